// The activations linear() fuses, in one table of op-level facts: each is a name and a functor of
// math/functors.hpp (its math and derivative, which every device runs). What a backend can do with an
// activation (oneDNN's post-op, cuBLASLt's epilogue) is a column kept with that backend
// (backend/cpu/gemm.hpp, backend/cuda/gemm.hpp); an activation a backend has no entry for runs unfused there.
// Adding an activation is a functor and a row; the enum value, its name and the elementwise op (tg::gelu,
// ...) follow from the row.
#pragma once

#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/math/functors.hpp"

TG_BEGIN_NAMESPACE

// X(name, functor)
#define TG_ACTIVATIONS(X) \
  X(relu, Relu)           \
  X(gelu, Gelu)           \
  X(gelu_exact, GeluExact) \
  X(silu, Silu)

/// The activation fused into linear(): none, or one of the table's (gelu is the tanh approximation,
/// jax.nn.gelu's default; gelu_exact the erf form; silu is x sigmoid(x), jax.nn.silu).
enum class Activation {
  none,
#define TG_ACTIVATION_ENUM(name, Functor) name,
  TG_ACTIVATIONS(TG_ACTIVATION_ENUM)
#undef TG_ACTIVATION_ENUM
};

/// The activation's name ("gelu"), "none" for none.
inline const char* name_of(Activation a) {
  switch (a) {
#define TG_ACTIVATION_NAME(name, Functor) \
  case Activation::name: return #name;
    TG_ACTIVATIONS(TG_ACTIVATION_NAME)
#undef TG_ACTIVATION_NAME
    case Activation::none: break;
  }
  return "none";
}

namespace detail {

/// f(functor) for the activation's functor; returns `none_result` for Activation::none.
template <class F, class R>
R visit_activation(Activation a, F&& f, R none_result) {
  switch (a) {
#define TG_ACTIVATION_VISIT(name, Functor) \
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
#define TG_ACTIVATION_OF(name, Functor) \
  if constexpr (std::is_same_v<Op, fn::Functor>) return Activation::name;
  TG_ACTIVATIONS(TG_ACTIVATION_OF)
#undef TG_ACTIVATION_OF
  return Activation::none;
}

}  // namespace detail
TG_END_NAMESPACE
