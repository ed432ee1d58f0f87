// Typed handles for the CUDA objects that cross plain-C++ headers: a stream, an event and a memory
// pool are each their own pointer type, so one cannot be passed for another (or for a device
// buffer) without a compiler error. The structs are the CUDA runtime's own (cudaStream_t is
// `CUstream_st*`, cudaEvent_t `CUevent_st*`, cudaMemPool_t `CUmemPoolHandle_st*`), declared here
// and defined only by CUDA's headers, so these headers stay CUDA-free (STYLE.md habit 7) and the
// CUDA side passes them to the runtime API as they are.
#pragma once

struct CUstream_st;
struct CUevent_st;
struct CUmemPoolHandle_st;

namespace trainsim::cuda {

using StreamHandle = CUstream_st*;     // cudaStream_t; nullptr is the legacy default stream
using EventHandle = CUevent_st*;       // cudaEvent_t
using PoolHandle = CUmemPoolHandle_st*;  // cudaMemPool_t

}  // namespace trainsim::cuda

namespace trainsim::runtime {
using ::trainsim::cuda::EventHandle;
using ::trainsim::cuda::PoolHandle;
using ::trainsim::cuda::StreamHandle;
}  // namespace trainsim::runtime
