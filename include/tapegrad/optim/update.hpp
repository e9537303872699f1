// apply_updates (optax.apply_updates): params + updates, leaf by leaf, in the parameters' dtype.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/multi_tensor.hpp"
#include "tapegrad/optim/base.hpp"

TG_BEGIN_NAMESPACE
namespace optim {

namespace detail {

/// out = p + u over a chunk of one leaf, in the compute type, rounded once (tg::add's arithmetic).
struct AddUpdatesFn {
  template <class Lists>
  TG_HD void operator()(const Lists& l, const ::tg::detail::Chunk& c) const {
    range(c.begin, c.end, l.ptr[0][c.tensor], l.ptr[1][c.tensor], l.ptr[2][c.tensor]);
  }
  template <class T>
  TG_HOST_NOINLINE TG_HD static void range(std::int64_t begin, std::int64_t end, const T* __restrict p, const T* __restrict u,
                                           T* __restrict out) {
    using C = compute_t<T>;
    for (std::int64_t i = begin; i < end; ++i)
      out[i] = ::tg::detail::convert_to<T>(::tg::detail::convert_from<C>(p[i]) + ::tg::detail::convert_from<C>(u[i]));
  }
};

}  // namespace detail

/// params + updates, leaf by leaf, in the parameters' dtype (optax.apply_updates): one launch per 32 leaves
/// of a dtype, or tg::add per leaf where the tape records (the sum is then differentiable) or under tg::vmap
/// (add's batching rule: an ensemble's members each updated).
template <class Params>
Params apply_updates(const Params& params, const Params& updates) {
  using D = tree_device_t<Params>;
  bool traced = false;
  tree_for_each_tensor([&](std::size_t, const std::string& path, const auto& p, const auto& u) {
    TG_CHECK(p.shape() == u.shape(), "apply_updates", "update of shape ", u.shape().str(), " for the parameter '", path, "' of shape ",
             p.shape().str());
    traced = traced || ::tg::detail::recording(p, u) || ::tg::detail::batched(p, u);
  }, params, updates);
  if (traced) {
    return tree_map([](const auto& p, const auto& u) {
      if constexpr (FloatElement<typename std::remove_cvref_t<decltype(p)>::value_type>) return add(p, u);
      else return p;
    }, params, updates);
  }
  std::tuple<::tg::detail::TensorLists<float, 3>, ::tg::detail::TensorLists<double, 3>, ::tg::detail::TensorLists<bf16, 3>> lists;
  auto run = [](auto& group) {
    if (!group.empty()) ::tg::detail::multi_tensor_map<D>(group, detail::AddUpdatesFn{});
    group = {};
  };
  Params out = params;
  tree_for_each_tensor([&](std::size_t, const std::string&, auto& o, const auto& p, const auto& u) {
    using L = std::remove_cvref_t<decltype(o)>;
    using T = typename L::value_type;
    if constexpr (FloatElement<T>) {
      o = L(p.shape());
      auto& group = std::get<::tg::detail::TensorLists<T, 3>>(lists);
      if (group.add({p.data(), u.data(), o.data()}, p.size())) run(group);
    }
  }, out, params, updates);
  std::apply([&](auto&... group) { (run(group), ...); }, lists);
  return out;
}

}  // namespace optim
TG_END_NAMESPACE
