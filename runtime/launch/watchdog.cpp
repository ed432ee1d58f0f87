#include "runtime/launch/watchdog.h"

#include <cstdio>
#include <ctime>
#include <iterator>
#include <stdexcept>

namespace trainsim::runtime {
namespace {

using SteadyClock = std::chrono::steady_clock;
using SystemClock = std::chrono::system_clock;

// "2024-05-01T12:00:00.123Z"
std::string utc_text(SystemClock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char buf[48];
  const std::size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ", static_cast<int>(ms % 1000));
  return buf;
}

std::string seconds_text(SteadyClock::duration d) {
  const double s = std::chrono::duration<double>(d).count();
  char buf[32];
  std::snprintf(buf, sizeof buf, s < 10 ? "%.2f" : "%.0f", s);
  return buf;
}

}  // namespace

Watchdog::Watchdog(int rank, std::chrono::milliseconds timeout, TimeoutHandler on_timeout)
    : rank_(rank), timeout_(timeout), on_timeout_(std::move(on_timeout)) {
  if (timeout_ <= std::chrono::milliseconds(0))
    throw std::invalid_argument("Watchdog: timeout must be positive, got " + std::to_string(timeout_.count()) +
                                " ms");
  if (!on_timeout_) throw std::invalid_argument("Watchdog: on_timeout must be set");
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

Watchdog::Token Watchdog::begin(std::string op_description) {
  bool was_empty = false;
  Token token = 0;
  {
    std::lock_guard lock(mutex_);
    token = next_token_++;
    was_empty = open_.empty();
    open_.emplace(token, Op{std::move(op_description), SteadyClock::now(), SystemClock::now()});
  }
  // Only an empty watch list leaves the thread waiting without a deadline; otherwise it
  // already sleeps until an earlier deadline than this operation's.
  if (was_empty) wake_.notify_all();
  return token;
}

bool Watchdog::end(Token token) {
  std::lock_guard lock(mutex_);
  return open_.erase(token) > 0;
}

Watchdog::Guard Watchdog::guard(std::string op_description) { return Guard(*this, begin(std::move(op_description))); }

bool Watchdog::fired() const {
  std::lock_guard lock(mutex_);
  return fired_;
}

std::size_t Watchdog::open_operations() const {
  std::lock_guard lock(mutex_);
  return open_.size();
}

void Watchdog::run() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    if (fired_ || open_.empty()) {
      wake_.wait(lock, [&] { return stop_ || (!fired_ && !open_.empty()); });
      continue;
    }
    const Op& op = open_.begin()->second;
    const auto now = SteadyClock::now();
    const auto deadline = op.start + timeout_;
    if (now < deadline) {
      // Ends that happen meanwhile need no wake-up: the next deadline is never earlier.
      wake_.wait_until(lock, deadline, [&] { return stop_; });
      continue;
    }
    fired_ = true;
    std::string message = "rank " + std::to_string(rank_) + ": " + op.description + " has not completed after " +
                          seconds_text(now - op.start) + " s (started at " + utc_text(op.wall_start) + ")";
    if (open_.size() > 1) {
      const auto& next = std::next(open_.begin())->second;
      message += "; " + std::to_string(open_.size() - 1) + " other operation(s) open, the oldest " +
                 next.description + " for " + seconds_text(now - next.start) + " s";
    }
    lock.unlock();
    try {
      on_timeout_(message);
    } catch (...) {
      // Documented: nobody to report to on this thread.
    }
    lock.lock();
  }
}

}  // namespace trainsim::runtime
