// A hardware profile: a backend's own rates, measured by `trainsim calibrate` (DESIGN.md
// "Validation"), which a scenario names with `cluster.profile: FILE` like a GPU preset.
//
// It holds what the cost models need and a datasheet cannot give:
//   kernels     the time of every kernel of the model's step at the model's own shapes: matrix
//               products (rate quoted in TFLOP/s on their FLOPs) and memory-bound kernels
//               (layer norms, GELU, residual adds, loss, embedding, optimizer; quoted in GB/s
//               on the bytes the kernel inventory says they move, core/kernel_inventory.h)
//   p2p         latency + bytes / bandwidth of one message between two ranks
//   allreduce   per group size n: latency + bus bytes / bus bandwidth, bus bytes = S 2(n-1)/n
//               (the nccl-tests convention, so busbw is comparable across group sizes)
// A kernel the profile lacks at a shape is priced from the nearest measured shape of the same
// kernel (same rate, scaled by work); a kernel it lacks entirely falls back to the cluster's
// peak rates (compute_model.h).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/dtype.h"

namespace trainsim {

// The work one kernel launch does: a matrix product (m x k) * (k x n), `batch` times, or a
// memory-bound kernel over `elements` elements moving `bytes` bytes.
struct KernelShape {
  long m = 0, n = 0, k = 0, batch = 1;
  long elements = 0;
  double flops() const { return 2.0 * static_cast<double>(m) * n * k * batch; }
  bool is_matmul() const { return m > 0; }
  friend bool operator==(const KernelShape&, const KernelShape&) = default;
};

struct KernelRate {
  std::string kernel;  // "linear.forward", "attention.backward", "layernorm.forward", "adam", ...
  DType dtype = DType::fp32;
  KernelShape shape;
  double bytes = 0;    // memory-bound kernels: bytes moved per launch (the inventory's count)
  // Measured time per launch; 0 for work the backend does not do as a kernel of its own (the
  // CUDA backend's `round`: every kernel stores its output in the compute format).
  double seconds = 0;
  // TFLOP/s for matrix products, GB/s for memory-bound kernels.
  double rate() const;
};

// How kernels compose inside a layer: the runtime's own blocks, timed whole, against the sum
// of their kernels timed one by one. Kernels in sequence share caches and memory traffic in
// ways isolated timings cannot show; the cost models scale forward and backward ops by these.
// Measured on a stage run right after itself (warm), as a rank runs a step's passes one after
// another; its first forward of each chunk in a step runs after the optimizer step and the steps
// between (cold: its weights and buffers evicted), at `first_forward`.
struct Composition {
  double forward = 1, backward = 1;
  // Where the calibrated stage ran a split backward (ZB-H1: the input pass, then the weight pass):
  // the weight pass's own composition, `backward` then being the input pass's. 0: one backward,
  // both passes at `backward`.
  double backward_weight = 0;
  // A rank's first forward of a chunk in a step. 0: at `forward` (not measured).
  double first_forward = 0;
};

struct LinkFit {
  double latency_us = 0;
  double bandwidth_gbps = 0;  // GB/s (1e9 bytes/s)
  double seconds(double bytes) const;
};

// Measured times by size (bytes ascending), as the nccl-tests style table printed them:
// interpolated log-log between sizes, by the last row's bandwidth beyond the largest and at
// the smallest row's time below it.
struct SizeTable {
  std::vector<std::pair<double, double>> rows;  // (bytes, seconds)
  double seconds(double bytes) const;
};

struct HardwareProfile {
  std::string name;      // what scenarios and reports call it
  std::string backend;   // cpu | cuda
  std::string device;    // "Intel Xeon ..., 2 cores" or the GPU's name
  std::string measured;  // ISO date and time of the calibration
  std::string scenario;  // the scenario whose shapes were measured
  double memory_gib = 0;  // memory per rank (cpu: the machine's memory divided by the ranks it can pin)
  int ranks_per_node = 1;  // cpu: cores; cuda: GPUs
  // The CPU backend holds every tensor in fp32 and rounds to fp16/bf16 in an extra pass; the
  // CUDA backend stores the low-precision format itself.
  bool emulated_low_precision = false;
  std::vector<KernelRate> kernels;
  Composition composition;
  // Per core (rank r runs pinned on core r): its compute time against the calibration core's
  // alone, measured with every core busy at once as in a run, so it holds both a core that
  // is slower than the others (a busy neighbour on a shared host) and what running side by
  // side costs (shared cache and memory bandwidth). Empty: all 1.
  std::vector<double> core_factors;
  // Per core: its compute time alone, every other core idle, against the calibration core's alone
  // (1 for that one): a core slow by itself, not only beside the others. Empty: all 1.
  std::vector<double> core_alone_factors;
  // Per core: its optimizer update with every core updating at once against the calibration
  // core's update alone. Updates are memory-bound, so ranks that share one memory (one GPU's
  // HBM) slow each other's more than their stages (core_factors). Empty: the core factors.
  std::vector<double> optimizer_core_factors;
  // The core factors were timed with each tensor-parallel shard's stage running its group's real
  // collectives against the others' (the CPU backend under tensor parallelism): they hold what
  // the shards' waiting for one another costs on this machine as it is, and the compute model
  // adds no separate price for those collectives.
  bool core_factors_include_tensor_parallel = false;
  // Where ranks share cores by turns (the CPU backend with more ranks than cores): how long a core
  // given back by one thread waits for the next turn's thread, asleep until then, to run on it (a
  // condition variable's wake-up on that core). 0: not measured.
  double core_handoff_us = 0;
  // Where a rank's communication thread waits for a collective's peers by polling only so long
  // (the CPU backend's pinned ranks whose collectives run beside their compute): that poll, and
  // what a member that waited longer, and so slept, adds to the collective once its last member
  // is there (its wake-up and what follows it, measured against members that arrive together).
  // The engine adds comm_wake_us to a collective whose first member arrived more than
  // comm_poll_us before its last. 0: not measured.
  double comm_poll_us = 0;
  double comm_wake_us = 0;
  // Where a rank's communication thread polls for its peers through a step's waits (the CPU
  // backend's pinned ranks whose collectives wait for the passes: a pipeline's embedding sum, a
  // reduction after the backward): what a collective takes longer, from its last member's arrival,
  // when its first member arrived `lead_us` before the last (polling, and past the poll asleep),
  // against members that arrive together; measured at a few leads, in increasing order. The
  // engine adds comm_late_extra_us(lead) to such a collective. Empty: not measured.
  struct LatePoint {
    double lead_us = 0, us = 0;
    bool operator==(const LatePoint&) const = default;
  };
  std::vector<LatePoint> comm_late;
  // The call comm_late was measured with: its size, and its time when both members arrive
  // together (caches warm from the call before; the communication benchmark's rows are of calls
  // after an eviction, so a late call's own time, not the benchmark's plus the difference, is
  // what a step meets). 0: not given (a profile from before).
  double comm_late_bytes = 0;
  double comm_late_base_us = 0;
  // comm_late at `lead_us`: linear between its points and from (0, 0) to the first, the last
  // point's beyond it; 0 where comm_late is empty.
  double comm_late_extra_us(double lead_us) const;
  // What a collective whose first member led by `lead_us` takes longer than the benchmark's
  // price: the late call as measured (comm_late_base_us + comm_late_extra_us) less this profile's
  // 2-member all-reduce of comm_late_bytes, at least 0; comm_late_extra_us where the call is not
  // given.
  double comm_late_charge_us(double lead_us) const;
  // A rank's collectives run on the rank's own compute: the CPU backend pins its communication
  // thread to its compute thread's core; the single-GPU world copies and reduces with kernels on
  // the rank's own SMs. While one of them moves data, the compute beside it makes no progress
  // (sim/core_contention.h).
  bool collectives_take_rank_core = false;
  double core_factor(int rank) const {
    return core_factors.empty() ? 1.0 : core_factors[static_cast<std::size_t>(rank) % core_factors.size()];
  }
  double optimizer_core_factor(int rank) const {
    return optimizer_core_factors.empty()
               ? core_factor(rank)
               : optimizer_core_factors[static_cast<std::size_t>(rank) % optimizer_core_factors.size()];
  }
  double core_alone_factor(int rank) const {
    return core_alone_factors.empty() ? 1.0 : core_alone_factors[static_cast<std::size_t>(rank) % core_alone_factors.size()];
  }
  LinkFit p2p;
  std::map<int, LinkFit> allreduce;  // by group size
  // The measurements the fits came from; where present they price instead of the fits.
  SizeTable p2p_table;
  std::map<int, SizeTable> allreduce_tables;
  // The ring's halves measured on their own (nccl-tests' all_gather_perf, reduce_scatter_perf;
  // bytes: the whole buffer), by group size. Absent: half the all-reduce of the same buffer.
  std::map<int, SizeTable> allgather_tables, reduce_scatter_tables;
  // The wire format the collectives' fits and tables were measured in: their bytes are its (an
  // fp16 row of B bytes reduced B/2 elements).
  DType allreduce_wire = DType::fp32;
  // One message between two ranks.
  double p2p_seconds(double bytes) const;

  // Seconds for one launch of `kernel` at `shape`, or a negative number when the profile has
  // no measurement of that kernel in `dtype` (0 at every shape for a kernel recorded at 0).
  double kernel_seconds(const std::string& kernel, DType dtype, const KernelShape& shape, double bytes) const;
  // Ring all-reduce of `bytes` over n ranks from the table of group size n, else its fit, else
  // the nearest measured size's fit with the latency scaled by (n-1) as a ring's is. 0 when n <= 1.
  double allreduce_seconds(int n, double bytes) const;
  // An all-gather / reduce-scatter of a whole buffer of `bytes` over n ranks: its table for
  // group size n where measured, else half allreduce_seconds (a ring's half of its steps).
  double allgather_seconds(int n, double bytes) const;
  double reduce_scatter_seconds(int n, double bytes) const;
  // Best measured matrix-product rate in `dtype` (TFLOP/s), 0 if none.
  double best_matmul_tflops(DType dtype) const;
};

// YAML round trip. load_profile throws ScenarioError-style std::runtime_error with the file
// and line on a bad file.
HardwareProfile load_profile(const std::string& path);
// The same from the text of a profile; `name` stands for the file in messages.
HardwareProfile load_profile_text(const std::string& yaml_text, const std::string& name);
std::string profile_to_yaml(const HardwareProfile& p);

// What naming the profile does to a cluster, like a GPU preset: peak rates from the best
// measured matrix products (efficiency 1: the rates are achieved ones), memory bandwidth from
// the memory-bound kernels, both links from the point-to-point fit, memory per rank.
void apply_profile(const HardwareProfile& p, ClusterConfig& cluster);

}  // namespace trainsim
