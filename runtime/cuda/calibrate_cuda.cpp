// `trainsim calibrate --backend cuda` (calibrate_cuda.h): runtime/calibrate/calibrate.cpp's
// method on the device. Each kernel of the inventory is timed through the launches the CUDA
// stage model (stage_model_cuda.cpp) or the CUDA engine's optimizer step (cuda_engine.cpp)
// make for that piece of work, so those files are the reference for every launch here.
#include "runtime/cuda/calibrate_cuda.h"

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <deque>
#include <exception>
#include <functional>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/kernel_inventory.h"
#include "core/median.h"
#include "kernels/device_buffer.h"
#include "kernels/device_info.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "runtime/cuda/stage_model_cuda.h"
#include "runtime/cuda/stream_ops.h"
#include "runtime/engine/world.h"
#include "runtime/cuda/cuda_engine.h"
#include "runtime/cuda/optimizer_cuda.h"

namespace trainsim::runtime::cuda {

namespace k = ::trainsim::cuda;  // the kernels (not this namespace)
using k::DeviceBuffer;

bool stored_by_kernels(DType t) { return t == DType::fp32 || t == DType::fp16 || t == DType::bf16; }

namespace {

// The formats the plan asks the kernels to store, refused before any device work.
void check_formats(const Plan& plan) {
  const auto& pr = plan.config.precision;
  for (const auto& [field, t] : {std::pair{"compute", pr.compute}, std::pair{"grad_accumulation", pr.grad_accumulation},
                                 std::pair{"master_weights", pr.master_weights}})
    if (!stored_by_kernels(t))
      throw std::invalid_argument(fmt::format("calibrate --backend cuda: precision.{} is {}; the CUDA kernels store "
                                              "fp32, fp16 or bf16",
                                              field, dtype_name(t)));
}

CudaDevice find_device(int device) {
  const CudaInventory inventory = query_cuda_devices();
  if (inventory.devices.empty()) throw std::runtime_error("calibrate --backend cuda needs a GPU: " + inventory.error);
  for (const CudaDevice& d : inventory.devices)
    if (d.index == device) return d;
  throw std::runtime_error(fmt::format("calibrate --backend cuda: there is no CUDA device {} ({} found)", device,
                                       inventory.devices.size()));
}

// Runs `body` on a new host thread with `rank`'s context current, so the caller's thread keeps
// its own; rethrows what it throws.
template <class F>
void on_rank_thread(const SmPartition& partition, int rank, F&& body) {
  on_own_thread([&] {
    partition.make_current(rank);
    body();
  });
}

const void* at(const void* base, std::size_t i, std::size_t bytes) {
  return static_cast<const char*>(base) + i * bytes;
}
void* at(void* base, std::size_t i, std::size_t bytes) { return static_cast<char*>(base) + i * bytes; }

constexpr double kEventResolutionSeconds = 0.5e-6;

// The ranks the run places on the GPU: every tensor-parallel shard is one (World::of), with its
// own green context. (Counting the schedule's ranks alone, a tp 2 plan was calibrated on all 132
// SMs of an H100, then stretched x2 for the shards thought to share them: +54% on the step.)
int placed_ranks(const Plan& plan) { return World::of(plan).size(); }

// Times one kernel of the inventory with the launches the CUDA backend makes for it, on one
// stream (rank 0's compute stream; its context current when created and used).
class KernelTimer {
 public:
  KernelTimer(const RuntimePlan& plan, StreamHandle stream) : plan_(plan), stream_(stream), gemm_(stream), rng_(12345) {
    const ModelDims& d = plan.dims;
    const auto& pr = plan.plan.config.precision;
    B_ = plan.plan.micro_batch_size;
    T_ = d.seq_length;
    C_ = d.hidden_size;
    V_ = d.vocab_size;
    dt_ = pr.compute;
    gacc_ = pr.grad_accumulation;
    master_ = pr.master_weights;
    eb_ = static_cast<std::size_t>(dtype_bytes(dt_));
    // CudaStageModel's fast_grads: weight gradients go straight into the fp32 accumulation buffer.
    fast_grads_ = dt_ == DType::fp32 && gacc_ == DType::fp32;
  }

  // A call that queues the backend's launches for `w` once, on device buffers of fresh random
  // values owned by this timer; empty for work the device does not do (`round`, and `commit`
  // when products accumulate straight into the fp32 buffer).
  std::function<void()> launcher(const KernelWork& w) {
    const std::string& kn = w.kernel;
    const KernelShape& s = w.shape;
    const StreamHandle S = stream_;
    const DType dt = dt_;
    if (kn == "linear.forward") {  // y (m, n) = x (m, k) w^T (n, k) + b
      const int m = static_cast<int>(s.m), n = static_cast<int>(s.n), kk = static_cast<int>(s.k);
      // The head's logits product has no bias (stage_model_cuda.cpp forward).
      const bool bias = !(s.n == V_ && s.k == C_);
      void* x = random(s.m * s.k, dt);
      void* wt = random(s.n * s.k, dt);
      const void* b = bias ? random(s.n, dt) : nullptr;
      void* y = output(s.m * s.n, dt);
      return [=, this] { k::linear_forward(gemm_, y, x, wt, b, m, kk, n, dt); };
    }
    if (kn == "linear.backward_input") {  // dx (N, in) = dy (N, out) W (out, in): m = N, n = in, k = out
      const int m = static_cast<int>(s.m), n = static_cast<int>(s.n), kk = static_cast<int>(s.k);
      void* dy = random(s.m * s.k, dt);
      void* wt = random(s.k * s.n, dt);
      void* dx = output(s.m * s.n, dt);
      return [=, this] { k::linear_backward_input(gemm_, dx, dy, wt, m, n, kk, dt); };
    }
    if (kn == "linear.backward_weight") {  // dW (out, in) = dy^T x: m = out, n = in, k = N
      // CudaStageModel::Impl::wgrad_linear without its commit (the inventory's `commit`).
      const int out = static_cast<int>(s.m), in = static_cast<int>(s.n), rows = static_cast<int>(s.k);
      const bool bias = !(s.m == V_ && s.n == C_);  // the head's product has none
      void* dy = random(s.k * s.m, dt);
      void* x = random(s.k * s.n, dt);
      const bool fast = fast_grads_;
      void* dw = fast ? random(s.m * s.n, DType::fp32) : output(s.m * s.n, DType::fp32);
      auto* db = static_cast<float*>(bias ? random(s.m, DType::fp32) : nullptr);
      return [=, this] {
        k::linear_backward_weight(gemm_, dw, DType::fp32, dy, x, rows, in, out, dt, fast);
        if (!bias) return;
        if (!fast) fill_zero(db, static_cast<std::size_t>(out) * sizeof(float), S);
        k::bias_backward(db, dy, rows, out, dt, S);
      };
    }
    if (kn == "attention.forward" || kn == "attention.backward") return attention(w);

    const std::size_t n = static_cast<std::size_t>(s.elements);
    const int rows = static_cast<int>(n / static_cast<std::size_t>(C_));
    const int C = C_;
    if (kn == "layernorm.forward" || kn == "layernorm.backward_input" || kn == "layernorm.backward_weight") {
      void* x = random(n, dt);
      void* g = random(C_, dt);
      void* b = random(C_, dt);
      void* out = output(n, dt);
      auto* mean = static_cast<float*>(output(rows, DType::fp32));
      auto* rstd = static_cast<float*>(output(rows, DType::fp32));
      k::layernorm_forward(out, mean, rstd, x, g, b, rows, C, dt, S);  // the statistics the backward reads
      if (kn == "layernorm.forward") return [=] { k::layernorm_forward(out, mean, rstd, x, g, b, rows, C, dt, S); };
      void* dout = random(n, dt);
      if (kn == "layernorm.backward_input") {
        void* dres = random(n, dt);  // a block's residual gradient, added in
        return [=] { k::layernorm_backward_input(out, dout, x, mean, rstd, g, dres, rows, C, dt, S); };
      }
      // CudaStageModel::Impl::wgrad_layernorm without its commits.
      const bool fast = fast_grads_;
      auto* dg = static_cast<float*>(random(C_, DType::fp32));
      auto* db = static_cast<float*>(random(C_, DType::fp32));
      return [=] {
        if (!fast) {
          fill_zero(dg, static_cast<std::size_t>(C) * sizeof(float), S);
          fill_zero(db, static_cast<std::size_t>(C) * sizeof(float), S);
        }
        k::layernorm_backward_weight(dg, db, dout, x, mean, rstd, rows, C, dt, S);
      };
    }
    if (kn == "gelu.forward") {
      void* x = random(n, dt);
      void* y = output(n, dt);
      return [=] { k::gelu_forward(y, x, n, dt, S); };
    }
    if (kn == "gelu.backward") {
      void* x = random(n, dt);
      void* dy = random(n, dt);
      void* dx = output(n, dt);
      return [=] { k::gelu_backward(dx, x, dy, n, dt, S); };
    }
    if (kn == "residual") {
      void* a = random(n, dt);
      void* b = random(n, dt);
      void* y = output(n, dt);
      return [=] { k::residual_add(y, a, b, n, dt, S); };
    }
    // A received activation or gradient into the stage's own buffer; a ZeRO buffer's section into
    // the flat one; a ZeRO-3 unit in and out of its gather's buffer (as one copy of its elements).
    if (kn == "copy" || kn == kShardCopyKernel || kn == kUnitCopyKernel) {
      void* a = random(n, dt);
      void* y = output(n, dt);
      const std::size_t bytes = n * eb_;
      return [=] { copy_device_to_device(y, a, bytes, S); };
    }
    if (kn == "round") return {};
    if (kn == "embedding.forward" || kn == "embedding.backward") {
      const int b = std::max(1, rows / T_), T = T_, V = V_;
      const std::vector<std::int32_t>& host = tokens(static_cast<std::size_t>(b) * T);
      auto* ids = static_cast<std::int32_t*>(device_bytes(host.size() * sizeof(std::int32_t)));
      copy_host_to_device(ids, host.data(), host.size() * sizeof(std::int32_t), S);
      if (kn == "embedding.forward") {
        void* wte = random(static_cast<std::size_t>(V) * C, dt);
        void* wpe = random(static_cast<std::size_t>(T) * C, dt);
        void* out = output(n, dt);
        const std::int32_t* from = host.data();
        const std::size_t bytes = host.size() * sizeof(std::int32_t);
        return [=] {
          copy_host_to_device(ids, from, bytes, S);  // the stage model uploads each micro-batch's tokens
          k::embedding_forward(out, ids, wte, wpe, b, T, C, V, dt, S);
        };
      }
      // CudaStageModel::Impl::wgrad_embedding without its commits.
      void* dout = random(n, dt);
      const bool fast = fast_grads_;
      auto* dwte = static_cast<float*>(random(static_cast<std::size_t>(V) * C, DType::fp32));
      auto* dwpe = static_cast<float*>(random(static_cast<std::size_t>(T) * C, DType::fp32));
      return [=] {
        if (!fast) {
          fill_zero(dwte, static_cast<std::size_t>(V) * C * sizeof(float), S);
          fill_zero(dwpe, static_cast<std::size_t>(T) * C * sizeof(float), S);
        }
        k::embedding_backward(dwte, dwpe, dout, ids, b, T, C, V, dt, S);
      };
    }
    if (kn == "cross_entropy.forward" || kn == "cross_entropy.backward") {
      const int rows_v = static_cast<int>(n / static_cast<std::size_t>(V_)), V = V_;
      const std::vector<std::int32_t>& host = tokens(static_cast<std::size_t>(rows_v));
      auto* targets = static_cast<std::int32_t*>(device_bytes(host.size() * sizeof(std::int32_t)));
      copy_host_to_device(targets, host.data(), host.size() * sizeof(std::int32_t), S);
      void* logits = random(n, dt);
      auto* losses = static_cast<float*>(output(rows_v, DType::fp32));
      auto* lse = static_cast<float*>(output(rows_v, DType::fp32));
      k::cross_entropy_forward(losses, lse, logits, targets, rows_v, V, dt, S);  // what the backward reads
      if (kn == "cross_entropy.forward") {
        auto* loss_sum = static_cast<double*>(device_bytes(sizeof(double)));
        auto* scratch = static_cast<double*>(device_bytes(k::kReductionScratchDoubles * sizeof(double)));
        const std::int32_t* from = host.data();
        const std::size_t bytes = host.size() * sizeof(std::int32_t);
        return [=] {
          copy_host_to_device(targets, from, bytes, S);  // the stage model uploads each micro-batch's targets
          k::cross_entropy_forward(losses, lse, logits, targets, rows_v, V, dt, S);
          k::sum(loss_sum, losses, static_cast<std::size_t>(rows_v), scratch, false, S);
        };
      }
      void* dlogits = output(n, dt);
      const float scale = 1.0f / static_cast<float>(rows_v);
      return [=] { k::cross_entropy_backward(dlogits, logits, lse, targets, rows_v, V, scale, dt, S); };
    }
    if (kn == "commit") {  // CudaStageModel::Impl::commit: a micro-batch's weight gradients added in
      if (fast_grads_) return {};
      const DType gacc = gacc_;
      auto* produced = static_cast<float*>(random(n, DType::fp32));
      void* acc = random(n, gacc);
      if (dt == DType::fp32) return [=] { k::accumulate(acc, gacc, produced, DType::fp32, n, S); };
      void* rounded = output(n, dt);
      return [=] {
        k::cast(rounded, dt, produced, DType::fp32, n, S);
        k::accumulate(acc, gacc, rounded, dt, n, S);
      };
    }
    if (kn == "unscale") {  // the optimizer's unscale and inf/NaN check, in the accumulation format
      const DType gacc = gacc_;
      void* g = random(n, gacc);
      auto* found = static_cast<int*>(device_bytes(sizeof(int)));
      return [=] { k::unscale_and_check(g, n, 1.0f, found, gacc, S); };
    }
    if (kn == "grad_norm") {
      const DType gacc = gacc_;
      void* g = random(n, gacc);
      auto* sumsq = static_cast<double*>(device_bytes(sizeof(double)));
      auto* scratch = static_cast<double*>(device_bytes(k::kReductionScratchDoubles * sizeof(double)));
      return [=] { k::squared_norm(sumsq, g, n, gacc, scratch, false, S); };
    }
    if (kn == "adam" || kn == "sgd") return optimizer(n);
    if (kn == "zero") {  // CudaStageModel::zero_gradients
      const std::size_t bytes = n * static_cast<std::size_t>(dtype_bytes(gacc_));
      void* g = output(n, gacc_);
      return [=] { fill_zero(g, bytes, S); };
    }
    throw std::logic_error("calibrate --backend cuda: no device launches to time for kernel " + kn);
  }

 private:
  // Device memory, uninitialised: what a launch only writes.
  void* device_bytes(std::size_t bytes) { return buffers_.emplace_back(std::max<std::size_t>(bytes, 1)).data(); }
  void* output(std::size_t n, DType dt) { return device_bytes(n * static_cast<std::size_t>(dtype_bytes(dt))); }
  // `n` fresh normal values stored in `dt`: what a launch reads.
  void* random(std::size_t n, DType dt, float scale = 1.0f, bool squared = false) {
    void* p = output(n, dt);
    k::fill_normal(p, dt, n, scale, next_seed_++, squared, stream_);
    return p;
  }
  // Token ids (or targets) in [0, V), kept on the host for launchers that upload them.
  const std::vector<std::int32_t>& tokens(std::size_t n) {
    std::uniform_int_distribution<std::int32_t> pick(0, V_ - 1);
    std::vector<std::int32_t>& t = host_ids_.emplace_back(n);
    for (auto& id : t) id = pick(rng_);
    return t;
  }

  // Attention's products and causal softmax for the whole micro-batch, as
  // CudaStageModel::Impl::attention_forward / attention_backward launch them. The inventory
  // counts its products per head and sample: 2 forward (QK^T, AV), 4 backward.
  std::function<void()> attention(const KernelWork& w) {
    const bool forward = w.kernel == "attention.forward";
    const int B = B_, T = T_, H = static_cast<int>(w.shape.batch / (forward ? 2 : 4) / B_);
    const int hs = static_cast<int>(w.shape.k), C = H * hs, C3 = 3 * C;
    const long long TT = static_cast<long long>(T) * T;
    const std::size_t eb = eb_, c = static_cast<std::size_t>(C), rows = static_cast<std::size_t>(B) * T;
    const std::size_t scores = static_cast<std::size_t>(B) * H * static_cast<std::size_t>(TT);
    const DType dt = dt_;
    const StreamHandle S = stream_;
    k::GemmContext* const gemm = &gemm_;
    void* qkv = random(rows * 3 * c, dt);
    void* scratch = output(scores, dt);
    if (forward) {
      void* probs = output(scores, dt);
      void* att = output(rows * c, dt);
      const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
      return [=] {
        for (int b = 0; b < B; ++b) {
          const void* q = at(qkv, static_cast<std::size_t>(b) * T * C3, eb);
          void* sc = at(scratch, static_cast<std::size_t>(b) * H * TT, eb);
          k::gemm_strided_batched(*gemm, false, true, T, T, hs, scale, q, C3, hs, at(q, c, eb), C3, hs, 0.0f, sc, T,
                                  TT, H, dt, dt);
        }
        k::causal_softmax_forward(probs, scratch, B * H, T, 1.0f, dt, S);
        for (int b = 0; b < B; ++b) {
          const void* q = at(qkv, static_cast<std::size_t>(b) * T * C3, eb);
          const void* p = at(probs, static_cast<std::size_t>(b) * H * TT, eb);
          k::gemm_strided_batched(*gemm, false, false, T, hs, T, 1.0f, p, T, TT, at(q, 2 * c, eb), C3, hs, 0.0f,
                                  at(att, static_cast<std::size_t>(b) * T * C, eb), C, hs, H, dt, dt);
        }
      };
    }
    void* probs = random(scores, dt);
    void* dout = random(rows * c, dt);
    void* dqkv = output(rows * 3 * c, dt);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    return [=] {
      for (int b = 0; b < B; ++b) {
        const void* q = at(qkv, static_cast<std::size_t>(b) * T * C3, eb);
        const void* dy = at(dout, static_cast<std::size_t>(b) * T * C, eb);
        void* dp = at(scratch, static_cast<std::size_t>(b) * H * TT, eb);
        k::gemm_strided_batched(*gemm, false, true, T, T, hs, 1.0f, dy, C, hs, at(q, 2 * c, eb), C3, hs, 0.0f, dp, T,
                                TT, H, dt, dt);
      }
      k::causal_softmax_backward(scratch, probs, scratch, B * H, T, scale, dt, S);
      for (int b = 0; b < B; ++b) {
        const void* q = at(qkv, static_cast<std::size_t>(b) * T * C3, eb);
        const void* p = at(probs, static_cast<std::size_t>(b) * H * TT, eb);
        const void* ds = at(scratch, static_cast<std::size_t>(b) * H * TT, eb);
        const void* dy = at(dout, static_cast<std::size_t>(b) * T * C, eb);
        void* dq = at(dqkv, static_cast<std::size_t>(b) * T * C3, eb);
        k::gemm_strided_batched(*gemm, false, false, T, hs, T, 1.0f, ds, T, TT, at(q, c, eb), C3, hs, 0.0f, dq, C3, hs,
                                H, dt, dt);
        k::gemm_strided_batched(*gemm, true, false, T, hs, T, 1.0f, ds, T, TT, q, C3, hs, 0.0f, at(dq, c, eb), C3, hs,
                                H, dt, dt);
        k::gemm_strided_batched(*gemm, true, false, T, hs, T, 1.0f, p, T, TT, dy, C, hs, 0.0f, at(dq, 2 * c, eb), C3,
                                hs, H, dt, dt);
      }
    };
  }

  // The CUDA engine's update of one chunk: Adam/AdamW or SGD on the fp32 master weights, the
  // master rounded to its format when that is not fp32, the working copy refreshed in the
  // compute format (cuda_engine.cpp optimizer_step and round_master).
  std::function<void()> optimizer(std::size_t n) {
    const OptimizerSettings os = optimizer_settings(plan_.plan.config);
    const DType dt = dt_, gacc = gacc_, master_format = master_;
    const StreamHandle S = stream_;
    auto* master = static_cast<float*>(random(n, DType::fp32, 0.02f));
    void* grads = random(n, gacc, 1e-3f);
    const std::vector<std::uint8_t> everywhere(n, 1);
    auto* mask = static_cast<std::uint8_t*>(device_bytes(n));
    copy_host_to_device(mask, everywhere.data(), n, S);
    synchronize(S);
    void* rounding = master_format == DType::fp32 ? nullptr : output(n, master_format);
    void* working = dt == DType::fp32 ? nullptr : output(n, dt);
    auto refresh = [=] {
      if (rounding) {
        k::cast(rounding, master_format, master, DType::fp32, n, S);
        k::cast(master, DType::fp32, rounding, master_format, n, S);
      }
      if (working) k::cast(working, dt, master, DType::fp32, n, S);
    };
    float* m = nullptr;
    float* v = nullptr;
    if (os.kind != Optimizer::sgd) {
      m = static_cast<float*>(random(n, DType::fp32, 1e-3f));
      v = static_cast<float*>(random(n, DType::fp32, 1e-3f, true));  // a second moment is not negative
    }
    return [=] {
      update_chunk(os, master, m, v, grads, gacc, mask, n, 1, 1.0f, S);
      refresh();
    };
  }

  const RuntimePlan& plan_;
  StreamHandle stream_;
  k::GemmContext gemm_;
  std::mt19937 rng_;               // token ids, drawn on the host (kept there for uploads)
  std::uint64_t next_seed_ = 12345;  // device-drawn operands (kernels.h fill_normal): one seed each
  int B_, T_, C_, V_;
  DType dt_, gacc_, master_;
  std::size_t eb_;
  bool fast_grads_;
  std::deque<DeviceBuffer> buffers_;  // stable addresses: launchers keep pointers
  std::deque<std::vector<std::int32_t>> host_ids_;
};

// A middle stage of the CUDA backend's blocks on one rank's compute stream, with an input and an
// output gradient of fresh random values, timed with events on that stream.
struct StageBench {
  CudaStageModel model;
  DeviceBuffer in, out, grad_out, grad_in;
  k::EventTimer forward_timer, backward_timer, weight_timer;
  // `split`: the backward runs as the zero-bubble schedules run it, input pass then weight pass,
  // each timed (as the CPU backend's calibration does).
  bool split = false;

  StageBench(const StageSpec& spec, StreamHandle stream, std::uint32_t seed, bool split_backward)
      : model(spec, stream), split(split_backward) {
    // A tensor-parallel shard is timed alone: its work, without its group's collectives.
    model.set_tensor_parallel_group(&TimingOnlyDeviceGroup::instance());
    model.randomize_for_timing(seed);
    model.reserve(1, split ? 0 : 1, split ? 1 : 0, 0);  // no allocation inside a timed forward or backward
    const std::size_t act = model.activation_elements();
    const DType dt = model.activation_format();
    const std::size_t bytes = act * static_cast<std::size_t>(dtype_bytes(dt));
    in = DeviceBuffer(bytes);
    out = DeviceBuffer(bytes);
    grad_out = DeviceBuffer(bytes);
    grad_in = DeviceBuffer(bytes);
    k::fill_normal(in.data(), dt, act, 1.0f, 2 * std::uint64_t{seed}, false, stream);
    k::fill_normal(grad_out.data(), dt, act, 1e-3f, 2 * std::uint64_t{seed} + 1, false, stream);
  }
  // Device seconds of one forward and one backward of micro-batch 0 (a split one's two passes apart).
  StageSeconds time() {
    const StreamHandle s = model.stream();
    forward_timer.start(s);
    model.forward(0, nullptr, nullptr, in.data(), out.data());
    forward_timer.stop(s);
    backward_timer.start(s);
    if (split) {
      model.backward_input(0, grad_out.data(), 1.0f, grad_in.data());
      backward_timer.stop(s);
      weight_timer.start(s);
      model.backward_weight(0);
      weight_timer.stop(s);
    } else {
      model.backward_begin(0, grad_out.data(), 1.0f);
      for (int u = 0; u < model.backward_units(); ++u) model.backward_unit(0);
      model.backward_end(0, grad_in.data());
      backward_timer.stop(s);
    }
    model.zero_gradients();
    return {forward_timer.elapsed_seconds(), backward_timer.elapsed_seconds(),
            split ? weight_timer.elapsed_seconds() : 0.0};
  }
};

// A rank's optimizer update as the engine runs it (runtime_optimizer_kernels of the rank's shard:
// its stage's parameters, split by ZeRO), on fresh random buffers on the rank's stream, timed with
// events in the rank's context. Create and time it on the rank's thread.
struct UpdateBench {
  KernelTimer timer;
  std::vector<std::function<void()>> launches;
  k::EventTimer events;
  StreamHandle stream;

  UpdateBench(const RuntimePlan& plan, int world_rank, StreamHandle s) : timer(plan, s), stream(s) {
    for (const KernelWork& w : rank_update_kernels(plan.plan, World::of(plan.plan).coord(world_rank).pp, false))
      if (std::function<void()> call = timer.launcher(w))
        for (int c = 0; c < w.count; ++c) launches.push_back(call);
    time();  // first launches: not a sample
  }
  double time() {
    events.start(stream);
    for (const auto& launch : launches) launch();
    events.stop(stream);
    return events.elapsed_seconds();
  }
};

}  // namespace

namespace {

// The device's side of calibration: the backend's launches on rank 0's compute stream, timed with
// CUDA events, and a stage of its blocks on every rank's streams.
class CudaClock final : public KernelClock {
 public:
  CudaClock(const RuntimePlan& plan, const std::vector<KernelWork>& kernels, const CudaCalibrateOptions& cuda)
      : partition_(placed_ranks(plan.plan), cuda.sm_sharing, cuda.device) {
    // The kernels' scratch comes from the default pool, kept warm by the run (cuda_engine.cpp):
    // so here too, or each launch that takes scratch is timed with a driver allocation.
    k::keep_default_pool_memory(cuda.device);
    // A middle stage (no embedding, no head) of a rank's blocks at the plan's shapes, one per
    // rank.
    const StageSpec spec = middle_stage_spec(plan, KernelCalibrator::compose_layers(plan.plan));
    const bool split = plan.plan.config.parallelism.schedule == ScheduleKind::zb_h1;
    on_timing_thread([&] {
      const StreamHandle stream = partition_.streams(0).compute;
      timer_ = std::make_unique<KernelTimer>(plan, stream);
      events_ = std::make_unique<k::EventTimer>();
      for (const KernelWork& w : kernels) calls_.push_back(timer_->launcher(w));
      for (const auto& c : calls_)  // warm-up: cuBLAS heuristics, first launches
        if (c) c();
      stages_.push_back(std::make_unique<StageBench>(spec, stream, 7, split));
      stages_[0]->time();
      if (partition_.ranks() > 1) updates_.push_back(std::make_unique<UpdateBench>(plan, 0, stream));
    });
    for (int r = 1; r < partition_.ranks(); ++r)
      on_rank_thread(partition_, r, [&] {
        stages_.push_back(std::make_unique<StageBench>(spec, partition_.streams(r).compute, 7, split));
        updates_.push_back(std::make_unique<UpdateBench>(plan, r, partition_.streams(r).compute));
      });
  }

  std::string placement() const override { return partition_.describe(); }

  void on_timing_thread(const std::function<void()>& body) override { on_rank_thread(partition_, 0, body); }

  double time_kernel(std::size_t i) override {
    const auto& call = calls_[i];
    if (!call) return 0;
    const StreamHandle stream = partition_.streams(0).compute;
    call();  // untimed: its operands in L2, as a kernel finds what the one before it wrote
    events_->start(stream);
    call();
    events_->stop(stream);
    // Events resolve to about half a microsecond (cudaEventElapsedTime): a launch that reads 0
    // (a tiny kernel at a test's shapes, seen on an H100) took at most that, and a profile cannot
    // hold the infinite rate a 0 would give.
    return std::max(events_->elapsed_seconds(), kEventResolutionSeconds);
  }

  StageSeconds time_stage() override { return stages_[0]->time(); }
  int stage_ranks() const override { return static_cast<int>(stages_.size()); }

  std::vector<double> time_stages_together() override {
    return on_every_rank_at_once([&](int r) { return stages_[static_cast<std::size_t>(r)]->time().total(); });
  }

  UpdateSeconds time_updates_together() override {
    UpdateSeconds out;
    out.together = on_every_rank_at_once([&](int r) { return updates_[static_cast<std::size_t>(r)]->time(); });
    on_timing_thread([&] { out.alone = updates_[0]->time(); });
    return out;
  }

 private:
  // Every rank's thread, its context current, runs `seconds(rank)` once the last of them is
  // ready; their results per rank, or the first exception rethrown once all have ended.
  std::vector<double> on_every_rank_at_once(const std::function<double(int)>& seconds) {
    const int n = partition_.ranks();
    std::vector<double> out(static_cast<std::size_t>(n));
    std::barrier start(n);
    std::vector<std::exception_ptr> failed(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        const auto ru = static_cast<std::size_t>(r);
        bool arrived = false;
        try {
          partition_.make_current(r);
          arrived = true;
          start.arrive_and_wait();
          out[ru] = seconds(r);
        } catch (...) {
          failed[ru] = std::current_exception();
          if (!arrived) start.arrive_and_drop();
        }
      });
    for (auto& t : threads) t.join();
    for (const auto& e : failed)
      if (e) std::rethrow_exception(e);
    return out;
  }

  // Destroyed after everything below, whose streams and contexts it owns.
  SmPartition partition_;
  std::unique_ptr<KernelTimer> timer_;     // on rank 0's compute stream
  std::unique_ptr<k::EventTimer> events_;  // in rank 0's context
  std::vector<std::function<void()>> calls_;  // empty: not done on the device (0 seconds)
  std::vector<std::unique_ptr<StageBench>> stages_;  // [rank], each on its rank's compute stream
  std::vector<std::unique_ptr<UpdateBench>> updates_;  // [rank], likewise
};

// The plan, checked before any device work: its formats, and a device to time on.
const RuntimePlan& checked(const RuntimePlan& plan, const CudaCalibrateOptions& cuda) {
  check_formats(plan.plan);
  find_device(cuda.device);
  return plan;
}

}  // namespace

CudaKernelCalibrator::CudaKernelCalibrator(const RuntimePlan& plan, const CalibrateOptions& options,
                                           const CudaCalibrateOptions& cuda)
    // The CUDA backend stores activations in the compute format (compute_model.cpp prices with
    // the same storage when the profile is not emulated).
    : KernelCalibrator(checked(plan, cuda), options, distinct_kernels(plan.plan, plan.plan.activation_bytes()),
                       plan.plan.activation_bytes(),
                       [cuda](const RuntimePlan& p, const CalibrateOptions&, const std::vector<KernelWork>& kernels) {
                         return std::make_unique<CudaClock>(p, kernels, cuda);
                       }) {}

HardwareProfile describe_cuda_profile(const RuntimePlan& plan, const std::string& name,
                                      const CudaCalibrateOptions& cuda) {
  const CudaDevice gpu = find_device(cuda.device);
  const int ranks = placed_ranks(plan.plan);
  const SmPartition placement(ranks, cuda.sm_sharing, cuda.device);
  HardwareProfile p;
  p.name = name;
  p.backend = "cuda";
  p.device = fmt::format("{}, {} SMs; {}", gpu.name, gpu.multiprocessors, placement.describe());
  p.measured = now_iso();
  p.scenario = plan.plan.source;
  p.emulated_low_precision = false;
  p.ranks_per_node = ranks;
  // The single-GPU world's copies and reductions are kernels in the rank's own context, on its SMs
  // (green contexts) or on every SM (shared): beside them the rank's products wait. On the H100 a
  // data-parallel backward ran 7% longer with its gradient reduction overlapped than without, about
  // the reduction's own time (docs/cuda-backend.md, "A fourth GPU session").
  p.collectives_take_rank_core = true;
  p.memory_gib = gpu.memory_gib / ranks;
  return p;
}

HardwareProfile calibrate_cuda(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options,
                               const CudaCalibrateOptions& cuda, CommBenchResult* comm_table) {
  check_formats(plan.plan);
  CalibrateOptions o = options;
  o.placement = cuda;
  return calibrate_profile(cuda_backend(), plan, name, o, comm_table);
}

}  // namespace trainsim::runtime::cuda
