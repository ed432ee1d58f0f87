// Scenario files (core/scenario.h, core/plan.h, sim/simulator.h). Whatever bytes a user hands
// `trainsim simulate` as a scenario:
//   * load_scenario_text either loads them or throws ScenarioError (never another exception,
//     a crash, undefined behaviour or a leak);
//   * a scenario that loads either becomes a Plan or is refused with ScenarioError;
//   * a small plan (few enough ops to simulate in a millisecond) is predicted, and the
//     prediction is a step: finite, non-negative times, fractions in [0, 1], one entry per rank.
//     A plan the simulator cannot represent must be refused with std::invalid_argument (bad
//     input to the CLI), as a sweep must skip it and carry on.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "core/plan.h"
#include "core/scenario.h"
#include "core/schedule.h"
#include "core/units.h"
#include "sim/simulator.h"

namespace {

// The harness's own checks: a broken property is a crash, and libFuzzer keeps the input.
void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_scenario: property violated: %s\n", what);
  std::abort();
}

bool in_unit(double x) { return x >= -1e-9 && x <= 1 + 1e-9; }

// Small enough to simulate in well under a millisecond: the schedule's ops grow with ranks x
// micro-batches x virtual stages, and with the gradient buckets of each stage. Larger plans
// are loaded and validated but not simulated (a slow input is not what is looked for here).
constexpr long kMaxRankMicrobatches = 64;
constexpr double kMaxBucketsPerStage = 64;

bool small_enough_to_simulate(const trainsim::Plan& plan) {
  if (static_cast<long>(plan.num_ranks()) * plan.num_microbatches * plan.vpp > kMaxRankMicrobatches) return false;
  if (plan.dp == 1) return true;
  const double bucket = trainsim::mib_to_bytes(plan.config.communication.bucket_size_mib);
  for (int vs = 0; vs < plan.num_virtual_stages(); ++vs)
    if (plan.virtual_stage_params(vs) / plan.tp * 4 / bucket > kMaxBucketsPerStage) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const trainsim::Scenario scenario = trainsim::load_scenario_text(text, "<fuzz>");
    const trainsim::Plan plan = trainsim::Plan::from_scenario(scenario);
    if (!small_enough_to_simulate(plan)) return 0;
    const trainsim::Prediction p = trainsim::predict(plan);
    require(trainsim::check_schedule(*p.schedule).empty(), "the schedule of a valid plan is sound");
    const trainsim::Result& r = p.result;
    require(std::isfinite(r.step_time_s) && r.step_time_s >= 0, "step_time_s is a finite, non-negative time");
    require(in_unit(r.bubble_fraction), "bubble_fraction in [0, 1]");
    require(std::isfinite(r.allreduce_time_s) && r.allreduce_time_s >= 0, "allreduce_time_s finite, >= 0");
    require(std::isfinite(r.exposed_comm_time_s) && r.exposed_comm_time_s >= 0, "exposed_comm_time_s finite, >= 0");
    require(r.ranks.size() == static_cast<std::size_t>(plan.num_ranks()), "one result entry per rank");
    for (const trainsim::RankResult& rk : r.ranks) {
      require(in_unit(rk.utilization), "a rank's utilization in [0, 1]");
      require(std::isfinite(rk.busy_s) && rk.busy_s >= 0, "a rank's busy_s finite, >= 0");
      require(std::isfinite(rk.peak_memory_bytes) && rk.peak_memory_bytes >= 0, "a rank's peak memory finite, >= 0");
    }
  } catch (const trainsim::ScenarioError&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
