// The CPU executor runs the schedule for real. Properties checked here:
//  * hybrid parallelism is exact: in FP32, any (data, pipeline) layout and schedule trains
//    the same model as one rank, to FP32 rounding;
//  * the incident's mechanisms: FP16 with too high a static scale gives inf gradients;
//    local overflow checks let ranks disagree and replicas drift; a global check keeps
//    them identical;
//  * checkpoint + resume and reruns with the same seed are bitwise identical;
//  * the measured Timeline and memory accounting obey the schedule's rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "core/metrics.h"
#include "sim/simulator.h"
#include "runtime/cpu/cpu_engine.h"
#include "runtime/loop/run_report.h"
#include "runtime/runtime_plan.h"
#include "runtime/loop/run_loop.h"
#include "tests/runtime/runtime_test_config.h"

namespace trainsim::runtime {
namespace {

ScenarioConfig small_config(int dp, int pp, ScheduleKind schedule, int vpp = 1) {
  return testing::tiny_training(dp, pp, schedule, vpp);
}

RunReport run(const ScenarioConfig& c, RunOptions opt = {}) {
  opt.synthetic_data = c.runtime.data_synthetic;
  opt.pin_threads = false;
  return run_cpu(make_runtime_plan(c), opt);
}

std::vector<double> losses(const RunReport& r) {
  std::vector<double> l;
  for (const auto& s : r.steps) l.push_back(s.loss);
  return l;
}

TEST(Executor, HybridParallelismMatchesOneRankInFp32) {
  const RunReport reference = run(small_config(1, 1, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(reference.failure) << reference.failure->message;
  ASSERT_EQ(reference.steps.size(), 3u);
  // Training happens: the loss moves.
  EXPECT_NE(reference.steps[0].loss, reference.steps[2].loss);

  struct Layout {
    int dp, pp, vpp;
    ScheduleKind schedule;
  };
  const Layout layouts[] = {
      {2, 4, 1, ScheduleKind::gpipe},           {1, 4, 1, ScheduleKind::gpipe},
      {2, 1, 1, ScheduleKind::gpipe},           {2, 4, 1, ScheduleKind::one_f_one_b},
      {1, 4, 1, ScheduleKind::one_f_one_b},     {2, 1, 1, ScheduleKind::one_f_one_b},
      {2, 4, 2, ScheduleKind::interleaved_1f1b}, {1, 4, 2, ScheduleKind::interleaved_1f1b},
      {1, 2, 1, ScheduleKind::zb_h1},
  };
  for (const Layout& l : layouts) {
    SCOPED_TRACE(::testing::Message() << "dp " << l.dp << " pp " << l.pp << " v " << l.vpp << " "
                                      << schedule_name(l.schedule));
    const RunReport r = run(small_config(l.dp, l.pp, l.schedule, l.vpp));
    ASSERT_FALSE(r.failure) << r.failure->message;
    ASSERT_EQ(r.steps.size(), reference.steps.size());
    for (std::size_t i = 0; i < r.steps.size(); ++i) {
      // Same samples, same weights, same updates: only the order of FP32 sums differs.
      EXPECT_NEAR(r.steps[i].loss, reference.steps[i].loss, 2e-5 * std::fabs(reference.steps[i].loss)) << "step " << i + 1;
      EXPECT_NEAR(r.steps[i].grad_norm, reference.steps[i].grad_norm, 1e-4 * reference.steps[i].grad_norm);
      EXPECT_EQ(r.steps[i].replica_drift, 0.0) << "replicas hold bit-identical weights";
    }
  }
}

TEST(Executor, OverlappedBucketsGiveTheSameTraining) {
  ScenarioConfig c = small_config(2, 2, ScheduleKind::one_f_one_b);
  const RunReport plain = run(c);
  c.communication.overlap_grad_reduce = true;
  c.communication.bucket_size_mib = 0.01;  // several buckets per stage of the small model
  const RunReport overlapped = run(c);
  ASSERT_FALSE(overlapped.failure);
  int buckets = 0;
  for (const auto& col : overlapped.schedule->collectives) buckets += col.purpose == CollectivePurpose::gradients;
  EXPECT_GT(buckets, 2 * 2) << "the test needs several buckets per stage";
  for (std::size_t i = 0; i < plain.steps.size(); ++i) {
    EXPECT_EQ(plain.steps[i].loss, overlapped.steps[i].loss) << "step " << i + 1 << ": bucketing changes no sum's operands";
    EXPECT_EQ(plain.steps[i].grad_norm, overlapped.steps[i].grad_norm) << "step " << i + 1;
  }
}

TEST(Executor, Fp16WithTooHighStaticScaleOverflows) {
  ScenarioConfig c = small_config(2, 2, ScheduleKind::one_f_one_b);
  c.precision.compute = DType::fp16;
  c.precision.loss_scaling.mode = LossScalingMode::static_scale;
  c.precision.loss_scaling.initial_scale = std::ldexp(1.0, 40);
  const RunReport r = run(c);
  for (const auto& s : r.steps) {
    EXPECT_GT(s.nonfinite_count, 0) << "scaled fp16 gradients overflow";
    EXPECT_EQ(s.skipped_ranks, 4) << "every rank skips under the global check";
  }
  EXPECT_EQ(r.steps.front().replica_checksums, r.steps.back().replica_checksums) << "no update was applied";
  bool named = false;
  for (const auto& rk : r.steps.front().ranks) named = named || !rk.first_nonfinite.empty();
  EXPECT_TRUE(named) << "the first tensor that overflowed is named";
}

// Searches the static scales 2^10 .. 2^40 for one at which the ranks' own overflow verdicts
// disagree on the first step: the borderline where local checks go wrong.
double borderline_scale(ScenarioConfig c) {
  c.runtime.steps = 1;
  for (int k = 10; k <= 40; ++k) {
    c.precision.loss_scaling.initial_scale = std::ldexp(1.0, k);
    const RunReport r = run(c);
    int found = 0;
    for (const auto& rk : r.steps.at(0).ranks) found += rk.found_nonfinite;
    if (found > 0 && found < static_cast<int>(r.steps[0].ranks.size())) return std::ldexp(1.0, k);
  }
  return 0;
}

TEST(Executor, LocalOverflowChecksLetRanksDisagreeAndReplicasDrift) {
  ScenarioConfig c = small_config(2, 2, ScheduleKind::one_f_one_b);
  c.precision.compute = DType::fp16;
  c.precision.grad_accumulation = DType::fp16;
  c.precision.allreduce = DType::fp16;
  c.precision.loss_scaling.mode = LossScalingMode::static_scale;
  c.precision.overflow_check = OverflowScope::local;
  const double scale = borderline_scale(c);
  ASSERT_GT(scale, 0) << "no static scale between 2^10 and 2^40 splits the ranks' verdicts";
  c.precision.loss_scaling.initial_scale = scale;
  c.runtime.steps = 2;
  const RunReport local = run(c);
  ASSERT_GE(local.steps.size(), 1u);
  const auto& first = local.steps[0];
  EXPECT_GT(first.skipped_ranks, 0);
  EXPECT_LT(first.skipped_ranks, 4) << "some ranks skipped, others applied the update";
  bool replicas_disagree = false;
  for (const auto& a : first.ranks)
    for (const auto& b : first.ranks)
      if (a.stage == b.stage && a.skipped != b.skipped) replicas_disagree = true;
  if (replicas_disagree) {
    EXPECT_GT(first.replica_drift, 0) << "replicas that skipped differently differ";
  } else {
    EXPECT_EQ(first.replica_drift, 0);
  }

  // The same scale under a global check: every rank skips together and replicas stay identical.
  c.precision.overflow_check = OverflowScope::global;
  const RunReport global = run(c);
  for (const auto& s : global.steps) {
    EXPECT_TRUE(s.skipped_ranks == 0 || s.skipped_ranks == 4);
    EXPECT_EQ(s.replica_drift, 0.0);
    EXPECT_EQ(s.replica_checksums[0], s.replica_checksums[1]);
  }
}

TEST(Executor, GlobalCheckWithDynamicScalingRecoversAndTrains) {
  ScenarioConfig c = small_config(2, 2, ScheduleKind::one_f_one_b);
  c.precision.compute = DType::fp16;
  c.precision.loss_scaling.mode = LossScalingMode::dynamic;
  c.precision.loss_scaling.initial_scale = std::ldexp(1.0, 40);
  c.precision.loss_scaling.hysteresis = 1;
  c.runtime.steps = 40;
  const RunReport r = run(c);
  ASSERT_FALSE(r.failure) << r.failure->message;
  EXPECT_TRUE(r.steps.front().skipped) << "2^40 overflows at first";
  EXPECT_LT(r.steps.back().loss_scale, r.steps.front().loss_scale) << "the scale backed off";
  EXPECT_FALSE(r.steps.back().skipped) << "and training proceeds";
  for (const auto& s : r.steps) EXPECT_EQ(s.replica_drift, 0.0);
  EXPECT_LT(r.steps.back().loss, r.steps.front().loss);
}

TEST(Executor, CheckpointResumeIsBitwiseIdentical) {
  const auto dir = std::filesystem::temp_directory_path() / "trainsim_test_resume";
  std::filesystem::remove_all(dir);
  ScenarioConfig c = small_config(2, 2, ScheduleKind::interleaved_1f1b, 2);
  c.precision.compute = DType::bf16;
  c.precision.loss_scaling.mode = LossScalingMode::dynamic;
  c.runtime.steps = 4;
  RunOptions opt;
  opt.checkpoint_dir = dir.string();
  opt.checkpoint_every_steps = 2;
  const RunReport whole = run(c, opt);
  ASSERT_FALSE(whole.failure);
  ASSERT_EQ(whole.checkpoints.size(), 2u);

  RunOptions resume;
  resume.resume_from = whole.checkpoints[0];  // after step 2
  const RunReport rest = run(c, resume);
  ASSERT_EQ(rest.first_step, 3);
  ASSERT_EQ(rest.steps.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(rest.steps[i].step, whole.steps[i + 2].step);
    EXPECT_EQ(rest.steps[i].loss, whole.steps[i + 2].loss) << "bitwise";
    EXPECT_EQ(rest.steps[i].replica_checksums, whole.steps[i + 2].replica_checksums);
  }
  // The same seed gives the same run.
  const RunReport again = run(c);
  EXPECT_EQ(losses(again), losses(whole));

  // A checkpoint of another plan is refused.
  ScenarioConfig other = c;
  other.parallelism.schedule = ScheduleKind::one_f_one_b;
  other.parallelism.virtual_pipeline_stages = 1;
  EXPECT_ANY_THROW(run(other, resume));
  std::filesystem::remove_all(dir);
}

TEST(Executor, MeasuredTimelineFollowsTheSchedule) {
  const RunReport r = run(small_config(2, 4, ScheduleKind::gpipe));
  const Schedule& s = *r.schedule;
  ASSERT_EQ(r.timeline.ops.size(), s.ranks.size());
  std::map<int, Tick> send_start;
  for (std::size_t rank = 0; rank < s.ranks.size(); ++rank) {
    Tick last_compute_end = 0;
    for (std::size_t i = 0; i < s.ranks[rank].ops.size(); ++i) {
      const Op& op = s.ranks[rank].ops[i];
      const OpTiming t = r.timeline.ops[rank][i];
      EXPECT_LE(t.start, t.end);
      if (stream_of(op.kind) == StreamKind::compute) {
        EXPECT_GE(t.start, last_compute_end) << "one compute op at a time, in program order";
        last_compute_end = t.end;
      }
      if (op.dep >= 0) {
        EXPECT_GE(t.start, r.timeline.ops[rank][op.dep].end - 1000) << op_label(op);
      }
      if (is_send(op.kind)) send_start[op.channel] = t.start;
    }
  }
  for (std::size_t rank = 0; rank < s.ranks.size(); ++rank)
    for (std::size_t i = 0; i < s.ranks[rank].ops.size(); ++i) {
      const Op& op = s.ranks[rank].ops[i];
      if (is_recv(op.kind)) {
        EXPECT_GE(r.timeline.ops[rank][i].end, send_start.at(op.channel)) << "a message arrives after it leaves";
      }
    }
  // The result is computed from this timeline by the simulator's own metrics.
  const Result again = compute_result(r.runtime_plan.plan, r.timeline, r.memory);
  EXPECT_EQ(again.step_time_s, r.result.step_time_s);
  EXPECT_EQ(again.bubble_fraction, r.result.bubble_fraction);
  for (const auto& rank : r.result.ranks) {
    EXPECT_GT(rank.utilization, 0);
    EXPECT_LE(rank.utilization, 1);
  }
}

// Every compute op of every rank (the optimizer step twice, around its gradient norm), in the
// order the simulator starts them: an order the ranks can follow.
std::vector<CoreTurn> predicted_turns(const RunReport& r) {
  const Timeline t = predict(r.runtime_plan.plan).timeline;
  std::vector<std::pair<Tick, CoreTurn>> turns;
  for (const RankProgram& p : r.schedule->ranks)
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i)
      if (is_compute(p.ops[i].kind)) {
        const Tick start = t.ops[p.rank][i].start;
        turns.push_back({start, {p.rank, i, 0}});
        if (p.ops[i].kind == OpKind::OptimizerStep) turns.push_back({t.end() + p.rank, {p.rank, i, 1}});
      }
  std::sort(turns.begin(), turns.end());
  std::vector<CoreTurn> out;
  for (const auto& [at, turn] : turns) out.push_back(turn);
  return out;
}

TEST(Executor, RanksThatShareCoresTakeTurnsInTheOrderGiven) {
  // Unpinned, ranks share the cores: first come first served, or in a given order; the training is
  // the same either way, and an order that leaves an op out is refused.
  const ScenarioConfig c = small_config(2, 4, ScheduleKind::one_f_one_b);
  const RunReport first_come = run(c);
  ASSERT_FALSE(first_come.failure);
  RunOptions o;
  o.core_turns = predicted_turns(first_come);
  const RunReport ordered = run(c, o);
  ASSERT_FALSE(ordered.failure);
  EXPECT_EQ(losses(ordered), losses(first_come));
  o.core_turns.pop_back();
  EXPECT_THROW(run(c, o), std::invalid_argument);
}

TEST(Executor, MemoryAccountingFollowsParametersAndStashes) {
  ScenarioConfig c = small_config(1, 4, ScheduleKind::gpipe);
  c.training.global_batch_size = 16;
  const RunReport gpipe = run(c);
  c.parallelism.schedule = ScheduleKind::one_f_one_b;
  const RunReport ofob = run(c);
  for (std::size_t r = 0; r < gpipe.memory.size(); ++r) {
    // Adam keeps two FP32 moments per FP32 master weight: optimizer bytes = 2 x weights
    // (compute is fp32, so there is no separate working copy).
    EXPECT_DOUBLE_EQ(gpipe.memory[r].optimizer, 2 * gpipe.memory[r].weights);
    EXPECT_DOUBLE_EQ(gpipe.memory[r].gradients, gpipe.memory[r].weights);
  }
  // GPipe keeps all 16 micro-batches' stashes on stage 0, 1F1B at most 4.
  EXPECT_GT(gpipe.memory[0].activations, 3 * ofob.memory[0].activations);
}

// Both executors fold their ranks' steps with step_record: the mean loss over every
// micro-batch of the last stages, counts over all ranks, rank 0's verdict, and the inf/NaN that
// came first in time (not first by rank).
TEST(Executor, StepRecordFoldsRanksAndNamesTheEarliestNonFinite) {
  std::vector<RankStep> ranks(3);
  for (int r = 0; r < 3; ++r) {
    ranks[r].numerics.rank = r;
    ranks[r].numerics.loss_scale = 1024;
    ranks[r].grad_norm = 2.5;
  }
  ranks[1].loss_sum = 6.0;  // two micro-batches of replica 0's last stage
  ranks[1].loss_count = 2;
  ranks[2].loss_sum = 5.0;  // one of replica 1's
  ranks[2].loss_count = 1;
  ranks[0].numerics.skipped = ranks[2].numerics.skipped = true;
  ranks[0].numerics.nonfinite_count = 4;
  ranks[2].numerics.nonfinite_count = 1;
  ranks[0].numerics.first_nonfinite = "later";
  ranks[0].first_nonfinite_at = 900;
  ranks[2].numerics.first_nonfinite = "earlier";
  ranks[2].first_nonfinite_at = 100;
  std::string first;
  const StepRecord rec = step_record(7, 0.25, ranks, &first);
  EXPECT_EQ(rec.step, 7);
  EXPECT_EQ(rec.step_time_s, 0.25);
  EXPECT_DOUBLE_EQ(rec.loss, 11.0 / 3);
  EXPECT_EQ(rec.nonfinite_count, 5);
  EXPECT_EQ(rec.skipped_ranks, 2);
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(rec.grad_norm, 2.5);
  EXPECT_EQ(rec.loss_scale, 1024);
  EXPECT_EQ(rec.ranks.size(), 3u);
  EXPECT_EQ(first, "earlier");
  EXPECT_TRUE(std::isnan(step_record(1, 0, {}, nullptr).loss)) << "no loss measured is not a loss of 0";
}

// The allocators' peaks (a CUDA run's) get a column beside the accounted peak and a JSON field;
// a CPU run, which has none, shows neither.
TEST(Executor, AllocatorPeaksAreShownOnlyWhenMeasured) {
  RunReport r = run(small_config(1, 2, ScheduleKind::one_f_one_b));
  EXPECT_EQ(format_run_summary(r).find("alloc MiB"), std::string::npos);
  EXPECT_FALSE(run_to_json(r)["run"].contains("allocated_peak_bytes"));
  r.allocated_peak_bytes = {3.0 * 1024 * 1024, 12.5 * 1024 * 1024};
  const std::string summary = format_run_summary(r);
  ASSERT_NE(summary.find("alloc MiB"), std::string::npos) << summary;
  EXPECT_NE(summary.find("      3.00\n"), std::string::npos) << summary;
  EXPECT_NE(summary.find("     12.50\n"), std::string::npos) << summary;
  EXPECT_EQ(run_to_json(r)["run"]["allocated_peak_bytes"][1].get<double>(), 12.5 * 1024 * 1024);
}

}  // namespace
}  // namespace trainsim::runtime
