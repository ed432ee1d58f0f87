// Memory per rank, from walking its program: model states are resident all step; each
// Forward adds its micro-batch's activations and the op that finishes that micro-batch's
// backward (Backward, or BackwardWeight when split) frees them, so the peak follows the
// schedule rather than a worst-case formula.
//
// Model states per parameter (ZeRO paper, Rajbhandari et al. 2020, mixed-precision Adam,
// K = 12): weights 2, gradients 2, optimizer 12 (FP32 master + two moments), i.e. 16P;
// stage 1: 4P + 12P/N; stage 2: 2P + 14P/N; stage 3: 16P/N, with N data-parallel ranks.
// Activations per layer and micro-batch: ModelShape::layer_activation_bytes (Korthikanti
// et al. 2022); the last stage also keeps the FP32 logits for the loss and the final norm's input
// and output.
#pragma once

#include <vector>

#include "core/plan.h"
#include "core/result.h"
#include "core/schedule.h"

namespace trainsim {

struct ModelStateBytes {
  double weights = 0, gradients = 0, optimizer = 0;
};

// Model-state bytes of one rank holding `params` parameters (its tensor-parallel share).
ModelStateBytes model_state_bytes(const Plan& plan, double params);

class MemoryModel {
 public:
  explicit MemoryModel(const Plan& plan);
  // Activation bytes one micro-batch leaves on virtual stage `vstage` until its backward.
  double activations_per_microbatch(int vstage) const { return act_.at(vstage); }
  // Breakdown at the peak of each rank's walk.
  std::vector<MemoryBreakdown> peak_per_rank(const Schedule& schedule) const;
  // The same for one rank's program.
  MemoryBreakdown peak_of(const RankProgram& prog) const;

 private:
  const Plan& plan_;
  ModelShape shape_;
  std::vector<double> act_;       // per virtual stage
  std::vector<double> transient_; // per virtual stage: extra during a backward (what recompute rebuilds)
  // Per virtual stage: what a split backward keeps from its input pass for its weight pass
  // (zero-bubble schedules): the gradients at the outputs of the layers that hold weights.
  std::vector<double> weight_pass_;
};

// Largest number of micro-batches whose activations a rank holds at once, per rank.
std::vector<int> max_in_flight_microbatches(const Schedule& schedule);

}  // namespace trainsim
