// The run loop (runtime/loop/run_loop.h), on the null engine (runtime/null/null_engine.h): what the
// loop owns, whatever engine runs the steps. Resuming is bitwise, checkpoints come at their
// cadence and never after a failure, a failed rank or a NaN/diverging loss ends the run with a
// message that says where, the report describes the median step, and with an engine that plays
// back the prediction the measured result is the predicted one.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "runtime/backend.h"
#include "runtime/checkpoint.h"
#include "runtime/loop/run_loop.h"
#include "runtime/loop/run_report.h"
#include "runtime/null/null_engine.h"
#include "runtime/runtime_plan.h"
#include "sim/simulator.h"
#include "tests/runtime/runtime_test_config.h"

namespace trainsim::runtime {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

ScenarioConfig config(int dp, int pp, ScheduleKind schedule, int vpp = 1, int steps = 5) {
  ScenarioConfig c = testing::tiny_training(dp, pp, schedule, vpp);
  c.runtime.steps = steps;
  return c;
}

// The null backend with `faults`, reporting (not sleeping) unless they say so.
Backend faulty(const NullFaults& faults) {
  Backend b = null_backend();
  b.engine = [faults](const RuntimePlan& plan, const Dataset&, const RunOptions& options) {
    return make_null_engine(plan, options, faults);
  };
  return b;
}

RunReport run_null(const ScenarioConfig& c, RunOptions options = {}, const NullFaults& faults = {}) {
  options.synthetic_data = true;
  return run(faulty(faults), make_runtime_plan(c), options);
}

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("trainsim_test_run_" + name);
  fs::remove_all(dir);
  return dir;
}

RunOptions checkpoints_every(int steps, const fs::path& dir) {
  RunOptions o;
  o.checkpoint_dir = dir.string();
  o.checkpoint_every_steps = steps;
  return o;
}

TEST(RunLoop, PlaysBackThePredictionAsTheMeasuredResult) {
  for (const ScenarioConfig& c : {config(2, 2, ScheduleKind::one_f_one_b), config(1, 4, ScheduleKind::gpipe),
                                  config(2, 2, ScheduleKind::interleaved_1f1b, 2), config(1, 2, ScheduleKind::zb_h1)}) {
    SCOPED_TRACE(std::string(schedule_name(c.parallelism.schedule)));
    const RuntimePlan rp = make_runtime_plan(c);
    const RunReport r = run_null(c);
    ASSERT_FALSE(r.failure) << r.failure->message;
    ASSERT_EQ(r.steps.size(), 5u);
    EXPECT_EQ(r.first_step, 1);
    EXPECT_EQ(r.backend, "null");
    EXPECT_FALSE(r.timeline.predicted);
    const Prediction p = predict(rp.plan);
    EXPECT_EQ(r.result.step_time_s, p.result.step_time_s);
    EXPECT_EQ(r.result.bubble_fraction, p.result.bubble_fraction);
    EXPECT_EQ(r.result.allreduce_time_s, p.result.allreduce_time_s);
    // Each step's record holds its own timeline's all-reduce: here every step plays the prediction back.
    for (const StepRecord& s : r.steps) EXPECT_EQ(s.allreduce_time_s, p.result.allreduce_time_s) << "step " << s.step;
    if (rp.plan.dp > 1) {
      EXPECT_GT(p.result.allreduce_time_s, 0.0);
    }
    ASSERT_EQ(r.result.ranks.size(), p.result.ranks.size());
    for (std::size_t k = 0; k < r.result.ranks.size(); ++k)
      EXPECT_EQ(r.result.ranks[k].peak_memory_bytes, p.result.ranks[k].peak_memory_bytes) << "rank " << k;
    EXPECT_EQ(r.result.mfu, 0) << "a run claims no MFU";
    for (const StepRecord& s : r.steps) {
      EXPECT_EQ(s.replica_checksums.size(), static_cast<std::size_t>(rp.plan.dp));
      for (std::uint64_t h : s.replica_checksums) EXPECT_EQ(h, s.replica_checksums[0]) << "replicas stay identical";
      EXPECT_EQ(s.replica_drift, 0.0);
      EXPECT_EQ(s.ranks.size(), static_cast<std::size_t>(rp.plan.num_ranks()));
    }
    EXPECT_LT(r.steps.back().loss, r.steps.front().loss) << "the stand-in trains";
  }
}

// Under tensor parallelism a schedule rank is tp ranks of the world: every shard plays back its
// cell's predicted ops, and the loop folds them back into one schedule rank per cell (its ops from
// its last shard's start to its last shard's end, its memory its largest shard's), so the
// measured result is still the prediction; every rank is reported with its coordinates.
TEST(RunLoop, FoldsTensorParallelShardsIntoTheirScheduleRank) {
  ScenarioConfig c = config(2, 2, ScheduleKind::one_f_one_b);
  c.parallelism.tensor_parallel_size = 2;
  const RuntimePlan rp = make_runtime_plan(c);
  const RunReport r = run_null(c);
  ASSERT_FALSE(r.failure) << r.failure->message;
  const Prediction p = predict(rp.plan);
  EXPECT_EQ(r.result.step_time_s, p.result.step_time_s);
  EXPECT_EQ(r.result.bubble_fraction, p.result.bubble_fraction);
  ASSERT_EQ(r.result.ranks.size(), 4u) << "a rank of the result per (dp, pp) cell";
  ASSERT_EQ(r.executed_ranks.size(), 8u);
  for (const ExecutedRank& e : r.executed_ranks) {
    EXPECT_EQ(World::of(rp.plan).rank({e.dp, e.pp, e.tp}), e.rank);
    EXPECT_EQ(e.schedule_rank, rp.plan.rank_of(e.pp, e.dp));
    EXPECT_EQ(e.memory.total(), p.result.ranks[static_cast<std::size_t>(e.schedule_rank)].peak_memory_bytes);
  }
  for (const StepRecord& s : r.steps) EXPECT_EQ(s.ranks.size(), 8u);

  // Shards that ran an op at different times: the cell's op runs from the later start to the
  // later end, and reaches a collective with its later shard.
  const World world(1, 1, 2);
  std::vector<RankStep> shards(2);
  shards[0].timing = {{0, 10}, {10, 30}};
  shards[1].timing = {{2, 12}, {12, 25}};
  shards[0].arrival = {-1, 10};
  shards[1].arrival = {-1, 12};
  shards[0].parts = {{}, {{11, 20}}};
  shards[1].parts = {{}, {{15, 18}}};
  const std::vector<RankStep> cells = cell_steps(world, shards);
  ASSERT_EQ(cells.size(), 1u);
  EXPECT_EQ(cells[0].timing[0].start, 2);
  EXPECT_EQ(cells[0].timing[0].end, 12);
  EXPECT_EQ(cells[0].timing[1].start, 12);
  EXPECT_EQ(cells[0].timing[1].end, 30);
  EXPECT_EQ(cells[0].arrival[1], 12);
  // A part of a collective has room when its last shard has, and ends with its last shard.
  ASSERT_EQ(cells[0].parts[1].size(), 1u);
  EXPECT_EQ(cells[0].parts[1][0], (std::pair<Tick, Tick>{15, 20}));
}

// The run's summary splits idle time as the simulator's does: a data-parallel run's idle time is
// exposed communication, not a pipeline bubble, and the two parts add up to the bubble fraction.
TEST(RunLoop, AGatherInPartsWaitsUntilItsLastMemberHasRoomForEachPart) {
  // Two ranks, one ZeRO-3 gather in two parts. Rank 0 reached it at 0 and had room at 10 and 60
  // (its first part ended at 30), rank 1 reached it at 5 and had room at 20 and 50 (its first
  // part ended at 40). The gather starts with its last member (5); its parts move from 20 and from
  // 60, so rank 0 waited 15 + 30 and rank 1 15 + 20, whoever's room it was.
  auto s = std::make_shared<Schedule>();
  s->ranks.resize(2);
  Collective c;
  c.kind = OpKind::AllGather;
  c.purpose = CollectivePurpose::parameters;
  c.members = {0, 1};
  c.parts = 2;
  s->collectives.push_back(c);
  for (int r = 0; r < 2; ++r) {
    Op op;
    op.kind = OpKind::AllGather;
    op.channel = 0;
    s->ranks[static_cast<std::size_t>(r)].rank = r;
    s->ranks[static_cast<std::size_t>(r)].replica = r;
    s->ranks[static_cast<std::size_t>(r)].ops.push_back(op);
  }
  std::vector<RankStep> ranks(2);
  ranks[0].timing = {{0, 100, 40}};
  ranks[0].arrival = {0};
  ranks[0].parts = {{{10, 30}, {60, 80}}};
  ranks[1].timing = {{5, 100, 25}};
  ranks[1].arrival = {5};
  ranks[1].parts = {{{20, 40}, {50, 90}}};
  const Timeline tl = measured_timeline(s, ranks);
  EXPECT_EQ(tl.ops[0][0].start, 5);
  EXPECT_EQ(tl.ops[0][0].waited, 45);
  EXPECT_EQ(tl.ops[1][0].start, 5);
  EXPECT_EQ(tl.ops[1][0].waited, 35);
  // Without the parts, each member's own waits stand.
  ranks[0].parts.clear();
  ranks[1].parts.clear();
  const Timeline own = measured_timeline(s, ranks);
  EXPECT_EQ(own.ops[0][0].waited, 40);
  EXPECT_EQ(own.ops[1][0].waited, 25);
}

TEST(RunLoop, TheSummarySplitsIdleTimeIntoPipelineBubbleAndExposedCommunication) {
  for (const ScenarioConfig& c : {config(2, 1, ScheduleKind::one_f_one_b), config(1, 2, ScheduleKind::one_f_one_b)}) {
    const RunReport r = run_null(c);
    ASSERT_FALSE(r.failure) << r.failure->message;
    const Result& res = r.result;
    EXPECT_NEAR(res.pipeline_bubble_fraction + res.exposed_comm_fraction, res.bubble_fraction, 1e-12);
    if (c.parallelism.pipeline_parallel_size == 1) {
      EXPECT_EQ(res.pipeline_bubble_fraction, 0.0);
    }
    const std::string line = fmt::format("= pipeline bubble {:.1f}% + exposed communication {:.1f}%",
                                         100 * res.pipeline_bubble_fraction, 100 * res.exposed_comm_fraction);
    EXPECT_NE(format_run_summary(r).find(line), std::string::npos) << line << "\n" << format_run_summary(r);
  }
}

// The summary's plan line names what ran: the ZeRO stage and its framework where data parallelism
// shards, and the recompute mode.
TEST(RunLoop, TheSummarySaysTheZeroStageAndRecomputeThatRan) {
  ScenarioConfig c = config(2, 1, ScheduleKind::one_f_one_b);
  c.parallelism.zero_stage = 3;
  c.parallelism.framework = Framework::fsdp;
  c.training.activation_recompute = Recompute::selective_op;
  const RunReport r = run_null(c);
  ASSERT_FALSE(r.failure) << r.failure->message;
  const std::string summary = format_run_summary(r);
  EXPECT_NE(summary.find(", ZeRO 3 (fsdp), recompute selective_op\n"), std::string::npos) << summary;
  c.parallelism.zero_stage = 0;
  c.training.activation_recompute = Recompute::none;
  const std::string plain = format_run_summary(run_null(c));
  EXPECT_EQ(plain.find("ZeRO"), std::string::npos) << plain;
  EXPECT_NE(plain.find(", recompute none\n"), std::string::npos) << plain;
}

// Where the engine measured what other work took from the ranks' cores, the summary says so per
// step and names the reported step's choice; where it did not (the null engine), neither shows.
TEST(RunLoop, TheSummarySaysWhatTheHostTookWhereItWasMeasured) {
  RunReport r = run_null(config(2, 2, ScheduleKind::one_f_one_b, 1, 7));
  ASSERT_FALSE(r.failure) << r.failure->message;
  const std::string plain = format_run_summary(r);
  EXPECT_NE(plain.find("the median)"), std::string::npos) << plain;
  EXPECT_EQ(plain.find(" host"), std::string::npos) << plain;
  for (StepRecord& s : r.steps) s.foreign_seconds = 0.25 * s.step_time_s;
  const std::string measured = format_run_summary(r);
  EXPECT_NE(measured.find("the median of the half the host took least from)"), std::string::npos) << measured;
  EXPECT_NE(measured.find("   host\n"), std::string::npos) << measured;
  std::size_t rows = 0;
  for (auto at = measured.find(" 25.0%\n"); at != std::string::npos; at = measured.find(" 25.0%\n", at + 1)) ++rows;
  EXPECT_EQ(rows, r.steps.size()) << measured;
}

TEST(RunLoop, ResumingFromACheckpointIsBitwiseAndCheckpointsComeAtTheirCadence) {
  const fs::path dir = fresh_dir("resume");
  const ScenarioConfig c = config(2, 2, ScheduleKind::one_f_one_b, 1, 7);
  const RunReport whole = run_null(c, checkpoints_every(3, dir));
  ASSERT_FALSE(whole.failure);
  // Every multiple of 3, and the last step.
  ASSERT_EQ(whole.checkpoints.size(), 3u);
  EXPECT_EQ(load_checkpoint(whole.checkpoints[0]).step, 3);
  EXPECT_EQ(load_checkpoint(whole.checkpoints[1]).step, 6);
  EXPECT_EQ(load_checkpoint(whole.checkpoints[2]).step, 7);
  EXPECT_EQ(load_checkpoint(dir.string()).step, 7) << "the folder resumes from its latest";

  RunOptions resume;
  resume.resume_from = whole.checkpoints[0];
  const RunReport rest = run_null(c, resume);
  ASSERT_FALSE(rest.failure);
  ASSERT_EQ(rest.first_step, 4);
  ASSERT_EQ(rest.steps.size(), 4u);
  for (const StepRecord& again : rest.steps) {
    const StepRecord& first_time = whole.steps[static_cast<std::size_t>(again.step - 1)];
    EXPECT_EQ(again.loss, first_time.loss) << "step " << again.step << ", bitwise";
    EXPECT_EQ(again.replica_checksums, first_time.replica_checksums) << "step " << again.step;
  }
  EXPECT_TRUE(rest.checkpoints.empty()) << "no checkpoint dir, no checkpoints";

  // A checkpoint of another plan is refused before any step.
  ScenarioConfig other = c;
  other.parallelism.schedule = ScheduleKind::gpipe;
  EXPECT_THROW(run_null(other, resume), CheckpointError);
  fs::remove_all(dir);
}

TEST(RunLoop, AFailedRankEndsTheRunNamingItAndWritesNothingAfter) {
  const fs::path dir = fresh_dir("fail");
  NullFaults f;
  f.fail_rank = 2;
  f.fail_step = 3;
  const RunReport r = run_null(config(2, 2, ScheduleKind::one_f_one_b), checkpoints_every(1, dir), f);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->step, 3);
  EXPECT_NE(r.failure->message.find("rank 2 failed at step 3: the null engine's injected failure"), std::string::npos)
      << r.failure->message;
  EXPECT_EQ(r.steps.size(), 2u) << "the failed step has no record";
  EXPECT_EQ(r.checkpoints.size(), 2u) << "checkpoints of the steps that completed, none after";
  EXPECT_EQ(r.timeline_step, 2) << "the result describes a step that completed";
  fs::remove_all(dir);
}

TEST(RunLoop, ANonFiniteLossEndsTheRunSayingWhereItFirstAppeared) {
  const fs::path dir = fresh_dir("nan");
  NullFaults f;
  f.nan_step = 2;
  const RunReport r = run_null(config(1, 2, ScheduleKind::gpipe), checkpoints_every(1, dir), f);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->step, 2);
  EXPECT_EQ(r.failure->message,
            "loss became NaN at step 2; non-finite values first appeared at step 2, in the null engine's injected NaN "
            "(stage 1, replica 0)");
  ASSERT_EQ(r.steps.size(), 2u) << "the step that went wrong is recorded";
  EXPECT_TRUE(std::isnan(r.steps[1].loss));
  EXPECT_EQ(r.checkpoints.size(), 1u) << "no checkpoint of a failed step";
  fs::remove_all(dir);
}

// A run its numerics end before it has timed RunOptions::timed_steps_at_least steps replays its
// steps from the state it started from: the same losses, the same failure, and the reported step
// chosen among the run's timed steps and its replays'.
TEST(RunLoop, ARunItsNumericsEndedEarlyReplaysItsStepsForTheirTiming) {
  const fs::path dir = fresh_dir("replay");
  NullFaults f;
  f.nan_step = 2;
  RunOptions o = checkpoints_every(1, dir);
  o.timed_steps_at_least = 4;
  int seen = 0;
  o.on_step = [&](const StepRecord&) { ++seen; };
  const RunReport r = run_null(config(1, 2, ScheduleKind::gpipe), o, f);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->step, 2);
  EXPECT_EQ(r.failure->message.rfind("loss became NaN at step 2", 0), 0u) << r.failure->message;
  ASSERT_EQ(r.steps.size(), 2u) << "the run's own steps: its numerics story";
  ASSERT_EQ(r.replayed_steps.size(), 6u) << "one timed step a run: three replays of steps 1 and 2";
  for (std::size_t i = 0; i < r.replayed_steps.size(); ++i) {
    const StepRecord& s = r.replayed_steps[i];
    EXPECT_EQ(s.replay, static_cast<int>(i / 2) + 1);
    EXPECT_EQ(s.step, static_cast<int>(i % 2) + 1);
    if (s.step == 1) {
      EXPECT_EQ(s.loss, r.steps[0].loss) << "restored bitwise: the same loss";
    } else {
      EXPECT_TRUE(std::isnan(s.loss));
    }
  }
  EXPECT_EQ(seen, 8) << "on_step sees every step run, replays too";
  EXPECT_EQ(r.checkpoints.size(), 1u) << "replays write no checkpoints";
  const std::vector<StepRecord> all = steps_as_run(r);
  EXPECT_EQ(timed_step_indices(all), (std::vector<int>{1, 3, 5, 7})) << "every run's first step left out";
  const int reported = reported_step_index(r);
  ASSERT_GE(reported, 0);
  EXPECT_EQ(reported, median_step_index(all));
  EXPECT_EQ(r.timeline_step, 2);
  EXPECT_EQ(all[static_cast<std::size_t>(reported)].replay, r.timeline_replay);
  fs::remove_all(dir);

  // Without the option, or when a rank failed (not the numerics), nothing is replayed.
  EXPECT_TRUE(run_null(config(1, 2, ScheduleKind::gpipe), {}, f).replayed_steps.empty());
  NullFaults failing;
  failing.fail_rank = 1;
  failing.fail_step = 2;
  RunOptions at_least;
  at_least.timed_steps_at_least = 4;
  EXPECT_TRUE(run_null(config(1, 2, ScheduleKind::gpipe), at_least, failing).replayed_steps.empty());

  // A replay whose numerics differ from the run's (an engine that does not restore) is dropped.
  f.restore_forgets = true;
  const RunReport differs = run_null(config(1, 2, ScheduleKind::gpipe), at_least, f);
  ASSERT_TRUE(differs.failure);
  EXPECT_EQ(differs.failure->step, 2);
  EXPECT_TRUE(differs.replayed_steps.empty());
  EXPECT_EQ(differs.timeline_step, 2);
  EXPECT_EQ(differs.timeline_replay, 0);
}

// A run of one step replayed: its replays' steps are timed, warm after the run's.
TEST(RunLoop, TimedStepsOfAOneStepRunAreAllOfItsReplays) {
  std::vector<StepRecord> all(3);
  for (std::size_t i = 0; i < all.size(); ++i) all[i].step = 1, all[i].replay = static_cast<int>(i);
  EXPECT_EQ(timed_step_indices(all), (std::vector<int>{0, 1, 2}));
}

TEST(RunLoop, ADivergingLossEndsTheRun) {
  NullFaults f;
  f.diverge_step = 4;
  const RunReport r = run_null(config(1, 1, ScheduleKind::one_f_one_b, 1, 8), {}, f);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->step, 4);
  EXPECT_EQ(r.failure->message.rfind("loss diverged at step 4", 0), 0u) << r.failure->message;
  EXPECT_EQ(r.steps.size(), 4u);
}

TEST(RunLoop, TheReportDescribesTheMedianStepNotTheFirstOrTheSlowest) {
  NullFaults f;
  f.step_sleep = {milliseconds(150), milliseconds(2), milliseconds(120), milliseconds(2), milliseconds(2)};
  const RunReport r = run_null(config(1, 2, ScheduleKind::one_f_one_b), {}, f);
  ASSERT_FALSE(r.failure);
  ASSERT_EQ(r.steps.size(), 5u);
  EXPECT_GE(r.steps[2].step_time_s, 0.1) << "the loop times each step";
  EXPECT_NE(r.timeline_step, 1) << "the first step is left out (warm-up)";
  EXPECT_NE(r.timeline_step, 3) << "the slow step is not the median";
  EXPECT_EQ(r.steps[static_cast<std::size_t>(median_step_index(r.steps))].step, r.timeline_step);
}

TEST(RunLoop, MedianStepLeavesOutTheFirstWhenThereAreOthers) {
  auto steps = [](std::vector<double> seconds) {
    std::vector<StepRecord> out;
    for (std::size_t i = 0; i < seconds.size(); ++i) {
      StepRecord s;
      s.step = static_cast<int>(i) + 1;
      s.step_time_s = seconds[i];
      out.push_back(s);
    }
    return out;
  };
  EXPECT_EQ(median_step_index({}), -1);
  EXPECT_EQ(median_step_index(steps({5})), 0) << "one step is its own median";
  EXPECT_EQ(median_step_index(steps({0.1, 9, 1})), 1) << "of {9, 1}: the upper middle";
  EXPECT_EQ(median_step_index(steps({9, 3, 1, 2})), 3) << "of {3, 1, 2}: 2";
  EXPECT_EQ(median_step_index(steps({9, 2, 2, 2})), 2) << "ties: the earlier of the middle";
}

// Where the engine measured the host's share of every step, the report describes the median of the
// half of the steps the host took least from: a step another process held a core in is left out
// even when its time is the median's.
TEST(RunLoop, MedianStepLeavesOutTheStepsTheHostTookTheMostFrom) {
  auto steps = [](std::vector<double> seconds, std::vector<double> foreign) {
    std::vector<StepRecord> out;
    for (std::size_t i = 0; i < seconds.size(); ++i) {
      StepRecord s;
      s.step = static_cast<int>(i) + 1;
      s.step_time_s = seconds[i];
      s.foreign_seconds = foreign[i];
      out.push_back(s);
    }
    return out;
  };
  // Steps 2..7 by time: 1.0, 1.1, 1.2, 1.3, 1.4, 1.5; the host took 0.2 s of steps 3 and 4 (1.1 and
  // 1.2) and of step 7, so the half it took least from is steps 2, 5 and 6 (1.0, 1.3, 1.4): 1.3.
  const auto disturbed = steps({9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5}, {5, 0.001, 0.2, 0.2, 0.002, 0.001, 0.2});
  EXPECT_EQ(median_step_index(disturbed), 4);
  // The share of the step, not the seconds: 0.012 s of a 1.5 s step (0.8%) is less of it than
  // 0.011 s of a 1.3 s one (0.85%) or 0.010 s of a 1.0 s one (1%). The half kept: steps 4, 5 and 3
  // (1.2, 1.1, 1.5): 1.2. By seconds it would be steps 4, 5 and 2 (1.2, 1.1, 1.0): 1.1.
  EXPECT_EQ(median_step_index(steps({9, 1.0, 1.5, 1.2, 1.1, 1.3}, {0, 0.010, 0.012, 0.0, 0.0, 0.011})), 3);
  // Not measured on every step (-1), or too few steps to halve: the median of all, as before.
  auto unmeasured = disturbed;
  unmeasured[3].foreign_seconds = -1;
  EXPECT_EQ(median_step_index(unmeasured), 4) << "of 1.0..1.5: the upper middle, 1.3 (step 5)";
  EXPECT_EQ(median_step_index(steps({9, 1.0, 1.1, 1.2}, {0, 0.5, 0, 0})), 2) << "three steps: 1.1";
}

TEST(RunLoop, ABackendThisBuildCannotUseSaysWhyBeforeRunning) {
  Backend b = null_backend();
  b.unavailable = "this trainsim was built without the example device";
  bool built = false;
  b.engine = [&](const RuntimePlan& plan, const Dataset&, const RunOptions& options) {
    built = true;
    return make_null_engine(plan, options);
  };
  RunOptions o;
  o.synthetic_data = true;
  try {
    (void)run(b, make_runtime_plan(config(1, 1, ScheduleKind::gpipe)), o);
    FAIL() << "ran on an unavailable backend";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "this trainsim was built without the example device");
  }
  EXPECT_FALSE(built);
}

TEST(Backends, EveryBackendIsFoundByItsNameOnce) {
  std::vector<std::string> names;
  for (const Backend* b : backends()) {
    names.push_back(b->name);
    EXPECT_EQ(&find_backend(b->name), b);
    EXPECT_FALSE(b->title.empty()) << b->name;
    EXPECT_TRUE(b->engine || !b->unavailable.empty()) << b->name << ": an engine, or why not";
  }
  for (const char* expected : {"cpu", "cuda", "null"})
    EXPECT_EQ(std::count(names.begin(), names.end(), expected), 1) << expected;
  EXPECT_EQ(&cpu_backend(), &find_backend("cpu"));
  try {
    (void)find_backend("tpu");
    FAIL() << "found a backend that does not exist";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cpu, cuda, null"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace trainsim::runtime
