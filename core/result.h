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
  double exposed_comm_s = 0; // communication during which this rank's compute stream was idle
  double peak_memory_bytes = 0;
  MemoryBreakdown memory;    // at the peak
  friend bool operator==(const RankResult&, const RankResult&) = default;
};

struct Result {
  double step_time_s = 0;
  double bubble_fraction = 0;  // 1 - mean utilization
  double tokens_per_s = 0;
  double mfu = 0;              // model FLOPs / (step time * GPUs * peak of the compute format)
  double allreduce_time_s = 0; // max over ranks of the time in data-parallel collectives
  double exposed_comm_time_s = 0;  // max over ranks of communication not hidden under compute
  bool fits_in_memory = true;
  double memory_capacity_bytes = 0;
  std::vector<RankResult> ranks;
  std::vector<std::string> warnings;
  // Field by field, every field of every rank (tests compare predictions whole, so a field
  // added here is compared too).
  friend bool operator==(const Result&, const Result&) = default;
};

}  // namespace trainsim
