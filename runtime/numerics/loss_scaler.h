// Loss scaling (DESIGN.md "Mixed precision"): none, static, or dynamic with growth interval,
// backoff and hysteresis, following Megatron-LM's DynamicGradScaler:
//  * a step whose gradients hold inf/NaN is skipped (static and dynamic; never with none);
//  * dynamic: each overflow uses up one unit of hysteresis; when none is left the scale is
//    multiplied by backoff_factor (not below 1, Megatron's min_scale; an initial_scale below
//    1 starts at 1). An overflow also restarts the growth count.
//  * dynamic: after growth_interval consecutive good steps the scale is multiplied by
//    growth_factor and the hysteresis is refilled (a good step alone does not refill it, so
//    once it is used up every overflow backs off until the next growth).
//  * none: the scale is 1 and no step is skipped (non-finite gradients are applied).
// Invalid dynamic/static settings (scale <= 0, growth_interval < 1, growth_factor < 1,
// backoff_factor outside (0, 1), hysteresis < 1) throw std::invalid_argument.
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
