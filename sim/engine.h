// The discrete-event engine: executes a Schedule against cost models and returns the
// predicted Timeline.
//
// State is per rank and stream (compute, collective, p2p), each running its ops in program
// order. Events are op completions in a binary heap keyed on (time, sequence), so ties
// resolve in the order events were created and every run is deterministic. Time is an
// integer number of picoseconds. A Simulation owns all of its state: many can run at once
// on many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/schedule.h"
#include "core/timeline.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

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

  // Bytes of engine state (excluding the schedule it executes), to check that memory
  // grows linearly with the number of ops.
  std::size_t footprint_bytes() const;

 private:
  struct Event {
    Tick time;
    std::uint32_t seq;
    std::int32_t stream;  // the stream whose op ends, or -1 - c when collective c ends
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.time != b.time ? a.time > b.time : a.seq > b.seq;
    }
  };
  enum class Role : std::uint8_t { work, recv, send, collective };
  // Everything the event loop reads and writes about one op, laid out in its stream's
  // order so that running a stream walks memory forwards.
  struct Slot {
    Tick duration = 0;
    Tick start = 0;
    Tick end = -1;                   // -1 until the op ends
    std::int32_t dep = -1;           // slot of the op this one waits for
    std::int32_t channel = -1;       // message id (recv, send) or collective id
    std::int32_t receiver = -1;      // send: the compute stream of the receiving rank
    Role role = Role::work;
    std::uint8_t wakes = 0;          // bit k: an op on stream k of this rank depends on this one
  };
  struct StreamState {
    std::int32_t rank = 0;
    std::int32_t cursor = 0, end = 0;  // range of slots_ still to run
    Tick free_at = 0;                  // when the previous op ended
    bool busy = false;
    bool arrived = false;  // registered at the collective it is waiting for
  };

  void prepare(const CostModels& models);
  void push(Tick time, std::int32_t stream);
  void try_advance(std::int32_t stream, Tick now);
  void finish(std::int32_t stream, Tick now);

  std::shared_ptr<const Schedule> schedule_;
  std::vector<std::int32_t> rank_offset_;  // first global op id of each rank
  std::vector<std::int32_t> slot_of_;      // global op id -> slot
  std::vector<std::int32_t> stream_fill_;
  std::vector<Slot> slots_;
  std::vector<StreamState> streams_;       // rank * kNumStreams + stream kind
  std::vector<Tick> message_arrival_;      // per message: -1 until its send ends
  std::vector<std::int32_t> collective_arrivals_;
  std::vector<Tick> collective_duration_;
  std::vector<Event> heap_;
  std::uint32_t seq_ = 0;
  std::int64_t completed_ = 0;
};

// Convenience: one run with fresh buffers.
Timeline simulate_schedule(std::shared_ptr<const Schedule> schedule, const CostModels& models);

}  // namespace trainsim
