#include "kernels/device_buffer.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/common.cuh"

namespace trainsim::cuda {



bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = cudaGetErrorString(err);
    cudaGetLastError();  // clear it, so later calls start clean
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  return true;
}

void synchronize() { check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (an earlier kernel failed?)"); }

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy host to device");
}

void copy_device_to_device(void* dst, const void* src, std::size_t bytes, StreamHandle stream) {
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync device to device");
}

void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
}

void fill_zero(void* dst, std::size_t bytes) { check_cuda(cudaMemset(dst, 0, bytes), "cudaMemset"); }

void keep_default_pool_memory(int device) {
  cudaMemPool_t pool = nullptr;
  check_cuda(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool of device " + std::to_string(device));
  std::uint64_t keep_everything = UINT64_MAX;
  check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
             "cudaMemPoolSetAttribute(default pool's release threshold)");
}

// ---------------------------------------------------------------------------------------
// DeviceBuffer
// ---------------------------------------------------------------------------------------
namespace {
thread_local MemoryAccount* g_account = nullptr;
}  // namespace

void MemoryAccount::charge(std::size_t bytes) {
  const std::size_t now = current_.fetch_add(bytes) + bytes;
  std::size_t seen = peak_.load();
  while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
  }
}

void MemoryAccount::refund(std::size_t bytes) { current_.fetch_sub(bytes); }

AccountScope::AccountScope(MemoryAccount* account) : previous_(std::exchange(g_account, account)) {}
AccountScope::~AccountScope() { g_account = previous_; }
MemoryAccount* current_account() { return g_account; }

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  check_cuda(cudaMalloc(&ptr_, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
  account_ = g_account;
  if (account_) account_->charge(bytes);
}

void DeviceBuffer::release() {
  if (!ptr_) return;
  cudaFree(ptr_);
  if (account_) account_->refund(bytes_);
  ptr_ = nullptr;
  bytes_ = 0;
  account_ = nullptr;
}

DeviceBuffer::~DeviceBuffer() { release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      account_(std::exchange(other.account_, nullptr)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    account_ = std::exchange(other.account_, nullptr);
  }
  return *this;
}

void DeviceBuffer::upload(const void* src, std::size_t bytes) {
  if (bytes > bytes_)
    throw std::invalid_argument("DeviceBuffer::upload: " + std::to_string(bytes) + " bytes into a buffer of " +
                                std::to_string(bytes_));
  if (bytes) copy_to_device(ptr_, src, bytes);
}

void DeviceBuffer::download(void* dst, std::size_t bytes) const {
  if (bytes > bytes_)
    throw std::invalid_argument("DeviceBuffer::download: " + std::to_string(bytes) + " bytes from a buffer of " +
                                std::to_string(bytes_));
  if (bytes) copy_to_host(dst, ptr_, bytes);
}

// ---------------------------------------------------------------------------------------
// Stream
// ---------------------------------------------------------------------------------------
Stream::Stream() {
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  stream_ = s;
}

Stream::~Stream() {
  if (stream_) cudaStreamDestroy(stream_);
}

Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void Stream::synchronize() const {
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (a kernel failed?)");
}

// ---------------------------------------------------------------------------------------
// EventTimer
// ---------------------------------------------------------------------------------------
EventTimer::EventTimer() {
  cudaEvent_t a = nullptr, b = nullptr;
  check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  const cudaError_t err = cudaEventCreate(&b);
  if (err != cudaSuccess) {
    cudaEventDestroy(a);
    check_cuda(err, "cudaEventCreate");
  }
  start_ = a;
  stop_ = b;
}

EventTimer::~EventTimer() {
  cudaEventDestroy(start_);
  cudaEventDestroy(stop_);
}

void EventTimer::start(StreamHandle stream) {
  check_cuda(cudaEventRecord(start_, stream), "cudaEventRecord");
}

void EventTimer::stop(StreamHandle stream) {
  check_cuda(cudaEventRecord(stop_, stream), "cudaEventRecord");
}

double EventTimer::elapsed_seconds() const {
  check_cuda(cudaEventSynchronize(stop_), "cudaEventSynchronize (a kernel failed?)");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, start_, stop_),
             "cudaEventElapsedTime");
  return static_cast<double>(ms) * 1e-3;
}

// ---------------------------------------------------------------------------------------
// HostGate
// ---------------------------------------------------------------------------------------
struct HostGate::State {
  unsigned long long opened;
  int timed_out;
};

namespace {

__device__ __forceinline__ unsigned long long global_nanoseconds() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Polls the host's counter (volatile: every read goes to host memory) with a short sleep between
// reads, so the one thread costs the SM next to nothing while it holds its stream.
__global__ void host_gate_kernel(const unsigned long long* opened, int* timed_out, unsigned long long target,
                                 unsigned long long patience_ns) {
  const volatile unsigned long long* count = opened;
  const unsigned long long start = global_nanoseconds();
  while (*count < target) {
    if (global_nanoseconds() - start > patience_ns) {
      *static_cast<volatile int*>(timed_out) = 1;
      __threadfence_system();
      return;
    }
    __nanosleep(500);
  }
}

}  // namespace

HostGate::HostGate() {
  void* p = nullptr;
  check_cuda(cudaHostAlloc(&p, sizeof(State), cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc of a host gate (mapped, portable)");
  host_ = static_cast<State*>(p);
  host_->opened = 0;
  host_->timed_out = 0;
  void* d = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&d, p, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(p);
    check_cuda(err, "cudaHostGetDevicePointer of a host gate");
  }
  device_ = static_cast<State*>(d);
}

HostGate::~HostGate() { cudaFreeHost(host_); }

void HostGate::wait(StreamHandle stream, std::uint64_t opened, std::uint64_t patience_ns) {
  host_gate_kernel<<<1, 1, 0, stream>>>(&device_->opened, &device_->timed_out, opened, patience_ns);
  check_cuda(cudaGetLastError(), "host gate kernel launch");
}

void HostGate::open() {
  unsigned long long v = __atomic_load_n(&host_->opened, __ATOMIC_SEQ_CST);
  while (v != ~0ull && !__atomic_compare_exchange_n(&host_->opened, &v, v + 1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
}

void HostGate::release() { __atomic_store_n(&host_->opened, ~0ull, __ATOMIC_SEQ_CST); }

std::uint64_t HostGate::opened() const { return __atomic_load_n(&host_->opened, __ATOMIC_SEQ_CST); }

bool HostGate::timed_out() const { return __atomic_load_n(&host_->timed_out, __ATOMIC_SEQ_CST) != 0; }

// ---------------------------------------------------------------------------------------
// Device memory system
// ---------------------------------------------------------------------------------------
DeviceMemoryInfo device_memory_info(int device) {
  DeviceMemoryInfo info;
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  info.name = prop.name;
  info.multiprocessors = prop.multiProcessorCount;
  check_cuda(cudaDeviceGetAttribute(&info.memory_clock_khz, cudaDevAttrMemoryClockRate, device),
             "cudaDeviceGetAttribute(cudaDevAttrMemoryClockRate)");
  check_cuda(cudaDeviceGetAttribute(&info.bus_width_bits, cudaDevAttrGlobalMemoryBusWidth, device),
             "cudaDeviceGetAttribute(cudaDevAttrGlobalMemoryBusWidth)");
  info.peak_bandwidth_bytes_per_s = 2.0 * info.memory_clock_khz * 1e3 * (info.bus_width_bits / 8.0);
  return info;
}

}  // namespace trainsim::cuda
