// A schedule compiled once into a straight-line max-plus program, then re-priced and
// evaluated per configuration: what a sweep needs, where thousands of configurations share
// a handful of schedules and differ only in what their ops cost.
//
// The engine's rules (sim/engine.h) make every op's end a max of other ends plus a price:
//   compute, send, local check   end = max(stream free, dep ended) + price
//   receive                      end = max(stream free, dep ended, its send ended)
//   collective                   end = max over members of max(stream free, dep ended) + price
// and which ops feed which is fixed by the schedule alone, not by the prices. compile()
// runs the engine's worklist once without times, recording the order in which it settles
// ops; run() then evaluates that order as `T[k] = max(T[a], T[b], T[c]) + D[d]` over integer
// ticks, with D the prices of this configuration, and writes the same Timeline the engine
// writes: the same max-plus equations over the same integers, so every start and end is
// identical (tests/test_step_program.cpp compares them op by op with the engine on random
// plans, and the Result with predict()). Instructions are ordered by depth so that
// neighbours seldom feed each other, and a receive that only the compute op after it reads
// is folded into that op's instruction (a third fewer instructions in a pipeline).
//
// Prices are computed once per distinct op, not once per op:
//   compute       per (rank, kind, chunk, work): the price of a compute op must not depend on
//                 its micro-batch, message, bucket, bytes, peer or dep (the default model reads
//                 kind, chunk, work and rank; tests/test_step_program.cpp checks that on every
//                 op of random plans, so a model that starts reading them fails there);
//   send          per (rank, peer, bytes): the P2PModel's own arguments;
//   collective    per (kind, bytes, members), as the engine already reuses a price.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/metrics.h"
#include "core/schedule.h"
#include "core/timeline.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

class RooflineComputeModel;
class LinkP2PModel;
class NetworkCollectiveModel;

class StepProgram {
 public:
  static constexpr std::int32_t kRecv = 1 << 30;  // see Instruction

  StepProgram() = default;
  StepProgram(const StepProgram&) = delete;
  StepProgram& operator=(const StepProgram&) = delete;

  // Compiles `schedule` (kept alive by the program). replica0_only: as
  // Simulation::run_replica0, only the ranks of data-parallel replica 0 are simulated (the
  // others may have empty programs, and get empty timeline rows); a collective shared with
  // other replicas starts when replica 0's members have arrived. Returns false, leaving
  // nothing compiled, where the engine would not complete the step (a deadlock) or, for
  // replica0_only, where the schedule is not shaped for it (not one replica-0 rank per stage);
  // the caller then runs the engine, which reports the deadlock.
  bool compile(std::shared_ptr<const Schedule> schedule, bool replica0_only);
  bool compiled() const { return schedule_ != nullptr; }
  void reset();  // compiled() false; the schedule let go
  bool replica0_only() const { return replica0_only_; }
  const std::shared_ptr<const Schedule>& schedule() const { return schedule_; }

  // The step at these prices, into `out` (buffers reused): what Simulation::run (or
  // run_replica0) writes for the same schedule and models. Requires compiled().
  void run(const RooflineComputeModel& compute, const LinkP2PModel& p2p, const NetworkCollectiveModel& collective,
           Timeline& out);
  void run(const CostModels& models, Timeline& out);  // any models, one virtual call per distinct op

  // The step for several configurations at once, lane j priced by compute[j], p2p[j] and
  // collective[j] and written into *out[j] (n lanes, 1 <= n <= kMaxLanes): for each lane, the
  // Timeline run() gives with its models. Every instruction is decoded once for all the lanes
  // and its max-plus step is one vector operation over them (about half the time per
  // configuration of run(), four lanes at a time).
  static constexpr int kMaxLanes = 4;
  void run_lanes(const RooflineComputeModel* const* compute, const LinkP2PModel* const* p2p,
                 const NetworkCollectiveModel* const* collective, Timeline* const* out, int n);

  // The step at these prices without its Timeline: the figures compute_result_into reads
  // from that Timeline (StepFigures, core/metrics.h), the same ticks, from the cells and the
  // prices alone. Every stream's ops start no earlier than the op before them on it ends, and
  // end no earlier than they start when no price is negative, so: the step spans each stream's
  // first start to its last end; a compute op's interval is its price, so a rank's busy time
  // is its compute ops' prices summed; and the compute stream can be idle only before its
  // first op and before an op with a dependency (anywhere else an op starts where the one
  // before it ended), so only those ops' starts, the rank's collectives and its last end are
  // read. pipelined: the plan has more than one stage (compute_result_into's plan.pp > 1).
  // Returns false, writing nothing, where a price is negative: the caller then runs run() and
  // compute_result_into. tests/test_step_program.cpp compares the figures with those of
  // run()'s Timeline on random plans and prices.
  bool run_figures(const RooflineComputeModel& compute, const LinkP2PModel& p2p,
                   const NetworkCollectiveModel& collective, bool pipelined, StepFigures& out, ResultWorkspace& ws);
  bool run_figures(const CostModels& models, bool pipelined, StepFigures& out, ResultWorkspace& ws);
  // The same for several configurations at once, as run_lanes: *out[j] is what run_figures
  // gives with lane j's models. False, writing nothing, where a lane has a negative price.
  bool run_lanes_figures(const RooflineComputeModel* const* compute, const LinkP2PModel* const* p2p,
                         const NetworkCollectiveModel* const* collective, bool pipelined, StepFigures* const* out,
                         ResultWorkspace& ws, int n);

  // Whether rank r's ops are simulated (false for replicas 1.. of a replica0_only program).
  bool simulated(int rank) const { return first_slot_[static_cast<std::size_t>(rank)] >= 0; }

  // Whether these models price every compute op of the schedule as its class's
  // representative (same rank, kind, chunk and work): one call per compute op. The Predictor
  // asks once per compiled schedule and runs the engine instead when not.
  bool prices_hold(const RooflineComputeModel& compute, const LinkP2PModel& p2p,
                   const NetworkCollectiveModel& collective) const;
  bool prices_hold(const CostModels& models) const;

  std::size_t num_instructions() const { return program_.size(); }
  std::size_t num_prices() const { return compute_.size() + sends_.size() + collectives_.size(); }
  std::size_t footprint_bytes() const;  // the compiled program, excluding the schedule

 private:
  // T[k + 1] = max(T[a], T[b], T[c]) + D[d] for instruction k; T[0] = 0 and D[0] = 0. It
  // also writes the interval of op `index` of `rank` (none when rank < 0): [T[k + 1] - D[d],
  // T[k + 1]), or for a receive (rank | kRecv) [T[a], T[k + 1]): a receive spans the wait,
  // from the end of the op before it on its stream.
  struct Instruction {
    std::int32_t a, b, c, d, rank, index;
  };
  // A collective's end is one cell; its members' intervals are written from it.
  struct Fanout {
    std::int32_t rank, index, cell, price;
  };
  // A receive whose end only the op after it reads (no dep names it) has no instruction of
  // its own: that op's takes the receive's inputs, and the receive's interval is
  // [T[prev], max(T[prev], T[sent])) (it has no dep either).
  struct Held {
    std::int32_t rank, index, prev, sent;
  };
  struct ComputePrice {  // a representative op (rank, index into its program), or any op and its class
    std::int32_t rank, op, cls = 0;
  };
  struct SendPrice {
    std::int32_t from, to;
    Bytes bytes;
  };

  // max(T[c1], T[c2]) - D[p]: an op's start or end from the cells (run_figures).
  struct Value {
    std::int32_t c1 = 0, c2 = 0, p = 0;
  };
  // Per simulated rank, what run_figures reads: ranges into the vectors below.
  struct RankTally {
    std::int32_t rank = 0;
    std::int32_t busy = 0, busy_end = 0;  // busy_: a price and how many compute ops have it
    std::int32_t coll = 0, coll_end = 0;  // colls_: the collectives, program order
    std::int32_t gap = 0, gap_end = 0;    // gaps_: the compute-stream ops that may start late
    std::int32_t span = 0, span_end = 0;  // spans_: each stream's first start and last end
    bool has_last = false;
    Value last;                           // the compute stream's last end
  };
  struct PriceCount {
    std::int32_t price, count;
  };
  struct CollTally {
    Value start, end;
    bool counted;  // false for the found-inf check (not in StepFigures::Rank::collective)
  };
  struct GapTally {
    std::int32_t op;
    bool first;    // the stream's first op: the idle time from the step's start
    Value cursor;  // else: the end of the op before it on the stream
    Value start;
  };

  template <class Models>
  void price(const Models& models, Tick* D, std::size_t stride) const;
  template <class Models>
  void run_impl(const Models& models, Timeline& out);
  template <class Models>
  bool run_figures_impl(const Models& models, bool pipelined, StepFigures& out, ResultWorkspace& ws);
  void figures_from_cells(const Tick* T, const Tick* D, std::size_t stride, bool pipelined, StepFigures& out,
                          ResultWorkspace& ws) const;
  void tally(const std::vector<std::array<std::int32_t, 2>>& slots, const std::vector<std::array<std::int32_t, 4>>& held,
             const std::vector<std::int32_t>& renamed, std::int32_t ncompute, std::int32_t nsends);
  template <class Models>
  bool prices_hold_impl(const Models& models) const;
  template <int B>
  void price_lanes(const RooflineComputeModel* const* compute, const LinkP2PModel* const* p2p,
                   const NetworkCollectiveModel* const* collective, int n);
  template <int B, bool kTimeline>
  void run_lanes_impl(Timeline* const* out, int n);

  std::shared_ptr<const Schedule> schedule_;
  bool replica0_only_ = false;
  std::vector<Instruction> program_;
  std::vector<Fanout> fanout_;
  std::vector<Held> held_;
  std::vector<std::int32_t> first_slot_;      // per rank: -1 when not simulated
  std::vector<ComputePrice> compute_;         // D[1 ..]
  std::vector<ComputePrice> priced_;          // every compute op with its class (prices_hold)
  std::vector<SendPrice> sends_;              // then these
  std::vector<std::int32_t> collectives_;     // then these (collective ids)
  std::vector<Tick> cells_, prices_;          // T and D, reused across runs
  std::vector<OpTiming*> rows_;               // the Timeline's rows during a run
  std::vector<Tick> lane_cells_, lane_prices_;  // run_lanes: T and D, lane by lane within a cell
  std::vector<RankTally> tallies_;              // run_figures
  std::vector<PriceCount> busy_;
  std::vector<CollTally> colls_;
  std::vector<std::vector<int>> coll_positions_;  // per rank: its collectives' program positions
  std::vector<GapTally> gaps_;
  std::vector<std::pair<Value, Value>> spans_;
};

}  // namespace trainsim
