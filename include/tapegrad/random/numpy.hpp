// NumPy's default generator (SeedSequence -> PCG64 -> Generator) on the host, bit for bit: tg::random::numpy
// draws the data order the codelab draws with np.random.default_rng, beside the JAX-compatible device PRNG.
//
// Followed line by line from NumPy's source at commit 1f90bbb55e65e7de68921bc3f1a2d94492fdf689 (2.6.0.dev0):
// numpy/random/bit_generator.pyx (SeedSequence), _pcg64.pyx and src/pcg64/pcg64.h (PCG64), _generator.pyx
// (shuffle, permutation, choice) and src/distributions/distributions.c (random_interval,
// random_bounded_uint64); tests/data/numpy_random_golden.txt (scripts/gen_numpy_golden.py) pins the streams.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"

TG_BEGIN_NAMESPACE
namespace random::numpy {

// PCG64's state is one 128-bit integer; __extension__ keeps -Wpedantic quiet about the GNU type, which g++,
// clang and nvcc's host pass all provide on 64-bit targets (NumPy uses the same type where it exists).
__extension__ typedef unsigned __int128 uint128;

/// np.random.SeedSequence(entropy) for a non-negative integer entropy (no spawn key, pool_size 4): the
/// hash that turns a small seed into well-mixed state words.
class SeedSequence {
 public:
  static constexpr std::size_t pool_size = 4;

  explicit SeedSequence(std::uint64_t entropy) {
    // _coerce_to_uint32_array: the integer as 32-bit words, least significant first; 0 is one word [0].
    std::array<std::uint32_t, 2> words{static_cast<std::uint32_t>(entropy),
                                       static_cast<std::uint32_t>(entropy >> 32)};
    const std::size_t n_words = (entropy >> 32) != 0 ? 2 : 1;
    // mix_entropy: hash the words into the pool (zeros past the entropy), then mix every word into every
    // other. A 64-bit seed never exceeds the pool, so NumPy's third loop (extra entropy words) never runs.
    std::uint32_t hash_const = init_a;
    for (std::size_t i = 0; i < pool_size; ++i) pool_[i] = hashmix(i < n_words ? words[i] : 0u, hash_const);
    for (std::size_t src = 0; src < pool_size; ++src)
      for (std::size_t dst = 0; dst < pool_size; ++dst)
        if (src != dst) pool_[dst] = mix(pool_[dst], hashmix(pool_[src], hash_const));
  }

  /// generate_state(n_words, np.uint32): n_words words drawn by cycling the pool through a second hash.
  std::vector<std::uint32_t> generate_state32(std::size_t n_words) const {
    std::vector<std::uint32_t> state(n_words);
    std::uint32_t hash_const = init_b;
    for (std::size_t i = 0; i < n_words; ++i) {
      std::uint32_t v = pool_[i % pool_size] ^ hash_const;
      hash_const *= mult_b;
      v *= hash_const;
      v ^= v >> xshift;
      state[i] = v;
    }
    return state;
  }

  /// generate_state(n_words, np.uint64): 2 * n_words 32-bit words paired little-endian (low word first).
  std::vector<std::uint64_t> generate_state64(std::size_t n_words) const {
    const auto w = generate_state32(2 * n_words);
    std::vector<std::uint64_t> state(n_words);
    for (std::size_t i = 0; i < n_words; ++i) state[i] = w[2 * i] | (std::uint64_t{w[2 * i + 1]} << 32);
    return state;
  }

  /// The mixed entropy pool (SeedSequence.pool).
  const std::array<std::uint32_t, pool_size>& pool() const { return pool_; }

 private:
  static constexpr std::uint32_t init_a = 0x43b0d7e5, mult_a = 0x931e8875;
  static constexpr std::uint32_t init_b = 0x8b51f9dd, mult_b = 0x58f38ded;
  static constexpr std::uint32_t mix_mult_l = 0xca01f9dd, mix_mult_r = 0x4973f715;
  static constexpr int xshift = 16;

  // The multiplier advances with every call, so hashmix carries it in and out.
  static std::uint32_t hashmix(std::uint32_t value, std::uint32_t& hash_const) {
    value ^= hash_const;
    hash_const *= mult_a;
    value *= hash_const;
    value ^= value >> xshift;
    return value;
  }
  static std::uint32_t mix(std::uint32_t x, std::uint32_t y) {
    std::uint32_t r = mix_mult_l * x - mix_mult_r * y;
    r ^= r >> xshift;
    return r;
  }

  std::array<std::uint32_t, pool_size> pool_{};
};

/// The PCG64 state as np.random.PCG64().state shows it: the LCG state and increment, and the buffered
/// upper half of the last 64-bit draw that next32 has not handed out yet.
struct PCG64State {
  uint128 state = 0, inc = 0;
  bool has_uint32 = false;
  std::uint32_t uinteger = 0;
};

/// np.random.PCG64(seed): PCG-XSL-RR 128/64 (O'Neill's setseq variant), seeded through SeedSequence.
class PCG64 {
 public:
  /// == np.random.PCG64(seed): generate_state(4, uint64) gives (initstate high, low, initseq high, low).
  explicit PCG64(std::uint64_t seed) : PCG64(SeedSequence(seed)) {}

  explicit PCG64(const SeedSequence& seed_seq) {
    const auto s = seed_seq.generate_state64(4);
    const uint128 initstate = (uint128{s[0]} << 64) | s[1];
    const uint128 initseq = (uint128{s[2]} << 64) | s[3];
    // pcg_setseq_128_srandom_r
    st_.state = 0;
    st_.inc = (initseq << 1u) | 1u;
    step();
    st_.state += initstate;
    step();
  }

  /// The next 64 bits (bit_generator.random_raw()): step the LCG, then output XSL-RR of the new state.
  std::uint64_t next64() {
    step();
    const auto hi = static_cast<std::uint64_t>(st_.state >> 64), lo = static_cast<std::uint64_t>(st_.state);
    const auto rot = static_cast<unsigned>(st_.state >> 122);
    const std::uint64_t x = hi ^ lo;
    return (x >> rot) | (x << ((-rot) & 63u));
  }

  /// The next 32 bits as NumPy's pcg64_next32 gives them: the low half of a fresh 64-bit draw, and the
  /// buffered high half on the call after (which every 32-bit consumer of the Generator shares).
  std::uint32_t next32() {
    if (st_.has_uint32) {
      st_.has_uint32 = false;
      return st_.uinteger;
    }
    const std::uint64_t next = next64();
    st_.has_uint32 = true;
    st_.uinteger = static_cast<std::uint32_t>(next >> 32);
    return static_cast<std::uint32_t>(next);
  }

  const PCG64State& state() const { return st_; }

 private:
  static constexpr uint128 multiplier = (uint128{2549297995355413924ULL} << 64) | 4865540595714422341ULL;
  void step() { st_.state = st_.state * multiplier + st_.inc; }

  PCG64State st_;
};

namespace detail {

/// The smallest all-ones mask >= max (gen_mask / _gen_mask).
inline std::uint64_t gen_mask(std::uint64_t max) {
  std::uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  return mask;
}

/// random_interval: uniform in [0, max] by masked rejection, from next32 when max fits 32 bits. What
/// shuffle (and so permutation) draws with.
inline std::uint64_t random_interval(PCG64& bitgen, std::uint64_t max) {
  if (max == 0) return 0;
  const std::uint64_t mask = gen_mask(max);
  std::uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (bitgen.next32() & mask)) > max) {
    }
  } else {
    while ((value = (bitgen.next64() & mask)) > max) {
    }
  }
  return value;
}

/// bounded_lemire_uint64 (Lemire, arXiv:1805.10941): uniform in [0, rng], rng < 2^64 - 1.
inline std::uint64_t bounded_lemire_uint64(PCG64& bitgen, std::uint64_t rng) {
  const std::uint64_t rng_excl = rng + 1;
  uint128 m = uint128{bitgen.next64()} * rng_excl;
  auto leftover = static_cast<std::uint64_t>(m);
  if (leftover < rng_excl) {  // rng_excl bounds the threshold, so the modulo is only paid near a rejection
    const std::uint64_t threshold = (UINT64_MAX - rng) % rng_excl;
    while (leftover < threshold) {
      m = uint128{bitgen.next64()} * rng_excl;
      leftover = static_cast<std::uint64_t>(m);
    }
  }
  return static_cast<std::uint64_t>(m >> 64);
}

/// buffered_bounded_lemire_uint32: the same on next32, rng < 2^32 - 1.
inline std::uint32_t bounded_lemire_uint32(PCG64& bitgen, std::uint32_t rng) {
  const std::uint32_t rng_excl = rng + 1;
  std::uint64_t m = std::uint64_t{bitgen.next32()} * rng_excl;
  auto leftover = static_cast<std::uint32_t>(m);
  if (leftover < rng_excl) {
    const std::uint32_t threshold = (UINT32_MAX - rng) % rng_excl;
    while (leftover < threshold) {
      m = std::uint64_t{bitgen.next32()} * rng_excl;
      leftover = static_cast<std::uint32_t>(m);
    }
  }
  return static_cast<std::uint32_t>(m >> 32);
}

/// random_bounded_uint64(bitgen, off, rng, 0, use_masked=false): off + uniform in [0, rng], Lemire's method
/// on next32 for ranges that fit 32 bits and on next64 otherwise; the two full ranges take raw draws.
/// What choice and integers draw with.
inline std::uint64_t random_bounded_uint64(PCG64& bitgen, std::uint64_t off, std::uint64_t rng) {
  if (rng == 0) return off;
  if (rng <= 0xffffffffULL) {
    if (rng == 0xffffffffULL) return off + bitgen.next32();  // 32-bit Lemire cannot take rng + 1 = 2^32
    return off + bounded_lemire_uint32(bitgen, static_cast<std::uint32_t>(rng));
  }
  if (rng == UINT64_MAX) return off + bitgen.next64();
  return off + bounded_lemire_uint64(bitgen, rng);
}

/// _shuffle_int: Fisher-Yates over data[first..n), from the back, with random_bounded_uint64 (not
/// random_interval, which shuffle uses: the two give different streams).
inline void shuffle_int(PCG64& bitgen, std::int64_t n, std::int64_t first, std::int64_t* data) {
  for (std::int64_t i = n - 1; i >= first; --i) {
    const auto j = static_cast<std::int64_t>(random_bounded_uint64(bitgen, 0, static_cast<std::uint64_t>(i)));
    std::swap(data[i], data[j]);
  }
}

}  // namespace detail

/// np.random.Generator over PCG64: the methods the codelab's data pipeline calls, drawing exactly NumPy's
/// numbers for the same seed and the same sequence of calls.
class Generator {
 public:
  /// == np.random.default_rng(seed).
  explicit Generator(std::uint64_t seed) : bitgen_(seed) {}
  explicit Generator(PCG64 bitgen) : bitgen_(std::move(bitgen)) {}

  PCG64& bit_generator() { return bitgen_; }
  const PCG64& bit_generator() const { return bitgen_; }

  /// shuffle(x) for a 1-d array: Fisher-Yates from the back with random_interval, in place.
  template <class T>
  void shuffle(std::span<T> x) {
    const auto n = static_cast<std::int64_t>(x.size());
    for (std::int64_t i = n - 1; i >= 1; --i) {
      const auto j = static_cast<std::int64_t>(detail::random_interval(bitgen_, static_cast<std::uint64_t>(i)));
      std::swap(x[static_cast<std::size_t>(i)], x[static_cast<std::size_t>(j)]);
    }
  }

  /// permutation(n): a shuffled arange(n), (n,) int64. NumPy returns an empty array for n < 0 (arange's
  /// rule); here that is an error, as it is always a caller's mistake.
  std::vector<std::int64_t> permutation(std::int64_t n) {
    TG_CHECK(n >= 0, "numpy::permutation", "n must be >= 0, got ", n);
    std::vector<std::int64_t> arr(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) arr[static_cast<std::size_t>(i)] = i;
    shuffle(std::span<std::int64_t>(arr));
    return arr;
  }

  /// choice(n, k, replace=False) (shuffle=True): k distinct indices from [0, n), (k,) int64, in random order.
  std::vector<std::int64_t> choice(std::int64_t n, std::int64_t k) {
    TG_CHECK(k >= 0, "numpy::choice", "k must be >= 0, got ", k);
    TG_CHECK(n > 0 || k == 0, "numpy::choice", "n must be > 0 unless no samples are taken, got n = ", n);
    TG_CHECK(k <= n, "numpy::choice", "cannot take k = ", k, " samples from n = ", n,
             " without replacement: k must be <= n");
    // NumPy's tuning: a large population and a sample above n / 50 shuffle the tail of arange(n); otherwise
    // Floyd's algorithm with a linear-probing hash set, then a shuffle of the picks (both with
    // random_bounded_uint64, so neither shares random_interval's stream).
    constexpr std::int64_t cutoff = 50;  // 20 with shuffle=False
    if (n > 10000 && k > n / cutoff) {
      std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) idx[static_cast<std::size_t>(i)] = i;
      detail::shuffle_int(bitgen_, n, std::max<std::int64_t>(n - k, 1), idx.data());
      return std::vector<std::int64_t>(idx.end() - k, idx.end());
    }
    std::vector<std::int64_t> idx(static_cast<std::size_t>(k));
    // The set is sized to the smallest power of two above 1.2 * k, computed in double as NumPy does.
    const std::uint64_t mask = detail::gen_mask(static_cast<std::uint64_t>(1.2 * static_cast<double>(k)));
    constexpr std::uint64_t empty = UINT64_MAX;
    std::vector<std::uint64_t> hash_set(mask + 1, empty);
    for (std::int64_t j = n - k; j < n; ++j) {
      const std::uint64_t val = detail::random_bounded_uint64(bitgen_, 0, static_cast<std::uint64_t>(j));
      std::uint64_t loc = val & mask;
      while (hash_set[loc] != empty && hash_set[loc] != val) loc = (loc + 1) & mask;
      if (hash_set[loc] == empty) {  // val is new: take it
        hash_set[loc] = val;
        idx[static_cast<std::size_t>(j - n + k)] = static_cast<std::int64_t>(val);
      } else {  // val was taken before: take j, which no earlier step could draw
        loc = static_cast<std::uint64_t>(j) & mask;
        while (hash_set[loc] != empty) loc = (loc + 1) & mask;
        hash_set[loc] = static_cast<std::uint64_t>(j);
        idx[static_cast<std::size_t>(j - n + k)] = j;
      }
    }
    detail::shuffle_int(bitgen_, k, 1, idx.data());
    return idx;
  }

  /// integers(low, high) (dtype int64, endpoint=False): one draw uniform in [low, high). Drawing it k
  /// times equals integers(low, high, size=k).
  std::int64_t integers(std::int64_t low, std::int64_t high) {
    TG_CHECK(low < high, "numpy::integers", "low must be < high, got low = ", low, ", high = ", high);
    // [low, high - 1] as an offset and an unsigned span, which wraps correctly for any int64 pair.
    const std::uint64_t off = static_cast<std::uint64_t>(low);
    const std::uint64_t rng = static_cast<std::uint64_t>(high) - off - 1;
    return static_cast<std::int64_t>(detail::random_bounded_uint64(bitgen_, off, rng));
  }

 private:
  PCG64 bitgen_;
};

/// np.random.default_rng(seed).
inline Generator default_rng(std::uint64_t seed) { return Generator(seed); }

}  // namespace random::numpy
TG_END_NAMESPACE
