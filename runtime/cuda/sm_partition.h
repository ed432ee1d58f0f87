// Per-rank streams for the single-GPU multi-rank mode: every rank of a plan in one process on one
// device. Each rank gets its own compute, communication and send streams; where the driver offers
// green contexts (CUDA 12.4+ driver API, looked up at run time: the binary does not link libcuda,
// so it starts on machines with no driver) the device's SMs are split into disjoint equal groups,
// one per rank, and each rank's streams belong to a green context on its group, so concurrent
// ranks do not take each other's SMs.
//
// Plain C++: no CUDA types cross this header (streams are kernels/cuda_handles.h's), and the SM
// arithmetic below is header-only so it is tested without a GPU (tests/runtime/test_sm_split.cpp).
#pragma once

#include <algorithm>
#include <memory>
#include <string>

#include "kernels/cuda_handles.h"
#include "runtime/contract.h"
#include "runtime/engine/rank_threads.h"

namespace trainsim::runtime::cuda {

// ---------------------------------------------------------------------------------------
// SM arithmetic (pure)
// ---------------------------------------------------------------------------------------

// The SMs each of `ranks` equal partitions gets out of `total_sms`: the largest multiple of
// `alignment` that is at least `min_partition` and fits `ranks` times. 0 when no such count
// exists (too many ranks for the device) or when total_sms or ranks is not positive.
// alignment <= 0 means 1; min_partition <= 0 means one alignment unit.
// Examples: (132, 8, 8, 8) -> 16 (128 used, 4 left over); (132, 9, 8, 8) -> 8; (132, 17, 8, 8) -> 0.
inline int sms_per_rank(int total_sms, int ranks, int min_partition, int alignment) {
  if (total_sms <= 0 || ranks <= 0) return 0;
  const int align = std::max(alignment, 1);
  const int smallest = (std::max(min_partition, 1) + align - 1) / align * align;
  const int fair_share = total_sms / ranks / align * align;  // == floor(total / (ranks * align)) * align
  return fair_share >= smallest ? fair_share : 0;
}

// Minimum partition size and alignment, in SMs, of an SM split.
struct SmGranularity {
  int min_partition = 0;
  int alignment = 0;
};

// The CUDA driver documentation's guideline per compute architecture ("Green Contexts"), used
// when the driver's CUdevSmResource leaves minSmPartitionSize / smCoscheduledAlignment zero
// (drivers older than CUDA 13). {0, 0} below compute capability 6.0, for which none is given.
inline SmGranularity sm_granularity_guideline(int compute_major) {
  if (compute_major >= 9) return {8, 8};
  if (compute_major == 8) return {4, 2};
  if (compute_major >= 6) return {2, 2};
  return {0, 0};
}

// ---------------------------------------------------------------------------------------
// Streams and partitions on the device
// ---------------------------------------------------------------------------------------

// SmSharing: runtime/contract.h (a placement option).

// One rank's streams (cudaStream_t, all non-blocking) and the SMs its kernels may run on: its
// partition under green contexts, the whole device when shared. `compute` and `send` are driven
// by the rank's compute thread, `comm` by its communication thread (RankThread).
struct RankStreams {
  StreamHandle compute = nullptr;
  StreamHandle comm = nullptr;
  StreamHandle send = nullptr;
  int sms = 0;
};

// RankThread: runtime/engine/rank_threads.h.

// Streams for `ranks` ranks on one device, created by the constructor and destroyed with the
// object. Move-only.
//
// The constructor makes `device` current on the calling thread and creates its primary context
// (green contexts share its memory: allocations made with cudaMalloc are used from any rank's
// streams). Work launched outside these streams (the legacy default stream, other primary-context
// streams) still runs on any SM, the left-over ones included.
//
// A green context "can be current to only one thread at a time", and the driver does not
// synchronise API calls that reach one green context from several threads (CUDA Driver API,
// cuGreenCtxCreate). A rank is driven by two threads at once, so under green contexts each rank
// gets two, on the same SMs: one for its compute thread, holding the compute and send streams,
// and one for its communication thread, holding the comm stream. An event must be created in the
// context of the stream it is recorded on (cuEventRecord); a stream may wait on an event of any
// context (cuStreamWaitEvent).
//
class SmPartition {
 public:
  SmPartition(int ranks, SmSharing sharing, int device = 0);
  ~SmPartition();
  SmPartition(SmPartition&& other) noexcept;
  SmPartition& operator=(SmPartition&& other) noexcept;
  SmPartition(const SmPartition&) = delete;
  SmPartition& operator=(const SmPartition&) = delete;

  int ranks() const;
  const RankStreams& streams(int rank) const;  // throws std::out_of_range outside [0, ranks)
  bool green() const;                          // true when the ranks run in green contexts
  // Makes the context of `rank`'s `thread` current on the calling thread: its green context (so
  // events, cuBLAS handles and allocations made next belong to the context its streams run in),
  // or the device's primary context when shared. Every thread that works for a rank calls it
  // first, and one thread at a time works in each of a rank's two contexts.
  void make_current(int rank, RankThread thread = RankThread::compute) const;
  // Makes the device's primary context current on the calling thread (a thread that hands a
  // rank's context over to the rank's own threads calls it first).
  void make_primary_current() const;
  int device_sms() const;                      // the device's SM count
  // Why green contexts are not used ("not requested", "one rank: nothing to split", the driver
  // lacks cuGreenCtxCreate, ...); empty when they are.
  const std::string& why_not_green() const;
  // One line for run reports, e.g.
  //   "green contexts: 8 ranks x 16 SMs (4 SMs left over) of 132 on NVIDIA H100 80GB HBM3 (device 0)"
  //   "shared SMs: 8 ranks on all 132 SMs of NVIDIA H100 80GB HBM3 (device 0) (green contexts: not requested)"
  std::string describe() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace trainsim::runtime::cuda
