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
  enum class Wait { none, collective, gate, running, recv, barrier };
  enum class Kind { job_start, job_check, barrier_end };
  struct Event {
    Tick at;
    std::int64_t seq;
    Kind kind;
    int rank, a;
    bool operator>(const Event& o) const { return std::tie(at, seq) > std::tie(o.at, o.seq); }
  };
  // Work on a core: a compute op's part or a send (on the core its rank's turn holds), or a
  // collective on the rank's communication thread. `left` is its time at full speed still to run.
  enum class JobKind { part, send, collective };
  struct Job {
    JobKind kind;
    int rank, op;
    double left;
    // Of a core (a turn's cores) it takes while it runs at full speed: compute and sends 1;
    // collectives where the sharing says so collective_share, else 0.
    double share;
  };
  // A collective's share of a turn's cores at full speed: its time alone is its benchmark's, whose
  // n member threads (one per schedule rank of the group, each shard's group alike) ran on the
  // host's cores, each busy min(1, cores / n) of it.
  double collective_share(int members) const {
    if (!sharing_.collectives_take_cores) return 0;
    const double host = static_cast<double>(sharing_.cores) * std::max(1, sharing_.threads_per_turn);
    return std::min(1.0, host / std::max(1, members));
  }
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
  };

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
    st.comm_busy = true;
    if (op.channel < 0) {  // the local overflow check: this rank alone
      out_.ops[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)].start = now_;
      start(Job{JobKind::collective, r, i, static_cast<double>(duration(r, i)), collective_share(1)});
      return;
    }
    const auto c = static_cast<std::size_t>(op.channel);
    last_arrival_[c] = std::max(last_arrival_[c], now_);
    if (++members_arrived_[c] < static_cast<int>(s_.collectives[c].members.size())) return;
    // The last member is here: the collective runs on every member at once.
    const Tick start = last_arrival_[c];
    for (int m : s_.collectives[c].members) {
      const int mi = ranks_[static_cast<std::size_t>(m)].queue.front();
      out_.ops[static_cast<std::size_t>(m)][static_cast<std::size_t>(mi)].start = start;
      this->start(Job{JobKind::collective, m, mi, static_cast<double>(duration(m, mi)),
                     collective_share(static_cast<int>(s_.collectives[c].members.size()))});
    }
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
      if (j.kind != JobKind::collective)
        ++compute;
      else
        collectives += j.share;
    const double cores = sharing_.cores;
    const double collective = collectives > cores ? cores / collectives : 1.0;
    const double left = std::max(0.0, cores - collective * collectives);
    return {compute > left ? left / compute : 1.0, collective};
  }
  double rate_of(const Job& j, const std::pair<double, double>& r) const {
    return j.kind != JobKind::collective ? r.first : j.share > 0 ? r.second : 1.0;
  }

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

  void job_end(const Job& j) {
    RankState& st = ranks_[static_cast<std::size_t>(j.rank)];
    switch (j.kind) {
      case JobKind::part: {
        const Op& op = s_.ranks[static_cast<std::size_t>(j.rank)].ops[static_cast<std::size_t>(j.op)];
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
        arrival_[static_cast<std::size_t>(op.channel)] = now_;
        finish_compute_op(j.rank, j.op, now_);
        advance(j.rank);
        if (auto it = waiting_recv_.find(op.channel); it != waiting_recv_.end()) {
          const int r = it->second;
          waiting_recv_.erase(it);
          ranks_[static_cast<std::size_t>(r)].wait = Wait::none;
          advance(r);
        }
        return;
      }
      case JobKind::collective: {
        out_.ops[static_cast<std::size_t>(j.rank)][static_cast<std::size_t>(j.op)].end = now_;
        st.done[static_cast<std::size_t>(j.op)] = 1;
        st.queue.pop_front();
        st.comm_busy = false;
        if (st.wait == Wait::collective) st.wait = Wait::none;
        advance(j.rank);
        return;
      }
    }
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
      const Job job{JobKind::part, t.rank, t.op, static_cast<double>(part_duration(t.rank, t.op, t.part)), 1.0};
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
  std::vector<Tick> last_arrival_;
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
