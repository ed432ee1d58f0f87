// `trainsim calibrate --backend cuda`: the CUDA backend's own rates at the shapes of the plan to
// be run, into the same HardwareProfile the CPU backend's calibration writes
// (runtime/calibrate/calibrate.h, core/hardware_profile.h), so `validate` and `prove` predict a
// GPU run from measurements of that GPU.
//
// Where it measures: the plan's single-GPU placement (every rank on one device, as `trainsim run
// --backend cuda` without a launcher places them; runtime/cuda/sm_partition.h). Kernels run on
// rank 0's compute stream, so under green contexts they see the SM share a rank gets in the run,
// and their rates are a rank's rates. Memory bandwidth is not partitioned: `core_factors` times
// a stage of the runtime's blocks on every rank's streams at once against rank 0 alone, as the
// CPU calibration does per core.
//
// How a kernel is timed: each kernel of the plan's inventory (core/kernel_inventory.h, counted
// with the compute format's storage bytes) is launched through the backend's own launchers
// (kernels/kernels.h, kernels/gemm.h) on device buffers of fresh random values; a timed launch
// follows an untimed one of the same kernel (its operands in L2, as a kernel finds what the one
// before it wrote), bracketed by CUDA events on the stream; kernels are timed round-robin, one
// launch each per pass, and a kernel's time is the median over passes. The inventory's `round`
// pass (the CPU backend's separate rounding and inf/NaN scan of each tensor) does not exist on
// the device, where every kernel stores its output in the compute format: it is recorded with
// zero time, so a prediction does not charge for it.
//
// Communication: the single-GPU world's send/recv and all-reduce (runtime/cuda/device_world.h),
// in nccl-tests' table (runtime/calibrate/comm_bench.h), with a data check on every call. One
// process per GPU over NCCL is not calibrated here: its links are the machine's NVLink/network,
// which nccl-tests measures (its table fits the profile's p2p and all-reduce rows as well).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/hardware_profile.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/calibrate/comm_bench.h"
#include "runtime/cuda/sm_partition.h"
#include "runtime/runtime_plan.h"

namespace trainsim::runtime::cuda {

// Where the plan's ranks are placed: runtime/contract.h's Placement (device, sm_sharing), as the
// run places them (green contexts where the driver has them, by default).
using CudaCalibrateOptions = Placement;

// The formats the kernels store: fp32, fp16, bf16 (the only ones the CUDA backend calibrates).
bool stored_by_kernels(DType t);

// A profile describing the device and placement, with no rates yet: backend "cuda", device
// "<GPU name>, <n> SMs" plus the SM sharing line, memory_gib = the device's memory divided by the
// plan's ranks (they share it), ranks_per_node = the plan's ranks (one device holds them all, so
// every link is intra-node), emulated_low_precision false.
HardwareProfile describe_cuda_profile(const RuntimePlan& plan, const std::string& name, const CudaCalibrateOptions& cuda);

// The kernel half, in passes: runtime::KernelCalibrator's method (calibrate.h), its clock the
// backend's launches timed with CUDA events. placement() is SmPartition::describe() of the
// placement timed. Throws std::runtime_error when no device can be used (saying why),
// std::invalid_argument for a compute format the kernels do not store (tf32, fp8).
class CudaKernelCalibrator final : public KernelCalibrator {
 public:
  CudaKernelCalibrator(const RuntimePlan& plan, const CalibrateOptions& options, const CudaCalibrateOptions& cuda);
};

// send/recv ping-pong and all-reduce over the single-GPU world on `device`, as
// bench_in_process_comm does over the in-process one (same options, rows, fits and checks;
// `wire` is the buffer's format: fp32, fp16 or bf16). Each rank's calls run on its own
// non-blocking stream from its own host thread; a call's time is taken with CUDA events on the
// rank's stream, and a row's time is the median over calls of the slowest rank's.
CommBenchResult bench_device_world_comm(const CommBenchOptions& options, int device = 0);

// Everything: the plan's kernels in its compute format and in each other format of
// options.precisions the kernels store (fp32, fp16, bf16), composition, core factors and (when
// options.communication) the single-GPU world's communication table.
HardwareProfile calibrate_cuda(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options,
                               const CudaCalibrateOptions& cuda, CommBenchResult* comm_table = nullptr);

}  // namespace trainsim::runtime::cuda
