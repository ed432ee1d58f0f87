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

// Decimal, as fmt's "{}" writes an int.
void append_int(std::string& out, int v) {
  char buf[16];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr);
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
  Tick step = 0;
  if (same_as == nullptr) {
    step = tl.end() - tl.begin();
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
    step = hi - (any ? lo : 0);
  }
  res.step_time_s = ticks_to_seconds(step);
  res.bubble_fraction = 0;
  res.tokens_per_s = 0;
  res.mfu = 0;
  res.allreduce_time_s = 0;
  res.exposed_comm_time_s = 0;
  res.fits_in_memory = true;
  res.memory_capacity_bytes = gib_to_bytes(cfg.cluster.memory_gib);
  res.ranks.resize(s.ranks.size());

  double util_sum = 0;
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const auto& prog = s.ranks[r];
    RankResult& rr = res.ranks[r];
    const int twin = same_as != nullptr ? (*same_as)[r] : static_cast<int>(r);
    if (twin >= 0 && twin < static_cast<int>(r)) {
      rr = res.ranks[twin];  // computed already: a twin is an earlier rank
    } else {
      Tick busy = 0, collective = 0;
      ws.compute.clear();
      ws.collectives.clear();
      ws.sends.clear();
      const OpTiming* times = tl.ops[r].data();
      const Op* ops = prog.ops.data();
      const std::size_t n = prog.ops.size();
      for (std::size_t i = 0; i < n; ++i) {
        const OpKind kind = ops[i].kind;
        const OpTiming& t = times[i];
        if (is_compute(kind)) {
          busy += t.end - t.start;
          ws.compute.push_back(t);
        } else if (is_collective(kind)) {
          ws.collectives.push_back(t);
          if (kind != OpKind::OverflowCheck) collective += t.end - t.start;
        } else if (is_send(kind)) {
          ws.sends.push_back(t);
        }
      }
      // The two communication streams' intervals, each in stream order, merged by start.
      ws.comm.resize(ws.collectives.size() + ws.sends.size());
      auto by_start = [](const OpTiming& a, const OpTiming& b) { return a.start < b.start; };
      if (std::is_sorted(ws.collectives.begin(), ws.collectives.end(), by_start) &&
          std::is_sorted(ws.sends.begin(), ws.sends.end(), by_start))
        std::merge(ws.collectives.begin(), ws.collectives.end(), ws.sends.begin(), ws.sends.end(), ws.comm.begin(),
                   by_start);
      else
        std::copy(ws.sends.begin(), ws.sends.end(),
                  std::copy(ws.collectives.begin(), ws.collectives.end(), ws.comm.begin()));
      merge_into(ws.comm, ws.merged_a);
      merge_into(ws.compute, ws.merged_b);
      rr.busy_s = ticks_to_seconds(busy);
      rr.idle_s = res.step_time_s - rr.busy_s;
      rr.utilization = step > 0 ? static_cast<double>(busy) / static_cast<double>(step) : 0;
      rr.allreduce_s = ticks_to_seconds(collective);
      rr.exposed_comm_s = ticks_to_seconds(uncovered_merged(ws.merged_a, ws.merged_b));
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
    res.allreduce_time_s = std::max(res.allreduce_time_s, rr.allreduce_s);
    res.exposed_comm_time_s = std::max(res.exposed_comm_time_s, rr.exposed_comm_s);
  }
  res.bubble_fraction = s.ranks.empty() ? 0 : 1.0 - util_sum / static_cast<double>(s.ranks.size());

  const ModelShape shape = plan.shape();
  const double tokens = static_cast<double>(plan.global_batch_size) * shape.s;
  res.tokens_per_s = res.step_time_s > 0 ? tokens / res.step_time_s : 0;
  const double peak = plan.peak_flops(cfg.precision.compute) * cfg.cluster.num_gpus;
  res.mfu = res.step_time_s > 0 && peak > 0
                ? shape.model_flops_per_sample() * plan.global_batch_size / (res.step_time_s * peak)
                : 0;

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
  ws.tail_peak = -1;
  for (const auto& rr : res.ranks)
    if (rr.peak_memory_bytes > res.memory_capacity_bytes) {
      res.fits_in_memory = false;
      if (rr.peak_memory_bytes != ws.tail_peak) {
        ws.tail.clear();
        fmt::format_to(std::back_inserter(ws.tail), " needs {:.1f} GiB, {:.1f} GiB more than the GPU's {:.1f} GiB",
                       bytes_to_gib(rr.peak_memory_bytes),
                       bytes_to_gib(rr.peak_memory_bytes - res.memory_capacity_bytes), cfg.cluster.memory_gib);
        ws.tail_peak = rr.peak_memory_bytes;
      }
      // "rank {} (stage {}, replica {})" + tail, without a format string per rank.
      std::string& w = next_warning();
      w += "rank ";
      append_int(w, rr.rank);
      w += " (stage ";
      append_int(w, rr.stage);
      w += ", replica ";
      append_int(w, rr.replica);
      w += ')';
      w += ws.tail;
    }
  if (res.step_time_s > 0 && res.exposed_comm_time_s > 0.1 * res.step_time_s)
    fmt::format_to(std::back_inserter(next_warning()), "{:.0f}% of the step is communication not hidden under compute{}",
                   100 * res.exposed_comm_time_s / res.step_time_s,
                   cfg.communication.overlap_grad_reduce ? "" : "; try communication.overlap_grad_reduce: true");
  res.warnings.resize(nw);
}

}  // namespace trainsim
