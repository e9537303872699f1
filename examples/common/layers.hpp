// The examples' layers, as Flax names them: parameter structs (pytrees) that apply themselves. Dense and
// Conv take an activation fused into the GEMM or convolution; LayerNorm normalises the last axis. And what
// every classifier model does with its logits: the loss with the accuracy as aux, the training step, the
// evaluation. Included by the model files (cnn.hpp, vit.hpp), so by the benchmarks and golden tests too:
// tapegrad only.
#pragma once

#include <tapegrad/tapegrad.hpp>

#include <cstdint>
#include <tuple>
#include <utility>

namespace examples {

/// flax.linen.Dense's parameters: the kernel (in, out) and the bias (out,); called on x (B, in).
template <class D, class T = float>
struct Dense {
  tg::Tensor<T, D> w, b;
  tg::Tensor<T, D> operator()(const tg::Tensor<T, D>& x, tg::Activation act = tg::Activation::none) const { return tg::linear(x, w, b, act); }
};
TG_PYTREE(Dense, w, b)

/// flax.linen.Conv's parameters: the kernel (kh, kw, in, out) HWIO and the bias (out,); "SAME" padding,
/// stride 1; called on images NHWC.
template <class D, class T = float>
struct Conv {
  tg::Tensor<T, D> w, b;
  tg::Tensor<T, D> operator()(const tg::Tensor<T, D>& x, tg::Activation act = tg::Activation::none) const { return tg::conv(x, w, b, act); }
};
TG_PYTREE(Conv, w, b)

/// flax.linen.LayerNorm's parameters: scale and bias (n,) over the last axis.
template <class D, class T = float>
struct LayerNorm {
  tg::Tensor<T, D> scale, bias;
  tg::Tensor<T, D> operator()(const tg::Tensor<T, D>& x, double eps) const { return tg::layer_norm(x, scale, bias, eps); }
};
TG_PYTREE(LayerNorm, scale, bias)

/// The mean softmax cross-entropy of the logits (B, classes) and, as aux, the batch accuracy.
template <class D>
std::pair<tg::Tensor<float, D>, tg::Tensor<float, D>> loss_and_accuracy(const tg::Tensor<float, D>& logits, const tg::Tensor<std::int32_t, D>& y) {
  return {tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::accuracy(logits, y)};
}

/// What a classifier's training step returns besides the parameters and the optimizer state; on the device.
template <class D>
struct StepMetrics {
  tg::Tensor<float, D> loss, accuracy, grad_norm;  ///< grad_norm: the gradient's global norm before the optimizer
};
TG_PYTREE(StepMetrics, loss, accuracy, grad_norm)

/// One training step: value_and_grad of loss_fn(params, batch...) -> (loss, accuracy) with the accuracy as
/// aux, the optimizer's update, apply_updates.
template <class LossFn, class Params, class Optimizer, class State, class... Batch>
auto classifier_step(const LossFn& loss_fn, const Optimizer& optimizer, const Params& params, const State& opt_state, const Batch&... batch) {
  using D = typename decltype(tg::global_norm(params))::device_type;
  auto [loss_and_accuracy, grads] = tg::value_and_grad(loss_fn, tg::has_aux)(params, batch...);
  auto [updates, next_state] = optimizer.update(grads, opt_state, params);
  StepMetrics<D> metrics{loss_and_accuracy.first, loss_and_accuracy.second, tg::global_norm(grads)};
  return std::tuple<Params, State, StepMetrics<D>>{tg::optim::apply_updates(params, updates), next_state, metrics};
}

/// The evaluation of a batch's logits (B, classes): the summed loss and the predicted classes.
template <class D>
std::tuple<tg::Tensor<float, D>, tg::Tensor<std::int32_t, D>> evaluate_logits(const tg::Tensor<float, D>& logits, const tg::Tensor<std::int32_t, D>& y) {
  return {tg::sum(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::argmax(logits, 1)};
}

}  // namespace examples
