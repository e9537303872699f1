// The numerics guard: find the tensor leaf that went NaN or Inf. Flags are computed on the device (no
// synchronisation, so they can be outputs of a compiled step); raising reads them, once per leaf, when the
// caller chooses to check. Off unless called: a training loop calls it behind a flag (the example's
// --check-numerics).
#pragma once

#include <string>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/reduce.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE

/// A tree of the same structure with each floating leaf replaced by a 0-d tensor: 0 when the leaf is all
/// finite, NaN when it holds a NaN or an Inf (max |x - x|: finite values give 0, NaN and Inf give NaN).
/// Integer leaves become 0-d zeros. Runs on the leaves' device without synchronising.
template <class Tree>
Tree nonfinite_flags(const Tree& tree) {
  return tree_map([](const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (std::is_same_v<L, bool>) {
      return leaf;
    } else {
      using T = typename L::value_type;
      using D = typename L::device_type;
      if constexpr (FloatElement<T>) {
        if (leaf.size() == 0) return zeros<T, D>({});
        return max(abs(leaf - leaf));
      } else {
        return zeros<T, D>({});
      }
    }
  }, tree);
}

/// Throws tg::Error naming the first leaf (tree order) whose flag from nonfinite_flags is set:
/// "[check_numerics] <what>: 'w2' holds a NaN or Inf". Reads the flags (a synchronisation on a GPU).
template <class Tree>
void raise_if_nonfinite(const Tree& flags, const std::string& what) {
  tree_for_each([&](const std::string& path, const auto& flag) {
    using L = std::remove_cvref_t<decltype(flag)>;
    if constexpr (!std::is_same_v<L, bool>) {
      using T = typename L::value_type;
      if constexpr (FloatElement<T>) {
        const double v = static_cast<double>(tg::cast<float>(flag).item());
        if (v != 0.0)
          detail::fail("check_numerics", what, ": '", path.empty() ? std::string("(the value)") : path,
                       "' holds a NaN or Inf; lower the learning rate, clip gradients (optim::clip_by_global_norm) or check the inputs");
      }
    }
  }, flags);
}

/// raise_if_nonfinite(nonfinite_flags(tree), what): checks a tree (or a single tensor) now.
template <class Tree>
void check_finite(const Tree& tree, const std::string& what) {
  raise_if_nonfinite(nonfinite_flags(tree), what);
}

TG_END_NAMESPACE
