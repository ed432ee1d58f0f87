// The communicator interface of the CUDA backend: the same operations as communicator.h (send,
// recv, all-reduce sum and max, abort) in the terms a GPU works in. Two implementations:
//  * NCCL, one process per GPU (runtime/cuda/nccl_communicator.h);
//  * every rank of a plan sharing one GPU in one process, exchanging through device memory
//    (runtime/cuda/device_world.h).
// Plain C++: no CUDA type crosses this header (STYLE.md habit 7); streams are
// kernels/cuda_handles.h's typed handles, buffers are device pointers.
//
// Contract (where it differs from communicator.h, it says so):
//  * Calls are stream-ordered. Each one is queued on `stream` and returns to the host without
//    waiting for the device: the data must be ready in stream order when the operation runs,
//    and the result is ready in stream order after it. The host never learns that an operation
//    finished except by synchronising the stream or an event recorded after it.
//  * Buffers hold `count` elements of `dt` (fp32, fp16 or bf16). all_reduce reduces in `dt`: the
//    caller casts to the wire format first (precision.allreduce), as NCCL reduces in the
//    buffer's type. Divide::before scales each contribution by 1/n (rounded to dt) before the
//    sum; Divide::after divides the sum by n. ReduceOp::max is used for the global overflow
//    check, whose flags are 0 or 1 (NCCL's max does not promise to propagate NaN).
//  * send/recv pair by ORDER between two ranks, as NCCL pairs them: the k-th send from A to B
//    meets the k-th recv at B from A, and their counts and formats must agree. `tag` names the
//    message in errors (and the single-GPU world checks it matches); it does not reorder.
//    The executor relies on the schedule property that sends from A to B and receives at B
//    from A come in the same order (tests/runtime/test_p2p_order.cpp checks every schedule).
//  * send may complete before the receiver posts its recv (single-GPU world: buffered) or
//    not (NCCL: it waits on the device for the receiver). Callers must not rely on either:
//    put sends on a stream whose progress nothing else on the sender waits for, or inside a
//    group with the matching recvs.
//  * group_begin/group_end bracket point-to-point calls that must progress together (NCCL's
//    ncclGroupStart/End); outside a group each call stands alone.
//  * all_reduce is a collective over `members` (ascending, containing this rank); every member
//    calls it with the same members, count, dt, op and divide, in the same order as every
//    other collective over overlapping members.
//  * A call that cannot complete (a peer failed, a timeout) throws CommError naming this rank,
//    the op and the peer; wrong arguments throw std::invalid_argument before anything is queued.
//  * abort(reason) makes every pending and future host-side call of every rank throw
//    CommError(reason) and, for NCCL, aborts the communicators so device work stops waiting.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda_handles.h"
#include "runtime/comm/communicator.h"  // ReduceOp, Divide, CommError

namespace trainsim::runtime {

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "single-gpu world (8 ranks on one device)", "nccl 2.28.3" ...: what ran, for the output.
  virtual std::string describe() const = 0;

  virtual void send(int peer, std::uint64_t tag, const void* data, std::size_t count, DType dt, StreamHandle stream) = 0;
  virtual void recv(int peer, std::uint64_t tag, void* data, std::size_t count, DType dt, StreamHandle stream) = 0;
  virtual void group_begin() = 0;
  virtual void group_end() = 0;

  virtual void all_reduce(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag,
                          ReduceOp op, Divide divide, StreamHandle stream) = 0;

  // Every rank passes a host blob and gets every rank's, indexed by rank (the executor gathers
  // each step's timings and numerics this way). Blocking on the host; every rank of the world
  // calls it, in the same order relative to its other calls of gather_host.
  virtual std::vector<std::vector<std::uint8_t>> gather_host(std::span<const std::uint8_t> mine) = 0;

  virtual void abort(const std::string& reason) = 0;
};

}  // namespace trainsim::runtime
