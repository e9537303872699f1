// A user's CUDA program: tapegrad::cuda from an installed package; runs with or without a GPU.
#include <tapegrad/tapegrad.hpp>

#include <iostream>

int main() {
  if (!tg::cuda::available()) {
    std::cout << "no CUDA device here; CUDA devices: " << tg::cuda::describe_devices() << "\nconsumer_cuda ok\n";
    return 0;
  }
  const auto w = tg::random::normal<float, tg::Cuda>(tg::random::key(1), {784, 256});
  const auto expected = tg::random::normal<float, tg::Cpu>(tg::random::key(1), {784, 256});
  if (w.to_vector() != expected.to_vector()) return 1;
  std::cout << w << "\nconsumer_cuda ok\n";
  return 0;
}
