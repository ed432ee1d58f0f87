// The subcommands of `trainsim`, one file each. Every add_*_command registers its options
// on `app` and returns what to run when the user picked it. Only main.cpp exits the
// process; commands return an exit code and throw typed errors (ScenarioError: bad input).
#pragma once

#include <functional>
#include <ostream>
#include <string>

#include <CLI/CLI.hpp>

namespace trainsim::cli {

inline constexpr int kExitBadInput = 2;  // the scenario or the arguments are wrong
inline constexpr int kExitIoError = 3;   // files, or anything else that failed
inline constexpr int kExitRunFailed = 4; // a run ended early (diverged, NaN): its report was still written
inline constexpr int kExitNothingFeasible = 5;  // sweep/plan: no configuration fits (the report says why)

struct Command {
  CLI::App* sub = nullptr;
  std::function<int()> run;
};

Command add_simulate_command(CLI::App& app);
Command add_fields_command(CLI::App& app);
Command add_presets_command(CLI::App& app);
Command add_devices_command(CLI::App& app);
Command add_sweep_command(CLI::App& app);
Command add_plan_command(CLI::App& app);
Command add_run_command(CLI::App& app);
Command add_calibrate_command(CLI::App& app);
Command add_validate_command(CLI::App& app);
Command add_prove_command(CLI::App& app);
Command add_fidelity_command(CLI::App& app);

// The backend a run, calibration or validation uses, from --backend, --sm-sharing, --device.
struct BackendChoice {
  std::string name = "cpu";           // cpu or cuda
  std::string sm_sharing = "auto";    // cuda, every rank on one GPU: auto, green or shared
  int device = 0;                     // cuda, every rank on one GPU
};
void add_backend_options(CLI::App* sub, BackendChoice& backend);
}  // namespace trainsim::cli

namespace trainsim {
struct Scenario;
struct HardwareProfile;
}  // namespace trainsim
namespace trainsim::runtime {
struct RuntimePlan;
struct RunOptions;
struct RunReport;
struct CalibrateOptions;
struct CommBenchResult;
}  // namespace trainsim::runtime
namespace trainsim::validation {
struct ValidationBackend;
}  // namespace trainsim::validation

namespace trainsim::cli {
// cli/backend.cpp. The choice, with the scenario's runtime.backend where --backend was not given.
BackendChoice backend_for(const Scenario& scenario, const CLI::App& sub, BackendChoice choice);
// Runs on the chosen backend. cuda under a launcher (torchrun, mpirun, srun with more than one
// process) runs this process's rank over NCCL; otherwise every rank shares one GPU.
runtime::RunReport run_on_backend(const runtime::RuntimePlan& rp, const runtime::RunOptions& options,
                                  const BackendChoice& backend);
// False on every process but rank 0 of a multi-process CUDA run: one report, not one per GPU.
bool prints_output(const BackendChoice& backend);
// The backend's own rates at the plan's shapes (calibrate_cpu, or calibrate_cuda with every rank
// on one GPU; refused under a launcher).
HardwareProfile calibrate_on_backend(const runtime::RuntimePlan& rp, const std::string& name,
                                     const runtime::CalibrateOptions& options, const BackendChoice& backend,
                                     runtime::CommBenchResult* comm_table);
// What validate and prove (`command`, for errors) run on.
validation::ValidationBackend validation_backend(const BackendChoice& backend, const char* command);

// core/report/write_file.h's write_file (whole or not at all), then tells the user on stderr
// where the file is (and how to open it).
void write_output(const std::string& path, const std::function<void(std::ostream&)>& body, const std::string& hint = "");

}  // namespace trainsim::cli
