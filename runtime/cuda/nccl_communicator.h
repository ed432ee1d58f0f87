// The NCCL implementation of DeviceCommunicator (runtime/comm/device_communicator.h): one
// process per GPU, ranks found through the launcher's variables (runtime/launch/launch_env.h),
// rank 0's ncclUniqueId handed out over TCP (runtime/launch/rendezvous.h). Plain C++: no CUDA or
// NCCL type crosses this header; streams are kernels/cuda_handles.h's typed handles.
//
// Communicators. One world communicator (ncclCommInitRankConfig over every rank), used for
// gather_host, all-reduces over the whole world and sends/receives on links given none; one
// sub-communicator per distinct all-reduce member set given to create(); and one per directed
// link (from, to) given to create(), which carries the sends from `from` to `to` and nothing
// else. Sub- and link communicators are split from the world (ncclCommSplit, key = rank, so a
// member's rank in one is its position in the ascending member list). A set of one rank needs
// none: an all-reduce over oneself is the identity and returns at once. Splits are collectives
// over the world: every rank must pass the same lists in the same order. Sets that share no rank
// are split together in one call (first-fit, in list order), so data-parallel groups of all
// stages cost one split, not one per stage, and a pipeline's links about four.
//
// Why a communicator per direction. NCCL runs the operations of one communicator in the order
// the host issued them, whatever their streams, and a send larger than NCCL's buffers completes
// only once the peer's receive runs. One-forward-one-backward issues, on stage 0, "send
// activation 1" before "receive gradient 0", and on stage 1 "send gradient 0" before "receive
// activation 1": over one communicator per pair both sends wait for receives queued behind the
// other's send, a deadlock, unless every exchange is grouped. With one communicator per
// direction each carries sends of one rank to one peer, paired in the order the peer receives
// them (tests/runtime/test_p2p_order.cpp), and the step completes for every schedule
// (tests/runtime/test_stream_deadlock.cpp models the streams and proves it).
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
// Nonblocking communicators. Every communicator is created nonblocking (ncclConfig_t with
// blocking = 0; splits get the same config), as NCCL's fault-tolerance model requires for an
// abort that may come at any point: init, splits, enqueues (ncclAllReduce, ncclSend, ...) and
// ncclGroupEnd return at once, with ncclSuccess or ncclInProgress, and finish in NCCL's own
// threads. After a call that returns ncclInProgress (outside a group), and after every init and
// split, the calling thread polls ncclCommGetAsyncError until the state leaves ncclInProgress
// (runtime/cuda/nccl_progress.h: wait_until_settled), before the next call on that communicator
// and before queueing more work on the stream; an error state fails the call, an abort (the
// watchdog's timeout included) stops the wait. A split is polled on the world (its parent).
// NCCL_COMM_BLOCKING=1 in the environment overrides the config and makes calls block again;
// then an abort waits for the blocked call to return. The price: NCCL launches a nonblocking
// call's (or group's) kernels from a thread it starts for it, and the caller polls until they
// are issued, so each call outside a group costs a thread start more than a blocking one.
//
// Failures. Every NCCL and CUDA call is checked; a failure throws CommError
//   "rank R: <op> (<peer or members, count and type>): <ncclGetErrorString> (<ncclGetLastError>)",
// and a communicator that enters an error state while a call waits for it
//   "rank R: <op>: <the communicator> failed: <ncclGetErrorString> (<ncclGetLastError>)".
// A failure that leaves NCCL unusable (anything but an invalid argument or usage) also aborts
// this rank's communicators, as abort() does. abort(reason) records the reason (the first one
// wins), sets the aborted flag, then takes each communicator's lock in turn and calls
// ncclCommAbort on it once (from any thread, e.g. the watchdog's), and makes every later call,
// and every host wait in progress, throw CommError(reason). The peers learn of it through their
// own calls failing (ncclCommGetAsyncError, polled while waiting) or, where the transport reports
// nothing (a peer's GPU kernel simply waits), through their watchdog.
//
// gather_host runs on the world communicator, whose operations execute in the order this rank
// issued them: call it when no send, recv or world all-reduce of this rank is still pending (after
// the step's streams are synchronised), or at the same place in the sequence on every rank.
//
// Waiting. The host waits for the device by polling, never inside a CUDA synchronisation:
// synchronize() and gather_host poll cudaStreamQuery, the communicators' asynchronous errors and
// the aborted flag, under a watchdog guard (watchdog(): `timeout` from create()). When the
// watchdog fires, its handler calls abort() with the watchdog's message ("rank R: <op> has not
// completed after T s ..."), and the wait throws that. Construction (init and splits) and the
// waits for ncclInProgress are guarded too; with nonblocking communicators an abort interrupts
// them at any point, init included.
//
// Threads. Each communicator has a lock, held around every NCCL call that touches it: enqueues,
// ncclRedOpCreatePreMulSum/Destroy, ncclCommGetAsyncError and ncclGetLastError (a wait on one
// thread polls every communicator, including those another thread drives), ncclGroupEnd (the
// locks of all the group's communicators, in one global order) and ncclCommAbort. NCCL allows
// one thread at a time per communicator and forbids any NCCL call on a communicator while it is
// aborted; the lock enforces both, and since calls do not block, abort() waits at most for a
// call in progress to return. Waits for ncclInProgress release the lock between polls, so an
// abort gets in. A communicator recorded in a thread's open group (group_begin, no group_end
// yet) is in NCCL's per-thread group state: abort() from another thread defers its
// ncclCommAbort to that thread's group_end, which always closes the group (even after an abort)
// and then aborts it; a group never closed leaves its communicators to the process's exit.
// An abort on the thread of an open group (a call inside it failed) runs its ncclCommAborts on
// a short-lived thread of its own, which it joins, since NCCL would queue them into the open
// group. ncclGroupStart opens only the calling thread's group and takes no lock.
//
// Beyond the lock, the caller's rules remain: a communicator takes its calls (and a group all of
// its calls) from one thread in the order the peers expect; different communicators may be driven
// from different threads. The CUDA executor issues sends and receives (link communicators) from a
// rank's compute thread and all-reduces (member-set communicators; the world's) from its
// communication thread, and the world's gradient-norm all-reduce only after that thread has issued
// all of its calls. NCCL documents concurrent communicators as safe while their kernels fit on the
// GPU together and nothing synchronises the device mid-step: NCCL kernels take few SMs, and a step
// allocates only from stream-ordered pools. abort() and watchdog() may be used from any thread.
// Each call makes the communicator's GPU current on the calling thread (cudaSetDevice).
//
// Destruction. Normally ncclCommDestroy on every communicator (NCCL documents it as a collective
// among the ranks of one node: every process destroys its communicator at the end of a run; it
// stays blocking for nonblocking communicators). After abort(), while an exception unwinds the
// stack, or with a group left open, the communicators are aborted instead (local, never waits
// for a peer), except those recorded in the open group (see "Threads").
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm/device_communicator.h"
#include "runtime/launch/launch_env.h"
#include "runtime/launch/watchdog.h"

namespace trainsim::runtime::cuda {

using NcclLink = std::pair<int, int>;  // (from, to): the sends of rank `from` to rank `to`

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // Rank 0 makes the unique id, broadcast_from_rank0 hands it to every rank (within `timeout`),
  // then init_from_id below with device env.local_rank % (visible GPUs). `groups` are the
  // distinct all-reduce member sets the caller will use (each strictly ascending ranks of the
  // world; the whole world and repeats are allowed and cost nothing), `links` the directed
  // pairs that get a communicator of their own (from != to; repeats allowed), both identical on
  // every rank. Throws std::invalid_argument for a bad env, group, link or timeout before any
  // network or device activity; RendezvousError when the id cannot be shared; CommError when
  // CUDA or NCCL fails.
  static std::unique_ptr<NcclCommunicator> create(const LaunchEnv& env, const std::vector<std::vector<int>>& groups,
                                                  std::chrono::milliseconds timeout,
                                                  const std::vector<NcclLink>& links = {});

  // The same from a unique id shared some other way (tests, or a launcher that has its own
  // broadcast): `unique_id` is make_unique_id()'s bytes from one process, the same on every rank.
  // NCCL's id also names the bootstrap root, which lives in the process that made it: keep that
  // process alive until every rank is constructed.
  static std::unique_ptr<NcclCommunicator> init_from_id(std::span<const std::uint8_t> unique_id, int rank,
                                                        int world_size, int device,
                                                        const std::vector<std::vector<int>>& groups,
                                                        std::chrono::milliseconds timeout,
                                                        const std::vector<NcclLink>& links = {});
  static std::vector<std::uint8_t> make_unique_id();  // ncclGetUniqueId; CommError on failure

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int world_size() const override;
  // "NCCL 2.28.9, rank 3 of 8, GPU 3 (NVIDIA H100 80GB HBM3)"
  std::string describe() const override;
  int device() const;  // the CUDA device index this rank uses

  void send(int peer, std::uint64_t tag, const void* data, std::size_t count, DType dt, StreamHandle stream) override;
  void recv(int peer, std::uint64_t tag, void* data, std::size_t count, DType dt, StreamHandle stream) override;
  void group_begin() override;
  void group_end() override;
  void all_reduce(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag, ReduceOp op,
                  Divide divide, StreamHandle stream) override;
  void reduce_scatter(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag,
                      ReduceOp op, Divide divide, StreamHandle stream) override;
  void all_gather(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag,
                  StreamHandle stream) override;
  std::vector<std::vector<std::uint8_t>> gather_host(std::span<const std::uint8_t> mine) override;
  void abort(const std::string& reason) override;

  // Waits on the host until the work queued on `stream` so far has run, without blocking in
  // CUDA: polls the stream, the communicators' asynchronous errors and the aborted flag under
  // a watchdog guard named `what`. Throws CommError when the stream reports an error, a
  // communicator has failed, the watchdog fired, or abort() was called.
  void synchronize(StreamHandle stream, const std::string& what);
  // Guards the caller's own host waits (guard(...)); on timeout it aborts this communicator.
  Watchdog& watchdog();
  bool aborted() const;

 private:
  struct Impl;
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  // all_reduce and reduce_scatter share one body.
  enum class Reduction : int;
  void reduce(Reduction kind, void* data, std::size_t count, DType dt, std::span<const int> members,
              std::uint64_t tag, ReduceOp op, Divide divide, StreamHandle stream);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainsim::runtime::cuda
