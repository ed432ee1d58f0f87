// ZeRO 1/2/3 and activation recompute, executed by the CPU engine (runtime/engine/zero.h,
// runtime/model/stage_model.h). Properties checked here:
//  * the shard layout: equal padded chunks per segment, collective buffers and shards round trip,
//    a tied embedding split over the pipeline is owned alike on both its stages;
//  * exactness: in FP32 every (data x pipeline x tensor) layout up to 2 x 2 x 2 (tensor parallel
//    with and without sequence parallelism), every ZeRO stage (and each
//    framework's way of running it), every recompute mode and every schedule trains the one-rank
//    model to FP32 rounding (relative 1e-5 in the loss); recompute alone is bitwise;
//  * BF16 and FP16 within the tolerances derived at BF16Fp16StayWithinTheirRounding;
//  * memory per rank: optimizer state ~1/dp under ZeRO-1, gradients too under ZeRO-2, weights too
//    under ZeRO-3, activations as recompute keeps them, and every rank's peak within 5% of the
//    simulator's prediction of the same plan;
//  * resuming a ZeRO run (tensor parallel or not) from a checkpoint of its shards is bitwise
//    identical.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include "runtime/checkpoint.h"
#include "runtime/cpu/cpu_engine.h"
#include "runtime/engine/zero.h"
#include "runtime/loop/run_loop.h"
#include "runtime/runtime_plan.h"
#include "sim/simulator.h"
#include "tests/runtime/runtime_test_config.h"

namespace trainsim::runtime {
namespace {

RunReport run(const ScenarioConfig& c, RunOptions opt = {}) {
  opt.synthetic_data = c.runtime.data_synthetic;
  opt.pin_threads = false;
  return run_cpu(make_runtime_plan(c), opt);
}

// ---------------------------------------------------------------------------------------
// The layout
// ---------------------------------------------------------------------------------------
TEST(ShardLayout, EqualPaddedChunksRoundTrip) {
  // 23 elements cut at 7 and 16 into segments of 7, 9 and 7, over 3 members: chunks 3, 3, 3.
  const ShardLayout l0(23, 3, 0, {7, 16}), l2(23, 3, 2, {16, 7});
  ASSERT_EQ(l0.segments().size(), 3u);
  EXPECT_EQ(l0.shard_size(), 9u);
  EXPECT_EQ(l2.shard_size(), 9u) << "every member's shard has the same size";
  std::vector<float> flat(23);
  std::iota(flat.begin(), flat.end(), 1.0f);
  // A group's buffer: member p's section holds its chunk of each segment, padded with zeros.
  const ShardGroup g = l0.group(7, 23);
  EXPECT_EQ(g.section, 6u);
  std::vector<float> buf(g.section * 3);
  l0.pack(g, flat, buf);
  const std::vector<float> expect = {8, 9, 10, 17, 18, 19, 11, 12, 13, 20, 21, 22, 14, 15, 16, 23, 0, 0};
  EXPECT_EQ(buf, expect);
  std::vector<float> back(23, -1.0f);
  l0.unpack(g, buf, back);
  for (std::size_t i = 7; i < 23; ++i) EXPECT_EQ(back[i], flat[i]);
  // Shards: every member's take, put back, rebuilds the flat buffer.
  std::vector<float> rebuilt(23, -1.0f);
  for (int p = 0; p < 3; ++p) {
    std::vector<float> shard(l0.shard_size());
    l0.take(p, flat, shard);
    l0.put(p, shard, rebuilt);
  }
  EXPECT_EQ(rebuilt, flat);
  EXPECT_THROW((void)l0.group(3, 16), std::logic_error) << "a group starts at a segment bound";
}

TEST(ShardLayout, TiedEmbeddingIsOwnedAlikeOnBothStages) {
  // Two stages of a tied model over two replicas: the embedding is the first stage's second to
  // last parameter and the last stage's first. Buckets cut each stage somewhere inside it.
  ScenarioConfig c = testing::tiny_training(2, 2, ScheduleKind::one_f_one_b);
  c.parallelism.zero_stage = 1;
  const RuntimePlan rp = make_runtime_plan(c);
  std::vector<StageModel> stage;
  for (int vs = 0; vs < 2; ++vs) stage.emplace_back(stage_spec(rp, vs));
  const ParamInfo first = stage[0].token_embedding(), last = stage[1].token_embedding();
  ASSERT_EQ(first.size, last.size);
  for (int p = 0; p < 2; ++p) {
    BucketRanges b0 = {{0, first.offset + first.size / 3}, {first.offset + first.size / 3, stage[0].gradients().size()}};
    BucketRanges b1 = {{0, last.size / 2}, {last.size / 2, stage[1].gradients().size()}};
    keep_embedding_whole(b0, first.offset, first.offset + first.size);
    keep_embedding_whole(b1, last.offset, last.offset + last.size);
    const ZeroChunk z0 = plan_zero_chunk(rp.plan, stage_spec(rp, 0), stage[0].params(), b0, first, 2, p);
    const ZeroChunk z1 = plan_zero_chunk(rp.plan, stage_spec(rp, 1), stage[1].params(), b1, last, 2, p);
    ASSERT_EQ(z0.tied.section, z1.tied.section);
    const auto own0 = z0.layout.shard_pieces(z0.tied, p), own1 = z1.layout.shard_pieces(z1.tied, p);
    ASSERT_EQ(own0.size(), 1u);
    ASSERT_EQ(own1.size(), 1u);
    EXPECT_EQ(own0[0].flat - first.offset, own1[0].flat - last.offset) << "member " << p << " owns the same rows";
    EXPECT_EQ(own0[0].count, own1[0].count);
  }
  // Buckets far smaller than the embedding put several bounds inside it, some of them starts of
  // buckets wholly inside: every one moves out (a bucket that kept its start inside cut the
  // embedding on one stage and not the other, and their sum's buffers disagreed in size).
  const std::size_t n0 = stage[0].gradients().size(), n1 = stage[1].gradients().size();
  const std::size_t step = std::max<std::size_t>(1, first.size / 5);
  auto cut = [&](std::size_t n) {
    BucketRanges b;
    for (std::size_t at = 0; at < n; at += step) b.emplace_back(at, std::min(n, at + step));
    return b;
  };
  BucketRanges b0 = cut(n0), b1 = cut(n1);
  keep_embedding_whole(b0, first.offset, first.offset + first.size);
  keep_embedding_whole(b1, last.offset, last.offset + last.size);
  for (const auto& [b, e, n] : {std::tuple{&b0, first, n0}, std::tuple{&b1, last, n1}}) {
    std::size_t at = 0;
    for (const auto& [lo, hi] : *b) {
      EXPECT_EQ(lo, at) << "the buckets tile the chunk in order";
      EXPECT_LE(lo, hi);
      EXPECT_FALSE(lo > e.offset && lo < e.offset + e.size) << "no bound inside the embedding";
      at = hi;
    }
    EXPECT_EQ(at, n);
  }
  for (int p = 0; p < 2; ++p) {
    const ZeroChunk z0 = plan_zero_chunk(rp.plan, stage_spec(rp, 0), stage[0].params(), b0, first, 2, p);
    const ZeroChunk z1 = plan_zero_chunk(rp.plan, stage_spec(rp, 1), stage[1].params(), b1, last, 2, p);
    EXPECT_EQ(z0.tied.section, z1.tied.section);
    EXPECT_EQ(z0.layout.shard_pieces(z0.tied, p).size(), 1u);
    EXPECT_EQ(z1.layout.shard_pieces(z1.tied, p).size(), 1u);
  }
}

// The simulator prices ZeRO-3's gathers by Plan::zero3_gather_units (how many units a pass
// gathers, the first's share); the runtime gathers the units plan_zero_chunk lays out. They must
// be the same units: every virtual stage of one- and two-stage pipelines, interleaved, tied and
// untied, forward and backward.
TEST(ShardLayout, Stage3UnitsAreTheOnesTheSimulatorPrices) {
  for (const bool tied : {true, false})
    for (const auto& [pp, vpp, schedule] : {std::tuple{1, 1, ScheduleKind::one_f_one_b},
                                           std::tuple{2, 1, ScheduleKind::one_f_one_b},
                                           std::tuple{2, 2, ScheduleKind::interleaved_1f1b}}) {
      ScenarioConfig c = testing::tiny_training(2, pp, schedule, vpp);
      c.parallelism.zero_stage = 3;
      c.parallelism.framework = Framework::fsdp;  // DeepSpeed refuses ZeRO-3 with a pipeline
      c.model.untie_embeddings_and_output_weights = !tied;
      const RuntimePlan rp = make_runtime_plan(c);
      for (int vs = 0; vs < pp * vpp; ++vs) {
        SCOPED_TRACE(fmt::format("tied {} pp {} vpp {} virtual stage {}", tied, pp, vpp, vs));
        const StageModel stage(stage_spec(rp, vs));
        const ZeroChunk z = plan_zero_chunk(rp.plan, stage_spec(rp, vs), stage.params(), {}, ParamInfo{}, 2, 0);
        double all = 0;
        for (const GatherUnit& u : z.units) all += static_cast<double>(u.elements);
        // One stage of 8 blocks: the embedding and the head are one unit when tied, two when not.
        if (pp * vpp == 1) {
          EXPECT_EQ(z.gathers(true).size(), tied ? 9u : 10u);
        }
        for (const bool forward : {true, false}) {
          const std::vector<int> units = z.gathers(forward);
          const Plan::GatherUnits priced = rp.plan.zero3_gather_units(vs, forward);
          ASSERT_EQ(static_cast<int>(units.size()), priced.count) << (forward ? "forward" : "backward");
          double gathered = 0;
          for (int u : units) gathered += static_cast<double>(z.units[static_cast<std::size_t>(u)].elements);
          const double first = static_cast<double>(z.units[static_cast<std::size_t>(units.front())].elements);
          // The runtime's decoder has a few parameters the simulator's shape counts otherwise
          // (norm gains, biases): the shares agree to a few percent, not exactly.
          EXPECT_NEAR(first / all, priced.first_share, 0.03) << (forward ? "forward" : "backward");
          EXPECT_NEAR(gathered / all, priced.gathered_share, 0.03) << (forward ? "forward" : "backward");
        }
      }
    }
}

// ---------------------------------------------------------------------------------------
// The matrix
// ---------------------------------------------------------------------------------------
struct Layout {
  int dp, pp, vpp;
  ScheduleKind schedule;
  int tp = 1;
  bool sp = false;  // sequence parallelism (tp 2 only)
};
// Every schedule at pp 1 and 2 (interleaved at pp 2, two chunks per stage), data parallel 1 and 2,
// tensor parallel 1 and 2 (with and without sequence parallelism).
std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (int tp : {1, 2})
    for (bool sp : {false, true})
      for (int dp : {1, 2})
        for (int pp : {1, 2})
          for (ScheduleKind s : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved_1f1b,
                                 ScheduleKind::zb_h1})
            if ((s != ScheduleKind::interleaved_1f1b || pp > 1) && (!sp || tp > 1))  // interleaving needs a pipeline
              out.push_back({dp, pp, s == ScheduleKind::interleaved_1f1b ? 2 : 1, s, tp, sp});
  return out;
}
// A ZeRO stage as a framework runs it (core/plan.h): DeepSpeed refuses stages 2-3 with a
// pipeline, FSDP has no stage 1 and a stage 2 of its own (gathers before each forward), and
// fsdp_no_sync reduces once per step without sharding gradients.
struct Sharding {
  int zero;
  Framework framework;
  bool no_sync;
};
std::vector<Sharding> shardings(int dp, int pp) {
  if (dp == 1) return {{0, Framework::auto_select, false}};  // nothing to shard over
  std::vector<Sharding> out = {{0, Framework::auto_select, false}, {1, Framework::auto_select, false}};
  for (int z : {2, 3}) {
    out.push_back({z, pp > 1 ? Framework::megatron : Framework::auto_select, false});
    out.push_back({z, Framework::fsdp, false});
  }
  out.push_back({3, Framework::fsdp, true});
  return out;
}

ScenarioConfig matrix_config(const Layout& l, const Sharding& z, Recompute r) {
  ScenarioConfig c = testing::tiny_training(l.dp, l.pp, l.schedule, l.vpp);
  c.parallelism.tensor_parallel_size = l.tp;
  c.parallelism.sequence_parallel = l.sp;
  c.cluster.num_gpus = l.dp * l.pp * l.tp;
  c.parallelism.zero_stage = z.zero;
  c.parallelism.framework = z.framework;
  c.parallelism.fsdp_no_sync = z.no_sync;
  c.training.activation_recompute = r;
  // Buckets smaller than a stage, reduced as the backward produces them (as every framework runs
  // stages 2-3), so buckets, shards and gathers all have several pieces.
  c.communication.overlap_grad_reduce = true;
  c.communication.bucket_size_mib = 0.05;
  return c;
}

std::string describe(const Layout& l, const Sharding& z, Recompute r) {
  return fmt::format("dp {} pp {} tp {}{} v {} {} zero {}{}{} recompute {}", l.dp, l.pp, l.tp, l.sp ? " sp" : "", l.vpp,
                     schedule_name(l.schedule),
                     z.zero, z.framework == Framework::fsdp ? " fsdp" : z.framework == Framework::megatron ? " megatron" : "",
                     z.no_sync ? " no_sync" : "", recompute_name(r));
}

// The worst |predicted / measured - 1| of peak memory seen by expect_memory_as_predicted.
double worst_memory_error = 0;

// Every rank's measured peak within `bound` of the prediction of the same runtime plan.
void expect_memory_as_predicted(const RunReport& r, double bound) {
  const Prediction p = predict(r.runtime_plan.plan);
  ASSERT_EQ(p.memory.size(), r.memory.size());
  for (std::size_t rank = 0; rank < r.memory.size(); ++rank) {
    const double measured = r.memory[rank].total(), predicted = p.memory[rank].total();
    worst_memory_error = std::max(worst_memory_error, std::fabs(predicted / measured - 1));
    EXPECT_NEAR(predicted / measured, 1.0, bound)
        << "rank " << rank << ": measured " << measured << " bytes (weights " << r.memory[rank].weights
        << ", gradients " << r.memory[rank].gradients << ", optimizer " << r.memory[rank].optimizer << ", activations "
        << r.memory[rank].activations << ", buffers " << r.memory[rank].buffers << "), predicted " << predicted
        << " (weights " << p.memory[rank].weights << ", gradients " << p.memory[rank].gradients << ", optimizer "
        << p.memory[rank].optimizer << ", activations " << p.memory[rank].activations << ", buffers "
        << p.memory[rank].buffers << ")";
  }
}

TEST(GatherGate, APassThatWaitsForItsUnitSaysHowLong) {
  // Stage 3's compute thread takes units as its communication thread gathers them; the time it
  // waited for one is the pass's (OpTiming::waited of its compute op), and a unit that was there
  // already costs nothing.
  using namespace std::chrono;
  GatherGate gate;
  std::thread comm([&] {
    std::this_thread::sleep_for(milliseconds(100));  // the compute thread is waiting by then
    gate.reserve(0);
    gate.gathered();
  });
  const auto t0 = steady_clock::now();
  gate.acquire();  // before the unit is there
  const auto waited = gate.take_compute_waited_ns();
  comm.join();
  EXPECT_GT(waited, 0);
  EXPECT_LE(waited, duration_cast<nanoseconds>(steady_clock::now() - t0).count());
  EXPECT_EQ(gate.take_compute_waited_ns(), 0) << "taken once";
  gate.reserve(1);
  gate.gathered();
  gate.acquire();  // already there
  EXPECT_EQ(gate.take_compute_waited_ns(), 0);
}

TEST(ZeroAndRecompute, EveryLayoutTrainsAsOneRankInFp32) {
  const RunReport reference = run(testing::tiny_training(1, 1, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(reference.failure) << reference.failure->message;
  double worst = 0;
  worst_memory_error = 0;
  int plans = 0;
  for (const Layout& l : layouts())
    for (const Sharding& z : shardings(l.dp, l.pp))
      for (const Recompute r : {Recompute::none, Recompute::selective, Recompute::selective_op, Recompute::full}) {
        SCOPED_TRACE(describe(l, z, r));
        const RunReport run_ = run(matrix_config(l, z, r));
        ASSERT_FALSE(run_.failure) << run_.failure->message;
        ++plans;
        for (const std::string& note : run_.runtime_plan.notes) {
          EXPECT_EQ(note.find("ZeRO"), std::string::npos) << note;
          EXPECT_EQ(note.find("recompute"), std::string::npos) << note;
          EXPECT_EQ(note.find("tensor_parallel"), std::string::npos) << note;
        }
        EXPECT_EQ(run_.executed_ranks.size(), static_cast<std::size_t>(l.dp * l.pp * l.tp));
        ASSERT_EQ(run_.steps.size(), reference.steps.size());
        for (std::size_t i = 0; i < run_.steps.size(); ++i) {
          const double ref = reference.steps[i].loss, err = std::fabs(run_.steps[i].loss - ref) / std::fabs(ref);
          worst = std::max(worst, err);
          EXPECT_LE(err, 1e-5) << "step " << i + 1;
          EXPECT_NEAR(run_.steps[i].grad_norm, reference.steps[i].grad_norm, 1e-4 * reference.steps[i].grad_norm);
          EXPECT_EQ(run_.steps[i].replica_drift, 0.0);
        }
        expect_memory_as_predicted(run_, 0.05);
      }
  RecordProperty("plans", plans);
  RecordProperty("worst_relative_loss_error", fmt::format("{:.2e}", worst));
  std::printf("%d plans, worst relative loss error %.2e, worst peak-memory error %.2f%%\n", plans, worst,
              100 * worst_memory_error);
}

// Full recompute of the first half of each chunk's layers alone (training.recompute_num_layers):
// the rebuilt blocks are bitwise the forward's, so the training is bitwise that of keeping
// everything; its activations lie strictly between none and full (half the blocks' stashes saved
// against one block's rebuild workspace), and each rank's peak is what the memory model predicts
// for the same plan. Pipelines of every schedule, interleaved chunks of 2 layers, and
// tensor-parallel shards with sequence parallelism.
TEST(ZeroAndRecompute, RecomputingAChunksFirstLayersTrainsBitwiseAndHoldsWhatTheModelPredicts) {
  for (const Layout& l : {Layout{1, 2, 1, ScheduleKind::one_f_one_b}, Layout{1, 2, 2, ScheduleKind::interleaved_1f1b},
                          Layout{1, 2, 1, ScheduleKind::zb_h1}, Layout{2, 1, 1, ScheduleKind::one_f_one_b, 2, true}}) {
    const int half = 8 / (l.pp * l.vpp) / 2;  // tiny_training's 8 layers
    const Sharding none{0, Framework::auto_select, false};
    SCOPED_TRACE(describe(l, none, Recompute::full));
    auto with = [&](Recompute r, int layers) {
      ScenarioConfig c = matrix_config(l, none, r);
      c.precision.compute = DType::bf16;  // rounding inside the rebuilt layer too
      c.training.recompute_num_layers = layers;
      const RunReport rep = run(c);
      EXPECT_FALSE(rep.failure) << rep.failure->message;
      return rep;
    };
    const RunReport kept = with(Recompute::none, 0), all = with(Recompute::full, 0), first = with(Recompute::full, half);
    if (kept.failure || all.failure || first.failure) continue;
    EXPECT_TRUE(first.runtime_plan.notes.empty()) << first.runtime_plan.notes.front();
    ASSERT_EQ(first.steps.size(), kept.steps.size());
    for (std::size_t i = 0; i < first.steps.size(); ++i) {
      EXPECT_EQ(first.steps[i].loss, kept.steps[i].loss) << "step " << i + 1;
      EXPECT_EQ(first.steps[i].grad_norm, kept.steps[i].grad_norm) << "step " << i + 1;
    }
    for (std::size_t r = 0; r < first.memory.size(); ++r) {
      EXPECT_LT(first.memory[r].activations, kept.memory[r].activations) << "rank " << r;
      EXPECT_GT(first.memory[r].activations, all.memory[r].activations) << "rank " << r;
    }
    expect_memory_as_predicted(first, 0.05);
  }
}

// What each setting shards, rank by rank, against ZeRO-0 of the same layout (dp 2, pp 2): the
// optimizer state halves under ZeRO-1, the gradients too under ZeRO-2, the weights too under
// ZeRO-3 (up to each segment's padding to a multiple of dp); recompute changes only activations,
// by what the memory model predicts it saves.
TEST(ZeroAndRecompute, MemoryFollowsTheSettings) {
  const Layout l{2, 2, 1, ScheduleKind::one_f_one_b};
  auto memory = [&](int zero, Recompute r) {
    ScenarioConfig c = matrix_config(l, {zero, zero >= 2 ? Framework::megatron : Framework::auto_select, false}, r);
    c.precision.compute = DType::bf16;  // weights (2 bytes), master and moments (12) and gradients (4) differ
    c.precision.loss_scaling.mode = LossScalingMode::dynamic;
    // The validation baselines' widths: at width 32 the FP32 norm statistics kept per row weigh
    // as much as a sixth of a row of activations, which the memory model leaves out.
    c.runtime.hidden_size = 128;
    c.runtime.num_attention_heads = 4;
    c.runtime.seq_length = 64;
    c.runtime.vocab_size = 256;
    c.runtime.steps = 1;
    c.communication.bucket_size_mib = 0.5;
    const RunReport rep = run(c);
    EXPECT_FALSE(rep.failure);
    return std::pair{rep.memory, predict(rep.runtime_plan.plan).memory};
  };
  const auto [zero0, zero0_predicted] = memory(0, Recompute::none);
  const double half = 0.5, padding = 0.01;  // a segment pads at most dp - 1 elements
  for (int zero = 1; zero <= 3; ++zero) {
    SCOPED_TRACE(::testing::Message() << "zero " << zero);
    const auto [m, predicted] = memory(zero, Recompute::none);
    for (std::size_t r = 0; r < m.size(); ++r) {
      EXPECT_NEAR(m[r].optimizer / zero0[r].optimizer, half, padding) << "rank " << r;
      EXPECT_NEAR(m[r].gradients / zero0[r].gradients, zero >= 2 ? half : 1.0, padding) << "rank " << r;
      EXPECT_NEAR(m[r].weights / zero0[r].weights, zero >= 3 ? half : 1.0, padding) << "rank " << r;
      // (The peak may fall on another op, with a little more or less in flight.)
      EXPECT_NEAR(m[r].activations / zero0[r].activations, 1.0, 0.02) << "rank " << r;
    }
  }
  std::map<Recompute, std::vector<double>> saved_by;  // per rank
  for (const Recompute rc : {Recompute::selective, Recompute::full, Recompute::selective_op}) {
    SCOPED_TRACE(recompute_name(rc));
    const auto [m, predicted] = memory(0, rc);
    for (std::size_t r = 0; r < m.size(); ++r) {
      EXPECT_EQ(m[r].weights + m[r].gradients + m[r].optimizer,
                zero0[r].weights + zero0[r].gradients + zero0[r].optimizer);
      // What recompute leaves out of the peak, measured and predicted (the backward's own
      // gradient buffers, which the memory model leaves to the framework, cancel out).
      const double saved = zero0[r].activations - m[r].activations;
      const double predicted_saved = zero0_predicted[r].activations - predicted[r].activations;
      saved_by[rc].push_back(saved);
      EXPECT_GT(saved, 0) << "rank " << r;
      if (rc == Recompute::selective_op) {  // keeps more than full, less than selective
        EXPECT_GT(saved, saved_by[Recompute::selective][r]) << "rank " << r;
        EXPECT_LT(saved, saved_by[Recompute::full][r]) << "rank " << r;
      }
      EXPECT_NEAR(saved / predicted_saved, 1.0, 0.05)
          << "rank " << r << ": activations " << zero0[r].activations << " -> " << m[r].activations
          << " measured, " << zero0_predicted[r].activations << " -> " << predicted[r].activations << " predicted";
    }
  }
}

// BF16 and FP16: the layouts round differently, so they train the one-rank model only to within
// what that rounding moves. Derivation (per step s, loss L_s, learning rate lr, P parameters):
//  * the forward is the same computation in every layout, so step 1's loss is the same (up to the
//    order its micro-batch losses are summed in double);
//  * a gradient element is a sum over data-parallel replicas and micro-batches, each addition
//    rounded to the reduction's or accumulation's format (unit roundoff u: 2^-8 bf16, 2^-11
//    fp16), so layouts differ by a relative eps <= (dp + m) u;
//  * Adam's update direction m_hat / sqrt(v_hat) is scale-free: step 1's is sign(g) (the same),
//    later ones move by at most ~2 eps per element, so weights differ by <= 2 lr eps (s - 1) after s
//    steps;
//  * the loss moves by |dL| <= sum_i |dL/dw_i| |dw_i| <= sqrt(P) |grad|_2 2 lr eps (s - 1), with
//    |grad|_2 the clipped norm (<= clip, 1 here).
// So |L_s - L_s(one rank)| / L_s <= 2 lr (dp + m) u (s - 1) sqrt(P) / L_s.
TEST(ZeroAndRecompute, Bf16Fp16StayWithinTheirRounding) {
  for (const DType format : {DType::bf16, DType::fp16}) {
    auto low = [&](ScenarioConfig c) {
      c.precision.compute = c.precision.grad_accumulation = c.precision.allreduce = format;
      c.precision.loss_scaling.mode = format == DType::fp16 ? LossScalingMode::static_scale : LossScalingMode::none;
      c.precision.loss_scaling.initial_scale = 1024;
      return c;
    };
    const ScenarioConfig one = low(testing::tiny_training(1, 1, ScheduleKind::one_f_one_b));
    const RunReport reference = run(one);
    ASSERT_FALSE(reference.failure) << reference.failure->message;
    const RuntimePlan rp = make_runtime_plan(one);
    const double params = static_cast<double>(StageModel(stage_spec(rp, 0)).gradients().size());
    const double u = format == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    double worst = 0, worst_error = 0;  // of error / bound, and the error itself
    for (const Layout& l : {Layout{2, 2, 1, ScheduleKind::one_f_one_b}, Layout{2, 1, 1, ScheduleKind::zb_h1}})
      for (const Sharding& z : shardings(l.dp, l.pp))
        for (const Recompute r : {Recompute::none, Recompute::full}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(format) << " " << describe(l, z, r));
          const ScenarioConfig c = low(matrix_config(l, z, r));
          const RunReport got = run(c);
          ASSERT_FALSE(got.failure) << got.failure->message;
          const int m = make_runtime_plan(c).plan.num_microbatches;
          for (std::size_t i = 0; i < got.steps.size(); ++i) {
            const double L = reference.steps[i].loss;
            EXPECT_FALSE(got.steps[i].skipped);
            const double bound = std::max(1e-6, 2 * c.training.lr * (l.dp + m) * u * static_cast<double>(i) *
                                                    std::sqrt(params) * c.training.clip_grad / L);
            const double err = std::fabs(got.steps[i].loss - L) / L;
            worst = std::max(worst, err / bound);
            worst_error = std::max(worst_error, err);
            EXPECT_LE(err, bound) << "step " << i + 1;
          }
        }
    std::printf("%s: worst relative loss error %.2e, %.4f of its bound\n", dtype_name(format).data(), worst_error, worst);
  }
}

// Checkpoints keep each rank's shards; resuming from them continues bit for bit.
TEST(ZeroAndRecompute, ResumingAShardedRunIsBitwiseIdentical) {
  const auto dir = std::filesystem::temp_directory_path() / "trainsim_test_zero_resume";
  for (const int tp : {1, 2}) {
    for (const Sharding& z : {Sharding{3, Framework::megatron, false}, Sharding{2, Framework::fsdp, false},
                              Sharding{1, Framework::auto_select, false}}) {
      SCOPED_TRACE(::testing::Message() << "zero " << z.zero << " tp " << tp);
      std::filesystem::remove_all(dir);
      ScenarioConfig c = matrix_config({2, 2, 2, ScheduleKind::interleaved_1f1b, tp, tp > 1}, z, Recompute::selective);
      c.precision.compute = DType::bf16;
      c.precision.loss_scaling.mode = LossScalingMode::dynamic;
      c.runtime.steps = 4;
      RunOptions opt;
      opt.checkpoint_dir = dir.string();
      opt.checkpoint_every_steps = 2;
      const RunReport whole = run(c, opt);
      ASSERT_FALSE(whole.failure) << whole.failure->message;
      ASSERT_EQ(whole.checkpoints.size(), 2u);
      RunOptions resume;
      resume.resume_from = whole.checkpoints[0];  // after step 2
      const RunReport rest = run(c, resume);
      ASSERT_FALSE(rest.failure) << rest.failure->message;
      ASSERT_EQ(rest.steps.size(), 2u);
      for (int i = 0; i < 2; ++i) {
        EXPECT_EQ(rest.steps[i].loss, whole.steps[i + 2].loss) << "bitwise";
        EXPECT_EQ(rest.steps[i].grad_norm, whole.steps[i + 2].grad_norm);
        EXPECT_EQ(rest.steps[i].replica_checksums, whole.steps[i + 2].replica_checksums);
      }
      // A rank's checkpoint holds its shard, not the whole chunk.
      const Checkpoint ck = load_checkpoint(whole.checkpoints[0]);
      const RuntimePlan rp = make_runtime_plan(c);
      std::size_t chunk = 0;
      for (int vs : {0, 2}) chunk += StageModel(stage_spec(rp, vs, 0)).gradients().size();  // rank 0's chunks
      EXPECT_LT(ck.ranks[0].master_weights.size(), chunk * 6 / 10);
      EXPECT_EQ(ck.ranks[0].first_moment.size(), ck.ranks[0].master_weights.size());
    }
  }
  std::filesystem::remove_all(dir);
}

// Megatron-LM's --overlap-param-gather moves the distributed optimizer's gather of the updated
// parameters to the next step's first forward of each chunk, which reads the units as they
// arrive: every step computes on the same weights as with the gather after the step, so losses
// and gradient norms are bitwise those of the plan without it, on every schedule, with tensor
// parallelism, in BF16, and resumed from a checkpoint (whose weights the first forward gathers).
TEST(ZeroAndRecompute, OverlappedParameterGatherTrainsBitwiseAsTheGatherAfterTheStep) {
  const auto dir = std::filesystem::temp_directory_path() / "trainsim_test_zero_overlap_gather";
  const Sharding zero1{1, Framework::auto_select, false};
  for (const Layout& l : {Layout{2, 1, 1, ScheduleKind::one_f_one_b}, Layout{2, 2, 1, ScheduleKind::one_f_one_b},
                          Layout{2, 2, 2, ScheduleKind::interleaved_1f1b}, Layout{2, 2, 1, ScheduleKind::zb_h1},
                          Layout{2, 2, 2, ScheduleKind::interleaved_1f1b, 2, true}})
    for (const DType compute : {DType::fp32, DType::bf16}) {
      SCOPED_TRACE(describe(l, zero1, Recompute::selective) + " " + std::string(dtype_name(compute)));
      ScenarioConfig c = matrix_config(l, zero1, Recompute::selective);
      c.precision.compute = compute;
      c.runtime.steps = 4;
      const RunReport after = run(c);
      ASSERT_FALSE(after.failure) << after.failure->message;
      c.communication.overlap_param_gather = true;
      std::filesystem::remove_all(dir);
      RunOptions opt;
      opt.checkpoint_dir = dir.string();
      opt.checkpoint_every_steps = 2;
      const RunReport before = run(c, opt);
      ASSERT_FALSE(before.failure) << before.failure->message;
      ASSERT_EQ(before.steps.size(), after.steps.size());
      for (std::size_t i = 0; i < before.steps.size(); ++i) {
        EXPECT_EQ(before.steps[i].loss, after.steps[i].loss) << "step " << i + 1;
        EXPECT_EQ(before.steps[i].grad_norm, after.steps[i].grad_norm) << "step " << i + 1;
        EXPECT_EQ(before.steps[i].replica_drift, 0.0);
      }
      ASSERT_FALSE(before.checkpoints.empty());
      RunOptions resume;
      resume.resume_from = before.checkpoints[0];  // after step 2
      const RunReport rest = run(c, resume);
      ASSERT_FALSE(rest.failure) << rest.failure->message;
      ASSERT_EQ(rest.steps.size(), 2u);
      for (int i = 0; i < 2; ++i) EXPECT_EQ(rest.steps[i].loss, after.steps[i + 2].loss) << "resumed, bitwise";
    }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace trainsim::runtime
