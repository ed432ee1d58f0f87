// Stream-ordered copies and fills for the CUDA stage model (runtime/cuda/stage_model_cuda.cpp).
// kernels/device_buffer.h's copy_to_device/copy_to_host/fill_zero run on the legacy default
// stream, which does not order with the non-blocking streams (kernels/device_buffer.h Stream)
// an executor runs ranks on; these take the stream. Plain C++: streams are `void*`
// (cudaStream_t; nullptr is the legacy default stream). Every call that fails throws
// std::runtime_error saying what failed.
//
// Host memory here is ordinary (pageable) memory. CUDA's documented behaviour for it: a copy
// from pageable host memory returns once the host bytes are staged (the caller may reuse its
// buffer at once); a copy to pageable host memory returns once the copy is done. The callers
// synchronise the stream before reading a result on the host anyway.
#pragma once

#include <cstddef>

namespace trainsim::runtime::cuda {

void copy_host_to_device(void* dst, const void* src, std::size_t bytes, void* stream);
void copy_device_to_host(void* dst, const void* src, std::size_t bytes, void* stream);
void copy_device_to_device(void* dst, const void* src, std::size_t bytes, void* stream);
void fill_zero(void* dst, std::size_t bytes, void* stream);
// Waits for the work queued on `stream`; reports an error a kernel on it raised.
void synchronize(void* stream);

}  // namespace trainsim::runtime::cuda
