#include "runtime/numerics/loss_scaler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace trainsim::runtime {

namespace {
constexpr double kMinScale = 1.0;  // Megatron-LM's min_scale; a scale below 1 would amplify nothing

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("loss scaling: " + what);
}
}  // namespace

LossScaler::LossScaler(const LossScalingConfig& config) : config_(config) {
  switch (config_.mode) {
    case LossScalingMode::none:
      state_.scale = 1;
      break;
    case LossScalingMode::static_scale:
      check(config_.initial_scale > 0, "initial_scale must be positive, got " + std::to_string(config_.initial_scale));
      state_.scale = config_.initial_scale;
      break;
    case LossScalingMode::dynamic:
      check(config_.initial_scale > 0, "initial_scale must be positive, got " + std::to_string(config_.initial_scale));
      check(config_.growth_interval >= 1,
            "growth_interval must be at least 1, got " + std::to_string(config_.growth_interval));
      check(config_.growth_factor >= 1, "growth_factor must be at least 1, got " + std::to_string(config_.growth_factor));
      check(config_.backoff_factor > 0 && config_.backoff_factor < 1,
            "backoff_factor must be in (0, 1), got " + std::to_string(config_.backoff_factor));
      check(config_.hysteresis >= 1, "hysteresis must be at least 1, got " + std::to_string(config_.hysteresis));
      state_.scale = std::max(config_.initial_scale, kMinScale);
      state_.hysteresis_left = config_.hysteresis;
      break;
  }
}

bool LossScaler::update(bool found_nonfinite) {
  switch (config_.mode) {
    case LossScalingMode::none:
      return false;  // nothing is scaled, so nothing can be blamed on the scale: apply the step
    case LossScalingMode::static_scale:
      return found_nonfinite;
    case LossScalingMode::dynamic:
      break;
  }
  if (found_nonfinite) {
    state_.good_steps = 0;
    // Megatron decrements its hysteresis tracker without bound and backs off while it is
    // <= 0; clamping at 0 and backing off at 0 is the same rule.
    state_.hysteresis_left = std::max(state_.hysteresis_left - 1, 0);
    if (state_.hysteresis_left == 0) state_.scale = std::max(state_.scale * config_.backoff_factor, kMinScale);
    return true;
  }
  if (++state_.good_steps == config_.growth_interval) {
    state_.good_steps = 0;
    state_.hysteresis_left = config_.hysteresis;
    state_.scale *= config_.growth_factor;
  }
  return false;
}

}  // namespace trainsim::runtime
