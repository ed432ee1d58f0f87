#include "sim/step_program.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "sim/cost/model_calls.h"

namespace trainsim {

namespace {

constexpr std::int32_t kCompute = static_cast<std::int32_t>(StreamKind::compute);
constexpr std::int32_t kCollective = static_cast<std::int32_t>(StreamKind::collective);

constexpr auto kStreamOf = [] {
  std::array<std::uint8_t, kNumOpKinds> t{};
  for (int k = 0; k < kNumOpKinds; ++k) t[k] = static_cast<std::uint8_t>(stream_of(static_cast<OpKind>(k)));
  return t;
}();
std::int32_t stream_index(OpKind k) { return kStreamOf[static_cast<std::uint8_t>(k)]; }

// B ticks, one per lane, as one vector (GCC's vector extension: element-wise operators).
typedef Tick Lanes4 __attribute__((vector_size(4 * sizeof(Tick))));
template <int B>
struct LanesOf;
template <>
struct LanesOf<4> {
  using type = Lanes4;
};

// The engine's worklist (sim/engine.cpp, Simulation::advance) without times: it settles the
// ops in the same dependency order and emits, for each, the instruction that computes its end.
class Compiler {
 public:
  Compiler(const Schedule& s, std::vector<std::uint8_t> simulated) : s_(s), simulated_(std::move(simulated)) {}

  struct Output {
    // a, b, c, price tag, then the op whose interval it writes: rank (| kRecv for a receive,
    // whose interval starts at T[a]; -1: none) and index in the rank's program.
    std::vector<std::array<std::int32_t, 6>> program;
    std::vector<std::array<std::int32_t, 4>> fanout;  // collective members: rank, index, end cell, price tag
    std::vector<std::array<std::int32_t, 4>> held;    // receives folded into the next op: rank, index, prev, sent
    // Per op: its end's cell, then its price tag or, for a receive, -1 - the cell its
    // interval starts from (the end of the op before it on its stream).
    std::vector<std::array<std::int32_t, 2>> slots;
    std::vector<std::int32_t> first_slot;
    std::vector<std::array<std::int32_t, 2>> compute;  // rank, op
    std::vector<std::array<std::int32_t, 3>> priced;   // every compute op: rank, op, its class (1..)
    std::vector<std::tuple<std::int32_t, std::int32_t, Bytes>> sends;
    std::vector<std::int32_t> collectives;
  };

  // False when the step cannot complete (a deadlock).
  bool compile(Output& out) {
    out_ = &out;
    const auto nranks = static_cast<std::int32_t>(s_.ranks.size());
    out.first_slot.assign(nranks, -1);
    std::int64_t expected = 0;
    for (std::int32_t r = 0; r < nranks; ++r) {
      if (!simulated_[r]) continue;
      out.first_slot[r] = static_cast<std::int32_t>(expected);
      expected += static_cast<std::int64_t>(s_.ranks[r].ops.size());
    }
    out.slots.assign(static_cast<std::size_t>(expected), {-1, 0});
    streams_.assign(static_cast<std::size_t>(nranks) * kNumStreams, Stream{});
    message_cell_.assign(s_.num_messages, -1);
    collectives_.assign(s_.collectives.size(), CollectiveState{});
    // Ops that another op's dep names: a receive among them keeps its own instruction.
    dep_target_.assign(static_cast<std::size_t>(expected), 0);
    for (std::int32_t r = 0; r < nranks; ++r)
      if (simulated_[r])
        for (const Op& op : s_.ranks[r].ops)
          if (op.dep >= 0) dep_target_[slot_of(r, op.dep)] = 1;
    // Members that must arrive: the simulated ones.
    for (std::size_t c = 0; c < s_.collectives.size(); ++c)
      for (int m : s_.collectives[c].members) collectives_[c].target += simulated_[m] ? 1 : 0;
    for (std::int32_t r = nranks - 1; r >= 0; --r)
      if (simulated_[r])
        for (std::int32_t k = kNumStreams - 1; k >= 0; --k) enqueue(r * kNumStreams + k);
    while (!worklist_.empty()) {
      const std::int32_t stream = worklist_.back();
      worklist_.pop_back();
      streams_[stream].queued = false;
      advance(stream);
    }
    return completed_ == expected;
  }

 private:
  struct Stream {
    std::int32_t cursor = 0;
    std::int32_t last = 0;  // cell of the previous op's end (0: T[0] = 0)
    // A receive held back to be folded into the op after it (held >= 0: its index): that
    // op's end is max(last before the receive, the send's end, its own dep) + its price.
    std::int32_t held = -1, held_prev = 0, held_sent = 0;
    bool arrived = false, waits_dep = false, queued = false;
  };

  // Whether the next op of stream k after op i is a compute op (not another receive).
  bool compute_follows(const std::vector<Op>& ops, std::int32_t i, std::int32_t k) const {
    auto j = static_cast<std::size_t>(i) + 1;
    while (j < ops.size() && stream_index(ops[j].kind) != k) ++j;
    return j < ops.size() && is_compute(ops[j].kind);
  }
  struct CollectiveState {
    std::int32_t target = 0;
    std::vector<std::int32_t> arrivals;  // (member, prev cell, dep cell) triples
  };

  void enqueue(std::int32_t stream) {
    Stream& st = streams_[stream];
    if (st.queued) return;
    st.queued = true;
    worklist_.push_back(stream);
  }

  // Emits T[new] = max(cells) + D[price], writing op `index` of `rank` (-1: none); returns
  // the new cell.
  std::int32_t emit(std::int32_t a, std::int32_t b, std::int32_t c, std::int32_t price, std::int32_t rank = -1,
                    std::int32_t index = 0) {
    out_->program.push_back({a, b, c, price, rank, index});
    return static_cast<std::int32_t>(out_->program.size());  // T[k + 1] for instruction k
  }

  std::int32_t slot_of(std::int32_t rank, std::int32_t op) const { return out_->first_slot[rank] + op; }

  std::int32_t compute_price(std::int32_t r, const Op& op, std::int32_t index) {
    // What RooflineComputeModel::duration reads: rank, kind, chunk, share of the work, and whether
    // it is the chunk's first forward of the step (priced cold under a calibrated profile).
    const bool first_forward = op.kind == OpKind::Forward && op.microbatch == 0;
    const auto key = std::make_tuple(r, static_cast<int>(op.kind), static_cast<int>(op.chunk), first_forward, op.work);
    auto [it, added] = compute_prices_.try_emplace(key, 0);
    if (added) {
      out_->compute.push_back({r, index});
      it->second = static_cast<std::int32_t>(out_->compute.size());  // D[1 ..] (finalised below)
    }
    out_->priced.push_back({r, index, it->second});
    return it->second;
  }
  std::int32_t send_price(std::int32_t r, const Op& op) {
    const auto key = std::make_tuple(r, op.peer, op.bytes);
    auto [it, added] = send_prices_.try_emplace(key, 0);
    if (added) {
      out_->sends.emplace_back(r, op.peer, op.bytes);
      it->second = kSendTag + static_cast<std::int32_t>(out_->sends.size());
    }
    return it->second;
  }
  std::int32_t collective_price(std::int32_t c) {
    const Collective& col = s_.collectives[c];
    // The purpose too: the collective model prices a data-parallel one over its ranks'
    // context-parallel GPUs as well (NetworkCollectiveModel::duration).
    const auto key = std::make_tuple(static_cast<int>(col.kind), static_cast<int>(col.purpose), col.parts, col.bytes,
                                     col.members);
    auto [it, added] = collective_prices_.try_emplace(key, 0);
    if (added) {
      out_->collectives.push_back(c);
      it->second = kCollectiveTag + static_cast<std::int32_t>(out_->collectives.size());
    }
    return it->second;
  }

  void advance(std::int32_t stream) {
    const std::int32_t r = stream / kNumStreams;
    const std::int32_t k = stream - r * kNumStreams;
    const auto& ops = s_.ranks[r].ops;
    const auto n = static_cast<std::int32_t>(ops.size());
    Stream* rank_streams = &streams_[static_cast<std::size_t>(r) * kNumStreams];
    Stream& st = rank_streams[k];
    st.waits_dep = false;
    bool progressed = false;
    for (;;) {
      std::int32_t i = st.cursor;
      while (i < n && stream_index(ops[i].kind) != k) ++i;
      st.cursor = i;
      if (i == n) break;
      const Op& op = ops[i];
      std::int32_t dep = 0;
      if (op.dep >= 0) {
        const std::int32_t d = op.dep;
        const std::int32_t kd = stream_index(ops[d].kind);
        if (kd != k && d >= rank_streams[kd].cursor) {
          st.waits_dep = true;
          break;
        }
        dep = out_->slots[slot_of(r, d)][0];
      }
      auto& slot = out_->slots[slot_of(r, i)];
      if (is_recv(op.kind)) {
        const std::int32_t sent = message_cell_[op.channel];
        if (sent < 0) break;
        if (op.dep < 0 && !dep_target_[slot_of(r, i)] && compute_follows(ops, i, k)) {
          // Nothing reads its end but the op after it: folded into that op's instruction
          // (a third fewer instructions in a pipeline), its interval written from the same cells.
          st.held = i;
          st.held_prev = st.last;
          st.held_sent = sent;
          slot = {-1, -st.last - 1};
        } else {
          // Spans the wait: from the stream's last end.
          slot = {emit(st.last, dep, sent, 0, r | StepProgram::kRecv, i), -st.last - 1};
          st.last = slot[0];
        }
      } else if (is_collective(op.kind) && op.channel >= 0) {
        if (st.arrived) break;
        const std::int32_t c = op.channel;
        CollectiveState& cs = collectives_[c];
        st.arrived = true;
        cs.arrivals.insert(cs.arrivals.end(), {r, st.last, dep});
        if (static_cast<std::int32_t>(cs.arrivals.size()) / 3 < cs.target) break;
        // The last member is here: end = max over every member's arrival + the price.
        inputs_.clear();
        for (std::size_t j = 0; j < cs.arrivals.size(); j += 3)
          for (std::size_t q = 1; q <= 2; ++q)
            if (cs.arrivals[j + q] != 0) inputs_.push_back(cs.arrivals[j + q]);
        std::size_t first = 0;
        while (inputs_.size() - first > 3) {  // fold three at a time into one cell
          const std::int32_t folded = emit(inputs_[first], inputs_[first + 1], inputs_[first + 2], 0);
          first += 2;
          inputs_[first] = folded;
        }
        auto input = [&](std::size_t q) { return first + q < inputs_.size() ? inputs_[first + q] : 0; };
        const std::int32_t price = collective_price(c);
        const std::int32_t end = emit(input(0), input(1), input(2), price);
        for (std::size_t j = 0; j < cs.arrivals.size(); j += 3) {
          const std::int32_t member = cs.arrivals[j];
          Stream* ms = &streams_[static_cast<std::size_t>(member) * kNumStreams];
          Stream& mc = ms[kCollective];
          out_->slots[slot_of(member, mc.cursor)] = {end, price};
          out_->fanout.push_back({member, mc.cursor, end, price});
          mc.last = end;
          mc.arrived = false;
          ++mc.cursor;
          ++completed_;
          if (member == r) continue;
          enqueue(member * kNumStreams + kCollective);
          for (std::int32_t kk = 0; kk < kNumStreams; ++kk)
            if (ms[kk].waits_dep) enqueue(member * kNumStreams + kk);
        }
        cs.arrivals.clear();
        cs.arrivals.shrink_to_fit();
        progressed = true;
        continue;
      } else {
        std::int32_t price = 0;
        if (is_compute(op.kind)) price = compute_price(r, op, i);
        else if (is_send(op.kind)) price = send_price(r, op);
        if (st.held >= 0) {  // the receive just before it
          out_->held.push_back({r, st.held, st.held_prev, st.held_sent});
          slot = {emit(st.held_prev, st.held_sent, dep, price, r, i), price};
          st.held = -1;
        } else {
          slot = {emit(st.last, dep, 0, price, r, i), price};
        }
        st.last = slot[0];
        if (is_send(op.kind)) {
          message_cell_[op.channel] = slot[0];
          if (simulated_[op.peer]) enqueue(op.peer * kNumStreams + kCompute);
        }
      }
      st.cursor = i + 1;
      ++completed_;
      progressed = true;
    }
    if (progressed)
      for (std::int32_t kk = 0; kk < kNumStreams; ++kk)
        if (kk != k && rank_streams[kk].waits_dep) enqueue(r * kNumStreams + kk);
  }

 public:
  // Price slots are numbered per kind while compiling (compute 1.., sends and collectives
  // tagged); final_slot lays them out as D = [0, compute..., sends..., collectives...].
  static constexpr std::int32_t kSendTag = 1 << 29, kCollectiveTag = 1 << 30;
  static std::int32_t final_slot(std::int32_t p, std::int32_t ncompute, std::int32_t nsends) {
    if (p >= kCollectiveTag) return ncompute + nsends + (p - kCollectiveTag);
    if (p >= kSendTag) return ncompute + (p - kSendTag);
    return p;
  }

 private:
  const Schedule& s_;
  std::vector<std::uint8_t> simulated_;
  Output* out_ = nullptr;
  std::vector<Stream> streams_;
  std::vector<std::int32_t> message_cell_;
  std::vector<CollectiveState> collectives_;
  std::vector<std::int32_t> worklist_, inputs_;
  std::vector<std::uint8_t> dep_target_;  // per op slot
  std::int64_t completed_ = 0;
  std::map<std::tuple<std::int32_t, int, int, bool, double>, std::int32_t> compute_prices_;
  std::map<std::tuple<std::int32_t, std::int32_t, Bytes>, std::int32_t> send_prices_;
  std::map<std::tuple<int, int, int, Bytes, std::vector<int>>, std::int32_t> collective_prices_;
};

}  // namespace

void StepProgram::reset() {
  schedule_.reset();
  replica0_only_ = false;
  program_.clear();
  fanout_.clear();
  held_.clear();
  priced_.clear();
  first_slot_.clear();
  compute_.clear();
  sends_.clear();
  collectives_.clear();
  tallies_.clear();
}

bool StepProgram::compile(std::shared_ptr<const Schedule> schedule, bool replica0_only) {
  reset();
  const Schedule& s = *schedule;
  const auto nranks = static_cast<std::int32_t>(s.ranks.size());
  std::vector<std::uint8_t> simulated(nranks, 1);
  if (replica0_only) {
    // As the engine's run_replica0: one replica-0 rank per stage, and every rank's stage has one.
    std::vector<std::int32_t> of_stage(nranks, -1);
    for (std::int32_t r = 0; r < nranks; ++r) {
      const RankProgram& prog = s.ranks[r];
      if (prog.stage < 0 || prog.stage >= nranks || prog.replica < 0) return false;
      if (prog.replica == 0) {
        if (of_stage[prog.stage] >= 0) return false;
        of_stage[prog.stage] = r;
      }
    }
    for (std::int32_t r = 0; r < nranks; ++r) {
      const std::int32_t c = of_stage[s.ranks[r].stage];
      if (c < 0) return false;
      simulated[r] = c == r;
    }
  }
  Compiler::Output out;
  if (!Compiler(s, std::move(simulated)).compile(out)) return false;

  const auto ncompute = static_cast<std::int32_t>(out.compute.size());
  const auto nsends = static_cast<std::int32_t>(out.sends.size());
  auto final_slot = [&](std::int32_t p) { return Compiler::final_slot(p, ncompute, nsends); };
  // Instructions by depth (1 + the deepest of their inputs), so that neighbours seldom feed
  // each other and the processor overlaps them; any order that keeps inputs first gives the
  // same values.
  const std::size_t n = out.program.size();
  std::vector<std::int32_t> depth(n + 1, 0), renamed(n + 1, 0);
  std::int32_t deepest = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const auto& x = out.program[k];
    depth[k + 1] = 1 + std::max({depth[x[0]], depth[x[1]], depth[x[2]]});
    deepest = std::max(deepest, depth[k + 1]);
  }
  std::vector<std::int32_t> at_depth(static_cast<std::size_t>(deepest) + 2, 0);
  for (std::size_t k = 1; k <= n; ++k) ++at_depth[depth[k] + 1];
  for (std::size_t d = 1; d < at_depth.size(); ++d) at_depth[d] += at_depth[d - 1];
  for (std::size_t k = 1; k <= n; ++k) renamed[k] = 1 + at_depth[depth[k]]++;  // stable within a depth
  program_.resize(n);
  for (std::size_t k = 0; k < n; ++k) {
    const auto& x = out.program[k];
    program_[renamed[k + 1] - 1] = {renamed[x[0]], renamed[x[1]], renamed[x[2]], final_slot(x[3]), x[4], x[5]};
  }
  fanout_.reserve(out.fanout.size());
  for (const auto& x : out.fanout) fanout_.push_back({x[0], x[1], renamed[x[2]], final_slot(x[3])});
  held_.reserve(out.held.size());
  for (const auto& x : out.held) held_.push_back({x[0], x[1], renamed[x[2]], renamed[x[3]]});
  first_slot_ = std::move(out.first_slot);
  for (const auto& x : out.compute) compute_.push_back({x[0], x[1]});
  priced_.reserve(out.priced.size());
  for (const auto& x : out.priced) priced_.push_back({x[0], x[1], x[2]});
  for (const auto& [from, to, bytes] : out.sends) sends_.push_back({from, to, bytes});
  collectives_ = std::move(out.collectives);
  schedule_ = std::move(schedule);
  replica0_only_ = replica0_only;
  tally(out.slots, out.held, renamed, ncompute, nsends);
  return true;
}

// What run_figures reads, per simulated rank, from the ops' slots (Compiler::Output): an
// instruction's op ends at its cell and starts its price before (a receive: at the cell its
// slot names); a held receive spans [T[prev], max(T[prev], T[sent])).
void StepProgram::tally(const std::vector<std::array<std::int32_t, 2>>& slots,
                        const std::vector<std::array<std::int32_t, 4>>& held, const std::vector<std::int32_t>& renamed,
                        std::int32_t ncompute, std::int32_t nsends) {
  const Schedule& s = *schedule_;
  const auto nranks = static_cast<std::int32_t>(s.ranks.size());
  std::vector<std::int32_t> sent_of(slots.size(), -1);  // held receives: the send's end cell
  for (const auto& h : held) sent_of[static_cast<std::size_t>(first_slot_[h[0]] + h[1])] = h[3];
  auto interval = [&](std::size_t slot) -> std::pair<Value, Value> {
    const auto [cell, tag] = slots[slot];
    if (cell < 0) {  // held: cell -1, tag -1 - prev
      const std::int32_t prev = renamed[-tag - 1];
      return {Value{prev, 0, 0}, Value{prev, renamed[sent_of[slot]], 0}};
    }
    if (tag < 0) return {Value{renamed[-tag - 1], 0, 0}, Value{renamed[cell], 0, 0}};  // a receive
    return {Value{renamed[cell], 0, Compiler::final_slot(tag, ncompute, nsends)}, Value{renamed[cell], 0, 0}};
  };
  tallies_.clear();
  busy_.clear();
  colls_.clear();
  gaps_.clear();
  spans_.clear();
  coll_positions_.assign(static_cast<std::size_t>(nranks), {});
  for (std::int32_t r = 0; r < nranks; ++r) {
    if (first_slot_[r] < 0) continue;
    const auto& ops = s.ranks[r].ops;
    const auto base = static_cast<std::size_t>(first_slot_[r]);
    RankTally t;
    t.rank = r;
    t.busy = static_cast<std::int32_t>(busy_.size());
    t.coll = static_cast<std::int32_t>(colls_.size());
    t.gap = static_cast<std::int32_t>(gaps_.size());
    t.span = static_cast<std::int32_t>(spans_.size());
    std::array<std::int32_t, kNumStreams> first{-1, -1, -1}, last{-1, -1, -1};
    std::vector<std::int32_t> count(static_cast<std::size_t>(ncompute) + 1, 0);
    std::optional<Value> before;  // the end of the compute stream's op before this one
    for (std::int32_t i = 0; i < static_cast<std::int32_t>(ops.size()); ++i) {
      const Op& op = ops[i];
      const std::int32_t k = stream_index(op.kind);
      if (first[k] < 0) first[k] = i;
      last[k] = i;
      const auto [start, end] = interval(base + i);
      if (is_collective(op.kind)) {
        colls_.push_back({start, end, op.kind != OpKind::OverflowCheck});
        coll_positions_[r].push_back(i);
      } else if (is_compute(op.kind) || is_recv(op.kind)) {
        if (is_compute(op.kind)) ++count[static_cast<std::size_t>(start.p)];
        if (!before || op.dep >= 0) gaps_.push_back({i, !before, before.value_or(Value{}), start});
        before = end;
      }
    }
    for (std::int32_t p = 1; p <= ncompute; ++p)
      if (count[p] > 0) busy_.push_back({p, count[p]});
    for (std::int32_t k = 0; k < kNumStreams; ++k)
      if (first[k] >= 0) spans_.emplace_back(interval(base + first[k]).first, interval(base + last[k]).second);
    t.has_last = before.has_value();
    t.last = before.value_or(Value{});
    t.busy_end = static_cast<std::int32_t>(busy_.size());
    t.coll_end = static_cast<std::int32_t>(colls_.size());
    t.gap_end = static_cast<std::int32_t>(gaps_.size());
    t.span_end = static_cast<std::int32_t>(spans_.size());
    tallies_.push_back(t);
  }
}

// D: this configuration's prices, once per distinct op, price p at D[p * stride].
template <class Models>
void StepProgram::price(const Models& models, Tick* D, std::size_t stride) const {
  const Schedule& s = *schedule_;
  std::size_t p = 0;
  D[p++ * stride] = 0;
  for (const ComputePrice& c : compute_) D[p++ * stride] = models.compute(s.ranks[c.rank].ops[c.op], c.rank);
  for (const SendPrice& x : sends_) D[p++ * stride] = models.p2p(x.from, x.to, x.bytes);
  for (std::int32_t c : collectives_) D[p++ * stride] = models.collective(s.collectives[c]);
}

template <class Models>
void StepProgram::run_impl(const Models& models, Timeline& t) {
  const Schedule& s = *schedule_;
  prices_.resize(1 + compute_.size() + sends_.size() + collectives_.size());
  price(models, prices_.data(), 1);

  // The Timeline's rows, as the engine sizes them.
  const auto nranks = static_cast<std::int32_t>(s.ranks.size());
  t.ops.resize(nranks);
  rows_.assign(nranks, nullptr);
  for (std::int32_t r = 0; r < nranks; ++r) {
    if (first_slot_[r] < 0) {
      t.ops[r].clear();
      continue;
    }
    t.ops[r].resize(s.ranks[r].ops.size());
    rows_[r] = t.ops[r].data();
  }
  step<true>();
  t.schedule = schedule_;
  t.predicted = true;
}

// T: every end at the prices in prices_, in the order the engine settles them. kTimeline:
// each op's interval written into rows_ as its end is known.
template <bool kTimeline>
void StepProgram::step() {
  const Tick* D = prices_.data();
  OpTiming* const* rows = rows_.data();
  cells_.resize(program_.size() + 1);
  Tick* T = cells_.data();
  T[0] = 0;
  const Instruction* ins = program_.data();
  const std::size_t n = program_.size();
  for (std::size_t k = 0; k < n; ++k) {
    const Instruction& x = ins[k];
    const Tick end = std::max(std::max(T[x.a], T[x.b]), T[x.c]) + D[x.d];
    T[k + 1] = end;
    if constexpr (kTimeline) {
      if (x.rank >= 0) {
        const Tick start = (x.rank & kRecv) ? T[x.a] : end - D[x.d];
        rows[x.rank & ~kRecv][x.index] = OpTiming{start, end};
      }
    }
  }
  if constexpr (kTimeline) {
    for (const Fanout& f : fanout_) rows[f.rank][f.index] = OpTiming{T[f.cell] - D[f.price], T[f.cell]};
    for (const Held& h : held_) rows[h.rank][h.index] = OpTiming{T[h.prev], std::max(T[h.prev], T[h.sent])};
  }
}

// D for several configurations: lane j of price p at D[p * B + j]; lanes past n repeat lane 0.
template <int B>
void StepProgram::price_lanes(const RooflineComputeModel* const* compute, const LinkP2PModel* const* p2p,
                              const NetworkCollectiveModel* const* collective, int n) {
  const std::size_t nprices = 1 + compute_.size() + sends_.size() + collectives_.size();
  lane_prices_.resize(nprices * B);
  Tick* D = lane_prices_.data();
  for (int j = 0; j < B; ++j) {
    const int l = j < n ? j : 0;
    price(DefaultModels{*compute[l], *p2p[l], *collective[l]}, D + j, B);
  }
}

// T for B lanes at the prices of price_lanes: lane j of cell c at T[c * B + j]. kTimeline:
// each lane's Timeline written too, into *out[j] for the first n lanes.
template <int B, bool kTimeline>
void StepProgram::run_lanes_impl(Timeline* const* out, int n) {
  using Lanes = typename LanesOf<B>::type;
  auto load = [](const Tick* p) {
    Lanes v;
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  const Schedule& s = *schedule_;
  const Tick* D = lane_prices_.data();
  // Each lane's Timeline rows, as the engine sizes them: rows[r * B + j].
  const auto nranks = static_cast<std::int32_t>(s.ranks.size());
  if constexpr (kTimeline) {
    rows_.assign(static_cast<std::size_t>(nranks) * B, nullptr);
    for (int j = 0; j < n; ++j) {
      Timeline& t = *out[j];
      t.ops.resize(nranks);
      for (std::int32_t r = 0; r < nranks; ++r) {
        if (first_slot_[r] < 0) {
          t.ops[r].clear();
          continue;
        }
        t.ops[r].resize(s.ranks[r].ops.size());
        rows_[static_cast<std::size_t>(r) * B + j] = t.ops[r].data();
      }
    }
  }
  OpTiming* const* rows = rows_.data();
  // Op `index` of rank r gets [start, end) in every lane.
  auto write = [&](std::int32_t r, std::int32_t index, const Lanes& start, const Lanes& end) {
    OpTiming* const* row = rows + static_cast<std::size_t>(r) * B;
    if (n == B) {  // pairs (start, end) of lanes 0 and 2, 1 and 3, ..., one 16-byte store each
      static_assert(B == 4);
      Tick even[B], odd[B];
      const auto e = __builtin_shufflevector(start, end, 0, 4, 2, 6);
      const auto o = __builtin_shufflevector(start, end, 1, 5, 3, 7);
      std::memcpy(even, &e, sizeof e);
      std::memcpy(odd, &o, sizeof o);
      for (int q = 0; q < B / 2; ++q) {
        row[2 * q][index] = OpTiming{even[2 * q], even[2 * q + 1]};
        row[2 * q + 1][index] = OpTiming{odd[2 * q], odd[2 * q + 1]};
      }
    } else {
      for (int j = 0; j < n; ++j) row[j][index] = OpTiming{start[j], end[j]};
    }
  };
  lane_cells_.resize((program_.size() + 1) * B);
  Tick* T = lane_cells_.data();
  std::fill(T, T + B, Tick{0});
  const Instruction* ins = program_.data();
  const std::size_t count = program_.size();
  for (std::size_t k = 0; k < count; ++k) {
    const Instruction& x = ins[k];
    const Lanes first = load(T + static_cast<std::size_t>(x.a) * B), second = load(T + static_cast<std::size_t>(x.b) * B),
                third = load(T + static_cast<std::size_t>(x.c) * B), price = load(D + static_cast<std::size_t>(x.d) * B);
    Lanes end = first > second ? first : second;
    end = end > third ? end : third;
    end += price;
    std::memcpy(T + (k + 1) * B, &end, sizeof end);
    if constexpr (kTimeline)
      if (x.rank >= 0) write(x.rank & ~kRecv, x.index, (x.rank & kRecv) ? first : end - price, end);
  }
  if constexpr (kTimeline) {
    for (const Fanout& f : fanout_) {
      const Lanes end = load(T + static_cast<std::size_t>(f.cell) * B);
      write(f.rank, f.index, end - load(D + static_cast<std::size_t>(f.price) * B), end);
    }
    for (const Held& h : held_) {
      const Lanes prev = load(T + static_cast<std::size_t>(h.prev) * B), sent = load(T + static_cast<std::size_t>(h.sent) * B);
      write(h.rank, h.index, prev, prev > sent ? prev : sent);
    }
    for (int j = 0; j < n; ++j) {
      out[j]->schedule = schedule_;
      out[j]->predicted = true;
    }
  }
}

void StepProgram::run_lanes(const RooflineComputeModel* const* compute, const LinkP2PModel* const* p2p,
                            const NetworkCollectiveModel* const* collective, Timeline* const* out, int n) {
  if (n < 1 || n > kMaxLanes) throw std::invalid_argument("StepProgram::run_lanes: 1 to kMaxLanes lanes");
  price_lanes<kMaxLanes>(compute, p2p, collective, n);
  run_lanes_impl<kMaxLanes, true>(out, n);
}

bool StepProgram::run_lanes_figures(const RooflineComputeModel* const* compute, const LinkP2PModel* const* p2p,
                                    const NetworkCollectiveModel* const* collective, bool pipelined,
                                    StepFigures* const* out, ResultWorkspace& ws, int n) {
  if (n < 1 || n > kMaxLanes) throw std::invalid_argument("StepProgram::run_lanes_figures: 1 to kMaxLanes lanes");
  constexpr int B = kMaxLanes;
  price_lanes<B>(compute, p2p, collective, n);
  if (std::any_of(lane_prices_.begin(), lane_prices_.end(), [](Tick d) { return d < 0; })) return false;
  run_lanes_impl<B, false>(nullptr, n);
  for (int j = 0; j < n; ++j) figures_from_cells(lane_cells_.data() + j, lane_prices_.data() + j, B, pipelined, *out[j], ws);
  return true;
}

template <class Models>
bool StepProgram::run_figures_impl(const Models& models, bool pipelined, StepFigures& out, ResultWorkspace& ws) {
  prices_.resize(1 + compute_.size() + sends_.size() + collectives_.size());
  price(models, prices_.data(), 1);
  if (std::any_of(prices_.begin(), prices_.end(), [](Tick d) { return d < 0; })) return false;
  step<false>();
  figures_from_cells(cells_.data(), prices_.data(), 1, pipelined, out, ws);
  return true;
}

// The figures rank_pass (core/metrics.cpp) takes from a Timeline, from the cells: T and D of
// one configuration, cell c at T[c * stride] and price p at D[p * stride].
void StepProgram::figures_from_cells(const Tick* T, const Tick* D, std::size_t stride, bool pipelined,
                                     StepFigures& out, ResultWorkspace& ws) const {
  auto value = [&](const Value& v) { return std::max(T[v.c1 * stride], T[v.c2 * stride]) - D[v.p * stride]; };
  const Schedule& s = *schedule_;
  // The step: Timeline::begin() and end() over the simulated ranks, from each stream's first
  // start and last end (a stream's ops start and end in program order).
  Tick lo = std::numeric_limits<Tick>::max(), hi = 0;
  for (const auto& [start, end] : spans_) {
    lo = std::min(lo, value(start));
    hi = std::max(hi, value(end));
  }
  out.begin = spans_.empty() ? 0 : lo;
  out.end = hi;
  out.ranks.resize(s.ranks.size());
  for (const RankTally& t : tallies_) {
    StepFigures::Rank& f = out.ranks[static_cast<std::size_t>(t.rank)];
    f = {};
    for (std::int32_t q = t.busy; q < t.busy_end; ++q) f.busy += busy_[q].count * D[busy_[q].price * stride];
    ws.collectives.clear();
    for (std::int32_t q = t.coll; q < t.coll_end; ++q) {
      const OpTiming c{value(colls_[q].start), value(colls_[q].end)};
      if (colls_[q].counted) f.collective += c.end - c.start;
      ws.collectives.push_back(c);
    }
    // rank_pass's cursor: the step's start, then the end of each compute-stream op.
    ws.gaps.clear();
    for (std::int32_t q = t.gap; q < t.gap_end; ++q) {
      const GapTally& g = gaps_[q];
      const Tick g0 = g.first ? out.begin : std::max(out.begin, value(g.cursor)), g1 = value(g.start);
      if (g1 > g0) ws.gaps.push_back({g.op, g0, g1});
    }
    const Tick cursor = t.has_last ? std::max(out.begin, value(t.last)) : out.begin;
    f.comm = idle_comm(s.ranks[t.rank], ws.gaps, coll_positions_[t.rank], ws.collectives, cursor, out.end, pipelined,
                       ws.merged_a);
  }
}

template <class Models>
bool StepProgram::prices_hold_impl(const Models& models) const {
  // The program was compiled with sends on their own stream; a p2p model whose sends hold the
  // compute stream (no p2p overlap) changes which ops feed which: such plans run on the engine.
  if (models.blocking_sends()) return false;
  const Schedule& s = *schedule_;
  std::vector<Tick> of_class;
  of_class.reserve(compute_.size());
  for (const ComputePrice& c : compute_) of_class.push_back(models.compute(s.ranks[c.rank].ops[c.op], c.rank));
  for (const ComputePrice& c : priced_)
    if (models.compute(s.ranks[c.rank].ops[c.op], c.rank) != of_class[static_cast<std::size_t>(c.cls) - 1]) return false;
  return true;
}

bool StepProgram::prices_hold(const RooflineComputeModel& compute, const LinkP2PModel& p2p,
                              const NetworkCollectiveModel& collective) const {
  return prices_hold_impl(DefaultModels{compute, p2p, collective});
}

bool StepProgram::prices_hold(const CostModels& models) const { return prices_hold_impl(VirtualModels{models}); }

void StepProgram::run(const RooflineComputeModel& compute, const LinkP2PModel& p2p,
                      const NetworkCollectiveModel& collective, Timeline& out) {
  run_impl(DefaultModels{compute, p2p, collective}, out);
}

void StepProgram::run(const CostModels& models, Timeline& out) { run_impl(VirtualModels{models}, out); }

bool StepProgram::run_figures(const RooflineComputeModel& compute, const LinkP2PModel& p2p,
                              const NetworkCollectiveModel& collective, bool pipelined, StepFigures& out,
                              ResultWorkspace& ws) {
  return run_figures_impl(DefaultModels{compute, p2p, collective}, pipelined, out, ws);
}

bool StepProgram::run_figures(const CostModels& models, bool pipelined, StepFigures& out, ResultWorkspace& ws) {
  return run_figures_impl(VirtualModels{models}, pipelined, out, ws);
}

std::size_t StepProgram::footprint_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return bytes(program_) + bytes(fanout_) + bytes(held_) + bytes(first_slot_) + bytes(rows_) + bytes(compute_) + bytes(sends_) + bytes(collectives_) +
         bytes(cells_) + bytes(prices_);
}

}  // namespace trainsim
