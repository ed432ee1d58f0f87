// Host-side mailboxes for communicators whose ranks are threads of one process: the CPU
// backend's in-process world (messages are the data) and the CUDA backend's single-GPU world
// (messages are device buffers and the events that say when they are ready).
//
// One mailbox per destination rank, each with its own mutex and condition variable, so ranks
// that do not talk never contend. A message is keyed by (source, tag, channel); messages under
// one key are delivered in the order they were posted. post never waits; take waits until the
// message is there, the world is aborted (CommError with the abort's reason) or the timeout
// passes (CommError naming the rank waited for). The first abort's reason wins.
//
// How take waits: given a `poll` time, it first polls the mailbox for up to that long (poll_for), as
// NCCL's kernels poll their flags, and only then sleeps on the condition variable. A sleeping
// thread costs a wake-up at every message it waited for: from microseconds on an idle core to a
// scheduler slice (milliseconds) on a core that runs something else; a ring all-reduce waits at
// each of its steps, and a pipeline stage at every receive. Polling is for threads that have a
// core each: where threads share cores, a poller takes the core from the thread it waits for.
#pragma once

#include <atomic>
#include <chrono>
#include <compare>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "runtime/comm/communicator.h"

namespace trainsim::runtime {

struct MailKey {
  int source;
  std::uint64_t tag;
  std::uint32_t channel;
  auto operator<=>(const MailKey&) const = default;
};

template <class Message>
class Mailboxes {
 public:
  Mailboxes(int world_size, std::chrono::milliseconds timeout)
      : world_size_(world_size), timeout_(timeout), inboxes_(static_cast<std::size_t>(world_size)) {}

  int world_size() const { return world_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool aborted() const { return aborted_.load(); }

  std::string reason() const {
    std::lock_guard lock(abort_mu_);
    return abort_reason_;
  }

  void abort(const std::string& why) {
    {
      std::lock_guard lock(abort_mu_);
      if (aborted_.load()) return;  // the first reason wins
      abort_reason_ = why;
      aborted_.store(true);
    }
    // Taking each inbox's lock before notifying guarantees that a waiter is either already
    // asleep (and is woken) or has not yet checked `aborted_` (and will see it).
    for (Inbox& box : inboxes_) {
      { std::lock_guard lock(box.mu); }
      box.arrived.notify_all();
    }
  }

  // `who` prefixes errors ("rank 3: "); `op` describes the call ("recv from rank 1 tag 7").
  template <class Op>
  void throw_if_aborted(const std::string& who, Op&& op) const {
    if (aborted_.load()) throw CommError(who + op() + ": aborted: " + reason());
  }

  void post(int destination, MailKey key, Message&& msg) {
    Inbox& box = inboxes_[static_cast<std::size_t>(destination)];
    {
      std::lock_guard lock(box.mu);
      box.messages[key].push_back(std::move(msg));
      box.posted.fetch_add(1, std::memory_order_release);
    }
    box.arrived.notify_all();
  }

  // Waits for the first message under `key` in `me`'s mailbox and moves it out, polling for it
  // for up to `poll` before sleeping, and only while `poll_while` (when given) holds true.
  template <class Op>
  Message take(int me, MailKey key, const std::string& who, Op&& op, std::chrono::microseconds poll = {},
               const std::atomic<bool>* poll_while = nullptr) {
    Inbox& box = inboxes_[static_cast<std::size_t>(me)];
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    if (poll.count() > 0 && (poll_while == nullptr || poll_while->load(std::memory_order_relaxed)))
      if (std::optional<Message> msg = poll_for(box, key, poll, poll_while)) return std::move(*msg);
    std::unique_lock lock(box.mu);
    auto it = box.messages.end();
    const bool ready = box.arrived.wait_until(lock, deadline, [&] {
      if (aborted_.load()) return true;
      it = box.messages.find(key);
      return it != box.messages.end();
    });
    if (aborted_.load()) {
      lock.unlock();
      throw_if_aborted(who, op);
    }
    if (!ready)
      throw CommError(who + op() + ": timed out after " + std::to_string(timeout_.count()) + " ms waiting for rank " +
                      std::to_string(key.source));
    return pop(box, it);
  }

 private:
  struct Inbox {
    std::mutex mu;
    std::condition_variable arrived;
    std::map<MailKey, std::deque<Message>> messages;
    std::atomic<std::uint64_t> posted{0};  // messages ever posted here: pollers look again when it moves
  };
  using Queue = typename std::map<MailKey, std::deque<Message>>::iterator;

  // Under box.mu.
  static Message pop(Inbox& box, Queue it) {
    Message msg = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) box.messages.erase(it);
    return msg;
  }

  // Polls `box` for `key` for at most `poll`: the message, or nothing when the time ran out or the
  // world was aborted (take then sleeps, and reports aborts and timeouts). A plain spin: a thread
  // woken on this core preempts the poller as it would preempt any running thread (at once if it
  // is real-time, the CPU engine's communication threads; else at the scheduler's next tick where
  // wake-up preemption is lazy), while a yield would hand the core to whatever else is runnable
  // for a whole scheduler slice.
  std::optional<Message> poll_for(Inbox& box, MailKey key, std::chrono::microseconds poll,
                                  const std::atomic<bool>* poll_while) {
    using Clock = std::chrono::steady_clock;
    const auto until = Clock::now() + poll;
    std::uint64_t looked_at = box.posted.load(std::memory_order_acquire) - 1;  // look at least once
    for (int spins = 0;; ++spins) {
      if (const std::uint64_t posted = box.posted.load(std::memory_order_acquire); posted != looked_at) {
        looked_at = posted;
        std::lock_guard lock(box.mu);
        if (auto it = box.messages.find(key); it != box.messages.end()) return pop(box, it);
      }
      if (spins % 64 == 0 && (aborted_.load() || Clock::now() >= until ||
                              (poll_while != nullptr && !poll_while->load(std::memory_order_relaxed))))
        return std::nullopt;
    }
  }

  const int world_size_;
  const std::chrono::milliseconds timeout_;
  std::vector<Inbox> inboxes_;  // indexed by destination rank; never resized
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;  // written once, under abort_mu_, before `aborted_` is set
};

}  // namespace trainsim::runtime
