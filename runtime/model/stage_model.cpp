// One pipeline stage of the GPT-2 style decoder (see stage_model.h for the contract and the
// mixed-precision rules). The math lives in layers.h; this file owns the parameters, the
// per-micro-batch stashes, the order of backward units and the rounding to the formats.
#include "runtime/model/stage_model.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numbers>
#include <stdexcept>
#include <string_view>

#include "runtime/model/layers.h"
#include "runtime/numerics/lowp.h"


namespace trainsim::runtime {

namespace {

using layers::AttnTensor;
using Row = layers::RowMap<float>;
using ConstRow = layers::ConstRowMap<float>;

// ---------------------------------------------------------------------------------------
// Initialisation: a counter-based generator, so a value depends on (seed, tensor name, index)
// only and any cut of the model draws the same weights as the whole.
// ---------------------------------------------------------------------------------------
std::uint64_t mix64(std::uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
std::uint64_t hash_name(std::string_view s) {  // FNV-1a
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}
// The i-th standard normal of stream `key`: Box-Muller on the splitmix64 outputs 2i+1, 2i+2.
double normal_at(std::uint64_t key, std::uint64_t i) {
  constexpr std::uint64_t kGamma = 0x9e3779b97f4a7c15ull;
  const double u1 = (static_cast<double>(mix64(key + (2 * i + 1) * kGamma) >> 11) + 0.5) * 0x1p-53;
  const double u2 = (static_cast<double>(mix64(key + (2 * i + 2) * kGamma) >> 11) + 0.5) * 0x1p-53;
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
struct StageModel::Impl {
  // Indices into params of one block's tensors.
  struct BlockParams {
    int ln1_w, ln1_b, qkv_w, qkv_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b;
  };
  // What a block's forward keeps for its backward (compute format, except the fp32 statistics).
  struct BlockStash {
    Buffer ln1, qkv, probs, att, x1, ln2, fc, gelu;  // (N,C) (N,3C) (B,H,T,T) (N,C)x3 (N,F)x2
    Buffer mean1, rstd1, mean2, rstd2;               // (N)
  };
  struct Stash {
    std::vector<std::int32_t> tokens, targets;  // (N)
    std::vector<Buffer> x;                      // residual stream: x[0] stage input, x[l+1] block l's output
    std::vector<BlockStash> blocks;
    Buffer lnf, logits;        // (N,C) (N,V)
    Buffer meanf, rstdf, lse;  // (N)
  };
  // Gradients a block's weight gradients read (kept per micro-batch between backward_input and
  // backward_weight; shared scratch in the unsplit backward).
  struct BlockGrads {
    Buffer dfc, dln2, dx1, dqkv, dln1;  // (N,F) (N,C) (N,C) (N,3C) (N,C)
  };
  struct Backward {
    bool split = false, inputs_done = false;
    Buffer dlogits, dlnf;            // (N,V) (N,C), last stage
    std::vector<Buffer> dres;        // residual-stream gradient: all L+1 positions when split, else 2
    std::vector<BlockGrads> blocks;  // split only
    float* res(int pos) { return dres[split ? pos : pos % dres.size()].data(); }
  };
  struct Slot {
    std::unique_ptr<Stash> stash;
    std::unique_ptr<Backward> backward;
    int units_done = 0;
    bool complete = false;
  };
  enum class UnitKind { head, block, embedding };
  struct Unit {
    UnitKind kind;
    int block = -1;      // local block index
    int params_end = 0;  // parameters [0, params_end) are complete after this unit
    std::size_t grads_end = 0;
  };

  StageSpec spec;
  int B, T, C, H, F, V, L;
  std::size_t N;  // rows: B * T

  std::vector<ParamInfo> params;
  std::vector<Init> inits;
  std::vector<BlockParams> blocks;
  int wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, head_w = -1;
  std::vector<Unit> units;
  Buffer master, working, grads;
  bool fast_grads;  // compute and accumulation both fp32: weight gradients go straight into grads

  std::vector<Slot> slots;  // by micro-batch
  std::vector<std::unique_ptr<Stash>> free_stashes;
  std::vector<std::unique_ptr<Backward>> free_backwards;

  // Scratch shared by all micro-batches (a forward or a unit runs to its end before another).
  BlockGrads shared_grads;
  Buffer tmp, dgelu, datt, attn_scratch, wscratch, bscratch;

  StageNumerics numerics;

  // Activation recompute (spec.recompute), wrapped around block_forward and the block's backward:
  // the stash keeps less, and a block's backward first rebuilds what it needs in this workspace
  // (full: one block's whole stash and output; selective: one softmax output), with the same
  // code and inputs as the forward, so bitwise the same values. Numerics are recorded once, in
  // the forward.
  struct RecomputeWork {
    BlockStash block;
    Buffer probs, out;
    bool active = false;  // rebuilding: record() is quiet
  } redo;
  void forward_block(int li, Stash& s, int mb);       // block_forward, keeping what spec.recompute keeps
  void rebuild(const Unit& u, Stash& s, int mb, bool split);  // before unit u's input pass
  void rerun_block(int li, Stash& s, int mb);         // block_forward into s.blocks[li], output aside
  void drop_rebuilt(const Unit& u, Stash& s, bool weights_done);  // after its pass(es)
  const Buffer& stage_output(const Stash& s) const { return s.x[L].empty() ? redo.out : s.x[L]; }

  // Weights read through the engine's gate (set_weight_gate), piece by piece.
  GateCalls gate;
  // A backward unit's input pass (and its rebuild) reads the unit's weights; the embedding's none.
  bool reads_weights(const Unit& u) const { return u.kind != UnitKind::embedding; }
  WeightPiece piece(const Unit& u) const { return u.kind == UnitKind::head ? WeightPiece::head : WeightPiece::block; }
  std::size_t block_bytes(const BlockStash& b) const;

  explicit Impl(const StageSpec& s);

  // -- parameters --
  int add_param(std::string name, std::size_t size, Init init, bool decay) {
    ParamInfo p;
    p.name = std::move(name);
    p.size = size;
    p.decay = decay;
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

  // -- micro-batch bookkeeping --
  Slot& slot(int mb) {
    if (mb < 0) throw std::invalid_argument("micro-batch index " + std::to_string(mb) + " is negative");
    if (static_cast<std::size_t>(mb) >= slots.size()) slots.resize(mb + 1);
    return slots[mb];
  }
  std::unique_ptr<Stash> take_stash();
  std::unique_ptr<Backward> take_backward(bool split);
  void release(Slot& s) {
    if (spec.recompute == Recompute::full)  // what a split backward kept for its weight pass
      for (BlockStash& b : s.stash->blocks) b = BlockStash{};
    free_stashes.push_back(std::move(s.stash));
    free_backwards.push_back(std::move(s.backward));
    s.complete = true;
  }
  std::size_t stash_bytes(const Stash& s) const;
  std::size_t backward_bytes(const Backward& b) const;

  // -- passes --
  float forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const float* input, float* output);
  void block_forward(int li, Stash& s, int mb);
  void begin(int mb, const float* grad_output, float scale, bool split);
  void unit_input(const Unit& u, Stash& s, Backward& b, int mb);
  void unit_weight(const Unit& u, Stash& s, Backward& b, int mb);
  void block_backward_input(int li, Stash& s, Backward& b, int mb);
  void block_backward_weight(int li, Stash& s, Backward& b, int mb);

  // -- weight gradients of one micro-batch into the accumulation buffer --
  void commit(int p, float* produced, int mb);
  void scan_accumulated(int p, int mb) {
    record(scan(g(p), params[p].size), Tag{params[p].name.c_str(), -1, " gradient"}, true, mb);
  }
  void wgrad_linear(int pw, int pb, const float* dy, const float* x, int in, int out, int mb);
  void wgrad_layernorm(int pw, int pb, const float* dy, const float* x, const float* mean, const float* rstd, int mb);
  void wgrad_embedding(const float* dx, const std::int32_t* tokens, int mb);

  void refresh_working();
};

StageModel::Impl::Impl(const StageSpec& s) : spec(s) {
  const ModelDims& d = s.dims;
  B = s.micro_batch_size;
  T = d.seq_length;
  C = d.hidden_size;
  H = d.num_heads;
  F = d.ffn();
  V = d.vocab_size;
  L = s.num_layers;
  auto fail = [](const std::string& m) { throw std::invalid_argument("StageSpec: " + m); };
  if (B < 1 || T < 1 || C < 1 || H < 1 || V < 1 || F < 1 || d.num_layers < 0)
    fail("micro_batch_size(" + std::to_string(B) + "), seq_length(" + std::to_string(T) + "), hidden_size(" +
         std::to_string(C) + "), num_heads(" + std::to_string(H) + "), ffn(" + std::to_string(F) + ") and vocab_size(" +
         std::to_string(V) + ") must be positive");
  if (C % H != 0)
    fail("hidden_size(" + std::to_string(C) + ") is not a multiple of num_heads(" + std::to_string(H) + ")");
  if (s.first_layer < 0 || L < 0 || s.first_layer + L > d.num_layers)
    fail("blocks [" + std::to_string(s.first_layer) + ", " + std::to_string(s.first_layer + L) +
         ") are not within the model's " + std::to_string(d.num_layers) + " layers");
  for (DType t : {s.compute, s.grad_accumulation})
    if (t == DType::fp8) fail("fp8 is not emulated by the runtime (compute or grad_accumulation)");
  N = static_cast<std::size_t>(B) * T;
  const std::size_t c = C, f = F, v = V;

  // Parameters in gradient-completion order: head, blocks from last to first, embedding.
  auto end_unit = [&](UnitKind k, int b) { units.push_back({k, b, static_cast<int>(params.size()), 0}); };
  if (s.has_head) {
    if (!d.tied_embeddings)
      head_w = add_param("lm_head.weight", v * c, Init::normal, true);
    else if (!s.has_embedding)
      head_w = wte = add_param("wte", v * c, Init::normal, true);  // the last stage's copy
    lnf_w = add_param("lnf.weight", c, Init::ones, false);
    lnf_b = add_param("lnf.bias", c, Init::zeros, false);
    end_unit(UnitKind::head, -1);
  }
  blocks.resize(L);
  for (int li = L - 1; li >= 0; --li) {
    const std::string pre = "block." + std::to_string(s.first_layer + li) + ".";
    BlockParams& bp = blocks[li];
    bp.mlp_proj_w = add_param(pre + "mlp.proj.weight", c * f, Init::normal_residual, true);
    bp.mlp_proj_b = add_param(pre + "mlp.proj.bias", c, Init::zeros, false);
    bp.fc_w = add_param(pre + "mlp.fc.weight", f * c, Init::normal, true);
    bp.fc_b = add_param(pre + "mlp.fc.bias", f, Init::zeros, false);
    bp.ln2_w = add_param(pre + "ln2.weight", c, Init::ones, false);
    bp.ln2_b = add_param(pre + "ln2.bias", c, Init::zeros, false);
    bp.attn_proj_w = add_param(pre + "attn.proj.weight", c * c, Init::normal_residual, true);
    bp.attn_proj_b = add_param(pre + "attn.proj.bias", c, Init::zeros, false);
    bp.qkv_w = add_param(pre + "attn.qkv.weight", 3 * c * c, Init::normal, true);
    bp.qkv_b = add_param(pre + "attn.qkv.bias", 3 * c, Init::zeros, false);
    bp.ln1_w = add_param(pre + "ln1.weight", c, Init::ones, false);
    bp.ln1_b = add_param(pre + "ln1.bias", c, Init::zeros, false);
    end_unit(UnitKind::block, li);
  }
  if (s.has_embedding) {
    wte = add_param("wte", v * c, Init::normal, true);
    wpe = add_param("wpe", static_cast<std::size_t>(T) * c, Init::normal, true);
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
  for (Unit& u : units)
    u.grads_end = u.params_end > 0 ? params[u.params_end - 1].offset + params[u.params_end - 1].size : 0;

  master = floats(offset);
  grads = floats(offset);
  if (s.compute != DType::fp32) working = floats(offset);
  fast_grads = s.compute == DType::fp32 && s.grad_accumulation == DType::fp32;

  tmp = floats(N * c);
  dgelu = floats(N * f);
  datt = floats(N * c);
  attn_scratch = floats(static_cast<std::size_t>(T) * T);
  if (!fast_grads) {
    wscratch = floats(largest);
    bscratch = floats(std::max(largest, static_cast<std::size_t>(T) * c));
  }
  shared_grads = {floats(N * f), floats(N * c), floats(N * c), floats(3 * N * c), floats(N * c)};
  if (s.recompute == Recompute::selective) redo.probs = floats(static_cast<std::size_t>(B) * H * T * T);
  if (s.recompute == Recompute::full) {
    redo.block = {floats(N * c), floats(3 * N * c), floats(static_cast<std::size_t>(B) * H * T * T), floats(N * c),
                  floats(N * c), floats(N * c), floats(N * f), floats(N * f), floats(N), floats(N), floats(N), floats(N)};
    redo.out = floats(N * c);
  }
}

std::unique_ptr<StageModel::Impl::Stash> StageModel::Impl::take_stash() {
  if (!free_stashes.empty()) {
    auto s = std::move(free_stashes.back());
    free_stashes.pop_back();
    return s;
  }
  auto s = std::make_unique<Stash>();
  const std::size_t nc = N * C, n = N;
  if (spec.has_embedding) s->tokens.resize(n);
  if (spec.has_head) {
    s->targets.resize(n);
    s->lnf = floats(nc);
    s->logits = floats(n * V);
    s->meanf = floats(n);
    s->rstdf = floats(n);
    s->lse = floats(n);
  }
  s->x.assign(L + 1, floats(nc));
  s->blocks.resize(L);
  if (spec.recompute == Recompute::full) {  // each block's input only (and the head's)
    if (!spec.has_head && L > 0) s->x[L] = Buffer();
    return s;
  }
  for (BlockStash& b : s->blocks) {
    b.ln1 = floats(nc);
    b.qkv = floats(3 * nc);
    if (spec.recompute == Recompute::none) b.probs = floats(static_cast<std::size_t>(B) * H * T * T);
    b.att = floats(nc);
    b.x1 = floats(nc);
    b.ln2 = floats(nc);
    b.fc = floats(n * F);
    b.gelu = floats(n * F);
    b.mean1 = floats(n);
    b.rstd1 = floats(n);
    b.mean2 = floats(n);
    b.rstd2 = floats(n);
  }
  return s;
}

std::unique_ptr<StageModel::Impl::Backward> StageModel::Impl::take_backward(bool split) {
  std::unique_ptr<Backward> b;
  if (!free_backwards.empty()) {
    b = std::move(free_backwards.back());
    free_backwards.pop_back();
  } else {
    b = std::make_unique<Backward>();
  }
  const std::size_t nc = N * C;
  b->split = split;
  b->inputs_done = false;
  if (spec.has_head) {
    b->dlogits.resize(N * V);
    b->dlnf.resize(nc);
  }
  b->dres.resize(split ? L + 1 : std::min(L + 1, 2));
  for (auto& r : b->dres) r.resize(nc);
  b->blocks.resize(split ? L : 0);
  for (BlockGrads& g : b->blocks) {
    g.dfc.resize(N * F);
    g.dln2.resize(nc);
    g.dx1.resize(nc);
    g.dqkv.resize(3 * nc);
    g.dln1.resize(nc);
  }
  return b;
}

std::size_t StageModel::Impl::stash_bytes(const Stash& s) const {
  const std::size_t e = dtype_bytes(spec.compute);
  std::size_t bytes = (s.tokens.size() + s.targets.size()) * sizeof(std::int32_t);
  bytes += (s.lnf.size() + s.logits.size()) * e + (s.meanf.size() + s.rstdf.size() + s.lse.size()) * 4;
  for (const auto& x : s.x) bytes += x.size() * e;
  for (const BlockStash& b : s.blocks) bytes += block_bytes(b);
  return bytes;
}

std::size_t StageModel::Impl::block_bytes(const BlockStash& b) const {
  const std::size_t e = dtype_bytes(spec.compute);
  return (b.ln1.size() + b.qkv.size() + b.probs.size() + b.att.size() + b.x1.size() + b.ln2.size() + b.fc.size() +
          b.gelu.size()) *
             e +
         (b.mean1.size() + b.rstd1.size() + b.mean2.size() + b.rstd2.size()) * 4;
}

std::size_t StageModel::Impl::backward_bytes(const Backward& b) const {
  std::size_t elems = b.dlogits.size() + b.dlnf.size();
  for (const auto& r : b.dres) elems += r.size();
  for (const BlockGrads& g : b.blocks)
    elems += g.dfc.size() + g.dln2.size() + g.dx1.size() + g.dqkv.size() + g.dln1.size();
  return elems * dtype_bytes(spec.compute);
}

void StageModel::Impl::refresh_working() {
  if (spec.compute == DType::fp32) return;
  std::copy(master.begin(), master.end(), working.begin());
  for (const ParamInfo& p : params)
    record(round_and_scan(spec.compute, working.data() + p.offset, p.size), Tag{p.name.c_str(), -1, " working copy"},
           false, -1);
}

void check_forward_arguments(const StageSpec& spec, const char* who, const std::int32_t* tokens,
                             const std::int32_t* targets, bool has_input) {
  const std::size_t n = static_cast<std::size_t>(spec.micro_batch_size) * spec.dims.seq_length;
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

  Slot& sl = slot(mb);
  if (sl.stash)
    throw std::logic_error("StageModel::forward: micro-batch " + std::to_string(mb) +
                           " already has a forward waiting for its backward");
  sl.stash = take_stash();
  sl.units_done = 0;
  sl.complete = false;
  Stash& s = *sl.stash;
  const std::size_t nc = N * C;

  float* x0 = s.x[0].data();
  if (spec.has_embedding) {
    std::copy(tokens, tokens + N, s.tokens.begin());
    gate.take(WeightPiece::embedding);
    layers::embedding_forward(x0, tokens, w(wte), w(wpe), B, T, C);
    gate.give(WeightPiece::embedding);
    finish(x0, nc, Tag{"embedding output"}, false, mb);
  } else {
    std::copy(input, input + nc, x0);
    finish(x0, nc, Tag{"stage input"}, false, mb);
  }
  for (int li = 0; li < L; ++li) {
    gate.take(WeightPiece::block, li);
    forward_block(li, s, mb);
    gate.give(WeightPiece::block, li);
  }
  const float* xl = stage_output(s).data();
  if (!spec.has_head) {
    if (output) std::copy(xl, xl + nc, output);
    return 0;
  }
  std::copy(targets, targets + N, s.targets.begin());
  gate.take(WeightPiece::head);
  layers::layernorm_forward(s.lnf.data(), s.meanf.data(), s.rstdf.data(), xl, w(lnf_w), w(lnf_b), N, C);
  finish(s.lnf.data(), nc, Tag{"lnf output"}, false, mb);
  layers::linear_forward(s.logits.data(), s.lnf.data(), w(head_w), static_cast<const float*>(nullptr), N, C, V);
  gate.give(WeightPiece::head);
  finish(s.logits.data(), N * V, Tag{"logits"}, false, mb);
  const float loss = layers::cross_entropy_forward(s.lse.data(), s.logits.data(), s.targets.data(), N, V);
  float l = loss;
  record(scan(&l, 1), Tag{"loss"}, false, mb);
  return loss;
}

void StageModel::Impl::block_forward(int li, Stash& s, int mb) {
  const BlockParams& p = blocks[li];
  BlockStash& b = s.blocks[li];
  const int layer = spec.first_layer + li;
  const std::size_t nc = N * C, nf = N * F;
  const float* x0 = s.x[li].data();
  float* x2 = s.x[li + 1].data();
  auto done = [&](Buffer& t, const char* what) { finish(t.data(), t.size(), Tag{what, layer}, false, mb); };

  layers::layernorm_forward(b.ln1.data(), b.mean1.data(), b.rstd1.data(), x0, w(p.ln1_w), w(p.ln1_b), N, C);
  done(b.ln1, "ln1 output");
  layers::linear_forward(b.qkv.data(), b.ln1.data(), w(p.qkv_w), w(p.qkv_b), N, C, 3 * C);
  done(b.qkv, "attn.qkv output");
  layers::attention_forward(b.att.data(), b.probs.data(), attn_scratch.data(), b.qkv.data(), B, T, C, H,
                            [&](float* row, int n, AttnTensor t) {
                              finish(row, n, Tag{attn_name(t), layer}, false, mb);
                            });
  done(b.att, "attn output");
  layers::linear_forward(tmp.data(), b.att.data(), w(p.attn_proj_w), w(p.attn_proj_b), N, C, C);
  done(tmp, "attn.proj output");
  Row(b.x1.data(), nc) = ConstRow(x0, nc) + ConstRow(tmp.data(), nc);
  done(b.x1, "attn residual");
  layers::layernorm_forward(b.ln2.data(), b.mean2.data(), b.rstd2.data(), b.x1.data(), w(p.ln2_w), w(p.ln2_b), N, C);
  done(b.ln2, "ln2 output");
  layers::linear_forward(b.fc.data(), b.ln2.data(), w(p.fc_w), w(p.fc_b), N, C, F);
  done(b.fc, "mlp.fc output");
  layers::gelu_forward(b.gelu.data(), b.fc.data(), nf);
  done(b.gelu, "mlp.gelu output");
  layers::linear_forward(tmp.data(), b.gelu.data(), w(p.mlp_proj_w), w(p.mlp_proj_b), N, F, C);
  done(tmp, "mlp.proj output");
  Row(x2, nc) = ConstRow(b.x1.data(), nc) + ConstRow(tmp.data(), nc);
  finish(x2, nc, Tag{"output", layer}, false, mb);
}

// ---------------------------------------------------------------------------------------
// Activation recompute: what the stash keeps, and rebuilding the rest in a block's backward
// ---------------------------------------------------------------------------------------
void StageModel::Impl::forward_block(int li, Stash& s, int mb) {
  switch (spec.recompute) {
    case Recompute::none:
      block_forward(li, s, mb);
      return;
    case Recompute::selective:  // the softmax output goes to the workspace, not the stash
      std::swap(s.blocks[li].probs, redo.probs);
      block_forward(li, s, mb);
      std::swap(s.blocks[li].probs, redo.probs);
      return;
    case Recompute::full: {  // the whole block goes to the workspace; its output stays only as the next input
      std::swap(s.blocks[li], redo.block);
      const bool kept = !s.x[li + 1].empty();
      if (!kept) std::swap(s.x[li + 1], redo.out);
      block_forward(li, s, mb);
      if (!kept) std::swap(s.x[li + 1], redo.out);
      std::swap(s.blocks[li], redo.block);
      return;
    }
  }
}

void StageModel::Impl::rerun_block(int li, Stash& s, int mb) {
  std::swap(s.x[li + 1], redo.out);  // the kept next input is left as it is
  redo.active = true;
  block_forward(li, s, mb);
  redo.active = false;
  std::swap(s.x[li + 1], redo.out);
}

void StageModel::Impl::rebuild(const Unit& u, Stash& s, int mb, bool split) {
  if (u.kind != UnitKind::block || spec.recompute == Recompute::none) return;
  const int li = u.block;
  BlockStash& st = s.blocks[li];
  if (spec.recompute == Recompute::selective) {
    const int layer = spec.first_layer + li;
    redo.active = true;
    layers::attention_forward(tmp.data(), redo.probs.data(), attn_scratch.data(), st.qkv.data(), B, T, C, H,
                              [&](float* row, int n, AttnTensor t) {
                                finish(row, n, Tag{attn_name(t), layer}, false, mb);
                              });
    redo.active = false;
    std::swap(st.probs, redo.probs);
    return;
  }
  if (!split) {
    std::swap(st, redo.block);
  } else {  // rebuilt in the stash: the weight pass, later, reads what the input pass leaves
    const std::size_t nc = N * C, n = N, nf = N * F;
    for (Buffer* b : {&st.ln1, &st.att, &st.x1, &st.ln2}) b->resize(nc);
    for (Buffer* b : {&st.mean1, &st.rstd1, &st.mean2, &st.rstd2}) b->resize(n);
    st.qkv.resize(3 * nc);
    st.probs.resize(static_cast<std::size_t>(B) * H * T * T);
    st.fc.resize(nf);
    st.gelu.resize(nf);
  }
  rerun_block(li, s, mb);
}

void StageModel::Impl::drop_rebuilt(const Unit& u, Stash& s, bool weights_done) {
  if (u.kind != UnitKind::block || spec.recompute == Recompute::none) return;
  BlockStash& st = s.blocks[u.block];
  if (spec.recompute == Recompute::selective)
    std::swap(st.probs, redo.probs);
  else if (weights_done)
    std::swap(st, redo.block);
  else  // the weight pass needs the products' inputs (ln1, att, ln2, gelu) and ln2's (x1), not these
    st.qkv = st.probs = st.fc = Buffer();
}

// ---------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------
void StageModel::Impl::begin(int mb, const float* grad_output, float scale, bool split) {
  Slot& sl = slot(mb);
  if (!sl.stash)
    throw std::logic_error("StageModel: backward of micro-batch " + std::to_string(mb) + " without its forward");
  if (sl.backward)
    throw std::logic_error("StageModel: backward of micro-batch " + std::to_string(mb) + " has already begun");
  if (!spec.has_head && !grad_output)
    throw std::invalid_argument("StageModel: this stage's backward needs grad_output");
  sl.backward = take_backward(split);
  sl.units_done = 0;
  Stash& s = *sl.stash;
  Backward& b = *sl.backward;
  if (spec.has_head) {
    layers::cross_entropy_backward(b.dlogits.data(), s.logits.data(), s.lse.data(), s.targets.data(), N, V,
                                   scale / static_cast<float>(N));
    finish(b.dlogits.data(), b.dlogits.size(), Tag{"logits gradient"}, true, mb);
  } else {
    float* d = b.res(L);
    std::copy(grad_output, grad_output + N * C, d);
    finish(d, N * C, Tag{"stage output gradient"}, true, mb);
  }
}

void StageModel::Impl::unit_input(const Unit& u, Stash& s, Backward& b, int mb) {
  switch (u.kind) {
    case UnitKind::head: {
      layers::linear_backward_input(b.dlnf.data(), b.dlogits.data(), w(head_w), N, C, V);
      finish(b.dlnf.data(), b.dlnf.size(), Tag{"lnf output gradient"}, true, mb);
      float* dx = b.res(L);
      layers::layernorm_backward_input(dx, b.dlnf.data(), s.x[L].data(), s.meanf.data(), s.rstdf.data(), w(lnf_w),
                                       static_cast<const float*>(nullptr), N, C);
      finish(dx, N * C, Tag{"lnf input gradient"}, true, mb);
      break;
    }
    case UnitKind::block:
      block_backward_input(u.block, s, b, mb);
      break;
    case UnitKind::embedding:
      break;  // no input gradient below the embedding
  }
}

void StageModel::Impl::unit_weight(const Unit& u, Stash& s, Backward& b, int mb) {
  switch (u.kind) {
    case UnitKind::head:
      wgrad_linear(head_w, -1, b.dlogits.data(), s.lnf.data(), C, V, mb);
      wgrad_layernorm(lnf_w, lnf_b, b.dlnf.data(), s.x[L].data(), s.meanf.data(), s.rstdf.data(), mb);
      break;
    case UnitKind::block:
      block_backward_weight(u.block, s, b, mb);
      break;
    case UnitKind::embedding:
      wgrad_embedding(b.res(0), s.tokens.data(), mb);
      break;
  }
}

void StageModel::Impl::block_backward_input(int li, Stash& s, Backward& b, int mb) {
  const BlockParams& p = blocks[li];
  const BlockStash& st = s.blocks[li];
  BlockGrads& g = b.split ? b.blocks[li] : shared_grads;
  const int layer = spec.first_layer + li;
  const std::size_t nc = N * C, nf = N * F;
  const float* dx2 = b.res(li + 1);  // gradient of the block's output
  float* dx0 = b.res(li);            // gradient of its input
  auto done = [&](float* t, std::size_t n, const char* what) { finish(t, n, Tag{what, layer}, true, mb); };

  layers::linear_backward_input(dgelu.data(), dx2, w(p.mlp_proj_w), N, F, C);
  done(dgelu.data(), nf, "mlp.gelu output gradient");
  layers::gelu_backward(g.dfc.data(), st.fc.data(), dgelu.data(), nf);
  done(g.dfc.data(), nf, "mlp.fc output gradient");
  layers::linear_backward_input(g.dln2.data(), g.dfc.data(), w(p.fc_w), N, C, F);
  done(g.dln2.data(), nc, "ln2 output gradient");
  layers::layernorm_backward_input(g.dx1.data(), g.dln2.data(), st.x1.data(), st.mean2.data(), st.rstd2.data(),
                                   w(p.ln2_w), dx2, N, C);
  done(g.dx1.data(), nc, "attn residual gradient");
  layers::linear_backward_input(datt.data(), g.dx1.data(), w(p.attn_proj_w), N, C, C);
  done(datt.data(), nc, "attn output gradient");
  layers::attention_backward(g.dqkv.data(), attn_scratch.data(), datt.data(), st.qkv.data(), st.probs.data(), B, T, C,
                             H, [&](float* row, int n, AttnTensor t) { done(row, n, attn_name(t)); });
  done(g.dqkv.data(), 3 * nc, "attn.qkv output gradient");
  layers::linear_backward_input(g.dln1.data(), g.dqkv.data(), w(p.qkv_w), N, C, 3 * C);
  done(g.dln1.data(), nc, "ln1 output gradient");
  layers::layernorm_backward_input(dx0, g.dln1.data(), s.x[li].data(), st.mean1.data(), st.rstd1.data(), w(p.ln1_w),
                                   g.dx1.data(), N, C);
  done(dx0, nc, "input gradient");
}

void StageModel::Impl::block_backward_weight(int li, Stash& s, Backward& b, int mb) {
  const BlockParams& p = blocks[li];
  const BlockStash& st = s.blocks[li];
  const BlockGrads& g = b.split ? b.blocks[li] : shared_grads;
  wgrad_linear(p.mlp_proj_w, p.mlp_proj_b, b.res(li + 1), st.gelu.data(), F, C, mb);
  wgrad_linear(p.fc_w, p.fc_b, g.dfc.data(), st.ln2.data(), C, F, mb);
  wgrad_layernorm(p.ln2_w, p.ln2_b, g.dln2.data(), st.x1.data(), st.mean2.data(), st.rstd2.data(), mb);
  wgrad_linear(p.attn_proj_w, p.attn_proj_b, g.dx1.data(), st.att.data(), C, C, mb);
  wgrad_linear(p.qkv_w, p.qkv_b, g.dqkv.data(), st.ln1.data(), C, 3 * C, mb);
  wgrad_layernorm(p.ln1_w, p.ln1_b, g.dln1.data(), s.x[li].data(), st.mean1.data(), st.rstd1.data(), mb);
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

void StageModel::Impl::wgrad_layernorm(int pw, int pb, const float* dy, const float* x, const float* mean,
                                       const float* rstd, int mb) {
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

void StageModel::Impl::wgrad_embedding(const float* dx, const std::int32_t* tokens, int mb) {
  if (fast_grads) {
    layers::embedding_backward(g(wte), g(wpe), dx, tokens, B, T, C);
    scan_accumulated(wte, mb);
    scan_accumulated(wpe, mb);
    return;
  }
  std::fill_n(wscratch.begin(), params[wte].size, 0.0f);
  std::fill_n(bscratch.begin(), params[wpe].size, 0.0f);
  layers::embedding_backward(wscratch.data(), bscratch.data(), dx, tokens, B, T, C);
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

void StageModel::init(std::uint64_t seed) {
  Impl& m = *impl_;
  const double std_residual = 0.02 / std::sqrt(2.0 * std::max(1, m.spec.dims.num_layers));
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const ParamInfo& p = m.params[i];
    float* w = m.master.data() + p.offset;
    const std::uint64_t key = mix64(seed ^ mix64(hash_name(p.name)));
    switch (m.inits[i]) {
      case Init::ones:
        std::fill_n(w, p.size, 1.0f);
        break;
      case Init::zeros:
        std::fill_n(w, p.size, 0.0f);
        break;
      case Init::normal:
      case Init::normal_residual: {
        const double sd = m.inits[i] == Init::normal ? 0.02 : std_residual;
        for (std::size_t k = 0; k < p.size; ++k) w[k] = static_cast<float>(sd * normal_at(key, k));
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
  if (impl_->wte < 0) return ParamInfo{"", 0, 0, true};
  return impl_->params[impl_->wte];
}

std::size_t StageModel::activation_elements() const { return impl_->N * impl_->C; }

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
  Impl::Slot& sl = m.slot(mb);
  if (!sl.backward || sl.backward->split)
    throw std::logic_error("StageModel::backward_unit: micro-batch " + std::to_string(mb) + " has no backward_begin");
  if (sl.units_done >= static_cast<int>(m.units.size()))
    throw std::logic_error("StageModel::backward_unit: micro-batch " + std::to_string(mb) + " has done all " +
                           std::to_string(m.units.size()) + " units");
  const Impl::Unit& u = m.units[sl.units_done];
  if (m.reads_weights(u)) m.gate.take(m.piece(u), u.block);
  m.rebuild(u, *sl.stash, mb, false);
  m.unit_input(u, *sl.stash, *sl.backward, mb);
  if (m.reads_weights(u)) m.gate.give(m.piece(u), u.block);
  m.unit_weight(u, *sl.stash, *sl.backward, mb);
  m.drop_rebuilt(u, *sl.stash, true);
  ++sl.units_done;
}

std::size_t StageModel::gradients_complete(int mb) const {
  const Impl& m = *impl_;
  if (mb < 0 || static_cast<std::size_t>(mb) >= m.slots.size()) return 0;
  const Impl::Slot& sl = m.slots[mb];
  if (sl.complete) return m.grads.size();
  return sl.units_done > 0 ? m.units[sl.units_done - 1].grads_end : 0;
}

void StageModel::backward_end(int mb, float* grad_input) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slot(mb);
  if (!sl.backward || sl.backward->split || sl.units_done != static_cast<int>(m.units.size()))
    throw std::logic_error("StageModel::backward_end: micro-batch " + std::to_string(mb) + " has done " +
                           std::to_string(sl.units_done) + " of " + std::to_string(m.units.size()) + " backward units");
  if (!m.spec.has_embedding && grad_input) {
    const float* d = sl.backward->res(0);
    std::copy(d, d + m.N * m.C, grad_input);
  }
  m.release(sl);
}

void StageModel::backward_input(int mb, const float* grad_output, float loss_gradient_scale, float* grad_input) {
  Impl& m = *impl_;
  m.begin(mb, grad_output, loss_gradient_scale, true);
  Impl::Slot& sl = m.slot(mb);
  for (const Impl::Unit& u : m.units) {
    if (m.reads_weights(u)) m.gate.take(m.piece(u), u.block);
    m.rebuild(u, *sl.stash, mb, true);
    m.unit_input(u, *sl.stash, *sl.backward, mb);
    if (m.reads_weights(u)) m.gate.give(m.piece(u), u.block);
    m.drop_rebuilt(u, *sl.stash, false);
  }
  sl.backward->inputs_done = true;
  if (!m.spec.has_embedding && grad_input) {
    const float* d = sl.backward->res(0);
    std::copy(d, d + m.N * m.C, grad_input);
  }
}

void StageModel::backward_weight(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slot(mb);
  if (!sl.backward || !sl.backward->split || !sl.backward->inputs_done)
    throw std::logic_error("StageModel::backward_weight: micro-batch " + std::to_string(mb) + " has no backward_input");
  for (; sl.units_done < static_cast<int>(m.units.size()); ++sl.units_done)
    m.unit_weight(m.units[sl.units_done], *sl.stash, *sl.backward, mb);
  m.release(sl);
}

void StageModel::backward_weight_unit(int mb) {
  Impl& m = *impl_;
  Impl::Slot& sl = m.slot(mb);
  if (!sl.backward || !sl.backward->split || !sl.backward->inputs_done || sl.units_done >= static_cast<int>(m.units.size()))
    throw std::logic_error("StageModel::backward_weight_unit: micro-batch " + std::to_string(mb) +
                           " has no backward_input or no weight unit left");
  m.unit_weight(m.units[sl.units_done], *sl.stash, *sl.backward, mb);
  ++sl.units_done;
}

std::size_t StageModel::master_weight_bytes() const { return impl_->master.size() * sizeof(float); }
std::size_t StageModel::working_weight_bytes() const {
  return impl_->spec.compute == DType::fp32 ? 0 : impl_->working.size() * dtype_bytes(impl_->spec.compute);
}
std::size_t StageModel::gradient_bytes() const {
  return impl_->grads.size() * dtype_bytes(impl_->spec.grad_accumulation);
}
std::size_t StageModel::activation_bytes() const {
  std::size_t bytes = 0;
  for (const Impl::Slot& sl : impl_->slots) {
    if (sl.stash) bytes += impl_->stash_bytes(*sl.stash);
    if (sl.backward) bytes += impl_->backward_bytes(*sl.backward);
  }
  return bytes;
}

std::size_t StageModel::recompute_bytes() const {
  const Impl& m = *impl_;
  return m.block_bytes(m.redo.block) + (m.redo.probs.size() + m.redo.out.size()) * dtype_bytes(m.spec.compute);
}

StageNumerics& StageModel::numerics() { return impl_->numerics; }

std::span<const float> StageModel::working_weights() const {
  return impl_->spec.compute == DType::fp32 ? impl_->master : impl_->working;
}

std::vector<StageModel::NamedTensor> StageModel::stashed_tensors(int mb) const {
  const Impl& m = *impl_;
  std::vector<NamedTensor> out;
  if (mb < 0 || static_cast<std::size_t>(mb) >= m.slots.size() || !m.slots[mb].stash) return out;
  const Impl::Stash& s = *m.slots[mb].stash;
  auto add = [&](std::string name, const Buffer& v) {
    if (!v.empty()) out.push_back({std::move(name), v});  // what recompute rebuilds is not kept
  };
  add(m.spec.has_embedding ? "embedding output" : "stage input", s.x[0]);
  for (int li = 0; li < m.L; ++li) {
    const Impl::BlockStash& b = s.blocks[li];
    const std::string pre = "block " + std::to_string(m.spec.first_layer + li) + " ";
    add(pre + "ln1 output", b.ln1);
    add(pre + "attn.qkv output", b.qkv);
    add(pre + "attn.softmax output", b.probs);
    add(pre + "attn output", b.att);
    add(pre + "attn residual", b.x1);
    add(pre + "ln2 output", b.ln2);
    add(pre + "mlp.fc output", b.fc);
    add(pre + "mlp.gelu output", b.gelu);
    add(pre + "output", s.x[li + 1]);
  }
  if (m.spec.has_head) {
    add("lnf output", s.lnf);
    add("logits", s.logits);
  }
  return out;
}

}  // namespace trainsim::runtime
