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

#include <chrono>
#include <memory>

#include "runtime/backend.h"
#include "runtime/contract.h"
#include "runtime/data/dataset.h"
#include "runtime/engine/device_engine.h"

namespace trainsim::runtime {

// How long a thread of a rank that has a core of its own polls for a message before it sleeps
// (InProcessWorld::communicator's `poll`): a ring all-reduce waits for its peer at every step, a
// pipeline stage at every receive, and a sleeping thread pays a wake-up each time (microseconds on
// an idle core, a scheduler slice on a busy one). A thread woken on the core preempts the poller as
// it would any running thread. The communication thread of a plan whose collectives run beside
// the passes (gradients reduced while the backward runs; ZeRO-2/3's per-micro-batch collectives)
// polls only briefly (kCpuOverlapPoll) for a peer that may not have arrived: longer, it would take
// the core from its own compute thread (docs/validation.md, "Sixth session"; 1 ms moved the
// replicas' skew into their compute, "Twenty-fourth session"); once its peers are in the call (a
// ring's later steps) it polls as long as the compute thread. That thread runs first on its core
// where the system lets it (run_first_on_core, core_gate.h). Ranks that share cores never
// poll. The communication benchmark polls as the compute thread does (calibration measures what a
// step does; its calls all find their peers in the ring).
inline constexpr std::chrono::microseconds kCpuCommPoll{10'000};
inline constexpr std::chrono::microseconds kCpuOverlapPoll{100};

// The cores this host runs threads on (at least 1).
int host_cores();

// Whether the plan's collectives run beside its passes on a rank's core: gradients reduced while
// the backward runs, or ZeRO-2/3's per-micro-batch reduce-scatters and gathers, which overlap the
// passes whatever overlap_grad_reduce says. Pinned, their thread polls kCpuOverlapPoll for a peer.
bool cpu_collectives_beside_compute(const Plan& plan);

// How a rank's communication thread polls (InProcessWorld::communicator's `poll` and
// `poll_in_call`): pinned, kCpuOverlapPoll for a peer where its collectives run beside its compute
// (else kCpuCommPoll) and kCpuCommPoll inside a ring; sharing the cores, never.
struct CpuCollectivePolls {
  std::chrono::microseconds first, in_call;
};
CpuCollectivePolls cpu_collective_polls(bool pinned, bool beside_compute);

// Where ranks share cores: whether their compute threads run first on their cores outside their
// turns (CoreGate's waiting_first), given whether the system grants a thread that
// (may_run_first_on_core): with one shard a cell only (no tensor or context parallelism). A
// turn's shards poll for each other inside its op, and a thread that runs first where one of them
// computes holds up both (the incident's redesign, dp 4 x tp 2 on 2 cores, measured worse with it:
// docs/validation.md, "Twenty-fifth session").
bool cpu_turns_wait_first(int shards_per_cell, bool granted);

// Whether the CPU engine pins rank r's threads to core r: when asked and the ranks fit the cores.
bool cpu_pins_ranks(const RunOptions& options, int ranks);

// The engine for `plan`, reading micro-batches from `data` (which must outlive it).
std::unique_ptr<DeviceEngine> make_cpu_engine(const RuntimePlan& plan, const Dataset& data, const RunOptions& options);

// run(cpu_backend(), plan, options) (runtime/loop/run_loop.h).
RunReport run_cpu(const RuntimePlan& plan, const RunOptions& options);

}  // namespace trainsim::runtime
