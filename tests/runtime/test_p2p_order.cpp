// The schedule properties the CUDA backend's communicators rely on (device_communicator.h):
//  * NCCL pairs sends with receives by order, not by tag: for every pair of ranks (A, B), the
//    messages A sends to B must come in the order B receives them from A, in every schedule;
//  * NCCL splits one communicator per all-reduce member set: reduction_groups lists each set
//    the executors reduce over exactly once, world included;
//  * and one per direction of every pipeline link: p2p_links lists each (from, to) once;
//  * the device stage model allocates its stashes before the first step, as many as in_flight
//    counts: GPipe keeps every micro-batch's, 1F1B at most pp - stage, ZB-H1's weight passes
//    keep split backwards alive past their input passes.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

#include "core/schedule.h"
#include "runtime/runtime_plan.h"
#include "runtime/engine/schedule_ops.h"
#include "tests/runtime/runtime_test_config.h"

namespace trainsim::runtime {
namespace {

ScenarioConfig config(int dp, int pp, ScheduleKind schedule, int vpp, int global_batch) {
  return testing::tiny_plan(dp, pp, schedule, vpp, global_batch, 16);
}

struct Layout {
  int dp, pp, vpp;
  ScheduleKind schedule;
  int global_batch;
};

class P2pOrder : public ::testing::TestWithParam<Layout> {};

TEST_P(P2pOrder, SendsFromAToBComeInTheOrderBReceivesThem) {
  const Layout l = GetParam();
  const RuntimePlan rp = make_runtime_plan(config(l.dp, l.pp, l.schedule, l.vpp, l.global_batch));
  const Schedule s = build_schedule(rp.plan);
  // (from, to) -> channels in program order, as sent by `from` and as received by `to`.
  std::map<std::pair<int, int>, std::vector<int>> sent, received;
  int messages = 0;
  for (int r = 0; r < static_cast<int>(s.ranks.size()); ++r)
    for (const Op& op : s.ranks[r].ops) {
      if (op.kind == OpKind::SendActivation || op.kind == OpKind::SendGradient) {
        sent[{r, op.peer}].push_back(op.channel);
        ++messages;
      }
      if (op.kind == OpKind::RecvActivation || op.kind == OpKind::RecvGradient)
        received[{op.peer, r}].push_back(op.channel);
    }
  if (l.pp > 1) {
    EXPECT_GT(messages, 0);
  }
  EXPECT_EQ(sent, received) << schedule_name(l.schedule) << " dp" << l.dp << " pp" << l.pp << " v" << l.vpp;
}

INSTANTIATE_TEST_SUITE_P(EverySchedule, P2pOrder,
                         ::testing::Values(Layout{1, 2, 1, ScheduleKind::gpipe, 8},
                                           Layout{1, 4, 1, ScheduleKind::gpipe, 8},
                                           Layout{2, 2, 1, ScheduleKind::one_f_one_b, 8},
                                           Layout{1, 4, 1, ScheduleKind::one_f_one_b, 3},
                                           Layout{1, 4, 1, ScheduleKind::one_f_one_b, 16},
                                           Layout{1, 2, 2, ScheduleKind::interleaved_1f1b, 8},
                                           Layout{1, 4, 2, ScheduleKind::interleaved_1f1b, 8},
                                           Layout{2, 4, 4, ScheduleKind::interleaved_1f1b, 16},
                                           Layout{1, 4, 1, ScheduleKind::zb_h1, 8},
                                           Layout{2, 2, 1, ScheduleKind::zb_h1, 4}));

TEST(ReductionGroups, EveryMemberSetOnceWorldLast) {
  const RuntimePlan rp = make_runtime_plan(config(2, 2, ScheduleKind::one_f_one_b, 1, 8));
  const Schedule s = build_schedule(rp.plan);
  const auto groups = reduction_groups(s, World::of(rp.plan));
  std::set<std::vector<int>> unique(groups.begin(), groups.end());
  EXPECT_EQ(unique.size(), groups.size());
  for (const Collective& c : s.collectives) EXPECT_TRUE(unique.count(c.members)) << "missing a collective's members";
  EXPECT_TRUE(unique.count(std::vector<int>{0, 1, 2, 3}));
  // dp2 x pp2, tied embeddings: a replica group per stage (ranks s*dp + d), the tied pair per
  // replica (stage 0 and stage 1 of the replica), and the world.
  EXPECT_TRUE(unique.count(std::vector<int>{0, 1}));
  EXPECT_TRUE(unique.count(std::vector<int>{2, 3}));
}

// Under tensor parallelism a schedule rank is tp ranks of the world (Megatron's order, tp
// innermost): each shard reduces its slice of the weights with the same shard of the other
// replicas, the global overflow check covers every shard, and each tensor-parallel group gets a
// communicator of its own for the collectives inside forward and backward.
TEST(ReductionGroups, ShardsReduceWithTheirOwnShardAndHaveTheirGroup) {
  ScenarioConfig c = config(2, 2, ScheduleKind::one_f_one_b, 1, 8);
  c.parallelism.tensor_parallel_size = 2;
  const RuntimePlan rp = make_runtime_plan(c);
  const Schedule s = build_schedule(rp.plan);
  const World world = World::of(rp.plan);
  ASSERT_EQ(world.size(), 8);
  const auto groups = reduction_groups(s, world);
  const std::set<std::vector<int>> unique(groups.begin(), groups.end());
  EXPECT_EQ(unique.size(), groups.size());
  // Stage 0's replicas: cells 0, 1 -> shard 0 on ranks 0, 2; shard 1 on ranks 1, 3.
  EXPECT_TRUE(unique.count({0, 2}));
  EXPECT_TRUE(unique.count({1, 3}));
  EXPECT_TRUE(unique.count({4, 6}));
  for (const std::vector<int>& tp : {std::vector<int>{0, 1}, {2, 3}, {4, 5}, {6, 7}}) EXPECT_TRUE(unique.count(tp));
  EXPECT_TRUE(unique.count(world.everyone()));
  for (const Collective& col : s.collectives)
    if (col.purpose == CollectivePurpose::overflow) {
      EXPECT_EQ(collective_members(col, world, 1), world.everyone());
    }
}

// Every collective op of every rank names its schedule entry, one whose members include the rank;
// a local overflow check (the incident's `overflow_check: local`) names none, and asking for its
// entry is refused in words rather than read at index -1 (the CUDA engine did, and crashed).
TEST(CollectiveOf, EveryCollectiveOpHasItsEntryAndALocalCheckHasNone) {
  for (const OverflowScope scope : {OverflowScope::local, OverflowScope::global}) {
    ScenarioConfig c = config(2, 2, ScheduleKind::gpipe, 1, 8);
    c.precision.compute = DType::fp16;
    c.precision.loss_scaling.mode = LossScalingMode::dynamic;
    c.precision.overflow_check = scope;
    const RuntimePlan rp = make_runtime_plan(c);
    const Schedule s = build_schedule(rp.plan);
    const World world = World::of(rp.plan);
    int checks = 0;
    for (const RankProgram& prog : s.ranks)
      for (const Op& op : prog.ops) {
        if (!is_collective(op.kind)) continue;
        if (op.kind == OpKind::OverflowCheck) ++checks;
        if (op.kind == OpKind::OverflowCheck && scope == OverflowScope::local) {
          EXPECT_LT(op.channel, 0);
          try {
            collective_of(s, op);
            ADD_FAILURE() << "a local overflow check has no collective";
          } catch (const std::logic_error& e) {
            EXPECT_NE(std::string(e.what()).find("local overflow check"), std::string::npos) << e.what();
          }
          continue;
        }
        const std::vector<int> members = collective_members(collective_of(s, op), world, 0);
        EXPECT_NE(std::find(members.begin(), members.end(), prog.rank), members.end())
            << "rank " << prog.rank << ", " << op_label(op);
      }
    EXPECT_EQ(checks, world.size()) << "one overflow check per rank";
    Op beyond{OpKind::AllReduce};
    beyond.channel = static_cast<int>(s.collectives.size());
    EXPECT_THROW(collective_of(s, beyond), std::logic_error);
  }
}

TEST(P2pLinks, ShardsTalkToTheSameShardOfTheirNeighbour) {
  ScenarioConfig c = config(1, 2, ScheduleKind::one_f_one_b, 1, 8);
  c.parallelism.tensor_parallel_size = 2;
  const RuntimePlan rp = make_runtime_plan(c);
  const std::vector<std::pair<int, int>> expected{{0, 2}, {1, 3}, {2, 0}, {3, 1}};
  EXPECT_EQ(p2p_links(build_schedule(rp.plan), World::of(rp.plan)), expected);
}

TEST(P2pLinks, BothDirectionsOfEveryPipelineNeighbourOnce) {
  // dp2 x pp4, 1F1B: replica d's stage s sends activations to s+1 and gradients to s-1.
  const RuntimePlan rp = make_runtime_plan(config(2, 4, ScheduleKind::one_f_one_b, 1, 16));
  const Schedule s = build_schedule(rp.plan);
  std::vector<std::pair<int, int>> expected;
  for (int d = 0; d < 2; ++d)
    for (int st = 0; st + 1 < 4; ++st) {
      expected.emplace_back(rp.plan.rank_of(st, d), rp.plan.rank_of(st + 1, d));
      expected.emplace_back(rp.plan.rank_of(st + 1, d), rp.plan.rank_of(st, d));
    }
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(p2p_links(s, World::of(rp.plan)), expected);
}

TEST(P2pLinks, InterleavingAddsTheWrapFromLastStageToFirst) {
  const RuntimePlan rp = make_runtime_plan(config(1, 4, ScheduleKind::interleaved_1f1b, 2, 8));
  const auto links = p2p_links(build_schedule(rp.plan), World::of(rp.plan));
  EXPECT_TRUE(std::is_sorted(links.begin(), links.end()));
  EXPECT_EQ(std::adjacent_find(links.begin(), links.end()), links.end()) << "each once";
  // Virtual stage 3 (rank 3) feeds virtual stage 4 (rank 0), and its gradient comes back.
  EXPECT_NE(std::find(links.begin(), links.end(), std::pair{3, 0}), links.end());
  EXPECT_NE(std::find(links.begin(), links.end(), std::pair{0, 3}), links.end());
  EXPECT_EQ(links.size(), 8u) << "four neighbours in a ring, both ways";
  for (const auto& [from, to] : links) EXPECT_NE(from, to);
}

TEST(InFlight, StashesFollowTheScheduleKind) {
  const Schedule gpipe = build_schedule(make_runtime_plan(config(1, 2, ScheduleKind::gpipe, 1, 8)).plan);
  for (int stage = 0; stage < 2; ++stage) {
    const InFlight f = in_flight(gpipe.ranks[stage], stage);
    EXPECT_EQ(f.stashes, 8) << "GPipe: all eight forwards before any backward";
    EXPECT_EQ(f.backwards, 1);
    EXPECT_EQ(f.split_backwards, 0);
  }
  const RuntimePlan rp = make_runtime_plan(config(1, 4, ScheduleKind::one_f_one_b, 1, 8));
  const Schedule ofob = build_schedule(rp.plan);
  for (int stage = 0; stage < 4; ++stage) {
    const InFlight f = in_flight(ofob.ranks[rp.plan.rank_of(stage, 0)], stage);
    EXPECT_EQ(f.stashes, 4 - stage) << "1F1B stage " << stage;
    EXPECT_EQ(f.backwards, 1);
  }
  const Schedule zb = build_schedule(make_runtime_plan(config(1, 4, ScheduleKind::zb_h1, 1, 8)).plan);
  for (int stage = 0; stage < 4; ++stage) {
    const InFlight f = in_flight(zb.ranks[stage], stage);
    EXPECT_GE(f.split_backwards, 1) << "stage " << stage;
    EXPECT_EQ(f.backwards, 0);
    EXPECT_GE(f.stashes, 4 - stage);
    EXPECT_LE(f.stashes, 8);
  }
  // A chunk the rank does not hold holds nothing.
  EXPECT_EQ(in_flight(ofob.ranks[0], 3).stashes, 0);
}

TEST(P2pLinks, NoneWithoutAPipeline) {
  const RuntimePlan rp = make_runtime_plan(config(4, 1, ScheduleKind::one_f_one_b, 1, 8));
  EXPECT_TRUE(p2p_links(build_schedule(rp.plan), World::of(rp.plan)).empty());
}

}  // namespace
}  // namespace trainsim::runtime
