// A CPU-only translation unit handing a tensor to the CUDA half: the two configurations' Tensor types
// differ (tg::abi_cpu vs tg::abi_cuda), so this must fail to link rather than mix two definitions.
#include <tapegrad/tapegrad.hpp>

float sum_in_cuda_half(const tg::Tensor<float>& x);

int main() { return sum_in_cuda_half(tg::ones<float>({3})) == 3.0f ? 0 : 1; }
