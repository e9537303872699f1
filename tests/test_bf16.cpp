// bf16: round-to-nearest-even against an independent reference, every bit pattern, NaN and infinities.
#include "test_common.hpp"

#include <cmath>
#include <limits>
#include <random>

namespace bf16_tests {

namespace {

/// Reference rounding by value: the nearer of the two bf16 neighbours of f, ties to the even one.
std::uint16_t reference_bf16(float f) {
  if (std::isnan(f)) return 0x7fff;
  const std::uint32_t u = bits_of(f);
  const auto down = static_cast<std::uint16_t>(u >> 16);  // truncation toward zero
  const auto up = static_cast<std::uint16_t>(down + 1);   // next magnitude (may reach infinity)
  if ((u & 0xffffu) == 0) return down;
  const double exact = std::fabs(static_cast<double>(f));
  const double lo = std::fabs(static_cast<double>(float_of(static_cast<std::uint32_t>(down) << 16)));
  const float up_f = float_of(static_cast<std::uint32_t>(up) << 16);
  // Past the largest finite bf16 the upper neighbour is infinity; IEEE rounds to it at the midpoint
  // between the largest finite value and 2^128, treating 2^128 as the next step.
  const double hi = std::isinf(up_f) ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(up_f));
  const double d_lo = exact - lo, d_hi = hi - exact;
  if (d_lo < d_hi) return down;
  if (d_hi < d_lo) return up;
  return (down & 1u) ? up : down;
}

}  // namespace

TEST_CASE("bf16 round-trips all 65,536 bit patterns", "[bf16]") {
  int nans = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const tg::bf16 x = tg::bf16::from_bits(static_cast<std::uint16_t>(b));
    const float f = x;
    const tg::bf16 back(f);
    if (std::isnan(f)) {
      ++nans;
      REQUIRE(back.bits == 0x7fff);  // NaN stays NaN (CUDA's canonical quiet NaN)
    } else {
      REQUIRE(back.bits == b);
    }
  }
  CHECK(nans == 2 * 127);  // exponent all ones, mantissa non-zero, both signs
}

TEST_CASE("bf16 rounds to nearest even", "[bf16]") {
  CHECK(tg::bf16(1.0f + 0x1p-8f).bits == tg::bf16(1.0f).bits);              // tie, even is down
  CHECK(tg::bf16(1.0f + 3 * 0x1p-8f).bits == tg::bf16(1.0f + 0x1p-6f).bits);  // tie, even is up
  CHECK(tg::bf16(1.0f + 0x1p-8f + 0x1p-20f).bits == tg::bf16(1.0f + 0x1p-7f).bits);  // above the tie
  CHECK(tg::bf16(-0.0f).bits == 0x8000);
  CHECK(tg::bf16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  CHECK(tg::bf16(-std::numeric_limits<float>::infinity()).bits == 0xff80);
  CHECK(tg::bf16(std::numeric_limits<float>::max()).bits == 0x7f80);  // rounds up to infinity
  CHECK(tg::bf16(-std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  CHECK(tg::bf16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  CHECK(static_cast<float>(tg::bf16(3.140625f)) == 3.140625f);
}

TEST_CASE("bf16 agrees with a reference rounding on 2^24 random floats and every boundary", "[bf16]") {
  std::mt19937 gen(1234);
  for (int i = 0; i < (1 << 24); ++i) {
    const float f = float_of(static_cast<std::uint32_t>(gen()));
    const std::uint16_t want = reference_bf16(f);
    if (tg::bf16(f).bits != want) FAIL("float bits " << std::hex << bits_of(f) << ": got " << tg::bf16(f).bits << ", want " << want);
  }
  // Around every bf16 value: the value itself, one below and one above each midpoint.
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const std::uint32_t base = b << 16;
    for (std::uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const float f = float_of(base | low);
      if (tg::bf16(f).bits != reference_bf16(f)) FAIL("float bits " << std::hex << (base | low));
    }
  }
}

}  // namespace bf16_tests
