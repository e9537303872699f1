// vmap: what batching rules buy, each against the loop vmap replaces, in the same process.
//  1. The codelab's evaluation: its 19 test batches of 512 (random images of the right shapes), the
//     compiled eval_one_batch called per batch (the loop the example ran) against the compiled
//     evaluate_batches, tg::vmap(eval_one_batch) over the stacked batches; both read every result.
//  2. Per-example gradients of the codelab's MLP at batch B (default 512): the compiled
//     tg::vmap(tg::grad(example_loss)) (examples/dp_sgd/dp_sgd.hpp) against a loop of tg::grad over the
//     examples, each example's gradients stacked (the loop is timed over --loop-examples examples and
//     scaled to B).
// Prints the medians and the ratios.
//   bench_vmap [--runs R] [--batch B] [--loop-examples N]
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "timing.hpp"
#include "../examples/dp_sgd/dp_sgd.hpp"
#include "../examples/fashion_mnist/codelab.hpp"

namespace {

using D = tg::Cpu;

}  // namespace

int main(int argc, char** argv) {
  int runs = 7;
  std::int64_t batch = 512, loop_examples = 64;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::stoll(argv[++i]) : 0LL; };
    if (a == "--runs") runs = static_cast<int>(next());
    else if (a == "--batch") batch = next();
    else if (a == "--loop-examples") loop_examples = next();
    else {
      std::fprintf(stderr, "usage: bench_vmap [--runs R] [--batch B] [--loop-examples N]\n");
      return 2;
    }
  }
  tg::cpu::FlushDenormals flush;
  namespace rnd = tg::random;
  const auto params = codelab::init_mlp_params<D>(rnd::key(3));
  auto labels = [](std::int64_t n, std::uint64_t seed) {
    const auto bits = rnd::bits<D>(rnd::key(static_cast<std::int64_t>(seed)), {n}).to_vector();
    std::vector<std::int32_t> y(bits.size());
    for (std::size_t k = 0; k < y.size(); ++k) y[k] = static_cast<std::int32_t>(bits[k] % 10);
    return y;
  };

  // 1. The evaluation.
  const std::int64_t nb = 19, bs = 512;
  const auto xb = rnd::uniform<float, D>(rnd::key(4), {nb, bs, 784});
  const auto yb = tg::from_vector<D>(labels(nb * bs, 5), {nb, bs});
  std::vector<tg::Tensor<float, D>> xs;
  std::vector<tg::Tensor<std::int32_t, D>> ys;
  for (std::int64_t b = 0; b < nb; ++b) xs.push_back(tg::index_in_dim(xb, b)), ys.push_back(tg::index_in_dim(yb, b));
  auto one = tg::compile(&codelab::eval_one_batch<D>);
  auto all = tg::compile(&codelab::evaluate_batches<D>);
  double loop_loss = 0, vmap_loss = 0;
  std::vector<std::int32_t> loop_pred, vmap_pred;
  const double loop_ms = bench::median_ms(runs, 1, [&] {
    loop_loss = 0, loop_pred.clear();
    for (std::int64_t b = 0; b < nb; ++b) {
      const auto [l, p] = one(params, xs[static_cast<std::size_t>(b)], ys[static_cast<std::size_t>(b)]);
      loop_loss += l.item();
      const auto pv = p.to_vector();
      loop_pred.insert(loop_pred.end(), pv.begin(), pv.end());
    }
  });
  const double vmap_ms = bench::median_ms(runs, 1, [&] {
    const auto [l, p] = all(params, xb, yb);
    vmap_loss = 0;
    for (const float v : l.to_vector()) vmap_loss += v;
    vmap_pred = p.to_vector();
  });
  std::printf("codelab evaluation, %lld batches of %lld (median of %d): loop of compiled eval_one_batch %.2f ms, compiled "
              "vmap(eval_one_batch) %.2f ms: vmap / loop speed %.2fx; summed loss %s (%.9g vs %.9g), predictions %s\n",
              static_cast<long long>(nb), static_cast<long long>(bs), runs, loop_ms, vmap_ms, loop_ms / vmap_ms,
              loop_loss == vmap_loss ? "identical" : "DIFFERENT", loop_loss, vmap_loss, loop_pred == vmap_pred ? "identical" : "DIFFERENT");

  // 2. Per-example gradients.
  const auto x = rnd::uniform<float, D>(rnd::key(6), {batch, 784});
  const auto y = tg::from_vector<D>(labels(batch, 7), {batch});
  auto batched = tg::compile([](const codelab::Mlp<D>& p, const tg::Tensor<float, D>& xi, const tg::Tensor<std::int32_t, D>& yi) {
    return dp_sgd::per_example_grads(p, xi, yi).second;
  });
  const double vmap_grad_ms = bench::median_ms(runs, 1, [&] { (void)batched(params, x, y).w1.dim(0); });
  auto example_grad = tg::grad([](const codelab::Mlp<D>& p, const tg::Tensor<float, D>& xi, const tg::Tensor<std::int32_t, D>& yi) {
    return dp_sgd::example_loss(p, xi, yi).first;
  });
  const std::int64_t n = std::min(loop_examples, batch);
  const double loop_grad_ms = bench::median_ms(std::max(1, runs / 2), 1, [&] {
    std::vector<codelab::Mlp<D>> gs;
    for (std::int64_t i = 0; i < n; ++i) gs.push_back(example_grad(params, tg::index_in_dim(x, i), tg::index_in_dim(y, i)));
    std::vector<tg::Tensor<float, D>> w1s;
    for (const auto& g : gs) w1s.push_back(g.w1);
    (void)tg::stack(std::span<const tg::Tensor<float, D>>(w1s));
  }) * static_cast<double>(batch) / static_cast<double>(n);
  std::printf("per-example gradients of the codelab MLP, batch %lld: compiled vmap(grad) %.1f ms (%.0f examples/s); loop of grad %.1f ms "
              "(%lld examples timed, scaled): vmap / loop speed %.1fx\n",
              static_cast<long long>(batch), vmap_grad_ms, 1e3 * static_cast<double>(batch) / vmap_grad_ms, loop_grad_ms,
              static_cast<long long>(n), loop_grad_ms / vmap_grad_ms);
  return 0;
}
