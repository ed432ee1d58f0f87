// The single-GPU world (runtime/cuda/device_world.h) against the CPU backend's in-process
// communicator (runtime/comm/in_process.h), the reference: the same contributions, rounded to
// the same format, reduced over the same members must give the same bits, because both sum
// every chunk in ring order with every partial sum rounded to the format. Point-to-point
// messages pair by order and a message out of order is an error; host gathers round-trip.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "cuda_test_helpers.h"
#include "kernels/device_buffer.h"
#include "kernels/kernels.h"
#include "runtime/comm/in_process.h"
#include "runtime/cuda/device_world.h"
#include "runtime/cuda/stream_ops.h"
#include "runtime/numerics/lowp.h"

namespace trainsim {
void PrintTo(DType d, std::ostream* os) { *os << dtype_name(d); }
}  // namespace trainsim

namespace trainsim::runtime::cuda {
namespace {

namespace k = ::trainsim::cuda;

// Magnitudes in [0.1, 2), random signs: never zero, partial sums that round differently by order.
std::vector<float> contribution(std::size_t n, int seed, DType dt) {
  std::mt19937 rng(static_cast<unsigned>(seed));
  std::uniform_real_distribution<float> mag(0.1f, 2.0f);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> x(n);
  for (float& v : x) v = round_to(dt, sign(rng) ? mag(rng) : -mag(rng));
  return x;
}

// all_reduce, or its two halves (reduce_scatter then all_gather) called on their own.
enum class Calls { all_reduce, halves };

// Every member reduces on the device from its own thread and stream; returns each member's result.
std::vector<std::vector<float>> device_all_reduce(const std::vector<std::vector<float>>& inputs, DType dt, ReduceOp op,
                                                  Divide divide, Calls calls = Calls::all_reduce) {
  const int n = static_cast<int>(inputs.size());
  const std::size_t count = inputs[0].size();
  DeviceWorld world(n, std::chrono::seconds(30));
  std::vector<std::vector<float>> out(n);
  std::vector<int> members(n);
  for (int r = 0; r < n; ++r) members[r] = r;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto comm = world.communicator(r);
      k::Stream stream;
      k::DeviceBuffer f32(count * 4 + 4), data(count * 4 + 4);
      copy_host_to_device(f32.data(), inputs[r].data(), count * 4, stream.get());
      k::cast(data.data(), dt, f32.data(), DType::fp32, count, stream.get());
      if (calls == Calls::all_reduce) {
        comm->all_reduce(data.data(), count, dt, members, 7, op, divide, stream.get());
      } else {
        comm->reduce_scatter(data.data(), count, dt, members, 7, op, divide, stream.get());
        comm->all_gather(data.data(), count, dt, members, 8, stream.get());
      }
      k::cast(f32.data(), DType::fp32, data.data(), dt, count, stream.get());
      out[r].resize(count);
      copy_device_to_host(out[r].data(), f32.data(), count * 4, stream.get());
      synchronize(stream.get());
    });
  for (auto& t : threads) t.join();
  return out;
}

std::vector<std::vector<float>> host_all_reduce(std::vector<std::vector<float>> inputs, DType dt, ReduceOp op,
                                                Divide divide, Calls calls = Calls::all_reduce) {
  const int n = static_cast<int>(inputs.size());
  InProcessWorld world(n);
  std::vector<int> members(n);
  for (int r = 0; r < n; ++r) members[r] = r;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto comm = world.communicator(r);
      if (calls == Calls::all_reduce) {
        comm->all_reduce(inputs[r], members, 7, op, dt, divide);
      } else {
        comm->reduce_scatter(inputs[r], members, 7, op, dt, divide);
        comm->all_gather(inputs[r], members, 8, dt);
      }
    });
  for (auto& t : threads) t.join();
  return inputs;
}

struct Case {
  int members;
  std::size_t count;
  DType dt;
  Divide divide;
};

class RingReduce : public ::testing::TestWithParam<Case> {};

TEST_P(RingReduce, SameBitsAsTheInProcessRing) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const Case c = GetParam();
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < c.members; ++r) inputs.push_back(contribution(c.count, 100 + r, c.dt));
  const auto device = device_all_reduce(inputs, c.dt, ReduceOp::sum, c.divide);
  const auto host = host_all_reduce(inputs, c.dt, ReduceOp::sum, c.divide);
  for (int r = 0; r < c.members; ++r) {
    ASSERT_EQ(device[r].size(), c.count);
    for (std::size_t i = 0; i < c.count; ++i)
      ASSERT_EQ(device[r][i], host[r][i]) << "member " << r << " element " << i;
  }
  // Not a copy of one input: the sum really mixes every member.
  EXPECT_NE(device[0], inputs[0]);
}

// ZeRO's and sequence parallelism's calls: each member's chunk reduced in its ring order, then
// gathered, the same bits as the in-process communicator's two halves.
TEST_P(RingReduce, ReduceScatterAndAllGatherGiveTheInProcessBits) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  const Case c = GetParam();
  const std::size_t count = c.count - c.count % static_cast<std::size_t>(c.members);
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < c.members; ++r) inputs.push_back(contribution(count, 200 + r, c.dt));
  const auto device = device_all_reduce(inputs, c.dt, ReduceOp::sum, c.divide, Calls::halves);
  const auto host = host_all_reduce(inputs, c.dt, ReduceOp::sum, c.divide, Calls::halves);
  for (int r = 0; r < c.members; ++r) {
    ASSERT_EQ(device[r].size(), count);
    for (std::size_t i = 0; i < count; ++i)
      ASSERT_EQ(device[r][i], host[r][i]) << "member " << r << " element " << i;
  }
  if (count > 0) {
    EXPECT_NE(device[0], inputs[0]);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, RingReduce,
    ::testing::Values(Case{2, 1001, DType::fp32, Divide::none}, Case{3, 1001, DType::fp32, Divide::after},
                      Case{5, 4099, DType::bf16, Divide::before}, Case{4, 777, DType::fp16, Divide::after},
                      Case{3, 2, DType::bf16, Divide::none},  // fewer elements than members: empty chunks
                      Case{8, 65537, DType::fp16, Divide::before}));

TEST(DeviceWorld, MaxPropagatesNaNToEveryMember) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  std::vector<std::vector<float>> inputs = {contribution(64, 1, DType::fp32), contribution(64, 2, DType::fp32),
                                            contribution(64, 3, DType::fp32)};
  inputs[1][5] = NAN;
  const auto out = device_all_reduce(inputs, DType::fp32, ReduceOp::max, Divide::none);
  for (const auto& o : out) {
    EXPECT_TRUE(std::isnan(o[5]));
    EXPECT_EQ(o[6], std::max({inputs[0][6], inputs[1][6], inputs[2][6]}));
  }
}

TEST(DeviceWorld, MessagesPairByOrderAndOutOfOrderIsAnError) {
  TRAINSIM_SKIP_WITHOUT_DEVICE();
  DeviceWorld world(2, std::chrono::seconds(10));
  const std::vector<float> a = contribution(300, 4, DType::fp32), b = contribution(300, 5, DType::fp32);
  std::vector<float> got_a(300), got_b(300);
  std::thread sender([&] {
    auto comm = world.communicator(0);
    k::Stream s;
    k::DeviceBuffer da(1200), db(1200);
    copy_host_to_device(da.data(), a.data(), 1200, s.get());
    copy_host_to_device(db.data(), b.data(), 1200, s.get());
    comm->send(1, 11, da.data(), 300, DType::fp32, s.get());
    comm->send(1, 12, db.data(), 300, DType::fp32, s.get());
    comm->send(1, 13, da.data(), 300, DType::fp32, s.get());
    synchronize(s.get());
  });
  auto comm = world.communicator(1);
  k::Stream s;
  k::DeviceBuffer ra(1200), rb(1200);
  comm->recv(0, 11, ra.data(), 300, DType::fp32, s.get());
  comm->recv(0, 12, rb.data(), 300, DType::fp32, s.get());
  copy_device_to_host(got_a.data(), ra.data(), 1200, s.get());
  copy_device_to_host(got_b.data(), rb.data(), 1200, s.get());
  synchronize(s.get());
  EXPECT_EQ(got_a, a);
  EXPECT_EQ(got_b, b);
  // The third message is tag 13; asking for tag 14 means the two sides disagree on the order.
  EXPECT_THROW(comm->recv(0, 14, ra.data(), 300, DType::fp32, s.get()), CommError);
  sender.join();
}

TEST(DeviceWorld, GatherHostGivesEveryRankEveryBlob) {
  // Host only: no device work, so it runs everywhere.
  DeviceWorld world(3, std::chrono::seconds(10));
  std::vector<std::vector<std::vector<std::uint8_t>>> got(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      auto comm = world.communicator(r);
      const std::vector<std::uint8_t> mine(static_cast<std::size_t>(r + 1), static_cast<std::uint8_t>(10 + r));
      got[r] = comm->gather_host(mine);
      got[r] = comm->gather_host(got[r][(r + 1) % 3]);  // a second round stays separate from the first
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r)
    for (int q = 0; q < 3; ++q) {
      const int from = (q + 1) % 3;
      EXPECT_EQ(got[r][q], std::vector<std::uint8_t>(static_cast<std::size_t>(from + 1), static_cast<std::uint8_t>(10 + from)));
    }
}

TEST(DeviceWorld, ArgumentsAreCheckedBeforeAnythingIsQueued) {
  DeviceWorld world(2);
  auto comm = world.communicator(0);
  EXPECT_THROW(comm->send(2, 1, nullptr, 4, DType::fp32, nullptr), std::invalid_argument);
  const std::vector<int> without_me = {1};
  EXPECT_THROW(comm->all_reduce(nullptr, 4, DType::fp32, without_me, 1, ReduceOp::sum, Divide::none, nullptr),
               std::invalid_argument);
  const std::vector<int> both = {0, 1};
  EXPECT_THROW(comm->all_reduce(nullptr, 4, DType::fp8, both, 1, ReduceOp::sum, Divide::none, nullptr),
               std::invalid_argument);
  EXPECT_THROW(world.communicator(2), std::invalid_argument);
}

}  // namespace
}  // namespace trainsim::runtime::cuda
