// Shared fixtures for the simulator tests: small plans built in code and cost models
// with exact, uniform durations, so closed forms can be checked to the tick.
#pragma once

#include <memory>
#include <vector>

#include "core/config_fields.h"
#include "core/plan.h"
#include "core/schedule.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/cost_models.h"
#include "sim/cost/p2p_model.h"
#include "sim/engine.h"

namespace trainsim::testing {

// A small GPT and a cluster where every (p, v, m, d) combination below is valid.
inline ScenarioConfig small_config(int p, int m, ScheduleKind kind, int v = 1, int d = 1) {
  ScenarioConfig c;
  c.model.num_layers = p * v * 2;
  c.model.hidden_size = 64;
  c.model.num_attention_heads = 4;
  c.model.seq_length = 16;
  c.model.vocab_size = 128;
  c.cluster.num_gpus = p * d;
  c.cluster.gpus_per_node = 8;
  c.parallelism.pipeline_parallel_size = p;
  c.parallelism.data_parallel_size = d;
  c.parallelism.virtual_pipeline_stages = v;
  c.parallelism.schedule = kind;
  c.training.micro_batch_size = 1;
  c.training.global_batch_size = m * d;
  c.precision.loss_scaling.mode = LossScalingMode::none;
  return c;
}

// A preset model (`model.preset`) on `gpus` GPUs of a preset (`cluster.gpu`), every one a
// data-parallel replica under ZeRO `zero`, one micro-batch of `micro` sequences each.
inline ScenarioConfig preset_replicas(const std::string& model, const std::string& gpu, int gpus, int zero,
                                      int micro = 1) {
  ScenarioConfig c;
  find_field("model.preset")->set(c, model);
  find_field("cluster.gpu")->set(c, gpu);
  c.cluster.num_gpus = gpus;
  c.parallelism.data_parallel_size = gpus;
  c.parallelism.zero_stage = zero;
  c.training.micro_batch_size = micro;
  c.training.global_batch_size = micro * gpus;
  return c;
}

// The settings a random-plan test draws for a (p stages, d replicas, t shards, m micro-batches)
// layout, every one the simulator must handle: sequence parallelism, ZeRO 0-3 with a framework
// that runs it with p stages (FSDP has no stage 1; DeepSpeed, auto's choice for 2-3, refuses
// ZeRO-2/3 with a pipeline), FSDP's no-sync, recompute, micro-batches of 1-2, overlapped and
// small buckets, both all-reduce algorithms, loss scaling and overflow checks, the compute
// format, optionally a memory so small that some plans do not fit, untied embeddings, and last
// context parallelism of 2 (where the doubled GPU count still fills whole nodes) with the ring or
// the gathered keys and an attention core each runs with, and the tensor-parallel overlap of
// sequence parallelism's collectives (either reduce-scatter form). `pick` draws one of a list;
// the draws come in this order, so a seed gives the same plans.
template <class Pick>
void draw_settings(ScenarioConfig& c, int p, int d, int t, int m, Pick&& pick, bool small_memory) {
  c.parallelism.tensor_parallel_size = t;
  c.parallelism.sequence_parallel = t > 1 && pick({0, 1});
  c.parallelism.zero_stage = pick({0, 1, 2, 3});
  const int zero = c.parallelism.zero_stage;
  c.parallelism.framework = static_cast<Framework>(zero == 1              ? pick({0, 1, 2})
                                                   : zero >= 2 && p > 1 ? pick({1, 3})
                                                                        : pick({0, 1, 2, 3}));
  c.parallelism.fsdp_no_sync = c.parallelism.framework == Framework::fsdp && pick({0, 1});
  c.training.activation_recompute = static_cast<Recompute>(pick({0, 1, 2, 3}));
  c.training.micro_batch_size = pick({1, 2});
  c.training.global_batch_size = m * d * c.training.micro_batch_size;
  c.communication.overlap_grad_reduce = pick({0, 1});
  c.communication.bucket_size_mib = pick({1, 25}) / 100.0;
  c.communication.allreduce_algorithm = static_cast<AllReduceAlgorithm>(pick({0, 1}));
  c.precision.loss_scaling.mode = static_cast<LossScalingMode>(pick({0, 1, 2}));
  c.precision.overflow_check = static_cast<OverflowScope>(pick({0, 1}));
  c.precision.compute = static_cast<DType>(pick({0, 2, 3}));
  if (small_memory) c.cluster.memory_gib = pick({1, 80}) / 1000.0;  // some plans do not fit: per-rank warnings
  c.model.untie_embeddings_and_output_weights = pick({0, 1});
  const int gpus = c.cluster.num_gpus * 2, node = c.cluster.gpus_per_node;
  if (pick({0, 0, 1}) && (gpus <= node || gpus % node == 0) && node % t == 0) {
    c.parallelism.context_parallel_size = 2;
    c.cluster.num_gpus = gpus;
    c.parallelism.context_parallel_comm = static_cast<ContextParallelComm>(pick({0, 1, 2}));
    // The ring runs a flash kernel per step; gathered keys suit any core.
    c.model.attention = c.parallelism.context_parallel_comm == ContextParallelComm::all_gather
                            ? static_cast<AttentionKernel>(pick({0, 1, 2, 3}))
                            : AttentionKernel::flash;
  }
  if (c.parallelism.sequence_parallel && t <= node && pick({0, 1})) {
    c.communication.tp_comm_overlap = true;
    c.communication.tp_comm_overlap_reduce_scatter = static_cast<TpOverlapReduceScatter>(pick({0, 1}));
  }
  // Interleaving over one group of all m micro-batches a chunk (always a valid group size > p;
  // Megatron-Core's, not PyTorch's).
  if (c.parallelism.schedule == ScheduleKind::interleaved_1f1b && c.parallelism.framework != Framework::fsdp &&
      m > p && pick({0, 1}))
    c.parallelism.microbatch_group_size = m;
}

// Every chunk costs the same: forward f, backward b (split into input bi and weight bw
// for zero-bubble schedules), scaled by 1/v per chunk so a whole stage's work is fixed.
class UniformCompute final : public ComputeModel {
 public:
  UniformCompute(Tick f, Tick bi, Tick bw, Tick optimizer = 0) : f_(f), bi_(bi), bw_(bw), opt_(optimizer) {}
  Tick duration(const Op& op, int) const override {
    double t = 0;
    switch (op.kind) {
      case OpKind::Forward: t = static_cast<double>(f_); break;
      case OpKind::Backward: t = static_cast<double>(bi_ + bw_); break;
      case OpKind::BackwardInput: t = static_cast<double>(bi_); break;
      case OpKind::BackwardWeight: t = static_cast<double>(bw_); break;
      case OpKind::OptimizerStep: return opt_;
      default: return 0;
    }
    return static_cast<Tick>(t * op.work + 0.5);
  }

 private:
  Tick f_, bi_, bw_, opt_;
};

class FreeP2P final : public P2PModel {
 public:
  Tick duration(int, int, Bytes) const override { return 0; }
};

class FixedP2P final : public P2PModel {
 public:
  explicit FixedP2P(Tick t) : t_(t) {}
  Tick duration(int, int, Bytes) const override { return t_; }

 private:
  Tick t_;
};

// Sends that hold the sender's compute stream (no p2p overlap).
class BlockingP2P final : public P2PModel {
 public:
  explicit BlockingP2P(Tick t) : t_(t) {}
  Tick duration(int, int, Bytes) const override { return t_; }
  bool blocks_sender() const override { return true; }

 private:
  Tick t_;
};

class FreeCollectives final : public CollectiveModel {
 public:
  Tick duration(const Collective&) const override { return 0; }
};

class FixedCollectives final : public CollectiveModel {
 public:
  explicit FixedCollectives(Tick t) : t_(t) {}
  Tick duration(const Collective&) const override { return t_; }

 private:
  Tick t_;
};

inline Timeline run_uniform(const Plan& plan, Tick f, Tick bi, Tick bw, const P2PModel& p2p,
                            const CollectiveModel& coll) {
  auto sched = std::make_shared<const Schedule>(build_schedule(plan));
  const UniformCompute compute(f, bi, bw);
  return simulate_schedule(sched, CostModels{&compute, &p2p, &coll});
}

// The default cost models of several plans, and pointers to them as StepProgram::run_lanes
// and run_lanes_figures take them (lane j: plans[j]).
struct LaneModels {
  explicit LaneModels(const std::vector<Plan>& plans) {
    for (const Plan& plan : plans) {
      compute.push_back(std::make_unique<RooflineComputeModel>(plan));
      p2p.push_back(std::make_unique<LinkP2PModel>(plan));
      collective.push_back(std::make_unique<NetworkCollectiveModel>(plan));
      cs.push_back(compute.back().get());
      ps.push_back(p2p.back().get());
      ks.push_back(collective.back().get());
    }
  }
  std::vector<std::unique_ptr<RooflineComputeModel>> compute;
  std::vector<std::unique_ptr<LinkP2PModel>> p2p;
  std::vector<std::unique_ptr<NetworkCollectiveModel>> collective;
  std::vector<const RooflineComputeModel*> cs;
  std::vector<const LinkP2PModel*> ps;
  std::vector<const NetworkCollectiveModel*> ks;
};

}  // namespace trainsim::testing
