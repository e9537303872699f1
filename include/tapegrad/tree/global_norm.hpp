// global_norm: the square root of the sum of squares of a whole tree's floating leaves, computed on the
// leaves' device in a few launches (the multi-tensor launcher, ops/multi_tensor.hpp) and a fixed order.
#pragma once

#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/indexing.hpp"
#include "tapegrad/ops/multi_tensor.hpp"
#include "tapegrad/ops/reduce.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE

/// sqrt of the sum of squares of every floating leaf, as a 0-d tensor on the leaves' device (optax's
/// global_norm), of the type JAX's sum of the leaves' sums would have (tree_float_t: double for a tree with
/// a double leaf, float with a float one, bf16 for bf16 alone). Computed on the device, with no host
/// synchronisation: double leaves in double; float leaves in float, one launch per 64 leaves (sums of
/// squares of 256-element chunks, each in index order) and one sum of the chunks' results, in order: a few
/// kernels for a whole model instead of several per leaf, and the same bits on every device; bf16 leaves
/// squared and summed in float. The float total joins the double one in double, as JAX promotes.
template <class Tree>
Tensor<tree_float_t<Tree>, tree_device_t<Tree>> global_norm(const Tree& tree) {
  using D = tree_device_t<Tree>;
  using R = tree_float_t<Tree>;
  using Acc = std::conditional_t<std::is_same_v<R, double>, double, float>;  // the total's type: float for bf16 trees
  if (tree_batch_levels(tree)) {  // batching rule (jax.vmap(optax.global_norm)): each example's norm, one pass over each leaf
    Tensor<Acc, D> total = zeros<Acc, D>(Shape{});
    tree_for_each_tensor([&](std::size_t, const std::string&, const auto& leaf) {
      using T = typename std::remove_cvref_t<decltype(leaf)>::value_type;
      if constexpr (FloatElement<T>) {
        if (!leaf.batch_levels()) {  // shared by every example
          total = add(total, cast<Acc>(sum(square(cast<compute_t<T>>(leaf)))));
          return;
        }
        const auto p = leaf.physical().untraced();
        const std::int64_t n = leaf.size(), rows = n ? p.size() / n : 0;
        const auto sq = detail::reduce_rows_as_all<detail::SumSquaresReducer, detail::SumReducer>(p.reshape(Shape{rows, n}), "global_norm");
        total = add(total, detail::as_batched(cast<Acc>(sq).reshape(Shape(p.shape().dims().first(static_cast<std::size_t>(detail::batch_rank(leaf.batch_levels()))))),
                                              leaf.batch_levels()));
      }
    }, tree);
    return cast<R>(sqrt(total));
  }
  constexpr std::int64_t chunk = 256;
  Tensor<double, D> total64;
  Tensor<float, D> total = zeros<float, D>(Shape{});
  std::vector<Tensor<float, D>> partials;
  detail::TensorLists<float, 1, 64> lists;
  auto flush = [&] {
    if (lists.empty()) return;
    Tensor<float, D> partial(Shape{lists.chunks(chunk)});
    if (partial.size() > 0) detail::multi_tensor_apply<D>(chunk, lists, detail::SumSquaresFn{partial.data()});
    partials.push_back(partial);
    lists = {};
  };
  tree_for_each_tensor([&](std::size_t, const std::string&, const auto& leaf) {
    using T = typename std::remove_cvref_t<decltype(leaf)>::value_type;
    if constexpr (std::is_same_v<T, double>) {
      const auto s = sum(square(leaf));
      total64 = total64.defined() ? add(total64, s) : s;
    } else if constexpr (std::is_same_v<T, float>) {
      if (lists.add({leaf.data()}, leaf.size())) flush();
    } else if constexpr (FloatElement<T>) {
      total = add(total, sum(square(cast<float>(leaf))));
    }
  }, tree);
  flush();
  if (partials.size() == 1) total = add(total, sum(partials[0]));
  else if (!partials.empty()) total = add(total, sum(concatenate(std::span<const Tensor<float, D>>(partials))));
  if constexpr (std::is_same_v<R, double>) {
    return sqrt(total64.defined() ? add(total64, cast<double>(total)) : cast<double>(total));
  } else {
    return cast<R>(sqrt(total));
  }
}

TG_END_NAMESPACE
