#include "runtime/engine/weights.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace trainsim::runtime {

namespace {
constexpr std::uint64_t kFnvPrime = 1099511628211ull;
}

std::uint64_t fnv1a(std::uint64_t h, std::span<const float> xs) {
  constexpr std::size_t kLanes = 8;
  std::uint64_t lane[kLanes];
  for (std::size_t l = 0; l < kLanes; ++l) lane[l] = (h ^ l) * kFnvPrime;
  const std::size_t n = xs.size();
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) lane[l] = (lane[l] ^ std::bit_cast<std::uint32_t>(xs[i + l])) * kFnvPrime;
  for (std::size_t l = 0; i < n; ++i, ++l) lane[l] = (lane[l] ^ std::bit_cast<std::uint32_t>(xs[i])) * kFnvPrime;
  for (std::size_t l = 0; l < kLanes; ++l) h = (h ^ lane[l]) * kFnvPrime;
  return h;
}

std::vector<std::uint64_t> replica_checksums(const World& world, const std::vector<std::uint64_t>& rank_hashes,
                                             bool sharded) {
  std::vector<std::uint64_t> out;
  if (sharded) {
    std::uint64_t h = kFnvOffset;
    for (int r : world.replica(0))
      for (int member : world.data_parallel_group(r)) h = (h ^ rank_hashes[static_cast<std::size_t>(member)]) * kFnvPrime;
    return std::vector<std::uint64_t>(static_cast<std::size_t>(world.replicas()), h);
  }
  for (int d = 0; d < world.replicas(); ++d) {
    std::uint64_t h = kFnvOffset;
    for (int r : world.replica(d)) h = (h ^ rank_hashes[static_cast<std::size_t>(r)]) * kFnvPrime;
    out.push_back(h);
  }
  return out;
}

double weight_difference(std::span<const float> a, std::span<const float> b) {
  double drift = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    std::uint32_t ua, ub;
    std::memcpy(&ua, &a[i], 4);
    std::memcpy(&ub, &b[i], 4);
    if (ua == ub) continue;
    const double diff = std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    drift = std::max(drift, std::isnan(diff) ? INFINITY : diff);
  }
  return drift;
}

RankCheckpoint pack_rank(int rank, const std::vector<ChunkState>& chunks, const LossScaler::State& scaler) {
  RankCheckpoint rc;
  rc.rank = rank;
  for (const ChunkState& c : chunks) {
    rc.master_weights.insert(rc.master_weights.end(), c.master_weights.begin(), c.master_weights.end());
    rc.first_moment.insert(rc.first_moment.end(), c.first_moment.begin(), c.first_moment.end());
    rc.second_moment.insert(rc.second_moment.end(), c.second_moment.begin(), c.second_moment.end());
    rc.optimizer_steps = c.optimizer_steps;
  }
  rc.scaler = scaler;
  return rc;
}

std::vector<ChunkState> unpack_rank(const RankCheckpoint& rc, const std::vector<std::size_t>& sizes) {
  std::vector<ChunkState> out;
  const bool moments = !rc.first_moment.empty();
  std::size_t off = 0;
  for (std::size_t n : sizes) {
    if (off + n > rc.master_weights.size())
      throw CheckpointError(fmt::format("checkpoint rank {} holds fewer weights than the model", rc.rank));
    if (moments && (off + n > rc.first_moment.size() || off + n > rc.second_moment.size()))
      throw CheckpointError(fmt::format("checkpoint rank {} holds fewer moments than the model", rc.rank));
    ChunkState c;
    c.master_weights = std::span<const float>(rc.master_weights).subspan(off, n);
    if (moments) {
      c.first_moment = std::span<const float>(rc.first_moment).subspan(off, n);
      c.second_moment = std::span<const float>(rc.second_moment).subspan(off, n);
    }
    c.optimizer_steps = rc.optimizer_steps;
    out.push_back(c);
    off += n;
  }
  return out;
}

const RankCheckpoint& checkpoint_of(const std::vector<RankCheckpoint>& checkpoints, int rank) {
  const auto it =
      std::find_if(checkpoints.begin(), checkpoints.end(), [&](const RankCheckpoint& c) { return c.rank == rank; });
  if (it == checkpoints.end()) throw CheckpointError(fmt::format("checkpoint holds no rank {}", rank));
  return *it;
}

}  // namespace trainsim::runtime
