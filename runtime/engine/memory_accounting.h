// A rank's memory now, in sim's memory model's categories (sim/cost/memory_model.h), from what
// its engine holds: the one way both engines count it, so `validate` compares like with like.
//  * weights: what passes read (the compute-format copy; the master itself in fp32), a ZeRO-3
//    shard of it;
//  * optimizer: the moments and a master kept apart from the compute copy (the shard's under
//    ZeRO-1 and up);
//  * gradients: the flat gradients (which hold the reduced shard in place under ZeRO-0/1: the
//    optimizer's copy of it stands for Megatron's view into the buffer), or under ZeRO-2/3 the
//    accumulated shard, the unsharded part the backward wrote and has not yet handed to a
//    reduce-scatter counting as buffers;
//  * activations: the stashes, plus what an op holds while it runs (`working`);
//  * buffers: activation send/receive, buckets in flight, ZeRO-3's gathered units, `writing`.
#pragma once

#include <cstddef>

#include "core/dtype.h"
#include "core/plan.h"
#include "core/result.h"

namespace trainsim::runtime {

// What a rank holds of one model chunk.
struct ChunkHeld {
  double params = 0;            // elements of the chunk's flat parameters
  double shard = 0;             // elements of this rank's ZeRO shard of them (= params without ZeRO)
  double moment_bytes = 0;      // the optimizer's moments
  double unsharded = 0;         // ZeRO-2/3: gradient elements written, not yet handed to a reduce-scatter
  double activation_bytes = 0;  // its stashes (and a split backward's kept gradients)
};

// What a rank holds beside its chunks.
struct RankHeld {
  double buffer_elements = 0;  // activation send/receive buffers, compute format
  double in_flight_bytes = 0;  // gradient buckets being reduce-scattered
  double gathered_bytes = 0;   // ZeRO-3: the units a gather holds
  double working = 0;          // activation bytes the running op holds beyond the stashes
  double writing = 0;          // buffer bytes the running op writes
};

// chunk(j) -> ChunkHeld for j in [0, chunks).
template <class Chunk>
MemoryBreakdown rank_memory(const Plan& plan, std::size_t chunks, Chunk&& chunk, const RankHeld& rank) {
  const auto& pr = plan.config.precision;
  const double w = dtype_bytes(pr.compute), g = dtype_bytes(pr.grad_accumulation);
  const double master = pr.compute == DType::fp32 ? 0.0 : 4.0;  // bytes per element kept apart
  MemoryBreakdown now;
  now.activations = rank.working;
  for (std::size_t j = 0; j < chunks; ++j) {
    const ChunkHeld c = chunk(j);
    now.weights += (plan.zero() >= 3 ? c.shard : c.params) * w;
    now.optimizer += c.moment_bytes + (plan.zero() >= 1 ? c.shard : c.params) * master;
    if (plan.reduces_every_microbatch()) {
      now.gradients += c.shard * g;
      now.buffers += c.unsharded * g;
    } else {
      now.gradients += c.params * g;
    }
    now.activations += c.activation_bytes;
  }
  now.buffers += rank.buffer_elements * w + rank.in_flight_bytes + rank.gathered_bytes + rank.writing;
  return now;
}

}  // namespace trainsim::runtime
