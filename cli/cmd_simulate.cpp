// trainsim simulate FILE: predict one step of the scenario's own configuration.
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.h"
#include "core/plan.h"
#include "core/report/report.h"
#include "core/scenario.h"
#include "sim/cost/compute_model.h"
#include "sim/simulator.h"

namespace trainsim::cli {

namespace {

std::string shape_text(const KernelWork& w) {
  const KernelShape& s = w.shape;
  if (s.is_matmul())
    return s.batch > 1 ? fmt::format("{}x{}x{} x{}", s.m, s.n, s.k, s.batch) : fmt::format("{}x{}x{}", s.m, s.n, s.k);
  return fmt::format("{:.1f} MiB", w.bytes / (1024.0 * 1024.0));
}

// Each distinct virtual stage's kernels, one micro-batch, as the compute model prices them
// (kernel_prices: the roofline's, or a calibrated profile's).
std::string format_kernel_prices(const Plan& plan) {
  std::string out;
  if (plan.config.cluster.calibrated)
    out += fmt::format("\nkernels at the calibrated profile {}'s rates (the runtime's kernels; each pass times its in-layer "
                       "composition)\n",
                       plan.config.cluster.calibrated->name);
  const std::vector<std::vector<PricedKernel>> chunks = kernel_prices(plan);
  auto same = [](const std::vector<PricedKernel>& x, const std::vector<PricedKernel>& y) {
    return std::equal(x.begin(), x.end(), y.begin(), y.end(), [](const PricedKernel& a, const PricedKernel& b) {
      return a.work.kernel == b.work.kernel && a.work.shape == b.work.shape && a.work.bytes == b.work.bytes &&
             a.work.count == b.work.count && a.seconds == b.seconds;
    });
  };
  for (int vs = 0; vs < static_cast<int>(chunks.size()); ++vs) {
    const std::vector<PricedKernel>& ks = chunks[static_cast<std::size_t>(vs)];
    if (std::any_of(chunks.begin(), chunks.begin() + vs, [&](const auto& earlier) { return same(earlier, ks); }))
      continue;
    double passes[3] = {0, 0, 0};
    for (const PricedKernel& k : ks) passes[static_cast<int>(k.pass)] += k.seconds;
    const double total = passes[0] + passes[1] + passes[2];
    out += fmt::format("\nvirtual stage {} ({} layers), one micro-batch: forward {:.3f} ms, backward input {:.3f} ms, "
                       "weight {:.3f} ms\n",
                       vs, plan.layers_per_virtual_stage[static_cast<std::size_t>(vs)], passes[0] * 1e3,
                       passes[1] * 1e3, passes[2] * 1e3);
    out += fmt::format("  {:<6} {:<40} {:<5} {:>22} {:>5} {:>10} {:>6} {:>12}  {}\n", "pass", "kernel", "type", "shape",
                       "count", "ms", "share", "rate", "bound");
    static const char* kPass[] = {"F", "B", "W"};
    for (const PricedKernel& k : ks) {
      const KernelWork& w = k.work;
      std::string rate;
      const double each = k.seconds / std::max(1, w.count);
      // A collective's rate is its bytes'; a context-parallel ring entry (the attention kernel's
      // shape, one step's bytes, only what its sends add beside that kernel) has none to show.
      const bool collective = std::string_view(k.bound) == "collective";
      if (each > 0 && w.shape.is_matmul() && !collective)
        rate = fmt::format("{:.1f} TF/s", w.shape.flops() / each / 1e12);
      else if (each > 0 && w.bytes > 0 && !(collective && w.shape.is_matmul()))
        rate = fmt::format("{:.0f} GB/s", w.bytes / each / 1e9);
      out += fmt::format("  {:<6} {:<40} {:<5} {:>22} {:>5} {:>10.3f} {:>5.1f}% {:>12}  {}\n",
                         kPass[static_cast<int>(k.pass)], w.kernel, dtype_name(w.dtype), shape_text(w), w.count,
                         k.seconds * 1e3, total > 0 ? 100 * k.seconds / total : 0.0, rate, k.bound);
    }
    double by_bound[3] = {0, 0, 0};
    double measured = 0;
    for (const PricedKernel& k : ks) {
      const std::string_view b = k.bound;
      if (b == "measured")
        measured += k.seconds;
      else
        by_bound[b == "compute" ? 0 : b == "memory" ? 1 : 2] += k.seconds;
    }
    auto pct = [&](double x) { return total > 0 ? 100 * x / total : 0.0; };
    if (measured > 0)
      out += fmt::format("  measured {:.1f}%, at the roofline {:.1f}%, collectives {:.1f}% of the chunk's {:.3f} ms\n",
                         pct(measured), pct(by_bound[0] + by_bound[1]), pct(by_bound[2]), total * 1e3);
    else
      out += fmt::format("  compute-bound {:.1f}%, memory-bound {:.1f}%, collectives {:.1f}% of the chunk's {:.3f} ms\n",
                         pct(by_bound[0]), pct(by_bound[1]), pct(by_bound[2]), total * 1e3);
  }
  return out;
}

}  // namespace

Command add_simulate_command(CLI::App& app) {
  struct Options {
    std::string file, trace, svg;
    bool json = false, kernels = false;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("simulate", "Predict one step of the scenario's configuration");
  sub->add_option("FILE", o->file,
                 "Scenario YAML (e.g. scenarios/postmortem-8x40gb.yaml), or a published row (validation/published: its "
                 "scenario)")
      ->required();
  add_set_option(sub, o->sets);
  auto* json = sub->add_flag("--json", o->json, "Print the result object (DESIGN.md field names) instead of the summary");
  sub->add_flag("--kernels", o->kernels,
                "Also list every kernel of each distinct pipeline chunk with its price, rate and bound (one micro-batch)")
      ->excludes(json);
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
            if (o->kernels) std::cout << format_kernel_prices(plan);
            if (!o->trace.empty())
              write_output(o->trace, [&](std::ostream& out) { write_chrome_trace(plan, p.timeline, out); },
                           "open in https://ui.perfetto.dev");
            if (!o->svg.empty())
              write_output(o->svg, [&](std::ostream& out) { write_timeline_svg(plan, p.timeline, p.result, out); });
            return 0;
          }};
}

}  // namespace trainsim::cli
