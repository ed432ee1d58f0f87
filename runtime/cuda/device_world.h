// Every rank of a plan on ONE GPU, in one process: a DeviceCommunicator (device_communicator.h)
// whose ranks are threads exchanging through device memory, so any plan's schedule, numerics
// and per-op costs can run on a single GPU. NCCL cannot do this (it refuses two ranks on one
// device); this world does what a transport would, with copies and events:
//
//  * send: the sender copies its buffer into a fresh staging buffer on its stream (stream-ordered
//    allocation), records an event and posts {staging, event} to the receiver's mailbox
//    (runtime/comm/mailbox.h). It never waits for the receiver: sends are buffered.
//  * recv: waits on the host for the message (timeout, abort), makes its stream wait for the
//    sender's event, copies the staging buffer into its own and frees the staging buffer on its
//    stream. The k-th send from A to B meets the k-th recv at B from A (as NCCL pairs them); a
//    tag, count or format that differs is a CommError (the schedule sent out of order).
//  * all_reduce: every member copies its contribution into staging and posts {staging, event}
//    to every other member; each member's stream then waits for all of them and computes the
//    whole reduction itself with kernels/collective.h ring_reduce, which sums every chunk in the
//    order the in-process ring does, rounding every partial sum to the buffer's format. So all
//    members get identical bits, and the same bits the CPU backend gets for the same inputs.
//    A second exchange of events frees each staging buffer once every member has read it.
//
// The host threads block only until their peers' host threads reach the same call (never on
// the device); the device never waits for an event that was not recorded yet. Every call must
// be made with the context of the stream it is given current (runtime/cuda/sm_partition.h). The
// events are reused per stream rather than destroyed by whichever rank's thread released them
// last, which under green contexts may not touch the sender's context.
#pragma once

#include <chrono>
#include <memory>

#include "runtime/comm/device_communicator.h"

namespace trainsim::runtime::cuda {

class DeviceWorld {
 public:
  // `timeout`: how long a host-side wait (recv, a collective's exchange) may last.
  explicit DeviceWorld(int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~DeviceWorld();
  DeviceWorld(const DeviceWorld&) = delete;
  DeviceWorld& operator=(const DeviceWorld&) = delete;

  int world_size() const;
  // Rank `rank`'s communicator; it shares this world's state and outlives it safely.
  std::unique_ptr<DeviceCommunicator> communicator(int rank);

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
};

}  // namespace trainsim::runtime::cuda
