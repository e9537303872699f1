// Flushing subnormal floats to zero on the CPU (the SSE control register's FTZ and DAZ bits), in the
// calling thread and in every OpenMP worker thread, which is where tapegrad's loops and oneDNN's kernels
// run. XLA, and so JAX, computes on the CPU this way; tapegrad leaves the choice to the program, since the
// register is per-thread process state.
//
// Why it matters: x86 cores take a microcode assist, around a hundred cycles, for each subnormal operand
// or result. A training step whose activations underflow (GELU of a pre-activation below about -10 is
// ~1e-40) fed a GEMM that ran 5x slower than with the same values flushed (docs/performance.md).
#pragma once

#include "tapegrad/config.hpp"

#if defined(__SSE__) || defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define TG_HAVE_MXCSR 1
#endif

#include <omp.h>

TG_BEGIN_NAMESPACE
namespace cpu {

namespace detail {
inline constexpr unsigned flush_bits = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)

inline void set_flush_bits(bool on) {
#if defined(TG_HAVE_MXCSR)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | flush_bits) : (csr & ~flush_bits));
#else
  (void)on;
#endif
}
}  // namespace detail

/// True when the calling thread flushes subnormal floats to zero.
inline bool flushing_denormals() {
#if defined(TG_HAVE_MXCSR)
  return (_mm_getcsr() & detail::flush_bits) == detail::flush_bits;
#else
  return false;
#endif
}

/// Sets (or clears) flush-to-zero and denormals-are-zero in the calling thread and in every thread of the
/// OpenMP pool of omp_get_max_threads() threads. Results differ from IEEE only where a value, or an
/// intermediate, is below 1.2e-38 in magnitude: it becomes zero. No effect off x86.
inline void set_flush_denormals(bool on) {
  detail::set_flush_bits(on);
#pragma omp parallel
  detail::set_flush_bits(on);
}

/// Flushes subnormals for its lifetime (see set_flush_denormals) and restores the calling thread's
/// previous setting, in every pool thread, when it ends.
class FlushDenormals {
 public:
  FlushDenormals() : previous_(flushing_denormals()) { set_flush_denormals(true); }
  ~FlushDenormals() { set_flush_denormals(previous_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  bool previous_;
};

}  // namespace cpu
TG_END_NAMESPACE
