// The in-process communicator (runtime/comm/in_process.h): point-to-point messages between
// rank threads, the ring all-reduce against independent references (an exact sum in double
// with the rounding-error bound of a ring, and a ring written out element by element), its
// low-precision numerics, NaN propagation, concurrency, timeouts and abort.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/in_process.h"
#include "runtime/numerics/lowp.h"

namespace trainsim::runtime {
namespace {

using namespace std::chrono_literals;

// Runs body(rank, comm) on one thread per rank and rethrows the first failure on the caller.
void run_ranks(InProcessWorld& world, const std::function<void(int, Communicator&)>& body) {
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world.world_size(); ++r) comms.push_back(world.communicator(r));
  std::vector<std::exception_ptr> errors(comms.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < world.world_size(); ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, *comms[static_cast<std::size_t>(r)]);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

std::vector<int> iota_members(int n) {
  std::vector<int> m(static_cast<std::size_t>(n));
  std::iota(m.begin(), m.end(), 0);
  return m;
}

// Fresh random inputs, one vector per member, never zeros: uniform in ±[lo, hi].
std::vector<std::vector<float>> random_inputs(int n, std::size_t size, std::uint32_t seed, float lo = 0.25f,
                                              float hi = 4.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  std::vector<std::vector<float>> x(static_cast<std::size_t>(n), std::vector<float>(size));
  for (auto& v : x)
    for (float& e : v) e = neg(gen) ? -mag(gen) : mag(gen);
  return x;
}

// All-reduces x[r] on every rank r of a world of n; returns each member's result.
std::vector<std::vector<float>> ring_all_reduce(std::vector<std::vector<float>> x, ReduceOp op, DType wire,
                                                Divide divide) {
  const int n = static_cast<int>(x.size());
  InProcessWorld world(n, 20s);
  const auto members = iota_members(n);
  run_ranks(world, [&](int r, Communicator& c) {
    c.all_reduce(x[static_cast<std::size_t>(r)], members, 42, op, wire, divide);
  });
  EXPECT_EQ(world.bytes_in_flight(), 0u);
  return x;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void expect_identical_on_all_members(const std::vector<std::vector<float>>& out) {
  for (std::size_t r = 1; r < out.size(); ++r)
    for (std::size_t i = 0; i < out[0].size(); ++i)
      ASSERT_TRUE(same_bits(out[r][i], out[0][i]))
          << "member " << r << " element " << i << ": " << out[r][i] << " vs member 0: " << out[0][i];
}

// The ring's order of summation, written out independently: element i lies in chunk c (N/n
// elements each, one more for the first N%n chunks), and chunk c is summed starting with
// member c's contribution, then c+1, ..., c-1, each partial sum rounded to the wire format.
// Divide::before multiplies each rounded term by 1/n rounded to the wire format (rounding
// the product); Divide::after divides the final sum by n (rounding the quotient).
// reduce_scatter's ring is shifted by one member (`first` = 1): chunk c starts with member c+1
// and ends at member c, which owns it.
float reference_ring_sum(const std::vector<std::vector<float>>& x, std::size_t i, DType wire,
                         Divide divide = Divide::none, std::size_t first = 0) {
  const std::size_t n = x.size(), N = x[0].size(), base = N / n, extra = N % n;
  std::size_t c = 0, end = base + (extra > 0 ? 1 : 0);
  while (i >= end) {
    ++c;
    end += base + (c < extra ? 1 : 0);
  }
  const float inv = round_to(wire, 1.0f / float(n));
  auto term = [&](std::size_t member) {
    const float t = round_to(wire, x[member][i]);
    return divide == Divide::before ? round_to(wire, t * inv) : t;
  };
  float s = term((c + first) % n);
  for (std::size_t k = 1; k < n; ++k) s = round_to(wire, s + term((c + first + k) % n));
  return divide == Divide::after ? round_to(wire, s / float(n)) : s;
}

// ---------------------------------------------------------------------------------------
// Point to point
// ---------------------------------------------------------------------------------------

TEST(InProcessComm, PointToPointRoundTripAcrossThreads) {
  InProcessWorld world(2, 20s);
  const std::vector<float> ping = {1.5f, -2.0f, 3.25f, 1e-20f, 7.0f};
  std::vector<float> back(ping.size());
  run_ranks(world, [&](int r, Communicator& c) {
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.world_size(), 2);
    std::vector<float> buf(ping.size());
    if (r == 0) {
      c.send(1, 7, ping);
      c.recv(1, 8, back);
    } else {
      c.recv(0, 7, buf);
      for (float& v : buf) v *= 2;
      c.send(0, 8, buf);
    }
  });
  for (std::size_t i = 0; i < ping.size(); ++i) EXPECT_EQ(back[i], 2 * ping[i]);
  EXPECT_EQ(world.bytes_in_flight(), 0u);
}

TEST(InProcessComm, SendCopiesAndReturnsBeforeTheReceiverArrives) {
  InProcessWorld world(2, 20s);
  auto c0 = world.communicator(0), c1 = world.communicator(1);
  std::vector<float> data(100, 3.0f);
  c0->send(1, 1, data);  // no receiver yet: must not block
  data.assign(100, -1.0f);  // the message was copied
  EXPECT_EQ(world.bytes_in_flight(), 100 * sizeof(float));
  EXPECT_EQ(world.peak_bytes_in_flight(), 100 * sizeof(float));
  c0->send(1, 2, std::vector<float>(50, 1.0f));
  EXPECT_EQ(world.bytes_in_flight(), 150 * sizeof(float));
  std::vector<float> got(100);
  c1->recv(0, 1, got);
  for (float v : got) EXPECT_EQ(v, 3.0f);
  EXPECT_EQ(world.bytes_in_flight(), 50 * sizeof(float));
  std::vector<float> rest(50);
  c1->recv(0, 2, rest);
  EXPECT_EQ(world.bytes_in_flight(), 0u);
  EXPECT_EQ(world.peak_bytes_in_flight(), 150 * sizeof(float));
}

// CPU time of the calling thread.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// `poll_while` false: a receiver that may poll for a second sleeps at once instead (a gated
// tensor-parallel shard whose partner has no core), and wakes when the message comes; true: it
// polls, and still gets the message.
TEST(InProcessComm, PollWhileFalseSleepsAtOnceAndTheMessageStillArrives) {
  InProcessWorld world(2, 20s);
  for (const bool may_poll : {false, true}) {
    std::atomic<bool> flag{may_poll};
    auto c0 = world.communicator(0), c1 = world.communicator(1, 1s, &flag);
    double cpu = 0;
    std::vector<float> got(8);
    std::thread receiver([&] {
      const double before = thread_cpu_seconds();
      c1->recv(0, 5, got);
      cpu = thread_cpu_seconds() - before;
    });
    std::this_thread::sleep_for(200ms);
    c0->send(1, 5, std::vector<float>(8, 2.5f));
    receiver.join();
    for (float v : got) EXPECT_EQ(v, 2.5f);
    // Sleeping, the 200 ms wait costs next to no CPU; polling, the receiver spins for it (at least
    // whatever share of those 200 ms the scheduler gave it: only bounded where it cannot fail).
    if (!may_poll) {
      EXPECT_LT(cpu, 0.05) << "the receiver polled although poll_while was false";
    }
  }
}

// `poll_in_call`: a ring's later steps, whose sender is inside the call already, poll that long;
// its first step polls `poll`. Three members, the third 200 ms late: member 0 waits at step 0
// for it (its predecessor), member 1 at step 1 for member 0, which is in the call (it sent step
// 0) and stuck there. With poll 0 everywhere both sleep; with poll_in_call 1 s member 1 polls its
// wait (at least a tenth of it, whatever share the scheduler gave it), member 0 still sleeps.
TEST(InProcessComm, LaterRingStepsPollForPollInCallAndTheFirstForPoll) {
  for (const auto in_call : {0ms, 1000ms}) {
    InProcessWorld world(3, 20s);
    std::vector<std::unique_ptr<Communicator>> comms;
    for (int r = 0; r < 3; ++r) comms.push_back(world.communicator(r, 0us, nullptr, in_call));
    const std::vector<int> members{0, 1, 2};
    std::vector<std::vector<float>> data(3, std::vector<float>(3 * 1024, 1.0f));
    std::vector<double> cpu(3, 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r)
      threads.emplace_back([&, r] {
        if (r == 2) std::this_thread::sleep_for(200ms);
        const double before = thread_cpu_seconds();
        comms[static_cast<std::size_t>(r)]->all_reduce(data[static_cast<std::size_t>(r)], members, 9, ReduceOp::sum,
                                                       DType::fp32, Divide::none);
        cpu[static_cast<std::size_t>(r)] = thread_cpu_seconds() - before;
      });
    for (auto& t : threads) t.join();
    for (const auto& d : data)
      for (float v : d) ASSERT_EQ(v, 3.0f);
    EXPECT_LT(cpu[0], 0.05) << "member 0 polled its first step's wait (poll 0)";
    if (in_call == 0ms) {
      EXPECT_LT(cpu[1], 0.05) << "member 1 polled a later step with poll_in_call 0";
    } else {
      EXPECT_GT(cpu[1], 0.02) << "member 1 slept a later step's wait with poll_in_call 1 s";
    }
  }
  InProcessWorld world(1);
  EXPECT_THROW(world.communicator(0, 0us, nullptr, -1us), std::invalid_argument);
}

TEST(InProcessComm, OutOfOrderTagsAndFifoWithinATag) {
  InProcessWorld world(2, 20s);
  run_ranks(world, [&](int r, Communicator& c) {
    if (r == 0) {
      for (int tag = 1; tag <= 3; ++tag) c.send(1, static_cast<std::uint64_t>(tag), std::vector<float>{float(tag)});
      c.send(1, 9, std::vector<float>{100});  // same tag twice: delivered in order
      c.send(1, 9, std::vector<float>{200});
    } else {
      std::vector<float> v(1);
      for (int tag : {3, 1, 2}) {
        c.recv(0, static_cast<std::uint64_t>(tag), v);
        EXPECT_EQ(v[0], float(tag));
      }
      c.recv(0, 9, v);
      EXPECT_EQ(v[0], 100);
      c.recv(0, 9, v);
      EXPECT_EQ(v[0], 200);
    }
  });
}

TEST(InProcessComm, SizeMismatchIsAnErrorNamingRanksTagAndSizes) {
  InProcessWorld world(2, 20s);
  auto c0 = world.communicator(0), c1 = world.communicator(1);
  c0->send(1, 5, std::vector<float>(3, 1.0f));
  std::vector<float> v(4);
  try {
    c1->recv(0, 5, v);
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("recv from rank 0 tag 5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sent 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expects 4"), std::string::npos) << msg;
  }
}

TEST(InProcessComm, BadPeersAndMembersAreRejected) {
  InProcessWorld world(3, 20s);
  auto c = world.communicator(1);
  std::vector<float> v(2);
  EXPECT_THROW(c->send(3, 0, v), std::invalid_argument);
  EXPECT_THROW(c->recv(-1, 0, v), std::invalid_argument);
  const std::vector<int> unsorted = {1, 0}, missing = {0, 2}, outside = {1, 5};
  EXPECT_THROW(c->all_reduce(v, unsorted, 0, ReduceOp::sum, DType::fp32, Divide::none), std::invalid_argument);
  EXPECT_THROW(c->all_reduce(v, missing, 0, ReduceOp::sum, DType::fp32, Divide::none), std::invalid_argument);
  EXPECT_THROW(c->all_reduce(v, outside, 0, ReduceOp::sum, DType::fp32, Divide::none), std::invalid_argument);
  EXPECT_THROW(world.communicator(3), std::invalid_argument);
  EXPECT_THROW(InProcessWorld(0), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// Ring all-reduce: numerics
// ---------------------------------------------------------------------------------------

// fp32 wire: the inputs enter unrounded and each element of the result is a sum of n terms
// taken by n-1 rounded additions, so (Higham, recursive summation)
//   |ring - exact| <= gamma_{n-1} * sum_i |x_i|,  gamma_k = k u / (1 - k u),  u = 2^-24.
// The exact sum is taken in double (exact enough: its own error is ~2^-53 relative).
TEST(InProcessComm, RingSumInFp32IsWithinTheRingBoundOfTheExactSum) {
  const double u = unit_roundoff(DType::fp32);
  for (int n : {1, 2, 3, 4, 8}) {
    for (std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t(n - 1), std::size_t{1000}, std::size_t{4097}}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " size=" + std::to_string(size));
      const auto x = random_inputs(n, size, static_cast<std::uint32_t>(1000 * n + size));
      const auto out = ring_all_reduce(x, ReduceOp::sum, DType::fp32, Divide::none);
      expect_identical_on_all_members(out);
      const double gamma = (n - 1) * u / (1 - (n - 1) * u);
      for (std::size_t i = 0; i < size; ++i) {
        double exact = 0, abs_sum = 0;
        for (int r = 0; r < n; ++r) {
          exact += x[static_cast<std::size_t>(r)][i];
          abs_sum += std::abs(x[static_cast<std::size_t>(r)][i]);
        }
        ASSERT_LE(std::abs(out[0][i] - exact), gamma * abs_sum * (1 + 1e-12)) << "element " << i;
        if (n == 1) {
          ASSERT_EQ(out[0][i], x[0][i]);
        }
      }
    }
  }
}

// Low-precision wire: each term is rounded on entry (one factor (1+d), |d| <= u) and then
// passes through at most n-1 rounded additions, so every term carries at most n rounding
// factors and
//   |ring - exact| <= gamma_n * sum_i |x_i|,  gamma_n = n u / (1 - n u),
// with u = 2^-11 (fp16) or 2^-8 (bf16); the last addition is the final rounding (no divide
// here). Values stay in the normal range, where the relative bound holds.
TEST(InProcessComm, RingSumInFp16AndBf16IsWithinTheFormatsBound) {
  for (DType wire : {DType::fp16, DType::bf16}) {
    const double u = unit_roundoff(wire);
    for (int n : {2, 3, 4, 8}) {
      SCOPED_TRACE(std::string(dtype_name(wire)) + " n=" + std::to_string(n));
      const auto x = random_inputs(n, 4097, static_cast<std::uint32_t>(77 + n));
      const auto out = ring_all_reduce(x, ReduceOp::sum, wire, Divide::none);
      expect_identical_on_all_members(out);
      const double gamma = n * u / (1 - n * u);
      for (std::size_t i = 0; i < x[0].size(); ++i) {
        double exact = 0, abs_sum = 0;
        for (int r = 0; r < n; ++r) {
          exact += x[static_cast<std::size_t>(r)][i];
          abs_sum += std::abs(x[static_cast<std::size_t>(r)][i]);
        }
        ASSERT_LE(std::abs(out[0][i] - exact), gamma * abs_sum * (1 + 1e-12)) << "element " << i;
        ASSERT_EQ(round_to(wire, out[0][i]), out[0][i]) << "the result is a value of the wire format";
      }
    }
  }
}

// The result is bit for bit the ring's order of summation (each chunk starting at its own
// member), which for every chunk but the first is not the naive left-to-right order.
TEST(InProcessComm, LowPrecisionSumFollowsTheRingOrderNotTheNaiveOrder) {
  for (DType wire : {DType::fp16, DType::bf16}) {
    const int n = 4;
    const auto x = random_inputs(n, 1003, 5, 0.01f, 300.0f);
    const auto out = ring_all_reduce(x, ReduceOp::sum, wire, Divide::none);
    int differs_from_naive = 0;
    for (std::size_t i = 0; i < x[0].size(); ++i) {
      ASSERT_TRUE(same_bits(out[0][i], reference_ring_sum(x, i, wire))) << dtype_name(wire) << " element " << i;
      float naive = round_to(wire, x[0][i]);
      for (int r = 1; r < n; ++r) naive = round_to(wire, naive + round_to(wire, x[static_cast<std::size_t>(r)][i]));
      differs_from_naive += naive != out[0][i];
    }
    EXPECT_GT(differs_from_naive, 0) << dtype_name(wire);
  }
  // A hand-made case, fp16 (spacing 2 at 2048): element 1 lies in chunk 1 of 4, summed as
  // ((x1 + x2) + x3) + x0 = ((1 + 1) + 0) + 2048 = 2050 exactly, while the naive order
  // ((2048 + 1) + 1) + 0 loses both ones to round-half-to-even and gives 2048.
  std::vector<std::vector<float>> x(4, std::vector<float>(4, 0.0f));
  x[0][1] = 2048;
  x[1][1] = 1;
  x[2][1] = 1;
  const auto out = ring_all_reduce(x, ReduceOp::sum, DType::fp16, Divide::none);
  EXPECT_EQ(out[0][1], 2050.0f);
  EXPECT_EQ(round_to_fp16(round_to_fp16(2048.0f + 1.0f) + 1.0f), 2048.0f);
}

// Three members (1/3 is inexact in every format): both divides, bit for bit.
TEST(InProcessComm, DivideBeforeAndAfterFollowTheRingBitForBit) {
  for (DType wire : {DType::fp32, DType::fp16, DType::bf16}) {
    for (Divide divide : {Divide::before, Divide::after}) {
      const auto x = random_inputs(3, 301, 9, 0.001f, 1000.0f);
      const auto out = ring_all_reduce(x, ReduceOp::sum, wire, divide);
      expect_identical_on_all_members(out);
      for (std::size_t i = 0; i < x[0].size(); ++i)
        ASSERT_TRUE(same_bits(out[0][i], reference_ring_sum(x, i, wire, divide)))
            << dtype_name(wire) << (divide == Divide::before ? " before" : " after") << " element " << i << ": "
            << out[0][i] << " vs " << reference_ring_sum(x, i, wire, divide);
    }
  }
}

// reduce_scatter: member p's chunk of its buffer is the ring's sum of chunk p, bit for bit, in
// every wire format and divide; all_gather then hands every member every chunk unchanged.
// Together they are an all-reduce (the same sum, up to where each chunk's ring starts).
TEST(InProcessComm, ReduceScatterOwnsItsChunkAndAllGatherSpreadsEveryChunk) {
  for (DType wire : {DType::fp32, DType::fp16, DType::bf16}) {
    for (Divide divide : {Divide::none, Divide::before, Divide::after}) {
      for (int n : {1, 2, 3, 4}) {
        for (std::size_t per : {std::size_t{0}, std::size_t{1}, std::size_t{257}}) {
          SCOPED_TRACE(std::string(dtype_name(wire)) + " n=" + std::to_string(n) + " chunk=" + std::to_string(per));
          const std::size_t N = per * static_cast<std::size_t>(n);
          const auto x = random_inputs(n, N, static_cast<std::uint32_t>(31 * n + per), 0.001f, 1000.0f);
          auto y = x;
          InProcessWorld world(n, 20s);
          const auto members = iota_members(n);
          run_ranks(world, [&](int r, Communicator& c) {
            auto& buf = y[static_cast<std::size_t>(r)];
            c.reduce_scatter(buf, members, 7, ReduceOp::sum, wire, divide);
            for (std::size_t j = 0; j < per; ++j) {
              const std::size_t i = static_cast<std::size_t>(r) * per + j;
              ASSERT_TRUE(same_bits(buf[i], reference_ring_sum(x, i, wire, divide, 1)))
                  << "rank " << r << " element " << i << ": " << buf[i] << " vs "
                  << reference_ring_sum(x, i, wire, divide, 1);
            }
            c.all_gather(buf, members, 8, wire);
          });
          EXPECT_EQ(world.bytes_in_flight(), 0u);
          expect_identical_on_all_members(y);
          for (std::size_t i = 0; i < N; ++i)
            ASSERT_TRUE(same_bits(y[0][i], reference_ring_sum(x, i, wire, divide, 1))) << "element " << i;
        }
      }
    }
  }
}

// all_gather rounds what it sends to the wire format and nothing else; max propagates NaN in a
// reduce_scatter as in an all-reduce.
TEST(InProcessComm, AllGatherRoundsToTheWireAndReduceScatterMaxKeepsNaN) {
  const int n = 2;
  std::vector<std::vector<float>> y = {{1.0f + 1.0f / 1024, 0.0f}, {0.0f, 3.14159f}};
  InProcessWorld world(n, 20s);
  const auto members = iota_members(n);
  run_ranks(world, [&](int r, Communicator& c) { c.all_gather(y[static_cast<std::size_t>(r)], members, 1, DType::bf16); });
  for (const auto& v : y) {
    EXPECT_EQ(v[0], round_to_bf16(1.0f + 1.0f / 1024));
    EXPECT_EQ(v[1], round_to_bf16(3.14159f));
  }
  std::vector<std::vector<float>> z = {{std::numeric_limits<float>::quiet_NaN(), 1.0f}, {2.0f, 5.0f}};
  run_ranks(world, [&](int r, Communicator& c) {
    c.reduce_scatter(z[static_cast<std::size_t>(r)], members, 2, ReduceOp::max, DType::fp32, Divide::none);
  });
  EXPECT_TRUE(std::isnan(z[0][0]));
  EXPECT_EQ(z[1][1], 5.0f);
}

// Disjoint subgroups run their own collectives at once (ZeRO over data-parallel groups while
// tensor-parallel groups gather); a buffer that does not split into equal chunks is refused
// before anything is sent, naming the call.
TEST(InProcessComm, ReduceScatterAndAllGatherOnSubgroupsAndUnevenBuffersRefused) {
  InProcessWorld world(4, 20s);
  std::vector<std::vector<float>> y(4, std::vector<float>(6));
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 6; ++i) y[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)] = float(10 * r + i);
  run_ranks(world, [&](int r, Communicator& c) {
    const std::vector<int> group = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    c.reduce_scatter(y[static_cast<std::size_t>(r)], group, 5, ReduceOp::sum, DType::fp32, Divide::none);
    c.all_gather(y[static_cast<std::size_t>(r)], group, 6, DType::fp32);
  });
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 6; ++i)
      EXPECT_EQ(y[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)], float(10 * (r % 2) + 10 * (r % 2 + 2) + 2 * i))
          << "rank " << r << " element " << i;
  auto comm = world.communicator(0);
  std::vector<float> odd(5);
  const std::vector<int> pair{0, 1};
  try {
    comm->reduce_scatter(odd, pair, 9, ReduceOp::sum, DType::fp32, Divide::none);
    FAIL() << "an uneven buffer was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("reduce_scatter tag 9: 5 elements do not split into 2"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(comm->all_gather(odd, pair, 9, DType::fp32), std::invalid_argument);
  EXPECT_EQ(world.bytes_in_flight(), 0u);
}

// fp16, four members near 60000: summing first overflows (60000 + 60000 > 65504) and stays
// inf after the divide; dividing each contribution by 4 first keeps every partial sum finite.
TEST(InProcessComm, DivideBeforeAvoidsTheOverflowOfDivideAfter) {
  const int n = 4;
  std::vector<std::vector<float>> x(n, std::vector<float>(10));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < 10; ++i) x[static_cast<std::size_t>(r)][i] = 60000.0f + 32.0f * float(r) - float(i);
  const auto after = ring_all_reduce(x, ReduceOp::sum, DType::fp16, Divide::after);
  const auto before = ring_all_reduce(x, ReduceOp::sum, DType::fp16, Divide::before);
  expect_identical_on_all_members(after);
  expect_identical_on_all_members(before);
  const double u = unit_roundoff(DType::fp16);
  for (std::size_t i = 0; i < 10; ++i) {
    EXPECT_TRUE(std::isinf(after[0][i]) && after[0][i] > 0) << after[0][i];
    ASSERT_TRUE(std::isfinite(before[0][i])) << before[0][i];
    double mean = 0;
    for (int r = 0; r < n; ++r) mean += x[static_cast<std::size_t>(r)][i] / n;
    // 1/4 is exact; rounding on entry, after the multiply and n-1 additions: gamma_{n+1}.
    EXPECT_LE(std::abs(before[0][i] - mean), (n + 1) * u / (1 - (n + 1) * u) * mean);
  }
  // Both divides agree where nothing overflows: small fp32 values, exact arithmetic.
  std::vector<std::vector<float>> small = {{4, 8}, {8, 16}, {12, 24}, {16, 32}};
  const auto a = ring_all_reduce(small, ReduceOp::sum, DType::fp32, Divide::after);
  const auto b = ring_all_reduce(small, ReduceOp::sum, DType::fp32, Divide::before);
  EXPECT_EQ(a[0], (std::vector<float>{10, 20}));
  EXPECT_EQ(b[0], (std::vector<float>{10, 20}));
}

// max must propagate NaN (unlike std::fmax): the global overflow check all-reduces each
// rank's verdict with max, and a NaN seen by one rank must reach all of them.
TEST(InProcessComm, MaxPropagatesNaNAndInf) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int n : {2, 3, 5}) {
    auto x = random_inputs(n, 9, static_cast<std::uint32_t>(n));
    x[static_cast<std::size_t>(n - 1)][0] = nan;  // NaN on the last member
    x[0][4] = nan;                                // NaN on the first member
    x[1][6] = inf;
    x[0][7] = -inf;
    const auto out = ring_all_reduce(x, ReduceOp::max, DType::fp32, Divide::none);
    expect_identical_on_all_members(out);
    for (std::size_t i = 0; i < 9; ++i) {
      if (i == 0 || i == 4) {
        EXPECT_TRUE(std::isnan(out[0][i])) << "n=" << n << " element " << i << ": " << out[0][i];
        continue;
      }
      float expect = -inf;
      for (int r = 0; r < n; ++r) expect = std::max(expect, x[static_cast<std::size_t>(r)][i]);
      EXPECT_EQ(out[0][i], expect) << "n=" << n << " element " << i;
    }
  }
}

TEST(InProcessComm, SizeMismatchInACollectiveIsAnError) {
  InProcessWorld world(2, 20s);
  const auto members = iota_members(2);
  std::atomic<int> errors{0};
  try {
    run_ranks(world, [&](int r, Communicator& c) {
      std::vector<float> v(r == 0 ? 10 : 12, 1.0f);
      try {
        c.all_reduce(v, members, 3, ReduceOp::sum, DType::fp32, Divide::none);
      } catch (const CommError& e) {
        ++errors;
        EXPECT_NE(std::string(e.what()).find("size mismatch"), std::string::npos) << e.what();
        c.abort(e.what());  // as the executor does: one failure stops the others
      }
    });
  } catch (...) {
  }
  EXPECT_GE(errors.load(), 1);
}

// ---------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------

// Four ranks, two threads each (as a rank's compute and communication threads): the
// communication thread runs all-reduces over all ranks and over its pair ({0,1} or {2,3});
// the compute thread runs all-reduces over the overlapping group {1,2,3} (ranks 1..3) and
// passes point-to-point messages around the ring, all at once, with distinct tags.
TEST(InProcessComm, ConcurrentCollectivesOnDisjointAndOverlappingGroups) {
  const int n = 4, rounds = 20;
  InProcessWorld world(n, 20s);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(world.communicator(r));
  const std::vector<int> all = {0, 1, 2, 3}, low = {0, 1}, high = {2, 3}, odd = {1, 2, 3};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    Communicator& c = *comms[static_cast<std::size_t>(r)];
    threads.emplace_back([&, r] {  // communication thread
      try {
        for (int k = 0; k < rounds; ++k) {
          std::vector<float> v(37, float(r + k));
          c.all_reduce(v, all, 1000, ReduceOp::sum, DType::fp32, Divide::none);
          for (float e : v) failures += e != float(6 + 4 * k);
          std::vector<float> w(5, float(r));
          c.all_reduce(w, r < 2 ? low : high, r < 2 ? 2000 : 2001, ReduceOp::max, DType::fp32, Divide::none);
          for (float e : w) failures += e != float(r < 2 ? 1 : 3);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << " comm thread: " << e.what();
        ++failures;
      }
    });
    threads.emplace_back([&, r] {  // compute thread
      try {
        for (int k = 0; k < rounds; ++k) {
          if (r > 0) {
            std::vector<float> v(11, float(r * k));
            c.all_reduce(v, odd, 3000, ReduceOp::sum, DType::fp16, Divide::after);
            for (float e : v) failures += e != float(2 * k);  // (1+2+3)k / 3, exact in fp16 here
          }
          c.send((r + 1) % n, 7, std::vector<float>(3, float(100 * r + k)));
          std::vector<float> got(3);
          c.recv((r + n - 1) % n, 7, got);
          failures += got[0] != float(100 * ((r + n - 1) % n) + k);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << " compute thread: " << e.what();
        ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(world.bytes_in_flight(), 0u);
  EXPECT_GT(world.peak_bytes_in_flight(), 0u);
}

// ---------------------------------------------------------------------------------------
// Failures: timeouts and abort never hang
// ---------------------------------------------------------------------------------------

TEST(InProcessComm, RecvTimeoutNamesRankOpAndPeer) {
  InProcessWorld world(2, 50ms);
  auto c0 = world.communicator(0);
  std::vector<float> v(4);
  try {
    c0->recv(1, 7, v);
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 0: recv from rank 1 tag 7"), std::string::npos) << msg;
    EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
  }
}

// Ranks 0 and 1 of members {0,1,2} call an all-reduce of `elements`; rank 2 never does.
std::vector<std::string> all_reduce_without_rank_2(std::size_t elements) {
  InProcessWorld world(3, 100ms);
  const std::vector<int> members = {0, 1, 2};
  std::vector<std::string> messages(2);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 2; ++r) comms.push_back(world.communicator(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> v(elements, 1.0f);
      try {
        comms[static_cast<std::size_t>(r)]->all_reduce(v, members, 11, ReduceOp::sum, DType::fp32, Divide::none);
      } catch (const CommError& e) {
        messages[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return messages;
}

TEST(InProcessComm, CollectiveTimeoutNamesRankStepAndPeer) {
  // Round the ring (a buffer larger than the direct path's): rank 0 waits on its predecessor,
  // rank 2, at the first step; rank 1 gets rank 0's first chunk, then waits on rank 0 at step 1.
  const auto ring = all_reduce_without_rank_2(3000);
  EXPECT_NE(ring[0].find("rank 0: all_reduce tag 11 step 0 (peer rank 2)"), std::string::npos) << ring[0];
  EXPECT_NE(ring[0].find("timed out"), std::string::npos) << ring[0];
  EXPECT_NE(ring[1].find("rank 1: all_reduce tag 11 step 1 (peer rank 0)"), std::string::npos) << ring[1];
  // Direct (a small buffer): both wait on the member that never came.
  const auto direct = all_reduce_without_rank_2(6);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(direct[r].find("rank " + std::to_string(r) + ": all_reduce tag 11 (peer rank 2)"), std::string::npos)
        << direct[r];
    EXPECT_NE(direct[r].find("timed out"), std::string::npos) << direct[r];
  }
}

// Small buffers take the direct path, large ones the ring (in_process.cpp: direct while a member
// receives at most 1024 elements, (n-1) x N): both sum in the ring's order, bit for bit, on both
// sides of the switch (1024 and 1025 elements on 2 members, 146 and 147 on 8), in every wire
// format, divide and reduction, and on every member.
TEST(InProcessComm, DirectAndRingAllReduceGiveTheRingsBits) {
  for (std::size_t size : {std::size_t{1}, std::size_t{7}, std::size_t{146}, std::size_t{147}, std::size_t{1024},
                           std::size_t{1025}, std::size_t{2051}})
    for (int n : {2, 3, 8})
      for (DType wire : {DType::fp32, DType::bf16})
        for (Divide divide : {Divide::none, Divide::before, Divide::after}) {
          const auto x = random_inputs(n, size, static_cast<std::uint32_t>(size * 31 + n), 0.01f, 300.0f);
          const auto out = ring_all_reduce(x, ReduceOp::sum, wire, divide);
          expect_identical_on_all_members(out);
          for (std::size_t i = 0; i < size; ++i)
            ASSERT_TRUE(same_bits(out[0][i], reference_ring_sum(x, i, wire, divide)))
                << "size " << size << ", " << n << " members, " << dtype_name(wire) << ", element " << i;
        }
  // max, with a NaN on one member only: it reaches every member by either path.
  for (std::size_t size : {std::size_t{5}, std::size_t{1500}}) {
    auto x = random_inputs(4, size, 3);
    x[2][size - 1] = std::numeric_limits<float>::quiet_NaN();
    const auto out = ring_all_reduce(x, ReduceOp::max, DType::fp32, Divide::none);
    for (const auto& o : out) {
      EXPECT_TRUE(std::isnan(o[size - 1])) << "size " << size;
      for (std::size_t i = 0; i + 1 < size; ++i)
        ASSERT_EQ(o[i], std::max({x[0][i], x[1][i], x[2][i], x[3][i]})) << "size " << size << " element " << i;
    }
  }
}

TEST(InProcessComm, AbortUnblocksPendingCallsAndFailsLaterOnes) {
  InProcessWorld world(3, 60s);  // a missed wake-up would show as a 60 s timeout, not the reason
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 3; ++r) comms.push_back(world.communicator(r));
  const std::vector<int> members = {0, 1, 2};
  std::vector<std::string> messages(3);
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&] {  // rank 0: a recv nobody will satisfy
    std::vector<float> v(3);
    ++started;
    try {
      comms[0]->recv(2, 1, v);
    } catch (const CommError& e) {
      messages[0] = e.what();
    }
  });
  threads.emplace_back([&] {  // rank 1: an all-reduce rank 2 never joins
    std::vector<float> v(8, 1.0f);
    ++started;
    try {
      comms[1]->all_reduce(v, members, 4, ReduceOp::sum, DType::fp32, Divide::none);
    } catch (const CommError& e) {
      messages[1] = e.what();
    }
  });
  while (started.load() < 2) std::this_thread::yield();
  std::this_thread::sleep_for(20ms);  // most likely asleep by now; either way they must fail
  comms[2]->abort("rank 2 failed: out of memory");
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(messages[static_cast<std::size_t>(r)].find("aborted: rank 2 failed: out of memory"), std::string::npos)
        << messages[static_cast<std::size_t>(r)];
    EXPECT_NE(messages[static_cast<std::size_t>(r)].find("rank " + std::to_string(r) + ":"), std::string::npos);
  }
  EXPECT_NE(messages[0].find("recv from rank 2 tag 1"), std::string::npos) << messages[0];
  EXPECT_NE(messages[1].find("all_reduce tag 4"), std::string::npos) << messages[1];
  // Future calls, on any rank, fail at once with the first reason.
  std::vector<float> v(2);
  comms[0]->abort("a second reason is ignored");
  try {
    comms[2]->send(0, 1, v);
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 failed: out of memory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comms[1]->recv(0, 1, v), CommError);
  const std::vector<int> solo = {0};
  EXPECT_THROW(comms[0]->all_reduce(v, solo, 9, ReduceOp::sum, DType::fp32, Divide::none), CommError);
}

}  // namespace
}  // namespace trainsim::runtime
