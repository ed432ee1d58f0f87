// Timeline -> Result: the one place step time, bubble fraction, utilization and
// communication figures are computed, for predicted and measured timelines alike.
#pragma once

#include <vector>

#include "core/plan.h"
#include "core/result.h"
#include "core/timeline.h"

namespace trainsim {

// `memory` holds each rank's breakdown at its peak (predicted by the memory model, or
// measured by the runtime's allocation accounting).
Result compute_result(const Plan& plan, const Timeline& timeline, const std::vector<MemoryBreakdown>& memory);

// Length of the union of intervals in `a` that no interval of `b` covers.
Tick uncovered_length(std::vector<OpTiming> a, std::vector<OpTiming> b);

}  // namespace trainsim
