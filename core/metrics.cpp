#include "core/metrics.h"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cstdint>
#include <iterator>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

namespace trainsim {

Tick Timeline::begin() const {
  Tick t = 0;
  bool first = true;
  for (const auto& r : ops)
    for (const auto& o : r)
      if (first || o.start < t) {
        t = o.start;
        first = false;
      }
  return t;
}

Tick Timeline::end() const {
  Tick t = 0;
  for (const auto& r : ops)
    for (const auto& o : r) t = std::max(t, o.end);
  return t;
}

namespace {
// Sorted, merged intervals.
std::vector<OpTiming> merged(std::vector<OpTiming> v) {
  std::sort(v.begin(), v.end(), [](const OpTiming& a, const OpTiming& b) { return a.start < b.start; });
  std::vector<OpTiming> out;
  for (const auto& x : v) {
    if (x.end <= x.start) continue;
    if (!out.empty() && x.start <= out.back().end)
      out.back().end = std::max(out.back().end, x.end);
    else
      out.push_back(x);
  }
  return out;
}
}  // namespace

namespace {

// Sorted, merged intervals into `out` (input sorted by start, or sorted here).
void merge_into(std::vector<OpTiming>& v, std::vector<OpTiming>& out) {
  if (!std::is_sorted(v.begin(), v.end(), [](const OpTiming& a, const OpTiming& b) { return a.start < b.start; }))
    std::sort(v.begin(), v.end(), [](const OpTiming& a, const OpTiming& b) { return a.start < b.start; });
  out.clear();
  for (const auto& x : v) {
    if (x.end <= x.start) continue;
    if (!out.empty() && x.start <= out.back().end)
      out.back().end = std::max(out.back().end, x.end);
    else
      out.push_back(x);
  }
}

// Sorted integers as ranges: "0-3, 5, 7-8".
std::string ranges_text(const std::vector<int>& v) {
  std::string out;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? fmt::format("{}", v[i]) : fmt::format("{}-{}", v[i], v[j]);
    i = j + 1;
  }
  return out;
}

// uncovered_length on merged intervals.
Tick uncovered_merged(const std::vector<OpTiming>& a, const std::vector<OpTiming>& b) {
  Tick total = 0;
  std::size_t j = 0;
  for (const auto& x : a) {
    Tick cursor = x.start;
    while (j < b.size() && b[j].end <= cursor) ++j;
    for (std::size_t k = j; k < b.size() && b[k].start < x.end; ++k) {
      if (b[k].start > cursor) total += b[k].start - cursor;
      cursor = std::max(cursor, b[k].end);
      if (cursor >= x.end) break;
    }
    if (cursor < x.end) total += x.end - cursor;
  }
  return total;
}


// Length of [a, b) covered by the sorted, merged intervals `m`.
Tick covered(Tick a, Tick b, const std::vector<OpTiming>& m) {
  Tick total = 0;
  auto it = std::upper_bound(m.begin(), m.end(), a, [](Tick t, const OpTiming& x) { return t < x.end; });
  for (; it != m.end() && it->start < b; ++it) {
    const Tick lo = std::max(a, it->start), hi = std::min(b, it->end);
    if (hi > lo) total += hi - lo;
  }
  return total;
}

// Op kinds by what the result does with them.
enum OpClass : std::uint8_t { kOther, kComputeOp, kReceive, kCollectiveOp, kFoundInf };
constexpr auto kClassOf = [] {
  std::array<std::uint8_t, kNumOpKinds> t{};
  for (int k = 0; k < kNumOpKinds; ++k) {
    const auto kind = static_cast<OpKind>(k);
    t[k] = is_compute(kind)                 ? kComputeOp
           : is_recv(kind)                  ? kReceive
           : kind == OpKind::OverflowCheck  ? kFoundInf
           : is_collective(kind)            ? kCollectiveOp
                                            : kOther;
  }
  return t;
}();

// The idle split (see below) of a gap [g0, g1) on the compute stream that ends where `op`
// starts. coll: program positions of the rank's collectives, ascending, at least every one
// up to op.dep; ctimes: their intervals, in the same order.
Tick gap_comm(const Op* ops, const OpTiming* ctimes, const int* coll, std::size_t ncoll, const Op& op, Tick g0, Tick g1,
              bool pipelined) {
  Tick comm = 0;
  const Tick other = pipelined ? 0 : 1;  // waiting for other ranks is communication without a pipeline
  if (op.dep >= 0 && is_collective(ops[op.dep].kind)) {
    auto k = static_cast<std::size_t>(std::lower_bound(coll, coll + ncoll, op.dep) - coll);
    Tick hi = g1;
    while (k < ncoll) {
      const OpTiming& c = ctimes[k];
      const Tick lo = std::max(g0, c.start), up = std::min(hi, c.end);
      if (up > lo) comm += up - lo;
      hi = std::min(hi, c.start);
      if (hi <= g0 || k == 0 || ctimes[k - 1].end < c.start) break;
      --k;  // it started when the one ahead of it on this stream ended
    }
    if (hi > g0) comm += other * (hi - g0);
  } else {
    comm += other * (g1 - g0);
  }
  return comm;
}

// One pass over a rank's ops, in program order: busy and collective time, the compute
// stream's idle gaps and where its last op ended; then the idle time split by what it waited
// for (idle_comm). The compute stream runs the compute ops and the receives (whose intervals
// are the time it was blocked on them) in program order; each idle gap ends where the next of
// them starts, or at the end of the step:
//  * a receive's blocked interval waits for a pipeline peer: pipeline bubble;
//  * a gap before an op whose dependency is a collective (ZeRO-3's gather before a forward,
//    the optimizer step after the gradient reduction or the found-inf check) waits for that
//    collective while it runs, and before it for the collectives ahead of it on this rank's
//    stream; the part before the first of them waited for other ranks to arrive;
//  * the tail after the last op waits for this rank's trailing collectives (ZeRO's gather of
//    the updated parameters) where they run, otherwise for other ranks to finish.
// Waiting for other ranks is pipeline bubble when there is a pipeline, else communication
// (replicas wait only for each other's collectives). Everything else of the idle time is
// pipeline bubble.
// Indexed: visits the ops of `index` (positions << 3 | class, see ResultIndex) instead of
// every op; the same figures, the sends (which only the step's span reads) skipped.
template <bool kIndexed>
StepFigures::Rank rank_pass(const RankProgram& prog, const std::vector<std::uint32_t>* index, const OpTiming* times,
                            Tick begin, Tick end, bool pipelined, ResultWorkspace& ws) {
  StepFigures::Rank f;
  ws.collectives.clear();
  ws.coll_index.clear();
  ws.gaps.clear();
  const Op* ops = prog.ops.data();
  const std::uint32_t* visit = kIndexed ? index->data() : nullptr;
  const std::size_t n = kIndexed ? index->size() : prog.ops.size();
  Tick cursor = begin, busy = 0;
  for (std::size_t j = 0; j < n; ++j) {
    std::size_t i = j;
    std::uint8_t cls = 0;
    if constexpr (kIndexed) {
      i = visit[j] >> 3;
      cls = static_cast<std::uint8_t>(visit[j] & 7);
    } else {
      cls = kClassOf[static_cast<std::uint8_t>(ops[i].kind)];
    }
    const OpTiming t = times[i];
    busy += cls == kComputeOp ? t.end - t.start : 0;
    if (cls >= kCollectiveOp) [[unlikely]] {
      ws.collectives.push_back(t);
      ws.coll_index.push_back(static_cast<int>(i));
      if (cls == kCollectiveOp) f.collective += t.end - t.start - t.waited;
      continue;
    }
    const bool on_compute = cls != kOther;
    if (on_compute && t.start > cursor) [[unlikely]]
      ws.gaps.push_back({static_cast<int>(i), cursor, t.start});
    cursor = on_compute ? std::max(cursor, t.end) : cursor;
  }
  f.busy = busy;
  f.comm = idle_comm(prog, ws.gaps, ws.coll_index, ws.collectives, cursor, end, pipelined, ws.merged_a);
  return f;
}

}  // namespace

Tick idle_comm(const RankProgram& prog, const std::vector<IdleGap>& gaps, const std::vector<int>& coll_index,
               std::vector<OpTiming>& colls, Tick cursor, Tick end, bool pipelined, std::vector<OpTiming>& merged) {
  Tick comm = 0;
  const Op* ops = prog.ops.data();
  for (const IdleGap& g : gaps)
    comm += gap_comm(ops, colls.data(), coll_index.data(), coll_index.size(), ops[g.op], g.g0, g.g1, pipelined);
  if (end > cursor) {
    merge_into(colls, merged);
    const Tick own = covered(cursor, end, merged);
    comm += own + (pipelined ? 0 : end - cursor - own);
  }
  return comm;
}

void result_index_into(const Schedule& s, ResultIndex& out) {
  out.ranks.resize(s.ranks.size());
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const auto& ops = s.ranks[r].ops;
    auto& list = out.ranks[r];
    list.clear();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const std::uint8_t cls = kClassOf[static_cast<std::uint8_t>(ops[i].kind)];
      if (cls != kOther) list.push_back(static_cast<std::uint32_t>(i) << 3 | cls);
    }
  }
}

Tick uncovered_length(std::vector<OpTiming> a, std::vector<OpTiming> b) {
  return uncovered_merged(merged(std::move(a)), merged(std::move(b)));
}

Result compute_result(const Plan& plan, const Timeline& tl, const std::vector<MemoryBreakdown>& memory) {
  Result res;
  ResultWorkspace ws;
  compute_result_into(plan, tl, memory, res, ws);
  return res;
}

void compute_result_into(const Plan& plan, const Timeline& tl, const std::vector<MemoryBreakdown>& memory,
                         Result& res, ResultWorkspace& ws, const std::vector<int>* same_as, const ResultIndex* index) {
  const Schedule& s = *tl.schedule;
  if (index && index->ranks.size() != s.ranks.size())
    throw std::logic_error("compute_result_into: a ResultIndex of another schedule");
  auto is_twin = [&](std::size_t r) {
    if (same_as == nullptr) return false;
    const int twin = (*same_as)[r];
    return twin >= 0 && twin < static_cast<int>(r);
  };
  // Twins have their counterpart's timings: the step spans the other ranks' ops (the
  // timeline may hold no rows for twins).
  // Timeline::end() - Timeline::begin() over those ranks.
  Tick lo = std::numeric_limits<Tick>::max(), hi = 0;
  bool any = false;
  for (std::size_t r = 0; r < tl.ops.size(); ++r) {
    if (is_twin(r)) continue;
    const OpTiming* o = tl.ops[r].data();
    const std::size_t n = tl.ops[r].size();
    any = any || n > 0;
    Tick row_lo = lo, row_hi = hi;
    for (std::size_t i = 0; i < n; ++i) {
      row_lo = std::min(row_lo, o[i].start);
      row_hi = std::max(row_hi, o[i].end);
    }
    lo = row_lo;
    hi = row_hi;
  }
  StepFigures& f = ws.figures;
  f.begin = any ? lo : 0;
  f.end = hi;
  f.ranks.resize(s.ranks.size());
  for (std::size_t r = 0; r < s.ranks.size(); ++r)
    if (!is_twin(r))
      f.ranks[r] = index ? rank_pass<true>(s.ranks[r], &index->ranks[r], tl.ops[r].data(), f.begin, f.end,
                                           plan.pp > 1, ws)
                         : rank_pass<false>(s.ranks[r], nullptr, tl.ops[r].data(), f.begin, f.end, plan.pp > 1, ws);
  result_from_figures(plan, s, f, memory, res, ws, same_as);
}

void result_from_figures(const Plan& plan, const Schedule& s, const StepFigures& figures,
                         const std::vector<MemoryBreakdown>& memory, Result& res, ResultWorkspace& ws,
                         const std::vector<int>* same_as) {
  const auto& cfg = plan.config;
  const Tick t0 = figures.begin;
  const Tick step = figures.end - t0;
  res.step_time_s = ticks_to_seconds(step);
  res.bubble_fraction = 0;
  res.pipeline_bubble_fraction = 0;
  res.exposed_comm_fraction = 0;
  res.tokens_per_s = 0;
  res.mfu = 0;
  res.allreduce_time_s = 0;
  res.exposed_comm_time_s = 0;
  res.fits_in_memory = true;
  res.memory_capacity_bytes = gib_to_bytes(cfg.cluster.memory_gib);
  res.framework = plan.framework_name();
  res.framework_setting = plan.framework_setting();
  res.ranks.resize(s.ranks.size());

  double util_sum = 0, comm_sum = 0;
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const auto& prog = s.ranks[r];
    RankResult& rr = res.ranks[r];
    const int twin = same_as != nullptr ? (*same_as)[r] : static_cast<int>(r);
    if (twin >= 0 && twin < static_cast<int>(r)) {
      rr = res.ranks[twin];  // computed already: a twin is an earlier rank
    } else {
      const StepFigures::Rank& f = figures.ranks[r];
      const Tick busy = f.busy, collective = f.collective;
      rr.busy_s = ticks_to_seconds(busy);
      rr.idle_s = res.step_time_s - rr.busy_s;
      rr.utilization = step > 0 ? static_cast<double>(busy) / static_cast<double>(step) : 0;
      rr.allreduce_s = ticks_to_seconds(collective);
      rr.exposed_comm_s = ticks_to_seconds(f.comm);
      rr.pipeline_bubble_s = ticks_to_seconds(std::max<Tick>(0, step - busy - f.comm));
    }
    rr.rank = prog.rank;
    rr.stage = prog.stage;
    rr.replica = prog.replica;
    if (r < memory.size()) {
      rr.memory = memory[r];
      rr.peak_memory_bytes = memory[r].total();
    } else {
      rr.memory = MemoryBreakdown{};
      rr.peak_memory_bytes = 0;
    }
    util_sum += rr.utilization;
    comm_sum += rr.exposed_comm_s;
    res.allreduce_time_s = std::max(res.allreduce_time_s, rr.allreduce_s);
    res.exposed_comm_time_s = std::max(res.exposed_comm_time_s, rr.exposed_comm_s);
  }
  res.bubble_fraction = s.ranks.empty() ? 0 : 1.0 - util_sum / static_cast<double>(s.ranks.size());
  // The two parts add up to bubble_fraction exactly; without a pipeline there is no pipeline bubble.
  res.exposed_comm_fraction =
      s.ranks.empty() || res.step_time_s <= 0
          ? 0
          : std::min(res.bubble_fraction, comm_sum / static_cast<double>(s.ranks.size()) / res.step_time_s);
  if (plan.pp <= 1) res.exposed_comm_fraction = std::max(0.0, res.bubble_fraction);
  res.pipeline_bubble_fraction = std::max(0.0, res.bubble_fraction - res.exposed_comm_fraction);

  const ModelShape shape = plan.shape();
  const double tokens = static_cast<double>(plan.global_batch_size) * shape.s;
  res.tokens_per_s = res.step_time_s > 0 ? tokens / res.step_time_s : 0;
  const double peak = plan.peak_flops(cfg.precision.compute) * cfg.cluster.num_gpus;
  res.mfu = res.step_time_s > 0 && peak > 0
                ? shape.model_flops_per_sample() * plan.global_batch_size / (res.step_time_s * peak)
                : 0;
  const double gpus = cfg.cluster.num_gpus;
  const double per_gpu_step = res.step_time_s > 0 && gpus > 0 ? 1.0 / (res.step_time_s * gpus) : 0;
  res.tokens_per_s_per_gpu = gpus > 0 ? res.tokens_per_s / gpus : 0;
  res.model_tflops_per_gpu = shape.model_flops_per_sample() * plan.global_batch_size * per_gpu_step / 1e12;
  int rebuilt = 0;
  for (const int layers : plan.layers_per_virtual_stage) rebuilt += recomputed_layers(cfg.training, layers);
  res.hardware_tflops_per_gpu = shape.hardware_flops_per_sample(cfg.training.activation_recompute, rebuilt) *
                                plan.global_batch_size * per_gpu_step / 1e12;
  res.time_to_train_s = res.gpu_hours = res.cost = -1;
  if (res.step_time_s > 0 && (cfg.training.total_tokens > 0 || cfg.training.train_steps > 0)) {
    res.time_to_train_s = cfg.training.total_tokens > 0 ? cfg.training.total_tokens / res.tokens_per_s
                                                        : static_cast<double>(cfg.training.train_steps) * res.step_time_s;
    res.gpu_hours = res.time_to_train_s * gpus / 3600.0;
    if (cfg.cluster.price_per_gpu_hour > 0) res.cost = res.gpu_hours * cfg.cluster.price_per_gpu_hour;
  }

  // Warnings, into the strings of the previous result where there are some.
  std::size_t nw = 0;
  auto next_warning = [&]() -> std::string& {
    if (nw == res.warnings.size()) res.warnings.emplace_back();
    std::string& w = res.warnings[nw++];
    w.clear();
    return w;
  };
  for (const auto& w : plan.warnings) next_warning() = w;
  // The memory warnings: a function of every rank's (rank, stage, replica, peak), the
  // capacity and memory_gib alone, so written again only when one of those changed since the
  // last result (a sweep's neighbours differ in rates and links, not in memory).
  auto bits = [](double x) { return std::bit_cast<std::uint64_t>(x); };
  auto& key = ws.memory_key;
  key.clear();
  key.reserve(2 * res.ranks.size() + 2);
  for (const auto& rr : res.ranks) {
    key.push_back(static_cast<std::uint64_t>(static_cast<std::uint32_t>(rr.rank)) << 32 |
                  static_cast<std::uint64_t>(static_cast<std::uint16_t>(rr.stage)) << 16 |
                  static_cast<std::uint16_t>(rr.replica));
    key.push_back(bits(rr.peak_memory_bytes));
  }
  key.push_back(bits(res.memory_capacity_bytes));
  key.push_back(bits(cfg.cluster.memory_gib));
  if (ws.memory_valid && key == ws.memory_written_from) {
    for (const auto& w : ws.memory_warnings) next_warning() = w;
    res.fits_in_memory = ws.memory_fits;
  } else {
    const std::size_t first = nw;
    double worst = 0;
    for (const auto& rr : res.ranks) worst = std::max(worst, rr.peak_memory_bytes);
    if (worst <= res.memory_capacity_bytes && res.memory_capacity_bytes - worst < gib_to_bytes(kUnmodelledMemoryGib))
      fmt::format_to(std::back_inserter(next_warning()),
                     "only {:.1f} GiB of headroom on the fullest GPU: the CUDA context, library workspaces and "
                     "allocator fragmentation (not modelled) typically take 0.5-2 GiB",
                     bytes_to_gib(res.memory_capacity_bytes - worst));
    // One warning per distinct need (the replicas of a stage need the same), not one per rank.
    ws.groups.clear();
    for (std::size_t r = 0; r < res.ranks.size(); ++r) {
      const RankResult& rr = res.ranks[r];
      if (rr.peak_memory_bytes <= res.memory_capacity_bytes) continue;
      res.fits_in_memory = false;
      auto g = std::find_if(ws.groups.begin(), ws.groups.end(),
                            [&](const auto& x) { return x.first == rr.peak_memory_bytes; });
      if (g == ws.groups.end()) {
        ws.groups.emplace_back(rr.peak_memory_bytes, std::vector<int>{});
        g = ws.groups.end() - 1;
      }
      g->second.push_back(static_cast<int>(r));
    }
    for (const auto& [peak, members] : ws.groups) {
      std::vector<int> stages, ranks;
      for (int r : members) {
        ranks.push_back(res.ranks[r].rank);
        if (std::find(stages.begin(), stages.end(), res.ranks[r].stage) == stages.end())
          stages.push_back(res.ranks[r].stage);
      }
      std::sort(stages.begin(), stages.end());
      std::string& w = next_warning();
      if (ranks.size() == 1)
        fmt::format_to(std::back_inserter(w), "rank {} (stage {}, replica {})", ranks[0], res.ranks[members[0]].stage,
                       res.ranks[members[0]].replica);
      else
        fmt::format_to(std::back_inserter(w), "{} ranks ({} {}: ranks {})", ranks.size(),
                       stages.size() == 1 ? "stage" : "stages", ranges_text(stages), ranges_text(ranks));
      fmt::format_to(std::back_inserter(w), " need{} {:.1f} GiB, {:.1f} GiB more than the GPU's {:.1f} GiB",
                     ranks.size() == 1 ? "s" : "", bytes_to_gib(peak), bytes_to_gib(peak - res.memory_capacity_bytes),
                     cfg.cluster.memory_gib);
    }
    ws.memory_warnings.assign(res.warnings.begin() + static_cast<std::ptrdiff_t>(first),
                              res.warnings.begin() + static_cast<std::ptrdiff_t>(nw));
    ws.memory_fits = res.fits_in_memory;
    ws.memory_written_from.swap(key);
    ws.memory_valid = true;
  }
  if (res.step_time_s > 0 && res.exposed_comm_time_s > 0.1 * res.step_time_s)
    fmt::format_to(std::back_inserter(next_warning()), "{:.0f}% of the step is communication not hidden under compute{}",
                   100 * res.exposed_comm_time_s / res.step_time_s,
                   cfg.communication.overlap_grad_reduce ? "" : "; try communication.overlap_grad_reduce: true");
  res.warnings.resize(nw);
}

}  // namespace trainsim
