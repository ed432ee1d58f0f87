#include "runtime/exec/executor.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/metrics.h"
#include "core/schedule.h"
#include "runtime/checkpoint.h"
#include "runtime/comm/in_process.h"
#include "runtime/data/dataset.h"
#include "runtime/exec/step_common.h"
#include "runtime/numerics/lowp.h"
#include "runtime/numerics/loss_scaler.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim::runtime {

namespace {

using Clock = std::chrono::steady_clock;

Tick ticks_since(Clock::time_point epoch, Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t - epoch).count() * 1000;
}

std::int64_t count_nonfinite(std::span<const float> xs) {
  std::int64_t n = 0;
  for (float x : xs) n += !std::isfinite(x);
  return n;
}

struct Shared;

// One rank: its model chunks, optimizer, scaler, buffers and the two threads' state.
struct Rank {
  int rank = 0, stage = 0, replica = 0;
  const RankProgram* program = nullptr;
  std::unique_ptr<Communicator> comm;
  std::vector<StageModel> chunks;  // local chunk j holds virtual stage j * pp + stage
  std::vector<OptimizerState> optimizers;
  std::vector<std::vector<std::uint8_t>> decay_masks;
  std::unique_ptr<LossScaler> scaler;

  // This step.
  int step = 0;
  std::vector<MicroBatchTokens> batches;
  std::vector<std::vector<float>> act_in, act_out, grad_out, grad_in;  // [chunk * m + mb]
  std::vector<int> units_done;                                         // [chunk * m + mb]
  std::vector<OpTiming> timing;
  std::vector<Tick> arrival;          // collectives: when this rank's communication thread started them
  OpCompletion completion;
  std::int64_t local_nonfinite = 0;   // in its own gradients, before any reduction
  bool found_nonfinite = false;
  double loss_sum = 0;
  int loss_count = 0;
  double grad_norm = 0;
  bool skipped = false;
  double scale_used = 1;
  std::string first_nonfinite;
  Tick first_nonfinite_at = -1;
  std::exception_ptr error;       // set by the compute thread
  std::exception_ptr comm_error;  // set by the communication thread

  // Memory accounting (bytes, in the formats values are held in).
  std::size_t buffer_elements = 0;
  double peak_bytes = 0;
  MemoryBreakdown peak;

  // Communication thread.
  CollectiveQueue collectives;  // to the communication thread
  std::thread comm_thread;
};

struct Shared {
  const RuntimePlan* rp = nullptr;
  const Plan* plan = nullptr;
  const Schedule* schedule = nullptr;
  const Dataset* data = nullptr;
  int m = 1, pp = 1, dp = 1, vpp = 1, V = 1;
  std::uint64_t data_position = 0;
  Clock::time_point epoch;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> bucket_ranges;  // [vstage][bucket] in gradient elements
};

DType compute_dtype(const Plan& plan) { return plan.config.precision.compute; }

class Engine {
 public:
  Engine(const RuntimePlan& rp, const Dataset& data, const RunOptions& options)
      : rp_(rp), plan_(rp.plan), options_(options), world_(plan_.num_ranks(), options.comm_timeout) {
    schedule_ = std::make_shared<const Schedule>(build_schedule(plan_));
    sh_.rp = &rp_;
    sh_.plan = &plan_;
    sh_.schedule = schedule_.get();
    sh_.data = &data;
    sh_.m = plan_.num_microbatches;
    sh_.pp = plan_.pp;
    sh_.dp = plan_.dp;
    sh_.vpp = plan_.vpp;
    sh_.V = plan_.num_virtual_stages();

    const auto& cfg = plan_.config;
    const OptimizerSettings os = optimizer_settings(cfg);

    std::vector<std::size_t> grad_elems(sh_.V, 0);
    ranks_.resize(plan_.num_ranks());
    for (int r = 0; r < plan_.num_ranks(); ++r) {
      auto& rk = ranks_[r];
      rk = std::make_unique<Rank>();
      rk->rank = r;
      rk->stage = plan_.stage_of(r);
      rk->replica = plan_.replica_of(r);
      rk->program = &schedule_->ranks[r];
      rk->comm = world_.communicator(r);
      for (int j = 0; j < sh_.vpp; ++j) {
        const int vs = j * sh_.pp + rk->stage;
        rk->chunks.emplace_back(stage_spec(rp_, vs));
        StageModel& model = rk->chunks.back();
        model.init(static_cast<std::uint64_t>(cfg.runtime.seed));
        round_master(model);
        rk->optimizers.emplace_back(os, model.master_weights().size());
        std::vector<std::uint8_t> mask(model.master_weights().size(), 1);
        for (const ParamInfo& p : model.params())
          if (!p.decay) std::fill(mask.begin() + p.offset, mask.begin() + p.offset + p.size, 0);
        rk->decay_masks.push_back(std::move(mask));
        grad_elems[vs] = model.gradients().size();
      }
      rk->scaler = std::make_unique<LossScaler>(cfg.precision.loss_scaling);
      rk->timing.resize(rk->program->ops.size());
      rk->arrival.assign(rk->program->ops.size(), -1);
    }
    GradientBuckets buckets = gradient_buckets(*schedule_, sh_.V, grad_elems);
    sh_.bucket_ranges = std::move(buckets.ranges);

    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    pinned_ = options.pin_threads && plan_.num_ranks() <= cores;
  }

  std::shared_ptr<const Schedule> schedule() const { return schedule_; }
  bool pinned() const { return pinned_; }
  Rank& rank(int r) { return *ranks_[r]; }
  int num_ranks() const { return static_cast<int>(ranks_.size()); }

  // Runs one optimizer step on every rank.
  void run_step(int step, std::uint64_t data_position) {
    sh_.data_position = data_position;
    // Everything a rank needs before the step begins (outside the measured step): its
    // micro-batches, clean gradients and numerics counters.
    for (auto& rk : ranks_) prepare_step(*rk, step);
    sh_.epoch = Clock::now();
    std::vector<std::thread> threads;
    threads.reserve(ranks_.size());
    for (auto& rk : ranks_) threads.emplace_back([this, r = rk.get()] { rank_main(*r); });
    for (auto& t : threads) t.join();
  }

  std::uint64_t replica_checksum(int replica) {
    std::uint64_t h = kFnvOffset;
    for (int s = 0; s < sh_.pp; ++s)
      for (auto& c : ranks_[plan_.rank_of(s, replica)]->chunks)
        h = fnv1a(h, c.master_weights());
    return h;
  }

  double replica_drift() {
    double drift = 0;
    for (int s = 0; s < sh_.pp; ++s)
      for (int d = 1; d < sh_.dp; ++d)
        for (int j = 0; j < sh_.vpp; ++j) {
          drift = std::max(drift, weight_difference(ranks_[plan_.rank_of(s, 0)]->chunks[j].master_weights(),
                                                    ranks_[plan_.rank_of(s, d)]->chunks[j].master_weights()));
        }
    return drift;
  }

 private:
  void round_master(StageModel& model) const {
    const DType master = plan_.config.precision.master_weights;
    if (master != DType::fp32) round_inplace(master, model.master_weights());
    model.refresh_working_weights();
  }

  void prepare_step(Rank& rk, int step) {
    rk.step = step;
    const int m = sh_.m;
    rk.batches.clear();
    const bool needs_data = rk.stage == 0 || rk.stage == sh_.pp - 1 || sh_.vpp > 1;
    if (needs_data)
      for (int mb = 0; mb < m; ++mb)
        rk.batches.push_back(sh_.data->microbatch(sh_.data_position, rk.replica, mb, sh_.dp, plan_.micro_batch_size));
    const std::size_t slots = static_cast<std::size_t>(sh_.vpp) * m;
    for (auto* v : {&rk.act_in, &rk.act_out, &rk.grad_out, &rk.grad_in}) {
      v->resize(slots);
      for (auto& b : *v) b.clear();
    }
    rk.units_done.assign(slots, 0);
    rk.buffer_elements = 0;
    for (auto& c : rk.chunks) {
      c.zero_gradients();
      c.numerics() = StageNumerics{};
    }
    rk.completion.reset(rk.program->ops.size());
    std::fill(rk.arrival.begin(), rk.arrival.end(), -1);
    rk.local_nonfinite = 0;
    rk.found_nonfinite = false;
    rk.loss_sum = 0;
    rk.loss_count = 0;
    rk.grad_norm = 0;
    rk.skipped = false;
    rk.scale_used = rk.scaler->scale();
    rk.first_nonfinite.clear();
    rk.first_nonfinite_at = -1;
    rk.error = nullptr;
    rk.comm_error = nullptr;
  }

  void pin(int core) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }

  void rank_main(Rank& rk) {
    if (pinned_) pin(rk.rank);
    rk.comm_thread = std::thread([this, &rk] { comm_main(rk); });
    try {
      const auto& ops = rk.program->ops;
      for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
        const Op& op = ops[i];
        if (is_collective(op.kind)) {
          rk.collectives.push(i);
          continue;
        }
        if (op.dep >= 0 && is_collective(ops[op.dep].kind)) rk.completion.wait(op.dep);
        const Tick start = now();
        run_op(rk, i, op);
        rk.timing[i] = {start, now()};
        rk.completion.mark(i);
        account_memory(rk);
        note_nonfinite(rk);
      }
    } catch (...) {
      rk.error = std::current_exception();
      rk.completion.fail(rk.error);
      world_abort(rk);
    }
    rk.collectives.push(-1);
    rk.comm_thread.join();
    if (!rk.error) rk.error = rk.comm_error;
  }

  Tick now() const { return ticks_since(sh_.epoch, Clock::now()); }

  void world_abort(Rank& rk) { rk.comm->abort(fmt::format("rank {} failed: {}", rk.rank, error_text(rk.error))); }

  void comm_main(Rank& rk) {
    for (;;) {
      const int i = rk.collectives.pop();
      if (i < 0) return;
      const Op& op = rk.program->ops[i];
      try {
        // Collective ops wait for their producing compute op (deps point backwards, and the
        // compute thread queued this op only after reaching it in program order).
        if (op.dep >= 0) rk.completion.wait(op.dep);
        // This rank reaches the collective when its communication thread can start it: its
        // producer done and the collectives queued before it finished, as the simulator's
        // communication stream does. (When the compute thread passed it in program order is
        // earlier, and would charge the wait for this rank's own stream to the others.)
        const Tick start = now();
        rk.arrival[i] = start;
        run_collective(rk, op);
        rk.timing[i] = {start, now()};
        rk.completion.mark(i);
      } catch (...) {
        if (!rk.comm_error) rk.comm_error = std::current_exception();
        rk.completion.fail(std::current_exception());
        rk.comm->abort(fmt::format("rank {} failed in {}", rk.rank, op_label(op)));
      }
    }
  }

  int local_chunk(const Op& op) const { return op.chunk / sh_.pp; }
  int slot(const Op& op) const { return local_chunk(op) * sh_.m + op.microbatch; }
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

  float loss_gradient_scale(const Rank& rk) const { return static_cast<float>(rk.scaler->scale() / sh_.m); }

  void run_op(Rank& rk, int index, const Op& op) {
    const int vs = op.chunk;
    switch (op.kind) {
      case OpKind::RecvActivation:
        rk.comm->recv(op.peer, message_tag(rk.step, op.channel), alloc(rk, rk.act_in[slot(op)]));
        return;
      case OpKind::RecvGradient:
        rk.comm->recv(op.peer, message_tag(rk.step, op.channel), alloc(rk, rk.grad_out[slot(op)]));
        return;
      case OpKind::SendActivation: {
        auto& buf = rk.act_out[slot(op)];
        rk.comm->send(op.peer, message_tag(rk.step, op.channel), buf);
        release(rk, buf);
        return;
      }
      case OpKind::SendGradient: {
        auto& buf = rk.grad_in[slot(op)];
        rk.comm->send(op.peer, message_tag(rk.step, op.channel), buf);
        release(rk, buf);
        return;
      }
      case OpKind::Forward: {
        StageModel& model = rk.chunks[local_chunk(op)];
        const auto* batch = rk.batches.empty() ? nullptr : &rk.batches[op.microbatch];
        const bool last = vs == sh_.V - 1;
        float* out = last ? nullptr : alloc(rk, rk.act_out[slot(op)]).data();
        const float* in = vs == 0 ? nullptr : rk.act_in[slot(op)].data();
        const float loss = model.forward(op.microbatch, vs == 0 ? batch->tokens.data() : nullptr,
                                         last ? batch->targets.data() : nullptr, in, out);
        if (vs > 0) release(rk, rk.act_in[slot(op)]);
        if (last) {
          rk.loss_sum += loss;
          ++rk.loss_count;
        }
        return;
      }
      case OpKind::Backward: backward(rk, op); return;
      case OpKind::BackwardInput: {
        StageModel& model = rk.chunks[local_chunk(op)];
        const bool last = vs == sh_.V - 1;
        float* gin = vs == 0 ? nullptr : alloc(rk, rk.grad_in[slot(op)]).data();
        model.backward_input(op.microbatch, last ? nullptr : rk.grad_out[slot(op)].data(), loss_gradient_scale(rk),
                             gin);
        if (!last) release(rk, rk.grad_out[slot(op)]);
        return;
      }
      case OpKind::BackwardWeight:
        // Split at bucket bounds only in name: the weight pass runs whole in its first segment.
        if (op.bucket <= 0) rk.chunks[local_chunk(op)].backward_weight(op.microbatch);
        return;
      case OpKind::OptimizerStep: optimizer_step(rk); return;
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: op {} ({}) cannot run on the compute thread", rk.rank, index,
                                       op_label(op)));
  }

  // A backward, or one segment of a backward cut at gradient-bucket bounds: segment k runs
  // units until bucket k's gradients are final, the last one runs the rest.
  void backward(Rank& rk, const Op& op) {
    const int vs = op.chunk;
    StageModel& model = rk.chunks[local_chunk(op)];
    const bool last_stage = vs == sh_.V - 1;
    const int s = slot(op);
    const auto& buckets = sh_.bucket_ranges[vs];
    const bool segmented = op.bucket >= 0;
    if (!segmented || op.bucket == 0)
      model.backward_begin(op.microbatch, last_stage ? nullptr : rk.grad_out[s].data(), loss_gradient_scale(rk));
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
    float* gin = vs == 0 ? nullptr : alloc(rk, rk.grad_in[s]).data();
    model.backward_end(op.microbatch, gin);
    if (!last_stage) release(rk, rk.grad_out[s]);
  }

  std::span<float> gradient_span(Rank& rk, const Op& op) {
    StageModel& model = rk.chunks[local_chunk(op)];
    if (op.bucket >= 0) {
      const auto [lo, hi] = sh_.bucket_ranges[op.chunk][op.bucket];
      return model.gradients().subspan(lo, hi - lo);
    }
    const ParamInfo e = model.token_embedding();
    return model.gradients().subspan(e.offset, e.size);
  }

  void run_collective(Rank& rk, const Op& op) {
    const auto& cfg = plan_.config;
    const std::uint64_t tag = collective_tag(rk.step, op.channel);
    switch (op.kind) {
      case OpKind::AllReduce:
      case OpKind::ReduceScatter: {
        const Collective& c = sh_.schedule->collectives[op.channel];
        auto grads = gradient_span(rk, op);
        const bool data_parallel = c.purpose == CollectivePurpose::gradients;
        if (data_parallel) rk.local_nonfinite += count_nonfinite(grads);
        const Divide divide = !data_parallel ? Divide::none
                              : cfg.precision.allreduce_divide == AllReduceDivide::before ? Divide::before
                                                                                          : Divide::after;
        const bool finite_before = count_nonfinite(grads) == 0;
        rk.comm->all_reduce(grads, c.members, tag, ReduceOp::sum, cfg.precision.allreduce, divide);
        if (finite_before && count_nonfinite(grads) > 0)
          record_nonfinite(rk, fmt::format("{} all-reduce of {} (stage {}, replica {})",
                                           dtype_name(cfg.precision.allreduce),
                                           data_parallel ? fmt::format("gradient bucket {}", op.bucket)
                                                         : std::string("the tied embedding gradient"),
                                           rk.stage, rk.replica));
        return;
      }
      case OpKind::OverflowCheck: {
        if (op.channel < 0) {
          // Local: only what this rank computed itself, before any reduction.
          std::int64_t own = rk.local_nonfinite;
          if (sh_.dp == 1)
            for (auto& c : rk.chunks) own += count_nonfinite(c.gradients());
          rk.found_nonfinite = own > 0;
          return;
        }
        std::int64_t n = 0;
        for (auto& c : rk.chunks) n += count_nonfinite(c.gradients());
        float flag = n > 0 ? 1.0f : 0.0f;
        const Collective& c = sh_.schedule->collectives[op.channel];
        rk.comm->all_reduce(std::span<float>(&flag, 1), c.members, tag, ReduceOp::max, DType::fp32, Divide::none);
        rk.found_nonfinite = !(flag == 0.0f);
        return;
      }
      default: break;
    }
    throw std::logic_error(fmt::format("rank {}: {} is not executed by the runtime (ZeRO is not implemented)",
                                       rk.rank, op_label(op)));
  }

  void optimizer_step(Rank& rk) {
    const auto& cfg = plan_.config;
    const float inv_scale = static_cast<float>(1.0 / rk.scaler->scale());
    // Unscale, and this rank's share of the global squared norm: its stage's gradients once
    // per replica, the last stage's copy of a tied embedding not counted again.
    double sumsq = 0;
    for (int j = 0; j < sh_.vpp; ++j) {
      StageModel& model = rk.chunks[j];
      auto g = model.gradients();
      for (float& x : g) x *= inv_scale;
      const int vs = j * sh_.pp + rk.stage;
      const ParamInfo e = model.token_embedding();
      const bool skip_copy = vs == sh_.V - 1 && sh_.V > 1 && e.size > 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        if (skip_copy && i >= e.offset && i < e.offset + e.size) continue;
        sumsq += static_cast<double>(g[i]) * g[i];
      }
    }
    float total = static_cast<float>(sumsq / sh_.dp);
    std::vector<int> everyone(sh_.pp * sh_.dp);
    for (int r = 0; r < static_cast<int>(everyone.size()); ++r) everyone[r] = r;
    rk.comm->all_reduce(std::span<float>(&total, 1), everyone,
                        collective_tag(rk.step, static_cast<int>(sh_.schedule->collectives.size())), ReduceOp::sum,
                        DType::fp32, Divide::none);
    rk.grad_norm = std::sqrt(static_cast<double>(total));

    const bool checks = cfg.precision.loss_scaling.mode != LossScalingMode::none;
    rk.skipped = rk.scaler->update(checks && rk.found_nonfinite);
    if (rk.skipped) return;
    const double clip = cfg.training.clip_grad;
    const float coef = clip > 0 && rk.grad_norm > clip ? static_cast<float>(clip / (rk.grad_norm + 1e-6)) : 1.0f;
    for (int j = 0; j < sh_.vpp; ++j) {
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
    now.buffers = static_cast<double>(rk.buffer_elements) * dtype_bytes(compute_dtype(plan_));
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
                                         rk.replica));
        return;
      }
  }

  void record_nonfinite(Rank& rk, std::string what) {
    if (rk.first_nonfinite_at >= 0) return;
    rk.first_nonfinite_at = now();
    rk.first_nonfinite = std::move(what);
  }

  const RuntimePlan& rp_;
  const Plan& plan_;
  RunOptions options_;
  InProcessWorld world_;
  std::shared_ptr<const Schedule> schedule_;
  Shared sh_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  bool pinned_ = false;

  friend RunReport run_cpu(const RuntimePlan&, const RunOptions&);
};

}  // namespace

std::string plan_fingerprint(const RuntimePlan& rp) {
  const Plan& p = rp.plan;
  const auto& pr = p.config.precision;
  return fmt::format(
      "model L{} h{} a{} s{} V{} tied{} | dp{} pp{} v{} {} m{} b{} layers {} | compute {} master {} accum {} "
      "allreduce {} divide {} check {} | optimizer {} seed {}",
      rp.dims.num_layers, rp.dims.hidden_size, rp.dims.num_heads, rp.dims.seq_length, rp.dims.vocab_size,
      rp.dims.tied_embeddings ? 1 : 0, p.dp, p.pp, p.vpp, schedule_name(p.config.parallelism.schedule),
      p.num_microbatches, p.micro_batch_size, fmt::join(p.layers_per_virtual_stage, "/"), dtype_name(pr.compute),
      dtype_name(pr.master_weights), dtype_name(pr.grad_accumulation), dtype_name(pr.allreduce),
      pr.allreduce_divide == AllReduceDivide::before ? "before" : "after",
      pr.overflow_check == OverflowScope::global ? "global" : "local", static_cast<int>(p.config.training.optimizer),
      p.config.runtime.seed);
}

RunReport run_cpu(const RuntimePlan& rp, const RunOptions& options) {
  RunReport report;
  report.runtime_plan = rp;
  const Dataset data = open_run_data(rp, options, report.data_source);
  Engine engine(report.runtime_plan, data, options);
  report.schedule = engine.schedule();
  report.threads_pinned = engine.pinned();
  report.execution = fmt::format("cpu: {} rank threads{}", engine.num_ranks(), engine.pinned() ? ", pinned to cores 0.." + std::to_string(engine.num_ranks() - 1) : "");
  const Plan& plan = report.runtime_plan.plan;
  const int steps = options.steps > 0 ? options.steps : plan.config.runtime.steps;
  const std::string fingerprint = plan_fingerprint(rp);

  int first = 1;
  if (!options.resume_from.empty()) {
    const Checkpoint ck = load_checkpoint(options.resume_from, fingerprint);
    if (static_cast<int>(ck.ranks.size()) != engine.num_ranks())
      throw CheckpointError(fmt::format("checkpoint has {} ranks, the plan {}", ck.ranks.size(), engine.num_ranks()));
    for (const RankCheckpoint& rc : ck.ranks) {
      Rank& rk = engine.rank(rc.rank);
      std::size_t off = 0;
      for (std::size_t j = 0; j < rk.chunks.size(); ++j) {
        auto w = rk.chunks[j].master_weights();
        if (off + w.size() > rc.master_weights.size())
          throw CheckpointError(fmt::format("checkpoint rank {} holds fewer weights than the model", rc.rank));
        std::copy_n(rc.master_weights.begin() + off, w.size(), w.begin());
        auto& o = rk.optimizers[j];
        if (!rc.first_moment.empty()) {
          std::copy_n(rc.first_moment.begin() + off, w.size(), o.first_moment().begin());
          std::copy_n(rc.second_moment.begin() + off, w.size(), o.second_moment().begin());
        }
        o.set_steps_taken(rc.optimizer_steps);
        rk.chunks[j].refresh_working_weights();
        off += w.size();
      }
      rk.scaler->restore(rc.scaler);
    }
    first = ck.step + 1;
  }
  report.first_step = first;

  const std::uint64_t samples_per_step = static_cast<std::uint64_t>(plan.global_batch_size);
  std::vector<Timeline> timelines;
  LossWatch loss_watch;
  for (int step = first; step <= steps; ++step) {
    const auto t0 = Clock::now();
    engine.run_step(step, static_cast<std::uint64_t>(step - 1) * samples_per_step);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();

    // A rank that threw (communication timeout, a bug) ends the run with its error.
    for (int r = 0; r < engine.num_ranks(); ++r)
      if (engine.rank(r).error) {
        report.failure =
            RunFailure{step, fmt::format("rank {} failed at step {}: {}", r, step, error_text(engine.rank(r).error))};
        break;
      }
    if (report.failure) break;

    std::vector<std::vector<OpTiming>> timing;
    std::vector<std::vector<Tick>> arrival;
    for (int r = 0; r < engine.num_ranks(); ++r) {
      timing.push_back(engine.rank(r).timing);
      arrival.push_back(engine.rank(r).arrival);
    }
    Timeline tl = measured_timeline(report.schedule, timing, arrival);
    timelines.push_back(std::move(tl));

    std::vector<RankStep> ranks;
    for (int r = 0; r < engine.num_ranks(); ++r) {
      Rank& rk = engine.rank(r);
      RankStep rs;
      RankStepNumerics& n = rs.numerics;
      n.rank = r;
      n.stage = rk.stage;
      n.replica = rk.replica;
      for (auto& c : rk.chunks) {
        const StageNumerics& sn = c.numerics();
        n.max_abs_activation = std::max(n.max_abs_activation, sn.max_abs_activation);
        n.max_abs_gradient = std::max(n.max_abs_gradient, sn.max_abs_gradient);
        n.nonfinite_count += sn.nonfinite_activations + sn.nonfinite_gradients;
      }
      n.found_nonfinite = rk.found_nonfinite;
      n.skipped = rk.skipped;
      n.loss_scale = rk.scale_used;
      n.first_nonfinite = rk.first_nonfinite;
      rs.loss_sum = rk.loss_sum;
      rs.loss_count = rk.loss_count;
      rs.grad_norm = rk.grad_norm;
      rs.first_nonfinite_at = rk.first_nonfinite_at;
      ranks.push_back(std::move(rs));
    }
    std::string first_nonfinite;
    StepRecord rec = step_record(step, seconds, ranks, &first_nonfinite);
    for (int d = 0; d < plan.dp; ++d) rec.replica_checksums.push_back(engine.replica_checksum(d));
    rec.replica_drift = engine.replica_drift();
    if (options.on_step) options.on_step(rec);
    report.steps.push_back(rec);

    report.failure = loss_watch.check(rec, first, first_nonfinite);

    if (checkpoint_due(options, step, steps) && !report.failure) {
      Checkpoint ck;
      ck.fingerprint = fingerprint;
      ck.step = step;
      ck.data_position = static_cast<std::uint64_t>(step) * samples_per_step;
      ck.seed = static_cast<std::uint64_t>(plan.config.runtime.seed);
      for (int r = 0; r < engine.num_ranks(); ++r) {
        Rank& rk = engine.rank(r);
        RankCheckpoint rc;
        rc.rank = r;
        for (std::size_t j = 0; j < rk.chunks.size(); ++j) {
          auto w = rk.chunks[j].master_weights();
          rc.master_weights.insert(rc.master_weights.end(), w.begin(), w.end());
          auto& o = rk.optimizers[j];
          rc.first_moment.insert(rc.first_moment.end(), o.first_moment().begin(), o.first_moment().end());
          rc.second_moment.insert(rc.second_moment.end(), o.second_moment().begin(), o.second_moment().end());
          rc.optimizer_steps = o.steps_taken();
        }
        rc.scaler = rk.scaler->state();
        ck.ranks.push_back(std::move(rc));
      }
      report.checkpoints.push_back(save_checkpoint(options.checkpoint_dir, ck));
    }
    if (report.failure) break;
  }

  // The step the result describes: the median by time (step_common.h).
  if (const int chosen = median_step_index(report.steps); chosen >= 0) {
    report.timeline = timelines[chosen];
    report.timeline_step = report.steps[chosen].step;
  } else {
    report.timeline.schedule = report.schedule;
    report.timeline.predicted = false;
    report.timeline.ops.assign(engine.num_ranks(), {});
    for (int r = 0; r < engine.num_ranks(); ++r) report.timeline.ops[r].assign(report.schedule->ranks[r].ops.size(), {});
  }
  for (int r = 0; r < engine.num_ranks(); ++r) report.memory.push_back(engine.rank(r).peak);
  report.result = compute_result(plan, report.timeline, report.memory);
  report.result.mfu = 0;  // the CPU's peak is not known until `trainsim calibrate` measures it
  for (const auto& n : rp.notes) report.result.warnings.push_back("runtime: " + n);
  return report;
}

}  // namespace trainsim::runtime
