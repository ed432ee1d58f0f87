// Turns a hung collective into an error: operations are registered with begin()/end() (or a
// Guard), and a thread calls `on_timeout` when one stays open longer than the timeout. The
// CUDA backend calls ncclCommAbort and records the error in that callback, so a failed or
// hung collective ends the run with a message naming the rank and the op, never a silent hang.
//
//   Watchdog dog(rank, std::chrono::minutes(5), [&](const std::string& msg) {
//     record_error(msg);
//     ncclCommAbort(comm);  // makes the blocked NCCL call return
//   });
//   { auto g = dog.guard("all_reduce(tag 7, 1048576 floats)"); launch_and_wait(); }
//
// on_timeout is called at most once per Watchdog, from the watchdog's thread, without any
// lock held (it may call begin/end), with
//   "rank R: <op> has not completed after T s (started at <UTC time>)"
// for the oldest overdue operation; when other operations are open too, their count and the
// oldest of them are appended. After the abort every open operation fails anyway, so one
// report is the cause and later ones would be consequences. Exceptions thrown by on_timeout
// are caught and dropped (the thread has nobody to report them to).
//
// begin/end may be called from any number of threads. The thread sleeps on a condition
// variable until the oldest open operation's deadline (or until an operation begins while
// none is open); the destructor wakes it and joins at once, whatever the timeout.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace trainsim::runtime {

class Watchdog {
 public:
  using Token = std::uint64_t;  // 0 is never a valid token
  using TimeoutHandler = std::function<void(const std::string& message)>;

  // `timeout` must be positive (std::invalid_argument otherwise); `on_timeout` must not be empty.
  Watchdog(int rank, std::chrono::milliseconds timeout, TimeoutHandler on_timeout);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts watching `op_description`; the returned token ends it.
  [[nodiscard]] Token begin(std::string op_description);
  // Stops watching; true if the token was open (false for an unknown or already ended token).
  bool end(Token token);

  // Ends its operation when it goes out of scope. Movable, not copyable.
  class Guard {
   public:
    Guard(Guard&& o) noexcept : dog_(o.dog_), token_(o.token_) { o.token_ = 0; }
    Guard& operator=(Guard&&) = delete;
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() {
      if (token_ != 0) dog_->end(token_);
    }

   private:
    friend class Watchdog;
    Guard(Watchdog& dog, Token token) : dog_(&dog), token_(token) {}
    Watchdog* dog_;
    Token token_;
  };
  [[nodiscard]] Guard guard(std::string op_description);

  bool fired() const;                // on_timeout has been called (or is running)
  std::size_t open_operations() const;
  int rank() const { return rank_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  struct Op {
    std::string description;
    std::chrono::steady_clock::time_point start;
    std::chrono::system_clock::time_point wall_start;  // for the message only
  };
  void run();

  const int rank_;
  const std::chrono::milliseconds timeout_;
  const TimeoutHandler on_timeout_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::map<Token, Op> open_;  // ascending token = ascending start time
  Token next_token_ = 1;
  bool fired_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace trainsim::runtime
