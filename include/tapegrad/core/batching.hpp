// What tg::vmap's batching rules share: the stack of active vmap levels and the views that line a
// batched tensor up with its operands. A batched Tensor (core/tensor.hpp) stores every example, the
// batch axes first (one per level it is batched at, outermost first); an op's batching rule runs the op
// once on those physical tensors, moving its axes past the batch axes, and marks the result batched.
// So a batched op is one kernel (a matmul one GEMM), it records on the tape as the physical op, and
// compile records it as it records anything else. The rules sit beside each op's forward (ops/); the
// transformation itself is autodiff/vmap.hpp.
#pragma once

#include <bit>
#include <cstdint>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/base/shape.hpp"
#include "tapegrad/core/tensor.hpp"

TG_BEGIN_NAMESPACE
namespace detail {

/// The batch size of each tg::vmap level active on this thread, outermost first (level d is bit d of a
/// tensor's batch_levels()).
inline thread_local std::vector<std::int64_t> vmap_sizes;

/// Opens a vmap level of `size` for a scope (tg::vmap's body runs inside one).
class VmapLevel {
 public:
  explicit VmapLevel(std::int64_t size) {
    TG_CHECK(vmap_sizes.size() < 8, "vmap", "at most 8 nested vmap levels are supported");
    vmap_sizes.push_back(size);
  }
  ~VmapLevel() { vmap_sizes.pop_back(); }
  VmapLevel(const VmapLevel&) = delete;
  VmapLevel& operator=(const VmapLevel&) = delete;
  static std::uint32_t bit() { return std::uint32_t{1} << (vmap_sizes.size() - 1); }
};

/// Every level active now, as a mask.
inline std::uint32_t active_levels() { return (std::uint32_t{1} << vmap_sizes.size()) - 1; }

inline int batch_rank(std::uint32_t levels) { return std::popcount(levels); }

/// True when any of `xs` is batched: the one check an op pays outside vmap.
template <class... Ts>
bool batched(const Ts&... xs) {
  return ((xs.batch_levels() != 0) || ...);
}

template <class... Ts>
std::uint32_t levels_of(const Ts&... xs) {
  return (xs.batch_levels() | ...);
}

/// The sizes of the batch axes of `levels`, outermost first.
inline std::vector<std::int64_t> batch_dims(std::uint32_t levels) {
  std::vector<std::int64_t> dims;
  for (std::size_t d = 0; d < vmap_sizes.size(); ++d)
    if (levels & (std::uint32_t{1} << d)) dims.push_back(vmap_sizes[d]);
  TG_CHECK(static_cast<int>(dims.size()) == batch_rank(levels), "vmap",
           "a tensor batched by a tg::vmap that has returned reached an op (a batched value kept past its vmap, as "
           "JAX's leaked tracers); return it from the vmapped function instead");
  return dims;
}

/// A per-example shape with the batch axes of `levels` in front: the physical shape of a batched result.
inline Shape with_batch(std::uint32_t levels, const Shape& per_example, const char* op) {
  std::vector<std::int64_t> dims = batch_dims(levels);
  dims.insert(dims.end(), per_example.dims().begin(), per_example.dims().end());
  TG_CHECK(static_cast<int>(dims.size()) <= Shape::max_rank, op, "inside tg::vmap, shape ", per_example.str(), " and ",
           batch_rank(levels), " batch axes exceed the maximum rank ", Shape::max_rank);
  return Shape(dims);
}

/// x's storage seen by an op batched at `levels` whose per-example operands have rank `rank`: an axis
/// per level (size 1 where x is not batched at it), then x's per-example axes with 1s in front up to
/// `rank`, so NumPy broadcasting lines each example up with its own. An unbatched x is returned as it
/// is: broadcasting aligns it from the right already (and the ops keep their fast paths for it).
template <Element T, Device D>
Tensor<T, D> aligned(const Tensor<T, D>& x, std::uint32_t levels, int rank) {
  if (x.batch_levels() == 0) return x;
  const Tensor<T, D> p = x.physical();
  const int nb = batch_rank(x.batch_levels());
  std::vector<std::int64_t> dims;
  int next = 0;
  for (int d = 0; d < 32; ++d) {
    const std::uint32_t bit = std::uint32_t{1} << d;
    if (!(levels & bit)) continue;
    dims.push_back((x.batch_levels() & bit) ? p.dim(next++) : 1);
  }
  for (int i = x.rank(); i < rank; ++i) dims.push_back(1);
  for (int i = nb; i < p.rank(); ++i) dims.push_back(p.dim(i));
  TG_CHECK(static_cast<int>(dims.size()) <= Shape::max_rank, "vmap", "a per-example rank of ", rank, " with ", batch_rank(levels),
           " batch axes exceeds the maximum rank ", Shape::max_rank);
  const Shape s(dims);
  return s == p.shape() ? p : p.reshape(s);
}

/// The physical axis of per-example axis `axis` of a tensor batched at `levels`.
inline int physical_axis(std::uint32_t levels, const Shape& per_example, int axis, const char* op) {
  return batch_rank(levels) + per_example.normalize_axis(axis, op);
}

/// The result of an op run on physical operands, batched at `levels`.
template <Element T, Device D>
Tensor<T, D> as_batched(const Tensor<T, D>& physical, std::uint32_t levels) {
  return Tensor<T, D>::batched(physical, levels);
}

}  // namespace detail
TG_END_NAMESPACE
