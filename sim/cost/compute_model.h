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
#include <memory>
#include <vector>

#include "core/hardware_profile.h"
#include "core/kernel_inventory.h"
#include "core/plan.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

// The buffers tensor parallelism's collectives move inside a virtual stage's ops, in bytes as a
// profile's all-reduce table is read (activations in `storage` bytes an element): what
// tensor_parallel_seconds prices (compute_model.cpp), and so the sizes a calibration must measure
// for it (validation::communication_sizes).
struct TensorParallelBuffers {
  double activation = 0;       // one micro-batch's rows x hidden: a layer's all-reduce (halves: SP's scatter, gather)
  double head_row_maxima = 0;  // the cross-entropy's row maxima across vocabulary shards (fp32)
  double head_row_sums = 0;    // its row sums and target logits (fp32)
  double norm_gradients = 0;   // SP: a layer's two norms' partial weight gradients (fp32)
  double final_norm_gradients = 0;  // SP: the final norm's (fp32)
};
TensorParallelBuffers tensor_parallel_buffers(const Plan& plan, int storage);

// `config` with every field cleared that neither the framework kernel inventory
// (core/kernel_inventory.h, InventoryTarget::framework) nor the shape part of its products'
// prices (their tiles on the SM count, their bytes in the compute format) reads, into `key`:
// the cluster's rates, links, efficiencies, memory and price, the names, the optimizer's
// settings and the runtime. Two plans whose configurations have equal keys launch the same
// kernels at the same shapes; tests/test_cost_models.cpp changes each cleared field on random
// plans and checks that.
void inventory_key_into(const ScenarioConfig& config, ScenarioConfig& key);

// The framework kernels of a plan's chunks, kept for the next plans with the same inventory
// (inventory_key_into): what RooflineComputeModel builds before it prices, and the larger part
// of its cost. A sweep's neighbours differ in rates and links, which only the pricing reads.
// One per thread (a sweep worker's Predictor holds one).
class KernelInventoryCache {
 public:
  KernelInventoryCache();
  ~KernelInventoryCache();
  KernelInventoryCache(const KernelInventoryCache&) = delete;
  KernelInventoryCache& operator=(const KernelInventoryCache&) = delete;

  struct Entry;
  // The inventory of `plan`'s chunks (built now if not kept), valid until the next call.
  const Entry& of(const Plan& plan);

 private:
  std::vector<std::unique_ptr<Entry>> entries_;  // most recently used first
  ScenarioConfig key_;
};

// One kernel of a virtual stage's op as the compute model prices it (what `trainsim simulate
// --kernels` prints): the inventory entry, its pass, its seconds for all `work.count` launches
// and what prices it.
struct PricedKernel {
  KernelWork work;
  enum class Pass { forward, backward_input, backward_weight } pass = Pass::forward;
  double seconds = 0;  // all launches (a calibrated profile's: times the pass's composition)
  // "compute" (a product or attention at its FLOP rate), "memory" (HBM bytes), "collective",
  // "measured" (a calibrated profile's rate for it).
  const char* bound = "memory";
};
// Every kernel of each virtual stage ([vs]) as RooflineComputeModel prices it, so their seconds
// per pass sum to its chunk(vs) (the first forward of a step aside): with a calibrated profile the
// runtime's kernels at its rates and composition, and tensor parallelism's collectives as a row
// per pass; without one the framework's kernels at the roofline.
std::vector<std::vector<PricedKernel>> kernel_prices(const Plan& plan);

class RooflineComputeModel final : public ComputeModel {
 public:
  // cache (optional): where the plan's kernel inventory is kept between plans; the prices are
  // the same with or without it.
  explicit RooflineComputeModel(const Plan& plan, KernelInventoryCache* cache = nullptr);
  // Pricing an op is a lookup (inline: the engine calls it once per op).
  Tick duration(const Op& op, int rank) const override { return price(op, rank, true); }
  // The op with every other core of its host idle: at the calibrated profile's core alone factor
  // instead of its core factor.
  Tick alone_duration(const Op& op, int rank) const { return price(op, rank, false); }
  // A calibrated profile's core factor and core alone factor for the op's rank (its tensor-parallel
  // shards' slowest; the optimizer step its first shard's): duration and alone_duration over the
  // op's price on the calibration core alone. 1 without them.
  double core_factor(const Op& op, int rank) const {
    if (op.kind == OpKind::OptimizerStep) return optimizer_factors_.empty() ? 1.0 : optimizer_factors_[rank][0];
    return rank_factors_.empty() ? 1.0 : rank_factors_[rank];
  }
  double alone_factor(const Op& op, int rank) const {
    if (op.kind == OpKind::OptimizerStep) return optimizer_factors_.empty() ? 1.0 : optimizer_factors_[rank][1];
    return rank_alone_factors_.empty() ? 1.0 : rank_alone_factors_[rank];
  }

  struct ChunkSeconds {
    double forward = 0, backward_input = 0, backward_weight = 0;
    // The chunk's first forward of a step (micro-batch 0), where a calibrated profile measured
    // it apart (Composition::first_forward); 0: at `forward`.
    double first_forward = 0;
    double backward() const { return backward_input + backward_weight; }
  };
  const ChunkSeconds& chunk(int vstage) const { return chunks_.at(vstage); }
  // Of a compute op's price, the share its in-op collectives take where a calibrated profile
  // prices them from its tables (tensor parallelism's unless the core factors hold them, context
  // parallelism's): measured with their member threads as the host ran them, not a kernel's work
  // on a core of its own. 0 for other ops and on the roofline path.
  double collective_share(const Op& op) const {
    if (op.chunk < 0 || static_cast<std::size_t>(op.chunk) >= collectives_.size()) return 0;
    const ChunkSeconds& c = collectives_[static_cast<std::size_t>(op.chunk)];
    const ChunkSeconds& all = chunks_[static_cast<std::size_t>(op.chunk)];
    auto of = [](double part, double whole) { return whole > 0 ? std::min(1.0, part / whole) : 0.0; };
    switch (op.kind) {
      case OpKind::Forward:
        return of(c.forward, op.microbatch == 0 && all.first_forward > 0 ? all.first_forward : all.forward);
      case OpKind::Backward: return of(c.backward(), all.backward());
      case OpKind::BackwardInput: return of(c.backward_input, all.backward_input);
      case OpKind::BackwardWeight: return of(c.backward_weight, all.backward_weight);
      default: return 0;
    }
  }

 private:
  void price_from_profile(const Plan& plan, const HardwareProfile& profile);
  Tick price(const Op& op, int rank, bool with_core_factor) const {
    int k = 0;
    switch (op.kind) {
      case OpKind::Forward: k = op.microbatch == 0 ? 4 : 0; break;  // a chunk's first forward of the step: cold
      case OpKind::Backward: k = 1; break;
      case OpKind::BackwardInput: k = 2; break;
      case OpKind::BackwardWeight: k = 3; break;
      case OpKind::OptimizerStep:
        return (with_core_factor || optimizer_alone_ticks_.empty() ? optimizer_ticks_ : optimizer_alone_ticks_)[rank];
      default: return 0;
    }
    const Tick whole = chunk_ticks_[op.chunk][k];
    // A backward split at bucket bounds: its share, rounded; segments sum to the whole within a tick each.
    const std::vector<double>& factors = with_core_factor ? rank_factors_ : rank_alone_factors_;
    const double share = op.work * (factors.empty() ? 1.0 : factors[rank]);
    return share == 1.0 ? whole : static_cast<Tick>(static_cast<double>(whole) * share + 0.5);
  }

  std::vector<ChunkSeconds> chunks_;
  std::vector<ChunkSeconds> collectives_;  // of chunks_, the table-priced collectives (calibrated only)
  // Pricing an op is a lookup: [chunk][Forward, Backward, BackwardInput, BackwardWeight, the
  // first Forward], and the optimizer step per rank.
  std::vector<std::array<Tick, 5>> chunk_ticks_;
  std::vector<Tick> optimizer_ticks_;
  std::vector<Tick> optimizer_alone_ticks_;  // at the core alone factor; empty: optimizer_ticks_
  std::vector<std::array<double, 2>> optimizer_factors_;  // by rank: core factor, core alone factor
  std::vector<double> rank_factors_;  // a calibrated profile's per-core factors, by rank; empty: all 1
  std::vector<double> rank_alone_factors_;  // its per-core alone factors, by rank; empty: all 1
};

}  // namespace trainsim
