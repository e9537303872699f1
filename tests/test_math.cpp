// math/ (functors.hpp, activation.hpp): each functor's backward against central finite differences in
// double, exp_poly (the vectorisable float exp) against expf over its whole range, and the functors run by
// the CPU's loops at every instruction set level giving the same bits. Host code only: built for the CPU.
#include "test_common.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace rnd = tg::random;

namespace math_test {

TEST_CASE("exp_poly, the vectorisable float exp, is within 1 ulp of expf over its whole range", "[math]") {
  // Every float from the smallest normal result's argument to the largest finite one, a stride of 7 (some
  // 2.2e9 values in reach, 3.2e8 checked); outside, 0 and inf as expf rounds (after flushing subnormals).
  // The floats in order are the integers: k >= 0 is the float with bits k, k < 0 minus the one with bits -k,
  // so k + 7 is seven nextafter steps up (a stride in the integers, not 7 calls to nextafter per value).
  std::int64_t worst = 0;
  float at = 0;
  auto bits = [](float f) {
    std::int32_t i;
    std::memcpy(&i, &f, sizeof f);
    return i;
  };
  auto from_bits = [](std::int32_t i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
  };
  auto ordered = [&](std::int32_t k) { return k >= 0 ? from_bits(k) : -from_bits(-k); };
  for (std::int32_t k = -bits(87.3365f);; k += 7) {
    const float x = ordered(k);
    if (x > 88.72283f) break;
    const std::int64_t ulp = std::abs(static_cast<std::int64_t>(bits(tg::math::exp_poly(x))) - bits(std::exp(x)));
    if (ulp > worst) worst = ulp, at = x;
  }
  INFO("worst " << worst << " ulp at x = " << at);
  CHECK(worst <= 1);
  CHECK(tg::math::exp_poly(0.0f) == 1.0f);
  CHECK(tg::math::exp_poly(-87.34f) == 0.0f);
  CHECK(tg::math::exp_poly(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(std::isinf(tg::math::exp_poly(88.73f)));
  CHECK(std::isnan(tg::math::exp_poly(std::numeric_limits<float>::quiet_NaN())));
  CHECK(tg::math::exp_poly(1.5) == std::exp(1.5));  // double: the library's exp
}

TEST_CASE("the CPU loops give the same bits at every instruction set level", "[math]") {
#if TG_CPU_MULTI_ISA
  // The AVX2 and AVX-512 loops the CPU picks at run time against the baseline (SSE2) loop, on functors
  // where contracting a * b + c into an FMA or reordering a sum would show: GELU's polynomial, a fused
  // softmax row, exp_poly, a multiply-add. Levels this CPU lacks are skipped.
  const std::int64_t n = 4099;
  const auto a = rnd::normal<float, tg::Cpu>(rnd::key(1), {n}) * 3.0f, b = rnd::normal<float, tg::Cpu>(rnd::key(2), {n});
  struct Mix {
    const float *a, *b;
    float* y;
    void operator()(std::int64_t i) const {
      y[4 * i] = tg::fn::Gelu{}(a[i]);
      y[4 * i + 1] = a[i] * b[i] + y[4 * i];
      y[4 * i + 2] = tg::math::exp_poly(a[i]);
      y[4 * i + 3] = tg::fn::backward(tg::fn::Gelu{}, a[i], y[4 * i], b[i]);
    }
  };
  auto run = [&](auto loop) {
    tg::Tensor<float, tg::Cpu> y({4 * n}), s({n / 17, 17});
    loop(n, Mix{a.data(), b.data(), y.data()});
    loop(n / 17, tg::detail::SoftmaxRowFn<float, false>{a.data(), s.data(), 17});
    auto out = y.to_vector(), rows = s.to_vector();
    out.insert(out.end(), rows.begin(), rows.end());
    return out;
  };
  const auto baseline = run([](std::int64_t m, const auto& f) {
    for (std::int64_t i = 0; i < m; ++i) f(i);
  });
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) CHECK(run([](std::int64_t m, const auto& f) { tg::cpu::run_avx2(0, m, f); }) == baseline);
#if TG_CPU_AVX512
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    CHECK(run([](std::int64_t m, const auto& f) { tg::cpu::run_avx512(0, m, f); }) == baseline);
#endif
  CHECK(run([](std::int64_t m, const auto& f) { tg::cpu::run_range(0, m, f); }) == baseline);
#else
  SUCCEED("one instruction set level in this build");
#endif
}

TEST_CASE("functor derivatives match central finite differences in double", "[math][grad]") {
  // Each derivative(x, y) must equal (f(x + h) - f(x - h)) / 2h; h = 1e-6 balances the O(h^2) truncation
  // against rounding (about 1e-10 relative), so 1e-7 relative is a safe bound.
  const auto pts = rnd::normal<double>(rnd::key(5), {200}).to_vector();
  auto check_unary = [&](auto f, const char* name, double shift, double scale) {
    double worst = 0.0;
    for (double p : pts) {
      const double x = p * scale + shift, h = 1e-6;
      const double fd = (f(x + h) - f(x - h)) / (2 * h);
      const double an = f.derivative(x, f(x));
      worst = std::max(worst, std::fabs(fd - an) / std::max(1.0, std::fabs(fd)));
    }
    INFO(name << ": worst relative error " << worst);
    CHECK(worst < 1e-7);
  };
  check_unary(tg::fn::Exp{}, "exp", 0, 1);
  check_unary(tg::fn::Log{}, "log", 3, 0.5);
  check_unary(tg::fn::Tanh{}, "tanh", 0, 2);
  check_unary(tg::fn::Sigmoid{}, "sigmoid", 0, 3);
  check_unary(tg::fn::Relu{}, "relu", 0, 1);  // FD at |x| >= h away from the kink: normals never land there
  check_unary(tg::fn::Gelu{}, "gelu", 0, 2);
  check_unary(tg::fn::GeluExact{}, "gelu_exact", 0, 2);
  check_unary(tg::fn::Silu{}, "silu", 0, 3);
  check_unary(tg::fn::Sin{}, "sin", 0, 2);
  check_unary(tg::fn::Cos{}, "cos", 0, 2);
  check_unary(tg::fn::Erf{}, "erf", 0, 1.5);
  check_unary(tg::fn::Square{}, "square", 0, 1);
  check_unary(tg::fn::Sqrt{}, "sqrt", 3, 0.5);
  check_unary(tg::fn::Rsqrt{}, "rsqrt", 3, 0.5);
  check_unary(tg::fn::Abs{}, "abs", 0, 1);
  check_unary(tg::fn::Neg{}, "neg", 0, 1);
  check_unary(tg::fn::PowScalar{2.5}, "pow", 3, 0.5);

  auto check_binary = [&](auto f, const char* name, double shift_b) {
    double worst = 0.0;
    for (std::size_t i = 0; i + 1 < pts.size(); i += 2) {
      const double a = pts[i], b = pts[i + 1] + shift_b, h = 1e-6, y = f(a, b);
      const double fa = (f(a + h, b) - f(a - h, b)) / (2 * h), fb = (f(a, b + h) - f(a, b - h)) / (2 * h);
      worst = std::max({worst, std::fabs(fa - f.derivative_a(a, b, y)) / std::max(1.0, std::fabs(fa)),
                        std::fabs(fb - f.derivative_b(a, b, y)) / std::max(1.0, std::fabs(fb))});
    }
    INFO(name << ": worst relative error " << worst);
    CHECK(worst < 1e-7);
  };
  check_binary(tg::fn::Add{}, "add", 0);
  check_binary(tg::fn::Sub{}, "sub", 0);
  check_binary(tg::fn::Mul{}, "mul", 0);
  check_binary(tg::fn::Div{}, "div", 4);
  check_binary(tg::fn::Maximum{}, "maximum", 0);
  check_binary(tg::fn::Minimum{}, "minimum", 0);
  // Ties split the gradient evenly. A select's zero slope does not read the cotangent (relu'(x) dy is 0 for
  // x <= 0 even for a NaN dy, as JAX's select); a product's does (0 times NaN is NaN).
  CHECK(tg::fn::backward2<true>(tg::fn::Maximum{}, 1.0, 1.0, 1.0, 1.0) == 0.5);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(tg::fn::backward(tg::fn::Relu{}, -1.0, 0.0, nan) == 0.0);
  CHECK(tg::fn::backward(tg::fn::Clip{-1.0, 1.0}, 2.0, 1.0, nan) == 0.0);
  CHECK(std::isnan(tg::fn::backward(tg::fn::Square{}, 0.0, 0.0, nan)));
}

TEST_CASE("each derivative is one expression: its tensor form equals its scalar form", "[math][grad]") {
  // The traced backward pass multiplies by derivative(x, y) compiled for tensors, the kernels by the same
  // expression compiled for doubles: they agree to rounding, element by element.
  const auto xt = rnd::normal<double>(rnd::key(9), {300});
  auto check = [&](auto f, const char* name, double shift, double scale) {
    const auto x = xt * scale + shift;
    const auto y = tg::map(x, f);
    const auto tensor = f.derivative(x, y).to_vector();
    const auto xs = x.to_vector(), ys = y.to_vector();
    double worst = 0.0;
    for (std::size_t i = 0; i < xs.size(); ++i)
      worst = std::max(worst, std::fabs(tensor[i] - f.derivative(xs[i], ys[i])) / std::max(1.0, std::fabs(tensor[i])));
    INFO(name << ": worst relative difference " << worst);
    CHECK(worst <= 4e-16);
  };
  check(tg::fn::Exp{}, "exp", 0, 1);
  check(tg::fn::Log{}, "log", 3, 0.5);
  check(tg::fn::Tanh{}, "tanh", 0, 2);
  check(tg::fn::Sigmoid{}, "sigmoid", 0, 3);
  check(tg::fn::Gelu{}, "gelu", 0, 2);
  check(tg::fn::GeluExact{}, "gelu_exact", 0, 2);
  check(tg::fn::Silu{}, "silu", 0, 3);
  check(tg::fn::Sin{}, "sin", 0, 2);
  check(tg::fn::Cos{}, "cos", 0, 2);
  check(tg::fn::Erf{}, "erf", 0, 1.5);
  check(tg::fn::Square{}, "square", 0, 1);
  check(tg::fn::Sqrt{}, "sqrt", 3, 0.5);
  check(tg::fn::Rsqrt{}, "rsqrt", 3, 0.5);
  check(tg::fn::PowScalar{2.5}, "pow", 3, 0.5);
  static_assert(tg::fn::piecewise_linear<tg::fn::Relu> && tg::fn::piecewise_linear<tg::fn::Maximum> && !tg::fn::piecewise_linear<tg::fn::Tanh>);
}

}  // namespace math_test
