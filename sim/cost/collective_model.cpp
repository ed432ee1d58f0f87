#include "sim/cost/collective_model.h"

#include <cmath>

namespace trainsim {

double ring_allreduce_seconds(int n, double bytes, double alpha, double bw) {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) * alpha + 2.0 * (n - 1) / n * bytes / bw;
}
double ring_reduce_scatter_seconds(int n, double bytes, double alpha, double bw) {
  if (n <= 1) return 0;
  return (n - 1) * alpha + static_cast<double>(n - 1) / n * bytes / bw;
}
double ring_allgather_seconds(int n, double bytes, double alpha, double bw) {
  return ring_reduce_scatter_seconds(n, bytes, alpha, bw);
}

namespace {
double alpha(const LinkConfig& l) { return us_to_seconds(l.latency_us); }
double beta(const LinkConfig& l) { return gbps_to_bytes_per_second(l.bandwidth_gbps); }
}  // namespace

double hierarchical_allreduce_seconds(int nodes, int per_node, double bytes, const LinkConfig& intra,
                                      const LinkConfig& inter) {
  return ring_reduce_scatter_seconds(per_node, bytes, alpha(intra), beta(intra)) +
         ring_allreduce_seconds(nodes, bytes / per_node, alpha(inter), beta(inter)) +
         ring_allgather_seconds(per_node, bytes, alpha(intra), beta(intra));
}

double allreduce_busbw(int n, double bytes, double seconds) {
  return seconds > 0 ? bytes / seconds * 2.0 * (n - 1) / n : 0;
}

double NetworkCollectiveModel::seconds(OpKind kind, const std::vector<int>& members, double bytes) const {
  const int n = static_cast<int>(members.size());
  if (n <= 1) return 0;
  const auto& cl = plan_.config.cluster;
  // Members are ascending and ranks fill nodes in order, so nodes change monotonically.
  int nodes = 1;
  for (int i = 1; i < n; ++i) nodes += plan_.node_of(members[i]) != plan_.node_of(members[i - 1]);
  const LinkConfig& link = nodes > 1 ? cl.inter_node : cl.intra_node;

  if (const auto& profile = cl.calibrated; profile && (!profile->allreduce.empty() || !profile->allreduce_tables.empty())) {
    // Measured: the fit for this group size (the found-inf flag is a 4-byte all-reduce).
    const double full = profile->allreduce_seconds(n, bytes);
    return kind == OpKind::ReduceScatter || kind == OpKind::AllGather ? full / 2 : full;
  }
  if (kind == OpKind::OverflowCheck) return 2.0 * std::ceil(std::log2(n)) * alpha(link) + 2.0 * bytes / beta(link);

  const bool hierarchical = plan_.config.communication.allreduce_algorithm == AllReduceAlgorithm::hierarchical &&
                            nodes > 1 && n % nodes == 0;
  const int g = n / nodes;
  switch (kind) {
    case OpKind::AllReduce:
      return hierarchical ? hierarchical_allreduce_seconds(nodes, g, bytes, cl.intra_node, cl.inter_node)
                          : ring_allreduce_seconds(n, bytes, alpha(link), beta(link));
    case OpKind::ReduceScatter:
      return hierarchical ? ring_reduce_scatter_seconds(g, bytes, alpha(cl.intra_node), beta(cl.intra_node)) +
                                ring_reduce_scatter_seconds(nodes, bytes / g, alpha(cl.inter_node), beta(cl.inter_node))
                          : ring_reduce_scatter_seconds(n, bytes, alpha(link), beta(link));
    case OpKind::AllGather:
      return hierarchical ? ring_allgather_seconds(nodes, bytes / g, alpha(cl.inter_node), beta(cl.inter_node)) +
                                ring_allgather_seconds(g, bytes, alpha(cl.intra_node), beta(cl.intra_node))
                          : ring_allgather_seconds(n, bytes, alpha(link), beta(link));
    default: return 0;
  }
}

Tick NetworkCollectiveModel::duration(const Collective& c) const {
  return seconds_to_ticks(seconds(c.kind, c.members, static_cast<double>(c.bytes)));
}

}  // namespace trainsim
