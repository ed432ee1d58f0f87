#include "core/presets.h"

#include <fmt/format.h>

#include "core/config_fields.h"
#include "core/model_shape.h"

namespace trainsim {

namespace {

DTypeMap<double> rates(double fp32, double tf32, double fp16, double bf16, double fp8) {
  return {{DType::fp32, fp32}, {DType::tf32, tf32}, {DType::fp16, fp16}, {DType::bf16, bf16}, {DType::fp8, fp8}};
}

// Dense tensor-core rates (the datasheets' "with sparsity" figures halved). Memory is what
// nvidia-smi reports as total. Links are per GPU and per direction; inter_node is the node's NIC
// bandwidth divided by its GPUs (one NIC per GPU on DGX/HGX nodes). Efficiencies are measured
// fractions (cuBLAS GEMMs, STREAM-like kernels, FlashAttention, NCCL's per-link figures).
// Every figure's source: docs/presets.md.
std::vector<GpuPreset> make_gpus() {
  return {
      {"v100-32gb", "NVIDIA V100 SXM2 32GB (Volta): no bf16, no tf32; DGX-1/DGX-2 class", 8, 32.0,
       rates(15.7, 0, 125, 0, 0), 0.80, 80, 900, 0.90, 0.35, 0.35, 1.0, {150, 3, 0.80}, {12.5, 6, 0.94}, false,
       80 * 64 * 1.530e-3},
      {"a100-40gb", "NVIDIA A100 SXM4 40GB (Ampere), DGX A100 node", 8, 40.0, rates(19.5, 156, 312, 312, 0), 0.82,
       108, 1555, 0.79, 0.575, 0.575, 1.0, {300, 3, 0.80}, {25, 6, 0.94}, false, 108 * 64 * 1.410e-3},
      {"a100-80gb", "NVIDIA A100 SXM4 80GB (Ampere), DGX A100 node", 8, 80.0, rates(19.5, 156, 312, 312, 0), 0.82,
       108, 2039, 0.79, 0.575, 0.575, 1.0, {300, 3, 0.80}, {25, 6, 0.94}, false, 108 * 64 * 1.410e-3},
      {"h100-80gb", "NVIDIA H100 SXM5 80GB (Hopper), DGX H100 node", 8, 79.6, rates(67, 494.7, 989.4, 989.4, 1978.9),
       0.806, 132, 3350, 0.835, 0.333, 0.542, 0.795, {450, 3, 0.824}, {50, 5, 0.94}, true, 132 * 64 * 1.980e-3},
      {"h100-96gb-500w",
       "NVIDIA H100 SXM5 96GB HBM2e capped at 500 W (Meta Grand Teton, torchtitan's benchmarks)", 8, 89.4,
       rates(67, 494.7, 989.4, 989.4, 1978.9), 0.806, 132, 2400, 0.835, 0.333, 0.542, 0.795 * 585.23 / 797.51,
       {450, 3, 0.824}, {50, 5, 0.94}, true, 132 * 64 * 1.980e-3},
      {"h200", "NVIDIA H200 SXM 141GB (Hopper), HGX H200 node", 8, 140.4, rates(67, 494.7, 989.4, 989.4, 1978.9),
       0.806, 132, 4800, 0.835, 0.333, 0.542, 0.795, {450, 3, 0.824}, {50, 5, 0.94}, true, 132 * 64 * 1.980e-3},
  };
}

ModelConfig gpt(int layers, int hidden, int heads) {
  ModelConfig m;
  m.num_layers = layers;
  m.hidden_size = hidden;
  m.num_attention_heads = heads;
  m.ffn_hidden_size = 4 * hidden;
  m.vocab_size = 50304;  // GPT-2 BPE's 50257, padded to a multiple of 128 as Megatron-LM does
  m.seq_length = 2048;
  return m;
}

ModelConfig megatron(int layers, int hidden, int heads) {
  ModelConfig m = gpt(layers, hidden, heads);
  m.vocab_size = 51200;
  return m;
}

ModelConfig llama2(int layers, int hidden, int heads, int groups, int ffn) {
  ModelConfig m;
  m.num_layers = layers;
  m.hidden_size = hidden;
  m.num_attention_heads = heads;
  m.num_query_groups = groups;
  m.ffn_hidden_size = ffn;
  m.vocab_size = 32000;
  m.seq_length = 4096;
  m.swiglu = true;
  m.position_embedding_type = PositionEmbedding::rope;
  m.untie_embeddings_and_output_weights = true;
  m.add_bias_linear = false;
  m.normalization = Normalization::rmsnorm;
  m.hidden_dropout = 0;  // Llama trains without dropout (Touvron et al. 2023; the released
  m.attention_dropout = 0;  // configs' attention_dropout is 0.0)
  return m;
}

// Llama 3 and 3.1 (Dubey et al. 2024, table 3): Llama 2's layer with 8 KV heads at every size, a
// 128,256-token vocabulary (128,000 BPE tokens and 256 special ones, the released configs'
// vocab_size) and 8,192-token training sequences.
ModelConfig llama3(int layers, int hidden, int heads, int ffn) {
  ModelConfig m = llama2(layers, hidden, heads, 8, ffn);
  m.vocab_size = 128256;
  m.seq_length = 8192;
  return m;
}

std::vector<ModelPreset> make_models() {
  return {
      {"gpt3-125m", "GPT-3 Small (Brown et al. 2020, table 2.1)", gpt(12, 768, 12)},
      {"gpt3-350m", "GPT-3 Medium (Brown et al. 2020, table 2.1)", gpt(24, 1024, 16)},
      {"gpt3-760m", "GPT-3 Large (Brown et al. 2020, table 2.1)", gpt(24, 1536, 16)},
      {"gpt3-1.3b", "GPT-3 XL (16 heads of 128: the paper's 24 heads do not divide 2048)", gpt(24, 2048, 16)},
      {"gpt3-2.7b", "GPT-3 2.7B (Brown et al. 2020, table 2.1)", gpt(32, 2560, 32)},
      {"gpt3-6.7b", "GPT-3 6.7B (Brown et al. 2020, table 2.1)", gpt(32, 4096, 32)},
      {"gpt3-13b", "GPT-3 13B (hidden 5120 as in Megatron-LM; the paper's 5140 does not split into 40 heads)",
       gpt(40, 5120, 40)},
      {"gpt3-175b", "GPT-3 175B (Brown et al. 2020, table 2.1)", gpt(96, 12288, 96)},
      {"llama2-7b", "Llama 2 7B (Touvron et al. 2023): SwiGLU, RoPE, RMSNorm, untied output", llama2(32, 4096, 32, 32, 11008)},
      {"llama2-13b", "Llama 2 13B (Touvron et al. 2023), as llama2-7b", llama2(40, 5120, 40, 40, 13824)},
      {"llama2-70b", "Llama 2 70B (Touvron et al. 2023): grouped-query attention with 8 KV heads", llama2(80, 8192, 64, 8, 28672)},
      {"llama3-8b", "Llama 3 / 3.1 8B (Dubey et al. 2024, table 3): 8 KV heads, 128K vocabulary", llama3(32, 4096, 32, 14336)},
      {"llama3-70b", "Llama 3 / 3.1 70B (Dubey et al. 2024, table 3), as llama3-8b", llama3(80, 8192, 64, 28672)},
      {"llama3-405b", "Llama 3.1 405B (Dubey et al. 2024, table 3), as llama3-8b", llama3(126, 16384, 128, 53248)},
      {"megatron-22b", "Megatron 22B (Korthikanti et al. 2022, table 3)", megatron(48, 6144, 64)},
      {"megatron-530b", "Megatron-Turing 530B (Korthikanti et al. 2022, table 3)", megatron(105, 20480, 128)},
      {"megatron-1t", "Megatron 1T (Korthikanti et al. 2022, table 3; Narayanan et al. 2021, table 1)",
       megatron(128, 25600, 160)},
  };
}

}  // namespace

const std::vector<GpuPreset>& gpu_presets() {
  static const std::vector<GpuPreset> presets = make_gpus();
  return presets;
}

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = make_models();
  return presets;
}

const GpuPreset* find_gpu_preset(std::string_view name) {
  for (const auto& p : gpu_presets())
    if (p.name == name) return &p;
  return nullptr;
}

const ModelPreset* find_model_preset(std::string_view name) {
  for (const auto& p : model_presets())
    if (p.name == name) return &p;
  return nullptr;
}

void apply_gpu_preset(const GpuPreset& p, ClusterConfig& c) {
  c.gpu = p.name;
  c.gpus_per_node = p.gpus_per_node;
  c.memory_gib = p.memory_gib;
  c.peak_tflops = p.peak_tflops;
  c.compute_efficiency = p.compute_efficiency;
  c.sm_count = p.sm_count;
  c.hbm_bandwidth_gbps = p.hbm_bandwidth_gbps;
  c.memory_efficiency = p.memory_efficiency;
  c.attention_efficiency = p.attention_efficiency;
  c.cudnn_attention_efficiency = p.cudnn_attention_efficiency;
  c.sustained_clock_fraction = p.sustained_clock_fraction;
  c.intra_node = p.intra_node;
  c.inter_node = p.inter_node;
  c.nvlink_sharp = p.nvlink_sharp;
  c.int32_tops = p.int32_tops;
}

void apply_model_preset(const ModelPreset& p, ModelConfig& m) {
  m = p.model;
  m.preset = p.name;
}

std::string model_label(const ModelConfig& m) {
  if (m.preset.empty()) return "";
  const ModelPreset* p = find_model_preset(m.preset);
  if (!p) return m.preset;
  ScenarioConfig mine, preset;
  mine.model = m;
  preset.model = p->model;
  preset.model.preset = m.preset;
  std::string diffs;
  for (const auto& f : scenario_fields()) {
    if (f.path.rfind("model.", 0) != 0 || f.path == "model.preset" || !f.get) continue;
    const std::string a = format_field_value(f.get(mine)), b = format_field_value(f.get(preset));
    if (a != b) diffs += fmt::format("{}{} {}", diffs.empty() ? "" : ", ", f.path.substr(6), a);
  }
  return diffs.empty() ? m.preset : m.preset + " with " + diffs;
}

std::string format_params(double params) { return fmt::format("{:.2f}B", params / 1e9); }

std::string model_presets_markdown() {
  std::string out =
      "| preset | layers | hidden | heads (KV) | FFN | seq | vocab | dropout (hidden / attention) | parameters | source |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& p : model_presets()) {
    const ModelShape s(p.model);
    out += fmt::format("| `{}` | {} | {} | {}{} | {} | {} | {} | {:g} / {:g} | {} | {} |\n", p.name, s.L, s.h, s.a,
                       s.kv_heads != s.a ? fmt::format(" ({})", s.kv_heads) : "", s.f, s.s, s.V, p.model.hidden_dropout,
                       p.model.attention_dropout, format_params(s.total_params()), p.summary);
  }
  return out;
}

}  // namespace trainsim
