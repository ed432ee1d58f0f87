// trainsim: predict, sweep, run and validate training configurations.
// Only this file exits the process; commands (cli/cmd_*.cpp) return exit codes and throw.
#include <iostream>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "core/diagnostics.h"
#include "core/report/write_file.h"

namespace trainsim::cli {

void write_output(const std::string& path, const std::function<void(std::ostream&)>& body, const std::string& hint) {
  trainsim::write_file(path, body);
  std::cerr << fmt::format("wrote {}{}\n", path, hint.empty() ? "" : " (" + hint + ")");
}

}  // namespace trainsim::cli

int main(int argc, char** argv) {
  using namespace trainsim;
  using namespace trainsim::cli;
  CLI::App app{"trainsim: predict, then prove, the step time, memory and numerics of a parallel training "
               "configuration"};
  app.set_version_flag("--version", "trainsim 0.1.0");
  app.require_subcommand(1);

  const std::vector<Command> commands = {
      add_simulate_command(app), add_sweep_command(app),   add_plan_command(app),    add_run_command(app),
      add_calibrate_command(app), add_validate_command(app), add_prove_command(app),
      add_fidelity_command(app),
      add_fields_command(app),   add_presets_command(app), add_devices_command(app),
  };

  CLI11_PARSE(app, argc, argv);
  try {
    for (const auto& c : commands)
      if (c.sub->parsed()) return c.run();
  } catch (const ScenarioError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << format_diagnostic(d) << "\n";
    std::cerr << fmt::format("{} error{} in the scenario; nothing was done\n", e.diagnostics().size(),
                             e.diagnostics().size() == 1 ? "" : "s");
    return kExitBadInput;
  } catch (const CLI::Error& e) {  // arguments that only make sense together, checked by a command
    std::cerr << "error: " << e.what() << "\nRun with --help for more information.\n";
    return kExitBadInput;
  } catch (const std::invalid_argument& e) {  // a plan the chosen backend cannot run, and the like
    std::cerr << "error: " << e.what() << "\n";
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return kExitIoError;
  }
  return 0;
}
