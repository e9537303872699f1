// Ops that move elements without arithmetic, under JAX's names: transpose / swapaxes, slice_in_dim,
// take, concatenate and stack. Each is one copy kernel (a TG_HD functor, so the CPU tests cover the
// GPU's indexing) and each backward rule is the adjoint copy, beside its forward.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/kernels.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

/// y[i] = x[offset of i]: the output's index decomposed over `dims`, each coordinate times the input
/// stride of that output axis (a transpose reads the input along permuted strides).
template <class T>
struct PermuteFn {
  const T* x;
  T* y;
  int rank = 0;
  std::int64_t dims[Shape::max_rank] = {};
  std::int64_t strides[Shape::max_rank] = {};
  /// The input offset of output element i.
  TG_HD std::int64_t source(std::int64_t i) const {
    std::int64_t off = 0;
    for (int d = rank - 1; d >= 0; --d) {
      off += (i % dims[d]) * strides[d];
      i /= dims[d];
    }
    return off;
  }
  TG_HD void operator()(std::int64_t i) const { y[i] = x[source(i)]; }
};

/// PermuteFn on the CPU: `rows` rows of the last output axis per item, the offset of the first computed
/// once and the others stepped to with an odometer over the outer axes (no divisions), each row copied
/// along its input stride (contiguous, so vectorised, when the last axis stays last).
template <class T>
struct PermuteRowsFn {
  static constexpr std::int64_t rows = 64;
  PermuteFn<T> f;
  std::int64_t total_rows;
  void operator()(std::int64_t item) const {
    const int last = f.rank - 1;
    const std::int64_t len = f.dims[last], step = f.strides[last];
    const std::int64_t first = item * rows, end = first + rows < total_rows ? first + rows : total_rows;
    std::int64_t coord[Shape::max_rank] = {};
    for (std::int64_t r = first, d = last - 1; d >= 0; --d) coord[d] = r % f.dims[d], r /= f.dims[d];
    std::int64_t off = f.source(first * len);
    for (std::int64_t row = first; row < end; ++row) {
      const T* __restrict src = f.x + off;
      T* __restrict dst = f.y + row * len;
      if (step == 1) {
        for (std::int64_t k = 0; k < len; ++k) dst[k] = src[k];
      } else {
        for (std::int64_t k = 0; k < len; ++k) dst[k] = src[k * step];
      }
      for (int d = last - 1; d >= 0; --d) {  // the next row: increment the odometer
        off += f.strides[d];
        if (++coord[d] < f.dims[d]) break;
        off -= f.strides[d] * f.dims[d];
        coord[d] = 0;
      }
    }
  }
};

/// Runs a copy functor over `size` output elements that come in rows of `inner` contiguous ones: on the
/// CPU a row per item (F::row), on CUDA an element per thread (F::operator()).
template <Device D, class F>
void rows_or_elements(std::int64_t size, std::int64_t inner, const F& f) {
  if (size == 0) return;
  if (inner > 1) index_map_per_device<D>(size / inner, [f, inner](std::int64_t r) { f.row(r, inner); }, inner, size, f);
  else index_map<D>(size, f);
}

/// Row-major strides of a shape.
inline std::vector<std::int64_t> strides_of(const Shape& s) {
  std::vector<std::int64_t> st(static_cast<std::size_t>(s.rank()));
  std::int64_t stride = 1;
  for (int d = s.rank() - 1; d >= 0; --d) st[static_cast<std::size_t>(d)] = stride, stride *= s[d];
  return st;
}

/// Checks that `perm` is a permutation of 0..rank-1 (negative entries count from the end) and returns it
/// normalised.
inline std::vector<int> normalize_perm(const Shape& s, std::span<const int> perm, const char* op) {
  TG_CHECK(static_cast<int>(perm.size()) == s.rank(), op, "perm has ", perm.size(), " axes but the input has shape ", s.str(),
           " (rank ", s.rank(), "); give one entry per axis");
  std::vector<int> p(perm.begin(), perm.end());
  std::vector<bool> seen(static_cast<std::size_t>(s.rank()), false);
  for (int& a : p) {
    a = s.normalize_axis(a, op);
    TG_CHECK(!seen[static_cast<std::size_t>(a)], op, "axis ", a, " appears twice in perm; perm must be a permutation of 0..",
             s.rank() - 1);
    seen[static_cast<std::size_t>(a)] = true;
  }
  return p;
}

/// y (outer, len, inner) = x (outer, n, inner) at positions start, start + step, ... along the middle axis.
template <class T>
struct SliceFn {
  const T* x;
  T* y;
  std::int64_t n, len, inner, start, step;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t in = i % inner, j = (i / inner) % len, o = i / (inner * len);
    y[i] = x[(o * n + start + j * step) * inner + in];
  }
  /// Elements [r inner, (r + 1) inner): one (o, j) row, a contiguous copy.
  void row(std::int64_t r, std::int64_t) const {
    const std::int64_t j = r % len, o = r / len;
    const T* __restrict src = x + (o * n + start + j * step) * inner;
    T* __restrict dst = y + r * inner;
    for (std::int64_t k = 0; k < inner; ++k) dst[k] = src[k];
  }
};

/// The adjoint of SliceFn: dx (outer, n, inner) holds dy where the slice read, zero elsewhere.
template <class T>
struct SliceBackwardFn {
  const T* dy;
  T* dx;
  std::int64_t n, len, inner, start, step;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t in = i % inner, k = (i / inner) % n, o = i / (inner * n);
    const std::int64_t rel = k - start;
    const bool hit = rel >= 0 && rel % step == 0 && rel / step < len;
    dx[i] = hit ? dy[(o * len + rel / step) * inner + in] : convert_to<T>(0.0f);
  }
  void row(std::int64_t r, std::int64_t) const {
    const std::int64_t k = r % n, o = r / n, rel = k - start;
    T* __restrict dst = dx + r * inner;
    if (rel >= 0 && rel % step == 0 && rel / step < len) {
      const T* __restrict src = dy + (o * len + rel / step) * inner;
      for (std::int64_t c = 0; c < inner; ++c) dst[c] = src[c];
    } else {
      for (std::int64_t c = 0; c < inner; ++c) dst[c] = convert_to<T>(0.0f);
    }
  }
};

/// An index of take() in [0, n): negative ones count from the end once, as NumPy; -1 when out of range.
TG_HD inline std::int64_t take_index(std::int32_t k, std::int64_t n) {
  const std::int64_t j = k < 0 ? k + n : k;
  return j >= 0 && j < n ? j : -1;
}

/// y (outer, m, inner) = x (outer, n, inner) at the m indices; an out-of-range index gives NaN, as
/// jnp.take's default mode "fill".
template <class T>
struct TakeFn {
  const T* x;
  const std::int32_t* idx;
  T* y;
  std::int64_t n, m, inner;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t in = i % inner, k = (i / inner) % m, o = i / (inner * m);
    const std::int64_t j = take_index(idx[k], n);
    y[i] = j >= 0 ? x[(o * n + j) * inner + in] : convert_to<T>(NAN);
  }
  void row(std::int64_t r, std::int64_t) const {
    const std::int64_t j = take_index(idx[r % m], n), o = r / m;
    T* __restrict dst = y + r * inner;
    if (j < 0) {
      for (std::int64_t c = 0; c < inner; ++c) dst[c] = convert_to<T>(NAN);
      return;
    }
    const T* __restrict src = x + (o * n + j) * inner;
    for (std::int64_t c = 0; c < inner; ++c) dst[c] = src[c];
  }
};

/// take's indices inverted, for its backward: the positions k in [0, m) grouped by the index j they read
/// (a stable counting sort, so k ascends within a group), as order[start[j] .. start[j + 1]); out-of-range
/// indices are left out. One item: a serial pass, O(m + n), the same on both devices. `work` holds start
/// (n + 1), then a cursor per j (n), then order (m).
struct TakeInverseFn {
  const std::int32_t* idx;
  std::int64_t n, m;
  std::int32_t* work;
  TG_HD void operator()(std::int64_t) const {
    std::int32_t* start = work;
    std::int32_t* cursor = work + n + 1;
    std::int32_t* order = work + 2 * n + 1;
    for (std::int64_t j = 0; j <= n; ++j) start[j] = 0;
    for (std::int64_t k = 0; k < m; ++k)
      if (const std::int64_t j = take_index(idx[k], n); j >= 0) ++start[j + 1];
    for (std::int64_t j = 0; j < n; ++j) start[j + 1] += start[j], cursor[j] = start[j];
    for (std::int64_t k = 0; k < m; ++k)
      if (const std::int64_t j = take_index(idx[k], n); j >= 0) order[cursor[j]++] = static_cast<std::int32_t>(k);
  }
};

/// The adjoint of TakeFn: dx[o, j, in] = sum of dy[o, k, in] over the k whose index is j, in k's order
/// (repeated indices add up; no atomics, so the sum is reproducible), each j reading only its own k
/// (TakeInverseFn): O(m inner + n inner) in all, where scanning every index for every j was O(n m inner).
template <class T>
struct TakeBackwardFn {
  const T* dy;
  const std::int32_t* work;  // TakeInverseFn's
  T* dx;
  std::int64_t n, m, inner;
  TG_HD void operator()(std::int64_t i) const {
    using C = compute_t<T>;
    const std::int64_t in = i % inner, j = (i / inner) % n, o = i / (inner * n);
    const std::int32_t* order = work + 2 * n + 1;
    C acc = C(0);
    for (std::int32_t p = work[j]; p < work[j + 1]; ++p) acc += convert_from<C>(dy[(o * m + order[p]) * inner + in]);
    dx[i] = convert_to<T>(acc);
  }
  /// Row (o, j) of dx: its contributions added in k's order, 64 columns at a time in the compute type.
  void row(std::int64_t r, std::int64_t) const {
    using C = compute_t<T>;
    const std::int64_t j = r % n, o = r / n;
    const std::int32_t* order = work + 2 * n + 1;
    constexpr std::int64_t width = 64;
    for (std::int64_t first = 0; first < inner; first += width) {
      const std::int64_t w = inner - first < width ? inner - first : width;
      C acc[width];
      for (std::int64_t c = 0; c < w; ++c) acc[c] = C(0);
      for (std::int32_t p = work[j]; p < work[j + 1]; ++p) {
        const T* __restrict src = dy + (o * m + order[p]) * inner + first;
        for (std::int64_t c = 0; c < w; ++c) acc[c] += convert_from<C>(src[c]);
      }
      T* __restrict dst = dx + r * inner + first;
      for (std::int64_t c = 0; c < w; ++c) dst[c] = convert_to<T>(acc[c]);
    }
  }
};

/// y (outer, total, inner) at [offset, offset + n) of the middle axis = x (outer, n, inner): one input of
/// a concatenation.
template <class T>
struct PlaceFn {
  const T* x;
  T* y;
  std::int64_t n, total, inner, offset;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t in = i % inner, j = (i / inner) % n, o = i / (inner * n);
    y[(o * total + offset + j) * inner + in] = x[i];
  }
  void row(std::int64_t r, std::int64_t) const {
    const std::int64_t j = r % n, o = r / n;
    const T* __restrict src = x + r * inner;
    T* __restrict dst = y + (o * total + offset + j) * inner;
    for (std::int64_t c = 0; c < inner; ++c) dst[c] = src[c];
  }
};

template <Element T, Device D>
Tensor<T, D> slice_impl(const Tensor<T, D>& x, std::int64_t start, std::int64_t len, std::int64_t step, int axis);

}  // namespace detail

/// x with its axes permuted, as jnp.transpose(x, perm): axis d of the result is axis perm[d] of x.
/// Negative entries count from the end. A copy; the cotangent is transposed back by the inverse permutation.
template <Element T, Device D>
Tensor<T, D> transpose(const Tensor<T, D>& x, std::span<const int> perm) {
  detail::check_defined(x, "transpose");
  const std::vector<int> p = detail::normalize_perm(x.shape(), perm, "transpose");
  if (detail::batched(x)) {  // batching rule: the batch axes stay in front
    const int nb = detail::batch_rank(x.batch_levels());
    std::vector<int> q(static_cast<std::size_t>(nb));
    for (int d = 0; d < nb; ++d) q[static_cast<std::size_t>(d)] = d;
    for (int d : p) q.push_back(d + nb);
    return detail::as_batched(transpose(x.physical(), std::span<const int>(q)), x.batch_levels());
  }
  const auto in_strides = detail::strides_of(x.shape());
  std::vector<std::int64_t> out_dims(p.size());
  detail::PermuteFn<T> f{};
  // Merge output axes that are adjacent in the input too (perm[d + 1] == perm[d] + 1): fewer divisions.
  for (std::size_t d = 0; d < p.size(); ++d) {
    out_dims[d] = x.shape()[p[d]];
    if (d > 0 && p[d] == p[d - 1] + 1 && f.rank > 0) {
      f.dims[f.rank - 1] *= out_dims[d];
      f.strides[f.rank - 1] = in_strides[static_cast<std::size_t>(p[d])];
      continue;
    }
    f.dims[f.rank] = out_dims[d];
    f.strides[f.rank] = in_strides[static_cast<std::size_t>(p[d])];
    ++f.rank;
  }
  Tensor<T, D> y{Shape(out_dims)};
  f.x = x.data(), f.y = y.data();
  if (y.size() > 0) {
    // The CPU copies rows of the last axis (R::rows per item), CUDA an element per thread.
    using R = detail::PermuteRowsFn<T>;
    const std::int64_t rows = y.size() / f.dims[f.rank - 1];
    detail::index_map_per_device<D>((rows + R::rows - 1) / R::rows, R{f, rows}, R::rows * f.dims[f.rank - 1], y.size(), f);
  }
  if constexpr (FloatElement<T>) {
    if (detail::recording(x)) {
      std::vector<int> inverse(p.size());
      for (std::size_t d = 0; d < p.size(); ++d) inverse[static_cast<std::size_t>(p[d])] = static_cast<int>(d);
      detail::record(y, {x.trace()}, [in = x.trace(), inverse](detail::Tape& t, const Tensor<T, D>& dy) {
        t.accumulate(in, transpose(dy, std::span<const int>(inverse)));
      }, [&](const detail::Tangents& tangent) {
        const Tensor<T, D> tx = tangent(x);
        return tx.defined() ? transpose(tx, p) : tx;
      }, "transpose");
    }
  }
  return y;
}

template <Element T, Device D>
Tensor<T, D> transpose(const Tensor<T, D>& x, std::initializer_list<int> perm) {
  return transpose(x, std::span<const int>(perm.begin(), perm.size()));
}

/// x with its axes reversed, as jnp.transpose(x) (x.T).
template <Element T, Device D>
Tensor<T, D> transpose(const Tensor<T, D>& x) {
  std::vector<int> perm(static_cast<std::size_t>(x.rank()));
  for (int d = 0; d < x.rank(); ++d) perm[static_cast<std::size_t>(d)] = x.rank() - 1 - d;
  return transpose(x, std::span<const int>(perm));
}

/// x with axes a and b exchanged, as jnp.swapaxes.
template <Element T, Device D>
Tensor<T, D> swapaxes(const Tensor<T, D>& x, int a, int b) {
  detail::check_defined(x, "swapaxes");
  a = x.shape().normalize_axis(a, "swapaxes"), b = x.shape().normalize_axis(b, "swapaxes");
  std::vector<int> perm(static_cast<std::size_t>(x.rank()));
  for (int d = 0; d < x.rank(); ++d) perm[static_cast<std::size_t>(d)] = d;
  std::swap(perm[static_cast<std::size_t>(a)], perm[static_cast<std::size_t>(b)]);
  return transpose(x, std::span<const int>(perm));
}

namespace detail {

template <Element T, Device D>
Tensor<T, D> slice_impl(const Tensor<T, D>& x, std::int64_t start, std::int64_t len, std::int64_t step, int axis);

/// A slice's cotangent placed back into zeros of the input's shape `s`: an op of its own (linear, its
/// cotangent the slice again), recorded when a backward pass records.
template <Element T, Device D>
Tensor<T, D> slice_transpose(const Tensor<T, D>& dy, const Shape& s, AxisView v, std::int64_t len, std::int64_t start, std::int64_t step, int axis) {
  Tensor<T, D> dx(s);
  rows_or_elements<D>(dx.size(), v.inner, SliceBackwardFn<T>{dy.data(), dx.data(), v.n, len, v.inner, start, step});
  if (recording(dy))
    record(dx, {dy.trace()}, [in = dy.trace(), len, start, step, axis](Tape& t, const Tensor<T, D>& g) { t.accumulate(in, slice_impl(g, start, len, step, axis)); },
           [&](const Tangents& tangent) {
             const Tensor<T, D> t = tangent(dy);
             return t.defined() ? slice_transpose(t, s, v, len, start, step, axis) : t;
           }, "slice_transpose");
  return dx;
}

template <Element T, Device D>
Tensor<T, D> slice_impl(const Tensor<T, D>& x, std::int64_t start, std::int64_t len, std::int64_t step, int axis) {
  if (batched(x))  // batching rule: the axis past the batch axes
    return as_batched(slice_impl(x.physical(), start, len, step, axis + batch_rank(x.batch_levels())), x.batch_levels());
  const AxisView v = axis_view(x.shape(), axis);
  std::vector<std::int64_t> dims(x.shape().dims().begin(), x.shape().dims().end());
  dims[static_cast<std::size_t>(axis)] = len;
  Tensor<T, D> y{Shape(dims)};
  rows_or_elements<D>(y.size(), v.inner, SliceFn<T>{x.data(), y.data(), v.n, len, v.inner, start, step});
  if constexpr (FloatElement<T>) {
    if (recording(x)) {
      record(y, {x.trace()}, [in = x.trace(), s = x.shape(), v, len, start, step, axis](Tape& t, const Tensor<T, D>& dy) {
        t.accumulate(in, slice_transpose(dy, s, v, len, start, step, axis));
      }, [&](const Tangents& tangent) {
        const Tensor<T, D> tx = tangent(x);
        return tx.defined() ? slice_impl(tx, start, len, step, axis) : tx;
      }, "slice");
    }
  }
  return y;
}

}  // namespace detail

/// Elements start, start + stride, ... below limit along `axis`, as jax.lax.slice_in_dim (negative start
/// and limit count from the end, as Python slices; both are clamped to the axis).
template <Element T, Device D>
Tensor<T, D> slice_in_dim(const Tensor<T, D>& x, std::int64_t start, std::int64_t limit, std::int64_t stride = 1, int axis = 0) {
  detail::check_defined(x, "slice_in_dim");
  const int a = x.shape().normalize_axis(axis, "slice_in_dim");
  TG_CHECK(stride >= 1, "slice_in_dim", "stride must be >= 1, got ", stride);
  const std::int64_t n = x.shape()[a];
  auto clamp = [n](std::int64_t i) { return std::min(std::max(i < 0 ? i + n : i, std::int64_t{0}), n); };
  const std::int64_t lo = clamp(start), hi = clamp(limit);
  const std::int64_t len = hi > lo ? (hi - lo + stride - 1) / stride : 0;
  return detail::slice_impl(x, lo, len, stride, a);
}

/// Element `index` along `axis`, that axis removed, as x[..., index, ...] (jnp indexing; negative counts
/// from the end).
template <Element T, Device D>
Tensor<T, D> index_in_dim(const Tensor<T, D>& x, std::int64_t index, int axis = 0) {
  detail::check_defined(x, "index_in_dim");
  const int a = x.shape().normalize_axis(axis, "index_in_dim");
  const std::int64_t n = x.shape()[a];
  TG_CHECK(index >= -n && index < n, "index_in_dim", "index ", index, " is out of range for axis ", a, " of shape ", x.shape().str());
  std::vector<std::int64_t> dims;
  for (int d = 0; d < x.rank(); ++d)
    if (d != a) dims.push_back(x.shape()[d]);
  return detail::slice_impl(x, index < 0 ? index + n : index, 1, 1, a).reshape(Shape(dims));
}

template <FloatElement T, Device D>
Tensor<T, D> take(const Tensor<T, D>& x, const Tensor<std::int32_t, D>& indices, int axis);

namespace detail {
/// take's batching rule. A batched x with shared indices takes along its axis past the batch axes; shared
/// x with batched indices takes once and moves the batch axes to the front; both batched fold the batch
/// into the taken axis (each example's indices offset to its own rows of x) and take once.
template <FloatElement T, Device D>
Tensor<T, D> take_batched(const Tensor<T, D>& x, const Tensor<std::int32_t, D>& indices, int a) {
  const std::uint32_t lv = levels_of(x, indices);
  const int nb = batch_rank(lv), ri = indices.rank(), rx = x.rank();
  if (!batched(indices)) return as_batched(take(x.physical(), indices, a + nb), lv);
  // The per-example result: x's axes before a, the indices' axes, x's axes after a.
  auto to_front = [&](const Tensor<T, D>& r, int batch_at) {  // r's nb batch axes, at batch_at, to the front
    if (batch_at == 0) return as_batched(r, lv);
    std::vector<int> q;
    for (int d = 0; d < nb; ++d) q.push_back(batch_at + d);
    for (int d = 0; d < r.rank(); ++d)
      if (d < batch_at || d >= batch_at + nb) q.push_back(d);
    return as_batched(transpose(r, std::span<const int>(q)), lv);
  };
  if (!batched(x)) return to_front(take(x, indices.physical(), a), a);
  const Tensor<T, D> xp = materialize(x, lv).physical();
  const Tensor<std::int32_t, D> ip = materialize(indices, lv).physical();
  std::int64_t bt = 1;
  for (int d = 0; d < nb; ++d) bt *= xp.dim(d);
  const std::int64_t n = x.dim(a);
  TG_CHECK(bt * n < (std::int64_t{1} << 30), "take", "a batch of ", bt, " examples of axes of ", n, " elements is too large to index");
  // x as (bt * n, x's other axes): each example's axis a first, its other axes after.
  std::vector<std::int64_t> bx{bt};
  bx.insert(bx.end(), x.shape().dims().begin(), x.shape().dims().end());
  std::vector<int> q{0, a + 1};
  std::vector<std::int64_t> rows{bt * n};
  for (int d = 0; d < rx; ++d)
    if (d != a) q.push_back(d + 1), rows.push_back(x.dim(d));
  const Tensor<T, D> xf = transpose(xp.reshape(Shape(bx)), std::span<const int>(q));
  // Indices in range move to their example's rows; negative ones count from the end first; out of range
  // ones stay out of range (NaN, as take's fill mode).
  const auto in = ip.reshape(Shape{bt, ip.size() / bt});
  const auto nn = full<std::int32_t, D>(Shape{}, static_cast<std::int32_t>(n));
  const auto wrapped = where(less(in, zeros<std::int32_t, D>(Shape{})), add(in, nn), in);
  const auto valid = mul(cast<std::int32_t>(greater_equal(wrapped, zeros<std::int32_t, D>(Shape{}))), cast<std::int32_t>(less(wrapped, nn)));
  const auto offset = mul(arange<std::int32_t, D>(bt).reshape(Shape{bt, 1}), nn);
  const auto out_of_range = full<std::int32_t, D>(Shape{}, static_cast<std::int32_t>(bt * n));
  const auto idx = where(cast<std::uint8_t>(valid), add(wrapped, offset), out_of_range);
  Tensor<T, D> r = take(xf.reshape(Shape(rows)), idx, 0);  // (bt, m, x's other axes)
  // To (batch..., x's axes before a, the indices' per-example axes, x's axes after a).
  std::vector<std::int64_t> bm{bt, ip.size() / bt};
  for (int d = 0; d < rx; ++d)
    if (d != a) bm.push_back(x.dim(d));
  r = r.reshape(Shape(bm));
  std::vector<int> back{0};
  for (int d = 0; d < a; ++d) back.push_back(2 + d);
  back.push_back(1);
  for (int d = a + 1; d < rx; ++d) back.push_back(1 + d);
  r = transpose(r, std::span<const int>(back));
  std::vector<std::int64_t> out(xp.shape().dims().begin(), xp.shape().dims().begin() + nb);
  for (int d = 0; d < a; ++d) out.push_back(x.dim(d));
  for (int d = 0; d < ri; ++d) out.push_back(indices.dim(d));
  for (int d = a + 1; d < rx; ++d) out.push_back(x.dim(d));
  return as_batched(r.reshape(Shape(out)), lv);
}
}  // namespace detail

template <FloatElement T, Device D>
Tensor<T, D> take(const Tensor<T, D>& x, const Tensor<std::int32_t, D>& indices, int axis);

namespace detail {
/// take's cotangent added back into zeros of the table's shape `s` (a scatter-add): an op of its own
/// (linear, its cotangent a take again), recorded when a backward pass records.
template <FloatElement T, Device D>
Tensor<T, D> take_transpose(const Tensor<T, D>& dy, const Shape& s, const Tensor<std::int32_t, D>& idx, AxisView v, std::int64_t m, int axis) {
  Tensor<T, D> dx(s);
  if (dx.size() > 0) {
    Tensor<std::int32_t, D> inverse(Shape{2 * v.n + 1 + m});
    index_map<D>(1, TakeInverseFn{idx.data(), v.n, m, inverse.data()}, m + v.n);
    rows_or_elements<D>(dx.size(), v.inner, TakeBackwardFn<T>{dy.data(), inverse.data(), dx.data(), v.n, m, v.inner});
  }
  if (recording(dy))
    record(dx, {dy.trace()}, [in = dy.trace(), idx, axis](Tape& t, const Tensor<T, D>& g) { t.accumulate(in, take(g, idx, axis)); },
           [&](const Tangents& tangent) {
             const Tensor<T, D> t = tangent(dy);
             return t.defined() ? take_transpose(t, s, idx, v, m, axis) : t;
           }, "take_transpose");
  return dx;
}
}  // namespace detail

/// x at `indices` (int32, any shape) along `axis`, as jnp.take(x, indices, axis): the result's shape is
/// x's with that axis replaced by the indices' shape. Negative indices count from the end; an index out
/// of range gives NaN (jnp.take's default mode "fill"). Repeated indices add their cotangents.
template <FloatElement T, Device D>
Tensor<T, D> take(const Tensor<T, D>& x, const Tensor<std::int32_t, D>& indices, int axis) {
  detail::check_defined(x, "take");
  detail::check_defined(indices, "take");
  const int a = x.shape().normalize_axis(axis, "take");
  if (detail::batched(x, indices)) return detail::take_batched(x, indices, a);
  const detail::AxisView v = detail::axis_view(x.shape(), a);
  std::vector<std::int64_t> dims(x.shape().dims().begin(), x.shape().dims().begin() + a);
  dims.insert(dims.end(), indices.shape().dims().begin(), indices.shape().dims().end());
  dims.insert(dims.end(), x.shape().dims().begin() + a + 1, x.shape().dims().end());
  TG_CHECK(dims.size() <= static_cast<std::size_t>(Shape::max_rank), "take", "the result of taking indices of shape ",
           indices.shape().str(), " from ", x.shape().str(), " would have rank ", dims.size(), " (at most ", Shape::max_rank, ")");
  const std::int64_t m = indices.size();
  TG_CHECK(m < (std::int64_t{1} << 31) && v.n < (std::int64_t{1} << 30), "take", "at most 2^31 - 1 indices into an axis of at most 2^30 "
           "elements, got ", m, " indices into ", v.n);
  Tensor<T, D> y{Shape(dims)};
  detail::rows_or_elements<D>(y.size(), v.inner, detail::TakeFn<T>{x.data(), indices.data(), y.data(), v.n, m, v.inner});
  if (detail::recording(x)) {
    detail::record(y, {x.trace()}, [in = x.trace(), s = x.shape(), idx = indices, v, m, a](detail::Tape& t, const Tensor<T, D>& dy) {
      t.accumulate(in, detail::take_transpose(dy, s, idx, v, m, a));
    }, [&](const detail::Tangents& tangent) {
      const Tensor<T, D> tx = tangent(x);
      return tx.defined() ? take(tx, indices, a) : tx;
    }, "take");
  }
  return y;
}

/// The tensors joined along an existing `axis`, as jnp.concatenate: all of one rank, equal except along
/// `axis`. The cotangent splits back into slices.
template <Element T, Device D>
Tensor<T, D> concatenate(std::span<const Tensor<T, D>> xs, int axis = 0) {
  TG_CHECK(!xs.empty(), "concatenate", "needs at least one tensor");
  for (const auto& x : xs) detail::check_defined(x, "concatenate");
  std::uint32_t lv = 0;
  for (const auto& x : xs) lv |= x.batch_levels();
  if (lv) {  // batching rule: every operand carries every batch axis; the axis moves past them
    const int a = xs[0].shape().normalize_axis(axis, "concatenate");
    std::vector<Tensor<T, D>> ps;
    for (const auto& x : xs) {
      TG_CHECK(x.rank() == xs[0].rank(), "concatenate", "tensors of shapes ", xs[0].shape().str(), " and ", x.shape().str(),
               " have different ranks");
      ps.push_back(detail::materialize(x, lv).physical());
    }
    return detail::as_batched(concatenate(std::span<const Tensor<T, D>>(ps), a + detail::batch_rank(lv)), lv);
  }
  const Shape& first = xs[0].shape();
  const int a = first.normalize_axis(axis, "concatenate");
  std::int64_t total = 0;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    const Shape& s = xs[k].shape();
    bool same = s.rank() == first.rank();
    for (int d = 0; same && d < s.rank(); ++d) same = d == a || s[d] == first[d];
    TG_CHECK(same, "concatenate", "tensor ", k, " has shape ", s.str(), " but tensor 0 has ", first.str(),
             "; all must have one rank and equal sizes except along axis ", a);
    total += s[a];
  }
  std::vector<std::int64_t> dims(first.dims().begin(), first.dims().end());
  dims[static_cast<std::size_t>(a)] = total;
  Tensor<T, D> y{Shape(dims)};
  std::vector<std::int64_t> offsets;
  std::int64_t offset = 0;
  for (const auto& x : xs) {
    const detail::AxisView v = detail::axis_view(x.shape(), a);
    detail::rows_or_elements<D>(x.size(), v.inner, detail::PlaceFn<T>{x.data(), y.data(), v.n, total, v.inner, offset});
    offsets.push_back(offset);
    offset += v.n;
  }
  if constexpr (FloatElement<T>) {
    bool traced = false;
    for (const auto& x : xs) traced = traced || detail::recording(x);
    if (traced) {
      std::vector<detail::Trace> ins;
      std::vector<std::int64_t> lens;
      for (const auto& x : xs) {
        detail::active_tape->use(x.trace());
        ins.push_back(x.trace());
        lens.push_back(x.shape()[a]);
      }
      detail::record(y, {}, [ins, lens, offsets, a](detail::Tape& t, const Tensor<T, D>& dy) {
        for (std::size_t k = 0; k < ins.size(); ++k)
          if (t.owns(ins[k])) t.accumulate(ins[k], detail::slice_impl(dy, offsets[k], lens[k], 1, a));
      }, [&](const detail::Tangents& tangent) -> Tensor<T, D> {
        std::vector<Tensor<T, D>> ts;
        bool any = false;
        for (const auto& x : xs) {
          Tensor<T, D> t = tangent(x);
          any = any || t.defined();
          ts.push_back(t.defined() ? t : zeros<T, D>(x.shape()));
        }
        return any ? concatenate(std::span<const Tensor<T, D>>(ts), a) : Tensor<T, D>{};
      }, "concatenate");
    }
  }
  return y;
}

template <Element T, Device D>
Tensor<T, D> concatenate(std::initializer_list<Tensor<T, D>> xs, int axis = 0) {
  return concatenate(std::span<const Tensor<T, D>>(xs.begin(), xs.size()), axis);
}

/// The tensors (all of one shape) joined along a new `axis`, as jnp.stack.
template <Element T, Device D>
Tensor<T, D> stack(std::span<const Tensor<T, D>> xs, int axis = 0) {
  TG_CHECK(!xs.empty(), "stack", "needs at least one tensor");
  detail::check_defined(xs[0], "stack");
  const Shape& s = xs[0].shape();
  TG_CHECK(axis >= -(s.rank() + 1) && axis <= s.rank(), "stack", "axis ", axis, " is out of range for stacking tensors of shape ",
           s.str(), " (the result has rank ", s.rank() + 1, ")");
  const int a = axis < 0 ? axis + s.rank() + 1 : axis;
  std::vector<std::int64_t> dims(s.dims().begin(), s.dims().end());
  dims.insert(dims.begin() + a, 1);
  std::vector<Tensor<T, D>> expanded;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    detail::check_defined(xs[k], "stack");
    TG_CHECK(xs[k].shape() == s, "stack", "tensor ", k, " has shape ", xs[k].shape().str(), " but tensor 0 has ", s.str(),
             "; stacked tensors must have one shape");
    expanded.push_back(xs[k].reshape(Shape(dims)));
  }
  return concatenate(std::span<const Tensor<T, D>>(expanded), a);
}

template <Element T, Device D>
Tensor<T, D> stack(std::initializer_list<Tensor<T, D>> xs, int axis = 0) {
  return stack(std::span<const Tensor<T, D>>(xs.begin(), xs.size()), axis);
}

TG_END_NAMESPACE
