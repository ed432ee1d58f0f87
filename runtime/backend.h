// A backend is one record: its name, the engine that runs a plan's steps on it, the calibrator of
// its kernels, its communication benchmark, and the few facts about it the front end and
// validation need. Each backend defines its record beside its engine (cpu_backend() in
// runtime/cpu/cpu_engine.cpp, ...) and is registered once, in runtime/backends.cpp. The CLI,
// `validate`, `prove` and the reports hold a record (found by name with find_backend); nothing
// compares a backend's name to choose what to do.
//
//   runtime/backends.cpp   backends(): cpu, cuda, null  ---- find_backend("cuda") ----> const Backend&
//                                                                                          |
//      run(backend, plan, options)  (runtime/loop/run_loop.h)  <-- backend.engine ---------+
//      calibrate_profile(backend, plan, ...)  (runtime/calibrate/calibrate.h)  <-- .kernels, .comm_bench
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/hardware_profile.h"
#include "runtime/calibrate/comm_bench.h"
#include "runtime/contract.h"
#include "runtime/data/dataset.h"

namespace trainsim::runtime {

class DeviceEngine;      // runtime/engine/device_engine.h
class KernelCalibrator;  // runtime/calibrate/calibrate.h
struct CalibrateOptions;

struct Backend {
  std::string name{};         // what --backend and runtime.backend say: "cpu", "cuda", "null"
  std::string title{};        // as a sentence says it: "measured on the CUDA backend"
  std::string help{};         // one line for --backend's help
  // Non-empty: this build cannot use the backend, and why ("this trainsim was built without CUDA
  // ..."); every use of the record throws std::runtime_error with it.
  std::string unavailable{};

  // The engine that runs `plan`'s steps: every rank, or this process's under a launcher
  // (options.placement). Throws std::invalid_argument for a plan it cannot run, std::runtime_error
  // when its device cannot be used (saying why).
  std::function<std::unique_ptr<DeviceEngine>(const RuntimePlan& plan, const Dataset& data, const RunOptions& options)>
      engine{};

  // Calibration (runtime/calibrate/calibrate.h). Empty: the backend has none (a profile must be given).
  // A profile that describes the device and the plan's placement on it, with no rates yet.
  std::function<HardwareProfile(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options)>
      describe{};
  // The kernels of the plan's inventory, timed in passes with the backend's own code.
  std::function<std::unique_ptr<KernelCalibrator>(const RuntimePlan& plan, const CalibrateOptions& options)> kernels{};
  // Compute formats the kernels can also be calibrated in, besides the plan's own.
  std::function<bool(DType)> calibrates_format{};
  // Point-to-point and all-reduce over the backend's communicator, as nccl-tests prints them
  // (comm_bench.h); `comm_where` names the transport in errors (" on the single-GPU world").
  std::function<CommBenchResult(const CommBenchOptions& options, const Placement& placement)> comm_bench{};
  std::string comm_where{};
  // The largest all-reduce group calibrate measures by default for a plan.
  std::function<int(const RuntimePlan& plan)> comm_ranks{};
  std::string kernel_clock{};  // how calibrate times kernels, for its output: "one core, pinned"

  // The machine's speed wanders (a shared host's neighbours): validate runs kernel calibration
  // passes between the run's steps, so that rates and run come from the same stretch of time.
  bool calibrate_between_steps = false;
  // Ranks beyond the profile's ranks_per_node share the devices (cores) by turns: each compute op
  // takes a whole one, in the order RunOptions::core_turns gives, which validate computes and then
  // predicts op by op (validation/core_sharing.h). Otherwise ranks that share a device run at once
  // and validate prices them by processor sharing.
  bool shares_by_turns = false;
  // One process per device under torchrun, mpirun or srun: only rank 0 prints, and calibration,
  // which places every rank in one process, refuses to run under a launcher.
  bool launched = false;

  // Throws std::runtime_error with `unavailable` when this build cannot use the backend.
  void require_available() const {
    if (!unavailable.empty()) throw std::runtime_error(unavailable);
  }
};

// Every backend this build knows (runtime/backends.cpp), in the order --backend lists them.
const std::vector<const Backend*>& backends();
// The backend named `name`; throws std::invalid_argument listing the names when there is none.
const Backend& find_backend(const std::string& name);

// The CPU backend's record (runtime/cpu/cpu_engine.cpp): what a run that names no backend uses.
const Backend& cpu_backend();

}  // namespace trainsim::runtime
