// The CPU backend's speed (see docs/performance.md, "CPU runtime"):
//  * matrix-product throughput at the runtime model's shapes, one thread, the runtime's own
//    product (runtime/model/matmul.h) beside Eigen's, per CPU second, with the core's nominal
//    peak (FMA lanes x 2 FLOPs x clock, read from the CPU) as a counter;
//  * one whole training step of a single rank, tokens/s (the PyTorch comparison is
//    scripts/bench-vs-pytorch).
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
#include <string>

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

// A whole optimizer step of one rank (tests/bench/cpu-step.yaml's model, FP32 and BF16).
void training_step(benchmark::State& state, DType compute) {
  ScenarioConfig c;
  c.cluster.num_gpus = 1;
  c.parallelism.schedule = ScheduleKind::one_f_one_b;
  c.training.micro_batch_size = 8;
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
  double tokens_per_s = 0;
  for (auto _ : state) {
    const auto report = runtime::run_cpu(rp, opt);
    tokens_per_s = report.result.tokens_per_s;
  }
  state.counters["tokens_per_s"] = tokens_per_s;  // of the median measured step
}
void BM_TrainingStep_fp32(benchmark::State& state) { training_step(state, DType::fp32); }
void BM_TrainingStep_bf16(benchmark::State& state) { training_step(state, DType::bf16); }
BENCHMARK(BM_TrainingStep_fp32)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(BM_TrainingStep_bf16)->Unit(benchmark::kMillisecond)->Iterations(2);

}  // namespace
