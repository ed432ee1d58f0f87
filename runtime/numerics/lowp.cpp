#include "runtime/numerics/lowp.h"

#include <cmath>
#include <stdexcept>

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

}  // namespace trainsim::runtime
