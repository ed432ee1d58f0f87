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

// `memory` holds each rank's breakdown at its peak (predicted by the memory model, or
// measured by the runtime's allocation accounting).
Result compute_result(const Plan& plan, const Timeline& timeline, const std::vector<MemoryBreakdown>& memory);

// Buffers that compute_result_into reuses between calls (one per sweep worker).
struct ResultWorkspace {
  std::vector<OpTiming> collectives, merged_a;
  std::vector<int> coll_index;  // program positions of the rank's collectives
  struct Gap {
    int op;      // the op it ends at
    Tick g0, g1;
  };
  std::vector<Gap> deferred;  // gaps before an op whose collective comes after it in the program
  std::vector<std::pair<double, std::vector<int>>> groups;  // over-capacity ranks by their peak
};

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
// the timeline's schedule; the result is the same with or without it.
void compute_result_into(const Plan& plan, const Timeline& timeline, const std::vector<MemoryBreakdown>& memory,
                         Result& out, ResultWorkspace& ws, const std::vector<int>* same_as = nullptr,
                         const ResultIndex* index = nullptr);

// Length of the union of intervals in `a` that no interval of `b` covers.
Tick uncovered_length(std::vector<OpTiming> a, std::vector<OpTiming> b);

}  // namespace trainsim
