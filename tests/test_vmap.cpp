// tg::vmap, tested as JAX tests its batching rules: for each op with a rule, vmap(f) equals a loop of f
// over the batch, stacked (bit for bit in f64 where the op's arithmetic per example is the same, to
// rounding in f32), with non-zero in_axes / out_axes and unbatched arguments; and its errors. Its
// composition with grad, the optimizers, itself and compile is in test_vmap_composed.cpp. Built for the
// CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "vmap_common.hpp"

namespace vmap_test {

TEST_CASE("vmap of elementwise ops and broadcasting equals the loop, in_axes and out_axes included", "[vmap]") {
  const auto x = randn<double>({5, 3, 4}, 1), y = randn<double>({3, 4}, 2), z = randn<double>({4}, 3);
  auto f = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b) { return tg::tanh(a) * b + tg::exp(a) / 3.0; };
  require_equal(tg::vmap(f)(x, tg::broadcast_to(y, {5, 3, 4})), loop_of(f, {0, 0}, 0, 5, x, tg::broadcast_to(y, {5, 3, 4})));
  require_equal(tg::vmap(f, {0, std::nullopt})(x, y), loop_of(f, {0, std::nullopt}, 0, 5, x, y));
  // A batched operand of lower per-example rank than the shared one.
  auto g = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b) { return a - b; };
  const auto zs = randn<double>({5, 4}, 4);
  require_equal(tg::vmap(g, {0, std::nullopt})(zs, y), loop_of(g, {0, std::nullopt}, 0, 5, zs, y));
  require_equal(tg::vmap(g, {std::nullopt, 0})(z, x), loop_of(g, {std::nullopt, 0}, 0, 5, z, x));
  // Mapped along axis 1 and 2, out along axis 1 and -1.
  const auto xt = randn<double>({3, 5, 4}, 5);
  require_equal(tg::vmap(f, {1, std::nullopt}, {1})(xt, y.reshape({3, 4}).reshape({3, 4})), loop_of(f, {1, std::nullopt}, 1, 5, xt, y));
  const auto x2 = randn<double>({3, 4, 5}, 6);
  require_equal(tg::vmap(f, {2, std::nullopt}, {-1})(x2, y), loop_of(f, {2, std::nullopt}, 2, 5, x2, y));
  // where, comparisons, maximum, cast, broadcast_to.
  auto h = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b) {
    return tg::where(tg::less(a, b), tg::maximum(a, b * 2.0), tg::cast<double>(tg::cast<float>(a))) +
           tg::broadcast_to(tg::sum(a, -1, true), {3, 4});
  };
  require_equal(tg::vmap(h, {0, std::nullopt})(x, y), loop_of(h, {0, std::nullopt}, 0, 5, x, y));
  // clip, pow, minimum, and f32 (to rounding: the same functors, so here bit for bit on the CPU).
  auto k = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b) { return tg::clip(a, -0.5, 0.5) + tg::pow(tg::abs(b), 1.5) - tg::minimum(a, b); };
  require_equal(tg::vmap(k, {0, std::nullopt})(x, y), loop_of(k, {0, std::nullopt}, 0, 5, x, y));
  const auto xf = tg::cast<float>(x), yf = tg::cast<float>(y);
  auto kf = [](const tg::Tensor<float, D>& a, const tg::Tensor<float, D>& b) { return tg::gelu(a) * b + tg::softmax(a) - tg::mean(a, -1, true); };
  require_equal(tg::vmap(kf, {0, std::nullopt})(xf, yf), loop_of(kf, {0, std::nullopt}, 0, 5, xf, yf), 1e-6);
  // A result that does not depend on the batch is spread along out_axes.
  auto c = [](const tg::Tensor<double, D>&, const tg::Tensor<double, D>& b) { return b * 2.0; };
  require_equal(tg::vmap(c, {0, std::nullopt})(x, y), loop_of(c, {0, std::nullopt}, 0, 5, x, y));
}

TEST_CASE("vmap of reductions, softmax and layer_norm equals the loop", "[vmap]") {
  const auto x = randn<double>({6, 7, 300}, 11);  // 2,100 elements per example: more than one reduction chunk
  for (int axis : {0, 1, -1}) {
    for (bool keep : {false, true}) {
      auto f = [axis, keep](const tg::Tensor<double, D>& a) {
        return tg::sum(a, axis, keep) + tg::mean(a, axis, keep) * tg::max(a, axis, keep) - tg::logsumexp(a, axis, keep);
      };
      require_equal(tg::vmap(f)(x), loop_of(f, {0}, 0, 6, x));
      auto am = [axis, keep](const tg::Tensor<double, D>& a) { return tg::argmax(a, axis, keep); };
      require_equal(tg::vmap(am)(x), loop_of(am, {0}, 0, 6, x));
    }
  }
  auto all = [](const tg::Tensor<double, D>& a) { return tg::sum(a) + tg::mean(a) * tg::max(a); };
  require_equal(tg::vmap(all)(x), loop_of(all, {0}, 0, 6, x));
  require_equal(tg::vmap([](const auto& a) { return tg::argmax(a); })(x), loop_of([](const auto& a) { return tg::argmax(a); }, {0}, 0, 6, x));
  auto sm = [](const tg::Tensor<double, D>& a) { return tg::softmax(a) + tg::log_softmax(a); };
  require_equal(tg::vmap(sm, {1})(x), loop_of(sm, {1}, 0, 7, x));
  const auto s = randn<double>({300}, 12), b = randn<double>({300}, 13);
  auto ln = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& sc, const tg::Tensor<double, D>& bi) { return tg::layer_norm(a, sc, bi); };
  require_equal(tg::vmap(ln, {0, std::nullopt, std::nullopt})(x, s, b), loop_of(ln, {0, std::nullopt, std::nullopt}, 0, 6, x, s, b));
  // Per-example scale and bias (an ensemble): to rounding, as the affine part runs as its own ops.
  const auto ss = randn<double>({6, 300}, 14), bs = randn<double>({6, 300}, 15);
  require_equal(tg::vmap(ln)(x, ss, bs), loop_of(ln, {0, 0, 0}, 0, 6, x, ss, bs), 1e-14);
}

TEST_CASE("vmap of matmul, linear and einsum is one GEMM and equals the loop", "[vmap]") {
  const auto x = randn<double>({4, 3, 5}, 21), w = randn<double>({5, 6}, 22), b = randn<double>({6}, 23);
  auto mm = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& c) { return tg::matmul(a, c); };
  require_equal(tg::vmap(mm, {0, std::nullopt})(x, w), loop_of(mm, {0, std::nullopt}, 0, 4, x, w), gemm_exact);
  const auto ws = randn<double>({4, 5, 6}, 24);
  require_equal(tg::vmap(mm)(x, ws), loop_of(mm, {0, 0}, 0, 4, x, ws), gemm_exact);
  const auto xs = randn<double>({3, 5}, 25);
  require_equal(tg::vmap(mm, {std::nullopt, 0})(xs, ws), loop_of(mm, {std::nullopt, 0}, 0, 4, xs, ws), gemm_exact);
  auto mmt = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& c) { return tg::matmul(a, c, true, true); };
  const auto at = randn<double>({4, 5, 3}, 26), ct = randn<double>({6, 5}, 27);
  require_equal(tg::vmap(mmt, {0, std::nullopt})(at, ct), loop_of(mmt, {0, std::nullopt}, 0, 4, at, ct), gemm_exact);
  for (auto act : {tg::Activation::none, tg::Activation::gelu, tg::Activation::relu}) {
    auto lin = [act](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& wi, const tg::Tensor<double, D>& bi) { return tg::linear(a, wi, bi, act); };
    require_equal(tg::vmap(lin, {0, std::nullopt, std::nullopt})(x, w, b), loop_of(lin, {0, std::nullopt, std::nullopt}, 0, 4, x, w, b), 1e-15);
    // One example a vector (per-example inputs of shape (in,)).
    const auto v = randn<double>({4, 5}, 28);
    auto lin_row = [act](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& wi, const tg::Tensor<double, D>& bi) {
      return tg::linear(a.reshape({1, -1}), wi, bi, act).reshape({-1});
    };
    require_equal(tg::vmap(lin, {0, std::nullopt, std::nullopt})(v, w, b), loop_of(lin_row, {0, std::nullopt, std::nullopt}, 0, 4, v, w, b), 1e-15);
    const auto bs = randn<double>({4, 6}, 29);
    require_equal(tg::vmap(lin)(x, ws, bs), loop_of(lin, {0, 0, 0}, 0, 4, x, ws, bs), 1e-14);
  }
  auto es = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& c) { return tg::einsum("ij,jk->ik", a, c); };
  require_equal(tg::vmap(es, {0, std::nullopt})(x, w), loop_of(es, {0, std::nullopt}, 0, 4, x, w), 1e-15);
  require_equal(tg::vmap(es)(x, ws), loop_of(es, {0, 0}, 0, 4, x, ws), 1e-15);
  require_equal(tg::vmap(es, {std::nullopt, 0})(xs, ws), loop_of(es, {std::nullopt, 0}, 0, 4, xs, ws), 1e-15);
}

TEST_CASE("vmap of indexing, slicing, concatenation and reshapes equals the loop", "[vmap]") {
  const auto x = randn<double>({4, 6, 5}, 31);
  auto tr = [](const tg::Tensor<double, D>& a) { return tg::transpose(a) * 2.0 + tg::swapaxes(a, 0, 1) + tg::transpose(a, {1, 0}); };
  require_equal(tg::vmap(tr)(x), loop_of(tr, {0}, 0, 4, x));
  auto sl = [](const tg::Tensor<double, D>& a) {
    return tg::concatenate({tg::slice_in_dim(a, 1, 5, 2, 0), tg::index_in_dim(a, -1, 0).reshape({1, 5})}, 0);
  };
  require_equal(tg::vmap(sl)(x), loop_of(sl, {0}, 0, 4, x));
  auto rs = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& c) {
    return tg::stack({a.reshape({30}), c.reshape({-1})}, 1);
  };
  const auto shared = randn<double>({5, 6}, 32);
  require_equal(tg::vmap(rs, {0, std::nullopt})(x, shared), loop_of(rs, {0, std::nullopt}, 0, 4, x, shared));
  // take: a batched table with shared indices, shared table with batched indices, both batched; negative
  // and out-of-range indices as take's fill mode.
  const auto idx = tg::from_vector<D>(std::vector<std::int32_t>{0, 5, -1, 2, 9, 3}, {2, 3});
  const auto idxs = tg::from_vector<D>(std::vector<std::int32_t>{0, 1, 2, -2, 4, 7, 1, 1, 3, 0, 0, 4}, {4, 3});
  for (int axis : {0, 1}) {
    auto tk = [axis](const tg::Tensor<double, D>& a, const tg::Tensor<std::int32_t, D>& i) { return tg::take(a, i, axis); };
    require_equal(tg::vmap(tk, {0, std::nullopt})(x, idx), loop_of(tk, {0, std::nullopt}, 0, 4, x, idx));
    require_equal(tg::vmap(tk, {std::nullopt, 0})(shared, idxs), loop_of(tk, {std::nullopt, 0}, 0, 4, shared, idxs));
    require_equal(tg::vmap(tk)(x, idxs), loop_of(tk, {0, 0}, 0, 4, x, idxs));
  }
}

TEST_CASE("vmap of the losses, one_hot, attention and dropout equals the loop", "[vmap]") {
  const auto logits = randn<double>({3, 8, 10}, 41);
  const auto labels = tg::from_vector<D>(std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 1, 2, 2}, {3, 8});
  auto ce = [](const tg::Tensor<double, D>& l, const tg::Tensor<std::int32_t, D>& y) {
    return tg::mean(tg::softmax_cross_entropy_with_integer_labels(l, y)) + tg::accuracy(l, y) + tg::sum(tg::one_hot<double>(y, 10) * l);
  };
  require_equal(tg::vmap(ce)(logits, labels), loop_of(ce, {0, 0}, 0, 3, logits, labels));
  const auto shared_labels = tg::index_in_dim(labels, 0, 0);
  require_equal(tg::vmap(ce, {0, std::nullopt})(logits, shared_labels), loop_of(ce, {0, std::nullopt}, 0, 3, logits, shared_labels));
  // Attention, (T, N, H) per example and (B, T, N, H) per example, with a mask and causal.
  const auto q = randn<double>({3, 2, 5, 2, 4}, 42), k = randn<double>({3, 2, 6, 2, 4}, 43), v = randn<double>({3, 2, 6, 2, 4}, 44);
  for (auto impl : {tg::AttentionImplementation::composed, tg::AttentionImplementation::fused}) {
    tg::AttentionOptions o;
    o.implementation = impl;
    auto at = [o](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b, const tg::Tensor<double, D>& c) { return tg::dot_product_attention(a, b, c, o); };
    require_equal(tg::vmap(at)(q, k, v), loop_of(at, {0, 0, 0}, 0, 3, q, k, v), 1e-14);
    require_equal(tg::vmap(at, {1, 1, 1})(q, k, v), loop_of(at, {1, 1, 1}, 0, 2, q, k, v), 1e-14);
    const auto mask = tg::cast<std::uint8_t>(tg::greater(randn<double>({3, 5, 6}, 45), tg::zeros<double, D>({})));
    auto atm = [o](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b, const tg::Tensor<double, D>& c, const tg::Tensor<std::uint8_t, D>& m) {
      return tg::dot_product_attention(a, b, c, m, o);
    };
    require_equal(tg::vmap(atm)(q, k, v, mask), loop_of(atm, {0, 0, 0, 0}, 0, 3, q, k, v, mask), 1e-14);
  }
  auto w = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b) { return tg::dot_product_attention_weights(a, b); };
  require_equal(tg::vmap(w)(q, k), loop_of(w, {0, 0}, 0, 3, q, k), 1e-14);
  // Dropout: a key per example draws each example's own mask; one key draws the same mask for all.
  const auto keys = tg::stack({rnd::key_data<D>(rnd::key(1)), rnd::key_data<D>(rnd::key(2)), rnd::key_data<D>(rnd::key(3))}, 0);
  const auto xs = randn<double>({3, 4, 5}, 46);
  auto dr = [](const tg::Tensor<std::uint32_t, D>& key, const tg::Tensor<double, D>& a) { return tg::dropout(rnd::fold_in(key, 7), a, 0.5); };
  require_equal(tg::vmap(dr)(keys, xs), loop_of(dr, {0, 0}, 0, 3, keys, xs));
  const auto one = rnd::key_data<D>(rnd::key(9));
  require_equal(tg::vmap(dr, {std::nullopt, 0})(one, xs), loop_of(dr, {std::nullopt, 0}, 0, 3, one, xs));
  // Draws from key tensors: equal to the host key's, and a key per example under vmap.
  require_equal(rnd::normal<double, D>(one, {4, 5}), rnd::normal<double, D>(rnd::key(9), {4, 5}));
  require_equal(rnd::uniform<float, D>(one, {7}, -2.0, 3.0), rnd::uniform<float, D>(rnd::key(9), {7}, -2.0, 3.0));
  auto draw = [](const tg::Tensor<std::uint32_t, D>& key, const tg::Tensor<double, D>& a) {
    return a * rnd::normal<double, D>(key, {4, 5}) + rnd::uniform<double, D>(rnd::fold_in(key, 1), {5});
  };
  require_equal(tg::vmap(draw)(keys, xs), loop_of(draw, {0, 0}, 0, 3, keys, xs));
  require_equal(tg::vmap(draw, {std::nullopt, 0})(one, xs), loop_of(draw, {std::nullopt, 0}, 0, 3, one, xs));
}

TEST_CASE("vmap's errors name the problem", "[vmap][errors]") {
  const auto x = randn<double>({3, 4}, 71), y = randn<double>({5, 4}, 72);
  auto add = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b) { return a + b; };
  REQUIRE_THROWS_WITH(tg::vmap(add)(x, y), Contains("mapped axes differ in size") && Contains("3") && Contains("5"));
  REQUIRE_THROWS_WITH(tg::vmap(add, {2, 0})(x, x), Contains("in_axes 2 is out of range"));
  REQUIRE_THROWS_WITH(tg::vmap(add, {std::nullopt})(x, x), Contains("no argument is mapped"));
  REQUIRE_THROWS_WITH(tg::vmap(add, {0, 0, 0})(x, x), Contains("in_axes has 3 entries for 2 arguments"));
  REQUIRE_THROWS_WITH(tg::vmap(add, {0}, {std::nullopt})(x, x), Contains("varies over the batch"));
  REQUIRE_THROWS_WITH(tg::vmap([](const tg::Tensor<double, D>& a) { return tg::Tensor<double, D>(a.shape()) + a.item(); })(x),
                      Contains("[item]") && Contains("batched by tg::vmap"));
  // A user op that reads data() directly has no batching rule.
  auto raw = [](const tg::Tensor<double, D>& a) {
    tg::Tensor<double, D> r(a.shape());
    (void)a.data();
    return r;
  };
  REQUIRE_THROWS_WITH(tg::vmap(raw)(x), Contains("without a batching rule") && Contains("(4,)"));
  // compile inside vmap is refused with the way round that works.
  auto compiled = tg::compile([](const tg::Tensor<double, D>& a) { return a * 2.0; });
  REQUIRE_THROWS_WITH(tg::vmap([&](const tg::Tensor<double, D>& a) { return compiled(a); })(x), Contains("[compile]") && Contains("tg::compile(tg::vmap(f))"));
  // A batched value kept past its vmap is caught when an op meets it.
  tg::Tensor<double, D> leaked;
  (void)tg::vmap([&](const tg::Tensor<double, D>& a) {
    leaked = a;
    return a;
  })(x);
  REQUIRE_THROWS_WITH(tg::sum(leaked), Contains("has returned"));
}

}  // namespace vmap_test
