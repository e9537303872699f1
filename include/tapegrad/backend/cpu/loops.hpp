// CPU loops: an OpenMP parallel loop over element indices that runs a TG_HD functor, and a parallel copy.
#pragma once

#include "tapegrad/config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <omp.h>

namespace tg::inline TG_ABI::cpu {

/// Calls f(i) for i in [0, n), in parallel when the work, n * work_per_item element operations, is large
/// enough to pay for the threads.
template <class F>
void index_map(std::int64_t n, const F& f, std::int64_t work_per_item = 1) {
  constexpr std::int64_t parallel_threshold = 1 << 15;
  if (n < 2 || n * work_per_item < parallel_threshold) {
    for (std::int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

/// memcpy, split among the OpenMP threads when large enough for two cores' bandwidth to pay.
inline void copy(void* dst, const void* src, std::size_t bytes) {
  constexpr std::size_t parallel_bytes = std::size_t{1} << 18;
  if (bytes < parallel_bytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
#pragma omp parallel
  {
    const auto threads = static_cast<std::size_t>(omp_get_num_threads());
    const std::size_t part = (bytes / threads + 63) / 64 * 64;
    const std::size_t begin = std::min(bytes, part * static_cast<std::size_t>(omp_get_thread_num()));
    const std::size_t end = std::min(bytes, begin + part);
    if (end > begin) std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
  }
}

}  // namespace tg::cpu
