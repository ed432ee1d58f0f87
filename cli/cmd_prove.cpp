// trainsim prove FILE: plan the scenario, then validate the original and the redesign on a
// backend (the CPU's by default), and tell what was predicted and what was measured
// (validation/incident.h).
#include <unistd.h>

#include <iostream>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "core/scenario.h"
#include "validation/incident.h"

namespace trainsim::cli {

Command add_prove_command(CLI::App& app) {
  struct Options {
    std::string file, report;
    BackendChoice backend;
    int steps = 0;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand(
      "prove", "Plan the scenario, run the original and the redesign at the runtime's scaled size, and compare "
               "prediction with measurement (utilization, bubble, numerics)");
  sub->add_option("FILE", o->file, "Scenario YAML (the bundled incident: scenarios/postmortem-8x40gb.yaml)")->required();
  add_set_option(sub, o->sets);
  sub->add_option("--report", o->report, "Write DIR/report.md with its tables and pictures");
  sub->add_option("--steps", o->steps, "Optimizer steps per run (default: runtime.steps)")->check(CLI::PositiveNumber);
  add_backend_options(sub, o->backend);
  return {sub, [o, sub] {
            const Scenario scenario = load_scenario_with(o->file, o->sets);
            validation::ProveOptions po;
            po.backend = validation_backend(scenario, *sub, o->backend, "prove");
            po.steps = o->steps;
            po.progress = [](const std::string& s) { std::cerr << "prove: " << s << "\n"; };
            validation::IncidentReport r;
            try {
              r = validation::prove(scenario, po);
            } catch (const validation::NothingFeasible& e) {
              std::cerr << "error: " << e.what() << "\n";
              return kExitNothingFeasible;  // as sweep and plan
            }
            std::cout << validation::format_incident(r) << std::flush;
            if (!o->report.empty()) {
              const auto files = validation::write_incident_report(r, o->report);
              std::cerr << "wrote " << o->report << "/report.md and " << files.size() - 1 << " pictures\n";
            }
            return 0;
          }};
}

}  // namespace trainsim::cli
