// The subcommands of `trainsim`, one file each. Every add_*_command registers its options
// on `app` and returns what to run when the user picked it. Only main.cpp exits the
// process; commands return an exit code and throw typed errors (ScenarioError: bad input).
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "runtime/contract.h"

namespace trainsim {
struct Scenario;
}  // namespace trainsim
namespace trainsim::runtime {
struct Backend;
}  // namespace trainsim::runtime
namespace trainsim::validation {
struct ValidationBackend;
}  // namespace trainsim::validation

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

// cli/scenario_args.cpp. `--set KEY=VALUE` (repeatable) on a command that reads a scenario, and
// the scenario file with those keys set as if it wrote them.
void add_set_option(CLI::App* sub, std::vector<std::string>& sets);
Scenario load_scenario_with(const std::string& file, const std::vector<std::string>& sets);

// The backend a run, calibration or validation uses, from --backend, --sm-sharing, --device.
struct BackendChoice {
  std::string name = "cpu";  // a name of the registry (runtime/backends.cpp)
  std::string sm_sharing = "auto";  // several ranks on one GPU: auto, green or shared
  int device = 0;            // several ranks on one GPU
};
void add_backend_options(CLI::App* sub, BackendChoice& backend);

// cli/backend.cpp. The record chosen: --backend, or the scenario's runtime.backend where
// --backend was not given. Throws when this build cannot use it (saying why).
const runtime::Backend& backend_for(const Scenario& scenario, const CLI::App& sub, const BackendChoice& choice);
// Where `backend` places the plan's ranks: under torchrun, mpirun or srun with more than one
// process (for a backend that is launched so), this process's rank; otherwise every rank here.
runtime::Placement placement_for(const runtime::Backend& backend, const BackendChoice& choice);
// The same for commands that place every rank in one process (calibrate, validate and prove,
// `command` names it in the error): refused under a launcher.
runtime::Placement single_process_placement(const runtime::Backend& backend, const BackendChoice& choice,
                                            const char* command);
// What validate and prove (`command`, for errors) run on: backend_for's record, every rank in
// this process.
validation::ValidationBackend validation_backend(const Scenario& scenario, const CLI::App& sub,
                                                const BackendChoice& choice, const char* command);
// False on every process but rank 0 of a launched run: one report, not one per GPU.
bool prints_output(const runtime::Backend& backend);

// core/report/write_file.h's write_file (whole or not at all), then tells the user on stderr
// where the file is (and how to open it).
void write_output(const std::string& path, const std::function<void(std::ostream&)>& body, const std::string& hint = "");

}  // namespace trainsim::cli
