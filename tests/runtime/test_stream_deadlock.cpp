// A model checker for how the CUDA backend's engine (runtime/cuda/cuda_engine.cpp:
// rank_main, comm_main, send, run_op, optimizer_step) issues one training step onto CUDA
// streams and NCCL communicators, and what it proves about communicator layouts. No GPU is
// involved: the model runs on the schedule (core/schedule.h) alone.
//
// The device, as modelled. Each rank's ops (its program, in program order) sit on streams:
//  * compute: every op that is neither a send nor a collective (forwards, backwards, receives,
//    the optimizer step), in program order;
//  * send: sends, in program order. A send first waits for everything queued on the compute
//    stream before it in program order (send() records an event there and the send stream
//    waits for it). One send stream per rank, or one per destination peer;
//  * collective: the collectives, in program order, each after its `dep`.
// A compute-stream op whose `dep` is a collective waits for it, and so does everything queued
// on the compute stream after it. The optimizer step waits for every collective of the rank,
// then all-reduces the gradient norm over the whole world on the compute stream: modelled as a
// collective of every rank on the world-collective communicator, at the start of the step.
//
// The NCCL facts the model relies on:
//  * per-communicator issue order: the operations of one communicator on one rank execute in
//    the order the host issued them, even when they were queued on different streams. Host
//    issue order is program order (the compute thread issues sends and receives in program
//    order; the collective thread's collectives use their own communicators, and the one they
//    share with the compute thread, the world-collective one, sees them in program order
//    because optimizer_step waits for every collective to be queued first);
//  * rendezvous: a send larger than NCCL's internal buffers completes only together with its
//    receive, so a send and its receive complete together, when both can start at once
//    (conservative: smaller messages could be buffered, which only removes waits);
//  * pairing by order: the k-th send from A to B on a communicator pairs with the k-th receive
//    from A on B on that communicator, whatever the message; the model checks that the pair
//    carries the same message (`channel`), and reports a malformed schedule otherwise;
//  * a collective completes when every member can start it.
// ZeRO is left out: the CUDA backend does not execute its collectives.
// Compute ops complete as soon as they can start: only progress is checked, not time. The
// model runs to a fixpoint, completing whatever can complete; a step that leaves any op
// incomplete deadlocks, and the model says which op heads each stuck stream and why.
//
// What it proves (the tests below), over every schedule kind with pp 2..4, dp 1..2 and 1..16
// micro-batches (with and without reductions overlapping the backward):
//  * one communicator for every send and receive (both directions of a link together, as
//    ncclSend/ncclRecv on one world communicator without grouping) deadlocks every 1F1B, ZB-H1
//    and interleaved-1f1b step with two or more micro-batches; only GPipe (and a single
//    micro-batch) is safe. Smallest case, 1F1B with two stages and two micro-batches: stage 0
//    issues send(F1) before recv(B0), stage 1 issues send(B0) before recv(F1), and each rank's
//    communicator runs them in that order;
//  * a communicator per directed link completes every step of the sweep, with one send stream
//    per rank as with one per destination peer. A shared send stream does serialise a rank's
//    sends to different peers, and a hand-built three-rank program shows that this can
//    deadlock; no schedule the builder makes needs its sends to pass each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <compare>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/diagnostics.h"
#include "core/schedule.h"
#include "runtime/runtime_plan.h"
#include "tests/runtime/runtime_test_config.h"

namespace trainsim::runtime {
namespace {

// 48 layers divide every pp * vpp used below.
ScenarioConfig config(int dp, int pp, ScheduleKind schedule, int vpp, int global_batch) {
  return testing::tiny_plan(dp, pp, schedule, vpp, global_batch, 48);
}

Schedule schedule_of(const ScenarioConfig& c) { return build_schedule(make_runtime_plan(c).plan); }

// ---- communicator layouts -------------------------------------------------------------

enum class P2pCommunicators {
  one_for_all,    // every send and receive of every rank on one world communicator
  one_per_link,   // A -> B on the communicator of the directed link (A, B); B -> A on another
};
enum class SendStreams { one_per_rank, one_per_peer };

// Collectives always get one communicator per distinct member set; the world's member set
// (the found-inf check, the gradient-norm all-reduce) is the world-collective communicator,
// never the one sends and receives use.
struct CommLayout {
  const char* name;
  P2pCommunicators p2p;
  SendStreams sends;
};

constexpr CommLayout kOneP2pCommunicator{"one p2p communicator", P2pCommunicators::one_for_all,
                                         SendStreams::one_per_rank};
constexpr CommLayout kLinkCommunicators{"a communicator per directed link", P2pCommunicators::one_per_link,
                                        SendStreams::one_per_rank};
constexpr CommLayout kLinkCommunicatorsPeerStreams{"a communicator per directed link, a send stream per peer",
                                                   P2pCommunicators::one_per_link, SendStreams::one_per_peer};
constexpr CommLayout kEveryLayout[] = {kOneP2pCommunicator, kLinkCommunicators, kLinkCommunicatorsPeerStreams};

// ---- the model ---------------------------------------------------------------------------

enum class Verdict { completes, deadlock, malformed };

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::completes: return "completes";
    case Verdict::deadlock: return "deadlock";
    case Verdict::malformed: return "malformed";
  }
  return "?";
}

// The op at the head of a stream that still holds ops, when the model stopped.
struct StuckHead {
  int rank = 0;
  std::string stream;  // "compute", "collective", "send", "send to rank 2"
  int op = -1;         // index in the rank's program
  std::string what;    // the op, readable
  std::string why;     // what it waits for
};

struct Outcome {
  Verdict verdict = Verdict::completes;
  std::string problem;           // malformed: the first pairing problem
  std::vector<StuckHead> stuck;  // deadlock: the head of every stream that still holds ops
  int completed = 0, total = 0;  // ops

  std::string describe() const {
    std::ostringstream o;
    o << verdict_name(verdict) << " (" << completed << " of " << total << " ops completed)";
    if (!problem.empty()) o << ": " << problem;
    for (const StuckHead& h : stuck)
      o << "\n  rank " << h.rank << ", " << h.stream << " stream: " << h.what << " -- " << h.why;
    return o.str();
  }
};

std::string op_text(const Schedule& s, int rank, int index) {
  const Op& op = s.ranks[rank].ops[index];
  std::ostringstream o;
  o << '#' << index << ' ' << op_kind_name(op.kind) << '(';
  if (is_send(op.kind) || is_recv(op.kind))
    o << "mb " << op.microbatch << ", " << (is_send(op.kind) ? "to" : "from") << " rank " << op.peer << ", ch "
      << op.channel;
  else if (is_collective(op.kind))
    o << (op.channel < 0 ? std::string("local") : "ch " + std::to_string(op.channel));
  else if (op.kind == OpKind::OptimizerStep)
    o << "+ world norm all-reduce";
  else
    o << "mb " << op.microbatch << ", chunk " << op.chunk;
  o << ')';
  return o.str();
}

class StepModel {
 public:
  StepModel(const Schedule& s, CommLayout layout) : s_(s), layout_(layout), ranks_(static_cast<int>(s.ranks.size())) {
    build();
  }

  Outcome run() {
    Outcome out;
    for (const auto& ops : ops_) out.total += static_cast<int>(ops.size());
    if (!problem_.empty()) {
      out.verdict = Verdict::malformed;
      out.problem = problem_;
      return out;
    }
    done_.assign(ranks_, {});
    pos_.assign(ranks_, {});
    for (int r = 0; r < ranks_; ++r) {
      done_[r].assign(ops_[r].size(), false);
      pos_[r].assign(streams_[r].size(), 0);
    }
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < ranks_; ++r)
        for (std::size_t st = 0; st < streams_[r].size(); ++st)
          while (head(r, st) >= 0 && try_complete(r, head(r, st))) progress = true;
    }
    for (int r = 0; r < ranks_; ++r)
      for (bool d : done_[r]) out.completed += d ? 1 : 0;
    if (out.completed == out.total) return out;
    out.verdict = Verdict::deadlock;
    for (int r = 0; r < ranks_; ++r)
      for (std::size_t st = 0; st < streams_[r].size(); ++st)
        if (const int i = head(r, st); i >= 0)
          out.stuck.push_back({r, stream_names_[r][st], i, op_text(s_, r, i), why_stuck(r, i)});
    return out;
  }

 private:
  struct ModelOp {
    int stream = -1;         // index into the rank's streams
    int comm = -1;           // communicator, or -1 when it uses none
    int prev_on_comm = -1;   // the op this rank issued before it on the same communicator
    std::vector<int> waits;  // ops of this rank that must have completed first
    int partner_rank = -1, partner_op = -1;  // p2p: the matching send or receive
    int group = -1;          // collectives: index into groups_
  };
  enum class CommKind { p2p_world, p2p_link, members };
  struct CommKey {
    CommKind kind;
    int from = -1, to = -1;    // p2p_link
    std::vector<int> members;  // members
    auto operator<=>(const CommKey&) const = default;
  };

  int comm_id(const CommKey& key) {
    const auto [it, added] = comm_ids_.try_emplace(key, static_cast<int>(comm_names_.size()));
    if (added) {
      std::ostringstream name;
      if (key.kind == CommKind::p2p_world) name << "p2p world";
      if (key.kind == CommKind::p2p_link) name << "link " << key.from << "->" << key.to;
      if (key.kind == CommKind::members) {
        if (static_cast<int>(key.members.size()) == ranks_) {
          name << "world collectives";
        } else {
          name << "collectives {";
          for (std::size_t k = 0; k < key.members.size(); ++k) name << (k ? "," : "") << key.members[k];
          name << '}';
        }
      }
      comm_names_.push_back(name.str());
    }
    return it->second;
  }
  int p2p_comm(int from, int to) {
    return layout_.p2p == P2pCommunicators::one_for_all ? comm_id({CommKind::p2p_world, -1, -1, {}})
                                                        : comm_id({CommKind::p2p_link, from, to, {}});
  }
  // A set of one rank needs no communicator: its reduction returns at once.
  int collective_comm(const std::vector<int>& members) {
    return members.size() > 1 ? comm_id({CommKind::members, -1, -1, members}) : -1;
  }

  int send_stream(int r, int peer) {
    const int key = layout_.sends == SendStreams::one_per_peer ? peer : -1;
    const auto [it, added] = send_streams_[r].try_emplace(key, static_cast<int>(stream_names_[r].size()));
    if (added) stream_names_[r].push_back(key < 0 ? std::string("send") : "send to rank " + std::to_string(key));
    return it->second;
  }

  void fail(std::string what) {
    if (problem_.empty()) problem_ = std::move(what);
  }

  void build() {
    const int world_norm = static_cast<int>(s_.collectives.size());  // the optimizer's all-reduce
    groups_.assign(s_.collectives.size() + 1, {});
    ops_.assign(ranks_, {});
    streams_.assign(ranks_, {});
    stream_names_.assign(ranks_, {"compute", "collective"});
    send_streams_.assign(ranks_, {});
    std::vector<int> world(ranks_);
    for (int r = 0; r < ranks_; ++r) world[r] = r;
    // (from, to, communicator) -> the sends, and the receives, in issue order
    std::map<std::tuple<int, int, int>, std::vector<int>> sends, recvs;

    for (int r = 0; r < ranks_; ++r) {
      const std::vector<Op>& prog = s_.ranks[r].ops;
      std::vector<ModelOp>& ops = ops_[r];
      ops.resize(prog.size());
      std::map<int, int> last_on_comm;
      int last_compute = -1;                // the last op queued on the compute stream
      std::vector<int> compute_stream_waits;  // collectives the compute stream was made to wait for
      for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
        const Op& op = prog[i];
        ModelOp& m = ops[i];
        if (is_collective(op.kind)) {
          m.stream = 1;
          if (op.dep >= 0) m.waits.push_back(op.dep);
          if (op.channel >= 0) {
            if (op.channel >= world_norm) {
              fail("rank " + std::to_string(r) + " " + op_text(s_, r, i) + " names no collective");
              continue;
            }
            const std::vector<int>& members = s_.collectives[op.channel].members;
            if (!std::binary_search(members.begin(), members.end(), r))
              fail("rank " + std::to_string(r) + " " + op_text(s_, r, i) + " is not a member of its collective");
            m.comm = collective_comm(members);
            m.group = op.channel;
            groups_[op.channel].push_back({r, i});
          }
        } else if (is_send(op.kind)) {
          m.stream = send_stream(r, op.peer);
          if (last_compute >= 0) m.waits.push_back(last_compute);
          m.waits.insert(m.waits.end(), compute_stream_waits.begin(), compute_stream_waits.end());
          m.comm = p2p_comm(r, op.peer);
          sends[{r, op.peer, m.comm}].push_back(i);
        } else {
          m.stream = 0;
          if (op.dep >= 0 && is_collective(prog[op.dep].kind)) {
            m.waits.push_back(op.dep);
            compute_stream_waits.push_back(op.dep);
          }
          if (is_recv(op.kind)) {
            m.comm = p2p_comm(op.peer, r);
            recvs[{op.peer, r, m.comm}].push_back(i);
          }
          if (op.kind == OpKind::OptimizerStep) {
            for (int j = 0; j < static_cast<int>(prog.size()); ++j)
              if (is_collective(prog[j].kind)) {
                m.waits.push_back(j);
                compute_stream_waits.push_back(j);
              }
            m.comm = collective_comm(world);
            m.group = world_norm;
            groups_[world_norm].push_back({r, i});
          }
          last_compute = i;
        }
        if (m.comm >= 0) {
          const auto [it, first] = last_on_comm.try_emplace(m.comm, i);
          if (!first) m.prev_on_comm = std::exchange(it->second, i);
        }
      }
      streams_[r].resize(stream_names_[r].size());
      for (int i = 0; i < static_cast<int>(prog.size()); ++i) streams_[r][ops[i].stream].push_back(i);
    }

    // The k-th send from A to B on a communicator meets the k-th receive from A on B there.
    std::set<std::tuple<int, int, int>> links;
    for (const auto& [link, list] : sends) links.insert(link);
    for (const auto& [link, list] : recvs) links.insert(link);
    for (const auto& link : links) {
      const auto [from, to, comm] = link;
      const std::vector<int>& sent = sends[link];
      const std::vector<int>& received = recvs[link];
      if (sent.size() != received.size()) {
        fail("rank " + std::to_string(from) + " sends " + std::to_string(sent.size()) + " messages to rank " +
             std::to_string(to) + " on " + comm_names_[comm] + ", which receives " + std::to_string(received.size()));
        continue;
      }
      for (std::size_t k = 0; k < sent.size(); ++k) {
        if (s_.ranks[from].ops[sent[k]].channel != s_.ranks[to].ops[received[k]].channel)
          fail("message " + std::to_string(k) + " from rank " + std::to_string(from) + " to rank " +
               std::to_string(to) + " on " + comm_names_[comm] + " pairs rank " + std::to_string(from) + "'s " +
               op_text(s_, from, sent[k]) + " with rank " + std::to_string(to) + "'s " + op_text(s_, to, received[k]));
        ops_[from][sent[k]].partner_rank = to;
        ops_[from][sent[k]].partner_op = received[k];
        ops_[to][received[k]].partner_rank = from;
        ops_[to][received[k]].partner_op = sent[k];
      }
    }
    for (std::size_t c = 0; c < groups_.size(); ++c) {
      const std::vector<int>& members = c < s_.collectives.size() ? s_.collectives[c].members : world;
      if (groups_[c].size() != members.size())
        fail("collective " + std::to_string(c) + " has " + std::to_string(members.size()) + " members but " +
             std::to_string(groups_[c].size()) + " ops reach it");
    }
  }

  int head(int r, std::size_t st) const {
    return pos_[r][st] < streams_[r][st].size() ? streams_[r][st][pos_[r][st]] : -1;
  }

  // At the head of its stream, every wait met, first in its communicator's queue.
  bool can_start(int r, int i) const {
    const ModelOp& m = ops_[r][i];
    if (head(r, m.stream) != i) return false;
    for (int w : m.waits)
      if (!done_[r][w]) return false;
    return m.prev_on_comm < 0 || done_[r][m.prev_on_comm];
  }

  void complete(int r, int i) {
    done_[r][i] = true;
    ++pos_[r][ops_[r][i].stream];
  }

  bool try_complete(int r, int i) {
    if (!can_start(r, i)) return false;
    const ModelOp& m = ops_[r][i];
    if (m.partner_rank >= 0) {
      if (!can_start(m.partner_rank, m.partner_op)) return false;
      complete(m.partner_rank, m.partner_op);
    } else if (m.group >= 0) {
      const auto& members = groups_[m.group];
      if (!std::all_of(members.begin(), members.end(), [&](const auto& ro) { return can_start(ro.first, ro.second); }))
        return false;
      for (const auto& [mr, mi] : members)
        if (mr != r) complete(mr, mi);
    }
    complete(r, i);
    return true;
  }

  std::string why_stuck(int r, int i) const {
    const ModelOp& m = ops_[r][i];
    std::ostringstream why;
    const char* sep = "";
    for (int w : m.waits)
      if (!done_[r][w]) {
        why << sep << "waits for " << op_text(s_, r, w);
        sep = "; ";
      }
    if (m.prev_on_comm >= 0 && !done_[r][m.prev_on_comm]) {
      why << sep << "queued on communicator '" << comm_names_[m.comm] << "' behind " << op_text(s_, r, m.prev_on_comm);
      sep = "; ";
    }
    if (can_start(r, i)) {
      if (m.partner_rank >= 0) {
        why << "ready; rank " << m.partner_rank << " cannot start its " << op_text(s_, m.partner_rank, m.partner_op);
      } else if (m.group >= 0) {
        why << "ready on communicator '" << comm_names_[m.comm] << "'; not ready:";
        const char* comma = " ";
        for (const auto& [mr, mi] : groups_[m.group])
          if (!can_start(mr, mi)) {
            why << comma << "rank " << mr << "'s " << op_text(s_, mr, mi);
            comma = ", ";
          }
      }
    }
    return why.str();
  }

  const Schedule& s_;
  const CommLayout layout_;
  const int ranks_;
  std::vector<std::vector<ModelOp>> ops_;                    // [rank][op]
  std::vector<std::vector<std::vector<int>>> streams_;       // [rank][stream] -> ops, in order
  std::vector<std::vector<std::string>> stream_names_;       // [rank][stream]
  std::vector<std::map<int, int>> send_streams_;             // [rank]: peer (or -1) -> stream
  std::map<CommKey, int> comm_ids_;
  std::vector<std::string> comm_names_;
  std::vector<std::vector<std::pair<int, int>>> groups_;     // collective -> (rank, op) of each member
  std::string problem_;
  std::vector<std::vector<bool>> done_;                      // [rank][op]
  std::vector<std::vector<std::size_t>> pos_;                // [rank][stream]: ops of it completed
};

Outcome check_step(const Schedule& s, CommLayout layout) { return StepModel(s, layout).run(); }

// ---- the schedules ------------------------------------------------------------------------

struct Shape {
  ScheduleKind kind;
  int pp, dp, vpp, microbatches;
  bool overlap;  // gradient buckets reduced during the backward, several per stage

  std::string name() const {
    std::ostringstream o;
    o << schedule_name(kind) << " pp" << pp << " dp" << dp << " vpp" << vpp << " m" << microbatches
      << (overlap ? " overlap" : "");
    return o.str();
  }
  ScenarioConfig scenario() const {
    ScenarioConfig c = config(dp, pp, kind, vpp, dp * microbatches);
    if (overlap) {
      c.communication.overlap_grad_reduce = true;
      c.communication.bucket_size_mib = 0.01;
    }
    return c;
  }
};

struct Case {
  Shape shape;
  Schedule schedule;
};

// Every schedule kind over pp 2..4, dp 1..2 and 1..16 micro-batches, with and without the
// reductions overlapping the backward (dp 2): those the plan accepts (interleaved-1f1b needs
// a multiple of pp micro-batches). Built once.
const std::vector<Case>& sweep() {
  static const std::vector<Case> cases = [] {
    struct Kind {
      ScheduleKind kind;
      int vpp;
    };
    const Kind kinds[] = {{ScheduleKind::gpipe, 1},
                          {ScheduleKind::one_f_one_b, 1},
                          {ScheduleKind::interleaved_1f1b, 2},
                          {ScheduleKind::interleaved_1f1b, 4},
                          {ScheduleKind::zb_h1, 1}};
    std::vector<Case> out;
    for (const Kind& k : kinds)
      for (int pp = 2; pp <= 4; ++pp)
        for (int dp = 1; dp <= 2; ++dp)
          for (int m = 1; m <= 16; ++m)
            for (bool overlap : {false, true}) {
              if (overlap && dp == 1) continue;
              const Shape shape{k.kind, pp, dp, k.vpp, m, overlap};
              try {
                out.push_back({shape, schedule_of(shape.scenario())});
              } catch (const ScenarioError&) {
                // not a valid plan (interleaved-1f1b with m not a multiple of pp): skipped
              }
            }
    return out;
  }();
  return cases;
}

// One send or receive of a hand-built schedule.
Op p2p(OpKind kind, int peer, int channel) {
  Op op{kind, 0, 0};
  op.peer = peer;
  op.channel = channel;
  return op;
}

// Programs as given, each ended by the optimizer step.
Schedule hand_built(std::vector<std::vector<Op>> programs, int messages) {
  Schedule s;
  s.num_stages = static_cast<int>(programs.size());
  s.num_messages = messages;
  s.ranks.resize(programs.size());
  for (std::size_t r = 0; r < programs.size(); ++r) {
    s.ranks[r].rank = s.ranks[r].stage = static_cast<int>(r);
    s.ranks[r].ops = std::move(programs[r]);
    s.ranks[r].ops.push_back(Op{OpKind::OptimizerStep});
  }
  return s;
}

bool stuck_at(const Outcome& out, const Schedule& s, int rank, OpKind kind, int microbatch) {
  return std::any_of(out.stuck.begin(), out.stuck.end(), [&](const StuckHead& h) {
    const Op& op = s.ranks[rank].ops[h.op];
    return h.rank == rank && op.kind == kind && op.microbatch == microbatch;
  });
}

// ---- the tests -------------------------------------------------------------------------

// Both directions of a link on one communicator: 1F1B's steady state crosses them.
TEST(StreamDeadlock, OneP2pCommunicatorDeadlocksOneFOneBFromTwoMicrobatches) {
  for (int m = 1; m <= 16; ++m) {
    const Schedule s = schedule_of(config(1, 2, ScheduleKind::one_f_one_b, 1, m));
    const Outcome out = check_step(s, kOneP2pCommunicator);
    if (m == 1) {
      // One micro-batch: F0, send, receive, B0 on both stages; nothing to cross.
      EXPECT_EQ(out.verdict, Verdict::completes) << out.describe();
      continue;
    }
    ASSERT_EQ(out.verdict, Verdict::deadlock) << "m" << m << ": " << out.describe();
    // Stage 0 sends F1's activation before receiving B0's gradient; stage 1 sends B0's
    // gradient before receiving F1's activation: each waits behind its own first op.
    EXPECT_TRUE(stuck_at(out, s, 0, OpKind::SendActivation, 1)) << out.describe();
    EXPECT_TRUE(stuck_at(out, s, 0, OpKind::RecvGradient, 0)) << out.describe();
    EXPECT_TRUE(stuck_at(out, s, 1, OpKind::SendGradient, 0)) << out.describe();
    EXPECT_TRUE(stuck_at(out, s, 1, OpKind::RecvActivation, 1)) << out.describe();
    const std::string text = out.describe();
    for (const char* needle : {"rank 0, send stream: #", "rank 1, send stream: #", "SendActivation(mb 1",
                               "SendGradient(mb 0", "queued on communicator 'p2p world' behind"})
      EXPECT_NE(text.find(needle), std::string::npos) << needle << " not in\n" << text;
  }
}

// Over the whole sweep, one p2p communicator is safe only where no two ranks ever have
// messages in flight both ways: GPipe (every forward, then every backward) or a single
// micro-batch. 1F1B and ZB-H1 cross at the last two stages as above; interleaved-1f1b also
// sends from the last stage back to the first, so even its all-forward warm-up crosses.
TEST(StreamDeadlock, OneP2pCommunicatorIsSafeOnlyForGPipeOrOneMicrobatch) {
  int deadlocks = 0;
  for (const auto& [shape, s] : sweep()) {
    const Outcome out = check_step(s, kOneP2pCommunicator);
    const bool safe = shape.kind == ScheduleKind::gpipe || shape.microbatches == 1;
    EXPECT_EQ(out.verdict, safe ? Verdict::completes : Verdict::deadlock) << shape.name() << ": " << out.describe();
    deadlocks += out.verdict == Verdict::deadlock ? 1 : 0;
  }
  EXPECT_GT(deadlocks, 100);
}

// The layout the executor relies on, a communicator per directed link, completes every
// schedule of the sweep with one send stream per rank; one per peer only removes waits.
TEST(StreamDeadlock, LinkCommunicatorsCompleteEverySchedule) {
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_GT(sweep().size(), 500u);
  for (const CommLayout& layout : {kLinkCommunicators, kLinkCommunicatorsPeerStreams})
    for (const auto& [shape, s] : sweep()) {
      const Outcome out = check_step(s, layout);
      EXPECT_EQ(out.verdict, Verdict::completes) << layout.name << ", " << shape.name() << ": " << out.describe();
      EXPECT_EQ(out.completed, static_cast<int>(s.total_ops()));
    }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0) << sweep().size() << " schedules";
}

// What a send stream per peer would guard against, though no schedule above needs it: rank 0
// sends to rank 1, then to rank 2; rank 1 first receives from rank 2, which first receives from
// rank 0. On one send stream, rank 0's second send waits behind its first, which waits for
// rank 1, which waits for rank 2, which waits for that second send.
TEST(StreamDeadlock, ASharedSendStreamSerialisesSendsToDifferentPeers) {
  const Schedule s = hand_built({{p2p(OpKind::SendActivation, 1, 0), p2p(OpKind::SendActivation, 2, 1)},
                                 {p2p(OpKind::RecvActivation, 2, 2), p2p(OpKind::RecvActivation, 0, 0)},
                                 {p2p(OpKind::RecvActivation, 0, 1), p2p(OpKind::SendActivation, 1, 2)}},
                                3);
  ASSERT_EQ(check_schedule(s), "");
  const Outcome shared = check_step(s, kLinkCommunicators);
  ASSERT_EQ(shared.verdict, Verdict::deadlock) << shared.describe();
  const auto head = std::find_if(shared.stuck.begin(), shared.stuck.end(),
                                 [](const StuckHead& h) { return h.rank == 0 && h.stream == "send"; });
  ASSERT_NE(head, shared.stuck.end()) << shared.describe();
  EXPECT_EQ(head->op, 0) << shared.describe();
  EXPECT_EQ(head->why.rfind("ready; rank 1 cannot start", 0), 0u) << shared.describe();
  const Outcome per_peer = check_step(s, kLinkCommunicatorsPeerStreams);
  EXPECT_EQ(per_peer.verdict, Verdict::completes) << per_peer.describe();
}

// Two ranks that each receive from the other before sending: no layout can save that.
TEST(StreamDeadlock, TheModelBlocksOnACycleOfReceives) {
  std::vector<std::vector<Op>> programs;
  for (int r = 0; r < 2; ++r) {
    Op send = p2p(OpKind::SendActivation, 1 - r, r);  // message c is sent by rank c
    send.dep = 1;
    programs.push_back({p2p(OpKind::RecvActivation, 1 - r, 1 - r), Op{OpKind::Forward, 0, 0}, send});
  }
  const Schedule s = hand_built(std::move(programs), 2);
  ASSERT_EQ(check_schedule(s), "");
  for (const CommLayout& layout : kEveryLayout) {
    const Outcome out = check_step(s, layout);
    ASSERT_EQ(out.verdict, Verdict::deadlock) << layout.name << ": " << out.describe();
    EXPECT_EQ(out.completed, 0) << out.describe();
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(stuck_at(out, s, r, OpKind::RecvActivation, 0)) << out.describe();
      EXPECT_TRUE(stuck_at(out, s, r, OpKind::SendActivation, 0)) << out.describe();
    }
  }

  // The same cycle inside a real schedule: stage 0 of 1F1B receiving B0's gradient before it
  // sends F0's activation.
  Schedule one_f_one_b = schedule_of(config(1, 2, ScheduleKind::one_f_one_b, 1, 4));
  auto& ops = one_f_one_b.ranks[0].ops;
  const auto find = [&](OpKind kind, int mb) {
    return static_cast<int>(std::find_if(ops.begin(), ops.end(),
                                         [&](const Op& op) { return op.kind == kind && op.microbatch == mb; }) -
                            ops.begin());
  };
  const int send = find(OpKind::SendActivation, 0), recv = find(OpKind::RecvGradient, 0);
  ASSERT_LT(send, recv);
  ASSERT_EQ(check_step(one_f_one_b, kLinkCommunicatorsPeerStreams).verdict, Verdict::completes);
  // Move the receive to just before the send; the ops in between move up by one.
  std::rotate(ops.begin() + send, ops.begin() + recv, ops.begin() + recv + 1);
  for (Op& op : ops) {
    if (op.dep == recv)
      op.dep = send;
    else if (op.dep >= send && op.dep < recv)
      ++op.dep;
  }
  ASSERT_EQ(check_schedule(one_f_one_b), "");
  for (const CommLayout& layout : kEveryLayout)
    EXPECT_EQ(check_step(one_f_one_b, layout).verdict, Verdict::deadlock) << layout.name;
}

// NCCL pairs by order: receives swapped on one side meet the wrong sends, which the model reports.
TEST(StreamDeadlock, MessagesPairByOrderNotByChannel) {
  Schedule s = schedule_of(config(1, 2, ScheduleKind::gpipe, 1, 4));
  std::vector<Op*> recvs;
  for (Op& op : s.ranks[1].ops)
    if (op.kind == OpKind::RecvActivation) recvs.push_back(&op);
  ASSERT_GE(recvs.size(), 2u);
  ASSERT_EQ(check_step(s, kOneP2pCommunicator).verdict, Verdict::completes);
  std::swap(*recvs[0], *recvs[1]);
  ASSERT_EQ(check_schedule(s), "");  // every message still has its send and its receive
  for (const CommLayout& layout : kEveryLayout) {
    const Outcome out = check_step(s, layout);
    ASSERT_EQ(out.verdict, Verdict::malformed) << layout.name << ": " << out.describe();
    EXPECT_NE(out.problem.find("message 0 from rank 0 to rank 1"), std::string::npos) << out.problem;
  }
}

// No pipeline: one rank alone, and four replicas reducing their gradients.
TEST(StreamDeadlock, SingleRankAndPureDataParallelCompleteUnderEveryLayout) {
  for (const ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zb_h1})
    for (const int dp : {1, 4})
      for (const bool overlap : {false, true}) {
        const Shape shape{kind, 1, dp, 1, 4, overlap};
        const Schedule s = schedule_of(shape.scenario());
        ASSERT_EQ(s.ranks.size(), static_cast<std::size_t>(dp));
        if (dp > 1) {
          EXPECT_GT(s.collectives.size(), 1u) << shape.name();
        }
        for (const CommLayout& layout : kEveryLayout) {
          const Outcome out = check_step(s, layout);
          EXPECT_EQ(out.verdict, Verdict::completes) << shape.name() << ", " << layout.name << ": " << out.describe();
          EXPECT_EQ(out.completed, static_cast<int>(s.total_ops()));
        }
      }
}

}  // namespace
}  // namespace trainsim::runtime
