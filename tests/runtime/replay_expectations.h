// What every engine's replays must show (RunOptions::timed_steps_at_least): the CPU engine's test
// (tests/runtime/test_executor.cpp) and the CUDA engine's (tests/cuda/test_executor_cuda.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>

#include "core/config.h"
#include "runtime/contract.h"

namespace trainsim::runtime::testing {

// `c` with a learning rate that sends the weights to 1e30 in one update: the loss is NaN at step 2
// and the run ends there (of five steps asked for).
inline ScenarioConfig nan_at_step_two(ScenarioConfig c) {
  c.training.lr = 1e30;
  c.runtime.steps = 5;
  return c;
}

// A run of nan_at_step_two asked for four timed steps: the loop replays steps 1-2 three times from
// the state before step 1 (DeviceEngine::save before any step, then restore), and an engine that
// restores bit for bit gives the run's losses and weights each time, so every replay is kept.
inline void expect_bitwise_replays(const RunReport& r) {
  ASSERT_TRUE(r.failure);
  ASSERT_EQ(r.failure->step, 2) << r.failure->message;
  ASSERT_EQ(r.steps.size(), 2u);
  EXPECT_TRUE(std::isfinite(r.steps[0].loss));
  EXPECT_FALSE(std::isfinite(r.steps[1].loss));
  ASSERT_EQ(r.replayed_steps.size(), 6u) << "every replay kept: the same numerics";
  for (const StepRecord& s : r.replayed_steps) {
    const StepRecord& original = r.steps[static_cast<std::size_t>(s.step - 1)];
    if (s.step == 1) {
      EXPECT_EQ(s.loss, original.loss) << "replay " << s.replay;
    }
    EXPECT_EQ(s.replica_checksums, original.replica_checksums) << "replay " << s.replay << " step " << s.step;
  }
}

}  // namespace trainsim::runtime::testing
