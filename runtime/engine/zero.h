// ZeRO over a data-parallel group (Rajbhandari et al. 2020), as the schedule runs it, worked out
// once per rank and model chunk for every engine (the CPU engine moves host spans, the CUDA one
// device buffers; both follow these layouts and sequences):
//
//  * Shards. A chunk's flat parameters are cut into segments, each split into `members` equal
//    chunks (the last one padded), chunk p owned by the member at position p of the
//    data-parallel group. A rank's shard is its chunk of every segment, in order: its master
//    weights, optimizer moments and reduced gradients live there (stage 1 and up), and, under
//    stage 3, its compute-format weights too. Segments end at every gradient bucket's bounds
//    (a bucket's reduce-scatter leaves each member its own elements), at every gather unit's
//    (stage 3 gathers a unit at a time), and around a tied embedding split over the pipeline,
//    which is one segment on both its stages, so the first and the last stage of a replica own
//    the same elements of it and their embedding sum adds like to like (Megatron-LM gives the
//    shared embedding a bucket of its own for the same reason, NVIDIA/Megatron-LM#844).
//  * Collective buffers. A group of consecutive segments (a bucket, a gather unit, the whole
//    chunk) travels in a buffer of `members` sections, member p's section holding its chunk
//    of each segment: the layout the communicators' in-place reduce_scatter and all_gather use
//    (runtime/comm/communicator.h). Its own section is a contiguous range of the shard.
//  * Stage 3 gathers (gathers_before_forward and _backward): the schedule's all-gather before
//    a compute op brings the chunk's weights unit by unit (each block, the embedding, the head;
//    with tied embeddings on one stage, embedding and head as one unit), at most two units held
//    at once (the one in use and the next), released as soon as the pass leaves them, as
//    FSDP and DeepSpeed's ZeRO-3 hold "the gathered layer and the next" (sim's memory model).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/plan.h"
#include "core/schedule.h"
#include "runtime/engine/schedule_ops.h"
#include "runtime/model/stage_model.h"

namespace trainsim::runtime {

struct ShardSegment {
  std::size_t offset = 0, length = 0;  // flat elements [offset, offset + length)
  std::size_t chunk = 0;               // ceil(length / members): each member's part, padded
  std::size_t shard_offset = 0;        // where a member's chunk of it starts in its shard
};

// Consecutive segments [first, first + count) moved by one collective.
struct ShardGroup {
  std::size_t first = 0, count = 0;
  std::size_t section = 0;       // each member's part: the sum of the segments' chunks
  std::size_t shard_offset = 0;  // the own section's place in the shard
  std::size_t lo = 0, hi = 0;    // the flat range it covers
};

// A contiguous copy: `count` elements between flat offset `flat` and offset `other` of a shard
// or a collective buffer.
struct ShardPiece {
  std::size_t flat = 0, other = 0, count = 0;
};

class ShardLayout {
 public:
  ShardLayout() = default;
  // `params` flat elements over `members` ranks, this rank at `position`; segments end at every
  // offset of `cuts` inside (0, params).
  ShardLayout(std::size_t params, int members, int position, std::vector<std::size_t> cuts);

  int members() const { return members_; }
  int position() const { return position_; }
  std::size_t params() const { return params_; }
  std::size_t shard_size() const { return shard_size_; }
  const std::vector<ShardSegment>& segments() const { return segments_; }

  // The segments covering flat [lo, hi) exactly; std::logic_error when lo or hi is not a
  // segment bound. An empty range gives an empty group.
  ShardGroup group(std::size_t lo, std::size_t hi) const;
  // The valid (unpadded) parts of member p's section of `g`, as copies between the flat buffer
  // and the collective buffer of `g` (its section p starts at p * g.section).
  std::vector<ShardPiece> section_pieces(const ShardGroup& g, int p) const;
  // Member p's elements of `g` as copies between the flat buffer and a shard (the same offsets
  // in every member's shard); p = position(): this rank's own.
  std::vector<ShardPiece> shard_pieces(const ShardGroup& g, int p) const;
  ShardGroup whole() const { return group(0, params_); }

  // Host copies. pack: every member's section of `g` from `flat` into `buffer` (padding 0);
  // unpack: every member's section from `buffer` into `flat`; take: member p's elements of `flat`
  // into `shard`; put: member p's elements of `shard` into `flat`.
  void pack(const ShardGroup& g, std::span<const float> flat, std::span<float> buffer) const;
  void unpack(const ShardGroup& g, std::span<const float> buffer, std::span<float> flat) const;
  void take(int p, std::span<const float> flat, std::span<float> shard) const;
  void put(int p, std::span<const float> shard, std::span<float> flat) const;

 private:
  std::size_t params_ = 0, shard_size_ = 0;
  int members_ = 1, position_ = 0;
  std::vector<ShardSegment> segments_;
};

// Where a stage's weights are used, for stage 3's unit-by-unit gathers: a unit is one or two flat
// ranges (the embedding and head of a one-stage pipeline with tied embeddings share one).
struct GatherUnit {
  std::vector<ShardGroup> groups;
  std::size_t elements = 0;
};
// One use of a unit by a pass, in the pass's order: the model's WeightGate call (piece, block)
// it answers, the unit, whether it comes from a new gather (else it is still held), and whether
// the unit goes after it.
struct UnitUse {
  WeightPiece piece = WeightPiece::block;
  int block = -1;
  int unit = 0;
  bool gathered = true, frees = true;
};

// Everything ZeRO asks of one chunk of one rank.
struct ZeroChunk {
  ShardLayout layout;
  std::vector<ShardGroup> buckets;  // per gradient bucket of the chunk (empty when it has no reduction)
  ShardGroup tied;                  // the tied embedding split over the pipeline, or empty
  std::vector<GatherUnit> units;    // stage 3
  std::vector<UnitUse> forward_uses, backward_uses;
  // The units a pass gathers, in order (the uses that gather).
  std::vector<int> gathers(bool forward) const;
};

// norm_ranges (flat ranges of a chunk's gradients counted in the global norm) mapped onto this
// rank's shard of `layout`: the shard's ranges [begin, end) holding those elements, ascending
// (padding is left out: it is zero).
std::vector<std::pair<std::size_t, std::size_t>> shard_ranges(
    const ShardLayout& layout, const std::vector<std::pair<std::size_t, std::size_t>>& flat_ranges);

// The buckets of chunk `vstage` moved, when a tied embedding [lo, hi) sits inside a bucket's
// interior bound, to the end of the embedding, so that it is one segment on every stage that
// holds it (a bucket may become empty). Other chunks' buckets are left as they are.
void keep_embedding_whole(BucketRanges& buckets, std::size_t lo, std::size_t hi);

// Every plan's ZeRO for a rank's chunk: the shard layout over its data-parallel group (`members`,
// this rank at `position`), the buckets (as the engine reduces them), the tied embedding when it
// is split over the pipeline, and stage 3's units and passes. `params` and `spec` are the chunk's
// model's (StageModel::params(), its StageSpec).
ZeroChunk plan_zero_chunk(const Plan& plan, const StageSpec& spec, const std::vector<ParamInfo>& params,
                          const BucketRanges& buckets, const ParamInfo& tied_embedding, int members, int position);

// Whether the schedule's all-gather at op `index` of `program` serves a forward (else a backward):
// the compute op that waits for it (for the rest of a ZeRO-3 pass's units, op bucket 1, the one
// that waits for the gather of its first, right before it).
bool gather_serves_forward(const RankProgram& program, int index);

// Stage 3's hand-over of gathered units between a rank's communication thread (which gathers
// them, in program order) and its compute thread (which uses them, in the same order), holding at
// most `capacity` units at once. A unit is named by a key (its chunk and index): a unit still held
// by one pass is not gathered again for the next until that pass gave it back (and poisoned it).
// Every wait fails with the rank's error once fail() is called.
inline constexpr int kZero3UnitsHeld = 2;  // the units a rank's GatherGate holds at once
class GatherGate {
 public:
  explicit GatherGate(int capacity = kZero3UnitsHeld) : capacity_(capacity) {}
  void reset();
  void fail(const std::string& reason);
  // Called around acquire()'s wait when it has to wait (a CPU rank gives its core back meanwhile).
  void on_wait(std::function<void()> before, std::function<void()> after) {
    before_wait_ = std::move(before);
    after_wait_ = std::move(after);
  }
  // Communication thread: wait for room (and for `key` to be free), then hand the unit over.
  void reserve(int key);
  void gathered();
  // Compute thread: wait for the next unit; give unit `key` back.
  void acquire();
  void release(int key);
  // Compute thread: nanoseconds acquire() waited for units since the last call (a pass held up
  // by its gathers: OpTiming::waited of the compute op).
  std::int64_t take_compute_waited_ns() { return std::exchange(compute_waited_ns_, 0); }

 private:
  void wait(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready);
  std::mutex mu_;
  std::condition_variable cv_;
  int capacity_;
  std::vector<int> held_;  // keys reserved and not yet given back
  long gathered_ = 0, acquired_ = 0;
  std::int64_t compute_waited_ns_ = 0;  // compute thread only
  std::string failed_;
  std::function<void()> before_wait_, after_wait_;
};

// Stage 3's all-gathers before a pass of chunk `zero` (its key_base in the rank's gate): the
// schedule's first gather op (`rest` false) brings the pass's first unit, the next one (`rest`
// true) every other unit, in order, each once there is room for it (`gather(unit, first_part)`
// moves it, parts numbered across the op), handed over to the pass. Returns the nanoseconds
// spent waiting for room (the pass's pace, not the gather's: OpTiming::waited); `units`, if given,
// gets each unit's moment of room and end (RankStep::parts).
using UnitTimes = std::vector<std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>>;
template <class Gather>
std::int64_t gather_units(const ZeroChunk& zero, bool forward, bool rest, GatherGate& gate, int key_base,
                          Gather&& gather, UnitTimes* unit_times = nullptr) {
  int part = 0;
  std::int64_t waited_ns = 0;
  const std::vector<int> units = zero.gathers(forward);
  const std::size_t from = rest ? std::min<std::size_t>(1, units.size()) : 0;
  const std::size_t to = rest ? units.size() : std::min<std::size_t>(1, units.size());
  for (std::size_t k = from; k < to; ++k) {
    const int u = units[k];
    const auto t0 = std::chrono::steady_clock::now();
    gate.reserve(key_base + u);
    const auto room = std::chrono::steady_clock::now();
    waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(room - t0).count();
    gather(u, part);
    // The unit's end is when its weights are in place: the hand-over wakes the compute thread
    // waiting for it, which may take this thread's core (where they share one) for a scheduler
    // slice before the clock could be read again.
    const auto done = std::chrono::steady_clock::now();
    part += static_cast<int>(zero.units[static_cast<std::size_t>(u)].groups.size());
    gate.gathered();
    if (unit_times) unit_times->emplace_back(room, done);
  }
  return waited_ns;
}

// The model's WeightGate for one chunk under stage 3: maps its calls onto the chunk's uses (the
// pass set by begin()), takes units from the rank's GatherGate, and gives them back through
// `on_free` (which poisons them) and the gate.
class ChunkWeightGate final : public WeightGate {
 public:
  // `key_base` + unit: the units' keys in the rank's GatherGate. `on_acquire` (optional) runs once
  // a unit is there (a device engine makes its compute stream wait for the gather).
  ChunkWeightGate(const ZeroChunk& zero, GatherGate& gate, int key_base, std::function<void(int unit)> on_free,
                  std::function<void(int unit)> on_acquire = {})
      : zero_(zero), gate_(gate), key_base_(key_base), on_free_(std::move(on_free)), on_acquire_(std::move(on_acquire)) {}
  // Before a forward (forward = true), or the first segment of a backward or backward_input.
  void begin(bool forward);
  // Before a pass that gathers nothing (under --overlap-param-gather every pass but a chunk's
  // first forward of the step): the weights are all in place, the model's calls pass through.
  void pass_through();
  void acquire(WeightPiece piece, int block) override;
  void release(WeightPiece piece, int block) override;

 private:
  const UnitUse& expect(WeightPiece piece, int block, bool acquiring);
  const ZeroChunk& zero_;
  GatherGate& gate_;
  int key_base_;
  std::function<void(int)> on_free_, on_acquire_;
  const std::vector<UnitUse>* uses_ = nullptr;
  std::size_t next_ = 0;
  bool holding_ = false;
  bool passive_ = false;
};

}  // namespace trainsim::runtime
