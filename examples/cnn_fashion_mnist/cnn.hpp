// A small convolutional network for 28x28 images in tapegrad, as Flax writes it: two 3x3 convolutions
// ("SAME", 32 and 64 features, ReLU), each followed by 2x2 max pooling with stride 2, then a ReLU dense
// layer of 128 and a linear head. The model, its loss, the training step and the evaluation;
// cnn_fashion_mnist.cpp trains it, the benchmark times its step, and scripts/cnn_reference.py is the same
// model in JAX + Flax for the golden first-batch values.
#pragma once

#include <tapegrad/tapegrad.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "../common/layers.hpp"

namespace cnn {

template <class D>
using Tensor = tg::Tensor<float, D>;
template <class D>
using Labels = tg::Tensor<std::int32_t, D>;

/// The sizes of the model. The defaults reach >= 0.92 test accuracy on Fashion-MNIST in a few epochs.
struct Config {
  std::int64_t image = 28, conv1 = 32, conv2 = 64, kernel = 3, dense = 128, classes = 10;
  std::int64_t flat() const { return (image / 4) * (image / 4) * conv2; }  // after two 2x2 poolings
  std::string str() const {
    const auto k = std::to_string(kernel) + "x" + std::to_string(kernel);
    return "conv " + k + " " + std::to_string(conv1) + ", pool, conv " + k + " " + std::to_string(conv2) + ", pool, dense " +
           std::to_string(dense) + ", dense " + std::to_string(classes);
  }
};

using examples::Conv;
using examples::Dense;

template <class D, class T = float>
struct Cnn {
  Conv<D, T> conv1, conv2;
  Dense<D, T> dense, head;
};
TG_PYTREE(Cnn, conv1, conv2, dense, head)

/// init_params(key, config): kernels normal / sqrt(fan_in) (LeCun normal; fan_in = kh * kw * in for a
/// convolution), biases 0; split(key, 4) gives conv1, conv2, dense and head their keys.
template <class D>
Cnn<D> init_params(tg::random::Key key, const Config& c = {}) {
  const auto k = tg::random::split(key, 4);
  auto lecun = [](tg::random::Key ki, const tg::Shape& shape, std::int64_t fan_in) {
    return tg::random::normal<float, D>(ki, shape) * static_cast<float>(1.0 / std::sqrt(static_cast<double>(fan_in)));
  };
  Cnn<D> p;
  p.conv1 = {lecun(k[0], {c.kernel, c.kernel, 1, c.conv1}, c.kernel * c.kernel), tg::zeros<float, D>({c.conv1})};
  p.conv2 = {lecun(k[1], {c.kernel, c.kernel, c.conv1, c.conv2}, c.kernel * c.kernel * c.conv1), tg::zeros<float, D>({c.conv2})};
  p.dense = {lecun(k[2], {c.flat(), c.dense}, c.flat()), tg::zeros<float, D>({c.dense})};
  p.head = {lecun(k[3], {c.dense, c.classes}, c.dense), tg::zeros<float, D>({c.classes})};
  return p;
}

/// forward(params, x, config): images (B, 784) in [0, 1] -> logits (B, classes) in f32, computed in C
/// (the parameters cast once, as Flax's dtype= does). `maps` receives the first block's pooled features.
template <class C, class D>
Tensor<D> forward(const Cnn<D>& params, const Tensor<D>& x, const Config& c, tg::Tensor<C, D>* maps = nullptr) {
  const Cnn<D, C> p = tg::tree_cast<C>(params);
  const std::int64_t B = x.dim(0);
  auto h = tg::max_pool(p.conv1(tg::cast<C>(x).reshape({B, c.image, c.image, 1}), tg::Activation::relu), {2, 2}, {2, 2});
  if (maps) *maps = h;
  h = tg::max_pool(p.conv2(h, tg::Activation::relu), {2, 2}, {2, 2});
  return tg::cast<float>(p.head(p.dense(h.reshape({B, c.flat()}), tg::Activation::relu)));
}

/// The mean softmax cross-entropy and, as aux, the batch accuracy.
template <class C, class D>
std::pair<Tensor<D>, Tensor<D>> loss_with_metrics(const Cnn<D>& p, const Tensor<D>& x, const Labels<D>& y, const Config& c) {
  return examples::loss_and_accuracy(forward<C>(p, x, c), y);
}

template <class D>
using Metrics = examples::StepMetrics<D>;

/// The optimizer: AdamW with a cosine decay from the peak rate (optax.adamw(cosine_decay_schedule)).
struct OptimConfig {
  double peak_lr = 2e-3, weight_decay = 1e-4;
  std::int64_t total_steps = 2000;
};

inline auto make_optimizer(const OptimConfig& o) {
  return tg::optim::adamw(tg::optim::cosine_decay_schedule(o.peak_lr, o.total_steps, 0.01), {.weight_decay = o.weight_decay});
}

/// train_step: value_and_grad with the accuracy as aux, the optimizer's update, apply_updates; the
/// metrics stay on the device.
template <class C, class D, class Optimizer, class State>
std::tuple<Cnn<D>, State, Metrics<D>> train_step(const Optimizer& optimizer, const Config& c, const Cnn<D>& params, const State& opt_state,
                                                 const Tensor<D>& x, const Labels<D>& y) {
  auto loss_fn = [&c](const Cnn<D>& p, const Tensor<D>& xb, const Labels<D>& yb) { return loss_with_metrics<C>(p, xb, yb, c); };
  return examples::classifier_step(loss_fn, optimizer, params, opt_state, x, y);
}

/// evaluate(params, batch): the summed loss and the predicted classes.
template <class D>
std::tuple<Tensor<D>, Labels<D>> evaluate(const Cnn<D>& params, const Tensor<D>& x, const Labels<D>& y, const Config& c) {
  return examples::evaluate_logits(forward<float>(params, x, c), y);
}

}  // namespace cnn
