// What an op asks of a GEMM backend, in the op's terms: the operands' layout, the epilogue it would like
// fused (bias, activation, the activation's derivative, a bias gradient), and what the backend answers:
// the result, plus which of those it did. The op computes whatever was not fused with its own ops, so
// every backend gives the same results whatever it fuses.
#pragma once

#include <atomic>
#include <cstdint>
#include <tuple>

#include "tapegrad/config.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/math/activation.hpp"

TG_BEGIN_NAMESPACE

namespace detail {
inline std::atomic<bool> fused_linear_enabled{true};
inline std::atomic<bool> tf32_enabled{false};
}  // namespace detail

/// Whether the GEMM backends fuse bias, activation and the backward epilogues into their GEMMs (default)
/// or leave them all to separate elementwise ops. Both give the same results up to rounding; tests
/// compare them.
inline void set_fused_linear(bool on) { detail::fused_linear_enabled = on; }
inline bool fused_linear() { return detail::fused_linear_enabled; }

/// Opt in to TF32 tensor cores for float32 GEMMs on CUDA (10-bit mantissa products, f32 accumulation).
inline void set_allow_tf32(bool on) { detail::tf32_enabled = on; }
inline bool allow_tf32() { return detail::tf32_enabled; }

namespace backend {

/// Which bias gradient the backend may compute in the GEMM's epilogue.
enum class BiasGrad {
  none,
  of_result,  ///< the column sums of the result c (over m): db of the layer whose dz this GEMM produces
  of_b,       ///< the sums of op(b) over k (n values): db = sum over rows of dz in dw = x^T dz
};

/// One row-major GEMM as an op asks for it: c (m, n) = op(a) op(b) with op(a) (m, k) [a stored (k, m) when
/// trans_a] and op(b) (k, n) [b stored (n, k) when trans_b]; `batch` > 1: that many GEMMs over operands
/// laid out (batch, ., .) one matrix after another. The rest is what the op would like fused; the backend
/// fuses what it can and says which in GemmResult.
struct GemmProblem {
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  std::int64_t batch = 1;
  const char* op = "matmul";  ///< names the op in errors

  // forward: c = act(c + bias), batch 1 only
  bool bias = false;
  Activation act = Activation::none;
  bool keep_pre = false;  ///< the backward pass needs the pre-activation c + bias: return it

  // backward: c = (op(a) op(b)) * act'(pre) with `pre` given (m, n); a bias gradient as asked
  Activation dact = Activation::none;
  BiasGrad bias_grad = BiasGrad::none;
};

/// The backend's answer: the result and what it fused. Whatever is not marked done the op computes:
/// c + bias, then `pre` = that, then act(pre); dc * act'(pre); the bias gradient's sums.
template <Element T, Device D>
struct GemmResult {
  Tensor<T, D> c;          ///< (m, n) or (batch, m, n)
  Tensor<T, D> pre;        ///< the pre-activation, when act_done and the problem keeps it
  Tensor<T, D> bias_grad;  ///< (n,), when bias_grad_done
  bool bias_done = false, act_done = false, dact_done = false, bias_grad_done = false;
};

/// Which of a convolution's three computations: y = conv(x, w); dx from dy and w (the transpose of the
/// forward in x); dw from x and dy (its transpose in w).
enum class ConvPass { forward, backward_data, backward_weights };

/// One 2-d convolution as `tg::conv` asks for it, in JAX's conv_general_dilated terms with Flax's layouts:
/// x (n, h, w, c) NHWC, the kernel (kh, kw, c / groups, o) HWIO, y (n, oh, ow, o); window strides, kernel
/// (rhs) dilation, low and high padding per spatial axis (non-negative), and the feature groups. For the
/// forward pass the op may ask for a bias (o,) and an activation fused; the backend says what it did.
struct ConvProblem {
  std::int64_t n = 0, h = 0, w = 0, c = 0;
  std::int64_t kh = 0, kw = 0, o = 0;
  std::int64_t oh = 0, ow = 0;
  std::int64_t stride[2] = {1, 1}, dilation[2] = {1, 1}, pad_lo[2] = {0, 0}, pad_hi[2] = {0, 0};
  std::int64_t groups = 1;
  const char* op = "conv";  ///< names the op in errors

  bool bias = false;                  ///< forward: + bias (o,)
  Activation act = Activation::none;  ///< forward: then act, unless the op keeps the pre-activation

  auto key() const {
    return std::tuple(n, h, w, c, kh, kw, o, oh, ow, stride[0], stride[1], dilation[0], dilation[1], pad_lo[0], pad_lo[1], pad_hi[0],
                      pad_hi[1], groups, bias, static_cast<int>(act));
  }
  friend bool operator<(const ConvProblem& a, const ConvProblem& b) { return a.key() < b.key(); }
  std::int64_t x_size() const { return n * h * w * c; }
  std::int64_t w_size() const { return kh * kw * (c / groups) * o; }
  std::int64_t y_size() const { return n * oh * ow * o; }
};

/// What a convolution backend did: ran the pass at all (false: the op runs its own loop, as for f64 on
/// the CPU), and for the forward pass whether it added the bias and applied the activation.
struct ConvResult {
  bool done = false, bias_done = false, act_done = false;
};

}  // namespace backend
TG_END_NAMESPACE
