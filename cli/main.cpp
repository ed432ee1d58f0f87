// trainsim: predict, sweep, run and validate training configurations.
// Only this file exits the process; library code throws typed errors.
#include <cstdio>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/config_fields.h"
#include "core/plan.h"
#include "core/presets.h"
#include "core/report/report.h"
#include "core/scenario.h"
#include "sim/simulator.h"
#ifdef TRAINSIM_HAVE_CUDA
#include "kernels/device_info.h"
#endif

namespace {

using namespace trainsim;

constexpr int kExitBadInput = 2;
constexpr int kExitIoError = 3;

// Writes through a temporary file and renames, so a failed write never leaves half a file.
void write_file(const std::string& path, const std::function<void(std::ostream&)>& body) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    if (!out) throw std::runtime_error(fmt::format("cannot write {} (does the folder exist?)", path));
    body(out);
    out.flush();
    if (!out) throw std::runtime_error(fmt::format("writing {} failed", path));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error(fmt::format("cannot rename {} to {}", tmp, path));
}

int cmd_simulate(const std::string& file, bool json, const std::string& trace, const std::string& svg) {
  const Scenario scenario = load_scenario_file(file);
  const Plan plan = Plan::from_scenario(scenario);
  const Prediction p = predict(plan);
  if (json)
    std::cout << result_to_json(p.result).dump(2) << "\n";
  else
    std::cout << format_summary(plan, p.result);
  if (!trace.empty()) {
    write_file(trace, [&](std::ostream& o) { write_chrome_trace(plan, p.timeline, o); });
    std::cerr << fmt::format("wrote {} (open in https://ui.perfetto.dev)\n", trace);
  }
  if (!svg.empty()) {
    write_file(svg, [&](std::ostream& o) { write_timeline_svg(plan, p.timeline, p.result, o); });
    std::cerr << fmt::format("wrote {}\n", svg);
  }
  return 0;
}

int cmd_fields(bool markdown) {
  if (markdown) {
    std::cout << fields_reference_markdown();
    return 0;
  }
  for (const auto& f : scenario_fields()) {
    std::string type = field_kind_name(f.kind);
    if (f.kind == FieldKind::choice) type = fmt::format("{}", fmt::join(f.choices, "|"));
    std::cout << fmt::format("{:<46} {:<28} default {}{}\n    {}\n", f.path, type, field_default_text(f),
                             f.unit.empty() ? "" : " " + f.unit, f.help);
  }
  return 0;
}

int cmd_presets() {
  std::cout << "GPUs (cluster.gpu):\n";
  for (const auto& g : gpu_presets())
    std::cout << fmt::format("  {:<10} {:6.1f} GiB  fp16 {:6.1f}  bf16 {:6.1f}  fp8 {:6.1f} TFLOP/s  HBM {:5.0f} GB/s  "
                             "NVLink {:4.0f} GB/s  net {:4.1f} GB/s\n             {}\n",
                             g.name, g.memory_gib, g.peak_tflops.at(DType::fp16), g.peak_tflops.at(DType::bf16),
                             g.peak_tflops.at(DType::fp8), g.hbm_bandwidth_gbps, g.intra_node.bandwidth_gbps,
                             g.inter_node.bandwidth_gbps, g.summary);
  std::cout << "\nModels (model.preset):\n";
  for (const auto& mp : model_presets()) {
    const ModelShape s(mp.model);
    std::cout << fmt::format("  {:<14} {:7.2f}B params  L={:<4} h={:<6} heads={:<4} ffn={:<6} seq={:<5} vocab={:<6} {}\n",
                             mp.name, s.total_params() / 1e9, s.L, s.h, s.a, s.f, s.s, s.V, mp.summary);
  }
  std::cout << "\nSources: docs/presets.md\n";
  return 0;
}

int cmd_devices() {
#ifdef TRAINSIM_HAVE_CUDA
  const CudaInventory inv = query_cuda_devices();
  std::cout << fmt::format("CUDA runtime {}.{}, NCCL {}\n", inv.runtime_version / 1000, (inv.runtime_version % 1000) / 10,
                           inv.nccl_version);
  if (inv.devices.empty()) {
    std::cout << "no usable GPU: " << inv.error << "\n";
    return 0;
  }
  for (const auto& d : inv.devices)
    std::cout << fmt::format("  GPU {}: {} ({:.1f} GiB, {} SMs, compute capability {}.{})\n", d.index, d.name,
                             d.memory_gib, d.multiprocessors, d.compute_capability_major, d.compute_capability_minor);
#else
  std::cout << "built without CUDA (no nvcc at configure time); only the CPU backend is available\n";
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainsim: predict, then prove, the step time, memory and numerics of a parallel training "
               "configuration"};
  app.set_version_flag("--version", "trainsim 0.1.0");
  app.require_subcommand(1);

  std::string file, trace, svg;
  bool json = false, markdown = false;
  auto* sim = app.add_subcommand("simulate", "Predict one step of the scenario's configuration");
  sim->add_option("FILE", file, "Scenario YAML (e.g. scenarios/postmortem-8x40gb.yaml)")->required();
  sim->add_flag("--json", json, "Print the result object (DESIGN.md field names) instead of the summary");
  sim->add_option("--trace", trace, "Write a Chrome/Perfetto trace of the predicted step");
  sim->add_option("--svg", svg, "Write an SVG picture of the predicted timeline");

  auto* fields = app.add_subcommand("fields", "List every scenario key with its default, unit and meaning");
  fields->add_flag("--markdown", markdown, "As the markdown table of docs/scenario-reference.md");
  auto* presets = app.add_subcommand("presets", "List the GPU and model presets");
  auto* devices = app.add_subcommand("devices", "List the CUDA devices this machine has");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*sim) return cmd_simulate(file, json, trace, svg);
    if (*fields) return cmd_fields(markdown);
    if (*presets) return cmd_presets();
    if (*devices) return cmd_devices();
  } catch (const ScenarioError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << format_diagnostic(d) << "\n";
    std::cerr << fmt::format("{} error{} in the scenario; nothing was simulated\n", e.diagnostics().size(),
                             e.diagnostics().size() == 1 ? "" : "s");
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return kExitIoError;
  }
  return 0;
}
