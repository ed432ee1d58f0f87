// The two host threads that walk one rank's program in a step, for every engine that runs ranks on
// host threads (CPU: the ops themselves; CUDA: queuing them on streams). The compute thread walks
// the program in order and hands each collective to the communication thread, which runs them in
// program order once their producing op is done, so a bucket's all-reduce overlaps the backward
// that follows it, as the schedule says. The engine says how an op runs (RankDriver); the walk
// owns the threads, the hand-over, waiting for dependencies, and stopping every waiter when
// either thread fails.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "core/schedule.h"
#include "runtime/contract.h"

namespace trainsim::runtime {

// The two host threads that drive a rank: the compute thread (compute ops, sends and receives)
// and the communication thread (collectives).
enum class RankThread { compute, comm };

// A flag per op, set by the thread that runs it and waited on by the thread that needs it; a
// failure wakes every waiter with the error. (The CPU engine marks an op when it is done; the
// CUDA one when it is queued on its stream, whose events do the device-side waiting.)
class OpCompletion {
 public:
  void reset(std::size_t n) {
    std::lock_guard lock(mu_);
    done_.assign(n, 0);
    error_ = nullptr;
  }
  void mark(std::size_t i) {
    {
      std::lock_guard lock(mu_);
      done_[i] = 1;
    }
    cv_.notify_all();
  }
  void fail(std::exception_ptr e) {
    {
      std::lock_guard lock(mu_);
      if (!error_) error_ = e;
    }
    cv_.notify_all();
  }
  void wait(std::size_t i) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_[i] || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> done_;
  std::exception_ptr error_;
};

// The ops a rank's compute thread hands its communication thread, in program order (and RankWalk's
// start and stop marks).
class CollectiveQueue {
 public:
  void push(int op) {
    {
      std::lock_guard lock(mu_);
      ops_.push_back(op);
    }
    cv_.notify_one();
  }
  // Waits for the next op.
  int pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !ops_.empty(); });
    const int op = ops_.front();
    ops_.pop_front();
    return op;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> ops_;
};

// How an engine runs one rank's ops. Every call but abort runs on the thread named; a call that
// throws fails the rank.
class RankDriver {
 public:
  virtual ~RankDriver() = default;
  // Runs `body`, all that `thread` does for the rank this step, inside what the thread needs around
  // it for the whole step (a memory account charged with its allocations, ...).
  virtual void on_thread(RankThread /*thread*/, const std::function<void()>& body) { body(); }
  // Compute thread, first (pinning, the rank's device context, the step's epoch). If it throws,
  // the rank runs nothing this step.
  virtual void start_compute_thread() {}
  // Communication thread, first (its device context, its stream's epoch).
  virtual void start_comm_thread() {}
  // Op `i`, not a collective, on the compute thread, once the collective it depends on (if any)
  // is done; timed by the driver.
  virtual void run_compute(int i) = 0;
  // Op `i`, on the compute thread, after it is marked done (memory accounting, numerics notes).
  virtual void finished_compute(int /*i*/) {}
  // Op `i`, a collective, on the communication thread, once its producing op is done; timed by the
  // driver from when this rank reached it.
  virtual void run_collective(int i) = 0;
  // On `thread`, after the walk saw op `dep` done and before the op that needs it runs: an engine
  // whose "done" means "queued" makes that thread's stream wait for it.
  virtual void waited_for(int /*dep*/, RankThread /*thread*/) {}
  // From either thread, when it fails: make every other rank's pending and future calls fail too.
  virtual void abort(const std::string& reason) = 0;
};

// The clock failures are stamped with (RankStep::failed_at_ns): the system clock in ns, comparable
// across the processes of one run.
inline std::int64_t failure_clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One rank's walk of one step, reused step after step.
class RankWalk {
 public:
  // Before each step (not measured): every op not done, no error.
  void reset(std::size_t ops) { done_.reset(ops); }
  // Walks `program` with `driver`: returns on the compute thread once both threads are finished;
  // the rank's first error, or nullptr. `rank` names it in abort reasons.
  // `fault`, when given, is injected into this rank's walk (RunOptions::fault, for this step).
  std::exception_ptr run(int rank, const RankProgram& program, RankDriver& driver,
                         const InjectedFault* fault = nullptr);
  // Waits (on any thread) until op `i` is done; rethrows the rank's failure.
  void wait(int i) { done_.wait(static_cast<std::size_t>(i)); }
  // When this step's first error was caught on either thread (failure_clock_ns), or 0.
  std::int64_t failed_at_ns() const { return failed_at_ns_.load(); }

 private:
  std::exception_ptr compute_main(int rank, const RankProgram& program, RankDriver& driver,
                                  const InjectedFault* fault);
  void comm_main(int rank, const RankProgram& program, RankDriver& driver, const InjectedFault* fault);

  void note_failure();

  OpCompletion done_;
  // What the compute thread hands the communication thread besides ops: its own start is done
  // (first), and the end of the step (last).
  static constexpr int kGo = -2, kStop = -1;
  CollectiveQueue collectives_;
  std::exception_ptr comm_error_;
  std::atomic<std::int64_t> failed_at_ns_{0};
};

// What a failed rank's exception says ("unknown error" when it is not a std::exception).
std::string error_text(std::exception_ptr error);

}  // namespace trainsim::runtime
