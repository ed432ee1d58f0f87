// One pipeline stage (model chunk) of the GPT-style decoder the runtime trains: token and
// position embeddings (first stage), pre-LayerNorm blocks (causal multi-head attention, GELU
// MLP), final LayerNorm, LM head and cross-entropy (last stage). Each data-parallel replica
// holds a full pipeline of these; an engine (runtime/cpu/cpu_engine.h) drives them in the order
// the schedule says.
//
// Mixed precision, as tensor cores and mixed-precision training do it (runtime/numerics/lowp.h):
//  * master weights FP32; the working copy, activations and gradients flowing between layers
//    hold values of the compute format;
//  * matrix products take compute-format inputs and accumulate in FP32, their outputs are
//    rounded to the compute format; LayerNorm, softmax, GELU and the loss compute in FP32
//    internally and round what they store or pass on;
//  * each micro-batch's weight gradients, as produced (compute format), are added into the
//    accumulation buffer and the sum rounded to grad_accumulation.
// With compute = fp32 every rounding is the identity, so any cut of the model into stages
// computes what the whole model does, to FP32 rounding of summation order.
//
// Tensor parallelism (stage_layout.h, runtime/README.md): a stage may be one of tp shards, holding
// 1/tp of the heads, the MLP and the vocabulary, running its group's collectives inside forward and
// backward (set_tensor_parallel_group); the shards of a stage together compute what the stage does,
// to FP32 rounding of summation order, and keep their replicated parameters bit-identical.
// Context parallelism: a stage may hold 1/cp of each sequence's tokens (two load-balanced chunks,
// their own positions), gathering the others' keys and values for its queries' attention
// (set_context_parallel_group); its loss is the mean over its tokens, and the cp ranks' gradients,
// summed (the engine's data-parallel reduction over dp x cp), are the whole sequences'.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"  // Recompute
#include "core/dtype.h"

namespace trainsim::runtime {

class ModelParallelGroup;  // runtime/model/model_parallel.h

struct ModelDims {
  int num_layers = 8;
  int hidden_size = 128;
  int num_heads = 4;
  int seq_length = 64;
  int vocab_size = 256;
  int ffn_hidden_size = 0;       // 0: 4 * hidden_size
  bool tied_embeddings = true;   // LM head shares the token embedding (GPT-2)
  int ffn() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
};

struct StageSpec {
  ModelDims dims;
  int first_layer = 0, num_layers = 0;     // blocks [first_layer, first_layer + num_layers)
  bool has_embedding = false, has_head = false;
  DType compute = DType::fp32, grad_accumulation = DType::fp32;
  int micro_batch_size = 1;
  // Activation recompute (training.activation_recompute), as sim's memory model counts it:
  // `selective` keeps no softmax output and rebuilds it from the kept QKV in the block's
  // backward (Korthikanti et al. 2022); `selective_op` (torchtitan's op-level policy) keeps each
  // block's input, the attention output and the 1st and 3rd products' outputs (qkv, mlp.fc) and
  // rebuilds the rest from them in the block's backward (not mlp.proj's output: the next block's
  // input, kept); `full` keeps only each block's input and reruns the block's forward in its
  // backward. Rebuilt tensors are bitwise those of the forward.
  Recompute recompute = Recompute::none;
  // Under full recompute, the blocks that rebuild: the stage's first `recompute_blocks`
  // (training.recompute_num_layers, Megatron-LM's block method); the others keep everything.
  int recompute_blocks = 1 << 30;
  // Block li's recompute: `recompute`, or none past the rebuilt ones.
  Recompute recompute_of(int li) const { return li < recompute_blocks ? recompute : Recompute::none; }
  // Tensor parallelism (stage_layout.h): this stage is shard `tensor_parallel_rank` of
  // `tensor_parallel_size`; its collectives go to the group set_tensor_parallel_group() names.
  // sequence_parallel: its residual stream holds 1/tensor_parallel_size of the rows.
  int tensor_parallel_size = 1, tensor_parallel_rank = 0;
  bool sequence_parallel = false;
  // Context parallelism (stage_layout.h): this stage holds context-parallel rank
  // `context_parallel_rank`'s two of each sequence's 2 x `context_parallel_size` chunks; its
  // attention gathers every rank's keys and values over the group set_context_parallel_group()
  // names.
  int context_parallel_size = 1, context_parallel_rank = 0;
};

// What numerics the stage saw since the last reset (per step): the largest magnitudes, how
// many values were inf/NaN, and the first tensor that held one.
struct StageNumerics {
  double max_abs_activation = 0, max_abs_gradient = 0;
  std::int64_t nonfinite_activations = 0, nonfinite_gradients = 0;
  std::string first_nonfinite;  // e.g. "block 3 mlp output (forward, micro-batch 2)"; empty if none
};

// How a parameter of the whole model is cut into this shard's: the rows of blocks
// [row_begin, row_begin + rows) of the whole (full_rows, full_cols) tensor, each keeping its columns
// [col_begin, col_begin + cols). Replicated: one block of every row and column.
struct ParamShard {
  std::size_t full_rows = 0, full_cols = 0;
  std::vector<std::size_t> row_begins;  // the shard's row blocks, in order, `rows` rows each
  std::size_t rows = 0, col_begin = 0, cols = 0;
  std::size_t size() const { return row_begins.size() * rows * cols; }
  // The whole tensor's element index of the shard's element i.
  std::size_t global_index(std::size_t i) const {
    const std::size_t r = i / cols, c = i % cols;
    const std::size_t block = r / rows, within = r % rows;
    return (row_begins[block] + within) * full_cols + col_begin + c;
  }
  static ParamShard whole(std::size_t rows, std::size_t cols) { return {rows, cols, {0}, rows, 0, cols}; }
};

struct ParamInfo {
  std::string name;   // global name, e.g. "block.3.attn.qkv.weight", "wte" (same on every cut)
  std::size_t offset = 0, size = 0;  // in master_weights() / gradients()
  bool decay = true;  // weight decay applies (not to biases, norms)
  // Split over the tensor-parallel group (each shard holds 1/tp of it); false: replicated, the
  // same values and the same gradient on every shard (layer norms, the biases added after a
  // row-parallel product's reduction, the position embedding).
  bool tensor_parallel = false;
  ParamShard shard;  // where its elements sit in the whole model's tensor
};

// For an engine that gathers sharded weights piece by piece (ZeRO-3, runtime/engine/zero.h): a
// pass tells it, in the order it goes, which weights it is about to read and when it is done
// with them. Pieces: the embedding (first stage), block `block` (local index), the head (last
// stage). Forward uses embedding, blocks 0.., head; a backward (or backward_input) the head and
// blocks ..0, each for its input-gradient pass and, with recompute, the block's rebuild (weight
// gradients and the embedding's need no weights).
enum class WeightPiece : std::uint8_t { embedding, block, head };
class WeightGate {
 public:
  virtual ~WeightGate() = default;
  virtual void acquire(WeightPiece piece, int block) = 0;  // returns once they are there
  virtual void release(WeightPiece piece, int block) = 0;
};

// A pass's calls on an engine's gate, if it has one (both stage models hold one).
struct GateCalls {
  WeightGate* gate = nullptr;
  void take(WeightPiece piece, int block = -1) const {
    if (gate) gate->acquire(piece, block);
  }
  void give(WeightPiece piece, int block = -1) const {
    if (gate) gate->release(piece, block);
  }
};

// The arguments a stage's forward needs, checked (every backend's stage model calls it):
// tokens on the first stage, an input activation on the others, targets on the last; token ids
// inside the vocabulary. `who` names the caller in the exceptions (std::invalid_argument,
// std::out_of_range).
void check_forward_arguments(const StageSpec& spec, const char* who, const std::int32_t* tokens,
                             const std::int32_t* targets, bool has_input);

class StageModel {
 public:
  explicit StageModel(const StageSpec& spec);
  ~StageModel();
  StageModel(StageModel&&) noexcept;
  StageModel& operator=(StageModel&&) noexcept;

  const StageSpec& spec() const;

  // The group a tensor-parallel shard (spec().tensor_parallel_size > 1) runs its collectives
  // over; it must outlive the model. A shard without one throws std::logic_error on forward.
  void set_tensor_parallel_group(ModelParallelGroup* group);
  // The group a context-parallel stage (spec().context_parallel_size > 1) gathers keys and values
  // over, its members in context-parallel order; it must outlive the model. Without one such a
  // stage throws std::logic_error on forward.
  void set_context_parallel_group(ModelParallelGroup* group);

  // Deterministic: each tensor's values depend only on (seed, its global name), so every cut
  // of the model starts from the weights of the whole one (the last stage's copy of a tied
  // embedding equals the first stage's; a tensor-parallel shard holds its slice of the whole
  // tensor's values). Also refreshes the working copy.
  void init(std::uint64_t seed);

  // Parameters flattened in gradient-completion order: the units of backward_unit() in the
  // order backward finishes them (head side first, embedding last), so that after k units a
  // prefix of gradients() is final (gradients_complete()).
  std::span<float> master_weights();
  std::span<float> gradients();
  const std::vector<ParamInfo>& params() const;
  void zero_gradients();
  // Rounds the master weights into the compute-format working copy; after each optimizer step.
  void refresh_working_weights();
  // The weights passes read: the working copy, or the master weights when compute is fp32. An
  // engine that shards them (ZeRO) writes what it gathers here.
  std::span<float> compute_weights();
  // Passes ask `gate` before they read weights (nullptr, the default: they are always there).
  void set_weight_gate(WeightGate* gate);
  // The token embedding's range in master_weights()/gradients() (size 0 when this stage has
  // none): with tied embeddings split over a pipeline its gradient is summed between the
  // first and last stage before the optimizer step.
  ParamInfo token_embedding() const;

  // Activations passed between stages: micro_batch_size * seq_length / context_parallel_size *
  // hidden_size floats (1/tp of them under sequence parallelism: the shard's rows).
  std::size_t activation_elements() const;

  // Forward of micro-batch `mb` (keeps what backward needs until backward_end/backward_weight).
  // The first stage reads `tokens`, the others `input`; the last stage reads `targets` and
  // returns the micro-batch's mean cross-entropy (FP32); others write `output` and return 0.
  // Tokens and targets are the stage's rows: micro_batch_size sequences of seq_length /
  // context_parallel_size tokens each (context_parallel_rows() says which).
  float forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const float* input, float* output);

  // Backward in units so an engine can end a step's last backward at gradient-bucket
  // bounds: begin (the last stage seeds d(loss)/d(logits) times loss_gradient_scale, i.e.
  // loss scale / micro-batches; the others take grad_output), then backward_units() units,
  // then end (writes grad_input, except on the first stage, and frees the micro-batch's stash).
  void backward_begin(int mb, const float* grad_output, float loss_gradient_scale);
  // The units, in order: the head (LM head and final LayerNorm) on the last stage, each block
  // from the last to the first, the embedding on the first stage.
  int backward_units() const;
  void backward_unit(int mb);  // the next unit; adds its weight gradients into gradients()
  std::size_t gradients_complete(int mb) const;  // leading elements of gradients() final for mb
  void backward_end(int mb, float* grad_input);

  // Zero-bubble split (ZB-H1): input gradients now, weight gradients later from the stash.
  void backward_input(int mb, const float* grad_output, float loss_gradient_scale, float* grad_input);
  void backward_weight(int mb);  // every weight unit left, then frees the stash
  // The weight pass in units (gradient-completion order, as backward_unit), so an engine can
  // end a split backward's weight segments at gradient-bucket bounds: the next unit's weight
  // gradients (gradients_complete() grows), then backward_weight() runs the rest.
  void backward_weight_unit(int mb);

  // Seconds the stage's transformer blocks computed since the last call (their forward, rebuild,
  // input and weight passes; not the embedding or head, not waits for weights at the gate), and
  // back to 0. Blocks are the same work on every stage: validation reads each core's speed
  // during a step from them (validation/validate.cpp, core_factors_in_step).
  double take_block_seconds();

  // Memory held now, in bytes of the formats the values are in (the runtime's accounting):
  std::size_t master_weight_bytes() const;   // FP32 master
  std::size_t working_weight_bytes() const;  // compute-format copy (0 when compute is fp32)
  std::size_t gradient_bytes() const;        // accumulation buffer in grad_accumulation
  std::size_t activation_bytes() const;      // stashes of micro-batches in flight (compute-format
                                             // elements, FP32 statistics; with the gradients a
                                             // split backward keeps for backward_weight)
  // What a backward (or backward_input) holds on top of activation_bytes() while it runs: the
  // workspace recompute rebuilds one block's activations in, and under context parallelism every
  // rank's keys and values, gathered, and their gradients; 0 with neither.
  std::size_t backward_workspace_bytes() const;

  // Reset by assigning {} (per step). Activations are the tensors forward stores or passes on,
  // gradients those backward passes on plus each parameter's gradient as produced and as
  // accumulated; first_nonfinite names e.g. "block 3 mlp.fc output (forward, micro-batch 2)",
  // "logits gradient (backward, micro-batch 0)", "block.3.mlp.fc.weight gradient accumulation
  // (backward, micro-batch 1)".
  StageNumerics& numerics();

  // Inspection, for tests and debugging: the compute-format working copy of the weights (the
  // master weights themselves when compute is fp32), and the compute-format tensors kept for
  // micro-batch `mb`'s backward, by name (empty when none are kept). Spans stay valid until
  // that micro-batch's backward frees its stash.
  std::span<const float> working_weights() const;
  struct NamedTensor {
    std::string name;
    std::span<const float> values;
  };
  std::vector<NamedTensor> stashed_tensors(int mb) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainsim::runtime
