// ops/elementwise.hpp: unary and binary math against double references, NumPy broadcasting, comparisons,
// where, cast, clip, map, bf16 casts and GELU, and every elementwise op's derivatives against finite
// differences in double, to second order in both modes (the functors themselves: test_math.cpp). Built for
// the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "ops_common.hpp"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace elementwise_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;
using namespace op_test;

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
  CHECK(tg::fn::Clip{-1.0, 1.0}.derivative(1.0, 0.0) == 0.5);
  CHECK(tg::fn::Clip{-1.0, 1.0}.derivative(-2.0, 0.0) == 0.0);
  CHECK(tg::fn::Clip{-1.0, 1.0}.derivative(0.25, 0.0) == 1.0);
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
    const tg::bf16 want_y(tg::fn::Gelu{}(v)), want_g(tg::fn::Gelu{}.derivative(v, 0.0f));
    // Far in the negative tail (x < -5) the value is below 1e-7 and oneDNN's 0.5 x (1 + tanh(u)) (JAX's
    // formula) cancels in f32: there it must agree in absolute terms, to f32 rounding of 1 + tanh(u).
    const double tail = 1e-6 * (1.0 + static_cast<double>(v) * v);
    if (std::fabs(static_cast<double>(static_cast<float>(y[i])) - static_cast<float>(want_y)) > tail) worst_y = std::max(worst_y, ulps(y[i], want_y));
    if (std::fabs(static_cast<double>(static_cast<float>(g[i])) - static_cast<float>(want_g)) > tail) worst_g = std::max(worst_g, ulps(g[i], want_g));
  }
  CHECK(worst_y <= 1);
  CHECK(worst_g <= 1);
}


TEST_CASE("every differentiable op's gradient matches finite differences in double", "[autodiff][ops]") {
  const AB<double, D> any{dnormal(1, {3, 4}, 1.5), dnormal(2, {3, 4})};
  const AB<double, D> pos{dnormal(3, {3, 4}, 0.3, 2.0), dnormal(4, {3, 4}, 0.3, 2.0)};
  check_op("exp", [](auto a, auto) { return tg::exp(a); }, any);
  check_op("log", [](auto a, auto) { return tg::log(a); }, pos);
  check_op("tanh", [](auto a, auto) { return tg::tanh(a); }, any);
  check_op("sigmoid", [](auto a, auto) { return tg::sigmoid(a); }, any);
  check_op("relu", [](auto a, auto) { return tg::relu(a); }, any);
  check_op("gelu", [](auto a, auto) { return tg::gelu(a); }, any);
  check_op("gelu_exact", [](auto a, auto) { return tg::gelu_exact(a); }, any);
  check_op("silu", [](auto a, auto) { return tg::silu(a); }, any);
  check_op("sin", [](auto a, auto) { return tg::sin(a); }, any);
  check_op("cos", [](auto a, auto) { return tg::cos(a); }, any);
  check_op("erf", [](auto a, auto) { return tg::erf(a); }, any);
  check_op("square", [](auto a, auto) { return tg::square(a); }, any);
  check_op("sqrt", [](auto a, auto) { return tg::sqrt(a); }, pos);
  check_op("rsqrt", [](auto a, auto) { return tg::rsqrt(a); }, pos);
  check_op("abs", [](auto a, auto) { return tg::abs(a); }, any);
  check_op("neg", [](auto a, auto) { return -a; }, any);
  check_op("pow", [](auto a, auto) { return tg::pow(a, 2.5); }, pos);
  check_op("clip", [](auto a, auto) { return tg::clip(a, -0.8, 0.9); }, any);
  check_op("map2 AddScaled", [](auto a, auto b) { return tg::map2(a, b, tg::fn::AddScaled{-0.7}); }, any);
  check_op("add", [](auto a, auto b) { return a + b; }, any);
  check_op("sub", [](auto a, auto b) { return a - b; }, any);
  check_op("mul", [](auto a, auto b) { return a * b; }, any);
  check_op("div", [](auto a, auto b) { return a / b; }, pos);
  check_op("maximum", [](auto a, auto b) { return tg::maximum(a, b); }, any);
  check_op("minimum", [](auto a, auto b) { return tg::minimum(a, b); }, any);
  check_op("scalar ops", [](auto a, auto) { return (2.0 - a * 3.0) / 4.0 + 1.0 / (a * a + 1.0); }, any);
  check_op("where", [](auto a, auto b) { return tg::where(tg::greater(a, b), a * 2.0, b); }, any);
  check_op("reshape", [](auto a, auto) { return tg::square(a.reshape({2, -1})); }, any);
  check_op("cast f64 -> f64", [](auto a, auto) { return tg::cast<double>(a) * 3.0; }, any);
  check_op("device round trip", [](auto a, auto) { return tg::device_put<D>(a.template to<tg::Cpu>()) * 3.0; }, any);
}

TEST_CASE("broadcasting sums cotangents back to each input's shape", "[autodiff][ops]") {
  check_op("add (3,4) + (4,)", [](auto a, auto b) { return a + b; }, AB<double, D>{dnormal(5, {3, 4}), dnormal(6, {4})});
  check_op("mul (3,1) * (1,4)", [](auto a, auto b) { return a * b; }, AB<double, D>{dnormal(7, {3, 1}), dnormal(8, {1, 4})});
  check_op("div (2,3,4) / (3,1)", [](auto a, auto b) { return a / b; },
           AB<double, D>{dnormal(9, {2, 3, 4}), dnormal(10, {3, 1}, 0.2, 2.0)});
  check_op("maximum () vs (3,4)", [](auto a, auto b) { return tg::maximum(a, b); }, AB<double, D>{dnormal(11, {}), dnormal(12, {3, 4})});
  check_op("broadcast_to", [](auto a, auto) { return tg::broadcast_to(a, tg::Shape{2, 3, 4}); }, AB<double, D>{dnormal(13, {3, 1}), dnormal(14, {1})});
}

#if defined(TG_TEST_CUDA)
TEST_CASE("CUDA elementwise ops equal the CPU's", "[ops][cuda]") {
  // Same functors on both sides: results agree to the last bit except where CUDA's libm differs
  // (exp/tanh/erf: 2 ulp).
  const auto xc = rnd::normal<float>(rnd::key(7), {300, 70});
  const auto xg = tg::device_put<tg::Cuda>(xc);
  check_close(values(tg::gelu(xg)), values(tg::gelu(xc)), 1e-6, 1e-6, "gelu");
}
#endif

}  // namespace elementwise_tests
