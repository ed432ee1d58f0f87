// Collectives over a group of ranks, priced by the formulas NCCL's ring and hierarchical
// algorithms follow (alpha: link latency, B: link bandwidth, S: buffer bytes, n: members):
//   ring all-reduce      2(n-1) alpha + 2(n-1)/n * S/B
//   reduce-scatter       (n-1) alpha + (n-1)/n * S/B     (S: the whole input)
//   all-gather           (n-1) alpha + (n-1)/n * S/B     (S: the whole output)
//   hierarchical all-reduce over k nodes of g ranks each:
//       reduce-scatter inside nodes (g, S) + ring all-reduce between nodes (k, S/g)
//       + all-gather inside nodes (g, S); inside one node it is the ring.
// A ring that leaves a node runs at the inter-node link's speed. The 4-byte found-inf
// reduction is latency-bound and uses a tree: 2 ceil(log2 n) alpha.
// Bandwidths reported the way nccl-tests does: algbw = S/t, busbw = algbw * 2(n-1)/n.
#pragma once

#include "core/hardware_profile.h"
#include "core/plan.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

double ring_allreduce_seconds(int n, double bytes, double latency_s, double bytes_per_s);
double ring_reduce_scatter_seconds(int n, double bytes, double latency_s, double bytes_per_s);
double ring_allgather_seconds(int n, double bytes, double latency_s, double bytes_per_s);
double hierarchical_allreduce_seconds(int nodes, int per_node, double bytes, const LinkConfig& intra,
                                      const LinkConfig& inter);
double allreduce_busbw(int n, double bytes, double seconds);

class NetworkCollectiveModel final : public CollectiveModel {
 public:
  explicit NetworkCollectiveModel(const Plan& plan) : plan_(plan) {}
  Tick duration(const Collective& c) const override;
  // Seconds for a collective of `kind` over `members` (schedule ranks), used also for the
  // tensor-parallel all-reduces inside layers.
  double seconds(OpKind kind, const std::vector<int>& members, double bytes) const;

 private:
  const Plan& plan_;
};

}  // namespace trainsim
