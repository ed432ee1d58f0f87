#include "sim/simulator.h"

#include <algorithm>
#include <array>
#include <optional>
#include <stdexcept>

#include "core/metrics.h"
#include "sim/core_contention.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/memory_model.h"
#include "sim/cost/p2p_model.h"
#include "sim/engine.h"
#include "sim/step_program.h"

namespace trainsim {

Prediction predict(const Plan& plan) {
  Prediction p;
  p.schedule = std::make_shared<const Schedule>(build_schedule(plan));
  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  Simulation sim;
  sim.run(p.schedule, compute, p2p, collective, p.timeline);
  settle_core_contention(plan, p.schedule, compute, p2p, collective, sim, p.timeline);
  p.memory = MemoryModel(plan).peak_per_rank(*p.schedule);
  p.result = compute_result(plan, p.timeline, p.memory);
  return p;
}

void schedule_key_into(const ScenarioConfig& c, ScenarioConfig& key) {
  key = c;  // reuses key's storage
  key.name.clear();
  key.description.clear();
  ModelConfig& m = key.model;
  m.preset.clear();  // the shape it set is compared field by field
  m.attention = {};
  m.fused_elementwise = true;
  m.fused_linear_bias = true;
  m.hidden_dropout = m.attention_dropout = 0;
  ClusterConfig& cl = key.cluster;
  cl.gpu.clear();
  cl.profile.clear();  // `calibrated`, the profile itself, is compared
  cl.memory_gib = 0;
  for (auto& rate : cl.peak_tflops) rate.second = 0;  // keeps the formats
  cl.compute_efficiency = 0;
  cl.sm_count = 0;
  cl.hbm_bandwidth_gbps = 0;
  cl.memory_efficiency = cl.attention_efficiency = cl.cudnn_attention_efficiency = cl.sustained_clock_fraction =
      cl.int32_tops = 0;
  cl.nvlink_sharp = false;
  cl.intra_node = cl.inter_node = {};
  key.parallelism.sequence_parallel = false;
  TrainingConfig& t = key.training;
  t.activation_recompute = {};
  t.recompute_num_layers = 0;
  t.optimizer = {};
  t.lr = t.weight_decay = t.adam_beta1 = t.adam_beta2 = t.adam_eps = t.clip_grad = 0;
  PrecisionConfig& pr = key.precision;
  pr.master_weights = pr.grad_accumulation = {};
  pr.allreduce_divide = {};
  const LossScalingMode mode = pr.loss_scaling.mode;  // whether there is an overflow check
  pr.loss_scaling = {};
  pr.loss_scaling.mode = mode;
  key.communication.allreduce_algorithm = {};
  key.runtime = {};
}

namespace {

// One schedule of the Predictor's cache. The first configuration with a given key is
// evaluated as without a cache (the engine, on the Predictor's own schedule) and leaves only
// its key here; the second builds the schedule and compiles it (sim/step_program.h), and
// every later one only re-prices and evaluates the program. Two variants: replica 0's
// programs alone (dp > 1, replicas symmetric) or every rank's, each built when first needed.
struct CachedSchedule {
  struct Variant {
    std::shared_ptr<Schedule> schedule;  // storage, reused from an evicted entry when no one holds it
    std::size_t ops = 0;                 // 0: not built
    bool compile_tried = false;
    StepProgram program;                 // not compiled() when the step cannot complete
    // Whether the ranks compute_result reads (all, or the first of each stage when replicas
    // are symmetric) are the ones the program simulates: its figures then replace the Timeline.
    bool figures = false;
    // Per stage, the first rank's forward and backward ops alone, in program order: all that
    // MemoryModel::peak_of reads (every other op leaves its walk unchanged), a third of the ops.
    std::vector<RankProgram> memory_walk;
    // The walks' activation peaks per stage, by the tables they were walked with, most recent
    // first: a sweep's configurations of one schedule share a few tables (the micro-batch,
    // recompute and sequence parallelism change them; rates and links do not), and the same
    // tables walk the same ops to the same peaks.
    std::vector<std::pair<ActivationTables, std::vector<double>>> peaks;
    static constexpr std::size_t kMaxPeaks = 16;
    ResultIndex result_index;  // of the schedule (compute_result_into)
  };
  ScenarioConfig key;  // schedule_key_into
  int uses = 0;
  Variant replica0, full;
  std::size_t ops() const { return replica0.ops + full.ops; }
};

}  // namespace

struct Predictor::Workspace {
  Simulation sim;
  KernelInventoryCache inventory;  // the compute model's, across plans
  ResultWorkspace result;
  StepFigures figures;
  std::array<StepFigures, StepProgram::kMaxLanes> lane_figures;
  std::array<Result, StepProgram::kMaxLanes> results;  // evaluate_batch's
  std::vector<int> same_as;
  // Most recently used first: at most kMaxEntries schedules and, beyond the first, kMaxOps ops.
  std::vector<std::unique_ptr<CachedSchedule>> cache;
  ScenarioConfig key;
  static constexpr std::size_t kMaxEntries = 8, kMaxOps = 1'000'000;

  // The entry for `key` (schedule_key_into of the plan), moved to the front; a new one
  // (nothing built) when there is none, which may evict others.
  CachedSchedule& lookup() {
    auto it = std::find_if(cache.begin(), cache.end(), [&](const auto& e) { return e->key == key; });
    if (it != cache.end()) {
      std::rotate(cache.begin(), it, it + 1);
      return *cache.front();
    }
    std::size_t ops = 0;
    for (const auto& e : cache) ops += e->ops();
    std::unique_ptr<CachedSchedule> entry;
    while (!cache.empty() && (cache.size() >= kMaxEntries || ops > kMaxOps)) {
      ops -= cache.back()->ops();
      entry = std::move(cache.back());  // the last one evicted is reused
      cache.pop_back();
    }
    if (!entry) entry = std::make_unique<CachedSchedule>();
    for (CachedSchedule::Variant* v : {&entry->replica0, &entry->full}) {
      v->program.reset();  // lets go of the schedule
      v->ops = 0;
      v->compile_tried = false;
      v->figures = false;
      v->memory_walk.clear();
      v->peaks.clear();
    }
    entry->key = key;
    entry->uses = 0;
    cache.insert(cache.begin(), std::move(entry));
    return *cache.front();
  }
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
  settle_core_contention(plan, schedule_, compute, p2p, collective, ws_->sim, last_.timeline);
  last_.schedule = schedule_;
  finish(plan, MemoryModel(plan), s, ws_->sim.last_run_symmetric(), last_.result);
  return last_;
}

// Where a configuration's step comes from once its schedule is looked up: the cache's variant
// whose compiled program gives it (none: evaluate wrote the result already), and whether that
// program gives figures without a Timeline.
struct Predictor::Route {
  CachedSchedule::Variant* variant = nullptr;
  bool symmetric = false;
};

struct Predictor::Models {
  const RooflineComputeModel& compute;
  const LinkP2PModel& p2p;
  const NetworkCollectiveModel& collective;
};

// evaluate up to the step, its schedule's key in ws_->key: the engine for a schedule not met
// lately and for a step that deadlocks (the result written into `out`, no variant returned),
// else the variant whose compiled program runs it (built and compiled now if new).
Predictor::Route Predictor::route(const Plan& plan, const Models& m, Result& out) {
  CachedSchedule& entry = ws_->lookup();
  // A schedule not met lately: the engine, as without the cache. So too ranks that contend for
  // their host's cores and compute that collectives slow, whose ops the engine prices again from
  // each round's overlaps (every rank simulated, as predict() settles them), and collectives that
  // cost more when a member waited (the program does not price that).
  const bool settles = cores_contend(plan) || collectives_slow_compute(plan);
  const bool on_engine = settles || m.collective.prices_wake();
  if (++entry.uses == 1 || on_engine) {
    if (!schedule_ || schedule_.use_count() > 2) schedule_ = std::make_shared<Schedule>();
    Schedule& s = *schedule_;
    bool symmetric = false;
    if (plan.dp > 1 && !settles) {
      build_replica0_into(plan, s);
      symmetric = replicas_symmetric(plan, s, m.collective) &&
                  ws_->sim.run_replica0(schedule_, m.compute, m.p2p, m.collective, last_.timeline);
    }
    if (!symmetric) {  // every rank simulated, as predict() does
      build_schedule_into(plan, s);
      ws_->sim.run(schedule_, m.compute, m.p2p, m.collective, last_.timeline, false);
      settle_core_contention(plan, schedule_, m.compute, m.p2p, m.collective, ws_->sim, last_.timeline);
    }
    finish(plan, MemoryModel(plan), s, symmetric, out);
    return {};
  }

  // Met before: its compiled program (built and compiled now if this variant is new), which
  // gives the engine's Timeline (tests/test_step_program.cpp).
  auto built = [&](CachedSchedule::Variant& v, bool replica0_only) -> CachedSchedule::Variant& {
    if (v.ops == 0) {
      if (!v.schedule || v.schedule.use_count() > 1) v.schedule = std::make_shared<Schedule>();
      if (replica0_only)
        build_replica0_into(plan, *v.schedule);
      else
        build_schedule_into(plan, *v.schedule);
      v.ops = std::max<std::size_t>(1, v.schedule->total_ops());
      result_index_into(*v.schedule, v.result_index);
      v.memory_walk.resize(static_cast<std::size_t>(plan.pp));
      for (int st = 0; st < plan.pp; ++st) {
        const RankProgram& prog = v.schedule->ranks[plan.rank_of(st, 0)];
        RankProgram& walk = v.memory_walk[st];
        walk.rank = prog.rank;
        walk.stage = prog.stage;
        walk.replica = prog.replica;
        walk.ops.clear();
        for (const Op& op : prog.ops)
          if (is_compute(op.kind) && op.kind != OpKind::OptimizerStep) walk.ops.push_back(op);
      }
    }
    return v;
  };
  auto compiled = [&](CachedSchedule::Variant& v, bool replica0_only) {
    if (!v.compile_tried) {
      v.compile_tried = true;
      // The program prices a compute op once per (rank, kind, chunk, work): a compute model
      // that reads more of an op (its micro-batch, say) keeps this schedule on the engine.
      if (v.program.compile(v.schedule, replica0_only) && !v.program.prices_hold(m.compute, m.p2p, m.collective))
        v.program.reset();
      // The memory walk's forward and backward ops alone must walk to what the whole
      // programs walk to; a memory model that reads other ops gets the whole programs.
      const MemoryModel memory(plan);
      for (int st = 0; st < plan.pp && !v.memory_walk.empty(); ++st)
        if (!(memory.peak_of(v.memory_walk[st]) == memory.peak_of(v.schedule->ranks[plan.rank_of(st, 0)])))
          v.memory_walk.clear();
      if (v.program.compiled()) {
        v.figures = true;
        for (int r = 0; r < static_cast<int>(v.schedule->ranks.size()); ++r)
          v.figures = v.figures && v.program.simulated(r) == (!replica0_only || plan.rank_of(plan.stage_of(r), 0) >= r);
      }
    }
    return v.program.compiled();
  };
  if (plan.dp > 1) {
    CachedSchedule::Variant& v = built(entry.replica0, true);
    // Not compiled: replica 0 alone cannot complete (run_replica0 would refuse): the full path.
    if (replicas_symmetric(plan, *v.schedule, m.collective) && compiled(v, true)) return {&v, true};
  }
  // Every rank simulated, as predict() does.
  CachedSchedule::Variant& v = built(entry.full, false);
  if (compiled(v, false)) return {&v, false};
  // A step that deadlocks: the engine names the blocked ops.
  ws_->sim.run(v.schedule, m.compute, m.p2p, m.collective, last_.timeline, false);
  finish_route(plan, {&v, false}, nullptr, out);
  return {};
}

// The memory and the Result of a routed configuration whose step is in `figures` or, without
// them, in last_.timeline.
void Predictor::finish_route(const Plan& plan, const Route& route, const StepFigures* figures, Result& out) {
  CachedSchedule::Variant& used = *route.variant;
  const MemoryModel memory(plan);
  if (used.memory_walk.empty()) {
    finish(plan, memory, *used.schedule, route.symmetric, out, nullptr, nullptr, &used.result_index, figures);
    return;
  }
  // The stages' activation peaks, walked once per distinct table.
  auto& peaks = used.peaks;
  auto hit = std::find_if(peaks.begin(), peaks.end(),
                          [&](const auto& e) { return same_bits(e.first, memory.activation_tables()); });
  if (hit == peaks.end()) {
    if (peaks.size() >= CachedSchedule::Variant::kMaxPeaks) peaks.pop_back();
    std::vector<double> per_stage;
    per_stage.reserve(used.memory_walk.size());
    for (const RankProgram& walk : used.memory_walk) per_stage.push_back(activation_peak(memory.activation_tables(), walk));
    peaks.emplace(peaks.begin(), memory.activation_tables(), std::move(per_stage));
  } else {
    std::rotate(peaks.begin(), hit, hit + 1);
  }
  finish(plan, memory, *used.schedule, route.symmetric, out, &used.memory_walk, &peaks.front().second,
         &used.result_index, figures);
}

const Result& Predictor::evaluate(const Plan& plan) {
  last_.schedule.reset();
  last_.timeline.schedule.reset();
  const RooflineComputeModel compute(plan, &ws_->inventory);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  const Models m{compute, p2p, collective};
  schedule_key_into(plan.config, ws_->key);
  const Route r = route(plan, m, last_.result);
  if (!r.variant) return last_.result;
  // The step's figures from the program alone (no Timeline) where it can give them, else its Timeline.
  StepProgram& program = r.variant->program;
  if (r.variant->figures && program.run_figures(compute, p2p, collective, plan.pp > 1, ws_->figures, ws_->result)) {
    finish_route(plan, r, &ws_->figures, last_.result);
  } else {
    program.run(compute, p2p, collective, last_.timeline);
    finish_route(plan, r, nullptr, last_.result);
  }
  return last_.result;
}

void Predictor::evaluate_batch(const Plan* const* plans, int n, const Result** out) {
  if (n < 0 || n > kMaxBatch) throw std::invalid_argument("Predictor::evaluate_batch: 0 to kMaxBatch plans");
  last_.schedule.reset();
  last_.timeline.schedule.reset();
  std::array<std::optional<RooflineComputeModel>, kMaxBatch> compute;
  std::array<std::optional<LinkP2PModel>, kMaxBatch> p2p;
  std::array<std::optional<NetworkCollectiveModel>, kMaxBatch> collective;
  // Consecutive plans whose step the same compiled program gives as figures: run together.
  std::array<int, kMaxBatch> lanes{};
  std::array<Route, kMaxBatch> routes{};
  int grouped = 0;
  const CachedSchedule* group_entry = nullptr;
  auto flush = [&] {
    if (grouped == 0) return;
    StepProgram& program = routes[lanes[0]].variant->program;
    std::array<const RooflineComputeModel*, kMaxBatch> cs{};
    std::array<const LinkP2PModel*, kMaxBatch> ps{};
    std::array<const NetworkCollectiveModel*, kMaxBatch> ks{};
    std::array<StepFigures*, kMaxBatch> fs{};
    for (int q = 0; q < grouped; ++q) {
      const int j = lanes[q];
      cs[q] = &*compute[j];
      ps[q] = &*p2p[j];
      ks[q] = &*collective[j];
      fs[q] = &ws_->lane_figures[q];
    }
    const bool pipelined = plans[lanes[0]]->pp > 1;
    const bool ok = program.run_lanes_figures(cs.data(), ps.data(), ks.data(), pipelined, fs.data(), ws_->result, grouped);
    for (int q = 0; q < grouped; ++q) {
      const int j = lanes[q];
      if (ok) {
        finish_route(*plans[j], routes[j], fs[q], ws_->results[j]);
      } else {  // a negative price: every lane on its own, as evaluate
        if (!program.run_figures(*cs[q], *ps[q], *ks[q], pipelined, ws_->figures, ws_->result)) {
          program.run(*cs[q], *ps[q], *ks[q], last_.timeline);
          finish_route(*plans[j], routes[j], nullptr, ws_->results[j]);
        } else {
          finish_route(*plans[j], routes[j], &ws_->figures, ws_->results[j]);
        }
      }
    }
    grouped = 0;
    group_entry = nullptr;
  };
  for (int j = 0; j < n; ++j) {
    const Plan& plan = *plans[j];
    out[j] = &ws_->results[j];
    compute[j].emplace(plan, &ws_->inventory);
    p2p[j].emplace(plan);
    collective[j].emplace(plan);
    const Models m{*compute[j], *p2p[j], *collective[j]};
    // Another schedule may evict the group's: run the group first.
    schedule_key_into(plan.config, ws_->key);
    if (group_entry && !(group_entry->key == ws_->key)) flush();
    routes[j] = route(plan, m, ws_->results[j]);
    const Route& r = routes[j];
    if (!r.variant) continue;
    if (r.variant->figures) {
      if (grouped > 0 && routes[lanes[0]].variant != r.variant) flush();
      if (grouped == 0) group_entry = ws_->cache.front().get();
      lanes[grouped++] = j;
    } else {  // no figures from this program: its Timeline
      r.variant->program.run(*compute[j], *p2p[j], *collective[j], last_.timeline);
      finish_route(plan, r, nullptr, ws_->results[j]);
    }
  }
  flush();
}

// Memory and result of the run in last_.timeline, of schedule `s`. symmetric: replica 0
// alone was simulated (replicas 1.. may have no programs or timings: their figures are copied).
// memory_walk (optional): per stage, what the memory model walks for its ranks; stage_peaks
// (optional, with it): the activation peaks of those walks, already walked. index
// (optional): result_index_into(s). figures (optional): the step's figures, read instead of
// last_.timeline (StepProgram::run_figures).
void Predictor::finish(const Plan& plan, const MemoryModel& memory, const Schedule& s, bool symmetric, Result& out,
                       const std::vector<RankProgram>* memory_walk, const std::vector<double>* stage_peaks,
                       const ResultIndex* index, const StepFigures* figures) {
  // Memory follows the program alone, the same for every replica of a stage.
  const int nranks = static_cast<int>(s.ranks.size());
  last_.memory.resize(nranks);
  auto& same_as = ws_->same_as;
  same_as.resize(nranks);
  for (int r = 0; r < nranks; ++r) {
    const int stage = plan.stage_of(r), first = plan.rank_of(stage, 0);
    same_as[r] = first;
    if (first < r)
      last_.memory[r] = last_.memory[first];
    else if (stage_peaks)
      last_.memory[r] = memory.breakdown((*memory_walk)[stage], (*stage_peaks)[stage]);
    else
      last_.memory[r] = memory.peak_of(memory_walk ? (*memory_walk)[stage] : s.ranks[r]);
  }
  if (figures)
    result_from_figures(plan, s, *figures, last_.memory, out, ws_->result, symmetric ? &same_as : nullptr);
  else
    compute_result_into(plan, last_.timeline, last_.memory, out, ws_->result, symmetric ? &same_as : nullptr, index);
}

}  // namespace trainsim
