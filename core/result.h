// The result of one step, predicted or measured, with the field names of DESIGN.md
// ("Machine-readable results"). Sizes are bytes and times seconds here; JSON reports GiB.
#pragma once

#include <string>
#include <vector>

#include "core/units.h"

namespace trainsim {

struct MemoryBreakdown {
  double weights = 0, gradients = 0, optimizer = 0, activations = 0, buffers = 0;  // bytes
  double total() const { return weights + gradients + optimizer + activations + buffers; }
  friend bool operator==(const MemoryBreakdown&, const MemoryBreakdown&) = default;
};

struct RankResult {
  int rank = 0, stage = 0, replica = 0;
  double busy_s = 0;         // compute stream busy
  double idle_s = 0;         // step time minus busy
  double utilization = 0;    // busy / step time
  double allreduce_s = 0;    // time in gradient and parameter collectives
  // idle_s split by what the compute stream waited for (they add up to idle_s):
  double pipeline_bubble_s = 0;  // a pipeline peer's activation or gradient (receives, drain)
  double exposed_comm_s = 0;     // this rank's collectives (data-parallel, ZeRO, embedding, found-inf)
  double peak_memory_bytes = 0;
  MemoryBreakdown memory;    // at the peak
  friend bool operator==(const RankResult&, const RankResult&) = default;
};

struct Result {
  double step_time_s = 0;
  double bubble_fraction = 0;  // 1 - mean utilization = pipeline_bubble_fraction + exposed_comm_fraction
  double pipeline_bubble_fraction = 0;  // mean over ranks of pipeline_bubble_s / step time
  double exposed_comm_fraction = 0;     // mean over ranks of exposed_comm_s / step time
  double tokens_per_s = 0;
  double mfu = 0;              // model FLOPs / (step time * GPUs * peak of the compute format)
  // Per GPU: tokens/s over cluster.num_gpus; model FLOP/s (no recompute, what MFU counts) and
  // hardware FLOP/s (recompute included), in TFLOP/s.
  double tokens_per_s_per_gpu = 0;
  double model_tflops_per_gpu = 0;
  double hardware_tflops_per_gpu = 0;
  // The whole run, when training.total_tokens (or train_steps) is given (else < 0): its wall
  // time at this step time, the GPU-hours, and their cost at cluster.price_per_gpu_hour (< 0
  // when no price is given).
  double time_to_train_s = -1;
  double gpu_hours = -1;
  double cost = -1;
  double allreduce_time_s = 0; // max over ranks of the time in data-parallel collectives
  double exposed_comm_time_s = 0;  // max over ranks of exposed_comm_s: collectives not hidden under compute
  bool fits_in_memory = true;
  double memory_capacity_bytes = 0;
  // Whose data-parallel sharding was simulated (parallelism.framework, resolved) and its
  // setting in that framework's words (Plan::framework_setting).
  std::string framework, framework_setting;
  std::vector<RankResult> ranks;
  std::vector<std::string> warnings;
  // Field by field, every field of every rank (tests compare predictions whole, so a field
  // added here is compared too).
  friend bool operator==(const Result&, const Result&) = default;
};

}  // namespace trainsim
