// What a run promises, whatever runs it (DESIGN.md "Runtime"): the options a run takes, the
// report it returns, the per-step numerics log, why a run ended early, and the fingerprint a
// checkpoint carries. The run loop (runtime/loop/run_loop.h) fills these from any device engine
// (runtime/engine/device_engine.h); calibration, validation, the CLI and the reports read them.
// Nothing here names a backend.
//
// Numerics follow the plan's precision settings (runtime/model/stage_model.h for the model), on
// every engine:
//  * the last stage seeds backward with loss_scale / micro-batches, so summed micro-batch
//    gradients are the scaled mean; replicas all-reduce in precision.allreduce, dividing by
//    data_parallel_size before or after the sum; tied embeddings are summed between the
//    first and last stage;
//  * overflow check `global`: after the reductions, every rank's found-inf flag is
//    max-reduced over all ranks, so all skip together. `local`: each rank decides from the
//    gradients it computed itself, before any reduction, and asks no one: stages and
//    replicas can skip different steps, and a rank that does not skip applies whatever
//    the reduction brought it;
//  * the optimizer step unscales in FP32, computes the global gradient norm (a sum over all
//    ranks of their stage's squares, once per replica; a tied embedding's copy counted
//    once), clips to training.clip_grad, updates the FP32 master weights (rounded to
//    precision.master_weights) and refreshes the working copy.
#pragma once

#include <chrono>
#include <compare>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/result.h"
#include "core/timeline.h"
#include "runtime/launch/launch_env.h"
#include "runtime/runtime_plan.h"

namespace trainsim::runtime {

// How ranks share the SMs of one GPU (an engine that puts several ranks on one device reads it).
enum class SmSharing {
  automatic,       // green contexts where the driver and the device allow them, else shared
  green_contexts,  // green contexts or an exception saying why not
  shared,          // ordinary streams of the primary context; every rank may use every SM
};

// Where an engine puts the plan's ranks. Engines read what applies to them: the CPU engine puts
// every rank on a thread of this process and reads none of it.
struct Placement {
  SmSharing sm_sharing = SmSharing::automatic;  // every rank on one device
  std::optional<LaunchEnv> launch;              // set: one process per device, this process one rank
  int device = 0;                               // every rank on one device: which
};

// What one rank saw in one step.
struct RankStepNumerics {
  int rank = 0, stage = 0, replica = 0;
  int shard = 0;  // its tensor-parallel coordinate (runtime/engine/world.h)
  double max_abs_activation = 0, max_abs_gradient = 0;
  std::int64_t nonfinite_count = 0;  // inf/NaN values among its activations and gradients
  bool found_nonfinite = false;      // its overflow verdict (after the global reduction, if global)
  bool skipped = false;
  double loss_scale = 1;             // the scale this step ran with
  std::string first_nonfinite;       // the first tensor that held inf/NaN, or ""
};

// DESIGN.md's per-step numerics (`steps`), plus the detail behind them.
struct StepRecord {
  int step = 0;               // 1-based optimizer step
  double loss = 0;            // mean cross-entropy over the global batch
  double grad_norm = 0;       // global L2 norm of the unscaled gradients (before clipping)
  double loss_scale = 1;      // rank 0's scale for this step
  bool skipped = false;       // rank 0 skipped its update
  int skipped_ranks = 0;      // ranks that skipped (all or none under a global check)
  std::int64_t nonfinite_count = 0;
  double replica_drift = 0;   // max |w(replica d) - w(replica 0)| over all weights after the step
  std::vector<std::uint64_t> replica_checksums;  // of each replica's master weights, bitwise
  double step_time_s = 0;
  // Its timeline's allreduce_time_s (DESIGN.md's result field, the most collective time of one
  // rank): the reported step's is the result's; the others say how much it moves step to step.
  double allreduce_time_s = 0;
  // The most seconds the host gave one rank's core to other work while that rank computed
  // (RankStep::foreign_seconds); -1 where the engine does not measure it.
  double foreign_seconds = -1;
  std::vector<RankStepNumerics> ranks;
  // 0: the run's own step; k: the same step run again in the run's k-th replay, for its timing
  // only (RunOptions::timed_steps_at_least).
  int replay = 0;
};

// Why a run ended early, and where it went wrong.
struct RunFailure {
  int step = 0;
  std::string message;  // "loss became NaN at step 7; first non-finite: stage 3 replica 0 ..."
};

// A compute op's turn at a core, where ranks share cores (the CPU engine with more ranks than cores):
// the rank, the op's index in its program, and the part (0; the optimizer step's update after its
// gradient-norm all-reduce is part 1).
struct CoreTurn {
  int rank = 0, op = 0, part = 0;
  auto operator<=>(const CoreTurn&) const = default;
};

// A fault a run injects on purpose, for the failure-path tests and demonstrations (the engines
// that run rank threads, CPU and CUDA, honour it; runtime/engine/rank_threads.h): at step `step`,
// rank `rank` raises instead of running its first compute op (raise), or reaches its first
// collective `stall` late, as a rank stuck before a collective would (stall: its peers time out).
struct InjectedFault {
  enum class Kind { raise, stall };
  int rank = -1;  // none
  int step = 0;
  Kind kind = Kind::raise;
  std::chrono::milliseconds stall{0};
  // This fault if it names `rank` at `step`, else none (what an engine hands a rank's walk).
  const InjectedFault* at(int at_step, int at_rank) const {
    return rank == at_rank && step == at_step ? this : nullptr;
  }
};

struct RunOptions {
  int steps = 0;                      // 0: the scenario's runtime.steps
  std::string data_path;              // empty: the scenario's (resolved by the caller) or the bundled corpus
  bool synthetic_data = false;
  std::string checkpoint_dir;         // empty: no checkpoints
  int checkpoint_every_steps = 0;
  std::string resume_from;            // a checkpoint file or folder; empty: fresh start
  bool pin_threads = true;            // pin rank r's compute thread to core r when ranks <= cores
  std::chrono::milliseconds comm_timeout{std::chrono::seconds(120)};
  Placement placement;                // devices and processes, for engines that have them
  // Where ranks share cores: the order their compute ops take cores in, every step (every compute
  // op of every rank once, and the optimizer's part 1). Empty: first come, first served.
  std::vector<CoreTurn> core_turns;
  std::function<void(const StepRecord&)> on_step;  // progress, called after every step (replays' too)
  // A run whose numerics end it (a NaN loss) before it has timed this many steps replays its steps
  // from the start until it has: the engine restored to its state before the first step, the same
  // data, so the same numerics (a replay whose losses differ is dropped). The reported step is then
  // the median over the run's timed steps and their replays'. validate asks for
  // kLeastDisturbedFrom: the incident's FP16 run ends at step 2, one timed step, which the host's
  // noise alone moved by -19% to +2% against its prediction. 0: no replays.
  std::size_t timed_steps_at_least = 0;
  InjectedFault fault;                // none by default
};

// A rank as the engine ran it: its coordinates in the plan's grid (runtime/engine/world.h) and
// the schedule rank (stage * dp + replica) whose program it ran, with its accounted memory peak.
struct ExecutedRank {
  int rank = 0, dp = 0, pp = 0, tp = 0, cp = 0;
  int schedule_rank = 0;
  MemoryBreakdown memory;
};

struct RunReport {
  RuntimePlan runtime_plan;
  std::shared_ptr<const Schedule> schedule;
  Timeline timeline;                  // the measured step the result describes
  int timeline_step = 0;              // which one: the median-time step, the first excluded when there are more
  // Per rank the engine ran, in that step: RankStep::layer_seconds (-1: not timed). Empty when
  // no step was reported.
  std::vector<double> layer_seconds;
  std::vector<MemoryBreakdown> memory;  // per schedule rank, at its peak over the run (its largest shard's)
  std::vector<ExecutedRank> executed_ranks;  // every rank the engine ran (dp * pp * tp * cp of them)
  // Per rank, the device memory its allocators handed out at its peak step (CUDA backend: the
  // rank's charged cudaMallocs plus its stream-ordered pool's high-water mark); empty on the CPU,
  // where ranks share one heap and `memory` is the only account.
  std::vector<double> allocated_peak_bytes;
  Result result;                      // the result fields, measured
  std::vector<StepRecord> steps;
  // The steps of the run's replays (RunOptions::timed_steps_at_least), in the order they ran, after
  // `steps`; the reported step may be one of them (timeline_replay).
  std::vector<StepRecord> replayed_steps;
  int timeline_replay = 0;            // which run the reported step came from: 0 the run's own, k its k-th replay
  std::optional<RunFailure> failure;
  std::string data_source;
  std::string backend = "cpu";        // the backend record that ran it (runtime/backend.h): its name
  std::string backend_title = "CPU";  // and as a sentence says it
  bool threads_pinned = false;
  std::string execution;              // how it ran, in words: "cpu: 4 rank threads, ...", "cuda: ..."
  std::string ranks_as;               // how ranks ran, for the summary: " as threads pinned to cores", or ""
  int first_step = 1;                 // > 1 when resumed
  std::vector<std::string> checkpoints;  // written by this run
};

// Identifies what a checkpoint belongs to: model, parallel layout, schedule and precision.
std::string plan_fingerprint(const RuntimePlan& plan);

}  // namespace trainsim::runtime
