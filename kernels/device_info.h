// What CUDA devices this process can see. Plain C++: no CUDA types cross this header.
#pragma once

#include <string>
#include <vector>

namespace trainsim {

struct CudaDevice {
  int index = 0;
  std::string name;
  double memory_gib = 0;
  int multiprocessors = 0;
  int compute_capability_major = 0, compute_capability_minor = 0;
};

struct CudaInventory {
  std::vector<CudaDevice> devices;
  int runtime_version = 0;  // e.g. 13000
  int nccl_version = 0;     // e.g. 22703
  std::string error;        // why no device is usable ("no CUDA-capable device is detected", ...)
};

CudaInventory query_cuda_devices();

}  // namespace trainsim
