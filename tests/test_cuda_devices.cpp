// The CUDA target: built wherever nvcc exists; device checks skip when no GPU is present.
#include <gtest/gtest.h>

#include "kernels/device_info.h"

namespace trainsim {
namespace {

TEST(Cuda, RuntimeAndNcclAreLinked) {
  // These need the libraries, not a device.
  const CudaInventory inv = query_cuda_devices();
  EXPECT_GT(inv.runtime_version, 0);
  EXPECT_GT(inv.nccl_version, 0);
}

TEST(Cuda, DevicesAreOnesWeBuildFor) {
  const CudaInventory inv = query_cuda_devices();
  if (inv.devices.empty()) GTEST_SKIP() << "no CUDA device: " << inv.error;
  for (const auto& d : inv.devices) {
    SCOPED_TRACE(d.name);
    EXPECT_GT(d.memory_gib, 1.0);
    EXPECT_GT(d.multiprocessors, 0);
    // Kernels are compiled for sm_80 and sm_90 (CMAKE_CUDA_ARCHITECTURES).
    EXPECT_GE(d.compute_capability_major * 10 + d.compute_capability_minor, 80);
  }
}

}  // namespace
}  // namespace trainsim
