#include "core/kernel_inventory.h"

#include <algorithm>

#include "core/model_shape.h"

namespace trainsim {

namespace {

struct Builder {
  DType dtype;
  double storage;
  std::vector<KernelWork>* out = nullptr;
  void matmul(const char* kernel, long m, long n, long k, long batch = 1) {
    KernelWork w{kernel, dtype, {}, 0, 1};
    w.shape.m = m, w.shape.n = n, w.shape.k = k, w.shape.batch = batch;
    add(std::move(w));
  }
  // An FP8 cast of a 16-bit tensor: read it, write FP8 twice, row- and column-major (the weight
  // gradient's product takes the transposes: Transformer Engine's cast_transpose), its amax
  // found in the same pass.
  void fp8_cast(double elements) { memory_bytes("fp8.cast", elements, elements * (storage + 2.0)); }
  // A memory-bound kernel over `elements`, touching each `passes` times (reads plus writes).
  void memory(const char* kernel, double elements, double passes) {
    if (elements <= 0) return;
    KernelWork w{kernel, dtype, {}, 0, 1};
    w.shape.elements = static_cast<long>(elements);
    w.bytes = elements * passes * storage;
    add(std::move(w));
  }
  // A memory-bound kernel over `elements` that moves `bytes` in all (mixed element sizes).
  void memory_bytes(const char* kernel, double elements, double bytes) {
    if (elements <= 0 || bytes <= 0) return;
    KernelWork w{kernel, dtype, {}, 0, 1};
    w.shape.elements = static_cast<long>(elements);
    w.bytes = bytes;
    add(std::move(w));
  }
  // A memory-bound kernel that also draws one random number per element (a dropout mask).
  void memory_random(const char* kernel, double elements, double bytes) {
    if (elements <= 0 || bytes <= 0) return;
    KernelWork w{kernel, dtype, {}, 0, 1};
    w.shape.elements = static_cast<long>(elements);
    w.bytes = bytes;
    w.random_draws = elements;
    add(std::move(w));
  }
  // A collective overlapped with a product (`tp.overlap.*`): the product's shape and format, the
  // collective's bytes.
  void overlapped(const char* kernel, const KernelShape& product, double bytes) {
    KernelWork w{kernel, dtype, product, bytes, 1};
    add(std::move(w));
  }
  void add(KernelWork w) {
    for (KernelWork& k : *out)
      if (k.shape == w.shape && k.bytes == w.bytes && k.random_draws == w.random_draws && k.dtype == w.dtype &&
          k.kernel == w.kernel) {  // the name last: dearest to compare
        ++k.count;
        return;
      }
    out->push_back(std::move(w));
  }
};

}  // namespace

std::vector<ChunkKernels> chunk_kernels(const Plan& plan, int storage, InventoryTarget target) {
  if (target == InventoryTarget::framework) {
    BuiltChunks built = framework_built_chunks(plan, storage);
    std::vector<ChunkKernels> out;
    out.reserve(built.chunk_of.size());
    for (int i : built.chunk_of) out.push_back(built.chunks[static_cast<std::size_t>(i)]);
    return out;
  }
  const ModelShape m = plan.shape();
  const auto& cfg = plan.config;
  // Context parallelism: a rank holds Tq = T / cp of each sequence's rows; its attention runs its
  // queries over all T keys, gathered (runtime/model/stage_model.cpp).
  const long b = plan.micro_batch_size, T = m.s, Tq = plan.local_seq_length(), N = b * Tq, t = plan.tp;
  const long C = m.h, F = m.f / t, V = m.V / t, H = std::max<long>(1, m.a / t), hs = m.h / m.a;
  const double scores = static_cast<double>(b) * H * Tq * T;  // attention's (Tq, T) per head and sample
  // The residual stream's rows on a shard: all of them, or 1/t under sequence parallelism (its
  // norms, residual adds and stored stream); the products see all N rows. A row-parallel product's
  // output is rounded as a partial sum (N rows) and again summed (the shard's rows), with its bias
  // added after the sum; a column-parallel input's gradient likewise (runtime/model/stage_model.cpp).
  const long Nl = cfg.parallelism.sequence_parallel && t > 1 ? N / t : N;
  const double reduced = t > 1 ? static_cast<double>(N * C + Nl * C) : static_cast<double>(N * C);
  const long qkv = (m.h + 2L * m.h / m.a * m.kv_heads) / t, Cout = C / t;
  const long ffn_in = m.swiglu ? 2 * F : F;  // SwiGLU's gate and up products as one wider product
  // Context parallelism's gathered keys and values: the rank's into its chunk and every rank's
  // into the sequence's order around the all-gather; the gradients of every key into the ranks'
  // chunks and the rank's own out around the reduce-scatter (the collectives themselves are priced
  // from the profile's tables).
  const double kv_all = static_cast<double>(b) * T * 2 * (C / t), kv_own = kv_all / plan.cp;
  auto cp_gather = [&](Builder& k) {
    if (plan.cp > 1) k.memory("copy", kv_own + kv_all, 2);
  };
  auto cp_reduce = [&](Builder& k) {
    if (plan.cp > 1) k.memory("copy", kv_all + kv_own, 2);
  };
  // In a low-precision format the runtime rounds every produced tensor (two passes); in FP32
  // it only scans it (one).
  const bool fp32 = cfg.precision.compute == DType::fp32;
  const double round_passes = fp32 ? 1.0 : 2.0;
  // Weight gradients: straight into the FP32 buffer and scanned (one pass), or produced, rounded,
  // added and the sum rounded (seven passes) when compute or accumulation is low-precision.
  const bool fast_grads = fp32 && cfg.precision.grad_accumulation == DType::fp32;
  const double commit_passes = fast_grads ? 1.0 : 7.0;
  const double layer_params = (m.params_per_layer() - m.replicated_params_per_layer()) / t + m.replicated_params_per_layer();

  std::vector<ChunkKernels> out(plan.num_virtual_stages());
  for (int vs = 0; vs < plan.num_virtual_stages(); ++vs) {
    const int layers = plan.layers_per_virtual_stage[vs];
    const bool first = vs == 0, last = vs == plan.num_virtual_stages() - 1;
    ChunkKernels& c = out[vs];
    Builder k{cfg.precision.compute, static_cast<double>(storage)};

    // One layer's forward as block_forward runs it: by the forward, again in the backward under
    // full recompute, and under selective_op (`rebuild_op`) without the products whose outputs it
    // kept (qkv, fc: the decoder's 1st and 3rd) and the second projection, whose output only the
    // next layer's input, kept, holds.
    auto layer_forward = [&](bool rebuild_op) {
      k.memory("layernorm.forward", Nl * C, 2);
      if (!rebuild_op) k.matmul("linear.forward", N, qkv, C);
      cp_gather(k);
      k.matmul("attention.forward", Tq, T, hs, 2 * b * H);
      k.matmul("linear.forward", N, C, Cout);
      if (t > 1) k.memory("residual", Nl * C, 3);  // the bias, after the sum
      k.memory("residual", Nl * C, 3);
      k.memory("layernorm.forward", Nl * C, 2);
      if (!rebuild_op) k.matmul("linear.forward", N, ffn_in, C);
      k.memory("gelu.forward", N * F, 2);
      if (rebuild_op) {
        // ln1, x1, ln2 (the stream's rows); att again, gelu; the projection's output; scores and
        // probabilities
        k.memory("round", 3.0 * Nl * C + N * (Cout + F) + reduced + 2.0 * scores, round_passes);
        return;
      }
      k.matmul("linear.forward", N, C, F);
      if (t > 1) k.memory("residual", Nl * C, 3);
      k.memory("residual", Nl * C, 3);
      // ln1, x1, ln2, out (the stream's rows); qkv, att, fc, gelu; the two projections' outputs;
      // attention's scores and probabilities
      k.memory("round", 4.0 * Nl * C + N * (qkv + Cout + ffn_in + F) + 2 * reduced + 2.0 * scores, round_passes);
    };
    const Recompute recompute = cfg.training.activation_recompute;

    k.out = &c.forward;
    if (first) {
      k.memory("embedding.forward", N * C, 3);
      k.memory("round", Nl * C, round_passes);
    } else {
      k.memory("copy", Nl * C, 2);  // the received activation into the stash
      k.memory("round", Nl * C, round_passes);
    }
    for (int l = 0; l < layers; ++l) layer_forward(false);
    if (last) {
      k.memory("layernorm.forward", Nl * C, 2);
      k.matmul("linear.forward", N, V, C);
      k.memory("cross_entropy.forward", N * V, 1);
      k.memory("round", Nl * C + N * V, round_passes);
    }

    k.out = &c.backward_input;
    if (last) {
      k.memory("cross_entropy.backward", N * V, 2);
      k.memory("round", N * V, round_passes);
      k.matmul("linear.backward_input", N, C, V);
      k.memory("layernorm.backward_input", Nl * C, 4);
      k.memory("round", reduced + Nl * C, round_passes);
    } else {
      k.memory("copy", Nl * C, 2);  // the received gradient
      k.memory("round", Nl * C, round_passes);
    }
    const int rebuilt = recomputed_layers(cfg.training, layers);
    for (int l = 0; l < layers; ++l) {
      // Recompute first rebuilds what the forward did not keep: the layer (full), all of it but
      // the kept products (selective_op), or the attention core's scores and probabilities
      // (selective).
      if ((recompute == Recompute::full && l < rebuilt) || recompute == Recompute::selective_op)
        layer_forward(recompute == Recompute::selective_op);
      if (recompute == Recompute::selective) {
        cp_gather(k);
        k.matmul("attention.forward", Tq, T, hs, 2 * b * H);
        k.memory("round", 2.0 * scores, round_passes);
      }
      k.matmul("linear.backward_input", N, F, C);
      k.memory("gelu.backward", N * F, 3);
      k.matmul("linear.backward_input", N, C, ffn_in);
      k.memory("layernorm.backward_input", Nl * C, 4);
      k.matmul("linear.backward_input", N, Cout, C);
      cp_gather(k);
      k.matmul("attention.backward", Tq, T, hs, 4 * b * H);
      cp_reduce(k);
      k.matmul("linear.backward_input", N, C, qkv);
      k.memory("layernorm.backward_input", Nl * C, 4);
      // dgelu, dfc, datt, dqkv; dln2 and dln1 (as the projections' outputs); dx1, dx0 (the
      // stream's rows); attention's two gradients of (Tq, T)
      k.memory("round", N * (F + ffn_in + Cout + qkv) + 2 * reduced + 2.0 * Nl * C + 2.0 * scores, round_passes);
    }

    k.out = &c.backward_weight;
    if (last) {
      k.matmul("linear.backward_weight", V, C, N);
      k.memory("layernorm.backward_weight", Nl * C, 2);
      k.memory("commit", m.output_params() / t + m.final_norm_params(), commit_passes);
    }
    for (int l = 0; l < layers; ++l) {
      k.matmul("linear.backward_weight", C, F, N);
      k.matmul("linear.backward_weight", ffn_in, C, N);
      k.memory("layernorm.backward_weight", Nl * C, 2);
      k.matmul("linear.backward_weight", Cout, C, N);
      k.matmul("linear.backward_weight", qkv, C, N);
      k.memory("layernorm.backward_weight", Nl * C, 2);
      k.memory("commit", layer_params, commit_passes);
    }
    if (first) {
      k.memory("embedding.backward", N * C, 3);
      k.memory("commit", static_cast<double>(m.V) * C / t + (m.learned_positions ? static_cast<double>(T) * C : 0.0),
               commit_passes);
    }
    // ZeRO-2/3 reduce every micro-batch's gradients: the backward hands each bucket over to its
    // reduce-scatter (copied out) and clears it for the next micro-batch.
    if (plan.reduces_every_microbatch()) {
      const double params = plan.virtual_stage_params(vs) / t;
      k.memory("copy", params, 2);
      k.memory("zero", params, 1);
    }
  }
  return out;
}

// What Megatron-LM / PyTorch launch on a GPU for one micro-batch on one tensor-parallel rank
// (InventoryTarget::framework; the header says what differs from the runtime's list).
BuiltChunks framework_built_chunks(const Plan& plan, int storage) {
  const ModelShape m = plan.shape();
  const auto& cfg = plan.config;
  // Context parallelism: a GPU holds Tq = s / cp of each sequence's tokens (N rows through every
  // token-wise kernel) and attends its queries over all T keys, gathered.
  const long b = plan.micro_batch_size, T = m.s, Tq = plan.local_seq_length(), N = b * Tq, t = plan.tp;
  const long C = m.h, F = m.f / t, V = m.V / t, H = std::max<long>(1, m.a / t), hs = m.h / m.a;
  const long kv = 2L * m.h / m.a * m.kv_heads;  // K and V widths together
  const long qkv = (m.h + kv) / t, Cout = C / t;
  const long ffn_in = m.swiglu ? 2 * F : F;
  const double e = storage;
  const double g = dtype_bytes(cfg.precision.grad_accumulation);
  const bool sp = cfg.parallelism.sequence_parallel && t > 1;
  const double rep = sp ? static_cast<double>(N) * C / t : static_cast<double>(N) * C;  // replicated tensors
  const double scores = static_cast<double>(b) * H * Tq * T;  // attention's s/cp x s elements on this rank
  const double hidden_mask = m.hidden_dropout ? 1.0 : 0.0;
  const AttentionKernel attn = m.attention;
  // The single attention kernel, named for its implementation (the compute model prices each).
  const bool cudnn = attn == AttentionKernel::cudnn;
  const Recompute rc = cfg.training.activation_recompute;
  const double act = static_cast<double>(N) * C * e;  // one tensor-parallel all-reduce's buffer
  // Gradients accumulate into the grad_accumulation buffer from the second micro-batch on:
  // read it, read the new gradient, write the sum.
  const int mb = std::max(1, plan.num_microbatches);
  const double accumulate = (2 * g + e) * static_cast<double>(mb - 1) / mb;
  const double layer_params = m.params_per_layer() / t;
  // Megatron-LM's gradient accumulation fusion: the weight-gradient products of the linear layers
  // (and of an untied or tied output layer) add into main_grad themselves, so only the embedding
  // lookup's gradient (and the small norm and bias gradients, left out) is added separately.
  const bool fused_accumulation = cfg.training.gradient_accumulation_fusion && plan.framework == Framework::megatron;
  const char* wgrad = fused_accumulation ? "linear.backward_weight_accumulate" : "linear.backward_weight";
  const double layer_accumulate = fused_accumulation ? 0.0 : accumulate;

  // One chunk's kernels: a function of its layer count and whether it is the first or the last
  // (and of the plan's constants above) alone.
  auto build_chunk = [&](const int layers, const bool first, const bool last) {
    ChunkKernels c;
    Builder k{cfg.precision.compute, e};
    // FP8 training (Transformer Engine, torchao's Float8) quantizes a linear layer's operands
    // before its product: the input and the weight in the forward, the output gradient in the
    // backward. A tensor of the residual stream's width (a column-parallel product's input, a
    // row-parallel product's output gradient) is cast on the rank's rows before it is gathered
    // (sequence parallelism: 1/t of them; TE and torchao's Float8ColwiseParallel gather FP8).
    const bool fp8 = cfg.precision.compute == DType::fp8;
    const double stream_rows = sp ? static_cast<double>(N) / t : static_cast<double>(N);
    // A layer's product, forward (m tokens, n outputs, depth): `row_parallel` when its input is
    // split t ways (attention output, MLP down) and its output the stream's width.
    auto linear_forward = [&](long n, long depth, bool row_parallel) {
      if (fp8) {
        k.fp8_cast((row_parallel ? static_cast<double>(N) : stream_rows) * depth);
        k.fp8_cast(static_cast<double>(n) * depth);
      }
      k.matmul("linear.forward", N, n, depth);
    };
    // Its input gradient (m tokens, n inputs, the output's width as depth).
    auto linear_backward_input = [&](long n, long depth, bool row_parallel) {
      if (fp8) k.fp8_cast((row_parallel ? stream_rows : static_cast<double>(N)) * depth);
      k.matmul("linear.backward_input", N, n, depth);
    };
    // The output layer stays in 16 bits under FP8: torchtitan's Float8 leaves `output` out, and
    // Megatron-LM's output layer is not a Transformer Engine layer.
    // What `emit` adds, in 16 bits where the compute is FP8.
    auto in_16_bits = [&](auto&& emit) {
      const DType compute = k.dtype;
      if (compute == DType::fp8) k.dtype = DType::bf16;
      emit();
      k.dtype = compute;
    };
    auto head_product = [&](const char* kernel, long m, long n, long depth) {
      in_16_bits([&] { k.matmul(kernel, m, n, depth); });
    };

    // Each of Megatron's tensor-parallel all-reduces; with sequence parallelism a reduce-scatter
    // and an all-gather of the same buffer instead (Korthikanti et al. 2022, section 4.2.2). The
    // reduce-scatter sums a product's 16-bit output; under FP8 the all-gather moves the FP8 copy
    // the next product reads, cast on the rank's rows before the gather (above): one byte an
    // element, unless what it feeds stays in 16 bits (`feeds_fp8_product`: the output layer, the
    // embedding's gradient).
    //
    // Transformer Engine's userbuffers (communication.tp_comm_overlap, under sequence parallelism)
    // run a TE layer's collectives beside its products, by TE's default methods (initialize_ub):
    // the all-gathers by ring exchange beside the product that reads the gathered tensor (qkv and
    // fc1 forward, proj and fc2 input gradients), the row-parallel forward products'
    // reduce-scatters pipelined with them (proj, fc2; or by ring exchange:
    // communication.tp_comm_overlap_reduce_scatter), the column-parallel input gradients'
    // reduce-scatters in bulk beside the weight-gradient products (qkv, fc1). Each becomes a
    // `tp.overlap.<method>` entry with its product's shape and the collective's bytes; the pricer
    // charges what the pair takes beyond the product, which is listed on its own. Megatron-LM's
    // embedding and output layer are not TE layers, so their collectives stay exposed; so do the
    // bulk ones under ZB-H1, whose weight-gradient products run later.
    struct Overlap {
      const char* reduce = nullptr;  // the reduce-scatter's method, or none: exposed
      KernelShape reduce_with;       // the product it runs beside
      bool gather = false;           // the all-gather by ring exchange beside gather_with
      KernelShape gather_with;
      bool reduce_with_16_bits = false;  // reduce_with stays in 16 bits under FP8 (the output layer's)
    };
    const bool ub = cfg.communication.tp_comm_overlap && sp;
    const bool ub_bulk = ub && cfg.parallelism.schedule != ScheduleKind::zb_h1;
    // Without userbuffers, Megatron-LM's column-parallel backward (LinearWithGradAccumulationAndAsync-
    // Communication, communication.tp_backward_comm) launches its collectives on NCCL's stream and
    // computes on: the input gradient's all-reduce (under sequence parallelism its reduce-scatter)
    // beside the weight-gradient product, and under sequence parallelism the re-gather of the
    // layer's input (kept split in the forward) beside the input-gradient product. Each becomes a
    // `tp.overlap.async_<collective>` entry with that product's shape; not under ZB-H1, whose
    // weight-gradient products run later (Plan::tp_backward_overlapped).
    const bool async_bwd = !ub && plan.tp_backward_overlapped;
    const char* column_reduce = ub_bulk ? "tp.overlap.bulk_reducescatter" : async_bwd ? "tp.overlap.async_reducescatter" : nullptr;
    const char* ub_reduce = cfg.communication.tp_comm_overlap_reduce_scatter == TpOverlapReduceScatter::ring_exchange
                                ? "tp.overlap.ring_reducescatter"
                                : "tp.overlap.pipeline_reducescatter";
    auto product = [](long rows, long n, long depth) {
      KernelShape s;
      s.m = rows, s.n = n, s.k = depth;
      return s;
    };
    auto tp_allreduce = [&](double bytes, bool feeds_fp8_product = true, const Overlap& o = {}) {
      if (t <= 1) return;
      auto overlapped_reduce = [&](const char* kernel, const Overlap& with) {
        if (with.reduce_with_16_bits) in_16_bits([&] { k.overlapped(kernel, with.reduce_with, bytes); });
        else k.overlapped(kernel, with.reduce_with, bytes);
      };
      if (sp) {
        const double elements = bytes / e, gathered = fp8 && feeds_fp8_product ? elements : bytes;
        if (o.reduce) overlapped_reduce(o.reduce, o);
        else k.memory_bytes("tp.reducescatter", elements, bytes);
        if (o.gather) k.overlapped("tp.overlap.ring_allgather", o.gather_with, gathered);
        else k.memory_bytes("tp.allgather", elements, gathered);
      } else if (o.reduce) {
        overlapped_reduce("tp.overlap.async_allreduce", o);
      } else {
        k.memory_bytes("tp.allreduce", bytes / e, bytes);
      }
    };
    // Megatron-LM's re-gather of a column-parallel layer's input for its weight gradient, beside
    // the input-gradient product `with` (async_bwd, sequence parallelism).
    auto input_regather = [&](const KernelShape& with) {
      if (async_bwd && sp) k.overlapped("tp.overlap.async_allgather", with, fp8 ? act / e : act);
    };
    // A pipeline message of a tensor-parallel group arrives as t slices, one per GPU (Megatron's
    // scatter/gather); the receiver all-gathers them over NVLink before computing. Sequence
    // parallelism keeps activations split, so there is nothing to gather.
    auto pipeline_gather = [&] {
      if (t > 1 && !sp) k.memory_bytes("tp.allgather", act / e, act);
    };
    // Context parallelism, all_gather form (Llama 3's, PyTorch's): before a layer's attention,
    // forward or backward, the cp GPUs all-gather their keys and values (bytes: the gathered
    // buffer, the s tokens' K and V of this tensor-parallel shard, in the 16-bit format attention
    // runs in); after its backward they reduce-scatter the keys' and values' gradients. On the
    // compute stream, exposed (Llama 3 section 3.3.2: small beside attention's s^2 work under
    // grouped-query attention). p2p form (Transformer Engine's ring): after each attention kernel
    // a `cp.ring` entry carrying that kernel's shape and the bytes one ring step sends (this GPU's
    // K and V; in the backward their gradients too); the pricer charges what of the c - 1 sends
    // the attention of the chunk in hand does not cover.
    const bool cp_gathers = plan.cp > 1 && plan.cp_comm == ContextParallelComm::all_gather;
    const bool cp_ring = plan.cp > 1 && plan.cp_comm == ContextParallelComm::p2p;
    const double kv_gathered = plan.cp_gathered_kv_elements() * e;
    auto cp_gather = [&] {
      if (cp_gathers) k.memory_bytes("cp.allgather", kv_gathered / e, kv_gathered);
    };
    auto cp_reduce = [&] {
      if (cp_gathers) k.memory_bytes("cp.reducescatter", kv_gathered / e, kv_gathered);
    };
    // `batch`: the attention kernel's (its shape, which the pricer divides into the ring's steps).
    auto cp_ring_after = [&](const char* kernel, long batch, double step_bytes) {
      if (!cp_ring) return;
      KernelWork w{kernel, k.dtype, {}, step_bytes, 1};
      w.shape.m = Tq, w.shape.n = T, w.shape.k = hs, w.shape.batch = batch;
      k.add(std::move(w));
    };
    auto attention_core_forward = [&] {
      cp_gather();
      if (single_kernel_attention(attn)) {
        k.matmul(cudnn ? "cudnn_attention.forward" : "flash_attention.forward", Tq, T, hs, 2 * b * H);
        cp_ring_after("cp.ring.forward", 2 * b * H, kv_gathered / plan.cp);
        return;
      }
      k.matmul("attention.scores", Tq, T, hs, b * H);
      if (attn == AttentionKernel::naive) k.memory("attention.mask", scores, 2);
      k.memory("softmax.forward", scores, 2);
      if (m.attention_dropout) k.memory_random("dropout.forward", scores, scores * (2 * e + 1));
      k.matmul("attention.context", Tq, hs, T, b * H);
    };
    // Bytes per element of the elementwise work, fused (Megatron-LM's kernels) or eager (one
    // PyTorch kernel per operation). Eager RMSNorm: cast up, square, mean, multiply, cast down,
    // scale (~32 bytes in 16/32-bit traffic; backward ~1.5x); eager RoPE: cast up, complex
    // multiply, cast down (~28); eager SwiGLU: SiLU then multiply (5 passes of e); eager residual
    // add and bias-dropout-add as separate adds and dropout.
    const bool eager = !cfg.model.fused_elementwise;
    const double norm_fwd = eager ? 32 : 2 * e, norm_bwd = eager ? 48 : 4 * e;
    const double rope_bytes = eager ? 28 : 2 * e;
    const double act_fwd = m.swiglu ? (eager ? 5 * e : 3 * e) : 2 * e;
    const double act_bwd = m.swiglu ? (eager ? 8 * e : 5 * e) : 3 * e;
    const double residual_fwd = eager ? 3 * e + (hidden_mask > 0 ? 3 * e + 1 : 0) : 3 * e + hidden_mask;
    const double q_and_k = static_cast<double>(N) * (C + kv / 2) / t;
    // Biases outside the products (model.fused_linear_bias false, Megatron-LM's own layers): the
    // QKV product's bias added after it (F.linear on [s, b, h] input: matmul, then add), and in
    // backward each bias gradient summed over the N tokens: QKV's, the first MLP product's (from
    // bias-GELU's gradient) and the two replicated ones of the bias-dropout-adds.
    const bool separate_bias = m.bias && !cfg.model.fused_linear_bias;
    // The unfused attention core (fused, naive) works in Megatron's [s, b, np, hn] layout: its
    // context leaves the batched product as [b np, s, hn] and is permuted back into a contiguous
    // [s, b, h/t] (a copy); in backward the q, k and v gradients, split views of the one QKV
    // product, are concatenated into its gradient (torch.cat). FlashAttention reads and writes the
    // layout in place.
    const bool layout_copies = !single_kernel_attention(attn);
    // Megatron's bias-dropout-add (and the eager adds and dropout) draws the hidden dropout's mask.
    auto bias_dropout_add_forward = [&] {
      if (m.hidden_dropout) k.memory_random("bias_dropout_add.forward", rep, rep * residual_fwd);
      else k.memory_bytes("bias_dropout_add.forward", rep, rep * residual_fwd);
    };
    // `feeds_head`: the layer's output goes to the output layer (the last layer of the last chunk).
    auto layer_forward = [&](bool feeds_head = false) {
      k.memory_bytes("layernorm.forward", rep, rep * norm_fwd);
      linear_forward(qkv, C, false);
      if (separate_bias) k.memory("bias.add", static_cast<double>(N) * qkv, 2);
      if (!m.learned_positions) k.memory_bytes("rope.forward", q_and_k, q_and_k * rope_bytes);
      attention_core_forward();
      if (eager && single_kernel_attention(attn))  // the heads transposed back into one tensor
        k.memory("attention.transpose", static_cast<double>(N) * Cout, 2);
      if (layout_copies) k.memory("attention.transpose", static_cast<double>(N) * Cout, 2);
      linear_forward(C, Cout, true);
      tp_allreduce(act, true,
                   ub ? Overlap{ub_reduce, product(N, C, Cout), true, product(N, ffn_in, C)}
                      : Overlap{});
      bias_dropout_add_forward();
      k.memory_bytes("layernorm.forward", rep, rep * norm_fwd);
      linear_forward(ffn_in, C, false);
      k.memory_bytes(m.swiglu ? "swiglu.forward" : "gelu.forward", static_cast<double>(N) * F,
                     static_cast<double>(N) * F * act_fwd);
      linear_forward(C, F, true);
      tp_allreduce(act, !feeds_head,
                   ub ? Overlap{ub_reduce, product(N, C, F), !feeds_head, product(N, qkv, C)}
                      : Overlap{});
      bias_dropout_add_forward();
    };

    // selective_op (torchtitan's op-level policy): the backward reruns the layer's forward but for
    // the products it kept (the 1st, 3rd, ... as the code calls them: m.layer_products()) and the
    // attention core, whose output is kept (an unfused core rebuilds its probabilities). PyTorch's
    // recompute stops once it has rebuilt what the backward reads (torch.utils.checkpoint's early
    // stop): the last product runs, to hand its input over, its all-reduce and residual add do not.
    auto op_rebuild = [&] {
      const std::vector<LayerProduct> products = m.layer_products();
      std::size_t i = 0;
      auto product = [&](std::size_t n) {  // the next n products; whether any ran
        bool ran = false;
        for (const std::size_t end = i + n; i < end; ++i) {
          if (ModelShape::op_policy_keeps(i)) continue;
          const LayerProduct& p = products[i];
          if (p.row_parallel) linear_forward(C, static_cast<long>(p.in) / t, true);
          else linear_forward(static_cast<long>(p.out) / t, C, false);
          ran = true;
        }
        return ran;
      };
      k.memory_bytes("layernorm.forward", rep, rep * norm_fwd);
      product(m.separate_projections ? 3 : 1);
      if (!m.learned_positions) k.memory_bytes("rope.forward", q_and_k, q_and_k * rope_bytes);
      if (!single_kernel_attention(attn)) attention_core_forward();
      if (eager && single_kernel_attention(attn)) k.memory("attention.transpose", static_cast<double>(N) * Cout, 2);
      if (layout_copies) k.memory("attention.transpose", static_cast<double>(N) * Cout, 2);
      if (product(1)) tp_allreduce(act);
      bias_dropout_add_forward();
      k.memory_bytes("layernorm.forward", rep, rep * norm_fwd);
      product(m.swiglu && m.separate_projections ? 2 : 1);
      k.memory_bytes(m.swiglu ? "swiglu.forward" : "gelu.forward", static_cast<double>(N) * F,
                     static_cast<double>(N) * F * act_fwd);
      product(1);
    };

    // ---- forward
    k.out = &c.forward;
    if (!first) pipeline_gather();
    if (first) {
      k.memory("embedding.forward", static_cast<double>(N) * C, m.learned_positions ? 3 : 2);
      tp_allreduce(act, layers > 0 || !last,  // vocabulary-parallel embedding
                   Overlap{nullptr, {}, ub && layers > 0, product(N, qkv, C)});
      if (m.hidden_dropout) k.memory_random("dropout.forward", rep, rep * (2 * e + 1));
    }
    for (int l = 0; l < layers; ++l) layer_forward(last && l == layers - 1);
    if (last) {
      k.memory("layernorm.forward", rep, 2);
      head_product("linear.forward", N, V, C);
      // The loss in FP32: the logits cast up, max, exp and sum, log: ~26 bytes per logit.
      k.memory_bytes("cross_entropy.forward", static_cast<double>(N) * V, static_cast<double>(N) * V * (e + 24));
      if (t > 1) k.memory_bytes("tp.allreduce", 3.0 * N, 3.0 * N * 4);  // max, sum and target logit (FP32)
    }

    // ---- backward, input gradients (recomputation first, as the framework runs it)
    k.out = &c.backward_input;
    if (!last) pipeline_gather();
    if (last) {
      k.memory_bytes("cross_entropy.backward", static_cast<double>(N) * V, static_cast<double>(N) * V * (12 + e));
      // Megatron-LM's output layer is its own column-parallel linear, not a Transformer Engine
      // layer: its backward runs as the layers' do without userbuffers (async_bwd), userbuffers
      // or not: the input re-gathered beside the input-gradient product, the input gradient's
      // collective beside the weight-gradient product, both products in 16 bits.
      const bool async_head = plan.tp_backward_overlapped;
      if (async_head && sp) in_16_bits([&] { k.overlapped("tp.overlap.async_allgather", product(N, C, V), act); });
      head_product("linear.backward_input", N, C, V);
      tp_allreduce(act, layers > 0 || !first,
                   Overlap{async_head ? "tp.overlap.async_reducescatter" : nullptr, product(V, C, N), ub && layers > 0,
                           product(N, F, C), true});
      k.memory("layernorm.backward_input", rep, 4);
    }
    const int rebuilt = recomputed_layers(cfg.training, layers);
    for (int l = 0; l < layers; ++l) {
      if (rc == Recompute::full && l < rebuilt) layer_forward();
      if (rc == Recompute::selective) attention_core_forward();
      if (rc == Recompute::selective_op) op_rebuild();
      if (m.hidden_dropout) k.memory_bytes("dropout.backward", rep, rep * (2 * e + 1));
      linear_backward_input(F, C, true);
      k.memory_bytes(m.swiglu ? "swiglu.backward" : "gelu.backward", static_cast<double>(N) * F,
                     static_cast<double>(N) * F * act_bwd);
      input_regather(product(N, C, ffn_in));
      linear_backward_input(C, ffn_in, false);
      tp_allreduce(act, true, Overlap{column_reduce, product(ffn_in, C, N), ub, product(N, Cout, C)});
      k.memory_bytes("layernorm.backward_input", rep, rep * norm_bwd);
      if (eager) k.memory("residual.backward", rep, 3);  // the two branches' gradients summed
      if (m.hidden_dropout) k.memory_bytes("dropout.backward", rep, rep * (2 * e + 1));
      linear_backward_input(Cout, C, true);
      cp_gather();
      if (single_kernel_attention(attn)) {
        k.matmul(cudnn ? "cudnn_attention.backward" : "flash_attention.backward", Tq, T, hs, 5 * b * H);  // five products, S and P recomputed
        cp_reduce();
        cp_ring_after("cp.ring.backward", 5 * b * H, 2 * kv_gathered / plan.cp);
      } else {
        // Under context parallelism the s/cp queries' products with all s keys: dK and dV come out
        // for every key (T x hs, over the Tq queries) and are reduce-scattered to their GPUs.
        k.matmul("attention.scores", Tq, T, hs, b * H);  // dP = dO V^T
        k.matmul("attention.context", T, hs, Tq, b * H);  // dV = P^T dO
        if (m.attention_dropout) k.memory_bytes("dropout.backward", scores, scores * (2 * e + 1));
        k.memory("softmax.backward", scores, 3);
        if (attn == AttentionKernel::naive) k.memory("attention.mask", scores, 2);
        if (Tq == T) {
          k.matmul("attention.context", T, hs, T, 2 * b * H);  // dQ = dS K, dK = dS^T Q
        } else {
          k.matmul("attention.context", Tq, hs, T, b * H);  // dQ = dS K
          k.matmul("attention.context", T, hs, Tq, b * H);  // dK = dS^T Q
        }
        cp_reduce();
      }
      if (eager && single_kernel_attention(attn)) k.memory("attention.transpose", static_cast<double>(N) * Cout, 2);
      if (layout_copies) k.memory("qkv.concat", static_cast<double>(N) * qkv, 2);
      if (separate_bias) k.memory("bias.backward", static_cast<double>(N) * (qkv + F) + 2.0 * rep, 1);
      if (!m.learned_positions) k.memory_bytes("rope.backward", q_and_k, q_and_k * rope_bytes);
      input_regather(product(N, C, qkv));
      linear_backward_input(C, qkv, false);
      // The first layer's input gradient goes to the embedding, another's to the layer before's fc2.
      tp_allreduce(act, !(first && l == 0),
                   Overlap{column_reduce, product(qkv, C, N), ub && !(first && l == 0), product(N, F, C)});
      k.memory_bytes("layernorm.backward_input", rep, rep * norm_bwd);
      if (eager) k.memory("residual.backward", rep, 3);
    }

    // ---- backward, weight gradients
    k.out = &c.backward_weight;
    if (last) {
      head_product(wgrad, V, C, N);
      k.memory("layernorm.backward_weight", rep, 2);
      k.memory_bytes("commit", m.output_params() / t, m.output_params() / t * layer_accumulate);
    }
    for (int l = 0; l < layers; ++l) {
      k.matmul(wgrad, C, F, N);
      k.matmul(wgrad, ffn_in, C, N);
      k.memory("layernorm.backward_weight", rep, 2);
      k.matmul(wgrad, Cout, C, N);
      k.matmul(wgrad, qkv, C, N);
      k.memory("layernorm.backward_weight", rep, 2);
      k.memory_bytes("commit", layer_params, layer_params * layer_accumulate);
    }
    if (first) {
      k.memory("embedding.backward", static_cast<double>(N) * C, 3);
      k.memory_bytes("commit", m.embedding_params() / t, m.embedding_params() / t * accumulate);
    }
    return c;
  };

  // A middle chunk with an earlier middle chunk's layer count has that chunk's kernels (a
  // pipeline's chunks are mostly alike: built once).
  BuiltChunks out;
  const int chunks = plan.num_virtual_stages();
  out.chunk_of.resize(static_cast<std::size_t>(chunks));
  for (int vs = 0; vs < chunks; ++vs) {
    const int layers = plan.layers_per_virtual_stage[vs];
    const bool first = vs == 0, last = vs == chunks - 1;
    int same = 1;
    while (!first && !last && same < vs && plan.layers_per_virtual_stage[same] != layers) ++same;
    if (!first && !last && same < vs) {
      out.chunk_of[vs] = out.chunk_of[same];
    } else {
      out.chunk_of[vs] = static_cast<int>(out.chunks.size());
      out.chunks.push_back(build_chunk(layers, first, last));
    }
  }
  return out;
}

std::vector<KernelWork> optimizer_kernels(const Plan& plan, double params) {
  const auto& pr = plan.config.precision;
  std::vector<KernelWork> out;
  Builder k{pr.compute, 4.0, &out};
  // Under loss scaling the gradients unscaled (read and written: Megatron-LM's
  // _amp_foreach_non_finite_check_and_unscale_, the CPU engine's multiply; without it the scale is
  // 1 and nothing is done). Gradient norm (read), the update (gradient, master, moments: read and
  // written), the working copy (written and rounded), zeroing the gradients for the next step.
  if (pr.loss_scaling.mode != LossScalingMode::none) k.memory("unscale", params, 2);
  k.memory("grad_norm", params, 1);
  k.memory(plan.config.training.optimizer == Optimizer::sgd ? "sgd" : "adam", params,
           plan.config.training.optimizer == Optimizer::sgd ? 5 : 7);
  if (pr.compute != DType::fp32) k.memory("round", params, 2);
  k.memory("zero", params, 1);
  return out;
}

std::vector<KernelWork> runtime_optimizer_kernels(const Plan& plan, double params, bool emulated_low_precision) {
  std::vector<KernelWork> out = optimizer_kernels(plan, params);
  if (!emulated_low_precision) {
    // The CUDA engine scans the accumulated gradients for the numerics report (inf/NaN, largest
    // magnitude) before the norm, a read like the norm's (the CPU engine scans them as the
    // backward writes them): priced as the norm's kernel.
    Builder scan{plan.config.precision.compute, 4.0, &out};
    scan.memory("grad_norm", params, 1);
  }
  if (plan.zero() >= 1 && !plan.reduces_every_microbatch()) {
    const double grad_bytes = emulated_low_precision ? 4.0 : dtype_bytes(plan.config.precision.grad_accumulation);
    Builder copies{DType::fp32, grad_bytes, &out};
    copies.memory(kShardCopyKernel, params, 2);
  }
  return out;
}

std::vector<KernelWork> rank_update_kernels(const Plan& plan, int stage, bool emulated_low_precision) {
  return runtime_optimizer_kernels(plan, plan.shard_stage_params(stage) / (plan.zero() >= 1 ? plan.data_shards() : 1),
                                   emulated_low_precision);
}

std::vector<KernelWork> distinct_kernels(const Plan& plan, int storage) {
  std::vector<KernelWork> all;
  Builder k{DType::fp32, 0, &all};
  auto take = [&](const std::vector<KernelWork>& ws) {
    for (KernelWork w : ws) {
      w.count = 1;
      k.add(std::move(w));
    }
  };
  for (const ChunkKernels& c : chunk_kernels(plan, storage)) {
    take(c.forward);
    take(c.backward_input);
    take(c.backward_weight);
  }
  double largest_chunk = 0;
  for (int s = 0; s < plan.pp; ++s) {
    double params = 0;
    for (int j = 0; j < plan.vpp; ++j) {
      const double chunk = plan.shard_params(j * plan.pp + s);
      params += chunk;
      largest_chunk = std::max(largest_chunk, chunk);
    }
    take(optimizer_kernels(plan, params));
  }
  // ZeRO: the runtime packs a collective's buffer from the flat gradients and unpacks gathered
  // weights into them (runtime/engine/zero.h's shard layout), copies a framework with contiguous
  // shards does not make; one size suffices (a copy's time is its bytes'). Stage 3 copies each
  // unit (a block) in and out of its gather's buffer (kUnitCopyKernel), at a block's size.
  if (plan.zero() >= 1) {
    Builder copies{DType::fp32, static_cast<double>(storage), &all};
    copies.memory(kShardCopyKernel, largest_chunk, 2);
    if (plan.zero() == 3)
      copies.memory(kUnitCopyKernel, plan.shape().params_per_layer() / plan.tp * (1.0 + 1.0 / plan.data_shards()), 2);
  }
  for (KernelWork& w : all) w.count = 1;
  return all;
}

}  // namespace trainsim
