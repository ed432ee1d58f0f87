#include "sim/cost/compute_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "core/kernel_inventory.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/gemm_model.h"
#include "sim/cost/p2p_model.h"

namespace trainsim {

namespace {

// One launch of `w` at the profile's measured rate, or at the roofline where it has none (FLOPs at
// peak times efficiency, bytes at memory bandwidth); `measured` says which.
double launch_seconds(const KernelWork& w, const HardwareProfile& profile, double flops_per_s, double bytes_per_s,
                      bool* measured = nullptr) {
  const double t = profile.kernel_seconds(w.kernel, w.dtype, w.shape, w.bytes);
  if (measured) *measured = t >= 0;
  if (t >= 0) return t;
  return w.shape.is_matmul() ? w.shape.flops() / flops_per_s : w.bytes / bytes_per_s;
}

// Seconds of a list of kernels, each at launch_seconds.
double kernels_seconds(const std::vector<KernelWork>& ws, const HardwareProfile& profile, double flops_per_s,
                       double bytes_per_s) {
  double total = 0;
  for (const KernelWork& w : ws) total += w.count * launch_seconds(w, profile, flops_per_s, bytes_per_s);
  return total;
}

// Tensor parallelism's collectives inside one virtual stage's ops, as the runtime runs them
// (runtime/model/stage_model.cpp), priced from the profile's measurements over the tp shards of
// a group: each collective's own table, a reduce-scatter or all-gather at half an all-reduce
// where it has none (as the collective model prices them); on the compute stream, not
// overlapped. Per layer: the two row-parallel
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
  const bool sp = plan.config.parallelism.sequence_parallel;
  const bool split = plan.config.parallelism.schedule == ScheduleKind::zb_h1;
  const TensorParallelBuffers buffers = tensor_parallel_buffers(plan, storage);
  auto all_reduce = [&](double bytes) { return profile.allreduce_seconds(t, bytes); };
  const double reduce = sp ? profile.reduce_scatter_seconds(t, buffers.activation) : all_reduce(buffers.activation);
  const double gather = sp ? profile.allgather_seconds(t, buffers.activation) : 0.0;
  const int layers = plan.layers_per_virtual_stage[vs];
  c.forward = layers * 2 * (reduce + gather);
  c.backward_input = layers * 2 * (reduce + gather);
  // A rebuild runs its products' collectives again: full recompute the whole layer's, selective_op
  // the attention projection's sum (its qkv and fc products, whose inputs are gathered, are kept).
  const Recompute rc = plan.config.training.activation_recompute;
  if (rc == Recompute::full) c.backward_input += recomputed_layers(plan.config.training, layers) * 2 * (reduce + gather);
  if (rc == Recompute::selective_op) c.backward_input += layers * reduce;
  if (sp) c.backward_weight = layers * ((split ? 4 : 2) * gather + all_reduce(buffers.norm_gradients));
  if (vs == 0) {
    c.forward += reduce;
    c.backward_weight += gather;
  }
  if (vs == plan.num_virtual_stages() - 1) {
    c.forward += gather + all_reduce(buffers.head_row_maxima) + all_reduce(buffers.head_row_sums);
    c.backward_input += reduce;
    if (sp) c.backward_weight += all_reduce(buffers.final_norm_gradients);
  }
  return c;
}

// Context parallelism's collectives in the runtime's stage model, from the profile's tables: before
// each layer's attention forward and backward (and the rebuild any recompute runs of it) an
// all-gather of every rank's keys and values, after the backward a reduce-scatter of their
// gradients (runtime/model/stage_model.cpp), on the compute thread. Not in the core factors: the
// calibration times the stages' context-parallel collectives as nothing.
RooflineComputeModel::ChunkSeconds context_parallel_seconds(const Plan& plan, int vs, const HardwareProfile& profile,
                                                            int storage) {
  RooflineComputeModel::ChunkSeconds c;
  if (plan.cp <= 1) return c;
  const double bytes = plan.cp_gathered_kv_elements() * storage;
  const double gather = profile.allgather_seconds(plan.cp, bytes);
  const double scatter = profile.reduce_scatter_seconds(plan.cp, bytes);
  const int layers = plan.layers_per_virtual_stage[vs];
  c.forward = layers * gather;
  c.backward_input = layers * (gather + scatter);
  c.backward_input += recomputed_layers(plan.config.training, layers) * gather;  // each rebuild's attention gathers again
  return c;
}

// What a calibrated profile prices a plan's kernels with (price_from_profile and the listing,
// calibrated_kernel_prices): the roofline's rates for a kernel it did not measure, the bytes an
// activation element takes, each pass's in-layer composition, and tensor parallelism's
// collectives unless the core factors were timed with them.
struct ProfilePricing {
  double rate = 0, hbm = 0;
  int storage = 4;
  double forward = 1, first_forward = 0, backward_input = 1, backward_weight = 1;
  bool tp_in_factors = false;

  ProfilePricing(const Plan& plan, const HardwareProfile& profile) {
    const ScenarioConfig& cfg = plan.config;
    rate = plan.peak_flops(cfg.precision.compute) * cfg.cluster.compute_efficiency;
    hbm = gbps_to_bytes_per_second(cfg.cluster.hbm_bandwidth_gbps);
    storage = profile.emulated_low_precision ? 4 : plan.activation_bytes();
    const Composition& in_layer = profile.composition;
    forward = in_layer.forward;
    first_forward = in_layer.first_forward;
    backward_input = in_layer.backward;
    backward_weight = in_layer.backward_weight > 0 ? in_layer.backward_weight : in_layer.backward;
    // Core factors timed with the shards' real collectives already hold them.
    tp_in_factors = profile.core_factors_include_tensor_parallel && !profile.core_factors.empty();
  }
  RooflineComputeModel::ChunkSeconds tensor_parallel(const Plan& plan, int vs, const HardwareProfile& profile) const {
    return tp_in_factors ? RooflineComputeModel::ChunkSeconds{} : tensor_parallel_seconds(plan, vs, profile, storage);
  }
  RooflineComputeModel::ChunkSeconds context_parallel(const Plan& plan, int vs, const HardwareProfile& profile) const {
    return context_parallel_seconds(plan, vs, profile, storage);
  }
};

}  // namespace

TensorParallelBuffers tensor_parallel_buffers(const Plan& plan, int storage) {
  const ModelShape m = plan.shape();
  const double rows = static_cast<double>(plan.micro_batch_size) * m.s;
  return TensorParallelBuffers{.activation = rows * m.h * storage,
                               .head_row_maxima = rows * 4,
                               .head_row_sums = 2 * rows * 4,
                               .norm_gradients = 4.0 * m.h * 4,
                               .final_norm_gradients = 2.0 * m.h * 4};
}

void RooflineComputeModel::price_from_profile(const Plan& plan, const HardwareProfile& profile) {
  const ProfilePricing pricing(plan, profile);
  const double rate = pricing.rate, hbm = pricing.hbm;
  const std::vector<ChunkKernels> kernels = chunk_kernels(plan, pricing.storage);
  for (int vs = 0; vs < static_cast<int>(kernels.size()); ++vs) {
    const ChunkKernels& k = kernels[static_cast<std::size_t>(vs)];
    const ChunkSeconds tp = pricing.tensor_parallel(plan, vs, profile), cp = pricing.context_parallel(plan, vs, profile);
    ChunkSeconds c;
    const double forward_kernels = kernels_seconds(k.forward, profile, rate, hbm);
    c.forward = pricing.forward * forward_kernels + tp.forward + cp.forward;
    if (pricing.first_forward > 0) c.first_forward = pricing.first_forward * forward_kernels + tp.forward + cp.forward;
    c.backward_input = pricing.backward_input * kernels_seconds(k.backward_input, profile, rate, hbm) + tp.backward_input +
                       cp.backward_input;
    c.backward_weight = pricing.backward_weight * kernels_seconds(k.backward_weight, profile, rate, hbm) + tp.backward_weight;
    chunks_.push_back(c);
    collectives_.push_back({.forward = tp.forward + cp.forward,
                            .backward_input = tp.backward_input + cp.backward_input,
                            .backward_weight = tp.backward_weight + cp.backward_weight});
  }
  for (int r = 0; r < plan.num_ranks(); ++r) {
    const double alone =
        kernels_seconds(rank_update_kernels(plan, plan.stage_of(r), profile.emulated_low_precision), profile, rate, hbm);
    // Updates are memory-bound: where the calibration timed them side by side, their own factor.
    const double factor = profile.optimizer_core_factor(plan.first_gpu_of(r));
    const double alone_factor = profile.core_alone_factor(plan.first_gpu_of(r));
    optimizer_ticks_.push_back(seconds_to_ticks(factor * alone));
    optimizer_alone_ticks_.push_back(seconds_to_ticks(alone_factor * alone));
    if (!profile.core_factors.empty()) optimizer_factors_.push_back({factor, alone_factor});
  }
  // A rank of the schedule runs on its shards' cores (GPUs first_gpu_of(r) .. + tp x cp - 1),
  // which wait for each other at every layer: the slowest one's factor.
  if (!profile.core_factors.empty())
    for (int r = 0; r < plan.num_ranks(); ++r) {
      double slowest = 0, slowest_alone = 0;
      for (int g = plan.first_gpu_of(r); g < plan.first_gpu_of(r) + plan.gpus_per_rank(); ++g) {
        slowest = std::max(slowest, profile.core_factor(g));
        slowest_alone = std::max(slowest_alone, profile.core_alone_factor(g));
      }
      rank_factors_.push_back(slowest);
      if (!profile.core_alone_factors.empty()) rank_alone_factors_.push_back(slowest_alone);
    }
}

namespace {

// Integer instructions per element of a dropout kernel that draws its mask: Philox-4x32-10 is 10
// rounds of two 32x32->64-bit multiplies (lo and hi: four instructions), two three-input XORs and
// two key additions, about 80 instructions per four numbers (20 each); then the conversion to a
// uniform float, the compare, the scale and the mask byte (about 5).
constexpr double kDropoutInstructionsPerDraw = 25;

// What FrameworkPricer does with a kernel, from its name and shape (in the order it asks).
enum class KernelClass : std::uint8_t {
  tp_allreduce,
  tp_allgather,
  tp_reducescatter,
  cp_allgather,      // context parallelism's keys and values
  cp_reducescatter,  // and their gradients
  cp_ring_forward,   // Transformer Engine's ring: what its sends add beside an attention kernel
  cp_ring_backward,
  tp_overlap_ring,      // Transformer Engine's userbuffers: a collective by ring exchange beside its product
  tp_overlap_pipeline,  // a reduce-scatter pipelined with its product's chunks
  tp_overlap_bulk,      // a reduce-scatter beside a weight-gradient product
  tp_overlap_async,     // Megatron-LM's NCCL collective beside a backward product
  flash_attention,  // FlashAttention 2 (attention_efficiency)
  cudnn_attention,  // cuDNN's fused attention, the same work (cudnn_attention_efficiency)
  accumulate,  // a weight-gradient product accumulating into FP32
  matmul,
  memory,
  layernorm_forward,
  layernorm_backward,  // any other layernorm.* kernel
};

KernelClass classify(const KernelWork& w) {
  if (w.kernel == "tp.allreduce") return KernelClass::tp_allreduce;
  if (w.kernel == "tp.allgather") return KernelClass::tp_allgather;
  if (w.kernel == "tp.reducescatter") return KernelClass::tp_reducescatter;
  if (w.kernel == "cp.allgather") return KernelClass::cp_allgather;
  if (w.kernel == "cp.reducescatter") return KernelClass::cp_reducescatter;
  if (w.kernel == "cp.ring.forward") return KernelClass::cp_ring_forward;
  if (w.kernel == "cp.ring.backward") return KernelClass::cp_ring_backward;
  if (w.kernel == "tp.overlap.ring_allgather" || w.kernel == "tp.overlap.ring_reducescatter")
    return KernelClass::tp_overlap_ring;
  if (w.kernel == "tp.overlap.pipeline_reducescatter") return KernelClass::tp_overlap_pipeline;
  if (w.kernel == "tp.overlap.bulk_reducescatter") return KernelClass::tp_overlap_bulk;
  if (w.kernel.rfind("tp.overlap.async_", 0) == 0) return KernelClass::tp_overlap_async;
  if (w.kernel.rfind("flash_attention", 0) == 0) return KernelClass::flash_attention;
  if (w.kernel.rfind("cudnn_attention", 0) == 0) return KernelClass::cudnn_attention;
  if (w.kernel == "linear.backward_weight_accumulate") return KernelClass::accumulate;
  if (w.shape.is_matmul()) return KernelClass::matmul;
  if (w.kernel.rfind("layernorm.", 0) == 0)
    return w.kernel == "layernorm.forward" ? KernelClass::layernorm_forward : KernelClass::layernorm_backward;
  return KernelClass::memory;
}

// Seconds of the framework's kernels of one op on one tensor-parallel rank (the roofline path).
struct FrameworkPricer {
  const Plan& plan;
  const ClusterConfig& cl;
  double peak = 0, attention_peak = 0, elem = 2;
  bool apex_layernorm = false;
  bool fused_accumulation = false;  // weight-gradient products add into FP32 main_grad
  GroupShape tp_group, cp_group;
  P2pChannels cp_channels;  // a send's channels on the context-parallel communicator

  explicit FrameworkPricer(const Plan& p) : plan(p), cl(p.config.cluster) {
    const DType compute = p.config.precision.compute;
    // Products and attention run at the clock the SMs hold through training (power-limited).
    peak = p.peak_flops(compute) * cl.sustained_clock_fraction;
    // FP8 runs the linear layers in FP8; attention stays in 16 bits.
    attention_peak = compute == DType::fp8 ? p.peak_flops(DType::bf16) * cl.sustained_clock_fraction : peak;
    elem = compute == DType::fp8 ? 1.0 : dtype_bytes(compute);
    apex_layernorm = p.config.model.layernorm_kernel == LayerNormKernel::apex &&
                     p.config.model.normalization == Normalization::layernorm && p.config.model.fused_elementwise;
    fused_accumulation = p.config.training.gradient_accumulation_fusion && p.framework == Framework::megatron;
    const int t = p.tp, per_node = std::max(1, p.config.cluster.gpus_per_node);
    tp_group = GroupShape{t, std::max(1, (t + per_node - 1) / per_node), std::min(t, per_node)};
    const int cp_per_node = p.cp_members_per_node();
    cp_group = GroupShape{p.cp, (p.cp + cp_per_node - 1) / cp_per_node, cp_per_node};
    cp_channels = nccl_p2p_channel_range(p.cp, cp_group.nodes > 1, cl);
  }

  // A causal decoder's attention kernel: it skips the tiles above the diagonal (128-row tiles)
  // and computes those on it whole: half the m x n scores and 64 more per key, n the keys (every
  // query's under context parallelism, whose m = n / cp queries are load-balanced chunks, each
  // with its own diagonal).
  double attention_seconds(const KernelShape& s, bool cudnn) const {
    const double causal = std::min(1.0, 0.5 + 64.0 / static_cast<double>(s.n));
    const double efficiency = cudnn ? cl.cudnn_attention_efficiency : cl.attention_efficiency;
    return s.flops() * causal / (attention_peak * efficiency);
  }

  // Transformer Engine's userbuffers defaults (transformer_engine/pytorch/module/base.py,
  // initialize_ub, get_default_config): a pipelined reduce-scatter cuts its product into 4 and
  // runs each chunk's collective on 16 SMs, as does a bulk one beside its product; both set the
  // products' SM margin (they run on the other SMs). A ring exchange sends with the copy engines.
  static constexpr int kUbPipelineSplits = 4;
  static constexpr int kUbCommSms = 16;

  // A product of shape `s` in format `d` on `sms` of the GPU's SMs (its peak scaled with them);
  // `accumulate`: a weight-gradient product adding into FP32 main_grad.
  double product_seconds(const KernelShape& s, DType d, bool accumulate, int sms) const {
    if (s.flops() <= 0) return 0;
    const double share = static_cast<double>(sms) / cl.sm_count;
    const double efficiency = gemm_efficiency_with(gemm_tile_use(s, sms), static_cast<double>(s.k), cl);
    return gemm_seconds_with(s.flops(), efficiency, gemm_io_bytes(s, elem_of(d), accumulate ? 8.0 : -1),
                             peak_of(d) * share, cl);
  }
  // Userbuffers are not NCCL: a GPU reads (or writes) its share from every peer of the node at
  // once through the NVSwitch, its buffers registered ahead, so a collective costs one hop's
  // latency and (t - 1)/t of its bytes at the NVLink bus bandwidth, with no ring to fill, and a
  // ring-exchange step one hop and the rows it passes on.
  double userbuffers_seconds(double bytes) const {
    const double b_nvl = gbps_to_bytes_per_second(cl.intra_node.bandwidth_gbps) * cl.intra_node.efficiency;
    return us_to_seconds(cl.intra_node.latency_us) + bytes / b_nvl;
  }
  // What an overlapped tensor-parallel collective adds to its product (w: the product's shape and
  // format, the collective's bytes), the pair's time less the product's alone, never below zero
  // (a chunked product's tiles can fit the SMs better than the whole's; the pair is not faster
  // than its product for it).
  //  ring exchange (t steps): each step multiplies 1/t of the rows while the copy engines pass
  //    a chunk on to the next GPU over NVLink (an all-gather's input rows, a reduce-scatter's
  //    partial sums): g + (t - 1) max(g, send);
  //  pipelined (S chunks on the SMs the collective leaves): each chunk's reduce-scatter runs
  //    while the next chunk multiplies, the last one's after: g' + (S - 1) max(g', c) + c;
  //  bulk: the whole collective beside the whole product on the SMs it leaves: max(G', C).
  //  async (NCCL): the same with NCCL's collective over the group, on the SMs cluster.
  //    collective_sms holds (none by default, as for every collective: docs/model.md).
  double tp_overlap_seconds(const KernelWork& w, KernelClass cls) const {
    const KernelShape& s = w.shape;
    const bool beside_weight_gradient =
        cls == KernelClass::tp_overlap_bulk ||
        (cls == KernelClass::tp_overlap_async && w.kernel != "tp.overlap.async_allgather");
    const bool accumulate = beside_weight_gradient && fused_accumulation;
    const double alone = product_seconds(s, w.dtype, accumulate, cl.sm_count);
    const int t = plan.tp;
    auto rows = [&](int parts) {
      KernelShape c = s;
      c.m = (s.m + parts - 1) / parts;
      return c;
    };
    double pair = alone;
    switch (cls) {
      case KernelClass::tp_overlap_ring: {
        const double g = product_seconds(rows(t), w.dtype, false, cl.sm_count);
        const double send = userbuffers_seconds(w.bytes / t);
        pair = g + (t - 1) * std::max(g, send);
        break;
      }
      case KernelClass::tp_overlap_pipeline: {
        const int S = kUbPipelineSplits;
        const double g = product_seconds(rows(S), w.dtype, false, cl.sm_count - kUbCommSms);
        const double c = userbuffers_seconds((t - 1.0) / t * w.bytes / S);
        pair = g + (S - 1) * std::max(g, c) + c;
        break;
      }
      case KernelClass::tp_overlap_bulk:
        pair = std::max(product_seconds(s, w.dtype, accumulate, cl.sm_count - kUbCommSms),
                        userbuffers_seconds((t - 1.0) / t * w.bytes));
        break;
      case KernelClass::tp_overlap_async: {
        const OpKind kind = w.kernel == "tp.overlap.async_allreduce"       ? OpKind::AllReduce
                            : w.kernel == "tp.overlap.async_reducescatter" ? OpKind::ReduceScatter
                                                                           : OpKind::AllGather;
        pair = std::max(product_seconds(s, w.dtype, accumulate, cl.sm_count - cl.collective_sms),
                        nccl_collective(kind, tp_group, w.bytes, cl).seconds);
        break;
      }
      default: break;
    }
    return std::max(0.0, pair - alone);
  }

  // What a product's price takes from its shape alone (the same at any rate): its FLOPs, the
  // best tile's use of the GPU (for the plan's SM count) and the bytes it moves.
  struct Facts {
    KernelClass cls = KernelClass::memory;
    double flops = 0, tile_use = 0, k = 0, io = 0;
    bool plain = false;  // gemm_compute_efficiency is compute_efficiency itself
  };
  Facts facts(const KernelWork& w) const {
    Facts f;
    f.cls = classify(w);
    if (f.cls != KernelClass::matmul && f.cls != KernelClass::accumulate) return f;
    const KernelShape& s = w.shape;
    f.flops = s.flops();
    f.plain = !s.is_matmul() || s.n <= 0 || s.k <= 0;
    if (!f.plain) f.tile_use = gemm_tile_use(s, cl.sm_count);
    f.k = static_cast<double>(s.k);
    f.io = gemm_io_bytes(s, elem_of(w.dtype), f.cls == KernelClass::accumulate ? 8.0 : -1);
    return f;
  }
  // A product in another format than the plan's compute (FP8's output layer stays in BF16): that
  // format's rate and operand bytes.
  double peak_of(DType d) const {
    return d == plan.config.precision.compute ? peak : plan.peak_flops(d) * cl.sustained_clock_fraction;
  }
  double elem_of(DType d) const { return d == plan.config.precision.compute ? elem : dtype_bytes(d); }

  // gemm_seconds, memory_seconds, nccl_collective, ... of the kernel (`f`: facts(w)).
  double seconds(const KernelWork& w, const Facts& f) const {
    switch (f.cls) {
      case KernelClass::tp_allreduce: return nccl_collective(OpKind::AllReduce, tp_group, w.bytes, cl).seconds;
      case KernelClass::tp_allgather: return nccl_collective(OpKind::AllGather, tp_group, w.bytes, cl).seconds;
      case KernelClass::tp_reducescatter: return nccl_collective(OpKind::ReduceScatter, tp_group, w.bytes, cl).seconds;
      case KernelClass::cp_allgather: return nccl_collective(OpKind::AllGather, cp_group, w.bytes, cl).seconds;
      case KernelClass::cp_reducescatter: return nccl_collective(OpKind::ReduceScatter, cp_group, w.bytes, cl).seconds;
      case KernelClass::tp_overlap_ring:
      case KernelClass::tp_overlap_pipeline:
      case KernelClass::tp_overlap_bulk:
      case KernelClass::tp_overlap_async: return tp_overlap_seconds(w, f.cls);
      case KernelClass::flash_attention:
      case KernelClass::cudnn_attention: return attention_seconds(w.shape, f.cls == KernelClass::cudnn_attention);
      // Transformer Engine's ring (AttnFuncWithCPAndKVP2P): c steps, each the attention of this
      // GPU's queries with one GPU's chunk (1/c of the kernel's work, load-balanced), while the
      // chunk in hand goes on to the next GPU; the c - 1 sends cost what their step's attention
      // does not cover. The backward sends keys, values and their gradients each step, and the
      // last gradients home once more, exposed. The ring's slowest hop sets its step: the NIC's
      // once the group spans nodes.
      case KernelClass::cp_ring_forward:
      case KernelClass::cp_ring_backward: {
        const int c = plan.cp;
        const double step = attention_seconds(w.shape, plan.config.model.attention == AttentionKernel::cudnn) / c;
        auto send = [&](double bytes) {
          const bool across = cp_group.nodes > 1;
          const LinkConfig& link = across ? cl.inter_node : cl.intra_node;
          return us_to_seconds(link.latency_us) +
                 bytes / nccl_p2p_bytes_per_second(bytes, !across, cp_channels, across, cl);
        };
        double exposed = (c - 1) * std::max(0.0, send(w.bytes) - step);
        if (f.cls == KernelClass::cp_ring_backward) exposed += send(w.bytes / 2);
        return exposed;
      }
      // A weight-gradient product fused with gradient accumulation reads and writes its FP32
      // main_grad tile (Megatron-LM's wgrad_gemm_accum_fp32): gemm_seconds(w.shape, elem, peak,
      // cl, 8.0); a product: gemm_seconds(w.shape, elem, peak, cl).
      case KernelClass::accumulate:
      case KernelClass::matmul: {
        if (f.flops <= 0) return 0;
        const double efficiency = f.plain ? cl.compute_efficiency : gemm_efficiency_with(f.tile_use, f.k, cl);
        return gemm_seconds_with(f.flops, efficiency, f.io, peak_of(w.dtype), cl);
      }
      case KernelClass::memory: {
        const double memory = memory_seconds(w.bytes, cl);
        if (w.random_draws <= 0 || cl.int32_tops <= 0) return memory;
        // A dropout mask drawn in the kernel: PyTorch's and Megatron's kernels draw with
        // Philox-4x32-10 (curand_uniform4, four numbers per call), about
        // kDropoutInstructionsPerDraw integer instructions per element on the SMs' 64 INT32
        // lanes, at the clock they hold. Those instructions and the bytes overlap, not
        // perfectly: the soft roofline of the matrix products.
        const double draws =
            w.random_draws * kDropoutInstructionsPerDraw / (cl.int32_tops * 1e12 * cl.sustained_clock_fraction);
        return std::sqrt(memory * memory + draws * draws);
      }
      // apex's FusedLayerNorm against the persistent kernel on the same A100 and shape
      // (NVIDIA/apex pull request #1037: forward 0.0751 against 0.0535 ms, backward 0.1762
      // against 0.0866 ms).
      case KernelClass::layernorm_forward:
        return memory_seconds(w.bytes, cl) * (apex_layernorm ? 0.0751 / 0.0535 : 1.0);
      case KernelClass::layernorm_backward:
        return memory_seconds(w.bytes, cl) * (apex_layernorm ? 0.1762 / 0.0866 : 1.0);
    }
    return 0;
  }
  double seconds(const std::vector<KernelWork>& ws, const std::vector<Facts>& facts) const {
    double total = 0;
    for (std::size_t i = 0; i < ws.size(); ++i) total += ws[i].count * seconds(ws[i], facts[i]);
    return total;
  }
};

bool same_kernels(const std::vector<KernelWork>& a, const std::vector<KernelWork>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const KernelWork& x, const KernelWork& y) {
    return x.kernel == y.kernel && x.dtype == y.dtype && x.shape == y.shape && x.bytes == y.bytes &&
           x.random_draws == y.random_draws && x.count == y.count;
  });
}

}  // namespace

void inventory_key_into(const ScenarioConfig& c, ScenarioConfig& key) {
  key = c;  // reuses key's storage
  key.name.clear();
  key.description.clear();
  ClusterConfig& cl = key.cluster;
  cl.gpu.clear();
  cl.memory_gib = 0;
  for (auto& rate : cl.peak_tflops) rate.second = 0;  // keeps the formats
  cl.compute_efficiency = cl.memory_efficiency = cl.attention_efficiency = cl.cudnn_attention_efficiency =
      cl.sustained_clock_fraction = 0;
  cl.hbm_bandwidth_gbps = cl.int32_tops = 0;
  cl.intra_node = cl.inter_node = {};
  cl.nvlink_sharp = false;
  cl.price_per_gpu_hour = 0;
  TrainingConfig& t = key.training;
  t.lr = t.weight_decay = t.adam_beta1 = t.adam_beta2 = t.adam_eps = t.clip_grad = 0;
  t.total_tokens = 0;
  t.train_steps = 0;
  key.runtime = {};
}

// One plan's framework inventory: for each chunk the first chunk with the same kernels
// (priced once), and only those first chunks' kernels and what the pricer does with each.
// A sweep keeps up to kMaxEntries of these, and most chunks of a deep pipeline repeat the
// one before (GPT-3 175B at pp 8, v 3: 3 distinct of 24), so the repeats are not kept.
struct KernelInventoryCache::Entry {
  ScenarioConfig key;
  struct Distinct {
    ChunkKernels kernels;
    std::vector<FrameworkPricer::Facts> forward, backward_input, backward_weight;
  };
  std::vector<Distinct> distinct;
  std::vector<int> same_as;  // per chunk: its index in `distinct`
  // Per pipeline stage: the parameters one rank holds (Plan::shard_stage_params), which the
  // optimizer step's price reads: a function of the model and the layout alone, both in the key.
  std::vector<double> shard_stage_params;

  void build(const Plan& plan) {
    shard_stage_params.resize(static_cast<std::size_t>(plan.pp));
    for (int st = 0; st < plan.pp; ++st) shard_stage_params[static_cast<std::size_t>(st)] = plan.shard_stage_params(st);
    BuiltChunks built = framework_built_chunks(plan, plan.activation_bytes());
    distinct.clear();
    same_as.assign(built.chunk_of.size(), 0);
    const FrameworkPricer pricer(plan);
    auto of = [&](const std::vector<KernelWork>& ws, std::vector<FrameworkPricer::Facts>& out) {
      out.clear();
      for (const KernelWork& w : ws) out.push_back(pricer.facts(w));
    };
    // Each built chunk compared with the distinct ones before it (built chunks may still have
    // the same kernels: the first chunk without an embedding's, say); chunks share their built
    // chunk's verdict.
    std::vector<int> distinct_of(built.chunks.size(), -1);
    for (std::size_t c = 0; c < built.chunk_of.size(); ++c) {
      int& d = distinct_of[static_cast<std::size_t>(built.chunk_of[c])];
      if (d < 0) {
        ChunkKernels& k = built.chunks[static_cast<std::size_t>(built.chunk_of[c])];
        auto same = std::find_if(distinct.begin(), distinct.end(), [&](const Distinct& x) {
          return same_kernels(x.kernels.forward, k.forward) && same_kernels(x.kernels.backward_input, k.backward_input) &&
                 same_kernels(x.kernels.backward_weight, k.backward_weight);
        });
        d = static_cast<int>(same - distinct.begin());
        if (same == distinct.end()) {  // priced once, here
          Distinct& x = distinct.emplace_back();
          x.kernels = std::move(k);
          of(x.kernels.forward, x.forward);
          of(x.kernels.backward_input, x.backward_input);
          of(x.kernels.backward_weight, x.backward_weight);
        }
      }
      same_as[c] = d;
    }
  }
};

KernelInventoryCache::KernelInventoryCache() = default;
KernelInventoryCache::~KernelInventoryCache() = default;

const KernelInventoryCache::Entry& KernelInventoryCache::of(const Plan& plan) {
  // A sweep's inventories are its shapes: micro-batch x recompute x sequence parallelism is
  // already 24 in the GPT-3 benchmark file.
  constexpr std::size_t kMaxEntries = 32;
  inventory_key_into(plan.config, key_);
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const auto& e) { return e->key == key_; });
  if (it == entries_.end()) {
    std::unique_ptr<Entry> entry;
    if (entries_.size() >= kMaxEntries) {
      entry = std::move(entries_.back());
      entries_.pop_back();
    } else {
      entry = std::make_unique<Entry>();
    }
    entry->key = key_;
    entry->build(plan);
    entries_.insert(entries_.begin(), std::move(entry));
  } else {
    std::rotate(entries_.begin(), it, it + 1);
  }
  return *entries_.front();
}

namespace {

// The calibrated path's kernels (price_from_profile), one list per virtual stage: the runtime's
// inventory at the profile's rates, each pass's scaled by its composition, and tensor
// parallelism's collectives from the profile's tables as one row per pass.
std::vector<std::vector<PricedKernel>> calibrated_kernel_prices(const Plan& plan, const HardwareProfile& profile) {
  const ProfilePricing pricing(plan, profile);
  std::vector<std::vector<PricedKernel>> all;
  const std::vector<ChunkKernels> kernels = chunk_kernels(plan, pricing.storage);
  for (int vs = 0; vs < static_cast<int>(kernels.size()); ++vs) {
    const ChunkKernels& k = kernels[static_cast<std::size_t>(vs)];
    const RooflineComputeModel::ChunkSeconds tp = pricing.tensor_parallel(plan, vs, profile);
    const RooflineComputeModel::ChunkSeconds cp = pricing.context_parallel(plan, vs, profile);
    std::vector<PricedKernel>& out = all.emplace_back();
    auto add = [&](const std::vector<KernelWork>& ws, PricedKernel::Pass pass, double composition, double tp_seconds,
                   double cp_seconds) {
      for (const KernelWork& w : ws) {
        bool measured = false;
        const double each = launch_seconds(w, profile, pricing.rate, pricing.hbm, &measured);
        out.push_back({w, pass, composition * w.count * each,
                       measured ? "measured" : w.shape.is_matmul() ? "compute" : "memory"});
      }
      for (const auto& [name, seconds] : {std::pair{"tp.collectives (profile tables)", tp_seconds},
                                          std::pair{"cp.collectives (profile tables)", cp_seconds}})
        if (seconds > 0) {
          KernelWork c;
          c.kernel = name;
          c.dtype = plan.config.precision.compute;
          out.push_back({c, pass, seconds, "collective"});
        }
    };
    add(k.forward, PricedKernel::Pass::forward, pricing.forward, tp.forward, cp.forward);
    add(k.backward_input, PricedKernel::Pass::backward_input, pricing.backward_input, tp.backward_input,
        cp.backward_input);
    add(k.backward_weight, PricedKernel::Pass::backward_weight, pricing.backward_weight, tp.backward_weight,
        cp.backward_weight);
  }
  return all;
}

// The framework's kernels at the roofline, each built chunk priced once.
std::vector<std::vector<PricedKernel>> framework_kernel_prices(const Plan& plan) {
  const BuiltChunks built = framework_built_chunks(plan, plan.activation_bytes());
  const FrameworkPricer pricer(plan);
  std::vector<std::vector<PricedKernel>> priced;
  for (const ChunkKernels& k : built.chunks) {
    std::vector<PricedKernel>& out = priced.emplace_back();
    auto add = [&](const std::vector<KernelWork>& ws, PricedKernel::Pass pass) {
      for (const KernelWork& w : ws) {
        const FrameworkPricer::Facts f = pricer.facts(w);
        const char* bound = "memory";
        if (f.cls == KernelClass::tp_allreduce || f.cls == KernelClass::tp_allgather ||
            f.cls == KernelClass::tp_reducescatter || f.cls == KernelClass::cp_allgather ||
            f.cls == KernelClass::cp_reducescatter || f.cls == KernelClass::cp_ring_forward ||
            f.cls == KernelClass::cp_ring_backward || f.cls == KernelClass::tp_overlap_ring ||
            f.cls == KernelClass::tp_overlap_pipeline || f.cls == KernelClass::tp_overlap_bulk ||
            f.cls == KernelClass::tp_overlap_async)
          bound = "collective";
        else if (f.cls == KernelClass::flash_attention || f.cls == KernelClass::cudnn_attention || f.cls == KernelClass::matmul || f.cls == KernelClass::accumulate)
          bound = "compute";
        out.push_back({w, pass, w.count * pricer.seconds(w, f), bound});
      }
    };
    add(k.forward, PricedKernel::Pass::forward);
    add(k.backward_input, PricedKernel::Pass::backward_input);
    add(k.backward_weight, PricedKernel::Pass::backward_weight);
  }
  std::vector<std::vector<PricedKernel>> all;
  for (int c : built.chunk_of) all.push_back(priced[static_cast<std::size_t>(c)]);
  return all;
}

}  // namespace

std::vector<std::vector<PricedKernel>> kernel_prices(const Plan& plan) {
  if (const auto& profile = plan.config.cluster.calibrated) return calibrated_kernel_prices(plan, *profile);
  return framework_kernel_prices(plan);
}

namespace {

std::array<Tick, 5> chunk_ticks(const RooflineComputeModel::ChunkSeconds& c) {
  return {seconds_to_ticks(c.forward), seconds_to_ticks(c.backward()), seconds_to_ticks(c.backward_input),
          seconds_to_ticks(c.backward_weight), seconds_to_ticks(c.first_forward > 0 ? c.first_forward : c.forward)};
}

}  // namespace

RooflineComputeModel::RooflineComputeModel(const Plan& plan, KernelInventoryCache* cache) {
  const ScenarioConfig& cfg = plan.config;
  if (cfg.cluster.calibrated) {
    price_from_profile(plan, *cfg.cluster.calibrated);
    for (const auto& c : chunks_) chunk_ticks_.push_back(chunk_ticks(c));
    return;
  }
  // Every kernel Megatron-LM / PyTorch launches for the op, each priced by what bounds it:
  // matrix products by shape (gemm_model.h), memory-bound kernels by HBM bandwidth, attention
  // by the plan's kernel, tensor-parallel all-reduces by the collective model. A chunk with
  // the same kernels as an earlier one has its prices.
  KernelInventoryCache::Entry built;
  if (!cache) built.build(plan);
  const KernelInventoryCache::Entry& inventory = cache ? cache->of(plan) : built;
  const FrameworkPricer price(plan);
  // Each distinct chunk priced once, then every chunk given its distinct chunk's prices.
  std::array<ChunkSeconds, 8> few;
  std::vector<ChunkSeconds> many;
  ChunkSeconds* priced = few.data();
  if (inventory.distinct.size() > few.size()) {
    many.resize(inventory.distinct.size());
    priced = many.data();
  }
  for (std::size_t d = 0; d < inventory.distinct.size(); ++d) {
    const auto& k = inventory.distinct[d];
    ChunkSeconds& c = priced[d];
    c.forward = price.seconds(k.kernels.forward, k.forward);
    c.backward_input = price.seconds(k.kernels.backward_input, k.backward_input);
    c.backward_weight = price.seconds(k.kernels.backward_weight, k.backward_weight);
  }
  chunks_.reserve(inventory.same_as.size());
  for (int d : inventory.same_as) chunks_.push_back(priced[d]);

  // The optimizer step as Megatron-LM's mixed-precision optimizer runs it, per parameter of the
  // rank's shard: gradients copied into FP32 (g + 4, unless accumulated in FP32), unscaled and
  // checked for inf/NaN with loss scaling (8), the global norm read (4), the update reading
  // gradient, master weight and moments and writing the last three (28 for Adam, 20 for SGD with
  // momentum), the working copy written from the master (4 + w), the gradients zeroed (g).
  // Without a master copy the update works on the w-byte weights directly.
  const int g = dtype_bytes(cfg.precision.grad_accumulation), w = plan.weight_bytes();
  const bool master = cfg.precision.master_weights != cfg.precision.compute;
  const bool sgd = cfg.training.optimizer == Optimizer::sgd;
  const bool scaled = cfg.precision.loss_scaling.mode != LossScalingMode::none;
  const double update = master ? (sgd ? 20.0 : 28.0) : (sgd ? 3.0 * w + 2 * 4.0 : 3.0 * w + 4 * 4.0);
  const double bytes_per_param = (master && g != 4 ? g + 4.0 : 0.0) + (scaled ? 8.0 : 0.0) + 4.0 + update +
                                 (master ? 4.0 + w : 0.0) + g;
  const int shards = cfg.parallelism.zero_stage >= 1 ? plan.data_shards() : 1;
  // Priced once per stage (every replica of a stage holds the same parameters).
  std::vector<Tick> of_stage(static_cast<std::size_t>(plan.pp));
  for (int s = 0; s < plan.pp; ++s)
    of_stage[static_cast<std::size_t>(s)] =
        seconds_to_ticks(memory_seconds(inventory.shard_stage_params[static_cast<std::size_t>(s)] / shards * bytes_per_param, cfg.cluster));
  optimizer_ticks_.reserve(static_cast<std::size_t>(plan.num_ranks()));
  for (int r = 0; r < plan.num_ranks(); ++r) optimizer_ticks_.push_back(of_stage[static_cast<std::size_t>(plan.stage_of(r))]);
  chunk_ticks_.reserve(chunks_.size());
  for (const auto& c : chunks_) chunk_ticks_.push_back(chunk_ticks(c));
}

}  // namespace trainsim
