// The CUDA half (nvcc, tapegrad::cuda).
#include "common.inc"

HalfReport cuda_half() {
  HalfReport r = report();
  if (tg::cuda::available()) {  // and, where there is a GPU, the same sum there
    const auto w = tg::device_put<tg::Cuda>(tg::arange<float>(4));
    if (tg::sum(tg::square(w - 1.0f)).item() != 6.0f) r.loss = -1.0;
  }
  return r;
}

/// For crossing.cpp, which declares it with its own (CPU-only) Tensor type: that must not link.
float sum_in_cuda_half(const tg::Tensor<float>& x) { return tg::sum(x).item(); }
