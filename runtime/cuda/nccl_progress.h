// Waiting for a nonblocking NCCL communicator to leave ncclInProgress (nccl_communicator.h,
// "Nonblocking communicators"). Plain C++, no CUDA or NCCL type: the NCCL side is injected as
// functions, so the loop's decisions are unit-tested without a GPU
// (tests/runtime/test_nccl_progress.cpp).
//
// NCCL's model: with config.blocking = 0 an init, a split, an enqueue or ncclGroupEnd may return
// ncclInProgress while it finishes in the background; the caller polls ncclCommGetAsyncError
// until the state is ncclSuccess (done) or an error (the communicator is unusable and must be
// aborted), and may give up (abort) at any point in between. wait_until_settled is that loop:
//
//   poll()      one ncclCommGetAsyncError, taken and released under the communicator's lock;
//               returns Polled::in_progress, done or failed;
//   stop()      checked before every poll: Stop::none to go on, Stop::aborted when abort() was
//               called (the watchdog's timeout included), Stop::timed_out when the caller's own
//               deadline passed;
//   pause(n)    called between polls with no lock held (n = polls so far), so another thread's
//               abort gets the communicator's lock; it yields, then sleeps.
//
// The first poll comes before any pause; a stop seen before a poll wins over what that poll
// would have said, so an aborted communicator is never polled again.
#pragma once

#include <chrono>
#include <thread>

namespace trainsim::runtime::cuda {

enum class Polled { in_progress, done, failed };
enum class Stop { none, aborted, timed_out };
enum class Settled { done, failed, aborted, timed_out };

template <class Poll, class StopCheck, class Pause>
Settled wait_until_settled(Poll&& poll, StopCheck&& stop, Pause&& pause) {
  for (long polls = 0;; ++polls) {
    switch (stop()) {
      case Stop::none: break;
      case Stop::aborted: return Settled::aborted;
      case Stop::timed_out: return Settled::timed_out;
    }
    switch (poll()) {
      case Polled::in_progress: break;
      case Polled::done: return Settled::done;
      case Polled::failed: return Settled::failed;
    }
    pause(polls + 1);
  }
}

// The production pause: a few yields keep short waits short, then 50 us sleeps, so a long wait
// (a slow init, a split waiting for a peer) costs no core.
inline void poll_pause(long polls) {
  if (polls < 64)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(50));
}

}  // namespace trainsim::runtime::cuda
