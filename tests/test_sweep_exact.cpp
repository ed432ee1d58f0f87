// The sweep benchmark of docs/performance.md (tests/bench/sweep-gpt3-175b.yaml: GPT-3 175B,
// TP 8 x PP 8, interleaved v = 3, 2,016 variants) answers every row exactly as a full
// discrete-event simulation of that row's plan does: the Predictor's cache and compiled
// programs (sim/step_program.h), met in the order a sweep meets them, give predict()'s
// Result whole, and the rows of `trainsim sweep` carry its figures.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/plan.h"
#include "sim/simulator.h"
#include "sim/sweep/sweep.h"

namespace trainsim {
namespace {

const char* kFile = TRAINSIM_SOURCE_DIR "/tests/bench/sweep-gpt3-175b.yaml";

TEST(SweepExact, EveryRowOfTheBenchmarkIsAFullSimulation) {
  const Scenario scenario = load_scenario_file(kFile);
  const auto points = expand_sweep(scenario);
  ASSERT_EQ(points.size(), 2016u);
  Predictor predictor;  // as one sweep worker: every configuration in expansion order
  for (const auto& p : points) {
    SCOPED_TRACE(::testing::Message() << "configuration " << p.index);
    const Plan plan = Plan::from_config(p.config);
    const Prediction want = predict(plan);  // a fresh engine run of every op of every rank
    const Result& got = predictor.evaluate(plan);
    ASSERT_TRUE(got == want.result) << "step " << got.step_time_s << " vs " << want.result.step_time_s;
  }

  // Four at a time, as a sweep worker evaluates them (Predictor::evaluate_batch).
  Predictor batched;
  for (std::size_t i = 0; i < points.size(); i += Predictor::kMaxBatch) {
    std::vector<Plan> plans;
    for (std::size_t j = i; j < std::min(points.size(), i + Predictor::kMaxBatch); ++j)
      plans.push_back(Plan::from_config(points[j].config));
    std::vector<const Plan*> in;
    for (const Plan& p : plans) in.push_back(&p);
    std::vector<const Result*> out(in.size());
    batched.evaluate_batch(in.data(), static_cast<int>(in.size()), out.data());
    for (std::size_t j = 0; j < in.size(); ++j)
      ASSERT_TRUE(*out[j] == predict(plans[j]).result) << "configuration " << i + j << ", four at a time";
  }

  SweepOptions options;
  options.threads = 2;
  const SweepResult sweep = run_sweep(scenario, options);
  ASSERT_EQ(sweep.rows.size(), points.size());
  EXPECT_EQ(sweep.stats.evaluations, points.size());  // nothing here is rejected before simulation
  EXPECT_EQ(sweep.stats.rejected, 0u);
  for (const SweepRow& row : sweep.rows) {
    const Result want = predict(Plan::from_config(row.point.config)).result;
    ASSERT_TRUE(row.simulated);
    EXPECT_EQ(row.metrics.step_time_s, want.step_time_s);
    EXPECT_EQ(row.metrics.tokens_per_s, want.tokens_per_s);
    EXPECT_EQ(row.metrics.mfu, want.mfu);
    EXPECT_EQ(row.metrics.bubble_fraction, want.bubble_fraction);
    EXPECT_EQ(row.metrics.allreduce_time_s, want.allreduce_time_s);
    EXPECT_EQ(row.metrics.exposed_comm_time_s, want.exposed_comm_time_s);
    EXPECT_EQ(row.warnings, want.warnings);
    double peak = 0;
    for (const auto& r : want.ranks) peak = std::max(peak, r.peak_memory_bytes);
    EXPECT_EQ(row.metrics.peak_memory_bytes, peak);
    if (HasFailure()) return;
  }
}

// Rows refused before simulation are not evaluations.
TEST(SweepExact, StatsCountOnlySimulatedRows) {
  Scenario scenario = load_scenario_file(kFile);
  scenario.sweep.clear();
  SweepAxis mbs;
  mbs.path = "training.micro_batch_size";
  mbs.values = {FieldValue(std::int64_t{1}), FieldValue(std::int64_t{3}), FieldValue(std::int64_t{8})};  // 3 does not divide 64
  scenario.sweep.push_back(mbs);
  SweepAxis format;
  format.path = "precision.compute";
  format.values = {FieldValue(std::string("bf16")), FieldValue(std::string("fp8"))};  // A100: no fp8
  scenario.sweep.push_back(format);
  SweepOptions options;
  options.threads = 1;
  const SweepResult sweep = run_sweep(scenario, options);
  ASSERT_EQ(sweep.rows.size(), 6u);
  EXPECT_EQ(sweep.stats.evaluations, 2u);
  EXPECT_EQ(sweep.stats.rejected, 4u);
  EXPECT_EQ(sweep.stats.threads, 1u);
  EXPECT_GT(sweep.stats.evaluate_cpu_s, 0);
  const std::string line = format_sweep_stats(sweep.stats, sweep.rows.size());
  EXPECT_NE(line.find("6 configurations: 2 evaluated, 4 rejected before simulation"), std::string::npos) << line;
}

}  // namespace
}  // namespace trainsim
