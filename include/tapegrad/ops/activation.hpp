// The activations linear() fuses, in one table: each is a functor of ops/functors.hpp (its math and
// derivative, which every backend can run) plus one row saying what each backend has for it. Adding an
// activation is a functor and a row; the elementwise op, the enum value, its name and the fused paths
// of linear() on both backends follow from the row.
#pragma once

#include <oneapi/dnnl/dnnl.h>

#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/functors.hpp"

namespace tg::inline TG_ABI {

/// What cuBLASLt can fuse into a GEMM's epilogue for an activation (ops/matmul.hpp maps it to the
/// backend's epilogues): nothing, relu (forward, when the pre-activation is not kept), or GELU in the
/// tanh form (forward keeping the pre-activation as aux, and DGELU with the bias gradient backward).
enum class LtFusion { none, relu, gelu_tanh };

// X(name, functor, oneDNN algorithm, its alpha, whether oneDNN's eltwise kernels run the elementwise op on
// the CPU, cuBLASLt fusion). oneDNN's algorithm serves as the GEMM post-op of linear() on the CPU; its
// standalone eltwise kernels replace the functor only where they vectorise what would otherwise be
// scalar libm calls (GELU's exp and erf), computing the same function.
#define TG_ACTIVATIONS(X)                                                                       \
  X(relu, Relu, dnnl_eltwise_relu, 0.0f, false, LtFusion::relu)                                 \
  X(gelu, Gelu, dnnl_eltwise_gelu_tanh, 0.0f, true, LtFusion::gelu_tanh)                        \
  X(gelu_exact, GeluExact, dnnl_eltwise_gelu_erf, 0.0f, true, LtFusion::none)                   \
  X(silu, Silu, dnnl_eltwise_swish, 1.0f, false, LtFusion::none)

/// The activation fused into linear(): none, or one of the table's (gelu is the tanh approximation,
/// jax.nn.gelu's default; gelu_exact the erf form; silu is x sigmoid(x), jax.nn.silu).
enum class Activation {
  none,
#define TG_ACTIVATION_ENUM(name, Functor, alg, alpha, eltwise, lt) name,
  TG_ACTIVATIONS(TG_ACTIVATION_ENUM)
#undef TG_ACTIVATION_ENUM
};

/// What the backends have for one activation (its row of the table).
struct ActivationInfo {
  const char* name = "none";
  dnnl_alg_kind_t onednn = dnnl_alg_kind_undef;  ///< oneDNN eltwise algorithm (GEMM post-op), undef for none
  float onednn_alpha = 0.0f;
  bool onednn_eltwise = false;  ///< oneDNN's eltwise kernels run the elementwise op on the CPU
  LtFusion lt = LtFusion::none;
};

inline ActivationInfo activation_info(Activation a) {
  switch (a) {
#define TG_ACTIVATION_INFO(name, Functor, alg, alpha, eltwise, lt) \
  case Activation::name: return {#name, alg, alpha, eltwise, lt};
    TG_ACTIVATIONS(TG_ACTIVATION_INFO)
#undef TG_ACTIVATION_INFO
    case Activation::none: break;
  }
  return {};
}

inline const char* name_of(Activation a) { return activation_info(a).name; }

namespace detail {

/// f(functor) for the activation's functor; returns `none_result` for Activation::none.
template <class F, class R>
R visit_activation(Activation a, F&& f, R none_result) {
  switch (a) {
#define TG_ACTIVATION_VISIT(name, Functor, alg, alpha, eltwise, lt) \
  case Activation::name: return f(fn::Functor{});
    TG_ACTIVATIONS(TG_ACTIVATION_VISIT)
#undef TG_ACTIVATION_VISIT
    case Activation::none: break;
  }
  return none_result;
}

/// The activation whose functor is Op (none for any other functor).
template <class Op>
constexpr Activation activation_of() {
#define TG_ACTIVATION_OF(name, Functor, alg, alpha, eltwise, lt) \
  if constexpr (std::is_same_v<Op, fn::Functor>) return Activation::name;
  TG_ACTIVATIONS(TG_ACTIVATION_OF)
#undef TG_ACTIVATION_OF
  return Activation::none;
}

}  // namespace detail
}  // namespace tg
