// Convolutions and pooling with JAX's names and semantics and Flax's layouts: tg::conv
// (jax.lax.conv_general_dilated on NHWC inputs and HWIO kernels, as flax.linen.Conv), the fused conv + bias
// + activation, tg::max_pool and tg::avg_pool (flax.linen's). Each pass of a convolution goes through the
// convolution door (backend/conv.hpp: oneDNN on the CPU, cuDNN on CUDA) or, for f64, the loops below,
// which are also the reference the tests hold the vendor libraries to. Derivatives: a convolution is
// linear in each operand, and its three passes (forward, backward data, backward weights) are each other's
// transposes, so each is an op whose backward rule is made of the other two: differentiable to any order.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/conv.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/matmul.hpp"
#include "tapegrad/ops/reduce.hpp"

TG_BEGIN_NAMESPACE

/// Window strides, kernel dilation or a pooling window: (height, width).
using Window2 = std::array<std::int64_t, 2>;

/// Padding of a convolution or a pooling window, as JAX's `padding`: "SAME" (the output has ceil(in /
/// stride) rows and columns; the padding split as evenly as possible, the extra one at the end), "VALID"
/// (none), or explicit (low, high) pairs per spatial axis, non-negative.
struct Padding {
  enum class Kind { same, valid, explicit_pairs } kind = Kind::valid;
  std::array<std::pair<std::int64_t, std::int64_t>, 2> pairs{};

  Padding(std::string_view name) {  // NOLINT(google-explicit-constructor): padding "SAME" as in JAX
    if (name == "SAME") kind = Kind::same;
    else if (name == "VALID") kind = Kind::valid;
    else ::tg::detail::fail("padding", "unknown padding \"", std::string(name), "\": use \"SAME\", \"VALID\" or {{low, high}, {low, high}}");
  }
  Padding(const char* name) : Padding(std::string_view(name)) {}  // NOLINT(google-explicit-constructor)
  Padding(std::pair<std::int64_t, std::int64_t> h, std::pair<std::int64_t, std::int64_t> w) : kind(Kind::explicit_pairs), pairs{h, w} {}
  std::string str() const {
    if (kind == Kind::same) return "\"SAME\"";
    if (kind == Kind::valid) return "\"VALID\"";
    return ::tg::detail::concat("((", pairs[0].first, ", ", pairs[0].second, "), (", pairs[1].first, ", ", pairs[1].second, "))");
  }
};

namespace detail {

/// The geometry of a convolution (or of a pooling window, with groups = channels) of x (n, h, w, c) by a
/// window (kh, kw): JAX's padtype_to_pads and output sizes, every argument checked with the op's name.
inline backend::ConvProblem conv_geometry(const Shape& x, std::int64_t kh, std::int64_t kw, std::int64_t o, Window2 strides,
                                          const Padding& padding, Window2 dilation, std::int64_t groups, const char* op) {
  TG_CHECK(x.rank() == 4, op, "needs x of rank 4 (batch, height, width, channels: NHWC), got ", x.str(), "; reshape a single image to (1, h, w, c)");
  TG_CHECK(strides[0] >= 1 && strides[1] >= 1, op, "window strides must be >= 1, got (", strides[0], ", ", strides[1], ")");
  TG_CHECK(dilation[0] >= 1 && dilation[1] >= 1, op, "dilation must be >= 1, got (", dilation[0], ", ", dilation[1], ")");
  TG_CHECK(kh >= 1 && kw >= 1, op, "the window must be at least 1 x 1, got (", kh, ", ", kw, ")");
  backend::ConvProblem p;
  p.op = op;
  p.n = x[0], p.h = x[1], p.w = x[2], p.c = x[3];
  p.kh = kh, p.kw = kw, p.o = o, p.groups = groups;
  p.stride[0] = strides[0], p.stride[1] = strides[1], p.dilation[0] = dilation[0], p.dilation[1] = dilation[1];
  const std::int64_t in[2] = {p.h, p.w}, k[2] = {kh, kw};
  std::int64_t out[2];
  for (int a = 0; a < 2; ++a) {
    const std::int64_t span = (k[a] - 1) * dilation[a] + 1;  // the dilated window
    if (padding.kind == Padding::Kind::same) {
      out[a] = (in[a] + strides[a] - 1) / strides[a];
      const std::int64_t total = std::max<std::int64_t>(0, (out[a] - 1) * strides[a] + span - in[a]);
      p.pad_lo[a] = total / 2, p.pad_hi[a] = total - total / 2;
    } else {
      if (padding.kind == Padding::Kind::explicit_pairs) p.pad_lo[a] = padding.pairs[a].first, p.pad_hi[a] = padding.pairs[a].second;
      TG_CHECK(p.pad_lo[a] >= 0 && p.pad_hi[a] >= 0, op, "padding ", padding.str(), " has a negative side; tapegrad pads with >= 0 only");
      const std::int64_t padded = in[a] + p.pad_lo[a] + p.pad_hi[a];
      TG_CHECK(padded >= span, op, "the ", a == 0 ? "height" : "width", " of x ", x.str(), " with padding ", padding.str(), " is ", padded,
               ", smaller than the (dilated) window ", span);
      out[a] = (padded - span) / strides[a] + 1;
    }
  }
  p.oh = out[0], p.ow = out[1];
  return p;
}

/// The convolution's checks on the kernel (kh, kw, c / groups, o) against x, then its geometry.
template <class T, class D>
backend::ConvProblem conv_problem(const Tensor<T, D>& x, const Tensor<T, D>& w, Window2 strides, const Padding& padding, Window2 dilation,
                                  std::int64_t groups, const char* op) {
  check_defined(x, op);
  check_defined(w, op);
  TG_CHECK(x.rank() == 4, op, "needs x of rank 4 (batch, height, width, channels: NHWC), got ", x.shape().str(),
           "; reshape a single image to (1, h, w, c)");
  TG_CHECK(w.rank() == 4, op, "needs a kernel of rank 4 (height, width, in / groups, out: HWIO), got ", w.shape().str());
  TG_CHECK(groups >= 1, op, "feature_group_count must be >= 1, got ", groups);
  TG_CHECK(x.rank() == 4 && x.dim(3) % groups == 0 && w.dim(2) * groups == x.dim(3), op, "x ", x.shape().str(), " has ",
           x.rank() == 4 ? x.dim(3) : 0, " channels; a kernel ", w.shape().str(), " with feature_group_count ", groups, " needs ",
           w.dim(2) * groups, " (in / groups = ", w.dim(2), ")");
  TG_CHECK(w.dim(3) % groups == 0, op, "the kernel's ", w.dim(3), " output features do not split into ", groups, " groups");
  return conv_geometry(x.shape(), w.dim(0), w.dim(1), w.dim(3), strides, padding, dilation, groups, op);
}

// The loops: one output element per item, the same on the CPU and on CUDA. f64 runs them (oneDNN has no
// f64 convolution; exact on CUDA too), and the tests compare the vendor libraries with them.

/// y (n, oh, ow, o) = sum over the window and the group's input channels of x * w.
template <class T>
struct ConvForwardFn {
  const T* x;
  const T* w;
  T* y;
  backend::ConvProblem p;
  TG_HD void operator()(std::int64_t e) const {
    using C = compute_t<T>;
    const std::int64_t o = e % p.o, ow = e / p.o % p.ow, oh = e / (p.o * p.ow) % p.oh, n = e / (p.o * p.ow * p.oh);
    const std::int64_t ig = p.c / p.groups, g = o / (p.o / p.groups);
    C acc = 0;
    for (std::int64_t kh = 0; kh < p.kh; ++kh) {
      const std::int64_t ih = oh * p.stride[0] - p.pad_lo[0] + kh * p.dilation[0];
      if (ih < 0 || ih >= p.h) continue;
      for (std::int64_t kw = 0; kw < p.kw; ++kw) {
        const std::int64_t iw = ow * p.stride[1] - p.pad_lo[1] + kw * p.dilation[1];
        if (iw < 0 || iw >= p.w) continue;
        const T* xp = x + ((n * p.h + ih) * p.w + iw) * p.c + g * ig;
        const T* wp = w + (kh * p.kw + kw) * ig * p.o + o;
        for (std::int64_t i = 0; i < ig; ++i) acc += convert_from<C>(xp[i]) * convert_from<C>(wp[i * p.o]);
      }
    }
    y[e] = convert_to<T>(acc);
  }
};

/// dx (n, h, w, c) = sum over the outputs whose window holds (h, w) and the group's output features of dy * w.
template <class T>
struct ConvBackwardDataFn {
  const T* dy;
  const T* w;
  T* dx;
  backend::ConvProblem p;
  TG_HD void operator()(std::int64_t e) const {
    using C = compute_t<T>;
    const std::int64_t c = e % p.c, iw = e / p.c % p.w, ih = e / (p.c * p.w) % p.h, n = e / (p.c * p.w * p.h);
    const std::int64_t ig = p.c / p.groups, og = p.o / p.groups, g = c / ig, ci = c % ig;
    C acc = 0;
    for (std::int64_t kh = 0; kh < p.kh; ++kh) {
      const std::int64_t th = ih + p.pad_lo[0] - kh * p.dilation[0];
      if (th < 0 || th % p.stride[0] != 0 || th / p.stride[0] >= p.oh) continue;
      for (std::int64_t kw = 0; kw < p.kw; ++kw) {
        const std::int64_t tw = iw + p.pad_lo[1] - kw * p.dilation[1];
        if (tw < 0 || tw % p.stride[1] != 0 || tw / p.stride[1] >= p.ow) continue;
        const T* dyp = dy + ((n * p.oh + th / p.stride[0]) * p.ow + tw / p.stride[1]) * p.o + g * og;
        const T* wp = w + ((kh * p.kw + kw) * ig + ci) * p.o + g * og;
        for (std::int64_t oo = 0; oo < og; ++oo) acc += convert_from<C>(dyp[oo]) * convert_from<C>(wp[oo]);
      }
    }
    dx[e] = convert_to<T>(acc);
  }
};

/// dw (kh, kw, i, o) = sum over the batch and the outputs of x * dy.
template <class T>
struct ConvBackwardWeightsFn {
  const T* x;
  const T* dy;
  T* dw;
  backend::ConvProblem p;
  TG_HD void operator()(std::int64_t e) const {
    using C = compute_t<T>;
    const std::int64_t ig = p.c / p.groups, og = p.o / p.groups;
    const std::int64_t o = e % p.o, i = e / p.o % ig, kw = e / (p.o * ig) % p.kw, kh = e / (p.o * ig * p.kw);
    const std::int64_t c = o / og * ig + i;
    C acc = 0;
    for (std::int64_t n = 0; n < p.n; ++n)
      for (std::int64_t oh = 0; oh < p.oh; ++oh) {
        const std::int64_t ih = oh * p.stride[0] - p.pad_lo[0] + kh * p.dilation[0];
        if (ih < 0 || ih >= p.h) continue;
        for (std::int64_t ow = 0; ow < p.ow; ++ow) {
          const std::int64_t iw = ow * p.stride[1] - p.pad_lo[1] + kw * p.dilation[1];
          if (iw < 0 || iw >= p.w) continue;
          acc += convert_from<C>(x[((n * p.h + ih) * p.w + iw) * p.c + c]) * convert_from<C>(dy[((n * p.oh + oh) * p.ow + ow) * p.o + o]);
        }
      }
    dw[e] = convert_to<T>(acc);
  }
};

/// One pass of p, untraced: the device's library where it runs it, else the loop. forward: (x, w) -> y
/// [+ bias, then act where fused: see `fused`]; backward_data: (dy, w) -> dx; backward_weights: (x, dy) -> dw.
template <class T, class D>
Tensor<T, D> conv_pass(backend::ConvPass pass, const backend::ConvProblem& p, const Tensor<T, D>& a, const Tensor<T, D>& b,
                       const std::type_identity_t<Tensor<T, D>>* bias = nullptr, backend::ConvResult* fused = nullptr,
                       bool reference = false) {
  using backend::ConvPass;
  const Shape out_shape = pass == ConvPass::forward         ? Shape{p.n, p.oh, p.ow, p.o}
                          : pass == ConvPass::backward_data ? Shape{p.n, p.h, p.w, p.c}
                                                            : Shape{p.kh, p.kw, p.c / p.groups, p.o};
  Tensor<T, D> out(out_shape);
  const backend::ConvResult r = reference ? backend::ConvResult{} : backend::conv(pass, p, a, b, bias, out);
  if (fused) *fused = r;
  if (r.done || out.size() == 0) return out;
  // The loop; a pass of which some sum is empty (c or o of 0) writes zeros.
  switch (pass) {
    case ConvPass::forward: index_map<D>(out.size(), ConvForwardFn<T>{a.data(), b.data(), out.data(), p}, p.kh * p.kw * p.c / p.groups); break;
    case ConvPass::backward_data: index_map<D>(out.size(), ConvBackwardDataFn<T>{a.data(), b.data(), out.data(), p}, p.kh * p.kw * p.o / p.groups); break;
    case ConvPass::backward_weights: index_map<D>(out.size(), ConvBackwardWeightsFn<T>{a.data(), b.data(), out.data(), p}, p.n * p.oh * p.ow); break;
  }
  return out;
}

template <FloatElement T, Device D>
Tensor<T, D> conv_forward(const Tensor<T, D>& x, const Tensor<T, D>& w, const backend::ConvProblem& p);
template <FloatElement T, Device D>
Tensor<T, D> conv_backward_data(const Tensor<T, D>& dy, const Tensor<T, D>& w, const backend::ConvProblem& p);
template <FloatElement T, Device D>
Tensor<T, D> conv_backward_weights(const Tensor<T, D>& x, const Tensor<T, D>& dy, const backend::ConvProblem& p);

/// The JVP of a product-like op f(a, b), linear in each: f(ta, b) + f(a, tb) (terms without a tangent
/// left out; undefined when neither has one).
template <FloatElement T, Device D, class F>
Tensor<T, D> bilinear_jvp(const Tensor<T, D>& a, const Tensor<T, D>& b, const Tensor<T, D>& ta, const Tensor<T, D>& tb, F f) {
  Tensor<T, D> r = ta.defined() ? f(ta, b) : Tensor<T, D>{};
  if (tb.defined()) r = r.defined() ? add(r, f(a, tb)) : f(a, tb);
  return r;
}

/// y = conv(x, w), differentiable: dx = backward_data(dy, w), dw = backward_weights(x, dy).
template <FloatElement T, Device D>
Tensor<T, D> conv_forward(const Tensor<T, D>& x, const Tensor<T, D>& w, const backend::ConvProblem& p) {
  Tensor<T, D> y = conv_pass(backend::ConvPass::forward, p, x.untraced(), w.untraced());
  if (recording(x, w))
    record(y, {x.trace(), w.trace()}, [tx = x.trace(), tw = w.trace(), x, w, p](Tape& t, const Tensor<T, D>& dy) {
      if (t.owns(tx)) t.accumulate(tx, conv_backward_data(dy, w, p));
      if (t.owns(tw)) t.accumulate(tw, conv_backward_weights(x, dy, p));
    }, [&](const Tangents& tangent) {
      return bilinear_jvp(x, w, tangent(x), tangent(w), [&](const Tensor<T, D>& a, const Tensor<T, D>& b) { return conv_forward(a, b, p); });
    }, "conv");
  return y;
}

/// dx = backward_data(dy, w): linear in dy and in w; its transpose in dy is the forward pass, in w the
/// backward-weights pass.
template <FloatElement T, Device D>
Tensor<T, D> conv_backward_data(const Tensor<T, D>& dy, const Tensor<T, D>& w, const backend::ConvProblem& p) {
  Tensor<T, D> dx = conv_pass(backend::ConvPass::backward_data, p, dy.untraced(), w.untraced());
  if (recording(dy, w))
    record(dx, {dy.trace(), w.trace()}, [tdy = dy.trace(), tw = w.trace(), dy, w, p](Tape& t, const Tensor<T, D>& g) {
      if (t.owns(tdy)) t.accumulate(tdy, conv_forward(g, w, p));
      if (t.owns(tw)) t.accumulate(tw, conv_backward_weights(g, dy, p));
    }, [&](const Tangents& tangent) {
      return bilinear_jvp(dy, w, tangent(dy), tangent(w), [&](const Tensor<T, D>& a, const Tensor<T, D>& b) { return conv_backward_data(a, b, p); });
    }, "conv");
  return dx;
}

/// dw = backward_weights(x, dy): linear in x and in dy; its transposes are the backward-data pass (in x)
/// and the forward pass (in dy).
template <FloatElement T, Device D>
Tensor<T, D> conv_backward_weights(const Tensor<T, D>& x, const Tensor<T, D>& dy, const backend::ConvProblem& p) {
  Tensor<T, D> dw = conv_pass(backend::ConvPass::backward_weights, p, x.untraced(), dy.untraced());
  if (recording(x, dy))
    record(dw, {x.trace(), dy.trace()}, [tx = x.trace(), tdy = dy.trace(), x, dy, p](Tape& t, const Tensor<T, D>& g) {
      if (t.owns(tx)) t.accumulate(tx, conv_backward_data(dy, g, p));
      if (t.owns(tdy)) t.accumulate(tdy, conv_forward(x, g, p));
    }, [&](const Tangents& tangent) {
      return bilinear_jvp(x, dy, tangent(x), tangent(dy), [&](const Tensor<T, D>& a, const Tensor<T, D>& b) { return conv_backward_weights(a, b, p); });
    }, "conv");
  return dw;
}

/// An op over NHWC images applied to examples of x inside tg::vmap (the batch axes folded into n), the
/// other operands shared; a batched other operand is an error naming the op.
template <class T, class D, class F>
Tensor<T, D> fold_vmap_batch(const Tensor<T, D>& x, bool others_batched, const char* op, F&& f) {
  TG_CHECK(!others_batched, op, "inside tg::vmap takes a batch of images with one kernel (and bias) for all; a kernel (or bias) per "
                                "example is not supported yet, nor are per-example gradients of one (tg::vmap of tg::grad): vmap over the "
                                "images only, with the kernel captured or passed as std::nullopt outside a grad, or loop over the examples");
  TG_CHECK(x.rank() == 4, op, "needs x of rank 4 per example (batch, height, width, channels), got ", x.shape().str(), " (inside tg::vmap)");
  const Tensor<T, D> px = x.physical();
  const Tensor<T, D> y = f(px.reshape({-1, x.dim(1), x.dim(2), x.dim(3)}));
  return as_batched(y.reshape(with_batch(x.batch_levels(), Shape{x.dim(0), y.dim(1), y.dim(2), y.dim(3)}, op)), x.batch_levels());
}

}  // namespace detail

/// jax.lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation,
/// feature_group_count=groups, dimension_numbers=("NHWC", "HWIO", "NHWC")): x (n, h, w, c), w (kh, kw,
/// c / groups, o) -> (n, oh, ow, o). Differentiable to any order in both operands; inside tg::vmap, x may
/// carry the batch (w shared).
template <FloatElement T, Device D>
Tensor<T, D> conv(const Tensor<T, D>& x, const Tensor<T, D>& w, Window2 strides = {1, 1}, const Padding& padding = "SAME",
                  Window2 dilation = {1, 1}, std::int64_t feature_group_count = 1) {
  if (detail::batched(x, w))
    return detail::fold_vmap_batch(x, detail::batched(w), "conv", [&](const Tensor<T, D>& xs) {
      return conv(xs, w, strides, padding, dilation, feature_group_count);
    });
  return detail::conv_forward(x, w, detail::conv_problem(x, w, strides, padding, dilation, feature_group_count, "conv"));
}

/// The fused layer act(conv(x, w) + b), as flax.linen.Conv followed by an activation: b (o,). The bias
/// (and, where nothing differentiates it, the activation) run in the convolution's epilogue (oneDNN
/// post-ops on the CPU); when traced, the pre-activation is kept and the activation is its own op.
template <FloatElement T, Device D>
Tensor<T, D> conv(const Tensor<T, D>& x, const Tensor<T, D>& w, const Tensor<T, D>& b, Activation act, Window2 strides = {1, 1},
                  const Padding& padding = "SAME", Window2 dilation = {1, 1}, std::int64_t feature_group_count = 1) {
  if (detail::batched(x, w, b))
    return detail::fold_vmap_batch(x, detail::batched(w, b), "conv", [&](const Tensor<T, D>& xs) {
      return conv(xs, w, b, act, strides, padding, dilation, feature_group_count);
    });
  const backend::ConvProblem p0 = detail::conv_problem(x, w, strides, padding, dilation, feature_group_count, "conv");
  detail::check_defined(b, "conv");
  TG_CHECK(b.rank() == 1 && b.dim(0) == p0.o, "conv", "bias must have shape (", p0.o, ",) for a kernel ", w.shape().str(), ", got ",
           b.shape().str());
  const bool traced = detail::recording(x, w, b);
  // Under two differentiating transformations: the primitives, each traced to any order.
  if (traced && (detail::higher_order() || detail::forward_mode())) return detail::activate(add(detail::conv_forward(x, w, p0), b), act);
  backend::ConvProblem p = p0;
  p.bias = fused_linear();
  p.act = traced || !fused_linear() ? Activation::none : act;
  backend::ConvResult r;
  const Tensor<T, D> bu = b.untraced();
  Tensor<T, D> z = detail::conv_pass(backend::ConvPass::forward, p, x.untraced(), w.untraced(), &bu, &r);
  if (!r.bias_done) z = add(z, bu);
  if (traced) {
    // z = conv(x, w) + b as one recorded node: dx and dw from dz as conv_forward's, db the sum of dz over n, h, w.
    detail::record(z, {x.trace(), w.trace(), b.trace()},
                   [tx = x.trace(), tw = w.trace(), tb = b.trace(), x, w, p0](detail::Tape& t, const Tensor<T, D>& dz) {
                     if (t.owns(tx)) t.accumulate(tx, detail::conv_backward_data(dz, w, p0));
                     if (t.owns(tw)) t.accumulate(tw, detail::conv_backward_weights(x, dz, p0));
                     if (t.owns(tb)) t.accumulate(tb, sum(dz.reshape({-1, p0.o}), 0));
                   });
  }
  return r.act_done ? z : detail::activate(z, act);
}

namespace detail {

/// The max over each window of x (n, h, w, c), padding excluded, and where it was: the row-major index
/// (h * w + w) in its image plane of the first maximum (-1 for a window of padding only, whose max is -inf
/// and which passes no gradient).
template <class T>
struct MaxPoolFn {
  using value_type = T;
  const T* x;
  T* y;
  std::int32_t* at;
  backend::ConvProblem p;
  TG_HD void operator()(std::int64_t e) const {
    using C = compute_t<T>;
    const std::int64_t c = e % p.c, ow = e / p.c % p.ow, oh = e / (p.c * p.ow) % p.oh, n = e / (p.c * p.ow * p.oh);
    C best = static_cast<C>(-HUGE_VAL);
    std::int64_t where = -1;
    for (std::int64_t kh = 0; kh < p.kh; ++kh) {
      const std::int64_t ih = oh * p.stride[0] - p.pad_lo[0] + kh;
      if (ih < 0 || ih >= p.h) continue;
      for (std::int64_t kw = 0; kw < p.kw; ++kw) {
        const std::int64_t iw = ow * p.stride[1] - p.pad_lo[1] + kw;
        if (iw < 0 || iw >= p.w) continue;
        const C v = convert_from<C>(x[((n * p.h + ih) * p.w + iw) * p.c + c]);
        if (where < 0 || v > best || (v != v && best == best)) best = v, where = ih * p.w + iw;  // the first max; NaN wins, as lax.max
      }
    }
    y[e] = convert_to<T>(best);
    at[e] = static_cast<std::int32_t>(where);
  }
};

/// The windows over (n, h, w, c) in the output that hold input position (ih, iw): a range of rows and one
/// of columns (empty where none).
struct PoolCover {
  std::int64_t oh0, oh1, ow0, ow1;
  TG_HD static std::int64_t first(std::int64_t i, std::int64_t pad, std::int64_t k, std::int64_t s) {
    const std::int64_t t = i + pad - (k - 1);  // the first window start that reaches i
    return t <= 0 ? 0 : (t + s - 1) / s;
  }
  TG_HD PoolCover(const backend::ConvProblem& p, std::int64_t ih, std::int64_t iw)
      : oh0(first(ih, p.pad_lo[0], p.kh, p.stride[0])),
        oh1((ih + p.pad_lo[0]) / p.stride[0] + 1 < p.oh ? (ih + p.pad_lo[0]) / p.stride[0] + 1 : p.oh),
        ow0(first(iw, p.pad_lo[1], p.kw, p.stride[1])),
        ow1((iw + p.pad_lo[1]) / p.stride[1] + 1 < p.ow ? (iw + p.pad_lo[1]) / p.stride[1] + 1 : p.ow) {}
};

/// dx of max_pool: each input element gathers dy from the windows whose maximum it was (no atomics).
template <class T>
struct MaxPoolScatterFn {
  using value_type = T;
  const T* dy;
  const std::int32_t* at;
  T* dx;
  backend::ConvProblem p;
  TG_HD void operator()(std::int64_t e) const {
    using C = compute_t<T>;
    const std::int64_t c = e % p.c, iw = e / p.c % p.w, ih = e / (p.c * p.w) % p.h, n = e / (p.c * p.w * p.h);
    const PoolCover cover(p, ih, iw);
    const std::int32_t me = static_cast<std::int32_t>(ih * p.w + iw);
    C acc = 0;
    for (std::int64_t oh = cover.oh0; oh < cover.oh1; ++oh)
      for (std::int64_t ow = cover.ow0; ow < cover.ow1; ++ow) {
        const std::int64_t o = ((n * p.oh + oh) * p.ow + ow) * p.c + c;
        if (at[o] == me) acc += convert_from<C>(dy[o]);
      }
    dx[e] = convert_to<T>(acc);
  }
};

/// The transpose of MaxPoolScatterFn: each output takes g at its window's maximum.
template <class T>
struct MaxPoolGatherFn {
  const T* g;
  const std::int32_t* at;
  T* out;
  backend::ConvProblem p;
  TG_HD void operator()(std::int64_t e) const {
    const std::int64_t c = e % p.c, n = e / (p.c * p.ow * p.oh);
    out[e] = at[e] < 0 ? T(0) : g[(n * p.h * p.w + at[e]) * p.c + c];
  }
};

/// The divisor of an average-pooling window: its size, or (count_include_pad false) its positions inside x.
TG_HD inline std::int64_t pool_count(const backend::ConvProblem& p, std::int64_t oh, std::int64_t ow, bool include_pad) {
  if (include_pad) return p.kh * p.kw;
  const std::int64_t h0 = oh * p.stride[0] - p.pad_lo[0], w0 = ow * p.stride[1] - p.pad_lo[1];
  const std::int64_t rows = (h0 + p.kh < p.h ? h0 + p.kh : p.h) - (h0 > 0 ? h0 : 0);
  const std::int64_t cols = (w0 + p.kw < p.w ? w0 + p.kw : p.w) - (w0 > 0 ? w0 : 0);
  return rows > 0 && cols > 0 ? rows * cols : 1;
}

/// The mean over each window of x (padding counted as zeros when include_pad).
template <class T>
struct AvgPoolFn {
  using value_type = T;
  const T* x;
  T* y;
  backend::ConvProblem p;
  bool include_pad;
  TG_HD void operator()(std::int64_t e) const {
    using C = compute_t<T>;
    const std::int64_t c = e % p.c, ow = e / p.c % p.ow, oh = e / (p.c * p.ow) % p.oh, n = e / (p.c * p.ow * p.oh);
    C acc = 0;
    for (std::int64_t kh = 0; kh < p.kh; ++kh) {
      const std::int64_t ih = oh * p.stride[0] - p.pad_lo[0] + kh;
      if (ih < 0 || ih >= p.h) continue;
      for (std::int64_t kw = 0; kw < p.kw; ++kw) {
        const std::int64_t iw = ow * p.stride[1] - p.pad_lo[1] + kw;
        if (iw >= 0 && iw < p.w) acc += convert_from<C>(x[((n * p.h + ih) * p.w + iw) * p.c + c]);
      }
    }
    y[e] = convert_to<T>(acc / static_cast<C>(pool_count(p, oh, ow, include_pad)));
  }
};

/// The transpose of AvgPoolFn: each input element sums dy / divisor over the windows that hold it.
template <class T>
struct AvgPoolTransposeFn {
  using value_type = T;
  const T* dy;
  T* dx;
  backend::ConvProblem p;
  bool include_pad;
  TG_HD void operator()(std::int64_t e) const {
    using C = compute_t<T>;
    const std::int64_t c = e % p.c, iw = e / p.c % p.w, ih = e / (p.c * p.w) % p.h, n = e / (p.c * p.w * p.h);
    const PoolCover cover(p, ih, iw);
    C acc = 0;
    for (std::int64_t oh = cover.oh0; oh < cover.oh1; ++oh)
      for (std::int64_t ow = cover.ow0; ow < cover.ow1; ++ow)
        acc += convert_from<C>(dy[((n * p.oh + oh) * p.ow + ow) * p.c + c]) / static_cast<C>(pool_count(p, oh, ow, include_pad));
    dx[e] = convert_to<T>(acc);
  }
};

// The CPU's form of the pooling loops: one row of the image per item, the channels innermost (contiguous,
// so the compare and the sums vectorise), the same results as the per-element functors above.
inline constexpr std::int64_t pool_lanes = 64;

/// MaxPoolFn over the output row (n, oh).
template <class T>
struct MaxPoolRowsFn {
  MaxPoolFn<T> f;
  void operator()(std::int64_t r) const {
    using C = compute_t<T>;
    const backend::ConvProblem& p = f.p;
    const std::int64_t n = r / p.oh, oh = r % p.oh;
    for (std::int64_t ow = 0; ow < p.ow; ++ow)
      for (std::int64_t c0 = 0; c0 < p.c; c0 += pool_lanes) {
        const std::int64_t lanes = std::min(pool_lanes, p.c - c0);
        C best[pool_lanes];
        std::int32_t where[pool_lanes];
        for (std::int64_t l = 0; l < lanes; ++l) best[l] = static_cast<C>(-HUGE_VAL), where[l] = -1;
        bool first = true;
        for (std::int64_t kh = 0; kh < p.kh; ++kh) {
          const std::int64_t ih = oh * p.stride[0] - p.pad_lo[0] + kh;
          if (ih < 0 || ih >= p.h) continue;
          for (std::int64_t kw = 0; kw < p.kw; ++kw) {
            const std::int64_t iw = ow * p.stride[1] - p.pad_lo[1] + kw;
            if (iw < 0 || iw >= p.w) continue;
            const T* xp = f.x + ((n * p.h + ih) * p.w + iw) * p.c + c0;
            const auto me = static_cast<std::int32_t>(ih * p.w + iw);
            if (first) {  // the window's first position inside x
              for (std::int64_t l = 0; l < lanes; ++l) best[l] = convert_from<C>(xp[l]), where[l] = me;
              first = false;
              continue;
            }
            for (std::int64_t l = 0; l < lanes; ++l) {  // branch-free, so that it vectorises
              const C v = convert_from<C>(xp[l]);
              const bool take = (v > best[l]) | ((v != v) & (best[l] == best[l]));  // the first max; NaN wins
              best[l] = take ? v : best[l];
              where[l] = take ? me : where[l];
            }
          }
        }
        const std::int64_t o = ((n * p.oh + oh) * p.ow + ow) * p.c + c0;
        for (std::int64_t l = 0; l < lanes; ++l) f.y[o + l] = convert_to<T>(best[l]), f.at[o + l] = where[l];
      }
  }
};

/// MaxPoolScatterFn over the input row (n, ih).
template <class T>
struct MaxPoolScatterRowsFn {
  MaxPoolScatterFn<T> f;
  void operator()(std::int64_t r) const {
    using C = compute_t<T>;
    const backend::ConvProblem& p = f.p;
    const std::int64_t n = r / p.h, ih = r % p.h;
    for (std::int64_t iw = 0; iw < p.w; ++iw) {
      const PoolCover cover(p, ih, iw);
      const auto me = static_cast<std::int32_t>(ih * p.w + iw);
      T* __restrict dx = f.dx + ((n * p.h + ih) * p.w + iw) * p.c;
      if (cover.oh1 - cover.oh0 == 1 && cover.ow1 - cover.ow0 == 1) {  // one window holds it (stride >= window): a select
        const std::int64_t o = ((n * p.oh + cover.oh0) * p.ow + cover.ow0) * p.c;
        const std::int32_t* __restrict at = f.at + o;
        if constexpr (std::is_same_v<T, bf16>) {  // on the bits, so that the select vectorises (+0 is bits 0)
          const bf16* __restrict dy = f.dy + o;
          for (std::int64_t c = 0; c < p.c; ++c) dx[c].bits = at[c] == me ? dy[c].bits : std::uint16_t{0};
        } else {
          const T* __restrict dy = f.dy + o;
          for (std::int64_t c = 0; c < p.c; ++c) dx[c] = at[c] == me ? dy[c] : T(0);
        }
        continue;
      }
      for (std::int64_t c0 = 0; c0 < p.c; c0 += pool_lanes) {
        const std::int64_t lanes = std::min(pool_lanes, p.c - c0);
        C acc[pool_lanes] = {};
        for (std::int64_t oh = cover.oh0; oh < cover.oh1; ++oh)
          for (std::int64_t ow = cover.ow0; ow < cover.ow1; ++ow) {
            const std::int64_t o = ((n * p.oh + oh) * p.ow + ow) * p.c + c0;
            for (std::int64_t l = 0; l < lanes; ++l) acc[l] += f.at[o + l] == me ? convert_from<C>(f.dy[o + l]) : C(0);
          }
        for (std::int64_t l = 0; l < lanes; ++l) dx[c0 + l] = convert_to<T>(acc[l]);
      }
    }
  }
};

/// AvgPoolFn over the output row (n, oh).
template <class T>
struct AvgPoolRowsFn {
  AvgPoolFn<T> f;
  void operator()(std::int64_t r) const {
    using C = compute_t<T>;
    const backend::ConvProblem& p = f.p;
    const std::int64_t n = r / p.oh, oh = r % p.oh;
    for (std::int64_t ow = 0; ow < p.ow; ++ow) {
      const auto count = static_cast<C>(pool_count(p, oh, ow, f.include_pad));
      for (std::int64_t c0 = 0; c0 < p.c; c0 += pool_lanes) {
        const std::int64_t lanes = std::min(pool_lanes, p.c - c0);
        C acc[pool_lanes] = {};
        for (std::int64_t kh = 0; kh < p.kh; ++kh) {
          const std::int64_t ih = oh * p.stride[0] - p.pad_lo[0] + kh;
          if (ih < 0 || ih >= p.h) continue;
          for (std::int64_t kw = 0; kw < p.kw; ++kw) {
            const std::int64_t iw = ow * p.stride[1] - p.pad_lo[1] + kw;
            if (iw < 0 || iw >= p.w) continue;
            const T* xp = f.x + ((n * p.h + ih) * p.w + iw) * p.c + c0;
            for (std::int64_t l = 0; l < lanes; ++l) acc[l] += convert_from<C>(xp[l]);
          }
        }
        T* y = f.y + ((n * p.oh + oh) * p.ow + ow) * p.c + c0;
        for (std::int64_t l = 0; l < lanes; ++l) y[l] = convert_to<T>(acc[l] / count);
      }
    }
  }
};

/// AvgPoolTransposeFn over the input row (n, ih).
template <class T>
struct AvgPoolTransposeRowsFn {
  AvgPoolTransposeFn<T> f;
  void operator()(std::int64_t r) const {
    using C = compute_t<T>;
    const backend::ConvProblem& p = f.p;
    const std::int64_t n = r / p.h, ih = r % p.h;
    for (std::int64_t iw = 0; iw < p.w; ++iw) {
      const PoolCover cover(p, ih, iw);
      T* dx = f.dx + ((n * p.h + ih) * p.w + iw) * p.c;
      for (std::int64_t c0 = 0; c0 < p.c; c0 += pool_lanes) {
        const std::int64_t lanes = std::min(pool_lanes, p.c - c0);
        C acc[pool_lanes] = {};
        for (std::int64_t oh = cover.oh0; oh < cover.oh1; ++oh)
          for (std::int64_t ow = cover.ow0; ow < cover.ow1; ++ow) {
            const auto count = static_cast<C>(pool_count(p, oh, ow, f.include_pad));
            const T* dy = f.dy + ((n * p.oh + oh) * p.ow + ow) * p.c + c0;
            for (std::int64_t l = 0; l < lanes; ++l) acc[l] += convert_from<C>(dy[l]) / count;
          }
        for (std::int64_t l = 0; l < lanes; ++l) dx[c0 + l] = convert_to<T>(acc[l]);
      }
    }
  }
};

/// Runs a pooling loop: rows on the CPU, elements on CUDA.
template <class D, template <class> class Rows, class F>
void pool_map(std::int64_t rows, std::int64_t elements, const F& f, std::int64_t work_per_element) {
  if (elements == 0) return;
  index_map_per_device<D>(rows, Rows<typename F::value_type>{f}, elements / rows * work_per_element, elements, f);
}

template <FloatElement T, Device D>
Tensor<T, D> max_pool_gather(const Tensor<T, D>& g, const Tensor<std::int32_t, D>& at, const backend::ConvProblem& p);

/// dx of max_pool from dy (linear in dy; its transpose is max_pool_gather).
template <FloatElement T, Device D>
Tensor<T, D> max_pool_scatter(const Tensor<T, D>& dy, const Tensor<std::int32_t, D>& at, const backend::ConvProblem& p) {
  Tensor<T, D> dx(Shape{p.n, p.h, p.w, p.c});
  pool_map<D, MaxPoolScatterRowsFn>(p.n * p.h, dx.size(), MaxPoolScatterFn<T>{dy.data(), at.data(), dx.data(), p}, p.kh * p.kw);
  if (recording(dy))
    record(dx, {dy.trace()}, [tdy = dy.trace(), at, p](Tape& t, const Tensor<T, D>& g) {
      if (t.owns(tdy)) t.accumulate(tdy, max_pool_gather(g, at, p));
    }, [&](const Tangents& tangent) {
      const Tensor<T, D> t_ = tangent(dy);
      return t_.defined() ? max_pool_scatter(t_, at, p) : t_;
    }, "max_pool");
  return dx;
}

/// g at each window's maximum (linear in g; its transpose is max_pool_scatter).
template <FloatElement T, Device D>
Tensor<T, D> max_pool_gather(const Tensor<T, D>& g, const Tensor<std::int32_t, D>& at, const backend::ConvProblem& p) {
  Tensor<T, D> out(Shape{p.n, p.oh, p.ow, p.c});
  if (out.size() > 0) index_map<D>(out.size(), MaxPoolGatherFn<T>{g.data(), at.data(), out.data(), p});
  if (recording(g))
    record(out, {g.trace()}, [tg_ = g.trace(), at, p](Tape& t, const Tensor<T, D>& d) {
      if (t.owns(tg_)) t.accumulate(tg_, max_pool_scatter(d, at, p));
    }, [&](const Tangents& tangent) {
      const Tensor<T, D> t_ = tangent(g);
      return t_.defined() ? max_pool_gather(t_, at, p) : t_;
    }, "max_pool");
  return out;
}

template <FloatElement T, Device D>
Tensor<T, D> avg_pool_transpose(const Tensor<T, D>& dy, const backend::ConvProblem& p, bool include_pad);

/// The average pool as an op: linear, its transpose avg_pool_transpose (and that one's, this).
template <FloatElement T, Device D>
Tensor<T, D> avg_pool_forward(const Tensor<T, D>& x, const backend::ConvProblem& p, bool include_pad) {
  Tensor<T, D> y(Shape{p.n, p.oh, p.ow, p.c});
  pool_map<D, AvgPoolRowsFn>(p.n * p.oh, y.size(), AvgPoolFn<T>{x.data(), y.data(), p, include_pad}, p.kh * p.kw);
  if (recording(x))
    record(y, {x.trace()}, [tx = x.trace(), p, include_pad](Tape& t, const Tensor<T, D>& dy) {
      if (t.owns(tx)) t.accumulate(tx, avg_pool_transpose(dy, p, include_pad));
    }, [&](const Tangents& tangent) {
      const Tensor<T, D> t_ = tangent(x);
      return t_.defined() ? avg_pool_forward(t_, p, include_pad) : t_;
    }, "avg_pool");
  return y;
}

template <FloatElement T, Device D>
Tensor<T, D> avg_pool_transpose(const Tensor<T, D>& dy, const backend::ConvProblem& p, bool include_pad) {
  Tensor<T, D> dx(Shape{p.n, p.h, p.w, p.c});
  pool_map<D, AvgPoolTransposeRowsFn>(p.n * p.h, dx.size(), AvgPoolTransposeFn<T>{dy.data(), dx.data(), p, include_pad}, p.kh * p.kw);
  if (recording(dy))
    record(dx, {dy.trace()}, [tdy = dy.trace(), p, include_pad](Tape& t, const Tensor<T, D>& g) {
      if (t.owns(tdy)) t.accumulate(tdy, avg_pool_forward(g, p, include_pad));
    }, [&](const Tangents& tangent) {
      const Tensor<T, D> t_ = tangent(dy);
      return t_.defined() ? avg_pool_transpose(t_, p, include_pad) : t_;
    }, "avg_pool");
  return dx;
}

inline backend::ConvProblem pool_problem(const Shape& x, Window2 window, Window2 strides, const Padding& padding, const char* op) {
  TG_CHECK(x.rank() == 4, op, "needs x of rank 4 (batch, height, width, channels: NHWC), got ", x.str());
  return conv_geometry(x, window[0], window[1], x[3], strides, padding, {1, 1}, x[3], op);
}

}  // namespace detail

/// flax.linen.max_pool(x, window_shape, strides, padding) on x (n, h, w, c) -> (n, oh, ow, c): the max of
/// each window, padding excluded. Its gradient goes to the first maximum of each window (for ties).
template <FloatElement T, Device D>
Tensor<T, D> max_pool(const Tensor<T, D>& x, Window2 window, Window2 strides = {1, 1}, const Padding& padding = "VALID") {
  if (detail::batched(x))
    return detail::fold_vmap_batch(x, false, "max_pool", [&](const Tensor<T, D>& xs) { return max_pool(xs, window, strides, padding); });
  detail::check_defined(x, "max_pool");
  const backend::ConvProblem p = detail::pool_problem(x.shape(), window, strides, padding, "max_pool");
  Tensor<T, D> y(Shape{p.n, p.oh, p.ow, p.c});
  Tensor<std::int32_t, D> at(y.shape());
  TG_CHECK(p.h * p.w < (std::int64_t{1} << 31), "max_pool", "images of ", p.h, " x ", p.w, " pixels are too large (at most 2^31 per image)");
  detail::pool_map<D, detail::MaxPoolRowsFn>(p.n * p.oh, y.size(), detail::MaxPoolFn<T>{x.data(), y.data(), at.data(), p}, p.kh * p.kw);
  if (detail::recording(x))
    detail::record(y, {x.trace()}, [tx = x.trace(), at, p](detail::Tape& t, const Tensor<T, D>& dy) {
      if (t.owns(tx)) t.accumulate(tx, detail::max_pool_scatter(dy, at, p));
    }, [&](const detail::Tangents& tangent) {  // the tangent at each window's maximum
      const Tensor<T, D> tx = tangent(x);
      return tx.defined() ? detail::max_pool_gather(tx, at, p) : tx;
    }, "max_pool");
  return y;
}

/// flax.linen.avg_pool(x, window_shape, strides, padding, count_include_pad) on x (n, h, w, c) -> (n, oh,
/// ow, c): the mean of each window, dividing by the window's size (count_include_pad, Flax's default) or
/// by its positions inside x.
template <FloatElement T, Device D>
Tensor<T, D> avg_pool(const Tensor<T, D>& x, Window2 window, Window2 strides = {1, 1}, const Padding& padding = "VALID",
                      bool count_include_pad = true) {
  if (detail::batched(x))
    return detail::fold_vmap_batch(x, false, "avg_pool",
                                   [&](const Tensor<T, D>& xs) { return avg_pool(xs, window, strides, padding, count_include_pad); });
  detail::check_defined(x, "avg_pool");
  return detail::avg_pool_forward(x, detail::pool_problem(x.shape(), window, strides, padding, "avg_pool"), count_include_pad);
}

TG_END_NAMESPACE
