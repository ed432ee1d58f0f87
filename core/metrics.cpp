#include "core/metrics.h"

#include <algorithm>

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

Tick uncovered_length(std::vector<OpTiming> a, std::vector<OpTiming> b) {
  a = merged(std::move(a));
  b = merged(std::move(b));
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

Result compute_result(const Plan& plan, const Timeline& tl, const std::vector<MemoryBreakdown>& memory) {
  const Schedule& s = *tl.schedule;
  const auto& cfg = plan.config;
  Result res;
  const Tick step = tl.end() - tl.begin();
  res.step_time_s = ticks_to_seconds(step);
  res.memory_capacity_bytes = gib_to_bytes(cfg.cluster.memory_gib);

  double util_sum = 0;
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const auto& prog = s.ranks[r];
    RankResult rr;
    rr.rank = prog.rank;
    rr.stage = prog.stage;
    rr.replica = prog.replica;
    Tick busy = 0, collective = 0;
    std::vector<OpTiming> compute, comm;
    for (std::size_t i = 0; i < prog.ops.size(); ++i) {
      const Op& op = prog.ops[i];
      const OpTiming& t = tl.ops[r][i];
      if (is_compute(op.kind)) {
        busy += t.end - t.start;
        compute.push_back(t);
      } else if (is_collective(op.kind) || is_send(op.kind)) {
        comm.push_back(t);
        if (op.kind != OpKind::OverflowCheck && is_collective(op.kind)) collective += t.end - t.start;
      }
    }
    rr.busy_s = ticks_to_seconds(busy);
    rr.idle_s = res.step_time_s - rr.busy_s;
    rr.utilization = step > 0 ? static_cast<double>(busy) / static_cast<double>(step) : 0;
    rr.allreduce_s = ticks_to_seconds(collective);
    rr.exposed_comm_s = ticks_to_seconds(uncovered_length(std::move(comm), std::move(compute)));
    if (r < memory.size()) {
      rr.memory = memory[r];
      rr.peak_memory_bytes = memory[r].total();
    }
    util_sum += rr.utilization;
    res.allreduce_time_s = std::max(res.allreduce_time_s, rr.allreduce_s);
    res.exposed_comm_time_s = std::max(res.exposed_comm_time_s, rr.exposed_comm_s);
    res.ranks.push_back(rr);
  }
  res.bubble_fraction = s.ranks.empty() ? 0 : 1.0 - util_sum / static_cast<double>(s.ranks.size());

  const ModelShape shape = plan.shape();
  const double tokens = static_cast<double>(plan.global_batch_size) * shape.s;
  res.tokens_per_s = res.step_time_s > 0 ? tokens / res.step_time_s : 0;
  const double peak = plan.peak_flops(cfg.precision.compute) * cfg.cluster.num_gpus;
  res.mfu = res.step_time_s > 0 && peak > 0
                ? shape.model_flops_per_sample() * plan.global_batch_size / (res.step_time_s * peak)
                : 0;

  res.warnings = plan.warnings;
  double worst = 0;
  for (const auto& rr : res.ranks) worst = std::max(worst, rr.peak_memory_bytes);
  constexpr double kFrameworkGib = 2.0;  // CUDA context, library workspaces, fragmentation
  if (worst <= res.memory_capacity_bytes && res.memory_capacity_bytes - worst < gib_to_bytes(kFrameworkGib))
    res.warnings.push_back(fmt::format(
        "only {:.1f} GiB of headroom on the fullest GPU: the CUDA context, library workspaces and allocator "
        "fragmentation (not modelled) typically take 0.5-2 GiB",
        bytes_to_gib(res.memory_capacity_bytes - worst)));
  for (const auto& rr : res.ranks)
    if (rr.peak_memory_bytes > res.memory_capacity_bytes) {
      res.fits_in_memory = false;
      res.warnings.push_back(fmt::format(
          "rank {} (stage {}, replica {}) needs {:.1f} GiB, {:.1f} GiB more than the GPU's {:.1f} GiB", rr.rank,
          rr.stage, rr.replica, bytes_to_gib(rr.peak_memory_bytes),
          bytes_to_gib(rr.peak_memory_bytes - res.memory_capacity_bytes), cfg.cluster.memory_gib));
    }
  if (res.step_time_s > 0 && res.exposed_comm_time_s > 0.1 * res.step_time_s)
    res.warnings.push_back(fmt::format(
        "{:.0f}% of the step is communication not hidden under compute{}", 100 * res.exposed_comm_time_s / res.step_time_s,
        cfg.communication.overlap_grad_reduce ? "" : "; try communication.overlap_grad_reduce: true"));
  return res;
}

}  // namespace trainsim
