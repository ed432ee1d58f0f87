#include "validation/baselines.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "core/median.h"
#include "core/scenario.h"
#include "validation/validate.h"

namespace trainsim::validation {

namespace {

struct Accepted {
  double value = 0, tolerance = 0;
};

Accepted read(const YAML::Node& n, double default_tolerance) {
  Accepted a{0, default_tolerance};
  if (n && n["accepted"]) a.value = n["accepted"].as<double>();
  if (n && n["tolerance"]) a.tolerance = n["tolerance"].as<double>();
  return a;
}


}  // namespace

BaselineReport check_baselines(const std::string& folder, const BaselineOptions& options) {
  namespace fs = std::filesystem;
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path dir(folder), index = dir / "accepted.yaml";
  YAML::Node root;
  try {
    root = YAML::LoadFile(index.string());
  } catch (const YAML::Exception& e) {
    throw std::runtime_error(fmt::format("cannot read {}: {}", index.string(), e.what()));
  }
  BaselineReport report;
  if (const YAML::Node t = root["targets"]) {
    report.target_step = t["step_time_median"].as<double>(report.target_step);
    report.target_bubble = t["bubble_abs"].as<double>(report.target_bubble);
    report.target_memory = t["peak_memory"].as<double>(report.target_memory);
  }
  if (!root["baselines"] || !root["baselines"].IsSequence())
    throw std::runtime_error(index.string() + ": expected a `baselines:` list");

  // Each plan's scenario and (--update, which accepts the median of `attempts` validations) the
  // errors seen so far, in the file's order; its accepted errors are in report.plans.
  struct Entry {
    Scenario scenario;
    std::vector<double> seen_step, seen_bubble;
  };
  std::vector<Entry> entries;
  for (YAML::Node b : root["baselines"]) {
    BaselineOutcome out;
    out.file = b["file"].as<std::string>();
    out.attempts = 0;
    const Accepted step = read(b["step_time"], 0.15), bubble = read(b["bubble_fraction"], 0.06),
                   memory = read(b["peak_memory"], 0.01);
    out.accepted_step = step.value, out.tolerance_step = step.tolerance;
    out.accepted_bubble = bubble.value, out.tolerance_bubble = bubble.tolerance;
    out.accepted_memory = memory.value, out.tolerance_memory = memory.tolerance;
    entries.push_back(Entry{load_scenario_file((dir / out.file).string()), {}, {}});
    report.plans.push_back(out);
  }

  // One validation of plan i; true when it is done (within its tolerances, out of attempts, or
  // --update with all its attempts in).
  const auto attempt = [&](std::size_t i) {
    Entry& e = entries[i];
    BaselineOutcome& out = report.plans[i];
    ++out.attempts;
    if (options.progress) options.progress(fmt::format("validate {} (attempt {})", out.file, out.attempts));
    const Validation v = options.validate_plan ? options.validate_plan(e.scenario) : [&] {
      ValidateOptions vo;
      if (options.backend_for) vo.backend = options.backend_for(e.scenario);
      vo.calibrate.comm.max_bytes = 4u << 20;
      return validate(e.scenario, vo);
    }();
    const auto errors = errors_of(v);
    out.step_time_error = errors[0].error;
    out.bubble_error = errors[1].error;
    out.allreduce_error = errors[2].error;
    out.reduces = errors[2].predicted > 0 || errors[2].measured > 0;
    out.memory_error = peak_memory_error(v);
    out.machine_drift = v.machine_drift;
    out.core_contention = 0;
    for (double f : v.profile.core_factors) out.core_contention = std::max(out.core_contention, f);
    out.stable = v.numerics.stable;
    out.failures.clear();
    if (options.update) {
      e.seen_step.push_back(out.step_time_error);
      e.seen_bubble.push_back(out.bubble_error);
      if (out.attempts < options.attempts) return false;
      out.step_time_error = median(e.seen_step);
      out.bubble_error = median(e.seen_bubble);
      return true;
    }
    if (std::abs(out.step_time_error - out.accepted_step) > out.tolerance_step)
      out.failures.push_back(fmt::format("step time error {:+.1f}% is more than {:.1f}% from the accepted {:+.1f}%",
                                         100 * out.step_time_error, 100 * out.tolerance_step, 100 * out.accepted_step));
    if (std::abs(out.bubble_error - out.accepted_bubble) > out.tolerance_bubble)
      out.failures.push_back(fmt::format("bubble error {:+.3f} is more than {:.3f} from the accepted {:+.3f}",
                                         out.bubble_error, out.tolerance_bubble, out.accepted_bubble));
    if (std::abs(out.memory_error - out.accepted_memory) > out.tolerance_memory)
      out.failures.push_back(fmt::format("peak memory error {:+.2f}% is more than {:.2f}% from the accepted {:+.2f}%",
                                         100 * out.memory_error, 100 * out.tolerance_memory,
                                         100 * out.accepted_memory));
    if (out.failures.empty() || out.attempts >= options.attempts) return true;
    if (options.progress)
      options.progress(fmt::format("{} off in attempt {} (step {:+.1f}%, bubble {:+.3f}; machine {:+.1f}%, cores x{:.2f}): "
                                   "validated again after the other plans",
                                   out.file, out.attempts, 100 * out.step_time_error, out.bubble_error,
                                   100 * out.machine_drift, out.core_contention));
    return false;
  };
  // In rounds: every plan once, then the plans still open again, in order, up to `attempts`
  // rounds. A plan's next validation comes after the other plans' of the round, not right after
  // its own: a shared host's slow stretches last minutes (a neighbour on one vCPU's core), and
  // back-to-back attempts fall in the same stretch (docs/validation.md).
  std::vector<std::size_t> open(entries.size());
  std::iota(open.begin(), open.end(), std::size_t{0});
  while (!open.empty()) {
    std::vector<std::size_t> still_open;
    for (std::size_t i : open)
      if (!attempt(i)) still_open.push_back(i);
    open = std::move(still_open);
  }
  for (const BaselineOutcome& out : report.plans)
    if (!out.failures.empty()) report.passed = false;

  std::vector<double> steps, bubbles;
  for (const auto& p : report.plans) {
    steps.push_back(std::abs(p.step_time_error));
    bubbles.push_back(std::abs(p.bubble_error));
    report.max_bubble_error = std::max(report.max_bubble_error, std::abs(p.bubble_error));
    report.max_memory_error = std::max(report.max_memory_error, std::abs(p.memory_error));
    if (p.reduces) {
      ++report.allreduce_plans;
      report.allreduce_within += std::abs(p.allreduce_error) <= report.target_allreduce ? 1 : 0;
    }
  }
  report.median_step_error = median(steps);
  report.median_bubble_error = median(bubbles);
  // The targets are what the model should reach; on a shared machine one set's medians
  // scatter around them (docs/validation.md), so the set fails only beyond twice the target,
  // where no noise seen so far reaches and a drift of the model does. Memory is deterministic.
  if (report.median_step_error > 2 * report.target_step)
    report.failures.push_back(fmt::format("median step-time error {:.1f}% is more than twice the target {:.1f}%",
                                          100 * report.median_step_error, 100 * report.target_step));
  if (report.median_bubble_error > 2 * report.target_bubble)
    report.failures.push_back(fmt::format("median bubble-fraction error {:.3f} is more than twice the target {:.3f}",
                                          report.median_bubble_error, report.target_bubble));
  if (report.max_memory_error > report.target_memory)
    report.failures.push_back(fmt::format("a peak-memory error of {:.1f}% exceeds the target {:.1f}%",
                                          100 * report.max_memory_error, 100 * report.target_memory));
  if (!report.failures.empty()) report.passed = false;

  if (options.update) {
    for (std::size_t i = 0; i < report.plans.size(); ++i) {
      YAML::Node b = root["baselines"][i];
      const auto& p = report.plans[i];
      // Four decimals, written as such (a double node would carry every digit of its binary value).
      const auto rounded = [](double x) { return fmt::format("{}", std::round(x * 1e4) / 1e4 + 0.0); };
      b["step_time"]["accepted"] = rounded(p.step_time_error);
      b["bubble_fraction"]["accepted"] = rounded(p.bubble_error);
      b["peak_memory"]["accepted"] = rounded(p.memory_error);
      for (const char* k : {"step_time", "bubble_fraction", "peak_memory"})
        if (!b[k]["tolerance"])
          b[k]["tolerance"] = std::string(k) == "step_time" ? 0.15 : std::string(k) == "bubble_fraction" ? 0.06 : 0.01;
    }
    YAML::Emitter e;
    e << root;
    // The file's opening comment (how its numbers were set, why its tolerances) stays.
    std::string header;
    {
      std::ifstream in(index);
      for (std::string line; std::getline(in, line) && line.rfind('#', 0) == 0;) header += line + "\n";
    }
    if (header.empty())
      header = "# Accepted prediction errors of the baselines (trainsim validate --baselines validation/baselines --update).\n";
    std::ofstream(index) << header << e.c_str() << "\n";
    report.passed = true;
    report.updated = true;
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

std::string format_baseline_report(const BaselineReport& r) {
  std::ostringstream o;
  o << fmt::format("{:<28} {:>10} {:>10} {:>10} {:>10} {:>9} {:>6} {:>8}  {}\n", "plan", "step time", "bubble",
                   "peak mem", "all-reduce", "machine", "cores", "numerics", "verdict");
  for (const auto& p : r.plans) {
    o << fmt::format("{:<28} {:>+9.1f}% {:>+10.3f} {:>+9.2f}% {:>+9.1f}% {:>+8.1f}% {:>6} {:>8}  {}{}\n", p.file,
                     100 * p.step_time_error, p.bubble_error, 100 * p.memory_error,
                     std::isfinite(p.allreduce_error) ? 100 * p.allreduce_error : 0.0, 100 * p.machine_drift,
                     p.core_contention > 0 ? fmt::format("x{:.2f}", p.core_contention) : std::string("-"),
                     p.stable ? "stable" : "unstable", p.failures.empty() ? "ok" : "FAIL",
                     p.attempts > 1 ? fmt::format(" ({} attempts)", p.attempts) : std::string());
    for (const auto& f : p.failures) o << "    " << f << "\n";
  }
  auto verdict = [](double v, double target) { return v <= target ? "met" : "missed"; };
  o << fmt::format("\nstep time    median |error| {:.1f}%: target {:.0f}% {}\n", 100 * r.median_step_error,
                   100 * r.target_step, verdict(r.median_step_error, r.target_step));
  o << fmt::format("bubble       median |error| {:.3f}, largest {:.3f}: target {:.2f} {} (median), {} (largest)\n",
                   r.median_bubble_error, r.max_bubble_error, r.target_bubble,
                   verdict(r.median_bubble_error, r.target_bubble), verdict(r.max_bubble_error, r.target_bubble));
  o << fmt::format("peak memory  largest |error| {:.2f}%: target {:.0f}% {}\n", 100 * r.max_memory_error,
                   100 * r.target_memory, verdict(r.max_memory_error, r.target_memory));
  if (r.allreduce_plans > 0)
    o << fmt::format("all-reduce   within {:.0f}% on {} of the {} plans that reduce: target every plan {}\n",
                     100 * r.target_allreduce, r.allreduce_within, r.allreduce_plans,
                     r.allreduce_within == r.allreduce_plans ? "met" : "missed");
  for (const auto& f : r.failures) o << "FAIL: " << f << "\n";
  o << fmt::format("{} in {:.1f} s\n", r.updated ? "ACCEPTED (accepted.yaml rewritten)" : r.passed ? "PASSED" : "FAILED",
                   r.seconds);
  return o.str();
}

}  // namespace trainsim::validation
