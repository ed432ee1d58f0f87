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
  InProcessCommunicator(std::shared_ptr<WorldState> shared, int rank, std::chrono::microseconds poll,
                        const std::atomic<bool>* poll_while, std::chrono::microseconds poll_in_call)
      : s_(std::move(shared)), rank_(rank), poll_(poll), poll_in_call_(poll_in_call), poll_while_(poll_while) {}

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
    with_rounding(wire, [&](auto round) { all_reduce_in(data, members, me, tag, op, divide, round); });
  }

  void reduce_scatter(std::span<float> data, std::span<const int> members, std::uint64_t tag, ReduceOp op,
                      DType wire, Divide divide) override {
    const int me = check_members(members, tag, "reduce_scatter");
    check_equal_chunks(data.size(), members.size(), tag, "reduce_scatter");
    with_rounding(wire, [&](auto round) { ring_reduce_scatter(data, members, me, tag, op, divide, round); });
  }

  void all_gather(std::span<float> data, std::span<const int> members, std::uint64_t tag, DType wire) override {
    const int me = check_members(members, tag, "all_gather");
    check_equal_chunks(data.size(), members.size(), tag, "all_gather");
    with_rounding(wire, [&](auto round) { ring_all_gather(data, members, me, tag, round); });
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
  int check_members(std::span<const int> members, std::uint64_t tag, const char* op = "all_reduce") const {
    return member_position(prefix(), members, rank_, s_->world_size(), tag, op);
  }
  void check_equal_chunks(std::size_t count, std::size_t members, std::uint64_t tag, const char* op) const {
    runtime::check_equal_chunks(prefix(), count, members, tag, op);
  }

  // Moves `msg` into `dst`'s mailbox; never waits for the receiver. Bytes are counted before
  // the message is visible, so a receiver never subtracts them first.
  void post(int dst, Key key, std::vector<float>&& msg) {
    s_->add_bytes(msg.size() * sizeof(float));
    s_->post(dst, key, std::move(msg));
  }

  // Waits for the first message under `key` in this rank's mailbox and moves it out. `op`
  // describes the call for errors ("recv from rank 1 tag 7").
  // `in_call`: a later step of a ring, whose sender is known to be inside the same call (it sent
  // this call's earlier steps): polled for up to poll_in_call_.
  template <typename Op>
  std::vector<float> take(Key key, Op&& op, bool in_call = false) {
    std::vector<float> msg = s_->take(rank_, key, prefix(), op, in_call ? poll_in_call_ : poll_, poll_while_);
    s_->in_flight.fetch_sub(msg.size() * sizeof(float));
    return msg;
  }

  // The ring. Chunk c of the buffer (N elements, n members) holds N/n elements, plus one for the
  // first N%n chunks (reduce_scatter and all_gather take equal chunks only). Reduce phase, shifted
  // by `shift`: at step k (0..n-2) the member at position p sends its partial sum of chunk
  // (p+shift-k) mod n to its successor and adds its own contribution to the partial sum of chunk
  // (p+shift-k-1) mod n it receives from its predecessor, so chunk c is summed in the order
  // c-shift, c-shift+1, ... (positions mod n) and position p ends owning chunk (p+shift+1) mod n:
  // the all-reduce uses shift 0 (position p owns chunk p+1), reduce_scatter shift -1 (chunk p, as
  // NCCL places it). Gather phase: at step k position p forwards the chunk it owns or last
  // received and receives chunk (p+shift-k) mod n. The chunk a member receives is the one it
  // sends next, so the received vector itself travels on: one allocation per phase, no other
  // copies. Messages of one call are keyed by step, 1 + k, continuing across the two phases.
  struct Ring {
    std::span<float> data;
    std::span<const int> members;
    int me, n;
    std::uint64_t tag;
    const char* name;

    int mod(int x) const { return ((x % n) + n) % n; }
    int next() const { return members[static_cast<std::size_t>(mod(me + 1))]; }
    int prev() const { return members[static_cast<std::size_t>(mod(me - 1))]; }
    std::span<float> chunk(int c) const {
      const std::size_t N = data.size(), nn = static_cast<std::size_t>(n);
      const std::size_t base = N / nn, extra = N % nn, cu = static_cast<std::size_t>(c);
      return data.subspan(cu * base + std::min(cu, extra), base + (cu < extra ? 1 : 0));
    }
    auto op_text(int step, int peer) const {
      return [=, this] {
        return std::string(name) + " tag " + std::to_string(tag) + " step " + std::to_string(step) + " (peer rank " +
               std::to_string(peer) + ")";
      };
    }
  };

  std::vector<float> receive(const Ring& r, int step, std::size_t expect) {
    const int prev = r.prev();
    // From step 1 on, the predecessor is inside this call: it sent step 0 (or this member's
    // successor chain did), and its next message is a chunk's sum away.
    std::vector<float> msg =
        take(Key{prev, r.tag, 1u + static_cast<std::uint32_t>(step)}, r.op_text(step, prev), step > 0);
    if (msg.size() != expect)
      throw CommError(prefix() + r.op_text(step, prev)() + ": size mismatch: rank " + std::to_string(prev) +
                      " sent a chunk of " + std::to_string(msg.size()) + " elements, expected " +
                      std::to_string(expect) + " (members disagree on the buffer size)");
    return msg;
  }

  // Contributions enter the ring in the wire format, pre-divided when asked; Divide::after is
  // applied by `finish` to what a member ends up owning.
  template <typename Round>
  static void contribute(std::span<float> data, int n, Divide divide, Round round) {
    if (divide == Divide::before) {
      const float inv = round(1.0f / static_cast<float>(n));
      for (float& x : data) x = round(round(x) * inv);
    } else {
      for (float& x : data) x = round(x);
    }
  }
  template <typename Round>
  static void finish(std::span<float> owned, int n, Divide divide, Round round) {
    if (divide == Divide::after)
      for (float& x : owned) x = round(x / static_cast<float>(n));
  }

  // Steps 0..n-2; returns the fully reduced chunk (p+shift+1) mod n.
  template <typename Round>
  std::vector<float> reduce_phase(const Ring& r, int shift, ReduceOp op, Round round) {
    std::span<const float> first = r.chunk(r.mod(r.me + shift));
    std::vector<float> travelling(first.begin(), first.end());
    for (int step = 0; step < r.n - 1; ++step) {
      post(r.next(), Key{rank_, r.tag, 1u + static_cast<std::uint32_t>(step)}, std::move(travelling));
      std::span<const float> mine = r.chunk(r.mod(r.me + shift - step - 1));
      travelling = receive(r, step, mine.size());
      if (op == ReduceOp::sum) {
        for (std::size_t i = 0; i < mine.size(); ++i) travelling[i] = round(travelling[i] + mine[i]);
      } else {
        for (std::size_t i = 0; i < mine.size(); ++i) travelling[i] = max_nan(travelling[i], mine[i]);
      }
    }
    return travelling;
  }

  // Steps first_step..first_step+n-2: `travelling` is the chunk this member owns.
  void gather_phase(const Ring& r, int shift, int first_step, std::vector<float> travelling) {
    for (int step = 0; step < r.n - 1; ++step) {
      const int s = first_step + step;
      post(r.next(), Key{rank_, r.tag, 1u + static_cast<std::uint32_t>(s)}, std::move(travelling));
      std::span<float> dst = r.chunk(r.mod(r.me + shift - step));
      travelling = receive(r, s, dst.size());
      std::copy(travelling.begin(), travelling.end(), dst.begin());
    }
  }

  // The contributions into the wire format, then the ring or, for a small buffer, the direct path.
  template <typename Round>
  void all_reduce_in(std::span<float> data, std::span<const int> members, int me, std::uint64_t tag, ReduceOp op,
                     Divide divide, Round round) {
    const int n = static_cast<int>(members.size());
    const Ring r{data, members, me, n, tag, "all_reduce"};
    throw_if_aborted(r.op_text(0, r.prev()));
    contribute(data, n, divide, round);
    if (n == 1)
      finish(data, n, divide, round);
    else if (all_reduce_goes_direct(static_cast<std::size_t>(n), data.size()))
      direct_all_reduce(r, op, divide, round);
    else
      ring_all_reduce(r, op, divide, round);
  }

  // The all-reduce of the contributions (already in the wire format) over n > 1 members.
  template <typename Round>
  void ring_all_reduce(const Ring& r, ReduceOp op, Divide divide, Round round) {
    std::vector<float> owned = reduce_phase(r, 0, op, round);
    finish(owned, r.n, divide, round);
    std::span<float> dst = r.chunk(r.mod(r.me + 1));
    std::copy(owned.begin(), owned.end(), dst.begin());
    gather_phase(r, 0, r.n - 1, std::move(owned));
  }

  // A small buffer (gradient norms, overflow flags, a head's row maxima): latency-bound, where the
  // ring's 2(n-1) steps are 2(n-1) waits in a row, each a thread's wake-up (a scheduler slice
  // where threads share cores). Every member sends its contribution to every other at once and
  // sums the n it holds in the ring's order (chunk c from member c on, ring_all_reduce above),
  // so the result is the ring's bit for bit: one wait instead of 2(n-1), n-1 messages of the
  // whole buffer instead of 2(n-1) of a chunk.
  template <typename Round>
  void direct_all_reduce(const Ring& r, ReduceOp op, Divide divide, Round round) {
    const std::span<float> data = r.data;
    const std::span<const int> members = r.members;
    const int n = r.n, me = r.me;
    const std::uint64_t tag = r.tag;
    for (int k = 1; k < n; ++k)
      post(members[static_cast<std::size_t>(r.mod(me + k))], Key{rank_, tag, 1u},
           std::vector<float>(data.begin(), data.end()));
    std::vector<std::vector<float>> from(static_cast<std::size_t>(n));  // contributions by position
    for (int k = 1; k < n; ++k) {
      const int p = r.mod(me - k);
      const int peer = members[static_cast<std::size_t>(p)];
      std::vector<float>& msg = from[static_cast<std::size_t>(p)] =
          take(Key{peer, tag, 1u}, [&] { return "all_reduce tag " + std::to_string(tag) + " (peer rank " + std::to_string(peer) + ")"; });
      if (msg.size() != data.size())
        throw CommError(prefix() + "all_reduce tag " + std::to_string(tag) + ": size mismatch: rank " +
                        std::to_string(peer) + " sent " + std::to_string(msg.size()) + " elements, expected " +
                        std::to_string(data.size()) + " (members disagree on the buffer size)");
    }
    auto term = [&](int p, std::size_t i) {
      return p == me ? data[i] : from[static_cast<std::size_t>(p)][i];
    };
    std::vector<float> sums(data.size());
    for (int c = 0; c < n; ++c) {
      const std::span<float> chunk = r.chunk(c);
      const auto first = static_cast<std::size_t>(chunk.data() - data.data());
      for (std::size_t i = first; i < first + chunk.size(); ++i) {
        float s = term(c, i);
        for (int k = 1; k < n; ++k) {
          const float x = term(r.mod(c + k), i);
          s = op == ReduceOp::sum ? round(s + x) : max_nan(s, x);
        }
        sums[i] = s;
      }
    }
    finish(sums, n, divide, round);
    std::copy(sums.begin(), sums.end(), data.begin());
  }

  template <typename Round>
  void ring_reduce_scatter(std::span<float> data, std::span<const int> members, int me, std::uint64_t tag,
                           ReduceOp op, Divide divide, Round round) {
    const int n = static_cast<int>(members.size());
    const Ring r{data, members, me, n, tag, "reduce_scatter"};
    throw_if_aborted(r.op_text(0, r.prev()));
    contribute(data, n, divide, round);
    if (n == 1) {
      finish(data, n, divide, round);
      return;
    }
    std::vector<float> owned = reduce_phase(r, -1, op, round);
    finish(owned, n, divide, round);
    std::span<float> mine = r.chunk(me);
    std::copy(owned.begin(), owned.end(), mine.begin());
  }

  template <typename Round>
  void ring_all_gather(std::span<float> data, std::span<const int> members, int me, std::uint64_t tag, Round round) {
    const int n = static_cast<int>(members.size());
    const Ring r{data, members, me, n, tag, "all_gather"};
    throw_if_aborted(r.op_text(0, r.prev()));
    std::span<float> mine = r.chunk(me);
    for (float& x : mine) x = round(x);
    if (n == 1) return;
    gather_phase(r, -1, 0, std::vector<float>(mine.begin(), mine.end()));
  }

  std::shared_ptr<WorldState> s_;
  int rank_;
  std::chrono::microseconds poll_, poll_in_call_;
  const std::atomic<bool>* poll_while_;
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

std::unique_ptr<Communicator> InProcessWorld::communicator(int rank, std::chrono::microseconds poll,
                                                         const std::atomic<bool>* poll_while,
                                                         std::optional<std::chrono::microseconds> poll_in_call) {
  if (rank < 0 || rank >= shared_->world_size())
    throw std::invalid_argument("InProcessWorld: no rank " + std::to_string(rank) + " in a world of " +
                                std::to_string(shared_->world_size()));
  if (poll.count() < 0)
    throw std::invalid_argument("InProcessWorld: poll must not be negative, got " + std::to_string(poll.count()) +
                                " us");
  if (poll_in_call && poll_in_call->count() < 0)
    throw std::invalid_argument("InProcessWorld: poll_in_call must not be negative, got " +
                                std::to_string(poll_in_call->count()) + " us");
  return std::make_unique<InProcessCommunicator>(shared_, rank, poll, poll_while, poll_in_call.value_or(poll));
}

std::size_t InProcessWorld::bytes_in_flight() const { return shared_->in_flight.load(); }
std::size_t InProcessWorld::peak_bytes_in_flight() const { return shared_->peak.load(); }

}  // namespace trainsim::runtime
