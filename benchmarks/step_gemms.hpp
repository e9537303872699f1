// The 8 GEMMs of one training step of the 784-256-128-10 MLP at batch 512, shared by the benchmarks.
#pragma once

#include <cstdint>

namespace bench {

/// Row-major op(A) (m x k) @ op(B) (k x n), transposes as the backward pass uses them.
struct StepGemm {
  const char* what;
  std::int64_t m, n, k;
  bool ta, tb;
};

inline constexpr StepGemm step_gemms[] = {
    {"fwd  x@W1     ", 512, 256, 784, false, false}, {"fwd  h1@W2    ", 512, 128, 256, false, false},
    {"fwd  h2@W3    ", 512, 10, 128, false, false},  {"bwd  x^T@dz1  ", 784, 256, 512, true, false},
    {"bwd  h1^T@dz2 ", 256, 128, 512, true, false},  {"bwd  h2^T@dz3 ", 128, 10, 512, true, false},
    {"bwd  dz3@W3^T ", 512, 128, 10, false, true},   {"bwd  dz2@W2^T ", 512, 256, 128, false, true},
};

}  // namespace bench
