// How a step runs when its ranks share cores (more rank threads than cores, the CPU backend's
// oversubscribed runs), predicted op by op.
//
// The CPU engine (runtime/cpu/cpu_engine.h) hands its `cores` to the ranks' compute ops one op at a
// time, in an order fixed before the run (RunOptions::core_turns): an op waits for its turn and a
// free core, then runs whole at the speed of a rank that has a core to itself, and keeps the core
// for the sends of its output that follow it. A rank waiting for its turn is inside its op (busy),
// as a time-shared rank would be. The communication threads (collectives) and the copies of
// receives are not gated; they take what the operating system gives them. A collective's copies
// and sums are work on a core (collectives_take_cores): a communication thread wakes to run it,
// and the scheduler lets a woken thread run before those that kept running, so collectives run
// first, at full speed while their shares of the cores fit, and the turns running beside them
// share what is left. A receive's copy is priced where its receiver slept on the message
// (receiver_copies), not where the message was there first (small next to the compute).
//
// Under ZeRO-3 a pass gathers its weights unit by unit (runtime/engine/zero.h, GatherGate): the
// communication thread gathers the next unit once the rank holds fewer than `zero3_units_held`
// (a unit goes when the pass is done with it), and the pass waits for each unit it reaches; a rank
// that waits in the middle of an op gives its core back and takes a free one again when the unit
// is there, ahead of the turns not begun. Each unit's gather is a collective of the rank's
// data-parallel peers, so where ranks take turns at the cores the passes move unit by unit
// together: a peer whose turn has not come holds up everyone's next unit. The replay runs the
// passes so: a unit's share of its pass's time is its share of the pass's gathered parameters (the
// products' work follows their weights; the embedding's lookup, small at the runtime's sizes, is
// the exception), each unit's gather the rest collective's time over its units.
//
// share_cores replays the schedule that way: each rank's compute thread walks its program in
// order (compute ops through the gate, sends for their copy time on the core of the op before them,
// receives until the message is there, collectives handed to the communication thread), each
// communication thread runs its collectives in order once their producing op ended and every
// member arrived (a ring's steps as their inputs come: `rings`; the turns and collectives running
// at one time share the cores as above: each op's work progresses at its share's rate, the set's
// rates change as ops start and end), and the optimizer
// step waits, between its gradient norm and its update, for every rank's share of the norm (the
// engine's all-reduce over all ranks; the core is free meanwhile). Op durations are those of a
// prediction in which every rank had a core to itself (`alone`), and a turn whose thread slept until
// its core came waits for it to wake (`handoff`). Given no order, it hands cores out
// first come first served (ties: lower rank, then earlier op) and returns that order, which is what
// validate passes to the run and then replays with the profile measured during the run.
#pragma once

#include <vector>

#include "core/timeline.h"
#include "runtime/contract.h"

namespace trainsim::validation {

struct CoreSharing {
  int cores = 1;
  // Of an optimizer step's time, the share before its gradient-norm all-reduce (unscaling and the
  // squared norm), and the all-reduce's time once every rank has reached it.
  double optimizer_first_part = 0.2;
  Tick norm_allreduce = 0;
  // A core handed to a turn whose thread waited for it asleep is idle this long before that thread
  // runs (HardwareProfile::core_handoff_us); a thread that finds its turn and a free core at once
  // pays nothing.
  Tick handoff = 0;
  // Per rank: it skipped its update (an overflow): its optimizer step ends with the norm.
  std::vector<char> skipped_update;
  // Collectives take cores' time beside the turns (their communication threads copy and sum on
  // the CPU backend): each needs min(1, host cores / its members) of a turn's cores at full speed,
  // as its benchmark's member threads had; the collectives running at a time get those shares
  // first (scaled down together when they exceed the cores) and the turns running beside them
  // share the rest. False: collectives run at their own speed beside the turns, which keep theirs.
  bool collectives_take_cores = false;
  // Per collective (its channel), where it runs as a ring of steps (the in-process world's
  // reduce-scatters, gathers and all-reduces past its direct path, runtime/comm/in_process.cpp):
  // a member copies what goes in (`before`: ZeRO-1's bucket packed from the flat gradients, a
  // gather's own section; seconds at full speed) as it arrives, then runs its steps, step k the sum
  // of the chunk its predecessor sent, once its own step k-1 and its predecessor's (for step 0:
  // its predecessor's copy in, after which it sent its first chunk) are done, then copies what
  // comes out (`after`: a reduce-scatter's section, a gather's sections into the flat weights). A
  // ring's mailboxes take any number of messages, so members that arrived early run what does not
  // wait for those still away, on cores the turns then share with them; the rest runs once the last
  // arrives. With collectives_take_cores each copy and step takes a core at full speed, each of
  // the K steps of a ring of n members min(1, host cores / n) of the ring's time alone T over K
  // (the work its benchmark's member threads did, were they busy throughout), so a ring whose
  // members all arrive together takes T. Absent (`ring` false): the collective runs whole on every
  // member once the last arrives.
  struct Ring {
    bool ring = false;
    double before = 0, after = 0;  // seconds at full speed
    // The member threads its price was measured with: its members, or, for the gradients and
    // parameters of context-parallel ranks, every shard of each (its table's group size); 0: its
    // members. Each was busy min(1, host cores / threads) of that time, which is its work.
    int threads = 0;
  };
  std::vector<Ring> rings;
  // A receive copies its message out of the mailbox on the receiving thread (the in-process
  // world's messages are the data). A receiver asleep on the message when it is posted is woken to
  // copy it, and a woken thread takes a core before those that kept running (as a collective's
  // does; the CPU engine's compute threads also run first outside their turns): its copy, as long
  // as the send's own, runs at full speed and the turns share the cores left; the receive ends
  // with it. A receiver that finds its message there copies it in its own time, not priced
  // (small next to the compute). False: a receive ends when its message is posted.
  bool receiver_copies = false;
  // Threads a turn runs on (a schedule rank's tensor- and context-parallel shards, each on its own
  // core where the host has enough): `cores` turns at a time, on the host's `host_cores` (0:
  // cores x threads_per_turn). Where a turn's threads outnumber the host's cores, the operating
  // system time-shares them: a turn's work progresses at host_cores / threads_per_turn of its
  // speed alone (the collectives beside it share the turns' cores as above).
  int threads_per_turn = 1;
  int host_cores = 0;
  // Per rank and op: the share of its duration that time-sharing does not slow (a calibrated
  // prediction's in-op collectives, priced from tables measured with their member threads sharing
  // the host's cores as the turn's do). Empty: none.
  std::vector<std::vector<double>> unslowed;
  // The order compute ops take cores in; empty: first come, first served.
  std::vector<runtime::CoreTurn> turns;
  // ZeRO-3: the units a rank holds at most (runtime::kZero3UnitsHeld), and whether a forward keeps
  // its first unit to its end (one chunk with tied embeddings: the embedding is the LM head).
  int zero3_units_held = 2;
  bool zero3_forward_keeps_first_unit = false;
};

struct SharedStep {
  Timeline timeline;                     // as the runtime would measure it
  std::vector<runtime::CoreTurn> turns;  // the order the cores were handed out in
};

// Throws std::invalid_argument when `sharing.turns` is not an order of every rank's compute ops
// (and the optimizer's second part), or cannot be followed (an op before what it waits for).
SharedStep share_cores(const Timeline& alone, const CoreSharing& sharing);

}  // namespace trainsim::validation
