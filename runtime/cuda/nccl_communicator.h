// The NCCL implementation of DeviceCommunicator (runtime/comm/device_communicator.h): one
// process per GPU, ranks found through the launcher's variables (runtime/launch/launch_env.h),
// rank 0's ncclUniqueId handed out over TCP (runtime/launch/rendezvous.h). Plain C++: no CUDA or
// NCCL type crosses this header; streams are `void*` (cudaStream_t).
//
// Communicators. One world communicator (ncclCommInitRank over every rank), used for
// send/recv, gather_host and all-reduces over the whole world; and one sub-communicator per
// distinct member set given to create(), split from the world (ncclCommSplit, key = rank, so a
// member's rank in it is its position in `members`). A set of one rank needs none: an all-reduce
// over oneself is the identity and returns at once. Splits are collectives over the world: every
// rank must pass the same list in the same order. Member sets that share no rank are split
// together in one call (first-fit, in list order), so data-parallel groups of all stages cost one
// split, not one per stage.
//
// Numerics (device_communicator.h's contract): all_reduce reduces in the buffer's type, as NCCL
// does. Divide::before is NCCL's PreMulSum with the scalar 1/n rounded to that type (each
// contribution is multiplied by it, one rounding, before the sum); Divide::after sums, then
// multiplies by 1/n in fp32 and rounds once to the type (kernels.h scale_inplace). For n a power
// of two that is exactly the in-process communicator's division by n; otherwise x * fl(1/n) and
// x / n may differ by one unit in the last place of fp32 before the rounding to the type.
//
// Groups. Between group_begin and group_end NCCL only records the calls and launches them at
// group_end, so work this class adds after a reduction (Divide::after's scaling, destroying a
// PreMulSum operator) is deferred to the outermost group_end, where it is queued after the group.
//
// Failures. Every NCCL and CUDA call is checked; a failure throws CommError
//   "rank R: <op> (<peer or members, count and type>): <ncclGetErrorString> (<ncclGetLastError>)".
// A failure that leaves NCCL unusable (anything but an invalid argument or usage) also aborts
// this rank's communicators, as abort() does. abort(reason) records the reason, calls
// ncclCommAbort on every communicator once (from any thread, e.g. the watchdog's), and makes
// every later call, and every host wait in progress, throw CommError(reason). The peers learn of
// it through their own calls failing (ncclCommGetAsyncError, polled while waiting) or, where the
// transport reports nothing (a peer's GPU kernel simply waits), through their watchdog.
//
// gather_host runs on the world communicator, whose operations execute in the order this rank
// issued them: call it when no send, recv or world all-reduce of this rank is still pending (after
// the step's streams are synchronised), or at the same place in the sequence on every rank.
//
// Waiting. The host waits for the device by polling, never inside a CUDA synchronisation:
// synchronize() and gather_host poll cudaStreamQuery, the communicators' asynchronous errors and the aborted flag, under a
// watchdog guard (watchdog(): `timeout` from create()). When the watchdog fires, its handler
// calls abort() with the watchdog's message ("rank R: <op> has not completed after T s ..."), and
// the wait throws that. Construction (init and splits) is guarded too; NCCL's blocking
// ncclCommInitRank cannot be interrupted before it returns a handle, but every later step can.
//
// Threads. One thread issues the communication calls of a rank (NCCL communicators are not
// thread-safe); abort() and watchdog() may be used from any thread. Each call makes the
// communicator's GPU current on the calling thread (cudaSetDevice), so the issuing thread need
// not be the one that created it.
//
// Destruction. Normally ncclCommDestroy on every communicator (NCCL documents it as a collective
// among the ranks of one node: every process destroys its communicator at the end of a run).
// After abort(), while an exception unwinds the stack, or with a group left open, the
// communicators are aborted instead (local, never waits for a peer).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "runtime/comm/device_communicator.h"
#include "runtime/launch/launch_env.h"
#include "runtime/launch/watchdog.h"

namespace trainsim::runtime::cuda {

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // Rank 0 makes the unique id, broadcast_from_rank0 hands it to every rank (within `timeout`),
  // then init_from_id below with device env.local_rank % (visible GPUs). `groups` are the
  // distinct all-reduce member sets the caller will use (each strictly ascending ranks of the
  // world; the whole world and repeats are allowed and cost nothing), identical on every rank.
  // Throws std::invalid_argument for a bad env, group or timeout before any network or device
  // activity; RendezvousError when the id cannot be shared; CommError when CUDA or NCCL fails.
  static std::unique_ptr<NcclCommunicator> create(const LaunchEnv& env, const std::vector<std::vector<int>>& groups,
                                                  std::chrono::milliseconds timeout);

  // The same from a unique id shared some other way (tests, or a launcher that has its own
  // broadcast): `unique_id` is make_unique_id()'s bytes from one process, the same on every rank.
  // NCCL's id also names the bootstrap root, which lives in the process that made it: keep that
  // process alive until every rank is constructed.
  static std::unique_ptr<NcclCommunicator> init_from_id(std::span<const std::uint8_t> unique_id, int rank,
                                                        int world_size, int device,
                                                        const std::vector<std::vector<int>>& groups,
                                                        std::chrono::milliseconds timeout);
  static std::vector<std::uint8_t> make_unique_id();  // ncclGetUniqueId; CommError on failure

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int world_size() const override;
  // "NCCL 2.28.9, rank 3 of 8, GPU 3 (NVIDIA H100 80GB HBM3)"
  std::string describe() const override;
  int device() const;  // the CUDA device index this rank uses

  void send(int peer, std::uint64_t tag, const void* data, std::size_t count, DType dt, void* stream) override;
  void recv(int peer, std::uint64_t tag, void* data, std::size_t count, DType dt, void* stream) override;
  void group_begin() override;
  void group_end() override;
  void all_reduce(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag, ReduceOp op,
                  Divide divide, void* stream) override;
  std::vector<std::vector<std::uint8_t>> gather_host(std::span<const std::uint8_t> mine) override;
  void abort(const std::string& reason) override;

  // Waits on the host until the work queued on `stream` so far has run, without blocking in
  // CUDA: polls the stream, the communicators' asynchronous errors and the aborted flag under
  // a watchdog guard named `what`. Throws CommError when the stream reports an error, a
  // communicator has failed, the watchdog fired, or abort() was called.
  void synchronize(void* stream, const std::string& what);
  // Guards the caller's own host waits (guard(...)); on timeout it aborts this communicator.
  Watchdog& watchdog();
  bool aborted() const;

 private:
  struct Impl;
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainsim::runtime::cuda
