#include "runtime/runtime_plan.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/diagnostics.h"

namespace trainsim::runtime {

namespace {

RuntimePlan build(const ScenarioConfig& scenario_config, const Scenario* scenario) {
  const RuntimeConfig& rt = scenario_config.runtime;
  std::vector<Diagnostic> errors;
  auto error = [&](const std::string& key, std::string message, std::initializer_list<std::string_view> related = {}) {
    if (scenario)
      errors.push_back(scenario->diagnostic(key, std::move(message), related));
    else
      errors.push_back(Diagnostic{"", {}, key, std::move(message)});
  };

  RuntimePlan out;
  ScenarioConfig c = scenario_config;
  const auto& par = scenario_config.parallelism;
  const int vstages = par.pipeline_parallel_size * par.virtual_pipeline_stages;

  // The executed model: a GPT-2 style decoder of the runtime section's size.
  ModelConfig m;
  m.num_layers = rt.num_layers;
  m.hidden_size = rt.hidden_size;
  m.num_attention_heads = rt.num_attention_heads;
  m.seq_length = rt.seq_length;
  m.vocab_size = rt.vocab_size;
  m.ffn_hidden_size = 4 * rt.hidden_size;
  m.untie_embeddings_and_output_weights = scenario_config.model.untie_embeddings_and_output_weights;
  m.hidden_dropout = m.attention_dropout = 0;  // the runtime's decoder has no dropout
  m.attention = AttentionKernel::naive;         // and writes its attention probabilities out
  c.model = m;
  out.dims = ModelDims{rt.num_layers, rt.hidden_size, rt.num_attention_heads, rt.seq_length, rt.vocab_size,
                       4 * rt.hidden_size, !m.untie_embeddings_and_output_weights};

  if (rt.hidden_size % rt.num_attention_heads != 0)
    error("runtime.model.hidden_size",
          fmt::format("hidden_size({}) is not divisible by num_attention_heads({})", rt.hidden_size,
                      rt.num_attention_heads),
          {"runtime.model.num_attention_heads"});
  // The plan's own rule decides whether the runtime model's layers fill the chunks (every chunk
  // but the first and the last holds one).
  if (default_layers_per_virtual_stage(m, par.pipeline_parallel_size, std::max(1, par.virtual_pipeline_stages))
          .empty())
    error("runtime.model.num_layers",
          fmt::format("the runtime model has {} layers but the plan has pipeline_parallel_size({}) * "
                      "virtual_pipeline_stages({}) = {} model chunks, each but the first and the last needing a "
                      "layer; give runtime.model.num_layers >= {}",
                      rt.num_layers, par.pipeline_parallel_size, par.virtual_pipeline_stages, vstages,
                      std::max(1, vstages - 2)),
          {"parallelism.pipeline_parallel_size", "parallelism.virtual_pipeline_stages"});
  if (scenario_config.precision.compute == DType::fp8)
    error("precision.compute", "the runtime does not emulate fp8 compute; use fp16, bf16, tf32 or fp32");
  // Context parallelism cuts each sequence into 2 x cp chunks (runtime/model/stage_layout.h).
  const int cp = par.context_parallel_size;
  if (cp > 1 && rt.seq_length % (2 * cp) != 0)
    error("runtime.model.seq_length",
          fmt::format("seq_length({}) is not divisible by 2 x context_parallel_size({}) = {}: each context-parallel "
                      "rank holds two of the sequence's 2 x {} equal chunks",
                      rt.seq_length, cp, 2 * cp, cp),
          {"parallelism.context_parallel_size"});
  if (!scenario_config.runtime.data_synthetic && rt.vocab_size < 256)
    error("runtime.model.vocab_size",
          fmt::format("vocab_size({}) is too small for byte-level text (256 tokens); use 256 or more, or "
                      "runtime.data.synthetic: true",
                      rt.vocab_size),
          {"runtime.data.path"});
  // Tensor parallelism shards the runtime model's heads, MLP and vocabulary (and, under sequence
  // parallelism, its rows): each must divide evenly (runtime/model/stage_layout.h).
  const int tp = par.tensor_parallel_size;
  if (tp > 1) {
    const auto tp_key = "parallelism.tensor_parallel_size";
    if (rt.num_attention_heads % tp != 0)
      error("runtime.model.num_attention_heads",
            fmt::format("num_attention_heads({}) is not divisible by tensor_parallel_size({}): each shard holds "
                        "whole heads",
                        rt.num_attention_heads, tp),
            {tp_key});
    if (rt.hidden_size % tp != 0 || (4 * rt.hidden_size) % tp != 0)
      error("runtime.model.hidden_size",
            fmt::format("hidden_size({}) and the MLP's ffn({}) must be divisible by tensor_parallel_size({})",
                        rt.hidden_size, 4 * rt.hidden_size, tp),
            {tp_key});
    if (rt.vocab_size % tp != 0)
      error("runtime.model.vocab_size",
            fmt::format("vocab_size({}) is not divisible by tensor_parallel_size({}): the embedding and the LM head "
                        "are split over the vocabulary",
                        rt.vocab_size, tp),
            {tp_key});
    if (par.sequence_parallel && (rt.seq_length / std::max(1, par.context_parallel_size)) % tp != 0)
      error("runtime.model.seq_length",
            fmt::format("seq_length({}){} is not divisible by tensor_parallel_size({}) under sequence_parallel: each "
                        "shard holds 1/{} of the {}",
                        rt.seq_length,
                        par.context_parallel_size > 1
                            ? fmt::format(" / context_parallel_size({})", par.context_parallel_size)
                            : std::string(),
                        tp, tp, par.context_parallel_size > 1 ? "context-parallel rank's rows" : "sequence"),
            {tp_key, "parallelism.sequence_parallel"});
  }
  if (!errors.empty()) throw ScenarioError(std::move(errors));

  // Layers per virtual stage: the scenario's split when it fits the runtime model, else the plan's
  // default for the runtime model (core/plan.h: even where the chunks divide the layers, else
  // balanced by forward FLOPs), so the full-size and the scaled plans are split by one rule; the
  // plan says so when the split is uneven.
  if (!par.layers_per_stage.empty() &&
      std::accumulate(par.layers_per_stage.begin(), par.layers_per_stage.end(), 0) != rt.num_layers) {
    c.parallelism.layers_per_stage.clear();
    out.notes.push_back(fmt::format(
        "parallelism.layers_per_stage does not sum to the runtime model's {} layers; they are split by the "
        "default rule",
        rt.num_layers));
  }

  // The runtime's context parallelism gathers the keys and values before each attention (its
  // decoder's unfused core has no per-chunk kernel for a ring to hide sends behind).
  if (cp > 1 && par.context_parallel_comm == ContextParallelComm::p2p)
    out.notes.push_back("context parallelism runs as all-gathers of the keys and values (context_parallel_comm: "
                        "all_gather), not a ring");
  c.parallelism.context_parallel_comm = ContextParallelComm::all_gather;
  // Transformer Engine's userbuffers overlap is a GPU library's: the runtimes' tensor-parallel
  // collectives run on the compute stream, exposed, and are predicted so.
  if (c.communication.tp_comm_overlap && tp > 1)
    out.notes.push_back("tensor-parallel collectives run exposed (communication.tp_comm_overlap is Transformer "
                        "Engine's userbuffers, priced for GPU runs only)");
  c.communication.tp_comm_overlap = false;
  c.cluster.num_gpus = c.parallelism.data_parallel_size * c.parallelism.pipeline_parallel_size *
                       c.parallelism.tensor_parallel_size * cp;
  c.cluster.gpus_per_node = std::max(1, std::min(c.cluster.gpus_per_node, c.cluster.num_gpus));
  out.plan = scenario ? [&] {
    Scenario s = *scenario;
    s.config = c;
    return Plan::from_scenario(s);
  }()
                      : Plan::from_config(c);
  out.plan.source = scenario ? scenario->file : "";
  out.plan.runtime_decoder = true;
  // recompute_num_layers counts layers of a chunk; the runtime model's chunks are the scaled ones.
  if (const int n = c.training.recompute_num_layers; n > 0 && c.training.activation_recompute == Recompute::full) {
    const auto& split = out.plan.layers_per_virtual_stage;
    const int most = split.empty() ? 0 : *std::max_element(split.begin(), split.end());
    if (!split.empty() && n >= most)
      out.notes.push_back(fmt::format("recompute_num_layers({}) covers every layer of the runtime model's chunks "
                                      "(at most {}): every layer is recomputed",
                                      n, most));
  }
  return out;
}

}  // namespace

RuntimePlan make_runtime_plan(const Scenario& scenario) { return build(scenario.config, &scenario); }
RuntimePlan make_runtime_plan(const ScenarioConfig& config) { return build(config, nullptr); }

namespace {
// The tensor- and context-parallel settings of every stage of the plan.
void set_model_parallel(StageSpec& spec, const Plan& plan, int tensor_parallel_rank, int context_parallel_rank) {
  spec.tensor_parallel_size = plan.tp;
  spec.tensor_parallel_rank = tensor_parallel_rank;
  spec.sequence_parallel = plan.tp > 1 && plan.config.parallelism.sequence_parallel;
  spec.context_parallel_size = plan.cp;
  spec.context_parallel_rank = context_parallel_rank;
}
}  // namespace

StageSpec stage_spec(const RuntimePlan& rp, int vs, int tensor_parallel_rank, int context_parallel_rank) {
  const Plan& plan = rp.plan;
  const int V = plan.num_virtual_stages();
  int first_layer = 0;
  for (int v = 0; v < vs; ++v) first_layer += plan.layers_per_virtual_stage[v];
  StageSpec spec;
  spec.dims = rp.dims;
  spec.first_layer = first_layer;
  spec.num_layers = plan.layers_per_virtual_stage[vs];
  spec.has_embedding = vs == 0;
  spec.has_head = vs == V - 1;
  spec.compute = plan.config.precision.compute;
  spec.grad_accumulation = plan.config.precision.grad_accumulation;
  spec.micro_batch_size = plan.micro_batch_size;
  spec.recompute = plan.config.training.activation_recompute;
  spec.recompute_blocks = recomputed_layers(plan.config.training, spec.num_layers);
  set_model_parallel(spec, plan, tensor_parallel_rank, context_parallel_rank);
  return spec;
}

StageSpec middle_stage_spec(const RuntimePlan& rp, int layers) {
  StageSpec spec;
  spec.dims = rp.dims;
  spec.first_layer = 0;
  spec.num_layers = layers;
  spec.compute = rp.plan.config.precision.compute;
  spec.grad_accumulation = rp.plan.config.precision.grad_accumulation;
  spec.micro_batch_size = rp.plan.micro_batch_size;
  spec.recompute = rp.plan.config.training.activation_recompute;
  spec.recompute_blocks = recomputed_layers(rp.plan.config.training, layers);
  set_model_parallel(spec, rp.plan, 0, 0);
  return spec;
}

OptimizerSettings optimizer_settings(const ScenarioConfig& cfg) {
  OptimizerSettings os;
  os.kind = cfg.training.optimizer;
  os.learning_rate = cfg.training.lr;
  os.beta1 = cfg.training.adam_beta1;
  os.beta2 = cfg.training.adam_beta2;
  os.eps = cfg.training.adam_eps;
  os.weight_decay = cfg.training.weight_decay;
  return os;
}

}  // namespace trainsim::runtime
