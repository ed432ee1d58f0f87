#include "sim/cost/p2p_model.h"

#include <algorithm>
#include <cmath>

namespace trainsim {
namespace {

int pow2_up(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// NVLinks per GPU: the intra-node line rate in lanes (at least one: a PCIe node then gets the
// two channels NCCL gives a PCIe peer, which the link's own rate limits anyway).
int nvlinks(const ClusterConfig& cl) {
  return std::max(1, static_cast<int>(std::floor(cl.intra_node.bandwidth_gbps / kNvlinkLaneGBps + 1e-9)));
}

int net_channels(const ClusterConfig& cl) {
  return std::max(2, static_cast<int>(std::ceil(cl.inter_node.bandwidth_gbps / kNcclP2pNetChannelGBps - 1e-9)));
}

}  // namespace

P2pChannels nccl_p2p_channel_range(int members, bool spans_nodes, const ClusterConfig& cl) {
  const int links = nvlinks(cl);
  const int p2p_channels = std::min(kNcclMaxChannels, pow2_up(2 * links));
  const int per_peer = pow2_up(std::min(p2p_channels, spans_nodes ? net_channels(cl) : 2 * links));
  P2pChannels r{per_peer, per_peer};
  if (spans_nodes) return r;
  const int n = std::max(1, members);
  while (r.min * n > p2p_channels && r.min > 1) r.min /= 2;
  while (r.max * n > 4 * p2p_channels && r.max > 1) r.max /= 2;
  r.max = std::max(r.max, r.min);
  return r;
}

int nccl_p2p_channels(const P2pChannels& range, bool spans_nodes, double bytes) {
  int c = range.min;
  if (spans_nodes) return c;
  while (bytes / c > kNcclP2pMaxPartBytes && c * 2 <= range.max) c *= 2;
  return c;
}

double nccl_p2p_bytes_per_second(double bytes, bool same_node, const P2pChannels& range, bool spans_nodes,
                                 const ClusterConfig& cl) {
  const LinkConfig& link = same_node ? cl.intra_node : cl.inter_node;
  const double link_rate = gbps_to_bytes_per_second(link.bandwidth_gbps) * link.efficiency;
  const int channels = nccl_p2p_channels(range, spans_nodes, bytes);
  const double per_channel = same_node ? gbps_to_bytes_per_second(kNvlinkLaneGBps) * cl.intra_node.efficiency
                                       : gbps_to_bytes_per_second(kNcclP2pNetChannelGBps);
  return std::min(link_rate, channels * per_channel);
}

LinkP2PModel::LinkP2PModel(const Plan& plan) : plan_(plan) {
  pipelines_.resize(static_cast<std::size_t>(std::max(1, plan.dp)));
  for (int r = 0; r < plan.dp; ++r) {
    Pipeline& p = pipelines_[static_cast<std::size_t>(r)];
    const int first = plan.node_of(plan.rank_of(0, r));
    for (int s = 1; s < plan.pp; ++s) p.spans_nodes = p.spans_nodes || plan.node_of(plan.rank_of(s, r)) != first;
    p.channels = nccl_p2p_channel_range(plan.pp, p.spans_nodes, plan.config.cluster);
  }
}

}  // namespace trainsim
