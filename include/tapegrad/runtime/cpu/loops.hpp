// CPU loops: an OpenMP parallel loop over element indices that runs a TG_HD functor, a parallel copy, and
// the f32 <-> bf16 conversions as loops the compiler vectorises. The library's OpenMP lives here.
#pragma once

#include "tapegrad/config.hpp"
#include "tapegrad/base/bf16.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include <omp.h>

TG_BEGIN_NAMESPACE
namespace cpu {

// The loops below are where every CPU kernel's functor runs, so they decide its instruction set. A
// library user's build rarely names one (no -march), which leaves x86-64's SSE2: 4 floats per vector. So
// on x86-64 each loop is also compiled for AVX2 and (with GCC) AVX-512 F/VL/BW/DQ, the functor inlined into
// each ([[gnu::flatten]]), and the CPU picks one at run time, once per process: the vectors -march=native
// would give, in a binary that runs anywhere. Without contracting a * b + c into an FMA (GCC:
// fp-contract=off; Clang, which cannot turn it off per function, gets AVX2 without FMA and no AVX-512),
// and with no reassociation (none is allowed without -ffast-math), so every level computes the same bits.
// Skipped where the build already targets AVX-512 (the plain loop is that), under nvcc (whose CUDA
// binaries run their CPU work rarely and compile slowly enough), under AddressSanitizer (the same functors
// run in the plain loop, and the sanitized build stays within CI's time) and off x86-64. TG_CPU_ISA=baseline|avx2
// caps the choice, for comparing.
// (TG_CPU_MULTI_ISA itself is decided in config.hpp.)
#if TG_CPU_MULTI_ISA && !defined(__clang__)
#define TG_CPU_AVX512 1
#define TG_CPU_LOOP_ATTRIBUTES(isa) [[gnu::flatten]] __attribute__((target(isa), optimize("fp-contract=off")))
#define TG_CPU_AVX2_ISA "avx2,fma,bmi,bmi2,popcnt"
#else
#define TG_CPU_AVX512 0
#define TG_CPU_LOOP_ATTRIBUTES(isa) [[gnu::flatten]] __attribute__((target(isa)))
#define TG_CPU_AVX2_ISA "avx2,bmi,bmi2,popcnt"
#endif

enum class Isa { baseline, avx2, avx512 };

#if TG_CPU_MULTI_ISA
/// The instruction set the loops run with: the best this CPU has (and the build can use), capped by
/// TG_CPU_ISA.
inline Isa isa() {
  static const Isa chosen = [] {
    __builtin_cpu_init();
    Isa best = Isa::baseline;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
      best = Isa::avx2;
    if (TG_CPU_AVX512 && best == Isa::avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
      best = Isa::avx512;
    if (const char* cap = std::getenv("TG_CPU_ISA")) {
      const std::string_view c = cap;
      best = std::min(best, c == "baseline" ? Isa::baseline : c == "avx2" ? Isa::avx2 : Isa::avx512);
    }
    return best;
  }();
  return chosen;
}

template <class F>
TG_CPU_LOOP_ATTRIBUTES(TG_CPU_AVX2_ISA) void run_avx2(std::int64_t begin, std::int64_t end, const F& f) {
  for (std::int64_t i = begin; i < end; ++i) f(i);
}
#if TG_CPU_AVX512
template <class F>
TG_CPU_LOOP_ATTRIBUTES("avx512f,avx512vl,avx512bw,avx512dq," TG_CPU_AVX2_ISA) void run_avx512(std::int64_t begin, std::int64_t end, const F& f) {
  for (std::int64_t i = begin; i < end; ++i) f(i);
}
#endif
#else
inline Isa isa() { return Isa::baseline; }
#endif

/// f(i) for i in [begin, end) on this thread, with the loop's instruction set.
template <class F>
void run_range(std::int64_t begin, std::int64_t end, const F& f) {
#if TG_CPU_MULTI_ISA
  switch (isa()) {
#if TG_CPU_AVX512
    case Isa::avx512: return run_avx512(begin, end, f);
#else
    case Isa::avx512:
#endif
    case Isa::avx2: return run_avx2(begin, end, f);
    case Isa::baseline: break;
  }
#endif
  for (std::int64_t i = begin; i < end; ++i) f(i);
}

/// Calls f(i) for i in [0, n), in parallel when the work, n * work_per_item element operations, is large
/// enough to pay for the threads: each thread a contiguous share (OpenMP's static schedule).
template <class F>
void index_map(std::int64_t n, const F& f, std::int64_t work_per_item = 1) {
  constexpr std::int64_t parallel_threshold = 1 << 15;
  if (n < 2 || n * work_per_item < parallel_threshold) {
    run_range(0, n, f);
    return;
  }
#pragma omp parallel
  {
    const std::int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const std::int64_t share = n / threads, extra = n % threads;
    const std::int64_t begin = t * share + std::min(t, extra);
    run_range(begin, begin + share + (t < extra ? 1 : 0), f);
  }
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
