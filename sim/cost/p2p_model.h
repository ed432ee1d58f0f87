// Point-to-point transfers: latency + bytes / bandwidth, where the bandwidth is the lesser of the
// link that joins the two ranks (intra-node when both sit on one node, else inter-node) at the
// share of its line rate NCCL moves (LinkConfig::efficiency) and what the channels NCCL gives one
// send can carry (nccl_p2p_channels below). A pipeline message of a tensor-parallel group is split
// over its t GPUs (Megatron's scatter/gather): each sends its 1/t share on its own link.
#pragma once

#include <vector>

#include "core/hardware_profile.h"
#include "core/plan.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

// How NCCL stripes one send or receive over its channels (src/graph/paths.cc
// ncclTopoComputeP2pChannels, src/enqueue.cc scheduleP2pTasksToPlan; v2.18 to v2.2x):
//   p2p channels      pow2Up(the communicator's channels), at most 32; a node of L NVLinks runs
//                     2L collective channels (A100 24 -> 32, H100 36 -> 32, V100 12 -> 16)
//   channels per peer the least over the communicator's peers: 2L for an NVLink peer, the NIC's
//                     channels for a peer on another node (NCHANNELS_PER_NET_PEER: 2; newer
//                     NCCL max(2, NIC GB/s / 14)), so one remote member limits every send of
//                     the communicator, NVLink neighbours included; rounded up to a power of 2
//   inside one node   a send starts on the channels per peer halved until channels x members
//                     <= p2p channels ("one channel per operation"), and doubles them, up to the
//                     channels per peer halved until channels x members <= 4 x p2p channels,
//                     while each channel's part is over 32 x 512 KiB
//   across nodes      the channels per peer, whatever the size
// Each channel is one thread block; NCCL prices one at one NVLink's effective rate
// (ncclTopoNVLinkBw: 20 GB/s on SM70/80, 20.6 on SM90 = kNvlinkLaneGBps x intra_node.efficiency)
// and one on a NIC at NCCL_P2P_PER_CHANNEL_NET_BW, 14 GB/s.
inline constexpr double kNvlinkLaneGBps = 25.0;       // one NVLink 2/3/4, one direction
inline constexpr double kNcclP2pNetChannelGBps = 14.0;  // NCCL_P2P_PER_CHANNEL_NET_BW
inline constexpr int kNcclMaxChannels = 32;
inline constexpr double kNcclP2pMaxPartBytes = 32.0 * 512 * 1024;  // 32 x P2P_NVL_CHUNKSIZE

struct P2pChannels {
  int min = 1, max = 1;  // a send's channels before and after the doubling by size
};
// The channels one send of `bytes` gets: a communicator of `members` ranks, on one node or not.
P2pChannels nccl_p2p_channel_range(int members, bool spans_nodes, const ClusterConfig& cl);
int nccl_p2p_channels(const P2pChannels& range, bool spans_nodes, double bytes);
// Bytes per second one send of `bytes` moves between two ranks (on one node or not) of a
// communicator whose channels are `range` (nccl_p2p_channel_range) and that does or does not
// span nodes.
double nccl_p2p_bytes_per_second(double bytes, bool same_node, const P2pChannels& range, bool spans_nodes,
                                 const ClusterConfig& cl);

class LinkP2PModel final : public P2PModel {
 public:
  explicit LinkP2PModel(const Plan& plan);
  Tick duration(int from_rank, int to_rank, Bytes bytes) const override {
    const auto& cl = plan_.config.cluster;
    if (cl.calibrated && (cl.calibrated->p2p.bandwidth_gbps > 0 || !cl.calibrated->p2p_table.rows.empty())) {
      // A runtime that emulates 16-bit formats sends every element as a 4-byte float (its
      // benchmark's messages are floats too).
      const double moved = cl.calibrated->emulated_low_precision
                               ? static_cast<double>(bytes) * 4.0 / plan_.activation_bytes()
                               : static_cast<double>(bytes);
      return seconds_to_ticks(cl.calibrated->p2p_seconds(moved));
    }
    const bool same = plan_.same_node(from_rank, to_rank);
    const LinkConfig& link = same ? cl.intra_node : cl.inter_node;
    const Pipeline& p = pipelines_[static_cast<std::size_t>(plan_.replica_of(from_rank))];
    const double rate = nccl_p2p_bytes_per_second(static_cast<double>(bytes), same, p.channels, p.spans_nodes, cl);
    return seconds_to_ticks(us_to_seconds(link.latency_us) + static_cast<double>(bytes) / rate);
  }
  bool blocks_sender() const override { return !plan_.config.communication.overlap_p2p_comm; }

 private:
  // Per replica: its pipeline communicator's channels per send, and whether it leaves one node.
  struct Pipeline {
    P2pChannels channels;
    bool spans_nodes = false;
  };
  const Plan& plan_;
  std::vector<Pipeline> pipelines_;
};

}  // namespace trainsim
