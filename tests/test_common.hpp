// Shared test setup: Catch2, the library, and the device a test binary runs on (CPU, or CUDA for the
// nvcc-built variant of the same sources).
#pragma once

#include <catch2/catch.hpp>
#include <tapegrad/tapegrad.hpp>

#include <cstdint>
#include <cstring>
#include <string>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(TG_TEST_CUDA)
using TestDevice = tg::Cuda;
#else
using TestDevice = tg::Cpu;
#endif

/// The directory of committed test data (golden files).
inline std::string test_data_dir() { return TG_TEST_DATA_DIR; }

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// Distance in units in the last place between two finite floats of the same sign region.
inline std::int64_t ulp_distance(float a, float b) {
  auto ordered = [](float f) {
    const auto u = static_cast<std::int64_t>(bits_of(f));
    return (u & 0x80000000) ? 0x80000000 - u : u;  // monotone map of the float line onto integers
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}
