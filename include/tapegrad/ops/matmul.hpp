// matmul and the fused layer linear(x, w, b, activation), with their backward rules: each says what GEMM
// it needs (backend/problem.hpp) and completes what the device's backend did not fuse (backend/gemm.hpp).
#pragma once

#include <any>
#include <cstdint>
#include <memory>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/gemm.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/reduce.hpp"

TG_BEGIN_NAMESPACE

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
  template <class C> TG_HD C operator()(C g, C z) const { return fn::backward(Act{}, z, C(0), g); }  // act'(z) reads z alone
};

template <class T, class D>
Tensor<T, D> activation_backward(const Tensor<T, D>& g, const Tensor<T, D>& z, Activation act) {
  return visit_activation(act, [&]<class Op>(Op) {
    if (backend::has_unary<Op, T, D>()) {  // a vendor kernel for act' (oneDNN's GELU on the CPU)
      TG_CHECK(g.shape() == z.shape(), "linear_backward", "gradient of shape ", g.shape().str(), " for a pre-activation of shape ",
               z.shape().str());
      Tensor<T, D> dz(z.shape());
      backend::unary_backward<Op, T, D>(z.size(), z.data(), g.data(), dz.data());
      return dz;
    }
    return map2(g, z, ActBackwardFn<Op>{}, "linear_backward");
  }, g);
}

/// c = op(a) op(b) [+ bias] [then act] through the device's GEMM door, completing what the backend did
/// not fuse; `pre` receives the pre-activation when the caller needs it for backward.
template <class T, class D>
Tensor<T, D> gemm(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb, const std::type_identity_t<Tensor<T, D>>* bias,
                  Activation act, std::type_identity_t<Tensor<T, D>>* pre, const char* op) {
  const GemmDims g = gemm_dims(a, b, ta, tb, op);
  if (bias) {
    check_defined(*bias, op);
    TG_CHECK(bias->rank() == 1 && bias->dim(0) == g.n, op, "bias must have shape (", g.n, ",), got ", bias->shape().str());
  }
  backend::GemmProblem p{g.m, g.n, g.k, ta, tb, 1, op};
  p.bias = bias != nullptr, p.act = act, p.keep_pre = pre != nullptr;
  backend::GemmResult<T, D> r = backend::gemm(p, a, b, bias);
  if (bias && !r.bias_done) r.c = add(r.c, *bias);
  if (r.act_done) {
    if (pre) *pre = r.pre;
    return r.c;
  }
  if (pre) *pre = r.c;
  return activate(r.c, act);
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

/// The input gradient dz @ w^T of a linear layer; fused into the producer of x when x is the output of
/// a linear layer whose act' the device's GEMM can apply (backend::fuses_dact) and that nothing else consumed.
template <class T, class D>
void linear_input_gradient(Tape& t, const Trace& x, const Tensor<T, D>& dz, const Tensor<T, D>& w) {
  if (!t.owns(x)) return;
  auto* state = std::any_cast<std::shared_ptr<LinearProducer<T, D>>>(&t.state(x.node));
  LinearProducer<T, D>* producer = state ? state->get() : nullptr;
  if (producer != nullptr && t.uses(x.node) == 1 && backend::fuses_dact<T, D>(producer->act, producer->z.dim(1))) {
    std::tie(producer->dz, producer->db) = matmul_dact_bgrad(dz, w, true, producer->z, producer->act);
    producer->pending = true;
    return;
  }
  t.accumulate(x, matmul(dz, w, false, true));
}

}  // namespace detail

namespace detail {

/// Strided-batched GEMM of 3-d operands with one batch size: c[i] = op(a[i]) op(b[i]) -> (batch, m, n),
/// shapes checked by the caller (oneDNN's batched matmul on the CPU, cuBLASLt's strided batch on CUDA).
template <class T, class D>
Tensor<T, D> batched_gemm(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb) {
  const std::int64_t batch = a.dim(0);
  const GemmDims g{ta ? a.dim(2) : a.dim(1), tb ? b.dim(1) : b.dim(2), ta ? a.dim(1) : a.dim(2)};
  return backend::gemm(backend::GemmProblem{g.m, g.n, g.k, ta, tb, batch, "matmul"}, a, b).c.reshape(Shape{batch, g.m, g.n});
}

/// batched_gemm as a differentiable op: the cotangents are batched GEMMs too.
template <FloatElement T, Device D>
Tensor<T, D> bmm(const Tensor<T, D>& a, const Tensor<T, D>& b, bool ta, bool tb) {
  Tensor<T, D> c = batched_gemm(a, b, ta, tb);
  if (recording(a, b)) {
    // a and b kept traced: a recording backward pass differentiates these GEMMs again.
    record(c, {a.trace(), b.trace()}, [xa = a.trace(), xb = b.trace(), a, b, ta, tb](Tape& t, const Tensor<T, D>& dc) {
      if (t.owns(xa)) t.accumulate(xa, ta ? bmm(b, dc, tb, true) : bmm(dc, b, false, !tb));
      if (t.owns(xb)) t.accumulate(xb, tb ? bmm(dc, a, true, ta) : bmm(a, dc, !ta, false));
    }, [&](const Tangents& tangent) {  // d(op(a) op(b)) = op(da) op(b) + op(a) op(db)
      const Tensor<T, D> da = tangent(a), db = tangent(b);
      Tensor<T, D> r = da.defined() ? bmm(da, b, ta, tb) : Tensor<T, D>{};
      if (db.defined()) r = r.defined() ? add(r, bmm(a, db, ta, tb)) : bmm(a, db, ta, tb);
      return r;
    }, "matmul");
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
    return Shape(dims);
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

/// The batching rule of x @ w [+ b] [then act] for examples of x (batched) that share w and b as broadcast
/// views (value_and_grad inside tg::vmap: the per-example gradients of shared parameters), as JAX's
/// batched backward pass computes it: the forward is one GEMM of every example's rows with the one copy
/// of w; the backward gives x's cotangent by one GEMM too and w's per example (x_b^T dz_b, a batched
/// GEMM), so no example's copy of w is ever made.
template <FloatElement T, Device D>
Tensor<T, D> linear_shared_weights(const Tensor<T, D>& x, const Tensor<T, D>& w, const Tensor<T, D>* b, Activation act, const char* op) {
  const std::uint32_t lv = x.batch_levels();
  const Tensor<T, D> px = x.physical(), w1 = w.shared_example();
  const Tensor<T, D> b1 = b ? b->shared_example() : Tensor<T, D>{};
  const std::int64_t in = w1.dim(0), out = w1.dim(1), rows = in ? x.size() / in : 0;
  std::int64_t examples = 1;
  for (int d = 0; d < batch_rank(lv); ++d) examples *= px.dim(d);
  std::vector<std::int64_t> dims(x.shape().dims().begin(), x.shape().dims().end() - 1);
  dims.push_back(out);
  const Shape y_shape = with_batch(lv, Shape(dims), op);
  const Tensor<T, D> x2 = px.untraced().reshape(Shape{examples * rows, in});
  const bool traced = b ? recording(px, w, *b) : recording(px, w);
  Tensor<T, D> z;
  Tensor<T, D> y = gemm(x2, w1, false, false, b ? &b1 : nullptr, act, traced ? &z : nullptr, op).reshape(y_shape);
  if (traced) {
    const Trace tb = b ? b->trace() : Trace{};
    record(y, {px.trace(), w.trace(), tb}, [tx = px.trace(), tw = w.trace(), tb, x2, w1, z, act, rows, examples, in, out, xs = px.shape(),
                                            ws = w.physical_shape(), bs = b ? b->physical_shape() : Shape{}](Tape& t, const Tensor<T, D>& dy) {
      const Tensor<T, D> d2 = dy.reshape(Shape{examples * rows, out});
      const Tensor<T, D> dz = z.defined() && act != Activation::none ? activation_backward(d2, z, act) : d2;
      if (t.owns(tx)) t.accumulate(tx, matmul(dz, w1, false, true).reshape(xs));
      const Tensor<T, D> dz3 = dz.reshape(Shape{examples, rows, out});
      if (t.owns(tw)) t.accumulate(tw, bmm(x2.reshape(Shape{examples, rows, in}), dz3, true, false).reshape(ws));
      if (t.owns(tb)) t.accumulate(tb, (rows == 1 ? dz : sum(dz3, 1)).reshape(bs));
    });
  }
  return as_batched(y, lv);
}

}  // namespace detail

/// op(a) @ op(b), as jnp.matmul: for 2-d a (m, k) [stored (k, m) when transpose_a] and b (k, n) [stored
/// (n, k) when transpose_b] -> (m, n); for higher ranks the last two axes are the matrices and the
/// leading ones broadcast as NumPy's (a batched GEMM). bf16 inputs accumulate in f32 and round the result
/// once.
template <FloatElement T, Device D>
Tensor<T, D> matmul(const Tensor<T, D>& a, const Tensor<T, D>& b, bool transpose_a = false, bool transpose_b = false) {
  if (detail::batched(a, b)) {  // batching rule: the batch axes lead the matrices' and broadcast as theirs do
    detail::check_defined(a, "matmul"), detail::check_defined(b, "matmul");
    TG_CHECK(a.rank() >= 2 && b.rank() >= 2, "matmul", "needs operands of rank >= 2, got ", a.shape().str(), " @ ", b.shape().str(),
             " (per example, inside tg::vmap); reshape a vector to (1, k) or (k, 1)");
    const std::uint32_t lv = detail::levels_of(a, b);
    const int r = std::max(a.rank(), b.rank());
    if (b.is_broadcast_view() && b.rank() == 2 && !transpose_a && !transpose_b && !a.is_broadcast_view() && a.batch_levels() == lv &&
        !detail::higher_order())
      return detail::linear_shared_weights(a, b, static_cast<const Tensor<T, D>*>(nullptr), Activation::none, "matmul");
    // An unbatched b of rank 2 stays as it is: the examples fold into the rows of one GEMM.
    return detail::as_batched(detail::matmul_nd(detail::aligned(a, lv, r), detail::aligned(b, lv, r), transpose_a, transpose_b), lv);
  }
  if (a.rank() != 2 || b.rank() != 2) return detail::matmul_nd(a, b, transpose_a, transpose_b);
  Tensor<T, D> c = detail::gemm(a.untraced(), b.untraced(), transpose_a, transpose_b, nullptr, Activation::none, nullptr, "matmul");
  if (detail::recording(a, b)) {
    // C = op(A) op(B): dA = dC op(B)^T (transposed back if A was), dB = op(A)^T dC (likewise).
    // a and b kept traced: a recording backward pass differentiates these GEMMs again.
    detail::record(c, {a.trace(), b.trace()}, [ta = a.trace(), tb = b.trace(), a, b, transpose_a, transpose_b](detail::Tape& t, const Tensor<T, D>& dc) {
      if (t.owns(ta)) t.accumulate(ta, transpose_a ? matmul(b, dc, transpose_b, true) : matmul(dc, b, false, !transpose_b));
      if (t.owns(tb)) t.accumulate(tb, transpose_b ? matmul(dc, a, true, transpose_a) : matmul(a, dc, !transpose_a, false));
    }, [&](const detail::Tangents& tangent) {  // d(op(a) op(b)) = op(da) op(b) + op(a) op(db)
      const Tensor<T, D> da = tangent(a), db = tangent(b);
      Tensor<T, D> r = da.defined() ? matmul(da, b, transpose_a, transpose_b) : Tensor<T, D>{};
      if (db.defined()) r = r.defined() ? add(r, matmul(a, db, transpose_a, transpose_b)) : matmul(a, db, transpose_a, transpose_b);
      return r;
    }, "matmul");
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
  // Under two differentiating transformations (grad of grad, jvp) the layer runs as its primitives, whose
  // backward rules are traced to any order (the fused rule below computes act' in a kernel).
  const bool composed = detail::higher_order() && detail::recording(x, w, b);
  const bool is_batched = detail::batched(x, w, b);
  if (composed || is_batched) {
    detail::check_defined(x, "linear"), detail::check_defined(w, "linear"), detail::check_defined(b, "linear");
    TG_CHECK(x.rank() >= 1 && w.rank() == 2 && b.rank() == 1 && x.dim(-1) == w.dim(0) && b.dim(0) == w.dim(1), "linear",
             "needs x (..., in), w (in, out), b (out,), got ", x.shape().str(), ", ", w.shape().str(), " and ", b.shape().str(),
             is_batched ? " (per example, inside tg::vmap)" : "");
    std::vector<std::int64_t> dims(x.shape().dims().begin(), x.shape().dims().end() - 1);
    dims.push_back(w.dim(1));
    if (!composed) {  // batching rule
      if (w.is_broadcast_view() && b.is_broadcast_view() && !x.is_broadcast_view() && x.batch_levels() == w.batch_levels())
        return detail::linear_shared_weights(x, w, &b, act, "linear");  // per-example gradients of shared parameters
      if (!detail::batched(w, b)) {  // shared weights: every example's rows in one fused layer
        const Tensor<T, D> p = x.physical();
        return detail::as_batched(linear(p.reshape({-1, x.dim(-1)}), w, b, act).reshape(detail::with_batch(x.batch_levels(), Shape(dims), "linear")),
                                  x.batch_levels());
      }
    }
    // Composed, or weights of their own per example (an ensemble, or per-example gradients: a batched GEMM).
    const Tensor<T, D> x2 = x.rank() == 1 ? x.reshape({1, x.dim(0)}) : x;
    return detail::activate(add(matmul(x2, w), b), act).reshape(Shape(dims));
  }
  const bool traced = detail::recording(x, w, b);
  const Tensor<T, D> bu = b.untraced();
  Tensor<T, D> z;  // the pre-activation, which the backward pass needs
  Tensor<T, D> y = detail::gemm(x.untraced(), w.untraced(), false, false, &bu, act, traced ? &z : nullptr, "linear");
  if (!traced) return y;
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
                 },
      [&](const detail::Tangents& tangent) -> Tensor<T, D> {
        // tz = tx @ w + tb + x @ tw, then ty = act'(z) tz with the kept pre-activation (kernels: at one
        // level, nothing differentiates this rule; an enclosing level runs the layer composed).
        const Tensor<T, D> tx = tangent(x), tw = tangent(w), tb = tangent(b);
        if (!tx.defined() && !tw.defined() && !tb.defined()) return {};
        if (detail::active_tape != nullptr) throw detail::NoForwardRule{"linear"};
        Tensor<T, D> tz;
        if (tx.defined()) tz = tb.defined() ? linear(tx, w, tb) : matmul(tx, w);
        if (tw.defined()) tz = tz.defined() ? add(tz, matmul(x, tw)) : matmul(x, tw);
        if (!tz.defined()) tz = broadcast_to(tb, y.shape());
        else if (!tx.defined() && tb.defined()) tz = add(tz, tb);
        return act == Activation::none ? tz : detail::activation_backward(tz, z, act);
      }, "linear");
  detail::active_tape->state(node) = producer;
  return y;
}

/// Backward through a layer's activation, fused into the GEMM that produces its input gradient:
/// g = a @ op(b); returns {dz = g * act'(z), db = sum over rows of dz}. With a = dz of the next layer
/// and b = its weight (transpose_b), this is cuBLASLt's DGELU_BGRAD on CUDA in bf16 (see lt_dgelu_epilogue in
/// backend/cuda/gemm.hpp); otherwise the GEMM, act' by tapegrad's functor, and a column sum.
template <FloatElement T, Device D>
std::pair<Tensor<T, D>, Tensor<T, D>> matmul_dact_bgrad(const Tensor<T, D>& a, const Tensor<T, D>& b, bool transpose_b,
                                                        const Tensor<T, D>& z, Activation act) {
  const detail::GemmDims g = detail::gemm_dims(a, b, false, transpose_b, "matmul_dact_bgrad");
  TG_CHECK(z.shape() == Shape({g.m, g.n}), "matmul_dact_bgrad", "pre-activation must have shape (", g.m, ", ", g.n,
           "), got ", z.shape().str());
  backend::GemmProblem p{g.m, g.n, g.k, false, transpose_b, 1, "matmul_dact_bgrad"};
  p.dact = act, p.bias_grad = backend::BiasGrad::of_result;
  const backend::GemmResult<T, D> r = backend::gemm(p, a, b, nullptr, &z);
  if (r.dact_done) return {r.c, r.bias_grad};
  const Tensor<T, D> dz = detail::activation_backward(r.c, z, act);
  return {dz, sum(dz, 0)};
}

/// The weight and bias gradients of a layer in one GEMM: {dw = x^T @ dz, db = sum over rows of dz}.
/// On CUDA the bias gradient comes from the GEMM's epilogue (BGRADA in the row-major swap), except in
/// f64 (see lt_epilogues in backend/cuda/gemm.hpp).
template <FloatElement T, Device D>
std::pair<Tensor<T, D>, Tensor<T, D>> matmul_bgrad(const Tensor<T, D>& x, const Tensor<T, D>& dz) {
  const detail::GemmDims g = detail::gemm_dims(x, dz, true, false, "matmul_bgrad");
  backend::GemmProblem p{g.m, g.n, g.k, true, false, 1, "matmul_bgrad"};
  p.bias_grad = backend::BiasGrad::of_b;
  backend::GemmResult<T, D> r = backend::gemm(p, x, dz);
  if (r.bias_grad_done) return {r.c, r.bias_grad};
  return {r.c, sum(dz, 0)};
}

TG_END_NAMESPACE
