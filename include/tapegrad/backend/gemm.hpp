// The GEMM door: ops describe a GEMM (backend/problem.hpp) and call backend::gemm; the device's backend
// decides how to run it (oneDNN post-ops on the CPU, cuBLASLt epilogues on CUDA) and says what it fused.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/gemm.hpp"
#include "tapegrad/backend/cuda/gemm.hpp"
#include "tapegrad/backend/problem.hpp"
#include "tapegrad/core/tensor.hpp"

TG_BEGIN_NAMESPACE
namespace backend {

/// Runs `p` on device D: a (or its transpose) and b as the problem describes them, `bias` (n,) when it
/// has one, `pre` (m, n) when it asks for act'. See GemmResult for what the caller completes.
template <Element T, Device D>
GemmResult<T, D> gemm(const GemmProblem& p, const Tensor<T, D>& a, const Tensor<T, D>& b,
                      const std::type_identity_t<Tensor<T, D>>* bias = nullptr, const std::type_identity_t<Tensor<T, D>>* pre = nullptr) {
  if constexpr (std::is_same_v<D, Cpu>) return cpu::gemm(p, a, b, bias);
  else return cuda::gemm(p, a, b, bias, pre);
}

/// Whether D's GEMMs fuse an activation's derivative and the bias gradient into the input-gradient GEMM
/// of the next layer (GemmProblem::dact): the layer then leaves its backward through act to its consumer.
template <Element T, Device D>
bool fuses_dact(Activation act, std::int64_t n) {
  if constexpr (std::is_same_v<D, Cpu>) return cpu::fuses_dact<T>(act, n);
  else return fused_linear() && cuda::fuses_dact<T>(act, n);
}

}  // namespace backend
TG_END_NAMESPACE
