// bfloat16: 2-byte storage with round-to-nearest-even conversion, identical on host and device.
#pragma once

#include <cstdint>
#include <cstring>

#include "tapegrad/config.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

TG_HD inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TG_HD inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

TG_HD inline double bits_double(std::uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

/// float -> bf16 bits, rounding to nearest even. Every NaN becomes the canonical quiet NaN 0x7FFF, as
/// CUDA's __float2bfloat16 does on the host and `cvt.rn.bf16.f32` does on sm_80+.
/// Branch-free, so a loop of it vectorises (the CPU's f32 -> bf16 conversion is one).
TG_HD inline std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  // Adding 0x7FFF plus the lowest kept bit rounds half to even; a carry into the exponent is correct
  // (it rounds up to the next binade, or to infinity past the largest finite bf16).
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : rounded);
}

TG_HD inline float bf16_bits_to_float(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// bfloat16 value: 1 sign, 8 exponent and 7 mantissa bits. Arithmetic goes through float.
struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  TG_HD explicit bf16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  TG_HD explicit bf16(double d) : bf16(static_cast<float>(d)) {}
  TG_HD explicit bf16(int i) : bf16(static_cast<float>(i)) {}
  TG_HD operator float() const { return detail::bf16_bits_to_float(bits); }

  /// The bf16 whose bit pattern is `b`.
  TG_HD static bf16 from_bits(std::uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
};

static_assert(sizeof(bf16) == 2, "bf16 must be two bytes");

TG_END_NAMESPACE
