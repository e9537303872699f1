// CUDA launches: a grid-stride kernel that runs the same TG_HD functors as the CPU loops, and the check
// that reports an index out of range found on the device. Each entry point exists in every configuration:
// a translation unit that cannot launch kernels gets a compile error (a host-only file of a CUDA build) or
// the one run-time error of a build without CUDA (cuda::not_compiled_in).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tapegrad/config.hpp"
#include "tapegrad/runtime/device.hpp"

#if defined(TG_WITH_CUDA)
#include "tapegrad/runtime/cuda/context.hpp"
#endif

TG_BEGIN_NAMESPACE
namespace cuda {

namespace detail {
template <class F>
inline constexpr bool needs_nvcc = !cuda_kernels;

/// Reports the first index outside [0, limit) to the device's error slot (raised at the next sync).
struct IndexCheckFn {
  const std::int32_t* index;
  std::int64_t limit;
  const char* op;
  void* slot;  // a DeviceError*, in mapped host memory
  TG_HD void operator()(std::int64_t i) const {
    const std::int32_t v = index[i];
    if (v >= 0 && v < limit) return;
#if defined(__CUDA_ARCH__) && defined(TG_WITH_CUDA)
    auto* e = static_cast<DeviceError*>(slot);
    if (atomicCAS(&e->code, 0, 1) == 0) {
      e->value = v, e->position = i, e->limit = limit, e->op = op;
      __threadfence_system();
    }
#endif
  }
};
}  // namespace detail

#if defined(TG_CUDA_KERNELS)
template <class F>
__global__ void index_map_kernel(std::int64_t n, F f) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

#endif

/// Calls f(i) for i in [0, n) on the library's stream; f must be a TG_HD functor held by value.
template <class F>
void index_map(std::int64_t n, const F& f) {
#if defined(TG_CUDA_KERNELS)
  if (n == 0) return;
  constexpr int threads = 256;
  // Enough blocks to fill any current GPU several times over; the grid-stride loop covers the rest.
  const std::int64_t blocks = std::min<std::int64_t>((n + threads - 1) / threads, 65536);
  index_map_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream()>>>(n, f);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    detail::throw_launch(err, "index_map_kernel", detail::type_name<F>(), n, blocks, threads, __FILE__, __LINE__);
#elif defined(TG_WITH_CUDA)
  static_assert(!detail::needs_nvcc<F>,
                "tapegrad: this CUDA work launches kernels, so this file must be compiled by nvcc "
                "(a .cu file, or set_source_files_properties(... LANGUAGE CUDA))");
#else
  (void)n, (void)f;
  not_compiled_in("cuda kernel");
#endif
}

/// Rejects values of index[0, n) outside [0, limit) without synchronising: a kernel reports the first one
/// to the device's error slot, and the next synchronisation raises it naming `op` (docs/cuda.md).
template <class Index = std::int32_t>
void check_indices(const Index* index, std::int64_t n, std::int64_t limit, const char* op) {
#if defined(TG_CUDA_KERNELS)
  index_map(n, detail::IndexCheckFn{index, limit, op, error_slot()});
#else
  index_map(n, detail::IndexCheckFn{index, limit, op, nullptr});
#endif
}

}  // namespace cuda
TG_END_NAMESPACE
