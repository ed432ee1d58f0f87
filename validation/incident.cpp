#include "validation/incident.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "core/report/format.h"
#include "core/report/report.h"
#include "core/report/write_file.h"
#include "runtime/loop/run_report.h"

namespace trainsim::validation {

namespace {

// The runtime's ranks: one per shard of each schedule rank, "8 (4 x tp 2)", "16 (2 x cp 8)".
std::string rank_threads(const Plan& plan) {
  if (plan.gpus_per_rank() == 1) return std::to_string(plan.num_ranks());
  std::string shards;
  if (plan.cp > 1) shards += fmt::format(" x cp {}", plan.cp);
  if (plan.tp > 1) shards += fmt::format(" x tp {}", plan.tp);
  return fmt::format("{} ({}{})", plan.num_ranks() * plan.gpus_per_rank(), plan.num_ranks(), shards);
}

struct Spread {
  double min = 0, mean = 0, max = 0;
};

Spread utilization(const Result& r) {
  Spread s{1, 0, 0};
  if (r.ranks.empty()) return {};
  for (const RankResult& k : r.ranks) {
    s.min = std::min(s.min, k.utilization);
    s.max = std::max(s.max, k.utilization);
    s.mean += k.utilization / static_cast<double>(r.ranks.size());
  }
  return s;
}

std::string pct(double x) { return fmt::format("{:.1f}%", 100 * x); }
std::string gib(double bytes) { return fmt::format("{:.1f} GiB", bytes / (1024.0 * 1024 * 1024)); }

std::string layout(const Plan& p) {
  std::string s = fmt::format("dp {} x pp {}", p.dp, p.pp);
  if (p.tp > 1) s += fmt::format(" x tp {}", p.tp);
  if (p.cp > 1) s += fmt::format(" x cp {}", p.cp);
  if (p.vpp > 1) s += fmt::format(" (v={})", p.vpp);
  return s + fmt::format(", {}, {} x {} micro-batches", schedule_name(p.config.parallelism.schedule),
                         p.num_microbatches, p.micro_batch_size);
}

std::string precision_line(const PrecisionConfig& p) {
  return fmt::format("{} compute, {} accumulation, {} all-reduce (divide {}), {} overflow check, loss scaling {}",
                     dtype_name(p.compute), dtype_name(p.grad_accumulation), dtype_name(p.allreduce),
                     p.allreduce_divide == AllReduceDivide::before ? "before" : "after",
                     p.overflow_check == OverflowScope::global ? "global" : "local",
                     p.loss_scaling.mode == LossScalingMode::none     ? "none"
                     : p.loss_scaling.mode == LossScalingMode::dynamic ? "dynamic"
                                                                       : fmt::format("static {:g}", p.loss_scaling.initial_scale));
}

ConfigurationStory tell(const std::string& label, Scenario scenario, const ProveOptions& o) {
  ConfigurationStory c;
  c.label = label;
  c.scenario = std::move(scenario);
  if (o.progress) o.progress(label + ": predicting at full size");
  c.plan = Plan::from_scenario(c.scenario);
  c.full = predict(c.plan);
  ValidateOptions vo;
  vo.backend = o.backend;
  vo.steps = o.steps;
  vo.progress = [&](const std::string& s) {
    if (o.progress) o.progress(label + ": " + s);
  };
  c.scaled = validate(c.scenario, vo);
  return c;
}

std::vector<std::string> findings(const IncidentReport& r) {
  std::vector<std::string> f;
  const auto& a = r.original;
  const auto& b = r.redesign;
  const Spread ap = utilization(a.full.result), am = utilization(a.scaled.measured.result);
  const Spread bp = utilization(b.full.result), bm = utilization(b.scaled.measured.result);
  f.push_back(fmt::format(
      "The original configuration was predicted to keep its GPUs busy {} of the step on average ({} to {} by rank, "
      "bubble {}); run at the scaled size its ranks were measured busy {} ({} to {}), against {} predicted for that run.",
      pct(ap.mean), pct(ap.min), pct(ap.max), pct(a.full.result.bubble_fraction), pct(am.mean), pct(am.min),
      pct(am.max), pct(utilization(a.scaled.predicted.result).mean)));
  const NumericsSummary& an = a.scaled.numerics;
  if (!an.stable)
    f.push_back("Its numerics failed as the incident did: " + describe_numerics(an) + ".");
  else
    f.push_back("Its numerics stayed stable in this run: " + describe_numerics(an) + ".");
  f.push_back(fmt::format(
      "The redesign was predicted at {} tokens/s against {} ({:+.0f}%), busy {} on average ({} to {}); run at the "
      "scaled size its ranks were measured busy {} ({} to {}).",
      human_count(b.full.result.tokens_per_s), human_count(a.full.result.tokens_per_s),
      100 * (b.full.result.tokens_per_s / a.full.result.tokens_per_s - 1), pct(bp.mean), pct(bp.min), pct(bp.max),
      pct(bm.mean), pct(bm.min), pct(bm.max)));
  f.push_back("Its numerics: " + describe_numerics(b.scaled.numerics) + ".");
  if (bm.mean > am.mean && b.scaled.numerics.stable && !an.stable)
    f.push_back("Measured, the redesign is busier and its loss is stable where the original's was not: the redesign "
                "holds.");
  else
    f.push_back("Measured, the redesign does NOT clearly beat the original on both counts here; see the tables.");
  return f;
}

// Utilization, bubble and step time: predicted at full size, then predicted and measured scaled.
void table(std::ostream& o, const ConfigurationStory& c, bool markdown) {
  const Result &full = c.full.result, &pred = c.scaled.predicted.result, &meas = c.scaled.measured.result;
  const Spread f = utilization(full), p = utilization(pred), m = utilization(meas);
  auto row = [&](const std::string& what, const std::string& a, const std::string& b, const std::string& d) {
    if (markdown)
      o << fmt::format("| {} | {} | {} | {} |\n", what, a, b, d);
    else
      o << fmt::format("    {:<24} {:>16} {:>16} {:>16}\n", what, a, b, d);
  };
  if (markdown)
    o << "| | full size, predicted | scaled, predicted | scaled, measured |\n|---|---:|---:|---:|\n";
  else
    row("", "full, predicted", "scaled, predicted", "scaled, measured");
  row("step time", format_seconds(full.step_time_s), format_seconds(pred.step_time_s), format_seconds(meas.step_time_s));
  row("tokens/s", human_count(full.tokens_per_s), human_count(pred.tokens_per_s), human_count(meas.tokens_per_s));
  row("bubble", pct(full.bubble_fraction), pct(pred.bubble_fraction), pct(meas.bubble_fraction));
  row("utilization (mean)", pct(f.mean), pct(p.mean), pct(m.mean));
  row("utilization (min-max)", pct(f.min) + "-" + pct(f.max), pct(p.min) + "-" + pct(p.max), pct(m.min) + "-" + pct(m.max));
  row("exposed communication", format_seconds(full.exposed_comm_time_s), format_seconds(pred.exposed_comm_time_s),
      format_seconds(meas.exposed_comm_time_s));
  double fp = 0, pp = 0, mp = 0;
  for (const auto& k : full.ranks) fp = std::max(fp, k.peak_memory_bytes);
  for (const auto& k : pred.ranks) pp = std::max(pp, k.peak_memory_bytes);
  for (const auto& k : meas.ranks) mp = std::max(mp, k.peak_memory_bytes);
  row("peak memory per rank", gib(fp) + (full.fits_in_memory ? "" : " (does not fit)"),
      fmt::format("{:.1f} MiB", pp / (1 << 20)), fmt::format("{:.1f} MiB", mp / (1 << 20)));
}

void describe(std::ostream& o, const ConfigurationStory& c, bool markdown) {
  const Plan& full = c.plan;
  const runtime::RuntimePlan& rp = c.scaled.plan;
  const auto& d = rp.dims;
  if (markdown) {
    o << fmt::format("- **layout**: {} on {} x {}\n", layout(full), full.num_ranks() * full.gpus_per_rank(),
                     c.scenario.config.cluster.gpu);
    o << fmt::format("- **precision**: {}\n", precision_line(c.scenario.config.precision));
    o << fmt::format("- **scaled run**: {} ranks as threads on {}; model {} layers, hidden {}, {} heads, seq {}, "
                     "vocab {}\n",
                     rank_threads(rp.plan), c.scaled.profile.device, d.num_layers, d.hidden_size, d.num_heads,
                     d.seq_length, d.vocab_size);
    for (const auto& n : rp.notes) o << "- runtime note: " << n << "\n";
  } else {
    o << fmt::format("  layout     {}\n  precision  {}\n", layout(full), precision_line(c.scenario.config.precision));
    // Where the scaled run ran: the CPU's cores, or a device (its name, before the placement).
    const HardwareProfile& p = c.scaled.profile;
    const std::string where = p.backend == "cpu" ? fmt::format("{} cores", p.ranks_per_node)
                                                 : p.device.substr(0, p.device.find(';'));
    o << fmt::format("  scaled     {} ranks on {}, model {} layers x hidden {}\n", rank_threads(rp.plan), where,
                     d.num_layers, d.hidden_size);
  }
}

}  // namespace

IncidentReport prove(const Scenario& scenario, const ProveOptions& o) {
  IncidentReport r;
  if (o.progress) o.progress("planning (trainsim plan)");
  PlanOptions po;
  po.threads = o.threads;
  r.plan = make_plan(scenario, po);
  if (!r.plan.chosen)
    throw NothingFeasible("trainsim plan found no feasible configuration for " + scenario.file +
                             ", so there is no redesign to prove (`trainsim plan " + scenario.file +
                             "` says what bound each candidate and what would make one fit)");
  Scenario redesign = load_scenario_text(r.plan.fragment.dump(), scenario.file + " (redesign by trainsim plan)");
  redesign.config.runtime = scenario.config.runtime;  // the same scaled model and steps
  r.original = tell("original", scenario, o);
  r.redesign = tell("redesign", redesign, o);
  r.findings = findings(r);
  return r;
}

std::string format_incident(const IncidentReport& r) {
  std::ostringstream o;
  o << fmt::format("{} — predicted, then proven on the {} backend\n\n", r.original.scenario.config.name,
                   backend_title(r.original.scaled.backend));
  for (const ConfigurationStory* c : {&r.original, &r.redesign}) {
    o << c->label << "\n";
    describe(o, *c, false);
    table(o, *c, false);
    o << "  numerics   " << describe_numerics(c->scaled.numerics) << "\n\n";
  }
  o << "what the plan changed\n";
  for (const auto& s : r.plan.steps) o << "  " << s.change << ": " << s.effect << "\n";
  o << "\nverdict\n";
  for (const auto& f : r.findings) o << "  - " << f << "\n";
  return o.str();
}

std::vector<std::string> write_incident_report(const IncidentReport& r, const std::string& dir) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  std::vector<std::string> written;
  auto file = [&](const std::string& name, const std::function<void(std::ostream&)>& body) {
    const std::string p = (fs::path(dir) / name).string();
    write_file(p, body);
    written.push_back(p);
  };
  for (const ConfigurationStory* c : {&r.original, &r.redesign}) {
    const Plan& full = c->plan;
    file(c->label + "-full-predicted.svg",
         [&](std::ostream& out) { write_timeline_svg(full, c->full.timeline, c->full.result, out); });
    file(c->label + "-scaled-predicted-vs-measured.svg",
         [&](std::ostream& out) { write_validation_svg(c->scaled, out); });
    file(c->label + "-scaled-run.svg", [&](std::ostream& out) { runtime::write_run_svg(c->scaled.measured, out); });
  }

  std::ostringstream md;
  const auto& a = r.original;
  md << fmt::format("# {}: predicted, then proven\n\n", a.scenario.config.name);
  md << a.scenario.config.description << "\n\n";
  md << "This report was written by `trainsim prove` in one invocation: every figure below comes from it.\n\n";
  md << "## Verdict\n\n";
  for (const auto& f : r.findings) md << "- " << f << "\n";
  md << "\n## What the plan changed (predicted at full size)\n\n";
  for (const auto& s : r.plan.steps) md << "- " << s.change << ": " << s.effect << "\n";
  if (!r.plan.precision.empty()) {
    md << "\nPrecision issues of the original configuration:\n\n";
    for (const auto& p : r.plan.precision) md << "- " << p.problem << " Fix: `" << p.fix << "`. " << p.why << "\n";
  }
  for (const ConfigurationStory* c : {&r.original, &r.redesign}) {
    md << fmt::format("\n## The {}\n\n", c->label);
    describe(md, *c, true);
    md << "\n";
    table(md, *c, true);
    md << "\n**Numerics of the scaled run**: " << describe_numerics(c->scaled.numerics) << ".\n";
    if (!c->scaled.numerics.failure.empty()) md << "The run ended early: " << c->scaled.numerics.failure << ".\n";
    md << "\n**Prediction against measurement at the scaled size** (`trainsim validate`):\n\n```\n"
       << format_validation(c->scaled) << "```\n";
    md << fmt::format("\n![{0}: predicted at full size]({0}-full-predicted.svg)\n\n", c->label);
    md << fmt::format("![{0}: scaled, predicted above measured]({0}-scaled-predicted-vs-measured.svg)\n\n", c->label);
    md << fmt::format("![{0}: the scaled run's timeline and loss]({0}-scaled-run.svg)\n", c->label);
  }
  md << "\n## How to read the scaled runs\n\n"
        "The scaled runs execute the same schedule and precision settings as the full-size plan on a small model, "
        "one rank per thread. With more ranks than cores the ranks take the cores in turns, one whole compute op "
        "at a time, in an order the prediction fixes before the run (a rank waiting for its turn counts as busy, "
        "as a time-shared rank would be); the prediction replays that order with each op at its calibrated time "
        "and each handoff of a core at the time the engine's own gate took on this machine. The communication "
        "threads' collectives take the cores first, as the operating system runs a thread that wakes before "
        "those that kept running, and the turns beside them share what is left. Waits for messages and "
        "wake-ups beyond the gate's are not priced: expect the scaled step time to be off by more than on the "
        "validation baselines, which keep one rank per core (docs/validation.md).\n";
  file("report.md", [&](std::ostream& out) { out << md.str(); });
  return written;
}

}  // namespace trainsim::validation
