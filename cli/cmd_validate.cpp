// trainsim validate FILE: calibrate, predict the runtime plan with the profile, run it, and
// print predicted vs measured with the error of each (validation/validate.h).
// trainsim validate --baselines DIR: the regression check over validation/baselines/.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/hardware_profile.h"
#include "core/scenario.h"
#include "validation/baselines.h"
#include "validation/validate.h"

namespace trainsim::cli {

Command add_validate_command(CLI::App& app) {
  struct Options {
    std::string file, profile, save_profile, trace, svg, baselines;
    BackendChoice backend;
    int steps = 0;
    bool json = false, synthetic = false, update = false, by_op = false, progress = false;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand(
      "validate", "Predict the scenario's runtime plan with a calibrated profile, run it, and compare the two");
  sub->add_option("FILE", o->file, "Scenario YAML (its runtime section says what runs)");
  add_set_option(sub, o->sets);
  add_backend_options(sub, o->backend);
  sub->add_option("--profile", o->profile, "A profile from `trainsim calibrate` (default: calibrate now)");
  sub->add_option("--save-profile", o->save_profile,
                  "Also write the profile the prediction was made with (calibrated now, or --profile's) to this file");
  sub->add_option("--steps", o->steps, "Optimizer steps to run (default: runtime.steps)")->check(CLI::PositiveNumber);
  sub->add_flag("--json", o->json, "Print {\"predicted\", \"measured\", \"error\", \"numerics\"} instead of the table");
  sub->add_flag("--by-op", o->by_op,
                "Also print, per rank, each kind of op's time in the step predicted against measured (where the error comes from)");
  sub->add_option("--trace", o->trace, "Write the predicted and the measured timelines as one Perfetto trace");
  sub->add_option("--svg", o->svg, "Write the predicted timeline above the measured one");
  sub->add_flag("--synthetic", o->synthetic, "Train on synthetic tokens instead of the corpus");
  sub->add_flag("--progress", o->progress,
                "Say on stderr what it is doing, with the seconds since it began (the default on a terminal)");
  sub->add_option("--baselines", o->baselines,
                  "Re-run every plan of this folder (validation/baselines) and check its errors against the "
                  "accepted ones");
  sub->add_flag("--update", o->update, "With --baselines: accept the errors measured now");
  return {sub, [o, sub] {
            const bool say = o->progress || isatty(STDERR_FILENO);
            const auto began = std::chrono::steady_clock::now();
            auto progress = [say, began](const std::string& s) {
              if (!say) return;
              const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
              std::cerr << fmt::format("validate: [{:.1f} s] {}\n", t, s);
            };
            if (!o->baselines.empty()) {
              if (!o->file.empty()) throw CLI::ValidationError("FILE", "give either FILE or --baselines, not both");
              if (!o->save_profile.empty())
                throw CLI::ValidationError("--save-profile", "names one file: give it with FILE, not --baselines");
              validation::BaselineOptions bo;
              bo.update = o->update;
              bo.progress = [](const std::string& s) { std::cerr << s << "\n"; };
              bo.backend_for = [o, sub](const Scenario& plan) {
                return validation_backend(plan, *sub, o->backend, "validate");
              };
              const validation::BaselineReport r = validation::check_baselines(o->baselines, bo);
              std::cout << validation::format_baseline_report(r);
              return r.passed ? 0 : kExitRunFailed;
            }
            if (o->file.empty()) throw CLI::RequiredError("FILE");
            const Scenario scenario = load_scenario_with(o->file, o->sets);
            validation::ValidateOptions vo;
            vo.backend = validation_backend(scenario, *sub, o->backend, "validate");
            vo.profile_path = o->profile;
            vo.steps = o->steps;
            vo.synthetic_data = o->synthetic;
            if (!scenario.config.runtime.data_path.empty()) {
              const auto beside =
                  std::filesystem::path(o->file).parent_path() / scenario.config.runtime.data_path;
              vo.data_path = std::filesystem::exists(beside) ? beside.string() : scenario.config.runtime.data_path;
            }
            vo.progress = progress;
            const validation::Validation v = validation::validate(scenario, vo);
            if (o->json)
              std::cout << validation::validation_to_json(v).dump(2) << "\n";
            else
              std::cout << validation::format_validation(v);
            if (o->by_op && !o->json)
              std::cout << "\n  where the step's time went, summed per kind of op:\n"
                        << validation::format_time_by_op_kind(validation::time_by_op_kind(v));
            if (!o->trace.empty())
              write_output(o->trace, [&](std::ostream& out) { validation::write_validation_trace(v, out); },
                           "open in https://ui.perfetto.dev");
            if (!o->svg.empty())
              write_output(o->svg, [&](std::ostream& out) { validation::write_validation_svg(v, out); });
            if (!o->save_profile.empty())
              write_output(o->save_profile, [&](std::ostream& out) { out << profile_to_yaml(v.profile); });
            return v.measured.failure ? kExitRunFailed : 0;
          }};
}

}  // namespace trainsim::cli
