// trainsim plan FILE: pick the best configuration that fits and explain what changed and why.
#include <iostream>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "core/scenario.h"
#include "sim/sweep/advice.h"
#include "sim/sweep/report.h"

namespace trainsim::cli {

std::function<void(const SweepProgress&)> terminal_progress();  // cmd_sweep.cpp

Command add_plan_command(CLI::App& app) {
  struct Options {
    std::string file, write_scenario;
    bool json = false, keep_precision = false;
    std::size_t runners_up = 5;
    unsigned threads = 0;
    double margin_pct = 100 * kPlanMargin;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand(
      "plan", "Pick the fastest configuration that fits, explain each change against the file's, advise on precision");
  sub->add_option("FILE", o->file, "Scenario YAML; its sweep: axes are the candidates (default: docs/sweep.md)")
      ->required();
  add_set_option(sub, o->sets);
  sub->add_flag("--json", o->json, "Print the plan as JSON, with the chosen configuration as a scenario fragment");
  sub->add_option("--write-scenario", o->write_scenario,
                  "Write the chosen configuration as a scenario file that trainsim simulate accepts");
  sub->add_option("--runners-up", o->runners_up, "Configurations shown after the chosen one")->capture_default_str();
  sub->add_flag("--keep-precision", o->keep_precision,
                "Search with the file's precision settings instead of applying the precision fixes");
  sub->add_option("--margin", o->margin_pct,
                  "Percent of tokens/s a change must gain to replace the file's configuration (default: the model's "
                  "own error, docs/sweep.md)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1000.0));
  sub->add_option("--threads", o->threads, "Worker threads (default: all cores)")->check(CLI::PositiveNumber);
  return {sub, [o] {
            const Scenario scenario = load_scenario_with(o->file, o->sets);
            PlanOptions options;
            options.threads = o->threads;
            options.runners_up = o->runners_up;
            options.fix_precision = !o->keep_precision;
            options.margin = o->margin_pct / 100;
            options.progress = terminal_progress();
            const PlanResult plan = make_plan(scenario, options);
            if (o->json)
              std::cout << plan_to_json(plan).dump(2) << "\n";
            else
              std::cout << format_plan(plan);
            std::cout << std::flush;
            if (!o->write_scenario.empty()) {
              if (!plan.chosen) throw std::runtime_error("no feasible configuration: nothing to write to " + o->write_scenario);
              write_output(o->write_scenario, [&](std::ostream& out) {
                out << scenario_fragment_yaml(plan.fragment, "Chosen by `trainsim plan " + o->file +
                                                                 "`.\nRun: trainsim simulate " + o->write_scenario);
              });
            }
            return plan.chosen ? 0 : kExitNothingFeasible;
          }};
}

}  // namespace trainsim::cli
