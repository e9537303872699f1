// The machinery every op shares: the conversions kernels compute through (bf16 in f32), the NumPy
// broadcast of shapes and its index maps, and reductions along one axis in a fixed order, with sum_to,
// the backward of broadcasting. Below the elementwise and reduction ops, which both use it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/math/functors.hpp"

TG_BEGIN_NAMESPACE
namespace detail {

template <Element T, Device D>
void check_defined(const Tensor<T, D>& t, const char* op) {
  TG_CHECK(t.defined(), op, "an input tensor is undefined (default-constructed)");
}

/// The NumPy broadcast of two shapes, or an error naming the op and both shapes.
inline Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const int rank = std::max(a.rank(), b.rank());
  std::int64_t dims[Shape::max_rank];
  for (int i = 0; i < rank; ++i) {
    const int ia = a.rank() - rank + i, ib = b.rank() - rank + i;
    const std::int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    TG_CHECK(da == db || da == 1 || db == 1, op, "shapes ", a.str(), " and ", b.str(),
             " cannot be broadcast together (axis ", i, " of the result: ", da, " vs ", db,
             "); dimensions must be equal or 1");
    dims[i] = da == 1 ? db : da;
  }
  return Shape(std::span<const std::int64_t>(dims, static_cast<std::size_t>(rank)));
}

/// Maps an index of the broadcast result to the offsets of N inputs (stride 0 along broadcast axes).
template <int N>
struct BroadcastIndex {
  int rank = 0;
  std::int64_t dims[Shape::max_rank] = {};
  std::int64_t strides[N][Shape::max_rank] = {};
  bool trivial[N] = {};  // input has the result's shape: offset == index
  // Input k, without its leading 1s, is the result's trailing dimensions (a bias, a position embedding, a
  // scalar): offset == index % period[k], one division instead of one per axis.
  std::int64_t period[N] = {};

  BroadcastIndex(const Shape& out, const Shape* in[N]) : rank(out.rank()) {
    for (int d = 0; d < rank; ++d) dims[d] = out[d];
    for (int k = 0; k < N; ++k) {
      trivial[k] = *in[k] == out;
      int lead = 0;
      while (lead < in[k]->rank() && (*in[k])[lead] == 1) ++lead;
      bool suffix = true;
      for (int d = lead; d < in[k]->rank() && suffix; ++d) suffix = (*in[k])[d] == out[rank - in[k]->rank() + d];
      period[k] = suffix ? in[k]->numel() : 0;
      std::int64_t stride = 1;
      for (int d = rank - 1; d >= 0; --d) {
        const int di = in[k]->rank() - rank + d;
        const std::int64_t n = di >= 0 ? (*in[k])[di] : 1;
        strides[k][d] = n == 1 ? 0 : stride;
        stride *= n;
      }
    }
  }

  TG_HD std::int64_t offset(int k, std::int64_t i) const {
    if (trivial[k]) return i;
    if (period[k] > 0) return i % period[k];
    std::int64_t off = 0;
    for (int d = rank - 1; d >= 0; --d) {
      const std::int64_t c = i % dims[d];
      i /= dims[d];
      off += c * strides[k][d];
    }
    return off;
  }
};

/// A tensor seen as (outer, n, inner) around the reduced axis.
struct AxisView {
  std::int64_t outer = 1, n = 1, inner = 1;
};

inline AxisView axis_view(const Shape& s, int axis) {
  AxisView v;
  for (int d = 0; d < axis; ++d) v.outer *= s[d];
  v.n = s[axis];
  for (int d = axis + 1; d < s.rank(); ++d) v.inner *= s[d];
  return v;
}

/// The shape after reducing `axis` (kept as 1 with keepdims).
inline Shape reduced_shape(const Shape& s, int axis, bool keepdims) {
  std::vector<std::int64_t> dims;
  for (int d = 0; d < s.rank(); ++d) {
    if (d != axis) dims.push_back(s[d]);
    else if (keepdims) dims.push_back(1);
  }
  return Shape(dims);
}

/// The identity of max: -inf for floating types, the minimum for integers. (std::numeric_limits is
/// host-only under nvcc, so the values are spelled out.)
template <class C> TG_HD C lowest() {
  if constexpr (std::is_floating_point_v<C>) return -static_cast<C>(INFINITY);
  else if constexpr (std::is_signed_v<C>) return static_cast<C>(C(1) << (sizeof(C) * 8 - 1));
  else return C(0);
}

struct SumReducer {
  template <class C> TG_HD C init() const { return C(0); }
  template <class C> TG_HD C step(C acc, C x) const { return acc + x; }
  template <class C> TG_HD C finish(C acc, std::int64_t) const { return acc; }
};
struct MeanReducer : SumReducer {
  template <class C> TG_HD C finish(C acc, std::int64_t n) const { return acc / C(n); }
};
/// The sum of squares (tg::global_norm's batching rule).
struct SumSquaresReducer : SumReducer {
  template <class C> TG_HD C step(C acc, C x) const { return acc + x * x; }
};
struct MaxReducer {
  template <class C> TG_HD C init() const { return lowest<C>(); }
  template <class C> TG_HD C step(C acc, C x) const { return (x > acc || math::isnan(x)) && !math::isnan(acc) ? x : acc; }
  template <class C> TG_HD C finish(C acc, std::int64_t) const { return acc; }
};

/// y[o] = reduce over k of x[outer(o), k, inner(o)], in index order.
template <class R, class TIn, class TOut>
struct ReduceAxisFn {
  const TIn* x;
  TOut* y;
  std::int64_t n, inner;
  R r;
  TG_HD void operator()(std::int64_t o) const {
    using C = compute_t<TIn>;
    const TIn* base = x + (o / inner) * n * inner + o % inner;
    C acc = r.template init<C>();
    for (std::int64_t k = 0; k < n; ++k) acc = r.step(acc, convert_from<C>(base[k * inner]));
    y[o] = convert_to<TOut>(r.finish(acc, n));
  }
};

/// ReduceAxisFn for a CPU and inner > 1 (column sums, bias gradients): item j reduces the `width` outputs
/// starting at column (j % chunks) * width of outer row j / chunks, walking the reduced rows in order
/// with the columns innermost, so the loads are contiguous and vectorise. Each output is the same
/// sequence of steps as in ReduceAxisFn: the results are bitwise equal.
template <class R, class TIn, class TOut>
struct ReduceColumnsFn {
  static constexpr std::int64_t width = 64;
  const TIn* x;
  TOut* y;
  std::int64_t n, inner, chunks;
  R r;
  void operator()(std::int64_t j) const {
    using C = compute_t<TIn>;
    const std::int64_t outer = j / chunks, first = (j % chunks) * width;
    const std::int64_t w = inner - first < width ? inner - first : width;
    const TIn* base = x + outer * n * inner + first;
    C acc[width];
    for (std::int64_t c = 0; c < w; ++c) acc[c] = r.template init<C>();
    for (std::int64_t k = 0; k < n; ++k) {
      const TIn* row = base + k * inner;
      for (std::int64_t c = 0; c < w; ++c) acc[c] = r.step(acc[c], convert_from<C>(row[c]));
    }
    TOut* out = y + outer * inner + first;
    for (std::int64_t c = 0; c < w; ++c) out[c] = convert_to<TOut>(r.finish(acc[c], n));
  }
};

/// Reduces `x` along `axis` with reducer R, writing TOut.
template <class R, Element TOut, Element T, Device D>
Tensor<TOut, D> reduce_axis(const Tensor<T, D>& x, int axis, bool keepdims, const char* op) {
  check_defined(x, op);
  const int a = x.shape().normalize_axis(axis, op);
  const AxisView v = axis_view(x.shape(), a);
  Tensor<TOut, D> y(reduced_shape(x.shape(), a, keepdims));
  const ReduceAxisFn<R, T, TOut> per_output{x.data(), y.data(), v.n, v.inner, R{}};
  if (v.inner > 1) {  // columns: the CPU reduces blocks of 64 adjacent ones per item (contiguous loads)
    using F = ReduceColumnsFn<R, T, TOut>;
    const std::int64_t chunks = (v.inner + F::width - 1) / F::width;
    index_map_per_device<D>(y.size() / v.inner * chunks, F{x.data(), y.data(), v.n, v.inner, chunks, R{}}, v.n * F::width, y.size(), per_output);
  } else {
    index_map<D>(y.size(), per_output, v.n);
  }
  return y;
}

/// Sums a cotangent of a broadcast result back to an input's shape (the backward of broadcasting):
/// leading axes summed away, axes of size 1 summed with keepdims.
template <Element T, Device D>
Tensor<T, D> sum_to(const Tensor<T, D>& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  Tensor<T, D> r = g.untraced();
  while (r.rank() > shape.rank()) r = reduce_axis<SumReducer, T>(r, 0, false, "sum_to");
  for (int d = 0; d < shape.rank(); ++d)
    if (shape[d] == 1 && r.dim(d) != 1) r = reduce_axis<SumReducer, T>(r, d, true, "sum_to");
  return r.reshape(shape);
}

}  // namespace detail
TG_END_NAMESPACE
