// Stream-ordered copies and fills (stream_ops.h): one CUDA runtime call each.
#include "runtime/cuda/stream_ops.h"

#include <cuda_runtime.h>

#include "kernels/cuda_check.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace trainsim::runtime::cuda {

namespace {

using ::trainsim::cuda::check_cuda;
std::string of(const char* what, std::size_t bytes) {
  return std::string(what) + " of " + std::to_string(bytes) + " bytes";
}

__global__ void stamp_device_clock_kernel(std::uint64_t* slot) {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *slot = t;
}

}  // namespace

void stamp_device_clock(std::uint64_t* slot, StreamHandle stream) {
  stamp_device_clock_kernel<<<1, 1, 0, stream>>>(slot);
  check_cuda(cudaGetLastError(), "stamp_device_clock");
}

void copy_host_to_device(void* dst, const void* src, std::size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
        of("cudaMemcpyAsync host to device", bytes));
}

void copy_device_to_host(void* dst, const void* src, std::size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream),
        of("cudaMemcpyAsync device to host", bytes));
}

void copy_device_to_device(void* dst, const void* src, std::size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
        of("cudaMemcpyAsync device to device", bytes));
}

void fill_zero(void* dst, std::size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemsetAsync(dst, 0, bytes, stream), of("cudaMemsetAsync", bytes));
}

PinnedBuffer::PinnedBuffer(std::size_t bytes) : bytes_(bytes) {
  check_cuda(cudaMallocHost(&ptr_, std::max<std::size_t>(bytes, 1)), of("cudaMallocHost", bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_) cudaFreeHost(ptr_);
}

void synchronize(StreamHandle stream) {
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (an earlier kernel on the stream failed?)");
}

namespace {
std::size_t pool_attribute(PoolHandle pool, cudaMemPoolAttr attr, const char* what) {
  std::uint64_t v = 0;
  check_cuda(cudaMemPoolGetAttribute(pool, attr, &v), what);
  return static_cast<std::size_t>(v);
}
}  // namespace

MemoryPool::MemoryPool(int device) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  check_cuda(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate on device " + std::to_string(device));
  pool_ = pool;
  std::uint64_t keep_everything = UINT64_MAX;
  check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
        "cudaMemPoolSetAttribute(release threshold)");
}

MemoryPool::~MemoryPool() {
  if (pool_) cudaMemPoolDestroy(pool_);
}

void* MemoryPool::allocate(std::size_t bytes, StreamHandle stream, const std::string& what) {
  void* p = nullptr;
  check_cuda(cudaMallocFromPoolAsync(&p, bytes == 0 ? 1 : bytes, pool_, stream),
        what + ": cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes");
  return p;
}

void MemoryPool::free(void* p, StreamHandle stream) {
  if (p) check_cuda(cudaFreeAsync(p, stream), "cudaFreeAsync");
}

std::size_t MemoryPool::used_high() const {
  return std::max(used_floor_, pool_attribute(pool_, cudaMemPoolAttrUsedMemHigh, "cudaMemPoolGetAttribute(used high)"));
}

std::size_t MemoryPool::reserved_high() const {
  return std::max(reserved_floor_,
                  pool_attribute(pool_, cudaMemPoolAttrReservedMemHigh, "cudaMemPoolGetAttribute(reserved high)"));
}

void MemoryPool::reset_high() {
  // The runtime API resets a high-water mark only "to zero"; whether it then reads 0 or what is
  // in use until the next allocation is not said, so what is in use now is kept as its floor.
  used_floor_ = pool_attribute(pool_, cudaMemPoolAttrUsedMemCurrent, "cudaMemPoolGetAttribute(used)");
  reserved_floor_ = pool_attribute(pool_, cudaMemPoolAttrReservedMemCurrent, "cudaMemPoolGetAttribute(reserved)");
  std::uint64_t zero = 0;
  check_cuda(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero), "reset the pool's used high mark");
  check_cuda(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero),
        "reset the pool's reserved high mark");
}

}  // namespace trainsim::runtime::cuda
