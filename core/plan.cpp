#include "core/plan.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/units.h"

namespace trainsim {

namespace {
// Dense peak of format `d`, 0 when the GPU lacks it (or the scenario left it out).
double peak_tflops_of(const ClusterConfig& cl, DType d) {
  auto it = cl.peak_tflops.find(d);
  return it == cl.peak_tflops.end() ? 0.0 : it->second;
}
}  // namespace

double Plan::peak_flops(DType d) const { return tflops_to_flops(peak_tflops_of(config.cluster, d)); }

namespace {
// Plan::virtual_stage_params with its shape given. Not inlined: a caller's sum of its results
// must round each result first, as a call to virtual_stage_params does (no fused multiply-add
// across the call).
[[gnu::noinline]] double virtual_stage_params_of(const Plan& plan, const ModelShape& m, int vs) {
  const int V = plan.num_virtual_stages();
  double p = plan.layers_per_virtual_stage.at(vs) * m.params_per_layer();
  if (vs == 0) p += m.embedding_params();
  if (vs == V - 1) {
    p += m.final_norm_params();
    if (!m.tied || V > 1) p += m.output_params();
  }
  return p;
}
}  // namespace

double Plan::virtual_stage_params(int vs) const { return virtual_stage_params_of(*this, shape(), vs); }
double Plan::virtual_stage_params(int vs, const ModelShape& m) const { return virtual_stage_params_of(*this, m, vs); }

double Plan::stage_params(int stage) const {
  const ModelShape m = shape();
  double params = 0;
  for (int j = 0; j < vpp; ++j) params += virtual_stage_params_of(*this, m, j * pp + stage);
  return params;
}

namespace {
// Plan::shard_params with its shape given (one ModelShape for a stage's virtual stages).
[[gnu::noinline]] double shard_params_of(const Plan& plan, const ModelShape& m, int vs) {
  if (plan.tp == 1) return virtual_stage_params_of(plan, m, vs);
  double replicated = plan.layers_per_virtual_stage.at(vs) * m.replicated_params_per_layer();
  if (vs == 0 && m.learned_positions) replicated += static_cast<double>(m.s) * m.h;
  if (vs == plan.num_virtual_stages() - 1) replicated += m.final_norm_params();
  return (virtual_stage_params_of(plan, m, vs) - replicated) / plan.tp + replicated;
}
}  // namespace

int Plan::cp_members_per_node() const {
  const int per_node = std::max(1, config.cluster.gpus_per_node);
  return std::clamp(per_node / tp, 1, cp);
}

double Plan::cp_gathered_kv_elements() const {
  const ModelShape m = shape();
  return static_cast<double>(micro_batch_size) * m.s * (2.0 * m.h / m.a * m.kv_heads) / tp;
}

ModelShape Plan::token_shape() const {
  if (cp == 1) return shape();
  ModelConfig local = config.model;
  local.seq_length = local_seq_length();
  ModelShape shape(local, framework == Framework::fsdp && !runtime_decoder);
  shape.keys = config.model.seq_length;  // its queries attend over the whole sequence's keys
  return shape;
}

double Plan::shard_params(int vs) const { return shard_params_of(*this, shape(), vs); }

double Plan::shard_stage_params(int stage) const {
  if (tp == 1) return stage_params(stage);
  const ModelShape m = shape();
  double params = 0;
  for (int j = 0; j < vpp; ++j) params += shard_params_of(*this, m, j * pp + stage);
  return params;
}

bool Plan::reduces_every_microbatch() const {
  if (zero() < 2) return false;
  return !(framework == Framework::fsdp && config.parallelism.fsdp_no_sync);
}
bool Plan::gathers_before_forward() const { return zero() == 3 || (zero() == 2 && framework == Framework::fsdp); }
bool Plan::gathers_before_backward() const { return zero() == 3; }
namespace {
// The units of virtual stage vs besides its layers, which ZeRO-3 gathers and FSDP reduces one by
// one: the embedding on the first chunk, the head (final norm and output layer) on the last, one
// unit of the two (embedding and final norm) with tied embeddings on a one-chunk pipeline.
struct EdgeUnits {
  bool embedding, head, merged;
  double head_params, merged_params;
};
EdgeUnits edge_units(const Plan& plan, const ModelShape& m, int vs) {
  const int V = plan.num_virtual_stages();
  EdgeUnits u{};
  u.embedding = vs == 0;
  u.head = vs == V - 1;
  u.merged = u.embedding && u.head && m.tied;
  u.head_params = m.final_norm_params() + (!m.tied || V > 1 ? m.output_params() : 0.0);
  u.merged_params = m.embedding_params() + m.final_norm_params();
  return u;
}
}  // namespace

Plan::GatherUnits Plan::zero3_gather_units(int vs, bool forward) const {
  const ModelShape m = shape();
  const int layers = layers_per_virtual_stage.at(vs);
  const auto [embedding, head, merged, head_params, merged_params] = edge_units(*this, m, vs);
  GatherUnits g;
  double first = 0;
  if (forward) {
    g.count = (embedding ? 1 : 0) + layers + (head && !merged ? 1 : 0);
    first = embedding ? (merged ? merged_params : m.embedding_params()) : layers > 0 ? m.params_per_layer() : head_params;
  } else {
    g.count = (head ? 1 : 0) + layers;
    first = head ? (merged ? merged_params : head_params) : m.params_per_layer();
  }
  const double whole = virtual_stage_params_of(*this, m, vs);
  if (g.count == 0 || whole <= 0) return {0, 0, 0};  // nothing to gather (a backward over the embedding alone)
  g.first_share = std::min(1.0, first / whole);
  const double left_out = !forward && embedding && !merged ? m.embedding_params() : 0.0;
  g.gathered_share = std::clamp(1.0 - left_out / whole, g.first_share, 1.0);
  return g;
}

bool Plan::gathers_after_step() const {
  return (zero() == 1 || (zero() == 2 && framework != Framework::fsdp)) && !gathers_before_first_forward();
}
bool Plan::gathers_before_first_forward() const {
  return zero() == 1 && framework == Framework::megatron && config.communication.overlap_param_gather;
}
bool Plan::shards_gradients() const { return zero() >= 2 && reduces_every_microbatch(); }
bool Plan::reduces_by_unit() const { return framework == Framework::fsdp && reduces_every_microbatch(); }

Bytes Plan::gradient_bytes(int vs) const {
  return static_cast<Bytes>(std::llround(shard_params(vs) * dtype_bytes(config.precision.allreduce)));
}

std::vector<Bytes> Plan::gradient_buckets(int vs) const {
  const Bytes grad = gradient_bytes(vs);
  std::vector<Bytes> out;
  if (data_shards() <= 1 || grad <= 0) return out;
  if (!reduces_by_unit()) {
    const Bytes b = std::max<Bytes>(1, static_cast<Bytes>(mib_to_bytes(config.communication.bucket_size_mib)));
    out.reserve(static_cast<std::size_t>((grad + b - 1) / b));
    for (Bytes off = 0; off < grad; off += b) out.push_back(std::min(b, grad - off));
    return out;
  }
  // The units' parameters in backward order, as shares of the shard's bytes (the last takes what
  // rounding leaves).
  const ModelShape m = shape();
  const EdgeUnits edge = edge_units(*this, m, vs);
  std::vector<double> units;
  if (edge.head && !edge.merged) units.push_back(edge.head_params);
  units.insert(units.end(), static_cast<std::size_t>(layers_per_virtual_stage.at(vs)), m.params_per_layer());
  if (edge.embedding) units.push_back(edge.merged ? edge.merged_params : m.embedding_params());
  const double whole = virtual_stage_params_of(*this, m, vs);
  double done = 0;
  Bytes given = 0;
  for (std::size_t i = 0; i < units.size(); ++i) {
    done += units[i];
    const Bytes upto =
        i + 1 == units.size() ? grad : std::min(grad, static_cast<Bytes>(std::llround(grad * done / whole)));
    if (upto > given) out.push_back(upto - given);
    given = std::max(given, upto);
  }
  return out;
}

double Plan::framework_bucket_bytes() const {
  const double wire = dtype_bytes(config.precision.allreduce);
  switch (framework) {
    case Framework::megatron: {
      // megatron/core/distributed/distributed_data_parallel.py: "make buckets larger [with the
      // data-parallel size] to ensure that chunks used in NCCL ring-reduce implementations are
      // large enough to remain bandwidth-bound"; bucket_size None (one bucket) without overlap.
      if (config.communication.overlap_grad_reduce) return std::max(40e6, 1e6 * dp) * wire;
      const ModelShape m = shape();
      double largest = 0;
      for (int vs = 0; vs < num_virtual_stages(); ++vs) largest = std::max(largest, shard_params_of(*this, m, vs));
      return largest > 0 ? std::ceil(largest * wire) : 40e6 * wire;
    }
    case Framework::deepspeed: return 5e8 * wire;  // zero_optimization.reduce_bucket_size
    case Framework::fsdp:
    case Framework::auto_select: break;
  }
  return 25.0 * kMiB;  // torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)
}

namespace {
const char* framework_key(Framework f) {  // as parallelism.framework writes it
  switch (f) {
    case Framework::megatron: return "megatron";
    case Framework::deepspeed: return "deepspeed";
    case Framework::fsdp: return "fsdp";
    case Framework::auto_select: break;
  }
  return "auto";
}
}  // namespace

std::string Plan::framework_name() const { return framework_key(framework); }

std::string Plan::zero_and_recompute() const {
  const std::string recompute = recompute_text(config.training);
  return zero() > 0 ? fmt::format("ZeRO {} ({}), recompute {}", zero(), framework_name(), recompute)
                    : fmt::format("recompute {}", recompute);
}

std::string Plan::framework_setting() const {
  const int z = config.parallelism.zero_stage;
  if (data_shards() <= 1) return "no data parallelism (data_parallel_size 1): nothing is reduced or sharded across replicas";
  const char* grads_each = "gradients reduce-scattered after every micro-batch's backward";
  std::string what;
  switch (framework) {
    case Framework::megatron:
      if (z == 0) what = "DistributedDataParallel (gradients all-reduced once per step)";
      else if (z == 1)
        what = gathers_before_first_forward()
                   ? "--use-distributed-optimizer --overlap-param-gather (gradients reduce-scattered once per step, "
                     "updated parameters all-gathered before each chunk's first forward of the next, beside it)"
                   : "--use-distributed-optimizer (gradients reduce-scattered once per step, updated parameters "
                     "all-gathered after the optimizer step)";
      else
        what = fmt::format("--use-megatron-fsdp --data-parallel-sharding-strategy {} ({}{})",
                           z == 2 ? "optim_grads" : "optim_grads_params",
                           z == 3 ? "parameters gathered for every micro-batch's forward and backward, " : "", grads_each);
      break;
    case Framework::deepspeed:
      what = fmt::format("zero_optimization.stage: {} ({})", z,
                         z == 0   ? "gradients all-reduced at the gradient-accumulation boundary"
                         : z == 1 ? "gradients reduced once per step, at the accumulation boundary; updated "
                                    "parameters all-gathered after the step"
                         : z == 2 ? "gradients reduce-scattered after every micro-batch; updated parameters "
                                    "all-gathered after the step"
                                  : "parameters gathered for every micro-batch's forward and backward, gradients "
                                    "reduce-scattered after every micro-batch");
      break;
    case Framework::fsdp: {
      const bool no_sync = config.parallelism.fsdp_no_sync;
      const std::string grads = no_sync ? "unsharded gradients accumulated, reduce-scattered after the last "
                                          "micro-batch (no_sync)"
                                        : grads_each;
      if (z == 0) what = "NO_SHARD / DDP (gradients all-reduced once per step)";
      else if (z == 2)
        what = fmt::format("fully_shard(reshard_after_forward=False) / SHARD_GRAD_OP (parameters gathered once per "
                           "micro-batch, kept through its backward; {})",
                           grads);
      else
        what = fmt::format("fully_shard(reshard_after_forward=True) / FULL_SHARD (parameters gathered for every "
                           "micro-batch's forward and backward; {})",
                           grads);
      break;
    }
    case Framework::auto_select: break;
  }
  return what;
}

int Plan::weight_bytes() const {
  return config.precision.compute == DType::fp8 ? 2 : dtype_bytes(config.precision.compute);
}
int Plan::activation_bytes() const { return weight_bytes(); }

namespace {

class Checker {
 public:
  explicit Checker(const Scenario& sc) : sc_(sc) {}
  void error(const std::string& key, std::string message, std::initializer_list<std::string_view> related = {}) {
    errors.push_back(sc_.diagnostic(key, std::move(message), related));
  }
  std::vector<Diagnostic> errors;

 private:
  const Scenario& sc_;
};

// What to suggest instead of an unsupported compute format, from what the GPU has.
std::string supported_alternatives(const ClusterConfig& cl, DType missing) {
  auto has = [&](DType d) { return peak_tflops_of(cl, d) > 0; };
  if (missing == DType::bf16 && has(DType::fp16)) return "fp16 with dynamic loss scaling";
  std::vector<std::string> options;
  for (DType d : {DType::bf16, DType::fp16})
    if (d != missing && has(d)) options.emplace_back(dtype_name(d));
  return options.empty() ? std::string("fp32") : fmt::format("{}", fmt::join(options, " or "));
}

void check_and_derive(const Scenario& sc, Plan& plan) {
  Checker ck(sc);
  const ScenarioConfig& c = sc.config;
  const ModelConfig& m = c.model;
  const ClusterConfig& cl = c.cluster;
  const ParallelismConfig& par = c.parallelism;
  const PrecisionConfig& pr = c.precision;
  const int d = par.data_parallel_size, p = par.pipeline_parallel_size, t = par.tensor_parallel_size;
  const int v = par.virtual_pipeline_stages, cp = par.context_parallel_size;

  // ---- GPUs ------------------------------------------------------------------------
  const long long model_parallel = static_cast<long long>(p) * t * cp;
  if (d * model_parallel != cl.num_gpus)
    ck.error("parallelism.data_parallel_size",
             fmt::format("data_parallel_size({}) * pipeline_parallel_size({}) * tensor_parallel_size({}){} = {} != "
                         "num_gpus({}){}",
                         d, p, t, cp > 1 ? fmt::format(" * context_parallel_size({})", cp) : std::string(),
                         d * model_parallel, cl.num_gpus,
                         // data_parallel_size, when not written, is num_gpus / (p * t * c): say why it could not be
                         cl.num_gpus % model_parallel != 0
                             ? fmt::format(" (num_gpus is not a multiple of pipeline x tensor{} = {})",
                                           cp > 1 ? " x context" : "", model_parallel)
                             : std::string()),
             {"parallelism.pipeline_parallel_size", "parallelism.tensor_parallel_size", "cluster.num_gpus"});
  if (cl.num_gpus > cl.gpus_per_node && cl.num_gpus % cl.gpus_per_node != 0)
    ck.error("cluster.num_gpus", fmt::format("num_gpus({}) is not a whole number of nodes of gpus_per_node({})",
                                             cl.num_gpus, cl.gpus_per_node));
  if (cl.collective_sms > 0 && cl.collective_sms >= cl.sm_count)
    ck.error("cluster.collective_sms",
             fmt::format("collective_sms({}) leaves no SM for compute of sm_count({})", cl.collective_sms, cl.sm_count),
             {"cluster.sm_count"});
  // Transformer Engine's userbuffers register one node's buffers with each other (CUDA IPC over
  // NVLink) and overlap sequence parallelism's collectives: Megatron-LM asserts both.
  if (c.communication.tp_comm_overlap && t > 1 && !c.parallelism.sequence_parallel)
    ck.error("communication.tp_comm_overlap",
             "tp_comm_overlap overlaps sequence parallelism's all-gathers and reduce-scatters with their products: "
             "set parallelism.sequence_parallel (Megatron-LM asserts it for --tp-comm-overlap)",
             {"parallelism.sequence_parallel"});
  if (c.communication.tp_comm_overlap && t > cl.gpus_per_node)
    ck.error("communication.tp_comm_overlap",
             fmt::format("tp_comm_overlap needs the tensor-parallel group inside one node (Transformer Engine's "
                         "userbuffers share its GPUs' memory over NVLink): tensor_parallel_size({}) > "
                         "gpus_per_node({})",
                         t, cl.gpus_per_node),
             {"parallelism.tensor_parallel_size", "cluster.gpus_per_node"});
  // The collective model prices a group as ceil(t / gpus_per_node) nodes of at most gpus_per_node
  // (sim/cost/compute_model.cpp, FrameworkPricer::tp_group): right for a group over whole nodes,
  // optimistic for groups that straddle a node boundary.
  if (t > 1 && t > cl.gpus_per_node)
    plan.warnings.push_back(fmt::format(
        "tensor_parallel_size({}) spans {} nodes of {} GPUs: its per-layer collectives cross the inter-node "
        "network (priced as NCCL's rings over the nodes' NICs), far slower than NVLink; Megatron-LM keeps a "
        "tensor-parallel group inside a node",
        t, (t + cl.gpus_per_node - 1) / cl.gpus_per_node, cl.gpus_per_node));
  else if (t > 1 && cl.gpus_per_node % t != 0 && cl.num_gpus > cl.gpus_per_node)
    plan.warnings.push_back(fmt::format(
        "tensor_parallel_size({}) does not divide a node of {} GPUs: some tensor-parallel groups straddle two "
        "nodes, and their per-layer collectives would cross the inter-node network; every group is costed "
        "inside one node here",
        t, cl.gpus_per_node));

  // ---- model -----------------------------------------------------------------------
  const int a = m.num_attention_heads;
  if (m.hidden_size % a != 0)
    ck.error("model.num_attention_heads", fmt::format("num_attention_heads({}) does not divide hidden_size({}): "
                                                      "hidden_size % num_attention_heads = {}",
                                                      a, m.hidden_size, m.hidden_size % a));
  const int groups = m.num_query_groups > 0 ? m.num_query_groups : a;
  if (a % groups != 0)
    ck.error("model.num_query_groups",
             fmt::format("num_query_groups({}) does not divide num_attention_heads({})", groups, a));
  if (a % t != 0)
    ck.error("parallelism.tensor_parallel_size",
             fmt::format("tensor_parallel_size({}) does not divide num_attention_heads({})", t, a));
  else if (groups % t != 0)
    ck.error("parallelism.tensor_parallel_size",
             fmt::format("tensor_parallel_size({}) does not divide num_query_groups({})", t, groups));
  const int ffn = m.ffn_hidden_size > 0 ? m.ffn_hidden_size : 4 * m.hidden_size;
  if (ffn % t != 0)
    ck.error("parallelism.tensor_parallel_size",
             fmt::format("tensor_parallel_size({}) does not divide ffn_hidden_size({})", t, ffn));
  if (par.sequence_parallel && t == 1)
    ck.error("parallelism.sequence_parallel", "sequence_parallel needs tensor_parallel_size > 1 (it is 1)");
  // Context parallelism cuts each sequence into 2c chunks (the causal mask's work even over the
  // c GPUs); its attention core (below, with the framework) runs over the gathered keys.
  if (cp > 1) {
    if (m.seq_length % (2 * cp) != 0)
      ck.error("parallelism.context_parallel_size",
               fmt::format("context_parallel_size({}) splits each sequence into 2 x {} = {} chunks, which do not "
                           "divide seq_length({})",
                           cp, cp, 2 * cp, m.seq_length),
               {"model.seq_length"});
    if (static_cast<long long>(t) * cp > cl.gpus_per_node && cl.gpus_per_node % t != 0)
      ck.error("parallelism.context_parallel_size",
               fmt::format("tensor_parallel_size({}) does not divide a node of {} GPUs: the context-parallel "
                           "groups of tensor_parallel_size x context_parallel_size = {} GPUs would straddle nodes "
                           "unevenly",
                           t, cl.gpus_per_node, t * cp),
               {"parallelism.tensor_parallel_size", "cluster.gpus_per_node"});
  }

  // ---- pipeline --------------------------------------------------------------------
  const bool interleaved = par.schedule == ScheduleKind::interleaved_1f1b;
  if (v > 1 && !interleaved)
    ck.error("parallelism.virtual_pipeline_stages",
             fmt::format("virtual_pipeline_stages({}) > 1 needs schedule: interleaved-1f1b (schedule is {})", v,
                         schedule_name(par.schedule)));
  if (interleaved && v < 2)
    ck.error("parallelism.schedule", fmt::format("interleaved-1f1b needs virtual_pipeline_stages >= 2 (it is {})", v));
  if (interleaved && p < 2)
    ck.error("parallelism.schedule", "interleaved-1f1b needs pipeline_parallel_size >= 2 (it is 1)");
  const int vstages = p * v;
  if (!par.layers_per_stage.empty()) {
    const int sum = std::accumulate(par.layers_per_stage.begin(), par.layers_per_stage.end(), 0);
    if (static_cast<int>(par.layers_per_stage.size()) != vstages)
      ck.error("parallelism.layers_per_stage",
               fmt::format("has {} entries; pipeline_parallel_size({}) * virtual_pipeline_stages({}) = {} needed",
                           par.layers_per_stage.size(), p, v, vstages));
    else if (sum != m.num_layers)
      ck.error("parallelism.layers_per_stage",
               fmt::format("sums to {} layers but num_layers is {}", sum, m.num_layers));
    else
      plan.layers_per_virtual_stage = par.layers_per_stage;
  } else if (std::vector<int> split = default_layers_per_virtual_stage(m, p, v); split.empty()) {
    ck.error("model.num_layers",
             fmt::format("num_layers({}) cannot fill pipeline_parallel_size({}) * virtual_pipeline_stages({}) = {} "
                         "model chunks: every chunk but the first and the last needs a layer; use fewer stages or "
                         "give parallelism.layers_per_stage",
                         m.num_layers, p, v, vstages),
             // A preset's layer count: the stage counts written are what to change.
             {"parallelism.virtual_pipeline_stages", "parallelism.pipeline_parallel_size"});
  } else {
    if (m.num_layers % vstages != 0) {
      const ModelShape shape(m);
      plan.warnings.push_back(fmt::format(
          "num_layers({}) does not divide into pipeline_parallel_size({}) * virtual_pipeline_stages({}) = {} model "
          "chunks: split {} (balanced by forward FLOPs over the ranks, then over each rank's chunks, the output "
          "layer as {:.2f} of a layer on the last chunk and those a layer short first, as Llama 3 split its 126 "
          "layers; Megatron-Core runs any split "
          "with --pipeline-model-parallel-layout, one whose first and last stages alone differ with "
          "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers); "
          "parallelism.layers_per_stage sets another",
          m.num_layers, p, v, vstages, layer_split_text(split),
          shape.lm_head_forward_flops(1) / shape.layer_forward_flops(1)));
    }
    plan.layers_per_virtual_stage = std::move(split);
  }

  if (c.training.recompute_num_layers > 0 && c.training.activation_recompute != Recompute::full)
    ck.error("training.recompute_num_layers",
             fmt::format("recompute_num_layers({}) chooses the layers full recompute rebuilds; activation_recompute "
                         "is {}: set it to full, or recompute_num_layers to 0",
                         c.training.recompute_num_layers, recompute_name(c.training.activation_recompute)),
             {"training.activation_recompute"});

  // ---- batch -----------------------------------------------------------------------
  const int b = c.training.micro_batch_size;
  const long long per_step = static_cast<long long>(b) * d;  // samples per micro-batch step, all replicas
  const long long gb = c.training.global_batch_size > 0 ? c.training.global_batch_size : per_step;
  constexpr long long kMaxBatch = 1 << 30;
  if (gb > kMaxBatch)
    ck.error("training.micro_batch_size",
             fmt::format("micro_batch_size({}) * data_parallel_size({}) = {} samples per step is more than {}", b, d,
                         gb, kMaxBatch),
             {"training.global_batch_size", "parallelism.data_parallel_size"});
  else if (gb % per_step != 0)
    ck.error("training.global_batch_size",
             fmt::format("global_batch_size({}) is not divisible by micro_batch_size({}) * data_parallel_size({}) = {}",
                         gb, b, d, per_step));
  const int mb = static_cast<int>(gb / per_step);
  // Megatron-Core's rule for its groups of n micro-batches (forward_backward_pipelining_with_
  // interleaving): p <= n <= m, and a last group of fewer than n at least p (else the pipeline
  // waits on its own dependencies). With n = p that is m a multiple of p.
  const int group = par.microbatch_group_size > 0 ? par.microbatch_group_size : p;
  plan.microbatch_group = group;
  if (interleaved && par.microbatch_group_size <= 0 && mb % p != 0)
    ck.error("training.global_batch_size",
             fmt::format("interleaved-1f1b needs micro-batches per replica ({}) to be a multiple of "
                         "pipeline_parallel_size({}), or parallelism.microbatch_group_size set so that they divide "
                         "into its groups",
                         mb, p));
  else if (interleaved && (group < p || group > mb))
    ck.error("parallelism.microbatch_group_size",
             fmt::format("microbatch_group_size({}) must lie between pipeline_parallel_size({}) and the micro-batches "
                         "per replica ({})",
                         group, p, mb));
  else if (interleaved && mb % group != 0 && mb % group < p)
    ck.error("parallelism.microbatch_group_size",
             fmt::format("micro-batches per replica ({}) leave a last group of {} after groups of "
                         "microbatch_group_size({}): fewer than pipeline_parallel_size({}), which stalls the pipeline",
                         mb, mb % group, group, p));
  if (p > 1 && mb < p)
    plan.warnings.push_back(fmt::format(
        "only {} micro-batches for {} pipeline stages: at least {:.0f}% of every step is pipeline bubble "
        "((p-1)/(m+p-1)); raise global_batch_size or lower micro_batch_size",
        mb, p, 100.0 * (p - 1) / (mb + p - 1)));

  // ---- precision -------------------------------------------------------------------
  auto require_rate = [&](DType dt, const std::string& key) {
    if (peak_tflops_of(cl, dt) <= 0)
      ck.error(key,
               fmt::format("{} is not supported by GPU {} (cluster.peak_tflops.{} is 0); use {}", dtype_name(dt),
                           cl.gpu.empty() ? std::string("of this cluster") : cl.gpu, dtype_name(dt),
                           supported_alternatives(cl, dt)),
               {"cluster.gpu", fmt::format("cluster.peak_tflops.{}", dtype_name(dt))});
  };
  require_rate(pr.compute, "precision.compute");
  if (pr.allreduce == DType::bf16 && pr.compute != DType::bf16) require_rate(DType::bf16, "precision.allreduce");
  if (pr.master_weights != DType::fp32 && pr.master_weights != pr.compute &&
      !(pr.compute == DType::fp8 && pr.master_weights == DType::bf16))
    ck.error("precision.master_weights",
             fmt::format("master_weights {} with compute {}: use fp32 (mixed precision) or the compute format",
                         dtype_name(pr.master_weights), dtype_name(pr.compute)));

  // Numerics warnings: the mechanisms behind loss spikes and NaNs.
  const bool fp16 = pr.compute == DType::fp16;
  if (fp16 && pr.loss_scaling.mode == LossScalingMode::none)
    plan.warnings.push_back("fp16 compute without loss scaling: gradients below 6e-8 underflow to zero");
  if (fp16 && pr.loss_scaling.mode == LossScalingMode::static_scale)
    plan.warnings.push_back(fmt::format(
        "fp16 with a static loss scale ({:g}): a scale too high overflows to inf on every step and never backs off; "
        "use mode: dynamic",
        pr.loss_scaling.initial_scale));
  if (pr.allreduce == DType::fp16 && pr.allreduce_divide == AllReduceDivide::after && d > 1)
    plan.warnings.push_back(fmt::format(
        "fp16 all-reduce summed before dividing by data_parallel_size({}): partial sums reach {}x a replica's "
        "gradient and overflow fp16's 65504 first; use allreduce_divide: before or allreduce: fp32",
        d, d));
  if (pr.grad_accumulation == DType::fp16 || pr.grad_accumulation == DType::bf16) {
    if (mb > 1)
      plan.warnings.push_back(fmt::format(
          "{} gradient accumulation over {} micro-batches: each add rounds to {} significant bits; use "
          "grad_accumulation: fp32",
          dtype_name(pr.grad_accumulation), mb, pr.grad_accumulation == DType::fp16 ? 11 : 8));
  }
  if (pr.overflow_check == OverflowScope::local && (d > 1 || p > 1) &&
      (fp16 || pr.loss_scaling.mode != LossScalingMode::none))
    plan.warnings.push_back(
        "overflow_check: local: each stage and replica decides alone whether to skip a step, so they can skip "
        "different steps and their weights drift apart; use overflow_check: global");
  // ---- data-parallel framework ------------------------------------------------------
  const int zs = par.zero_stage;
  Framework fw = par.framework;
  if (fw == Framework::auto_select) fw = zs >= 2 ? Framework::deepspeed : Framework::megatron;
  if (fw == Framework::fsdp && interleaved && par.microbatch_group_size > 0 && par.microbatch_group_size != p)
    ck.error("parallelism.microbatch_group_size",
             fmt::format("microbatch_group_size({}) is Megatron-Core's; PyTorch's interleaved schedule (framework "
                         "fsdp) runs groups of pipeline_parallel_size({})",
                         par.microbatch_group_size, p));
  // Megatron-LM's interleaved schedule without p2p overlap exchanges with both neighbours in one
  // batch per step (send_forward_backward_recv_forward_backward).
  if (interleaved && !c.communication.overlap_p2p_comm) {
    if (fw == Framework::megatron && p <= 2)
      ck.error("communication.overlap_p2p_comm",
               fmt::format("Megatron-LM refuses interleaved-1f1b without p2p overlap on pipeline_parallel_size({}) "
                           "<= 2: \"pipeline-model-parallel size should be greater than 2 to avoid having multiple "
                           "p2p sends and recvs between same 2 ranks per communication batch\" (arguments.py); "
                           "set overlap_p2p_comm: true",
                           p));
    // Megatron-Core posts each receive in the iteration its neighbour sends (its first stage
    // "ahead of the last by p - 1") and queues the tensor; trainsim places a blocking receive
    // before the task that reads it, which matches that only for groups of p. (PyTorch's
    // schedule, framework fsdp, has no such groups: refused above.)
    if (group != p && fw != Framework::fsdp)
      ck.error("parallelism.microbatch_group_size",
               fmt::format("microbatch_group_size({}) other than pipeline_parallel_size({}) with blocking pipeline "
                           "exchanges (overlap_p2p_comm: false) is not modelled: Megatron-Core receives each tensor in "
                           "the iteration its neighbour sends it and queues it; set overlap_p2p_comm: true or "
                           "microbatch_group_size: {}",
                           group, p, p));
  }
  const bool named = par.framework != Framework::auto_select;
  if (fw == Framework::deepspeed && zs >= 2 && p > 1)
    ck.error("parallelism.zero_stage",
             fmt::format("DeepSpeed refuses ZeRO-{} with pipeline_parallel_size({}) > 1: its PipelineEngine asserts "
                         "\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\" (partitioned gradients "
                         "would be reduce-scattered for every micro-batch of every stage){}",
                         zs, p,
                         named ? "; use zero_stage 1, or parallelism.framework: fsdp (torchtitan runs FSDP2 with "
                                 "pipeline parallelism)"
                               : "; zero_stage 2-3 follow DeepSpeed unless parallelism.framework names another (fsdp: "
                                 "torchtitan runs FSDP2 with pipeline parallelism)"),
             {"parallelism.pipeline_parallel_size", "parallelism.framework"});
  if (fw == Framework::fsdp && zs == 1)
    ck.error("parallelism.zero_stage",
             "framework fsdp has no optimizer-only sharding (ShardingStrategy has NO_SHARD, SHARD_GRAD_OP, FULL_SHARD): "
             "use zero_stage 0 (DDP), 2 (reshard_after_forward=False) or 3 (reshard_after_forward=True)",
             {"parallelism.framework"});
  if (c.communication.overlap_param_gather && (zs != 1 || fw != Framework::megatron))
    ck.error("communication.overlap_param_gather",
             fmt::format("overlap_param_gather is Megatron-LM's --overlap-param-gather, which needs its distributed "
                         "optimizer: zero_stage 1 under framework megatron (it is zero_stage {}, framework {}){}",
                         zs, framework_key(fw),
                         zs >= 2 ? "; ZeRO-2/3 and FSDP place their gathers themselves" : ""),
             {"parallelism.zero_stage", "parallelism.framework"});
  if (par.fsdp_no_sync && fw != Framework::fsdp)
    ck.error("parallelism.fsdp_no_sync",
             fmt::format("fsdp_no_sync needs parallelism.framework: fsdp (it is {})",
                         framework_key(fw)),
             {"parallelism.framework"});

  // The ring (Transformer Engine's p2p, Megatron-Core's default) runs attention one chunk of keys
  // at a time, a kernel per step: flash or cudnn. Gathered keys (all_gather) suit any core; an
  // unfused one holds the GPU's s/c x s scores (the runtime's decoder runs so).
  const ContextParallelComm cp_comm = par.context_parallel_comm != ContextParallelComm::auto_select
                                          ? par.context_parallel_comm
                                      : fw == Framework::megatron ? ContextParallelComm::p2p
                                                                  : ContextParallelComm::all_gather;
  if (cp > 1 && cp_comm == ContextParallelComm::p2p && !single_kernel_attention(m.attention))
    ck.error("parallelism.context_parallel_size",
             fmt::format("context_parallel_size({}) as a ring (context_parallel_comm {}) needs model.attention "
                         "flash or cudnn (it is {}): the ring runs attention a chunk of keys at a time; use "
                         "context_parallel_comm: all_gather for an unfused core",
                         cp, par.context_parallel_comm == ContextParallelComm::p2p ? "p2p" : "auto, under megatron",
                         m.attention == AttentionKernel::fused ? "fused" : "naive"),
             {"model.attention", "parallelism.context_parallel_comm"});
  if (!ck.errors.empty()) throw ScenarioError(std::move(ck.errors));

  plan.config = c;
  plan.source = sc.file;
  plan.dp = d;
  plan.pp = p;
  plan.tp = t;
  plan.cp = cp;
  plan.cp_comm = cp_comm;
  // ZB-H1 runs the weight-gradient products later: nothing of the backward to overlap them with.
  plan.tp_backward_overlapped = t > 1 && c.parallelism.schedule != ScheduleKind::zb_h1 &&
                                (c.communication.tp_backward_comm == TpBackwardComm::auto_select
                                     ? fw == Framework::megatron
                                     : c.communication.tp_backward_comm == TpBackwardComm::overlapped);
  plan.vpp = v;
  plan.num_microbatches = mb;
  plan.framework = fw;
  plan.micro_batch_size = b;
  plan.global_batch_size = static_cast<int>(gb);
  if (plan.config.communication.bucket_size_mib <= 0 && plan.data_shards() > 1)  // (else nothing is reduced)
    plan.config.communication.bucket_size_mib = plan.framework_bucket_bytes() / kMiB;

  // Every gradient bucket is a collective of the schedule with an op on each member's program,
  // once a step or (ZeRO-2/3 reducing after each backward) once a micro-batch. A bucket thousands
  // of times smaller than the gradients makes tens of millions of ops, gigabytes to hold and
  // minutes to walk: refused with the smallest bucket that stays under the bound.
  if (plan.data_shards() > 1 && !plan.reduces_by_unit()) {  // (units: a few per layer)
    const double bucket = std::max(1.0, mib_to_bytes(plan.config.communication.bucket_size_mib));
    const double reductions = plan.reduces_every_microbatch() ? mb : 1, members = plan.data_shards();
    double buckets = 0, gradient_bytes = 0;
    for (int vs = 0; vs < plan.num_virtual_stages(); ++vs) {  // gradient_buckets(vs).size(), not materialised
      const auto g = static_cast<double>(plan.gradient_bytes(vs));
      buckets += std::ceil(g / bucket);
      gradient_bytes += g;
    }
    const double ops = buckets * reductions * members;
    if (ops > kMaxGradientBucketOps) {
      const double room = kMaxGradientBucketOps / (reductions * members) - plan.num_virtual_stages();
      const double least_mib = std::ceil(gradient_bytes / std::max(1.0, room) / kMiB);
      ck.error("communication.bucket_size_mib",
               fmt::format("bucket_size_mib({:g}) cuts {:.1f} GB of gradients into {:.0f} buckets{} over {:g} "
                           "data-parallel members: {:.3g} ops, more than the {:.3g} trainsim simulates (each bucket is "
                           "an op of every member's program); use bucket_size_mib >= {:g} (PyTorch DDP's default is 25)",
                           plan.config.communication.bucket_size_mib, gradient_bytes / 1e9, buckets,
                           reductions > 1 ? fmt::format(", reduced after each of {:g} micro-batches,", reductions) : "",
                           members, ops, kMaxGradientBucketOps, least_mib));
      throw ScenarioError(std::move(ck.errors));
    }
  }
}

}  // namespace

Plan Plan::from_scenario(const Scenario& scenario) {
  Plan plan;
  check_and_derive(scenario, plan);
  return plan;
}

Plan Plan::from_config(const ScenarioConfig& config) {
  Scenario sc;  // no file: diagnostics name only the key path
  sc.config = config;
  return from_scenario(sc);
}

namespace {
// `layers` over mins.size() parts, part i holding at least mins[i], so that the costliest part is
// cheapest, a part costing its layers and the last `extra` more; ties with the most layers on the
// last part, the parts a layer short first. Given the last part's count n, the others hold the
// rest with their costliest at max(their largest minimum, ceil(rest / others)), which a split
// reaches; so the best split is the best n. Empty when the minimums exceed the layers.
std::vector<int> balanced_split(int layers, const std::vector<int>& mins, double extra) {
  const int parts = static_cast<int>(mins.size()), others = parts - 1;
  const int others_min = std::accumulate(mins.begin(), mins.end() - 1, 0);
  const int others_floor = others > 0 ? *std::max_element(mins.begin(), mins.end() - 1) : 0;
  if (others_min + mins.back() > layers) return {};
  if (others == 0) return {layers};
  int last = mins.back(), level = 0;
  double best = std::numeric_limits<double>::infinity();
  for (int n = mins.back(); n <= layers - others_min; ++n) {
    if (n + extra > best) break;  // the last part alone costs more from here on
    const int most = std::max(others_floor, (layers - n + others - 1) / others);
    const double cost = std::max(static_cast<double>(most), n + extra);
    if (cost <= best) {  // ties: the most layers on the last part
      best = cost;
      last = n;
      level = most;
    }
  }
  // The others filled like water from their minimums: each holds max(its minimum, w) for the
  // highest w the rest allows, and what is left goes a layer each to the latest of those at w
  // (the short ones come first); none passes `level`.
  const int rest = layers - last;
  auto filled = [&](int w) {
    int sum = 0;
    for (int i = 0; i < others; ++i) sum += std::max(mins[static_cast<std::size_t>(i)], w);
    return sum;
  };
  int w = 0;
  while (w < level && filled(w + 1) <= rest) ++w;
  std::vector<int> split(static_cast<std::size_t>(parts));
  for (int i = 0; i < others; ++i) split[static_cast<std::size_t>(i)] = std::max(mins[static_cast<std::size_t>(i)], w);
  split.back() = last;
  int left = rest - filled(w);
  for (int i = others - 1; i >= 0 && left > 0; --i)
    if (split[static_cast<std::size_t>(i)] == w) {
      ++split[static_cast<std::size_t>(i)];
      --left;
    }
  return split;
}
}  // namespace

std::vector<int> default_layers_per_virtual_stage(const ModelConfig& model, int stages, int virtual_stages) {
  const int layers = model.num_layers, chunks = stages * virtual_stages;
  if (stages < 1 || virtual_stages < 1 || layers < 1) return {};
  if (layers % chunks == 0) return std::vector<int>(static_cast<std::size_t>(chunks), layers / chunks);
  const ModelShape shape(model);
  const double layer = shape.layer_forward_flops(1);
  const double head = layer > 0 ? shape.lm_head_forward_flops(1) / layer : 0.0;  // in layers
  // Every chunk holds a layer but the first (the embedding can stand alone) and the last (the
  // output layer). A rank runs all its chunks for every micro-batch: the ranks are balanced
  // first, then each rank's layers over its chunks (chunk j lives on rank j % stages), the output
  // layer on the last rank's last chunk.
  auto needs_layer = [&](int j) { return j != 0 && j != chunks - 1 ? 1 : 0; };
  std::vector<int> rank_mins(static_cast<std::size_t>(stages));
  for (int j = 0; j < chunks; ++j) rank_mins[static_cast<std::size_t>(j % stages)] += needs_layer(j);
  const std::vector<int> ranks = balanced_split(layers, rank_mins, head);
  if (ranks.empty()) return {};
  std::vector<int> split(static_cast<std::size_t>(chunks));
  for (int r = 0; r < stages; ++r) {
    std::vector<int> chunk_mins(static_cast<std::size_t>(virtual_stages));
    for (int v = 0; v < virtual_stages; ++v) chunk_mins[static_cast<std::size_t>(v)] = needs_layer(v * stages + r);
    const std::vector<int> own =
        balanced_split(ranks[static_cast<std::size_t>(r)], chunk_mins, r == stages - 1 ? head : 0.0);
    for (int v = 0; v < virtual_stages; ++v)
      split[static_cast<std::size_t>(v * stages + r)] = own[static_cast<std::size_t>(v)];
  }
  return split;
}

std::string layer_split_text(const std::vector<int>& layers) {
  std::vector<std::string> runs;
  for (std::size_t i = 0; i < layers.size();) {
    std::size_t j = i;
    while (j < layers.size() && layers[j] == layers[i]) ++j;
    runs.push_back(j - i > 1 ? fmt::format("{} x {}", j - i, layers[i]) : std::to_string(layers[i]));
    i = j;
  }
  return fmt::format("{}", fmt::join(runs, " + "));
}

std::vector<int> layers_per_virtual_stage_of(const ScenarioConfig& config) {
  const auto& p = config.parallelism;
  if (!p.layers_per_stage.empty()) return p.layers_per_stage;
  return default_layers_per_virtual_stage(config.model, p.pipeline_parallel_size, std::max(1, p.virtual_pipeline_stages));
}

bool is_even_split(const std::vector<int>& layers) {
  return std::adjacent_find(layers.begin(), layers.end(), std::not_equal_to<>()) == layers.end();
}

std::string uneven_layers_text(const std::vector<int>& layers) {
  return is_even_split(layers) ? "" : ", layers " + layer_split_text(layers);
}

}  // namespace trainsim
