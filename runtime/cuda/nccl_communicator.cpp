// NcclCommunicator (nccl_communicator.h): DeviceCommunicator over NCCL, one process per GPU.
#include "runtime/cuda/nccl_communicator.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

#include "kernels/cuda_check.h"
#include "kernels/kernels.h"
#include "runtime/comm/arguments.h"
#include "runtime/cuda/nccl_progress.h"
#include "runtime/launch/rendezvous.h"

namespace trainsim::runtime::cuda {
namespace {

// "{0,1,2}"; long lists end with the count of the ranks left out, so messages stay one line.
std::string ranks_text(std::span<const int> ranks) {
  constexpr std::size_t kShown = 16;
  std::string s = "{";
  for (std::size_t i = 0; i < ranks.size() && i < kShown; ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ranks[i]);
  }
  if (ranks.size() > kShown) s += ",... (" + std::to_string(ranks.size()) + " ranks)";
  return s + "}";
}

// NCCL_VERSION(X,Y,Z) is X*1000+Y*100+Z up to 2.8 and X*10000+Y*100+Z from 2.9 on.
std::string nccl_version_text(int code) {
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

ncclDataType_t nccl_type(DType dt, const std::string& where) {
  switch (dt) {
    case DType::fp32: return ncclFloat;
    case DType::fp16: return ncclHalf;
    case DType::bf16: return ncclBfloat16;
    case DType::tf32:
    case DType::fp8: break;
  }
  throw std::invalid_argument(where + ": buffers must hold fp32, fp16 or bf16, got " + std::string(dtype_name(dt)) +
                              " (cast to the wire format first)");
}

std::string count_text(std::size_t count, DType dt) { return std::to_string(count) + " " + std::string(dtype_name(dt)); }

// Lets the map of sub-communicators be searched with the caller's span, without a copy.
struct RanksLess {
  using is_transparent = void;
  bool operator()(std::span<const int> a, std::span<const int> b) const {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
  }
};

void check_world(int rank, int world_size, const char* who) {
  if (world_size < 1)
    throw std::invalid_argument(std::string(who) + ": world size must be at least 1, got " +
                                std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    throw std::invalid_argument(std::string(who) + ": rank " + std::to_string(rank) + " is outside [0, " +
                                std::to_string(world_size) + ")");
}

void check_timeout(std::chrono::milliseconds timeout, const char* who) {
  if (timeout <= std::chrono::milliseconds(0))
    throw std::invalid_argument(std::string(who) + ": timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
}

void check_links(const std::vector<NcclLink>& links, int world_size, const char* who) {
  for (std::size_t i = 0; i < links.size(); ++i) {
    const auto [from, to] = links[i];
    const std::string where = std::string(who) + ": link " + std::to_string(i) + " (" + std::to_string(from) +
                              " -> " + std::to_string(to) + ")";
    if (from < 0 || from >= world_size || to < 0 || to >= world_size)
      throw std::invalid_argument(where + ": not a pair of ranks (world size " + std::to_string(world_size) + ")");
    if (from == to) throw std::invalid_argument(where + ": a rank sends to itself on the world communicator");
  }
}

void check_groups(const std::vector<std::vector<int>>& groups, int world_size, const char* who) {
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& members = groups[g];
    const std::string where = std::string(who) + ": group " + std::to_string(g) + " " + ranks_text(members);
    if (members.empty()) throw std::invalid_argument(where + " is empty");
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] < 0 || members[i] >= world_size)
        throw std::invalid_argument(where + ": " + std::to_string(members[i]) + " is not a rank (world size " +
                                    std::to_string(world_size) + ")");
      if (i > 0 && members[i] <= members[i - 1])
        throw std::invalid_argument(where + ": members must be strictly ascending");
    }
  }
}

// Host staging memory for gather_host: page-locked, so the copies are asynchronous and the host
// waits for them by polling rather than inside the CUDA call.
struct PinnedFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};

// One NCCL communicator and the lock that every NCCL call on it takes (the header, "Threads").
// The slots exist before any NCCL call and are never added or removed afterwards, so abort()
// may walk them from any thread; only `handle` and the flags change, under `mutex`.
struct NcclSlot {
  explicit NcclSlot(std::string name_) : name(std::move(name_)) {}
  const std::string name;  // "the world communicator", for messages
  std::mutex mutex;
  ncclComm_t handle = nullptr;  // null before its init or split, and after its abort
  // Recorded in the open group of the thread that issues the group: NCCL's per-thread group
  // state points at the communicator until that thread's ncclGroupEnd, so an abort from another
  // thread is deferred to it (abort_deferred) instead of freeing the communicator under it.
  bool in_group = false;
  bool abort_deferred = false;
};

// ncclGetLastError's text, or "" when it has none (NCCL keeps one text per process).
std::string last_error_text(ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return last != nullptr ? std::string(last) : std::string();
}

}  // namespace

struct NcclCommunicator::Impl {
  Impl(int rank_, int world_size_, int device_) : rank(rank_), world_size(world_size_), device(device_) {}
  ~Impl();

  const int rank, world_size, device;
  std::string device_name;
  int nccl_version = 0;

  // Every slot is made in init() before the first NCCL call (and before any watchdog guard can
  // fire); the maps do not change afterwards.
  std::unique_ptr<NcclSlot> world;
  std::map<std::vector<int>, std::unique_ptr<NcclSlot>, RanksLess> subgroups;  // by member list
  std::string groups_text;  // for "no communicator for members" errors
  std::map<NcclLink, std::unique_ptr<NcclSlot>> links;  // by (from, to): that direction's sends
  // Where a nonblocking ncclCommSplit of the world writes the new communicator when it completes
  // (NCCL stores it from its own thread). Read and cleared under world->mutex, only once the
  // world's state has left ncclInProgress or after the world was aborted (either way NCCL's job
  // has ended); abort() aborts a communicator left here.
  ncclComm_t split_result = nullptr;

  // Every slot, world last.
  template <class F>
  void for_each_slot(F&& f) const {
    for (const auto& entry : subgroups) f(*entry.second);
    for (const auto& entry : links) f(*entry.second);
    if (world) f(*world);
  }

  cudaStream_t gather_stream = nullptr;
  std::unique_ptr<void, DeviceFree> device_scratch;
  std::size_t device_scratch_bytes = 0;
  std::unique_ptr<void, PinnedFree> pinned_scratch;
  std::size_t pinned_scratch_bytes = 0;

  // Work that must follow the launch of the enclosing group (see the header, "Groups"), and the
  // communicators the group has touched; all of it belongs to the thread that issues the group.
  int group_depth = 0;
  struct DeferredScale {
    void* data;
    std::size_t count;
    float factor;
    DType dt;
    StreamHandle stream;
    std::string op;
  };
  std::vector<DeferredScale> deferred_scales;
  std::vector<std::pair<ncclRedOp_t, NcclSlot*>> deferred_op_destroys;
  std::vector<NcclSlot*> group_slots;
  // The thread whose group is open (group_depth > 0), for abort(); a default id when none is.
  std::atomic<std::thread::id> group_thread{};

  // abort_mutex guards abort_reason; `aborted` is set under it, before any communicator is aborted.
  mutable std::mutex abort_mutex;
  std::string abort_reason;
  std::atomic<bool> aborted{false};

  // Last member: built once everything it may touch exists, and reset first in ~Impl so no
  // timeout handler runs while the communicators are being torn down.
  std::unique_ptr<Watchdog> watchdog;

  std::string who() const { return "rank " + std::to_string(rank) + ": "; }

  bool is_aborted() const { return aborted.load(std::memory_order_acquire); }

  void throw_if_aborted() const {
    if (!is_aborted()) return;
    std::lock_guard lock(abort_mutex);
    throw CommError(abort_reason);
  }

  void make_current() const {
    const cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess)
      throw CommError(who() + "cudaSetDevice(" + std::to_string(device) + "): " + cudaGetErrorString(err));
  }

  // ncclCommAbort on the slot's communicator, once, under its lock; deferred to the group's
  // thread while the communicator is in an open group (NcclSlot::in_group). For the world, also
  // a communicator a split left in split_result.
  void abort_slot(NcclSlot& slot) {
    std::lock_guard lock(slot.mutex);
    if (slot.in_group) {
      slot.abort_deferred = true;
      return;
    }
    if (slot.handle != nullptr) (void)ncclCommAbort(slot.handle);  // nothing else to try if it fails
    slot.handle = nullptr;
    if (&slot == world.get() && split_result != nullptr) {
      // The world's abort has joined the split's job, so NCCL no longer writes split_result.
      (void)ncclCommAbort(split_result);
      split_result = nullptr;
    }
  }

  void abort(const std::string& reason) {
    {
      std::lock_guard lock(abort_mutex);
      if (is_aborted()) return;
      abort_reason = reason.empty() ? who() + "aborted" : reason;
      aborted.store(true, std::memory_order_release);
    }
    // Outside abort_mutex: a waiting thread must still be able to read the reason and throw.
    // The flag is set first, so a thread that polls between our aborts stops at its next check;
    // each communicator's lock makes its ncclCommAbort wait for a call in progress on it, which
    // with nonblocking communicators returns promptly (ncclInProgress instead of blocking).
    auto abort_all = [this] {
      (void)cudaSetDevice(device);  // the watchdog's thread has never chosen one
      for_each_slot([&](NcclSlot& slot) { abort_slot(slot); });
    };
    // On the thread of an open group (a call inside it failed), NCCL would queue each
    // ncclCommAbort into that group until its ncclGroupEnd: abort from a thread of our own, with
    // no group, and wait for it. The group's own communicators are deferred either way.
    if (group_thread.load(std::memory_order_acquire) == std::this_thread::get_id()) {
      try {
        std::thread aborter(abort_all);
        aborter.join();
        return;
      } catch (const std::system_error&) {
        // No thread to be had: abort here, queued behind the group as before.
      }
    }
    abort_all();
  }

  // Throws CommError for a failed NCCL call (`last`: ncclGetLastError, read under the call's
  // lock). A communicator whose call failed for any reason but its arguments is unusable (NCCL's
  // documented error classes), so this rank's communicators are aborted first; when an abort
  // already happened (the watchdog's, say, making this call fail), its reason is the cause.
  [[noreturn]] void fail(ncclResult_t res, const std::string& last, const std::string& op) {
    std::string message = who() + op + ": " + ncclGetErrorString(res);
    {
      std::lock_guard lock(abort_mutex);
      if (is_aborted()) throw CommError(abort_reason + " (then " + message + ")");
    }
    if (!last.empty()) message += " (" + last + ")";
    if (res != ncclInvalidArgument && res != ncclInvalidUsage) abort(message);
    throw CommError(message);
  }

  // For the calls that touch no communicator (ncclGetVersion, ncclGroupStart, nested ncclGroupEnd).
  void check_global(ncclResult_t res, const std::string& op) {
    if (res == ncclSuccess || res == ncclInProgress) return;
    fail(res, last_error_text(nullptr), op);
  }

  void check_cuda(cudaError_t err, const std::string& op) {
    if (err == cudaSuccess) return;
    const std::string message = who() + ::trainsim::cuda::cuda_error_text(err, op);
    abort(message);
    throw CommError(message);
  }

  // One ncclCommGetAsyncError on `slot`, under its lock. `failure` gets the error's text.
  Polled poll_once(NcclSlot& slot, std::string& failure) {
    std::lock_guard lock(slot.mutex);
    if (slot.handle == nullptr) {
      failure = "the communicator was aborted";
      return Polled::failed;
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t res = ncclCommGetAsyncError(slot.handle, &state);
    if (res != ncclSuccess) state = res;
    if (state == ncclInProgress) return Polled::in_progress;
    if (state == ncclSuccess) return Polled::done;
    failure = ncclGetErrorString(state);
    const std::string last = last_error_text(slot.handle);
    if (!last.empty()) failure += " (" + last + ")";
    return Polled::failed;
  }

  // Waits until `slot` leaves ncclInProgress (nccl_progress.h): polls under its lock, pauses
  // without it, stops when abort() is called (the watchdog's timeout arrives that way). Throws
  // CommError with the abort's reason, or, when the communicator failed, aborts with
  // "rank R: <op>: <slot> failed: <error>" and throws that.
  void settle(NcclSlot& slot, const std::string& op) {
    std::string failure;
    const Settled settled = wait_until_settled([&] { return poll_once(slot, failure); },
                                               [&] { return is_aborted() ? Stop::aborted : Stop::none; }, poll_pause);
    if (settled == Settled::done) return;
    throw_if_aborted();
    if (settled == Settled::timed_out) failure = "timed out in ncclInProgress";
    const std::string message = who() + op + ": " + slot.name + " failed: " + failure;
    abort(message);
    throw CommError(message);
  }

  // Runs one NCCL call on `slot`'s communicator under its lock. Outside a group, a call that
  // returns ncclInProgress is waited for (settle) before this returns, as NCCL requires before
  // the next call on the communicator or new work on its stream; inside one, the slot joins the
  // group and group_end waits for it.
  template <class Call>
  void issue(NcclSlot& slot, const std::string& op, Call&& call) {
    ncclResult_t res = ncclSuccess;
    std::string last;
    {
      std::lock_guard lock(slot.mutex);
      if (slot.handle == nullptr) {
        throw_if_aborted();
        throw CommError(who() + op + ": " + slot.name + " was aborted");
      }
      res = call(slot.handle);
      if (res != ncclSuccess && res != ncclInProgress) last = last_error_text(slot.handle);
      if (group_depth > 0 && !slot.in_group) {
        slot.in_group = true;
        group_slots.push_back(&slot);
      }
    }
    if (res == ncclInProgress) {
      if (group_depth == 0) settle(slot, op);
      return;
    }
    if (res != ncclSuccess) fail(res, last, op);
  }

  // The group's communicators leave it (after ncclGroupEnd on this thread): aborts deferred
  // while they were in it happen now.
  void leave_group(const std::vector<NcclSlot*>& slots) {
    for (NcclSlot* slot : slots) {
      std::lock_guard lock(slot->mutex);
      slot->in_group = false;
      if (!slot->abort_deferred) continue;
      slot->abort_deferred = false;
      if (slot->handle != nullptr) (void)ncclCommAbort(slot->handle);
      slot->handle = nullptr;
    }
  }

  // The first communicator in an error state, described; nullopt when all are healthy or an
  // abort already happened (the caller's throw_if_aborted reports that). Communicators in an
  // open group (another thread's, NCCL's rule: one thread per group) are not polled.
  std::optional<std::string> first_async_error() {
    std::optional<std::string> first;
    for_each_slot([&](NcclSlot& slot) {
      if (first || is_aborted()) return;
      std::string failure;
      {
        std::lock_guard lock(slot.mutex);
        if (slot.in_group || slot.handle == nullptr) return;
      }
      if (poll_once(slot, failure) == Polled::failed && !is_aborted()) first = slot.name + " failed: " + failure;
    });
    return first;
  }

  // Spins until `stream` is idle (see the header, "Waiting").
  void wait(cudaStream_t stream, const std::string& what) {
    auto guard = watchdog->guard(what);
    for (int spin = 0;; ++spin) {
      throw_if_aborted();
      const cudaError_t state = cudaStreamQuery(stream);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) check_cuda(state, what + ": the stream reported an error");
      if (auto failure = first_async_error()) {
        const std::string message = who() + what + ": " + *failure;
        abort(message);
        throw CommError(message);
      }
      poll_pause(spin + 1);
    }
  }

  // A watchdog guard for a call that launches work now; calls inside a group only record, and
  // group_end is guarded instead.
  std::optional<Watchdog::Guard> guard_if_launching(const std::string& op) {
    std::optional<Watchdog::Guard> guard;
    if (group_depth == 0) guard.emplace(watchdog->guard(op));
    return guard;
  }

  void scale(void* data, std::size_t count, float factor, DType dt, StreamHandle stream, const std::string& op) {
    try {
      ::trainsim::cuda::scale_inplace(data, count, factor, dt, stream);
    } catch (const std::exception& e) {
      const std::string message = who() + op + ": " + e.what();
      abort(message);
      throw CommError(message);
    }
  }

  void init(std::span<const std::uint8_t> unique_id, const std::vector<std::vector<int>>& groups,
            const std::vector<NcclLink>& wanted_links);
  NcclSlot* communicator_for(std::span<const int> members, std::uint64_t tag) const;
  // The communicator of the sends from `from` to `to` (one of them this rank), and the other's
  // rank in it: the link's own when create() was given it (two members, ranked by world rank),
  // else the world's.
  std::pair<NcclSlot*, int> p2p_communicator(int from, int to) const {
    const int peer = from == rank ? to : from;
    const auto it = links.find({from, to});
    if (it == links.end()) return {world.get(), peer};
    return {it->second.get(), peer == std::min(from, to) ? 0 : 1};
  }

  // What send and recv check before launching: the peer, the format, the buffer, the state.
  // Returns the op's name for errors, "send tag 7 (peer 3, 1024 bf16)"; sets `type`.
  std::string prepare_p2p(bool sending, int peer, std::uint64_t tag, const void* data, std::size_t count, DType dt,
                          ncclDataType_t& type) {
    check_peer(who(), peer, world_size, sending ? "send to" : "recv from");
    const std::string op = std::string(sending ? "send" : "recv") + " tag " + std::to_string(tag) + " (peer " + std::to_string(peer) +
                           ", " + count_text(count, dt) + ")";
    type = nccl_type(dt, who() + op);
    if (data == nullptr && count > 0) throw std::invalid_argument(who() + op + ": data is null");
    throw_if_aborted();
    make_current();
    return op;
  }
  void ensure_scratch(std::size_t device_bytes, std::size_t pinned_bytes);
};

NcclCommunicator::Impl::~Impl() {
  watchdog.reset();
  (void)cudaSetDevice(device);
  // While an exception unwinds, this rank has stopped taking part: a collective destroy would
  // wait for peers that may never come, so abort (local) instead.
  if (!is_aborted() && std::uncaught_exceptions() > 0)
    abort(who() + "communicator destroyed while an exception was propagating");
  // An unclosed group holds recorded calls that were never launched; NCCL refuses to destroy
  // a communicator inside a group, and launching them now could wait for peers. Its
  // communicators stay in_group, so abort() leaves them to the process's exit (NCCL's
  // per-thread group state still points at them).
  if (!is_aborted() && group_depth > 0) abort(who() + "communicator destroyed inside group_begin/group_end");
  if (is_aborted()) {
    // The handles are gone. Device and pinned memory are left to the process's exit: freeing
    // them synchronises the device, which a kernel still spinning after the abort could stall.
    (void)device_scratch.release();
    (void)pinned_scratch.release();
  } else {
    for (auto& [op, slot] : deferred_op_destroys) {
      std::lock_guard lock(slot->mutex);
      if (slot->handle != nullptr) (void)ncclRedOpDestroy(op, slot->handle);
    }
    for_each_slot([](NcclSlot& slot) {
      std::lock_guard lock(slot.mutex);
      if (slot.handle != nullptr) (void)ncclCommDestroy(slot.handle);
      slot.handle = nullptr;
    });
  }
  if (gather_stream != nullptr) (void)cudaStreamDestroy(gather_stream);
}

void NcclCommunicator::Impl::init(std::span<const std::uint8_t> unique_id,
                                  const std::vector<std::vector<int>>& groups,
                                  const std::vector<NcclLink>& wanted_links) {
  make_current();
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  device_name = prop.name;
  check_global(ncclGetVersion(&nccl_version), "ncclGetVersion");
  check_cuda(cudaStreamCreateWithFlags(&gather_stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");

  // Distinct member sets that need a communicator of their own: not the world (it has one) and
  // not a single rank (an all-reduce over oneself is the identity and needs none).
  std::vector<std::vector<int>> distinct;
  for (const auto& g : groups) {
    if (!groups_text.empty()) groups_text += ' ';
    groups_text += ranks_text(g);
    if (g.size() == static_cast<std::size_t>(world_size) || g.size() == 1) continue;
    if (std::find(distinct.begin(), distinct.end(), g) == distinct.end()) distinct.push_back(g);
  }
  // Then one set per distinct link: both directions of a pair have the same members, and each its
  // own communicator.
  const std::size_t first_link = distinct.size();
  std::vector<NcclLink> link_of;
  for (const NcclLink& l : wanted_links) {
    if (std::find(link_of.begin(), link_of.end(), l) != link_of.end()) continue;
    link_of.push_back(l);
    distinct.push_back({std::min(l.first, l.second), std::max(l.first, l.second)});
  }
  // First fit into layers of disjoint sets, one ncclCommSplit per layer. Every rank computes the
  // same layers from the same list, so they call the same splits in the same order.
  std::vector<std::vector<std::size_t>> layers;
  std::vector<std::vector<char>> used;  // per layer: rank taken
  for (std::size_t g = 0; g < distinct.size(); ++g) {
    std::size_t layer = 0;
    for (; layer < layers.size(); ++layer) {
      const auto& taken = used[layer];
      if (std::none_of(distinct[g].begin(), distinct[g].end(), [&](int r) { return taken[static_cast<std::size_t>(r)]; }))
        break;
    }
    if (layer == layers.size()) {
      layers.emplace_back();
      used.emplace_back(static_cast<std::size_t>(world_size), 0);
    }
    layers[layer].push_back(g);
    for (int r : distinct[g]) used[layer][static_cast<std::size_t>(r)] = 1;
  }

  // Every slot this rank will hold, before the first NCCL call and the first watchdog guard, so
  // abort() never walks maps that are still growing. A set this rank is not in gets no slot.
  world = std::make_unique<NcclSlot>("the world communicator");
  for (std::size_t g = 0; g < distinct.size(); ++g) {
    if (!std::binary_search(distinct[g].begin(), distinct[g].end(), rank)) continue;
    if (g < first_link) {
      subgroups.emplace(distinct[g], std::make_unique<NcclSlot>("the communicator of members " + ranks_text(distinct[g])));
    } else {
      const NcclLink l = link_of[g - first_link];
      links.emplace(l, std::make_unique<NcclSlot>("the communicator of sends " + std::to_string(l.first) + " -> " +
                                                  std::to_string(l.second)));
    }
  }

  // Nonblocking communicators (the header, "Nonblocking communicators"): init and splits return
  // at once (ncclInProgress) and finish in NCCL's threads while settle() polls, so abort() can
  // come in at any point. Children get the same config.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;

  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof id);
  {
    const std::string op = "ncclCommInitRankConfig (" + std::to_string(world_size) + " ranks, GPU " +
                           std::to_string(device) + ", nonblocking)";
    auto guard = watchdog->guard(op);
    ncclResult_t res = ncclSuccess;
    std::string last;
    {
      std::lock_guard lock(world->mutex);
      throw_if_aborted();
      res = ncclCommInitRankConfig(&world->handle, world_size, id, rank, &config);
      if (res != ncclSuccess && res != ncclInProgress) last = last_error_text(world->handle);
    }
    if (res != ncclSuccess && res != ncclInProgress) fail(res, last, op);
    settle(*world, op);
  }

  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    int color = NCCL_SPLIT_NOCOLOR;
    std::string sets;
    for (std::size_t j = 0; j < layers[layer].size(); ++j) {
      const auto& members = distinct[layers[layer][j]];
      if (j > 0) sets += ' ';
      sets += ranks_text(members);
      if (std::binary_search(members.begin(), members.end(), rank)) color = static_cast<int>(j);
    }
    const std::string op = "ncclCommSplit (split " + std::to_string(layer + 1) + " of " +
                           std::to_string(layers.size()) + ": members " + sets + ")";
    throw_if_aborted();
    auto guard = watchdog->guard(op);
    // The split is a call on the world: under its lock, with the result written to split_result
    // when NCCL's job completes, which issue() waits for by polling the world (the parent).
    issue(*world, op, [&](ncclComm_t w) { return ncclCommSplit(w, color, rank, &split_result, &config); });
    if (color == NCCL_SPLIT_NOCOLOR) continue;
    const std::size_t set = layers[layer][static_cast<std::size_t>(color)];
    NcclSlot& slot = set < first_link ? *subgroups.at(distinct[set]) : *links.at(link_of[set - first_link]);
    bool adopted = false;
    {
      std::scoped_lock lock(world->mutex, slot.mutex);
      const ncclComm_t child = split_result;
      split_result = nullptr;
      if (is_aborted()) {
        // abort() may have passed this slot already: the child is ours to abort.
        if (child != nullptr) (void)ncclCommAbort(child);
      } else if (child != nullptr) {
        slot.handle = child;
        adopted = true;
      }
    }
    throw_if_aborted();
    if (!adopted) {
      const std::string message = who() + op + ": NCCL returned no communicator for this rank";
      abort(message);
      throw CommError(message);
    }
    settle(slot, op);
  }
}

NcclSlot* NcclCommunicator::Impl::communicator_for(std::span<const int> members, std::uint64_t tag) const {
  if (members.size() == static_cast<std::size_t>(world_size)) return world.get();
  if (members.size() == 1) return nullptr;
  const auto it = subgroups.find(members);
  if (it == subgroups.end())
    throw std::invalid_argument(who() + "all_reduce tag " + std::to_string(tag) + ": no communicator for members " +
                                ranks_text(members) + "; NcclCommunicator::create was given " +
                                (groups_text.empty() ? std::string("no groups") : groups_text));
  return it->second.get();
}

void NcclCommunicator::Impl::ensure_scratch(std::size_t device_bytes, std::size_t pinned_bytes) {
  if (device_bytes > device_scratch_bytes) {
    device_scratch.reset();
    device_scratch_bytes = 0;
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, device_bytes), "gather_host: cudaMalloc of " + std::to_string(device_bytes) + " bytes");
    device_scratch.reset(p);
    device_scratch_bytes = device_bytes;
  }
  if (pinned_bytes > pinned_scratch_bytes) {
    pinned_scratch.reset();
    pinned_scratch_bytes = 0;
    void* p = nullptr;
    check_cuda(cudaMallocHost(&p, pinned_bytes),
               "gather_host: cudaMallocHost of " + std::to_string(pinned_bytes) + " bytes");
    pinned_scratch.reset(p);
    pinned_scratch_bytes = pinned_bytes;
  }
}

// ---------------------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCommunicator::~NcclCommunicator() = default;

std::vector<std::uint8_t> NcclCommunicator::make_unique_id() {
  ncclUniqueId id;
  const ncclResult_t res = ncclGetUniqueId(&id);
  if (res != ncclSuccess)
    throw CommError(std::string("ncclGetUniqueId: ") + ncclGetErrorString(res) + " (" + ncclGetLastError(nullptr) +
                    ")");
  std::vector<std::uint8_t> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(const LaunchEnv& env,
                                                           const std::vector<std::vector<int>>& groups,
                                                           std::chrono::milliseconds timeout,
                                                           const std::vector<NcclLink>& links) {
  const char* who = "NcclCommunicator::create";
  check_world(env.rank, env.world_size, who);
  if (env.local_rank < 0)
    throw std::invalid_argument(std::string(who) + ": local rank must not be negative, got " +
                                std::to_string(env.local_rank));
  check_timeout(timeout, who);
  check_groups(groups, env.world_size, who);
  check_links(links, env.world_size, who);

  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0)
    throw CommError("rank " + std::to_string(env.rank) + ": no usable CUDA device (" +
                    (err != cudaSuccess ? std::string(cudaGetErrorString(err)) : std::string("none visible")) + ")");
  const int device = env.local_rank % devices;

  std::vector<std::uint8_t> id;
  if (env.rank == 0) id = make_unique_id();
  const std::vector<std::uint8_t> shared = broadcast_from_rank0(env, id, timeout);
  return init_from_id(shared, env.rank, env.world_size, device, groups, timeout, links);
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::init_from_id(std::span<const std::uint8_t> unique_id, int rank,
                                                                 int world_size, int device,
                                                                 const std::vector<std::vector<int>>& groups,
                                                                 std::chrono::milliseconds timeout,
                                                                 const std::vector<NcclLink>& links) {
  const char* who = "NcclCommunicator::init_from_id";
  check_world(rank, world_size, who);
  check_timeout(timeout, who);
  check_groups(groups, world_size, who);
  check_links(links, world_size, who);
  if (unique_id.size() != sizeof(ncclUniqueId))
    throw std::invalid_argument(std::string(who) + ": the unique id must be " + std::to_string(sizeof(ncclUniqueId)) +
                                " bytes (ncclUniqueId), got " + std::to_string(unique_id.size()));
  if (device < 0) throw std::invalid_argument(std::string(who) + ": device must not be negative");

  auto impl = std::make_unique<Impl>(rank, world_size, device);
  Impl* raw = impl.get();
  impl->watchdog = std::make_unique<Watchdog>(rank, timeout, [raw](const std::string& message) { raw->abort(message); });
  impl->init(unique_id, groups, links);
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl)));
}

// ---------------------------------------------------------------------------------------
// DeviceCommunicator
// ---------------------------------------------------------------------------------------

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::world_size() const { return impl_->world_size; }
int NcclCommunicator::device() const { return impl_->device; }
bool NcclCommunicator::aborted() const { return impl_->aborted.load(std::memory_order_acquire); }
Watchdog& NcclCommunicator::watchdog() { return *impl_->watchdog; }

std::string NcclCommunicator::describe() const {
  return "NCCL " + nccl_version_text(impl_->nccl_version) + ", rank " + std::to_string(impl_->rank) + " of " +
         std::to_string(impl_->world_size) + ", GPU " + std::to_string(impl_->device) + " (" + impl_->device_name +
         ")";
}

void NcclCommunicator::send(int peer, std::uint64_t tag, const void* data, std::size_t count, DType dt,
                            StreamHandle stream) {
  Impl& m = *impl_;
  ncclDataType_t type;
  const std::string op = m.prepare_p2p(true, peer, tag, data, count, dt, type);
  auto guard = m.guard_if_launching(op);
  const auto [slot, comm_peer] = m.p2p_communicator(m.rank, peer);
  m.issue(*slot, op, [&](ncclComm_t comm) { return ncclSend(data, count, type, comm_peer, comm, stream); });
}

void NcclCommunicator::recv(int peer, std::uint64_t tag, void* data, std::size_t count, DType dt, StreamHandle stream) {
  Impl& m = *impl_;
  ncclDataType_t type;
  const std::string op = m.prepare_p2p(false, peer, tag, data, count, dt, type);
  auto guard = m.guard_if_launching(op);
  const auto [slot, comm_peer] = m.p2p_communicator(peer, m.rank);
  m.issue(*slot, op, [&](ncclComm_t comm) { return ncclRecv(data, count, type, comm_peer, comm, stream); });
}

void NcclCommunicator::group_begin() {
  Impl& m = *impl_;
  m.throw_if_aborted();
  m.make_current();
  // ncclGroupStart only opens this thread's group: it touches no communicator, so takes no lock.
  m.check_global(ncclGroupStart(), "group_begin (ncclGroupStart)");
  if (m.group_depth++ == 0) m.group_thread.store(std::this_thread::get_id(), std::memory_order_release);
}

void NcclCommunicator::group_end() {
  Impl& m = *impl_;
  if (m.group_depth == 0) throw std::logic_error(m.who() + "group_end without group_begin");
  --m.group_depth;
  m.make_current();
  if (m.group_depth > 0) {
    // Nested: only closes a level of this thread's group, launches nothing.
    const ncclResult_t res = ncclGroupEnd();
    m.throw_if_aborted();
    m.check_global(res, "group_end (nested, ncclGroupEnd)");
    return;
  }
  auto scales = std::move(m.deferred_scales);
  auto op_destroys = std::move(m.deferred_op_destroys);
  auto slots = std::move(m.group_slots);
  m.deferred_scales.clear();
  m.deferred_op_destroys.clear();
  m.group_slots.clear();
  m.group_thread.store(std::thread::id(), std::memory_order_release);
  const std::string op = "group_end (ncclGroupEnd)";
  auto guard = m.watchdog->guard(op);
  // Even after an abort the group is closed, so NCCL's per-thread state lets go of its
  // communicators (nonblocking: this launches in the background and returns), and then the
  // aborts deferred while they were in the group happen (leave_group).
  ncclResult_t res = ncclSuccess;
  std::string last;
  {
    // ncclGroupEnd launches on every communicator of the group: all their locks, taken in one
    // global order (by address), so two threads' groups cannot deadlock on them.
    std::sort(slots.begin(), slots.end(), std::less<NcclSlot*>());
    std::vector<std::unique_lock<std::mutex>> locks;
    locks.reserve(slots.size());
    for (NcclSlot* slot : slots) locks.emplace_back(slot->mutex);
    res = ncclGroupEnd();
    if (res != ncclSuccess && res != ncclInProgress) {
      last = last_error_text(nullptr);
      // The operators are not used by a group that failed to launch.
      if (!m.is_aborted())
        for (auto& [redop, slot] : op_destroys)
          if (slot->handle != nullptr) (void)ncclRedOpDestroy(redop, slot->handle);
    }
  }
  m.leave_group(slots);
  m.throw_if_aborted();
  if (res != ncclSuccess && res != ncclInProgress) m.fail(res, last, op);
  // Nonblocking group (NCCL's "Nonblocking Group Operation"): ncclInProgress means the kernels
  // are still being issued; every communicator of the group must leave ncclInProgress before
  // the next NCCL call on it or new work on its streams (the deferred scales below).
  if (res == ncclInProgress)
    for (NcclSlot* slot : slots) m.settle(*slot, op);
  for (auto& [redop, slot] : op_destroys)
    m.issue(*slot, op + ": ncclRedOpDestroy", [&, r = redop](ncclComm_t comm) { return ncclRedOpDestroy(r, comm); });
  for (const auto& s : scales) m.scale(s.data, s.count, s.factor, s.dt, s.stream, s.op);
}

// all_reduce and reduce_scatter: the same operator, divides and error paths; reduce_scatter (in
// place, as NCCL allows: this member's chunk is the receive buffer) divides only its own chunk.
enum class NcclCommunicator::Reduction : int { all_reduce, reduce_scatter };

void NcclCommunicator::all_reduce(void* data, std::size_t count, DType dt, std::span<const int> members,
                                  std::uint64_t tag, ReduceOp op, Divide divide, StreamHandle stream) {
  reduce(Reduction::all_reduce, data, count, dt, members, tag, op, divide, stream);
}

void NcclCommunicator::reduce_scatter(void* data, std::size_t count, DType dt, std::span<const int> members,
                                      std::uint64_t tag, ReduceOp op, Divide divide, StreamHandle stream) {
  reduce(Reduction::reduce_scatter, data, count, dt, members, tag, op, divide, stream);
}

void NcclCommunicator::all_gather(void* data, std::size_t count, DType dt, std::span<const int> members,
                                  std::uint64_t tag, StreamHandle stream) {
  Impl& m = *impl_;
  const int me = member_position(m.who(), members, m.rank, m.world_size, tag, "all_gather");
  check_equal_chunks(m.who(), count, members.size(), tag, "all_gather");
  const std::string what = "all_gather tag " + std::to_string(tag) + " (members " + ranks_text(members) + ", " +
                           count_text(count, dt) + ")";
  const ncclDataType_t type = nccl_type(dt, m.who() + what);
  if (data == nullptr && count > 0) throw std::invalid_argument(m.who() + what + ": data is null");
  NcclSlot* const slot = m.communicator_for(members, tag);
  m.throw_if_aborted();
  if (slot == nullptr || count == 0) return;
  m.make_current();
  const std::size_t per = count / members.size();
  const void* mine = static_cast<const char*>(data) + static_cast<std::size_t>(me) * per * static_cast<std::size_t>(dtype_bytes(dt));
  auto guard = m.guard_if_launching(what);
  m.issue(*slot, what, [&](ncclComm_t comm) { return ncclAllGather(mine, data, per, type, comm, stream); });
}

void NcclCommunicator::reduce(Reduction kind, void* data, std::size_t count, DType dt, std::span<const int> members,
                              std::uint64_t tag, ReduceOp op, Divide divide, StreamHandle stream) {
  Impl& m = *impl_;
  const char* name = kind == Reduction::all_reduce ? "all_reduce" : "reduce_scatter";
  const int me = member_position(m.who(), members, m.rank, m.world_size, tag, name);
  if (kind == Reduction::reduce_scatter) check_equal_chunks(m.who(), count, members.size(), tag, name);
  const std::string what = std::string(name) + " tag " + std::to_string(tag) + " (members " + ranks_text(members) + ", " +
                           count_text(count, dt) + ", " + (op == ReduceOp::sum ? "sum" : "max") +
                           (divide == Divide::before ? ", divide before" : divide == Divide::after ? ", divide after" : "") +
                           ")";
  const ncclDataType_t type = nccl_type(dt, m.who() + what);
  if (data == nullptr && count > 0) throw std::invalid_argument(m.who() + what + ": data is null");
  NcclSlot* const slot = m.communicator_for(members, tag);
  m.throw_if_aborted();
  // Over oneself every op and divide is the identity (x * round(1/1) = x), and so is no data.
  if (slot == nullptr || count == 0) return;
  m.make_current();

  const int n = static_cast<int>(members.size());
  // Divide::before on a sum: NCCL multiplies each contribution by the scalar, in the buffer's
  // type. On a max, dividing before or after is the same monotone rounding of the max, done after.
  const bool premultiply = divide == Divide::before && op == ReduceOp::sum;
  const float inverse = 1.0f / static_cast<float>(n);
  // The scalar 1/n in the buffer's type, the value the in-process communicator uses.
  const __half inverse_fp16 = __float2half_rn(inverse);
  const __nv_bfloat16 inverse_bf16 = __float2bfloat16_rn(inverse);
  float post_factor = 1.0f;
  if (divide == Divide::after) post_factor = inverse;
  if (divide == Divide::before && op == ReduceOp::max)
    post_factor = dt == DType::fp16 ? __half2float(inverse_fp16)
                  : dt == DType::bf16 ? __bfloat162float(inverse_bf16)
                                      : inverse;

  auto guard = m.guard_if_launching(what);
  ncclRedOp_t redop = op == ReduceOp::max ? ncclMax : ncclSum;
  if (premultiply) {
    float scalar_fp32 = inverse;
    __half scalar_fp16 = inverse_fp16;
    __nv_bfloat16 scalar_bf16 = inverse_bf16;
    void* scalar = dt == DType::fp16   ? static_cast<void*>(&scalar_fp16)
                   : dt == DType::bf16 ? static_cast<void*>(&scalar_bf16)
                                       : static_cast<void*>(&scalar_fp32);
    m.issue(*slot, what + ": ncclRedOpCreatePreMulSum", [&](ncclComm_t comm) {
      return ncclRedOpCreatePreMulSum(&redop, scalar, type, ncclScalarHostImmediate, comm);
    });
  }
  // What this member ends up owning: the whole buffer, or its chunk of it.
  const std::size_t owned_count = kind == Reduction::all_reduce ? count : count / members.size();
  void* const owned = static_cast<char*>(data) + (kind == Reduction::all_reduce ? 0 : static_cast<std::size_t>(me) * owned_count * static_cast<std::size_t>(dtype_bytes(dt)));
  auto collective = [&](ncclComm_t comm) {
    return kind == Reduction::all_reduce ? ncclAllReduce(data, data, count, type, redop, comm, stream)
                                         : ncclReduceScatter(data, owned, owned_count, type, redop, comm, stream);
  };
  if (!premultiply) {
    m.issue(*slot, what, collective);
  } else {
    try {
      m.issue(*slot, what, collective);
    } catch (...) {
      // The operator is not used by a call that failed; after an abort it went with the communicator.
      if (!m.is_aborted()) {
        std::lock_guard lock(slot->mutex);
        if (slot->handle != nullptr) (void)ncclRedOpDestroy(redop, slot->handle);
      }
      throw;
    }
    if (m.group_depth > 0) {
      // NCCL may read the operator until the group is launched: destroyed after group_end.
      m.deferred_op_destroys.emplace_back(redop, slot);
    } else {
      m.issue(*slot, what + ": ncclRedOpDestroy", [&](ncclComm_t comm) { return ncclRedOpDestroy(redop, comm); });
    }
  }
  if (post_factor != 1.0f) {
    if (m.group_depth > 0)
      m.deferred_scales.push_back({owned, owned_count, post_factor, dt, stream, what});
    else
      m.scale(owned, owned_count, post_factor, dt, stream, what);
  }
}

std::vector<std::vector<std::uint8_t>> NcclCommunicator::gather_host(std::span<const std::uint8_t> mine) {
  Impl& m = *impl_;
  if (m.group_depth > 0)
    throw std::logic_error(m.who() + "gather_host inside group_begin/group_end: it waits for its own result");
  m.throw_if_aborted();
  m.make_current();
  const std::size_t world = static_cast<std::size_t>(m.world_size);
  const std::string what = "gather_host (" + std::to_string(mine.size()) + " bytes from this rank)";
  // The whole call, not only its waits: growing the scratch buffers frees the old ones, and
  // cudaFree waits for the device, where a collective may hang on a failed peer.
  auto guard = m.watchdog->guard(what);

  // 1. Every rank's size, as int64 (ncclAllGather of one element per rank).
  m.ensure_scratch((1 + world) * sizeof(std::int64_t), (1 + world) * sizeof(std::int64_t));
  auto* size_host = static_cast<std::int64_t*>(m.pinned_scratch.get());
  auto* size_device = static_cast<std::int64_t*>(m.device_scratch.get());
  size_host[0] = static_cast<std::int64_t>(mine.size());
  m.check_cuda(cudaMemcpyAsync(size_device, size_host, sizeof(std::int64_t), cudaMemcpyHostToDevice, m.gather_stream),
               what + ": cudaMemcpyAsync of the size");
  {
    const std::string op = what + ": ncclAllGather of the sizes";
    auto guard = m.watchdog->guard(op);
    m.issue(*m.world, op, [&](ncclComm_t comm) {
      return ncclAllGather(size_device, size_device + 1, 1, ncclInt64, comm, m.gather_stream);
    });
  }
  m.check_cuda(cudaMemcpyAsync(size_host + 1, size_device + 1, world * sizeof(std::int64_t), cudaMemcpyDeviceToHost,
                               m.gather_stream),
               what + ": cudaMemcpyAsync of the sizes");
  m.wait(m.gather_stream, what + ": sizes");
  std::vector<std::size_t> sizes(world);
  std::size_t longest = 0;
  for (std::size_t r = 0; r < world; ++r) {
    if (size_host[1 + r] < 0)
      throw CommError(m.who() + what + ": rank " + std::to_string(r) + " reported a negative size " +
                      std::to_string(size_host[1 + r]));
    sizes[r] = static_cast<std::size_t>(size_host[1 + r]);
    longest = std::max(longest, sizes[r]);
  }
  if (sizes[static_cast<std::size_t>(m.rank)] != mine.size())
    throw CommError(m.who() + what + ": the gathered size of this rank is " +
                    std::to_string(sizes[static_cast<std::size_t>(m.rank)]) + ", not " + std::to_string(mine.size()));
  std::vector<std::vector<std::uint8_t>> all(world);
  if (longest == 0) return all;

  // 2. The blobs, each padded to the longest: [this rank's blob | every rank's, by rank] on the
  // device; the host buffer holds this rank's blob on the way in and every blob on the way out
  // (stream order: the upload has read it before the download writes it).
  m.ensure_scratch(longest * (1 + world), longest * world);
  auto* host = static_cast<std::uint8_t*>(m.pinned_scratch.get());
  auto* send = static_cast<std::uint8_t*>(m.device_scratch.get());
  std::uint8_t* gathered = send + longest;
  if (!mine.empty()) std::memcpy(host, mine.data(), mine.size());
  std::memset(host + mine.size(), 0, longest - mine.size());
  m.check_cuda(cudaMemcpyAsync(send, host, longest, cudaMemcpyHostToDevice, m.gather_stream),
               what + ": cudaMemcpyAsync of the blob");
  {
    const std::string op = what + ": ncclAllGather of " + std::to_string(longest) + " bytes per rank";
    auto guard = m.watchdog->guard(op);
    m.issue(*m.world, op, [&](ncclComm_t comm) {
      return ncclAllGather(send, gathered, longest, ncclUint8, comm, m.gather_stream);
    });
  }
  m.check_cuda(cudaMemcpyAsync(host, gathered, longest * world, cudaMemcpyDeviceToHost, m.gather_stream),
               what + ": cudaMemcpyAsync of the blobs");
  m.wait(m.gather_stream, what + ": blobs");
  for (std::size_t r = 0; r < world; ++r) all[r].assign(host + r * longest, host + r * longest + sizes[r]);
  return all;
}

void NcclCommunicator::abort(const std::string& reason) { impl_->abort(reason); }

void NcclCommunicator::synchronize(StreamHandle stream, const std::string& what) {
  Impl& m = *impl_;
  m.throw_if_aborted();
  m.make_current();
  m.wait(stream, what);
}

}  // namespace trainsim::runtime::cuda
