// A physics-informed network for the 2-D Poisson problem -lap(u) = f on the unit square with u = 0 on its
// boundary, f(x, y) = 2 pi^2 sin(pi x) sin(pi y), whose solution is sin(pi x) sin(pi y): an MLP N(x, y)
// with tanh, the boundary condition built in (u = x (1 - x) y (1 - y) N, as Lagaris et al. 1998), and a
// loss made of the network's second derivatives in its inputs, by tg::jvp of tg::grad. The same model
// in JAX: scripts/pinn_poisson_reference.py.
#pragma once

#include <tapegrad/tapegrad.hpp>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <tuple>
#include <vector>

namespace pinn {

template <class D>
using Tensor = tg::Tensor<float, D>;

/// N: 2 -> width -> width -> 1, tanh between.
template <class D>
struct Mlp {
  Tensor<D> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

/// Glorot-normal weights (normal * sqrt(2 / (fan_in + fan_out))) from jax.random.split(key, 3), zero biases.
template <class D>
Mlp<D> init_params(tg::random::Key key, std::int64_t width) {
  const auto k = tg::random::split(key, 3);
  auto glorot = [](tg::random::Key ki, std::int64_t fan_in, std::int64_t fan_out) {
    return tg::random::normal<float, D>(ki, {fan_in, fan_out}) * static_cast<float>(std::sqrt(2.0 / static_cast<double>(fan_in + fan_out)));
  };
  return {glorot(k[0], 2, width), tg::zeros<float, D>({width}), glorot(k[1], width, width),
          tg::zeros<float, D>({width}), glorot(k[2], width, 1),    tg::zeros<float, D>({1})};
}

/// u at points xy (n, 2) -> (n,): x (1 - x) y (1 - y) N(x, y), zero on the boundary by construction.
template <class D>
Tensor<D> u(const Mlp<D>& p, const Tensor<D>& xy) {
  auto h = tg::tanh(tg::linear(xy, p.w1, p.b1));
  h = tg::tanh(tg::linear(h, p.w2, p.b2));
  const auto n = tg::linear(h, p.w3, p.b3).reshape({-1});
  const auto x = tg::index_in_dim(xy, 0, 1), y = tg::index_in_dim(xy, 1, 1);
  return x * (1.0f - x) * y * (1.0f - y) * n;
}

/// The source term f(x, y) = 2 pi^2 sin(pi x) sin(pi y), and the exact solution sin(pi x) sin(pi y).
inline double source(double x, double y) { return 2 * std::numbers::pi * std::numbers::pi * std::sin(std::numbers::pi * x) * std::sin(std::numbers::pi * y); }
inline double exact(double x, double y) { return std::sin(std::numbers::pi * x) * std::sin(std::numbers::pi * y); }

/// The Laplacian of u at each row of xy: u's gradient in its inputs (tg::grad of sum(u): the rows are
/// independent), then its derivative along each coordinate by tg::jvp, d2u/dx2 + d2u/dy2. e0 and e1 are
/// (n, 2) tensors with ones in column 0 and 1.
template <class D>
Tensor<D> laplacian(const Mlp<D>& p, const Tensor<D>& xy, const Tensor<D>& e0, const Tensor<D>& e1) {
  auto grad_u = [&](const Tensor<D>& points) { return tg::grad([&](const Tensor<D>& q) { return tg::sum(u(p, q)); })(points); };
  const auto h0 = tg::jvp(grad_u, xy, e0).second;  // row i: the Hessian's column 0 at point i
  const auto h1 = tg::jvp(grad_u, xy, e1).second;
  return tg::index_in_dim(h0, 0, 1) + tg::index_in_dim(h1, 1, 1);
}

/// The mean squared residual of -lap(u) = f at the collocation points.
template <class D>
Tensor<D> loss(const Mlp<D>& p, const Tensor<D>& xy, const Tensor<D>& f, const Tensor<D>& e0, const Tensor<D>& e1) {
  return tg::mean(tg::square(laplacian(p, xy, e0, e1) + f));
}

/// The collocation points: the n x n grid of cell centres ((i + 1/2) / n, (j + 1/2) / n), row-major in
/// (x, y), with f there and the two unit directions.
template <class D>
struct Collocation {
  Tensor<D> xy, f, e0, e1;
};
TG_PYTREE(Collocation, xy, f, e0, e1)

template <class D>
Collocation<D> collocation(std::int64_t n) {
  std::vector<float> xy, f, e0, e1;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      const float x = (static_cast<float>(i) + 0.5f) / static_cast<float>(n), y = (static_cast<float>(j) + 0.5f) / static_cast<float>(n);
      xy.insert(xy.end(), {x, y});
      f.push_back(static_cast<float>(source(x, y)));
      e0.insert(e0.end(), {1.0f, 0.0f});
      e1.insert(e1.end(), {0.0f, 1.0f});
    }
  const std::int64_t m = n * n;
  return {tg::from_vector<D>(xy, {m, 2}), tg::from_vector<D>(f, {m}), tg::from_vector<D>(e0, {m, 2}), tg::from_vector<D>(e1, {m, 2})};
}

/// The points of the k x k evaluation grid (i / (k - 1), j / (k - 1)), row-major in (x, y).
template <class D>
Tensor<D> grid(std::int64_t k) {
  std::vector<float> xy;
  for (std::int64_t i = 0; i < k; ++i)
    for (std::int64_t j = 0; j < k; ++j)
      xy.insert(xy.end(), {static_cast<float>(i) / static_cast<float>(k - 1), static_cast<float>(j) / static_cast<float>(k - 1)});
  return tg::from_vector<D>(xy, {k * k, 2});
}

/// Adam, its learning rate `lr` for `adam_steps`, then decaying exponentially to lr / 100 over `decay_steps`
/// (the second phase): optax.adam(optax.join_schedules([constant, exponential_decay], [adam_steps])).
inline auto make_optimizer(double lr, std::int64_t adam_steps, std::int64_t decay_steps) {
  return tg::optim::adam(tg::optim::join_schedules(tg::optim::constant_schedule(lr), adam_steps,
                                                   tg::optim::exponential_decay(lr, decay_steps, 0.01)));
}

/// One training step: the loss and its gradient in the parameters (third derivatives of N), Adam.
template <class D, class Optimizer, class State>
std::tuple<Mlp<D>, State, Tensor<D>> train_step(const Optimizer& optimizer, const Mlp<D>& params, const State& state, const Collocation<D>& c) {
  auto [value, grads] = tg::value_and_grad(loss<D>)(params, c.xy, c.f, c.e0, c.e1);
  auto [updates, next] = optimizer.update(grads, state, params);
  return {tg::optim::apply_updates(params, updates), next, value};
}

}  // namespace pinn
