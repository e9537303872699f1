// oneDNN's column of the activation table (math/activation.hpp): the eltwise algorithm oneDNN computes each
// activation with, used as the post-op of the CPU GEMM, and whether its standalone eltwise kernels replace
// the functor loop for the elementwise op. They do only where they vectorise what would otherwise be scalar
// libm calls (GELU's exp and erf), computing the same function. An activation without an entry runs unfused.
#pragma once

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/onednn.hpp"
#include "tapegrad/math/activation.hpp"

TG_BEGIN_NAMESPACE
namespace cpu {

/// What oneDNN has for one activation.
struct OneDnnActivation {
  Eltwise eltwise{};        ///< the algorithm (GEMM post-op); undef: none
  bool elementwise = false;  ///< oneDNN's eltwise kernels run the elementwise op
};

inline OneDnnActivation onednn_activation(Activation a) {
  switch (a) {
    case Activation::relu: return {{dnnl_eltwise_relu, 0.0f}, false};
    case Activation::gelu: return {{dnnl_eltwise_gelu_tanh, 0.0f}, true};
    case Activation::gelu_exact: return {{dnnl_eltwise_gelu_erf, 0.0f}, true};
    case Activation::silu: return {{dnnl_eltwise_swish, 1.0f}, false};
    case Activation::none: break;
  }
  return {};
}

}  // namespace cpu
TG_END_NAMESPACE
