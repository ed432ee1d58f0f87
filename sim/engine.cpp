#include "sim/engine.h"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace trainsim {

namespace {
constexpr int stream_index(int rank, StreamKind k) { return rank * kNumStreams + static_cast<int>(k); }
}  // namespace

void Simulation::prepare(const CostModels& models) {
  const Schedule& s = *schedule_;
  const int nranks = static_cast<int>(s.ranks.size());
  rank_offset_.assign(nranks + 1, 0);
  for (int r = 0; r < nranks; ++r) rank_offset_[r + 1] = rank_offset_[r] + static_cast<std::int32_t>(s.ranks[r].ops.size());
  const std::size_t nops = static_cast<std::size_t>(rank_offset_[nranks]);
  slot_of_.resize(nops);
  slots_.assign(nops, Slot{});
  streams_.assign(static_cast<std::size_t>(nranks) * kNumStreams, StreamState{});
  heap_.clear();
  seq_ = 0;
  completed_ = 0;

  collective_duration_.resize(s.collectives.size());
  for (std::size_t c = 0; c < s.collectives.size(); ++c)
    collective_duration_[c] = models.collective->duration(s.collectives[c]);
  collective_arrivals_.assign(s.collectives.size(), 0);
  message_arrival_.assign(s.num_messages, -1);

  // Each stream's ops get consecutive slots, in program order.
  stream_fill_.assign(streams_.size(), 0);
  for (int r = 0; r < nranks; ++r)
    for (const Op& op : s.ranks[r].ops) stream_fill_[stream_index(r, stream_of(op.kind))]++;
  std::int32_t offset = 0;
  for (std::size_t st = 0; st < streams_.size(); ++st) {
    streams_[st].rank = static_cast<std::int32_t>(st / kNumStreams);
    streams_[st].cursor = offset;
    offset += stream_fill_[st];
    streams_[st].end = offset;
    stream_fill_[st] = streams_[st].cursor;  // from here on: the next free slot of the stream
  }

  for (int r = 0; r < nranks; ++r) {
    const auto& ops = s.ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      const StreamKind kind = stream_of(op.kind);
      const std::int32_t slot = stream_fill_[stream_index(r, kind)]++;
      slot_of_[rank_offset_[r] + i] = slot;
      Slot& sl = slots_[slot];
      sl.channel = op.channel;
      if (is_compute(op.kind)) {
        sl.duration = models.compute->duration(op, r);
      } else if (is_send(op.kind)) {
        sl.role = Role::send;
        sl.receiver = stream_index(op.peer, StreamKind::compute);
        sl.duration = models.p2p->duration(r, op.peer, op.bytes);
      } else if (is_recv(op.kind)) {
        sl.role = Role::recv;
      } else if (is_collective(op.kind) && op.channel >= 0) {
        sl.role = Role::collective;  // priced per collective above
      }
      if (op.dep >= 0) {
        sl.dep = slot_of_[rank_offset_[r] + op.dep];  // deps point backwards: already placed
        slots_[sl.dep].wakes |= static_cast<std::uint8_t>(1u << static_cast<int>(kind));
      }
    }
  }
}

void Simulation::push(Tick time, std::int32_t stream) {
  heap_.push_back(Event{time, seq_++, stream});
  std::push_heap(heap_.begin(), heap_.end(), Later{});
}

// Starts as many ops of `stream` as can start at `now`. Receives whose message is in end
// at once (they do no work); a collective registers its arrival and starts on every member
// when the last one arrives.
void Simulation::try_advance(std::int32_t stream, Tick now) {
  StreamState& st = streams_[stream];
  while (!st.busy && st.cursor < st.end) {
    Slot& sl = slots_[st.cursor];
    if (sl.dep >= 0 && slots_[sl.dep].end < 0) return;  // woken when the dependency ends
    switch (sl.role) {
      case Role::recv:
        if (message_arrival_[sl.channel] < 0) return;  // woken when the send ends
        sl.start = st.free_at;  // the interval the stream spent blocked
        sl.end = now;
        st.free_at = now;
        ++st.cursor;
        ++completed_;
        continue;
      case Role::collective: {
        if (st.arrived) return;  // waiting for the other members
        st.arrived = true;
        const std::int32_t c = sl.channel;
        const auto& members = schedule_->collectives[c].members;
        if (++collective_arrivals_[c] < static_cast<std::int32_t>(members.size())) return;
        // One event ends the collective on every member.
        for (int member : members) {
          StreamState& ms = streams_[stream_index(member, StreamKind::collective)];
          ms.arrived = false;
          ms.busy = true;
          slots_[ms.cursor].start = now;
        }
        push(now + collective_duration_[c], -1 - c);
        return;
      }
      default:
        st.busy = true;
        sl.start = now;
        push(now + sl.duration, stream);
        return;
    }
  }
}

void Simulation::finish(std::int32_t stream, Tick now) {
  StreamState& st = streams_[stream];
  Slot& sl = slots_[st.cursor];
  sl.end = now;
  st.busy = false;
  st.free_at = now;
  ++st.cursor;
  ++completed_;
  // Anything this end can release: the rest of this stream, the rank's streams whose ops
  // depend on this one, and the receiver of a message.
  const std::int32_t base = st.rank * kNumStreams;
  try_advance(stream, now);
  for (std::uint32_t mask = sl.wakes & ~(1u << (stream - base)); mask != 0; mask &= mask - 1)
    try_advance(base + std::countr_zero(mask), now);
  if (sl.role == Role::send) {
    message_arrival_[sl.channel] = now;
    try_advance(sl.receiver, now);
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
      finish(e.stream, e.time);
    } else {
      for (int member : schedule_->collectives[-1 - e.stream].members)
        finish(stream_index(member, StreamKind::collective), e.time);
    }
  }
  const Schedule& s = *schedule_;
  if (completed_ != static_cast<std::int64_t>(slots_.size())) {
    std::string blocked;
    for (std::size_t r = 0; r < s.ranks.size(); ++r)
      for (int k = 0; k < kNumStreams; ++k) {
        const StreamState& st = streams_[stream_index(static_cast<int>(r), static_cast<StreamKind>(k))];
        if (st.cursor >= st.end) continue;
        for (std::size_t i = 0; i < s.ranks[r].ops.size(); ++i)
          if (slot_of_[rank_offset_[r] + i] == st.cursor)
            blocked += fmt::format("\n  rank {} op {} {}", r, i, op_label(s.ranks[r].ops[i]));
      }
    throw std::logic_error(
        fmt::format("schedule deadlocked after {} of {} ops; blocked at:{}", completed_, slots_.size(), blocked));
  }
  t.schedule = schedule_;
  t.predicted = true;
  t.ops.resize(s.ranks.size());
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    auto& out = t.ops[r];
    out.resize(s.ranks[r].ops.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      const Slot& sl = slots_[slot_of_[rank_offset_[r] + i]];
      out[i] = OpTiming{sl.start, sl.end};
    }
  }
}

std::size_t Simulation::footprint_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return bytes(rank_offset_) + bytes(slot_of_) + bytes(stream_fill_) + bytes(slots_) + bytes(streams_) +
         bytes(message_arrival_) + bytes(collective_arrivals_) + bytes(collective_duration_) + bytes(heap_);
}

Timeline simulate_schedule(std::shared_ptr<const Schedule> schedule, const CostModels& models) {
  Simulation sim;
  Timeline t;
  sim.run(std::move(schedule), models, t);
  return t;
}

}  // namespace trainsim
