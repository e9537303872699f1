// Threefry-2x32 (20 rounds), the counter-based hash under JAX's PRNG (Salmon et al., SC'11), as a TG_HD
// function so the CPU and CUDA draw the same numbers.
#pragma once

#include <cstdint>

#include "tapegrad/config.hpp"

TG_BEGIN_NAMESPACE
namespace random {

/// A PRNG key: two 32-bit words, as jax.random.key_data(key) shows them.
struct Key {
  std::uint32_t k0 = 0, k1 = 0;
  friend bool operator==(const Key&, const Key&) = default;
};

namespace detail {

TG_HD inline std::uint32_t rotl32(std::uint32_t v, int r) { return (v << r) | (v >> (32 - r)); }

/// Four Threefry rounds with rotation constants r0..r3.
TG_HD inline void threefry_rounds(std::uint32_t& x0, std::uint32_t& x1, int r0, int r1, int r2, int r3) {
  x0 += x1; x1 = rotl32(x1, r0); x1 ^= x0;
  x0 += x1; x1 = rotl32(x1, r1); x1 ^= x0;
  x0 += x1; x1 = rotl32(x1, r2); x1 ^= x0;
  x0 += x1; x1 = rotl32(x1, r3); x1 ^= x0;
}

}  // namespace detail

/// Threefry-2x32-20 of the counter (x0, x1) under `key`, in place.
TG_HD inline void threefry2x32(Key key, std::uint32_t& x0, std::uint32_t& x1) {
  // Key schedule with the Skein parity constant; the injection after every fourth round adds the round count.
  const std::uint32_t ks0 = key.k0, ks1 = key.k1, ks2 = key.k0 ^ key.k1 ^ 0x1BD11BDAu;
  x0 += ks0; x1 += ks1;
  detail::threefry_rounds(x0, x1, 13, 15, 26, 6);
  x0 += ks1; x1 += ks2 + 1u;
  detail::threefry_rounds(x0, x1, 17, 29, 16, 24);
  x0 += ks2; x1 += ks0 + 2u;
  detail::threefry_rounds(x0, x1, 13, 15, 26, 6);
  x0 += ks0; x1 += ks1 + 3u;
  detail::threefry_rounds(x0, x1, 17, 29, 16, 24);
  x0 += ks1; x1 += ks2 + 4u;
  detail::threefry_rounds(x0, x1, 13, 15, 26, 6);
  x0 += ks2; x1 += ks0 + 5u;
}

/// The hash of the 64-bit counter `i` (high word first), as JAX's partitionable Threefry uses for the
/// i-th element of a row-major array: the building block of split, random_bits and everything above.
TG_HD inline Key threefry_at(Key key, std::uint64_t i) {
  std::uint32_t x0 = static_cast<std::uint32_t>(i >> 32), x1 = static_cast<std::uint32_t>(i);
  threefry2x32(key, x0, x1);
  return {x0, x1};
}

}  // namespace random
TG_END_NAMESPACE
