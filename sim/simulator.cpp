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

struct Predictor::Workspace {
  Simulation sim;
  ResultWorkspace result;
  std::vector<int> same_as;
};

Predictor::Predictor() : ws_(std::make_unique<Workspace>()) {}
Predictor::~Predictor() = default;

namespace {

// Whether every replica's step has the same timings as replica 0's. The programs are the
// same by construction (build_schedule_into copies them); the costs may differ: the
// compute model prices by stage, but a message between two stages crosses a node boundary
// in one replica and not in another when placement puts their ranks differently, and each
// replica has its own embedding group, whose two ranks may or may not share a node.
bool replicas_symmetric(const Plan& plan, const Schedule& s, const NetworkCollectiveModel& collective) {
  if (plan.dp <= 1) return false;
  // A calibrated profile may price each rank's core differently.
  if (const auto& p = plan.config.cluster.calibrated; p && !p->core_factors.empty()) return false;
  const int p = plan.pp;
  for (int st = 0; st < p; ++st) {
    const int next = (st + 1) % p;  // interleaving also sends from the last stage to the first
    if (next == st) continue;
    const bool same = plan.same_node(plan.rank_of(st, 0), plan.rank_of(next, 0));
    for (int d = 1; d < plan.dp; ++d)
      if (plan.same_node(plan.rank_of(st, d), plan.rank_of(next, d)) != same) return false;
  }
  Tick embedding = -1;
  for (const Collective& c : s.collectives) {
    if (c.purpose != CollectivePurpose::embedding) continue;
    const Tick t = collective.duration(c);
    if (embedding >= 0 && t != embedding) return false;
    embedding = t;
  }
  return true;
}

}  // namespace

const Prediction& Predictor::predict(const Plan& plan) {
  // Rebuild the schedule in place unless someone kept the previous one.
  last_.schedule.reset();
  last_.timeline.schedule.reset();
  if (!schedule_ || schedule_.use_count() > 2) schedule_ = std::make_shared<Schedule>();
  Schedule& s = *schedule_;
  build_schedule_into(plan, s);

  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  ws_->sim.run(schedule_, compute, p2p, collective, last_.timeline, replicas_symmetric(plan, s, collective));
  last_.schedule = schedule_;
  finish(plan, ws_->sim.last_run_symmetric());
  return last_;
}

const Result& Predictor::evaluate(const Plan& plan) {
  last_.schedule.reset();
  last_.timeline.schedule.reset();
  if (!schedule_ || schedule_.use_count() > 2) schedule_ = std::make_shared<Schedule>();
  Schedule& s = *schedule_;

  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  bool symmetric = false;
  if (plan.dp > 1) {
    build_replica0_into(plan, s);
    symmetric = replicas_symmetric(plan, s, collective) &&
                ws_->sim.run_replica0(schedule_, compute, p2p, collective, last_.timeline);
  }
  if (!symmetric) {  // every rank simulated, as predict() does
    build_schedule_into(plan, s);
    ws_->sim.run(schedule_, compute, p2p, collective, last_.timeline, false);
  }
  finish(plan, symmetric);
  return last_.result;
}

// Memory and result of the run in last_.timeline. symmetric: replica 0 alone was simulated
// (replicas 1.. may have no programs or timings: their figures are copied).
void Predictor::finish(const Plan& plan, bool symmetric) {
  const Schedule& s = *schedule_;
  // Memory follows the program alone, the same for every replica of a stage.
  const int nranks = static_cast<int>(s.ranks.size());
  const MemoryModel memory(plan);
  last_.memory.resize(nranks);
  auto& same_as = ws_->same_as;
  same_as.resize(nranks);
  for (int r = 0; r < nranks; ++r) {
    const int first = plan.rank_of(plan.stage_of(r), 0);
    same_as[r] = first;
    last_.memory[r] = first < r ? last_.memory[first] : memory.peak_of(s.ranks[r]);
  }
  compute_result_into(plan, last_.timeline, last_.memory, last_.result, ws_->result, symmetric ? &same_as : nullptr);
}

}  // namespace trainsim
