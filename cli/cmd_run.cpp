// trainsim run: placeholder until its issue lands (replaced by the real command).
#include <stdexcept>

#include "cli/commands.h"

namespace trainsim::cli {

Command add_run_command(CLI::App& app) {
  auto* sub = app.add_subcommand("run", "(not built yet)");
  return {sub, [] () -> int { throw std::runtime_error("trainsim run is not built yet"); }};
}

}  // namespace trainsim::cli
