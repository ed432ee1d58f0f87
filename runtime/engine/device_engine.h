// The interface between the run loop (runtime/loop/run_loop.h), written once, and what runs a
// step on some device: the CPU engine (rank threads and Eigen), the CUDA engine (streams, cuBLAS,
// NCCL), the null engine (the prediction, played back). An engine owns its ranks' models,
// optimizers, loss scalers, communicators and buffers; the loop owns everything about the run:
// the steps, resuming, the numerics log, the loss watch, checkpoints, and the measured result.
//
//                   +--------------------------- run loop ----------------------------+
//   RunOptions ---> | resume -> for each step: run_step -> timeline, numerics, checks  | ---> RunReport
//                   |           checksums -> loss watch -> checkpoint                  |
//                   +------------------------------+-----------------------------------+
//                                                  | DeviceEngine
//                         +------------------------+------------------------+
//                     CpuEngine                CudaEngine               NullEngine
//
// One step of the schedule: every rank walks its program (core/schedule.h) and reports what it
// measured (RankStep: op timings, when it reached each collective, numerics, a hash of its
// weights). An engine that holds only some ranks (the CUDA engine, one process per GPU) gathers
// the others' reports, so every process's loop sees the whole world.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/result.h"
#include "core/schedule.h"
#include "core/timeline.h"
#include "runtime/checkpoint.h"
#include "runtime/contract.h"
#include "runtime/engine/world.h"

namespace trainsim::runtime {

// One rank's step, as its engine saw it.
struct RankStep {
  RankStepNumerics numerics;
  double loss_sum = 0;           // the last stage's micro-batch losses, summed
  int loss_count = 0;
  double grad_norm = 0;          // the global norm (every rank computes the same)
  Tick first_nonfinite_at = -1;  // when numerics.first_nonfinite was produced (the step's clock)
  std::vector<OpTiming> timing;  // per op of its program, from the step's start on this rank
  std::vector<Tick> arrival;     // per op: when this rank reached a collective; -1 for other ops
  // Per op: a collective run in parts that each wait for room first (ZeRO-3's gathers, unit by
  // unit), each part's (room, end) on this rank; empty for other ops (and engines that do not say).
  std::vector<std::vector<std::pair<Tick, Tick>>> parts;
  std::uint64_t weights_hash = 0;  // over its master weights after the step (fnv1a, weights.h)
  // Seconds its transformer blocks computed in the step, per block it holds
  // (StageModel::take_block_seconds over its chunks); -1 where the engine does not time them.
  double layer_seconds = -1;
  // Seconds the host ran other work (other processes, the kernel's threads, the hypervisor) on the
  // rank's core in the step: the wall time less the core's idle time and what the rank's own
  // threads ran there. Where ranks share the cores (threads not pinned), every core's other work
  // over the whole process's step, per core. -1 where the engine does not measure it (the CUDA
  // engine; a kernel that publishes no cpuidle residency).
  double foreign_seconds = -1;
  std::string error;             // non-empty: the rank failed, and why; the rest is not meaningful
  // When its error was caught (system clock, ns; 0: not recorded). One failure makes the others
  // fail too (aborted collectives, a stopped core gate): the run names the earliest, the cause.
  std::int64_t failed_at_ns = 0;
};

// What an engine is running, in words, for the report.
struct Execution {
  std::string text;             // "cpu: 4 rank threads, pinned to cores 0..3", "cuda: ..."
  std::string ranks_as;         // how ranks run, for the summary's run line (" as threads ...") or ""
  bool threads_pinned = false;
};

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;

  virtual const World& world() const = 0;
  virtual std::shared_ptr<const Schedule> schedule() const = 0;
  virtual Execution execution() const = 0;

  // Runs optimizer step `step` of the schedule on the ranks this engine holds, their micro-batches
  // starting at sample `data_position`. Returns every rank's step, indexed by rank. A rank that
  // fails says so in its RankStep::error (the engine stops the others' waits); throwing is for a
  // failure of the engine itself.
  virtual std::vector<RankStep> run_step(int step, std::uint64_t data_position) = 0;

  // After a step every rank completed: the largest |w(replica d) - w(replica 0)| over all weights,
  // or nullopt when this engine does not hold every rank's weights (the loop then compares the
  // replicas' checksums).
  virtual std::optional<double> replica_drift() = 0;

  // After a step every rank completed: every rank's state, by rank (gathered from the other
  // processes when this engine holds only some ranks).
  virtual std::vector<RankCheckpoint> save() = 0;
  // Loads the ranks this engine holds from `checkpoint` (of the same plan: the loop has checked its
  // fingerprint and rank count). Throws CheckpointError for a rank it does not find or that holds
  // fewer values than its model.
  virtual void restore(const Checkpoint& checkpoint) = 0;
  // Whether this process writes the run's files (checkpoints): the one holding rank 0.
  virtual bool writes_files() const { return true; }

  // Per rank (all of the world), the accounted memory at its peak over the steps so far.
  virtual std::vector<MemoryBreakdown> memory_peaks() const = 0;
  // Per rank, what its allocators handed out at their peak; empty where ranks share a heap.
  virtual std::vector<double> allocated_peaks() const { return {}; }
};

}  // namespace trainsim::runtime
