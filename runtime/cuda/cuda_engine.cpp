// The CUDA engine (cuda_engine.h). runtime/cpu/cpu_engine.cpp is the reference for every decision
// about numerics; this file follows it op by op, with device buffers, streams and events where that
// one has vectors, threads and clocks. The run (steps, numerics log, checkpoints, the result) is
// the run loop's (runtime/loop/run_loop.h).
#include "runtime/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "kernels/collective.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/kernels.h"
#include "runtime/cuda/calibrate_cuda.h"
#include "runtime/cuda/device_world.h"
#include "runtime/cuda/nccl_communicator.h"
#include "runtime/cuda/optimizer_cuda.h"
#include "runtime/cuda/sm_partition.h"
#include "runtime/cuda/stage_model_cuda.h"
#include "runtime/cuda/stream_ops.h"
#include "runtime/engine/memory_accounting.h"
#include "runtime/engine/rank_threads.h"
#include "runtime/engine/schedule_ops.h"
#include "runtime/engine/weights.h"
#include "runtime/engine/zero.h"
#include "runtime/loop/run_loop.h"
#include "runtime/numerics/loss_scaler.h"

namespace trainsim::runtime::cuda {

namespace k = ::trainsim::cuda;
using k::check_cuda;

namespace {

void* offset(void* base, std::size_t elements, DType dt) {
  return static_cast<char*>(base) + elements * static_cast<std::size_t>(dtype_bytes(dt));
}

// A timing event per op boundary, re-recorded every step; created in the calling thread's
// current context (Event(nullptr): none yet).
struct Event {
  EventHandle e = nullptr;
  Event() { check_cuda(cudaEventCreate(&e), "cudaEventCreate"); }
  explicit Event(std::nullptr_t) {}
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
  Event(Event&& o) noexcept : e(o.e) { o.e = nullptr; }
  Event& operator=(Event&& o) noexcept {
    std::swap(e, o.e);
    return *this;
  }
  Event(const Event&) = delete;
};

Tick ticks_between(EventHandle from, EventHandle to) {
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, from, to), "cudaEventElapsedTime");
  return static_cast<Tick>(std::llround(static_cast<double>(ms) * 1e9));  // ms -> ps
}

void record(EventHandle event, StreamHandle stream) { check_cuda(cudaEventRecord(event, stream), "cudaEventRecord"); }
void wait_event(StreamHandle stream, EventHandle event) {
  check_cuda(cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent");
}

// What one rank did in one step, with its memory peaks: it travels between processes
// (gather_host) when ranks are not all in this one.
struct RankReport {
  RankStep step;
  MemoryBreakdown peak;
  std::uint64_t allocated_peak = 0;  // bytes, from the allocators: its DeviceBuffers' peak + its pool's
};

class Writer {
 public:
  template <class T>
  void pod(const T& v) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  template <class T>
  void vec(const std::vector<T>& v) {
    pod<std::uint64_t>(v.size());
    const auto* p = reinterpret_cast<const std::uint8_t*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(T));
  }
  void str(const std::string& s) {
    pod<std::uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  std::vector<std::uint8_t> bytes;
};

class Reader {
 public:
  explicit Reader(const std::vector<std::uint8_t>& b) : b_(b) {}
  template <class T>
  T pod() {
    if (at_ + sizeof(T) > b_.size()) throw std::runtime_error("CUDA engine: a rank's step record is truncated");
    T v;
    std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> vec() {
    const auto n = pod<std::uint64_t>();
    if (n > (b_.size() - at_) / sizeof(T)) throw std::runtime_error("CUDA engine: a rank's step record is truncated");
    std::vector<T> v(n);
    std::memcpy(v.data(), b_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return v;
  }
  std::string str() {
    const auto n = pod<std::uint64_t>();
    if (at_ + n > b_.size()) throw std::runtime_error("CUDA engine: a rank's step record is truncated");
    std::string s(b_.begin() + static_cast<std::ptrdiff_t>(at_), b_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += n;
    return s;
  }

 private:
  const std::vector<std::uint8_t>& b_;
  std::size_t at_ = 0;
};

std::vector<std::uint8_t> serialize(const RankReport& r) {
  const RankStep& s = r.step;
  const RankStepNumerics& n = s.numerics;
  Writer w;
  w.vec(s.timing);
  w.vec(s.arrival);
  w.pod(s.loss_sum);
  w.pod<std::int32_t>(s.loss_count);
  w.pod(s.grad_norm);
  w.pod<std::uint8_t>(n.skipped);
  w.pod<std::uint8_t>(n.found_nonfinite);
  w.pod(n.loss_scale);
  w.pod(n.max_abs_activation);
  w.pod(n.max_abs_gradient);
  w.pod(n.nonfinite_count);
  w.pod(s.first_nonfinite_at);
  w.str(n.first_nonfinite);
  w.pod(s.weights_hash);
  w.pod(r.peak);
  w.pod(r.allocated_peak);
  w.str(s.error);
  w.pod(s.failed_at_ns);
  return std::move(w.bytes);
}

RankReport deserialize(const std::vector<std::uint8_t>& bytes) {
  Reader rd(bytes);
  RankReport r;
  RankStep& s = r.step;
  RankStepNumerics& n = s.numerics;
  s.timing = rd.vec<OpTiming>();
  s.arrival = rd.vec<Tick>();
  s.loss_sum = rd.pod<double>();
  s.loss_count = rd.pod<std::int32_t>();
  s.grad_norm = rd.pod<double>();
  n.skipped = rd.pod<std::uint8_t>() != 0;
  n.found_nonfinite = rd.pod<std::uint8_t>() != 0;
  n.loss_scale = rd.pod<double>();
  n.max_abs_activation = rd.pod<double>();
  n.max_abs_gradient = rd.pod<double>();
  n.nonfinite_count = rd.pod<std::int64_t>();
  s.first_nonfinite_at = rd.pod<Tick>();
  n.first_nonfinite = rd.str();
  s.weights_hash = rd.pod<std::uint64_t>();
  r.peak = rd.pod<MemoryBreakdown>();
  r.allocated_peak = rd.pod<std::uint64_t>();
  s.error = rd.str();
  s.failed_at_ns = rd.pod<std::int64_t>();
  return r;
}

// A rank's part of a checkpoint, on its way to the process that writes the file.
std::vector<std::uint8_t> serialize(const RankCheckpoint& c) {
  Writer w;
  w.pod<std::int64_t>(c.rank);
  w.vec(c.master_weights);
  w.vec(c.first_moment);
  w.vec(c.second_moment);
  w.pod(c.optimizer_steps);
  w.pod(c.scaler.scale);
  w.pod<std::int64_t>(c.scaler.good_steps);
  w.pod<std::int64_t>(c.scaler.hysteresis_left);
  return std::move(w.bytes);
}

RankCheckpoint deserialize_checkpoint(const std::vector<std::uint8_t>& bytes) {
  Reader r(bytes);
  RankCheckpoint c;
  c.rank = static_cast<int>(r.pod<std::int64_t>());
  c.master_weights = r.vec<float>();
  c.first_moment = r.vec<float>();
  c.second_moment = r.vec<float>();
  c.optimizer_steps = r.pod<std::int64_t>();
  c.scaler.scale = r.pod<double>();
  c.scaler.good_steps = static_cast<int>(r.pod<std::int64_t>());
  c.scaler.hysteresis_left = static_cast<int>(r.pod<std::int64_t>());
  return c;
}

// Flags per rank, on the device: before/after each collective op, then the verdicts.
struct FlagLayout {
  std::size_t ops = 0;
  std::size_t before(std::size_t i) const { return 2 * i; }
  std::size_t after(std::size_t i) const { return 2 * i + 1; }
  std::size_t local() const { return 2 * ops; }      // inf/NaN in this rank's own gradients
  std::size_t global() const { return 2 * ops + 1; } // inf/NaN in its reduced gradients
  std::size_t unused() const { return 2 * ops + 2; } // the optimizer's unscale (verdict already taken)
  std::size_t count() const { return 2 * ops + 3; }
};

// Device scalars of a rank: the squared norm, the norm's all-reduce, the global verdict.
struct Scalars {
  double sumsq;
  float norm;
  float verdict;
};

struct CudaRank {
  // Declared first, destroyed last: every device allocation of the rank is charged to `memory`
  // (persistent buffers, stashes, cuBLAS workspaces) or comes from `pool` (what is in flight).
  k::MemoryAccount memory;
  std::unique_ptr<MemoryPool> pool;
  int rank = 0, stage = 0, replica = 0, shard = 0;  // shard: its tensor-parallel coordinate
  const RankProgram* program = nullptr;             // its cell's (World::cell)
  std::unique_ptr<DeviceCommunicator> comm;
  std::unique_ptr<DeviceCommunicatorGroup> tensor_parallel;  // its tensor-parallel group (tp > 1)
  RankStreams streams;
  std::vector<CudaStageModel> chunks;  // local chunk j holds virtual stage j * pp + stage
  struct OptimizerBuffers {
    k::DeviceBuffer m, v, mask, master_rounding;
    std::int64_t steps = 0;
  };
  std::vector<OptimizerBuffers> optimizers;
  std::unique_ptr<LossScaler> scaler;
  RankWalk walk;  // an op is done when its thread has queued it on its stream (its end event recorded)

  int partition_index = 0;  // its streams and contexts in the SmPartition
  // Per op, in the context of the stream the op runs on (an event is recorded only on a stream of
  // its own context): the communication thread's for collectives, the compute thread's otherwise.
  std::vector<Event> start, end;
  // The step's start on the compute stream and on the comm stream: the origins of the compute
  // ops' and the collectives' times. Two contexts, so the device clock is stamped beside each
  // (epoch_clock[0] compute, [1] comm) to put the collectives on the compute ops' time line.
  std::unique_ptr<Event> epoch, comm_epoch;
  k::DeviceBuffer epoch_clock;
  std::unique_ptr<PinnedBuffer> readback;  // the optimizer step's scalars and flags, read on the host
  FlagLayout flags_at;
  k::DeviceBuffer flags, scans, scalars, scratch;

  // This step.
  int step = 0;
  std::vector<MicroBatchTokens> batches;
  std::vector<void*> act_in, act_out, grad_out, grad_in;  // [slot], stream-ordered allocations
  std::vector<int> units_done;
  double grad_norm = 0;
  bool skipped = false, found_nonfinite = false;
  double scale_used = 1;
  std::exception_ptr error;

  std::vector<std::vector<float>> master_copy;  // this step's master weights on the host, per chunk

  std::size_t buffer_elements = 0;
  double peak_bytes = 0;
  MemoryBreakdown peak;

  // ZeRO (runtime/engine/zero.h; the CPU engine's ZeroShard with device buffers), per local chunk:
  // shards of the fp32 master weights, the reduced gradients (grad_accumulation), the decay mask
  // and (compute not fp32) the compute-format weights gathers send; the moments are the chunk's
  // OptimizerBuffers, shard-sized. Stage 3: an event per unit when its gather is queued (comm
  // context) and when the compute stream let it go (compute context).
  struct ZeroShard {
    ZeroChunk plan;
    k::DeviceBuffer master, grads, working, mask;
    std::unique_ptr<ChunkWeightGate> gate;
    std::vector<Event> unit_ready, unit_freed;
    bool gathered = false;  // FSDP's stage 2: gathered once this step
  };
  std::vector<ZeroShard> zero;
  std::vector<std::vector<int>> staged_after;  // per op: the reduce-scatters whose bucket it completes
  std::map<int, void*> staged;                 // reduce-scatter op -> its bucket (pool, grad_accumulation)
  std::mutex staged_mu;
  GatherGate gather_gate;
  double staged_bytes = 0, in_flight = 0;
  std::vector<std::size_t> written, staged_to;
};

// What the CUDA backend cannot run, refused before any device work.
void check_supported(const Plan& plan) {
  const auto& pr = plan.config.precision;
  for (DType t : {pr.compute, pr.grad_accumulation, pr.allreduce})
    if (!(t == DType::fp32 || t == DType::fp16 || t == DType::bf16))
      throw std::invalid_argument(fmt::format("the CUDA backend stores and reduces fp32, fp16 or bf16; precision "
                                              "compute {}, grad_accumulation {}, allreduce {}",
                                              dtype_name(pr.compute), dtype_name(pr.grad_accumulation),
                                              dtype_name(pr.allreduce)));
  if (!(pr.master_weights == DType::fp32 || pr.master_weights == DType::fp16 || pr.master_weights == DType::bf16))
    throw std::invalid_argument(fmt::format("the CUDA backend keeps master weights in fp32, fp16 or bf16, not {}",
                                            dtype_name(pr.master_weights)));
  // Its passes do not yet read units as they arrive outside stage 3 (the CPU backend's do).
  if (plan.gathers_before_first_forward())
    throw std::invalid_argument("the CUDA backend does not execute communication.overlap_param_gather yet; the CPU "
                                "backend does (its weights and losses are those of the same plan without it)");
  // Its stage model has no gathered-key attention yet (the CPU backend's does: --backend cpu).
  if (plan.cp > 1)
    throw std::invalid_argument(fmt::format("the CUDA backend does not execute context parallelism yet "
                                            "(context_parallel_size {}); the CPU backend does",
                                            plan.cp));
}

int current_device() {
  int d = 0;
  check_cuda(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

class CudaEngine final : public DeviceEngine {
 public:
  CudaEngine(const RuntimePlan& rp, const Dataset& data, const RunOptions& options)
      : fault_(options.fault),
        rp_(rp), plan_(rp.plan), data_(data), world_(World::of(rp.plan)), shape_(rp.plan) {
    const auto& cfg = plan_.config;
    const Placement& placement = options.placement;
    schedule_ = std::make_shared<const Schedule>(build_schedule(plan_));
    const int world = world_.size();

    std::vector<int> local;
    if (placement.launch) {
      if (placement.launch->world_size != world)
        throw std::invalid_argument(fmt::format("the launcher started {} processes, the plan has {} ranks (dp {} x pp {} x tp {})",
                                                placement.launch->world_size, world, plan_.dp, plan_.pp, plan_.tp));
      auto comm = NcclCommunicator::create(*placement.launch, reduction_groups(*schedule_, world_), options.comm_timeout,
                                           p2p_links(*schedule_, world_));
      nccl_ = comm.get();
      partition_ = std::make_unique<SmPartition>(1, SmSharing::shared, current_device());
      k::keep_default_pool_memory(current_device());  // the kernels take their scratch there
      local.push_back(placement.launch->rank);
      ranks_.push_back(std::make_unique<CudaRank>());
      ranks_.back()->comm = std::move(comm);
    } else {
      partition_ = std::make_unique<SmPartition>(world, placement.sm_sharing, placement.device);
      device_world_ = std::make_unique<DeviceWorld>(world, options.comm_timeout);
      k::keep_default_pool_memory(placement.device);  // where the world stages its messages
      for (int r = 0; r < world; ++r) {
        local.push_back(r);
        ranks_.push_back(std::make_unique<CudaRank>());
        ranks_.back()->comm = device_world_->communicator(r);
      }
    }
    all_local_ = static_cast<int>(local.size()) == world;
    execution_ = fmt::format("cuda: {}; {}", ranks_[0]->comm->describe(), partition_->describe());

    const OptimizerSettings os = optimizer_settings(cfg);
    std::vector<std::size_t> grad_elems(static_cast<std::size_t>(shape_.virtual_stages), 0);
    for (std::size_t li = 0; li < ranks_.size(); ++li) {
      CudaRank& rk = *ranks_[li];
      rk.rank = local[li];
      rk.stage = world_.coord(rk.rank).pp;
      rk.replica = world_.coord(rk.rank).dp;
      rk.shard = world_.coord(rk.rank).tp;
      rk.program = &schedule_->ranks[static_cast<std::size_t>(world_.cell(rk.rank))];
      if (world_.tensor_parallel() > 1)
        rk.tensor_parallel = std::make_unique<DeviceCommunicatorGroup>(*rk.comm, world_.tensor_parallel_group(rk.rank));
      rk.partition_index = all_local_ ? rk.rank : 0;
      rk.streams = partition_->streams(rk.partition_index);
      // Everything this rank creates (events, cuBLAS handles, buffers) belongs to its context
      // and is charged to its account.
      partition_->make_current(rk.partition_index);
      k::AccountScope charge(&rk.memory);
      rk.pool = std::make_unique<MemoryPool>(current_device());
      rk.epoch = std::make_unique<Event>();
      for (int j = 0; j < shape_.vpp; ++j) {
        const int vs = shape_.vstage_of_chunk(rk.stage, j);
        rk.chunks.emplace_back(stage_spec(rp_, vs, rk.shard), rk.streams.compute);
        CudaStageModel& model = rk.chunks.back();
        model.set_tensor_parallel_group(rk.tensor_parallel.get());
        model.init(static_cast<std::uint64_t>(cfg.runtime.seed));
        const InFlight most = in_flight(*rk.program, vs);
        model.reserve(most.stashes, most.backwards, most.split_backwards, shape_.last(vs) ? shape_.microbatches : 0);
        CudaRank::OptimizerBuffers opt;
        const std::size_t n = model.num_parameters();
        if (os.kind != Optimizer::sgd) {
          opt.m = k::DeviceBuffer(n * sizeof(float));
          opt.v = k::DeviceBuffer(n * sizeof(float));
          fill_zero(opt.m.data(), opt.m.bytes(), rk.streams.compute);
          fill_zero(opt.v.data(), opt.v.bytes(), rk.streams.compute);
        }
        std::vector<std::uint8_t> mask(n, 1);
        for (const ParamInfo& p : model.params())
          if (!p.decay) std::fill(mask.begin() + p.offset, mask.begin() + p.offset + p.size, 0);
        opt.mask = k::DeviceBuffer(n);
        copy_host_to_device(opt.mask.data(), mask.data(), n, rk.streams.compute);
        if (cfg.precision.master_weights != DType::fp32)
          opt.master_rounding = k::DeviceBuffer(n * dtype_bytes(cfg.precision.master_weights));
        rk.optimizers.push_back(std::move(opt));
        round_master(rk, j);
        grad_elems[static_cast<std::size_t>(vs)] = model.num_parameters();
      }
      rk.scaler = std::make_unique<LossScaler>(cfg.precision.loss_scaling);
      const std::size_t ops = rk.program->ops.size();
      rk.flags_at.ops = ops;
      rk.flags = k::DeviceBuffer(rk.flags_at.count() * sizeof(int));
      rk.readback = std::make_unique<PinnedBuffer>(sizeof(Scalars) + rk.flags_at.count() * sizeof(int));
      rk.start.reserve(ops);
      rk.end.reserve(ops);
      for (std::size_t i = 0; i < ops; ++i) {
        rk.start.emplace_back(nullptr);
        rk.end.emplace_back(nullptr);
      }
      rk.scans = k::DeviceBuffer(std::max<std::size_t>(ops, 1) * sizeof(k::TensorScan));
      rk.epoch_clock = k::DeviceBuffer(2 * sizeof(std::uint64_t));
      rk.scalars = k::DeviceBuffer(sizeof(Scalars));
      rk.scratch = k::DeviceBuffer(k::kReductionScratchDoubles * sizeof(double));
      for (RankThread thread : {RankThread::compute, RankThread::comm}) {
        partition_->make_current(rk.partition_index, thread);
        if (thread == RankThread::comm) rk.comm_epoch = std::make_unique<Event>();
        for (std::size_t i = 0; i < ops; ++i)
          if (is_collective(rk.program->ops[i].kind) == (thread == RankThread::comm)) {
            rk.start[i] = Event();
            rk.end[i] = Event();
          }
      }
    }
    // Every virtual stage's gradient count, also for stages held by other processes: a CPU
    // StageModel of the same spec has the same parameters (stage_model_cuda.h).
    for (int vs = 0; vs < shape_.virtual_stages; ++vs)
      if (grad_elems[static_cast<std::size_t>(vs)] == 0)
        grad_elems[static_cast<std::size_t>(vs)] = StageModel(stage_spec(rp_, vs, 0)).gradients().size();
    buckets_ = gradient_buckets(*schedule_, shape_.virtual_stages, grad_elems);
    if (plan_.zero() >= 1) setup_zero(os);
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      synchronize(rk->streams.compute);
    }
    peaks_.assign(static_cast<std::size_t>(world), {});
    allocated_.assign(static_cast<std::size_t>(world), 0.0);
  }

  const World& world() const override { return world_; }
  std::shared_ptr<const Schedule> schedule() const override { return schedule_; }
  Execution execution() const override { return {execution_, "", false}; }

  std::vector<RankStep> run_step(int step, std::uint64_t data_position) override {
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      prepare_step(*rk, step, data_position);
      synchronize(rk->streams.compute);
    }
    // The ranks' contexts are their own threads' now (sm_partition.h: one thread per green context).
    partition_->make_primary_current();
    std::vector<std::thread> threads;
    for (auto& rk : ranks_)
      threads.emplace_back([this, r = rk.get(), step] {
        Driver driver(*this, *r);
        r->error = r->walk.run(r->rank, *r->program, driver, fault_.at(step, r->rank));
      });
    for (auto& t : threads) t.join();
    for (auto& rk : ranks_)
      if (!rk->error) try {
          // Over NCCL a peer that died leaves this rank's streams waiting: the communicator's
          // synchronize polls its async errors under the watchdog instead of blocking.
          for (auto [s, thread] : {std::pair{rk->streams.compute, RankThread::compute},
                                   std::pair{rk->streams.send, RankThread::compute},
                                   std::pair{rk->streams.comm, RankThread::comm}}) {
            partition_->make_current(rk->partition_index, thread);
            wait_idle(*rk, s, fmt::format("step {} of rank {}", step, rk->rank));
          }
        } catch (...) {
          rk->error = std::current_exception();
        }

    std::vector<RankReport> reports;
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      reports.push_back(summarize(*rk));
    }
    if (!all_local_) {
      std::vector<RankReport> all;
      for (const auto& blob : ranks_[0]->comm->gather_host(serialize(reports[0]))) all.push_back(deserialize(blob));
      reports = std::move(all);
    }
    // The memory peaks of steps every rank completed.
    const bool all_done = std::all_of(reports.begin(), reports.end(), [](const RankReport& r) { return r.step.error.empty(); });
    std::vector<RankStep> out;
    for (std::size_t r = 0; r < reports.size(); ++r) {
      RankReport& rep = reports[r];
      const RankCoord c = world_.coord(static_cast<int>(r));
      rep.step.numerics.rank = static_cast<int>(r);
      rep.step.numerics.stage = c.pp;
      rep.step.numerics.replica = c.dp;
      rep.step.numerics.shard = c.tp;
      if (all_done) {
        if (rep.peak.total() > peaks_[r].total()) peaks_[r] = rep.peak;
        allocated_[r] = std::max(allocated_[r], static_cast<double>(rep.allocated_peak));
      }
      out.push_back(std::move(rep.step));
    }
    return out;
  }

  // Max |w(replica d) - w(replica 0)|, when every rank is in this process.
  std::optional<double> replica_drift() override {
    if (plan_.zero() >= 1) return 0.0;  // one copy of the master, spread over the replicas: nothing to drift
    if (!all_local_) return std::nullopt;
    return runtime::replica_drift(world_, shape_.vpp, [&](int r, int j) {
      return std::span<const float>(ranks_[static_cast<std::size_t>(r)]->master_copy[static_cast<std::size_t>(j)]);
    });
  }

  // Every rank's state after a step that succeeded: its master weights (as summarize downloaded
  // them), moments, optimizer steps and loss scaler. With one process per GPU every process takes
  // part (gather_host) and gets all of them.
  std::vector<RankCheckpoint> save() override {
    std::vector<RankCheckpoint> mine;
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      // Before the first step (the state a run's replays start from) no step has downloaded them.
      if (rk->master_copy.size() != rk->chunks.size()) download_masters(*rk);
      std::vector<std::vector<float>> moments;  // per chunk: first, second
      std::vector<ChunkState> chunks;
      for (std::size_t j = 0; j < rk->chunks.size(); ++j) {
        const std::vector<float>& w = rk->master_copy[j];
        const auto& opt = rk->optimizers[j];
        for (const k::DeviceBuffer* from : {&opt.m, &opt.v}) {
          std::vector<float>& to = moments.emplace_back();
          if (from->bytes() == 0) continue;
          to.resize(w.size());
          copy_device_to_host(to.data(), from->data(), w.size() * sizeof(float), rk->streams.compute);
        }
      }
      synchronize(rk->streams.compute);
      for (std::size_t j = 0; j < rk->chunks.size(); ++j)
        chunks.push_back({rk->master_copy[j], moments[2 * j], moments[2 * j + 1], rk->optimizers[j].steps});
      mine.push_back(pack_rank(rk->rank, chunks, rk->scaler->state()));
    }
    if (all_local_) return mine;
    std::vector<RankCheckpoint> all;
    for (const auto& blob : ranks_[0]->comm->gather_host(serialize(mine[0]))) all.push_back(deserialize_checkpoint(blob));
    return all;
  }

  // The process that writes files (checkpoints): the one holding rank 0.
  bool writes_files() const override { return ranks_[0]->rank == 0; }

  // Loads this process's ranks from `ck` (a checkpoint of the same plan from any backend).
  void restore(const Checkpoint& ck) override {
    if (plan_.zero() >= 1) return restore_zero(ck);
    for (auto& rk : ranks_) {
      const RankCheckpoint& rc = checkpoint_of(ck.ranks, rk->rank);
      partition_->make_current(rk->partition_index);
      const StreamHandle cs = rk->streams.compute;
      std::vector<std::size_t> sizes;
      for (auto& c : rk->chunks) sizes.push_back(c.num_parameters());
      const std::vector<ChunkState> chunks = unpack_rank(rc, sizes);
      for (std::size_t j = 0; j < rk->chunks.size(); ++j) {
        CudaStageModel& model = rk->chunks[j];
        auto& opt = rk->optimizers[j];
        const std::size_t n = model.num_parameters();
        copy_host_to_device(model.master_weights_device(), chunks[j].master_weights.data(), n * sizeof(float), cs);
        if (opt.m.bytes() > 0 && !chunks[j].first_moment.empty()) {
          copy_host_to_device(opt.m.data(), chunks[j].first_moment.data(), n * sizeof(float), cs);
          copy_host_to_device(opt.v.data(), chunks[j].second_moment.data(), n * sizeof(float), cs);
        }
        opt.steps = chunks[j].optimizer_steps;
        model.refresh_working_weights();
      }
      rk->scaler->restore(rc.scaler);
      synchronize(cs);
    }
  }

  std::vector<MemoryBreakdown> memory_peaks() const override { return peaks_; }
  std::vector<double> allocated_peaks() const override { return allocated_; }

 private:
  // The device side of a rank's walk: each op queued on its stream between two events.
  class Driver final : public RankDriver {
   public:
    Driver(CudaEngine& e, CudaRank& rk) : e_(e), rk_(rk) {}
    void on_thread(RankThread, const std::function<void()>& body) override {
      k::AccountScope charge(&rk_.memory);  // stashes are made on first use
      body();
    }
    void start_compute_thread() override {
      e_.partition_->make_current(rk_.partition_index, RankThread::compute);
      // Every stream of the rank starts the step at its epoch (the comm stream: start_comm_thread).
      record(rk_.epoch->e, rk_.streams.compute);
      stamp_device_clock(rk_.epoch_clock.as<std::uint64_t>(), rk_.streams.compute);
      wait_event(rk_.streams.send, rk_.epoch->e);
    }
    // The comm thread starts after the compute thread, so its epoch is later by that thread's
    // start-up on the host (up to 0.2 ms with 8 ranks on an H200); each epoch's device-clock stamp
    // says by how much (summarize). (Re-recording the compute epoch after a wait for the comm
    // epoch was off by the compute thread's wake-up instead: 28 us on an H100.)
    void start_comm_thread() override {
      e_.partition_->make_current(rk_.partition_index, RankThread::comm);
      wait_event(rk_.streams.comm, rk_.epoch->e);
      record(rk_.comm_epoch->e, rk_.streams.comm);
      stamp_device_clock(rk_.epoch_clock.as<std::uint64_t>() + 1, rk_.streams.comm);
    }
    void run_compute(int i) override {
      const Op& op = rk_.program->ops[static_cast<std::size_t>(i)];
      if (is_send(op.kind)) {
        e_.send(rk_, i, op);
        return;
      }
      if (is_compute(op.kind)) {  // ZeRO: the buckets the previous compute op staged are reduced during this one
        rk_.in_flight = rk_.staged_bytes;
        rk_.staged_bytes = 0;
      }
      // As the CPU engine: a backward holds its recompute workspace and (ZeRO-2/3) the unsharded
      // gradients it writes.
      if (op.kind == OpKind::Backward || op.kind == OpKind::BackwardInput || op.kind == OpKind::BackwardWeight)
        e_.account_memory(rk_, op.kind == OpKind::BackwardWeight
                                   ? 0.0
                                   : static_cast<double>(rk_.chunks[static_cast<std::size_t>(e_.shape_.local_chunk(op))]
                                                             .backward_workspace_bytes()),
                          e_.unsharded_written_by(rk_, op));
      record(rk_.start[static_cast<std::size_t>(i)].e, rk_.streams.compute);
      e_.run_op(rk_, i, op);
      if (e_.stages_buckets_ && is_compute(op.kind)) {
        e_.stage_buckets(rk_, i, op);
        rk_.in_flight = rk_.staged_bytes;
      }
      record(rk_.end[static_cast<std::size_t>(i)].e, rk_.streams.compute);
    }
    void finished_compute(int) override { e_.account_memory(rk_); }
    void run_collective(int i) override {
      const StreamHandle st = rk_.streams.comm;
      // Recorded after the wait for its producer: the time this rank reached the collective.
      record(rk_.start[static_cast<std::size_t>(i)].e, st);
      e_.run_collective(rk_, i, rk_.program->ops[static_cast<std::size_t>(i)]);
      record(rk_.end[static_cast<std::size_t>(i)].e, st);
    }
    void waited_for(int dep, RankThread thread) override {
      wait_event(thread == RankThread::compute ? rk_.streams.compute : rk_.streams.comm,
                 rk_.end[static_cast<std::size_t>(dep)].e);
    }
    void abort(const std::string& reason) override {
      rk_.comm->abort(reason);
      rk_.gather_gate.fail(reason);
    }

   private:
    CudaEngine& e_;
    CudaRank& rk_;
  };

  // Master weights held in a format other than fp32 are rounded to it after every update.
  void round_master(CudaRank& rk, int j) {
    const DType master = plan_.config.precision.master_weights;
    CudaStageModel& model = rk.chunks[static_cast<std::size_t>(j)];
    if (master != DType::fp32) {
      const std::size_t n = model.num_parameters();
      void* tmp = rk.optimizers[static_cast<std::size_t>(j)].master_rounding.data();
      k::cast(tmp, master, model.master_weights_device(), DType::fp32, n, rk.streams.compute);
      k::cast(model.master_weights_device(), DType::fp32, tmp, master, n, rk.streams.compute);
    }
    model.refresh_working_weights();
  }

  // ---------------------------------------------------------------------------------------
  // ZeRO (runtime/engine/zero.h): the CPU engine's section (cpu_engine.cpp) with device buffers;
  // what travels is queued on the comm stream, what a pass needs on the compute stream, and
  // stage 3's units are handed over through the rank's GatherGate and two events per unit.
  // ---------------------------------------------------------------------------------------
  static int unit_key(int chunk, int unit) { return chunk * 4096 + unit; }
  int position(const CudaRank& rk) const {
    const std::vector<int> group = world_.data_parallel_group(rk.rank);
    return static_cast<int>(std::find(group.begin(), group.end(), rk.rank) - group.begin());
  }
  std::size_t gbytes() const { return static_cast<std::size_t>(dtype_bytes(plan_.config.precision.grad_accumulation)); }
  std::size_t wbytes() const { return static_cast<std::size_t>(dtype_bytes(plan_.config.precision.compute)); }
  static void* at(void* base, std::size_t element, std::size_t bytes) { return static_cast<char*>(base) + element * bytes; }

  // Copies between a flat buffer and a collective buffer or shard, piece by piece (zero.h).
  static void copy_pieces(const std::vector<ShardPiece>& pieces, void* flat, void* other, std::size_t bytes,
                          bool to_flat, StreamHandle stream) {
    for (const ShardPiece& p : pieces)
      if (to_flat)
        copy_device_to_device(at(flat, p.flat, bytes), at(other, p.other, bytes), p.count * bytes, stream);
      else
        copy_device_to_device(at(other, p.other, bytes), at(flat, p.flat, bytes), p.count * bytes, stream);
  }

  void setup_zero(const OptimizerSettings& os) {
    const auto& pr = plan_.config.precision;
    const int V = shape_.virtual_stages;
    gathers_units_ = plan_.gathers_before_backward();
    stages_buckets_ = plan_.reduces_every_microbatch();
    std::vector<char> kept(static_cast<std::size_t>(V), 0);  // a tied embedding split over the pipeline stays whole
    for (auto& rk : ranks_)
      for (int j = 0; j < shape_.vpp; ++j) {
        const int vs = shape_.vstage_of_chunk(rk->stage, j);
        const ParamInfo te = rk->chunks[static_cast<std::size_t>(j)].token_embedding();
        if (V > 1 && te.size > 0 && !kept[static_cast<std::size_t>(vs)]) {
          keep_embedding_whole(buckets_.ranges[static_cast<std::size_t>(vs)], te.offset, te.offset + te.size);
          kept[static_cast<std::size_t>(vs)] = 1;
        }
      }
    std::size_t largest_unit = 0;
    for (auto& r : ranks_) {
      CudaRank& rk = *r;
      partition_->make_current(rk.partition_index);
      k::AccountScope charge(&rk.memory);
      const StreamHandle cs = rk.streams.compute;
      const int pos = position(rk);
      rk.staged_after.assign(rk.program->ops.size(), {});
      rk.written.assign(static_cast<std::size_t>(shape_.vpp), 0);
      rk.staged_to.assign(static_cast<std::size_t>(shape_.vpp), 0);
      for (int i = 0; i < static_cast<int>(rk.program->ops.size()); ++i) {
        const Op& op = rk.program->ops[static_cast<std::size_t>(i)];
        if (op.kind == OpKind::ReduceScatter && stages_buckets_ && op.dep >= 0)
          rk.staged_after[static_cast<std::size_t>(op.dep)].push_back(i);
      }
      for (int j = 0; j < shape_.vpp; ++j) {
        const int vs = shape_.vstage_of_chunk(rk.stage, j);
        CudaStageModel& model = rk.chunks[static_cast<std::size_t>(j)];
        CudaRank::ZeroShard z;
        z.plan = plan_zero_chunk(plan_, model.spec(), model.params(), buckets_.ranges[static_cast<std::size_t>(vs)],
                                 V > 1 ? model.token_embedding() : ParamInfo{}, plan_.dp, pos);
        const std::size_t S = z.plan.layout.shard_size();
        std::vector<float> shard(S), flat_mask(model.num_parameters(), 1.0f), mask(S);
        z.plan.layout.take(pos, model.master_weights_to_host(), shard);
        for (const ParamInfo& p : model.params())
          if (!p.decay) std::fill(flat_mask.begin() + p.offset, flat_mask.begin() + p.offset + p.size, 0.0f);
        z.plan.layout.take(pos, flat_mask, mask);
        const std::vector<std::uint8_t> mask8(mask.begin(), mask.end());
        z.master = k::DeviceBuffer(S * sizeof(float));
        z.grads = k::DeviceBuffer(S * gbytes());
        z.mask = k::DeviceBuffer(std::max<std::size_t>(S, 1));
        copy_host_to_device(z.master.data(), shard.data(), S * sizeof(float), cs);
        copy_host_to_device(z.mask.data(), mask8.data(), S, cs);
        fill_zero(z.grads.data(), z.grads.bytes(), cs);
        if (pr.compute != DType::fp32) z.working = k::DeviceBuffer(S * wbytes());
        auto& opt = rk.optimizers[static_cast<std::size_t>(j)];
        if (os.kind != Optimizer::sgd) {
          opt.m = k::DeviceBuffer(S * sizeof(float));
          opt.v = k::DeviceBuffer(S * sizeof(float));
          fill_zero(opt.m.data(), opt.m.bytes(), cs);
          fill_zero(opt.v.data(), opt.v.bytes(), cs);
        }
        opt.mask = k::DeviceBuffer();
        if (pr.master_weights != DType::fp32)
          opt.master_rounding = k::DeviceBuffer(S * static_cast<std::size_t>(dtype_bytes(pr.master_weights)));
        for (const GatherUnit& u : z.plan.units) largest_unit = std::max(largest_unit, u.elements);
        rk.zero.push_back(std::move(z));
        refresh_working_shard(rk, j);
        synchronize(cs);  // the host vectors go now
      }
      if (!gathers_units_) continue;
      for (int j = 0; j < shape_.vpp; ++j) {
        auto& z = rk.zero[static_cast<std::size_t>(j)];
        partition_->make_current(rk.partition_index, RankThread::comm);
        for (std::size_t u = 0; u < z.plan.units.size(); ++u) z.unit_ready.emplace_back();
        partition_->make_current(rk.partition_index, RankThread::compute);
        for (std::size_t u = 0; u < z.plan.units.size(); ++u) z.unit_freed.emplace_back();
        z.gate = std::make_unique<ChunkWeightGate>(
            z.plan, rk.gather_gate, unit_key(j, 0), [this, &rk, j](int unit) { poison(rk, j, unit); },
            [&rk, j](int unit) {
              wait_event(rk.streams.compute, rk.zero[static_cast<std::size_t>(j)].unit_ready[static_cast<std::size_t>(unit)].e);
            });
        rk.chunks[static_cast<std::size_t>(j)].set_weight_gate(z.gate.get());
        for (int u = 0; u < static_cast<int>(z.plan.units.size()); ++u) poison(rk, j, u);
      }
      partition_->make_current(rk.partition_index);
    }
    gathered_bytes_ = 2.0 * static_cast<double>(largest_unit) * static_cast<double>(wbytes());
  }

  // The compute-format shard gathers send: the master shard rounded (fp32: the master itself).
  const void* working_shard(CudaRank& rk, int j) {
    auto& z = rk.zero[static_cast<std::size_t>(j)];
    return plan_.config.precision.compute == DType::fp32 ? z.master.data() : z.working.data();
  }
  void refresh_working_shard(CudaRank& rk, int j) {
    auto& z = rk.zero[static_cast<std::size_t>(j)];
    const DType compute = plan_.config.precision.compute;
    if (compute != DType::fp32)
      k::cast(z.working.data(), compute, z.master.data(), DType::fp32, z.plan.layout.shard_size(), rk.streams.compute);
  }
  // round_master on the shard: master weights kept in another format are rounded after each update.
  void round_master_shard(CudaRank& rk, int j) {
    const DType master = plan_.config.precision.master_weights;
    auto& z = rk.zero[static_cast<std::size_t>(j)];
    const std::size_t n = z.plan.layout.shard_size();
    if (master != DType::fp32) {
      void* tmp = rk.optimizers[static_cast<std::size_t>(j)].master_rounding.data();
      k::cast(tmp, master, z.master.data(), DType::fp32, n, rk.streams.compute);
      k::cast(z.master.data(), DType::fp32, tmp, master, n, rk.streams.compute);
    }
    refresh_working_shard(rk, j);
  }
  // Stage 1: the shard from where its reduce-scatters left it, in place in the flat gradients.
  void take_flat_gradients(CudaRank& rk, int j) {
    auto& z = rk.zero[static_cast<std::size_t>(j)];
    copy_pieces(z.plan.layout.shard_pieces(z.plan.layout.whole(), z.plan.layout.position()),
                rk.chunks[static_cast<std::size_t>(j)].gradients_device(), z.grads.data(), gbytes(), false,
                rk.streams.compute);
  }

  // A released stage-3 unit: the first element of every parameter NaN (all ones in any format),
  // then its event, which the next gather of the unit waits for.
  void poison(CudaRank& rk, int j, int unit) {
    auto& z = rk.zero[static_cast<std::size_t>(j)];
    CudaStageModel& model = rk.chunks[static_cast<std::size_t>(j)];
    void* cw = model.compute_weights_device();
    for (const ShardGroup& g : z.plan.units[static_cast<std::size_t>(unit)].groups)
      for (const ParamInfo& p : model.params())
        if (p.offset >= g.lo && p.offset < g.hi)
          check_cuda(cudaMemsetAsync(at(cw, p.offset, wbytes()), 0xff, wbytes(), rk.streams.compute), "cudaMemsetAsync");
    record(z.unit_freed[static_cast<std::size_t>(unit)].e, rk.streams.compute);
  }

  // After compute op `index` (stages 2-3): the buckets it completed into their reduce-scatters'
  // buffers, the flat gradients cleared for the next micro-batch.
  void stage_buckets(CudaRank& rk, int index, const Op& done) {
    const StreamHandle cs = rk.streams.compute;
    if (done.kind == OpKind::Backward || done.kind == OpKind::BackwardWeight) {
      const auto j = static_cast<std::size_t>(shape_.local_chunk(done));
      if (done.bucket <= 0) rk.staged_to[j] = 0;
      rk.written[j] = rk.chunks[j].gradients_complete(done.microbatch);
    }
    for (int rs : rk.staged_after[static_cast<std::size_t>(index)]) {
      const Op& op = rk.program->ops[static_cast<std::size_t>(rs)];
      const auto j = static_cast<std::size_t>(shape_.local_chunk(op));
      const auto& z = rk.zero[j];
      const ShardGroup& g = z.plan.buckets[static_cast<std::size_t>(op.bucket)];
      const std::size_t count = g.section * static_cast<std::size_t>(plan_.dp);
      void* buf = nullptr;
      if (count > 0) {
        buf = rk.pool->allocate(count * gbytes(), cs, fmt::format("rank {}: gradient bucket {}", rk.rank, op.bucket));
        fill_zero(buf, count * gbytes(), cs);
        void* grads = rk.chunks[j].gradients_device();
        for (int p = 0; p < plan_.dp; ++p) copy_pieces(z.plan.layout.section_pieces(g, p), grads, buf, gbytes(), false, cs);
        fill_zero(at(grads, g.lo, gbytes()), (g.hi - g.lo) * gbytes(), cs);
      }
      rk.staged_bytes += static_cast<double>(count) * dtype_bytes(plan_.config.precision.allreduce);
      rk.staged_to[j] = std::max(rk.staged_to[j], g.hi);
      std::lock_guard lock(rk.staged_mu);
      rk.staged[rs] = buf;
    }
  }

  // As the CPU engine's: what a backward op writes, unsharded, before its reduce-scatters.
  double unsharded_written_by(const CudaRank& rk, const Op& op) const {
    if (!stages_buckets_ || op.kind == OpKind::BackwardInput) return 0;
    const auto j = static_cast<std::size_t>(shape_.local_chunk(op));
    const BucketRanges& b = buckets_.ranges[static_cast<std::size_t>(op.chunk)];
    std::size_t from = op.bucket > 0 ? rk.written[j] : 0, to = rk.zero[j].plan.layout.params();
    if (op.bucket >= 0 && op.bucket + 1 < static_cast<int>(b.size())) to = b[static_cast<std::size_t>(op.bucket)].second;
    return to > from ? static_cast<double>(to - from) * static_cast<double>(gbytes()) : 0.0;
  }

  // `buf` (count elements of grad_accumulation) reduced over `c` in the wire format: cast there
  // and back as the all-reduce does. `reduce`: the collective itself on the wire buffer.
  template <class Reduce>
  void on_wire(CudaRank& rk, void* buf, std::size_t count, Reduce&& reduce) {
    const auto& pr = plan_.config.precision;
    const StreamHandle st = rk.streams.comm;
    if (pr.allreduce == pr.grad_accumulation) return reduce(buf);
    void* wire = rk.pool->allocate(count * dtype_bytes(pr.allreduce), st,
                                   fmt::format("rank {}: a reduction's {} copy", rk.rank, dtype_name(pr.allreduce)));
    k::cast(wire, pr.allreduce, buf, pr.grad_accumulation, count, st);
    reduce(wire);
    k::cast(buf, pr.grad_accumulation, wire, pr.allreduce, count, st);
    rk.pool->free(wire, st);
  }

  void zero_reduce_scatter(CudaRank& rk, int i, const Op& op) {
    const auto& pr = plan_.config.precision;
    const StreamHandle st = rk.streams.comm;
    const Collective& c = collective_of(*schedule_, op);
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    const auto j = static_cast<std::size_t>(shape_.local_chunk(op));
    auto& z = rk.zero[j];
    const ShardGroup& g = z.plan.buckets[static_cast<std::size_t>(op.bucket)];
    const std::size_t count = g.section * static_cast<std::size_t>(plan_.dp);
    void* grads = rk.chunks[j].gradients_device();
    void* buf = nullptr;
    if (stages_buckets_) {
      std::lock_guard lock(rk.staged_mu);
      buf = rk.staged.at(i);
      rk.staged.erase(i);
    } else if (count > 0) {  // once per step, after the chunk's last backward
      buf = rk.pool->allocate(count * gbytes(), st, fmt::format("rank {}: gradient bucket {}", rk.rank, op.bucket));
      fill_zero(buf, count * gbytes(), st);
      for (int p = 0; p < plan_.dp; ++p) copy_pieces(z.plan.layout.section_pieces(g, p), grads, buf, gbytes(), false, st);
    }
    if (count == 0) return;
    const auto at_op = static_cast<std::size_t>(i);
    k::unscale_and_check(buf, count, 1.0f, flag(rk, rk.flags_at.before(at_op)), pr.grad_accumulation, st);
    k::unscale_and_check(buf, count, 1.0f, flag(rk, rk.flags_at.local()), pr.grad_accumulation, st);
    on_wire(rk, buf, count, [&](void* wire) {
      rk.comm->reduce_scatter(wire, count, pr.allreduce, members, collective_tag(rk.step, op.channel), ReduceOp::sum,
                              divide_of(c, pr), st);
    });
    const std::size_t own = static_cast<std::size_t>(position(rk)) * g.section;
    k::unscale_and_check(at(buf, own, gbytes()), g.section, 1.0f, flag(rk, rk.flags_at.after(at_op)),
                         pr.grad_accumulation, st);
    if (stages_buckets_)  // accumulated over micro-batches, in grad_accumulation
      k::accumulate(at(z.grads.data(), g.shard_offset, gbytes()), pr.grad_accumulation, at(buf, own, gbytes()),
                    pr.grad_accumulation, g.section, st);
    else  // left in place, in the flat gradients
      copy_pieces(z.plan.layout.section_pieces(g, position(rk)), grads, buf, gbytes(), true, st);
    rk.pool->free(buf, st);
  }

  // The tied embedding's sum between the first and last stage, on the elements each owns of it.
  void zero_embedding_sum(CudaRank& rk, int i, const Op& op) {
    const auto& pr = plan_.config.precision;
    const StreamHandle st = rk.streams.comm;
    const Collective& c = collective_of(*schedule_, op);
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    const auto j = static_cast<std::size_t>(shape_.local_chunk(op));
    auto& z = rk.zero[j];
    const ShardGroup& g = z.plan.tied;
    const std::size_t count = g.section * static_cast<std::size_t>(plan_.dp);
    if (count == 0) return;
    void* buf = rk.pool->allocate(count * gbytes(), st, fmt::format("rank {}: the embedding's sum", rk.rank));
    fill_zero(buf, count * gbytes(), st);
    const std::size_t own = static_cast<std::size_t>(position(rk)) * g.section;
    void* grads = rk.chunks[j].gradients_device();
    const std::vector<ShardPiece> pieces = z.plan.layout.section_pieces(g, position(rk));
    if (stages_buckets_)
      copy_device_to_device(at(buf, own, gbytes()), at(z.grads.data(), g.shard_offset, gbytes()), g.section * gbytes(), st);
    else
      copy_pieces(pieces, grads, buf, gbytes(), false, st);
    const auto at_op = static_cast<std::size_t>(i);
    k::unscale_and_check(buf, count, 1.0f, flag(rk, rk.flags_at.before(at_op)), pr.grad_accumulation, st);
    on_wire(rk, buf, count, [&](void* wire) {
      rk.comm->all_reduce(wire, count, pr.allreduce, members, collective_tag(rk.step, op.channel), ReduceOp::sum,
                          Divide::none, st);
    });
    k::unscale_and_check(buf, count, 1.0f, flag(rk, rk.flags_at.after(at_op)), pr.grad_accumulation, st);
    if (stages_buckets_)
      copy_device_to_device(at(z.grads.data(), g.shard_offset, gbytes()), at(buf, own, gbytes()), g.section * gbytes(), st);
    else
      copy_pieces(pieces, grads, buf, gbytes(), true, st);
    rk.pool->free(buf, st);
  }

  // The schedule's all-gather of a chunk (the CPU engine's zero_gather).
  void zero_gather(CudaRank& rk, int i, const Op& op) {
    const StreamHandle st = rk.streams.comm;
    const int j = shape_.local_chunk(op);
    auto& z = rk.zero[static_cast<std::size_t>(j)];
    const Collective& c = collective_of(*schedule_, op);
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    if (gathers_units_ && op.microbatch >= 0) {
      // The first unit (op bucket 0), which the pass waits for, or the rest while it runs.
      gather_units(z.plan, gather_serves_forward(*rk.program, i), op.bucket == 1, rk.gather_gate, unit_key(j, 0),
                   [&](int u, int part) {
                     wait_event(st, z.unit_freed[static_cast<std::size_t>(u)].e);  // its last pass has let it go
                     for (const ShardGroup& g : z.plan.units[static_cast<std::size_t>(u)].groups)
                       gather_group(rk, j, g, members, collective_tag(rk.step, op.channel, part++), true);
                     record(z.unit_ready[static_cast<std::size_t>(u)].e, st);
                   });
      return;
    }
    const bool keep = op.microbatch < 0 || !z.gathered;
    gather_group(rk, j, z.plan.layout.whole(), members, collective_tag(rk.step, op.channel), keep);
    z.gathered = true;
  }

  void gather_group(CudaRank& rk, int j, const ShardGroup& g, const std::vector<int>& members, std::uint64_t tag,
                    bool keep) {
    if (g.section == 0) return;
    const StreamHandle st = rk.streams.comm;
    const DType compute = plan_.config.precision.compute;
    const std::size_t count = g.section * static_cast<std::size_t>(plan_.dp);
    void* buf = rk.pool->allocate(count * wbytes(), st, fmt::format("rank {}: a parameter gather", rk.rank));
    const std::size_t own = static_cast<std::size_t>(position(rk)) * g.section;
    copy_device_to_device(at(buf, own, wbytes()), at(const_cast<void*>(working_shard(rk, j)), g.shard_offset, wbytes()),
                          g.section * wbytes(), st);
    rk.comm->all_gather(buf, count, compute, members, tag, st);
    auto& z = rk.zero[static_cast<std::size_t>(j)];
    if (keep)
      for (int p = 0; p < plan_.dp; ++p)
        copy_pieces(z.plan.layout.section_pieces(g, p), rk.chunks[static_cast<std::size_t>(j)].compute_weights_device(),
                    buf, wbytes(), true, st);
    rk.pool->free(buf, st);
  }

  // Each rank's shards from its own checkpoint; stages 1-2 keep the whole weights between steps,
  // assembled from every member's shard of the checkpoint (the others gather before use).
  void restore_zero(const Checkpoint& ck) {
    for (auto& r : ranks_) {
      CudaRank& rk = *r;
      partition_->make_current(rk.partition_index);
      const StreamHandle cs = rk.streams.compute;
      std::vector<std::size_t> sizes;
      for (auto& z : rk.zero) sizes.push_back(z.plan.layout.shard_size());
      const RankCheckpoint& rc = checkpoint_of(ck.ranks, rk.rank);
      const std::vector<ChunkState> chunks = unpack_rank(rc, sizes);
      std::vector<std::vector<float>> whole(rk.chunks.size());
      for (std::size_t j = 0; j < rk.chunks.size(); ++j) {
        auto& z = rk.zero[j];
        auto& opt = rk.optimizers[j];
        copy_host_to_device(z.master.data(), chunks[j].master_weights.data(), sizes[j] * sizeof(float), cs);
        if (opt.m.bytes() > 0 && !chunks[j].first_moment.empty()) {
          copy_host_to_device(opt.m.data(), chunks[j].first_moment.data(), sizes[j] * sizeof(float), cs);
          copy_host_to_device(opt.v.data(), chunks[j].second_moment.data(), sizes[j] * sizeof(float), cs);
        }
        opt.steps = chunks[j].optimizer_steps;
        refresh_working_shard(rk, static_cast<int>(j));
        if (!plan_.gathers_after_step()) continue;
        CudaStageModel& model = rk.chunks[j];
        whole[j] = model.master_weights_to_host();
        const std::vector<int> group = world_.data_parallel_group(rk.rank);
        for (int p = 0; p < static_cast<int>(group.size()); ++p)
          z.plan.layout.put(p, unpack_rank(checkpoint_of(ck.ranks, group[static_cast<std::size_t>(p)]), sizes)[j].master_weights,
                            whole[j]);
        model.set_master_weights(whole[j]);
      }
      rk.scaler->restore(rc.scaler);
      synchronize(cs);
    }
  }

  void prepare_step(CudaRank& rk, int step, std::uint64_t data_position) {
    rk.step = step;
    rk.memory.reset_peak();
    rk.pool->reset_high();
    rk.batches.clear();
    if (shape_.needs_data(rk.stage))
      for (int mb = 0; mb < shape_.microbatches; ++mb)
        rk.batches.push_back(data_.microbatch(data_position, rk.replica, mb, plan_.dp, plan_.micro_batch_size));
    for (auto* v : {&rk.act_in, &rk.act_out, &rk.grad_out, &rk.grad_in}) v->assign(shape_.slots(), nullptr);
    rk.units_done.assign(shape_.slots(), 0);
    rk.buffer_elements = 0;
    for (auto& c : rk.chunks) c.zero_gradients();
    for (auto& z : rk.zero) {
      fill_zero(z.grads.data(), z.grads.bytes(), rk.streams.compute);
      z.gathered = false;
    }
    rk.staged.clear();
    rk.gather_gate.reset();
    rk.staged_bytes = rk.in_flight = 0;
    std::fill(rk.written.begin(), rk.written.end(), 0);
    std::fill(rk.staged_to.begin(), rk.staged_to.end(), 0);
    fill_zero(rk.flags.data(), rk.flags.bytes(), rk.streams.compute);
    fill_zero(rk.scans.data(), rk.scans.bytes(), rk.streams.compute);
    rk.walk.reset(rk.program->ops.size());
    if (rk.tensor_parallel) rk.tensor_parallel->restart(tensor_parallel_tag(step));
    rk.grad_norm = 0;
    rk.skipped = false;
    rk.found_nonfinite = false;
    rk.scale_used = rk.scaler->scale();
    rk.error = nullptr;
  }

  // Waits on the host for `stream` mid-step. Over NCCL the stream may hold a receive or an
  // all-reduce waiting for a peer that died: the communicator polls under its watchdog
  // instead of blocking in CUDA, so that becomes an error naming the rank and the op.
  void wait_idle(CudaRank& rk, StreamHandle stream, const std::string& what) {
    if (nccl_)
      nccl_->synchronize(stream, fmt::format("rank {}, step {}: {}", rk.rank, rk.step, what));
    else
      synchronize(stream);
  }

  // Makes `stream` wait for op `dep` of this rank, once its thread has queued it.
  void wait_for(CudaRank& rk, int dep, StreamHandle stream) {
    rk.walk.wait(dep);
    wait_event(stream, rk.end[static_cast<std::size_t>(dep)].e);
  }

  std::size_t act_elems(const CudaRank& rk) const { return rk.chunks[0].activation_elements(); }
  DType act_format() const { return plan_.config.precision.compute; }

  void* alloc(CudaRank& rk, void*& buf, StreamHandle stream) {
    const std::size_t bytes = act_elems(rk) * dtype_bytes(act_format());
    buf = rk.pool->allocate(bytes, stream, fmt::format("rank {}: a buffer in flight", rk.rank));
    rk.buffer_elements += act_elems(rk);
    return buf;
  }
  void release(CudaRank& rk, void*& buf, StreamHandle stream) {
    if (!buf) return;
    rk.pool->free(buf, stream);
    rk.buffer_elements -= act_elems(rk);
    buf = nullptr;
  }

  k::TensorScan* scan_of(CudaRank& rk, int op) { return rk.scans.as<k::TensorScan>() + op; }
  int* flag(CudaRank& rk, std::size_t at) { return rk.flags.as<int>() + at; }
  Scalars* scalars(CudaRank& rk) { return rk.scalars.as<Scalars>(); }

  float gradient_scale(const CudaRank& rk) const { return loss_gradient_scale(rk.scaler->scale(), shape_.microbatches); }
  // The rank a point-to-point op of the cell's program talks to: the same shard of the peer cell.
  int peer(const CudaRank& rk, const Op& op) const { return world_.shard(op.peer, rk.shard); }

  // A send waits (on the device) for everything queued on the compute stream before it, and
  // runs on the send stream, so the compute that follows never waits for the receiver.
  void send(CudaRank& rk, int i, const Op& op) {
    const StreamHandle cs = rk.streams.compute, ss = rk.streams.send;
    record(rk.start[static_cast<std::size_t>(i)].e, cs);
    wait_event(ss, rk.start[static_cast<std::size_t>(i)].e);
    void*& buf = op.kind == OpKind::SendActivation ? rk.act_out[shape_.slot(op)] : rk.grad_in[shape_.slot(op)];
    rk.comm->send(peer(rk, op), message_tag(rk.step, op.channel), buf, act_elems(rk), act_format(), ss);
    release(rk, buf, ss);
    record(rk.end[static_cast<std::size_t>(i)].e, ss);
  }

  void run_op(CudaRank& rk, int index, const Op& op) {
    const StreamHandle cs = rk.streams.compute;
    const int vs = op.chunk;
    const int s = shape_.slot(op);
    switch (op.kind) {
      case OpKind::RecvActivation:
      case OpKind::RecvGradient: {
        void*& buf = op.kind == OpKind::RecvActivation ? rk.act_in[s] : rk.grad_out[s];
        rk.comm->recv(peer(rk, op), message_tag(rk.step, op.channel), alloc(rk, buf, cs), act_elems(rk), act_format(), cs);
        return;
      }
      case OpKind::Forward: {
        CudaStageModel& model = rk.chunks[shape_.local_chunk(op)];
        const auto* batch = rk.batches.empty() ? nullptr : &rk.batches[op.microbatch];
        const bool last = shape_.last(vs);
        void* out = last ? nullptr : alloc(rk, rk.act_out[s], cs);
        const void* in = shape_.first(vs) ? nullptr : rk.act_in[s];
        if (gathers_units_) rk.zero[static_cast<std::size_t>(shape_.local_chunk(op))].gate->begin(true);
        model.forward(op.microbatch, shape_.first(vs) ? batch->tokens.data() : nullptr,
                      last ? batch->targets.data() : nullptr, in, out);
        if (!shape_.first(vs)) release(rk, rk.act_in[s], cs);
        if (!last) k::scan_tensor(scan_of(rk, index), out, act_elems(rk), act_format(), cs);
        return;
      }
      case OpKind::Backward: {
        CudaStageModel& model = rk.chunks[shape_.local_chunk(op)];
        const bool last = shape_.last(vs);
        const void* grad_output = last ? nullptr : rk.grad_out[s];
        if (gathers_units_ && op.bucket <= 0) rk.zero[static_cast<std::size_t>(shape_.local_chunk(op))].gate->begin(false);
        if (!backward_segment(model, op, buckets_.ranges[vs], rk.units_done[s], grad_output, gradient_scale(rk)))
          return;
        void* gin = shape_.first(vs) ? nullptr : alloc(rk, rk.grad_in[s], cs);
        model.backward_end(op.microbatch, gin);
        if (gin) k::scan_tensor(scan_of(rk, index), gin, act_elems(rk), act_format(), cs);
        if (!last) release(rk, rk.grad_out[s], cs);
        return;
      }
      case OpKind::BackwardInput: {
        CudaStageModel& model = rk.chunks[shape_.local_chunk(op)];
        const bool last = shape_.last(vs);
        void* gin = shape_.first(vs) ? nullptr : alloc(rk, rk.grad_in[s], cs);
        if (gathers_units_) rk.zero[static_cast<std::size_t>(shape_.local_chunk(op))].gate->begin(false);
        model.backward_input(op.microbatch, last ? nullptr : rk.grad_out[s], gradient_scale(rk), gin);
        if (gin) k::scan_tensor(scan_of(rk, index), gin, act_elems(rk), act_format(), cs);
        if (!last) release(rk, rk.grad_out[s], cs);
        return;
      }
      case OpKind::BackwardWeight:
        weight_segment(rk.chunks[static_cast<std::size_t>(shape_.local_chunk(op))], op, buckets_.ranges[vs]);
        return;
      case OpKind::OptimizerStep: optimizer_step(rk, index); return;
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: op {} ({}) cannot run on the compute stream", rk.rank, index,
                                       op_label(op)));
  }

  // Local overflow check: only what this rank computed itself, before any reduction.
  void local_overflow_check(CudaRank& rk) {
    if (plan_.dp != 1) return;  // the data-parallel all-reduces raised the local flag as they went
    for (auto& ch : rk.chunks)
      k::unscale_and_check(ch.gradients_device(), ch.num_parameters(), 1.0f, flag(rk, rk.flags_at.local()),
                           ch.gradient_format(), rk.streams.comm);
  }

  void run_collective(CudaRank& rk, int i, const Op& op) {
    const auto& pr = plan_.config.precision;
    const StreamHandle st = rk.streams.comm;
    // A local overflow check (channel -1) is no collective of the schedule: it has no entry.
    if (op.kind == OpKind::OverflowCheck && op.channel < 0) return local_overflow_check(rk);
    const std::uint64_t tag = collective_tag(rk.step, op.channel);
    const auto at = static_cast<std::size_t>(i);
    const Collective& c = collective_of(*schedule_, op);
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    if (!rk.zero.empty()) {  // ZeRO's collectives work on shards
      if (op.kind == OpKind::ReduceScatter) return zero_reduce_scatter(rk, i, op);
      if (op.kind == OpKind::AllGather) return zero_gather(rk, i, op);
      if (op.kind == OpKind::AllReduce && c.purpose == CollectivePurpose::embedding) return zero_embedding_sum(rk, i, op);
    }
    switch (op.kind) {
      case OpKind::AllReduce: {
        CudaStageModel& model = rk.chunks[shape_.local_chunk(op)];
        const DType gdt = model.gradient_format();
        const auto [first, count] = collective_range(op, buckets_, model.token_embedding());
        void* grads = offset(model.gradients_device(), first, gdt);
        const bool data_parallel = c.purpose == CollectivePurpose::gradients;
        // Multiplying by 1 changes no value: these passes only raise flags.
        k::unscale_and_check(grads, count, 1.0f, flag(rk, rk.flags_at.before(at)), gdt, st);
        if (data_parallel) k::unscale_and_check(grads, count, 1.0f, flag(rk, rk.flags_at.local()), gdt, st);
        const Divide divide = divide_of(c, pr);
        if (pr.allreduce == gdt) {
          rk.comm->all_reduce(grads, count, gdt, members, tag, ReduceOp::sum, divide, st);
        } else {
          // NCCL reduces in the buffer's type: cast to the wire format and back.
          void* wire = rk.pool->allocate(count * dtype_bytes(pr.allreduce), st,
                                         fmt::format("rank {}: the all-reduce's {} copy", rk.rank,
                                                     dtype_name(pr.allreduce)));
          k::cast(wire, pr.allreduce, grads, gdt, count, st);
          rk.comm->all_reduce(wire, count, pr.allreduce, members, tag, ReduceOp::sum, divide, st);
          k::cast(grads, gdt, wire, pr.allreduce, count, st);
          rk.pool->free(wire, st);
        }
        k::unscale_and_check(grads, count, 1.0f, flag(rk, rk.flags_at.after(at)), gdt, st);
        return;
      }
      case OpKind::OverflowCheck: {
        for (auto& ch : rk.chunks)
          k::unscale_and_check(ch.gradients_device(), ch.num_parameters(), 1.0f, flag(rk, rk.flags_at.global()),
                               ch.gradient_format(), st);
        for (auto& z : rk.zero)  // (ZeRO: the reduced gradients are these)
          k::unscale_and_check(z.grads.data(), z.plan.layout.shard_size(), 1.0f, flag(rk, rk.flags_at.global()),
                               pr.grad_accumulation, st);
        float* verdict = &scalars(rk)->verdict;
        k::flag_to_float(verdict, flag(rk, rk.flags_at.global()), st);
        rk.comm->all_reduce(verdict, 1, DType::fp32, members, tag, ReduceOp::max, Divide::none, st);
        return;
      }
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: {} is not a collective of this plan (ZeRO stage {})", rk.rank,
                                       op_label(op), plan_.zero()));
  }

  void optimizer_step(CudaRank& rk, int index) {
    const auto& cfg = plan_.config;
    const StreamHandle cs = rk.streams.compute;
    const auto& ops = rk.program->ops;
    // Every collective before it has reduced the gradients this updates (those after it, ZeRO's
    // gather of the updated parameters, wait for it).
    int overflow_op = -1;
    for (int j = 0; j < index; ++j)
      if (is_collective(ops[j].kind)) {
        wait_for(rk, j, cs);
        if (ops[j].kind == OpKind::OverflowCheck) overflow_op = j;
      }
    Scalars* sc = scalars(rk);
    const float inv_scale = static_cast<float>(1.0 / rk.scaler->scale());
    fill_zero(&sc->sumsq, sizeof(double), cs);
    // What each chunk updates: all of it, or under ZeRO this rank's shard (the CPU engine's Part).
    struct Part {
      void* grads;
      float* master;
      std::size_t n;
      std::vector<std::pair<std::size_t, std::size_t>> counted;  // norm_ranges, in what it updates
      const std::uint8_t* mask;
    };
    std::vector<Part> parts;
    for (int j = 0; j < shape_.vpp; ++j) {
      CudaStageModel& model = rk.chunks[static_cast<std::size_t>(j)];
      auto counted = norm_ranges(shape_.vstage_of_chunk(rk.stage, j), shape_.virtual_stages, model.params(),
                                 model.token_embedding(), rk.shard);
      if (rk.zero.empty()) {
        parts.push_back({model.gradients_device(), model.master_weights_device(), model.num_parameters(),
                         std::move(counted), rk.optimizers[static_cast<std::size_t>(j)].mask.as<std::uint8_t>()});
        continue;
      }
      auto& z = rk.zero[static_cast<std::size_t>(j)];
      if (!plan_.reduces_every_microbatch()) take_flat_gradients(rk, j);  // stage 1: the shard, from in place
      parts.push_back({z.grads.data(), z.master.as<float>(), z.plan.layout.shard_size(),
                       shard_ranges(z.plan.layout, counted), z.mask.as<std::uint8_t>()});
    }
    for (int j = 0; j < shape_.vpp; ++j) {
      const Part& part = parts[static_cast<std::size_t>(j)];
      void* g = part.grads;
      const std::size_t n = part.n;
      const DType gdt = cfg.precision.grad_accumulation;
      k::scan_tensor(scan_of(rk, index), g, n, gdt, cs);  // the scaled gradients, as the backward left them
      // No loss scaling: nothing to unscale (x * 1 is x, NaN and inf included), as on the CPU
      // engine and in the optimizer's kernel inventory (core/kernel_inventory.h): two passes over
      // the gradients saved.
      if (inv_scale != 1.0f) k::unscale_and_check(g, n, inv_scale, flag(rk, rk.flags_at.unused()), gdt, cs);
      // This rank's share of the global squared norm (norm_ranges), each element once over the
      // data-parallel group: a replica's whole copy counts 1/dp (below), a shard once.
      double* scratch = rk.scratch.as<double>();
      for (const auto& [from, to] : part.counted)
        k::squared_norm(&sc->sumsq, offset(g, from, gdt), to - from, gdt, scratch, true, cs);
    }
    // Read back through pinned memory: a copy into pageable memory would block in CUDA until the
    // stream drains, outside wait_idle's watchdog (stream_ops.h).
    auto* host_scalars = static_cast<Scalars*>(rk.readback->data());
    int* host_flags = reinterpret_cast<int*>(host_scalars + 1);
    const std::size_t num_flags = rk.flags_at.count();
    copy_device_to_host(host_scalars, sc, sizeof(Scalars), cs);
    copy_device_to_host(host_flags, rk.flags.data(), num_flags * sizeof(int), cs);
    wait_idle(rk, cs, "the optimizer step's overflow verdict and squared norm");
    const Scalars host = *host_scalars;
    const std::vector<int> flags(host_flags, host_flags + num_flags);
    host_scalars->norm = static_cast<float>(rk.zero.empty() ? host.sumsq / plan_.dp : host.sumsq);
    copy_host_to_device(&sc->norm, &host_scalars->norm, sizeof(float), cs);
    rk.comm->all_reduce(&sc->norm, 1, DType::fp32, world_.everyone(), norm_tag(rk.step, *schedule_), ReduceOp::sum,
                        Divide::none, cs);
    copy_device_to_host(&host_scalars->norm, &sc->norm, sizeof(float), cs);
    wait_idle(rk, cs, "the gradient norm's all-reduce");
    rk.grad_norm = std::sqrt(static_cast<double>(host_scalars->norm));

    if (overflow_op >= 0)
      rk.found_nonfinite = ops[static_cast<std::size_t>(overflow_op)].channel < 0 ? flags[rk.flags_at.local()] != 0
                                                                                  : !(host.verdict == 0.0f);
    const bool checks = cfg.precision.loss_scaling.mode != LossScalingMode::none;
    rk.skipped = rk.scaler->update(checks && rk.found_nonfinite);
    if (rk.skipped) return;
    const float coef = clip_coefficient(cfg.training.clip_grad, rk.grad_norm);
    const OptimizerSettings os = optimizer_settings(cfg);
    for (int j = 0; j < shape_.vpp; ++j) {
      const Part& part = parts[static_cast<std::size_t>(j)];
      auto& opt = rk.optimizers[static_cast<std::size_t>(j)];
      ++opt.steps;
      update_chunk(os, part.master, opt.m.as<float>(), opt.v.as<float>(), part.grads, cfg.precision.grad_accumulation,
                   part.mask, part.n, opt.steps, coef, cs);
      if (rk.zero.empty())
        round_master(rk, j);
      else
        round_master_shard(rk, j);
    }
  }

  // The CPU engine's accounting (memory_accounting.h), from device buffers.
  void account_memory(CudaRank& rk, double working = 0, double writing = 0) {
    const MemoryBreakdown now = rank_memory(
        plan_, rk.chunks.size(),
        [&](std::size_t j) {
          const CudaStageModel& c = rk.chunks[j];
          ChunkHeld h;
          h.params = static_cast<double>(c.num_parameters());
          h.shard = rk.zero.empty() ? h.params : static_cast<double>(rk.zero[j].plan.layout.shard_size());
          h.moment_bytes = static_cast<double>(rk.optimizers[j].m.bytes() + rk.optimizers[j].v.bytes());
          if (plan_.reduces_every_microbatch() && rk.written[j] > rk.staged_to[j])
            h.unsharded = static_cast<double>(rk.written[j] - rk.staged_to[j]);
          h.activation_bytes = static_cast<double>(c.activation_bytes());
          return h;
        },
        RankHeld{static_cast<double>(rk.buffer_elements), rk.in_flight, gathered_bytes_, working, writing});
    if (now.total() > rk.peak_bytes) {
      rk.peak_bytes = now.total();
      rk.peak = now;
    }
  }

  RankReport summarize(CudaRank& rk) {
    RankReport rep;
    RankStep& s = rep.step;
    RankStepNumerics& n = s.numerics;
    rep.peak = rk.peak;
    if (rk.error) {
      s.error = error_text(rk.error);
      // (An error of the streams' final wait, after the walk, is stamped when it is reported.)
      s.failed_at_ns = rk.walk.failed_at_ns() != 0 ? rk.walk.failed_at_ns() : failure_clock_ns();
      return rep;
    }
    // A rank's account only grows within a step (stashes are kept for reuse), so its peak is
    // its size at the end, reached no later than the pool's peak except on the first step.
    rep.allocated_peak = rk.memory.peak() + rk.pool->used_high();
    const auto& ops = rk.program->ops;
    s.timing.resize(ops.size());
    s.arrival.assign(ops.size(), -1);
    std::uint64_t clock[2] = {};
    copy_device_to_host(clock, rk.epoch_clock.data(), sizeof clock, rk.streams.compute);  // pageable: waits
    // Where the comm epoch falls on the compute epoch's time line (ns -> ps).
    const Tick comm_epoch_at = (static_cast<Tick>(clock[1]) - static_cast<Tick>(clock[0])) * 1000;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      // Events of one context measured from that context's epoch, then moved onto one time line.
      const bool comm = is_collective(ops[i].kind);
      const EventHandle origin = comm ? rk.comm_epoch->e : rk.epoch->e;
      const Tick shift = comm ? comm_epoch_at : 0;
      s.timing[i] = {ticks_between(origin, rk.start[i].e) + shift, ticks_between(origin, rk.end[i].e) + shift};
      if (comm) s.arrival[i] = s.timing[i].start;
    }
    std::vector<k::TensorScan> scans(std::max<std::size_t>(ops.size(), 1));
    copy_device_to_host(scans.data(), rk.scans.data(), rk.scans.bytes(), rk.streams.compute);
    std::vector<int> flags(rk.flags_at.count());
    copy_device_to_host(flags.data(), rk.flags.data(), flags.size() * sizeof(int), rk.streams.compute);
    synchronize(rk.streams.compute);
    // The first op, in time, whose output held inf/NaN, or whose all-reduce made them.
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      std::string what;
      const double max_abs = k::scan_max_abs(scans[i]);
      if (op.kind == OpKind::Forward) n.max_abs_activation = std::max(n.max_abs_activation, max_abs);
      if (op.kind == OpKind::Backward || op.kind == OpKind::BackwardInput || op.kind == OpKind::OptimizerStep)
        n.max_abs_gradient = std::max(n.max_abs_gradient, max_abs);
      n.nonfinite_count += static_cast<std::int64_t>(scans[i].nonfinite);
      if (scans[i].nonfinite > 0)
        what = op.kind == OpKind::Forward    ? fmt::format("forward output of micro-batch {}", op.microbatch)
               : op.kind == OpKind::Backward || op.kind == OpKind::BackwardInput
                   ? fmt::format("input gradient of micro-batch {}", op.microbatch)
                                             : std::string("the accumulated weight gradients");
      if (op.kind == OpKind::AllReduce && flags[rk.flags_at.before(i)] == 0 && flags[rk.flags_at.after(i)] != 0)
        what = allreduce_label(op, plan_.config.precision.allreduce);
      if (op.kind == OpKind::ReduceScatter && flags[rk.flags_at.before(i)] == 0 && flags[rk.flags_at.after(i)] != 0)
        what = fmt::format("{} reduce-scatter of gradient bucket {}", dtype_name(plan_.config.precision.allreduce),
                           op.bucket);
      if (!what.empty() && (s.first_nonfinite_at < 0 || s.timing[i].start < s.first_nonfinite_at)) {
        s.first_nonfinite_at = s.timing[i].start;
        n.first_nonfinite = fmt::format("{} (stage {}, replica {})", what, rk.stage, rk.replica);
      }
    }
    // The last stage's losses, read once the step's streams are idle.
    for (std::size_t j = 0; j < rk.chunks.size(); ++j)
      if (shape_.last(shape_.vstage_of_chunk(rk.stage, static_cast<int>(j))))
        for (float loss : rk.chunks[j].losses(shape_.microbatches)) {
          s.loss_sum += loss;
          ++s.loss_count;
        }
    s.grad_norm = rk.grad_norm;
    n.skipped = rk.skipped;
    n.found_nonfinite = rk.found_nonfinite;
    n.loss_scale = rk.scale_used;
    // One download of the master weights per step: the checksum, and the drift between replicas.
    s.weights_hash = download_masters(rk);
    return rep;
  }

  // The rank's master weights (under ZeRO its shard) into CudaRank::master_copy; their checksum.
  std::uint64_t download_masters(CudaRank& rk) {
    std::uint64_t h = kFnvOffset;
    rk.master_copy.clear();
    for (std::size_t j = 0; j < rk.chunks.size(); ++j) {
      if (rk.zero.empty()) {
        rk.master_copy.push_back(rk.chunks[j].master_weights_to_host());
      } else {  // the rank's shard: what it holds of the master
        std::vector<float>& shard = rk.master_copy.emplace_back(rk.zero[j].plan.layout.shard_size());
        copy_device_to_host(shard.data(), rk.zero[j].master.data(), shard.size() * sizeof(float), rk.streams.compute);
        synchronize(rk.streams.compute);
      }
      h = fnv1a(h, rk.master_copy.back());
    }
    return h;
  }

  InjectedFault fault_;  // RunOptions::fault
  const RuntimePlan& rp_;
  const Plan& plan_;
  const Dataset& data_;
  World world_;
  StepShape shape_;
  std::shared_ptr<const Schedule> schedule_;
  GradientBuckets buckets_;
  std::unique_ptr<SmPartition> partition_;
  std::unique_ptr<DeviceWorld> device_world_;
  NcclCommunicator* nccl_ = nullptr;  // one process per GPU: this rank's communicator
  std::vector<std::unique_ptr<CudaRank>> ranks_;  // this process's ranks
  bool all_local_ = true;
  std::string execution_;
  std::vector<MemoryBreakdown> peaks_;  // per rank of the world, over the steps every rank completed
  std::vector<double> allocated_;
  bool gathers_units_ = false;  // ZeRO-3: weights gathered unit by unit before every pass
  bool stages_buckets_ = false;  // ZeRO-2/3: every micro-batch's buckets go to their reduce-scatters
  double gathered_bytes_ = 0;   // the two units a stage-3 rank holds at most
};

}  // namespace

std::unique_ptr<DeviceEngine> make_cuda_engine(const RuntimePlan& plan, const Dataset& data, const RunOptions& options) {
  check_supported(plan.plan);
  std::string why;
  if (!k::device_available(&why)) throw std::runtime_error("the CUDA backend needs a GPU: " + why);
  return std::make_unique<CudaEngine>(plan, data, options);
}

RunReport run_cuda(const RuntimePlan& plan, const RunOptions& options, const CudaRunOptions& cuda) {
  RunOptions o = options;
  o.placement = cuda;
  return run(cuda_backend(), plan, o);
}

const Backend& cuda_backend() {
  static const Backend backend{
      .name = "cuda",
      .title = "CUDA",
      .help = "cuBLAS, our kernels; NCCL under a launcher",
      .engine = make_cuda_engine,
      .describe = [](const RuntimePlan& plan, const std::string& name,
                     const CalibrateOptions& options) { return describe_cuda_profile(plan, name, options.placement); },
      .kernels = [](const RuntimePlan& plan, const CalibrateOptions& options) -> std::unique_ptr<KernelCalibrator> {
        check_supported(plan.plan);  // before any kernel is timed at shapes its stage model would refuse
        return std::make_unique<CudaKernelCalibrator>(plan, options, options.placement);
      },
      .calibrates_format = stored_by_kernels,
      .comm_bench = [](const CommBenchOptions& options,
                       const Placement& placement) { return bench_device_world_comm(options, placement.device); },
      .comm_where = " on the single-GPU world",
      .comm_ranks = [](const RuntimePlan& plan) { return std::max(2, plan.plan.num_ranks()); },  // all on one GPU
      .kernel_clock = "CUDA events on rank 0's stream",
      .launched = true,
  };
  return backend;
}

}  // namespace trainsim::runtime::cuda
