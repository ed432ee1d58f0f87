// Parameter counts, FLOPs and activation sizes of a GPT-style decoder, from its shape.
// Shared by the compute and memory cost models and by MFU. Formulas and their sources:
//   forward FLOPs per layer (GPT, ffn = 4h): 24 b s h^2 + 4 b s^2 h  (Narayanan et al. 2021, eq. 3)
//   activation bytes per layer, 16-bit, no recompute, no tensor parallelism, an attention
//   kernel that stores the scores (model.attention fused or naive):
//       s b h (34 + 5 a s / h)                                        (Korthikanti et al. 2022, eq. 1)
//   with t-way tensor parallelism: s b h (10 + 24/t + 5 a s / (h t)); with sequence
//   parallelism: s b h (34 + 5 a s / h) / t; selective recompute drops the 5as/h term;
//   full recompute keeps only each layer's input (2 s b h). Without dropout the masks (2 s b h
//   bytes, a s^2 b bytes) and attention dropout's output (2 a s^2 b) are not kept: 16-bit,
//   s b h (32 + 2 a s / h), which is what the runtime's decoder (naive attention) keeps.
//   FlashAttention (model.attention: flash, the default) stores no s x s matrix: s b h 34
//   plus its FP32 log-sum-exp, 4 a s b (Dao et al. 2022), whatever the recompute.
//   torchtitan's op-level checkpointing (selective_op) keeps the layer's input, the attention
//   core's output (with flash its log-sum-exp) and the output of every other matrix product in
//   the order the code calls them: 16-bit, no tensor parallelism, Llama's separate q, k, v, w1,
//   w3, w2 (torchtitan) keep x, q, v, attention, w1 and w2: s b (2h + 2h + 2 kv + 2h + 2f + 2h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/config.h"

namespace trainsim {

// One matrix product of a layer's forward, per token: `out` x `in` weights of the whole model.
struct LayerProduct {
  double out = 0, in = 0;
  // Row-parallel under tensor parallelism (attention output, MLP down): its output has the
  // residual stream's width on every rank; the others' outputs are split t ways.
  bool row_parallel = false;
};

struct ModelShape {
  // separate_projections: the layer's code calls q, k and v (and SwiGLU's gate and up) as products
  // of their own, as PyTorch-native decoders write them (torchtitan, Hugging Face Llama); false:
  // one QKV product and one gate/up product, as Megatron-LM and the runtime's decoder do.
  explicit ModelShape(const ModelConfig& m, bool separate_projections = false);

  // Parameters (whole model, no parallel split).
  double params_per_layer() const;
  double embedding_params() const;  // word (+ position) embeddings, on the first stage
  double output_params() const;     // LM-head weights held by the last stage (a copy when tied and p > 1)
  double final_norm_params() const;
  double total_params() const;      // unique parameters: tied output weights counted once
  // Parameters every tensor-parallel shard holds whole, as Megatron-LM keeps them: a layer's norms
  // and the biases added after its row-parallel products' reduction (attention output, MLP out);
  // learned position embeddings; the final norm. The rest is split t ways.
  double replicated_params_per_layer() const;

  // Forward FLOPs for one micro-batch of b samples (no tensor-parallel split).
  double layer_forward_flops(int b) const;
  double layer_weight_matmul_flops(int b) const;    // the part with weights (their gradient needs W)
  double layer_attention_core_flops(int b) const;   // QK^T and AV: no weights
  double lm_head_forward_flops(int b) const;

  // Model FLOPs per sample for MFU: 3x forward (no recompute). For a GPT with ffn = 4h this is
  // Korthikanti et al. 2022's 72 s l h^2 (1 + s/(6h) + V/(12 l h)).
  double model_flops_per_sample() const;
  // The FLOPs the hardware runs per sample, recompute included (Narayanan et al. 2021, eq. 3,
  // with full recompute: 96 s l h^2 (1 + s/(6h) + V/(16 l h))): full recompute adds each layer's
  // forward again, selective its attention core (QK^T and AV). FlashAttention's own
  // recomputation inside its backward is not counted.
  // selective_op adds the products it does not keep, and the attention core where the kernel
  // keeps its s x s probabilities (they are rebuilt).
  // `rebuilt_layers` of the model's layers rebuild (full recompute of a chunk's first layers
  // alone, recompute_num_layers); -1: all of them.
  double hardware_flops_per_sample(Recompute r, int rebuilt_layers = -1) const;

  // The layer's matrix products in the order its code calls them (separate_projections says how
  // many), and which outputs torchtitan's op-level policy keeps: the 1st, 3rd, 5th, ...
  // (`_save_list` with every second `aten.mm` recomputed, torchtitan parallelize_llama.py).
  std::vector<LayerProduct> layer_products() const;
  static bool op_policy_keeps(std::size_t index) { return index % 2 == 0; }

  // Activation bytes kept for backward by one layer for one micro-batch, element size
  // `elem_bytes` (2 for 16-bit), with t-way tensor parallelism, as model.attention keeps them
  // (flash: no s x s matrix). What the memory model holds.
  double layer_stored_activation_bytes(int b, int elem_bytes, int t, bool sequence_parallel, Recompute r) const;
  // The same as a kernel that writes the attention scores keeps them (fused or naive,
  // Korthikanti et al.'s formula), whatever model.attention says: what the compute model's
  // memory-bound term reads and writes (attention's time is priced there).
  double layer_activation_bytes(int b, int elem_bytes, int t, bool sequence_parallel, Recompute r) const;

  int h, a, kv_heads, f, V, s, L;
  // The keys each of the s tokens' queries attends over: s, but the whole sequence where a GPU
  // holds s of its tokens (context parallelism: Plan::token_shape), so an s x keys score matrix.
  int keys;

 private:
  double activation_bytes(int b, int e, int t, bool sp, Recompute r, bool flash) const;

 public:
  bool separate_projections;
  bool swiglu, learned_positions, tied, bias, layernorm;
  bool hidden_dropout, attention_dropout;  // > 0: their masks (and attention's output) are kept
  AttentionKernel attention;
};

}  // namespace trainsim
