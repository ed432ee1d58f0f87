// A rank's weights as the run loop and checkpoints see them, whatever device holds them: a hash
// of its master weights (replica checksums), the difference between two replicas' copies
// (replica drift), and its checkpoint state, chunk by chunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/checkpoint.h"
#include "runtime/engine/world.h"

namespace trainsim::runtime {

// A rank's weights hash: FNV-1a over the bits of `xs`, continuing from `h` (start: kFnvOffset),
// taken a 32-bit word at a time in 8 interleaved lanes (word i goes to lane i % 8) that are
// folded into `h` at the end. Equal bits give equal hashes, as with byte-wise FNV-1a, at an eighth
// of the serial multiplies: byte-wise, hashing 6.4M weights took ~6% of a CPU training step.
inline constexpr std::uint64_t kFnvOffset = 1469598103934665603ull;
std::uint64_t fnv1a(std::uint64_t h, std::span<const float> xs);

// Each replica's checksum: FNV-1a over the weights hashes of its ranks (World::replica order),
// from every rank's hash, indexed by rank. `sharded` (ZeRO): a rank's hash covers its shard, the
// replicas hold one copy of the state between them, and every replica's checksum is that copy's:
// FNV-1a over every rank's hash, stage by stage, each stage's data-parallel group in order.
std::vector<std::uint64_t> replica_checksums(const World& world, const std::vector<std::uint64_t>& rank_hashes,
                                             bool sharded = false);

// The largest |a[i] - b[i]| over elements whose bits differ (inf when one is NaN): replica drift.
double weight_difference(std::span<const float> a, std::span<const float> b);

// The largest difference between every rank's weights and its counterpart's in copy 0 (replica 0,
// context-parallel rank 0), given a rank's chunk weights by (rank, chunk): the drift of a step,
// when every rank is at hand.
template <class ChunkWeights>
double replica_drift(const World& world, int chunks, ChunkWeights&& weights) {
  double drift = 0;
  for (int r = 0; r < world.size(); ++r) {
    RankCoord c = world.coord(r);
    if (c.dp == 0 && c.cp == 0) continue;
    c.dp = c.cp = 0;
    const int first = world.rank(c);
    for (int j = 0; j < chunks; ++j) drift = std::max(drift, weight_difference(weights(first, j), weights(r, j)));
  }
  return drift;
}

// One model chunk's share of a rank's checkpoint.
struct ChunkState {
  std::span<const float> master_weights;
  std::span<const float> first_moment, second_moment;  // empty: an optimizer without moments (SGD)
  std::int64_t optimizer_steps = 0;
};
// A rank's checkpoint from its chunks, in chunk order (a checkpoint concatenates them).
RankCheckpoint pack_rank(int rank, const std::vector<ChunkState>& chunks, const LossScaler::State& scaler);
// Chunk `j` (of `sizes[j]` parameters) of `checkpoint`: views into it. Throws CheckpointError when
// the checkpoint holds fewer weights or moments than the chunks.
std::vector<ChunkState> unpack_rank(const RankCheckpoint& checkpoint, const std::vector<std::size_t>& sizes);
// The checkpoint of `rank` among `checkpoints`; throws CheckpointError when there is none.
const RankCheckpoint& checkpoint_of(const std::vector<RankCheckpoint>& checkpoints, int rank);

}  // namespace trainsim::runtime
