// Storage: an owned, aligned block of memory on one device, and copies between devices.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/runtime/device.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/runtime/cpu/allocator.hpp"
#include "tapegrad/runtime/cpu/loops.hpp"

#if defined(TG_WITH_CUDA)
#include "tapegrad/runtime/cuda/context.hpp"
#endif

TG_BEGIN_NAMESPACE

/// Bytes on device D. CPU blocks are 64-byte aligned (one cache line, a full AVX-512 vector) and large
/// ones are reused once freed (runtime/cpu/allocator.hpp); CUDA blocks come from the stream-ordered pool
/// of the device that was current at allocation.
template <Device D>
class Storage {
 public:
  static constexpr std::size_t cpu_alignment = cpu::detail::BlockCache::alignment;

  explicit Storage(std::size_t bytes) : bytes_(bytes) {
    if constexpr (std::is_same_v<D, Cpu>) {
      data_ = cpu::detail::BlockCache::instance().allocate(padded(bytes));
      if (data_ == nullptr)
        ::tg::detail::fail("cpu::allocate", "out of memory allocating ", bytes, " bytes (", static_cast<double>(bytes) / (1 << 20),
                           " MiB); use smaller batches or free tensors first");
    } else {
      cuda::require_device("cuda::allocate");
#if defined(TG_WITH_CUDA)
      device_ = cuda::current_device();
      if (bytes > 0) data_ = cuda::allocate(bytes, device_);
#endif
    }
  }

  ~Storage() {
    if constexpr (std::is_same_v<D, Cpu>) {
      cpu::detail::BlockCache::instance().deallocate(data_, padded(bytes_));
    } else {
#if defined(TG_WITH_CUDA)
      cuda::deallocate(data_, device_);
#endif
    }
  }

  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  /// The CUDA device index holding this block (-1 for host memory).
  int device() const { return device_; }

  /// Exchanges the blocks of two storages of the same size (compile() uses it to hand a caller a copy
  /// of a buffer its plan is about to overwrite, keeping the address the plan was recorded with).
  friend void swap_blocks(Storage& a, Storage& b) noexcept {  // sizes travel with their blocks
    std::swap(a.data_, b.data_);
    std::swap(a.bytes_, b.bytes_);
    std::swap(a.device_, b.device_);
  }

 private:
  /// The size of a CPU block: a multiple of the alignment (aligned_alloc's rule), never 0.
  static std::size_t padded(std::size_t bytes) {
    const std::size_t p = (bytes + cpu_alignment - 1) / cpu_alignment * cpu_alignment;
    return p == 0 ? cpu_alignment : p;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
};

namespace detail {

/// Copies `bytes` from `src` on device S to `dst` on device Dst. A copy to the host returns when the data
/// has arrived; copies to the device are ordered on the library's stream.
template <Device Dst, Device Src>
void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if constexpr (std::is_same_v<Dst, Cpu> && std::is_same_v<Src, Cpu>) {
    cpu::copy(dst, src, bytes);
  } else {
#if defined(TG_WITH_CUDA)
    const cudaMemcpyKind kind = std::is_same_v<Src, Cpu>   ? cudaMemcpyHostToDevice
                                : std::is_same_v<Dst, Cpu> ? cudaMemcpyDeviceToHost
                                                           : cudaMemcpyDeviceToDevice;
    TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, cuda::stream()));
    // Host memory handed to us is pageable and may be freed as soon as we return, so both directions
    // wait. A read back to the host also raises what kernels found in the data (cuda::synchronize); a
    // transfer to the device leaves it for the next read, as it concerns earlier work (docs/cuda.md).
    if (kind == cudaMemcpyDeviceToHost) cuda::synchronize();
    else if (kind == cudaMemcpyHostToDevice) cuda::wait();
#else
    cuda::require_device("copy");
#endif
  }
}

}  // namespace detail
TG_END_NAMESPACE
