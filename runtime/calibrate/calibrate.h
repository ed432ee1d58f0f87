// `trainsim calibrate`: a backend's own rates, measured with the backend's own kernels at the
// shapes of the plan to be run, into a HardwareProfile (core/hardware_profile.h), plus its
// communicator's point-to-point and all-reduce latency and bandwidth (comm_bench.h). One method
// for every backend (calibrate_profile), driven by the backend's record (runtime/backend.h): its
// profile description, its kernel calibrator and its communication benchmark.
//
// Kernels (KernelCalibrator): each kernel of the plan's inventory (core/kernel_inventory.h) runs
// on buffers of fresh random values where a rank's compute runs (CPU: pinned to one core like a
// rank's compute thread; CUDA: rank 0's compute stream); its time is the median of its launches,
// timed round-robin with the others (every pass launches each kernel once) after a warm-up, each
// timed launch right after an untimed one (operands in cache). Every pass also runs a stage of the
// runtime's own blocks, forward and backward: the ratio of its time to the sum of its kernels' is
// the profile's `composition` (core/hardware_profile.h); the same stage on every rank's core (or
// streams) at once against it alone gives `core_factors`.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/hardware_profile.h"
#include "core/kernel_inventory.h"
#include "runtime/backend.h"
#include "runtime/calibrate/comm_bench.h"
#include "runtime/contract.h"
#include "runtime/runtime_plan.h"

namespace trainsim::runtime {

struct CalibrateOptions {
  // Kernels are timed round-robin (one launch of each per pass): at least `min_passes` passes
  // and `min_seconds` of launches in all, at most `max_passes`.
  int min_passes = 9, max_passes = 200;
  double min_seconds = 0.6;
  bool pin = true;            // CPU: time on core 0, as rank 0's compute thread runs
  Placement placement;        // devices: where the plan's ranks are placed (as the run places them)
  bool communication = true;  // also run the point-to-point and all-reduce benchmarks
  // calibrate_profile: compute formats measured besides the plan's own, those the backend's
  // kernels run (Backend::calibrates_format). validate measures only the plan's.
  std::vector<DType> precisions = {DType::fp32, DType::tf32, DType::fp16, DType::bf16};
  CommBenchOptions comm;
  std::function<void(const std::string&)> progress;  // a line per kernel group measured
};

// One forward and one backward of a stage, timed. A plan whose backward is split (ZB-H1) times its
// two passes apart: `backward` is then the input pass and `backward_weight` the weight pass (0 when
// the backward ran whole).
struct StageSeconds {
  double forward = 0, backward = 0, backward_weight = 0;
  double total() const { return forward + backward + backward_weight; }
};

// Every rank's optimizer update at once (its shard's runtime_optimizer_kernels, core/kernel_inventory.h)
// and then rank 0's alone, in seconds.
struct UpdateSeconds {
  std::vector<double> together;  // per rank
  double alone = 0;              // rank 0's, every other rank idle
};

// A backend's side of kernel calibration: how it times one kernel, one stage alone, and one stage
// per rank at once, on its device (a pinned core; a rank's streams). KernelCalibrator owns the
// method around it.
class KernelClock {
 public:
  virtual ~KernelClock() = default;
  // Where kernels are timed, for progress lines: "core 0, pinned", "green contexts: ...".
  virtual std::string placement() const = 0;
  // Runs `body` on the thread kernels are timed from (a pinned core; the rank's device context),
  // rethrowing what it throws.
  virtual void on_timing_thread(const std::function<void()>& body) = 0;
  // On the timing thread: seconds of one launch of kernel `i` of the calibrator's inventory right
  // after an untimed one; 0 for work this backend does not do.
  virtual double time_kernel(std::size_t i) = 0;
  // On the timing thread: seconds of one forward and one backward of rank 0's middle stage.
  virtual StageSeconds time_stage() = 0;
  // How many ranks' stages time_stages_together runs (1: rank 0's alone, no factors).
  virtual int stage_ranks() const = 0;
  // The middle stage on every rank at once: seconds (forward + backward) per rank.
  virtual std::vector<double> time_stages_together() = 0;
  // Right after time_stages_together: each rank's stage again on its own core with every other
  // core idle, seconds (forward + backward) per rank; rank 0's entry is not timed (0: time_stage
  // is its). Empty where a backend does not time them (every core then as fast alone as rank 0's).
  virtual std::vector<double> time_stages_alone() { return {}; }
  // The optimizer's updates on every rank at once, then rank 0's alone (UpdateSeconds). A step's
  // updates are memory-bound where its stages are a mix: ranks that share one memory (one GPU's
  // HBM) slow each other's updates more than their stages. Empty `together` where a backend does
  // not time them: the update then takes its rank's stage factor.
  virtual UpdateSeconds time_updates_together() { return {}; }
  // Whether time_stages_together runs tensor-parallel shards with their group's real collectives
  // (HardwareProfile::core_factors_include_tensor_parallel).
  virtual bool stages_run_tensor_parallel() const { return false; }
};

// Every backend's kernel calibrator: the pass loop, the rates, composition and per-rank factors,
// around a backend's KernelClock. Kernels are calibrated in passes: each pass launches every
// kernel of the plan's inventory once (round-robin), so all kernels' samples fall in the same
// stretch of time and a machine that changes speed (a shared host's neighbours) moves them
// together. Passes can be run between the steps of a run (validate does, for a backend whose speed
// wanders), so that calibration and measurement see the same machine; a kernel's time is the
// median of all its samples.
class KernelCalibrator {
 public:
  // Times `kernels` (the plan's inventory) with the clock `make_clock` builds for them (warmed up:
  // every kernel and stage launched once); `storage_bytes`: bytes per stored element the
  // composition's kernels are priced with (the CPU's 4-byte floats, the device's compute format).
  using ClockFactory = std::function<std::unique_ptr<KernelClock>(
      const RuntimePlan& plan, const CalibrateOptions& options, const std::vector<KernelWork>& kernels)>;
  KernelCalibrator(const RuntimePlan& plan, const CalibrateOptions& options, std::vector<KernelWork> kernels,
                   int storage_bytes, const ClockFactory& make_clock);
  virtual ~KernelCalibrator();
  KernelCalibrator(const KernelCalibrator&) = delete;
  KernelCalibrator& operator=(const KernelCalibrator&) = delete;

  void run_passes(int passes);
  void run_until_settled();  // passes until options' min_passes and min_seconds
  std::vector<KernelRate> rates() const;  // throws std::logic_error before any pass
  // The same from passes [first_pass, end_pass) only (clamped to at least one pass done): the
  // kernels as they ran in one stretch of the calibration.
  std::vector<KernelRate> rates(int first_pass, int end_pass) const;
  // The runtime's own blocks (a middle stage of compose_layers) against the sum of their
  // kernels' times: how much faster or slower kernels run in sequence inside a layer than
  // alone (operands left in cache by the kernel before, or evicted by the layer's traffic).
  // Warm (the stage right after itself), with the cold stage's forward as `first_forward`.
  Composition composition() const;
  Composition composition(int first_pass, int end_pass) const;  // from passes [first_pass, end_pass), as rates()
  // The composition stage's blocks: as many as the plan's fullest rank holds (all its chunks),
  // so that the stage's weights and activations press on the caches as a rank's passes do
  // between one forward and the next.
  static int compose_layers(const Plan& plan);
  // Per rank: the stage's time with every rank running it at once (each on its core or its
  // streams), against its time alone on rank 0's (HardwareProfile::core_factors). Empty for one
  // rank, or when the ranks are not timed together.
  std::vector<double> core_factors() const;
  // The same from passes [first_pass, end_pass) only (clamped to the passes done; empty when none
  // is left): the cores as they were in one stretch of the calibration.
  std::vector<double> core_factors(int first_pass, int end_pass) const;
  // Per rank: its stage alone on its own core (every other core idle) against rank 0's alone
  // (HardwareProfile::core_alone_factors; rank 0's is 1), from the same passes. Empty where the
  // clock does not time them or core_factors(first_pass, end_pass) is empty.
  std::vector<double> core_alone_factors(int first_pass, int end_pass) const;
  // Per rank: its optimizer update with every rank updating at once against rank 0's alone, from
  // passes [first_pass, end_pass) (HardwareProfile::optimizer_core_factors). Empty where the clock
  // does not time updates or one rank is timed.
  std::vector<double> optimizer_core_factors(int first_pass, int end_pass) const;
  // core_factors() hold the tensor-parallel shards' collectives (KernelClock::stages_run_tensor_parallel).
  bool core_factors_include_tensor_parallel() const;
  std::size_t num_kernels() const;
  int passes_done() const;
  // Median pass time after the first `first_passes` passes against before them, minus 1.
  double speed_change(int first_passes) const;
  std::string placement() const;  // the clock's

 private:
  RuntimePlan plan_;
  CalibrateOptions options_;
  std::vector<KernelWork> kernels_;
  int storage_bytes_;
  std::unique_ptr<KernelClock> clock_;
  std::vector<std::vector<double>> samples_;       // [kernel][pass]
  std::vector<double> pass_seconds_;               // all kernels, per pass
  // Rank 0's stage alone, per pass: right after the pass's kernels (cold: as a rank's first
  // forward of a step finds its data evicted by the optimizer step and the steps between), and
  // again right after itself (warm: as every later pass of a step runs, one after another on the
  // same stage; also the core factors' base, so that a factor is contention alone).
  std::vector<StageSeconds> cold_, warm_;
  std::vector<std::vector<double>> rank_seconds_;  // [rank][pass]: forward + backward, all ranks at once
  std::vector<std::vector<double>> alone_seconds_;  // [rank][pass]: each alone on its core (rank 0's unused)
  std::vector<std::vector<double>> update_seconds_;  // [rank][pass]: the optimizer's update, all ranks at once
  std::vector<double> update_alone_seconds_;         // [pass]: rank 0's update alone
  std::pair<int, int> clamped(int first_pass, int end_pass) const;  // [first, end) within the passes, not empty
  // Per rank: the median of `per_rank`'s passes [first_pass, end_pass) over rank 0's warm stage
  // alone in the same passes (clamped; empty when none is left or one rank is timed).
  std::vector<double> factors_over(const std::vector<std::vector<double>>& per_rank, int first_pass,
                                   int end_pass) const;
};

// Everything, on `backend`: a profile describing it, the plan's kernels in its compute format and
// in each other format of options.precisions the backend calibrates, composition, core factors and
// (when options.communication) the communication benchmark, whose table goes to `comm_table` when
// given. Throws std::invalid_argument when the backend has no calibration.
HardwareProfile calibrate_profile(const Backend& backend, const RuntimePlan& plan, const std::string& name,
                                  const CalibrateOptions& options, CommBenchResult* comm_table = nullptr);
// The communication benchmark of `backend` into `p` (when options.communication).
void calibrate_communication(const Backend& backend, HardwareProfile& p, const CalibrateOptions& options,
                             CommBenchResult* comm_table = nullptr);

// What every backend's calibration shares:

// The profile's `measured`: local time as YYYY-MM-DDTHH:MM:SS.
std::string now_iso();

// Runs `body` on a new thread and waits for it, rethrowing what it throws: for work that pins
// its thread or makes a device context current without touching the caller's.
void on_own_thread(const std::function<void()>& body);

// Whether a kernel calibrator whose passes took `pass_seconds` (one entry per pass) has run
// enough: options' max_passes, or both min_passes and min_seconds (run_until_settled).
bool calibration_settled(const CalibrateOptions& options, const std::vector<double>& pass_seconds);

// core_factors: per rank (or core), the median of its stage times with every rank running the
// stage at once (`together`, [rank][pass]), against the median of forward + backward per pass
// of the stage alone.
std::vector<double> stage_factors(const std::vector<double>& forward_alone, const std::vector<double>& backward_alone,
                                  const std::vector<std::vector<double>>& together);

// The composition of a middle stage of `layers` blocks of `config`'s model that took
// `forward_seconds` and `backward_seconds` (the medians of its timings; with a split backward,
// `backward_seconds` its input pass and `backward_weight_seconds` its weight pass): each against the same
// stage priced with `rates`, the inventory (core/kernel_inventory.h) of the middle chunk of a
// three-stage 1F1B pipeline of `layers` blocks per stage, counted with `storage` bytes per
// stored element (a kernel without a rate of its kernel, dtype and shape costs nothing). A
// direction priced at zero gets 1.
Composition stage_composition(const ScenarioConfig& config, int layers, int storage,
                              const std::vector<KernelRate>& rates, double forward_seconds, double backward_seconds,
                              double backward_weight_seconds = 0);

// A communication benchmark's fits into `p` (p2p, allreduce) and its rows into the profile's
// tables, replacing what they held (sendrecv rows into p2p_table, all_reduce rows of op sum into
// allreduce_tables per group size, all_gather and reduce_scatter rows likewise), as (bytes,
// seconds). Throws std::runtime_error for the first row with wrong
// elements: "calibrate: <op> of <bytes> bytes over <ranks> ranks<where> gave <n> wrong elements"
// (`where` names the transport, e.g. " on the single-GPU world", or is empty).
void apply_comm_bench(HardwareProfile& p, const CommBenchResult& comm, const std::string& where = "");

}  // namespace trainsim::runtime
