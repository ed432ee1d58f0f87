#include "runtime/loop/run_report.h"

#include <algorithm>
#include <cmath>
#include <ostream>
#include <sstream>

#include <fmt/format.h>

#include "core/report/format.h"
#include "core/report/report.h"
#include "core/report/svg_kit.h"
#include "runtime/loop/run_loop.h"

namespace trainsim::runtime {

namespace {

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

// One character per step, its height the loss between the run's lowest and highest.
std::string sparkline(const std::vector<StepRecord>& steps) {
  static const char* levels[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& s : steps)
    if (std::isfinite(s.loss)) {
      lo = std::min(lo, s.loss);
      hi = std::max(hi, s.loss);
    }
  std::string out;
  for (const auto& s : steps) {
    if (!std::isfinite(s.loss)) {
      out += "!";
      continue;
    }
    const int k = hi > lo ? static_cast<int>(std::lround((s.loss - lo) / (hi - lo) * 7)) : 3;
    out += levels[std::clamp(k, 0, 7)];
  }
  return out;
}

std::string number(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{:.4g}", x);
}

}  // namespace

std::string format_run_summary(const RunReport& rep) {
  const Plan& plan = rep.runtime_plan.plan;
  const auto& c = plan.config;
  const auto& d = rep.runtime_plan.dims;
  const Result& res = rep.result;
  std::string o;
  o += fmt::format("{}{} — measured on the {} backend\n", c.name.empty() ? std::string("scenario") : c.name,
                   plan.source.empty() ? "" : fmt::format(" ({})", plan.source), rep.backend_title);
  o += fmt::format("  model    executed: {} layers, hidden {}, {} heads, seq {}, vocab {}{}\n", d.num_layers,
                   d.hidden_size, d.num_heads, d.seq_length, d.vocab_size, d.tied_embeddings ? ", tied embeddings" : "");
  o += fmt::format("  plan     data {} x pipeline {}{}{}{}, {} schedule, {} micro-batches of {} per replica (global batch {}), "
                   "layers per stage {}, {}\n",
                   plan.dp, plan.pp, plan.vpp > 1 ? fmt::format(" (v={})", plan.vpp) : "",
                   plan.tp > 1 ? fmt::format(" x tensor {}{}", plan.tp,
                                             c.parallelism.sequence_parallel ? " (sequence parallel)" : "")
                               : "",
                   plan.cp > 1 ? fmt::format(" x context {}", plan.cp) : "",
                   schedule_name(c.parallelism.schedule), plan.num_microbatches, plan.micro_batch_size,
                   plan.global_batch_size, fmt::join(plan.layers_per_virtual_stage, "/"), plan.zero_and_recompute());
  const auto& pr = c.precision;
  const auto& ls = pr.loss_scaling;
  o += fmt::format("  numerics {} compute, {} master, {} accumulation, {} all-reduce (divide {}), overflow check {}, "
                   "loss scaling {}{}\n",
                   dtype_name(pr.compute), dtype_name(pr.master_weights), dtype_name(pr.grad_accumulation),
                   dtype_name(pr.allreduce), pr.allreduce_divide == AllReduceDivide::before ? "before" : "after",
                   pr.overflow_check == OverflowScope::global ? "global" : "local",
                   ls.mode == LossScalingMode::none ? "none" : ls.mode == LossScalingMode::static_scale ? "static" : "dynamic",
                   ls.mode == LossScalingMode::none ? "" : fmt::format(" from {:g}", ls.initial_scale));
  o += fmt::format("  run      {} ranks{}, data {}, steps {}..{}\n", plan.num_ranks() * plan.gpus_per_rank(), rep.ranks_as, rep.data_source, rep.first_step, rep.first_step + static_cast<int>(rep.steps.size()) - 1);
  if (!rep.execution.empty()) o += fmt::format("  backend  {}\n", rep.execution);
  o += "\n";

  const double tokens = static_cast<double>(plan.global_batch_size) * d.seq_length;
  // Where the engine measured what other work took from the ranks' cores on every step, the
  // reported step is the median of those it took least from (median_step_index).
  const bool host_measured = !rep.steps.empty() && std::all_of(rep.steps.begin(), rep.steps.end(), [](const StepRecord& s) {
    return s.foreign_seconds >= 0;
  });
  o += fmt::format("  step time        {:>10}  (step {}, the median{})   tokens/s {:>10.0f}\n", format_seconds(res.step_time_s),
                   rep.timeline_step, chosen_by_host_share(steps_as_run(rep)) ? " of the half the host took least from" : "",
                   res.step_time_s > 0 ? tokens / res.step_time_s : 0.0);
  // The simulator's split (core/metrics.h): idle waiting for pipeline peers plus idle waiting for
  // collectives, so a data-parallel run's exposed all-reduce is not read as a pipeline bubble.
  o += fmt::format("  bubble fraction  {:>9.1f}%   = pipeline bubble {:.1f}% + exposed communication {:.1f}% "
                   "(idle, mean over ranks)\n",
                   100 * res.bubble_fraction, 100 * res.pipeline_bubble_fraction, 100 * res.exposed_comm_fraction);
  o += fmt::format("  all-reduce       {:>10}   exposed communication {} (the most on one rank)\n",
                   format_seconds(res.allreduce_time_s), format_seconds(res.exposed_comm_time_s));
  // On the GPU the allocators' own peak follows the accounted one: the difference is cuBLAS
  // workspaces, scratch and the pool's rounding.
  const bool allocated = rep.allocated_peak_bytes.size() == res.ranks.size() && !res.ranks.empty();
  o += fmt::format("\n  {:>4} {:>5} {:>7}  {:>6} {:<20} {:>9} {:>9}   {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}{}\n", "rank",
                   "stage", "replica", "util", "", "busy", "idle", "weights", "grads", "optim", "activ", "buffers",
                   "peak MiB", allocated ? fmt::format(" {:>10}", "alloc MiB") : "");
  for (const auto& r : res.ranks) {
    o += fmt::format("  {:>4} {:>5} {:>7}  {:5.1f}% {:<20} {:>9} {:>9}   {:8.2f} {:8.2f} {:8.2f} {:8.2f} {:8.2f} {:9.2f}{}\n",
                     r.rank, r.stage, r.replica, 100 * r.utilization, text_bar(r.utilization, 20), format_seconds(r.busy_s),
                     format_seconds(r.idle_s), mib(r.memory.weights), mib(r.memory.gradients), mib(r.memory.optimizer),
                     mib(r.memory.activations), mib(r.memory.buffers), mib(r.peak_memory_bytes),
                     allocated ? fmt::format(" {:10.2f}", mib(rep.allocated_peak_bytes[static_cast<std::size_t>(r.rank)])) : "");
  }

  o += fmt::format("\n  loss {}  {} -> {}\n", sparkline(rep.steps), rep.steps.empty() ? "-" : number(rep.steps.front().loss),
                   rep.steps.empty() ? "-" : number(rep.steps.back().loss));
  // host: the share of the step other work held the most-disturbed rank's core.
  o += fmt::format("  {:>5} {:>9} {:>10} {:>10} {:>8} {:>9} {:>12} {:>9}{}\n", "step", "loss", "grad norm", "loss scale",
                   "skipped", "nonfinite", "drift", "time", host_measured ? fmt::format(" {:>6}", "host") : "");
  for (const auto& s : rep.steps)
    o += fmt::format("  {:>5} {:>9} {:>10} {:>10} {:>8} {:>9} {:>12} {:>9}{}\n", s.step, number(s.loss),
                     number(s.grad_norm), number(s.loss_scale),
                     s.skipped_ranks == 0 ? "-" : s.skipped_ranks == plan.num_ranks() ? "all" : fmt::format("{} ranks", s.skipped_ranks),
                     s.nonfinite_count, number(s.replica_drift), format_seconds(s.step_time_s),
                     host_measured ? fmt::format(" {:5.1f}%", 100 * s.foreign_seconds / std::max(1e-12, s.step_time_s)) : "");
  int skipped = 0;
  bool drift = false;
  for (const auto& s : rep.steps) {
    skipped += s.skipped_ranks > 0;
    drift = drift || s.replica_drift != 0;
  }
  if (skipped > 0) o += fmt::format("  {} of {} steps skipped an update on some rank\n", skipped, rep.steps.size());
  if (drift)
    o += "  replicas drifted apart: data-parallel copies of a stage that should be identical are not\n";
  if (rep.failure) o += fmt::format("\nRUN FAILED: {}\n", rep.failure->message);
  if (!res.warnings.empty()) {
    o += "\nnotes:\n";
    for (const auto& w : res.warnings) o += fmt::format("  - {}\n", w);
  }
  for (const auto& ck : rep.checkpoints) o += fmt::format("checkpoint {}\n", ck);
  return o;
}

nlohmann::ordered_json run_to_json(const RunReport& rep) {
  nlohmann::ordered_json j = result_to_json(rep.result);
  const auto finite_or_null = [](double x) -> nlohmann::ordered_json {
    if (std::isfinite(x)) return x;
    return std::isnan(x) ? "NaN" : (x > 0 ? "inf" : "-inf");
  };
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const auto& s : rep.steps) {
    nlohmann::ordered_json st;
    st["step"] = s.step;
    st["loss"] = finite_or_null(s.loss);
    st["grad_norm"] = finite_or_null(s.grad_norm);
    st["loss_scale"] = s.loss_scale;
    st["skipped"] = s.skipped;
    st["nonfinite_count"] = s.nonfinite_count;
    st["replica_drift"] = finite_or_null(s.replica_drift);
    st["skipped_ranks"] = s.skipped_ranks;
    st["step_time_s"] = s.step_time_s;
    if (s.foreign_seconds >= 0) st["foreign_seconds"] = s.foreign_seconds;
    st["replica_checksums"] = nlohmann::ordered_json::array();
    for (auto h : s.replica_checksums) st["replica_checksums"].push_back(fmt::format("{:016x}", h));
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (const auto& r : s.ranks) {
      nlohmann::ordered_json rj;
      rj["rank"] = r.rank;
      rj["stage"] = r.stage;
      rj["replica"] = r.replica;
      rj["shard"] = r.shard;
      rj["max_abs_activation"] = finite_or_null(r.max_abs_activation);
      rj["max_abs_gradient"] = finite_or_null(r.max_abs_gradient);
      rj["nonfinite_count"] = r.nonfinite_count;
      rj["found_nonfinite"] = r.found_nonfinite;
      rj["skipped"] = r.skipped;
      rj["loss_scale"] = r.loss_scale;
      if (!r.first_nonfinite.empty()) rj["first_nonfinite"] = r.first_nonfinite;
      ranks.push_back(std::move(rj));
    }
    st["ranks"] = std::move(ranks);
    steps.push_back(std::move(st));
  }
  j["steps"] = std::move(steps);
  const auto& d = rep.runtime_plan.dims;
  j["run"] = {{"backend", rep.backend},
              {"execution", rep.execution},
              {"model", {{"num_layers", d.num_layers}, {"hidden_size", d.hidden_size}, {"num_attention_heads", d.num_heads},
                         {"seq_length", d.seq_length}, {"vocab_size", d.vocab_size}}},
              {"data", rep.data_source},
              {"measured_step", rep.timeline_step},
              {"threads_pinned", rep.threads_pinned},
              {"first_step", rep.first_step}};
  if (!rep.replayed_steps.empty()) {
    // Its steps replayed for their timing (RunOptions::timed_steps_at_least): which one the result is.
    j["run"]["measured_replay"] = rep.timeline_replay;
    j["run"]["replays"] = rep.replayed_steps.back().replay;
  }
  if (!rep.allocated_peak_bytes.empty()) j["run"]["allocated_peak_bytes"] = rep.allocated_peak_bytes;
  // Every rank the engine ran, with its coordinates (runtime/engine/world.h) and the schedule rank
  // whose program it ran (the `ranks` of the result: one per (dp, pp) cell).
  nlohmann::ordered_json executed = nlohmann::ordered_json::array();
  for (const ExecutedRank& e : rep.executed_ranks)
    executed.push_back({{"rank", e.rank},
                        {"dp", e.dp},
                        {"pp", e.pp},
                        {"tp", e.tp},
                        {"cp", e.cp},
                        {"schedule_rank", e.schedule_rank},
                        {"peak_memory_bytes", e.memory.total()},
                        {"memory_bytes",
                         {{"weights", e.memory.weights},
                          {"gradients", e.memory.gradients},
                          {"optimizer", e.memory.optimizer},
                          {"activations", e.memory.activations},
                          {"buffers", e.memory.buffers}}}});
  j["run"]["executed_ranks"] = std::move(executed);
  if (rep.failure) j["failure"] = {{"step", rep.failure->step}, {"message", rep.failure->message}};
  return j;
}

void write_run_svg(const RunReport& rep, std::ostream& out) {
  // The timeline, drawn by the simulator's own writer, nested above a loss chart.
  std::ostringstream tl;
  write_timeline_svg(rep.runtime_plan.plan, rep.timeline, rep.result, tl);
  const std::string timeline = tl.str();
  const svg::Size size = svg::size_of(timeline).value_or(svg::Size{1400, 400});
  const double width = size.width, height = size.height;
  const double chart_h = 260, left = 250, right = 24, top = height + 30;
  const double total_h = top + chart_h + 64;
  out << svg::open(width, total_h, false, " font-family=\"sans-serif\" font-size=\"12\"");
  out << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out << svg::nested(timeline) << "\n";
  const auto& steps = rep.steps;
  out << fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\" font-size=\"14\" font-weight=\"bold\">Loss per step "
                     "(measured){}</text>\n",
                     left, top - 10, rep.failure ? fmt::format(": the run failed at step {}", rep.failure->step) : "");
  if (rep.failure) {
    std::string why = rep.failure->message;
    if (why.size() > 190) why = why.substr(0, 187) + "...";
    out << fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\" fill=\"#c0392b\">{}</text>\n", left, top + chart_h + 52,
                       svg::escape(why));
  }
  const double pw = width - left - right;
  out << fmt::format("<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"{:.0f}\" height=\"{:.0f}\" fill=\"none\" "
                     "stroke=\"#999\"/>\n",
                     left, top, pw, chart_h);
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& s : steps)
    if (std::isfinite(s.loss)) {
      lo = std::min(lo, s.loss);
      hi = std::max(hi, s.loss);
    }
  if (!(hi > lo)) {
    lo = std::isfinite(lo) ? lo - 1 : 0;
    hi = std::isfinite(hi) ? hi + 1 : 1;
  }
  const int n = static_cast<int>(steps.size());
  auto x_of = [&](int i) { return left + (n > 1 ? pw * i / (n - 1) : pw / 2); };
  auto y_of = [&](double loss) { return top + chart_h - (loss - lo) / (hi - lo) * chart_h; };
  for (int k = 0; k <= 4; ++k) {
    const double v = lo + (hi - lo) * k / 4;
    out << fmt::format("<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3f}</text>\n", left - 6, y_of(v) + 4, v);
  }
  std::string path;
  for (int i = 0; i < n; ++i) {
    const auto& s = steps[i];
    if (s.skipped_ranks > 0)
      out << fmt::format("<rect x=\"{:.1f}\" y=\"{:.0f}\" width=\"4\" height=\"{:.0f}\" fill=\"#f4c542\" "
                         "opacity=\"0.5\"><title>step {}: {} rank(s) skipped</title></rect>\n",
                         x_of(i) - 2, top, chart_h, s.step, s.skipped_ranks);
    if (!std::isfinite(s.loss)) {
      out << fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\" fill=\"#c0392b\" text-anchor=\"middle\">NaN</text>\n", x_of(i),
                         top + 14);
      continue;
    }
    path += fmt::format("{}{:.1f},{:.1f}", path.empty() ? "M" : " L", x_of(i), y_of(s.loss));
  }
  if (!path.empty()) out << fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"#2f6db5\" stroke-width=\"2\"/>\n", path);
  for (int i = 0; i < n; ++i)
    if (std::isfinite(steps[i].loss))
      out << fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#2f6db5\"><title>step {}: loss {:.4f}, "
                         "scale {:g}</title></circle>\n",
                         x_of(i), y_of(steps[i].loss), steps[i].step, steps[i].loss, steps[i].loss_scale);
  for (int i = 0; i < n; ++i)
    if (i == 0 || i == n - 1 || n <= 20 || i % (n / 10) == 0)
      out << fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\" text-anchor=\"middle\">{}</text>\n", x_of(i),
                         top + chart_h + 16, steps[i].step);
  out << fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\" text-anchor=\"middle\">optimizer step (yellow: an update was "
                     "skipped on some rank)</text>\n",
                     left + pw / 2, top + chart_h + 36);
  out << svg::kClose;
}

}  // namespace trainsim::runtime
