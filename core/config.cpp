#include "core/config.h"

#include <algorithm>

#include <fmt/format.h>

namespace trainsim {

std::string_view schedule_name(ScheduleKind s) {
  switch (s) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved_1f1b: return "interleaved-1f1b";
    case ScheduleKind::zb_h1: return "zb-h1";
  }
  return "?";
}

std::string parallel_sizes_text(const ParallelismConfig& p) {
  std::string s = "data " + std::to_string(p.data_parallel_size) + " x pipeline " +
                  std::to_string(p.pipeline_parallel_size);
  if (p.virtual_pipeline_stages > 1) s += " (v=" + std::to_string(p.virtual_pipeline_stages) + ")";
  s += " x tensor " + std::to_string(p.tensor_parallel_size);
  if (p.context_parallel_size > 1) s += " x context " + std::to_string(p.context_parallel_size);
  return s;
}

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::selective: return "selective";
    case Recompute::full: return "full";
    case Recompute::selective_op: return "selective_op";
  }
  return "?";
}

int recomputed_layers(const TrainingConfig& t, int chunk_layers) {
  if (t.activation_recompute == Recompute::none) return 0;
  if (t.activation_recompute != Recompute::full || t.recompute_num_layers <= 0) return chunk_layers;
  return std::min(t.recompute_num_layers, chunk_layers);
}

std::string recompute_text(const TrainingConfig& t) {
  std::string s(recompute_name(t.activation_recompute));
  if (t.activation_recompute == Recompute::full && t.recompute_num_layers > 0)
    s += fmt::format(" (first {} layer{} a chunk)", t.recompute_num_layers, t.recompute_num_layers == 1 ? "" : "s");
  return s;
}

std::string_view runtime_backend_name(RuntimeBackend b) { return b == RuntimeBackend::cuda ? "cuda" : "cpu"; }

}  // namespace trainsim
