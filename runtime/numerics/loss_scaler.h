// Loss scaling (DESIGN.md "Mixed precision"): none, static, or dynamic with growth interval,
// backoff and hysteresis, following Megatron-LM's DynamicGradScaler:
//  * a step whose gradients hold inf/NaN is skipped (static and dynamic; never with none);
//  * dynamic: each overflow uses up one unit of hysteresis; when none is left the scale is
//    multiplied by backoff_factor (not below 1). An overflow also restarts the growth count.
//  * dynamic: after growth_interval consecutive good steps the scale is multiplied by
//    growth_factor and the hysteresis is refilled.
#pragma once

#include "core/config.h"

namespace trainsim::runtime {

class LossScaler {
 public:
  struct State {
    double scale = 1;
    int good_steps = 0;       // consecutive steps without overflow since the last change
    int hysteresis_left = 0;  // overflows still tolerated before the next backoff
    bool operator==(const State&) const = default;
  };

  explicit LossScaler(const LossScalingConfig& config);
  double scale() const { return state_.scale; }
  // Records one step's verdict; returns true when the step must be skipped.
  bool update(bool found_nonfinite);
  const State& state() const { return state_; }
  void restore(const State& s) { state_ = s; }

 private:
  LossScalingConfig config_;
  State state_;
};

}  // namespace trainsim::runtime
