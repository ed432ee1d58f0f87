// `trainsim plan`: pick the best configuration that fits, and explain in plain words what
// changed against the scenario's own configuration and what each change buys, as predicted.
//
//   make_plan(scenario)
//     1. the scenario's own configuration, evaluated as written (SweepRow `original`);
//     2. its precision issues (precision_issues), each with a fix and a one-line reason;
//     3. the candidates: the scenario's `sweep:` axes, or default_search_space() when it has
//        none, with every precision fix applied to every candidate (so the chosen
//        configuration's figures include their cost);
//     4. the chosen row: the first of the ranking (max tokens/s among feasible rows), and
//        the runners-up after it;
//     5. the changes from original to chosen, applied one group of keys at a time
//        (layout, pipelining, memory, communication, precision, other) and simulated after
//        each, so each sentence carries its own predicted effect.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/scenario.h"
#include "sim/sweep/sweep.h"

namespace trainsim {

// ---- precision advice ---------------------------------------------------------------

struct PrecisionIssue {
  // Stable identifiers: "fp16_no_loss_scaling", "fp16_static_loss_scaling",
  // "low_precision_master_weights", "low_precision_grad_accumulation",
  // "allreduce_sum_before_divide", "low_precision_allreduce", "local_overflow_check".
  std::string id;
  std::string problem;  // what is risky here, with the scenario's numbers
  std::string fix;      // the keys to set, e.g. "precision.compute: bf16, precision.loss_scaling.mode: none"
  std::string why;      // one line
  std::vector<std::pair<std::string, FieldValue>> changes;  // what `fix` says, as key paths and values
};

// The numerics risks of a configuration, in a fixed order. BF16 is recommended where the GPU
// has it (cluster.peak_tflops.bf16 > 0); otherwise FP16 with dynamic loss scaling and a
// global overflow check. Whatever the format: FP32 gradient accumulation and all-reduce,
// divided before the sum, and a global overflow check.
std::vector<PrecisionIssue> precision_issues(const ScenarioConfig& config);
// Applies every fix of precision_issues(config); afterwards precision_issues() is empty.
void apply_precision_fixes(ScenarioConfig& config);

// ---- the plan -----------------------------------------------------------------------

struct PlanOptions {
  unsigned threads = 0;         // 0: all cores
  std::size_t runners_up = 5;   // rows shown after the chosen one
  bool fix_precision = true;    // apply the precision fixes to every candidate
  std::function<void(const SweepProgress&)> progress;
};

// One group of changed keys, applied on top of the previous steps and simulated.
struct PlanStep {
  std::vector<std::string> keys;  // dotted paths changed in this step
  std::string change;  // "schedule gpipe -> 1f1b and 4 -> 8 micro-batches per replica"
  std::string effect;  // "bubble 43% -> 9%, activation memory on stage 0 -18.0 GiB, tokens/s 12.1K -> 19.9K (+64.0%)"
  SweepRow before, after;
};

struct PlanResult {
  Scenario scenario;           // as loaded
  bool default_space = false;  // the scenario had no `sweep:`; default_search_space() was searched
  SweepRow original;           // the scenario's own configuration, as written
  std::vector<PrecisionIssue> precision;  // issues of the original configuration
  SweepResult sweep;           // every candidate (with precision fixes when fix_precision)
  std::optional<std::size_t> chosen;      // index into sweep.rows; none when nothing is feasible
  std::vector<std::size_t> runners_up;    // indices into sweep.rows, best first
  std::vector<PlanStep> steps;            // original -> chosen
  // The chosen configuration as a scenario that load_scenario_text accepts (JSON is YAML):
  // model/cluster presets, every key the file wrote, and every key the plan changed.
  nlohmann::ordered_json fragment;
};

// The axes `trainsim plan` searches when the scenario has no `sweep:` section:
// parallelism: auto, training.micro_batch_size: auto (when global_batch_size is set),
// schedule x virtual_pipeline_stages {1, 2}, activation_recompute, zero_stage {0, 1},
// communication.overlap_grad_reduce.
std::vector<SweepAxis> default_search_space(const ScenarioConfig& config);

PlanResult make_plan(const Scenario& scenario, const PlanOptions& options = {});

// See PlanResult::fragment. Sections in the field table's order; `sweep:` and
// `constraints:` are left out, so `trainsim simulate` runs exactly `chosen`.
nlohmann::ordered_json scenario_fragment(const Scenario& original, const ScenarioConfig& chosen);
// The same fragment as block YAML, with a comment header.
std::string scenario_fragment_yaml(const nlohmann::ordered_json& fragment, const std::string& comment);

}  // namespace trainsim
