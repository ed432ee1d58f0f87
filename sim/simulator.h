// Plan -> prediction: builds the schedule, prices it with the default cost models, runs
// the discrete-event engine, walks memory and computes the result fields.
#pragma once

#include <memory>
#include <vector>

#include "core/plan.h"
#include "core/result.h"
#include "core/schedule.h"
#include "core/timeline.h"

namespace trainsim {

struct Prediction {
  std::shared_ptr<const Schedule> schedule;
  Timeline timeline;
  std::vector<MemoryBreakdown> memory;  // per rank, at its peak
  Result result;
};

Prediction predict(const Plan& plan);

// Predicts plan after plan on one thread, reusing its buffers between calls: what a sweep
// worker keeps (one per thread; no state is shared between Predictors).
class Predictor {
 public:
  // The prediction for `plan`; valid until the next call on this Predictor.
  const Prediction& predict(const Plan& plan);

 private:
  Prediction last_;
};

}  // namespace trainsim
