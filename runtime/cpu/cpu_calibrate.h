// `trainsim calibrate --backend cpu`: the CPU backend's kernel calibrator (runtime/calibrate/
// calibrate.h's method) and its profile. Each kernel of the plan's inventory is timed with the
// runtime's own implementation of it (runtime/model/layers.h, runtime/numerics/) on buffers of
// fresh random values, on a thread pinned to core 0 like rank 0's compute thread; its stage of
// the runtime's own blocks runs alone on core 0 and on every rank's core at once.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/hardware_profile.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/runtime_plan.h"

namespace trainsim::runtime {

// The CPU backend's kernel calibrator for `plan` (its clock: the runtime's own kernels, pinned).
std::unique_ptr<KernelCalibrator> make_cpu_kernel_calibrator(const RuntimePlan& plan, const CalibrateOptions& options);

// A profile with the machine's description and no rates yet (and, for a plan with more ranks than
// cores, the core handoff).
HardwareProfile describe_cpu_profile(const RuntimePlan& plan, const std::string& name);
// HardwareProfile::core_handoff_us in seconds: what a turn of the engine's CoreGate costs beyond its
// work, `cells` schedule ranks of `shards` threads each taking `turns_per_cell` turns in
// round-robin order on this machine's cores.
double core_handoff_seconds(int cells, int shards, int turns_per_cell = 50);
// HardwareProfile::comm_wake_us in seconds: what a 2-member all-reduce of `bytes` takes longer,
// from its last member's arrival, when the first arrived a millisecond earlier and slept, than
// when both arrive together; each member on a core of its own beside a spinning thread, its
// thread as the engine runs a pinned rank's collectives beside its compute (kCpuOverlapPoll for a
// peer, polling inside the ring, run_first_on_core where granted). Medians of `calls` each; 0
// where the difference is not positive. Needs two cores.
double comm_wake_seconds(std::size_t bytes, int calls = 100);
// HardwareProfile::comm_late's points: what a 2-member all-reduce of `bytes` takes longer, from
// its last member's arrival, when the first arrived each of `leads` earlier (polling for it as the
// engine's pinned ranks whose collectives wait for the passes do, kCpuCommPoll, then asleep) while
// the last computed, than when both arrive together; each member on a core of its own. Every kind
// of call in four interleaved rounds of calls / 4, the difference of their medians (0 where it is
// not positive); and the call's time when they arrive together (comm_late_base_us). Needs two
// cores.
struct CommLateCurve {
  std::vector<HardwareProfile::LatePoint> points;
  double together_us = 0;
};
CommLateCurve comm_late_curve(std::size_t bytes, std::span<const std::chrono::microseconds> leads, int calls = 20);
// The leads the profile measures: 1, 2 and 4 ms, and 0.9, 1.1 and 2 x the poll (the first member
// asleep in the last two).
std::vector<std::chrono::microseconds> comm_late_leads();
// Where ranks share cores, calibration times every rank's stage in the order the run gives them the
// cores, one op a turn: rotation_rounds(cores, ranks) rounds, in round `round` core `core` runs
// rotation_rank(...) (-1: none, a spare core of the last round). Every rank once a round-robin
// cycle, never two cores on one rank at once, and cycle 1 one `cell` on from cycle 0 (a
// tensor-parallel cell's shards, consecutive ranks, stay in one round as its turn takes their
// cores together; 1 without tensor parallelism), so that a rank's timed ops find its data where
// other ranks' ops, and another core, left it.
int rotation_rounds(int cores, int ranks);
int rotation_rank(int round, int core, int cycle, int cores, int ranks, int cell = 1);
// The machine's CPU model and core count, for the profile's `device`.
std::string cpu_description();
// calibrate_profile(cpu_backend(), ...).
HardwareProfile calibrate_cpu(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options,
                              CommBenchResult* comm_table = nullptr);

}  // namespace trainsim::runtime
