// trainsim calibrate FILE [--backend cpu|cuda]: measure the backend's own rates at the shapes of
// the scenario's runtime plan into a hardware profile (core/hardware_profile.h) that scenarios
// name with `cluster.profile: FILE`, and print the communication table as nccl-tests does.
#include <unistd.h>

#include <iostream>
#include <memory>
#include <vector>
#include <stdexcept>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/scenario.h"
#include "runtime/backend.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/runtime_plan.h"
#include "validation/validate.h"

namespace trainsim::cli {

Command add_calibrate_command(CLI::App& app) {
  struct Options {
    std::string file, out, name;
    BackendChoice backend;
    std::vector<int> ranks;
    double max_mib = 64;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand(
      "calibrate", "Measure the backend's matrix-product, memory-bound kernel and communication rates at the "
                   "scenario's runtime shapes into a hardware profile (cluster.profile)");
  sub->add_option("FILE", o->file, "Scenario YAML whose runtime plan's kernels are measured")->required();
  add_set_option(sub, o->sets);
  add_backend_options(sub, o->backend);
  sub->add_option("-o,--out", o->out, "Write the profile here (default: print it)");
  sub->add_option("--name", o->name, "The profile's name (default: <backend>-<scenario name>)");
  sub->add_option("--ranks", o->ranks, "Collective group sizes to measure (default: 2 up to the cores, cpu, or the plan's ranks, cuda; doubling)");
  sub->add_option("--max-mib", o->max_mib, "Largest collective buffer, MiB (default 64, as nccl-tests -e 64M)")
      ->check(CLI::PositiveNumber);
  return {sub, [o, sub] {
            const Scenario scenario = load_scenario_with(o->file, o->sets);
            const runtime::Backend& backend = backend_for(scenario, *sub, o->backend);
            const runtime::RuntimePlan rp = runtime::make_runtime_plan(scenario);
            if (!backend.kernels || !backend.comm_ranks)
              throw std::invalid_argument("calibrate: the " + backend.name + " backend has no calibration");
            runtime::CalibrateOptions co;
            co.placement = single_process_placement(backend, o->backend, "calibrate");
            co.comm.max_bytes = static_cast<std::size_t>(o->max_mib * (1 << 20));
            co.comm.group_sizes = o->ranks;
            if (co.comm.group_sizes.empty()) {
              const int most = backend.comm_ranks(rp);
              for (int n = 2; n <= most; n *= 2) co.comm.group_sizes.push_back(n);
            }
            // The ring's halves, where the plan gathers or scatters (ZeRO, sequence parallelism):
            // the same doubling sizes as the all-reduce, so the profile prices them as measured.
            const validation::CommunicationSizes used = validation::communication_sizes(rp.plan);
            if (!used.all_gather.empty()) co.comm.all_gather_sizes = runtime::doubling_sizes(co.comm);
            if (!used.reduce_scatter.empty()) co.comm.reduce_scatter_sizes = runtime::doubling_sizes(co.comm);
            co.progress = [](const std::string& s) { std::cerr << "calibrate: " << s << "\n"; };
            runtime::CommBenchResult comm;
            const std::string name = o->name.empty() ? backend.name + "-" + scenario.config.name : o->name;
            const HardwareProfile p = runtime::calibrate_profile(backend, rp, name, co, &comm);
            std::cout << runtime::format_comm_table(comm);
            std::cout << fmt::format("\n# {} kernels of {} measured on {} ({})\n", p.kernels.size(),
                                     scenario.config.name, p.device, backend.kernel_clock);
            std::cout << fmt::format("# {:<26} {:>6} {:>32} {:>10} {:>12}\n", "kernel", "dtype", "shape", "time(us)",
                                     "rate");
            for (const KernelRate& k : p.kernels) {
              const std::string shape =
                  k.shape.is_matmul()
                      ? fmt::format("{}x{}x{}{}", k.shape.m, k.shape.n, k.shape.k,
                                    k.shape.batch > 1 ? fmt::format(" x{}", k.shape.batch) : "")
                      : fmt::format("{} elements", k.shape.elements);
              std::cout << fmt::format("  {:<26} {:>6} {:>32} {:>10.1f} {:>8.2f} {}\n", k.kernel, dtype_name(k.dtype),
                                       shape, k.seconds * 1e6, k.shape.is_matmul() ? k.rate() * 1e3 : k.rate(),
                                       k.shape.is_matmul() ? "GFLOP/s" : "GB/s");
            }
            if (o->out.empty())
              std::cout << "\n" << profile_to_yaml(p);
            else
              write_output(o->out, [&](std::ostream& out) { out << profile_to_yaml(p); },
                           "name it in a scenario with `cluster: {profile: " + o->out + "}`");
            return 0;
          }};
}

}  // namespace trainsim::cli
