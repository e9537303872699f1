// The CUDA GEMM door: each GEMM problem through cuBLASLt (backend/cuda/blaslt.hpp), with the epilogues
// its column of the activation table allows (bias, relu + bias, GELU + bias keeping the pre-activation,
// DGELU with the bias gradient, the bias gradient of an operand), a plain GEMM where none applies. Without
// the CUDA backend, one stub raising cuda::not_compiled_in.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cuda/activation.hpp"
#include "tapegrad/backend/cuda/blaslt.hpp"
#include "tapegrad/backend/problem.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/runtime/device.hpp"

TG_BEGIN_NAMESPACE
namespace cuda {

#if defined(TG_WITH_CUDA)
template <class T>
constexpr LtType lt_type() {
  if constexpr (std::is_same_v<T, double>) return LtType::f64;
  else if constexpr (std::is_same_v<T, bf16>) return LtType::bf16;
  else return LtType::f32;
}

/// The column-major cuBLASLt problem for row-major c (m, n) = op(a) op(b): c^T = op(b)^T op(a)^T, so
/// cuBLASLt's A is our b and its B is our a (llm.c's swap); a batch's matrices are one after another.
template <class T>
LtGemm lt_problem(const backend::GemmProblem& p, Epilogue e) {
  LtGemm g;
  g.m = p.n;
  g.n = p.m;
  g.k = p.k;
  g.trans_a = p.trans_b;
  g.trans_b = p.trans_a;
  g.lda = p.trans_b ? p.k : p.n;
  g.ldb = p.trans_a ? p.m : p.k;
  g.ldd = p.n;
  g.type = lt_type<T>();
  if (g.type == LtType::f32 && allow_tf32()) g.type = LtType::tf32;
  g.epilogue = e;
  g.aux_ld = p.n;
  if (p.batch > 1) g.batch = p.batch, g.stride_a = p.k * p.n, g.stride_b = p.m * p.k, g.stride_d = p.m * p.n;
  return g;
}

/// Whether cuBLASLt's epilogues serve T. Not double: on an H200 (CUDA 13.0) the f64 GELU / DGELU_BGRAD /
/// BGRADA epilogues gave gradients accurate only to about 2e-6 relative (single precision) where plain
/// 64F GEMMs and tapegrad's double kernels agree with the CPU to 1e-12. f64 is for gradient checks, so it
/// takes the exact path: plain GEMMs, then bias, activation and bias gradient by the ops.
template <class T>
inline constexpr bool lt_epilogues = !std::is_same_v<T, double>;

/// Whether the backward GEMM through a GELU layer may run cuBLASLt's DGELU_BGRAD epilogue: only for
/// bf16. On an H200 its f32 derivative was off by up to 1.7e-5 absolute (5.6e-5 relative: 2 of 768
/// elements outside 1e-5 + 1e-5 |x|), more than f32 rounding, so f32 and f64 run tapegrad's own GELU
/// derivative (the CPU's functor); in bf16 that error is far below the output's rounding (2^-8 relative).
template <class T>
inline constexpr bool lt_dgelu_epilogue = std::is_same_v<T, bf16>;

/// The epilogue the forward GEMM runs: bias, relu + bias (inference: relu needs no saved pre-activation),
/// GELU + bias keeping the pre-activation in aux (its leading dimension must be a multiple of 8), or none
/// (everything else is left to the op).
template <class T>
Epilogue forward_epilogue(bool fused, bool has_bias, Activation act, bool keep_pre, std::int64_t n) {
  if (!lt_epilogues<T> || !fused || !has_bias) return Epilogue::none;
  const LtFusion lt = lt_fusion(act);
  if (act == Activation::none) return Epilogue::bias;
  if (lt == LtFusion::relu && !keep_pre) return Epilogue::relu_bias;
  if (lt == LtFusion::gelu_tanh && n % 8 == 0) return Epilogue::gelu_aux_bias;
  return Epilogue::none;
}

/// Whether an input-gradient GEMM can also apply the previous layer's act' and reduce its bias gradient
/// in the epilogue (DGELU_BGRAD): for GELU in bf16 with n a multiple of 8 (see lt_dgelu_epilogue).
template <class T>
bool fuses_dact(Activation act, std::int64_t n) {
  return lt_dgelu_epilogue<T> && lt_fusion(act) == LtFusion::gelu_tanh && n % 8 == 0;
}

/// Runs the GEMM problem on the current GPU (see backend/problem.hpp).
template <class T>
backend::GemmResult<T, Cuda> gemm(const backend::GemmProblem& p, const Tensor<T, Cuda>& a, const Tensor<T, Cuda>& b,
                                   const Tensor<T, Cuda>* bias, const Tensor<T, Cuda>* pre) {
  backend::GemmResult<T, Cuda> r;
  r.c = p.batch > 1 ? Tensor<T, Cuda>(Shape{p.batch, p.m, p.n}) : Tensor<T, Cuda>(Shape{p.m, p.n});
  if (r.c.size() == 0) return r;
  Lt& lt = Lt::instance();
  auto plain = [&] {
    if (p.k == 0) {
      r.c = zeros<T, Cuda>(r.c.shape());
      return;
    }
    TG_CHECK(lt.matmul(lt_problem<T>(p, Epilogue::none), b.data(), a.data(), r.c.data()), p.op, "cuBLASLt found no algorithm for ",
             p.batch, " x (", p.m, ", ", p.k, ") @ (", p.k, ", ", p.n, ") in ", dtype_name<T>);
  };
  const bool fused = fused_linear() && p.k > 0;
  if (p.dact != Activation::none) {
    // The previous layer's dz = (a @ op(b)) * act'(pre) and its bias gradient, in the epilogue.
    if (fused && fuses_dact<T>(p.dact, p.n) && p.bias_grad == backend::BiasGrad::of_result) {
      Tensor<T, Cuda> db(Shape{p.n});
      if (lt.matmul(lt_problem<T>(p, Epilogue::dgelu_bgrad), b.data(), a.data(), r.c.data(), db.data(), pre->data())) {
        r.bias_grad = db;
        r.dact_done = r.bias_grad_done = true;
        return r;
      }
    }
    plain();
    return r;
  }
  if (p.bias_grad == backend::BiasGrad::of_b) {
    // dw = x^T dz: cuBLASLt sees dw^T = dz^T x with dz^T as its A operand, whose sums over k (the batch)
    // are the bias gradient (BGRADA in the row-major swap).
    if (fused && lt_epilogues<T>) {
      Tensor<T, Cuda> db(Shape{p.n});
      if (lt.matmul(lt_problem<T>(p, Epilogue::bgrada), b.data(), a.data(), r.c.data(), db.data())) {
        r.bias_grad = db;
        r.bias_grad_done = true;
        return r;
      }
    }
    plain();
    return r;
  }
  // cuBLASLt's GELU epilogue is the tanh form; the aux buffer of GELU_AUX_BIAS is the pre-activation.
  const Epilogue e = p.batch > 1 ? Epilogue::none : forward_epilogue<T>(fused_linear(), p.bias, p.act, p.keep_pre, p.n);
  if (p.k > 0 && e != Epilogue::none) {
    Tensor<T, Cuda> aux;
    if (e == Epilogue::gelu_aux_bias) aux = Tensor<T, Cuda>(Shape{p.m, p.n});
    if (lt.matmul(lt_problem<T>(p, e), b.data(), a.data(), r.c.data(), bias->data(), aux.defined() ? aux.data() : nullptr)) {
      r.bias_done = true;
      r.act_done = e == Epilogue::relu_bias || e == Epilogue::gelu_aux_bias;
      if (e == Epilogue::gelu_aux_bias) r.pre = aux;
      return r;
    }
  }
  plain();
  return r;
}
#else
/// A build without the CUDA backend: the GEMM door's one stub.
template <class T>
backend::GemmResult<T, Cuda> gemm(const backend::GemmProblem& p, const Tensor<T, Cuda>&, const Tensor<T, Cuda>&, const Tensor<T, Cuda>*,
                                   const Tensor<T, Cuda>*) {
  not_compiled_in(p.op);
}

template <class T>
bool fuses_dact(Activation, std::int64_t) {
  return false;
}
#endif

}  // namespace cuda
TG_END_NAMESPACE
