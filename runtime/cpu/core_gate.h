// The CPU engine's gate for ranks that share cores (more rank threads than cores): who computes on
// which core when, one whole op at a time. Its own file so that calibration can time it as the
// engine runs it (core_handoff_seconds, runtime/cpu/cpu_calibrate.h).
#pragma once

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "runtime/contract.h"

namespace trainsim::runtime {

// Pins `thread` to `core` (where the system lets it: a failed pin leaves the thread where the
// scheduler puts it, which costs time, not correctness).
inline void pin_to_core(pthread_t thread, int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(thread, sizeof(set), &set);
}

// Asks that `thread` run before the other threads of its core whenever it is runnable (SCHED_FIFO,
// the lowest real-time priority); false where the system refuses (no CAP_SYS_NICE, RLIMIT_RTPRIO
// 0), and the thread stays as it was. A thread woken on a core whose running thread is in user
// space (a compute thread in a product) waits for the scheduler's tick where both are normal
// threads: 0-4 ms at 250 Hz, which a 0.2 ms collective beside a backward pass measured at times
// (docs/validation.md, "Twenty-fourth session"); a real-time thread takes the core at once. It
// must sleep rather than spin while it waits for its own core's other threads: they cannot run.
inline bool run_first_on_core(pthread_t thread) {
  sched_param param{};
  param.sched_priority = sched_get_priority_min(SCHED_FIFO);
  return pthread_setschedparam(thread, SCHED_FIFO, &param) == 0;
}

// Makes `thread` a normal thread again (SCHED_OTHER), as run_first_on_core found it.
inline void run_as_normal(pthread_t thread) {
  sched_param param{};
  param.sched_priority = 0;
  pthread_setschedparam(thread, SCHED_OTHER, &param);
}

// Whether run_first_on_core is granted here (asked by a thread that ends at once).
inline bool may_run_first_on_core() {
  bool granted = false;
  std::thread([&granted] { granted = run_first_on_core(pthread_self()); }).join();
  return granted;
}

// Where ranks share cores: hands the cores to the ranks' compute ops one op at a time, each op whole,
// in the order given (RunOptions::core_turns) or first come first served. Left to the operating
// system, 8 rank threads on 2 cores were time-sliced at its tick (4 ms) over ops of 1-2 ms, and the
// same run measured per-rank utilizations 0.1-0.2 apart from one run to the next; with the order
// fixed, what a rank waits for is decided before the run (validation/core_sharing.h predicts it).
// A turn is a schedule rank's (CoreTurn::rank: the cell, World::cell): under tensor parallelism its
// `shards` shards run the op together (they meet at collectives inside it), so the turn takes
// min(shards, cores) cores at once and every shard of the cell joins it; the cores come back when
// the last shard releases it.
//
// A turn's shards are pinned to the cores it took (shard s to the s-th, modulo), by the thread that
// grants it, before they are woken. Left to the scheduler, a woken shard was at times queued for
// milliseconds on the core where its partner already ran (and polled for it at their first
// collective) while the other core was busy with other threads.
//
// Outside its turns a compute thread only keeps books and waits (for a message, a collective, its
// next turn), and with `waiting_first` (where run_first_on_core is granted) it runs first on its
// core meanwhile, as a normal thread again once a turn starts (wait_first, acquire, release, pause,
// resume). Left a normal thread, the release of a turn woke the next turn's thread on the same core
// and that thread took it: the releaser, a few microseconds from its next wait, sat behind a whole
// op until the scheduler's tick (0-4 ms at 250 Hz; 4-5 ms measured on the incident's ranks), and a
// thread woken by a message waited as long beside the turns running: its next turn in the fixed
// order came late, with a core idle until then (docs/validation.md, "Twenty-fifth session").
class CoreGate {
 public:
  CoreGate(int cores, int cells, int shards, std::vector<CoreTurn> turns, std::chrono::milliseconds timeout,
           bool waiting_first = false)
      : waiting_first_(waiting_first),
        cores_(cores),
        shards_(shards),
        take_(std::min(shards, cores)),
        turns_(std::move(turns)),
        timeout_(timeout),
        woken_(static_cast<std::size_t>(cells)) {
    paused_in_.assign(static_cast<std::size_t>(cells), 0);
    may_poll_ = std::make_unique<std::atomic<bool>[]>(static_cast<std::size_t>(cells));
    threads_.resize(static_cast<std::size_t>(cells * shards));
    core_of_.assign(threads_.size(), -1);
    users_.assign(static_cast<std::size_t>(cores), 0);
  }

  // Before each step (not measured).
  void reset() {
    std::lock_guard lock(mu_);
    free_ = cores_;
    next_ = 0;
    waiting_.clear();
    granted_.clear();
    paused_ = 0;
    std::fill(paused_in_.begin(), paused_in_.end(), 0);
    std::fill(threads_.begin(), threads_.end(), std::optional<pthread_t>{});
    std::fill(core_of_.begin(), core_of_.end(), -1);
    std::fill(users_.begin(), users_.end(), 0);
    for (std::size_t c = 0; c < woken_.size(); ++c) may_poll_[c].store(false);
    aborted_ = false;
  }

  // True while cell `cell` holds a turn with a core for each of its shards (none paused): then, and
  // only then, its shards may poll for each other inside the op (InProcessWorld::communicator's
  // `poll_while`). Polling for a partner that shares the poller's core would hold that core from it.
  const std::atomic<bool>* may_poll(int cell) const { return &may_poll_[static_cast<std::size_t>(cell)]; }

  // On the compute thread of cell `cell`'s shard `shard`, before the step starts: the thread its
  // turns pin.
  void enrol(int cell, int shard) {
    std::lock_guard lock(mu_);
    threads_[slot(cell, shard)] = pthread_self();
  }

  // On a compute thread, once every rank's thread has started (a real-time thread spinning for the
  // others to start would keep them from it): from now on it runs first on its core outside its
  // turns, where the gate was made so.
  void wait_first() const {
    if (waiting_first_) run_first_on_core(pthread_self());
  }
  bool waiting_first() const { return waiting_first_; }

  // Waits for cores for cell `turn.rank`'s op `op` (part `part`), or joins its shards already on them.
  void acquire(const CoreTurn& turn) {
    take_turn(turn);
    if (waiting_first_) run_as_normal(pthread_self());  // the op's work: a normal thread's
  }

  // Shard `shard` of cell `turn.rank` is done with the turn.
  void release(const CoreTurn& turn, int shard) {
    if (waiting_first_) run_first_on_core(pthread_self());  // before the next turn's thread wakes on this core
    give_back(turn, shard);
  }

  // A rank that must wait in the middle of an op (ZeRO-3's next unit, which its data-parallel
  // peers' gathers need their compute to move on for) gives its core back and takes any free one
  // again, outside the turns. Meanwhile the next turn may start on the cores there are: under
  // tensor parallelism the paused shard's partners can hold theirs (waiting for it inside a
  // collective), and a turn that waited for all `take_` would wait for the peers it waits for.
  // A shard resumes at once while a partner of its cell runs (the cell's shards meet at
  // collectives inside the op: a shard that waited for a core would wait for the partner that
  // spins for it), sharing its cores for the while.
  void pause(int cell, int shard) {
    if (waiting_first_) run_first_on_core(pthread_self());
    std::lock_guard lock(mu_);
    unpin(slot(cell, shard));
    may_poll_[static_cast<std::size_t>(cell)].store(false);  // until the cell's next turn
    ++free_;
    ++paused_;
    ++paused_in_[static_cast<std::size_t>(cell)];
    wake_next();
  }
  void resume(int rank, int cell, int shard) {
    std::unique_lock lock(mu_);
    ++resuming_;
    const bool ready = resumed_.wait_for(lock, timeout_, [&] { return aborted_ || free_ > 0 || partner_runs(cell); });
    --resuming_;
    if (aborted_) throw std::runtime_error(fmt::format("rank {}: stopped while waiting for a core", rank));
    if (!ready) throw std::runtime_error(fmt::format("rank {}: waited {} ms for a core", rank, timeout_.count()));
    --free_;
    --paused_;
    --paused_in_[static_cast<std::size_t>(cell)];
    pin(slot(cell, shard), least_used_core());
    resumed_.notify_all();  // its own paused partners may go on with it
    lock.unlock();
    if (waiting_first_) run_as_normal(pthread_self());
  }

  void abort() {
    std::lock_guard lock(mu_);
    aborted_ = true;
    for (auto& w : woken_) w.notify_all();
    resumed_.notify_all();
  }

  // Holds a core for one op (part) of a rank (shard `shard` of cell turn.rank), if there is a gate.
  class Hold {
   public:
    Hold(CoreGate* gate, const CoreTurn& turn, int shard) : gate_(gate), turn_(turn), shard_(shard) {
      if (gate_) gate_->acquire(turn);
    }
    ~Hold() {
      if (gate_) gate_->release(turn_, shard_);
    }
    // Moved, the turn goes with it (the CPU engine keeps a compute op's turn for its sends).
    Hold(Hold&& other) noexcept : gate_(std::exchange(other.gate_, nullptr)), turn_(other.turn_), shard_(other.shard_) {}
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    Hold& operator=(Hold&&) = delete;

   private:
    CoreGate* gate_;
    CoreTurn turn_;
    int shard_;
  };

 private:
  // acquire's and release's work, under mu_ (the thread's priority changes outside it).
  void take_turn(const CoreTurn& turn) {
    std::unique_lock lock(mu_);
    if (auto g = granted_.find(turn); g != granted_.end()) {
      ++g->second.joined;
      resumed_.notify_all();  // a paused partner may go on with it
      return;
    }
    if (turns_.empty() && std::find(waiting_.begin(), waiting_.end(), turn) == waiting_.end()) waiting_.push_back(turn);
    const bool ready = woken_[static_cast<std::size_t>(turn.rank)].wait_for(lock, timeout_, [&] {
      return aborted_ || granted_.count(turn) > 0 ||
             (can_start() &&
              (turns_.empty() ? waiting_.front() == turn : next_ < turns_.size() && turns_[next_] == turn));
    });
    if (aborted_) throw std::runtime_error(fmt::format("rank {}: stopped while waiting for a core", turn.rank));
    if (!ready)
      throw std::runtime_error(fmt::format("rank {}: op {} waited {} ms for its turn at a core", turn.rank, turn.op,
                                           timeout_.count()));
    if (auto g = granted_.find(turn); g != granted_.end()) {  // another shard of the cell took it
      ++g->second.joined;
      resumed_.notify_all();
      return;
    }
    if (turns_.empty())
      waiting_.pop_front();
    else
      ++next_;
    const int took = std::min(take_, free_);
    free_ -= took;
    granted_[turn] = Granted{1, 0, took};
    pin_shards(turn.rank, took);
    may_poll_[static_cast<std::size_t>(turn.rank)].store(took == shards_);
    woken_[static_cast<std::size_t>(turn.rank)].notify_all();  // the cell's other shards join
    wake_next();
  }

  void give_back(const CoreTurn& turn, int shard) {
    std::lock_guard lock(mu_);
    unpin(slot(turn.rank, shard));
    auto g = granted_.find(turn);
    if (g == granted_.end() || ++g->second.released < shards_) return;
    free_ += g->second.cores;
    granted_.erase(g);
    may_poll_[static_cast<std::size_t>(turn.rank)].store(false);
    wake_next();
  }

  std::size_t slot(int cell, int shard) const { return static_cast<std::size_t>(cell * shards_ + shard); }
  // Under mu_: the core the fewest running shards are pinned to (a free one when there is one).
  int least_used_core() const {
    return static_cast<int>(std::min_element(users_.begin(), users_.end()) - users_.begin());
  }
  // Under mu_: pins the thread of `s` to `core`.
  void pin(std::size_t s, int core) {
    unpin(s);
    core_of_[s] = core;
    ++users_[static_cast<std::size_t>(core)];
    if (threads_[s]) pin_to_core(*threads_[s], core);
  }
  void unpin(std::size_t s) {
    if (core_of_[s] >= 0) --users_[static_cast<std::size_t>(core_of_[s])];
    core_of_[s] = -1;
  }
  // Under mu_: a turn of `cell` took `took` cores: its shards go to the least used ones, shard s to
  // the (s mod took)-th.
  void pin_shards(int cell, int took) {
    std::vector<int> cores;
    std::vector<int> users = users_;
    for (int k = 0; k < std::max(1, took); ++k) {
      const int c = static_cast<int>(std::min_element(users.begin(), users.end()) - users.begin());
      cores.push_back(c);
      users[static_cast<std::size_t>(c)] = std::numeric_limits<int>::max();
    }
    for (int sh = 0; sh < shards_; ++sh) pin(slot(cell, sh), cores[static_cast<std::size_t>(sh) % cores.size()]);
  }

  struct Granted {
    int joined = 0, released = 0;  // shards of the cell that took the turn, and that gave it back
    int cores = 0;                 // the cores it took
  };
  // Under mu_: a turn may start on take_ free cores, or, while a rank is paused, on any.
  bool can_start() const { return free_ >= take_ || (paused_ > 0 && free_ > 0); }
  // Under mu_: a shard of `cell` is inside a turn and not paused.
  bool partner_runs(int cell) const {
    for (const auto& [turn, g] : granted_)
      if (turn.rank == cell && g.joined - g.released - paused_in_[static_cast<std::size_t>(cell)] > 0) return true;
    return false;
  }
  // Under mu_: wakes the cell whose turn comes next, if cores are free for it.
  void wake_next() {
    if (resuming_ > 0 && free_ > 0) resumed_.notify_all();
    if (!can_start()) return;
    if (turns_.empty()) {
      if (!waiting_.empty()) woken_[static_cast<std::size_t>(waiting_.front().rank)].notify_all();
    } else if (next_ < turns_.size()) {
      woken_[static_cast<std::size_t>(turns_[next_].rank)].notify_all();
    }
  }

  const bool waiting_first_;                        // compute threads run first outside their turns
  std::unique_ptr<std::atomic<bool>[]> may_poll_;   // per cell (may_poll)
  std::vector<std::optional<pthread_t>> threads_;  // per cell and shard: its compute thread this step
  std::vector<int> core_of_;                       // per cell and shard: the core it is pinned to, or -1
  std::vector<int> users_;                         // per core: the shards pinned to it, in a turn
  int resuming_ = 0;                  // ranks waiting to resume an op (pause/resume)
  int paused_ = 0;                    // ranks paused in an op, until they resume
  std::vector<int> paused_in_;        // of them, per cell
  std::condition_variable resumed_;
  const int cores_, shards_, take_;
  const std::vector<CoreTurn> turns_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::vector<std::condition_variable> woken_;  // per cell: its shards' compute threads wait here
  int free_ = 0;
  std::size_t next_ = 0;
  std::deque<CoreTurn> waiting_;  // first come, first served
  std::map<CoreTurn, Granted> granted_;  // turns on cores now
  bool aborted_ = false;
};

}  // namespace trainsim::runtime
