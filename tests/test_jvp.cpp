// autodiff/jvp.hpp, forward mode and higher order: jvp, linearize, grad of grad to third order, hvp, jacfwd,
// jacrev, hessian (closed forms and finite differences in double), their composition with vmap and compile,
// and their errors. Built for the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "autodiff_common.hpp"

namespace jvp_tests {

using ho_test::check_close;
using ho_test::dvec;

TEST_CASE("jvp and linearize give J t (closed forms)", "[higher][jvp]") {
  // f(x) = sin(x) * x^2 elementwise: J = diag(cos(x) x^2 + 2 x sin(x)).
  const auto x = dvec({0.3, -1.2, 2.0}, {3});
  const auto t = dvec({1.0, 0.5, -2.0}, {3});
  auto f = [](const tg::Tensor<double, D>& v) { return tg::sin(v) * tg::square(v); };
  auto [y, yt] = tg::jvp(f, x, t);
  std::vector<double> want_y, want_t;
  const std::vector<double> xv{0.3, -1.2, 2.0}, tv{1.0, 0.5, -2.0};
  for (std::size_t i = 0; i < 3; ++i) {
    want_y.push_back(std::sin(xv[i]) * xv[i] * xv[i]);
    want_t.push_back((std::cos(xv[i]) * xv[i] * xv[i] + 2 * xv[i] * std::sin(xv[i])) * tv[i]);
  }
  check_close(y, want_y, 1e-15);
  check_close(yt, want_t, 1e-14);
  CHECK(yt.trace().tape == 0);

  auto [y2, f_jvp] = tg::linearize(f, x);
  check_close(y2, want_y, 1e-15);
  check_close(f_jvp(t), want_t, 1e-14);
  check_close(f_jvp(t * 2.0), [&] { auto w = want_t; for (auto& v : w) v *= 2; return w; }(), 1e-14);

  // A pytree in, a pytree out: a matmul and a reduction.
  const ho_test::Net<D> p = ho_test::init_net<D>(3);
  const ho_test::Net<D> dp = ho_test::init_net<D>(30);
  const auto xs = rnd::normal<double, D>(rnd::key(9), {5, 2});
  auto [out, out_t] = tg::jvp(ho_test::net<D>, p, dp, xs);
  const double h = 1e-6;
  const auto up = ho_test::net<D>(tg::tree_map([&](const auto& a, const auto& b) { return a + b * h; }, p, dp), xs);
  const auto down = ho_test::net<D>(tg::tree_map([&](const auto& a, const auto& b) { return a - b * h; }, p, dp), xs);
  const auto fd = ((up - down) / (2 * h)).to_vector();
  check_close(out_t, fd, 1e-8);
}

/// f's JVP along t by the ops' forward rules (tg::detail::jvp_by_rules, which throws where an op has no
/// rule) against the transposed VJP (the fallback, a different computation), and the transposition
/// identity <w, J t> = <J^T w, t> with J^T w from grad: f64, 1e-12.
template <class F>
void check_forward_rules(const std::string& name, F f, const tg::Tensor<double, D>& x, int seed) {
  INFO(name);
  const auto t = rnd::normal<double, D>(rnd::key(seed), x.shape());
  std::pair<tg::Tensor<double, D>, tg::Tensor<double, D>> rules;
  REQUIRE_NOTHROW(rules = tg::detail::jvp_by_rules(f, x, t));
  const auto transposed = tg::detail::jvp_by_transposition(f, x, t);
  check_close(rules.first, transposed.first.to_vector(), 0.0);
  check_close(rules.second, transposed.second.to_vector(), 1e-12);
  const auto w = rnd::normal<double, D>(rnd::key(seed + 1), rules.first.shape());
  const auto jtw = tg::grad([&](const tg::Tensor<double, D>& v) { return tg::sum(f(v) * w); })(x);
  const double lhs = tg::sum(w * rules.second).item(), rhs = tg::sum(jtw * t).item();
  CHECK(std::fabs(lhs - rhs) <= 1e-12 * std::max(1.0, std::fabs(rhs)));
}

TEST_CASE("jvp pushes tangents by each op's forward rule, equal to the transposed VJP", "[higher][jvp][forward]") {
  using T = tg::Tensor<double, D>;
  const auto x = rnd::normal<double, D>(rnd::key(40), {4, 6});
  int seed = 100;
  // Elementwise: every functor, the scalar forms, broadcasting both ways.
  check_forward_rules("unary", [](const T& v) {
    const auto p = tg::exp(v * 0.3) + 0.5;
    return tg::exp(v) + tg::log(p) + tg::tanh(v) + tg::sigmoid(v) + tg::relu(v) + tg::gelu(v) + tg::gelu_exact(v) + tg::silu(v) + tg::sin(v) +
           tg::cos(v) + tg::erf(v) + tg::square(v) + tg::sqrt(p) + tg::rsqrt(p) + tg::abs(v) + tg::neg(v) + tg::clip(v, -0.5, 0.5) + tg::pow(p, 2.5);
  }, x, seed++);
  check_forward_rules("binary", [](const T& v) {
    const auto row = tg::sum(v, 0) * 0.1;  // (6,), broadcast against (4, 6)
    const auto p = tg::exp(v * 0.3) + 0.5;
    return v * row + (v - row) / (tg::exp(row) + 1.0) + tg::maximum(v, row) + tg::minimum(row, v * 2.0) + 2.0 / p - v / 3.0 + (1.0 - v) * 4.0;
  }, x, seed++);
  check_forward_rules("where, broadcast_to, cast, reshape", [](const T& v) {
    const auto c = tg::greater(v, tg::zeros<double, D>({}));
    const auto b = tg::broadcast_to(tg::index_in_dim(v, 0).reshape({1, 6}), {4, 6});
    return tg::where(c, v * v, b) + tg::cast<double>(tg::cast<double>(v)).reshape({6, 4}).reshape({4, 6});
  }, x, seed++);
  check_forward_rules("indexing", [](const T& v) {
    const auto idx = tg::from_vector<D>(std::vector<std::int32_t>{2, 0, 5, 5}, {4});
    const auto a = tg::take(v, idx, 1);                                // (4, 4)
    const auto s = tg::slice_in_dim(v, 1, 5, 1, 1);                    // (4, 4)
    const auto j = tg::concatenate({a, s, tg::transpose(tg::slice_in_dim(v, 0, 4, 1, 1))}, 0);  // (12, 4)
    return tg::stack({j, j * j}, 1);
  }, x, seed++);
  check_forward_rules("reductions", [](const T& v) {
    const auto r = tg::sum(v, 1) + tg::mean(v, 1) + tg::max(v, 1) + tg::logsumexp(v, 1) + tg::sum(tg::softmax(v) * v, 1) + tg::sum(tg::log_softmax(v), 1);
    return r + tg::sum(v) + tg::mean(v * v) + tg::max(v) + tg::sum(tg::sum(v, 0, true));
  }, x, seed++);
  check_forward_rules("matmul, einsum, linear", [](const T& v) {
    const auto a = tg::slice_in_dim(v, 0, 3, 1, 1), b = tg::slice_in_dim(v, 3, 6, 1, 1);  // (4, 3) each
    const auto mm = tg::matmul(a, b, true, false) + tg::sum(tg::matmul(a, b, false, true));
    const auto batched = tg::matmul(v.reshape({2, 2, 6}), v.reshape({2, 6, 2}));    // (2, 2, 2)
    const auto e = tg::einsum("ij,kj->ik", a, b);                                   // (4, 4)
    const auto lin = tg::linear(a, tg::matmul(a, b, true, false), tg::sum(b, 0), tg::Activation::gelu);  // (4, 3)
    return tg::sum(mm) + tg::sum(batched) + tg::sum(e * e) + tg::sum(lin);
  }, x, seed++);
  check_forward_rules("nn", [](const T& v) {
    const auto labels = tg::from_vector<D>(std::vector<std::int32_t>{1, 0, 5, 3}, {4});
    const auto ce = tg::softmax_cross_entropy_with_integer_labels(v, labels);
    const auto ln = tg::layer_norm(v, tg::index_in_dim(v, 1), tg::index_in_dim(v, 2));
    const auto dr = tg::dropout(rnd::key(3), v, 0.25);
    return tg::sum(ce) + tg::sum(ln * ln) + tg::sum(dr * v);
  }, x, seed++);
  for (auto impl : {tg::AttentionImplementation::fused, tg::AttentionImplementation::composed}) {  // the fused kernel's rule, the ops'
    check_forward_rules(impl == tg::AttentionImplementation::fused ? "attention, fused" : "attention, composed", [impl](const T& v) {
      const auto q = v.reshape({1, 2, 3, 4}), k = (v * 0.5).reshape({1, 2, 3, 4}), vv = tg::tanh(v).reshape({1, 2, 3, 4});
      const auto mask = tg::from_vector<D>(std::vector<std::uint8_t>{1, 0, 1, 1}, {2, 2});  // (T, S), broadcast over the heads
      return tg::dot_product_attention(q, k, vv, tg::AttentionOptions{.is_causal = true, .implementation = impl}) +
             tg::dot_product_attention(tg::index_in_dim(q, 0), tg::index_in_dim(k, 0), tg::index_in_dim(vv, 0), mask,
                                       tg::AttentionOptions{.implementation = impl});
    }, x, seed++);
  }
  check_forward_rules("conv, pools", [](const T& v) {
    const auto img = v.reshape({1, 4, 3, 2});
    const auto k = v.reshape({2, 2, 2, 3}) * 0.5;  // (kh, kw, in, out)
    const auto y = tg::conv(img, k, {1, 1}, "SAME");  // (1, 4, 3, 3)
    const auto fused = tg::conv(img, k, tg::slice_in_dim(tg::sum(v, 0), 0, 3), tg::Activation::relu);
    return tg::sum(y * y) + tg::sum(fused) + tg::sum(tg::max_pool(img, {2, 2})) + tg::sum(tg::avg_pool(img, {2, 2}, {1, 1}, "SAME"));
  }, x, seed++);
}

TEST_CASE("grad of grad to third order (closed forms)", "[higher][grad]") {
  // f(x) = sum(x^3 + exp(x) sin(x)): f' = 3x^2 + e^x (sin + cos), f'' = 6x + 2 e^x cos, f''' = 6 + 2 e^x (cos - sin).
  auto f = [](const tg::Tensor<double, D>& v) { return tg::sum(v * v * v + tg::exp(v) * tg::sin(v)); };
  auto df = [&](const tg::Tensor<double, D>& v) { return tg::grad(f)(v); };
  auto d2 = [&](const tg::Tensor<double, D>& v) { return tg::sum(tg::grad([&](const tg::Tensor<double, D>& u) { return tg::sum(df(u)); })(v)); };
  const std::vector<double> xv{0.4, -0.7, 1.3};
  const auto x = dvec(xv, {3});
  std::vector<double> g1, g2, g3;
  for (double v : xv) {
    g1.push_back(3 * v * v + std::exp(v) * (std::sin(v) + std::cos(v)));
    g2.push_back(6 * v + 2 * std::exp(v) * std::cos(v));
    g3.push_back(6 + 2 * std::exp(v) * (std::cos(v) - std::sin(v)));
  }
  check_close(df(x), g1, 1e-14);
  // The diagonal Hessian's entries: grad of sum(grad f).
  check_close(tg::grad([&](const tg::Tensor<double, D>& u) { return tg::sum(df(u)); })(x), g2, 1e-13);
  check_close(tg::grad(d2)(x), g3, 1e-12);
}

TEST_CASE("hessian, jacfwd, jacrev and hvp agree with each other and with closed forms", "[higher][hessian]") {
  // f(x) = sum(x)^2 / 2 + sum(log(1 + x^2)): H = 1 + diag((2 - 2x^2) / (1 + x^2)^2).
  auto f = [](const tg::Tensor<double, D>& v) { return tg::sum(v) * tg::sum(v) * 0.5 + tg::sum(tg::log(tg::square(v) + 1.0)); };
  const std::vector<double> xv{0.5, -1.5, 2.0};
  const auto x = dvec(xv, {3});
  std::vector<double> want;
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 3; ++j) {
      const double x2 = xv[i] * xv[i];
      want.push_back(1.0 + (i == j ? (2 - 2 * x2) / ((1 + x2) * (1 + x2)) : 0.0));
    }
  const auto hess = tg::hessian(f)(x);
  CHECK(hess.shape() == tg::Shape{3, 3});
  check_close(hess, want, 1e-14);
  auto g = [&](const tg::Tensor<double, D>& v) { return tg::grad(f)(v); };
  check_close(tg::jacfwd(g)(x), want, 1e-14);
  check_close(tg::jacrev(g)(x), want, 1e-14);
  const auto v = dvec({1.0, -2.0, 0.5}, {3});
  std::vector<double> hv(3, 0.0);
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 3; ++j) hv[i] += want[i * 3 + j] * std::vector<double>{1.0, -2.0, 0.5}[j];
  check_close(tg::hvp(f, x, v), hv, 1e-14);
  // A non-square Jacobian: (2,) -> (3,), out.shape + in.shape.
  auto h = [](const tg::Tensor<double, D>& u) { return tg::concatenate({u * 2.0, tg::sum(u * u).reshape({1})}); };
  const auto u = dvec({1.0, 3.0}, {2});
  const std::vector<double> jw{2, 0, 0, 2, 2, 6};
  check_close(tg::jacfwd(h)(u), jw, 1e-15);
  check_close(tg::jacrev(h)(u), jw, 1e-15);
  CHECK(tg::jacrev(h)(u).shape() == tg::Shape{3, 2});
}

namespace {

/// The 2-d Laplacian of the network at each row of xs, by jvp of grad along each coordinate (the rows
/// are independent, so one jvp per coordinate serves every point).
template <class Dev>
tg::Tensor<double, Dev> laplacian(const ho_test::Net<Dev>& p, const tg::Tensor<double, Dev>& xs) {
  auto u_sum = [&](const tg::Tensor<double, Dev>& x) { return tg::sum(ho_test::net(p, x)); };
  auto g = [&](const tg::Tensor<double, Dev>& x) { return tg::grad(u_sum)(x); };
  const std::int64_t n = xs.dim(0);
  tg::Tensor<double, Dev> total;
  for (int k = 0; k < 2; ++k) {
    std::vector<double> e(static_cast<std::size_t>(2 * n), 0.0);
    for (std::int64_t i = 0; i < n; ++i) e[static_cast<std::size_t>(2 * i + k)] = 1.0;
    const auto hk = tg::jvp(g, xs, tg::from_vector<Dev>(e, xs.shape())).second;  // H e_k per row
    const auto d2 = tg::index_in_dim(hk, k, 1);
    total = k == 0 ? d2 : total + d2;
  }
  return total;
}

}  // namespace

TEST_CASE("vmap of hessian, jvp inside vmap, and grad of a loss made of second derivatives", "[higher][vmap]") {
  const ho_test::Net<D> p = ho_test::init_net<D>(5);
  const auto xs = rnd::uniform<double, D>(rnd::key(8), {6, 2});
  auto u = [](const tg::Tensor<double, D>& x, const ho_test::Net<D>& q) { return tg::sum(ho_test::net(q, x.reshape({1, 2}))); };
  // vmap(hessian(u)) over points, the parameters shared: each point's 2 x 2 Hessian, as a loop of them.
  const auto hs = tg::vmap(tg::hessian(u), {0, std::nullopt})(xs, p);
  REQUIRE(hs.shape() == tg::Shape{6, 2, 2});
  const auto hv = hs.to_vector();
  std::vector<double> lap_loop;
  for (std::int64_t i = 0; i < 6; ++i) {
    const auto hi = tg::hessian(u)(tg::index_in_dim(xs, i, 0), p).to_vector();
    for (int k = 0; k < 4; ++k) CHECK(std::fabs(hv[static_cast<std::size_t>(4 * i + k)] - hi[static_cast<std::size_t>(k)]) <= 1e-13 * std::max(1.0, std::fabs(hi[static_cast<std::size_t>(k)])));
    lap_loop.push_back(hi[0] + hi[3]);
    CHECK(std::fabs(hi[1] - hi[2]) <= 1e-14);  // symmetric
  }
  // The Laplacian by jvp of grad over all points at once equals the Hessians' traces.
  check_close(laplacian(p, xs), lap_loop, 1e-12);
  // jvp inside vmap: per-example tangents.
  const auto ts = rnd::normal<double, D>(rnd::key(12), {6, 2});
  auto tangent_of = [&](const tg::Tensor<double, D>& x, const tg::Tensor<double, D>& t) { return tg::jvp([&](const tg::Tensor<double, D>& v) { return u(v, p); }, x, t).second; };
  const auto jv = tg::vmap(tangent_of)(xs, ts).to_vector();
  for (std::int64_t i = 0; i < 6; ++i) {
    const auto gi = tg::grad([&](const tg::Tensor<double, D>& v) { return u(v, p); })(tg::index_in_dim(xs, i, 0)).to_vector();
    const auto ti = tg::index_in_dim(ts, i, 0).to_vector();
    CHECK(std::fabs(jv[static_cast<std::size_t>(i)] - (gi[0] * ti[0] + gi[1] * ti[1])) <= 1e-14);
  }
  // A physics-informed loss: its gradient in the parameters (third derivatives of the network) against
  // finite differences, in forward and reverse mode.
  auto loss = [&](const ho_test::Net<D>& q) { return tg::mean(tg::square(laplacian(q, xs) + 1.0)); };
  const auto r = tg::check_grads(loss, p, tg::GradCheckOptions{.modes = tg::fwd | tg::rev, .print = false});
  INFO(r);
  CHECK(r.passed);
}

TEST_CASE("hvp and hessian compose with compile: one recording, replays equal to the eager values", "[higher][compile]") {
  auto f = [](const tg::Tensor<double, D>& v) { return tg::sum(tg::exp(v) * tg::tanh(v)) + tg::sum(v) * tg::sum(v); };
  auto step = tg::compile([&](const tg::Tensor<double, D>& x, const tg::Tensor<double, D>& v) {
    return std::tuple{tg::hvp(f, x, v), tg::hessian(f)(x)};
  });
  for (int i = 0; i < 3; ++i) {
    const auto x = rnd::normal<double, D>(rnd::key(40 + i), {4});
    const auto v = rnd::normal<double, D>(rnd::key(50 + i), {4});
    const auto [hv, h] = step(x, v);
    CHECK(hv.to_vector() == tg::hvp(f, x, v).to_vector());
    CHECK(h.to_vector() == tg::hessian(f)(x).to_vector());
    // H v from the Hessian itself.
    const auto hm = tg::matmul(h, v.reshape({4, 1})).reshape({4}).to_vector();
    const auto hvv = hv.to_vector();
    for (int k = 0; k < 4; ++k) CHECK(std::fabs(hm[static_cast<std::size_t>(k)] - hvv[static_cast<std::size_t>(k)]) <= 1e-13 * std::max(1.0, std::fabs(hm[static_cast<std::size_t>(k)])));
  }
  CHECK(step.recordings() == 1);
}

TEST_CASE("higher-order errors name the problem", "[higher][errors]") {
  auto f = [](const tg::Tensor<double, D>& v) { return tg::sum(v * v); };
  const auto x = dvec({1.0, 2.0}, {2});
  CHECK_THROWS_WITH(tg::jvp(f, x, dvec({1.0, 2.0, 3.0}, {3})), Contains("[jvp]") && Contains("shape (3,)") && Contains("primal (2,)"));
  CHECK_THROWS_WITH(tg::grad([&](const tg::Tensor<double, D>& v) { return tg::linearize(f, v).first; })(x), Contains("[linearize]"));
  // A user functor with a first derivative only: grad works, grad of grad says what is missing.
  auto g = [](const tg::Tensor<double, D>& v) { return tg::sum(tg::map(v, ho_test::Cube{}, "cube")); };
  check_close(tg::grad(g)(x), {3.0, 12.0}, 1e-15);
  CHECK_THROWS_WITH(tg::hessian(g)(x), Contains("[cube]") && Contains("no higher-order derivative") && Contains("generic derivative(x, y)") && Contains("custom_jvp"));
  // With its derivative as a generic expression, the same functor differentiates to any order: 6 x.
  auto h = [](const tg::Tensor<double, D>& v) { return tg::sum(tg::map(v, ho_test::CubeWithDerivative{}, "cube")); };
  check_close(tg::hessian(h)(x), {6.0, 0.0, 0.0, 12.0}, 1e-15);
}

}  // namespace jvp_tests
