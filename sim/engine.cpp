#include "sim/engine.h"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace trainsim {

void Simulation::prepare(const CostModels& models) {
  const Schedule& s = *schedule_;
  const int nranks = static_cast<int>(s.ranks.size());
  rank_offset_.assign(nranks + 1, 0);
  for (int r = 0; r < nranks; ++r) rank_offset_[r + 1] = rank_offset_[r] + static_cast<std::int32_t>(s.ranks[r].ops.size());
  const std::size_t nops = static_cast<std::size_t>(rank_offset_[nranks]);
  op_.resize(nops);
  role_.resize(nops);
  channel_.resize(nops);
  dep_.resize(nops);
  wakes_.assign(nops, 0);
  duration_.resize(nops);
  timing_.assign(nops, OpTiming{0, -1});
  stream_ops_.resize(nops);
  streams_.assign(static_cast<std::size_t>(nranks) * kNumStreams, StreamState{});
  heap_.clear();
  seq_ = 0;
  completed_ = 0;

  collective_duration_.resize(s.collectives.size());
  for (std::size_t c = 0; c < s.collectives.size(); ++c)
    collective_duration_[c] = models.collective->duration(s.collectives[c]);
  collective_arrivals_.assign(s.collectives.size(), 0);
  message_arrival_.assign(s.num_messages, -1);

  // Price every op once, then lay out each stream's op ids contiguously.
  per_stream_count_.assign(streams_.size(), 0);
  auto& per_stream_count = per_stream_count_;
  for (int r = 0; r < nranks; ++r) {
    const auto& ops = s.ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const std::int32_t g = rank_offset_[r] + static_cast<std::int32_t>(i);
      const Op& op = ops[i];
      op_[g] = &op;
      role_[g] = is_recv(op.kind)                                ? Role::recv
                 : is_send(op.kind)                              ? Role::send
                 : is_collective(op.kind) && op.channel >= 0     ? Role::collective
                                                                 : Role::work;
      channel_[g] = op.channel;
      dep_[g] = op.dep >= 0 ? rank_offset_[r] + op.dep : -1;
      if (op.dep >= 0) wakes_[dep_[g]] |= static_cast<std::uint8_t>(1u << static_cast<int>(stream_of(op.kind)));
      if (is_compute(op.kind))
        duration_[g] = models.compute->duration(op, r);
      else if (is_send(op.kind))
        duration_[g] = models.p2p->duration(r, op.peer, op.bytes);
      else
        duration_[g] = 0;  // receives wait, collectives are priced per collective above
      per_stream_count[r * kNumStreams + static_cast<int>(stream_of(op.kind))]++;
    }
  }
  std::int32_t offset = 0;
  for (std::size_t st = 0; st < streams_.size(); ++st) {
    streams_[st].rank = static_cast<std::int32_t>(st / kNumStreams);
    streams_[st].begin = streams_[st].cursor = offset;
    offset += per_stream_count[st];
    streams_[st].end = streams_[st].begin;  // grows as ops are placed below
  }
  for (int r = 0; r < nranks; ++r)
    for (std::int32_t g = rank_offset_[r]; g < rank_offset_[r + 1]; ++g) {
      StreamState& st = streams_[r * kNumStreams + static_cast<int>(stream_of(op_[g]->kind))];
      stream_ops_[st.end++] = g;
    }
}

void Simulation::push(Tick time, std::int32_t stream) {
  heap_.push_back(Event{time, seq_++, stream});
  std::push_heap(heap_.begin(), heap_.end(), Later{});
}

void Simulation::start(std::int32_t stream, std::int32_t g, Tick now, Tick duration) {
  streams_[stream].busy = true;
  timing_[g].start = now;
  push(now + duration, stream);
}

// Starts as many ops of `stream` as can start at `now`. Receives whose message is in end
// at once (they take no time); a collective registers its arrival and starts on every
// member when the last one arrives.
void Simulation::try_advance(std::int32_t stream, Tick now) {
  StreamState& st = streams_[stream];
  while (!st.busy && st.cursor < st.end) {
    const std::int32_t g = stream_ops_[st.cursor];
    if (dep_[g] >= 0 && timing_[dep_[g]].end < 0) return;  // woken when the dependency ends
    const Role role = role_[g];
    if (role == Role::recv) {
      if (message_arrival_[channel_[g]] < 0) return;  // woken when the send ends
      timing_[g].start = st.free_at;
      timing_[g].end = now;
      st.free_at = now;
      ++st.cursor;
      ++completed_;
      continue;
    }
    if (role == Role::collective) {
      if (st.arrived) return;  // waiting for the other members
      st.arrived = true;
      const std::int32_t c = channel_[g];
      const auto& members = schedule_->collectives[c].members;
      if (++collective_arrivals_[c] < static_cast<std::int32_t>(members.size())) return;
      // One event ends the collective on every member.
      for (int member : members) {
        StreamState& ms = streams_[member * kNumStreams + static_cast<int>(StreamKind::collective)];
        ms.arrived = false;
        ms.busy = true;
        timing_[stream_ops_[ms.cursor]].start = now;
      }
      push(now + collective_duration_[c], -1 - c);
      return;
    }
    start(stream, g, now, duration_[g]);
  }
}

void Simulation::finish(const Event& e) {
  StreamState& st = streams_[e.stream];
  const std::int32_t g = stream_ops_[st.cursor];
  timing_[g].end = e.time;
  st.busy = false;
  st.free_at = e.time;
  ++st.cursor;
  ++completed_;
  // Anything this end can release: the rest of this stream, the rank's streams whose ops
  // depend on this one, and the receiver of a message.
  const std::int32_t base = st.rank * kNumStreams;
  try_advance(e.stream, e.time);
  for (std::uint32_t mask = wakes_[g] & ~(1u << (e.stream - base)); mask != 0; mask &= mask - 1)
    try_advance(base + std::countr_zero(mask), e.time);
  if (role_[g] == Role::send) {
    const Op& op = *op_[g];
    message_arrival_[op.channel] = e.time;
    try_advance(op.peer * kNumStreams + static_cast<int>(StreamKind::compute), e.time);
  }
}

void Simulation::run(std::shared_ptr<const Schedule> schedule, const CostModels& models, Timeline& t) {
  schedule_ = std::move(schedule);
  prepare(models);
  for (std::int32_t st = 0; st < static_cast<std::int32_t>(streams_.size()); ++st) try_advance(st, 0);
  while (!heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end(), Later{});
    const Event e = heap_.back();
    heap_.pop_back();
    if (e.stream >= 0) {
      finish(e);
    } else {
      const auto& members = schedule_->collectives[-1 - e.stream].members;
      for (int member : members)
        finish(Event{e.time, e.seq, member * kNumStreams + static_cast<int>(StreamKind::collective)});
    }
  }
  if (completed_ != static_cast<std::int64_t>(op_.size())) {
    std::string blocked;
    for (const auto& st : streams_)
      if (st.cursor < st.end) {
        const std::int32_t g = stream_ops_[st.cursor];
        const int r = st.rank;
        blocked += fmt::format("\n  rank {} op {} {}", r, g - rank_offset_[r], op_label(*op_[g]));
      }
    throw std::logic_error(fmt::format("schedule deadlocked after {} of {} ops; blocked at:{}", completed_, op_.size(), blocked));
  }
  t.schedule = schedule_;
  t.predicted = true;
  t.ops.resize(schedule_->ranks.size());
  for (std::size_t r = 0; r < schedule_->ranks.size(); ++r)
    t.ops[r].assign(timing_.begin() + rank_offset_[r], timing_.begin() + rank_offset_[r + 1]);
}

std::size_t Simulation::footprint_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return bytes(rank_offset_) + bytes(op_) + bytes(role_) + bytes(channel_) + bytes(dep_) + bytes(wakes_) + bytes(duration_) + bytes(timing_) + bytes(per_stream_count_) +
         bytes(stream_ops_) + bytes(streams_) + bytes(message_arrival_) + bytes(collective_arrivals_) +
         bytes(collective_duration_) + bytes(heap_);
}

Timeline simulate_schedule(std::shared_ptr<const Schedule> schedule, const CostModels& models) {
  Simulation sim;
  Timeline t;
  sim.run(std::move(schedule), models, t);
  return t;
}

}  // namespace trainsim
