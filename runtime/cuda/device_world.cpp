#include "runtime/cuda/device_world.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/collective.h"
#include "kernels/cuda_check.h"
#include "runtime/comm/arguments.h"
#include "runtime/comm/mailbox.h"

namespace trainsim::runtime::cuda {

namespace {

// Channels of the mailbox key: point-to-point messages (keyed by source only, paired by order),
// a collective's contributions, its "done reading" events, and host gathers.
constexpr std::uint32_t kPointToPoint = 0, kContribution = 1, kDone = 2, kGather = 3;

using ::trainsim::cuda::check_cuda;

// TRAINSIM_COMM_TRACE=1: every call's start and end on stderr, with the thread's milliseconds since
// the first call, to see which rank waits for which on a hang (one line per event, whole lines).
bool tracing() {
  static const bool on = [] {
    const char* v = std::getenv("TRAINSIM_COMM_TRACE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return on;
}
void trace(const std::string& what, const char* event) {
  if (!tracing()) return;
  static const auto t0 = std::chrono::steady_clock::now();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "[comm %10.3f ms] %s: %s\n", ms, what.c_str(), event);
}

std::size_t element_bytes(DType dt, const std::string& who) {
  switch (dt) {
    case DType::fp32: return 4;
    case DType::fp16:
    case DType::bf16: return 2;
    default: break;
  }
  throw std::invalid_argument(who + "the single-GPU world moves fp32, fp16 or bf16 buffers, got " +
                              std::string(dtype_name(dt)));
}

// The events messages carry, kept for reuse rather than destroyed. The sender and every reader
// hold a message's event until they have queued their wait on it, so the last holder is often
// another rank's thread; under green contexts the event belongs to the sender's context, which
// only the sender's thread may use (sm_partition.h). So a released event goes back to the free
// list of the stream it was recorded on, and only a thread recording on that stream takes it
// again (re-recording does not disturb waits already queued: cudaStreamWaitEvent uses the state
// captured when it was called). Whatever is left is destroyed with the pool, after every rank's
// thread is done with the world.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  ~EventPool() {
    for (auto& [stream, events] : free_)
      for (cudaEvent_t e : events) cudaEventDestroy(e);
  }

  // An event recorded on `stream`, returned to this pool by its last holder.
  std::shared_ptr<void> record(StreamHandle stream, const std::string& what) {
    cudaEvent_t ev = take(stream);
    if (ev == nullptr) check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), what + ": cudaEventCreate");
    std::shared_ptr<void> owned(ev, [pool = shared_from_this(), stream](void* e) {
      pool->give_back(stream, static_cast<cudaEvent_t>(e));
    });
    check_cuda(cudaEventRecord(ev, stream), what + ": cudaEventRecord");
    return owned;
  }

 private:
  cudaEvent_t take(StreamHandle stream) {
    std::lock_guard lock(mutex_);
    auto& events = free_[stream];
    if (events.empty()) return nullptr;
    const cudaEvent_t e = events.back();
    events.pop_back();
    return e;
  }
  void give_back(StreamHandle stream, cudaEvent_t e) {
    std::lock_guard lock(mutex_);
    free_[stream].push_back(e);
  }

  std::mutex mutex_;
  std::map<void*, std::vector<cudaEvent_t>> free_;
};

void wait_event(StreamHandle stream, const std::shared_ptr<void>& ev, const std::string& what) {
  check_cuda(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(ev.get()), 0), what + ": cudaStreamWaitEvent");
}

struct DeviceMessage {
  std::uint64_t tag = 0;
  std::size_t count = 0;
  DType dt = DType::fp32;
  void* staging = nullptr;       // device; freed by the receiver (point-to-point) or the owner (collective)
  std::shared_ptr<void> ready;   // cudaEvent_t: the staging buffer is written / has been read
  std::vector<std::uint8_t> blob;  // gather_host only
};

struct WorldState : Mailboxes<DeviceMessage> {
  using Mailboxes::Mailboxes;
  std::shared_ptr<EventPool> events = std::make_shared<EventPool>();  // outlives the messages that hold its events
};

class DeviceWorldCommunicator final : public DeviceCommunicator {
 public:
  DeviceWorldCommunicator(std::shared_ptr<WorldState> s, int rank) : s_(std::move(s)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return s_->world_size(); }
  std::string describe() const override {
    return "single-GPU world: " + std::to_string(s_->world_size()) + " ranks on one device, exchanging through device memory";
  }

  void send(int peer, std::uint64_t tag, const void* data, std::size_t count, DType dt, StreamHandle stream) override {
    check_peer(prefix(), peer, s_->world_size(), "send to");
    const std::string op = "send to rank " + std::to_string(peer) + " tag " + std::to_string(tag);
    const std::string what = prefix() + op;
    const std::size_t bytes = count * element_bytes(dt, prefix());
    s_->throw_if_aborted(prefix(), [&] { return op; });
    DeviceMessage msg;
    msg.tag = tag;
    msg.count = count;
    msg.dt = dt;
    msg.staging = stage(data, bytes, stream, what);
    msg.ready = s_->events->record(stream, what);
    s_->post(peer, MailKey{rank_, 0, kPointToPoint}, std::move(msg));
    trace(what, "posted");
  }

  void recv(int peer, std::uint64_t tag, void* data, std::size_t count, DType dt, StreamHandle stream) override {
    check_peer(prefix(), peer, s_->world_size(), "recv from");
    const std::size_t bytes = count * element_bytes(dt, prefix());
    auto op = [&] { return "recv from rank " + std::to_string(peer) + " tag " + std::to_string(tag); };
    if (tracing()) trace(prefix() + op(), "waiting");
    DeviceMessage msg = s_->take(rank_, MailKey{peer, 0, kPointToPoint}, prefix(), op);
    if (tracing()) trace(prefix() + op(), "received");
    if (msg.tag != tag || msg.count != count || msg.dt != dt)
      throw CommError(prefix() + op() + ": the next message from rank " + std::to_string(peer) + " is tag " +
                      std::to_string(msg.tag) + ", " + std::to_string(msg.count) + " " + std::string(dtype_name(msg.dt)) +
                      " elements; this recv expects " + std::to_string(count) + " " + std::string(dtype_name(dt)) +
                      " (sends and receives between two ranks must come in the same order)");
    const std::string what = prefix() + op();
    wait_event(stream, msg.ready, what);
    if (bytes > 0) {
      check_cuda(cudaMemcpyAsync(data, msg.staging, bytes, cudaMemcpyDeviceToDevice, stream),
            what + ": cudaMemcpyAsync");
      check_cuda(cudaFreeAsync(msg.staging, stream), what + ": cudaFreeAsync");
    }
  }

  // Sends are buffered: nothing needs to progress together.
  void group_begin() override {}
  void group_end() override {}

  void all_reduce(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag,
                  ReduceOp op, Divide divide, StreamHandle stream) override {
    Exchange x = exchange("all_reduce", data, 0, count, dt, members, tag, stream);
    if (!x.active) return;  // one member: x * round(1/1) and x / 1 are x
    if (count > 0)
      trainsim::cuda::ring_reduce(data, x.inputs.data(), x.n, count, dt, member_reduce(op), divide == Divide::before,
                                divide == Divide::after, stream);
    release(x, stream);
  }

  // Member p reduces chunk p of every member's buffer in the ring's order for that chunk (the
  // in-process ring's reduce_scatter starts chunk p at member p+1).
  void reduce_scatter(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag,
                      ReduceOp op, Divide divide, StreamHandle stream) override {
    check_equal_chunks(prefix(), count, members.size(), tag, "reduce_scatter");
    const std::size_t per = members.empty() ? 0 : count / members.size();
    const std::size_t offset = per * element_bytes(dt, prefix());
    Exchange x = exchange("reduce_scatter", data, 0, count, dt, members, tag, stream);
    char* const mine = static_cast<char*>(data) + static_cast<std::size_t>(x.me) * offset;
    if (!x.active) return;  // as all_reduce: over one member every op and divide is the identity
    if (per == 0) return release(x, stream);
    std::vector<const void*> order(static_cast<std::size_t>(x.n));
    for (int k = 0; k < x.n; ++k)
      order[static_cast<std::size_t>(k)] =
          static_cast<const char*>(x.inputs[static_cast<std::size_t>((x.me + 1 + k) % x.n)]) +
          static_cast<std::size_t>(x.me) * offset;
    trainsim::cuda::ordered_reduce(mine, order.data(), x.n, per, dt, member_reduce(op), divide == Divide::before,
                                   divide == Divide::after, stream);
    release(x, stream);
  }

  // Every member stages only its own chunk; each copies every other member's into place.
  void all_gather(void* data, std::size_t count, DType dt, std::span<const int> members, std::uint64_t tag,
                  StreamHandle stream) override {
    check_equal_chunks(prefix(), count, members.size(), tag, "all_gather");
    const std::size_t per = members.empty() ? 0 : count / members.size();
    const std::size_t chunk_bytes = per * element_bytes(dt, prefix());
    const int me = member_position(prefix(), members, rank_, s_->world_size(), tag, "all_gather");
    Exchange x = exchange("all_gather", data, static_cast<std::size_t>(me) * per, per, dt, members, tag, stream);
    if (!x.active) return;
    const std::string what = prefix() + "all_gather tag " + std::to_string(tag);
    for (int k = 0; k < x.n; ++k)
      if (k != x.me)
        check_cuda(cudaMemcpyAsync(static_cast<char*>(data) + static_cast<std::size_t>(k) * chunk_bytes,
                                   x.inputs[static_cast<std::size_t>(k)], chunk_bytes, cudaMemcpyDeviceToDevice,
                                   stream),
                   what + ": cudaMemcpyAsync");
    release(x, stream);
  }

  std::vector<std::vector<std::uint8_t>> gather_host(std::span<const std::uint8_t> blob) override {
    const std::uint64_t round = gathers_++;
    const int n = s_->world_size();
    for (int r = 0; r < n; ++r) {
      if (r == rank_) continue;
      DeviceMessage m;
      m.blob.assign(blob.begin(), blob.end());
      s_->post(r, MailKey{rank_, round, kGather}, std::move(m));
    }
    std::vector<std::vector<std::uint8_t>> all(static_cast<std::size_t>(n));
    all[static_cast<std::size_t>(rank_)].assign(blob.begin(), blob.end());
    for (int r = 0; r < n; ++r) {
      if (r == rank_) continue;
      auto op = [&] { return "gather_host round " + std::to_string(round) + " (rank " + std::to_string(r) + ")"; };
      all[static_cast<std::size_t>(r)] = std::move(s_->take(rank_, MailKey{r, round, kGather}, prefix(), op).blob);
    }
    return all;
  }

  void abort(const std::string& reason) override { s_->abort(reason); }

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }

  static trainsim::cuda::MemberReduce member_reduce(ReduceOp op) {
    return op == ReduceOp::max ? trainsim::cuda::MemberReduce::max : trainsim::cuda::MemberReduce::sum;
  }

  // A collective's contributions handed round: this member stages `count` elements of its buffer
  // from element `first` and posts them to every other member; `inputs` holds every member's
  // staged copy in member order, each ready in `stream`'s order. Inactive (nothing staged,
  // nothing to release) for one member.
  struct Exchange {
    bool active = false;
    int me = 0, n = 0;
    std::uint64_t tag = 0;
    std::string what;
    std::vector<int> members;
    std::vector<const void*> inputs;
    void* my_staging = nullptr;
  };
  Exchange exchange(const char* name, const void* data, std::size_t first, std::size_t count, DType dt,
                    std::span<const int> members, std::uint64_t tag, StreamHandle stream) {
    Exchange x;
    x.me = member_position(prefix(), members, rank_, s_->world_size(), tag, name);
    x.n = static_cast<int>(members.size());
    x.tag = tag;
    if (x.n > trainsim::cuda::kMaxRingMembers)
      throw std::invalid_argument(prefix() + name + " over " + std::to_string(x.n) + " members: the single-GPU world "
                                  "reduces at most " + std::to_string(trainsim::cuda::kMaxRingMembers));
    const std::size_t elem = element_bytes(dt, prefix());
    const std::string op_text = std::string(name) + " tag " + std::to_string(tag);
    x.what = prefix() + op_text;
    if (tracing()) {
      std::string m = x.what;
      m += " over ranks";
      for (int r : members) {
        m += ' ';
        m += std::to_string(r);
      }
      trace(m, "start");
    }
    s_->throw_if_aborted(prefix(), [&] { return op_text; });
    x.inputs.assign(static_cast<std::size_t>(x.n), nullptr);
    // Every member of two or more exchanges, even one with nothing to send: members that
    // disagree on the count then fail with a CommError below instead of leaving a peer waiting.
    if (x.n == 1) {
      x.inputs[0] = static_cast<const char*>(data) + first * elem;
      return x;
    }
    x.active = true;

    DeviceMessage mine;
    mine.tag = tag;
    mine.count = count;
    mine.dt = dt;
    mine.staging = stage(static_cast<const char*>(data) + first * elem, count * elem, stream, x.what);
    mine.ready = s_->events->record(stream, x.what);
    x.my_staging = mine.staging;
    for (int k = 0; k < x.n; ++k)
      if (k != x.me) s_->post(members[static_cast<std::size_t>(k)], MailKey{rank_, tag, kContribution}, DeviceMessage(mine));

    x.inputs[static_cast<std::size_t>(x.me)] = x.my_staging;
    x.members.assign(members.begin(), members.end());
    for (int k = 0; k < x.n; ++k) {
      if (k == x.me) continue;
      const int peer = members[static_cast<std::size_t>(k)];
      auto peer_op = [&] { return op_text + " (contribution of rank " + std::to_string(peer) + ")"; };
      DeviceMessage m = s_->take(rank_, MailKey{peer, tag, kContribution}, prefix(), peer_op);
      if (m.count != count || m.dt != dt)
        throw CommError(prefix() + peer_op() + ": rank " + std::to_string(peer) + " sends " + std::to_string(m.count) +
                        " " + std::string(dtype_name(m.dt)) + " elements, this rank " + std::to_string(count) + " " +
                        std::string(dtype_name(dt)) + " (members disagree on the buffer)");
      wait_event(stream, m.ready, x.what);
      x.inputs[static_cast<std::size_t>(k)] = m.staging;
    }
    trace(x.what, "every contribution in");
    return x;
  }
  // Frees this member's staging once every member has read it.
  void release(Exchange& x, StreamHandle stream) {
    DeviceMessage done;
    done.tag = x.tag;
    done.ready = s_->events->record(stream, x.what);
    for (int k = 0; k < x.n; ++k)
      if (k != x.me) s_->post(x.members[static_cast<std::size_t>(k)], MailKey{rank_, x.tag, kDone}, DeviceMessage(done));
    for (int k = 0; k < x.n; ++k) {
      if (k == x.me) continue;
      const int peer = x.members[static_cast<std::size_t>(k)];
      auto peer_op = [&] { return x.what + " (completion of rank " + std::to_string(peer) + ")"; };
      DeviceMessage m = s_->take(rank_, MailKey{peer, x.tag, kDone}, prefix(), peer_op);
      wait_event(stream, m.ready, x.what);
    }
    if (x.my_staging) check_cuda(cudaFreeAsync(x.my_staging, stream), x.what + ": cudaFreeAsync");
    trace(x.what, "done");
  }

  // A stream-ordered copy of `bytes` of `data` into a fresh device buffer.
  static void* stage(const void* data, std::size_t bytes, StreamHandle stream, const std::string& what) {
    if (bytes == 0) return nullptr;
    void* staging = nullptr;
    check_cuda(cudaMallocAsync(&staging, bytes, stream), what + ": cudaMallocAsync of " + std::to_string(bytes) + " bytes");
    check_cuda(cudaMemcpyAsync(staging, data, bytes, cudaMemcpyDeviceToDevice, stream), what + ": cudaMemcpyAsync");
    return staging;
  }

  std::shared_ptr<WorldState> s_;
  int rank_;
  std::uint64_t gathers_ = 0;
};

}  // namespace

struct DeviceWorld::Shared : WorldState {
  using WorldState::WorldState;
};

DeviceWorld::DeviceWorld(int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1)
    throw std::invalid_argument("DeviceWorld: world_size must be at least 1, got " + std::to_string(world_size));
  if (timeout.count() <= 0)
    throw std::invalid_argument("DeviceWorld: timeout must be positive, got " + std::to_string(timeout.count()) + " ms");
  shared_ = std::make_shared<Shared>(world_size, timeout);
}

DeviceWorld::~DeviceWorld() = default;

int DeviceWorld::world_size() const { return shared_->world_size(); }

std::unique_ptr<DeviceCommunicator> DeviceWorld::communicator(int rank) {
  if (rank < 0 || rank >= shared_->world_size())
    throw std::invalid_argument("DeviceWorld: no rank " + std::to_string(rank) + " in a world of " +
                                std::to_string(shared_->world_size()));
  return std::make_unique<DeviceWorldCommunicator>(shared_, rank);
}

}  // namespace trainsim::runtime::cuda
