// custom_vjp and checkpoint: a function's backward pass given by the user (jax.custom_vjp), or made by
// running its forward pass again (jax.checkpoint): one tape node for the whole function either way.
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

/// custom_vjp(fwd, bwd): a differentiable function whose backward pass is bwd, as jax.custom_vjp with
/// defvjp(fwd, bwd). fwd(x, args...) returns {y, residuals} (y a tensor); bwd(residuals, dy) returns x's
/// cotangent, of x's type. The returned function takes (x, args...) and gives y; args are not
/// differentiated. Under higher order the residuals are traced, so bwd is differentiated as it computes.
template <class Fwd, class Bwd>
auto custom_vjp(Fwd fwd, Bwd bwd) {
  return [fwd, bwd](const auto& x, auto&&... args) {
    using X = std::remove_cvref_t<decltype(x)>;
    detail::Tape* tape = detail::active_tape;
    auto [traces, any_traced] = detail::leaf_traces(tape, x);
    const bool traced = any_traced;  // a copy: clang 14 cannot capture a structured binding in a lambda
    // First order: fwd runs as a constant (only bwd differentiates). Higher order: fwd's ops are recorded
    // too, so the residuals, and through them bwd's result, depend on x for an outer pass.
    auto [y, residuals] = [&] {
      detail::ActiveTape active(traced && detail::higher_order() ? tape : nullptr);
      return fwd(x, std::forward<decltype(args)>(args)...);
    }();
    using Y = std::remove_cvref_t<decltype(y)>;
    static_assert(detail::is_tensor<Y>::value, "custom_vjp: fwd must return {y, residuals} with y a tg::Tensor");
    if (!traced) return y;
    TG_CHECK(tree_batch_levels(x) == 0 && y.batch_levels() == 0, "custom_vjp", "a custom_vjp function differentiated inside tg::vmap is "
             "not supported; differentiate outside the vmap, or vmap the whole gradient");
    Y out = y.untraced();
    for (const auto& tr : traces) tape->use(tr);  // before the rule takes them
    detail::record(out, {}, [traces = std::move(traces), residuals = std::move(residuals), kept = x, bwd](detail::Tape& t, const Y& dy) {
      detail::accumulate_leaves(t, traces, kept, X(bwd(residuals, dy)), "custom_vjp");
    });
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
      X xr = kept;
      const Y yr = detail::call_traced(t, xr, rerun);
      detail::Walk walk(t.size(), first_node, t.records());
      t.accumulate_in(walk, yr.trace(), dy);
      t.backward(walk, first_entry, t.entries());
      detail::accumulate_leaves(t, traces, kept, detail::gather_cotangents(walk, xr, t.records()), "checkpoint");
    });
    return out;
  };
}

TG_END_NAMESPACE
