// The math of every elementwise op, written once: TG_HD functors with the forward and, beside it, the
// derivative. The CPU loops and the CUDA kernels both call these, so the CPU tests cover the GPU's math.
//
// A derivative is one generic expression, `derivative(x, y)` (f'(x), given y = f(x) for the functors whose
// derivative reads it) or `derivative_a / derivative_b(a, b, y)`: compiled for a scalar it is what the
// backward kernels multiply the cotangent by (fn::backward below); compiled for a tg::Tensor it is the
// traced derivative a recorded backward pass differentiates again (ops/elementwise.hpp), so the two cannot
// drift. Its constants are `k<V>(c)` and its functions unqualified (`exp(x)`, after `using math::exp`): the
// scalar overloads here, the tensor ops found by argument-dependent lookup. A functor whose derivative is
// piecewise constant says so (`piecewise_linear = true`): its derivative is then a scalar slope only, taken
// as a constant of x by a traced pass (its second derivative is 0 wherever it exists), and where the slope
// is 0 the cotangent is not read (a select, as JAX's rules: relu'(x) dy is 0 for x <= 0 even where dy is
// not finite). Activations (math/activation.hpp) take their derivative from x alone (linear's backward
// passes no y).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/base/bf16.hpp"

TG_BEGIN_NAMESPACE

namespace math {
// Overloads that resolve to the float or double library function on host and device alike.
TG_HD inline float exp(float x) { return ::expf(x); }
TG_HD inline double exp(double x) { return ::exp(x); }
TG_HD inline float log(float x) { return ::logf(x); }
TG_HD inline double log(double x) { return ::log(x); }
TG_HD inline float tanh(float x) { return ::tanhf(x); }
TG_HD inline double tanh(double x) { return ::tanh(x); }
TG_HD inline float sqrt(float x) { return ::sqrtf(x); }
TG_HD inline double sqrt(double x) { return ::sqrt(x); }
TG_HD inline float erf(float x) { return ::erff(x); }
TG_HD inline double erf(double x) { return ::erf(x); }
TG_HD inline float sin(float x) { return ::sinf(x); }
TG_HD inline double sin(double x) { return ::sin(x); }
TG_HD inline float cos(float x) { return ::cosf(x); }
TG_HD inline double cos(double x) { return ::cos(x); }
TG_HD inline float abs(float x) { return ::fabsf(x); }
TG_HD inline double abs(double x) { return ::fabs(x); }
TG_HD inline float pow(float x, float p) { return ::powf(x, p); }
TG_HD inline double pow(double x, double p) { return ::pow(x, p); }
template <class C> TG_HD bool isnan(C x) { return x != x; }
/// 1 / (1 + e^-x), written through e^-|x| so that neither tail overflows.
template <class C> TG_HD C sigmoid(C x) {
  const C e = exp(-abs(x));
  return x >= C(0) ? C(1) / (C(1) + e) : e / (C(1) + e);
}

/// The constant c in a generic derivative's type V: V(c) for a scalar, c itself for a tensor (whose ops
/// take double scalars).
template <class V> TG_HD constexpr auto k(double c) {
  if constexpr (std::is_arithmetic_v<V>) return V(c);
  else return c;
}

/// e^x for float in plain arithmetic, so that a loop of them vectorises (a call to expf does not):
/// Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial in r, 2^n from the exponent bits),
/// within 2 ulp of expf; 0 below -87.3365 (where expf is subnormal: tapegrad flushes those), inf above 88.72283,
/// NaN for NaN. For rows of exponentials on the CPU (the fused attention's softmax); double calls exp.
TG_HD inline float exp_poly(float x) {
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // t rounded to the nearest integer (|t| < 2^22)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float nc = n >= -126.0f ? (n <= 127.0f ? n : 127.0f) : -126.0f;  // NaN to -126: converting NaN to int is undefined
  const std::uint32_t bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(nc) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  const float y = p * scale * (n > 127.0f ? 2.0f : 1.0f);  // 2^128 as 2^127 * 2
  return x < -87.3365f ? 0.0f : (x > 88.72283f ? INFINITY : (x != x ? x : y));
}
TG_HD inline double exp_poly(double x) { return ::exp(x); }
}  // namespace math

namespace fn {

// ---- unary: y = f(x); derivative(x, y) = f'(x) ----

struct Neg {
  static constexpr bool piecewise_linear = true;
  template <class C> TG_HD C operator()(C x) const { return -x; }
  template <class C> TG_HD C derivative(C, C) const { return C(-1); }
};
struct Exp {
  template <class C> TG_HD C operator()(C x) const { return math::exp(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V&, const V& y) const { return y; }
};
struct Log {
  template <class C> TG_HD C operator()(C x) const { return math::log(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const { return math::k<V>(1) / x; }
};
struct Tanh {
  template <class C> TG_HD C operator()(C x) const { return math::tanh(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V&, const V& y) const { return math::k<V>(1) - y * y; }
};
struct Sigmoid {
  template <class C> TG_HD C operator()(C x) const { return math::sigmoid(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V&, const V& y) const { return y * (math::k<V>(1) - y); }
};
struct Relu {
  static constexpr bool piecewise_linear = true;
  template <class C> TG_HD C operator()(C x) const { return x > C(0) ? x : C(0); }
  // The subgradient at 0 is 0, as jax.nn.relu.
  template <class C> TG_HD C derivative(C x, C) const { return x > C(0) ? C(1) : C(0); }
};
/// GELU, tanh approximation (jax.nn.gelu's default): x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
/// Evaluated as x sigmoid(2u), since 1 + tanh(u) = 2 sigmoid(2u): one exp instead of a tanh, and no
/// cancellation in 1 + tanh(u) for negative x.
struct Gelu {
  static constexpr double k0 = 0.7978845608028654;  // sqrt(2 / pi)
  static constexpr double k1 = 0.044715;
  TG_HD_GENERIC template <class V> TG_HD static V sigmoid_2u(const V& x) {
    using math::sigmoid;
    return sigmoid(math::k<V>(2 * k0) * (x + math::k<V>(k1) * x * x * x));
  }
  template <class C> TG_HD C operator()(C x) const { return x * sigmoid_2u(x); }
  // d/dx [x s] with s = sigmoid(2u): s + 2 x s (1 - s) u'.
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const {
    const V s = sigmoid_2u(x);
    const V du = math::k<V>(k0) * (math::k<V>(1) + math::k<V>(3 * k1) * x * x);
    return s + math::k<V>(2) * x * s * (math::k<V>(1) - s) * du;
  }
};
/// GELU, exact: x Phi(x) = x/2 (1 + erf(x / sqrt 2)) (jax.nn.gelu(approximate=False)).
struct GeluExact {
  template <class C> TG_HD C operator()(C x) const { return C(0.5) * x * (C(1) + math::erf(x * C(0.7071067811865476))); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const {
    using math::erf;
    using math::exp;
    const V cdf = math::k<V>(0.5) * (math::k<V>(1) + erf(x * math::k<V>(0.7071067811865476)));
    const V pdf = math::k<V>(0.3989422804014327) * exp(math::k<V>(-0.5) * (x * x));  // 1 / sqrt(2 pi)
    return cdf + x * pdf;
  }
};
/// SiLU (swish, jax.nn.silu): x sigmoid(x).
struct Silu {
  template <class C> TG_HD C operator()(C x) const { return x * math::sigmoid(x); }
  // d/dx [x s] = s (1 + x (1 - s)), from x (linear's backward passes no y).
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const {
    using math::sigmoid;
    const V s = sigmoid(x);
    return s * (math::k<V>(1) + x * (math::k<V>(1) - s));
  }
};
/// x limited to [lo, hi], as jnp.clip (NaN stays NaN). Derivative 1 inside, 0 outside and 1/2 on a bound,
/// as JAX's minimum(maximum(x, lo), hi) splits ties.
struct Clip {
  static constexpr bool piecewise_linear = true;
  double lo = 0.0, hi = 0.0;
  template <class C> TG_HD C operator()(C x) const { return x < C(lo) ? C(lo) : (x > C(hi) ? C(hi) : x); }
  template <class C> TG_HD C derivative(C x, C) const {
    return x > C(lo) && x < C(hi) ? C(1) : (x == C(lo) || x == C(hi) ? C(0.5) : C(0));
  }
};
struct Sin {
  template <class C> TG_HD C operator()(C x) const { return math::sin(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const {
    using math::cos;
    return cos(x);
  }
};
struct Cos {
  template <class C> TG_HD C operator()(C x) const { return math::cos(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const {
    using math::sin;
    return -sin(x);
  }
};
/// The error function; d erf / dx = 2 / sqrt(pi) e^(-x^2).
struct Erf {
  template <class C> TG_HD C operator()(C x) const { return math::erf(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const {
    using math::exp;
    return math::k<V>(1.1283791670955126) * exp(-(x * x));
  }
};
struct Square {
  template <class C> TG_HD C operator()(C x) const { return x * x; }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const { return math::k<V>(2) * x; }
};
struct Sqrt {
  template <class C> TG_HD C operator()(C x) const { return math::sqrt(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V&, const V& y) const { return math::k<V>(0.5) / y; }
};
struct Rsqrt {
  template <class C> TG_HD C operator()(C x) const { return C(1) / math::sqrt(x); }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V& y) const { return math::k<V>(-0.5) * y / x; }
};
struct Abs {
  static constexpr bool piecewise_linear = true;
  template <class C> TG_HD C operator()(C x) const { return math::abs(x); }
  // sign(x), 0 at 0 (as JAX).
  template <class C> TG_HD C derivative(C x, C) const { return x > C(0) ? C(1) : (x < C(0) ? C(-1) : C(0)); }
};
/// x^p for a scalar exponent p.
struct PowScalar {
  double p;
  template <class C> TG_HD C operator()(C x) const { return math::pow(x, C(p)); }
  // p x^(p-1); 0 for p = 0 (x^0 is the constant 1).
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const {
    using math::pow;
    return p == 0.0 ? x * math::k<V>(0) : math::k<V>(p) * pow(x, math::k<V>(p - 1.0));
  }
};

// ---- binary: y = f(a, b); derivative_a / derivative_b(a, b, y) = df/da, df/db ----

struct Add {
  static constexpr bool piecewise_linear = true;
  template <class C> TG_HD C operator()(C a, C b) const { return a + b; }
  template <class C> TG_HD C derivative_a(C, C, C) const { return C(1); }
  template <class C> TG_HD C derivative_b(C, C, C) const { return C(1); }
};
/// a + alpha b (an axpy, in the compute type and rounded once): decayed weights and momentum in optim.
struct AddScaled {
  static constexpr bool piecewise_linear = true;
  double alpha = 1.0;
  template <class C> TG_HD C operator()(C a, C b) const { return a + C(alpha) * b; }
  template <class C> TG_HD C derivative_a(C, C, C) const { return C(1); }
  template <class C> TG_HD C derivative_b(C, C, C) const { return C(alpha); }
};
/// optax.clip_by_global_norm's rescale of one element: g where norm < max_norm (compared in the norm's
/// type, as optax compares), else (g / norm) * max_norm in g's compute type. Not differentiable (an
/// optimizer's arithmetic).
struct ClipToNorm {
  double max_norm = 1.0;
  template <class C, class N> TG_HD C operator()(C g, N norm) const {
    return norm < static_cast<N>(max_norm) ? g : (g / static_cast<C>(norm)) * C(max_norm);
  }
};
struct Sub {
  static constexpr bool piecewise_linear = true;
  template <class C> TG_HD C operator()(C a, C b) const { return a - b; }
  template <class C> TG_HD C derivative_a(C, C, C) const { return C(1); }
  template <class C> TG_HD C derivative_b(C, C, C) const { return C(-1); }
};
struct Mul {
  template <class C> TG_HD C operator()(C a, C b) const { return a * b; }
  TG_HD_GENERIC template <class A, class B, class V> TG_HD B derivative_a(const A&, const B& b, const V&) const { return b; }
  TG_HD_GENERIC template <class A, class B, class V> TG_HD A derivative_b(const A& a, const B&, const V&) const { return a; }
};
struct Div {
  template <class C> TG_HD C operator()(C a, C b) const { return a / b; }
  TG_HD_GENERIC template <class A, class B, class V> TG_HD B derivative_a(const A&, const B& b, const V&) const {
    return math::k<B>(1) / b;
  }
  TG_HD_GENERIC template <class A, class B, class V> TG_HD V derivative_b(const A&, const B& b, const V& y) const { return -y / b; }
};
/// max(a, b); NaN propagates. At a tie the gradient is split evenly, as JAX does.
struct Maximum {
  static constexpr bool piecewise_linear = true;
  template <class C> TG_HD C operator()(C a, C b) const { return (a > b || math::isnan(a)) ? a : b; }
  template <class C> TG_HD C derivative_a(C a, C b, C) const { return a > b ? C(1) : (a == b ? C(0.5) : C(0)); }
  template <class C> TG_HD C derivative_b(C a, C b, C) const { return b > a ? C(1) : (a == b ? C(0.5) : C(0)); }
};
struct Minimum {
  static constexpr bool piecewise_linear = true;
  template <class C> TG_HD C operator()(C a, C b) const { return (a < b || math::isnan(a)) ? a : b; }
  template <class C> TG_HD C derivative_a(C a, C b, C) const { return a < b ? C(1) : (a == b ? C(0.5) : C(0)); }
  template <class C> TG_HD C derivative_b(C a, C b, C) const { return b < a ? C(1) : (a == b ? C(0.5) : C(0)); }
};

/// Whether a functor says its derivative is piecewise constant (see the top of this file).
template <class Op>
inline constexpr bool piecewise_linear = requires { requires Op::piecewise_linear; };

/// Whether the functor has a derivative (one of the library's, or a user's functor that gives one); a
/// user's functor may instead give backward(x, y, dy) (first order only).
template <class Op, class C>
concept HasDerivative = requires(const Op op, C x) { op.derivative(x, x); };
template <class Op, class C>
concept HasBinaryDerivative = requires(const Op op, C x) { op.derivative_a(x, x, x); };

/// Whether the derivative is a select (relu's, clip's, abs's, maximum's): where its slope is 0 the
/// cotangent is not read. A piecewise-linear functor's is, unless it says otherwise (a multiplication by
/// a constant, whose 0 times a NaN stays NaN).
template <class Op>
struct selects_trait {
  static constexpr bool value = piecewise_linear<Op>;
};
template <class Op>
  requires requires { Op::selects; }
struct selects_trait<Op> {
  static constexpr bool value = Op::selects;
};
template <class Op>
inline constexpr bool selects = selects_trait<Op>::value;

/// dy times the slope, as a select where the derivative is one.
template <class Op, class C>
TG_HD C times_slope(C dy, C slope) {
  if constexpr (selects<Op>) return slope == C(0) ? C(0) : dy * slope;
  else return dy * slope;
}

/// The backward pass of y = op(x) at one element: dy * f'(x) (a user's functor's own backward when it
/// gives no derivative).
template <class Op, class C>
TG_HD C backward(const Op& op, C x, C y, C dy) {
  if constexpr (HasDerivative<Op, C>) return times_slope<Op>(dy, op.derivative(x, y));
  else return op.backward(x, y, dy);
}
/// The backward pass of y = op(a, b) at one element, for a (SideA) or b.
template <bool SideA, class Op, class C>
TG_HD C backward2(const Op& op, C a, C b, C y, C dy) {
  if constexpr (HasBinaryDerivative<Op, C>) return times_slope<Op>(dy, SideA ? C(op.derivative_a(a, b, y)) : C(op.derivative_b(a, b, y)));
  else return SideA ? op.backward_a(a, b, y, dy) : op.backward_b(a, b, y, dy);
}

// ---- comparisons: uint8 results (1 true, 0 false); piecewise constant, so their derivative is 0 ----

struct Less { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a < b; } };
struct LessEqual { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a <= b; } };
struct Greater { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a > b; } };
struct GreaterEqual { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a >= b; } };
struct Equal { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a == b; } };
struct NotEqual { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a != b; } };


}  // namespace fn
TG_END_NAMESPACE
