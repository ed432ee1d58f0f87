// What a step of the schedule asks of every engine, worked out once from the plan and the
// schedule: message tags, gradient buckets as element ranges, which buffers and model chunks an
// op touches, how a backward cut at bucket bounds proceeds, the all-reduce's divide, the gradient
// norm's share and clipping, and what a device engine allocates or connects before the first step
// (stashes in flight, reduction groups, point-to-point links). Engines keep only how the work
// is done on their device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/plan.h"
#include "core/schedule.h"
#include "runtime/comm/communicator.h"
#include "runtime/engine/world.h"
#include "runtime/model/stage_model.h"

namespace trainsim::runtime {

// Tags: point-to-point messages and collectives of step `step` live in separate ranges, so
// nothing of one step can be mistaken for another's.
inline constexpr std::uint64_t kCollectiveTag = 1ull << 62;
inline std::uint64_t message_tag(int step, int channel) {
  return (static_cast<std::uint64_t>(step) << 32) | static_cast<std::uint32_t>(channel);
}
inline std::uint64_t collective_tag(int step, int id) { return kCollectiveTag | message_tag(step, id); }
// Part `part` (0..255) of collective `id` when one op runs several collectives (ZeRO-3 gathers a
// unit at a time); collective ids stay below 2^24.
inline std::uint64_t collective_tag(int step, int id, int part) {
  return collective_tag(step, id) | (static_cast<std::uint64_t>(part & 0xff) << 24);
}
// The gradient norm's sum over every rank (not in the schedule): the id after the schedule's collectives.
inline std::uint64_t norm_tag(int step, const Schedule& schedule) {
  return collective_tag(step, static_cast<int>(schedule.collectives.size()));
}
// The tensor-parallel collectives inside a step's forwards and backwards (not ops of the schedule:
// the simulator prices them inside the compute ops) count up from this tag, in the order a shard
// runs them, the same on every member of a group (runtime/model/model_parallel.h).
inline std::uint64_t tensor_parallel_tag(int step) { return kCollectiveTag | (1ull << 61) | message_tag(step, 0); }
// The context-parallel collectives inside them (the keys' and values' gathers and their gradients'
// reduce-scatters) likewise, from their own tag.
inline std::uint64_t context_parallel_tag(int step) { return kCollectiveTag | (1ull << 60) | message_tag(step, 0); }

// Gradient buckets of every virtual stage as element ranges of its gradient buffer: the
// schedule sizes them in bytes of the scenario's all-reduce format; the same fractions of the
// executed model's buffer are reduced together.
using BucketRanges = std::vector<std::pair<std::size_t, std::size_t>>;  // [bucket], [lo, hi)
struct GradientBuckets {
  std::vector<BucketRanges> ranges;       // [vstage]
  std::vector<int> bucket_of_collective;  // per collective: its bucket index, -1 if not a gradient bucket
};
GradientBuckets gradient_buckets(const Schedule& schedule, int virtual_stages,
                                 const std::vector<std::size_t>& gradient_elements_per_vstage);

// Where an op of a rank's program lives: its chunk among the rank's model chunks (local chunk j
// holds virtual stage j * pp + stage), and its slot among the rank's per-micro-batch buffers.
struct StepShape {
  int microbatches = 1, pp = 1, vpp = 1, virtual_stages = 1;
  explicit StepShape(const Plan& plan)
      : microbatches(plan.num_microbatches), pp(plan.pp), vpp(plan.vpp), virtual_stages(plan.num_virtual_stages()) {}
  int local_chunk(const Op& op) const { return op.chunk / pp; }
  int slot(const Op& op) const { return local_chunk(op) * microbatches + op.microbatch; }
  std::size_t slots() const { return static_cast<std::size_t>(vpp) * static_cast<std::size_t>(microbatches); }
  int vstage_of_chunk(int stage, int chunk) const { return chunk * pp + stage; }
  bool first(int vstage) const { return vstage == 0; }
  bool last(int vstage) const { return vstage == virtual_stages - 1; }
  // A rank reads micro-batches when a chunk of it holds the embedding or the head.
  bool needs_data(int stage) const { return stage == 0 || stage == pp - 1 || vpp > 1; }
};

// Backward (or one segment of a backward cut at gradient-bucket bounds: segment k runs units
// until bucket k's gradients are final, the last one runs the rest) on a model with StageModel's
// unit interface (CPU StageModel, CudaStageModel). `units_done` counts the micro-batch's units
// across segments. Runs backward_begin with `grad_output` on the first segment; returns true when
// this was the final segment, whose caller then runs backward_end.
template <class Model, class Buffer>
bool backward_segment(Model& model, const Op& op, const BucketRanges& buckets, int& units_done,
                      const Buffer& grad_output, float loss_gradient_scale) {
  const bool segmented = op.bucket >= 0;
  if (!segmented || op.bucket == 0) model.backward_begin(op.microbatch, grad_output, loss_gradient_scale);
  const bool final_segment = !segmented || op.bucket + 1 >= static_cast<int>(buckets.size());
  const std::size_t needed = final_segment ? 0 : buckets[static_cast<std::size_t>(op.bucket)].second;
  while (units_done < model.backward_units() &&
         (final_segment || model.gradients_complete(op.microbatch) < needed)) {
    model.backward_unit(op.microbatch);
    ++units_done;
  }
  return final_segment;
}

// A split backward's weight pass (BackwardWeight) cut at the same bounds: segment k runs weight
// units until bucket k's gradients are final, the last one the rest (which frees the stash).
template <class Model>
void weight_segment(Model& model, const Op& op, const BucketRanges& buckets) {
  const bool final_segment = op.bucket < 0 || op.bucket + 1 >= static_cast<int>(buckets.size());
  if (final_segment) return model.backward_weight(op.microbatch);
  const std::size_t needed = buckets[static_cast<std::size_t>(op.bucket)].second;
  while (model.gradients_complete(op.microbatch) < needed) model.backward_weight_unit(op.microbatch);
}

// The gradients a collective reduces, as [offset, offset + count) of its chunk's gradient buffer:
// its bucket's range, or (op.bucket < 0) the tied embedding's.
std::pair<std::size_t, std::size_t> collective_range(const Op& op, const GradientBuckets& buckets,
                                                    const ParamInfo& token_embedding);
// How a collective divides by its members: a data-parallel gradient all-reduce as the plan says,
// anything else (the tied embedding's sum) not at all.
Divide divide_of(const Collective& collective, const PrecisionConfig& precision);
// What a report calls the all-reduce of `op` when it made the first inf/NaN:
// "fp16 all-reduce of gradient bucket 0", "bf16 all-reduce of the tied embedding gradient".
std::string allreduce_label(const Op& op, DType wire);

// A rank's share of the global squared gradient norm covers its stage's gradients once per
// replica; the last virtual stage's copy of a tied embedding is not counted again, nor, on a
// tensor-parallel shard other than the first, the parameters every shard holds the same copy of
// (Megatron counts those on shard 0). The ranges [begin, end) of chunk `vstage`'s gradients
// counted, ascending.
std::vector<std::pair<std::size_t, std::size_t>> norm_ranges(int vstage, int virtual_stages,
                                                             const std::vector<ParamInfo>& params,
                                                             const ParamInfo& token_embedding, int tensor_parallel_rank);
// The clipping coefficient for a gradient norm: clip / (norm + 1e-6) above `clip` (when > 0), else 1.
float clip_coefficient(double clip, double norm);
// The last stage seeds its backward with loss_scale / micro-batches: summed micro-batch gradients
// are then the scaled mean.
inline float loss_gradient_scale(double loss_scale, int microbatches) {
  return static_cast<float>(loss_scale / microbatches);
}

// The schedule's entry for collective op `op`. Throws std::logic_error for an op that names none: a
// local overflow check (channel -1: each rank checks its own gradients, nothing is exchanged) or
// a channel past the schedule's collectives.
const Collective& collective_of(const Schedule& schedule, const Op& op);

// The ranks of `world` a collective of the schedule runs over on shard `shard` of its cells: for
// gradients and parameters the shards of each member cell that hold its slice of the weights
// (World::members: every context-parallel rank's), for the tied embedding's sum that shard of each
// (World::counterparts), for the global overflow check every shard of them.
std::vector<int> collective_members(const Collective& collective, const World& world, int shard);

// The member sets of every collective the engines run, in a fixed order (the schedule's
// collectives shard by shard, the tensor- and context-parallel groups, then the global gradient-norm sum over
// all ranks), each once: what a communicator must be able to reduce over (NCCL splits a
// communicator per set).
std::vector<std::vector<int>> reduction_groups(const Schedule& schedule, const World& world);

// What one chunk (virtual stage `chunk`) of a rank holds at once during a step, from its
// program: forward stashes (a micro-batch's Forward to the op that ends its backward: the final
// Backward segment, or the BackwardWeight that runs the weight pass), whole backwards in progress
// (first Backward segment to last) and zero-bubble ones (BackwardInput to BackwardWeight). What
// a device engine allocates before the first step.
struct InFlight {
  int stashes = 0, backwards = 0, split_backwards = 0;
};
InFlight in_flight(const RankProgram& program, int chunk);

// Every directed pair (from, to) of ranks of `world` such that `from` sends to `to` in the step
// (shard s of a cell sends to shard s of its peer), ascending, each once: NCCL gives each its
// own communicator (nccl_communicator.h says why).
std::vector<std::pair<int, int>> p2p_links(const Schedule& schedule, const World& world);

}  // namespace trainsim::runtime
