// What each half of the mixed program reports about the tapegrad it was compiled with.
#pragma once
#include <string>

struct HalfReport {
  bool built_with_cuda = false;
  std::string no_device_message;  // what require_device says here ("" where a GPU is usable)
  double loss = 0.0, grad_sum = 0.0;  // one value_and_grad of a small quadratic on the CPU
};

HalfReport cpu_half();
HalfReport cuda_half();
