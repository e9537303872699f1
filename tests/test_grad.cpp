// autodiff/grad.hpp: grad and value_and_grad on the whole MLP against finite differences in double, their
// contracts (types, aux, accumulation, unused leaves, errors), argnums, and bf16 compute against f32. Each op's
// own derivatives are tested in its op family's file. Built for the CPU, and by nvcc with every tensor on
// CUDA (TG_TEST_CUDA).
#include "autodiff_common.hpp"

namespace grad_tests {

namespace ad_test {

/// Two inputs for the op tests.
template <class T, class Dev>
struct AB {
  tg::Tensor<T, Dev> a, b;
};
TG_PYTREE(AB, a, b)

/// The codelab's MLP, 784-256-128-10 with GELU.
template <class T, class Dev>
struct Mlp {
  tg::Tensor<T, Dev> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

template <class T, class Dev>
struct Batch {
  tg::Tensor<T, Dev> x;
  tg::Tensor<std::int32_t, Dev> y;
};

/// logits of the MLP, computed in C (the compute dtype) from parameters of type T.
template <class C, class T, class Dev>
tg::Tensor<float, Dev> logits_of(const Mlp<T, Dev>& p, const tg::Tensor<T, Dev>& x) {
  const auto h1 = tg::linear(tg::cast<C>(x), tg::cast<C>(p.w1), tg::cast<C>(p.b1), tg::Activation::gelu);
  const auto h2 = tg::linear(h1, tg::cast<C>(p.w2), tg::cast<C>(p.b2), tg::Activation::gelu);
  return tg::cast<float>(tg::linear(h2, tg::cast<C>(p.w3), tg::cast<C>(p.b3)));
}

template <class T, class Dev>
tg::Tensor<T, Dev> mlp_loss(const Mlp<T, Dev>& p, const Batch<T, Dev>& batch) {
  const auto h1 = tg::linear(batch.x, p.w1, p.b1, tg::Activation::gelu);
  const auto h2 = tg::linear(h1, p.w2, p.b2, tg::Activation::gelu);
  const auto logits = tg::linear(h2, p.w3, p.b3);
  return tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, batch.y));
}

/// He-normal parameters from key(1), zero biases, in T on D.
template <class T, class Dev>
Mlp<T, Dev> init_mlp(std::int64_t in = 784, std::int64_t h1 = 256, std::int64_t h2 = 128, std::int64_t out = 10) {
  const auto keys = rnd::split(rnd::key(1), 3);
  auto layer = [&](rnd::Key k, std::int64_t fan_in, std::int64_t fan_out) {
    return (rnd::normal<T, Dev>(k, {fan_in, fan_out}) * std::sqrt(2.0 / static_cast<double>(fan_in)));
  };
  // Small random biases (not zeros) so the bias gradients are exercised away from a special point.
  return {layer(keys[0], in, h1), rnd::normal<T, Dev>(rnd::key(11), {h1}) * 0.1, layer(keys[1], h1, h2),
          rnd::normal<T, Dev>(rnd::key(12), {h2}) * 0.1, layer(keys[2], h2, out), rnd::normal<T, Dev>(rnd::key(13), {out}) * 0.1};
}

template <class T, class Dev>
Batch<T, Dev> make_batch(std::int64_t n, std::int64_t in = 784) {
  std::vector<std::int32_t> labels(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) labels[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 7 + 3) % 10);
  return {rnd::uniform<T, Dev>(rnd::key(5), {n, in}), tg::from_vector<Dev>(labels)};
}

}  // namespace ad_test

using ad_test::AB;

using ho_test::check_close;

TEST_CASE("the whole MLP's gradient matches finite differences in double", "[autodiff][mlp]") {
  const auto params = ad_test::init_mlp<double, D>();
  const auto batch = ad_test::make_batch<double, D>(8);
  // Leaves above 256 elements are checked along 8 random directions each; biases element by element.
  const auto r = tg::check_grads(ad_test::mlp_loss<double, D>, params, batch);
  INFO(r);
  CHECK(r.passed);
  REQUIRE(r.leaves.size() == 6);
  CHECK(r.worst()->worst_ratio <= 1.0);
  for (bool fused : {true, false}) {
    // The fused backward (act' and bias gradient in the next layer's GEMM) and the plain one agree.
    tg::set_fused_linear(fused);
    const auto g = tg::grad(ad_test::mlp_loss<double, D>)(params, batch);
    tg::set_fused_linear(true);
    const auto g_ref = tg::grad(ad_test::mlp_loss<double, D>)(params, batch);
    std::string why;
    CHECK(tg::tree_all_close(g, g_ref, 1e-12, 1e-14, &why));
    INFO(why);
  }
}

TEST_CASE("grad and value_and_grad: types, shapes, aux, accumulation, unused leaves", "[autodiff]") {
  const auto params = ad_test::init_mlp<float, D>(20, 16, 12, 10);
  const auto batch = ad_test::make_batch<float, D>(32, 20);
  auto [loss, g1] = tg::value_and_grad(ad_test::mlp_loss<float, D>)(params, batch);
  const auto g2 = tg::grad(ad_test::mlp_loss<float, D>)(params, batch);
  static_assert(std::is_same_v<decltype(g1), ad_test::Mlp<float, D>>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(g2)>, ad_test::Mlp<float, D>>);
  CHECK(tg::tree_all_close(g1, g2, 0.0, 0.0));  // bitwise: the same tape walk
  tg::tree_for_each([](const std::string& path, const auto& g, const auto& p) {
    INFO(path);
    CHECK(g.shape() == p.shape());
    CHECK(g.trace().tape == 0);
  }, g1, params);
  CHECK(loss.rank() == 0);
  CHECK(loss.item() == ad_test::mlp_loss(params, batch).item());
  CHECK(loss.trace().tape == 0);

  // has_aux: aux is computed with the loss, returned untraced, equal to the untraced computation.
  auto with_metrics = [](const ad_test::Mlp<float, D>& p, const ad_test::Batch<float, D>& b) {
    const auto logits = ad_test::logits_of<float>(p, b.x);
    return std::pair{tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, b.y)), tg::accuracy(logits, b.y)};
  };
  auto [out, g3] = tg::value_and_grad(with_metrics, tg::has_aux)(params, batch);
  CHECK(out.second.item() == tg::accuracy(ad_test::logits_of<float>(params, batch.x), batch.y).item());
  CHECK(out.second.trace().tape == 0);
  CHECK(out.first.item() == loss.item());
  CHECK(tg::tree_all_close(g3, g1, 0.0, 0.0));
  auto [g4, aux] = tg::grad(with_metrics, tg::has_aux)(params, batch);
  CHECK(aux.item() == out.second.item());
  CHECK(tg::tree_all_close(g4, g1, 0.0, 0.0));

  // A leaf used twice accumulates; an unused leaf gets zeros of its shape.
  const AB<float, D> ab{tg::arange<float, D>(4), tg::ones<float, D>({2, 3})};
  const auto g = tg::grad([](const AB<float, D>& p) { return tg::sum(p.a * p.a) + tg::sum(p.a * 3.0f); })(ab);
  CHECK(g.a.to_vector() == std::vector<float>{3, 5, 7, 9});
  CHECK(g.b.to_vector() == std::vector<float>(6, 0.0f));
  CHECK(g.b.shape() == tg::Shape{2, 3});
  // A function that ignores its parameters: all zeros, no error.
  const auto z = tg::grad([](const AB<float, D>&) { return tg::full<float, D>({}, 1.0f); })(ab);
  CHECK(z.a.to_vector() == std::vector<float>(4, 0.0f));
}

TEST_CASE("autodiff errors name the problem", "[autodiff][errors]") {
  const AB<float, D> ab{tg::ones<float, D>({4}), tg::ones<float, D>({4})};
  CHECK_THROWS_WITH(tg::grad([](const AB<float, D>& p) { return p.a * 2.0f; })(ab),
                    Contains("[value_and_grad] the function must return a scalar (shape ()), got shape (4,)"));
  CHECK_THROWS_WITH(tg::grad([](const AB<float, D>& p) { return tg::sum(p.a, 0, true); })(ab), Contains("got shape (1,)"));
  const std::vector<tg::Tensor<float, D>> two{tg::ones<float, D>({1}), tg::ones<float, D>({1})}, one{tg::ones<float, D>({1})};
  CHECK_THROWS_WITH(tg::tree_map([](const auto& a, const auto&) { return a; }, two, one),
                    Contains("[tree] structures differ at '<root>': a list of 2 vs one of 1 elements"));
  const std::tuple<std::vector<tg::Tensor<float, D>>> t2{two}, t1{one};
  CHECK_THROWS_WITH(tg::tree_map([](const auto& a, const auto&) { return a; }, t2, t1), Contains("structures differ at '[0]'"));
}

TEST_CASE("bf16-compute gradients stay close to f32 ones", "[autodiff][bf16]") {
  const auto params = ad_test::init_mlp<float, D>(784, 256, 128, 10);
  const auto batch = ad_test::make_batch<float, D>(64);
  auto loss_in = [&](auto compute_tag) {
    using C = decltype(compute_tag);
    return [](const ad_test::Mlp<float, D>& p, const ad_test::Batch<float, D>& b) {
      return tg::mean(tg::softmax_cross_entropy_with_integer_labels(ad_test::logits_of<C>(p, b.x), b.y));
    };
  };
  const auto g32 = tg::grad(loss_in(float{}))(params, batch);
  const auto g16 = tg::grad(loss_in(tg::bf16{}))(params, batch);
  static_assert(std::is_same_v<decltype(g16.w1), tg::Tensor<float, D>>);  // f32 parameters get f32 gradients
  // bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%). Every GEMM input, activation and
  // cotangent is rounded, about 12 roundings on the longest path, and their errors add up roughly in
  // quadrature: a few percent of each leaf's gradient norm at most. We bound it at 5% per leaf (measured on
  // this machine: the worst leaf is printed below).
  double worst = 0;
  tg::tree_for_each([&](const std::string& path, const auto& a, const auto& b) {
    const double diff = tg::global_norm(std::vector{a - b}).item(), norm = tg::global_norm(std::vector{b}).item();
    worst = std::max(worst, diff / norm);
    INFO(path << ": relative difference " << diff / norm);
    CHECK(diff / norm < 0.05);
    CHECK(diff > 0);  // bf16 really ran
  }, g16, g32);
  WARN("bf16 vs f32 gradients: worst leaf relative difference " << worst);
}

TEST_CASE("argnums picks the arguments grad and value_and_grad differentiate", "[autodiff][argnums]") {
  auto f = [](const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b, double s) { return tg::sum(a * b * b) * s; };
  const auto a = tg::from_vector<D>(std::vector<double>{1.0, 2.0}), b = tg::from_vector<D>(std::vector<double>{3.0, -1.0});
  check_close(tg::grad(f, tg::argnums<1>)(a, b, 2.0), {2 * 2 * 1.0 * 3.0, 2 * 2 * 2.0 * -1.0}, 1e-15);
  auto [value, grads] = tg::value_and_grad(f, tg::argnums<0, 1>)(a, b, 2.0);
  CHECK(value.item() == Approx((9.0 + 2.0) * 2.0));
  static_assert(std::is_same_v<decltype(grads), std::tuple<tg::Tensor<double, D>, tg::Tensor<double, D>>>);
  check_close(std::get<0>(grads), {2 * 9.0, 2 * 1.0}, 1e-15);
  check_close(std::get<1>(grads), {2 * 2 * 3.0, 2 * 2 * 2.0 * -1.0}, 1e-15);
  // grad with argnums<0> is plain grad.
  check_close(tg::grad(f, tg::argnums<0>)(a, b, 2.0), tg::grad(f)(a, b, 2.0).to_vector(), 0.0);
}

#if defined(TG_TEST_CUDA)
TEST_CASE("CUDA gradients equal the CPU's", "[autodiff][cuda]") {
  const auto pc = ad_test::init_mlp<float, tg::Cpu>(784, 256, 128, 10);
  const auto bc = ad_test::make_batch<float, tg::Cpu>(64);
  ad_test::Mlp<float, tg::Cuda> params_gpu{tg::device_put<tg::Cuda>(pc.w1), tg::device_put<tg::Cuda>(pc.b1), tg::device_put<tg::Cuda>(pc.w2),
                                           tg::device_put<tg::Cuda>(pc.b2), tg::device_put<tg::Cuda>(pc.w3), tg::device_put<tg::Cuda>(pc.b3)};
  const ad_test::Batch<float, tg::Cuda> batch_gpu{tg::device_put<tg::Cuda>(bc.x), tg::device_put<tg::Cuda>(bc.y)};
  const auto gc = tg::grad(ad_test::mlp_loss<float, tg::Cpu>)(pc, bc);
  const auto gg = tg::grad(ad_test::mlp_loss<float, tg::Cuda>)(params_gpu, batch_gpu);
  // Different GEMM kernels and summation orders, and cuBLASLt's fused epilogues: 1e-4 relative.
  tg::tree_for_each([](const std::string& path, const auto& a, const auto& b) {
    INFO(path);
    const auto av = a.to_vector(), bv = b.to_vector();
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < av.size(); ++i) worst = std::max(worst, std::fabs(double(av[i]) - double(bv[i]))), scale = std::max(scale, std::fabs(double(bv[i])));
    CHECK(worst <= 1e-4 * scale + 1e-7);
  }, gg, gc);
}
#endif

}  // namespace grad_tests
