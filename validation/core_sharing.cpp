#include "validation/core_sharing.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>

namespace trainsim::validation {

namespace {

using runtime::CoreTurn;

int parts_of(OpKind k) { return k == OpKind::OptimizerStep ? 2 : 1; }

// The engine's two threads per rank and its gate, as events in time.
class Replay {
 public:
  Replay(const Timeline& alone, const CoreSharing& sharing)
      : s_(*alone.schedule), alone_(alone), sharing_(sharing), ranks_(s_.ranks.size()) {
    if (sharing.cores < 1) throw std::invalid_argument(fmt::format("share_cores: {} cores", sharing.cores));
    if (alone.ops.size() != s_.ranks.size())
      throw std::invalid_argument("share_cores: the timeline does not cover every rank of its schedule");
    out_.schedule = alone.schedule;
    out_.predicted = true;
    out_.ops.resize(s_.ranks.size());
    for (std::size_t r = 0; r < s_.ranks.size(); ++r) {
      const auto n = s_.ranks[r].ops.size();
      if (alone.ops[r].size() != n) throw std::invalid_argument("share_cores: the timeline does not match its schedule");
      out_.ops[r].assign(n, OpTiming{});
      ranks_[r].done.assign(n, 0);
      find_unit_passes(static_cast<int>(r));
    }
    arrival_.assign(static_cast<std::size_t>(s_.num_messages), -1);
    members_arrived_.assign(s_.collectives.size(), 0);
    last_arrival_.assign(s_.collectives.size(), 0);
    check_turns();
  }

  SharedStep run() {
    free_cores_ = sharing_.cores;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) advance(r);
    grant();
    reschedule();
    while (!events_.empty()) {
      const Tick t = events_.top().at;
      now_ = t;
      settle();
      while (!events_.empty() && events_.top().at == t) {
        const Event e = events_.top();
        events_.pop();
        handle(e);
      }
      grant();
      reschedule();
    }
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      if (ranks_[r].next < static_cast<int>(s_.ranks[r].ops.size()) || !ranks_[r].queue.empty())
        throw std::invalid_argument(fmt::format(
            "share_cores: rank {} cannot go on at op {} ({}){}", r, ranks_[r].next,
            ranks_[r].next < static_cast<int>(s_.ranks[r].ops.size()) ? op_label(s_.ranks[r].ops[ranks_[r].next])
                                                                         : "end",
            sharing_.turns.empty() ? "" : ": the order of turns makes it wait for an op that waits for it"));
    return {std::move(out_), std::move(granted_)};
  }

 private:
  enum class Wait { none, collective, gate, running, recv, barrier, unit };
  enum class Kind { job_start, job_check, barrier_end };
  struct Event {
    Tick at;
    std::int64_t seq;
    Kind kind;
    int rank, a;
    bool operator>(const Event& o) const { return std::tie(at, seq) > std::tie(o.at, o.seq); }
  };
  // Work on a core: a compute op's part or a send (on the core its rank's turn holds), a
  // collective on the rank's communication thread, or the copy of a receiver woken by its message
  // (CoreSharing::receiver_copies). `left` is its time at full speed still to run.
  enum class JobKind { part, send, collective, receive };
  // What a ring collective's job is (CoreSharing::rings).
  enum class RingPart : std::uint8_t { none, before, step, after };
  struct Job {
    JobKind kind;
    int rank, op;
    double left;
    // Of a core (a turn's cores) it takes while it runs at full speed: compute and sends 1;
    // collectives where the sharing says so collective_share, else 0.
    double share;
    // ZeRO-3 (UnitPass): the unit a gather's collective brings; where in its pass a compute op's
    // stretch ends.
    int unit = -1;
    double to = -1;
    // A receive's copy (JobKind::receive): the message it takes out of the mailbox. A ring's
    // part (CoreSharing::rings): its collective.
    int channel = -1;
    RingPart ring = RingPart::none;
  };
  // A collective run as a ring of steps, per member position (ring order: the members' order).
  struct RingState {
    int steps = 0;             // per member
    double step_work = 0;      // a step's time at full speed
    std::vector<char> sent, running;  // sent: its copy in done, its first chunk sent
    std::vector<int> done;     // steps done
  };
  // A ZeRO-3 pass gathered unit by unit: its two gather ops (the first unit, the rest), its compute
  // ops (a backward split at its buckets is several), and where each unit and op begins in the
  // pass's work (0 to 1).
  struct UnitPass {
    int first_op = -1, rest_op = -1;
    int units = 0;
    std::vector<double> unit_from;  // units + 1 bounds
    std::vector<int> ops;
    std::vector<double> op_from;    // ops + 1 bounds
    bool keeps_first = false;       // the first unit is used again at the pass's end
    int gathered = 0;               // units handed over to the pass
  };
  // A collective's share of a turn's cores at full speed: its time alone is its benchmark's, whose
  // n member threads (one per schedule rank of the group, each shard's group alike) ran on the
  // host's cores, each busy min(1, cores / n) of it.
  double collective_share(int members) const {
    if (!sharing_.collectives_take_cores) return 0;
    return std::min(1.0, host_cores() / std::max(1, members));
  }
  // Collective `channel`'s threads (CoreSharing::Ring::threads) and what of its price is work
  // beyond what its members' own share counts: 1 but where each member is several threads (the
  // context-parallel shards of a rank, all in the collective), whose table time had them sharing
  // the cores already.
  int threads_of(int channel) const {
    const CoreSharing::Ring* spec = static_cast<std::size_t>(channel) < sharing_.rings.size()
                                        ? &sharing_.rings[static_cast<std::size_t>(channel)]
                                        : nullptr;
    const int members = static_cast<int>(s_.collectives[static_cast<std::size_t>(channel)].members.size());
    return spec && spec->threads > members ? spec->threads : members;
  }
  double thread_factor(int channel) const {
    if (!sharing_.collectives_take_cores) return 1;
    const int members = static_cast<int>(s_.collectives[static_cast<std::size_t>(channel)].members.size());
    return collective_share(threads_of(channel)) / collective_share(members);
  }
  // The cores the turns' threads run on: `cores` turns of threads_per_turn, or the host's fewer.
  double host_cores() const {
    const double turns = static_cast<double>(sharing_.cores) * std::max(1, sharing_.threads_per_turn);
    return sharing_.host_cores > 0 ? std::min<double>(turns, sharing_.host_cores) : turns;
  }
  // The speed of a turn's work with its cores to itself: 1, or less where its threads outnumber
  // the host's cores and the operating system time-shares them.
  double turn_speed() const { return std::min(1.0, host_cores() / std::max(1, sharing_.threads_per_turn)); }
  struct Request {
    Tick at;
    CoreTurn turn;
    auto operator<=>(const Request&) const = default;
  };
  struct RankState {
    int next = 0;  // the compute thread's op
    Wait wait = Wait::none;
    bool reached = false;
    int part = 0;
    std::deque<int> queue;  // the communication thread's collectives, in program order
    bool comm_busy = false;
    bool comm_arrived = false;
    bool holds_core = false;  // a compute op's turn, kept through the sends after it
    std::vector<char> done;
    // ZeRO-3: the rank's passes and each op's (-1: none); the units it holds; the communication
    // thread's unit of the gather op at its front (-1: not begun), the op's wait for its parts'
    // last members (as the run measures it: runtime/loop/run_loop.cpp) and where its last unit
    // ended; the compute thread's place in its pass, the unit it is in, and since when it waits
    // for that unit.
    std::vector<UnitPass> passes;
    std::vector<int> pass_of;
    int held = 0;
    int gather_unit = -1;
    Tick gather_waited = 0, unit_end = 0;
    double pass_at = 0;
    int unit = 0;
    Tick paused_at = 0;
  };
  // A rank whose unit came, waiting for a core: by time, then by a place that moves by one with
  // every unit (the operating system wakes the threads a gather frees in no fixed order; served in
  // rank order, the same ranks would always be first).
  struct Resume {
    Tick at;
    int place, rank;
    auto operator<=>(const Resume&) const = default;
  };

  // The work of `seconds` of op i of rank r for a turn: where a turn's threads outnumber the host's
  // cores the turn runs at turn_speed(), and what of the op does not slow (its collectives,
  // CoreSharing::unslowed) counts that much less, so that alone it takes its own time.
  double turn_work(int r, int i, double seconds) const {
    const double c = turn_speed();
    if (c >= 1 || static_cast<std::size_t>(r) >= sharing_.unslowed.size()) return seconds;
    const auto& ops = sharing_.unslowed[static_cast<std::size_t>(r)];
    const double u = static_cast<std::size_t>(i) < ops.size() ? ops[static_cast<std::size_t>(i)] : 0.0;
    return seconds * (1 - u * (1 - c));
  }
  Tick duration(int r, int i) const {
    const OpTiming& t = alone_.ops[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)];
    return std::max<Tick>(0, t.end - t.start);
  }
  Tick part_duration(int r, int i, int part) const {
    const Tick d = duration(r, i);
    if (parts_of(s_.ranks[r].ops[i].kind) == 1) return d;
    const auto first = static_cast<Tick>(std::llround(static_cast<double>(d) * sharing_.optimizer_first_part));
    const bool skipped = static_cast<std::size_t>(r) < sharing_.skipped_update.size() && sharing_.skipped_update[r];
    return part == 0 ? first : skipped ? 0 : d - first;
  }
  void at(Tick t, Kind k, int rank, int a = 0) { events_.push(Event{t, seq_++, k, rank, a}); }

  // Rank r's ZeRO-3 passes: a gather of a pass's first unit (bucket 0) followed by the gather of
  // the rest (bucket 1), and the compute ops of the pass, the first of which waits for the first.
  void find_unit_passes(int r) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    const auto& ops = s_.ranks[static_cast<std::size_t>(r)].ops;
    const int n = static_cast<int>(ops.size());
    st.pass_of.assign(ops.size(), -1);
    for (int i = 0; i + 1 < n; ++i) {
      const Op& a = ops[static_cast<std::size_t>(i)];
      const Op& b = ops[static_cast<std::size_t>(i + 1)];
      if (a.kind != OpKind::AllGather || b.kind != OpKind::AllGather || a.microbatch < 0 || a.bucket != 0 ||
          b.bucket != 1 || a.channel < 0 || b.channel < 0)
        continue;
      const Collective& first = s_.collectives[static_cast<std::size_t>(a.channel)];
      const Collective& rest = s_.collectives[static_cast<std::size_t>(b.channel)];
      if (first.parts < 1) continue;  // nothing to gather
      UnitPass p;
      p.first_op = i;
      p.rest_op = i + 1;
      p.units = 1 + std::max(0, rest.parts);
      int k = i + 2;
      while (k < n && !(ops[static_cast<std::size_t>(k)].dep == i && is_compute(ops[static_cast<std::size_t>(k)].kind))) ++k;
      if (k == n) continue;
      const Op& lead = ops[static_cast<std::size_t>(k)];
      for (; k < n; ++k) {
        const Op& o = ops[static_cast<std::size_t>(k)];
        if (!is_compute(o.kind)) continue;
        if (o.kind != lead.kind || o.chunk != lead.chunk || o.microbatch != lead.microbatch) break;
        p.ops.push_back(k);
      }
      // Bounds in the pass's work: the ops' by their shares, the units' by their parameters.
      auto bounds = [](const std::vector<double>& w) {
        double total = 0;
        for (double x : w) total += std::max(0.0, x);
        std::vector<double> out{0.0};
        for (double x : w) out.push_back(out.back() + (total > 0 ? std::max(0.0, x) / total : 1.0 / w.size()));
        out.back() = 1.0;
        return out;
      };
      std::vector<double> work, bytes{static_cast<double>(first.bytes)};
      for (int o : p.ops) work.push_back(ops[static_cast<std::size_t>(o)].work);
      for (int u = 1; u < p.units; ++u) bytes.push_back(static_cast<double>(rest.bytes) / rest.parts);
      p.op_from = bounds(work);
      p.unit_from = bounds(bytes);
      p.keeps_first = sharing_.zero3_forward_keeps_first_unit && lead.kind == OpKind::Forward && p.units > 1;
      const int index = static_cast<int>(st.passes.size());
      st.pass_of[static_cast<std::size_t>(p.first_op)] = st.pass_of[static_cast<std::size_t>(p.rest_op)] = index;
      for (int o : p.ops) st.pass_of[static_cast<std::size_t>(o)] = index;
      st.passes.push_back(std::move(p));
    }
  }
  UnitPass* unit_pass(int r, int i) {  // op i's ZeRO-3 pass, or null
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    const int p = st.pass_of[static_cast<std::size_t>(i)];
    return p < 0 ? nullptr : &st.passes[static_cast<std::size_t>(p)];
  }

  // Every compute op (and the optimizer's second part) once, in an order the replay can follow.
  void check_turns() const {
    if (sharing_.turns.empty()) return;
    std::set<CoreTurn> want, got;
    for (std::size_t r = 0; r < s_.ranks.size(); ++r)
      for (std::size_t i = 0; i < s_.ranks[r].ops.size(); ++i)
        if (is_compute(s_.ranks[r].ops[i].kind))
          for (int p = 0; p < parts_of(s_.ranks[r].ops[i].kind); ++p)
            want.insert(CoreTurn{static_cast<int>(r), static_cast<int>(i), p});
    for (const CoreTurn& t : sharing_.turns)
      if (!got.insert(t).second)
        throw std::invalid_argument(fmt::format("share_cores: rank {} op {} part {} has two turns", t.rank, t.op, t.part));
    if (got != want)
      throw std::invalid_argument(fmt::format(
          "share_cores: the order of turns lists {} compute ops and parts; the schedule has {}", got.size(), want.size()));
  }

  // Runs rank r's compute thread, then its communication thread, as far as they go now.
  void advance(int r) {
    advance_compute(r);
    advance_comm(r);
  }

  void advance_compute(int r) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    const auto& ops = s_.ranks[static_cast<std::size_t>(r)].ops;
    auto& times = out_.ops[static_cast<std::size_t>(r)];
    while (st.wait == Wait::none && st.next < static_cast<int>(ops.size())) {
      const int i = st.next;
      const Op& op = ops[static_cast<std::size_t>(i)];
      if (is_collective(op.kind)) {
        st.queue.push_back(i);
        ++st.next;
        continue;
      }
      if (!st.reached) {
        if (op.dep >= 0 && is_collective(ops[static_cast<std::size_t>(op.dep)].kind) && !st.done[op.dep]) {
          st.wait = Wait::collective;
          return;
        }
        st.reached = true;
        times[static_cast<std::size_t>(i)].start = now_;
        st.part = 0;
        if (const UnitPass* p = unit_pass(r, i); p && p->ops.front() == i) st.pass_at = 0, st.unit = 0;
      }
      if (is_compute(op.kind)) {
        requests_.insert(Request{now_, CoreTurn{r, i, st.part}});
        st.wait = Wait::gate;
        return;
      }
      if (is_send(op.kind)) {
        st.wait = Wait::running;
        start(Job{JobKind::send, r, i, static_cast<double>(duration(r, i)), 1.0});
        return;
      }
      if (is_recv(op.kind)) {
        const Tick sent = arrival_[static_cast<std::size_t>(op.channel)];
        if (sent < 0) {
          st.wait = Wait::recv;
          waiting_recv_.emplace(op.channel, r);
          return;
        }
        finish_compute_op(r, i, std::max(now_, sent));
        continue;
      }
      throw std::logic_error("share_cores: op " + op_label(op) + " has no place on the compute thread");
    }
  }

  void finish_compute_op(int r, int i, Tick end) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    out_.ops[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)].end = end;
    st.done[static_cast<std::size_t>(i)] = 1;
    st.reached = false;
    st.wait = Wait::none;
    ++st.next;
  }

  void advance_comm(int r) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    const auto& ops = s_.ranks[static_cast<std::size_t>(r)].ops;
    if (st.comm_busy || st.queue.empty()) return;
    const int i = st.queue.front();
    const Op& op = ops[static_cast<std::size_t>(i)];
    if (op.dep >= 0 && !st.done[static_cast<std::size_t>(op.dep)]) return;
    if (unit_pass(r, i)) {
      gather_next_unit(r, i);
      return;
    }
    st.comm_busy = true;
    if (op.channel < 0) {  // the local overflow check: this rank alone
      out_.ops[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)].start = now_;
      start(Job{JobKind::collective, r, i, static_cast<double>(duration(r, i)), collective_share(1)});
      return;
    }
    const auto c = static_cast<std::size_t>(op.channel);
    last_arrival_[c] = std::max(last_arrival_[c], now_);
    const bool ring = ring_of(op.channel) != nullptr;
    if (ring) ring_arrive(op.channel, r, i);
    if (++members_arrived_[c] < static_cast<int>(s_.collectives[c].members.size())) return;
    // The last member is here: the collective runs on every member at once (a ring: what is left
    // of it), timed from now as the run times it.
    const Tick start = last_arrival_[c];
    for (int m : s_.collectives[c].members) {
      const int mi = ranks_[static_cast<std::size_t>(m)].queue.front();
      out_.ops[static_cast<std::size_t>(m)][static_cast<std::size_t>(mi)].start = start;
      if (!ring)
        this->start(Job{JobKind::collective, m, mi, static_cast<double>(duration(m, mi)) * thread_factor(op.channel),
                        collective_share(threads_of(op.channel))});
    }
  }

  const CoreSharing::Ring* ring_of(int channel) const {
    const auto c = static_cast<std::size_t>(channel);
    const bool ring = c < sharing_.rings.size() && sharing_.rings[c].ring && s_.collectives[c].members.size() > 1;
    return ring ? &sharing_.rings[c] : nullptr;
  }
  // A job of ring `channel` for member `m` (at its communication thread's op).
  Job ring_job(int channel, int m, RingPart part, double work) const {
    Job job{JobKind::collective, m, ranks_[static_cast<std::size_t>(m)].queue.front(), work,
            sharing_.collectives_take_cores ? 1.0 : 0.0};
    job.channel = channel;
    job.ring = part;
    return job;
  }
  // Rank r's communication thread reached ring collective `channel` (its op i): it copies what
  // goes in, then its steps start as their inputs come.
  void ring_arrive(int channel, int r, int i) {
    const Collective& c = s_.collectives[static_cast<std::size_t>(channel)];
    const CoreSharing::Ring& spec = *ring_of(channel);
    RingState& ring = rings_[channel];
    const int n = static_cast<int>(c.members.size());
    if (ring.sent.empty()) {
      ring.steps = c.kind == OpKind::AllReduce ? 2 * (n - 1) : n - 1;
      ring.sent.assign(static_cast<std::size_t>(n), 0);
      ring.running.assign(static_cast<std::size_t>(n), 0);
      ring.done.assign(static_cast<std::size_t>(n), 0);
      // Every member's time alone is the same (one collective, one duration), its copies included.
      const double copies = static_cast<double>(seconds_to_ticks(spec.before + spec.after));
      const double ring_time = std::max(0.0, static_cast<double>(duration(r, i)) - copies);
      const double busy = sharing_.collectives_take_cores ? collective_share(threads_of(channel)) : 1.0;
      ring.step_work = ring_time * busy / ring.steps;
    }
    if (spec.before > 0) {
      start(ring_job(channel, r, RingPart::before, static_cast<double>(seconds_to_ticks(spec.before))));
      return;
    }
    ring.sent[static_cast<std::size_t>(position(c, r))] = 1;
    ring_steps(channel);
  }
  static int position(const Collective& c, int rank) {
    return static_cast<int>(std::find(c.members.begin(), c.members.end(), rank) - c.members.begin());
  }
  // Starts every step of ring `channel` whose inputs are there: a member's next step once its
  // predecessor has done the step before it (its first: once its predecessor sent its first chunk).
  void ring_steps(int channel) {
    const Collective& c = s_.collectives[static_cast<std::size_t>(channel)];
    RingState& ring = rings_[channel];
    const int n = static_cast<int>(c.members.size());
    for (int p = 0; p < n; ++p) {
      const auto pu = static_cast<std::size_t>(p);
      const auto pred = static_cast<std::size_t>((p + n - 1) % n);
      const int k = ring.done[pu];
      if (!ring.sent[pu] || ring.running[pu] || k >= ring.steps) continue;
      if (k == 0 ? !ring.sent[pred] : ring.done[pred] < k) continue;
      ring.running[pu] = 1;
      start(ring_job(channel, c.members[pu], RingPart::step, ring.step_work));
    }
  }
  // A job of ring j.channel ended on rank j.rank: after its copy in its steps may start; its last
  // step ends its collective (after its copy out).
  void ring_job_end(const Job& j) {
    const Collective& c = s_.collectives[static_cast<std::size_t>(j.channel)];
    RingState& ring = rings_[j.channel];
    const auto p = static_cast<std::size_t>(position(c, j.rank));
    switch (j.ring) {
      case RingPart::before:
        ring.sent[p] = 1;
        break;
      case RingPart::step:
        ring.running[p] = 0;
        if (++ring.done[p] < ring.steps) break;
        if (const double after = ring_of(j.channel)->after; after > 0)
          start(ring_job(j.channel, j.rank, RingPart::after, static_cast<double>(seconds_to_ticks(after))));
        else
          end_collective(j.rank, j.op);
        break;
      case RingPart::after:
      case RingPart::none:
        end_collective(j.rank, j.op);
        return;
    }
    ring_steps(j.channel);
  }
  void end_collective(int r, int i) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    out_.ops[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)].end = now_;
    st.done[static_cast<std::size_t>(i)] = 1;
    st.queue.pop_front();
    st.comm_busy = false;
    if (st.wait == Wait::collective) st.wait = Wait::none;
    advance(r);
  }

  // The communication thread's gather op `i` of a ZeRO-3 pass, unit by unit: each once the rank
  // holds fewer units than it may, then a collective of the op's members.
  void gather_next_unit(int r, int i) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    const UnitPass& p = *unit_pass(r, i);
    const Op& op = s_.ranks[static_cast<std::size_t>(r)].ops[static_cast<std::size_t>(i)];
    const bool rest = i == p.rest_op;
    if (st.gather_unit < 0) {
      out_.ops[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)].start = now_;
      st.gather_unit = rest ? 1 : 0;
      st.gather_waited = 0;
    }
    if (st.gather_unit >= (rest ? p.units : 1)) {
      finish_gather(r, i);
      return;
    }
    if (st.held >= sharing_.zero3_units_held) return;  // a unit's release calls again
    ++st.held;
    st.comm_busy = true;
    const auto key = std::make_pair(op.channel, st.gather_unit);
    const Collective& c = s_.collectives[static_cast<std::size_t>(op.channel)];
    if (++unit_arrived_[key] < static_cast<int>(c.members.size())) return;
    // The run counts a member's time before its op's last member began it, and before each part's
    // last member had room for it, as the pass's pace (OpTiming::waited), not communication.
    Tick began = 0;
    for (int m : c.members)
      began = std::max(began, out_.ops[static_cast<std::size_t>(m)][static_cast<std::size_t>(
                                  ranks_[static_cast<std::size_t>(m)].queue.front())].start);
    for (int m : c.members) {
      RankState& mst = ranks_[static_cast<std::size_t>(m)];
      const int mi = mst.queue.front();
      OpTiming& t = out_.ops[static_cast<std::size_t>(m)][static_cast<std::size_t>(mi)];
      if (mst.gather_unit == (rest ? 1 : 0)) {
        t.start = std::max(t.start, began);
        mst.unit_end = t.start;
      }
      mst.gather_waited += std::max<Tick>(0, now_ - mst.unit_end);
      const Tick d = duration(m, mi) / (rest ? std::max(1, c.parts) : 1);
      Job job{JobKind::collective, m, mi, static_cast<double>(d) * thread_factor(op.channel),
              collective_share(threads_of(op.channel))};
      job.unit = st.gather_unit;
      start(job);
    }
  }
  void finish_gather(int r, int i) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    OpTiming& t = out_.ops[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)];
    t.waited = std::min(st.gather_waited, now_ - t.start);
    st.gather_unit = -1;
    end_collective(r, i);
  }
  // A unit the pass is done with leaves the rank (the first, where the pass uses it again at its
  // end, with the last): room for the next gather.
  void release_unit(int r, const UnitPass& p, int unit, bool pass_end) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    if (!(p.keeps_first && unit == 0 && !pass_end)) --st.held;
    if (pass_end && p.keeps_first && unit != 0) --st.held;
  }
  // Op i's place among its pass's compute ops (its work is op_from[k] to op_from[k + 1]).
  static std::size_t place_in(const UnitPass& p, int i) {
    return static_cast<std::size_t>(std::find(p.ops.begin(), p.ops.end(), i) - p.ops.begin());
  }
  // The stretch of op i a unit-paced pass runs next, on a core its rank holds: to the end of its
  // unit or of the op.
  Job next_stretch(int r, int i) const {
    const RankState& st = ranks_[static_cast<std::size_t>(r)];
    const UnitPass& p = st.passes[static_cast<std::size_t>(st.pass_of[static_cast<std::size_t>(i)])];
    const std::size_t k = place_in(p, i);
    const double from = p.op_from[k], to = std::min(p.op_from[k + 1], p.unit_from[static_cast<std::size_t>(st.unit) + 1]);
    const double whole = p.op_from[k + 1] - from;
    Job job{JobKind::part, r, i,
            whole > 0 ? turn_work(r, i, static_cast<double>(duration(r, i)) * (to - st.pass_at) / whole) : 0.0, 1.0};
    job.to = to;
    return job;
  }
  // On a core, at op i of a unit-paced pass: runs its next stretch, or gives the core back until its
  // unit is there.
  void go_on_or_pause(int r, int i) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    if (unit_pass(r, i)->gathered > st.unit) {
      st.wait = Wait::running;
      start(next_stretch(r, i));
      return;
    }
    pause(r);
  }
  // Rank r gives its core back until its pass's unit is there.
  void pause(int r) {
    RankState& st = ranks_[static_cast<std::size_t>(r)];
    ++free_cores_;
    st.wait = Wait::unit;
    st.paused_at = now_;
  }

  // Starts `job` now (its rate from the next reschedule on).
  void start(const Job& job) {
    jobs_.push_back(job);
    jobs_changed_ = true;
  }

  // The running jobs' rates: {turns and sends, collectives}. A communication thread wakes from a
  // sleep to run its collective, and the operating system's scheduler lets a thread that slept
  // take a core before those that kept running (Linux CFS: a woken thread's virtual runtime is
  // at most a slice behind the lowest), so collectives run first, as many at full speed as there
  // are cores, and the turns share what is left; a collective that takes no core runs at full
  // speed beside them.
  std::pair<double, double> rates() const {
    int compute = 0;
    double collectives = 0;  // their shares of cores at full speed
    for (const Job& j : jobs_)
      if (takes_turn_core(j))
        ++compute;
      else
        collectives += j.share;
    const double cores = sharing_.cores;
    const double collective = collectives > cores ? cores / collectives : 1.0;
    const double left = std::max(0.0, cores - collective * collectives);
    return {(compute > left ? left / compute : 1.0) * turn_speed(), collective};
  }
  double rate_of(const Job& j, const std::pair<double, double>& r) const {
    return takes_turn_core(j) ? r.first : j.share > 0 ? r.second : 1.0;
  }
  // Compute parts and sends run on the cores turns hold; collectives and a woken receiver's copy
  // on what a thread woken from a sleep takes first.
  static bool takes_turn_core(const Job& j) { return j.kind == JobKind::part || j.kind == JobKind::send; }

  // Each running job's work done since the last settle, at the rates of that interval.
  void settle() {
    const double elapsed = static_cast<double>(now_ - settled_);
    settled_ = now_;
    if (elapsed <= 0) return;
    const auto r = rates();
    for (Job& j : jobs_) j.left -= elapsed * rate_of(j, r);
  }

  // After the running jobs changed: when the first of them ends at the new rates.
  void reschedule() {
    if (!jobs_changed_) return;
    jobs_changed_ = false;
    ++generation_;
    if (jobs_.empty()) return;
    const auto r = rates();
    double first = std::numeric_limits<double>::infinity();
    for (const Job& j : jobs_)
      if (const double rate = rate_of(j, r); rate > 0) first = std::min(first, std::max(0.0, j.left) / rate);
    if (!std::isfinite(first)) return;  // nothing progresses until a collective ends: cannot be (they all run)
    at(now_ + static_cast<Tick>(std::ceil(first - 1e-9)), Kind::job_check, 0, static_cast<int>(generation_ & 0x7fffffff));
  }

  void handle(const Event& e) {
    if (e.kind == Kind::job_start) {
      start(pending_[static_cast<std::size_t>(e.a)]);
      return;
    }
    if (e.kind == Kind::job_check) {
      if (e.a != static_cast<int>(generation_ & 0x7fffffff)) return;  // the jobs changed since
      std::vector<Job> ended;
      auto done = [](const Job& j) { return j.left < 0.5; };  // under a picosecond of work left
      std::copy_if(jobs_.begin(), jobs_.end(), std::back_inserter(ended), done);
      jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(), done), jobs_.end());
      jobs_changed_ = true;
      for (const Job& j : ended) job_end(j);
      return;
    }
    barrier_end();
  }

  // Message `channel` is in: rank r, asleep on it, takes it and goes on.
  void deliver(int channel, int r) {
    arrival_[static_cast<std::size_t>(channel)] = now_;
    ranks_[static_cast<std::size_t>(r)].wait = Wait::none;
    advance(r);
  }

  void job_end(const Job& j) {
    RankState& st = ranks_[static_cast<std::size_t>(j.rank)];
    switch (j.kind) {
      case JobKind::part: {
        const Op& op = s_.ranks[static_cast<std::size_t>(j.rank)].ops[static_cast<std::size_t>(j.op)];
        if (UnitPass* p = unit_pass(j.rank, j.op); p && !stretch_ends_op(j, *p)) return;
        const bool last_part = st.part + 1 >= parts_of(op.kind);
        // The turn is kept for the sends of the op's output that follow it.
        st.holds_core = last_part && sends_next(s_.ranks[static_cast<std::size_t>(j.rank)], j.op);
        if (!st.holds_core) ++free_cores_;
        if (!last_part) {
          // The optimizer's gradient norm is in: its all-reduce over every rank, core released.
          st.wait = Wait::barrier;
          last_at_barrier_ = std::max(last_at_barrier_, now_);
          if (++at_barrier_ == static_cast<int>(ranks_.size()))
            at(last_at_barrier_ + sharing_.norm_allreduce, Kind::barrier_end, j.rank);
          return;
        }
        finish_compute_op(j.rank, j.op, now_);
        advance(j.rank);
        return;
      }
      case JobKind::send: {
        const Op& op = s_.ranks[static_cast<std::size_t>(j.rank)].ops[static_cast<std::size_t>(j.op)];
        if (st.holds_core && !sends_next(s_.ranks[static_cast<std::size_t>(j.rank)], j.op)) {
          st.holds_core = false;
          ++free_cores_;
        }
        finish_compute_op(j.rank, j.op, now_);
        advance(j.rank);
        const auto it = waiting_recv_.find(op.channel);
        if (it == waiting_recv_.end()) {
          arrival_[static_cast<std::size_t>(op.channel)] = now_;
          return;
        }
        const int r = it->second;
        waiting_recv_.erase(it);
        if (sharing_.receiver_copies)  // woken, it copies the message out first
          start(Job{.kind = JobKind::receive, .rank = r, .op = -1,
                    .left = static_cast<double>(duration(j.rank, j.op)), .share = 1.0, .channel = op.channel});
        else
          deliver(op.channel, r);
        return;
      }
      case JobKind::receive:
        deliver(j.channel, j.rank);
        return;
      case JobKind::collective: {
        if (j.unit >= 0) {
          unit_gathered(j);
          return;
        }
        if (j.ring != RingPart::none) {
          ring_job_end(j);
          return;
        }
        end_collective(j.rank, j.op);
        return;
      }
    }
  }

  // A stretch of a unit-paced pass ended: past a unit's end the pass is done with that unit and
  // goes on to the next. True when the op ended (then as any compute op's end).
  bool stretch_ends_op(const Job& j, const UnitPass& p) {
    RankState& st = ranks_[static_cast<std::size_t>(j.rank)];
    constexpr double kEps = 1e-12;
    st.pass_at = j.to;
    const bool op_done = st.pass_at >= p.op_from[place_in(p, j.op) + 1] - kEps;
    const bool pass_end = j.op == p.ops.back() && op_done;
    if (pass_end) {
      release_unit(j.rank, p, st.unit, true);
    } else if (st.pass_at >= p.unit_from[static_cast<std::size_t>(st.unit) + 1] - kEps && st.unit + 1 < p.units) {
      release_unit(j.rank, p, st.unit, false);
      ++st.unit;
    }
    advance_comm(j.rank);  // room for the next unit
    if (op_done) return true;
    go_on_or_pause(j.rank, j.op);
    return false;
  }
  // A unit's gather ended on rank j.rank: the pass may go on (taking a core again, ahead of the
  // turns not begun), and the communication thread to the next unit.
  void unit_gathered(const Job& j) {
    RankState& st = ranks_[static_cast<std::size_t>(j.rank)];
    UnitPass& p = *unit_pass(j.rank, j.op);
    ++p.gathered;
    ++st.gather_unit;
    st.unit_end = now_;
    st.comm_busy = false;
    if (st.wait == Wait::unit && unit_pass(j.rank, st.next) == &p && p.gathered > st.unit) {
      out_.ops[static_cast<std::size_t>(j.rank)][static_cast<std::size_t>(st.next)].waited += now_ - st.paused_at;
      st.wait = Wait::gate;
      const int n = static_cast<int>(ranks_.size());
      const int unit = s_.ranks[static_cast<std::size_t>(j.rank)].ops[static_cast<std::size_t>(j.op)].channel + st.gather_unit;
      resumes_.insert(Resume{now_, ((j.rank - unit) % n + n) % n, j.rank});
    }
    if (st.gather_unit >= (j.op == p.rest_op ? p.units : 1))
      finish_gather(j.rank, j.op);
    else
      advance_comm(j.rank);
  }

  void barrier_end() {
    at_barrier_ = 0;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      RankState& b = ranks_[r];
      b.wait = Wait::none;
      ++b.part;
      advance(static_cast<int>(r));
    }
  }

  // Hands free cores to waiting ops: the next turn of the order, or the earliest request.
  void grant() {
    while (free_cores_ > 0 && !resumes_.empty()) {
      const Resume q = *resumes_.begin();
      resumes_.erase(resumes_.begin());
      --free_cores_;
      const int i = ranks_[static_cast<std::size_t>(q.rank)].next;
      Job job = next_stretch(q.rank, i);
      ranks_[static_cast<std::size_t>(q.rank)].wait = Wait::running;
      // Its thread slept on the unit: the core idles while it wakes, whenever the core came.
      const Tick woken = sharing_.handoff;
      if (woken > 0) {
        pending_.push_back(job);
        at(now_ + woken, Kind::job_start, q.rank, static_cast<int>(pending_.size()) - 1);
      } else {
        start(job);
      }
    }
    while (free_cores_ > 0 && !requests_.empty()) {
      auto it = requests_.begin();
      if (!sharing_.turns.empty()) {
        if (next_turn_ >= sharing_.turns.size()) return;
        const CoreTurn& want = sharing_.turns[next_turn_];
        it = std::find_if(requests_.begin(), requests_.end(), [&](const Request& q) { return q.turn == want; });
        if (it == requests_.end()) return;  // its op is not there yet: the core waits for it
        ++next_turn_;
      }
      const CoreTurn t = it->turn;
      const Tick woken = it->at < now_ ? sharing_.handoff : 0;  // it slept until now
      // The wait for the turn, as the engine reports it (OpTiming::waited; the optimizer's two
      // parts and the norm between them: none).
      if (parts_of(s_.ranks[static_cast<std::size_t>(t.rank)].ops[static_cast<std::size_t>(t.op)].kind) == 1)
        out_.ops[static_cast<std::size_t>(t.rank)][static_cast<std::size_t>(t.op)].waited = now_ + woken - it->at;
      requests_.erase(it);
      granted_.push_back(t);
      --free_cores_;
      ranks_[static_cast<std::size_t>(t.rank)].wait = Wait::running;
      const UnitPass* pass = unit_pass(t.rank, t.op);
      if (pass && pass->gathered <= ranks_[static_cast<std::size_t>(t.rank)].unit) {
        pause(t.rank);  // its unit is not there: the turn's thread gives the core back at once
        continue;
      }
      const Job job = pass ? next_stretch(t.rank, t.op)
                          : Job{JobKind::part, t.rank, t.op,
                                turn_work(t.rank, t.op, static_cast<double>(part_duration(t.rank, t.op, t.part))), 1.0};
      if (woken > 0) {  // the core idles while the thread wakes
        pending_.push_back(job);
        at(now_ + woken, Kind::job_start, t.rank, static_cast<int>(pending_.size()) - 1);
      } else {
        start(job);
      }
    }
  }

  const Schedule& s_;
  const Timeline& alone_;
  const CoreSharing& sharing_;
  std::vector<RankState> ranks_;
  Timeline out_;
  std::vector<Tick> arrival_;              // per message: when its send ended, -1 before
  std::multimap<int, int> waiting_recv_;   // message -> the rank blocked on it
  std::vector<int> members_arrived_;       // per collective
  std::map<int, RingState> rings_;         // per ring collective, once a member reached it
  std::vector<Tick> last_arrival_;
  std::map<std::pair<int, int>, int> unit_arrived_;  // ZeRO-3: per (collective, unit)
  std::set<Resume> resumes_;               // ranks whose unit came, waiting for a core
  int at_barrier_ = 0;
  Tick last_at_barrier_ = 0;
  std::set<Request> requests_;  // ordered by time, then rank, op, part
  std::vector<CoreTurn> granted_;
  std::size_t next_turn_ = 0;
  int free_cores_ = 0;
  Tick now_ = 0;
  std::int64_t seq_ = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  std::vector<Job> jobs_;     // running, in the order they started
  std::vector<Job> pending_;  // turns whose threads are waking (Kind::job_start's index)
  bool jobs_changed_ = false;
  std::int64_t generation_ = 0;  // of the running set: a job_check of an older one is stale
  Tick settled_ = 0;
};

}  // namespace

SharedStep share_cores(const Timeline& alone, const CoreSharing& sharing) {
  return Replay(alone, sharing).run();
}

}  // namespace trainsim::validation
