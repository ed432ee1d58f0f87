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
  // A memory-bound kernel over `elements`, touching each `passes` times (reads plus writes).
  void memory(const char* kernel, double elements, double passes) {
    if (elements <= 0) return;
    KernelWork w{kernel, dtype, {}, 0, 1};
    w.shape.elements = static_cast<long>(elements);
    w.bytes = elements * passes * storage;
    add(std::move(w));
  }
  void add(KernelWork w) {
    for (KernelWork& k : *out)
      if (k.kernel == w.kernel && k.shape == w.shape && k.dtype == w.dtype) {
        ++k.count;
        return;
      }
    out->push_back(std::move(w));
  }
};

}  // namespace

std::vector<ChunkKernels> chunk_kernels(const Plan& plan, int storage) {
  const ModelShape m = plan.shape();
  const auto& cfg = plan.config;
  const long b = plan.micro_batch_size, T = m.s, N = b * T, t = plan.tp;
  const long C = m.h, F = m.f / t, V = m.V / t, H = std::max<long>(1, m.a / t), hs = m.h / m.a;
  // The residual stream's rows on a shard: all of them, or 1/t under sequence parallelism (its
  // norms, residual adds and stored stream); the products see all N rows. A row-parallel product's
  // output is rounded as a partial sum (N rows) and again summed (the shard's rows), with its bias
  // added after the sum; a column-parallel input's gradient likewise (runtime/model/stage_model.cpp).
  const long Nl = cfg.parallelism.sequence_parallel && t > 1 ? N / t : N;
  const double reduced = t > 1 ? static_cast<double>(N * C + Nl * C) : static_cast<double>(N * C);
  const long qkv = (m.h + 2L * m.h / m.a * m.kv_heads) / t, Cout = C / t;
  const long ffn_in = m.swiglu ? 2 * F : F;  // SwiGLU's gate and up products as one wider product
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

    k.out = &c.forward;
    if (first) {
      k.memory("embedding.forward", N * C, 3);
      k.memory("round", Nl * C, round_passes);
    } else {
      k.memory("copy", Nl * C, 2);  // the received activation into the stash
      k.memory("round", Nl * C, round_passes);
    }
    for (int l = 0; l < layers; ++l) {
      k.memory("layernorm.forward", Nl * C, 2);
      k.matmul("linear.forward", N, qkv, C);
      k.matmul("attention.forward", T, T, hs, 2 * b * H);
      k.matmul("linear.forward", N, C, Cout);
      if (t > 1) k.memory("residual", Nl * C, 3);  // the bias, after the sum
      k.memory("residual", Nl * C, 3);
      k.memory("layernorm.forward", Nl * C, 2);
      k.matmul("linear.forward", N, ffn_in, C);
      k.memory("gelu.forward", N * F, 2);
      k.matmul("linear.forward", N, C, F);
      if (t > 1) k.memory("residual", Nl * C, 3);
      k.memory("residual", Nl * C, 3);
      // ln1, x1, ln2, out (the stream's rows); qkv, att, fc, gelu; the two projections' outputs;
      // attention's scores and probabilities
      k.memory("round", 4.0 * Nl * C + N * (qkv + Cout + ffn_in + F) + 2 * reduced + 2.0 * b * H * T * T, round_passes);
    }
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
    for (int l = 0; l < layers; ++l) {
      k.matmul("linear.backward_input", N, F, C);
      k.memory("gelu.backward", N * F, 3);
      k.matmul("linear.backward_input", N, C, ffn_in);
      k.memory("layernorm.backward_input", Nl * C, 4);
      k.matmul("linear.backward_input", N, Cout, C);
      k.matmul("attention.backward", T, T, hs, 4 * b * H);
      k.matmul("linear.backward_input", N, C, qkv);
      k.memory("layernorm.backward_input", Nl * C, 4);
      // dgelu, dfc, datt, dqkv; dln2 and dln1 (as the projections' outputs); dx1, dx0 (the
      // stream's rows); attention's two gradients of (T, T)
      k.memory("round", N * (F + ffn_in + Cout + qkv) + 2 * reduced + 2.0 * Nl * C + 2.0 * b * H * T * T,
               round_passes);
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
  }
  return out;
}

std::vector<KernelWork> optimizer_kernels(const Plan& plan, double params) {
  const auto& pr = plan.config.precision;
  std::vector<KernelWork> out;
  Builder k{pr.compute, 4.0, &out};
  // Gradient norm (read), the update (gradient, master, moments: read and written), the
  // working copy (written and rounded), zeroing the gradients for the next step.
  k.memory("grad_norm", params, 1);
  k.memory(plan.config.training.optimizer == Optimizer::sgd ? "sgd" : "adam", params,
           plan.config.training.optimizer == Optimizer::sgd ? 5 : 7);
  if (pr.compute != DType::fp32) k.memory("round", params, 2);
  k.memory("zero", params, 1);
  return out;
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
  for (int s = 0; s < plan.pp; ++s) {
    double params = 0;
    for (int j = 0; j < plan.vpp; ++j) params += plan.shard_params(j * plan.pp + s);
    take(optimizer_kernels(plan, params));
  }
  for (KernelWork& w : all) w.count = 1;
  return all;
}

}  // namespace trainsim
