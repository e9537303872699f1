// grad and value_and_grad: JAX's transforms over the tape. The gradients come back as the parameters'
// own C++ type; has_aux lets the function return (loss, aux) with aux not differentiated; argnums picks
// other arguments. Nested (grad of grad), they record on the enclosing transformation's tape.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/core/batching.hpp"
#include "tapegrad/core/tape.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE

/// Tag: the function returns std::pair{loss, aux}; aux is passed through, not differentiated.
struct HasAux {};
inline constexpr HasAux has_aux{};

namespace detail {

template <class T> struct is_pair : std::false_type {};
template <class A, class B> struct is_pair<std::pair<A, B>> : std::true_type {};

template <class X>
concept Pytree = requires(X& x) { tree_for_each([](const std::string&, auto&) {}, x); };

/// The same value with every tensor leaf's trace removed (anything else is passed through).
template <class X>
X strip_traces(X x) {
  if constexpr (is_tensor<X>::value) {
    return x.untraced();
  } else if constexpr (Pytree<X>) {
    tree_for_each([](const std::string&, auto& leaf) { leaf = leaf.untraced(); }, x);
    return x;
  } else {
    return x;
  }
}

/// Gives every floating leaf of `tree` a fresh node on `tape` (the tape must be active). A leaf already
/// traced on it (a transformation nested in another: grad of grad) is linked to its old node, so that an
/// outer backward pass flows through. Inside tg::vmap every leaf is given each active batch axis first
/// (as JAX's batched backward pass makes a shared parameter's cotangent batched), so the tape's walks,
/// which run on the physical tensors, keep the examples apart.
template <class Tree>
void trace_leaves(Tape& tape, Tree& tree) {
  const std::uint32_t levels = active_levels();
  tree_for_each([&](const std::string&, auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    using T = typename L::value_type;
    using D = typename L::device_type;
    if constexpr (FloatElement<T>) {
      const Trace from = leaf.trace();
      const bool linked = tape.holds(from);
      if (linked && (levels & ~leaf.batch_levels())) leaf = materialize(leaf, levels | leaf.batch_levels());  // traced copies
      else if (levels && leaf.batch_levels() == 0) leaf = L::broadcast_view(leaf.untraced(), levels, with_batch(levels, leaf.shape(), "value_and_grad"));
      else if (levels & ~leaf.batch_levels()) leaf = materialize(leaf.untraced(), levels | leaf.batch_levels());
      const Trace outer = leaf.trace();
      const std::int64_t node = tape.new_node(leaf.physical_shape());
      leaf.set_trace({tape.id(), node});
      if (tape.holds(outer)) {
        tape.use(outer);
        tape.push([outer, node](Tape& t) {
          const Tensor<T, D> dy = t.cotangent<T, D>(node);
          if (dy.defined()) t.accumulate(outer, dy);
        });
        forward_identity<T, D>(tape, outer, node);
      }
    }
  }, tree);
}

/// A tree of zeros like `tree`'s floating leaves, each a fresh node on `tape`, physical and batched as the
/// leaves are: the variables a transformation linearises in (jvp's cotangent u of the output, custom_jvp's
/// tangents).
template <class Tree>
Tree zero_leaves(Tape& tape, const Tree& tree) {
  Tree z = tree;
  tree_for_each([&](const std::string&, auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    using T = typename L::value_type;
    if constexpr (FloatElement<T>) {
      leaf = L::batched(zeros<T, typename L::device_type>(leaf.physical_shape()), leaf.batch_levels());
      leaf.set_trace({tape.id(), tape.new_node(leaf.physical_shape())});
    }
  }, z);
  return z;
}

/// f(x, args...) recorded on `tape` from fresh nodes for x's leaves (trace_leaves; `x` becomes the traced
/// copy): the start of every transformation's pass.
template <class F, class X, class... Args>
auto call_traced(Tape& tape, X& x, F& f, Args&&... args) {
  ActiveTape active(&tape);
  trace_leaves(tape, x);
  return f(std::as_const(x), std::forward<Args>(args)...);
}

/// The tape a transformation records on: the active one when it is nested in another (so the outer one
/// sees everything it does), else its own; and the transformation's level (core/tape.hpp) while it runs.
/// A reverse transformation's level is pending until it calls walking() (its rules are kept until then);
/// a forward one (tg::jvp's) carries its pass's tangents, and a tape of its own is forward-only.
class TransformTape {
 public:
  enum Kind { reverse, forward };
  explicit TransformTape(Kind kind = reverse) : outer_(active_tape) {
    if (!outer_) {
      own_.emplace();
      if (kind == forward) own_->set_forward_only();
    }
    first_node_ = tape().size();
    first_entry_ = tape().entries();
    if (kind == forward) {
      forward_.emplace(first_node_);
      forward_scope_.emplace(tape(), *forward_);
    } else {
      pending_.emplace(tape(), first_node_);
    }
    level_.emplace(Level{tape().id(), first_node_, forward_ ? &*forward_ : nullptr});
  }
  TransformTape(const TransformTape&) = delete;
  TransformTape& operator=(const TransformTape&) = delete;
  Tape& tape() { return outer_ ? *outer_ : *own_; }
  /// Nested in another transformation: its walks record, its results stay traced.
  bool nested() const { return outer_ != nullptr; }
  std::int64_t first_node() const { return first_node_; }
  std::int64_t first_entry() const { return first_entry_; }
  /// A value to hand back: traced when nested, else a plain tensor.
  template <class X> X result(X x) const { return nested() ? std::move(x) : strip_traces(std::move(x)); }
  /// A reverse transformation's walk begins: every rule it walks is recorded.
  void walking() {
    if (pending_) pending_->end();
  }
  /// A forward transformation's tangents.
  Forward& pass() { return *forward_; }

 private:
  Tape* outer_;
  std::optional<Tape> own_;
  std::int64_t first_node_ = 0, first_entry_ = 0;
  std::optional<Forward> forward_;
  std::optional<ForwardScope> forward_scope_;
  std::optional<PendingReverse> pending_;
  std::optional<LevelScope> level_;  // last: popped before the tape goes
};

/// The cotangent of each leaf of `traced` after `walk`, as a tree of its type (zeros for a leaf nothing
/// reached; physical and batched as the leaf is).
template <class Tree>
Tree gather_cotangents(const Walk& walk, const Tree& traced, bool keep_traces) {
  Tree out = traced;
  tree_for_each([&](const std::string&, auto& g, const auto& p) {
    using L = std::remove_cvref_t<decltype(g)>;
    using T = typename L::value_type;
    using D = typename L::device_type;
    L cot;
    if constexpr (FloatElement<T>) cot = walk.cotangent<T, D>(p.trace().node);
    if (cot.defined() && !keep_traces) cot = cot.untraced();
    g = L::batched(cot.defined() ? cot : zeros<T, D>(p.physical_shape()), p.batch_levels());
  }, out, traced);
  return out;
}

/// Runs f on traced parameters, walks the tape back from the scalar output, and returns
/// {output, gradients} (the output still (loss, aux) when Aux).
template <bool Aux, class F, class Params, class... Args>
auto value_and_grad_impl(F& f, const Params& params, Args&&... args) {
  TransformTape scope;
  Tape& tape = scope.tape();
  DepthScope depth(1);
  Params traced = params;
  using Out = std::remove_cvref_t<std::invoke_result_t<F&, const Params&, Args&&...>>;
  Out out = call_traced(tape, traced, f, std::forward<Args>(args)...);

  if constexpr (Aux) static_assert(is_pair<Out>::value, "value_and_grad(f, tg::has_aux): f must return std::pair{loss, aux}");
  auto& loss = *[&] {
    if constexpr (Aux) return &out.first;
    else return &out;
  }();
  using Loss = std::remove_cvref_t<decltype(loss)>;
  static_assert(is_tensor<Loss>::value && FloatElement<typename Loss::value_type>,
                "value_and_grad: the function must return a floating-point scalar tg::Tensor (or {loss, aux} with has_aux)");
  TG_CHECK(loss.defined() && loss.rank() == 0, "value_and_grad", "the function must return a scalar (shape ()), got shape ",
           loss.defined() ? loss.shape().str() : std::string("<undefined>"), "; reduce it first, e.g. with tg::mean");

  // Nested in another transformation, the walk records (its rules' ops are differentiated by the outer
  // one); outermost, nothing is active during it and the rules run their fused kernels.
  scope.walking();
  Walk walk(tape.size(), scope.first_node(), scope.nested());
  if (tape.owns(loss.trace())) {  // batched: a scalar per example, each seeded with 1
    tape.accumulate_in(walk, loss.trace(), ones<typename Loss::value_type, typename Loss::device_type>(loss.physical_shape()));
    tape.backward(walk, scope.first_entry(), tape.entries());
  }
  Params grads = gather_cotangents(walk, traced, scope.nested());
  return std::pair{scope.result(std::move(out)), std::move(grads)};
}

/// Which arguments argnums differentiates.
template <std::size_t... I>
struct Argnums {};

/// Where K is among I... (sizeof...(I) when it is not).
template <std::size_t K, std::size_t... I>
constexpr std::size_t position_of() {
  constexpr std::size_t indices[] = {I..., K};
  std::size_t n = 0;
  while (indices[n] != K) ++n;
  return n;
}

/// f called with argument K taken from `selected` (the tuple being differentiated) where K is one of I...,
/// else from `all`.
template <class F, std::size_t... I, class... Args>
auto call_with_selected(F& f, const std::tuple<std::remove_cvref_t<std::tuple_element_t<I, std::tuple<Args...>>>...>& selected,
                        std::tuple<Args...>& all) {
  return [&]<std::size_t... J>(std::index_sequence<J...>) {
    auto pick = [&]<std::size_t K>(std::integral_constant<std::size_t, K>) -> decltype(auto) {
      constexpr std::size_t pos = position_of<K, I...>();
      if constexpr (pos < sizeof...(I)) return static_cast<const std::remove_cvref_t<std::tuple_element_t<K, std::tuple<Args...>>>&>(std::get<pos>(selected));
      else return static_cast<std::tuple_element_t<K, std::tuple<Args...>>&&>(std::get<K>(all));
    };
    return f(pick(std::integral_constant<std::size_t, J>{})...);
  }(std::make_index_sequence<sizeof...(Args)>{});
}

/// value_and_grad with respect to arguments I...: {value, grads}, grads of the argument's type for one
/// index, a std::tuple of them for several.
template <bool Aux, std::size_t... I, class F, class... Args>
auto value_and_grad_argnums(F& f, Args&&... args) {
  static_assert(sizeof...(I) > 0, "tg::argnums<...>: name at least one argument");
  static_assert(((I < sizeof...(Args)) && ...), "tg::argnums<...>: an index is past the last argument");
  auto all = std::forward_as_tuple(std::forward<Args>(args)...);
  using Selected = std::tuple<std::remove_cvref_t<std::tuple_element_t<I, std::tuple<Args...>>>...>;
  const Selected selected{std::get<I>(all)...};
  auto g = [&](const Selected& s) { return call_with_selected<F, I...>(f, s, all); };
  auto [value, grads] = value_and_grad_impl<Aux>(g, selected);
  if constexpr (sizeof...(I) == 1) return std::pair{std::move(value), std::get<0>(std::move(grads))};
  else return std::pair{std::move(value), std::move(grads)};
}

}  // namespace detail

/// value_and_grad(f)(params, args...) -> {loss, grads}: f(params, args...) must return a scalar tensor;
/// grads has params' type and holds d loss / d leaf for every leaf (args are not differentiated).
template <class F>
auto value_and_grad(F f) {
  return [f](const auto& params, auto&&... args) mutable {
    return detail::value_and_grad_impl<false>(f, params, std::forward<decltype(args)>(args)...);
  };
}

/// value_and_grad(f, tg::has_aux)(params, args...) -> {{loss, aux}, grads}: f returns std::pair{loss, aux}.
template <class F>
auto value_and_grad(F f, HasAux) {
  return [f](const auto& params, auto&&... args) mutable {
    return detail::value_and_grad_impl<true>(f, params, std::forward<decltype(args)>(args)...);
  };
}

/// Which arguments value_and_grad and grad differentiate (jax's argnums): tg::argnums<1> gives the
/// gradient with respect to the second argument, tg::argnums<0, 2> a std::tuple of two.
template <std::size_t... I>
inline constexpr detail::Argnums<I...> argnums{};

/// value_and_grad(f, tg::argnums<I...>)(args...) -> {value, grads}: grads of argument I's type (a tuple
/// for several indices).
template <class F, std::size_t... I>
auto value_and_grad(F f, detail::Argnums<I...>) {
  return [f](auto&&... args) mutable { return detail::value_and_grad_argnums<false, I...>(f, std::forward<decltype(args)>(args)...); };
}

/// value_and_grad(f, tg::argnums<I...>, tg::has_aux)(args...) -> {{value, aux}, grads}.
template <class F, std::size_t... I>
auto value_and_grad(F f, detail::Argnums<I...>, HasAux) {
  return [f](auto&&... args) mutable { return detail::value_and_grad_argnums<true, I...>(f, std::forward<decltype(args)>(args)...); };
}

/// grad(f, tg::argnums<I...>)(args...) -> grads of argument I's type (a tuple for several indices).
template <class F, std::size_t... I>
auto grad(F f, detail::Argnums<I...>) {
  return [f](auto&&... args) mutable { return detail::value_and_grad_argnums<false, I...>(f, std::forward<decltype(args)>(args)...).second; };
}

/// grad(f)(params, args...) -> grads, of params' type.
template <class F>
auto grad(F f) {
  return [f](const auto& params, auto&&... args) mutable {
    return detail::value_and_grad_impl<false>(f, params, std::forward<decltype(args)>(args)...).second;
  };
}

/// grad(f, tg::has_aux)(params, args...) -> {grads, aux}.
template <class F>
auto grad(F f, HasAux) {
  return [f](const auto& params, auto&&... args) mutable {
    auto [out, grads] = detail::value_and_grad_impl<true>(f, params, std::forward<decltype(args)>(args)...);
    return std::pair{std::move(grads), std::move(out.second)};
  };
}

TG_END_NAMESPACE
