// `trainsim calibrate --backend cuda` (runtime/cuda/calibrate_cuda.h) on a real device: every
// kernel of the plan's inventory is timed (positive, finite, below the device's ceilings; the
// `round` pass the device does not have at exactly 0), composition and core factors are
// measured, the single-GPU world's table follows nccl-tests' definitions with every element
// exact, and the profile survives its YAML round trip. Tests that need a device skip
// (GTEST_SKIP) without one; the argument checks, which come before any device work, run
// everywhere. No timing assertions beyond physical ceilings: rates depend on the device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/kernel_inventory.h"
#include "cuda_test_helpers.h"
#include "kernels/device_buffer.h"
#include "kernels/device_info.h"
#include "runtime/cuda/calibrate_cuda.h"
#include "runtime/runtime_plan.h"
#include "tests/runtime/runtime_test_config.h"
#include "tests/runtime/comm_bench_checks.h"

namespace trainsim::runtime::cuda {
namespace {

namespace k = ::trainsim::cuda;
namespace fs = std::filesystem;

class CalibrateCuda : public ::testing::Test {
 protected:
  void SetUp() override { TRAINSIM_SKIP_WITHOUT_DEVICE(); }
};

// A tiny GPT of 4 layers in `compute`, dp x pp ranks, two micro-batches per replica.
RuntimePlan tiny(int dp, int pp, DType compute) {
  ScenarioConfig c = testing::tiny_plan(dp, pp, ScheduleKind::one_f_one_b, 1, 2 * dp, 4);
  c.precision.compute = compute;
  return make_runtime_plan(c);
}

// Three passes, nothing else: the kernels of a tiny plan in well under a second.
CalibrateOptions quick() {
  CalibrateOptions o;
  o.min_passes = o.max_passes = 3;
  o.min_seconds = 0;
  o.communication = false;
  o.precisions = {};
  o.comm.group_sizes = {2};
  o.comm.min_bytes = 8;
  o.comm.max_bytes = 2u << 20;
  o.comm.warmup_iters = 1;
  o.comm.iters = 3;
  return o;
}

// A ceiling on any matrix product's rate on this device: every SM at 3 GHz (above any shipping
// GPU's boost clock) doing the most dense FLOPs per clock of its architecture generation:
// 16-bit tensor cores (per SM per clock: V100 1024, A100 2048, H100 4096, B200 8192), or FP32
// on the CUDA cores (2 x 128 lanes), which gemm.h's fp32 products use.
double matmul_ceiling_flops(DType dt) {
  const CudaDevice d = query_cuda_devices().devices.at(0);
  const int major = d.compute_capability_major;
  const double tensor = major <= 7 ? 1024.0 : major == 8 ? 2048.0 : major == 9 ? 4096.0 : 8192.0;
  const double per_sm_clock = dt == DType::fp32 ? 256.0 : tensor;
  return d.multiprocessors * 3e9 * per_sm_clock;
}

// Memory-bound kernels may beat DRAM a little when their operands sit in L2 (the untimed launch
// before each timed one leaves them there), never by much at a tiny plan's sizes, where a
// launch's fixed cost dominates.
constexpr double kBandwidthSlack = 1.5;

const KernelRate* find_rate(const std::vector<KernelRate>& rates, const KernelWork& w) {
  for (const KernelRate& r : rates)
    if (r.kernel == w.kernel && r.dtype == w.dtype && r.shape == w.shape) return &r;
  return nullptr;
}

// Every kernel of `plan`'s inventory at the device's storage is in `rates`, timed: positive,
// finite and under the ceilings, except what the device does not do (round; commit when the
// products accumulate straight into fp32 gradients), at exactly 0.
void expect_inventory_timed(const RuntimePlan& plan, const std::vector<KernelRate>& rates) {
  const auto& pr = plan.plan.config.precision;
  const bool fast_grads = pr.compute == DType::fp32 && pr.grad_accumulation == DType::fp32;
  const double peak_bandwidth = k::device_memory_info(0).peak_bandwidth_bytes_per_s;
  const std::vector<KernelWork> inventory = distinct_kernels(plan.plan, plan.plan.activation_bytes());
  ASSERT_FALSE(inventory.empty());
  for (const KernelWork& w : inventory) {
    SCOPED_TRACE(w.kernel + " in " + std::string(dtype_name(w.dtype)));
    const KernelRate* r = find_rate(rates, w);
    ASSERT_NE(r, nullptr) << "not measured";
    EXPECT_EQ(r->bytes, w.bytes);
    ASSERT_TRUE(std::isfinite(r->seconds)) << r->seconds;
    if (w.kernel == "round" || (w.kernel == "commit" && fast_grads)) {
      EXPECT_EQ(r->seconds, 0.0);
      continue;
    }
    ASSERT_GT(r->seconds, 0.0);
    if (w.shape.is_matmul())
      EXPECT_LT(w.shape.flops() / r->seconds, matmul_ceiling_flops(w.dtype));
    else
      EXPECT_LT(w.bytes / r->seconds, kBandwidthSlack * peak_bandwidth);
  }
}

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------

TEST_F(CalibrateCuda, TimesEveryKernelOfTheInventory) {
  const RuntimePlan plan = tiny(1, 2, DType::bf16);  // embedding on one stage, head on the other
  CudaKernelCalibrator calibrator(plan, quick(), {});
  EXPECT_NE(calibrator.placement().find("2 ranks"), std::string::npos) << calibrator.placement();
  EXPECT_EQ(calibrator.num_kernels(), distinct_kernels(plan.plan, plan.plan.activation_bytes()).size());
  EXPECT_THROW(calibrator.rates(), std::logic_error);  // no pass yet
  calibrator.run_until_settled();
  EXPECT_EQ(calibrator.passes_done(), 3);
  const std::vector<KernelRate> rates = calibrator.rates();
  EXPECT_EQ(rates.size(), calibrator.num_kernels());
  expect_inventory_timed(plan, rates);
  for (const char* kernel : {"embedding.forward", "cross_entropy.backward", "attention.backward", "copy", "commit",
                             "adam", "zero"})
    EXPECT_TRUE(std::any_of(rates.begin(), rates.end(), [&](const KernelRate& r) { return r.kernel == kernel; }))
        << kernel;
  calibrator.run_passes(2);
  EXPECT_EQ(calibrator.passes_done(), 5);
}

TEST_F(CalibrateCuda, MeasuresCompositionAndEveryRanksFactor) {
  const RuntimePlan plan = tiny(2, 1, DType::fp16);
  CudaKernelCalibrator calibrator(plan, quick(), {});
  calibrator.run_until_settled();
  expect_inventory_timed(plan, calibrator.rates());
  const Composition c = calibrator.composition();
  EXPECT_TRUE(std::isfinite(c.forward) && c.forward > 0) << c.forward;
  EXPECT_TRUE(std::isfinite(c.backward) && c.backward > 0) << c.backward;
  const std::vector<double> factors = calibrator.core_factors();
  ASSERT_EQ(factors.size(), 2u);
  for (double f : factors) EXPECT_TRUE(std::isfinite(f) && f > 0) << f;
  // Both ranks' optimizer updates side by side against rank 0's alone, every pass.
  const std::vector<double> updates = calibrator.optimizer_core_factors(0, calibrator.passes_done());
  ASSERT_EQ(updates.size(), 2u);
  for (double f : updates) EXPECT_TRUE(std::isfinite(f) && f > 0) << f;
}

// A zero-bubble plan's backward runs as two passes, and each is timed against its own kernels
// (the weight pass has a composition of its own), as the CPU backend's calibration does.
TEST_F(CalibrateCuda, AZeroBubblePlansTwoBackwardPassesAreTimedApart) {
  ScenarioConfig c = testing::tiny_plan(1, 2, ScheduleKind::zb_h1, 1, 4, 4);
  c.precision.compute = DType::bf16;
  const RuntimePlan plan = make_runtime_plan(c);
  CudaKernelCalibrator calibrator(plan, quick(), {});
  calibrator.run_until_settled();
  const Composition zb = calibrator.composition();
  EXPECT_TRUE(std::isfinite(zb.backward) && zb.backward > 0) << zb.backward;
  EXPECT_TRUE(std::isfinite(zb.backward_weight) && zb.backward_weight > 0) << zb.backward_weight;

  c.parallelism.schedule = ScheduleKind::one_f_one_b;
  CudaKernelCalibrator whole(make_runtime_plan(c), quick(), {});
  whole.run_until_settled();
  EXPECT_EQ(whole.composition().backward_weight, 0.0);  // one pass: one composition for it
}

// The run places every tensor-parallel shard as a rank (its own green context): the calibration
// too, so a shard's kernels are timed on its share of the SMs and each shard has a factor.
TEST_F(CalibrateCuda, EveryTensorParallelShardIsARankAsTheRunPlacesIt) {
  ScenarioConfig c = testing::tiny_plan(1, 1, ScheduleKind::one_f_one_b, 1, 2, 4);
  c.precision.compute = DType::fp16;
  c.parallelism.tensor_parallel_size = 2;
  const RuntimePlan plan = make_runtime_plan(c);
  CudaKernelCalibrator calibrator(plan, quick(), {});
  calibrator.run_until_settled();
  EXPECT_EQ(calibrator.core_factors().size(), 2u);
  const HardwareProfile p = describe_cuda_profile(plan, "tp2", {});
  EXPECT_EQ(p.ranks_per_node, 2);
}

TEST_F(CalibrateCuda, OneRankInFp32HasNoFactorsAndNoSeparateCommit) {
  const RuntimePlan plan = make_runtime_plan(testing::tiny_training(1, 1, ScheduleKind::one_f_one_b));
  CudaKernelCalibrator calibrator(plan, quick(), {});
  calibrator.run_until_settled();
  expect_inventory_timed(plan, calibrator.rates());
  EXPECT_TRUE(calibrator.core_factors().empty());
  const Composition c = calibrator.composition();
  EXPECT_TRUE(std::isfinite(c.forward) && c.forward > 0) << c.forward;
  EXPECT_TRUE(std::isfinite(c.backward) && c.backward > 0) << c.backward;
}

TEST(CalibrateCudaArguments, RefusesFormatsTheKernelsDoNotStore) {
  // Refused before any device work: the same on machines without a GPU.
  const RuntimePlan plan = tiny(1, 1, DType::tf32);
  EXPECT_THROW(CudaKernelCalibrator(plan, quick(), {}), std::invalid_argument);
  try {
    calibrate_cuda(plan, "tf32", quick(), {});
    FAIL() << "tf32 compute accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("precision.compute is tf32"), std::string::npos) << e.what();
  }
}

TEST(CalibrateCudaArguments, WithoutADeviceSaysWhy) {
  std::string why;
  if (k::device_available(&why)) GTEST_SKIP() << "a CUDA device is present";
  try {
    CudaKernelCalibrator calibrator(tiny(1, 1, DType::bf16), quick(), {});
    FAIL() << "calibrated without a device";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a GPU: "), std::string::npos) << e.what();
  }
  EXPECT_THROW(bench_device_world_comm(quick().comm), std::runtime_error);
}

// ---------------------------------------------------------------------------------------
// The profile
// ---------------------------------------------------------------------------------------

TEST_F(CalibrateCuda, ProfileHoldsThePlansFormatsAndTheWorldsTables) {
  const RuntimePlan plan = tiny(2, 1, DType::bf16);
  CalibrateOptions o = quick();
  o.communication = true;
  o.precisions = {DType::fp32, DType::tf32, DType::fp16, DType::bf16};  // tf32: not stored, skipped
  std::vector<std::string> progress;
  o.progress = [&](const std::string& line) { progress.push_back(line); };
  CommBenchResult table;
  const HardwareProfile p = calibrate_cuda(plan, "gpu", o, {}, &table);

  EXPECT_EQ(progress.size(), 4u);  // bf16 (the plan's), fp32, fp16, communication
  const CudaDevice gpu = query_cuda_devices().devices.at(0);
  EXPECT_EQ(p.name, "gpu");
  EXPECT_EQ(p.backend, "cuda");
  EXPECT_FALSE(p.emulated_low_precision);
  EXPECT_EQ(p.ranks_per_node, 2);
  EXPECT_NE(p.device.find(gpu.name), std::string::npos) << p.device;
  EXPECT_NE(p.device.find(std::to_string(gpu.multiprocessors) + " SMs"), std::string::npos) << p.device;
  EXPECT_DOUBLE_EQ(p.memory_gib, gpu.memory_gib / 2);
  EXPECT_FALSE(p.measured.empty());
  EXPECT_TRUE(p.collectives_take_rank_core);  // the world's kernels run on the rank's own SMs

  for (DType d : {DType::bf16, DType::fp32, DType::fp16}) {
    SCOPED_TRACE(dtype_name(d));
    ScenarioConfig c = plan.plan.config;
    c.precision.compute = d;
    RuntimePlan other = plan;
    other.plan = Plan::from_config(c);
    expect_inventory_timed(other, p.kernels);
  }
  EXPECT_TRUE(
      std::none_of(p.kernels.begin(), p.kernels.end(), [](const KernelRate& r) { return r.dtype == DType::tf32; }));
  EXPECT_EQ(p.core_factors.size(), 2u);

  // 8 B .. 2 MiB doubling: 19 sendrecv rows, 19 all_reduce rows on 2 ranks; all exact.
  ASSERT_EQ(table.rows.size(), 2u * 19u);
  for (const CollectiveRow& r : table.rows) EXPECT_EQ(r.wrong, 0) << r.op << " " << r.bytes;
  EXPECT_EQ(p.p2p_table.rows.size(), 19u);
  ASSERT_EQ(p.allreduce_tables.count(2), 1u);
  EXPECT_EQ(p.allreduce_tables.at(2).rows.size(), 19u);
  EXPECT_EQ(p.p2p.latency_us, table.p2p.latency_us);
  EXPECT_GT(p.p2p.bandwidth_gbps, 0.0);
  ASSERT_EQ(p.allreduce.count(2), 1u);
  EXPECT_GT(p.allreduce.at(2).bandwidth_gbps, 0.0);
}

TEST_F(CalibrateCuda, ProfileRoundTripsThroughYaml) {
  CalibrateOptions o = quick();
  o.communication = true;
  o.comm.max_bytes = 64u << 10;
  const HardwareProfile p = calibrate_cuda(tiny(2, 1, DType::bf16), "gpu", o, {});
  const fs::path dir = fs::temp_directory_path() / "trainsim_cuda_profile_roundtrip";
  fs::create_directories(dir);
  std::ofstream(dir / "p.yaml") << profile_to_yaml(p);
  const HardwareProfile q = load_profile((dir / "p.yaml").string());
  fs::remove_all(dir);

  EXPECT_EQ(q.name, p.name);
  EXPECT_EQ(q.backend, "cuda");
  EXPECT_EQ(q.device, p.device);
  EXPECT_EQ(q.emulated_low_precision, false);
  EXPECT_EQ(q.ranks_per_node, p.ranks_per_node);
  ASSERT_EQ(q.kernels.size(), p.kernels.size());
  for (std::size_t i = 0; i < p.kernels.size(); ++i) {
    EXPECT_EQ(q.kernels[i].kernel, p.kernels[i].kernel);
    EXPECT_EQ(q.kernels[i].dtype, p.kernels[i].dtype);
    EXPECT_EQ(q.kernels[i].shape, p.kernels[i].shape);
    EXPECT_NEAR(q.kernels[i].seconds, p.kernels[i].seconds, 1e-9 * p.kernels[i].seconds + 1e-15);
  }
  EXPECT_NEAR(q.composition.forward, p.composition.forward, 1e-9 * p.composition.forward);
  EXPECT_NEAR(q.composition.backward, p.composition.backward, 1e-9 * p.composition.backward);
  ASSERT_EQ(q.core_factors.size(), p.core_factors.size());
  EXPECT_EQ(q.p2p_table.rows.size(), p.p2p_table.rows.size());
  ASSERT_EQ(q.allreduce.count(2), 1u);
  EXPECT_NEAR(q.allreduce.at(2).bandwidth_gbps, p.allreduce.at(2).bandwidth_gbps,
              1e-9 * p.allreduce.at(2).bandwidth_gbps);
}

// ---------------------------------------------------------------------------------------
// The single-GPU world's table
// ---------------------------------------------------------------------------------------

CommBenchOptions small_comm() {
  CommBenchOptions o;
  o.group_sizes = {2, 3};
  o.min_bytes = 8;
  o.max_bytes = 1u << 20;
  o.warmup_iters = 1;
  o.iters = 3;
  return o;
}


// The single-GPU world's all-gather and reduce-scatter as nccl-tests times them, each checked
// exactly in fp32 and bf16 (the world's own copies and ordered reduction, not its all-reduce).
TEST_F(CalibrateCuda, WorldGathersAndScattersAreExact) {
  for (DType wire : {DType::fp32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(wire));
    CommBenchOptions o;
    o.group_sizes = {2, 3};
    o.sendrecv = false;
    o.wire = wire;
    o.all_reduce_sizes = {8};
    o.iters = 2;
    o.warmup_iters = 1;
    const std::vector<std::size_t> listed = {100, 4096, 1u << 20};
    o.all_gather_sizes = listed;
    o.reduce_scatter_sizes = listed;
    const CommBenchResult r = bench_device_world_comm(o);
    testing::expect_half_ring_rows(r, o, listed, static_cast<int>(dtype_bytes(wire)));
  }
}

TEST_F(CalibrateCuda, WorldTableIsExactAndFollowsNcclTestsDefinitions) {
  CommBenchOptions o = small_comm();
  std::vector<CollectiveRow> streamed;
  o.on_row = [&](const CollectiveRow& row) { streamed.push_back(row); };
  const CommBenchResult r = bench_device_world_comm(o);

  // 8 B .. 1 MiB doubling: 18 sizes per section; sections: sendrecv, all_reduce on 2, on 3.
  constexpr std::size_t kSizes = 18;
  ASSERT_EQ(r.rows.size(), 3 * kSizes);
  testing::expect_rows_follow_the_definitions(r, o, 4);
  for (std::size_t i = 0; i < r.rows.size(); ++i) {
    EXPECT_EQ(r.rows[i].op, i < kSizes ? "sendrecv" : "all_reduce");
    if (i >= kSizes) {
      EXPECT_EQ(r.rows[i].ranks, i < 2 * kSizes ? 2 : 3);
    }
    EXPECT_EQ(r.rows[i].iters, 3);
    EXPECT_EQ(r.rows[i].warmup_iters, 1);
  }
  ASSERT_EQ(streamed.size(), r.rows.size());
  for (std::size_t i = 0; i < streamed.size(); ++i) EXPECT_EQ(streamed[i].time_us, r.rows[i].time_us);

  EXPECT_GE(r.p2p.latency_us, 0.0);
  // A fit is physical and loads back into a profile: a finite bandwidth, or 0 where the times
  // did not grow with size (no size term; on an H100 under load, all sizes of a small table).
  auto physical = [](double gbps) { return gbps == 0.0 || (gbps > 0.0 && std::isfinite(gbps)); };
  EXPECT_TRUE(physical(r.p2p.bandwidth_gbps)) << r.p2p.bandwidth_gbps;
  for (int n : {2, 3}) {
    ASSERT_EQ(r.allreduce.count(n), 1u) << n;
    EXPECT_GE(r.allreduce.at(n).latency_us, 0.0);
    EXPECT_TRUE(physical(r.allreduce.at(n).bandwidth_gbps)) << r.allreduce.at(n).bandwidth_gbps;
  }
  EXPECT_NE(format_comm_table(r).find("# Out of bounds values : 0 OK"), std::string::npos);
}

TEST_F(CalibrateCuda, LowPrecisionWiresAndMaxAreCheckedExactly) {
  for (DType wire : {DType::fp16, DType::bf16}) {
    SCOPED_TRACE(nccl_type_name(wire));
    CommBenchOptions o;
    o.group_sizes = {2, 5};
    o.min_bytes = 16;
    o.max_bytes = 64u << 10;
    o.warmup_iters = 0;
    o.iters = 2;
    o.wire = wire;
    o.sendrecv = false;
    o.redops = {ReduceOp::sum, ReduceOp::max};
    const CommBenchResult r = bench_device_world_comm(o);
    ASSERT_EQ(r.rows.size(), 2u * 2u * 13u);
    testing::expect_rows_follow_the_definitions(r, o, dtype_bytes(wire));
    for (const CollectiveRow& row : r.rows) EXPECT_EQ(row.type, nccl_type_name(wire));
    EXPECT_EQ(r.rows.front().redop, "sum");
    EXPECT_EQ(r.rows.back().redop, "max");
  }
}

TEST(CalibrateCudaArguments, WorldRefusesOptionsItCannotRun) {
  // Refused before any device work: the same on machines without a GPU.
  auto run = [](auto edit) {
    CommBenchOptions o = small_comm();
    edit(o);
    return bench_device_world_comm(o);
  };
  for (DType wire : {DType::tf32, DType::fp8}) {
    try {
      run([wire](CommBenchOptions& o) { o.wire = wire; });
      FAIL() << dtype_name(wire) << " wire accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("wire " + std::string(dtype_name(wire))), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(run([](CommBenchOptions& o) { o.group_sizes = {1}; }), std::invalid_argument);
  EXPECT_THROW(run([](CommBenchOptions& o) { o.group_sizes = {2, 2}; }), std::invalid_argument);
  EXPECT_THROW(run([](CommBenchOptions& o) { o.group_sizes = {65}; }), std::invalid_argument);
  EXPECT_THROW(run([](CommBenchOptions& o) { o.min_bytes = 2; }), std::invalid_argument);
  EXPECT_THROW(run([](CommBenchOptions& o) { o.max_bytes = 4; }), std::invalid_argument);
  EXPECT_THROW(run([](CommBenchOptions& o) { o.iters = 0; }), std::invalid_argument);
  EXPECT_THROW(run([](CommBenchOptions& o) { o.redops = {ReduceOp::sum, ReduceOp::sum}; }), std::invalid_argument);
}

TEST_F(CalibrateCuda, AFailingCallbackStopsTheWorldWithoutHanging) {
  CommBenchOptions o = small_comm();
  o.group_sizes = {3};
  int seen = 0;
  o.on_row = [&](const CollectiveRow& row) {
    if (row.op == "all_reduce" && ++seen == 2) throw std::runtime_error("disk full");
  };
  try {
    bench_device_world_comm(o);
    FAIL() << "the callback's exception was swallowed";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "disk full");
  }
}

}  // namespace
}  // namespace trainsim::runtime::cuda
