// A Timeline is what an executor reports for one step of a schedule: when every op of
// every rank started and ended. The simulator fills it with predictions, the runtime with
// measurements; metrics, traces and pictures are computed from it by one piece of code.
#pragma once

#include <memory>
#include <vector>

#include "core/schedule.h"
#include "core/units.h"

namespace trainsim {

struct OpTiming {
  Tick start = 0;
  Tick end = 0;
  // Inside [start, end): time the op was held up rather than working. A measured ZeRO-3 gather
  // runs unit by unit beside its pass and waits between units for the pass to free room; those
  // waits are not communication. Where ranks share cores (the CPU engine's turns), a compute op's
  // wait for its turn at a core, measured and replayed (validation/core_sharing.h): busy time all
  // the same, but not its work. 0 in other predictions.
  Tick waited = 0;
};

struct Timeline {
  std::shared_ptr<const Schedule> schedule;
  std::vector<std::vector<OpTiming>> ops;  // [rank][op index], parallel to schedule->ranks[rank].ops
  bool predicted = true;                   // simulator (true) or runtime measurement (false)

  Tick begin() const;  // earliest op start
  Tick end() const;    // latest op end
};

}  // namespace trainsim
