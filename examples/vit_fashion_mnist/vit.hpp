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

#include "../common/layers.hpp"

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
  bool checkpoint_blocks = false;  ///< tg::checkpoint each block (jax.checkpoint): its forward runs again in the backward pass, its activations are not kept
  std::int64_t tokens() const { return (image / patch) * (image / patch); }
  std::int64_t patch_pixels() const { return patch * patch; }
  std::int64_t head_dim() const { return dim / heads; }
  std::string str() const {
    return "dim " + std::to_string(dim) + ", " + std::to_string(heads) + " heads, " + std::to_string(layers) + " blocks, MLP " +
           std::to_string(mlp) + ", " + std::to_string(tokens()) + " tokens of " + std::to_string(patch_pixels()) + " pixels";
  }
};

using examples::Dense;
using examples::LayerNorm;

/// One pre-norm transformer block: LayerNorm, self-attention (qkv in one Dense, the heads' outputs through
/// `out`), LayerNorm, a GELU MLP.
template <class D, class T = float>
struct Block {
  LayerNorm<D, T> ln1;
  Dense<D, T> qkv, out;
  LayerNorm<D, T> ln2;
  Dense<D, T> fc1, fc2;
};
TG_PYTREE(Block, ln1, qkv, out, ln2, fc1, fc2)

template <class D, class T = float>
struct Vit {
  Dense<D, T> patch;
  tg::Tensor<T, D> pos;
  std::vector<Block<D, T>> blocks;
  LayerNorm<D, T> ln;
  Dense<D, T> head;
};
TG_PYTREE(Vit, patch, pos, blocks, ln, head)

/// init_params(key, config): weights normal / sqrt(fan_in) (LeCun normal), the position embedding
/// normal * 0.02, biases 0, LayerNorm scales 1. Keys: split(key, 2 + 4 layers) — [0] patch embedding,
/// [1] position embedding, [2 + 4l + j] block l's qkv, out, fc1, fc2 weights — then fold_in(key, 1000) for
/// the head.
template <class D>
Vit<D> init_params(tg::random::Key key, const Config& c = {}) {
  const auto k = tg::random::split(key, static_cast<int>(2 + 4 * c.layers));
  auto dense = [](tg::random::Key ki, std::int64_t fan_in, std::int64_t fan_out) {
    return Dense<D>{tg::random::normal<float, D>(ki, {fan_in, fan_out}) * static_cast<float>(1.0 / std::sqrt(static_cast<double>(fan_in))),
                    tg::zeros<float, D>({fan_out})};
  };
  auto layer_norm = [](std::int64_t n) { return LayerNorm<D>{tg::ones<float, D>({n}), tg::zeros<float, D>({n})}; };
  Vit<D> p;
  p.patch = dense(k[0], c.patch_pixels(), c.dim);
  p.pos = tg::random::normal<float, D>(k[1], {c.tokens(), c.dim}) * 0.02f;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const auto* kl = &k[static_cast<std::size_t>(2 + 4 * l)];
    p.blocks.push_back({.ln1 = layer_norm(c.dim),
                        .qkv = dense(kl[0], c.dim, 3 * c.dim),
                        .out = dense(kl[1], c.dim, c.dim),
                        .ln2 = layer_norm(c.dim),
                        .fc1 = dense(kl[2], c.dim, c.mlp),
                        .fc2 = dense(kl[3], c.mlp, c.dim)});
  }
  p.ln = layer_norm(c.dim);
  p.head = dense(tg::random::fold_in(key, 1000), c.dim, c.classes);
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
  // A distinct mask per site: jax.random.fold_in(key, site), on the device.
  return tg::dropout(tg::random::fold_in(*rng.key, site), x, c.dropout);
}

/// Multi-head self-attention of h (B, T, dim) -> (B, T, dim), as Flax's MultiHeadDotProductAttention: q, k
/// and v (B, T, heads, head_dim) from one Dense, jax.nn.dot_product_attention (fused: no (T, T) matrix in
/// memory), the heads side by side through `out`. The softmax weights (B, heads, T, T) go to `weights` when
/// given.
template <class C, class D>
tg::Tensor<C, D> attention(const Block<D, C>& b, const tg::Tensor<C, D>& h, const Config& c, tg::Tensor<C, D>* weights) {
  const std::int64_t B = h.dim(0), T = h.dim(1);
  const auto qkv = b.qkv(h.reshape({B * T, c.dim})).reshape({B, T, 3, c.heads, c.head_dim()});
  const auto q = tg::index_in_dim(qkv, 0, 2), k = tg::index_in_dim(qkv, 1, 2), v = tg::index_in_dim(qkv, 2, 2);
  if (weights) *weights = tg::dot_product_attention_weights(q, k);
  return b.out(tg::dot_product_attention(q, k, v).reshape({B * T, c.dim})).reshape({B, T, c.dim});
}

/// One pre-norm block: h + attention(ln1(h)), then + MLP(ln2(.)); dropout sites `site` and `site + 1`.
template <class C, class D>
tg::Tensor<C, D> block(const Block<D, C>& b, const tg::Tensor<C, D>& h, const Config& c, Rng<D> rng, std::uint32_t site, tg::Tensor<C, D>* weights) {
  const std::int64_t B = h.dim(0), T = h.dim(1);
  const auto a = h + maybe_dropout(attention<C>(b, b.ln1(h, c.ln_eps), c, weights), c, rng, site);
  const auto m = b.ln2(a, c.ln_eps).reshape({B * T, c.dim});
  return a + maybe_dropout(b.fc2(b.fc1(m, tg::Activation::gelu)).reshape({B, T, c.dim}), c, rng, site + 1);
}

/// forward(params, x, config): logits (B, classes) in f32, computed in C (the parameters cast once, as
/// Flax's dtype= does); each block's attention weights appended to `weights` when given. With
/// c.checkpoint_blocks each block is a tg::checkpoint of block(): its intermediate values are recomputed
/// in the backward pass instead of kept (the step's peak memory against the plain one: bench_train_step
/// --model vit).
template <class C, class D>
Tensor<D> forward(const Vit<D>& params, const Tensor<D>& x, const Config& c, Rng<D> rng = {},
                  std::vector<tg::Tensor<C, D>>* weights = nullptr) {
  const Vit<D, C> p = tg::tree_cast<C>(params);
  const std::int64_t B = x.dim(0), T = c.tokens();
  auto h = p.patch(patches<C>(x, c)).reshape({B, T, c.dim}) + p.pos;
  std::uint32_t site = 0;
  for (const auto& b : p.blocks) {
    if (c.checkpoint_blocks && !weights) {
      // Config and Rng by value: the backward pass runs this again after forward() has returned.
      auto remat = [c, rng, site](const std::pair<Block<D, C>, tg::Tensor<C, D>>& in) { return block<C, D>(in.first, in.second, c, rng, site, nullptr); };
      h = tg::checkpoint(remat)(std::pair{b, h});
    } else {
      tg::Tensor<C, D> w;
      h = block<C>(b, h, c, rng, site, weights ? &w : nullptr);
      if (weights) weights->push_back(w);
    }
    site += 2;
  }
  const auto pooled = tg::mean(p.ln(h, c.ln_eps), 1);
  return tg::cast<float>(p.head(pooled));
}

/// The mean softmax cross-entropy and, as aux, the batch accuracy.
template <class C, class D>
std::pair<Tensor<D>, Tensor<D>> loss_with_metrics(const Vit<D>& p, const Tensor<D>& x, const Labels<D>& y, const Config& c, Rng<D> rng = {}) {
  return examples::loss_and_accuracy(forward<C>(p, x, c, rng), y);
}

template <class D>
using Metrics = examples::StepMetrics<D>;

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
  return examples::classifier_step(loss_fn, optimizer, params, opt_state, x, y);
}

/// evaluate(params, batch): the summed loss and the predicted classes.
template <class D>
std::tuple<Tensor<D>, Labels<D>> evaluate(const Vit<D>& params, const Tensor<D>& x, const Labels<D>& y, const Config& c) {
  return examples::evaluate_logits(forward<float>(params, x, c), y);
}

}  // namespace vit
