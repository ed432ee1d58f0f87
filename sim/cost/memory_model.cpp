#include "sim/cost/memory_model.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/units.h"

namespace trainsim {

ModelStateBytes model_state_bytes(const Plan& plan, double params) {
  const auto& pr = plan.config.precision;
  const int zero = plan.zero();
  const double n = plan.dp;
  const double w = plan.weight_bytes();
  const double g = dtype_bytes(pr.grad_accumulation);
  const double master = pr.master_weights != pr.compute && !(pr.compute == DType::tf32 && pr.master_weights == DType::fp32)
                            ? dtype_bytes(pr.master_weights)
                            : 0.0;
  const double moments = plan.config.training.optimizer == Optimizer::sgd ? 4.0 : 8.0;
  ModelStateBytes b;
  b.weights = params * w / (zero >= 3 ? n : 1.0);
  b.gradients = params * g / (plan.shards_gradients() ? n : 1.0);
  b.optimizer = params * (master + moments) / (zero >= 1 ? n : 1.0);
  return b;
}

MemoryModel::MemoryModel(const Plan& plan) : plan_(plan), shape_(plan.shape()) {
  const ModelShape& m = shape_;
  const auto& cfg = plan.config;
  const int b = plan.micro_batch_size, t = plan.tp, e = plan.activation_bytes();
  const bool sp = cfg.parallelism.sequence_parallel;
  const Recompute rc = cfg.training.activation_recompute;
  const double per_layer = m.layer_stored_activation_bytes(b, e, t, sp, rc);
  const double full_layer = m.layer_stored_activation_bytes(b, e, t, sp, Recompute::none);
  const int V = plan.num_virtual_stages();
  tables_.act.reserve(V);
  tables_.transient.reserve(V);
  tables_.weight_pass.reserve(V);
  for (int vs = 0; vs < V; ++vs) {
    double a = plan.layers_per_virtual_stage[vs] * per_layer;
    if (vs == V - 1) a += 4.0 * b * m.s * static_cast<double>(m.V) / t + e * static_cast<double>(b) * m.s * m.h;
    tables_.act.push_back(a);
    // Full recompute rebuilds one layer's activations at a time during backward.
    tables_.transient.push_back(rc == Recompute::full && plan.layers_per_virtual_stage[vs] > 0 ? full_layer : 0.0);
    // Per layer: the gradients at the outputs of QKV, the attention projection, the MLP's
    // first and second products and both norms (dW = dY^T X needs dY); per stage the
    // gradient at its input, and on the last the logits' and the final norm's.
    const double qkv = m.h + 2.0 * m.h / m.a * m.kv_heads, mlp_in = (m.swiglu ? 2.0 : 1.0) * m.f;
    double w = plan.layers_per_virtual_stage[vs] * e * static_cast<double>(b) * m.s * (qkv + m.h + mlp_in + m.h + 2.0 * m.h) / t;
    w += e * static_cast<double>(b) * m.s * m.h;
    if (vs == V - 1) w += e * static_cast<double>(b) * m.s * (static_cast<double>(m.V) / t + m.h);
    tables_.weight_pass.push_back(w);
  }
}

std::vector<MemoryBreakdown> MemoryModel::peak_per_rank(const Schedule& schedule) const {
  std::vector<MemoryBreakdown> out;
  out.reserve(schedule.ranks.size());
  for (const auto& prog : schedule.ranks) out.push_back(peak_of(prog));
  return out;
}

bool same_bits(const ActivationTables& a, const ActivationTables& b) {
  auto same = [](const std::vector<double>& x, const std::vector<double>& y) {
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0);
  };
  return same(a.act, b.act) && same(a.transient, b.transient) && same(a.weight_pass, b.weight_pass);
}

double activation_peak(const ActivationTables& t, const RankProgram& prog) {
  const double* act = t.act.data();
  const double* transient = t.transient.data();
  const double* weight_pass = t.weight_pass.data();
  double live = 0, peak = 0;
  for (const Op& op : prog.ops) {
    switch (op.kind) {
      case OpKind::Forward:
        live += act[op.chunk] * op.work;
        peak = std::max(peak, live);
        break;
      case OpKind::Backward:
        peak = std::max(peak, live + transient[op.chunk]);
        live -= act[op.chunk] * op.work;
        break;
      case OpKind::BackwardInput:
        peak = std::max(peak, live + transient[op.chunk]);
        live += weight_pass[op.chunk] * op.work;
        peak = std::max(peak, live);
        break;
      case OpKind::BackwardWeight: live -= (act[op.chunk] + weight_pass[op.chunk]) * op.work; break;
      default: break;
    }
  }
  return peak;
}

MemoryBreakdown MemoryModel::breakdown(const RankProgram& prog, double activation_peak) const {
  const auto& cfg = plan_.config;
  const double params = plan_.stage_params(prog.stage) / plan_.tp;
  const ModelStateBytes states = model_state_bytes(plan_, params);

  // Communication buffers: activation send/receive, gradient buckets cast to another
  // format for the all-reduce (double-buffered), ZeRO-3's gathered layer and the next.
  double buffers = 0;
  if (plan_.num_virtual_stages() > 1)
    buffers += 2.0 * plan_.micro_batch_size * shape_.s * shape_.h * plan_.activation_bytes() / plan_.tp;
  if (plan_.dp > 1 && cfg.precision.allreduce != cfg.precision.grad_accumulation)
    buffers += 2.0 * mib_to_bytes(cfg.communication.bucket_size_mib);
  if (plan_.zero() == 3)
    buffers += 2.0 * shape_.params_per_layer() / plan_.tp * plan_.weight_bytes();

  MemoryBreakdown b;
  b.weights = states.weights;
  b.gradients = states.gradients;
  b.optimizer = states.optimizer;
  b.activations = activation_peak;
  b.buffers = buffers;
  return b;
}

std::vector<int> max_in_flight_microbatches(const Schedule& schedule) {
  std::vector<int> out;
  for (const auto& prog : schedule.ranks) {
    const bool split = std::any_of(prog.ops.begin(), prog.ops.end(),
                                   [](const Op& o) { return o.kind == OpKind::BackwardWeight; });
    const OpKind frees = split ? OpKind::BackwardWeight : OpKind::Backward;
    std::set<std::pair<int, int>> live;  // (chunk, micro-batch); a backward split into bucket segments frees once
    std::size_t peak = 0;
    for (const Op& op : prog.ops) {
      if (op.kind == OpKind::Forward) peak = std::max(peak, (live.insert({op.chunk, op.microbatch}), live.size()));
      if (op.kind == frees) live.erase({op.chunk, op.microbatch});
    }
    out.push_back(static_cast<int>(peak));
  }
  return out;
}

}  // namespace trainsim
