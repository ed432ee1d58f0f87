// `trainsim plan`: pick the best configuration that fits, and explain in plain words what
// changed against the scenario's own configuration and what each change buys, as predicted.
//
//   make_plan(scenario)
//     1. the scenario's own configuration, evaluated as written (SweepRow `original`);
//     2. its precision issues (precision_issues), each with a fix and a one-line reason;
//     3. the candidates: the scenario's `sweep:` axes, or default_search_space() when it has
//        none, with every precision fix applied to every candidate (so the chosen
//        configuration's figures include their cost);
//     4. only the file's own setup is chosen from: rows whose swept hardware and model keys
//        (is_setup_key) are the file's; the other setups are compared in `setups`, each with
//        its own best configuration;
//     5. the chosen row: the file's configuration (with the precision fixes) when nothing
//        beats it by more than `margin`; otherwise, among the rows within `margin` of the
//        fastest, the one with the simplest layout (layout_complexity), the fastest first;
//        the runners-up after it;
//     6. the changes from original to chosen, applied one group of keys at a time
//        (layout, pipelining, memory, communication, precision, other) and simulated after
//        each, so each sentence carries its own predicted effect;
//     7. when nothing is feasible, what the smallest configuration needs, which limit bound
//        the nearest misses, and what would make it fit (diagnose_infeasible).
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model_error.h"
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

// Expert notes that are not fixes: they are not applied, only said (FP8 and its caveats).
struct PlanNote {
  std::string id;    // "fp8_option", "fp8_caveats"
  std::string text;
};

// ---- when nothing fits ------------------------------------------------------------------

struct Infeasibility {
  std::optional<std::size_t> smallest;   // the simulated row with the smallest peak memory per GPU
  double model_state_bytes_per_param = 0;  // weights + gradients + optimizer states, unsharded
  double model_state_bytes = 0;          // the whole model's, unsharded
  int min_gpus_zero3 = 0;                // GPUs that hold the model states alone, ZeRO-3 over all of them
  std::vector<std::size_t> near_misses;  // simulated infeasible rows, nearest first (at most 5)
  std::vector<std::string> suggestions;  // what would make it fit
};
// What the rows of `sweep` (none feasible) say about the scenario's configuration `config`.
Infeasibility diagnose_infeasible(const SweepResult& sweep, const ScenarioConfig& config);

// ---- the plan -----------------------------------------------------------------------

// A change is recommended only if it gains more than the model's own error: the mean absolute
// error the published-data suite (validation/published, issue 16) holds the shipped presets to,
// kFidelityTargetMeanError (core/model_error.h), so the margin moves with the suite's target.
// The suite measures 2.8% mean over all its rows and 2.5% on the Zero Bubble rows, the throughput
// ratios between two configurations of one model on one cluster: the comparison a plan makes.
// Gains below it are within what the model cannot tell apart. `trainsim plan --margin` changes it.
inline constexpr double kPlanMargin = kFidelityTargetMeanError;

// Layout complexity, lower is simpler: GPUs per model replica (pipeline x tensor x context),
// then the pipeline depth, the schedule (1F1B and GPipe, then interleaved, then ZB-H1), the
// virtual stages and the ZeRO stage.
std::tuple<int, int, int, int, int> layout_complexity(const ScenarioConfig& config);

struct PlanOptions {
  unsigned threads = 0;         // 0: all cores
  std::size_t runners_up = 5;   // rows shown after the chosen one
  bool fix_precision = true;    // apply the precision fixes to every candidate
  double margin = kPlanMargin;  // smallest gain worth a change (a fraction of tokens/s)
  std::function<void(const SweepProgress&)> progress;
};

// One setup of the sweep (a combination of swept hardware or model keys) and its best row.
struct SetupOption {
  std::vector<std::pair<std::string, FieldValue>> values;
  std::optional<std::size_t> best;  // index into sweep.rows
  std::size_t candidates = 0;
  bool own = false;                 // the file's own setup
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
  double margin = kPlanMargin;
  std::optional<std::size_t> fastest;     // the fastest feasible row of the file's own setup
  std::optional<std::size_t> incumbent;   // the file's configuration (with the precision fixes) in sweep.rows
  // Why `chosen` was chosen: "fastest", "kept" (the file's configuration is within the
  // margin of the fastest), "headroom" (the fastest leaves less than kUnmodelledMemoryGib free,
  // this one, within the margin, does) or "simpler" (a simpler layout within the margin of the
  // fastest); the sentence says it with the numbers.
  std::string choice;
  std::string choice_reason;
  std::vector<std::string> setup_keys;    // swept setup keys (is_setup_key); empty: no comparison
  std::vector<SetupOption> setups;        // one per setup, the file's own first
  std::vector<PlanNote> notes;            // FP8 option and caveats
  std::optional<Infeasibility> infeasible;  // when nothing is feasible
  std::vector<PlanStep> steps;            // original -> chosen
  // The chosen configuration as a scenario that load_scenario_text accepts (JSON is YAML):
  // model/cluster presets, every key the file wrote, and every key the plan changed.
  nlohmann::ordered_json fragment;
};

// The axes `trainsim plan` searches when the scenario has no `sweep:` section:
// parallelism: auto, training.micro_batch_size: auto (when global_batch_size is set),
// schedule x virtual_pipeline_stages: auto, activation_recompute, zero_stage {0, 1, 2, 3},
// sequence_parallel, communication.overlap_grad_reduce, and for sequences of kLongContextTokens
// or more context_parallel_size {1, 2, 4, 8}, and beyond 8 the powers of two that leave each GPU
// kContextTokensPerGpu tokens or more. Hardware and model are not searched.
// From this length NeMo's long-context recipes split sequences (`llama3_8b_16k`: TP 4 x CP 2).
inline constexpr int kLongContextTokens = 16384;
// Llama 3 split its 131,072-token sequences over 16 GPUs, 8,192 a GPU (Dubey et al. 2024, Table 4).
inline constexpr int kContextTokensPerGpu = 8192;
std::vector<SweepAxis> default_search_space(const ScenarioConfig& config);
// How many of the fastest feasible full-recompute candidates make_plan tries with fewer layers
// recomputed (training.recompute_num_layers: the fewest of each chunk's first layers that still
// fit, found by bisection; memory falls as layers are recomputed).
inline constexpr std::size_t kRecomputeRefinements = 8;
// Folds the default space's meaningless combinations into one (applied to every candidate,
// so duplicates are dropped): one schedule without a pipeline, virtual stages only with the
// interleaved schedule, sequence parallelism only with tensor parallelism, ZeRO and overlap
// only with data parallelism, ZeRO-2/3 only where the framework allows them, and the selective
// recompute the framework has (Megatron-LM's selective, FSDP's selective_op).
void normalize_default_candidate(ScenarioConfig& config);

PlanResult make_plan(const Scenario& scenario, const PlanOptions& options = {});

// See PlanResult::fragment. Sections in the field table's order; `sweep:` and
// `constraints:` are left out, so `trainsim simulate` runs exactly `chosen`; an uneven layer
// split the plan derived is written out as parallelism.layers_per_stage.
nlohmann::ordered_json scenario_fragment(const Scenario& original, const ScenarioConfig& chosen);
// The same fragment as block YAML, with a comment header.
std::string scenario_fragment_yaml(const nlohmann::ordered_json& fragment, const std::string& comment);

}  // namespace trainsim
