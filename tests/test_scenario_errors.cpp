// Bad input gets a clear error and never a crash or a silent default. Each test writes a
// small scenario and checks the file, line, column, key path and message of every error;
// the expected line and column are counted from the YAML text written beside them.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "core/config_fields.h"
#include "core/diagnostics.h"
#include "core/model_shape.h"
#include "core/plan.h"
#include "core/presets.h"
#include "core/scenario.h"
#include "tests/test_helpers.h"

namespace trainsim {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "\"" << (part) << "\" not in: " << (text)

// Drops the newline after R"( so that line 1 is the first line written in the test.
std::string yaml(const char* text) {
  std::string s(text);
  if (!s.empty() && s.front() == '\n') s.erase(0, 1);
  return s;
}

std::string dump(const std::vector<Diagnostic>& ds) {
  std::string s;
  for (const auto& d : ds) s += format_diagnostic(d) + "\n";
  return s;
}

// The diagnostics of a scenario the loader must reject.
std::vector<Diagnostic> load_errors(const std::string& text) {
  try {
    load_scenario_text(text, "test.yaml");
  } catch (const ScenarioError& e) {
    return e.diagnostics();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ScenarioError: " << e.what();
    return {};
  }
  ADD_FAILURE() << "loaded without an error:\n" << text;
  return {};
}

// The diagnostics of a scenario that loads but whose invariants must fail.
std::vector<Diagnostic> plan_errors(const std::string& text) {
  Scenario sc;
  try {
    sc = load_scenario_text(text, "test.yaml");
  } catch (const ScenarioError& e) {
    ADD_FAILURE() << "the loader rejected it:\n" << e.what();
    return {};
  }
  try {
    Plan::from_scenario(sc);
  } catch (const ScenarioError& e) {
    return e.diagnostics();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ScenarioError: " << e.what();
    return {};
  }
  ADD_FAILURE() << "validated without an error:\n" << text;
  return {};
}

// A scenario that must load and validate.
Plan plan_of(const std::string& text) {
  return Plan::from_scenario(load_scenario_text(text, "test.yaml"));
}

void expect_at(const Diagnostic& d, int line, int column, const std::string& key_path) {
  EXPECT_EQ(d.file, "test.yaml") << format_diagnostic(d);
  EXPECT_EQ(d.where.line, line) << format_diagnostic(d);
  EXPECT_EQ(d.where.column, column) << format_diagnostic(d);
  EXPECT_EQ(d.key_path, key_path) << format_diagnostic(d);
}

const Diagnostic* find_key(const std::vector<Diagnostic>& ds, const std::string& key_path) {
  for (const auto& d : ds)
    if (d.key_path == key_path) return &d;
  return nullptr;
}

// ---- unknown and misspelled keys ----------------------------------------------------

TEST(ScenarioErrors, MisspelledTopLevelKeySuggestsTheSection) {
  auto ds = load_errors(yaml(R"(
name: typo
paralelism:
  data_parallel_size: 2
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 1, "paralelism");
  EXPECT_EQ(ds[0].message, "unknown key; did you mean \"parallelism\"?");
  EXPECT_EQ(format_diagnostic(ds[0]), "test.yaml:2:1: error: paralelism: unknown key; did you mean \"parallelism\"?");
}

TEST(ScenarioErrors, MisspelledKeyInASectionSuggestsTheKey) {
  auto ds = load_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpu: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 3, 3, "cluster.num_gpu");
  EXPECT_EQ(ds[0].message, "unknown key; did you mean \"num_gpus\"?");
}

TEST(ScenarioErrors, MisspelledKeyInANestedSectionSuggestsTheKey) {
  auto ds = load_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  intra_node:
    bandwith_gbps: 300
    latency_us: 3
  inter_node: {bandwidth_gbps: 25, latncy_us: 6}
)"));
  ASSERT_EQ(ds.size(), 2u) << dump(ds);
  expect_at(ds[0], 4, 5, "cluster.intra_node.bandwith_gbps");
  EXPECT_EQ(ds[0].message, "unknown key; did you mean \"bandwidth_gbps\"?");
  // In a flow map the column is that of the key inside the braces.
  expect_at(ds[1], 6, 36, "cluster.inter_node.latncy_us");
  EXPECT_EQ(ds[1].message, "unknown key; did you mean \"latency_us\"?");
}

TEST(ScenarioErrors, KeyInTheWrongCaseSuggestsTheKey) {
  auto ds = load_errors(yaml(R"(
cluster:
  Num_GPUs: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 3, "cluster.Num_GPUs");
  EXPECT_EQ(ds[0].message, "unknown key; did you mean \"num_gpus\"?");
}

TEST(ScenarioErrors, UnknownKeyWithNoCloseMatchListsTheAcceptedKeys) {
  auto ds = load_errors(yaml(R"(
parallelism:
  data_parallel_size: 2
  gradient_clipping: 1.0
learning_rate: 0.0001
)"));
  ASSERT_EQ(ds.size(), 2u) << dump(ds);
  expect_at(ds[0], 3, 3, "parallelism.gradient_clipping");
  EXPECT_EQ(ds[0].message, fmt::format("unknown key; parallelism accepts: {}",
                                       fmt::join(section_children("parallelism"), ", ")));
  EXPECT_CONTAINS(ds[0].message, "data_parallel_size, pipeline_parallel_size, tensor_parallel_size");
  EXPECT_CONTAINS(ds[0].message, "zero_stage");
  expect_at(ds[1], 4, 1, "learning_rate");
  EXPECT_EQ(ds[1].message,
            "unknown key; the top level accepts: name, description, model, cluster, parallelism, training, "
            "precision, communication, runtime, sweep, constraints");
}

// ---- wrong types ----------------------------------------------------------------------

TEST(ScenarioErrors, TextWhereAnIntegerIsExpected) {
  auto ds = load_errors(yaml(R"(
cluster:
  num_gpus: eight
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 13, "cluster.num_gpus");  // the value's column
  EXPECT_EQ(ds[0].message, "expected an integer, got \"eight\"");
  EXPECT_EQ(format_diagnostic(ds[0]), "test.yaml:2:13: error: cluster.num_gpus: expected an integer, got \"eight\"");
}

TEST(ScenarioErrors, ListWhereANumberIsExpected) {
  auto ds = load_errors(yaml(R"(
cluster:
  compute_efficiency: [0.5]
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 23, "cluster.compute_efficiency");
  EXPECT_EQ(ds[0].message, "expected a number, got a list");
}

TEST(ScenarioErrors, QuotedNumberIsTextNotAnInteger) {
  auto ds = load_errors(yaml(R"(
cluster:
  num_gpus: "8"
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 13, "cluster.num_gpus");
  EXPECT_EQ(ds[0].message, "expected an integer, got the quoted text \"8\"");
}

TEST(ScenarioErrors, MapWhereAScalarIsExpected) {
  auto ds = load_errors(yaml(R"(
parallelism:
  schedule: {name: gpipe}
model:
  num_layers: {value: 4}
)"));
  ASSERT_EQ(ds.size(), 2u) << dump(ds);
  expect_at(ds[0], 2, 13, "parallelism.schedule");
  EXPECT_EQ(ds[0].message, "expected one of gpipe, 1f1b, interleaved-1f1b, zb-h1, got a map");
  expect_at(ds[1], 4, 15, "model.num_layers");
  EXPECT_EQ(ds[1].message, "expected an integer, got a map");
}

TEST(ScenarioErrors, ScalarWhereASectionIsExpected) {
  auto ds = load_errors(yaml(R"(
model: gpt3-13b
cluster:
  intra_node: 300
)"));
  ASSERT_EQ(ds.size(), 2u) << dump(ds);
  expect_at(ds[0], 1, 8, "model");
  EXPECT_EQ(ds[0].message, "expected a section (a map of keys), got \"gpt3-13b\"");
  expect_at(ds[1], 3, 15, "cluster.intra_node");
  EXPECT_EQ(ds[1].message, "expected a section (a map of keys), got \"300\"");
}

TEST(ScenarioErrors, WrongBooleanAndWrongListEntry) {
  auto ds = load_errors(yaml(R"(
parallelism:
  sequence_parallel: maybe
  layers_per_stage: [10, ten, 10, 10]
)"));
  ASSERT_EQ(ds.size(), 2u) << dump(ds);
  expect_at(ds[0], 2, 22, "parallelism.sequence_parallel");
  EXPECT_EQ(ds[0].message, "expected true or false, got \"maybe\"");
  expect_at(ds[1], 3, 26, "parallelism.layers_per_stage");  // the bad entry itself
  EXPECT_EQ(ds[1].message, "entry 1 must be an integer, got \"ten\"");
}

TEST(ScenarioErrors, EmptyValueIsAnErrorAtItsKeyNotADefault) {
  // yaml-cpp marks an empty value where the next token starts (here the next line); the
  // error must point at the key that has no value.
  auto ds = load_errors(yaml(R"(
cluster:
  num_gpus:
  gpus_per_node: 8
model:
)"));
  ASSERT_EQ(ds.size(), 2u) << dump(ds);
  expect_at(ds[0], 2, 3, "cluster.num_gpus");
  EXPECT_EQ(ds[0].message, "expected an integer, got nothing");
  expect_at(ds[1], 4, 1, "model");
  EXPECT_EQ(ds[1].message, "expected a section (a map of keys), got nothing");
}

// ---- out of range -----------------------------------------------------------------------

TEST(ScenarioErrors, ZeroStageAboveThree) {
  auto ds = load_errors(yaml(R"(
parallelism:
  zero_stage: 4
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 15, "parallelism.zero_stage");
  EXPECT_EQ(ds[0].message, "must be between 0 and 3, got 4");
}

TEST(ScenarioErrors, ComputeEfficiencyAboveOne) {
  auto ds = load_errors(yaml(R"(
cluster:
  compute_efficiency: 1.5
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 23, "cluster.compute_efficiency");
  EXPECT_EQ(ds[0].message, "must be between 0.001 and 1, got 1.5");
}

TEST(ScenarioErrors, NegativeAndHugeIntegers) {
  // Integer bounds are written out in full, and a number too large for 64 bits is still
  // reported as out of range rather than as "not an integer".
  auto ds = load_errors(yaml(R"(
cluster:
  num_gpus: -8
  gpus_per_node: 99999999999999999999
)"));
  ASSERT_EQ(ds.size(), 2u) << dump(ds);
  expect_at(ds[0], 2, 13, "cluster.num_gpus");
  EXPECT_EQ(ds[0].message, "must be between 1 and 1048576, got -8");
  expect_at(ds[1], 3, 18, "cluster.gpus_per_node");
  EXPECT_EQ(ds[1].message, "must be between 1 and 1024, got 99999999999999999999");
}

TEST(ScenarioErrors, NegativeListEntry) {
  auto ds = load_errors(yaml(R"(
parallelism:
  layers_per_stage: [10, -1]
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 26, "parallelism.layers_per_stage");
  EXPECT_EQ(ds[0].message, "entry 1 must be between 0 and 100000, got -1");
}

// ---- choices and presets ----------------------------------------------------------------

TEST(ScenarioErrors, UnknownScheduleSuggestsTheReorderedName) {
  auto ds = load_errors(yaml(R"(
parallelism:
  schedule: 1f1b-interleaved
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 13, "parallelism.schedule");
  EXPECT_EQ(ds[0].message,
            "unknown value \"1f1b-interleaved\"; expected one of: gpipe, 1f1b, interleaved-1f1b, zb-h1 "
            "(did you mean \"interleaved-1f1b\"?)");
}

TEST(ScenarioErrors, UnknownComputeFormatSuggestsTheClosest) {
  auto ds = load_errors(yaml(R"(
precision:
  compute: bf61
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 12, "precision.compute");
  EXPECT_EQ(ds[0].message,
            "unknown value \"bf61\"; expected one of: fp32, tf32, fp16, bf16, fp8 (did you mean \"bf16\"?)");
}

TEST(ScenarioErrors, UnknownGpuPresetListsTheCatalog) {
  auto ds = load_errors(yaml(R"(
cluster:
  gpu: a100-40
  num_gpus: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 8, "cluster.gpu");
  EXPECT_CONTAINS(ds[0].message, "\"a100-40\": unknown GPU preset; did you mean \"a100-40gb\"? known: ");
  for (const auto& p : gpu_presets()) EXPECT_CONTAINS(ds[0].message, p.name);
}

TEST(ScenarioErrors, UnknownModelPresetListsTheCatalog) {
  auto ds = load_errors(yaml(R"(
model:
  preset: gpt3-13
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 11, "model.preset");
  EXPECT_CONTAINS(ds[0].message, "\"gpt3-13\": unknown model preset; did you mean \"gpt3-13b\"? known: ");
  for (const auto& p : model_presets()) EXPECT_CONTAINS(ds[0].message, p.name);
}

// Preset names as people type them: another case, the start of the name, separators; but a
// different product (B200) is not taken for a typo of a catalog entry (H200).
TEST(ScenarioErrors, PresetNamesGetADidYouMean) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model:\n  preset: llama2-70B\n", "did you mean \"llama2-70b\"?"},
      {"model:\n  preset: llama-2-13b\n", "did you mean \"llama2-13b\"?"},
      {"model:\n  preset: megatron-22\n", "did you mean \"megatron-22b\"?"},
      {"cluster:\n  gpu: h100\n", "did you mean \"h100-80gb\"?"},
      {"cluster:\n  gpu: A100-80GB\n", "did you mean \"a100-80gb\"?"},
  };
  for (const auto& [text, hint] : cases) {
    auto ds = load_errors(text);
    ASSERT_EQ(ds.size(), 1u) << text << dump(ds);
    EXPECT_CONTAINS(ds[0].message, hint);
  }
  auto ds = load_errors(yaml("cluster:\n  gpu: b200\n"));
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0].message.find("did you mean"), std::string::npos) << ds[0].message;
}

// ---- keys given twice, syntax, empty and missing files ----------------------------------

TEST(ScenarioErrors, KeyGivenTwice) {
  auto ds = load_errors(yaml(R"(
parallelism:
  pipeline_parallel_size: 4
  data_parallel_size: 2
  pipeline_parallel_size: 2
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 4, 3, "parallelism.pipeline_parallel_size");
  EXPECT_EQ(ds[0].message, "given twice (first on line 2)");
}

TEST(ScenarioErrors, SectionGivenTwice) {
  auto ds = load_errors(yaml(R"(
model:
  num_layers: 4
model:
  hidden_size: 64
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 3, 1, "model");
  EXPECT_EQ(ds[0].message, "given twice (first on line 1)");
}

TEST(ScenarioErrors, DottedKeyAndNestedKeyForTheSameFieldAreGivenTwice) {
  // A dotted key names the same field as the nested one; the later must not silently win.
  auto ds = load_errors(yaml(R"(
cluster:
  num_gpus: 8
cluster.num_gpus: 6
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 3, 1, "cluster.num_gpus");
  EXPECT_EQ(ds[0].message, "given twice (first on line 2)");
}

TEST(ScenarioErrors, YamlSyntaxErrorNamesItsLine) {
  auto ds = load_errors(yaml(R"(
name: t
model:
  num_layers: 4
 hidden_size: 5
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 4, 2, "");  // the badly indented key
  EXPECT_EQ(ds[0].message.rfind("YAML syntax: ", 0), 0u) << ds[0].message;
  EXPECT_EQ(format_diagnostic(ds[0]).rfind("test.yaml:4:2: error: YAML syntax: ", 0), 0u) << format_diagnostic(ds[0]);
}

TEST(ScenarioErrors, EmptyFile) {
  for (const std::string text : {"", "# only a comment\n", "---\n"}) {
    SCOPED_TRACE("text: \"" + text + "\"");
    auto ds = load_errors(text);
    ASSERT_EQ(ds.size(), 1u) << dump(ds);
    EXPECT_EQ(ds[0].file, "test.yaml");
    EXPECT_EQ(ds[0].key_path, "");
    EXPECT_CONTAINS(ds[0].message, "the scenario is empty");
    EXPECT_CONTAINS(format_diagnostic(ds[0]), "test.yaml: error: the scenario is empty");
  }
}

TEST(ScenarioErrors, RootThatIsNotAMap) {
  auto ds = load_errors(yaml(R"(
- model
- cluster
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 1, 1, "");
  EXPECT_EQ(ds[0].message, "a scenario must be a map of sections, got a list");
}

TEST(ScenarioErrors, SecondYamlDocumentIsNotSilentlyDropped) {
  auto ds = load_errors(yaml(R"(
name: first
---
name: second
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 3, 1, "");
  EXPECT_CONTAINS(ds[0].message, "2 YAML documents");
}

// yaml-cpp 0.7's LoadAll never returns on a token its parser neither takes nor refuses (a
// comma outside brackets): the loader reports it as a syntax error at the comma instead of
// hanging (found by fuzz/fuzz_scenario; inputs in fuzz/corpus/scenario/regression-*).
TEST(ScenarioErrors, TokenTheYamlParserCannotPassIsASyntaxErrorNotAHang) {
  struct Case {
    std::string text;
    int line, column;
  };
  for (const Case& c : {Case{",", 1, 1}, Case{"!,", 1, 2}, Case{"- a\n- b\n,\n", 3, 1}}) {
    SCOPED_TRACE("input: " + c.text);
    auto ds = load_errors(c.text);
    ASSERT_EQ(ds.size(), 1u) << dump(ds);
    expect_at(ds[0], c.line, c.column, "");
    EXPECT_EQ(ds[0].message, "YAML syntax: unexpected ','");
  }
}

TEST(ScenarioErrors, FileThatDoesNotExist) {
  const std::string path = std::string(TRAINSIM_SOURCE_DIR) + "/scenarios/no-such-scenario.yaml";
  try {
    load_scenario_file(path);
    FAIL() << "loaded a file that does not exist";
  } catch (const ScenarioError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u) << e.what();
    const Diagnostic& d = e.diagnostics()[0];
    EXPECT_EQ(d.file, path);
    EXPECT_EQ(d.key_path, "");
    EXPECT_EQ(d.message, "cannot open the file (does it exist and is it readable?)");
    EXPECT_EQ(format_diagnostic(d), path + ": error: cannot open the file (does it exist and is it readable?)");
  }
}

TEST(ScenarioErrors, FolderInsteadOfAFile) {
  // Reading a folder yields no bytes; it must not be reported as an empty scenario.
  const std::string path = std::string(TRAINSIM_SOURCE_DIR) + "/scenarios";
  try {
    load_scenario_file(path);
    FAIL() << "loaded a folder";
  } catch (const ScenarioError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u) << e.what();
    EXPECT_EQ(e.diagnostics()[0].file, path);
    EXPECT_EQ(e.diagnostics()[0].message, "is a folder, not a scenario file");
  }
}

// ---- invariants between keys, stated with their numbers ---------------------------------

TEST(ScenarioInvariants, GpuCountIsTheProductOfTheParallelSizes) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 6
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 1
  global_batch_size: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 9, 3, "parallelism.data_parallel_size");
  EXPECT_EQ(ds[0].message,
            "data_parallel_size(2) * pipeline_parallel_size(4) * tensor_parallel_size(1) = 8 != num_gpus(6) "
            "(num_gpus is not a multiple of pipeline x tensor = 4)");
  EXPECT_EQ(format_diagnostic(ds[0]),
            "test.yaml:9:3: error: parallelism.data_parallel_size: data_parallel_size(2) * "
            "pipeline_parallel_size(4) * tensor_parallel_size(1) = 8 != num_gpus(6) (num_gpus is not a multiple of "
            "pipeline x tensor = 4)");
}

TEST(ScenarioInvariants, InvariantOnAKeyNotWrittenPointsAtItsSection) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 6
parallelism:
  pipeline_parallel_size: 4
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  // data_parallel_size is not written, and 6 GPUs do not make whole 4-stage pipelines, so it is
  // not derived: the error points at the first written key of the product it states,
  // pipeline_parallel_size, and says why no data-parallel size fits.
  expect_at(ds[0], 5, 3, "parallelism.data_parallel_size");
  EXPECT_EQ(ds[0].message,
            "data_parallel_size(1) * pipeline_parallel_size(4) * tensor_parallel_size(1) = 4 != num_gpus(6) "
            "(num_gpus is not a multiple of pipeline x tensor = 4)");
}

// When neither the implicated key nor its section is written, the error points at the key
// that makes the default wrong: cluster.gpu for a compute format the GPU lacks. (The GPU count
// cannot be wrong that way: with no parallel size written, data_parallel_size is num_gpus.)
TEST(ScenarioInvariants, InvariantOnDefaultsStillNamesALineOfTheFile) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: v100-32gb
  num_gpus: 8
)"));
  const Diagnostic* compute = find_key(ds, "precision.compute");
  ASSERT_NE(compute, nullptr) << dump(ds);
  EXPECT_EQ(compute->message,
            "bf16 is not supported by GPU v100-32gb (cluster.peak_tflops.bf16 is 0); use fp16 with dynamic loss "
            "scaling");
  EXPECT_EQ(compute->where.line, 2) << format_diagnostic(*compute);  // gpu: v100-32gb
  EXPECT_EQ(compute->where.column, 3) << format_diagnostic(*compute);
  EXPECT_EQ(find_key(ds, "parallelism.data_parallel_size"), nullptr) << dump(ds);
  EXPECT_EQ(ds.size(), 1u) << dump(ds);
}

// A command-line override (`--set`) is applied as the file's own key would be: presets first
// (the file's other keys still override the swept-in preset), and it counts as written.
TEST(ScenarioOverrides, AnOverrideIsAppliedAsAWrittenKey) {
  const std::string file = "model: {preset: gpt3-1.3b, num_layers: 12}\ncluster: {num_gpus: 8}\n";
  const Scenario sc = load_scenario_text(file, "t.yaml",
                                         {{"model.preset", "gpt3-2.7b"}, {"parallelism.pipeline_parallel_size", "2"}});
  EXPECT_EQ(sc.config.model.hidden_size, 2560);  // gpt3-2.7b's
  EXPECT_EQ(sc.config.model.num_layers, 12);     // the file's, over the preset's 32
  EXPECT_TRUE(sc.has_key("parallelism.pipeline_parallel_size"));
  EXPECT_EQ(sc.config.parallelism.data_parallel_size, 4);  // derived from the overridden layout
  // Replacing a written key: the file's value is not applied (it would fail) and its line is no
  // longer the key's.
  const Scenario replaced =
      load_scenario_text("training: {micro_batch_size: 0}\n", "t.yaml", {{"training.micro_batch_size", "2"}});
  EXPECT_EQ(replaced.config.training.micro_batch_size, 2);
  EXPECT_EQ(replaced.locations.count("training.micro_batch_size"), 0u);
}

// What the file leaves unwritten of the layout and loss scaling is derived as Megatron-LM has it
// (core/scenario.h, derive_unwritten): data_parallel_size = num_gpus / (pipeline x tensor);
// num_gpus = data x pipeline x tensor when only data_parallel_size is written.
TEST(ScenarioInvariants, UnwrittenLayoutAndLossScalingAreDerivedFromTheRest) {
  auto load = [](const std::string& text) { return load_scenario_text(text, "test.yaml").config; };
  const ScenarioConfig data = load("cluster: {num_gpus: 64}\nparallelism: {pipeline_parallel_size: 2, tensor_parallel_size: 8}\n");
  EXPECT_EQ(data.parallelism.data_parallel_size, 4);
  EXPECT_EQ(data.cluster.num_gpus, 64);
  const ScenarioConfig gpus = load("parallelism: {data_parallel_size: 4, pipeline_parallel_size: 4}\n");
  EXPECT_EQ(gpus.cluster.num_gpus, 16);
  EXPECT_EQ(gpus.parallelism.data_parallel_size, 4);
  const ScenarioConfig unwritten = load("name: no-layout\n");
  EXPECT_EQ(unwritten.cluster.num_gpus, 8);  // one node
  EXPECT_EQ(unwritten.parallelism.data_parallel_size, 8);
  // The loss scaling follows the compute format where it is not written: dynamic under FP16
  // (Megatron-LM's), none under BF16 (FP32's exponent range); written, it is kept.
  EXPECT_EQ(load("precision: {compute: fp16}\n").precision.loss_scaling.mode, LossScalingMode::dynamic);
  EXPECT_EQ(load("precision: {compute: bf16}\n").precision.loss_scaling.mode, LossScalingMode::none);
  EXPECT_EQ(load("name: x\n").precision.loss_scaling.mode, LossScalingMode::none);  // bf16 by default
  EXPECT_EQ(load("precision: {compute: bf16, loss_scaling: {mode: static}}\n").precision.loss_scaling.mode,
            LossScalingMode::static_scale);
  // Both written: kept as written, and a mismatch is an error (GpuCountIsTheProductOfTheParallelSizes).
  const ScenarioConfig both = load("cluster: {num_gpus: 8}\nparallelism: {data_parallel_size: 2}\n");
  EXPECT_EQ(both.parallelism.data_parallel_size, 2);
  EXPECT_EQ(both.cluster.num_gpus, 8);
}

// Layers that the chunks do not divide are split as DESIGN.md's "default: balanced" says
// (default_layers_per_virtual_stage), and the plan says how.
TEST(ScenarioInvariants, LayersNotDivisibleByStagesAreSplitBalancedAndSaidSo) {
  const Scenario sc = load_scenario_text(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 30
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 1
  global_batch_size: 8
)"),
                                         "test.yaml");
  const Plan plan = Plan::from_scenario(sc);
  // The output layer (2 h V = 0.77 of a layer's forward FLOPs at s = 2048) on the last stage:
  // 7 + 0.77 there against 8 on the two middle ones, the first holding the layer short.
  EXPECT_EQ(plan.layers_per_virtual_stage, (std::vector<int>{7, 8, 8, 7}));
  const auto said = std::find_if(plan.warnings.begin(), plan.warnings.end(), [](const std::string& w) {
    return w.find("num_layers(30) does not divide into pipeline_parallel_size(4) * virtual_pipeline_stages(1) = 4 "
                  "model chunks: split 7 + 2 x 8 + 7 (") != std::string::npos;
  });
  EXPECT_NE(said, plan.warnings.end()) << fmt::format("{}", fmt::join(plan.warnings, "\n"));
  // A split the file writes is kept, and an even one says nothing.
  ScenarioConfig written = sc.config;
  written.parallelism.layers_per_stage = {6, 8, 8, 8};
  EXPECT_EQ(Plan::from_config(written).layers_per_virtual_stage, (std::vector<int>{6, 8, 8, 8}));
  ScenarioConfig divides = sc.config;
  divides.model.num_layers = 32;
  const Plan even = Plan::from_config(divides);
  EXPECT_EQ(even.layers_per_virtual_stage, (std::vector<int>{8, 8, 8, 8}));
  for (const auto& w : even.warnings) EXPECT_EQ(w.find("does not divide"), std::string::npos) << w;
}

// Too few layers for the chunks: an error, at the stage counts when the layers come from a preset.
TEST(ScenarioInvariants, LayersOfAPresetTooFewForTheChunksPointAtTheStages) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 48
model:
  preset: gpt3-13b
parallelism:
  pipeline_parallel_size: 48
training:
  micro_batch_size: 1
  global_batch_size: 48
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 7, 3, "model.num_layers");  // pipeline_parallel_size: 48 (40 layers)
  EXPECT_EQ(ds[0].message,
            "num_layers(40) cannot fill pipeline_parallel_size(48) * virtual_pipeline_stages(1) = 48 model chunks: "
            "every chunk but the first and the last needs a layer; use fewer stages or give "
            "parallelism.layers_per_stage");
}

// The least cost of the costliest part over every split of `layers` with part i holding at least
// mins[i], the last costing `extra` more (brute force): what a balanced split must reach.
double least_max_cost(int layers, const std::vector<int>& mins, double extra) {
  const int parts = static_cast<int>(mins.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> split(static_cast<std::size_t>(parts));
  std::function<void(int, int)> walk = [&](int i, int left) {
    if (i + 1 == parts) {
      if (left < mins.back()) return;
      split.back() = left;
      double c = 0;
      for (int k = 0; k < parts; ++k) c = std::max(c, split[static_cast<std::size_t>(k)] + (k + 1 == parts ? extra : 0.0));
      best = std::min(best, c);
      return;
    }
    for (int n = mins[static_cast<std::size_t>(i)]; n <= left; ++n) {
      split[static_cast<std::size_t>(i)] = n;
      walk(i + 1, left - n);
    }
  };
  walk(0, layers);
  return best;
}

// How many of each rank's chunks must hold a layer: all but the pipeline's first and last.
std::vector<int> middle_chunks_per_rank(int stages, int v) {
  std::vector<int> mins(static_cast<std::size_t>(stages));
  for (int j = 1; j + 1 < stages * v; ++j) ++mins[static_cast<std::size_t>(j % stages)];
  return mins;
}

// The output layer's cost in layers of a small model with `vocab` tokens.
ModelConfig small_model(int vocab, double* head) {
  ModelConfig m;
  m.hidden_size = 256;
  m.num_attention_heads = 4;
  m.seq_length = 512;
  m.vocab_size = vocab;
  const ModelShape shape(m);
  *head = shape.lm_head_forward_flops(1) / shape.layer_forward_flops(1);
  return m;
}

// One chunk per stage: the balanced split against every split there is (small sizes). The
// costliest chunk, the output layer counted on the last, is the least any split reaches that
// leaves no middle chunk empty; then the most layers on the last chunk, the short chunks first.
TEST(ScenarioInvariants, BalancedSplitIsTheBestOfEverySplit) {
  for (int vocab : {100, 1000, 5000}) {  // the output layer at 0.02, 0.2 and 1.2 layers
    double head = 0;
    ModelConfig m = small_model(vocab, &head);
    for (int layers = 1; layers <= 12; ++layers)
      for (int chunks = 1; chunks <= 6; ++chunks) {
        m.num_layers = layers;
        SCOPED_TRACE(fmt::format("head {:.2f} layers {} chunks {}", head, layers, chunks));
        const std::vector<int> got = default_layers_per_virtual_stage(m, chunks, 1);
        if (layers % chunks == 0) {
          EXPECT_EQ(got, std::vector<int>(static_cast<std::size_t>(chunks), layers / chunks));
          continue;
        }
        // Refused exactly where no split fills every chunk but the first and the last.
        EXPECT_EQ(got.empty(), layers < chunks - 2);
        if (got.empty()) continue;
        ASSERT_EQ(got.size(), static_cast<std::size_t>(chunks));
        EXPECT_EQ(std::accumulate(got.begin(), got.end(), 0), layers);
        double cost = 0;
        for (std::size_t i = 0; i < got.size(); ++i) cost = std::max(cost, got[i] + (i + 1 == got.size() ? head : 0.0));
        EXPECT_DOUBLE_EQ(cost, least_max_cost(layers, middle_chunks_per_rank(chunks, 1), head));
        for (std::size_t i = 1; i + 1 < got.size(); ++i) EXPECT_GE(got[i], 1) << "an empty middle chunk";
        for (std::size_t i = 2; i + 1 < got.size(); ++i) EXPECT_GE(got[i], got[i - 1]) << "a short chunk after a long one";
      }
  }
}

// Interleaved: the ranks balanced as above (each runs all its chunks for every micro-batch), then
// each rank's layers over its chunks, the output layer on the last rank's last one; only the
// pipeline's first and last chunk may be empty. An output layer worth several layers (a small
// hidden size with a large vocabulary) is where those minimums bind.
TEST(ScenarioInvariants, BalancedInterleavedSplitBalancesTheRanksThenTheirChunks) {
  int split = 0;
  for (int vocab : {100, 5000, 20000}) {  // 0.02, 1.2 and 4.9 layers
    double head = 0;
    ModelConfig m = small_model(vocab, &head);
    for (int layers = 1; layers <= 14; ++layers)
      for (int stages = 2; stages <= 4; ++stages)
        for (int v = 2; v <= 3; ++v) {
          m.num_layers = layers;
          SCOPED_TRACE(fmt::format("head {:.2f} layers {} stages {} v {}", head, layers, stages, v));
          const std::vector<int> got = default_layers_per_virtual_stage(m, stages, v);
          if (layers % (stages * v) == 0) continue;
          EXPECT_EQ(got.empty(), layers < stages * v - 2);
          if (got.empty()) continue;
          ++split;
          ASSERT_EQ(got.size(), static_cast<std::size_t>(stages * v));
          EXPECT_EQ(std::accumulate(got.begin(), got.end(), 0), layers);
          std::vector<int> rank_layers(static_cast<std::size_t>(stages));
          for (std::size_t j = 0; j < got.size(); ++j) rank_layers[j % stages] += got[j];
          double rank_cost = 0;
          for (int r = 0; r < stages; ++r)
            rank_cost = std::max(rank_cost, rank_layers[static_cast<std::size_t>(r)] + (r + 1 == stages ? head : 0.0));
          EXPECT_DOUBLE_EQ(rank_cost, least_max_cost(layers, middle_chunks_per_rank(stages, v), head));
          for (int r = 0; r < stages; ++r) {
            const double extra = r + 1 == stages ? head : 0.0;
            std::vector<int> mins(static_cast<std::size_t>(v));
            double chunk_cost = 0;
            for (int k = 0; k < v; ++k) {
              const int j = k * stages + r;
              mins[static_cast<std::size_t>(k)] = j != 0 && j + 1 != stages * v ? 1 : 0;
              chunk_cost = std::max(chunk_cost, got[static_cast<std::size_t>(j)] + (k + 1 == v ? extra : 0.0));
            }
            EXPECT_DOUBLE_EQ(chunk_cost, least_max_cost(rank_layers[static_cast<std::size_t>(r)], mins, extra))
                << "rank " << r;
          }
          for (std::size_t j = 1; j + 1 < got.size(); ++j) EXPECT_GE(got[j], 1) << "an empty middle chunk";
        }
  }
  EXPECT_GT(split, 120);  // 141: the loops above are not vacuous
}

// Llama 3 405B's own split (Dubey et al. 2024, section 3.3.2: one layer fewer on the first and the
// last of 16 stages; the Table 4 row's 16 x 8 chunks, the first holding only the embedding and
// the last only the output layer and loss).
TEST(ScenarioInvariants, BalancedSplitOfLlama3405BIsLlama3s) {
  const ModelConfig m =
      load_scenario_text("model: {preset: llama3-405b}\ncluster: {gpu: h100-80gb, num_gpus: 8}\n", "test.yaml").config.model;
  ASSERT_EQ(m.num_layers, 126);
  const std::vector<int> stages = default_layers_per_virtual_stage(m, 16, 1);
  EXPECT_EQ(layer_split_text(stages), "7 + 14 x 8 + 7");
  std::vector<int> chunks(128, 1);
  chunks.front() = chunks.back() = 0;
  EXPECT_EQ(default_layers_per_virtual_stage(m, 16, 8), chunks);
  EXPECT_EQ(layer_split_text(chunks), "0 + 126 x 1 + 0");
  EXPECT_EQ(uneven_layers_text(std::vector<int>(16, 8)), "");
  EXPECT_EQ(uneven_layers_text(stages), ", layers 7 + 14 x 8 + 7");
}

TEST(ScenarioInvariants, LayersPerStageThatDoesNotSum) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
  layers_per_stage: [10, 10, 10, 9]
training:
  micro_batch_size: 1
  global_batch_size: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 12, 3, "parallelism.layers_per_stage");
  EXPECT_EQ(ds[0].message, "sums to 39 layers but num_layers is 40");
}

TEST(ScenarioInvariants, LayersPerStageWithTheWrongNumberOfEntries) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
  layers_per_stage: [20, 20]
training:
  micro_batch_size: 1
  global_batch_size: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 12, 3, "parallelism.layers_per_stage");
  EXPECT_EQ(ds[0].message, "has 2 entries; pipeline_parallel_size(4) * virtual_pipeline_stages(1) = 4 needed");
}

TEST(ScenarioInvariants, UnevenLayersPerStageThatSumsIsAccepted) {
  Plan plan = plan_of(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 30
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
  layers_per_stage: [6, 8, 8, 8]
training:
  micro_batch_size: 1
  global_batch_size: 8
)"));
  EXPECT_EQ(plan.layers_per_virtual_stage, (std::vector<int>{6, 8, 8, 8}));
}

TEST(ScenarioInvariants, GlobalBatchNotDivisibleByMicroBatchTimesDataParallel) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 2
  global_batch_size: 10
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 14, 3, "training.global_batch_size");
  EXPECT_EQ(ds[0].message,
            "global_batch_size(10) is not divisible by micro_batch_size(2) * data_parallel_size(2) = 4");
}

// A gradient bucket thousands of times smaller than the gradients makes hundreds of millions of
// ops (every bucket an op of every data-parallel member's program: gigabytes of schedule, minutes
// to walk): refused at the key with the count and the smallest bucket that stays under the bound,
// which is accepted.
TEST(ScenarioInvariants, BucketsTooSmallForTheGradientsAreRefusedWithOneThatFits) {
  const auto text = [](const std::string& bucket_mib) {
    return yaml(R"(
model:
  preset: megatron-22b
cluster:
  gpu: h100-80gb
  num_gpus: 64
parallelism:
  data_parallel_size: 32
  pipeline_parallel_size: 2
training:
  micro_batch_size: 1
  global_batch_size: 128
communication:
  bucket_size_mib: )") + bucket_mib + "\n";
  };
  const auto ds = plan_errors(text("0.01"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 13, 3, "communication.bucket_size_mib");
  const std::string& message = ds[0].message;
  const std::string use = "use bucket_size_mib >= ";
  const auto at = message.find(use);
  ASSERT_NE(at, std::string::npos) << message;
  const std::string suggested = message.substr(at + use.size(), message.find(' ', at + use.size()) - at - use.size());
  const Plan accepted = plan_of(text(suggested));
  // The count it states, from the accepted plan's shards: each chunk's FP32 gradients in 0.01 MiB.
  double buckets = 0;
  for (int vs = 0; vs < accepted.num_virtual_stages(); ++vs)
    buckets += std::ceil(std::round(accepted.shard_params(vs) * 4) / (0.01 * 1048576));
  EXPECT_GT(buckets * 32, kMaxGradientBucketOps);
  EXPECT_CONTAINS(message, fmt::format("into {:.0f} buckets over 32 data-parallel members", buckets));
}

// With global_batch_size left at 0 the default global batch is micro_batch_size *
// data_parallel_size; sizes the field table accepts (2^20 * 2^20) must be refused with their
// numbers, not wrap around in 32 bits.
TEST(ScenarioInvariants, DefaultGlobalBatchThatOverflowsIsRejected) {
  auto ds = plan_errors(yaml(R"(
cluster:
  num_gpus: 1048576
  gpus_per_node: 8
parallelism:
  data_parallel_size: 1048576
training:
  micro_batch_size: 1048576
)"));
  ASSERT_FALSE(ds.empty());
  bool names_the_batch = false;
  for (const auto& d : ds)
    if (d.key_path.rfind("training.", 0) == 0 && d.where.line > 0) names_the_batch = true;
  EXPECT_TRUE(names_the_batch) << dump(ds);
}

TEST(ScenarioInvariants, HeadsThatDoNotDivideHiddenSize) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 48
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 1
  global_batch_size: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 7, 3, "model.num_attention_heads");
  // 5120 = 48 * 106 + 32
  EXPECT_EQ(ds[0].message,
            "num_attention_heads(48) does not divide hidden_size(5120): hidden_size % num_attention_heads = 32");
}

TEST(ScenarioInvariants, Bf16OnV100IsRejected) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: v100-32gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 1
  global_batch_size: 8
precision:
  compute: bf16
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 16, 3, "precision.compute");
  EXPECT_EQ(ds[0].message,
            "bf16 is not supported by GPU v100-32gb (cluster.peak_tflops.bf16 is 0); use fp16 with dynamic loss "
            "scaling");
}

TEST(ScenarioInvariants, Fp8OnA100IsRejected) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 1
  global_batch_size: 8
precision:
  compute: fp8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 16, 3, "precision.compute");
  EXPECT_EQ(ds[0].message,
            "fp8 is not supported by GPU a100-40gb (cluster.peak_tflops.fp8 is 0); use bf16 or fp16");
}

TEST(ScenarioInvariants, Fp8OnH100IsAccepted) {
  Plan plan = plan_of(yaml(R"(
cluster:
  gpu: h100-80gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 1
  global_batch_size: 8
precision:
  compute: fp8
)"));
  EXPECT_EQ(plan.config.precision.compute, DType::fp8);
  EXPECT_EQ(plan.config.cluster.gpu, "h100-80gb");
  EXPECT_GT(plan.peak_flops(DType::fp8), 0.0);
}

TEST(ScenarioInvariants, InterleavedScheduleWithoutVirtualStages) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
  schedule: interleaved-1f1b
training:
  micro_batch_size: 1
  global_batch_size: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 12, 3, "parallelism.schedule");
  EXPECT_EQ(ds[0].message, "interleaved-1f1b needs virtual_pipeline_stages >= 2 (it is 1)");
}

TEST(ScenarioInvariants, VirtualStagesWithoutInterleavedSchedule) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
  virtual_pipeline_stages: 2
training:
  micro_batch_size: 1
  global_batch_size: 8
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 12, 3, "parallelism.virtual_pipeline_stages");
  EXPECT_EQ(ds[0].message, "virtual_pipeline_stages(2) > 1 needs schedule: interleaved-1f1b (schedule is 1f1b)");
}

TEST(ScenarioInvariants, InterleavedNeedsMicroBatchesAMultipleOfStages) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
  schedule: interleaved-1f1b
  virtual_pipeline_stages: 2
training:
  micro_batch_size: 1
  global_batch_size: 12
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 16, 3, "training.global_batch_size");
  // 12 / (1 * 2) = 6 micro-batches per replica
  EXPECT_EQ(ds[0].message,
            "interleaved-1f1b needs micro-batches per replica (6) to be a multiple of pipeline_parallel_size(4), or "
            "parallelism.microbatch_group_size set so that they divide into its groups");
}

// Megatron-Core's groups of n micro-batches a chunk: p <= n <= m, a short last group at least p.
TEST(ScenarioInvariants, InterleavedMicroBatchGroupsFollowMegatronCoresRule) {
  ScenarioConfig c = testing::small_config(4, 6, ScheduleKind::interleaved_1f1b, 2);
  auto errors = [&](int n) {
    c.parallelism.microbatch_group_size = n;
    try {
      Plan::from_config(c);
    } catch (const ScenarioError& e) {
      return e.diagnostics();
    }
    return std::vector<Diagnostic>{};
  };
  EXPECT_TRUE(errors(6).empty());  // one group of all six: 6 % 6 == 0
  EXPECT_EQ(Plan::from_config(c).microbatch_group, 6);
  for (int n : {3, 7}) {
    const auto ds = errors(n);
    ASSERT_EQ(ds.size(), 1u) << n;
    EXPECT_EQ(ds[0].key_path, "parallelism.microbatch_group_size");
    EXPECT_EQ(ds[0].message, fmt::format("microbatch_group_size({}) must lie between pipeline_parallel_size(4) and "
                                         "the micro-batches per replica (6)",
                                         n));
  }
  for (int n : {4, 5}) {  // a last group of 2 or 1 after a group of 4 or 5
    const auto ds = errors(n);
    ASSERT_EQ(ds.size(), 1u) << n;
    EXPECT_EQ(ds[0].message, fmt::format("micro-batches per replica (6) leave a last group of {} after groups of "
                                         "microbatch_group_size({}): fewer than pipeline_parallel_size(4), which "
                                         "stalls the pipeline",
                                         6 % n, n));
  }
  c.parallelism.framework = Framework::fsdp;  // PyTorch's schedule has no such groups
  {
    const auto ds = errors(6);
    ASSERT_EQ(ds.size(), 1u);
    EXPECT_EQ(ds[0].message, "microbatch_group_size(6) is Megatron-Core's; PyTorch's interleaved schedule (framework "
                             "fsdp) runs groups of pipeline_parallel_size(4)");
  }
  c.parallelism.framework = Framework::auto_select;
  c.parallelism.schedule = ScheduleKind::one_f_one_b;  // the key means nothing elsewhere
  c.parallelism.virtual_pipeline_stages = 1;
  EXPECT_TRUE(errors(3).empty()) << dump(errors(3));
}

// Interleaved without p2p overlap: Megatron-LM's own refusal on two stages (arguments.py), and
// groups other than p, whose lockstep exchanges trainsim does not model, named instead of run
// into a deadlock.
TEST(ScenarioInvariants, InterleavedWithoutP2POverlapFollowsMegatronsRules) {
  auto errors = [](const ScenarioConfig& c) {
    try {
      Plan::from_config(c);
    } catch (const ScenarioError& e) {
      return e.diagnostics();
    }
    return std::vector<Diagnostic>{};
  };
  // Refused blocking with exactly one error at `key`, `message`; accepted with overlap.
  auto refused_blocking = [&](ScenarioConfig c, const std::string& key, const std::string& message) {
    c.communication.overlap_p2p_comm = false;
    const auto ds = errors(c);
    ASSERT_EQ(ds.size(), 1u) << dump(ds);
    EXPECT_EQ(ds[0].key_path, key);
    EXPECT_EQ(ds[0].message, message);
    c.communication.overlap_p2p_comm = true;
    EXPECT_TRUE(errors(c).empty()) << dump(errors(c));
  };
  refused_blocking(testing::small_config(2, 4, ScheduleKind::interleaved_1f1b, 2), "communication.overlap_p2p_comm",
                   "Megatron-LM refuses interleaved-1f1b without p2p overlap on pipeline_parallel_size(2) <= 2: "
                   "\"pipeline-model-parallel size should be greater than 2 to avoid having multiple p2p sends and "
                   "recvs between same 2 ranks per communication batch\" (arguments.py); set overlap_p2p_comm: true");
  ScenarioConfig grouped = testing::small_config(4, 6, ScheduleKind::interleaved_1f1b, 2);
  grouped.parallelism.microbatch_group_size = 6;
  refused_blocking(grouped, "parallelism.microbatch_group_size",
                   "microbatch_group_size(6) other than pipeline_parallel_size(4) with blocking pipeline exchanges "
                   "(overlap_p2p_comm: false) is not modelled: Megatron-Core receives each tensor in the iteration "
                   "its neighbour sends it and queues it; set overlap_p2p_comm: true or microbatch_group_size: 4");
  ScenarioConfig plain = testing::small_config(4, 8, ScheduleKind::interleaved_1f1b, 2);
  plain.communication.overlap_p2p_comm = false;  // groups of p: the exchange trainsim models
  EXPECT_TRUE(errors(plain).empty()) << dump(errors(plain));
}

TEST(ScenarioInvariants, InterleavedWithEnoughMicroBatchesIsAccepted) {
  Plan plan = plan_of(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 8
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 40
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
  schedule: interleaved-1f1b
  virtual_pipeline_stages: 2
training:
  micro_batch_size: 1
  global_batch_size: 16
)"));
  EXPECT_EQ(plan.vpp, 2);
  EXPECT_EQ(plan.num_microbatches, 8);
  EXPECT_EQ(plan.layers_per_virtual_stage, std::vector<int>(8, 5));
}

// ---- several errors at once -------------------------------------------------------------

TEST(ScenarioErrors, EveryLoaderErrorIsReportedInFileOrder) {
  auto ds = load_errors(yaml(R"(
name: several
cluster:
  gpu: a100-40gb
  num_gpu: 8
  compute_efficiency: 1.5
parallelism:
  zero_stage: four
  schedule: 1f1b-interleaved
precision:
  compute: bf61
)"));
  ASSERT_EQ(ds.size(), 5u) << dump(ds);
  expect_at(ds[0], 4, 3, "cluster.num_gpu");
  expect_at(ds[1], 5, 23, "cluster.compute_efficiency");
  expect_at(ds[2], 7, 15, "parallelism.zero_stage");
  EXPECT_EQ(ds[2].message, "expected an integer, got \"four\"");
  expect_at(ds[3], 8, 13, "parallelism.schedule");
  expect_at(ds[4], 10, 12, "precision.compute");
}

TEST(ScenarioErrors, WhatListsEveryDiagnosticOnItsOwnLine) {
  try {
    load_scenario_text(yaml(R"(
cluster:
  num_gpu: 8
parallelism:
  zero_stage: 4
)"),
                       "test.yaml");
    FAIL() << "loaded without an error";
  } catch (const ScenarioError& e) {
    ASSERT_EQ(e.diagnostics().size(), 2u) << e.what();
    EXPECT_EQ(std::string(e.what()),
              "test.yaml:2:3: error: cluster.num_gpu: unknown key; did you mean \"num_gpus\"?\n"
              "test.yaml:4:15: error: parallelism.zero_stage: must be between 0 and 3, got 4");
  }
}

TEST(ScenarioInvariants, EveryBrokenInvariantIsReported) {
  auto ds = plan_errors(yaml(R"(
cluster:
  gpu: a100-40gb
  num_gpus: 6
model:
  num_layers: 40
  hidden_size: 5120
  num_attention_heads: 48
parallelism:
  data_parallel_size: 2
  pipeline_parallel_size: 4
  tensor_parallel_size: 1
training:
  micro_batch_size: 1
  global_batch_size: 9
)"));
  ASSERT_EQ(ds.size(), 3u) << dump(ds);
  const Diagnostic* gpus = find_key(ds, "parallelism.data_parallel_size");
  const Diagnostic* heads = find_key(ds, "model.num_attention_heads");
  const Diagnostic* batch = find_key(ds, "training.global_batch_size");
  ASSERT_TRUE(gpus && heads && batch) << dump(ds);
  expect_at(*gpus, 9, 3, "parallelism.data_parallel_size");
  EXPECT_CONTAINS(gpus->message, "= 8 != num_gpus(6)");
  expect_at(*heads, 7, 3, "model.num_attention_heads");
  EXPECT_CONTAINS(heads->message, "num_attention_heads(48) does not divide hidden_size(5120)");
  expect_at(*batch, 14, 3, "training.global_batch_size");
  EXPECT_EQ(batch->message,
            "global_batch_size(9) is not divisible by micro_batch_size(1) * data_parallel_size(2) = 2");
}

// ---- sweep --------------------------------------------------------------------------------

TEST(ScenarioErrors, SweepAxisThatIsNotAKeySuggestsOne) {
  auto ds = load_errors(yaml(R"(
name: s
sweep:
  parallelism.pipline_parallel_size: [1, 2]
  micro_batch_size: [1, 2]
  parallelism.zero_stage: [0, 1]
  parallelism.zero_stage: [2, 3]
)"));
  ASSERT_EQ(ds.size(), 3u) << dump(ds);
  expect_at(ds[0], 3, 3, "sweep.parallelism.pipline_parallel_size");
  EXPECT_EQ(ds[0].message, "not a scenario key; did you mean \"parallelism.pipeline_parallel_size\"?");
  // An axis written without its section.
  expect_at(ds[1], 4, 3, "sweep.micro_batch_size");
  EXPECT_EQ(ds[1].message, "not a scenario key; did you mean \"training.micro_batch_size\"?");
  expect_at(ds[2], 6, 3, "sweep.parallelism.zero_stage");
  EXPECT_EQ(ds[2].message, "given twice (first on line 5)");
}

TEST(ScenarioErrors, BadValueInsideASweepList) {
  auto ds = load_errors(yaml(R"(
sweep:
  precision.compute: [fp16, bf61]
  training.micro_batch_size: [1, 0]
  cluster.gpu: [a100-40gb, b200]
)"));
  ASSERT_EQ(ds.size(), 3u) << dump(ds);
  expect_at(ds[0], 2, 29, "sweep.precision.compute");
  EXPECT_EQ(ds[0].message,
            "unknown value \"bf61\"; expected one of: fp32, tf32, fp16, bf16, fp8 (did you mean \"bf16\"?)");
  expect_at(ds[1], 3, 34, "sweep.training.micro_batch_size");
  EXPECT_EQ(ds[1].message, "must be between 1 and 1048576, got 0");
  expect_at(ds[2], 4, 28, "sweep.cluster.gpu");
  EXPECT_CONTAINS(ds[2].message, "\"b200\": unknown GPU preset; known: ");
}

TEST(ScenarioErrors, SweepThatIsNotAMapOfLists) {
  auto ds = load_errors(yaml(R"(
sweep:
  training.micro_batch_size: 4
  precision.compute:
  parallelism.zero_stage: []
)"));
  ASSERT_EQ(ds.size(), 3u) << dump(ds);
  expect_at(ds[0], 2, 30, "sweep.training.micro_batch_size");
  EXPECT_EQ(ds[0].message, "expected a non-empty list of values, got \"4\"");
  expect_at(ds[1], 3, 3, "sweep.precision.compute");
  EXPECT_EQ(ds[1].message, "expected a non-empty list of values, got nothing");
  expect_at(ds[2], 4, 27, "sweep.parallelism.zero_stage");
  EXPECT_EQ(ds[2].message, "expected a non-empty list of values, got an empty list");
}

TEST(ScenarioLoad, SweepAxesLoadInOrder) {
  Scenario sc = load_scenario_text(yaml(R"(
sweep:
  parallelism.pipeline_parallel_size: [1, 2, 4]
  precision.compute: [fp16, bf16]
)"),
                                   "test.yaml");
  ASSERT_EQ(sc.sweep.size(), 2u);
  EXPECT_EQ(sc.sweep[0].path, "parallelism.pipeline_parallel_size");
  EXPECT_EQ(sc.sweep[0].values, (std::vector<FieldValue>{std::int64_t{1}, std::int64_t{2}, std::int64_t{4}}));
  EXPECT_EQ(sc.sweep[0].where.line, 2);
  EXPECT_EQ(sc.sweep[0].where.column, 3);
  EXPECT_EQ(sc.sweep[1].path, "precision.compute");
  EXPECT_EQ(sc.sweep[1].values, (std::vector<FieldValue>{std::string("fp16"), std::string("bf16")}));
}

// ---- no input makes anything but a ScenarioError -------------------------------------------

TEST(ScenarioErrors, OddInputsGiveScenarioErrorsWithLocations) {
  const std::vector<std::string> inputs = {
      "? [a, b]\n: 1\n",
      "sweep:\n  ? [x]\n  : [1]\n",
      "sweep: [1]\n",
      "sweep:\n  cluster.gpu: ~\n",
      "model: &m {num_layers: 4}\ncluster: *m\n",
      "<<: {name: x}\n",
      "{",
      "]",
      "\t",
      "name: \"\\xZZ\"\n",
      "model: [1, 2]\n",
      "parallelism:\n  layers_per_stage: [[1], {a: 1}, ~]\n",
      "cluster:\n  peak_tflops: {fp64: 1}\n",
      "runtime:\n  model: 3\n",
      "cluster:\n  memory_gib: .nan\n  hbm_bandwidth_gbps: 1e999\n",
      "model:\n  num_layers: 4.0\n  hidden_size: 0x400\n",
      "training:\n  global_batch_size: -0\n  micro_batch_size: +\n",
      "runtime:\n  seed: 9100000000000000\n",
  };
  for (const auto& text : inputs) {
    SCOPED_TRACE("input:\n" + text);
    auto ds = load_errors(text);
    EXPECT_FALSE(ds.empty());
    for (const auto& d : ds) {
      EXPECT_EQ(d.file, "test.yaml");
      EXPECT_FALSE(d.message.empty());
      // An error about a key always says where that key is.
      if (!d.key_path.empty()) {
        EXPECT_GT(d.where.line, 0) << format_diagnostic(d);
        EXPECT_GT(d.where.column, 0) << format_diagnostic(d);
      }
    }
  }
}

// runtime.backend is a choice: a typo fails at load time, not when `trainsim run` starts.
TEST(ScenarioErrors, UnknownRuntimeBackendIsRejected) {
  auto ds = load_errors(yaml(R"(
runtime:
  backend: cdua
)"));
  ASSERT_EQ(ds.size(), 1u) << dump(ds);
  expect_at(ds[0], 2, 12, "runtime.backend");
  EXPECT_CONTAINS(ds[0].message, "\"cdua\"");
  EXPECT_CONTAINS(ds[0].message, "did you mean \"cuda\"?");
}

// ---- positive round trips ---------------------------------------------------------------

TEST(ScenarioLoad, BundledPostmortemLoadsAndValidates) {
  const std::string path = std::string(TRAINSIM_SOURCE_DIR) + "/scenarios/postmortem-8x40gb.yaml";
  const Scenario sc = load_scenario_file(path);
  EXPECT_EQ(sc.file, path);
  EXPECT_EQ(sc.config.name, "postmortem-8x40gb");
  EXPECT_EQ(sc.config.model.preset, "gpt3-6.7b");
  EXPECT_EQ(sc.config.cluster.gpu, "a100-40gb");
  // Its search space for `trainsim plan`: every layout of the 8 GPUs, among other axes.
  ASSERT_FALSE(sc.sweep.empty());
  EXPECT_EQ(sc.sweep.front().kind, SweepAxisKind::auto_parallelism);
  const Plan plan = Plan::from_scenario(sc);
  EXPECT_EQ(plan.dp, 2);
  EXPECT_EQ(plan.pp, 4);
  EXPECT_EQ(plan.tp, 1);
  EXPECT_EQ(plan.vpp, 1);
  EXPECT_EQ(plan.micro_batch_size, 2);
  EXPECT_EQ(plan.global_batch_size, 16);
  EXPECT_EQ(plan.num_microbatches, 4);  // 16 / (2 * 2)
  EXPECT_EQ(plan.layers_per_virtual_stage, std::vector<int>(4, 8));  // gpt3-6.7b: 32 layers
  EXPECT_EQ(plan.config.model.hidden_size, 4096);
  EXPECT_EQ(plan.config.cluster.memory_gib, 40.0);
  EXPECT_EQ(plan.config.parallelism.schedule, ScheduleKind::gpipe);
  EXPECT_EQ(plan.config.precision.compute, DType::fp16);
  EXPECT_EQ(plan.config.precision.loss_scaling.mode, LossScalingMode::static_scale);
  EXPECT_EQ(plan.config.training.activation_recompute, Recompute::full);
}

TEST(ScenarioLoad, ExplicitKeysOverrideAPresetWhateverTheKeyOrder) {
  const std::vector<std::string> texts = {
      yaml(R"(
model:
  preset: gpt3-13b
  num_layers: 20
cluster:
  gpu: a100-80gb
  memory_gib: 32
)"),
      yaml(R"(
cluster:
  memory_gib: 32
  gpu: a100-80gb
model:
  num_layers: 20
  preset: gpt3-13b
)"),
      // Dotted keys name the same fields; the preset still applies first.
      yaml(R"(
model.num_layers: 20
cluster.memory_gib: 32
model.preset: gpt3-13b
cluster.gpu: a100-80gb
)"),
  };
  for (const auto& text : texts) {
    SCOPED_TRACE(text);
    const Scenario sc = load_scenario_text(text, "test.yaml");
    EXPECT_EQ(sc.config.model.preset, "gpt3-13b");
    EXPECT_EQ(sc.config.model.num_layers, 20);             // explicit
    EXPECT_EQ(sc.config.model.hidden_size, 5120);          // from the preset
    EXPECT_EQ(sc.config.model.num_attention_heads, 40);    // from the preset
    EXPECT_EQ(sc.config.model.ffn_hidden_size, 4 * 5120);  // from the preset
    EXPECT_EQ(sc.config.cluster.gpu, "a100-80gb");
    EXPECT_EQ(sc.config.cluster.memory_gib, 32.0);            // explicit
    EXPECT_EQ(sc.config.cluster.hbm_bandwidth_gbps, 2039.0);  // from the preset
    EXPECT_TRUE(sc.has_key("model.num_layers"));
    EXPECT_FALSE(sc.has_key("model.hidden_size"));
  }
}

// Nested YAML for one dotted key path: "a.b.c" -> "a:\n  b:\n    c: value\n".
std::string nested_yaml(const std::string& path, const std::string& value) {
  std::string out, indent;
  std::size_t start = 0;
  for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', start)) {
    out += indent + path.substr(start, dot - start) + ":\n";
    indent += "  ";
    start = dot + 1;
  }
  return out + indent + path.substr(start) + ": " + value + "\n";
}

std::string yaml_value(const FieldValue& v) {
  if (const auto* s = std::get_if<std::string>(&v)) return "\"" + *s + "\"";
  if (const auto* x = std::get_if<double>(&v)) return fmt::format("{}", *x);  // shortest exact form
  return format_field_value(v);
}

// model.preset and cluster.gpu default to "" (no preset); writing that default back means
// "no preset", not an unknown one.
TEST(ScenarioLoad, EveryFieldRoundTripsWithItsDefault) {
  const ScenarioConfig defaults{};
  for (const FieldSpec& f : scenario_fields()) {
    const FieldValue expected = f.get(defaults);
    const std::string value = f.default_note.empty() ? field_default_text(f) : yaml_value(expected);
    const std::string text = nested_yaml(f.path, value);
    SCOPED_TRACE(f.path + " written as:\n" + text);
    try {
      const Scenario sc = load_scenario_text(text, "test.yaml");
      EXPECT_EQ(f.get(sc.config), expected) << format_field_value(f.get(sc.config));
      EXPECT_TRUE(sc.has_key(f.path));
      const auto depth = static_cast<int>(std::count(f.path.begin(), f.path.end(), '.'));
      ASSERT_EQ(sc.locations.count(f.path), 1u);
      EXPECT_EQ(sc.locations.at(f.path).line, depth + 1);
      EXPECT_EQ(sc.locations.at(f.path).column, 2 * depth + 1);
    } catch (const ScenarioError& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

// A value of the field's kind, within its bounds, that differs from the default.
FieldValue another_value(const FieldSpec& f, const FieldValue& def) {
  switch (f.kind) {
    case FieldKind::integer: {
      const auto d = std::get<std::int64_t>(def);
      return FieldValue{static_cast<double>(d + 1) <= f.max ? d + 1 : d - 1};
    }
    case FieldKind::real: {
      const double d = std::get<double>(def);
      for (double x : {d / 2, d * 2, d + 1, f.min, f.max})
        if (std::isfinite(x) && x != d && x >= f.min && x <= f.max) return FieldValue{x};
      return def;
    }
    case FieldKind::boolean: return FieldValue{!std::get<bool>(def)};
    case FieldKind::text: return FieldValue{std::string("some text")};
    case FieldKind::choice:
      for (const auto& c : f.choices)
        if (c != std::get<std::string>(def)) return FieldValue{c};
      return def;
    case FieldKind::integer_list: return FieldValue{IntList{3, 0, 7}};
  }
  return def;
}

TEST(ScenarioLoad, EveryFieldRoundTripsWithAnotherValue) {
  const ScenarioConfig defaults{};
  for (const FieldSpec& f : scenario_fields()) {
    if (f.applies_preset) continue;  // presets take catalog names: covered above and below
    const FieldValue wanted = another_value(f, f.get(defaults));
    ASSERT_NE(wanted, f.get(defaults)) << f.path;
    const std::string text = nested_yaml(f.path, yaml_value(wanted));
    SCOPED_TRACE(f.path + " written as:\n" + text);
    try {
      const Scenario sc = load_scenario_text(text, "test.yaml");
      EXPECT_EQ(f.get(sc.config), wanted) << format_field_value(f.get(sc.config));
    } catch (const ScenarioError& e) {
      ADD_FAILURE() << e.what();
    }
  }
  for (const auto& p : gpu_presets()) {
    const Scenario sc = load_scenario_text(nested_yaml("cluster.gpu", p.name), "test.yaml");
    EXPECT_EQ(sc.config.cluster.gpu, p.name);
    EXPECT_EQ(sc.config.cluster.memory_gib, p.memory_gib);
  }
  for (const auto& p : model_presets()) {
    const Scenario sc = load_scenario_text(nested_yaml("model.preset", p.name), "test.yaml");
    EXPECT_EQ(sc.config.model.preset, p.name);
    EXPECT_EQ(sc.config.model.num_layers, p.model.num_layers);
  }
}

}  // namespace
}  // namespace trainsim
