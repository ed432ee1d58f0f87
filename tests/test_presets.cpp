// Presets from public datasheets and papers (sources in docs/presets.md).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/model_shape.h"
#include "core/presets.h"
#include "core/scenario.h"

namespace trainsim {
namespace {

// docs/presets.md's model table is `trainsim presets --markdown`: the two cannot disagree
// (the docs said 21.8B for megatron-22b while `presets` printed 22.07B).
TEST(Presets, DocumentedModelTableIsWhatPresetsPrints) {
  std::ifstream in(std::string(TRAINSIM_SOURCE_DIR) + "/docs/presets.md");
  std::stringstream doc;
  doc << in.rdbuf();
  EXPECT_NE(doc.str().find(model_presets_markdown()), std::string::npos)
      << "regenerate the table with `trainsim presets --markdown`";
  EXPECT_NE(model_presets_markdown().find("| 22.07B |"), std::string::npos);
}

// The parameter count is labelled by the shape actually used: the preset's name alone only
// when no key overrides it.
TEST(Presets, ModelLabelNamesTheOverrides) {
  ModelConfig m;
  apply_model_preset(*find_model_preset("llama2-13b"), m);
  EXPECT_EQ(model_label(m), "llama2-13b");
  m.num_layers = 60;
  m.hidden_size = 6656;
  EXPECT_EQ(model_label(m), "llama2-13b with num_layers 60, hidden_size 6656");
  EXPECT_EQ(model_label(ModelConfig{}), "");
}

TEST(Presets, TheRequiredCatalog) {
  for (const char* g : {"a100-40gb", "a100-80gb", "h100-80gb", "h200"}) EXPECT_NE(find_gpu_preset(g), nullptr) << g;
  for (const char* m : {"gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b",
                        "gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b", "megatron-22b", "megatron-530b",
                        "megatron-1t"})
    EXPECT_NE(find_model_preset(m), nullptr) << m;
}

// Each model preset's parameter count matches the size in its name (within 6%: names round).
TEST(Presets, ModelSizesMatchTheirNames) {
  const std::pair<const char*, double> sizes[] = {
      {"gpt3-125m", 0.125e9}, {"gpt3-350m", 0.35e9}, {"gpt3-760m", 0.76e9}, {"gpt3-1.3b", 1.3e9},
      {"gpt3-2.7b", 2.7e9},   {"gpt3-6.7b", 6.7e9},  {"gpt3-13b", 13e9},    {"gpt3-175b", 175e9},
      {"llama2-7b", 6.74e9},  {"llama2-13b", 13.0e9}, {"llama2-70b", 69.0e9}, {"megatron-22b", 22e9},
      {"megatron-530b", 530e9}, {"megatron-1t", 1008e9}};
  for (auto [name, n] : sizes) {
    const double got = ModelShape(find_model_preset(name)->model).total_params();
    EXPECT_NEAR(got / n, 1.0, 0.06) << name << " has " << got;
  }
}

TEST(Presets, GpuFiguresAreConsistent) {
  for (const auto& g : gpu_presets()) {
    SCOPED_TRACE(g.name);
    // Tensor-core 16-bit rates exceed FP32; fp8 doubles fp16 where present.
    EXPECT_GT(g.peak_tflops.at(DType::fp16), g.peak_tflops.at(DType::fp32));
    if (g.peak_tflops.at(DType::fp8) > 0) {
      EXPECT_NEAR(g.peak_tflops.at(DType::fp8), 2 * g.peak_tflops.at(DType::fp16), 1);
    }
    if (g.peak_tflops.at(DType::bf16) > 0) {
      EXPECT_EQ(g.peak_tflops.at(DType::bf16), g.peak_tflops.at(DType::fp16));
    }
    EXPECT_GT(g.intra_node.bandwidth_gbps, g.inter_node.bandwidth_gbps);
  }
  // Only Hopper has fp8; Volta has neither bf16 nor tf32.
  EXPECT_EQ(find_gpu_preset("a100-40gb")->peak_tflops.at(DType::fp8), 0);
  EXPECT_GT(find_gpu_preset("h100-80gb")->peak_tflops.at(DType::fp8), 0);
  EXPECT_EQ(find_gpu_preset("v100-32gb")->peak_tflops.at(DType::bf16), 0);
  // The H200 is an H100 with more and faster memory.
  EXPECT_EQ(find_gpu_preset("h200")->peak_tflops, find_gpu_preset("h100-80gb")->peak_tflops);
  EXPECT_GT(find_gpu_preset("h200")->memory_gib, find_gpu_preset("h100-80gb")->memory_gib);
  EXPECT_GT(find_gpu_preset("h200")->hbm_bandwidth_gbps, find_gpu_preset("h100-80gb")->hbm_bandwidth_gbps);
}

TEST(Presets, AnyFieldCanBeOverriddenInAnyOrder) {
  const std::string a = R"(cluster:
  memory_gib: 24
  gpu: a100-80gb
  peak_tflops: {bf16: 100}
model:
  num_layers: 12
  preset: llama2-7b
)";
  const Scenario sc = load_scenario_text(a);
  EXPECT_EQ(sc.config.cluster.memory_gib, 24);
  EXPECT_EQ(sc.config.cluster.peak_tflops.at(DType::bf16), 100);
  EXPECT_EQ(sc.config.cluster.peak_tflops.at(DType::fp16), 312);  // from the preset
  EXPECT_EQ(sc.config.cluster.hbm_bandwidth_gbps, 2039);
  EXPECT_EQ(sc.config.model.num_layers, 12);
  EXPECT_EQ(sc.config.model.hidden_size, 4096);  // from the preset
  EXPECT_TRUE(sc.config.model.swiglu);
}

}  // namespace
}  // namespace trainsim
