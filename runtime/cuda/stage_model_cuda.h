// The CUDA backend's pipeline stage: the device counterpart of runtime/model/stage_model.h's
// StageModel, for the CUDA engine. Same StageSpec, same parameters in the same order and
// layout (params(), so gradients compare element by element with the CPU model's), same call
// sequence (forward, then backward_begin / backward_unit x backward_units() / backward_end), same
// per-micro-batch stashes and the same mixed-precision rules, computed with the launchers of
// kernels/kernels.h and the cuBLAS products of kernels/gemm.h. Plain C++: no CUDA type crosses
// this header (STYLE.md habit 7); streams are kernels/cuda_handles.h's typed handles.
//
// Where values live:
//  * weights: FP32 master weights on the device, and a working copy in the compute format
//    (refresh_working_weights(); the master itself when compute is fp32);
//  * gradients: one device buffer in the grad_accumulation format, params() offsets;
//  * activations passed between stages (forward's input/output, backward's grad_output /
//    grad_input) are DEVICE pointers to activation_elements() elements stored in the compute
//    format (activation_format(): 4 bytes for fp32, 2 for fp16/bf16) — what a send to the
//    neighbouring stage carries. tokens and targets are HOST pointers (B*T int32 each).
//
// Mixed precision, as StageModel (stage_model.h) and lowp.h define it: every tensor a layer
// produces is stored in the compute format, i.e. rounded once (round-to-nearest-even) from the
// FP32 result of the kernel or product that made it — the device stores in the format what the
// CPU model stores as rounded floats; LayerNorm statistics, the log-sum-exp and the losses are
// FP32 as on the CPU. Each micro-batch's weight gradients are produced in FP32, rounded to the
// compute format and added into the accumulation buffer (kernels.h accumulate), except with
// compute = grad_accumulation = fp32, where, as on the CPU, products accumulate straight into it.
// Compute formats: fp32, fp16, bf16 (tf32 and fp8 are refused: the kernels do not store them).
//
// Tensor and sequence parallelism as StageModel (stage_model.h, stage_layout.h): the same shards,
// the same collectives in the same order, over a DeviceTensorParallelGroup on the model's stream.
//
// What it does not do yet (the CPU model does): the per-step StageNumerics scans (the engine
// scans what passes between stages instead) and stashed_tensors() inspection.
//
// Work is queued on `stream`; calls return before the device finishes, except forward on the
// last stage (it reads the loss back) and the *_to_host copies (they wait for the stream). Not
// thread-safe; one model per stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda_handles.h"
#include "runtime/comm/device_communicator.h"
#include "runtime/model/stage_model.h"

namespace trainsim::runtime::cuda {

// The collectives a tensor-parallel shard runs inside its forward and backward, on its stream,
// over its group: runtime/model/model_parallel.h's ModelParallelGroup in device terms (buffers
// of `count` elements of `dt`, in place; reduce_scatter and all_gather as device_communicator.h's,
// one equal chunk per member, member p's chunk p).
class DeviceTensorParallelGroup {
 public:
  virtual ~DeviceTensorParallelGroup() = default;
  virtual void all_reduce(void* data, std::size_t count, DType dt, ReduceOp op, StreamHandle stream) = 0;
  virtual void reduce_scatter(void* data, std::size_t count, DType dt, StreamHandle stream) = 0;
  virtual void all_gather(void* data, std::size_t count, DType dt, StreamHandle stream) = 0;
};

// Over a DeviceCommunicator (the single-GPU world, or NCCL's sub-communicator for the members):
// the group's members in tensor-parallel order and a tag per call from a counter every member
// advances in the same order, restarted by the engine before each step (CommunicatorGroup's).
class DeviceCommunicatorGroup final : public DeviceTensorParallelGroup {
 public:
  DeviceCommunicatorGroup(DeviceCommunicator& comm, std::vector<int> members)
      : comm_(comm), members_(std::move(members)) {}
  void restart(std::uint64_t first_tag) { next_tag_ = first_tag; }
  void all_reduce(void* data, std::size_t count, DType dt, ReduceOp op, StreamHandle stream) override {
    comm_.all_reduce(data, count, dt, members_, next_tag_++, op, Divide::none, stream);
  }
  void reduce_scatter(void* data, std::size_t count, DType dt, StreamHandle stream) override {
    comm_.reduce_scatter(data, count, dt, members_, next_tag_++, ReduceOp::sum, Divide::none, stream);
  }
  void all_gather(void* data, std::size_t count, DType dt, StreamHandle stream) override {
    comm_.all_gather(data, count, dt, members_, next_tag_++, stream);
  }

 private:
  DeviceCommunicator& comm_;
  std::vector<int> members_;
  std::uint64_t next_tag_ = 0;
};

// A shard timed alone (the CUDA kernel calibrator's composition stage): collectives do nothing.
class TimingOnlyDeviceGroup final : public DeviceTensorParallelGroup {
 public:
  void all_reduce(void*, std::size_t, DType, ReduceOp, StreamHandle) override {}
  void reduce_scatter(void*, std::size_t, DType, StreamHandle) override {}
  void all_gather(void*, std::size_t, DType, StreamHandle) override {}
  static TimingOnlyDeviceGroup& instance() {
    static TimingOnlyDeviceGroup group;
    return group;
  }
};

class CudaStageModel {
 public:
  // Validates the spec as StageModel does, and refuses compute or grad_accumulation formats the
  // kernels do not store (tf32, fp8), before touching the device (std::invalid_argument). Then
  // allocates the weights, gradients and scratch on the current device.
  explicit CudaStageModel(const StageSpec& spec, StreamHandle stream = nullptr);
  ~CudaStageModel();
  CudaStageModel(CudaStageModel&&) noexcept;
  CudaStageModel& operator=(CudaStageModel&&) noexcept;
  CudaStageModel(const CudaStageModel&) = delete;
  CudaStageModel& operator=(const CudaStageModel&) = delete;

  const StageSpec& spec() const;
  StreamHandle stream() const;
  // A tensor-parallel shard's group (spec().tensor_parallel_size > 1), as StageModel's; it must
  // outlive the model.
  void set_tensor_parallel_group(DeviceTensorParallelGroup* group);

  // Initialises a CPU StageModel of the same spec with `seed` and copies its master weights to
  // the device, so both start from identical weights; refreshes the working copy.
  void init(std::uint64_t seed);
  // Master weights drawn on the device (kernels.h fill_normal, normal with deviation 0.02) and the
  // working copy refreshed: for a stage that is only timed (the calibration's), where the values
  // do not matter and init's host draw of a GPU-sized stage (~10^8 weights) takes seconds per
  // rank. Not an initialisation the CPU backend can match.
  void randomize_for_timing(std::uint64_t seed);
  // Replaces the master weights (params() layout, e.g. from a checkpoint) and refreshes the
  // working copy. weights.size() must equal the parameter count.
  void set_master_weights(const std::vector<float>& weights);

  // Parameters in gradient-completion order, exactly StageModel::params() for the same spec.
  const std::vector<ParamInfo>& params() const;
  std::size_t num_parameters() const;
  ParamInfo token_embedding() const;  // size 0 when this stage has none

  void zero_gradients();
  // Rounds the master weights into the compute-format working copy; after each optimizer step.
  void refresh_working_weights();

  // Device buffers, for the engine (optimizer, all-reduce): params() layout.
  float* master_weights_device();                 // fp32
  void* gradients_device();                       // gradient_format()
  DType gradient_format() const;                  // spec().grad_accumulation
  const void* working_weights_device() const;     // compute format (the master when fp32)
  // What passes read, writable: an engine that shards the weights (ZeRO) gathers into it.
  void* compute_weights_device();
  // Passes ask `gate` before they read weights, as StageModel::set_weight_gate (the gate's
  // acquire/release run on the host, in queue order; device ordering is the engine's).
  void set_weight_gate(WeightGate* gate);
  // Copies for tests and checkpoints (wait for the stream).
  std::vector<float> master_weights_to_host() const;
  std::vector<float> gradients_to_host() const;   // converted to float from gradient_format()

  // Activations passed between stages: micro_batch_size * seq_length * hidden_size elements in
  // activation_format() (= spec().compute); 1/tp of them under sequence parallelism.
  std::size_t activation_elements() const;
  DType activation_format() const;

  // Forward of micro-batch `mb` (keeps what backward needs until backward_end). The first stage
  // reads `tokens` (host), the others `input` (device, activation_format()); the last stage reads
  // `targets` (host) and keeps the micro-batch's loss on the device (losses()); the others write
  // `output` (device, may be null). Queues work only: never waits for the stream.
  void forward(int mb, const std::int32_t* tokens, const std::int32_t* targets, const void* input, void* output);
  // The last stage's mean cross-entropy of micro-batches 0..count-1, from their latest forwards
  // (as StageModel::forward returns it: rows summed in double, divided, rounded to float). Waits
  // for the stream.
  std::vector<float> losses(int count) const;

  // Allocates now what forwards and backwards would otherwise allocate on first use (cudaMalloc
  // synchronises with the device, and a step may have NCCL kernels waiting on peers): room for
  // `stashes` micro-batches in flight, `backwards` whole and `split_backwards` zero-bubble
  // backwards in flight, and `micro_batches` losses.
  void reserve(int stashes, int backwards, int split_backwards, int micro_batches);

  // As StageModel: begin (the last stage seeds d(loss)/d(logits) times loss_gradient_scale, the
  // others take grad_output, a device pointer in activation_format()), then backward_units()
  // units (head, blocks from last to first, embedding), each adding its weight gradients into
  // gradients(), then end (writes grad_input, a device pointer, except on the first stage; may be
  // null; frees the micro-batch's stash for reuse).
  void backward_begin(int mb, const void* grad_output, float loss_gradient_scale);
  int backward_units() const;
  void backward_unit(int mb);
  std::size_t gradients_complete(int mb) const;  // leading elements of gradients() final for mb
  void backward_end(int mb, void* grad_input);

  // The zero-bubble split (ZB-H1), as StageModel: backward_input runs every unit's input
  // gradient and writes grad_input (device, may be null); backward_weight later adds every
  // unit's weight gradients (kept per micro-batch in between) and frees the stash.
  void backward_input(int mb, const void* grad_output, float loss_gradient_scale, void* grad_input);
  void backward_weight(int mb);       // every weight unit left, then frees the stash
  void backward_weight_unit(int mb);  // the next weight unit (StageModel::backward_weight_unit)

  // Device bytes of the stashes (and backward buffers) of micro-batches in flight.
  std::size_t activation_bytes() const;
  // Device bytes of the workspace recompute (spec().recompute) rebuilds a block in during a backward.
  std::size_t backward_workspace_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainsim::runtime::cuda
