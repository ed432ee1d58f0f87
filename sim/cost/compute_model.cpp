#include "sim/cost/compute_model.h"

#include <algorithm>

#include "sim/cost/collective_model.h"
#include "core/kernel_inventory.h"

namespace trainsim {

namespace {

// Seconds of a list of kernels at the profile's measured rates; a kernel it did not measure
// at the roofline (FLOPs at peak times efficiency, bytes at memory bandwidth).
double kernels_seconds(const std::vector<KernelWork>& ws, const HardwareProfile& profile, double flops_per_s,
                       double bytes_per_s) {
  double total = 0;
  for (const KernelWork& w : ws) {
    double t = profile.kernel_seconds(w.kernel, w.dtype, w.shape, w.bytes);
    if (t < 0) t = w.shape.is_matmul() ? w.shape.flops() / flops_per_s : w.bytes / bytes_per_s;
    total += w.count * t;
  }
  return total;
}

// Tensor parallelism's collectives inside one virtual stage's ops, as the runtime runs them
// (runtime/model/stage_model.cpp), priced from the profile's all-reduce measurements over the tp
// shards of a group, a reduce-scatter or all-gather at half an all-reduce (as the collective
// model prices them); on the compute stream, not overlapped. Per layer: the two row-parallel
// outputs summed (all-reduce; reduce-scatter under SP) in the forward and the two column-parallel
// inputs' gradients in the backward, and under SP the two inputs gathered before their products
// in both; the weight pass under SP gathers the two norms' outputs again (and, split from the
// input pass, the two output gradients) and sums the norms' partial gradients (fp32). The
// embedding sums its shards' rows; the head gathers its input (SP), reduces the cross-entropy's
// row maxima and sums (fp32) and sums its input's gradient.
RooflineComputeModel::ChunkSeconds tensor_parallel_seconds(const Plan& plan, int vs, const HardwareProfile& profile,
                                                           int storage) {
  RooflineComputeModel::ChunkSeconds c;
  const int t = plan.tp;
  if (t <= 1) return c;
  const ModelShape m = plan.shape();
  const bool sp = plan.config.parallelism.sequence_parallel;
  const bool split = plan.config.parallelism.schedule == ScheduleKind::zb_h1;
  const double rows = static_cast<double>(plan.micro_batch_size) * m.s;
  auto all_reduce = [&](double bytes) { return profile.allreduce_seconds(t, bytes); };
  const double activation = all_reduce(rows * m.h * storage);
  const double reduce = sp ? activation / 2 : activation;
  const double gather = sp ? activation / 2 : 0.0;
  const int layers = plan.layers_per_virtual_stage[vs];
  c.forward = layers * 2 * (reduce + gather);
  c.backward_input = layers * 2 * (reduce + gather);
  if (sp) c.backward_weight = layers * ((split ? 4 : 2) * gather + all_reduce(4.0 * m.h * 4));
  if (vs == 0) {
    c.forward += reduce;
    c.backward_weight += gather;
  }
  if (vs == plan.num_virtual_stages() - 1) {
    c.forward += gather + all_reduce(rows * 4) + all_reduce(2 * rows * 4);
    c.backward_input += reduce;
    if (sp) c.backward_weight += all_reduce(2.0 * m.h * 4);
  }
  return c;
}

}  // namespace

void RooflineComputeModel::price_from_profile(const Plan& plan, const HardwareProfile& profile) {
  const ScenarioConfig& cfg = plan.config;
  const double rate = plan.peak_flops(cfg.precision.compute) * cfg.cluster.compute_efficiency;
  const double hbm = gbps_to_bytes_per_second(cfg.cluster.hbm_bandwidth_gbps);
  const int storage = profile.emulated_low_precision ? 4 : plan.activation_bytes();
  const std::vector<ChunkKernels> kernels = chunk_kernels(plan, storage);
  for (int vs = 0; vs < static_cast<int>(kernels.size()); ++vs) {
    const ChunkKernels& k = kernels[static_cast<std::size_t>(vs)];
    // Core factors timed with the shards' real collectives already hold them.
    const bool in_factors = profile.core_factors_include_tensor_parallel && !profile.core_factors.empty();
    const ChunkSeconds tp = in_factors ? ChunkSeconds{} : tensor_parallel_seconds(plan, vs, profile, storage);
    ChunkSeconds c;
    const Composition& in_layer = profile.composition;
    c.forward = in_layer.forward * kernels_seconds(k.forward, profile, rate, hbm) + tp.forward;
    c.backward_input = in_layer.backward * kernels_seconds(k.backward_input, profile, rate, hbm) + tp.backward_input;
    c.backward_weight = in_layer.backward * kernels_seconds(k.backward_weight, profile, rate, hbm) + tp.backward_weight;
    chunks_.push_back(c);
  }
  const int shards = cfg.parallelism.zero_stage >= 1 ? plan.dp : 1;
  for (int r = 0; r < plan.num_ranks(); ++r) {
    const int s = plan.stage_of(r);
    double params = 0;
    for (int j = 0; j < plan.vpp; ++j) params += plan.shard_params(j * plan.pp + s);
    optimizer_ticks_.push_back(seconds_to_ticks(profile.core_factor(plan.first_gpu_of(r)) * kernels_seconds(
        optimizer_kernels(plan, params / shards), profile, rate, hbm)));
  }
  // A rank of the schedule runs on its tensor-parallel shards' cores (GPUs first_gpu_of(r) ..
  // + tp - 1), which wait for each other at every layer: the slowest one's factor.
  if (!profile.core_factors.empty())
    for (int r = 0; r < plan.num_ranks(); ++r) {
      double slowest = 0;
      for (int g = plan.first_gpu_of(r); g < plan.first_gpu_of(r) + plan.tp; ++g)
        slowest = std::max(slowest, profile.core_factor(g));
      rank_factors_.push_back(slowest);
    }
}

RooflineComputeModel::RooflineComputeModel(const Plan& plan) {
  const ScenarioConfig& cfg = plan.config;
  if (cfg.cluster.calibrated) {
    price_from_profile(plan, *cfg.cluster.calibrated);
    for (const auto& c : chunks_)
      chunk_ticks_.push_back({seconds_to_ticks(c.forward), seconds_to_ticks(c.backward()),
                              seconds_to_ticks(c.backward_input), seconds_to_ticks(c.backward_weight)});
    return;
  }
  const ModelShape m = plan.shape();
  const int b = plan.micro_batch_size, t = plan.tp, e = plan.activation_bytes();
  const bool sp = cfg.parallelism.sequence_parallel;
  const Recompute rc = cfg.training.activation_recompute;
  const double rate = plan.peak_flops(cfg.precision.compute) * cfg.cluster.compute_efficiency;
  const double hbm = gbps_to_bytes_per_second(cfg.cluster.hbm_bandwidth_gbps);
  const LinkConfig& link = cfg.cluster.intra_node;

  // One layer, one micro-batch, this rank's 1/t share.
  const double weight_flops = m.layer_weight_matmul_flops(b) / t;
  const double core_flops = m.layer_attention_core_flops(b) / t;
  const double elementwise = m.layer_activation_bytes(b, e, t, sp, Recompute::none);
  const double tp_allreduce =
      ring_allreduce_seconds(t, static_cast<double>(b) * m.s * m.h * e, us_to_seconds(link.latency_us),
                             gbps_to_bytes_per_second(link.bandwidth_gbps));
  const double layer_fwd = (weight_flops + core_flops) / rate + elementwise / hbm + 2 * tp_allreduce;
  double layer_bi = (weight_flops + 2 * core_flops) / rate + 2 * elementwise / hbm + 2 * tp_allreduce;
  if (rc == Recompute::full) layer_bi += layer_fwd;
  if (rc == Recompute::selective) layer_bi += core_flops / rate;
  const double layer_bw = weight_flops / rate;

  const double embed = 2.0 * b * m.s * m.h * e / hbm + (t > 1 ? tp_allreduce : 0.0);
  const double head_flops = m.lm_head_forward_flops(b) / t;
  const double loss_bytes = 2.0 * 4.0 * b * m.s * static_cast<double>(m.V) / t;  // fp32 logits written and read

  const int V = plan.num_virtual_stages();
  for (int vs = 0; vs < V; ++vs) {
    const int layers = plan.layers_per_virtual_stage[vs];
    ChunkSeconds c;
    c.forward = layers * layer_fwd;
    c.backward_input = layers * layer_bi;
    c.backward_weight = layers * layer_bw;
    if (vs == 0) {
      c.forward += embed;
      c.backward_weight += embed;  // the embedding's gradient is a weight gradient (scatter-add)
    }
    if (vs == V - 1) {
      c.forward += head_flops / rate + loss_bytes / hbm;
      c.backward_input += head_flops / rate + loss_bytes / hbm;
      c.backward_weight += head_flops / rate;
    }
    chunks_.push_back(c);
  }

  // Adam touches per parameter: gradient read and zeroed (2g), FP32 master read and
  // written (8, or 2w without a master copy), both moments read and written (16; SGD's
  // one momentum 8), and the working copy written (w).
  const int g = dtype_bytes(cfg.precision.grad_accumulation), w = plan.weight_bytes();
  const bool master = cfg.precision.master_weights != cfg.precision.compute;
  const double moments = cfg.training.optimizer == Optimizer::sgd ? 8.0 : 16.0;
  const double bytes_per_param = 2.0 * g + (master ? 8.0 : 2.0 * w) + moments + (master ? w : 0);
  const int shards = cfg.parallelism.zero_stage >= 1 ? plan.dp : 1;
  for (int r = 0; r < plan.num_ranks(); ++r) {
    const int s = plan.stage_of(r);
    double params = 0;
    for (int j = 0; j < plan.vpp; ++j) params += plan.shard_params(j * plan.pp + s);
    optimizer_ticks_.push_back(seconds_to_ticks(params / shards * bytes_per_param / hbm));
  }
  for (const auto& c : chunks_)
    chunk_ticks_.push_back({seconds_to_ticks(c.forward), seconds_to_ticks(c.backward()),
                            seconds_to_ticks(c.backward_input), seconds_to_ticks(c.backward_weight)});
}

}  // namespace trainsim
