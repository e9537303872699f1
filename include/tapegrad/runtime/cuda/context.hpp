// The library's CUDA stream and stream-ordered memory pool, one of each per device, created on first use.
#pragma once

#include <cstdint>
#include <mutex>
#include <new>
#include <vector>

#include "tapegrad/config.hpp"

#if defined(TG_WITH_CUDA)
#include "tapegrad/runtime/cuda/check.hpp"
#include "tapegrad/runtime/device.hpp"

TG_BEGIN_NAMESPACE
namespace cuda {

/// An error a kernel found in the data (a label out of range). The first failing thread fills it in,
/// in mapped host memory, and the next synchronisation raises it as a tg::Error: kernels cannot throw,
/// and checking on the host would need a synchronisation inside every step.
struct DeviceError {
  int code = 0;  ///< 0: none; 1: a value out of [0, limit)
  long long value = 0, position = 0, limit = 0;
  const char* op = nullptr;  ///< a string literal in host memory (not dereferenced on the device)
};

namespace detail {

struct DeviceContext {
  cudaStream_t stream = nullptr;
  cudaMemPool_t pool = nullptr;
  DeviceError* error = nullptr;  ///< host address; the same address on the device (unified addressing)
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
    void* error = nullptr;
    TG_CUDA_CHECK(cudaHostAlloc(&error, sizeof(DeviceError), cudaHostAllocMapped));
    ctx.error = new (error) DeviceError{};
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

/// Where kernels on the current device report bad data (see DeviceError).
inline DeviceError* error_slot() {
  require_device("cuda::error_slot");
  return detail::context(current_device()).error;
}

/// Raises (and clears) an error a kernel reported; call after a synchronisation.
inline void raise_device_error() {
  DeviceError* e = detail::context(current_device()).error;
  if (e->code == 0) return;
  const DeviceError found = *e;
  *e = DeviceError{};
  ::tg::detail::fail(found.op ? found.op : "cuda", "label ", found.value, " at position ", found.position,
                     " is out of range for ", found.limit, " classes; labels must be in [0, ", found.limit,
                     ") (found on the device, reported at the next synchronisation)");
}

/// Waits until all tapegrad work queued on the current device has finished, without raising what kernels
/// found in the data (a transfer to the device waits so the caller may free its host buffer).
inline void wait() { TG_CUDA_CHECK(cudaStreamSynchronize(stream())); }

/// Waits until all tapegrad work queued on the current device has finished, then raises, once, the first
/// error a kernel found in the data since the last raise (a label out of range): see docs/cuda.md.
/// Host reads (item, to_vector, at, printing, a copy to the CPU) do the same.
inline void synchronize() {
  wait();
  raise_device_error();
}

/// Allocates `bytes` on `device` from its stream-ordered pool; out of memory is a tg::Error with sizes.
inline void* allocate(std::size_t bytes, int device) {
  detail::DeviceContext& ctx = detail::context(device);
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes, ctx.stream);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    std::size_t free = 0, total = 0;
    (void)cudaMemGetInfo(&free, &total);
    throw Error(detail::out_of_memory_message(bytes, device, free, total));
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

}  // namespace cuda
TG_END_NAMESPACE
#endif  // TG_WITH_CUDA
