// The cost models as the engine and the step program call them, op by op: behind their
// interfaces (any model, one virtual call per op), or the default ones by their final types, so
// the calls are direct and inlined (a sweep prices millions of ops).
#pragma once

#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/cost_models.h"
#include "sim/cost/p2p_model.h"

namespace trainsim {

struct VirtualModels {
  const CostModels& m;
  Tick compute(const Op& op, int rank) const { return m.compute->duration(op, rank); }
  Tick p2p(int from, int to, Bytes bytes) const { return m.p2p->duration(from, to, bytes); }
  Tick collective(const Collective& c) const { return m.collective->duration(c); }
  Tick collective_wake(Tick waited) const { return m.collective->wake_after(waited); }
  bool blocking_sends() const { return m.p2p->blocks_sender(); }
};

struct DefaultModels {
  const RooflineComputeModel& c;
  const LinkP2PModel& p;
  const NetworkCollectiveModel& k;
  Tick compute(const Op& op, int rank) const { return c.RooflineComputeModel::duration(op, rank); }
  Tick p2p(int from, int to, Bytes bytes) const { return p.LinkP2PModel::duration(from, to, bytes); }
  Tick collective(const Collective& col) const { return k.NetworkCollectiveModel::duration(col); }
  Tick collective_wake(Tick waited) const { return k.NetworkCollectiveModel::wake_after(waited); }
  bool blocking_sends() const { return p.LinkP2PModel::blocks_sender(); }
};

}  // namespace trainsim
