// CUDA launch helpers: a grid-stride kernel that runs the same TG_HD functors as the CPU loops.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tapegrad/config.hpp"

#if defined(TG_CUDA_KERNELS)
#include "tapegrad/backend/cuda/context.hpp"

namespace tg::inline TG_ABI::cuda {

template <class F>
__global__ void index_map_kernel(std::int64_t n, F f) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

/// Calls f(i) for i in [0, n) on the library's stream; f must be a TG_HD functor held by value.
template <class F>
void index_map(std::int64_t n, const F& f) {
  if (n == 0) return;
  constexpr int threads = 256;
  // Enough blocks to fill any current GPU several times over; the grid-stride loop covers the rest.
  const std::int64_t blocks = std::min<std::int64_t>((n + threads - 1) / threads, 65536);
  index_map_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream()>>>(n, f);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    detail::throw_launch(err, "index_map_kernel", detail::type_name<F>(), n, blocks, threads, __FILE__, __LINE__);
}

}  // namespace tg::cuda
#endif
