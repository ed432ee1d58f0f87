// The scenario library (scenarios/*.yaml, listed in scenarios/README.md): every file is run
// the way its header comment says (`trainsim plan FILE` or `trainsim sweep FILE`) through the
// library API (sim/sweep/advice.h, sim/sweep/sweep.h), and its main figures are compared with
// the stored result in tests/golden/library/NAME.json: the chosen (best) configuration's swept
// keys exactly, its tokens/s, step time, bubble, communication and peak memory to a relative
// 1e-6, the number of configurations of each status exactly, the file's own configuration's
// figures, and the five best configurations. A scenario without a stored result fails.
// Regenerate after an intended cost-model change with
//   TRAINSIM_UPDATE_GOLDEN=1 build/tests/test_library --gtest_filter='Library.EveryScenarioMatchesItsStoredResult'
// and say why in the commit.
//
// Each scenario's point is also asserted as a property of the prediction (Library.* below), so
// a regenerated golden file cannot silently lose the answer the scenario exists to show.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/scenario.h"
#include "core/units.h"
#include "sim/simulator.h"
#include "sim/sweep/advice.h"
#include "sim/sweep/report.h"
#include "sim/sweep/sweep.h"

namespace trainsim {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

const fs::path kSource = TRAINSIM_SOURCE_DIR;

std::vector<fs::path> scenario_files() {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(kSource / "scenarios"))
    if (e.path().extension() == ".yaml") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The comment block at the top of the file (every line up to the first that is not a comment).
std::string header_comment(const std::string& text) {
  std::string out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] != '#') break;
    out += line + "\n";
  }
  return out;
}

enum class Mode { plan, sweep };

// What one library scenario's command computes.
struct LibraryRun {
  fs::path file;
  Mode mode = Mode::sweep;
  Scenario scenario;
  SweepRow base;  // the file's own configuration, as written
  std::optional<PlanResult> plan;
  SweepResult sweep;  // plan.sweep in plan mode
  const SweepRow* best() const {
    if (plan) return plan->chosen ? &sweep.rows[*plan->chosen] : nullptr;
    return sweep.best();
  }
};

LibraryRun run_scenario(const fs::path& file) {
  LibraryRun r;
  r.file = file;
  const std::string header = header_comment(read_text(file));
  const std::string rel = "scenarios/" + file.filename().string();
  if (header.find("trainsim plan " + rel) != std::string::npos)
    r.mode = Mode::plan;
  else if (header.find("trainsim sweep " + rel) != std::string::npos)
    r.mode = Mode::sweep;
  else
    throw std::runtime_error(file.string() + ": the header comment gives no `trainsim plan " + rel +
                             "` or `trainsim sweep " + rel + "` command");
  r.scenario = load_scenario_file(file.string());
  if (r.mode == Mode::plan) {
    r.plan = make_plan(r.scenario);
    r.base = r.plan->original;
    r.sweep = r.plan->sweep;
  } else {
    r.sweep = run_sweep(r.scenario);
    Predictor predictor;
    SweepConfiguration own;
    own.config = r.scenario.config;
    r.base = evaluate_configuration(predictor, own, r.scenario.constraints);
  }
  return r;
}

// Each scenario is run once per test program.
const LibraryRun& library(const std::string& name) {
  static std::map<std::string, std::unique_ptr<LibraryRun>> cache;
  auto& slot = cache[name];
  if (!slot) slot = std::make_unique<LibraryRun>(run_scenario(kSource / "scenarios" / (name + ".yaml")));
  return *slot;
}

json value_json(const FieldValue& v) {
  json j;
  std::visit([&](const auto& x) { j = x; }, v);
  return j;
}

json config_json(const SweepRow& row) {
  json j = json::object();
  for (const auto& [k, v] : row.point.values) j[k] = value_json(v);
  return j;
}

json row_figures(const SweepRow& row) {
  json j = {{"status", std::string(sweep_status_name(row.status))},
            {"num_microbatches", row.num_microbatches},
            {"global_batch_size", row.global_batch_size}};
  if (row.simulated) {
    const SweepMetrics& m = row.metrics;
    j["tokens_per_s"] = m.tokens_per_s;
    j["step_time_s"] = m.step_time_s;
    j["bubble_fraction"] = m.bubble_fraction;
    j["allreduce_time_s"] = m.allreduce_time_s;
    j["exposed_comm_time_s"] = m.exposed_comm_time_s;
    j["peak_memory_gib"] = bytes_to_gib(m.peak_memory_bytes);
  }
  return j;
}

json main_figures(const LibraryRun& r) {
  const SweepCounts& c = r.sweep.counts;
  json j = {{"name", r.scenario.config.name},
            {"command", r.mode == Mode::plan ? "plan" : "sweep"},
            {"counts",
             {{"total", c.total},
              {"ok", c.ok},
              {"out_of_memory", c.out_of_memory},
              {"invalid", c.invalid},
              {"unsupported_precision", c.unsupported_precision},
              {"constraint", c.constraint}}},
            {"base", row_figures(r.base)}};
  if (const SweepRow* b = r.best()) {
    json best = row_figures(*b);
    best["config"] = config_json(*b);
    j["best"] = best;
  } else {
    j["best"] = nullptr;
  }
  json top = json::array();
  for (std::size_t i = 0; i < r.sweep.ranking.size() && i < 5; ++i) {
    const SweepRow& row = r.sweep.rows[r.sweep.ranking[i]];
    top.push_back({{"config", config_json(row)},
                   {"tokens_per_s", row.metrics.tokens_per_s},
                   {"peak_memory_gib", bytes_to_gib(row.metrics.peak_memory_bytes)}});
  }
  j["top"] = top;
  if (r.plan) {
    json issues = json::array();
    for (const auto& i : r.plan->precision) issues.push_back(i.id);
    j["precision_issues"] = issues;
    // Every key the plan changes, with the chosen value, in the order the plan explains them.
    json changes = json::array();
    if (r.plan->chosen)
      for (const auto& step : r.plan->steps)
        for (const auto& k : step.keys)
          changes.push_back({{"key", k}, {"value", value_json(find_field(k)->get(r.best()->point.config))}});
    j["changes"] = changes;
  }
  return j;
}

// Exact for configuration choices, counts and statuses; relative 1e-6 for figures.
void expect_matches(const json& got, const json& want, const std::string& path) {
  if (want.is_number_float()) {
    ASSERT_TRUE(got.is_number()) << path << ": got " << got.dump();
    const double w = want.get<double>(), g = got.get<double>();
    EXPECT_NEAR(g, w, 1e-6 * std::max(1.0, std::fabs(w))) << path;
  } else if (want.is_object()) {
    ASSERT_TRUE(got.is_object()) << path << ": got " << got.dump();
    EXPECT_EQ(got.size(), want.size()) << path << ": got " << got.dump() << "\nwant " << want.dump();
    for (const auto& [key, value] : want.items()) {
      ASSERT_TRUE(got.contains(key)) << path << "." << key << " missing";
      expect_matches(got[key], value, path + "." + key);
    }
  } else if (want.is_array()) {
    ASSERT_TRUE(got.is_array()) << path << ": got " << got.dump();
    ASSERT_EQ(got.size(), want.size()) << path << ": got " << got.dump() << "\nwant " << want.dump();
    for (std::size_t i = 0; i < want.size(); ++i) expect_matches(got[i], want[i], path + "[" + std::to_string(i) + "]");
  } else {
    EXPECT_EQ(got.dump(), want.dump()) << path;
  }
}

TEST(Library, EveryScenarioMatchesItsStoredResult) {
  const bool update = std::getenv("TRAINSIM_UPDATE_GOLDEN") != nullptr;
  const auto files = scenario_files();
  ASSERT_GE(files.size(), 10u);
  for (const auto& file : files) {
    SCOPED_TRACE(file.string());
    const std::string name = file.stem().string();
    const LibraryRun& r = library(name);
    const json got = main_figures(r);
    const fs::path golden = kSource / "tests" / "golden" / "library" / (name + ".json");
    if (update) {
      fs::create_directories(golden.parent_path());
      std::ofstream(golden) << got.dump(2) << "\n";
      continue;
    }
    std::ifstream in(golden);
    ASSERT_TRUE(in) << "no stored result " << golden << "; create it with TRAINSIM_UPDATE_GOLDEN=1";
    const json want = json::parse(in);
    expect_matches(got, want, name);
  }
}

// Every file states its question, names itself after its file, gives the command that answers
// it, keeps the sweep small enough for CI, and is listed in scenarios/README.md.
TEST(Library, EveryScenarioIsDocumentedAndSmall) {
  const std::string readme = read_text(kSource / "scenarios" / "README.md");
  for (const auto& file : scenario_files()) {
    SCOPED_TRACE(file.string());
    const std::string name = file.stem().string();
    const Scenario sc = load_scenario_file(file.string());
    const std::string header = header_comment(read_text(file));
    EXPECT_NE(header.find("trainsim "), std::string::npos) << "the header comment gives the command";
    EXPECT_EQ(sc.config.name, name);
    EXPECT_GE(sc.config.description.size(), 40u);
    EXPECT_NE(sc.config.description.find('?'), std::string::npos) << "the description states a question";
    EXPECT_FALSE(sc.sweep.empty()) << "a library scenario answers with sweep or plan: it needs sweep: axes";
    EXPECT_LT(expand_sweep(sc).size(), 3000u) << "keep the library fast on a 2-core CI machine";
    EXPECT_NE(readme.find(file.filename().string()), std::string::npos) << "not listed in scenarios/README.md";
  }
}

// ---- each scenario's point ------------------------------------------------------------

std::string str_of(const SweepRow& row, const std::string& key) {
  for (const auto& [k, v] : row.point.values)
    if (k == key) return format_field_value(v);
  ADD_FAILURE() << "no swept key " << key;
  return "";
}

const SweepRow* find_row(const SweepResult& s, const std::map<std::string, std::string>& want, bool feasible_only) {
  const SweepRow* found = nullptr;
  for (std::size_t i : s.order) {  // report order: the best such row first
    const SweepRow& row = s.rows[i];
    if (feasible_only && !row.feasible()) continue;
    bool match = true;
    for (const auto& [k, v] : want) match &= str_of(row, k) == v;
    if (match) {
      found = &row;
      break;
    }
  }
  return found;
}

double gib(double bytes) { return bytes_to_gib(bytes); }

// #1: the incident. The plan beats the configuration as written on throughput and bubble,
// fits, and removes every numerics risk; keeping the 4 x 2 layout, the pipelining changes
// alone already cut the bubble.
TEST(Library, PostmortemPlanFixesTheBubbleAndTheNumerics) {
  const LibraryRun& r = library("postmortem-8x40gb");
  ASSERT_EQ(r.mode, Mode::plan);
  const SweepRow* chosen = r.best();
  ASSERT_NE(chosen, nullptr);
  EXPECT_GT(r.base.metrics.bubble_fraction, 0.40);
  EXPECT_GT(chosen->metrics.tokens_per_s, 1.5 * r.base.metrics.tokens_per_s);
  EXPECT_LT(chosen->metrics.bubble_fraction, 0.5 * r.base.metrics.bubble_fraction);
  EXPECT_GE(gib(chosen->metrics.headroom_bytes()), 2.0);
  EXPECT_TRUE(precision_issues(chosen->point.config).empty());
  EXPECT_EQ(r.plan->precision.size(), 4u) << "static scale, fp16 accumulation, sum before divide, local check";
  const SweepRow* kept = find_row(r.sweep, {{"parallelism.data_parallel_size", "2"},
                                             {"parallelism.pipeline_parallel_size", "4"}},
                                  true);
  ASSERT_NE(kept, nullptr);
  EXPECT_NE(str_of(*kept, "parallelism.schedule"), "gpipe");
  EXPECT_LT(kept->metrics.bubble_fraction, 0.5 * r.base.metrics.bubble_fraction);
  EXPECT_GT(kept->metrics.tokens_per_s, r.base.metrics.tokens_per_s);
}

// #2: every requirement at once: the chosen configuration meets the memory and batch bounds,
// has no numerics risk, and reaches the 250K tokens/s target that the first attempt misses.
TEST(Library, ConstrainedPlanMeetsEveryRequirement) {
  const LibraryRun& r = library("constrained-plan-13b-64xh100");
  ASSERT_EQ(r.mode, Mode::plan);
  const SweepRow* chosen = r.best();
  ASSERT_NE(chosen, nullptr);
  constexpr double kTarget = 250e3;  // 300B tokens in 14 days
  EXPECT_LT(r.base.metrics.tokens_per_s, kTarget);
  EXPECT_GE(chosen->metrics.tokens_per_s, kTarget);
  EXPECT_LE(chosen->metrics.peak_memory_bytes, 0.9 * chosen->metrics.memory_capacity_bytes);
  EXPECT_GE(chosen->global_batch_size, 256);
  EXPECT_LE(chosen->global_batch_size, 512);
  EXPECT_TRUE(precision_issues(chosen->point.config).empty());
  EXPECT_FALSE(r.plan->precision.empty());
  // The constraints bite: faster configurations exist outside them (a 4M-token batch).
  EXPECT_GT(r.sweep.counts.constraint, 0u);
  bool faster_outside = false;
  for (const auto& row : r.sweep.rows)
    faster_outside |= row.status == SweepStatus::constraint && row.metrics.tokens_per_s > chosen->metrics.tokens_per_s;
  EXPECT_TRUE(faster_outside);
}

// #3: doubling the GPUs gives much less than twice the throughput; the lost time is the
// gradient reduction crossing the inter-node link, exposed; overlap + hierarchical recover it.
TEST(Library, ScalingRegressionIsTheExposedInterNodeReduction) {
  const LibraryRun& r = library("scaling-regression-8-to-16-gpus");
  auto row = [&](const char* gpus, const char* dp, const char* overlap, const char* alg) {
    const SweepRow* x = find_row(r.sweep, {{"cluster.num_gpus", gpus},
                                          {"parallelism.data_parallel_size", dp},
                                          {"communication.overlap_grad_reduce", overlap},
                                          {"communication.allreduce_algorithm", alg}},
                                 true);
    EXPECT_NE(x, nullptr) << gpus << " GPUs";
    return x;
  };
  const SweepRow* one = row("8", "2", "false", "ring");
  const SweepRow* two = row("16", "4", "false", "ring");
  const SweepRow* fixed = row("16", "4", "true", "hierarchical");
  ASSERT_TRUE(one && two && fixed);
  const double speedup = two->metrics.tokens_per_s / one->metrics.tokens_per_s;
  // (1.53x since Megatron-Core's distributed optimizer reduces each chunk in one call without
  // overlap_grad_reduce, where 25 MiB buckets paid the ring's latency over again: 1.4x.)
  EXPECT_GT(speedup, 1.0);
  EXPECT_LT(speedup, 1.6);
  EXPECT_LT(one->metrics.exposed_comm_time_s, 0.02 * one->metrics.step_time_s);
  EXPECT_GT(two->metrics.exposed_comm_time_s, 0.2 * two->metrics.step_time_s);
  EXPECT_GT(two->metrics.bubble_fraction, 0.2) << "the GPUs idle while the reduction crosses nodes";
  // That idle time is exposed communication, not a pipeline bubble (there is no pipeline).
  EXPECT_EQ(two->metrics.pipeline_bubble_fraction, 0.0);
  EXPECT_EQ(two->metrics.exposed_comm_fraction, two->metrics.bubble_fraction);
  EXPECT_GT(fixed->metrics.tokens_per_s / one->metrics.tokens_per_s, 1.7);
  EXPECT_EQ(r.sweep.counts.invalid, r.sweep.counts.total / 2) << "only the mismatched (num_gpus, dp) pairs";
}

// #4: over a slow link, the best layout cuts the pipeline at the link (pp >= 2, each stage's
// replicas inside one cluster); one replica per cluster (the file's layout) loses much.
TEST(Library, TwoClustersCutThePipelineAtTheSlowLink) {
  const LibraryRun& r = library("two-clusters-slow-link");
  const SweepRow* slow = find_row(r.sweep, {{"cluster.inter_node.bandwidth_gbps", "1.5625"}}, true);
  const SweepRow* fast = find_row(r.sweep, {{"cluster.inter_node.bandwidth_gbps", "25"}}, true);
  ASSERT_TRUE(slow && fast);
  const auto& par = slow->point.config.parallelism;
  EXPECT_GE(par.pipeline_parallel_size, 2);
  EXPECT_LE(par.data_parallel_size * par.tensor_parallel_size, slow->point.config.cluster.gpus_per_node);
  EXPECT_LT(r.base.metrics.tokens_per_s, 0.7 * slow->metrics.tokens_per_s);
  EXPECT_GT(r.base.metrics.exposed_comm_time_s, 0.3 * r.base.metrics.step_time_s);
  // The slow link costs little once it carries only activations.
  EXPECT_GT(slow->metrics.tokens_per_s, 0.85 * fast->metrics.tokens_per_s);
  EXPECT_LT(slow->metrics.tokens_per_s, fast->metrics.tokens_per_s);
  // Replicas across the slow link (pipeline 1) are the worst layouts there.
  const SweepRow* across = find_row(r.sweep, {{"cluster.inter_node.bandwidth_gbps", "1.5625"},
                                              {"parallelism.pipeline_parallel_size", "1"}},
                                    true);
  ASSERT_NE(across, nullptr);
  EXPECT_LT(across->metrics.tokens_per_s, 0.8 * slow->metrics.tokens_per_s);
}

// #5: the file is the H100 node running the A100's configuration. Hardware is not a knob: the
// plan chooses for the H100s (never another GPU), with another layout than the A100's best
// and than the file's, and lists each GPU's own best; the new node at its best is much faster
// than the old one at its best.
TEST(Library, HardwareRefreshChangesTheBestConfiguration) {
  const LibraryRun& r = library("hardware-refresh-a100-to-h100");
  ASSERT_EQ(r.mode, Mode::plan);
  const SweepRow* chosen = r.best();
  ASSERT_NE(chosen, nullptr);
  EXPECT_EQ(chosen->point.config.cluster.gpu, r.scenario.config.cluster.gpu);
  EXPECT_EQ(chosen->point.config.cluster.gpu, "h100-80gb");
  for (const auto& step : r.plan->steps)
    for (const auto& k : step.keys) EXPECT_FALSE(is_setup_key(k)) << "the plan changes " << k;
  const SweepRow* a100 = find_row(r.sweep, {{"cluster.gpu", "a100-40gb"}}, true);
  ASSERT_NE(a100, nullptr);
  // Each GPU is listed with its own best configuration, the file's first.
  ASSERT_EQ(r.plan->setups.size(), 2u);
  EXPECT_TRUE(r.plan->setups[0].own);
  for (const auto& su : r.plan->setups) {
    ASSERT_TRUE(su.best.has_value());
    const std::string gpu = format_field_value(su.values.at(0).second);
    EXPECT_EQ(r.sweep.rows[*su.best].point.config.cluster.gpu, gpu);
    EXPECT_EQ(&r.sweep.rows[*su.best], find_row(r.sweep, {{"cluster.gpu", gpu}}, true)) << gpu;
  }
  const auto layout = [](const SweepRow& x) {
    const auto& p = x.point.config.parallelism;
    return std::tuple(p.data_parallel_size, p.pipeline_parallel_size, p.tensor_parallel_size);
  };
  EXPECT_NE(layout(*chosen), layout(*a100)) << "the A100's best layout is not the H100's";
  EXPECT_NE(layout(*chosen), layout(r.base)) << "the A100-era layout is not kept";
  EXPECT_GT(chosen->metrics.tokens_per_s, (1 + r.plan->margin) * r.base.metrics.tokens_per_s);
  EXPECT_GT(chosen->metrics.tokens_per_s, 2.5 * a100->metrics.tokens_per_s);
  // The A100 layout, moved unchanged to the H100s, is slower than the H100's own best.
  const auto& ap = a100->point.config;
  const SweepRow* moved = find_row(
      r.sweep,
      {{"cluster.gpu", "h100-80gb"},
       {"parallelism.data_parallel_size", std::to_string(ap.parallelism.data_parallel_size)},
       {"parallelism.pipeline_parallel_size", std::to_string(ap.parallelism.pipeline_parallel_size)},
       {"parallelism.tensor_parallel_size", std::to_string(ap.parallelism.tensor_parallel_size)}},
      true);
  ASSERT_NE(moved, nullptr);
  EXPECT_LT(moved->metrics.tokens_per_s, chosen->metrics.tokens_per_s);
}

// #6: the file's configuration does not fit; what fits needs sharding or recompute, and the
// fastest fit computes in FP16 (V100 has no BF16; FP32 is slower and larger).
TEST(Library, MemoryBoundRunFitsOnlyWithShardingOrRecompute) {
  const LibraryRun& r = library("memory-bound-13b-on-v100");
  EXPECT_EQ(r.base.status, SweepStatus::out_of_memory);
  const SweepRow* best = r.best();
  ASSERT_NE(best, nullptr);
  EXPECT_GE(gib(best->metrics.headroom_bytes()), 2.0);
  EXPECT_EQ(str_of(*best, "precision.compute"), "fp16");
  EXPECT_GT(r.sweep.counts.unsupported_precision, 0u);
  EXPECT_GT(r.sweep.counts.out_of_memory, r.sweep.counts.ok);
  for (std::size_t i : r.sweep.ranking) {
    const ScenarioConfig& c = r.sweep.rows[i].point.config;
    EXPECT_TRUE(c.parallelism.zero_stage > 0 || c.training.activation_recompute != Recompute::none ||
                c.parallelism.tensor_parallel_size * c.parallelism.pipeline_parallel_size >= 8)
        << "fits without sharding, recompute or an 8-way split: row " << i;
  }
}

// #7: a 30B model on one 8-GPU node: the first attempt leaves less than the 2 GiB the framework
// needs; the plan fits with headroom.
TEST(Library, ThirtyBillionOnOneNodeFitsOnlyAfterThePlan) {
  const LibraryRun& r = library("llama-30b-single-node");
  ASSERT_EQ(r.mode, Mode::plan);
  EXPECT_FALSE(r.base.feasible());
  EXPECT_LT(gib(r.base.metrics.headroom_bytes()), 2.0);
  const SweepRow* chosen = r.best();
  ASSERT_NE(chosen, nullptr);
  EXPECT_GE(gib(chosen->metrics.headroom_bytes()), 2.0);
  EXPECT_GT(r.sweep.counts.out_of_memory, r.sweep.counts.ok);
  // 52 heads: no 8-way tensor parallelism among the candidates.
  for (const auto& row : r.sweep.rows) EXPECT_NE(row.point.config.parallelism.tensor_parallel_size, 8);
}

// #8: 70B on 8 GPUs: nothing fits on 80 GB GPUs; only the H200 fits, and only with 16-bit
// gradients or master weights.
TEST(Library, SeventyBillionOnEightGpusFitsOnlyOnH200) {
  const LibraryRun& r = library("llama2-70b-on-8-gpus");
  EXPECT_EQ(r.base.status, SweepStatus::out_of_memory);
  EXPECT_GT(r.sweep.counts.out_of_memory, 0u);
  ASSERT_GT(r.sweep.counts.ok, 0u);
  for (std::size_t i : r.sweep.ranking) {
    const ScenarioConfig& c = r.sweep.rows[i].point.config;
    EXPECT_EQ(c.cluster.gpu, "h200") << "row " << i;
    EXPECT_FALSE(c.precision.master_weights == DType::fp32 && c.precision.grad_accumulation == DType::fp32)
        << "row " << i << " fits with FP32 master weights and gradients";
  }
}

// #11: a 128K-token sequence does not fit a GPU whole: every feasible configuration splits it
// (context parallelism) or its heads (tensor parallelism), and the chosen one splits it. The
// sequence's split is the cheaper one: the best context-parallel configuration without tensor
// parallelism beats the best tensor-parallel one without context parallelism (8 ways of heads
// pay two all-gathers and two reduce-scatters of the whole stream a layer; 8 ways of tokens one
// gather of the keys and values, an eighth of the stream's width under grouped-query attention).
TEST(Library, LongContextSplitsTheSequence) {
  const LibraryRun& r = library("long-context-llama3-8b");
  ASSERT_EQ(r.mode, Mode::plan);
  EXPECT_EQ(r.base.status, SweepStatus::out_of_memory);
  const SweepRow* chosen = r.best();
  ASSERT_NE(chosen, nullptr);
  EXPECT_GT(chosen->point.config.parallelism.context_parallel_size, 1);
  EXPECT_GE(gib(chosen->metrics.headroom_bytes()), 2.0);
  for (std::size_t i : r.sweep.ranking) {
    const ParallelismConfig& p = r.sweep.rows[i].point.config.parallelism;
    EXPECT_GE(p.context_parallel_size * p.tensor_parallel_size, 2) << "row " << i << " holds a whole sequence";
  }
  const SweepRow* by_tokens = find_row(r.sweep, {{"parallelism.tensor_parallel_size", "1"}}, true);
  const SweepRow* by_heads = find_row(r.sweep, {{"parallelism.context_parallel_size", "1"}}, true);
  ASSERT_NE(by_tokens, nullptr);
  ASSERT_NE(by_heads, nullptr);
  EXPECT_GT(by_tokens->metrics.tokens_per_s, by_heads->metrics.tokens_per_s);
}

// #12: activations that do not fit: recomputing each chunk's first layers alone trades memory for
// time layer by layer (every 4 layers fewer: more memory, more tokens/s), and the fewest that
// leave 2 GiB free beat recomputing all 32.
TEST(Library, PartialRecomputeBuysBackPartOfFullRecomputesCost) {
  const LibraryRun& r = library("partial-recompute-llama3-8b-8xh100");
  ASSERT_EQ(r.mode, Mode::sweep);
  EXPECT_EQ(r.base.status, SweepStatus::out_of_memory);
  std::map<int, const SweepRow*> by_layers;  // layers recomputed (0: all 32)
  for (const SweepRow& row : r.sweep.rows) {
    const int n = row.point.config.training.recompute_num_layers;
    by_layers[n == 0 ? 32 : n] = &row;
  }
  ASSERT_EQ(by_layers.size(), 8u);
  for (auto it = std::next(by_layers.begin()); it != by_layers.end(); ++it) {
    const SweepRow &fewer = *std::prev(it)->second, &more = *it->second;
    EXPECT_GT(fewer.metrics.peak_memory_bytes, more.metrics.peak_memory_bytes) << it->first << " layers";
    EXPECT_GT(fewer.metrics.tokens_per_s, more.metrics.tokens_per_s) << it->first << " layers";
  }
  const SweepRow* best = r.best();
  ASSERT_NE(best, nullptr);
  const int n = best->point.config.training.recompute_num_layers;
  EXPECT_GT(n, 0);
  EXPECT_LT(n, 32);
  EXPECT_GE(gib(best->metrics.headroom_bytes()), 2.0);
  ASSERT_TRUE(by_layers[32]->feasible());
  EXPECT_GT(best->metrics.tokens_per_s, 1.05 * by_layers[32]->metrics.tokens_per_s);
  EXPECT_FALSE(by_layers[n - 4]->feasible()) << "four layers fewer leave less than 2 GiB";
}

// #9: pure data parallelism: the speed-up grows with the GPUs but stays below ideal, and the
// all-reduce's share of the step grows with the GPU count.
TEST(Library, DataParallelSpeedupIsBelowIdealAndTheAllReduceShareGrows) {
  const LibraryRun& r = library("data-parallel-scaling-1-to-64");
  for (const char* overlap : {"false", "true"}) {
    SCOPED_TRACE(std::string("overlap ") + overlap);
    double base = 0, prev_tokens = 0, prev_share = -1;
    for (int n : {1, 2, 4, 8, 16, 32, 64}) {
      const SweepRow* row = find_row(r.sweep, {{"cluster.num_gpus", std::to_string(n)},
                                              {"parallelism.data_parallel_size", std::to_string(n)},
                                              {"communication.overlap_grad_reduce", overlap}},
                                     true);
      ASSERT_NE(row, nullptr) << n;
      const double tokens = row->metrics.tokens_per_s;
      const double share = row->metrics.allreduce_time_s / row->metrics.step_time_s;
      if (n == 1) {
        base = tokens;
        EXPECT_EQ(row->metrics.allreduce_time_s, 0.0);
      } else {
        EXPECT_GT(tokens, prev_tokens) << n;
        EXPECT_LE(tokens / base, n * (1 + 1e-9)) << n;
        EXPECT_GT(share, prev_share) << n;
      }
      if (n == 64) {
        EXPECT_LT(tokens / base, 0.85 * 64);
        EXPECT_GT(share, 0.2);
      }
      prev_tokens = tokens;
      prev_share = share;
    }
  }
  EXPECT_EQ(r.sweep.counts.ok, 14u);
}

// #10: on two nodes, the best layouts use pipeline parallelism across the nodes and keep
// tensor parallelism inside one; the widest tensor split (8) is slower than the best.
TEST(Library, TensorInsideNodesPipelineAcross) {
  const LibraryRun& r = library("tensor-vs-pipeline-22b");
  const SweepRow* two = find_row(r.sweep, {{"cluster.num_gpus", "16"}}, true);
  const SweepRow* one = find_row(r.sweep, {{"cluster.num_gpus", "8"}}, true);
  ASSERT_TRUE(one && two);
  EXPECT_GE(two->point.config.parallelism.pipeline_parallel_size, 2);
  EXPECT_LE(two->point.config.parallelism.tensor_parallel_size, 8);
  for (const char* gpus : {"8", "16"}) {
    const SweepRow* tp8 = find_row(r.sweep, {{"cluster.num_gpus", gpus}, {"parallelism.tensor_parallel_size", "8"}}, true);
    const SweepRow* best = find_row(r.sweep, {{"cluster.num_gpus", gpus}}, true);
    ASSERT_TRUE(tp8 && best) << gpus;
    EXPECT_LT(tp8->metrics.tokens_per_s, best->metrics.tokens_per_s) << gpus;
  }
  // Two nodes are faster than one, but not twice.
  EXPECT_GT(two->metrics.tokens_per_s, one->metrics.tokens_per_s);
  EXPECT_LT(two->metrics.tokens_per_s, 2.0 * one->metrics.tokens_per_s);
}

// Sweep and plan agree, or the reason is printed: for every plan scenario the plan says why it
// chose what it chose, and whenever its ranking differs from the sweep's (precision fixes,
// hardware setups, the margin) its text says so.
TEST(Library, PlanSaysWhyItsChoiceCanDifferFromTheSweep) {
  for (const auto& file : scenario_files()) {
    const LibraryRun& r = library(file.stem().string());
    if (!r.plan || !r.plan->chosen) continue;
    SCOPED_TRACE(file.string());
    const PlanResult& p = *r.plan;
    EXPECT_FALSE(p.choice_reason.empty());
    const std::string text = format_plan(p);
    EXPECT_NE(text.find("why: " + p.choice_reason), std::string::npos);
    if (!p.precision.empty() || !p.setups.empty()) {
      EXPECT_NE(text.find("`trainsim sweep` ranks the same candidates as written"), std::string::npos);
    }
    // The plan's choice is within its margin of the fastest of the file's setup.
    ASSERT_TRUE(p.fastest.has_value());
    EXPECT_GE(p.sweep.rows[*p.chosen].metrics.tokens_per_s * (1 + p.margin),
              p.sweep.rows[*p.fastest].metrics.tokens_per_s);
    if (*p.chosen != *p.fastest) {
      EXPECT_NE(p.choice, "fastest");
    }
  }
}

}  // namespace
}  // namespace trainsim
