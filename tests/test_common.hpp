// Shared test setup: Catch2, the library, and the device a test binary runs on (CPU, or CUDA for the
// nvcc-built variant of the same sources).
#pragma once

#include <catch2/catch.hpp>
#include <tapegrad/tapegrad.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(TG_TEST_CUDA)
using TestDevice = tg::Cuda;
#else
using TestDevice = tg::Cpu;
#endif

namespace test_data {

/// The first of the candidates that holds the golden files: $TAPEGRAD_TEST_DATA when set (and then only
/// it, so a wrong setting is an error rather than a silent fallback), else data/ beside the executable
/// (a relocated test binary, as scripts/gpu-bundle ships it), else the source tree's tests/data compiled
/// in. Empty when none does.
inline std::string find(const char* env, const std::string& exe_dir, const std::string& compiled) {
  const auto holds_goldens = [](const std::string& dir) {
    return std::filesystem::is_regular_file(std::filesystem::path(dir) / "jax_random_golden.txt");
  };
  if (env != nullptr && *env != '\0') return holds_goldens(env) ? std::string(env) : std::string();
  for (const std::string& dir : {exe_dir + "/data", compiled})
    if (holds_goldens(dir)) return dir;
  return {};
}

inline std::string exe_dir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

}  // namespace test_data

/// The directory of committed test data (golden files): see test_data::find. Throws naming the places
/// looked in when none holds them.
inline std::string test_data_dir() {
  const char* env = std::getenv("TAPEGRAD_TEST_DATA");
  const std::string dir = test_data::find(env, test_data::exe_dir(), TG_TEST_DATA_DIR);
  if (dir.empty())
    throw std::runtime_error(std::string("test data (jax_random_golden.txt) not found: ") +
                             (env && *env ? std::string("TAPEGRAD_TEST_DATA=") + env + " does not hold it"
                                          : "looked in " + test_data::exe_dir() + "/data and " TG_TEST_DATA_DIR) +
                             "; set TAPEGRAD_TEST_DATA to a copy of tests/data");
  return dir;
}

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
