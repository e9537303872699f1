// apply_updates, and the fused multi-tensor AdamW: the chained adamw's arithmetic in one pass over all
// leaves (one OpenMP loop on the CPU, one kernel launch per 32 leaves on CUDA), with the same state.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/optim/alias.hpp"

namespace tg::inline TG_ABI::optim {

/// params + updates, leaf by leaf, in the parameters' dtype (optax.apply_updates).
template <class Params>
Params apply_updates(const Params& params, const Params& updates) {
  return tree_map([](const auto& p, const auto& u) {
    using L = std::remove_cvref_t<decltype(p)>;
    using T = typename L::value_type;
    if constexpr (FloatElement<T>) {
      TG_CHECK(p.shape() == u.shape(), "apply_updates", "update of shape ", u.shape().str(), " for a parameter of shape ", p.shape().str());
      return add(p, u);  // in the compute type, rounded to the parameter's dtype
    } else {
      return p;
    }
  }, params, updates);
}

namespace detail {

/// Up to 32 leaves of one dtype, passed to the kernel by value (no host-to-device copy, so the launch can
/// be captured in a CUDA Graph); a flat index finds its leaf by binary search over the offsets.
template <class T>
struct AdamWLeaves {
  static constexpr int capacity = 32;
  int n = 0;
  std::int64_t offset[capacity + 1] = {};
  const T* g[capacity] = {};
  const T* p[capacity] = {};
  const T* mu_in[capacity] = {};
  const T* nu_in[capacity] = {};
  T* mu_out[capacity] = {};
  T* nu_out[capacity] = {};
  T* update[capacity] = {};
  bool decay[capacity] = {};
};

template <class T>
TG_HD T adamw_element(const AdamMath<T>& adam, T g, T p, T mu_in, T nu_in, compute_t<T> c1, compute_t<T> c2, bool decay,
                      compute_t<T> wd, compute_t<T> scale, T& mu, T& nu);

/// The fused AdamW over a batch of leaves: exactly the chained form's operations, in its order and
/// roundings (Adam's arithmetic is AdamMath, which scale_by_adam runs too).
template <class T>
struct FusedAdamWFn {
  AdamWLeaves<T> leaves;
  const compute_t<T>* correction;  // {1 - b1^count, 1 - b2^count}
  const double* step;              // -lr(count) when a schedule, else unused
  bool scheduled;
  AdamMath<T> adam;
  double lr, weight_decay;
  /// Element `flat` of the concatenated leaves (the CUDA kernel's view: one launch for all).
  TG_HD void operator()(std::int64_t flat) const {
    int lo = 0, hi = leaves.n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (leaves.offset[mid] <= flat) lo = mid;
      else hi = mid - 1;
    }
    const int k = lo;
    const std::int64_t i = flat - leaves.offset[k];
    using C = compute_t<T>;
    leaves.update[k][i] = adamw_element(adam, leaves.g[k][i], leaves.p[k][i], leaves.mu_in[k][i], leaves.nu_in[k][i], correction[0],
                                        correction[1], leaves.decay[k] && weight_decay != 0.0, C(weight_decay),
                                        scheduled ? C(step[0]) : C(-lr), leaves.mu_out[k][i], leaves.nu_out[k][i]);
  }
};

/// One element of the fused AdamW: scale_by_adam (AdamMath), add_decayed_weights where `decay`
/// (u + wd p), then scale_by_learning_rate, u * scale with scale = -lr, or step = -lr(count) for a
/// schedule (the chained form's mul(u, -lr) and step * u: a product is the same either way round).
template <class T>
TG_HD T adamw_element(const AdamMath<T>& adam, T g, T p, T mu_in, T nu_in, compute_t<T> c1, compute_t<T> c2, bool decay,
                      compute_t<T> wd, compute_t<T> scale, T& mu, T& nu) {
  using C = compute_t<T>;
  using ::tg::detail::convert_from;
  using ::tg::detail::convert_to;
  T u = convert_to<T>(adam(convert_from<C>(g), mu_in, nu_in, c1, c2, mu, nu));
  if (decay) u = convert_to<T>(convert_from<C>(u) + wd * convert_from<C>(p));
  return convert_to<T>(convert_from<C>(u) * scale);
}

/// Elements [0, n) of leaf k split among the threads of the enclosing parallel region: adamw_element as
/// a loop over restrict pointers and local constants, which the compiler vectorises (CPU).
template <class T>
void fused_adamw_cpu_leaf(const FusedAdamWFn<T>& f, int k) {
  using C = compute_t<T>;
  const AdamWLeaves<T>& l = f.leaves;
  const std::int64_t n = l.offset[k + 1] - l.offset[k];
  const T* __restrict g = l.g[k];
  const T* __restrict p = l.p[k];
  const T* __restrict mu_in = l.mu_in[k];
  const T* __restrict nu_in = l.nu_in[k];
  T* __restrict mu_out = l.mu_out[k];
  T* __restrict nu_out = l.nu_out[k];
  T* __restrict update = l.update[k];
  const AdamMath<T> adam = f.adam;
  const C c1 = f.correction[0], c2 = f.correction[1], wd = C(f.weight_decay);
  const C scale = f.scheduled ? C(f.step[0]) : C(-f.lr);
  const bool decay = l.decay[k] && f.weight_decay != 0.0;
#pragma omp for simd schedule(static) nowait
  for (std::int64_t i = 0; i < n; ++i)
    update[i] = adamw_element(adam, g[i], p[i], mu_in[i], nu_in[i], c1, c2, decay, wd, scale, mu_out[i], nu_out[i]);
}

template <class LR>
struct LearningRate {
  using type = decltype(scale_by_learning_rate(std::declval<LR>()));
};

}  // namespace detail

/// adamw as one fused pass over all leaves. Same hyperparameters, same state type (so the two are
/// interchangeable mid-training) and the same arithmetic as the chained adamw: equal bit for bit on the CPU.
template <class LR, class Mask = AllLeaves>
struct FusedAdamW {
  using Chained = decltype(adamw(std::declval<LR>(), AdamWOptions{}, std::declval<Mask>()));
  Chained chained;  // holds the validated hyperparameters and the mask
  LR learning_rate;
  AdamWOptions options;
  Mask mask;

  template <class Params>
  auto init(const Params& params) const {
    return chained.init(params);
  }

  template <class Params, class State>
  std::pair<Params, State> update(const Params& updates, const State& state, const Params& params) const {
    using D = tree_device_t<Params>;
    const auto& adam_state = std::get<0>(state);
    State next = state;
    auto& adam_next = std::get<0>(next);
    adam_next.count = detail::increment(adam_state.count);
    detail::BiasCorrections<D> corrections(adam_next.count, options.b1, options.b2);
    Tensor<double, D> step;
    if constexpr (Schedule<LR>) {
      auto& sched = std::get<2>(next);
      step = detail::eval_schedule(learning_rate, std::get<2>(state).count, -1.0);
      sched.count = detail::increment(std::get<2>(state).count);
    }
    const auto selected = detail::mask_predicate(mask);
    Params out = updates;
    // Leaves grouped by dtype, 32 per launch.
    auto run = [&]<class T>(detail::AdamWLeaves<T>& batch) {
      if (batch.n == 0) return;
      double lr = 0.0;
      if constexpr (!Schedule<LR>) lr = learning_rate;
      const compute_t<T>* correction = corrections.template get<compute_t<T>>();
      const detail::FusedAdamWFn<T> fn{batch, correction, step.defined() ? step.data() : nullptr, Schedule<LR>,
                                       {options.b1, options.b2, options.eps, options.eps_root}, lr, options.weight_decay};
      if constexpr (std::is_same_v<D, Cpu>) {
        // One parallel region over all leaves, each leaf's elements split among the threads: contiguous,
        // vectorisable loops and no per-leaf thread start-up.
        ::tg::detail::cpu_kernel([fn] {
#pragma omp parallel
          for (int k = 0; k < fn.leaves.n; ++k) detail::fused_adamw_cpu_leaf(fn, k);
        });
      } else {
        ::tg::detail::index_map<D>(batch.offset[batch.n], fn);
      }
      batch = detail::AdamWLeaves<T>{};
    };
    std::tuple<detail::AdamWLeaves<float>, detail::AdamWLeaves<double>, detail::AdamWLeaves<bf16>> batches;
    tree_for_each([&](const std::string& path, auto& o, auto& mu, auto& nu, const auto& g, const auto& p, const auto& mu0, const auto& nu0) {
      using L = std::remove_cvref_t<decltype(o)>;
      using T = typename L::value_type;
      if constexpr (FloatElement<T>) {
        auto& batch = std::get<detail::AdamWLeaves<T>>(batches);
        L u(g.shape()), m(g.shape()), v(g.shape());
        const int k = batch.n++;
        batch.g[k] = g.data(), batch.p[k] = p.data(), batch.mu_in[k] = mu0.data(), batch.nu_in[k] = nu0.data();
        batch.mu_out[k] = m.data(), batch.nu_out[k] = v.data(), batch.update[k] = u.data();
        batch.decay[k] = selected(path);
        batch.offset[k + 1] = batch.offset[k] + g.size();
        o = u, mu = m, nu = v;
        if (batch.n == detail::AdamWLeaves<T>::capacity) run(batch);
      }
    }, out, adam_next.mu, adam_next.nu, updates, params, adam_state.mu, adam_state.nu);
    std::apply([&](auto&... batch) { (run(batch), ...); }, batches);
    return {out, next};
  }
};

/// The fused fast path of adamw(lr, options, mask); interchangeable with it (same state).
template <class LR, class Mask = AllLeaves>
FusedAdamW<LR, Mask> fused_adamw(LR learning_rate, AdamWOptions o = {}, Mask mask = {}) {
  auto chained = adamw(learning_rate, o, mask);
  return {std::move(chained), learning_rate, o, std::move(mask)};
}

}  // namespace tg::optim
