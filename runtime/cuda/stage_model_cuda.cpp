// The CUDA stage model (stage_model_cuda.h). Host code only: it owns device buffers and calls
// the launchers of kernels/kernels.h and kernels/gemm.h in the order
// runtime/model/stage_model.cpp calls layers.h, step by step, so that file is the reference for
// every line here (the same names: stash, backward, units, commit, wgrad_*, and for a
// tensor-parallel shard reduce_rows, gather_rows, row_parallel, column_parallel_input_grad,
// flush_norms). The stash layout is stage_layout.h's, shared with it.
//
// Storage: every tensor the CPU model rounds to the compute format (its finish() calls) is a
// device buffer in that format, written by the kernel or product that makes it (one rounding of
// the FP32 result: kernels.h and gemm.h contracts). Attention follows kernels.h's split of the
// 1/sqrt(hs) scale: alpha of the scores product in the forward (softmax scale 1), and the
// softmax backward's `scale` in the backward, which is where layers.h applies it. A shard keeps
// its LOCAL token and target ids on the device (kernels.h: id - vocab0, or -1), so the whole
// model's embedding and cross-entropy gradient kernels serve it unchanged.
#include "runtime/cuda/stage_model_cuda.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/device_buffer.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "runtime/cuda/stream_ops.h"
#include "runtime/model/micro_batch_slots.h"
#include "runtime/model/stage_layout.h"

namespace trainsim::runtime::cuda {

namespace k = ::trainsim::cuda;  // the kernels (not this namespace)
using k::DeviceBuffer;

namespace {

// The StageModel checks, then the formats the kernels store.
const StageSpec& checked(const StageSpec& s) {
  for (DType t : {s.compute, s.grad_accumulation})
    if (!(t == DType::fp32 || t == DType::fp16 || t == DType::bf16))
      throw std::invalid_argument(std::string("CudaStageModel: compute and grad_accumulation must be fp32, fp16 or "
                                              "bf16 (the formats the CUDA kernels store), got compute ") +
                                  std::string(dtype_name(s.compute)) + ", grad_accumulation " +
                                  std::string(dtype_name(s.grad_accumulation)));
  if (s.context_parallel_size > 1)
    throw std::invalid_argument("CudaStageModel: context parallelism (context_parallel_size " +
                                std::to_string(s.context_parallel_size) +
                                ") is not executed on the GPU yet: its attention has no gathered keys");
  return s;
}

// Element i of a buffer of `bytes`-sized elements.
void* at(void* base, std::size_t i, std::size_t bytes) { return static_cast<char*>(base) + i * bytes; }
const void* at(const void* base, std::size_t i, std::size_t bytes) {
  return static_cast<const char*>(base) + i * bytes;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// State (mirrors StageModel::Impl)
// ---------------------------------------------------------------------------------------
struct CudaStageModel::Impl : StageShape {
  using StashT = Stash<DeviceBuffer, DeviceBuffer>;
  using BackwardT = runtime::Backward<DeviceBuffer>;
  using Grads = BlockGrads<DeviceBuffer>;
  using Slots = MicroBatchSlots<DeviceBuffer, DeviceBuffer>;
  using Slot = Slots::Slot;
  using Unit = BackwardUnit;

  StageSpec spec;
  DType dt;            // compute (storage) format
  DType gacc;          // grad_accumulation format
  std::size_t eb;      // bytes of a compute-format element
  DeviceTensorParallelGroup* group = nullptr;

  std::vector<ParamInfo> params;
  std::vector<BlockParams> blocks;
  int wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, head_w = -1;
  std::vector<Unit> units;
  std::size_t total = 0, largest = 0;
  bool fast_grads;

  StreamHandle stream;
  k::GemmContext gemm;
  DeviceBuffer master, working, grads;

  Slots slots{"CudaStageModel"};

  // Scratch shared by all micro-batches (a forward or a unit is queued whole before another).
  Grads shared_grads;
  DeviceBuffer tmp, dgelu, datt, attn_scratch;  // (N,C) (N,Fl) (N,Cl) (B,Hl,T,T): scores, then d(probs)
  DeviceBuffer wscratch, bscratch, gscratch;    // fp32 produced gradients; their compute-format copy
  DeviceBuffer losses, reduce_scratch;
  DeviceBuffer mb_loss_sums;  // per micro-batch: its rows' losses summed, in double
  std::size_t loss_slots = 0;
  // Tensor parallelism (as StageModel): gathered rows, the cross-entropy's row statistics (fp32:
  // max N, sums 2N), the norms' partial gradients under SP, the local ids on their way up.
  DeviceBuffer gathered, dy_full, dx1_full, ce, norm_partials;
  std::vector<int> pending_norms;  // pairs (weight, bias) of parameters, flattened
  std::vector<std::int32_t> host_ids;

  Impl(const StageSpec& s, StreamHandle st);

  // -- parameters --
  const void* w(int p) const {
    return at(dt == DType::fp32 ? master.data() : working.data(), params[p].offset, eb);
  }
  void* g(int p) { return at(grads.data(), params[p].offset, static_cast<std::size_t>(dtype_bytes(gacc))); }
  float* g32(int p) { return static_cast<float*>(g(p)); }  // fast_grads only: the buffer is fp32

  DeviceBuffer act(std::size_t elements) const { return DeviceBuffer(elements * eb); }
  static DeviceBuffer f32(std::size_t elements) { return DeviceBuffer(elements * sizeof(float)); }
  DeviceBuffer make(std::size_t elements, Held h) const { return h == Held::compute ? act(elements) : f32(elements); }
  void* row(const DeviceBuffer& b, std::size_t i) const { return at(b.data(), i, eb); }

  // -- the tensor-parallel group's collectives (StageModel::Impl's, on this stream) --
  DeviceTensorParallelGroup& tp_group() {
    if (!group)
      throw std::logic_error("CudaStageModel: tensor-parallel shard " + std::to_string(tp_rank) + " of " +
                             std::to_string(tp) + " has no group (set_tensor_parallel_group)");
    return *group;
  }
  void* reduce_rows(void* partial, int width) {
    const std::size_t n = N * static_cast<std::size_t>(width);
    if (!sp) {
      tp_group().all_reduce(partial, n, dt, ReduceOp::sum, stream);
      return partial;
    }
    tp_group().reduce_scatter(partial, n, dt, stream);
    return at(partial, row0 * width, eb);
  }
  const void* gather_rows(const void* local, DeviceBuffer& full, int width) {
    if (!sp) return local;
    void* mine = row(full, row0 * width);
    if (local != mine) copy_device_to_device(mine, local, Nl * width * eb, stream);
    tp_group().all_gather(full.data(), N * static_cast<std::size_t>(width), dt, stream);
    return full.data();
  }
  const void* row_parallel(const void* x, int pw, int pb, int in) {
    const int n = static_cast<int>(N);
    if (tp == 1) {
      k::linear_forward(gemm, tmp.data(), x, w(pw), w(pb), n, in, C, dt);
      return tmp.data();
    }
    k::linear_forward(gemm, tmp.data(), x, w(pw), nullptr, n, in, C, dt);
    void* y = reduce_rows(tmp.data(), C);
    k::add_bias(y, w(pb), Nl, C, dt, stream);
    return y;
  }
  void column_parallel_input_grad(void* out, const void* dy, const void* wt, int out_width) {
    const int n = static_cast<int>(N);
    if (tp == 1) {
      k::linear_backward_input(gemm, out, dy, wt, n, C, out_width, dt);
      return;
    }
    k::linear_backward_input(gemm, tmp.data(), dy, wt, n, C, out_width, dt);
    const void* d = reduce_rows(tmp.data(), C);
    copy_device_to_device(out, d, Nl * C * eb, stream);
  }
  // The ids a shard keeps on the device: its local ones (kernels.h), or the ids themselves.
  void upload_ids(DeviceBuffer& to, const std::int32_t* ids) {
    host_ids.assign(ids, ids + N);
    if (tp > 1)
      for (std::int32_t& id : host_ids) id = id >= vocab0 && id < vocab0 + Vl ? id - vocab0 : -1;
    copy_host_to_device(to.data(), host_ids.data(), N * sizeof(std::int32_t), stream);
  }

  std::unique_ptr<StashT> new_stash() {
    auto make_buf = [this](std::size_t n, Held h) { return make(n, h); };
    auto make_ids = [](std::size_t n) { return DeviceBuffer(n * sizeof(std::int32_t)); };
    return std::make_unique<StashT>(make_stash<DeviceBuffer, DeviceBuffer>(
        shape(), spec.has_embedding, spec.has_head, [this](int li) { return spec.recompute_of(li); }, split_room,
        make_buf, make_ids));
  }
  std::unique_ptr<BackwardT> new_backward(bool split) {
    return std::make_unique<BackwardT>(
        make_backward<DeviceBuffer>(shape(), spec.has_head, split, [this](std::size_t n, Held h) { return make(n, h); }));
  }
  void release(Slot& s) {
    for (BlockStash<DeviceBuffer>& b : s.stash->blocks) b.kept = false;
    slots.release(s);
  }

  void forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const void* input, void* output);
  // Room for micro-batch losses 0..count-1, the ones already there kept.
  void ensure_loss_slots(std::size_t count);
  // rebuild_op: selective_op's rebuild (StageModel::Impl::block_forward's): neither qkv nor fc, the
  // attention output to scratch, no mlp.proj.
  void block_forward(int li, StashT& s, bool rebuild_op = false);
  void head_forward(int mb, StashT& s);
  void attention_forward(BlockStash<DeviceBuffer>& st);
  Slot& begin(int mb, const void* grad_output, float scale, bool split);
  void unit_input(const Unit& u, StashT& s, BackwardT& b);
  void unit_weight(const Unit& u, StashT& s, BackwardT& b);
  void block_backward_input(int li, StashT& s, BackwardT& b);
  void block_backward_weight(int li, StashT& s, BackwardT& b);
  void attention_backward(void* dqkv, const void* dout, const BlockStash<DeviceBuffer>& st);

  void commit(int p, const float* produced);
  void wgrad_linear(int pw, int pb, const void* dy, const void* x, int in, int out);
  void wgrad_layernorm(int pw, int pb, const void* dy, const void* x, const float* mean, const float* rstd);
  void flush_norms();
  void wgrad_embedding(const void* dx, const std::int32_t* local_tokens);

  void refresh_working() {
    if (dt != DType::fp32) k::cast(working.data(), dt, master.data(), DType::fp32, total, stream);
  }

  // Activation recompute (spec.recompute), as StageModel::Impl's: the stash keeps less, and a
  // block's backward first rebuilds what it needs in this workspace with the forward's kernels.
  struct RecomputeWork {
    BlockStash<DeviceBuffer> block;
    DeviceBuffer probs, out;
  } redo;
  void forward_block(int li, StashT& s);
  void rebuild(const Unit& u, StashT& s, bool split);
  void rerun_block(int li, StashT& s);
  void drop_rebuilt(const Unit& u, StashT& s, bool weights_done);
  const DeviceBuffer& stage_output(const StashT& s) const {
    return s.x[static_cast<std::size_t>(L)].bytes() == 0 ? redo.out : s.x[static_cast<std::size_t>(L)];
  }
  // Full recompute and selective_op under a split backward rebuild a block in its stash's room,
  // allocated with the stash (no allocation mid-step, while NCCL may wait): reserve() asked for
  // split backwards.
  bool split_room = false;

  // Weights read through the engine's gate (set_weight_gate), piece by piece.
  GateCalls gate;
};

CudaStageModel::Impl::Impl(const StageSpec& s, StreamHandle st)
    : StageShape(checked(s)),
      spec(s),
      dt(s.compute),
      gacc(s.grad_accumulation),
      eb(static_cast<std::size_t>(dtype_bytes(s.compute))),
      // The CPU model validates the spec (before any device call) and is the one source of the
      // parameter list, its layout and its shards.
      params(StageModel(s).params()),
      stream(st),
      gemm(st) {

  auto index = [&](const std::string& name) {
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].name == name) return static_cast<int>(i);
    throw std::logic_error("CudaStageModel: StageModel has no parameter " + name);
  };
  auto end_of = [&](int p) { return params[p].offset + params[p].size; };
  const ModelDims& d = s.dims;
  // Units in StageModel's order: head, blocks from last to first, embedding.
  if (s.has_head) {
    head_w = index(d.tied_embeddings ? "wte" : "lm_head.weight");
    // The last stage's copy of a tied embedding is the token embedding its gradient is summed
    // into across the first and last stages (StageModel's rule; token_embedding()).
    if (d.tied_embeddings && !s.has_embedding) wte = head_w;
    lnf_w = index("lnf.weight");
    lnf_b = index("lnf.bias");
    units.push_back({.kind = UnitKind::head, .grads_end = end_of(lnf_b)});
  }
  blocks.resize(static_cast<std::size_t>(L));
  for (int li = L - 1; li >= 0; --li) {
    const std::string pre = "block." + std::to_string(s.first_layer + li) + ".";
    BlockParams& bp = blocks[static_cast<std::size_t>(li)];
    bp.mlp_proj_w = index(pre + "mlp.proj.weight");
    bp.mlp_proj_b = index(pre + "mlp.proj.bias");
    bp.fc_w = index(pre + "mlp.fc.weight");
    bp.fc_b = index(pre + "mlp.fc.bias");
    bp.ln2_w = index(pre + "ln2.weight");
    bp.ln2_b = index(pre + "ln2.bias");
    bp.attn_proj_w = index(pre + "attn.proj.weight");
    bp.attn_proj_b = index(pre + "attn.proj.bias");
    bp.qkv_w = index(pre + "attn.qkv.weight");
    bp.qkv_b = index(pre + "attn.qkv.bias");
    bp.ln1_w = index(pre + "ln1.weight");
    bp.ln1_b = index(pre + "ln1.bias");
    units.push_back({.kind = UnitKind::block, .block = li, .grads_end = end_of(bp.ln1_b)});
  }
  if (s.has_embedding) {
    wte = index("wte");
    wpe = index("wpe");
    units.push_back({.kind = UnitKind::embedding, .grads_end = end_of(wpe)});
  }
  for (const ParamInfo& p : params) {
    total = std::max(total, p.offset + p.size);
    largest = std::max(largest, p.size);
  }

  master = f32(total);
  grads = DeviceBuffer(total * static_cast<std::size_t>(dtype_bytes(gacc)));
  if (dt != DType::fp32) working = act(total);
  fast_grads = dt == DType::fp32 && gacc == DType::fp32;

  const std::size_t nc = N * C;
  tmp = act(nc);
  dgelu = act(N * Fl);
  datt = act(N * Cl);
  attn_scratch = act(static_cast<std::size_t>(B) * Hl * T * T);
  if (!fast_grads) {
    const std::size_t scratch = std::max(largest, static_cast<std::size_t>(T) * C);
    wscratch = f32(scratch);
    bscratch = f32(scratch);
    gscratch = act(scratch);
  }
  shared_grads = make_block_grads<DeviceBuffer>(shape(), [this](std::size_t n, Held h) { return make(n, h); });
  if (s.has_head) {
    losses = f32(N);
    reduce_scratch = DeviceBuffer(k::kReductionScratchDoubles * sizeof(double));
    if (tp > 1) ce = f32(3 * N);
  }
  if (sp) {
    gathered = act(nc);
    dy_full = act(nc);
    dx1_full = act(nc);
    norm_partials = f32(4 * static_cast<std::size_t>(C));
  }
  if (s.recompute == Recompute::selective) redo.probs = act(static_cast<std::size_t>(B) * Hl * T * T);
  auto make_buf = [this](std::size_t n, Held h) { return make(n, h); };
  if (s.recompute == Recompute::full) {
    redo.block = make_block_stash<DeviceBuffer>(shape(), {}, make_buf);
    redo.out = act(Nl * C);
  }
  if (s.recompute == Recompute::selective_op) {
    redo.block = make_block_stash<DeviceBuffer>(shape(), {.products = false}, make_buf);
    if (!s.has_head && L > 0) redo.out = act(Nl * C);  // the stage's output, passed on
  }
  fill_zero(grads.data(), grads.bytes(), stream);
}

// ---------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------
void CudaStageModel::Impl::ensure_loss_slots(std::size_t count) {
  if (count <= loss_slots) return;
  const std::size_t slots = std::max(count, 2 * loss_slots);
  DeviceBuffer grown(slots * sizeof(double));
  copy_device_to_device(grown.data(), mb_loss_sums.data(), loss_slots * sizeof(double), stream);
  synchronize(stream);  // before the old buffer is freed
  mb_loss_sums = std::move(grown);
  loss_slots = slots;
}

void CudaStageModel::Impl::forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const void* input,
                                   void* output) {
  check_forward_arguments(spec, "CudaStageModel::forward", tokens, targets, input != nullptr);
  if (tp > 1) tp_group();  // a shard without its group fails before it keeps anything

  StashT& s = *slots.begin_forward(mb, [&] { return new_stash(); }).stash;
  const std::size_t nlc = Nl * C;

  void* x0 = s.x[0].data();
  if (spec.has_embedding) {
    upload_ids(s.tokens, tokens);
    gate.take(WeightPiece::embedding);
    if (tp == 1) {
      k::embedding_forward(x0, s.tokens.as<std::int32_t>(), w(wte), w(wpe), B, T, C, V, dt, stream);
    } else {
      // Vocabulary-parallel: the shard's rows, summed over the group, then the position embedding.
      k::embedding_shard_forward(tmp.data(), s.tokens.as<std::int32_t>(), w(wte), static_cast<int>(N), C, Vl, dt,
                                 stream);
      copy_device_to_device(x0, reduce_rows(tmp.data(), C), nlc * eb, stream);
      k::add_position_embedding(x0, w(wpe), row0, Nl, T, C, dt, stream);
    }
    gate.give(WeightPiece::embedding);
  } else {
    copy_device_to_device(x0, input, nlc * eb, stream);  // already in the compute format
  }
  for (int li = 0; li < L; ++li) {
    gate.take(WeightPiece::block, li);
    forward_block(li, s);
    gate.give(WeightPiece::block, li);
  }
  if (!spec.has_head) {
    if (output) copy_device_to_device(output, stage_output(s).data(), nlc * eb, stream);
    return;
  }
  upload_ids(s.targets, targets);
  gate.take(WeightPiece::head);
  head_forward(mb, s);
  gate.give(WeightPiece::head);
}

void CudaStageModel::Impl::head_forward(int mb, StashT& s) {
  const int n = static_cast<int>(N);
  const void* xl = s.x[static_cast<std::size_t>(L)].data();
  // The final norm's rows kept as the shard's (as StageModel: the head gathers them into scratch).
  k::layernorm_forward(s.lnf.data(), s.meanf.as<float>(), s.rstdf.as<float>(), xl, w(lnf_w), w(lnf_b),
                       static_cast<int>(Nl), C, dt, stream);
  k::linear_forward(gemm, s.logits.data(), gather_rows(s.lnf.data(), gathered, C), w(head_w), nullptr, n, C, Vl, dt);
  const std::int32_t* targets = s.targets.as<std::int32_t>();
  if (tp == 1) {
    k::cross_entropy_forward(losses.as<float>(), s.lse.as<float>(), s.logits.data(), targets, n, V, dt, stream);
  } else {
    float* rowmax = ce.as<float>();
    float* sums = rowmax + N;
    k::cross_entropy_shard_max(rowmax, s.logits.data(), n, Vl, dt, stream);
    tp_group().all_reduce(rowmax, N, DType::fp32, ReduceOp::max, stream);
    k::cross_entropy_shard_sums(sums, s.logits.data(), rowmax, targets, n, Vl, dt, stream);
    tp_group().all_reduce(sums, 2 * N, DType::fp32, ReduceOp::sum, stream);
    k::cross_entropy_shard_loss(losses.as<float>(), s.lse.as<float>(), rowmax, sums, n, stream);
  }
  // layers::cross_entropy_forward: the rows' losses summed in double (divided by N, as float,
  // when read: losses()). Left on the device: a read here would stall the host every micro-batch.
  ensure_loss_slots(static_cast<std::size_t>(mb) + 1);
  k::sum(mb_loss_sums.as<double>() + mb, losses.as<float>(), N, reduce_scratch.as<double>(), false, stream);
}

void CudaStageModel::Impl::block_forward(int li, StashT& s, bool rebuild_op) {
  const BlockParams& p = blocks[static_cast<std::size_t>(li)];
  BlockStash<DeviceBuffer>& b = s.blocks[static_cast<std::size_t>(li)];
  const int n = static_cast<int>(N), nl = static_cast<int>(Nl);
  const std::size_t nlc = Nl * C;
  const void* x0 = s.x[static_cast<std::size_t>(li)].data();
  void* x2 = s.x[static_cast<std::size_t>(li) + 1].data();

  k::layernorm_forward(b.ln1.data(), b.mean1.as<float>(), b.rstd1.as<float>(), x0, w(p.ln1_w), w(p.ln1_b), nl, C, dt,
                       stream);
  if (!rebuild_op)
    k::linear_forward(gemm, b.qkv.data(), gather_rows(b.ln1.data(), gathered, C), w(p.qkv_w), w(p.qkv_b), n, C,
                      3 * Cl, dt);
  if (rebuild_op) std::swap(b.att, datt);  // to scratch (datt: free until the input pass); attn.proj reads the kept one
  attention_forward(b);
  if (rebuild_op) std::swap(b.att, datt);
  k::residual_add(b.x1.data(), x0, row_parallel(b.att.data(), p.attn_proj_w, p.attn_proj_b, Cl), nlc, dt, stream);
  k::layernorm_forward(b.ln2.data(), b.mean2.as<float>(), b.rstd2.as<float>(), b.x1.data(), w(p.ln2_w), w(p.ln2_b), nl,
                       C, dt, stream);
  if (!rebuild_op)
    k::linear_forward(gemm, b.fc.data(), gather_rows(b.ln2.data(), gathered, C), w(p.fc_w), w(p.fc_b), n, C, Fl, dt);
  k::gelu_forward(b.gelu.data(), b.fc.data(), N * Fl, dt, stream);
  if (rebuild_op) return;
  k::residual_add(x2, b.x1.data(), row_parallel(b.gelu.data(), p.mlp_proj_w, p.mlp_proj_b, Fl), nlc, dt, stream);
}

// layers::attention_forward over the shard's Hl heads of width hs (its qkv rows are (N, 3 Cl)),
// per (b, h), heads as the batch of one strided product per row b:
//   scores = (1/sqrt(hs)) q k^T   (alpha; rounded to dt), probs = causal softmax(scores) (scale 1),
//   att    = probs v              (heads side by side in (T, Cl)).
// q, k, v of head h start at qkv + b*T*3Cl + {0, Cl, 2Cl} + h*hs, row stride 3Cl (gemm.h).
void CudaStageModel::Impl::attention_forward(BlockStash<DeviceBuffer>& st) {
  const int hs = Cl / Hl, C3 = 3 * Cl;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));  // as layers.h: S(1) / sqrt(S(hs))
  const long long TT = static_cast<long long>(T) * T;
  for (int b = 0; b < B; ++b) {
    const void* q = row(st.qkv, static_cast<std::size_t>(b) * T * C3);
    void* s = row(attn_scratch, static_cast<std::size_t>(b) * Hl * TT);
    k::gemm_strided_batched(gemm, false, true, T, T, hs, scale, q, C3, hs, at(q, Cl, eb), C3, hs, 0.0f, s, T, TT, Hl,
                            dt, dt);
  }
  k::causal_softmax_forward(st.probs.data(), attn_scratch.data(), B * Hl, T, 1.0f, dt, stream);
  for (int b = 0; b < B; ++b) {
    const void* q = row(st.qkv, static_cast<std::size_t>(b) * T * C3);
    const void* p = row(st.probs, static_cast<std::size_t>(b) * Hl * TT);
    k::gemm_strided_batched(gemm, false, false, T, hs, T, 1.0f, p, T, TT, at(q, 2 * static_cast<std::size_t>(Cl), eb),
                            C3, hs, 0.0f, row(st.att, static_cast<std::size_t>(b) * T * Cl), Cl, hs, Hl, dt, dt);
  }
}

// ---------------------------------------------------------------------------------------
// Activation recompute (StageModel::Impl's, with device buffers)
// ---------------------------------------------------------------------------------------
void CudaStageModel::Impl::forward_block(int li, StashT& s) {
  BlockStash<DeviceBuffer>& b = s.blocks[static_cast<std::size_t>(li)];
  const Recompute recompute = spec.recompute_of(li);
  switch (recompute) {
    case Recompute::none:
      block_forward(li, s);
      return;
    case Recompute::selective:  // the softmax output goes to the workspace, not the stash
      std::swap(b.probs, redo.probs);
      block_forward(li, s);
      std::swap(b.probs, redo.probs);
      return;
    case Recompute::full:            // the whole block goes to the workspace,
    case Recompute::selective_op: {  // or all but qkv, att and fc; the output stays only as the next input
      auto to_workspace = [&] {
        if (recompute == Recompute::full)
          std::swap(b, redo.block);
        else
          swap_op_rebuilt(b, redo.block);
      };
      DeviceBuffer& next = s.x[static_cast<std::size_t>(li) + 1];
      to_workspace();
      const bool kept = next.bytes() > 0;
      if (!kept) std::swap(next, redo.out);
      block_forward(li, s);
      if (!kept) std::swap(next, redo.out);
      to_workspace();  // and back
      return;
    }
  }
}

void CudaStageModel::Impl::rerun_block(int li, StashT& s) {
  DeviceBuffer& next = s.x[static_cast<std::size_t>(li) + 1];
  std::swap(next, redo.out);  // the kept next input is left as it is
  block_forward(li, s);
  std::swap(next, redo.out);
}

void CudaStageModel::Impl::rebuild(const Unit& u, StashT& s, bool split) {
  if (u.kind != UnitKind::block) return;
  const Recompute recompute = spec.recompute_of(u.block);
  if (recompute == Recompute::none) return;
  BlockStash<DeviceBuffer>& st = s.blocks[static_cast<std::size_t>(u.block)];
  if (recompute == Recompute::selective) {  // the softmax output again, from the kept QKV
    std::swap(st.probs, redo.probs);
    std::swap(st.att, datt);  // the kept attention output is left as it is (datt: (N,Cl), free until the input pass)
    attention_forward(st);
    std::swap(st.att, datt);
    return;
  }
  if (recompute == Recompute::selective_op) {  // from the kept input, qkv, att and fc
    if (!split) {
      swap_op_rebuilt(st, redo.block);
    } else {  // in the stash's room what the weight pass, later, reads; the softmax output in the workspace
      if (st.ln1.bytes() == 0)
        throw std::logic_error(
            "CudaStageModel: a split backward under selective_op recompute needs reserve() with split backwards");
      std::swap(st.probs, redo.block.probs);
      st.kept = true;
    }
    block_forward(u.block, s, true);
    return;
  }
  if (!split) {
    std::swap(st, redo.block);
  } else {  // rebuilt in the stash's room: the weight pass, later, reads what the input pass leaves
    if (st.ln1.bytes() == 0)
      throw std::logic_error("CudaStageModel: a split backward under full recompute needs reserve() with split backwards");
    st.kept = true;
  }
  rerun_block(u.block, s);
}

void CudaStageModel::Impl::drop_rebuilt(const Unit& u, StashT& s, bool weights_done) {
  if (u.kind != UnitKind::block) return;
  const Recompute recompute = spec.recompute_of(u.block);
  if (recompute == Recompute::none) return;
  BlockStash<DeviceBuffer>& st = s.blocks[static_cast<std::size_t>(u.block)];
  if (recompute == Recompute::selective) {
    std::swap(st.probs, redo.probs);
  } else if (recompute == Recompute::selective_op) {
    if (weights_done)
      swap_op_rebuilt(st, redo.block);
    else  // the rest kept for the weight pass
      std::swap(st.probs, redo.block.probs);
  } else if (weights_done) {
    std::swap(st, redo.block);
  }  // else: kept; stash_bytes counts only what the weight pass reads
}

// ---------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------
CudaStageModel::Impl::Slot& CudaStageModel::Impl::begin(int mb, const void* grad_output, float scale, bool split) {
  if (!spec.has_head && !grad_output)
    throw std::invalid_argument("CudaStageModel: this stage's backward needs grad_output");
  Slot& sl = slots.begin_backward(mb, split, [&](bool sp) { return new_backward(sp); });
  StashT& s = *sl.stash;
  BackwardT& b = *sl.backward;
  if (spec.has_head)  // a shard's local targets: the whole model's kernel over its Vl columns
    k::cross_entropy_backward(b.dlogits.data(), s.logits.data(), s.lse.as<float>(), s.targets.as<std::int32_t>(),
                              static_cast<int>(N), Vl, scale / static_cast<float>(N), dt, stream);
  else
    copy_device_to_device(b.res(L).data(), grad_output, Nl * C * eb, stream);  // already in the compute format
  return sl;
}

void CudaStageModel::Impl::unit_input(const Unit& u, StashT& s, BackwardT& b) {
  switch (u.kind) {
    case UnitKind::head:
      column_parallel_input_grad(b.dlnf.data(), b.dlogits.data(), w(head_w), Vl);
      k::layernorm_backward_input(b.res(L).data(), b.dlnf.data(), s.x[static_cast<std::size_t>(L)].data(),
                                  s.meanf.as<float>(), s.rstdf.as<float>(), w(lnf_w), nullptr, static_cast<int>(Nl), C,
                                  dt, stream);
      break;
    case UnitKind::block:
      block_backward_input(u.block, s, b);
      break;
    case UnitKind::embedding:
      break;  // no input gradient below the embedding
  }
}

void CudaStageModel::Impl::unit_weight(const Unit& u, StashT& s, BackwardT& b) {
  switch (u.kind) {
    case UnitKind::head:
      wgrad_linear(head_w, -1, b.dlogits.data(), gather_rows(s.lnf.data(), gathered, C), C, Vl);
      wgrad_layernorm(lnf_w, lnf_b, b.dlnf.data(), s.x[static_cast<std::size_t>(L)].data(), s.meanf.as<float>(),
                      s.rstdf.as<float>());
      flush_norms();
      break;
    case UnitKind::block:
      block_backward_weight(u.block, s, b);
      break;
    case UnitKind::embedding:
      wgrad_embedding(gather_rows(b.res(0).data(), tmp, C), s.tokens.as<std::int32_t>());
      break;
  }
}

void CudaStageModel::Impl::block_backward_input(int li, StashT& s, BackwardT& b) {
  const BlockParams& p = blocks[static_cast<std::size_t>(li)];
  const BlockStash<DeviceBuffer>& st = s.blocks[static_cast<std::size_t>(li)];
  Grads& g = b.split ? b.blocks[static_cast<std::size_t>(li)] : shared_grads;
  const int n = static_cast<int>(N), nl = static_cast<int>(Nl);
  const void* dx2 = b.res(li + 1).data();  // gradient of the block's output (the shard's rows)
  void* dx0 = b.res(li).data();            // gradient of its input

  k::linear_backward_input(gemm, dgelu.data(), gather_rows(dx2, dy_full, C), w(p.mlp_proj_w), n, Fl, C, dt);
  k::gelu_backward(g.dfc.data(), st.fc.data(), dgelu.data(), N * Fl, dt, stream);
  column_parallel_input_grad(g.dln2.data(), g.dfc.data(), w(p.fc_w), Fl);
  k::layernorm_backward_input(g.dx1.data(), g.dln2.data(), st.x1.data(), st.mean2.as<float>(), st.rstd2.as<float>(),
                              w(p.ln2_w), dx2, nl, C, dt, stream);
  k::linear_backward_input(gemm, datt.data(), gather_rows(g.dx1.data(), dx1_full, C), w(p.attn_proj_w), n, Cl, C,
                           dt);
  attention_backward(g.dqkv.data(), datt.data(), st);
  column_parallel_input_grad(g.dln1.data(), g.dqkv.data(), w(p.qkv_w), 3 * Cl);
  k::layernorm_backward_input(dx0, g.dln1.data(), s.x[static_cast<std::size_t>(li)].data(), st.mean1.as<float>(),
                              st.rstd1.as<float>(), w(p.ln1_w), g.dx1.data(), nl, C, dt, stream);
}

// layers::attention_backward over the shard's heads, per (b, h), with the same strided products:
//   dprobs  = dout v^T                                    (rounded to dt)
//   dscores = probs * (dprobs - rowdot) * (1/sqrt(hs))    causal_softmax_backward, in place
//   dq = dscores k, dk = dscores^T q, dv = probs^T dout   (into dqkv, row stride 3Cl)
void CudaStageModel::Impl::attention_backward(void* dqkv, const void* dout, const BlockStash<DeviceBuffer>& st) {
  const int hs = Cl / Hl, C3 = 3 * Cl;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const long long TT = static_cast<long long>(T) * T;
  const std::size_t c = static_cast<std::size_t>(Cl);
  for (int b = 0; b < B; ++b) {
    const void* q = row(st.qkv, static_cast<std::size_t>(b) * T * C3);
    const void* dy = at(dout, static_cast<std::size_t>(b) * T * Cl, eb);
    void* dp = row(attn_scratch, static_cast<std::size_t>(b) * Hl * TT);
    k::gemm_strided_batched(gemm, false, true, T, T, hs, 1.0f, dy, Cl, hs, at(q, 2 * c, eb), C3, hs, 0.0f, dp, T, TT,
                            Hl, dt, dt);
  }
  k::causal_softmax_backward(attn_scratch.data(), st.probs.data(), attn_scratch.data(), B * Hl, T, scale, dt, stream);
  for (int b = 0; b < B; ++b) {
    const void* q = row(st.qkv, static_cast<std::size_t>(b) * T * C3);
    const void* p = row(st.probs, static_cast<std::size_t>(b) * Hl * TT);
    const void* ds = row(attn_scratch, static_cast<std::size_t>(b) * Hl * TT);
    const void* dy = at(dout, static_cast<std::size_t>(b) * T * Cl, eb);
    void* dq = at(dqkv, static_cast<std::size_t>(b) * T * C3, eb);
    k::gemm_strided_batched(gemm, false, false, T, hs, T, 1.0f, ds, T, TT, at(q, c, eb), C3, hs, 0.0f, dq, C3, hs, Hl,
                            dt, dt);
    k::gemm_strided_batched(gemm, true, false, T, hs, T, 1.0f, ds, T, TT, q, C3, hs, 0.0f, at(dq, c, eb), C3, hs, Hl,
                            dt, dt);
    k::gemm_strided_batched(gemm, true, false, T, hs, T, 1.0f, p, T, TT, dy, Cl, hs, 0.0f, at(dq, 2 * c, eb), C3, hs,
                            Hl, dt, dt);
  }
}

void CudaStageModel::Impl::block_backward_weight(int li, StashT& s, BackwardT& b) {
  const BlockParams& p = blocks[static_cast<std::size_t>(li)];
  const BlockStash<DeviceBuffer>& st = s.blocks[static_cast<std::size_t>(li)];
  const Grads& g = b.split ? b.blocks[static_cast<std::size_t>(li)] : shared_grads;
  // All rows of the output and attn residual gradients (StageModel::Impl::block_backward_weight).
  const void* dy = b.res(li + 1).data();
  const void* dx1 = g.dx1.data();
  if (sp) {
    dy = b.split ? gather_rows(dy, dy_full, C) : dy_full.data();
    dx1 = b.split ? gather_rows(dx1, dx1_full, C) : dx1_full.data();
  }
  wgrad_linear(p.mlp_proj_w, p.mlp_proj_b, dy, st.gelu.data(), Fl, C);
  wgrad_linear(p.fc_w, p.fc_b, g.dfc.data(), gather_rows(st.ln2.data(), gathered, C), C, Fl);
  wgrad_layernorm(p.ln2_w, p.ln2_b, g.dln2.data(), st.x1.data(), st.mean2.as<float>(), st.rstd2.as<float>());
  wgrad_linear(p.attn_proj_w, p.attn_proj_b, dx1, st.att.data(), Cl, C);
  wgrad_linear(p.qkv_w, p.qkv_b, g.dqkv.data(), gather_rows(st.ln1.data(), gathered, C), C, 3 * Cl);
  wgrad_layernorm(p.ln1_w, p.ln1_b, g.dln1.data(), s.x[static_cast<std::size_t>(li)].data(), st.mean1.as<float>(),
                  st.rstd1.as<float>());
  flush_norms();
}

// One micro-batch's gradient of parameter p, produced in fp32: rounded to the compute format,
// added into the accumulation buffer, the sum rounded to grad_accumulation (StageModel's commit).
void CudaStageModel::Impl::commit(int p, const float* produced) {
  const std::size_t n = params[p].size;
  if (dt == DType::fp32) {
    k::accumulate(g(p), gacc, produced, DType::fp32, n, stream);
  } else {
    k::cast(gscratch.data(), dt, produced, DType::fp32, n, stream);
    k::accumulate(g(p), gacc, gscratch.data(), dt, n, stream);
  }
}

// A product's weight (and bias) gradients over all N rows.
void CudaStageModel::Impl::wgrad_linear(int pw, int pb, const void* dy, const void* x, int in, int out) {
  const int n = static_cast<int>(N);
  if (fast_grads) {
    k::linear_backward_weight(gemm, g32(pw), DType::fp32, dy, x, n, in, out, dt, true);
    if (pb >= 0) k::bias_backward(g32(pb), dy, n, out, dt, stream);
    return;
  }
  k::linear_backward_weight(gemm, wscratch.data(), DType::fp32, dy, x, n, in, out, dt, false);
  commit(pw, wscratch.as<float>());
  if (pb >= 0) {
    fill_zero(bscratch.data(), static_cast<std::size_t>(out) * sizeof(float), stream);
    k::bias_backward(bscratch.as<float>(), dy, n, out, dt, stream);
    commit(pb, bscratch.as<float>());
  }
}

// A norm's gradients over the shard's rows; under sequence parallelism partial sums that
// flush_norms sums over the group first (StageModel::Impl::wgrad_layernorm).
void CudaStageModel::Impl::wgrad_layernorm(int pw, int pb, const void* dy, const void* x, const float* mean,
                                           const float* rstd) {
  const int nl = static_cast<int>(Nl);
  if (sp) {
    float* partial = norm_partials.as<float>() + pending_norms.size() * static_cast<std::size_t>(C);
    fill_zero(partial, 2 * static_cast<std::size_t>(C) * sizeof(float), stream);
    k::layernorm_backward_weight(partial, partial + C, dy, x, mean, rstd, nl, C, dt, stream);
    pending_norms.push_back(pw);
    pending_norms.push_back(pb);
    return;
  }
  if (fast_grads) {
    k::layernorm_backward_weight(g32(pw), g32(pb), dy, x, mean, rstd, nl, C, dt, stream);
    return;
  }
  fill_zero(wscratch.data(), static_cast<std::size_t>(C) * sizeof(float), stream);
  fill_zero(bscratch.data(), static_cast<std::size_t>(C) * sizeof(float), stream);
  k::layernorm_backward_weight(wscratch.as<float>(), bscratch.as<float>(), dy, x, mean, rstd, nl, C, dt, stream);
  commit(pw, wscratch.as<float>());
  commit(pb, bscratch.as<float>());
}

void CudaStageModel::Impl::flush_norms() {
  if (pending_norms.empty()) return;
  float* partials = norm_partials.as<float>();
  tp_group().all_reduce(partials, pending_norms.size() * static_cast<std::size_t>(C), DType::fp32, ReduceOp::sum,
                        stream);
  for (std::size_t i = 0; i < pending_norms.size(); ++i) {
    const float* produced = partials + i * static_cast<std::size_t>(C);
    if (fast_grads)
      k::accumulate(g(pending_norms[i]), gacc, produced, DType::fp32, static_cast<std::size_t>(C), stream);
    else
      commit(pending_norms[i], produced);
  }
  pending_norms.clear();
}

// The embedding's gradients from all N rows' gradient dx; the shard's local token ids make the
// whole model's kernel scatter into its Vl rows only.
void CudaStageModel::Impl::wgrad_embedding(const void* dx, const std::int32_t* local_tokens) {
  if (fast_grads) {
    k::embedding_backward(g32(wte), g32(wpe), dx, local_tokens, B, T, C, Vl, dt, stream);
    return;
  }
  fill_zero(wscratch.data(), params[wte].size * sizeof(float), stream);
  fill_zero(bscratch.data(), params[wpe].size * sizeof(float), stream);
  k::embedding_backward(wscratch.as<float>(), bscratch.as<float>(), dx, local_tokens, B, T, C, Vl, dt, stream);
  commit(wte, wscratch.as<float>());
  commit(wpe, bscratch.as<float>());
}

// ---------------------------------------------------------------------------------------
// CudaStageModel
// ---------------------------------------------------------------------------------------
CudaStageModel::CudaStageModel(const StageSpec& spec, StreamHandle stream) : impl_(std::make_unique<Impl>(spec, stream)) {}
CudaStageModel::~CudaStageModel() = default;
CudaStageModel::CudaStageModel(CudaStageModel&&) noexcept = default;
CudaStageModel& CudaStageModel::operator=(CudaStageModel&&) noexcept = default;

const StageSpec& CudaStageModel::spec() const { return impl_->spec; }
void CudaStageModel::set_tensor_parallel_group(DeviceTensorParallelGroup* group) { impl_->group = group; }
StreamHandle CudaStageModel::stream() const { return impl_->stream; }

void CudaStageModel::init(std::uint64_t seed) {
  StageModel reference(impl_->spec);
  reference.init(seed);
  const std::span<float> w = reference.master_weights();
  set_master_weights(std::vector<float>(w.begin(), w.end()));
}

void CudaStageModel::randomize_for_timing(std::uint64_t seed) {
  Impl& m = *impl_;
  k::fill_normal(m.master.data(), DType::fp32, m.total, 0.02f, seed, false, m.stream);
  m.refresh_working();
}

void CudaStageModel::set_master_weights(const std::vector<float>& weights) {
  Impl& m = *impl_;
  if (weights.size() != m.total)
    throw std::invalid_argument("CudaStageModel::set_master_weights: " + std::to_string(weights.size()) +
                                " values for " + std::to_string(m.total) + " parameters");
  copy_host_to_device(m.master.data(), weights.data(), m.total * sizeof(float), m.stream);
  m.refresh_working();
  synchronize(m.stream);  // `weights` may go away when this returns
}

const std::vector<ParamInfo>& CudaStageModel::params() const { return impl_->params; }
std::size_t CudaStageModel::num_parameters() const { return impl_->total; }

ParamInfo CudaStageModel::token_embedding() const {
  if (impl_->wte < 0) return ParamInfo{};
  return impl_->params[impl_->wte];
}

void CudaStageModel::zero_gradients() { fill_zero(impl_->grads.data(), impl_->grads.bytes(), impl_->stream); }
void CudaStageModel::refresh_working_weights() { impl_->refresh_working(); }

float* CudaStageModel::master_weights_device() { return impl_->master.as<float>(); }
void* CudaStageModel::compute_weights_device() {
  return impl_->dt == DType::fp32 ? impl_->master.data() : impl_->working.data();
}
void CudaStageModel::set_weight_gate(WeightGate* gate) { impl_->gate.gate = gate; }
void* CudaStageModel::gradients_device() { return impl_->grads.data(); }
DType CudaStageModel::gradient_format() const { return impl_->gacc; }
const void* CudaStageModel::working_weights_device() const {
  return impl_->dt == DType::fp32 ? impl_->master.data() : impl_->working.data();
}

std::vector<float> CudaStageModel::master_weights_to_host() const {
  const Impl& m = *impl_;
  std::vector<float> out(m.total);
  copy_device_to_host(out.data(), m.master.data(), m.total * sizeof(float), m.stream);
  synchronize(m.stream);
  return out;
}

std::vector<float> CudaStageModel::gradients_to_host() const {
  const Impl& m = *impl_;
  std::vector<float> out(m.total);
  DeviceBuffer wide;  // the gradients converted to fp32, when they are stored narrower
  if (m.gacc == DType::fp32) {
    copy_device_to_host(out.data(), m.grads.data(), m.total * sizeof(float), m.stream);
  } else {
    wide = DeviceBuffer(m.total * sizeof(float));
    k::cast(wide.data(), DType::fp32, m.grads.data(), m.gacc, m.total, m.stream);
    copy_device_to_host(out.data(), wide.data(), m.total * sizeof(float), m.stream);
  }
  synchronize(m.stream);  // also before `wide` is freed
  return out;
}

std::size_t CudaStageModel::activation_elements() const { return impl_->Nl * impl_->C; }
DType CudaStageModel::activation_format() const { return impl_->dt; }

void CudaStageModel::forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const void* input,
                             void* output) {
  impl_->forward(mb, tokens, targets, input, output);
}

std::vector<float> CudaStageModel::losses(int count) const {
  const Impl& m = *impl_;
  if (!m.spec.has_head) throw std::logic_error("CudaStageModel::losses: only the last stage computes a loss");
  if (count < 0 || static_cast<std::size_t>(count) > m.loss_slots)
    throw std::invalid_argument("CudaStageModel::losses: " + std::to_string(count) + " micro-batches asked, " +
                                std::to_string(m.loss_slots) + " have room");
  std::vector<double> sums(static_cast<std::size_t>(count));
  copy_device_to_host(sums.data(), m.mb_loss_sums.data(), sums.size() * sizeof(double), m.stream);
  synchronize(m.stream);
  std::vector<float> out;
  for (double sum : sums) out.push_back(static_cast<float>(sum / static_cast<double>(m.N)));
  return out;
}

void CudaStageModel::reserve(int stashes, int backwards, int split_backwards, int micro_batches) {
  Impl& m = *impl_;
  if (split_backwards > 0 && (m.spec.recompute == Recompute::full || m.spec.recompute == Recompute::selective_op) &&
      !m.split_room) {
    m.split_room = true;
    m.slots.free_stashes.clear();  // made again with the room
  }
  while (static_cast<int>(m.slots.free_stashes.size()) < stashes) m.slots.free_stashes.push_back(m.new_stash());
  for (const bool split : {false, true}) {
    const int want = split ? split_backwards : backwards;
    int have = static_cast<int>(std::count_if(m.slots.free_backwards.begin(), m.slots.free_backwards.end(),
                                              [&](const auto& b) { return b->split == split; }));
    for (; have < want; ++have) m.slots.free_backwards.push_back(m.new_backward(split));
  }
  if (m.spec.has_head) m.ensure_loss_slots(static_cast<std::size_t>(std::max(micro_batches, 0)));
}

void CudaStageModel::backward_begin(int mb, const void* grad_output, float loss_gradient_scale) {
  impl_->begin(mb, grad_output, loss_gradient_scale, false);
}

// The zero-bubble split, as StageModel: every unit's input gradient now (grad_input for the
// previous stage), every unit's weight gradients later.
void CudaStageModel::backward_input(int mb, const void* grad_output, float loss_gradient_scale, void* grad_input) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.begin(mb, grad_output, loss_gradient_scale, true);
  for (const Impl::Unit& u : m.units) {
    if (u.reads_weights()) m.gate.take(u.piece(), u.block);
    m.rebuild(u, *sl.stash, true);
    m.unit_input(u, *sl.stash, *sl.backward);
    if (u.reads_weights()) m.gate.give(u.piece(), u.block);
    m.drop_rebuilt(u, *sl.stash, false);
  }
  sl.backward->inputs_done = true;
  if (!m.spec.has_embedding && grad_input)
    copy_device_to_device(grad_input, sl.backward->res(0).data(), m.Nl * m.C * m.eb, m.stream);
}

void CudaStageModel::backward_weight(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.weight_pass(mb);
  for (; sl.units_done < static_cast<int>(m.units.size()); ++sl.units_done)
    m.unit_weight(m.units[static_cast<std::size_t>(sl.units_done)], *sl.stash, *sl.backward);
  m.release(sl);
}

void CudaStageModel::backward_weight_unit(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.next_weight_unit(mb, m.units.size());
  m.unit_weight(m.units[static_cast<std::size_t>(sl.units_done)], *sl.stash, *sl.backward);
  ++sl.units_done;
}

int CudaStageModel::backward_units() const { return static_cast<int>(impl_->units.size()); }

void CudaStageModel::backward_unit(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.next_unit(mb, m.units.size());
  const Impl::Unit& u = m.units[static_cast<std::size_t>(sl.units_done)];
  if (u.reads_weights()) m.gate.take(u.piece(), u.block);
  m.rebuild(u, *sl.stash, false);
  m.unit_input(u, *sl.stash, *sl.backward);
  if (u.reads_weights()) m.gate.give(u.piece(), u.block);
  m.unit_weight(u, *sl.stash, *sl.backward);
  m.drop_rebuilt(u, *sl.stash, true);
  ++sl.units_done;
}

std::size_t CudaStageModel::gradients_complete(int mb) const {
  const Impl& m = *impl_;
  return m.slots.gradients_complete(mb, m.total,
                                    [&](int i) { return m.units[static_cast<std::size_t>(i)].grads_end; });
}

void CudaStageModel::backward_end(int mb, void* grad_input) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.finish_whole(mb, m.units.size());
  if (!m.spec.has_embedding && grad_input)
    copy_device_to_device(grad_input, sl.backward->res(0).data(), m.Nl * m.C * m.eb, m.stream);
  m.release(sl);
}

std::size_t CudaStageModel::activation_bytes() const {
  std::size_t bytes = 0;
  auto count = [&](const DeviceBuffer& b, Held) { bytes += b.bytes(); };
  for (const Impl::Slot& sl : impl_->slots.all()) {
    if (sl.stash)
      bytes += stash_bytes(
          *sl.stash, [this](int li) { return impl_->spec.recompute_of(li); },
          [](const DeviceBuffer& b, Held) { return b.bytes(); },
          [](const DeviceBuffer& ids) { return ids.bytes(); });
    if (sl.backward) for_each_tensor(*sl.backward, count);
  }
  return bytes;
}

std::size_t CudaStageModel::backward_workspace_bytes() const {
  const Impl& m = *impl_;
  const auto& b = m.redo.block;
  std::size_t bytes = m.redo.probs.bytes() + m.redo.out.bytes();
  for (const DeviceBuffer* t : {&b.ln1, &b.qkv, &b.probs, &b.att, &b.x1, &b.ln2, &b.fc, &b.gelu, &b.mean1, &b.rstd1,
                                &b.mean2, &b.rstd2})
    bytes += t->bytes();
  return bytes;
}

}  // namespace trainsim::runtime::cuda
