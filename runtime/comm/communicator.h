// The communicator interface every backend implements (DESIGN.md: "Communicators share one
// interface"): in-process for the CPU backend (comm/in_process.h), NCCL for the CUDA one.
// One Communicator per rank; ranks are the schedule's ranks (stage * dp + replica).
//
// Contract:
//  * send/recv are matched by (source, destination, tag). send copies the data before it
//    returns and never waits for the receiver; recv blocks until the matching message is
//    there and its size must match.
//  * all_reduce is a collective over `members` (ascending, containing this rank): every
//    member calls it with the same tag, members, size, op, wire format and divide. It runs
//    as a ring (reduce-scatter, then all-gather, over members.size() chunks), rounding each
//    contribution and every partial sum to `wire`, as NCCL reduces in the buffer's type, so
//    its numerics are those of a ring and not of a naive sum. Every member ends with the
//    identical result. Divide::before multiplies each rounded contribution by 1/n (itself
//    rounded to `wire`) and rounds the product; Divide::after divides the final sum by n and
//    rounds the quotient. ReduceOp::max propagates NaN (max(x, NaN) is NaN, unlike fmax): the
//    global overflow check reduces with max and a NaN on one rank must reach every rank.
//  * reduce_scatter and all_gather are the ring's two halves on their own, over the same members
//    and with the same numerics, in place as NCCL's in-place variants: the buffer holds one equal
//    chunk per member (its size a multiple of members.size(), else std::invalid_argument), and
//    the member at position p owns chunk p. reduce_scatter leaves the reduction of chunk p in
//    chunk p (every other chunk of the buffer is left unspecified); all_gather sends chunk p,
//    rounded to `wire`, and fills every other chunk with its owner's. ZeRO's gradient shards and
//    parameter gathers, and sequence parallelism's activations, are these two calls.
//    Tags are separate name spaces for point-to-point messages and collectives: an
//    all_reduce with tag T never takes a send with tag T, and the reverse.
//  * A call that cannot complete (a peer failed, or nothing arrives within the timeout)
//    throws CommError naming this rank, the op and the peer; it never hangs. Size
//    mismatches are CommError too. Arguments that are wrong on their own (a peer outside the
//    world, members not ascending or not containing this rank, an fp8 wire) throw
//    std::invalid_argument before anything is sent.
//  * Calls on one Communicator may come from two threads at once (a rank's compute thread
//    sends and receives while its communication thread runs collectives), as long as tags
//    differ.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "core/dtype.h"

namespace trainsim::runtime {

enum class ReduceOp { sum, max };
// Divide by the number of members: each contribution before the sum, the sum after it, or not at all.
enum class Divide { none, before, after };

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  virtual void send(int peer, std::uint64_t tag, std::span<const float> data) = 0;
  virtual void recv(int peer, std::uint64_t tag, std::span<float> data) = 0;
  virtual void all_reduce(std::span<float> data, std::span<const int> members, std::uint64_t tag, ReduceOp op,
                          DType wire, Divide divide) = 0;
  virtual void reduce_scatter(std::span<float> data, std::span<const int> members, std::uint64_t tag, ReduceOp op,
                              DType wire, Divide divide) = 0;
  virtual void all_gather(std::span<float> data, std::span<const int> members, std::uint64_t tag, DType wire) = 0;

  // Makes every pending and future call of every rank throw CommError(reason): one failing
  // rank stops the others instead of leaving them blocked.
  virtual void abort(const std::string& reason) = 0;
};

}  // namespace trainsim::runtime
