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

/// The learning rate inside the fused pass: Scale's constant step size (-lr), or a schedule's value at
/// its count before the update (ScheduleAt, as scale_by_schedule evaluates it), as a double.
struct ConstantStep {
  double step_size;
  TG_HD double operator()(std::int64_t) const { return step_size; }
};

/// The fused pass's learning-rate step for adamw's last atom.
template <class LR> struct StepOf;
template <> struct StepOf<Scale> {
  using type = ConstantStep;
  static type make(const Scale& lr) { return {lr.step_size}; }
};
template <class S> struct StepOf<ScaleBySchedule<S>> {
  using type = ScheduleAt<S>;
  static type make(const ScaleBySchedule<S>& lr) { return {lr.schedule, lr.sign}; }
};

/// The step's bookkeeping, computed where it is used: the counts after the update (optax's
/// safe_int32_increment), Adam's bias corrections with the incremented count, the learning-rate step.
template <class T, class Step>
struct AdamWScalars {
  compute_t<T> c1, c2, scale;

  TG_HD static AdamWScalars at(std::int32_t count, std::int32_t lr_count, double b1, double b2, const Step& step) {
    using C = compute_t<T>;
    const std::int32_t next = SafeIncrement{}(count);
    // As scale_by_adam and scale_by_schedule compute them.
    return {bias_correction<C>(b1, next), bias_correction<C>(b2, next), C(step(static_cast<std::int64_t>(lr_count)))};
  }
};

/// The fused AdamW over a batch of leaves (the CUDA kernel's functor: one launch for all of them, with the
/// counts, the bias corrections and the learning rate computed inside it rather than by kernels of their own).
template <class T, class Step>
struct FusedAdamWFn {
  AdamWLeaves<T> leaves;
  const std::int32_t* count_in;     // Adam's count before the update
  std::int32_t* count_out;          // its next value, written by element 0 of the first launch (else null)
  const std::int32_t* lr_count_in;  // a schedule's count (null for a constant learning rate)
  std::int32_t* lr_count_out;
  Step step;
  AdamMath<T> adam;
  double b1, b2, weight_decay;

  TG_HD AdamWScalars<T, Step> scalars() const {
    return AdamWScalars<T, Step>::at(count_in[0], lr_count_in ? lr_count_in[0] : 0, b1, b2, step);
  }
  TG_HD void write_counts() const {
    if (count_out) count_out[0] = SafeIncrement{}(count_in[0]);
    if (lr_count_out) lr_count_out[0] = SafeIncrement{}(lr_count_in[0]);
  }

  /// Element `flat` of the concatenated leaves.
  TG_HD void operator()(std::int64_t flat) const {
    using C = compute_t<T>;
    const int k = leaf_of(leaves.offset, leaves.n, flat);
    const std::int64_t i = flat - leaves.offset[k];
    const AdamWScalars<T, Step> sc = scalars();
    const T p = leaves.p[k][i];
    const T u = adamw_element(adam, leaves.g[k][i], p, leaves.mu_in[k][i], leaves.nu_in[k][i], sc.c1, sc.c2,
                              leaves.decay[k] && weight_decay != 0.0, C(weight_decay), sc.scale, leaves.mu_out[k][i], leaves.nu_out[k][i]);
    leaves.update[k][i] = u;
    leaves.applied[k][i] = applied(p, u);
    if (flat == 0) write_counts();
  }
};

/// Elements [0, n) of leaf k split among the threads of the enclosing parallel region: adamw_element as
/// a loop over restrict pointers and local constants, which the compiler vectorises (CPU).
template <class T, class Step>
void fused_adamw_cpu_leaf(const FusedAdamWFn<T, Step>& f, const AdamWScalars<T, Step>& sc, int k) {
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
  const C c1 = sc.c1, c2 = sc.c2, wd = C(f.weight_decay), scale = sc.scale;
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
  // The counts after the update are written by the pass itself (the first launch's element 0).
  adam_next.count = Tensor<std::int32_t, D>(Shape{});
  const std::int32_t* lr_count_in = nullptr;
  std::int32_t* lr_count_out = nullptr;
  using Step = typename StepOf<LR>::type;
  const Step step_fn = StepOf<LR>::make(lr);
  if constexpr (!std::is_same_v<LR, Scale>) {
    std::get<2>(next).count = Tensor<std::int32_t, D>(Shape{});
    lr_count_in = std::get<2>(state).count.data();
    lr_count_out = std::get<2>(next).count.data();
  }
  bool counts_written = false;
  require_params(params);  // as add_decayed_weights checks, whatever the decay
  const auto selected = mask_predicate(decay.mask);
  Params out = updates;
  // Leaves grouped by dtype, 32 per launch.
  auto run = [&]<class T>(AdamWLeaves<T>& batch) {
    if (batch.n == 0) return;
    const bool first = !counts_written;
    counts_written = true;
    const FusedAdamWFn<T, Step> fn{batch, adam_state.count.data(), first ? adam_next.count.data() : nullptr, lr_count_in,
                                   first ? lr_count_out : nullptr, step_fn, {adam.b1, adam.b2, adam.eps, adam.eps_root},
                                   adam.b1, adam.b2, decay.weight_decay};
    if constexpr (std::is_same_v<D, Cpu>) {
      // One parallel region over all leaves, each leaf's elements split among the threads: contiguous,
      // vectorisable loops and no per-leaf thread start-up. The scalars once, the counts last.
      ::tg::detail::cpu_kernel([fn] {
        const AdamWScalars<T, Step> sc = fn.scalars();
#pragma omp parallel
        for (int k = 0; k < fn.leaves.n; ++k) fused_adamw_cpu_leaf(fn, sc, k);
        fn.write_counts();
      });
    } else {
      ::tg::detail::index_map<D>(batch.offset[batch.n], fn);
    }
    batch = AdamWLeaves<T>{};
  };
  std::erase_if(applied_updates, [](const AppliedUpdate& e) { return e.update.expired(); });  // updates that are gone
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
      applied_updates.push_back({u.storage(), p.storage(), applied});
      batch.decay[k] = decay.weight_decay != 0.0 && selected(path);
      batch.offset[k + 1] = batch.offset[k] + g.size();
      o = u, mu = m, nu = v;
      if (batch.n == AdamWLeaves<T>::capacity) run(batch);
    }
  }, out, adam_next.mu, adam_next.nu, updates, params, adam_state.mu, adam_state.nu);
  std::apply([&](auto&... batch) { (run(batch), ...); }, batches);
  if (!counts_written) {  // no floating leaf: only the counts move
    adam_next.count = increment(adam_state.count);
    if constexpr (!std::is_same_v<LR, Scale>) std::get<2>(next).count = increment(std::get<2>(state).count);
  }
  return {out, next};
}

}  // namespace detail
}  // namespace tg::optim
