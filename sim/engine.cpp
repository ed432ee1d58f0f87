#include "sim/engine.h"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "sim/cost/model_calls.h"

namespace trainsim {

namespace {

constexpr std::int32_t kCompute = static_cast<std::int32_t>(StreamKind::compute);
constexpr std::int32_t kCollective = static_cast<std::int32_t>(StreamKind::collective);

// stream_of as a table: the scans below read it for every op of a rank, per stream.
std::array<std::uint8_t, kNumOpKinds> stream_table(bool blocking_sends) {
  std::array<std::uint8_t, kNumOpKinds> t{};
  for (int k = 0; k < kNumOpKinds; ++k) {
    const auto kind = static_cast<OpKind>(k);
    t[k] = static_cast<std::uint8_t>(blocking_sends && is_send(kind) ? StreamKind::compute : stream_of(kind));
  }
  return t;
}

}  // namespace

void Simulation::enqueue(std::int32_t stream) {
  StreamState& st = streams_[stream];
  if (st.queued) return;
  st.queued = true;
  worklist_.push_back(stream);
}

// Prices collective c and lists its simulated members, the first time a simulated rank
// reaches it. Consecutive collectives often have the same members (one stage's gradient
// buckets) and sizes (full buckets): those reuse the previous one's figures. A collective
// model prices a collective from its kind, bytes and members alone.
template <class Models>
void Simulation::prepare_collective(const Models& models, std::int32_t c) {
  const Schedule& s = *schedule_;
  const Collective& col = s.collectives[c];
  CollectiveState& cs = collectives_[c];
  const bool same_members = last_priced_ >= 0 && s.collectives[last_priced_].members == col.members;
  if (same_members) {
    const Collective& prev = s.collectives[last_priced_];
    const CollectiveState& ps = collectives_[last_priced_];
    cs.duration = prev.kind == col.kind && prev.bytes == col.bytes && prev.parts == col.parts ? ps.duration
                                                                                              : models.collective(col);
    cs.target = ps.target;
    cs.first = ps.first;
    cs.count = ps.count;
  } else {
    cs.duration = models.collective(col);
    if (symmetric_) {
      cs.first = static_cast<std::int32_t>(sim_members_.size());
      for (int m : col.members)
        if (simulated_[m]) sim_members_.push_back(m);
      cs.count = static_cast<std::int32_t>(sim_members_.size()) - cs.first;
      cs.target = cs.count;
    } else {
      cs.target = static_cast<std::int32_t>(col.members.size());
    }
  }
  last_priced_ = c;
}

// Runs `stream` as far as it can go now: each op ends as soon as what it waits for has
// ended (see the header for the rule per op).
template <class Models>
void Simulation::advance(const Models& models, std::int32_t stream, Timeline& out) {
  const Schedule& s = *schedule_;
  const std::int32_t r = stream / kNumStreams;
  const std::int32_t k = stream - r * kNumStreams;
  const Op* ops = s.ranks[r].ops.data();
  const auto n = static_cast<std::int32_t>(s.ranks[r].ops.size());
  OpTiming* times = out.ops[r].data();
  StreamState* rank_streams = &streams_[static_cast<std::size_t>(r) * kNumStreams];
  StreamState& st = rank_streams[k];
  st.waits_dep = false;
  bool progressed = false;
  for (;;) {
    std::int32_t i = st.cursor;
    while (i < n && stream_of_[static_cast<std::uint8_t>(ops[i].kind)] != k) ++i;
    st.cursor = i;
    if (i == n) break;
    const Op& op = ops[i];
    Tick ready = st.free_at;
    if (op.dep >= 0) {
      // An op of another stream has ended once that stream's cursor is past it.
      const std::int32_t d = op.dep;
      const std::int32_t kd = stream_of_[static_cast<std::uint8_t>(ops[d].kind)];
      if (kd != k && d >= rank_streams[kd].cursor) {
        st.waits_dep = true;  // woken when its rank's other streams move on
        break;
      }
      ready = std::max(ready, times[d].end);
    }
    if (blocking_sends_ && (is_recv(op.kind) || is_send(op.kind))) {
      // One exchange: this op and the sends and receives right after it on the stream are
      // posted together (a batched isend/irecv); post its receives, whose senders may wait.
      for (std::int32_t j = i; j < n; ++j) {
        const OpKind kj = ops[j].kind;
        if (stream_of_[static_cast<std::uint8_t>(kj)] != k) continue;
        if (!is_recv(kj) && !is_send(kj)) break;
        if (is_recv(kj) && recv_posted_[ops[j].channel] < 0) {
          recv_posted_[ops[j].channel] = ready;
          if (simulated_[ops[j].peer]) enqueue(ops[j].peer * kNumStreams + kCompute);
        }
      }
    }
    if (is_recv(op.kind)) {
      const Tick arrival = message_arrival_[op.channel];
      if (arrival < 0) break;  // woken when the send ends
      times[i] = OpTiming{st.free_at, std::max(ready, arrival)};  // the interval the stream spent blocked
      st.free_at = times[i].end;
    } else if (is_collective(op.kind) && op.channel >= 0) {
      if (st.arrived) break;  // waiting for the other members
      const std::int32_t c = op.channel;
      CollectiveState& cs = collectives_[c];
      if (cs.duration < 0) prepare_collective(models, c);
      st.arrived = true;
      cs.first_arrival = cs.first_arrival < 0 ? ready : std::min(cs.first_arrival, ready);
      cs.last_arrival = std::max(cs.last_arrival, ready);
      if (++cs.arrivals < cs.target) break;
      // The last member is here: the collective runs on every member at once.
      const Tick start = cs.last_arrival,
                 end = add_ticks(start, cs.duration + models.collective_wake(cs.last_arrival - cs.first_arrival));
      auto end_on = [&](std::int32_t member) {
        StreamState* ms = &streams_[static_cast<std::size_t>(member) * kNumStreams];
        StreamState& mc = ms[kCollective];
        out.ops[member][mc.cursor] = OpTiming{start, end};
        mc.free_at = end;
        mc.arrived = false;
        ++mc.cursor;
        ++completed_;
        if (member == r) return;
        enqueue(member * kNumStreams + kCollective);
        for (std::int32_t kk = 0; kk < kNumStreams; ++kk)
          if (ms[kk].waits_dep) enqueue(member * kNumStreams + kk);
      };
      if (symmetric_) {
        for (std::int32_t j = cs.first; j < cs.first + cs.count; ++j) end_on(sim_members_[j]);
      } else {
        for (int member : s.collectives[c].members) end_on(member);
      }
      progressed = true;
      continue;
    } else {
      Tick duration = 0;
      if (is_compute(op.kind)) duration = models.compute(op, r);
      else if (is_send(op.kind)) duration = models.p2p(r, op.peer, op.bytes);
      if (blocking_sends_ && is_send(op.kind)) {
        // A rendezvous: the message moves once its receiver has posted the receive.
        const Tick posted = recv_posted_[op.channel];
        if (posted < 0) break;  // woken when the receiver posts
        ready = std::max(ready, posted);
      }
      times[i] = OpTiming{ready, add_ticks(ready, duration)};
      st.free_at = times[i].end;
      if (is_send(op.kind)) {
        message_arrival_[op.channel] = st.free_at;
        if (simulated_[op.peer]) enqueue(op.peer * kNumStreams + kCompute);
      }
    }
    st.cursor = i + 1;
    ++completed_;
    progressed = true;
  }
  if (progressed)
    for (std::int32_t kk = 0; kk < kNumStreams; ++kk)
      if (kk != k && rank_streams[kk].waits_dep) enqueue(r * kNumStreams + kk);
}

// materialised = false: replicas 1.. have empty programs (run_replica0); returns false
// instead of falling back to a full run.
template <class Models>
bool Simulation::run_impl(const Models& models, Timeline& t, bool replica_symmetric, bool materialised) {
  const Schedule& s = *schedule_;
  const auto nranks = static_cast<std::int32_t>(s.ranks.size());
  stream_of_ = stream_table(models.blocking_sends());
  // Megatron-LM's own schedules exchange through blocking batched isend/irecv calls, so a send
  // waits for its receiver (a rendezvous). ZB-H1 stands for the Zero Bubble runtime, whose
  // scheduler posts every receive ahead of the compute that needs it: its sends never wait.
  blocking_sends_ = models.blocking_sends() && s.kind != ScheduleKind::zb_h1;
  symmetric_ = false;
  simulated_.assign(nranks, 1);
  counterpart_.resize(nranks);
  for (std::int32_t r = 0; r < nranks; ++r) counterpart_[r] = r;
  if (replica_symmetric) {
    // Replica 0's rank of each stage; every other rank takes its timings.
    std::vector<std::int32_t>& of_stage = sim_members_;  // scratch until the run starts
    of_stage.assign(nranks, -1);
    bool ok = true;
    for (std::int32_t r = 0; r < nranks && ok; ++r) {
      const RankProgram& prog = s.ranks[r];
      ok = prog.stage >= 0 && prog.stage < nranks && prog.replica >= 0;
      if (ok && prog.replica == 0) {
        ok = of_stage[prog.stage] < 0;
        of_stage[prog.stage] = r;
      }
    }
    for (std::int32_t r = 0; r < nranks && ok; ++r) {
      const std::int32_t c = of_stage[s.ranks[r].stage];
      ok = c >= 0 && (!materialised || s.ranks[c].ops.size() == s.ranks[r].ops.size());
      counterpart_[r] = c;
      simulated_[r] = c == r;
    }
    symmetric_ = ok;
    if (!ok && !materialised) return false;
    if (!ok) {
      simulated_.assign(nranks, 1);
      for (std::int32_t r = 0; r < nranks; ++r) counterpart_[r] = r;
    }
  }

  streams_.assign(static_cast<std::size_t>(nranks) * kNumStreams, StreamState{});
  message_arrival_.assign(s.num_messages, -1);
  recv_posted_.assign(blocking_sends_ ? s.num_messages : 0, -1);
  collectives_.assign(s.collectives.size(), CollectiveState{});
  sim_members_.clear();
  last_priced_ = -1;
  worklist_.clear();
  completed_ = 0;
  expected_ = 0;
  t.ops.resize(nranks);
  for (std::int32_t r = nranks - 1; r >= 0; --r) {
    if (!simulated_[r]) {
      if (!materialised) t.ops[r].clear();
      continue;
    }
    t.ops[r].resize(s.ranks[r].ops.size());
    expected_ += static_cast<std::int64_t>(s.ranks[r].ops.size());
    for (std::int32_t k = kNumStreams - 1; k >= 0; --k) enqueue(r * kNumStreams + k);
  }
  while (!worklist_.empty()) {
    const std::int32_t stream = worklist_.back();
    worklist_.pop_back();
    streams_[stream].queued = false;
    advance(models, stream, t);
  }
  if (completed_ != expected_) {
    if (!materialised) {
      symmetric_ = false;
      return false;
    }
    if (symmetric_) return run_impl(models, t, false);  // name every blocked rank
    report_deadlock();
  }
  if (symmetric_ && materialised)
    for (std::int32_t r = 0; r < nranks; ++r)
      if (!simulated_[r]) t.ops[r] = t.ops[counterpart_[r]];
  t.schedule = schedule_;
  t.predicted = true;
  return true;
}

void Simulation::report_deadlock() const {
  const Schedule& s = *schedule_;
  std::string blocked;
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const auto& ops = s.ranks[r].ops;
    for (int k = 0; k < kNumStreams; ++k) {
      std::size_t i = static_cast<std::size_t>(streams_[r * kNumStreams + k].cursor);
      while (i < ops.size() && static_cast<int>(stream_of_[static_cast<std::uint8_t>(ops[i].kind)]) != k) ++i;
      if (i < ops.size()) blocked += fmt::format("\n  rank {} op {} {}", r, i, op_label(ops[i]));
    }
  }
  throw std::logic_error(
      fmt::format("schedule deadlocked after {} of {} ops; blocked at:{}", completed_, expected_, blocked));
}

void Simulation::run(std::shared_ptr<const Schedule> schedule, const CostModels& models, Timeline& t) {
  schedule_ = std::move(schedule);
  run_impl(VirtualModels{models}, t, false);
}

void Simulation::run(std::shared_ptr<const Schedule> schedule, const RooflineComputeModel& compute,
                     const LinkP2PModel& p2p, const NetworkCollectiveModel& collective, Timeline& t,
                     bool replica_symmetric) {
  schedule_ = std::move(schedule);
  run_impl(DefaultModels{compute, p2p, collective}, t, replica_symmetric);
}

bool Simulation::run_replica0(std::shared_ptr<const Schedule> schedule, const RooflineComputeModel& compute,
                              const LinkP2PModel& p2p, const NetworkCollectiveModel& collective, Timeline& t) {
  schedule_ = std::move(schedule);
  return run_impl(DefaultModels{compute, p2p, collective}, t, true, false);
}

std::size_t Simulation::footprint_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return bytes(streams_) + bytes(simulated_) + bytes(message_arrival_) + bytes(recv_posted_) + bytes(collectives_) + bytes(sim_members_) +
         bytes(worklist_) + bytes(counterpart_);
}

Timeline simulate_schedule(std::shared_ptr<const Schedule> schedule, const CostModels& models) {
  Simulation sim;
  Timeline t;
  sim.run(std::move(schedule), models, t);
  return t;
}

}  // namespace trainsim
