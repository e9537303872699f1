// tg::vmap: JAX's batching transformation. vmap(f, in_axes, out_axes)(args...) runs f once on whole
// batches: each argument's mapped axis becomes a batch axis (core/batching.hpp) that f's ops carry
// through their batching rules (beside each op's forward, in ops/), so a matmul of a batch is one GEMM,
// not a GEMM per example. Composes with grad (vmap(grad(f)) gives per-example gradients; grad of a
// function that calls vmap), with itself (nested levels), and with compile (the batched ops are what it
// records).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/autodiff/grad.hpp"
#include "tapegrad/core/batching.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/indexing.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE

/// How vmap maps one argument or output: along `axis` for every tensor leaf, not at all (std::nullopt,
/// JAX's None: the value is shared by every example), or leaf by leaf (VmapAxes::per_leaf, in the
/// order of tg::tree_leaves).
class VmapAxes {
 public:
  VmapAxes(int axis) : all_(axis) {}  // NOLINT: an int converts, as in_axes=0 does in JAX
  VmapAxes(std::nullopt_t) {}         // NOLINT: so does std::nullopt, JAX's None
  static VmapAxes per_leaf(std::vector<std::optional<int>> axes) {
    VmapAxes a(std::nullopt);
    a.leaves_ = std::move(axes);
    a.per_leaf_ = true;
    return a;
  }
  /// The axis of leaf `i` of `n`.
  std::optional<int> leaf(std::size_t i, std::size_t n, const char* what, std::size_t arg) const {
    if (!per_leaf_) return all_;
    TG_CHECK(leaves_.size() == n, "vmap", what, " ", arg, " has ", n, " tensor leaves but ", leaves_.size(),
             " per-leaf axes were given");
    return leaves_[i];
  }

 private:
  std::optional<int> all_;
  std::vector<std::optional<int>> leaves_;
  bool per_leaf_ = false;
};

namespace detail {

template <class X>
std::size_t tensor_leaf_count(X& x) {
  std::size_t n = 0;
  tree_for_each([&](const std::string&, auto& leaf) {
    if constexpr (is_tensor<std::remove_cvref_t<decltype(leaf)>>::value) ++n;
  }, x);
  return n;
}

/// Calls f(leaf, axis, path) for every tensor leaf of x with its axis from `axes`.
template <class X, class F>
void for_each_mapped_leaf(X& x, const VmapAxes& axes, const char* what, std::size_t arg, F&& f) {
  const std::size_t n = tensor_leaf_count(x);
  std::size_t i = 0;
  tree_for_each([&](const std::string& path, auto& leaf) {
    if constexpr (is_tensor<std::remove_cvref_t<decltype(leaf)>>::value) f(leaf, axes.leaf(i++, n, what, arg), path);
  }, x);
}

/// The batch axis of one leaf moved to its place among the batch axes, as level `bit`.
template <Element T, Device D>
Tensor<T, D> vmap_enter(const Tensor<T, D>& x, int axis, std::uint32_t bit) {
  const int nb = batch_rank(x.batch_levels());
  Tensor<T, D> p = x.physical();
  if (axis != 0) {
    std::vector<int> perm;
    for (int d = 0; d < nb; ++d) perm.push_back(d);
    perm.push_back(nb + axis);
    for (int d = 0; d < x.rank(); ++d)
      if (d != axis) perm.push_back(nb + d);
    p = transpose(p, std::span<const int>(perm));
  }
  return as_batched(p, x.batch_levels() | bit);
}

/// One output leaf with level `bit`'s batch axis moved to `axis` (or spread along it when the leaf does
/// not depend on the batch).
template <Element T, Device D>
Tensor<T, D> vmap_exit(const Tensor<T, D>& y, std::optional<int> axis, std::uint32_t bit, std::int64_t size, const std::string& path) {
  const bool mapped = (y.batch_levels() & bit) != 0;
  if (!axis) {
    TG_CHECK(!mapped, "vmap", "output ", path.empty() ? std::string("value") : path, " varies over the batch (per-example shape ",
             y.shape().str(), ") but its out_axes entry is std::nullopt; give it an axis");
    return y;
  }
  const int rank = y.rank() + 1;
  TG_CHECK(*axis >= -rank && *axis < rank, "vmap", "out_axes ", *axis, " is out of range for output ", path.empty() ? std::string("value") : path,
           " of per-example shape ", y.shape().str());
  const int a = *axis < 0 ? *axis + rank : *axis;
  if (!mapped) {  // the same for every example: spread along the new axis
    std::vector<std::int64_t> one(y.shape().dims().begin(), y.shape().dims().end()), full;
    one.insert(one.begin() + a, 1);
    full = one;
    full[static_cast<std::size_t>(a)] = size;
    return broadcast_to(y.reshape(Shape(one)), Shape(full));
  }
  const std::uint32_t rest = y.batch_levels() & ~bit;
  const int k = batch_rank(rest);  // `bit` is the innermost level: its axis follows the outer ones
  Tensor<T, D> p = y.physical();
  if (a != 0) {
    std::vector<int> perm;
    for (int d = 0; d < p.rank(); ++d)
      if (d != k) perm.push_back(d);
    perm.insert(perm.begin() + k + a, k);
    p = transpose(p, std::span<const int>(perm));
  }
  return as_batched(p, rest);
}

template <class X>
void vmap_size_of(const X& x, const VmapAxes& axes, std::size_t arg, std::optional<std::int64_t>& size, std::size_t& from) {
  if constexpr (Pytree<X>) {
    for_each_mapped_leaf(x, axes, "argument", arg, [&](const auto& leaf, std::optional<int> axis, const std::string& path) {
      if (!axis) return;
      TG_CHECK(leaf.defined(), "vmap", "argument ", arg, (path.empty() ? "" : " leaf "), path, " is undefined");
      TG_CHECK(leaf.rank() > 0 && *axis >= -leaf.rank() && *axis < leaf.rank(), "vmap", "in_axes ", *axis, " is out of range for argument ",
               arg, (path.empty() ? "" : " leaf "), path, " of shape ", leaf.shape().str());
      const std::int64_t n = leaf.dim(*axis);
      TG_CHECK(!size || *size == n, "vmap", "the mapped axes differ in size: ", *size, " (argument ", from, ") and ", n, " (argument ", arg,
               (path.empty() ? "" : " leaf "), path, ", shape ", leaf.shape().str(), ")");
      size = n, from = arg;
    });
  }
}

template <class X>
X vmap_enter_all(const X& x, const VmapAxes& axes, std::size_t arg, std::uint32_t bit) {
  if constexpr (Pytree<X>) {
    X y = x;
    for_each_mapped_leaf(y, axes, "argument", arg, [&](auto& leaf, std::optional<int> axis, const std::string&) {
      if (axis) leaf = vmap_enter(leaf, *axis < 0 ? *axis + leaf.rank() : *axis, bit);
    });
    return y;
  } else {
    return x;
  }
}

template <class Y>
Y vmap_exit_all(Y y, const std::vector<VmapAxes>& out_axes, std::uint32_t bit, std::int64_t size) {
  if constexpr (is_tuple_like<Y>::value) {
    if (out_axes.size() > 1) {
      TG_CHECK(out_axes.size() == std::tuple_size_v<Y>, "vmap", "out_axes has ", out_axes.size(), " entries for an output of ",
               std::tuple_size_v<Y>, " values");
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((std::get<I>(y) = vmap_exit_all(std::get<I>(y), std::vector<VmapAxes>{out_axes[I]}, bit, size)), ...);
      }(std::make_index_sequence<std::tuple_size_v<Y>>{});
      return y;
    }
  }
  TG_CHECK(out_axes.size() == 1, "vmap", "out_axes has ", out_axes.size(), " entries for an output that is one value");
  if constexpr (Pytree<Y>) {
    for_each_mapped_leaf(y, out_axes[0], "output", 0, [&](auto& leaf, std::optional<int> axis, const std::string& path) {
      leaf = vmap_exit(leaf, axis, bit, size, path);
    });
  }
  return y;
}

}  // namespace detail

/// vmap(f, in_axes, out_axes)(args...), as jax.vmap: f written for one example runs on a batch. Each
/// argument is mapped along its in_axes entry (an axis, std::nullopt for "shared by every example", or
/// VmapAxes::per_leaf for a pytree); one entry applies to every argument. Arguments that hold no tensor
/// (ints, options) pass through. The outputs (a tensor, a pytree, a pair or tuple of them; one entry of
/// out_axes per element of a tuple, or one for all) get the batch axis at out_axes. f's ops run batched
/// through their batching rules (docs/vmap.md lists them); an op without one is an error naming it.
template <class F>
auto vmap(F f, std::vector<VmapAxes> in_axes = {0}, std::vector<VmapAxes> out_axes = {0}) {
  return [f, in_axes = std::move(in_axes), out_axes = std::move(out_axes)](const auto&... args) mutable {
    constexpr std::size_t nargs = sizeof...(args);
    TG_CHECK(in_axes.size() == 1 || in_axes.size() == nargs, "vmap", "in_axes has ", in_axes.size(), " entries for ", nargs,
             " arguments (give one per argument, or one for all)");
    auto axes_of = [&](std::size_t i) -> const VmapAxes& { return in_axes.size() == 1 ? in_axes[0] : in_axes[i]; };
    std::optional<std::int64_t> size;
    std::size_t from = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (detail::vmap_size_of(args, axes_of(I), I, size, from), ...);
    }(std::index_sequence_for<decltype(args)...>{});
    TG_CHECK(size.has_value(), "vmap", "no argument is mapped (every in_axes entry is std::nullopt, or no argument holds a tensor)");
    auto out = [&] {
      detail::VmapLevel level(*size);
      const std::uint32_t bit = detail::VmapLevel::bit();
      auto batched_args = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return std::tuple{detail::vmap_enter_all(args, axes_of(I), I, bit)...};
      }(std::index_sequence_for<decltype(args)...>{});
      auto y = std::apply(f, batched_args);
      return std::pair{std::move(y), bit};
    }();
    return detail::vmap_exit_all(std::move(out.first), out_axes, out.second, *size);
  };
}

TG_END_NAMESPACE
