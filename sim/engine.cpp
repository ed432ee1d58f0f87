#include "sim/engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace trainsim {

Simulation::Simulation(std::shared_ptr<const Schedule> schedule, const CostModels& models)
    : schedule_(std::move(schedule)) {
  const Schedule& s = *schedule_;
  const int nranks = static_cast<int>(s.ranks.size());
  const std::size_t nops = s.total_ops();
  rank_offset_.resize(nranks + 1, 0);
  for (int r = 0; r < nranks; ++r) rank_offset_[r + 1] = rank_offset_[r] + static_cast<std::int32_t>(s.ranks[r].ops.size());
  op_.resize(nops);
  dep_.resize(nops);
  duration_.resize(nops);
  done_at_.assign(nops, -1);
  timing_.resize(nops);
  stream_ops_.resize(nops);
  streams_.resize(static_cast<std::size_t>(nranks) * kNumStreams);

  collective_duration_.resize(s.collectives.size());
  for (std::size_t c = 0; c < s.collectives.size(); ++c)
    collective_duration_[c] = models.collective->duration(s.collectives[c]);
  collective_arrivals_.assign(s.collectives.size(), 0);
  message_arrival_.assign(s.num_messages, -1);

  // Price every op once, then lay out each stream's op ids contiguously.
  std::vector<std::int32_t> per_stream_count(streams_.size(), 0);
  for (int r = 0; r < nranks; ++r) {
    const auto& ops = s.ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const std::int32_t g = rank_offset_[r] + static_cast<std::int32_t>(i);
      const Op& op = ops[i];
      op_[g] = &op;
      dep_[g] = op.dep >= 0 ? rank_offset_[r] + op.dep : -1;
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
  heap_.reserve(streams_.size() + 16);
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
    const Op& op = *op_[g];
    if (dep_[g] >= 0 && done_at_[dep_[g]] < 0) return;  // woken when the dependency ends
    if (is_recv(op.kind)) {
      if (message_arrival_[op.channel] < 0) return;  // woken when the send ends
      timing_[g].start = st.free_at;
      timing_[g].end = now;
      done_at_[g] = now;
      st.free_at = now;
      ++st.cursor;
      ++completed_;
      continue;
    }
    if (is_collective(op.kind) && op.channel >= 0) {
      if (st.arrived) return;  // waiting for the other members
      st.arrived = true;
      const Collective& c = schedule_->collectives[op.channel];
      if (++collective_arrivals_[op.channel] < static_cast<std::int32_t>(c.members.size())) return;
      for (int member : c.members) {
        const std::int32_t ms = member * kNumStreams + static_cast<int>(StreamKind::collective);
        streams_[ms].arrived = false;
        start(ms, stream_ops_[streams_[ms].cursor], now, collective_duration_[op.channel]);
      }
      return;
    }
    start(stream, g, now, duration_[g]);
  }
}

void Simulation::finish(const Event& e) {
  StreamState& st = streams_[e.stream];
  const std::int32_t g = stream_ops_[st.cursor];
  const Op& op = *op_[g];
  timing_[g].end = e.time;
  done_at_[g] = e.time;
  st.busy = false;
  st.free_at = e.time;
  ++st.cursor;
  ++completed_;
  // Anything this end can release: the rest of this stream, the rank's other streams
  // (their ops may depend on this one), and the receiver of a message.
  const std::int32_t base = st.rank * kNumStreams;
  for (int k = 0; k < kNumStreams; ++k) try_advance(base + k, e.time);
  if (is_send(op.kind)) {
    message_arrival_[op.channel] = e.time;
    try_advance(op.peer * kNumStreams + static_cast<int>(StreamKind::compute), e.time);
  }
}

Timeline Simulation::run() {
  for (std::int32_t st = 0; st < static_cast<std::int32_t>(streams_.size()); ++st) try_advance(st, 0);
  while (!heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end(), Later{});
    const Event e = heap_.back();
    heap_.pop_back();
    finish(e);
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
  Timeline t;
  t.schedule = schedule_;
  t.predicted = true;
  t.ops.resize(schedule_->ranks.size());
  for (std::size_t r = 0; r < schedule_->ranks.size(); ++r)
    t.ops[r].assign(timing_.begin() + rank_offset_[r], timing_.begin() + rank_offset_[r + 1]);
  return t;
}

Timeline simulate_schedule(std::shared_ptr<const Schedule> schedule, const CostModels& models) {
  Simulation sim(std::move(schedule), models);
  return sim.run();
}

}  // namespace trainsim
