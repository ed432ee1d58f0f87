// Memory against the published formulas: ZeRO model states and Korthikanti et al.'s
// per-layer activations; and the schedule walk's peak.
#include <gtest/gtest.h>

#include "core/config_fields.h"
#include "core/presets.h"
#include "sim/cost/memory_model.h"
#include "sim/simulator.h"
#include "tests/test_helpers.h"

namespace trainsim {
namespace {

Plan zero_plan(int zero, int d) {
  ScenarioConfig c = testing::small_config(1, 1, ScheduleKind::one_f_one_b, 1, d);
  c.parallelism.zero_stage = zero;
  c.precision.compute = DType::fp16;
  c.precision.master_weights = DType::fp32;
  c.precision.grad_accumulation = DType::fp16;
  c.training.optimizer = Optimizer::adam;
  return Plan::from_config(c);
}

// Rajbhandari et al. 2020, mixed-precision Adam (K = 12): 16P; 4P + 12P/N; 2P + 14P/N; 16P/N.
TEST(ModelStates, ZeroPaperFormulas) {
  const double P = 1e9;
  for (int N : {2, 4, 64}) {
    const double expected[4] = {16 * P, 4 * P + 12 * P / N, 2 * P + 14 * P / N, 16 * P / N};
    for (int zero = 0; zero <= 3; ++zero) {
      const ModelStateBytes b = model_state_bytes(zero_plan(zero, N), P);
      EXPECT_NEAR(b.weights + b.gradients + b.optimizer, expected[zero], 1e-3) << "zero " << zero << " N " << N;
    }
  }
  // Without data parallelism nothing is sharded.
  const ModelStateBytes one = model_state_bytes(zero_plan(3, 1), P);
  EXPECT_NEAR(one.weights + one.gradients + one.optimizer, 16 * P, 1e-3);
}

TEST(ModelStates, Fp32TrainingAndFp32GradientBuffers) {
  ScenarioConfig c = testing::small_config(1, 1, ScheduleKind::one_f_one_b);
  c.precision.compute = DType::fp32;
  c.precision.master_weights = DType::fp32;
  c.precision.grad_accumulation = DType::fp32;
  const ModelStateBytes fp32 = model_state_bytes(Plan::from_config(c), 1.0);
  EXPECT_DOUBLE_EQ(fp32.weights + fp32.gradients + fp32.optimizer, 16.0);  // 4 + 4 + 8 (no separate master)
  c.precision.compute = DType::bf16;
  const ModelStateBytes main_grad = model_state_bytes(Plan::from_config(c), 1.0);
  EXPECT_DOUBLE_EQ(main_grad.weights + main_grad.gradients + main_grad.optimizer, 18.0);  // Megatron's main_grad
}

// Korthikanti et al. 2022, eq. 1-2 and section 4: bytes per layer per micro-batch.
TEST(Activations, PublishedPerLayerFormulas) {
  ModelConfig m;
  m.hidden_size = 6144;
  m.num_attention_heads = 64;
  m.seq_length = 2048;
  const ModelShape shape(m);
  const double s = 2048, b = 2, h = 6144, a = 64;
  const double sbh = s * b * h;
  EXPECT_DOUBLE_EQ(shape.layer_activation_bytes(2, 2, 1, false, Recompute::none), sbh * (34 + 5 * a * s / h));
  for (int t : {2, 8}) {
    EXPECT_DOUBLE_EQ(shape.layer_activation_bytes(2, 2, t, false, Recompute::none),
                     sbh * (10 + 24.0 / t + 5 * a * s / (h * t)));
    EXPECT_DOUBLE_EQ(shape.layer_activation_bytes(2, 2, t, true, Recompute::none), sbh * (34 + 5 * a * s / h) / t);
    EXPECT_DOUBLE_EQ(shape.layer_activation_bytes(2, 2, t, true, Recompute::selective), sbh * 34 / t);
    EXPECT_DOUBLE_EQ(shape.layer_activation_bytes(2, 2, t, false, Recompute::selective), sbh * (10 + 24.0 / t));
  }
  EXPECT_DOUBLE_EQ(shape.layer_activation_bytes(2, 2, 1, false, Recompute::full), 2 * sbh);
  // What the memory model holds follows model.attention: fused and naive keep the scores as
  // above; FlashAttention keeps no s x s matrix, only its FP32 log-sum-exp (4 a s b), with or
  // without recompute of the attention core (Dao et al. 2022).
  for (AttentionKernel k : {AttentionKernel::fused, AttentionKernel::naive}) {
    m.attention = k;
    EXPECT_DOUBLE_EQ(ModelShape(m).layer_stored_activation_bytes(2, 2, 1, false, Recompute::none),
                     sbh * (34 + 5 * a * s / h));
  }
  m.attention = AttentionKernel::flash;
  const ModelShape flash(m);
  for (int t : {1, 2, 8}) {
    EXPECT_DOUBLE_EQ(flash.layer_stored_activation_bytes(2, 2, t, false, Recompute::none),
                     sbh * (10 + 24.0 / t) + 4 * a * s * b / t);
    EXPECT_DOUBLE_EQ(flash.layer_stored_activation_bytes(2, 2, t, false, Recompute::selective),
                     sbh * (10 + 24.0 / t) + 4 * a * s * b / t);
  }
  EXPECT_DOUBLE_EQ(flash.layer_stored_activation_bytes(2, 2, 1, false, Recompute::full), 2 * sbh);
}

TEST(Activations, PeakFollowsTheSchedule) {
  // Middle stages hold p - s micro-batches under 1F1B and m under GPipe.
  const int p = 4, m = 8;
  for (ScheduleKind kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe}) {
    const Plan plan = Plan::from_config(testing::small_config(p, m, kind));
    const MemoryModel mm(plan);
    const auto peak = mm.peak_per_rank(build_schedule(plan));
    for (int s = 1; s < p - 1; ++s) {
      const int held = kind == ScheduleKind::gpipe ? m : p - s;
      EXPECT_DOUBLE_EQ(peak[s].activations, held * mm.activations_per_microbatch(s)) << "stage " << s;
    }
  }
}

// Llama 2 13B at 4,096 tokens, micro-batch 1, no tensor parallelism, no recompute: with
// FlashAttention and Llama's zero dropout one micro-batch keeps about 26 GiB of activations
// (what such runs measure; the scores-storing formula with dropout gave 152 GiB). Per layer,
// 16-bit: the two norms' inputs and the QKV and MLP inputs 8 sbh, Q, K, V 6 sbh, projection
// input 2 sbh, SwiGLU's gate, up and product 3 * 2 * f/h sbh, plus the FP32 log-sum-exp; the
// last stage adds FP32 logits and the final norm's input.
TEST(Activations, LlamaTwoThirteenBillionWithFlashAttention) {
  ScenarioConfig c;
  find_field("model.preset")->set(c, std::string("llama2-13b"));
  EXPECT_EQ(c.model.hidden_dropout, 0.0);
  EXPECT_EQ(c.model.attention_dropout, 0.0);
  EXPECT_EQ(c.model.attention, AttentionKernel::flash);
  c.cluster.num_gpus = 1;
  const Plan plan = Plan::from_config(c);
  const MemoryModel mm(plan);
  const double s = 4096, h = 5120, f = 13824, a = 40, L = 40, V = 32000;
  const double per_layer = s * h * (8 + 6 + 2 + 6 * f / h) + 4 * a * s;
  const double expected = L * per_layer + 4 * s * V + 2 * s * h;
  EXPECT_NEAR(mm.activations_per_microbatch(0), expected, 1.0);
  EXPECT_GT(bytes_to_gib(expected), 24.0);
  EXPECT_LT(bytes_to_gib(expected), 28.0);
  // The same layer with a kernel that stores the scores would keep a s^2 (2 bytes) more.
  c.model.attention = AttentionKernel::fused;
  const MemoryModel fused(Plan::from_config(c));
  EXPECT_NEAR(fused.activations_per_microbatch(0) - mm.activations_per_microbatch(0), L * (2 * a * s * s - 4 * a * s), 1.0);
}

// Published dropout: Llama trains without it; GPT-3 and the Megatron models keep Megatron's 0.1.
TEST(Presets, ModelsCarryTheirPublishedDropout) {
  for (const auto& p : model_presets()) {
    const bool llama = p.name.rfind("llama", 0) == 0;
    EXPECT_EQ(p.model.hidden_dropout, llama ? 0.0 : 0.1) << p.name;
    EXPECT_EQ(p.model.attention_dropout, llama ? 0.0 : 0.1) << p.name;
  }
}

TEST(Activations, FullRecomputeAddsOneLayerDuringBackward) {
  ScenarioConfig c = testing::small_config(2, 4, ScheduleKind::gpipe);
  c.training.activation_recompute = Recompute::full;
  const Plan plan = Plan::from_config(c);
  const MemoryModel mm(plan);
  const auto peak = mm.peak_per_rank(build_schedule(plan));
  const ModelShape shape = plan.shape();
  const double one_layer = shape.layer_stored_activation_bytes(1, plan.activation_bytes(), 1, false, Recompute::none);
  EXPECT_DOUBLE_EQ(peak[0].activations, 4 * mm.activations_per_microbatch(0) + one_layer);
}

TEST(Fit, OverflowIsReportedWithTheRankAndTheExcess) {
  ScenarioConfig c = testing::small_config(2, 4, ScheduleKind::gpipe);
  c.cluster.memory_gib = 0.001;
  const Plan plan = Plan::from_config(c);
  const Prediction p = predict(plan);
  EXPECT_FALSE(p.result.fits_in_memory);
  bool named = false;
  for (const auto& w : p.result.warnings) named |= w.find("rank 0 (stage 0, replica 0) needs") != std::string::npos;
  EXPECT_TRUE(named);
  c.cluster.memory_gib = 80;
  EXPECT_TRUE(predict(Plan::from_config(c)).result.fits_in_memory);
}

}  // namespace
}  // namespace trainsim

namespace trainsim {
namespace {

// The framework's own memory is not modelled, so a plan that fits by less than 2 GiB says so.
TEST(Fit, ThinHeadroomIsFlagged) {
  ScenarioConfig c = testing::small_config(2, 4, ScheduleKind::one_f_one_b);
  const Plan probe = Plan::from_config(c);
  const double peak = MemoryModel(probe).peak_per_rank(build_schedule(probe))[0].total();
  auto flagged = [&](double capacity_gib) {
    c.cluster.memory_gib = capacity_gib;
    const Result r = predict(Plan::from_config(c)).result;
    bool found = false;
    for (const auto& w : r.warnings) found |= w.find("GiB of headroom") != std::string::npos;
    return found;
  };
  EXPECT_TRUE(flagged(bytes_to_gib(peak) + 1.0));
  EXPECT_FALSE(flagged(bytes_to_gib(peak) + 3.0));
}

}  // namespace
}  // namespace trainsim
