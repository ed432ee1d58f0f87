// The scenario as written by the user, after presets are applied and before invariants are
// checked. Every field here has one row in the field table (core/config_fields.cpp), which
// holds its key, default, unit and help text; parsing, `trainsim fields` and
// docs/scenario-reference.md are all driven from that table.
//
// Plan::from_config (core/plan.h) turns this into a validated Plan.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace trainsim {

struct HardwareProfile;  // core/hardware_profile.h

enum class ScheduleKind { gpipe, one_f_one_b, interleaved_1f1b, zb_h1 };
// selective: Megatron-LM's (Korthikanti et al. 2022), the attention core recomputed; selective_op:
// torchtitan's op-level policy, the attention core's output and every other matrix product's (the
// 1st, 3rd, ... in the order the layer's code calls them) kept, the rest of the layer recomputed;
// full: each layer from its input.
enum class Recompute { none, selective, full, selective_op };
enum class LossScalingMode { none, static_scale, dynamic };
enum class OverflowScope { global, local };
enum class AllReduceDivide { before, after };
enum class AllReduceAlgorithm { ring, hierarchical };
// How Transformer Engine's userbuffers overlap a row-parallel forward product's reduce-scatter.
enum class TpOverlapReduceScatter { pipeline, ring_exchange };
// How a column-parallel layer's backward runs its tensor-parallel collectives (the input
// gradient's all-reduce; under sequence parallelism its reduce-scatter and the re-gather of the
// layer's input): each beside the product that does not need it (overlapped: Megatron-LM since
// September 2021, Megatron-Core, Transformer Engine), or after the product before it (exposed:
// Megatron-LM before, --no-async-tensor-model-parallel-allreduce; PyTorch's DTensor). auto:
// overlapped under framework megatron, exposed otherwise.
enum class TpBackwardComm { auto_select, overlapped, exposed };
enum class PositionEmbedding { learned_absolute, rope };
enum class Optimizer { adam, adamw, sgd };
enum class Normalization { layernorm, rmsnorm };
// How the attention core (softmax(QK^T) V) runs: one fused kernel that never writes the s x s
// scores (FlashAttention 2; PyTorch SDPA's default, torchtitan's), the same work in cuDNN's fused
// attention (Transformer Engine's default backend, Megatron-Core and NeMo on Hopper: Hopper's
// asynchronous tensor cores, 1.6x FlashAttention 2 there), a fused softmax that still writes the
// scores, or separate unfused kernels (scores, softmax, dropout, each through memory).
enum class AttentionKernel { flash, cudnn, fused, naive };
// One kernel that never stores the scores: flash or cudnn (the same work and memory, priced apart).
inline bool single_kernel_attention(AttentionKernel a) {
  return a == AttentionKernel::flash || a == AttentionKernel::cudnn;
}
// The LayerNorm kernel: a persistent one that keeps each row in registers and moves 16-byte
// vectors (apex contrib FastLayerNorm, Megatron-LM since November 2021, Transformer Engine),
// priced like any streaming kernel; or apex's FusedLayerNorm of 2019-2021, which Megatron-LM
// copied into megatron/fused_kernels and ran until then (and still runs with
// --no-persist-layer-norm): 1.40x the persistent kernel's time forward and 2.03x backward
// (NVIDIA/apex pull request #1037, A100: 0.0751 against 0.0535 ms, 0.1762 against 0.0866 ms).
enum class LayerNormKernel { persistent, apex };
enum class RuntimeBackend { cpu, cuda };
// Whose data-parallel sharding the ZeRO stages follow (docs/model.md, "Data-parallel
// frameworks"): when gradients are reduced (once per step, or after every micro-batch), when
// parameters are gathered, and which combinations the framework refuses. auto: Megatron-LM
// for stages 0-1 (DDP, --use-distributed-optimizer), DeepSpeed for stages 2-3 (whose ZeRO
// stages the key names).
enum class Framework { auto_select, megatron, deepspeed, fsdp };
// How a context-parallel group exchanges keys and values: gathered whole before attention, exposed
// (Llama 3; PyTorch's context_parallel, rotate method allgather), or around a ring, each step's
// chunk sent while the attention of the chunk in hand runs (Megatron-Core with Transformer Engine,
// cp_comm_type p2p). auto: the ring under framework megatron, the gather otherwise.
enum class ContextParallelComm { auto_select, all_gather, p2p };

struct ModelConfig {
  std::string preset;  // name from the catalog, or empty
  int num_layers = 24;
  int hidden_size = 1024;
  int num_attention_heads = 16;
  int num_query_groups = 0;   // 0: as many as attention heads (no grouped-query attention)
  int ffn_hidden_size = 0;    // 0: 4 * hidden_size (or 8/3 * hidden_size rounded with swiglu)
  int vocab_size = 50304;
  int seq_length = 2048;
  bool swiglu = false;
  PositionEmbedding position_embedding_type = PositionEmbedding::learned_absolute;
  bool untie_embeddings_and_output_weights = false;
  bool add_bias_linear = true;
  Normalization normalization = Normalization::layernorm;
  // Dropout probabilities (Megatron's --hidden-dropout, --attention-dropout). Only whether they
  // are zero matters here: a dropout keeps a 1-byte mask per element for backward.
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;
  AttentionKernel attention = AttentionKernel::flash;
  // The elementwise work around the matrix products fused as Megatron-LM's kernels do (bias-GELU,
  // bias-dropout-add, one-kernel LayerNorm/RMSNorm and RoPE). false: PyTorch eager, one kernel per
  // operation with norms and rotary embeddings computed in FP32 (torchtitan without torch.compile).
  bool fused_elementwise = true;
  LayerNormKernel layernorm_kernel = LayerNormKernel::persistent;
  // The linear layers' biases added, and their gradients summed over the tokens, inside the matrix
  // products (cuBLASLt epilogues, Transformer Engine). false: as kernels of their own, as
  // Megatron-LM's own linear layers run them (docs/model.md, "Mechanisms").
  bool fused_linear_bias = true;
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

struct LinkConfig {
  double bandwidth_gbps = 0;  // GB/s, one direction: the line rate per GPU
  double latency_us = 0;
  // Fraction of the line rate that NCCL's collectives move as bus bandwidth (protocol and
  // flow-control overhead); sim/cost/collective_model.h.
  double efficiency = 1.0;
  friend bool operator==(const LinkConfig&, const LinkConfig&) = default;
};

struct ClusterConfig {
  std::string gpu;  // name from the catalog, or empty
  int num_gpus = 8;
  int gpus_per_node = 8;
  double memory_gib = 80;
  // Dense (no sparsity) peak rate per format; 0 means the GPU has no such format.
  DTypeMap<double> peak_tflops = {{DType::fp32, 19.5}, {DType::tf32, 156}, {DType::fp16, 312},
                                         {DType::bf16, 312}, {DType::fp8, 0}};
  // Fraction of peak that the best-shaped matrix products reach (cuBLAS on large GEMMs); the
  // compute model lowers it further by each product's shape (sim/cost/gemm_model.h).
  double compute_efficiency = 0.8;
  int sm_count = 108;  // streaming multiprocessors: a product's tiles run in waves of this many; 0: no waves
  // SMs a collective's kernels hold on each GPU while it runs (NCCL: one thread block per channel,
  // for the collective's whole duration): compute beside it runs on the others
  // (sim/core_contention.h). 0: collectives do not slow the compute they overlap.
  int collective_sms = 0;
  double hbm_bandwidth_gbps = 2039;
  double memory_efficiency = 0.79;  // fraction of hbm_bandwidth_gbps that streaming kernels reach
  // Fraction of peak a fused attention kernel (FlashAttention) reaches on the work it does, and
  // cuDNN's fused attention (model.attention: cudnn).
  double attention_efficiency = 0.5;
  double cudnn_attention_efficiency = 0.5;
  // Fraction of the clock at which compute_efficiency and attention_efficiency were measured
  // (short benchmarks, boost clock) that the SMs hold through sustained training, where the power
  // limit binds (matrix products, HBM, NVLink and NICs all drawing at once).
  double sustained_clock_fraction = 1.0;
  // 32-bit integer instructions per second, in tera (SMs x 64 INT32 lanes x boost clock): the
  // rate of the random-number generation inside dropout kernels (Philox), scaled like the products
  // by sustained_clock_fraction.
  double int32_tops = 9.75;
  LinkConfig intra_node{300, 3, 0.8};
  LinkConfig inter_node{25, 6, 0.94};
  // NVSwitch with in-switch reduction (NVLink SHARP, Hopper and later): NCCL's NVLS algorithms.
  bool nvlink_sharp = false;
  double price_per_gpu_hour = 0;  // what one GPU-hour costs (any currency); 0: not given
  // A hardware profile measured by `trainsim calibrate` (path as written; relative to the
  // scenario's folder), applied like a GPU preset; the cost models then price each kernel at
  // its measured rate (core/hardware_profile.h).
  std::string profile;
  std::shared_ptr<const HardwareProfile> calibrated;
  friend bool operator==(const ClusterConfig&, const ClusterConfig&) = default;
};

struct ParallelismConfig {
  int data_parallel_size = 1;
  int pipeline_parallel_size = 1;
  int tensor_parallel_size = 1;
  bool sequence_parallel = false;
  // Context parallelism: each sequence split over c GPUs (2c chunks, GPU i holding chunks i and
  // 2c-1-i so causal attention's work is even), which all-gather K and V for their queries.
  int context_parallel_size = 1;
  ContextParallelComm context_parallel_comm = ContextParallelComm::auto_select;
  int virtual_pipeline_stages = 1;
  // Interleaved 1F1B: micro-batches a model chunk runs before the next (Megatron-Core's
  // --microbatch-group-size-per-virtual-pipeline-stage); 0: pipeline_parallel_size.
  int microbatch_group_size = 0;
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  std::vector<int> layers_per_stage;  // empty: balanced
  int zero_stage = 0;
  Framework framework = Framework::auto_select;
  // FSDP only: accumulate unsharded gradients over the micro-batches (no_sync(), FSDP2's
  // set_requires_gradient_sync(False)) and reduce-scatter once, after the last.
  bool fsdp_no_sync = false;
  friend bool operator==(const ParallelismConfig&, const ParallelismConfig&) = default;
};

struct TrainingConfig {
  int micro_batch_size = 1;
  int global_batch_size = 0;  // 0: micro_batch_size * data_parallel_size (one micro-batch per step)
  Recompute activation_recompute = Recompute::none;
  // Under full recompute, the layers of each model chunk that rebuild, the chunk's first ones
  // (Megatron-LM's --recompute-method block --recompute-num-layers N); the others keep every
  // activation. 0: every layer. recomputed_layers() applies it.
  int recompute_num_layers = 0;
  Optimizer optimizer = Optimizer::adam;
  // Megatron-LM's --gradient-accumulation-fusion (on by default since 2022): each weight-gradient
  // product accumulates straight into the main_grad buffer (cuBLAS with beta = 1) instead of a
  // separate add. Applies where the framework is Megatron-LM; DeepSpeed and FSDP add separately.
  bool gradient_accumulation_fusion = true;
  // The optimizer's settings; only the runtime uses them (the simulator needs none).
  double lr = 1e-3;
  double weight_decay = 0.1;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  double clip_grad = 1.0;  // clip by the global gradient norm across all stages; 0: off
  // The whole training run, for time to train, GPU-hours and cost (0: not given).
  double total_tokens = 0;
  std::int64_t train_steps = 0;
  friend bool operator==(const TrainingConfig&, const TrainingConfig&) = default;
};

struct LossScalingConfig {
  LossScalingMode mode = LossScalingMode::dynamic;
  double initial_scale = 65536;
  int growth_interval = 1000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int hysteresis = 2;
  friend bool operator==(const LossScalingConfig&, const LossScalingConfig&) = default;
};

struct PrecisionConfig {
  DType compute = DType::bf16;
  DType master_weights = DType::fp32;
  DType grad_accumulation = DType::fp32;
  DType allreduce = DType::fp32;
  AllReduceDivide allreduce_divide = AllReduceDivide::before;
  OverflowScope overflow_check = OverflowScope::global;
  LossScalingConfig loss_scaling;
  friend bool operator==(const PrecisionConfig&, const PrecisionConfig&) = default;
};

struct CommunicationConfig {
  // Gradient bytes per data-parallel collective; 0: the framework's own (Plan::framework_bucket_bytes).
  double bucket_size_mib = 0;
  bool overlap_grad_reduce = false;
  // Megatron-LM --overlap-param-gather (its distributed optimizer: zero_stage 1): the updated
  // parameters are all-gathered before each chunk's first forward of the next step, unit by unit
  // beside it, instead of after the optimizer step.
  bool overlap_param_gather = false;
  AllReduceAlgorithm allreduce_algorithm = AllReduceAlgorithm::ring;
  // Pipeline sends run beside compute (asynchronous point-to-point, as current Megatron-LM and
  // torchtitan do). false: a stage waits for each send before computing on (Megatron-LM 2021,
  // --no-overlap-p2p-communication).
  bool overlap_p2p_comm = true;
  // Tensor parallelism's collectives overlapped with the products they feed or follow, as
  // Transformer Engine's userbuffers run them (Megatron-LM --tp-comm-overlap; needs sequence
  // parallelism and a group inside one node). Priced on the GPU path only: the runtimes run
  // their collectives exposed.
  bool tp_comm_overlap = false;
  TpOverlapReduceScatter tp_comm_overlap_reduce_scatter = TpOverlapReduceScatter::pipeline;
  TpBackwardComm tp_backward_comm = TpBackwardComm::auto_select;
  friend bool operator==(const CommunicationConfig&, const CommunicationConfig&) = default;
};

// What `trainsim run` executes for real (the runtime issue); parsed and checked now so that
// scenario files can carry it.
struct RuntimeConfig {
  RuntimeBackend backend = RuntimeBackend::cpu;
  int steps = 20;
  std::int64_t seed = 1;
  int num_layers = 8;
  int hidden_size = 128;
  int num_attention_heads = 4;
  int seq_length = 64;
  int vocab_size = 256;
  std::string data_path;  // empty: the bundled corpus (runtime/data/), unless data_synthetic
  bool data_synthetic = false;
  std::string checkpoint_dir;
  int checkpoint_every_steps = 0;
  friend bool operator==(const RuntimeConfig&, const RuntimeConfig&) = default;
};

struct ScenarioConfig {
  std::string name;
  std::string description;
  ModelConfig model;
  ClusterConfig cluster;
  ParallelismConfig parallelism;
  TrainingConfig training;
  PrecisionConfig precision;
  CommunicationConfig communication;
  RuntimeConfig runtime;
  // Field by field, every field (a field added to any section is compared too): the
  // Predictor's schedule cache (sim/simulator.cpp) is keyed on it.
  friend bool operator==(const ScenarioConfig&, const ScenarioConfig&) = default;
};

std::string_view schedule_name(ScheduleKind s);
std::string_view recompute_name(Recompute r);
// The layers of a model chunk of `chunk_layers` whose backward rebuilds something: none without
// recompute, every one under selective and selective_op (each rebuilds part of every layer), the
// chunk's first recompute_num_layers (or all of them) under full.
int recomputed_layers(const TrainingConfig& t, int chunk_layers);
// The recompute as the reports write it: "full", or "full (first 5 layers a chunk)".
std::string recompute_text(const TrainingConfig& t);
// The parallel sizes as the reports write them: "data 2 x pipeline 4 (v=2) x tensor 2", with
// " x context c" when context parallelism is on.
std::string parallel_sizes_text(const ParallelismConfig& p);
// The backend record runtime.backend names (runtime/backend.h find_backend).
std::string_view runtime_backend_name(RuntimeBackend b);

}  // namespace trainsim
