#include "tests/bench/sm_holder.h"

#include <cuda_runtime.h>

#include "kernels/common.cuh"

namespace trainsim::cuda::bench {

namespace {

constexpr int kHolderThreads = 512;

// The dynamic shared memory is reserved at launch and never touched: it is what keeps the SM to
// this block.
__global__ void hold_and_copy_kernel(float4* dst, const float4* src, std::size_t n, int passes) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (int p = 0; p < passes; ++p)
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
      dst[i] = src[i];
}

}  // namespace

void hold_sms_copying(void* dst, const void* src, std::size_t bytes, int blocks, int passes, StreamHandle stream) {
  if (blocks <= 0 || passes <= 0 || bytes < sizeof(float4)) return;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  int most = 0;
  check_cuda(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  check_cuda(cudaFuncSetAttribute(hold_and_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most),
             "cudaFuncSetAttribute(hold_and_copy_kernel, MaxDynamicSharedMemorySize)");
  hold_and_copy_kernel<<<blocks, kHolderThreads, static_cast<std::size_t>(most), stream>>>(
      static_cast<float4*>(dst), static_cast<const float4*>(src), bytes / sizeof(float4), passes);
  detail::check_launch("hold_and_copy_kernel");
}

}  // namespace trainsim::cuda::bench
