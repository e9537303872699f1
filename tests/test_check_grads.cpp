// Written as a user would: their own parameter struct and loss, registered with TG_PYTREE, and a Catch2
// test that checks its gradients with tg::check_grads. docs/autodiff.md shows this same file.
#include <catch2/catch.hpp>
#include <tapegrad/tapegrad.hpp>

namespace my_model {

// A small regression model: y = tanh(x W + b) . v, with a learned scale.
struct Params {
  tg::Tensor<double> w, b, v, scale;
};
TG_PYTREE(Params, w, b, v, scale)

tg::Tensor<double> loss(const Params& p, const tg::Tensor<double>& x, const tg::Tensor<double>& y) {
  const auto h = tg::tanh(tg::linear(x, p.w, p.b));
  const auto pred = tg::sum(h * p.v, -1) * p.scale;
  return tg::mean(tg::square(pred - y));
}

}  // namespace my_model

TEST_CASE("my model's gradients match finite differences", "[user]") {
  namespace rnd = tg::random;
  const my_model::Params p{rnd::normal<double>(rnd::key(1), {5, 3}), rnd::normal<double>(rnd::key(2), {3}),
                           rnd::normal<double>(rnd::key(3), {3}), tg::full<double>({}, 0.7)};
  const auto x = rnd::normal<double>(rnd::key(4), {16, 5});
  const auto y = rnd::normal<double>(rnd::key(5), {16});

  const tg::GradCheckResult result = tg::check_grads(my_model::loss, p, x, y);
  INFO(result);  // names the worst leaf and its relative error if anything is off
  CHECK(result.passed);

  // A deliberately wrong gradient is caught: scale the loss by a constant the tape cannot see.
  auto wrong = [](const my_model::Params& q, const tg::Tensor<double>& xx, const tg::Tensor<double>& yy) {
    const double k = q.v.trace().tape != 0 ? 1.0 : 2.0;  // traced (gradient pass) vs plain (finite differences)
    return my_model::loss(q, xx, yy) * k;
  };
  CHECK_FALSE(tg::check_grads(wrong, p, x, y, tg::GradCheckOptions{.print = false}).passed);
}
