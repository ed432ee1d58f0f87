// Timeline -> Result: the one place step time, bubble fraction, utilization and
// communication figures are computed, for predicted and measured timelines alike.
//
// Idle time: a rank's compute stream is idle for step time minus busy time; that idle time
// is split by what the stream waited for (metrics.cpp, split_idle): a pipeline peer's
// activation or gradient (pipeline_bubble_s) or this rank's collectives (exposed_comm_s).
// bubble_fraction = 1 - mean utilization = pipeline_bubble_fraction + exposed_comm_fraction.
#pragma once

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
  std::vector<std::pair<double, std::vector<int>>> groups;  // over-capacity ranks by their peak
};

// The same result into `out`, reusing its storage and `ws`. same_as (optional, one entry per
// rank): a rank whose program and timings equal those of rank same_as[r] (replicas found
// identical by the simulator); its per-rank figures are copied instead of recomputed, and its
// row of the timeline is not read (it may be empty).
void compute_result_into(const Plan& plan, const Timeline& timeline, const std::vector<MemoryBreakdown>& memory,
                         Result& out, ResultWorkspace& ws, const std::vector<int>* same_as = nullptr);

// Length of the union of intervals in `a` that no interval of `b` covers.
Tick uncovered_length(std::vector<OpTiming> a, std::vector<OpTiming> b);

}  // namespace trainsim
