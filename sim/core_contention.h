// Ranks that share one host's cores, each thread on a core of its own (the CPU backend with no
// more threads than cores), compute at a speed that follows how many of them compute at once.
//
// A calibrated profile's core factor F (HardwareProfile::core_factors) is a rank's compute time
// with every thread of the host computing, and its core alone factor S (core_alone_factors) the
// same with every other core idle, both against the calibration core alone: S holds a core slow by
// itself (a busy neighbour on a shared host), F / S what computing side by side costs (shared
// caches, memory bandwidth, clocks). The compute model prices every compute op at F, which is
// right while every rank computes and wrong while a rank computes with others idle: a pipeline's
// fill and drain, a stage waiting for its neighbour, a replica waiting in a collective. There the
// op runs at S (measured: a two-stage pipeline's bubble 9-10% with F = 1.65 where pricing every op
// at F gave 13.7%; docs/validation.md, "Seventh session").
//
// Between the two ends a compute op progresses at 1 / f(a) of its speed alone, a the threads
// computing on its host at that moment (its own included: its rank's tensor-parallel shards), N
// the plan's threads on the host:
//   f(a) = 1 + (F / S - 1) (a - 1) / (N - 1)
// linear in the threads that compete, exact at one thread (alone) and at N (the calibration's
// together). An op of alone duration A (at S) that starts at s ends at the first e with
//   integral from s to e of dt / f(a(t)) = A,
// and, where the profile says a rank's collectives take its core (collectives_take_rank_core), no
// progress while one of them runs.
//
// GPUs (no calibrated profile) have the same form with one term: a collective's kernels hold
// `cluster.collective_sms` of the GPU's SMs while it runs (NCCL: a block per channel, for the
// collective's whole duration), so a compute op progresses, while one of its rank's collectives
// runs, at the speed it has on the other SMs: its price with sm_count - collective_sms SMs and the
// peak rates scaled alike (the products' tiles then run in more waves; memory-bound kernels keep
// their bandwidth). Off (0) by default: no measured figure yet (docs/model.md).
// Durations and the timeline depend on each other, so the step is simulated again with the ops'
// durations from the last timeline until they agree (a fixed point: each round's durations
// follow from the previous round's overlaps; rounds after the first six are damped).
#pragma once

#include <memory>

#include "core/plan.h"
#include "core/schedule.h"
#include "core/timeline.h"

namespace trainsim {

class Simulation;
class RooflineComputeModel;
class LinkP2PModel;
class NetworkCollectiveModel;

// Whether the plan's compute ops contend as above: a calibrated profile with core factors, at
// least two threads on some host, and no host with more threads than cores (those share cores
// by turns: validation/core_sharing.h).
bool cores_contend(const Plan& plan);
// Whether a GPU plan's collectives slow the compute they overlap (cluster.collective_sms > 0,
// no calibrated profile, some collective).
bool collectives_slow_compute(const Plan& plan);

// `t`, simulated with `compute`'s prices (every op at its core factor), re-simulated until each
// compute op's duration agrees with the threads computing beside it (and, on GPUs, with the
// collectives of its rank beside it). Returns the rounds taken (0: nothing to settle).
int settle_core_contention(const Plan& plan, const std::shared_ptr<const Schedule>& schedule,
                           const RooflineComputeModel& compute, const LinkP2PModel& p2p,
                           const NetworkCollectiveModel& collective, Simulation& sim, Timeline& t);

}  // namespace trainsim
