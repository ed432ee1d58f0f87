// The CPU backend's engine: runs the plan's schedule for real, a rank per thread, and measures it
// (DESIGN.md "Runtime"). Each rank walks its program from build_schedule on two threads
// (runtime/engine/rank_threads.h): compute ops and receives on its compute thread, collectives on
// its communication thread, sends inline (they only copy). Ops are timed with the host's steady
// clock from the step's start; the model is runtime/model/stage_model.h (Eigen, low precision
// emulated by rounding); the communicator the in-process one (runtime/comm/in_process.h), a real
// ring in the wire format. The run itself (steps, numerics log, checkpoints, the result) is the
// run loop's (runtime/loop/run_loop.h); the CPU backend's record is runtime/backend.h's
// cpu_backend().
#pragma once

#include <memory>

#include "runtime/backend.h"
#include "runtime/contract.h"
#include "runtime/data/dataset.h"
#include "runtime/engine/device_engine.h"

namespace trainsim::runtime {

// The engine for `plan`, reading micro-batches from `data` (which must outlive it).
std::unique_ptr<DeviceEngine> make_cpu_engine(const RuntimePlan& plan, const Dataset& data, const RunOptions& options);

// run(cpu_backend(), plan, options) (runtime/loop/run_loop.h).
RunReport run_cpu(const RuntimePlan& plan, const RunOptions& options);

}  // namespace trainsim::runtime
