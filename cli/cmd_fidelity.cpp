// trainsim fidelity FOLDER|FILE...: predict every published row (validation/published/) and print
// predicted against published with the error of each row and of each source; --svg draws them,
// --check holds them against the accepted errors beside the rows (the CTest), --update accepts
// the errors of this run (validation/fidelity.h).
#include <filesystem>
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.h"
#include "validation/fidelity.h"

namespace trainsim::cli {

Command add_fidelity_command(CLI::App& app) {
  struct Options {
    std::vector<std::string> paths, set;
    std::string svg, accepted;
    bool check = false, update = false;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand(
      "fidelity", "Predict published measurements of real clusters (validation/published) and print the errors");
  sub->add_option("PATH", o->paths, "A folder of published rows (validation/published) or row files")->required();
  sub->add_option("--svg", o->svg, "Write predicted against published, log-log, with the diagonal and +-5% bands");
  sub->add_flag("--check", o->check,
                "Fail (exit 4) when a row moved from its accepted error or a source misses its target");
  sub->add_flag("--update", o->update, "Accept the errors of this run (rewrites accepted.yaml in the folder)");
  sub->add_option("--accepted", o->accepted, "The accepted errors (default: accepted.yaml in the folder)");
  sub->add_option("--set", o->set, "KEY=VALUE: set a scenario key in every row (what-if runs, ablations)");
  return {sub, [o] {
            std::vector<validation::PublishedFile> files;
            std::string folder;
            for (const auto& p : o->paths) {
              if (std::filesystem::is_directory(p)) {
                folder = p;
                for (auto& f : validation::load_published(p)) files.push_back(std::move(f));
              } else {
                files.push_back(validation::load_published_file(p));
              }
            }
            for (const auto& kv : o->set) {
              const auto eq = kv.find('=');
              if (eq == std::string::npos) throw CLI::ValidationError("--set", "expects KEY=VALUE, got " + kv);
              validation::override_all(files, kv.substr(0, eq), kv.substr(eq + 1));
            }
            const validation::FidelityReport r = validation::run_fidelity(files);
            std::cout << validation::format_fidelity(r);
            if (!o->svg.empty())
              write_output(o->svg, [&](std::ostream& out) { validation::write_fidelity_svg(r, out); });
            const std::string accepted_path =
                !o->accepted.empty() ? o->accepted
                                     : (std::filesystem::path(folder.empty() ? "." : folder) / "accepted.yaml").string();
            if (o->update) {
              validation::AcceptedErrors previous;
              if (std::filesystem::exists(accepted_path)) previous = validation::load_accepted(accepted_path);
              write_output(accepted_path,
                           [&](std::ostream& out) { out << validation::accepted_to_yaml(r, previous); });
              return 0;
            }
            if (o->check) {
              const validation::AcceptedErrors accepted = validation::load_accepted(accepted_path);
              for (const auto& m : validation::target_misses(r, accepted)) std::cout << "target not met: " << m << "\n";
              const auto problems = validation::check_fidelity(r, accepted);
              for (const auto& p : problems) std::cout << "FAIL " << p << "\n";
              std::cout << (problems.empty() ? "fidelity: passed\n" : fmt::format("fidelity: {} problem{}\n",
                                                                                   problems.size(),
                                                                                   problems.size() == 1 ? "" : "s"));
              return problems.empty() ? 0 : kExitRunFailed;
            }
            return 0;
          }};
}

}  // namespace trainsim::cli
