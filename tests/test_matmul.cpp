// ops/matmul.hpp: matmul for every transpose, batched and broadcast over leading axes, bf16 GEMMs, the fused
// linear layer and fused backward GEMMs against their compositions, and their derivatives against finite
// differences in double. Built for the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "ops_common.hpp"

#include <cmath>
#include <vector>

namespace matmul_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;
using namespace op_test;

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
      const double d = act == tg::Activation::gelu ? tg::fn::Gelu{}.derivative(v, 0.0)
                       : act == tg::Activation::relu ? (v > 0 ? 1.0 : 0.0)
                       : act == tg::Activation::silu ? tg::fn::Silu{}.derivative(v, 0.0) : 1.0;
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
      const double want = g[i] * tg::fn::Gelu{}.derivative(zv[i], 0.0);
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


TEST_CASE("matmul batches over leading axes with NumPy broadcasting, for every transpose", "[ops][transformer][matmul]") {
  struct Case {
    tg::Shape a, b;
    bool ta, tb;
  };
  const std::vector<Case> cases = {
      {{2, 3, 4, 5}, {2, 3, 5, 6}, false, false},  // same batch
      {{2, 3, 4, 5}, {3, 6, 5}, false, true},      // b broadcast over the first axis
      {{2, 1, 5, 4}, {1, 3, 5, 6}, true, false},   // both broadcast
      {{3, 5, 4}, {3, 6, 5}, true, true},
      {{2, 3, 4, 5}, {5, 6}, false, false},        // a 2-d weight: one GEMM over the folded batch
      {{4, 5}, {3, 5, 6}, false, false},           // a 2-d left operand broadcast over b's batch
      {{2, 5, 4}, {5, 6}, true, false},
  };
  int seed = 10;
  for (const auto& c : cases) {
    INFO("a " << c.a << (c.ta ? "^T" : "") << " @ b " << c.b << (c.tb ? "^T" : ""));
    const auto a = op_test::dnormal(seed++, c.a), b = op_test::dnormal(seed++, c.b);
    tg::Shape want_shape;
    const auto want = op_test::ref_matmul(a.to_vector(), c.a, b.to_vector(), c.b, c.ta, c.tb, want_shape);
    const auto got = tg::matmul(a, b, c.ta, c.tb);
    REQUIRE(got.shape() == want_shape);
    op_test::check_close(got.to_vector(), want, 1e-12, "f64 values");
    const auto got32 = tg::matmul(tg::cast<float>(a), tg::cast<float>(b), c.ta, c.tb);
    op_test::check_close(op_test::host(got32), want, 2e-5, "f32 values");
    const auto got16 = tg::cast<float>(tg::matmul(tg::cast<tg::bf16>(a), tg::cast<tg::bf16>(b), c.ta, c.tb));
    op_test::check_close(op_test::host(got16), want, 0.05, "bf16 values");
    op_test::check_fd("batched matmul", op_test::Leaves3<double>{a, b, tg::zeros<double, D>({})},
                   [&](const op_test::Leaves3<double>& p) { return tg::matmul(p.a, p.b, c.ta, c.tb); });
  }
  CHECK_THROWS_WITH(tg::matmul(op_test::dnormal(1, {2, 3, 4}), op_test::dnormal(2, {2, 5, 6})), Contains("inner dims differ"));
  CHECK_THROWS_WITH(tg::matmul(op_test::dnormal(1, {2, 3, 4}), op_test::dnormal(2, {3, 4, 6})), Contains("cannot be broadcast"));
  CHECK_THROWS_WITH(tg::matmul(op_test::dnormal(1, {4}), op_test::dnormal(2, {4, 6})), Contains("rank >= 2"));
}


TEST_CASE("matmul and linear differentiate correctly", "[autodiff][matmul]") {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("transpose_a " << ta << ", transpose_b " << tb);
      check_op("matmul", [&](auto a, auto b) { return tg::matmul(a, b, ta, tb); },
               AB<double, D>{dnormal(31, ta ? tg::Shape{5, 3} : tg::Shape{3, 5}), dnormal(32, tb ? tg::Shape{4, 5} : tg::Shape{5, 4})});
    }
  const auto x = dnormal(33, {6, 5});
  for (auto act : {tg::Activation::none, tg::Activation::relu, tg::Activation::gelu, tg::Activation::gelu_exact, tg::Activation::silu}) {
    INFO("activation " << tg::name_of(act));
    check_op("linear (w, b)", [&](auto w, auto b) { return tg::linear(x, w, b, act); }, AB<double, D>{dnormal(34, {5, 4}), dnormal(35, {4})});
    check_op("linear (x, b)", [&](auto xx, auto b) { return tg::linear(xx, dnormal(36, {5, 4}), b, act); }, AB<double, D>{x, dnormal(37, {4})});
  }
}

#if defined(TG_TEST_CUDA)
TEST_CASE("CUDA GEMMs and the fused layer equal the CPU's", "[ops][cuda]") {
  // GEMMs sum in another order (1e-5).
  const auto xc = rnd::normal<float>(rnd::key(7), {300, 70});
  const auto xg = tg::device_put<tg::Cuda>(xc);
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

}  // namespace matmul_tests
