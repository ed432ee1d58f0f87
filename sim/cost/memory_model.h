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

// All that the walk of a rank's program reads besides the program, per virtual stage.
struct ActivationTables {
  std::vector<double> act;          // bytes one micro-batch leaves until its backward
  std::vector<double> transient;    // extra during a backward: what recompute rebuilds (FSDP's loss: its gradients)
  std::vector<double> weight_pass;  // kept from a split backward's input pass for its weight pass
  // ZeRO-2/3: the unsharded gradient buckets (the one filled, the one reduce-scattered) while an
  // op that produces gradients runs (Backward, BackwardWeight); counted with the activations.
  // `unsharded`: two consecutive buckets of one op; an op that follows another gradient op with
  // no forward between them may fill its first bucket while the other's last is still reduced.
  std::vector<double> unsharded, first_bucket, last_bucket;
};
// Whether every number is the same, bit for bit: two such tables walk any program to the
// same peak (a sweep's configurations share a few: the micro-batch, recompute and sequence
// parallelism change them, rates and links do not).
bool same_bits(const ActivationTables& a, const ActivationTables& b);

// The largest activation bytes a rank holds during its program: each Forward adds its
// micro-batch's activations, the op that finishes that micro-batch's backward frees them; a
// backward adds what recompute rebuilds and (ZeRO-2/3) its unsharded buckets while it runs.
// Reads each op's kind, chunk and work and the tables, nothing else.
double activation_peak(const ActivationTables& tables, const RankProgram& prog);

class MemoryModel {
 public:
  explicit MemoryModel(const Plan& plan);
  // Activation bytes one micro-batch leaves on virtual stage `vstage` until its backward.
  double activations_per_microbatch(int vstage) const { return tables_.act.at(vstage); }
  // Breakdown at the peak of each rank's walk.
  std::vector<MemoryBreakdown> peak_per_rank(const Schedule& schedule) const;
  // The same for one rank's program.
  MemoryBreakdown peak_of(const RankProgram& prog) const { return breakdown(prog, activation_peak(tables_, prog)); }
  // The walk's inputs: activation_peak(activation_tables(), prog) is the activations of
  // peak_of(prog), and breakdown(prog, that) is peak_of(prog).
  const ActivationTables& activation_tables() const { return tables_; }
  MemoryBreakdown breakdown(const RankProgram& prog, double activation_peak) const;

 private:
  const Plan& plan_;
  ModelShape shape_;
  // Per virtual stage: activations per micro-batch; extra during a backward (full
  // recompute); what a split backward keeps from its input pass for its weight pass
  // (zero-bubble schedules): the gradients at the outputs of the layers that hold weights.
  ActivationTables tables_;
};

// Largest number of micro-batches whose activations a rank holds at once, per rank.
std::vector<int> max_in_flight_microbatches(const Schedule& schedule);

}  // namespace trainsim
