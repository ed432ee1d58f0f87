// NcclCommunicator (runtime/cuda/nccl_communicator.h) against host references.
//
//  * Argument checks that need no device run everywhere.
//  * A world of one runs on any machine with a GPU: all-reduce is then the identity in every
//    format, op and divide (x * round(1/1) = x), a send to oneself inside a group is a copy,
//    gather_host returns the blob, abort and the watchdog turn into CommError.
//  * Several processes, one GPU each, run where the machine has two GPUs or more (NCCL refuses
//    two ranks of one communicator on one device). The test re-executes this binary (fork +
//    execve, so no child inherits an initialised CUDA runtime) with torchrun's variables, one
//    process per rank; each child runs NcclCommunicatorChild.RunsTheRoleItWasStartedFor and
//    exits with gtest's status.
//
// Tolerances of a reduction over k members, derived, not measured. Values are drawn with
// magnitudes in [0.5, 2) and random signs, never zero, rounded to the format (unit roundoff u:
// 2^-24 fp32, 2^-11 fp16, 2^-8 bf16). Whatever order NCCL adds in (ring or tree), each of the k-1
// additions rounds once to the format, and every partial sum is at most sum|c| in magnitude, so
//   |result - exact sum| <= (k - 1) u sum|c|          (c: the contributions, pre-scaled for
//                                                     Divide::before, itself exact in double)
// For k = 2 this is one correctly rounded addition. Divide::after divides that by k and rounds
// twice more, the fp32 product by fl(1/k) (itself rounded) then to the format:
// + (u + 2 * 2^-24) |sum| / k. A max involves no
// arithmetic: the max of the contributions, exactly; with a divide, one more rounding (u |max|).
// A wrong chunk, offset, type or op gives errors of order |c|, far above these bounds.
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <ostream>
#include <random>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/device_buffer.h"
#include "kernels/kernels.h"
#include "runtime/cuda/nccl_communicator.h"
#include "runtime/cuda/stream_ops.h"
#include "runtime/launch/launch_env.h"
#include "runtime/numerics/lowp.h"

extern char** environ;

namespace trainsim {
// Parameterised tests name their format instead of printing bytes.
void PrintTo(DType d, std::ostream* os) { *os << dtype_name(d); }
}  // namespace trainsim

namespace trainsim::runtime::cuda {
namespace {

namespace k = ::trainsim::cuda;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr const char* kRoleVariable = "TRAINSIM_NCCL_TEST_ROLE";
constexpr const char* kChildTest = "NcclCommunicatorChild.RunsTheRoleItWasStartedFor";
constexpr DType kFormats[] = {DType::fp32, DType::bf16, DType::fp16};

void skip_without_device() {
  std::string why;
  if (!k::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
}

int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Expects `f` to throw E with `fragment` in its message.
template <class E, class F>
void expect_throw_with(F&& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one mentioning \"" << fragment << "\"";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// Data: random, never zero, representable in the format; device buffers in any format.
// ---------------------------------------------------------------------------------------
std::vector<float> random_values(std::size_t n, std::uint64_t seed, DType dt) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> magnitude(0.5f, 2.0f);
  std::vector<float> x(n);
  for (float& v : x) v = round_to(dt, (rng() & 1 ? -1.0f : 1.0f) * magnitude(rng));
  return x;
}

std::uint64_t seed_of(DType dt, std::size_t count, int rank, int variant) {
  return 0x9e3779b97f4a7c15ull ^ (static_cast<std::uint64_t>(dt) << 56) ^ (static_cast<std::uint64_t>(count) << 20) ^
         (static_cast<std::uint64_t>(rank) << 8) ^ static_cast<std::uint64_t>(variant);
}

// `values` (already representable in dt) stored as dt on the device.
k::DeviceBuffer upload(const std::vector<float>& values, DType dt, StreamHandle stream) {
  k::DeviceBuffer fp32(values.size() * sizeof(float)), out(values.size() * static_cast<std::size_t>(dtype_bytes(dt)));
  copy_host_to_device(fp32.data(), values.data(), values.size() * sizeof(float), stream);
  k::cast(out.data(), dt, fp32.data(), DType::fp32, values.size(), stream);
  synchronize(stream);  // fp32 is freed on return
  return out;
}

std::vector<float> download(const k::DeviceBuffer& buffer, std::size_t n, DType dt, StreamHandle stream) {
  k::DeviceBuffer fp32(n * sizeof(float));
  k::cast(fp32.data(), DType::fp32, buffer.data(), dt, n, stream);
  std::vector<float> out(n);
  copy_device_to_host(out.data(), fp32.data(), n * sizeof(float), stream);
  synchronize(stream);
  return out;
}

// Bitwise equality, reporting the first difference.
void expect_identical(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << want[i];
      return;
    }
}

std::unique_ptr<NcclCommunicator> world_of_one(milliseconds timeout = seconds(60)) {
  return NcclCommunicator::create(LaunchEnv{}, {}, timeout);
}

struct Case {
  ReduceOp op;
  Divide divide;
  const char* name;
};
constexpr Case kCases[] = {{ReduceOp::sum, Divide::none, "sum"},
                           {ReduceOp::sum, Divide::before, "sum, divide before"},
                           {ReduceOp::sum, Divide::after, "sum, divide after"},
                           {ReduceOp::max, Divide::none, "max"},
                           {ReduceOp::max, Divide::before, "max, divide before"}};

// ---------------------------------------------------------------------------------------
// No device needed
// ---------------------------------------------------------------------------------------
TEST(NcclCommunicatorArguments, CreateRefusesBadArgumentsBeforeTouchingTheDevice) {
  LaunchEnv four;  // rank 0 of 4: a valid call would wait for three peers, so only refusals may run here
  four.world_size = 4;
  const auto create = [](const LaunchEnv& env, std::vector<std::vector<int>> groups, milliseconds timeout) {
    (void)NcclCommunicator::create(env, groups, timeout);
  };
  expect_throw_with<std::invalid_argument>([&] { create(four, {{0, 1}, {1, 0}}, seconds(1)); },
                                           "group 1 {1,0}: members must be strictly ascending");
  expect_throw_with<std::invalid_argument>([&] { create(four, {{2, 2}}, seconds(1)); }, "strictly ascending");
  expect_throw_with<std::invalid_argument>([&] { create(four, {{0, 4}}, seconds(1)); }, "4 is not a rank");
  expect_throw_with<std::invalid_argument>([&] { create(four, {{-1, 0}}, seconds(1)); }, "-1 is not a rank");
  expect_throw_with<std::invalid_argument>([&] { create(four, {{}}, seconds(1)); }, "group 0 {} is empty");
  expect_throw_with<std::invalid_argument>([&] { create(four, {}, milliseconds(0)); }, "timeout must be positive");
  LaunchEnv outside = four;
  outside.rank = 4;
  expect_throw_with<std::invalid_argument>([&] { create(outside, {}, seconds(1)); }, "rank 4 is outside [0, 4)");
  LaunchEnv negative_local = four;
  negative_local.local_rank = -1;
  expect_throw_with<std::invalid_argument>([&] { create(negative_local, {}, seconds(1)); }, "local rank");

  expect_throw_with<std::invalid_argument>(
      [&] { (void)NcclCommunicator::create(four, {}, seconds(1), {{0, 1}, {2, 2}}); },
      "link 1 (2 -> 2): a rank sends to itself");
  expect_throw_with<std::invalid_argument>(
      [&] { (void)NcclCommunicator::create(four, {}, seconds(1), {{3, 4}}); }, "link 0 (3 -> 4): not a pair of ranks");

  const std::vector<std::uint8_t> short_id(5, 1);
  expect_throw_with<std::invalid_argument>(
      [&] { (void)NcclCommunicator::init_from_id(short_id, 0, 2, 0, {}, seconds(1)); }, "got 5");
}

// ---------------------------------------------------------------------------------------
// A world of one
// ---------------------------------------------------------------------------------------
class NcclWorldOfOne : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { skip_without_device(); }
};

TEST_P(NcclWorldOfOne, AllReduceIsTheIdentity) {
  const DType dt = GetParam();
  auto comm = world_of_one();
  k::Stream stream;
  const int members[] = {0};
  for (std::size_t count : {std::size_t{1}, std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
    for (const Case& c : kCases) {
      const std::vector<float> x = random_values(count, seed_of(dt, count, 0, 0), dt);
      k::DeviceBuffer buffer = upload(x, dt, stream.get());
      comm->all_reduce(buffer.data(), count, dt, members, 7, c.op, c.divide, stream.get());
      comm->synchronize(stream.get(), "all_reduce test");
      expect_identical(download(buffer, count, dt, stream.get()), x,
                       std::string(c.name) + ", " + std::to_string(count) + " " + std::string(dtype_name(dt)));
    }
  }
}

// ncclReduceScatter and ncclAllGather in place over the world of one: the chunk is the buffer.
TEST_P(NcclWorldOfOne, ReduceScatterAndAllGatherAreTheIdentity) {
  const DType dt = GetParam();
  auto comm = world_of_one();
  k::Stream stream;
  const int members[] = {0};
  for (std::size_t count : {std::size_t{1}, std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
    for (const Case& c : kCases) {
      const std::vector<float> x = random_values(count, seed_of(dt, count, 0, 3), dt);
      k::DeviceBuffer buffer = upload(x, dt, stream.get());
      comm->reduce_scatter(buffer.data(), count, dt, members, 7, c.op, c.divide, stream.get());
      comm->all_gather(buffer.data(), count, dt, members, 8, stream.get());
      comm->synchronize(stream.get(), "reduce_scatter/all_gather test");
      expect_identical(download(buffer, count, dt, stream.get()), x,
                       std::string(c.name) + ", " + std::to_string(count) + " " + std::string(dtype_name(dt)));
    }
  }
}

TEST_P(NcclWorldOfOne, SendToSelfInsideAGroupIsACopy) {
  const DType dt = GetParam();
  auto comm = world_of_one();
  k::Stream stream;
  for (std::size_t count : {std::size_t{1}, std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
    const std::vector<float> sent = random_values(count, seed_of(dt, count, 0, 1), dt);
    const std::vector<float> before = random_values(count, seed_of(dt, count, 0, 2), dt);
    k::DeviceBuffer source = upload(sent, dt, stream.get());
    k::DeviceBuffer target = upload(before, dt, stream.get());
    comm->group_begin();
    comm->send(0, 11, source.data(), count, dt, stream.get());
    comm->recv(0, 11, target.data(), count, dt, stream.get());
    comm->group_end();
    comm->synchronize(stream.get(), "send/recv test");
    expect_identical(download(target, count, dt, stream.get()), sent, std::to_string(count) + " elements");
  }
}

TEST_P(NcclWorldOfOne, AllReduceInsideAGroupIsTheIdentity) {
  // Inside a group NCCL launches at group_end (PreMulSum operators are destroyed after it): the
  // buffers must hold the results afterwards. Every case in one group, each on its own buffer.
  const DType dt = GetParam();
  auto comm = world_of_one();
  k::Stream stream;
  const int members[] = {0};
  const std::size_t count = 4099;
  std::vector<std::vector<float>> x;
  std::vector<k::DeviceBuffer> buffers;
  for (int ci = 0; ci < static_cast<int>(std::size(kCases)); ++ci) {
    x.push_back(random_values(count, seed_of(dt, count, 0, 20 + ci), dt));
    buffers.push_back(upload(x.back(), dt, stream.get()));
  }
  comm->group_begin();
  for (std::size_t ci = 0; ci < std::size(kCases); ++ci)
    comm->all_reduce(buffers[ci].data(), count, dt, members, 3 + ci, kCases[ci].op, kCases[ci].divide, stream.get());
  comm->group_end();
  comm->synchronize(stream.get(), "grouped all_reduce test");
  for (std::size_t ci = 0; ci < std::size(kCases); ++ci)
    expect_identical(download(buffers[ci], count, dt, stream.get()), x[ci], kCases[ci].name);
}

INSTANTIATE_TEST_SUITE_P(Formats, NcclWorldOfOne, ::testing::ValuesIn(kFormats),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

class NcclWorldOfOneHost : public ::testing::Test {
 protected:
  void SetUp() override { skip_without_device(); }
};

TEST_F(NcclWorldOfOneHost, GatherHostReturnsTheBlob) {
  auto comm = world_of_one();
  std::mt19937_64 rng(5);
  // Growing then shrinking sizes: the scratch buffers are reused, and stale bytes must not leak in.
  for (std::size_t size : {std::size_t{37}, std::size_t{100000}, std::size_t{1}, std::size_t{0}, std::size_t{37}}) {
    std::vector<std::uint8_t> blob(size);
    for (auto& b : blob) b = static_cast<std::uint8_t>(1 + rng() % 255);
    const auto all = comm->gather_host(blob);
    ASSERT_EQ(all.size(), 1u);
    EXPECT_EQ(all[0], blob) << size << " bytes";
  }
}

TEST_F(NcclWorldOfOneHost, DescribeNamesNcclTheRankAndTheDevice) {
  auto comm = world_of_one();
  const std::string text = comm->describe();
  EXPECT_TRUE(std::regex_match(text, std::regex(R"(NCCL \d+\.\d+\.\d+, rank 0 of 1, GPU \d+ \(.+\))"))) << text;
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
}

TEST_F(NcclWorldOfOneHost, RefusesBadArgumentsAndStaysUsable) {
  auto comm = world_of_one();
  k::Stream stream;
  k::DeviceBuffer buffer(64 * sizeof(float));
  const int world[] = {0};
  const int none[] = {0, 0};
  const int stranger[] = {1};
  StreamHandle s = stream.get();
  expect_throw_with<std::invalid_argument>([&] { comm->send(0, 1, buffer.data(), 64, DType::fp8, s); }, "fp8");
  expect_throw_with<std::invalid_argument>([&] { comm->recv(0, 1, buffer.data(), 64, DType::tf32, s); }, "tf32");
  expect_throw_with<std::invalid_argument>([&] { comm->send(1, 1, buffer.data(), 64, DType::fp32, s); },
                                           "no such rank");
  expect_throw_with<std::invalid_argument>([&] { comm->recv(-1, 1, buffer.data(), 64, DType::fp32, s); },
                                           "no such rank");
  expect_throw_with<std::invalid_argument>([&] { comm->send(0, 1, nullptr, 64, DType::fp32, s); }, "data is null");
  expect_throw_with<std::invalid_argument>(
      [&] { comm->all_reduce(buffer.data(), 64, DType::fp8, world, 1, ReduceOp::sum, Divide::none, s); }, "fp8");
  expect_throw_with<std::invalid_argument>(
      [&] { comm->all_reduce(buffer.data(), 64, DType::fp32, none, 1, ReduceOp::sum, Divide::none, s); },
      "strictly ascending");
  expect_throw_with<std::invalid_argument>(
      [&] { comm->all_reduce(buffer.data(), 64, DType::fp32, stranger, 1, ReduceOp::sum, Divide::none, s); },
      "not a rank");
  expect_throw_with<std::logic_error>([&] { comm->group_end(); }, "group_end without group_begin");
  EXPECT_FALSE(comm->aborted());

  const std::vector<float> x = random_values(64, 9, DType::fp32);
  k::DeviceBuffer fresh = upload(x, DType::fp32, s);
  comm->all_reduce(fresh.data(), 64, DType::fp32, world, 2, ReduceOp::sum, Divide::none, s);
  comm->synchronize(s, "after refusals");
  expect_identical(download(fresh, 64, DType::fp32, s), x, "all_reduce after refused calls");
}

TEST_F(NcclWorldOfOneHost, AbortMakesEveryLaterCallThrowTheReason) {
  auto comm = world_of_one();
  k::Stream stream;
  k::DeviceBuffer buffer(64 * sizeof(float));
  const int world[] = {0};
  StreamHandle s = stream.get();
  comm->abort("rank 0: injected failure");
  comm->abort("rank 0: a second reason, ignored");
  EXPECT_TRUE(comm->aborted());
  const std::string reason = "rank 0: injected failure";
  expect_throw_with<CommError>(
      [&] { comm->all_reduce(buffer.data(), 64, DType::fp32, world, 1, ReduceOp::sum, Divide::none, s); }, reason);
  expect_throw_with<CommError>([&] { comm->send(0, 1, buffer.data(), 64, DType::fp32, s); }, reason);
  expect_throw_with<CommError>([&] { comm->recv(0, 1, buffer.data(), 64, DType::fp32, s); }, reason);
  expect_throw_with<CommError>([&] { comm->group_begin(); }, reason);
  expect_throw_with<CommError>([&] { (void)comm->gather_host(std::vector<std::uint8_t>{1, 2, 3}); }, reason);
  expect_throw_with<CommError>([&] { comm->synchronize(s, "after abort"); }, reason);
}

// A host function holds the stream until the test releases it: the wait outlives the watchdog's
// timeout, the watchdog aborts the communicator, and the wait throws the watchdog's message.
TEST_F(NcclWorldOfOneHost, WatchdogTurnsAStuckWaitIntoCommError) {
  // The 300 ms watchdog guards this communicator's init too, and a process's first NCCL init
  // (CUDA context, NCCL's one-time setup) took 0.5-1.0 s on the H100 when ctest ran this test
  // alone in its process. A first world, under the default timeout, pays that setup here.
  (void)world_of_one();
  const auto timeout = milliseconds(300);
  auto comm = world_of_one(timeout);
  k::Stream stream;
  std::atomic<bool> release{false};
  // Lets go by itself after 20 s, so a broken abort path fails the test instead of hanging it.
  auto hold = [](void* flag) {
    const auto give_up = std::chrono::steady_clock::now() + seconds(20);
    while (!static_cast<std::atomic<bool>*>(flag)->load() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(milliseconds(1));
  };
  ASSERT_EQ(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream.get()), hold, &release), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  expect_throw_with<CommError>([&] { comm->synchronize(stream.get(), "the held stream"); },
                               "rank 0: the held stream has not completed after");
  const auto waited = std::chrono::steady_clock::now() - start;
  release = true;
  stream.synchronize();
  EXPECT_GE(waited, timeout);
  EXPECT_LT(waited, seconds(30));
  EXPECT_TRUE(comm->aborted());
  expect_throw_with<CommError>([&] { (void)comm->gather_host(std::vector<std::uint8_t>{1}); }, "the held stream");
}

// ---------------------------------------------------------------------------------------
// Several processes
// ---------------------------------------------------------------------------------------
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  if (!ok) throw std::runtime_error("could not find a free port");
  return ntohs(addr.sin_port);
}

// Starts this binary again as `rank` of `world` (torchrun's variables, rendezvous on localhost),
// running only the child test in `role`. Everything is prepared before fork(); the child calls
// only execve.
pid_t start_rank(const std::string& role, int rank, int world, int port) {
  static const char* const kLauncherVariables[] = {
      "RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "MASTER_ADDR=", "MASTER_PORT=", "OMPI_COMM_WORLD_RANK=",
      "OMPI_COMM_WORLD_SIZE=", "OMPI_COMM_WORLD_LOCAL_RANK=", "PMI_RANK=", "PMI_SIZE=", "MPI_LOCALRANKID=",
      "SLURM_PROCID=", "SLURM_NTASKS=", "SLURM_LOCALID=", "TRAINSIM_NCCL_TEST_ROLE="};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const bool launcher = std::any_of(std::begin(kLauncherVariables), std::end(kLauncherVariables),
                                      [&](const char* prefix) { return entry.rfind(prefix, 0) == 0; });
    if (!launcher) env.push_back(entry);
  }
  env.push_back("RANK=" + std::to_string(rank));
  env.push_back("WORLD_SIZE=" + std::to_string(world));
  env.push_back("LOCAL_RANK=" + std::to_string(rank));
  env.push_back("MASTER_ADDR=127.0.0.1");
  env.push_back("MASTER_PORT=" + std::to_string(port));
  env.push_back(std::string(kRoleVariable) + "=" + role);
  if (std::getenv("NCCL_DEBUG") == nullptr) env.push_back("NCCL_DEBUG=WARN");  // NCCL's reasons, should a rank fail
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string name = "test_nccl_communicator", filter = std::string("--gtest_filter=") + kChildTest;
  char* argv[] = {name.data(), filter.data(), nullptr};

  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execve("/proc/self/exe", argv, envp.data());
    ::_exit(127);
  }
  if (pid < 0) throw std::runtime_error("fork failed");
  return pid;
}

// Waits for every child; kills those still running at the deadline. Returns one line per rank
// that did not exit with status 0.
std::vector<std::string> wait_for_ranks(const std::vector<pid_t>& pids, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<std::string> failures;
  std::vector<bool> done(pids.size(), false);
  for (std::size_t left = pids.size(); left > 0;) {
    for (std::size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids[r], &status, WNOHANG);
      if (got == 0) continue;
      done[r] = true;
      --left;
      if (got < 0)
        failures.push_back("rank " + std::to_string(r) + ": waitpid failed");
      else if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
        failures.push_back("rank " + std::to_string(r) + " exited with status " + std::to_string(WEXITSTATUS(status)));
      else if (WIFSIGNALED(status))
        failures.push_back("rank " + std::to_string(r) + " was killed by signal " + std::to_string(WTERMSIG(status)));
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (std::size_t r = 0; r < pids.size(); ++r)
        if (!done[r]) {
          ::kill(pids[r], SIGKILL);
          (void)::waitpid(pids[r], nullptr, 0);
          failures.push_back("rank " + std::to_string(r) + " still running after " + std::to_string(limit.count()) +
                             " s: killed");
        }
      break;
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
  return failures;
}

void run_ranks(const std::string& role, int world, std::chrono::seconds limit) {
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) pids.push_back(start_rank(role, r, world, port));
  for (const std::string& failure : wait_for_ranks(pids, limit)) ADD_FAILURE() << failure;
}

class NcclProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    skip_without_device();
    if (IsSkipped()) return;
    if (device_count() < 2) GTEST_SKIP() << "needs 2 GPUs: NCCL refuses two ranks on one device";
  }
};

TEST_F(NcclProcesses, AgreeWithAHostReference) { run_ranks("ranks", std::min(device_count(), 4), seconds(300)); }

TEST_F(NcclProcesses, APeerThatDiesBecomesCommErrorNotAHang) { run_ranks("peer_dies", 2, seconds(120)); }

// ---------------------------------------------------------------------------------------
// The children
// ---------------------------------------------------------------------------------------

// The member sets a world of n uses besides itself: neighbours and, from 3 ranks, the even and
// odd ranks (overlapping sets, so the splits take more than one layer).
std::vector<std::vector<int>> member_sets(int n) {
  std::vector<std::vector<int>> sets;
  if (n < 3) return sets;
  for (int i = 0; i + 1 < n; ++i) sets.push_back({i, i + 1});
  std::vector<int> even, odd;
  for (int i = 0; i < n; ++i) (i % 2 ? odd : even).push_back(i);
  sets.push_back(even);
  if (odd.size() > 1) sets.push_back(odd);
  return sets;
}

std::uint64_t fnv1a(const std::vector<float>& x) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(x.data());
  for (std::size_t i = 0; i < x.size() * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  return h;
}

// Checks `got`, the all-reduce of the contributions `x` (one per member, in dt) with case `c`,
// against the bounds in the header comment.
void expect_matches_reference(const std::vector<float>& got, const std::vector<std::vector<float>>& x, DType dt,
                              const Case& c, const std::string& label) {
  const int kk = static_cast<int>(x.size());
  const double u = unit_roundoff(dt), u32 = unit_roundoff(DType::fp32);
  const float inverse = round_to(dt, 1.0f / static_cast<float>(kk));
  std::size_t bad = 0;
  std::string first;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double want = 0, tolerance = 0;
    if (c.op == ReduceOp::sum) {
      double sum = 0, sum_abs = 0;
      for (const auto& xm : x) {
        const double contribution = c.divide == Divide::before ? round_to(dt, xm[i] * inverse) : xm[i];
        sum += contribution;
        sum_abs += std::fabs(contribution);
      }
      want = sum;
      tolerance = (kk - 1) * u * sum_abs;
      if (c.divide == Divide::after) {
        want = sum / kk;
        tolerance = tolerance / kk + (u + 2 * u32) * std::fabs(sum) / kk;
      }
    } else {
      double largest = -INFINITY;
      for (const auto& xm : x) largest = std::max(largest, static_cast<double>(xm[i]));
      want = largest;
      if (c.divide == Divide::before) {
        want = largest * inverse;
        tolerance = u * std::fabs(want);
      }
    }
    if (!(std::fabs(got[i] - want) <= tolerance) && bad++ == 0)
      first = "element " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " + std::to_string(want) +
              " (tolerance " + std::to_string(tolerance) + ")";
  }
  EXPECT_EQ(bad, 0u) << label << ", members of " << kk << ", " << dtype_name(dt) << ", " << got.size()
                     << " elements, " << c.name << ": " << first;
}

// Checks an all-reduce over `members` of every format, size and case; returns the hashes of the
// results (for the cross-rank comparison).
std::vector<std::uint64_t> check_all_reduce(NcclCommunicator& comm, const std::vector<int>& members, StreamHandle stream) {
  std::vector<std::uint64_t> hashes;
  const auto mine = static_cast<std::size_t>(std::find(members.begin(), members.end(), comm.rank()) - members.begin());
  for (DType dt : kFormats) {
    for (std::size_t count : {std::size_t{1}, std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
      for (int ci = 0; ci < static_cast<int>(std::size(kCases)); ++ci) {
        const Case& c = kCases[ci];
        std::vector<std::vector<float>> x;
        for (int m : members) x.push_back(random_values(count, seed_of(dt, count, m, 10 + ci), dt));
        k::DeviceBuffer buffer = upload(x[mine], dt, stream);
        comm.all_reduce(buffer.data(), count, dt, members, 100 + static_cast<std::uint64_t>(ci), c.op, c.divide,
                        stream);
        comm.synchronize(stream, "all_reduce check");
        const std::vector<float> got = download(buffer, count, dt, stream);
        hashes.push_back(fnv1a(got));
        expect_matches_reference(got, x, dt, c, "rank " + std::to_string(comm.rank()));
      }
    }
  }
  return hashes;
}

std::vector<std::uint8_t> bytes_of(const std::vector<std::uint64_t>& v) {
  std::vector<std::uint8_t> out(v.size() * sizeof(std::uint64_t));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

void run_ranks_role() {
  const LaunchEnv env = launch_env_from();
  const int n = env.world_size, me = env.rank;
  const auto sets = member_sets(n);
  // Both directions between ranks 0 and 1 on communicators of their own, as the executor's
  // pipeline links; every other pair on the world communicator.
  auto comm = NcclCommunicator::create(env, sets, seconds(120), {{0, 1}, {1, 0}});
  EXPECT_NE(comm->describe().find("rank " + std::to_string(me) + " of " + std::to_string(n)), std::string::npos)
      << comm->describe();
  k::Stream stream;
  StreamHandle s = stream.get();

  // All-reduce over the world: against the host, and identical on every rank.
  std::vector<int> everyone(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) everyone[static_cast<std::size_t>(r)] = r;
  const std::vector<std::uint64_t> hashes = check_all_reduce(*comm, everyone, s);
  const auto all_hashes = comm->gather_host(bytes_of(hashes));
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(all_hashes[static_cast<std::size_t>(r)], bytes_of(hashes)) << "rank " << r << "'s results differ";
  // Over the split communicators, then one that does not exist.
  for (const auto& members : sets)
    if (std::binary_search(members.begin(), members.end(), me)) (void)check_all_reduce(*comm, members, s);
  // The world without one other rank, when that set was not declared (from 4 ranks on).
  for (int left_out = 0; left_out < n && n >= 3; ++left_out) {
    if (left_out == me) continue;
    std::vector<int> unknown;
    for (int r = 0; r < n; ++r)
      if (r != left_out) unknown.push_back(r);
    if (std::find(sets.begin(), sets.end(), unknown) != sets.end()) continue;
    k::DeviceBuffer buffer(16 * sizeof(float));
    expect_throw_with<std::invalid_argument>(
        [&] { comm->all_reduce(buffer.data(), 16, DType::fp32, unknown, 1, ReduceOp::sum, Divide::none, s); },
        "no communicator for members");
    break;
  }

  // Inside a group, next to a send/recv ring: the divide after the sum is queued after the group.
  {
    const DType dt = DType::bf16;
    const std::size_t count = 4099;
    const Case& c = kCases[2];  // sum, divide after
    std::vector<std::vector<float>> x;
    for (int r = 0; r < n; ++r) x.push_back(random_values(count, seed_of(dt, count, r, 40), dt));
    k::DeviceBuffer buffer = upload(x[static_cast<std::size_t>(me)], dt, s);
    k::DeviceBuffer out = upload(x[static_cast<std::size_t>(me)], dt, s), in(count * 2);
    comm->group_begin();
    comm->all_reduce(buffer.data(), count, dt, everyone, 41, c.op, c.divide, s);
    comm->send((me + 1) % n, 42, out.data(), count, dt, s);
    comm->recv((me + n - 1) % n, 42, in.data(), count, dt, s);
    comm->group_end();
    comm->synchronize(s, "grouped all_reduce");
    expect_matches_reference(download(buffer, count, dt, s), x, dt, c, "grouped, rank " + std::to_string(me));
    expect_identical(download(in, count, dt, s), x[static_cast<std::size_t>((me + n - 1) % n)], "grouped ring");
  }

  // A ring of sends and receives inside a group, then one pair standing alone (0 -> 1).
  for (DType dt : {DType::fp32, DType::bf16}) {
    for (std::size_t count : {std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
      const int next = (me + 1) % n, prev = (me + n - 1) % n;
      k::DeviceBuffer out = upload(random_values(count, seed_of(dt, count, me, 50), dt), dt, s);
      k::DeviceBuffer in = upload(random_values(count, seed_of(dt, count, me, 51), dt), dt, s);
      comm->group_begin();
      comm->send(next, 5, out.data(), count, dt, s);
      comm->recv(prev, 5, in.data(), count, dt, s);
      comm->group_end();
      comm->synchronize(s, "ring");
      expect_identical(download(in, count, dt, s), random_values(count, seed_of(dt, count, prev, 50), dt),
                       "ring from rank " + std::to_string(prev));
    }
  }
  const std::size_t pair_count = 12345;
  if (me == 0) {
    k::DeviceBuffer out = upload(random_values(pair_count, seed_of(DType::fp32, pair_count, 0, 60), DType::fp32),
                                 DType::fp32, s);
    comm->send(1, 6, out.data(), pair_count, DType::fp32, s);
    comm->synchronize(s, "pair send");
  } else if (me == 1) {
    k::DeviceBuffer in(pair_count * sizeof(float));
    comm->recv(0, 6, in.data(), pair_count, DType::fp32, s);
    comm->synchronize(s, "pair recv");
    expect_identical(download(in, pair_count, DType::fp32, s),
                     random_values(pair_count, seed_of(DType::fp32, pair_count, 0, 60), DType::fp32), "pair");
  }

  // A pipeline's exchange, ungrouped, as one-forward-one-backward issues it: rank 0 sends an
  // activation and then receives a gradient, rank 1 sends its gradient first. Each send is larger
  // than NCCL's buffers, so it completes only when the peer's receive runs: over one communicator
  // per pair (issue order) this deadlocks; over a communicator per direction it must complete.
  {
    const std::size_t big = std::size_t{16} << 20;  // 64 MiB of fp32
    const int other = 1 - me;
    if (me <= 1) {
      k::Stream sends;  // the executor's send stream; receives on the compute stream `s`
      k::DeviceBuffer out = upload(random_values(big, seed_of(DType::fp32, big, me, 70), DType::fp32), DType::fp32, s);
      k::DeviceBuffer in(big * sizeof(float));
      comm->synchronize(s, "pipeline upload");
      comm->send(other, 7, out.data(), big, DType::fp32, sends.get());
      comm->recv(other, 8, in.data(), big, DType::fp32, s);
      comm->synchronize(sends.get(), "pipeline send");
      comm->synchronize(s, "pipeline recv");
      expect_identical(download(in, big, DType::fp32, s),
                       random_values(big, seed_of(DType::fp32, big, other, 70), DType::fp32), "pipeline exchange");
    }
  }

  // gather_host: sizes differ by rank, rank 0's is empty the second time.
  for (int round = 0; round < 2; ++round) {
    auto blob_of = [&](int r) {
      const std::size_t size = round == 1 && r == 0 ? 0 : 5 + 11 * static_cast<std::size_t>(r);
      std::vector<std::uint8_t> blob(size);
      for (std::size_t i = 0; i < size; ++i) blob[i] = static_cast<std::uint8_t>(1 + (r * 31 + i * 7 + round) % 255);
      return blob;
    };
    const auto all = comm->gather_host(blob_of(me));
    ASSERT_EQ(all.size(), static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)], blob_of(r)) << "round " << round;
  }
}

// Rank 1 leaves without a word after one successful exchange; rank 0's next gather_host must
// end in CommError (NCCL's asynchronous error or the watchdog's timeout), not wait forever.
// Rank 1 lingers a moment first: its exchange can finish before rank 0's has (rank 0 may still be
// copying what rank 1 sent), and that one must succeed.
void run_peer_dies_role() {
  const LaunchEnv env = launch_env_from();
  // Long enough for the rendezvous and NCCL's initialisation, which it also bounds.
  const auto timeout = seconds(20);
  auto comm = NcclCommunicator::create(env, {}, timeout);
  (void)comm->gather_host(std::vector<std::uint8_t>{static_cast<std::uint8_t>(env.rank + 1)});
  if (env.rank != 0) {
    std::this_thread::sleep_for(seconds(2));
    std::_Exit(0);
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)comm->gather_host(std::vector<std::uint8_t>{1, 2, 3});
    ADD_FAILURE() << "gather_host with a dead peer returned";
  } catch (const CommError& e) {
    std::printf("rank 0 saw, as expected: %s\n", e.what());
    EXPECT_NE(std::string(e.what()).find("rank 0: gather_host"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, timeout + seconds(20));
  EXPECT_TRUE(comm->aborted());
}

TEST(NcclCommunicatorChild, RunsTheRoleItWasStartedFor) {
  const char* role = std::getenv(kRoleVariable);
  if (role == nullptr) GTEST_SKIP() << "runs only in the processes NcclProcesses tests start";
  std::string why;
  ASSERT_TRUE(k::device_available(&why)) << why;
  if (std::string(role) == "ranks")
    run_ranks_role();
  else if (std::string(role) == "peer_dies")
    run_peer_dies_role();
  else
    FAIL() << "unknown role " << role;
}

}  // namespace
}  // namespace trainsim::runtime::cuda
