#include "core/dtype.h"

#include <limits>

namespace trainsim {

std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::fp32: return "fp32";
    case DType::tf32: return "tf32";
    case DType::fp16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::fp8: return "fp8";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType d : kAllDTypes)
    if (dtype_name(d) == name) return d;
  return std::nullopt;
}

int dtype_bytes(DType d) {
  switch (d) {
    case DType::fp32:
    case DType::tf32: return 4;
    case DType::fp16:
    case DType::bf16: return 2;
    case DType::fp8: return 1;
  }
  return 4;
}

double dtype_max(DType d) {
  switch (d) {
    case DType::fp32:
    case DType::tf32: return std::numeric_limits<float>::max();
    case DType::fp16: return 65504.0;
    case DType::bf16: return 3.3895313892515355e38;
    case DType::fp8: return 448.0;  // E4M3, the format used for forward tensors
  }
  return 0;
}

double dtype_epsilon(DType d) {
  switch (d) {
    case DType::fp32: return 1.1920928955078125e-07;  // 2^-23
    case DType::tf32: return 9.765625e-04;            // 2^-10
    case DType::fp16: return 9.765625e-04;            // 2^-10
    case DType::bf16: return 7.8125e-03;              // 2^-7
    case DType::fp8: return 0.125;                    // E4M3: 2^-3
  }
  return 0;
}

}  // namespace trainsim
