// Low-precision formats emulated on the CPU. Tensors stay `float` in memory, but every value
// a format would hold is rounded to that format first, so a float array "in fp16" holds only
// values an fp16 array could hold: round-to-nearest-even, overflow to ±inf, NaN kept, and
// subnormals as the format has them (fp16: down to 2^-24; bf16 and tf32: fp32's range).
// Matrix products then take these rounded inputs and accumulate in fp32, as tensor cores do.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "core/dtype.h"

namespace trainsim::runtime {

namespace lowp_detail {
inline std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_of(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
// Keeps the top (23 - drop) mantissa bits, rounding to nearest even. A carry out of the
// mantissa moves into the exponent, and out of the largest exponent into infinity.
inline float round_mantissa(float x, int drop) {
  const std::uint32_t u = bits_of(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf or NaN
  const std::uint32_t half = (1u << (drop - 1)) - 1u;
  const std::uint32_t lsb = (u >> drop) & 1u;
  return float_of((u + half + lsb) & ~((1u << drop) - 1u));
}
}  // namespace lowp_detail

// IEEE binary16: 5 exponent bits, 10 mantissa bits, largest finite 65504.
inline float round_to_fp16(float x) {
  using namespace lowp_detail;
  const std::uint32_t u = bits_of(x);
  const std::uint32_t sign = u & 0x80000000u, mag = u & 0x7fffffffu;
  if (mag >= 0x7f800000u) return x;                         // inf, NaN
  if (mag >= 0x477ff000u) return float_of(sign | 0x7f800000u);  // >= 65520 rounds past 65504
  if (mag < 0x38800000u) {
    // Below fp16's smallest normal (2^-14) the spacing is a fixed 2^-24: round the multiple
    // of 2^-24 in double (exact), whose default rounding mode is to nearest even.
    const double q = static_cast<double>(float_of(mag)) * 16777216.0;  // 2^24
    const double r = __builtin_nearbyint(q) / 16777216.0;
    return float_of(sign | bits_of(static_cast<float>(r)));
  }
  return round_mantissa(x, 13);
}

// bfloat16: fp32's exponent, 7 mantissa bits.
inline float round_to_bf16(float x) { return lowp_detail::round_mantissa(x, 16); }
// TF32 as tensor cores read it: fp32's exponent, 10 mantissa bits.
inline float round_to_tf32(float x) { return lowp_detail::round_mantissa(x, 13); }

// The value format `d` stores for x. fp32 returns x; fp8 is not emulated (throws).
float round_to(DType d, float x);
// Rounds every element in place; returns how many are inf or NaN afterwards.
std::int64_t round_inplace(DType d, std::span<float> xs);
// The unit roundoff u (half the spacing of numbers just above 1.0) of the format:
// |round(x) - x| <= u·|x| for x in the normal range.
double unit_roundoff(DType d);

// What a pass over a tensor saw: the largest magnitude (inf counts, NaN does not) and how many
// values are inf or NaN.
struct Scan {
  float max_abs = 0;
  std::int64_t nonfinite = 0;
};
Scan scan(const float* x, std::size_t n);
// Rounds n values in place to `d` (fp32: unchanged), then scans them: the one pass every
// tensor a layer produces goes through (runtime/model/stage_model.cpp).
Scan round_and_scan(DType d, float* x, std::size_t n);

}  // namespace trainsim::runtime
