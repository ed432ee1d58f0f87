// Stream-ordered copies and fills for the CUDA stage model (runtime/cuda/stage_model_cuda.cpp).
// kernels/device_buffer.h's copy_to_device/copy_to_host/fill_zero run on the legacy default
// stream, which does not order with the non-blocking streams (kernels/device_buffer.h Stream)
// an engine runs ranks on; these take the stream. Plain C++: streams are kernels/cuda_handles.h's
// StreamHandle (cudaStream_t; nullptr is the legacy default stream). Every call that fails throws
// std::runtime_error saying what failed.
//
// Host memory may be ordinary (pageable) memory or a PinnedBuffer. CUDA's documented behaviour
// ("API synchronization behavior"): a copy from pageable host memory returns once the host bytes
// are staged (the caller may reuse its buffer at once); a copy to pageable host memory returns
// once the copy is done, i.e. the host waits for the stream inside CUDA. Copies to and from
// pinned memory are asynchronous: the host must not touch the bytes until the stream has reached
// the copy, and waits only where it chooses to (a mid-step wait over NCCL must be the
// communicator's polled synchronize, never a blocking copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda_handles.h"

namespace trainsim::runtime::cuda {

void copy_host_to_device(void* dst, const void* src, std::size_t bytes, StreamHandle stream);
void copy_device_to_host(void* dst, const void* src, std::size_t bytes, StreamHandle stream);
void copy_device_to_device(void* dst, const void* src, std::size_t bytes, StreamHandle stream);
void fill_zero(void* dst, std::size_t bytes, StreamHandle stream);
// Waits for the work queued on `stream`; reports an error a kernel on it raised.
void synchronize(StreamHandle stream);

// Writes the device's global nanosecond clock (%globaltimer) to *slot (device memory) when
// `stream` reaches this point. An event is timed only against events of its own context; this
// clock is the same in every context of the device (the green contexts a rank's streams run in).
void stamp_device_clock(std::uint64_t* slot, StreamHandle stream);

// Page-locked host memory (cudaMallocHost), freed with the object. Move-only.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(std::size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// One rank's pool for stream-ordered allocations (cudaMemPoolCreate on `device`): the
// activations and gradients in flight between ops, wire-format copies for an all-reduce. Its
// memory stays reserved between steps (release threshold: all of it), so a step's
// cudaMallocFromPoolAsync never goes back to the driver. used_high() is the allocator's own
// high-water mark of bytes handed out (cudaMemPoolAttrUsedMemHigh): a free counts once the
// stream it was queued on reaches it, so this is the peak on the device's timeline.
class MemoryPool {
 public:
  explicit MemoryPool(int device);
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // Throws std::runtime_error naming `what` and the size when the pool cannot grow.
  void* allocate(std::size_t bytes, StreamHandle stream, const std::string& what);
  void free(void* p, StreamHandle stream);
  std::size_t used_high() const;
  std::size_t reserved_high() const;  // cudaMemPoolAttrReservedMemHigh: what the pool took from the device
  void reset_high();                  // both marks down to what is in use (reserved) now

 private:
  PoolHandle pool_ = nullptr;
  std::size_t used_floor_ = 0, reserved_floor_ = 0;
};

}  // namespace trainsim::runtime::cuda
