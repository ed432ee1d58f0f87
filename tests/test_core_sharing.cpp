// Ranks that share cores by turns (validation/core_sharing.h): closed forms of the replay on small
// hand-made schedules, and the replay of a real plan with a core per rank against the simulator.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>

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
  auto s = std::make_shared<Schedule>(*t.schedule);
  s->num_messages = 1;
  s->ranks[0].ops[1].channel = s->ranks[1].ops[1].channel = 0;
  s->ranks[0].ops[1].peer = 1;
  s->ranks[1].ops[1].peer = 0;
  t.schedule = s;
  CoreSharing sh;
  sh.cores = 1;
  const SharedStep out = share_cores(t, sh);
  EXPECT_EQ(out.timeline.ops[0][1].start, 10 * kUs);
  EXPECT_EQ(out.timeline.ops[0][1].end, 12 * kUs);
  EXPECT_EQ(out.timeline.ops[1][0].end, 22 * kUs);
  EXPECT_EQ(out.timeline.ops[1][1].end, 22 * kUs);  // the message was there at 12 us
  EXPECT_EQ(out.timeline.ops[1][0].waited, 12 * kUs);
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
  Tick previous = 0;
  for (int cores : {8, 4, 2, 1}) {
    CoreSharing sh;
    sh.cores = cores;
    const SharedStep s = share_cores(p.timeline, sh);
    // Fewer cores: a longer step; and the order it found replays to the same step.
    EXPECT_GE(s.timeline.end(), previous);
    previous = s.timeline.end();
    sh.turns = s.turns;
    EXPECT_EQ(share_cores(p.timeline, sh).timeline.end(), s.timeline.end());
  }
}

}  // namespace
}  // namespace trainsim::validation
