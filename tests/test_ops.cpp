// Ops against double-precision references on random inputs: elementwise math and its derivatives,
// broadcasting, reductions, GEMMs and the fused layer, softmax cross-entropy. Built for the CPU, and by
// nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "test_common.hpp"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;

namespace {

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<double>(static_cast<float>(v[i]));
  return r;
}
std::vector<double> as_double(const std::vector<double>& v) { return v; }

template <class T, class Dev>
std::vector<double> values(const tg::Tensor<T, Dev>& t) { return as_double(t.to_vector()); }

/// Random inputs on device D: normals (never exact zeros in practice), optionally shifted into a domain.
template <class T = float>
tg::Tensor<T, D> input(int seed, const tg::Shape& shape, double scale = 1.0, double shift = 0.0) {
  auto z = rnd::normal<double>(rnd::key(seed), shape).to_vector();
  std::vector<T> v(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) v[i] = tg::detail::convert_to<T>(z[i] * scale + shift);
  return tg::from_vector<D>(v, shape);
}

/// |got - want| <= atol + rtol |want| everywhere; otherwise the first mismatches are reported.
void check_close(const std::vector<double>& got, const std::vector<double>& want, double atol, double rtol,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const bool ok = err <= atol + rtol * std::fabs(want[i]) || (std::isnan(got[i]) && std::isnan(want[i]));
    worst = std::max(worst, err);
    if (!ok && ++bad <= 5) UNSCOPED_INFO(what << "[" << i << "]: got " << got[i] << ", want " << want[i]);
  }
  INFO(what << ": " << bad << " of " << got.size() << " outside atol " << atol << " + rtol " << rtol << " (worst |err| " << worst << ")");
  CHECK(bad == 0);
}

std::vector<double> ref_unary(const std::vector<double>& x, const std::function<double(double)>& f) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = f(x[i]);
  return y;
}

}  // namespace

TEST_CASE("unary ops match double references", "[ops][elementwise]") {
  const tg::Shape s{37, 29};
  const auto x = input(1, s, 2.0);            // anywhere
  const auto xp = input(2, s, 0.5, 3.0);      // positive: log, sqrt, rsqrt, pow
  const auto dx = values(x), dxp = values(xp);
  // float32 math against double: a few ulp of the library functions (tanh/erf/exp are within 2-4 ulp).
  const double rtol = 4e-6, atol = 1e-6;
  const double k = std::sqrt(2.0 / M_PI);
  check_close(values(tg::exp(x)), ref_unary(dx, [](double v) { return std::exp(v); }), atol, rtol, "exp");
  check_close(values(tg::log(xp)), ref_unary(dxp, [](double v) { return std::log(v); }), atol, rtol, "log");
  check_close(values(tg::tanh(x)), ref_unary(dx, [](double v) { return std::tanh(v); }), atol, rtol, "tanh");
  check_close(values(tg::sigmoid(x)), ref_unary(dx, [](double v) { return 1 / (1 + std::exp(-v)); }), atol, rtol, "sigmoid");
  check_close(values(tg::relu(x)), ref_unary(dx, [](double v) { return v > 0 ? v : 0; }), 0, 0, "relu");
  check_close(values(tg::gelu(x)), ref_unary(dx, [&](double v) { return 0.5 * v * (1 + std::tanh(k * (v + 0.044715 * v * v * v))); }),
              atol, rtol, "gelu");
  check_close(values(tg::gelu_exact(x)), ref_unary(dx, [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }),
              atol, rtol, "gelu_exact");
  check_close(values(tg::silu(x)), ref_unary(dx, [](double v) { return v / (1 + std::exp(-v)); }), atol, rtol, "silu");
  check_close(values(tg::sin(x)), ref_unary(dx, [](double v) { return std::sin(v); }), atol, rtol, "sin");
  check_close(values(tg::cos(x)), ref_unary(dx, [](double v) { return std::cos(v); }), atol, rtol, "cos");
  check_close(values(tg::erf(x)), ref_unary(dx, [](double v) { return std::erf(v); }), atol, rtol, "erf");
  check_close(values(tg::square(x)), ref_unary(dx, [](double v) { return v * v; }), atol, rtol, "square");
  check_close(values(tg::sqrt(xp)), ref_unary(dxp, [](double v) { return std::sqrt(v); }), atol, rtol, "sqrt");
  check_close(values(tg::rsqrt(xp)), ref_unary(dxp, [](double v) { return 1 / std::sqrt(v); }), atol, rtol, "rsqrt");
  check_close(values(tg::abs(x)), ref_unary(dx, [](double v) { return std::fabs(v); }), 0, 0, "abs");
  check_close(values(-x), ref_unary(dx, [](double v) { return -v; }), 0, 0, "neg");
  check_close(values(tg::pow(xp, 2.5)), ref_unary(dxp, [](double v) { return std::pow(v, 2.5); }), atol, rtol, "pow");
  // In double the same ops agree with the references to double rounding.
  const auto x64 = input<double>(1, s, 2.0);
  check_close(values(tg::gelu(x64)), ref_unary(values(x64), [&](double v) { return 0.5 * v * (1 + std::tanh(k * (v + 0.044715 * v * v * v))); }),
              1e-15, 1e-14, "gelu f64");
  check_close(values(tg::sigmoid(input<double>(3, {1000}, 30.0))),
              ref_unary(values(input<double>(3, {1000}, 30.0)), [](double v) { return 1 / (1 + std::exp(-v)); }), 1e-300, 1e-14,
              "sigmoid f64 tails");
}

TEST_CASE("exp_poly, the vectorisable float exp, is within 1 ulp of expf over its whole range", "[ops][elementwise]") {
  // Every float from the smallest normal result's argument to the largest finite one, a stride of 7 (some
  // 2.7e8 values in reach, 3.8e7 checked); outside, 0 and inf as expf rounds (after flushing subnormals).
  std::int64_t worst = 0;
  float at = 0;
  auto bits = [](float f) {
    std::int32_t i;
    std::memcpy(&i, &f, sizeof f);
    return i;
  };
  for (float x = -87.3365f; x <= 88.72283f;) {
    const std::int64_t ulp = std::abs(static_cast<std::int64_t>(bits(tg::math::exp_poly(x))) - bits(std::exp(x)));
    if (ulp > worst) worst = ulp, at = x;
    for (int k = 0; k < 7; ++k) x = std::nextafter(x, 100.0f);
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

TEST_CASE("the CPU loops give the same bits at every instruction set level", "[ops][elementwise]") {
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
      y[4 * i + 3] = tg::fn::Gelu{}.backward(a[i], y[4 * i], b[i]);
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

TEST_CASE("functor derivatives match central finite differences in double", "[ops][grad]") {
  // Each backward(x, y, dy) with dy = 1 must equal (f(x + h) - f(x - h)) / 2h; h = 1e-6 balances the
  // O(h^2) truncation against rounding (about 1e-10 relative), so 1e-7 relative is a safe bound.
  const auto pts = rnd::normal<double>(rnd::key(5), {200}).to_vector();
  auto check_unary = [&](auto f, const char* name, double shift, double scale) {
    double worst = 0.0;
    for (double p : pts) {
      const double x = p * scale + shift, h = 1e-6;
      const double fd = (f(x + h) - f(x - h)) / (2 * h);
      const double an = f.backward(x, f(x), 1.0);
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
      worst = std::max({worst, std::fabs(fa - f.backward_a(a, b, y, 1.0)) / std::max(1.0, std::fabs(fa)),
                        std::fabs(fb - f.backward_b(a, b, y, 1.0)) / std::max(1.0, std::fabs(fb))});
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
  // Ties split the gradient evenly; where() routes it to the chosen side.
  CHECK(tg::fn::Maximum{}.backward_a(1.0, 1.0, 1.0, 1.0) == 0.5);
  CHECK(tg::fn::Select{}.backward_a<double>(1, 2.0) == 2.0);
  CHECK(tg::fn::Select{}.backward_b<double>(1, 2.0) == 0.0);
}

TEST_CASE("binary ops broadcast as NumPy does", "[ops][elementwise]") {
  const auto a = input(11, {2, 3, 4});
  const auto b = input(12, {3, 1});
  const auto c = input(13, {4}, 1.0, 5.0);
  const auto da = values(a), db = values(b), dc = values(c);
  std::vector<double> sum_ab(24), div_ac(24), max_ab(24);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) {
        const int o = (i * 3 + j) * 4 + k;
        sum_ab[o] = da[o] + db[j];
        div_ac[o] = da[o] / dc[k];
        max_ab[o] = std::max(da[o], db[j]);
      }
  CHECK((a + b).shape() == tg::Shape{2, 3, 4});
  check_close(values(a + b), sum_ab, 1e-6, 1e-6, "a + b");
  check_close(values(b + a), sum_ab, 1e-6, 1e-6, "b + a");
  check_close(values(a / c), div_ac, 1e-6, 1e-6, "a / c");
  check_close(values(tg::maximum(a, b)), max_ab, 0, 0, "maximum");
  check_close(values(a * 2.0f - 1.0), ref_unary(da, [](double v) { return v * 2 - 1; }), 1e-6, 1e-6, "a * 2 - 1");
  check_close(values(3.0 / c), ref_unary(dc, [](double v) { return 3 / v; }), 1e-6, 1e-6, "3 / c");
  check_close(values(1.0f - a), ref_unary(da, [](double v) { return 1 - v; }), 1e-6, 1e-6, "1 - a");
  CHECK(tg::add(tg::full<std::int32_t, D>({2}, 3), tg::full<std::int32_t, D>({1}, 4)).to_vector() == std::vector<std::int32_t>{7, 7});
  CHECK_THROWS_WITH(a + input(14, {2, 4}),
                    Contains("[add] shapes (2, 3, 4) and (2, 4) cannot be broadcast together (axis 1 of the result: 3 vs 2)"));
}

TEST_CASE("comparisons, where and cast", "[ops][elementwise]") {
  const auto a = input(21, {50});
  const auto b = input(22, {50});
  const auto da = values(a), db = values(b);
  const auto lt = tg::less(a, b).to_vector();
  const auto ge = tg::greater_equal(a, b).to_vector();
  const auto w = values(tg::where(tg::less(a, b), a, b));
  for (std::size_t i = 0; i < da.size(); ++i) {
    CHECK(lt[i] == (da[i] < db[i]));
    CHECK(ge[i] == (da[i] >= db[i]));
    CHECK(w[i] == std::min(da[i], db[i]));
  }
  CHECK(tg::equal(a, a).to_vector() == std::vector<std::uint8_t>(50, 1));
  CHECK(tg::not_equal(a, a).to_vector() == std::vector<std::uint8_t>(50, 0));
  // where broadcasts all three operands.
  const auto picked = tg::where(tg::from_vector<D>(std::vector<std::uint8_t>{1, 0}), tg::full<float, D>({3, 2}, 1.0f),
                                tg::full<float, D>({1}, -1.0f));
  CHECK(picked.to_vector() == std::vector<float>{1, -1, 1, -1, 1, -1});
  // Casts: f32 -> bf16 rounds as tg::bf16 does, bf16 -> f32 is exact, f32 -> int truncates.
  const auto h = tg::cast<tg::bf16>(a).to_vector();
  const auto af = a.to_vector();
  for (std::size_t i = 0; i < af.size(); ++i) CHECK(h[i].bits == tg::bf16(af[i]).bits);
  CHECK(values(tg::cast<float>(tg::cast<tg::bf16>(a))) == as_double(h));
  CHECK(tg::cast<std::int32_t>(tg::from_vector<D>(std::vector<float>{1.7f, -2.5f})).to_vector() == std::vector<std::int32_t>{1, -2});
  CHECK(tg::cast<float>(a).data() == a.data());  // same type: shared, no copy
}

namespace ops_test {
struct Half {  // a user's functor with another output type (int32 in, double out)
  TG_HD double operator()(std::int32_t v) const { return v / 2.0; }
};
}  // namespace ops_test

TEST_CASE("clip, map with another output type, and map2 with AddScaled", "[ops][elementwise]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto x = tg::from_vector<D>(std::vector<float>{-3.0f, -1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 2.0f, nan});
  const auto c = tg::clip(x, -1.0, 1.0).to_vector();
  const std::vector<float> want{-1.0f, -1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.0f};
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(c[i] == want[i]);
  CHECK(std::isnan(c[7]));  // as jnp.clip: NaN stays NaN
  CHECK_THROWS_WITH(tg::clip(x, 1.0, -1.0), Contains("[clip] needs lo <= hi, got [1, -1]"));
  // Derivative: 1 inside, 0 outside, 1/2 on a bound (JAX's tie rule for maximum / minimum).
  CHECK(tg::fn::Clip{-1.0, 1.0}.backward(1.0, 0.0, 1.0) == 0.5);
  CHECK(tg::fn::Clip{-1.0, 1.0}.backward(-2.0, 0.0, 1.0) == 0.0);
  CHECK(tg::fn::Clip{-1.0, 1.0}.backward(0.25, 0.0, 1.0) == 1.0);
  // map<Op, Out>: an int32 tensor mapped to doubles.
  const auto halves = tg::map<ops_test::Half, double>(tg::from_vector<D>(std::vector<std::int32_t>{1, 4, -3}), ops_test::Half{});
  CHECK(halves.to_vector() == std::vector<double>{0.5, 2.0, -1.5});
  // AddScaled: a + alpha b in the compute type, rounded once (bf16: one rounding of the f32 result).
  const auto a = input(23, {40}), b = input(24, {40});
  const auto got = tg::map2(tg::cast<tg::bf16>(a), tg::cast<tg::bf16>(b), tg::fn::AddScaled{0.3}).to_vector();
  const auto ha = tg::cast<tg::bf16>(a).to_vector(), hb = tg::cast<tg::bf16>(b).to_vector();
  for (std::size_t i = 0; i < got.size(); ++i)
    CHECK(got[i].bits == tg::bf16(static_cast<float>(ha[i]) + 0.3f * static_cast<float>(hb[i])).bits);
}

TEST_CASE("f32 <-> bf16 casts of large tensors equal the scalar conversion for every kind of value", "[ops][elementwise][bf16]") {
  // Large enough for the CPU's parallel, vectorised loop; every special case inside it.
  std::vector<std::uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                                     0x7f800001u, 0x7fbfffffu, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0xff7fffffu,
                                     0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x3f807fffu, 0x7f7f8000u, 0x33800000u};
  std::uint32_t state = 12345u;
  while (bits.size() < 70000) {  // the rest: random bit patterns (NaNs, subnormals and ties included)
    state = state * 1664525u + 1013904223u;
    bits.push_back(state);
  }
  std::vector<float> f(bits.size());
  std::memcpy(f.data(), bits.data(), bits.size() * sizeof(float));
  const auto x = tg::from_vector<D>(f);
  const auto h = tg::cast<tg::bf16>(x).to_vector();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < f.size(); ++i) wrong += h[i].bits != tg::bf16(f[i]).bits;
  CHECK(wrong == 0);
  // Back to f32: every one of the 65,536 bf16 patterns, exactly.
  std::vector<tg::bf16> all(65536 * 2);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = tg::bf16::from_bits(static_cast<std::uint16_t>(i));
  const auto back = tg::cast<float>(tg::from_vector<D>(all)).to_vector();
  wrong = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const float want = static_cast<float>(all[i]);
    wrong += std::memcmp(&back[i], &want, sizeof(float)) != 0;
  }
  CHECK(wrong == 0);
}

TEST_CASE("bf16 GELU and its gradient are the f32 computation rounded once to bf16", "[ops][elementwise][bf16]") {
  // On the CPU these run in oneDNN's kernels (f32 inside, one rounding); the reference is the functor in
  // f32, rounded. Two roundings of nearly equal f32 values may differ by one bf16 unit.
  const auto x = tg::cast<tg::bf16>(tg::random::normal<float, D>(tg::random::key(7), {40000}) * 3.0f);
  const auto y = tg::gelu(x).to_vector();
  const auto g = tg::grad([](const tg::Tensor<tg::bf16, D>& t) { return tg::sum(tg::cast<float>(tg::gelu(t))); })(x).to_vector();
  const auto xs = x.to_vector();
  auto ulps = [](tg::bf16 a, tg::bf16 b) {
    auto key = [](tg::bf16 v) { return v.bits & 0x8000u ? -static_cast<int>(v.bits & 0x7fffu) : static_cast<int>(v.bits); };
    return std::abs(key(a) - key(b));
  };
  int worst_y = 0, worst_g = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const float v = static_cast<float>(xs[i]);
    const tg::bf16 want_y(tg::fn::Gelu{}(v)), want_g(tg::fn::Gelu{}.backward(v, 0.0f, 1.0f));
    // Far in the negative tail (x < -5) the value is below 1e-7 and oneDNN's 0.5 x (1 + tanh(u)) (JAX's
    // formula) cancels in f32: there it must agree in absolute terms, to f32 rounding of 1 + tanh(u).
    const double tail = 1e-6 * (1.0 + static_cast<double>(v) * v);
    if (std::fabs(static_cast<double>(static_cast<float>(y[i])) - static_cast<float>(want_y)) > tail) worst_y = std::max(worst_y, ulps(y[i], want_y));
    if (std::fabs(static_cast<double>(static_cast<float>(g[i])) - static_cast<float>(want_g)) > tail) worst_g = std::max(worst_g, ulps(g[i], want_g));
  }
  CHECK(worst_y <= 1);
  CHECK(worst_g <= 1);
}

TEST_CASE("reductions over an axis and over everything", "[ops][reduce]") {
  const auto x = input(31, {3, 4, 5});
  const auto dx = values(x);
  auto at = [&](int i, int j, int k) { return dx[static_cast<std::size_t>((i * 4 + j) * 5 + k)]; };
  std::vector<double> s1(15), m1(15), lse1(15);
  std::vector<std::int32_t> am1(15);
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < 5; ++k) {
      double s = 0, m = -INFINITY, e = 0;
      int arg = 0;
      for (int j = 0; j < 4; ++j) {
        s += at(i, j, k);
        if (at(i, j, k) > m) m = at(i, j, k), arg = j;
      }
      for (int j = 0; j < 4; ++j) e += std::exp(at(i, j, k) - m);
      s1[i * 5 + k] = s, m1[i * 5 + k] = m, am1[i * 5 + k] = arg, lse1[i * 5 + k] = m + std::log(e);
    }
  check_close(values(tg::sum(x, 1)), s1, 1e-6, 1e-6, "sum axis 1");
  check_close(values(tg::mean(x, -2)), ref_unary(s1, [](double v) { return v / 4; }), 1e-6, 1e-6, "mean axis -2");
  check_close(values(tg::max(x, 1)), m1, 0, 0, "max axis 1");
  CHECK(tg::argmax(x, 1).to_vector() == am1);
  check_close(values(tg::logsumexp(x, 1)), lse1, 1e-6, 1e-6, "logsumexp axis 1");
  CHECK(tg::sum(x, 1, true).shape() == tg::Shape{3, 1, 5});
  CHECK(tg::max(x, 0, false).shape() == tg::Shape{4, 5});
  double total = 0;
  for (double v : dx) total += v;
  CHECK(tg::sum(x).rank() == 0);
  CHECK(tg::sum(x).item() == Approx(total).margin(1e-5));
  CHECK(tg::mean(x).item() == Approx(total / 60).margin(1e-6));
  CHECK(tg::max(x).item() == *std::max_element(dx.begin(), dx.end()));
  CHECK(tg::argmax(x).item() == std::max_element(dx.begin(), dx.end()) - dx.begin());
  CHECK_THROWS_WITH(tg::sum(x, 3), Contains("[sum] axis 3 is out of range for shape (3, 4, 5)"));
}

TEST_CASE("column reductions (inner > 1) equal the in-order loop bitwise, across column chunks", "[ops][reduce]") {
  // 130 columns: two full 64-wide chunks and a partial one; 3 outer rows; 37 reduced rows.
  const auto x = input(33, {3, 37, 130}, 3.0);
  const auto v = x.to_vector();
  std::vector<float> sum(3 * 130), max(3 * 130);
  for (int o = 0; o < 3; ++o)
    for (int c = 0; c < 130; ++c) {
      float s = 0.0f, m = -INFINITY;
      for (int k = 0; k < 37; ++k) {
        const float e = v[static_cast<std::size_t>((o * 37 + k) * 130 + c)];
        s += e;
        m = std::max(m, e);
      }
      sum[static_cast<std::size_t>(o * 130 + c)] = s, max[static_cast<std::size_t>(o * 130 + c)] = m;
    }
  CHECK(tg::sum(x, 1).to_vector() == sum);
  CHECK(tg::max(x, 1).to_vector() == max);
  const auto means = tg::mean(x, 1).to_vector();
  for (std::size_t i = 0; i < means.size(); ++i) CHECK(means[i] == sum[i] / 37.0f);
}

TEST_CASE("whole-tensor sums are accurate and bitwise reproducible", "[ops][reduce]") {
  // 1,000,003 elements: several chunk levels and a ragged tail. Chunked f32 accumulation keeps the
  // relative error near 4096 * 2^-24 ~ 2.4e-4 at worst; against the double sum we allow 1e-4 relative.
  const auto x = input(41, {1000003}, 1.0, 0.5);
  const auto dx = values(x);
  double want = 0;
  for (double v : dx) want += v;
  const float got = tg::sum(x).item();
  CHECK(got == Approx(want).epsilon(1e-4));
  CHECK(tg::sum(x).item() == got);  // same bits every time
  CHECK(tg::max(x).item() == static_cast<float>(*std::max_element(dx.begin(), dx.end())));
  CHECK(tg::mean(x).item() == Approx(want / 1000003).epsilon(1e-4));
#if defined(_OPENMP) && !defined(TG_TEST_CUDA)
  // The CPU result does not depend on the thread count: every chunk is summed by one thread, in order.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const float one_thread = tg::sum(x).item();
  omp_set_num_threads(threads);
  CHECK(one_thread == got);
#endif
}

TEST_CASE("softmax and log_softmax are stable and normalised", "[ops][reduce]") {
  const auto x = input(51, {6, 10}, 3.0);
  const auto big = x + 1000.0f;  // would overflow exp without the max shift
  const auto p = values(tg::softmax(big));
  const auto lp = values(tg::log_softmax(big));
  const auto dx = values(x);
  for (int r = 0; r < 6; ++r) {
    double m = -INFINITY, s = 0, total = 0;
    for (int k = 0; k < 10; ++k) m = std::max(m, dx[r * 10 + k]);
    for (int k = 0; k < 10; ++k) s += std::exp(dx[r * 10 + k] - m);
    for (int k = 0; k < 10; ++k) {
      const double want_log = dx[r * 10 + k] - m - std::log(s);
      CHECK(lp[r * 10 + k] == Approx(want_log).margin(2e-4));  // 1000 + x loses ~1e-4 in float
      CHECK(p[r * 10 + k] == Approx(std::exp(want_log)).margin(2e-4));
      total += p[r * 10 + k];
    }
    CHECK(total == Approx(1.0).margin(1e-5));
  }
  CHECK(std::isfinite(tg::logsumexp(big, -1).to_vector()[0]));
}

TEST_CASE("matmul matches a double reference for every transpose", "[ops][matmul]") {
  const std::int64_t m = 37, k = 53, n = 29;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const auto a = input(61, ta ? tg::Shape{k, m} : tg::Shape{m, k});
      const auto b = input(62, tb ? tg::Shape{n, k} : tg::Shape{k, n});
      const auto da = values(a), db = values(b);
      std::vector<double> want(static_cast<std::size_t>(m * n), 0.0);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j)
          for (std::int64_t p = 0; p < k; ++p)
            want[i * n + j] += da[ta ? p * m + i : i * k + p] * db[tb ? j * k + p : p * n + j];
      INFO("transpose_a " << ta << ", transpose_b " << tb);
      // f32 accumulation over k = 53 terms of size ~1: |err| ~ sqrt(k) 2^-24 * 8 < 1e-5.
      check_close(values(tg::matmul(a, b, ta, tb)), want, 1e-5, 1e-5, "matmul f32");
      const auto a64 = tg::cast<double>(a), b64 = tg::cast<double>(b);
      check_close(values(tg::matmul(a64, b64, ta, tb)), want, 1e-12, 1e-12, "matmul f64");
    }
  CHECK_THROWS_WITH(tg::matmul(input(63, {512, 784}), input(64, {128, 10})),
                    Contains("[matmul] inner dims differ: (512, 784) @ (128, 10)"));
  CHECK_THROWS_WITH(tg::matmul(input(63, {4}), input(64, {4, 2})), Contains("[matmul] needs operands of rank >= 2"));
}

TEST_CASE("bf16 GEMMs stay close to f32", "[ops][matmul][bf16]") {
  const auto a = input(71, {64, 96}), b = input(72, {96, 48}), bias = input(73, {48});
  const auto want = values(tg::matmul(a, b));
  const auto got = values(tg::matmul(tg::cast<tg::bf16>(a), tg::cast<tg::bf16>(b)));
  const auto y_want = values(tg::linear(a, b, bias, tg::Activation::gelu));
  const auto y_got = values(tg::linear(tg::cast<tg::bf16>(a), tg::cast<tg::bf16>(b), tg::cast<tg::bf16>(bias), tg::Activation::gelu));
  // The error bound, element by element: rounding a and b to bf16 (2^-9 relative each) perturbs every
  // product by at most 2^-8 of |a||b|, so |err| <= 2^-8 sum_k |a_ik||b_kj|; rounding the result to bf16
  // adds 2^-9 of it. Through linear: the bias rounds too (2^-9 |b|), and GELU's slope is at most 1.13.
  const auto abs_sum = values(tg::matmul(tg::abs(a), tg::abs(b)));
  const auto db = values(bias);
  int bad = 0, bad_linear = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double tol = 0x1p-8 * abs_sum[i] + 0x1p-9 * std::fabs(want[i]) + 1e-6;
    bad += std::fabs(got[i] - want[i]) > tol;
    const double tol_y = 1.13 * (0x1p-8 * abs_sum[i] + 0x1p-9 * std::fabs(db[i % 48])) + 0x1p-9 * std::fabs(y_want[i]) + 1e-5;
    bad_linear += std::fabs(y_got[i] - y_want[i]) > tol_y;
  }
  CHECK(bad == 0);
  CHECK(bad_linear == 0);
  // And the bound is not vacuous: bf16 really differs from f32 here.
  CHECK(got != want);
}

TEST_CASE("fused linear equals the unfused composition", "[ops][matmul][linear]") {
  const auto x = input(81, {33, 40}), w = input(82, {40, 24}, 0.2), b = input(83, {24});
  for (auto act : {tg::Activation::none, tg::Activation::relu, tg::Activation::gelu, tg::Activation::gelu_exact, tg::Activation::silu}) {
    INFO("activation " << tg::name_of(act));
    tg::set_fused_linear(true);
    const auto fused = values(tg::linear(x, w, b, act));
    const auto [y, z] = tg::linear_with_pre_activation(x, w, b, act);
    tg::set_fused_linear(false);
    const auto unfused = values(tg::linear(x, w, b, act));
    tg::set_fused_linear(true);
    const auto z_ref = values(tg::matmul(x, w) + b);
    auto act_ref = [&](double v) {
      switch (act) {
        case tg::Activation::relu: return v > 0 ? v : 0.0;
        case tg::Activation::gelu: return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
        case tg::Activation::gelu_exact: return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
        case tg::Activation::silu: return v / (1 + std::exp(-v));
        default: return v;
      }
    };
    // oneDNN's and cuBLASLt's activation kernels use their own tanh/erf approximations: 1e-5 covers them.
    check_close(fused, unfused, 1e-5, 1e-5, "fused vs unfused");
    check_close(values(y), ref_unary(z_ref, act_ref), 1e-5, 1e-5, "training forward");
    check_close(values(z), z_ref, 1e-5, 1e-5, "pre-activation");
  }
  CHECK_THROWS_WITH(tg::linear(x, w, input(84, {23})), Contains("[linear] bias must have shape (24,), got (23,)"));
}

TEST_CASE("fused backward GEMMs equal their compositions", "[ops][matmul][linear]") {
  const auto g_next = input(91, {32, 16}), w_next = input(92, {24, 16}, 0.3), z = input(93, {32, 24});
  for (auto act : {tg::Activation::gelu, tg::Activation::relu, tg::Activation::silu, tg::Activation::none}) {
    INFO("activation " << tg::name_of(act));
    const auto [dz, db] = tg::matmul_dact_bgrad(g_next, w_next, true, z, act);
    const auto g = values(tg::matmul(g_next, w_next, false, true));
    const auto dzv = values(z);
    std::vector<double> want(g.size()), want_db(24, 0.0);
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double v = dzv[i];
      const double d = act == tg::Activation::gelu ? tg::fn::Gelu{}.backward(v, 0.0, 1.0)
                       : act == tg::Activation::relu ? (v > 0 ? 1.0 : 0.0)
                       : act == tg::Activation::silu ? tg::fn::Silu{}.backward(v, 0.0, 1.0) : 1.0;
      want[i] = g[i] * d;
      want_db[i % 24] += want[i];
    }
    check_close(values(dz), want, 1e-5, 1e-5, "dz");
    check_close(values(db), want_db, 1e-4, 1e-5, "db");
  }
  {
    // bf16 (unit roundoff u = 2^-8): on CUDA cuBLASLt's DGELU_BGRAD rounds its f32 result once (u, plus the
    // epilogue's own 5.6e-5 measured in f32 on an H200); on the CPU the GEMM's output and dz are rounded
    // separately (2u + u^2). So dz is within 2u = 7.8e-3 (8e-3) relative of the double result of the same
    // bf16 inputs, and db within 8e-3 of the sum of |dz| (each term's error) plus its own rounding.
    const auto gb = tg::cast<tg::bf16>(g_next), wb = tg::cast<tg::bf16>(w_next), zb = tg::cast<tg::bf16>(z);
    const auto [dz, db] = tg::matmul_dact_bgrad(gb, wb, true, zb, tg::Activation::gelu);
    const auto g = values(tg::matmul(tg::cast<double>(gb), tg::cast<double>(wb), false, true));
    const auto zv = values(zb), got_dz = values(dz), got_db = values(db);
    std::vector<double> want_db(24, 0.0), abs_db(24, 0.0);
    int bad = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double want = g[i] * tg::fn::Gelu{}.backward(zv[i], 0.0, 1.0);
      want_db[i % 24] += want;
      abs_db[i % 24] += std::fabs(want);
      if (std::fabs(got_dz[i] - want) > 8e-3 * std::fabs(want) + 1e-6) ++bad;
    }
    CHECK(bad == 0);
    for (std::size_t j = 0; j < 24; ++j) CHECK(std::fabs(got_db[j] - want_db[j]) <= 8e-3 * abs_db[j] + 4e-3 * std::fabs(want_db[j]));
  }
  const auto x = input(94, {32, 20}), dz = input(95, {32, 12});
  const auto [dw, db] = tg::matmul_bgrad(x, dz);
  check_close(values(dw), values(tg::matmul(x, dz, true, false)), 1e-5, 1e-5, "dw");
  check_close(values(db), values(tg::sum(dz, 0)), 1e-5, 1e-5, "db");
}

TEST_CASE("softmax cross-entropy, accuracy and one_hot", "[ops][nn]") {
  const auto logits = input(101, {8, 10}, 4.0);
  const std::vector<std::int32_t> lv{0, 9, 3, 3, 7, 1, 2, 5};
  const auto labels = tg::from_vector<D>(lv);
  const auto dl = values(logits);
  std::vector<double> want(8);
  int correct = 0;
  for (int r = 0; r < 8; ++r) {
    double m = -INFINITY, s = 0;
    int arg = 0;
    for (int k = 0; k < 10; ++k)
      if (dl[r * 10 + k] > m) m = dl[r * 10 + k], arg = k;
    for (int k = 0; k < 10; ++k) s += std::exp(dl[r * 10 + k] - m);
    want[r] = m + std::log(s) - dl[r * 10 + lv[r]];
    correct += arg == lv[r];
  }
  check_close(values(tg::softmax_cross_entropy_with_integer_labels(logits, labels)), want, 1e-5, 1e-5, "cross-entropy");
  // Stable for logits far from 0.
  const auto shifted = values(tg::softmax_cross_entropy_with_integer_labels(logits + 5000.0f, labels));
  check_close(shifted, want, 2e-3, 1e-3, "cross-entropy at +5000");  // 5000 + x keeps ~2^-11 of x
  CHECK(tg::accuracy(logits, labels).item() == Approx(correct / 8.0));
  const auto oh = tg::one_hot<float>(tg::from_vector<D>(std::vector<std::int32_t>{2, 0, 5}), 3).to_vector();
  CHECK(oh == std::vector<float>{0, 0, 1, 1, 0, 0, 0, 0, 0});  // 5 is out of range: a zero row, as JAX
  const auto ten = tg::from_vector<D>(std::vector<std::int32_t>{0, 1, 2, 3, 10, 1, 2, 3});
  const auto minus_one = tg::from_vector<D>(std::vector<std::int32_t>{-1, 1, 2, 3, 1, 1, 2, 3});
  const std::string ten_message = "[softmax_cross_entropy_with_integer_labels] label 10 at position 4 is out of range for 10 classes";
#if defined(TG_TEST_CUDA)
  // CUDA (docs/cuda.md): the labels are checked on the device; the call that queued the check returns,
  // and the error is raised, once, by the next synchronisation or host read, then cleared.
  tg::cuda::synchronize();  // nothing pending
  const auto bad_loss = tg::softmax_cross_entropy_with_integer_labels(logits, ten);
  CHECK_THROWS_WITH(tg::cuda::synchronize(), Contains(ten_message) && Contains("found on the device"));
  CHECK_NOTHROW(tg::cuda::synchronize());  // raised once
  (void)tg::softmax_cross_entropy_with_integer_labels(logits, minus_one);
  const auto upload = tg::from_vector<D>(std::vector<float>{1.0f});  // a transfer to the device does not raise it
  CHECK_THROWS_WITH(bad_loss.to_vector(), Contains("label -1 at position 0"));  // a host read does
  CHECK(upload.item() == 1.0f);
  // The first error since the last raise wins; a later one is not reported on top of it.
  (void)tg::softmax_cross_entropy_with_integer_labels(logits, ten);
  (void)tg::softmax_cross_entropy_with_integer_labels(logits, minus_one);
  CHECK_THROWS_WITH(tg::cuda::synchronize(), Contains(ten_message));
  CHECK_NOTHROW(tg::cuda::synchronize());
#else
  // CPU: the op checks and throws itself.
  CHECK_THROWS_WITH(tg::softmax_cross_entropy_with_integer_labels(logits, ten), Contains(ten_message));
  CHECK_THROWS_WITH(tg::softmax_cross_entropy_with_integer_labels(logits, minus_one), Contains("label -1 at position 0"));
#endif
  CHECK_THROWS_WITH(tg::softmax_cross_entropy_with_integer_labels(logits, tg::from_vector<D>(std::vector<std::int32_t>{1, 2})),
                    Contains("labels of shape (2,) do not match logits of shape (8, 10)"));
}

#if defined(TG_TEST_CUDA)
TEST_CASE("CUDA ops equal the CPU's", "[ops][cuda]") {
  // Same functors on both sides: elementwise results agree to the last bit except where CUDA's libm
  // differs (exp/tanh/erf: 2 ulp); GEMMs sum in another order (1e-5).
  const auto xc = rnd::normal<float>(rnd::key(7), {300, 70});
  const auto xg = tg::device_put<tg::Cuda>(xc);
  check_close(values(tg::gelu(xg)), values(tg::gelu(xc)), 1e-6, 1e-6, "gelu");
  check_close(values(tg::softmax(xg)), values(tg::softmax(xc)), 1e-6, 1e-6, "softmax");
  check_close(values(tg::sum(xg, 0)), values(tg::sum(xc, 0)), 0, 0, "sum axis 0 (same order)");
  CHECK(tg::sum(xg).item() == tg::sum(xc).item());  // same chunking, same order
  const auto wc = rnd::normal<float>(rnd::key(8), {70, 40});
  const auto bc = rnd::normal<float>(rnd::key(9), {40});
  const auto wg = tg::device_put<tg::Cuda>(wc), bg = tg::device_put<tg::Cuda>(bc);
  check_close(values(tg::matmul(xg, wg)), values(tg::matmul(xc, wc)), 1e-4, 1e-5, "matmul");
  for (auto act : {tg::Activation::none, tg::Activation::relu, tg::Activation::gelu}) {
    tg::set_fused_linear(true);
    const auto fused = values(tg::linear(xg, wg, bg, act));
    tg::set_fused_linear(false);
    const auto unfused = values(tg::linear(xg, wg, bg, act));
    tg::set_fused_linear(true);
    INFO("activation " << tg::name_of(act));
    // cuBLASLt's GELU epilogue against our tanh-form functor: equal to 1e-5 iff it is the tanh form.
    check_close(fused, unfused, 1e-4, 1e-5, "cuBLASLt epilogue vs unfused");
    check_close(fused, values(tg::linear(xc, wc, bc, act)), 1e-4, 1e-5, "CUDA vs CPU");
  }
}
#endif
