// tg::vmap composed with the other transformations: vmap of grad (per-example gradients, with aux and
// per-leaf axes) and grad of a vmapped function, an ensemble trained by vmapping the optimizer step,
// vmap of vmap, and vmap inside compile (one plan whatever the batch). Built for the CPU, and by nvcc
// with every tensor on CUDA (TG_TEST_CUDA).
#include "vmap_common.hpp"

namespace vmap_test {

TEST_CASE("vmap of grad gives per-example gradients; grad of vmap the gradient of the batch", "[vmap][autodiff]") {
  const auto p = init_mlp<double>(7, 6, 5, 3, 51);
  const auto x = randn<double>({4, 7}, 52);
  const auto y = tg::from_vector<D>(std::vector<std::int32_t>{0, 2, 1, 2}, {4});
  auto loss = [](const Mlp<double, D>& params, const tg::Tensor<double, D>& xi, const tg::Tensor<std::int32_t, D>& yi) {
    return tg::mean(tg::softmax_cross_entropy_with_integer_labels(mlp(params, xi.reshape({1, -1})), yi.reshape({1})));
  };
  const auto per_example = tg::vmap(tg::grad(loss), {std::nullopt, 0, 0})(p, x, y);
  {  // f32: per-example gradients against the loop's, to rounding
    const auto pf = tg::tree_cast<float>(p);
    const auto xf = tg::cast<float>(x);
    auto lossf = [](const Mlp<float, D>& params, const tg::Tensor<float, D>& xi, const tg::Tensor<std::int32_t, D>& yi) {
      return tg::mean(tg::softmax_cross_entropy_with_integer_labels(mlp(params, xi.reshape({1, -1})), yi.reshape({1})));
    };
    const auto gf = tg::vmap(tg::grad(lossf), {std::nullopt, 0, 0})(pf, xf, y);
    for (std::int64_t i = 0; i < 4; ++i) {
      const auto g = tg::grad(lossf)(pf, tg::index_in_dim(xf, i), tg::index_in_dim(y, i));
      tg::tree_for_each([&](const std::string& path, const auto& batched, const auto& one) {
        INFO(path << " example " << i << " (f32)");
        require_equal(tg::index_in_dim(batched, i), one, 1e-6);
      }, gf, g);
    }
  }
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(per_example)>, Mlp<double, D>>);
  REQUIRE(per_example.w1.shape() == tg::Shape{4, 7, 6});
  REQUIRE(per_example.b3.shape() == tg::Shape{4, 3});
  for (std::int64_t i = 0; i < 4; ++i) {
    const auto g = tg::grad(loss)(p, tg::index_in_dim(x, i), tg::index_in_dim(y, i));
    tg::tree_for_each([&](const std::string& path, const auto& batched, const auto& one) {
      INFO(path << " example " << i);
      require_equal(tg::index_in_dim(batched, i), one, 1e-14);
    }, per_example, g);
  }
  // value_and_grad with aux under vmap: per-example losses and aux.
  auto with_aux = [&](const Mlp<double, D>& params, const tg::Tensor<double, D>& xi, const tg::Tensor<std::int32_t, D>& yi) {
    auto l = loss(params, xi, yi);
    return std::pair{l, l * 2.0};
  };
  const auto [out, grads] = tg::vmap(tg::value_and_grad(with_aux, tg::has_aux), {std::nullopt, 0, 0})(p, x, y);
  REQUIRE(out.first.shape() == tg::Shape{4});
  require_equal(out.second, tg::mul(out.first, 2.0));
  require_equal(grads.w2, per_example.w2);
  // grad of a function that vmaps: the mean of the per-example losses, differentiated as one.
  auto batch_loss = [&](const Mlp<double, D>& params, const tg::Tensor<double, D>& xs, const tg::Tensor<std::int32_t, D>& ys) {
    return tg::mean(tg::vmap(loss, {std::nullopt, 0, 0})(params, xs, ys));
  };
  auto direct = [](const Mlp<double, D>& params, const tg::Tensor<double, D>& xs, const tg::Tensor<std::int32_t, D>& ys) {
    return tg::mean(tg::softmax_cross_entropy_with_integer_labels(mlp(params, xs), ys));
  };
  const auto g1 = tg::grad(batch_loss)(p, x, y), g2 = tg::grad(direct)(p, x, y);
  tg::tree_for_each([&](const std::string& path, const auto& a, const auto& b) {
    INFO(path);
    require_equal(a, b, 1e-14);
    require_equal(tg::mean(tg::index_in_dim(per_example.w1, 0), 0), tg::mean(tg::index_in_dim(per_example.w1, 0), 0));
  }, g1, g2);
  // The per-example gradients average to the batch gradient.
  require_equal(tg::mean(per_example.w1, 0), g2.w1, 1e-14);
  // Shared parameters used by ops without a shared-weights rule (elementwise, reshape, a transposed
  // matmul) and by linear together: each use sees every example's copy, and the gradients add up.
  auto mixed = [](const Mlp<double, D>& q, const tg::Tensor<double, D>& xi, const tg::Tensor<std::int32_t, D>&) {
    const auto h = tg::linear(xi.reshape({1, -1}), q.w1, q.b1, tg::Activation::silu);
    const auto u = tg::matmul(q.w2, h, true, true).reshape({-1});
    return tg::sum(tg::tanh(u * q.b2)) + tg::sum(tg::square(q.w1.reshape({-1}))) * 0.1 + tg::mean(q.w3 * q.b3);
  };
  const auto mixed_grads = tg::vmap(tg::grad(mixed), {std::nullopt, 0, 0})(p, x, y);
  for (std::int64_t i = 0; i < 4; ++i) {
    const auto g = tg::grad(mixed)(p, tg::index_in_dim(x, i), tg::index_in_dim(y, i));
    tg::tree_for_each([&](const std::string& path, const auto& batched, const auto& one) {
      INFO(path << " example " << i);
      require_equal(tg::index_in_dim(batched, i), one, 1e-14);
    }, mixed_grads, g);
  }
  // Per-example gradient norms, jax.vmap(optax.global_norm): each example's own, to float rounding (the
  // batched rule sums each leaf's squares, the tree-wide kernel all leaves' chunks together).
  const auto pf = tg::tree_cast<float>(per_example);
  const auto norms = tg::vmap([](const Mlp<float, D>& g) { return tg::global_norm(g); })(pf);
  REQUIRE(norms.shape() == tg::Shape{4});
  for (std::int64_t i = 0; i < 4; ++i) {
    const auto one = tg::tree_map([i](const auto& leaf) { return tg::index_in_dim(leaf, i); }, pf);
    REQUIRE(std::abs(norms.at({i}) - tg::global_norm(one).item()) <= 1e-6 * tg::global_norm(one).item());
  }
  // Per-leaf axes: only w1 and b1 per member (axis 0 and axis 1 of their stacks), the rest shared; and an
  // output per tuple element with its own out_axes.
  const auto w1s = tg::stack({p.w1, tg::mul(p.w1, 2.0)}, 0), b1s = tg::stack({p.b1, tg::mul(p.b1, -1.0)}, 1);
  auto partly = p;
  partly.w1 = w1s, partly.b1 = b1s;
  const auto axes = tg::VmapAxes::per_leaf({0, 1, std::nullopt, std::nullopt, std::nullopt, std::nullopt});
  const auto [logits_t, shared] = tg::vmap([](const Mlp<double, D>& q, const tg::Tensor<double, D>& xs) { return std::pair{mlp(q, xs), xs}; },
                                            {axes, std::nullopt}, {1, std::nullopt})(partly, x);
  REQUIRE(logits_t.shape() == tg::Shape{4, 2, 3});
  require_equal(shared, x);
  auto second = p;
  second.w1 = tg::mul(p.w1, 2.0), second.b1 = tg::mul(p.b1, -1.0);
  require_equal(tg::index_in_dim(logits_t, 1, 1), mlp(second, x), 1e-14);
  REQUIRE_THROWS_WITH(tg::vmap([](const Mlp<double, D>& q) { return q.w1; }, {tg::VmapAxes::per_leaf({0, 0})})(partly),
                      Contains("6 tensor leaves but 2 per-leaf axes"));
  // An ensemble: params batched too (in_axes 0 for every leaf).
  const auto ps = tg::tree_map([](const auto& leaf) { return tg::stack({leaf, tg::mul(leaf, 2.0), leaf}, 0); }, p);
  const auto logits = tg::vmap([](const Mlp<double, D>& q, const tg::Tensor<double, D>& xs) { return mlp(q, xs); }, {0, std::nullopt})(ps, x);
  require_equal(tg::index_in_dim(logits, 1), mlp(tg::tree_map([](const auto& l) { return tg::mul(l, 2.0); }, p), x), 1e-14);
}

TEST_CASE("vmap trains an ensemble: each member's step, the optimizer included, equals its own", "[vmap][optim]") {
  const auto p = init_mlp<double>(7, 6, 5, 3, 81);
  const auto members = tg::tree_map([](const auto& leaf) { return tg::stack({leaf, tg::mul(leaf, 0.5), tg::mul(leaf, 3.0)}, 0); }, p);
  const auto x = randn<double>({4, 7}, 82);
  const auto y = tg::from_vector<D>(std::vector<std::int32_t>{0, 2, 1, 2}, {4});
  const auto optimizer = tg::optim::chain(tg::optim::clip_by_global_norm(1.0), tg::optim::adamw(1e-2, {.weight_decay = 1e-3}));
  auto loss = [](const Mlp<double, D>& q, const tg::Tensor<double, D>& xs, const tg::Tensor<std::int32_t, D>& ys) {
    return tg::mean(tg::softmax_cross_entropy_with_integer_labels(mlp(q, xs), ys));
  };
  using State = decltype(optimizer.init(p));
  auto step = [&](const Mlp<double, D>& q, const State& s, const tg::Tensor<double, D>& xs, const tg::Tensor<std::int32_t, D>& ys) {
    auto [l, g] = tg::value_and_grad(loss)(q, xs, ys);
    auto [u, next] = optimizer.update(g, s, q);
    return std::tuple{tg::optim::apply_updates(q, u), next, l};
  };
  auto params = members;
  auto state = tg::vmap([&](const Mlp<double, D>& q) { return optimizer.init(q); })(members);
  tg::Tensor<double, D> losses;
  for (int i = 0; i < 3; ++i) std::tie(params, state, losses) = tg::vmap(step, {0, 0, std::nullopt, std::nullopt})(params, state, x, y);
  REQUIRE(losses.shape() == tg::Shape{3});
  for (std::int64_t m = 0; m < 3; ++m) {
    auto q = tg::tree_map([m](const auto& leaf) { return tg::index_in_dim(leaf, m); }, members);
    auto s = optimizer.init(q);
    tg::Tensor<double, D> l;
    for (int i = 0; i < 3; ++i) std::tie(q, s, l) = step(q, s, x, y);
    INFO("member " << m);
    REQUIRE(std::abs(losses.at({m}) - l.item()) <= 1e-13);
    tg::tree_for_each([&](const std::string& path, const auto& batched, const auto& one) {
      INFO(path);
      require_equal(tg::index_in_dim(batched, m), one, 1e-13);
    }, params, q);
  }
}

TEST_CASE("vmap nests, and compiles into one plan", "[vmap][compile]") {
  const auto x = randn<double>({3, 4, 5}, 61), w = randn<double>({5, 2}, 62);
  auto f = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& c) { return tg::sum(tg::tanh(tg::matmul(a.reshape({1, -1}), c))); };
  auto inner = tg::vmap(f, {0, std::nullopt});
  const auto nested = tg::vmap(inner, {0, std::nullopt})(x, w);
  REQUIRE(nested.shape() == tg::Shape{3, 4});
  for (std::int64_t i = 0; i < 3; ++i)
    for (std::int64_t j = 0; j < 4; ++j)
      REQUIRE(std::abs(nested.at({i, j}) - f(tg::index_in_dim(tg::index_in_dim(x, i), j), w).item()) <= gemm_exact);
  // The outer level mapped along axis 1: nested levels keep their batch axes apart.
  const auto swapped = tg::vmap(inner, {1, std::nullopt})(x, w);
  require_equal(swapped, tg::transpose(nested));
  // vmap of vmap of grad: per-example gradients of a two-level batch.
  auto g = tg::vmap(tg::vmap(tg::grad([](const tg::Tensor<double, D>& c, const tg::Tensor<double, D>& a) {
    return tg::sum(tg::tanh(tg::matmul(a.reshape({1, -1}), c)));
  }), {std::nullopt, 0}), {std::nullopt, 0})(w, x);
  REQUIRE(g.shape() == tg::Shape{3, 4, 5, 2});
  require_equal(tg::index_in_dim(tg::index_in_dim(g, 2), 1),
                tg::grad([&](const tg::Tensor<double, D>& c) { return f(tg::index_in_dim(tg::index_in_dim(x, 2), 1), c); })(w), 1e-15);
  // Inside compile: the replay equals the eager call, bit for bit.
  auto step = tg::compile([&](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& c) { return tg::vmap(inner, {0, std::nullopt})(a, c); });
  const auto first = step(x, w);
  const auto x2 = randn<double>({3, 4, 5}, 63);
  const auto replay = step(x2, w);
  require_equal(first, nested);
  require_equal(replay, tg::vmap(inner, {0, std::nullopt})(x2, w));
  // One plan whatever the batch: a replay runs as many kernels for 3 examples as for 9 (the batched GEMM
  // is one GEMM), where the loop it replaces runs a set per example.
  auto kernels = [&](std::int64_t n, bool looped) {
    auto c = tg::compile([&](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& cw) {
      return looped ? loop_of(f, {0, std::nullopt}, 0, n, a, cw) : tg::vmap(f, {0, std::nullopt})(a, cw);
    });
    (void)c(randn<double>({n, 5}, 64), w);
    return c.kernels();
  };
  REQUIRE(kernels(3, false) == kernels(9, false));
  REQUIRE(kernels(9, true) > kernels(3, true));
}

}  // namespace vmap_test
