// trainsim fields | presets | devices: what a scenario may say, and what this machine has.
#include <iostream>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/commands.h"
#include "core/config_fields.h"
#include "core/model_shape.h"
#include "core/presets.h"
#ifdef TRAINSIM_HAVE_CUDA
#include "kernels/device_info.h"
#endif

namespace trainsim::cli {

Command add_fields_command(CLI::App& app) {
  auto markdown = std::make_shared<bool>(false);
  auto* sub = app.add_subcommand("fields", "List every scenario key with its default, unit and meaning");
  sub->add_flag("--markdown", *markdown, "As the markdown table of docs/scenario-reference.md");
  return {sub, [markdown] {
            if (*markdown) {
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
          }};
}

Command add_presets_command(CLI::App& app) {
  auto* sub = app.add_subcommand("presets", "List the GPU and model presets");
  auto markdown = std::make_shared<bool>(false);
  sub->add_flag("--markdown", *markdown, "The model table of docs/presets.md");
  return {sub, [markdown] {
            if (*markdown) {
              std::cout << model_presets_markdown();
              return 0;
            }
            std::cout << "GPUs (cluster.gpu):\n";
            for (const auto& g : gpu_presets())
              std::cout << fmt::format(
                  "  {:<10} {:6.1f} GiB  fp16 {:6.1f}  bf16 {:6.1f}  fp8 {:6.1f} TFLOP/s  HBM {:5.0f} GB/s  "
                  "NVLink {:4.0f} GB/s  net {:4.1f} GB/s\n             {}\n",
                  g.name, g.memory_gib, g.peak_tflops.at(DType::fp16), g.peak_tflops.at(DType::bf16),
                  g.peak_tflops.at(DType::fp8), g.hbm_bandwidth_gbps, g.intra_node.bandwidth_gbps,
                  g.inter_node.bandwidth_gbps, g.summary);
            std::cout << "\nModels (model.preset):\n";
            for (const auto& mp : model_presets()) {
              const ModelShape s(mp.model);
              std::cout << fmt::format(
                  "  {:<14} {:>8} params  L={:<4} h={:<6} heads={:<4} ffn={:<6} seq={:<5} vocab={:<6} {}\n",
                  mp.name, format_params(s.total_params()), s.L, s.h, s.a, s.f, s.s, s.V, mp.summary);
            }
            std::cout << "\nSources: docs/presets.md\n";
            return 0;
          }};
}

Command add_devices_command(CLI::App& app) {
  auto* sub = app.add_subcommand("devices", "List the CUDA devices this machine has");
  return {sub, [] {
#ifdef TRAINSIM_HAVE_CUDA
            const CudaInventory inv = query_cuda_devices();
            std::cout << fmt::format("CUDA runtime {}.{}, NCCL {}\n", inv.runtime_version / 1000,
                                     (inv.runtime_version % 1000) / 10, inv.nccl_version);
            if (inv.devices.empty()) {
              std::cout << "no usable GPU: " << inv.error << "\n";
              return 0;
            }
            for (const auto& d : inv.devices)
              std::cout << fmt::format("  GPU {}: {} ({:.1f} GiB, {} SMs, compute capability {}.{})\n", d.index,
                                       d.name, d.memory_gib, d.multiprocessors, d.compute_capability_major,
                                       d.compute_capability_minor);
#else
            std::cout << "built without CUDA (no nvcc at configure time); only the CPU backend is available\n";
#endif
            return 0;
          }};
}

}  // namespace trainsim::cli
