// cuBLASLt's column of the activation table (math/activation.hpp): what its epilogues can fuse for each
// activation. relu forward (when the pre-activation is not kept: relu's derivative needs it), and GELU in
// the tanh form: forward keeping the pre-activation as aux (GELU_AUX_BIAS), backward DGELU with the bias
// gradient (DGELU_BGRAD). An activation without an entry runs unfused after the GEMM.
#pragma once

#include "tapegrad/config.hpp"
#include "tapegrad/math/activation.hpp"

TG_BEGIN_NAMESPACE
namespace cuda {

enum class LtFusion { none, relu, gelu_tanh };

inline LtFusion lt_fusion(Activation a) {
  switch (a) {
    case Activation::relu: return LtFusion::relu;
    case Activation::gelu: return LtFusion::gelu_tanh;
    default: return LtFusion::none;
  }
}

}  // namespace cuda
TG_END_NAMESPACE
