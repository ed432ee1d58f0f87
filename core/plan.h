// A Plan is a validated scenario: every invariant between keys holds, and the derived
// quantities (micro-batches per replica, layers of each virtual stage, rank placement)
// are computed once. Plan::from_config states each broken invariant with its numbers:
//   data_parallel_size(2) * pipeline_parallel_size(4) * tensor_parallel_size(1) = 8 != num_gpus(6)
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "core/model_shape.h"
#include "core/scenario.h"
#include "core/units.h"

namespace trainsim {

struct Plan {
  ScenarioConfig config;
  std::string source;  // scenario file, for reports

  int dp = 1, pp = 1, tp = 1, vpp = 1;  // data, pipeline, tensor, virtual stages per rank
  int cp = 1;                           // context-parallel ways (each sequence split over cp GPUs)
  // parallelism.context_parallel_comm with `auto` resolved (by the framework, below).
  ContextParallelComm cp_comm = ContextParallelComm::all_gather;
  // communication.tp_backward_comm with `auto` resolved (by the framework): whether a
  // column-parallel layer's backward collectives run beside its products (never without tensor
  // parallelism, nor under ZB-H1, whose weight-gradient products run later).
  bool tp_backward_overlapped = false;
  int num_microbatches = 1;             // per replica per step (m)
  int micro_batch_size = 1;
  int global_batch_size = 1;
  // Layers of each virtual stage (model chunk), pp * vpp entries in pipeline order. Virtual
  // stage c lives on pipeline rank c % pp as its chunk c / pp (Megatron's interleaving).
  std::vector<int> layers_per_virtual_stage;
  // Interleaved 1F1B: micro-batches each model chunk runs before the next (Megatron-Core's
  // microbatch_group_size_per_vp_stage, n): parallelism.microbatch_group_size, p unless set.
  int microbatch_group = 1;
  std::vector<std::string> warnings;
  // parallelism.framework with `auto` resolved: whose data-parallel sharding is simulated.
  Framework framework = Framework::megatron;

  // The data-parallel traffic of the ZeRO stage as `framework` runs it (docs/model.md), all
  // false without data parallelism:
  int zero() const { return data_shards() > 1 ? config.parallelism.zero_stage : 0; }
  // The GPUs that hold the same weights (one tensor-parallel shard of one stage) and so reduce
  // their gradients together and share ZeRO's shards: the replicas' and, within each, the
  // context-parallel GPUs' (Megatron-Core's data-parallel group with context parallelism,
  // torchtitan's dp_shard x cp mesh).
  int data_shards() const { return dp * cp; }
  // Gradients reduced (reduce-scattered) after every micro-batch's backward, not once per step.
  bool reduces_every_microbatch() const;
  // Parameters all-gathered before every micro-batch's forward / again before its backward
  // (resharded in between), and after the optimizer step (the updated shards, for the next step).
  bool gathers_before_forward() const;
  bool gathers_before_backward() const;
  bool gathers_after_step() const;
  // Megatron-LM's --overlap-param-gather: the parameters a step updated are gathered before each
  // chunk's first forward of the next, unit by unit as ZeRO-3 gathers a forward's (the first
  // unit waited for, the rest beside the pass; Plan::zero3_gather_units), and kept.
  bool gathers_before_first_forward() const;
  // Weights gathered unit by unit while a pass runs: stage 3's passes, or the first forwards above.
  bool gathers_units() const { return gathers_before_backward() || gathers_before_first_forward(); }
  // ZeRO-3 gathers a pass's weights unit by unit, as DeepSpeed and FSDP do (each block, the
  // embedding, the head; with tied embeddings on a one-stage pipeline, embedding and head are
  // one unit): how many units the forward (or backward) pass of virtual stage `vs` gathers, and
  // the first one's share of the chunk's parameters (the pass begins once it is there), and the
  // share of all it gathers (a backward leaves the embedding, whose gradient needs no weights).
  // runtime/engine/zero.cpp's plan_zero_chunk lays out the same units.
  struct GatherUnits {
    int count = 1;
    double first_share = 1;
    double gathered_share = 1;
  };
  GatherUnits zero3_gather_units(int vs, bool forward) const;
  // Gradients kept sharded in memory (stage >= 2 unless FSDP accumulates them unsharded).
  bool shards_gradients() const;
  // FSDP reducing after every micro-batch reduce-scatters each unit's gradients in one call as
  // its backward ends (FSDP2's foreach_reduce per fully_shard group, FSDP1 per flat parameter):
  // communication.bucket_size_mib does not apply. Every other reduction runs buckets of it.
  bool reduces_by_unit() const;
  // The gradient collectives of virtual stage `vs` (bytes of this GPU's shard in the all-reduce
  // format), in the order its backward completes them: bucket_size_mib buckets, or (reduces_by_unit)
  // the units of zero3_gather_units: the head (final norm and output layer), each layer, the
  // embedding. Empty without data parallelism.
  std::vector<Bytes> gradient_buckets(int vs) const;
  // What every collective of gradient_buckets(vs) sums to.
  Bytes gradient_bytes(int vs) const;
  // The bucket a framework cuts gradients into unless communication.bucket_size_mib names one
  // (the plan's config holds it resolved): Megatron-Core's DistributedDataParallel
  // max(40M, 1M x data-parallel size) parameters, or one bucket a chunk without
  // overlap_grad_reduce; DeepSpeed's reduce_bucket_size, 5e8 elements; PyTorch DDP's 25 MiB
  // (framework fsdp, whose ZeRO-2/3 reduce by unit instead).
  double framework_bucket_bytes() const;
  // The framework and its setting in its own words, e.g. "deepspeed" and
  // "zero_optimization.stage: 3 (parameters gathered for every micro-batch's forward and
  // backward, gradients reduce-scattered after every micro-batch)".
  std::string framework_name() const;
  std::string framework_setting() const;
  // What a plan line says of the sharding and recompute that run: "ZeRO 3 (fsdp), recompute full",
  // "recompute none" without ZeRO.
  std::string zero_and_recompute() const;

  // Schedule ranks: one per (stage, replica); each stands for a group of tp x cp GPUs (its
  // tensor-parallel shards, tensor-parallel innermost, for each of its context-parallel parts),
  // which run alike. Numbered stage-major as Megatron does (rank = stage * dp + replica), so the
  // ranks of one stage, which all-reduce together, sit next to each other on a node.
  int num_ranks() const { return dp * pp; }
  int rank_of(int stage, int replica) const { return stage * dp + replica; }
  int stage_of(int rank) const { return rank / dp; }
  int replica_of(int rank) const { return rank % dp; }
  int gpus_per_rank() const { return tp * cp; }
  int first_gpu_of(int rank) const { return rank * gpus_per_rank(); }
  // Tokens of one sequence on one GPU: seq_length / cp.
  int local_seq_length() const { return config.model.seq_length / cp; }
  // The context-parallel group of a rank's GPUs (one per tensor-parallel shard): cp members, tp
  // GPUs apart, over as few nodes as that allows.
  int cp_members_per_node() const;
  // Elements of the keys and values a context-parallel group gathers for one layer of one
  // micro-batch on one tensor-parallel shard: every token's K and V of its key/value heads.
  double cp_gathered_kv_elements() const;
  int node_of(int rank) const { return first_gpu_of(rank) / config.cluster.gpus_per_node; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
  int num_virtual_stages() const { return pp * vpp; }
  int rank_stage_of_virtual(int vstage) const { return vstage % pp; }

  // The decoder as `framework` writes it: PyTorch-native code (FSDP: torchtitan, Hugging Face)
  // calls q, k, v and gate/up as separate products, Megatron-LM (and DeepSpeed on it) fuses them;
  // the runtime's decoder fuses them whatever the framework.
  ModelShape shape() const { return ModelShape(config.model, framework == Framework::fsdp && !runtime_decoder); }
  // shape() for what one GPU holds of each sequence, local_seq_length() tokens: every tensor that
  // runs token by token (activations, messages, logits). shape() with cp = 1.
  ModelShape token_shape() const;
  // The plan the runtime executes (runtime/runtime_plan.h): its GPT-2 decoder and its own loss
  // run, not the framework's code, while the framework's sharding and traffic stay.
  bool runtime_decoder = false;
  // Parameters of one virtual stage (whole tensor-parallel group): its layers, plus the
  // embeddings on the first and the LM head on the last (a copy of tied embeddings when
  // the pipeline has more than one stage, as Megatron-LM keeps it).
  double virtual_stage_params(int vstage) const;
  // The same, `shape` being shape() (for a caller that walks every virtual stage).
  double virtual_stage_params(int vstage, const ModelShape& shape) const;
  // What a rank of pipeline stage `stage` holds of them: virtual_stage_params(j * pp + stage)
  // summed over its chunks j = 0, 1, ... (the shape computed once).
  double stage_params(int stage) const;
  // The same held by one tensor-parallel shard: 1/tp of the split tensors and all of the
  // replicated ones (ModelShape::replicated_params_per_layer, position embeddings, final norm);
  // with tp = 1, exactly the former.
  double shard_params(int vstage) const;
  double shard_stage_params(int stage) const;
  // Bytes per element of working weights and of stored activations: the compute format,
  // except fp8, whose weights and activations are kept in 16 bits between matrix products.
  int weight_bytes() const;
  int activation_bytes() const;
  double peak_flops(DType d) const;  // FLOP/s per GPU, 0 if unsupported

  // Throws ScenarioError listing every broken invariant.
  static Plan from_scenario(const Scenario& scenario);
  // For configurations built in code (tests, sweeps): no file locations.
  static Plan from_config(const ScenarioConfig& config);
};

// The most gradient-bucket ops (buckets x reductions x data-parallel members) a plan may hold:
// about 2 GB of schedule and timeline and a few seconds to simulate. Llama 3 70B under FSDP on 64
// GPUs with 32 micro-batches and 25 MiB buckets holds 22M; a 22B model in 10 KiB buckets 275M.
inline constexpr double kMaxGradientBucketOps = 33554432;  // 2^25

// The layers of each of the stages x virtual_stages model chunks (pipeline order: chunk j on
// rank j % stages) when the file gives no layers_per_stage (DESIGN.md: "default: balanced").
// Where the chunks divide the layers, the even split (Megatron-LM's default). Otherwise balanced
// by forward FLOPs, the output layer counted on the last chunk and the embedding's lookup as
// nothing: first the ranks (each runs all its chunks for every micro-batch), so that the
// costliest is cheapest, ties with the most layers on the last, the ranks a layer short first
// (a 1F1B pipeline's earlier stages hold more micro-batches' activations); then each rank's
// layers over its chunks the same way; every chunk but the first and the last holding a layer.
// Llama 3 405B's 126 layers over 16 stages: 7 + 14 x 8 + 7, Llama 3's own (one layer fewer on
// the first and the last stage, Dubey et al. 2024, section 3.3.2); over 16 x 8 chunks 0 + 126 x
// 1 + 0. Empty when the layers are fewer than the chunks less two.
std::vector<int> default_layers_per_virtual_stage(const ModelConfig& model, int stages, int virtual_stages);
// The split a configuration runs: its layers_per_stage where written, else the default above
// (empty where that refuses). What a report of a configuration without its Plan shows.
std::vector<int> layers_per_virtual_stage_of(const ScenarioConfig& config);
// Whether every chunk holds the first one's count (an empty split too).
bool is_even_split(const std::vector<int>& layers);
// "7 + 14 x 8 + 7": a split with runs of equal counts folded.
std::string layer_split_text(const std::vector<int>& layers);
// ", layers 7 + 14 x 8 + 7" for a split whose chunks differ, "" for an even one: what a line
// describing a layout adds after its parallel sizes.
std::string uneven_layers_text(const std::vector<int>& layers);

}  // namespace trainsim
