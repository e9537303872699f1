// Forward mode and its compositions: jvp, linearize, hvp, jacfwd, jacrev, hessian.
//
// jvp pushes tangents forward with the ops' JVP rules, as JAX does: f runs once, each op giving its output
// a tangent from its inputs' as it runs (core/tape.hpp's Forward; the rules sit beside each op's backward
// rule), and nothing is kept for a backward pass. Where f reaches an op that has no JVP rule, jvp computes
// J t by transposing the VJP instead: the backward pass from f's output, seeded with a cotangent u and
// recorded, is linear in u; walking *that* pass backward from x's cotangent, seeded with t, gives J t
// (a forward and two backward passes; the same numbers). linearize and jacfwd use that transposition
// (one recorded VJP, one walk per tangent).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/autodiff/grad.hpp"
#include "tapegrad/core/tape.hpp"
#include "tapegrad/ops/indexing.hpp"
#include "tapegrad/runtime/dispatch.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

/// `t` as the physical tensor of a leaf batched at `levels` (a tangent or a seed given per example, or
/// shared by every example), checked against the leaf's per-example shape.
template <Element T, Device D>
Tensor<T, D> seed_for(const Tensor<T, D>& t, const Tensor<T, D>& leaf, const std::string& path, const char* op) {
  TG_CHECK(t.defined() && t.shape() == leaf.shape(), op, "the tangent of '", path.empty() ? std::string("x") : path, "' has shape ",
           t.defined() ? t.shape().str() : std::string("<undefined>"), ", its primal ", leaf.shape().str(), "; give tangents of the primals' shapes");
  TG_CHECK((t.batch_levels() & ~leaf.batch_levels()) == 0, op, "a tangent batched by tg::vmap where its primal is not; map the primal too");
  return materialize(t, leaf.batch_levels()).physical().untraced();
}

/// f linearised at x: f(x), and the recorded VJP (x's cotangent xbar as a traced function of the output's
/// cotangent u), which apply() transposes for each tangent.
template <class X, class Out>
struct Linearization {
  Tape* tape = nullptr;
  std::shared_ptr<Tape> own;  // linearize's own tape, kept alive by the returned function
  Out out, u;
  X xbar;
  std::int64_t u_first = 0, first = 0, last = 0;
  bool records = false;

  /// J t: the recorded VJP walked backward from xbar seeded with t (recorded when nested).
  Out apply(const X& tangent, const char* op) const {
    Walk walk(tape->size(), u_first, records);
    tree_for_each([&](const std::string& path, const auto& g, const auto& t) {
      using L = std::remove_cvref_t<decltype(g)>;
      if constexpr (FloatElement<typename L::value_type>) {
        const auto seed = seed_for(t, g, path, op);
        if (tape->holds(g.trace())) tape->accumulate_in(walk, g.trace(), seed);
      }
    }, xbar, tangent);
    tape->backward(walk, first, last);
    return gather_cotangents(walk, u, records);
  }
};

/// Records f(x) and its VJP in u on `tape` (the active one when nested, else `own`).
template <class F, class X, class... Args>
auto linearize_on(Tape& tape, std::int64_t first_node, std::int64_t first_entry, bool nested, F& f, const X& primal, Args&&... args) {
  using Out = std::remove_cvref_t<std::invoke_result_t<F&, const X&, Args&&...>>;
  Linearization<X, Out> lin;
  lin.tape = &tape;
  lin.records = nested;
  DepthScope depth(2);  // the VJP is itself differentiated: the ops record their traced forms
  X traced = primal;
  lin.out = call_traced(tape, traced, f, std::forward<Args>(args)...);
  lin.u_first = tape.size();
  lin.u = zero_leaves(tape, lin.out);  // the output's cotangent u
  Walk walk(tape.size(), first_node, /*records=*/true);
  tree_for_each([&](const std::string&, const auto& y, const auto& u) {
    using L = std::remove_cvref_t<decltype(y)>;
    if constexpr (FloatElement<typename L::value_type>)
      if (tape.holds(y.trace())) tape.accumulate_in(walk, y.trace(), u.physical());  // the tape's values are physical
  }, lin.out, lin.u);
  lin.first = tape.entries();
  tape.backward(walk, first_entry, lin.first);
  lin.last = tape.entries();
  lin.xbar = gather_cotangents(walk, traced, /*keep_traces=*/true);
  return lin;
}

/// y[i] = 1 at i == j, else 0.
template <class T>
struct BasisFn {
  T* y;
  std::int64_t j;
  TG_HD void operator()(std::int64_t i) const { y[i] = i == j ? T(1) : T(0); }
};

/// The basis tensor e_j of `shape`: 1 at flat index j, zeros elsewhere. Written by a kernel, so that a
/// compiled step's replay writes it again (a host write would not be replayed).
template <Element T, Device D>
Tensor<T, D> basis(const Shape& shape, std::int64_t j) {
  Tensor<T, D> e(shape);
  if (e.size() > 0) index_map<D>(e.size(), BasisFn<T>{e.data(), j});
  return e;
}

/// The slices of a Jacobian stacked into out.shape + in.shape: `slices[k]` is the k-th column (jacfwd:
/// d out / d x_k, of out's shape) or row (jacrev: d out_k / d x, of x's shape).
template <Element T, Device D>
Tensor<T, D> assemble_jacobian(const std::vector<Tensor<T, D>>& slices, const Shape& out, const Shape& in, bool columns) {
  std::vector<std::int64_t> dims(out.dims().begin(), out.dims().end());
  dims.insert(dims.end(), in.dims().begin(), in.dims().end());
  std::vector<Tensor<T, D>> flat;
  for (const auto& s : slices) flat.push_back(s.reshape({-1}));
  const Tensor<T, D> j = stack(std::span<const Tensor<T, D>>(flat), columns ? 1 : 0);  // (out.numel, in.numel)
  return j.reshape(Shape(dims));
}

template <class X>
concept JacobianTensor = is_tensor<X>::value && FloatElement<typename X::value_type>;

}  // namespace detail

namespace detail {

/// `t` as the physical tangent of a leaf batched at `levels`, checked as seed_for does, and kept traced
/// (a transformation outside the jvp differentiates through it).
template <Element T, Device D>
Tensor<T, D> tangent_for(const Tensor<T, D>& t, const Tensor<T, D>& leaf, const std::string& path, const char* op) {
  seed_for(t, leaf, path, op);
  return materialize(t, leaf.batch_levels()).physical();
}

/// jvp by the ops' JVP rules: f(x) run once with x's tangents pushed forward. Throws NoForwardRule where f
/// reaches an op without one.
template <class F, class X, class... Args>
auto jvp_by_rules(F& f, const X& primal, const X& tangent, Args&... args) {
  TransformTape scope(TransformTape::forward);
  Tape& tape = scope.tape();
  DepthScope depth(1);  // one level: the fused ops keep their kernels (their rules) unless another level encloses
  X traced = primal;
  using Out = std::remove_cvref_t<std::invoke_result_t<F&, const X&, Args&...>>;
  Out out = [&] {
    ActiveTape active(&tape);
    trace_leaves(tape, traced);
    tree_for_each([&](const std::string& path, const auto& x, const auto& t) {
      using L = std::remove_cvref_t<decltype(x)>;
      if constexpr (FloatElement<typename L::value_type>) {
        const auto seed = tangent_for(t, x, path, "jvp");
        scope.pass().set(x.trace().node, seed);
      }
    }, traced, tangent);
    return f(std::as_const(traced), args...);
  }();
  Out out_tangent = out;
  tree_for_each([&](const std::string&, auto& t, const auto& y) {
    using L = std::remove_cvref_t<decltype(y)>;
    using T = typename L::value_type;
    using D = typename L::device_type;
    if constexpr (FloatElement<T>) {
      Tensor<T, D> g = tape.holds(y.trace()) ? scope.pass().template tangent<T, D>(y.trace().node) : Tensor<T, D>{};
      t = L::batched(g.defined() ? g : zeros<T, D>(y.physical_shape()), y.batch_levels());
    }
  }, out_tangent, out);
  return std::pair{scope.result(std::move(out)), scope.result(std::move(out_tangent))};
}

/// jvp by transposing the recorded VJP (for a function with an op that has no JVP rule).
template <class F, class X, class... Args>
auto jvp_by_transposition(F& f, const X& primal, const X& tangent, Args&&... args) {
  TransformTape scope;
  auto lin = linearize_on(scope.tape(), scope.first_node(), scope.first_entry(), scope.nested(), f, primal, std::forward<Args>(args)...);
  auto out_tangent = lin.apply(tangent, "jvp");
  return std::pair{scope.result(std::move(lin.out)), std::move(out_tangent)};
}

}  // namespace detail

/// jvp(f, x, t, args...) -> {f(x, args...), J t}: the output and its tangent along t, as jax.jvp(f, (x,),
/// (t,)). x and t are pytrees of one type (a tensor, a registered struct); f's result a tensor or a pytree
/// of tensors; args are not differentiated. Forward mode by the ops' JVP rules (about two forward passes'
/// work); where f uses an op without one, by transposing the VJP (a forward and two backward passes).
template <class F, class X, class... Args>
auto jvp(F f, const X& primal, const X& tangent, Args&&... args) {
  try {
    return detail::jvp_by_rules(f, primal, tangent, args...);
  } catch (const detail::NoForwardRule&) {
    // An op without a JVP rule: the same J t by transposition. f ran partly; pure, it is run again.
  }
  return detail::jvp_by_transposition(f, primal, tangent, std::forward<Args>(args)...);
}

/// linearize(f, x, args...) -> {f(x, args...), f_jvp}: f_jvp(t) gives J t for any tangent t, each call a
/// backward pass over the one recorded VJP (jax.linearize). Not inside another transformation (use jvp
/// there).
template <class F, class X, class... Args>
auto linearize(F f, const X& primal, Args&&... args) {
  TG_CHECK(detail::active_tape == nullptr, "linearize", "cannot be nested in grad, jvp or another transformation; use tg::jvp inside them");
  auto tape = std::make_shared<detail::Tape>();
  detail::LevelScope level(detail::Level{tape->id(), 0});
  auto lin = detail::linearize_on(*tape, 0, 0, false, f, primal, std::forward<Args>(args)...);
  lin.own = tape;
  auto out = detail::strip_traces(lin.out);
  return std::pair{std::move(out), [lin = std::move(lin)](const X& t) { return lin.apply(t, "linearize"); }};
}

/// hvp(f, x, v, args...) -> H v, the Hessian of the scalar f(x, args...) at x times v, by forward over
/// reverse: jvp of grad(f), the tangents pushed through the gradient's backward pass by the rules of the
/// ops it runs. Of x's type.
template <class F, class X, class... Args>
X hvp(F f, const X& primal, const X& v, Args&&... args) {
  auto g = [&f](const X& x, auto&&... a) { return grad(f)(x, std::forward<decltype(a)>(a)...); };
  return jvp(g, primal, v, std::forward<Args>(args)...).second;
}

/// jacfwd(f)(x, args...): the Jacobian of f: tensor -> tensor at x, shape out.shape + x.shape, by forward
/// mode, one tangent per element of x (for small inputs). As jax.jacfwd.
template <class F>
auto jacfwd(F f) {
  return [f](const auto& x, auto&&... args) mutable {
    using X = std::remove_cvref_t<decltype(x)>;
    static_assert(detail::JacobianTensor<X>, "jacfwd: x must be a floating-point tg::Tensor");
    using T = typename X::value_type;
    using D = typename X::device_type;
    detail::TransformTape scope;
    auto lin = detail::linearize_on(scope.tape(), scope.first_node(), scope.first_entry(), scope.nested(), f, x,
                                    std::forward<decltype(args)>(args)...);
    using Out = decltype(lin.out);
    static_assert(std::is_same_v<Out, X>, "jacfwd: f must return a tensor of x's type");
    std::vector<Out> columns;
    for (std::int64_t j = 0; j < x.size(); ++j) columns.push_back(lin.apply(detail::basis<T, D>(x.shape(), j), "jacfwd"));
    return scope.result(detail::assemble_jacobian(columns, lin.out.shape(), x.shape(), true));
  };
}

/// jacrev(f)(x, args...): the Jacobian of f: tensor -> tensor at x, shape out.shape + x.shape, by reverse
/// mode, one backward pass per element of the output (for small outputs). As jax.jacrev.
template <class F>
auto jacrev(F f) {
  return [f](const auto& x, auto&&... args) mutable {
    using X = std::remove_cvref_t<decltype(x)>;
    static_assert(detail::JacobianTensor<X>, "jacrev: x must be a floating-point tg::Tensor");
    using T = typename X::value_type;
    using D = typename X::device_type;
    detail::TransformTape scope;
    detail::Tape& tape = scope.tape();
    detail::DepthScope depth(1);
    X traced = x;
    const X out = detail::call_traced(tape, traced, f, std::forward<decltype(args)>(args)...);
    std::vector<X> rows;
    scope.walking();
    const std::int64_t last = tape.entries();
    for (std::int64_t i = 0; i < out.size(); ++i) {
      detail::Walk walk(tape.size(), scope.first_node(), scope.nested());
      if (tape.holds(out.trace()))
        tape.accumulate_in(walk, out.trace(), detail::seed_for(detail::basis<T, D>(out.shape(), i), out, "", "jacrev"));
      tape.backward(walk, scope.first_entry(), last);
      rows.push_back(detail::gather_cotangents(walk, traced, scope.nested()));
    }
    return scope.result(detail::assemble_jacobian(rows, out.shape(), x.shape(), false));
  };
}

/// hessian(f)(x, args...): the Hessian of the scalar f at x, shape x.shape + x.shape: jacfwd(grad(f)), as
/// jax.hessian.
template <class F>
auto hessian(F f) {
  return [f](const auto& x, auto&&... args) mutable {
    auto g = [&f](const auto& p, auto&&... a) { return grad(f)(p, std::forward<decltype(a)>(a)...); };
    return jacfwd(g)(x, std::forward<decltype(args)>(args)...);
  };
}

TG_END_NAMESPACE
