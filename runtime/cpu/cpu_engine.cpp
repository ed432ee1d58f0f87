#include "runtime/cpu/cpu_engine.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "core/schedule.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/comm/in_process.h"
#include "runtime/cpu/core_account.h"
#include "runtime/cpu/core_gate.h"
#include "runtime/cpu/cpu_calibrate.h"
#include "runtime/engine/memory_accounting.h"
#include "runtime/engine/rank_threads.h"
#include "runtime/engine/schedule_ops.h"
#include "runtime/engine/weights.h"
#include "runtime/engine/zero.h"
#include "runtime/loop/run_loop.h"
#include "runtime/model/model_parallel.h"
#include "runtime/model/stage_layout.h"
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

// One rank: its model chunks, optimizer, scaler, buffers and this step's state.
struct Rank {
  int rank = 0, stage = 0, replica = 0;
  int shard = 0;               // which of its cell's shards (World::shard_of: tp + TP * cp)
  int tp_rank = 0, cp_rank = 0;  // its tensor- and context-parallel coordinates
  const RankProgram* program = nullptr;             // its cell's (World::cell)
  std::unique_ptr<Communicator> comm;         // its compute thread's: receives, sends, the norm
  std::unique_ptr<Communicator> collectives;  // its communication thread's
  // Its compute thread's collectives inside the passes (tp or cp > 1): the tensor- and context-
  // parallel groups over `tp_comm`.
  std::unique_ptr<Communicator> tp_comm;
  std::unique_ptr<CommunicatorGroup> tensor_parallel, context_parallel;
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
  Tick gather_waited = 0;             // the last ZeRO-3 gather's waits for room (OpTiming::waited)
  std::vector<std::vector<std::pair<Tick, Tick>>> parts;  // ZeRO-3 gathers: each unit's room and end (RankStep::parts)
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
  Tick optimizer_end = 0;  // where ranks share cores: its update's end, before its turn's core went on
  // Pinned ranks: the core's account from the step's start to the compute thread's end, and the CPU
  // time the communication thread ran this step (it measures its own: it has ended by then).
  CoreAccount core_account;
  std::int64_t comm_cpu_ns = 0;
  // RankStep::foreign_seconds, in ns: pinned, its core's other work; sharing the cores, the host's
  // per core (run_step). -1: not measured.
  std::int64_t foreign_ns = -1;
  double scale_used = 1;
  std::string first_nonfinite;
  Tick first_nonfinite_at = -1;
  std::exception_ptr error;

  // Memory accounting (bytes, in the formats values are held in).
  std::size_t buffer_elements = 0;
  double peak_bytes = 0;
  MemoryBreakdown peak;

  // ZeRO (plan.zero() >= 1; runtime/engine/zero.h), per local chunk: its layout, and its shards
  // of the master weights, the reduced gradients, the optimizer's decay mask and (stage 3) the
  // compute-format weights it contributes to gathers (fp32: the master shard itself).
  struct ZeroShard {
    ZeroChunk plan;
    std::vector<float> master, grads, working;
    std::vector<std::uint8_t> mask;
    std::unique_ptr<ChunkWeightGate> gate;  // stage 3: the model's pieces gathered unit by unit
    bool gathered = false;                  // FSDP's stage 2: gathered once this step
  };
  std::vector<ZeroShard> zero;
  std::vector<std::vector<int>> staged_after;  // per op: the reduce-scatters whose bucket it completes
  std::map<int, std::vector<float>> staged;    // reduce-scatter op -> its bucket, as the backward left it
  std::mutex staged_mu;
  // The communication thread's buffer for a once-per-step reduce-scatter's bucket and for a gather:
  // kept between calls (a fresh vector zero-fills what the pack or the copy writes anyway).
  std::vector<float> comm_scratch;
  GatherGate gather_gate;
  double staged_bytes = 0, in_flight = 0;     // buckets staged by this compute op; those being reduce-scattered
  std::vector<std::size_t> written, staged_to;  // per chunk: this micro-batch's flat gradients, and how far staged
};

class CpuEngine final : public DeviceEngine {
 public:
  CpuEngine(const RuntimePlan& rp, const Dataset& data, const RunOptions& options)
      : fault_(options.fault),
        rp_(rp),
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

    // Collectives that run beside the passes on the same core (cpu_collectives_beside_compute):
    // their thread then runs first on its core where the system lets it (a woken one otherwise
    // waits for the tick: run_first_on_core), and so do the communication threads of ranks that
    // share the cores, which always wake beside a turn's compute (the incident's data-parallel
    // all-reduces, 1.5-1.8 ms predicted, measured 4-9 ms without it, 1.9-2.0 with it), and those
    // ranks' compute threads outside their turns (CoreGate's waiting_first).
    const bool beside_compute = cpu_collectives_beside_compute(plan_);
    const CpuCollectivePolls polls = cpu_collective_polls(pinned_, beside_compute);
    comm_first_asked_ = !pinned_ || beside_compute;
    comm_first_ = comm_first_asked_ && may_run_first_on_core();
    if (!pinned_) {
      check_turns(options.core_turns);
      gate_ = std::make_unique<CoreGate>(host_cores(), world_.num_cells(), world_.shards_per_cell(), options.core_turns,
                                         options.comm_timeout, cpu_turns_wait_first(world_.shards_per_cell(), comm_first_));
    }
    std::vector<std::size_t> grad_elems(static_cast<std::size_t>(shape_.virtual_stages), 0);
    ranks_.resize(static_cast<std::size_t>(world_.size()));
    for (int r = 0; r < world_.size(); ++r) {
      auto& rk = ranks_[static_cast<std::size_t>(r)];
      rk = std::make_unique<Rank>();
      rk->rank = r;
      rk->stage = world_.coord(r).pp;
      rk->replica = world_.coord(r).dp;
      rk->shard = world_.shard_of(r);
      rk->tp_rank = world_.coord(r).tp;
      rk->cp_rank = world_.coord(r).cp;
      rk->program = &schedule_->ranks[static_cast<std::size_t>(world_.cell(r))];
      // Pinned, a rank's waiting thread polls while its core has nothing else to run: the compute
      // thread always (its communication thread preempts it when woken), the communication thread
      // only briefly for a peer that may not have arrived where its collectives run beside the
      // compute on the same core, and as long as the compute thread once its peers are in the
      // call (the ring's later steps, a chunk's sum apart: asleep there, each step's message waited
      // for a wake-up).
      // Sharing cores, a cell's shards still poll inside their op's tensor-parallel collectives
      // while the gate gives each shard a core (CoreGate::may_poll): they meet a dozen times per
      // layer, and a sleeping shard paid a wake-up at each (8 ranks, tp 2, on 2 cores: the ops took
      // 1.8x what calibration, which polls, measured).
      const auto off = std::chrono::microseconds{0};
      rk->comm = comm_world_.communicator(r, pinned_ ? kCpuCommPoll : off);
      rk->collectives = comm_world_.communicator(r, polls.first, nullptr, polls.in_call);
      if (world_.shards_per_cell() > 1)
        rk->tp_comm = comm_world_.communicator(r, kCpuCommPoll, gate_ ? gate_->may_poll(world_.cell(r)) : nullptr);
      if (world_.tensor_parallel() > 1)
        rk->tensor_parallel = std::make_unique<CommunicatorGroup>(*rk->tp_comm, world_.tensor_parallel_group(r));
      if (world_.context_parallel() > 1)
        rk->context_parallel = std::make_unique<CommunicatorGroup>(*rk->tp_comm, world_.context_parallel_group(r));
      for (int j = 0; j < shape_.vpp; ++j) {
        const int vs = shape_.vstage_of_chunk(rk->stage, j);
        rk->chunks.emplace_back(stage_spec(rp_, vs, rk->tp_rank, rk->cp_rank));
        StageModel& model = rk->chunks.back();
        model.set_tensor_parallel_group(rk->tensor_parallel.get());
        model.set_context_parallel_group(rk->context_parallel.get());
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
      rk->parts.assign(rk->program->ops.size(), {});
      rk->finite_after.assign(rk->program->ops.size(), 0);
    }
    buckets_ = gradient_buckets(*schedule_, shape_.virtual_stages, grad_elems);
    sent_at_ = std::vector<std::atomic<Tick>>(static_cast<std::size_t>(schedule_->num_messages) *
                                              static_cast<std::size_t>(world_.shards_per_cell()));
    if (plan_.zero() >= 1) setup_zero(os);
  }

  const World& world() const override { return world_; }
  std::shared_ptr<const Schedule> schedule() const override { return schedule_; }
  Execution execution() const override {
    const int n = world_.size();
    const std::string shards =
        world_.shards_per_cell() > 1
            ? fmt::format(" ({} schedule rank{} x {})", world_.num_cells(), world_.num_cells() == 1 ? "" : "s",
                          world_.context_parallel() == 1
                              ? fmt::format("{} tensor-parallel shards", world_.tensor_parallel())
                          : world_.tensor_parallel() == 1
                              ? fmt::format("{} context-parallel ranks", world_.context_parallel())
                              : fmt::format("{} context-parallel ranks x {} tensor-parallel shards",
                                            world_.context_parallel(), world_.tensor_parallel()))
            : "";
    const bool waiting_first = gate_ && gate_->waiting_first();
    const std::string comm = comm_first_ ? (waiting_first ? "; communication threads, and compute threads outside their turns, run "
                                                    "first on their cores (SCHED_FIFO)"
                                                  : "; communication threads run first on their cores (SCHED_FIFO)")
                             : comm_first_asked_ ? "; communication threads at normal priority (SCHED_FIFO refused: "
                                                   "a woken one may wait for the scheduler's tick)"
                                                 : "";
    return {fmt::format("cpu: {} rank threads{}{}{}", n, shards,
                        pinned_ ? ", pinned to cores 0.." + std::to_string(n - 1) : "", comm),
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
    // Ranks that share the cores take one another's: what other work took is the whole host's,
    // per core on average (pinned ranks each account their own core, Driver::on_thread).
    HostAccount host;
    const bool host_open = !pinned_ && host.open();
    std::vector<std::thread> threads;
    threads.reserve(ranks_.size());
    for (auto& rk : ranks_)
      threads.emplace_back([this, r = rk.get(), step] {
        Driver driver(*this, *r);
        r->error = r->walk.run(r->rank, *r->program, driver, fault_.at(step, r->rank));
      });
    for (auto& t : threads) t.join();
    if (const std::optional<std::int64_t> other = host_open ? host.other_work_ns() : std::nullopt)
      for (auto& rk : ranks_) rk->foreign_ns = *other / std::max(1, host_cores());
    std::vector<RankStep> out;
    out.reserve(ranks_.size());
    for (auto& rk : ranks_) out.push_back(report(*rk));
    return out;
  }

  std::optional<double> replica_drift() override {
    if (plan_.zero() >= 1) return 0.0;  // one copy of the master, spread over the replicas: nothing to drift
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
        const std::span<const float> master =
            rk->zero.empty() ? std::span<const float>(rk->chunks[j].master_weights()) : rk->zero[j].master;
        chunks.push_back({master, o.first_moment(), o.second_moment(), o.steps_taken()});
      }
      out.push_back(pack_rank(rk->rank, chunks, rk->scaler->state()));
    }
    return out;
  }

  void restore(const Checkpoint& ck) override {
    if (plan_.zero() >= 1) return restore_zero(ck);
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

  // Each rank's shards from its own checkpoint; the weights passes read from every member's
  // (stages 1-2 keep them whole between steps; stage 3 and FSDP gather them before use).
  void restore_zero(const Checkpoint& ck) {
    for (auto& rk : ranks_) {
      std::vector<std::size_t> sizes;
      for (auto& z : rk->zero) sizes.push_back(z.master.size());
      const RankCheckpoint& rc = checkpoint_of(ck.ranks, rk->rank);
      const std::vector<ChunkState> chunks = unpack_rank(rc, sizes);
      for (std::size_t j = 0; j < rk->chunks.size(); ++j) {
        auto& z = rk->zero[j];
        std::copy(chunks[j].master_weights.begin(), chunks[j].master_weights.end(), z.master.begin());
        auto& o = rk->optimizers[j];
        std::copy(chunks[j].first_moment.begin(), chunks[j].first_moment.end(), o.first_moment().begin());
        std::copy(chunks[j].second_moment.begin(), chunks[j].second_moment.end(), o.second_moment().begin());
        o.set_steps_taken(chunks[j].optimizer_steps);
        refresh_working_shard(*rk, static_cast<int>(j));
        if (!plan_.gathers_after_step() && !plan_.gathers_before_first_forward()) continue;
        StageModel& model = rk->chunks[j];
        const std::vector<int> group = world_.data_parallel_group(rk->rank);
        for (int p = 0; p < static_cast<int>(group.size()); ++p)
          z.plan.layout.put(p, unpack_rank(checkpoint_of(ck.ranks, group[p]), sizes)[j].master_weights,
                            model.master_weights());
        model.refresh_working_weights();
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
    void on_thread(RankThread thread, const std::function<void()>& body) override {
      if (!e_.pinned_) return body();
      if (thread == RankThread::comm) {
        const std::int64_t begin = thread_cpu_ns();
        body();
        rk_.comm_cpu_ns = thread_cpu_ns() - begin;
        return;
      }
      body();  // the communication thread has ended (joined) when it returns
      if (const auto window = rk_.core_account.close()) rk_.foreign_ns = window->other_work(rk_.comm_cpu_ns);
    }
    void start_compute_thread() override {
      if (e_.pinned_) pin_to_core(pthread_self(), rk_.rank);
      if (e_.gate_) e_.gate_->enrol(e_.world_.cell(rk_.rank), rk_.shard);
      e_.start_together();
      if (e_.gate_) e_.gate_->wait_first();  // after the spin above: every rank's thread has started
      if (e_.pinned_) rk_.core_account.open(rk_.rank);  // the step's start, on the rank's core
    }
    void start_comm_thread() override {
      if (e_.pinned_) pin_to_core(pthread_self(), rk_.rank);  // the rank's core, as its compute thread
      if (e_.comm_first_) run_first_on_core(pthread_self());
    }
    void run_compute(int i) override {
      // An op starts when the one before it on this thread and what it waits for have ended, and a
      // receive ends when its message was there, as the simulator times them: however long a woken
      // thread then waited for a core is the op's, as a time-shared rank's wait would be.
      const Op& op = rk_.program->ops[static_cast<std::size_t>(i)];
      if (is_compute(op.kind)) {  // ZeRO: the buckets the previous compute op staged are reduced during this one
        rk_.in_flight = rk_.staged_bytes;
        rk_.staged_bytes = 0;
      }
      // A backward holds, while it runs, the workspace recompute rebuilds a block in, and (ZeRO-2/3)
      // the unsharded gradients it writes before they go to their reduce-scatters.
      if (op.kind == OpKind::Backward || op.kind == OpKind::BackwardInput || op.kind == OpKind::BackwardWeight)
        e_.account_memory(rk_, op.kind == OpKind::BackwardWeight
                                   ? 0.0
                                   : static_cast<double>(rk_.chunks[e_.shape_.local_chunk(op)].backward_workspace_bytes()),
                          e_.unsharded_written_by(rk_, op));
      Tick start = e_.now();
      if (previous_end_ >= 0) {
        Tick ready = previous_end_;
        // A collective it waited for ended before it: its end is when the op could start.
        if (op.dep >= 0) {
          const Op& dep = rk_.program->ops[static_cast<std::size_t>(op.dep)];
          if (is_collective(dep.kind)) ready = std::max(ready, rk_.timing[static_cast<std::size_t>(op.dep)].end);
        }
        start = std::min(start, ready);
      }
      Tick waited = 0;
      Tick end = 0;
      {
        // A compute op's turn at a core is kept through the sends of its output that follow it
        // (eager copies, tens of microseconds of work): released first, a send competed for the
        // core with the turn woken in its place, measured at 0.2-1.7 ms each, and its receiver
        // waited as long. Anything else (a receive, the next compute op's own turn) starts
        // without one.
        std::optional<CoreGate::Hold> core = std::move(held_);
        held_.reset();
        if (!is_send(op.kind)) core.reset();
        const bool gated = is_compute(op.kind) && op.kind != OpKind::OptimizerStep;  // the optimizer: inside
        if (gated) core.emplace(e_.gate_.get(), CoreTurn{e_.world_.cell(rk_.rank), i, 0}, rk_.shard);
        // Where ranks share cores, the time before the op's turn came is its wait (busy all the same).
        if (gated && e_.gate_) waited = std::max<Tick>(0, e_.now() - start);
        e_.run_op(rk_, i, op);
        // ZeRO-3: the time the pass waited for its units inside the op (its gathers' pace).
        if (e_.gathers_units_ && is_compute(op.kind)) waited += rk_.gather_gate.take_compute_waited_ns() * 1000;
        if (e_.stages_buckets_ && is_compute(op.kind)) {
          e_.stage_buckets(rk_, i, op);
          rk_.in_flight = rk_.staged_bytes;
        }
        if (core && sends_next(*rk_.program, i)) held_.emplace(std::move(*core));
        // The op ends before its turn's core is released: the release wakes the next turn's
        // thread, which takes this core at once where ranks share cores; read after it, the end
        // came a scheduler slice late (sends measured at 1-4 ms where their copies take 15 us).
        // The optimizer step takes its turns inside, and ends as its second turn did.
        end = op.kind == OpKind::OptimizerStep && e_.gate_ ? rk_.optimizer_end : e_.now();
      }
      if (is_recv(op.kind)) {
        const Tick sent = e_.sent_at_[e_.sent_index(rk_, op)].load(std::memory_order_acquire);
        if (sent >= 0) end = std::clamp(sent, start, end);
      }
      rk_.timing[static_cast<std::size_t>(i)] = {start, end, std::min(waited, end - start)};
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
      rk_.gather_waited = 0;
      e_.run_collective(rk_, i, rk_.program->ops[static_cast<std::size_t>(i)]);
      // A gather in parts (ZeRO-3's units) ended with its last unit in place: the hand-over after
      // it may have given this thread's core to the compute thread (zero.h, gather_units).
      const auto& parts = rk_.parts[static_cast<std::size_t>(i)];
      const Tick end = parts.empty() ? e_.now() : std::max(start, parts.back().second);
      rk_.timing[static_cast<std::size_t>(i)] = {start, end, rk_.gather_waited};
    }
    void abort(const std::string& reason) override {
      if (e_.gate_) e_.gate_->abort();
      rk_.comm->abort(reason);
      rk_.gather_gate.fail(reason);
    }

   private:
    CpuEngine& e_;
    Rank& rk_;
    Tick previous_end_ = -1;                // of this thread's last op this step
    std::optional<CoreGate::Hold> held_;  // a compute op's turn, kept for the sends after it
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

  // What context-parallel rank `cp_rank` reads of a micro-batch: its two chunks of every sequence
  // (runtime/model/stage_layout.h); the whole micro-batch without context parallelism.
  MicroBatchTokens context_parallel_batch(MicroBatchTokens mb, int cp_rank) const {
    if (plan_.cp == 1) return mb;
    mb.tokens = context_parallel_rows(mb.tokens, mb.batch, mb.seq_length, plan_.cp, cp_rank);
    mb.targets = context_parallel_rows(mb.targets, mb.batch, mb.seq_length, plan_.cp, cp_rank);
    mb.seq_length /= plan_.cp;
    return mb;
  }

  void prepare_step(Rank& rk, int step, std::uint64_t data_position) {
    rk.step = step;
    const int m = shape_.microbatches;
    rk.batches.clear();
    if (shape_.needs_data(rk.stage))
      for (int mb = 0; mb < m; ++mb)
        rk.batches.push_back(context_parallel_batch(
            data_.microbatch(data_position, rk.replica, mb, plan_.dp, plan_.micro_batch_size), rk.cp_rank));
    for (auto* v : {&rk.act_in, &rk.act_out, &rk.grad_out, &rk.grad_in}) {
      v->resize(shape_.slots());
      for (auto& b : *v) b.clear();
    }
    rk.units_done.assign(shape_.slots(), 0);
    rk.buffer_elements = 0;
    for (auto& z : rk.zero) {
      std::fill(z.grads.begin(), z.grads.end(), 0.0f);
      z.gathered = false;
    }
    rk.staged.clear();
    rk.gather_gate.reset();
    rk.staged_bytes = rk.in_flight = 0;
    rk.core_account = CoreAccount{};
    rk.comm_cpu_ns = 0;
    rk.foreign_ns = -1;
    std::fill(rk.written.begin(), rk.written.end(), 0);
    std::fill(rk.staged_to.begin(), rk.staged_to.end(), 0);
    for (auto& c : rk.chunks) {
      c.zero_gradients();
      c.numerics() = StageNumerics{};
    }
    rk.walk.reset(rk.program->ops.size());
    if (rk.tensor_parallel) rk.tensor_parallel->restart(tensor_parallel_tag(step));
    if (rk.context_parallel) rk.context_parallel->restart(context_parallel_tag(step));
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
      rs.failed_at_ns = rk.walk.failed_at_ns();
      return rs;
    }
    RankStepNumerics& n = rs.numerics;
    n.rank = rk.rank;
    n.stage = rk.stage;
    n.replica = rk.replica;
    n.shard = rk.shard;
    std::uint64_t h = kFnvOffset;
    double block_seconds = 0;
    int blocks = 0;
    for (std::size_t j = 0; j < rk.chunks.size(); ++j) {
      StageModel& c = rk.chunks[j];
      block_seconds += c.take_block_seconds();
      blocks += c.spec().num_layers;
      const StageNumerics& sn = c.numerics();
      n.max_abs_activation = std::max(n.max_abs_activation, sn.max_abs_activation);
      n.max_abs_gradient = std::max(n.max_abs_gradient, sn.max_abs_gradient);
      n.nonfinite_count += sn.nonfinite_activations + sn.nonfinite_gradients;
      h = fnv1a(h, rk.zero.empty() ? std::span<const float>(c.master_weights()) : rk.zero[j].master);
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
    rs.parts = rk.parts;
    rs.weights_hash = h;
    if (blocks > 0) rs.layer_seconds = block_seconds / blocks;
    if (rk.foreign_ns >= 0) rs.foreign_seconds = static_cast<double>(rk.foreign_ns) * 1e-9;
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

  Tick now() const { return at(Clock::now()); }
  Tick at(Clock::time_point t) const {  // the step's clock at `t`
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - epoch_).count() * 1000;
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
  // The rank a point-to-point op of the cell's program talks to: the same shard of the peer cell.
  int peer(const Rank& rk, const Op& op) const { return world_.shard(op.peer, rk.shard); }
  // Where a message's send time is kept: per message of the cell's program and shard.
  std::size_t sent_index(const Rank& rk, const Op& op) const {
    return static_cast<std::size_t>(op.channel) * static_cast<std::size_t>(world_.shards_per_cell()) +
           static_cast<std::size_t>(rk.shard);
  }

  void run_op(Rank& rk, int index, const Op& op) {
    const int vs = op.chunk;
    const int s = shape_.slot(op);
    switch (op.kind) {
      case OpKind::RecvActivation:
        rk.comm->recv(peer(rk, op), message_tag(rk.step, op.channel), alloc(rk, rk.act_in[s]));
        return;
      case OpKind::RecvGradient:
        rk.comm->recv(peer(rk, op), message_tag(rk.step, op.channel), alloc(rk, rk.grad_out[s]));
        return;
      case OpKind::SendActivation:
      case OpKind::SendGradient: {
        auto& buf = op.kind == OpKind::SendActivation ? rk.act_out[s] : rk.grad_in[s];
        rk.comm->send(peer(rk, op), message_tag(rk.step, op.channel), buf);
        sent_at_[sent_index(rk, op)].store(now(), std::memory_order_release);
        release(rk, buf);
        return;
      }
      case OpKind::Forward: {
        StageModel& model = rk.chunks[shape_.local_chunk(op)];
        const auto* batch = rk.batches.empty() ? nullptr : &rk.batches[op.microbatch];
        const bool last = shape_.last(vs);
        float* out = last ? nullptr : alloc(rk, rk.act_out[s]).data();
        const float* in = shape_.first(vs) ? nullptr : rk.act_in[s].data();
        if (gathers_units_) begin_pass(rk.zero[shape_.local_chunk(op)], op, true);
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
        if (gathers_units_ && op.bucket <= 0) begin_pass(rk.zero[shape_.local_chunk(op)], op, false);
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
        if (gathers_units_) begin_pass(rk.zero[shape_.local_chunk(op)], op, false);
        model.backward_input(op.microbatch, last ? nullptr : rk.grad_out[s].data(), gradient_scale(rk), gin);
        if (!last) release(rk, rk.grad_out[s]);
        return;
      }
      case OpKind::BackwardWeight:
        weight_segment(rk.chunks[shape_.local_chunk(op)], op, buckets_.ranges[vs]);
        return;
      case OpKind::OptimizerStep: optimizer_step(rk, index); return;
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: op {} ({}) cannot run on the compute thread", rk.rank, index,
                                       op_label(op)));
  }

  void run_collective(Rank& rk, int index, const Op& op) {
    const auto& pr = plan_.config.precision;
    const std::uint64_t tag = collective_tag(rk.step, op.channel);
    if (!rk.zero.empty()) {  // ZeRO's collectives work on shards
      if (op.kind == OpKind::ReduceScatter) return zero_reduce_scatter(rk, index, op);
      if (op.kind == OpKind::AllGather) return zero_gather(rk, index, op);
      if (op.kind == OpKind::AllReduce && collective_of(*schedule_, op).purpose == CollectivePurpose::embedding)
        return zero_embedding_sum(rk, op);
    }
    switch (op.kind) {
      case OpKind::AllReduce:
      case OpKind::ReduceScatter: {
        const Collective& c = collective_of(*schedule_, op);
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
        rk.collectives->all_reduce(grads, collective_members(c, world_, rk.shard), tag, ReduceOp::sum, pr.allreduce,
                                   divide_of(c, pr));
        if (nonfinite_before == 0) rk.reduced.push_back({shape_.local_chunk(op), offset, count, &op, now()});
        return;
      }
      case OpKind::OverflowCheck: {
        if (op.channel < 0) {
          // Local: only what this rank computed itself, before any reduction.
          std::int64_t own = rk.local_nonfinite;
          if (plan_.data_shards() == 1)
            for (auto& c : rk.chunks) own += count_nonfinite(c.gradients());
          rk.found_nonfinite = own > 0;
          return;
        }
        std::int64_t n = 0;
        for (auto& c : rk.chunks) n += count_nonfinite(c.gradients());
        for (auto& z : rk.zero) n += count_nonfinite(z.grads);  // (ZeRO: the reduced gradients are these)
        float flag = n > 0 ? 1.0f : 0.0f;
        const Collective& c = collective_of(*schedule_, op);
        rk.collectives->all_reduce(std::span<float>(&flag, 1), collective_members(c, world_, rk.shard), tag,
                                   ReduceOp::max, DType::fp32, Divide::none);
        rk.found_nonfinite = !(flag == 0.0f);
        return;
      }
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: {} is not a collective of this plan (ZeRO stage {})", rk.rank,
                                       op_label(op), plan_.zero()));
  }

  // Where ranks share cores, the step takes two turns at a core: before its gradient norm's
  // all-reduce over every rank, and after it (none is held while the ranks wait for each other).
  void optimizer_step(Rank& rk, int index) {
    std::optional<CoreGate::Hold> core(std::in_place, gate_.get(), CoreTurn{world_.cell(rk.rank), index, 0}, rk.shard);
    optimizer_update(rk, index, core);
    rk.optimizer_end = now();  // before `core` lets the next turn take the core (RankWalk: an op's end)
  }

  // The step's work between its two turns: `core` holds the first, is released for the norm's
  // all-reduce, and holds the second on return.
  void optimizer_update(Rank& rk, int index, std::optional<CoreGate::Hold>& core) {
    const auto& cfg = plan_.config;
    const float inv_scale = static_cast<float>(1.0 / rk.scaler->scale());
    // Reductions that made finite gradients non-finite (a wire format that overflowed).
    for (const Rank::Reduced& r : rk.reduced)
      if (count_nonfinite(rk.chunks[static_cast<std::size_t>(r.chunk)].gradients().subspan(r.offset, r.count)) > 0)
        record_nonfinite(rk,
                         fmt::format("{} (stage {}, replica {})", allreduce_label(*r.op, cfg.precision.allreduce),
                                     rk.stage, rk.replica),
                         r.at);
    // What each chunk updates: all of it, or under ZeRO this rank's shard. Unscale, and this
    // rank's share of the global squared norm (norm_ranges), each element once over the
    // data-parallel group: a replica's whole copy counts 1/dp, a shard (padding is zero) once.
    struct Part {
      std::span<float> master, grads;
      std::span<const std::uint8_t> mask;
      std::vector<std::pair<std::size_t, std::size_t>> counted;
    };
    std::vector<Part> parts;
    for (int j = 0; j < shape_.vpp; ++j) {
      StageModel& model = rk.chunks[j];
      auto counted = norm_ranges(shape_.vstage_of_chunk(rk.stage, j), shape_.virtual_stages, model.params(),
                                 model.token_embedding(), rk.tp_rank);
      if (rk.zero.empty()) {
        parts.push_back({model.master_weights(), model.gradients(), rk.decay_masks[j], std::move(counted)});
        continue;
      }
      auto& z = rk.zero[j];
      if (!plan_.reduces_every_microbatch())  // stage 1: the shard from where the reduce-scatters left it
        z.plan.layout.take(z.plan.layout.position(), model.gradients(), z.grads);
      parts.push_back({z.master, z.grads, z.mask, shard_ranges(z.plan.layout, counted)});
    }
    double sumsq = 0;
    for (const Part& p : parts) {
      if (inv_scale != 1.0f)  // no loss scaling: nothing to unscale (x * 1 is x, NaN and inf included)
        for (float& x : p.grads) x *= inv_scale;
      // In index order over the ranges counted, as one pass that skipped the others would add them.
      for (const auto& [from, to] : p.counted)
        for (std::size_t i = from; i < to; ++i) sumsq += static_cast<double>(p.grads[i]) * p.grads[i];
    }
    float total = static_cast<float>(rk.zero.empty() ? sumsq / plan_.data_shards() : sumsq);
    core.reset();
    rk.comm->all_reduce(std::span<float>(&total, 1), world_.everyone(), norm_tag(rk.step, *schedule_), ReduceOp::sum,
                        DType::fp32, Divide::none);
    rk.grad_norm = std::sqrt(static_cast<double>(total));
    core.emplace(gate_.get(), CoreTurn{world_.cell(rk.rank), index, 1}, rk.shard);

    const bool checks = cfg.precision.loss_scaling.mode != LossScalingMode::none;
    rk.skipped = rk.scaler->update(checks && rk.found_nonfinite);
    if (rk.skipped) return;
    const float coef = clip_coefficient(cfg.training.clip_grad, rk.grad_norm);
    for (int j = 0; j < shape_.vpp; ++j) {
      const Part& p = parts[static_cast<std::size_t>(j)];
      rk.optimizers[j].step(p.master, p.grads, coef, p.mask);
      if (rk.zero.empty()) {
        round_master(rk.chunks[j]);
        continue;
      }
      if (cfg.precision.master_weights != DType::fp32) round_inplace(cfg.precision.master_weights, p.master);
      refresh_working_shard(rk, j);
    }
  }

  // `working`, `writing`: what the running op holds beyond the stashes (memory_accounting.h).
  void account_memory(Rank& rk, double working = 0, double writing = 0) {
    const double g = dtype_bytes(plan_.config.precision.grad_accumulation);
    const MemoryBreakdown now = rank_memory(
        plan_, rk.chunks.size(),
        [&](std::size_t j) {
          const StageModel& c = rk.chunks[j];
          ChunkHeld h;
          h.params = static_cast<double>(c.gradient_bytes()) / g;
          h.shard = rk.zero.empty() ? h.params : static_cast<double>(rk.zero[j].master.size());
          h.moment_bytes = static_cast<double>(rk.optimizers[j].bytes());
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

  // ---------------------------------------------------------------------------------------
  // ZeRO (runtime/engine/zero.h): shards over each data-parallel group, the schedule's
  // reduce-scatters, gathers and embedding sum on them, the optimizer on the shard.
  // ---------------------------------------------------------------------------------------
  static int unit_key(int chunk, int unit) { return chunk * 4096 + unit; }  // in the rank's GatherGate
  int position(const Rank& rk) const {
    const std::vector<int> group = world_.data_parallel_group(rk.rank);
    return static_cast<int>(std::find(group.begin(), group.end(), rk.rank) - group.begin());
  }

  // A pass's weights: gathered unit by unit as it reads them (stage 3; a chunk's first forward of
  // the step under --overlap-param-gather), or all in place (the other passes of the latter).
  void begin_pass(Rank::ZeroShard& z, const Op& op, bool forward) {
    if (first_forwards_only_ && !(forward && op.microbatch == 0))
      z.gate->pass_through();
    else
      z.gate->begin(forward);
  }

  void setup_zero(const OptimizerSettings& os) {
    const int V = shape_.virtual_stages;
    gathers_units_ = plan_.gathers_units();
    first_forwards_only_ = plan_.gathers_before_first_forward();
    stages_buckets_ = plan_.reduces_every_microbatch();
    // A tied embedding split over the pipeline is one segment on both its stages (zero.h).
    std::vector<char> kept(static_cast<std::size_t>(V), 0);
    for (auto& rk : ranks_)
      for (int j = 0; j < shape_.vpp; ++j) {
        const int vs = shape_.vstage_of_chunk(rk->stage, j);
        const ParamInfo te = rk->chunks[j].token_embedding();
        if (V > 1 && te.size > 0 && !kept[vs]) {
          keep_embedding_whole(buckets_.ranges[vs], te.offset, te.offset + te.size);
          kept[vs] = 1;
        }
      }
    std::size_t largest_unit = 0;
    for (auto& rk : ranks_) {
      const int pos = position(*rk);
      rk->staged_after.assign(rk->program->ops.size(), {});
      rk->written.assign(static_cast<std::size_t>(shape_.vpp), 0);
      rk->staged_to.assign(static_cast<std::size_t>(shape_.vpp), 0);
      for (int i = 0; i < static_cast<int>(rk->program->ops.size()); ++i) {
        const Op& op = rk->program->ops[i];
        if (op.kind == OpKind::ReduceScatter && plan_.reduces_every_microbatch() && op.dep >= 0)
          rk->staged_after[op.dep].push_back(i);
      }
      for (int j = 0; j < shape_.vpp; ++j) {
        const int vs = shape_.vstage_of_chunk(rk->stage, j);
        StageModel& model = rk->chunks[j];
        const ParamInfo te = V > 1 ? model.token_embedding() : ParamInfo{};
        Rank::ZeroShard z;
        z.plan = plan_zero_chunk(plan_, model.spec(), model.params(), buckets_.ranges[vs], te, plan_.data_shards(), pos);
        const std::size_t S = z.plan.layout.shard_size();
        z.master.assign(S, 0.0f);
        z.plan.layout.take(pos, model.master_weights(), z.master);
        z.grads.assign(S, 0.0f);
        std::vector<float> flat_mask(rk->decay_masks[j].begin(), rk->decay_masks[j].end()), mask(S);
        z.plan.layout.take(pos, flat_mask, mask);
        z.mask.assign(mask.begin(), mask.end());
        rk->optimizers[j] = OptimizerState(os, S);
        for (const GatherUnit& u : z.plan.units) largest_unit = std::max(largest_unit, u.elements);
        rk->zero.push_back(std::move(z));
        refresh_working_shard(*rk, j);
      }
      if (gathers_units_)
        for (int j = 0; j < shape_.vpp; ++j) {
          Rank& r = *rk;
          auto& z = r.zero[j];
          z.gate = std::make_unique<ChunkWeightGate>(z.plan, r.gather_gate, unit_key(j, 0),
                                                     [this, &r, j](int unit) { poison(r, j, unit); });
          r.chunks[j].set_weight_gate(z.gate.get());
          if (gate_) r.gather_gate.on_wait([this, &r] { gate_->pause(world_.cell(r.rank), r.shard); },
                                               [this, &r] { gate_->resume(r.rank, world_.cell(r.rank), r.shard); });
          if (!first_forwards_only_)  // (stage 1 keeps its weights whole between steps)
            for (int u = 0; u < static_cast<int>(z.plan.units.size()); ++u) poison(r, j, u);
        }
    }
    // Stage 3 holds two units at a time (GatherGate): their room is kept.
    if (plan_.gathers_before_backward())
      gathered_bytes_ = 2.0 * static_cast<double>(largest_unit) * dtype_bytes(plan_.config.precision.compute);
  }

  // The compute-format shard a gather sends: the master shard rounded (fp32: the master itself).
  void refresh_working_shard(Rank& rk, int j) {
    auto& z = rk.zero[j];
    const DType compute = plan_.config.precision.compute;
    if (compute == DType::fp32) return;
    // Block by block, each rounded while its copy is in cache (one pass over the shard's memory).
    z.working.resize(z.master.size());
    constexpr std::size_t kBlock = 1 << 14;
    for (std::size_t from = 0; from < z.master.size(); from += kBlock) {
      const std::size_t n = std::min(kBlock, z.master.size() - from);
      std::copy_n(z.master.begin() + static_cast<std::ptrdiff_t>(from), n,
                  z.working.begin() + static_cast<std::ptrdiff_t>(from));
      round_inplace(compute, std::span<float>(z.working).subspan(from, n));
    }
  }
  std::span<const float> working_shard(Rank& rk, int j) {
    auto& z = rk.zero[j];
    return plan_.config.precision.compute == DType::fp32 ? std::span<const float>(z.master) : z.working;
  }

  // A released stage-3 unit is gone: its first element of every parameter becomes NaN, so a pass
  // that read it before it is gathered again would say so in its loss.
  void poison(Rank& rk, int j, int unit) {
    StageModel& model = rk.chunks[j];
    const std::span<float> cw = model.compute_weights();
    for (const ShardGroup& g : rk.zero[j].plan.units[unit].groups)
      for (const ParamInfo& p : model.params())
        if (p.offset >= g.lo && p.offset < g.hi) cw[p.offset] = std::numeric_limits<float>::quiet_NaN();
  }

  // After compute op `index`: the buckets it completed go into their reduce-scatter's buffer and
  // leave the flat gradients to the next micro-batch (stages 2-3, reduced every micro-batch).
  void stage_buckets(Rank& rk, int index, const Op& done) {
    if (done.kind == OpKind::Backward || done.kind == OpKind::BackwardWeight) {  // what it wrote, unsharded
      const int j = shape_.local_chunk(done);
      if (done.bucket <= 0) rk.staged_to[j] = 0;  // a new micro-batch's gradients
      rk.written[j] = rk.chunks[j].gradients_complete(done.microbatch);
    }
    for (int rs : rk.staged_after[static_cast<std::size_t>(index)]) {
      const Op& op = rk.program->ops[static_cast<std::size_t>(rs)];
      const int j = shape_.local_chunk(op);
      const auto& z = rk.zero[j];
      const ShardGroup& g = z.plan.buckets[static_cast<std::size_t>(op.bucket)];
      std::vector<float> buf(g.section * static_cast<std::size_t>(plan_.data_shards()));
      const std::span<float> grads = rk.chunks[j].gradients();
      z.plan.layout.pack(g, grads, buf);
      std::fill(grads.begin() + static_cast<std::ptrdiff_t>(g.lo), grads.begin() + static_cast<std::ptrdiff_t>(g.hi), 0.0f);
      rk.staged_bytes += static_cast<double>(buf.size()) * dtype_bytes(plan_.config.precision.allreduce);
      rk.staged_to[j] = std::max(rk.staged_to[j], g.hi);
      std::lock_guard lock(rk.staged_mu);
      rk.staged[rs] = std::move(buf);
    }
  }

  // Bytes of unsharded gradients backward op `op` writes before it hands them to reduce-scatters
  // (stages 2-3): up to its bucket's end, or the chunk's end when it ends the backward.
  double unsharded_written_by(const Rank& rk, const Op& op) const {
    if (!stages_buckets_ || op.kind == OpKind::BackwardInput) return 0;
    const int j = shape_.local_chunk(op);
    const std::size_t n = rk.zero[j].plan.layout.params();
    const BucketRanges& b = buckets_.ranges[static_cast<std::size_t>(op.chunk)];
    std::size_t from = op.bucket > 0 ? rk.written[j] : 0, to = n;
    if (op.bucket >= 0 && op.bucket + 1 < static_cast<int>(b.size())) to = b[static_cast<std::size_t>(op.bucket)].second;
    return to > from ? static_cast<double>(to - from) * dtype_bytes(plan_.config.precision.grad_accumulation) : 0.0;
  }

  void zero_reduce_scatter(Rank& rk, int index, const Op& op) {
    const auto& pr = plan_.config.precision;
    const Collective& c = collective_of(*schedule_, op);
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    const int j = shape_.local_chunk(op);
    auto& z = rk.zero[j];
    const ShardGroup& g = z.plan.buckets[static_cast<std::size_t>(op.bucket)];
    std::vector<float> staged;
    std::span<float> buf;
    if (plan_.reduces_every_microbatch()) {
      std::lock_guard lock(rk.staged_mu);
      staged = std::move(rk.staged.at(index));
      rk.staged.erase(index);
      buf = staged;
    } else {  // once per step, after the chunk's last backward: nothing writes the flat gradients any more
      buf = scratch(rk, g.section * static_cast<std::size_t>(plan_.data_shards()));
      z.plan.layout.pack(g, rk.chunks[j].gradients(), buf);
    }
    if (g.section == 0) return;
    // Gradients the backward found finite as it accumulated them are not scanned again (as the
    // all-reduce's path): only a bucket that may hold inf/NaN is counted.
    const bool finite = op.dep >= 0 && rk.finite_after[static_cast<std::size_t>(op.dep)];
    const std::int64_t local = finite ? 0 : count_nonfinite(buf);
    rk.local_nonfinite += local;
    rk.collectives->reduce_scatter(buf, members, collective_tag(rk.step, op.channel), ReduceOp::sum, pr.allreduce,
                            divide_of(c, pr));
    const std::size_t at = static_cast<std::size_t>(position(rk)) * g.section;
    const std::span<const float> own = std::span<const float>(buf).subspan(at, g.section);
    if (plan_.reduces_every_microbatch()) {  // accumulated over micro-batches, in grad_accumulation
      const std::span<float> acc = std::span<float>(z.grads).subspan(g.shard_offset, g.section);
      for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += own[i];
      round_inplace(pr.grad_accumulation, acc);
    } else {  // left in place, in the flat gradients (as Megatron's distributed optimizer does)
      const std::span<float> flat = rk.chunks[j].gradients();
      for (const ShardPiece& piece : z.plan.layout.section_pieces(g, position(rk)))
        std::copy_n(buf.begin() + static_cast<std::ptrdiff_t>(piece.other), piece.count,
                    flat.begin() + static_cast<std::ptrdiff_t>(piece.flat));
    }
    if (local == 0 && count_nonfinite(own) > 0)
      record_nonfinite(rk,
                       fmt::format("{} reduce-scatter of gradient bucket {} (stage {}, replica {})",
                                   dtype_name(pr.allreduce), op.bucket, rk.stage, rk.replica),
                       now());
  }

  // The tied embedding's sum between the first and last stage, on the element each owns of it
  // (the same on both, zero.h), in a buffer of the whole embedding as the schedule moves it.
  void zero_embedding_sum(Rank& rk, const Op& op) {
    const auto& pr = plan_.config.precision;
    const Collective& c = collective_of(*schedule_, op);
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    auto& z = rk.zero[shape_.local_chunk(op)];
    const ShardGroup& g = z.plan.tied;
    std::vector<float> buf(g.section * static_cast<std::size_t>(plan_.data_shards()), 0.0f);
    const auto own = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(position(rk)) * g.section);
    // The reduced gradients: the shard (stages 2-3), or in place in the flat gradients (stage 1).
    const bool in_shard = plan_.reduces_every_microbatch();
    const std::vector<ShardPiece> pieces = z.plan.layout.section_pieces(g, position(rk));
    const std::span<float> flat = rk.chunks[shape_.local_chunk(op)].gradients();
    if (in_shard)
      std::copy_n(z.grads.begin() + static_cast<std::ptrdiff_t>(g.shard_offset), g.section, buf.begin() + own);
    else
      for (const ShardPiece& piece : pieces)
        std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(piece.flat), piece.count,
                    buf.begin() + static_cast<std::ptrdiff_t>(piece.other));
    const bool finite_before = count_nonfinite(buf) == 0;
    rk.collectives->all_reduce(buf, members, collective_tag(rk.step, op.channel), ReduceOp::sum, pr.allreduce,
                               Divide::none);
    if (in_shard)
      std::copy_n(buf.begin() + own, g.section, z.grads.begin() + static_cast<std::ptrdiff_t>(g.shard_offset));
    else
      for (const ShardPiece& piece : pieces)
        std::copy_n(buf.begin() + static_cast<std::ptrdiff_t>(piece.other), piece.count,
                    flat.begin() + static_cast<std::ptrdiff_t>(piece.flat));
    if (finite_before && count_nonfinite(buf) > 0)
      record_nonfinite(rk, fmt::format("{} (stage {}, replica {})", allreduce_label(op, pr.allreduce), rk.stage, rk.replica),
                       now());
  }

  // The schedule's all-gather of chunk op.chunk: after the optimizer step (stages 1-2) or before
  // FSDP's forwards (stage 2) the whole chunk into the working weights; before each pass under
  // stage 3, unit by unit as the pass will use them: the first (op bucket 0), then the rest.
  void zero_gather(Rank& rk, int index, const Op& op) {
    const int j = shape_.local_chunk(op);
    auto& z = rk.zero[j];
    const Collective& c = collective_of(*schedule_, op);
    const std::vector<int> members = collective_members(c, world_, rk.shard);
    if (gathers_units_ && op.microbatch >= 0) {
      UnitTimes units;
      rk.gather_waited = 1000 * gather_units(
                                    z.plan, gather_serves_forward(*rk.program, index), op.bucket == 1, rk.gather_gate,
                                    unit_key(j, 0),
                                    [&](int u, int part) {
                                      for (const ShardGroup& g : z.plan.units[static_cast<std::size_t>(u)].groups)
                                        gather_group(rk, j, g, members, collective_tag(rk.step, op.channel, part++), true);
                                      // Kept, not handed back by the pass: no room held for it.
                                      if (first_forwards_only_) rk.gather_gate.release(unit_key(j, u));
                                    },
                                    &units);
      auto& parts = rk.parts[static_cast<std::size_t>(index)];
      parts.clear();
      for (const auto& [room, end] : units) parts.emplace_back(at(room), at(end));
      return;
    }
    // FSDP's stage 2 gathers before every forward what the first one already brought: the values
    // are the same, and the chunk's passes may be reading them.
    const bool keep = op.microbatch < 0 || !z.gathered;
    gather_group(rk, j, z.plan.layout.whole(), members, collective_tag(rk.step, op.channel), keep);
    z.gathered = true;
  }

  void gather_group(Rank& rk, int j, const ShardGroup& g, const std::vector<int>& members, std::uint64_t tag,
                    bool keep) {
    if (g.section == 0) return;
    const std::span<float> buf = scratch(rk, g.section * static_cast<std::size_t>(plan_.data_shards()));
    const std::span<const float> own = working_shard(rk, j).subspan(g.shard_offset, g.section);
    std::copy(own.begin(), own.end(), buf.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(position(rk)) * g.section));
    rk.collectives->all_gather(buf, members, tag, plan_.config.precision.compute);
    if (keep) rk.zero[j].plan.layout.unpack(g, buf, rk.chunks[j].compute_weights());
  }

  // `n` elements of the rank's communication-thread scratch (their values are whatever was left).
  static std::span<float> scratch(Rank& rk, std::size_t n) {
    if (rk.comm_scratch.size() < n) rk.comm_scratch.resize(n);
    return std::span<float>(rk.comm_scratch).first(n);
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

  InjectedFault fault_;  // RunOptions::fault
  const RuntimePlan& rp_;
  const Plan& plan_;
  const Dataset& data_;
  World world_;
  StepShape shape_;
  bool pinned_;
  // Ranks that share cores, or whose collectives run beside their compute: whether the communication thread runs
  // first on its core (run_first_on_core, where a thread asking for it at the start was granted it).
  bool comm_first_ = false;
  bool comm_first_asked_ = false;
  std::unique_ptr<CoreGate> gate_;  // ranks share cores
  std::vector<std::atomic<Tick>> sent_at_;  // per message of the step and shard: when its send returned, or -1
  InProcessWorld comm_world_;
  std::shared_ptr<const Schedule> schedule_;
  GradientBuckets buckets_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  Clock::time_point epoch_;  // the step's start: written by the last rank to start, before go_
  std::atomic<int> started_{0};
  std::atomic<bool> go_{false};
  std::chrono::milliseconds comm_timeout_;
  bool gathers_units_ = false;  // ZeRO-3: weights gathered unit by unit before every pass
  bool first_forwards_only_ = false;  // --overlap-param-gather: only before each chunk's first forward
  bool stages_buckets_ = false;  // ZeRO-2/3: every micro-batch's buckets go to their reduce-scatters
  double gathered_bytes_ = 0;   // the two units a stage-3 rank holds at most
};

}  // namespace

int host_cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

bool cpu_collectives_beside_compute(const Plan& plan) {
  return plan.config.communication.overlap_grad_reduce || plan.reduces_every_microbatch() ||
         plan.gathers_before_forward() || plan.gathers_before_first_forward();
}

CpuCollectivePolls cpu_collective_polls(bool pinned, bool beside_compute) {
  if (!pinned) return {std::chrono::microseconds{0}, std::chrono::microseconds{0}};
  return {beside_compute ? kCpuOverlapPoll : kCpuCommPoll, kCpuCommPoll};
}

bool cpu_turns_wait_first(int shards_per_cell, bool granted) { return granted && shards_per_cell == 1; }

bool cpu_pins_ranks(const RunOptions& options, int ranks) { return options.pin_threads && ranks <= host_cores(); }

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
      .comm_ranks = [](const RuntimePlan&) { return std::max(2, host_cores()); },
      .kernel_clock = "one core, pinned",
      .calibrate_between_steps = true,  // a shared host's speed wanders
      .shares_by_turns = true,          // ranks beyond the cores: the engine's CoreGate
  };
  return backend;
}

}  // namespace trainsim::runtime
