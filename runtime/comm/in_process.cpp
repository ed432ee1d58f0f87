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

#include "runtime/comm/arguments.h"
#include "runtime/comm/mailbox.h"
#include "runtime/numerics/lowp.h"

namespace trainsim::runtime {

namespace {

// Messages are matched on (source, tag, channel). Point-to-point messages use channel 0;
// step k of a collective with tag T travels on (T, channel 1 + k), so no collective step
// can ever be taken for a user's point-to-point message or for another step, whatever the
// tags the caller picks.
using Key = MailKey;
constexpr std::uint32_t kPointToPoint = 0;

std::string ms_text(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

// The world's state, shared by its communicators (which keep it alive): the mailboxes and
// the bytes they hold.
struct WorldState : Mailboxes<std::vector<float>> {
  using Mailboxes::Mailboxes;

  std::atomic<std::size_t> in_flight{0};
  std::atomic<std::size_t> peak{0};

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
  int world_size() const override { return s_->world_size(); }

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
    s_->throw_if_aborted(prefix(), op);
  }

  void check_peer(int peer, const char* what) const { runtime::check_peer(prefix(), peer, s_->world_size(), what); }

  // Returns this rank's position among `members`.
  int check_members(std::span<const int> members, std::uint64_t tag) const {
    return member_position(prefix(), members, rank_, s_->world_size(), tag);
  }

  // Moves `msg` into `dst`'s mailbox; never waits for the receiver. Bytes are counted before
  // the message is visible, so a receiver never subtracts them first.
  void post(int dst, Key key, std::vector<float>&& msg) {
    s_->add_bytes(msg.size() * sizeof(float));
    s_->post(dst, key, std::move(msg));
  }

  // Waits for the first message under `key` in this rank's mailbox and moves it out. `op`
  // describes the call for errors ("recv from rank 1 tag 7").
  template <typename Op>
  std::vector<float> take(Key key, Op&& op) {
    std::vector<float> msg = s_->take(rank_, key, prefix(), op);
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

int InProcessWorld::world_size() const { return shared_->world_size(); }

std::unique_ptr<Communicator> InProcessWorld::communicator(int rank) {
  if (rank < 0 || rank >= shared_->world_size())
    throw std::invalid_argument("InProcessWorld: no rank " + std::to_string(rank) + " in a world of " +
                                std::to_string(shared_->world_size()));
  return std::make_unique<InProcessCommunicator>(shared_, rank);
}

std::size_t InProcessWorld::bytes_in_flight() const { return shared_->in_flight.load(); }
std::size_t InProcessWorld::peak_bytes_in_flight() const { return shared_->peak.load(); }

}  // namespace trainsim::runtime
