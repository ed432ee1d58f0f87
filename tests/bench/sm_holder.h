// A stand-in for a collective's kernel running beside the matrix products, for
// BM_GemmBesideHeldSms (tests/bench/bench_kernels.cpp): NCCL runs each channel of a collective as
// one thread block that holds its SM for the collective's whole duration and moves the data through
// HBM. hold_sms_copying launches `blocks` such blocks, each asking for the most shared memory a
// block may have (so that no block of another kernel fits on its SM beside it), copying `bytes` from
// `src` to `dst` `passes` times between them. Plain C++ header (no CUDA types).
#pragma once

#include <cstddef>

#include "kernels/cuda_handles.h"

namespace trainsim::cuda::bench {

void hold_sms_copying(void* dst, const void* src, std::size_t bytes, int blocks, int passes, StreamHandle stream);

}  // namespace trainsim::cuda::bench
