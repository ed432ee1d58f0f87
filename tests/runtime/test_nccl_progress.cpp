// wait_until_settled (runtime/cuda/nccl_progress.h): the loop that waits for a nonblocking NCCL
// communicator to leave ncclInProgress, driven here by scripted poll results. Runs without a GPU.
#include "runtime/cuda/nccl_progress.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <thread>
#include <utility>
#include <vector>

namespace trainsim::runtime::cuda {
namespace {

// Replays `polled`, then `stops` (one per stop check; Stop::none once the script runs out), and
// records every call so the tests can check what the loop did, not only what it returned.
struct Script {
  Script(std::vector<Polled> polled_, std::vector<Stop> stops_ = {})
      : polled(std::move(polled_)), stops(std::move(stops_)) {}
  std::vector<Polled> polled;
  std::vector<Stop> stops;
  std::size_t polls = 0, checks = 0;
  std::vector<long> pauses;

  Settled run() {
    return wait_until_settled(
        [&] {
          EXPECT_LT(polls, polled.size()) << "polled after the script ended";
          return polls < polled.size() ? polled[polls++] : Polled::failed;
        },
        [&] { return checks < stops.size() ? stops[checks++] : (++checks, Stop::none); },
        [&](long n) { pauses.push_back(n); });
  }
};

TEST(NcclProgress, DoneAtOnceNeverPauses) {
  Script s{{Polled::done}};
  EXPECT_EQ(s.run(), Settled::done);
  EXPECT_EQ(s.polls, 1u);
  EXPECT_TRUE(s.pauses.empty());
}

TEST(NcclProgress, InProgressIsPolledAgainAfterAPause) {
  Script s{{Polled::in_progress, Polled::in_progress, Polled::in_progress, Polled::done}};
  EXPECT_EQ(s.run(), Settled::done);
  EXPECT_EQ(s.polls, 4u);
  EXPECT_EQ(s.pauses, (std::vector<long>{1, 2, 3}));  // one pause between each pair of polls
}

TEST(NcclProgress, AnErrorEndsTheWait) {
  Script s{{Polled::in_progress, Polled::failed}};
  EXPECT_EQ(s.run(), Settled::failed);
  EXPECT_EQ(s.polls, 2u);
  EXPECT_EQ(s.pauses.size(), 1u);
}

TEST(NcclProgress, AbortBeforeTheFirstPollNeverPolls) {
  Script s{{}, {Stop::aborted}};
  EXPECT_EQ(s.run(), Settled::aborted);
  EXPECT_EQ(s.polls, 0u);
}

TEST(NcclProgress, AbortWhileInProgressStopsPolling) {
  // Two polls in progress; the third check sees the abort and the communicator is not polled
  // again (it may already be freed).
  Script s{{Polled::in_progress, Polled::in_progress}, {Stop::none, Stop::none, Stop::aborted}};
  EXPECT_EQ(s.run(), Settled::aborted);
  EXPECT_EQ(s.polls, 2u);
  EXPECT_EQ(s.checks, 3u);
}

TEST(NcclProgress, TimeoutWhileInProgress) {
  Script s{{Polled::in_progress}, {Stop::none, Stop::timed_out}};
  EXPECT_EQ(s.run(), Settled::timed_out);
  EXPECT_EQ(s.polls, 1u);
}

TEST(NcclProgress, TheStopCheckComesBeforeEveryPoll) {
  Script s{{Polled::in_progress, Polled::in_progress, Polled::done}};
  EXPECT_EQ(s.run(), Settled::done);
  EXPECT_EQ(s.checks, s.polls);
}

TEST(NcclProgress, ThePausesYieldThenSleep) {
  // poll_pause only decides how long to wait; a short and a long pause both return.
  poll_pause(1);
  poll_pause(1000);
  SUCCEED();
}

// As the communicator uses it: a poll that never settles (a peer that never comes), the
// production pause, and an abort from another thread (the watchdog's) that ends the wait.
TEST(NcclProgress, AnAbortFromAnotherThreadEndsAWaitThatNeverSettles) {
  std::atomic<bool> aborted{false};
  std::atomic<long> polls{0};
  std::thread watchdog([&] {
    while (polls.load() < 200) std::this_thread::yield();
    aborted.store(true);
  });
  const Settled settled = wait_until_settled(
      [&] {
        polls.fetch_add(1);
        return Polled::in_progress;
      },
      [&] { return aborted.load() ? Stop::aborted : Stop::none; }, poll_pause);
  watchdog.join();
  EXPECT_EQ(settled, Settled::aborted);
  EXPECT_GE(polls.load(), 200);
}

}  // namespace
}  // namespace trainsim::runtime::cuda
