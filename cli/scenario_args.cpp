// The scenario a command reads: its file, with the keys `--set` overrides (core/scenario.h).
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/diagnostics.h"
#include "core/scenario.h"
#include "validation/fidelity.h"

namespace trainsim::cli {

void add_set_option(CLI::App* sub, std::vector<std::string>& sets) {
  sub->add_option("--set", sets,
                  "KEY=VALUE: set a scenario key as if the file wrote it (repeatable; keys: `trainsim fields`), "
                  "e.g. --set parallelism.tensor_parallel_size=4");
}

Scenario load_scenario_with(const std::string& file, const std::vector<std::string>& sets) {
  std::vector<KeyOverride> overrides;
  std::vector<Diagnostic> malformed;  // every one, not the first
  for (const std::string& s : sets) {
    try {
      overrides.push_back(parse_key_override(s));
    } catch (const ScenarioError& e) {
      malformed.insert(malformed.end(), e.diagnostics().begin(), e.diagnostics().end());
    }
  }
  if (!malformed.empty()) throw ScenarioError(std::move(malformed));
  // A published row (validation/published) runs as the scenario it states.
  if (const std::optional<std::string> row = validation::published_row_scenario_text(file))
    return load_scenario_text(*row, file, overrides);
  return load_scenario_file(file, overrides);
}

}  // namespace trainsim::cli
