// What one stage of the decoder holds, written once for every device: its sizes as a tensor-
// parallel shard sees them (StageShape), and the layout of the per-micro-batch stash and backward
// buffers, templated over the buffer type so the CPU StageModel (host vectors) and the CUDA stage
// model (device buffers) allocate, count and name the very same tensors.
//
// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): a shard of `tp` holds 1/tp of every
// block's heads (qkv: its heads' q, k and v rows; attn.proj: the matching input columns), 1/tp of
// the MLP's hidden units (mlp.fc rows, mlp.proj columns) and 1/tp of the vocabulary (wte / the LM
// head rows). Sequence parallelism (Korthikanti et al. 2022) splits the residual stream's rows
// over the shards as well: shard r holds rows [r*N/tp, (r+1)*N/tp) of the micro-batch's N = B*T
// rows (with micro_batch_size 1, a slice of the sequence), where the layer norms, residual adds
// and position embeddings run; the products see all N rows (gathered).
//
// Context parallelism (Llama 3, Dubey et al. 2024, section 3.3.2; PyTorch's context_parallel with
// load balancing; Megatron-Core): each sequence of T tokens is cut into 2 cp chunks of T / (2 cp)
// and rank r holds chunks r and 2 cp - 1 - r, so that every rank's share of the causal attention is
// the same. A stage's micro-batch is then B sequences of Tq = T / cp rows each, at the positions
// context_parallel_positions() gives (increasing); its attention gathers every rank's keys and
// values into the sequence's order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"  // Recompute
#include "runtime/model/stage_model.h"

namespace trainsim::runtime {

// The positions in a T-token sequence of context-parallel rank `rank`'s T / cp rows, in order:
// chunks `rank` and 2 cp - 1 - rank of 2 cp equal chunks (cp = 1: 0 .. T-1). T must divide by 2 cp.
inline std::vector<int> context_parallel_positions(int T, int cp, int rank) {
  std::vector<int> pos;
  if (cp == 1) {
    for (int t = 0; t < T; ++t) pos.push_back(t);
    return pos;
  }
  const int chunk = T / (2 * cp);
  for (const int c : {rank, 2 * cp - 1 - rank})
    for (int t = 0; t < chunk; ++t) pos.push_back(c * chunk + t);
  return pos;
}

// A rank's rows of `whole`'s B sequences of T values (token ids or targets), sequence by sequence
// at context_parallel_positions(T, cp, rank): what its stages read.
template <class T>
std::vector<T> context_parallel_rows(const std::vector<T>& whole, int B, int seq, int cp, int rank) {
  if (cp == 1) return whole;
  const std::vector<int> pos = context_parallel_positions(seq, cp, rank);
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(B) * pos.size());
  for (int b = 0; b < B; ++b)
    for (int p : pos) out.push_back(whole[static_cast<std::size_t>(b) * seq + p]);
  return out;
}

struct StageShape {
  int B = 1, T = 1, C = 1, H = 1, F = 1, V = 1, L = 0;  // the whole model's sizes; L: this stage's blocks
  int tp = 1, tp_rank = 0;
  bool sp = false;
  int cp = 1, cp_rank = 0;
  int Tq = 1;                          // a sequence's rows this stage holds: T / cp
  std::vector<int> positions;          // their positions in the sequence (context_parallel_positions)
  int Cl = 1, Hl = 1, Fl = 1, Vl = 1;  // this shard's: C/tp (its heads' width), H/tp, F/tp, V/tp
  int vocab0 = 0;                      // its first vocabulary row: tp_rank * Vl
  std::size_t N = 1;                   // rows of a micro-batch: B * Tq
  std::size_t Nl = 1;                  // rows of the residual stream it holds: N/tp under SP, else N
  std::size_t row0 = 0;                // the first of them

  // Validates the spec (std::invalid_argument, "StageSpec: ..." with the numbers).
  explicit StageShape(const StageSpec& s) {
    const ModelDims& d = s.dims;
    B = s.micro_batch_size;
    T = d.seq_length;
    C = d.hidden_size;
    H = d.num_heads;
    F = d.ffn();
    V = d.vocab_size;
    L = s.num_layers;
    tp = s.tensor_parallel_size;
    tp_rank = s.tensor_parallel_rank;
    sp = s.sequence_parallel && tp > 1;
    cp = s.context_parallel_size;
    cp_rank = s.context_parallel_rank;
    auto fail = [](const std::string& m) { throw std::invalid_argument("StageSpec: " + m); };
    auto num = [](long v) { return std::to_string(v); };
    if (B < 1 || T < 1 || C < 1 || H < 1 || V < 1 || F < 1 || d.num_layers < 0)
      fail("micro_batch_size(" + num(B) + "), seq_length(" + num(T) + "), hidden_size(" + num(C) + "), num_heads(" +
           num(H) + "), ffn(" + num(F) + ") and vocab_size(" + num(V) + ") must be positive");
    if (C % H != 0) fail("hidden_size(" + num(C) + ") is not a multiple of num_heads(" + num(H) + ")");
    if (s.first_layer < 0 || L < 0 || s.first_layer + L > d.num_layers)
      fail("blocks [" + num(s.first_layer) + ", " + num(s.first_layer + L) + ") are not within the model's " +
           num(d.num_layers) + " layers");
    if (tp < 1 || tp_rank < 0 || tp_rank >= tp)
      fail("tensor-parallel rank " + num(tp_rank) + " of " + num(tp) + " shards");
    if (H % tp != 0) fail("num_heads(" + num(H) + ") is not divisible by tensor_parallel_size(" + num(tp) + ")");
    if (F % tp != 0) fail("ffn(" + num(F) + ") is not divisible by tensor_parallel_size(" + num(tp) + ")");
    if (V % tp != 0) fail("vocab_size(" + num(V) + ") is not divisible by tensor_parallel_size(" + num(tp) + ")");
    if (cp < 1 || cp_rank < 0 || cp_rank >= cp)
      fail("context-parallel rank " + num(cp_rank) + " of " + num(cp) + " ranks");
    if (T % (2 * cp) != 0 && cp > 1)
      fail("seq_length(" + num(T) + ") is not divisible by 2 x context_parallel_size(" + num(cp) + ")");
    Tq = T / cp;
    if (sp && Tq % tp != 0)
      fail("seq_length(" + num(T) + ")" + (cp > 1 ? " / context_parallel_size(" + num(cp) + ")" : std::string()) +
           " is not divisible by tensor_parallel_size(" + num(tp) + ") under sequence parallelism");
    Cl = C / tp;
    Hl = H / tp;
    Fl = F / tp;
    Vl = V / tp;
    vocab0 = tp_rank * Vl;
    positions = context_parallel_positions(T, cp, cp_rank);
    N = static_cast<std::size_t>(B) * Tq;
    Nl = sp ? N / tp : N;
    row0 = sp ? Nl * tp_rank : 0;
  }
  const StageShape& shape() const { return *this; }
};

// The format a tensor's elements are held in: the compute format (activations and gradients
// between layers), FP32 (statistics, log-sum-exp), int32 (token ids).
enum class Held { compute, f32, i32 };

// What a block's forward keeps for its backward.
template <class Buf>
struct BlockStash {
  Buf ln1, qkv, probs, att, x1, ln2, fc, gelu;  // (Nl,C) (N,3Cl) (B,Hl,Tq,T) (N,Cl) (Nl,C) (Nl,C) (N,Fl) (N,Fl)
  Buf mean1, rstd1, mean2, rstd2;               // (Nl) fp32
  // Full recompute (selective_op: what it does not keep) under a split backward: the input pass
  // rebuilds the block here and the weight pass, later, reads part of it; `kept` from the one to
  // the other (stash_bytes counts it then).
  bool kept = false;
};
// selective_op (torchtitan's op-level policy) keeps of a block the attention core's output and
// every other product's, in the order block_forward calls them (qkv 1st, attn.proj 2nd, mlp.fc 3rd,
// mlp.proj 4th): att, qkv and fc. The rest is rebuilt in the block's backward; this swaps it (ln1,
// probs, x1, ln2, gelu and the statistics) between two blocks' tensors (the stash and the workspace).
template <class Buf>
void swap_op_rebuilt(BlockStash<Buf>& a, BlockStash<Buf>& b) {
  using std::swap;
  for (auto t : {&BlockStash<Buf>::ln1, &BlockStash<Buf>::probs, &BlockStash<Buf>::x1, &BlockStash<Buf>::ln2,
                 &BlockStash<Buf>::gelu, &BlockStash<Buf>::mean1, &BlockStash<Buf>::rstd1, &BlockStash<Buf>::mean2,
                 &BlockStash<Buf>::rstd2})
    swap(a.*t, b.*t);
}
// Indices into the stage's parameters (StageModel::params()) of one block's tensors.
struct BlockParams {
  int ln1_w, ln1_b, qkv_w, qkv_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b;
};

// A stage's backward runs in units, in the order its gradients become final: the head, the blocks
// from last to first, the embedding (the parameters are laid out in that order). After a unit the
// gradients [0, grads_end) are final.
enum class UnitKind { head, block, embedding };
struct BackwardUnit {
  UnitKind kind;
  int block = -1;  // local block index
  std::size_t grads_end = 0;
  // Its input pass (and its rebuild) reads the unit's weights; the embedding's reads none.
  bool reads_weights() const { return kind != UnitKind::embedding; }
  WeightPiece piece() const { return kind == UnitKind::head ? WeightPiece::head : WeightPiece::block; }
};

template <class Buf, class Ids>
struct Stash {
  Ids tokens, targets;    // (N) int32: first stage, last stage
  std::vector<Buf> x;     // residual stream (Nl,C): x[0] stage input, x[l+1] block l's output
  std::vector<BlockStash<Buf>> blocks;
  Buf lnf, logits;        // (Nl,C) the shard's rows, (N,Vl): last stage
  Buf meanf, rstdf, lse;  // (Nl) (Nl) (N) fp32
};
// Gradients a block's weight pass reads: shared scratch in the unsplit backward, kept per
// micro-batch between backward_input and backward_weight in the zero-bubble split.
template <class Buf>
struct BlockGrads {
  Buf dfc, dln2, dx1, dqkv, dln1;  // (N,Fl) (Nl,C) (Nl,C) (N,3Cl) (Nl,C)
};
template <class Buf>
struct Backward {
  bool split = false, inputs_done = false;
  Buf dlogits, dlnf;               // (N,Vl) (Nl,C): last stage
  std::vector<Buf> dres;           // residual-stream gradient (Nl,C): all L+1 positions when split, else 2 alternating
  std::vector<BlockGrads<Buf>> blocks;  // split only
  Buf& res(int pos) { return dres[static_cast<std::size_t>(pos) % dres.size()]; }
};

// Allocation: make(elements, Held) -> Buf, make_ids(elements) -> Ids.
// Which of a block's tensors to allocate: `products` the ones selective_op keeps (qkv, att, fc),
// `probs` the softmax output, `rest` the others (the norms' outputs and statistics, x1, gelu).
struct BlockParts {
  bool products = true, probs = true, rest = true;
};
template <class Buf, class Make>
BlockStash<Buf> make_block_stash(const StageShape& s, BlockParts parts, Make&& make) {
  const std::size_t nlc = s.Nl * s.C, n = s.N;
  BlockStash<Buf> b;
  if (parts.products) {
    b.qkv = make(3 * n * s.Cl, Held::compute);
    b.att = make(n * s.Cl, Held::compute);
    b.fc = make(n * s.Fl, Held::compute);
  }
  if (parts.probs) b.probs = make(static_cast<std::size_t>(s.B) * s.Hl * s.Tq * s.T, Held::compute);
  if (parts.rest) {
    b.ln1 = make(nlc, Held::compute);
    b.x1 = make(nlc, Held::compute);
    b.ln2 = make(nlc, Held::compute);
    b.gelu = make(n * s.Fl, Held::compute);
    b.mean1 = make(s.Nl, Held::f32);
    b.rstd1 = make(s.Nl, Held::f32);
    b.mean2 = make(s.Nl, Held::f32);
    b.rstd2 = make(s.Nl, Held::f32);
  }
  return b;
}

// A micro-batch's stash under activation recompute (training.activation_recompute, as sim's
// memory model counts it): `none` keeps every tensor; `selective` no softmax output (rebuilt from
// the kept QKV, Korthikanti et al. 2022); `selective_op` each block's input and its qkv, att and fc
// (torchtitan's op-level policy: swap_op_rebuilt); `full` each block's input only. Under these two
// the last block's output is kept only where the head reads it (it is no block's input).
// `block_room`: under full recompute and selective_op, allocate the tensors they rebuild anyway
// (selective_op's but the softmax output, which its rebuild leaves in the workspace), as room a
// split backward rebuilds a block in for its weight pass (a device that must not allocate mid-step).
// `recompute_of(block)` says each block's (StageSpec::recompute_of: full recompute of a stage's first
// blocks alone keeps everything of the others).
template <class Buf, class Ids, class RecomputeOf, class Make, class MakeIds>
Stash<Buf, Ids> make_stash(const StageShape& s, bool has_embedding, bool has_head, RecomputeOf&& recompute_of,
                           bool block_room, Make&& make, MakeIds&& make_ids) {
  Stash<Buf, Ids> st;
  const std::size_t nlc = s.Nl * s.C, n = s.N;
  if (has_embedding) st.tokens = make_ids(n);
  if (has_head) {
    st.targets = make_ids(n);
    st.lnf = make(nlc, Held::compute);
    st.logits = make(n * s.Vl, Held::compute);
    st.meanf = make(s.Nl, Held::f32);
    st.rstdf = make(s.Nl, Held::f32);
    st.lse = make(n, Held::f32);
  }
  auto inputs_only = [&](int block) {
    const Recompute r = recompute_of(block);
    return r == Recompute::full || r == Recompute::selective_op;
  };
  for (int i = 0; i <= s.L; ++i)
    st.x.push_back(s.L > 0 && i == s.L && !has_head && inputs_only(s.L - 1) ? Buf() : make(nlc, Held::compute));
  st.blocks.resize(static_cast<std::size_t>(s.L));
  for (int i = 0; i < s.L; ++i) {
    BlockParts parts;
    switch (recompute_of(i)) {
      case Recompute::none: break;
      case Recompute::selective: parts.probs = false; break;
      case Recompute::full: parts = {block_room, block_room, block_room}; break;
      case Recompute::selective_op: parts = {true, false, block_room}; break;
    }
    if (parts.products || parts.probs || parts.rest)
      st.blocks[static_cast<std::size_t>(i)] = make_block_stash<Buf>(s, parts, make);
  }
  return st;
}

template <class Buf, class Make>
BlockGrads<Buf> make_block_grads(const StageShape& s, Make&& make) {
  const std::size_t nlc = s.Nl * s.C;
  return {make(s.N * s.Fl, Held::compute), make(nlc, Held::compute), make(nlc, Held::compute),
          make(3 * s.N * s.Cl, Held::compute), make(nlc, Held::compute)};
}

template <class Buf, class Make>
Backward<Buf> make_backward(const StageShape& s, bool has_head, bool split, Make&& make) {
  Backward<Buf> b;
  b.split = split;
  if (has_head) {
    b.dlogits = make(s.N * s.Vl, Held::compute);
    b.dlnf = make(s.Nl * s.C, Held::compute);
  }
  for (int i = 0; i < (split ? s.L + 1 : std::min(s.L + 1, 2)); ++i) b.dres.push_back(make(s.Nl * s.C, Held::compute));
  if (split)
    for (int i = 0; i < s.L; ++i) b.blocks.push_back(make_block_grads<Buf>(s, make));
  return b;
}

// A stash (or a backward of the kind: the split kind holds every position and block) from those
// released by earlier micro-batches, or a new one from make_new().
template <class T, class MakeNew>
std::unique_ptr<T> reuse_or_make(std::vector<std::unique_ptr<T>>& free, MakeNew&& make_new) {
  if (free.empty()) return make_new();
  auto t = std::move(free.back());
  free.pop_back();
  return t;
}
template <class Buf, class MakeNew>
std::unique_ptr<Backward<Buf>> reuse_or_make(std::vector<std::unique_ptr<Backward<Buf>>>& free, bool split,
                                             MakeNew&& make_new) {
  for (auto it = free.begin(); it != free.end(); ++it)
    if ((*it)->split == split) {
      auto b = std::move(*it);
      free.erase(it);
      b->inputs_done = false;
      return b;
    }
  return make_new();
}

// Every tensor, in a fixed order: visit(what, layer, buffer, held) with `what` the tensor's name
// as the numerics report and stashed_tensors() call it ("ln1 output"), `layer` the block's local
// index or -1; visit_ids(ids) for the token ids.
template <class Buf, class Ids, class Visit, class VisitIds>
void for_each_tensor(const Stash<Buf, Ids>& st, Visit&& visit, VisitIds&& visit_ids) {
  visit_ids(st.tokens);
  visit_ids(st.targets);
  visit("stage input", -1, st.x[0], Held::compute);
  for (std::size_t l = 0; l < st.blocks.size(); ++l) {
    const BlockStash<Buf>& b = st.blocks[l];
    const int li = static_cast<int>(l);
    visit("ln1 output", li, b.ln1, Held::compute);
    visit("attn.qkv output", li, b.qkv, Held::compute);
    visit("attn.softmax output", li, b.probs, Held::compute);
    visit("attn output", li, b.att, Held::compute);
    visit("attn residual", li, b.x1, Held::compute);
    visit("ln2 output", li, b.ln2, Held::compute);
    visit("mlp.fc output", li, b.fc, Held::compute);
    visit("mlp.gelu output", li, b.gelu, Held::compute);
    visit("output", li, st.x[l + 1], Held::compute);
    for (const Buf* stat : {&b.mean1, &b.rstd1, &b.mean2, &b.rstd2}) visit("statistics", li, *stat, Held::f32);
  }
  visit("lnf output", -1, st.lnf, Held::compute);
  visit("logits", -1, st.logits, Held::compute);
  for (const Buf* stat : {&st.meanf, &st.rstdf, &st.lse}) visit("statistics", -1, *stat, Held::f32);
}

// The bytes a stash holds for its backward, as the memory model counts them (bytes(buf, held)):
// every tensor, but under full recompute a block's only while `kept`, and then only what its
// weight pass reads (the products' and norms' inputs and statistics; not qkv, probs, fc); under
// selective_op a block's qkv, att and fc, and while `kept` the rest of that (ln1, x1, ln2, gelu
// and the statistics). (A device's room for them, block_room, is not counted until used.)
template <class Buf, class Ids, class RecomputeOf, class Bytes, class IdBytes>
std::size_t stash_bytes(const Stash<Buf, Ids>& st, RecomputeOf&& recompute_of, Bytes&& bytes, IdBytes&& id_bytes) {
  std::size_t total = id_bytes(st.tokens) + id_bytes(st.targets);
  for (const Buf& x : st.x) total += bytes(x, Held::compute);
  for (std::size_t i = 0; i < st.blocks.size(); ++i) {
    const BlockStash<Buf>& b = st.blocks[i];
    const Recompute recompute = recompute_of(static_cast<int>(i));
    const bool rebuilt = recompute == Recompute::full || recompute == Recompute::selective_op;
    if (recompute != Recompute::full)
      for (const Buf* t : {&b.qkv, &b.att, &b.fc}) total += bytes(*t, Held::compute);
    if (!rebuilt) total += bytes(b.probs, Held::compute);  // none under selective
    if (rebuilt && !b.kept) continue;
    for (const Buf* t : {&b.ln1, &b.x1, &b.ln2, &b.gelu}) total += bytes(*t, Held::compute);
    for (const Buf* t : {&b.mean1, &b.rstd1, &b.mean2, &b.rstd2}) total += bytes(*t, Held::f32);
    if (recompute == Recompute::full) total += bytes(b.att, Held::compute);
  }
  for (const Buf* t : {&st.lnf, &st.logits}) total += bytes(*t, Held::compute);
  for (const Buf* t : {&st.meanf, &st.rstdf, &st.lse}) total += bytes(*t, Held::f32);
  return total;
}

template <class Buf, class Visit>
void for_each_tensor(const Backward<Buf>& b, Visit&& visit) {
  visit(b.dlogits, Held::compute);
  visit(b.dlnf, Held::compute);
  for (const Buf& r : b.dres) visit(r, Held::compute);
  for (const BlockGrads<Buf>& g : b.blocks)
    for (const Buf* t : {&g.dfc, &g.dln2, &g.dx1, &g.dqkv, &g.dln1}) visit(*t, Held::compute);
}

}  // namespace trainsim::runtime
