// The sweep engine behind `trainsim sweep` and `trainsim plan`.
//
//   Scenario (with `sweep:` axes and optional `constraints:`)
//     --expand_sweep-->  configurations (cartesian product of the axes, in file order,
//                        generated axes last), each a complete ScenarioConfig
//     --run_sweep----->  one SweepRow per configuration: Plan::from_config, then a full
//                        discrete-event simulation (Predictor), then the verdict
//                        (ok | out_of_memory | invalid | unsupported_precision | constraint)
//     --ranking------->  feasible rows by tokens/s, the Pareto front of throughput against
//                        peak memory per GPU
//
// Configurations are evaluated on std::thread workers (on the calling thread when there is
// one worker), a few consecutive ones at a time, one Predictor per thread; results are
// stored by expansion index and every ordering is a total order on (metrics, index), so the
// result is identical whatever the thread count.
//
// Axes (Scenario::sweep, core/scenario.h):
//   - `a.b.c: [v1, v2, ...]`          any row of the field table, values as listed;
//   - `parallelism: auto`             every (data, pipeline, tensor) with d * p * t = num_gpus,
//                                     t dividing num_attention_heads (and num_query_groups) and
//                                     at most gpus_per_node, p at most num_layers. Sizes that
//                                     break another invariant (e.g. d not dividing
//                                     global_batch_size / micro_batch_size) are kept as
//                                     `invalid` rows with the reason;
//   - `training.micro_batch_size: auto`  every divisor of global_batch_size / data_parallel_size
//                                     (per configuration, after parallelism is set).
// Micro-batches per replica always follow from the global batch (Plan::num_microbatches).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/config_fields.h"
#include "core/scenario.h"

namespace trainsim {

class Predictor;

// ---- configurations ---------------------------------------------------------------------

// One point of the sweep before it is evaluated.
struct SweepConfiguration {
  std::size_t index = 0;  // position in expansion order (stable: the file's axis order)
  ScenarioConfig config;  // the scenario's configuration with this point's values applied
  // The swept keys and their values at this point, in sweep_keys() order; `parallelism:
  // auto` contributes parallelism.data_parallel_size, .pipeline_parallel_size and
  // .tensor_parallel_size, `training.micro_batch_size: auto` training.micro_batch_size.
  std::vector<std::pair<std::string, FieldValue>> values;
  // Non-empty when applying a value failed (a field setter refused it): the row is invalid.
  std::string error;
};

// (data, pipeline, tensor) sizes of one factorisation of the GPU count.
struct ParallelLayout {
  int dp = 1, pp = 1, tp = 1;
  friend bool operator==(const ParallelLayout&, const ParallelLayout&) = default;
};

// Every layout `parallelism: auto` generates for this model and cluster, ordered by
// (tp, pp) ascending. Empty when num_gpus < 1.
std::vector<ParallelLayout> auto_parallel_layouts(const ScenarioConfig& config);
// The virtual stages `parallelism.virtual_pipeline_stages: auto` generates for a configuration:
// under interleaved-1f1b with a pipeline, every v >= 2 that cuts a stage's layers into equal
// chunks (the divisors of num_layers / pipeline_parallel_size, as Megatron-LM requires: 80 layers
// on 8 stages give 2, 5 and 10), or, where the stages cannot hold equal layers, of that count
// rounded up (the uneven split default_layers_per_virtual_stage makes: 126 layers on 16 stages
// give 2, 4 and 8). Otherwise the configuration's own value alone.
std::vector<std::int64_t> interleaving_depths(const ScenarioConfig& config);
// The positive divisors of n in ascending order (empty for n < 1).
std::vector<std::int64_t> divisors(std::int64_t n);

// The keys (dotted paths) a sweep of `scenario` reports per configuration, in column order
// (the file's axis order).
std::vector<std::string> sweep_keys(const Scenario& scenario);

// Every configuration of the sweep, in expansion order. `adjust`, when given, is applied
// to each configuration after the axes (plan uses it to apply its precision fixes); the
// reported values are then read back from the adjusted configuration. Configurations that
// end up identical in every field are kept once (the first in expansion order).
// A scenario without axes expands to its own configuration alone.
std::vector<SweepConfiguration> expand_sweep(const Scenario& scenario,
                                             const std::function<void(ScenarioConfig&)>& adjust = {});

// ---- evaluation -------------------------------------------------------------------------

enum class SweepStatus {
  ok,                     // valid, fits, meets every constraint: ranked
  out_of_memory,          // simulated; some GPU's peak exceeds cluster.memory_gib
  invalid,                // Plan::from_config refused it (the invariant, with its numbers)
  unsupported_precision,  // a format the GPU lacks (cluster.peak_tflops.<format> is 0)
  constraint,             // simulated; violates a `constraints:` entry
};
std::string_view sweep_status_name(SweepStatus s);  // "ok", "out_of_memory", ...

// Per pipeline stage, the largest figure over its replicas (bytes, per GPU).
struct StageMemory {
  int stage = 0;
  double peak_bytes = 0;
  double activation_bytes = 0;  // activations held at that rank's peak
};

// The predicted figures of one simulated configuration (per GPU where it says so).
struct SweepMetrics {
  double step_time_s = 0;
  double tokens_per_s = 0;
  double mfu = 0;
  double tokens_per_s_per_gpu = 0, model_tflops_per_gpu = 0, hardware_tflops_per_gpu = 0;
  double time_to_train_s = -1, gpu_hours = -1, cost = -1;  // < 0: not given (Result)
  double bubble_fraction = 0;           // idle: pipeline_bubble_fraction + exposed_comm_fraction
  double pipeline_bubble_fraction = 0;  // idle waiting for pipeline peers
  double exposed_comm_fraction = 0;     // idle waiting for collectives
  double allreduce_time_s = 0;
  double exposed_comm_time_s = 0;
  double peak_memory_bytes = 0;      // max over GPUs
  int peak_memory_rank = 0;          // the schedule rank holding that peak
  double memory_capacity_bytes = 0;  // cluster.memory_gib
  double headroom_bytes() const { return memory_capacity_bytes - peak_memory_bytes; }
  std::vector<StageMemory> stages;   // pipeline order
};

struct SweepRow {
  SweepRow() = default;
  // A row that holds its configuration and nothing else yet.
  explicit SweepRow(SweepConfiguration p) : point(std::move(p)) {}

  SweepConfiguration point;
  SweepStatus status = SweepStatus::invalid;
  // Empty for ok rows. Otherwise why it cannot run, with the numbers, e.g.
  //   "out of memory on rank 3 (stage 1, replica 1) by 4.21 GiB: needs 44.21 of 40.00 GiB"
  //   "training.global_batch_size: global_batch_size(16) is not divisible by
  //    micro_batch_size(2) * data_parallel_size(16) = 32"
  //   "precision.compute: bf16 is not supported by GPU v100-32gb (cluster.peak_tflops.bf16 is 0); ..."
  //   "max_pipeline_parallel_size: pipeline_parallel_size(8) > 4"
  // Several reasons are joined with "; ".
  std::string reason;
  bool simulated = false;  // metrics hold a prediction (ok, out_of_memory, constraint)
  SweepMetrics metrics;
  int num_microbatches = 0;   // per replica per step (0 when invalid)
  int global_batch_size = 0;  // samples per step (0 when invalid)
  std::vector<std::string> warnings;  // the prediction's warnings (numerics, memory, comm)
  // Simulated infeasible rows: the limit that bound it ("memory" or a constraints: key) and
  // by how much it is exceeded, relative to the limit (0.05: 5% over); 0 and "" otherwise.
  std::string binding;
  double shortfall = 0;
  bool feasible() const { return status == SweepStatus::ok; }
};

// Evaluates one configuration: checks precision support and invariants, simulates, checks
// memory and constraints. Never throws for a bad configuration (it becomes the row's status).
SweepRow evaluate_configuration(Predictor& predictor, const SweepConfiguration& point,
                                const SweepConstraints& constraints);
// The same, the row taking `point` over instead of a copy of it.
SweepRow evaluate_configuration(Predictor& predictor, SweepConfiguration&& point, const SweepConstraints& constraints);
// Rows that hold their configuration and nothing else (SweepRow(point)), evaluated in
// place: rows[i] becomes evaluate_configuration(predictor, rows[i].point, constraints), the
// simulated ones Predictor::kMaxBatch at a time (Predictor::evaluate_batch).
void evaluate_rows(Predictor& predictor, SweepRow* rows, std::size_t n, const SweepConstraints& constraints);

// ---- running a whole sweep --------------------------------------------------------------

struct SweepProgress {
  std::size_t done = 0, total = 0;
  double elapsed_s = 0;
};

struct SweepOptions {
  unsigned threads = 0;  // 0: one per core this process may run on (its CPU affinity)
  // Called on the calling thread about every 100 ms while workers run, and once at the end
  // (done == total).
  std::function<void(const SweepProgress&)> progress;
  // See expand_sweep.
  std::function<void(ScenarioConfig&)> adjust;
};

struct SweepCounts {
  std::size_t total = 0, ok = 0, out_of_memory = 0, invalid = 0, unsupported_precision = 0, constraint = 0;
};

// What the sweep cost (`trainsim sweep --stats`). An evaluation is a row that was simulated
// (ok, out_of_memory, constraint); a row refused before simulation (invalid,
// unsupported_precision) is not one.
struct SweepStats {
  std::size_t evaluations = 0;  // rows simulated
  std::size_t rejected = 0;     // rows refused before (or by a failure of) the simulation
  unsigned threads = 0;         // workers that evaluated them
  double expand_s = 0;          // expand_sweep, wall-clock (run_sweep only)
  double evaluate_wall_s = 0;   // evaluating every row, wall-clock
  double evaluate_cpu_s = 0;    // the same in CPU time of the whole process (every thread)
  // Evaluations per CPU second: per core, whatever the thread count.
  double evaluations_per_cpu_s() const { return evaluate_cpu_s > 0 ? evaluations / evaluate_cpu_s : 0; }
};

// "2016 configurations: 2016 evaluated, 0 rejected before simulation; evaluation 0.050 s CPU
// (0.051 s wall, 1 thread): 40,300 evaluations per CPU-second; expansion 0.012 s", one line.
std::string format_sweep_stats(const SweepStats& stats, std::size_t configurations);

struct SweepResult {
  std::vector<std::string> keys;  // sweep_keys(): the columns of every row's point.values
  std::vector<SweepRow> rows;     // in expansion order (rows[i].point.index == i)
  // Feasible rows, best first: tokens/s descending, then peak memory ascending, then index.
  std::vector<std::size_t> ranking;
  // Every row in report order: `ranking`, then simulated infeasible rows (nearest misses
  // first: shortfall ascending, then tokens/s descending, then index), then rows that were
  // not simulated (index order).
  std::vector<std::size_t> order;
  // Feasible rows on the Pareto front of (tokens/s up, peak memory per GPU down), by
  // peak memory ascending, then index.
  std::vector<std::size_t> pareto;
  SweepCounts counts;
  SweepStats stats;
  const SweepRow* best() const { return ranking.empty() ? nullptr : &rows[ranking.front()]; }
};

// Expands and evaluates every configuration on `options.threads` workers.
SweepResult run_sweep(const Scenario& scenario, const SweepOptions& options = {});

// Recomputes counts, ranking, order and Pareto front from `rows` (after rows were added).
void rank_rows(SweepResult& result);

// Every field's value as one string: equal strings mean equal configurations.
std::string config_fingerprint(const ScenarioConfig& config);

// Keys that describe the question rather than a choice to make: the hardware (cluster.*)
// and the model (model.*). `plan` never changes them; swept, they become a comparison.
bool is_setup_key(const std::string& path);

// The rows of one setup: one combination of the swept setup keys' values (the hardware or
// model under comparison), in the order the sweep first meets them.
struct SetupGroup {
  std::vector<std::pair<std::string, FieldValue>> values;  // the swept setup keys, sweep_keys() order
  std::vector<std::size_t> rows;                           // indices into SweepResult::rows
  std::optional<std::size_t> best;                         // its fastest feasible row
};
// One group per distinct setup; a single group with no values when no setup key is swept.
std::vector<SetupGroup> setup_groups(const SweepResult& result);

// Evaluates given configurations (indices are renumbered 0..n-1 in the given order).
SweepResult run_configurations(std::vector<SweepConfiguration> points, const SweepConstraints& constraints,
                               std::vector<std::string> keys, const SweepOptions& options = {});

// Indices of the rows that no other feasible row dominates (another has tokens/s >= and
// peak memory <=, one of them strictly). Sorted by peak memory ascending, then index.
// Only feasible rows take part.
std::vector<std::size_t> pareto_front(const std::vector<SweepRow>& rows);

}  // namespace trainsim
