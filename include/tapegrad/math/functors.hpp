// The math of every elementwise op, written once: TG_HD functors with the forward and, beside it, the
// derivative. The CPU loops and the CUDA kernels both call these, so the CPU tests cover the GPU's math.
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

// ---- unary: y = f(x); backward(x, y, dy) = dy * f'(x) ----

struct Neg {
  template <class C> TG_HD C operator()(C x) const { return -x; }
  template <class C> TG_HD C backward(C, C, C dy) const { return -dy; }
};
struct Exp {
  template <class C> TG_HD C operator()(C x) const { return math::exp(x); }
  template <class C> TG_HD C backward(C, C y, C dy) const { return dy * y; }
};
struct Log {
  template <class C> TG_HD C operator()(C x) const { return math::log(x); }
  template <class C> TG_HD C backward(C x, C, C dy) const { return dy / x; }
};
struct Tanh {
  template <class C> TG_HD C operator()(C x) const { return math::tanh(x); }
  template <class C> TG_HD C backward(C, C y, C dy) const { return dy * (C(1) - y * y); }
};
struct Sigmoid {
  // Written through exp(-|x|) so neither tail overflows.
  template <class C> TG_HD C operator()(C x) const {
    const C e = math::exp(-math::abs(x));
    return x >= C(0) ? C(1) / (C(1) + e) : e / (C(1) + e);
  }
  template <class C> TG_HD C backward(C, C y, C dy) const { return dy * y * (C(1) - y); }
};
struct Relu {
  template <class C> TG_HD C operator()(C x) const { return x > C(0) ? x : C(0); }
  // The subgradient at 0 is 0, as jax.nn.relu.
  template <class C> TG_HD C backward(C x, C, C dy) const { return x > C(0) ? dy : C(0); }
};
/// GELU, tanh approximation (jax.nn.gelu's default): x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
/// Evaluated as x sigmoid(2u), since 1 + tanh(u) = 2 sigmoid(2u): one exp instead of a tanh, and no
/// cancellation in 1 + tanh(u) for negative x.
struct Gelu {
  static constexpr double k0 = 0.7978845608028654;  // sqrt(2 / pi)
  static constexpr double k1 = 0.044715;
  template <class C> TG_HD static C sigmoid_2u(C x) {
    return C(1) / (C(1) + math::exp(C(-2 * k0) * (x + C(k1) * x * x * x)));
  }
  template <class C> TG_HD C operator()(C x) const { return x * sigmoid_2u(x); }
  // d/dx [x s] with s = sigmoid(2u): s + 2 x s (1 - s) u'.
  template <class C> TG_HD C backward(C x, C, C dy) const {
    const C s = sigmoid_2u(x);
    const C du = C(k0) * (C(1) + C(3 * k1) * x * x);
    return dy * (s + C(2) * x * s * (C(1) - s) * du);
  }
};
/// GELU, exact: x Phi(x) = x/2 (1 + erf(x / sqrt 2)) (jax.nn.gelu(approximate=False)).
struct GeluExact {
  template <class C> TG_HD C operator()(C x) const { return C(0.5) * x * (C(1) + math::erf(x * C(0.7071067811865476))); }
  template <class C> TG_HD C backward(C x, C, C dy) const {
    const C cdf = C(0.5) * (C(1) + math::erf(x * C(0.7071067811865476)));
    const C pdf = C(0.3989422804014327) * math::exp(C(-0.5) * x * x);  // 1 / sqrt(2 pi)
    return dy * (cdf + x * pdf);
  }
};
/// SiLU (swish, jax.nn.silu): x sigmoid(x).
struct Silu {
  template <class C> TG_HD C operator()(C x) const { return x * Sigmoid{}(x); }
  // d/dx [x s] = s + x s (1 - s), recomputed from x (linear's backward passes no y).
  template <class C> TG_HD C backward(C x, C, C dy) const {
    const C s = Sigmoid{}(x);
    return dy * s * (C(1) + x * (C(1) - s));
  }
};
/// x limited to [lo, hi], as jnp.clip (NaN stays NaN). Derivative 1 inside, 0 outside and 1/2 on a bound,
/// as JAX's minimum(maximum(x, lo), hi) splits ties.
struct Clip {
  double lo = 0.0, hi = 0.0;
  template <class C> TG_HD C operator()(C x) const { return x < C(lo) ? C(lo) : (x > C(hi) ? C(hi) : x); }
  template <class C> TG_HD C backward(C x, C, C dy) const {
    return x > C(lo) && x < C(hi) ? dy : (x == C(lo) || x == C(hi) ? dy / C(2) : C(0));
  }
};
struct Sin {
  template <class C> TG_HD C operator()(C x) const { return math::sin(x); }
  template <class C> TG_HD C backward(C x, C, C dy) const { return dy * math::cos(x); }
};
struct Cos {
  template <class C> TG_HD C operator()(C x) const { return math::cos(x); }
  template <class C> TG_HD C backward(C x, C, C dy) const { return -dy * math::sin(x); }
};
/// The error function; d erf / dx = 2 / sqrt(pi) e^(-x^2).
struct Erf {
  template <class C> TG_HD C operator()(C x) const { return math::erf(x); }
  template <class C> TG_HD C backward(C x, C, C dy) const { return dy * C(1.1283791670955126) * math::exp(-x * x); }
};
struct Square {
  template <class C> TG_HD C operator()(C x) const { return x * x; }
  template <class C> TG_HD C backward(C x, C, C dy) const { return dy * C(2) * x; }
};
struct Sqrt {
  template <class C> TG_HD C operator()(C x) const { return math::sqrt(x); }
  template <class C> TG_HD C backward(C, C y, C dy) const { return dy / (C(2) * y); }
};
struct Rsqrt {
  template <class C> TG_HD C operator()(C x) const { return C(1) / math::sqrt(x); }
  template <class C> TG_HD C backward(C x, C y, C dy) const { return dy * C(-0.5) * y / x; }
};
struct Abs {
  template <class C> TG_HD C operator()(C x) const { return math::abs(x); }
  // sign(x), 0 at 0 (as JAX).
  template <class C> TG_HD C backward(C x, C, C dy) const { return x > C(0) ? dy : (x < C(0) ? -dy : C(0)); }
};
/// x^p for a scalar exponent p.
struct PowScalar {
  double p;
  template <class C> TG_HD C operator()(C x) const { return math::pow(x, C(p)); }
  template <class C> TG_HD C backward(C x, C, C dy) const {
    return p == 0.0 ? C(0) : dy * C(p) * math::pow(x, C(p - 1.0));
  }
};

// ---- binary: y = f(a, b); backward_a / backward_b give dy * df/da, dy * df/db ----

struct Add {
  template <class C> TG_HD C operator()(C a, C b) const { return a + b; }
  template <class C> TG_HD C backward_a(C, C, C, C dy) const { return dy; }
  template <class C> TG_HD C backward_b(C, C, C, C dy) const { return dy; }
};
/// a + alpha b (an axpy, in the compute type and rounded once): decayed weights and momentum in optim.
struct AddScaled {
  double alpha = 1.0;
  template <class C> TG_HD C operator()(C a, C b) const { return a + C(alpha) * b; }
  template <class C> TG_HD C backward_a(C, C, C, C dy) const { return dy; }
  template <class C> TG_HD C backward_b(C, C, C, C dy) const { return C(alpha) * dy; }
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
  template <class C> TG_HD C operator()(C a, C b) const { return a - b; }
  template <class C> TG_HD C backward_a(C, C, C, C dy) const { return dy; }
  template <class C> TG_HD C backward_b(C, C, C, C dy) const { return -dy; }
};
struct Mul {
  template <class C> TG_HD C operator()(C a, C b) const { return a * b; }
  template <class C> TG_HD C backward_a(C, C b, C, C dy) const { return dy * b; }
  template <class C> TG_HD C backward_b(C a, C, C, C dy) const { return dy * a; }
};
struct Div {
  template <class C> TG_HD C operator()(C a, C b) const { return a / b; }
  template <class C> TG_HD C backward_a(C, C b, C, C dy) const { return dy / b; }
  template <class C> TG_HD C backward_b(C, C b, C y, C dy) const { return -dy * y / b; }
};
/// max(a, b); NaN propagates. At a tie the gradient is split evenly, as JAX does.
struct Maximum {
  template <class C> TG_HD C operator()(C a, C b) const { return (a > b || math::isnan(a)) ? a : b; }
  template <class C> TG_HD C backward_a(C a, C b, C, C dy) const { return a > b ? dy : (a == b ? dy / C(2) : C(0)); }
  template <class C> TG_HD C backward_b(C a, C b, C, C dy) const { return b > a ? dy : (a == b ? dy / C(2) : C(0)); }
};
struct Minimum {
  template <class C> TG_HD C operator()(C a, C b) const { return (a < b || math::isnan(a)) ? a : b; }
  template <class C> TG_HD C backward_a(C a, C b, C, C dy) const { return a < b ? dy : (a == b ? dy / C(2) : C(0)); }
  template <class C> TG_HD C backward_b(C a, C b, C, C dy) const { return b < a ? dy : (a == b ? dy / C(2) : C(0)); }
};

// ---- comparisons: uint8 results (1 true, 0 false); piecewise constant, so their derivative is 0 ----

struct Less { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a < b; } };
struct LessEqual { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a <= b; } };
struct Greater { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a > b; } };
struct GreaterEqual { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a >= b; } };
struct Equal { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a == b; } };
struct NotEqual { template <class C> TG_HD std::uint8_t operator()(C a, C b) const { return a != b; } };

/// where(cond, a, b): a where cond is non-zero, else b. The cotangent goes to the chosen side.
struct Select {
  template <class C> TG_HD C operator()(std::uint8_t cond, C a, C b) const { return cond ? a : b; }
  template <class C> TG_HD C backward_a(std::uint8_t cond, C dy) const { return cond ? dy : C(0); }
  template <class C> TG_HD C backward_b(std::uint8_t cond, C dy) const { return cond ? C(0) : dy; }
};

}  // namespace fn
TG_END_NAMESPACE
