// The one check of a CUDA runtime call, for the CUDA side of the backend (.cu files and the .cpp
// files that include CUDA's headers): a call that fails throws std::runtime_error saying what
// failed and CUDA's name and words for the error,
//   "CUDA error in cudaMemcpyAsync device to host of 64 bytes: cudaErrorInvalidValue (invalid argument)".
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace trainsim::cuda {

inline std::string cuda_error_text(cudaError_t err, std::string_view what) {
  return "CUDA error in " + std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

inline void check_cuda(cudaError_t err, std::string_view what) {
  if (err != cudaSuccess) throw std::runtime_error(cuda_error_text(err, what));
}

}  // namespace trainsim::cuda
