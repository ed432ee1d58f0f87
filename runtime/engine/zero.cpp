#include "runtime/engine/zero.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

namespace trainsim::runtime {

ShardLayout::ShardLayout(std::size_t params, int members, int position, std::vector<std::size_t> cuts)
    : params_(params), members_(members), position_(position) {
  if (members < 1 || position < 0 || position >= members)
    throw std::invalid_argument(fmt::format("ShardLayout: position {} of {} members", position, members));
  cuts.push_back(0);
  cuts.push_back(params);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  const auto n = static_cast<std::size_t>(members);
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    if (cuts[i] >= params) break;
    ShardSegment s;
    s.offset = cuts[i];
    s.length = std::min(cuts[i + 1], params) - cuts[i];
    s.chunk = (s.length + n - 1) / n;
    s.shard_offset = shard_size_;
    shard_size_ += s.chunk;
    segments_.push_back(s);
  }
}

ShardGroup ShardLayout::group(std::size_t lo, std::size_t hi) const {
  ShardGroup g;
  g.lo = lo;
  g.hi = hi;
  if (lo >= hi) return g;
  const auto first = std::find_if(segments_.begin(), segments_.end(), [&](const ShardSegment& s) { return s.offset == lo; });
  if (first == segments_.end())
    throw std::logic_error(fmt::format("ShardLayout: no segment starts at {} (of {})", lo, params_));
  g.first = static_cast<std::size_t>(first - segments_.begin());
  g.shard_offset = first->shard_offset;
  for (auto s = first; s != segments_.end() && s->offset < hi; ++s) {
    if (s->offset + s->length > hi)
      throw std::logic_error(fmt::format("ShardLayout: segment [{}, {}) crosses the end {} of a group", s->offset,
                                         s->offset + s->length, hi));
    ++g.count;
    g.section += s->chunk;
  }
  const ShardSegment& last = segments_[g.first + g.count - 1];
  if (last.offset + last.length != hi)
    throw std::logic_error(fmt::format("ShardLayout: no segment ends at {} (of {})", hi, params_));
  return g;
}

namespace {
// Member p's valid part of a segment: [begin, begin + count) of the flat buffer.
std::pair<std::size_t, std::size_t> owned(const ShardSegment& s, int p) {
  const std::size_t from = static_cast<std::size_t>(p) * s.chunk;
  if (from >= s.length) return {s.offset + s.length, 0};
  return {s.offset + from, std::min(s.chunk, s.length - from)};
}
}  // namespace

std::vector<ShardPiece> ShardLayout::section_pieces(const ShardGroup& g, int p) const {
  std::vector<ShardPiece> out;
  std::size_t at = static_cast<std::size_t>(p) * g.section;
  for (std::size_t i = g.first; i < g.first + g.count; ++i) {
    const auto [flat, count] = owned(segments_[i], p);
    if (count > 0) out.push_back({flat, at, count});
    at += segments_[i].chunk;
  }
  return out;
}

std::vector<ShardPiece> ShardLayout::shard_pieces(const ShardGroup& g, int p) const {
  std::vector<ShardPiece> out;
  for (std::size_t i = g.first; i < g.first + g.count; ++i) {
    const auto [flat, count] = owned(segments_[i], p);
    if (count > 0) out.push_back({flat, segments_[i].shard_offset, count});
  }
  return out;
}

std::vector<std::pair<std::size_t, std::size_t>> shard_ranges(
    const ShardLayout& layout, const std::vector<std::pair<std::size_t, std::size_t>>& flat_ranges) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (const ShardPiece& c : layout.shard_pieces(layout.whole(), layout.position()))
    for (const auto& [from, to] : flat_ranges) {
      const std::size_t lo = std::max(from, c.flat), hi = std::min(to, c.flat + c.count);
      if (lo < hi) out.emplace_back(c.other + (lo - c.flat), c.other + (hi - c.flat));
    }
  std::sort(out.begin(), out.end());
  std::vector<std::pair<std::size_t, std::size_t>> merged;
  for (const auto& r : out) {
    if (!merged.empty() && merged.back().second == r.first)
      merged.back().second = r.second;
    else
      merged.push_back(r);
  }
  return merged;
}

void ShardLayout::pack(const ShardGroup& g, std::span<const float> flat, std::span<float> buffer) const {
  std::fill(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(g.section * members_), 0.0f);
  for (int p = 0; p < members_; ++p)
    for (const ShardPiece& c : section_pieces(g, p))
      std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(c.flat), c.count,
                  buffer.begin() + static_cast<std::ptrdiff_t>(c.other));
}

void ShardLayout::unpack(const ShardGroup& g, std::span<const float> buffer, std::span<float> flat) const {
  for (int p = 0; p < members_; ++p)
    for (const ShardPiece& c : section_pieces(g, p))
      std::copy_n(buffer.begin() + static_cast<std::ptrdiff_t>(c.other), c.count,
                  flat.begin() + static_cast<std::ptrdiff_t>(c.flat));
}

void ShardLayout::take(int p, std::span<const float> flat, std::span<float> shard) const {
  std::fill(shard.begin(), shard.end(), 0.0f);
  for (const ShardPiece& c : shard_pieces(whole(), p))
    std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(c.flat), c.count,
                shard.begin() + static_cast<std::ptrdiff_t>(c.other));
}

void ShardLayout::put(int p, std::span<const float> shard, std::span<float> flat) const {
  for (const ShardPiece& c : shard_pieces(whole(), p))
    std::copy_n(shard.begin() + static_cast<std::ptrdiff_t>(c.other), c.count,
                flat.begin() + static_cast<std::ptrdiff_t>(c.flat));
}

std::vector<int> ZeroChunk::gathers(bool forward) const {
  std::vector<int> out;
  for (const UnitUse& u : forward ? forward_uses : backward_uses)
    if (u.gathered) out.push_back(u.unit);
  return out;
}

void keep_embedding_whole(BucketRanges& buckets, std::size_t lo, std::size_t hi) {
  // Bounds rise bucket by bucket; those strictly inside the embedding move to its end: the bucket
  // that reaches into it first takes it whole, and every later bucket starts at its end at the
  // earliest (those wholly inside it become empty), so no bound is left inside.
  for (std::size_t k = 0; k + 1 < buckets.size(); ++k)
    if (buckets[k].second > lo && buckets[k].second < hi) {
      buckets[k].second = hi;
      for (std::size_t j = k + 1; j < buckets.size(); ++j) {
        buckets[j].first = std::max(buckets[j].first, hi);
        buckets[j].second = std::max(buckets[j].second, hi);
      }
      return;
    }
}

ZeroChunk plan_zero_chunk(const Plan& plan, const StageSpec& spec, const std::vector<ParamInfo>& params,
                          const BucketRanges& buckets, const ParamInfo& tied_embedding, int members, int position) {
  ZeroChunk z;
  std::size_t n = 0;
  for (const ParamInfo& p : params) n = std::max(n, p.offset + p.size);

  // The stage's pieces as flat ranges: the head (parameters before the first block), each block,
  // the embedding (after the last block). Parameters are in gradient-completion order (head,
  // blocks from last to first, embedding), each block's together under "block.<layer>.".
  std::vector<std::pair<std::size_t, std::size_t>> block_range(static_cast<std::size_t>(spec.num_layers), {n, 0});
  for (const ParamInfo& p : params) {
    if (p.name.rfind("block.", 0) != 0) continue;
    const int layer = std::stoi(p.name.substr(6));
    auto& r = block_range[static_cast<std::size_t>(layer - spec.first_layer)];
    r.first = std::min(r.first, p.offset);
    r.second = std::max(r.second, p.offset + p.size);
  }
  std::size_t blocks_lo = n, blocks_hi = 0;
  for (const auto& r : block_range) blocks_lo = std::min(blocks_lo, r.first), blocks_hi = std::max(blocks_hi, r.second);
  if (spec.num_layers == 0) blocks_lo = blocks_hi = spec.has_head ? n : 0;
  const std::pair<std::size_t, std::size_t> head{0, spec.has_head ? blocks_lo : 0};
  const std::pair<std::size_t, std::size_t> embedding{spec.has_embedding ? blocks_hi : n, n};

  const bool tied_split = tied_embedding.size > 0 && plan.pp * plan.vpp > 1 && spec.dims.tied_embeddings;
  std::vector<std::size_t> cuts;
  for (const auto& [lo, hi] : buckets) cuts.push_back(lo), cuts.push_back(hi);
  for (const auto& [lo, hi] : block_range) cuts.push_back(lo), cuts.push_back(hi);
  cuts.push_back(head.second);
  cuts.push_back(embedding.first);
  if (tied_split) cuts.push_back(tied_embedding.offset), cuts.push_back(tied_embedding.offset + tied_embedding.size);
  z.layout = ShardLayout(n, members, position, std::move(cuts));
  for (const auto& [lo, hi] : buckets) z.buckets.push_back(z.layout.group(lo, hi));
  if (tied_split) z.tied = z.layout.group(tied_embedding.offset, tied_embedding.offset + tied_embedding.size);

  if (!plan.gathers_units()) return z;  // stage 3, or --overlap-param-gather's first forwards
  // A one-stage pipeline with tied embeddings reads the embedding at both ends of the forward
  // and at the start of the backward (the LM head): embedding and head are one unit.
  const bool merged = spec.has_embedding && spec.has_head && spec.dims.tied_embeddings;
  auto add_unit = [&](std::vector<std::pair<std::size_t, std::size_t>> ranges) {
    GatherUnit u;
    for (const auto& [lo, hi] : ranges)
      if (hi > lo) {
        u.groups.push_back(z.layout.group(lo, hi));
        u.elements += hi - lo;
      }
    z.units.push_back(std::move(u));
    return static_cast<int>(z.units.size()) - 1;
  };
  const int emb = spec.has_embedding ? (merged ? add_unit({head, embedding}) : add_unit({embedding})) : -1;
  const int hd = spec.has_head ? (merged ? emb : add_unit({head})) : -1;
  std::vector<int> blk;
  for (const auto& r : block_range) blk.push_back(add_unit({r}));

  // --overlap-param-gather keeps what it gathers (the weights stay whole until the next step's
  // first forward), and its backwards gather nothing.
  const bool keeps = !plan.gathers_before_backward();
  if (emb >= 0) z.forward_uses.push_back({WeightPiece::embedding, -1, emb, true, !merged && !keeps});
  for (int li = 0; li < spec.num_layers; ++li)
    z.forward_uses.push_back({WeightPiece::block, li, blk[li], true, !keeps});
  if (hd >= 0) z.forward_uses.push_back({WeightPiece::head, -1, hd, !merged, !keeps});
  if (keeps) return z;
  if (hd >= 0) z.backward_uses.push_back({WeightPiece::head, -1, hd, true, true});
  for (int li = spec.num_layers - 1; li >= 0; --li)
    z.backward_uses.push_back({WeightPiece::block, li, blk[li], true, true});
  return z;
}

bool gather_serves_forward(const RankProgram& program, int index) {
  const Op& op = program.ops[static_cast<std::size_t>(index)];
  if (op.kind == OpKind::AllGather && op.bucket == 1 && index > 0) --index;
  for (std::size_t i = static_cast<std::size_t>(index) + 1; i < program.ops.size(); ++i)
    if (program.ops[i].dep == index && is_compute(program.ops[i].kind)) return program.ops[i].kind == OpKind::Forward;
  return true;
}

// ---------------------------------------------------------------------------------------
// GatherGate
// ---------------------------------------------------------------------------------------
void GatherGate::reset() {
  std::lock_guard lock(mu_);
  held_.clear();
  gathered_ = acquired_ = 0;
  compute_waited_ns_ = 0;
  failed_.clear();
}

void GatherGate::fail(const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (failed_.empty()) failed_ = reason.empty() ? "failed" : reason;
  }
  cv_.notify_all();
}

void GatherGate::wait(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready) {
  cv_.wait(lock, [&] { return ready() || !failed_.empty(); });
  if (!failed_.empty()) throw std::runtime_error("ZeRO-3 gather stopped: " + failed_);
}

void GatherGate::reserve(int key) {
  std::unique_lock lock(mu_);
  wait(lock, [&] {
    return static_cast<int>(held_.size()) < capacity_ && std::find(held_.begin(), held_.end(), key) == held_.end();
  });
  held_.push_back(key);
}

void GatherGate::gathered() {
  {
    std::lock_guard lock(mu_);
    ++gathered_;
  }
  cv_.notify_all();
}

void GatherGate::acquire() {
  std::unique_lock lock(mu_);
  const bool missing = gathered_ <= acquired_ && failed_.empty();
  const bool waits = missing && before_wait_;
  const auto t0 = missing ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  if (waits) {
    lock.unlock();
    before_wait_();
    lock.lock();
  }
  wait(lock, [&] { return gathered_ > acquired_; });
  if (missing)
    compute_waited_ns_ +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  ++acquired_;
  if (waits) {
    lock.unlock();
    after_wait_();
  }
}

void GatherGate::release(int key) {
  {
    std::lock_guard lock(mu_);
    const auto it = std::find(held_.begin(), held_.end(), key);
    if (it != held_.end()) held_.erase(it);
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------
// ChunkWeightGate
// ---------------------------------------------------------------------------------------
void ChunkWeightGate::begin(bool forward) {
  if (uses_ && next_ < uses_->size())
    throw std::logic_error(fmt::format("ZeRO-3: a pass began with {} of the previous pass's {} weight uses left",
                                       uses_->size() - next_, uses_->size()));
  uses_ = forward ? &zero_.forward_uses : &zero_.backward_uses;
  next_ = 0;
  holding_ = false;
  passive_ = false;
}

void ChunkWeightGate::pass_through() {
  if (uses_ && next_ < uses_->size())
    throw std::logic_error(fmt::format("ZeRO: a pass began with {} of the previous pass's {} weight uses left",
                                       uses_->size() - next_, uses_->size()));
  uses_ = nullptr;
  passive_ = true;
}

const UnitUse& ChunkWeightGate::expect(WeightPiece piece, int block, bool acquiring) {
  if (!uses_ || next_ >= uses_->size())
    throw std::logic_error("ZeRO-3: the model read weights its pass does not gather");
  const UnitUse& u = (*uses_)[next_];
  if (u.piece != piece || (piece == WeightPiece::block && u.block != block) || holding_ == acquiring)
    throw std::logic_error(fmt::format("ZeRO-3: the model {} piece {} block {} out of the pass's order",
                                       acquiring ? "acquired" : "released", static_cast<int>(piece), block));
  return u;
}

void ChunkWeightGate::acquire(WeightPiece piece, int block) {
  if (passive_) return;
  const UnitUse& u = expect(piece, block, true);
  if (u.gathered) {
    gate_.acquire();
    if (on_acquire_) on_acquire_(u.unit);
  }
  holding_ = true;
}

void ChunkWeightGate::release(WeightPiece piece, int block) {
  if (passive_) return;
  const UnitUse& u = expect(piece, block, false);
  if (u.frees) {
    on_free_(u.unit);
    gate_.release(key_base_ + u.unit);
  }
  holding_ = false;
  ++next_;
}

}  // namespace trainsim::runtime
