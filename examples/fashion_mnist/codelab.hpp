// The codelab's training code in C++, in its order and under its names: the model, the loss, the steps
// and the evaluation. fashion_mnist.cpp runs them section by section and builds the report around them;
// docs/example.md sets each beside the codelab's JAX cell.
#pragma once

#include <tapegrad/tapegrad.hpp>
#if defined(TG_WITH_DIST)
#include <tapegrad/distributed/distributed.hpp>
#endif

#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>

namespace codelab {

template <class D>
using Tensor = tg::Tensor<float, D>;
template <class D>
using Labels = tg::Tensor<std::int32_t, D>;

/// params = {"w1": ..., "b1": ..., ...}; T is the element type (tg::tree_cast changes it).
template <class D, class T = float>
struct Mlp {
  tg::Tensor<T, D> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

/// The metrics a train_step returns: {"loss", "accuracy", "grad_norm"} (and, under --check-numerics,
/// which gradients went non-finite).
template <class D>
struct Metrics {
  Tensor<D> loss, accuracy, grad_norm;
  Mlp<D> grad_flags;
};
TG_PYTREE(Metrics, loss, accuracy, grad_norm, grad_flags)

struct Sizes {
  std::int64_t input = 784, hidden1 = 256, hidden2 = 128, classes = 10;
};

/// init_mlp_params(key): He-normal weights from jax.random.split(key, 3), zero biases.
template <class D>
Mlp<D> init_mlp_params(tg::random::Key key, const Sizes& s = {}) {
  const auto k = tg::random::split(key, 3);
  auto he = [](tg::random::Key ki, std::int64_t fan_in, std::int64_t fan_out) {
    return tg::random::normal<float, D>(ki, {fan_in, fan_out}) * static_cast<float>(std::sqrt(2.0 / static_cast<double>(fan_in)));
  };
  return {he(k[0], s.input, s.hidden1), tg::zeros<float, D>({s.hidden1}), he(k[1], s.hidden1, s.hidden2),
          tg::zeros<float, D>({s.hidden2}),   he(k[2], s.hidden2, s.classes), tg::zeros<float, D>({s.classes})};
}

/// mlp(params, x, compute_dtype): logits (B, 10) in f32; the layers in C (the parameters cast once per
/// call, jax.tree.map(lambda p: p.astype(C), params)).
template <class C, class D>
Tensor<D> mlp(const Mlp<D>& params, const Tensor<D>& x) {
  const Mlp<D, C> p = tg::tree_cast<C>(params);
  auto h = tg::linear(tg::cast<C>(x), p.w1, p.b1, tg::Activation::gelu);
  h = tg::linear(h, p.w2, p.b2, tg::Activation::gelu);
  return tg::cast<float>(tg::linear(h, p.w3, p.b3));
}

/// cross_entropy_loss(params, batch): the mean softmax cross-entropy.
template <class D>
Tensor<D> cross_entropy_loss(const Mlp<D>& params, const Tensor<D>& x, const Labels<D>& y) {
  return tg::mean(tg::softmax_cross_entropy_with_integer_labels(mlp<float>(params, x), y));
}

/// loss_with_metrics(params, batch, compute_dtype): (loss, accuracy), the accuracy as aux.
template <class C, class D>
std::pair<Tensor<D>, Tensor<D>> loss_with_metrics(const Mlp<D>& params, const Tensor<D>& x, const Labels<D>& y) {
  const auto logits = mlp<C>(params, x);
  return {tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::accuracy(logits, y)};
}

/// sgd_step(params, batch): plain SGD by hand, jax.tree.map(lambda p, g: p - lr * g, params, grads).
template <class D>
std::pair<Mlp<D>, Tensor<D>> sgd_step(const Mlp<D>& params, const Tensor<D>& x, const Labels<D>& y, float lr) {
  auto [loss, grads] = tg::value_and_grad(cross_entropy_loss<D>)(params, x, y);
  return {tg::tree_map([lr](const auto& p, const auto& g) { return p - g * lr; }, params, grads), loss};
}

/// How a train_step runs beside the codelab's: the gradients' non-finite flags kept (--check-numerics),
/// and the mean over the ranks of a data-parallel run (tg::dist, under mpirun).
struct StepOptions {
  bool check_numerics = false;
  bool data_parallel = false;
};

/// train_step(params, opt_state, batch, compute_dtype): value_and_grad with has_aux, the optimizer's
/// update, apply_updates; the metrics stay on the device.
template <class C, class D, class Optimizer, class State>
std::tuple<Mlp<D>, State, Metrics<D>> train_step(const Optimizer& optimizer, const Mlp<D>& params, const State& opt_state,
                                                  const Tensor<D>& x, const Labels<D>& y, StepOptions o = {}) {
  auto [loss_and_accuracy, grads] = tg::value_and_grad(loss_with_metrics<C, D>, tg::has_aux)(params, x, y);
#if defined(TG_WITH_DIST)
  if (o.data_parallel) {  // the gradient of the global batch's mean loss: the mean over the ranks
    grads = tg::dist::all_reduce_mean(grads);
    loss_and_accuracy = tg::dist::all_reduce_mean(loss_and_accuracy);
  }
#endif
  auto [updates, next_state] = optimizer.update(grads, opt_state, params);
  auto flags = o.check_numerics ? tg::nonfinite_flags(grads) : tg::tree_map([](const auto&) { return tg::zeros<float, D>({}); }, grads);
  Metrics<D> metrics{loss_and_accuracy.first, loss_and_accuracy.second, tg::global_norm(grads), flags};
  return {tg::optim::apply_updates(params, updates), next_state, metrics};
}

/// The training loop: steps first..last (1-based) over the batches in turn, each a compiled train_step
/// with the parameters and optimizer state donated; after each, on_step(step, metrics, log) with log true
/// every log_every steps and at the first and last (when the codelab reads its metrics: only then do
/// they leave the device).
template <class Step, class P, class S, class Batches, class OnStep>
void train_loop(Step& train_step, P& params, S& opt_state, const Batches& batches, int first, int last, int log_every, OnStep&& on_step) {
  for (int step = first; step <= last; ++step) {
    const auto& batch = batches[static_cast<std::size_t>(step - 1) % batches.size()];
    auto [p, s, metrics] = train_step(std::move(params), std::move(opt_state), batch.x, batch.y);
    params = std::move(p), opt_state = std::move(s);
    on_step(step, metrics, step % log_every == 0 || step == first || step == last);
  }
}

/// eval_one_batch(params, batch): the summed loss over the batch and the predicted classes.
template <class D>
std::tuple<Tensor<D>, Labels<D>> eval_one_batch(const Mlp<D>& params, const Tensor<D>& x, const Labels<D>& y) {
  const auto logits = mlp<float>(params, x);
  return {tg::sum(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::argmax(logits, 1)};
}

/// evaluate_batches(params, x_batches, y_batches): every test batch at once, as the codelab's
/// jax.vmap(eval_one_batch)(x_batches, y_batches): the batches stacked (batches, batch, 784) and
/// (batches, batch) -> each batch's summed loss (batches,) and predictions (batches, batch).
template <class D>
std::tuple<Tensor<D>, Labels<D>> evaluate_batches(const Mlp<D>& params, const Tensor<D>& x_batches, const Labels<D>& y_batches) {
  return tg::vmap(eval_one_batch<D>, {std::nullopt, 0, 0})(params, x_batches, y_batches);
}

}  // namespace codelab
