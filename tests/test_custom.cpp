// autodiff/custom.hpp: custom_vjp (a straight-through estimator, a stable log-sum-exp to second order, a
// wrong rule caught in both modes) and checkpoint (the same gradients, to second order). Built for the CPU,
// and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "autodiff_common.hpp"

namespace custom_tests {

using ho_test::check_close;
using ho_test::dvec;

TEST_CASE("custom_vjp: a straight-through estimator and a stable log-sum-exp, to second order", "[custom][custom_vjp]") {
  // Straight-through: forward the sign, backward the identity.
  auto ste = tg::custom_vjp([](const tg::Tensor<double, D>& x) { return std::pair{tg::where(tg::greater(x, tg::zeros<double, D>({})), tg::ones<double, D>({}), tg::full<double, D>({}, -1.0)), 0}; },
                            [](int, const tg::Tensor<double, D>& dy) { return dy; });
  const auto x = dvec({0.5, -2.0, 3.0}, {3});
  check_close(ste(x), {1.0, -1.0, 1.0}, 0.0);
  check_close(tg::grad([&](const tg::Tensor<double, D>& v) { return tg::sum(ste(v) * v); })(x), {1.0 + 0.5, -1.0 - 2.0, 1.0 + 3.0}, 1e-15);
  // log-sum-exp with the softmax as its residual; differentiable twice because the residual is traced.
  auto lse = tg::custom_vjp(
      [](const tg::Tensor<double, D>& v) {
        const auto m = tg::max(v).untraced();
        const auto y = tg::log(tg::sum(tg::exp(v - m))) + m;
        return std::pair{y, tg::exp(v - y)};
      },
      [](const tg::Tensor<double, D>& softmax, const tg::Tensor<double, D>& dy) { return softmax * dy; });
  const auto big = dvec({1000.0, 1001.0, 999.0}, {3});
  CHECK(std::isfinite(lse(big).item()));
  CHECK(lse(big).item() == Approx(1001.0 + std::log(1.0 + std::exp(-1.0) + std::exp(-2.0))).epsilon(1e-15));
  auto f = [&](const tg::Tensor<double, D>& v) { return lse(v * 2.0) * 0.5; };
  const auto r = tg::check_grads(f, x, tg::GradCheckOptions{.order = 2, .modes = tg::fwd | tg::rev, .print = false});
  INFO(r);
  CHECK(r.passed);
  // A wrong backward rule is caught, in both modes (forward mode is derived from it).
  auto wrong = tg::custom_vjp([](const tg::Tensor<double, D>& v) { return std::pair{tg::sum(v * v), v}; },
                              [](const tg::Tensor<double, D>& v, const tg::Tensor<double, D>& dy) { return v * dy; });  // should be 2 v dy
  const auto bad = tg::check_grads(wrong, x, tg::GradCheckOptions{.modes = tg::fwd | tg::rev, .print = false});
  CHECK_FALSE(bad.passed);
  for (const auto& leaf : bad.leaves) CHECK_FALSE(leaf.passed());
}

TEST_CASE("checkpoint recomputes the forward in the backward pass with the same gradients, to second order", "[custom][checkpoint]") {
  const ho_test::Net<D> p = ho_test::init_net<D>(21);
  const auto xs = rnd::uniform<double, D>(rnd::key(22), {7, 2});
  auto block = [](const ho_test::Net<D>& q, const tg::Tensor<double, D>& x) { return ho_test::net(q, x); };
  auto plain = [&](const ho_test::Net<D>& q) { return tg::sum(tg::square(block(q, xs))); };
  auto remat = [&](const ho_test::Net<D>& q) { return tg::sum(tg::square(tg::checkpoint(block)(q, xs))); };
  std::string why;
  CHECK(tg::tree_all_close(tg::grad(remat)(p), tg::grad(plain)(p), 1e-15, 1e-15, &why));
  INFO(why);
  const auto r = tg::check_grads(remat, p, tg::GradCheckOptions{.order = 2, .modes = tg::fwd | tg::rev, .print = false});
  INFO(r);
  CHECK(r.passed);
}

}  // namespace custom_tests
