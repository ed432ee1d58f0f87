// runtime/numerics/lowp.h against independent references: the compiler's _Float16 conversion
// (where it exists) and a rounding done in double arithmetic, exhaustively over every fp16
// value and the midpoints between neighbours, plus random floats; bf16 and tf32 against the
// nearer of the two truncation neighbours; the thresholds and subnormals that matter.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "runtime/numerics/lowp.h"

namespace trainsim::runtime {
namespace {

std::uint32_t bits(float x) { return std::bit_cast<std::uint32_t>(x); }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

// fp16 rounding done in double: the spacing of fp16 numbers at |x| is 2^(e-10) with e the
// exponent of |x| clamped below at -14 (subnormals); x / spacing is exact in double, so
// nearbyint (ties to even) rounds it exactly; magnitudes past 65504 after rounding overflow.
float reference_fp16(float x) {
  if (std::isnan(x) || std::isinf(x)) return x;
  const double d = x;
  if (d == 0) return x;
  const int e = std::max(std::ilogb(d), -14);
  const double spacing = std::ldexp(1.0, e - 10);
  const double r = std::nearbyint(d / spacing) * spacing;
  if (std::fabs(r) > 65504.0) return std::copysign(std::numeric_limits<float>::infinity(), d);
  return static_cast<float>(std::copysign(r, d));  // keeps -0
}

// Rounding that keeps the top (23 - drop) mantissa bits, from the two truncation neighbours
// compared in double (ties to the even one). The upper neighbour past the largest finite value
// is infinity, standing for 2^128 in the comparison, as IEEE's unbounded-exponent rule says.
float reference_mantissa(float x, int drop) {
  if (std::isnan(x) || std::isinf(x)) return x;
  const std::uint32_t u = bits(x);
  const std::uint32_t sign = u & 0x80000000u;
  const std::uint32_t lo = (u & 0x7fffffffu) & ~((1u << drop) - 1u);
  const std::uint32_t hi = lo + (1u << drop);
  const double a = std::fabs(static_cast<double>(x));
  const double vlo = from_bits(lo);
  const double vhi = hi >= 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(from_bits(hi));
  std::uint32_t pick;
  if (a - vlo < vhi - a)
    pick = lo;
  else if (a - vlo > vhi - a)
    pick = hi;
  else
    pick = ((lo >> drop) & 1u) == 0 ? lo : hi;
  if (pick >= 0x7f800000u) pick = 0x7f800000u;
  return from_bits(sign | pick);
}

bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits(a) == bits(b); }

// Every finite fp16 value, as floats, ascending from 0 (positive side).
std::vector<float> all_fp16_positive() {
  std::vector<float> v;
  for (std::uint32_t m = 0; m < (1u << 10); ++m) v.push_back(static_cast<float>(std::ldexp(m, -24)));  // subnormal
  for (int e = -14; e <= 15; ++e)
    for (std::uint32_t m = 0; m < (1u << 10); ++m) v.push_back(static_cast<float>(std::ldexp(1024 + m, e - 10)));
  return v;
}

TEST(LowpFp16, EveryValueIsKeptAndEveryMidpointTiesToEven) {
  const std::vector<float> vals = all_fp16_positive();
  ASSERT_EQ(vals.size(), 31u * 1024u);
  EXPECT_EQ(vals.back(), 65504.0f);
  for (std::size_t i = 0; i < vals.size(); ++i) {
    for (float s : {1.0f, -1.0f}) {
      const float x = s * vals[i];
      ASSERT_TRUE(same(round_to_fp16(x), x)) << x;
    }
    // The midpoint to the next value (for the last: to 65536, which does not exist) is exact in
    // float; it rounds to the neighbour whose fp16 mantissa is even.
    const double next = i + 1 < vals.size() ? vals[i + 1] : 65536.0;
    const float mid = static_cast<float>((vals[i] + next) / 2);
    ASSERT_EQ(static_cast<double>(mid), (vals[i] + next) / 2);
    const bool lower_even = (i % 2) == 0;  // consecutive fp16 bit patterns alternate parity
    const float want = lower_even ? vals[i] : (i + 1 < vals.size() ? vals[i + 1] : INFINITY);
    for (float s : {1.0f, -1.0f}) {
      ASSERT_TRUE(same(round_to_fp16(s * mid), s * want)) << "midpoint " << s * mid;
      ASSERT_TRUE(same(round_to_fp16(s * mid), reference_fp16(s * mid))) << s * mid;
      // One float step either side of the midpoint goes to the nearer neighbour.
      const float below = std::nextafter(s * mid, 0.0f), above = std::nextafter(s * mid, s * INFINITY);
      ASSERT_TRUE(same(round_to_fp16(below), s * vals[i])) << below;
      ASSERT_TRUE(same(round_to_fp16(above), reference_fp16(above))) << above;
      ASSERT_NE(round_to_fp16(above), s * vals[i]) << above;
    }
  }
}

TEST(LowpFp16, RandomFloatsMatchTheReferences) {
  std::mt19937 rng(12345);
  for (int i = 0; i < 2'000'000; ++i) {
    std::uint32_t u = rng();
    if (i % 2) u = (u & 0x807fffffu) | (static_cast<std::uint32_t>(100 + rng() % 60) << 23);  // near fp16's range
    const float x = from_bits(u);
    const float got = round_to_fp16(x);
    ASSERT_TRUE(same(got, reference_fp16(x))) << std::hexfloat << x;
#ifdef __FLT16_MAX__
    ASSERT_TRUE(same(got, static_cast<float>(static_cast<_Float16>(x)))) << std::hexfloat << x;
#endif
  }
}

#ifdef __FLT16_MAX__
TEST(LowpFp16, EveryFp16BitPatternMatchesTheCompiler) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const _Float16 f = std::bit_cast<_Float16>(static_cast<std::uint16_t>(h));
    const float x = static_cast<float>(f);
    ASSERT_TRUE(same(round_to_fp16(x), x)) << h;
    // Half-way and quarter-way to the next pattern's value.
    const _Float16 g = std::bit_cast<_Float16>(static_cast<std::uint16_t>(h + 1 < 65536 ? h + 1 : h));
    const float y = static_cast<float>(g);
    if (std::isfinite(x) && std::isfinite(y)) {
      for (double t : {0.25, 0.5, 0.75}) {
        const float z = static_cast<float>(x + t * (static_cast<double>(y) - x));
        ASSERT_TRUE(same(round_to_fp16(z), static_cast<float>(static_cast<_Float16>(z)))) << z;
      }
    }
  }
}
#endif

TEST(LowpFp16, OverflowAndSubnormalThresholds) {
  EXPECT_EQ(round_to_fp16(65504.0f), 65504.0f);
  EXPECT_EQ(round_to_fp16(65519.99f), 65504.0f);
  EXPECT_EQ(round_to_fp16(std::nextafter(65520.0f, 0.0f)), 65504.0f);
  EXPECT_EQ(round_to_fp16(65520.0f), INFINITY);
  EXPECT_EQ(round_to_fp16(-65520.0f), -INFINITY);
  EXPECT_EQ(round_to_fp16(1e10f), INFINITY);
  const float tiny = std::ldexp(1.0f, -24);  // smallest fp16 subnormal
  EXPECT_EQ(round_to_fp16(tiny), tiny);
  EXPECT_EQ(round_to_fp16(std::ldexp(1.0f, -25)), 0.0f);                        // tie: to 0 (even)
  EXPECT_EQ(round_to_fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), tiny);  // past the tie
  EXPECT_EQ(round_to_fp16(3 * std::ldexp(1.0f, -25)), std::ldexp(1.0f, -23));   // tie: to 2*2^-24 (even)
  EXPECT_EQ(round_to_fp16(5 * std::ldexp(1.0f, -25)), std::ldexp(1.0f, -23));   // tie: to 2*2^-24 (even)
  EXPECT_TRUE(std::signbit(round_to_fp16(-std::ldexp(1.0f, -30))));             // -0 keeps its sign
  EXPECT_EQ(round_to_fp16(std::ldexp(1.0f, -14)), std::ldexp(1.0f, -14));       // smallest normal
  EXPECT_TRUE(std::isnan(round_to_fp16(NAN)));
  EXPECT_TRUE(std::isnan(round_to_fp16(-NAN)));
  EXPECT_EQ(round_to_fp16(INFINITY), INFINITY);
  EXPECT_EQ(round_to_fp16(1.0f + std::ldexp(1.0f, -11)), 1.0f);  // tie at 1: to even
  EXPECT_EQ(round_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
}

TEST(LowpBf16Tf32, MatchTruncationNeighbourReference) {
  std::mt19937 rng(777);
  auto check = [&](float x) {
    ASSERT_TRUE(same(round_to_bf16(x), reference_mantissa(x, 16))) << std::hexfloat << x;
    ASSERT_TRUE(same(round_to_tf32(x), reference_mantissa(x, 13))) << std::hexfloat << x;
  };
  // Every bf16 upper half with low halves at, just around and away from the tie.
  for (std::uint32_t hi = 0; hi < 65536; ++hi)
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x1000u, 0x1001u, 0x0fffu})
      check(from_bits((hi << 16) | lo));
  for (int i = 0; i < 2'000'000; ++i) check(from_bits(rng()));
  EXPECT_EQ(round_to_bf16(std::numeric_limits<float>::max()), INFINITY);  // rounds up past the top
  EXPECT_EQ(round_to_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);            // tie to even
  EXPECT_EQ(round_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(round_to_bf16(NAN)));
  EXPECT_TRUE(std::isnan(round_to_tf32(NAN)));
  // A NaN whose payload sits only in the dropped bits must stay NaN, not become infinity.
  EXPECT_TRUE(std::isnan(round_to_bf16(from_bits(0x7f800001u))));
  EXPECT_TRUE(std::isnan(round_to_tf32(from_bits(0x7f800001u))));
}

TEST(Lowp, UnitRoundoffBoundsTheRelativeError) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  for (DType d : {DType::fp32, DType::tf32, DType::fp16, DType::bf16}) {
    const double u = unit_roundoff(d);
    double worst = 0;
    for (int i = 0; i < 200'000; ++i) {
      // Normal range of the format: fp16 2^-14 .. 2^15; the others: a wide slice of fp32's.
      const int e = d == DType::fp16 ? static_cast<int>(rng() % 30) - 14 : static_cast<int>(rng() % 200) - 100;
      const float x = static_cast<float>(std::ldexp(mant(rng), e)) * ((rng() & 1) ? 1.0f : -1.0f);
      const double r = round_to(d, x);
      if (!std::isfinite(r)) continue;  // fp16 past 65504
      const double rel = std::fabs(r - x) / std::fabs(static_cast<double>(x));
      ASSERT_LE(rel, u) << dtype_name(d) << " " << x;
      worst = std::max(worst, rel);
    }
    if (d != DType::fp32) {
      EXPECT_GT(worst, 0.9 * u) << dtype_name(d) << ": u is not the format's unit roundoff";
    }
  }
}

TEST(Lowp, RoundInplaceRoundsEveryElementAndCountsNonfinite) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3e4f);
  std::vector<float> xs(10000);
  for (float& x : xs) x = nd(rng);
  xs[17] = NAN;
  for (DType d : {DType::fp32, DType::tf32, DType::fp16, DType::bf16}) {
    std::vector<float> ys = xs;
    const std::int64_t bad = round_inplace(d, ys);
    std::int64_t want = 0;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const float r = round_to(d, xs[i]);
      ASSERT_TRUE(same(ys[i], r));
      want += !std::isfinite(r);
    }
    EXPECT_EQ(bad, want) << dtype_name(d);
    if (d == DType::fp16) {
      EXPECT_GT(bad, 1);  // some |x| > 65504 overflowed
    }
  }
  EXPECT_THROW(round_to(DType::fp8, 1.0f), std::invalid_argument);
}

}  // namespace
}  // namespace trainsim::runtime
