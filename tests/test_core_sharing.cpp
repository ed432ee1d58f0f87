// Ranks that share cores by turns (validation/core_sharing.h): closed forms of the replay on small
// hand-made schedules, and the replay of a real plan with a core per rank against the simulator.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <stdexcept>
#include <utility>

#include "core/schedule.h"
#include "sim/simulator.h"
#include "tests/test_helpers.h"
#include "validation/core_sharing.h"

namespace trainsim::validation {
namespace {

using runtime::CoreTurn;

constexpr Tick kUs = 1'000'000;  // picoseconds

// Ranks each running `ops` (kinds) with the given durations, no messages, no collectives.
Timeline alone(const std::vector<std::vector<std::pair<OpKind, Tick>>>& programs) {
  auto s = std::make_shared<Schedule>();
  Timeline t;
  for (std::size_t r = 0; r < programs.size(); ++r) {
    RankProgram p;
    p.rank = p.stage = static_cast<int>(r);
    Tick at = 0;
    t.ops.emplace_back();
    for (const auto& [kind, d] : programs[r]) {
      Op op;
      op.kind = kind;
      op.chunk = 0;
      p.ops.push_back(op);
      t.ops.back().push_back({at, at + d});
      at += d;
    }
    s->ranks.push_back(p);
  }
  t.schedule = s;
  return t;
}

// Makes message `channel` go from `send` ({rank, op}) to `recv` in t's schedule.
void connect(Timeline& t, int channel, std::pair<int, int> send, std::pair<int, int> recv) {
  auto s = std::make_shared<Schedule>(*t.schedule);
  s->num_messages = std::max(s->num_messages, channel + 1);
  Op& from = s->ranks[static_cast<std::size_t>(send.first)].ops[static_cast<std::size_t>(send.second)];
  Op& to = s->ranks[static_cast<std::size_t>(recv.first)].ops[static_cast<std::size_t>(recv.second)];
  from.channel = to.channel = channel;
  from.peer = recv.first;
  to.peer = send.first;
  t.schedule = s;
}

TEST(CoreSharing, FirstComeFirstServedOnOneCore) {
  const Timeline t = alone({{{OpKind::Forward, 10 * kUs}}, {{OpKind::Forward, 10 * kUs}}});
  CoreSharing sh;
  sh.cores = 1;
  const SharedStep s = share_cores(t, sh);
  // Both ranks reach their op at 0; rank 0 takes the core, rank 1 waits for it inside its op.
  EXPECT_EQ(s.timeline.ops[0][0].start, 0);
  EXPECT_EQ(s.timeline.ops[0][0].end, 10 * kUs);
  EXPECT_EQ(s.timeline.ops[1][0].start, 0);
  EXPECT_EQ(s.timeline.ops[1][0].end, 20 * kUs);
  EXPECT_EQ(s.turns, (std::vector<CoreTurn>{{0, 0, 0}, {1, 0, 0}}));
  // Rank 1's wait for its turn is reported as the engine reports it (OpTiming::waited).
  EXPECT_EQ(s.timeline.ops[0][0].waited, 0);
  EXPECT_EQ(s.timeline.ops[1][0].waited, 10 * kUs);
  // As many cores as ranks: nobody waits.
  sh.cores = 2;
  EXPECT_EQ(share_cores(t, sh).timeline.ops[1][0].end, 10 * kUs);
}

TEST(CoreSharing, ATurnsThreadsBeyondTheHostsCoresShareThem) {
  // One schedule rank whose turn runs on 4 threads (its shards) on a host of 2 cores: the operating
  // system time-shares them, so its ops take twice their time alone; the part of an op its
  // in-op collectives took (priced from tables measured with those threads sharing the cores
  // already) keeps its time.
  const Timeline t = alone({{{OpKind::Forward, 10 * kUs}, {OpKind::Backward, 10 * kUs}}});
  CoreSharing sh;
  sh.cores = 1;
  sh.threads_per_turn = 4;
  EXPECT_EQ(share_cores(t, sh).timeline.ops[0][1].end, 20 * kUs);  // host_cores unset: a core per thread
  sh.host_cores = 2;
  const SharedStep s = share_cores(t, sh);
  EXPECT_EQ(s.timeline.ops[0][0].end, 20 * kUs);
  EXPECT_EQ(s.timeline.ops[0][1].end, 40 * kUs);
  sh.unslowed = {{0.3, 0.0}};
  const SharedStep u = share_cores(t, sh);
  EXPECT_EQ(u.timeline.ops[0][0].end, 17 * kUs);  // 7 ms of kernels at half speed, 3 ms of collectives
  EXPECT_EQ(u.timeline.ops[0][1].end, 37 * kUs);
  // Enough cores for every thread: nothing changes.
  sh.host_cores = 4;
  EXPECT_EQ(share_cores(t, sh).timeline.ops[0][1].end, 20 * kUs);
}

TEST(CoreSharing, ATurnThatSleptWaitsForItsThreadToWake) {
  // One core, rank 0 two ops, rank 1 one. Rank 0 takes the core at 0 (its turn, the core free: no
  // wake-up), rank 1 slept until 10 us and runs 2 us later; rank 0's second op, asked for at 10 us
  // while rank 1 held the core, waits again and is woken at 22 us.
  const Timeline t = alone({{{OpKind::Forward, 10 * kUs}, {OpKind::Forward, 5 * kUs}}, {{OpKind::Forward, 10 * kUs}}});
  CoreSharing sh;
  sh.cores = 1;
  sh.handoff = 2 * kUs;
  const SharedStep s = share_cores(t, sh);
  EXPECT_EQ(s.timeline.ops[0][0].end, 10 * kUs);
  EXPECT_EQ(s.timeline.ops[1][0].end, 22 * kUs);
  EXPECT_EQ(s.timeline.ops[0][1].start, 10 * kUs);
  EXPECT_EQ(s.timeline.ops[0][1].end, 29 * kUs);
  // With a core each nobody sleeps, and nothing changes.
  sh.cores = 2;
  EXPECT_EQ(share_cores(t, sh).timeline.ops[0][1].end, 15 * kUs);
}

TEST(CoreSharing, FollowsTheOrderItIsGiven) {
  const Timeline t = alone({{{OpKind::Forward, 10 * kUs}, {OpKind::Forward, 5 * kUs}},
                            {{OpKind::Forward, 10 * kUs}}});
  CoreSharing sh;
  sh.cores = 1;
  sh.turns = {{1, 0, 0}, {0, 0, 0}, {0, 1, 0}};
  const SharedStep s = share_cores(t, sh);
  EXPECT_EQ(s.timeline.ops[1][0].end, 10 * kUs);
  EXPECT_EQ(s.timeline.ops[0][0].end, 20 * kUs);
  EXPECT_EQ(s.timeline.ops[0][1].start, 20 * kUs);
  EXPECT_EQ(s.timeline.ops[0][1].end, 25 * kUs);
  EXPECT_EQ(s.turns, sh.turns);
}

TEST(CoreSharing, OptimizerStepsMeetAtTheGradientNorm) {
  // Rank 0 reaches its optimizer step at 10 us, rank 1 at 30 us; half of each step comes before
  // the norm's all-reduce (2 us once both are there), half after; a core each.
  const Timeline t = alone({{{OpKind::Forward, 10 * kUs}, {OpKind::OptimizerStep, 10 * kUs}},
                            {{OpKind::Forward, 30 * kUs}, {OpKind::OptimizerStep, 10 * kUs}}});
  CoreSharing sh;
  sh.cores = 2;
  sh.optimizer_first_part = 0.5;
  sh.norm_allreduce = 2 * kUs;
  SharedStep s = share_cores(t, sh);
  EXPECT_EQ(s.timeline.ops[0][1].start, 10 * kUs);
  EXPECT_EQ(s.timeline.ops[0][1].end, 35 * kUs + 2 * kUs + 5 * kUs);
  EXPECT_EQ(s.timeline.ops[1][1].end, 35 * kUs + 2 * kUs + 5 * kUs);
  EXPECT_EQ(s.turns.size(), 6u);  // two forwards, two parts of each optimizer step
  // A rank that skipped its update ends with the norm.
  sh.skipped_update = {1, 0};
  s = share_cores(t, sh);
  EXPECT_EQ(s.timeline.ops[0][1].end, 37 * kUs);
  EXPECT_EQ(s.timeline.ops[1][1].end, 42 * kUs);
}

TEST(CoreSharing, ASendKeepsTheCoreOfTheOpBeforeIt) {
  // One core. Rank 0 runs a forward (10 us) and sends its output (2 us) to rank 1, which runs a
  // forward of its own and then receives. Rank 0's turn comes first and keeps the core through
  // its send, so rank 1's forward runs from 12 us, not from 10.
  Timeline t = alone({{{OpKind::Forward, 10 * kUs}, {OpKind::SendActivation, 2 * kUs}},
                      {{OpKind::Forward, 10 * kUs}, {OpKind::RecvActivation, 0}}});
  connect(t, 0, {0, 1}, {1, 1});
  CoreSharing sh;
  sh.cores = 1;
  const SharedStep out = share_cores(t, sh);
  EXPECT_EQ(out.timeline.ops[0][1].start, 10 * kUs);
  EXPECT_EQ(out.timeline.ops[0][1].end, 12 * kUs);
  EXPECT_EQ(out.timeline.ops[1][0].end, 22 * kUs);
  EXPECT_EQ(out.timeline.ops[1][1].end, 22 * kUs);  // the message was there at 12 us
  EXPECT_EQ(out.timeline.ops[1][0].waited, 12 * kUs);
}

// Two cores. Rank 0 runs a forward (10 us) and sends its output (2 us) to rank 1, whose first op is
// the receive, then a forward (5 us): rank 1 sleeps on the message from 0 us. Rank 2 runs a forward
// of 20 us, then receives a second message rank 0 sends right after the first. Rank 0's turn keeps
// its core through both sends, rank 2's the other, so rank 1's forward waits for rank 0's sends.
// Without receiver_copies the sends take 10-12 and 12-14 us and rank 1's forward 14-19 us. With
// them, rank 1, woken at 12 us, copies its message out (2 us, as long as the send) on a core it
// takes first, as a woken thread does: 12-14 us, while the two turns share the other core at half
// speed. Rank 0's second send ends at 15 us (1 us of its 2 done by 14), rank 1's forward runs
// 15-20 us, and rank 2's forward ends at 21 us, where it finds its message there (copied in its
// own time, not priced).
TEST(CoreSharing, AReceiverAsleepOnItsMessageCopiesItOnACoreItTakesFirst) {
  Timeline t = alone({{{OpKind::Forward, 10 * kUs}, {OpKind::SendActivation, 2 * kUs}, {OpKind::SendActivation, 2 * kUs}},
                      {{OpKind::RecvActivation, 0}, {OpKind::Forward, 5 * kUs}},
                      {{OpKind::Forward, 20 * kUs}, {OpKind::RecvActivation, 0}}});
  connect(t, 0, {0, 1}, {1, 0});
  connect(t, 1, {0, 2}, {2, 1});
  CoreSharing sh;
  sh.cores = 2;
  const SharedStep plain = share_cores(t, sh);
  EXPECT_EQ(plain.timeline.ops[0][1].end, 12 * kUs);
  EXPECT_EQ(plain.timeline.ops[1][0].end, 12 * kUs);
  EXPECT_EQ(plain.timeline.ops[0][2].end, 14 * kUs);
  EXPECT_EQ(plain.timeline.ops[1][1].end, 19 * kUs);
  EXPECT_EQ(plain.timeline.ops[2][1].end, 20 * kUs);
  sh.receiver_copies = true;
  const SharedStep copied = share_cores(t, sh);
  EXPECT_EQ(copied.timeline.ops[0][1].end, 12 * kUs);
  EXPECT_EQ(copied.timeline.ops[1][0].end, 14 * kUs);
  EXPECT_EQ(copied.timeline.ops[0][2].end, 15 * kUs);
  EXPECT_EQ(copied.timeline.ops[1][1].start, 14 * kUs);
  EXPECT_EQ(copied.timeline.ops[1][1].end, 20 * kUs);
  EXPECT_EQ(copied.timeline.ops[1][1].waited, 1 * kUs);
  EXPECT_EQ(copied.timeline.ops[2][0].end, 21 * kUs);
  EXPECT_EQ(copied.timeline.ops[2][1].end, 21 * kUs);
}

TEST(CoreSharing, CollectivesThatTakeCoresRunFirstAndTheTurnsShareWhatIsLeft) {
  // Both ranks all-reduce (4 us alone) on their communication threads from 0 while their
  // forwards (10 us) want the cores. Each all-reduce's thread was busy min(1, cores / members) of
  // its benchmark's time.
  auto two_ranks = [](int groups) {
    std::vector<std::vector<std::pair<OpKind, Tick>>> programs(
        static_cast<std::size_t>(2 * groups), {{OpKind::AllReduce, 4 * kUs}, {OpKind::Forward, 10 * kUs}});
    Timeline t = alone(programs);
    for (auto& ops : t.ops) ops[1] = {0, 10 * kUs};  // the forward does not wait for the collective
    auto s = std::make_shared<Schedule>(*t.schedule);
    for (int g = 0; g < groups; ++g) {
      s->collectives.push_back(Collective{.kind = OpKind::AllReduce, .bytes = 1024, .members = {2 * g, 2 * g + 1}});
      s->ranks[2 * g].ops[0].channel = s->ranks[2 * g + 1].ops[0].channel = g;
    }
    t.schedule = s;
    return t;
  };
  const Timeline t = two_ranks(1);
  CoreSharing sh;
  sh.cores = 1;
  // Beside the turns at their own speed: the all-reduce ends at 4 us, the forwards at 10 and 20.
  SharedStep out = share_cores(t, sh);
  EXPECT_EQ(out.timeline.ops[0][0].end, 4 * kUs);
  EXPECT_EQ(out.timeline.ops[0][1].end, 10 * kUs);
  EXPECT_EQ(out.timeline.ops[1][1].end, 20 * kUs);
  // Taking cores: the two members' threads, each half a core's (two threads on one core in the
  // benchmark), take the core until they are done; rank 0's forward then runs its 10 us.
  sh.collectives_take_cores = true;
  out = share_cores(t, sh);
  EXPECT_EQ(out.timeline.ops[0][0].end, 4 * kUs);
  EXPECT_EQ(out.timeline.ops[1][0].end, 4 * kUs);
  EXPECT_EQ(out.timeline.ops[0][1].end, 14 * kUs);
  EXPECT_EQ(out.timeline.ops[1][1].end, 24 * kUs);
  // Two cores: each member a core's worth; both forwards wait for them.
  sh.cores = 2;
  out = share_cores(t, sh);
  EXPECT_EQ(out.timeline.ops[0][0].end, 4 * kUs);
  EXPECT_EQ(out.timeline.ops[0][1].end, 14 * kUs);
  EXPECT_EQ(out.timeline.ops[1][1].end, 14 * kUs);
  // Turns of two threads each (tensor parallelism 2: each shard's group all-reduces), one turn at
  // a time on a host of two cores: four communication threads, each a core's worth in its
  // two-member benchmark on two cores, on two cores: half speed.
  sh.cores = 1;
  sh.threads_per_turn = 2;
  out = share_cores(t, sh);
  EXPECT_EQ(out.timeline.ops[0][0].end, 8 * kUs);
  EXPECT_EQ(out.timeline.ops[0][1].end, 18 * kUs);
  // Two groups on one core: four members' shares of half a core each, twice what there is; the
  // collectives run at half speed (8 us) and the turns wait for them.
  sh.threads_per_turn = 1;
  out = share_cores(two_ranks(2), sh);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(out.timeline.ops[static_cast<std::size_t>(r)][0].end, 8 * kUs) << r;
  EXPECT_EQ(out.timeline.ops[0][1].end, 18 * kUs);
  // Context-parallel ranks of four shards each on a host of two cores: the gradients' all-reduce
  // was priced from its table for all 8 shards, whose threads were each busy 2/8 of its time: its
  // work is a quarter of it (1 us), each member's job a quarter of a turn's cores. The turn of 4
  // threads on 2 cores runs its forward at half speed on what the collectives leave: 0.25 of its
  // speed for 1 us, then 0.5: rank 0's forward ends at 1 + 9.75 / 0.5 = 20.5 us, rank 1's 20 us
  // after.
  sh.cores = 1;
  sh.threads_per_turn = 4;
  sh.host_cores = 2;
  sh.rings.assign(1, CoreSharing::Ring{});
  sh.rings[0].threads = 8;
  out = share_cores(t, sh);
  EXPECT_EQ(out.timeline.ops[0][0].end, 1 * kUs);
  EXPECT_EQ(out.timeline.ops[1][0].end, 1 * kUs);
  EXPECT_EQ(out.timeline.ops[0][1].end, 20'500'000);
  EXPECT_EQ(out.timeline.ops[1][1].end, 40'500'000);
}

// Two data-parallel ranks under ZeRO-3 on one core: each gathers its forward's three units (the
// first, then the rest: two more, each a collective of both ranks, instantaneous here) and runs a
// 30 us forward, 10 us a unit (the units' parameters alike). A rank holds two units at most, so its
// third unit's gather waits for its pass to be done with the first; rank 1, whose turn comes
// second, gets there at 30 us, and rank 0 waits for it in the middle of its forward with its core
// given back.
Timeline zero3_two_ranks(int rest_units = 2) {
  const Tick forward = (1 + rest_units) * 10 * kUs;
  Timeline t = alone({{{OpKind::AllGather, 0}, {OpKind::AllGather, 0}, {OpKind::Forward, forward}},
                      {{OpKind::AllGather, 0}, {OpKind::AllGather, 0}, {OpKind::Forward, forward}}});
  auto s = std::make_shared<Schedule>(*t.schedule);
  s->collectives.push_back(Collective{.kind = OpKind::AllGather, .bytes = 100, .members = {0, 1}, .parts = 1});
  s->collectives.push_back(
      Collective{.kind = OpKind::AllGather, .bytes = 100L * rest_units, .members = {0, 1}, .parts = rest_units});
  for (auto& r : s->ranks) {
    for (int k = 0; k < 2; ++k) {
      r.ops[static_cast<std::size_t>(k)].channel = k;
      r.ops[static_cast<std::size_t>(k)].bucket = k;
      r.ops[static_cast<std::size_t>(k)].microbatch = 0;
    }
    r.ops[2].microbatch = 0;
    r.ops[2].dep = 0;  // the forward waits for its first unit
  }
  t.schedule = s;
  return t;
}

TEST(CoreSharing, ZeroThreePassesMoveUnitByUnitWithTheirPeers) {
  CoreSharing sh;
  sh.cores = 1;
  const SharedStep out = share_cores(zero3_two_ranks(), sh);
  const auto& r0 = out.timeline.ops[0];
  const auto& r1 = out.timeline.ops[1];
  // Rank 0: units 1 and 2 (0-20 us), paused from 20 us for its third unit, gathered at 30 us when
  // rank 1 is done with its first; rank 1 holds the core to its forward's end (50 us): 50-60 us.
  EXPECT_EQ(r0[2].start, 0);
  EXPECT_EQ(r0[2].end, 60 * kUs);
  EXPECT_EQ(r0[2].waited, 10 * kUs);  // the unit's wait (20-30 us); its turn came at once
  EXPECT_EQ(r1[2].end, 50 * kUs);
  EXPECT_EQ(r1[2].waited, 20 * kUs);  // its turn
  // The rest's gathers: the third unit's moved once rank 1 had room for it (30 us); rank 0's wait
  // for it is the pass's pace, as the run counts it, not communication.
  EXPECT_EQ(r0[1].end, 30 * kUs);
  EXPECT_EQ(r0[1].waited, 30 * kUs);
  EXPECT_EQ(r1[1].waited, 30 * kUs);
  // Holding three units, the pass would not wait: each forward whole in its turn.
  sh.zero3_units_held = 3;
  const SharedStep free = share_cores(zero3_two_ranks(), sh);
  EXPECT_EQ(free.timeline.ops[0][2].end, 30 * kUs);
  EXPECT_EQ(free.timeline.ops[1][2].end, 60 * kUs);
  // The first unit kept to the forward's end (tied embeddings): one unit of room for the rest,
  // so the third unit waits for rank 1 to be done with its second (40 us), and both passes wait
  // for it there; rank 0, paused first, resumes first.
  sh.zero3_units_held = 2;
  sh.zero3_forward_keeps_first_unit = true;
  const SharedStep kept = share_cores(zero3_two_ranks(), sh);
  EXPECT_EQ(kept.timeline.ops[0][1].end, 40 * kUs);
  EXPECT_EQ(kept.timeline.ops[0][2].end, 50 * kUs);
  EXPECT_EQ(kept.timeline.ops[0][2].waited, 20 * kUs);
  EXPECT_EQ(kept.timeline.ops[1][2].end, 60 * kUs);
  EXPECT_EQ(kept.timeline.ops[1][2].waited, 20 * kUs);
  // A thread that slept on its unit wakes before it runs, a free core or not (1 us here): rank
  // 1's turn starts at 21 us, both units are there at 41 us on a free core, rank 0 runs from
  // 42 us, rank 1 (asleep again, its core taken) from 53 us.
  sh.handoff = kUs;
  const SharedStep woken = share_cores(zero3_two_ranks(), sh);
  EXPECT_EQ(woken.timeline.ops[0][2].end, 52 * kUs);
  EXPECT_EQ(woken.timeline.ops[1][2].end, 63 * kUs);
}

TEST(CoreSharing, RanksThatAUnitWakesTogetherTakeTheCoreInTurns) {
  // One unit held at a time: each of four units is a barrier of both ranks on one core. Where both
  // wait for the same unit, the one served first alternates (rank 1 for the second unit, rank 0 for
  // the third, rank 1 for the fourth), as the operating system's wake-ups favour neither.
  CoreSharing sh;
  sh.cores = 1;
  sh.zero3_units_held = 1;
  const SharedStep out = share_cores(zero3_two_ranks(3), sh);
  EXPECT_EQ(out.timeline.ops[0][2].end, 80 * kUs);
  EXPECT_EQ(out.timeline.ops[1][2].end, 70 * kUs);
}

// ZeRO-3 plans of every shape the runtime runs (DeepSpeed and FSDP, recompute or not, tied or
// untied embeddings, data parallelism with or without tensor parallelism, one to four micro-batches)
// on one to four cores, their collectives whole or as rings of steps: every op ends, the order found
// replays to the same step, and no pass is done sooner than it runs alone.
TEST(CoreSharing, ZeroThreePlansFinishWhicheverTheCores) {
  std::mt19937 rng(20261128);
  auto pick = [&](std::initializer_list<int> xs) {
    return *(xs.begin() + std::uniform_int_distribution<int>(0, static_cast<int>(xs.size()) - 1)(rng));
  };
  for (int trial = 0; trial < 40; ++trial) {
    // FSDP also under a pipeline (torchtitan), one or two chunks a stage.
    const bool fsdp = pick({0, 1});
    const int pp = fsdp ? pick({1, 2}) : 1, v = pp > 1 ? pick({1, 2}) : 1;
    const int d = pick({2, 3, 4, 8}) / pp, t = d * pp <= 4 ? pick({1, 2}) : 1, m = pick({1, 2, 4}) * pp;
    ScenarioConfig c = testing::small_config(pp, m, v > 1 ? ScheduleKind::interleaved_1f1b : ScheduleKind::one_f_one_b,
                                             v, d);
    c.parallelism.tensor_parallel_size = t;
    c.cluster.num_gpus = pp * d * t;
    c.parallelism.zero_stage = 3;
    c.parallelism.framework = fsdp ? Framework::fsdp : Framework::deepspeed;
    c.training.activation_recompute = static_cast<Recompute>(pick({0, 1, 2}));
    c.model.untie_embeddings_and_output_weights = pick({0, 1});
    c.communication.overlap_grad_reduce = pick({0, 1});
    const Plan plan = Plan::from_config(c);
    const Prediction p = predict(plan);
    int unit_gathers = 0;  // the rest of a pass's units, in more than one part somewhere
    for (const Collective& k : p.schedule->collectives) unit_gathers += k.kind == OpKind::AllGather && k.parts > 1;
    if (pp == 1) {
      ASSERT_GT(unit_gathers, 0) << "trial " << trial;
    }
    for (int cores : {4, 2, 1}) {
      CoreSharing sh;
      sh.cores = cores;
      sh.threads_per_turn = t;
      sh.collectives_take_cores = pick({0, 1});
      sh.zero3_forward_keeps_first_unit = !c.model.untie_embeddings_and_output_weights;
      // Rings of steps (with copies around them) for the collectives that are not unit gathers.
      const bool rings = pick({0, 1});
      if (rings)
        for (std::size_t k = 0; k < p.schedule->collectives.size(); ++k)
          sh.rings.push_back(CoreSharing::Ring{.ring = true, .before = pick({0, 1}) * 1e-6, .after = pick({0, 1}) * 1e-6});
      const std::string what = fmt::format("trial {} pp {} v {} dp {} tp {} m {} {} cores {} rings {}", trial, pp, v, d,
                                           t, m, plan.zero_and_recompute(), cores, rings);
      SharedStep s;
      ASSERT_NO_THROW(s = share_cores(p.timeline, sh)) << what;
      sh.turns = s.turns;
      EXPECT_EQ(share_cores(p.timeline, sh).timeline.end(), s.timeline.end()) << what;
      for (std::size_t r = 0; r < p.timeline.ops.size(); ++r)
        for (std::size_t i = 0; i < p.timeline.ops[r].size(); ++i) {
          const OpTiming& a = p.timeline.ops[r][i];
          const OpTiming& b = s.timeline.ops[r][i];
          ASSERT_GE(b.end, b.start) << what;
          if (is_compute(p.timeline.schedule->ranks[r].ops[i].kind)) {
            EXPECT_GE(b.end - b.start, a.end - a.start - 2) << what << " rank " << r << " op " << i;
          }
        }
    }
  }
}

// Three ranks reduce-scatter over {0, 1, 2} (6 us alone, two ring steps) on one core, collectives
// taking cores; ranks 0 and 1 are there at 0, rank 2 after a 10 us forward.
Timeline ring_of_three(Tick last_forward) {
  Timeline t = alone({{{OpKind::ReduceScatter, 6 * kUs}},
                      {{OpKind::ReduceScatter, 6 * kUs}},
                      {{OpKind::Forward, last_forward}, {OpKind::ReduceScatter, 6 * kUs}}});
  auto s = std::make_shared<Schedule>(*t.schedule);
  s->collectives.push_back(Collective{.kind = OpKind::ReduceScatter, .bytes = 1 << 20, .members = {0, 1, 2}});
  s->ranks[0].ops[0].channel = s->ranks[1].ops[0].channel = s->ranks[2].ops[1].channel = 0;
  s->ranks[2].ops[1].dep = 0;
  t.schedule = s;
  return t;
}

TEST(CoreSharing, ARingsEarlyMembersRunTheStepsThatDoNotWaitForTheLast) {
  CoreSharing sh;
  sh.cores = 1;
  sh.collectives_take_cores = true;
  // Whole, the reduce-scatter starts once rank 2 is there (10 us) and its three members, a third
  // of a core each in their benchmark, take the core for its 6 us.
  SharedStep whole = share_cores(ring_of_three(10 * kUs), sh);
  EXPECT_EQ(whole.timeline.ops[2][0].end, 10 * kUs);
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(whole.timeline.ops[r][0].start, 10 * kUs) << r;
    EXPECT_EQ(whole.timeline.ops[r][0].end, 16 * kUs) << r;
  }
  // As a ring of steps, each a core at full speed for 1 us (6 us x 1/3 over 2 steps). Rank 1 (its
  // predecessor rank 0 sent at 0) runs its first step at once, taking the core from rank 2's
  // forward (0-1 us), which ends at 11. Then ranks 2 and 0 run their first steps side by side
  // (11-13) and all three their second (13-16): 5 us from the last arrival instead of 6.
  sh.rings = {CoreSharing::Ring{.ring = true}};
  SharedStep ring = share_cores(ring_of_three(10 * kUs), sh);
  EXPECT_EQ(ring.timeline.ops[2][0].end, 11 * kUs);
  for (std::size_t r = 0; r < 3; ++r) {
    const OpTiming& rs = ring.timeline.ops[r][r == 2 ? 1 : 0];
    EXPECT_EQ(rs.start, 11 * kUs) << r;  // as the run times it: from its last member's arrival
    EXPECT_EQ(rs.end, 16 * kUs) << r;
  }
  // Members that arrive together: the ring takes its time alone, as the whole collective does.
  for (std::size_t r = 0; r < 3; ++r)
    EXPECT_EQ(share_cores(ring_of_three(0), sh).timeline.ops[r].back().end, 6 * kUs) << r;
  // Its copies around the ring (ZeRO's pack and unpack, 1 us each, part of the 6 us) run at a core
  // each as a member arrives and after its last step. With a core each (3 cores) the ring's other
  // 4 us are two steps of 2 us: ranks 0 and 1 copy in at 0-1, rank 1 runs its first step at 1-3,
  // rank 2 copies in at 10-11, ranks 2 and 0 step at 11-13, everyone's second step at 13-15, the
  // copies out at 15-16.
  sh.cores = 3;
  sh.rings = {CoreSharing::Ring{.ring = true, .before = 1e-6, .after = 1e-6}};
  ring = share_cores(ring_of_three(10 * kUs), sh);
  EXPECT_EQ(ring.timeline.ops[2][0].end, 10 * kUs);
  for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(ring.timeline.ops[r].back().end, 16 * kUs) << r;
  for (std::size_t r = 0; r < 3; ++r)
    EXPECT_EQ(share_cores(ring_of_three(0), sh).timeline.ops[r].back().end, 6 * kUs) << r;
}

TEST(CoreSharing, RefusesAnOrderThatIsNotOneTurnPerOp) {
  const Timeline t = alone({{{OpKind::Forward, 10 * kUs}}, {{OpKind::Forward, 10 * kUs}}});
  CoreSharing sh;
  sh.turns = {{0, 0, 0}};
  EXPECT_THROW(share_cores(t, sh), std::invalid_argument);
  sh.turns = {{0, 0, 0}, {0, 0, 0}};
  EXPECT_THROW(share_cores(t, sh), std::invalid_argument);
}

TEST(CoreSharing, OneRankWithACoreIsTheSimulatorsStep) {
  const ScenarioConfig c = testing::small_config(1, 4, ScheduleKind::one_f_one_b);
  const Prediction p = predict(Plan::from_config(c));
  CoreSharing sh;
  sh.cores = 1;
  const SharedStep s = share_cores(p.timeline, sh);
  for (std::size_t i = 0; i < p.timeline.ops[0].size(); ++i) {
    EXPECT_EQ(s.timeline.ops[0][i].start, p.timeline.ops[0][i].start) << op_label(p.schedule->ranks[0].ops[i]);
    EXPECT_EQ(s.timeline.ops[0][i].end, p.timeline.ops[0][i].end) << op_label(p.schedule->ranks[0].ops[i]);
  }
}

TEST(CoreSharing, EveryRankOfAPipelineFinishesWhicheverTheCores) {
  const ScenarioConfig c = testing::small_config(4, 4, ScheduleKind::gpipe, 1, 2);
  const Plan plan = Plan::from_config(c);
  const Prediction p = predict(plan);
  for (const auto& [take, copies] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(fmt::format("collectives {} the cores, receivers' copies {}", take ? "take" : "beside",
                             copies ? "priced" : "not priced"));
    Tick previous = 0;
    for (int cores : {8, 4, 2, 1}) {
      CoreSharing sh;
      sh.cores = cores;
      sh.collectives_take_cores = take;
      sh.receiver_copies = copies;
      const SharedStep s = share_cores(p.timeline, sh);
      // Fewer cores: a longer step; and the order it found replays to the same step.
      EXPECT_GE(s.timeline.end(), previous);
      previous = s.timeline.end();
      sh.turns = s.turns;
      EXPECT_EQ(share_cores(p.timeline, sh).timeline.end(), s.timeline.end());
      // No op runs faster than it does alone (sharing only slows work down).
      for (std::size_t r = 0; r < p.timeline.ops.size(); ++r)
        for (std::size_t i = 0; i < p.timeline.ops[r].size(); ++i) {
          const OpKind kind = p.timeline.schedule->ranks[r].ops[i].kind;
          if (!is_collective(kind) && !is_send(kind)) continue;
          const OpTiming& a = p.timeline.ops[r][i];
          const OpTiming& b = s.timeline.ops[r][i];
          EXPECT_GE(b.end - b.start, a.end - a.start - 1) << "rank " << r << " op " << i;
        }
    }
  }
}

}  // namespace
}  // namespace trainsim::validation
