// The optimizers, literally as chains of atoms (optax/_src/alias.py): sgd, adam, adamw.
#pragma once

#include "tapegrad/config.hpp"
#include "tapegrad/optim/combine.hpp"
#include "tapegrad/optim/transforms.hpp"

namespace tg::inline TG_ABI::optim {

/// Plain SGD: chain(identity(), scale_by_learning_rate(lr)). lr: a number or a schedule.
template <class LR>
auto sgd(LR learning_rate) {
  return chain(identity(), scale_by_learning_rate(learning_rate));
}

/// SGD with momentum: chain(trace(momentum, nesterov), scale_by_learning_rate(lr)).
template <class LR>
auto sgd(LR learning_rate, double momentum, bool nesterov = false) {
  return chain(trace(momentum, nesterov), scale_by_learning_rate(learning_rate));
}

/// Adam: chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(lr)).
template <class LR>
auto adam(LR learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8, double eps_root = 0.0) {
  return chain(scale_by_adam(b1, b2, eps, eps_root, "adam"), scale_by_learning_rate(learning_rate));
}

/// Hyperparameters of adamw beyond the learning rate, with Optax's defaults.
struct AdamWOptions {
  double b1 = 0.9, b2 = 0.999, eps = 1e-8, eps_root = 0.0;
  double weight_decay = 1e-4;
};

/// AdamW: chain(scale_by_adam(...), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr)).
/// As in Optax, the decay is applied before the learning rate, so the effective decay per step is
/// lr * weight_decay (the paper decouples it from lr; Optax's docstring notes the same difference).
/// mask: a predicate on the leaf path (e.g. no decay on biases) or a bool pytree; default every leaf.
template <class LR, class Mask = AllLeaves>
auto adamw(LR learning_rate, AdamWOptions o = {}, Mask mask = {}) {
  return chain(scale_by_adam(o.b1, o.b2, o.eps, o.eps_root, "adamw"), add_decayed_weights(o.weight_decay, std::move(mask)),
               scale_by_learning_rate(learning_rate));
}

/// adamw with Optax's positional order: (lr, b1, b2, eps, weight_decay, mask).
template <class LR, class Mask = AllLeaves>
auto adamw(LR learning_rate, double b1, double b2 = 0.999, double eps = 1e-8, double weight_decay = 1e-4, Mask mask = {}) {
  return adamw(learning_rate, AdamWOptions{b1, b2, eps, 0.0, weight_decay}, std::move(mask));
}

}  // namespace tg::optim
