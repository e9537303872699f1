// grad and value_and_grad: JAX's transforms over the tape. The gradients come back as the parameters'
// own C++ type; has_aux lets the function return (loss, aux) with aux not differentiated.
#pragma once

#include <string>
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

/// Runs f on traced parameters, walks the tape back from the scalar output, and returns
/// {output, gradients} (the output still (loss, aux) when Aux).
template <bool Aux, class F, class Params, class... Args>
auto value_and_grad_impl(F& f, const Params& params, Args&&... args) {
  Tape tape;
  Params traced = params;
  using Out = std::remove_cvref_t<std::invoke_result_t<F&, const Params&, Args&&...>>;
  Out out = [&] {
    ActiveTape active(&tape);
    // Inside tg::vmap the gradient is per example: every leaf is given each active batch axis first (as
    // JAX's batched backward pass makes a shared parameter's cotangent batched), so the tape's backward
    // walk, which runs on the physical tensors, keeps the examples apart.
    const std::uint32_t levels = active_levels();
    tree_for_each([&](const std::string&, auto& leaf) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      if constexpr (FloatElement<typename L::value_type>) {
        if (levels && leaf.batch_levels() == 0) leaf = L::broadcast_view(leaf.untraced(), levels, with_batch(levels, leaf.shape(), "value_and_grad"));
        else if (levels & ~leaf.batch_levels()) leaf = materialize(leaf.untraced(), levels | leaf.batch_levels());
        leaf.set_trace({tape.id(), tape.new_node(leaf.physical_shape())});
      }
    }, traced);
    return f(std::as_const(traced), std::forward<Args>(args)...);
  }();

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

  if (tape.owns(loss.trace())) {  // batched: a scalar per example, each seeded with 1
    tape.accumulate(loss.trace(), ones<typename Loss::value_type, typename Loss::device_type>(loss.physical_shape()));
    tape.backward();  // no tape is active: the backward rules record nothing
  }
  Params grads = traced;
  tree_for_each([&](const std::string&, auto& g, const auto& p) {
    using L = std::remove_cvref_t<decltype(g)>;
    using T = typename L::value_type;
    using D = typename L::device_type;
    L cot;
    if constexpr (FloatElement<T>) cot = tape.cotangent<T, D>(p.trace().node);
    // An unused leaf: zeros of its shape. The tape's cotangents are physical: batched as the leaf is.
    g = L::batched(cot.defined() ? cot.untraced() : zeros<T, D>(p.physical_shape()), p.batch_levels());
  }, grads, traced);
  return std::pair{strip_traces(std::move(out)), std::move(grads)};
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
