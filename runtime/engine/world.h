// Where every rank of a run sits: its coordinates in the plan's grid of data-parallel replicas,
// pipeline stages, context-parallel ranks and tensor-parallel shards, and the groups it reduces
// with. Engines and the run loop ask this, never the arithmetic itself, so a new parallel
// dimension changes this file.
//
// Order: Megatron-LM's, tensor parallelism innermost, then context, then data, then pipeline:
//   rank = tp + TP * (cp + CP * (dp + DP * pp))
// so a tensor-parallel group (the most traffic) is consecutive ranks on one node, and with
// TP = CP = 1 it is the schedule's numbering (core/plan.h: rank = stage * dp + replica).
//
// The schedule (core/schedule.h) has a program per (dp, pp) cell, its "schedule rank"
// stage * dp + replica; each of the cell's TP x CP shards (shard index tp + TP * cp) is a rank of
// the world running that program, with its point-to-point peers the same shard of the peer cells
// (cell(), shard(), shard_of()). A context-parallel rank holds the whole weights of its tensor-
// parallel shard, as a data-parallel replica does: the gradients reduce, and ZeRO shards, over
// every (dp, cp) pair of a (pp, tp) (members(), data_parallel_group()), and each (dp, cp) pair is
// a copy of the weights that checksums compare (replicas(), replica()); the tied embedding's
// gradient is summed between the two stages that hold it within a copy (counterparts()).
#pragma once

#include <algorithm>
#include <vector>

#include "core/plan.h"

namespace trainsim::runtime {

struct RankCoord {
  int dp = 0;  // replica
  int pp = 0;  // pipeline stage
  int tp = 0;  // tensor-parallel shard
  int cp = 0;  // context-parallel rank: which chunks of each sequence it holds
  bool operator==(const RankCoord&) const = default;
};

class World {
 public:
  World(int dp, int pp, int tp = 1, int cp = 1) : dp_(dp), pp_(pp), tp_(tp), cp_(cp) {}
  // The executed plan's world: its data, pipeline, tensor- and context-parallel degrees.
  static World of(const Plan& plan) { return World(plan.dp, plan.pp, plan.tp, plan.cp); }

  int size() const { return dp_ * pp_ * tp_ * cp_; }
  int data_parallel() const { return dp_; }
  int pipeline_parallel() const { return pp_; }
  int tensor_parallel() const { return tp_; }
  int context_parallel() const { return cp_; }
  // The ranks that run one cell's program together: its tensor-parallel shards of each of its
  // context-parallel ranks.
  int shards_per_cell() const { return tp_ * cp_; }

  RankCoord coord(int rank) const {
    return {(rank / (tp_ * cp_)) % dp_, rank / (tp_ * cp_ * dp_), rank % tp_, (rank / tp_) % cp_};
  }
  int rank(RankCoord c) const { return c.tp + tp_ * (c.cp + cp_ * (c.dp + dp_ * c.pp)); }

  // Copies of the weights: a data-parallel replica's context-parallel ranks each hold one.
  int replicas() const { return dp_ * cp_; }
  // The ranks holding copy `k` (replica k / CP, context-parallel rank k % CP), stage by stage
  // (shards of a stage in tp order): the order its checksum folds them in.
  std::vector<int> replica(int k) const {
    std::vector<int> out;
    for (int pp = 0; pp < pp_; ++pp)
      for (int tp = 0; tp < tp_; ++tp) out.push_back(rank({k / cp_, pp, tp, k % cp_}));
    return out;
  }
  // The ranks that hold the same weights as `rank` in the other copies (its data-parallel group:
  // every replica's every context-parallel rank), ascending.
  std::vector<int> data_parallel_group(int rank) const {
    const RankCoord c = coord(rank);
    std::vector<int> out;
    for (int dp = 0; dp < dp_; ++dp)
      for (int cp = 0; cp < cp_; ++cp) out.push_back(this->rank({dp, c.pp, c.tp, cp}));
    return out;
  }
  // The ranks that shard `rank`'s layers with it (its tensor-parallel group), ascending.
  std::vector<int> tensor_parallel_group(int rank) const {
    const RankCoord c = coord(rank);
    std::vector<int> out;
    for (int tp = 0; tp < tp_; ++tp) out.push_back(this->rank({c.dp, c.pp, tp, c.cp}));
    return out;
  }
  // The ranks that hold the other chunks of `rank`'s sequences (its context-parallel group), in
  // context-parallel order (ascending).
  std::vector<int> context_parallel_group(int rank) const {
    const RankCoord c = coord(rank);
    std::vector<int> out;
    for (int cp = 0; cp < cp_; ++cp) out.push_back(this->rank({c.dp, c.pp, c.tp, cp}));
    return out;
  }
  // The schedule rank (cell) that `rank` is a shard of: stage * dp + replica (core/plan.h).
  int cell(int rank) const {
    const RankCoord c = coord(rank);
    return c.pp * dp_ + c.dp;
  }
  int num_cells() const { return dp_ * pp_; }
  // Which of its cell's shards `rank` is: tp + TP * cp.
  int shard_of(int rank) const {
    const RankCoord c = coord(rank);
    return c.tp + tp_ * c.cp;
  }
  // Shard `s` (tp + TP * cp) of schedule rank `cell`.
  int shard(int cell, int s) const { return rank({cell % dp_, cell / dp_, s % tp_, s / tp_}); }
  // The ranks a collective of the schedule over `cells` (a stage's replicas) runs over for shard
  // `s`: the shards of each cell with s's tensor-parallel slice of the weights, every context-
  // parallel rank's, ascending (each slice reduces with its copies).
  std::vector<int> members(const std::vector<int>& cells, int s) const {
    std::vector<int> out;
    for (int c : cells)
      for (int cp = 0; cp < cp_; ++cp) out.push_back(shard(c, s % tp_ + tp_ * cp));
    std::sort(out.begin(), out.end());
    return out;
  }
  // Shard `s` of each of `cells`, ascending: the tied embedding's sum between a replica's first and
  // last stage, each context-parallel rank with its own counterpart.
  std::vector<int> counterparts(const std::vector<int>& cells, int s) const {
    std::vector<int> out;
    for (int c : cells) out.push_back(shard(c, s));
    std::sort(out.begin(), out.end());
    return out;
  }
  // Every shard of each of `cells`, ascending (the global overflow check: every rank's verdict).
  std::vector<int> all_shards(const std::vector<int>& cells) const {
    std::vector<int> out;
    for (int c : cells)
      for (int s = 0; s < shards_per_cell(); ++s) out.push_back(shard(c, s));
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
  int dp_, pp_, tp_, cp_;
};

}  // namespace trainsim::runtime
