// The CPU's convolution door: oneDNN's convolution primitives (backend/cpu/onednn_conv.hpp) for f32, and for
// bf16 where the CPU has native bf16 kernels (else the inputs converted to f32, the same f32 accumulation,
// the result rounded once), with the bias and the activation fused into the forward pass as post-ops.
// Not f64 (oneDNN has none): the op runs its own loop, which is also the reference the tests hold oneDNN to.
#pragma once

#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/activation.hpp"
#include "tapegrad/backend/cpu/gemm.hpp"
#include "tapegrad/backend/cpu/onednn_conv.hpp"
#include "tapegrad/backend/problem.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/runtime/dispatch.hpp"
#include "tapegrad/runtime/recorder.hpp"

TG_BEGIN_NAMESPACE
namespace cpu {

/// Runs one pass of `p` (see backend/problem.hpp) into `out`; `bias` (o,) for a forward pass that has one.
template <class T>
backend::ConvResult conv(backend::ConvPass pass, const backend::ConvProblem& p, const Tensor<T, Cpu>& a, const Tensor<T, Cpu>& b,
                         const Tensor<T, Cpu>* bias, Tensor<T, Cpu>& out) {
  backend::ConvResult r;
  if constexpr (std::is_same_v<T, double>) {
    return r;
  } else {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>, "convolutions take float, double or bf16");
    if (a.size() == 0 || b.size() == 0) return r;  // an empty sum (no channels, or an empty batch): the op's loop writes the zeros
    r.done = true;
    if (out.size() == 0) return r;
    const bool forward = pass == backend::ConvPass::forward;
    backend::ConvProblem q = p;
    r.bias_done = q.bias = forward && p.bias;
    const Eltwise post = forward ? onednn_activation(p.act).eltwise : Eltwise{};
    r.act_done = post.alg != dnnl_alg_kind_undef;
    q.act = r.act_done ? p.act : Activation::none;
    // oneDNN's bias is f32.
    Tensor<float, Cpu> bias_f;
    if (r.bias_done) {
      if constexpr (std::is_same_v<T, float>) bias_f = *bias;
      else bias_f = detail::to_f32(*bias);
    }
    if (std::is_same_v<T, float> || OneDnn::instance().bf16_supported()) {
      constexpr GemmType type = std::is_same_v<T, float> ? GemmType::f32 : GemmType::bf16;
      ::tg::detail::cpu_kernel([pass, q, post, pa = a.data(), pb = b.data(), pbias = bias_f.data(), po = out.data()] {
        OneDnnConv::instance().run(pass, q, type, post, pa, pb, pbias, po);
      });
    } else {
      // The same f32 accumulation on converted inputs, the result rounded once.
      const Tensor<float, Cpu> af = detail::to_f32(a), bf = detail::to_f32(b);
      Tensor<float, Cpu> of(out.shape());
      ::tg::detail::cpu_kernel([pass, q, post, pa = af.data(), pb = bf.data(), pbias = bias_f.data(), po = of.data()] {
        OneDnnConv::instance().run(pass, q, GemmType::f32, post, pa, pb, pbias, po);
      });
      ::tg::detail::convert<Cpu>(of.size(), of.data(), out.data());
    }
    return r;
  }
}

}  // namespace cpu
TG_END_NAMESPACE
