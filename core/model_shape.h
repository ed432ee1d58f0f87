// Parameter counts, FLOPs and activation sizes of a GPT-style decoder, from its shape.
// Shared by the compute and memory cost models and by MFU. Formulas and their sources:
//   forward FLOPs per layer (GPT, ffn = 4h): 24 b s h^2 + 4 b s^2 h  (Narayanan et al. 2021, eq. 3)
//   activation bytes per layer, 16-bit, no recompute, no tensor parallelism:
//       s b h (34 + 5 a s / h)                                        (Korthikanti et al. 2022, eq. 1)
//   with t-way tensor parallelism: s b h (10 + 24/t + 5 a s / (h t)); with sequence
//   parallelism: s b h (34 + 5 a s / h) / t; selective recompute drops the 5as/h term;
//   full recompute keeps only each layer's input (2 s b h). Without dropout the masks (2 s b h
//   bytes, a s^2 b bytes) and attention dropout's output (2 a s^2 b) are not kept: 16-bit,
//   s b h (32 + 2 a s / h), which is what the runtime's decoder keeps.
#pragma once

#include <cstdint>

#include "core/config.h"

namespace trainsim {

struct ModelShape {
  explicit ModelShape(const ModelConfig& m);

  // Parameters (whole model, no parallel split).
  double params_per_layer() const;
  double embedding_params() const;  // word (+ position) embeddings, on the first stage
  double output_params() const;     // LM-head weights held by the last stage (a copy when tied and p > 1)
  double final_norm_params() const;
  double total_params() const;      // unique parameters: tied output weights counted once

  // Forward FLOPs for one micro-batch of b samples (no tensor-parallel split).
  double layer_forward_flops(int b) const;
  double layer_weight_matmul_flops(int b) const;    // the part with weights (their gradient needs W)
  double layer_attention_core_flops(int b) const;   // QK^T and AV: no weights
  double lm_head_forward_flops(int b) const;

  // Model FLOPs per step for MFU: 3x forward (no recompute), for `samples` samples.
  double model_flops_per_sample() const;

  // Activation bytes kept for backward by one layer for one micro-batch, element size
  // `elem_bytes` (2 for 16-bit), with t-way tensor parallelism.
  double layer_activation_bytes(int b, int elem_bytes, int t, bool sequence_parallel, Recompute r) const;

  int h, a, kv_heads, f, V, s, L;
  bool swiglu, learned_positions, tied, bias, layernorm;
  bool hidden_dropout, attention_dropout;  // > 0: their masks (and attention's output) are kept
  AttentionKernel attention;
};

}  // namespace trainsim
