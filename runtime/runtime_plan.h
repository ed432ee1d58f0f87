// The plan the runtime executes: the scenario's parallel, schedule and precision settings
// applied to the small model of its `runtime:` section (scenario models are far too large to
// train on a CPU). It is an ordinary Plan, so the simulator can predict exactly what the
// runtime runs (validation), and build_schedule gives the runtime its programs.
#pragma once

#include <string>
#include <vector>

#include "core/plan.h"
#include "core/scenario.h"
#include "runtime/model/stage_model.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim::runtime {

struct RuntimePlan {
  Plan plan;                       // model = the runtime model; parallelism as the scenario says
  ModelDims dims;                  // the executed decoder
  std::vector<std::string> notes;  // what the runtime does differently from the scenario, in words
};

// Throws ScenarioError (located in the file when `scenario` has locations) when the runtime
// cannot execute the scenario: too few runtime layers to fill the model chunks, heads not dividing
// the width, heads, width or vocabulary not dividing among tensor-parallel shards, a sequence not
// dividing under sequence parallelism, fp8 compute, ...
RuntimePlan make_runtime_plan(const Scenario& scenario);
RuntimePlan make_runtime_plan(const ScenarioConfig& config);

// The executed StageSpec of virtual stage `vstage`, on tensor-parallel shard `tensor_parallel_rank`
// of context-parallel rank `context_parallel_rank`.
StageSpec stage_spec(const RuntimePlan& rp, int vstage, int tensor_parallel_rank = 0, int context_parallel_rank = 0);
// A middle stage (no embedding, no head) of `layers` blocks at the plan's shapes (shard 0 of a
// tensor-parallel plan's): what the kernel calibrators time against the sum of their kernels
// (composition, per-rank factors).
StageSpec middle_stage_spec(const RuntimePlan& rp, int layers);
OptimizerSettings optimizer_settings(const ScenarioConfig& config);

}  // namespace trainsim::runtime
