// Kernels behind the single-GPU world (runtime/cuda/device_world.h), where every rank of a plan
// lives on one device and collectives are computed from the members' buffers directly, and the
// numerics scans of the CUDA executor. Plain C++: no CUDA type crosses this header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/cuda_handles.h"

namespace trainsim::cuda {

enum class MemberReduce { sum, max };

// The most members one ring_reduce call takes (their pointers travel as a kernel argument).
inline constexpr int kMaxRingMembers = 64;

// out = the reduction of `inputs[0..n)` (n device buffers of `count` elements of dt), with the
// numerics of the in-process ring all-reduce (runtime/comm/in_process.h): the buffer is cut into
// n chunks (count/n elements, one more for the first count%n), and chunk c is reduced in the
// order of members c, c+1, ..., c-1 (mod n), every partial sum rounded to dt. When
// `divide_before`, each contribution is first multiplied by 1/n rounded to dt (and the product
// rounded); when `divide_after`, the final sum is divided by n and rounded. max propagates NaN.
// So every member that computes it gets the same bits, equal to what the CPU backend's ring gives
// for the same inputs. `out` may be one of the inputs only when n == 1.
void ring_reduce(void* out, const void* const* inputs, int n, std::size_t count, DType dt, MemberReduce op,
                 bool divide_before, bool divide_after, StreamHandle stream);

// *out = 1.0f when *flag != 0, else 0.0f: an overflow flag (kernels.h unscale_and_check) as the
// float the global max-reduction carries.
void flag_to_float(float* out, const int* flag, StreamHandle stream);

// Running numerics of tensors, accumulated on the device: the largest finite |x| (as float bits,
// so an integer atomicMax orders them) and the count of inf/NaN values. Zero it before use.
struct TensorScan {
  std::uint32_t max_abs_bits;
  std::uint32_t pad;
  unsigned long long nonfinite;
};
void scan_tensor(TensorScan* acc, const void* x, std::size_t n, DType dt, StreamHandle stream);
// The host view of max_abs_bits.
float scan_max_abs(const TensorScan& s);

}  // namespace trainsim::cuda
