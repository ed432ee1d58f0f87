// Multi-process launch (runtime/launch/): the launcher variables of torchrun, mpirun (Open MPI,
// MPICH) and srun through an injected environment, with every error; rank 0's blob over TCP
// on 127.0.0.1 with ranks as threads, including late starters, duplicates and ranks that never
// come; the watchdog that reports a stuck operation once and shuts down at once.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/launch/launch_env.h"
#include "runtime/launch/rendezvous.h"
#include "runtime/launch/watchdog.h"

namespace trainsim::runtime {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Vars = std::map<std::string, std::string>;

void expect_contains(const std::string& text, std::initializer_list<std::string> parts) {
  for (const auto& p : parts) EXPECT_NE(text.find(p), std::string::npos) << "missing '" << p << "' in: " << text;
}

// ---------------------------------------------------------------------------------------
// Launch environment
// ---------------------------------------------------------------------------------------

LaunchEnv parse(const Vars& vars) {
  return launch_env_from([&](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string parse_error(const Vars& vars) {
  try {
    parse(vars);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return {};
}

const Vars kMaster = {{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"}};

Vars with_master(Vars v) {
  v.insert(kMaster.begin(), kMaster.end());
  return v;
}

void expect_env(const LaunchEnv& e, int rank, int world, int local, const std::string& source) {
  EXPECT_EQ(e.rank, rank);
  EXPECT_EQ(e.world_size, world);
  EXPECT_EQ(e.local_rank, local);
  EXPECT_EQ(e.source, source);
}

TEST(LaunchEnv, Torchrun) {
  const auto e = parse(with_master({{"RANK", "11"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "3"}}));
  expect_env(e, 11, 16, 3, "torchrun");
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29400);
}

TEST(LaunchEnv, MpirunOpenMpi) {
  const auto e = parse(with_master(
      {{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  expect_env(e, 5, 8, 1, "mpirun (Open MPI)");
  EXPECT_EQ(e.master_addr, "node0");
}

TEST(LaunchEnv, MpirunMpich) {
  const auto e = parse(with_master({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}}));
  expect_env(e, 2, 4, 0, "mpirun (MPICH)");
}

TEST(LaunchEnv, Srun) {
  const auto e = parse(with_master({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "3"},
                                    {"SLURM_JOB_NODELIST", "gpu[01-02]"}}));
  expect_env(e, 7, 8, 3, "srun");
  EXPECT_EQ(e.master_port, 29400);
}

TEST(LaunchEnv, NothingSetIsOneProcessAlone) {
  const auto e = parse({});
  expect_env(e, 0, 1, 0, "single process");
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  // A world of one needs no rendezvous point, but one that is given is still used and checked.
  EXPECT_EQ(parse({{"MASTER_PORT", "1234"}}).master_port, 1234);
  expect_contains(parse_error({{"MASTER_PORT", "0"}}), {"MASTER_PORT=0", "1..65535", "single process"});
  // An explicit world of one without MASTER_*: the same defaults.
  const auto one = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}});
  expect_env(one, 0, 1, 0, "torchrun");
  EXPECT_EQ(one.master_addr, "127.0.0.1");
}

// The innermost launcher names the process; Slurm's variables describe the srun task.
TEST(LaunchEnv, InnerLauncherWinsOverSlurm) {
  // srun torchrun --nproc-per-node=8: one srun task per node, torchrun's ranks inside.
  expect_env(parse(with_master({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"RANK", "9"},
                                {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}})),
             9, 16, 1, "torchrun");
  // mpirun inside sbatch: the batch step's SLURM_PROCID is 0 for every process.
  expect_env(parse(with_master({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_RANK", "3"},
                                {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}})),
             3, 4, 3, "mpirun (Open MPI)");
  // srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but not Hydra's MPI_LOCALRANKID: they are srun's.
  expect_env(parse(with_master({{"PMI_RANK", "5"}, {"PMI_SIZE", "8"}, {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"},
                                {"SLURM_LOCALID", "1"}})),
             5, 8, 1, "srun");
  // Launchers that agree are fine; the first in precedence names the source.
  expect_env(parse(with_master({{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_RANK", "2"},
                                {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}})),
             2, 4, 0, "torchrun");
}

TEST(LaunchEnv, MissingVariablesNameThemAndTheLauncher) {
  expect_contains(parse_error(with_master({{"RANK", "1"}})),
                  {"torchrun detected: RANK set", "WORLD_SIZE, LOCAL_RANK are not set"});
  expect_contains(parse_error(with_master({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}})),
                  {"mpirun (Open MPI) detected", "OMPI_COMM_WORLD_LOCAL_RANK is not set"});
  expect_contains(parse_error(with_master({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}})),
                  {"mpirun (MPICH) detected", "MPI_LOCALRANKID is not set"});
  expect_contains(parse_error({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}}),
                  {"MASTER_ADDR and MASTER_PORT are not set", "srun detected", "world size 2", "SLURM_JOB_NODELIST"});
  expect_contains(parse_error({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"MASTER_ADDR", "node0"}}),
                  {"MASTER_PORT is not set", "mpirun (Open MPI) detected"});
  expect_contains(parse_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "29500"}}),
                  {"MASTER_ADDR is not set", "torchrun detected"});
  expect_contains(parse_error({{"MASTER_ADDR", ""}}), {"MASTER_ADDR is empty"});
}

TEST(LaunchEnv, NonNumericValues) {
  const Vars base = with_master({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}});
  for (const std::string bad : {"two", "3x", "", " 3", "1.0", "+1"}) {
    Vars v = base;
    v["RANK"] = bad;
    expect_contains(parse_error(v), {"RANK='" + bad + "' is not an integer", "torchrun detected"});
  }
  Vars big = base;
  big["WORLD_SIZE"] = "99999999999";
  expect_contains(parse_error(big), {"WORLD_SIZE='99999999999' is out of range"});
  Vars port = base;
  port["MASTER_PORT"] = "http";
  expect_contains(parse_error(port), {"MASTER_PORT='http' is not an integer"});
}

TEST(LaunchEnv, ValuesOutOfRange) {
  auto torchrun = [](const char* rank, const char* world, const char* local) {
    return with_master({{"RANK", rank}, {"WORLD_SIZE", world}, {"LOCAL_RANK", local}});
  };
  expect_contains(parse_error(torchrun("4", "4", "0")), {"RANK=4 is outside [0, WORLD_SIZE=4)"});
  expect_contains(parse_error(torchrun("-1", "4", "0")), {"RANK=-1 is outside [0, WORLD_SIZE=4)"});
  expect_contains(parse_error(torchrun("0", "0", "0")), {"WORLD_SIZE=0 must be at least 1"});
  expect_contains(parse_error(torchrun("1", "4", "-1")), {"LOCAL_RANK=-1 is outside [0, WORLD_SIZE=4)"});
  expect_contains(parse_error({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}),
                  {"SLURM_PROCID=2 is outside [0, SLURM_NTASKS=2)", "srun detected"});
  for (const char* port : {"0", "65536", "-5"}) {
    Vars v = torchrun("0", "2", "0");
    v["MASTER_PORT"] = port;
    expect_contains(parse_error(v), {std::string("MASTER_PORT=") + port + " is outside 1..65535"});
  }
  Vars ok = torchrun("0", "2", "0");
  ok["MASTER_PORT"] = "65535";
  EXPECT_EQ(parse(ok).master_port, 65535);
}

TEST(LaunchEnv, ConflictingSources) {
  expect_contains(parse_error(with_master({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                           {"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}})),
                  {"conflicting launcher variables", "RANK=1 (torchrun)",
                   "OMPI_COMM_WORLD_RANK=2 (mpirun (Open MPI))", "rank"});
  expect_contains(parse_error(with_master({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"PMI_RANK", "1"},
                                           {"PMI_SIZE", "8"}, {"MPI_LOCALRANKID", "1"}})),
                  {"conflicting launcher variables", "OMPI_COMM_WORLD_SIZE=4", "PMI_SIZE=8", "world size"});
}

TEST(LaunchEnv, OneLineSummary) {
  EXPECT_EQ(to_string(parse(with_master({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}}))),
            "rank 3 of 8 (local rank 3) via torchrun, rendezvous at node0:29400");
}

// ---------------------------------------------------------------------------------------
// Rendezvous: ranks as threads on 127.0.0.1
// ---------------------------------------------------------------------------------------

// A port nobody listens on right now: bind port 0, read what the kernel chose, close.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

LaunchEnv local_env(int rank, int world, int port) {
  LaunchEnv e;
  e.rank = rank;
  e.world_size = world;
  e.local_rank = rank;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  e.source = "torchrun";
  return e;
}

struct Outcome {
  std::optional<std::vector<std::uint8_t>> blob;
  std::string error;
  Clock::duration elapsed{};
};

struct Participant {
  LaunchEnv env;
  std::chrono::milliseconds start_delay{0};
};

// Runs each participant's broadcast_from_rank0 on its own thread; rank 0 passes `blob`, the
// others a different blob that must not travel.
std::vector<Outcome> run_participants(const std::vector<Participant>& ps, const std::vector<std::uint8_t>& blob,
                                      std::chrono::milliseconds timeout) {
  std::vector<Outcome> out(ps.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ps.size(); ++i)
    threads.emplace_back([&, i] {
      std::this_thread::sleep_for(ps[i].start_delay);
      const std::vector<std::uint8_t> wrong(7, 0xEE);
      const auto t0 = Clock::now();
      try {
        out[i].blob = broadcast_from_rank0(ps[i].env, ps[i].env.rank == 0 ? blob : wrong, timeout);
      } catch (const RendezvousError& e) {
        out[i].error = e.what();
      }
      out[i].elapsed = Clock::now() - t0;
    });
  for (auto& t : threads) t.join();
  return out;
}

std::vector<std::uint8_t> random_blob(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::uint8_t> b(n);
  for (auto& x : b) x = static_cast<std::uint8_t>(byte(gen));
  return b;
}

TEST(Rendezvous, WorldOfOneNeedsNoNetwork) {
  const auto blob = random_blob(128, 1);
  // Port 1 cannot be listened on without privileges: no socket is opened at all.
  EXPECT_EQ(broadcast_from_rank0(local_env(0, 1, 1), blob, 100ms), blob);
}

TEST(Rendezvous, BlobArrivesIdenticalOnEveryRank) {
  for (int world : {2, 5}) {
    const auto blob = random_blob(128, 100 + static_cast<std::uint32_t>(world));
    const int port = free_port();
    std::vector<Participant> ps;
    for (int r = 0; r < world; ++r) ps.push_back({local_env(r, world, port)});
    const auto out = run_participants(ps, blob, 10s);
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("world " + std::to_string(world) + ", rank " + std::to_string(r));
      EXPECT_EQ(out[static_cast<std::size_t>(r)].error, "");
      ASSERT_TRUE(out[static_cast<std::size_t>(r)].blob);
      EXPECT_EQ(*out[static_cast<std::size_t>(r)].blob, blob);
    }
  }
}

TEST(Rendezvous, OtherRanksRetryUntilRankZeroStarts) {
  const auto blob = random_blob(128, 7);
  const int port = free_port();
  const auto out = run_participants(
      {{local_env(1, 3, port)}, {local_env(2, 3, port)}, {local_env(0, 3, port), 200ms}}, blob, 10s);
  for (const auto& o : out) {
    EXPECT_EQ(o.error, "");
    ASSERT_TRUE(o.blob);
    EXPECT_EQ(*o.blob, blob);
  }
}

TEST(Rendezvous, DuplicateRankIsRefused) {
  const int port = free_port();
  // World of 3 with rank 2 absent, so rank 0 cannot finish before both rank-1s have come.
  const auto out = run_participants({{local_env(0, 3, port)}, {local_env(1, 3, port)}, {local_env(1, 3, port)}},
                                    random_blob(128, 3), 5s);
  expect_contains(out[0].error, {"rank 0 of 3", "duplicate rank 1", "connected from 127.0.0.1:",
                                 "two processes were given the same rank"});
  EXPECT_LT(out[0].elapsed, 4s);  // at once, not at the timeout
  for (std::size_t i : {1u, 2u}) {
    // Both rank-1 processes learn rank 0's reason instead of waiting for their own timeout.
    expect_contains(out[i].error, {"rank 1 of 3", "rank 0 (127.0.0.1:" + std::to_string(port) +
                                                      ") failed the rendezvous", "duplicate rank 1"});
    EXPECT_LT(out[i].elapsed, 4s);
  }
}

TEST(Rendezvous, MissingRanksFailRankZeroWithinTheTimeout) {
  const int port = free_port();
  const auto out =
      run_participants({{local_env(0, 4, port)}, {local_env(1, 4, port)}}, random_blob(128, 4), 300ms);
  expect_contains(out[0].error, {"rank 0 of 4", "ranks 2, 3 did not connect within 300 ms",
                                 "1 of 3 other ranks arrived"});
  EXPECT_GE(out[0].elapsed, 300ms);
  EXPECT_LT(out[0].elapsed, 2s);
  expect_contains(out[1].error, {"rank 1 of 4", "failed the rendezvous", "ranks 2, 3 did not connect"});
  EXPECT_LT(out[1].elapsed, 2s);
}

TEST(Rendezvous, NoRankZeroFailsWithinTheTimeout) {
  const int port = free_port();
  const auto out = run_participants({{local_env(1, 2, port)}}, {}, 300ms);
  expect_contains(out[0].error, {"rank 1 of 2", "127.0.0.1:" + std::to_string(port),
                                 "could not connect to rank 0 within 300 ms", "Connection refused"});
  EXPECT_LT(out[0].elapsed, 2s);
}

TEST(Rendezvous, WorldSizeMismatchIsRefused) {
  const int port = free_port();
  const auto out =
      run_participants({{local_env(0, 2, port)}, {local_env(1, 3, port)}}, random_blob(128, 5), 5s);
  expect_contains(out[0].error, {"rank 1 (127.0.0.1:", "reports world size 3 but rank 0 has world size 2"});
  expect_contains(out[1].error, {"rank 1 of 3", "failed the rendezvous", "reports world size 3"});
  EXPECT_LT(out[0].elapsed, 4s);
}

TEST(Rendezvous, PeerClosingEarlyIsNamed) {
  const int port = free_port();
  std::string error;
  std::thread root([&] {
    try {
      broadcast_from_rank0(local_env(0, 2, port), random_blob(128, 6), 5s);
    } catch (const RendezvousError& e) {
      error = e.what();
    }
  });
  // A client that sends half a greeting and hangs up; retries until rank 0 listens.
  bool sent = false;
  for (int attempt = 0; attempt < 200 && !sent; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      sent = ::send(fd, "TSRV\x01", 5, MSG_NOSIGNAL) == 5;
    } else {
      std::this_thread::sleep_for(10ms);
    }
    ::close(fd);
  }
  root.join();
  ASSERT_TRUE(sent);
  expect_contains(error, {"rank 0 of 2", "the peer at 127.0.0.1:", "closed the connection before sending its rank",
                          "5 of 16 bytes"});
}

TEST(Rendezvous, BadArgumentsAreRejectedBeforeTheNetwork) {
  const std::vector<std::uint8_t> blob(4, 1);
  EXPECT_THROW(broadcast_from_rank0(local_env(0, 2, 29500), blob, 0ms), std::invalid_argument);
  EXPECT_THROW(broadcast_from_rank0(local_env(2, 2, 29500), blob, 100ms), std::invalid_argument);
  EXPECT_THROW(broadcast_from_rank0(local_env(0, 2, 0), blob, 100ms), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------------------

// Collects on_timeout calls; wait_for_call waits (bounded) for the first.
struct Reports {
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::string> messages;

  Watchdog::TimeoutHandler handler() {
    return [this](const std::string& msg) {
      {
        std::lock_guard lock(m);
        messages.push_back(msg);
      }
      cv.notify_all();
    };
  }
  bool wait_for_call(std::chrono::milliseconds limit) {
    std::unique_lock lock(m);
    return cv.wait_for(lock, limit, [&] { return !messages.empty(); });
  }
  std::size_t count() {
    std::lock_guard lock(m);
    return messages.size();
  }
};

TEST(Watchdog, StuckOperationIsReportedOnceWithRankAndOp) {
  Reports reports;
  Watchdog dog(3, 100ms, reports.handler());
  const auto t0 = Clock::now();
  const auto stuck = dog.begin("all_reduce(tag 7, 4096 floats)");
  const auto also_open = dog.begin("send(to rank 2, tag 9)");
  ASSERT_TRUE(reports.wait_for_call(3s));
  EXPECT_GE(Clock::now() - t0, 100ms);  // never before the timeout
  EXPECT_TRUE(dog.fired());
  // Still stuck, and a new operation that also overruns: no second report.
  const auto later = dog.begin("recv(from rank 1, tag 9)");
  std::this_thread::sleep_for(250ms);
  EXPECT_EQ(reports.count(), 1u);
  const std::string msg = reports.messages.at(0);
  expect_contains(msg, {"rank 3: all_reduce(tag 7, 4096 floats) has not completed after ", " s (started at ", "Z)",
                        "1 other operation(s) open, the oldest send(to rank 2, tag 9)"});
  EXPECT_EQ(msg.rfind("rank 3: all_reduce", 0), 0u);
  EXPECT_TRUE(dog.end(stuck));
  EXPECT_TRUE(dog.end(also_open));
  EXPECT_TRUE(dog.end(later));
}

TEST(Watchdog, OperationsThatEndInTimeAreNotReported) {
  Reports reports;
  Watchdog dog(0, 400ms, reports.handler());
  // Many short operations from several threads at once.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        auto g = dog.guard("op " + std::to_string(t) + "." + std::to_string(i));
        std::this_thread::sleep_for(1ms);
      }
    });
  for (auto& t : threads) t.join();
  // One longer operation, well inside the timeout; then wait past where it would have fired.
  const auto t0 = Clock::now();
  const auto token = dog.begin("long all_reduce");
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(dog.end(token));
  std::this_thread::sleep_until(t0 + 600ms);
  EXPECT_FALSE(dog.fired());
  EXPECT_EQ(reports.count(), 0u);
  EXPECT_EQ(dog.open_operations(), 0u);
}

TEST(Watchdog, ShutsDownPromptlyWhateverTheTimeout) {
  Reports reports;
  const auto t0 = Clock::now();
  {
    Watchdog idle(0, std::chrono::hours(1), reports.handler());
  }
  {
    Watchdog busy(0, std::chrono::hours(1), reports.handler());
    const auto token = busy.begin("all_reduce that never ends");
    (void)token;
    std::this_thread::sleep_for(20ms);  // let the thread go to sleep on its deadline
  }
  EXPECT_LT(Clock::now() - t0, 1s);
  EXPECT_EQ(reports.count(), 0u);
}

TEST(Watchdog, GuardsAndTokens) {
  Reports reports;
  Watchdog dog(1, std::chrono::hours(1), reports.handler());
  {
    auto a = dog.guard("a");
    std::vector<Watchdog::Guard> moved;
    moved.push_back(dog.guard("b"));
    moved.push_back(std::move(a));  // a moved-from guard ends nothing
    EXPECT_EQ(dog.open_operations(), 2u);
  }
  EXPECT_EQ(dog.open_operations(), 0u);
  const auto t = dog.begin("c");
  EXPECT_NE(t, 0u);
  EXPECT_TRUE(dog.end(t));
  EXPECT_FALSE(dog.end(t));       // already ended
  EXPECT_FALSE(dog.end(t + 100));  // never begun
}

TEST(Watchdog, HandlerMayThrowOrCallBack) {
  std::atomic<int> calls{0};
  std::atomic<bool> done{false};
  std::atomic<Watchdog*> self{nullptr};
  Watchdog dog(2, 50ms, [&](const std::string&) {
    ++calls;
    Watchdog* dog_ = self.load();
    const auto t = dog_->begin("from the handler");  // no lock is held during the call
    dog_->end(t);
    done = true;
    throw std::runtime_error("dropped");
  });
  self = &dog;
  auto g = dog.guard("stuck");
  for (int i = 0; i < 300 && !done; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(done);
  EXPECT_EQ(calls, 1);
}

TEST(Watchdog, RejectsBadArguments) {
  EXPECT_THROW(Watchdog(0, 0ms, [](const std::string&) {}), std::invalid_argument);
  EXPECT_THROW(Watchdog(0, 1s, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace trainsim::runtime
