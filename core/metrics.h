// Timeline -> Result: the one place step time, bubble fraction, utilization and
// communication figures are computed, for predicted and measured timelines alike.
//
// Idle time: a rank's compute stream is idle for step time minus busy time; that idle time
// is split by what the stream waited for (metrics.cpp, split_idle): a pipeline peer's
// activation or gradient (pipeline_bubble_s) or this rank's collectives (exposed_comm_s).
// bubble_fraction = 1 - mean utilization = pipeline_bubble_fraction + exposed_comm_fraction.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/plan.h"
#include "core/result.h"
#include "core/timeline.h"

namespace trainsim {

// What a GPU holds beyond the model's accounting at most, typically: the CUDA context, library
// workspaces and the allocator's fragmentation (0.5-2 GiB). A result leaving less free than
// this is warned about, and a plan prefers, among near-equal configurations, one that leaves it.
inline constexpr double kUnmodelledMemoryGib = 2.0;

// `memory` holds each rank's breakdown at its peak (predicted by the memory model, or
// measured by the runtime's allocation accounting).
Result compute_result(const Plan& plan, const Timeline& timeline, const std::vector<MemoryBreakdown>& memory);

// What the Result reads from a timeline, before the memory and the warnings: the step's span
// (Timeline::begin() and end() over the ranks read) and, per rank, its busy, collective and
// exposed-communication ticks. compute_result_into computes them from the timeline's ops;
// StepProgram::run_figures (sim/step_program.h) from its cells, without writing a timeline.
struct StepFigures {
  Tick begin = 0, end = 0;
  struct Rank {
    Tick busy = 0;        // the compute ops' intervals, summed
    Tick collective = 0;  // the collectives' other than the found-inf check
    Tick comm = 0;        // idle while waiting for this rank's collectives (see metrics.cpp, rank_pass)
    friend bool operator==(const Rank&, const Rank&) = default;
  };
  std::vector<Rank> ranks;  // per rank of the schedule; a twin's entry (same_as) is not read
};

// An idle interval [g0, g1) of a rank's compute stream that ends where op `op` (a compute op or
// a receive, by program position) starts.
struct IdleGap {
  int op;
  Tick g0, g1;
};

// Buffers that compute_result_into reuses between calls (one per sweep worker).
struct ResultWorkspace {
  std::vector<OpTiming> collectives, merged_a;
  std::vector<int> coll_index;  // program positions of the rank's collectives
  std::vector<IdleGap> gaps;    // the rank's, in program order
  std::vector<std::pair<double, std::vector<int>>> groups;  // over-capacity ranks by their peak
  StepFigures figures;
  // The last result's memory warnings and fits_in_memory, and what they were written from
  // (every rank's rank, stage, replica and peak, the capacity and memory_gib, as bits).
  bool memory_valid = false, memory_fits = true;
  std::vector<std::string> memory_warnings;
  std::vector<std::uint64_t> memory_written_from, memory_key;
};

// The part of a rank's compute-stream idle time that waited for its own collectives
// (StepFigures::Rank::comm): split gap by gap (see metrics.cpp, rank_pass), then the tail from
// `cursor` (where the stream's last op ended, or the step's start) to `end`. coll_index and
// colls: the rank's collectives (found-inf checks included), program positions ascending, and
// their intervals (sorted by start in place); merged: scratch.
Tick idle_comm(const RankProgram& prog, const std::vector<IdleGap>& gaps, const std::vector<int>& coll_index,
               std::vector<OpTiming>& colls, Tick cursor, Tick end, bool pipelined, std::vector<OpTiming>& merged);

// Per rank of a schedule, the ops compute_result_into reads one by one (compute ops, receives
// and collectives, in program order, each with what is done with it; the sends are read only
// for the step's span). Built once per schedule and given with each timeline of it, it
// spares the result the other ops and the decoding of every op's kind (a sweep's schedules
// are timed at thousands of prices).
struct ResultIndex {
  std::vector<std::vector<std::uint32_t>> ranks;  // op position << 3 | class (metrics.cpp)
};
void result_index_into(const Schedule& schedule, ResultIndex& out);

// The same result into `out`, reusing its storage and `ws`. same_as (optional, one entry per
// rank): a rank whose program and timings equal those of rank same_as[r] (replicas found
// identical by the simulator); its per-rank figures are copied instead of recomputed, and its
// row of the timeline is not read (it may be empty). index (optional): result_index_into of
// the timeline's schedule; the result is the same with or without it. The timeline's figures
// (StepFigures) are left in ws.figures.
void compute_result_into(const Plan& plan, const Timeline& timeline, const std::vector<MemoryBreakdown>& memory,
                         Result& out, ResultWorkspace& ws, const std::vector<int>* same_as = nullptr,
                         const ResultIndex* index = nullptr);

// The same Result from the step's figures (StepFigures) instead of a timeline of `schedule`.
// same_as as above: a twin's figures are not read (its counterpart's entry is copied).
void result_from_figures(const Plan& plan, const Schedule& schedule, const StepFigures& figures,
                         const std::vector<MemoryBreakdown>& memory, Result& out, ResultWorkspace& ws,
                         const std::vector<int>* same_as = nullptr);

// Length of the union of intervals in `a` that no interval of `b` covers.
Tick uncovered_length(std::vector<OpTiming> a, std::vector<OpTiming> b);

}  // namespace trainsim
