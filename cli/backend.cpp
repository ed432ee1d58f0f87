// The --backend choice of run, calibrate, validate and prove: a record of the registry
// (runtime/backend.h), and where it places the plan's ranks (--sm-sharing, --device, a launcher).
// Nothing here knows which backends exist.
#include <stdexcept>

#include "cli/commands.h"
#include "core/scenario.h"
#include "runtime/backend.h"
#include "runtime/launch/launch_env.h"
#include "validation/validate.h"

namespace trainsim::cli {

void add_backend_options(CLI::App* sub, BackendChoice& backend) {
  std::vector<std::string> names;
  std::string help;
  for (const runtime::Backend* b : runtime::backends()) {
    names.push_back(b->name);
    help += (help.empty() ? "" : "; ") + b->name + " (" + b->help + ")";
  }
  sub->add_option("--backend", backend.name, help + ". Default: the scenario's runtime.backend")
      ->check(CLI::IsMember(names));
  sub->add_option("--sm-sharing", backend.sm_sharing,
                  "several ranks on one GPU: split the SMs between ranks with green contexts (green), let ranks "
                  "share every SM (shared), or green where the driver allows it (auto)")
      ->check(CLI::IsMember({"auto", "green", "shared"}));
  sub->add_option("--device", backend.device, "several ranks on one GPU: which GPU")->check(CLI::NonNegativeNumber);
}

const runtime::Backend& backend_for(const Scenario& scenario, const CLI::App& sub, const BackendChoice& choice) {
  std::string name = choice.name;
  if (sub.count("--backend") == 0) name = runtime_backend_name(scenario.config.runtime.backend);
  const runtime::Backend& backend = runtime::find_backend(name);
  backend.require_available();
  return backend;
}

runtime::Placement placement_for(const runtime::Backend& backend, const BackendChoice& choice) {
  runtime::Placement p;
  p.sm_sharing = choice.sm_sharing == "green"    ? runtime::SmSharing::green_contexts
                 : choice.sm_sharing == "shared" ? runtime::SmSharing::shared
                                                 : runtime::SmSharing::automatic;
  p.device = choice.device;
  // Started by torchrun, mpirun or srun with more than one process: one rank per process.
  // Otherwise every rank of the plan is placed in this process.
  if (backend.launched)
    if (const runtime::LaunchEnv env = runtime::launch_env_from(); env.world_size > 1) p.launch = env;
  return p;
}

runtime::Placement single_process_placement(const runtime::Backend& backend, const BackendChoice& choice,
                                            const char* command) {
  runtime::Placement p = placement_for(backend, choice);
  // Calibration and validation place every rank in this process; under a launcher each process
  // would calibrate its own copy of the whole plan.
  if (p.launch)
    throw std::runtime_error(std::string(command) + " --backend " + backend.name +
                             " runs every rank of the plan in one process: start it without torchrun/mpirun/srun (a "
                             "launched run is `trainsim run --backend " +
                             backend.name + "`)");
  return p;
}

validation::ValidationBackend validation_backend(const Scenario& scenario, const CLI::App& sub,
                                                const BackendChoice& choice, const char* command) {
  const runtime::Backend& backend = backend_for(scenario, sub, choice);
  validation::ValidationBackend v(backend);
  v.placement = single_process_placement(backend, choice, command);
  return v;
}

bool prints_output(const runtime::Backend& backend) {
  if (!backend.launched) return true;
  return runtime::launch_env_from().rank == 0;  // one process per device: rank 0 reports
}

}  // namespace trainsim::cli
