#include "sim/simulator.h"

#include "core/metrics.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/memory_model.h"
#include "sim/cost/p2p_model.h"
#include "sim/engine.h"

namespace trainsim {

Prediction predict(const Plan& plan) {
  Prediction p;
  p.schedule = std::make_shared<const Schedule>(build_schedule(plan));
  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  p.timeline = simulate_schedule(p.schedule, CostModels{&compute, &p2p, &collective});
  p.memory = MemoryModel(plan).peak_per_rank(*p.schedule);
  p.result = compute_result(plan, p.timeline, p.memory);
  return p;
}

const Prediction& Predictor::predict(const Plan& plan) {
  last_ = trainsim::predict(plan);
  return last_;
}

}  // namespace trainsim
