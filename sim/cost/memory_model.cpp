#include "sim/cost/memory_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "core/units.h"

namespace trainsim {

ModelStateBytes model_state_bytes(const Plan& plan, double params) {
  const auto& pr = plan.config.precision;
  const int zero = plan.zero();
  const double n = plan.data_shards();
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

// shape_ holds one GPU's tokens of each sequence (Plan::token_shape): every activation below is
// token by token under context parallelism, an unfused core's scores s/cp x s (ModelShape::keys).
MemoryModel::MemoryModel(const Plan& plan) : plan_(plan), shape_(plan.token_shape()) {
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
  tables_.unsharded.reserve(V);
  tables_.first_bucket.reserve(V);
  tables_.last_bucket.reserve(V);
  for (int vs = 0; vs < V; ++vs) {
    // Under full recompute of a chunk's first layers alone (recompute_num_layers) the others keep
    // every activation.
    const int layers = plan.layers_per_virtual_stage[vs];
    const int rebuilt = recomputed_layers(cfg.training, layers);
    double a = rebuilt * per_layer + (layers - rebuilt) * full_layer;
    // The last stage keeps the FP32 logits for the loss, and the final norm's input (its backward)
    // and output (the LM head's input, for its weight gradient). Under sequence parallelism the
    // norm's input is the shard's rows, and so is its output where the head gathers it again for
    // the weight gradient (Megatron-LM's output layer, as its layers' products: 7 GiB of Llama 3
    // 405B's last stage); PyTorch's column-parallel head saves the gathered rows (ModelShape).
    if (vs == V - 1) {
      const double rows_e = e * static_cast<double>(b) * m.s * m.h;
      a += 4.0 * b * m.s * static_cast<double>(m.V) / t + rows_e / (sp ? t : 1) +
           rows_e / (sp && !m.separate_projections ? t : 1);
    }
    tables_.act.push_back(a);
    // During a backward, recompute rebuilds one layer at a time: full, the layer's activations;
    // selective and selective_op, what they do not keep (selective: the attention core's s x s
    // tensors, none with flash).
    const bool has_layers = layers > 0;
    double transient = rebuilt == 0 ? 0.0 : rc == Recompute::full ? full_layer : full_layer - per_layer;
    // PyTorch's cross-entropy on the FP32 logits (the FSDP frameworks' loss: torchtitan,
    // `F.cross_entropy(pred.float(), labels)`) keeps its log-softmax (the 4 bytes above); its
    // backward holds that, the gradient flowing into it and the one it produces, FP32 each, at
    // once: 8 bytes per logit beyond the kept 4 (Megatron-LM's vocabulary-parallel cross-entropy
    // works in place in the one FP32 buffer). The layers' rebuilds come after it.
    if (vs == V - 1 && plan.framework == Framework::fsdp && !plan.runtime_decoder)
      transient = std::max(transient, 8.0 * b * m.s * static_cast<double>(m.V) / t);
    // Context parallelism: a layer's attention backward holds every GPU's keys and values,
    // gathered, and their gradients before the reduce-scatter (the forward's gather is freed
    // once the kernel has run; the backward gathers again).
    if (has_layers && plan.cp > 1) {
      transient += 2.0 * plan.cp_gathered_kv_elements() * e;
    }
    tables_.transient.push_back(transient);
    // ZeRO-2/3 keep gradients sharded: unsharded, while a backward produces them, only the
    // bucket it fills and the one before it, being reduce-scattered (DeepSpeed's reduce buckets,
    // FSDP's unit), in the reduction's format. The chunk's gradients g are cut into buckets of B
    // in completion order, the last one the remainder: inside one op two consecutive buckets hold
    // min(g, 2B) (g itself when one bucket holds them all); activation_peak adds the case of two
    // ops back to back (the first bucket of one while the last of the other is reduced).
    // FSDP's units (Plan::reduces_by_unit) differ in size: two consecutive ones at the most.
    const double grads = plan.virtual_stage_params(vs, m) / t * dtype_bytes(cfg.precision.allreduce);
    const double bucket = std::max(1.0, mib_to_bytes(cfg.communication.bucket_size_mib));
    const bool sharded = plan.shards_gradients() && grads > 0;
    if (sharded && plan.reduces_by_unit()) {
      const std::vector<Bytes> units = plan.gradient_buckets(vs);
      double pair = units.empty() ? 0.0 : static_cast<double>(units.front());
      for (std::size_t i = 1; i < units.size(); ++i)
        pair = std::max(pair, static_cast<double>(units[i - 1] + units[i]));
      tables_.unsharded.push_back(pair);
      tables_.first_bucket.push_back(units.empty() ? 0.0 : static_cast<double>(units.front()));
      tables_.last_bucket.push_back(units.empty() ? 0.0 : static_cast<double>(units.back()));
    } else {
      tables_.unsharded.push_back(sharded ? std::min(grads, 2.0 * bucket) : 0.0);
      tables_.first_bucket.push_back(sharded ? std::min(grads, bucket) : 0.0);
      tables_.last_bucket.push_back(sharded ? grads - bucket * std::ceil(grads / bucket - 1.0) : 0.0);
    }
    // Per layer: the gradients at the outputs of QKV, the attention projection, the MLP's
    // first and second products and both norms (dW = dY^T X needs dY); per stage the
    // gradient at its input, and on the last the logits' and the final norm's. Under tensor
    // parallelism QKV's and the MLP's first product's are split t ways; the others are the
    // residual stream's width, whole on every shard unless sequence parallel.
    const double qkv = m.h + 2.0 * m.h / m.a * m.kv_heads, mlp_in = (m.swiglu ? 2.0 : 1.0) * m.f;
    const double rows = e * static_cast<double>(b) * m.s, stream_split = sp ? t : 1;
    double w = plan.layers_per_virtual_stage[vs] * rows * ((qkv + mlp_in) / t + (m.h + m.h + 2.0 * m.h) / stream_split);
    w += rows * m.h / stream_split;
    if (vs == V - 1) w += rows * (static_cast<double>(m.V) / t + m.h / stream_split);
    // Full recompute keeps only the layer's input: the input pass, which rebuilt the layer, keeps
    // for the weight pass the products' inputs (QKV's and the MLP's first product's, the stream's
    // rows; the projection's and the MLP's second product's, split t ways) and the second norm's input.
    if (rc == Recompute::full) w += rebuilt * rows * (3.0 * m.h / stream_split + (m.h + m.f) / t);
    // selective_op keeps the projection's input (the attention core's output); the rebuilt first
    // norm's output, the residual and the second norm's output, and the MLP's activation stay.
    if (rc == Recompute::selective_op)
      w += plan.layers_per_virtual_stage[vs] * rows * (3.0 * m.h / stream_split + static_cast<double>(m.f) / t);
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
  return same(a.act, b.act) && same(a.transient, b.transient) && same(a.weight_pass, b.weight_pass) &&
         same(a.unsharded, b.unsharded) && same(a.first_bucket, b.first_bucket) && same(a.last_bucket, b.last_bucket);
}

double activation_peak(const ActivationTables& t, const RankProgram& prog) {
  const double* act = t.act.data();
  const double* transient = t.transient.data();
  const double* weight_pass = t.weight_pass.data();
  const double* unsharded = t.unsharded.data();
  // The unsharded buckets of a gradient op: its own two, or its first with the last bucket of a
  // gradient op just before it (no forward between them, so that one may still be reduced).
  int previous_grads = -1;  // chunk of the last compute op if it produced gradients, else -1
  auto buckets = [&](const Op& op) {
    const double own = unsharded[op.chunk];
    if (previous_grads < 0) return own;
    return std::max(own, t.last_bucket[previous_grads] + t.first_bucket[op.chunk]);
  };
  double live = 0, peak = 0;
  for (const Op& op : prog.ops) {
    switch (op.kind) {
      case OpKind::Forward:
        live += act[op.chunk] * op.work;
        peak = std::max(peak, live);
        previous_grads = -1;
        break;
      case OpKind::Backward:
        peak = std::max(peak, live + transient[op.chunk] + buckets(op));
        live -= act[op.chunk] * op.work;
        previous_grads = op.chunk;
        break;
      case OpKind::BackwardInput:
        peak = std::max(peak, live + transient[op.chunk]);
        live += weight_pass[op.chunk] * op.work;
        peak = std::max(peak, live);
        break;
      case OpKind::BackwardWeight:
        peak = std::max(peak, live + buckets(op));
        live -= (act[op.chunk] + weight_pass[op.chunk]) * op.work;
        previous_grads = op.chunk;
        break;
      default: break;
    }
  }
  return peak;
}

MemoryBreakdown MemoryModel::breakdown(const RankProgram& prog, double activation_peak) const {
  const auto& cfg = plan_.config;
  const double params = plan_.shard_stage_params(prog.stage);
  const ModelStateBytes states = model_state_bytes(plan_, params);

  // Communication buffers: activation send/receive, gradient buckets cast to another
  // format for the all-reduce (double-buffered), ZeRO-3's gathered layer and the next.
  double buffers = 0;
  if (plan_.num_virtual_stages() > 1)
    buffers += 2.0 * plan_.micro_batch_size * shape_.s * shape_.h * plan_.activation_bytes() / plan_.tp;
  if (plan_.data_shards() > 1 && cfg.precision.allreduce != cfg.precision.grad_accumulation) {
    double largest = mib_to_bytes(cfg.communication.bucket_size_mib);
    if (plan_.reduces_by_unit()) {  // a unit at a time
      largest = 0;
      for (int j = 0; j < plan_.vpp; ++j)
        for (const Bytes u : plan_.gradient_buckets(j * plan_.pp + prog.stage))
          largest = std::max(largest, static_cast<double>(u));
    }
    buffers += 2.0 * largest;
  }
  if (plan_.zero() == 3)
    buffers += 2.0 * shape_.params_per_layer() / plan_.tp * plan_.weight_bytes();
  // Transformer Engine's userbuffers (communication.tp_comm_overlap): one registered buffer of the
  // gathered activation's shape (micro-batch x sequence rows x hidden) per overlapped product of
  // a layer, twelve (TE's initialize_ub: qkv, proj, fc1 and fc2 forward, input and weight
  // gradients), the eight all-gathering ones in FP8 under FP8 (fp8_buf), the rest 16-bit.
  if (cfg.communication.tp_comm_overlap && plan_.tp > 1 && cfg.parallelism.sequence_parallel) {
    const double elements = static_cast<double>(plan_.micro_batch_size) * plan_.local_seq_length() * shape_.h;
    const double gathered = cfg.precision.compute == DType::fp8 ? 1.0 : plan_.activation_bytes();
    buffers += elements * (8 * gathered + 4.0 * plan_.activation_bytes());
  }

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
