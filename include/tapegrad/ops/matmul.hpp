// matmul and the fused layer linear(x, w, b, activation) on both backends (oneDNN on the CPU, cuBLASLt
// on CUDA), and the two fused backward GEMMs a training step needs.
#pragma once

#include <any>
#include <atomic>
#include <memory>
#include <tuple>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/onednn.hpp"
#include "tapegrad/backend/cuda/blaslt.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/reduce.hpp"

namespace tg::inline TG_ABI {

namespace detail {
inline std::atomic<bool> fused_linear_enabled{true};
inline std::atomic<bool> tf32_enabled{false};
}  // namespace detail

/// Whether linear() and the backward GEMMs use the fused epilogues (default) or the unfused path of
/// separate GEMM and elementwise ops. Both give the same results up to rounding; a test compares them.
inline void set_fused_linear(bool on) { detail::fused_linear_enabled = on; }
inline bool fused_linear() { return detail::fused_linear_enabled; }

/// Opt in to TF32 tensor cores for float32 GEMMs on CUDA (10-bit mantissa products, f32 accumulation).
inline void set_allow_tf32(bool on) { detail::tf32_enabled = on; }
inline bool allow_tf32() { return detail::tf32_enabled; }

namespace detail {

/// Row-major GEMM sizes of op(a) @ op(b), with the error users see for mismatched shapes.
struct GemmDims {
  std::int64_t m, n, k;
};

template <class T, class D>
GemmDims gemm_dims(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb, const char* op) {
  check_defined(a, op);
  check_defined(b, op);
  TG_CHECK(a.rank() == 2 && b.rank() == 2, op, "needs 2-d operands, got ", a.shape().str(), " @ ", b.shape().str());
  const std::int64_t m = ta ? a.dim(1) : a.dim(0), ka = ta ? a.dim(0) : a.dim(1);
  const std::int64_t kb = tb ? b.dim(1) : b.dim(0), n = tb ? b.dim(0) : b.dim(1);
  TG_CHECK(ka == kb, op, "inner dims differ: ", a.shape().str(), ta ? "^T" : "", " @ ", b.shape().str(), tb ? "^T" : "",
           " (", ka, " vs ", kb, ")");
  return {m, n, ka};
}

/// y(x) = act(x) on a tensor, for the unfused paths.
template <class T, class D>
Tensor<T, D> activate(const Tensor<T, D>& z, Activation act) {
  return visit_activation(act, [&](auto f) { return map(z, f, name_of(act)); }, z);
}

/// dz = g * act'(z) elementwise.
template <class Act>
struct ActBackwardFn {
  template <class C> TG_HD C operator()(C g, C z) const { return Act{}.backward(z, C(0), g); }
};

template <class T, class D>
Tensor<T, D> activation_backward(const Tensor<T, D>& g, const Tensor<T, D>& z, Activation act) {
  return visit_activation(act, [&]<class Op>(Op) {
    if (use_onednn_eltwise<Op, T, D>()) {
      TG_CHECK(g.shape() == z.shape(), "linear_backward", "gradient of shape ", g.shape().str(), " for a pre-activation of shape ",
               z.shape().str());
      Tensor<T, D> dz(z.shape());
      unary_backward<Op, T, D>(z.size(), z.data(), nullptr, g.data(), dz.data(), {});
      return dz;
    }
    return map2(g, z, ActBackwardFn<Op>{}, "linear_backward");
  }, g);
}

/// The post-op oneDNN fuses into a CPU GEMM for `act`.
inline cpu::Eltwise onednn_post_op(Activation act) {
  const ActivationInfo info = activation_info(act);
  return {info.onednn, info.onednn_alpha};
}

/// Double-precision GEMM on the CPU: oneDNN has no f64 matmul, and double is for gradient checks, so a
/// plain cache-friendly OpenMP loop (rows in parallel, i-k-j order) serves.
inline void gemm_f64(const GemmDims& g, const double* a, const double* b, double* c, bool ta, bool tb) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < g.m; ++i) {
    double* ci = c + i * g.n;
    for (std::int64_t j = 0; j < g.n; ++j) ci[j] = 0.0;
    for (std::int64_t p = 0; p < g.k; ++p) {
      const double aip = ta ? a[p * g.m + i] : a[i * g.k + p];
      if (tb) {
        for (std::int64_t j = 0; j < g.n; ++j) ci[j] += aip * b[j * g.k + p];
      } else {
        const double* bp = b + p * g.n;
        for (std::int64_t j = 0; j < g.n; ++j) ci[j] += aip * bp[j];
      }
    }
  }
}

/// CPU: C = op(A) op(B) [+ bias] [act], through oneDNN (bf16 inputs go through f32 where this CPU has no
/// oneDNN bf16 kernels: the same f32 accumulation, one rounding of the result).
template <class T>
Tensor<T, Cpu> cpu_gemm(const Tensor<T, Cpu>& a, const Tensor<T, Cpu>& b, bool ta, bool tb,
                        const std::type_identity_t<Tensor<T, Cpu>>* bias,
                        Activation act, const GemmDims& g) {
  Tensor<T, Cpu> c(Shape{g.m, g.n});
  if constexpr (std::is_same_v<T, double>) {
    cpu_kernel([g, pa = a.data(), pb = b.data(), pc = c.data(), ta, tb] { gemm_f64(g, pa, pb, pc, ta, tb); });
    if (bias) c = add(c, *bias);
    return activate(c, act);
  } else if constexpr (std::is_same_v<T, float>) {
    cpu::GemmShape s{g.m, g.n, g.k, ta, tb, cpu::GemmType::f32, bias != nullptr, onednn_post_op(act)};
    cpu_kernel([s, pa = a.data(), pb = b.data(), pbias = bias ? bias->data() : nullptr, pc = c.data()] {
      cpu::OneDnn::instance().gemm(s, pa, pb, pbias, pc);
    });
    return c;
  } else {
    static_assert(std::is_same_v<T, bf16>, "GEMMs take float, double or bf16");
    auto& dnn = cpu::OneDnn::instance();
    Tensor<float, Cpu> bias_f;
    if (bias) bias_f = cast<float>(*bias);
    if (dnn.bf16_supported()) {
      cpu::GemmShape s{g.m, g.n, g.k, ta, tb, cpu::GemmType::bf16, bias != nullptr, onednn_post_op(act)};
      cpu_kernel([&dnn, s, pa = a.data(), pb = b.data(), pbias = bias ? bias_f.data() : nullptr, pc = c.data()] {
        dnn.gemm(s, pa, pb, pbias, pc);
      });
      return c;
    }
    const auto af = cast<float>(a), bf = cast<float>(b);
    return cast<bf16>(cpu_gemm<float>(af, bf, ta, tb, bias ? &bias_f : nullptr, act, g));
  }
}

#if defined(TG_WITH_CUDA)
template <class T>
constexpr cuda::LtType lt_type() {
  if constexpr (std::is_same_v<T, double>) return cuda::LtType::f64;
  else if constexpr (std::is_same_v<T, bf16>) return cuda::LtType::bf16;
  else return cuda::LtType::f32;
}

/// The column-major cuBLASLt problem for row-major C(m, n) = op(A) op(B): C^T = op(B)^T op(A)^T, so
/// cuBLASLt's A is our B and its B is our A (llm.c's swap).
template <class T>
cuda::LtGemm lt_problem(const GemmDims& g, bool ta, bool tb, cuda::Epilogue e) {
  cuda::LtGemm p;
  p.m = g.n;
  p.n = g.m;
  p.k = g.k;
  p.trans_a = tb;
  p.trans_b = ta;
  p.lda = tb ? g.k : g.n;
  p.ldb = ta ? g.m : g.k;
  p.ldd = g.n;
  p.type = lt_type<T>();
  if (p.type == cuda::LtType::f32 && allow_tf32()) p.type = cuda::LtType::tf32;
  p.epilogue = e;
  p.aux_ld = g.n;
  return p;
}

/// Whether cuBLASLt's epilogues serve T. Not double: on an H200 (CUDA 13.0) the f64 GELU / DGELU_BGRAD /
/// BGRADA epilogues gave gradients accurate only to about 2e-6 relative (single precision) where plain
/// 64F GEMMs and tapegrad's double kernels agree with the CPU to 1e-12. f64 is for gradient checks, so it
/// takes the exact path: plain GEMMs, then bias, activation and bias gradient in tapegrad's kernels.
template <class T>
inline constexpr bool lt_epilogues = !std::is_same_v<T, double>;

/// Whether the backward GEMM through a GELU layer may run cuBLASLt's DGELU_BGRAD epilogue: only for
/// bf16. On an H200 its f32 derivative was off by up to 1.7e-5 absolute (5.6e-5 relative: 2 of 768
/// elements outside 1e-5 + 1e-5 |x|), more than f32 rounding, so f32 and f64 run tapegrad's own GELU
/// derivative (the CPU's functor); in bf16 that error is far below the output's rounding (2^-8 relative).
template <class T>
inline constexpr bool lt_dgelu_epilogue = std::is_same_v<T, bf16>;

/// The epilogue the forward GEMM of linear() runs: bias, relu + bias (inference: relu needs no saved
/// pre-activation), GELU + bias keeping the pre-activation in aux (its leading dimension must be a
/// multiple of 8), or none (everything else runs unfused after the GEMM).
template <class T>
cuda::Epilogue forward_epilogue(bool fused, bool has_bias, Activation act, bool keep_pre, std::int64_t n) {
  if (!lt_epilogues<T> || !fused || !has_bias) return cuda::Epilogue::none;
  const LtFusion lt = activation_info(act).lt;
  if (act == Activation::none) return cuda::Epilogue::bias;
  if (lt == LtFusion::relu && !keep_pre) return cuda::Epilogue::relu_bias;
  if (lt == LtFusion::gelu_tanh && n % 8 == 0) return cuda::Epilogue::gelu_aux_bias;
  return cuda::Epilogue::none;
}
#endif

/// Row-major GEMM on device D with an optional fused bias/activation; `pre` receives the pre-activation
/// when the caller needs it for backward.
template <class T, class D>
Tensor<T, D> gemm(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb,
                  const std::type_identity_t<Tensor<T, D>>* bias, Activation act,
                  std::type_identity_t<Tensor<T, D>>* pre, const char* op) {
  const GemmDims g = gemm_dims(a, b, ta, tb, op);
  if (bias) {
    check_defined(*bias, op);
    TG_CHECK(bias->rank() == 1 && bias->dim(0) == g.n, op, "bias must have shape (", g.n, ",), got ", bias->shape().str());
  }
  const bool fused = fused_linear();
  if constexpr (std::is_same_v<D, Cpu>) {
    if (pre == nullptr && fused) return cpu_gemm(a, b, ta, tb, bias, act, g);
    // Training, or the unfused path: keep z = op(A) op(B) + bias and apply the activation separately.
    Tensor<T, D> z = cpu_gemm(a, b, ta, tb, fused ? bias : nullptr, Activation::none, g);
    if (!fused && bias) z = add(z, *bias);
    if (pre) *pre = z;
    return activate(z, act);
  } else {
#if defined(TG_WITH_CUDA)
    Tensor<T, D> c(Shape{g.m, g.n});
    if (g.m == 0 || g.n == 0) return c;
    // cuBLASLt's GELU epilogue is the tanh form; activations it has no epilogue for run unfused. The aux
    // buffer of GELU_AUX_BIAS is the pre-activation backward needs.
    const cuda::Epilogue e = forward_epilogue<T>(fused, bias != nullptr, act, pre != nullptr, g.n);
    Tensor<T, D> aux;
    if (e == cuda::Epilogue::gelu_aux_bias) aux = Tensor<T, D>(Shape{g.m, g.n});
    const bool done = g.k > 0 && cuda::Lt::instance().matmul(lt_problem<T>(g, ta, tb, e), b.data(), a.data(), c.data(),
                                                             bias ? bias->data() : nullptr, aux.defined() ? aux.data() : nullptr);
    if (done && e != cuda::Epilogue::none) {
      if (pre) *pre = e == cuda::Epilogue::gelu_aux_bias ? aux : c;
      if (e == cuda::Epilogue::bias) return activate(c, act);
      return c;
    }
    if (!done) {
      if (g.k == 0) c = zeros<T, D>(Shape{g.m, g.n});
      else TG_CHECK(cuda::Lt::instance().matmul(lt_problem<T>(g, ta, tb, cuda::Epilogue::none), b.data(), a.data(), c.data()),
                    op, "cuBLASLt found no algorithm for (", g.m, ", ", g.k, ") @ (", g.k, ", ", g.n, ") in ", dtype_name<T>);
    }
    if (bias) c = add(c, *bias);
    if (pre) *pre = c;
    return activate(c, act);
#else
    cuda::require_device(op);
    return {};
#endif
  }
}

}  // namespace detail

namespace detail {

/// What a recorded linear layer leaves on its output's node (Tape::state) for its consumer: the
/// pre-activation, so that the next layer's input-gradient GEMM can apply act' and reduce the bias
/// gradient in its epilogue (DGELU_BGRAD) and deliver them here instead of a cotangent.
template <class T, class D>
struct LinearProducer {
  Tensor<T, D> z;
  Activation act = Activation::none;
  bool pending = false;  ///< the consumer has delivered dz and db
  Tensor<T, D> dz, db;
};

/// Whether the input-gradient GEMM of a layer can also apply the previous layer's act' and reduce its
/// bias gradient in the epilogue: cuBLASLt's DGELU_BGRAD, on CUDA, for GELU in bf16 (see
/// lt_dgelu_epilogue). Elsewhere the previous layer applies act' itself and gets its bias gradient from
/// its weight-gradient GEMM (matmul_bgrad): the same operations, so no fusion is lost.
template <class T, class D>
bool backward_fusion(Activation act, std::int64_t n) {
#if defined(TG_WITH_CUDA)
  if constexpr (std::is_same_v<D, Cuda>) return lt_dgelu_epilogue<T> && activation_info(act).lt == LtFusion::gelu_tanh && n % 8 == 0;
#endif
  (void)act, (void)n;
  return false;
}

/// The input gradient dz @ w^T of a linear layer; fused into the producer of x when x is the output of
/// a linear layer whose act' the GEMM's epilogue can apply (backward_fusion) and that nothing else consumed.
template <class T, class D>
void linear_input_gradient(Tape& t, const Trace& x, const Tensor<T, D>& dz, const Tensor<T, D>& w) {
  if (!t.owns(x)) return;
  auto* state = std::any_cast<std::shared_ptr<LinearProducer<T, D>>>(&t.state(x.node));
  LinearProducer<T, D>* producer = state ? state->get() : nullptr;
  if (producer != nullptr && t.uses(x.node) == 1 && fused_linear() && backward_fusion<T, D>(producer->act, producer->z.dim(1))) {
    std::tie(producer->dz, producer->db) = matmul_dact_bgrad(dz, w, true, producer->z, producer->act);
    producer->pending = true;
    return;
  }
  t.accumulate(x, matmul(dz, w, false, true));
}

}  // namespace detail

namespace detail {

/// Strided-batched GEMM of 3-d operands with one batch size: c[i] = op(a[i]) op(b[i]) -> (batch, m, n),
/// shapes checked by the caller. oneDNN's batched matmul on the CPU (a loop of gemm_f64 in double),
/// cuBLASLt's strided batch on CUDA.
template <class T, class D>
Tensor<T, D> batched_gemm(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb) {
  const std::int64_t batch = a.dim(0);
  const GemmDims g{ta ? a.dim(2) : a.dim(1), tb ? b.dim(1) : b.dim(2), ta ? a.dim(1) : a.dim(2)};
  Tensor<T, D> c(Shape{batch, g.m, g.n});
  if (c.size() == 0) return c;
  if (g.k == 0) return zeros<T, D>(c.shape());
  if constexpr (std::is_same_v<D, Cpu>) {
    if constexpr (std::is_same_v<T, double>) {
      cpu_kernel([g, batch, pa = a.data(), pb = b.data(), pc = c.data(), ta, tb] {
        for (std::int64_t i = 0; i < batch; ++i) gemm_f64(g, pa + i * g.m * g.k, pb + i * g.k * g.n, pc + i * g.m * g.n, ta, tb);
      });
    } else {
      auto& dnn = cpu::OneDnn::instance();
      if constexpr (std::is_same_v<T, bf16>) {
        if (!dnn.bf16_supported()) return cast<bf16>(batched_gemm(cast<float>(a), cast<float>(b), ta, tb));
      }
      const cpu::GemmShape s{g.m, g.n, g.k, ta, tb, std::is_same_v<T, bf16> ? cpu::GemmType::bf16 : cpu::GemmType::f32, false, {}, batch};
      cpu_kernel([&dnn, s, pa = a.data(), pb = b.data(), pc = c.data()] { dnn.gemm(s, pa, pb, nullptr, pc); });
    }
  } else {
#if defined(TG_WITH_CUDA)
    // The row-major swap of lt_problem, batch by batch: cuBLASLt's A is our b, its B our a.
    cuda::LtGemm p = lt_problem<T>(g, ta, tb, cuda::Epilogue::none);
    p.batch = batch, p.stride_a = g.k * g.n, p.stride_b = g.m * g.k, p.stride_d = g.m * g.n;
    TG_CHECK(cuda::Lt::instance().matmul(p, b.data(), a.data(), c.data()), "matmul", "cuBLASLt found no algorithm for ", batch,
             " x (", g.m, ", ", g.k, ") @ (", g.k, ", ", g.n, ") in ", dtype_name<T>);
#else
    cuda::require_device("matmul");
#endif
  }
  return c;
}

/// batched_gemm as a differentiable op: the cotangents are batched GEMMs too.
template <FloatElement T, Device D>
Tensor<T, D> bmm(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb) {
  Tensor<T, D> c = batched_gemm(a, b, ta, tb);
  if (recording(a, b)) {
    record(c, {a.trace(), b.trace()}, [xa = a.trace(), xb = b.trace(), a0 = a.untraced(), b0 = b.untraced(), ta, tb](
                                          Tape& t, const Tensor<T, D>& dc) {
      if (t.owns(xa)) t.accumulate(xa, ta ? bmm(b0, dc, tb, true) : bmm(dc, b0, false, !tb));
      if (t.owns(xb)) t.accumulate(xb, tb ? bmm(dc, a0, true, ta) : bmm(a0, dc, !ta, false));
    });
  }
  return c;
}

/// matmul of operands of rank >= 2 with NumPy's broadcasting over the leading (batch) dimensions.
template <FloatElement T, Device D>
Tensor<T, D> matmul_nd(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb) {
  check_defined(a, "matmul");
  check_defined(b, "matmul");
  TG_CHECK(a.rank() >= 2 && b.rank() >= 2, "matmul", "needs operands of rank >= 2, got ", a.shape().str(), " @ ", b.shape().str(),
           "; reshape a vector to (1, k) or (k, 1)");
  const std::int64_t ka = ta ? a.dim(-2) : a.dim(-1), kb = tb ? b.dim(-1) : b.dim(-2);
  TG_CHECK(ka == kb, "matmul", "inner dims differ: ", a.shape().str(), ta ? "^T" : "", " @ ", b.shape().str(), tb ? "^T" : "",
           " (", ka, " vs ", kb, "; the last two axes are the matrices)");
  const std::int64_t m = ta ? a.dim(-1) : a.dim(-2), n = tb ? b.dim(-2) : b.dim(-1);
  auto leading = [](const Shape& s) { return Shape(s.dims().first(static_cast<std::size_t>(s.rank() - 2))); };
  const Shape batch = broadcast_shapes(leading(a.shape()), leading(b.shape()), "matmul");
  auto with = [&](std::int64_t r, std::int64_t c) {
    std::vector<std::int64_t> dims(batch.dims().begin(), batch.dims().end());
    dims.push_back(r), dims.push_back(c);
    TG_CHECK(dims.size() <= static_cast<std::size_t>(Shape::max_rank), "matmul", "the result of ", a.shape().str(), " @ ",
             b.shape().str(), " would have rank ", dims.size(), " (at most ", Shape::max_rank, ")");
    return Shape(std::span<const std::int64_t>(dims));
  };
  const Shape out = with(m, n);
  // (..., m, k) @ (k, n): the batch folds into the rows of one 2-d GEMM.
  if (b.rank() == 2 && !ta && m > 0) return matmul(a.reshape({-1, a.dim(-1)}), b, false, tb).reshape(out);
  auto full = [&](const Tensor<T, D>& x) {
    const Shape s = with(x.dim(-2), x.dim(-1));
    return x.shape() == s ? x : broadcast_to(x, s);
  };
  const Tensor<T, D> af = full(a), bf = full(b);
  const std::int64_t nb = batch.numel();
  return bmm(af.reshape(Shape{nb, af.dim(-2), af.dim(-1)}), bf.reshape(Shape{nb, bf.dim(-2), bf.dim(-1)}), ta, tb).reshape(out);
}

}  // namespace detail

/// op(a) @ op(b), as jnp.matmul: for 2-d a (m, k) [stored (k, m) when transpose_a] and b (k, n) [stored
/// (n, k) when transpose_b] -> (m, n); for higher ranks the last two axes are the matrices and the
/// leading ones broadcast as NumPy's (a batched GEMM). bf16 inputs accumulate in f32 and round the result
/// once.
template <FloatElement T, Device D>
Tensor<T, D> matmul(const Tensor<T, D>& a, const Tensor<T, D>& b, bool transpose_a = false, bool transpose_b = false) {
  if (a.rank() != 2 || b.rank() != 2) return detail::matmul_nd(a, b, transpose_a, transpose_b);
  Tensor<T, D> c = detail::gemm(a.untraced(), b.untraced(), transpose_a, transpose_b, nullptr, Activation::none, nullptr, "matmul");
  if (detail::recording(a, b)) {
    // C = op(A) op(B): dA = dC op(B)^T (transposed back if A was), dB = op(A)^T dC (likewise).
    detail::record(c, {a.trace(), b.trace()},
                   [ta = a.trace(), tb = b.trace(), a0 = a.untraced(), b0 = b.untraced(), transpose_a, transpose_b](
                       detail::Tape& t, const Tensor<T, D>& dc) {
                     if (t.owns(ta))
                       t.accumulate(ta, transpose_a ? matmul(b0, dc, transpose_b, true) : matmul(dc, b0, false, !transpose_b));
                     if (t.owns(tb))
                       t.accumulate(tb, transpose_b ? matmul(dc, a0, true, transpose_a) : matmul(a0, dc, !transpose_a, false));
                   });
  }
  return c;
}

/// linear() that also returns the pre-activation z = x @ w + b, which its backward pass needs.
template <FloatElement T, Device D>
std::pair<Tensor<T, D>, Tensor<T, D>> linear_with_pre_activation(const Tensor<T, D>& x, const Tensor<T, D>& w,
                                                                 const Tensor<T, D>& b, Activation act) {
  Tensor<T, D> pre;
  const Tensor<T, D> bu = b.untraced();
  Tensor<T, D> y = detail::gemm(x.untraced(), w.untraced(), false, false, &bu, act, &pre, "linear");
  return {y, pre};
}

/// The fused layer act(x @ w + b): x (B, in), w (in, out), b (out,) -> (B, out). The bias and activation
/// run in the GEMM's epilogue (oneDNN post-ops, cuBLASLt epilogues) unless set_fused_linear(false).
/// Differentiable as one op: its backward computes dz = dy act'(z) once, the weight and bias gradients
/// in one GEMM (bias gradient in the epilogue on CUDA), and hands dz @ w^T to the previous linear layer
/// to fuse with that layer's act' (DGELU_BGRAD).
template <FloatElement T, Device D>
Tensor<T, D> linear(const Tensor<T, D>& x, const Tensor<T, D>& w, const Tensor<T, D>& b, Activation act = Activation::none) {
  if (!detail::recording(x, w, b)) {
    const Tensor<T, D> bu = b.untraced();
    return detail::gemm(x.untraced(), w.untraced(), false, false, &bu, act, nullptr, "linear");
  }
  auto [y, z] = linear_with_pre_activation(x, w, b, act);
  auto producer = std::make_shared<detail::LinearProducer<T, D>>();
  producer->z = z;
  producer->act = act;
  const std::int64_t node = detail::record_node(
      y, {x.trace(), w.trace(), b.trace()},
      [tx = x.trace(), tw = w.trace(), tb = b.trace(), x0 = x.untraced(), w0 = w.untraced(), producer](detail::Tape& t,
                                                                                                        std::int64_t node) {
                   const Tensor<T, D> dy = t.cotangent<T, D>(node);
                   if (!dy.defined() && !producer->pending) return;  // no gradient reached this layer
                   Tensor<T, D> dz, db;
                   if (producer->pending) {
                     // Delivered by the only consumer (fusion requires one), so dy itself is undefined.
                     dz = producer->dz, db = producer->db;
                   } else {
                     dz = detail::activation_backward(dy, producer->z, producer->act);
                   }
                   if (t.owns(tw) || t.owns(tb)) {
                     if (db.defined()) {
                       t.accumulate(tw, matmul(x0, dz, true, false));
                       t.accumulate(tb, db);
                     } else {
                       auto [dw, dbias] = matmul_bgrad(x0, dz);
                       t.accumulate(tw, dw);
                       t.accumulate(tb, dbias);
                     }
                   }
                   detail::linear_input_gradient(t, tx, dz, w0);
                   producer->dz = producer->db = Tensor<T, D>{};  // free them early
                 });
  detail::active_tape->state(node) = producer;
  return y;
}

/// Backward through a layer's activation, fused into the GEMM that produces its input gradient:
/// g = a @ op(b); returns {dz = g * act'(z), db = sum over rows of dz}. With a = dz of the next layer
/// and b = its weight (transpose_b), this is cuBLASLt's DGELU_BGRAD on CUDA in bf16 (see
/// lt_dgelu_epilogue); otherwise the GEMM, act' by tapegrad's functor, and a column sum.
template <FloatElement T, Device D>
std::pair<Tensor<T, D>, Tensor<T, D>> matmul_dact_bgrad(const Tensor<T, D>& a, const Tensor<T, D>& b, bool transpose_b,
                                                        const Tensor<T, D>& z, Activation act) {
  const detail::GemmDims g = detail::gemm_dims(a, b, false, transpose_b, "matmul_dact_bgrad");
  TG_CHECK(z.shape() == Shape({g.m, g.n}), "matmul_dact_bgrad", "pre-activation must have shape (", g.m, ", ", g.n,
           "), got ", z.shape().str());
#if defined(TG_WITH_CUDA)
  if constexpr (std::is_same_v<D, Cuda> && detail::lt_dgelu_epilogue<T>) {
    if (fused_linear() && activation_info(act).lt == LtFusion::gelu_tanh && g.n % 8 == 0 && g.k > 0 && g.m > 0) {
      Tensor<T, D> dz(Shape{g.m, g.n}), db(Shape{g.n});
      if (cuda::Lt::instance().matmul(detail::lt_problem<T>(g, false, transpose_b, cuda::Epilogue::dgelu_bgrad), b.data(),
                                      a.data(), dz.data(), db.data(), z.data()))
        return {dz, db};
    }
  }
#endif
  const Tensor<T, D> dz = detail::activation_backward(matmul(a, b, false, transpose_b), z, act);
  return {dz, sum(dz, 0)};
}

/// The weight and bias gradients of a layer in one GEMM: {dw = x^T @ dz, db = sum over rows of dz}.
/// On CUDA the bias gradient comes from the GEMM's epilogue (BGRADA in the row-major swap), except in
/// f64 (see lt_epilogues).
template <FloatElement T, Device D>
std::pair<Tensor<T, D>, Tensor<T, D>> matmul_bgrad(const Tensor<T, D>& x, const Tensor<T, D>& dz) {
  [[maybe_unused]] const detail::GemmDims g = detail::gemm_dims(x, dz, true, false, "matmul_bgrad");
#if defined(TG_WITH_CUDA)
  if constexpr (std::is_same_v<D, Cuda> && detail::lt_epilogues<T>) {
    if (fused_linear() && g.k > 0 && g.m > 0 && g.n > 0) {
      // Row-major dw (in, out) = x^T dz; cuBLASLt sees dw^T = dz^T x with dz^T as its A operand, whose
      // sums over k (the batch) are the bias gradient.
      Tensor<T, D> dw(Shape{g.m, g.n}), db(Shape{g.n});
      if (cuda::Lt::instance().matmul(detail::lt_problem<T>(g, true, false, cuda::Epilogue::bgrada), dz.data(), x.data(),
                                      dw.data(), db.data()))
        return {dw, db};
    }
  }
#endif
  return {matmul(x, dz, true, false), sum(dz, 0)};
}

}  // namespace tg
