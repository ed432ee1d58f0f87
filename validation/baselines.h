// The regression check over validation/baselines/: small plans that run in seconds on the CPU
// backend, each with its accepted prediction errors and tolerances (accepted.yaml). Each is
// validated again (calibrate, predict, run); a plan fails when an error moved further from its
// accepted value than its tolerance in each of `attempts` validations, taken in rounds (every
// plan, then the plans still off, again after one another: one slow stretch of a shared machine
// is not a drift of the model; a drift misses every time), and the set fails when it drifts from
// the targets:
//   step time   median |error| over the set: target targets.step_time_median (5%)
//   bubble      median and largest |error|: target targets.bubble_abs (0.03)
//   peak memory every rank's |error| <= targets.peak_memory (5%)
// Memory is deterministic and gated at its target; step time and bubble are reported against
// their targets and gated at twice them (a shared machine scatters a set's medians around the
// targets; a drift of the model goes beyond).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "validation/validate.h"

namespace trainsim::validation {

struct BaselineOptions {
  bool update = false;          // accept the median errors of `attempts` validations of each plan
  int attempts = 3;
  // How one plan is validated (tests replace it); empty: validate() with the calibration the
  // baselines use.
  std::function<Validation(const Scenario&)> validate_plan;
  // The backend that calibrates and runs a plan (the CLI's --backend, else the plan's
  // runtime.backend); empty: the CPU backend.
  std::function<ValidationBackend(const Scenario&)> backend_for;
  std::function<void(const std::string&)> progress;
};

struct BaselineOutcome {
  std::string file;
  double step_time_error = 0, bubble_error = 0, memory_error = 0, allreduce_error = 0;
  double accepted_step = 0, accepted_bubble = 0, accepted_memory = 0;
  double tolerance_step = 0, tolerance_bubble = 0, tolerance_memory = 0;
  double machine_drift = 0;
  bool reduces = false;  // the step has an all-reduce (predicted or measured)
  // The largest core factor of the validation's profile (HardwareProfile::core_factors): how much
  // slower a core ran with every rank computing than one alone. 1.03-1.08 on a quiet 2-core host,
  // 1.6 and more when the host is busy; 0 for one rank.
  double core_contention = 0;
  int attempts = 1;
  bool stable = true;
  std::vector<std::string> failures;
};

struct BaselineReport {
  std::vector<BaselineOutcome> plans;
  double median_step_error = 0, median_bubble_error = 0, max_bubble_error = 0, max_memory_error = 0;
  double target_step = 0.05, target_bubble = 0.03, target_memory = 0.05;
  // The all-reduce inside a step (issue 16: within 20% on every plan), reported, not failed: a
  // 30 us embedding sum moves by a third between runs of its own benchmark on a shared host.
  double target_allreduce = 0.20;
  int allreduce_plans = 0, allreduce_within = 0;  // plans that reduce; of them within target_allreduce
  std::vector<std::string> failures;  // set-level
  bool passed = true;
  bool updated = false;  // --update: accepted.yaml now holds these errors
  double seconds = 0;
};

BaselineReport check_baselines(const std::string& folder, const BaselineOptions& options);
std::string format_baseline_report(const BaselineReport& r);

}  // namespace trainsim::validation
