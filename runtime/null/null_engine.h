// The null backend: an engine that runs no model. Each step it plays back the simulator's
// prediction of the plan (runtime/engine/device_engine.h's interface, filled from
// sim/simulator.h's Timeline and memory), optionally sleeping for the predicted step time, with
// a small deterministic stand-in for training (weights that decay, a loss that follows them). It
// is the run loop's own test (tests/runtime/test_run.cpp): resume, checkpoint cadence, failure
// propagation and the median step, on every plan, in milliseconds. `trainsim run --backend null`
// shows the prediction through the run's reports.
//
// Adding it took this file's .cpp, this header (only for the faults the loop's tests inject), and
// one line in runtime/backends.cpp.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "runtime/backend.h"
#include "runtime/engine/device_engine.h"

namespace trainsim::runtime {

// What the null engine makes go wrong, or how long it takes, for the loop's tests.
struct NullFaults {
  int fail_rank = -1, fail_step = 0;  // rank fail_rank fails at step fail_step
  int nan_step = 0;                   // the loss is NaN at this step (0: never)
  int diverge_step = 0;               // from this step on the loss is 10 times larger (0: never)
  // Per step (index step - 1): how long it takes. Empty: sleep_predicted decides.
  std::vector<std::chrono::milliseconds> step_sleep{};
  bool sleep_predicted = false;       // sleep for the predicted step time
  // restore() keeps the state it had: the loop's replays then meet other numerics, as they would
  // on an engine that does not restore bitwise.
  bool restore_forgets = false;
};

std::unique_ptr<DeviceEngine> make_null_engine(const RuntimePlan& plan, const RunOptions& options,
                                               const NullFaults& faults = {});

const Backend& null_backend();

}  // namespace trainsim::runtime
