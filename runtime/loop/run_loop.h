// The run loop: `trainsim run` on any backend, written once (DESIGN.md "Runtime"). It owns the
// run: the data, resuming from a checkpoint, the steps, the numerics log, the loss watch, the
// replica checksums, the checkpoints, and the measured result (the median step's Timeline through
// the simulator's own compute_result). A device engine (runtime/engine/device_engine.h), built
// from the backend's record (runtime/backend.h), runs each step of the schedule.
//
//   run(backend, plan, options)
//     data   = open_run_data(plan, options)
//     engine = backend.engine(plan, data, options)
//     if resuming: engine.restore(load_checkpoint(...))
//     for step in first..steps:
//       ranks    = engine.run_step(step, data position)        per-rank timings and numerics
//       timeline = measured_timeline(schedule, cell_steps(world, ranks))
//       record   = step_record(step, ranks) + replica checksums and drift
//       failure  = a rank's error, or loss_watch.check(record)
//       if checkpoint_due: save_checkpoint(engine.save())
//     if the numerics ended it before it timed options.timed_steps_at_least steps:
//       replay its steps from the state before the first (engine.restore), for their timing
//     result = compute_result(plan, timeline of the median step, engine.memory_peaks())
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/timeline.h"
#include "runtime/backend.h"
#include "runtime/contract.h"
#include "runtime/data/dataset.h"
#include "runtime/engine/device_engine.h"

namespace trainsim::runtime {

// Runs the plan on `backend`. Throws ScenarioError/std::runtime_error for bad setup (data, a
// checkpoint to resume from, a backend this build cannot use), std::invalid_argument for a plan the
// backend cannot run; a run that goes numerically wrong, or whose rank fails, returns with
// `failure` set.
RunReport run(const Backend& backend, const RuntimePlan& plan, const RunOptions& options);

// The pieces of the loop, for its tests.

// The run's tokens: synthetic, the file options.data_path names, or the bundled corpus; `source`
// says which, in words.
Dataset open_run_data(const RuntimePlan& rp, const RunOptions& options, std::string& source);

// The measured Timeline of one step from every schedule rank's op timings and, for collectives,
// when each rank reached them: a collective starts when its last member reaches it (as the
// simulator defines it). A collective run in parts that each wait for room (RankStep::parts:
// ZeRO-3's gathers unit by unit) waited, on each member, until its last member had room for
// each part (OpTiming::waited: the passes' pace, not communication).
Timeline measured_timeline(std::shared_ptr<const Schedule> schedule, const std::vector<RankStep>& ranks);

// The schedule ranks' steps (timings and arrivals) from the world's, by rank: a schedule rank
// stands for its shards (tensor- and context-parallel), so its op runs from when its last shard
// starts it to when its last shard ends it (each shard starts an op after its own previous one
// ended, so the cell's ops stay in order and never overlap), and it reaches a collective when its
// last shard does. With one shard a cell, the ranks' own.
std::vector<RankStep> cell_steps(const World& world, const std::vector<RankStep>& ranks);

// The step's record from every rank's, by rank: the mean loss, counts, rank 0's norm, scale and
// verdict. Replica checksums and drift are the loop's. *first_nonfinite: where inf/NaN appeared
// first in time this step, or "".
StepRecord step_record(int step, double seconds, const std::vector<RankStep>& ranks, std::string* first_nonfinite);

// Ends a run that went numerically wrong: loss not finite, or more than 3x the first step's
// after two steps. The failure says where inf/NaN first appeared in the run (step_record's
// first_nonfinite, passed every step; the earliest is kept).
class LossWatch {
 public:
  std::optional<RunFailure> check(const StepRecord& rec, int first_step, const std::string& step_first_nonfinite);

 private:
  double first_loss_ = -1;
  bool have_first_ = false;
  std::string first_trouble_;
};

// A checkpoint is written after `step` of `steps` when options ask for them every N steps: at
// every multiple of N and at the last step.
bool checkpoint_due(const RunOptions& options, int step, int steps);

// The step a report describes: the median by time, leaving out the first (warm-up: first
// touches of memory) when there are others; where the engine measured what the host took from
// the ranks' cores (StepRecord::foreign_seconds) on every step and there are at least
// kLeastDisturbedFrom of them, the median of the half it took the smallest share of the step from.
// A step in which another process, a kernel thread or the hypervisor held a rank's core is the
// machine's noise, not the plan's (on the 2-vCPU guest of docs/validation.md a kernel thread ran
// up to 50 ms at a time), and the prediction is of the plan on the machine as calibrated.
// `steps` in the order they ran, replays included (steps_as_run): each replay's first step is
// left out as the run's is. Index into `steps`; -1 when empty.
inline constexpr std::size_t kLeastDisturbedFrom = 4;
int median_step_index(const std::vector<StepRecord>& steps);
// The indices into `steps` of the timed steps: all but the run's first step (and its replays')
// when there are others.
std::vector<int> timed_step_indices(const std::vector<StepRecord>& steps);
// Whether median_step_index chose among the steps the host took least from (every timed step
// measured, at least kLeastDisturbedFrom of them).
bool chosen_by_host_share(const std::vector<StepRecord>& steps);

// Every step the loop ran, in order: the run's own, then its replays'.
std::vector<StepRecord> steps_as_run(const RunReport& report);
// The index into steps_as_run(report) of the step the report describes (timeline_step of
// timeline_replay), or -1.
int reported_step_index(const RunReport& report);
// That step's record, or nullptr.
const StepRecord* reported_step(const RunReport& report);

}  // namespace trainsim::runtime
