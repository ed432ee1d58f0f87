#include "sim/cost/p2p_model.h"

namespace trainsim {

Tick LinkP2PModel::duration(int from, int to, Bytes bytes) const {
  const auto& cl = plan_.config.cluster;
  const LinkConfig& link = plan_.same_node(from, to) ? cl.intra_node : cl.inter_node;
  return seconds_to_ticks(us_to_seconds(link.latency_us) +
                          static_cast<double>(bytes) / gbps_to_bytes_per_second(link.bandwidth_gbps));
}

}  // namespace trainsim
