// Neural-network ops: the fused, stable softmax cross-entropy with integer labels, accuracy, one_hot,
// layer_norm (one fused kernel each way) and dropout (its mask recomputed from the key, never stored).
#pragma once

#include <cstdint>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/reduce.hpp"
#include "tapegrad/random/random.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

/// loss[r] = logsumexp(logits[r]) - logits[r, label[r]] for each row of (rows, n) logits.
template <class T>
struct SoftmaxCrossEntropyFn {
  const T* logits;
  const std::int32_t* labels;
  T* loss;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<T>;
    const T* x = logits + row * n;
    const auto [m, s] = max_sum_exp(x, n, 1);
    const std::int32_t label = labels[row];
    // Out-of-range labels were rejected before the launch; NaN guards against a label changed since.
    const C picked = label >= 0 && label < n ? convert_from<C>(x[label]) : C(NAN);
    loss[row] = convert_to<T>(m + math::log(s) - picked);
  }
};

/// dlogits[r, k] = dloss[r] (softmax(logits[r])[k] - [k == label[r]]): softmax minus one-hot, per row.
template <class T>
struct SoftmaxCrossEntropyBackwardFn {
  const T* logits;
  const std::int32_t* labels;
  const T* dloss;
  T* dlogits;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<T>;
    const T* x = logits + row * n;
    T* dx = dlogits + row * n;
    const auto [m, s] = max_sum_exp(x, n, 1);
    const C g = convert_from<C>(dloss[row]), inv = C(1) / s;
    for (std::int64_t k = 0; k < n; ++k) {
      const C p = math::exp(convert_from<C>(x[k]) - m) * inv;
      dx[k] = convert_to<T>(g * (p - (k == labels[row] ? C(1) : C(0))));
    }
  }
};

/// Rejects labels outside [0, n_classes), naming the op, the first bad label and its position, without
/// synchronising (runtime/dispatch.hpp: on CUDA it is raised at the next synchronisation).
template <class D>
void check_labels(const Tensor<std::int32_t, D>& labels, std::int64_t n_classes, const char* op) {
  check_indices<D>(labels.data(), labels.size(), n_classes, op);
}

template <class T>
struct CorrectFn {
  const T* logits;
  const std::int32_t* labels;
  compute_t<T>* correct;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    std::int32_t best = 0;
    ArgmaxAxisFn<T>{logits + row * n, &best, n, 1}(0);
    correct[row] = best == labels[row] ? compute_t<T>(1) : compute_t<T>(0);
  }
};

template <class T>
struct OneHotFn {
  const std::int32_t* labels;
  T* out;
  std::int64_t n;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t row = i / n, k = i % n;
    out[i] = convert_to<T>(labels[row] == k ? 1.0f : 0.0f);
  }
};

template <class T, class D>
void check_logits_labels(const Tensor<T, D>& logits, const Tensor<std::int32_t, D>& labels, const char* op) {
  check_defined(logits, op);
  check_defined(labels, op);
  TG_CHECK(logits.rank() >= 1, op, "logits need a class axis, got a scalar");
  std::vector<std::int64_t> batch(logits.shape().dims().begin(), logits.shape().dims().end() - 1);
  TG_CHECK(labels.shape() == Shape(batch), op, "labels of shape ", labels.shape().str(),
           " do not match logits of shape ", logits.shape().str(), "; labels need the logits' shape without the class axis");
}

}  // namespace detail

template <FloatElement T, Device D>
Tensor<T, D> one_hot(const Tensor<std::int32_t, D>& labels, std::int64_t num_classes);

/// Per-example -log softmax(logits)[label], fused and stable: logits (..., C), int32 labels (...) -> (...).
/// As optax.softmax_cross_entropy_with_integer_labels. A label outside [0, C) is an error.
template <FloatElement T, Device D>
Tensor<T, D> softmax_cross_entropy_with_integer_labels(const Tensor<T, D>& logits, const Tensor<std::int32_t, D>& labels) {
  const char* op = "softmax_cross_entropy_with_integer_labels";
  detail::check_logits_labels(logits, labels, op);
  if (detail::batched(logits, labels)) {  // batching rule: rows, each example's logits with its own labels
    const std::uint32_t lv = detail::levels_of(logits, labels);
    return detail::as_batched(softmax_cross_entropy_with_integer_labels(detail::materialize(logits, lv).physical(),
                                                                        detail::materialize(labels, lv).physical()), lv);
  }
  const std::int64_t n = logits.dim(-1);
  detail::check_labels(labels, n, op);
  Tensor<T, D> loss(labels.shape());
  detail::index_map<D>(labels.size(), detail::SoftmaxCrossEntropyFn<T>{logits.data(), labels.data(), loss.data(), n}, 8 * n);
  if (detail::recording(logits)) {
    detail::record(loss, {logits.trace()}, [in = logits.trace(), x0 = logits, y = labels, n](detail::Tape& t, const Tensor<T, D>& dloss) {
      if (t.records()) {  // higher order: (softmax(x) - one_hot(y)) dloss in traced ops
        std::vector<std::int64_t> d(dloss.shape().dims().begin(), dloss.shape().dims().end());
        d.push_back(1);
        return t.accumulate(in, mul(sub(softmax(x0), one_hot<T>(y, n)), broadcast_to(dloss.reshape(Shape(d)), x0.shape())));
      }
      Tensor<T, D> dx(x0.shape());
      detail::index_map<D>(y.size(), detail::SoftmaxCrossEntropyBackwardFn<T>{x0.data(), y.data(), dloss.data(), dx.data(), n}, 16 * n);
      t.accumulate(in, dx);
    }, [&](const detail::Tangents& tangent) {  // d loss = sum((softmax(x) - one_hot(y)) tx) over the classes
      const Tensor<T, D> tx = tangent(logits);
      return tx.defined() ? sum(mul(sub(softmax(logits), one_hot<T>(labels, n)), tx), -1) : tx;
    }, op);
  }
  return loss;
}

/// Fraction of rows whose argmax equals the label, as a 0-d tensor (float; double for double logits).
template <FloatElement T, Device D>
Tensor<compute_t<T>, D> accuracy(const Tensor<T, D>& logits, const Tensor<std::int32_t, D>& labels) {
  detail::check_logits_labels(logits, labels, "accuracy");
  TG_CHECK(labels.size() > 0, "accuracy", "needs at least one example");
  const std::int64_t n = logits.dim(-1);
  // Batching rule: the rows of every example at once, then each example's mean.
  const std::uint32_t lv = detail::levels_of(logits, labels);
  const Tensor<T, D> pl = detail::materialize(logits, lv).physical();
  const Tensor<std::int32_t, D> py = detail::materialize(labels, lv).physical();
  Tensor<compute_t<T>, D> correct(py.shape());
  detail::index_map<D>(py.size(), detail::CorrectFn<T>{pl.data(), py.data(), correct.data(), n});
  return mean(detail::as_batched(correct, lv));
}

/// one_hot(labels, n): (..., n) with 1 at each label; a label outside [0, n) gives a row of zeros, as
/// jax.nn.one_hot.
template <FloatElement T = float, Device D>
Tensor<T, D> one_hot(const Tensor<std::int32_t, D>& labels, std::int64_t num_classes) {
  detail::check_defined(labels, "one_hot");
  if (detail::batched(labels)) return detail::as_batched(one_hot<T>(labels.physical(), num_classes), labels.batch_levels());  // batching rule
  TG_CHECK(num_classes > 0, "one_hot", "num_classes must be > 0, got ", num_classes);
  std::vector<std::int64_t> dims(labels.shape().dims().begin(), labels.shape().dims().end());
  dims.push_back(num_classes);
  Tensor<T, D> out{Shape(dims)};
  detail::index_map<D>(out.size(), detail::OneHotFn<T>{labels.data(), out.data(), num_classes});
  return out;
}

namespace detail {

/// layer_norm's forward on each row of (rows, n): mean and rstd = 1 / sqrt(var + eps) in the compute type
/// (f32 for bf16; var two-pass, as the mean of squared deviations), y = (x - mean) rstd scale + bias.
/// mean and rstd are kept for the backward pass.
template <class T>
struct LayerNormFn {
  using C = compute_t<T>;
  const T *x, *scale, *bias;
  T* y;
  C *mean, *rstd;
  std::int64_t n;
  C eps;
  TG_HD void operator()(std::int64_t row) const {
    const T* xr = x + row * n;
    T* yr = y + row * n;
    C s = C(0);
    for (std::int64_t k = 0; k < n; ++k) s += convert_from<C>(xr[k]);
    const C mu = s / C(n);
    C v = C(0);
    for (std::int64_t k = 0; k < n; ++k) {
      const C d = convert_from<C>(xr[k]) - mu;
      v += d * d;
    }
    const C r = C(1) / math::sqrt(v / C(n) + eps);
    for (std::int64_t k = 0; k < n; ++k)
      yr[k] = convert_to<T>((convert_from<C>(xr[k]) - mu) * r * convert_from<C>(scale[k]) + convert_from<C>(bias[k]));
    mean[row] = mu, rstd[row] = r;
  }
};

/// layer_norm's JVP, a row per item: with xhat = (x - mean) rstd from the kept statistics,
/// ty = rstd (tx - mean(tx) - xhat mean(tx xhat)) scale + xhat tscale + tbias; a null tangent is zero.
template <class T>
struct LayerNormJvpFn {
  using C = compute_t<T>;
  const T *x, *scale, *tx, *tscale, *tbias;
  const C *mean, *rstd;
  T* ty;
  std::int64_t n;
  TG_HD C xhat(const T* xr, std::int64_t k, C mu, C r) const { return (convert_from<C>(xr[k]) - mu) * r; }
  TG_HD void operator()(std::int64_t row) const {
    const T* xr = x + row * n;
    T* yr = ty + row * n;
    const C mu = mean[row], r = rstd[row];
    C m1 = C(0), m2 = C(0);
    if (tx) {
      const T* tr = tx + row * n;
      for (std::int64_t k = 0; k < n; ++k) {
        const C t = convert_from<C>(tr[k]);
        m1 += t, m2 += t * xhat(xr, k, mu, r);
      }
      m1 /= C(n), m2 /= C(n);
    }
    for (std::int64_t k = 0; k < n; ++k) {
      const C h = xhat(xr, k, mu, r);
      C v = tx ? r * (convert_from<C>(tx[row * n + k]) - m1 - h * m2) * convert_from<C>(scale[k]) : C(0);
      if (tscale) v += h * convert_from<C>(tscale[k]);
      if (tbias) v += convert_from<C>(tbias[k]);
      yr[k] = convert_to<T>(v);
    }
  }
};

/// layer_norm's backward in one launch of rows + chunks * n items. Item r < rows is row r's input
/// gradient: with xhat = (x - mean) rstd and g = dy scale, dx = rstd (g - mean(g) - xhat mean(g xhat)).
/// Item rows + c n + k is chunk c's partial sums over its `chunk` rows of column k: dy xhat (for dscale)
/// and dy (for dbias), summed over the chunks afterwards in a fixed order (no atomics). Every item's loop
/// is short and keeps its sums in registers, so a GPU runs thousands of them side by side.
template <class T>
struct LayerNormBackwardFn {
  using C = compute_t<T>;
  const T *x, *scale, *dy;
  const C *mean, *rstd;
  T* dx;
  C *dscale_partial, *dbias_partial;
  std::int64_t rows, n, chunk;
  TG_HD void operator()(std::int64_t i) const {
    if (i < rows) {
      const T* xr = x + i * n;
      const T* dyr = dy + i * n;
      const C mu = mean[i], r = rstd[i];
      C sum_g = C(0), sum_gx = C(0);
      for (std::int64_t k = 0; k < n; ++k) {
        const C g = convert_from<C>(dyr[k]) * convert_from<C>(scale[k]);
        sum_g += g, sum_gx += g * ((convert_from<C>(xr[k]) - mu) * r);
      }
      const C mg = sum_g / C(n), mgx = sum_gx / C(n);
      T* dxr = dx + i * n;
      for (std::int64_t k = 0; k < n; ++k) {
        const C xhat = (convert_from<C>(xr[k]) - mu) * r;
        dxr[k] = convert_to<T>(r * (convert_from<C>(dyr[k]) * convert_from<C>(scale[k]) - mg - xhat * mgx));
      }
      return;
    }
    const std::int64_t j = i - rows, c = j / n, k = j % n;
    const std::int64_t end = (c + 1) * chunk < rows ? (c + 1) * chunk : rows;
    C ps = C(0), pb = C(0);
    for (std::int64_t row = c * chunk; row < end; ++row) {
      const C d = convert_from<C>(dy[row * n + k]);
      ps += d * ((convert_from<C>(x[row * n + k]) - mean[row]) * rstd[row]);
      pb += d;
    }
    dscale_partial[j] = ps, dbias_partial[j] = pb;
  }
};

/// Rows per partial sum of LayerNormBackwardFn: fixed, so the parameter gradients' summation order is too.
inline constexpr std::int64_t layer_norm_chunk = 16;

/// y = keep ? x / keep_prob : 0 with keep = uniform(key)[i] < keep_prob: jax.random.bernoulli's draw and
/// flax's Dropout, element for element. The key comes from the host or from a device tensor (key_data).
template <class T>
struct DropoutFn {
  const T* x;
  T* y;
  random::Key key;
  const std::uint32_t* key_data;  ///< the key's two words on the device, or null for `key`
  float keep_prob;
  TG_HD void operator()(std::int64_t i) const { apply(i, key_data != nullptr ? random::Key{key_data[0], key_data[1]} : key, i); }
  /// y[i] from element n of the mask drawn from k.
  TG_HD void apply(std::int64_t i, random::Key k, std::int64_t n) const {
    using C = compute_t<T>;
    const bool kept = random::detail::unit_float(random::detail::bits32(k, static_cast<std::uint64_t>(n))) < keep_prob;
    y[i] = kept ? convert_to<T>(convert_from<C>(x[i]) / static_cast<C>(keep_prob)) : convert_to<T>(0.0f);
  }
};

/// DropoutFn under tg::vmap: each example of per_example elements draws its mask from index 0, from its
/// own key (key_per_example: key_data holds one per example) or from the one key.
template <class T>
struct DropoutPerExampleFn {
  DropoutFn<T> f;
  std::int64_t per_example;
  bool key_per_example;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t e = key_per_example ? i / per_example : 0;
    f.apply(i, f.key_data != nullptr ? random::Key{f.key_data[2 * e], f.key_data[2 * e + 1]} : f.key, i % per_example);
  }
};

/// y = dropout(x) with DropoutFn, per example when per_example > 0.
template <class T, class D>
void dropout_kernel(std::int64_t n, const DropoutFn<T>& f, std::int64_t per_example, bool key_per_example) {
  if (per_example > 0) index_map<D>(n, DropoutPerExampleFn<T>{f, per_example, key_per_example});
  else index_map<D>(n, f);
}

template <FloatElement T, Device D>
Tensor<T, D> dropout_impl(random::Key key, const Tensor<std::uint32_t, D>* key_data, const Tensor<T, D>& x, double rate,
                          std::int64_t per_example = 0, bool key_per_example = false) {
  Tensor<T, D> y(x.shape());
  const auto keep = static_cast<float>(1.0 - rate);
  const std::uint32_t* kd = key_data ? key_data->data() : nullptr;
  if (y.size() > 0) dropout_kernel<T, D>(y.size(), DropoutFn<T>{x.data(), y.data(), key, kd, keep}, per_example, key_per_example);
  if (recording(x)) {
    // Linear in x: the cotangent goes through the same mask, drawn again from the key.
    Tensor<std::uint32_t, D> kept_key = key_data ? *key_data : Tensor<std::uint32_t, D>{};
    // dropout_impl of dy is that: an op of its own, recorded when a backward pass records.
    record(y, {x.trace()}, [in = x.trace(), key, kept_key, rate, per_example, key_per_example](Tape& t, const Tensor<T, D>& dy) {
      t.accumulate(in, dropout_impl<T, D>(key, kept_key.defined() ? &kept_key : nullptr, dy, rate, per_example, key_per_example));
    }, [&](const Tangents& tangent) {  // linear: the tangent through the same mask
      const Tensor<T, D> tx = tangent(x);
      return tx.defined() ? dropout_impl<T, D>(key, key_data, tx, rate, per_example, key_per_example) : tx;
    }, "dropout");
  }
  return y;
}

inline void check_rate(double rate) {
  TG_CHECK(rate >= 0.0 && rate < 1.0, "dropout", "rate must be in [0, 1), got ", rate);
}

}  // namespace detail

/// Layer normalisation over the last axis, as flax.linen.LayerNorm: (x - mean) / sqrt(var + eps) * scale
/// + bias, with scale and bias of shape (n,) for x (..., n). Statistics in f32 for bf16 inputs. One fused
/// kernel forward (a row per item); backward one fused kernel (a row's dx or a chunk's column sums per
/// item), then the reduction of the chunks' sums.
template <FloatElement T, Device D>
Tensor<T, D> layer_norm(const Tensor<T, D>& x, const Tensor<T, D>& scale, const Tensor<T, D>& bias, double eps = 1e-6) {
  using C = compute_t<T>;
  const char* op = "layer_norm";
  detail::check_defined(x, op), detail::check_defined(scale, op), detail::check_defined(bias, op);
  TG_CHECK(x.rank() >= 1, op, "needs at least one axis, got a scalar");
  const std::int64_t n = x.dim(-1);
  TG_CHECK(scale.shape() == Shape{n} && bias.shape() == Shape{n}, op, "scale and bias must have shape (", n, ",) for x of shape ",
           x.shape().str(), ", got ", scale.shape().str(), " and ", bias.shape().str());
  TG_CHECK(eps > 0.0, op, "eps must be > 0, got ", eps);
  if (detail::higher_order() && detail::recording(x, scale, bias)) {
    // Under two differentiating transformations: the normalisation as its primitives (traced to any
    // order), in T.
    const auto centred = sub(x, broadcast_to(tg::mean(x, -1, true), x.shape()));
    const auto var = tg::mean(mul(centred, centred), -1, true);
    return add(mul(mul(centred, broadcast_to(rsqrt(add(var, eps)), x.shape())), scale), bias);
  }
  if (detail::batched(x, scale, bias)) {  // batching rule: rows; per-example scale and bias apply after
    const Tensor<T, D> px = detail::materialize(x, detail::levels_of(x)).physical();
    if (!detail::batched(scale, bias)) return detail::as_batched(layer_norm(px, scale, bias, eps), x.batch_levels());
    const Tensor<T, D> normed = detail::as_batched(layer_norm(px, ones<T, D>(Shape{n}), zeros<T, D>(Shape{n}), eps), x.batch_levels());
    return add(mul(normed, scale), bias);
  }
  const std::int64_t rows = n ? x.size() / n : 0;
  Tensor<T, D> y(x.shape());
  Tensor<C, D> mean(Shape{rows}), rstd(Shape{rows});
  if (rows > 0 && n > 0)
    detail::index_map<D>(rows, detail::LayerNormFn<T>{x.data(), scale.data(), bias.data(), y.data(), mean.data(), rstd.data(), n, static_cast<C>(eps)}, 8 * n);
  if (detail::recording(x, scale, bias)) {
    detail::record(y, {x.trace(), scale.trace(), bias.trace()},
                   [tx = x.trace(), ts = scale.trace(), tb = bias.trace(), x0 = x.untraced(), s0 = scale.untraced(), mean, rstd, rows, n](
                       detail::Tape& t, const Tensor<T, D>& dy) {
                     const std::int64_t chunk = detail::layer_norm_chunk, chunks = (rows + chunk - 1) / chunk;
                     Tensor<T, D> dx(x0.shape());
                     Tensor<C, D> ps(Shape{chunks, n}), pb(Shape{chunks, n});
                     if (chunks > 0 && n > 0)
                       detail::index_map<D>(rows + chunks * n, detail::LayerNormBackwardFn<T>{x0.data(), s0.data(), dy.data(), mean.data(), rstd.data(),
                                                                                               dx.data(), ps.data(), pb.data(), rows, n, chunk}, 8 * n);
                     t.accumulate(tx, dx);
                     if (t.owns(ts)) t.accumulate(ts, detail::reduce_axis<detail::SumReducer, T>(ps, 0, false, "layer_norm"));
                     if (t.owns(tb)) t.accumulate(tb, detail::reduce_axis<detail::SumReducer, T>(pb, 0, false, "layer_norm"));
                   },
                   [&](const detail::Tangents& tangent) -> Tensor<T, D> {
                     // ty = t_xhat scale + xhat tscale + tbias, t_xhat = rstd (tx - mean(tx) - xhat mean(tx xhat)), from
                     // the kept statistics (at one level nothing differentiates this rule; an enclosing level runs
                     // the normalisation composed).
                     const Tensor<T, D> tx = tangent(x), tsc = tangent(scale), tbi = tangent(bias);
                     if (!tx.defined() && !tsc.defined() && !tbi.defined()) return {};
                     if (detail::active_tape != nullptr) throw detail::NoForwardRule{"layer_norm"};
                     Tensor<T, D> ty(x.shape());
                     if (rows > 0 && n > 0)
                       detail::index_map<D>(rows, detail::LayerNormJvpFn<T>{x.data(), scale.data(), tx.defined() ? tx.data() : nullptr,
                                                                           tsc.defined() ? tsc.data() : nullptr, tbi.defined() ? tbi.data() : nullptr,
                                                                           mean.data(), rstd.data(), ty.data(), n}, 8 * n);
                     return ty;
                   }, op);
  }
  return y;
}

/// Inverted dropout, as flax.linen.Dropout: each element kept with probability 1 - rate and scaled by
/// 1 / (1 - rate), else zero; the mask is jax.random.bernoulli(key, 1 - rate, x.shape), bit for bit.
/// Deterministic given the key; the identity at rate 0 and when `deterministic` (evaluation). A host key
/// cannot be used inside a compiled step (it would be frozen): pass the key as a device tensor there.
template <FloatElement T, Device D>
Tensor<T, D> dropout(random::Key key, const Tensor<T, D>& x, double rate, bool deterministic = false) {
  detail::check_defined(x, "dropout");
  detail::check_rate(rate);
  if (deterministic || rate == 0.0) return x;
  detail::forbid_in_compiled_step("dropout", "a mask drawn from a host key (pass tg::random::key_data(key) as a step input instead)");
  if (detail::batched(x))  // batching rule: one key, so every example draws the same mask (as under jax.vmap)
    return detail::as_batched(detail::dropout_impl<T, D>(key, nullptr, x.physical(), rate, x.size()), x.batch_levels());
  return detail::dropout_impl<T, D>(key, nullptr, x, rate);
}

/// dropout with the key as a device tensor: uint32 of shape (2,), as jax.random.key_data(key) (see
/// tg::random::key_data); usable inside a compiled step, where the key is an input of each call.
template <FloatElement T, Device D>
Tensor<T, D> dropout(const Tensor<std::uint32_t, D>& key, const Tensor<T, D>& x, double rate, bool deterministic = false) {
  detail::check_defined(x, "dropout");
  detail::check_defined(key, "dropout");
  detail::check_rate(rate);
  random::detail::check_key_tensor(key, "dropout");
  if (deterministic || rate == 0.0) return x;
  if (detail::batched(key, x)) {  // batching rule: a batch of keys draws a mask per example; one key, the same for all
    const std::uint32_t lv = detail::levels_of(key, x);
    const Tensor<std::uint32_t, D> kp = detail::batched(key) ? detail::materialize(key, lv).physical() : key;
    return detail::as_batched(detail::dropout_impl<T, D>(random::Key{}, &kp, detail::materialize(x, lv).physical(), rate, x.size(), detail::batched(key)), lv);
  }
  return detail::dropout_impl<T, D>(random::Key{}, &key, x, rate);
}

TG_END_NAMESPACE
