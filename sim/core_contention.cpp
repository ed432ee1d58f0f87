#include "sim/core_contention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/p2p_model.h"
#include "sim/engine.h"

namespace trainsim {

namespace {

// Rounds of re-simulation before giving up on agreement, the first ones undamped, and the
// agreement asked for: no op's duration moving by more than this share. Most plans agree in 2-3
// rounds; where an op's end crosses another's from one round to the next the durations bounce
// between two overlaps, and damping halves the bounce each round: 10-37 rounds on the random plans
// of tests/test_validation.cpp (CoreContention.SettlesOnRandomPlans).
constexpr int kMaxRounds = 60;
constexpr int kUndampedRounds = 6;
constexpr double kAgreement = 1e-6;

// Each compute op at the duration of a table, by rank and op index; the engine prices the
// program's own ops, so an op's index is its place in its rank's program.
class TabledCompute final : public ComputeModel {
 public:
  TabledCompute(const Schedule& s, const std::vector<std::vector<Tick>>& ticks) : s_(s), ticks_(ticks) {}
  Tick duration(const Op& op, int rank) const override {
    const auto& ops = s_.ranks[static_cast<std::size_t>(rank)].ops;
    const std::ptrdiff_t i = &op - ops.data();
    if (i < 0 || i >= static_cast<std::ptrdiff_t>(ops.size()))
      throw std::logic_error("settle_core_contention: an op priced outside its rank's program");
    return ticks_[static_cast<std::size_t>(rank)][static_cast<std::size_t>(i)];
  }

 private:
  const Schedule& s_;
  const std::vector<std::vector<Tick>>& ticks_;
};

// What a rank's core holds from each time on, a step function: how many threads of the other
// ranks of its host compute, and whether its own communication thread runs a collective.
struct Beside {
  std::vector<Tick> at;      // increasing
  std::vector<int> threads;  // from at[j] to at[j + 1]; 0 before at[0]
  std::vector<int> collectives;
};

// The plan as its compute sees the GPU while a collective holds collective_sms of its SMs.
Plan beside_collectives(const Plan& plan) {
  Plan p = plan;
  ClusterConfig& cl = p.config.cluster;
  const double left = static_cast<double>(cl.sm_count - cl.collective_sms) / cl.sm_count;
  for (DType d : kAllDTypes)
    if (cl.peak_tflops.at(d) > 0) cl.peak_tflops[d] = cl.peak_tflops.at(d) * left;
  cl.int32_tops *= left;
  cl.sm_count -= cl.collective_sms;
  return p;
}

}  // namespace

bool collectives_slow_compute(const Plan& plan) {
  const ClusterConfig& cl = plan.config.cluster;
  return !cl.calibrated && cl.collective_sms > 0 && cl.collective_sms < cl.sm_count && plan.num_ranks() > 1;
}

bool cores_contend(const Plan& plan) {
  const auto& p = plan.config.cluster.calibrated;
  if (!p || p->core_factors.empty()) return false;
  const int threads = plan.num_ranks() * plan.gpus_per_rank();
  return threads >= 2 && threads <= p->ranks_per_node;
}

int settle_core_contention(const Plan& plan, const std::shared_ptr<const Schedule>& schedule,
                           const RooflineComputeModel& compute, const LinkP2PModel& p2p,
                           const NetworkCollectiveModel& collective, Simulation& sim, Timeline& t) {
  const bool contend = cores_contend(plan), slowed = collectives_slow_compute(plan);
  if (!contend && !slowed) return 0;
  const Schedule& s = *schedule;
  const int ranks = static_cast<int>(s.ranks.size());
  const int tp = plan.gpus_per_rank();  // a rank's shards (tensor- and context-parallel), a core each
  const double threads = static_cast<double>(ranks) * tp;  // the host's, each on a core (cores_contend)
  // GPUs: each compute op's speed beside its rank's collectives, over its speed alone.
  std::optional<RooflineComputeModel> on_the_rest_sms;
  if (slowed) on_the_rest_sms.emplace(beside_collectives(plan));

  // The table the engine prices with, starting from `compute`'s (every op at its factor: t).
  std::vector<std::vector<Tick>> ticks(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const auto& ops = s.ranks[static_cast<std::size_t>(r)].ops;
    ticks[static_cast<std::size_t>(r)].assign(ops.size(), 0);
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (is_compute(ops[i].kind)) ticks[static_cast<std::size_t>(r)][i] = compute.duration(ops[i], r);
  }
  std::vector<std::vector<Tick>> next = ticks;
  const TabledCompute tabled(s, ticks);

  struct Change {
    Tick at;
    int threads, collectives;
    bool operator<(const Change& o) const { return at < o.at; }
  };
  std::vector<Change> events;
  Beside beside;
  // A rank's own collective, while it runs: takes its core (the CPU profile says so) or slows its
  // compute (GPUs); the op's speed then, as a share of its speed alone, is `held_rate`.
  const bool preempts = contend && plan.config.cluster.calibrated->collectives_take_rank_core;
  const bool held_matters = preempts || slowed;
  for (int round = 1;; ++round) {
    // Each op's duration from the threads computing beside it in `t`.
    double moved = 0;
    for (int r = 0; r < ranks; ++r) {
      events.clear();
      // Other ranks' compute counts only where they share the host's cores.
      for (int q = contend ? 0 : r; q < (contend ? ranks : r + 1); ++q) {
        const auto& ops = s.ranks[static_cast<std::size_t>(q)].ops;
        for (std::size_t i = 0; i < ops.size(); ++i) {
          const OpTiming& x = t.ops[static_cast<std::size_t>(q)][i];
          if (x.end <= x.start) continue;
          if (q != r && is_compute(ops[i].kind)) {
            events.push_back({x.start, tp, 0});
            events.push_back({x.end, -tp, 0});
          } else if (q == r && held_matters && is_collective(ops[i].kind) && ops[i].channel >= 0) {
            events.push_back({x.start, 0, 1});
            events.push_back({x.end, 0, -1});
          }
        }
      }
      std::sort(events.begin(), events.end());
      beside.at.clear();
      beside.threads.clear();
      beside.collectives.clear();
      int threads_now = 0, collectives_now = 0;
      for (const Change& e : events) {
        threads_now += e.threads;
        collectives_now += e.collectives;
        if (beside.at.empty() || beside.at.back() != e.at) {
          beside.at.push_back(e.at);
          beside.threads.push_back(0);
          beside.collectives.push_back(0);
        }
        beside.threads.back() = threads_now;
        beside.collectives.back() = collectives_now;
      }
      const auto& ops = s.ranks[static_cast<std::size_t>(r)].ops;
      for (std::size_t i = 0; i < ops.size(); ++i) {
        if (!is_compute(ops[i].kind)) continue;
        const double together = compute.core_factor(ops[i], r), by_itself = compute.alone_factor(ops[i], r);
        const double alone = static_cast<double>(compute.alone_duration(ops[i], r));
        Tick& d = next[static_cast<std::size_t>(r)][i];
        if ((together == by_itself && !held_matters) || alone <= 0) {
          d = static_cast<Tick>(alone);
          continue;
        }
        double held_rate = 0;
        if (slowed) {
          const double on_the_rest = static_cast<double>(on_the_rest_sms->duration(ops[i], r));
          held_rate = on_the_rest > 0 ? std::min(1.0, alone / on_the_rest) : 1.0;
        }
        // Walk the core's steps from the op's start until its alone work is done: at held_rate while
        // the rank's own collective runs (none where it takes the core).
        const Tick start = t.ops[static_cast<std::size_t>(r)][i].start;
        auto j = static_cast<std::ptrdiff_t>(std::upper_bound(beside.at.begin(), beside.at.end(), start) -
                                             beside.at.begin()) - 1;
        double now = static_cast<double>(start), left = alone;
        for (;;) {
          const auto k = static_cast<std::size_t>(j);
          const int others = j >= 0 ? beside.threads[k] : 0;
          const bool held = j >= 0 && beside.collectives[k] > 0;
          const double f = 1.0 + (together / by_itself - 1.0) * (tp + others - 1) / (threads - 1);
          const double until = j + 1 < static_cast<std::ptrdiff_t>(beside.at.size())
                                   ? static_cast<double>(beside.at[k + 1])
                                   : std::numeric_limits<double>::infinity();
          const double rate = held ? held_rate : 1.0 / f;
          if (rate > 0 && (until - now) * rate >= left) {
            now += left / rate;
            break;
          }
          left -= (until - now) * rate;
          now = until;
          ++j;
        }
        d = static_cast<Tick>(std::llround(now)) - start;
      }
    }
    for (int r = 0; r < ranks; ++r)
      for (std::size_t i = 0; i < next[static_cast<std::size_t>(r)].size(); ++i) {
        const Tick a = ticks[static_cast<std::size_t>(r)][i], b = next[static_cast<std::size_t>(r)][i];
        if (a != b) moved = std::max(moved, std::abs(static_cast<double>(b - a)) / std::max<double>(1, static_cast<double>(a)));
      }
    if (moved <= kAgreement || round > kMaxRounds) return round;
    // The next round's table: the new durations, halfway there once the first rounds have not agreed.
    for (int r = 0; r < ranks; ++r)
      for (std::size_t i = 0; i < next[static_cast<std::size_t>(r)].size(); ++i) {
        Tick& a = ticks[static_cast<std::size_t>(r)][i];
        const Tick b = next[static_cast<std::size_t>(r)][i];
        a = round <= kUndampedRounds ? b : a + (b - a) / 2;
      }
    sim.run(schedule, CostModels{&tabled, &p2p, &collective}, t);
  }
}

}  // namespace trainsim
