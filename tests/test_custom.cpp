// autodiff/custom.hpp: custom_vjp (a straight-through estimator, a stable log-sum-exp to second order, a
// wrong rule caught in both modes), custom_vjp and custom_jvp against JAX to second order
// (tests/data/custom_rules_golden.txt from scripts/custom_rules_golden.py), and checkpoint (the same
// gradients, to second order). Built for the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "autodiff_common.hpp"

#include <fstream>
#include <functional>
#include <map>
#include <sstream>

namespace custom_tests {

using ho_test::check_close;
using ho_test::dvec;
using T = tg::Tensor<double, D>;

/// tests/data/custom_rules_golden.txt: name -> values.
const std::map<std::string, std::vector<double>>& jax_values() {
  static const std::map<std::string, std::vector<double>> table = [] {
    std::map<std::string, std::vector<double>> t;
    const std::string path = test_data_dir() + "/custom_rules_golden.txt";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path + " (made by scripts/custom_rules_golden.py)");
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream ls(line);
      std::string name;
      std::size_t n = 0;
      ls >> name >> n;
      std::vector<double> v(n);
      for (double& e : v) ls >> e;
      if (!ls) throw std::runtime_error("bad line in " + path + ": " + line);
      t[name] = v;
    }
    return t;
  }();
  return table;
}

/// f's value, gradient and Hessian (forward over reverse, tg::hessian; reverse over reverse, jacrev of
/// grad) at JAX's point, against JAX's.
template <class F>
void check_against_jax(const std::string& name, F f) {
  INFO(name);
  const auto x = dvec({0.3, -1.2, 0.7}, {3});
  const auto& want = jax_values();
  REQUIRE(want.count(name + ".value"));
  check_close(f(x), want.at(name + ".value"), 1e-13);
  check_close(tg::grad(f)(x), want.at(name + ".grad"), 1e-13);
  check_close(tg::hessian(f)(x), want.at(name + ".hessian_fwd_rev"), 1e-13);
  check_close(tg::jacrev(tg::grad(f))(x), want.at(name + ".hessian_rev_rev"), 1e-13);
}

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

TEST_CASE("custom_vjp's rule is the innermost derivative only, as in JAX: gradient reversal, straight-through, clipping",
          "[custom][custom_vjp]") {
  // Outer levels differentiate fwd's and bwd's own ops: a gradient-reversal layer's Hessian is the reversed
  // first derivative times the identity's (it once applied bwd twice: 0.341076527 at 0.3, JAX -0.682153053).
  auto grl = tg::custom_vjp([](const T& z) { return std::pair{z, 0}; }, [](int, const T& dy) { return dy * -0.5; });
  check_against_jax("grl", [&](const T& x) { return tg::sum(tg::square(tg::tanh(grl(x)))); });
  const auto h = tg::hessian([&](const T& x) { return tg::sum(tg::square(tg::tanh(grl(x)))); })(dvec({0.3}, {1}));
  check_close(h, jax_values().at("grl.hessian_at_0.3"), 1e-13);
  auto ste = tg::custom_vjp([](const T& z) { return std::pair{tg::where(tg::greater(z, tg::zeros<double, D>({})), tg::ones<double, D>({}),
                                                                        tg::full<double, D>({}, -1.0)), 0}; },
                            [](int, const T& dy) { return dy; });
  check_against_jax("ste", [&](const T& x) { return tg::sum(ste(x) * x * x); });
  auto clip_gradient = tg::custom_vjp([](const T& z) { return std::pair{z, 0}; }, [](int, const T& dy) { return tg::clip(dy, -0.5, 0.5); });
  check_against_jax("clip_gradient", [&](const T& x) { return tg::sum(tg::sin(clip_gradient(x * x))); });
}

TEST_CASE("custom_jvp: the rule transposed for reverse mode, differentiated again at order 2, as in JAX", "[custom][custom_jvp]") {
  // softplus with a stable rule whose y calls the custom function itself (JAX's documented pattern).
  std::function<T(const T&)> softplus;
  softplus = tg::custom_jvp([](const T& z) { return tg::log(1.0 + tg::exp(z)); },
                            [&](const T& z, const T& t) { return std::pair{softplus(z), t * tg::sigmoid(z)}; });
  auto f = [&](const T& x) { return tg::sum(softplus(x) * tg::tanh(x)); };
  check_against_jax("softplus", f);
  const auto r = tg::check_grads(f, dvec({0.3, -1.2, 0.7}, {3}), tg::GradCheckOptions{.order = 2, .modes = tg::fwd | tg::rev, .print = false});
  INFO(r);
  CHECK(r.passed);
  // A rule that is not sin's derivative (2 cos): an outer level sees the rule again when the rule's y calls
  // the function itself, sin's own derivative when it calls sin.
  std::function<T(const T&)> sin2_self;
  sin2_self = tg::custom_jvp([](const T& z) { return tg::sin(z); },
                             [&](const T& z, const T& t) { return std::pair{sin2_self(z), 2.0 * tg::cos(z) * t}; });
  check_against_jax("sin2_self", [&](const T& x) { return tg::sum(tg::square(sin2_self(x))); });
  auto sin2_plain = tg::custom_jvp([](const T& z) { return tg::sin(z); }, [](const T& z, const T& t) { return std::pair{tg::sin(z), 2.0 * tg::cos(z) * t}; });
  check_against_jax("sin2_plain", [&](const T& x) { return tg::sum(tg::square(sin2_plain(x))); });
  // Forward mode: J t is the rule's tangent.
  const auto [y, ty] = tg::jvp(sin2_plain, dvec({0.3, -1.2}, {2}), dvec({1.0, 0.5}, {2}));
  check_close(ty, {2.0 * std::cos(0.3), 2.0 * std::cos(-1.2) * 0.5}, 1e-15);
  check_close(y, {std::sin(0.3), std::sin(-1.2)}, 1e-15);
  // Untraced, f runs; a tangent of the wrong shape is an error naming the op.
  check_close(sin2_plain(dvec({0.5}, {1})), {std::sin(0.5)}, 1e-15);
  auto bad = tg::custom_jvp([](const T& z) { return tg::sin(z); }, [](const T& z, const T& t) { return std::pair{tg::sin(z), tg::sum(t)}; });
  CHECK_THROWS_WITH(tg::grad([&](const T& x) { return tg::sum(bad(x)); })(dvec({0.3, 0.4}, {2})),
                    Contains("[custom_jvp] the rule returned a tangent of shape () for an output of shape (2,)"));
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
