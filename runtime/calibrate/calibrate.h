// `trainsim calibrate --backend cpu`: the CPU backend's own rates, measured with the runtime's
// own kernels (runtime/model/layers.h, runtime/numerics/) at the shapes of the plan to be run,
// into a HardwareProfile (core/hardware_profile.h), plus the communicator's point-to-point and
// all-reduce latency and bandwidth (comm_bench.h).
//
// Each kernel of the plan's inventory (core/kernel_inventory.h) runs on buffers of fresh
// random values, pinned to one core like a rank's compute thread; its time is the median of
// its launches, timed round-robin with the others (every pass launches each kernel once)
// after a warm-up, each timed launch right after an untimed one (operands in cache). Every pass
// also runs a stage of the runtime's own blocks, forward and backward: the ratio of its time
// to the sum of its kernels' is the profile's `composition` (core/hardware_profile.h).
#pragma once

#include <functional>
#include <memory>
#include <vector>
#include <string>

#include "core/hardware_profile.h"
#include "runtime/calibrate/comm_bench.h"
#include "runtime/exec/runtime_plan.h"

namespace trainsim::runtime {

struct CalibrateOptions {
  // Kernels are timed round-robin (one launch of each per pass): at least `min_passes` passes
  // and `min_seconds` of launches in all, at most `max_passes`.
  int min_passes = 9, max_passes = 200;
  double min_seconds = 0.6;
  bool pin = true;            // time on core 0, as rank 0's compute thread runs
  bool communication = true;  // also run the point-to-point and all-reduce benchmarks
  // calibrate_cpu: compute formats measured besides the plan's own (the CPU backend emulates
  // them all by rounding; fp8 it does not run). validate measures only the plan's.
  std::vector<DType> precisions = {DType::fp32, DType::tf32, DType::fp16, DType::bf16};
  CommBenchOptions comm;
  std::function<void(const std::string&)> progress;  // a line per kernel group measured
};

// Measures every kernel of `plan`'s inventory; `name` names the profile. The communication
// benchmark's rows go to `comm_table` when given (its nccl-tests table).
HardwareProfile calibrate_cpu(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options,
                              CommBenchResult* comm_table = nullptr);

// The kernel half of calibration, in passes: each pass launches every kernel of the plan's
// inventory once (round-robin), so all kernels' samples fall in the same stretch of time and a
// machine that changes speed (a shared host's neighbours) moves them together. Passes can be
// run between the steps of a run (validate does), so that calibration and measurement see
// the same machine; a kernel's time is the median of all its samples.
class KernelCalibrator {
 public:
  KernelCalibrator(const RuntimePlan& plan, const CalibrateOptions& options);
  ~KernelCalibrator();
  void run_passes(int passes);
  void run_until_settled();  // passes until options' min_passes and min_seconds
  std::vector<KernelRate> rates() const;
  // The runtime's own blocks (a middle stage of kComposeLayers) against the sum of their
  // kernels' times: how much faster or slower kernels run in sequence inside a layer than
  // alone (operands left in cache by the kernel before, or evicted by the layer's traffic).
  Composition composition() const;
  static constexpr int kComposeLayers = 2;
  // Per rank's core: the stage's time with every rank's core running it at once, against its
  // time alone on core 0 (HardwareProfile::core_factors). Empty for one rank, or more ranks
  // than cores.
  std::vector<double> core_factors() const;
  std::size_t num_kernels() const;
  int passes_done() const;
  // Median pass time after the first `first_passes` passes against before them, minus 1.
  double speed_change(int first_passes) const;

 private:
  void time_stages_on_every_core();
  struct State;
  const RuntimePlan& plan_;
  CalibrateOptions options_;
  std::unique_ptr<State> s_;
};

// A profile with the machine's description and no rates yet.
HardwareProfile describe_cpu_profile(const RuntimePlan& plan, const std::string& name);
// The communication benchmark into `p` (when options.communication).
void calibrate_communication(HardwareProfile& p, const CalibrateOptions& options, CommBenchResult* comm_table = nullptr);

// What a backend's calibration shares (this one's and the CUDA backend's, runtime/cuda/calibrate_cuda.h):

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
// `forward_seconds` and `backward_seconds` (the medians of its timings): each against the same
// stage priced with `rates`, the inventory (core/kernel_inventory.h) of the middle chunk of a
// three-stage 1F1B pipeline of `layers` blocks per stage, counted with `storage` bytes per
// stored element (a kernel without a rate of its kernel, dtype and shape costs nothing). A
// direction priced at zero gets 1.
Composition stage_composition(const ScenarioConfig& config, int layers, int storage,
                              const std::vector<KernelRate>& rates, double forward_seconds, double backward_seconds);

// A communication benchmark's fits into `p` (p2p, allreduce) and its rows into the profile's
// tables (sendrecv rows into p2p_table, all_reduce rows of op sum into allreduce_tables per
// group size), as (bytes, seconds). Throws std::runtime_error for the first row with wrong
// elements: "calibrate: <op> of <bytes> bytes over <ranks> ranks<where> gave <n> wrong elements"
// (`where` names the transport, e.g. " on the single-GPU world", or is empty).
void apply_comm_bench(HardwareProfile& p, const CommBenchResult& comm, const std::string& where = "");

// The machine's CPU model and core count, for the profile's `device`.
std::string cpu_description();

}  // namespace trainsim::runtime
