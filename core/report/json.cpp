#include <cmath>

#include "core/report/format.h"
#include "core/report/report.h"

namespace trainsim {

double round6(double x) {
  if (x == 0 || !std::isfinite(x)) return x;
  const double scale = std::pow(10.0, 5 - static_cast<int>(std::floor(std::log10(std::fabs(x)))));
  return std::round(x * scale) / scale;
}

namespace {
double r6(double x) { return round6(x); }
double gib(double bytes) { return round6(bytes_to_gib(bytes)); }
}  // namespace

nlohmann::ordered_json result_to_json(const Result& res) {
  nlohmann::ordered_json j;
  j["step_time_s"] = r6(res.step_time_s);
  j["bubble_fraction"] = r6(res.bubble_fraction);
  j["pipeline_bubble_fraction"] = r6(res.pipeline_bubble_fraction);
  j["exposed_comm_fraction"] = r6(res.exposed_comm_fraction);
  j["tokens_per_s"] = r6(res.tokens_per_s);
  j["mfu"] = r6(res.mfu);
  j["tokens_per_s_per_gpu"] = r6(res.tokens_per_s_per_gpu);
  j["model_tflops_per_gpu"] = r6(res.model_tflops_per_gpu);
  j["hardware_tflops_per_gpu"] = r6(res.hardware_tflops_per_gpu);
  auto given = [](double v) { return v >= 0 ? nlohmann::ordered_json(r6(v)) : nlohmann::ordered_json(); };
  j["time_to_train_s"] = given(res.time_to_train_s);
  j["gpu_hours"] = given(res.gpu_hours);
  j["cost"] = given(res.cost);
  j["allreduce_time_s"] = r6(res.allreduce_time_s);
  j["exposed_comm_time_s"] = r6(res.exposed_comm_time_s);
  j["fits_in_memory"] = res.fits_in_memory;
  j["memory_capacity_gib"] = gib(res.memory_capacity_bytes);
  j["framework"] = res.framework;
  j["framework_setting"] = res.framework_setting;
  auto ranks = nlohmann::ordered_json::array();
  for (const auto& r : res.ranks) {
    nlohmann::ordered_json e;
    e["rank"] = r.rank;
    e["stage"] = r.stage;
    e["replica"] = r.replica;
    e["busy_s"] = r6(r.busy_s);
    e["idle_s"] = r6(r.idle_s);
    e["utilization"] = r6(r.utilization);
    e["allreduce_s"] = r6(r.allreduce_s);
    e["pipeline_bubble_s"] = r6(r.pipeline_bubble_s);
    e["exposed_comm_s"] = r6(r.exposed_comm_s);
    e["peak_memory_gib"] = gib(r.peak_memory_bytes);
    e["memory_gib"] = {{"weights", gib(r.memory.weights)},
                       {"gradients", gib(r.memory.gradients)},
                       {"optimizer", gib(r.memory.optimizer)},
                       {"activations", gib(r.memory.activations)},
                       {"buffers", gib(r.memory.buffers)}};
    ranks.push_back(std::move(e));
  }
  j["ranks"] = std::move(ranks);
  j["warnings"] = res.warnings;
  return j;
}

}  // namespace trainsim
