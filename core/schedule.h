// The schedule: for every rank, the ordered program of ops it runs in one training step,
// and the cross-rank links between them (point-to-point messages, collectives). Both the
// simulator and the runtime execute exactly this; neither invents its own order.
//
// Execution rules, shared by both executors:
//  * Each op runs on one of the rank's streams (compute, collective, p2p). Ops of one
//    stream run in program order, one at a time.
//  * An op also waits for `dep` (another op of the same rank) to end, when set.
//  * Recv ops wait for the matching Send (same `channel`) to end; they do no work, and
//    their Timeline interval is the time the compute stream spent blocked on them.
//  * A collective starts when every member rank has reached it (same `channel`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/units.h"

namespace trainsim {

struct Plan;

enum class OpKind : std::uint8_t {
  Forward,
  Backward,        // input and weight gradients together
  BackwardInput,   // zero-bubble split: gradient w.r.t. the input (on the critical path)
  BackwardWeight,  // zero-bubble split: gradient w.r.t. the weights (fills bubbles)
  SendActivation,
  RecvActivation,
  SendGradient,
  RecvGradient,
  AllReduce,      // data-parallel gradient bucket
  ReduceScatter,  // ZeRO gradient bucket
  AllGather,      // ZeRO parameters
  OverflowCheck,  // loss-scaling found-inf max-reduction (global), or the local check
  OptimizerStep,
};
inline constexpr int kNumOpKinds = 13;

enum class StreamKind : std::uint8_t { compute, collective, p2p };
inline constexpr int kNumStreams = 3;

const char* op_kind_name(OpKind k);

// Forward, Backward*, OptimizerStep
constexpr bool is_compute(OpKind k) {
  return k == OpKind::Forward || k == OpKind::Backward || k == OpKind::BackwardInput ||
         k == OpKind::BackwardWeight || k == OpKind::OptimizerStep;
}
// AllReduce, ReduceScatter, AllGather, OverflowCheck
constexpr bool is_collective(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::OverflowCheck;
}
constexpr bool is_send(OpKind k) { return k == OpKind::SendActivation || k == OpKind::SendGradient; }
constexpr bool is_recv(OpKind k) { return k == OpKind::RecvActivation || k == OpKind::RecvGradient; }
// Receives block the compute stream: the op after them needs what they bring.
constexpr StreamKind stream_of(OpKind k) {
  return is_collective(k) ? StreamKind::collective : is_send(k) ? StreamKind::p2p : StreamKind::compute;
}

struct Op {
  OpKind kind = OpKind::Forward;
  std::int16_t chunk = -1;        // virtual stage (model chunk) index in 0..p*v-1, or -1
  std::int32_t microbatch = -1;   // or -1
  std::int32_t dep = -1;          // op of this rank that must end first, or -1
  std::int32_t peer = -1;         // p2p: the other rank
  std::int32_t channel = -1;      // p2p: message id; collectives: collective id
  std::int32_t bucket = -1;       // gradient bucket, for AllReduce/ReduceScatter and split backwards
  Bytes bytes = 0;                // message / collective payload per rank
  double work = 1.0;              // share of the whole op's work (backward split at bucket bounds)
};

// A short label as in the traces: F3, B3, BI3, BW3, AR b2, ...
std::string op_label(const Op& op);

struct RankProgram {
  int rank = 0, stage = 0, replica = 0;
  std::vector<Op> ops;
};

// Whether the op rank `program`'s compute thread runs after op `i` is a send (collectives go to
// its communication thread): where ranks share cores, a compute op keeps its turn for it.
bool sends_next(const RankProgram& program, int i);

// gradients: data-parallel buckets; embedding: the tied word-embedding gradient shared by
// the first and last stage; parameters: ZeRO gathers; overflow: the found-inf reduction.
enum class CollectivePurpose : std::uint8_t { gradients, embedding, parameters, overflow };

struct Collective {
  OpKind kind = OpKind::AllReduce;
  CollectivePurpose purpose = CollectivePurpose::gradients;
  Bytes bytes = 0;           // payload per member
  std::vector<int> members;  // ranks, ascending
  // The library calls it stands for, one after another, each of bytes / parts: ZeRO-3 gathers
  // the rest of a pass's units after its first, one collective per unit. 0 with no bytes.
  int parts = 1;
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int num_stages = 1, num_replicas = 1, num_chunks = 1, num_microbatches = 1;
  std::vector<RankProgram> ranks;
  std::vector<Collective> collectives;
  int num_messages = 0;

  std::size_t total_ops() const;
};

// Builds the step's programs from a validated plan.
Schedule build_schedule(const Plan& plan);
// The same schedule, built into `out` with its vectors' storage reused (what a sweep
// worker calls plan after plan). Replicas 1.. are derived from replica 0's programs.
void build_schedule_into(const Plan& plan, Schedule& out);
// Replica 0's programs only, into `out`: every rank of `out.ranks` gets its rank, stage and
// replica, but the programs of replicas 1.. are left empty (they would be copies of replica
// 0's with shifted peers and message ids); collectives and message counts are those of the
// full schedule. For callers that simulate replica 0 alone (Predictor::evaluate); with
// dp = 1 it is the full schedule.
void build_replica0_into(const Plan& plan, Schedule& out);

// Checks the structural rules above (every Recv has one Send, collective members agree,
// deps point backwards); returns an empty string when sound, else the first problem.
std::string check_schedule(const Schedule& s);

}  // namespace trainsim
