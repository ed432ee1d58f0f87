// The CUDA executor (executor_cuda.h). runtime/exec/executor.cpp is the reference for every
// decision about numerics and the report; this file follows it op by op, with device buffers,
// streams and events where that one has vectors, threads and clocks.
#include "runtime/cuda/executor_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "core/metrics.h"
#include "kernels/collective.h"
#include "kernels/device_buffer.h"
#include "kernels/kernels.h"
#include "runtime/cuda/device_world.h"
#include "runtime/cuda/nccl_communicator.h"
#include "runtime/cuda/stage_model_cuda.h"
#include "runtime/checkpoint.h"
#include "runtime/cuda/stream_ops.h"
#include "runtime/exec/step_common.h"
#include "runtime/numerics/loss_scaler.h"

namespace trainsim::runtime::cuda {

namespace k = ::trainsim::cuda;

namespace {

using Clock = std::chrono::steady_clock;

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess)
    throw std::runtime_error(what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}
cudaStream_t S(void* s) { return static_cast<cudaStream_t>(s); }

void* offset(void* base, std::size_t elements, DType dt) {
  return static_cast<char*>(base) + elements * static_cast<std::size_t>(dtype_bytes(dt));
}

// A timing event per op boundary, re-recorded every step; created in the calling thread's
// current context (Event(nullptr): none yet).
struct Event {
  cudaEvent_t e = nullptr;
  Event() { check(cudaEventCreate(&e), "cudaEventCreate"); }
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

Tick ticks_between(cudaEvent_t from, cudaEvent_t to) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, from, to), "cudaEventElapsedTime");
  return static_cast<Tick>(std::llround(static_cast<double>(ms) * 1e9));  // ms -> ps
}

// What one rank did in one step: the CPU executor reads this from its rank objects; here it
// also travels between processes (gather_host) when ranks are not all in this one.
struct RankSummary {
  std::vector<OpTiming> timing;
  std::vector<Tick> arrival;
  double loss_sum = 0;
  std::int32_t loss_count = 0;
  double grad_norm = 0;
  std::uint8_t skipped = 0, found_nonfinite = 0;
  double scale_used = 1;
  double max_abs_activation = 0, max_abs_gradient = 0;
  std::int64_t nonfinite = 0;
  Tick first_nonfinite_at = -1;
  std::string first_nonfinite;
  std::uint64_t weights_hash = 0;
  MemoryBreakdown peak;
  std::uint64_t allocated_peak = 0;  // bytes, from the allocators: its DeviceBuffers' peak + its pool's
  std::string error;  // non-empty: this rank failed
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
    if (at_ + sizeof(T) > b_.size()) throw std::runtime_error("CUDA executor: a rank's step record is truncated");
    T v;
    std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> vec() {
    const auto n = pod<std::uint64_t>();
    if (n > (b_.size() - at_) / sizeof(T)) throw std::runtime_error("CUDA executor: a rank's step record is truncated");
    std::vector<T> v(n);
    std::memcpy(v.data(), b_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return v;
  }
  std::string str() {
    const auto n = pod<std::uint64_t>();
    if (at_ + n > b_.size()) throw std::runtime_error("CUDA executor: a rank's step record is truncated");
    std::string s(b_.begin() + static_cast<std::ptrdiff_t>(at_), b_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += n;
    return s;
  }

 private:
  const std::vector<std::uint8_t>& b_;
  std::size_t at_ = 0;
};

std::vector<std::uint8_t> serialize(const RankSummary& s) {
  Writer w;
  w.vec(s.timing);
  w.vec(s.arrival);
  w.pod(s.loss_sum);
  w.pod(s.loss_count);
  w.pod(s.grad_norm);
  w.pod(s.skipped);
  w.pod(s.found_nonfinite);
  w.pod(s.scale_used);
  w.pod(s.max_abs_activation);
  w.pod(s.max_abs_gradient);
  w.pod(s.nonfinite);
  w.pod(s.first_nonfinite_at);
  w.str(s.first_nonfinite);
  w.pod(s.weights_hash);
  w.pod(s.peak);
  w.pod(s.allocated_peak);
  w.str(s.error);
  return std::move(w.bytes);
}

RankSummary deserialize(const std::vector<std::uint8_t>& bytes) {
  Reader r(bytes);
  RankSummary s;
  s.timing = r.vec<OpTiming>();
  s.arrival = r.vec<Tick>();
  s.loss_sum = r.pod<double>();
  s.loss_count = r.pod<std::int32_t>();
  s.grad_norm = r.pod<double>();
  s.skipped = r.pod<std::uint8_t>();
  s.found_nonfinite = r.pod<std::uint8_t>();
  s.scale_used = r.pod<double>();
  s.max_abs_activation = r.pod<double>();
  s.max_abs_gradient = r.pod<double>();
  s.nonfinite = r.pod<std::int64_t>();
  s.first_nonfinite_at = r.pod<Tick>();
  s.first_nonfinite = r.str();
  s.weights_hash = r.pod<std::uint64_t>();
  s.peak = r.pod<MemoryBreakdown>();
  s.allocated_peak = r.pod<std::uint64_t>();
  s.error = r.str();
  return s;
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
  int rank = 0, stage = 0, replica = 0;
  const RankProgram* program = nullptr;
  std::unique_ptr<DeviceCommunicator> comm;
  RankStreams streams;
  std::vector<CudaStageModel> chunks;  // local chunk j holds virtual stage j * pp + stage
  struct OptimizerBuffers {
    k::DeviceBuffer m, v, mask, master_rounding;
    std::int64_t steps = 0;
  };
  std::vector<OptimizerBuffers> optimizers;
  std::unique_ptr<LossScaler> scaler;

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
  std::vector<void*> act_in, act_out, grad_out, grad_in;  // [chunk * m + mb], stream-ordered allocations
  std::vector<int> units_done;
  OpCompletion queued;  // op i is queued on its stream (its end event recorded)
  double grad_norm = 0;
  bool skipped = false, found_nonfinite = false;
  double scale_used = 1;
  std::exception_ptr error, comm_error;

  std::vector<std::vector<float>> master_copy;  // this step's master weights on the host, per chunk

  std::size_t buffer_elements = 0;
  double peak_bytes = 0;
  MemoryBreakdown peak;

  CollectiveQueue collectives;  // to the communication thread
  std::thread comm_thread;
};

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

class Engine {
 public:
  Engine(const RuntimePlan& rp, const Dataset& data, const CudaRunOptions& cuda, std::chrono::milliseconds timeout)
      : rp_(rp), plan_(rp.plan), data_(data) {
    const auto& cfg = plan_.config;
    schedule_ = std::make_shared<const Schedule>(build_schedule(plan_));
    m_ = plan_.num_microbatches;
    pp_ = plan_.pp;
    dp_ = plan_.dp;
    vpp_ = plan_.vpp;
    V_ = plan_.num_virtual_stages();
    const int world = plan_.num_ranks();

    std::vector<int> local;
    if (cuda.launch) {
      if (cuda.launch->world_size != world)
        throw std::invalid_argument(fmt::format("the launcher started {} processes, the plan has {} ranks (dp {} x pp {})",
                                                cuda.launch->world_size, world, dp_, pp_));
      auto comm = NcclCommunicator::create(*cuda.launch, reduction_groups(*schedule_, world), timeout,
                                           p2p_links(*schedule_));
      nccl_ = comm.get();
      partition_ = std::make_unique<SmPartition>(1, SmSharing::shared, current_device());
      local.push_back(cuda.launch->rank);
      ranks_.push_back(std::make_unique<CudaRank>());
      ranks_.back()->comm = std::move(comm);
    } else {
      partition_ = std::make_unique<SmPartition>(world, cuda.sm_sharing, cuda.device);
      world_ = std::make_unique<DeviceWorld>(world, timeout);
      keep_default_pool_memory(cuda.device);  // where the world stages its messages
      for (int r = 0; r < world; ++r) {
        local.push_back(r);
        ranks_.push_back(std::make_unique<CudaRank>());
        ranks_.back()->comm = world_->communicator(r);
      }
    }
    all_local_ = static_cast<int>(local.size()) == world;
    execution_ = fmt::format("cuda: {}; {}", ranks_[0]->comm->describe(), partition_->describe());

    const OptimizerSettings os = optimizer_settings(cfg);
    std::vector<std::size_t> grad_elems(V_, 0);
    for (std::size_t li = 0; li < ranks_.size(); ++li) {
      CudaRank& rk = *ranks_[li];
      rk.rank = local[li];
      rk.stage = plan_.stage_of(rk.rank);
      rk.replica = plan_.replica_of(rk.rank);
      rk.program = &schedule_->ranks[rk.rank];
      rk.partition_index = all_local_ ? rk.rank : 0;
      rk.streams = partition_->streams(rk.partition_index);
      // Everything this rank creates (events, cuBLAS handles, buffers) belongs to its context
      // and is charged to its account.
      partition_->make_current(rk.partition_index);
      k::AccountScope charge(&rk.memory);
      rk.pool = std::make_unique<MemoryPool>(current_device());
      rk.epoch = std::make_unique<Event>();
      for (int j = 0; j < vpp_; ++j) {
        const int vs = j * pp_ + rk.stage;
        rk.chunks.emplace_back(stage_spec(rp_, vs), rk.streams.compute);
        CudaStageModel& model = rk.chunks.back();
        model.init(static_cast<std::uint64_t>(cfg.runtime.seed));
        const InFlight most = in_flight(*rk.program, vs);
        model.reserve(most.stashes, most.backwards, most.split_backwards, vs == V_ - 1 ? m_ : 0);
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
        grad_elems[vs] = model.num_parameters();
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
    for (int vs = 0; vs < V_; ++vs)
      if (grad_elems[vs] == 0) grad_elems[vs] = StageModel(stage_spec(rp_, vs)).gradients().size();
    buckets_ = gradient_buckets(*schedule_, V_, grad_elems);
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      synchronize(rk->streams.compute);
    }
  }

  std::shared_ptr<const Schedule> schedule() const { return schedule_; }
  const std::string& execution() const { return execution_; }
  bool all_local() const { return all_local_; }
  int world() const { return plan_.num_ranks(); }

  // Runs one optimizer step on this process's ranks; returns every rank's summary, indexed by rank.
  std::vector<RankSummary> run_step(int step, std::uint64_t data_position, double& seconds) {
    data_position_ = data_position;
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      prepare_step(*rk, step);
      synchronize(rk->streams.compute);
    }
    // The ranks' contexts are their own threads' now (sm_partition.h: one thread per green context).
    partition_->make_primary_current();
    const auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (auto& rk : ranks_) threads.emplace_back([this, r = rk.get()] { rank_main(*r); });
    for (auto& t : threads) t.join();
    for (auto& rk : ranks_)
      if (!rk->error) try {
          // Over NCCL a peer that died leaves this rank's streams waiting: the communicator's
          // synchronize polls its async errors under the watchdog instead of blocking.
          for (auto [s, thread] : {std::pair{rk->streams.compute, RankThread::compute},
                                   std::pair{rk->streams.send, RankThread::compute},
                                   std::pair{rk->streams.comm, RankThread::comm}}) {
            partition_->make_current(rk->partition_index, thread);
            if (nccl_)
              nccl_->synchronize(s, fmt::format("step {} of rank {}", step, rk->rank));
            else
              synchronize(s);
          }
        } catch (...) {
          rk->error = std::current_exception();
        }
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();

    std::vector<RankSummary> mine;
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      mine.push_back(summarize(*rk));
    }
    if (all_local_) return mine;
    std::vector<RankSummary> all;
    for (const auto& blob : ranks_[0]->comm->gather_host(serialize(mine[0]))) all.push_back(deserialize(blob));
    return all;
  }

  // Max |w(replica d) - w(replica 0)|, when every rank is in this process; -1 otherwise.
  double replica_drift() {
    if (!all_local_) return -1;
    double drift = 0;
    for (int s = 0; s < pp_; ++s)
      for (int d = 1; d < dp_; ++d)
        for (int j = 0; j < vpp_; ++j)
          drift = std::max(drift, weight_difference(ranks_[plan_.rank_of(s, 0)]->master_copy[j],
                                                    ranks_[plan_.rank_of(s, d)]->master_copy[j]));
    return drift;
  }

  // Every rank's state for a checkpoint, by rank, after a step that succeeded: its master weights
  // (as summarize downloaded them), moments, optimizer steps and loss scaler. With one process
  // per GPU every process takes part (gather_host) and gets all of them.
  std::vector<RankCheckpoint> checkpoint_state() {
    std::vector<RankCheckpoint> mine;
    for (auto& rk : ranks_) {
      partition_->make_current(rk->partition_index);
      RankCheckpoint rc;
      rc.rank = rk->rank;
      for (std::size_t j = 0; j < rk->chunks.size(); ++j) {
        const std::vector<float>& w = rk->master_copy[j];
        rc.master_weights.insert(rc.master_weights.end(), w.begin(), w.end());
        const auto& opt = rk->optimizers[j];
        if (opt.m.bytes() > 0) {
          for (auto [from, to] : {std::pair{&opt.m, &rc.first_moment}, std::pair{&opt.v, &rc.second_moment}}) {
            const std::size_t at = to->size();
            to->resize(at + w.size());
            copy_device_to_host(to->data() + at, from->data(), w.size() * sizeof(float), rk->streams.compute);
          }
        }
        rc.optimizer_steps = opt.steps;
      }
      synchronize(rk->streams.compute);
      rc.scaler = rk->scaler->state();
      mine.push_back(std::move(rc));
    }
    if (all_local_) return mine;
    std::vector<RankCheckpoint> all;
    for (const auto& blob : ranks_[0]->comm->gather_host(serialize(mine[0]))) all.push_back(deserialize_checkpoint(blob));
    return all;
  }

  // The process that writes files (checkpoints): the one holding rank 0.
  bool holds_rank_zero() const { return ranks_[0]->rank == 0; }

  // Loads this process's ranks from `ck` (a CPU or CUDA checkpoint of the same plan).
  void restore(const Checkpoint& ck) {
    if (static_cast<int>(ck.ranks.size()) != world())
      throw CheckpointError(fmt::format("checkpoint has {} ranks, the plan {}", ck.ranks.size(), world()));
    for (auto& rk : ranks_) {
      const auto rc = std::find_if(ck.ranks.begin(), ck.ranks.end(),
                                   [&](const RankCheckpoint& c) { return c.rank == rk->rank; });
      if (rc == ck.ranks.end()) throw CheckpointError(fmt::format("checkpoint holds no rank {}", rk->rank));
      partition_->make_current(rk->partition_index);
      void* cs = rk->streams.compute;
      std::size_t off = 0;
      for (std::size_t j = 0; j < rk->chunks.size(); ++j) {
        CudaStageModel& model = rk->chunks[j];
        auto& opt = rk->optimizers[j];
        const std::size_t n = model.num_parameters();
        if (off + n > rc->master_weights.size())
          throw CheckpointError(fmt::format("checkpoint rank {} holds fewer weights than the model", rc->rank));
        copy_host_to_device(model.master_weights_device(), rc->master_weights.data() + off, n * sizeof(float), cs);
        if (opt.m.bytes() > 0 && !rc->first_moment.empty()) {
          if (off + n > rc->first_moment.size() || off + n > rc->second_moment.size())
            throw CheckpointError(fmt::format("checkpoint rank {} holds fewer moments than the model", rc->rank));
          copy_host_to_device(opt.m.data(), rc->first_moment.data() + off, n * sizeof(float), cs);
          copy_host_to_device(opt.v.data(), rc->second_moment.data() + off, n * sizeof(float), cs);
        }
        opt.steps = rc->optimizer_steps;
        model.refresh_working_weights();
        off += n;
      }
      rk->scaler->restore(rc->scaler);
      synchronize(cs);
    }
  }

 private:
  static int current_device() {
    int d = 0;
    check(cudaGetDevice(&d), "cudaGetDevice");
    return d;
  }

  // Master weights held in a format other than fp32 are rounded to it after every update.
  void round_master(CudaRank& rk, int j) {
    const DType master = plan_.config.precision.master_weights;
    CudaStageModel& model = rk.chunks[j];
    if (master != DType::fp32) {
      const std::size_t n = model.num_parameters();
      void* tmp = rk.optimizers[j].master_rounding.data();
      k::cast(tmp, master, model.master_weights_device(), DType::fp32, n, rk.streams.compute);
      k::cast(model.master_weights_device(), DType::fp32, tmp, master, n, rk.streams.compute);
    }
    model.refresh_working_weights();
  }

  void prepare_step(CudaRank& rk, int step) {
    rk.step = step;
    rk.memory.reset_peak();
    rk.pool->reset_high();
    rk.batches.clear();
    const bool needs_data = rk.stage == 0 || rk.stage == pp_ - 1 || vpp_ > 1;
    if (needs_data)
      for (int mb = 0; mb < m_; ++mb)
        rk.batches.push_back(data_.microbatch(data_position_, rk.replica, mb, dp_, plan_.micro_batch_size));
    const std::size_t slots = static_cast<std::size_t>(vpp_) * m_;
    for (auto* v : {&rk.act_in, &rk.act_out, &rk.grad_out, &rk.grad_in}) v->assign(slots, nullptr);
    rk.units_done.assign(slots, 0);
    rk.buffer_elements = 0;
    for (auto& c : rk.chunks) c.zero_gradients();
    fill_zero(rk.flags.data(), rk.flags.bytes(), rk.streams.compute);
    fill_zero(rk.scans.data(), rk.scans.bytes(), rk.streams.compute);
    rk.queued.reset(rk.program->ops.size());
    rk.grad_norm = 0;
    rk.skipped = false;
    rk.found_nonfinite = false;
    rk.scale_used = rk.scaler->scale();
    rk.error = nullptr;
    rk.comm_error = nullptr;
  }

  void rank_main(CudaRank& rk) {
    void* cs = rk.streams.compute;
    k::AccountScope charge(&rk.memory);  // stashes are made on first use
    try {
      partition_->make_current(rk.partition_index, RankThread::compute);
      // Every stream of the rank starts the step at its epoch (the comm stream: comm_main).
      check(cudaEventRecord(rk.epoch->e, S(cs)), "cudaEventRecord(epoch)");
      check(cudaStreamWaitEvent(S(rk.streams.send), rk.epoch->e, 0), "cudaStreamWaitEvent(epoch)");
    } catch (...) {
      rk.error = std::current_exception();
      return;
    }
    rk.comm_thread = std::thread([this, &rk] { comm_main(rk); });
    try {
      const auto& ops = rk.program->ops;
      for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
        const Op& op = ops[i];
        if (is_collective(op.kind)) {
          rk.collectives.push(i);
          continue;
        }
        if (op.dep >= 0 && is_collective(ops[op.dep].kind)) wait_for(rk, op.dep, cs);
        if (op.kind == OpKind::SendActivation || op.kind == OpKind::SendGradient) {
          send(rk, i, op);
        } else {
          check(cudaEventRecord(rk.start[i].e, S(cs)), "cudaEventRecord");
          run_op(rk, i, op);
          check(cudaEventRecord(rk.end[i].e, S(cs)), "cudaEventRecord");
        }
        rk.queued.mark(i);
        account_memory(rk);
      }
    } catch (...) {
      rk.error = std::current_exception();
      rk.queued.fail(rk.error);
      abort_world(rk);
    }
    rk.collectives.push(-1);
    rk.comm_thread.join();
    if (!rk.error) rk.error = rk.comm_error;
  }

  // Waits on the host for `stream` mid-step. Over NCCL the stream may hold a receive or an
  // all-reduce waiting for a peer that died: the communicator polls under its watchdog
  // instead of blocking in CUDA, so that becomes an error naming the rank and the op.
  void wait_idle(CudaRank& rk, void* stream, const std::string& what) {
    if (nccl_)
      nccl_->synchronize(stream, fmt::format("rank {}, step {}: {}", rk.rank, rk.step, what));
    else
      synchronize(stream);
  }

  // Makes `stream` wait for op `dep` of this rank, once its thread has queued it.
  void wait_for(CudaRank& rk, int dep, void* stream) {
    rk.queued.wait(dep);
    check(cudaStreamWaitEvent(S(stream), rk.end[dep].e, 0), "cudaStreamWaitEvent");
  }

  void abort_world(CudaRank& rk) {
    rk.comm->abort(fmt::format("rank {} failed: {}", rk.rank, error_text(rk.error)));
  }

  void comm_main(CudaRank& rk) {
    void* st = rk.streams.comm;
    k::AccountScope charge(&rk.memory);
    try {
      partition_->make_current(rk.partition_index, RankThread::comm);
      check(cudaStreamWaitEvent(S(st), rk.epoch->e, 0), "cudaStreamWaitEvent(epoch)");
      check(cudaEventRecord(rk.comm_epoch->e, S(st)), "cudaEventRecord(comm epoch)");
    } catch (...) {
      rk.comm_error = std::current_exception();
      rk.queued.fail(rk.comm_error);
    }
    for (;;) {
      const int i = rk.collectives.pop();
      if (i < 0) return;
      if (rk.comm_error) continue;  // failed: drain the queue until the compute thread stops it
      const Op& op = rk.program->ops[i];
      try {
        if (op.dep >= 0) wait_for(rk, op.dep, st);
        // Recorded after the wait: the time this rank reached the collective.
        check(cudaEventRecord(rk.start[i].e, S(st)), "cudaEventRecord");
        run_collective(rk, i, op);
        check(cudaEventRecord(rk.end[i].e, S(st)), "cudaEventRecord");
        rk.queued.mark(i);
      } catch (...) {
        if (!rk.comm_error) rk.comm_error = std::current_exception();
        rk.queued.fail(std::current_exception());
        rk.comm->abort(fmt::format("rank {} failed in {}", rk.rank, op_label(op)));
      }
    }
  }

  int local_chunk(const Op& op) const { return op.chunk / pp_; }
  int slot(const Op& op) const { return local_chunk(op) * m_ + op.microbatch; }
  std::size_t act_elems(const CudaRank& rk) const { return rk.chunks[0].activation_elements(); }
  DType act_format() const { return plan_.config.precision.compute; }

  void* alloc(CudaRank& rk, void*& buf, void* stream) {
    const std::size_t bytes = act_elems(rk) * dtype_bytes(act_format());
    buf = rk.pool->allocate(bytes, stream, fmt::format("rank {}: a buffer in flight", rk.rank));
    rk.buffer_elements += act_elems(rk);
    return buf;
  }
  void release(CudaRank& rk, void*& buf, void* stream) {
    if (!buf) return;
    rk.pool->free(buf, stream);
    rk.buffer_elements -= act_elems(rk);
    buf = nullptr;
  }

  k::TensorScan* scan_of(CudaRank& rk, int op) { return rk.scans.as<k::TensorScan>() + op; }
  int* flag(CudaRank& rk, std::size_t at) { return rk.flags.as<int>() + at; }
  Scalars* scalars(CudaRank& rk) { return rk.scalars.as<Scalars>(); }

  float loss_gradient_scale(const CudaRank& rk) const { return static_cast<float>(rk.scaler->scale() / m_); }

  // A send waits (on the device) for everything queued on the compute stream before it, and
  // runs on the send stream, so the compute that follows never waits for the receiver.
  void send(CudaRank& rk, int i, const Op& op) {
    void* cs = rk.streams.compute;
    void* ss = rk.streams.send;
    check(cudaEventRecord(rk.start[i].e, S(cs)), "cudaEventRecord");
    check(cudaStreamWaitEvent(S(ss), rk.start[i].e, 0), "cudaStreamWaitEvent");
    void*& buf = op.kind == OpKind::SendActivation ? rk.act_out[slot(op)] : rk.grad_in[slot(op)];
    rk.comm->send(op.peer, message_tag(rk.step, op.channel), buf, act_elems(rk), act_format(), ss);
    release(rk, buf, ss);
    check(cudaEventRecord(rk.end[i].e, S(ss)), "cudaEventRecord");
  }

  void run_op(CudaRank& rk, int index, const Op& op) {
    void* cs = rk.streams.compute;
    const int vs = op.chunk;
    switch (op.kind) {
      case OpKind::RecvActivation:
        rk.comm->recv(op.peer, message_tag(rk.step, op.channel), alloc(rk, rk.act_in[slot(op)], cs), act_elems(rk),
                      act_format(), cs);
        return;
      case OpKind::RecvGradient:
        rk.comm->recv(op.peer, message_tag(rk.step, op.channel), alloc(rk, rk.grad_out[slot(op)], cs), act_elems(rk),
                      act_format(), cs);
        return;
      case OpKind::Forward: {
        CudaStageModel& model = rk.chunks[local_chunk(op)];
        const auto* batch = rk.batches.empty() ? nullptr : &rk.batches[op.microbatch];
        const bool last = vs == V_ - 1;
        void* out = last ? nullptr : alloc(rk, rk.act_out[slot(op)], cs);
        const void* in = vs == 0 ? nullptr : rk.act_in[slot(op)];
        model.forward(op.microbatch, vs == 0 ? batch->tokens.data() : nullptr, last ? batch->targets.data() : nullptr,
                      in, out);
        if (vs > 0) release(rk, rk.act_in[slot(op)], cs);
        if (!last) k::scan_tensor(scan_of(rk, index), out, act_elems(rk), act_format(), cs);
        return;
      }
      case OpKind::Backward: backward(rk, index, op); return;
      case OpKind::BackwardInput: {
        CudaStageModel& model = rk.chunks[local_chunk(op)];
        const bool last = vs == V_ - 1;
        void* gin = vs == 0 ? nullptr : alloc(rk, rk.grad_in[slot(op)], cs);
        model.backward_input(op.microbatch, last ? nullptr : rk.grad_out[slot(op)], loss_gradient_scale(rk), gin);
        if (gin) k::scan_tensor(scan_of(rk, index), gin, act_elems(rk), act_format(), cs);
        if (!last) release(rk, rk.grad_out[slot(op)], cs);
        return;
      }
      case OpKind::BackwardWeight:
        // Split at bucket bounds only in name: the weight pass runs whole in its first segment
        // (as the CPU executor).
        if (op.bucket <= 0) rk.chunks[local_chunk(op)].backward_weight(op.microbatch);
        return;
      case OpKind::OptimizerStep: optimizer_step(rk, index); return;
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: op {} ({}) cannot run on the compute stream", rk.rank, index,
                                       op_label(op)));
  }

  // A backward, or one segment of a backward cut at gradient-bucket bounds (as the CPU executor).
  void backward(CudaRank& rk, int index, const Op& op) {
    void* cs = rk.streams.compute;
    const int vs = op.chunk;
    CudaStageModel& model = rk.chunks[local_chunk(op)];
    const bool last_stage = vs == V_ - 1;
    const int s = slot(op);
    const auto& buckets = buckets_.ranges[vs];
    const bool segmented = op.bucket >= 0;
    if (!segmented || op.bucket == 0)
      model.backward_begin(op.microbatch, last_stage ? nullptr : rk.grad_out[s], loss_gradient_scale(rk));
    const bool final_segment = !segmented || op.bucket + 1 >= static_cast<int>(buckets.size());
    if (!final_segment) {
      const std::size_t needed = buckets[op.bucket].second;
      while (model.gradients_complete(op.microbatch) < needed && rk.units_done[s] < model.backward_units()) {
        model.backward_unit(op.microbatch);
        ++rk.units_done[s];
      }
      return;
    }
    while (rk.units_done[s] < model.backward_units()) {
      model.backward_unit(op.microbatch);
      ++rk.units_done[s];
    }
    void* gin = vs == 0 ? nullptr : alloc(rk, rk.grad_in[s], cs);
    model.backward_end(op.microbatch, gin);
    if (gin) k::scan_tensor(scan_of(rk, index), gin, act_elems(rk), act_format(), cs);
    if (!last_stage) release(rk, rk.grad_out[s], cs);
  }

  // The gradients a collective reduces: a bucket's range, or the tied embedding's.
  std::pair<void*, std::size_t> gradient_range(CudaRank& rk, const Op& op) {
    CudaStageModel& model = rk.chunks[local_chunk(op)];
    const DType gdt = model.gradient_format();
    if (op.bucket >= 0) {
      const auto [lo, hi] = buckets_.ranges[op.chunk][op.bucket];
      return {offset(model.gradients_device(), lo, gdt), hi - lo};
    }
    const ParamInfo e = model.token_embedding();
    return {offset(model.gradients_device(), e.offset, gdt), e.size};
  }

  void run_collective(CudaRank& rk, int i, const Op& op) {
    const auto& pr = plan_.config.precision;
    void* st = rk.streams.comm;
    const std::uint64_t tag = collective_tag(rk.step, op.channel);
    const Collective& c = schedule_->collectives[op.channel];
    switch (op.kind) {
      case OpKind::AllReduce: {
        const auto [grads, count] = gradient_range(rk, op);
        const DType gdt = rk.chunks[local_chunk(op)].gradient_format();
        const bool data_parallel = c.purpose == CollectivePurpose::gradients;
        // Multiplying by 1 changes no value: these passes only raise flags.
        k::unscale_and_check(grads, count, 1.0f, flag(rk, rk.flags_at.before(i)), gdt, st);
        if (data_parallel) k::unscale_and_check(grads, count, 1.0f, flag(rk, rk.flags_at.local()), gdt, st);
        const Divide divide = !data_parallel                                ? Divide::none
                              : pr.allreduce_divide == AllReduceDivide::before ? Divide::before
                                                                               : Divide::after;
        if (pr.allreduce == gdt) {
          rk.comm->all_reduce(grads, count, gdt, c.members, tag, ReduceOp::sum, divide, st);
        } else {
          // NCCL reduces in the buffer's type: cast to the wire format and back.
          void* wire = rk.pool->allocate(count * dtype_bytes(pr.allreduce), st,
                                         fmt::format("rank {}: the all-reduce's {} copy", rk.rank,
                                                     dtype_name(pr.allreduce)));
          k::cast(wire, pr.allreduce, grads, gdt, count, st);
          rk.comm->all_reduce(wire, count, pr.allreduce, c.members, tag, ReduceOp::sum, divide, st);
          k::cast(grads, gdt, wire, pr.allreduce, count, st);
          rk.pool->free(wire, st);
        }
        k::unscale_and_check(grads, count, 1.0f, flag(rk, rk.flags_at.after(i)), gdt, st);
        return;
      }
      case OpKind::OverflowCheck: {
        if (op.channel < 0) {
          // Local: only what this rank computed itself, before any reduction.
          if (dp_ == 1)
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
        rk.comm->all_reduce(verdict, 1, DType::fp32, c.members, tag, ReduceOp::max, Divide::none, st);
        return;
      }
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: {} is not executed by the runtime (ZeRO is not implemented)", rk.rank,
                                       op_label(op)));
  }

  void optimizer_step(CudaRank& rk, int index) {
    const auto& cfg = plan_.config;
    void* cs = rk.streams.compute;
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
    for (int j = 0; j < vpp_; ++j) {
      CudaStageModel& model = rk.chunks[j];
      void* g = model.gradients_device();
      const std::size_t n = model.num_parameters();
      const DType gdt = model.gradient_format();
      k::scan_tensor(scan_of(rk, index), g, n, gdt, cs);  // the scaled gradients, as the backward left them
      k::unscale_and_check(g, n, inv_scale, flag(rk, rk.flags_at.unused()), gdt, cs);
      // This rank's share of the global squared norm: its stage once per replica, a tied
      // embedding's copy on the last stage not counted again.
      const int vs = j * pp_ + rk.stage;
      const ParamInfo e = model.token_embedding();
      const bool skip_copy = vs == V_ - 1 && V_ > 1 && e.size > 0;
      double* scratch = rk.scratch.as<double>();
      if (skip_copy) {
        k::squared_norm(&sc->sumsq, g, e.offset, gdt, scratch, true, cs);
        k::squared_norm(&sc->sumsq, offset(g, e.offset + e.size, gdt), n - e.offset - e.size, gdt, scratch, true, cs);
      } else {
        k::squared_norm(&sc->sumsq, g, n, gdt, scratch, true, cs);
      }
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
    host_scalars->norm = static_cast<float>(host.sumsq / dp_);
    copy_host_to_device(&sc->norm, &host_scalars->norm, sizeof(float), cs);
    std::vector<int> everyone(world());
    for (int r = 0; r < world(); ++r) everyone[r] = r;
    rk.comm->all_reduce(&sc->norm, 1, DType::fp32, everyone,
                        collective_tag(rk.step, static_cast<int>(schedule_->collectives.size())), ReduceOp::sum,
                        Divide::none, cs);
    copy_device_to_host(&host_scalars->norm, &sc->norm, sizeof(float), cs);
    wait_idle(rk, cs, "the gradient norm's all-reduce");
    rk.grad_norm = std::sqrt(static_cast<double>(host_scalars->norm));

    if (overflow_op >= 0)
      rk.found_nonfinite = ops[overflow_op].channel < 0 ? flags[rk.flags_at.local()] != 0 : !(host.verdict == 0.0f);
    const bool checks = cfg.precision.loss_scaling.mode != LossScalingMode::none;
    rk.skipped = rk.scaler->update(checks && rk.found_nonfinite);
    if (rk.skipped) return;
    const double clip = cfg.training.clip_grad;
    const float coef = clip > 0 && rk.grad_norm > clip ? static_cast<float>(clip / (rk.grad_norm + 1e-6)) : 1.0f;
    const OptimizerSettings os = optimizer_settings(cfg);
    for (int j = 0; j < vpp_; ++j) {
      CudaStageModel& model = rk.chunks[j];
      auto& opt = rk.optimizers[j];
      const std::size_t n = model.num_parameters();
      const auto* mask = opt.mask.as<std::uint8_t>();
      ++opt.steps;
      if (os.kind == Optimizer::sgd) {
        k::sgd_update(model.master_weights_device(), model.gradients_device(), model.gradient_format(), mask, nullptr,
                      DType::fp32, n, os.learning_rate, os.weight_decay, coef, cs);
      } else {
        k::AdamParams p;
        p.learning_rate = os.learning_rate;
        p.beta1 = os.beta1;
        p.beta2 = os.beta2;
        p.eps = os.eps;
        p.weight_decay = os.weight_decay;
        p.decoupled = os.kind == Optimizer::adamw;
        p.step = opt.steps;
        p.grad_scale = coef;
        k::adam_update(model.master_weights_device(), opt.m.as<float>(), opt.v.as<float>(), model.gradients_device(),
                       model.gradient_format(), mask, nullptr, DType::fp32, n, p, cs);
      }
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

  RankSummary summarize(CudaRank& rk) {
    RankSummary s;
    s.peak = rk.peak;
    if (rk.error) {
      s.error = error_text(rk.error);
      return s;
    }
    // A rank's account only grows within a step (stashes are kept for reuse), so its peak is
    // its size at the end, reached no later than the pool's peak except on the first step.
    s.allocated_peak = rk.memory.peak() + rk.pool->used_high();
    const auto& ops = rk.program->ops;
    s.timing.resize(ops.size());
    s.arrival.assign(ops.size(), -1);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      // Events of one context measured from that context's epoch (both epochs are one instant).
      const cudaEvent_t origin = is_collective(ops[i].kind) ? rk.comm_epoch->e : rk.epoch->e;
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
      if (op.kind == OpKind::Forward) s.max_abs_activation = std::max(s.max_abs_activation, max_abs);
      if (op.kind == OpKind::Backward || op.kind == OpKind::BackwardInput || op.kind == OpKind::OptimizerStep)
        s.max_abs_gradient = std::max(s.max_abs_gradient, max_abs);
      s.nonfinite += static_cast<std::int64_t>(scans[i].nonfinite);
      if (scans[i].nonfinite > 0)
        what = op.kind == OpKind::Forward    ? fmt::format("forward output of micro-batch {}", op.microbatch)
               : op.kind == OpKind::Backward || op.kind == OpKind::BackwardInput
                   ? fmt::format("input gradient of micro-batch {}", op.microbatch)
                                             : std::string("the accumulated weight gradients");
      if (op.kind == OpKind::AllReduce && flags[rk.flags_at.before(i)] == 0 && flags[rk.flags_at.after(i)] != 0)
        what = fmt::format("{} all-reduce of {}", dtype_name(plan_.config.precision.allreduce),
                           op.bucket >= 0 ? fmt::format("gradient bucket {}", op.bucket)
                                          : std::string("the tied embedding gradient"));
      if (!what.empty() && (s.first_nonfinite_at < 0 || s.timing[i].start < s.first_nonfinite_at)) {
        s.first_nonfinite_at = s.timing[i].start;
        s.first_nonfinite = fmt::format("{} (stage {}, replica {})", what, rk.stage, rk.replica);
      }
    }
    // The last stage's losses, read once the step's streams are idle.
    for (std::size_t j = 0; j < rk.chunks.size(); ++j)
      if (static_cast<int>(j) * pp_ + rk.stage == V_ - 1)
        for (float loss : rk.chunks[j].losses(m_)) {
          s.loss_sum += loss;
          ++s.loss_count;
        }
    s.grad_norm = rk.grad_norm;
    s.skipped = rk.skipped;
    s.found_nonfinite = rk.found_nonfinite;
    s.scale_used = rk.scale_used;
    // One download of the master weights per step: the checksum, and the drift between replicas.
    std::uint64_t h = kFnvOffset;
    rk.master_copy.clear();
    for (auto& c : rk.chunks) {
      rk.master_copy.push_back(c.master_weights_to_host());
      h = fnv1a(h, rk.master_copy.back());
    }
    s.weights_hash = h;
    return s;
  }

  const RuntimePlan& rp_;
  const Plan& plan_;
  const Dataset& data_;
  std::shared_ptr<const Schedule> schedule_;
  int m_ = 1, pp_ = 1, dp_ = 1, vpp_ = 1, V_ = 1;
  std::uint64_t data_position_ = 0;
  GradientBuckets buckets_;
  std::unique_ptr<SmPartition> partition_;
  std::unique_ptr<DeviceWorld> world_;
  NcclCommunicator* nccl_ = nullptr;  // one process per GPU: this rank's communicator
  std::vector<std::unique_ptr<CudaRank>> ranks_;  // this process's ranks
  bool all_local_ = true;
  std::string execution_;
};

}  // namespace

RunReport run_cuda(const RuntimePlan& rp, const RunOptions& options, const CudaRunOptions& cuda) {
  check_supported(rp.plan);
  std::string why;
  if (!k::device_available(&why)) throw std::runtime_error("the CUDA backend needs a GPU: " + why);

  RunReport report;
  report.runtime_plan = rp;
  const Dataset data = open_run_data(rp, options, report.data_source);
  Engine engine(report.runtime_plan, data, cuda, options.comm_timeout);
  report.schedule = engine.schedule();
  report.execution = engine.execution();
  const Plan& plan = report.runtime_plan.plan;
  const int steps = options.steps > 0 ? options.steps : plan.config.runtime.steps;
  const auto samples_per_step = static_cast<std::uint64_t>(plan.global_batch_size);
  const std::string fingerprint = plan_fingerprint(report.runtime_plan);

  // The same checkpoint format and fingerprint as the CPU backend: either resumes the other's.
  int first = 1;
  if (!options.resume_from.empty()) {
    const Checkpoint ck = load_checkpoint(options.resume_from, fingerprint);
    engine.restore(ck);
    first = ck.step + 1;
  }
  report.first_step = first;

  std::vector<Timeline> timelines;
  std::vector<MemoryBreakdown> peaks(engine.world());
  std::vector<double> allocated(engine.world(), 0.0);
  LossWatch loss_watch;
  for (int step = first; step <= steps; ++step) {
    double seconds = 0;
    const std::vector<RankSummary> ranks =
        engine.run_step(step, static_cast<std::uint64_t>(step - 1) * samples_per_step, seconds);
    for (int r = 0; r < engine.world(); ++r)
      if (!ranks[r].error.empty()) {
        report.failure = RunFailure{step, fmt::format("rank {} failed at step {}: {}", r, step, ranks[r].error)};
        break;
      }
    if (report.failure) break;

    std::vector<std::vector<OpTiming>> timing;
    std::vector<std::vector<Tick>> arrival;
    for (const RankSummary& s : ranks) {
      timing.push_back(s.timing);
      arrival.push_back(s.arrival);
    }
    timelines.push_back(measured_timeline(report.schedule, timing, arrival));

    std::vector<RankStep> steps_of_ranks;
    for (int r = 0; r < engine.world(); ++r) {
      const RankSummary& s = ranks[r];
      RankStep rs;
      RankStepNumerics& n = rs.numerics;
      n.rank = r;
      n.stage = plan.stage_of(r);
      n.replica = plan.replica_of(r);
      n.max_abs_activation = s.max_abs_activation;
      n.max_abs_gradient = s.max_abs_gradient;
      n.nonfinite_count = s.nonfinite;
      n.found_nonfinite = s.found_nonfinite != 0;
      n.skipped = s.skipped != 0;
      n.loss_scale = s.scale_used;
      n.first_nonfinite = s.first_nonfinite;
      rs.loss_sum = s.loss_sum;
      rs.loss_count = s.loss_count;
      rs.grad_norm = s.grad_norm;
      rs.first_nonfinite_at = s.first_nonfinite_at;
      steps_of_ranks.push_back(std::move(rs));
      if (s.peak.total() > peaks[r].total()) peaks[r] = s.peak;
      allocated[r] = std::max(allocated[r], static_cast<double>(s.allocated_peak));
    }
    std::string first_nonfinite;
    StepRecord rec = step_record(step, seconds, steps_of_ranks, &first_nonfinite);
    // A replica's checksum: FNV-1a over its ranks' weight hashes, stage by stage.
    for (int d = 0; d < plan.dp; ++d) {
      std::uint64_t h = kFnvOffset;
      for (int s = 0; s < plan.pp; ++s) {
        const std::uint64_t part = ranks[plan.rank_of(s, d)].weights_hash;
        h = (h ^ part) * 1099511628211ull;
      }
      rec.replica_checksums.push_back(h);
    }
    const double drift = engine.replica_drift();
    rec.replica_drift = drift >= 0 ? drift
                        : std::all_of(rec.replica_checksums.begin(), rec.replica_checksums.end(),
                                      [&](std::uint64_t h) { return h == rec.replica_checksums[0]; })
                            ? 0.0
                            : INFINITY;  // replicas differ; by how much is only known when all ranks are here
    if (options.on_step) options.on_step(rec);
    report.steps.push_back(rec);
    report.failure = loss_watch.check(rec, first, first_nonfinite);

    if (checkpoint_due(options, step, steps) && !report.failure) {
      Checkpoint ck;
      ck.fingerprint = fingerprint;
      ck.step = step;
      ck.data_position = static_cast<std::uint64_t>(step) * samples_per_step;
      ck.seed = static_cast<std::uint64_t>(plan.config.runtime.seed);
      ck.ranks = engine.checkpoint_state();
      if (engine.holds_rank_zero()) report.checkpoints.push_back(save_checkpoint(options.checkpoint_dir, ck));
    }
    if (report.failure) break;
  }

  if (const int chosen = median_step_index(report.steps); chosen >= 0) {
    report.timeline = timelines[chosen];
    report.timeline_step = report.steps[chosen].step;
  } else {
    report.timeline.schedule = report.schedule;
    report.timeline.predicted = false;
    report.timeline.ops.assign(engine.world(), {});
    for (int r = 0; r < engine.world(); ++r) report.timeline.ops[r].assign(report.schedule->ranks[r].ops.size(), {});
  }
  report.memory = peaks;
  report.allocated_peak_bytes = allocated;
  report.result = compute_result(plan, report.timeline, report.memory);
  report.result.mfu = 0;  // against the scenario's GPU, not necessarily this one: not claimed
  for (const auto& n : rp.notes) report.result.warnings.push_back("runtime: " + n);
  return report;
}

}  // namespace trainsim::runtime::cuda
