// A small Vision Transformer for 28x28 images in tapegrad: 7x7 patches (16 tokens of 49 pixels) linearly
// embedded, a learned position embedding, pre-norm transformer blocks (multi-head self-attention and a
// GELU MLP), mean-pooled tokens, a linear head. The model, its loss, the training step and the evaluation;
// vit_fashion_mnist.cpp trains it, the benchmark times its step, and scripts/vit_reference.py is the same
// model in JAX, op for op, for the golden first-batch values.
#pragma once

#include <tapegrad/tapegrad.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace vit {

template <class D>
using Tensor = tg::Tensor<float, D>;
template <class D>
using Labels = tg::Tensor<std::int32_t, D>;

/// The sizes of the model. The defaults reach >= 0.88 test accuracy on Fashion-MNIST in a few epochs.
struct Config {
  std::int64_t image = 28, patch = 7, dim = 64, heads = 4, layers = 4, mlp = 128, classes = 10;
  double dropout = 0.0;  ///< after the attention projection and the MLP, in training
  double ln_eps = 1e-6;  ///< flax.linen.LayerNorm's default
  std::int64_t tokens() const { return (image / patch) * (image / patch); }
  std::int64_t patch_pixels() const { return patch * patch; }
  std::int64_t head_dim() const { return dim / heads; }
  std::string str() const {
    return "dim " + std::to_string(dim) + ", " + std::to_string(heads) + " heads, " + std::to_string(layers) + " blocks, MLP " +
           std::to_string(mlp) + ", " + std::to_string(tokens()) + " tokens of " + std::to_string(patch_pixels()) + " pixels";
  }
};

/// One pre-norm transformer block's parameters.
template <class D>
struct Block {
  Tensor<D> ln1_scale, ln1_bias, qkv_w, qkv_b, out_w, out_b, ln2_scale, ln2_bias, fc1_w, fc1_b, fc2_w, fc2_b;
};
TG_PYTREE(Block, ln1_scale, ln1_bias, qkv_w, qkv_b, out_w, out_b, ln2_scale, ln2_bias, fc1_w, fc1_b, fc2_w, fc2_b)

template <class D>
struct Vit {
  Tensor<D> patch_w, patch_b, pos;
  std::vector<Block<D>> blocks;
  Tensor<D> ln_scale, ln_bias, head_w, head_b;
};
TG_PYTREE(Vit, patch_w, patch_b, pos, blocks, ln_scale, ln_bias, head_w, head_b)

/// init_params(key, config): weights normal / sqrt(fan_in) (LeCun normal), the position embedding
/// normal * 0.02, biases 0, LayerNorm scales 1. Keys: split(key, 2 + 4 layers) — [0] patch embedding,
/// [1] position embedding, [2 + 4l + j] block l's qkv, out, fc1, fc2 weights — then fold_in(key, 1000) for
/// the head.
template <class D>
Vit<D> init_params(tg::random::Key key, const Config& c = {}) {
  const auto k = tg::random::split(key, static_cast<int>(2 + 4 * c.layers));
  auto dense = [](tg::random::Key ki, std::int64_t fan_in, std::int64_t fan_out) {
    return tg::random::normal<float, D>(ki, {fan_in, fan_out}) * static_cast<float>(1.0 / std::sqrt(static_cast<double>(fan_in)));
  };
  auto zeros = [](std::int64_t n) { return tg::zeros<float, D>({n}); };
  auto ones = [](std::int64_t n) { return tg::ones<float, D>({n}); };
  Vit<D> p;
  p.patch_w = dense(k[0], c.patch_pixels(), c.dim), p.patch_b = zeros(c.dim);
  p.pos = tg::random::normal<float, D>(k[1], {c.tokens(), c.dim}) * 0.02f;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const auto* kl = &k[static_cast<std::size_t>(2 + 4 * l)];
    p.blocks.push_back({ones(c.dim), zeros(c.dim), dense(kl[0], c.dim, 3 * c.dim), zeros(3 * c.dim), dense(kl[1], c.dim, c.dim),
                        zeros(c.dim), ones(c.dim), zeros(c.dim), dense(kl[2], c.dim, c.mlp), zeros(c.mlp), dense(kl[3], c.mlp, c.dim),
                        zeros(c.dim)});
  }
  p.ln_scale = ones(c.dim), p.ln_bias = zeros(c.dim);
  p.head_w = dense(tg::random::fold_in(key, 1000), c.dim, c.classes), p.head_b = zeros(c.classes);
  return p;
}

/// Images (B, 784) -> patches (B * 16, 49): (B, 4, 7, 4, 7) with the two patch-grid axes brought together.
template <class C, class D>
tg::Tensor<C, D> patches(const Tensor<D>& x, const Config& c) {
  const std::int64_t g = c.image / c.patch;
  return tg::cast<C>(tg::transpose(x.reshape({-1, g, c.patch, g, c.patch}), {0, 1, 3, 2, 4})).reshape({-1, c.patch_pixels()});
}

/// Where dropout draws its masks: a device key (one per step; none in evaluation).
template <class D>
struct Rng {
  const tg::Tensor<std::uint32_t, D>* key = nullptr;
};

template <class C, class D>
tg::Tensor<C, D> maybe_dropout(const tg::Tensor<C, D>& x, const Config& c, Rng<D> rng, std::uint32_t site) {
  if (rng.key == nullptr || c.dropout == 0.0) return x;
  // A distinct mask per site: the step's key with the site's number added to its second word.
  const auto site_key = tg::add(*rng.key, tg::from_vector<D>(std::vector<std::uint32_t>{0u, site}));
  return tg::dropout(site_key, x, c.dropout);
}

/// Multi-head self-attention of h (B, T, dim) -> (B, T, dim), the softmax weights (B, heads, T, T) kept in
/// `attention` when given.
template <class C, class D>
tg::Tensor<C, D> attention(const Block<D>& b, const tg::Tensor<C, D>& h, const Config& c, tg::Tensor<C, D>* weights) {
  const std::int64_t B = h.dim(0), T = h.dim(1);
  // (B T, 3 dim) -> (B, T, 3, heads, head_dim) -> (3, B, heads, T, head_dim)
  const auto qkv = tg::transpose(tg::linear(h.reshape({B * T, c.dim}), tg::cast<C>(b.qkv_w), tg::cast<C>(b.qkv_b))
                                     .reshape({B, T, 3, c.heads, c.head_dim()}),
                                 {2, 0, 3, 1, 4});
  const auto q = tg::index_in_dim(qkv, 0), k = tg::index_in_dim(qkv, 1), v = tg::index_in_dim(qkv, 2);
  const auto scores = tg::matmul(q, k, false, true) * static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim())));
  const auto p = tg::softmax(scores);
  if (weights) *weights = p;
  const auto o = tg::transpose(tg::matmul(p, v), {0, 2, 1, 3}).reshape({B * T, c.dim});  // heads side by side
  return tg::linear(o, tg::cast<C>(b.out_w), tg::cast<C>(b.out_b)).reshape({B, T, c.dim});
}

/// forward(params, x, config): logits (B, classes) in f32, computed in C (parameters cast per call);
/// each block's attention weights appended to `weights` when given.
template <class C, class D>
Tensor<D> forward(const Vit<D>& p, const Tensor<D>& x, const Config& c, Rng<D> rng = {},
                  std::vector<tg::Tensor<C, D>>* weights = nullptr) {
  const std::int64_t B = x.dim(0), T = c.tokens();
  auto h = tg::linear(patches<C>(x, c), tg::cast<C>(p.patch_w), tg::cast<C>(p.patch_b)).reshape({B, T, c.dim}) + tg::cast<C>(p.pos);
  std::uint32_t site = 0;
  for (const auto& b : p.blocks) {
    tg::Tensor<C, D> w;
    const auto a = attention<C>(b, tg::layer_norm(h, tg::cast<C>(b.ln1_scale), tg::cast<C>(b.ln1_bias), c.ln_eps), c, weights ? &w : nullptr);
    h = h + maybe_dropout(a, c, rng, site++);
    if (weights) weights->push_back(w);
    const auto m = tg::layer_norm(h, tg::cast<C>(b.ln2_scale), tg::cast<C>(b.ln2_bias), c.ln_eps).reshape({B * T, c.dim});
    const auto f = tg::linear(tg::linear(m, tg::cast<C>(b.fc1_w), tg::cast<C>(b.fc1_b), tg::Activation::gelu), tg::cast<C>(b.fc2_w),
                              tg::cast<C>(b.fc2_b));
    h = h + maybe_dropout(f.reshape({B, T, c.dim}), c, rng, site++);
  }
  const auto pooled = tg::mean(tg::layer_norm(h, tg::cast<C>(p.ln_scale), tg::cast<C>(p.ln_bias), c.ln_eps), 1);
  return tg::cast<float>(tg::linear(pooled, tg::cast<C>(p.head_w), tg::cast<C>(p.head_b)));
}

/// The mean softmax cross-entropy and, as aux, the batch accuracy.
template <class C, class D>
std::pair<Tensor<D>, Tensor<D>> loss_with_metrics(const Vit<D>& p, const Tensor<D>& x, const Labels<D>& y, const Config& c, Rng<D> rng = {}) {
  const auto logits = forward<C>(p, x, c, rng);
  return {tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::accuracy(logits, y)};
}

template <class D>
struct Metrics {
  Tensor<D> loss, accuracy, grad_norm;
};
TG_PYTREE(Metrics, loss, accuracy, grad_norm)

/// The optimizer: global-norm clipping, then AdamW with a linear warm-up and a cosine decay, from
/// tg::optim's transforms (optax.chain(clip_by_global_norm, adamw(warmup_cosine_decay_schedule))).
struct OptimConfig {
  double peak_lr = 2e-3, weight_decay = 0.05, clip = 1.0;
  std::int64_t warmup_steps = 200, total_steps = 2000;
};

inline auto make_optimizer(const OptimConfig& o) {
  const auto schedule = tg::optim::warmup_cosine_decay_schedule(0.0, o.peak_lr, o.warmup_steps, o.total_steps, o.peak_lr * 0.01);
  return tg::optim::chain(tg::optim::clip_by_global_norm(o.clip), tg::optim::adamw(schedule, {.weight_decay = o.weight_decay}));
}

/// train_step: value_and_grad with the accuracy as aux, the optimizer's update, apply_updates; the
/// metrics (the gradient norm before clipping) stay on the device. `key` (uint32 (2,)) feeds dropout.
template <class C, class D, class Optimizer, class State>
std::tuple<Vit<D>, State, Metrics<D>> train_step(const Optimizer& optimizer, const Config& c, const Vit<D>& params, const State& opt_state,
                                                 const Tensor<D>& x, const Labels<D>& y, const tg::Tensor<std::uint32_t, D>& key) {
  auto loss_fn = [&c, &key](const Vit<D>& p, const Tensor<D>& xb, const Labels<D>& yb) {
    return loss_with_metrics<C>(p, xb, yb, c, Rng<D>{&key});
  };
  auto [loss_and_accuracy, grads] = tg::value_and_grad(loss_fn, tg::has_aux)(params, x, y);
  auto [updates, next_state] = optimizer.update(grads, opt_state, params);
  Metrics<D> metrics{loss_and_accuracy.first, loss_and_accuracy.second, tg::global_norm(grads)};
  return {tg::optim::apply_updates(params, updates), next_state, metrics};
}

/// evaluate(params, batch): the summed loss and the predicted classes.
template <class D>
std::tuple<Tensor<D>, Labels<D>> evaluate(const Vit<D>& params, const Tensor<D>& x, const Labels<D>& y, const Config& c) {
  const auto logits = forward<float>(params, x, c);
  return {tg::sum(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::argmax(logits, 1)};
}

}  // namespace vit
