// Scaled dot-product attention as jax.nn.dot_product_attention: softmax(scale q k^T, masked) v per batch
// and head, in one of two forms. Composed: einsum, the masked logits, softmax, einsum (oneDNN's or
// cuBLASLt's GEMMs). Fused: no (T, S) matrix in memory; the softmax rows kept for the backward only for
// short sequences, else recomputed from each row's log-sum-exp, as flash attention does. Its CPU form runs
// (batch, head) blocks, one kernel forward and one backward, with the keys and values copied into the
// block's scratch so that every inner loop is a unit-stride one that vectorises; its GPU form runs a query
// row per thread forward, and backward each row's dO . O, then the query rows' dq and the key rows' dk and
// dv as items of one launch. Both sum in a fixed order (no atomics), and the math is TG_HD functors, so the
// CPU tests run the GPU form too. Also dot_product_attention_weights (flax's), the weights themselves.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/einsum.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/kernels.hpp"
#include "tapegrad/ops/reduce.hpp"

TG_BEGIN_NAMESPACE

/// How dot_product_attention computes, as its `implementation` argument in JAX: `composed` is JAX's "xla"
/// (two batched GEMMs through einsum, the masked logits, softmax), `fused` the kernels below (no (T, S)
/// matrix in memory), `automatic` whichever bench_attention measured faster for the problem's size.
enum class AttentionImplementation { automatic, composed, fused };

/// How dot_product_attention masks and scales: `scale` defaults to 1 / sqrt(head_dim); `is_causal` lets
/// query i attend to keys j <= i only.
struct AttentionOptions {
  std::optional<double> scale = std::nullopt;
  bool is_causal = false;
  AttentionImplementation implementation = AttentionImplementation::automatic;
};

namespace detail {

/// The attention problem's sizes: q (B, T, N, H), k and v (B, S, N, H), and the mask's strides over
/// (B, N, T, S) (0 along its broadcast axes; mask null when there is none).
struct AttentionDims {
  std::int64_t B = 1, T = 0, S = 0, N = 0, H = 0;
  std::int64_t mask_stride[4] = {};
  const std::uint8_t* mask = nullptr;
  bool causal = false;
  double scale = 1.0;

  /// Whether query i of (b, n) may attend to key j.
  TG_HD bool allowed(std::int64_t b, std::int64_t n, std::int64_t i, std::int64_t j) const {
    if (causal && j > i) return false;
    return mask == nullptr || mask[b * mask_stride[0] + n * mask_stride[1] + i * mask_stride[2] + j * mask_stride[3]] != 0;
  }
  TG_HD std::int64_t q_row(std::int64_t b, std::int64_t t, std::int64_t n) const { return ((b * T + t) * N + n) * H; }
  TG_HD std::int64_t kv_row(std::int64_t b, std::int64_t s, std::int64_t n) const { return ((b * S + s) * N + n) * H; }
};

/// The logit of a masked pair, as jax.nn.dot_product_attention writes it (-0.7 times the largest finite
/// value, not -inf): a row with every key masked attends to all of them evenly.
template <class C>
TG_HD C masked_logit() {
  if constexpr (sizeof(C) == 8) return C(-0.7 * 1.7976931348623157e308);
  else return C(-0.7f * 3.4028234663852886e38f);
}

/// The composed path's masking, element (b, n, i, j) of logits (B, N, T, S): scale s_ij where allowed, else
/// the masked logit (forward); scale ds_ij where allowed, else 0 (backward).
template <class T, bool Backward>
struct MaskLogitsFn {
  using C = compute_t<T>;
  const T* in;
  T* out;
  AttentionDims d;
  TG_HD void operator()(std::int64_t e) const {
    const std::int64_t j = e % d.S, i = (e / d.S) % d.T, n = (e / (d.S * d.T)) % d.N, b = e / (d.S * d.T * d.N);
    const bool ok = d.allowed(b, n, i, j);
    if constexpr (Backward) out[e] = ok ? convert_to<T>(convert_from<C>(in[e]) * C(d.scale)) : T(0);
    else out[e] = ok ? convert_to<T>(convert_from<C>(in[e]) * C(d.scale)) : convert_to<T>(masked_logit<C>());
  }
};

/// The largest head_dim the fused kernels take (a row's accumulator lives in the item's registers).
inline constexpr std::int64_t attention_max_head_dim = 256;
/// The most items the CPU form splits a problem's (batch, head) blocks into: enough to share among the
/// threads, few enough that the scratch (a few K^T and V copies) stays small.
inline constexpr std::int64_t attention_cpu_items = 64;

template <class T>
struct AttentionScore {
  using C = compute_t<T>;
  const T *q, *k;
  AttentionDims d;
  /// scale q_i . k_j, or the masked logit.
  TG_HD C operator()(std::int64_t b, std::int64_t n, std::int64_t i, std::int64_t j) const {
    if (!d.allowed(b, n, i, j)) return masked_logit<C>();
    const T* qi = q + d.q_row(b, i, n);
    const T* kj = k + d.kv_row(b, j, n);
    C s = C(0);
    for (std::int64_t h = 0; h < d.H; ++h) s += convert_from<C>(qi[h]) * convert_from<C>(kj[h]);
    return s * C(d.scale);
  }
  /// The largest of query row i's scores (masked ones included, as the softmax sees them).
  TG_HD C row_max(std::int64_t b, std::int64_t n, std::int64_t i) const {
    C m = lowest<C>();
    for (std::int64_t j = 0; j < d.S; ++j) {
      const C s = (*this)(b, n, i, j);
      m = s > m ? s : m;
    }
    return m;
  }
};

/// Forward, item (b, n, i) = ((b * N + n) * T + i): o_i = sum_j softmax_j(s_ij) v_j, and lse_i =
/// max + log(sum of exp) for the backward; with `p` (short sequences), the softmax row itself, so that the
/// backward reads it instead of computing its exps again. One exp per score.
template <class T>
struct AttentionFn {
  using C = compute_t<T>;
  AttentionScore<T> score;
  const T* v;
  T* o;
  C* lse;
  C* p;  // (B, N, T, S), or null
  TG_HD void operator()(std::int64_t item) const {
    const AttentionDims& d = score.d;
    const std::int64_t i = item % d.T, n = (item / d.T) % d.N, b = item / (d.T * d.N);
    const C m = score.row_max(b, n, i);
    C acc[attention_max_head_dim];
    for (std::int64_t h = 0; h < d.H; ++h) acc[h] = C(0);
    C sum = C(0);
    C* pi = p != nullptr ? p + item * d.S : nullptr;
    for (std::int64_t j = 0; j < d.S; ++j) {
      const C e = math::exp(score(b, n, i, j) - m);
      sum += e;
      if (pi) pi[j] = e;
      const T* vj = v + d.kv_row(b, j, n);
      for (std::int64_t h = 0; h < d.H; ++h) acc[h] += e * convert_from<C>(vj[h]);
    }
    T* oi = o + d.q_row(b, i, n);
    const C inv = C(1) / sum;
    for (std::int64_t h = 0; h < d.H; ++h) oi[h] = convert_to<T>(acc[h] * inv);
    if (pi)
      for (std::int64_t j = 0; j < d.S; ++j) pi[j] *= inv;
    lse[item] = m + math::log(sum);
  }
};

/// Whether the forward keeps the softmax rows for the backward: where (T, S) is small enough (at most
/// 256 x 256 per batch and head) that storing them costs less than computing their exps twice more.
inline bool attention_keeps_weights(const AttentionDims& d) { return d.T * d.S <= 65536; }

/// The weights themselves, item (b, n, i): p (B, N, T, S) row i (flax's dot_product_attention_weights).
template <class T>
struct AttentionWeightsFn {
  using C = compute_t<T>;
  AttentionScore<T> score;
  T* p;
  TG_HD void operator()(std::int64_t item) const {
    const AttentionDims& d = score.d;
    const std::int64_t i = item % d.T, n = (item / d.T) % d.N, b = item / (d.T * d.N);
    const C m = score.row_max(b, n, i);
    C sum = C(0);
    for (std::int64_t j = 0; j < d.S; ++j) sum += math::exp(score(b, n, i, j) - m);
    T* pi = p + item * d.S;
    for (std::int64_t j = 0; j < d.S; ++j) pi[j] = convert_to<T>(math::exp(score(b, n, i, j) - m) / sum);
  }
};

/// Backward, first pass, item (b, n, i): delta_i = dO_i . O_i.
template <class T>
struct AttentionDeltaFn {
  using C = compute_t<T>;
  const T *o, *dout;
  C* delta;
  AttentionDims d;
  TG_HD void operator()(std::int64_t item) const {
    const std::int64_t i = item % d.T, n = (item / d.T) % d.N, b = item / (d.T * d.N);
    const std::int64_t row = d.q_row(b, i, n);
    C s = C(0);
    for (std::int64_t h = 0; h < d.H; ++h) s += convert_from<C>(dout[row + h]) * convert_from<C>(o[row + h]);
    delta[item] = s;
  }
};

/// Backward, second pass: items [0, B N T) are query rows, dq_i = scale sum_j ds_ij k_j; items
/// [B N T, B N T + B N S) are key rows, dk_j = scale sum_i ds_ij q_i and dv_j = sum_i p_ij dO_i; with
/// p_ij = exp(s_ij - lse_i) and ds_ij = p_ij (dO_i . v_j - delta_i), zero where masked. Each item sums
/// in index order into registers.
template <class T>
struct AttentionBackwardFn {
  using C = compute_t<T>;
  AttentionScore<T> score;
  const T *v, *dout;
  const C *lse, *delta;
  const C* p;  // the forward's softmax rows, or null: computed again from lse
  T *dq, *dk, *dv;
  /// p_ij: kept by the forward, or exp(s_ij - lse_i).
  TG_HD C prob(std::int64_t b, std::int64_t n, std::int64_t i, std::int64_t j) const {
    const std::int64_t r = (b * score.d.N + n) * score.d.T + i;
    return p != nullptr ? p[r * score.d.S + j] : math::exp(score(b, n, i, j) - lse[r]);
  }
  TG_HD C ds(std::int64_t b, std::int64_t n, std::int64_t i, std::int64_t j, C pij) const {
    const AttentionDims& d = score.d;
    if (!d.allowed(b, n, i, j)) return C(0);
    const T* doi = dout + d.q_row(b, i, n);
    const T* vj = v + d.kv_row(b, j, n);
    C dp = C(0);
    for (std::int64_t h = 0; h < d.H; ++h) dp += convert_from<C>(doi[h]) * convert_from<C>(vj[h]);
    return pij * (dp - delta[(b * d.N + n) * d.T + i]);
  }
  TG_HD void operator()(std::int64_t item) const {
    const AttentionDims& d = score.d;
    const std::int64_t rows = d.B * d.N * d.T;
    C acc[attention_max_head_dim], acc_v[attention_max_head_dim];
    for (std::int64_t h = 0; h < d.H; ++h) acc[h] = C(0), acc_v[h] = C(0);
    if (item < rows) {
      const std::int64_t i = item % d.T, n = (item / d.T) % d.N, b = item / (d.T * d.N);
      for (std::int64_t j = 0; j < d.S; ++j) {
        const C g = ds(b, n, i, j, prob(b, n, i, j));
        const T* kj = score.k + d.kv_row(b, j, n);
        for (std::int64_t h = 0; h < d.H; ++h) acc[h] += g * convert_from<C>(kj[h]);
      }
      T* out = dq + d.q_row(b, i, n);
      for (std::int64_t h = 0; h < d.H; ++h) out[h] = convert_to<T>(acc[h] * C(d.scale));
      return;
    }
    const std::int64_t key = item - rows, j = key % d.S, n = (key / d.S) % d.N, b = key / (d.S * d.N);
    for (std::int64_t i = 0; i < d.T; ++i) {
      const C pij = prob(b, n, i, j);
      const C g = ds(b, n, i, j, pij);
      const T* qi = score.q + d.q_row(b, i, n);
      const T* doi = dout + d.q_row(b, i, n);
      for (std::int64_t h = 0; h < d.H; ++h) {
        acc[h] += g * convert_from<C>(qi[h]);
        acc_v[h] += pij * convert_from<C>(doi[h]);
      }
    }
    T* out_k = dk + d.kv_row(b, j, n);
    T* out_v = dv + d.kv_row(b, j, n);
    for (std::int64_t h = 0; h < d.H; ++h) out_k[h] = convert_to<T>(acc[h] * C(d.scale)), out_v[h] = convert_to<T>(acc_v[h]);
  }
};

// The CPU's form of the fused kernels: an item is one (batch, head) pair, its T query rows in order, with
// K^T and V (and, backward, K and V^T) copied once into the item's scratch in C. A query row's scores are
// then s += q_h K^T[h, :] and its output o += p_j V[j, :], unit-stride loops over the keys or head_dim
// that vectorise, where the row items' dot products are serial sums. The backward item owns its keys, so
// dk and dv add the query rows' terms in order: no atomics, the same bits for any thread count. A causal
// problem without a mask stops each row at its last allowed key (the rest weigh exactly 0).

/// s[j] = sum_h q[h] kt[h S + j], j < n.
template <class C>
TG_HD inline void attention_scores_row(const C* __restrict__ q, const C* __restrict__ kt, C* __restrict__ s, std::int64_t H, std::int64_t S,
                                       std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) s[j] = C(0);
  for (std::int64_t h = 0; h < H; ++h) {
    const C qh = q[h];
    const C* __restrict__ row = kt + h * S;
    for (std::int64_t j = 0; j < n; ++j) s[j] += qh * row[j];
  }
}

/// acc[h] += sum_j w[j] rows[j H + h], j < n, in j's order.
template <class C>
TG_HD inline void attention_weighted_rows(const C* __restrict__ w, const C* __restrict__ rows, C* __restrict__ acc, std::int64_t H,
                                          std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) {
    const C wj = w[j];
    const C* __restrict__ r = rows + j * H;
    for (std::int64_t h = 0; h < H; ++h) acc[h] += wj * r[h];
  }
}

/// out[j H + h] += w[j] x[h], j < n.
template <class C>
TG_HD inline void attention_outer_add(const C* __restrict__ w, const C* __restrict__ x, C* __restrict__ out, std::int64_t H, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) {
    const C wj = w[j];
    C* __restrict__ r = out + j * H;
    for (std::int64_t h = 0; h < H; ++h) r[h] += wj * x[h];
  }
}

/// Copies the (b, n) slice of k (B, S, N, H) into kt (H, S) and, when rows is given, into rows (S, H), in C.
template <class T>
TG_HD void attention_gather_keys(const T* k, const AttentionDims& d, std::int64_t b, std::int64_t n, compute_t<T>* kt, compute_t<T>* rows) {
  for (std::int64_t j = 0; j < d.S; ++j) {
    const T* kj = k + d.kv_row(b, j, n);
    for (std::int64_t h = 0; h < d.H; ++h) {
      const compute_t<T> x = convert_from<compute_t<T>>(kj[h]);
      if (kt) kt[h * d.S + j] = x;
      if (rows) rows[j * d.H + h] = x;
    }
  }
}

/// The last key row i attends to, plus one: i + 1 for a causal problem without a mask, else S.
TG_HD inline std::int64_t attention_keys_seen(const AttentionDims& d, std::int64_t i) {
  return d.causal && d.mask == nullptr ? (i + 1 < d.S ? i + 1 : d.S) : d.S;
}

/// Query row i's softmax over keys j < n into s (the scores on entry), as AttentionFn computes it: the
/// masked logits, the max, one exp per key, normalised; returns the log-sum-exp.
template <class C>
TG_HD C attention_softmax_row(C* s, const AttentionDims& d, std::int64_t b, std::int64_t n, std::int64_t i, std::int64_t keys) {
  if (d.causal || d.mask != nullptr)
    for (std::int64_t j = 0; j < keys; ++j)
      if (!d.allowed(b, n, i, j)) s[j] = masked_logit<C>();
  C m = lowest<C>();
  for (std::int64_t j = 0; j < keys; ++j) m = s[j] > m ? s[j] : m;
  C sum = C(0);
  for (std::int64_t j = 0; j < keys; ++j) {
    s[j] = math::exp_poly(s[j] - m);
    sum += s[j];
  }
  const C inv = C(1) / sum;
  for (std::int64_t j = 0; j < keys; ++j) s[j] *= inv;
  return m + math::log(sum);
}

/// Forward, CPU form: item (b, n). Scratch per item: K^T (H, S), V (S, H) and a row (S), in C.
template <class T>
struct AttentionBlockFn {
  using C = compute_t<T>;
  const T *q, *k, *v;
  T* o;
  C* lse;
  C* p;  // (B, N, T, S) softmax rows kept for the backward, or null
  C* scratch;
  AttentionDims d;
  std::int64_t blocks_per_item;
  TG_HD static std::int64_t scratch_per_item(const AttentionDims& d) { return 2 * d.H * d.S + d.S; }
  TG_HD void operator()(std::int64_t item) const {
    for (std::int64_t blk = item * blocks_per_item; blk < (item + 1) * blocks_per_item && blk < d.B * d.N; ++blk)
      block(blk, scratch + item * scratch_per_item(d));
  }
  TG_HD void block(std::int64_t blk, C* kt) const {
    const std::int64_t n = blk % d.N, b = blk / d.N;
    C* vr = kt + d.H * d.S;
    C* row = vr + d.S * d.H;
    attention_gather_keys(k, d, b, n, kt, static_cast<C*>(nullptr));
    attention_gather_keys(v, d, b, n, static_cast<C*>(nullptr), vr);
    C qi[attention_max_head_dim], acc[attention_max_head_dim];
    for (std::int64_t i = 0; i < d.T; ++i) {
      const T* qrow = q + d.q_row(b, i, n);
      for (std::int64_t h = 0; h < d.H; ++h) qi[h] = convert_from<C>(qrow[h]) * C(d.scale), acc[h] = C(0);
      const std::int64_t keys = attention_keys_seen(d, i);
      attention_scores_row(qi, kt, row, d.H, d.S, keys);
      const std::int64_t r = (b * d.N + n) * d.T + i;
      lse[r] = attention_softmax_row(row, d, b, n, i, keys);
      attention_weighted_rows(row, vr, acc, d.H, keys);
      T* orow = o + d.q_row(b, i, n);
      for (std::int64_t h = 0; h < d.H; ++h) orow[h] = convert_to<T>(acc[h]);
      if (p) {
        C* pi = p + r * d.S;
        for (std::int64_t j = 0; j < d.S; ++j) pi[j] = j < keys ? row[j] : C(0);
      }
    }
  }
};

/// Backward, CPU form: item (b, n), its query rows in order; dq of each row, and dk, dv summed over the rows
/// in the item's scratch: K^T (H, S), K (S, H), V^T (H, S), dK and dV (S, H), two rows (S), in C.
template <class T>
struct AttentionBlockBackwardFn {
  using C = compute_t<T>;
  const T *q, *k, *v, *o, *dout;
  const C *lse, *p;  // p: the forward's softmax rows, or null
  T *dq, *dk, *dv;
  C* scratch;
  AttentionDims d;
  std::int64_t blocks_per_item;
  TG_HD static std::int64_t scratch_per_item(const AttentionDims& d) { return 5 * d.H * d.S + 2 * d.S; }
  TG_HD void operator()(std::int64_t item) const {
    for (std::int64_t blk = item * blocks_per_item; blk < (item + 1) * blocks_per_item && blk < d.B * d.N; ++blk)
      block(blk, scratch + item * scratch_per_item(d));
  }
  TG_HD void block(std::int64_t blk, C* kt) const {
    const std::int64_t n = blk % d.N, b = blk / d.N, HS = d.H * d.S;
    C *kr = kt + HS, *vt = kr + HS, *dkr = vt + HS, *dvr = dkr + HS, *pr = dvr + HS, *ds = pr + d.S;
    attention_gather_keys(k, d, b, n, kt, kr);
    attention_gather_keys(v, d, b, n, vt, static_cast<C*>(nullptr));
    for (std::int64_t e = 0; e < 2 * HS; ++e) dkr[e] = C(0);
    C qi[attention_max_head_dim], doi[attention_max_head_dim], acc[attention_max_head_dim];
    for (std::int64_t i = 0; i < d.T; ++i) {
      const T *qrow = q + d.q_row(b, i, n), *orow = o + d.q_row(b, i, n), *drow = dout + d.q_row(b, i, n);
      C delta = C(0);
      for (std::int64_t h = 0; h < d.H; ++h) {
        qi[h] = convert_from<C>(qrow[h]) * C(d.scale), doi[h] = convert_from<C>(drow[h]), acc[h] = C(0);
        delta += doi[h] * convert_from<C>(orow[h]);
      }
      const std::int64_t keys = attention_keys_seen(d, i), r = (b * d.N + n) * d.T + i;
      if (p) {
        for (std::int64_t j = 0; j < keys; ++j) pr[j] = p[r * d.S + j];
      } else {
        attention_scores_row(qi, kt, pr, d.H, d.S, keys);
        if (d.causal || d.mask != nullptr)
          for (std::int64_t j = 0; j < keys; ++j)
            if (!d.allowed(b, n, i, j)) pr[j] = masked_logit<C>();
        for (std::int64_t j = 0; j < keys; ++j) pr[j] = math::exp_poly(pr[j] - lse[r]);
      }
      attention_scores_row(doi, vt, ds, d.H, d.S, keys);  // dp_ij = dO_i . v_j
      for (std::int64_t j = 0; j < keys; ++j) ds[j] = pr[j] * (ds[j] - delta);
      if (d.causal || d.mask != nullptr)
        for (std::int64_t j = 0; j < keys; ++j)
          if (!d.allowed(b, n, i, j)) ds[j] = C(0);
      attention_weighted_rows(ds, kr, acc, d.H, keys);
      T* dqrow = dq + d.q_row(b, i, n);
      for (std::int64_t h = 0; h < d.H; ++h) dqrow[h] = convert_to<T>(acc[h] * C(d.scale));
      attention_outer_add(ds, qi, dkr, d.H, keys);  // qi carries the scale
      attention_outer_add(pr, doi, dvr, d.H, keys);
    }
    for (std::int64_t j = 0; j < d.S; ++j) {
      T *dkj = dk + d.kv_row(b, j, n), *dvj = dv + d.kv_row(b, j, n);
      for (std::int64_t h = 0; h < d.H; ++h) dkj[h] = convert_to<T>(dkr[j * d.H + h]), dvj[h] = convert_to<T>(dvr[j * d.H + h]);
    }
  }
};

/// Checks the operands (q (B, T, N, H) or (T, N, H), k and v (B, S, N, H), a mask broadcastable to
/// (B, N, T, S)) and returns the problem's sizes.
template <class T, class D>
AttentionDims attention_dims(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v, const std::type_identity_t<Tensor<std::uint8_t, D>>* mask,
                             const AttentionOptions& o, const char* op) {
  check_defined(q, op), check_defined(k, op), check_defined(v, op);
  TG_CHECK((q.rank() == 4 || q.rank() == 3) && k.rank() == q.rank() && v.rank() == q.rank(), op,
           "query, key and value must be (batch, length, heads, head_dim) or (length, heads, head_dim), got ", q.shape().str(), ", ",
           k.shape().str(), " and ", v.shape().str());
  const int r = q.rank();
  AttentionDims d;
  d.B = r == 4 ? q.dim(0) : 1, d.T = q.dim(-3), d.N = q.dim(-2), d.H = q.dim(-1), d.S = k.dim(-3);
  TG_CHECK(k.shape() == v.shape() && (r == 3 || k.dim(0) == d.B) && k.dim(-2) == d.N && k.dim(-1) == d.H, op, "key and value must be (",
           r == 4 ? std::to_string(d.B) + ", " : std::string(), "length, ", d.N, ", ", d.H, ") for a query of shape ", q.shape().str(), ", got ",
           k.shape().str(), " and ", v.shape().str());
  TG_CHECK(d.S > 0, op, "the key length is 0: there is nothing to attend to (key of shape ", k.shape().str(), ")");
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(d.H)));
  TG_CHECK(std::isfinite(scale), op, "scale must be finite, got ", scale);
  d.scale = scale, d.causal = o.is_causal;
  if (mask != nullptr) {
    check_defined(*mask, op);
    const Shape full{d.B, d.N, d.T, d.S};
    TG_CHECK(mask->rank() <= 4, op, "the mask must broadcast to (batch, heads, length, key length) ", full.str(), ", got ", mask->shape().str());
    std::int64_t stride = 1;
    for (int a = 3; a >= 0; --a) {
      const int ma = mask->rank() - 4 + a;
      const std::int64_t n = ma >= 0 ? mask->dim(ma) : 1;
      TG_CHECK(n == 1 || n == full[a], op, "the mask of shape ", mask->shape().str(), " does not broadcast to (batch, heads, length, key length) ",
               full.str());
      d.mask_stride[a] = n == 1 ? 0 : stride;
      stride *= n;
    }
    d.mask = mask->data();
  }
  return d;
}

/// mask_logits' cotangent: scaled where allowed, 0 where masked. Its own transpose, so it records itself
/// when a backward pass records.
template <FloatElement T, Device D>
Tensor<T, D> mask_logits_transpose(const Tensor<T, D>& dout, const Tensor<std::uint8_t, D>& kept_mask, AttentionDims d) {
  d.mask = kept_mask.defined() ? kept_mask.data() : nullptr;
  Tensor<T, D> dlogits(dout.shape());
  if (dlogits.size() > 0) index_map<D>(dlogits.size(), MaskLogitsFn<T, true>{dout.data(), dlogits.data(), d});
  if (recording(dout))
    record(dlogits, {dout.trace()}, [in = dout.trace(), kept_mask, d](Tape& t, const Tensor<T, D>& g) {
      t.accumulate(in, mask_logits_transpose(g, kept_mask, d));
    }, [&](const Tangents& tangent) {  // linear, diagonal: its own JVP
      const Tensor<T, D> t = tangent(dout);
      return t.defined() ? mask_logits_transpose(t, kept_mask, d) : t;
    }, "dot_product_attention");
  return dlogits;
}

/// The logits (B, N, T, S) scaled and masked, differentiable in `logits`.
template <FloatElement T, Device D>
Tensor<T, D> mask_logits(const Tensor<T, D>& logits, const Tensor<std::uint8_t, D>* mask, const AttentionDims& d) {
  Tensor<T, D> out(logits.shape());
  if (out.size() > 0) index_map<D>(out.size(), MaskLogitsFn<T, false>{logits.data(), out.data(), d});
  if (recording(logits)) {
    const Tensor<std::uint8_t, D> kept_mask = mask ? *mask : Tensor<std::uint8_t, D>{};
    record(out, {logits.trace()}, [in = logits.trace(), kept_mask, d](Tape& t, const Tensor<T, D>& dout) {
      t.accumulate(in, mask_logits_transpose(dout, kept_mask, d));
    }, [&](const Tangents& tangent) {  // the scaled tangent where allowed, 0 where masked (a masked logit is a constant)
      const Tensor<T, D> t = tangent(logits);
      return t.defined() ? mask_logits_transpose(t, kept_mask, d) : t;
    }, "dot_product_attention");
  }
  return out;
}

/// JAX's "xla" implementation: einsum, the masked and scaled logits, softmax, einsum; each op differentiable
/// as itself.
template <FloatElement T, Device D>
Tensor<T, D> attention_composed(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v, const Tensor<std::uint8_t, D>* mask,
                                const AttentionDims& d) {
  const bool batched = q.rank() == 4;
  const Tensor<T, D> logits = einsum(batched ? "btnh,bsnh->bnts" : "tnh,snh->nts", q, k);
  const Tensor<T, D> p = softmax(mask_logits(logits.reshape(Shape{d.B, d.N, d.T, d.S}), mask, d));
  return einsum(batched ? "bnts,bsnh->btnh" : "nts,snh->tnh", batched ? p : p.reshape(Shape{d.N, d.T, d.S}), v);
}

/// The fused kernels, in D's form (ByBlock: the CPU's (batch, head) blocks; otherwise a GPU's rows; the
/// tests run both on the CPU): one kernel forward, one backward (rows: two).
template <FloatElement T, Device D, bool ByBlock = few_long_items<D>>
Tensor<T, D> attention_fused(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v, const Tensor<std::uint8_t, D>* mask,
                             const AttentionDims& d) {
  using C = compute_t<T>;
  Tensor<T, D> out(q.shape());
  Tensor<C, D> lse(Shape{d.B * d.N * d.T});
  const bool traced = recording(q, k, v);
  Tensor<C, D> p;  // the softmax rows, kept for the backward of short sequences
  if (traced && attention_keeps_weights(d)) p = Tensor<C, D>(Shape{d.B * d.N * d.T * d.S});
  C* const kept = p.defined() ? p.data() : nullptr;
  const std::int64_t heads = d.B * d.N, rows = heads * d.T, keys = heads * d.S;
  // The CPU's items are runs of (batch, head) blocks, at most attention_cpu_items of them, each with its
  // scratch (reused block after block, so it stays in cache); a GPU's are query rows (and key rows
  // backward).
  constexpr bool by_head = ByBlock;
  const std::int64_t per_item = (heads + attention_cpu_items - 1) / attention_cpu_items, items = (heads + per_item - 1) / per_item;
  if (out.size() > 0) {
    Tensor<C, D> scratch(Shape{by_head ? items * AttentionBlockFn<T>::scratch_per_item(d) : 0});
    if constexpr (by_head)
      index_map<D>(items, AttentionBlockFn<T>{q.data(), k.data(), v.data(), out.data(), lse.data(), kept, scratch.data(), d, per_item},
                   4 * per_item * d.T * d.S * d.H);
    else
      index_map<D>(rows, AttentionFn<T>{{q.data(), k.data(), d}, v.data(), out.data(), lse.data(), kept}, 4 * d.S * d.H);
  }
  if (traced) {
    const Tensor<std::uint8_t, D> kept_mask = mask ? *mask : Tensor<std::uint8_t, D>{};
    record(out, {q.trace(), k.trace(), v.trace()},
           [tq = q.trace(), tk = k.trace(), tv = v.trace(), q0 = q.untraced(), k0 = k.untraced(), v0 = v.untraced(), o0 = out.untraced(), lse, p,
            kept_mask, d, per_item, items, rows, keys](Tape& t, const Tensor<T, D>& dout) {
             AttentionDims dd = d;
             dd.mask = kept_mask.defined() ? kept_mask.data() : nullptr;
             if constexpr (!by_head) static_cast<void>(per_item);  // the by-head backward's block count only
             const C* pk = p.defined() ? p.data() : nullptr;
             Tensor<T, D> dq(q0.shape()), dk(k0.shape()), dv(v0.shape());
             if (rows + keys > 0) {
               Tensor<C, D> delta(Shape{by_head ? 0 : rows});
               Tensor<C, D> scratch(Shape{by_head ? items * AttentionBlockBackwardFn<T>::scratch_per_item(dd) : 0});
               if (!by_head && rows > 0) index_map<D>(rows, AttentionDeltaFn<T>{o0.data(), dout.data(), delta.data(), dd}, dd.H);
               if constexpr (by_head)
                 index_map<D>(items,
                              AttentionBlockBackwardFn<T>{q0.data(), k0.data(), v0.data(), o0.data(), dout.data(), lse.data(), pk, dq.data(),
                                                          dk.data(), dv.data(), scratch.data(), dd, per_item},
                              8 * per_item * dd.T * dd.S * dd.H);
               else
                 index_map<D>(rows + keys,
                              AttentionBackwardFn<T>{{q0.data(), k0.data(), dd}, v0.data(), dout.data(), lse.data(), delta.data(), pk, dq.data(),
                                                     dk.data(), dv.data()},
                              4 * std::max(dd.S, dd.T) * dd.H);
             }
             t.accumulate(tq, dq);
             t.accumulate(tk, dk);
             t.accumulate(tv, dv);
           },
           [&](const Tangents& tangent) -> Tensor<T, D> {
             // From the kept softmax rows P: tS = scale (tq k^T + q tk^T) where allowed (a masked logit is a
             // constant), tP = P (tS - rowsum(P tS)), tO = tP v + P tv. At one level (nothing differentiates
             // the rule) and where P is kept; else the JVP transposes (an enclosing level runs it composed).
             const Tensor<T, D> tq = tangent(q), tk = tangent(k), tv = tangent(v);
             if (!tq.defined() && !tk.defined() && !tv.defined()) return {};
             if (active_tape != nullptr || !p.defined()) throw NoForwardRule{"dot_product_attention"};
             const bool b4 = q.rank() == 4;
             const char* qk = b4 ? "btnh,bsnh->bnts" : "tnh,snh->nts";
             const char* pv = b4 ? "bnts,bsnh->btnh" : "nts,snh->tnh";
             const Shape logits{d.B, d.N, d.T, d.S};
             const Tensor<T, D> pt = cast<T>(p).reshape(b4 ? logits : Shape{d.N, d.T, d.S});
             Tensor<T, D> to = tv.defined() ? einsum(pv, pt, tv) : Tensor<T, D>{};
             if (tq.defined() || tk.defined()) {
               Tensor<T, D> ts = tq.defined() ? einsum(qk, tq, k) : Tensor<T, D>{};
               if (tk.defined()) ts = ts.defined() ? add(ts, einsum(qk, q, tk)) : einsum(qk, q, tk);
               const Tensor<std::uint8_t, D> kept_mask = mask ? *mask : Tensor<std::uint8_t, D>{};
               const Tensor<T, D> tsm = mask_logits_transpose(ts.reshape(logits), kept_mask, d);  // scaled, 0 where masked
               const Tensor<T, D> p4 = pt.reshape(logits);
               Tensor<T, D> tp(logits);
               index_map<D>(d.B * d.N * d.T, SoftmaxJvpRowFn<T, false>{p4.data(), tsm.data(), tp.data(), d.S}, 4 * d.S);
               const Tensor<T, D> term = einsum(pv, b4 ? tp : tp.reshape(Shape{d.N, d.T, d.S}), v);
               to = to.defined() ? add(to, term) : term;
             }
             return to;
           }, "dot_product_attention");
  }
  return out;
}

/// Whether `automatic` takes the fused kernels, as bench_attention measured them against the composed form
/// (compiled forward + backward in f32 on a 2-core Xeon, 2026-12-05; fused / composed time at T = S = 16,
/// 64, 128, 256, 512, and causal at 256 and 1,024):
///   AVX-512 loops  0.69 0.77 0.69 1.14 1.24, causal 0.80 0.68
///   AVX2 loops     0.90 0.80 1.08 1.50 1.99, causal 0.87 1.00
///   SSE2 loops     1.05 1.03 1.37 2.02 2.57, causal 1.22 1.35
/// So on the CPU: up to 64 x 64 with AVX2, 128 x 128 with AVX-512, and a causal problem without a mask
/// (its rows stop at the diagonal) up to 256 x 256 with AVX2 and at any length with AVX-512; never with
/// SSE2 alone, where oneDNN's GEMMs win. On CUDA (a row per thread; not yet measured on a GPU): up to
/// 64 x 64, the short sequences whose rows fit a thread's registers.
template <Device D>
bool attention_fused_is_faster(const AttentionDims& d) {
  const std::int64_t ts = d.T * d.S;
  const bool stops_at_diagonal = d.causal && d.mask == nullptr;
  switch (vector_floats<D>()) {
    case 16: return ts <= 128 * 128 || stops_at_diagonal;
    case 8: return ts <= 64 * 64 || (stops_at_diagonal && ts <= 256 * 256);
    case 4: return false;
    default: return ts <= 64 * 64;  // a GPU: a thread per row
  }
}

template <FloatElement T, Device D>
Tensor<T, D> attention_impl(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v, const Tensor<std::uint8_t, D>* mask,
                            const AttentionOptions& o);

/// The batching rule of the attention ops: every batch axis (and the op's own batch axis, if any) folds
/// into one batch axis of a rank-4 problem; a mask is spread to each example's (B, N, T, S) first.
template <FloatElement T, Device D, class F>
Tensor<T, D> attention_batched(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v, const std::type_identity_t<Tensor<std::uint8_t, D>>* mask,
                               const AttentionOptions& o, const char* op, F run) {
  std::uint32_t lv = levels_of(q, k, v);
  if (mask) lv |= mask->batch_levels();
  (void)attention_dims(q, k, v, nullptr, o, op);  // the checks, per example
  const Tensor<T, D> pq = materialize(q, lv).physical(), pk = materialize(k, lv).physical(), pv = materialize(v, lv).physical();
  const int nb = batch_rank(lv), r = q.rank();
  std::int64_t bt = 1;
  for (int i = 0; i < nb + r - 3; ++i) bt *= pq.dim(i);
  auto fold = [&](const Tensor<T, D>& x) { return x.reshape(Shape{bt, x.dim(-3), x.dim(-2), x.dim(-1)}); };
  std::vector<std::int64_t> lead(pq.shape().dims().begin(), pq.shape().dims().begin() + nb + r - 3);
  Tensor<T, D> y;
  if (mask) {
    const std::int64_t B = r == 4 ? q.dim(0) : 1;
    TG_CHECK(mask->rank() <= 4, op, "the mask must broadcast to (batch, heads, length, key length), got ", mask->shape().str());
    const Tensor<std::uint8_t, D> m = broadcast_to(aligned(materialize(*mask, lv), lv, 4), with_batch(lv, Shape{B, q.dim(-2), q.dim(-3), k.dim(-3)}, op));
    const Tensor<std::uint8_t, D> fm = m.reshape(Shape{bt, q.dim(-2), q.dim(-3), k.dim(-3)});
    y = run(fold(pq), fold(pk), fold(pv), &fm);
  } else {
    y = run(fold(pq), fold(pk), fold(pv), nullptr);
  }
  lead.insert(lead.end(), y.shape().dims().begin() + 1, y.shape().dims().end());
  return as_batched(y.reshape(Shape(lead)), lv);
}

template <FloatElement T, Device D>
Tensor<T, D> attention_impl(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v, const Tensor<std::uint8_t, D>* mask,
                            const AttentionOptions& o) {
  const char* op = "dot_product_attention";
  if (batched(q, k, v) || (mask && batched(*mask)))  // batching rule
    return attention_batched(q, k, v, mask, o, op, [&](const auto& fq, const auto& fk, const auto& fv, const Tensor<std::uint8_t, D>* fm) {
      return attention_impl(fq, fk, fv, fm, o);
    });
  const AttentionDims d = attention_dims(q, k, v, mask, o, op);
  TG_CHECK(d.H <= attention_max_head_dim || o.implementation != AttentionImplementation::fused, op, "head_dim ", d.H, " is above the fused kernels' ",
           attention_max_head_dim, "; use implementation = AttentionImplementation::composed (or automatic)");
  // Under two differentiating transformations the composed form, whose ops are traced to any order; under
  // forward mode too where the fused kernel's rule cannot run (the softmax rows not kept: long sequences).
  const bool higher = (higher_order() || (forward_mode() && !attention_keeps_weights(d))) && recording(q, k, v);
  const bool fused = !higher && (o.implementation == AttentionImplementation::fused ||
                                 (o.implementation == AttentionImplementation::automatic && d.H <= attention_max_head_dim &&
                                  attention_fused_is_faster<D>(d)));
  return fused ? attention_fused(q, k, v, mask, d) : attention_composed(q, k, v, mask, d);
}

}  // namespace detail

/// Scaled dot-product attention, as jax.nn.dot_product_attention: query (B, T, N, H), key and value
/// (B, S, N, H) (or all three without the batch axis) -> (B, T, N, H): for each batch and head,
/// softmax(scale q k^T) v with scale 1 / sqrt(H) by default, `is_causal` masking keys after the query.
/// `implementation`: composed, fused (no (T, S) matrix in memory; head_dim at most 256) or, by default,
/// whichever was measured faster for the problem's size on this device (attention_fused_is_faster).
/// Statistics in f32 for bf16.
template <FloatElement T, Device D>
Tensor<T, D> dot_product_attention(const Tensor<T, D>& query, const Tensor<T, D>& key, const Tensor<T, D>& value, AttentionOptions options = {}) {
  return detail::attention_impl<T, D>(query, key, value, nullptr, options);
}

/// dot_product_attention with a mask (uint8, nonzero where a query may attend to a key) broadcastable to
/// (B, N, T, S). A masked pair's logit is JAX's large negative number, not -inf: a row with every key
/// masked attends to all of them evenly, as in JAX.
template <FloatElement T, Device D>
Tensor<T, D> dot_product_attention(const Tensor<T, D>& query, const Tensor<T, D>& key, const Tensor<T, D>& value,
                                   const Tensor<std::uint8_t, D>& mask, AttentionOptions options = {}) {
  return detail::attention_impl<T, D>(query, key, value, &mask, options);
}

/// The softmax weights of dot_product_attention (flax.linen.dot_product_attention_weights): (B, N, T, S)
/// (or (N, T, S) without the batch axis). Not differentiable: for looking at, as the ViT example's report
/// does.
template <FloatElement T, Device D>
Tensor<T, D> dot_product_attention_weights(const Tensor<T, D>& query, const Tensor<T, D>& key, AttentionOptions options = {}) {
  if (detail::batched(query, key))  // batching rule, as the attention's
    return detail::attention_batched(query, key, key, nullptr, options, "dot_product_attention_weights",
                                     [&](const auto& fq, const auto& fk, const auto&, const Tensor<std::uint8_t, D>*) {
                                       return dot_product_attention_weights(fq, fk, options);
                                     });
  const detail::AttentionDims d = detail::attention_dims(query, key, key, nullptr, options, "dot_product_attention_weights");
  Tensor<T, D> p(query.rank() == 4 ? Shape{d.B, d.N, d.T, d.S} : Shape{d.N, d.T, d.S});
  if (p.size() > 0)
    detail::index_map<D>(d.B * d.N * d.T, detail::AttentionWeightsFn<T>{{query.data(), key.data(), d}, p.data()}, 4 * d.S * d.H);
  return p;
}

TG_END_NAMESPACE
