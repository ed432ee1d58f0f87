// One pipeline stage of the GPT-2 style decoder (see stage_model.h for the contract and the
// mixed-precision rules). The math lives in layers.h, the stash layout in stage_layout.h; this
// file owns the parameters, the per-micro-batch stashes, the order of backward units, the rounding
// to the formats and, for a tensor-parallel shard, where its group's collectives go (Megatron-LM:
// column-parallel qkv and mlp.fc, row-parallel attn.proj and mlp.proj, an all-reduce after each
// row-parallel product in the forward and before each column-parallel input in the backward — the
// f/g pair —, a vocabulary-parallel embedding and cross-entropy; under sequence parallelism each
// all-reduce becomes a reduce-scatter into the shard's rows and an all-gather of them).
#include "runtime/model/stage_model.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numbers>
#include <stdexcept>
#include <string_view>

#include "runtime/model/layers.h"
#include "runtime/model/micro_batch_slots.h"
#include "runtime/model/stage_layout.h"
#include "runtime/model/model_parallel.h"
#include "runtime/numerics/lowp.h"
#include "runtime/numerics/splitmix64.h"

namespace trainsim::runtime {

namespace {

using layers::AttnTensor;
using Row = layers::RowMap<float>;
using ConstRow = layers::ConstRowMap<float>;

// ---------------------------------------------------------------------------------------
// Initialisation: a counter-based generator, so a value depends on (seed, tensor name, index)
// only and any cut of the model draws the same weights as the whole.
// ---------------------------------------------------------------------------------------
std::uint64_t hash_name(std::string_view s) {  // FNV-1a
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}
// The i-th standard normal of stream `key`: Box-Muller on the splitmix64 outputs 2i+1, 2i+2.
double normal_at(std::uint64_t key, std::uint64_t i) {
  const double u1 = (static_cast<double>(splitmix64_mix(key + (2 * i + 1) * kSplitMixGamma) >> 11) + 0.5) * 0x1p-53;
  const double u2 = (static_cast<double>(splitmix64_mix(key + (2 * i + 2) * kSplitMixGamma) >> 11) + 0.5) * 0x1p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

enum class Init { normal, normal_residual, ones, zeros };

// A tensor's name for StageNumerics::first_nonfinite, formatted only when needed:
// "block 3 mlp.fc output (forward, micro-batch 2)".
struct Tag {
  const char* what;
  int layer = -1;  // global block index, or -1 outside the blocks
  const char* suffix = "";
};

const char* attn_name(AttnTensor t) {
  switch (t) {
    case AttnTensor::scores:
      return "attn.scores";
    case AttnTensor::probs:
      return "attn.softmax output";
    case AttnTensor::probs_grad:
      return "attn.softmax output gradient";
    case AttnTensor::scores_grad:
      return "attn.scores gradient";
  }
  return "attn";
}

// Every float buffer starts on Eigen's widest alignment: Eigen peels unaligned leading elements
// off its vectorised loops and sums, so results would otherwise depend on where malloc put a
// buffer (run to run, and between the split and the unsplit backward).
using Buffer = std::vector<float, Eigen::aligned_allocator<float>>;
Buffer floats(std::size_t n) { return Buffer(n); }

}  // namespace

// ---------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------
// A stage's sizes are its own (StageShape: B, T, C, ..., the shard's Cl, Hl, Fl, Vl, N, Nl).
struct StageModel::Impl : StageShape {
  using Ids = std::vector<std::int32_t>;
  using StashT = Stash<Buffer, Ids>;
  using BackwardT = runtime::Backward<Buffer>;
  using Grads = BlockGrads<Buffer>;
  using Slots = MicroBatchSlots<Buffer, Ids>;
  using Slot = Slots::Slot;
  using Unit = BackwardUnit;

  StageSpec spec;
  ModelParallelGroup* group = nullptr;     // tensor-parallel
  ModelParallelGroup* cp_group = nullptr;  // context-parallel
  DType wire;  // what the activations' collectives carry

  std::vector<ParamInfo> params;
  std::vector<Init> inits;
  std::vector<BlockParams> blocks;
  int wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, head_w = -1;
  std::vector<Unit> units;
  Buffer master, working, grads;
  bool fast_grads;  // compute and accumulation both fp32: weight gradients go straight into grads

  Slots slots{"StageModel"};

  // Scratch shared by all micro-batches (a forward or a unit runs to its end before another).
  Grads shared_grads;
  Buffer tmp, dgelu, datt, attn_scratch, wscratch, bscratch;
  // Tensor parallelism: all N rows of a gathered input, of the gathered output gradient and attn
  // residual gradient (sequence parallel), the cross-entropy's row statistics, and the norms'
  // partial gradients a sequence-parallel shard sums over its group.
  Buffer gathered, dy_full, dx1_full, ce, norm_partials;
  // Context parallelism: every rank's keys and values (B,T,2Cl) in the sequence's order and their
  // gradients; each also serves as the other's room for the ranks' chunks as the group's
  // collectives move them (cp x N x 2Cl, the same size). And each rank's positions.
  Buffer kv_all, dkv_all;
  std::vector<std::vector<int>> rank_positions;
  struct PendingNorm {
    int pw, pb;
  };
  std::vector<PendingNorm> pending_norms;

  StageNumerics numerics;

  // Activation recompute (spec.recompute), wrapped around block_forward and the block's backward:
  // the stash keeps less (stage_layout.h), and a block's backward first rebuilds what it needs in
  // this workspace (full: one block's whole stash and output; selective: one softmax output;
  // selective_op: what swap_op_rebuilt names, and the stage's output when it is passed on, not
  // kept), with the same code and inputs as the forward, so bitwise the same values (and, for a
  // shard, the same collectives on every shard of the group). Numerics are recorded once, in the
  // forward.
  struct RecomputeWork {
    BlockStash<Buffer> block;
    Buffer probs, out;
    bool active = false;  // rebuilding: record() is quiet
  } redo;
  void forward_block(int li, StashT& s, int mb);              // block_forward, keeping what spec.recompute keeps
  void rebuild(const Unit& u, StashT& s, int mb, bool split);  // before unit u's input pass
  void rerun_block(int li, StashT& s, int mb);                // block_forward into s.blocks[li], output aside
  void drop_rebuilt(const Unit& u, StashT& s, bool weights_done);  // after its pass(es)
  const Buffer& stage_output(const StashT& s) const { return s.x[L].empty() ? redo.out : s.x[L]; }

  // Weights read through the engine's gate (set_weight_gate), piece by piece.
  GateCalls gate;
  // Seconds the stage's blocks computed since take_block_seconds() last read them (BlockClock).
  double block_seconds = 0;
  // Adds the seconds from its construction to its destruction to block_seconds, for a block
  // unit's work (`on`: the unit is a block; the head and embedding are not counted).
  struct BlockClock {
    double* to;
    std::chrono::steady_clock::time_point t0;
    BlockClock(double& sum, bool on) : to(on ? &sum : nullptr), t0(std::chrono::steady_clock::now()) {}
    ~BlockClock() {
      if (to) *to += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    BlockClock(const BlockClock&) = delete;
    BlockClock& operator=(const BlockClock&) = delete;
  };
  // The clock of backward unit u's work: running for a block, idle for the head and embedding.
  BlockClock unit_clock(const Unit& u) { return {block_seconds, u.kind == UnitKind::block}; }

  explicit Impl(const StageSpec& s);

  // -- parameters --
  int add_param(std::string name, const ParamShard& shard, Init init, bool decay) {
    ParamInfo p;
    p.name = std::move(name);
    p.size = shard.size();
    p.decay = decay;
    p.tensor_parallel = tp > 1 && shard.size() != shard.full_rows * shard.full_cols;
    p.shard = shard;
    params.push_back(std::move(p));
    inits.push_back(init);
    return static_cast<int>(params.size()) - 1;
  }
  const float* w(int p) const {
    return (spec.compute == DType::fp32 ? master.data() : working.data()) + params[p].offset;
  }
  float* g(int p) { return grads.data() + params[p].offset; }

  // -- numerics --
  void record(const Scan& s, const Tag& tag, bool backward, int mb) {
    if (redo.active) return;
    double& mx = backward ? numerics.max_abs_gradient : numerics.max_abs_activation;
    mx = std::max(mx, static_cast<double>(s.max_abs));
    if (s.nonfinite == 0) return;
    (backward ? numerics.nonfinite_gradients : numerics.nonfinite_activations) += s.nonfinite;
    if (!numerics.first_nonfinite.empty()) return;
    std::string name;
    if (tag.layer >= 0) name = "block " + std::to_string(tag.layer) + " ";
    name += tag.what;
    name += tag.suffix;
    if (mb >= 0)
      name += std::string(" (") + (backward ? "backward" : "forward") + ", micro-batch " + std::to_string(mb) + ")";
    else
      name += " (weights refresh)";
    numerics.first_nonfinite = std::move(name);
  }
  // Rounds a tensor the stage stores or passes on to the compute format; records its numerics.
  void finish(float* x, std::size_t n, const Tag& tag, bool backward, int mb) {
    record(round_and_scan(spec.compute, x, n), tag, backward, mb);
  }

  // -- the tensor-parallel group's collectives --
  ModelParallelGroup& tp_group() {
    if (!group)
      throw std::logic_error("StageModel: tensor-parallel shard " + std::to_string(tp_rank) + " of " +
                             std::to_string(tp) + " has no group (set_tensor_parallel_group)");
    return *group;
  }
  // -- the context-parallel group's collectives --
  ModelParallelGroup& context_group() {
    if (!cp_group)
      throw std::logic_error("StageModel: context-parallel rank " + std::to_string(cp_rank) + " of " +
                             std::to_string(cp) + " has no group (set_context_parallel_group)");
    return *cp_group;
  }
  // Every rank's keys and values (columns [Cl, 3Cl) of its N qkv rows) into kv_all, each row at its
  // position: this rank's into its chunk, the group's all-gather (in dkv_all, free until the
  // backward's gradients), then into the sequence's order.
  void gather_keys_values(const float* qkv) {
    const std::size_t w = 2 * static_cast<std::size_t>(Cl), qw = 3 * static_cast<std::size_t>(Cl), chunk = N * w;
    float* chunks = dkv_all.data();
    float* mine = chunks + static_cast<std::size_t>(cp_rank) * chunk;
    for (std::size_t n = 0; n < N; ++n) std::copy_n(qkv + n * qw + Cl, w, mine + n * w);
    context_group().all_gather({chunks, cp * chunk}, wire);
    for_each_rank_row([&](std::size_t chunk_row, std::size_t seq_row) {
      std::copy_n(chunks + chunk_row * w, w, kv_all.data() + seq_row * w);
    });
  }
  // The keys' and values' gradients of every position (dkv_all) to the ranks that hold them,
  // summed over the group (in kv_all, read by the attention backward before): this rank's into
  // columns [Cl, 3Cl) of its dqkv rows.
  void reduce_scatter_keys_values(float* dqkv) {
    const std::size_t w = 2 * static_cast<std::size_t>(Cl), qw = 3 * static_cast<std::size_t>(Cl), chunk = N * w;
    float* chunks = kv_all.data();
    for_each_rank_row([&](std::size_t chunk_row, std::size_t seq_row) {
      std::copy_n(dkv_all.data() + seq_row * w, w, chunks + chunk_row * w);
    });
    context_group().reduce_scatter({chunks, cp * chunk}, wire);
    const float* mine = chunks + static_cast<std::size_t>(cp_rank) * chunk;
    for (std::size_t n = 0; n < N; ++n) std::copy_n(mine + n * w, w, dqkv + n * qw + Cl);
  }
  // f(row of the ranks' chunks as the collectives move them, row in the (B,T) sequence order) for
  // every rank's every row.
  template <class F>
  void for_each_rank_row(F&& f) const {
    for (int r = 0; r < cp; ++r)
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < Tq; ++t)
          f(static_cast<std::size_t>(r) * N + static_cast<std::size_t>(b) * Tq + t,
            static_cast<std::size_t>(b) * T + rank_positions[r][t]);
  }
  // The attention core on this rank's queries (qkv's N rows): over their own sequence's keys, or
  // under context parallelism over every rank's, gathered.
  // Its keys and values: columns [Cl, 3Cl) of its qkv rows, or every rank's gathered (kv_all).
  layers::AttentionShape attention_shape() const { return {B, Tq, T, cp > 1 ? positions.data() : nullptr}; }
  template <class Post>
  void attention_core(float* att, float* probs, const float* qkv, Post&& post) {
    const std::ptrdiff_t qw = 3 * Cl, w = cp > 1 ? 2 * Cl : qw;
    if (cp > 1) gather_keys_values(qkv);
    const float* kv = cp > 1 ? kv_all.data() : qkv + Cl;
    layers::attention_forward<float>(att, probs, attn_scratch.data(), {qkv, qw}, {kv, w}, {kv + Cl, w},
                                     attention_shape(), Cl, Hl, post);
  }
  template <class Post>
  void attention_core_backward(float* dqkv, const float* datt_in, const float* qkv, const float* probs, Post&& post) {
    const std::ptrdiff_t qw = 3 * Cl, w = cp > 1 ? 2 * Cl : qw;
    if (cp > 1) gather_keys_values(qkv);  // again: the forward's gather is not kept
    const float* kv = cp > 1 ? kv_all.data() : qkv + Cl;
    float* dkv = cp > 1 ? dkv_all.data() : dqkv + Cl;
    layers::attention_backward<float>({dqkv, qw}, {dkv, w}, {dkv + Cl, w}, attn_scratch.data(), datt_in, {qkv, qw},
                                      {kv, w}, {kv + Cl, w}, probs, attention_shape(), Cl, Hl, post);
    if (cp > 1) reduce_scatter_keys_values(dqkv);
  }

  // Partial products (all N rows of `width`) summed over the group: all rows (all-reduce), or under
  // sequence parallelism the shard's rows (reduce-scatter). Returns the shard's Nl rows, in place.
  float* reduce_rows(float* partial, int width) {
    const std::size_t n = N * static_cast<std::size_t>(width);
    if (!sp) {
      tp_group().all_reduce({partial, n}, ReduceOp::sum, wire);
      return partial;
    }
    tp_group().reduce_scatter({partial, n}, wire);
    return partial + row0 * width;
  }
  // All N rows of `width` from the shards' rows (sequence parallelism: an all-gather into `full`,
  // `local` may already be its place there); without sequence parallelism the shard holds them all.
  const float* gather_rows(const float* local, Buffer& full, int width) {
    if (!sp) return local;
    float* mine = full.data() + row0 * width;
    if (local != mine) std::copy(local, local + Nl * width, mine);
    tp_group().all_gather({full.data(), N * static_cast<std::size_t>(width)}, wire);
    return full.data();
  }
  // A row-parallel product (attn.proj, mlp.proj): out = x w^T + b over this shard's rows. Whole:
  // the product with its bias; a shard: its partial product, summed over the group, then the bias.
  const float* row_parallel(const float* x, int pw, int pb, int in, const Tag& tag, int mb) {
    if (tp == 1) {
      layers::linear_forward(tmp.data(), x, w(pw), w(pb), N, in, C);
      finish(tmp.data(), N * C, tag, false, mb);
      return tmp.data();
    }
    layers::linear_forward(tmp.data(), x, w(pw), static_cast<const float*>(nullptr), N, in, C);
    finish(tmp.data(), N * C, tag, false, mb);
    float* y = reduce_rows(tmp.data(), C);
    layers::add_bias(y, w(pb), Nl, C);
    finish(y, Nl * C, tag, false, mb);
    return y;
  }
  // The gradient at a column-parallel product's input (ln outputs, lnf output): dy w from this
  // shard's columns, summed over the group into `out` (the shard's rows).
  void column_parallel_input_grad(float* out, const float* dy, const float* wt, int out_width, const Tag& tag, int mb) {
    if (tp == 1) {
      layers::linear_backward_input(out, dy, wt, N, C, out_width);
      finish(out, N * C, tag, true, mb);
      return;
    }
    layers::linear_backward_input(tmp.data(), dy, wt, N, C, out_width);
    finish(tmp.data(), N * C, tag, true, mb);
    const float* d = reduce_rows(tmp.data(), C);
    std::copy(d, d + Nl * C, out);
    finish(out, Nl * C, tag, true, mb);
  }

  // -- micro-batch bookkeeping --
  static Buffer make(std::size_t n, Held) { return floats(n); }
  std::unique_ptr<StashT> new_stash();
  std::unique_ptr<BackwardT> new_backward(bool split);
  void release(Slot& s) {
    // Full recompute and selective_op: what a split backward rebuilt and kept for its weight pass.
    for (BlockStash<Buffer>& b : s.stash->blocks) {
      if (!b.kept) continue;
      if (spec.recompute == Recompute::selective_op) {
        BlockStash<Buffer> rebuilt;
        swap_op_rebuilt(b, rebuilt);
        b.kept = false;
      } else {
        b = BlockStash<Buffer>{};
      }
    }
    slots.release(s);
  }
  std::size_t held_bytes(std::size_t elements, Held h) const {
    return elements * (h == Held::compute ? dtype_bytes(spec.compute) : 4);
  }

  // -- passes --
  float forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const float* input, float* output);
  // rebuild_op: selective_op's rebuild in the block's backward, which makes again neither what the
  // stash keeps (qkv, fc: their products are skipped; att: the attention core writes to scratch and
  // attn.proj reads the kept one) nor mlp.proj's output (only the next block's input, kept).
  void block_forward(int li, StashT& s, int mb, bool rebuild_op = false);
  float head_forward(StashT& s, int mb);
  Slot& begin(int mb, const float* grad_output, float scale, bool split);
  void unit_input(const Unit& u, StashT& s, BackwardT& b, int mb);
  void unit_weight(const Unit& u, StashT& s, BackwardT& b, int mb);
  void block_backward_input(int li, StashT& s, BackwardT& b, int mb);
  void block_backward_weight(int li, StashT& s, BackwardT& b, int mb);

  // -- weight gradients of one micro-batch into the accumulation buffer --
  void commit(int p, float* produced, int mb);
  void scan_accumulated(int p, int mb) {
    record(scan(g(p), params[p].size), Tag{params[p].name.c_str(), -1, " gradient"}, true, mb);
  }
  void wgrad_linear(int pw, int pb, const float* dy, const float* x, int in, int out, int mb);
  void wgrad_layernorm(int pw, int pb, const float* dy, const float* x, const float* mean, const float* rstd, int mb);
  void flush_norms(int mb);
  void wgrad_embedding(const float* dx, const std::int32_t* tokens, int mb);

  void refresh_working();
};

StageModel::Impl::Impl(const StageSpec& s) : StageShape(s), spec(s) {
  wire = tensor_parallel_wire(s.compute);
  for (DType t : {s.compute, s.grad_accumulation})
    if (t == DType::fp8) throw std::invalid_argument("StageSpec: fp8 is not emulated by the runtime (compute or grad_accumulation)");
  const std::size_t c = C, f = F, v = V, r = tp_rank, cl = Cl, fl = Fl;
  const ModelDims& d = s.dims;

  // How each tensor is cut: rows of blocks and a range of columns (stage_layout.h).
  const ParamShard replicated_c = ParamShard::whole(c, 1);
  const ParamShard vocab_rows{v, c, {static_cast<std::size_t>(vocab0)}, v / tp, 0, c};
  auto rows = [&](std::size_t full, std::size_t cols, std::vector<std::size_t> begins, std::size_t n) {
    return ParamShard{full, cols, std::move(begins), n, 0, cols};
  };
  auto columns = [&](std::size_t full_rows, std::size_t full_cols, std::size_t begin, std::size_t n) {
    return ParamShard{full_rows, full_cols, {0}, full_rows, begin, n};
  };
  const std::vector<std::size_t> qkv_rows{r * cl, c + r * cl, 2 * c + r * cl};  // this shard's heads' q, k, v

  // Parameters in gradient-completion order: head, blocks from last to first, embedding.
  std::vector<std::size_t> params_end;  // per unit: its parameters are [0, params_end)
  auto end_unit = [&](UnitKind k, int b) {
    units.push_back({.kind = k, .block = b});
    params_end.push_back(params.size());
  };
  if (s.has_head) {
    if (!d.tied_embeddings)
      head_w = add_param("lm_head.weight", vocab_rows, Init::normal, true);
    else if (!s.has_embedding)
      head_w = wte = add_param("wte", vocab_rows, Init::normal, true);  // the last stage's copy
    lnf_w = add_param("lnf.weight", replicated_c, Init::ones, false);
    lnf_b = add_param("lnf.bias", replicated_c, Init::zeros, false);
    end_unit(UnitKind::head, -1);
  }
  blocks.resize(L);
  for (int li = L - 1; li >= 0; --li) {
    const std::string pre = "block." + std::to_string(s.first_layer + li) + ".";
    BlockParams& bp = blocks[li];
    bp.mlp_proj_w = add_param(pre + "mlp.proj.weight", columns(c, f, r * fl, fl), Init::normal_residual, true);
    bp.mlp_proj_b = add_param(pre + "mlp.proj.bias", replicated_c, Init::zeros, false);
    bp.fc_w = add_param(pre + "mlp.fc.weight", rows(f, c, {r * fl}, fl), Init::normal, true);
    bp.fc_b = add_param(pre + "mlp.fc.bias", rows(f, 1, {r * fl}, fl), Init::zeros, false);
    bp.ln2_w = add_param(pre + "ln2.weight", replicated_c, Init::ones, false);
    bp.ln2_b = add_param(pre + "ln2.bias", replicated_c, Init::zeros, false);
    bp.attn_proj_w = add_param(pre + "attn.proj.weight", columns(c, c, r * cl, cl), Init::normal_residual, true);
    bp.attn_proj_b = add_param(pre + "attn.proj.bias", replicated_c, Init::zeros, false);
    bp.qkv_w = add_param(pre + "attn.qkv.weight", rows(3 * c, c, qkv_rows, cl), Init::normal, true);
    bp.qkv_b = add_param(pre + "attn.qkv.bias", rows(3 * c, 1, qkv_rows, cl), Init::zeros, false);
    bp.ln1_w = add_param(pre + "ln1.weight", replicated_c, Init::ones, false);
    bp.ln1_b = add_param(pre + "ln1.bias", replicated_c, Init::zeros, false);
    end_unit(UnitKind::block, li);
  }
  if (s.has_embedding) {
    wte = add_param("wte", vocab_rows, Init::normal, true);
    wpe = add_param("wpe", ParamShard::whole(static_cast<std::size_t>(T), c), Init::normal, true);
    if (s.has_head && d.tied_embeddings) head_w = wte;
    end_unit(UnitKind::embedding, -1);
  }
  std::size_t offset = 0, largest = 0;
  for (ParamInfo& p : params) {
    p.offset = offset;
    offset += p.size;
    largest = std::max(largest, p.size);
  }
  // A unit's gradients end where its last parameter ends.
  for (std::size_t i = 0; i < units.size(); ++i) {
    const std::size_t end = params_end[i];
    units[i].grads_end = end > 0 ? params[end - 1].offset + params[end - 1].size : 0;
  }

  master = floats(offset);
  grads = floats(offset);
  if (s.compute != DType::fp32) working = floats(offset);
  fast_grads = s.compute == DType::fp32 && s.grad_accumulation == DType::fp32;

  tmp = floats(N * c);
  dgelu = floats(N * fl);
  datt = floats(N * cl);
  attn_scratch = floats(static_cast<std::size_t>(Tq) * T);
  if (cp > 1) {
    const std::size_t kv = static_cast<std::size_t>(B) * T * 2 * cl;
    kv_all = floats(kv);
    dkv_all = floats(kv);
    for (int i = 0; i < cp; ++i) rank_positions.push_back(context_parallel_positions(T, cp, i));
  }
  if (!fast_grads) {
    wscratch = floats(largest);
    bscratch = floats(std::max(largest, static_cast<std::size_t>(T) * c));
  }
  shared_grads = make_block_grads<Buffer>(shape(), make);
  if (tp > 1 && s.has_head) ce = floats(3 * N);
  if (sp) {
    gathered = floats(N * c);
    dy_full = floats(N * c);
    dx1_full = floats(N * c);
    norm_partials = floats(4 * c);
  }
  if (s.recompute == Recompute::selective) redo.probs = floats(static_cast<std::size_t>(B) * Hl * Tq * T);
  if (s.recompute == Recompute::full) {
    redo.block = make_block_stash<Buffer>(shape(), {}, make);
    redo.out = floats(Nl * c);
  }
  if (s.recompute == Recompute::selective_op) {
    redo.block = make_block_stash<Buffer>(shape(), {.products = false}, make);
    if (!s.has_head && L > 0) redo.out = floats(Nl * c);  // the stage's output, passed on
  }
}

std::unique_ptr<StageModel::Impl::StashT> StageModel::Impl::new_stash() {
  return std::make_unique<StashT>(make_stash<Buffer, Ids>(
      shape(), spec.has_embedding, spec.has_head, [this](int li) { return spec.recompute_of(li); }, false, make,
      [](std::size_t n) { return Ids(n); }));
}

std::unique_ptr<StageModel::Impl::BackwardT> StageModel::Impl::new_backward(bool split) {
  return std::make_unique<BackwardT>(make_backward<Buffer>(shape(), spec.has_head, split, make));
}

void StageModel::Impl::refresh_working() {
  if (spec.compute == DType::fp32) return;
  // Tensor by tensor, each rounded while its copy is still in cache: one pass over the weights'
  // memory, as a framework's cast of its master weights to the compute format is. (Elements no
  // tensor names, if any, are copied as they are.)
  std::size_t named = 0;
  for (const ParamInfo& p : params) named += p.size;
  if (named != master.size()) std::copy(master.begin(), master.end(), working.begin());
  for (const ParamInfo& p : params) {
    std::copy_n(master.begin() + static_cast<std::ptrdiff_t>(p.offset), p.size,
                working.begin() + static_cast<std::ptrdiff_t>(p.offset));
    record(round_and_scan(spec.compute, working.data() + p.offset, p.size), Tag{p.name.c_str(), -1, " working copy"},
           false, -1);
  }
}

void check_forward_arguments(const StageSpec& spec, const char* who, const std::int32_t* tokens,
                             const std::int32_t* targets, bool has_input) {
  const std::size_t n = static_cast<std::size_t>(spec.micro_batch_size) * spec.dims.seq_length /
                        static_cast<std::size_t>(std::max(1, spec.context_parallel_size));
  const int V = spec.dims.vocab_size;
  auto check_ids = [&](const std::int32_t* ids, const char* what) {
    if (!ids) throw std::invalid_argument(std::string(who) + ": this stage needs " + what);
    for (std::size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= V)
        throw std::out_of_range(std::string(who) + ": " + what + "[" + std::to_string(i) + "] = " +
                                std::to_string(ids[i]) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
  };
  if (spec.has_embedding)
    check_ids(tokens, "tokens");
  else if (!has_input)
    throw std::invalid_argument(std::string(who) + ": this stage needs an input activation");
  if (spec.has_head) check_ids(targets, "targets");
}

// ---------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------
float StageModel::Impl::forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const float* input,
                                float* output) {
  check_forward_arguments(spec, "StageModel::forward", tokens, targets, input != nullptr);
  if (tp > 1) tp_group();  // a shard without its groups fails before it keeps anything
  if (cp > 1) context_group();

  StashT& s = *slots.begin_forward(mb, [&] { return new_stash(); }).stash;
  const std::size_t nlc = Nl * C;

  float* x0 = s.x[0].data();
  if (spec.has_embedding) {
    std::copy(tokens, tokens + N, s.tokens.begin());
    gate.take(WeightPiece::embedding);
    if (tp == 1) {
      layers::embedding_forward(x0, tokens, w(wte), w(wpe), B, Tq, C, positions.data());
    } else {
      // Vocabulary-parallel: each shard looks up the tokens it holds, the group sums the rows
      // (one shard's row and zeros: exact in any format), then the position embedding.
      layers::embedding_shard_forward(tmp.data(), tokens, w(wte), vocab0, Vl, static_cast<int>(N), C);
      const float* rows = reduce_rows(tmp.data(), C);
      std::copy(rows, rows + nlc, x0);
      layers::add_position_embedding(x0, w(wpe), row0, Nl, Tq, C, positions.data());
    }
    gate.give(WeightPiece::embedding);
    finish(x0, nlc, Tag{"embedding output"}, false, mb);
  } else {
    std::copy(input, input + nlc, x0);
    finish(x0, nlc, Tag{"stage input"}, false, mb);
  }
  for (int li = 0; li < L; ++li) {
    gate.take(WeightPiece::block, li);
    {
      const BlockClock clock(block_seconds, true);
      forward_block(li, s, mb);
    }
    gate.give(WeightPiece::block, li);
  }
  if (!spec.has_head) {
    const float* xl = stage_output(s).data();
    if (output) std::copy(xl, xl + nlc, output);
    return 0;
  }
  std::copy(targets, targets + N, s.targets.begin());
  gate.take(WeightPiece::head);
  const float loss = head_forward(s, mb);
  gate.give(WeightPiece::head);
  return loss;
}

float StageModel::Impl::head_forward(StashT& s, int mb) {
  const float* xl = s.x[L].data();
  // The final norm over the shard's rows, kept as they are: the LM head, column-parallel over the
  // vocabulary, reads all N rows, gathered under sequence parallelism into scratch, and its weight
  // pass gathers them again (Megatron-LM's output layer keeps its input sharded so).
  layers::layernorm_forward(s.lnf.data(), s.meanf.data(), s.rstdf.data(), xl, w(lnf_w), w(lnf_b), Nl, C);
  finish(s.lnf.data(), Nl * C, Tag{"lnf output"}, false, mb);
  layers::linear_forward(s.logits.data(), gather_rows(s.lnf.data(), gathered, C), w(head_w),
                         static_cast<const float*>(nullptr), N, C, Vl);
  finish(s.logits.data(), s.logits.size(), Tag{"logits"}, false, mb);
  float loss;
  if (tp == 1) {
    loss = layers::cross_entropy_forward(s.lse.data(), s.logits.data(), s.targets.data(), N, V);
  } else {
    // Vocabulary-parallel cross-entropy in FP32: the rows' maxima max-reduced, then the shards'
    // sums of exponentials and the targets' logits summed, over the group.
    float* rowmax = ce.data();
    float* sums = ce.data() + N;
    layers::cross_entropy_shard_max(rowmax, s.logits.data(), static_cast<int>(N), Vl);
    tp_group().all_reduce({rowmax, N}, ReduceOp::max, DType::fp32);
    layers::cross_entropy_shard_sums(sums, s.logits.data(), rowmax, s.targets.data(), vocab0,
                                     static_cast<int>(N), Vl);
    tp_group().all_reduce({sums, 2 * N}, ReduceOp::sum, DType::fp32);
    loss = layers::cross_entropy_shard_loss(s.lse.data(), rowmax, sums, static_cast<int>(N));
  }
  float l = loss;
  record(scan(&l, 1), Tag{"loss"}, false, mb);
  return loss;
}

void StageModel::Impl::block_forward(int li, StashT& s, int mb, bool rebuild_op) {
  const BlockParams& p = blocks[li];
  BlockStash<Buffer>& b = s.blocks[li];
  const int layer = spec.first_layer + li;
  const std::size_t nlc = Nl * C;
  const float* x0 = s.x[li].data();
  float* x2 = s.x[li + 1].data();
  auto done = [&](Buffer& t, const char* what) { finish(t.data(), t.size(), Tag{what, layer}, false, mb); };

  layers::layernorm_forward(b.ln1.data(), b.mean1.data(), b.rstd1.data(), x0, w(p.ln1_w), w(p.ln1_b), Nl, C);
  done(b.ln1, "ln1 output");
  if (!rebuild_op) {
    layers::linear_forward(b.qkv.data(), gather_rows(b.ln1.data(), gathered, C), w(p.qkv_w), w(p.qkv_b), N, C,
                           3 * Cl);
    done(b.qkv, "attn.qkv output");
  }
  // Rebuilding, the attention output goes to datt (N,Cl), scratch until the block's input pass:
  // attn.proj reads the kept one.
  float* att = rebuild_op ? datt.data() : b.att.data();
  attention_core(att, b.probs.data(), b.qkv.data(), [&](float* row, int n, AttnTensor t) {
    finish(row, n, Tag{attn_name(t), layer}, false, mb);
  });
  finish(att, b.att.size(), Tag{"attn output", layer}, false, mb);
  const float* y = row_parallel(b.att.data(), p.attn_proj_w, p.attn_proj_b, Cl, Tag{"attn.proj output", layer}, mb);
  Row(b.x1.data(), nlc) = ConstRow(x0, nlc) + ConstRow(y, nlc);
  done(b.x1, "attn residual");
  layers::layernorm_forward(b.ln2.data(), b.mean2.data(), b.rstd2.data(), b.x1.data(), w(p.ln2_w), w(p.ln2_b), Nl, C);
  done(b.ln2, "ln2 output");
  if (!rebuild_op) {
    layers::linear_forward(b.fc.data(), gather_rows(b.ln2.data(), gathered, C), w(p.fc_w), w(p.fc_b), N, C, Fl);
    done(b.fc, "mlp.fc output");
  }
  layers::gelu_forward(b.gelu.data(), b.fc.data(), b.fc.size());
  done(b.gelu, "mlp.gelu output");
  if (rebuild_op) return;
  y = row_parallel(b.gelu.data(), p.mlp_proj_w, p.mlp_proj_b, Fl, Tag{"mlp.proj output", layer}, mb);
  Row(x2, nlc) = ConstRow(b.x1.data(), nlc) + ConstRow(y, nlc);
  finish(x2, nlc, Tag{"output", layer}, false, mb);
}

// ---------------------------------------------------------------------------------------
// Activation recompute: what the stash keeps, and rebuilding the rest in a block's backward
// ---------------------------------------------------------------------------------------
void StageModel::Impl::forward_block(int li, StashT& s, int mb) {
  const Recompute recompute = spec.recompute_of(li);
  switch (recompute) {
    case Recompute::none:
      block_forward(li, s, mb);
      return;
    case Recompute::selective:  // the softmax output goes to the workspace, not the stash
      std::swap(s.blocks[li].probs, redo.probs);
      block_forward(li, s, mb);
      std::swap(s.blocks[li].probs, redo.probs);
      return;
    case Recompute::full:            // the whole block goes to the workspace,
    case Recompute::selective_op: {  // or all but qkv, att and fc; the output stays only as the next input
      auto to_workspace = [&] {
        if (recompute == Recompute::full)
          std::swap(s.blocks[li], redo.block);
        else
          swap_op_rebuilt(s.blocks[li], redo.block);
      };
      to_workspace();
      const bool kept = !s.x[li + 1].empty();
      if (!kept) std::swap(s.x[li + 1], redo.out);
      block_forward(li, s, mb);
      if (!kept) std::swap(s.x[li + 1], redo.out);
      to_workspace();  // and back
      return;
    }
  }
}

void StageModel::Impl::rerun_block(int li, StashT& s, int mb) {
  std::swap(s.x[li + 1], redo.out);  // the kept next input is left as it is
  redo.active = true;
  block_forward(li, s, mb);
  redo.active = false;
  std::swap(s.x[li + 1], redo.out);
}

void StageModel::Impl::rebuild(const Unit& u, StashT& s, int mb, bool split) {
  if (u.kind != UnitKind::block) return;
  const int li = u.block;
  const Recompute recompute = spec.recompute_of(li);
  if (recompute == Recompute::none) return;
  BlockStash<Buffer>& st = s.blocks[li];
  if (recompute == Recompute::selective) {  // the softmax output again, from the kept QKV
    const int layer = spec.first_layer + li;
    redo.active = true;
    attention_core(tmp.data(), redo.probs.data(), st.qkv.data(), [&](float* row, int n, AttnTensor t) {
      finish(row, n, Tag{attn_name(t), layer}, false, mb);
    });
    redo.active = false;
    std::swap(st.probs, redo.probs);
    return;
  }
  if (recompute == Recompute::selective_op) {  // from the kept input, qkv, att and fc
    if (!split) {
      swap_op_rebuilt(st, redo.block);
    } else {  // in the stash what the weight pass, later, reads; the softmax output in the workspace
      BlockStash<Buffer> room = make_block_stash<Buffer>(shape(), {.products = false, .probs = false}, make);
      swap_op_rebuilt(st, room);
      std::swap(st.probs, redo.block.probs);
      st.kept = true;
    }
    redo.active = true;
    block_forward(li, s, mb, true);
    redo.active = false;
    return;
  }
  if (!split) {
    std::swap(st, redo.block);
  } else {  // rebuilt in the stash: the weight pass, later, reads what the input pass leaves
    st = make_block_stash<Buffer>(shape(), {}, make);
    st.kept = true;
  }
  rerun_block(li, s, mb);
}

void StageModel::Impl::drop_rebuilt(const Unit& u, StashT& s, bool weights_done) {
  if (u.kind != UnitKind::block) return;
  const Recompute recompute = spec.recompute_of(u.block);
  if (recompute == Recompute::none) return;
  BlockStash<Buffer>& st = s.blocks[u.block];
  if (recompute == Recompute::selective)
    std::swap(st.probs, redo.probs);
  else if (recompute == Recompute::selective_op && weights_done)
    swap_op_rebuilt(st, redo.block);
  else if (recompute == Recompute::selective_op)  // the weight pass reads all but the softmax output
    std::swap(st.probs, redo.block.probs);
  else if (weights_done)
    std::swap(st, redo.block);
  else  // the weight pass needs the products' inputs (ln1, att, ln2, gelu) and ln2's (x1), not these
    st.qkv = st.probs = st.fc = Buffer();
}

// ---------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------
StageModel::Impl::Slot& StageModel::Impl::begin(int mb, const float* grad_output, float scale, bool split) {
  if (!spec.has_head && !grad_output)
    throw std::invalid_argument("StageModel: this stage's backward needs grad_output");
  Slot& sl = slots.begin_backward(mb, split, [&](bool s) { return new_backward(s); });
  StashT& s = *sl.stash;
  BackwardT& b = *sl.backward;
  if (spec.has_head) {
    const float row_scale = scale / static_cast<float>(N);
    if (tp == 1)
      layers::cross_entropy_backward(b.dlogits.data(), s.logits.data(), s.lse.data(), s.targets.data(), N, V, row_scale);
    else
      layers::cross_entropy_shard_backward(b.dlogits.data(), s.logits.data(), s.lse.data(), s.targets.data(), vocab0,
                                           static_cast<int>(N), Vl, row_scale);
    finish(b.dlogits.data(), b.dlogits.size(), Tag{"logits gradient"}, true, mb);
  } else {
    float* d = b.res(L).data();
    std::copy(grad_output, grad_output + Nl * C, d);
    finish(d, Nl * C, Tag{"stage output gradient"}, true, mb);
  }
  return sl;
}

void StageModel::Impl::unit_input(const Unit& u, StashT& s, BackwardT& b, int mb) {
  switch (u.kind) {
    case UnitKind::head: {
      column_parallel_input_grad(b.dlnf.data(), b.dlogits.data(), w(head_w), Vl, Tag{"lnf output gradient"}, mb);
      float* dx = b.res(L).data();
      layers::layernorm_backward_input(dx, b.dlnf.data(), s.x[L].data(), s.meanf.data(), s.rstdf.data(), w(lnf_w),
                                       static_cast<const float*>(nullptr), Nl, C);
      finish(dx, Nl * C, Tag{"lnf input gradient"}, true, mb);
      break;
    }
    case UnitKind::block:
      block_backward_input(u.block, s, b, mb);
      break;
    case UnitKind::embedding:
      break;  // no input gradient below the embedding
  }
}

void StageModel::Impl::unit_weight(const Unit& u, StashT& s, BackwardT& b, int mb) {
  switch (u.kind) {
    case UnitKind::head:
      wgrad_linear(head_w, -1, b.dlogits.data(), gather_rows(s.lnf.data(), gathered, C), C, Vl, mb);
      wgrad_layernorm(lnf_w, lnf_b, b.dlnf.data(), s.x[L].data(), s.meanf.data(), s.rstdf.data(), mb);
      flush_norms(mb);
      break;
    case UnitKind::block:
      block_backward_weight(u.block, s, b, mb);
      break;
    case UnitKind::embedding:
      // Under sequence parallelism the shard gathers every row's gradient: its vocabulary rows
      // see tokens from all of them, and the position embedding (replicated) then gets the same
      // whole gradient on every shard.
      wgrad_embedding(gather_rows(b.res(0).data(), tmp, C), s.tokens.data(), mb);
      break;
  }
}

void StageModel::Impl::block_backward_input(int li, StashT& s, BackwardT& b, int mb) {
  const BlockParams& p = blocks[li];
  const BlockStash<Buffer>& st = s.blocks[li];
  Grads& g = b.split ? b.blocks[li] : shared_grads;
  const int layer = spec.first_layer + li;
  const std::size_t nlc = Nl * C;
  const float* dx2 = b.res(li + 1).data();  // gradient of the block's output (the shard's rows)
  float* dx0 = b.res(li).data();            // gradient of its input
  auto done = [&](float* t, std::size_t n, const char* what) { finish(t, n, Tag{what, layer}, true, mb); };

  // mlp.proj is row-parallel: its input gradient needs the output gradient of every row.
  layers::linear_backward_input(dgelu.data(), gather_rows(dx2, dy_full, C), w(p.mlp_proj_w), N, Fl, C);
  done(dgelu.data(), dgelu.size(), "mlp.gelu output gradient");
  layers::gelu_backward(g.dfc.data(), st.fc.data(), dgelu.data(), dgelu.size());
  done(g.dfc.data(), g.dfc.size(), "mlp.fc output gradient");
  column_parallel_input_grad(g.dln2.data(), g.dfc.data(), w(p.fc_w), Fl, Tag{"ln2 output gradient", layer}, mb);
  layers::layernorm_backward_input(g.dx1.data(), g.dln2.data(), st.x1.data(), st.mean2.data(), st.rstd2.data(),
                                   w(p.ln2_w), dx2, Nl, C);
  done(g.dx1.data(), nlc, "attn residual gradient");
  layers::linear_backward_input(datt.data(), gather_rows(g.dx1.data(), dx1_full, C), w(p.attn_proj_w), N, Cl, C);
  done(datt.data(), datt.size(), "attn output gradient");
  attention_core_backward(g.dqkv.data(), datt.data(), st.qkv.data(), st.probs.data(),
                          [&](float* row, int n, AttnTensor t) { done(row, n, attn_name(t)); });
  done(g.dqkv.data(), g.dqkv.size(), "attn.qkv output gradient");
  column_parallel_input_grad(g.dln1.data(), g.dqkv.data(), w(p.qkv_w), 3 * Cl, Tag{"ln1 output gradient", layer},
                             mb);
  layers::layernorm_backward_input(dx0, g.dln1.data(), s.x[li].data(), st.mean1.data(), st.rstd1.data(), w(p.ln1_w),
                                   g.dx1.data(), Nl, C);
  done(dx0, nlc, "input gradient");
}

void StageModel::Impl::block_backward_weight(int li, StashT& s, BackwardT& b, int mb) {
  const BlockParams& p = blocks[li];
  const BlockStash<Buffer>& st = s.blocks[li];
  const Grads& g = b.split ? b.blocks[li] : shared_grads;
  // All rows of the output and attn residual gradients: the unsplit backward's input pass has just
  // gathered them (sequence parallelism); the split one's ran long ago, so gather them again.
  const float* dy = b.res(li + 1).data();
  const float* dx1 = g.dx1.data();
  if (sp) {
    dy = b.split ? gather_rows(dy, dy_full, C) : dy_full.data();
    dx1 = b.split ? gather_rows(dx1, dx1_full, C) : dx1_full.data();
  }
  wgrad_linear(p.mlp_proj_w, p.mlp_proj_b, dy, st.gelu.data(), Fl, C, mb);
  wgrad_linear(p.fc_w, p.fc_b, g.dfc.data(), gather_rows(st.ln2.data(), gathered, C), C, Fl, mb);
  wgrad_layernorm(p.ln2_w, p.ln2_b, g.dln2.data(), st.x1.data(), st.mean2.data(), st.rstd2.data(), mb);
  wgrad_linear(p.attn_proj_w, p.attn_proj_b, dx1, st.att.data(), Cl, C, mb);
  wgrad_linear(p.qkv_w, p.qkv_b, g.dqkv.data(), gather_rows(st.ln1.data(), gathered, C), C, 3 * Cl, mb);
  wgrad_layernorm(p.ln1_w, p.ln1_b, g.dln1.data(), s.x[li].data(), st.mean1.data(), st.rstd1.data(), mb);
  flush_norms(mb);
}

// One micro-batch's gradient of parameter p, as produced: rounded to the compute format, added
// into the accumulation buffer, the sum rounded to grad_accumulation.
void StageModel::Impl::commit(int p, float* produced, int mb) {
  const ParamInfo& pi = params[p];
  finish(produced, pi.size, Tag{pi.name.c_str(), -1, " gradient"}, true, mb);
  float* acc = g(p);
  Row(acc, pi.size) += ConstRow(produced, pi.size);
  record(round_and_scan(spec.grad_accumulation, acc, pi.size), Tag{pi.name.c_str(), -1, " gradient accumulation"}, true,
         mb);
}

// A product's weight (and bias) gradients over all N rows.
void StageModel::Impl::wgrad_linear(int pw, int pb, const float* dy, const float* x, int in, int out, int mb) {
  if (fast_grads) {
    layers::linear_backward_weight(g(pw), pb >= 0 ? g(pb) : nullptr, dy, x, N, in, out, true);
    scan_accumulated(pw, mb);
    if (pb >= 0) scan_accumulated(pb, mb);
    return;
  }
  layers::linear_backward_weight(wscratch.data(), pb >= 0 ? bscratch.data() : nullptr, dy, x, N, in, out, false);
  commit(pw, wscratch.data(), mb);
  if (pb >= 0) commit(pb, bscratch.data(), mb);
}

// A norm's gradients over the shard's rows. Under sequence parallelism those are 1/tp of the rows:
// the partial sums wait in norm_partials until flush_norms sums them over the group, so every
// shard commits the same whole gradient (the norms stay replicated).
void StageModel::Impl::wgrad_layernorm(int pw, int pb, const float* dy, const float* x, const float* mean,
                                       const float* rstd, int mb) {
  if (sp) {
    float* at = norm_partials.data() + pending_norms.size() * 2 * C;
    std::fill_n(at, 2 * C, 0.0f);
    layers::layernorm_backward_weight(at, at + C, dy, x, mean, rstd, Nl, C);
    pending_norms.push_back({pw, pb});
    return;
  }
  if (fast_grads) {
    layers::layernorm_backward_weight(g(pw), g(pb), dy, x, mean, rstd, N, C);
    scan_accumulated(pw, mb);
    scan_accumulated(pb, mb);
    return;
  }
  std::fill_n(wscratch.begin(), C, 0.0f);
  std::fill_n(bscratch.begin(), C, 0.0f);
  layers::layernorm_backward_weight(wscratch.data(), bscratch.data(), dy, x, mean, rstd, N, C);
  commit(pw, wscratch.data(), mb);
  commit(pb, bscratch.data(), mb);
}

void StageModel::Impl::flush_norms(int mb) {
  if (pending_norms.empty()) return;
  const std::size_t n = pending_norms.size() * 2 * C;
  tp_group().all_reduce({norm_partials.data(), n}, ReduceOp::sum, DType::fp32);
  for (std::size_t i = 0; i < pending_norms.size(); ++i) {
    const int pair[2] = {pending_norms[i].pw, pending_norms[i].pb};
    for (int j = 0; j < 2; ++j) {
      float* produced = norm_partials.data() + (2 * i + j) * C;
      if (fast_grads) {
        Row(g(pair[j]), C) += ConstRow(produced, C);
        scan_accumulated(pair[j], mb);
      } else {
        commit(pair[j], produced, mb);
      }
    }
  }
  pending_norms.clear();
}

// The embedding's gradients from all N rows' gradient dx: wte's (the shard's vocabulary rows) and wpe's.
void StageModel::Impl::wgrad_embedding(const float* dx, const std::int32_t* tokens, int mb) {
  const int n = static_cast<int>(N);
  auto scatter = [&](float* dwte, float* dwpe) {
    if (tp == 1)
      layers::embedding_backward(dwte, dwpe, dx, tokens, B, Tq, C, positions.data());
    else
      layers::embedding_shard_backward(dwte, dwpe, dx, tokens, vocab0, Vl, n, Tq, C, positions.data());
  };
  if (fast_grads) {
    scatter(g(wte), g(wpe));
    scan_accumulated(wte, mb);
    scan_accumulated(wpe, mb);
    return;
  }
  std::fill_n(wscratch.begin(), params[wte].size, 0.0f);
  std::fill_n(bscratch.begin(), params[wpe].size, 0.0f);
  scatter(wscratch.data(), bscratch.data());
  commit(wte, wscratch.data(), mb);
  commit(wpe, bscratch.data(), mb);
}

// ---------------------------------------------------------------------------------------
// StageModel
// ---------------------------------------------------------------------------------------
StageModel::StageModel(const StageSpec& spec) : impl_(std::make_unique<Impl>(spec)) {}
StageModel::~StageModel() = default;
StageModel::StageModel(StageModel&&) noexcept = default;
StageModel& StageModel::operator=(StageModel&&) noexcept = default;

const StageSpec& StageModel::spec() const { return impl_->spec; }

void StageModel::set_tensor_parallel_group(ModelParallelGroup* group) { impl_->group = group; }
void StageModel::set_context_parallel_group(ModelParallelGroup* group) { impl_->cp_group = group; }

void StageModel::init(std::uint64_t seed) {
  Impl& m = *impl_;
  const double std_residual = 0.02 / std::sqrt(2.0 * std::max(1, m.spec.dims.num_layers));
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const ParamInfo& p = m.params[i];
    const ParamShard& shard = p.shard;
    float* w = m.master.data() + p.offset;
    const std::uint64_t key = splitmix64_mix(seed ^ splitmix64_mix(hash_name(p.name)));
    switch (m.inits[i]) {
      case Init::ones:
        std::fill_n(w, p.size, 1.0f);
        break;
      case Init::zeros:
        std::fill_n(w, p.size, 0.0f);
        break;
      case Init::normal:
      case Init::normal_residual: {
        // A shard draws the whole tensor's values at its elements' places in it.
        const double sd = m.inits[i] == Init::normal ? 0.02 : std_residual;
        for (std::size_t k = 0; k < p.size; ++k) w[k] = static_cast<float>(sd * normal_at(key, shard.global_index(k)));
        break;
      }
    }
  }
  m.refresh_working();
}

std::span<float> StageModel::master_weights() { return impl_->master; }
std::span<float> StageModel::gradients() { return impl_->grads; }
const std::vector<ParamInfo>& StageModel::params() const { return impl_->params; }
void StageModel::zero_gradients() { std::fill(impl_->grads.begin(), impl_->grads.end(), 0.0f); }
void StageModel::refresh_working_weights() { impl_->refresh_working(); }
std::span<float> StageModel::compute_weights() {
  return impl_->spec.compute == DType::fp32 ? std::span<float>(impl_->master) : std::span<float>(impl_->working);
}
void StageModel::set_weight_gate(WeightGate* gate) { impl_->gate.gate = gate; }

ParamInfo StageModel::token_embedding() const {
  if (impl_->wte < 0) return ParamInfo{};
  return impl_->params[impl_->wte];
}

std::size_t StageModel::activation_elements() const { return impl_->Nl * impl_->C; }

float StageModel::forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const float* input,
                          float* output) {
  return impl_->forward(mb, tokens, targets, input, output);
}

void StageModel::backward_begin(int mb, const float* grad_output, float loss_gradient_scale) {
  impl_->begin(mb, grad_output, loss_gradient_scale, false);
}

int StageModel::backward_units() const { return static_cast<int>(impl_->units.size()); }

void StageModel::backward_unit(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.next_unit(mb, m.units.size());
  const Impl::Unit& u = m.units[sl.units_done];
  if (u.reads_weights()) m.gate.take(u.piece(), u.block);
  {
    const auto clock = m.unit_clock(u);
    m.rebuild(u, *sl.stash, mb, false);
    m.unit_input(u, *sl.stash, *sl.backward, mb);
  }
  if (u.reads_weights()) m.gate.give(u.piece(), u.block);
  {
    const auto clock = m.unit_clock(u);
    m.unit_weight(u, *sl.stash, *sl.backward, mb);
  }
  m.drop_rebuilt(u, *sl.stash, true);
  ++sl.units_done;
}

std::size_t StageModel::gradients_complete(int mb) const {
  const Impl& m = *impl_;
  return m.slots.gradients_complete(mb, m.grads.size(), [&](int i) { return m.units[i].grads_end; });
}

void StageModel::backward_end(int mb, float* grad_input) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.finish_whole(mb, m.units.size());
  if (!m.spec.has_embedding && grad_input) {
    const float* d = sl.backward->res(0).data();
    std::copy(d, d + m.Nl * m.C, grad_input);
  }
  m.release(sl);
}

void StageModel::backward_input(int mb, const float* grad_output, float loss_gradient_scale, float* grad_input) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.begin(mb, grad_output, loss_gradient_scale, true);
  for (const Impl::Unit& u : m.units) {
    if (u.reads_weights()) m.gate.take(u.piece(), u.block);
    {
      const auto clock = m.unit_clock(u);
      m.rebuild(u, *sl.stash, mb, true);
      m.unit_input(u, *sl.stash, *sl.backward, mb);
    }
    if (u.reads_weights()) m.gate.give(u.piece(), u.block);
    m.drop_rebuilt(u, *sl.stash, false);
  }
  sl.backward->inputs_done = true;
  if (!m.spec.has_embedding && grad_input) {
    const float* d = sl.backward->res(0).data();
    std::copy(d, d + m.Nl * m.C, grad_input);
  }
}

void StageModel::backward_weight(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.weight_pass(mb);
  for (; sl.units_done < static_cast<int>(m.units.size()); ++sl.units_done) {
    const Impl::Unit& u = m.units[sl.units_done];
    const auto clock = m.unit_clock(u);
    m.unit_weight(u, *sl.stash, *sl.backward, mb);
  }
  m.release(sl);
}

void StageModel::backward_weight_unit(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slots.next_weight_unit(mb, m.units.size());
  const Impl::Unit& u = m.units[sl.units_done];
  {
    const auto clock = m.unit_clock(u);
    m.unit_weight(u, *sl.stash, *sl.backward, mb);
  }
  ++sl.units_done;
}

double StageModel::take_block_seconds() {
  const double s = impl_->block_seconds;
  impl_->block_seconds = 0;
  return s;
}

std::size_t StageModel::master_weight_bytes() const { return impl_->master.size() * sizeof(float); }
std::size_t StageModel::working_weight_bytes() const {
  return impl_->spec.compute == DType::fp32 ? 0 : impl_->working.size() * dtype_bytes(impl_->spec.compute);
}
std::size_t StageModel::gradient_bytes() const {
  return impl_->grads.size() * dtype_bytes(impl_->spec.grad_accumulation);
}
std::size_t StageModel::activation_bytes() const {
  const Impl& m = *impl_;
  std::size_t bytes = 0;
  auto count = [&](const Buffer& b, Held h) { bytes += m.held_bytes(b.size(), h); };
  for (const Impl::Slot& sl : m.slots.all()) {
    if (sl.stash)
      bytes += stash_bytes(
          *sl.stash, [&](int li) { return m.spec.recompute_of(li); },
          [&](const Buffer& b, Held h) { return m.held_bytes(b.size(), h); },
          [](const Impl::Ids& ids) { return ids.size() * sizeof(std::int32_t); });
    if (sl.backward) for_each_tensor(*sl.backward, count);
  }
  return bytes;
}

std::size_t StageModel::backward_workspace_bytes() const {
  const Impl& m = *impl_;
  std::size_t bytes = m.held_bytes(m.redo.probs.size() + m.redo.out.size() + m.kv_all.size() + m.dkv_all.size(),
                                   Held::compute);
  for (const Buffer* t : {&m.redo.block.ln1, &m.redo.block.qkv, &m.redo.block.probs, &m.redo.block.att,
                          &m.redo.block.x1, &m.redo.block.ln2, &m.redo.block.fc, &m.redo.block.gelu})
    bytes += m.held_bytes(t->size(), Held::compute);
  for (const Buffer* t : {&m.redo.block.mean1, &m.redo.block.rstd1, &m.redo.block.mean2, &m.redo.block.rstd2})
    bytes += m.held_bytes(t->size(), Held::f32);
  return bytes;
}

StageNumerics& StageModel::numerics() { return impl_->numerics; }

std::span<const float> StageModel::working_weights() const {
  return impl_->spec.compute == DType::fp32 ? impl_->master : impl_->working;
}

std::vector<StageModel::NamedTensor> StageModel::stashed_tensors(int mb) const {
  const Impl& m = *impl_;
  std::vector<NamedTensor> out;
  const Impl::Slot* sl = m.slots.find(mb);
  if (!sl || !sl->stash) return out;
  for_each_tensor(
      *sl->stash,
      [&](const char* what, int li, const Buffer& b, Held h) {
        if (h != Held::compute || b.empty()) return;
        std::string name = what;
        if (li >= 0)
          name = "block " + std::to_string(m.spec.first_layer + li) + " " + name;
        else if (m.spec.has_embedding && name == "stage input")
          name = "embedding output";
        out.push_back({std::move(name), b});
      },
      [](const Impl::Ids&) {});
  return out;
}

}  // namespace trainsim::runtime
