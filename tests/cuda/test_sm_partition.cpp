// Per-rank streams and green-context SM partitions (runtime/cuda/sm_partition.h) on a real device:
// every rank's three streams are distinct and run work; green partitions are disjoint in count
// (their SMs add up to at most the device's); a refusal says why. Every test skips (GTEST_SKIP)
// when no CUDA device can be used. The SM arithmetic itself is tested without a GPU in
// tests/runtime/test_sm_split.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <future>
#include <iostream>
#include <thread>
#include <vector>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "kernels/device_buffer.h"
#include "runtime/cuda/sm_partition.h"
#include "runtime/cuda/stream_ops.h"

namespace trainsim::runtime::cuda {
namespace {

namespace k = ::trainsim::cuda;

class SmPartitionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!k::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  }
};

// The thread that drives each of a rank's streams (sm_partition.h).
constexpr std::pair<StreamHandle RankStreams::*, RankThread> kStreamThreads[] = {
    {&RankStreams::compute, RankThread::compute}, {&RankStreams::comm, RankThread::comm},
    {&RankStreams::send, RankThread::compute}};

// Every stream of every rank is set, distinct from all others, and runs a fill to completion,
// queued with the context of its thread current.
void expect_working_streams(const SmPartition& partition, int ranks) {
  ASSERT_EQ(partition.ranks(), ranks);
  std::set<StreamHandle> seen;
  constexpr std::size_t kBytes = 1 << 20;
  k::DeviceBuffer buffer(kBytes * 3 * static_cast<std::size_t>(ranks));
  auto* base = buffer.as<unsigned char>();
  for (int r = 0; r < ranks; ++r) {
    const RankStreams& s = partition.streams(r);
    EXPECT_GT(s.sms, 0) << "rank " << r;
    int index = 0;
    for (auto [member, thread] : kStreamThreads) {
      StreamHandle stream = s.*member;
      ASSERT_NE(stream, nullptr) << "rank " << r << " stream " << index;
      EXPECT_TRUE(seen.insert(stream).second) << "rank " << r << " stream " << index << " is shared";
      partition.make_current(r, thread);
      fill_zero(base + (static_cast<std::size_t>(r) * 3 + static_cast<std::size_t>(index)) * kBytes, kBytes, stream);
      ++index;
    }
  }
  for (int r = 0; r < ranks; ++r)
    for (auto [member, thread] : kStreamThreads) {
      partition.make_current(r, thread);
      synchronize(partition.streams(r).*member);
    }
  partition.make_primary_current();
}

// A rank's two threads at once, each in its own context, as the executor drives them: the
// compute thread fills on its stream and records an event; the communication thread's stream
// waits for that event (an event of the other context) and then copies what was filled.
void expect_two_threads_per_rank(const SmPartition& partition, int rank) {
  constexpr std::size_t kBytes = 4 << 20;
  k::DeviceBuffer a(kBytes), b(kBytes);
  const RankStreams& s = partition.streams(rank);
  void* filled = nullptr;  // cudaEvent_t of the compute thread's context
  std::promise<void> recorded;
  std::thread compute([&] {
    partition.make_current(rank, RankThread::compute);
    std::vector<unsigned char> ones(kBytes, 1);
    copy_host_to_device(a.data(), ones.data(), kBytes, s.compute);
    cudaEvent_t e = nullptr;
    EXPECT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
    EXPECT_EQ(cudaEventRecord(e, static_cast<cudaStream_t>(s.compute)), cudaSuccess);  // same context
    filled = e;
    recorded.set_value();  // whatever happened: the other thread must not wait forever
    synchronize(s.compute);
  });
  std::thread comm([&] {
    partition.make_current(rank, RankThread::comm);
    recorded.get_future().wait();
    EXPECT_EQ(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.comm), static_cast<cudaEvent_t>(filled), 0),
              cudaSuccess);  // an event of the other context
    copy_device_to_device(b.data(), a.data(), kBytes, s.comm);
    synchronize(s.comm);
  });
  compute.join();
  comm.join();
  if (filled) cudaEventDestroy(static_cast<cudaEvent_t>(filled));
  std::vector<unsigned char> got(kBytes);
  b.download(got.data(), kBytes);
  EXPECT_EQ(std::count(got.begin(), got.end(), 1), static_cast<std::ptrdiff_t>(kBytes)) << "rank " << rank;
  partition.make_primary_current();
}

TEST_F(SmPartitionTest, SharedStreamsAreDistinctAndRunWork) {
  constexpr int kRanks = 4;
  const SmPartition partition(kRanks, SmSharing::shared);
  EXPECT_FALSE(partition.green());
  EXPECT_EQ(partition.why_not_green(), "not requested");
  EXPECT_GT(partition.device_sms(), 0);
  expect_working_streams(partition, kRanks);
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(partition.streams(r).sms, partition.device_sms());
  const std::string text = partition.describe();
  EXPECT_EQ(text.rfind("shared SMs: 4 ranks on all ", 0), 0u) << text;
  EXPECT_NE(text.find("(green contexts: not requested)"), std::string::npos) << text;
}

TEST_F(SmPartitionTest, AutomaticIsGreenWithDisjointPartitionsOrSaysWhyNot) {
  constexpr int kRanks = 2;
  const SmPartition partition(kRanks, SmSharing::automatic);
  const std::string text = partition.describe();
  std::cout << "[ sm partition ] " << text << '\n';
  expect_working_streams(partition, kRanks);
  for (int r = 0; r < kRanks; ++r) expect_two_threads_per_rank(partition, r);
  if (partition.green()) {
    EXPECT_TRUE(partition.why_not_green().empty());
    int used = 0;
    for (int r = 0; r < kRanks; ++r) used += partition.streams(r).sms;
    EXPECT_LE(used, partition.device_sms());
    EXPECT_EQ(text.rfind("green contexts: 2 ranks x ", 0), 0u) << text;
  } else {
    EXPECT_FALSE(partition.why_not_green().empty());
    EXPECT_EQ(text.rfind("shared SMs: 2 ranks on all ", 0), 0u) << text;
  }
}

TEST_F(SmPartitionTest, AutomaticWithOneRankSharesTheDevice) {
  const SmPartition partition(1, SmSharing::automatic);
  EXPECT_FALSE(partition.green());
  EXPECT_EQ(partition.why_not_green(), "one rank: nothing to split");
  expect_working_streams(partition, 1);
}

TEST_F(SmPartitionTest, GreenContextsEitherWorkOrThrowWithAReason) {
  constexpr int kRanks = 2;
  try {
    const SmPartition partition(kRanks, SmSharing::green_contexts);
    EXPECT_TRUE(partition.green());
    expect_working_streams(partition, kRanks);
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no green contexts for 2 ranks"), std::string::npos) << what;
  }
}

TEST_F(SmPartitionTest, MoreRanksThanSmsCannotBeGreen) {
  const int ranks = k::device_memory_info().multiprocessors + 1;
  EXPECT_THROW(SmPartition(ranks, SmSharing::green_contexts), std::runtime_error);
}

TEST_F(SmPartitionTest, MovedPartitionKeepsItsStreams) {
  SmPartition first(2, SmSharing::automatic);
  void* compute = first.streams(1).compute;
  SmPartition second(std::move(first));
  EXPECT_EQ(second.streams(1).compute, compute);
  expect_working_streams(second, 2);
}

// Checked before any CUDA call, so it runs without a device too.
TEST(SmPartitionArguments, ZeroRanksIsRejected) {
  EXPECT_THROW(SmPartition(0, SmSharing::shared), std::invalid_argument);
  EXPECT_THROW(SmPartition(-2, SmSharing::automatic), std::invalid_argument);
}

TEST_F(SmPartitionTest, RankOutsideThePartitionIsRejected) {
  const SmPartition partition(1, SmSharing::shared);
  EXPECT_THROW(partition.streams(1), std::out_of_range);
  EXPECT_THROW(partition.streams(-1), std::out_of_range);
}

}  // namespace
}  // namespace trainsim::runtime::cuda
