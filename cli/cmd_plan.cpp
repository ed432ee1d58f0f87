// trainsim plan: placeholder until its issue lands (replaced by the real command).
#include <stdexcept>

#include "cli/commands.h"

namespace trainsim::cli {

Command add_plan_command(CLI::App& app) {
  auto* sub = app.add_subcommand("plan", "(not built yet)");
  return {sub, [] () -> int { throw std::runtime_error("trainsim plan is not built yet"); }};
}

}  // namespace trainsim::cli
