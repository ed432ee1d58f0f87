// Number formats that appear in a plan: compute precision, master weights, gradient
// accumulation and all-reduce.
#pragma once

#include <optional>
#include <string_view>

namespace trainsim {

enum class DType { fp32, tf32, fp16, bf16, fp8 };

inline constexpr DType kAllDTypes[] = {DType::fp32, DType::tf32, DType::fp16, DType::bf16, DType::fp8};

std::string_view dtype_name(DType d);
std::optional<DType> parse_dtype(std::string_view name);

// Bytes one element occupies in memory. tf32 is stored as fp32; fp8 tensors are 1 byte.
int dtype_bytes(DType d);

// Finite range and precision, used by the numerics warnings: largest finite value and
// machine epsilon (spacing of numbers just above 1.0).
double dtype_max(DType d);
double dtype_epsilon(DType d);

}  // namespace trainsim
