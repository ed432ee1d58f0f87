// The CUDA engine (cuda_engine.h). runtime/cpu/cpu_engine.cpp is the reference for every decision
// about numerics; this file follows it op by op, with device buffers, streams and events where that
// one has vectors, threads and clocks. The run (steps, numerics log, checkpoints, the result) is
// the run loop's (runtime/loop/run_loop.h).
#include "runtime/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
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
#include "runtime/engine/rank_threads.h"
#include "runtime/engine/schedule_ops.h"
#include "runtime/engine/weights.h"
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
  // The step's start on the compute stream; comm_epoch is the same instant on the comm stream (it
  // is recorded there right after the comm stream waits for epoch), the origin of the
  // collectives' times.
  std::unique_ptr<Event> epoch, comm_epoch;
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
}

int current_device() {
  int d = 0;
  check_cuda(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

class CudaEngine final : public DeviceEngine {
 public:
  CudaEngine(const RuntimePlan& rp, const Dataset& data, const RunOptions& options)
      : rp_(rp), plan_(rp.plan), data_(data), world_(World::of(rp.plan)), shape_(rp.plan) {
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
      local.push_back(placement.launch->rank);
      ranks_.push_back(std::make_unique<CudaRank>());
      ranks_.back()->comm = std::move(comm);
    } else {
      partition_ = std::make_unique<SmPartition>(world, placement.sm_sharing, placement.device);
      device_world_ = std::make_unique<DeviceWorld>(world, options.comm_timeout);
      keep_default_pool_memory(placement.device);  // where the world stages its messages
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
      threads.emplace_back([this, r = rk.get()] {
        Driver driver(*this, *r);
        r->error = r->walk.run(r->rank, *r->program, driver);
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
      wait_event(rk_.streams.send, rk_.epoch->e);
    }
    void start_comm_thread() override {
      e_.partition_->make_current(rk_.partition_index, RankThread::comm);
      wait_event(rk_.streams.comm, rk_.epoch->e);
      record(rk_.comm_epoch->e, rk_.streams.comm);
    }
    void run_compute(int i) override {
      const Op& op = rk_.program->ops[static_cast<std::size_t>(i)];
      if (is_send(op.kind)) {
        e_.send(rk_, i, op);
        return;
      }
      record(rk_.start[static_cast<std::size_t>(i)].e, rk_.streams.compute);
      e_.run_op(rk_, i, op);
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
    void abort(const std::string& reason) override { rk_.comm->abort(reason); }

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
        model.backward_input(op.microbatch, last ? nullptr : rk.grad_out[s], gradient_scale(rk), gin);
        if (gin) k::scan_tensor(scan_of(rk, index), gin, act_elems(rk), act_format(), cs);
        if (!last) release(rk, rk.grad_out[s], cs);
        return;
      }
      case OpKind::BackwardWeight:
        // Split at bucket bounds only in name: the weight pass runs whole in its first segment
        // (as the CPU engine).
        if (op.bucket <= 0) rk.chunks[shape_.local_chunk(op)].backward_weight(op.microbatch);
        return;
      case OpKind::OptimizerStep: optimizer_step(rk, index); return;
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: op {} ({}) cannot run on the compute stream", rk.rank, index,
                                       op_label(op)));
  }

  void run_collective(CudaRank& rk, int i, const Op& op) {
    const auto& pr = plan_.config.precision;
    const StreamHandle st = rk.streams.comm;
    const std::uint64_t tag = collective_tag(rk.step, op.channel);
    const Collective& c = schedule_->collectives[op.channel];
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    const auto at = static_cast<std::size_t>(i);
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
        if (op.channel < 0) {
          // Local: only what this rank computed itself, before any reduction.
          if (plan_.dp == 1)
            for (auto& ch : rk.chunks)
              k::unscale_and_check(ch.gradients_device(), ch.num_parameters(), 1.0f, flag(rk, rk.flags_at.local()),
                                   ch.gradient_format(), st);
          return;
        }
        for (auto& ch : rk.chunks)
          k::unscale_and_check(ch.gradients_device(), ch.num_parameters(), 1.0f, flag(rk, rk.flags_at.global()),
                               ch.gradient_format(), st);
        float* verdict = &scalars(rk)->verdict;
        k::flag_to_float(verdict, flag(rk, rk.flags_at.global()), st);
        rk.comm->all_reduce(verdict, 1, DType::fp32, members, tag, ReduceOp::max, Divide::none, st);
        return;
      }
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: {} is not executed by the runtime (ZeRO is not implemented)", rk.rank,
                                       op_label(op)));
  }

  void optimizer_step(CudaRank& rk, int index) {
    const auto& cfg = plan_.config;
    const StreamHandle cs = rk.streams.compute;
    const auto& ops = rk.program->ops;
    // Every collective of the step has reduced the gradients this updates.
    int overflow_op = -1;
    for (int j = 0; j < static_cast<int>(ops.size()); ++j)
      if (is_collective(ops[j].kind)) {
        wait_for(rk, j, cs);
        if (ops[j].kind == OpKind::OverflowCheck) overflow_op = j;
      }
    Scalars* sc = scalars(rk);
    const float inv_scale = static_cast<float>(1.0 / rk.scaler->scale());
    fill_zero(&sc->sumsq, sizeof(double), cs);
    for (int j = 0; j < shape_.vpp; ++j) {
      CudaStageModel& model = rk.chunks[static_cast<std::size_t>(j)];
      void* g = model.gradients_device();
      const std::size_t n = model.num_parameters();
      const DType gdt = model.gradient_format();
      k::scan_tensor(scan_of(rk, index), g, n, gdt, cs);  // the scaled gradients, as the backward left them
      k::unscale_and_check(g, n, inv_scale, flag(rk, rk.flags_at.unused()), gdt, cs);
      // This rank's share of the global squared norm (norm_ranges).
      double* scratch = rk.scratch.as<double>();
      for (const auto& [from, to] : norm_ranges(shape_.vstage_of_chunk(rk.stage, j), shape_.virtual_stages,
                                                model.params(), model.token_embedding(), rk.shard))
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
    host_scalars->norm = static_cast<float>(host.sumsq / plan_.dp);
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
      CudaStageModel& model = rk.chunks[static_cast<std::size_t>(j)];
      auto& opt = rk.optimizers[static_cast<std::size_t>(j)];
      const std::size_t n = model.num_parameters();
      const auto* mask = opt.mask.as<std::uint8_t>();
      ++opt.steps;
      update_chunk(os, model.master_weights_device(), opt.m.as<float>(), opt.v.as<float>(), model.gradients_device(),
                   model.gradient_format(), mask, n, opt.steps, coef, cs);
      round_master(rk, j);
    }
  }

  void account_memory(CudaRank& rk) {
    const auto& pr = plan_.config.precision;
    MemoryBreakdown now;
    for (std::size_t j = 0; j < rk.chunks.size(); ++j) {
      const CudaStageModel& c = rk.chunks[j];
      const auto n = static_cast<double>(c.num_parameters());
      now.weights += n * 4 + (pr.compute == DType::fp32 ? 0.0 : n * dtype_bytes(pr.compute));
      now.gradients += n * dtype_bytes(c.gradient_format());
      now.optimizer += static_cast<double>(rk.optimizers[j].m.bytes() + rk.optimizers[j].v.bytes());
      now.activations += static_cast<double>(c.activation_bytes());
    }
    now.buffers = static_cast<double>(rk.buffer_elements) * dtype_bytes(act_format());
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
      return rep;
    }
    // A rank's account only grows within a step (stashes are kept for reuse), so its peak is
    // its size at the end, reached no later than the pool's peak except on the first step.
    rep.allocated_peak = rk.memory.peak() + rk.pool->used_high();
    const auto& ops = rk.program->ops;
    s.timing.resize(ops.size());
    s.arrival.assign(ops.size(), -1);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      // Events of one context measured from that context's epoch (both epochs are one instant).
      const EventHandle origin = is_collective(ops[i].kind) ? rk.comm_epoch->e : rk.epoch->e;
      s.timing[i] = {ticks_between(origin, rk.start[i].e), ticks_between(origin, rk.end[i].e)};
      if (is_collective(ops[i].kind)) s.arrival[i] = s.timing[i].start;
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
    std::uint64_t h = kFnvOffset;
    rk.master_copy.clear();
    for (auto& c : rk.chunks) {
      rk.master_copy.push_back(c.master_weights_to_host());
      h = fnv1a(h, rk.master_copy.back());
    }
    s.weights_hash = h;
    return rep;
  }

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
