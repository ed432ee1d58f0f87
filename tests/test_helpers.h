// Shared fixtures for the simulator tests: small plans built in code and cost models
// with exact, uniform durations, so closed forms can be checked to the tick.
#pragma once

#include <memory>

#include "core/plan.h"
#include "core/schedule.h"
#include "sim/cost/cost_models.h"
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

}  // namespace trainsim::testing
