// bench_device_world_comm (calibrate_cuda.h): the benchmark of runtime/calibrate/comm_bench.h
// (its options, sections, checks, rows and fits) over the single-GPU world (device_world.h)
// instead of the in-process one. What is this transport's own: buffers live on the device in
// the wire format, each rank drives its own stream from its own thread, and a call is timed
// with CUDA events on that stream, held by a gate until every rank has enqueued it.
#include "runtime/cuda/calibrate_cuda.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/collective.h"
#include "kernels/device_buffer.h"
#include "kernels/kernels.h"
#include "runtime/cuda/device_world.h"
#include "runtime/cuda/stream_ops.h"

namespace trainsim::runtime::cuda {

namespace k = ::trainsim::cuda;

namespace {

// A host-side wait longer than this fails the call with CommError instead of hanging.
constexpr std::chrono::milliseconds kTimeout{60'000};
// How long a call's streams wait for every rank to have enqueued it (HostGate).
constexpr std::uint64_t kGatePatienceNs = 10'000'000'000;
constexpr DType kWires[] = {DType::fp32, DType::fp16, DType::bf16};  // what the world moves

// One rank's buffer: `count` elements of `dt` on the device, filled from and read back into
// host floats through an fp32 copy (kernels.h cast) when dt is narrower. Every transfer waits
// for the stream: it happens outside the timed calls.
class RankBuffer {
 public:
  RankBuffer(std::size_t max_count, DType dt, StreamHandle stream)
      : dt_(dt), stream_(stream), data_(max_count * static_cast<std::size_t>(dtype_bytes(dt))),
        host_(max_count) {
    if (dt != DType::fp32) wide_ = k::DeviceBuffer(max_count * sizeof(float));
  }
  void* data() const { return data_.data(); }
  std::span<float> host() { return host_; }
  void upload(std::size_t count) {
    void* f32 = dt_ == DType::fp32 ? data_.data() : wide_.data();
    copy_host_to_device(f32, host_.data(), count * sizeof(float), stream_);
    if (dt_ != DType::fp32) k::cast(data_.data(), dt_, f32, DType::fp32, count, stream_);
    synchronize(stream_);
  }
  void download(std::size_t count) {
    void* f32 = dt_ == DType::fp32 ? data_.data() : wide_.data();
    if (dt_ != DType::fp32) k::cast(f32, DType::fp32, data_.data(), dt_, count, stream_);
    copy_device_to_host(host_.data(), f32, count * sizeof(float), stream_);
    synchronize(stream_);
  }

 private:
  DType dt_;
  StreamHandle stream_;
  k::DeviceBuffer data_, wide_;
  std::vector<float> host_;
};

// Section `s` on a fresh single-GPU world of s.ranks, each rank on its own non-blocking stream
// with its context current.
void run_section(const CommSection& s, const CommBenchOptions& o, int device, CommBenchResult& out) {
  const SmPartition streams(s.ranks, SmSharing::shared, device);
  DeviceWorld world(s.ranks, kTimeout);
  k::HostGate gate;
  std::vector<std::unique_ptr<DeviceCommunicator>> comms;
  for (int r = 0; r < s.ranks; ++r) comms.push_back(world.communicator(r));
  const auto rank = [&](int r, const std::function<void(const CommRankCalls&)>& measure) {
    DeviceCommunicator& comm = *comms[static_cast<std::size_t>(r)];
    streams.make_current(r);
    StreamHandle stream = streams.streams(r).compute;
    RankBuffer buffer(s.max_count, s.wire, stream);
    k::EventTimer timer;
    std::uint64_t tag = 0;  // every rank counts its calls alike
    const auto call = [&](std::size_t count) {
      // Call tag + 1 starts on the device once every rank has enqueued it (the gate), so its
      // events time the transport's device work, as in a step whose host runs ahead of its GPU.
      gate.wait(stream, (tag + 1) * static_cast<std::uint64_t>(s.ranks), kGatePatienceNs);
      double seconds = -1.0;  // sendrecv: only rank 0 sees the round trip
      if (s.op != "sendrecv") {
        timer.start(stream);
        if (s.op == "all_gather")
          comm.all_gather(buffer.data(), count, s.wire, s.members, tag, stream);
        else if (s.op == "reduce_scatter")
          comm.reduce_scatter(buffer.data(), count, s.wire, s.members, tag, s.reduce, Divide::none, stream);
        else
          comm.all_reduce(buffer.data(), count, s.wire, s.members, tag, s.reduce, Divide::none, stream);
        timer.stop(stream);
        seconds = timer.elapsed_seconds();
      } else if (r == 0) {
        timer.start(stream);
        comm.send(1, tag, buffer.data(), count, DType::fp32, stream);
        comm.recv(1, tag, buffer.data(), count, DType::fp32, stream);
        timer.stop(stream);
        seconds = timer.elapsed_seconds() / 2;
      } else {
        comm.recv(0, tag, buffer.data(), count, DType::fp32, stream);
        comm.send(0, tag, buffer.data(), count, DType::fp32, stream);  // echo what arrived: checked on both ranks
      }
      ++tag;
      gate.open();
      buffer.download(count);
      if (gate.timed_out())
        throw CommError("rank " + std::to_string(r) + ": " + s.op + " of " + std::to_string(count) +
                        " elements: the ranks did not all enqueue it within " +
                        std::to_string(kGatePatienceNs / 1'000'000'000) +
                        " s (a host thread blocked inside the call?)");
      return seconds;
    };
    measure(CommRankCalls{buffer.host(), [&](std::size_t count) { buffer.upload(count); }, call, nullptr});
  };
  run_comm_section(s, o, out, rank,
                   [&](int r, const std::string& why) {
                     gate.release();  // no stream waits for a rank that has stopped
                     comms[static_cast<std::size_t>(r)]->abort(why);
                   });
}

}  // namespace

CommBenchResult bench_device_world_comm(const CommBenchOptions& options, int device) {
  const CommBenchOptions o = checked_comm_options(options, kWires, "the single-GPU world", k::kMaxRingMembers);
  std::string why;
  if (!k::device_available(&why)) throw std::runtime_error("calibrate: the single-GPU world needs a GPU: " + why);
  k::keep_default_pool_memory(device);  // where the world stages its messages

  CommBenchResult result;
  for (const CommSection& s : comm_sections(o)) run_section(s, o, device, result);
  fit_comm_rows(result);
  return result;
}

}  // namespace trainsim::runtime::cuda
