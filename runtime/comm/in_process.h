// The CPU backend's communicator: ranks are threads of one process exchanging through
// shared mailboxes. The ring all-reduce really passes chunks from member to member.
//
// Mailboxes: one per destination rank, each with its own mutex and condition variable (ranks
// that do not talk never contend). A message is keyed by (source, tag, channel): channel 0
// for send/recv, 1 + k for step k of a collective, so collectives and point-to-point
// messages never collide; messages under one key arrive in the order they were sent.
//
// Ring all-reduce over n members of an N-element buffer: chunk c holds N/n elements, plus one
// for the first N%n chunks (chunks may be empty; an empty buffer still synchronizes).
// Reduce-scatter, steps 0..n-2: the member at position p sends its partial sum of chunk
// (p-k) mod n to position p+1 and adds its own contribution to chunk (p-k-1) mod n from
// position p-1; chunk c is therefore summed in the order of positions c, c+1, ..., c-1.
// All-gather, steps n-1..2n-3: each member forwards the chunk it last received. The received
// vector is itself what travels on, so a call allocates one chunk (for its first send) and
// otherwise only moves vectors and copies received chunks into the caller's buffer. Partial sums are computed in fp32 and rounded to the wire format, which for
// fp16 and bf16 equals the correctly rounded sum in that format (fp32 holds more than twice
// their significand bits plus two, so the double rounding is harmless).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>

#include "runtime/comm/communicator.h"

namespace trainsim::runtime {

// An all-reduce whose member would receive at most this many elements from the others going
// direct ((n-1) x N: every member sends its whole buffer to every other) goes direct, a larger one
// round the ring; both give the same bits. Measured (bench_runtime BM_SmallAllReduce, threads that
// sleep while they wait, 2 vCPUs): direct is 1.7x faster for 1-64 elements on 2 and 8 members,
// even at 1024 elements on 2 and at 256 on 8, and 1.8x slower at 1024 on 8 (docs/performance.md).
inline constexpr std::size_t kDirectAllReduceElements = 1024;

// Whether an all-reduce of `elements` per member over `members` goes direct (above).
inline bool all_reduce_goes_direct(std::size_t members, std::size_t elements) {
  return members > 1 && (members - 1) * elements <= kDirectAllReduceElements;
}

class InProcessWorld {
 public:
  // `timeout`: how long a recv or collective may wait before it fails with CommError.
  explicit InProcessWorld(int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~InProcessWorld();
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;

  int world_size() const;
  // The communicator of `rank` (any number per rank; they share the rank's mailbox). It
  // shares this world's state, so it stays usable even if the world is destroyed first. `poll`:
  // how long its calls poll for a message they wait for before sleeping (comm/mailbox.h), for a
  // thread that has a core to itself while it waits; zero (sleep at once) for threads that share
  // cores, where a poller takes the core from the thread it waits for. `poll_while` (optional, must
  // outlive the communicator): polling also stops, or does not start, while it is false (a thread
  // that has a core of its own only at times: the CPU engine's gated tensor-parallel shards).
  // `poll_in_call` (default: `poll`): how long the later steps of a ring poll, whose sender is
  // inside the same call already and a chunk's sum away from its message, for a thread that
  // polls only briefly for a peer that may not have arrived yet (the CPU engine's communication
  // thread beside its compute thread): sleeping there put a wake-up on every step's path.
  std::unique_ptr<Communicator> communicator(int rank, std::chrono::microseconds poll = {},
                                             const std::atomic<bool>* poll_while = nullptr,
                                             std::optional<std::chrono::microseconds> poll_in_call = std::nullopt);
  // Bytes held in mailboxes right now and at most so far (messages sent, not yet received),
  // counted as stored: 4 bytes per element whatever the wire format.
  std::size_t bytes_in_flight() const;
  std::size_t peak_bytes_in_flight() const;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
};

}  // namespace trainsim::runtime
