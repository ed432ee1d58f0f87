#include <cstring>

#include "kernels/collective.h"
#include "kernels/common.cuh"

namespace trainsim::cuda {

using namespace detail;

namespace {

struct Members {
  const void* ptr[kMaxRingMembers];
};

// max that propagates NaN, as the in-process ring's max_nan.
__device__ __forceinline__ float max_nan(float a, float b) {
  if (isnan(a) || isnan(b)) return __int_as_float(0x7fc00000);
  return a < b ? b : a;
}

template <class S>
__global__ void ring_reduce_kernel(S* out, Members in, int n, std::size_t count, bool is_max, bool divide_before,
                                   bool divide_after) {
  const std::size_t base = count / static_cast<std::size_t>(n), extra = count % static_cast<std::size_t>(n);
  // 1/n as the CPU ring rounds it: in the wire format.
  const float inv = to_float(from_float<S>(1.0f / static_cast<float>(n)));
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    // The chunk of element i: the first `extra` chunks hold base + 1 elements.
    const std::size_t big = extra * (base + 1);
    const int c = static_cast<int>(i < big ? i / (base + 1) : extra + (i - big) / (base == 0 ? 1 : base));
    auto contribution = [&](int member) {
      const float x = to_float(static_cast<const S*>(in.ptr[member])[i]);
      return divide_before ? to_float(from_float<S>(x * inv)) : x;
    };
    float acc = contribution(c);
    for (int k = 1; k < n; ++k) {
      const float x = contribution((c + k) % n);
      acc = is_max ? max_nan(acc, x) : to_float(from_float<S>(acc + x));
    }
    if (divide_after) acc = to_float(from_float<S>(acc / static_cast<float>(n)));
    out[i] = from_float<S>(acc);
  }
}

__global__ void flag_to_float_kernel(float* out, const int* flag) { *out = *flag != 0 ? 1.0f : 0.0f; }

template <class S>
__global__ void scan_kernel(TensorScan* acc, const S* x, std::size_t n) {
  float local_max = 0;
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float v = to_float(x[i]);
    if (isfinite(v))
      local_max = fmaxf(local_max, fabsf(v));
    else
      ++bad;
  }
  __shared__ float smax[32];
  __shared__ unsigned long long sbad[32];
  local_max = block_max(local_max, smax);
  bad = block_sum(bad, sbad);
  if (threadIdx.x == 0) {
    // Non-negative floats order as their bit patterns do.
    atomicMax(&acc->max_abs_bits, __float_as_uint(local_max));
    if (bad) atomicAdd(&acc->nonfinite, bad);
  }
}

}  // namespace

void ring_reduce(void* out, const void* const* inputs, int n, std::size_t count, DType dt, MemberReduce op,
                 bool divide_before, bool divide_after, StreamHandle stream) {
  const char* name = "ring_reduce";
  require(n >= 1 && n <= kMaxRingMembers, name,
          "members must be 1.." + std::to_string(kMaxRingMembers) + ", got " + std::to_string(n));
  if (count == 0) return;
  Members m{};
  for (int k = 0; k < n; ++k) m.ptr[k] = inputs[k];
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    ring_reduce_kernel<S><<<elementwise_blocks(count), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), m, n, count, op == MemberReduce::max, divide_before, divide_after);
  });
  check_launch(name);
}

void flag_to_float(float* out, const int* flag, StreamHandle stream) {
  flag_to_float_kernel<<<1, 1, 0, stream>>>(out, flag);
  check_launch("flag_to_float");
}

void scan_tensor(TensorScan* acc, const void* x, std::size_t n, DType dt, StreamHandle stream) {
  const char* name = "scan_tensor";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    scan_kernel<S><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(acc, static_cast<const S*>(x), n);
  });
  check_launch(name);
}

float scan_max_abs(const TensorScan& s) {
  float f;
  std::memcpy(&f, &s.max_abs_bits, 4);
  return f;
}

}  // namespace trainsim::cuda
