// tg::vmap, tested as JAX tests its batching rules: for each op with a rule, vmap(f) equals a loop of f
// over the batch, stacked (bit for bit in f64 where the op's arithmetic per example is the same, to
// rounding in f32), with non-zero in_axes / out_axes and unbatched arguments; composition with grad
// (per-example gradients, grad of a vmapped function), with itself and with compile; errors. Built for
// the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "test_common.hpp"

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;

namespace vmap_test {

template <class T, class Dev>
struct Mlp {
  tg::Tensor<T, Dev> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

template <class T, class Dev>
tg::Tensor<T, Dev> mlp(const Mlp<T, Dev>& p, const tg::Tensor<T, Dev>& x) {
  auto h = tg::linear(x, p.w1, p.b1, tg::Activation::gelu);
  h = tg::linear(h, p.w2, p.b2, tg::Activation::gelu);
  return tg::linear(h, p.w3, p.b3);
}

template <class T>
Mlp<T, D> init_mlp(int in, int h1, int h2, int out, std::int64_t seed) {
  auto k = rnd::split(rnd::key(seed), 6);
  auto n = [&](int i, tg::Shape s, double scale) { return tg::mul(rnd::normal<T, D>(k[static_cast<std::size_t>(i)], s), scale); };
  return {n(0, {in, h1}, 0.1), n(1, {h1}, 0.1), n(2, {h1, h2}, 0.1), n(3, {h2}, 0.1), n(4, {h2, out}, 0.1), n(5, {out}, 0.1)};
}

template <class T>
tg::Tensor<T, D> randn(tg::Shape s, std::int64_t seed) {
  return rnd::normal<T, D>(rnd::key(seed), s);
}

/// The loop vmap replaces: f on each example's slice (index_in_dim along its in_axis; an unmapped
/// argument whole), the results stacked along out_axis.
template <class F, class... A>
auto loop_of(F f, std::vector<std::optional<int>> in_axes, int out_axis, std::int64_t n, const A&... args) {
  using Y = decltype(f(args...));
  std::vector<Y> ys;
  for (std::int64_t i = 0; i < n; ++i) {
    std::size_t k = 0;
    auto pick = [&](const auto& x) {
      const auto ax = in_axes[k++];
      if constexpr (tg::detail::is_tensor<std::remove_cvref_t<decltype(x)>>::value) return ax ? tg::index_in_dim(x, i, *ax) : x;
      else return x;
    };
    ys.push_back(std::apply(f, std::tuple{pick(args)...}));
  }
  return tg::stack(std::span<const Y>(ys), out_axis);
}

/// Where a GEMM is compared with GEMMs of other shapes: bit for bit on the CPU (oneDNN computes a row the
/// same way whatever the rows around it), to rounding on a GPU, whose GEMM libraries pick kernels by shape.
#if defined(TG_TEST_CUDA)
constexpr double gemm_exact = 1e-13;
#else
constexpr double gemm_exact = 0.0;
#endif

template <class T, class Dev>
void require_equal(const tg::Tensor<T, Dev>& got, const tg::Tensor<T, Dev>& want, double rel = 0.0) {
  REQUIRE(got.shape() == want.shape());
  const auto g = got.to_vector(), w = want.to_vector();
  double worst = 0.0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double a = static_cast<double>(g[i]), b = static_cast<double>(w[i]);
    if (rel == 0.0) {
      if (!(a == b || (std::isnan(a) && std::isnan(b)))) {
        INFO("element " << i << ": " << a << " vs " << b);
        REQUIRE(a == b);
      }
    } else {
      worst = std::max(worst, std::abs(a - b) / std::max(1.0, std::abs(b)));
    }
  }
  if (rel != 0.0) REQUIRE(worst <= rel);
}


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
