// In-place multiplication by a scalar: the NCCL communicator's Divide::after (a sum divided by
// the number of members, runtime/cuda/nccl_communicator.h). CPU reference: x = round_to(dt,
// x * factor) (runtime/numerics/lowp.h); tests: tests/cuda/test_nccl_communicator.cpp.
#include "kernels/common.cuh"
#include "kernels/kernels.h"

namespace trainsim::cuda {

using namespace detail;

namespace {

// One thread per pack (or element): one fp32 multiply, rounded once to T.
template <class T>
__global__ void scale_kernel(T* x, std::size_t n, float factor, bool packed) {
  map_elements(x, x, n, packed, [=](float v) { return v * factor; });
}

}  // namespace

void scale_inplace(void* x, std::size_t n, float factor, DType dt, StreamHandle stream) {
  const char* name = "scale_inplace";
  if (n == 0) return;
  require(x != nullptr, name, "x is null with n = " + std::to_string(n));
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const bool packed = aligned16(x);
    scale_kernel<S><<<packed_blocks(n, packed), kElementwiseThreads, 0, stream>>>(static_cast<S*>(x), n, factor, packed);
  });
  check_launch(name);
}

}  // namespace trainsim::cuda
