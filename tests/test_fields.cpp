// The field table: one row per key, parsing driven by it, documentation generated from it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "core/config_fields.h"
#include "core/scenario.h"

namespace trainsim {
namespace {

// A real field's text (format_field_value: sweep tables, CSV columns, the duplicate check of
// expand_sweep) is fmt's "{:g}", written by write_general6: the same text on values swept in
// practice, on every power of ten and its neighbours, and on random bit patterns.
TEST(Fields, RealValuesReadAsFmtGeneralFormat) {
  std::vector<double> values = {0.0, -0.0, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 1600, 2039, 3350, 25, 50, 1e-3, 1e21,
                                 std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::denorm_min()};
  for (int e = -30; e <= 30; ++e) {
    const double p = std::pow(10.0, e);
    values.insert(values.end(), {p, std::nextafter(p, 0.0), std::nextafter(p, 1e300), 1.5 * p, 9.999995 * p});
  }
  std::mt19937_64 rng(19);
  for (int i = 0; i < 200000; ++i) {
    const std::uint64_t bits = rng();
    double x;
    std::memcpy(&x, &bits, sizeof x);
    values.push_back(x);
    values.push_back(std::ldexp(static_cast<double>(rng() >> 11), static_cast<int>(rng() % 100) - 70));
  }
  for (double x : values) ASSERT_EQ(format_field_value(FieldValue{x}), fmt::format("{:g}", x)) << fmt::format("{:a}", x);
}

TEST(Fields, PathsAreUniqueAndEveryRowIsComplete) {
  std::set<std::string> seen;
  for (const auto& f : scenario_fields()) {
    EXPECT_TRUE(seen.insert(f.path).second) << "duplicate " << f.path;
    EXPECT_FALSE(f.help.empty()) << f.path;
    EXPECT_TRUE(f.set && f.get) << f.path;
    if (f.kind == FieldKind::choice) {
      EXPECT_FALSE(f.choices.empty()) << f.path;
      // The default must be one of the accepted spellings; one that follows another key
      // (derive_unwritten) says which, each an accepted spelling.
      if (f.default_note.empty()) {
        EXPECT_NE(std::find(f.choices.begin(), f.choices.end(), field_default_text(f)), f.choices.end()) << f.path;
      } else {
        int named = 0;
        for (const auto& c : f.choices) named += f.default_note.find(c) != std::string::npos;
        EXPECT_GE(named, 2) << f.path << ": " << f.default_note;
      }
    }
  }
}

// Every section of DESIGN.md's scenario format is in the table.
TEST(Fields, CoverTheDesignScenarioFormat) {
  for (const char* key :
       {"model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.ffn_hidden_size",
        "model.vocab_size", "model.seq_length", "model.preset", "cluster.gpu", "cluster.num_gpus",
        "cluster.gpus_per_node", "cluster.memory_gib", "cluster.peak_tflops.fp32", "cluster.peak_tflops.tf32",
        "cluster.peak_tflops.fp16", "cluster.peak_tflops.bf16", "cluster.peak_tflops.fp8",
        "cluster.compute_efficiency", "cluster.hbm_bandwidth_gbps", "cluster.intra_node.bandwidth_gbps",
        "cluster.intra_node.latency_us", "cluster.inter_node.bandwidth_gbps", "cluster.inter_node.latency_us",
        "parallelism.data_parallel_size", "parallelism.pipeline_parallel_size", "parallelism.tensor_parallel_size",
        "parallelism.sequence_parallel", "parallelism.virtual_pipeline_stages", "parallelism.schedule",
        "parallelism.layers_per_stage", "parallelism.zero_stage", "training.micro_batch_size",
        "training.global_batch_size", "training.activation_recompute", "training.optimizer", "precision.compute",
        "precision.master_weights", "precision.grad_accumulation", "precision.allreduce",
        "precision.allreduce_divide", "precision.overflow_check", "precision.loss_scaling.mode",
        "precision.loss_scaling.initial_scale", "precision.loss_scaling.growth_interval",
        "precision.loss_scaling.backoff_factor", "precision.loss_scaling.hysteresis",
        "communication.bucket_size_mib", "communication.overlap_grad_reduce", "communication.allreduce_algorithm",
        "runtime.backend", "runtime.steps", "runtime.seed", "runtime.model.num_layers", "runtime.data.path",
        "runtime.data.synthetic", "runtime.checkpoint.dir", "runtime.checkpoint.every_steps"})
    EXPECT_NE(find_field(key), nullptr) << key;
  const auto* compute = find_field("precision.compute");
  for (const char* d : {"fp32", "fp16", "bf16", "fp8"})
    EXPECT_NE(std::find(compute->choices.begin(), compute->choices.end(), d), compute->choices.end()) << d;
  const auto* sched = find_field("parallelism.schedule");
  EXPECT_EQ(sched->choices, (std::vector<std::string>{"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}));
}

// Setting each field to a value different from its default and reading it back through
// YAML changes exactly that field.
TEST(Fields, EveryFieldRoundTripsThroughYaml) {
  // What a file that writes none of the fields below loads to (an empty file is refused).
  ScenarioConfig empty;
  derive_unwritten(empty, [](std::string_view) { return false; });
  for (const auto& f : scenario_fields()) {
    if (f.applies_preset) continue;  // presets set many fields; covered in test_presets
    std::string value;
    switch (f.kind) {
      case FieldKind::integer: value = std::to_string(static_cast<long long>(std::max(f.min, 0.0)) + 1); break;
      case FieldKind::real: value = "0.5"; break;
      case FieldKind::boolean: value = std::get<bool>(f.get(ScenarioConfig{})) ? "false" : "true"; break;
      case FieldKind::text: value = "\"some text\""; break;
      case FieldKind::choice: value = f.choices.back(); break;
      case FieldKind::integer_list: value = "[3, 4]"; break;
    }
    if (f.kind == FieldKind::real && f.min > 0.5) value = std::to_string(f.min + 1);
    if (f.kind == FieldKind::real && f.max < 0.5) value = std::to_string(f.max);
    // Build nested YAML from the dotted path.
    std::string yaml, indent;
    std::stringstream path(f.path);
    std::vector<std::string> parts;
    for (std::string part; std::getline(path, part, '.');) parts.push_back(part);
    for (std::size_t i = 0; i < parts.size(); ++i) {
      yaml += indent + parts[i] + ":" + (i + 1 == parts.size() ? " " + value + "\n" : "\n");
      indent += "  ";
    }
    SCOPED_TRACE(yaml);
    const Scenario sc = load_scenario_text(yaml, "roundtrip.yaml");
    const FieldValue got = f.get(sc.config);
    const std::string expected = f.kind == FieldKind::text ? "some text" : value;
    if (f.kind == FieldKind::real)
      EXPECT_DOUBLE_EQ(std::get<double>(got), std::stod(value));
    else
      EXPECT_EQ(format_field_value(got), expected == "[3, 4]" ? "[3, 4]" : expected);
    EXPECT_TRUE(sc.has_key(f.path));
    // No other field moved from an empty file's, but for what is derived from the key
    // (derive_unwritten): data_parallel_size when num_gpus, pipeline, tensor or context size is
    // written, num_gpus when data_parallel_size is (the GPU count stays their product), the loss
    // scaling when the compute format is.
    const std::string derived = f.path == "parallelism.data_parallel_size" ? "cluster.num_gpus"
                                : f.path == "cluster.num_gpus" || f.path == "parallelism.pipeline_parallel_size" ||
                                        f.path == "parallelism.tensor_parallel_size" ||
                                        f.path == "parallelism.context_parallel_size"
                                    ? "parallelism.data_parallel_size"
                                : f.path == "precision.compute" ? "precision.loss_scaling.mode"
                                                                : "";
    const ParallelismConfig& par = sc.config.parallelism;
    EXPECT_EQ(par.data_parallel_size * par.pipeline_parallel_size * par.tensor_parallel_size *
                  par.context_parallel_size,
              sc.config.cluster.num_gpus);
    for (const auto& other : scenario_fields()) {
      if (other.path == f.path || other.path == derived || other.applies_preset) continue;
      EXPECT_EQ(format_field_value(other.get(sc.config)), format_field_value(other.get(empty)))
          << other.path << " changed when setting " << f.path;
    }
  }
}

TEST(Fields, ReferenceDocumentIsGeneratedFromTheTable) {
  const std::string md = fields_reference_markdown();
  for (const auto& f : scenario_fields()) EXPECT_NE(md.find("`" + f.path + "`"), std::string::npos) << f.path;
  // docs/scenario-reference.md is this text; regenerate with `trainsim fields --markdown`.
  std::ifstream in(std::string(TRAINSIM_SOURCE_DIR) + "/docs/scenario-reference.md");
  ASSERT_TRUE(in) << "docs/scenario-reference.md is missing";
  std::stringstream doc;
  doc << in.rdbuf();
  EXPECT_EQ(doc.str(), md) << "docs/scenario-reference.md is stale: run `trainsim fields --markdown > "
                              "docs/scenario-reference.md`";
}

}  // namespace
}  // namespace trainsim
