#include "runtime/engine/schedule_ops.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

#include <fmt/format.h>

namespace trainsim::runtime {

GradientBuckets gradient_buckets(const Schedule& schedule, int V, const std::vector<std::size_t>& grad_elems) {
  GradientBuckets out;
  out.ranges.assign(V, {});
  out.bucket_of_collective.assign(schedule.collectives.size(), -1);
  std::vector<std::vector<int>> ids(V);
  // Gradient collectives are created per virtual stage in bucket order (see core/schedule.cpp);
  // recover each one's (vstage, bucket) from the programs.
  for (const auto& prog : schedule.ranks)
    for (const Op& op : prog.ops)
      if ((op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter) && op.bucket >= 0) {
        auto& v = ids[op.chunk];
        if (static_cast<int>(v.size()) <= op.bucket) v.resize(op.bucket + 1, -1);
        v[op.bucket] = op.channel;
      }
  for (int vs = 0; vs < V; ++vs) {
    double total = 0;
    for (int id : ids[vs]) total += static_cast<double>(schedule.collectives[id].bytes);
    double cum = 0;
    const auto n = static_cast<double>(grad_elems[vs]);
    for (std::size_t k = 0; k < ids[vs].size(); ++k) {
      const auto lo = static_cast<std::size_t>(std::llround(n * cum / total));
      cum += static_cast<double>(schedule.collectives[ids[vs][k]].bytes);
      const auto hi = k + 1 == ids[vs].size() ? grad_elems[vs] : static_cast<std::size_t>(std::llround(n * cum / total));
      out.ranges[vs].push_back({lo, hi});
      out.bucket_of_collective[ids[vs][k]] = static_cast<int>(k);
    }
  }
  return out;
}

std::pair<std::size_t, std::size_t> collective_range(const Op& op, const GradientBuckets& buckets,
                                                    const ParamInfo& token_embedding) {
  if (op.bucket >= 0) {
    const auto [lo, hi] = buckets.ranges[static_cast<std::size_t>(op.chunk)][static_cast<std::size_t>(op.bucket)];
    return {lo, hi - lo};
  }
  return {token_embedding.offset, token_embedding.size};
}

Divide divide_of(const Collective& collective, const PrecisionConfig& precision) {
  if (collective.purpose != CollectivePurpose::gradients) return Divide::none;
  return precision.allreduce_divide == AllReduceDivide::before ? Divide::before : Divide::after;
}

std::string allreduce_label(const Op& op, DType wire) {
  return fmt::format("{} all-reduce of {}", dtype_name(wire),
                     op.bucket >= 0 ? fmt::format("gradient bucket {}", op.bucket)
                                    : std::string("the tied embedding gradient"));
}

std::vector<std::pair<std::size_t, std::size_t>> norm_ranges(int vstage, int virtual_stages,
                                                             const std::vector<ParamInfo>& params,
                                                             const ParamInfo& token_embedding, int tensor_parallel_rank) {
  const bool tied_copy = vstage == virtual_stages - 1 && virtual_stages > 1 && token_embedding.size > 0;
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (const ParamInfo& p : params) {
    if (tied_copy && p.offset == token_embedding.offset) continue;
    if (tensor_parallel_rank > 0 && !p.tensor_parallel) continue;
    if (p.size == 0) continue;
    if (!out.empty() && out.back().second == p.offset)
      out.back().second += p.size;  // adjacent parameters: one range
    else
      out.emplace_back(p.offset, p.offset + p.size);
  }
  return out;
}

float clip_coefficient(double clip, double norm) {
  return clip > 0 && norm > clip ? static_cast<float>(clip / (norm + 1e-6)) : 1.0f;
}

const Collective& collective_of(const Schedule& schedule, const Op& op) {
  if (op.channel < 0 || static_cast<std::size_t>(op.channel) >= schedule.collectives.size())
    throw std::logic_error(fmt::format("{} names collective {}, and the schedule has {} (0..{}){}", op_label(op),
                                       op.channel, schedule.collectives.size(),
                                       static_cast<int>(schedule.collectives.size()) - 1,
                                       op.kind == OpKind::OverflowCheck && op.channel < 0
                                           ? ": a local overflow check exchanges nothing"
                                           : ""));
  return schedule.collectives[static_cast<std::size_t>(op.channel)];
}

std::vector<int> collective_members(const Collective& collective, const World& world, int shard) {
  switch (collective.purpose) {
    case CollectivePurpose::overflow: return world.all_shards(collective.members);
    case CollectivePurpose::embedding: return world.counterparts(collective.members, shard);
    case CollectivePurpose::gradients:
    case CollectivePurpose::parameters: break;
  }
  return world.members(collective.members, shard);
}

std::vector<std::vector<int>> reduction_groups(const Schedule& schedule, const World& world) {
  std::vector<std::vector<int>> groups;
  auto add = [&](const std::vector<int>& members) {
    if (std::find(groups.begin(), groups.end(), members) == groups.end()) groups.push_back(members);
  };
  for (const Collective& c : schedule.collectives)
    for (int s = 0; s < world.shards_per_cell(); ++s) add(collective_members(c, world, s));
  for (int cell = 0; cell < world.num_cells(); ++cell)
    for (int s = 0; s < world.shards_per_cell(); ++s) {
      const int r = world.shard(cell, s);
      if (world.tensor_parallel() > 1) add(world.tensor_parallel_group(r));
      if (world.context_parallel() > 1) add(world.context_parallel_group(r));
    }
  add(world.everyone());
  return groups;
}

InFlight in_flight(const RankProgram& program, int chunk) {
  // Per micro-batch: [forward, backward end] for its stash, [backward begin, backward end] for its
  // backward, as op indices; -1 where it has none.
  struct Span {
    int forward = -1, begin = -1, end = -1;
    bool split = false;
  };
  std::map<int, Span> spans;
  const auto& ops = program.ops;
  for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
    const Op& op = ops[i];
    if (op.chunk != chunk) continue;
    Span& s = spans[op.microbatch];
    switch (op.kind) {
      case OpKind::Forward: s.forward = i; break;
      case OpKind::Backward:
        if (s.begin < 0) s.begin = i;
        s.end = i;  // the last segment ends it
        break;
      case OpKind::BackwardInput:
        s.begin = i;
        s.split = true;
        break;
      case OpKind::BackwardWeight: s.end = i; break;  // its last segment ends it
      default: break;
    }
  }
  InFlight most;
  for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
    InFlight now;
    for (const auto& [mb, s] : spans) {
      const auto covers = [&](int from) { return from >= 0 && from <= i && (s.end < 0 || i <= s.end); };
      now.stashes += covers(s.forward) ? 1 : 0;
      if (covers(s.begin)) ++(s.split ? now.split_backwards : now.backwards);
    }
    most.stashes = std::max(most.stashes, now.stashes);
    most.backwards = std::max(most.backwards, now.backwards);
    most.split_backwards = std::max(most.split_backwards, now.split_backwards);
  }
  return most;
}

std::vector<std::pair<int, int>> p2p_links(const Schedule& schedule, const World& world) {
  std::vector<std::pair<int, int>> links;
  for (int r = 0; r < static_cast<int>(schedule.ranks.size()); ++r)
    for (const Op& op : schedule.ranks[r].ops)
      if (is_send(op.kind))
        for (int s = 0; s < world.shards_per_cell(); ++s) links.emplace_back(world.shard(r, s), world.shard(op.peer, s));
  std::sort(links.begin(), links.end());
  links.erase(std::unique(links.begin(), links.end()), links.end());
  return links;
}

}  // namespace trainsim::runtime
