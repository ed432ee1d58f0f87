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

// torchtitan's op-level policy keeps each layer's input, the attention core's output and the
// 1st, 3rd, ... product's output in the order the code calls them: Llama's separate q, k, v, o, w1,
// w3, w2 (PyTorch-native, separate_projections) keep q, v, w1 and w2; a fused decoder's qkv, o,
// fc1, fc2 keep qkv and fc1. A row-parallel output (o, w2) is the stream's width on every rank.
TEST(Activations, OpLevelCheckpointingKeepsEveryOtherProduct) {
  ModelConfig m;
  m.hidden_size = 4096;
  m.num_attention_heads = 32;
  m.num_query_groups = 8;
  m.ffn_hidden_size = 14336;
  m.swiglu = true;
  m.seq_length = 8192;
  m.attention = AttentionKernel::flash;
  const double s = 8192, b = 2, h = 4096, a = 32, kv = 1024, f = 14336, e = 2;
  const ModelShape llama(m, true);
  for (int t : {1, 2, 8}) {
    const double lse = 4 * a * s * b / t;
    EXPECT_DOUBLE_EQ(llama.layer_stored_activation_bytes(2, 2, t, false, Recompute::selective_op),
                     e * s * b * (h + h / t + h / t + kv / t + f / t + h) + lse);
    EXPECT_DOUBLE_EQ(llama.layer_stored_activation_bytes(2, 2, t, true, Recompute::selective_op),
                     e * s * b * (h / t + h / t + h / t + kv / t + f / t + h / t) + lse);
  }
  // Megatron-LM's fused products: qkv (h + 2 kv) and the gate and up product (2f) kept.
  const ModelShape fused(m, false);
  EXPECT_DOUBLE_EQ(fused.layer_stored_activation_bytes(2, 2, 1, false, Recompute::selective_op),
                   e * s * b * (h + h + (h + 2 * kv) + 2 * f) + 4 * a * s * b);
  // A GPT with unfused attention: its probabilities are rebuilt, not kept (no s x s term).
  ModelConfig g;
  g.hidden_size = 1024;
  g.num_attention_heads = 16;
  g.seq_length = 1024;
  g.attention = AttentionKernel::fused;
  g.attention_dropout = 0.1;
  g.hidden_dropout = 0.1;
  const double gh = 1024, gs = 1024;
  EXPECT_DOUBLE_EQ(ModelShape(g).layer_stored_activation_bytes(2, 2, 1, false, Recompute::selective_op),
                   e * gs * b * (gh + gh + 3 * gh + 4 * gh));
  // Between full recompute's and selective's, for every layout above.
  for (const ModelShape& shape : {llama, fused, ModelShape(g)})
    for (bool sp : {false, true}) {
      const double op = shape.layer_stored_activation_bytes(2, 2, 2, sp, Recompute::selective_op);
      EXPECT_GT(op, shape.layer_stored_activation_bytes(2, 2, 2, sp, Recompute::full));
      EXPECT_LT(op, shape.layer_stored_activation_bytes(2, 2, 2, sp, Recompute::selective));
    }
  // The FLOPs the hardware runs: the products not kept again (k, o and w3 for Llama), per sample.
  EXPECT_DOUBLE_EQ(llama.hardware_flops_per_sample(Recompute::selective_op) - llama.model_flops_per_sample(),
                   llama.L * 2 * s * (kv * h + h * h + f * h));
  EXPECT_DOUBLE_EQ(fused.hardware_flops_per_sample(Recompute::selective_op) - fused.model_flops_per_sample(),
                   fused.L * 2 * s * (h * h + h * f));
}

// PyTorch's cross-entropy on FP32 logits (the FSDP frameworks' loss) holds, in its backward, the
// kept log-softmax, the gradient into it and the one it produces: 12 bytes per logit at once,
// where Megatron-LM's vocabulary-parallel cross-entropy works in its one FP32 buffer (4).
TEST(Activations, PyTorchsLossHoldsThreeFp32LogitTensorsInItsBackward) {
  // ZeRO-0, so that nothing else differs: under stages 2-3 the frameworks' gradients in flight do
  // too (FSDP's units, DeepSpeed's buckets).
  ScenarioConfig c = testing::small_config(1, 1, ScheduleKind::one_f_one_b, 1, 2);
  c.parallelism.zero_stage = 0;
  c.training.activation_recompute = Recompute::full;
  c.model.vocab_size = 4096;
  const double logits = static_cast<double>(c.training.micro_batch_size) * c.model.seq_length * c.model.vocab_size;
  c.parallelism.framework = Framework::deepspeed;
  const Plan ds = Plan::from_config(c);
  c.parallelism.framework = Framework::fsdp;
  const Plan fsdp = Plan::from_config(c);
  const double ds_peak = MemoryModel(ds).peak_per_rank(build_schedule(ds))[0].activations;
  const double fsdp_peak = MemoryModel(fsdp).peak_per_rank(build_schedule(fsdp))[0].activations;
  // Full recompute rebuilds one layer (smaller than the loss's 8 bytes per logit here).
  const ModelShape shape = fsdp.shape();
  const double layer = shape.layer_stored_activation_bytes(c.training.micro_batch_size, 2, 1, false, Recompute::none);
  ASSERT_LT(layer, 8 * logits);
  EXPECT_DOUBLE_EQ(fsdp_peak - ds_peak, 8 * logits - layer);
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
// last stage adds FP32 logits and the final norm's input and output (the LM head's input).
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
  const double expected = L * per_layer + 4 * s * V + 2 * 2 * s * h;
  EXPECT_NEAR(mm.activations_per_microbatch(0), expected, 1.0);
  EXPECT_GT(bytes_to_gib(expected), 24.0);
  EXPECT_LT(bytes_to_gib(expected), 28.0);
  // The same layer with a kernel that stores the scores would keep a s^2 (2 bytes) more.
  c.model.attention = AttentionKernel::fused;
  const MemoryModel fused(Plan::from_config(c));
  EXPECT_NEAR(fused.activations_per_microbatch(0) - mm.activations_per_microbatch(0), L * (2 * a * s * s - 4 * a * s), 1.0);
}

// The same model on 8-way tensor parallelism: without sequence parallelism every shard keeps all
// s rows of the final norm's input and output (2 * 2 sh bytes), with it the shard's s/8 of each,
// the LM head gathering its input again for its weight gradient (Megatron-LM's output layer); the
// FP32 logits are the shard's vocabulary either way.
TEST(Activations, TheFinalNormsRowsAreTheShardsUnderSequenceParallelism) {
  ScenarioConfig c;
  find_field("model.preset")->set(c, std::string("llama2-13b"));
  c.cluster.num_gpus = 8;
  c.cluster.gpus_per_node = 8;
  c.parallelism.tensor_parallel_size = 8;
  const double s = 4096, h = 5120, V = 32000, t = 8, L = 40;
  const ModelShape m = Plan::from_config(c).token_shape();
  for (const bool sp : {false, true}) {
    c.parallelism.sequence_parallel = sp;
    const MemoryModel mm(Plan::from_config(c));
    const double layers = L * m.layer_stored_activation_bytes(1, 2, 8, sp, Recompute::none);
    EXPECT_NEAR(mm.activations_per_microbatch(0) - layers, 4 * s * V / t + 2 * 2 * s * h / (sp ? t : 1), 1.0)
        << "sequence parallel " << sp;
  }
  // PyTorch's sequence parallelism (framework fsdp: DTensor, as torchtitan plans it) gathers the
  // norms' outputs before the products that read them, which save the gathered rows: per layer the
  // QKV and MLP inputs (2 * 2 sbh) whole, the norms' inputs the shard's; the head's input whole.
  c.parallelism.framework = Framework::fsdp;
  c.parallelism.zero_stage = 3;
  const Plan fsdp = Plan::from_config(c);
  const ModelShape pytorch = fsdp.token_shape();
  ASSERT_TRUE(pytorch.separate_projections);
  const double megatron_layer = m.layer_stored_activation_bytes(1, 2, 8, true, Recompute::none);
  EXPECT_NEAR(pytorch.layer_stored_activation_bytes(1, 2, 8, true, Recompute::none) - megatron_layer,
              2 * 2 * s * h * (1 - 1 / t), 1.0);
  EXPECT_NEAR(pytorch.layer_stored_activation_bytes(1, 2, 8, false, Recompute::none),
              m.layer_stored_activation_bytes(1, 2, 8, false, Recompute::none), 1.0);  // no SP: the same
  const MemoryModel mm(fsdp);
  EXPECT_NEAR(mm.activations_per_microbatch(0) - L * pytorch.layer_stored_activation_bytes(1, 2, 8, true, Recompute::none),
              4 * s * V / t + 2 * s * h / t + 2 * s * h, 1.0);
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

// Megatron-LM's block recompute (training.recompute_num_layers N): the first N layers of each
// chunk are fully recomputed, the others keep everything. Against the two ends, layer by layer:
// the stash grows by (L - N) x (a kept layer - its input), the backward's rebuild workspace stays
// one layer, and the step costs N / L of full recompute's extra time (one stage, one replica:
// nothing but the passes moves) and its hardware FLOPs N / L of the extra.
TEST(Activations, RecomputingAChunksFirstLayersIsFullRecomputeOnThemAlone) {
  ScenarioConfig c = testing::preset_replicas("gpt3-1.3b", "a100-80gb", 1, 0);
  c.training.global_batch_size = 4;
  const int L = c.model.num_layers;
  auto with = [&](Recompute r, int n) {
    ScenarioConfig x = c;
    x.training.activation_recompute = r;
    x.training.recompute_num_layers = n;
    return predict(Plan::from_config(x)).result;
  };
  const Result none = with(Recompute::none, 0), full = with(Recompute::full, 0);
  const Plan plan = Plan::from_config(c);
  const ModelShape shape = plan.shape();
  const int b = plan.micro_batch_size, e = plan.activation_bytes();
  const double kept = shape.layer_stored_activation_bytes(b, e, 1, false, Recompute::none);
  const double input = shape.layer_stored_activation_bytes(b, e, 1, false, Recompute::full);
  for (const int n : {1, L / 3, L - 1}) {
    SCOPED_TRACE(::testing::Message() << n << " of " << L << " layers");
    const Result r = with(Recompute::full, n);
    EXPECT_NEAR(r.ranks[0].memory.activations - full.ranks[0].memory.activations, (L - n) * (kept - input), 1.0);
    EXPECT_NEAR(r.step_time_s - none.step_time_s, static_cast<double>(n) / L * (full.step_time_s - none.step_time_s),
                1e-6 * full.step_time_s);
    const double extra = full.hardware_tflops_per_gpu * full.step_time_s - none.hardware_tflops_per_gpu * none.step_time_s;
    EXPECT_NEAR(r.hardware_tflops_per_gpu * r.step_time_s - none.hardware_tflops_per_gpu * none.step_time_s,
                static_cast<double>(n) / L * extra, 1e-9 * extra);
  }
  EXPECT_EQ(with(Recompute::full, L).step_time_s, full.step_time_s);  // every layer: full recompute
  EXPECT_EQ(with(Recompute::full, 10 * L).ranks[0].memory.activations, full.ranks[0].memory.activations);
}

// It chooses among the layers full recompute rebuilds: with another recompute it is an error at
// its key, and the plan line says how many layers a chunk rebuild.
TEST(Activations, RecomputeNumLayersNeedsFullRecompute) {
  ScenarioConfig c = testing::small_config(2, 4, ScheduleKind::one_f_one_b);
  c.training.recompute_num_layers = 1;
  c.training.activation_recompute = Recompute::selective;
  try {
    Plan::from_config(c);
    ADD_FAILURE() << "accepted";
  } catch (const ScenarioError& e) {
    ASSERT_FALSE(e.diagnostics().empty());
    EXPECT_EQ(e.diagnostics()[0].key_path, "training.recompute_num_layers");
    EXPECT_NE(e.diagnostics()[0].message.find("activation_recompute is selective"), std::string::npos)
        << e.diagnostics()[0].message;
  }
  c.training.activation_recompute = Recompute::full;
  EXPECT_EQ(Plan::from_config(c).zero_and_recompute(), "recompute full (first 1 layer a chunk)");
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
