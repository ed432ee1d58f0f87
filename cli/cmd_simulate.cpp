// trainsim simulate FILE: predict one step of the scenario's own configuration.
#include <iostream>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "core/plan.h"
#include "core/report/report.h"
#include "core/scenario.h"
#include "sim/simulator.h"

namespace trainsim::cli {

Command add_simulate_command(CLI::App& app) {
  struct Options {
    std::string file, trace, svg;
    bool json = false;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("simulate", "Predict one step of the scenario's configuration");
  sub->add_option("FILE", o->file, "Scenario YAML (e.g. scenarios/postmortem-8x40gb.yaml)")->required();
  add_set_option(sub, o->sets);
  sub->add_flag("--json", o->json, "Print the result object (DESIGN.md field names) instead of the summary");
  sub->add_option("--trace", o->trace, "Write a Chrome/Perfetto trace of the predicted step");
  sub->add_option("--svg", o->svg, "Write an SVG picture of the predicted timeline");
  return {sub, [o] {
            const Scenario scenario = load_scenario_with(o->file, o->sets);
            const Plan plan = Plan::from_scenario(scenario);
            const Prediction p = predict(plan);
            if (o->json)
              std::cout << result_to_json(p.result).dump(2) << "\n";
            else
              std::cout << format_summary(plan, p.result);
            if (!o->trace.empty())
              write_output(o->trace, [&](std::ostream& out) { write_chrome_trace(plan, p.timeline, out); },
                           "open in https://ui.perfetto.dev");
            if (!o->svg.empty())
              write_output(o->svg, [&](std::ostream& out) { write_timeline_svg(plan, p.timeline, p.result, out); });
            return 0;
          }};
}

}  // namespace trainsim::cli
