// The CUDA executor (runtime/cuda/cuda_engine.h) against the CPU engine, the reference: the
// same plan, seed and data must train the same model.
//
// Tolerances. Both backends start from identical weights and compute the same function with the
// same roundings; they differ in the order of FP32 summation inside matrix products and
// reductions (tests/cuda/test_stage_model_cuda.cpp derives 1e-5 relative for a stage's loss).
//  * fp32: the first step's loss to 1e-5 relative; after Adam steps (lr 3e-3; an update of
//    ~lr per weight whatever the gradient's size, so gradient differences of ~1e-4 relative
//    move weights by ~1e-4 lr) the loss to 1e-4 relative over three steps;
//  * bf16 (u = 2^-8): one rounding flip per tensor changes a loss by O(u) relative; three steps,
//    2^-5 relative.
// A wrong stream dependency (a collective reading gradients before the backward wrote them, a
// receive before the send) or a wrong bucket gives errors of order one, far above these.
#include <gtest/gtest.h>

#include <chrono>

#include <cmath>
#include <filesystem>
#include <map>

#include "core/metrics.h"
#include "cuda_test_helpers.h"
#include "runtime/cuda/cuda_engine.h"
#include "runtime/cpu/cpu_engine.h"
#include "runtime/runtime_plan.h"
#include "tests/runtime/replay_expectations.h"
#include "tests/runtime/runtime_test_config.h"

namespace trainsim::runtime::cuda {
namespace {

// Wider than the CPU tests' model (hidden 64, 4 heads, 32 tokens), two samples per micro-batch.
ScenarioConfig small_config(int dp, int pp, ScheduleKind schedule, int vpp = 1) {
  ScenarioConfig c = testing::tiny_training(dp, pp, schedule, vpp);
  c.training.micro_batch_size = 2;
  c.training.global_batch_size = 16;
  c.runtime.hidden_size = 64;
  c.runtime.num_attention_heads = 4;
  c.runtime.seq_length = 32;
  c.runtime.vocab_size = 96;
  c.runtime.seed = 11;
  return c;
}

RunOptions options() {
  RunOptions o;
  o.synthetic_data = true;
  o.pin_threads = false;
  return o;
}

RunReport on_cpu(const ScenarioConfig& c) { return run_cpu(make_runtime_plan(c), options()); }
RunReport on_gpu(const ScenarioConfig& c, SmSharing sharing = SmSharing::automatic) {
  CudaRunOptions cuda;
  cuda.sm_sharing = sharing;
  return run_cuda(make_runtime_plan(c), options(), cuda);
}

void expect_tracks(const RunReport& cpu, const RunReport& gpu, double first_tol, double later_tol) {
  ASSERT_FALSE(cpu.failure) << cpu.failure->message;
  ASSERT_FALSE(gpu.failure) << gpu.failure->message;
  ASSERT_EQ(cpu.steps.size(), gpu.steps.size());
  for (std::size_t i = 0; i < cpu.steps.size(); ++i) {
    const double tol = i == 0 ? first_tol : later_tol;
    EXPECT_NEAR(gpu.steps[i].loss, cpu.steps[i].loss, tol * std::fabs(cpu.steps[i].loss)) << "step " << i + 1;
    EXPECT_NEAR(gpu.steps[i].grad_norm, cpu.steps[i].grad_norm, 10 * tol * cpu.steps[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_LT(gpu.steps.back().loss, gpu.steps.front().loss) << "and it trains";
}

TEST(CudaExecutor, RefusesWhatItCannotRunBeforeTouchingTheDevice) {
  ScenarioConfig tf32_wire = small_config(1, 1, ScheduleKind::one_f_one_b);
  tf32_wire.precision.allreduce = DType::tf32;
  EXPECT_THROW(run_cuda(make_runtime_plan(tf32_wire), options(), {}), std::invalid_argument);
}

TEST(CudaExecutor, ZeroBubbleSplitTracksTheCpu) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const ScenarioConfig c = small_config(2, 2, ScheduleKind::zb_h1);
  expect_tracks(on_cpu(c), on_gpu(c), 1e-5, 1e-4);
}

TEST(CudaExecutor, OneRankTracksTheCpuInFp32) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const ScenarioConfig c = small_config(1, 1, ScheduleKind::one_f_one_b);
  expect_tracks(on_cpu(c), on_gpu(c), 1e-5, 1e-4);
}

TEST(CudaExecutor, DataAndPipelineParallelTrackTheCpuAndReplicasStayIdentical) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const ScenarioConfig c = small_config(2, 2, ScheduleKind::one_f_one_b);
  const RunReport gpu = on_gpu(c, SmSharing::shared);
  expect_tracks(on_cpu(c), gpu, 1e-5, 1e-4);
  for (const auto& s : gpu.steps) {
    EXPECT_EQ(s.replica_checksums[0], s.replica_checksums[1]) << "step " << s.step;
    EXPECT_EQ(s.replica_drift, 0.0);
  }
  EXPECT_NE(gpu.execution.find("single-GPU world"), std::string::npos) << gpu.execution;
}

TEST(CudaExecutor, InterleavedAndGpipeOnGreenContextsTrackTheCpu) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  for (const ScenarioConfig& c :
       {small_config(1, 2, ScheduleKind::interleaved_1f1b, 2), small_config(2, 2, ScheduleKind::gpipe)}) {
    const RunReport gpu = on_gpu(c, SmSharing::automatic);
    expect_tracks(on_cpu(c), gpu, 1e-5, 1e-4);
    EXPECT_NE(gpu.execution.find("SMs"), std::string::npos) << "says which SM mode ran: " << gpu.execution;
  }
}

// ZeRO 1/2/3 and recompute on the device follow the CPU engine (the reference for their layouts,
// collectives and units) to the same tolerances as plain data parallelism; ZeRO-3 resumes bitwise.
TEST(CudaExecutor, ZeroAndRecomputeTrackTheCpu) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  struct Case {
    int dp, pp, zero;
    Framework framework;
    ScheduleKind schedule;
    Recompute recompute;
  };
  for (const Case& k : {Case{2, 1, 1, Framework::auto_select, ScheduleKind::one_f_one_b, Recompute::selective},
                        Case{2, 1, 2, Framework::fsdp, ScheduleKind::one_f_one_b, Recompute::none},
                        Case{2, 2, 2, Framework::megatron, ScheduleKind::zb_h1, Recompute::full},
                        Case{2, 2, 3, Framework::megatron, ScheduleKind::one_f_one_b, Recompute::full},
                        Case{2, 2, 3, Framework::megatron, ScheduleKind::zb_h1, Recompute::selective_op},
                        Case{2, 1, 3, Framework::fsdp, ScheduleKind::gpipe, Recompute::selective}}) {
    SCOPED_TRACE(::testing::Message() << "dp " << k.dp << " pp " << k.pp << " zero " << k.zero << " "
                                      << schedule_name(k.schedule) << " recompute " << recompute_name(k.recompute));
    ScenarioConfig c = small_config(k.dp, k.pp, k.schedule);
    c.parallelism.zero_stage = k.zero;
    c.parallelism.framework = k.framework;
    c.training.activation_recompute = k.recompute;
    c.communication.overlap_grad_reduce = true;
    c.communication.bucket_size_mib = 0.05;
    const RunReport gpu = on_gpu(c);
    expect_tracks(on_cpu(c), gpu, 1e-5, 1e-4);
    for (const auto& st : gpu.steps) EXPECT_EQ(st.replica_drift, 0.0);
  }
}

// Issue 18: FP32 losses of hybrid plans on the GPU equal the one-rank GPU run to FP32 rounding
// (relative 1e-5, as the CPU's matrix of every layout holds against its one rank: the plans
// split the same global batch and sum the same gradients in another order).
TEST(CudaExecutor, HybridPlansTrainAsTheOneRankGpuRunInFp32) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const RunReport one = on_gpu(small_config(1, 1, ScheduleKind::one_f_one_b));
  ASSERT_FALSE(one.failure) << one.failure->message;
  struct Case {
    int dp, pp, tp, vpp, zero;
    ScheduleKind schedule;
  };
  for (const Case& k : {Case{2, 2, 1, 1, 0, ScheduleKind::one_f_one_b}, Case{2, 2, 1, 1, 0, ScheduleKind::zb_h1},
                        Case{1, 2, 1, 2, 0, ScheduleKind::interleaved_1f1b}, Case{1, 1, 2, 1, 0, ScheduleKind::one_f_one_b},
                        Case{2, 1, 2, 1, 1, ScheduleKind::one_f_one_b}, Case{2, 1, 1, 1, 3, ScheduleKind::gpipe}}) {
    SCOPED_TRACE(::testing::Message() << "dp " << k.dp << " pp " << k.pp << " tp " << k.tp << " vpp " << k.vpp
                                      << " zero " << k.zero << " " << schedule_name(k.schedule));
    ScenarioConfig c = small_config(k.dp, k.pp, k.schedule, k.vpp);
    c.parallelism.tensor_parallel_size = k.tp;
    c.parallelism.sequence_parallel = k.tp > 1;
    c.parallelism.zero_stage = k.zero;
    c.cluster.num_gpus = k.dp * k.pp * k.tp;
    const RunReport r = on_gpu(c);
    ASSERT_FALSE(r.failure) << r.failure->message;
    ASSERT_EQ(r.steps.size(), one.steps.size());
    for (std::size_t i = 0; i < r.steps.size(); ++i) {
      EXPECT_NEAR(r.steps[i].loss, one.steps[i].loss, 1e-5 * std::fabs(one.steps[i].loss)) << "step " << i + 1;
      EXPECT_NEAR(r.steps[i].grad_norm, one.steps[i].grad_norm, 1e-4 * one.steps[i].grad_norm) << "step " << i + 1;
    }
  }
}

TEST(CudaExecutor, Bf16TracksTheCpuWithinTheFormat) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  ScenarioConfig c = small_config(2, 2, ScheduleKind::one_f_one_b);
  c.precision.compute = DType::bf16;
  c.precision.allreduce = DType::bf16;
  expect_tracks(on_cpu(c), on_gpu(c), std::ldexp(1.0, -5), std::ldexp(1.0, -5));
}

TEST(CudaExecutor, Fp16OverflowIsFoundNamedAndSkippedTogether) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  ScenarioConfig c = small_config(2, 2, ScheduleKind::one_f_one_b);
  c.precision.compute = DType::fp16;
  c.precision.loss_scaling.mode = LossScalingMode::static_scale;
  c.precision.loss_scaling.initial_scale = std::ldexp(1.0, 40);
  const RunReport r = on_gpu(c);
  for (const auto& s : r.steps) {
    EXPECT_GT(s.nonfinite_count, 0) << "scaled fp16 gradients overflow";
    EXPECT_EQ(s.skipped_ranks, 4) << "every rank skips under the global check";
  }
  EXPECT_EQ(r.steps.front().replica_checksums, r.steps.back().replica_checksums) << "no update was applied";
  bool named = false;
  for (const auto& rk : r.steps.front().ranks) named = named || !rk.first_nonfinite.empty();
  EXPECT_TRUE(named);
}

// Every byte the report accounts for (weights, gradients, moments, stashes, buffers in flight)
// is a real allocation, so the allocators' peak is at least that; and GPipe, which keeps every
// micro-batch's stash, must show twice the micro-batches' stashes in the allocators too.
TEST(CudaExecutor, AllocatorPeakCoversTheAccountedMemoryAndGrowsWithStashes) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  ScenarioConfig c = small_config(1, 2, ScheduleKind::gpipe);
  c.training.global_batch_size = 8;
  const RunReport four = on_gpu(c);
  c.training.global_batch_size = 16;
  const RunReport eight = on_gpu(c);
  for (const RunReport* r : {&four, &eight}) {
    ASSERT_FALSE(r->failure) << r->failure->message;
    ASSERT_EQ(r->allocated_peak_bytes.size(), 2u);
    for (std::size_t rank = 0; rank < 2; ++rank)
      EXPECT_GE(r->allocated_peak_bytes[rank], r->memory[rank].total()) << "rank " << rank;
  }
  for (std::size_t rank = 0; rank < 2; ++rank) {
    const double more_stashes = eight.memory[rank].activations - four.memory[rank].activations;
    EXPECT_GT(more_stashes, 0);
    EXPECT_GE(eight.allocated_peak_bytes[rank] - four.allocated_peak_bytes[rank], more_stashes) << "rank " << rank;
  }
}

// Checkpoint at step 2 of 4, resume: steps 3 and 4 again, bit for bit (the backend is
// deterministic: no floating-point atomics). And the format is the CPU backend's: a CPU
// checkpoint continues on the GPU as the CPU itself continues, within the fp32 tolerance.
TEST(CudaExecutor, CheckpointResumeIsBitwiseAndCrossesBackends) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const auto dir = std::filesystem::temp_directory_path() / "trainsim_cuda_resume";
  std::filesystem::remove_all(dir);
  ScenarioConfig c = small_config(2, 2, ScheduleKind::interleaved_1f1b, 2);
  c.precision.compute = DType::bf16;
  c.precision.loss_scaling.mode = LossScalingMode::dynamic;
  c.runtime.steps = 4;
  RunOptions opt = options();
  opt.checkpoint_dir = (dir / "gpu").string();
  opt.checkpoint_every_steps = 2;
  CudaRunOptions cuda;
  const RunReport whole = run_cuda(make_runtime_plan(c), opt, cuda);
  ASSERT_FALSE(whole.failure) << whole.failure->message;
  ASSERT_EQ(whole.checkpoints.size(), 2u);

  RunOptions resume = options();
  resume.resume_from = whole.checkpoints[0];
  const RunReport rest = run_cuda(make_runtime_plan(c), resume, cuda);
  ASSERT_EQ(rest.first_step, 3);
  ASSERT_EQ(rest.steps.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(rest.steps[i].loss, whole.steps[i + 2].loss) << "bitwise, step " << i + 3;
    EXPECT_EQ(rest.steps[i].replica_checksums, whole.steps[i + 2].replica_checksums);
  }

  ScenarioConfig f = small_config(1, 2, ScheduleKind::one_f_one_b);
  f.runtime.steps = 4;
  RunOptions cpu_opt = options();
  cpu_opt.checkpoint_dir = (dir / "cpu").string();
  cpu_opt.checkpoint_every_steps = 2;
  const RunReport cpu = run_cpu(make_runtime_plan(f), cpu_opt);
  ASSERT_FALSE(cpu.failure);
  RunOptions from_cpu = options();
  from_cpu.resume_from = cpu.checkpoints[0];
  const RunReport gpu_rest = run_cuda(make_runtime_plan(f), from_cpu, cuda);
  ASSERT_EQ(gpu_rest.steps.size(), 2u);
  for (int i = 0; i < 2; ++i)
    EXPECT_NEAR(gpu_rest.steps[i].loss, cpu.steps[i + 2].loss, 1e-4 * std::fabs(cpu.steps[i + 2].loss));
  std::filesystem::remove_all(dir);
}

// As on the CPU (tests/runtime/replay_expectations.h): a run its numerics end at step 2 is replayed
// from the state before step 1, which the engine saves before it has run a step (its masters not
// yet downloaded by any step), bit for bit.
TEST(CudaExecutor, ARunItsNumericsEndReplaysBitwiseFromItsFirstState) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  RunOptions o = options();
  o.timed_steps_at_least = 4;
  testing::expect_bitwise_replays(
      run_cuda(make_runtime_plan(testing::nan_at_step_two(small_config(2, 2, ScheduleKind::one_f_one_b))), o,
               CudaRunOptions{}));
}

// Failure paths on the device, as on the CPU (tests/runtime/test_executor.cpp): a rank that
// raises ends the run naming it and the op; a rank stuck before a collective times its peers out
// on the single-GPU world, naming it; neither hangs.
TEST(CudaExecutor, ARankThatRaisesOrStallsEndsTheRunNamingIt) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  RunOptions raise = options();
  raise.steps = 3;
  raise.fault = InjectedFault{.rank = 3, .step = 2, .kind = InjectedFault::Kind::raise};
  const RunReport r = run_cuda(make_runtime_plan(small_config(2, 2, ScheduleKind::one_f_one_b)), raise, {});
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->step, 2);
  EXPECT_NE(r.failure->message.find("rank 3 failed at step 2"), std::string::npos) << r.failure->message;
  EXPECT_NE(r.failure->message.find("the injected failure"), std::string::npos) << r.failure->message;

  RunOptions stall = options();
  stall.steps = 2;
  stall.comm_timeout = std::chrono::milliseconds(500);
  stall.fault = InjectedFault{.rank = 1, .step = 1, .kind = InjectedFault::Kind::stall,
                              .stall = std::chrono::milliseconds(2000)};
  const auto t0 = std::chrono::steady_clock::now();
  const RunReport s = run_cuda(make_runtime_plan(small_config(2, 1, ScheduleKind::one_f_one_b)), stall, {});
  ASSERT_TRUE(s.failure);
  EXPECT_NE(s.failure->message.find("waiting for rank 1"), std::string::npos) << s.failure->message;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60) << "ended, not hung";
}

TEST(CudaExecutor, MeasuredTimelineFollowsTheSchedule) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const RunReport r = on_gpu(small_config(2, 2, ScheduleKind::one_f_one_b));
  const Schedule& s = *r.schedule;
  ASSERT_EQ(r.timeline.ops.size(), s.ranks.size());
  for (std::size_t rank = 0; rank < s.ranks.size(); ++rank) {
    Tick last_compute_end = 0;
    for (std::size_t i = 0; i < s.ranks[rank].ops.size(); ++i) {
      const Op& op = s.ranks[rank].ops[i];
      const OpTiming t = r.timeline.ops[rank][i];
      EXPECT_GE(t.start, 0);
      EXPECT_LE(t.start, t.end) << op_label(op);
      // Compute ops (sends end on the send stream) run one at a time, in program order.
      if (stream_of(op.kind) == StreamKind::compute && !is_send(op.kind)) {
        EXPECT_GE(t.start, last_compute_end) << op_label(op);
        last_compute_end = t.end;
      }
      // Events resolve to about half a microsecond; a collective's times are moved from its
      // context's epoch onto the compute epoch's time line by the device clock's stamps.
      if (op.dep >= 0) {
        EXPECT_GE(t.start, r.timeline.ops[rank][op.dep].end - 1'000'000) << op_label(op);
      }
    }
  }
  const Result again = compute_result(r.runtime_plan.plan, r.timeline, r.memory);
  EXPECT_EQ(again.step_time_s, r.result.step_time_s);
  EXPECT_GT(r.result.step_time_s, 0);
  for (const auto& rank : r.result.ranks) {
    EXPECT_GT(rank.utilization, 0);
    EXPECT_LE(rank.utilization, 1);
  }
}

}  // namespace
}  // namespace trainsim::runtime::cuda
