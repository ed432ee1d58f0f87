// The collectives a model-parallel shard of the stage model runs inside its forward and backward,
// as the CPU StageModel asks for them: over its tensor-parallel group, Megatron's f/g pair, its
// vocabulary-parallel embedding and cross-entropy, sequence parallelism's gathers and scatters;
// over its context-parallel group, the keys' and values' all-gather before each attention and
// their gradients' reduce-scatter after its backward. An engine implements it over its
// communicator (CommunicatorGroup); every member of a group calls the same collectives in the
// same order, because every member runs the same program.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "runtime/comm/communicator.h"

namespace trainsim::runtime {

class ModelParallelGroup {
 public:
  virtual ~ModelParallelGroup() = default;
  // Every member's `data` summed (or max-reduced), the identical result on every member; values
  // and partial sums rounded to `wire` (communicator.h's ring).
  virtual void all_reduce(std::span<float> data, ReduceOp op, DType wire) = 0;
  // `data` holds one equal chunk per member: leaves the sum of chunk p in chunk p on the member at
  // position p (tensor- or context-parallel rank p); the other chunks are unspecified.
  virtual void reduce_scatter(std::span<float> data, DType wire) = 0;
  // `data` holds one equal chunk per member, this member's in its own chunk: fills the others.
  virtual void all_gather(std::span<float> data, DType wire) = 0;
};

// Over a Communicator: the group's members (ranks of the communicator, ascending, in tensor-
// parallel order) and a tag per call, from a counter every member advances in the same order.
// The engine restarts the counter with the step's first tag before each step (tags of different
// steps never meet).
class CommunicatorGroup final : public ModelParallelGroup {
 public:
  CommunicatorGroup(Communicator& comm, std::vector<int> members) : comm_(comm), members_(std::move(members)) {}
  void restart(std::uint64_t first_tag) { next_tag_ = first_tag; }
  void all_reduce(std::span<float> data, ReduceOp op, DType wire) override {
    comm_.all_reduce(data, members_, next_tag_++, op, wire, Divide::none);
  }
  void reduce_scatter(std::span<float> data, DType wire) override {
    comm_.reduce_scatter(data, members_, next_tag_++, ReduceOp::sum, wire, Divide::none);
  }
  void all_gather(std::span<float> data, DType wire) override { comm_.all_gather(data, members_, next_tag_++, wire); }

 private:
  Communicator& comm_;
  std::vector<int> members_;
  std::uint64_t next_tag_ = 0;
};

// A shard timed alone (the kernel calibrators' composition stage): its collectives do nothing, so
// it computes a shard's work on values no group summed. Never for training. Stateless: one
// instance serves every caller.
class TimingOnlyGroup final : public ModelParallelGroup {
 public:
  void all_reduce(std::span<float>, ReduceOp, DType) override {}
  void reduce_scatter(std::span<float>, DType) override {}
  void all_gather(std::span<float>, DType) override {}
  static TimingOnlyGroup& instance() {
    static TimingOnlyGroup group;
    return group;
  }
};

// The format a shard's activation collectives carry: the compute format where it is a storage
// format (fp16, bf16), else fp32 (tf32 is a product mode, its values are stored in fp32).
inline DType tensor_parallel_wire(DType compute) {
  return compute == DType::fp16 || compute == DType::bf16 ? compute : DType::fp32;
}

}  // namespace trainsim::runtime
