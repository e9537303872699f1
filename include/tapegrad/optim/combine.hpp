// chain(a, b, ...): transformations applied in order; the state is a std::tuple of theirs (no virtual calls).
#pragma once

#include <tuple>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/optim/base.hpp"

TG_BEGIN_NAMESPACE
namespace optim {

/// Applies its transformations in order, each to the previous one's updates.
template <class... G>
struct Chain {
  std::tuple<G...> transforms;

  template <class Params>
  std::tuple<state_t<G, Params>...> init(const Params& params) const {
    return std::apply([&](const auto&... g) { return std::tuple<state_t<G, Params>...>(g.init(params)...); }, transforms);
  }

  template <class Params>
  std::pair<Params, std::tuple<state_t<G, Params>...>> update(const Params& updates, const std::tuple<state_t<G, Params>...>& state,
                                                               const Params& params) const {
    std::tuple<state_t<G, Params>...> next;
    Params u = updates;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((std::tie(u, std::get<I>(next)) = std::get<I>(transforms).update(u, std::get<I>(state), params)), ...);
    }(std::index_sequence_for<G...>{});
    return {u, next};
  }
};

/// chain(a, b, c): optax.chain.
template <class... G>
Chain<G...> chain(G... transforms) {
  return {std::tuple<G...>(std::move(transforms)...)};
}

}  // namespace optim
TG_END_NAMESPACE
