// Stream-ordered copies and fills (stream_ops.h): one CUDA runtime call each.
#include "runtime/cuda/stream_ops.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
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

PinnedBuffer::PinnedBuffer(std::size_t bytes) : bytes_(bytes) {
  check(cudaMallocHost(&ptr_, std::max<std::size_t>(bytes, 1)), of("cudaMallocHost", bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_) cudaFreeHost(ptr_);
}

void synchronize(void* stream) {
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize (an earlier kernel on the stream failed?)");
}

namespace {
cudaMemPool_t as_pool(void* p) { return static_cast<cudaMemPool_t>(p); }
std::size_t pool_attribute(void* pool, cudaMemPoolAttr attr, const char* what) {
  std::uint64_t v = 0;
  check(cudaMemPoolGetAttribute(as_pool(pool), attr, &v), what);
  return static_cast<std::size_t>(v);
}
}  // namespace

void keep_default_pool_memory(int device) {
  cudaMemPool_t pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool of device " + std::to_string(device));
  std::uint64_t keep_everything = UINT64_MAX;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
        "cudaMemPoolSetAttribute(default pool's release threshold)");
}

MemoryPool::MemoryPool(int device) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  check(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate on device " + std::to_string(device));
  pool_ = pool;
  std::uint64_t keep_everything = UINT64_MAX;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
        "cudaMemPoolSetAttribute(release threshold)");
}

MemoryPool::~MemoryPool() {
  if (pool_) cudaMemPoolDestroy(as_pool(pool_));
}

void* MemoryPool::allocate(std::size_t bytes, void* stream, const std::string& what) {
  void* p = nullptr;
  check(cudaMallocFromPoolAsync(&p, bytes == 0 ? 1 : bytes, as_pool(pool_), as_stream(stream)),
        what + ": cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes");
  return p;
}

void MemoryPool::free(void* p, void* stream) {
  if (p) check(cudaFreeAsync(p, as_stream(stream)), "cudaFreeAsync");
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
  check(cudaMemPoolSetAttribute(as_pool(pool_), cudaMemPoolAttrUsedMemHigh, &zero), "reset the pool's used high mark");
  check(cudaMemPoolSetAttribute(as_pool(pool_), cudaMemPoolAttrReservedMemHigh, &zero),
        "reset the pool's reserved high mark");
}

}  // namespace trainsim::runtime::cuda
