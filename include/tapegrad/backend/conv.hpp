// The convolution door: ops describe a convolution pass (backend/problem.hpp: ConvProblem, ConvPass) and
// call backend::conv; the device's backend runs it (oneDNN's primitives on the CPU, cuDNN on CUDA) or
// answers that it did not (f64: the op runs its own loop), and says what of the forward epilogue (bias,
// activation) it fused.
#pragma once

#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/conv.hpp"
#include "tapegrad/backend/cuda/cudnn.hpp"
#include "tapegrad/backend/problem.hpp"
#include "tapegrad/core/tensor.hpp"

TG_BEGIN_NAMESPACE
namespace backend {

/// Runs one pass of `p` on device D into `out` (allocated by the caller): forward y from a = x, b = w;
/// backward_data dx from a = dy, b = w; backward_weights dw from a = x, b = dy. `bias` (o,) for a
/// forward pass that asks for one.
template <Element T, Device D>
ConvResult conv(ConvPass pass, const ConvProblem& p, const Tensor<T, D>& a, const Tensor<T, D>& b, const Tensor<T, D>* bias, Tensor<T, D>& out) {
  if constexpr (std::is_same_v<D, Cpu>) return cpu::conv(pass, p, a, b, bias, out);
  else return cuda::conv(pass, p, a, b, bias, out);
}

}  // namespace backend
TG_END_NAMESPACE
