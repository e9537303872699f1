// CPU loops: an OpenMP parallel loop over element indices that runs a TG_HD functor, a parallel copy, and
// the f32 <-> bf16 conversions as loops the compiler vectorises. The library's OpenMP lives here.
#pragma once

#include "tapegrad/config.hpp"
#include "tapegrad/base/bf16.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <omp.h>

TG_BEGIN_NAMESPACE
namespace cpu {

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

/// f32 -> bf16 (round to nearest even, every NaN to the canonical NaN) and back, bitwise the scalar
/// conversions of base/bf16.hpp, as plain loops the compiler vectorises.
inline void convert(std::int64_t n, const float* __restrict x, bf16* __restrict y) {
  auto* out = reinterpret_cast<std::uint16_t*>(y);
#pragma omp parallel for simd schedule(static) if (n >= (std::int64_t{1} << 15))
  for (std::int64_t i = 0; i < n; ++i) out[i] = ::tg::detail::float_to_bf16_bits(x[i]);
}
inline void convert(std::int64_t n, const bf16* __restrict x, float* __restrict y) {
  const auto* in = reinterpret_cast<const std::uint16_t*>(x);
#pragma omp parallel for simd schedule(static) if (n >= (std::int64_t{1} << 15))
  for (std::int64_t i = 0; i < n; ++i) y[i] = ::tg::detail::bf16_bits_to_float(in[i]);
}

/// The OpenMP threads the CPU loops and oneDNN use (OMP_NUM_THREADS, or one per core).
inline int threads() { return omp_get_max_threads(); }

}  // namespace cpu
TG_END_NAMESPACE
