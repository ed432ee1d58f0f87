#include "runtime/null/null_engine.h"

#include <cmath>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "runtime/engine/weights.h"
#include "sim/simulator.h"

namespace trainsim::runtime {

namespace {

class NullEngine final : public DeviceEngine {
 public:
  NullEngine(const RuntimePlan& rp, const NullFaults& faults)
      : plan_(rp.plan), world_(World::of(rp.plan)), faults_(faults), prediction_(predict(rp.plan)) {
    // Each rank's stand-in weights: the same in every replica, different per stage.
    for (int r = 0; r < world_.size(); ++r) {
      const int stage = world_.coord(r).pp;
      std::vector<float> w(8);
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + 0.01f * static_cast<float>((stage + 1) * (i + 1));
      weights_.push_back(std::move(w));
    }
    steps_taken_.assign(static_cast<std::size_t>(world_.size()), 0);
  }

  const World& world() const override { return world_; }
  std::shared_ptr<const Schedule> schedule() const override { return prediction_.schedule; }
  Execution execution() const override {
    return {fmt::format("null: the prediction of {} ranks played back{}", world_.size(),
                        faults_.sleep_predicted ? ", sleeping for its step time" : ""),
            "", false};
  }

  std::vector<RankStep> run_step(int step, std::uint64_t) override {
    const Timeline& tl = prediction_.timeline;
    const auto predicted = std::chrono::nanoseconds((tl.end() - tl.begin()) / 1000);
    const auto at = static_cast<std::size_t>(step - 1);
    if (at < faults_.step_sleep.size())
      std::this_thread::sleep_for(faults_.step_sleep[at]);
    else if (faults_.step_sleep.empty() && faults_.sleep_predicted)
      std::this_thread::sleep_for(predicted);

    // The loss follows the weights before this step's update: a resumed run gives the same bits.
    double norm_sq = 0;
    for (int r : world_.replica(0))
      for (float x : weights_[static_cast<std::size_t>(r)]) norm_sq += static_cast<double>(x) * x;
    std::vector<RankStep> out(static_cast<std::size_t>(world_.size()));
    for (int r = 0; r < world_.size(); ++r) {
      RankStep& rs = out[static_cast<std::size_t>(r)];
      if (r == faults_.fail_rank && step == faults_.fail_step) {
        rs.error = fmt::format("the null engine's injected failure of rank {} at step {}", r, step);
        continue;
      }
      const RankCoord c = world_.coord(r);
      auto& w = weights_[static_cast<std::size_t>(r)];
      rs.numerics.rank = r;
      rs.numerics.stage = c.pp;
      rs.numerics.replica = c.dp;
      rs.numerics.shard = c.tp;
      rs.grad_norm = std::sqrt(norm_sq);
      if (c.pp == world_.pipeline_parallel() - 1) {
        double mean = 0;
        for (float x : w) mean += x / static_cast<double>(w.size());
        double loss = std::log(static_cast<double>(plan_.config.model.vocab_size)) * (0.5 + mean);
        if (faults_.diverge_step > 0 && step >= faults_.diverge_step) loss *= 10;
        if (step == faults_.nan_step) {
          loss = NAN;
          rs.numerics.nonfinite_count = 1;
          rs.numerics.first_nonfinite = fmt::format("the null engine's injected NaN (stage {}, replica {})", c.pp, c.dp);
          rs.first_nonfinite_at = 0;
        }
        rs.loss_sum = loss * plan_.num_microbatches;
        rs.loss_count = plan_.num_microbatches;
      }
      // A shard of a schedule rank plays back its cell's predicted ops.
      const auto cell = static_cast<std::size_t>(world_.cell(r));
      rs.timing = tl.ops[cell];
      rs.arrival.assign(rs.timing.size(), -1);
      const auto& ops = prediction_.schedule->ranks[cell].ops;
      for (std::size_t i = 0; i < ops.size(); ++i)
        if (is_collective(ops[i].kind)) rs.arrival[i] = rs.timing[i].start;
      // The update: weights decay towards zero.
      for (float& x : w) x *= 0.9f;
      ++steps_taken_[static_cast<std::size_t>(r)];
      rs.weights_hash = fnv1a(kFnvOffset, w);
    }
    return out;
  }

  std::optional<double> replica_drift() override {
    return runtime::replica_drift(world_, 1, [&](int r, int) {
      return std::span<const float>(weights_[static_cast<std::size_t>(r)]);
    });
  }

  std::vector<RankCheckpoint> save() override {
    std::vector<RankCheckpoint> out;
    for (int r = 0; r < world_.size(); ++r)
      out.push_back(pack_rank(r, {{weights_[static_cast<std::size_t>(r)], {}, {}, steps_taken_[static_cast<std::size_t>(r)]}},
                              LossScaler::State{}));
    return out;
  }

  void restore(const Checkpoint& ck) override {
    if (faults_.restore_forgets) return;
    for (int r = 0; r < world_.size(); ++r) {
      auto& w = weights_[static_cast<std::size_t>(r)];
      const ChunkState c = unpack_rank(checkpoint_of(ck.ranks, r), {w.size()}).at(0);
      w.assign(c.master_weights.begin(), c.master_weights.end());
      steps_taken_[static_cast<std::size_t>(r)] = c.optimizer_steps;
    }
  }

  std::vector<MemoryBreakdown> memory_peaks() const override {
    std::vector<MemoryBreakdown> out;  // the prediction is per GPU: each shard of a cell holds its cell's
    for (int r = 0; r < world_.size(); ++r) out.push_back(prediction_.memory[static_cast<std::size_t>(world_.cell(r))]);
    return out;
  }

 private:
  const Plan& plan_;
  World world_;
  NullFaults faults_;
  Prediction prediction_;
  std::vector<std::vector<float>> weights_;  // per rank
  std::vector<std::int64_t> steps_taken_;
};

}  // namespace

std::unique_ptr<DeviceEngine> make_null_engine(const RuntimePlan& plan, const RunOptions&, const NullFaults& faults) {
  return std::make_unique<NullEngine>(plan, faults);
}

const Backend& null_backend() {
  static const Backend backend{
      .name = "null",
      .title = "null",
      .help = "no device: the plan's prediction played back, to test the run loop",
      .engine = [](const RuntimePlan& plan, const Dataset&, const RunOptions& options) {
        return make_null_engine(plan, options, NullFaults{.sleep_predicted = true});
      },
  };
  return backend;
}

}  // namespace trainsim::runtime
