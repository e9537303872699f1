// The CPU-only half (g++, tapegrad::tapegrad) and main.
#include "common.inc"

#include <iostream>

HalfReport cpu_half() { return report(); }

int main() {
  const HalfReport a = cpu_half(), b = cuda_half();
  std::cout << "cpu half:  built_with_cuda " << a.built_with_cuda << ", loss " << a.loss << ", grad sum " << a.grad_sum
            << "\n           require_device: " << a.no_device_message << "\n";
  std::cout << "cuda half: built_with_cuda " << b.built_with_cuda << ", loss " << b.loss << ", grad sum " << b.grad_sum
            << "\n           require_device: " << (b.no_device_message.empty() ? "a GPU is usable" : b.no_device_message) << "\n";
  // Each half must have run its own configuration's code: the CPU half says CUDA is not compiled in, the
  // CUDA half either has a GPU or says there is none (never "not compiled in").
  const bool cpu_ok = !a.built_with_cuda && a.no_device_message.find("CUDA support not compiled in") != std::string::npos;
  const bool cuda_ok = b.built_with_cuda && b.no_device_message.find("not compiled in") == std::string::npos;
  // sum((w - 1)^2) over w = 0, 1, 2, 3 is 6; its gradient 2 (w - 1) sums to 4.
  const bool same = a.loss == 6.0 && b.loss == 6.0 && a.grad_sum == 4.0 && b.grad_sum == 4.0;
  if (!(cpu_ok && cuda_ok && same)) {
    std::cout << "mixed FAILED\n";
    return 1;
  }
  std::cout << "mixed ok\n";
  return 0;
}
