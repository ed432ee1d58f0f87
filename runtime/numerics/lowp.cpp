#include "runtime/numerics/lowp.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace trainsim::runtime {

namespace {
template <float (*Round)(float)>
std::int64_t round_all(std::span<float> xs) {
  std::int64_t nonfinite = 0;
  for (float& x : xs) {
    x = Round(x);
    nonfinite += !std::isfinite(x);
  }
  return nonfinite;
}
float identity(float x) { return x; }
}  // namespace

float round_to(DType d, float x) {
  switch (d) {
    case DType::fp32: return x;
    case DType::tf32: return round_to_tf32(x);
    case DType::fp16: return round_to_fp16(x);
    case DType::bf16: return round_to_bf16(x);
    case DType::fp8: break;
  }
  throw std::invalid_argument("the runtime does not emulate fp8");
}

std::int64_t round_inplace(DType d, std::span<float> xs) {
  switch (d) {
    case DType::fp32: return round_all<identity>(xs);
    case DType::tf32: return round_all<round_to_tf32>(xs);
    case DType::fp16: return round_all<round_to_fp16>(xs);
    case DType::bf16: return round_all<round_to_bf16>(xs);
    case DType::fp8: break;
  }
  throw std::invalid_argument("the runtime does not emulate fp8");
}

double unit_roundoff(DType d) { return dtype_epsilon(d) / 2; }

// ---------------------------------------------------------------------------------------
// Rounding to a format, then numerics: the largest magnitude (inf counts, NaN does not) and how
// many values are inf or NaN. Both loops are written so the compiler vectorises them; fp16 uses
// the F16C conversion instructions where the CPU has them (IEEE round-to-nearest-even, the same
// values as round_to_fp16; tests/runtime/test_model.cpp checks the two agree).
// ---------------------------------------------------------------------------------------
Scan scan(const float* x, std::size_t n) {
  std::uint32_t max_bits = 0, bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = std::bit_cast<std::uint32_t>(x[i]) & 0x7fffffffu;
    bad += (a + 0x00800000u) >> 31;                     // a >= 0x7f800000: inf or NaN
    const std::uint32_t nan = (0x7f800000u - a) >> 31;  // a > 0x7f800000
    max_bits = std::max(max_bits, a & (nan - 1u));
  }
  return {std::bit_cast<float>(max_bits), bad};
}

namespace {

template <float (*Round)(float)>
void round_each(float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) x[i] = Round(x[i]);
}

void round_all_fp16(float* x, std::size_t n) {
  std::size_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) x[i] = round_to_fp16(x[i]);
}

void round_each(DType d, float* x, std::size_t n) {
  switch (d) {
    case DType::fp32:
      return;
    case DType::tf32:
      return round_each<round_to_tf32>(x, n);
    case DType::fp16:
      return round_all_fp16(x, n);
    case DType::bf16:
      return round_each<round_to_bf16>(x, n);
    case DType::fp8:
      break;
  }
  throw std::invalid_argument("the runtime does not emulate fp8");
}

}  // namespace

Scan round_and_scan(DType d, float* x, std::size_t n) {
  round_each(d, x, n);
  return scan(x, n);
}


}  // namespace trainsim::runtime
