#include "core/schedule.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include "core/model_shape.h"
#include "core/plan.h"

namespace trainsim {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::Forward: return "Forward";
    case OpKind::Backward: return "Backward";
    case OpKind::BackwardInput: return "BackwardInput";
    case OpKind::BackwardWeight: return "BackwardWeight";
    case OpKind::SendActivation: return "SendActivation";
    case OpKind::RecvActivation: return "RecvActivation";
    case OpKind::SendGradient: return "SendGradient";
    case OpKind::RecvGradient: return "RecvGradient";
    case OpKind::AllReduce: return "AllReduce";
    case OpKind::ReduceScatter: return "ReduceScatter";
    case OpKind::AllGather: return "AllGather";
    case OpKind::OverflowCheck: return "OverflowCheck";
    case OpKind::OptimizerStep: return "OptimizerStep";
  }
  return "?";
}

std::string op_label(const Op& op) {
  switch (op.kind) {
    case OpKind::Forward: return fmt::format("F{}", op.microbatch);
    case OpKind::Backward: return fmt::format("B{}", op.microbatch);
    case OpKind::BackwardInput: return fmt::format("BI{}", op.microbatch);
    case OpKind::BackwardWeight: return fmt::format("BW{}", op.microbatch);
    case OpKind::SendActivation: return fmt::format("send act {}", op.microbatch);
    case OpKind::RecvActivation: return fmt::format("recv act {}", op.microbatch);
    case OpKind::SendGradient: return fmt::format("send grad {}", op.microbatch);
    case OpKind::RecvGradient: return fmt::format("recv grad {}", op.microbatch);
    case OpKind::AllReduce: return op.bucket >= 0 ? fmt::format("AR b{}", op.bucket) : "AR embedding";
    case OpKind::ReduceScatter: return fmt::format("RS b{}", op.bucket);
    case OpKind::AllGather:
      if (op.microbatch < 0) return "AG params";
      return op.bucket == 1 ? fmt::format("AG w{} rest", op.microbatch) : fmt::format("AG w{}", op.microbatch);
    case OpKind::OverflowCheck: return "found-inf";
    case OpKind::OptimizerStep: return "optimizer";
  }
  return "?";
}

bool sends_next(const RankProgram& program, int i) {
  const auto& ops = program.ops;
  for (std::size_t j = static_cast<std::size_t>(i) + 1; j < ops.size(); ++j)
    if (!is_collective(ops[j].kind)) return is_send(ops[j].kind);
  return false;
}

std::size_t Schedule::total_ops() const {
  std::size_t n = 0;
  for (const auto& r : ranks) n += r.ops.size();
  return n;
}

namespace {

// One compute task of a stage's pipeline order; local_chunk in 0..v-1.
struct Task {
  OpKind kind;
  int local_chunk;
  int microbatch;
  // A forward of the interleaved schedule's steady state, which Megatron-LM runs back to back
  // with the backward after it before exchanging with both neighbours (see Builder::build_rank).
  bool steady = false;
};

void gpipe_order(int m, std::vector<Task>& t) {
  for (int i = 0; i < m; ++i) t.push_back({OpKind::Forward, 0, i});
  for (int i = 0; i < m; ++i) t.push_back({OpKind::Backward, 0, i});
}

// 1F1B (PipeDream-Flush): p-s-1 warm-up forwards, then alternate, then drain.
void one_f_one_b_order(int s, int p, int m, std::vector<Task>& t) {
  const int warmup = std::min(p - s - 1, m);
  for (int i = 0; i < warmup; ++i) t.push_back({OpKind::Forward, 0, i});
  for (int i = 0; i < m - warmup; ++i) {
    t.push_back({OpKind::Forward, 0, warmup + i});
    t.push_back({OpKind::Backward, 0, i});
  }
  for (int i = m - warmup; i < m; ++i) t.push_back({OpKind::Backward, 0, i});
}

// Interleaved 1F1B (Narayanan et al. 2021): forwards visit chunks in groups of n micro-batches
// (Megatron-Core's microbatch_group_size_per_vp_stage, p unless set; `get_schedule_table`: the
// last group holds what is left), every chunk of a group before the next group; backwards visit
// the same order with the chunks reversed. Stage s warms up with (v-1) n + 2 (p-s-1) forwards.
// Megatron-LM runs every forward first when m == p (`all_warmup_microbatches` in schedules.py
// until Megatron-Core's tunable schedule of November 2024); PyTorch's ScheduleInterleaved1F1B
// (torch.distributed.pipelining, what torchtitan runs) keeps the rule there too
// (`get_rank_warmup_ops`).
void interleaved_order(int s, int p, int m, int v, int n, bool all_warmup_when_m_is_p, std::vector<Task>& t) {
  const int total = m * v;
  int warmup = (m == p && all_warmup_when_m_is_p) ? total : std::min(total, (p - s - 1) * 2 + (v - 1) * n);
  // The k-th task's (chunk, micro-batch) in forward order: (m-1)/n groups of n micro-batches,
  // then the last group, whatever remains (1 to n), each group's micro-batches chunk by chunk.
  const int full = (m - 1) / n;
  auto at = [&](int k) {
    const int group = std::min(k / (n * v), full);
    const int first = group * n, size = group < full ? n : m - first;
    const int within = k - first * v;
    return std::pair(within / size, first + within % size);
  };
  auto push = [&](OpKind kind, int k, bool steady = false) {
    const auto [chunk, mb] = at(k);
    t.push_back({kind, kind == OpKind::Forward ? chunk : v - 1 - chunk, mb, steady});
  };
  for (int k = 0; k < warmup; ++k) push(OpKind::Forward, k);
  for (int k = 0; k < total - warmup; ++k) {
    push(OpKind::Forward, k + warmup, true);
    push(OpKind::Backward, k);
  }
  for (int k = total - warmup; k < total; ++k) push(OpKind::Backward, k);
}

// ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B (input gradient) and W
// (weight gradient). Stage s defers its first s W passes, so every stage keeps the same
// number of micro-batches in flight as stage 0 of 1F1B, and the deferred Ws fill the
// drain bubbles. Bubble: (p-1)(T_F + T_B - T_W) instead of 1F1B's (p-1)(T_F + T_B + T_W).
void zb_h1_order(int s, int p, int m, std::vector<Task>& t) {
  const int warmup = std::min(p - s - 1, m);
  int next_w = 0, bs_done = 0;
  auto backward = [&](int i) {
    t.push_back({OpKind::BackwardInput, 0, i});
    ++bs_done;
    if (bs_done - next_w > s) t.push_back({OpKind::BackwardWeight, 0, next_w++});
  };
  for (int i = 0; i < warmup; ++i) t.push_back({OpKind::Forward, 0, i});
  for (int i = 0; i < m - warmup; ++i) {
    t.push_back({OpKind::Forward, 0, warmup + i});
    backward(i);
  }
  for (int i = m - warmup; i < m; ++i) backward(i);
  while (next_w < m) t.push_back({OpKind::BackwardWeight, 0, next_w++});
}

// Into `t` (cleared first; its storage reused rank after rank). `framework` says whose
// interleaved schedule runs (FSDP: PyTorch's pipelining; otherwise Megatron-LM's).
void pipeline_order(ScheduleKind kind, Framework framework, int s, int p, int m, int v, int n, std::vector<Task>& t) {
  t.clear();
  switch (kind) {
    case ScheduleKind::gpipe: return gpipe_order(m, t);
    case ScheduleKind::one_f_one_b: return one_f_one_b_order(s, p, m, t);
    case ScheduleKind::interleaved_1f1b: return interleaved_order(s, p, m, v, n, framework != Framework::fsdp, t);
    case ScheduleKind::zb_h1: return zb_h1_order(s, p, m, t);
  }
}

class Builder {
 public:
  // Fills `out`, reusing its vectors' storage (a sweep builds schedule after schedule into one).
  Builder(const Plan& plan, Schedule& out) : plan_(plan), shape_(plan.config.model), sched_(out) {
    const auto& cfg = plan.config;
    V_ = plan.num_virtual_stages();
    m_ = plan.num_microbatches;
    const int e_weights = plan.weight_bytes();
    // A stage sends its output activations: each GPU its tokens (s / cp) of its shard.
    act_bytes_ = static_cast<Bytes>(std::llround(static_cast<double>(plan.micro_batch_size) *
                                                 plan.local_seq_length() * shape_.h * plan.activation_bytes() /
                                                 plan.tp));
    // Gradient buckets and collective ids, identical for every replica of a stage.
    bucket_bytes_.resize(V_);
    for (int vs = 0; vs < V_; ++vs) {
      bucket_bytes_[vs] = plan.gradient_buckets(vs);
      chunk_grad_bytes_.push_back(plan.gradient_bytes(vs));
      chunk_weight_bytes_.push_back(static_cast<Bytes>(std::llround(plan.shard_params(vs) * e_weights)));
    }
    const int stage_count = plan.pp;
    // Gradient buckets: once per step, or (ZeRO-2/3 as DeepSpeed and FSDP run them) after every
    // micro-batch's backward: then each (chunk, micro-batch, bucket) is its own collective.
    per_microbatch_ = plan.reduces_every_microbatch();
    const int reductions = per_microbatch_ ? m_ : 1;
    for (int vs = 0; vs < V_; ++vs) {
      bucket_base_.push_back(num_collectives_);
      for (int mb = 0; mb < reductions; ++mb)
        for (Bytes b : bucket_bytes_[vs])
          stage_members(add_collective(zero() >= 1 ? OpKind::ReduceScatter : OpKind::AllReduce,
                                       CollectivePurpose::gradients, b),
                        vs % stage_count);
    }
    // Tied embeddings split over a pipeline: the first stage's input embedding and the last
    // stage's LM head are one parameter, so their gradients are summed across the two
    // (Megatron-LM's embedding group) before the optimizer step.
    if (shape_.tied && plan.pp > 1) {
      embedding_base_ = num_collectives_;
      const Bytes bytes = static_cast<Bytes>(std::llround(static_cast<double>(shape_.V) * shape_.h / plan.tp *
                                                          dtype_bytes(cfg.precision.allreduce)));
      for (int d = 0; d < plan.dp; ++d) {
        auto& members = add_collective(OpKind::AllReduce, CollectivePurpose::embedding, bytes);
        members.push_back(plan.rank_of(0, d));
        members.push_back(plan.rank_of(plan.pp - 1, d));
      }
    }
    if (plan.gathers_after_step()) {
      param_gather_base_ = num_collectives_;
      for (int vs = 0; vs < V_; ++vs)
        stage_members(add_collective(OpKind::AllGather, CollectivePurpose::parameters, chunk_weight_bytes_[vs]),
                      vs % stage_count);
    }
    if (needs_overflow_check() && cfg.precision.overflow_check == OverflowScope::global && plan.num_ranks() > 1) {
      overflow_id_ = num_collectives_;
      auto& all = add_collective(OpKind::OverflowCheck, CollectivePurpose::overflow, 4);
      for (int r = 0; r < plan.num_ranks(); ++r) all.push_back(r);
    }
    // Sharded parameters gathered for every micro-batch: before its forward, and again before
    // its backward when they were resharded after the forward (ZeRO-3, reshard_after_forward).
    // ZeRO-3 gathers unit by unit: the pass's first unit (the pass waits for it), then the rest
    // (one collective per unit, while the pass runs): two collectives each (Plan::zero3_gather_units).
    gather_dirs_ = (plan.gathers_before_forward() ? 1 : 0) + (plan.gathers_before_backward() ? 1 : 0);
    gather_parts_ = plan.gathers_before_backward() ? 2 : 1;
    if (gather_dirs_ > 0) {
      zero3_base_ = num_collectives_;
      for (int vs = 0; vs < V_; ++vs)
        for (int mb = 0; mb < m_; ++mb)
          for (int dir = 0; dir < gather_dirs_; ++dir) {
            if (gather_parts_ == 1) {
              stage_members(add_collective(OpKind::AllGather, CollectivePurpose::parameters, chunk_weight_bytes_[vs]),
                            vs % stage_count);
              continue;
            }
            add_unit_gathers(plan, vs, plan.zero3_gather_units(vs, dir == 0 && plan.gathers_before_forward()));
          }
    }
    // --overlap-param-gather: each chunk's parameters once a step, before its first forward, in
    // the same two parts (the forward's first unit, the rest while the forward runs).
    if (plan.gathers_before_first_forward()) {
      first_forward_base_ = num_collectives_;
      for (int vs = 0; vs < V_; ++vs) add_unit_gathers(plan, vs, plan.zero3_gather_units(vs, true));
    }
    sched_.collectives.resize(num_collectives_);
  }

  // A pass's gather of chunk vs's weights as two collectives: the first unit's (the pass waits for
  // it), then the rest, one call per unit.
  void add_unit_gathers(const Plan& plan, int vs, const Plan::GatherUnits& u) {
    const auto whole = static_cast<double>(chunk_weight_bytes_[vs]);
    const auto first = static_cast<Bytes>(std::llround(whole * u.first_share));
    const Bytes rest = std::max<Bytes>(0, static_cast<Bytes>(std::llround(whole * u.gathered_share)) - first);
    stage_members(add_collective(OpKind::AllGather, CollectivePurpose::parameters, first), vs % plan.pp);
    sched_.collectives[num_collectives_ - 1].parts = first > 0 ? 1 : 0;  // nothing to gather: no call
    stage_members(add_collective(OpKind::AllGather, CollectivePurpose::parameters, rest), vs % plan.pp);
    sched_.collectives[num_collectives_ - 1].parts = rest > 0 ? std::max(1, u.count - 1) : 0;
  }

  // copy_replicas: build replica 0's programs and derive the others from them (they differ
  // only in the ranks they exchange messages with, the message ids and the embedding
  // group); otherwise every rank is built on its own. Both give the same schedule.
  // replica0_only: the programs of replicas 1.. are left empty.
  void build(bool copy_replicas, bool replica0_only = false) {
    sched_.kind = plan_.config.parallelism.schedule;
    sched_.num_stages = plan_.pp;
    sched_.num_replicas = plan_.dp;
    sched_.num_chunks = plan_.vpp;
    sched_.num_microbatches = m_;
    sched_.num_messages = plan_.dp * std::max(0, V_ - 1) * m_ * 2;
    sched_.ranks.resize(plan_.num_ranks());
    for (int r = 0; r < plan_.num_ranks(); ++r) {
      if (replica0_only && plan_.replica_of(r) > 0) {
        RankProgram& prog = sched_.ranks[r];
        prog.rank = r;
        prog.stage = plan_.stage_of(r);
        prog.replica = plan_.replica_of(r);
        prog.ops.clear();
      } else if (copy_replicas && plan_.replica_of(r) > 0)
        copy_rank(r);
      else
        build_rank(r);
    }
  }

 private:
  std::vector<int>& add_collective(OpKind kind, CollectivePurpose purpose, Bytes bytes) {
    if (static_cast<int>(sched_.collectives.size()) <= num_collectives_) sched_.collectives.emplace_back();
    Collective& c = sched_.collectives[num_collectives_++];
    c.kind = kind;
    c.purpose = purpose;
    c.bytes = bytes;
    c.parts = 1;
    c.members.clear();
    return c.members;
  }

  void copy_rank(int r) {
    const int s = plan_.stage_of(r), d = plan_.replica_of(r);
    const RankProgram& first = sched_.ranks[plan_.rank_of(s, 0)];
    RankProgram& prog = sched_.ranks[r];
    prog.rank = r;
    prog.stage = s;
    prog.replica = d;
    prog.ops = first.ops;
    // rank_of(stage, d) = rank_of(stage, 0) + d; message_id(d, ...) = message_id(0, ...) + d * (V - 1) * m * 2.
    const int message_shift = d * (V_ - 1) * m_ * 2;
    for (Op& op : prog.ops) {
      if (is_send(op.kind) || is_recv(op.kind)) {
        op.peer += d;
        op.channel += message_shift;
      } else if (op.kind == OpKind::AllReduce && embedding_base_ >= 0 && op.channel == embedding_base_) {
        op.channel += d;
      }
    }
  }

  int zero() const { return plan_.zero(); }
  // A loss scale needs the found-inf check; FP8 (Transformer Engine's recipe) scales each tensor
  // by its own amax history instead, with BF16 as the higher precision: no loss scale, no check.
  bool needs_overflow_check() const {
    return plan_.config.precision.loss_scaling.mode != LossScalingMode::none &&
           plan_.config.precision.compute != DType::fp8;
  }

  // The replicas of a stage, ascending: rank_of(stage, d) = rank_of(stage, 0) + d.
  void stage_members(std::vector<int>& v, int stage) const {
    v.resize(plan_.dp);
    std::iota(v.begin(), v.end(), plan_.rank_of(stage, 0));
  }

  // Message between virtual stages vs and vs+1 of one replica, per micro-batch and direction.
  int message_id(int replica, int boundary, int mb, bool gradient) const {
    return ((replica * (V_ - 1) + boundary) * m_ + mb) * 2 + (gradient ? 1 : 0);
  }
  int rank_of_virtual(int vs, int replica) const { return plan_.rank_of(vs % plan_.pp, replica); }

  int push(std::vector<Op>& ops, Op op) {
    ops.push_back(op);
    return static_cast<int>(ops.size()) - 1;
  }

  void build_rank(int r) {
    RankProgram& prog = sched_.ranks[r];
    const int s = plan_.stage_of(r), d = plan_.replica_of(r), p = plan_.pp, v = plan_.vpp;
    prog.rank = r;
    prog.stage = s;
    prog.replica = d;
    auto& ops = prog.ops;
    ops.clear();
    std::vector<Task>& tasks = tasks_;
    pipeline_order(plan_.config.parallelism.schedule, plan_.framework, s, p, m_, v, plan_.microbatch_group, tasks);
    const bool overlap = plan_.config.communication.overlap_grad_reduce;

    // The task that completes each chunk's gradients: its last B (or W when split).
    std::vector<int>& last_grad_task = last_grad_task_;
    last_grad_task.assign(v, -1);
    for (int i = 0; i < static_cast<int>(tasks.size()); ++i) {
      const OpKind k = tasks[i].kind;
      if (k == OpKind::Backward || k == OpKind::BackwardWeight) last_grad_task[tasks[i].local_chunk] = i;
    }

    std::vector<int>& compute_ops = compute_ops_;  // indices of compute ops in program order (ZeRO-3 prefetch)
    std::vector<int>& chunks_done = chunks_done_;  // local chunks in the order their gradients complete
    compute_ops.clear();
    chunks_done.clear();
    int last_collective = -1;
    // --overlap-param-gather: a chunk's first forward reads its units as they arrive and ends no
    // sooner than the last: the rank's next compute op waits for the rest of the gather (a next
    // op with a gather of its own waits behind it on the communication stream already).
    int first_forward_gather = -1, rest_to_wait = -1;
    // Megatron-LM's interleaved schedule without p2p overlap runs each steady-state forward and
    // backward back to back and only then exchanges with both neighbours at once
    // (send_forward_backward_recv_forward_backward: both sends, and the receives for the next
    // pair). Its ops are placed so: the pair's receives before its forward, its sends after its
    // backward. Everywhere else a task's receive comes right before it and its send right after:
    // a stage whose warm-up is every forward (all of them when m == p) has no steady state, and
    // receives its first backward's gradient after its last forward (recv_backward before the
    // cool-down), not before it, which the next stage's gradient needs.
    const bool paired = plan_.config.parallelism.schedule == ScheduleKind::interleaved_1f1b &&
                        !plan_.config.communication.overlap_p2p_comm;
    auto recv_for = [&](const Task& task) {
      const int vs = task.local_chunk * p + s;
      const int mb = task.microbatch;
      if (task.kind == OpKind::Forward && vs > 0) {
        Op rc{OpKind::RecvActivation, static_cast<std::int16_t>(vs), mb};
        rc.peer = rank_of_virtual(vs - 1, d);
        rc.channel = message_id(d, vs - 1, mb, false);
        rc.bytes = act_bytes_;
        push(ops, rc);
      } else if ((task.kind == OpKind::Backward || task.kind == OpKind::BackwardInput) && vs < V_ - 1) {
        Op rc{OpKind::RecvGradient, static_cast<std::int16_t>(vs), mb};
        rc.peer = rank_of_virtual(vs + 1, d);
        rc.channel = message_id(d, vs, mb, true);
        rc.bytes = act_bytes_;
        push(ops, rc);
      }
    };
    auto send_for = [&](const Task& task, int task_end) {
      const int vs = task.local_chunk * p + s;
      const int mb = task.microbatch;
      if (task.kind == OpKind::Forward && vs < V_ - 1) {
        Op sd{OpKind::SendActivation, static_cast<std::int16_t>(vs), mb};
        sd.peer = rank_of_virtual(vs + 1, d);
        sd.channel = message_id(d, vs, mb, false);
        sd.bytes = act_bytes_;
        sd.dep = task_end;
        push(ops, sd);
      } else if ((task.kind == OpKind::Backward || task.kind == OpKind::BackwardInput) && vs > 0) {
        Op sd{OpKind::SendGradient, static_cast<std::int16_t>(vs), mb};
        sd.peer = rank_of_virtual(vs - 1, d);
        sd.channel = message_id(d, vs - 1, mb, true);
        sd.bytes = act_bytes_;
        sd.dep = task_end;
        push(ops, sd);
      }
    };
    // The task's gather (ZeRO-3) and compute ops; returns the op that ends it.
    auto compute_for = [&](int i, int own_gather) {
      const Task& task = tasks[i];
      const int gather = own_gather >= 0 ? own_gather : rest_to_wait;
      rest_to_wait = own_gather >= 0 && own_gather == first_forward_gather ? own_gather + 1 : -1;
      const int vs = task.local_chunk * p + s;
      const int mb = task.microbatch;
      // The task that completes gradients to reduce (the chunk's last gradient-producing task,
      // or every one when gradients are reduced per micro-batch) is split at bucket bounds when
      // reductions overlap with backward, each bucket leaving as soon as it is whole; without
      // overlap its buckets follow it whole.
      const auto& buckets = bucket_bytes_[vs];
      const bool completes_grads = i == last_grad_task[task.local_chunk];
      const bool makes_grads = task.kind == OpKind::Backward || task.kind == OpKind::BackwardWeight;
      const bool reduces_now = per_microbatch_ ? makes_grads : completes_grads;
      const int reduction = per_microbatch_ ? mb : 0;
      int task_end = -1;
      if (reduces_now && overlap && buckets.size() > 0) {
        for (std::size_t k = 0; k < buckets.size(); ++k) {
          Op seg{task.kind, static_cast<std::int16_t>(vs), mb};
          seg.bucket = static_cast<int>(k);
          seg.bytes = buckets[k];
          seg.work = static_cast<double>(buckets[k]) / static_cast<double>(chunk_grad_bytes_[vs]);
          if (k == 0 && gather >= 0) seg.dep = gather;
          task_end = push(ops, seg);
          compute_ops.push_back(task_end);
          last_collective = push(ops, gradient_collective(vs, reduction, static_cast<int>(k), task_end));
        }
      } else {
        Op c{task.kind, static_cast<std::int16_t>(vs), mb};
        c.dep = gather;
        task_end = push(ops, c);
        compute_ops.push_back(task_end);
        if (reduces_now && per_microbatch_)
          for (std::size_t k = 0; k < buckets.size(); ++k)
            last_collective = push(ops, gradient_collective(vs, reduction, static_cast<int>(k), task_end));
      }
      if (completes_grads) chunks_done.push_back(task.local_chunk);
      return task_end;
    };
    auto gather_for = [&](const Task& task) {
      const int vs = task.local_chunk * p + s;
      const bool fwd = task.kind == OpKind::Forward;
      const bool needs_weights = task.kind != OpKind::BackwardWeight;
      const bool first_forward = fwd && task.microbatch == 0 && plan_.gathers_before_first_forward();
      if (!needs_weights ||
          !(first_forward || (fwd ? plan_.gathers_before_forward() : plan_.gathers_before_backward())))
        return -1;
      Op ag{OpKind::AllGather, static_cast<std::int16_t>(vs), task.microbatch};
      ag.channel = first_forward
                       ? first_forward_base_ + 2 * vs
                       : zero3_base_ + ((vs * m_ + task.microbatch) * gather_dirs_ + (fwd ? 0 : 1)) * gather_parts_;
      ag.bytes = sched_.collectives[ag.channel].bytes;
      ag.bucket = 0;  // the first unit (ZeRO-3), or the whole chunk
      ag.dep = compute_ops.size() >= 2 ? compute_ops[compute_ops.size() - 2] : -1;  // prefetch one ahead
      const int first = push(ops, ag);
      if (first_forward) first_forward_gather = first;
      if (first_forward || gather_parts_ == 2) {  // the rest, right after it on the communication stream
        Op rest = ag;
        rest.channel = ag.channel + 1;
        rest.bytes = sched_.collectives[rest.channel].bytes;
        rest.bucket = 1;
        rest.dep = -1;
        push(ops, rest);
      }
      return first;
    };
    for (int i = 0; i < static_cast<int>(tasks.size()); ++i) {
      const bool pair = paired && tasks[i].steady;  // interleaved_order puts its backward next
      if (!pair) {
        const int gather = gather_for(tasks[i]);
        recv_for(tasks[i]);
        send_for(tasks[i], compute_for(i, gather));
        continue;
      }
      const int gather_f = gather_for(tasks[i]);
      recv_for(tasks[i]);
      recv_for(tasks[i + 1]);
      const int end_f = compute_for(i, gather_f);
      const int end_b = compute_for(i + 1, gather_for(tasks[i + 1]));
      send_for(tasks[i], end_f);
      send_for(tasks[i + 1], end_b);
      ++i;
    }
    const int last_compute = compute_ops.empty() ? -1 : compute_ops.back();

    // Without overlap, every bucket of a once-per-step reduction waits for the whole backward.
    if (!overlap && !per_microbatch_)
      for (int j : chunks_done) {
        const int vs = j * p + s;
        for (std::size_t k = 0; k < bucket_bytes_[vs].size(); ++k)
          last_collective = push(ops, gradient_collective(vs, 0, static_cast<int>(k), last_compute));
      }

    // The tied embedding's gradient, summed between the first and last stage.
    if (embedding_base_ >= 0 && (s == 0 || s == p - 1)) {
      Op ar{OpKind::AllReduce, static_cast<std::int16_t>(s == 0 ? 0 : V_ - 1)};
      ar.channel = embedding_base_ + d;
      ar.bytes = sched_.collectives[ar.channel].bytes;
      ar.dep = last_compute;
      last_collective = push(ops, ar);
    }

    // Loss-scaling found-inf check: a max-reduction over every rank (global) or this rank's own check.
    int before_step = last_collective;
    if (needs_overflow_check()) {
      Op oc{OpKind::OverflowCheck};
      oc.channel = overflow_id_;  // -1 for a local check: no collective
      oc.bytes = 4;
      oc.dep = last_compute;
      before_step = push(ops, oc);
    }
    Op step{OpKind::OptimizerStep};
    step.dep = before_step;
    const int step_index = push(ops, step);

    // ZeRO-1/2: each replica updated its shard; gather the new parameters (ZeRO-3 and FSDP
    // gather them before the next step's forward instead).
    if (plan_.gathers_after_step())
      for (int j = 0; j < v; ++j) {
        const int vs = j * p + s;
        Op ag{OpKind::AllGather, static_cast<std::int16_t>(vs)};
        ag.channel = param_gather_base_ + vs;
        ag.bytes = chunk_weight_bytes_[vs];
        ag.dep = step_index;
        push(ops, ag);
      }
  }

  // Bucket `bucket` of virtual stage vs, of reduction `reduction` (the micro-batch when
  // gradients are reduced per micro-batch, else 0).
  Op gradient_collective(int vs, int reduction, int bucket, int dep) const {
    Op op{zero() >= 1 ? OpKind::ReduceScatter : OpKind::AllReduce, static_cast<std::int16_t>(vs)};
    op.bucket = bucket;
    op.microbatch = per_microbatch_ ? reduction : -1;
    op.channel = bucket_base_[vs] + reduction * static_cast<int>(bucket_bytes_[vs].size()) + bucket;
    op.bytes = bucket_bytes_[vs][bucket];
    op.dep = dep;
    return op;
  }

  const Plan& plan_;
  ModelShape shape_;
  Schedule& sched_;
  int num_collectives_ = 0;
  int V_ = 1, m_ = 1;
  Bytes act_bytes_ = 0;
  std::vector<Bytes> chunk_grad_bytes_, chunk_weight_bytes_;
  std::vector<std::vector<Bytes>> bucket_bytes_;
  std::vector<int> bucket_base_;
  int param_gather_base_ = -1, overflow_id_ = -1, zero3_base_ = -1, embedding_base_ = -1, first_forward_base_ = -1;
  bool per_microbatch_ = false;  // gradients reduced after every micro-batch
  int gather_parts_ = 1;         // collectives per gather: 2 under ZeRO-3 (first unit, the rest)
  int gather_dirs_ = 0;          // per-micro-batch parameter gathers: 1 (forward) or 2 (and backward)
  // build_rank's scratch, reused rank after rank.
  std::vector<Task> tasks_;
  std::vector<int> last_grad_task_, compute_ops_, chunks_done_;
};

}  // namespace

Schedule build_schedule(const Plan& plan) {
  Schedule s;
  Builder(plan, s).build(false);
  return s;
}

void build_schedule_into(const Plan& plan, Schedule& out) { Builder(plan, out).build(true); }

void build_replica0_into(const Plan& plan, Schedule& out) { Builder(plan, out).build(true, true); }

std::string check_schedule(const Schedule& s) {
  std::vector<int> sends(s.num_messages, 0), recvs(s.num_messages, 0);
  std::vector<std::vector<int>> arrivals(s.collectives.size());
  for (const auto& prog : s.ranks) {
    for (std::size_t i = 0; i < prog.ops.size(); ++i) {
      const Op& op = prog.ops[i];
      if (op.dep >= static_cast<int>(i))
        return fmt::format("rank {} op {} ({}) depends on a later op {}", prog.rank, i, op_label(op), op.dep);
      if (is_send(op.kind) || is_recv(op.kind)) {
        if (op.channel < 0 || op.channel >= s.num_messages)
          return fmt::format("rank {} op {} ({}) has no message id", prog.rank, i, op_label(op));
        (is_send(op.kind) ? sends : recvs)[op.channel]++;
        const auto& peer = s.ranks.at(op.peer);
        const bool found = std::any_of(peer.ops.begin(), peer.ops.end(), [&](const Op& o) {
          return o.channel == op.channel && (is_send(o.kind) || is_recv(o.kind)) && o.peer == prog.rank &&
                 is_send(o.kind) != is_send(op.kind);
        });
        if (!found) return fmt::format("rank {} op {} ({}) has no partner on rank {}", prog.rank, i, op_label(op), op.peer);
      } else if (is_collective(op.kind) && op.channel >= 0) {
        if (op.channel >= static_cast<int>(s.collectives.size()))
          return fmt::format("rank {} op {} ({}) names collective {} that does not exist", prog.rank, i, op_label(op),
                             op.channel);
        if (s.collectives[op.channel].kind != op.kind)
          return fmt::format("rank {} op {} is a {} but collective {} is a {}", prog.rank, i, op_kind_name(op.kind),
                             op.channel, op_kind_name(s.collectives[op.channel].kind));
        arrivals[op.channel].push_back(prog.rank);
      }
    }
  }
  for (int c = 0; c < s.num_messages; ++c)
    if (sends[c] != 1 || recvs[c] != 1)
      return fmt::format("message {} has {} sends and {} receives", c, sends[c], recvs[c]);
  for (std::size_t c = 0; c < s.collectives.size(); ++c) {
    auto a = arrivals[c];
    std::sort(a.begin(), a.end());
    if (a != s.collectives[c].members)
      return fmt::format("collective {} ({}) is reached by {} ranks but has {} members", c,
                         op_kind_name(s.collectives[c].kind), a.size(), s.collectives[c].members.size());
  }
  return "";
}

}  // namespace trainsim
