#include "core/config_fields.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <iterator>
#include <stdexcept>

#include <fmt/format.h>

#include "core/diagnostics.h"
#include "core/general6.h"
#include "core/hardware_profile.h"
#include "core/presets.h"

namespace trainsim {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

template <class T>
using Ref = T& (*)(ScenarioConfig&);

// Getters reuse the setter's accessor on a const config.
template <class T>
T& deref(Ref<T> ref, const ScenarioConfig& c) {
  return ref(const_cast<ScenarioConfig&>(c));
}

// Unary + turns the captureless lambda into a plain function pointer, so T is deduced.
#define FIELD(expr) +[](ScenarioConfig& c) -> auto& { return c.expr; }

template <class T>
FieldSpec integer(std::string path, Ref<T> ref, double min, double max, std::string unit, std::string help,
                  std::string default_note = "") {
  FieldSpec f;
  f.path = std::move(path);
  f.kind = FieldKind::integer;
  f.unit = std::move(unit);
  f.help = std::move(help);
  f.min = min;
  f.max = max;
  f.default_note = std::move(default_note);
  f.set = [ref](ScenarioConfig& c, const FieldValue& v) { ref(c) = static_cast<T>(std::get<std::int64_t>(v)); };
  f.get = [ref](const ScenarioConfig& c) { return FieldValue{static_cast<std::int64_t>(deref(ref, c))}; };
  return f;
}

FieldSpec real(std::string path, Ref<double> ref, double min, double max, std::string unit, std::string help,
               std::string default_note = "") {
  FieldSpec f;
  f.path = std::move(path);
  f.kind = FieldKind::real;
  f.unit = std::move(unit);
  f.help = std::move(help);
  f.min = min;
  f.max = max;
  f.default_note = std::move(default_note);
  f.set = [ref](ScenarioConfig& c, const FieldValue& v) { ref(c) = std::get<double>(v); };
  f.get = [ref](const ScenarioConfig& c) { return FieldValue{deref(ref, c)}; };
  return f;
}

FieldSpec boolean(std::string path, Ref<bool> ref, std::string help) {
  FieldSpec f;
  f.path = std::move(path);
  f.kind = FieldKind::boolean;
  f.help = std::move(help);
  f.set = [ref](ScenarioConfig& c, const FieldValue& v) { ref(c) = std::get<bool>(v); };
  f.get = [ref](const ScenarioConfig& c) { return FieldValue{deref(ref, c)}; };
  return f;
}

FieldSpec text(std::string path, Ref<std::string> ref, std::string help, std::string default_note = "") {
  FieldSpec f;
  f.path = std::move(path);
  f.kind = FieldKind::text;
  f.help = std::move(help);
  f.default_note = std::move(default_note);
  f.set = [ref](ScenarioConfig& c, const FieldValue& v) { ref(c) = std::get<std::string>(v); };
  f.get = [ref](const ScenarioConfig& c) { return FieldValue{deref(ref, c)}; };
  return f;
}

template <class E>
FieldSpec choice(std::string path, Ref<E> ref, std::vector<std::pair<std::string, E>> options, std::string help) {
  FieldSpec f;
  f.path = std::move(path);
  f.kind = FieldKind::choice;
  f.help = std::move(help);
  for (const auto& o : options) f.choices.push_back(o.first);
  f.set = [ref, options](ScenarioConfig& c, const FieldValue& v) {
    const auto& s = std::get<std::string>(v);
    for (const auto& o : options)
      if (o.first == s) {
        ref(c) = o.second;
        return;
      }
    throw std::invalid_argument("not one of the accepted values");  // the loader checks choices first
  };
  f.get = [ref, options](const ScenarioConfig& c) {
    for (const auto& o : options)
      if (o.second == deref(ref, c)) return FieldValue{o.first};
    return FieldValue{std::string("?")};
  };
  return f;
}

std::vector<std::pair<std::string, DType>> dtype_options(std::initializer_list<DType> ds) {
  std::vector<std::pair<std::string, DType>> out;
  for (DType d : ds) out.emplace_back(std::string(dtype_name(d)), d);
  return out;
}

FieldSpec peak_rate(DType d) {
  FieldSpec f;
  f.path = fmt::format("cluster.peak_tflops.{}", dtype_name(d));
  f.kind = FieldKind::real;
  f.unit = "TFLOP/s";
  f.help = fmt::format("Dense peak matrix-product rate in {} per GPU; 0 when the GPU has no {}", dtype_name(d),
                       dtype_name(d));
  f.min = 0;
  f.max = 1e6;
  f.set = [d](ScenarioConfig& c, const FieldValue& v) { c.cluster.peak_tflops[d] = std::get<double>(v); };
  f.get = [d](const ScenarioConfig& c) {
    auto it = c.cluster.peak_tflops.find(d);
    return FieldValue{it == c.cluster.peak_tflops.end() ? 0.0 : it->second};
  };
  return f;
}

// "did you mean ...? " for a preset name: another case or separators ("llama2-70B",
// "llama2_70b"), the start of a name ("h100" for h100-80gb), or a typo that keeps the first
// letter (b200 is another GPU than h200, not a typo of it).
std::string preset_hint(const std::string& name, const std::vector<std::string>& names) {
  auto squash = [](const std::string& x) {
    std::string o;
    for (char ch : x)
      if (ch != '-' && ch != '_' && ch != ' ') o += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return o;
  };
  const std::string w = squash(name);
  std::string hint;
  for (const auto& n : names)
    if (squash(n) == w) hint = n;
  if (hint.empty() && !w.empty())
    for (const auto& n : names)
      if (squash(n).rfind(w, 0) == 0) {
        hint = n;
        break;
      }
  if (hint.empty() && !w.empty()) {
    std::vector<std::string> same_start;
    for (const auto& n : names)
      if (!n.empty() && std::tolower(static_cast<unsigned char>(n[0])) == w[0]) same_start.push_back(n);
    hint = closest_match(name, same_start);
  }
  return hint.empty() ? "" : fmt::format("did you mean \"{}\"? ", hint);
}

std::vector<std::string> gpu_names() {
  std::vector<std::string> v;
  for (const auto& p : gpu_presets()) v.push_back(p.name);
  return v;
}
std::vector<std::string> model_names() {
  std::vector<std::string> v;
  for (const auto& p : model_presets()) v.push_back(p.name);
  return v;
}

std::string names_of_gpus() {
  std::string s;
  for (const auto& p : gpu_presets()) s += (s.empty() ? "" : ", ") + p.name;
  return s;
}
std::string names_of_models() {
  std::string s;
  for (const auto& p : model_presets()) s += (s.empty() ? "" : ", ") + p.name;
  return s;
}

std::vector<FieldSpec> make_fields() {
  std::vector<FieldSpec> t;

  t.push_back(text("name", FIELD(name), "Short name of the scenario, used in reports"));
  t.push_back(text("description", FIELD(description), "The question this scenario asks, in a sentence or two"));

  // ---- model -------------------------------------------------------------------------
  {
    FieldSpec f = text("model.preset", FIELD(model.preset), "Model shape from the catalog (" + names_of_models() +
                                                                  "); any model key below overrides it");
    f.applies_preset = true;
    f.set = [](ScenarioConfig& c, const FieldValue& v) {
      const auto& name = std::get<std::string>(v);
      if (name.empty()) {  // the default: no preset
        c.model.preset.clear();
        return;
      }
      const ModelPreset* p = find_model_preset(name);
      if (!p)
        throw std::invalid_argument("unknown model preset; " + preset_hint(name, model_names()) +
                                    "known: " + names_of_models());
      apply_model_preset(*p, c.model);
    };
    t.push_back(std::move(f));
  }
  t.push_back(integer("model.num_layers", FIELD(model.num_layers), 1, 100000, "", "Transformer layers"));
  t.push_back(integer("model.hidden_size", FIELD(model.hidden_size), 1, 1 << 20, "", "Model width h"));
  t.push_back(integer("model.num_attention_heads", FIELD(model.num_attention_heads), 1, 1 << 16, "",
                      "Attention heads a; must divide hidden_size"));
  t.push_back(integer("model.num_query_groups", FIELD(model.num_query_groups), 0, 1 << 16, "",
                      "Key/value heads for grouped-query attention; must divide num_attention_heads",
                      "0 (= num_attention_heads)"));
  t.push_back(integer("model.ffn_hidden_size", FIELD(model.ffn_hidden_size), 0, 1 << 22, "",
                      "Width of the MLP's inner layer", "0 (= 4 * hidden_size)"));
  t.push_back(integer("model.vocab_size", FIELD(model.vocab_size), 1, 1 << 24, "", "Vocabulary size V"));
  t.push_back(integer("model.seq_length", FIELD(model.seq_length), 1, 1 << 22, "", "Tokens per sample s"));
  t.push_back(boolean("model.swiglu", FIELD(model.swiglu), "SwiGLU MLP (three weight matrices) instead of GELU (two)"));
  t.push_back(choice("model.position_embedding_type", FIELD(model.position_embedding_type),
                     {{"learned_absolute", PositionEmbedding::learned_absolute}, {"rope", PositionEmbedding::rope}},
                     "Learned position table (s*h parameters on the first stage) or rotary embeddings (none)"));
  t.push_back(boolean("model.untie_embeddings_and_output_weights", FIELD(model.untie_embeddings_and_output_weights),
                      "Separate LM-head weights instead of sharing the input embedding"));
  t.push_back(boolean("model.add_bias_linear", FIELD(model.add_bias_linear), "Biases on the linear layers"));
  t.push_back(choice("model.normalization", FIELD(model.normalization),
                     {{"layernorm", Normalization::layernorm}, {"rmsnorm", Normalization::rmsnorm}},
                     "LayerNorm (scale and shift) or RMSNorm (scale only)"));
  t.push_back(real("model.hidden_dropout", FIELD(model.hidden_dropout), 0, 1, "",
                   "Dropout after attention and MLP; when above 0 each keeps a 1-byte mask of s*b*h for backward"));
  t.push_back(real("model.attention_dropout", FIELD(model.attention_dropout), 0, 1, "",
                   "Dropout of the attention probabilities; when above 0 it keeps a 1-byte mask and its output "
                   "(a*s*s*b each)"));
  t.push_back(choice("model.attention", FIELD(model.attention),
                     {{"flash", AttentionKernel::flash}, {"cudnn", AttentionKernel::cudnn},
                      {"fused", AttentionKernel::fused}, {"naive", AttentionKernel::naive}},
                     "Attention core kernel: flash (FlashAttention 2, the s*s scores never stored; PyTorch SDPA "
                     "and torchtitan's default), cudnn (cuDNN's fused attention, the same work: Transformer "
                     "Engine's default, Megatron-Core and NeMo), fused (fused softmax, scores stored) or naive "
                     "(separate kernels)"));
  t.push_back(boolean("model.fused_elementwise", FIELD(model.fused_elementwise),
                      "Elementwise work fused as Megatron-LM's kernels do; false: PyTorch eager, one kernel per "
                      "operation, norms and rotary embeddings in FP32 (torchtitan without torch.compile)"));

  t.push_back(choice("model.layernorm_kernel", FIELD(model.layernorm_kernel),
                     {{"persistent", LayerNormKernel::persistent}, {"apex", LayerNormKernel::apex}},
                     "LayerNorm kernel: persistent (apex FastLayerNorm, Transformer Engine; Megatron-LM since "
                     "November 2021) or apex (apex's FusedLayerNorm, Megatron-LM before then or with "
                     "--no-persist-layer-norm: 1.40x the time forward, 2.03x backward, apex pull request #1037)"));
  t.push_back(boolean("model.fused_linear_bias", FIELD(model.fused_linear_bias),
                      "Linear layers add their bias and sum its gradient inside the matrix product (cuBLASLt "
                      "epilogues, Transformer Engine); false: separate kernels, as Megatron-LM's own layers run "
                      "them (the QKV bias added after the product, every bias gradient a sum over the tokens)"));

  // ---- cluster -----------------------------------------------------------------------
  {
    FieldSpec f = text("cluster.gpu", FIELD(cluster.gpu),
                       "GPU from the catalog (" + names_of_gpus() + "); any cluster key below overrides it");
    f.applies_preset = true;
    f.set = [](ScenarioConfig& c, const FieldValue& v) {
      const auto& name = std::get<std::string>(v);
      if (name.empty()) {  // the default: no preset
        c.cluster.gpu.clear();
        return;
      }
      const GpuPreset* p = find_gpu_preset(name);
      if (!p)
        throw std::invalid_argument("unknown GPU preset; " + preset_hint(name, gpu_names()) + "known: " + names_of_gpus());
      apply_gpu_preset(*p, c.cluster);
    };
    t.push_back(std::move(f));
  }
  {
    FieldSpec f = text("cluster.profile", FIELD(cluster.profile),
                       "Hardware profile written by `trainsim calibrate` (a file; relative to the scenario's folder), "
                       "applied like cluster.gpu; any cluster key below overrides it");
    f.applies_preset = true;
    f.is_path = true;
    f.set = [](ScenarioConfig& c, const FieldValue& v) {
      const auto& path = std::get<std::string>(v);
      c.cluster.profile = path;
      c.cluster.calibrated.reset();
      if (path.empty()) return;
      try {
        auto p = std::make_shared<HardwareProfile>(load_profile(path));
        apply_profile(*p, c.cluster);
        c.cluster.calibrated = std::move(p);
      } catch (const std::runtime_error& e) {
        throw std::invalid_argument(e.what());
      }
    };
    t.push_back(std::move(f));
  }
  t.push_back(integer("cluster.num_gpus", FIELD(cluster.num_gpus), 1, 1 << 20, "", "GPUs in the job",
                      "data x pipeline x tensor x context parallel sizes where data_parallel_size is written, else 8"));
  t.push_back(integer("cluster.gpus_per_node", FIELD(cluster.gpus_per_node), 1, 1024, "",
                      "GPUs joined by the intra-node link (NVLink); ranks are placed on nodes in order"));
  t.push_back(real("cluster.memory_gib", FIELD(cluster.memory_gib), 0.001, 1e6, "GiB", "Memory per GPU"));
  for (DType d : kAllDTypes) t.push_back(peak_rate(d));
  t.push_back(real("cluster.compute_efficiency", FIELD(cluster.compute_efficiency), 0.001, 1, "",
                   "Fraction of peak that the best-shaped matrix products reach (cuBLAS on large GEMMs); each "
                   "product is priced lower by its shape (tiles, waves, depth; docs/model.md)"));
  t.push_back(integer("cluster.sm_count", FIELD(cluster.sm_count), 0, 1 << 16, "",
                      "Streaming multiprocessors per GPU: a matrix product's tiles run in waves of this many; 0: "
                      "no wave quantization"));
  t.push_back(integer("cluster.collective_sms", FIELD(cluster.collective_sms), 0, 1 << 16, "",
                      "SMs a collective's kernels hold on each GPU while it runs (NCCL: a block per channel); "
                      "compute that overlaps it runs on the other SMs, priced by its shape; 0: collectives do not "
                      "slow compute (the default: no measured figure yet, docs/model.md)"));
  t.push_back(real("cluster.hbm_bandwidth_gbps", FIELD(cluster.hbm_bandwidth_gbps), 0.001, 1e6, "GB/s",
                   "GPU memory bandwidth (datasheet), for memory-bound kernels (norms, activations, softmax, "
                   "dropout, loss, optimizer)"));
  t.push_back(real("cluster.memory_efficiency", FIELD(cluster.memory_efficiency), 0.001, 1, "",
                   "Fraction of hbm_bandwidth_gbps that streaming kernels reach (STREAM-like measurements)"));
  t.push_back(real("cluster.attention_efficiency", FIELD(cluster.attention_efficiency), 0.001, 1, "",
                   "Fraction of peak that a fused attention kernel (model.attention: flash) reaches on its work"));
  t.push_back(real("cluster.cudnn_attention_efficiency", FIELD(cluster.cudnn_attention_efficiency), 0.001, 1, "",
                   "Fraction of peak that cuDNN's fused attention (model.attention: cudnn) reaches on its work"));
  t.push_back(real("cluster.sustained_clock_fraction", FIELD(cluster.sustained_clock_fraction), 0.01, 1, "",
                   "Fraction of the benchmarks' clock the SMs hold through sustained training under the power "
                   "limit; scales matrix products and attention, not memory"));
  t.push_back(real("cluster.int32_tops", FIELD(cluster.int32_tops), 0.001, 1e6, "TOPS",
                   "32-bit integer instructions per second of the SMs (SMs x 64 INT32 lanes x boost clock): "
                   "prices the random numbers dropout kernels draw (Philox) beside their bytes"));
  t.push_back(real("cluster.intra_node.bandwidth_gbps", FIELD(cluster.intra_node.bandwidth_gbps), 0.001, 1e6,
                   "GB/s", "Per-GPU NVLink line rate inside a node, one direction"));
  t.push_back(real("cluster.intra_node.latency_us", FIELD(cluster.intra_node.latency_us), 0, 1e6, "us",
                   "Per-message (per ring step) latency inside a node"));
  t.push_back(real("cluster.intra_node.efficiency", FIELD(cluster.intra_node.efficiency), 0.001, 1, "",
                   "Fraction of the intra-node line rate NCCL's rings move (protocol overhead)"));
  t.push_back(real("cluster.inter_node.bandwidth_gbps", FIELD(cluster.inter_node.bandwidth_gbps), 0.001, 1e6,
                   "GB/s",
                   "Network line rate per GPU between nodes, one direction: the node's NICs times their rate, "
                   "divided by its GPUs (a ring across nodes runs one channel per NIC)"));
  t.push_back(real("cluster.inter_node.latency_us", FIELD(cluster.inter_node.latency_us), 0, 1e6, "us",
                   "Per-message (per ring step) latency between nodes"));
  t.push_back(real("cluster.inter_node.efficiency", FIELD(cluster.inter_node.efficiency), 0.001, 1, "",
                   "Fraction of the network line rate NCCL moves"));
  t.push_back(boolean("cluster.nvlink_sharp", FIELD(cluster.nvlink_sharp),
                      "NVSwitch with in-switch reduction (NVLink SHARP, Hopper): NCCL runs all-reduces as NVLS"));
  t.push_back(real("cluster.price_per_gpu_hour", FIELD(cluster.price_per_gpu_hour), 0, 1e9, "per GPU-hour",
                   "What one GPU-hour costs (any currency), for the cost of training; 0: not given"));

  // ---- parallelism -------------------------------------------------------------------
  t.push_back(integer("parallelism.data_parallel_size", FIELD(parallelism.data_parallel_size), 1, 1 << 20, "",
                      "Model replicas d",
                      "num_gpus / (pipeline_parallel_size * tensor_parallel_size * context_parallel_size)"));
  t.push_back(integer("parallelism.pipeline_parallel_size", FIELD(parallelism.pipeline_parallel_size), 1, 4096,
                      "", "Pipeline stages p"));
  t.push_back(integer("parallelism.tensor_parallel_size", FIELD(parallelism.tensor_parallel_size), 1, 1024, "",
                      "Tensor-parallel ways t (Megatron column/row split inside each layer)"));
  t.push_back(boolean("parallelism.sequence_parallel", FIELD(parallelism.sequence_parallel),
                      "Megatron sequence parallelism: shard LayerNorm/dropout activations over the t ranks"));
  t.push_back(integer("parallelism.context_parallel_size", FIELD(parallelism.context_parallel_size), 1, 1024, "",
                      "Context-parallel ways c: each sequence split over c GPUs (2c load-balanced chunks), which "
                      "exchange K and V for attention as context_parallel_comm says (Llama 3, PyTorch's "
                      "context_parallel, Megatron-Core); the ring (p2p) needs flash or cudnn attention"));
  t.push_back(choice("parallelism.context_parallel_comm", FIELD(parallelism.context_parallel_comm),
                     {{"auto", ContextParallelComm::auto_select},
                      {"all_gather", ContextParallelComm::all_gather},
                      {"p2p", ContextParallelComm::p2p}},
                     "How a context-parallel group exchanges keys and values: all_gather (gathered before each "
                     "attention, exposed: Llama 3, PyTorch's context_parallel), p2p (a ring, each chunk sent while "
                     "the attention of the one in hand runs: Megatron-Core with Transformer Engine, cp_comm_type "
                     "p2p); auto: p2p under framework megatron, all_gather otherwise"));
  t.push_back(integer("parallelism.virtual_pipeline_stages", FIELD(parallelism.virtual_pipeline_stages), 1, 1024,
                      "", "Model chunks per pipeline rank v (interleaved-1f1b)"));
  t.push_back(integer("parallelism.microbatch_group_size", FIELD(parallelism.microbatch_group_size), 0, 1 << 20, "",
                      "interleaved-1f1b: micro-batches each model chunk runs before the next, from p to the "
                      "micro-batches per replica (Megatron-Core's --microbatch-group-size-per-virtual-pipeline-"
                      "stage); 0: pipeline_parallel_size",
                      "0 (pipeline_parallel_size)"));
  t.push_back(choice("parallelism.schedule", FIELD(parallelism.schedule),
                     {{"gpipe", ScheduleKind::gpipe},
                      {"1f1b", ScheduleKind::one_f_one_b},
                      {"interleaved-1f1b", ScheduleKind::interleaved_1f1b},
                      {"zb-h1", ScheduleKind::zb_h1}},
                     "Pipeline schedule"));
  {
    FieldSpec f;
    f.path = "parallelism.layers_per_stage";
    f.kind = FieldKind::integer_list;
    f.help =
        "Layers of each (virtual) stage, p*v entries in pipeline order; default: balanced (even where p*v divides "
        "the layers, else by forward FLOPs with the output layer on the last chunk, the short chunks first)";
    f.min = 0;
    f.max = 100000;
    f.default_note = "[] (balanced)";
    f.set = [](ScenarioConfig& c, const FieldValue& v) {
      c.parallelism.layers_per_stage.clear();
      for (auto x : std::get<IntList>(v)) c.parallelism.layers_per_stage.push_back(static_cast<int>(x));
    };
    f.get = [](const ScenarioConfig& c) {
      IntList l(c.parallelism.layers_per_stage.begin(), c.parallelism.layers_per_stage.end());
      return FieldValue{l};
    };
    t.push_back(std::move(f));
  }
  t.push_back(integer("parallelism.zero_stage", FIELD(parallelism.zero_stage), 0, 3, "",
                      "ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also weights, over replicas"));
  t.push_back(choice("parallelism.framework", FIELD(parallelism.framework),
                     {{"auto", Framework::auto_select},
                      {"megatron", Framework::megatron},
                      {"deepspeed", Framework::deepspeed},
                      {"fsdp", Framework::fsdp}},
                     "Whose sharding the ZeRO stages follow (docs/model.md): megatron (1: "
                     "--use-distributed-optimizer, gradients reduce-scattered once per step; 2/3: Megatron-FSDP "
                     "optim_grads/optim_grads_params), deepspeed (zero_optimization.stage; 2/3 reduce-scatter after "
                     "every micro-batch; refuses 2/3 with pipeline parallelism), fsdp (PyTorch FSDP/FSDP2 as in "
                     "torchtitan; 2: reshard_after_forward=False, 3: True; no stage 1); auto: megatron for 0-1, "
                     "deepspeed for 2-3"));
  t.push_back(boolean("parallelism.fsdp_no_sync", FIELD(parallelism.fsdp_no_sync),
                      "framework fsdp: accumulate unsharded gradients over micro-batches (no_sync / "
                      "set_requires_gradient_sync(False)) and reduce-scatter once, after the last; gradients are "
                      "then not sharded in memory"));

  // ---- training ----------------------------------------------------------------------
  t.push_back(integer("training.micro_batch_size", FIELD(training.micro_batch_size), 1, 1 << 20, "",
                      "Samples per micro-batch b"));
  t.push_back(integer("training.global_batch_size", FIELD(training.global_batch_size), 0, 1 << 30, "",
                      "Samples per optimizer step; micro-batches per replica m = global / (micro * data_parallel)",
                      "0 (= micro_batch_size * data_parallel_size)"));
  t.push_back(boolean("training.gradient_accumulation_fusion", FIELD(training.gradient_accumulation_fusion),
                      "framework megatron: the weight-gradient products accumulate into the main_grad buffer "
                      "(Megatron-LM's --gradient-accumulation-fusion, default since March 2022); false: a separate "
                      "add per micro-batch, as Megatron-LM before 2022, DeepSpeed and FSDP do"));
  t.push_back(choice("training.activation_recompute", FIELD(training.activation_recompute),
                     {{"none", Recompute::none},
                      {"selective", Recompute::selective},
                      {"full", Recompute::full},
                      {"selective_op", Recompute::selective_op}},
                     "Recompute activations in backward: selective recomputes attention's softmax part "
                     "(Megatron-LM), full each layer from its input, selective_op keeps the attention core's "
                     "output and every other matrix product's and recomputes the rest of the layer "
                     "(torchtitan's op-level policy)"));
  t.push_back(integer("training.recompute_num_layers", FIELD(training.recompute_num_layers), 0, 1 << 20, "",
                      "Under activation_recompute: full, the layers of each model chunk that are recomputed, the "
                      "chunk's first ones; the others keep every activation (Megatron-LM's --recompute-method "
                      "block --recompute-num-layers N: memory traded for time layer by layer)",
                      "0 (every layer)"));
  t.push_back(choice("training.optimizer", FIELD(training.optimizer),
                     {{"adam", Optimizer::adam}, {"adamw", Optimizer::adamw}, {"sgd", Optimizer::sgd}},
                     "Optimizer (Adam keeps two FP32 moments per parameter, SGD one momentum)"));
  t.push_back(real("training.lr", FIELD(training.lr), 0, 10, "", "Learning rate (runtime)"));
  t.push_back(real("training.weight_decay", FIELD(training.weight_decay), 0, 10, "",
                   "Weight decay: decoupled for adamw, added to the gradient for adam (runtime; not biases or norms)"));
  t.push_back(real("training.adam_beta1", FIELD(training.adam_beta1), 0, 0.999999, "", "Adam's first-moment decay"));
  t.push_back(real("training.adam_beta2", FIELD(training.adam_beta2), 0, 0.999999, "", "Adam's second-moment decay"));
  t.push_back(real("training.adam_eps", FIELD(training.adam_eps), 1e-30, 1, "", "Adam's denominator epsilon"));
  t.push_back(real("training.clip_grad", FIELD(training.clip_grad), 0, 1e30, "",
                   "Clip gradients to this global L2 norm across all stages (runtime); 0: no clipping"));
  t.push_back(real("training.total_tokens", FIELD(training.total_tokens), 0, 1e18, "tokens",
                   "Tokens of the whole run, for time to train, GPU-hours and cost; 0: not given"));
  t.push_back(integer("training.train_steps", FIELD(training.train_steps), 0, 1e15, "steps",
                      "Optimizer steps of the whole run (when total_tokens is not given); 0: not given"));

  // ---- precision ---------------------------------------------------------------------
  t.push_back(choice("precision.compute", FIELD(precision.compute),
                     dtype_options({DType::fp32, DType::tf32, DType::fp16, DType::bf16, DType::fp8}),
                     "Format of matrix-product inputs (products accumulate in FP32)"));
  t.push_back(choice("precision.master_weights", FIELD(precision.master_weights),
                     dtype_options({DType::fp32, DType::fp16, DType::bf16}),
                     "Format of the weights the optimizer updates"));
  t.push_back(choice("precision.grad_accumulation", FIELD(precision.grad_accumulation),
                     dtype_options({DType::fp32, DType::fp16, DType::bf16}),
                     "Format of the buffer that sums gradients over micro-batches"));
  t.push_back(choice("precision.allreduce", FIELD(precision.allreduce),
                     dtype_options({DType::fp32, DType::fp16, DType::bf16}),
                     "Format in which gradients cross the data-parallel all-reduce"));
  t.push_back(choice("precision.allreduce_divide", FIELD(precision.allreduce_divide),
                     {{"before", AllReduceDivide::before}, {"after", AllReduceDivide::after}},
                     "Divide gradients by data_parallel_size before the sum (safe) or after it (can overflow)"));
  t.push_back(choice("precision.overflow_check", FIELD(precision.overflow_check),
                     {{"global", OverflowScope::global}, {"local", OverflowScope::local}},
                     "Found-inf check across every stage and replica, or per stage alone (they can diverge)"));
  t.push_back(choice("precision.loss_scaling.mode", FIELD(precision.loss_scaling.mode),
                     {{"none", LossScalingMode::none},
                      {"static", LossScalingMode::static_scale},
                      {"dynamic", LossScalingMode::dynamic}},
                     "Loss scaling for FP16 gradients"));
  t.back().default_note = "dynamic under fp16 compute, none otherwise";
  t.push_back(real("precision.loss_scaling.initial_scale", FIELD(precision.loss_scaling.initial_scale), 1e-30, 1e38,
                   "", "Starting (or static) loss scale"));
  t.push_back(integer("precision.loss_scaling.growth_interval", FIELD(precision.loss_scaling.growth_interval), 1,
                      1 << 30, "steps", "Overflow-free steps before a dynamic scale grows"));
  t.push_back(real("precision.loss_scaling.growth_factor", FIELD(precision.loss_scaling.growth_factor), 1.0001,
                   1e6, "", "Factor by which a dynamic scale grows"));
  t.push_back(real("precision.loss_scaling.backoff_factor", FIELD(precision.loss_scaling.backoff_factor), 1e-6,
                   0.9999, "", "Factor by which a dynamic scale shrinks after an overflow"));
  t.push_back(integer("precision.loss_scaling.hysteresis", FIELD(precision.loss_scaling.hysteresis), 1, 1 << 20,
                      "steps", "Overflowing steps tolerated before the scale backs off"));

  // ---- communication -----------------------------------------------------------------
  t.push_back(real("communication.bucket_size_mib", FIELD(communication.bucket_size_mib), 0, 1e6, "MiB",
                   "Gradient bytes per data-parallel collective (DDP, Megatron-LM and DeepSpeed buckets; FSDP "
                   "reducing after every micro-batch reduce-scatters each unit, whatever this says)",
                   "0 (the framework's own: megatron max(40M, 1M x data_parallel_size) parameters, one bucket a "
                   "chunk without overlap_grad_reduce; deepspeed 5e8 elements; fsdp's DDP 25 MiB)"));
  t.push_back(boolean("communication.overlap_grad_reduce", FIELD(communication.overlap_grad_reduce),
                      "Start each bucket's reduction during the last micro-batch's backward"));
  t.push_back(boolean("communication.overlap_param_gather", FIELD(communication.overlap_param_gather),
                      "Megatron-LM --overlap-param-gather (zero_stage 1, framework megatron): gather the updated "
                      "parameters before each chunk's first forward of the next step, unit by unit beside it, not "
                      "after the optimizer step"));
  t.push_back(choice("communication.allreduce_algorithm", FIELD(communication.allreduce_algorithm),
                     {{"ring", AllReduceAlgorithm::ring}, {"hierarchical", AllReduceAlgorithm::hierarchical}},
                     "NCCL's own choice (ring per NIC rail, tree across nodes, NVLS inside an NVSwitch node), or "
                     "intra-node then inter-node then intra-node"));
  t.push_back(boolean("communication.overlap_p2p_comm", FIELD(communication.overlap_p2p_comm),
                      "Pipeline sends run beside compute; false: a stage waits for each send (Megatron-LM 2021, "
                      "--no-overlap-p2p-communication)"));
  t.push_back(boolean("communication.tp_comm_overlap", FIELD(communication.tp_comm_overlap),
                      "Tensor-parallel all-gathers and reduce-scatters overlapped with their products as Transformer "
                      "Engine's userbuffers run them (Megatron-LM --tp-comm-overlap; its default methods: ring "
                      "exchange beside each gathered product, reduce-scatters pipelined in 4 chunks on 16 SMs, the "
                      "backward's on 16 SMs beside the weight-gradient products); needs sequence parallelism, a "
                      "group inside one node, and is priced for the GPU (the runtimes run them exposed)"));
  t.push_back(choice("communication.tp_comm_overlap_reduce_scatter",
                     FIELD(communication.tp_comm_overlap_reduce_scatter),
                     {{"pipeline", TpOverlapReduceScatter::pipeline},
                      {"ring_exchange", TpOverlapReduceScatter::ring_exchange}},
                     "How tp_comm_overlap runs the attention output's and MLP output's reduce-scatters: pipeline "
                     "(Transformer Engine's default: the product in 4 chunks on the SMs 16 leave, each chunk's "
                     "reduce-scatter beside the next) or ring_exchange (tensor-parallel-size steps, each "
                     "chunk's partial sums passed on by the copy engines: the FP8 configs of Megatron-Bridge's "
                     "H100 recipes)"));
  t.push_back(choice("communication.tp_backward_comm", FIELD(communication.tp_backward_comm),
                     {{"auto", TpBackwardComm::auto_select},
                      {"overlapped", TpBackwardComm::overlapped},
                      {"exposed", TpBackwardComm::exposed}},
                     "How a column-parallel layer's backward runs its tensor-parallel collectives: overlapped (the "
                     "input gradient's all-reduce, or under sequence parallelism its reduce-scatter, beside the "
                     "weight-gradient product, and the input's re-gather beside the input-gradient product: "
                     "Megatron-LM since September 2021, Megatron-Core, Transformer Engine) or exposed (Megatron-LM "
                     "before, --no-async-tensor-model-parallel-allreduce; PyTorch's DTensor); auto: overlapped "
                     "under framework megatron, exposed otherwise. Priced for the GPU (the runtimes run them "
                     "exposed)"));

  // ---- runtime (what `trainsim run` executes) ----------------------------------------
  t.push_back(choice("runtime.backend", FIELD(runtime.backend),
                     {{"cpu", RuntimeBackend::cpu}, {"cuda", RuntimeBackend::cuda}}, "Executor of `trainsim run`"));
  t.push_back(integer("runtime.steps", FIELD(runtime.steps), 1, 1 << 30, "steps", "Optimizer steps to run"));
  t.push_back(integer("runtime.seed", FIELD(runtime.seed), 0, 9.0e15, "", "Seed for weights and data order"));
  t.push_back(integer("runtime.model.num_layers", FIELD(runtime.num_layers), 1, 4096, "", "Layers of the executed model"));
  t.push_back(integer("runtime.model.hidden_size", FIELD(runtime.hidden_size), 1, 1 << 16, "", "Width of the executed model"));
  t.push_back(integer("runtime.model.num_attention_heads", FIELD(runtime.num_attention_heads), 1, 1024, "",
                      "Heads of the executed model"));
  t.push_back(integer("runtime.model.seq_length", FIELD(runtime.seq_length), 1, 1 << 16, "", "Sequence length executed"));
  t.push_back(integer("runtime.model.vocab_size", FIELD(runtime.vocab_size), 1, 1 << 20, "", "Vocabulary executed"));
  t.push_back(text("runtime.data.path", FIELD(runtime.data_path), "Text corpus (byte-level tokens), relative to the scenario file",
                 "\"\" (the bundled corpus, runtime/data/)"));
  t.push_back(boolean("runtime.data.synthetic", FIELD(runtime.data_synthetic), "Generated tokens instead of a file"));
  t.push_back(text("runtime.checkpoint.dir", FIELD(runtime.checkpoint_dir), "Checkpoint folder", "\"\" (none)"));
  t.push_back(integer("runtime.checkpoint.every_steps", FIELD(runtime.checkpoint_every_steps), 0, 1 << 30, "steps",
                      "Steps between checkpoints; 0: none"));
  return t;
}

#undef FIELD

}  // namespace

const std::vector<FieldSpec>& scenario_fields() {
  static const std::vector<FieldSpec> fields = make_fields();
  return fields;
}

const FieldSpec* find_field(std::string_view path) {
  for (const auto& f : scenario_fields())
    if (f.path == path) return &f;
  return nullptr;
}

bool is_field_section(std::string_view path) {
  for (const auto& f : scenario_fields())
    if (f.path.size() > path.size() && f.path.compare(0, path.size(), path) == 0 && f.path[path.size()] == '.')
      return true;
  return false;
}

std::vector<std::string> section_children(std::string_view section) {
  std::vector<std::string> out;
  const std::size_t skip = section.empty() ? 0 : section.size() + 1;
  for (const auto& f : scenario_fields()) {
    if (!section.empty() && !(f.path.size() > skip && f.path.compare(0, section.size(), section) == 0 &&
                              f.path[section.size()] == '.'))
      continue;
    std::string rest = f.path.substr(skip);
    std::string child = rest.substr(0, rest.find('.'));
    if (std::find(out.begin(), out.end(), child) == out.end()) out.push_back(child);
  }
  return out;
}

std::string field_kind_name(FieldKind k) {
  switch (k) {
    case FieldKind::integer: return "integer";
    case FieldKind::real: return "number";
    case FieldKind::boolean: return "true/false";
    case FieldKind::text: return "text";
    case FieldKind::choice: return "choice";
    case FieldKind::integer_list: return "list of integers";
  }
  return "?";
}

void append_field_value(std::string& out, const FieldValue& v) {
  struct Visitor {
    std::string& out;
    void operator()(std::int64_t x) const { fmt::format_to(std::back_inserter(out), "{}", x); }
    void operator()(double x) const { append_general6(out, x); }  // "{:g}", i.e. "{:.6g}"
    void operator()(bool x) const { out += x ? "true" : "false"; }
    void operator()(const std::string& x) const { out += x; }
    void operator()(const IntList& x) const { fmt::format_to(std::back_inserter(out), "[{}]", fmt::join(x, ", ")); }
  };
  std::visit(Visitor{out}, v);
}

bool same_field_value(const FieldValue& a, const FieldValue& b) {
  if (a.index() != b.index()) return false;
  if (const double* x = std::get_if<double>(&a))
    return std::bit_cast<std::uint64_t>(*x) == std::bit_cast<std::uint64_t>(std::get<double>(b)) && *x == *x;
  return a == b;
}

std::string format_field_value(const FieldValue& v) {
  std::string s;
  append_field_value(s, v);
  return s;
}

std::string field_default_text(const FieldSpec& f) {
  if (!f.default_note.empty()) return f.default_note;
  static const ScenarioConfig defaults{};
  std::string s = format_field_value(f.get(defaults));
  return s.empty() ? "\"\"" : s;
}

std::string fields_reference_markdown() {
  std::string out =
      "# Scenario reference\n\n"
      "Generated by `trainsim fields --markdown` from the field table in `core/config_fields.cpp`; "
      "do not edit by hand. Every key is optional; unknown keys are errors. A `sweep:` axis names any "
      "key below by its dotted path.\n";
  std::string section = "-";
  for (const auto& f : scenario_fields()) {
    std::string s = f.path.find('.') == std::string::npos ? "" : f.path.substr(0, f.path.find('.'));
    if (s != section) {
      section = s;
      out += fmt::format("\n## `{}`\n\n| key | type | default | unit | meaning |\n|---|---|---|---|---|\n",
                         s.empty() ? "(top level)" : s);
    }
    std::string type = field_kind_name(f.kind);
    if (f.kind == FieldKind::choice) type = fmt::format("{}", fmt::join(f.choices, " \\| "));
    std::string range;
    if ((f.kind == FieldKind::integer || f.kind == FieldKind::real) && (f.min > -kInf || f.max < kInf))
      range = f.max < 1e15 ? fmt::format(" [{:g}, {:g}]", f.min, f.max) : fmt::format(" >= {:g}", f.min);
    out += fmt::format("| `{}` | {}{} | {} | {} | {} |\n", f.path, type, range, field_default_text(f), f.unit, f.help);
  }
  return out;
}

}  // namespace trainsim
