// The multi-tensor launcher (apex's multi_tensor_apply): one launch over chunks of many tensors, for the
// work that touches every leaf of a model (global norms, clipping, the optimizer's update, applying it).
// A group of up to Capacity tensors is passed to the kernel by value (no host-to-device copy, so the launch
// can be captured in a CUDA Graph); each chunk finds its tensor by a binary search over the groups' chunk
// offsets, and the functor runs on that chunk's elements.
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/runtime/dispatch.hpp"

TG_BEGIN_NAMESPACE
namespace detail {

/// The tensor holding chunk (or element) `flat` of n tensors laid end to end from first[0] = 0: the last
/// whose first is <= flat (a binary search, so empty tensors are passed over).
TG_HD inline int tensor_of(const std::int64_t* first, int n, std::int64_t flat) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= flat) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/// Up to Capacity tensors of element type T, each given as Depth pointers of the same length (AdamW: the
/// gradient, parameter and moments in, the moments and update out), with a flag per tensor the functor may
/// read (AdamW: whether the leaf decays).
template <class T, int Depth, int Capacity = 32>
struct TensorLists {
  static constexpr int depth = Depth, capacity = Capacity;
  int n = 0;
  std::int64_t chunk = 1;                 ///< elements per chunk (set by multi_tensor_apply)
  std::int64_t size[Capacity] = {};       ///< elements of each tensor
  std::int64_t first[Capacity + 1] = {};  ///< each tensor's first chunk; first[n] = the chunks in all
  T* ptr[Depth][Capacity] = {};
  bool flag[Capacity] = {};

  bool empty() const { return n == 0; }
  /// The chunks of `chunk` elements the tensors held make (a per-chunk output's length).
  std::int64_t chunks(std::int64_t chunk) const {
    std::int64_t c = 0;
    for (int k = 0; k < n; ++k) c += (size[k] + chunk - 1) / chunk;
    return c;
  }
  bool full() const { return n == Capacity; }
  /// Adds a tensor of `count` elements; returns full().
  bool add(const std::array<T*, Depth>& p, std::int64_t count, bool f = false) {
    for (int d = 0; d < Depth; ++d) ptr[d][n] = p[static_cast<std::size_t>(d)];
    size[n] = count, flag[n] = f;
    ++n;
    return full();
  }
};

/// One chunk of a launch: elements [begin, end) of tensor `tensor`; `index` counts the chunks of the launch.
struct Chunk {
  int tensor;
  std::int64_t begin, end, index;
};

template <class Lists, class F>
struct MultiTensorFn {
  Lists lists;
  F f;
  TG_HD void operator()(std::int64_t i) const {
    const int k = tensor_of(lists.first, lists.n, i);
    const std::int64_t begin = (i - lists.first[k]) * lists.chunk;
    const std::int64_t end = begin + lists.chunk < lists.size[k] ? begin + lists.chunk : lists.size[k];
    f(lists, Chunk{k, begin, end, i});
  }
};

/// Calls f(lists, chunk) for every chunk of `chunk` elements of every tensor in `lists` (a tensor's last
/// chunk may be shorter), in one launch on device D: an OpenMP loop over the chunks on the CPU, a thread
/// per chunk on CUDA. Returns the number of chunks (the length of a per-chunk output).
template <Device D, class Lists, class F>
std::int64_t multi_tensor_apply(std::int64_t chunk, Lists lists, const F& f) {
  lists.chunk = chunk;
  lists.first[0] = 0;
  for (int k = 0; k < lists.n; ++k) lists.first[k + 1] = lists.first[k] + (lists.size[k] + chunk - 1) / chunk;
  const std::int64_t chunks = lists.first[lists.n];
  if (chunks > 0) index_map<D>(chunks, MultiTensorFn<Lists, F>{lists, f}, chunk);
  return chunks;
}

/// partial[chunk] = the sum of squares of the chunk's elements, in index order (global_norm's first pass:
/// reproducible, as every chunk is summed by one thread in a fixed order).
struct SumSquaresFn {
  float* partial;
  template <class Lists>
  TG_HD void operator()(const Lists& l, const Chunk& c) const {
    const float* x = l.ptr[0][c.tensor];
    float s = 0.0f;
    for (std::int64_t i = c.begin; i < c.end; ++i) s += x[i] * x[i];
    partial[c.index] = s;
  }
};

/// multi_tensor_apply with D's elementwise chunk: for functors whose result does not depend on how the
/// elements are grouped.
template <Device D, class Lists, class F>
void multi_tensor_map(const Lists& lists, const F& f) {
  multi_tensor_apply<D>(elementwise_chunk<D>, lists, f);
}

}  // namespace detail
TG_END_NAMESPACE
