// Compute time of forward, backward and optimizer ops. With a calibrated hardware profile
// (cluster.profile) every kernel of the op (core/kernel_inventory.h) is priced at its measured
// time at its shape, and tensor parallelism's collectives inside the op from the profile's
// all-reduce measurements over tp ranks (compute_model.cpp, tensor_parallel_seconds).
// Otherwise roofline style:
//   matrix products: FLOPs / (peak rate of the compute format * compute_efficiency)
//   memory-bound work (activations written and read around the products, embedding
//   gather, softmax of the loss, optimizer update): bytes / HBM bandwidth
//   tensor parallelism: two all-reduces of b*s*h activations per layer in forward and two
//   in backward (Megatron's column/row split), on the intra-node link, not overlapped
// Backward is twice the forward's matrix products: the input gradient (B) and the weight
// gradient (W) each repeat the forward's weight products; attention's QK^T and AV have no
// weights, so both their backward products belong to B. Recompute adds the forward (full)
// or attention's QK^T and AV (selective) to B. The first stage also runs the embedding,
// the last the LM head and the loss, so equal layer counts still leave them heavier.
#pragma once

#include <array>
#include <vector>

#include "core/hardware_profile.h"
#include "core/plan.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

class RooflineComputeModel final : public ComputeModel {
 public:
  explicit RooflineComputeModel(const Plan& plan);
  // Pricing an op is a lookup (inline: the engine calls it once per op).
  Tick duration(const Op& op, int rank) const override {
    int k = 0;
    switch (op.kind) {
      case OpKind::Forward: k = 0; break;
      case OpKind::Backward: k = 1; break;
      case OpKind::BackwardInput: k = 2; break;
      case OpKind::BackwardWeight: k = 3; break;
      case OpKind::OptimizerStep: return optimizer_ticks_[rank];
      default: return 0;
    }
    const Tick whole = chunk_ticks_[op.chunk][k];
    // A backward split at bucket bounds: its share, rounded; segments sum to the whole within a tick each.
    const double share = op.work * (rank_factors_.empty() ? 1.0 : rank_factors_[rank]);
    return share == 1.0 ? whole : static_cast<Tick>(static_cast<double>(whole) * share + 0.5);
  }

  struct ChunkSeconds {
    double forward = 0, backward_input = 0, backward_weight = 0;
    double backward() const { return backward_input + backward_weight; }
  };
  const ChunkSeconds& chunk(int vstage) const { return chunks_.at(vstage); }

 private:
  void price_from_profile(const Plan& plan, const HardwareProfile& profile);

  std::vector<ChunkSeconds> chunks_;
  // Pricing an op is a lookup: [chunk][Forward, Backward, BackwardInput, BackwardWeight],
  // and the optimizer step per rank.
  std::vector<std::array<Tick, 4>> chunk_ticks_;
  std::vector<Tick> optimizer_ticks_;
  std::vector<double> rank_factors_;  // a calibrated profile's per-core factors, by rank; empty: all 1
};

}  // namespace trainsim
