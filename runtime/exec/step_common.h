// What both executors (the CPU one, runtime/exec/executor.cpp, and the CUDA one,
// runtime/cuda/executor_cuda.cpp) do the same way around the device work: message tags,
// gradient buckets as element ranges, each virtual stage's StageSpec, the measured Timeline
// of a step, the run's loss checks, and the step a report describes.
#pragma once

#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <span>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/schedule.h"
#include "core/timeline.h"
#include "runtime/data/dataset.h"
#include "runtime/exec/executor.h"
#include "runtime/exec/runtime_plan.h"
#include "runtime/model/stage_model.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim::runtime {

// Tags: point-to-point messages and collectives of step `step` live in separate ranges, so
// nothing of one step can be mistaken for another's.
inline constexpr std::uint64_t kCollectiveTag = 1ull << 62;
inline std::uint64_t message_tag(int step, int channel) {
  return (static_cast<std::uint64_t>(step) << 32) | static_cast<std::uint32_t>(channel);
}
inline std::uint64_t collective_tag(int step, int id) { return kCollectiveTag | message_tag(step, id); }

// Gradient buckets of every virtual stage as element ranges of its gradient buffer: the
// schedule sizes them in bytes of the scenario's all-reduce format; the same fractions of the
// executed model's buffer are reduced together.
struct GradientBuckets {
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> ranges;  // [vstage][bucket], [lo, hi)
  std::vector<int> bucket_of_collective;  // per collective: its bucket index, -1 if not a gradient bucket
};
GradientBuckets gradient_buckets(const Schedule& schedule, int virtual_stages,
                                 const std::vector<std::size_t>& gradient_elements_per_vstage);

// The executed StageSpec of virtual stage `vstage`.
StageSpec stage_spec(const RuntimePlan& rp, int vstage);
OptimizerSettings optimizer_settings(const ScenarioConfig& config);

// The member sets of every all-reduce the executors run, in a fixed order (the schedule's
// collectives, then the global gradient-norm sum over all ranks), each once: what a
// communicator must be able to reduce over (NCCL splits a communicator per set).
std::vector<std::vector<int>> reduction_groups(const Schedule& schedule, int world_size);

// What one chunk (virtual stage `chunk`) of a rank holds at once during a step, from its
// program: forward stashes (a micro-batch's Forward to the op that ends its backward: the final
// Backward segment, or the BackwardWeight that runs the weight pass), whole backwards in progress
// (first Backward segment to last) and zero-bubble ones (BackwardInput to BackwardWeight). What
// a device executor allocates before the first step.
struct InFlight {
  int stashes = 0, backwards = 0, split_backwards = 0;
};
InFlight in_flight(const RankProgram& program, int chunk);

// Every directed pair (from, to) such that `from` sends to `to` in the step, ascending, each
// once: NCCL gives each its own communicator (nccl_communicator.h says why).
std::vector<std::pair<int, int>> p2p_links(const Schedule& schedule);

// The measured Timeline of one step from every rank's op timings and, for collectives, when
// each rank reached them: a collective starts when its last member reaches it (as the
// simulator defines it).
Timeline measured_timeline(std::shared_ptr<const Schedule> schedule, const std::vector<std::vector<OpTiming>>& timing,
                           const std::vector<std::vector<Tick>>& arrival);

// The run's tokens: synthetic, the file options.data_path names, or the bundled corpus; `source`
// says which, in words.
Dataset open_run_data(const RuntimePlan& rp, const RunOptions& options, std::string& source);

// What a failed rank's exception says ("unknown error" when it is not a std::exception).
std::string error_text(std::exception_ptr error);

// A checkpoint is written after `step` of `steps` when options ask for them every N steps: at
// every multiple of N and at the last step.
bool checkpoint_due(const RunOptions& options, int step, int steps);

// One rank's step as either executor saw it; step_record folds every rank's into the StepRecord.
struct RankStep {
  RankStepNumerics numerics;
  double loss_sum = 0;           // the last stage's micro-batch losses, summed
  int loss_count = 0;
  double grad_norm = 0;          // the global norm (every rank computes the same)
  Tick first_nonfinite_at = -1;  // when numerics.first_nonfinite was produced (the step's clock)
};

// The step's record from every rank's, by rank: the mean loss, counts, rank 0's norm, scale and
// verdict. Replica checksums and drift are the caller's (each backend reads weights its own
// way). *first_nonfinite: where inf/NaN appeared first in time this step, or "".
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

// FNV-1a over the bits of `xs`, continuing from `h` (start: kFnvOffset): replica checksums.
inline constexpr std::uint64_t kFnvOffset = 1469598103934665603ull;
std::uint64_t fnv1a(std::uint64_t h, std::span<const float> xs);

// The largest |a[i] - b[i]| over elements whose bits differ (inf when one is NaN): replica drift.
double weight_difference(std::span<const float> a, std::span<const float> b);

// A flag per op, set by the thread that runs it and waited on by the thread that needs it; a
// failure wakes every waiter with the error. (The CPU executor marks an op when it is done;
// the CUDA one when it is queued on its stream, whose events do the device-side waiting.)
class OpCompletion {
 public:
  void reset(std::size_t n) {
    std::lock_guard lock(mu_);
    done_.assign(n, 0);
    error_ = nullptr;
  }
  void mark(std::size_t i) {
    {
      std::lock_guard lock(mu_);
      done_[i] = 1;
    }
    cv_.notify_all();
  }
  void fail(std::exception_ptr e) {
    {
      std::lock_guard lock(mu_);
      if (!error_) error_ = e;
    }
    cv_.notify_all();
  }
  void wait(std::size_t i) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_[i] || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> done_;
  std::exception_ptr error_;
};

// The ops a rank's compute thread hands its communication thread, in program order; -1 stops it.
class CollectiveQueue {
 public:
  void push(int op) {
    {
      std::lock_guard lock(mu_);
      ops_.push_back(op);
    }
    cv_.notify_one();
  }
  // Waits for the next op.
  int pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !ops_.empty(); });
    const int op = ops_.front();
    ops_.pop_front();
    return op;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> ops_;
};

// The step a report describes: the median by time, leaving out the first (warm-up: first
// touches of memory) when there are others. Index into `steps`; -1 when empty.
int median_step_index(const std::vector<StepRecord>& steps);

}  // namespace trainsim::runtime
