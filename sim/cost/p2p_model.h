// Point-to-point transfers: latency + bytes / bandwidth of the link that joins the two
// ranks (intra-node when both sit on one node, else inter-node).
#pragma once

#include "core/plan.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

class LinkP2PModel final : public P2PModel {
 public:
  explicit LinkP2PModel(const Plan& plan) : plan_(plan) {}
  Tick duration(int from_rank, int to_rank, Bytes bytes) const override;

 private:
  const Plan& plan_;
};

}  // namespace trainsim
