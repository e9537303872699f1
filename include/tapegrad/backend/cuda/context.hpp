// The library's CUDA stream and stream-ordered memory pool, one of each per device, created on first use.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "tapegrad/backend/cuda/check.hpp"
#include "tapegrad/core/device.hpp"

namespace tg::cuda {

namespace detail {

struct DeviceContext {
  cudaStream_t stream = nullptr;
  cudaMemPool_t pool = nullptr;
};

/// Per-device stream and pool. Streams are never destroyed: tensors may be freed during static
/// destruction, after any destructor of ours would have run.
inline DeviceContext& context(int device) {
  static std::mutex mutex;
  static std::vector<DeviceContext> contexts;
  std::lock_guard lock(mutex);
  if (contexts.empty()) contexts.resize(static_cast<std::size_t>(device_count()));
  TG_CHECK(device >= 0 && static_cast<std::size_t>(device) < contexts.size(), "cuda::context",
           "device index ", device, " is out of range: ", contexts.size(), " device(s)");
  DeviceContext& ctx = contexts[static_cast<std::size_t>(device)];
  if (ctx.stream == nullptr) {
    int previous = 0;
    TG_CUDA_CHECK(cudaGetDevice(&previous));
    TG_CUDA_CHECK(cudaSetDevice(device));
    TG_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx.stream, cudaStreamNonBlocking));
    TG_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&ctx.pool, device));
    // Keep freed blocks in the pool instead of returning them to the driver at every synchronisation:
    // a training step then allocates from cached memory, and allocation inside graph capture is legal.
    std::uint64_t threshold = UINT64_MAX;
    TG_CUDA_CHECK(cudaMemPoolSetAttribute(ctx.pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    TG_CUDA_CHECK(cudaSetDevice(previous));
  }
  return ctx;
}

}  // namespace detail

/// The library's (non-blocking) stream on the current device; all tapegrad CUDA work is ordered on it.
inline cudaStream_t stream() {
  require_device("cuda::stream");
  return detail::context(current_device()).stream;
}

/// Waits until all tapegrad work queued on the current device has finished.
inline void synchronize() { TG_CUDA_CHECK(cudaStreamSynchronize(stream())); }

/// Allocates `bytes` on `device` from its stream-ordered pool; out of memory is a tg::Error with sizes.
inline void* allocate(std::size_t bytes, int device) {
  detail::DeviceContext& ctx = detail::context(device);
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes, ctx.stream);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    std::size_t free = 0, total = 0;
    (void)cudaMemGetInfo(&free, &total);
    ::tg::detail::fail("cuda::allocate", "out of memory allocating ", bytes, " bytes on cuda:", device, " (",
                       free, " of ", total, " bytes free); use smaller batches or free tensors first");
  }
  TG_CUDA_CHECK(err);
  return p;
}

/// Returns `p` to its device's pool, ordered after all work queued so far on the library's stream.
inline void deallocate(void* p, int device) noexcept {
  if (p == nullptr) return;
  // A destructor cannot throw; a failure here means the context is already gone (process exit).
  if (cudaFreeAsync(p, detail::context(device).stream) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace tg::cuda
