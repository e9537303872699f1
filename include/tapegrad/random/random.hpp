// JAX's splittable PRNG in C++: key, split, fold_in, random_bits, uniform, normal, permutation.
// Same seed, shape and dtype give JAX's numbers (jax_threefry_partitionable=True, JAX's default since
// 0.5): keys, bits and uniforms bit for bit, float32 normals within 2 ulp (XLA's erf_inv polynomial).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/bf16.hpp"
#include "tapegrad/core/batching.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/random/threefry.hpp"

TG_BEGIN_NAMESPACE
namespace random {

/// A key from an integer seed, as jax.random.key(seed): [0, seed] for 32-bit seeds (JAX's default x32
/// mode), [seed >> 32, seed & 0xFFFFFFFF] for larger ones (as JAX with x64 enabled).
inline Key key(std::int64_t seed) {
  if (seed >= std::numeric_limits<std::int32_t>::min() && seed <= std::numeric_limits<std::int32_t>::max())
    return {0u, static_cast<std::uint32_t>(seed)};
  return {static_cast<std::uint32_t>(static_cast<std::uint64_t>(seed) >> 32), static_cast<std::uint32_t>(seed)};
}

/// `n` new keys, as jax.random.split(key, n).
inline std::vector<Key> split(Key key, int n) {
  TG_CHECK(n >= 0, "random::split", "n must be >= 0, got ", n);
  std::vector<Key> keys(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) keys[static_cast<std::size_t>(i)] = threefry_at(key, static_cast<std::uint64_t>(i));
  return keys;
}

/// Two new keys, for `auto [key, sub] = tg::random::split(key);`.
inline std::array<Key, 2> split(Key key) { return {threefry_at(key, 0), threefry_at(key, 1)}; }

/// A key derived from `key` and `data`, as jax.random.fold_in.
inline Key fold_in(Key key, std::uint32_t data) {
  std::uint32_t x0 = 0, x1 = data;
  threefry2x32(key, x0, x1);
  return {x0, x1};
}

namespace detail {

/// 32 random bits for element i: the two hash words xor-ed, as JAX's partitionable random_bits.
TG_HD inline std::uint32_t bits32(Key key, std::uint64_t i) {
  const Key h = threefry_at(key, i);
  return h.k0 ^ h.k1;
}

/// 64 random bits for element i: high word first.
TG_HD inline std::uint64_t bits64(Key key, std::uint64_t i) {
  const Key h = threefry_at(key, i);
  return (static_cast<std::uint64_t>(h.k0) << 32) | h.k1;
}

/// A float in [0, 1) from the top 23 bits (JAX's construction: mantissa bits under exponent 0, minus 1).
TG_HD inline float unit_float(std::uint32_t bits) {
  return ::tg::detail::bits_float((bits >> 9) | 0x3F800000u) - 1.0f;
}

TG_HD inline double unit_double(std::uint64_t bits) {
  return ::tg::detail::bits_double((bits >> 12) | 0x3FF0000000000000ull) - 1.0;
}

/// bf16 in [0, 1) from 8 random bits (JAX draws 8 bits when the mantissa has fewer than 8).
TG_HD inline float unit_bf16(std::uint32_t bits) {
  const auto b8 = static_cast<std::uint16_t>(bits & 0xFFu);
  return ::tg::detail::bf16_bits_to_float(static_cast<std::uint16_t>((b8 >> 1) | 0x3F80u)) - 1.0f;
}

/// log1p for float as XLA evaluates it: for |x| < sqrt(2) - 1 the Cephes rational approximation
/// x - x^2/2 + x^3 P(x)/Q(x) (fused multiply-adds), else log(1 + x) with 1 + x rounded to float first.
/// The log of the large branch is taken in double and rounded once, identically on host and device.
TG_HD inline float log1p_f32(float x) {
  if (fabsf(x) < 0.41421356f) {
    const float num[7] = {4.5270000862445199635215e-5f, 4.9854102823193375972212e-1f, 6.5787325942061044846969e0f,
                          2.9911919328553073277375e1f,  6.0949667980987787057556e1f,  5.7112963590585538103336e1f,
                          2.0039553499201281259648e1f};
    const float den[7] = {1.0f, 1.5062909083469192043167e1f, 8.3047565967967209469434e1f, 2.2176239823732856465394e2f,
                          3.0909872225312059774938e2f, 2.1642788614495947685003e2f, 6.0118660497603843919306e1f};
    float p = num[0], q = den[0];
    for (int i = 1; i < 7; ++i) {
      p = fmaf(p, x, num[i]);
      q = fmaf(q, x, den[i]);
    }
    const float x2 = x * x;
    return x + fmaf(-0.5f, x2, (x * x2) * (p / q));
  }
  return static_cast<float>(::log(static_cast<double>(x + 1.0f)));
}

/// erf^-1 for float, XLA's ErfInv32 (Giles, "Approximating the erfinv function", GPU Gems 4): a degree-8
/// polynomial in w = -log(1 - x^2) on each side of w = 5, evaluated with fused multiply-adds so the host
/// and the device round identically.
TG_HD inline float erf_inv_f32(float x) {
  const float w0 = -log1p_f32(-x * x);
  float p, w;
  if (w0 < 5.0f) {
    w = w0 - 2.5f;
    p = 2.81022636e-08f;
    p = fmaf(p, w, 3.43273939e-07f);
    p = fmaf(p, w, -3.5233877e-06f);
    p = fmaf(p, w, -4.39150654e-06f);
    p = fmaf(p, w, 0.00021858087f);
    p = fmaf(p, w, -0.00125372503f);
    p = fmaf(p, w, -0.00417768164f);
    p = fmaf(p, w, 0.246640727f);
    p = fmaf(p, w, 1.50140941f);
  } else {
    w = sqrtf(w0) - 3.0f;
    p = -0.000200214257f;
    p = fmaf(p, w, 0.000100950558f);
    p = fmaf(p, w, 0.00134934322f);
    p = fmaf(p, w, -0.00367342844f);
    p = fmaf(p, w, 0.00573950773f);
    p = fmaf(p, w, -0.0076224613f);
    p = fmaf(p, w, 0.00943887047f);
    p = fmaf(p, w, 1.00167406f);
    p = fmaf(p, w, 2.83297682f);
  }
  if (fabsf(x) == 1.0f) return x * INFINITY;
  return p * x;
}

/// erf^-1 for double: the float approximation (in double) refined by Newton steps on erf, or on erfc in
/// the tails where 1 - |x| carries the information; accurate to a few ulp of double.
TG_HD inline double erf_inv_f64(double x) {
  if (fabs(x) >= 1.0) return x == 1.0 ? INFINITY : (x == -1.0 ? -INFINITY : NAN);
  const double ax = fabs(x);
  const double w0 = -log1p(-ax * ax);
  double y;
  if (w0 < 5.0) {
    const double w = w0 - 2.5;
    y = (((((((2.81022636e-08 * w + 3.43273939e-07) * w - 3.5233877e-06) * w - 4.39150654e-06) * w +
             0.00021858087) * w - 0.00125372503) * w - 0.00417768164) * w + 0.246640727) * w + 1.50140941;
  } else {
    const double w = ::sqrt(w0) - 3.0;
    y = (((((((-0.000200214257 * w + 0.000100950558) * w + 0.00134934322) * w - 0.00367342844) * w +
             0.00573950773) * w - 0.0076224613) * w + 0.00943887047) * w + 1.00167406) * w + 2.83297682;
  }
  y *= ax;
  const double two_over_sqrt_pi = 1.1283791670955126;
  for (int it = 0; it < 3; ++it) {
    const double slope = two_over_sqrt_pi * ::exp(-y * y);
    // erf(y) - ax; above 0.5 written as (1 - ax) - erfc(y), where 1 - ax is exact (Sterbenz) and erfc
    // keeps the tail's precision.
    const double residual = ax > 0.5 ? (1.0 - ax) - std::erfc(y) : std::erf(y) - ax;
    y -= residual / slope;
  }
  return x < 0 ? -y : y;
}

/// out[i] = random_bits(key)[i] (32 bits).
struct BitsFn {
  Key key;
  std::uint32_t* out;
  TG_HD void operator()(std::int64_t i) const { out[i] = bits32(key, static_cast<std::uint64_t>(i)); }
};

/// out[i] = uniform in [lo, hi), as jax.random.uniform: u * (hi - lo) + lo, then max with lo.
template <class T>
struct UniformFn {
  Key key;
  T* out;
  double lo, hi;
  TG_HD void operator()(std::int64_t i) const { out[i] = value(key, static_cast<std::uint64_t>(i)); }
  /// Element n of the draw from `key`.
  TG_HD T value(Key key, std::uint64_t n) const {
    if constexpr (std::is_same_v<T, float>) {
      const float flo = static_cast<float>(lo), range = static_cast<float>(hi) - flo;
      return fmaxf(flo, fmaf(unit_float(bits32(key, n)), range, flo));
    } else if constexpr (std::is_same_v<T, double>) {
      return fmax(lo, fma(unit_double(bits64(key, n)), hi - lo, lo));
    } else {
      // bf16 arithmetic: each operation rounds to bf16, as XLA does for a bf16 computation.
      const float blo = static_cast<float>(bf16(static_cast<float>(lo)));
      const float range = static_cast<float>(bf16(static_cast<float>(bf16(static_cast<float>(hi))) - blo));
      const float scaled = static_cast<float>(bf16(unit_bf16(bits32(key, n)) * range));
      return bf16(fmaxf(blo, static_cast<float>(bf16(scaled + blo))));
    }
  }
};

/// out[i] = standard normal, as jax.random.normal: sqrt(2) * erf_inv(uniform in (-1, 1)).
template <class T>
struct NormalFn {
  Key key;
  T* out;
  TG_HD void operator()(std::int64_t i) const { out[i] = value(key, static_cast<std::uint64_t>(i)); }
  /// Element n of the draw from `key`.
  TG_HD T value(Key key, std::uint64_t n) const {
    if constexpr (std::is_same_v<T, float>) {
      // lo = nextafter(-1, 0); hi - lo rounds to 2 in float, so u * 2 + lo is exact before the add.
      const float lo = -0.99999994f;
      const float u = fmaxf(lo, fmaf(unit_float(bits32(key, n)), 2.0f, lo));
      return 1.41421354f * erf_inv_f32(u);
    } else if constexpr (std::is_same_v<T, double>) {
      const double lo = -0.99999999999999989;  // nextafter(-1.0, 0.0)
      const double u = fmax(lo, fma(unit_double(bits64(key, n)), 2.0, lo));
      return 1.4142135623730951 * erf_inv_f64(u);
    } else {
      const float lo = -0.99609375f;  // nextafter(-1, 0) in bf16; hi - lo rounds to 2 in bf16
      const float u = fmaxf(lo, static_cast<float>(bf16(unit_bf16(bits32(key, n)) * 2.0f + lo)));
      const float e = static_cast<float>(bf16(erf_inv_f32(u)));  // XLA evaluates bf16 erf_inv in float
      return bf16(1.4140625f * e);                               // sqrt(2) rounded to bf16
    }
  }
};

/// out[i] = a draw (UniformFn / NormalFn) from keys held on the device: element i % per_key of the draw
/// from key i / per_key (per_key 0: every element from the one key).
template <class T, class Draw>
struct DeviceKeyDrawFn {
  const std::uint32_t* keys;
  T* out;
  std::int64_t per_key;
  Draw draw;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t k = per_key ? i / per_key : 0, n = per_key ? i % per_key : i;
    out[i] = draw.value(Key{keys[2 * k], keys[2 * k + 1]}, static_cast<std::uint64_t>(n));
  }
};

/// A key held as a device tensor is uint32 of shape (2,) per example (jax.random.key_data); anything
/// else is an error naming `op`.
template <Device D>
void check_key_tensor(const Tensor<std::uint32_t, D>& key, const char* op) {
  TG_CHECK(key.defined() && key.shape() == Shape{2}, op, "a key tensor must have shape (2,) (jax.random.key_data), got ",
           key.defined() ? key.shape().str() : std::string("an undefined tensor"));
}

/// A draw of `shape` from a key tensor (uint32 (2,)); under tg::vmap a batch of keys draws each
/// example's own values (and one key the same values for every example), as jax.random under jax.vmap.
template <class T, class D, class Draw>
Tensor<T, D> draw_from_key_tensor(const Tensor<std::uint32_t, D>& key, const Shape& shape, Draw draw, const char* op) {
  check_key_tensor(key, op);
  if (::tg::detail::batched(key)) {
    const std::uint32_t lv = key.batch_levels();
    Tensor<T, D> t(::tg::detail::with_batch(lv, shape, op));
    if (t.size() > 0) ::tg::detail::index_map<D>(t.size(), DeviceKeyDrawFn<T, Draw>{key.physical().data(), t.data(), shape.numel(), draw});
    return Tensor<T, D>::batched(t, lv);
  }
  Tensor<T, D> t(shape);
  if (t.size() > 0) ::tg::detail::index_map<D>(t.size(), DeviceKeyDrawFn<T, Draw>{key.data(), t.data(), 0, draw});
  return t;
}

}  // namespace detail

/// The key's two words as a uint32 tensor of shape (2,) on D, as jax.random.key_data(key): how a key
/// enters a compiled step as an input (tg::dropout takes one).
template <Device D = Cpu>
Tensor<std::uint32_t, D> key_data(Key key) {
  return from_vector<D>(std::vector<std::uint32_t>{key.k0, key.k1});
}

namespace detail {
/// out[i] = fold_in(key[i], data) for keys held on the device (two words each).
struct FoldInFn {
  const std::uint32_t* key;
  std::uint32_t data;
  std::uint32_t* out;
  TG_HD void operator()(std::int64_t i) const {
    std::uint32_t x0 = 0, x1 = data;
    threefry2x32(Key{key[2 * i], key[2 * i + 1]}, x0, x1);
    out[2 * i] = x0, out[2 * i + 1] = x1;
  }
};
}  // namespace detail

/// fold_in for a key held as a device tensor (uint32 of shape (2,), key_data): a new key tensor derived
/// from `key` and `data`, equal to jax.random.fold_in(key, data), computed on the device, so a compiled
/// step derives its per-site keys (dropout's) from the key it is given.
template <Device D>
Tensor<std::uint32_t, D> fold_in(const Tensor<std::uint32_t, D>& key, std::uint32_t data) {
  detail::check_key_tensor(key, "random::fold_in");
  if (::tg::detail::batched(key)) {  // batching rule: a batch of keys, each folded
    const auto p = key.physical();
    Tensor<std::uint32_t, D> out(p.shape());
    ::tg::detail::index_map<D>(p.size() / 2, detail::FoldInFn{p.data(), data, out.data()});
    return Tensor<std::uint32_t, D>::batched(out, key.batch_levels());
  }
  Tensor<std::uint32_t, D> out(Shape{2});
  ::tg::detail::index_map<D>(1, detail::FoldInFn{key.data(), data, out.data()});
  return out;
}

/// 32 random bits per element, as jax.random.bits(key, shape) (uint32).
template <Device D = Cpu>
Tensor<std::uint32_t, D> bits(Key key, const Shape& shape) {
  Tensor<std::uint32_t, D> t(shape);
  ::tg::detail::forbid_in_compiled_step("random::bits", "a draw from a host key");
  ::tg::detail::index_map<D>(t.size(), detail::BitsFn{key, t.data()});
  return t;
}

/// Uniform in [minval, maxval), as jax.random.uniform(key, shape, dtype, minval, maxval).
template <FloatElement T = float, Device D = Cpu>
Tensor<T, D> uniform(Key key, const Shape& shape, double minval = 0.0, double maxval = 1.0) {
  TG_CHECK(minval < maxval, "random::uniform", "minval must be < maxval, got [", minval, ", ", maxval, ")");
  Tensor<T, D> t(shape);
  ::tg::detail::forbid_in_compiled_step("random::uniform", "a draw from a host key");
  ::tg::detail::index_map<D>(t.size(), detail::UniformFn<T>{key, t.data(), minval, maxval});
  return t;
}

/// Standard normal, as jax.random.normal(key, shape, dtype).
template <FloatElement T = float, Device D = Cpu>
Tensor<T, D> normal(Key key, const Shape& shape) {
  Tensor<T, D> t(shape);
  ::tg::detail::forbid_in_compiled_step("random::normal", "a draw from a host key");
  ::tg::detail::index_map<D>(t.size(), detail::NormalFn<T>{key, t.data()});
  return t;
}

/// uniform from a key held as a device tensor (uint32 of shape (2,), key_data): usable inside a compiled
/// step (the key an input of each call) and under tg::vmap (a batch of keys). Equal to the host-key draw.
template <FloatElement T = float, Device D = Cpu>
Tensor<T, D> uniform(const Tensor<std::uint32_t, D>& key, const Shape& shape, double minval = 0.0, double maxval = 1.0) {
  TG_CHECK(minval < maxval, "random::uniform", "minval must be < maxval, got [", minval, ", ", maxval, ")");
  return detail::draw_from_key_tensor<T, D>(key, shape, detail::UniformFn<T>{{}, nullptr, minval, maxval}, "random::uniform");
}

/// normal from a key held as a device tensor, as uniform's.
template <FloatElement T = float, Device D = Cpu>
Tensor<T, D> normal(const Tensor<std::uint32_t, D>& key, const Shape& shape) {
  return detail::draw_from_key_tensor<T, D>(key, shape, detail::NormalFn<T>{{}, nullptr}, "random::normal");
}

/// A random permutation of 0..n-1, as jax.random.permutation(key, n): stable sorts of the indices by
/// 32-bit random keys, ceil(3 ln n / ln(2^32 - 1)) rounds, each with a fresh subkey. Computed on the host.
template <Device D = Cpu>
Tensor<std::int32_t, D> permutation(Key key, std::int64_t n) {
  TG_CHECK(n >= 0 && n <= std::numeric_limits<std::int32_t>::max(), "random::permutation",
           "n must be in [0, 2^31), got ", n);
  ::tg::detail::forbid_in_compiled_step("random::permutation", "a draw from a host key");
  std::vector<std::int32_t> x(static_cast<std::size_t>(n));
  std::iota(x.begin(), x.end(), 0);
  const int rounds = static_cast<int>(
      std::ceil(3.0 * std::log(static_cast<double>(std::max<std::int64_t>(1, n))) / std::log(4294967295.0)));
  std::vector<std::uint32_t> sort_keys(x.size());
  std::vector<std::size_t> order(x.size());
  std::vector<std::int32_t> next(x.size());
  for (int r = 0; r < rounds; ++r) {
    const auto [k, sub] = split(key);
    key = k;
    for (std::size_t i = 0; i < x.size(); ++i) sort_keys[i] = detail::bits32(sub, i);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return sort_keys[a] < sort_keys[b]; });
    for (std::size_t i = 0; i < x.size(); ++i) next[i] = x[order[i]];
    x.swap(next);
  }
  return from_vector<D>(x, Shape{n});
}

}  // namespace random
TG_END_NAMESPACE
