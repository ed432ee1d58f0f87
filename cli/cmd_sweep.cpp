// trainsim sweep FILE: simulate every configuration of the scenario's `sweep:` axes and rank them.
#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "core/scenario.h"
#include "sim/sweep/report.h"
#include "sim/sweep/sweep.h"

namespace trainsim::cli {

// A progress bar on stderr when it is a terminal and the work has lasted over a second.
std::function<void(const SweepProgress&)> terminal_progress() {
  if (!::isatty(STDERR_FILENO)) return {};
  auto drawn = std::make_shared<bool>(false);
  return [drawn](const SweepProgress& p) {
    const bool finished = p.done >= p.total;
    if (p.elapsed_s < 1.0 && !*drawn) return;
    if (finished) {
      if (*drawn) std::cerr << "\r\033[K" << std::flush;  // leave the terminal clean
      return;
    }
    std::cerr << "\r" << format_progress(p) << "\033[K" << std::flush;
    *drawn = true;
  };
}

// --stats: the sweep's own figures, then the whole process so far (loading, expansion,
// evaluation, ranking and writing the outputs), both in CPU time.
void print_sweep_stats(const SweepResult& result) {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double cpu = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                     1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  std::cerr << "sweep stats: " << format_sweep_stats(result.stats, result.rows.size()) << "\n"
            << "sweep stats: whole command " << fmt::format("{:.3f}", cpu) << " s CPU: "
            << fmt::format("{:.0f}", cpu > 0 ? static_cast<double>(result.stats.evaluations) / cpu : 0.0)
            << " evaluations per CPU-second end to end\n";
}

Command add_sweep_command(CLI::App& app) {
  struct Options {
    std::string file, csv, svg, html;
    bool json = false, stats = false;
    std::size_t top = 10, infeasible = 10;
    unsigned threads = 0;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("sweep", "Simulate every configuration of the scenario's sweep: axes and rank them");
  sub->add_option("FILE", o->file, "Scenario YAML with a sweep: section (see docs/sweep.md)")->required();
  add_set_option(sub, o->sets);
  sub->add_option("--top", o->top, "Feasible configurations shown in the table")->capture_default_str();
  sub->add_option("--infeasible", o->infeasible, "Configurations that cannot run shown with their reason")
      ->capture_default_str();
  sub->add_flag("--json", o->json, "Print every configuration with its metrics as JSON instead of the table");
  sub->add_option("--csv", o->csv, "Write every configuration with its metrics as CSV");
  sub->add_option("--svg", o->svg, "Write a picture: throughput against peak memory per GPU, Pareto front marked");
  sub->add_option("--html", o->html,
                  "Write the same picture as an HTML page: hover any point for its configuration and figures");
  sub->add_option("--threads", o->threads, "Worker threads (default: one per core it may run on, e.g. under taskset)")
      ->check(CLI::PositiveNumber);
  sub->add_flag("--stats", o->stats,
                "After the outputs, print on stderr what the sweep cost: configurations evaluated (simulated) and "
                "rejected, evaluations per CPU-second, and the whole command's CPU time");
  return {sub, [o] {
            const Scenario scenario = load_scenario_with(o->file, o->sets);
            if (scenario.sweep.empty())
              std::cerr << o->file << ": no sweep: section; evaluating the file's own configuration (see docs/sweep.md; "
                                      "trainsim plan searches a default space)\n";
            SweepOptions options;
            options.threads = o->threads;
            options.progress = terminal_progress();
            const SweepResult result = run_sweep(scenario, options);
            if (o->json) {
              std::cout << sweep_to_json(result, scenario).dump(2) << "\n";
            } else {
              const std::string name = scenario.config.name.empty() ? o->file : scenario.config.name;
              std::cout << format_sweep_table(result, "sweep of " + name + " (" + o->file + ")", o->top,
                                              o->infeasible)
                        << format_sweep_notes(result, scenario);
            }
            std::cout << std::flush;
            if (!o->csv.empty()) write_output(o->csv, [&](std::ostream& out) { write_sweep_csv(result, out); });
            if (!o->svg.empty())
              write_output(o->svg, [&](std::ostream& out) { write_sweep_svg(result, scenario, out); });
            if (!o->html.empty())
              write_output(o->html, [&](std::ostream& out) { write_sweep_html(result, scenario, out); },
                           "open in a browser");
            if (o->stats) print_sweep_stats(result);
            return result.ranking.empty() ? kExitNothingFeasible : 0;
          }};
}

}  // namespace trainsim::cli
