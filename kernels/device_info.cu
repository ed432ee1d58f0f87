#include "kernels/device_info.h"

#include <cuda_runtime.h>
#include <nccl.h>

namespace trainsim {

CudaInventory query_cuda_devices() {
  CudaInventory inv;
  cudaRuntimeGetVersion(&inv.runtime_version);
  ncclGetVersion(&inv.nccl_version);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    inv.error = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return inv;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDevice d;
    d.index = i;
    d.name = prop.name;
    d.memory_gib = static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0);
    d.multiprocessors = prop.multiProcessorCount;
    d.compute_capability_major = prop.major;
    d.compute_capability_minor = prop.minor;
    inv.devices.push_back(d);
  }
  if (inv.devices.empty() && inv.error.empty()) inv.error = "no CUDA device";
  return inv;
}

}  // namespace trainsim
