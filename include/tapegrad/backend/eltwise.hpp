// The elementwise door: where a vendor library computes an elementwise function faster than tapegrad's
// functor loop, it runs it. Today that is oneDNN's eltwise kernels on the CPU for the activations its
// column marks (GELU in both forms: vectorised exp and erf instead of scalar libm calls), in f32 and, where
// oneDNN has them, bf16 (computed in f32 and rounded once, as the functors do). Everywhere else the door
// answers false and the op runs its functor.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/activation.hpp"
#include "tapegrad/backend/cpu/onednn.hpp"
#include "tapegrad/base/bf16.hpp"
#include "tapegrad/math/activation.hpp"
#include "tapegrad/runtime/device.hpp"
#include "tapegrad/runtime/recorder.hpp"

TG_BEGIN_NAMESPACE
namespace backend {

namespace detail {
template <class Op, class T, class D>
bool onednn_runs() {
  if constexpr (std::is_same_v<D, Cpu> && ::tg::detail::activation_of<Op>() != Activation::none &&
                (std::is_same_v<T, float> || std::is_same_v<T, bf16>)) {
    const cpu::OneDnnActivation a = cpu::onednn_activation(::tg::detail::activation_of<Op>());
    if (!a.elementwise) return false;
    if constexpr (std::is_same_v<T, float>) return true;
    else return cpu::OneDnn::instance().eltwise_supported(a.eltwise, cpu::GemmType::bf16);
  }
  return false;
}

template <class T>
constexpr cpu::GemmType onednn_type = std::is_same_v<T, bf16> ? cpu::GemmType::bf16 : cpu::GemmType::f32;
}  // namespace detail

/// Whether a vendor kernel computes the functor Op on elements of T on device D (then unary and
/// unary_backward below run it).
template <class Op, class T, Device D>
bool has_unary() {
  return detail::onednn_runs<Op, T, D>();
}

/// y = Op(x) on n elements by the vendor kernel; false (nothing done) where there is none.
template <class Op, class T, Device D>
bool unary(std::int64_t n, const T* x, T* y) {
  if (!has_unary<Op, T, D>()) return false;
  if (n > 0) {
    const cpu::Eltwise e = cpu::onednn_activation(::tg::detail::activation_of<Op>()).eltwise;
    ::tg::detail::cpu_kernel([e, n, x, y] { cpu::OneDnn::instance().eltwise(e, false, n, x, nullptr, y, detail::onednn_type<T>); });
  }
  return true;
}

/// dx = dy * Op'(x) on n elements by the vendor kernel; false (nothing done) where there is none.
template <class Op, class T, Device D>
bool unary_backward(std::int64_t n, const T* x, const T* dy, T* dx) {
  if (!has_unary<Op, T, D>()) return false;
  if (n > 0) {
    const cpu::Eltwise e = cpu::onednn_activation(::tg::detail::activation_of<Op>()).eltwise;
    ::tg::detail::cpu_kernel([e, n, x, dy, dx] { cpu::OneDnn::instance().eltwise(e, true, n, x, dy, dx, detail::onednn_type<T>); });
  }
  return true;
}

}  // namespace backend
TG_END_NAMESPACE
