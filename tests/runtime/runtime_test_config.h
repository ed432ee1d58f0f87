// The small plans the runtime tests execute or schedule: a tiny GPT on synthetic data, so a
// step takes milliseconds. Each test changes only what it is about.
#pragma once

#include "core/config.h"

namespace trainsim::runtime::testing {

// A (dp x pp) layout with `schedule` (vpp virtual stages), micro-batches of one, `layers`
// layers of width 32, and the scenario's default precision: bf16 compute, dynamic loss scaling
// and a global overflow check, so schedules carry the found-inf collective too.
inline ScenarioConfig tiny_plan(int dp, int pp, ScheduleKind schedule, int vpp, int global_batch, int layers) {
  ScenarioConfig c;
  c.name = "runtime-test";
  c.cluster.num_gpus = dp * pp;
  c.cluster.gpus_per_node = 8;
  c.parallelism.data_parallel_size = dp;
  c.parallelism.pipeline_parallel_size = pp;
  c.parallelism.virtual_pipeline_stages = vpp;
  c.parallelism.schedule = schedule;
  c.training.micro_batch_size = 1;
  c.training.global_batch_size = global_batch;
  c.runtime.num_layers = layers;
  c.runtime.hidden_size = 32;
  c.runtime.num_attention_heads = 2;
  c.runtime.seq_length = 16;
  c.runtime.vocab_size = 64;
  c.runtime.data_synthetic = true;
  return c;
}

// The same for training: 8 layers, 8 samples per step, FP32 throughout with no loss scaling (so
// any layout trains the one-rank model to FP32 rounding), AdamW (lr 3e-3, clip 1), 3 steps.
inline ScenarioConfig tiny_training(int dp, int pp, ScheduleKind schedule, int vpp = 1) {
  ScenarioConfig c = tiny_plan(dp, pp, schedule, vpp, 8, 8);
  c.training.optimizer = Optimizer::adamw;
  c.training.lr = 3e-3;
  c.training.clip_grad = 1.0;
  c.precision.compute = DType::fp32;
  c.precision.grad_accumulation = DType::fp32;
  c.precision.allreduce = DType::fp32;
  c.precision.loss_scaling.mode = LossScalingMode::none;
  c.runtime.steps = 3;
  c.runtime.seed = 7;
  return c;
}

}  // namespace trainsim::runtime::testing
