// Reductions (sum, mean, max, argmax, logsumexp) over one axis or everything, and softmax / log_softmax
// over the last axis. Every output element is reduced by one thread in index order, and whole-tensor
// reductions go through fixed chunks, so results are bitwise reproducible on the CPU (any thread count)
// and on CUDA (no float atomics).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/elementwise.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

/// The maximum of n elements x[0], x[stride], ... and the sum of exp(x - max): the stable core of
/// logsumexp, softmax and the softmax cross-entropy.
template <class T>
struct MaxSumExp {
  compute_t<T> max, sum;
};

template <class T>
TG_HD MaxSumExp<T> max_sum_exp(const T* x, std::int64_t n, std::int64_t stride) {
  using C = compute_t<T>;
  C m = lowest<C>();
  for (std::int64_t k = 0; k < n; ++k) m = MaxReducer{}.step(m, convert_from<C>(x[k * stride]));
  C s = C(0);
  for (std::int64_t k = 0; k < n; ++k) s += math::exp(convert_from<C>(x[k * stride]) - m);
  return {m, s};
}

/// First index of the maximum along the axis (NaN counts as the maximum, as NumPy).
template <class TIn>
struct ArgmaxAxisFn {
  const TIn* x;
  std::int32_t* y;
  std::int64_t n, inner;
  TG_HD void operator()(std::int64_t o) const {
    using C = compute_t<TIn>;
    const TIn* base = x + (o / inner) * n * inner + o % inner;
    C best = convert_from<C>(base[0]);
    std::int64_t at = 0;
    for (std::int64_t k = 1; k < n && !math::isnan(best); ++k) {
      const C v = convert_from<C>(base[k * inner]);
      if (v > best || math::isnan(v)) best = v, at = k;
    }
    y[o] = static_cast<std::int32_t>(at);
  }
};

/// log(sum(exp(x))) along the axis, shifted by the maximum so it cannot overflow.
template <class TIn, class TOut>
struct LogSumExpAxisFn {
  const TIn* x;
  TOut* y;
  std::int64_t n, inner;
  TG_HD void operator()(std::int64_t o) const {
    using C = compute_t<TIn>;
    const TIn* base = x + (o / inner) * n * inner + o % inner;
    const auto [m, s] = max_sum_exp(base, n, inner);
    // All -inf, an inf, or NaN: the max is the answer.
    y[o] = convert_to<TOut>(m > lowest<C>() && m < -lowest<C>() ? m + math::log(s) : m);
  }
};

/// softmax (or log_softmax) of each row of a (rows, n) tensor.
template <class T, bool Log>
struct SoftmaxRowFn {
  const T* x;
  T* y;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<T>;
    const T* xr = x + row * n;
    T* yr = y + row * n;
    if constexpr (Log) {
      const auto [m, s] = max_sum_exp(xr, n, 1);
      const C lse = math::log(s);
      for (std::int64_t k = 0; k < n; ++k) yr[k] = convert_to<T>(convert_from<C>(xr[k]) - m - lse);
    } else {
      // One exp per element: exp(x - max) summed as it is computed (the order max_sum_exp sums in), kept
      // in y when T is the compute type, recomputed (identically) otherwise.
      C m = lowest<C>();
      for (std::int64_t k = 0; k < n; ++k) m = MaxReducer{}.step(m, convert_from<C>(xr[k]));
      C s = C(0);
      for (std::int64_t k = 0; k < n; ++k) {
        const C e = math::exp(convert_from<C>(xr[k]) - m);
        s += e;
        if constexpr (std::is_same_v<T, C>) yr[k] = e;
      }
      const C inv = C(1) / s;
      for (std::int64_t k = 0; k < n; ++k) {
        if constexpr (std::is_same_v<T, C>) yr[k] = yr[k] * inv;
        else yr[k] = convert_to<T>(math::exp(convert_from<C>(xr[k]) - m) * inv);
      }
    }
  }
};

/// The backward of softmax (log_softmax) for each row of (rows, n), from its output y: dx = y (dy - sum(dy y))
/// (log: dx = dy - exp(y) sum(dy)), in one pass over the row.
template <class T, bool Log>
struct SoftmaxBackwardRowFn {
  const T* y;
  const T* dy;
  T* dx;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<T>;
    const T* yr = y + row * n;
    const T* gr = dy + row * n;
    T* out = dx + row * n;
    C s = C(0);
    for (std::int64_t k = 0; k < n; ++k) s += Log ? convert_from<C>(gr[k]) : convert_from<C>(gr[k]) * convert_from<C>(yr[k]);
    for (std::int64_t k = 0; k < n; ++k) {
      const C yk = convert_from<C>(yr[k]), g = convert_from<C>(gr[k]);
      out[k] = convert_to<T>(Log ? g - math::exp(yk) * s : yk * (g - s));
    }
  }
};

/// The JVP of softmax (log_softmax) for each row, from its output y: ty = y (tx - sum(y tx)) (log: ty =
/// tx - sum(exp(y) tx)), in one pass over the row.
template <class T, bool Log>
struct SoftmaxJvpRowFn {
  const T* y;
  const T* tx;
  T* ty;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<T>;
    const T* yr = y + row * n;
    const T* tr = tx + row * n;
    T* out = ty + row * n;
    C s = C(0);
    for (std::int64_t k = 0; k < n; ++k) s += (Log ? math::exp(convert_from<C>(yr[k])) : convert_from<C>(yr[k])) * convert_from<C>(tr[k]);
    for (std::int64_t k = 0; k < n; ++k) {
      const C t = convert_from<C>(tr[k]);
      out[k] = convert_to<T>(Log ? t - s : convert_from<C>(yr[k]) * (t - s));
    }
  }
};

template <class T, bool Log, class D>
Tensor<T, D> softmax_backward(const Tensor<T, D>& y, const Tensor<T, D>& dy) {
  const std::int64_t n = y.dim(-1);
  Tensor<T, D> dx(y.shape());
  if (n > 0) index_map<D>(y.size() / n, SoftmaxBackwardRowFn<T, Log>{y.data(), dy.data(), dx.data(), n}, (Log ? 16 : 4) * n);
  return dx;
}

/// Chunk size for whole-tensor reductions: partial results of fixed chunks, then of the partials. Short
/// enough that a GPU thread's serial loop is brief (a 4,096-element chunk made the mean of 8,192 losses a
/// 165 µs kernel on an H200), the same on both devices so they sum in the same order.
inline constexpr std::int64_t reduce_chunk = 256;

/// Item i: chunk i % chunks of row i / chunks of x (rows of n elements; the last chunk of a row shorter)
/// reduced with R, in index order.
template <class R, class TIn, class TOut>
struct RowChunkFn {
  const TIn* x;
  TOut* y;
  std::int64_t n, chunks, chunk;
  R r;
  TG_HD void operator()(std::int64_t i) const {
    using C = compute_t<TIn>;
    const std::int64_t row = i / chunks, begin = (i % chunks) * chunk;
    const std::int64_t len = n - begin < chunk ? n - begin : chunk;
    const TIn* base = x + row * n + begin;
    C acc = r.template init<C>();
    for (std::int64_t k = 0; k < len; ++k) acc = r.step(acc, convert_from<C>(base[k]));
    y[i] = convert_to<TOut>(r.finish(acc, len));
  }
};

/// Each row of a (rows, n) tensor reduced with R into (rows,) of the compute type: fixed chunks reduced in
/// order, then the chunks' results, recursively, combined with Rest (the sum, for a sum of squares). A
/// whole tensor is one row (reduce_all); a batch of examples is a row each (the whole-tensor reductions'
/// batching rule), so a batched sum equals the per-example sums bit for bit.
template <class R, class Rest = R, Element T, Device D>
Tensor<compute_t<T>, D> reduce_rows_as_all(const Tensor<T, D>& x, const char* op) {
  using C = compute_t<T>;
  check_defined(x, op);
  const std::int64_t rows = x.dim(0), n = x.dim(1);
  if (n <= reduce_chunk) return reduce_axis<R, C>(x, 1, false, op);
  const std::int64_t chunks = (n + reduce_chunk - 1) / reduce_chunk;
  Tensor<C, D> partial(Shape{rows, chunks});
  index_map<D>(rows * chunks, RowChunkFn<R, T, C>{x.data(), partial.data(), n, chunks, reduce_chunk, R{}}, reduce_chunk);
  return reduce_rows_as_all<Rest>(partial, op);
}

/// Every element reduced with R into a (1,) tensor of the compute type.
template <class R, Element T, Device D>
Tensor<compute_t<T>, D> reduce_all(const Tensor<T, D>& x, const char* op) {
  check_defined(x, op);
  return reduce_rows_as_all<R>(x.untraced().reshape(Shape{1, x.size()}), op);
}

/// The cotangent of a reduction over `axis`, expanded back to the input's shape.
template <Element T, Device D>
Tensor<T, D> expand_reduced(const Tensor<T, D>& dy, const Shape& input, int axis) {
  return broadcast_to(dy.reshape(reduced_shape(input, axis, true)), input);
}

}  // namespace detail

/// Sum along `axis` (negative counts from the end); keepdims keeps it as size 1.
template <Element T, Device D>
Tensor<T, D> sum(const Tensor<T, D>& x, int axis, bool keepdims = false) {
  if (detail::batched(x))  // batching rule: the axis past the batch axes
    return detail::as_batched(sum(x.physical(), detail::physical_axis(x.batch_levels(), x.shape(), axis, "sum"), keepdims), x.batch_levels());
  Tensor<T, D> y = detail::reduce_axis<detail::SumReducer, T>(x, axis, keepdims, "sum");
  if constexpr (FloatElement<T>) {
    if (detail::recording(x)) {
      const int a = x.shape().normalize_axis(axis, "sum");
      detail::record(y, {x.trace()}, [in = x.trace(), s = x.shape(), a](detail::Tape& t, const Tensor<T, D>& dy) {
        t.accumulate(in, detail::expand_reduced(dy, s, a));
      }, [&](const detail::Tangents& tangent) {
        const Tensor<T, D> tx = tangent(x);
        return tx.defined() ? sum(tx, a, keepdims) : tx;
      }, "sum");
    }
  }
  return y;
}

/// Mean along `axis`.
template <FloatElement T, Device D>
Tensor<T, D> mean(const Tensor<T, D>& x, int axis, bool keepdims = false) {
  if (detail::batched(x))  // batching rule: the axis past the batch axes
    return detail::as_batched(mean(x.physical(), detail::physical_axis(x.batch_levels(), x.shape(), axis, "mean"), keepdims), x.batch_levels());
  Tensor<T, D> y = detail::reduce_axis<detail::MeanReducer, T>(x, axis, keepdims, "mean");
  if (detail::recording(x)) {
    const int a = x.shape().normalize_axis(axis, "mean");
    detail::record(y, {x.trace()}, [in = x.trace(), s = x.shape(), a](detail::Tape& t, const Tensor<T, D>& dy) {
      t.accumulate(in, mul(detail::expand_reduced(dy, s, a), 1.0 / static_cast<double>(s[a])));
    }, [&](const detail::Tangents& tangent) {
      const Tensor<T, D> tx = tangent(x);
      return tx.defined() ? mean(tx, a, keepdims) : tx;
    }, "mean");
  }
  return y;
}

namespace detail {
/// The cotangent of a max: to the elements equal to the maximum, shared evenly among ties (as JAX).
template <Element T, Device D>
Tensor<T, D> max_backward(const Tensor<T, D>& x, const Tensor<T, D>& y_expanded, const Tensor<T, D>& dy_expanded,
                          const Tensor<T, D>& count_expanded) {
  const auto mask = cast<T>(equal(x, y_expanded));
  return div(mul(dy_expanded, mask), count_expanded);
}
}  // namespace detail

namespace detail {
/// The tangent of a max (JAX's rule): the tangents at the elements equal to the maximum, averaged over
/// ties. `ye`: the maximum expanded to x's shape; `reduce` sums along the reduced axes.
template <Element T, Device D, class Reduce>
Tensor<T, D> max_jvp(const Tensor<T, D>& x, const Tensor<T, D>& ye, const Tensor<T, D>& tx, Reduce reduce) {
  const auto at = cast<T>(equal(x.untraced(), ye.untraced()));
  return div(reduce(mul(tx, at)), reduce(at));
}
}  // namespace detail

/// Maximum along `axis` (NaN propagates).
template <Element T, Device D>
Tensor<T, D> max(const Tensor<T, D>& x, int axis, bool keepdims = false) {
  if (detail::batched(x))  // batching rule: the axis past the batch axes
    return detail::as_batched(max(x.physical(), detail::physical_axis(x.batch_levels(), x.shape(), axis, "max"), keepdims), x.batch_levels());
  TG_CHECK(x.dim(axis) > 0, "max", "cannot take the maximum over an empty axis of shape ", x.shape().str());
  Tensor<T, D> y = detail::reduce_axis<detail::MaxReducer, T>(x, axis, keepdims, "max");
  if constexpr (FloatElement<T>) {
    if (detail::recording(x)) {
      const int a = x.shape().normalize_axis(axis, "max");
      detail::record(y, {x.trace()}, [in = x.trace(), x0 = x.untraced(), y0 = y.untraced(), a](detail::Tape& t, const Tensor<T, D>& dy) {
        const auto ye = detail::expand_reduced(y0, x0.shape(), a);
        const auto count = detail::expand_reduced(sum(cast<T>(equal(x0, ye)), a), x0.shape(), a);
        t.accumulate(in, detail::max_backward(x0, ye, detail::expand_reduced(dy, x0.shape(), a), count));
      }, [&](const detail::Tangents& tangent) {
        const Tensor<T, D> tx = tangent(x);
        if (!tx.defined()) return tx;
        return detail::max_jvp(x, detail::expand_reduced(y, x.shape(), a), tx, [&](const Tensor<T, D>& v) { return sum(v, a, keepdims); });
      }, "max");
    }
  }
  return y;
}

/// Index (int32) of the first maximum along `axis`.
template <Element T, Device D>
Tensor<std::int32_t, D> argmax(const Tensor<T, D>& x, int axis, bool keepdims = false) {
  if (detail::batched(x))  // batching rule: the axis past the batch axes
    return detail::as_batched(argmax(x.physical(), detail::physical_axis(x.batch_levels(), x.shape(), axis, "argmax"), keepdims), x.batch_levels());
  detail::check_defined(x, "argmax");
  const int a = x.shape().normalize_axis(axis, "argmax");
  TG_CHECK(x.shape()[a] > 0, "argmax", "cannot take argmax over an empty axis of shape ", x.shape().str());
  const detail::AxisView v = detail::axis_view(x.shape(), a);
  Tensor<std::int32_t, D> y(detail::reduced_shape(x.shape(), a, keepdims));
  detail::index_map<D>(y.size(), detail::ArgmaxAxisFn<T>{x.data(), y.data(), v.n, v.inner});
  return y;
}

/// log(sum(exp(x))) along `axis`, numerically stable.
template <FloatElement T, Device D>
Tensor<T, D> logsumexp(const Tensor<T, D>& x, int axis, bool keepdims = false) {
  if (detail::batched(x))  // batching rule: the axis past the batch axes
    return detail::as_batched(logsumexp(x.physical(), detail::physical_axis(x.batch_levels(), x.shape(), axis, "logsumexp"), keepdims), x.batch_levels());
  detail::check_defined(x, "logsumexp");
  const int a = x.shape().normalize_axis(axis, "logsumexp");
  const detail::AxisView v = detail::axis_view(x.shape(), a);
  Tensor<T, D> y(detail::reduced_shape(x.shape(), a, keepdims));
  detail::index_map<D>(y.size(), detail::LogSumExpAxisFn<T, T>{x.data(), y.data(), v.n, v.inner});
  if (detail::recording(x)) {
    // d logsumexp / dx = softmax(x) along the axis.
    detail::record_with_output(y, {x.trace()}, [in = x.trace(), x, a](detail::Tape& t, const Tensor<T, D>& dy, const Tensor<T, D>& y) {
      const auto p = exp(sub(x, detail::expand_reduced(y, x.shape(), a)));
      t.accumulate(in, mul(detail::expand_reduced(dy, x.shape(), a), p));
    }, [&](const detail::Tangents& tangent) {
      const Tensor<T, D> tx = tangent(x);
      if (!tx.defined()) return tx;
      return sum(mul(exp(sub(x, y.reshape(detail::reduced_shape(x.shape(), a, true)))), tx), a, keepdims);  // softmax . tx
    }, "logsumexp");
  }
  return y;
}

namespace detail {
/// The batching rule of sum(x) and mean(x): each example's elements reduced as reduce_all reduces them
/// (so the results equal the per-example ones bit for bit), times `scale`; the cotangent spreads back.
template <Element T, Device D>
Tensor<T, D> batched_sum_all(const Tensor<T, D>& x, double scale, const char* op) {
  const std::uint32_t lv = x.batch_levels();
  const Tensor<T, D> p = x.physical();
  const std::vector<std::int64_t> bd = batch_dims(lv);
  std::int64_t rows = 1;
  for (std::int64_t b : bd) rows *= b;
  const std::int64_t n = x.size();
  const auto total = reduce_rows_as_all<SumReducer>(p.untraced().reshape(Shape{rows, n}), op);
  Tensor<T, D> y = cast<T>(scale == 1.0 ? total : mul(total, scale)).reshape(Shape(bd));
  if constexpr (FloatElement<T>) {
    if (recording(p)) {
      record(y, {p.trace()}, [in = p.trace(), s = p.shape(), nb = batch_rank(lv), scale](Tape& t, const Tensor<T, D>& dy) {
        std::vector<std::int64_t> d(s.dims().begin(), s.dims().begin() + nb);
        d.resize(static_cast<std::size_t>(s.rank()), 1);
        const Tensor<T, D> g = broadcast_to(dy.reshape(Shape(d)), s);
        t.accumulate(in, scale == 1.0 ? g : mul(g, scale));
      }, [&](const Tangents& tangent) {  // linear: the same sums of the tangent
        const Tensor<T, D> tp = tangent(p);
        return tp.defined() ? batched_sum_all(as_batched(tp, lv), scale, op).physical() : tp;
      }, op);
    }
  }
  return as_batched(y, lv);
}
}  // namespace detail

/// Sum of all elements, as a 0-d tensor (accumulated in the compute type, in a fixed order).
template <Element T, Device D>
Tensor<T, D> sum(const Tensor<T, D>& x) {
  if (detail::batched(x)) return detail::batched_sum_all(x, 1.0, "sum");  // batching rule
  Tensor<T, D> y = cast<T>(detail::reduce_all<detail::SumReducer>(x, "sum").reshape(Shape{}));
  if constexpr (FloatElement<T>) {
    if (detail::recording(x)) {
      detail::record(y, {x.trace()}, [in = x.trace(), s = x.shape()](detail::Tape& t, const Tensor<T, D>& dy) {
        t.accumulate(in, broadcast_to(dy, s));
      }, [&](const detail::Tangents& tangent) {
        const Tensor<T, D> tx = tangent(x);
        return tx.defined() ? sum(tx) : tx;
      }, "sum");
    }
  }
  return y;
}

/// Mean of all elements, as a 0-d tensor.
template <FloatElement T, Device D>
Tensor<T, D> mean(const Tensor<T, D>& x) {
  if (detail::batched(x)) {  // batching rule
    TG_CHECK(x.size() > 0, "mean", "the mean of an empty tensor is undefined (shape ", x.shape().str(), ")");
    return detail::batched_sum_all(x, 1.0 / static_cast<double>(x.size()), "mean");
  }
  TG_CHECK(x.size() > 0, "mean", "the mean of an empty tensor is undefined (shape ", x.shape().str(), ")");
  const auto total = detail::reduce_all<detail::SumReducer>(x, "mean");
  Tensor<T, D> y = cast<T>(mul(total.reshape(Shape{}), 1.0 / static_cast<double>(x.size())));
  if (detail::recording(x)) {
    detail::record(y, {x.trace()}, [in = x.trace(), s = x.shape()](detail::Tape& t, const Tensor<T, D>& dy) {
      t.accumulate(in, mul(broadcast_to(dy, s), 1.0 / static_cast<double>(s.numel())));
    }, [&](const detail::Tangents& tangent) {
      const Tensor<T, D> tx = tangent(x);
      return tx.defined() ? mean(tx) : tx;
    }, "mean");
  }
  return y;
}

/// Maximum of all elements, as a 0-d tensor.
template <Element T, Device D>
Tensor<T, D> max(const Tensor<T, D>& x) {
  TG_CHECK(x.size() > 0, "max", "cannot take the maximum of an empty tensor");
  if (detail::batched(x)) return max(x.reshape({-1}), 0);  // batching rule: max over the flattened example
  Tensor<T, D> y = cast<T>(detail::reduce_all<detail::MaxReducer>(x, "max").reshape(Shape{}));
  if constexpr (FloatElement<T>) {
    if (detail::recording(x)) {
      detail::record(y, {x.trace()}, [in = x.trace(), x0 = x.untraced(), y0 = y.untraced()](detail::Tape& t, const Tensor<T, D>& dy) {
        const auto ye = broadcast_to(y0, x0.shape());
        const auto count = broadcast_to(sum(cast<T>(equal(x0, ye))), x0.shape());
        t.accumulate(in, detail::max_backward(x0, ye, broadcast_to(dy, x0.shape()), count));
      }, [&](const detail::Tangents& tangent) {
        const Tensor<T, D> tx = tangent(x);
        if (!tx.defined()) return tx;
        return detail::max_jvp(x, broadcast_to(y, x.shape()), tx, [](const Tensor<T, D>& v) { return sum(v); });
      }, "max");
    }
  }
  return y;
}

/// Index (int32) of the first maximum of the flattened tensor, as a 0-d tensor.
template <Element T, Device D>
Tensor<std::int32_t, D> argmax(const Tensor<T, D>& x) {
  if (detail::batched(x)) return argmax(x.untraced().reshape({-1}), 0);  // batching rule, as max's
  return argmax(x.untraced().reshape({-1}), 0).reshape(Shape{});
}

namespace detail {
/// softmax (Log: log_softmax) over the last axis: one row per item forward, one kernel backward.
template <bool Log, FloatElement T, Device D>
Tensor<T, D> softmax_over_rows(const Tensor<T, D>& x, const char* op) {
  if (batched(x)) return as_batched(softmax_over_rows<Log>(x.physical(), op), x.batch_levels());  // batching rule: rows
  check_defined(x, op);
  TG_CHECK(x.rank() >= 1, op, "needs at least one axis, got a scalar");
  const std::int64_t n = x.dim(-1);
  Tensor<T, D> y(x.shape());
  index_map<D>(n ? x.size() / n : 0, SoftmaxRowFn<T, Log>{x.data(), y.data(), n}, 16 * n);
  if (recording(x)) {
    // softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - softmax(x) * sum(dy); along the last axis.
    record_with_output(y, {x.trace()}, [in = x.trace()](Tape& t, const Tensor<T, D>& dy, const Tensor<T, D>& y) {
      if (!t.records()) return t.accumulate(in, softmax_backward<T, Log>(y.untraced(), dy));
      // Higher order: the same formulas in traced ops (log_softmax's softmax is exp(y)).
      const int last = y.rank() - 1;
      if constexpr (Log) t.accumulate(in, sub(dy, mul(exp(y), broadcast_to(sum(dy, last, true), y.shape()))));
      else t.accumulate(in, mul(y, sub(dy, broadcast_to(sum(mul(dy, y), last, true), y.shape()))));
    }, [&](const Tangents& tangent) {
      // softmax: ty = y (tx - sum(y tx)); log_softmax: ty = tx - sum(softmax tx); along the last axis.
      const Tensor<T, D> tx = tangent(x);
      if (!tx.defined()) return tx;
      if (active_tape == nullptr) {  // nothing differentiates the rule: one pass per row
        Tensor<T, D> ty(y.shape());
        if (n > 0) index_map<D>(y.size() / n, SoftmaxJvpRowFn<T, Log>{y.data(), tx.data(), ty.data(), n}, (Log ? 16 : 4) * n);
        return ty;
      }
      const int last = y.rank() - 1;
      if constexpr (Log) return sub(tx, sum(mul(exp(y), tx), last, true));  // (..., 1) broadcasts along the row
      else return mul(y, sub(tx, sum(mul(y, tx), last, true)));
    }, op);
  }
  return y;
}
}  // namespace detail

/// softmax over the last axis: exp(x - max) / sum(exp(x - max)).
template <FloatElement T, Device D>
Tensor<T, D> softmax(const Tensor<T, D>& x) {
  return detail::softmax_over_rows<false>(x, "softmax");
}

/// log_softmax over the last axis: x - max - log(sum(exp(x - max))).
template <FloatElement T, Device D>
Tensor<T, D> log_softmax(const Tensor<T, D>& x) {
  return detail::softmax_over_rows<true>(x, "log_softmax");
}

TG_END_NAMESPACE
