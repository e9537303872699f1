// Gradient transformations, Optax's design: a value with init(params) -> state and
// update(updates, state, params) -> {updates, state}, pure (the state is returned, never mutated).
#pragma once

#include <any>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE
namespace optim {

/// The state of a stateless transformation: a pytree with no leaves.
struct EmptyState {};

template <class Visitor, class Self, class... Others>
  requires std::is_same_v<std::remove_cvref_t<Self>, EmptyState>
void tg_pytree_visit(Visitor&&, Self&&, Others&&...) {}
template <class Self>
  requires std::is_same_v<std::remove_cvref_t<Self>, EmptyState>
auto tg_pytree_field_types(const Self*) -> std::tuple<void*>;

/// The step count a transformation keeps: an int32 scalar on the parameters' device, so schedules and
/// bias corrections are computed there and an update never waits on the host.
template <class Params>
using Count = Tensor<std::int32_t, tree_device_t<Params>>;

/// A transformation's state type for Params.
template <class G, class Params>
using state_t = std::remove_cvref_t<decltype(std::declval<const G&>().init(std::declval<const Params&>()))>;

/// G is a gradient transformation of Params: init(params) -> State, update(updates, state, params) ->
/// std::pair<Params, State>.
template <class G, class Params>
concept GradientTransformation = requires(const G g, const Params& p) {
  { g.init(p) };
  { g.update(p, g.init(p), p) } -> std::same_as<std::pair<Params, state_t<G, Params>>>;
};

namespace detail {

/// A fresh count of 0 on device D.
template <Device D>
Tensor<std::int32_t, D> zero_count() {
  return zeros<std::int32_t, D>(Shape{});
}

/// c + 1, saturating at INT32_MAX (optax's safe_int32_increment).
struct SafeIncrement {
  template <class C> TG_HD C operator()(C c) const { return c < C(2147483647) ? c + C(1) : c; }
};

/// The next step count, on the device.
template <Device D>
Tensor<std::int32_t, D> increment(const Tensor<std::int32_t, D>& count) {
  return map(count, SafeIncrement{}, "increment");
}

}  // namespace detail

/// A transformation chosen at run time: wraps any GradientTransformation of Params. Its state is a
/// std::any holding the wrapped transformation's state (unwrap with state_as<State>() to checkpoint it).
template <class Params>
class AnyTransformation {
 public:
  using State = std::any;

  AnyTransformation() = default;
  template <class G>
    requires(!std::is_same_v<std::remove_cvref_t<G>, AnyTransformation> && GradientTransformation<G, Params>)
  AnyTransformation(G g) : impl_(std::make_shared<Model<G>>(std::move(g))) {}

  State init(const Params& params) const { return require().init(params); }
  std::pair<Params, State> update(const Params& updates, const State& state, const Params& params) const {
    return require().update(updates, state, params);
  }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual State init(const Params&) const = 0;
    virtual std::pair<Params, State> update(const Params&, const State&, const Params&) const = 0;
  };
  template <class G>
  struct Model : Concept {
    explicit Model(G g) : g(std::move(g)) {}
    State init(const Params& p) const override { return g.init(p); }
    std::pair<Params, State> update(const Params& u, const State& s, const Params& p) const override {
      const auto* typed = std::any_cast<state_t<G, Params>>(&s);
      TG_CHECK(typed != nullptr, "AnyTransformation::update", "the state was not made by this transformation's init");
      auto [next, state] = g.update(u, *typed, p);
      return {std::move(next), State(std::move(state))};
    }
    G g;
  };
  const Concept& require() const {
    TG_CHECK(impl_ != nullptr, "AnyTransformation", "empty: assign a transformation (e.g. tg::optim::adamw(3e-3)) first");
    return *impl_;
  }
  std::shared_ptr<const Concept> impl_;
};

}  // namespace optim
TG_END_NAMESPACE
