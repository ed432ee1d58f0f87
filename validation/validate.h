// `trainsim validate`: predict a scenario's runtime plan with a calibrated hardware profile,
// run the same plan on the backend, and put the two side by side (DESIGN.md "Validation").
//
// The prediction sees only the profile and the schedule, never the run's measurements. Without
// a profile given, the kernels are calibrated in round-robin passes before the run and
// between its steps (outside the measured steps), so that rates and run come from the same
// stretch of time on a machine whose speed wanders (shared hosts do, by tens of percent over
// seconds); `machine_drift`, the change of the passes' time during the run against before
// it, says how much the machine moved.
//
// Errors: relative ((predicted - measured) / measured) for times and memory, absolute
// (predicted - measured) for fractions (bubble, utilization).
#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/hardware_profile.h"
#include "core/scenario.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/backend.h"
#include "runtime/contract.h"
#include "sim/simulator.h"

namespace trainsim::validation {

// The backend that runs the plan and, without a profile, calibrates it at the plan's shapes: a
// record of the registry (runtime/backend.h). A backend whose machine's speed wanders (the CPU's:
// Backend::calibrate_between_steps) has its kernels calibrated between the run's steps (above);
// the others (the CUDA backend's: a GPU's speed does not wander with a shared host's neighbours)
// calibrate before the run.
struct ValidationBackend {
  ValidationBackend() : ValidationBackend(runtime::cpu_backend()) {}
  explicit ValidationBackend(const runtime::Backend& backend) : name(backend.name), record(&backend) {}

  std::string name;  // as reports say "measured on the <name> backend" (backend_title)
  const runtime::Backend* record;
  runtime::Placement placement;  // where the record's run and calibration place the plan's ranks
  // Stand-ins for the record's calibration (before the run) and run, for a backend outside the
  // registry (tests). When either is set the record is not used to calibrate: without
  // `calibrate`, a profile must be given.
  std::function<HardwareProfile(const runtime::RuntimePlan&, const runtime::CalibrateOptions&)> calibrate;
  std::function<runtime::RunReport(const runtime::RuntimePlan&, const runtime::RunOptions&)> run;
};

struct ValidateOptions {
  ValidationBackend backend;
  std::string profile_path;  // empty: calibrate now, at the plan's shapes
  int steps = 0;             // 0: the scenario's runtime.steps
  bool synthetic_data = false;
  std::string data_path;     // resolved by the caller; empty: the bundled corpus
  runtime::CalibrateOptions calibrate;
  int passes_between_steps = 2;  // kernel calibration passes run between the run's steps
  // Timed calls of each communication benchmark row run between the run's steps (0: none; the
  // rows then come from the calibration before the run).
  int comm_calls_between_steps = 4;
  // The most seconds those reruns may take in one validation: on a host whose last-level cache is
  // reported large (300 MiB on an Intel VM of the tenth session) each call's eviction takes tens of
  // milliseconds; steps after the budget is spent have none, and a window without any keeps the
  // rows from before the run. About 1.5 s for a baseline plan on a 32 MiB cache.
  double comm_rerun_budget_s = 4;
  // Kernel calibration passes before the run: the reference `machine_drift` is measured against
  // (ranks that share cores by turns: as many as calibrate runs, for the order of their turns).
  int passes_before_run = 8;
  std::function<void(const std::string&)> progress;
};

// What the run's numerics came to (DESIGN.md's `steps`, summarised).
struct NumericsSummary {
  bool stable = true;         // every step finite, none skipped, loss not diverged
  int steps = 0;
  int skipped_steps = 0;      // steps rank 0 skipped
  int split_skips = 0;        // steps some ranks skipped and others applied (a local overflow check)
  int unguarded_steps = 0;    // steps with inf/NaN that some rank applied anyway (the check missed them)
  int first_nan_step = 0;     // 0: none
  std::string first_nan_where;  // "stage 3 replica 0: block 7 mlp.fc output (forward, micro-batch 2)"
  double final_loss_scale = 1;
  double max_replica_drift = 0;
  double first_loss = 0, last_loss = 0;
  std::string failure;        // the run's failure message, if it ended early
};

struct Validation {
  runtime::RuntimePlan plan;  // the executed plan, with the profile applied for prediction
  HardwareProfile profile;
  Prediction predicted;
  runtime::RunReport measured;
  NumericsSummary numerics;
  std::string backend = "cpu";  // the backend that ran it
  bool oversubscribed = false;  // more ranks than cores: ops take the cores in turns (core_sharing.h)
  bool drift_measured = false;  // calibration passes ran between the steps (the CPU backend, no profile given)
  double machine_drift = 0;   // calibration passes during the run against before it, - 1 (0 when not measured)
  // Ranks on cores of their own: each one's blocks' time per block in the measured step against
  // the ranks' mean, which the prediction's core factors took (validate.cpp,
  // core_factors_in_step). Empty: not applied.
  std::vector<double> core_factors_in_step;
  // The measured all-reduce time the prediction is held against: the median of allreduce_time_s
  // over the timed steps within kStepWindowSteps of the reported one, the steps whose surrounding
  // calibration priced it (one step's ~30 us embedding sum or 1 MiB buckets move 2-3x from step
  // to step on a shared host). The reported step's own figure stays in `measured.result`.
  double allreduce_window_s = 0;
};

// Calibrates (or loads the profile), predicts, runs, compares. Throws ScenarioError for a
// scenario the runtime cannot execute.
Validation validate(const Scenario& scenario, const ValidateOptions& options);

// The errors, as DESIGN.md names the fields: step_time_s, bubble_fraction, allreduce_time_s
// (relative or absolute as above; the all-reduce's measured figure Validation::allreduce_window_s),
// and per rank utilization and peak_memory.
struct MetricError {
  std::string metric;  // "step_time_s", "bubble_fraction", "rank 1 utilization", ...
  double predicted = 0, measured = 0, error = 0;
  bool relative = true;
};
std::vector<MetricError> errors_of(const Validation& v);
double peak_memory_error(const Validation& v);  // largest relative error of any rank's peak

// Where the step's time went, predicted against measured: per rank, the summed duration of each
// kind of op of the reported step (op_label without its numbers: "F", "B", "AR b", "AG w rest",
// "recv grad" (the time blocked on it), ...; a chunk's first forward of the step apart as
// "F first"), each op less what it waited inside (OpTiming::waited: a collective for its peers'
// room, a compute op for its turn at a shared core or, under ZeRO-3, for its units), the waits
// summed apart. In the order the kinds first appear in the rank's program. Ranks whose two
// programs differ are left out.
struct OpKindTime {
  int rank = 0;
  std::string kind;
  int count = 0;
  double predicted_s = 0, measured_s = 0;
  double predicted_waited_s = 0, measured_waited_s = 0;
};
std::vector<OpKindTime> time_by_op_kind(const Validation& v);
std::string format_time_by_op_kind(const std::vector<OpKindTime>& rows);

std::string format_validation(const Validation& v);
// {"predicted": <result>, "measured": <result + steps>, "error": {...}, "numerics": {...}, ...}
nlohmann::ordered_json validation_to_json(const Validation& v);
// Both timelines in one Perfetto trace: predicted ranks first, then measured ones.
void write_validation_trace(const Validation& v, std::ostream& out);
// The predicted timeline above the measured one, on one time axis.
void write_validation_svg(const Validation& v, std::ostream& out);

// The rows the communication benchmark measures for `plan`: the prediction reads a table only
// between the two rows around a size (SizeTable::seconds), so only the powers of two around the
// plan's own messages and collectives are run, not the whole doubling series (on the CPU each
// all-reduce row costs a cache eviction per call: a series of 20 sizes made up two thirds of a
// pipeline baseline's validation). Around each buffer of the schedule (a collective's bytes per
// call, a message's bytes): every power of two from half to four times it, the range the cost
// models scale it over (NetworkCollectiveModel and LinkP2PModel: a runtime that emulates 16- and
// 8-bit formats moves 4-byte floats, and its tables count the wire format's bytes). All-reduces
// also get the 8-byte row: the optimizer's norm and the overflow flag are one float each, and a
// size below the first row reads that row. Tensor-parallel plans also get the rows around
// their layers' collectives, which are priced apart from the schedule (tensor_parallel_buffers).
// Each collective is measured as itself: ZeRO's gathers and scatters and sequence parallelism's
// in `all_gather` and `reduce_scatter` (their own tables price them), the rest in `all_reduce`.
// `sendrecv` is empty when the plan sends nothing.
struct CommunicationSizes {
  std::vector<std::size_t> sendrecv, all_reduce, all_gather, reduce_scatter;  // bytes, ascending
};
CommunicationSizes communication_sizes(const Plan& plan);

// The calibration passes around the step a run reports (its median), as [first, end): those run
// between the steps `steps_each_side` before and after it (clamped to the run), where
// `passes_after_step[i]` is how many passes were done when the run's i-th step ended and each step
// was followed by `passes_between_steps`. Before the first step: the last `passes_between_steps` of
// the calibration before the run. nullopt when the reported step is not among them.
std::optional<std::pair<int, int>> passes_around_step(const runtime::RunReport& run,
                                                      const std::vector<int>& passes_after_step,
                                                      int passes_between_steps, int steps_each_side);
// The same window in steps: [first, last] of the run's steps (replays included, in order) whose
// following calibration ran around the reported step, of the first `steps_recorded`; first is -1
// where the window begins before the run. nullopt when the reported step is not among them.
std::optional<std::pair<int, int>> steps_around_step(const runtime::RunReport& run, int steps_recorded,
                                                     int steps_each_side);
// The median of allreduce_time_s over the run's timed steps (steps_as_run, replays included)
// within `steps_each_side` of the reported one: Validation::allreduce_window_s. The reported
// step's own figure where none is timed.
double allreduce_around_step(const runtime::RunReport& run, int steps_each_side);

// Where ranks share cores, the share of the optimizer step's priced time (the calibrated
// runtime_optimizer_kernels of a rank's shard) that comes before its gradient norm's all-reduce:
// the ZeRO-1 shard taken from the flat gradients, their unscaling under loss scaling, the
// squared norm. The replay of shared cores splits the step there (validation/core_sharing.h).
double optimizer_norm_share(const Plan& plan, const HardwareProfile& profile);

NumericsSummary summarize_numerics(const runtime::RunReport& r);
// "CPU", "CUDA": a backend's name as a sentence says it (its record's title; a name the registry
// does not know, as it is).
std::string backend_title(const std::string& backend);
// One line: steps, loss, skips, where inf/NaN first appeared, drift, final scale, verdict.
std::string describe_numerics(const NumericsSummary& n);

}  // namespace trainsim::validation
