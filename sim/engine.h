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
    std::uint64_t seq;
    std::int32_t stream;  // the stream whose op ends, or -1 - c when collective c ends
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.time != b.time ? a.time > b.time : a.seq > b.seq;
    }
  };
  struct StreamState {
    std::int32_t rank = 0;
    std::int32_t begin = 0, end = 0, cursor = 0;  // range in stream_ops_
    Tick free_at = 0;                             // when the previous op ended
    bool busy = false;
    bool arrived = false;  // registered at the collective it is waiting for
  };

  void prepare(const CostModels& models);
  void push(Tick time, std::int32_t stream);
  void try_advance(std::int32_t stream, Tick now);
  void start(std::int32_t stream, std::int32_t op, Tick now, Tick duration);
  void finish(const Event& e);

  std::shared_ptr<const Schedule> schedule_;
  // Flattened ops: global id = rank_offset_[rank] + index in the rank's program.
  std::vector<std::int32_t> rank_offset_;
  // What the event loop reads per op, kept in flat arrays rather than behind Op pointers.
  enum class Role : std::uint8_t { work, recv, send, collective };
  std::vector<const Op*> op_;
  std::vector<Role> role_;
  std::vector<std::int32_t> channel_;
  std::vector<std::int32_t> dep_;  // global id or -1
  std::vector<std::uint8_t> wakes_;  // bit k: an op on stream k of this rank depends on this op
  std::vector<Tick> duration_;
  std::vector<OpTiming> timing_;   // end is -1 until the op ends
  std::vector<std::int32_t> per_stream_count_;
  std::vector<std::int32_t> stream_ops_;  // op ids, grouped by stream, in program order
  std::vector<StreamState> streams_;      // rank * kNumStreams + stream kind
  std::vector<Tick> message_arrival_;     // per message: -1 until its send ends
  std::vector<std::int32_t> collective_arrivals_;
  std::vector<Tick> collective_duration_;
  std::vector<Event> heap_;
  std::uint64_t seq_ = 0;
  std::int64_t completed_ = 0;
};

// Convenience: one run with fresh buffers.
Timeline simulate_schedule(std::shared_ptr<const Schedule> schedule, const CostModels& models);

}  // namespace trainsim
