// Device memory, streams and event timing for code compiled with plain g++ (tests, benchmarks,
// the CUDA backend's host side). No CUDA types cross this header: streams and events are the typed
// handles of kernels/cuda_handles.h. Every call that fails throws std::runtime_error saying what failed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda_handles.h"

namespace trainsim::cuda {

// True when a CUDA device can be used; otherwise false, with the reason in *why (when given):
// "no CUDA-capable device is detected", a driver/runtime mismatch, ... Never throws.
bool device_available(std::string* why = nullptr);

// Waits for all work on the device; reports errors raised by kernels since the last check.
void synchronize();

void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);
// cudaMemcpyAsync device to device on `stream`: the copy engine's bandwidth, the reference the
// memory-bound kernels are measured against (tests/bench/bench_kernels.cpp).
void copy_device_to_device(void* dst, const void* src, std::size_t bytes, StreamHandle stream);
void fill_zero(void* dst, std::size_t bytes);

// Device memory charged to one owner: the CUDA backend gives each rank one. While an
// AccountScope for it is active on a thread, every DeviceBuffer and cuBLAS workspace
// (gemm.h GemmContext) allocated on that thread is charged to it, at the cudaMalloc, and
// refunded at the cudaFree, whichever thread frees it. Thread-safe.
class MemoryAccount {
 public:
  void charge(std::size_t bytes);
  void refund(std::size_t bytes);
  std::size_t current() const { return current_.load(); }
  std::size_t peak() const { return peak_.load(); }  // since construction or reset_peak()
  void reset_peak() { peak_.store(current_.load()); }

 private:
  std::atomic<std::size_t> current_{0}, peak_{0};
};

// Makes `account` the one this thread's allocations are charged to, until destroyed (then the
// previous one again). nullptr: charge no one.
class AccountScope {
 public:
  explicit AccountScope(MemoryAccount* account);
  ~AccountScope();
  AccountScope(const AccountScope&) = delete;
  AccountScope& operator=(const AccountScope&) = delete;

 private:
  MemoryAccount* previous_;
};
MemoryAccount* current_account();  // this thread's, or nullptr

// An owned device allocation (cudaMalloc), freed on destruction, charged to the thread's
// current MemoryAccount (if any) while it lives. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const { return bytes_; }
  void upload(const void* src, std::size_t bytes);    // bytes <= this->bytes()
  void download(void* dst, std::size_t bytes) const;  // bytes <= this->bytes()

 private:
  void release();

  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  MemoryAccount* account_ = nullptr;
};

// A non-blocking CUDA stream, destroyed with the object. Move-only.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  StreamHandle get() const { return stream_; }
  void synchronize() const;

 private:
  StreamHandle stream_ = nullptr;
};

// GPU time between two points of a stream, measured with CUDA events.
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start(StreamHandle stream);
  void stop(StreamHandle stream);
  double elapsed_seconds() const;  // waits for the stop event

 private:
  EventHandle start_ = nullptr;
  EventHandle stop_ = nullptr;
};

// Holds streams until the host has opened the gate enough times, so that work several host
// threads enqueue at different moments starts on the device together. wait(stream, n, patience)
// enqueues a one-thread kernel that polls a counter in pinned, mapped host memory until open()
// has been called n times in all; open() adds one. A benchmark of several ranks' streams times a
// collective by its device time alone this way (runtime/cuda/device_comm_bench.cpp): each rank
// waits for call k's count, enqueues the call between its events, then opens; the call starts
// when the last rank has enqueued, not when the first one's host thread got there (the other
// threads' wake-ups and the transport's host-side meeting would otherwise be timed). A wait that
// outlasts `patience` lets its stream go on and sets timed_out(), so a rank that never opens
// cannot hang the device. Any thread may call open(); usable from every context of the device
// (the memory is portable).
class HostGate {
 public:
  HostGate();
  ~HostGate();
  HostGate(const HostGate&) = delete;
  HostGate& operator=(const HostGate&) = delete;
  void wait(StreamHandle stream, std::uint64_t opened, std::uint64_t patience_ns);
  void open();
  void release();  // opens it for good: every wait, enqueued or to come, returns (after a failure)
  std::uint64_t opened() const;
  bool timed_out() const;  // some wait gave up (its stream went on without the count)

 private:
  struct State;
  State* host_ = nullptr;    // pinned, mapped
  State* device_ = nullptr;  // the same memory as the device addresses it
};

// Makes `device`'s default pool (cudaMallocAsync without a pool) keep freed memory instead of
// returning it to the driver at every synchronisation (its release threshold is 0 by default),
// so that a stream-ordered allocation is a lookup, not a driver call (tens of microseconds, with
// the stream idle meanwhile). The single-GPU world stages every message there; the kernels that
// need scratch (embedding_backward, layernorm_backward_weight, bias_backward) take it there.
void keep_default_pool_memory(int device);

// The device's memory system, from cudaDeviceGetAttribute: peak bandwidth = 2 (double data rate)
// x memory clock x bus width. (cudaDeviceProp::memoryClockRate is gone in CUDA 13; the attribute
// cudaDevAttrMemoryClockRate remains.)
struct DeviceMemoryInfo {
  std::string name;
  int memory_clock_khz = 0;
  int bus_width_bits = 0;
  double peak_bandwidth_bytes_per_s = 0;
  int multiprocessors = 0;
};
DeviceMemoryInfo device_memory_info(int device = 0);

}  // namespace trainsim::cuda
