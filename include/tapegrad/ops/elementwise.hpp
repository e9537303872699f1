// Elementwise ops with NumPy broadcasting: unary math, binary arithmetic, scalar overloads, comparisons,
// where and cast. Each runs a functor from math/functors.hpp through the device's index loop.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/eltwise.hpp"
#include "tapegrad/core/batching.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/math/activation.hpp"
#include "tapegrad/math/functors.hpp"
#include "tapegrad/ops/kernels.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

template <class Op, class TIn, class TOut>
struct UnaryFn {
  const TIn* x;
  TOut* y;
  Op op;
  TG_HD void operator()(std::int64_t i) const {
    y[i] = convert_to<TOut>(op(convert_from<compute_t<TIn>>(x[i])));
  }
};

/// op(x, s) or op(s, x) with a scalar s, computed in x's compute type. s * x and x / s are linear in x
/// (piecewise linear, their slope a constant multiplier); s / x is not.
template <class Op, bool ScalarOnLeft>
struct WithScalar {
  static constexpr bool piecewise_linear =
      fn::piecewise_linear<Op> || std::is_same_v<Op, fn::Mul> || (std::is_same_v<Op, fn::Div> && !ScalarOnLeft);
  static constexpr bool selects = fn::piecewise_linear<Op>;
  Op op;
  double s;
  template <class C> TG_HD auto operator()(C x) const {
    if constexpr (ScalarOnLeft) return op(C(s), x);
    else return op(x, C(s));
  }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V& y) const {
    if constexpr (ScalarOnLeft) return op.derivative_b(math::k<V>(s), x, y);
    else return op.derivative_a(x, math::k<V>(s), y);
  }
};

/// dx = dy * op'(x) elementwise (fn::backward).
template <class Op, class T>
struct UnaryBackwardFn {
  const T* x;
  const T* y;
  const T* dy;
  T* dx;
  Op op;
  TG_HD void operator()(std::int64_t i) const {
    using C = compute_t<T>;
    dx[i] = convert_to<T>(fn::backward(op, convert_from<C>(x[i]), convert_from<C>(y[i]), convert_from<C>(dy[i])));
  }
};

/// The cotangent of one side of a broadcast binary op, at the result's shape (summed back by sum_to).
template <class Op, class T, bool SideA>
struct BinaryBackwardFn {
  const T* a;
  const T* b;
  const T* y;
  const T* dy;
  T* out;
  Op op;
  BroadcastIndex<2> index;
  TG_HD void operator()(std::int64_t i) const {
    using C = compute_t<T>;
    const C av = convert_from<C>(a[index.offset(0, i)]), bv = convert_from<C>(b[index.offset(1, i)]);
    const C yv = convert_from<C>(y[i]), g = convert_from<C>(dy[i]);
    out[i] = convert_to<T>(fn::backward2<SideA>(op, av, bv, yv, g));
  }
};

/// y[i] = x[broadcast offset of i]: x expanded to a larger shape.
template <class T>
struct BroadcastCopyFn {
  const T* x;
  T* y;
  BroadcastIndex<1> index;
  TG_HD void operator()(std::int64_t i) const { y[i] = x[index.offset(0, i)]; }
};

/// BroadcastCopyFn of one element (a scalar's cotangent spread over a tensor, as sum's backward): a fill
/// from device memory, which vectorises.
template <class T>
struct BroadcastScalarFn {
  const T* x;
  T* y;
  TG_HD void operator()(std::int64_t i) const { y[i] = x[0]; }
};

/// A functor with a derivative, or (a user's, first order only) a backward(x, y, dy).
template <class Op, class C>
concept UnaryDifferentiable = fn::HasDerivative<Op, C> || requires(const Op op, C x) { op.backward(x, x, x); };
template <class Op, class C>
concept BinaryDifferentiable = fn::HasBinaryDerivative<Op, C> || requires(const Op op, C x) { op.backward_a(x, x, x, x); };

template <class Op, class TIn, class TOut>
struct BinaryFn {
  const TIn* a;
  const TIn* b;
  TOut* y;
  Op op;
  BroadcastIndex<2> index;
  TG_HD void operator()(std::int64_t i) const {
    using C = compute_t<TIn>;
    y[i] = convert_to<TOut>(op(convert_from<C>(a[index.offset(0, i)]), convert_from<C>(b[index.offset(1, i)])));
  }
};

/// BinaryFn for inputs of the result's shape: plain indexing, which vectorises.
template <class Op, class TIn, class TOut>
struct SameShapeBinaryFn {
  const TIn* a;
  const TIn* b;
  TOut* y;
  Op op;
  TG_HD void operator()(std::int64_t i) const {
    using C = compute_t<TIn>;
    y[i] = convert_to<TOut>(op(convert_from<C>(a[i]), convert_from<C>(b[i])));
  }
};

/// How an operand of a broadcast binary op is read along the result viewed as rows of its last axis:
/// offset = row * row_stride + k * col_stride (each 0 or the operand's row length), or not expressible
/// that way (the generic BroadcastIndex path).
struct RowPattern {
  bool ok = false;
  std::int64_t row_stride = 0, col_stride = 0;
};

/// The operand's pattern against the result `out` (rank >= 1): the whole result (n, 1), a row vector of the
/// last axis (0, 1: a bias), a column of per-row values (1, 0: the (..., 1) statistics of a row
/// reduction) or a scalar (0, 0).
inline RowPattern row_pattern(const Shape& in, const Shape& out) {
  const std::int64_t n = out[out.rank() - 1];
  if (in == out) return {true, n, 1};
  if (in.numel() == 1) return {true, 0, 0};
  int lead = 0;
  while (lead < in.rank() && in[lead] == 1) ++lead;
  if (lead == in.rank() - 1 && in[in.rank() - 1] == n) return {true, 0, 1};
  if (in.rank() == out.rank() && in[in.rank() - 1] == 1) {
    for (int d = 0; d < in.rank() - 1; ++d)
      if (in[d] != out[d]) return {};
    return {true, 1, 0};
  }
  return {};
}

/// BinaryFn for operands read by row patterns: a row of the result per item, its inner loop unit-stride
/// or constant in each operand, which vectorises (the generic path computes each offset axis by axis).
template <class Op, class TIn, class TOut>
struct BinaryRowsFn {
  const TIn* a;
  const TIn* b;
  TOut* y;
  Op op;
  RowPattern pa, pb;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<TIn>;
    const TIn* ar = a + row * pa.row_stride;
    const TIn* br = b + row * pb.row_stride;
    TOut* yr = y + row * n;
    const std::int64_t sa = pa.col_stride, sb = pb.col_stride;
    for (std::int64_t k = 0; k < n; ++k) yr[k] = convert_to<TOut>(op(convert_from<C>(ar[k * sa]), convert_from<C>(br[k * sb])));
  }
};

template <class T>
struct SelectFn {
  const std::uint8_t* cond;
  const T* a;
  const T* b;
  T* y;
  BroadcastIndex<3> index;
  TG_HD void operator()(std::int64_t i) const {
    y[i] = cond[index.offset(0, i)] ? a[index.offset(1, i)] : b[index.offset(2, i)];
  }
};

}  // namespace detail

template <Element T, Device D>
Tensor<T, D> broadcast_to(const Tensor<T, D>& x, const Shape& shape);

namespace detail {

template <class Op, class T, class D>
Tensor<T, D> traced_derivative(const Op& op, const Tensor<T, D>& x, const Tensor<T, D>& y, const char* name);
template <bool SideA, class Op, class T, class D>
Tensor<T, D> traced_derivative2(const Op& op, const Tensor<T, D>& a, const Tensor<T, D>& b, const Tensor<T, D>& y, const char* name);
template <class Op, class T, class D>
Tensor<T, D> unary_jvp(const Op& op, const Tensor<T, D>& x, const Tensor<T, D>& y, const Tensor<T, D>& tx, const char* name);
template <class Op, class T, class D>
Tensor<T, D> binary_jvp(const Op& op, const Tensor<T, D>& a, const Tensor<T, D>& b, const Tensor<T, D>& y, const Tensor<T, D>& ta,
                        const Tensor<T, D>& tb, const BroadcastIndex<2>& index, const char* name);

/// sum_to (a broadcast's cotangent summed back to an input's shape) as an op: recorded when `g` is
/// traced, its own cotangent broadcast again, so a recording backward pass can be differentiated.
template <Element T, Device D>
Tensor<T, D> reduce_to(const Tensor<T, D>& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  Tensor<T, D> r = sum_to(g, shape);
  if constexpr (FloatElement<T>) {
    if (recording(g))
      record(r, {g.trace()}, [in = g.trace(), s = g.shape()](Tape& t, const Tensor<T, D>& dy) { t.accumulate(in, broadcast_to(dy, s)); },
             [&](const Tangents& tangent) {
               const Tensor<T, D> tg = tangent(g);
               return tg.defined() ? reduce_to(tg, shape) : tg;
             }, "sum_to");
  }
  return r;
}

/// y = op(x) on n elements: a vendor kernel where the backend has one (backend/eltwise.hpp), else the functor.
template <class Op, class T, class D>
void unary_forward(std::int64_t n, const T* x, T* y, Op op) {
  if (!backend::unary<Op, T, D>(n, x, y)) index_map<D>(n, UnaryFn<Op, T, T>{x, y, op});
}

/// dx = dy * op'(x) on n elements (y = op(x) is given for ops whose derivative reads it).
template <class Op, class T, class D>
void unary_backward(std::int64_t n, const T* x, const T* y, const T* dy, T* dx, Op op) {
  if (!backend::unary_backward<Op, T, D>(n, x, dy, dx)) index_map<D>(n, UnaryBackwardFn<Op, T>{x, y, dy, dx, op});
}

}  // namespace detail

namespace detail {
/// map and map2 on unbatched tensors (their batching rules call these: a rule that called its own op
/// again would read, to g++'s -Winfinite-recursion, as endless where a CUDA launch is a stub that throws).
template <class Op, class Out, Element T, Device D>
auto map_unbatched(const Tensor<T, D>& x, Op op, const char* name) -> Tensor<std::conditional_t<std::is_void_v<Out>, T, Out>, D> {
  check_defined(x, name);
  if constexpr (!std::is_void_v<Out> && !std::is_same_v<Out, T>) {
    Tensor<Out, D> y(x.shape());
    detail::index_map<D>(y.size(), detail::UnaryFn<Op, T, Out>{x.data(), y.data(), op});
    return y;
  } else {
    Tensor<T, D> y(x.shape());
    detail::unary_forward<Op, T, D>(x.size(), x.data(), y.data(), op);
    if constexpr (FloatElement<T> && detail::UnaryDifferentiable<Op, compute_t<T>>) {
      if (detail::recording(x)) {
        detail::record_with_output(y, {x.trace()}, [in = x.trace(), x, op, name](detail::Tape& t, const Tensor<T, D>& dy, const Tensor<T, D>& y) {
          if (t.records()) return t.accumulate(in, dy * detail::traced_derivative(op, x, y, name));  // higher order: traced
          Tensor<T, D> dx(x.shape());
          detail::unary_backward<Op, T, D>(x.size(), x.data(), y.data(), dy.data(), dx.data(), op);
          t.accumulate(in, dx);
        }, [&](const detail::Tangents& tangent) { return detail::unary_jvp(op, x, y, tangent(x), name); }, name);
      }
    }
    return y;
  }
}

template <class Op, class Out, Element T, Device D>
auto map2_unbatched(const Tensor<T, D>& a, const Tensor<T, D>& b, Op op, const char* name)
    -> Tensor<std::conditional_t<std::is_void_v<Out>, T, Out>, D> {
  using R = std::conditional_t<std::is_void_v<Out>, T, Out>;
  detail::check_defined(a, name);
  detail::check_defined(b, name);
  const Shape out = detail::broadcast_shapes(a.shape(), b.shape(), name);
  const Shape* in[2] = {&a.shape(), &b.shape()};
  const detail::BroadcastIndex<2> index(out, in);
  Tensor<R, D> y(out);
  const detail::RowPattern pa = out.rank() ? detail::row_pattern(a.shape(), out) : detail::RowPattern{};
  const detail::RowPattern pb = out.rank() ? detail::row_pattern(b.shape(), out) : detail::RowPattern{};
  const std::int64_t n = out.rank() ? out[out.rank() - 1] : 1;
  if (index.trivial[0] && index.trivial[1]) detail::index_map<D>(y.size(), detail::SameShapeBinaryFn<Op, T, R>{a.data(), b.data(), y.data(), op});
  else if (detail::few_long_items<D> && pa.ok && pb.ok && n >= 8)  // the CPU: a row per item (a GPU keeps a thread per element)
    detail::index_map<D>(y.size() / n, detail::BinaryRowsFn<Op, T, R>{a.data(), b.data(), y.data(), op, pa, pb, n}, n);
  else detail::index_map<D>(y.size(), detail::BinaryFn<Op, T, R>{a.data(), b.data(), y.data(), op, index});
  if constexpr (std::is_same_v<R, T> && FloatElement<T> && detail::BinaryDifferentiable<Op, compute_t<T>>) {
    if (detail::recording(a, b)) {
      detail::record_with_output(y, {a.trace(), b.trace()}, [ta = a.trace(), tb = b.trace(), a, b, op, index, name](
                                                                 detail::Tape& t, const Tensor<T, D>& dy, const Tensor<T, D>& y) {
        if (t.records()) {  // higher order: traced (dy has the result's shape, so each product has it too)
          if (t.owns(ta)) t.accumulate(ta, detail::reduce_to(dy * detail::traced_derivative2<true>(op, a, b, y, name), a.shape()));
          if (t.owns(tb)) t.accumulate(tb, detail::reduce_to(dy * detail::traced_derivative2<false>(op, a, b, y, name), b.shape()));
          return;
        }
        auto side = [&](auto side_a) {
          Tensor<T, D> g(y.shape());
          detail::index_map<D>(g.size(), detail::BinaryBackwardFn<Op, T, decltype(side_a)::value>{a.data(), b.data(), y.data(), dy.data(),
                                                                                                  g.data(), op, index});
          return g;
        };
        if (t.owns(ta)) t.accumulate(ta, detail::sum_to(side(std::true_type{}), a.shape()));
        if (t.owns(tb)) t.accumulate(tb, detail::sum_to(side(std::false_type{}), b.shape()));
      }, [&](const detail::Tangents& tangent) { return detail::binary_jvp(op, a, b, y, tangent(a), tangent(b), index, name); }, name);
    }
  }
  return y;
}
}  // namespace detail

/// y = op(x) elementwise, for an op functor of math/functors.hpp (or your own TG_HD functor). Out is the
/// result element type: the input's by default (map<Op, double>(counts, op) gives doubles; only a
/// same-type map is differentiable).
template <class Op, class Out = void, Element T, Device D>
auto map(const Tensor<T, D>& x, Op op = {}, const char* name = "map") -> Tensor<std::conditional_t<std::is_void_v<Out>, T, Out>, D> {
  if (detail::batched(x)) return detail::as_batched(detail::map_unbatched<Op, Out>(x.physical(), op, name), x.batch_levels());  // batching rule
  return detail::map_unbatched<Op, Out>(x, op, name);
}

/// y = op(a, b) with NumPy broadcasting; Out is the result element type (uint8 for comparisons).
template <class Op, class Out = void, Element T, Device D>
auto map2(const Tensor<T, D>& a, const Tensor<T, D>& b, Op op = {}, const char* name = "map2")
    -> Tensor<std::conditional_t<std::is_void_v<Out>, T, Out>, D> {
  if (detail::batched(a, b)) {  // batching rule: each example's operands line up by broadcasting
    const std::uint32_t lv = detail::levels_of(a, b);
    const int r = std::max(a.rank(), b.rank());
    return detail::as_batched(detail::map2_unbatched<Op, Out>(detail::aligned(a, lv, r), detail::aligned(b, lv, r), op, name), lv);
  }
  return detail::map2_unbatched<Op, Out>(a, b, op, name);
}

#define TG_UNARY_OP(name, Functor)                                                   \
  template <FloatElement T, Device D>                                                \
  Tensor<T, D> name(const Tensor<T, D>& x) { return map(x, fn::Functor{}, #name); }

TG_UNARY_OP(exp, Exp)
TG_UNARY_OP(log, Log)
TG_UNARY_OP(tanh, Tanh)
TG_UNARY_OP(sigmoid, Sigmoid)
#define TG_ACTIVATION_OP(name, Functor) TG_UNARY_OP(name, Functor)
TG_ACTIVATIONS(TG_ACTIVATION_OP)  // relu, gelu, gelu_exact, ...: one op per row of math/activation.hpp
#undef TG_ACTIVATION_OP
TG_UNARY_OP(sin, Sin)
TG_UNARY_OP(cos, Cos)
TG_UNARY_OP(erf, Erf)
TG_UNARY_OP(square, Square)
TG_UNARY_OP(sqrt, Sqrt)
TG_UNARY_OP(rsqrt, Rsqrt)
TG_UNARY_OP(abs, Abs)
TG_UNARY_OP(neg, Neg)
#undef TG_UNARY_OP

/// x limited to [lo, hi] elementwise (jnp.clip with scalar bounds).
template <FloatElement T, Device D>
Tensor<T, D> clip(const Tensor<T, D>& x, double lo, double hi) {
  TG_CHECK(lo <= hi, "clip", "needs lo <= hi, got [", lo, ", ", hi, "]");
  return map(x, fn::Clip{lo, hi}, "clip");
}

/// x^p for a scalar exponent.
template <FloatElement T, Device D>
Tensor<T, D> pow(const Tensor<T, D>& x, double p) { return map(x, fn::PowScalar{p}, "pow"); }

#define TG_BINARY_OP(name, Functor, Constraint)                                                        \
  template <Constraint T, Device D>                                                                    \
  Tensor<T, D> name(const Tensor<T, D>& a, const Tensor<T, D>& b) { return map2(a, b, fn::Functor{}, #name); } \
  template <Constraint T, Device D, class S>                                                           \
    requires std::is_arithmetic_v<S>                                                                   \
  Tensor<T, D> name(const Tensor<T, D>& a, S s) {                                                      \
    return map(a, detail::WithScalar<fn::Functor, false>{{}, static_cast<double>(s)}, #name);          \
  }                                                                                                    \
  template <Constraint T, Device D, class S>                                                           \
    requires std::is_arithmetic_v<S>                                                                   \
  Tensor<T, D> name(S s, const Tensor<T, D>& b) {                                                      \
    return map(b, detail::WithScalar<fn::Functor, true>{{}, static_cast<double>(s)}, #name);           \
  }

TG_BINARY_OP(add, Add, Element)
TG_BINARY_OP(sub, Sub, Element)
TG_BINARY_OP(mul, Mul, Element)
TG_BINARY_OP(div, Div, FloatElement)
TG_BINARY_OP(maximum, Maximum, Element)
TG_BINARY_OP(minimum, Minimum, Element)
#undef TG_BINARY_OP

namespace detail {

/// f'(x) of a piecewise-linear functor as a value: its slope, a constant of x wherever it exists, which a
/// traced backward pass multiplies by.
template <class Op>
struct SlopeFn {
  Op op;
  template <class C> TG_HD C operator()(C x) const { return op.derivative(x, op(x)); }
};
template <class Op, bool SideA>
struct BinarySlopeFn {
  Op op;
  template <class C> TG_HD C operator()(C a, C b) const {
    return SideA ? C(op.derivative_a(a, b, op(a, b))) : C(op.derivative_b(a, b, op(a, b)));
  }
};

/// f'(x) of y = op(x) as a traced tensor (a recording backward pass multiplies dy by it): the slope of a
/// piecewise-linear functor as a constant, else the functor's generic derivative compiled for tensors (the
/// same expression its kernel runs). A functor with neither (a user's with backward only) cannot be
/// differentiated twice: an error naming the op.
template <class Op, class T, class D>
Tensor<T, D> traced_derivative(const Op& op, const Tensor<T, D>& x, const Tensor<T, D>& y, const char* name) {
  if constexpr (fn::piecewise_linear<Op>) {
    return map_unbatched<SlopeFn<Op>, void>(x.untraced(), SlopeFn<Op>{op}, name);
  } else if constexpr (fn::HasDerivative<Op, Tensor<T, D>>) {
    return op.derivative(x, y);
  } else {
    fail(name, "has no higher-order derivative: its functor ", typeid(Op).name(),
         " gives backward(x, y, dy) only; give it a generic derivative(x, y) (docs/ops.md, \"Adding an op\"), or wrap the op in tg::custom_jvp with a rule made of ops");
  }
}

/// df/da (SideA) or df/db of y = op(a, b) as a traced tensor of the result's shape.
template <bool SideA, class Op, class T, class D>
Tensor<T, D> traced_derivative2(const Op& op, const Tensor<T, D>& a, const Tensor<T, D>& b, const Tensor<T, D>& y, const char* name) {
  if constexpr (fn::piecewise_linear<Op>) {
    return map2_unbatched<BinarySlopeFn<Op, SideA>, void>(a.untraced(), b.untraced(), BinarySlopeFn<Op, SideA>{op}, name);
  } else if constexpr (fn::HasBinaryDerivative<Op, Tensor<T, D>>) {
    return SideA ? op.derivative_a(a, b, y) : op.derivative_b(a, b, y);  // of an operand's shape or the result's: dy broadcasts
  } else {
    fail(name, "has no higher-order derivative: its functor ", typeid(Op).name(), " gives backward_a / backward_b only; use tg::custom_jvp for it");
  }
}

/// The JVP rule of y = op(x): ty = f'(x) tx. Where nothing differentiates the rule (the innermost
/// forward pass alone), the backward kernel with the tangent for the cotangent (one fused pass: the same
/// arithmetic as the backward pass); else with ops, f'(x) traced.
template <class Op, class T, class D>
Tensor<T, D> unary_jvp(const Op& op, const Tensor<T, D>& x, const Tensor<T, D>& y, const Tensor<T, D>& tx, const char* name) {
  if (!tx.defined()) return {};
  if (active_tape == nullptr) {
    Tensor<T, D> ty(x.shape());
    unary_backward<Op, T, D>(x.size(), x.data(), y.data(), tx.data(), ty.data(), op);
    return ty;
  }
  return tx * traced_derivative(op, x, y, name);
}

/// The JVP rule of y = op(a, b) (broadcast): ty = df/da ta + df/db tb, each term as unary_jvp computes
/// it; add, sub, mul and div as their products with the operands (broadcast by the ops themselves: no
/// copy of a tangent to the result's shape unless the result needs it).
template <class Op, class T, class D>
Tensor<T, D> binary_jvp(const Op& op, const Tensor<T, D>& a, const Tensor<T, D>& b, const Tensor<T, D>& y, const Tensor<T, D>& ta,
                        const Tensor<T, D>& tb, const BroadcastIndex<2>& index, const char* name) {
  if (!ta.defined() && !tb.defined()) return {};
  auto full = [&](const Tensor<T, D>& t) { return t.shape() == y.shape() ? t : broadcast_to(t, y.shape()); };
  if constexpr (std::is_same_v<Op, fn::Add> || std::is_same_v<Op, fn::Sub>) {
    if (!tb.defined()) return full(ta);
    const Tensor<T, D> sb = std::is_same_v<Op, fn::Sub> ? neg(tb) : tb;
    return ta.defined() ? full(add(ta, sb)) : full(sb);
  } else if constexpr (std::is_same_v<Op, fn::Mul>) {  // ta b + a tb
    Tensor<T, D> r = ta.defined() ? mul(ta, b) : Tensor<T, D>{};
    if (tb.defined()) r = r.defined() ? add(r, mul(a, tb)) : mul(a, tb);
    return full(r);
  } else if constexpr (std::is_same_v<Op, fn::Div>) {  // (ta - tb y) / b
    const Tensor<T, D> num = !tb.defined() ? ta : ta.defined() ? sub(ta, mul(tb, y)) : neg(mul(tb, y));
    return full(div(num, b));
  } else {
    auto term = [&](const Tensor<T, D>& t, auto side_a) -> Tensor<T, D> {
      if (active_tape == nullptr) {
        const Tensor<T, D> g = full(t);
        Tensor<T, D> out(y.shape());
        index_map<D>(out.size(), BinaryBackwardFn<Op, T, decltype(side_a)::value>{a.data(), b.data(), y.data(), g.data(), out.data(), op, index});
        return out;
      }
      return full(t * traced_derivative2<decltype(side_a)::value>(op, a, b, y, name));
    };
    Tensor<T, D> r;
    if (ta.defined()) r = term(ta, std::true_type{});
    if (tb.defined()) r = r.defined() ? add(r, term(tb, std::false_type{})) : term(tb, std::false_type{});
    return r;
  }
}

/// The tape's sum of two cotangents of one value (declared by core/tape.hpp): add.
template <Element T, Device D>
struct AddCotangents {
  Tensor<T, D> operator()(const Tensor<T, D>& a, const Tensor<T, D>& b) const { return add(a, b); }
};
}  // namespace detail

template <Element T, Device D> Tensor<T, D> operator+(const Tensor<T, D>& a, const Tensor<T, D>& b) { return add(a, b); }
template <Element T, Device D> Tensor<T, D> operator-(const Tensor<T, D>& a, const Tensor<T, D>& b) { return sub(a, b); }
template <Element T, Device D> Tensor<T, D> operator*(const Tensor<T, D>& a, const Tensor<T, D>& b) { return mul(a, b); }
template <FloatElement T, Device D> Tensor<T, D> operator/(const Tensor<T, D>& a, const Tensor<T, D>& b) { return div(a, b); }
template <FloatElement T, Device D> Tensor<T, D> operator-(const Tensor<T, D>& x) { return neg(x); }

#define TG_SCALAR_OPERATOR(sym, name, Constraint)                                                  \
  template <Constraint T, Device D, class S>                                                       \
    requires std::is_arithmetic_v<S>                                                               \
  Tensor<T, D> operator sym(const Tensor<T, D>& a, S s) { return name(a, s); }                     \
  template <Constraint T, Device D, class S>                                                       \
    requires std::is_arithmetic_v<S>                                                               \
  Tensor<T, D> operator sym(S s, const Tensor<T, D>& b) { return name(s, b); }

TG_SCALAR_OPERATOR(+, add, Element)
TG_SCALAR_OPERATOR(-, sub, Element)
TG_SCALAR_OPERATOR(*, mul, Element)
TG_SCALAR_OPERATOR(/, div, FloatElement)
#undef TG_SCALAR_OPERATOR

#define TG_COMPARE_OP(name, Functor)                                                                  \
  template <Element T, Device D>                                                                      \
  Tensor<std::uint8_t, D> name(const Tensor<T, D>& a, const Tensor<T, D>& b) {                        \
    return map2<fn::Functor, std::uint8_t>(a, b, fn::Functor{}, #name);                               \
  }

/// Comparisons give uint8 masks (1 where true): less(a, b) is a < b elementwise, with broadcasting.
TG_COMPARE_OP(less, Less)
TG_COMPARE_OP(less_equal, LessEqual)
TG_COMPARE_OP(greater, Greater)
TG_COMPARE_OP(greater_equal, GreaterEqual)
TG_COMPARE_OP(equal, Equal)
TG_COMPARE_OP(not_equal, NotEqual)
#undef TG_COMPARE_OP

/// a where cond is non-zero, else b; all three broadcast together.
template <Element T, Device D>
Tensor<T, D> where(const Tensor<std::uint8_t, D>& cond, const Tensor<T, D>& a, const Tensor<T, D>& b) {
  if (detail::batched(cond, a, b)) {  // batching rule: as map2's
    const std::uint32_t lv = detail::levels_of(cond, a, b);
    const int r = std::max({cond.rank(), a.rank(), b.rank()});
    return detail::as_batched(where(detail::aligned(cond, lv, r), detail::aligned(a, lv, r), detail::aligned(b, lv, r)), lv);
  }
  detail::check_defined(cond, "where");
  detail::check_defined(a, "where");
  detail::check_defined(b, "where");
  const Shape out = detail::broadcast_shapes(cond.shape(), detail::broadcast_shapes(a.shape(), b.shape(), "where"), "where");
  const Shape* in[3] = {&cond.shape(), &a.shape(), &b.shape()};
  Tensor<T, D> y(out);
  detail::index_map<D>(y.size(), detail::SelectFn<T>{cond.data(), a.data(), b.data(), y.data(), detail::BroadcastIndex<3>(out, in)});
  if constexpr (FloatElement<T>) {
    if (detail::recording(a, b)) {
      detail::record(y, {a.trace(), b.trace()},
                     [ta = a.trace(), tb = b.trace(), sa = a.shape(), sb = b.shape(), c = cond](detail::Tape& t, const Tensor<T, D>& dy) {
                       const auto zero = zeros<T, D>(Shape{});
                       if (t.owns(ta)) t.accumulate(ta, detail::reduce_to(where(c, dy, zero), sa));
                       if (t.owns(tb)) t.accumulate(tb, detail::reduce_to(where(c, zero, dy), sb));
                     },
                     [&](const detail::Tangents& tangent) -> Tensor<T, D> {
                       const Tensor<T, D> ta = tangent(a), tb = tangent(b);
                       if (!ta.defined() && !tb.defined()) return {};
                       const auto zero = zeros<T, D>(Shape{});
                       const Tensor<T, D> r = where(cond, ta.defined() ? ta : zero, tb.defined() ? tb : zero);
                       return r.shape() == y.shape() ? r : broadcast_to(r, y.shape());
                     }, "where");
    }
  }
  return y;
}

namespace detail {
/// broadcast_to on an unbatched tensor (its batching rule calls this, as map's calls map_unbatched).
template <Element T, Device D>
Tensor<T, D> broadcast_unbatched(const Tensor<T, D>& x, const Shape& shape) {
  check_defined(x, "broadcast_to");
  const Shape out = broadcast_shapes(x.shape(), shape, "broadcast_to");
  TG_CHECK(out == shape, "broadcast_to", "cannot broadcast ", x.shape().str(), " to ", shape.str());
  const Shape* in[1] = {&x.shape()};
  Tensor<T, D> y(out);
  if (x.size() == 1) index_map<D>(y.size(), BroadcastScalarFn<T>{x.data(), y.data()});
  else index_map<D>(y.size(), BroadcastCopyFn<T>{x.data(), y.data(), BroadcastIndex<1>(out, in)});
  if constexpr (FloatElement<T>) {
    if (recording(x))
      record(y, {x.trace()}, [in = x.trace(), s = x.shape()](Tape& t, const Tensor<T, D>& dy) { t.accumulate(in, reduce_to(dy, s)); },
             [&](const Tangents& tangent) {
               const Tensor<T, D> tx = tangent(x);
               return tx.defined() ? broadcast_unbatched(tx, shape) : tx;
             }, "broadcast_to");
  }
  return y;
}
}  // namespace detail

/// `x` expanded to `shape` by NumPy broadcasting (a copy); the cotangent sums back.
template <Element T, Device D>
Tensor<T, D> broadcast_to(const Tensor<T, D>& x, const Shape& shape) {
  if (detail::batched(x)) {  // batching rule: each example to `shape`
    const std::uint32_t lv = x.batch_levels();
    TG_CHECK(x.rank() <= shape.rank(), "broadcast_to", "cannot broadcast ", x.shape().str(), " to ", shape.str());
    return detail::as_batched(detail::broadcast_unbatched(detail::aligned(x, lv, shape.rank()), detail::with_batch(lv, shape, "broadcast_to")), lv);
  }
  return detail::broadcast_unbatched(x, shape);
}

/// The elements converted to U (to bf16: round to nearest even). Casting to the same type shares storage.
template <Element U, Element T, Device D>
Tensor<U, D> cast(const Tensor<T, D>& x) {
  if constexpr (std::is_same_v<U, T>) {
    return x;
  } else if (detail::batched(x)) {  // batching rule: elementwise
    return detail::as_batched(cast<U>(x.physical()), x.batch_levels());
  } else {
    detail::check_defined(x, "cast");
    Tensor<U, D> y(x.shape());
    detail::convert<D>(x.size(), x.data(), y.data());
    if constexpr (FloatElement<T> && FloatElement<U>) {
      // The cotangent converts back: a bf16 computation's gradient reaches f32 parameters in f32.
      if (detail::recording(x)) {
        detail::record(y, {x.trace()}, [in = x.trace()](detail::Tape& t, const Tensor<U, D>& dy) {
          t.accumulate(in, cast<T>(dy));
        }, [&](const detail::Tangents& tangent) {
          const Tensor<T, D> tx = tangent(x);
          return tx.defined() ? cast<U>(tx) : Tensor<U, D>{};
        }, "cast");
      }
    }
    return y;
  }
}

namespace detail {
/// x batched at `levels` (a superset of its own), its examples copied along the levels it lacks: for the
/// batching rules of ops whose operands must all carry every batch axis (concatenate, the loss's labels).
template <Element T, Device D>
Tensor<T, D> materialize(const Tensor<T, D>& x, std::uint32_t levels) {
  if (x.batch_levels() == levels) return x;
  const Shape full = with_batch(levels, x.shape(), "vmap");
  const Tensor<T, D> a = aligned(x, levels, x.rank());
  return as_batched(a.shape() == full ? a : broadcast_to(a, full), levels);
}
}  // namespace detail

TG_END_NAMESPACE

