// The interfaces the engine prices ops with. Each implementation lives in its own file
// (compute_model, p2p_model, collective_model) and has its closed form as its test.
#pragma once

#include "core/schedule.h"
#include "core/units.h"

namespace trainsim {

// Duration of a compute op (Forward, Backward*, OptimizerStep) on `rank`, for op.work of
// the whole op.
class ComputeModel {
 public:
  virtual ~ComputeModel() = default;
  virtual Tick duration(const Op& op, int rank) const = 0;
};

// Transfer time of one message between two ranks.
class P2PModel {
 public:
  virtual ~P2PModel() = default;
  virtual Tick duration(int from_rank, int to_rank, Bytes bytes) const = 0;
  // True when a send holds its rank's compute stream until it ends (no p2p overlap).
  virtual bool blocks_sender() const { return false; }
};

// Duration of a collective once every member has arrived; `wake_after(waited)`: what it adds
// when its first member arrived `waited` before its last (a runtime whose members sleep after
// polling so long, or slow down after polling long: HardwareProfile::comm_wake_us, comm_late),
// 0 for most.
class CollectiveModel {
 public:
  virtual ~CollectiveModel() = default;
  virtual Tick duration(const Collective& c) const = 0;
  virtual Tick wake_after(Tick /*waited*/) const { return 0; }
};

struct CostModels {
  const ComputeModel* compute = nullptr;
  const P2PModel* p2p = nullptr;
  const CollectiveModel* collective = nullptr;
};

}  // namespace trainsim
