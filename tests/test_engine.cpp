// The discrete-event engine on hand-built schedules: stream order, dependencies,
// message arrival, collective rendezvous, determinism, deadlock detection, and many
// simulations running at once on many threads.
#include <gtest/gtest.h>

#include <cmath>
#include <future>
#include <limits>
#include <stdexcept>
#include <random>
#include <thread>

#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/p2p_model.h"
#include "core/presets.h"
#include "core/scenario.h"
#include "sim/simulator.h"
#include "tests/sim_equality.h"
#include "tests/test_helpers.h"

namespace trainsim {
namespace {

using testing::FixedCollectives;
using testing::FixedP2P;
using testing::UniformCompute;

Op op(OpKind kind, int microbatch = 0) {
  Op o;
  o.kind = kind;
  o.chunk = 0;
  o.microbatch = microbatch;
  return o;
}

// Two ranks: rank 0 computes F (10) and sends it; rank 1 waits for it, computes F, and both
// all-reduce. The all-reduce starts when the slower member arrives, on both ranks at once.
std::shared_ptr<Schedule> two_rank_schedule() {
  auto s = std::make_shared<Schedule>();
  s->num_messages = 1;
  s->collectives.push_back({OpKind::AllReduce, CollectivePurpose::gradients, 1024, {0, 1}});
  RankProgram r0{0, 0, 0, {}}, r1{1, 1, 0, {}};
  r0.ops.push_back(op(OpKind::Forward));                 // 0: [0, 10)
  Op send = op(OpKind::SendActivation);                   // 1: p2p [10, 15)
  send.peer = 1, send.channel = 0, send.dep = 0;
  r0.ops.push_back(send);
  Op ar = op(OpKind::AllReduce);
  ar.channel = 0, ar.dep = 0, ar.bucket = 0;
  r0.ops.push_back(ar);                                   // 2: waits for rank 1
  Op recv = op(OpKind::RecvActivation);
  recv.peer = 0, recv.channel = 0;
  r1.ops.push_back(recv);                                 // 0: until 15
  r1.ops.push_back(op(OpKind::Forward));                  // 1: [15, 25)
  Op ar1 = ar;
  ar1.dep = 1;
  r1.ops.push_back(ar1);                                  // 2: [25, 32) on both
  s->ranks = {r0, r1};
  return s;
}

TEST(Engine, StreamsDependenciesMessagesAndRendezvous) {
  auto s = two_rank_schedule();
  ASSERT_EQ(check_schedule(*s), "");
  const UniformCompute compute(10, 0, 0);
  const FixedP2P p2p(5);
  const FixedCollectives coll(7);
  const Timeline tl = simulate_schedule(s, CostModels{&compute, &p2p, &coll});
  EXPECT_EQ(tl.ops[0][0].start, 0);
  EXPECT_EQ(tl.ops[0][0].end, 10);
  EXPECT_EQ(tl.ops[0][1].start, 10);  // the send waits for the forward it carries
  EXPECT_EQ(tl.ops[0][1].end, 15);
  EXPECT_EQ(tl.ops[1][0].end, 15);    // the receive ends when the message arrives
  EXPECT_EQ(tl.ops[1][1].start, 15);
  EXPECT_EQ(tl.ops[1][1].end, 25);
  EXPECT_EQ(tl.ops[0][2].start, 25);  // rank 0 arrived at 10 but waits for rank 1
  EXPECT_EQ(tl.ops[1][2].start, 25);
  EXPECT_EQ(tl.ops[0][2].end, 32);
  EXPECT_EQ(tl.ops[1][2].end, 32);
  EXPECT_EQ(tl.end(), 32);
}

// A collective model that adds `wake` where the first member led the last by more than `poll`
// (HardwareProfile::comm_wake_us's rule): rank 0 reaches the all-reduce at 10, rank 1 at 25.
class WakingCollectives final : public CollectiveModel {
 public:
  WakingCollectives(Tick t, Tick poll, Tick wake) : t_(t), poll_(poll), wake_(wake) {}
  Tick duration(const Collective&) const override { return t_; }
  Tick wake_after(Tick waited) const override { return waited > poll_ ? wake_ : 0; }

 private:
  Tick t_, poll_, wake_;
};

TEST(Engine, ACollectiveWhoseFirstMemberWaitedPastThePollAddsTheWakeUp) {
  auto s = two_rank_schedule();
  const UniformCompute compute(10, 0, 0);
  const FixedP2P p2p(5);
  for (const auto& [poll, end] : {std::pair<Tick, Tick>{15, 32}, {14, 36}}) {
    const WakingCollectives coll(7, poll, 4);
    const Timeline tl = simulate_schedule(s, CostModels{&compute, &p2p, &coll});
    EXPECT_EQ(tl.ops[0][2].start, 25) << "poll " << poll;
    EXPECT_EQ(tl.ops[0][2].end, end) << "poll " << poll;
    EXPECT_EQ(tl.ops[1][2].end, end) << "poll " << poll;
  }
}

// The calibrated profile's rules, and nothing without one: a member that slept (its lead past the
// poll) pays comm_wake_us; otherwise the comm_late curve at its lead, linear from (0, 0) through
// the measured points and flat past the last; never both.
TEST(Engine, NetworkCollectivesAddTheProfilesWakeUpOrLateLatencyByTheLead) {
  Plan plan = Plan::from_config(testing::small_config(2, 1, ScheduleKind::one_f_one_b, 1, 2));
  EXPECT_FALSE(NetworkCollectiveModel(plan).prices_wake());
  EXPECT_EQ(NetworkCollectiveModel(plan).wake_after(seconds_to_ticks(1.0)), 0);
  auto profile = std::make_shared<HardwareProfile>();
  plan.config.cluster.calibrated = profile;
  profile->comm_late = {{1000, 3}, {4000, 9}, {11000, 100}};
  const NetworkCollectiveModel polling(plan);
  EXPECT_TRUE(polling.prices_wake());
  EXPECT_EQ(polling.wake_after(0), 0);
  EXPECT_EQ(polling.wake_after(seconds_to_ticks(500e-6)), seconds_to_ticks(1.5e-6));
  EXPECT_EQ(polling.wake_after(seconds_to_ticks(1000e-6)), seconds_to_ticks(3e-6));
  EXPECT_EQ(polling.wake_after(seconds_to_ticks(2500e-6)), seconds_to_ticks(6e-6));
  EXPECT_EQ(polling.wake_after(seconds_to_ticks(7500e-6)), seconds_to_ticks(54.5e-6));
  EXPECT_EQ(polling.wake_after(seconds_to_ticks(1.0)), seconds_to_ticks(100e-6));
  profile->comm_late.clear();
  profile->comm_poll_us = 100;
  profile->comm_wake_us = 40;
  const NetworkCollectiveModel sleeping(plan);
  EXPECT_TRUE(sleeping.prices_wake());
  EXPECT_EQ(sleeping.wake_after(seconds_to_ticks(100e-6)), 0);
  EXPECT_EQ(sleeping.wake_after(seconds_to_ticks(101e-6)), seconds_to_ticks(40e-6));
  profile->comm_late = {{1000, 3}};
  const NetworkCollectiveModel both(plan);
  EXPECT_EQ(both.wake_after(seconds_to_ticks(50e-6)), seconds_to_ticks(0.15e-6));
  EXPECT_EQ(both.wake_after(seconds_to_ticks(2e-3)), seconds_to_ticks(40e-6));
}

// Where the profile says which call the curve was measured with, the late call's own time (its
// time together plus the curve) replaces the benchmark's price of that call: charged is their
// difference, never below 0.
TEST(Engine, TheLateCallsOwnTimeReplacesTheBenchmarksPrice) {
  Plan plan = Plan::from_config(testing::small_config(2, 1, ScheduleKind::one_f_one_b, 1, 2));
  auto profile = std::make_shared<HardwareProfile>();
  plan.config.cluster.calibrated = profile;
  profile->comm_late = {{1000, 3}, {4000, 9}, {11000, 100}};
  profile->comm_late_bytes = 131072;
  profile->comm_late_base_us = 20;
  profile->allreduce_tables[2].rows = {{65536, 30e-6}, {131072, 40e-6}, {262144, 60e-6}};
  const NetworkCollectiveModel m(plan);
  EXPECT_EQ(m.wake_after(seconds_to_ticks(1e-3)), 0);                           // 20 + 3 < 40
  EXPECT_EQ(m.wake_after(seconds_to_ticks(11e-3)), seconds_to_ticks(80e-6));    // 20 + 100 - 40
  EXPECT_EQ(m.wake_after(seconds_to_ticks(7.5e-3)), seconds_to_ticks(34.5e-6)); // 20 + 54.5 - 40
  EXPECT_NEAR(profile->comm_late_charge_us(11000), 80, 1e-9);
}

// Blocking sends are a rendezvous (Megatron-LM's batched isend/irecv without p2p overlap):
// rank 0 sends after its forward (10), but rank 1 posts the receive only after its own two
// forwards (20): the message moves from 20 to 25, and rank 0's stream is held until then.
// A send and the receive right after it are one exchange: rank 1's send of a gradient back
// and its receive are posted together, so neither rank waits for the other's send to finish.
TEST(Engine, BlockingSendsWaitForTheirReceiver) {
  auto s = std::make_shared<Schedule>();
  s->num_messages = 2;
  RankProgram r0{0, 0, 0, {}}, r1{1, 1, 0, {}};
  r0.ops.push_back(op(OpKind::Forward));                  // 0: [0, 10)
  Op send = op(OpKind::SendActivation);                    // 1: waits for rank 1 to post: [20, 25)
  send.peer = 1, send.channel = 0, send.dep = 0;
  r0.ops.push_back(send);
  Op rg = op(OpKind::RecvGradient);                        // 2: posted with the send at 10
  rg.peer = 1, rg.channel = 1;
  r0.ops.push_back(rg);
  r0.ops.push_back(op(OpKind::Forward, 1));               // 3: after the gradient arrives
  r1.ops.push_back(op(OpKind::Forward, 5));               // 0: [0, 10)
  r1.ops.push_back(op(OpKind::Forward, 6));               // 1: [10, 20)
  Op sg = op(OpKind::SendGradient);                        // 2: rank 0 posted at 10: [20, 25)
  sg.peer = 0, sg.channel = 1, sg.dep = 1;
  r1.ops.push_back(sg);
  Op ra = op(OpKind::RecvActivation);                      // 3: posted with the send at 20
  ra.peer = 0, ra.channel = 0;
  r1.ops.push_back(ra);
  s->ranks = {r0, r1};
  s->kind = ScheduleKind::one_f_one_b;
  ASSERT_EQ(check_schedule(*s), "");
  const UniformCompute compute(10, 0, 0);
  const testing::BlockingP2P p2p(5);
  const FixedCollectives coll(0);
  const Timeline tl = simulate_schedule(s, CostModels{&compute, &p2p, &coll});
  EXPECT_EQ(tl.ops[0][1].start, 20);
  EXPECT_EQ(tl.ops[0][1].end, 25);
  EXPECT_EQ(tl.ops[1][2].start, 20);
  EXPECT_EQ(tl.ops[1][2].end, 25);
  EXPECT_EQ(tl.ops[0][2].end, 25);  // the gradient arrives as the activation leaves
  EXPECT_EQ(tl.ops[1][3].end, 25);
  EXPECT_EQ(tl.ops[0][3].start, 25);
  // ZB-H1 stands for the Zero Bubble runtime, which posts receives ahead: its sends do not wait.
  s->kind = ScheduleKind::zb_h1;
  const Timeline zb = simulate_schedule(s, CostModels{&compute, &p2p, &coll});
  EXPECT_EQ(zb.ops[0][1].start, 10);
  EXPECT_EQ(zb.ops[0][1].end, 15);
}

TEST(Engine, CollectiveStreamOverlapsCompute) {
  // Rank 0: F, then an all-reduce that depends on F, then another F that does not wait
  // for the all-reduce: the second F runs while the collective is in flight.
  auto s = std::make_shared<Schedule>();
  s->collectives.push_back({OpKind::AllReduce, CollectivePurpose::gradients, 8, {0}});
  RankProgram r{0, 0, 0, {}};
  r.ops.push_back(op(OpKind::Forward));
  Op ar = op(OpKind::AllReduce);
  ar.channel = 0, ar.dep = 0;
  r.ops.push_back(ar);
  r.ops.push_back(op(OpKind::Forward, 1));
  s->ranks = {r};
  const UniformCompute compute(10, 0, 0);
  const FixedP2P p2p(0);
  const FixedCollectives coll(30);
  const Timeline tl = simulate_schedule(s, CostModels{&compute, &p2p, &coll});
  EXPECT_EQ(tl.ops[0][1].start, 10);
  EXPECT_EQ(tl.ops[0][2].start, 10);
  EXPECT_EQ(tl.ops[0][2].end, 20);
  EXPECT_EQ(tl.end(), 40);
}

TEST(Engine, DeadlockIsReportedNotHung) {
  // A receive whose message is never sent.
  auto s = std::make_shared<Schedule>();
  s->num_messages = 1;
  RankProgram r{0, 0, 0, {}};
  Op recv = op(OpKind::RecvActivation);
  recv.peer = 0, recv.channel = 0;
  r.ops.push_back(recv);
  r.ops.push_back(op(OpKind::Forward));
  s->ranks = {r};
  EXPECT_NE(check_schedule(*s), "");
  const UniformCompute compute(10, 0, 0);
  const FixedP2P p2p(0);
  const FixedCollectives coll(0);
  try {
    simulate_schedule(s, CostModels{&compute, &p2p, &coll});
    FAIL() << "expected a deadlock report";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 op 0 recv act 0"), std::string::npos) << e.what();
  }
}

ScenarioConfig busy_config() {
  ScenarioConfig c = testing::small_config(4, 16, ScheduleKind::interleaved_1f1b, 2, 2);
  c.communication.overlap_grad_reduce = true;
  c.communication.bucket_size_mib = 0.01;
  c.precision.loss_scaling.mode = LossScalingMode::dynamic;
  return c;
}

bool same_timeline(const Timeline& a, const Timeline& b) {
  if (a.ops.size() != b.ops.size()) return false;
  for (std::size_t r = 0; r < a.ops.size(); ++r) {
    if (a.ops[r].size() != b.ops[r].size()) return false;
    for (std::size_t i = 0; i < a.ops[r].size(); ++i)
      if (a.ops[r][i].start != b.ops[r][i].start || a.ops[r][i].end != b.ops[r][i].end) return false;
  }
  return true;
}

TEST(Engine, DeterministicAcrossRuns) {
  const Plan plan = Plan::from_config(busy_config());
  const Prediction a = predict(plan), b = predict(plan);
  EXPECT_TRUE(same_timeline(a.timeline, b.timeline));
}

TEST(Engine, ManySimulationsOnManyThreadsAgreeWithSerial) {
  std::vector<ScenarioConfig> configs;
  for (int m : {8, 16, 24})
    for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zb_h1}) {
      ScenarioConfig c = testing::small_config(4, m, k, 1, 2);
      c.communication.overlap_grad_reduce = true;
      configs.push_back(c);
    }
  std::vector<Timeline> serial;
  for (const auto& c : configs) serial.push_back(predict(Plan::from_config(c)).timeline);
  std::vector<std::future<Timeline>> parallel;
  for (int round = 0; round < 4; ++round)
    for (const auto& c : configs)
      parallel.push_back(std::async(std::launch::async, [c] { return predict(Plan::from_config(c)).timeline; }));
  for (std::size_t i = 0; i < parallel.size(); ++i)
    EXPECT_TRUE(same_timeline(parallel[i].get(), serial[i % configs.size()])) << "config " << i % configs.size();
}

TEST(Engine, TimeIsIntegerPicoseconds) {
  // 1e6 ops of 1 ps each would be lost by a float clock near 1 s; an integer clock is exact.
  EXPECT_EQ(seconds_to_ticks(1.0), 1'000'000'000'000);
  EXPECT_EQ(seconds_to_ticks(1e-12), 1);
  EXPECT_EQ(seconds_to_ticks(1e-13), 1);  // real work never rounds to zero
  EXPECT_EQ(seconds_to_ticks(0), 0);
  EXPECT_DOUBLE_EQ(ticks_to_seconds(seconds_to_ticks(2.5e-6)), 2.5e-6);
}

// A time a Tick cannot hold is refused, never converted or added into a wrapped integer
// (undefined behaviour; `trainsim simulate` printed a 24 s step at an MFU of 3e12 %).
TEST(Engine, TimesBeyondTheTickRangeAreRefused) {
  EXPECT_EQ(seconds_to_ticks(9.1e6), 9'100'000'000'000'000'000);
  for (double s : {9.3e6, 1e30, std::numeric_limits<double>::infinity(), std::nan("")})
    EXPECT_THROW(seconds_to_ticks(s), std::invalid_argument) << s;
  EXPECT_EQ(add_ticks(5, 7), 12);
  EXPECT_THROW(add_ticks(std::numeric_limits<Tick>::max() - 3, 4), std::invalid_argument);
}

// A 1T-parameter model on one GPU rated at 1 GFLOP/s: one forward lasts about 7,000 years.
// The prediction is refused with std::invalid_argument (a sweep skips the configuration, the
// CLI calls it bad input). Found with fuzz/fuzz_scenario's UBSan
// (fuzz/corpus/scenario/regression-tick-overflow.yaml).
TEST(Engine, PlanFarTooLargeForItsClusterIsRefused) {
  const Scenario sc = load_scenario_text(R"(
model: {preset: megatron-1t, seq_length: 4194304}
cluster:
  gpu: a100-40gb
  num_gpus: 1
  peak_tflops: {fp32: 0.001, tf32: 0.001, fp16: 0.001, bf16: 0.001}
  compute_efficiency: 0.001
training: {micro_batch_size: 1, global_batch_size: 1}
precision: {compute: fp16}
)");
  const Plan plan = Plan::from_scenario(sc);
  try {
    predict(plan);
    ADD_FAILURE() << "predicted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("beyond what the simulator represents"), std::string::npos) << e.what();
  }
  Predictor predictor;
  EXPECT_THROW(predictor.evaluate(plan), std::invalid_argument);
}

// Ops that each fit a Tick but add up past it: the engine's sums are checked too.
TEST(Engine, StepThatAddsUpPastTheTickRangeIsRefused) {
  ScenarioConfig c;  // the default model: 24 layers, hidden 1024, sequence 2048
  c.cluster.num_gpus = c.cluster.gpus_per_node = 1;
  for (auto& [dtype, tflops] : c.cluster.peak_tflops) tflops = 0.001;
  c.cluster.compute_efficiency = 0.001;  // 1 MFLOP/s: a forward lasts ~17 days, a backward twice that
  c.training.micro_batch_size = 1;
  c.training.global_batch_size = 64;  // 64 micro-batches: ~9 years in all
  const Plan plan = Plan::from_config(c);
  ASSERT_EQ(plan.num_microbatches, 64);
  try {
    predict(plan);
    ADD_FAILURE() << "predicted";
  } catch (const std::invalid_argument& e) {
    // The time named is the sum's (just past the range), not one op's.
    const double s = std::stod(std::string(e.what()).substr(std::string("a simulated time of ").size()));
    EXPECT_GT(s, kMaxTickSeconds) << e.what();
    EXPECT_LT(s, kMaxTickSeconds * 1.5) << e.what();
  }
}

}  // namespace
}  // namespace trainsim

namespace trainsim {
namespace {

// Random valid configurations (fixed seed): the schedule is sound, the step completes, and
// the result obeys what must hold whatever the costs: every rank's busy time fits in the
// step, the bubble is a fraction, memory is positive, JSON-able numbers are finite.
TEST(Engine, RandomValidPlansSimulateSoundly) {
  std::mt19937 rng(20261120);
  auto pick = [&](std::initializer_list<int> xs) {
    std::uniform_int_distribution<std::size_t> u(0, xs.size() - 1);
    return *(xs.begin() + u(rng));
  };
  int simulated = 0, with_context_parallelism = 0, with_tp_overlap = 0, with_groups = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const auto kind = static_cast<ScheduleKind>(pick({0, 1, 2, 3}));
    const int p = pick({1, 2, 4, 8}), d = pick({1, 2, 3}), t = pick({1, 2}), v = kind == ScheduleKind::interleaved_1f1b ? pick({2, 3}) : 1;
    if (kind == ScheduleKind::interleaved_1f1b && p < 2) continue;
    const int m = kind == ScheduleKind::interleaved_1f1b ? p * pick({1, 2, 3}) : pick({1, 3, 8, 16});
    ScenarioConfig c = testing::small_config(p, m, kind, v, d);
    c.cluster.num_gpus = p * d * t;
    c.cluster.gpus_per_node = pick({2, 4, 8});
    if (c.cluster.num_gpus > c.cluster.gpus_per_node && c.cluster.num_gpus % c.cluster.gpus_per_node) continue;
    testing::draw_settings(c, p, d, t, m, [&](std::initializer_list<int> xs) { return pick(xs); }, false);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": " << schedule_name(kind) << " p=" << p << " d=" << d
                                      << " t=" << t << " v=" << v << " m=" << m);
    const Plan plan = Plan::from_config(c);
    const Prediction pr = predict(plan);
    ASSERT_EQ(check_schedule(*pr.schedule), "");
    const Result& r = pr.result;
    ASSERT_GT(r.step_time_s, 0);
    EXPECT_GE(r.bubble_fraction, 0);
    EXPECT_LT(r.bubble_fraction, 1);
    EXPECT_TRUE(std::isfinite(r.tokens_per_s) && std::isfinite(r.mfu));
    ASSERT_EQ(r.ranks.size(), static_cast<std::size_t>(p * d));
    // The idle time splits into pipeline bubble and exposed communication, per rank and
    // overall; without a pipeline there is no pipeline bubble.
    EXPECT_NEAR(r.pipeline_bubble_fraction + r.exposed_comm_fraction, r.bubble_fraction, 1e-12);
    EXPECT_GE(r.pipeline_bubble_fraction, 0);
    EXPECT_GE(r.exposed_comm_fraction, 0);
    if (p == 1) {
      EXPECT_EQ(r.pipeline_bubble_fraction, 0);
    }
    for (const auto& rank : r.ranks) {
      EXPECT_LE(rank.busy_s, r.step_time_s * (1 + 1e-12));
      EXPECT_GT(rank.peak_memory_bytes, 0);
      EXPECT_GE(rank.exposed_comm_s, 0);
      EXPECT_GE(rank.pipeline_bubble_s, 0);
      EXPECT_NEAR(rank.pipeline_bubble_s + rank.exposed_comm_s, rank.idle_s, 1e-9 * r.step_time_s);
      if (p == 1) {
        EXPECT_EQ(rank.pipeline_bubble_s, 0);
      }
    }
    ++simulated;
    with_context_parallelism += c.parallelism.context_parallel_size > 1;
    with_tp_overlap += c.communication.tp_comm_overlap;
    with_groups += c.parallelism.microbatch_group_size > 0;
  }
  EXPECT_GT(simulated, 200);
  EXPECT_GT(with_context_parallelism, 30);  // the draw reaches context parallelism too
  EXPECT_GT(with_tp_overlap, 10);           // and the tensor-parallel overlap
  EXPECT_GT(with_groups, 10);               // and interleaving in groups of micro-batches
}

}  // namespace
}  // namespace trainsim

namespace trainsim {
namespace {

using testing::expect_same_memory;
using testing::expect_same_result;
using testing::same_op;

void expect_same_schedule(const Schedule& a, const Schedule& b) {
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.num_stages, b.num_stages);
  EXPECT_EQ(a.num_replicas, b.num_replicas);
  EXPECT_EQ(a.num_chunks, b.num_chunks);
  EXPECT_EQ(a.num_microbatches, b.num_microbatches);
  EXPECT_EQ(a.num_messages, b.num_messages);
  ASSERT_EQ(a.ranks.size(), b.ranks.size());
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    EXPECT_EQ(a.ranks[r].rank, b.ranks[r].rank);
    EXPECT_EQ(a.ranks[r].stage, b.ranks[r].stage);
    EXPECT_EQ(a.ranks[r].replica, b.ranks[r].replica);
    ASSERT_EQ(a.ranks[r].ops.size(), b.ranks[r].ops.size()) << "rank " << r;
    for (std::size_t i = 0; i < a.ranks[r].ops.size(); ++i)
      ASSERT_TRUE(same_op(a.ranks[r].ops[i], b.ranks[r].ops[i])) << "rank " << r << " op " << i;
  }
  ASSERT_EQ(a.collectives.size(), b.collectives.size());
  for (std::size_t c = 0; c < a.collectives.size(); ++c) {
    EXPECT_EQ(a.collectives[c].kind, b.collectives[c].kind);
    EXPECT_EQ(a.collectives[c].purpose, b.collectives[c].purpose);
    EXPECT_EQ(a.collectives[c].bytes, b.collectives[c].bytes);
    EXPECT_EQ(a.collectives[c].members, b.collectives[c].members);
  }
}



// One Predictor, reused across differently shaped random plans (fixed seed), gives what a
// fresh predict() gives: schedule, timeline, memory and result, bit for bit. Placements
// include replicas whose pipeline boundaries fall on different nodes (dp = 3 on 2- and
// 4-GPU nodes), where only the full simulation is exact.
// cluster.collective_sms (sim/core_contention.h): while a collective of its rank runs, a compute
// op progresses at its speed on the SMs the collective leaves. A data-parallel H100 plan whose
// gradient reductions hide under the backward (the step bound by compute): with no SMs held it is the plain prediction; with some,
// every compute op's work adds up (its time beside its rank's collectives at the speed on the
// SMs left, the rest at full speed), the step is longer, and the sweep's path gives the same step.
ScenarioConfig overlapped_h100_plan() {
  ScenarioConfig c = testing::small_config(1, 4, ScheduleKind::one_f_one_b, 1, 4);
  c.model.num_layers = 8;
  c.model.hidden_size = 2048;
  c.model.num_attention_heads = 16;
  c.model.seq_length = 2048;
  c.model.vocab_size = 32000;
  c.cluster.gpu = "h100-80gb";
  apply_gpu_preset(*find_gpu_preset("h100-80gb"), c.cluster);
  c.cluster.num_gpus = 4;
  c.cluster.gpus_per_node = 4;  // on NVLink: the reductions hide under the backward
  c.precision.compute = DType::bf16;
  c.communication.overlap_grad_reduce = true;
  c.communication.bucket_size_mib = 25;
  return c;
}

TEST(CollectiveSms, ComputeBesideItsRanksCollectivesRunsOnTheSmsLeft) {
  ScenarioConfig c = overlapped_h100_plan();
  const Prediction plain = predict(Plan::from_config(c));
  c.cluster.collective_sms = 0;
  EXPECT_EQ(predict(Plan::from_config(c)).result.step_time_s, plain.result.step_time_s);

  c.cluster.collective_sms = 24;
  const Plan plan = Plan::from_config(c);
  const Prediction held = predict(plan);
  EXPECT_GT(held.result.step_time_s, plain.result.step_time_s);
  // The GPU as compute sees it beside a collective: 24 SMs fewer, its peaks scaled alike.
  ScenarioConfig rest = c;
  const double left = (rest.cluster.sm_count - 24.0) / rest.cluster.sm_count;
  for (DType d : kAllDTypes) rest.cluster.peak_tflops[d] = rest.cluster.peak_tflops.at(d) * left;
  rest.cluster.int32_tops *= left;
  rest.cluster.sm_count -= 24;
  rest.cluster.collective_sms = 0;
  const RooflineComputeModel full(plan), on_the_rest(Plan::from_config(rest));
  int overlapped = 0;
  for (std::size_t r = 0; r < held.timeline.ops.size(); ++r) {
    const auto& ops = held.schedule->ranks[r].ops;
    std::vector<OpTiming> collectives;
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (is_collective(ops[i].kind) && ops[i].channel >= 0) collectives.push_back(held.timeline.ops[r][i]);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (!is_compute(ops[i].kind)) continue;
      const OpTiming& t = held.timeline.ops[r][i];
      double beside = 0;  // collectives of one rank run one at a time: their intervals do not overlap
      for (const OpTiming& k : collectives)
        beside += std::max<double>(0, static_cast<double>(std::min(t.end, k.end) - std::max(t.start, k.start)));
      const double alone = static_cast<double>(full.duration(ops[i], static_cast<int>(r)));
      const double slow = static_cast<double>(on_the_rest.duration(ops[i], static_cast<int>(r)));
      ASSERT_GE(slow, alone) << op_label(ops[i]);  // equal for memory-bound work (the optimizer)
      const double work = (static_cast<double>(t.end - t.start) - beside) + beside * alone / slow;
      EXPECT_NEAR(work, alone, 1e-4 * alone + 2) << "rank " << r << " " << op_label(ops[i]);
      overlapped += beside > 0;
    }
  }
  EXPECT_GT(overlapped, 4);  // the backward's reductions overlap it
  // The sweep's path (a Predictor, every rank simulated) gives the same step.
  Predictor predictor;
  for (int k = 0; k < 2; ++k)  // the second call finds the schedule cached
    EXPECT_EQ(predictor.evaluate(plan).step_time_s, held.result.step_time_s);
}

TEST(CollectiveSms, RefusesToHoldEverySm) {
  ScenarioConfig c = overlapped_h100_plan();
  c.cluster.collective_sms = c.cluster.sm_count;
  EXPECT_THROW(Plan::from_config(c), ScenarioError);
}

TEST(Predictor, ReusedAcrossRandomPlansMatchesPredict) {
  std::mt19937 rng(20261121);
  auto pick = [&](std::initializer_list<int> xs) {
    std::uniform_int_distribution<std::size_t> u(0, xs.size() - 1);
    return *(xs.begin() + u(rng));
  };
  Predictor predictor;
  int compared = 0, replicated = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const auto kind = static_cast<ScheduleKind>(pick({0, 1, 2, 3}));
    const int p = pick({1, 2, 4, 8}), d = pick({1, 2, 3, 4}), t = pick({1, 2});
    const int v = kind == ScheduleKind::interleaved_1f1b ? pick({2, 3}) : 1;
    if (kind == ScheduleKind::interleaved_1f1b && p < 2) continue;
    const int m = kind == ScheduleKind::interleaved_1f1b ? p * pick({1, 2, 3}) : pick({1, 3, 8, 16});
    ScenarioConfig c = testing::small_config(p, m, kind, v, d);
    c.cluster.num_gpus = p * d * t;
    c.cluster.gpus_per_node = pick({1, 2, 4, 8});
    if (c.cluster.num_gpus > c.cluster.gpus_per_node && c.cluster.num_gpus % c.cluster.gpus_per_node) continue;
    testing::draw_settings(c, p, d, t, m, [&](std::initializer_list<int> xs) { return pick(xs); }, true);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": " << schedule_name(kind) << " p=" << p << " d=" << d
                                      << " t=" << t << " v=" << v << " m=" << m
                                      << " gpus_per_node=" << c.cluster.gpus_per_node);
    const Plan plan = Plan::from_config(c);
    const Prediction expected = predict(plan);
    const Prediction& got = predictor.predict(plan);
    expect_same_schedule(*got.schedule, *expected.schedule);
    ASSERT_TRUE(same_timeline(got.timeline, expected.timeline));
    EXPECT_EQ(got.timeline.schedule, got.schedule);
    ASSERT_EQ(got.memory.size(), expected.memory.size());
    for (std::size_t r = 0; r < got.memory.size(); ++r) expect_same_memory(got.memory[r], expected.memory[r]);
    expect_same_result(got.result, expected.result);
    ++compared;
    replicated += d > 1;
  }
  EXPECT_GT(compared, 250);
  EXPECT_GT(replicated, 150);
}

// Predictor::evaluate, the sweep's result-only path, gives predict().result exactly (every
// field, every rank, the warnings) on the same 400 random plans as above, with one
// Predictor reused across all of them and switching between evaluate() and predict() now
// and then (evaluate leaves replicas 1.. without programs or timings; predict must not see
// them stale). Covers replica-symmetric plans (only replica 0 built), asymmetric
// placements (dp = 3 on 2- and 4-GPU nodes: full path) and plans that do not fit.
TEST(Predictor, EvaluateMatchesPredictResultOnRandomPlans) {
  std::mt19937 rng(20261121);
  auto pick = [&](std::initializer_list<int> xs) {
    std::uniform_int_distribution<std::size_t> u(0, xs.size() - 1);
    return *(xs.begin() + u(rng));
  };
  Predictor predictor;
  int compared = 0, replicated = 0, asymmetric = 0, not_fitting = 0, mixed = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const auto kind = static_cast<ScheduleKind>(pick({0, 1, 2, 3}));
    const int p = pick({1, 2, 4, 8}), d = pick({1, 2, 3, 4}), t = pick({1, 2});
    const int v = kind == ScheduleKind::interleaved_1f1b ? pick({2, 3}) : 1;
    if (kind == ScheduleKind::interleaved_1f1b && p < 2) continue;
    const int m = kind == ScheduleKind::interleaved_1f1b ? p * pick({1, 2, 3}) : pick({1, 3, 8, 16});
    ScenarioConfig c = testing::small_config(p, m, kind, v, d);
    c.cluster.num_gpus = p * d * t;
    c.cluster.gpus_per_node = pick({1, 2, 4, 8});
    if (c.cluster.num_gpus > c.cluster.gpus_per_node && c.cluster.num_gpus % c.cluster.gpus_per_node) continue;
    testing::draw_settings(c, p, d, t, m, [&](std::initializer_list<int> xs) { return pick(xs); }, true);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": " << schedule_name(kind) << " p=" << p << " d=" << d
                                      << " t=" << t << " v=" << v << " m=" << m
                                      << " gpus_per_node=" << c.cluster.gpus_per_node);
    const Plan plan = Plan::from_config(c);
    const Prediction expected = predict(plan);
    if (trial % 7 == 3) {  // a full prediction in between: evaluate must not leave it stale
      const Prediction& full = predictor.predict(plan);
      ASSERT_TRUE(same_timeline(full.timeline, expected.timeline));
      expect_same_result(full.result, expected.result);
      ++mixed;
    }
    const Result& got = predictor.evaluate(plan);
    expect_same_result(got, expected.result);
    ++compared;
    replicated += d > 1;
    asymmetric += d == 3 && c.cluster.gpus_per_node > 1 && c.cluster.gpus_per_node < p * d * t;
    not_fitting += !expected.result.fits_in_memory;
  }
  EXPECT_GT(compared, 250);
  EXPECT_GT(replicated, 150);
  EXPECT_GT(asymmetric, 10);
  EXPECT_GT(not_fitting, 50);
  EXPECT_GT(mixed, 20);
}

// A prediction kept past the next call stays as it was: the Predictor then builds into
// fresh storage instead of the schedule someone still holds.
TEST(Predictor, KeptScheduleIsNotOverwritten) {
  Predictor predictor;
  const Plan a = Plan::from_config(testing::small_config(4, 8, ScheduleKind::one_f_one_b, 1, 2));
  const Plan b = Plan::from_config(testing::small_config(2, 3, ScheduleKind::gpipe, 1, 1));
  const std::shared_ptr<const Schedule> kept = predictor.predict(a).schedule;
  const std::size_t ops = kept->total_ops();
  predictor.predict(b);
  EXPECT_EQ(kept->total_ops(), ops);
  expect_same_schedule(*kept, build_schedule(a));
}

// Replica symmetry in the engine: simulating replica 0 alone and copying gives the full
// run's timeline when every replica is placed alike (2 stages x 4 replicas on one node).
TEST(Engine, ReplicaSymmetricRunEqualsFullRun) {
  ScenarioConfig c = testing::small_config(2, 8, ScheduleKind::one_f_one_b, 1, 4);
  c.communication.overlap_grad_reduce = true;
  c.communication.bucket_size_mib = 0.01;
  c.precision.loss_scaling.mode = LossScalingMode::dynamic;
  const Plan plan = Plan::from_config(c);
  auto sched = std::make_shared<const Schedule>(build_schedule(plan));
  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  Simulation sim;
  Timeline full, symmetric;
  sim.run(sched, compute, p2p, collective, full, false);
  EXPECT_FALSE(sim.last_run_symmetric());
  sim.run(sched, compute, p2p, collective, symmetric, true);
  EXPECT_TRUE(sim.last_run_symmetric());
  EXPECT_TRUE(same_timeline(full, symmetric));
  EXPECT_TRUE(same_timeline(full, simulate_schedule(sched, CostModels{&compute, &p2p, &collective})));
}

}  // namespace
}  // namespace trainsim
