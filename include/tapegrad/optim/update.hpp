// apply_updates (optax.apply_updates), and fused_adamw, the name adamw's fused pass had before chain()
// ran it by itself (optim/fused.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/optim/alias.hpp"

namespace tg::inline TG_ABI::optim {

/// params + updates, leaf by leaf, in the parameters' dtype (optax.apply_updates). Updates fresh from
/// adamw's fused pass come with the sum already computed by that pass (optim/fused.hpp): it is returned
/// instead of adding again, the same bits without another pass over the parameters.
template <class Params>
Params apply_updates(const Params& params, const Params& updates) {
  return tree_map([](const auto& p, const auto& u) {
    using L = std::remove_cvref_t<decltype(p)>;
    using T = typename L::value_type;
    if constexpr (FloatElement<T>) {
      TG_CHECK(p.shape() == u.shape(), "apply_updates", "update of shape ", u.shape().str(), " for a parameter of shape ", p.shape().str());
      if (!::tg::detail::recording(p, u))
        if (auto fused = detail::take_applied(p, u)) return *fused;
      return add(p, u);  // in the compute type, rounded to the parameter's dtype
    } else {
      return p;
    }
  }, params, updates);
}

/// adamw(lr, options, mask) under the name of its fast path: chain() runs adamw's three atoms as one
/// fused pass (optim/fused.hpp), so the two are the same object, kept for code that names it.
template <class LR, class Mask = AllLeaves>
auto fused_adamw(LR learning_rate, AdamWOptions o = {}, Mask mask = {}) {
  return adamw(learning_rate, o, std::move(mask));
}

}  // namespace tg::optim
