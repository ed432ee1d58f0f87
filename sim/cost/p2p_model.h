// Point-to-point transfers: latency + bytes / bandwidth of the link that joins the two
// ranks (intra-node when both sit on one node, else inter-node), at the share of its line rate
// NCCL moves (LinkConfig::efficiency). A pipeline message of a tensor-parallel group is split
// over its t GPUs (Megatron's scatter/gather): each sends its 1/t share on its own link.
#pragma once

#include "core/hardware_profile.h"
#include "core/plan.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

class LinkP2PModel final : public P2PModel {
 public:
  explicit LinkP2PModel(const Plan& plan) : plan_(plan) {}
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
    const LinkConfig& link = plan_.same_node(from_rank, to_rank) ? cl.intra_node : cl.inter_node;
    return seconds_to_ticks(us_to_seconds(link.latency_us) +
                            static_cast<double>(bytes) / (gbps_to_bytes_per_second(link.bandwidth_gbps) * link.efficiency));
  }
  bool blocks_sender() const override { return !plan_.config.communication.overlap_p2p_comm; }

 private:
  const Plan& plan_;
};

}  // namespace trainsim
