#include "sim/step_program.h"

#include <algorithm>
#include <array>
#include <map>
#include <tuple>

#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/p2p_model.h"

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

struct VirtualModels {
  const CostModels& m;
  Tick compute(const Op& op, int rank) const { return m.compute->duration(op, rank); }
  Tick p2p(int from, int to, Bytes bytes) const { return m.p2p->duration(from, to, bytes); }
  Tick collective(const Collective& c) const { return m.collective->duration(c); }
  bool blocking_sends() const { return m.p2p->blocks_sender(); }
};

struct DefaultModels {
  const RooflineComputeModel& c;
  const LinkP2PModel& p;
  const NetworkCollectiveModel& k;
  Tick compute(const Op& op, int rank) const { return c.RooflineComputeModel::duration(op, rank); }
  Tick p2p(int from, int to, Bytes bytes) const { return p.LinkP2PModel::duration(from, to, bytes); }
  Tick collective(const Collective& col) const { return k.NetworkCollectiveModel::duration(col); }
  bool blocking_sends() const { return p.LinkP2PModel::blocks_sender(); }
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
    const auto key = std::make_tuple(r, static_cast<int>(op.kind), static_cast<int>(op.chunk), op.work);
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
    const auto key = std::make_tuple(static_cast<int>(col.kind), col.bytes, col.members);
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
  std::map<std::tuple<std::int32_t, int, int, double>, std::int32_t> compute_prices_;
  std::map<std::tuple<std::int32_t, std::int32_t, Bytes>, std::int32_t> send_prices_;
  std::map<std::tuple<int, Bytes, std::vector<int>>, std::int32_t> collective_prices_;
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
  return true;
}

template <class Models>
void StepProgram::run_impl(const Models& models, Timeline& t) {
  const Schedule& s = *schedule_;
  // D: this configuration's prices, once per distinct op.
  prices_.resize(1 + compute_.size() + sends_.size() + collectives_.size());
  Tick* D = prices_.data();
  D[0] = 0;
  std::size_t j = 1;
  for (const ComputePrice& c : compute_) D[j++] = models.compute(s.ranks[c.rank].ops[c.op], c.rank);
  for (const SendPrice& x : sends_) D[j++] = models.p2p(x.from, x.to, x.bytes);
  for (std::int32_t c : collectives_) D[j++] = models.collective(s.collectives[c]);

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
  OpTiming* const* rows = rows_.data();

  // T: every end, in the order the engine settles them; each op's interval written as its
  // end is known.
  cells_.resize(program_.size() + 1);
  Tick* T = cells_.data();
  T[0] = 0;
  const Instruction* ins = program_.data();
  const std::size_t n = program_.size();
  for (std::size_t k = 0; k < n; ++k) {
    const Instruction& x = ins[k];
    const Tick end = std::max(std::max(T[x.a], T[x.b]), T[x.c]) + D[x.d];
    T[k + 1] = end;
    if (x.rank >= 0) {
      const Tick start = (x.rank & kRecv) ? T[x.a] : end - D[x.d];
      rows[x.rank & ~kRecv][x.index] = OpTiming{start, end};
    }
  }
  for (const Fanout& f : fanout_) rows[f.rank][f.index] = OpTiming{T[f.cell] - D[f.price], T[f.cell]};
  for (const Held& h : held_) rows[h.rank][h.index] = OpTiming{T[h.prev], std::max(T[h.prev], T[h.sent])};
  t.schedule = schedule_;
  t.predicted = true;
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

std::size_t StepProgram::footprint_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return bytes(program_) + bytes(fanout_) + bytes(held_) + bytes(first_slot_) + bytes(rows_) + bytes(compute_) + bytes(sends_) + bytes(collectives_) +
         bytes(cells_) + bytes(prices_);
}

}  // namespace trainsim
