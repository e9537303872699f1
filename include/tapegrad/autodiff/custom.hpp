// custom_vjp, custom_jvp and checkpoint: a function's derivative given by the user, as its backward pass
// (jax.custom_vjp) or its forward one (jax.custom_jvp), or its backward pass made by running its forward
// pass again (jax.checkpoint): one tape node for the whole function each way.
#pragma once

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/autodiff/grad.hpp"
#include "tapegrad/core/tape.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

/// The traces of x's floating leaves on `tape`, in order, and whether any is on it.
template <class X>
std::pair<std::vector<Trace>, bool> leaf_traces(const Tape* tape, const X& x) {
  std::vector<Trace> traces;
  bool any = false;
  tree_for_each([&](const std::string&, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (FloatElement<typename L::value_type>) {
      traces.push_back(leaf.trace());
      any = any || (tape != nullptr && tape->holds(leaf.trace()));
    }
  }, x);
  return {traces, any};
}

/// Adds each leaf of the cotangent tree `dx` to the leaf of x traced as traces[i], checking its shape.
template <class X>
void accumulate_leaves(Tape& t, const std::vector<Trace>& traces, const X& x, const X& dx, const char* op) {
  std::size_t i = 0;
  tree_for_each([&](const std::string& path, const auto& leaf, const auto& g) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (FloatElement<typename L::value_type>) {
      const Trace& tr = traces[i++];
      if (!t.owns(tr) || !g.defined()) return;
      TG_CHECK(g.shape() == leaf.shape() && g.batch_levels() == leaf.batch_levels(), op, "the backward function returned a cotangent of shape ",
               g.shape().str(), " for '", path.empty() ? std::string("x") : path, "' of shape ", leaf.shape().str(),
               "; it must return cotangents of the inputs' shapes");
      t.accumulate(tr, g);
    }
  }, x, dx);
}

}  // namespace detail

namespace detail {

/// Where a custom function is called: the tape, x's leaves' traces on it, and the innermost level of
/// differentiation, whose pass applies the function's rule (none when nothing differentiates x here), and
/// whether levels outside it record on the same tape (a second differentiation: their passes differentiate
/// what the function computes).
struct CustomCall {
  Tape* tape = active_tape;
  std::vector<Trace> traces;
  const Level* level = nullptr;
  bool outer = false;

  template <class X>
  explicit CustomCall(const X& x) {
    auto [t, any] = leaf_traces(tape, x);
    traces = std::move(t);
    level = any ? innermost_level(*tape) : nullptr;
    outer = level != nullptr && levels.size() >= 2 && levels[levels.size() - 2].tape == level->tape;
  }
};

}  // namespace detail

/// custom_vjp(fwd, bwd): a differentiable function whose backward pass is bwd, as jax.custom_vjp with
/// defvjp(fwd, bwd). fwd(x, args...) returns {y, residuals} (y a tensor); bwd(residuals, dy) returns x's
/// cotangent, of x's type. The returned function takes (x, args...) and gives y; args are not
/// differentiated.
///
/// As in JAX, the rule is the derivative at the innermost level of differentiation that calls the
/// function only: a transformation around that one (the outer grad of a Hessian) differentiates what fwd
/// computes for y and what bwd computes for the cotangent, each as ordinary ops. So a gradient-reversal
/// layer (fwd the identity, bwd -dy) has the reversed gradient and the identity's second derivative, and
/// a straight-through estimator's Hessian is that of its backward pass, as in JAX.
template <class Fwd, class Bwd>
auto custom_vjp(Fwd fwd, Bwd bwd) {
  return [fwd, bwd](const auto& x, auto&&... args) {
    using X = std::remove_cvref_t<decltype(x)>;
    detail::CustomCall call(x);
    if (call.level == nullptr) return fwd(x, std::forward<decltype(args)>(args)...).first;  // nothing differentiates x here
    detail::Tape* tape = call.tape;
    const std::int64_t floor = call.level->floor;
    // Directly under forward mode, as JAX (which refuses it): tg::jvp then transposes bwd instead.
    if (call.level->forward != nullptr) throw detail::NoForwardRule{"custom_vjp"};
    // fwd runs as its own computation for the outer levels (recorded, so they differentiate y and the
    // residuals through it), as a constant where there are none; its own custom functions belong to the
    // outer levels.
    auto [y, residuals] = [&] {
      detail::LevelScope hide = detail::LevelScope::hiding_from(*tape, floor);
      detail::ActiveTape active(call.outer ? tape : nullptr);
      return fwd(x, std::forward<decltype(args)>(args)...);
    }();
    using Y = std::remove_cvref_t<decltype(y)>;
    static_assert(detail::is_tensor<Y>::value, "custom_vjp: fwd must return {y, residuals} with y a tg::Tensor");
    TG_CHECK(tree_batch_levels(x) == 0 && y.batch_levels() == 0, "custom_vjp", "a custom_vjp function differentiated inside tg::vmap is "
             "not supported; differentiate outside the vmap, or vmap the whole gradient");
    Y out = y.untraced();
    const detail::Trace computed = y.trace();  // fwd's y, traced for the outer levels
    for (const auto& tr : call.traces) tape->use(tr);  // before the rule takes them
    tape->use(computed);
    detail::record(out, {}, [traces = std::move(call.traces), residuals = std::move(residuals), kept = x, bwd, floor, computed](detail::Tape& t, const Y& dy) {
      if (t.walk_floor() < floor) return t.accumulate(computed, dy);  // an outer level: through fwd's ops
      detail::LevelScope hide = detail::LevelScope::hiding_from(t, t.walk_floor());  // bwd's custom functions: the outer levels'
      detail::accumulate_leaves(t, traces, kept, X(bwd(residuals, dy)), "custom_vjp");
    }, [fy = Y(y)](const detail::Tangents& tangent) { return tangent(fy); }, "custom_vjp");  // outer forward levels: through fwd's ops
    return out;
  };
}

/// custom_jvp(f, rule): f with its derivative given as a JVP rule, as jax.custom_jvp with defjvp(rule).
/// rule(x, t, args...) returns {y, ty}: f(x, args...) and its tangent along t, of x's type, computed with
/// ordinary ops and linear in t. Reverse mode transposes the rule (a backward pass over its recorded
/// tangent ops, from ty to t), so a custom_jvp function serves grad, jvp, vmap'd gradients and their
/// compositions. The rule is the derivative at the innermost level of differentiation that calls f; an
/// outer level differentiates the rule's own ops (its y and its tangent), so the rule must be
/// differentiable for second derivatives, as in JAX. A rule that calls the custom function itself for y
/// (as JAX's examples do) gives an outer level the rule again. Not differentiated: args.
template <class F, class Rule>
auto custom_jvp(F f, Rule rule) {
  return [f, rule](const auto& x, auto&&... args) {
    using X = std::remove_cvref_t<decltype(x)>;
    detail::CustomCall call(x);
    if (call.level == nullptr) return f(x, std::forward<decltype(args)>(args)...);  // nothing differentiates x here
    detail::Tape* tape = call.tape;
    const std::int64_t floor = call.level->floor;
    TG_CHECK(tree_batch_levels(x) == 0, "custom_jvp", "a custom_jvp function differentiated inside tg::vmap is not supported; "
             "differentiate outside the vmap, or vmap the whole gradient");
    if (detail::Forward* pass = call.level->forward) {
      // Forward mode at this level: the rule itself, on x's tangents in this pass, run as the outer levels'
      // ops (this pass hidden); y's tangent in this pass is the rule's, in the outer passes that of its y.
      X tx = x;
      tree_for_each([&](const std::string&, auto& t, const auto& leaf) {
        using L = std::remove_cvref_t<decltype(leaf)>;
        using T = typename L::value_type;
        using D = typename L::device_type;
        if constexpr (FloatElement<T>) {
          const Tensor<T, D> g = pass->tangent<T, D>(leaf.trace().node);
          t = g.defined() ? g : zeros<T, D>(leaf.shape());
        }
      }, tx, x);
      auto [y, ty] = [&] {
        detail::LevelScope hide = detail::LevelScope::hiding_from(*tape, floor);
        const std::size_t visible = tape->hide_forwards_from(pass);
        struct Show {
          detail::Tape* tape;
          std::size_t n;
          ~Show() { tape->show_forwards(n); }
        } show{tape, visible};
        return rule(x, std::as_const(tx), std::forward<decltype(args)>(args)...);
      }();
      using Y = std::remove_cvref_t<decltype(y)>;
      Y out = y.untraced();
      tape->use(y.trace());
      detail::record(out, {y.trace()}, [computed = y.trace()](detail::Tape& tp, const Y& dy) { tp.accumulate(computed, dy); },
                     [pass, ry = Y(y), rty = Y(ty)](const detail::Tangents& tangent) { return &tangent.pass == pass ? rty : tangent(ry); }, "custom_jvp");
      return out;
    }
    // The rule recorded on the tape with tangents that are fresh nodes: its tangent ops, entries
    // [first, last), are the linear map the backward pass transposes.
    const std::int64_t first_tangent = tape->size();
    const X t = detail::zero_leaves(*tape, x);
    const std::int64_t first = tape->entries();
    auto [y, ty] = [&] {
      detail::LevelScope hide = detail::LevelScope::hiding_from(*tape, floor);
      detail::PendingReverse keep(*tape, first_tangent);  // this level's pass walks the rule's entries
      return rule(x, t, std::forward<decltype(args)>(args)...);
    }();
    const std::int64_t last = tape->entries();
    using Y = std::remove_cvref_t<decltype(y)>;
    static_assert(detail::is_tensor<Y>::value && std::is_same_v<std::remove_cvref_t<decltype(ty)>, Y>,
                  "custom_jvp: the rule must return {y, ty}, two tg::Tensors of one type");
    TG_CHECK(ty.defined() && ty.shape() == y.shape(), "custom_jvp", "the rule returned a tangent of shape ",
             ty.defined() ? ty.shape().str() : std::string("<undefined>"), " for an output of shape ", y.shape().str(),
             "; it must return {f(x), J t} with J t of f(x)'s shape");
    Y out = y.untraced();
    const detail::Trace computed = y.trace(), tangent = ty.trace();
    for (const auto& tr : call.traces) tape->use(tr);
    tape->use(computed);
    detail::record(out, {}, [traces = std::move(call.traces), kept = x, t, tangent, computed, floor, first_tangent, first, last](detail::Tape& tp,
                                                                                                                           const Y& dy) {
      if (tp.walk_floor() < floor) return tp.accumulate(computed, dy);  // an outer level: through the rule's y
      // This level: the rule's tangent map transposed, a pass over its entries from ty (seeded with dy)
      // back to the tangents, recorded when this pass records (an outer level differentiates it).
      detail::LevelScope hide = detail::LevelScope::hiding_from(tp, tp.walk_floor());
      detail::Walk walk(tp.size(), first_tangent, tp.records());
      if (tp.holds(tangent)) tp.accumulate_in(walk, tangent, dy);
      tp.backward(walk, first, last);
      detail::accumulate_leaves(tp, traces, kept, detail::gather_cotangents(walk, t, tp.records()), "custom_jvp");
    }, [ry = Y(y)](const detail::Tangents& tangent) { return tangent(ry); }, "custom_jvp");  // outer forward levels: through the rule's y
    return out;
  };
}

/// checkpoint(f): f with its forward pass run again in the backward pass instead of its intermediate
/// values kept, as jax.checkpoint (remat): the tape holds only f's inputs and output, so peak memory
/// falls by what f's ops would have kept, at the cost of one more forward pass of f. f(x, args...) -> a
/// tensor; x a pytree (differentiated), args not.
template <class F>
auto checkpoint(F f) {
  return [f](const auto& x, auto&&... args) {
    using X = std::remove_cvref_t<decltype(x)>;
    detail::Tape* tape = detail::active_tape;
    auto [traces, any_traced] = detail::leaf_traces(tape, x);
    const bool traced = any_traced;  // a copy: clang 14 cannot capture a structured binding in a lambda
    if (traced && tape->forward_mode()) return f(x, args...);  // forward mode keeps nothing anyway: f as it is
    auto y = [&] {
      detail::ActiveTape none(nullptr);  // nothing kept
      return f(x, args...);
    }();
    using Y = std::remove_cvref_t<decltype(y)>;
    static_assert(detail::is_tensor<Y>::value, "checkpoint: f must return a tg::Tensor");
    if (!traced) return y;
    TG_CHECK(tree_batch_levels(x) == 0 && y.batch_levels() == 0, "checkpoint", "a checkpointed function differentiated inside tg::vmap is "
             "not supported; differentiate outside the vmap");
    Y out = y;
    auto rerun = [f, args = std::make_tuple(std::decay_t<decltype(args)>(args)...)](const X& xr) {
      return std::apply([&](const auto&... a) { return f(xr, a...); }, args);
    };
    for (const auto& tr : traces) tape->use(tr);
    detail::record(out, {}, [traces = std::move(traces), kept = x, rerun](detail::Tape& t, const Y& dy) {
      // The forward again, recorded on this tape from fresh nodes linked to x's (an outer pass, when this
      // one records, differentiates through it), then its own backward pass seeded with dy.
      const std::int64_t first_node = t.size(), first_entry = t.entries();
      detail::LevelScope level(detail::Level{t.id(), first_node});  // its own level: a custom rule inside applies here
      detail::PendingReverse keep(t, first_node);
      X xr = kept;
      const Y yr = detail::call_traced(t, xr, rerun);
      keep.end();
      detail::Walk walk(t.size(), first_node, t.records());
      t.accumulate_in(walk, yr.trace(), dy);
      t.backward(walk, first_entry, t.entries());
      detail::accumulate_leaves(t, traces, kept, detail::gather_cotangents(walk, xr, t.records()), "checkpoint");
    });
    return out;
  };
}

TG_END_NAMESPACE
