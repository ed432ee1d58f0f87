// Simulator speed. Targets (one core of the 2-core CI machine), see docs/performance.md:
//   sweep (BM_Sweep_Evaluate, the path sweeps run): >= 20,000 configurations of 8-64 GPUs
//   per second per core
//   1F1B, p=8, m=32, data-parallel all-reduce in buckets: one step simulates in < 50 us
//   interleaved 1F1B, p=64, m=512, v=2:                    one step simulates in < 20 ms
//   engine memory linear in the number of ops (bytes_per_op constant across sizes)
//
//   build/tests/bench/bench_simulator --benchmark_min_time=0.5
#include <benchmark/benchmark.h>

#include <vector>

#include "core/metrics.h"
#include "core/plan.h"
#include "core/presets.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/memory_model.h"
#include "sim/cost/p2p_model.h"
#include "sim/engine.h"
#include "sim/simulator.h"
#include "sim/step_program.h"
#include "sim/sweep/sweep.h"

namespace {

using namespace trainsim;

ScenarioConfig config(const char* model, int p, int m, int v, int d, ScheduleKind kind) {
  ScenarioConfig c;
  apply_model_preset(*find_model_preset(model), c.model);
  apply_gpu_preset(*find_gpu_preset("h100-80gb"), c.cluster);
  c.cluster.num_gpus = p * d;
  c.parallelism.pipeline_parallel_size = p;
  c.parallelism.data_parallel_size = d;
  c.parallelism.virtual_pipeline_stages = v;
  c.parallelism.schedule = kind;
  c.training.micro_batch_size = 1;
  c.training.global_batch_size = m * d;
  c.communication.overlap_grad_reduce = true;
  c.communication.bucket_size_mib = 40;
  return c;
}

// The engine as a sweep worker uses it: one Simulation and one Timeline reused across
// runs. Timed: pricing every op with the cost models, the event loop, and the Timeline.
void simulate_step(benchmark::State& state, const ScenarioConfig& c) {
  const Plan plan = Plan::from_config(c);
  auto schedule = std::make_shared<const Schedule>(build_schedule(plan));
  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  const CostModels models{&compute, &p2p, &collective};
  Simulation sim;
  Timeline timeline;
  for (auto _ : state) {
    sim.run(schedule, models, timeline);
    benchmark::DoNotOptimize(timeline);
  }
  const std::size_t footprint = sim.footprint_bytes();
  const double ops = static_cast<double>(schedule->total_ops());
  state.counters["ops"] = ops;
  state.counters["ops_per_s"] = benchmark::Counter(ops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes_per_op"] = static_cast<double>(footprint) / ops;
}

void BM_Simulate_1F1B_p8_m32_dp2(benchmark::State& state) {
  simulate_step(state, config("gpt3-6.7b", 8, 32, 1, 2, ScheduleKind::one_f_one_b));
}
BENCHMARK(BM_Simulate_1F1B_p8_m32_dp2)->Unit(benchmark::kMicrosecond);

void BM_Simulate_Interleaved_p64_m512_v2(benchmark::State& state) {
  simulate_step(state, config("megatron-1t", 64, 512, 2, 1, ScheduleKind::interleaved_1f1b));
}
BENCHMARK(BM_Simulate_Interleaved_p64_m512_v2)->Unit(benchmark::kMillisecond);

// Memory linearity: the same schedule family at growing m; bytes_per_op should not grow.
void BM_Simulate_1F1B_p8_dp2_by_m(benchmark::State& state) {
  simulate_step(state, config("gpt3-6.7b", 8, static_cast<int>(state.range(0)), 1, 2, ScheduleKind::one_f_one_b));
}
BENCHMARK(BM_Simulate_1F1B_p8_dp2_by_m)->RangeMultiplier(4)->Range(8, 2048)->Unit(benchmark::kMicrosecond);

// Everything `trainsim simulate` does after parsing: schedule, cost models, engine, memory
// walk and metrics.
void BM_Predict_1F1B_p8_m32_dp2(benchmark::State& state) {
  const Plan plan = Plan::from_config(config("gpt3-6.7b", 8, 32, 1, 2, ScheduleKind::one_f_one_b));
  for (auto _ : state) benchmark::DoNotOptimize(predict(plan));
}
BENCHMARK(BM_Predict_1F1B_p8_m32_dp2)->Unit(benchmark::kMicrosecond);

void BM_BuildSchedule_1F1B_p8_m32_dp2(benchmark::State& state) {
  const Plan plan = Plan::from_config(config("gpt3-6.7b", 8, 32, 1, 2, ScheduleKind::one_f_one_b));
  for (auto _ : state) benchmark::DoNotOptimize(build_schedule(plan));
}
BENCHMARK(BM_BuildSchedule_1F1B_p8_m32_dp2)->Unit(benchmark::kMicrosecond);


// ---- Sweep throughput --------------------------------------------------------------------
// BM_Sweep_Predictor: Plan::from_config, then the full Predictor::predict
// (schedule, cost models, discrete-event simulation of every op, memory walk, metrics).
// Population: every dp x pp factorisation of 8, 16, 32 and 64 GPUs (tp = 1) for
// gpt3-6.7b, gpt3-13b and llama2-7b on a100-80gb and h100-80gb, micro-batch sizes
// 1, 2, 4, 8, schedules gpipe, 1f1b and interleaved-1f1b (v = 2), global batch 128, 256 or
// 512 sequences, kept where the plan is valid and p * m <= 256. Gradients all-reduced in
// fp32 in Megatron-LM's default buckets of 40M parameters, overlapped with backward.
std::vector<ScenarioConfig> sweep_population() {
  std::vector<ScenarioConfig> out;
  for (const char* model : {"gpt3-6.7b", "gpt3-13b", "llama2-7b"})
    for (const char* gpu : {"a100-80gb", "h100-80gb"})
      for (int n : {8, 16, 32, 64})
        for (int p = 1; p <= n; p *= 2)
          for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved_1f1b})
            for (int b : {1, 2, 4, 8})
              for (int gb : {128, 256, 512}) {
                const int d = n / p, v = kind == ScheduleKind::interleaved_1f1b ? 2 : 1;
                if (gb % (b * d) != 0) continue;
                const int m = gb / (b * d);
                if (p * m > 256) continue;
                ScenarioConfig c;
                apply_model_preset(*find_model_preset(model), c.model);
                apply_gpu_preset(*find_gpu_preset(gpu), c.cluster);
                if (c.model.num_layers % (p * v) != 0) continue;
                if (kind == ScheduleKind::interleaved_1f1b && (p < 2 || m % p != 0)) continue;
                c.cluster.num_gpus = n;
                c.parallelism.pipeline_parallel_size = p;
                c.parallelism.data_parallel_size = d;
                c.parallelism.virtual_pipeline_stages = v;
                c.parallelism.schedule = kind;
                c.training.micro_batch_size = b;
                c.training.global_batch_size = gb;
                c.communication.overlap_grad_reduce = true;
                c.communication.bucket_size_mib = 40e6 * 4 / kMiB;
                out.push_back(c);
              }
  return out;
}

// One iteration predicts the whole population once, on one thread, with one Predictor.
void BM_Sweep_Predictor(benchmark::State& state) {
  const std::vector<ScenarioConfig> population = sweep_population();
  Predictor predictor;
  double ops = 0;
  for (const auto& c : population) ops += static_cast<double>(predictor.predict(Plan::from_config(c)).schedule->total_ops());
  for (auto _ : state) {
    for (const auto& c : population) {
      const Plan plan = Plan::from_config(c);
      const Prediction& p = predictor.predict(plan);
      benchmark::DoNotOptimize(p.result.step_time_s);
    }
  }
  const double n = static_cast<double>(population.size());
  state.counters["configs"] = n;
  state.counters["ops_per_config"] = ops / n;
  state.counters["configs_per_s"] = benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["s_per_config"] =  // printed with an SI prefix: 50u is 50 us
      benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_Sweep_Predictor)->Unit(benchmark::kMillisecond);

// The figure: what a sweep worker really does per configuration (sim/sweep/sweep.cpp),
// Plan::from_config then Predictor::evaluate, the result-only path (replica 0 alone built
// and simulated when the replicas are symmetric). Same population, one thread, one Predictor.
void BM_Sweep_Evaluate(benchmark::State& state) {
  const std::vector<ScenarioConfig> population = sweep_population();
  Predictor predictor;
  double ops = 0;
  for (const auto& c : population) ops += static_cast<double>(predictor.predict(Plan::from_config(c)).schedule->total_ops());
  for (auto _ : state) {
    for (const auto& c : population) {
      const Plan plan = Plan::from_config(c);
      const Result& r = predictor.evaluate(plan);
      benchmark::DoNotOptimize(r.step_time_s);
    }
  }
  const double n = static_cast<double>(population.size());
  state.counters["configs"] = n;
  state.counters["ops_per_config"] = ops / n;  // of the full schedule, as in BM_Sweep_Predictor
  state.counters["configs_per_s"] = benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["s_per_config"] =
      benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_Sweep_Evaluate)->Unit(benchmark::kMillisecond);

// The same population through Plan::from_config alone (validation and derived figures).
void BM_Sweep_PlanOnly(benchmark::State& state) {
  const std::vector<ScenarioConfig> population = sweep_population();
  for (auto _ : state)
    for (const auto& c : population) benchmark::DoNotOptimize(Plan::from_config(c).num_microbatches);
  state.counters["configs_per_s"] =
      benchmark::Counter(static_cast<double>(population.size()), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Sweep_PlanOnly)->Unit(benchmark::kMillisecond);

// ---- A sweep file, as `trainsim sweep` evaluates it -----------------------------------
// tests/bench/sweep-gpt3-175b.yaml: GPT-3 175B, TP 8 x PP 8, interleaved v = 3, global batch
// 64, 2,016 variants, every one simulated (docs/performance.md compares it with Calculon).
// One iteration evaluates every configuration once, on one thread, with one Predictor:
// exactly what a sweep worker does per row (evaluate_configuration: precision check,
// Plan::from_config, Predictor::evaluate, the row's metrics and verdict).
const std::vector<SweepConfiguration>& gpt3_175b_points() {
  static const std::vector<SweepConfiguration> points =
      expand_sweep(load_scenario_file(TRAINSIM_SOURCE_DIR "/tests/bench/sweep-gpt3-175b.yaml"));
  return points;
}

// One iteration: what a sweep worker does with the file's rows (evaluate_rows: four at a time,
// Predictor::evaluate_batch); the rows are rebuilt from the configurations between iterations,
// outside the timing (a sweep moves its configurations into them).
void BM_SweepFile_GPT3_175B(benchmark::State& state) {
  const auto& points = gpt3_175b_points();
  const SweepConstraints none;
  Predictor predictor;
  std::vector<SweepRow> rows;
  auto fresh_rows = [&] {
    rows.clear();
    for (const auto& p : points) rows.emplace_back(p);
  };
  fresh_rows();
  evaluate_rows(predictor, rows.data(), rows.size(), none);
  std::size_t simulated = 0;
  for (const auto& r : rows) simulated += r.simulated;
  for (auto _ : state) {
    state.PauseTiming();
    fresh_rows();
    state.ResumeTiming();
    evaluate_rows(predictor, rows.data(), rows.size(), none);
  }
  const double n = static_cast<double>(simulated);  // rows rejected before simulation do not count
  state.counters["configs"] = static_cast<double>(points.size());
  state.counters["evaluations_per_s"] = benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["s_per_evaluation"] =
      benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_SweepFile_GPT3_175B)->Unit(benchmark::kMillisecond);

// The same rows one at a time (evaluate_configuration, Predictor::evaluate): no lanes.
void BM_SweepFile_GPT3_175B_OneByOne(benchmark::State& state) {
  const auto& points = gpt3_175b_points();
  const SweepConstraints none;
  Predictor predictor;
  std::size_t simulated = 0;
  for (const auto& p : points) simulated += evaluate_configuration(predictor, p, none).simulated;
  for (auto _ : state)
    for (const auto& p : points) benchmark::DoNotOptimize(evaluate_configuration(predictor, p, none));
  const double n = static_cast<double>(simulated);
  state.counters["evaluations_per_s"] = benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["s_per_evaluation"] =
      benchmark::Counter(n, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_SweepFile_GPT3_175B_OneByOne)->Unit(benchmark::kMillisecond);

// One configuration of that file (a100-80gb, micro-batch 1: 64 micro-batches, 8,200 ops),
// three ways: the engine, compiling its schedule (once per schedule in a sweep) and the
// compiled program (every configuration after that).
Plan gpt3_175b_m64() { return Plan::from_config(gpt3_175b_points().front().config); }

void BM_GPT3_175B_m64_Engine(benchmark::State& state) {
  const Plan plan = gpt3_175b_m64();
  auto schedule = std::make_shared<const Schedule>(build_schedule(plan));
  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  Simulation sim;
  Timeline timeline;
  for (auto _ : state) sim.run(schedule, compute, p2p, collective, timeline, false);
  state.counters["ops"] = static_cast<double>(schedule->total_ops());
}
BENCHMARK(BM_GPT3_175B_m64_Engine)->Unit(benchmark::kMicrosecond);

void BM_GPT3_175B_m64_Compile(benchmark::State& state) {
  const Plan plan = gpt3_175b_m64();
  auto schedule = std::make_shared<const Schedule>(build_schedule(plan));
  StepProgram program;
  for (auto _ : state) benchmark::DoNotOptimize(program.compile(schedule, false));
  state.counters["instructions"] = static_cast<double>(program.num_instructions());
  state.counters["prices"] = static_cast<double>(program.num_prices());
}
BENCHMARK(BM_GPT3_175B_m64_Compile)->Unit(benchmark::kMicrosecond);

void BM_GPT3_175B_m64_Program(benchmark::State& state) {
  const Plan plan = gpt3_175b_m64();
  auto schedule = std::make_shared<const Schedule>(build_schedule(plan));
  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  StepProgram program;
  program.compile(schedule, false);
  Timeline timeline;
  for (auto _ : state) program.run(compute, p2p, collective, timeline);
}
BENCHMARK(BM_GPT3_175B_m64_Program)->Unit(benchmark::kMicrosecond);

// The same program for `lanes` configurations of the file at once (compute efficiencies
// 0.4, 0.45, ...): StepProgram::run_lanes, as a sweep runs a schedule's configurations.
void BM_GPT3_175B_m64_ProgramLanes(benchmark::State& state) {
  const int lanes = static_cast<int>(state.range(0));
  std::vector<Plan> plans;
  for (const auto& p : gpt3_175b_points())
    if (plans.size() < static_cast<std::size_t>(lanes) && p.config.training.micro_batch_size == 1 &&
        p.config.cluster.gpu == "a100-80gb" && (plans.empty() || p.config.cluster.compute_efficiency != plans.back().config.cluster.compute_efficiency))
      plans.push_back(Plan::from_config(p.config));
  auto schedule = std::make_shared<const Schedule>(build_schedule(plans[0]));
  std::vector<std::unique_ptr<RooflineComputeModel>> compute;
  std::vector<std::unique_ptr<LinkP2PModel>> p2p;
  std::vector<std::unique_ptr<NetworkCollectiveModel>> collective;
  std::vector<const RooflineComputeModel*> c;
  std::vector<const LinkP2PModel*> l;
  std::vector<const NetworkCollectiveModel*> k;
  std::vector<Timeline> timelines(plans.size());
  std::vector<Timeline*> out;
  for (std::size_t j = 0; j < plans.size(); ++j) {
    compute.push_back(std::make_unique<RooflineComputeModel>(plans[j]));
    p2p.push_back(std::make_unique<LinkP2PModel>(plans[j]));
    collective.push_back(std::make_unique<NetworkCollectiveModel>(plans[j]));
    c.push_back(compute.back().get());
    l.push_back(p2p.back().get());
    k.push_back(collective.back().get());
    out.push_back(&timelines[j]);
  }
  StepProgram program;
  program.compile(schedule, false);
  std::vector<StepFigures> figures(plans.size());
  std::vector<StepFigures*> figures_out;
  for (auto& f : figures) figures_out.push_back(&f);
  ResultWorkspace ws;
  const bool timeline = state.range(1) != 0;
  for (auto _ : state)
    if (timeline)
      program.run_lanes(c.data(), l.data(), k.data(), out.data(), static_cast<int>(plans.size()));
    else
      program.run_lanes_figures(c.data(), l.data(), k.data(), true, figures_out.data(), ws, static_cast<int>(plans.size()));
  state.counters["configurations_per_s"] =
      benchmark::Counter(static_cast<double>(plans.size()), benchmark::Counter::kIsIterationInvariantRate);
}
// (lanes, 1: Timelines written; 0: the Result's figures alone, what a sweep runs)
BENCHMARK(BM_GPT3_175B_m64_ProgramLanes)
    ->Args({1, 1})
    ->Args({4, 1})
    ->Args({1, 0})
    ->Args({4, 0})
    ->Unit(benchmark::kMicrosecond);

// The program's figures alone (StepProgram::run_figures, no Timeline): what replaced Program
// then Result for a configuration of a compiled schedule.
void BM_GPT3_175B_m64_Figures(benchmark::State& state) {
  const Plan plan = gpt3_175b_m64();
  auto schedule = std::make_shared<const Schedule>(build_schedule(plan));
  const RooflineComputeModel compute(plan);
  const LinkP2PModel p2p(plan);
  const NetworkCollectiveModel collective(plan);
  StepProgram program;
  program.compile(schedule, false);
  StepFigures figures;
  ResultWorkspace ws;
  for (auto _ : state) benchmark::DoNotOptimize(program.run_figures(compute, p2p, collective, true, figures, ws));
}
BENCHMARK(BM_GPT3_175B_m64_Figures)->Unit(benchmark::kMicrosecond);

// What turns that Timeline into the Result (core/metrics.cpp), and the memory walk.
void BM_GPT3_175B_m64_Result(benchmark::State& state) {
  const Plan plan = gpt3_175b_m64();
  const Prediction p = predict(plan);
  Result result;
  ResultWorkspace ws;
  for (auto _ : state) compute_result_into(plan, p.timeline, p.memory, result, ws);
}
BENCHMARK(BM_GPT3_175B_m64_Result)->Unit(benchmark::kMicrosecond);

// The same with the schedule's ResultIndex, as a sweep passes it.
void BM_GPT3_175B_m64_ResultIndexed(benchmark::State& state) {
  const Plan plan = gpt3_175b_m64();
  const Prediction p = predict(plan);
  Result result;
  ResultWorkspace ws;
  ResultIndex index;
  result_index_into(*p.schedule, index);
  for (auto _ : state) compute_result_into(plan, p.timeline, p.memory, result, ws, nullptr, &index);
}
BENCHMARK(BM_GPT3_175B_m64_ResultIndexed)->Unit(benchmark::kMicrosecond);

void BM_GPT3_175B_m64_Memory(benchmark::State& state) {
  const Plan plan = gpt3_175b_m64();
  const Schedule s = build_schedule(plan);
  for (auto _ : state) benchmark::DoNotOptimize(MemoryModel(plan).peak_per_rank(s));
}
BENCHMARK(BM_GPT3_175B_m64_Memory)->Unit(benchmark::kMicrosecond);

// Expanding the file's axes into its 2,016 configurations (run_sweep's first step).
void BM_SweepFile_GPT3_175B_Expand(benchmark::State& state) {
  const Scenario scenario = load_scenario_file(TRAINSIM_SOURCE_DIR "/tests/bench/sweep-gpt3-175b.yaml");
  for (auto _ : state) benchmark::DoNotOptimize(expand_sweep(scenario));
}
BENCHMARK(BM_SweepFile_GPT3_175B_Expand)->Unit(benchmark::kMillisecond);

// The whole sweep as `trainsim sweep FILE --threads 1` runs it after loading the file:
// expansion, evaluation, ranking.
void BM_SweepFile_GPT3_175B_RunSweep(benchmark::State& state) {
  const Scenario scenario = load_scenario_file(TRAINSIM_SOURCE_DIR "/tests/bench/sweep-gpt3-175b.yaml");
  SweepOptions options;
  options.threads = 1;
  std::size_t simulated = 0;
  for (const auto& r : run_sweep(scenario, options).rows) simulated += r.simulated;
  for (auto _ : state) benchmark::DoNotOptimize(run_sweep(scenario, options));
  state.counters["evaluations_per_s"] =
      benchmark::Counter(static_cast<double>(simulated), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_SweepFile_GPT3_175B_RunSweep)->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
