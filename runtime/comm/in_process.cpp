#include "runtime/comm/in_process.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/numerics/lowp.h"

namespace trainsim::runtime {

namespace {

// Messages are matched on (source, tag, channel). Point-to-point messages use channel 0;
// step k of a collective with tag T travels on (T, channel 1 + k), so no collective step
// can ever be taken for a user's point-to-point message or for another step, whatever the
// tags the caller picks.
struct Key {
  int source;
  std::uint64_t tag;
  std::uint32_t channel;
  auto operator<=>(const Key&) const = default;
};
constexpr std::uint32_t kPointToPoint = 0;

// One destination rank's mailbox: its own lock, so ranks that do not talk to each other
// never contend. Messages with the same key are delivered in the order they were sent.
struct Inbox {
  std::mutex mu;
  std::condition_variable arrived;
  std::map<Key, std::deque<std::vector<float>>> messages;
};

std::string ms_text(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

// The world's state, shared by its communicators (which keep it alive).
struct WorldState {
  WorldState(int n, std::chrono::milliseconds t) : world_size(n), timeout(t), inboxes(static_cast<std::size_t>(n)) {}

  const int world_size;
  const std::chrono::milliseconds timeout;
  std::vector<Inbox> inboxes;  // indexed by destination rank; never resized

  std::atomic<bool> aborted{false};
  std::mutex abort_mu;
  std::string abort_reason;  // written once, under abort_mu, before `aborted` is set

  std::atomic<std::size_t> in_flight{0};
  std::atomic<std::size_t> peak{0};

  std::string reason() {
    std::lock_guard lock(abort_mu);
    return abort_reason;
  }

  void abort(const std::string& why) {
    {
      std::lock_guard lock(abort_mu);
      if (aborted.load()) return;  // the first reason wins
      abort_reason = why;
      aborted.store(true);
    }
    // Taking each inbox's lock before notifying guarantees that a waiter is either already
    // asleep (and is woken) or has not yet checked `aborted` (and will see it).
    for (Inbox& box : inboxes) {
      { std::lock_guard lock(box.mu); }
      box.arrived.notify_all();
    }
  }

  void add_bytes(std::size_t b) {
    const std::size_t now = in_flight.fetch_add(b) + b;
    std::size_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }
};

// Element-wise rounding to the wire format, chosen once per call rather than per element.
template <typename F>
decltype(auto) with_rounding(DType wire, F&& f) {
  switch (wire) {
    case DType::fp32: return f([](float x) { return x; });
    case DType::tf32: return f([](float x) { return round_to_tf32(x); });
    case DType::fp16: return f([](float x) { return round_to_fp16(x); });
    case DType::bf16: return f([](float x) { return round_to_bf16(x); });
    case DType::fp8: break;
  }
  throw std::invalid_argument("all_reduce: the in-process communicator does not emulate an fp8 wire format");
}

// max that propagates NaN (std::max and fmax both drop it): the global overflow check
// reduces with max, and a NaN on one rank must reach every rank.
inline float max_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a < b ? b : a;
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<WorldState> shared, int rank) : s_(std::move(shared)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return s_->world_size; }

  void send(int peer, std::uint64_t tag, std::span<const float> data) override {
    check_peer(peer, "send to");
    throw_if_aborted([&] { return "send to rank " + std::to_string(peer) + " tag " + std::to_string(tag); });
    post(peer, Key{rank_, tag, kPointToPoint}, std::vector<float>(data.begin(), data.end()));
  }

  void recv(int peer, std::uint64_t tag, std::span<float> data) override {
    check_peer(peer, "recv from");
    auto op = [&] { return "recv from rank " + std::to_string(peer) + " tag " + std::to_string(tag); };
    std::vector<float> msg = take(Key{peer, tag, kPointToPoint}, op);
    if (msg.size() != data.size())
      throw CommError(prefix() + op() + ": size mismatch: rank " + std::to_string(peer) + " sent " +
                      std::to_string(msg.size()) + " elements, this recv expects " + std::to_string(data.size()));
    std::copy(msg.begin(), msg.end(), data.begin());
  }

  void all_reduce(std::span<float> data, std::span<const int> members, std::uint64_t tag, ReduceOp op, DType wire,
                  Divide divide) override {
    const int me = check_members(members, tag);
    with_rounding(wire, [&](auto round) { ring(data, members, me, tag, op, divide, round); });
  }

  void abort(const std::string& reason) override { s_->abort(reason); }

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }

  template <typename Op>
  void throw_if_aborted(Op&& op) const {
    if (s_->aborted.load()) throw CommError(prefix() + op() + ": aborted: " + s_->reason());
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= s_->world_size)
      throw std::invalid_argument(prefix() + what + " rank " + std::to_string(peer) + ": no such rank (world size " +
                                  std::to_string(s_->world_size) + ")");
  }

  // Returns this rank's position among `members`.
  int check_members(std::span<const int> members, std::uint64_t tag) const {
    const std::string where = prefix() + "all_reduce tag " + std::to_string(tag) + ": ";
    int me = -1;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] < 0 || members[i] >= s_->world_size)
        throw std::invalid_argument(where + "member " + std::to_string(members[i]) + " is not a rank (world size " +
                                    std::to_string(s_->world_size) + ")");
      if (i > 0 && members[i] <= members[i - 1])
        throw std::invalid_argument(where + "members must be strictly ascending, got " +
                                    std::to_string(members[i - 1]) + " then " + std::to_string(members[i]));
      if (members[i] == rank_) me = static_cast<int>(i);
    }
    if (me < 0) throw std::invalid_argument(where + "this rank is not among the members");
    return me;
  }

  // Moves `msg` into `dst`'s mailbox; never waits for the receiver.
  void post(int dst, Key key, std::vector<float>&& msg) {
    Inbox& box = s_->inboxes[static_cast<std::size_t>(dst)];
    const std::size_t bytes = msg.size() * sizeof(float);
    {
      std::lock_guard lock(box.mu);
      box.messages[key].push_back(std::move(msg));
      s_->add_bytes(bytes);
    }
    box.arrived.notify_all();
  }

  // Waits for the first message under `key` in this rank's mailbox and moves it out. `op`
  // describes the call for errors ("recv from rank 1 tag 7").
  template <typename Op>
  std::vector<float> take(Key key, Op&& op) {
    Inbox& box = s_->inboxes[static_cast<std::size_t>(rank_)];
    const auto deadline = std::chrono::steady_clock::now() + s_->timeout;
    std::unique_lock lock(box.mu);
    auto it = box.messages.end();
    const bool ready = box.arrived.wait_until(lock, deadline, [&] {
      if (s_->aborted.load()) return true;
      it = box.messages.find(key);
      return it != box.messages.end();
    });
    if (s_->aborted.load()) {
      lock.unlock();
      throw_if_aborted(op);
    }
    if (!ready)
      throw CommError(prefix() + op() + ": timed out after " + ms_text(s_->timeout) + " waiting for rank " +
                      std::to_string(key.source));
    std::vector<float> msg = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) box.messages.erase(it);
    s_->in_flight.fetch_sub(msg.size() * sizeof(float));
    return msg;
  }

  // The ring all-reduce. Chunk c of the buffer (N elements, n members) holds N/n elements,
  // plus one for the first N%n chunks. Reduce-scatter: at step k (0..n-2) the member at
  // position p sends its partial sum of chunk (p-k) mod n to its successor and adds its own
  // contribution to the partial sum of chunk (p-k-1) mod n it receives from its predecessor,
  // so chunk c is summed in the order c, c+1, ..., c-1 (positions mod n) and position p ends
  // owning chunk (p+1) mod n. All-gather: at step k position p forwards chunk (p+1-k) mod n.
  // The chunk a member receives is the one it sends next, so the received vector itself
  // travels on: one allocation per phase, no other copies.
  template <typename Round>
  void ring(std::span<float> data, std::span<const int> members, int me, std::uint64_t tag, ReduceOp op,
            Divide divide, Round round) {
    const int n = static_cast<int>(members.size());
    auto op_text = [&](int step, int peer) {
      return [=, this] {
        return "all_reduce tag " + std::to_string(tag) + " step " + std::to_string(step) + " (peer rank " +
               std::to_string(peer) + ")";
      };
    };
    throw_if_aborted(op_text(0, members[static_cast<std::size_t>((me + n - 1) % n)]));

    // Contributions enter the ring in the wire format, pre-divided when asked.
    if (divide == Divide::before) {
      const float inv = round(1.0f / static_cast<float>(n));
      for (float& x : data) x = round(round(x) * inv);
    } else {
      for (float& x : data) x = round(x);
    }
    auto finish = [&](std::span<float> owned) {
      if (divide == Divide::after)
        for (float& x : owned) x = round(x / static_cast<float>(n));
    };
    if (n == 1) {
      finish(data);
      return;
    }

    const std::size_t N = data.size();
    const std::size_t base = N / static_cast<std::size_t>(n), extra = N % static_cast<std::size_t>(n);
    auto chunk = [&](int c) {
      const auto cu = static_cast<std::size_t>(c);
      const std::size_t begin = cu * base + std::min(cu, extra);
      return data.subspan(begin, base + (cu < extra ? 1 : 0));
    };
    auto mod = [n](int x) { return ((x % n) + n) % n; };
    const int next = members[static_cast<std::size_t>(mod(me + 1))];
    const int prev = members[static_cast<std::size_t>(mod(me - 1))];

    auto receive = [&](int step, std::size_t expect) {
      std::vector<float> msg = take(Key{prev, tag, 1u + static_cast<std::uint32_t>(step)}, op_text(step, prev));
      if (msg.size() != expect)
        throw CommError(prefix() + op_text(step, prev)() + ": size mismatch: rank " + std::to_string(prev) +
                        " sent a chunk of " + std::to_string(msg.size()) + " elements, expected " +
                        std::to_string(expect) + " (members disagree on the buffer size)");
      return msg;
    };

    // Reduce-scatter.
    std::span<const float> first = chunk(me);
    std::vector<float> travelling(first.begin(), first.end());
    for (int step = 0; step < n - 1; ++step) {
      post(next, Key{rank_, tag, 1u + static_cast<std::uint32_t>(step)}, std::move(travelling));
      std::span<const float> mine = chunk(mod(me - step - 1));
      travelling = receive(step, mine.size());
      if (op == ReduceOp::sum) {
        for (std::size_t i = 0; i < mine.size(); ++i) travelling[i] = round(travelling[i] + mine[i]);
      } else {
        for (std::size_t i = 0; i < mine.size(); ++i) travelling[i] = max_nan(travelling[i], mine[i]);
      }
    }
    // This member now holds the complete reduction of chunk me+1.
    finish(travelling);
    std::span<float> owned = chunk(mod(me + 1));
    std::copy(travelling.begin(), travelling.end(), owned.begin());

    // All-gather.
    for (int step = 0; step < n - 1; ++step) {
      const int s = n - 1 + step;
      post(next, Key{rank_, tag, 1u + static_cast<std::uint32_t>(s)}, std::move(travelling));
      std::span<float> dst = chunk(mod(me - step));
      travelling = receive(s, dst.size());
      std::copy(travelling.begin(), travelling.end(), dst.begin());
    }
  }

  std::shared_ptr<WorldState> s_;
  int rank_;
};

}  // namespace

struct InProcessWorld::Shared : WorldState {
  using WorldState::WorldState;
};

InProcessWorld::InProcessWorld(int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1)
    throw std::invalid_argument("InProcessWorld: world_size must be at least 1, got " + std::to_string(world_size));
  if (timeout.count() <= 0)
    throw std::invalid_argument("InProcessWorld: timeout must be positive, got " + ms_text(timeout));
  shared_ = std::make_shared<Shared>(world_size, timeout);
}

InProcessWorld::~InProcessWorld() = default;

int InProcessWorld::world_size() const { return shared_->world_size; }

std::unique_ptr<Communicator> InProcessWorld::communicator(int rank) {
  if (rank < 0 || rank >= shared_->world_size)
    throw std::invalid_argument("InProcessWorld: no rank " + std::to_string(rank) + " in a world of " +
                                std::to_string(shared_->world_size));
  return std::make_unique<InProcessCommunicator>(shared_, rank);
}

std::size_t InProcessWorld::bytes_in_flight() const { return shared_->in_flight.load(); }
std::size_t InProcessWorld::peak_bytes_in_flight() const { return shared_->peak.load(); }

}  // namespace trainsim::runtime
