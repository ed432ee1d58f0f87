// The CPU executor runs the schedule for real. Properties checked here:
//  * hybrid parallelism is exact: in FP32, any (data, pipeline) layout and schedule trains
//    the same model as one rank, to FP32 rounding;
//  * the incident's mechanisms: FP16 with too high a static scale gives inf gradients;
//    local overflow checks let ranks disagree and replicas drift; a global check keeps
//    them identical;
//  * checkpoint + resume and reruns with the same seed are bitwise identical;
//  * the measured Timeline and memory accounting obey the schedule's rules.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <thread>

#include "core/metrics.h"
#include "sim/simulator.h"
#include "runtime/cpu/core_account.h"
#include "runtime/cpu/core_gate.h"
#include "runtime/cpu/cpu_engine.h"
#include "runtime/loop/run_report.h"
#include "core/diagnostics.h"
#include "runtime/runtime_plan.h"
#include "sim/cost/memory_model.h"
#include "runtime/loop/run_loop.h"
#include "tests/runtime/replay_expectations.h"
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

// A (dp x pp) layout with vpp virtual stages under `schedule`.
struct Layout {
  int dp, pp, vpp;
  ScheduleKind schedule;
};

std::vector<double> losses(const RunReport& r) {
  std::vector<double> l;
  for (const auto& s : r.steps) l.push_back(s.loss);
  return l;
}

// Every step of `r` against the one-rank `reference`: the loss to `relative`, the gradient norm
// to 1e-4, replicas bit-identical.
void expect_trains_like(const RunReport& r, const RunReport& reference, double relative) {
  ASSERT_FALSE(r.failure) << r.failure->message;
  ASSERT_EQ(r.steps.size(), reference.steps.size());
  for (std::size_t i = 0; i < r.steps.size(); ++i) {
    EXPECT_NEAR(r.steps[i].loss, reference.steps[i].loss, relative * std::fabs(reference.steps[i].loss))
        << "step " << i + 1;
    EXPECT_NEAR(r.steps[i].grad_norm, reference.steps[i].grad_norm, 1e-4 * reference.steps[i].grad_norm);
    EXPECT_EQ(r.steps[i].replica_drift, 0.0) << "replicas hold bit-identical weights";
  }
}

TEST(Executor, HybridParallelismMatchesOneRankInFp32) {
  const RunReport reference = run(small_config(1, 1, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(reference.failure) << reference.failure->message;
  ASSERT_EQ(reference.steps.size(), 3u);
  // Training happens: the loss moves.
  EXPECT_NE(reference.steps[0].loss, reference.steps[2].loss);

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
    // Same samples, same weights, same updates: only the order of FP32 sums differs.
    expect_trains_like(r, reference, 2e-5);
  }
}

// Interleaving in groups of n micro-batches a chunk (Megatron-Core's
// microbatch_group_size_per_vp_stage), micro-batches that are not a multiple of the stages
// among them, trains the one-rank model to FP32 rounding as the default groups do.
TEST(Executor, InterleavedGroupsOfMicroBatchesMatchOneRankInFp32) {
  struct G {
    int dp, pp, n, global_batch;
  };
  for (const G g : {G{1, 2, 3, 8}, G{1, 2, 8, 8}, G{2, 2, 4, 8}, G{1, 4, 8, 8}, G{1, 4, 6, 6}}) {
    SCOPED_TRACE(::testing::Message() << "dp " << g.dp << " pp " << g.pp << " n " << g.n << " batch " << g.global_batch);
    ScenarioConfig one = small_config(1, 1, ScheduleKind::one_f_one_b);
    one.training.global_batch_size = g.global_batch;
    const RunReport reference = run(one);
    ASSERT_FALSE(reference.failure) << reference.failure->message;
    ScenarioConfig c = small_config(g.dp, g.pp, ScheduleKind::interleaved_1f1b, 2);
    c.training.global_batch_size = g.global_batch;
    c.parallelism.microbatch_group_size = g.n;
    const RunReport r = run(c);
    EXPECT_EQ(r.runtime_plan.plan.microbatch_group, g.n);
    expect_trains_like(r, reference, 2e-5);
  }
}

// A runtime model whose layers the chunks do not divide is split by the plan's own rule
// (default_layers_per_virtual_stage: balanced by forward FLOPs, the first or the last chunk left
// empty where that balances the ranks), as the full-size model is, and trains the one-rank model
// to FP32 rounding.
TEST(Executor, UnevenSplitsOfTheRuntimeModelMatchOneRankInFp32) {
  struct U {
    int pp, vpp, layers, global_batch;
    ScheduleKind schedule;
  };
  bool an_empty_chunk = false;
  for (const U u : {U{3, 1, 8, 6, ScheduleKind::one_f_one_b}, U{3, 3, 8, 6, ScheduleKind::interleaved_1f1b},
                    U{4, 3, 10, 8, ScheduleKind::interleaved_1f1b}, U{2, 1, 3, 8, ScheduleKind::zb_h1}}) {
    SCOPED_TRACE(::testing::Message() << "pp " << u.pp << " v " << u.vpp << " layers " << u.layers);
    ScenarioConfig one = small_config(1, 1, ScheduleKind::one_f_one_b);
    one.runtime.num_layers = u.layers;
    one.training.global_batch_size = u.global_batch;
    const RunReport reference = run(one);
    ASSERT_FALSE(reference.failure) << reference.failure->message;
    ScenarioConfig c = small_config(1, u.pp, u.schedule, u.vpp);
    c.runtime.num_layers = u.layers;
    c.training.global_batch_size = u.global_batch;
    const RunReport r = run(c);
    const std::vector<int>& split = r.runtime_plan.plan.layers_per_virtual_stage;
    EXPECT_EQ(split, default_layers_per_virtual_stage(r.runtime_plan.plan.config.model, u.pp, u.vpp));
    EXPECT_FALSE(is_even_split(split));
    an_empty_chunk = an_empty_chunk || split.front() == 0 || split.back() == 0;
    expect_trains_like(r, reference, 2e-5);
  }
  EXPECT_TRUE(an_empty_chunk) << "no case ran a chunk without layers";
}

// Tensor parallelism (and sequence parallelism) is exact too: every dp x pp x tp layout up to 2
// each, under every schedule, trains the one-rank model to FP32 rounding. The shards' sums run in
// another order than one rank's (the row-parallel products' partial sums, the cross-entropy's
// sums over the vocabulary, the norms' partial gradients under SP), so the losses agree to a unit
// or two of FP32 rounding (seen: 6e-8 on a loss of 4, 1.5e-8 relative); the bound is 1e-6.
TEST(Executor, TensorParallelMatchesOneRankInFp32) {
  const RunReport reference = run(small_config(1, 1, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(reference.failure) << reference.failure->message;
  const Layout layouts[] = {
      {1, 1, 1, ScheduleKind::one_f_one_b},      {2, 1, 1, ScheduleKind::one_f_one_b},
      {1, 2, 1, ScheduleKind::gpipe},            {1, 2, 1, ScheduleKind::one_f_one_b},
      {2, 2, 1, ScheduleKind::one_f_one_b},      {1, 2, 2, ScheduleKind::interleaved_1f1b},
      {2, 2, 2, ScheduleKind::interleaved_1f1b}, {1, 2, 1, ScheduleKind::zb_h1},
      {2, 2, 1, ScheduleKind::zb_h1},            {2, 2, 1, ScheduleKind::gpipe},
  };
  for (const Layout& l : layouts)
    for (const bool sp : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "dp " << l.dp << " pp " << l.pp << " tp 2 v " << l.vpp << " "
                                        << schedule_name(l.schedule) << (sp ? " sequence parallel" : ""));
      ScenarioConfig c = small_config(l.dp, l.pp, l.schedule, l.vpp);
      c.parallelism.tensor_parallel_size = 2;
      c.parallelism.sequence_parallel = sp;
      const RunReport r = run(c);
      expect_trains_like(r, reference, 1e-6);
      for (const StepRecord& step : r.steps)
        EXPECT_EQ(step.ranks.size(), static_cast<std::size_t>(2 * l.dp * l.pp)) << "a rank per shard";
      // Every rank ran with its coordinates; the result has a rank per (dp, pp) cell.
      ASSERT_EQ(r.executed_ranks.size(), static_cast<std::size_t>(2 * l.dp * l.pp));
      for (const ExecutedRank& e : r.executed_ranks) {
        EXPECT_EQ(e.rank, e.tp + 2 * (e.dp + l.dp * e.pp)) << "Megatron's order, tensor parallelism innermost";
        EXPECT_EQ(e.schedule_rank, e.pp * l.dp + e.dp);
      }
      EXPECT_EQ(r.result.ranks.size(), static_cast<std::size_t>(l.dp * l.pp));
      // run --json lists them with their coordinates.
      const auto executed = run_to_json(r)["run"]["executed_ranks"];
      ASSERT_EQ(executed.size(), r.executed_ranks.size());
      EXPECT_EQ(executed.back()["tp"].get<int>(), 1);
      EXPECT_EQ(executed.back()["pp"].get<int>(), l.pp - 1);
      EXPECT_EQ(executed.back()["dp"].get<int>(), l.dp - 1);
    }
}

// Context parallelism is exact too (runtime/model/stage_layout.h): each rank holds two chunks of
// every sequence, embeds them at their own positions, attends its queries over every rank's keys
// and values (gathered), and the keys' gradients are reduce-scattered back; its loss is the mean
// over its tokens and the gradients are averaged over dp x cp. In FP32 the sums run in another
// order than one rank's (a weight gradient's rows split over the ranks, a key's gradient summed
// from each rank's queries), so the losses agree to FP32 rounding. Every schedule and every
// parallel dimension beside it, ZeRO included.
TEST(Executor, ContextParallelMatchesOneRankInFp32) {
  const RunReport reference = run(small_config(1, 1, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(reference.failure) << reference.failure->message;
  struct CpLayout {
    Layout layout;
    int cp, tp;
    bool sp;
    int zero;
  };
  const CpLayout layouts[] = {
      {{1, 1, 1, ScheduleKind::one_f_one_b}, 2, 1, false, 0},
      {{1, 1, 1, ScheduleKind::one_f_one_b}, 4, 1, false, 0},
      {{2, 1, 1, ScheduleKind::one_f_one_b}, 2, 1, false, 0},
      {{1, 2, 1, ScheduleKind::one_f_one_b}, 2, 1, false, 0},
      {{1, 2, 1, ScheduleKind::gpipe}, 2, 1, false, 0},
      {{1, 2, 2, ScheduleKind::interleaved_1f1b}, 2, 1, false, 0},
      {{1, 2, 1, ScheduleKind::zb_h1}, 2, 1, false, 0},
      {{1, 1, 1, ScheduleKind::one_f_one_b}, 2, 2, false, 0},
      {{1, 2, 1, ScheduleKind::one_f_one_b}, 2, 2, true, 0},
      {{2, 1, 1, ScheduleKind::one_f_one_b}, 2, 1, false, 1},
      {{1, 1, 1, ScheduleKind::one_f_one_b}, 2, 1, false, 3},
  };
  for (const CpLayout& l : layouts) {
    const Layout& g = l.layout;
    SCOPED_TRACE(::testing::Message() << "dp " << g.dp << " pp " << g.pp << " v " << g.vpp << " cp " << l.cp << " tp "
                                      << l.tp << (l.sp ? " sequence parallel" : "") << " zero " << l.zero << " "
                                      << schedule_name(g.schedule));
    ScenarioConfig c = small_config(g.dp, g.pp, g.schedule, g.vpp);
    c.parallelism.context_parallel_size = l.cp;
    c.parallelism.tensor_parallel_size = l.tp;
    c.parallelism.sequence_parallel = l.sp;
    c.parallelism.zero_stage = l.zero;
    const RunReport r = run(c);
    expect_trains_like(r, reference, 1e-6);
    const int ranks = g.dp * g.pp * l.cp * l.tp;
    ASSERT_EQ(r.executed_ranks.size(), static_cast<std::size_t>(ranks));
    for (const ExecutedRank& e : r.executed_ranks) {
      EXPECT_EQ(e.rank, e.tp + l.tp * (e.cp + l.cp * (e.dp + g.dp * e.pp)))
          << "Megatron's order: tensor, context, data, pipeline";
      EXPECT_EQ(e.schedule_rank, e.pp * g.dp + e.dp);
    }
    EXPECT_EQ(r.result.ranks.size(), static_cast<std::size_t>(g.dp * g.pp)) << "a rank per (dp, pp) cell";
    for (const StepRecord& step : r.steps)
      EXPECT_EQ(step.replica_checksums.size(), static_cast<std::size_t>(g.dp * l.cp)) << "a copy per (dp, cp)";
    EXPECT_EQ(run_to_json(r)["run"]["executed_ranks"].back()["cp"].get<int>(), l.cp - 1);
  }
}

// Low precision. A shard rounds where one rank does not: each row-parallel product's partial sum
// to the format, the ring's sum of the tp partials, the bias added after it (three roundings where
// one rank rounds b + xW^T once), and under SP the norms' gradients are summed from rounded halves.
// Each is one rounding of relative size u (bf16 u = 2^-8, fp16 2^-11) on a tensor the one-rank run
// also rounds ten-odd times per block, so a TP run is another low-precision run of the same FP32
// trajectory, no farther from it than the one-rank run is. Bounds, per step's loss L:
//  * step 1 (identical weights, only the forward's roundings differ) and every step after:
//    |L_tp - L_one| <= u L — one rounding of every logit the loss reads;
//  * |L_tp - L_fp32| <= 2 max over steps |L_one - L_fp32| — no farther from FP32 than two of
//    the one-rank run's own low-precision errors.
// Seen over 6 steps: bf16 |L_tp - L_one| 1.2e-4 L (u = 3.9e-3), fp16 1.0e-4 L (u = 4.9e-4); from
// FP32: bf16 1.9e-4 against the one-rank run's 2.5e-4, fp16 3.3e-5 against 7.9e-5.
TEST(Executor, TensorParallelLowPrecisionStaysWithinTheFormatsError) {
  for (const DType dt : {DType::bf16, DType::fp16}) {
    const double u = dt == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    ScenarioConfig c = small_config(1, 1, ScheduleKind::one_f_one_b);
    c.runtime.steps = 6;
    const RunReport fp32 = run(c);
    c.precision.compute = dt;
    if (dt == DType::fp16) {
      c.precision.loss_scaling.mode = LossScalingMode::static_scale;
      c.precision.loss_scaling.initial_scale = 1024;
    }
    const RunReport one = run(c);
    ASSERT_FALSE(one.failure);
    double one_from_fp32 = 0;
    for (std::size_t i = 0; i < one.steps.size(); ++i)
      one_from_fp32 = std::max(one_from_fp32, std::fabs(one.steps[i].loss - fp32.steps[i].loss));
    for (const auto& [dp, pp] : {std::pair{1, 1}, std::pair{2, 2}})
      for (const bool sp : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " dp " << dp << " pp " << pp << " tp 2"
                                          << (sp ? " sequence parallel" : ""));
        ScenarioConfig t = c;
        t.parallelism.data_parallel_size = dp;
        t.parallelism.pipeline_parallel_size = pp;
        t.parallelism.tensor_parallel_size = 2;
        t.parallelism.sequence_parallel = sp;
        const RunReport r = run(t);
        ASSERT_FALSE(r.failure) << r.failure->message;
        for (std::size_t i = 0; i < r.steps.size(); ++i) {
          EXPECT_NEAR(r.steps[i].loss, one.steps[i].loss, u * one.steps[i].loss) << "step " << i + 1;
          EXPECT_NEAR(r.steps[i].loss, fp32.steps[i].loss, 2 * one_from_fp32) << "step " << i + 1;
        }
      }
  }
}

// Every rank `r` ran against the memory model's prediction for its schedule rank: weights,
// gradients and moments exactly, the total within 3%; then also(measured, predicted, one-rank's
// `whole`) for what a test adds.
template <class Also>
void expect_memory_follows_the_model(const RunReport& r, const RunReport& whole, Also&& also) {
  const auto predicted = MemoryModel(r.runtime_plan.plan).peak_per_rank(*r.schedule);
  for (const ExecutedRank& e : r.executed_ranks) {
    SCOPED_TRACE(::testing::Message() << "rank " << e.rank);
    const MemoryBreakdown& m = e.memory;
    const MemoryBreakdown& p = predicted[static_cast<std::size_t>(e.schedule_rank)];
    EXPECT_EQ(m.weights, p.weights);
    EXPECT_EQ(m.gradients, p.gradients);
    EXPECT_EQ(m.optimizer, p.optimizer);
    EXPECT_NEAR(m.total(), p.total(), 0.03 * m.total());
    also(m, p, whole.memory[static_cast<std::size_t>(e.schedule_rank)]);
  }
}

// What a shard holds: 1/tp of the sharded weights (with their gradients and Adam's moments) plus
// the replicated norms, biases and position embedding — the simulator's count exactly
// (Plan::shard_params); its activations as the memory model counts them (per layer 4 e·sbh
// replicated, 1/tp of them under SP, the rest 1/tp; a split backward's kept gradients likewise),
// which leaves out only the stage's input, the norms' statistics and the token ids: within 3%.
TEST(Executor, TensorParallelMemoryPerRankFollowsTheModel) {
  for (const ScheduleKind sched : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zb_h1}) {
    const RunReport whole = run(small_config(1, 2, sched));
    ASSERT_FALSE(whole.failure);
    for (const bool sp : {false, true}) {
      SCOPED_TRACE(::testing::Message() << schedule_name(sched) << " pp 2 tp 2" << (sp ? " sequence parallel" : ""));
      ScenarioConfig c = small_config(1, 2, sched);
      c.parallelism.tensor_parallel_size = 2;
      c.parallelism.sequence_parallel = sp;
      const RunReport r = run(c);
      ASSERT_FALSE(r.failure) << r.failure->message;
      expect_memory_follows_the_model(r, whole, [](const MemoryBreakdown& m, const MemoryBreakdown&,
                                                   const MemoryBreakdown& one) {
        EXPECT_GT(m.weights, one.weights / 2) << "the replicated parameters on top of half";
        EXPECT_LT(m.weights, 0.53 * one.weights) << "about 1/tp of the stage's weights";
        EXPECT_LT(m.activations, 0.7 * one.activations) << "activations split too";
      });
    }
  }
}

// What a context-parallel rank holds: the whole stage's weights, gradients and moments (a copy, as
// a replica's: the simulator's count exactly); activations of its 1/cp of the tokens, its queries'
// scores over every key (B a s/cp s), and while a backward runs every rank's keys and values and
// their gradients (the memory model's transient): within 3% of the model, as tensor parallelism.
TEST(Executor, ContextParallelMemoryPerRankFollowsTheModel) {
  for (const ScheduleKind sched : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zb_h1})
    for (const Recompute rc : {Recompute::none, Recompute::full}) {
      SCOPED_TRACE(::testing::Message() << schedule_name(sched) << " pp 2 cp 2, recompute " << recompute_name(rc));
      ScenarioConfig c = small_config(1, 2, sched);
      c.training.activation_recompute = rc;
      const RunReport whole = run(c);
      ASSERT_FALSE(whole.failure);
      c.parallelism.context_parallel_size = 2;
      const RunReport r = run(c);
      ASSERT_FALSE(r.failure) << r.failure->message;
      expect_memory_follows_the_model(r, whole, [](const MemoryBreakdown& m, const MemoryBreakdown& p,
                                                   const MemoryBreakdown& one) {
        EXPECT_EQ(m.weights, one.weights) << "a whole copy";
        EXPECT_NEAR(m.activations, p.activations, 0.03 * p.activations);
        EXPECT_LT(m.activations, 0.75 * one.activations) << "activations split too";
      });
    }
}

// Recompute rebuilds bitwise what the forward made (the same code on the same inputs), so every
// gradient, and the training, is bitwise that of keeping everything; only memory changes.
TEST(Executor, RecomputeTrainsBitwiseAsKeepingEverything) {
  for (const ScheduleKind schedule : {ScheduleKind::one_f_one_b, ScheduleKind::zb_h1}) {
    ScenarioConfig c = small_config(1, 2, schedule);
    c.precision.compute = DType::bf16;  // rounding inside the rebuilt layers too
    const RunReport kept = run(c);
    ASSERT_FALSE(kept.failure) << kept.failure->message;
    for (const Recompute r : {Recompute::selective, Recompute::selective_op, Recompute::full}) {
      SCOPED_TRACE(::testing::Message() << schedule_name(schedule) << " recompute " << recompute_name(r));
      c.training.activation_recompute = r;
      const RunReport again = run(c);
      ASSERT_FALSE(again.failure) << again.failure->message;
      EXPECT_TRUE(again.runtime_plan.notes.empty() || again.runtime_plan.notes[0].find("recompute") == std::string::npos);
      EXPECT_EQ(losses(again), losses(kept));
      for (std::size_t i = 0; i < again.steps.size(); ++i) {
        EXPECT_EQ(again.steps[i].grad_norm, kept.steps[i].grad_norm);
        EXPECT_EQ(again.steps[i].replica_checksums, kept.steps[i].replica_checksums);
      }
      for (std::size_t rank = 0; rank < again.memory.size(); ++rank)
        EXPECT_LT(again.memory[rank].activations, kept.memory[rank].activations) << "rank " << rank;
    }
    c.training.activation_recompute = Recompute::none;
  }
}

// A plan the runtime cannot shard is refused before anything runs, saying which number does not
// divide which (heads, vocabulary, width, and the sequence under sequence parallelism).
TEST(Executor, TensorParallelRefusesPlansThatDoNotShard) {
  auto refusal = [](ScenarioConfig c) -> std::string {
    try {
      make_runtime_plan(c);
    } catch (const ScenarioError& e) {
      std::string all;
      for (const Diagnostic& d : e.diagnostics()) all += d.key_path + ": " + d.message + "\n";
      return all;
    }
    return "";
  };
  ScenarioConfig c = small_config(1, 1, ScheduleKind::one_f_one_b);  // 2 heads, width 32, vocab 64, seq 16
  c.parallelism.tensor_parallel_size = 4;
  EXPECT_NE(refusal(c).find("num_attention_heads(2) is not divisible by tensor_parallel_size(4)"), std::string::npos)
      << refusal(c);
  c.parallelism.tensor_parallel_size = 2;
  c.runtime.vocab_size = 65;
  EXPECT_NE(refusal(c).find("vocab_size(65) is not divisible by tensor_parallel_size(2)"), std::string::npos)
      << refusal(c);
  c.runtime.vocab_size = 64;
  c.runtime.seq_length = 15;
  EXPECT_EQ(refusal(c), "") << "without sequence parallelism the rows need not divide";
  c.parallelism.sequence_parallel = true;
  EXPECT_NE(refusal(c).find("seq_length(15) is not divisible by tensor_parallel_size(2) under sequence_parallel"),
            std::string::npos)
      << refusal(c);
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

// A run its numerics end at step 2, asked for four timed steps, is replayed from the state before
// step 1, bit for bit (tests/runtime/replay_expectations.h).
TEST(Executor, ARunItsNumericsEndReplaysBitwiseFromItsFirstState) {
  RunOptions o;
  o.timed_steps_at_least = 4;
  testing::expect_bitwise_replays(run(testing::nan_at_step_two(small_config(2, 2, ScheduleKind::one_f_one_b)), o));
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

// Each rank's blocks are timed inside its compute ops: per block, more than nothing, and all its
// blocks together (every chunk's, interleaved) within the time its forward and backward ops took
// (which add the embedding, the head and the stage's passes around them). Under the zero-bubble
// split and recompute too.
TEST(Executor, BlocksAreTimedInsideTheComputeOps) {
  for (const ScheduleKind schedule : {ScheduleKind::gpipe, ScheduleKind::zb_h1, ScheduleKind::interleaved_1f1b}) {
    ScenarioConfig c = small_config(1, 2, schedule, schedule == ScheduleKind::interleaved_1f1b ? 2 : 1);
    c.training.activation_recompute = schedule == ScheduleKind::gpipe ? Recompute::full
                                                                      : Recompute::none;
    const RunReport r = run(c);
    ASSERT_FALSE(r.failure) << r.failure->message;
    EXPECT_EQ(r.runtime_plan.plan.vpp, schedule == ScheduleKind::interleaved_1f1b ? 2 : 1);
    ASSERT_EQ(r.layer_seconds.size(), r.executed_ranks.size());
    for (const ExecutedRank& e : r.executed_ranks) {
      const double per_block = r.layer_seconds[static_cast<std::size_t>(e.rank)];
      EXPECT_GT(per_block, 0) << "rank " << e.rank;
      const auto& ops = r.schedule->ranks[static_cast<std::size_t>(e.schedule_rank)].ops;
      double compute = 0;
      for (std::size_t i = 0; i < ops.size(); ++i)
        if (is_compute(ops[i].kind) && ops[i].kind != OpKind::OptimizerStep) {
          const OpTiming& t = r.timeline.ops[static_cast<std::size_t>(e.schedule_rank)][i];
          compute += ticks_to_seconds(t.end - t.start);
        }
      const Plan& plan = r.runtime_plan.plan;
      int blocks = 0;
      for (int vs = 0; vs < plan.num_virtual_stages(); ++vs)
        if (plan.rank_stage_of_virtual(vs) == e.pp) blocks += plan.layers_per_virtual_stage[static_cast<std::size_t>(vs)];
      EXPECT_GT(blocks, 0);
      EXPECT_LT(per_block * blocks, compute) << "rank " << e.rank;
    }
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

// run_first_on_core: granted, the thread runs SCHED_FIFO at the lowest real-time priority;
// refused (no CAP_SYS_NICE, RLIMIT_RTPRIO 0), it stays as it was. may_run_first_on_core says
// which, asking from a thread of its own.
TEST(CoreGate, RunFirstOnCoreIsRealTimeWhereGrantedAndUnchangedWhereNot) {
  const bool may = may_run_first_on_core();
  std::thread([may] {
    const int before = sched_getscheduler(0);
    const bool granted = run_first_on_core(pthread_self());
    EXPECT_EQ(granted, may);
    if (granted) {
      EXPECT_EQ(sched_getscheduler(0), SCHED_FIFO);
      sched_param p{};
      ASSERT_EQ(sched_getparam(0, &p), 0);
      EXPECT_EQ(p.sched_priority, sched_get_priority_min(SCHED_FIFO));
    } else {
      EXPECT_EQ(sched_getscheduler(0), before);
    }
  }).join();
  EXPECT_NE(sched_getscheduler(0), SCHED_FIFO) << "the asking thread's policy leaked to the caller";
}

// Where ranks share cores, a compute thread outside its turns runs first on its core and inside
// them is a normal thread (CoreGate's waiting_first): releasing a turn wakes the next turn's thread
// on the same core, and the releaser, a few microseconds from its next wait, must get there before
// that thread's whole op. One core, two cells; the next turn spins 100 ms.
TEST(CoreGate, ThreadsOutsideTheirTurnsRunFirstAndTurnsRunAsNormalThreads) {
  if (!may_run_first_on_core()) GTEST_SKIP() << "SCHED_FIFO is refused here (no CAP_SYS_NICE / RLIMIT_RTPRIO)";
  CoreGate gate(1, 2, 1, {CoreTurn{0, 0, 0}, CoreTurn{1, 0, 0}}, std::chrono::milliseconds(10'000), true);
  gate.reset();
  using Clock = std::chrono::steady_clock;
  Clock::time_point released_on{}, next_started{};
  int outside = -1, inside = -1, after = -1;
  std::atomic<bool> first_holds{false};
  std::thread next([&] {
    gate.enrol(1, 0);
    gate.wait_first();
    while (!first_holds) std::this_thread::sleep_for(std::chrono::microseconds(100));
    CoreGate::Hold turn(&gate, CoreTurn{1, 0, 0}, 0);
    next_started = Clock::now();
    const auto until = next_started + std::chrono::milliseconds(100);
    while (Clock::now() < until) {
    }
  });
  std::thread first([&] {
    gate.enrol(0, 0);
    gate.wait_first();
    outside = sched_getscheduler(0);
    {
      CoreGate::Hold turn(&gate, CoreTurn{0, 0, 0}, 0);
      inside = sched_getscheduler(0);
      first_holds = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the next turn's thread waits in the gate
    }
    released_on = Clock::now();  // the books after a turn, on the core the next turn was woken on
    after = sched_getscheduler(0);
  });
  first.join();
  next.join();
  EXPECT_EQ(outside, SCHED_FIFO);
  EXPECT_EQ(inside, SCHED_OTHER);
  EXPECT_EQ(after, SCHED_FIFO);
  EXPECT_LT(released_on, next_started) << "the next turn's op ran before the releaser's books: it took the core from it";
}

// A pinned rank's core account (runtime/cpu/core_account.h): a thread that is not the rank's,
// spinning on the rank's core, is other work (all of its CPU time in the window, and whatever else
// the machine ran there: other tests in parallel); the same thread counted as the rank's own is not.
TEST(CoreAccount, AnotherThreadOnTheCoreIsOtherWorkAndTheRanksOwnIsNot) {
  if (!cpu_idle_us(0)) GTEST_SKIP() << "this kernel publishes no cpuidle residency";
  cpu_set_t was;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(was), &was), 0);
  constexpr std::int64_t kWindowNs = 300'000'000, kSlackNs = 2'000'000;
  pin_to_core(pthread_self(), 0);
  std::atomic<bool> stop{false};
  std::int64_t stranger_end = 0;  // its CPU time as it ends, read by itself
  std::thread stranger([&] {
    pin_to_core(pthread_self(), 0);
    while (!stop.load(std::memory_order_relaxed)) {
    }
    stranger_end = thread_cpu_ns();
  });
  clockid_t clock{};  // EXPECT, not ASSERT, while the stranger runs: it must be joined
  EXPECT_EQ(pthread_getcpuclockid(stranger.native_handle(), &clock), 0);
  CoreAccount account;
  EXPECT_TRUE(account.open(0));
  timespec t{};
  clock_gettime(clock, &t);
  const std::int64_t before = static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec, t0 = wall_ns();
  while (wall_ns() - t0 < kWindowNs) {
  }
  stop = true;
  stranger.join();  // it runs nothing more: all it ran in the window is known
  const std::int64_t ran = stranger_end - before;
  const std::optional<CoreAccount::Window> window = account.close();
  pthread_setaffinity_np(pthread_self(), sizeof(was), &was);
  ASSERT_TRUE(window);
  EXPECT_GE(window->wall, kWindowNs);
  EXPECT_GE(window->own, kWindowNs / 10) << "this thread shared the core";
  EXPECT_GE(ran, kWindowNs / 10) << "the stranger shared the core";
  const std::int64_t other = window->other_work(0), own = window->other_work(ran);
  EXPECT_GE(other, ran - kSlackNs) << "all the stranger's time is other work";
  EXPECT_LE(other, window->wall - window->own) << "this thread's is not";
  EXPECT_LE(own, std::max<std::int64_t>(0, other - ran) + kSlackNs) << "counted as the rank's, the stranger's is not";
}

// Where the process's threads are not pinned: another process spinning beside this one is other
// work (all its CPU time in the window), this process's own threads are not.
TEST(HostAccount, AnotherProcessIsOtherWorkAndThisOnesThreadsAreNot) {
  if (!cpu_idle_us(0)) GTEST_SKIP() << "this kernel publishes no cpuidle residency";
  constexpr std::int64_t kWindowNs = 300'000'000, kSlackNs = 3'000'000;
  HostAccount account;
  ASSERT_TRUE(account.open());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the other process: spin for the window, then leave without running atexit
    const std::int64_t t0 = wall_ns();
    while (wall_ns() - t0 < kWindowNs) {
    }
    _exit(0);
  }
  std::atomic<bool> stop{false};
  std::thread own([&] {  // this process's own second thread: not other work
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  const std::int64_t t0 = wall_ns();
  while (wall_ns() - t0 < kWindowNs) {
  }
  stop = true;
  own.join();
  int status = 0;
  rusage usage{};
  ASSERT_EQ(wait4(child, &status, 0, &usage), child);
  const std::optional<std::int64_t> other = account.other_work_ns();
  ASSERT_TRUE(other);
  const std::int64_t child_cpu = (static_cast<std::int64_t>(usage.ru_utime.tv_sec) + usage.ru_stime.tv_sec) *
                                     1'000'000'000 +
                                 (static_cast<std::int64_t>(usage.ru_utime.tv_usec) + usage.ru_stime.tv_usec) * 1000;
  EXPECT_GE(child_cpu, kWindowNs / 10) << "the other process ran";
  EXPECT_GE(*other, child_cpu - kSlackNs) << "all its time is other work";
  // This process ran two spinning threads on the cores for the window: the cores' busy time less
  // those is at most what the other process and the rest of the machine took.
  EXPECT_LE(*other, static_cast<std::int64_t>(std::thread::hardware_concurrency()) * (wall_ns() - t0));
}

// Ranks say, per step, what the host took from their cores: pinned one per core, each its own;
// sharing the cores, the host's per core.
TEST(Executor, RanksSayWhatTheHostTookFromTheirCores) {
  if (std::thread::hardware_concurrency() < 2 || !cpu_idle_us(0) || !cpu_idle_us(1))
    GTEST_SKIP() << "needs two cores whose idle time the kernel publishes";
  RunOptions pinned;
  pinned.pin_threads = true;
  const ScenarioConfig c = small_config(1, 2, ScheduleKind::one_f_one_b);
  pinned.synthetic_data = c.runtime.data_synthetic;
  const RunReport r = run_cpu(make_runtime_plan(c), pinned);
  ASSERT_FALSE(r.failure) << r.failure->message;
  ASSERT_TRUE(r.threads_pinned);
  for (const StepRecord& s : r.steps) {
    EXPECT_GE(s.foreign_seconds, 0) << "step " << s.step;
    EXPECT_LE(s.foreign_seconds, s.step_time_s) << "step " << s.step;
  }
  const RunReport shared = run(small_config(2, 4, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(shared.failure) << shared.failure->message;
  ASSERT_FALSE(shared.threads_pinned);
  for (const StepRecord& s : shared.steps) {
    EXPECT_GE(s.foreign_seconds, 0) << "step " << s.step;
    EXPECT_LE(s.foreign_seconds, s.step_time_s) << "step " << s.step;
  }
}

// The communication threads run first on their cores (run_first_on_core) where their collectives
// run beside the compute (pinned, overlap_grad_reduce) or the ranks share the cores (and there the
// compute threads outside their turns too), and the run says whether the system granted it; pinned
// ranks whose collectives wait for the passes do not ask.
TEST(Executor, TheRunSaysWhetherItsCommunicationThreadsRunFirst) {
  const bool granted = may_run_first_on_core();
  const std::string first = "communication threads run first on their cores",
                    shared_first = "communication threads, and compute threads outside their turns, run first on their cores",
                    refused = "communication threads at normal priority";
  auto says = [](const RunReport& r, const std::string& what) { return r.execution.find(what) != std::string::npos; };
  const RunReport shared = run(small_config(2, 4, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(shared.failure) << shared.failure->message;
  EXPECT_TRUE(says(shared, granted ? shared_first : refused)) << shared.execution;
  // Under tensor parallelism a turn's shards poll for each other: its compute threads stay normal.
  ScenarioConfig tp = small_config(2, 2, ScheduleKind::one_f_one_b);
  tp.parallelism.tensor_parallel_size = 2;
  tp.cluster.num_gpus = 4;
  const RunReport shards = run(tp);
  ASSERT_FALSE(shards.failure) << shards.failure->message;
  EXPECT_FALSE(says(shards, shared_first)) << shards.execution;
  EXPECT_TRUE(says(shards, granted ? first : refused)) << shards.execution;
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "pinned ranks need two cores";
  RunOptions pinned;
  pinned.pin_threads = true;
  ScenarioConfig c = small_config(2, 1, ScheduleKind::one_f_one_b);
  pinned.synthetic_data = c.runtime.data_synthetic;
  for (const bool overlap : {false, true}) {
    c.communication.overlap_grad_reduce = overlap;
    const RunReport r = run_cpu(make_runtime_plan(c), pinned);
    ASSERT_FALSE(r.failure) << r.failure->message;
    ASSERT_TRUE(r.threads_pinned);
    if (overlap) {
      EXPECT_TRUE(says(r, granted ? first : refused)) << r.execution;
    } else {
      EXPECT_FALSE(says(r, first) || says(r, refused)) << r.execution;
    }
  }
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

TEST(Executor, RanksThatShareCoresNeverRunMoreOpsThanCores) {
  // A turn's op ends before its core goes to the next turn: its measured end precedes the next
  // op's start of work on that core. Read after the release, the end fell wherever the scheduler
  // let the releasing thread run again (the woken next turn takes the core at once), and the
  // measured step showed more ops working at once than there are cores. Each op works from the
  // end of its wait for a turn (OpTiming::waited) to its end; sends hold the core of the op before
  // them; the optimizer step takes its turns inside its op (not timed apart).
  const ScenarioConfig c = small_config(2, 4, ScheduleKind::gpipe);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const RunReport r = run(c);
    ASSERT_FALSE(r.failure);
    std::vector<std::pair<Tick, int>> edges;
    for (const RankProgram& p : r.schedule->ranks)
      for (std::size_t i = 0; i < p.ops.size(); ++i)
        if (is_compute(p.ops[i].kind) && p.ops[i].kind != OpKind::OptimizerStep) {
          const OpTiming& t = r.timeline.ops[static_cast<std::size_t>(p.rank)][i];
          edges.push_back({t.start + t.waited, +1});
          edges.push_back({t.end, -1});
        }
    std::sort(edges.begin(), edges.end());  // an end before a start at the same tick
    int working = 0, most = 0;
    for (const auto& [at, change] : edges) most = std::max(most, working += change);
    EXPECT_LE(most, host_cores()) << "attempt " << attempt;
  }
}

TEST(Executor, AMovedTurnIsHeldUntilItsLastHolderEnds) {
  // The CPU engine keeps a compute op's turn for the sends after it by moving its Hold: the move
  // must not give the core back. One core, two cells, first come first served.
  CoreGate gate(1, 2, 1, {}, std::chrono::milliseconds(10'000));
  gate.reset();
  std::optional<CoreGate::Hold> kept;
  {
    CoreGate::Hold op(&gate, CoreTurn{0, 0, 0}, 0);
    kept.emplace(std::move(op));
  }  // the op's own Hold ends here, moved from
  std::atomic<bool> got{false};
  std::thread other([&] {
    CoreGate::Hold next(&gate, CoreTurn{1, 0, 0}, 0);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(got) << "the core went to the next turn while the moved turn was held";
  kept.reset();
  other.join();
  EXPECT_TRUE(got);
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

// Failure paths (issue 18: the same on the CUDA engine, test_executor_cuda.cpp): a rank that
// raises ends the run at that step naming the rank and the op; a rank stuck before a collective
// makes its peers time out naming the rank they waited for, and the run ends, no hang.
TEST(Executor, ARankThatRaisesEndsTheRunNamingRankAndOp) {
  RunOptions o;
  o.steps = 3;
  o.fault.rank = 3;
  o.fault.step = 2;
  o.fault.kind = InjectedFault::Kind::raise;
  const RunReport r = run(small_config(2, 2, ScheduleKind::one_f_one_b), o);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->step, 2);
  const std::string& m = r.failure->message;
  EXPECT_NE(m.find("rank 3 failed at step 2"), std::string::npos) << m;
  EXPECT_NE(m.find("the injected failure"), std::string::npos) << m;
  // The op it raised at: its program's first op that is not a collective (stage 1: a receive).
  const RankProgram& prog = r.schedule->ranks[3];
  const auto first = std::find_if(prog.ops.begin(), prog.ops.end(), [](const Op& op) { return !is_collective(op.kind); });
  ASSERT_NE(first, prog.ops.end());
  EXPECT_NE(m.find(op_label(*first) + ": the injected failure"), std::string::npos) << "names the op: " << m;
  EXPECT_EQ(r.steps.size(), 1u) << "the step that failed has no record";
}

TEST(Executor, ARankStuckBeforeACollectiveTimesItsPeersOutNamingIt) {
  RunOptions o;
  o.steps = 2;
  o.comm_timeout = std::chrono::milliseconds(300);
  o.fault.rank = 1;
  o.fault.step = 1;
  o.fault.kind = InjectedFault::Kind::stall;
  o.fault.stall = std::chrono::milliseconds(1500);
  const auto t0 = std::chrono::steady_clock::now();
  const RunReport r = run(small_config(2, 1, ScheduleKind::one_f_one_b), o);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->step, 1);
  const std::string& m = r.failure->message;
  EXPECT_NE(m.find("waiting for rank 1"), std::string::npos) << m;
  EXPECT_NE(m.find("all_reduce"), std::string::npos) << m;
  EXPECT_LT(seconds, 30) << "ended, not hung";
}

}  // namespace
}  // namespace trainsim::runtime
