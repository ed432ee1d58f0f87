#include "runtime/cpu/cpu_engine.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <chrono>
#include <cmath>
#include <exception>
#include <optional>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "core/schedule.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/comm/in_process.h"
#include "runtime/cpu/cpu_calibrate.h"
#include "runtime/engine/rank_threads.h"
#include "runtime/engine/schedule_ops.h"
#include "runtime/engine/weights.h"
#include "runtime/loop/run_loop.h"
#include "runtime/numerics/loss_scaler.h"
#include "runtime/numerics/lowp.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim::runtime {

namespace {

using Clock = std::chrono::steady_clock;

std::int64_t count_nonfinite(std::span<const float> xs) {
  std::int64_t n = 0;
  for (float x : xs) n += !std::isfinite(x);
  return n;
}

// Where ranks share cores: hands the cores to the ranks' compute ops one op at a time, each op whole,
// in the order given (RunOptions::core_turns) or first come first served. Left to the operating
// system, 8 rank threads on 2 cores were time-sliced at its tick (4 ms) over ops of 1-2 ms, and the
// same run measured per-rank utilizations 0.1-0.2 apart from one run to the next; with the order
// fixed, what a rank waits for is decided before the run (validation/core_sharing.h predicts it).
class CoreGate {
 public:
  CoreGate(int cores, int ranks, std::vector<CoreTurn> turns, std::chrono::milliseconds timeout)
      : cores_(cores), turns_(std::move(turns)), timeout_(timeout), woken_(static_cast<std::size_t>(ranks)) {}

  // Before each step (not measured).
  void reset() {
    std::lock_guard lock(mu_);
    free_ = cores_;
    next_ = 0;
    waiting_.clear();
    aborted_ = false;
  }

  // Waits for a core for rank `rank`'s op `op` (part `part`).
  void acquire(const CoreTurn& turn) {
    std::unique_lock lock(mu_);
    if (turns_.empty()) waiting_.push_back(turn);
    const bool ready = woken_[static_cast<std::size_t>(turn.rank)].wait_for(lock, timeout_, [&] {
      return aborted_ || (free_ > 0 && (turns_.empty() ? waiting_.front() == turn : next_ < turns_.size() && turns_[next_] == turn));
    });
    if (aborted_) throw std::runtime_error(fmt::format("rank {}: stopped while waiting for a core", turn.rank));
    if (!ready)
      throw std::runtime_error(fmt::format("rank {}: op {} waited {} ms for its turn at a core", turn.rank, turn.op,
                                           timeout_.count()));
    if (turns_.empty())
      waiting_.pop_front();
    else
      ++next_;
    --free_;
    wake_next();
  }

  void release() {
    std::lock_guard lock(mu_);
    ++free_;
    wake_next();
  }

  void abort() {
    std::lock_guard lock(mu_);
    aborted_ = true;
    for (auto& w : woken_) w.notify_all();
  }

  // Holds a core for one op (part) of a rank, if there is a gate.
  class Hold {
   public:
    Hold(CoreGate* gate, const CoreTurn& turn) : gate_(gate) {
      if (gate_) gate_->acquire(turn);
    }
    ~Hold() {
      if (gate_) gate_->release();
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    CoreGate* gate_;
  };

 private:
  // Under mu_: wakes the rank whose turn comes next, if a core is free for it.
  void wake_next() {
    if (free_ <= 0) return;
    if (turns_.empty()) {
      if (!waiting_.empty()) woken_[static_cast<std::size_t>(waiting_.front().rank)].notify_one();
    } else if (next_ < turns_.size()) {
      woken_[static_cast<std::size_t>(turns_[next_].rank)].notify_one();
    }
  }

  const int cores_;
  const std::vector<CoreTurn> turns_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::vector<std::condition_variable> woken_;  // per rank: its compute thread waits here
  int free_ = 0;
  std::size_t next_ = 0;
  std::deque<CoreTurn> waiting_;  // first come, first served
  bool aborted_ = false;
};

// One rank: its model chunks, optimizer, scaler, buffers and this step's state.
struct Rank {
  int rank = 0, stage = 0, replica = 0;
  const RankProgram* program = nullptr;
  std::unique_ptr<Communicator> comm;        // its compute thread's: receives, sends, the norm
  std::unique_ptr<Communicator> collectives;  // its communication thread's
  std::vector<StageModel> chunks;  // local chunk j holds virtual stage j * pp + stage
  std::vector<OptimizerState> optimizers;
  std::vector<std::vector<std::uint8_t>> decay_masks;
  std::unique_ptr<LossScaler> scaler;
  RankWalk walk;

  // This step.
  int step = 0;
  std::vector<MicroBatchTokens> batches;
  std::vector<std::vector<float>> act_in, act_out, grad_out, grad_in;  // [slot]
  std::vector<int> units_done;                                         // [slot]
  std::vector<OpTiming> timing;
  std::vector<Tick> arrival;          // collectives: when this rank's communication thread started them
  // Backward ops: whether the op's chunk had accumulated only finite gradients when it ended (the
  // model scans every accumulation), so a collective that depends on it need not scan them again.
  std::vector<char> finite_after;
  // Reductions of gradients that were all finite, for the optimizer step to check afterwards.
  struct Reduced {
    int chunk;
    std::size_t offset, count;
    const Op* op;  // the all-reduce
    Tick at;       // when it ended
  };
  std::vector<Reduced> reduced;
  std::int64_t local_nonfinite = 0;   // in its own gradients, before any reduction
  bool found_nonfinite = false;
  double loss_sum = 0;
  int loss_count = 0;
  double grad_norm = 0;
  bool skipped = false;
  double scale_used = 1;
  std::string first_nonfinite;
  Tick first_nonfinite_at = -1;
  std::exception_ptr error;

  // Memory accounting (bytes, in the formats values are held in).
  std::size_t buffer_elements = 0;
  double peak_bytes = 0;
  MemoryBreakdown peak;
};

class CpuEngine final : public DeviceEngine {
 public:
  CpuEngine(const RuntimePlan& rp, const Dataset& data, const RunOptions& options)
      : rp_(rp),
        plan_(rp.plan),
        data_(data),
        world_(World::of(rp.plan)),
        shape_(rp.plan),
        pinned_(cpu_pins_ranks(options, world_.size())),
        comm_world_(world_.size(), options.comm_timeout),
        comm_timeout_(options.comm_timeout) {
    schedule_ = std::make_shared<const Schedule>(build_schedule(plan_));
    const auto& cfg = plan_.config;
    const OptimizerSettings os = optimizer_settings(cfg);

    std::vector<std::size_t> grad_elems(static_cast<std::size_t>(shape_.virtual_stages), 0);
    ranks_.resize(static_cast<std::size_t>(world_.size()));
    for (int r = 0; r < world_.size(); ++r) {
      auto& rk = ranks_[static_cast<std::size_t>(r)];
      rk = std::make_unique<Rank>();
      rk->rank = r;
      rk->stage = world_.coord(r).pp;
      rk->replica = world_.coord(r).dp;
      rk->program = &schedule_->ranks[static_cast<std::size_t>(r)];
      // Pinned, a rank's waiting thread polls while its core has nothing else to run: the compute
      // thread always (its communication thread preempts it when woken), the communication thread
      // only briefly where the plan reduces gradients while the backward runs on the same core.
      const auto off = std::chrono::microseconds{0};
      rk->comm = comm_world_.communicator(r, pinned_ ? kCpuCommPoll : off);
      rk->collectives = comm_world_.communicator(
          r, !pinned_ ? off : cfg.communication.overlap_grad_reduce ? kCpuOverlapPoll : kCpuCommPoll);
      for (int j = 0; j < shape_.vpp; ++j) {
        const int vs = shape_.vstage_of_chunk(rk->stage, j);
        rk->chunks.emplace_back(stage_spec(rp_, vs));
        StageModel& model = rk->chunks.back();
        model.init(static_cast<std::uint64_t>(cfg.runtime.seed));
        round_master(model);
        rk->optimizers.emplace_back(os, model.master_weights().size());
        std::vector<std::uint8_t> mask(model.master_weights().size(), 1);
        for (const ParamInfo& p : model.params())
          if (!p.decay) std::fill(mask.begin() + p.offset, mask.begin() + p.offset + p.size, 0);
        rk->decay_masks.push_back(std::move(mask));
        grad_elems[static_cast<std::size_t>(vs)] = model.gradients().size();
      }
      rk->scaler = std::make_unique<LossScaler>(cfg.precision.loss_scaling);
      rk->timing.resize(rk->program->ops.size());
      rk->arrival.assign(rk->program->ops.size(), -1);
      rk->finite_after.assign(rk->program->ops.size(), 0);
    }
    buckets_ = gradient_buckets(*schedule_, shape_.virtual_stages, grad_elems);
    sent_at_ = std::vector<std::atomic<Tick>>(static_cast<std::size_t>(schedule_->num_messages));
    if (!pinned_) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      check_turns(options.core_turns);
      gate_ = std::make_unique<CoreGate>(cores, world_.size(), options.core_turns, options.comm_timeout);
    }
  }

  const World& world() const override { return world_; }
  std::shared_ptr<const Schedule> schedule() const override { return schedule_; }
  Execution execution() const override {
    const int n = world_.size();
    return {fmt::format("cpu: {} rank threads{}", n, pinned_ ? ", pinned to cores 0.." + std::to_string(n - 1) : ""),
            pinned_ ? " as threads pinned to cores" : " as threads (not pinned: more ranks than cores)", pinned_};
  }

  std::vector<RankStep> run_step(int step, std::uint64_t data_position) override {
    // Everything a rank needs before the step begins (outside the measured step): its
    // micro-batches, clean gradients and numerics counters.
    for (auto& rk : ranks_) prepare_step(*rk, step, data_position);
    if (gate_) gate_->reset();
    for (auto& t : sent_at_) t.store(-1);
    started_.store(0);
    go_.store(false);
    std::vector<std::thread> threads;
    threads.reserve(ranks_.size());
    for (auto& rk : ranks_)
      threads.emplace_back([this, r = rk.get()] {
        Driver driver(*this, *r);
        r->error = r->walk.run(r->rank, *r->program, driver);
      });
    for (auto& t : threads) t.join();
    std::vector<RankStep> out;
    out.reserve(ranks_.size());
    for (auto& rk : ranks_) out.push_back(report(*rk));
    return out;
  }

  std::optional<double> replica_drift() override {
    return runtime::replica_drift(world_, shape_.vpp, [&](int r, int j) {
      return std::span<const float>(ranks_[static_cast<std::size_t>(r)]->chunks[static_cast<std::size_t>(j)].master_weights());
    });
  }

  std::vector<RankCheckpoint> save() override {
    std::vector<RankCheckpoint> out;
    for (auto& rk : ranks_) {
      std::vector<ChunkState> chunks;
      for (std::size_t j = 0; j < rk->chunks.size(); ++j) {
        auto& o = rk->optimizers[j];
        chunks.push_back({rk->chunks[j].master_weights(), o.first_moment(), o.second_moment(), o.steps_taken()});
      }
      out.push_back(pack_rank(rk->rank, chunks, rk->scaler->state()));
    }
    return out;
  }

  void restore(const Checkpoint& ck) override {
    for (auto& rk : ranks_) {
      const RankCheckpoint& rc = checkpoint_of(ck.ranks, rk->rank);
      std::vector<std::size_t> sizes;
      for (auto& c : rk->chunks) sizes.push_back(c.master_weights().size());
      const std::vector<ChunkState> chunks = unpack_rank(rc, sizes);
      for (std::size_t j = 0; j < rk->chunks.size(); ++j) {
        std::copy(chunks[j].master_weights.begin(), chunks[j].master_weights.end(),
                  rk->chunks[j].master_weights().begin());
        auto& o = rk->optimizers[j];
        std::copy(chunks[j].first_moment.begin(), chunks[j].first_moment.end(), o.first_moment().begin());
        std::copy(chunks[j].second_moment.begin(), chunks[j].second_moment.end(), o.second_moment().begin());
        o.set_steps_taken(chunks[j].optimizer_steps);
        rk->chunks[j].refresh_working_weights();
      }
      rk->scaler->restore(rc.scaler);
    }
  }

  std::vector<MemoryBreakdown> memory_peaks() const override {
    std::vector<MemoryBreakdown> out;
    for (const auto& rk : ranks_) out.push_back(rk->peak);
    return out;
  }

 private:
  // The CPU side of a rank's walk: each op run and timed with the host's clock.
  class Driver final : public RankDriver {
   public:
    Driver(CpuEngine& e, Rank& rk) : e_(e), rk_(rk) {}
    void start_compute_thread() override {
      if (e_.pinned_) pin(rk_.rank);
      e_.start_together();
    }
    void run_compute(int i) override {
      // An op starts when the one before it on this thread and what it waits for have ended, and a
      // receive ends when its message was there, as the simulator times them: however long a woken
      // thread then waited for a core is the op's, as a time-shared rank's wait would be.
      const Op& op = rk_.program->ops[static_cast<std::size_t>(i)];
      Tick start = e_.now();
      if (previous_end_ >= 0) {
        Tick ready = previous_end_;
        if (op.dep >= 0 && is_collective(rk_.program->ops[static_cast<std::size_t>(op.dep)].kind))
          ready = std::max(ready, rk_.timing[static_cast<std::size_t>(op.dep)].end);
        start = std::min(start, ready);
      }
      {
        const bool gated = is_compute(op.kind) && op.kind != OpKind::OptimizerStep;  // the optimizer: inside
        CoreGate::Hold core(gated ? e_.gate_.get() : nullptr, CoreTurn{rk_.rank, i, 0});
        e_.run_op(rk_, i, op);
      }
      Tick end = e_.now();
      if (is_recv(op.kind)) {
        const Tick sent = e_.sent_at_[static_cast<std::size_t>(op.channel)].load(std::memory_order_acquire);
        if (sent >= 0) end = std::clamp(sent, start, end);
      }
      rk_.timing[static_cast<std::size_t>(i)] = {start, end};
      previous_end_ = end;
      // Before the op is marked done: a collective that waits for it reads this.
      if (op.kind == OpKind::Backward || op.kind == OpKind::BackwardInput || op.kind == OpKind::BackwardWeight)
        rk_.finite_after[static_cast<std::size_t>(i)] =
            rk_.chunks[e_.shape_.local_chunk(op)].numerics().nonfinite_gradients == 0;
    }
    void finished_compute(int) override {
      e_.account_memory(rk_);
      e_.note_nonfinite(rk_);
    }
    void run_collective(int i) override {
      // This rank reaches the collective when its communication thread can start it: its
      // producer done and the collectives queued before it finished, as the simulator's
      // communication stream does. (When the compute thread passed it in program order is
      // earlier, and would charge the wait for this rank's own stream to the others.)
      const Tick start = e_.now();
      rk_.arrival[static_cast<std::size_t>(i)] = start;
      e_.run_collective(rk_, rk_.program->ops[static_cast<std::size_t>(i)]);
      rk_.timing[static_cast<std::size_t>(i)] = {start, e_.now()};
    }
    void abort(const std::string& reason) override {
      if (e_.gate_) e_.gate_->abort();
      rk_.comm->abort(reason);
    }

   private:
    static void pin(int core) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(core, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    CpuEngine& e_;
    Rank& rk_;
    Tick previous_end_ = -1;  // of this thread's last op this step
  };

  // Core turns must name every compute op of every rank once, and the optimizer's second part.
  void check_turns(const std::vector<CoreTurn>& turns) const {
    if (turns.empty()) return;
    std::vector<CoreTurn> want, got = turns;
    for (const RankProgram& p : schedule_->ranks)
      for (int i = 0; i < static_cast<int>(p.ops.size()); ++i)
        if (is_compute(p.ops[static_cast<std::size_t>(i)].kind)) {
          want.push_back({p.rank, i, 0});
          if (p.ops[static_cast<std::size_t>(i)].kind == OpKind::OptimizerStep) want.push_back({p.rank, i, 1});
        }
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    if (got != want)
      throw std::invalid_argument(fmt::format("cpu engine: the order of core turns lists {} turns; the schedule's compute "
                                              "ops take {} (each once, the optimizer step twice)",
                                              turns.size(), want.size()));
  }

  void round_master(StageModel& model) const {
    const DType master = plan_.config.precision.master_weights;
    if (master != DType::fp32) round_inplace(master, model.master_weights());
    model.refresh_working_weights();
  }

  void prepare_step(Rank& rk, int step, std::uint64_t data_position) {
    rk.step = step;
    const int m = shape_.microbatches;
    rk.batches.clear();
    if (shape_.needs_data(rk.stage))
      for (int mb = 0; mb < m; ++mb)
        rk.batches.push_back(data_.microbatch(data_position, rk.replica, mb, plan_.dp, plan_.micro_batch_size));
    for (auto* v : {&rk.act_in, &rk.act_out, &rk.grad_out, &rk.grad_in}) {
      v->resize(shape_.slots());
      for (auto& b : *v) b.clear();
    }
    rk.units_done.assign(shape_.slots(), 0);
    rk.buffer_elements = 0;
    for (auto& c : rk.chunks) {
      c.zero_gradients();
      c.numerics() = StageNumerics{};
    }
    rk.walk.reset(rk.program->ops.size());
    std::fill(rk.arrival.begin(), rk.arrival.end(), -1);
    rk.local_nonfinite = 0;
    rk.reduced.clear();
    rk.found_nonfinite = false;
    rk.loss_sum = 0;
    rk.loss_count = 0;
    rk.grad_norm = 0;
    rk.skipped = false;
    rk.scale_used = rk.scaler->scale();
    rk.first_nonfinite.clear();
    rk.first_nonfinite_at = -1;
    rk.error = nullptr;
  }

  // What the rank did this step, for the loop.
  RankStep report(Rank& rk) const {
    RankStep rs;
    if (rk.error) {
      rs.error = error_text(rk.error);
      return rs;
    }
    RankStepNumerics& n = rs.numerics;
    n.rank = rk.rank;
    n.stage = rk.stage;
    n.replica = rk.replica;
    std::uint64_t h = kFnvOffset;
    for (auto& c : rk.chunks) {
      const StageNumerics& sn = c.numerics();
      n.max_abs_activation = std::max(n.max_abs_activation, sn.max_abs_activation);
      n.max_abs_gradient = std::max(n.max_abs_gradient, sn.max_abs_gradient);
      n.nonfinite_count += sn.nonfinite_activations + sn.nonfinite_gradients;
      h = fnv1a(h, c.master_weights());
    }
    n.found_nonfinite = rk.found_nonfinite;
    n.skipped = rk.skipped;
    n.loss_scale = rk.scale_used;
    n.first_nonfinite = rk.first_nonfinite;
    rs.loss_sum = rk.loss_sum;
    rs.loss_count = rk.loss_count;
    rs.grad_norm = rk.grad_norm;
    rs.first_nonfinite_at = rk.first_nonfinite_at;
    rs.timing = rk.timing;
    rs.arrival = rk.arrival;
    rs.weights_hash = h;
    return rs;
  }

  // The step starts when every rank's thread has started (and is pinned): threads created for the
  // step start up to milliseconds apart on a busy machine, and the first would wait for the last
  // at its first message or collective, as no rank of a real job does. The last one sets the
  // step's epoch; the others wait for it, polling where each rank has its own core.
  void start_together() {
    const int n = static_cast<int>(ranks_.size());
    if (started_.fetch_add(1) + 1 == n) {
      epoch_ = Clock::now();
      go_.store(true, std::memory_order_release);
      return;
    }
    const auto give_up = Clock::now() + comm_timeout_;
    for (int spins = 0; !go_.load(std::memory_order_acquire); ++spins) {
      if (!pinned_) std::this_thread::yield();
      if (spins % 1024 == 0 && Clock::now() > give_up)
        throw std::runtime_error(fmt::format("cpu engine: not every rank's thread started within {} ms",
                                             comm_timeout_.count()));
    }
  }

  Tick now() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - epoch_).count() * 1000;
  }

  std::size_t act_elems(const Rank& rk) const { return rk.chunks[0].activation_elements(); }

  std::vector<float>& alloc(Rank& rk, std::vector<float>& buf) {
    buf.assign(act_elems(rk), 0.0f);
    rk.buffer_elements += buf.size();
    return buf;
  }
  void release(Rank& rk, std::vector<float>& buf) {
    rk.buffer_elements -= buf.size();
    buf.clear();
    buf.shrink_to_fit();
  }

  float gradient_scale(const Rank& rk) const { return loss_gradient_scale(rk.scaler->scale(), shape_.microbatches); }

  void run_op(Rank& rk, int index, const Op& op) {
    const int vs = op.chunk;
    const int s = shape_.slot(op);
    switch (op.kind) {
      case OpKind::RecvActivation:
        rk.comm->recv(op.peer, message_tag(rk.step, op.channel), alloc(rk, rk.act_in[s]));
        return;
      case OpKind::RecvGradient:
        rk.comm->recv(op.peer, message_tag(rk.step, op.channel), alloc(rk, rk.grad_out[s]));
        return;
      case OpKind::SendActivation:
      case OpKind::SendGradient: {
        auto& buf = op.kind == OpKind::SendActivation ? rk.act_out[s] : rk.grad_in[s];
        rk.comm->send(op.peer, message_tag(rk.step, op.channel), buf);
        sent_at_[static_cast<std::size_t>(op.channel)].store(now(), std::memory_order_release);
        release(rk, buf);
        return;
      }
      case OpKind::Forward: {
        StageModel& model = rk.chunks[shape_.local_chunk(op)];
        const auto* batch = rk.batches.empty() ? nullptr : &rk.batches[op.microbatch];
        const bool last = shape_.last(vs);
        float* out = last ? nullptr : alloc(rk, rk.act_out[s]).data();
        const float* in = shape_.first(vs) ? nullptr : rk.act_in[s].data();
        const float loss = model.forward(op.microbatch, shape_.first(vs) ? batch->tokens.data() : nullptr,
                                         last ? batch->targets.data() : nullptr, in, out);
        if (!shape_.first(vs)) release(rk, rk.act_in[s]);
        if (last) {
          rk.loss_sum += loss;
          ++rk.loss_count;
        }
        return;
      }
      case OpKind::Backward: {
        StageModel& model = rk.chunks[shape_.local_chunk(op)];
        const bool last = shape_.last(vs);
        const float* grad_output = last ? nullptr : rk.grad_out[s].data();
        if (!backward_segment(model, op, buckets_.ranges[vs], rk.units_done[s], grad_output, gradient_scale(rk)))
          return;
        float* gin = shape_.first(vs) ? nullptr : alloc(rk, rk.grad_in[s]).data();
        model.backward_end(op.microbatch, gin);
        if (!last) release(rk, rk.grad_out[s]);
        return;
      }
      case OpKind::BackwardInput: {
        StageModel& model = rk.chunks[shape_.local_chunk(op)];
        const bool last = shape_.last(vs);
        float* gin = shape_.first(vs) ? nullptr : alloc(rk, rk.grad_in[s]).data();
        model.backward_input(op.microbatch, last ? nullptr : rk.grad_out[s].data(), gradient_scale(rk), gin);
        if (!last) release(rk, rk.grad_out[s]);
        return;
      }
      case OpKind::BackwardWeight:
        // Split at bucket bounds only in name: the weight pass runs whole in its first segment.
        if (op.bucket <= 0) rk.chunks[shape_.local_chunk(op)].backward_weight(op.microbatch);
        return;
      case OpKind::OptimizerStep: optimizer_step(rk, index); return;
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: op {} ({}) cannot run on the compute thread", rk.rank, index,
                                       op_label(op)));
  }

  void run_collective(Rank& rk, const Op& op) {
    const auto& pr = plan_.config.precision;
    const std::uint64_t tag = collective_tag(rk.step, op.channel);
    switch (op.kind) {
      case OpKind::AllReduce:
      case OpKind::ReduceScatter: {
        const Collective& c = schedule_->collectives[op.channel];
        StageModel& model = rk.chunks[shape_.local_chunk(op)];
        const auto [offset, count] = collective_range(op, buckets_, model.token_embedding());
        auto grads = model.gradients().subspan(offset, count);
        const bool data_parallel = c.purpose == CollectivePurpose::gradients;
        // The numerics' bookkeeping stays off the collective (NCCL makes no pass of its own over a
        // bucket): gradients the model found finite as it accumulated them are not scanned again,
        // and whether the reduction made them non-finite is checked by the optimizer step.
        const bool finite = op.dep >= 0 && rk.finite_after[static_cast<std::size_t>(op.dep)];
        const std::int64_t nonfinite_before = finite ? 0 : count_nonfinite(grads);
        if (data_parallel) rk.local_nonfinite += nonfinite_before;
        rk.collectives->all_reduce(grads, c.members, tag, ReduceOp::sum, pr.allreduce, divide_of(c, pr));
        if (nonfinite_before == 0) rk.reduced.push_back({shape_.local_chunk(op), offset, count, &op, now()});
        return;
      }
      case OpKind::OverflowCheck: {
        if (op.channel < 0) {
          // Local: only what this rank computed itself, before any reduction.
          std::int64_t own = rk.local_nonfinite;
          if (plan_.dp == 1)
            for (auto& c : rk.chunks) own += count_nonfinite(c.gradients());
          rk.found_nonfinite = own > 0;
          return;
        }
        std::int64_t n = 0;
        for (auto& c : rk.chunks) n += count_nonfinite(c.gradients());
        float flag = n > 0 ? 1.0f : 0.0f;
        const Collective& c = schedule_->collectives[op.channel];
        rk.collectives->all_reduce(std::span<float>(&flag, 1), c.members, tag, ReduceOp::max, DType::fp32,
                                   Divide::none);
        rk.found_nonfinite = !(flag == 0.0f);
        return;
      }
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: {} is not executed by the runtime (ZeRO is not implemented)",
                                       rk.rank, op_label(op)));
  }

  // Where ranks share cores, the step takes two turns at a core: before its gradient norm's
  // all-reduce over every rank, and after it (none is held while the ranks wait for each other).
  void optimizer_step(Rank& rk, int index) {
    std::optional<CoreGate::Hold> core(std::in_place, gate_.get(), CoreTurn{rk.rank, index, 0});
    const auto& cfg = plan_.config;
    const float inv_scale = static_cast<float>(1.0 / rk.scaler->scale());
    // Reductions that made finite gradients non-finite (a wire format that overflowed).
    for (const Rank::Reduced& r : rk.reduced)
      if (count_nonfinite(rk.chunks[static_cast<std::size_t>(r.chunk)].gradients().subspan(r.offset, r.count)) > 0)
        record_nonfinite(rk,
                         fmt::format("{} (stage {}, replica {})", allreduce_label(*r.op, cfg.precision.allreduce),
                                     rk.stage, rk.replica),
                         r.at);
    // Unscale, and this rank's share of the global squared norm (norm_excluded).
    double sumsq = 0;
    for (int j = 0; j < shape_.vpp; ++j) {
      StageModel& model = rk.chunks[j];
      auto g = model.gradients();
      for (float& x : g) x *= inv_scale;
      const auto [skip_from, skip_count] =
          norm_excluded(shape_.vstage_of_chunk(rk.stage, j), shape_.virtual_stages, model.token_embedding());
      // In index order around the range left out, as one pass that skipped it would add them.
      for (std::size_t i = 0; i < skip_from; ++i) sumsq += static_cast<double>(g[i]) * g[i];
      for (std::size_t i = skip_from + skip_count; i < g.size(); ++i) sumsq += static_cast<double>(g[i]) * g[i];
    }
    float total = static_cast<float>(sumsq / plan_.dp);
    core.reset();
    rk.comm->all_reduce(std::span<float>(&total, 1), world_.everyone(), norm_tag(rk.step, *schedule_), ReduceOp::sum,
                        DType::fp32, Divide::none);
    rk.grad_norm = std::sqrt(static_cast<double>(total));
    core.emplace(gate_.get(), CoreTurn{rk.rank, index, 1});

    const bool checks = cfg.precision.loss_scaling.mode != LossScalingMode::none;
    rk.skipped = rk.scaler->update(checks && rk.found_nonfinite);
    if (rk.skipped) return;
    const float coef = clip_coefficient(cfg.training.clip_grad, rk.grad_norm);
    for (int j = 0; j < shape_.vpp; ++j) {
      StageModel& model = rk.chunks[j];
      rk.optimizers[j].step(model.master_weights(), model.gradients(), coef, rk.decay_masks[j]);
      round_master(model);
    }
  }

  void account_memory(Rank& rk) {
    MemoryBreakdown now;
    for (std::size_t j = 0; j < rk.chunks.size(); ++j) {
      const StageModel& c = rk.chunks[j];
      now.weights += static_cast<double>(c.master_weight_bytes() + c.working_weight_bytes());
      now.gradients += static_cast<double>(c.gradient_bytes());
      now.optimizer += static_cast<double>(rk.optimizers[j].bytes());
      now.activations += static_cast<double>(c.activation_bytes());
    }
    now.buffers = static_cast<double>(rk.buffer_elements) * dtype_bytes(plan_.config.precision.compute);
    if (now.total() > rk.peak_bytes) {
      rk.peak_bytes = now.total();
      rk.peak = now;
    }
  }

  void note_nonfinite(Rank& rk) {
    if (rk.first_nonfinite_at >= 0) return;
    for (auto& c : rk.chunks)
      if (!c.numerics().first_nonfinite.empty()) {
        record_nonfinite(rk, fmt::format("{} (stage {}, replica {})", c.numerics().first_nonfinite, rk.stage,
                                         rk.replica),
                         now());
        return;
      }
  }

  // The earliest wins (a reduction is checked after the compute ops that followed it).
  void record_nonfinite(Rank& rk, std::string what, Tick at) {
    if (rk.first_nonfinite_at >= 0 && rk.first_nonfinite_at <= at) return;
    rk.first_nonfinite_at = at;
    rk.first_nonfinite = std::move(what);
  }

  const RuntimePlan& rp_;
  const Plan& plan_;
  const Dataset& data_;
  World world_;
  StepShape shape_;
  bool pinned_;
  std::unique_ptr<CoreGate> gate_;  // ranks share cores
  std::vector<std::atomic<Tick>> sent_at_;  // per message of the step: when its send returned, or -1
  InProcessWorld comm_world_;
  std::shared_ptr<const Schedule> schedule_;
  GradientBuckets buckets_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  Clock::time_point epoch_;  // the step's start: written by the last rank to start, before go_
  std::atomic<int> started_{0};
  std::atomic<bool> go_{false};
  std::chrono::milliseconds comm_timeout_;
};

}  // namespace

bool cpu_pins_ranks(const RunOptions& options, int ranks) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return options.pin_threads && ranks <= cores;
}

std::unique_ptr<DeviceEngine> make_cpu_engine(const RuntimePlan& plan, const Dataset& data, const RunOptions& options) {
  return std::make_unique<CpuEngine>(plan, data, options);
}

RunReport run_cpu(const RuntimePlan& plan, const RunOptions& options) { return run(cpu_backend(), plan, options); }

const Backend& cpu_backend() {
  static const Backend backend{
      .name = "cpu",
      .title = "CPU",
      .help = "threads, Eigen",
      .engine = make_cpu_engine,
      .describe = [](const RuntimePlan& plan, const std::string& name,
                     const CalibrateOptions&) { return describe_cpu_profile(plan, name); },
      .kernels = make_cpu_kernel_calibrator,
      .calibrates_format = [](DType) { return true; },  // low precision is emulated by rounding
      .comm_bench =
          [](const CommBenchOptions& options, const Placement&) {
            CommBenchOptions o = options;
            o.poll = kCpuCommPoll;  // as the engine's pinned ranks wait
            return bench_in_process_comm(o);
          },
      // Ranks are threads on the machine's cores.
      .comm_ranks = [](const RuntimePlan&) { return static_cast<int>(std::max(2u, std::thread::hardware_concurrency())); },
      .kernel_clock = "one core, pinned",
      .calibrate_between_steps = true,  // a shared host's speed wanders
      .shares_by_turns = true,          // ranks beyond the cores: the engine's CoreGate
  };
  return backend;
}

}  // namespace trainsim::runtime
