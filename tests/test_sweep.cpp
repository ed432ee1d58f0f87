// The sweep engine: expanding axes (cartesian products, generated factorisations), the
// scenario loader's `sweep:` and `constraints:` sections, determinism across thread counts,
// every infeasibility reason with its numbers, the Pareto front against a brute-force
// check, and `trainsim sweep` run as a user runs it.
#include <gtest/gtest.h>

#include "tests/command_helpers.h"
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <unistd.h>

#include <fmt/format.h>

#include "core/plan.h"
#include "core/scenario.h"
#include "core/units.h"
#include "sim/simulator.h"
#include "sim/sweep/report.h"
#include "sim/sweep/sweep.h"

namespace trainsim {
namespace {

namespace fs = std::filesystem;

using trainsim::testing::kDefault;
using trainsim::testing::postmortem_text;
using trainsim::testing::slurp;

// The bundled incident with `extra` (a sweep and constraints) appended.
Scenario postmortem_with(const std::string& extra) {
  return load_scenario_text(postmortem_text() + extra, "postmortem+sweep.yaml");
}

std::vector<Diagnostic> load_errors(const std::string& text) {
  try {
    load_scenario_text(text, "t.yaml");
  } catch (const ScenarioError& e) {
    return e.diagnostics();
  }
  return {};
}

// ---- expansion ----------------------------------------------------------------------------

TEST(SweepExpand, DivisorsMatchTrialDivision) {
  for (std::int64_t n = 1; n <= 200; ++n) {
    std::vector<std::int64_t> want;
    for (std::int64_t d = 1; d <= n; ++d)
      if (n % d == 0) want.push_back(d);
    EXPECT_EQ(divisors(n), want) << n;
  }
  EXPECT_TRUE(divisors(0).empty());
}

// Ordered triples with product n = prod p_i^k_i number prod C(k_i + 2, 2).
TEST(SweepExpand, FactorisationsOfKnownCountsWhenNothingElseRestricts) {
  ScenarioConfig c;
  c.model.num_layers = 1000;
  c.model.num_attention_heads = 2880;  // 2^6 * 3^2 * 5: divisible by every tp below
  c.cluster.gpus_per_node = 1 << 20;
  const std::vector<std::pair<int, std::size_t>> cases = {
      {1, 1}, {2, 3}, {8, 10}, {12, 18}, {16, 15}, {64, 28}, {36, 36}, {30, 27}};
  for (auto [n, count] : cases) {
    c.cluster.num_gpus = n;
    const auto layouts = auto_parallel_layouts(c);
    EXPECT_EQ(layouts.size(), count) << n;
    std::set<std::tuple<int, int, int>> distinct;
    for (const auto& l : layouts) {
      EXPECT_EQ(l.dp * l.pp * l.tp, n);
      distinct.emplace(l.dp, l.pp, l.tp);
    }
    EXPECT_EQ(distinct.size(), layouts.size()) << n;
  }
}

TEST(SweepExpand, FactorisationsRespectHeadsNodeAndLayersLikeABruteForce) {
  for (int n : {8, 12, 24, 48}) {
    for (int heads : {12, 32, 40}) {
      for (int per_node : {4, 8}) {
        for (int layers : {2, 6, 40}) {
          ScenarioConfig c;
          c.cluster.num_gpus = n;
          c.cluster.gpus_per_node = per_node;
          c.model.num_attention_heads = heads;
          c.model.num_layers = layers;
          std::set<std::tuple<int, int, int>> want, got;
          for (int d = 1; d <= n; ++d)
            for (int p = 1; p <= n; ++p)
              for (int t = 1; t <= n; ++t)
                if (d * p * t == n && heads % t == 0 && t <= per_node && p <= layers) want.emplace(d, p, t);
          for (const auto& l : auto_parallel_layouts(c)) got.emplace(l.dp, l.pp, l.tp);
          EXPECT_EQ(got, want) << n << " " << heads << " " << per_node << " " << layers;
        }
      }
    }
  }
}

TEST(SweepExpand, CartesianProductInFileOrderFirstAxisSlowest) {
  const Scenario sc = postmortem_with(R"(
sweep:
  training.micro_batch_size: [1, 2, 4]
  precision.compute: [fp16, bf16]
  communication.overlap_grad_reduce: [false, true]
)");
  const auto points = expand_sweep(sc);
  ASSERT_EQ(points.size(), 3u * 2u * 2u);
  const std::vector<std::string> keys = {"training.micro_batch_size", "precision.compute",
                                         "communication.overlap_grad_reduce"};
  EXPECT_EQ(sweep_keys(sc), keys);
  std::set<std::string> seen;
  for (std::size_t i = 0; i < points.size(); ++i) {
    const auto& p = points[i];
    EXPECT_EQ(p.index, i);
    ASSERT_EQ(p.values.size(), 3u);
    // Values agree with the configuration they describe.
    EXPECT_EQ(std::get<std::int64_t>(p.values[0].second), p.config.training.micro_batch_size);
    EXPECT_EQ(std::get<std::string>(p.values[1].second), std::string(dtype_name(p.config.precision.compute)));
    EXPECT_EQ(std::get<bool>(p.values[2].second), p.config.communication.overlap_grad_reduce);
    const std::int64_t mbs[] = {1, 2, 4};
    EXPECT_EQ(p.config.training.micro_batch_size, mbs[i / 4]);
    EXPECT_EQ(p.config.communication.overlap_grad_reduce, i % 2 == 1);
    seen.insert(fmt::format("{}", fmt::join(std::vector<std::string>{format_field_value(p.values[0].second),
                                                                     format_field_value(p.values[1].second),
                                                                     format_field_value(p.values[2].second)},
                                           ",")));
    // Keys that are not swept keep the file's values.
    EXPECT_EQ(p.config.parallelism.pipeline_parallel_size, 4);
  }
  EXPECT_EQ(seen.size(), points.size());
}

// Configurations that end up identical in every field (as format_field_value writes them,
// which keeps six significant digits) are kept once, the first in expansion order, and the
// others renumbered; a configuration whose value was refused keeps its own row per error.
TEST(SweepExpand, IdenticalConfigurationsAreKeptOnce) {
  const Scenario sc = postmortem_with(R"(
sweep:
  training.micro_batch_size: [1, 2, 1]
  cluster.compute_efficiency: [0.5, 0.50000001, 0.6]
  communication.overlap_grad_reduce: [false, true]
)");
  const auto points = expand_sweep(sc);
  ASSERT_EQ(points.size(), 2u * 2u * 2u);  // micro-batch 1 twice, 0.5 and 0.50000001 read the same
  for (std::size_t i = 0; i < points.size(); ++i) {
    EXPECT_EQ(points[i].index, i);
    EXPECT_EQ(points[i].config.training.micro_batch_size, i < 4 ? 1 : 2) << i;
    EXPECT_EQ(points[i].config.cluster.compute_efficiency, i % 4 < 2 ? 0.5 : 0.6) << i;  // the first kept
    EXPECT_EQ(points[i].config.communication.overlap_grad_reduce, i % 2 == 1) << i;
  }
  // An adjustment that makes configurations identical (plan's precision fixes do) drops them too.
  const auto adjusted = expand_sweep(sc, [](ScenarioConfig& c) { c.communication.overlap_grad_reduce = true; });
  ASSERT_EQ(adjusted.size(), 2u * 2u);
  for (std::size_t i = 0; i < adjusted.size(); ++i) {
    EXPECT_EQ(adjusted[i].index, i);
    EXPECT_TRUE(std::get<bool>(adjusted[i].values[2].second));
  }
}

TEST(SweepExpand, GeneratedAxesFollowTheGlobalBatch) {
  const Scenario sc = postmortem_with(R"(
sweep:
  parallelism: auto
  training.micro_batch_size: auto
)");
  const auto points = expand_sweep(sc);
  // Independent count: for every layout, the divisors of global / dp (when dp divides it).
  std::size_t want = 0;
  const int gb = sc.config.training.global_batch_size;
  for (int d = 1; d <= 8; ++d)
    for (int p = 1; p <= 8; ++p)
      for (int t = 1; t <= 8; ++t) {
        if (d * p * t != 8 || 32 % t != 0) continue;
        if (gb % d != 0) {
          ++want;
          continue;
        }
        for (int b = 1; b <= gb / d; ++b) want += (gb / d) % b == 0;
      }
  EXPECT_EQ(points.size(), want);
  for (const auto& pt : points) {
    const auto& c = pt.config;
    EXPECT_EQ(c.parallelism.data_parallel_size * c.parallelism.pipeline_parallel_size *
                  c.parallelism.tensor_parallel_size,
              8);
    EXPECT_EQ(gb % (c.training.micro_batch_size * c.parallelism.data_parallel_size), 0);
    ASSERT_EQ(pt.values.size(), 4u);
    EXPECT_EQ(pt.values[0].first, "parallelism.data_parallel_size");
    EXPECT_EQ(pt.values[3].first, "training.micro_batch_size");
  }
}

// `virtual_pipeline_stages: auto` under interleaving: exactly the v >= 2 that cut each stage's
// layers into equal chunks (brute force over every v up to the layers); one row (the file's v)
// for the other schedules. 30 layers: 1, 2, 3, 5 and 6 stages divide them, 4 does not.
TEST(SweepExpand, AutoVirtualStagesCutEveryStageIntoEqualChunks) {
  const Scenario sc = postmortem_with(R"(
sweep:
  parallelism.pipeline_parallel_size: [2, 3, 5, 6]
  parallelism.schedule: [1f1b, interleaved-1f1b]
  parallelism.virtual_pipeline_stages: auto
)");
  ASSERT_EQ(sc.sweep.back().kind, SweepAxisKind::auto_virtual_stages);
  Scenario thirty = sc;
  thirty.config.model.num_layers = 30;
  thirty.config.cluster.num_gpus = 30;  // every stage count divides it
  std::map<std::pair<int, ScheduleKind>, std::set<int>> got;
  for (const auto& pt : expand_sweep(thirty)) {
    const auto& p = pt.config.parallelism;
    got[{p.pipeline_parallel_size, p.schedule}].insert(p.virtual_pipeline_stages);
    ASSERT_EQ(pt.values.back().first, "parallelism.virtual_pipeline_stages");
  }
  for (int stages : {2, 3, 5, 6}) {
    std::set<int> want;
    for (int v = 2; v <= 30; ++v)
      if (30 % (stages * v) == 0) want.insert(v);
    EXPECT_EQ((got[{stages, ScheduleKind::interleaved_1f1b}]), want) << stages << " stages";
    EXPECT_EQ((got[{stages, ScheduleKind::one_f_one_b}]), std::set<int>{1}) << stages << " stages";
  }
}

// The values behind it: Megatron-Bridge's Llama 3 70B recipe interleaves 80 layers on 8 stages
// 5 deep, which {1, 2, 4, 8} never tried; layers the stages do not share equally are cut as the
// stages' rounded-up share (126 on 16: Llama 3 405B's split, 8 layers on the middle stages).
TEST(SweepExpand, InterleavingDepthsAreTheDivisorsOfAStagesLayers) {
  ScenarioConfig c = load_scenario_text(postmortem_text(), "p.yaml").config;
  c.parallelism.schedule = ScheduleKind::interleaved_1f1b;
  c.model.num_layers = 80;
  c.parallelism.pipeline_parallel_size = 8;
  EXPECT_EQ(interleaving_depths(c), (std::vector<std::int64_t>{2, 5, 10}));
  c.model.num_layers = 126;
  c.parallelism.pipeline_parallel_size = 16;
  EXPECT_EQ(interleaving_depths(c), (std::vector<std::int64_t>{2, 4, 8}));
  c.parallelism.pipeline_parallel_size = 126;  // a layer a stage: nothing to interleave, the file's own
  c.parallelism.virtual_pipeline_stages = 3;
  EXPECT_EQ(interleaving_depths(c), (std::vector<std::int64_t>{3}));
  c.parallelism.pipeline_parallel_size = 16;
  c.parallelism.schedule = ScheduleKind::zb_h1;
  EXPECT_EQ(interleaving_depths(c), (std::vector<std::int64_t>{3}));
}

TEST(SweepExpand, ASweptGpuKeepsTheFilesOverrides) {
  const Scenario sc = load_scenario_text(R"(
model: {preset: gpt3-1.3b}
cluster: {gpu: a100-40gb, num_gpus: 8, memory_gib: 30}
sweep:
  cluster.gpu: [a100-80gb, h100-80gb]
)");
  const auto points = expand_sweep(sc);
  ASSERT_EQ(points.size(), 2u);
  for (const auto& p : points) {
    EXPECT_EQ(p.config.cluster.memory_gib, 30);  // the file's override, not the preset's 80
    EXPECT_EQ(p.config.cluster.num_gpus, 8);
  }
  EXPECT_EQ(points[1].config.cluster.peak_tflops.at(DType::fp8) > 0, true);  // h100 has fp8
}

TEST(SweepExpand, ScenarioWithoutAxesIsItsOwnConfiguration) {
  const Scenario sc = postmortem_with("");
  ASSERT_TRUE(sc.sweep.empty());
  const auto points = expand_sweep(sc);
  ASSERT_EQ(points.size(), 1u);
  EXPECT_TRUE(points[0].values.empty());
}

// ---- loader ---------------------------------------------------------------------------------

TEST(SweepLoad, GeneratedAxesAndConstraintsParse) {
  const Scenario sc = postmortem_with(R"(
sweep:
  parallelism: auto
  training.micro_batch_size: auto
  parallelism.virtual_pipeline_stages: [1, 2]
constraints:
  max_memory_fraction: 0.9
  min_global_batch_size: 8
  max_pipeline_parallel_size: 4
  min_memory_headroom_gib: 1.5
)");
  ASSERT_EQ(sc.sweep.size(), 3u);
  EXPECT_EQ(sc.sweep[0].kind, SweepAxisKind::auto_parallelism);
  EXPECT_EQ(sc.sweep[1].kind, SweepAxisKind::auto_micro_batch_size);
  EXPECT_EQ(sc.sweep[2].kind, SweepAxisKind::values);
  EXPECT_EQ(postmortem_with("sweep:\n  parallelism.virtual_pipeline_stages: auto\n").sweep.at(0).kind,
            SweepAxisKind::auto_virtual_stages);
  EXPECT_DOUBLE_EQ(sc.constraints.max_memory_fraction, 0.9);
  EXPECT_EQ(sc.constraints.min_global_batch_size, 8);
  EXPECT_EQ(sc.constraints.max_pipeline_parallel_size, 4);
  EXPECT_EQ(sc.constraints.min_memory_headroom_gib, 1.5);
  EXPECT_FALSE(sc.constraints.max_tensor_parallel_size.has_value());
}

TEST(SweepLoad, BadGeneratedAxesAndConstraintsAreLocatedErrors) {
  const auto ds = load_errors(R"(training: {global_batch_size: 16}
sweep:
  parallelism: [1, 2]
  model.num_layers: auto
constraints:
  max_memory_fractoin: 0.9
  max_pipeline_parallel_size: 0
  min_global_batch_size: many
)");
  ASSERT_EQ(ds.size(), 5u);
  EXPECT_EQ(ds[0].key_path, "sweep.parallelism");
  EXPECT_NE(ds[0].message.find("expected auto"), std::string::npos) << ds[0].message;
  EXPECT_EQ(ds[0].where.line, 3);
  EXPECT_EQ(ds[1].key_path, "sweep.model.num_layers");
  EXPECT_NE(ds[1].message.find("auto is generated only for"), std::string::npos);
  EXPECT_EQ(ds[2].key_path, "constraints.max_memory_fractoin");
  EXPECT_EQ(ds[2].message, "unknown key; did you mean \"max_memory_fraction\"?");
  EXPECT_EQ(ds[3].key_path, "constraints.max_pipeline_parallel_size");
  EXPECT_NE(ds[3].message.find("must be between 1 and 4096, got 0"), std::string::npos) << ds[3].message;
  EXPECT_EQ(ds[4].key_path, "constraints.min_global_batch_size");
  EXPECT_EQ(ds[4].where.line, 8);
}

TEST(SweepLoad, AutoConflictsAndMissingGlobalBatchAreErrors) {
  auto ds = load_errors(R"(sweep:
  parallelism: auto
  parallelism.pipeline_parallel_size: [1, 2]
)");
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0].key_path, "sweep.parallelism.pipeline_parallel_size");
  EXPECT_NE(ds[0].message.find("parallelism: auto (line 2) already generates"), std::string::npos);
  ds = load_errors("sweep:\n  training.micro_batch_size: auto\n");
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_NE(ds[0].message.find("training.global_batch_size is not set"), std::string::npos);
  // Misspelt top-level section: the hint names it.
  ds = load_errors("constraint:\n  max_memory_fraction: 0.5\n");
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_NE(ds[0].message.find("did you mean \"constraints\"?"), std::string::npos) << ds[0].message;
}

TEST(SweepLoad, EveryConstraintKeyIsDocumented) {
  const std::string doc = slurp(fs::path(TRAINSIM_SOURCE_DIR) / "docs" / "sweep.md");
  ASSERT_FALSE(doc.empty());
  for (const auto& c : constraint_fields()) EXPECT_NE(doc.find("`" + c.key + "`"), std::string::npos) << c.key;
}

// ---- evaluation -------------------------------------------------------------------------------

SweepRow evaluate(const ScenarioConfig& c, const SweepConstraints& k = {}) {
  Predictor predictor;
  SweepConfiguration p;
  p.config = c;
  return evaluate_configuration(predictor, p, k);
}

TEST(SweepEvaluate, FeasibleRowMatchesASimulationOfTheSamePlan) {
  const Scenario sc = load_scenario_file(kDefault);
  const SweepRow row = evaluate(sc.config);
  ASSERT_EQ(row.status, SweepStatus::ok) << row.reason;
  const Prediction p = predict(Plan::from_config(sc.config));
  EXPECT_DOUBLE_EQ(row.metrics.tokens_per_s, p.result.tokens_per_s);
  EXPECT_DOUBLE_EQ(row.metrics.step_time_s, p.result.step_time_s);
  double peak = 0;
  for (const auto& r : p.result.ranks) peak = std::max(peak, r.peak_memory_bytes);
  EXPECT_DOUBLE_EQ(row.metrics.peak_memory_bytes, peak);
  EXPECT_DOUBLE_EQ(row.metrics.headroom_bytes(), gib_to_bytes(sc.config.cluster.memory_gib) - peak);
  EXPECT_EQ(row.num_microbatches, 4);
}

TEST(SweepEvaluate, OutOfMemoryNamesTheRankAndTheExcess) {
  ScenarioConfig c = load_scenario_file(kDefault).config;
  c.cluster.memory_gib = 20;
  const SweepRow row = evaluate(c);
  ASSERT_EQ(row.status, SweepStatus::out_of_memory);
  ASSERT_TRUE(row.simulated);
  const double over = bytes_to_gib(row.metrics.peak_memory_bytes) - 20;
  ASSERT_GT(over, 0);
  EXPECT_NE(row.reason.find(fmt::format("out of memory on rank {} ", row.metrics.peak_memory_rank)), std::string::npos)
      << row.reason;
  EXPECT_NE(row.reason.find(fmt::format("by {:.2f} GiB", over)), std::string::npos) << row.reason;
  EXPECT_NE(row.reason.find(fmt::format("needs {:.2f} of 20.00 GiB", bytes_to_gib(row.metrics.peak_memory_bytes))),
            std::string::npos)
      << row.reason;
}

// A file that does not write data_parallel_size leaves it to each configuration: num_gpus over
// its swept pipeline and tensor sizes (as Megatron-LM derives it). One that writes it keeps it,
// and a configuration whose product misses num_gpus is invalid with the numbers.
TEST(SweepEvaluate, AnUnwrittenDataParallelSizeFollowsEachConfiguration) {
  const std::string base = R"(
model: {preset: gpt3-13b}
cluster: {gpu: a100-80gb, num_gpus: 64}
training: {global_batch_size: 512}
sweep:
  parallelism.tensor_parallel_size: [1, 2, 8]
  parallelism.pipeline_parallel_size: [1, 4]
)";
  const auto points = expand_sweep(load_scenario_text(base));
  ASSERT_EQ(points.size(), 6u);
  for (const auto& p : points) {
    const ParallelismConfig& par = p.config.parallelism;
    EXPECT_EQ(par.data_parallel_size, 64 / (par.tensor_parallel_size * par.pipeline_parallel_size));
    EXPECT_NE(evaluate(p.config).status, SweepStatus::invalid) << evaluate(p.config).reason;
    // It moves with the swept sizes, so the tables show it, first.
    ASSERT_EQ(p.values.size(), 3u);
    EXPECT_EQ(p.values.front().first, "parallelism.data_parallel_size");
    EXPECT_EQ(format_field_value(p.values.front().second), std::to_string(par.data_parallel_size));
  }
  // Swept GPU counts too; where pipeline x tensor does not divide them (8 x 4 on 16), no data
  // size fits: invalid, saying why.
  const auto gpus = expand_sweep(load_scenario_text(base + "  cluster.num_gpus: [16, 32]\n"));
  ASSERT_EQ(gpus.size(), 12u);
  for (const auto& p : gpus) {
    const ParallelismConfig& par = p.config.parallelism;
    const int model_parallel = par.tensor_parallel_size * par.pipeline_parallel_size;
    if (p.config.cluster.num_gpus % model_parallel == 0) {
      EXPECT_EQ(par.data_parallel_size * model_parallel, p.config.cluster.num_gpus);
      continue;
    }
    EXPECT_EQ(par.data_parallel_size, 1);
    const SweepRow row = evaluate(p.config);
    EXPECT_EQ(row.status, SweepStatus::invalid);
    EXPECT_NE(row.reason.find("num_gpus is not a multiple of pipeline x tensor = 32"), std::string::npos) << row.reason;
  }
  // Written: kept, and the products that miss 64 are invalid, saying so.
  const auto written = expand_sweep(load_scenario_text(base + "parallelism: {data_parallel_size: 8}\n"));
  ASSERT_EQ(written.size(), 6u);
  int invalid = 0;
  for (const auto& p : written) {
    EXPECT_EQ(p.config.parallelism.data_parallel_size, 8);
    EXPECT_EQ(p.values.size(), 2u);  // as written: not a column
    const SweepRow row = evaluate(p.config);
    if (row.status != SweepStatus::invalid) continue;
    ++invalid;
    EXPECT_NE(row.reason.find("!= num_gpus(64)"), std::string::npos) << row.reason;
  }
  EXPECT_EQ(invalid, 4);  // tp 2 x pp 4 and tp 8 x pp 1 make 8 x 8 = 64
  // A swept compute format carries its own loss scaling where the file writes none.
  const auto formats = expand_sweep(load_scenario_text(base + "  precision.compute: [fp16, bf16]\n"));
  ASSERT_EQ(formats.size(), 12u);
  for (const auto& p : formats)
    EXPECT_EQ(p.config.precision.loss_scaling.mode,
              p.config.precision.compute == DType::fp16 ? LossScalingMode::dynamic : LossScalingMode::none);
}

TEST(SweepEvaluate, InvalidStatesTheInvariantWithItsNumbers) {
  ScenarioConfig c = load_scenario_file(kDefault).config;
  c.parallelism.data_parallel_size = 8;
  c.parallelism.pipeline_parallel_size = 1;
  c.training.micro_batch_size = 4;  // 4 * 8 = 32 does not divide 16
  const SweepRow row = evaluate(c);
  ASSERT_EQ(row.status, SweepStatus::invalid);
  EXPECT_FALSE(row.simulated);
  EXPECT_NE(row.reason.find("global_batch_size(16) is not divisible by micro_batch_size(4) * data_parallel_size(8) = 32"),
            std::string::npos)
      << row.reason;
}

TEST(SweepEvaluate, UnsupportedPrecisionNamesTheFormatAndTheGpu) {
  ScenarioConfig c = load_scenario_file(kDefault).config;
  find_field("cluster.gpu")->set(c, FieldValue{std::string("v100-32gb")});
  c.precision.compute = DType::bf16;
  const SweepRow row = evaluate(c);
  ASSERT_EQ(row.status, SweepStatus::unsupported_precision);
  EXPECT_NE(row.reason.find("bf16 is not supported by GPU v100-32gb (cluster.peak_tflops.bf16 is 0)"), std::string::npos)
      << row.reason;
}

TEST(SweepEvaluate, ConstraintsStateTheLimitAndTheValue) {
  const ScenarioConfig c = load_scenario_file(kDefault).config;
  const SweepRow free_row = evaluate(c);
  ASSERT_EQ(free_row.status, SweepStatus::ok);
  const double peak_gib = bytes_to_gib(free_row.metrics.peak_memory_bytes);

  SweepConstraints k;
  k.max_pipeline_parallel_size = 2;
  k.min_global_batch_size = 32;
  SweepRow row = evaluate(c, k);
  ASSERT_EQ(row.status, SweepStatus::constraint);
  EXPECT_TRUE(row.simulated);
  EXPECT_NE(row.reason.find("max_pipeline_parallel_size: pipeline_parallel_size(4) > 2"), std::string::npos) << row.reason;
  EXPECT_NE(row.reason.find("min_global_batch_size: global_batch_size(16) < 32"), std::string::npos) << row.reason;

  // A fraction just under the peak's share of the GPU rules it out; just over, it fits.
  const double share = peak_gib / c.cluster.memory_gib;
  SweepConstraints tight;
  tight.max_memory_fraction = share - 0.01;
  row = evaluate(c, tight);
  ASSERT_EQ(row.status, SweepStatus::constraint);
  EXPECT_NE(row.reason.find(fmt::format("max_memory_fraction: peak {:.2f} GiB", peak_gib)), std::string::npos)
      << row.reason;
  SweepConstraints loose;
  loose.max_memory_fraction = std::min(1.0, share + 0.01);
  EXPECT_EQ(evaluate(c, loose).status, SweepStatus::ok);
}

// ---- whole sweeps -----------------------------------------------------------------------------

const char* kSweep = R"(
sweep:
  parallelism: auto
  training.micro_batch_size: auto
  parallelism.schedule: [gpipe, 1f1b, zb-h1]
  training.activation_recompute: [none, full]
  communication.overlap_grad_reduce: [false, true]
constraints:
  max_tensor_parallel_size: 4
)";

TEST(SweepRun, IdenticalOutputWhateverTheThreadCount) {
  const Scenario sc = postmortem_with(kSweep);
  std::string first_json, first_csv, first_svg, first_table;
  for (unsigned threads : {1u, 2u, 5u, 16u}) {
    SweepOptions o;
    o.threads = threads;
    const SweepResult r = run_sweep(sc, o);
    const std::string json = sweep_to_json(r, sc).dump(2);
    std::ostringstream csv, svg;
    write_sweep_csv(r, csv);
    write_sweep_svg(r, sc, svg);
    const std::string table = format_sweep_table(r, "t");
    if (threads == 1) {
      first_json = json;
      first_csv = csv.str();
      first_svg = svg.str();
      first_table = table;
      continue;
    }
    EXPECT_EQ(json, first_json) << threads;
    EXPECT_EQ(csv.str(), first_csv) << threads;
    EXPECT_EQ(svg.str(), first_svg) << threads;
    EXPECT_EQ(table, first_table) << threads;
  }
}

// A pipeline that splits its layers unevenly gets a layers column, the even ones say so; a sweep
// of even splits has none.
TEST(SweepRun, TheTableShowsAnUnevenLayerSplit) {
  const SweepResult r = run_sweep(postmortem_with("sweep:\n  model.num_layers: [30, 32]\n"), SweepOptions{});
  const std::string table = format_sweep_table(r, "t");
  ASSERT_EQ(r.ranking.size(), 2u) << table;
  EXPECT_NE(table.find(" layers "), std::string::npos) << table;
  EXPECT_NE(table.find(" 7 + 2 x 8 + 7 "), std::string::npos) << table;
  EXPECT_NE(table.find(" even "), std::string::npos) << table;
  const SweepResult even = run_sweep(postmortem_with("sweep:\n  model.num_layers: [28, 32]\n"), SweepOptions{});
  EXPECT_EQ(format_sweep_table(even, "t").find(" layers "), std::string::npos);
  // The JSON rows hold every chunk's layers, derived or even.
  const auto rows = sweep_to_json(r, postmortem_with("")).at("rows");
  std::set<std::vector<int>> splits;
  for (const auto& row : rows) splits.insert(row.at("layers_per_stage").get<std::vector<int>>());
  EXPECT_EQ(splits, (std::set<std::vector<int>>{{7, 8, 8, 7}, {8, 8, 8, 8}}));
  // So do the CSV's, in its last column.
  std::ostringstream csv;
  write_sweep_csv(r, csv);
  std::istringstream lines(csv.str());
  std::set<std::string> cells;
  for (std::string line; std::getline(lines, line);) cells.insert(line.substr(line.rfind(',') + 1));
  EXPECT_EQ(cells, (std::set<std::string>{"layers_per_stage", "7/8/8/7", "8/8/8/8"}));
}

// A sweep worker evaluates its rows a few at a time (evaluate_rows, simulated ones
// batched in the Predictor): the same rows, every field the reports write, as
// evaluate_configuration one by one, with invalid, out-of-memory and constrained rows among them.
TEST(SweepRun, RowsInBatchesEqualRowsOneByOne) {
  // Neighbours that differ only in prices (the efficiency, last) are stepped together.
  const Scenario sc = postmortem_with(R"(
sweep:
  parallelism.schedule: [gpipe, 1f1b, zb-h1]
  training.micro_batch_size: [1, 2, 3]
  communication.overlap_grad_reduce: [false, true]
  cluster.memory_gib: [12, 40]
  cluster.compute_efficiency: [0.5, 0.55, 0.6, 0.65, 0.7]
constraints:
  max_micro_batch_size: 1
)");
  SweepOptions o;
  o.threads = 1;
  const SweepResult batched = run_sweep(sc, o);
  SweepResult single;
  single.keys = sweep_keys(sc);
  Predictor predictor;
  for (const SweepConfiguration& p : expand_sweep(sc))
    single.rows.push_back(evaluate_configuration(predictor, p, sc.constraints));
  rank_rows(single);
  ASSERT_EQ(single.rows.size(), batched.rows.size());
  EXPECT_GT(batched.counts.ok, 0u);
  EXPECT_GT(batched.counts.invalid, 0u);
  EXPECT_GT(batched.counts.out_of_memory, 0u);
  EXPECT_GT(batched.counts.constraint, 0u);
  EXPECT_EQ(sweep_to_json(single, sc).dump(2), sweep_to_json(batched, sc).dump(2));
  std::ostringstream a, b;
  write_sweep_csv(single, a);
  write_sweep_csv(batched, b);
  EXPECT_EQ(a.str(), b.str());
  for (std::size_t i = 0; i < single.rows.size(); ++i) {
    EXPECT_EQ(single.rows[i].reason, batched.rows[i].reason) << i;
    EXPECT_EQ(single.rows[i].warnings, batched.rows[i].warnings) << i;
  }
}

TEST(SweepRun, CountsRankingAndOrderAreConsistent) {
  const Scenario sc = postmortem_with(kSweep);
  std::size_t progress_calls = 0, last_done = 0;
  SweepOptions o;
  o.threads = 3;
  o.progress = [&](const SweepProgress& p) {
    ++progress_calls;
    EXPECT_GE(p.done, last_done);
    last_done = p.done;
  };
  const SweepResult r = run_sweep(sc, o);
  EXPECT_GE(progress_calls, 1u);
  EXPECT_EQ(last_done, r.rows.size());
  const auto& c = r.counts;
  EXPECT_EQ(c.total, r.rows.size());
  EXPECT_EQ(c.ok + c.out_of_memory + c.invalid + c.unsupported_precision + c.constraint, c.total);
  EXPECT_GT(c.ok, 0u);
  EXPECT_GT(c.out_of_memory, 0u);
  EXPECT_GT(c.constraint, 0u);  // tp = 8 is ruled out
  EXPECT_EQ(r.ranking.size(), c.ok);
  for (std::size_t i = 0; i < r.rows.size(); ++i) EXPECT_EQ(r.rows[i].point.index, i);
  for (std::size_t i = 1; i < r.ranking.size(); ++i)
    EXPECT_GE(r.rows[r.ranking[i - 1]].metrics.tokens_per_s, r.rows[r.ranking[i]].metrics.tokens_per_s);
  // The best is the maximum over every feasible row.
  double best = 0;
  for (const auto& row : r.rows)
    if (row.feasible()) best = std::max(best, row.metrics.tokens_per_s);
  ASSERT_NE(r.best(), nullptr);
  EXPECT_EQ(r.best()->metrics.tokens_per_s, best);
  // Every row appears once in the report order.
  std::set<std::size_t> order(r.order.begin(), r.order.end());
  EXPECT_EQ(order.size(), r.rows.size());
  for (const auto& row : r.rows) {
    if (row.status == SweepStatus::constraint) {
      EXPECT_NE(row.reason.find("max_tensor_parallel_size: tensor_parallel_size(8) > 4"), std::string::npos)
          << row.reason;
    }
    if (row.feasible()) {
      EXPECT_TRUE(row.reason.empty());
      EXPECT_LE(row.metrics.peak_memory_bytes, row.metrics.memory_capacity_bytes);
    }
  }
}

// Brute force: a feasible row is on the front iff no feasible row dominates it.
std::vector<std::size_t> brute_front(const std::vector<SweepRow>& rows) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].feasible()) continue;
    bool dominated = false;
    for (std::size_t j = 0; j < rows.size() && !dominated; ++j) {
      if (j == i || !rows[j].feasible()) continue;
      const auto &a = rows[j].metrics, &b = rows[i].metrics;
      dominated = a.tokens_per_s >= b.tokens_per_s && a.peak_memory_bytes <= b.peak_memory_bytes &&
                  (a.tokens_per_s > b.tokens_per_s || a.peak_memory_bytes < b.peak_memory_bytes);
    }
    if (!dominated) out.push_back(i);
  }
  return out;
}

// setup_groups against its definition written plainly: rows grouped by the text of their
// setup values (cluster.*, model.*), groups in the order first met, each group's best the
// first of its rows in the ranking; setup keys swept outermost, innermost and in between.
TEST(SweepSetups, GroupsMatchTheirDefinition) {
  for (const char* axes : {R"(
sweep:
  cluster.gpu: [a100-80gb, h100-80gb]
  training.micro_batch_size: [1, 2]
  cluster.compute_efficiency: [0.5, 0.6, 0.7]
)",
                           R"(
sweep:
  training.activation_recompute: [none, full]
  cluster.memory_gib: [20, 40, 80]
  communication.overlap_grad_reduce: [false, true]
  cluster.inter_node.bandwidth_gbps: [12.5, 25]
)",
                           R"(
sweep:
  training.micro_batch_size: [1, 2]
)"}) {
    SCOPED_TRACE(axes);
    const Scenario sc = postmortem_with(axes);
    const SweepResult r = run_sweep(sc);
    std::vector<std::string> names;
    std::vector<SetupGroup> want;
    auto text = [&](const SweepRow& row) {
      std::string t;
      for (std::size_t k = 0; k < r.keys.size(); ++k)
        if (is_setup_key(r.keys[k])) t += format_field_value(row.point.values[k].second) + "|";
      return t;
    };
    for (std::size_t i = 0; i < r.rows.size(); ++i) {
      const std::string t = text(r.rows[i]);
      auto it = std::find(names.begin(), names.end(), t);
      if (it == names.end()) {
        names.push_back(t);
        SetupGroup g;
        for (std::size_t k = 0; k < r.keys.size(); ++k)
          if (is_setup_key(r.keys[k])) g.values.push_back(r.rows[i].point.values[k]);
        want.push_back(g);
        it = names.end() - 1;
      }
      want[static_cast<std::size_t>(it - names.begin())].rows.push_back(i);
    }
    for (std::size_t i : r.ranking) {
      auto& g = want[static_cast<std::size_t>(std::find(names.begin(), names.end(), text(r.rows[i])) - names.begin())];
      if (!g.best) g.best = i;
    }
    const std::vector<SetupGroup> got = setup_groups(r);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t g = 0; g < got.size(); ++g) {
      EXPECT_EQ(got[g].values, want[g].values) << g;
      EXPECT_EQ(got[g].rows, want[g].rows) << g;
      EXPECT_EQ(got[g].best, want[g].best) << g;
    }
  }
}

TEST(SweepPareto, MatchesBruteForceOnARealSweep) {
  const SweepResult r = run_sweep(postmortem_with(kSweep));
  std::vector<std::size_t> got = r.pareto, want = brute_front(r.rows);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, want);
  EXPECT_FALSE(got.empty());
  // The best by tokens/s is always on the front.
  EXPECT_NE(std::find(got.begin(), got.end(), r.ranking.front()), got.end());
}

TEST(SweepPareto, MatchesBruteForceWithTiesAndInfeasibleRows) {
  // Values on a small grid so ties in both coordinates are common.
  std::uint64_t state = 12345;
  auto next = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % 6);
  };
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<SweepRow> rows(static_cast<std::size_t>(1 + trial % 17));
    for (auto& row : rows) {
      row.status = next() == 0 ? SweepStatus::out_of_memory : SweepStatus::ok;
      row.simulated = true;
      row.metrics.tokens_per_s = 1000.0 * next();
      row.metrics.peak_memory_bytes = gib_to_bytes(next());
    }
    std::vector<std::size_t> got = pareto_front(rows), want = brute_front(rows);
    for (std::size_t i = 1; i < got.size(); ++i)
      EXPECT_LE(rows[got[i - 1]].metrics.peak_memory_bytes, rows[got[i]].metrics.peak_memory_bytes);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want) << "trial " << trial;
  }
}

// ---- reports ----------------------------------------------------------------------------------

// The CSV's value columns are each value's text (format_field_value), whatever the writer
// keeps of the cells it wrote: a column of more distinct values than it keeps, values equal
// to six digits, and 0 beside -0.
TEST(SweepReport, CsvValueColumnsAreTheValuesText) {
  std::string efficiencies;
  for (int k = 0; k < 40; ++k) efficiencies += fmt::format("{}{}", k ? ", " : "", 0.3 + 0.01 * k);
  const Scenario sc = postmortem_with(fmt::format(R"(
sweep:
  cluster.compute_efficiency: [{}, 0.5000001]
  training.micro_batch_size: [1, 2]
  cluster.price_per_gpu_hour: [0.0, -0.0, 2.5]
)",
                                                  efficiencies));
  const SweepResult r = run_sweep(sc);
  std::ostringstream csv;
  write_sweep_csv(r, csv);
  std::istringstream in(csv.str());
  std::string line;
  std::getline(in, line);  // the head
  std::size_t lines = 0;
  for (std::size_t at = 0; std::getline(in, line); ++at) {
    std::vector<std::string> cells;
    std::stringstream fields(line);
    for (std::string c; cells.size() < 2 + r.keys.size() && std::getline(fields, c, ',');) cells.push_back(c);
    const SweepRow& row = r.rows[r.order[at]];
    ASSERT_EQ(cells[1], std::to_string(r.order[at]));
    for (std::size_t k = 0; k < r.keys.size(); ++k)
      ASSERT_EQ(cells[2 + k], format_field_value(row.point.values[k].second)) << "row " << r.order[at] << " " << r.keys[k];
    ++lines;
  }
  EXPECT_EQ(lines, r.rows.size());
  EXPECT_GT(r.rows.size(), 200u);
}

// A CSV cell with commas, quotes or line breaks is quoted, its quotes doubled (RFC 4180).
TEST(SweepReport, CsvQuotesCellsThatNeedIt) {
  SweepResult r;
  for (const std::string& reason : {std::string("plain"), std::string("a, b"), std::string("say \"x\", then \"\"y\""),
                                   std::string("\"at both ends\""), std::string("two\nlines")}) {
    SweepRow& row = r.rows.emplace_back();
    row.point.index = r.rows.size() - 1;
    row.status = SweepStatus::invalid;
    row.reason = reason;
  }
  rank_rows(r);
  std::ostringstream csv;
  write_sweep_csv(r, csv);
  const std::string text = csv.str();
  for (const char* cell : {",plain,", ",\"a, b\",", ",\"say \"\"x\"\", then \"\"\"\"y\"\"\",",
                           ",\"\"\"at both ends\"\"\",", ",\"two\nlines\","})
    EXPECT_NE(text.find(cell), std::string::npos) << cell << " in\n" << text;
}

TEST(SweepReport, JsonCsvAndSvgHoldEveryConfiguration) {
  const Scenario sc = postmortem_with(kSweep);
  const SweepResult r = run_sweep(sc);
  const auto j = nlohmann::json::parse(sweep_to_json(r, sc).dump());
  ASSERT_EQ(j["rows"].size(), r.rows.size());
  EXPECT_EQ(j["counts"]["total"], r.rows.size());
  std::size_t ranked = 0;
  for (const auto& row : j["rows"]) {
    const std::string status = row["status"];
    EXPECT_TRUE(status == "ok" || status == "out_of_memory" || status == "invalid" ||
                status == "unsupported_precision" || status == "constraint");
    EXPECT_EQ(row["config"].size(), sweep_keys(sc).size());
    if (status == "ok") {
      ++ranked;
      EXPECT_EQ(row["rank"], ranked);  // ranked rows come first, in rank order
      EXPECT_NEAR(row["headroom_gib"].get<double>(),
                  row["memory_capacity_gib"].get<double>() - row["peak_memory_gib"].get<double>(), 1e-3);
    } else {
      EXPECT_TRUE(row["rank"].is_null());
      EXPECT_FALSE(row["reason"].get<std::string>().empty());
    }
    if (status == "invalid") {
      EXPECT_TRUE(row["tokens_per_s"].is_null());
    }
  }
  EXPECT_EQ(ranked, r.counts.ok);

  std::ostringstream csv;
  write_sweep_csv(r, csv);
  std::size_t lines = 0;
  for (char ch : csv.str()) lines += ch == '\n';
  EXPECT_EQ(lines, r.rows.size() + 1);

  std::ostringstream svg;
  write_sweep_svg(r, sc, svg);
  const std::string s = svg.str();
  EXPECT_EQ(s.rfind("<svg", 0), 0u);
  EXPECT_NE(s.find("Pareto front"), std::string::npos);
  EXPECT_NE(s.find("out of memory"), std::string::npos);
  std::size_t circles = 0;
  for (std::size_t pos = 0; (pos = s.find("<circle", pos)) != std::string::npos; ++pos) ++circles;
  // Feasible points, front rings (the best point, always on the front, gets its star instead
  // of a ring), constraint points and the legend's three circles.
  ASSERT_FALSE(r.ranking.empty());
  EXPECT_EQ(circles, r.counts.ok + r.pareto.size() - 1 + r.counts.constraint + 3);
}

// ---- the command ------------------------------------------------------------------------------

using trainsim::testing::CommandResult;
using trainsim::testing::run;
using trainsim::testing::temp_dir;

fs::path write_sweep_file() {
  const fs::path f = temp_dir() / "sweep.yaml";
  std::ofstream(f) << postmortem_text() << kSweep;
  return f;
}

TEST(SweepCli, BadFilesExitTwoWithNothingOnStdout) {
  CommandResult r = run("sweep /nonexistent/x.yaml");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  const fs::path f = temp_dir() / "bad.yaml";
  std::ofstream(f) << "sweep:\n  parallelism: all\n";
  r = run("sweep " + f.string());
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find(f.string() + ":2:16: error: sweep.parallelism: expected auto"), std::string::npos) << r.err;
  r = run("plan " + f.string());
  EXPECT_EQ(r.status, 2);
}

TEST(SweepCli, JsonIsByteIdenticalAcrossThreadCountsAndFilesAreWritten) {
  const fs::path f = write_sweep_file(), d = temp_dir();
  const CommandResult a = run("sweep --json --threads 1 " + f.string());
  const CommandResult b = run("sweep --json --threads 4 " + f.string() + " --csv " + (d / "s.csv").string() +
                              " --svg " + (d / "s.svg").string());
  ASSERT_EQ(a.status, 0) << a.err;
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
  const auto j = nlohmann::json::parse(a.out);
  EXPECT_EQ(j["rows"].size(), j["counts"]["total"].get<std::size_t>());
  EXPECT_TRUE(fs::exists(d / "s.csv"));
  EXPECT_EQ(slurp(d / "s.svg").rfind("<svg", 0), 0u);
  // stderr is not a terminal here: no progress bar, only the notes about written files.
  EXPECT_EQ(b.err.find('\r'), std::string::npos);
  const CommandResult t = run("sweep " + f.string() + " --top 3");
  ASSERT_EQ(t.status, 0);
  EXPECT_NE(t.out.find("best 3 of"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("headroom GiB"), std::string::npos);
}

}  // namespace
}  // namespace trainsim

namespace trainsim {
namespace {

// The sweep picture: the best point is drawn last, as a star wider than a Pareto ring (the
// ring of the best point is not drawn), and the HTML page carries one hover record per drawn
// point, keyed like the points' data-i.
TEST(SweepPicture, BestPointIsVisibleAndTheHtmlHovers) {
  const Scenario sc = load_scenario_text(
      "model: {preset: gpt3-1.3b}\ncluster: {gpu: a100-40gb, num_gpus: 8}\ntraining: {global_batch_size: 32}\n"
      "sweep:\n  parallelism: auto\n  training.activation_recompute: [none, selective, full]\n",
      "picture.yaml");
  const SweepResult r = run_sweep(sc);
  ASSERT_NE(r.best(), nullptr);
  std::ostringstream svg;
  write_sweep_svg(r, sc, svg);
  const std::string s = svg.str();
  const auto star = s.find("<path id=\"best\"");
  ASSERT_NE(star, std::string::npos);
  EXPECT_EQ(s.find("class=\"pt\"", s.find('>', star)), std::string::npos) << "no point is drawn over the best one";
  const std::string best_ring = fmt::format("data-i=\"{}\" cx=", r.best()->point.index);
  EXPECT_EQ(s.find(best_ring), s.rfind(best_ring)) << "only the feasible dot, no ring over the star";
  // The star reaches further from the point than a Pareto ring (6.5 px radius, 2 px stroke).
  std::smatch dot, d;
  ASSERT_TRUE(std::regex_search(s, dot, std::regex(best_ring + "\"([0-9.]+)\" cy=\"([0-9.]+)\"")));
  const double cx = std::stod(dot[1]), cy = std::stod(dot[2]);
  const std::string star_tag = s.substr(star, s.find('>', star) - star);
  ASSERT_TRUE(std::regex_search(star_tag, d, std::regex(" d=\"([^\"]+)\"")));
  const std::string path = d[1];
  double reach = 0;
  const std::regex pt("([0-9.]+),([0-9.]+)");
  for (std::sregex_iterator it(path.begin(), path.end(), pt), e; it != e; ++it)
    reach = std::max(reach, std::hypot(std::stod((*it)[1]) - cx, std::stod((*it)[2]) - cy));
  EXPECT_GT(reach, 6.5 + 1.0);

  std::ostringstream html;
  write_sweep_html(r, sc, html);
  const std::string h = html.str();
  EXPECT_EQ(h.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(h.find("<svg"), std::string::npos);
  EXPECT_NE(h.find("addEventListener('mousemove'"), std::string::npos);
  EXPECT_EQ(h.find("<title>", h.find("<svg")), std::string::npos) << "the hover box replaces the native tooltips";
  const auto start = h.find("const rows = ") + 13;
  const auto end = h.find(";\n", start);
  const auto rows = nlohmann::json::parse(h.substr(start, end - start));
  std::size_t simulated = 0;
  for (const auto& row : r.rows)
    if (row.simulated) {
      ++simulated;
      ASSERT_TRUE(rows.contains(std::to_string(row.point.index))) << row.point.index;
      EXPECT_EQ(rows[std::to_string(row.point.index)]["status"], std::string(sweep_status_name(row.status)));
    }
  EXPECT_EQ(rows.size(), simulated);
}

// Infeasible rows come nearest first, each with the limit that bound it.
TEST(SweepPicture, NearMissesComeFirstWithTheirBindingLimit) {
  const Scenario sc = load_scenario_text(
      "model: {preset: gpt3-6.7b}\ncluster: {gpu: a100-40gb, num_gpus: 8}\ntraining: {global_batch_size: 16}\n"
      "constraints: {max_memory_fraction: 0.8}\n"
      "sweep:\n  parallelism: auto\n  training.activation_recompute: [none, full]\n",
      "misses.yaml");
  const SweepResult r = run_sweep(sc);
  double prev = -1;
  for (std::size_t k = r.ranking.size(); k < r.order.size(); ++k) {
    const SweepRow& row = r.rows[r.order[k]];
    if (!row.simulated) break;
    EXPECT_GE(row.shortfall, prev);
    prev = row.shortfall;
    EXPECT_TRUE(row.binding == "memory" || row.binding == "max_memory_fraction") << row.binding;
    if (row.binding == "memory")
      EXPECT_NEAR(row.shortfall, row.metrics.peak_memory_bytes / row.metrics.memory_capacity_bytes - 1, 1e-12);
    else
      EXPECT_NEAR(row.shortfall, row.metrics.peak_memory_bytes / (0.8 * row.metrics.memory_capacity_bytes) - 1, 1e-12);
  }
  EXPECT_GT(prev, 0);
}

}  // namespace
}  // namespace trainsim
