// The CUDA stage model (runtime/cuda/stage_model_cuda.h) against the CPU StageModel
// (runtime/model/stage_model.h), the reference: the same spec, the same seed (so identical master
// weights), the same fresh random tokens, inputs and output gradients (never zeros), the same
// call sequence; losses, activations and every gradient element compared. Every test that needs
// a device skips (GTEST_SKIP) when no CUDA device can be used, so the suite runs, and passes, on
// machines without a GPU.
//
// Tolerances. Both models compute the same function with the same roundings to the compute
// format at the same places; they differ only in the order of FP32 summation inside matrix
// products and row reductions (cuBLAS and the kernels vs Eigen).
//  * fp32: each such reduction has K <= max(N, C, F, V, T) = 128 terms here, so a relative error
//    of at most K u32 ~ 8e-6 of its sum of magnitudes (worst case; sqrt(K) u32 ~ 7e-7 typically),
//    and a gradient passes through ~20 of them (head, two blocks of ~8 products and reductions,
//    embedding). Cancellation (LayerNorm backward, bias sums) makes small elements relatively
//    worse, so the check is normwise per parameter: |gpu - cpu| <= 1e-4 * max(max|cpu| of that
//    parameter, 1e-2 * max|cpu| of all gradients) — about ten times the worst chain seen in the
//    kernels' own attention test (tests/kernels/test_kernels.cpp). The loss, a mean of 32
//    log-sum-exp terms of logits accurate to ~1e-6, is checked to 1e-5 relative; the forward
//    output of a stage, dominated by its input through the residual stream, to 1e-5 of its
//    largest value.
//  * fp16/bf16 (unit roundoff u = 2^-11 / 2^-8): a summation-order difference can flip one
//    rounding to the format, a change of one unit in the last place (<= 2u relative) of that
//    element; flips are rare (an fp32 difference of ~1e-6 relative against a spacing of 2u) and
//    dilute as they propagate, but the produced gradient itself is rounded to the format (one
//    possible flip per micro-batch, two micro-batches summed). So the gradient check is
//    normwise with 8u (bf16: 2^-5) of the same scale, the loss to 2u relative (bf16: 2^-7).
// A wrong index, stride, transpose or scale gives errors of order 1 of the scale, far above all
// of these.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <ostream>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

#include "kernels/device_buffer.h"
#include "kernels/kernels.h"
#include "runtime/comm/in_process.h"
#include "runtime/cuda/device_world.h"
#include "runtime/cuda/stage_model_cuda.h"
#include "runtime/model/stage_model.h"
#include "runtime/model/model_parallel.h"
#include "runtime/numerics/lowp.h"
#include "tests/runtime/stage_call_order.h"

namespace trainsim {
// Parameterised tests name their format instead of printing bytes.
void PrintTo(DType d, std::ostream* os) { *os << dtype_name(d); }
}  // namespace trainsim

namespace trainsim::runtime::cuda {
namespace {

namespace k = ::trainsim::cuda;

void skip_without_device() {
  std::string why;
  if (!k::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
}

class CudaStage : public ::testing::Test {
 protected:
  void SetUp() override { skip_without_device(); }
};

class CudaStageLowPrecision : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { skip_without_device(); }
};

// ---------------------------------------------------------------------------------------
// Shapes and data
// ---------------------------------------------------------------------------------------
constexpr int kMicroBatches = 2;
constexpr std::uint64_t kSeed = 7;

ModelDims small_dims(int num_layers) {
  ModelDims d;
  d.num_layers = num_layers;
  d.hidden_size = 32;  // C
  d.num_heads = 2;     // hs = 16
  d.seq_length = 16;   // T
  d.vocab_size = 64;   // V; F = 4C = 128
  return d;
}

StageSpec stage(const ModelDims& d, int first_layer, int num_layers, bool embedding, bool head, DType compute,
                DType grad_accumulation = DType::fp32) {
  StageSpec s;
  s.dims = d;
  s.first_layer = first_layer;
  s.num_layers = num_layers;
  s.has_embedding = embedding;
  s.has_head = head;
  s.compute = compute;
  s.grad_accumulation = grad_accumulation;
  s.micro_batch_size = 2;  // B; N = B * T = 32 rows
  return s;
}

struct Batch {
  std::vector<std::int32_t> tokens, targets;
};

Batch make_batch(const StageSpec& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::size_t n = static_cast<std::size_t>(s.micro_batch_size) * s.dims.seq_length;
  Batch b{std::vector<std::int32_t>(n), std::vector<std::int32_t>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    b.tokens[i] = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(s.dims.vocab_size));
    b.targets[i] = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(s.dims.vocab_size));
  }
  return b;
}

// Standard normal values times sd (fp32: stored as is by an fp32 stage).
std::vector<float> randn(std::size_t n, std::uint64_t seed, double sd) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, sd);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}

k::DeviceBuffer to_device(const std::vector<float>& v) {
  k::DeviceBuffer b(v.size() * sizeof(float));
  b.upload(v.data(), b.bytes());
  return b;
}

std::vector<float> to_host(const k::DeviceBuffer& b, std::size_t n) {
  std::vector<float> v(n);
  b.download(v.data(), n * sizeof(float));
  return v;
}

double max_abs(const float* v, std::size_t n) {
  double m = 0;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(v[i])));
  return m;
}

// ---------------------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------------------
// |got - ref| <= tol for every element; reports the count and the worst few.
void expect_close(const std::string& what, const std::vector<float>& got, const float* ref, std::size_t n,
                  double tol) {
  ASSERT_EQ(got.size(), n) << what;
  std::size_t bad = 0;
  double worst = 0;
  std::ostringstream first;
  for (std::size_t i = 0; i < n; ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    if (!(err <= tol)) {  // NaN fails too
      if (bad < 5) first << "\n  [" << i << "] gpu " << got[i] << " cpu " << ref[i] << " err " << err;
      ++bad;
    }
    if (!(err <= worst)) worst = err;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << n << " elements beyond " << tol << " (worst error "
                     << worst << ")" << first.str();
}

// Every parameter's gradient, normwise: tol = rel * max(max|cpu| of the parameter, 1e-2 * max|cpu|
// of all gradients) (see the tolerance note at the top).
void expect_gradients_match(StageModel& cpu, const CudaStageModel& gpu, double rel) {
  const std::vector<float> got = gpu.gradients_to_host();
  const std::span<float> ref = cpu.gradients();
  ASSERT_EQ(got.size(), ref.size());
  const double all = max_abs(ref.data(), ref.size());
  ASSERT_GT(all, 0.0) << "the CPU gradients are all zero: the test would check nothing";
  for (const ParamInfo& p : cpu.params()) {
    const double scale = std::max(max_abs(ref.data() + p.offset, p.size), 1e-2 * all);
    std::vector<float> part(got.begin() + static_cast<std::ptrdiff_t>(p.offset),
                            got.begin() + static_cast<std::ptrdiff_t>(p.offset + p.size));
    expect_close(p.name + " gradient", part, ref.data() + p.offset, p.size, rel * scale);
  }
}

// Both models built from one spec and seed: same parameter list, identical master weights.
void expect_same_start(StageModel& cpu, const CudaStageModel& gpu) {
  ASSERT_EQ(gpu.params().size(), cpu.params().size());
  for (std::size_t i = 0; i < cpu.params().size(); ++i) {
    EXPECT_EQ(gpu.params()[i].name, cpu.params()[i].name);
    EXPECT_EQ(gpu.params()[i].offset, cpu.params()[i].offset);
    EXPECT_EQ(gpu.params()[i].size, cpu.params()[i].size);
  }
  EXPECT_EQ(gpu.backward_units(), cpu.backward_units());
  const std::vector<float> w = gpu.master_weights_to_host();
  ASSERT_EQ(w.size(), cpu.master_weights().size());
  EXPECT_TRUE(std::equal(w.begin(), w.end(), cpu.master_weights().begin())) << "master weights differ after init";
}

// A whole pipeline in one stage (embedding, blocks, head): GPipe order over kMicroBatches
// micro-batches, gradients accumulated over both; returns the (cpu, gpu) losses.
void run_full_stage(StageModel& cpu, CudaStageModel& gpu, std::vector<float>& cpu_loss,
                    std::vector<float>& gpu_loss) {
  const float loss_gradient_scale = 1.0f / kMicroBatches;
  std::vector<Batch> batches;
  for (int mb = 0; mb < kMicroBatches; ++mb) batches.push_back(make_batch(cpu.spec(), 100 + mb));
  cpu.zero_gradients();
  gpu.zero_gradients();
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    const Batch& b = batches[static_cast<std::size_t>(mb)];
    cpu_loss.push_back(cpu.forward(mb, b.tokens.data(), b.targets.data(), nullptr, nullptr));
    gpu.forward(mb, b.tokens.data(), b.targets.data(), nullptr, nullptr);
  }
  gpu_loss = gpu.losses(kMicroBatches);  // every micro-batch's, read once the stream is idle
  EXPECT_GT(gpu.activation_bytes(), 0u);
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    cpu.backward_begin(mb, nullptr, loss_gradient_scale);
    gpu.backward_begin(mb, nullptr, loss_gradient_scale);
    for (int u = 0; u < cpu.backward_units(); ++u) {
      cpu.backward_unit(mb);
      gpu.backward_unit(mb);
    }
    cpu.backward_end(mb, nullptr);
    gpu.backward_end(mb, nullptr);
  }
  EXPECT_EQ(gpu.activation_bytes(), 0u);
}

// What reserve() set aside is all a step needs: GPipe order (every stash alive at once), then
// the backwards one at a time, allocate nothing more, and still match the CPU.
TEST_F(CudaStage, ReservedBuffersAreAllAStepAllocates) {
  const StageSpec spec = stage(small_dims(2), 0, 2, true, true, DType::bf16);
  StageModel cpu(spec);
  k::MemoryAccount account;
  k::AccountScope scope(&account);
  CudaStageModel gpu(spec);
  cpu.init(kSeed);
  gpu.init(kSeed);
  const std::size_t before = account.current();
  gpu.reserve(kMicroBatches, 1, 0, kMicroBatches);
  EXPECT_GT(account.current(), before) << "the stashes were made now";
  const std::size_t reserved = account.current();
  account.reset_peak();
  std::vector<float> cpu_loss, gpu_loss;
  run_full_stage(cpu, gpu, cpu_loss, gpu_loss);
  EXPECT_EQ(account.peak(), reserved) << "nothing allocated during the step";
  for (int mb = 0; mb < kMicroBatches; ++mb)
    EXPECT_NEAR(gpu_loss[mb], cpu_loss[mb], std::ldexp(1.0, -7) * std::fabs(cpu_loss[mb])) << "micro-batch " << mb;
}

// A stage that is only timed draws its weights on the device: finite, deviation 0.02, the same
// for a seed and others for another.
TEST_F(CudaStage, RandomizedForTimingDrawsItsWeightsBySeed) {
  const StageSpec spec = stage(small_dims(2), 0, 2, true, true, DType::bf16);
  CudaStageModel a(spec), b(spec);
  a.randomize_for_timing(3);
  b.randomize_for_timing(3);
  const std::vector<float> w = a.master_weights_to_host();
  EXPECT_EQ(w, b.master_weights_to_host());
  b.randomize_for_timing(4);
  EXPECT_NE(w, b.master_weights_to_host());
  double sq = 0;
  for (float x : w) {
    ASSERT_TRUE(std::isfinite(x));
    sq += double(x) * x;
  }
  EXPECT_NEAR(std::sqrt(sq / double(w.size())), 0.02, 0.002);
}

// ---------------------------------------------------------------------------------------
// (1) fp32, first and last stage in one: loss and every gradient element
// ---------------------------------------------------------------------------------------
TEST_F(CudaStage, Fp32WholeModelLossAndGradientsMatchTheCpu) {
  const StageSpec spec = stage(small_dims(2), 0, 2, true, true, DType::fp32);
  StageModel cpu(spec);
  CudaStageModel gpu(spec);
  cpu.init(kSeed);
  gpu.init(kSeed);
  expect_same_start(cpu, gpu);

  std::vector<float> cpu_loss, gpu_loss;
  run_full_stage(cpu, gpu, cpu_loss, gpu_loss);
  for (int mb = 0; mb < kMicroBatches; ++mb)
    EXPECT_NEAR(gpu_loss[mb], cpu_loss[mb], 1e-5 * std::fabs(cpu_loss[mb])) << "micro-batch " << mb;
  expect_gradients_match(cpu, gpu, 1e-4);
}

// ---------------------------------------------------------------------------------------
// (2) fp32, a middle stage (no embedding, no head): output activation, input gradient and the
// blocks' gradients, through device input/output pointers
// ---------------------------------------------------------------------------------------
// The tied token embedding, whose gradient the first and last stages sum (the schedule's
// embedding all-reduce), is the same parameter range as the CPU model's on every kind of stage:
// a last stage without the embedding once reported none, so it sent nothing to that all-reduce
// and the first stage waited for it until the timeout.
TEST_F(CudaStage, TiedEmbeddingIsTheCpusRangeOnEveryStage) {
  const ModelDims d = small_dims(4);
  ASSERT_TRUE(d.tied_embeddings);
  struct Kind {
    int first, layers;
    bool embedding, head;
  };
  for (const Kind& k : {Kind{0, 2, true, false}, Kind{2, 2, false, true}, Kind{1, 2, false, false},
                        Kind{0, 4, true, true}}) {
    SCOPED_TRACE("embedding " + std::to_string(k.embedding) + ", head " + std::to_string(k.head));
    const StageSpec spec = stage(d, k.first, k.layers, k.embedding, k.head, DType::fp32);
    const StageModel cpu(spec);
    const CudaStageModel gpu(spec);
    EXPECT_EQ(gpu.token_embedding().offset, cpu.token_embedding().offset);
    EXPECT_EQ(gpu.token_embedding().size, cpu.token_embedding().size);
    EXPECT_EQ(gpu.token_embedding().size > 0, k.embedding || k.head);
  }
}

TEST_F(CudaStage, Fp32MiddleStageOutputAndInputGradientMatchTheCpu) {
  const StageSpec spec = stage(small_dims(4), 1, 2, false, false, DType::fp32);
  StageModel cpu(spec);
  CudaStageModel gpu(spec);
  cpu.init(kSeed);
  gpu.init(kSeed);
  expect_same_start(cpu, gpu);
  ASSERT_EQ(gpu.activation_elements(), cpu.activation_elements());
  ASSERT_EQ(gpu.activation_format(), DType::fp32);
  const std::size_t n = cpu.activation_elements();

  cpu.zero_gradients();
  gpu.zero_gradients();
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    SCOPED_TRACE("micro-batch " + std::to_string(mb));
    const std::vector<float> input = randn(n, 200 + mb, 1.0), grad_output = randn(n, 300 + mb, 1e-2);
    std::vector<float> cpu_out(n), cpu_grad_in(n);
    EXPECT_EQ(cpu.forward(mb, nullptr, nullptr, input.data(), cpu_out.data()), 0.0f);
    const k::DeviceBuffer d_in = to_device(input), d_gout = to_device(grad_output);
    k::DeviceBuffer d_out(n * sizeof(float)), d_gin(n * sizeof(float));
    gpu.forward(mb, nullptr, nullptr, d_in.data(), d_out.data());
    k::synchronize();
    expect_close("stage output", to_host(d_out, n), cpu_out.data(), n, 1e-5 * max_abs(cpu_out.data(), n));

    cpu.backward_begin(mb, grad_output.data(), 1.0f);
    gpu.backward_begin(mb, d_gout.data(), 1.0f);
    for (int u = 0; u < cpu.backward_units(); ++u) {
      cpu.backward_unit(mb);
      gpu.backward_unit(mb);
    }
    cpu.backward_end(mb, cpu_grad_in.data());
    gpu.backward_end(mb, d_gin.data());
    k::synchronize();
    expect_close("stage input gradient", to_host(d_gin, n), cpu_grad_in.data(), n,
                 1e-4 * max_abs(cpu_grad_in.data(), n));
  }
  expect_gradients_match(cpu, gpu, 1e-4);
}

// ---------------------------------------------------------------------------------------
// (3) fp16 / bf16 compute, fp32 gradient accumulation
// ---------------------------------------------------------------------------------------
TEST_P(CudaStageLowPrecision, LossAndGradientsMatchTheCpuEmulation) {
  const DType dt = GetParam();
  const double u = unit_roundoff(dt);  // 2^-11 (fp16), 2^-8 (bf16)
  const StageSpec spec = stage(small_dims(2), 0, 2, true, true, dt, DType::fp32);
  StageModel cpu(spec);
  CudaStageModel gpu(spec);
  cpu.init(kSeed);
  gpu.init(kSeed);
  expect_same_start(cpu, gpu);

  std::vector<float> cpu_loss, gpu_loss;
  run_full_stage(cpu, gpu, cpu_loss, gpu_loss);
  for (int mb = 0; mb < kMicroBatches; ++mb)
    EXPECT_NEAR(gpu_loss[mb], cpu_loss[mb], 2 * u * std::fabs(cpu_loss[mb])) << "micro-batch " << mb;
  expect_gradients_match(cpu, gpu, 8 * u);
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& p) { return std::string(dtype_name(p.param)); }

INSTANTIATE_TEST_SUITE_P(Compute, CudaStageLowPrecision, ::testing::Values(DType::bf16, DType::fp16),
                         dtype_param_name);

// ---------------------------------------------------------------------------------------
// (4) Unit by unit: gradients_complete as the CPU reports it, and what it reports final is
// never touched again by the later units
// ---------------------------------------------------------------------------------------
TEST_F(CudaStage, UnitByUnitBackwardFinishesAPrefixOfTheGradients) {
  const StageSpec spec = stage(small_dims(2), 0, 2, true, true, DType::fp32);
  StageModel cpu(spec);
  CudaStageModel gpu(spec);
  cpu.init(kSeed);
  gpu.init(kSeed);
  const Batch b = make_batch(spec, 400);
  cpu.zero_gradients();
  gpu.zero_gradients();
  cpu.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr);
  gpu.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr);
  EXPECT_EQ(gpu.gradients_complete(0), 0u);
  cpu.backward_begin(0, nullptr, 1.0f);
  gpu.backward_begin(0, nullptr, 1.0f);
  EXPECT_EQ(gpu.gradients_complete(0), 0u);
  std::vector<std::size_t> complete;
  std::vector<std::vector<float>> snapshots;
  for (int u = 0; u < gpu.backward_units(); ++u) {
    cpu.backward_unit(0);
    gpu.backward_unit(0);
    complete.push_back(gpu.gradients_complete(0));
    EXPECT_EQ(complete.back(), cpu.gradients_complete(0)) << "unit " << u;
    snapshots.push_back(gpu.gradients_to_host());
  }
  ASSERT_FALSE(complete.empty());
  EXPECT_EQ(complete.back(), gpu.num_parameters());
  for (std::size_t u = 0; u < complete.size(); ++u)
    for (std::size_t i = 0; i < complete[u]; ++i)
      ASSERT_EQ(snapshots[u][i], snapshots.back()[i]) << "unit " << u << ", element " << i;
  cpu.backward_end(0, nullptr);
  gpu.backward_end(0, nullptr);
  EXPECT_EQ(gpu.gradients_complete(0), gpu.num_parameters());
  expect_gradients_match(cpu, gpu, 1e-4);
}

// A micro-batch's calls out of their order throw and change nothing, as on the CPU
// (tests/runtime/stage_call_order.h; both models keep their micro-batches with
// runtime/model/micro_batch_slots.h).
TEST_F(CudaStage, CallsOutOfOrderThrowAndChangeNothing) {
  const StageSpec spec = stage(small_dims(2), 0, 2, true, true, DType::fp32);
  CudaStageModel m(spec), clean(spec);
  for (CudaStageModel* g : {&m, &clean}) {
    g->init(kSeed);
    g->zero_gradients();
  }
  const Batch b = make_batch(spec, 410);
  testing::expect_calls_out_of_order_throw(m, clean, b.tokens.data(), b.targets.data(),
                                           [](const CudaStageModel& g) { return g.gradients_to_host(); });
}

// The zero-bubble split computes the same products in the same order as the whole backward,
// only at other times and into per-micro-batch buffers: gradients and the input gradient are
// the same bits. Two micro-batches are in flight between their input and weight passes, as in
// ZB-H1's steady state, so kept buffers must not be shared between them.
TEST_F(CudaStage, SplitBackwardGivesTheWholeBackwardsBits) {
  const StageSpec spec = stage(small_dims(4), 1, 2, false, false, DType::fp32);
  CudaStageModel whole(spec), split(spec);
  whole.init(kSeed);
  split.init(kSeed);
  whole.zero_gradients();
  split.zero_gradients();
  const std::size_t n = whole.activation_elements();
  std::vector<k::DeviceBuffer> inputs, douts;
  for (int mb = 0; mb < 2; ++mb) {
    inputs.push_back(to_device(randn(n, 500 + mb, 1.0)));
    douts.push_back(to_device(randn(n, 600 + mb, 1e-2)));
  }
  k::DeviceBuffer din_whole(n * sizeof(float)), din_split(n * sizeof(float));
  std::vector<std::vector<float>> whole_din, split_din;
  for (int mb = 0; mb < 2; ++mb) {
    whole.forward(mb, nullptr, nullptr, inputs[mb].data(), nullptr);
    split.forward(mb, nullptr, nullptr, inputs[mb].data(), nullptr);
  }
  for (int mb = 0; mb < 2; ++mb) {
    whole.backward_begin(mb, douts[mb].data(), 1.0f);
    for (int u = 0; u < whole.backward_units(); ++u) whole.backward_unit(mb);
    whole.backward_end(mb, din_whole.data());
    whole_din.push_back(to_host(din_whole, n));
    split.backward_input(mb, douts[mb].data(), 1.0f, din_split.data());
    split_din.push_back(to_host(din_split, n));
  }
  EXPECT_LT(split.gradients_complete(0), split.num_parameters()) << "no weight gradient before the weight pass";
  for (int mb = 0; mb < 2; ++mb) split.backward_weight(mb);
  EXPECT_EQ(whole_din, split_din);
  EXPECT_EQ(whole.gradients_to_host(), split.gradients_to_host());
  EXPECT_THROW(split.backward_weight(0), std::logic_error) << "its weight pass is done";
}

// The first n 16-bit elements of a device buffer, as bits.
std::vector<std::uint16_t> bits16(const k::DeviceBuffer& b, std::size_t n) {
  std::vector<std::uint16_t> v(n);
  b.download(v.data(), n * sizeof(std::uint16_t));
  return v;
}

// Micro-batch 0's backward into `din`: split (the input pass, then the weight pass) or whole (unit
// by unit).
void backward_of_first(CudaStageModel& m, const void* dout, void* din, bool split) {
  if (split) {
    m.backward_input(0, dout, 1.0f, din);
    m.backward_weight(0);
  } else {
    m.backward_begin(0, dout, 1.0f);
    for (int u = 0; u < m.backward_units(); ++u) m.backward_unit(0);
    m.backward_end(0, din);
  }
}

// Recompute (selective, selective_op, full) rebuilds in the backward what the forward made, with
// the same kernels: gradients bitwise those of keeping everything, whole and split; the stash is
// smaller: selective keeps no softmax outputs, selective_op only each block's input, qkv, att and
// fc, full only the inputs (this middle stage's output, passed on, is kept by neither of the last).
TEST_F(CudaStage, RecomputeGivesTheSameBitsWithLessStashed) {
  std::map<Recompute, std::size_t> stashed, workspace;
  for (const Recompute r : {Recompute::selective, Recompute::selective_op, Recompute::full})
    for (const bool split_backward : {false, true}) {
      SCOPED_TRACE(::testing::Message() << recompute_name(r) << (split_backward ? " split" : " whole"));
      StageSpec spec = stage(small_dims(4), 1, 2, false, false, DType::bf16);
      CudaStageModel kept(spec);
      spec.recompute = r;
      CudaStageModel redo(spec);
      kept.reserve(1, 1, 1, 0);
      redo.reserve(1, 1, 1, 0);
      kept.init(kSeed);
      redo.init(kSeed);
      kept.zero_gradients();
      redo.zero_gradients();
      const std::size_t n = kept.activation_elements();
      const k::DeviceBuffer input = to_device(randn(n, 700, 1.0)), dout = to_device(randn(n, 701, 1e-2));
      k::DeviceBuffer in16(n * 2), dout16(n * 2), din_kept(n * 2), din_redo(n * 2);
      k::cast(in16.data(), DType::bf16, input.data(), DType::fp32, n, nullptr);
      k::cast(dout16.data(), DType::bf16, dout.data(), DType::fp32, n, nullptr);
      for (CudaStageModel* m : {&kept, &redo}) m->forward(0, nullptr, nullptr, in16.data(), nullptr);
      EXPECT_LT(redo.activation_bytes(), kept.activation_bytes());
      stashed[r] = redo.activation_bytes();
      workspace[r] = redo.backward_workspace_bytes();
      for (CudaStageModel* m : {&kept, &redo})
        backward_of_first(*m, dout16.data(), m == &kept ? din_kept.data() : din_redo.data(), split_backward);
      EXPECT_EQ(kept.gradients_to_host(), redo.gradients_to_host());
      k::synchronize();
      EXPECT_EQ(bits16(din_kept, n), bits16(din_redo, n)) << "input gradient";
    }
  EXPECT_LT(stashed[Recompute::full], stashed[Recompute::selective_op]);
  EXPECT_LT(stashed[Recompute::selective_op], stashed[Recompute::selective]);
  // bf16 elements of the two blocks' (N = 32 rows, C = 32, F = 128, 2 heads, T = 16).
  const std::size_t N = 32, C = 32, F = 128, probs = 2 * 2 * 16 * 16, blocks = 2, eb = 2;
  EXPECT_EQ(stashed[Recompute::selective_op], blocks * (N * C + 3 * N * C + N * C + N * F) * eb)
      << "each block's input, qkv, att and fc";
  EXPECT_EQ(workspace[Recompute::selective_op], (3 * N * C + N * F + probs + N * C) * eb + 4 * N * sizeof(float))
      << "ln1, x1, ln2, gelu, the softmax output and the stage's output; the norms' statistics";
}

// Full recompute of the stage's first block alone (StageSpec::recompute_blocks, from
// training.recompute_num_layers): the same bits as keeping everything, whole and split, and a stash
// strictly between every block recomputed and none.
TEST_F(CudaStage, RecomputingTheFirstBlockAloneGivesTheSameBits) {
  for (const bool split_backward : {false, true}) {
    SCOPED_TRACE(split_backward ? "split" : "whole");
    StageSpec spec = stage(small_dims(4), 1, 2, false, false, DType::bf16);
    CudaStageModel kept(spec);
    spec.recompute = Recompute::full;
    CudaStageModel all(spec);
    spec.recompute_blocks = 1;
    CudaStageModel first(spec);
    std::vector<CudaStageModel*> models{&kept, &all, &first};
    for (CudaStageModel* m : models) {
      m->reserve(1, 1, 1, 0);
      m->init(kSeed);
      m->zero_gradients();
    }
    const std::size_t n = kept.activation_elements();
    const k::DeviceBuffer input = to_device(randn(n, 710, 1.0)), dout = to_device(randn(n, 711, 1e-2));
    k::DeviceBuffer in16(n * 2), dout16(n * 2);
    k::cast(in16.data(), DType::bf16, input.data(), DType::fp32, n, nullptr);
    k::cast(dout16.data(), DType::bf16, dout.data(), DType::fp32, n, nullptr);
    for (CudaStageModel* m : models) m->forward(0, nullptr, nullptr, in16.data(), nullptr);
    EXPECT_LT(all.activation_bytes(), first.activation_bytes());
    EXPECT_LT(first.activation_bytes(), kept.activation_bytes());
    std::vector<k::DeviceBuffer> din;
    for (CudaStageModel* m : models) {
      din.emplace_back(n * 2);
      backward_of_first(*m, dout16.data(), din.back().data(), split_backward);
    }
    EXPECT_EQ(kept.gradients_to_host(), first.gradients_to_host());
    k::synchronize();
    EXPECT_EQ(bits16(din[0], n), bits16(din[2], n)) << "input gradient";
  }
}

// ---------------------------------------------------------------------------------------
// Without a device: specs are refused before the device is touched
// ---------------------------------------------------------------------------------------
TEST(CudaStageModelWithoutDevice, RefusesFormatsTheKernelsDoNotStoreAndBadSpecs) {
  auto build = [](const StageSpec& s) { CudaStageModel m(s); };
  const ModelDims d = small_dims(2);
  EXPECT_THROW(build(stage(d, 0, 2, true, true, DType::tf32)), std::invalid_argument);
  EXPECT_THROW(build(stage(d, 0, 2, true, true, DType::fp32, DType::fp8)), std::invalid_argument);
  ModelDims odd = d;
  odd.num_heads = 3;  // 32 is not a multiple of 3
  EXPECT_THROW(build(stage(odd, 0, 2, true, true, DType::fp32)), std::invalid_argument);
  EXPECT_THROW(build(stage(d, 1, 2, false, false, DType::fp32)), std::invalid_argument);  // blocks 1..2 of 2
}

// ---------------------------------------------------------------------------------------
// Tensor (and sequence) parallelism: two shards of a whole-model stage, each on its own host
// thread and stream with the single-GPU world as its group, against the CPU's two shards on the
// in-process ring. Same tolerances as the whole stage in fp32: a shard's sums differ from the
// CPU shard's in the same places (products, row reductions), and the group's sums are the same
// ring in the same order on both (device_world.h).
// ---------------------------------------------------------------------------------------
// Each recompute mode too: a shard's rebuild runs its row-parallel reduction again, which must
// meet the other shard's (the CPU shards recompute bitwise as they keep everything,
// test_model.cpp).
class CudaStageTensorParallel : public ::testing::TestWithParam<std::tuple<bool, Recompute>> {
 protected:
  void SetUp() override { skip_without_device(); }
};

struct ShardResult {
  std::vector<float> loss, gradients;
  std::vector<ParamInfo> params;
};

TEST_P(CudaStageTensorParallel, ShardsMatchTheCpuShards) {
  const auto [sp, recompute] = GetParam();
  constexpr int tp = 2;
  StageSpec spec = stage(small_dims(2), 0, 2, true, true, DType::fp32);
  spec.tensor_parallel_size = tp;
  spec.sequence_parallel = sp;
  spec.recompute = recompute;
  std::vector<Batch> batches;
  for (int mb = 0; mb < kMicroBatches; ++mb) batches.push_back(make_batch(spec, 100 + mb));
  const float scale = 1.0f / kMicroBatches;

  // Each shard on its own thread (its group's collectives wait for the others), backward after
  // every forward (GPipe order), gradients accumulated over both micro-batches.
  auto on_shards = [&](auto&& body) {
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r) threads.emplace_back(body, r);
    for (auto& t : threads) t.join();
  };
  auto shard = [&](int r) {
    StageSpec mine = spec;
    mine.tensor_parallel_rank = r;
    return mine;
  };
  auto backward_all = [&](auto& model) {
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      model.backward_begin(mb, nullptr, scale);
      for (int u = 0; u < model.backward_units(); ++u) model.backward_unit(mb);
      model.backward_end(mb, nullptr);
    }
  };
  std::vector<ShardResult> cpu(tp), gpu(tp);
  InProcessWorld cpu_world(tp);
  on_shards([&](int r) {
    auto comm = cpu_world.communicator(r);
    CommunicatorGroup group(*comm, {0, 1});
    group.restart(1);
    StageModel m(shard(r));
    m.set_tensor_parallel_group(&group);
    m.init(kSeed);
    for (int mb = 0; mb < kMicroBatches; ++mb)
      cpu[r].loss.push_back(m.forward(mb, batches[mb].tokens.data(), batches[mb].targets.data(), nullptr, nullptr));
    backward_all(m);
    cpu[r].gradients.assign(m.gradients().begin(), m.gradients().end());
    cpu[r].params = m.params();
  });
  DeviceWorld gpu_world(tp);
  on_shards([&](int r) {
    k::Stream stream;
    auto comm = gpu_world.communicator(r);
    DeviceCommunicatorGroup group(*comm, {0, 1});
    group.restart(1);
    CudaStageModel m(shard(r), stream.get());
    m.set_tensor_parallel_group(&group);
    m.init(kSeed);
    m.zero_gradients();
    for (int mb = 0; mb < kMicroBatches; ++mb)
      m.forward(mb, batches[mb].tokens.data(), batches[mb].targets.data(), nullptr, nullptr);
    gpu[r].loss = m.losses(kMicroBatches);
    backward_all(m);
    gpu[r].gradients = m.gradients_to_host();
  });
  for (int r = 0; r < tp; ++r) {
    SCOPED_TRACE("shard " + std::to_string(r));
    for (int mb = 0; mb < kMicroBatches; ++mb)
      EXPECT_NEAR(gpu[r].loss[mb], cpu[r].loss[mb], 1e-5 * std::fabs(cpu[r].loss[mb])) << "micro-batch " << mb;
    const std::vector<float>& ref = cpu[r].gradients;
    ASSERT_EQ(gpu[r].gradients.size(), ref.size());
    const double all = max_abs(ref.data(), ref.size());
    for (const ParamInfo& p : cpu[r].params) {
      const double tol = 1e-4 * std::max(max_abs(ref.data() + p.offset, p.size), 1e-2 * all);
      const std::vector<float> part(gpu[r].gradients.begin() + static_cast<std::ptrdiff_t>(p.offset),
                                    gpu[r].gradients.begin() + static_cast<std::ptrdiff_t>(p.offset + p.size));
      expect_close(p.name + " gradient", part, ref.data() + p.offset, p.size, tol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SequenceParallelAndRecompute, CudaStageTensorParallel,
                         ::testing::Combine(::testing::Values(false, true),
                                            ::testing::Values(Recompute::none, Recompute::selective,
                                                              Recompute::selective_op, Recompute::full)),
                         [](const ::testing::TestParamInfo<std::tuple<bool, Recompute>>& i) {
                           return std::string(std::get<0>(i.param) ? "sp_" : "tp_only_") +
                                  std::string(recompute_name(std::get<1>(i.param)));
                         });

}  // namespace
}  // namespace trainsim::runtime::cuda
