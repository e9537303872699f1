// The atoms, with Optax's names and numerics: identity, scale, scale_by_adam, add_decayed_weights,
// scale_by_learning_rate, scale_by_schedule, trace, clip, clip_by_global_norm. Each runs on the
// parameters' device; counts, schedules and norms stay there (no host round trip inside update).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/multi_tensor.hpp"
#include "tapegrad/optim/base.hpp"
#include "tapegrad/optim/schedule.hpp"
#include "tapegrad/tree/global_norm.hpp"

TG_BEGIN_NAMESPACE
namespace optim {

// ---- states (pytrees, so they checkpoint and tree_map like parameters) ----

/// State of scale_by_adam: the step count and the first and second moments.
template <class Params>
struct ScaleByAdamState {
  Count<Params> count;
  Params mu, nu;
};
TG_PYTREE(ScaleByAdamState, count, mu, nu)

/// State of trace: the momentum buffer.
template <class Params>
struct TraceState {
  Params trace;
};
TG_PYTREE(TraceState, trace)

/// State of scale_by_schedule (and scale_by_learning_rate with a schedule): the step count.
template <class Params>
struct ScaleByScheduleState {
  Count<Params> count;
};
TG_PYTREE(ScaleByScheduleState, count)

namespace detail {

/// Applies f to the floating leaves of a tree (others pass through), returning a tree of the same type.
template <class F, class Tree, class... Rest>
Tree map_float_leaves(F&& f, const Tree& tree, const Rest&... rest) {
  return tree_map([&](const auto& leaf, const auto&... others) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (FloatElement<typename L::value_type>) return L(f(leaf, others...));
    else return leaf;
  }, tree, rest...);
}

/// f(leaf) computed in the leaf's compute type and rounded to its dtype once, as a fused kernel would
/// (bf16 leaves go through f32; for f32 and f64 leaves the casts share storage and cost nothing).
template <class F, class L>
L in_compute_type(F&& f, const L& leaf) {
  using T = typename L::value_type;
  return cast<T>(f(cast<compute_t<T>>(leaf)));
}

/// Adam's arithmetic for one element, in Optax's order and roundings: the moments are updated in the
/// compute type C and rounded to the moments' dtype T, then bias-corrected with the incremented count's
/// corrections c1 = 1 - b1^count, c2 = 1 - b2^count, and the update m_hat / (sqrt(v_hat + eps_root) + eps)
/// is returned in C. scale_by_adam's kernel and adamw's pass (optim/adamw.hpp) both run this.
template <class T>
struct AdamMath {
  using C = compute_t<T>;
  C one_minus_b1, b1, one_minus_b2, b2, eps, eps_root;

  AdamMath(double b1_, double b2_, double eps_, double eps_root_)
      : one_minus_b1(C(1.0 - b1_)), b1(C(b1_)), one_minus_b2(C(1.0 - b2_)), b2(C(b2_)), eps(C(eps_)), eps_root(C(eps_root_)) {}

  TG_HD C operator()(C g, T mu_in, T nu_in, C c1, C c2, T& mu, T& nu) const {
    using ::tg::detail::convert_from;
    using ::tg::detail::convert_to;
    // optax.tree.update_moment: (1 - decay) g^order + decay t, in the moment's dtype.
    mu = convert_to<T>(one_minus_b1 * g + b1 * convert_from<C>(mu_in));
    nu = convert_to<T>(one_minus_b2 * (g * g) + b2 * convert_from<C>(nu_in));
    const C m_hat = convert_from<C>(mu) / c1;
    const C v_hat = convert_from<C>(nu) / c2;
    // eps outside the square root, eps_root inside (Optax's defaults: 1e-8 and 0).
    return m_hat / (math::sqrt(v_hat + eps_root) + eps);
  }
};

/// Adam's bias correction 1 - decay^count for the incremented count, in the compute type C (as Optax
/// computes decay**count in the moments' dtype).
template <class C>
TG_HD C bias_correction(double decay, std::int32_t count) {
  return C(1) - math::pow(C(decay), C(count));
}

/// Both bias corrections, computed once per update on the device.
template <class C>
struct BiasCorrectionFn {
  const std::int32_t* count;  // already incremented
  double b1, b2;
  C* out;  // [2]
  TG_HD void operator()(std::int64_t) const {
    out[0] = bias_correction<C>(b1, count[0]);
    out[1] = bias_correction<C>(b2, count[0]);
  }
};

/// The bias corrections of one update, computed on the device the first time a leaf of each compute
/// type (float for f32/bf16, double for f64) asks for them.
template <Device D>
class BiasCorrections {
 public:
  BiasCorrections(const Tensor<std::int32_t, D>& count, double b1, double b2) : count_(count), b1_(b1), b2_(b2) {}

  template <class C>
  const C* get() {
    Tensor<C, D>& t = std::get<Tensor<C, D>>(values_);
    if (!t.defined()) {
      t = Tensor<C, D>(Shape{2});
      ::tg::detail::index_map<D>(1, BiasCorrectionFn<C>{count_.data(), b1_, b2_, t.data()});
    }
    return t.data();
  }

 private:
  Tensor<std::int32_t, D> count_;
  double b1_, b2_;
  std::tuple<Tensor<float, D>, Tensor<double, D>> values_;
};

/// Under tg::vmap, each example's bias corrections from its own count: out[2e], out[2e + 1].
template <class C>
struct BiasCorrectionPerExampleFn {
  const std::int32_t* count;
  double b1, b2;
  C* out;
  TG_HD void operator()(std::int64_t e) const { BiasCorrectionFn<C>{count + e, b1, b2, out + 2 * e}(0); }
};

/// scale_by_adam's kernel: one leaf's moments and update.
template <class T>
struct AdamFn {
  const T* g;
  const T* mu_in;
  const T* nu_in;
  const compute_t<T>* correction;  // {1 - b1^count, 1 - b2^count} for the incremented count
  T* mu_out;
  T* nu_out;
  T* update;
  AdamMath<T> adam;
  TG_HD void operator()(std::int64_t i) const {
    using C = compute_t<T>;
    const C u = adam(::tg::detail::convert_from<C>(g[i]), mu_in[i], nu_in[i], correction[0], correction[1], mu_out[i], nu_out[i]);
    update[i] = ::tg::detail::convert_to<T>(u);
  }
};

/// sign * schedule(count), as a double: the schedule evaluated on the device at the step count.
template <class S>
struct ScheduleAt {
  S schedule;
  double sign;
  template <class C> TG_HD double operator()(C count) const { return sign * schedule(static_cast<std::int64_t>(count)); }
};

template <class Params>
using device_of = tree_device_t<Params>;

/// Evaluates `schedule` (times sign) at the device-side count, into a 0-d double on the device.
template <class S, Device D>
Tensor<double, D> eval_schedule(const S& schedule, const Tensor<std::int32_t, D>& count, double sign) {
  return map<ScheduleAt<S>, double>(count, ScheduleAt<S>{schedule, sign}, "scale_by_schedule");
}

/// g * step for a 0-d double step on the device, in the leaf's compute type.
template <class Leaf>
Leaf scale_by_device_scalar(const Leaf& g, const Tensor<double, typename Leaf::device_type>& step) {
  return in_compute_type([&](const auto& gc) {
    using C = typename std::remove_cvref_t<decltype(gc)>::value_type;
    return mul(gc, cast<C>(step));
  }, g);
}

/// add_decayed_weights needs the parameters: every leaf defined, else an error saying so.
template <class Params>
void require_params(const Params& params) {
  bool given = true;
  tree_for_each([&](const std::string&, const auto& p) { given = given && p.defined(); }, params);
  TG_CHECK(given, "add_decayed_weights", "needs the parameters: pass them as update()'s third argument");
}

/// Which leaves a mask selects: a predicate on the leaf path, or a pytree with the parameters' field
/// names whose leaves are bool (true: apply).
template <class Mask>
std::function<bool(const std::string&)> mask_predicate(const Mask& mask) {
  if constexpr (std::is_invocable_r_v<bool, const Mask&, const std::string&>) {
    return mask;
  } else {
    std::set<std::string> on;
    tree_for_each([&](const std::string& path, const bool& apply) {
      if (apply) on.insert(path);
    }, mask);
    return [on](const std::string& path) { return on.count(path) > 0; };
  }
}

}  // namespace detail

/// Passes updates through.
struct Identity {
  template <class Params> EmptyState init(const Params&) const { return {}; }
  template <class Params>
  std::pair<Params, EmptyState> update(const Params& updates, const EmptyState&, const Params&) const {
    return {updates, {}};
  }
};
inline Identity identity() { return {}; }

/// updates * step_size.
struct Scale {
  double step_size = 1.0;
  template <class Params> EmptyState init(const Params&) const { return {}; }
  template <class Params>
  std::pair<Params, EmptyState> update(const Params& updates, const EmptyState&, const Params&) const {
    return {detail::map_float_leaves([&](const auto& g) { return mul(g, step_size); }, updates), {}};
  }
};
inline Scale scale(double step_size) {
  TG_CHECK(std::isfinite(step_size), "scale", "step_size must be finite, got ", step_size);
  return {step_size};
}

namespace detail {
/// AdamFn under tg::vmap: element i belongs to example i / per_example, whose corrections it reads.
template <class T>
struct AdamPerExampleFn {
  AdamFn<T> f;
  std::int64_t per_example;
  TG_HD void operator()(std::int64_t i) const {
    AdamFn<T> g = f;
    g.correction = f.correction + 2 * (i / per_example);
    g(i);
  }
};
}  // namespace detail

/// Adam's rescaling (Kingma & Ba): moments with decay b1, b2, bias-corrected with the incremented count;
/// updates m_hat / (sqrt(v_hat + eps_root) + eps).
struct ScaleByAdam {
  double b1 = 0.9, b2 = 0.999, eps = 1e-8, eps_root = 0.0;
  template <class Params>
  ScaleByAdamState<Params> init(const Params& params) const {
    return {detail::zero_count<detail::device_of<Params>>(), tree_zeros_like(params), tree_zeros_like(params)};
  }
  template <class Params>
  std::pair<Params, ScaleByAdamState<Params>> update(const Params& updates, const ScaleByAdamState<Params>& state,
                                                      const Params&) const {
    using D = tree_device_t<Params>;
    ScaleByAdamState<Params> next{detail::increment(state.count), state.mu, state.nu};
    if (const std::uint32_t levels = tree_batch_levels(next.count, updates, state.mu, state.nu)) return batched_update(updates, state, next, levels);
    detail::BiasCorrections<D> corrections(next.count, b1, b2);
    Params out = updates;
    tree_for_each([&](const std::string&, auto& o, auto& mu, auto& nu, const auto& g, const auto& mu0, const auto& nu0) {
      using L = std::remove_cvref_t<decltype(o)>;
      using T = typename L::value_type;
      if constexpr (FloatElement<T>) {
        const compute_t<T>* correction = corrections.template get<compute_t<T>>();
        L u(g.shape()), m(g.shape()), v(g.shape());
        ::tg::detail::index_map<typename L::device_type>(
            g.size(), detail::AdamFn<T>{g.data(), mu0.data(), nu0.data(), correction, m.data(), v.data(), u.data(), {b1, b2, eps, eps_root}});
        o = u, mu = m, nu = v;
      }
    }, out, next.mu, next.nu, updates, state.mu, state.nu);
    return {out, next};
  }

 private:
  /// The batching rule (tg::vmap: an ensemble's members, or per-example updates): every leaf and the
  /// count carry every batch axis; each example's moments and update in one kernel per leaf, with its
  /// own bias corrections, bit for bit what the update of that example alone gives.
  template <class Params>
  std::pair<Params, ScaleByAdamState<Params>> batched_update(const Params& updates, const ScaleByAdamState<Params>& state,
                                                              ScaleByAdamState<Params> next, std::uint32_t levels) const {
    using D = tree_device_t<Params>;
    const auto count = ::tg::detail::materialize(next.count, levels).physical();
    const std::int64_t examples = count.size();
    std::tuple<Tensor<float, D>, Tensor<double, D>> corrections;
    auto correction = [&]<class C>() {
      Tensor<C, D>& t = std::get<Tensor<C, D>>(corrections);
      if (!t.defined()) {
        t = Tensor<C, D>(Shape{examples, 2});
        ::tg::detail::index_map<D>(examples, detail::BiasCorrectionPerExampleFn<C>{count.data(), b1, b2, t.data()});
      }
      return t.data();
    };
    Params out = updates;
    tree_for_each([&](const std::string&, auto& o, auto& mu, auto& nu, const auto& g, const auto& mu0, const auto& nu0) {
      using L = std::remove_cvref_t<decltype(o)>;
      using T = typename L::value_type;
      if constexpr (FloatElement<T>) {
        const L gp = ::tg::detail::materialize(g, levels).physical();
        const L mp = ::tg::detail::materialize(mu0, levels).physical(), np = ::tg::detail::materialize(nu0, levels).physical();
        L u(gp.shape()), m(gp.shape()), v(gp.shape());
        const auto* c = correction.template operator()<compute_t<T>>();
        if (u.size() > 0)
          ::tg::detail::index_map<D>(u.size(), detail::AdamPerExampleFn<T>{detail::AdamFn<T>{gp.data(), mp.data(), np.data(), c, m.data(), v.data(),
                                                                                             u.data(), {b1, b2, eps, eps_root}},
                                                                           g.size()});
        o = L::batched(u, levels), mu = L::batched(m, levels), nu = L::batched(v, levels);
      }
    }, out, next.mu, next.nu, updates, state.mu, state.nu);
    return {out, next};
  }
};

/// scale_by_adam with its hyperparameters checked; `who` names the caller in errors.
inline ScaleByAdam scale_by_adam(double b1 = 0.9, double b2 = 0.999, double eps = 1e-8, double eps_root = 0.0,
                                 const char* who = "scale_by_adam") {
  TG_CHECK(b1 >= 0.0 && b1 < 1.0, who, "b1 must be in [0, 1), got ", b1);
  TG_CHECK(b2 >= 0.0 && b2 < 1.0, who, "b2 must be in [0, 1), got ", b2);
  TG_CHECK(eps >= 0.0 && std::isfinite(eps), who, "eps must be finite and >= 0, got ", eps);
  TG_CHECK(eps_root >= 0.0 && std::isfinite(eps_root), who, "eps_root must be finite and >= 0, got ", eps_root);
  TG_CHECK(eps > 0.0 || eps_root > 0.0, who, "eps and eps_root cannot both be 0: the update divides by sqrt(v_hat)");
  return {b1, b2, eps, eps_root};
}

/// A mask that selects every leaf.
struct AllLeaves {
  bool operator()(const std::string&) const { return true; }
};

/// updates + weight_decay * params, on the leaves the mask selects (Optax: decoupled weight decay;
/// in adamw it is scaled by the learning rate afterwards, unlike the AdamW paper's wd * lr schedule).
template <class Mask = AllLeaves>
struct AddDecayedWeights {
  double weight_decay = 0.0;
  Mask mask{};
  template <class Params> EmptyState init(const Params&) const { return {}; }
  template <class Params>
  std::pair<Params, EmptyState> update(const Params& updates, const EmptyState&, const Params& params) const {
    detail::require_params(params);
    if (weight_decay == 0.0) return {updates, {}};  // optax skips a zero constant
    const auto selected = detail::mask_predicate(mask);
    Params out = updates;
    tree_for_each([&](const std::string& path, auto& o, const auto& p) {
      if constexpr (FloatElement<typename std::remove_cvref_t<decltype(o)>::value_type>) {
        if (selected(path)) o = map2(o, p, fn::AddScaled{weight_decay}, "add_decayed_weights");  // g + wd p
      }
    }, out, params);
    return {out, {}};
  }
};

template <class Mask = AllLeaves>
AddDecayedWeights<Mask> add_decayed_weights(double weight_decay, Mask mask = {}) {
  TG_CHECK(weight_decay >= 0.0 && std::isfinite(weight_decay), "add_decayed_weights", "weight_decay must be finite and >= 0, got ",
           weight_decay);
  return {weight_decay, std::move(mask)};
}

/// updates * schedule(count), then count + 1 (Optax's scale_by_schedule); sign -1 for a learning rate.
template <Schedule S>
struct ScaleBySchedule {
  S schedule;
  double sign = 1.0;
  template <class Params>
  ScaleByScheduleState<Params> init(const Params&) const {
    return {detail::zero_count<detail::device_of<Params>>()};
  }
  template <class Params>
  std::pair<Params, ScaleByScheduleState<Params>> update(const Params& updates, const ScaleByScheduleState<Params>& state,
                                                          const Params&) const {
    const auto step = detail::eval_schedule(schedule, state.count, sign);
    Params out = detail::map_float_leaves([&](const auto& g) { return detail::scale_by_device_scalar(g, step); }, updates);
    return {out, {detail::increment(state.count)}};
  }
};

template <Schedule S>
ScaleBySchedule<S> scale_by_schedule(S schedule) {
  return {schedule, 1.0};
}

/// -learning_rate * updates: a constant (Scale) or a schedule evaluated on the device at the count.
inline Scale scale_by_learning_rate(double learning_rate) {
  TG_CHECK(std::isfinite(learning_rate), "scale_by_learning_rate", "learning_rate must be finite, got ", learning_rate);
  return {-learning_rate};
}
template <Schedule S>
ScaleBySchedule<S> scale_by_learning_rate(S schedule) {
  return {schedule, -1.0};
}

/// Momentum: trace = updates + decay * trace; updates = trace, or updates + decay * trace (Nesterov).
struct Trace {
  double decay = 0.9;
  bool nesterov = false;
  template <class Params>
  TraceState<Params> init(const Params& params) const {
    return {tree_zeros_like(params)};
  }
  template <class Params>
  std::pair<Params, TraceState<Params>> update(const Params& updates, const TraceState<Params>& state, const Params&) const {
    // trace = g + decay trace (rounded to the trace's dtype); the update is it, or g + decay trace.
    const fn::AddScaled plus_decay{decay};
    TraceState<Params> next{detail::map_float_leaves([&](const auto& g, const auto& t) { return map2(g, t, plus_decay, "trace"); },
                                                     updates, state.trace)};
    if (!nesterov) return {next.trace, next};
    return {detail::map_float_leaves([&](const auto& g, const auto& t) { return map2(g, t, plus_decay, "trace"); }, updates, next.trace),
            next};
  }
};
inline Trace trace(double decay, bool nesterov = false) {
  TG_CHECK(decay >= 0.0 && std::isfinite(decay), "trace", "decay (momentum) must be finite and >= 0, got ", decay);
  return {decay, nesterov};
}

/// Clips every update element to [-max_delta, max_delta].
struct Clip {
  double max_delta = 1.0;
  template <class Params> EmptyState init(const Params&) const { return {}; }
  template <class Params>
  std::pair<Params, EmptyState> update(const Params& updates, const EmptyState&, const Params&) const {
    return {detail::map_float_leaves([&](const auto& g) { return clip(g, -max_delta, max_delta); }, updates), {}};
  }
};
inline Clip clip(double max_delta) {
  TG_CHECK(max_delta >= 0.0, "clip", "max_delta must be >= 0, got ", max_delta);
  return {max_delta};
}

namespace detail {

/// clip_by_global_norm's rescale of a chunk of one leaf (fn::ClipToNorm, in the compute type), the norm
/// (of the tree's floating type N) read from the device: leaves in, leaves out.
template <class N>
struct ClipToNormFn {
  const N* norm;
  double max_norm;
  template <class Lists>
  TG_HD void operator()(const Lists& l, const ::tg::detail::Chunk& c) const {
    range(fn::ClipToNorm{max_norm}, norm[0], c.begin, c.end, l.ptr[0][c.tensor], l.ptr[1][c.tensor]);
  }
  template <class T>
  TG_HOST_NOINLINE TG_HD static void range(fn::ClipToNorm clip, N norm, std::int64_t begin, std::int64_t end, const T* __restrict in,
                                           T* __restrict out) {
    using C = compute_t<T>;
    using NC = compute_t<N>;
    const NC n = ::tg::detail::convert_from<NC>(norm);
    for (std::int64_t i = begin; i < end; ++i) out[i] = ::tg::detail::convert_to<T>(clip(::tg::detail::convert_from<C>(in[i]), n));
  }
};

}  // namespace detail

/// Rescales the updates to global norm max_norm when their global norm exceeds it (computed on the device).
struct ClipByGlobalNorm {
  double max_norm = 1.0;
  template <class Params> EmptyState init(const Params&) const { return {}; }
  template <class Params>
  std::pair<Params, EmptyState> update(const Params& updates, const EmptyState&, const Params&) const {
    using D = tree_device_t<Params>;
    const auto norm = global_norm(updates);  // of the tree's floating type, on the device
    if (tree_batch_levels(updates)) {  // batching rule (under tg::vmap): each example's updates by its own norm, with ops
      using N = typename std::remove_cvref_t<decltype(norm)>::value_type;
      const auto below = less(norm, full<N, D>(Shape{}, static_cast<N>(max_norm)));
      return {tree_map([&](const auto& g) {
                using T = typename std::remove_cvref_t<decltype(g)>::value_type;
                if constexpr (FloatElement<T>) {
                  const auto n = cast<T>(norm);
                  return where(below, g, mul(div(g, n), max_norm));
                } else {
                  return g;
                }
              }, updates), {}};
    }
    // optax: select(norm < max_norm, t, (t / norm) * max_norm), in each leaf's compute type: one launch
    // per 32 leaves of a dtype, the norm read from the device.
    const detail::ClipToNormFn<typename std::remove_cvref_t<decltype(norm)>::value_type> clip{norm.data(), max_norm};
    std::tuple<::tg::detail::TensorLists<float, 2>, ::tg::detail::TensorLists<double, 2>, ::tg::detail::TensorLists<bf16, 2>> lists;
    auto run = [&](auto& group) {
      if (!group.empty()) ::tg::detail::multi_tensor_map<D>(group, clip);
      group = {};
    };
    Params out = tree_map([&](const auto& g) {
      using L = std::remove_cvref_t<decltype(g)>;
      using T = typename L::value_type;
      if constexpr (FloatElement<T>) {
        L o(g.shape());
        auto& group = std::get<::tg::detail::TensorLists<T, 2>>(lists);
        if (group.add({g.data(), o.data()}, g.size())) run(group);
        return o;
      } else {
        return g;
      }
    }, updates);
    std::apply([&](auto&... group) { (run(group), ...); }, lists);
    return {out, {}};
  }
};
inline ClipByGlobalNorm clip_by_global_norm(double max_norm) {
  TG_CHECK(max_norm > 0.0, "clip_by_global_norm", "max_norm must be > 0, got ", max_norm);
  return {max_norm};
}

}  // namespace optim
TG_END_NAMESPACE
