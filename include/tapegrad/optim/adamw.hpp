// adamw: Optax's chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate) as a transformation of
// its own that runs the three atoms in one pass over all leaves (the multi-tensor launcher: one launch per
// 32 leaves of a dtype), with the chain's state and, bit for bit, the chain's results. The fast path is
// explicit and owned here: AdamW::atoms() is the chain it stands for, and a test compares the two.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/multi_tensor.hpp"
#include "tapegrad/optim/base.hpp"
#include "tapegrad/optim/combine.hpp"
#include "tapegrad/optim/transforms.hpp"

TG_BEGIN_NAMESPACE
namespace optim {

/// Hyperparameters of adamw beyond the learning rate, with Optax's defaults.
struct AdamWOptions {
  double b1 = 0.9, b2 = 0.999, eps = 1e-8, eps_root = 0.0;
  double weight_decay = 1e-4;
};

namespace detail {

/// One element of AdamW: scale_by_adam (AdamMath), add_decayed_weights where the leaf decays (u + wd p), then the
/// learning rate, u * scale: scale is Scale's step size (-lr) or a schedule's step (-lr(count)) — the
/// chain's mul(u, -lr) and step * u, a product being the same either way round.
template <bool Decay, class T>
TG_HD T adamw_element(const AdamMath<T>& adam, T g, T p, T mu_in, T nu_in, compute_t<T> c1, compute_t<T> c2, compute_t<T> wd,
                      compute_t<T> scale, T& mu, T& nu) {
  using C = compute_t<T>;
  using ::tg::detail::convert_from;
  using ::tg::detail::convert_to;
  T u = convert_to<T>(adam(convert_from<C>(g), mu_in, nu_in, c1, c2, mu, nu));
  if constexpr (Decay) u = convert_to<T>(convert_from<C>(u) + wd * convert_from<C>(p));
  return convert_to<T>(convert_from<C>(u) * scale);
}

/// The learning rate inside the pass: Scale's constant step size (-lr), or a schedule's value at its count
/// before the update (ScheduleAt, as scale_by_schedule evaluates it), as a double.
struct ConstantStep {
  double step_size;
  TG_HD double operator()(std::int64_t) const { return step_size; }
};

/// The pass's learning-rate step for adamw's last atom.
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

/// The tensors of one launch: gradient, parameter, first and second moment in; the moments and the update
/// out. A tensor's flag says whether its leaf decays.
template <class T>
using AdamWLists = ::tg::detail::TensorLists<T, 7>;

/// AdamW over a chunk of one leaf (the multi-tensor launcher's functor), with the counts, the bias
/// corrections and the learning rate computed inside it rather than by kernels of their own.
template <class T, class Step>
struct AdamWFn {
  const std::int32_t* count_in;     // Adam's count before the update
  std::int32_t* count_out;          // its next value, written by chunk 0 of the first launch (else null)
  const std::int32_t* lr_count_in;  // a schedule's count (null for a constant learning rate)
  std::int32_t* lr_count_out;
  Step step;
  AdamMath<T> adam;
  double b1, b2, weight_decay;

  TG_HD void operator()(const AdamWLists<T>& l, const ::tg::detail::Chunk& c) const {
    using C = compute_t<T>;
    const AdamWScalars<T, Step> sc = AdamWScalars<T, Step>::at(count_in[0], lr_count_in ? lr_count_in[0] : 0, b1, b2, step);
    const int k = c.tensor;
    auto run = [&]<bool Decay>(std::integral_constant<bool, Decay>) {
      range<Decay>(adam, sc.c1, sc.c2, C(weight_decay), sc.scale, c.begin, c.end, l.ptr[0][k], l.ptr[1][k], l.ptr[2][k], l.ptr[3][k],
                   l.ptr[4][k], l.ptr[5][k], l.ptr[6][k]);
    };
    if (l.flag[k] && weight_decay != 0.0) run(std::true_type{});
    else run(std::false_type{});
    if (c.index == 0) {
      if (count_out) count_out[0] = SafeIncrement{}(count_in[0]);
      if (lr_count_out) lr_count_out[0] = SafeIncrement{}(lr_count_in[0]);
    }
  }

  /// Elements [begin, end) of one leaf: a loop without a branch (one instance per decay case), over
  /// restrict pointers, which the compiler vectorises on the CPU.
  template <bool Decay>
  TG_HOST_NOINLINE TG_HD static void range(const AdamMath<T> adam, compute_t<T> c1, compute_t<T> c2, compute_t<T> wd, compute_t<T> scale, std::int64_t begin,
                          std::int64_t end, const T* __restrict g, const T* __restrict p, const T* __restrict mu_in, const T* __restrict nu_in,
                          T* __restrict mu_out, T* __restrict nu_out, T* __restrict update) {
    for (std::int64_t i = begin; i < end; ++i)
      update[i] = adamw_element<Decay>(adam, g[i], p[i], mu_in[i], nu_in[i], c1, c2, wd, scale, mu_out[i], nu_out[i]);
  }
};

}  // namespace detail

/// AdamW: chain(scale_by_adam(...), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr))
/// run as one pass. Its state is that chain's (a tuple of the three atoms' states), so checkpoints and
/// tree maps see Optax's structure. LR is Scale (a constant learning rate) or ScaleBySchedule.
template <class Mask, class LR>
struct AdamW {
  ScaleByAdam adam;
  AddDecayedWeights<Mask> decay;
  LR lr;

  /// The chain of atoms this transformation runs in one pass (the same state, the same bits).
  Chain<ScaleByAdam, AddDecayedWeights<Mask>, LR> atoms() const { return chain(adam, decay, lr); }

  template <class Params>
  auto init(const Params& params) const {
    return atoms().init(params);
  }

  template <class Params, class State>
  std::pair<Params, State> update(const Params& updates, const State& state, const Params& params) const {
    using D = tree_device_t<Params>;
    if (tree_batch_levels(updates, state, params)) return atoms().update(updates, state, params);  // under tg::vmap: the chain, whose ops batch
    const auto& adam_state = std::get<0>(state);
    State next = state;
    auto& adam_next = std::get<0>(next);
    // The counts after the update are written by the pass itself (the first launch's chunk 0).
    adam_next.count = Tensor<std::int32_t, D>(Shape{});
    const std::int32_t* lr_count_in = nullptr;
    std::int32_t* lr_count_out = nullptr;
    using Step = typename detail::StepOf<LR>::type;
    const Step step = detail::StepOf<LR>::make(lr);
    if constexpr (!std::is_same_v<LR, Scale>) {
      std::get<2>(next).count = Tensor<std::int32_t, D>(Shape{});
      lr_count_in = std::get<2>(state).count.data();
      lr_count_out = std::get<2>(next).count.data();
    }
    detail::require_params(params);  // as add_decayed_weights checks, whatever the decay
    const auto selected = detail::mask_predicate(decay.mask);
    bool counts_written = false;
    auto run = [&]<class T>(detail::AdamWLists<T>& lists) {
      if (lists.empty()) return;
      const bool first = !counts_written;
      counts_written = true;
      ::tg::detail::multi_tensor_map<D>(lists, detail::AdamWFn<T, Step>{adam_state.count.data(), first ? adam_next.count.data() : nullptr,
                                                                         lr_count_in, first ? lr_count_out : nullptr, step,
                                                                         {adam.b1, adam.b2, adam.eps, adam.eps_root}, adam.b1, adam.b2,
                                                                         decay.weight_decay});
      lists = {};
    };
    // Leaves grouped by dtype, 32 per launch.
    std::tuple<detail::AdamWLists<float>, detail::AdamWLists<double>, detail::AdamWLists<bf16>> lists;
    Params out = updates;
    tree_for_each([&](const std::string& path, auto& o, auto& mu, auto& nu, const auto& g, const auto& p, const auto& mu0, const auto& nu0) {
      using L = std::remove_cvref_t<decltype(o)>;
      using T = typename L::value_type;
      if constexpr (FloatElement<T>) {
        L u(g.shape()), m(g.shape()), v(g.shape());
        auto& group = std::get<detail::AdamWLists<T>>(lists);
        if (group.add({g.data(), p.data(), mu0.data(), nu0.data(), m.data(), v.data(), u.data()}, g.size(),
                      decay.weight_decay != 0.0 && selected(path)))
          run(group);
        o = u, mu = m, nu = v;
      }
    }, out, adam_next.mu, adam_next.nu, updates, params, adam_state.mu, adam_state.nu);
    std::apply([&](auto&... group) { (run(group), ...); }, lists);
    if (!counts_written) {  // no floating leaf: only the counts move
      adam_next.count = detail::increment(adam_state.count);
      if constexpr (!std::is_same_v<LR, Scale>) std::get<2>(next).count = detail::increment(std::get<2>(state).count);
    }
    return {out, next};
  }
};

/// adamw(lr, options, mask): Optax's adamw, chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate),
/// run as one pass (AdamW). As in Optax, the decay is applied before the learning rate, so the effective
/// decay per step is lr * weight_decay (the paper decouples it from lr; Optax's docstring notes the same
/// difference). lr: a number or a schedule. mask: a predicate on the leaf path (e.g. no decay on biases)
/// or a bool pytree; default every leaf.
template <class LR, class Mask = AllLeaves>
auto adamw(LR learning_rate, AdamWOptions o = {}, Mask mask = {}) {
  auto lr = scale_by_learning_rate(learning_rate);
  return AdamW<Mask, decltype(lr)>{scale_by_adam(o.b1, o.b2, o.eps, o.eps_root, "adamw"), add_decayed_weights(o.weight_decay, std::move(mask)),
                                   lr};
}

/// adamw with Optax's positional order: (lr, b1, b2, eps, weight_decay, mask).
template <class LR, class Mask = AllLeaves>
auto adamw(LR learning_rate, double b1, double b2 = 0.999, double eps = 1e-8, double weight_decay = 1e-4, Mask mask = {}) {
  return adamw(learning_rate, AdamWOptions{b1, b2, eps, 0.0, weight_decay}, std::move(mask));
}

/// adamw under the name of its fast path in tapegrad 0.1 (the same transformation), kept for code that names it.
template <class LR, class Mask = AllLeaves>
auto fused_adamw(LR learning_rate, AdamWOptions o = {}, Mask mask = {}) {
  return adamw(learning_rate, o, std::move(mask));
}

}  // namespace optim
TG_END_NAMESPACE
