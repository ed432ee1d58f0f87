// The sweep's fast path against the discrete-event engine it replaces, on random plans:
//  * StepProgram (a schedule compiled into a max-plus program, sim/step_program.h) gives the
//    engine's Timeline op for op, for every rank or for replica 0 alone, with the default
//    cost models and with others that price every rank differently;
//  * Predictor::evaluate, which caches schedules and their programs across configurations,
//    gives predict()'s Result whole (operator==: every field of the Result and of every rank,
//    memory and warnings included, and any field added to them later), configuration after
//    configuration, as the prices, the memory, the placement and the schedule change;
//  * what the cache relies on: changing a field that schedule_key_into clears leaves the
//    schedule unchanged, and the compute model prices an op without reading its micro-batch,
//    message, bucket, bytes, peer or dep;
//  * compute_result_into, which reads each rank's ops in one pass, against the passes it
//    replaced (each figure computed on its own, as they were before), on predicted timelines
//    and on timelines shaken like measured ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>

#include "core/config_fields.h"
#include "core/metrics.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/gemm_model.h"
#include "core/kernel_inventory.h"
#include "sim/cost/p2p_model.h"
#include "sim/simulator.h"
#include "sim/step_program.h"
#include "tests/sim_equality.h"
#include "tests/test_helpers.h"

namespace trainsim {
namespace {

using testing::expect_same_result;
using testing::same_op;

bool same_timeline(const Timeline& a, const Timeline& b, std::string* where = nullptr) {
  if (a.ops.size() != b.ops.size()) return false;
  for (std::size_t r = 0; r < a.ops.size(); ++r) {
    if (a.ops[r].size() != b.ops[r].size()) {
      if (where) *where = "rank " + std::to_string(r) + " has a different number of ops";
      return false;
    }
    for (std::size_t i = 0; i < a.ops[r].size(); ++i)
      if (a.ops[r][i].start != b.ops[r][i].start || a.ops[r][i].end != b.ops[r][i].end) {
        if (where)
          *where = "rank " + std::to_string(r) + " op " + std::to_string(i) + ": [" + std::to_string(a.ops[r][i].start) +
                   ", " + std::to_string(a.ops[r][i].end) + ") vs [" + std::to_string(b.ops[r][i].start) + ", " +
                   std::to_string(b.ops[r][i].end) + ")";
        return false;
      }
  }
  return true;
}


// A random valid configuration of the small test model: every schedule, 1-8 stages,
// 1-4 replicas, tensor parallelism, ZeRO 0-3, recompute, overlapped and bucketed gradients,
// loss scaling with global or local checks, untied embeddings, and placements where a
// replica's pipeline boundaries fall on other nodes than replica 0's (dp = 3 on small nodes).
struct RandomPlans {
  std::mt19937 rng;
  explicit RandomPlans(unsigned seed) : rng(seed) {}
  int pick(std::initializer_list<int> xs) {
    std::uniform_int_distribution<std::size_t> u(0, xs.size() - 1);
    return *(xs.begin() + u(rng));
  }
  // Empty when the draw is not a valid layout.
  std::optional<ScenarioConfig> next() {
    const auto kind = static_cast<ScheduleKind>(pick({0, 1, 2, 3}));
    const int p = pick({1, 2, 4, 8}), d = pick({1, 2, 3, 4}), t = pick({1, 2});
    const int v = kind == ScheduleKind::interleaved_1f1b ? pick({2, 3}) : 1;
    if (kind == ScheduleKind::interleaved_1f1b && p < 2) return std::nullopt;
    const int m = kind == ScheduleKind::interleaved_1f1b ? p * pick({1, 2, 3}) : pick({1, 2, 3, 8, 16});
    ScenarioConfig c = testing::small_config(p, m, kind, v, d);
    c.cluster.num_gpus = p * d * t;
    c.cluster.gpus_per_node = pick({1, 2, 4, 8});
    if (c.cluster.num_gpus > c.cluster.gpus_per_node && c.cluster.num_gpus % c.cluster.gpus_per_node) return std::nullopt;
    testing::draw_settings(c, p, d, t, m, [&](std::initializer_list<int> xs) { return pick(xs); }, true);
    try {  // any other invariant a plan must meet
      Plan::from_config(c);
    } catch (const ScenarioError&) {
      return std::nullopt;
    }
    return c;
  }
  // What a sweep varies without changing the schedule: rates, links, memory, recompute.
  void reprice(ScenarioConfig& c) {
    c.cluster.compute_efficiency = pick({30, 45, 60, 75}) / 100.0;
    c.cluster.hbm_bandwidth_gbps = pick({900, 2039, 3350});
    c.cluster.intra_node.bandwidth_gbps = pick({50, 300, 450});
    c.cluster.inter_node.bandwidth_gbps = pick({3, 12, 25, 50});
    c.cluster.inter_node.latency_us = pick({2, 6, 30});
    c.cluster.peak_tflops[c.precision.compute] = pick({100, 312, 989});
    c.cluster.memory_gib = pick({1, 80}) / 1000.0;
    c.training.activation_recompute = static_cast<Recompute>(pick({0, 1, 2}));
    c.parallelism.sequence_parallel = c.parallelism.tensor_parallel_size > 1 && pick({0, 1});
    c.communication.tp_comm_overlap = c.communication.tp_comm_overlap && c.parallelism.sequence_parallel;
  }
};

// Prices that differ per rank and per chunk and are all distinct primes-ish, so that a
// price read for the wrong op, rank or collective shows.
class RankedCompute final : public ComputeModel {
 public:
  Tick duration(const Op& op, int rank) const override {
    Tick base = 0;
    switch (op.kind) {
      case OpKind::Forward: base = 1009; break;
      case OpKind::Backward: base = 2003; break;
      case OpKind::BackwardInput: base = 1201; break;
      case OpKind::BackwardWeight: base = 809; break;
      case OpKind::OptimizerStep: return 307 + 13 * rank;
      default: return 0;
    }
    const Tick whole = base + 17 * rank + 7 * op.chunk;
    return op.work == 1.0 ? whole : static_cast<Tick>(static_cast<double>(whole) * op.work + 0.5);
  }
};
// A model the compiled program cannot serve: it prices each micro-batch differently.
class MicrobatchCompute final : public ComputeModel {
 public:
  Tick duration(const Op& op, int) const override { return is_compute(op.kind) ? 1000 + op.microbatch : 0; }
};
// As a calibrated profile prices compute: a chunk's first forward of the step (micro-batch 0)
// cold, every other op of a kind and chunk alike.
class FirstForwardCompute final : public ComputeModel {
 public:
  Tick duration(const Op& op, int) const override {
    if (!is_compute(op.kind)) return 0;
    return 1000 + 10 * op.chunk + (op.kind == OpKind::Forward && op.microbatch == 0 ? 300 : 0);
  }
};
class RankedP2P final : public P2PModel {
 public:
  Tick duration(int from, int to, Bytes bytes) const override { return 31 + 5 * from + 3 * to + bytes % 97; }
};
class SizedCollectives final : public CollectiveModel {
 public:
  Tick duration(const Collective& c) const override {
    return 101 + c.bytes % 1013 + 11 * static_cast<Tick>(c.members.size()) + 41 * static_cast<Tick>(c.kind);
  }
};

void expect_same_figures(const StepFigures& got, const StepFigures& want, const std::vector<int>* same_as) {
  ASSERT_EQ(got.begin, want.begin);
  ASSERT_EQ(got.end, want.end);
  ASSERT_EQ(got.ranks.size(), want.ranks.size());
  for (std::size_t r = 0; r < got.ranks.size(); ++r) {
    if (same_as && (*same_as)[r] < static_cast<int>(r)) continue;  // a twin: not read
    const auto &x = got.ranks[r], &y = want.ranks[r];
    ASSERT_TRUE(x == y) << "rank " << r << ": busy " << x.busy << " vs " << y.busy << ", collective " << x.collective
                        << " vs " << y.collective << ", comm " << x.comm << " vs " << y.comm;
  }
}

// A random plan's default models and the ranked ones above.
struct PlanModels {
  explicit PlanModels(const Plan& plan) : compute(plan), p2p(plan), collective(plan) {}
  const RooflineComputeModel compute;
  const LinkP2PModel p2p;
  const NetworkCollectiveModel collective;
  const RankedCompute ranked_compute;
  const RankedP2P ranked_p2p;
  const SizedCollectives sized;
  const CostModels ranked{&ranked_compute, &ranked_p2p, &sized};
};

::testing::Message describe(int trial, const ScenarioConfig& c) {
  return ::testing::Message() << "trial " << trial << ": " << schedule_name(c.parallelism.schedule)
                              << " p=" << c.parallelism.pipeline_parallel_size
                              << " d=" << c.parallelism.data_parallel_size
                              << " v=" << c.parallelism.virtual_pipeline_stages << " zero=" << c.parallelism.zero_stage;
}

// run_figures (the figures compute_result_into reads from a Timeline: the step's span; each
// rank's busy, collective and exposed-communication ticks, read from the program's cells
// without a Timeline) against those of the Timeline run() wrote with the same models,
// `timeline`. twins: replica 0 alone was compiled (its ranks are read, the others are twins).
template <class... Models>
void expect_figures_of_timeline(StepProgram& program, const Plan& plan, const Timeline& timeline,
                                const std::vector<int>* twins, int& exposed, const Models&... models) {
  StepFigures got;
  ResultWorkspace ws, scratch;
  Result result;
  ASSERT_TRUE(program.run_figures(models..., plan.pp > 1, got, scratch));
  compute_result_into(plan, timeline, {}, result, ws, twins);
  expect_same_figures(got, ws.figures, twins);
  exposed += std::any_of(got.ranks.begin(), got.ranks.end(), [](const auto& f) { return f.comm > 0; });
}

// The engine and the compiled program, on the same schedule, every rank and replica 0 alone;
// and the program's figures without a Timeline, equal to those of its Timeline, on random
// plans whose compute streams wait for ZeRO gathers, found-inf checks and gradient reductions.
TEST(StepProgram, TimelineEqualsTheEnginesOnRandomPlans) {
  RandomPlans random(20261125);
  int compared = 0, replica0 = 0, refused = 0, exposed = 0;
  Simulation sim;
  StepProgram program;
  Timeline want, got;
  for (int trial = 0; trial < 400; ++trial) {
    const auto c = random.next();
    if (!c) continue;
    SCOPED_TRACE(describe(trial, *c));
    const Plan plan = Plan::from_config(*c);
    const PlanModels m(plan);
    const auto &compute = m.compute;
    const auto& p2p = m.p2p;
    const auto& collective = m.collective;
    const auto& ranked = m.ranked;
    const MicrobatchCompute microbatch_compute;
    const CostModels by_microbatch{&microbatch_compute, &m.ranked_p2p, &m.sized};
    std::string where;

    auto full = std::make_shared<const Schedule>(build_schedule(plan));
    ASSERT_TRUE(program.compile(full, false));
    EXPECT_TRUE(program.prices_hold(compute, p2p, collective));
    EXPECT_TRUE(program.prices_hold(ranked));
    // Micro-batches 1 and 2's forwards of a chunk share a price class (micro-batch 0's is its own:
    // a calibrated profile prices it cold), so pricing by micro-batch must be caught.
    if (plan.num_microbatches > 2) {
      EXPECT_FALSE(program.prices_hold(by_microbatch));
    }
    // A first forward priced apart keeps the compiled program (its price is a class of its own).
    const FirstForwardCompute first_forward;
    const CostModels cold_first{&first_forward, &m.ranked_p2p, &m.sized};
    EXPECT_TRUE(program.prices_hold(cold_first));
    sim.run(full, cold_first, want);
    program.run(cold_first, got);
    ASSERT_TRUE(same_timeline(got, want, &where)) << "first forward priced apart: " << where;
    sim.run(full, compute, p2p, collective, want, false);
    program.run(compute, p2p, collective, got);
    ASSERT_TRUE(same_timeline(got, want, &where)) << where;
    EXPECT_EQ(got.schedule, full);
    expect_figures_of_timeline(program, plan, got, nullptr, exposed, compute, p2p, collective);
    sim.run(full, ranked, want);
    program.run(ranked, got);
    ASSERT_TRUE(same_timeline(got, want, &where)) << "ranked prices: " << where;
    expect_figures_of_timeline(program, plan, got, nullptr, exposed, ranked);
    if (HasFailure()) return;
    ++compared;

    auto half = std::make_shared<Schedule>();
    build_replica0_into(plan, *half);
    const bool engine_ok = sim.run_replica0(half, compute, p2p, collective, want);
    ASSERT_EQ(program.compile(half, true), engine_ok);
    if (!engine_ok) {
      ++refused;
      continue;
    }
    program.run(compute, p2p, collective, got);
    ASSERT_TRUE(same_timeline(got, want, &where)) << "replica 0: " << where;
    std::vector<int> same_as(static_cast<std::size_t>(plan.num_ranks()));
    for (int r = 0; r < plan.num_ranks(); ++r) same_as[r] = plan.rank_of(plan.stage_of(r), 0);
    expect_figures_of_timeline(program, plan, got, &same_as, exposed, compute, p2p, collective);
    program.run(ranked, got);
    expect_figures_of_timeline(program, plan, got, &same_as, exposed, ranked);
    if (HasFailure()) return;
    ++replica0;
  }
  EXPECT_GT(compared, 250);
  EXPECT_GT(replica0, 100);
  EXPECT_GT(exposed, 100);  // idle time waiting for collectives, split gap by gap
}

// Several configurations of one schedule at once (run_lanes): each lane's Timeline is the one
// run() gives with that lane's prices, and the engine's, for every rank and for replica 0
// alone, with 1 to 4 lanes.
TEST(StepProgram, LanesEqualRunOnePerConfiguration) {
  RandomPlans random(20261130);
  int compared = 0;
  Simulation sim;
  StepProgram program;
  std::string where;
  for (int trial = 0; trial < 200; ++trial) {
    const auto c = random.next();
    if (!c) continue;
    const int n = random.pick({1, 2, 3, 4});
    std::vector<Plan> plans;
    for (int j = 0; j < n; ++j) {
      ScenarioConfig priced = *c;
      if (j > 0) random.reprice(priced);
      try {
        plans.push_back(Plan::from_config(priced));
      } catch (const ScenarioError&) {
        break;
      }
    }
    const int lanes = static_cast<int>(plans.size());
    const testing::LaneModels models(plans);
    const auto& cs = models.cs;
    const auto& ps = models.ps;
    const auto& ks = models.ks;
    for (const bool replica0 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "trial " << trial << ", " << lanes << " lanes"
                                        << (replica0 ? ", replica 0" : ""));
      auto s = std::make_shared<Schedule>();
      if (replica0)
        build_replica0_into(plans[0], *s);
      else
        build_schedule_into(plans[0], *s);
      if (!program.compile(s, replica0)) continue;
      std::vector<Timeline> got(static_cast<std::size_t>(lanes));
      std::vector<Timeline*> out;
      for (auto& t : got) out.push_back(&t);
      program.run_lanes(cs.data(), ps.data(), ks.data(), out.data(), lanes);
      // And the figures alone (run_lanes_figures), lane by lane those of run_figures.
      std::vector<StepFigures> figures(static_cast<std::size_t>(lanes));
      std::vector<StepFigures*> figures_out;
      for (auto& f : figures) figures_out.push_back(&f);
      ResultWorkspace ws;
      const bool pipelined = plans[0].pp > 1;
      ASSERT_TRUE(program.run_lanes_figures(cs.data(), ps.data(), ks.data(), pipelined, figures_out.data(), ws, lanes));
      for (int j = 0; j < lanes; ++j) {
        StepFigures want;
        ASSERT_TRUE(program.run_figures(*cs[j], *ps[j], *ks[j], pipelined, want, ws));
        SCOPED_TRACE(::testing::Message() << "figures of lane " << j);
        expect_same_figures(figures[j], want, nullptr);
      }
      for (int j = 0; j < lanes; ++j) {
        Timeline want, engine;
        program.run(*cs[j], *ps[j], *ks[j], want);
        ASSERT_TRUE(same_timeline(got[j], want, &where)) << "lane " << j << ": " << where;
        EXPECT_EQ(got[j].schedule, want.schedule);
        if (replica0)
          ASSERT_TRUE(sim.run_replica0(s, *cs[j], *ps[j], *ks[j], engine));
        else
          sim.run(s, *cs[j], *ps[j], *ks[j], engine, false);
        ASSERT_TRUE(same_timeline(got[j], engine, &where)) << "lane " << j << " against the engine: " << where;
      }
      ++compared;
    }
  }
  EXPECT_GT(compared, 200);
}

// A price below zero breaks the order of a stream's intervals that run_figures relies on: it
// refuses, and the caller takes the Timeline.
TEST(StepProgram, FiguresRefuseANegativePrice) {
  class Negative final : public P2PModel {
   public:
    Tick duration(int, int, Bytes) const override { return -5; }
  };
  const Plan plan = Plan::from_config(testing::small_config(2, 4, ScheduleKind::one_f_one_b, 1, 1));
  auto s = std::make_shared<const Schedule>(build_schedule(plan));
  StepProgram program;
  ASSERT_TRUE(program.compile(s, false));
  const RankedCompute compute;
  const Negative p2p;
  const SizedCollectives coll;
  StepFigures figures;
  ResultWorkspace ws;
  EXPECT_FALSE(program.run_figures(CostModels{&compute, &p2p, &coll}, true, figures, ws));
  const RankedP2P positive;
  EXPECT_TRUE(program.run_figures(CostModels{&compute, &positive, &coll}, true, figures, ws));
}

// Hand-built schedules the generator never makes: an op whose dep is a receive, a local
// check, a collective of one member, and a deadlock (not compiled: the engine reports it).
TEST(StepProgram, UnusualSchedulesAndDeadlocks) {
  auto s = std::make_shared<Schedule>();
  s->num_messages = 1;
  s->collectives.push_back({OpKind::AllReduce, CollectivePurpose::gradients, 64, {1}});
  RankProgram r0{0, 0, 0, {}}, r1{1, 1, 0, {}};
  Op f{OpKind::Forward, 0, 0};
  r0.ops.push_back(f);
  Op send{OpKind::SendActivation, 0, 0};
  send.peer = 1, send.channel = 0, send.dep = 0, send.bytes = 100;
  r0.ops.push_back(send);
  Op recv{OpKind::RecvActivation, 1, 0};
  recv.peer = 0, recv.channel = 0;
  r1.ops.push_back(recv);
  Op ar{OpKind::AllReduce, 1};
  ar.channel = 0, ar.dep = 0;  // waits for the receive itself
  r1.ops.push_back(ar);
  Op check{OpKind::OverflowCheck};
  check.dep = 1;  // local: no collective
  r1.ops.push_back(check);
  Op g{OpKind::Forward, 1, 0};
  g.dep = 2;
  r1.ops.push_back(g);
  s->ranks = {r0, r1};
  const RankedCompute compute;
  const RankedP2P p2p;
  const SizedCollectives coll;
  const CostModels models{&compute, &p2p, &coll};
  StepProgram program;
  ASSERT_TRUE(program.compile(s, false));
  Timeline got;
  program.run(models, got);
  std::string where;
  EXPECT_TRUE(same_timeline(got, simulate_schedule(s, models), &where)) << where;
  for (const bool pipelined : {false, true}) {  // and the figures read from the cells alone
    StepFigures figures;
    ResultWorkspace ws;
    Result result;
    ASSERT_TRUE(program.run_figures(models, pipelined, figures, ws));
    Plan plan = Plan::from_config(testing::small_config(2, 1, ScheduleKind::gpipe, 1, 1));
    if (!pipelined) plan.pp = 1;
    compute_result_into(plan, got, {}, result, ws);
    expect_same_figures(figures, ws.figures, nullptr);
  }

  auto dead = std::make_shared<Schedule>(*s);
  dead->ranks[0].ops.pop_back();  // the send is gone: the receive waits for ever
  EXPECT_FALSE(program.compile(dead, false));
  EXPECT_FALSE(program.compiled());
  EXPECT_THROW(simulate_schedule(dead, models), std::logic_error);
}

// The sweep's path: one Predictor evaluating configuration after configuration, several
// per schedule at different prices (so each schedule is met once by the engine and then by
// its compiled program), with predict() of the same plan as the reference each time.
TEST(Predictor, EvaluateEqualsPredictAcrossSchedulesAndPrices) {
  RandomPlans random(20261126);
  Predictor predictor;
  int compared = 0, programs = 0, replicated = 0, not_fitting = 0, revisited = 0;
  std::vector<ScenarioConfig> seen;
  for (int trial = 0; trial < 240; ++trial) {
    auto drawn = random.next();
    if (!drawn) continue;
    // Now and then an earlier schedule again (the cache holds several).
    if (!seen.empty() && random.pick({0, 0, 1})) {
      drawn = seen[static_cast<std::size_t>(random.pick({0, 1, 2, 3, 4, 5, 6, 7})) % seen.size()];
      ++revisited;
    }
    seen.push_back(*drawn);
    const int repeats = random.pick({1, 3, 4});
    for (int k = 0; k < repeats; ++k) {
      ScenarioConfig c = *drawn;
      if (k > 0) random.reprice(c);
      SCOPED_TRACE(::testing::Message() << "trial " << trial << " price " << k << ": "
                                        << schedule_name(c.parallelism.schedule)
                                        << " p=" << c.parallelism.pipeline_parallel_size
                                        << " d=" << c.parallelism.data_parallel_size
                                        << " v=" << c.parallelism.virtual_pipeline_stages
                                        << " gpus_per_node=" << c.cluster.gpus_per_node);
      const Plan plan = Plan::from_config(c);
      const Prediction want = predict(plan);
      if (trial % 11 == 5 && k == 0) {  // a full prediction in between must not disturb the cache
        const Prediction& full = predictor.predict(plan);
        expect_same_result(full.result, want.result);
      }
      const Result& got = predictor.evaluate(plan);
      expect_same_result(got, want.result);
      if (HasFailure()) return;
      ++compared;
      programs += k >= 1;
      replicated += plan.dp > 1;
      not_fitting += !want.result.fits_in_memory;
    }
  }
  EXPECT_GT(compared, 300);
  EXPECT_GT(programs, 150);
  EXPECT_GT(replicated, 150);
  EXPECT_GT(not_fitting, 50);
  EXPECT_GT(revisited, 30);
}

// evaluate_batch: plans a few at a time, as a sweep worker takes them (several prices of one
// schedule, schedules met once, revisited or compiled within the batch, batches of 1 to 4),
// each Result predict()'s whole, and evaluate() in between leaves it so.
TEST(Predictor, EvaluateBatchEqualsPredict) {
  RandomPlans random(20261202);
  Predictor predictor;
  std::vector<ScenarioConfig> drawn;
  while (drawn.size() < 60)
    if (auto c = random.next()) drawn.push_back(*c);
  int compared = 0, lanes = 0;
  for (int batch = 0; batch < 400; ++batch) {
    const int n = random.pick({1, 2, 3, 4, 4, 4});
    std::vector<Plan> plans;
    const ScenarioConfig& base = drawn[static_cast<std::size_t>(batch / 5) % drawn.size()];
    for (int j = 0; j < n; ++j) {
      ScenarioConfig c = random.pick({0, 0, 0, 1}) ? drawn[static_cast<std::size_t>(random.pick({0, 7, 13, 29}) + batch) %
                                                           drawn.size()]
                                                   : base;
      random.reprice(c);
      try {
        plans.push_back(Plan::from_config(c));
      } catch (const ScenarioError&) {
      }
    }
    std::vector<const Plan*> in;
    for (const Plan& p : plans) in.push_back(&p);
    std::vector<const Result*> out(in.size());
    predictor.evaluate_batch(in.data(), static_cast<int>(in.size()), out.data());
    for (std::size_t j = 0; j < in.size(); ++j) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " plan " << j << ": "
                                        << schedule_name(plans[j].config.parallelism.schedule) << " p=" << plans[j].pp
                                        << " d=" << plans[j].dp);
      expect_same_result(*out[j], predict(plans[j]).result);
      if (HasFailure()) return;
      ++compared;
    }
    lanes += in.size() > 1;
    if (batch % 13 == 0 && !plans.empty()) expect_same_result(predictor.evaluate(plans[0]), predict(plans[0]).result);
  }
  EXPECT_GT(compared, 1000);
  EXPECT_GT(lanes, 250);
}

// ---- What the cache relies on --------------------------------------------------------


std::string schedule_difference(const Schedule& a, const Schedule& b) {
  if (a.kind != b.kind || a.num_stages != b.num_stages || a.num_replicas != b.num_replicas ||
      a.num_chunks != b.num_chunks || a.num_microbatches != b.num_microbatches || a.num_messages != b.num_messages)
    return "shape";
  if (a.ranks.size() != b.ranks.size()) return "rank count";
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const auto &x = a.ranks[r], &y = b.ranks[r];
    if (x.rank != y.rank || x.stage != y.stage || x.replica != y.replica || x.ops.size() != y.ops.size())
      return "rank " + std::to_string(r);
    for (std::size_t i = 0; i < x.ops.size(); ++i)
      if (!same_op(x.ops[i], y.ops[i])) return "rank " + std::to_string(r) + " op " + std::to_string(i);
  }
  if (a.collectives.size() != b.collectives.size()) return "collective count";
  for (std::size_t c = 0; c < a.collectives.size(); ++c) {
    const auto &x = a.collectives[c], &y = b.collectives[c];
    if (x.kind != y.kind || x.purpose != y.purpose || x.bytes != y.bytes || x.members != y.members)
      return "collective " + std::to_string(c);
  }
  return "";
}

// Other values of a field, of its kind, within its bounds.
std::vector<FieldValue> other_values(const FieldSpec& f, const FieldValue& now) {
  std::vector<FieldValue> out;
  auto in_bounds = [&](double x) { return x >= f.min && x <= f.max; };
  switch (f.kind) {
    case FieldKind::integer: {
      const auto x = std::get<std::int64_t>(now);
      for (std::int64_t y : {x + 1, x * 2, x - 1, std::int64_t{0}, std::int64_t{1}, std::int64_t{3}})
        if (y != x && in_bounds(static_cast<double>(y))) out.emplace_back(y);
      break;
    }
    case FieldKind::real: {
      const double x = std::get<double>(now);
      for (double y : {x * 1.5 + 0.25, x * 0.5, 0.0, 1.0, 7.0})
        if (y != x && in_bounds(y)) out.emplace_back(y);
      break;
    }
    case FieldKind::boolean: out.emplace_back(!std::get<bool>(now)); break;
    case FieldKind::choice:
      for (const auto& c : f.choices)
        if (FieldValue(c) != now) out.emplace_back(c);
      break;
    case FieldKind::text: out.emplace_back(std::string("other")); break;
    case FieldKind::integer_list: out.emplace_back(IntList{}); break;
  }
  return out;
}

// Every field that schedule_key_into clears (found from the field table: changing it leaves
// the key equal), changed on random plans to every other value of its kind: the schedule
// (every op of every rank, every collective) stays the same, whenever the changed plan is
// valid. A field that starts to shape the schedule fails here until it is compared.
TEST(ScheduleKey, ClearedFieldsLeaveTheScheduleUnchanged) {
  RandomPlans random(20261127);
  std::vector<ScenarioConfig> bases;
  while (bases.size() < 40)
    if (auto c = random.next()) bases.push_back(*c);
  std::set<std::string> cleared, compared;
  int checked = 0;
  ScenarioConfig key_a, key_b;
  for (const FieldSpec& f : scenario_fields()) {
    if (!f.get || !f.set) continue;
    for (const ScenarioConfig& base : bases) {
      for (const FieldValue& v : other_values(f, f.get(base))) {
        ScenarioConfig changed = base;
        try {
          f.set(changed, v);
        } catch (const std::exception&) {  // e.g. a preset or profile that does not exist
          continue;
        }
        schedule_key_into(base, key_a);
        schedule_key_into(changed, key_b);
        if (!(key_a == key_b)) {
          compared.insert(f.path);
          continue;
        }
        cleared.insert(f.path);
        Plan a, b;
        try {
          a = Plan::from_config(base);
          b = Plan::from_config(changed);
        } catch (const ScenarioError&) {
          continue;
        }
        const std::string diff = schedule_difference(build_schedule(a), build_schedule(b));
        EXPECT_EQ(diff, "") << f.path << " = " << format_field_value(v) << " changes the schedule";
        ++checked;
      }
    }
  }
  // The fields a sweep varies most without touching the schedule are among the cleared ones.
  for (const char* path : {"cluster.compute_efficiency", "cluster.inter_node.bandwidth_gbps", "cluster.memory_gib",
                           "training.activation_recompute", "parallelism.sequence_parallel"})
    EXPECT_TRUE(cleared.count(path)) << path;
  for (const char* path : {"training.micro_batch_size", "parallelism.pipeline_parallel_size", "precision.compute",
                           "communication.bucket_size_mib", "cluster.gpus_per_node"})
    EXPECT_TRUE(compared.count(path)) << path;
  EXPECT_GT(checked, 1000);
}

// ---- What the compute model's inventory cache relies on -------------------------------------

// The framework pricing as sim/cost/compute_model.cpp wrote it before its
// inventory was cached and its products' shape part kept (main at da8390b), written out: the
// definition the cached pricing is checked against. Context parallelism's collectives and the
// tensor-parallel overlap (their mechanisms: docs/model.md; closed forms:
// tests/test_context_parallel.cpp, tests/test_tp_overlap.cpp) came later and are written out too.
namespace reference {

double gemm_seconds(const KernelShape& s, double elem_bytes, double peak_flops, const ClusterConfig& cl,
                    double c_bytes = -1) {
  if (s.flops() <= 0) return 0;
  double efficiency = cl.compute_efficiency;
  if (s.is_matmul() && s.n > 0 && s.k > 0) {
    const double m = static_cast<double>(s.m), n = static_cast<double>(s.n), k = static_cast<double>(s.k);
    const double batch = static_cast<double>(std::max<long>(1, s.batch));
    double best = 0;
    for (const GemmTile& t : kTiles) {
      const double tiles_m = std::ceil(m / t.m), tiles_n = std::ceil(n / t.n);
      const double tiles = tiles_m * tiles_n * batch;
      const double tile_use = m * n / (tiles_m * t.m * tiles_n * t.n);
      double wave_use = 1;
      if (cl.sm_count > 0) {
        const double waves = std::ceil(tiles / cl.sm_count);
        wave_use = tiles / (waves * cl.sm_count);
      }
      best = std::max(best, t.efficiency * tile_use * wave_use);
    }
    efficiency = cl.compute_efficiency * best * k / (k + kDepthOverhead);
  }
  const double compute = s.flops() / (peak_flops * efficiency);
  const double m = static_cast<double>(s.m), n = static_cast<double>(s.n), k = static_cast<double>(s.k);
  const double c = c_bytes < 0 ? elem_bytes : c_bytes;
  const double io = ((m * k + k * n) * elem_bytes + m * n * c) * static_cast<double>(std::max<long>(1, s.batch));
  const double memory = memory_seconds(io, cl);
  return std::sqrt(compute * compute + memory * memory);
}

// A product on `sms` of the GPU's SMs: its tiles in waves of that many, the peak scaled with them.
double product_on_sms(const KernelShape& s, double elem_bytes, double peak_flops, ClusterConfig cl, int sms,
                      double c_bytes = -1) {
  const double share = static_cast<double>(sms) / cl.sm_count;
  cl.sm_count = sms;
  return reference::gemm_seconds(s, elem_bytes, peak_flops * share, cl, c_bytes);
}

// Transformer Engine's userbuffers: one hop's latency, the bytes at the NVLink bus bandwidth.
double userbuffers_seconds(double bytes, const ClusterConfig& cl) {
  return us_to_seconds(cl.intra_node.latency_us) +
         bytes / (gbps_to_bytes_per_second(cl.intra_node.bandwidth_gbps) * cl.intra_node.efficiency);
}

// One op's framework kernels on one tensor-parallel rank, in seconds.
double framework_seconds(const Plan& p, const std::vector<KernelWork>& ws) {
  const ClusterConfig& cl = p.config.cluster;
  const DType compute = p.config.precision.compute;
  const double peak = p.peak_flops(compute) * cl.sustained_clock_fraction;
  const double attention_peak = compute == DType::fp8 ? p.peak_flops(DType::bf16) * cl.sustained_clock_fraction : peak;
  const double elem = compute == DType::fp8 ? 1.0 : dtype_bytes(compute);
  const bool apex = p.config.model.layernorm_kernel == LayerNormKernel::apex &&
                    p.config.model.normalization == Normalization::layernorm && p.config.model.fused_elementwise;
  const int t = p.tp, per_node = std::max(1, cl.gpus_per_node);
  const GroupShape tp_group{t, std::max(1, (t + per_node - 1) / per_node), std::min(t, per_node)};
  const int c = p.cp, cp_per_node = p.cp_members_per_node();
  const GroupShape cp_group{c, (c + cp_per_node - 1) / cp_per_node, cp_per_node};
  const bool cp_across = cp_group.nodes > 1;
  const P2pChannels cp_channels = nccl_p2p_channel_range(c, cp_across, cl);
  const bool fused_accumulation =
      p.config.training.gradient_accumulation_fusion && p.framework == Framework::megatron;
  constexpr int kSplits = 4, kCommSms = 16;  // userbuffers' pipelined chunks and the SMs its kernels hold
  // A causal decoder's attention: half the scores and 64 more per key (n: every key, under
  // context parallelism every rank's).
  auto attention = [&](const KernelShape& s, bool cudnn) {
    const double causal = std::min(1.0, 0.5 + 64.0 / static_cast<double>(s.n));
    return s.flops() * causal / (attention_peak * (cudnn ? cl.cudnn_attention_efficiency : cl.attention_efficiency));
  };
  double total = 0;
  for (const KernelWork& w : ws) {
    double x = 0;
    const bool own = w.dtype == compute;
    const double w_peak = own ? peak : p.peak_flops(w.dtype) * cl.sustained_clock_fraction;
    const double w_elem = own ? elem : dtype_bytes(w.dtype);
    if (w.kernel == "cp.allgather") {
      x = nccl_collective(OpKind::AllGather, cp_group, w.bytes, cl).seconds;
    } else if (w.kernel == "cp.reducescatter") {
      x = nccl_collective(OpKind::ReduceScatter, cp_group, w.bytes, cl).seconds;
    } else if (w.kernel == "cp.ring.forward" || w.kernel == "cp.ring.backward") {
      // c steps of 1/c of the attention each; the c - 1 sends cost what their step does not cover,
      // and the backward sends the last gradients home once more.
      const double step = attention(w.shape, p.config.model.attention == AttentionKernel::cudnn) / c;
      auto send = [&](double bytes) {
        const LinkConfig& link = cp_across ? cl.inter_node : cl.intra_node;
        return us_to_seconds(link.latency_us) +
               bytes / nccl_p2p_bytes_per_second(bytes, !cp_across, cp_channels, cp_across, cl);
      };
      x = (c - 1) * std::max(0.0, send(w.bytes) - step);
      if (w.kernel == "cp.ring.backward") x += send(w.bytes / 2);
    } else if (w.kernel.rfind("tp.overlap.", 0) == 0) {
      // What the overlapped collective adds to its product: the pair less the product alone.
      const bool bulk = w.kernel == "tp.overlap.bulk_reducescatter";
      // Megatron-LM's NCCL collectives beside a backward product: the input gradient's
      // all-reduce or reduce-scatter beside the weight-gradient product, the input's re-gather
      // beside the input-gradient product.
      const bool async_reduce = w.kernel == "tp.overlap.async_allreduce" || w.kernel == "tp.overlap.async_reducescatter";
      const bool async_gather = w.kernel == "tp.overlap.async_allgather";
      const double accumulate = (bulk || async_reduce) && fused_accumulation ? 8.0 : -1;
      const double alone = product_on_sms(w.shape, w_elem, w_peak, cl, cl.sm_count, accumulate);
      auto rows = [&](int parts) {
        KernelShape r = w.shape;
        r.m = (w.shape.m + parts - 1) / parts;
        return r;
      };
      double pair = alone;
      if (w.kernel == "tp.overlap.ring_allgather" || w.kernel == "tp.overlap.ring_reducescatter") {
        const double g = product_on_sms(rows(t), w_elem, w_peak, cl, cl.sm_count);
        pair = g + (t - 1) * std::max(g, userbuffers_seconds(w.bytes / t, cl));
      } else if (w.kernel == "tp.overlap.pipeline_reducescatter") {
        const double g = product_on_sms(rows(kSplits), w_elem, w_peak, cl, cl.sm_count - kCommSms);
        const double comm = userbuffers_seconds((t - 1.0) / t * w.bytes / kSplits, cl);
        pair = g + (kSplits - 1) * std::max(g, comm) + comm;
      } else if (bulk) {
        pair = std::max(product_on_sms(w.shape, w_elem, w_peak, cl, cl.sm_count - kCommSms, accumulate),
                        userbuffers_seconds((t - 1.0) / t * w.bytes, cl));
      } else if (async_reduce || async_gather) {
        const OpKind kind = w.kernel == "tp.overlap.async_allreduce"       ? OpKind::AllReduce
                            : w.kernel == "tp.overlap.async_reducescatter" ? OpKind::ReduceScatter
                                                                           : OpKind::AllGather;
        pair = std::max(product_on_sms(w.shape, w_elem, w_peak, cl, cl.sm_count - cl.collective_sms, accumulate),
                        nccl_collective(kind, tp_group, w.bytes, cl).seconds);
      } else {
        ADD_FAILURE() << "no reference for " << w.kernel;
      }
      x = std::max(0.0, pair - alone);
    } else if (w.kernel == "tp.allreduce") {
      x = nccl_collective(OpKind::AllReduce, tp_group, w.bytes, cl).seconds;
    } else if (w.kernel == "tp.allgather") {
      x = nccl_collective(OpKind::AllGather, tp_group, w.bytes, cl).seconds;
    } else if (w.kernel == "tp.reducescatter") {
      x = nccl_collective(OpKind::ReduceScatter, tp_group, w.bytes, cl).seconds;
    } else if (w.kernel.rfind("flash_attention", 0) == 0 || w.kernel.rfind("cudnn_attention", 0) == 0) {
      x = attention(w.shape, w.kernel.rfind("cudnn_attention", 0) == 0);
    } else if (w.shape.is_matmul()) {
      // A product in another format than the compute's (FP8's output layer in BF16): its rate and bytes.
      x = w.kernel == "linear.backward_weight_accumulate" ? reference::gemm_seconds(w.shape, w_elem, w_peak, cl, 8.0)
                                                           : reference::gemm_seconds(w.shape, w_elem, w_peak, cl);
    } else {
      double factor = 1.0;
      if (apex && w.kernel.rfind("layernorm.", 0) == 0)
        factor = w.kernel == "layernorm.forward" ? 0.0751 / 0.0535 : 0.1762 / 0.0866;
      x = memory_seconds(w.bytes, cl) * factor;
      if (w.random_draws > 0 && cl.int32_tops > 0) {  // a dropout mask: 25 integer instructions a draw
        const double draws = w.random_draws * 25 / (cl.int32_tops * 1e12 * cl.sustained_clock_fraction);
        x = std::sqrt(x * x + draws * draws);
      }
    }
    total += w.count * x;
  }
  return total;
}

}  // namespace reference

// Random plans with the model's kernel settings drawn too (apex or persistent layernorm, fused
// or eager element-wise kernels and biases, gradient-accumulation fusion, the attention
// kernels, FP8).
std::optional<ScenarioConfig> random_kernels(RandomPlans& random) {
  auto c = random.next();
  if (!c) return c;
  ModelConfig& m = c->model;
  m.layernorm_kernel = static_cast<LayerNormKernel>(random.pick({0, 1}));
  m.normalization = static_cast<Normalization>(random.pick({0, 0, 1}));
  m.fused_elementwise = random.pick({0, 1});
  m.fused_linear_bias = random.pick({0, 1});
  m.attention = static_cast<AttentionKernel>(random.pick({0, 1, 2}));
  c->training.gradient_accumulation_fusion = random.pick({0, 1});
  c->cluster.sm_count = random.pick({0, 108, 132});
  if (random.pick({0, 0, 0, 1})) {
    c->precision.compute = DType::fp8;
    c->cluster.peak_tflops[DType::fp8] = 1979;
  }
  try {
    Plan::from_config(*c);
  } catch (const ScenarioError&) {
    return std::nullopt;
  }
  return c;
}

// The compute model's chunk prices, with and without an inventory cache (one cache across every
// plan and price, as a sweep worker's), equal the reference pricing of the plan's framework
// kernels, chunk by chunk, bit for bit.
TEST(ComputeModel, PricesEqualTheReferenceWithAndWithoutTheInventoryCache) {
  RandomPlans random(20261204);
  KernelInventoryCache cache;
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const auto drawn = random_kernels(random);
    if (!drawn) continue;
    for (int k = 0; k < 3; ++k) {
      ScenarioConfig c = *drawn;
      if (k > 0) random.reprice(c);
      Plan plan;
      try {
        plan = Plan::from_config(c);
      } catch (const ScenarioError&) {
        continue;
      }
      SCOPED_TRACE(describe(trial, c));
      const RooflineComputeModel fresh(plan), cached(plan, &cache);
      const auto chunks = chunk_kernels(plan, plan.activation_bytes(), InventoryTarget::framework);
      ASSERT_EQ(chunks.size(), static_cast<std::size_t>(plan.num_virtual_stages()));
      for (int vs = 0; vs < plan.num_virtual_stages(); ++vs) {
        const auto& want = chunks[vs];
        const auto& got = cached.chunk(vs);
        ASSERT_EQ(got.forward, fresh.chunk(vs).forward) << "chunk " << vs;
        ASSERT_EQ(got.backward_input, fresh.chunk(vs).backward_input) << "chunk " << vs;
        ASSERT_EQ(got.backward_weight, fresh.chunk(vs).backward_weight) << "chunk " << vs;
        ASSERT_EQ(got.forward, reference::framework_seconds(plan, want.forward)) << "chunk " << vs;
        ASSERT_EQ(got.backward_input, reference::framework_seconds(plan, want.backward_input)) << "chunk " << vs;
        ASSERT_EQ(got.backward_weight, reference::framework_seconds(plan, want.backward_weight)) << "chunk " << vs;
      }
      Op step;
      step.kind = OpKind::OptimizerStep;
      for (int r = 0; r < plan.num_ranks(); ++r) ASSERT_EQ(cached.duration(step, r), fresh.duration(step, r));
      ++compared;
    }
  }
  EXPECT_GT(compared, 400);
}

// Every field that inventory_key_into clears, changed on random plans to every other value of
// its kind: a compute model served from the cache entry of the plan before the change prices
// every chunk and the optimizer step as a fresh model of the changed plan does. A field that
// starts to shape the kernels fails here until the key compares it.
TEST(InventoryKey, ClearedFieldsLeaveTheKernelsUnchanged) {
  RandomPlans random(20261205);
  std::vector<ScenarioConfig> bases;
  while (bases.size() < 30)
    if (auto c = random_kernels(random)) bases.push_back(*c);
  std::set<std::string> cleared, compared;
  int checked = 0;
  ScenarioConfig key_a, key_b;
  for (const FieldSpec& f : scenario_fields()) {
    if (!f.get || !f.set) continue;
    for (const ScenarioConfig& base : bases) {
      for (const FieldValue& v : other_values(f, f.get(base))) {
        ScenarioConfig changed = base;
        try {
          f.set(changed, v);
        } catch (const std::exception&) {
          continue;
        }
        inventory_key_into(base, key_a);
        inventory_key_into(changed, key_b);
        if (!(key_a == key_b)) {
          compared.insert(f.path);
          continue;
        }
        cleared.insert(f.path);
        Plan a, b;
        try {
          a = Plan::from_config(base);
          b = Plan::from_config(changed);
        } catch (const ScenarioError&) {
          continue;
        }
        if (a.config.cluster.calibrated || b.config.cluster.calibrated) continue;  // not the framework path
        KernelInventoryCache cache;
        std::optional<RooflineComputeModel> served, fresh;
        try {  // a rate of 0 prices ops beyond what a tick holds: then both refuse
          const RooflineComputeModel warm(a, &cache);
          fresh.emplace(b);
        } catch (const std::exception&) {
          continue;
        }
        served.emplace(b, &cache);
        for (int vs = 0; vs < b.num_virtual_stages(); ++vs) {
          const auto &x = served->chunk(vs), &y = fresh->chunk(vs);
          ASSERT_TRUE(x.forward == y.forward && x.backward_input == y.backward_input &&
                      x.backward_weight == y.backward_weight)
              << f.path << " = " << format_field_value(v) << " changes chunk " << vs;
        }
        ++checked;
      }
    }
  }
  for (const char* path : {"cluster.compute_efficiency", "cluster.hbm_bandwidth_gbps", "cluster.inter_node.bandwidth_gbps",
                           "cluster.memory_gib"})
    EXPECT_TRUE(cleared.count(path)) << path;
  for (const char* path : {"training.micro_batch_size", "training.activation_recompute", "parallelism.sequence_parallel",
                           "cluster.sm_count", "precision.compute", "model.attention"})
    EXPECT_TRUE(compared.count(path)) << path;
  EXPECT_GT(checked, 500);
}

// The compute model prices an op from its kind, chunk, work and rank: the same op with
// another micro-batch, message, bucket, byte count, peer or dep costs the same. StepProgram
// prices one op per (rank, kind, chunk, work) and relies on it.
TEST(StepProgram, ComputePriceReadsOnlyKindChunkWorkAndRank) {
  RandomPlans random(20261128);
  int ops = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const auto c = random.next();
    if (!c) continue;
    const Plan plan = Plan::from_config(*c);
    const RooflineComputeModel model(plan);
    const Schedule s = build_schedule(plan);
    for (const auto& prog : s.ranks)
      for (const Op& op : prog.ops) {
        if (!is_compute(op.kind)) continue;
        Op other = op;
        other.microbatch = op.microbatch + 5;
        other.channel = 12345;
        other.bucket = op.bucket + 3;
        other.bytes = op.bytes * 3 + 1;
        other.peer = prog.rank + 1;
        other.dep = -1;
        ASSERT_EQ(model.duration(other, prog.rank), model.duration(op, prog.rank))
            << op_label(op) << " on rank " << prog.rank;
        ++ops;
      }
  }
  EXPECT_GT(ops, 10000);
}

// ---- The Result's per-rank figures, one pass against several ------------------------------

// The figures compute_result_into derives from a timeline, each computed on its own the way
// core/metrics.cpp did before it read a rank's ops in one pass (the definitions, written
// plainly): the step from Timeline::begin() and end(); busy time; collective time; and the
// idle time split, gap by gap, with every collective of the rank known.
namespace reference {

std::vector<OpTiming> merged(std::vector<OpTiming> v) {
  std::sort(v.begin(), v.end(), [](const OpTiming& a, const OpTiming& b) { return a.start < b.start; });
  std::vector<OpTiming> out;
  for (const auto& x : v) {
    if (x.end <= x.start) continue;
    if (!out.empty() && x.start <= out.back().end)
      out.back().end = std::max(out.back().end, x.end);
    else
      out.push_back(x);
  }
  return out;
}

Tick covered(Tick a, Tick b, const std::vector<OpTiming>& m) {
  Tick total = 0;
  for (const auto& x : m) {
    const Tick lo = std::max(a, x.start), hi = std::min(b, x.end);
    if (hi > lo) total += hi - lo;
  }
  return total;
}

struct Figures {
  Tick busy = 0, collective = 0, comm = 0;
};

Figures rank_figures(const RankProgram& prog, const std::vector<OpTiming>& times, Tick begin, Tick end,
                     bool pipelined) {
  Figures f;
  std::vector<int> coll_index;
  std::vector<OpTiming> colls;
  for (std::size_t i = 0; i < prog.ops.size(); ++i) {
    const OpKind kind = prog.ops[i].kind;
    if (is_compute(kind)) f.busy += times[i].end - times[i].start;
    if (is_collective(kind)) {
      coll_index.push_back(static_cast<int>(i));
      colls.push_back(times[i]);
      if (kind != OpKind::OverflowCheck) f.collective += times[i].end - times[i].start - times[i].waited;
    }
  }
  auto other_ranks = [&](Tick len) {
    if (!pipelined) f.comm += len;
  };
  Tick cursor = begin;
  for (std::size_t i = 0; i < prog.ops.size(); ++i) {
    const Op& op = prog.ops[i];
    if (!is_compute(op.kind) && !is_recv(op.kind)) continue;
    const OpTiming& t = times[i];
    if (t.start > cursor) {
      const Tick g0 = cursor, g1 = t.start;
      if (op.dep >= 0 && is_collective(prog.ops[static_cast<std::size_t>(op.dep)].kind)) {
        auto k = static_cast<std::size_t>(std::find(coll_index.begin(), coll_index.end(), op.dep) - coll_index.begin());
        Tick hi = g1;
        while (k < coll_index.size()) {
          const OpTiming& c = times[coll_index[k]];
          const Tick lo = std::max(g0, c.start), up = std::min(hi, c.end);
          if (up > lo) f.comm += up - lo;
          hi = std::min(hi, c.start);
          if (hi <= g0 || k == 0 || times[coll_index[k - 1]].end < c.start) break;
          --k;
        }
        if (hi > g0) other_ranks(hi - g0);
      } else {
        other_ranks(g1 - g0);
      }
    }
    cursor = std::max(cursor, t.end);
  }
  if (end > cursor) {
    const Tick own = covered(cursor, end, merged(colls));
    f.comm += own;
    other_ranks(end - cursor - own);
  }
  return f;
}

}  // namespace reference

// compute_result_into's step and per-rank figures equal the reference's, for every rank of
// `tl` (or, with same_as, for the ranks it simulated; their twins copy them), with and
// without the schedule's ResultIndex.
void expect_reference_figures(const Plan& plan, const Timeline& tl, const std::vector<int>* same_as) {
  Result got, indexed;
  ResultWorkspace ws;
  compute_result_into(plan, tl, {}, got, ws, same_as);
  ResultIndex index;  // what a sweep passes with each timeline of a schedule: the same Result
  result_index_into(*tl.schedule, index);
  compute_result_into(plan, tl, {}, indexed, ws, same_as, &index);
  ASSERT_TRUE(indexed == got);
  Timeline simulated = tl;  // Timeline::begin() and end() over the ranks that are not twins
  if (same_as)
    for (std::size_t r = 0; r < simulated.ops.size(); ++r)
      if ((*same_as)[r] < static_cast<int>(r)) simulated.ops[r].clear();
  const Tick t0 = simulated.begin(), step = simulated.end() - t0;
  ASSERT_EQ(got.step_time_s, ticks_to_seconds(step));
  const Schedule& s = *tl.schedule;
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const std::size_t from = same_as ? static_cast<std::size_t>((*same_as)[r]) : r;
    const auto want = reference::rank_figures(s.ranks[from], tl.ops[from], t0, t0 + step, plan.pp > 1);
    const RankResult& rr = got.ranks[r];
    ASSERT_EQ(rr.busy_s, ticks_to_seconds(want.busy)) << "rank " << r;
    ASSERT_EQ(rr.allreduce_s, ticks_to_seconds(want.collective)) << "rank " << r;
    ASSERT_EQ(rr.exposed_comm_s, ticks_to_seconds(want.comm)) << "rank " << r;
    ASSERT_EQ(rr.pipeline_bubble_s, ticks_to_seconds(std::max<Tick>(0, step - want.busy - want.comm))) << "rank " << r;
  }
}

// Predicted timelines of random plans, and the same timelines shaken: every op's start and
// end moved at random (some ops ending before they start, some collectives overlapping), so
// that gaps open before compute ops, receives and ops that wait for collectives, as measured
// timelines have them.
// A measured collective that was held up (a ZeRO-3 gather waiting between units for its pass
// to free room: OpTiming::waited) counts only its working time as communication.
TEST(ComputeResult, ACollectivesWaitsAreNotCommunication) {
  ScenarioConfig c = testing::small_config(1, 2, ScheduleKind::one_f_one_b, 1, 2);
  c.parallelism.zero_stage = 3;
  const Plan plan = Plan::from_config(c);
  const Prediction p = predict(plan);
  Timeline held = p.timeline;
  const auto& ops = p.schedule->ranks[0].ops;
  Tick waited = 0;
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (ops[i].kind == OpKind::AllGather && ops[i].bucket == 1) {
      OpTiming& t = held.ops[0][i];
      t.waited = (t.end - t.start) / 3;
      waited += t.waited;
    }
  ASSERT_GT(waited, 0);
  Result a, b;
  ResultWorkspace ws;
  compute_result_into(plan, p.timeline, {}, a, ws, nullptr);
  compute_result_into(plan, held, {}, b, ws, nullptr);
  EXPECT_NEAR(a.ranks[0].allreduce_s - b.ranks[0].allreduce_s, ticks_to_seconds(waited), 1e-15);
  EXPECT_EQ(a.ranks[0].busy_s, b.ranks[0].busy_s);
  EXPECT_EQ(a.step_time_s, b.step_time_s);
}

TEST(ComputeResult, OnePassEqualsTheFiguresComputedOneByOne) {
  RandomPlans random(20261129);
  std::mt19937 shake(7);
  int compared = 0, with_gaps = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const auto c = random.next();
    if (!c) continue;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": " << schedule_name(c->parallelism.schedule)
                                      << " p=" << c->parallelism.pipeline_parallel_size
                                      << " d=" << c->parallelism.data_parallel_size
                                      << " zero=" << c->parallelism.zero_stage);
    const Plan plan = Plan::from_config(*c);
    const Prediction p = predict(plan);
    std::vector<int> same_as(p.schedule->ranks.size());
    for (std::size_t r = 0; r < same_as.size(); ++r) same_as[r] = plan.rank_of(plan.stage_of(static_cast<int>(r)), 0);
    expect_reference_figures(plan, p.timeline, nullptr);
    expect_reference_figures(plan, p.timeline, &same_as);
    Timeline shaken = p.timeline;
    const Tick span = std::max<Tick>(1, p.timeline.end() - p.timeline.begin());
    std::uniform_int_distribution<Tick> jitter(-span / 50, span / 50);
    std::uniform_int_distribution<int> percent(0, 99);
    for (auto& row : shaken.ops)
      for (auto& t : row) {
        if (percent(shake) < 30) t.start += jitter(shake);
        if (percent(shake) < 30) t.end += jitter(shake);
      }
    expect_reference_figures(plan, shaken, nullptr);
    expect_reference_figures(plan, shaken, &same_as);
    if (HasFailure()) return;
    ++compared;
    const Result r = compute_result(plan, shaken, {});
    with_gaps += std::any_of(r.ranks.begin(), r.ranks.end(), [](const RankResult& x) { return x.exposed_comm_s > 0; });
  }
  EXPECT_GT(compared, 150);
  EXPECT_GT(with_gaps, 50);
}

// One workspace reused result after result, as a sweep worker's is: the memory warnings it
// keeps from the last result are those a fresh workspace writes, whether the memory, the
// capacity or the ranks changed in between or not.
TEST(ComputeResult, AReusedWorkspaceWritesEachResultsMemoryWarnings) {
  RandomPlans random(20261203);
  ResultWorkspace ws;
  Result reused;
  int compared = 0, over = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const auto c = random.next();
    if (!c) continue;
    const Prediction p = predict(Plan::from_config(*c));
    for (const double gib : {0.001, 0.001, 0.08, 1e9, 0.08}) {
      ScenarioConfig priced = *c;
      priced.cluster.memory_gib = gib;
      const Plan plan = Plan::from_config(priced);
      compute_result_into(plan, p.timeline, p.memory, reused, ws);
      const Result fresh = compute_result(plan, p.timeline, p.memory);
      expect_same_result(reused, fresh);
      if (HasFailure()) return;
      ++compared;
      over += !fresh.fits_in_memory;
    }
  }
  EXPECT_GT(compared, 500);
  EXPECT_GT(over, 100);
}

// An op whose dependency is a collective later in its rank's program (build_schedule makes
// none): its gap is split with every collective of the rank known, as before.
TEST(ComputeResult, GapBeforeAnOpWaitingForALaterCollective) {
  const Plan plan = Plan::from_config(testing::small_config(1, 1, ScheduleKind::gpipe, 1, 1));
  auto s = std::make_shared<Schedule>();
  s->collectives.push_back({OpKind::AllReduce, CollectivePurpose::gradients, 64, {0}});
  s->collectives.push_back({OpKind::AllReduce, CollectivePurpose::gradients, 64, {0}});
  RankProgram prog;
  Op first, fwd, second;
  first.kind = second.kind = OpKind::AllReduce;
  first.channel = 0;
  second.channel = 1;
  fwd.kind = OpKind::Forward;
  fwd.chunk = 0;
  fwd.dep = 2;
  prog.ops = {first, fwd, second};
  s->ranks.push_back(prog);
  Timeline tl;
  tl.schedule = s;
  tl.ops = {{{0, 10}, {50, 60}, {30, 45}}};
  expect_reference_figures(plan, tl, nullptr);
  // The gap [0, 50) before the forward: the collective it waits for runs 30-45, the one ahead
  // of it on the stream ended at 10 (so the wait before 30 was for other ranks: with one
  // stage, communication).
  const Result r = compute_result(plan, tl, {});
  EXPECT_EQ(r.ranks[0].exposed_comm_s, ticks_to_seconds(45));
}

}  // namespace
}  // namespace trainsim
