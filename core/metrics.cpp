#include "core/metrics.h"

#include <algorithm>
#include <charconv>
#include <iterator>
#include <limits>

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

struct IdleSplit {
  Tick comm = 0;  // idle while waiting for this rank's collectives; the rest of the idle time is pipeline bubble
};

// Splits the compute stream's idle time by what it waited for. The compute stream runs the
// compute ops and the receives (whose intervals are the time it was blocked on them) in
// program order; each idle gap ends where the next of them starts, or at the end of the step:
//  * a receive's blocked interval waits for a pipeline peer: pipeline bubble;
//  * a gap before an op whose dependency is a collective (ZeRO-3's gather before a forward,
//    the optimizer step after the gradient reduction or the found-inf check) waits for that
//    collective while it runs, and before it for the collectives ahead of it on this rank's
//    stream; the part before the first of them waited for other ranks to arrive;
//  * the tail after the last op waits for this rank's trailing collectives (ZeRO's gather of
//    the updated parameters) where they run, otherwise for other ranks to finish.
// Waiting for other ranks is pipeline bubble when there is a pipeline, else communication
// (replicas wait only for each other's collectives).
IdleSplit split_idle(const RankProgram& prog, const OpTiming* times, const std::vector<int>& coll_index,
                     const std::vector<OpTiming>& coll_merged, Tick begin, Tick end, bool pipelined) {
  IdleSplit out;
  auto other_ranks = [&](Tick len) {
    if (!pipelined) out.comm += len;
  };
  Tick cursor = begin;
  const std::size_t n = prog.ops.size();
  for (std::size_t i = 0; i < n; ++i) {
    const Op& op = prog.ops[i];
    const bool on_compute = is_compute(op.kind) || is_recv(op.kind);
    if (!on_compute) continue;
    const OpTiming& t = times[i];
    if (t.start > cursor) {
      const Tick g0 = cursor, g1 = t.start;
      if (op.dep >= 0 && is_collective(prog.ops[static_cast<std::size_t>(op.dep)].kind)) {
        auto k = static_cast<std::size_t>(std::lower_bound(coll_index.begin(), coll_index.end(), op.dep) -
                                          coll_index.begin());
        Tick hi = g1;
        while (k < coll_index.size()) {
          const OpTiming& c = times[coll_index[k]];
          const Tick lo = std::max(g0, c.start), up = std::min(hi, c.end);
          if (up > lo) out.comm += up - lo;
          hi = std::min(hi, c.start);
          if (hi <= g0 || k == 0 || times[coll_index[k - 1]].end < c.start) break;
          --k;  // it started when the one ahead of it on this stream ended
        }
        if (hi > g0) other_ranks(hi - g0);
      } else {
        other_ranks(g1 - g0);
      }
    }
    cursor = std::max(cursor, t.end);
  }
  if (end > cursor) {
    const Tick own = covered(cursor, end, coll_merged);
    out.comm += own;
    other_ranks(end - cursor - own);
  }
  return out;
}

}  // namespace

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
                         Result& res, ResultWorkspace& ws, const std::vector<int>* same_as) {
  const Schedule& s = *tl.schedule;
  const auto& cfg = plan.config;
  // Twins have their counterpart's timings: the step spans the other ranks' ops (the
  // timeline may hold no rows for twins).
  Tick step = 0, t0 = 0;
  if (same_as == nullptr) {
    t0 = tl.begin();
    step = tl.end() - t0;
  } else {
    // Timeline::end() - Timeline::begin() over those ranks.
    Tick lo = std::numeric_limits<Tick>::max(), hi = 0;
    bool any = false;
    for (std::size_t r = 0; r < tl.ops.size(); ++r) {
      const int twin = (*same_as)[r];
      if (twin >= 0 && twin < static_cast<int>(r)) continue;
      const OpTiming* o = tl.ops[r].data();
      const std::size_t n = tl.ops[r].size();
      any = any || n > 0;
      for (std::size_t i = 0; i < n; ++i) {
        lo = std::min(lo, o[i].start);
        hi = std::max(hi, o[i].end);
      }
    }
    t0 = any ? lo : 0;
    step = hi - t0;
  }
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
      Tick busy = 0, collective = 0;
      ws.collectives.clear();
      ws.coll_index.clear();
      const OpTiming* times = tl.ops[r].data();
      const Op* ops = prog.ops.data();
      const std::size_t n = prog.ops.size();
      for (std::size_t i = 0; i < n; ++i) {
        const OpKind kind = ops[i].kind;
        if (is_compute(kind)) {
          busy += times[i].end - times[i].start;
        } else if (is_collective(kind)) {
          ws.collectives.push_back(times[i]);
          ws.coll_index.push_back(static_cast<int>(i));
          if (kind != OpKind::OverflowCheck) collective += times[i].end - times[i].start;
        }
      }
      merge_into(ws.collectives, ws.merged_a);
      // The compute stream's idle time, split by what it waited for (see split_idle).
      const IdleSplit idle = split_idle(prog, times, ws.coll_index, ws.merged_a, t0, t0 + step, plan.pp > 1);
      rr.busy_s = ticks_to_seconds(busy);
      rr.idle_s = res.step_time_s - rr.busy_s;
      rr.utilization = step > 0 ? static_cast<double>(busy) / static_cast<double>(step) : 0;
      rr.allreduce_s = ticks_to_seconds(collective);
      rr.exposed_comm_s = ticks_to_seconds(idle.comm);
      rr.pipeline_bubble_s = ticks_to_seconds(std::max<Tick>(0, step - busy - idle.comm));
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
  res.hardware_tflops_per_gpu = shape.hardware_flops_per_sample(cfg.training.activation_recompute) *
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
  double worst = 0;
  for (const auto& rr : res.ranks) worst = std::max(worst, rr.peak_memory_bytes);
  constexpr double kFrameworkGib = 2.0;  // CUDA context, library workspaces, fragmentation
  if (worst <= res.memory_capacity_bytes && res.memory_capacity_bytes - worst < gib_to_bytes(kFrameworkGib))
    fmt::format_to(std::back_inserter(next_warning()),
                   "only {:.1f} GiB of headroom on the fullest GPU: the CUDA context, library workspaces and allocator "
                   "fragmentation (not modelled) typically take 0.5-2 GiB",
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
  if (res.step_time_s > 0 && res.exposed_comm_time_s > 0.1 * res.step_time_s)
    fmt::format_to(std::back_inserter(next_warning()), "{:.0f}% of the step is communication not hidden under compute{}",
                   100 * res.exposed_comm_time_s / res.step_time_s,
                   cfg.communication.overlap_grad_reduce ? "" : "; try communication.overlap_grad_reduce: true");
  res.warnings.resize(nw);
}

}  // namespace trainsim
