// Where every rank of a run sits: its coordinates in the plan's grid of data-parallel replicas,
// pipeline stages and tensor-parallel shards, and the groups it reduces with. Engines and the run
// loop ask this, never the arithmetic itself, so a new parallel dimension changes this file.
//
// Order: Megatron-LM's, tensor parallelism innermost, then data, then pipeline:
//   rank = tp + TP * (dp + DP * pp)
// so a tensor-parallel group (the most traffic) is consecutive ranks on one node, and with
// TP = 1 it is the schedule's numbering (core/plan.h: rank = stage * dp + replica).
//
// The schedule (core/schedule.h) has a program per (dp, pp) cell, its "schedule rank"
// stage * dp + replica; under tensor parallelism each of the cell's TP shards is a rank of the
// world running that program, with its point-to-point peers and reduction partners the same shard
// of the peer cells (cell(), shard(), members()).
#pragma once

#include <algorithm>
#include <vector>

#include "core/plan.h"

namespace trainsim::runtime {

struct RankCoord {
  int dp = 0;  // replica
  int pp = 0;  // pipeline stage
  int tp = 0;  // tensor-parallel shard
  bool operator==(const RankCoord&) const = default;
};

class World {
 public:
  World(int dp, int pp, int tp = 1) : dp_(dp), pp_(pp), tp_(tp) {}
  // The executed plan's world: its data and pipeline degrees, and its tensor-parallel degree.
  static World of(const Plan& plan) { return World(plan.dp, plan.pp, plan.tp); }

  int size() const { return dp_ * pp_ * tp_; }
  int data_parallel() const { return dp_; }
  int pipeline_parallel() const { return pp_; }
  int tensor_parallel() const { return tp_; }

  RankCoord coord(int rank) const { return {(rank / tp_) % dp_, rank / (tp_ * dp_), rank % tp_}; }
  int rank(RankCoord c) const { return c.tp + tp_ * (c.dp + dp_ * c.pp); }

  // The ranks holding replica `dp`'s weights, stage by stage (shards of a stage in tp order): the
  // order its checksum folds them in.
  std::vector<int> replica(int dp) const {
    std::vector<int> out;
    for (int pp = 0; pp < pp_; ++pp)
      for (int tp = 0; tp < tp_; ++tp) out.push_back(rank({dp, pp, tp}));
    return out;
  }
  // The ranks that hold the same weights as `rank` in other replicas (its data-parallel group), ascending.
  std::vector<int> data_parallel_group(int rank) const {
    const RankCoord c = coord(rank);
    std::vector<int> out;
    for (int dp = 0; dp < dp_; ++dp) out.push_back(this->rank({dp, c.pp, c.tp}));
    return out;
  }
  // The ranks that shard `rank`'s layers with it (its tensor-parallel group), ascending.
  std::vector<int> tensor_parallel_group(int rank) const {
    const RankCoord c = coord(rank);
    std::vector<int> out;
    for (int tp = 0; tp < tp_; ++tp) out.push_back(this->rank({c.dp, c.pp, tp}));
    return out;
  }
  // The schedule rank (cell) that `rank` is a shard of: stage * dp + replica (core/plan.h).
  int cell(int rank) const {
    const RankCoord c = coord(rank);
    return c.pp * dp_ + c.dp;
  }
  int num_cells() const { return dp_ * pp_; }
  // Shard `tp` of schedule rank `cell`.
  int shard(int cell, int tp) const { return rank({cell % dp_, cell / dp_, tp}); }
  // The ranks a collective of the schedule over `cells` runs over for shard `tp`: that shard of
  // each cell, ascending (each shard reduces its own slice of the weights with its peers).
  std::vector<int> members(const std::vector<int>& cells, int tp) const {
    std::vector<int> out;
    for (int c : cells) out.push_back(shard(c, tp));
    std::sort(out.begin(), out.end());
    return out;
  }
  // Every shard of each of `cells`, ascending (the global overflow check: every rank's verdict).
  std::vector<int> all_shards(const std::vector<int>& cells) const {
    std::vector<int> out;
    for (int c : cells)
      for (int tp = 0; tp < tp_; ++tp) out.push_back(shard(c, tp));
    std::sort(out.begin(), out.end());
    return out;
  }
  // Every rank, ascending: the gradient norm's and the global overflow check's group.
  std::vector<int> everyone() const {
    std::vector<int> out(static_cast<std::size_t>(size()));
    for (int r = 0; r < size(); ++r) out[static_cast<std::size_t>(r)] = r;
    return out;
  }

 private:
  int dp_, pp_, tp_;
};

}  // namespace trainsim::runtime
