// The fused multi-tensor AdamW: chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate) —
// adamw's atoms — in one pass over all leaves (one OpenMP loop on the CPU, one kernel launch per 32 leaves
// on CUDA), with the chain's own state and bit for bit its results. chain() runs it whenever its atoms are
// exactly these (optim/combine.hpp), so the code users write from Optax is the fast code.
#pragma once

#include <algorithm>
#include <any>
#include <atomic>
#include <memory>
#include <optional>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/optim/base.hpp"
#include "tapegrad/optim/transforms.hpp"

namespace tg::inline TG_ABI::optim {

namespace detail {
inline std::atomic<bool> fused_chains_enabled{true};
}  // namespace detail

/// Whether chain() runs adamw's atoms as one fused pass (default) or atom by atom. The two give the same
/// bits and the same state; a test compares them.
inline void set_fused_chains(bool on) { detail::fused_chains_enabled = on; }
inline bool fused_chains() { return detail::fused_chains_enabled; }

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
  T* applied[capacity] = {};  // params + update, what apply_updates will return
  bool decay[capacity] = {};
};

/// params + updates as the fused pass computed them, kept for apply_updates (optim/update.hpp) until it
/// asks for them: the update tensor (to recognise it), the parameter it was computed from, the result.
struct AppliedUpdate {
  std::weak_ptr<const void> update, param;
  std::any result;  // a Tensor<T, D>
};
inline thread_local std::vector<AppliedUpdate> applied_updates;

/// The kept params + updates for exactly this parameter and update tensor, removed from the list; or
/// nothing. Entries whose update tensor is gone are dropped on the way.
template <class L>
std::optional<L> take_applied(const L& param, const L& update) {
  std::optional<L> found;
  std::erase_if(applied_updates, [&](AppliedUpdate& e) {
    const auto u = e.update.lock();
    if (!u) return true;
    if (found || u.get() != update.storage().get() || e.param.lock().get() != param.storage().get()) return false;
    if (const L* r = std::any_cast<L>(&e.result); r && r->shape() == param.shape()) found = *r;
    return found.has_value();
  });
  return found;
}

/// One element of the fused AdamW: scale_by_adam (AdamMath), add_decayed_weights where `decay`
/// (u + wd p), then the learning rate, u * scale: scale is Scale's step size (-lr) or a schedule's step
/// (-lr(count)) — the chain's mul(u, -lr) and step * u, a product being the same either way round.
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

/// apply_updates of one element: p + u in the compute type, rounded to the parameter's dtype (tg::add's
/// arithmetic).
template <class T>
TG_HD T applied(T p, T u) {
  using C = compute_t<T>;
  return ::tg::detail::convert_to<T>(::tg::detail::convert_from<C>(p) + ::tg::detail::convert_from<C>(u));
}

/// The fused AdamW over a batch of leaves (the CUDA kernel's functor: one launch for all of them).
template <class T>
struct FusedAdamWFn {
  AdamWLeaves<T> leaves;
  const compute_t<T>* correction;  // {1 - b1^count, 1 - b2^count} for the incremented count
  const double* step;              // a schedule's -lr(count) on the device, or null: then `scale`
  double scale;                    // Scale's step size, -lr
  AdamMath<T> adam;
  double weight_decay;

  /// Element `flat` of the concatenated leaves.
  TG_HD void operator()(std::int64_t flat) const {
    using C = compute_t<T>;
    int lo = 0, hi = leaves.n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (leaves.offset[mid] <= flat) lo = mid;
      else hi = mid - 1;
    }
    const int k = lo;
    const std::int64_t i = flat - leaves.offset[k];
    const T p = leaves.p[k][i];
    const T u = adamw_element(adam, leaves.g[k][i], p, leaves.mu_in[k][i], leaves.nu_in[k][i], correction[0], correction[1],
                              leaves.decay[k] && weight_decay != 0.0, C(weight_decay), step ? C(step[0]) : C(scale),
                              leaves.mu_out[k][i], leaves.nu_out[k][i]);
    leaves.update[k][i] = u;
    leaves.applied[k][i] = applied(p, u);
  }
};

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
  T* __restrict out = l.applied[k];
  const AdamMath<T> adam = f.adam;
  const C c1 = f.correction[0], c2 = f.correction[1], wd = C(f.weight_decay);
  const C scale = f.step ? C(f.step[0]) : C(f.scale);
  const bool decay = l.decay[k] && f.weight_decay != 0.0;
#pragma omp for simd schedule(static) nowait
  for (std::int64_t i = 0; i < n; ++i) {
    const T u = adamw_element(adam, g[i], p[i], mu_in[i], nu_in[i], c1, c2, decay, wd, scale, mu_out[i], nu_out[i]);
    update[i] = u;
    out[i] = applied(p[i], u);
  }
}

/// The learning-rate atoms adamw ends with: Scale (a constant) or ScaleBySchedule.
template <class G> inline constexpr bool is_learning_rate = false;
template <> inline constexpr bool is_learning_rate<Scale> = true;
template <class S> inline constexpr bool is_learning_rate<ScaleBySchedule<S>> = true;

/// Whether a chain's atoms are adamw's: scale_by_adam, add_decayed_weights, then a learning rate.
template <class... G> inline constexpr bool adamw_atoms = false;
template <class Mask, class LR>
inline constexpr bool adamw_atoms<ScaleByAdam, AddDecayedWeights<Mask>, LR> = is_learning_rate<LR>;

/// chain(adam, decay, lr).update(updates, state, params) in one pass: the same state, the same bits. The
/// pass also computes params + updates, which apply_updates then returns without another pass.
template <class Mask, class LR, class Params, class State>
std::pair<Params, State> fused_adamw_update(const ScaleByAdam& adam, const AddDecayedWeights<Mask>& decay, const LR& lr,
                                            const Params& updates, const State& state, const Params& params) {
  using D = tree_device_t<Params>;
  const auto& adam_state = std::get<0>(state);
  State next = state;
  auto& adam_next = std::get<0>(next);
  adam_next.count = increment(adam_state.count);
  BiasCorrections<D> corrections(adam_next.count, adam.b1, adam.b2);
  Tensor<double, D> step;
  double scale = 0.0;
  if constexpr (std::is_same_v<LR, Scale>) {
    scale = lr.step_size;
  } else {
    step = eval_schedule(lr.schedule, std::get<2>(state).count, lr.sign);
    std::get<2>(next).count = increment(std::get<2>(state).count);
  }
  bool given = true;  // as add_decayed_weights checks, whatever the decay
  tree_for_each([&](const std::string&, const auto& p) { given = given && p.defined(); }, params);
  TG_CHECK(given, "add_decayed_weights", "needs the parameters: pass them as update()'s third argument");
  const auto selected = mask_predicate(decay.mask);
  Params out = updates;
  // Leaves grouped by dtype, 32 per launch.
  auto run = [&]<class T>(AdamWLeaves<T>& batch) {
    if (batch.n == 0) return;
    const FusedAdamWFn<T> fn{batch, corrections.template get<compute_t<T>>(), step.defined() ? step.data() : nullptr, scale,
                             {adam.b1, adam.b2, adam.eps, adam.eps_root}, decay.weight_decay};
    if constexpr (std::is_same_v<D, Cpu>) {
      // One parallel region over all leaves, each leaf's elements split among the threads: contiguous,
      // vectorisable loops and no per-leaf thread start-up.
      ::tg::detail::cpu_kernel([fn] {
#pragma omp parallel
        for (int k = 0; k < fn.leaves.n; ++k) fused_adamw_cpu_leaf(fn, k);
      });
    } else {
      ::tg::detail::index_map<D>(batch.offset[batch.n], fn);
    }
    batch = AdamWLeaves<T>{};
  };
  std::tuple<AdamWLeaves<float>, AdamWLeaves<double>, AdamWLeaves<bf16>> batches;
  tree_for_each([&](const std::string& path, auto& o, auto& mu, auto& nu, const auto& g, const auto& p, const auto& mu0, const auto& nu0) {
    using L = std::remove_cvref_t<decltype(o)>;
    using T = typename L::value_type;
    if constexpr (FloatElement<T>) {
      auto& batch = std::get<AdamWLeaves<T>>(batches);
      L u(g.shape()), m(g.shape()), v(g.shape()), applied(g.shape());
      const int k = batch.n++;
      batch.g[k] = g.data(), batch.p[k] = p.data(), batch.mu_in[k] = mu0.data(), batch.nu_in[k] = nu0.data();
      batch.mu_out[k] = m.data(), batch.nu_out[k] = v.data(), batch.update[k] = u.data(), batch.applied[k] = applied.data();
      take_applied(p, u);  // drops entries of updates that are gone
      applied_updates.push_back({u.storage(), p.storage(), applied});
      batch.decay[k] = decay.weight_decay != 0.0 && selected(path);
      batch.offset[k + 1] = batch.offset[k] + g.size();
      o = u, mu = m, nu = v;
      if (batch.n == AdamWLeaves<T>::capacity) run(batch);
    }
  }, out, adam_next.mu, adam_next.nu, updates, params, adam_state.mu, adam_state.nu);
  std::apply([&](auto&... batch) { (run(batch), ...); }, batches);
  return {out, next};
}

}  // namespace detail
}  // namespace tg::optim
