// Host memory for tensors: 64-byte aligned blocks, and a cache of freed large blocks by size, as the CUDA
// pool keeps freed device blocks. A training step allocates the same sizes every step; without the cache
// glibc returns large blocks to the system (or trims its heap) and every step pays a page fault per 4 KiB
// it touches again, how many depending on the order of earlier frees: the eager ViT step of
// bench_train_step ran 22 ms with its blocks reused and 25 to 32 ms without, from run to run.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tapegrad/config.hpp"

TG_BEGIN_NAMESPACE
namespace cpu {

namespace detail {

// Under AddressSanitizer every block goes back to the allocator at once, so that a use after free is
// still caught.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool cache_blocks = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool cache_blocks = false;
#else
inline constexpr bool cache_blocks = true;
#endif
#else
inline constexpr bool cache_blocks = true;
#endif

/// Freed blocks of at least `min_bytes`, by exact size, up to `max_bytes` in all (then freed as usual).
class BlockCache {
 public:
  static constexpr std::size_t alignment = 64;  // one cache line, a full AVX-512 vector
  static constexpr std::size_t min_bytes = std::size_t{1} << 16;
  static constexpr std::size_t max_bytes = std::size_t{1} << 31;

  /// The process's cache; never destroyed (tensors may be freed during static destruction).
  static BlockCache& instance() {
    static BlockCache* cache = new BlockCache;
    return *cache;
  }

  /// A block of `bytes` (a multiple of the alignment, > 0), or null when the system has none to give.
  void* allocate(std::size_t bytes) {
    if (cache_blocks && bytes >= min_bytes) {
      std::lock_guard lock(mutex_);
      if (auto it = free_.find(bytes); it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        note_allocated(bytes);
        return p;
      }
    }
    void* p = std::aligned_alloc(alignment, bytes);
    if (p == nullptr && release() > 0) p = std::aligned_alloc(alignment, bytes);  // the cache's blocks, given back, may make room
    if (p != nullptr) note_allocated(bytes);
    return p;
  }

  void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    in_use_.fetch_sub(bytes, std::memory_order_relaxed);
    if (cache_blocks && bytes >= min_bytes) {
      std::lock_guard lock(mutex_);
      if (cached_ + bytes <= max_bytes) {
        try {
          free_[bytes].push_back(p);
          cached_ += bytes;
          return;
        } catch (...) {  // no memory for the list itself: free the block instead
        }
      }
    }
    std::free(p);
  }

  /// Frees every cached block; returns the bytes given back.
  std::size_t release() noexcept {
    std::lock_guard lock(mutex_);
    const std::size_t given = cached_;
    for (auto& [bytes, blocks] : free_)
      for (void* p : blocks) std::free(p);
    free_.clear();
    cached_ = 0;
    return given;
  }

  std::size_t cached() {
    std::lock_guard lock(mutex_);
    return cached_;
  }

  /// Bytes of blocks held by tensors now, and the most held at once since the last reset_peak().
  std::size_t in_use() const { return in_use_.load(std::memory_order_relaxed); }
  std::size_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() { peak_.store(in_use(), std::memory_order_relaxed); }

 private:
  BlockCache() = default;
  void note_allocated(std::size_t bytes) {
    const std::size_t now = in_use_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::size_t seen = peak_.load(std::memory_order_relaxed);
    while (now > seen && !peak_.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  std::atomic<std::size_t> in_use_{0}, peak_{0};
  std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  std::size_t cached_ = 0;
};

}  // namespace detail

/// Bytes of freed host blocks tapegrad keeps for reuse (at most 2 GiB; blocks under 64 KiB are not kept).
inline std::size_t cached_memory() { return detail::BlockCache::instance().cached(); }

/// Gives every kept block back to the system (as a program might between phases); returns the bytes.
inline std::size_t release_cached_memory() { return detail::BlockCache::instance().release(); }

/// Bytes of host memory tensors hold now (their storage blocks, rounded up to the 64-byte alignment; the
/// cached free blocks not counted).
inline std::size_t memory_in_use() { return detail::BlockCache::instance().in_use(); }

/// The most host memory tensors held at once since the program started or the last reset_peak_memory():
/// what tg::checkpoint lowers (bench_vit_memory measures the ViT step with and without it).
inline std::size_t peak_memory() { return detail::BlockCache::instance().peak(); }
inline void reset_peak_memory() { detail::BlockCache::instance().reset_peak(); }

}  // namespace cpu
TG_END_NAMESPACE
