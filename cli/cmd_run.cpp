// trainsim run FILE: execute the scenario's plan for real on a backend and measure it.
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/report/report.h"
#include "core/scenario.h"
#include "runtime/backend.h"
#include "runtime/loop/run_loop.h"
#include "runtime/loop/run_report.h"

namespace trainsim::cli {

namespace {

// runtime.data.path is relative to the scenario file; an absolute path or one that exists
// from the working directory is taken as it is.
std::string resolve_data_path(const std::string& scenario_file, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty() || fs::path(path).is_absolute()) return path;
  const fs::path beside = fs::path(scenario_file).parent_path() / path;
  if (fs::exists(beside)) return beside.string();
  return path;
}

}  // namespace

Command add_run_command(CLI::App& app) {
  struct Options {
    std::string file, trace, svg, resume, checkpoint_dir;
    BackendChoice backend;
    int steps = 0, checkpoint_every = -1;
    bool json = false, synthetic = false, no_pin = false;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("run", "Execute the scenario's plan for real (the runtime section's model) and measure it");
  sub->add_option("FILE", o->file, "Scenario YAML")->required();
  add_set_option(sub, o->sets);
  add_backend_options(sub, o->backend);
  sub->add_option("--steps", o->steps, "Optimizer steps (default: runtime.steps)")->check(CLI::PositiveNumber);
  sub->add_flag("--json", o->json, "Print the measured result object with per-step numerics instead of the summary");
  sub->add_option("--trace", o->trace, "Write a Chrome/Perfetto trace of the measured step");
  sub->add_option("--svg", o->svg, "Write an SVG of the measured timeline and the loss curve");
  sub->add_option("--resume", o->resume, "Continue from a checkpoint file or folder (its latest)");
  sub->add_option("--checkpoint-dir", o->checkpoint_dir, "Write checkpoints here (default: runtime.checkpoint.dir)");
  sub->add_option("--checkpoint-every", o->checkpoint_every, "Steps between checkpoints (default: runtime.checkpoint.every_steps)");
  sub->add_flag("--synthetic", o->synthetic, "Train on synthetic tokens instead of the corpus");
  sub->add_flag("--no-pin", o->no_pin, "Do not pin rank threads to cores");
  return {sub, [o, sub] {
            const Scenario scenario = load_scenario_with(o->file, o->sets);
            const runtime::Backend& backend = backend_for(scenario, *sub, o->backend);
            const runtime::RuntimePlan rp = runtime::make_runtime_plan(scenario);
            const auto& rt = scenario.config.runtime;

            runtime::RunOptions opt;
            opt.steps = o->steps;
            opt.synthetic_data = o->synthetic || rt.data_synthetic;
            opt.data_path = resolve_data_path(o->file, rt.data_path);
            opt.checkpoint_dir = o->checkpoint_dir.empty() ? rt.checkpoint_dir : o->checkpoint_dir;
            opt.checkpoint_every_steps = o->checkpoint_every >= 0 ? o->checkpoint_every : rt.checkpoint_every_steps;
            if (!opt.checkpoint_dir.empty() && opt.checkpoint_every_steps == 0) opt.checkpoint_every_steps = rt.steps;
            opt.resume_from = o->resume;
            opt.pin_threads = !o->no_pin;
            opt.placement = placement_for(backend, o->backend);
            const int total = o->steps > 0 ? o->steps : rt.steps;
            const bool prints = prints_output(backend);
            if (prints && isatty(STDERR_FILENO))
              opt.on_step = [total](const runtime::StepRecord& s) {
                std::cerr << fmt::format("\rstep {:>4}/{}  loss {:8.4f}  scale {:>8g}  {:6.1f} ms{}", s.step, total, s.loss,
                                         s.loss_scale, s.step_time_s * 1e3, s.skipped_ranks ? "  (skipped)" : "          ")
                          << std::flush;
              };
            const runtime::RunReport report = runtime::run(backend, rp, opt);
            if (prints && isatty(STDERR_FILENO)) std::cerr << "\n";
            if (!prints) return report.failure ? kExitRunFailed : 0;

            if (o->json)
              std::cout << runtime::run_to_json(report).dump(2) << "\n";
            else
              std::cout << runtime::format_run_summary(report);
            if (!o->trace.empty())
              write_output(o->trace,
                           [&](std::ostream& out) { write_chrome_trace(rp.plan, report.timeline, out); },
                           "open in https://ui.perfetto.dev");
            if (!o->svg.empty()) write_output(o->svg, [&](std::ostream& out) { runtime::write_run_svg(report, out); });
            return report.failure ? kExitRunFailed : 0;
          }};
}

}  // namespace trainsim::cli
