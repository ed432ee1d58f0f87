// Catalog of GPUs and model shapes from public datasheets and papers. Every figure's
// source is in docs/presets.md; a scenario may override any field after naming a preset.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/config.h"

namespace trainsim {

struct GpuPreset {
  std::string name;
  std::string summary;  // one line for `trainsim presets`
  // Every ClusterConfig field a GPU determines; num_gpus is left to the scenario.
  int gpus_per_node;
  double memory_gib;
  DTypeMap<double> peak_tflops;
  double compute_efficiency;    // large-GEMM fraction of peak (cuBLAS measurements, docs/presets.md)
  int sm_count;
  double hbm_bandwidth_gbps;
  double memory_efficiency;     // streaming-kernel fraction of HBM bandwidth
  double attention_efficiency;  // FlashAttention's fraction of peak
  double cudnn_attention_efficiency;  // cuDNN's fused attention's
  double sustained_clock_fraction;  // clock held in training under the power limit / benchmark clock
  LinkConfig intra_node;        // NVLink line rate per GPU and direction, NCCL's efficiency
  LinkConfig inter_node;        // NIC line rate per GPU (NICs per node x NIC rate / GPUs per node)
  bool nvlink_sharp;            // NVSwitch with in-switch reduction (NCCL NVLS)
  double int32_tops;            // SMs x 64 INT32 lanes x boost clock (whitepapers), tera-instructions/s
};

struct ModelPreset {
  std::string name;
  std::string summary;
  ModelConfig model;
};

const std::vector<GpuPreset>& gpu_presets();
const std::vector<ModelPreset>& model_presets();
const GpuPreset* find_gpu_preset(std::string_view name);
const ModelPreset* find_model_preset(std::string_view name);

void apply_gpu_preset(const GpuPreset& preset, ClusterConfig& cluster);
void apply_model_preset(const ModelPreset& preset, ModelConfig& model);

// The shape a model configuration actually has, named after its preset: "llama2-13b", or
// "llama2-13b with num_layers 60, hidden_size 6656" when keys override the preset; empty
// without a preset.
std::string model_label(const ModelConfig& model);

// A parameter count as `trainsim presets` and docs/presets.md write it: "22.07B".
std::string format_params(double params);
// The model table of docs/presets.md, as `trainsim presets --markdown` prints it.
std::string model_presets_markdown();

}  // namespace trainsim
