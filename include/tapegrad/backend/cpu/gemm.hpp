// The CPU's GEMM door: oneDNN's matmul primitive for f32, and for bf16 where the CPU has bf16 kernels (else
// the inputs converted to f32, the same f32 accumulation, the result rounded once), with the bias and
// the activation fused as post-ops; a plain OpenMP loop for f64 (oneDNN has none; double is for gradient
// checks). The backward epilogues (act', bias gradients) are never fused here: the op computes them.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/activation.hpp"
#include "tapegrad/backend/cpu/onednn.hpp"
#include "tapegrad/backend/problem.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/runtime/dispatch.hpp"
#include "tapegrad/runtime/recorder.hpp"

TG_BEGIN_NAMESPACE
namespace cpu {

/// Double-precision row-major GEMM, c (m, n) = op(a) op(b): a cache-friendly loop, rows in parallel,
/// i-k-j order.
inline void gemm_f64(std::int64_t m, std::int64_t n, std::int64_t k, const double* a, const double* b, double* c, bool ta,
                     bool tb) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < m; ++i) {
    double* ci = c + i * n;
    for (std::int64_t j = 0; j < n; ++j) ci[j] = 0.0;
    for (std::int64_t p = 0; p < k; ++p) {
      const double aip = ta ? a[p * m + i] : a[i * k + p];
      if (tb) {
        for (std::int64_t j = 0; j < n; ++j) ci[j] += aip * b[j * k + p];
      } else {
        const double* bp = b + p * n;
        for (std::int64_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
      }
    }
  }
}

namespace detail {

template <class T>
Tensor<float, Cpu> to_f32(const Tensor<T, Cpu>& x) {
  Tensor<float, Cpu> y(x.shape());
  ::tg::detail::convert<Cpu>(x.size(), x.data(), y.data());
  return y;
}

/// The f32 GEMM (with the post-ops of `s`) on f32 operands.
inline void onednn_gemm(const GemmShape& s, const float* a, const float* b, const float* bias, float* c) {
  ::tg::detail::cpu_kernel([s, a, b, bias, c] { OneDnn::instance().gemm(s, a, b, bias, c); });
}

}  // namespace detail

/// Runs the GEMM problem on the CPU (see backend/problem.hpp); `bias` (n,) when the problem has one.
template <class T>
backend::GemmResult<T, Cpu> gemm(const backend::GemmProblem& p, const Tensor<T, Cpu>& a, const Tensor<T, Cpu>& b,
                                  const Tensor<T, Cpu>* bias) {
  backend::GemmResult<T, Cpu> r;
  r.c = p.batch > 1 ? Tensor<T, Cpu>(Shape{p.batch, p.m, p.n}) : Tensor<T, Cpu>(Shape{p.m, p.n});
  if (r.c.size() == 0) return r;
  if (p.k == 0) {  // an empty sum; the op adds the bias and applies the activation
    r.c = zeros<T, Cpu>(r.c.shape());
    return r;
  }
  // What oneDNN fuses: the bias, and the activation when the pre-activation is not needed.
  const bool fuse = fused_linear() && !std::is_same_v<T, double>;
  r.bias_done = fuse && p.bias;
  r.act_done = fuse && !p.keep_pre && onednn_activation(p.act).eltwise.alg != dnnl_alg_kind_undef;
  GemmShape s{p.m, p.n, p.k, p.trans_a, p.trans_b, GemmType::f32, r.bias_done, r.act_done ? onednn_activation(p.act).eltwise : Eltwise{},
              p.batch};
  if constexpr (std::is_same_v<T, double>) {
    ::tg::detail::cpu_kernel([p, pa = a.data(), pb = b.data(), pc = r.c.data()] {
      for (std::int64_t i = 0; i < p.batch; ++i)
        gemm_f64(p.m, p.n, p.k, pa + i * p.m * p.k, pb + i * p.k * p.n, pc + i * p.m * p.n, p.trans_a, p.trans_b);
    });
  } else if constexpr (std::is_same_v<T, float>) {
    detail::onednn_gemm(s, a.data(), b.data(), r.bias_done ? bias->data() : nullptr, r.c.data());
  } else {
    static_assert(std::is_same_v<T, bf16>, "GEMMs take float, double or bf16");
    Tensor<float, Cpu> bias_f;
    if (r.bias_done) bias_f = detail::to_f32(*bias);  // oneDNN's bias is f32
    if (OneDnn::instance().bf16_supported()) {
      s.type = GemmType::bf16;
      ::tg::detail::cpu_kernel([s, pa = a.data(), pb = b.data(), pbias = bias_f.data(), pc = r.c.data()] {
        OneDnn::instance().gemm(s, pa, pb, pbias, pc);
      });
    } else {
      // The same f32 accumulation on converted inputs, the result rounded once.
      const Tensor<float, Cpu> af = detail::to_f32(a), bf = detail::to_f32(b);
      Tensor<float, Cpu> cf(r.c.shape());
      detail::onednn_gemm(s, af.data(), bf.data(), bias_f.data(), cf.data());
      ::tg::detail::convert<Cpu>(cf.size(), cf.data(), r.c.data());
    }
  }
  return r;
}

/// Whether the CPU fuses the previous layer's act' and bias gradient into an input-gradient GEMM: never.
template <class T>
constexpr bool fuses_dact(Activation, std::int64_t) {
  return false;
}

}  // namespace cpu
TG_END_NAMESPACE
