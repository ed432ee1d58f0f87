// The discrete-event engine: executes a Schedule against cost models and returns the
// predicted Timeline.
//
// State is per rank and stream (compute, collective, p2p), each running its ops in program
// order. Time is an integer number of picoseconds. A Simulation owns all of its state:
// many can run at once on many threads.
//
// Nothing in the model is a shared resource that ops queue for (a stream runs one op at a
// time, in program order; links and collectives are priced per transfer), so every op's
// start is fixed by the ends of what it waits for, whatever order events are handled in:
//   start = max(stream free, dep ended)            compute, send, local check
//   a receive ends at max(stream free, dep ended, its send ended) and spans the wait
//   a blocking send (no p2p overlap, on the compute stream) also waits for its receiver to
//   post the receive: NCCL moves the message only once both sides are in the exchange. A
//   send and the receive right after it on the compute stream are posted together, as one
//   batched exchange (Megatron-LM's send_forward_recv_backward and the like), so two
//   neighbours exchanging in both directions meet instead of waiting for each other.
//   a collective starts when its last member arrives (each member: max(stream free, dep ended))
//   and lasts its price, plus what the collective model adds for members that waited
//   (CollectiveModel::wake_after, of the first arrival's lead on the last)
// The engine therefore evaluates ops in dependency order (a worklist of streams that may
// advance) rather than popping a time-ordered heap; the timestamps are those of the event
// order, ties included, and tests/test_engine.cpp checks them against closed forms.
#pragma once

#include <cstdint>
#include <array>
#include <memory>
#include <vector>

#include "core/schedule.h"
#include "core/timeline.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

class RooflineComputeModel;
class LinkP2PModel;
class NetworkCollectiveModel;

class Simulation {
 public:
  Simulation() = default;
  Simulation(const Simulation&) = delete;
  Simulation& operator=(const Simulation&) = delete;

  // Runs one step of `schedule` to completion into `out`. Buffers (this object's and
  // out's) are reused from earlier runs, so a sweep worker that keeps one Simulation and
  // one Timeline allocates nothing in steady state. Throws std::logic_error naming the
  // blocked ops if the schedule deadlocks (schedules from build_schedule never do).
  void run(std::shared_ptr<const Schedule> schedule, const CostModels& models, Timeline& out);

  // The same with the default cost models, priced without virtual calls. With
  // `replica_symmetric`, only the ranks of data-parallel replica 0 are simulated and every
  // other rank gets the timings of the rank with its stage in replica 0. That is exact
  // only when every replica runs the same programs at the same costs with the same
  // collective structure: the caller checks it (Predictor does, and tests compare it with
  // a full run on random plans).
  void run(std::shared_ptr<const Schedule> schedule, const RooflineComputeModel& compute, const LinkP2PModel& p2p,
           const NetworkCollectiveModel& collective, Timeline& out, bool replica_symmetric = false);

  // Replica 0 alone, for a schedule whose replicas 1.. have empty programs
  // (build_replica0_into) and which the caller has found replica-symmetric as above: the
  // ranks of replica 0 get their timings in `out`, every other rank an empty row (its
  // timings are those of its stage's rank in replica 0). Returns false, with `out` not
  // usable, when the schedule is not shaped for it (not one replica-0 rank per stage) or
  // replica 0 alone cannot complete; the caller then builds and runs the full schedule.
  bool run_replica0(std::shared_ptr<const Schedule> schedule, const RooflineComputeModel& compute,
                    const LinkP2PModel& p2p, const NetworkCollectiveModel& collective, Timeline& out);

  // Whether the last run simulated replica 0 alone (asked for, and the schedule had one
  // replica-0 rank per stage with programs as long as every other replica's).
  bool last_run_symmetric() const { return symmetric_; }

  // Bytes of engine state (excluding the schedule it executes), to check that memory
  // grows linearly with the number of ops.
  std::size_t footprint_bytes() const;

 private:
  struct StreamState {
    std::int32_t cursor = 0;  // next op of this stream in the rank's program (or its size)
    Tick free_at = 0;         // when the previous op of the stream ended
    bool arrived = false;     // registered at the collective it is waiting for
    bool waits_dep = false;   // blocked on an op of another stream of its rank
    bool queued = false;      // in the worklist
  };
  struct CollectiveState {
    Tick duration = -1;        // -1: not priced yet
    Tick first_arrival = -1;   // -1: no member yet
    Tick last_arrival = 0;
    std::int32_t arrivals = 0;
    std::int32_t target = 0;   // members that must arrive (simulated members)
    std::int32_t first = 0, count = 0;  // simulated members: sim_members_[first, first + count)
  };

  template <class Models>
  bool run_impl(const Models& models, Timeline& out, bool replica_symmetric, bool materialised = true);
  template <class Models>
  void prepare_collective(const Models& models, std::int32_t c);
  template <class Models>
  void advance(const Models& models, std::int32_t stream, Timeline& out);
  void enqueue(std::int32_t stream);
  [[noreturn]] void report_deadlock() const;

  std::shared_ptr<const Schedule> schedule_;
  std::vector<StreamState> streams_;       // rank * kNumStreams + stream kind
  std::vector<std::uint8_t> simulated_;    // per rank
  std::vector<Tick> message_arrival_;      // per message: -1 until its send ends
  // Blocking sends only (no p2p overlap): per message, when its receiver posted the receive
  // (-1 until then). A blocking send is a rendezvous: it starts once the receive is posted.
  std::vector<Tick> recv_posted_;
  std::vector<CollectiveState> collectives_;
  std::vector<std::int32_t> sim_members_;  // simulated members of each collective
  std::vector<std::int32_t> worklist_;
  std::vector<std::int32_t> counterpart_;  // rank -> the simulated rank whose timings it takes
  std::int32_t last_priced_ = -1;          // the collective priced last (its neighbours often match it)
  // The stream each op kind runs on: stream_of, except that sends run on the compute stream
  // when the p2p model says a send blocks its rank (no p2p overlap).
  std::array<std::uint8_t, kNumOpKinds> stream_of_{};
  bool symmetric_ = false;
  bool blocking_sends_ = false;  // sends hold the compute stream and wait for their receiver (rendezvous)
  std::int64_t completed_ = 0, expected_ = 0;
};

// Convenience: one run with fresh buffers.
Timeline simulate_schedule(std::shared_ptr<const Schedule> schedule, const CostModels& models);

}  // namespace trainsim
