// The optimizers of optax/_src/alias.py: sgd and adam, literally chains of atoms; adamw, the chain of its
// atoms run as one pass, is its own transformation (optim/adamw.hpp).
#pragma once

#include "tapegrad/config.hpp"
#include "tapegrad/optim/adamw.hpp"
#include "tapegrad/optim/combine.hpp"
#include "tapegrad/optim/transforms.hpp"

TG_BEGIN_NAMESPACE
namespace optim {

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

}  // namespace optim
TG_END_NAMESPACE
