// Stream-ordered copies and fills (stream_ops.h): one CUDA runtime call each.
#include "runtime/cuda/stream_ops.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace trainsim::runtime::cuda {

namespace {

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess)
    throw std::runtime_error("CUDA error in " + what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                             ")");
}
std::string of(const char* what, std::size_t bytes) {
  return std::string(what) + " of " + std::to_string(bytes) + " bytes";
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

void copy_host_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(stream)),
        of("cudaMemcpyAsync host to device", bytes));
}

void copy_device_to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream)),
        of("cudaMemcpyAsync device to host", bytes));
}

void copy_device_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)),
        of("cudaMemcpyAsync device to device", bytes));
}

void fill_zero(void* dst, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemsetAsync(dst, 0, bytes, as_stream(stream)), of("cudaMemsetAsync", bytes));
}

void synchronize(void* stream) {
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize (an earlier kernel on the stream failed?)");
}

}  // namespace trainsim::runtime::cuda
