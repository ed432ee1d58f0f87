#include "runtime/cuda/device_world.h"

#include <cuda_runtime_api.h>

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
  }

  void recv(int peer, std::uint64_t tag, void* data, std::size_t count, DType dt, StreamHandle stream) override {
    check_peer(prefix(), peer, s_->world_size(), "recv from");
    const std::size_t bytes = count * element_bytes(dt, prefix());
    auto op = [&] { return "recv from rank " + std::to_string(peer) + " tag " + std::to_string(tag); };
    DeviceMessage msg = s_->take(rank_, MailKey{peer, 0, kPointToPoint}, prefix(), op);
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
    const int me = member_position(prefix(), members, rank_, s_->world_size(), tag);
    const int n = static_cast<int>(members.size());
    if (n > trainsim::cuda::kMaxRingMembers)
      throw std::invalid_argument(prefix() + "all_reduce over " + std::to_string(n) + " members: the single-GPU world "
                                  "reduces at most " + std::to_string(trainsim::cuda::kMaxRingMembers));
    const std::size_t bytes = count * element_bytes(dt, prefix());
    const std::string op_text = "all_reduce tag " + std::to_string(tag);
    const std::string what = prefix() + op_text;
    s_->throw_if_aborted(prefix(), [&] { return op_text; });
    // One member, or nothing to reduce: x * round(1/1) and x / 1 are x.
    if (n == 1 || count == 0) return;

    DeviceMessage mine;
    mine.tag = tag;
    mine.count = count;
    mine.dt = dt;
    mine.staging = stage(data, bytes, stream, what);
    mine.ready = s_->events->record(stream, what);
    void* const my_staging = mine.staging;
    for (int k = 0; k < n; ++k)
      if (k != me) s_->post(members[k], MailKey{rank_, tag, kContribution}, DeviceMessage(mine));

    std::vector<const void*> inputs(static_cast<std::size_t>(n));
    inputs[me] = my_staging;
    for (int k = 0; k < n; ++k) {
      if (k == me) continue;
      auto peer_op = [&] { return "all_reduce tag " + std::to_string(tag) + " (contribution of rank " + std::to_string(members[k]) + ")"; };
      DeviceMessage m = s_->take(rank_, MailKey{members[k], tag, kContribution}, prefix(), peer_op);
      if (m.count != count || m.dt != dt)
        throw CommError(prefix() + peer_op() + ": rank " + std::to_string(members[k]) + " reduces " +
                        std::to_string(m.count) + " " + std::string(dtype_name(m.dt)) + " elements, this rank " +
                        std::to_string(count) + " " + std::string(dtype_name(dt)) + " (members disagree on the buffer)");
      wait_event(stream, m.ready, what);
      inputs[k] = m.staging;
    }
    trainsim::cuda::ring_reduce(data, inputs.data(), n, count, dt,
                                op == ReduceOp::max ? trainsim::cuda::MemberReduce::max : trainsim::cuda::MemberReduce::sum,
                                divide == Divide::before, divide == Divide::after, stream);

    // Free this member's staging once every member has read it.
    DeviceMessage done;
    done.tag = tag;
    done.ready = s_->events->record(stream, what);
    for (int k = 0; k < n; ++k)
      if (k != me) s_->post(members[k], MailKey{rank_, tag, kDone}, DeviceMessage(done));
    for (int k = 0; k < n; ++k) {
      if (k == me) continue;
      auto peer_op = [&] { return "all_reduce tag " + std::to_string(tag) + " (completion of rank " + std::to_string(members[k]) + ")"; };
      DeviceMessage m = s_->take(rank_, MailKey{members[k], tag, kDone}, prefix(), peer_op);
      wait_event(stream, m.ready, what);
    }
    check_cuda(cudaFreeAsync(my_staging, stream), what + ": cudaFreeAsync");
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
