#include "runtime/launch/rendezvous.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>

namespace trainsim::runtime {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::uint8_t kMagic[4] = {'T', 'S', 'R', 'V'};
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHelloBytes = 16;  // magic, version, rank, world size
constexpr std::uint8_t kStatusOk = 0;
constexpr std::uint8_t kStatusError = 1;
constexpr std::uint8_t kAck = 0x06;
constexpr std::uint64_t kMaxBlobBytes = std::uint64_t{1} << 30;
constexpr std::uint32_t kMaxMessageBytes = 1u << 16;

// After the common deadline, the time still given to the exchange that follows it: rank 0's
// verdict reaching a connected rank, the blob and its acknowledgements (rendezvous.h).
milliseconds grace(milliseconds timeout) { return std::clamp(timeout / 4, milliseconds(1), milliseconds(1000)); }

std::string errno_text(int e) { return std::generic_category().message(e); }

// A socket that closes itself.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Milliseconds left until `deadline`, rounded up, never negative: a poll timeout.
int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

std::string host_port(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::string sockaddr_text(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {};
  char serv[NI_MAXSERV] = {};
  if (::getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "<unknown address>";
  return host_port(host, std::atoi(serv));
}

struct AddrInfoFree {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using AddrList = std::unique_ptr<addrinfo, AddrInfoFree>;

// getaddrinfo for a TCP stream; returns the gai error code in `err` (0 on success).
AddrList resolve(const LaunchEnv& env, bool passive, int& err) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* list = nullptr;
  const std::string port = std::to_string(env.master_port);
  err = ::getaddrinfo(env.master_addr.c_str(), port.c_str(), &hints, &list);
  return AddrList(err == 0 ? list : nullptr);
}

enum class Io { ok, timeout, closed, error };

// Waits until fd is ready for `events` (poll), or returns Io::timeout at the deadline.
Io wait_ready(int fd, short events, Clock::time_point deadline, int& err) {
  pollfd pfd{fd, events, 0};
  const int ms = remaining_ms(deadline);
  if (ms == 0) return Io::timeout;
  if (::poll(&pfd, 1, ms) < 0 && errno != EINTR) {
    err = errno;
    return Io::error;
  }
  return Io::ok;
}

// Reads exactly n bytes before `deadline`. On Io::error, `err` holds errno.
Io read_exact(int fd, std::uint8_t* p, std::size_t n, Clock::time_point deadline, int& err) {
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got > 0) {
      p += got;
      n -= static_cast<std::size_t>(got);
      continue;
    }
    if (got == 0) return Io::closed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      err = errno;
      return err == ECONNRESET ? Io::closed : Io::error;
    }
    if (const Io w = wait_ready(fd, POLLIN, deadline, err); w != Io::ok) return w;
  }
  return Io::ok;
}

// Writes all n bytes before `deadline` (no SIGPIPE). On Io::error, `err` holds errno.
Io write_all(int fd, const std::uint8_t* p, std::size_t n, Clock::time_point deadline, int& err) {
  while (n > 0) {
    const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put > 0) {
      p += put;
      n -= static_cast<std::size_t>(put);
      continue;
    }
    if (put < 0 && errno == EINTR) continue;
    if (put < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      err = errno;
      return (err == EPIPE || err == ECONNRESET) ? Io::closed : Io::error;
    }
    if (const Io w = wait_ready(fd, POLLOUT, deadline, err); w != Io::ok) return w;
  }
  return Io::ok;
}

void put_u32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<std::uint8_t>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
std::uint64_t get_u64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  const std::size_t shown = std::min<std::size_t>(ranks.size(), 16);
  for (std::size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (shown < ranks.size()) s += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return s;
}

std::string plural_ranks(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

// ---------------------------------------------------------------------------------------
// Rank 0
// ---------------------------------------------------------------------------------------

class Root {
 public:
  Root(const LaunchEnv& env, milliseconds timeout, Clock::time_point deadline)
      : env_(env), timeout_(timeout), deadline_(deadline), peers_(static_cast<std::size_t>(env.world_size)) {
    prefix_ = "rank 0 of " + std::to_string(env.world_size) + " (rendezvous at " +
              host_port(env.master_addr, env.master_port) + "): ";
  }

  std::vector<std::uint8_t> run(std::span<const std::uint8_t> blob) {
    listen();
    gather_hellos();
    deadline_ = std::max(deadline_, Clock::now() + grace(timeout_));
    send_blob(blob);
    collect_acks();
    return {blob.begin(), blob.end()};
  }

 private:
  struct Conn {
    Fd fd;
    std::string addr;
    std::vector<std::uint8_t> hello;
    bool acked = false;
  };

  [[noreturn]] void fail(const std::string& what) {
    const std::string msg = prefix_ + what;
    // Tell every connected rank why, so it fails now with this reason. Best effort, never
    // blocking: the frame is small and lands in the socket's send buffer.
    std::vector<std::uint8_t> frame{kStatusError};
    const std::uint32_t n = static_cast<std::uint32_t>(std::min<std::size_t>(msg.size(), kMaxMessageBytes));
    put_u32(frame, n);
    frame.insert(frame.end(), msg.begin(), msg.begin() + n);
    auto tell = [&](Conn& c) {
      if (!c.fd) return;
      (void)::send(c.fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::shutdown(c.fd.get(), SHUT_WR);
    };
    for (auto& c : pending_) tell(c);
    for (auto& p : peers_)
      if (p) tell(*p);
    throw RendezvousError(msg);
  }

  std::string ms_text() const { return std::to_string(timeout_.count()) + " ms"; }

  std::string peer_text(int rank) const {
    return "rank " + std::to_string(rank) + " (" + peers_[static_cast<std::size_t>(rank)]->addr + ")";
  }

  void listen() {
    int gai = 0;
    AddrList list = resolve(env_, true, gai);
    if (gai != 0)
      fail("cannot resolve MASTER_ADDR '" + env_.master_addr + "': " + ::gai_strerror(gai));
    std::string last_error = "no address";
    for (addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
      Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (!fd) {
        last_error = "socket: " + errno_text(errno);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
        last_error = "bind " + sockaddr_text(ai->ai_addr, ai->ai_addrlen) + ": " + errno_text(errno);
        continue;
      }
      if (::listen(fd.get(), std::max(16, env_.world_size)) != 0) {
        last_error = "listen: " + errno_text(errno);
        continue;
      }
      set_nonblocking(fd.get());
      listener_ = std::move(fd);
      return;
    }
    fail("cannot listen on MASTER_ADDR:MASTER_PORT (" + last_error +
         "); MASTER_ADDR must be an address of rank 0's host and MASTER_PORT a free port");
  }

  std::vector<int> missing_ranks() const {
    std::vector<int> missing;
    for (int r = 1; r < env_.world_size; ++r)
      if (!peers_[static_cast<std::size_t>(r)]) missing.push_back(r);
    return missing;
  }

  void gather_hellos() {
    int arrived = 0;
    while (arrived < env_.world_size - 1) {
      std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}};
      for (const auto& c : pending_) fds.push_back({c.fd.get(), POLLIN, 0});
      const int ms = remaining_ms(deadline_);
      if (ms == 0) {
        const auto missing = missing_ranks();
        std::string msg = plural_ranks(missing) + " did not connect within " + ms_text() + " (" +
                          std::to_string(arrived) + " of " + std::to_string(env_.world_size - 1) +
                          " other ranks arrived";
        if (!pending_.empty()) msg += ", " + std::to_string(pending_.size()) + " connection(s) sent no complete rank";
        fail(msg + "); were they started, with the same MASTER_ADDR and MASTER_PORT?");
      }
      if (::poll(fds.data(), fds.size(), ms) < 0) {
        if (errno == EINTR) continue;
        fail("poll failed: " + errno_text(errno));
      }
      // Read hellos first (indices into pending_ stay valid), then accept new connections.
      for (std::size_t i = pending_.size(); i-- > 0;) {
        if (fds[i + 1].revents == 0) continue;
        if (read_hello(pending_[i])) {
          Conn c = std::move(pending_[i]);
          pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
          admit(std::move(c));
          ++arrived;
        }
      }
      if (fds[0].revents != 0) accept_all();
    }
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      const int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        fail("accept failed: " + errno_text(errno));
      }
      Conn c;
      c.fd = Fd(fd);
      c.addr = sockaddr_text(reinterpret_cast<sockaddr*>(&addr), len);
      pending_.push_back(std::move(c));
    }
  }

  // Reads what has arrived of a hello; true once all of it is there.
  bool read_hello(Conn& c) {
    for (;;) {
      std::uint8_t buf[kHelloBytes];
      const std::size_t want = kHelloBytes - c.hello.size();
      const ssize_t got = ::recv(c.fd.get(), buf, want, 0);
      if (got > 0) {
        c.hello.insert(c.hello.end(), buf, buf + got);
        if (c.hello.size() == kHelloBytes) return true;
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      const std::string why = got == 0 ? "closed the connection" : errno_text(errno);
      fail("the peer at " + c.addr + " " + why + " before sending its rank (" + std::to_string(c.hello.size()) +
           " of " + std::to_string(kHelloBytes) + " bytes arrived)");
    }
  }

  void admit(Conn c) {
    std::string problem = check_hello(c);
    if (problem.empty()) {
      auto& slot = peers_[static_cast<std::size_t>(get_u32(c.hello.data() + 8))];
      if (!slot) {
        slot = std::move(c);
        return;
      }
      problem = "duplicate rank " + std::to_string(get_u32(c.hello.data() + 8)) + ": it connected from " +
                slot->addr + " and again from " + c.addr + "; two processes were given the same rank";
    }
    pending_.push_back(std::move(c));  // so that fail() tells this peer too
    fail(problem);
  }

  // Empty when the hello is a valid, in-range rank of this world; otherwise why not.
  std::string check_hello(const Conn& c) const {
    const std::uint8_t* h = c.hello.data();
    if (!std::equal(h, h + 4, kMagic))
      return "the peer at " + c.addr + " is not a trainsim rendezvous peer (wrong greeting); is another program "
             "using MASTER_PORT " + std::to_string(env_.master_port) + "?";
    const std::uint32_t version = get_u32(h + 4);
    if (version != kVersion)
      return "the peer at " + c.addr + " speaks rendezvous protocol version " + std::to_string(version) +
             ", this build speaks " + std::to_string(kVersion) + "; start every rank from the same build";
    const auto rank = static_cast<std::int32_t>(get_u32(h + 8));
    const auto world = static_cast<std::int32_t>(get_u32(h + 12));
    if (world != env_.world_size)
      return "rank " + std::to_string(rank) + " (" + c.addr + ") reports world size " + std::to_string(world) +
             " but rank 0 has world size " + std::to_string(env_.world_size) +
             "; every rank must be started with the same world size";
    if (rank == 0) return "the peer at " + c.addr + " also claims rank 0; two processes were given rank 0";
    if (rank < 0 || rank >= env_.world_size)
      return "the peer at " + c.addr + " claims rank " + std::to_string(rank) + ", outside [1, " +
             std::to_string(env_.world_size) + ")";
    return {};
  }

  void send_blob(std::span<const std::uint8_t> blob) {
    std::vector<std::uint8_t> frame{kStatusOk};
    put_u64(frame, blob.size());
    frame.insert(frame.end(), blob.begin(), blob.end());
    for (int r = 1; r < env_.world_size; ++r) {
      int err = 0;
      const Io io = write_all(peers_[static_cast<std::size_t>(r)]->fd.get(), frame.data(), frame.size(), deadline_, err);
      if (io == Io::timeout) fail("sending the blob to " + peer_text(r) + " did not finish within " + ms_text());
      if (io == Io::closed) fail(peer_text(r) + " closed the connection before receiving the blob");
      if (io == Io::error) fail("sending the blob to " + peer_text(r) + " failed: " + errno_text(err));
    }
  }

  void collect_acks() {
    int acked = 0;
    while (acked < env_.world_size - 1) {
      std::vector<pollfd> fds;
      std::vector<int> ranks;
      for (int r = 1; r < env_.world_size; ++r)
        if (!peers_[static_cast<std::size_t>(r)]->acked) {
          fds.push_back({peers_[static_cast<std::size_t>(r)]->fd.get(), POLLIN, 0});
          ranks.push_back(r);
        }
      const int ms = remaining_ms(deadline_);
      if (ms == 0)
        fail(plural_ranks(ranks) + " did not acknowledge the blob within " + ms_text());
      if (::poll(fds.data(), fds.size(), ms) < 0) {
        if (errno == EINTR) continue;
        fail("poll failed: " + errno_text(errno));
      }
      for (std::size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const int r = ranks[i];
        std::uint8_t b = 0;
        int err = 0;
        const Io io = read_exact(fds[i].fd, &b, 1, deadline_, err);
        if (io == Io::closed) fail(peer_text(r) + " closed the connection before acknowledging the blob");
        if (io == Io::error) fail("reading the acknowledgement of " + peer_text(r) + " failed: " + errno_text(err));
        if (io == Io::timeout) continue;
        if (b != kAck) fail(peer_text(r) + " sent a wrong acknowledgement byte");
        peers_[static_cast<std::size_t>(r)]->acked = true;
        ++acked;
      }
    }
  }

  const LaunchEnv& env_;
  milliseconds timeout_;
  Clock::time_point deadline_;
  std::string prefix_;
  Fd listener_;
  std::vector<Conn> pending_;               // accepted, hello not complete yet
  std::vector<std::optional<Conn>> peers_;  // by rank; [0] unused
};

// ---------------------------------------------------------------------------------------
// Ranks 1..world_size-1
// ---------------------------------------------------------------------------------------

bool same_endpoint(int fd) {
  sockaddr_storage a{}, b{};
  socklen_t la = sizeof a, lb = sizeof b;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0) return false;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0) return false;
  return la == lb && std::memcmp(&a, &b, la) == 0;
}

// One non-blocking connect attempt to `ai`, bounded by `deadline`. Returns the connected
// socket, or an empty Fd with `err` set.
Fd try_connect(const addrinfo* ai, Clock::time_point deadline, int& err) {
  Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
  if (!fd) {
    err = errno;
    return {};
  }
  if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) {
      err = errno;
      return {};
    }
    pollfd pfd{fd.get(), POLLOUT, 0};
    for (;;) {
      const int n = ::poll(&pfd, 1, remaining_ms(deadline));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        err = n == 0 ? ETIMEDOUT : errno;
        return {};
      }
      break;
    }
    int so_error = 0;
    socklen_t len = sizeof so_error;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error != 0) {
      err = so_error;
      return {};
    }
  }
  // Connecting to a port nobody listens on, from an ephemeral port equal to it, can connect
  // the socket to itself (TCP simultaneous open): that is nobody listening.
  if (same_endpoint(fd.get())) {
    err = ECONNREFUSED;
    return {};
  }
  return fd;
}

std::vector<std::uint8_t> join(const LaunchEnv& env, milliseconds timeout, Clock::time_point deadline) {
  const std::string root = host_port(env.master_addr, env.master_port);
  const std::string prefix = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                             " (rendezvous at " + root + "): ";
  auto fail = [&](const std::string& what) { throw RendezvousError(prefix + what); };
  const std::string ms_text = std::to_string(timeout.count()) + " ms";

  // Connect, retrying while rank 0 is not listening yet.
  Fd fd;
  std::string last_error = "no attempt";
  int attempts = 0;
  milliseconds backoff(10);
  while (!fd) {
    int gai = 0;
    AddrList list = resolve(env, false, gai);
    if (gai != 0 && gai != EAI_AGAIN)
      fail("cannot resolve MASTER_ADDR '" + env.master_addr + "': " + ::gai_strerror(gai));
    if (gai == EAI_AGAIN) last_error = std::string("resolving: ") + ::gai_strerror(gai);
    for (addrinfo* ai = list.get(); ai != nullptr && !fd; ai = ai->ai_next) {
      int err = 0;
      ++attempts;
      fd = try_connect(ai, deadline, err);
      // An attempt cut short by the deadline says less than the refusals before it.
      if (!fd && !(err == ETIMEDOUT && attempts > 1 && remaining_ms(deadline) == 0)) last_error = errno_text(err);
    }
    if (fd) break;
    const int ms = remaining_ms(deadline);
    if (ms == 0)
      fail("could not connect to rank 0 within " + ms_text + " (" + std::to_string(attempts) +
           " attempts, last error: " + last_error + "); is rank 0 running, with the same MASTER_ADDR and MASTER_PORT?");
    std::this_thread::sleep_for(std::min(backoff, milliseconds(ms)));
    backoff = std::min(backoff * 2, milliseconds(500));
  }

  const std::string peer = "rank 0 (" + root + ")";
  // Connected: rank 0 answers at its own deadline at the latest, if only to say who is missing.
  deadline += grace(timeout);
  std::vector<std::uint8_t> hello(kMagic, kMagic + 4);
  put_u32(hello, kVersion);
  put_u32(hello, static_cast<std::uint32_t>(env.rank));
  put_u32(hello, static_cast<std::uint32_t>(env.world_size));
  int err = 0;
  auto check = [&](Io io, const std::string& doing) {
    if (io == Io::ok) return;
    if (io == Io::timeout) fail(doing + ": " + peer + " did not answer within " + ms_text +
                                " and a grace period (rank 0 answers once every rank has connected)");
    if (io == Io::closed) fail(doing + ": " + peer + " closed the connection early");
    fail(doing + " from " + peer + " failed: " + errno_text(err));
  };
  check(write_all(fd.get(), hello.data(), hello.size(), deadline, err), "sending this rank's hello");

  std::uint8_t status = 0;
  check(read_exact(fd.get(), &status, 1, deadline, err), "receiving the blob");
  if (status == kStatusError) {
    std::uint8_t len_bytes[4];
    check(read_exact(fd.get(), len_bytes, 4, deadline, err), "receiving rank 0's error");
    const std::uint32_t len = get_u32(len_bytes);
    if (len > kMaxMessageBytes) fail(peer + " sent an implausible error length");
    std::string msg(len, '\0');
    check(read_exact(fd.get(), reinterpret_cast<std::uint8_t*>(msg.data()), len, deadline, err),
          "receiving rank 0's error");
    fail(peer + " failed the rendezvous: " + msg);
  }
  if (status != kStatusOk) fail(peer + " sent an unknown status byte " + std::to_string(status));
  std::uint8_t len_bytes[8];
  check(read_exact(fd.get(), len_bytes, 8, deadline, err), "receiving the blob");
  const std::uint64_t len = get_u64(len_bytes);
  if (len > kMaxBlobBytes) fail(peer + " announced a blob of " + std::to_string(len) + " bytes, more than 1 GiB");
  std::vector<std::uint8_t> blob(static_cast<std::size_t>(len));
  check(read_exact(fd.get(), blob.data(), blob.size(), deadline, err), "receiving the blob");
  check(write_all(fd.get(), &kAck, 1, deadline, err), "acknowledging the blob");
  return blob;
}

}  // namespace

std::vector<std::uint8_t> broadcast_from_rank0(const LaunchEnv& env, std::span<const std::uint8_t> blob_on_rank0,
                                               milliseconds timeout) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
    throw std::invalid_argument("broadcast_from_rank0: rank " + std::to_string(env.rank) + " is outside [0, " +
                                std::to_string(env.world_size) + ")");
  if (env.master_port < 1 || env.master_port > 65535)
    throw std::invalid_argument("broadcast_from_rank0: master_port " + std::to_string(env.master_port) +
                                " is outside 1..65535");
  if (timeout <= milliseconds(0))
    throw std::invalid_argument("broadcast_from_rank0: timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  if (env.world_size == 1) return {blob_on_rank0.begin(), blob_on_rank0.end()};
  const auto deadline = Clock::now() + timeout;
  if (env.rank == 0) return Root(env, timeout, deadline).run(blob_on_rank0);
  return join(env, timeout, deadline);
}

}  // namespace trainsim::runtime
