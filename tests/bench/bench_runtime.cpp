// The CPU backend's speed (see docs/performance.md, "CPU runtime"):
//  * matrix-product throughput at the runtime model's shapes, one thread, the runtime's own
//    product (runtime/model/matmul.h) beside Eigen's, per CPU second, with the core's nominal
//    peak (FMA lanes x 2 FLOPs x clock, read from the CPU) as a counter;
//  * one whole training step of a single rank, tokens/s (the PyTorch comparison is
//    scripts/bench-vs-pytorch);
//  * the same step as two tensor-parallel shards (with and without sequence parallelism) and as
//    two data-parallel replicas, each of the two rank threads pinned to its own core, against
//    the one rank: the same model, batch and total work on the same machine.
//
//   build/tests/bench/bench_runtime --benchmark_min_time=0.5
#include <benchmark/benchmark.h>

// GCC 12 warns "may be used uninitialized" inside its own AVX-512 intrinsics when Eigen's
// random fill and product kernels are inlined; a false positive in system code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Dense>
#pragma GCC diagnostic pop
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/in_process.h"
#include "runtime/cpu/cpu_engine.h"
#include "runtime/model/matmul.h"
#include "runtime/runtime_plan.h"
#include "runtime/numerics/lowp.h"

namespace {

using namespace trainsim;
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// FP32 FLOPs per cycle of one core: two FMA units of the widest vectors the build uses.
double flops_per_cycle() {
#if defined(__AVX512F__)
  return 2 * 16 * 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return 2 * 8 * 2;
#else
  return 2 * 4;
#endif
}

// The clock the kernel reports in /proc/cpuinfo (nominal; turbo can exceed it).
double cpu_hz() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("cpu MHz", 0) == 0) return std::stod(line.substr(line.find(':') + 1)) * 1e6;
  return 0;
}

// The model's linear layers at their shapes, m = N tokens, k = in, n = out, one thread, through
// the product the runtime uses (runtime/model/matmul.h) and, for comparison, Eigen's: arg 3 picks
// the layout (0: forward y = x w^T; 1: input gradient dx = dy w; 2: weight gradient dw += dy^T x)
// and arg 4 the implementation (0: matmul::sgemm, 1: Eigen).
void BM_Gemm(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), k = static_cast<int>(state.range(1)),
            n = static_cast<int>(state.range(2)), layout = static_cast<int>(state.range(3));
  const bool eigen = state.range(4) != 0;
  RowMatrix x = RowMatrix::Random(m, k), w = RowMatrix::Random(n, k), y(m, n), dy = RowMatrix::Random(m, n),
            dx(m, k), dw = RowMatrix::Zero(n, k);
  for (auto _ : state) {
    if (layout == 0) {
      if (eigen) y.noalias() = x * w.transpose();
      else runtime::matmul::sgemm(false, true, m, n, k, 1.0f, x.data(), k, w.data(), k, 0.0f, y.data(), n);
      benchmark::DoNotOptimize(y.data());
    } else if (layout == 1) {
      if (eigen) dx.noalias() = dy * w;
      else runtime::matmul::sgemm(false, false, m, k, n, 1.0f, dy.data(), n, w.data(), k, 0.0f, dx.data(), k);
      benchmark::DoNotOptimize(dx.data());
    } else {
      if (eigen) dw.noalias() += dy.transpose() * x;
      else runtime::matmul::sgemm(true, false, n, k, m, 1.0f, dy.data(), n, x.data(), k, 1.0f, dw.data(), k);
      benchmark::DoNotOptimize(dw.data());
    }
  }
  const double flops = 2.0 * m * k * n;
  state.counters["gflops"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  const double peak = flops_per_cycle() * cpu_hz();
  state.counters["peak_gflops"] = peak * 1e-9;
  state.counters["flops"] = flops;
  state.SetLabel(std::string(layout == 0 ? "forward" : layout == 1 ? "input grad" : "weight grad") +
                 (eigen ? ", Eigen" : ", matmul"));
}
// Tokens N = micro-batch 8 x seq 128; hidden 256: qkv, attention output, MLP up and down.
BENCHMARK(BM_Gemm)
    ->ArgsProduct({{1024}, {256}, {768, 256, 1024}, {0, 1, 2}, {0, 1}})
    ->ArgsProduct({{1024}, {1024}, {256}, {0, 1, 2}, {0, 1}})
    ->MeasureProcessCPUTime()
    ->Unit(benchmark::kMicrosecond);

// Rounding a tensor to a low-precision format, per element.
void BM_RoundToFp16(benchmark::State& state) {
  std::vector<float> x(1 << 16);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.37f - 9000.0f;
  for (auto _ : state) {
    runtime::round_inplace(DType::fp16, x);
    benchmark::DoNotOptimize(x.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(x.size()));
}
BENCHMARK(BM_RoundToFp16);

// A whole optimizer step (tests/bench/cpu-step.yaml's model, FP32 and BF16) of one rank, or of
// `tp` tensor-parallel shards, or of `dp` replicas (micro-batches of 8 / dp samples).
void training_step(benchmark::State& state, DType compute, int tp = 1, bool sp = false, int dp = 1) {
  ScenarioConfig c;
  c.cluster.num_gpus = tp * dp;
  c.cluster.gpus_per_node = tp * dp;
  c.parallelism.schedule = ScheduleKind::one_f_one_b;
  c.parallelism.tensor_parallel_size = tp;
  c.parallelism.sequence_parallel = sp;
  c.parallelism.data_parallel_size = dp;
  c.training.micro_batch_size = 8 / dp;
  c.training.global_batch_size = 8;
  c.training.optimizer = Optimizer::adamw;
  c.precision.compute = compute;
  c.precision.loss_scaling.mode = LossScalingMode::none;
  c.runtime = RuntimeConfig{};
  c.runtime.num_layers = 8;
  c.runtime.hidden_size = 256;
  c.runtime.num_attention_heads = 8;
  c.runtime.seq_length = 128;
  c.runtime.vocab_size = 256;
  c.runtime.data_synthetic = true;
  const auto rp = runtime::make_runtime_plan(c);
  runtime::RunOptions opt;
  opt.synthetic_data = true;
  opt.steps = 3;
  double tokens_per_s = 0, step_s = 0;
  for (auto _ : state) {
    const auto report = runtime::run_cpu(rp, opt);
    tokens_per_s = report.result.tokens_per_s;
    step_s = report.result.step_time_s;
  }
  state.counters["tokens_per_s"] = tokens_per_s;  // of the median measured step
  state.counters["step_ms"] = 1e3 * step_s;
}
void BM_TrainingStep_fp32(benchmark::State& state) { training_step(state, DType::fp32); }
void BM_TrainingStep_bf16(benchmark::State& state) { training_step(state, DType::bf16); }
BENCHMARK(BM_TrainingStep_fp32)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(BM_TrainingStep_bf16)->Unit(benchmark::kMillisecond)->Iterations(2);

// The same step on two cores: tensor parallelism (each shard does half of every product and
// exchanges two activations per layer each way), with sequence parallelism, and data parallelism.
void BM_TwoCoreStep_tp2(benchmark::State& state) { training_step(state, DType::fp32, 2); }
void BM_TwoCoreStep_tp2_sp(benchmark::State& state) { training_step(state, DType::fp32, 2, true); }
void BM_TwoCoreStep_dp2(benchmark::State& state) { training_step(state, DType::fp32, 1, false, 2); }
BENCHMARK(BM_TwoCoreStep_tp2)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(BM_TwoCoreStep_tp2_sp)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(BM_TwoCoreStep_dp2)->Unit(benchmark::kMillisecond)->Iterations(2);

// One all-reduce of N floats over n rank threads of the in-process communicator, threads that
// sleep at once when they wait (as ranks that share cores do), per call on rank 0. A call whose
// member receives at most 1024 elements from the others, (n-1) x N, goes direct (one wait),
// a larger one round the ring (2(n-1) waits in a row, runtime/comm/in_process.cpp): on 8
// members 128 and 256 elements fall either side of the switch, on 2 members 1024 and 1025.
void BM_SmallAllReduce(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const auto size = static_cast<std::size_t>(state.range(1));
  constexpr int kCalls = 200;
  runtime::InProcessWorld world(n);
  std::vector<std::unique_ptr<runtime::Communicator>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(world.communicator(r));
  std::vector<int> members(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) members[static_cast<std::size_t>(r)] = r;
  std::uint64_t tag = 0;
  for (auto _ : state) {
    std::vector<std::thread> others;
    auto calls = [&](int r, std::uint64_t first) {
      std::vector<float> v(size, 1.0f);
      for (int i = 0; i < kCalls; ++i)
        comms[static_cast<std::size_t>(r)]->all_reduce(v, members, first + static_cast<std::uint64_t>(i),
                                                       runtime::ReduceOp::sum, DType::fp32, runtime::Divide::none);
    };
    for (int r = 1; r < n; ++r) others.emplace_back(calls, r, tag);
    calls(0, tag);
    for (auto& t : others) t.join();
    tag += kCalls;
  }
  state.SetItemsProcessed(state.iterations() * kCalls);
  state.counters["us_per_call"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kCalls,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_SmallAllReduce)
    ->ArgsProduct({{2, 8}, {1, 64, 128, 256, 1024, 1025}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
