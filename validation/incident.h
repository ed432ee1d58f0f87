// `trainsim prove FILE`: the whole story of a configuration on one page (README's main command,
// on the bundled incident). It plans the scenario (trainsim plan: the original configuration
// and the recommended redesign, predicted at full size), then validates both on a backend (the
// CPU's unless ProveOptions::backend says otherwise) at the runtime section's scaled size (calibrate, predict, run, compare), and reports
// what was predicted and what was measured: utilization and its spread over the ranks, the
// bubble, and the numerics (overflow, skipped steps, NaN, replica drift, loss).
// Every figure in the report comes from this one invocation.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/scenario.h"
#include "sim/simulator.h"
#include "sim/sweep/advice.h"
#include "validation/validate.h"

namespace trainsim::validation {

struct ProveOptions {
  ValidationBackend backend;  // the CPU backend unless set (validate.h)
  int steps = 0;        // 0: each scenario's runtime.steps
  unsigned threads = 0; // plan search threads (0: all cores)
  std::function<void(const std::string&)> progress;
};

struct ConfigurationStory {
  std::string label;    // "original" / "redesign"
  Scenario scenario;    // as run (the redesign: the plan's fragment)
  Plan plan;            // the scenario's plan at full size
  Prediction full;      // predicted at full size, with the scenario's GPU
  Validation scaled;    // calibrated prediction and measurement at the runtime's size
};

struct IncidentReport {
  PlanResult plan;
  ConfigurationStory original, redesign;
  std::vector<std::string> findings;  // the verdict, one sentence each, from the numbers above
};

// What prove throws when the plan finds no feasible configuration: nothing to redesign.
struct NothingFeasible : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws NothingFeasible when the plan finds no feasible configuration.
IncidentReport prove(const Scenario& scenario, const ProveOptions& options);

// The comparison as a person reads it on a terminal.
std::string format_incident(const IncidentReport& r);
// DIR/report.md with its tables, and beside it the pictures it shows: each configuration's
// predicted full-size timeline, its predicted-over-measured scaled timeline, its loss curve.
// Returns the files written.
std::vector<std::string> write_incident_report(const IncidentReport& r, const std::string& dir);

}  // namespace trainsim::validation
