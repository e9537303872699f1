// DP-SGD (Abadi et al. 2016) for the codelab's MLP, as JAX's examples/differentially_private_sgd.py and
// Opacus write it: each example's gradient (tg::vmap of tg::grad), clipped to an L2 norm of at most C,
// summed, Gaussian noise of standard deviation sigma C added, divided by the batch size; then an
// ordinary optimizer step. dp_sgd.cpp trains with it and reports; scripts/dp_sgd_reference.py is the same
// code in JAX + Optax.
#pragma once

#include <tapegrad/tapegrad.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

#include "../fashion_mnist/codelab.hpp"

namespace dp_sgd {

template <class D>
using Tensor = tg::Tensor<float, D>;
template <class D>
using Labels = tg::Tensor<std::int32_t, D>;
template <class D>
using Mlp = codelab::Mlp<D>;

/// One example's loss and whether it was classified right: x (784,), y () -> (loss, correct).
template <class D>
std::pair<Tensor<D>, Tensor<D>> example_loss(const Mlp<D>& params, const Tensor<D>& x, const Labels<D>& y) {
  const auto logits = codelab::mlp<float>(params, x.reshape({1, -1}));
  const auto label = y.reshape({1});
  return {tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, label)), tg::accuracy(logits, label)};
}

/// Every example's gradient: jax.vmap(jax.grad(loss, has_aux=True), in_axes=(None, 0, 0)). Each leaf
/// gets a leading batch axis: w1 (B, 784, 256), ...; the losses and correct flags are (B,).
template <class D>
auto per_example_grads(const Mlp<D>& params, const Tensor<D>& x, const Labels<D>& y) {
  return tg::vmap(tg::value_and_grad(example_loss<D>, tg::has_aux), {std::nullopt, 0, 0})(params, x, y);
}

/// Each example's gradient norm over all leaves, jax.vmap(optax.global_norm)(grads): (B,).
template <class D>
Tensor<D> per_example_norms(const Mlp<D>& grads) {
  return tg::vmap([](const Mlp<D>& g) { return tg::global_norm(g); })(grads);
}

struct Privacy {
  double l2_norm_clip = 1.0, noise_multiplier = 1.1;
};

/// The private gradient: sum_b g_b / max(1, |g_b| / C), plus sigma C N(0, 1) per coordinate (leaf i's
/// noise from fold_in(key, i)), over B. Returns it with the norms.
template <class D>
std::pair<Mlp<D>, Tensor<D>> private_gradient(const Mlp<D>& grads, const tg::Tensor<std::uint32_t, D>& key, const Privacy& p) {
  const Tensor<D> norms = per_example_norms(grads);
  const std::int64_t batch = norms.dim(0);
  const Tensor<D> scale = 1.0f / tg::maximum(norms * static_cast<float>(1.0 / p.l2_norm_clip), tg::ones<float, D>({}));
  Mlp<D> out = grads;
  std::uint32_t leaf = 0;
  tg::tree_for_each([&](const std::string&, auto& g, const auto& per_example) {
    std::vector<std::int64_t> dims(per_example.shape().dims().begin() + 1, per_example.shape().dims().end());
    // sum_b scale_b g_b: one pass over the per-example gradients, as a (1, B) @ (B, n) GEMM.
    const auto clipped_sum = tg::matmul(scale.reshape({1, batch}), per_example.reshape({batch, -1})).reshape(tg::Shape(dims));
    const auto noise = tg::random::normal<float, D>(tg::random::fold_in(key, leaf++), tg::Shape(dims));
    g = (clipped_sum + noise * static_cast<float>(p.l2_norm_clip * p.noise_multiplier)) * static_cast<float>(1.0 / static_cast<double>(batch));
  }, out, grads);
  return {out, norms};
}

/// The metrics a step returns: the batch's mean loss and accuracy, and the mean per-example gradient
/// norm and fraction of examples clipped.
template <class D>
struct Metrics {
  Tensor<D> loss, accuracy, mean_norm, clipped;
};
TG_PYTREE(Metrics, loss, accuracy, mean_norm, clipped)

/// train_step(params, opt_state, batch, key): per-example gradients, the private gradient, the update.
template <class D, class Optimizer, class State>
std::tuple<Mlp<D>, State, Metrics<D>> train_step(const Optimizer& optimizer, const Privacy& privacy, const Mlp<D>& params, const State& opt_state,
                                                  const Tensor<D>& x, const Labels<D>& y, const tg::Tensor<std::uint32_t, D>& key) {
  auto [losses_and_correct, grads] = per_example_grads(params, x, y);
  auto [g, norms] = private_gradient(grads, key, privacy);
  auto [updates, next_state] = optimizer.update(g, opt_state, params);
  const auto clipped = tg::mean(tg::cast<float>(tg::greater(norms, tg::full<float, D>({}, static_cast<float>(privacy.l2_norm_clip)))));
  Metrics<D> m{tg::mean(losses_and_correct.first), tg::mean(losses_and_correct.second), tg::mean(norms), clipped};
  return {tg::optim::apply_updates(params, updates), next_state, m};
}

}  // namespace dp_sgd
