#include "sim/sweep/advice.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>

#include "core/metrics.h"
#include "core/plan.h"
#include "core/presets.h"
#include "core/report/format.h"
#include "core/units.h"
#include "sim/simulator.h"

namespace trainsim {

namespace {

double rate_of(const ClusterConfig& cl, DType d) {
  auto it = cl.peak_tflops.find(d);
  return it == cl.peak_tflops.end() ? 0.0 : it->second;
}

// Upper case in prose ("FP16"), as papers and vendors write it.
std::string dt(DType d) {
  std::string s(dtype_name(d));
  for (auto& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return s;
}

// Micro-batches per replica as Plan would derive them (0 when the batch does not divide).
int microbatches_of(const ScenarioConfig& c) {
  const long long per_step = static_cast<long long>(c.training.micro_batch_size) * c.parallelism.data_parallel_size;
  if (per_step <= 0) return 0;
  const long long gb = c.training.global_batch_size > 0 ? c.training.global_batch_size : per_step;
  return gb % per_step == 0 ? static_cast<int>(gb / per_step) : 0;
}

std::string fix_text(const std::vector<std::pair<std::string, FieldValue>>& changes) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : changes) parts.push_back(fmt::format("{}: {}", k, format_field_value(v)));
  return fmt::format("{}", fmt::join(parts, ", "));
}

FieldValue text(const char* s) { return FieldValue{std::string(s)}; }

}  // namespace

std::vector<PrecisionIssue> precision_issues(const ScenarioConfig& c) {
  std::vector<PrecisionIssue> out;
  const auto& pr = c.precision;
  const bool has_bf16 = rate_of(c.cluster, DType::bf16) > 0;
  const bool fp16 = pr.compute == DType::fp16;
  const int d = c.parallelism.data_parallel_size, p = c.parallelism.pipeline_parallel_size;
  const std::string gpu = c.cluster.gpu.empty() ? std::string("this GPU") : c.cluster.gpu;
  auto add = [&](std::string id, std::string problem, std::vector<std::pair<std::string, FieldValue>> changes,
                 std::string why) {
    PrecisionIssue i{std::move(id), std::move(problem), fix_text(changes), std::move(why), std::move(changes)};
    out.push_back(std::move(i));
  };

  // The format and the loss scale.
  if (fp16 && pr.loss_scaling.mode != LossScalingMode::dynamic) {
    const bool none = pr.loss_scaling.mode == LossScalingMode::none;
    const std::string problem =
        none ? std::string("FP16 compute without loss scaling: gradients below 6e-8 (FP16's smallest subnormal) "
                           "underflow to zero")
             : fmt::format("FP16 with a static loss scale ({:g}): a scale too high overflows to inf on every step "
                           "and never backs off, one too low lets small gradients underflow",
                           pr.loss_scaling.initial_scale);
    if (has_bf16)
      add(none ? "fp16_no_loss_scaling" : "fp16_static_loss_scaling", problem,
          {{"precision.compute", text("bf16")}, {"precision.loss_scaling.mode", text("none")}},
          fmt::format("{} has BF16 at the same peak rate; BF16 keeps FP32's exponent range, so gradients neither "
                      "overflow nor underflow and no loss scale is needed",
                      gpu));
    else
      add(none ? "fp16_no_loss_scaling" : "fp16_static_loss_scaling", problem,
          {{"precision.loss_scaling.mode", text("dynamic")}, {"precision.overflow_check", text("global")}},
          fmt::format("{} has no BF16; a dynamic scale halves after an overflow (the step is skipped everywhere "
                      "at once with a global check) and grows back after a run of clean steps",
                      gpu));
  }
  else if (fp16 && has_bf16)
    add("fp16_where_bf16_available",
        fmt::format("FP16 on {}, which has BF16 at the same peak rate: FP16 needs its loss scale (skipped steps on "
                    "every overflow, a found-inf check every step) only for its narrow exponent range",
                    gpu),
        {{"precision.compute", text("bf16")}, {"precision.loss_scaling.mode", text("none")}},
        "BF16 is the standard on A100 and H100 (Megatron-LM, torchtitan, Llama): FP32's exponent range, no loss "
        "scale, no skipped steps, same speed");
  if (pr.master_weights != DType::fp32)
    add("low_precision_master_weights",
        fmt::format("{} master weights: an update smaller than 2^-{} of a weight rounds away and is lost",
                    dt(pr.master_weights), pr.master_weights == DType::fp16 ? 11 : 8),
        {{"precision.master_weights", text("fp32")}},
        "FP32 master weights keep small updates (mixed precision's standard recipe; 2 more bytes per parameter)");

  // Gradient accumulation over micro-batches.
  const int m = microbatches_of(c);
  if ((pr.grad_accumulation == DType::fp16 || pr.grad_accumulation == DType::bf16) && m > 1)
    add("low_precision_grad_accumulation",
        fmt::format("{} gradient accumulation over {} micro-batches: each add rounds to {} significant bits, so "
                    "small contributions vanish as the sum grows",
                    dt(pr.grad_accumulation), m, pr.grad_accumulation == DType::fp16 ? 11 : 8),
        {{"precision.grad_accumulation", text("fp32")}},
        "an FP32 accumulation buffer keeps 24 significant bits through the whole sum (costs 2 more bytes per "
        "gradient)");

  // The data-parallel all-reduce.
  if (d > 1 && pr.allreduce == DType::fp16 && pr.allreduce_divide == AllReduceDivide::after)
    add("allreduce_sum_before_divide",
        fmt::format("FP16 all-reduce summed before dividing by data_parallel_size({}): partial sums reach {}x a "
                    "replica's gradient and overflow FP16's 65504 first",
                    d, d),
        {{"precision.allreduce", text("fp32")}, {"precision.allreduce_divide", text("before")}},
        "an FP32 sum of gradients divided first cannot overflow and loses no bits to the sum (it moves twice the "
        "bytes of FP16)");
  else if (d > 1 && (pr.allreduce == DType::fp16 || pr.allreduce == DType::bf16))
    add("low_precision_allreduce",
        fmt::format("{} all-reduce over {} replicas: every partial sum of the ring rounds to {} significant bits",
                    dt(pr.allreduce), d, pr.allreduce == DType::fp16 ? 11 : 8),
        {{"precision.allreduce", text("fp32")}, {"precision.allreduce_divide", text("before")}},
        "reducing in FP32 keeps the sum exact to 24 bits (it moves twice the bytes of a 16-bit all-reduce)");
  else if (d > 1 && pr.allreduce_divide == AllReduceDivide::after)
    add("allreduce_sum_before_divide",
        fmt::format("all-reduce summed before dividing by data_parallel_size({}): partial sums reach {}x a "
                    "replica's gradient",
                    d, d),
        {{"precision.allreduce_divide", text("before")}}, "dividing first keeps every partial sum in range at no cost");

  // Who decides to skip a step.
  const bool scaled = fp16 || pr.loss_scaling.mode != LossScalingMode::none;
  if (pr.overflow_check == OverflowScope::local && (d > 1 || p > 1) && scaled)
    add("local_overflow_check",
        fmt::format("overflow checks local to each of {} stage{} x {} replica{}: each decides alone whether to skip "
                    "a step, so they skip different steps and their weights drift apart",
                    p, p == 1 ? "" : "s", d, d == 1 ? "" : "s"),
        {{"precision.overflow_check", text("global")}},
        "a global check (one tiny all-reduce of a found-inf flag) makes every stage and replica skip the same steps");
  return out;
}

void apply_precision_fixes(ScenarioConfig& c) {
  // Fixes can uncover others (none do today); a few rounds settle any chain.
  for (int round = 0; round < 4; ++round) {
    const auto issues = precision_issues(c);
    if (issues.empty()) return;
    for (const auto& i : issues)
      for (const auto& [k, v] : i.changes) find_field(k)->set(c, v);
  }
}

std::vector<SweepAxis> default_search_space(const ScenarioConfig& c) {
  std::vector<SweepAxis> axes;
  auto values = [&](const char* path, std::vector<FieldValue> v) {
    axes.push_back(SweepAxis{path, std::move(v), {}, SweepAxisKind::values});
  };
  axes.push_back(SweepAxis{"parallelism", {}, {}, SweepAxisKind::auto_parallelism});
  if (c.training.global_batch_size > 0)
    axes.push_back(SweepAxis{"training.micro_batch_size", {}, {}, SweepAxisKind::auto_micro_batch_size});
  values("parallelism.schedule", {text("gpipe"), text("1f1b"), text("interleaved-1f1b"), text("zb-h1")});
  axes.push_back(SweepAxis{"parallelism.virtual_pipeline_stages", {}, {}, SweepAxisKind::auto_virtual_stages});
  values("parallelism.sequence_parallel", {false, true});
  // Long sequences: the ways to split each one over GPUs (docs/sweep.md says from what length).
  if (c.model.seq_length >= kLongContextTokens) {
    std::vector<FieldValue> ways;
    const std::int64_t most = std::max<std::int64_t>(8, c.model.seq_length / kContextTokensPerGpu);
    for (std::int64_t cp = 1; cp <= most && c.model.seq_length % (2 * cp) == 0; cp *= 2) ways.push_back(cp);
    values("parallelism.context_parallel_size", std::move(ways));
  }
  values("training.activation_recompute", {text("none"), text("selective"), text("selective_op"), text("full")});
  values("parallelism.zero_stage", {std::int64_t{0}, std::int64_t{1}, std::int64_t{2}, std::int64_t{3}});
  values("communication.overlap_grad_reduce", {false, true});
  return axes;
}

void normalize_default_candidate(ScenarioConfig& c) {
  auto& p = c.parallelism;
  if (p.pipeline_parallel_size == 1) p.schedule = ScheduleKind::one_f_one_b;  // all schedules are one without stages
  if (p.schedule != ScheduleKind::interleaved_1f1b) p.virtual_pipeline_stages = 1;
  else if (p.virtual_pipeline_stages < 2) p.virtual_pipeline_stages = 2;
  if (p.tensor_parallel_size == 1) p.sequence_parallel = false;
  // The file's own split of the layers fits its own chunks: a candidate with another number of
  // chunks splits them as trainsim's default does (balanced by FLOPs, the output layer counted).
  if (!p.layers_per_stage.empty() &&
      static_cast<long long>(p.layers_per_stage.size()) !=
          static_cast<long long>(p.pipeline_parallel_size) * p.virtual_pipeline_stages)
    p.layers_per_stage.clear();
  // Transformer Engine's userbuffers overlap sequence parallelism's collectives inside a node: a
  // layout without them runs its tensor-parallel collectives exposed.
  if (c.communication.tp_comm_overlap &&
      (!p.sequence_parallel || p.tensor_parallel_size > std::max(1, c.cluster.gpus_per_node)))
    c.communication.tp_comm_overlap = false;
  if (p.data_parallel_size * p.context_parallel_size == 1) {  // nothing to reduce or shard over
    p.zero_stage = 0;
    c.communication.overlap_grad_reduce = false;
  }
  const Framework fw = p.framework == Framework::auto_select
                           ? (p.zero_stage >= 2 ? Framework::deepspeed : Framework::megatron)
                           : p.framework;
  if (fw == Framework::deepspeed && p.zero_stage >= 2 && p.pipeline_parallel_size > 1) p.zero_stage = 1;
  if (fw == Framework::fsdp && p.zero_stage == 1) p.zero_stage = 2;
  // --overlap-param-gather is the distributed optimizer's: a candidate without it gathers as its
  // framework does.
  if (p.zero_stage != 1 || fw != Framework::megatron) c.communication.overlap_param_gather = false;
  // Interleaving with micro-batches that are not a multiple of the stages: Megatron-Core's
  // smallest group of micro-batches a chunk that runs them (Plan::from_config states the rule;
  // PyTorch's interleaved schedule, framework fsdp, has no such groups).
  if (p.schedule == ScheduleKind::interleaved_1f1b && p.microbatch_group_size == 0 && fw != Framework::fsdp) {
    const long long per = static_cast<long long>(c.training.micro_batch_size) * p.data_parallel_size;
    const long long gb = c.training.global_batch_size;
    const int stages = p.pipeline_parallel_size;
    if (per > 0 && gb > 0 && gb % per == 0 && stages > 0 && (gb / per) % stages != 0) {
      const int m = static_cast<int>(gb / per);
      for (int n = stages; n <= m; ++n)
        if (m % n == 0 || m % n >= stages) {
          p.microbatch_group_size = n;
          break;
        }
    }
  }
  // The selective recompute the framework has: Megatron-LM's (and DeepSpeed on it) recomputes the
  // attention core; PyTorch-native FSDP code (torchtitan) its op-level policy.
  Recompute& rc = c.training.activation_recompute;
  if (fw == Framework::fsdp && rc == Recompute::selective) rc = Recompute::selective_op;
  if (fw != Framework::fsdp && rc == Recompute::selective_op) rc = Recompute::selective;
  if (rc != Recompute::full) c.training.recompute_num_layers = 0;  // the layers full recompute rebuilds
}

std::tuple<int, int, int, int, int> layout_complexity(const ScenarioConfig& c) {
  const auto& p = c.parallelism;
  const int schedule = p.pipeline_parallel_size == 1                     ? 0
                       : p.schedule == ScheduleKind::interleaved_1f1b ? 1
                       : p.schedule == ScheduleKind::zb_h1            ? 2
                                                                      : 0;
  return {p.pipeline_parallel_size * p.tensor_parallel_size * p.context_parallel_size, p.pipeline_parallel_size,
          schedule, p.virtual_pipeline_stages, p.data_parallel_size * p.context_parallel_size > 1 ? p.zero_stage : 0};
}

// ---- explaining the changes ---------------------------------------------------------

namespace {

std::string secs(double s) {
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.1f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string pct(double f) {
  const double p = 100 * f;
  return std::fabs(p) >= 10 || p == 0 ? fmt::format("{:.0f}%", p) : fmt::format("{:.1f}%", p);
}

std::string gib(double bytes) { return fmt::format("{:.1f} GiB", bytes_to_gib(bytes)); }

std::string signed_gib(double bytes) {
  return fmt::format("{}{:.1f} GiB", bytes >= 0 ? "+" : "-", std::fabs(bytes_to_gib(bytes)));
}

// Key path without its section for sentences ("precision.loss_scaling.mode" -> "loss_scaling.mode").
std::string short_key(const std::string& path) {
  const auto dot = path.find('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

// The group a changed key is explained in; lower groups are applied first.
int group_of(const std::string& key) {
  static const std::vector<std::pair<int, std::vector<std::string>>> groups = {
      {0, {"parallelism.data_parallel_size", "parallelism.pipeline_parallel_size",
           "parallelism.tensor_parallel_size", "parallelism.sequence_parallel", "parallelism.context_parallel_size",
           "parallelism.layers_per_stage"}},
      {1, {"parallelism.schedule", "parallelism.virtual_pipeline_stages", "training.micro_batch_size",
           "training.global_batch_size"}},
      {2, {"training.activation_recompute", "training.recompute_num_layers", "parallelism.zero_stage"}},
  };
  for (const auto& [g, keys] : groups)
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) return g;
  if (key.rfind("communication.", 0) == 0) return 3;
  if (key.rfind("precision.", 0) == 0) return 4;
  return 5;
}

std::vector<std::string> changed_keys(const ScenarioConfig& a, const ScenarioConfig& b) {
  std::vector<std::string> out;
  for (const auto& f : scenario_fields())
    if (f.get && format_field_value(f.get(a)) != format_field_value(f.get(b))) out.push_back(f.path);
  return out;
}

std::string describe_change(const std::vector<std::string>& keys, const ScenarioConfig& from, const ScenarioConfig& to,
                            const SweepRow& before, const SweepRow& after) {
  std::vector<std::string> parts;
  // A configuration that names no split of the layers runs trainsim's own: shown as the layers
  // each chunk holds ("3 + 6 x 4 + 3"), not as an empty list.
  auto value = [](const FieldSpec& f, const ScenarioConfig& c) {
    if (f.path != "parallelism.layers_per_stage" || !c.parallelism.layers_per_stage.empty())
      return format_field_value(f.get(c));
    return fmt::format("trainsim's split ({})", layer_split_text(layers_per_virtual_stage_of(c)));
  };
  for (const auto& k : keys) {
    const FieldSpec* f = find_field(k);
    parts.push_back(fmt::format("{} {} -> {}", short_key(k), value(*f, from), value(*f, to)));
  }
  if (before.num_microbatches > 0 && after.num_microbatches > 0 && before.num_microbatches != after.num_microbatches)
    parts.push_back(
        fmt::format("{} -> {} micro-batches per replica", before.num_microbatches, after.num_microbatches));
  if (parts.size() <= 2) return fmt::format("{}", fmt::join(parts, " and "));
  const std::string last = parts.back();
  parts.pop_back();
  return fmt::format("{} and {}", fmt::join(parts, ", "), last);
}

std::string describe_effect(const SweepRow& a, const SweepRow& b) {
  std::vector<std::string> parts;
  if (!b.simulated) return fmt::format("{} ({})", sweep_status_name(b.status), b.reason);
  const SweepMetrics &x = a.metrics, &y = b.metrics;
  if (!a.simulated) {
    parts.push_back(fmt::format("now runs: tokens/s {}, pipeline bubble {}, exposed communication {}, peak memory {}",
                                human_count(y.tokens_per_s), pct(y.pipeline_bubble_fraction),
                                pct(y.exposed_comm_fraction), gib(y.peak_memory_bytes)));
    return fmt::format("{}", fmt::join(parts, ", "));
  }
  // The idle time, by what it waits for: each part named only when it moved.
  if (std::fabs(x.pipeline_bubble_fraction - y.pipeline_bubble_fraction) >= 0.005)
    parts.push_back(fmt::format("pipeline bubble {} -> {}", pct(x.pipeline_bubble_fraction),
                                pct(y.pipeline_bubble_fraction)));
  const double step = std::max(x.step_time_s, y.step_time_s);
  const bool comm_moved = std::fabs(x.exposed_comm_fraction - y.exposed_comm_fraction) >= 0.005;
  if (comm_moved)
    parts.push_back(fmt::format("exposed communication {} -> {} of the step", pct(x.exposed_comm_fraction),
                                pct(y.exposed_comm_fraction)));
  if (!comm_moved && std::fabs(x.allreduce_time_s - y.allreduce_time_s) > std::max(1e-3, 0.01 * step) &&
      std::fabs(x.exposed_comm_time_s - y.exposed_comm_time_s) <= std::max(1e-3, 0.01 * step))
    parts.push_back(fmt::format("all-reduce {} -> {} (hidden under compute)", secs(x.allreduce_time_s),
                                secs(y.allreduce_time_s)));
  // Activation memory: per stage when the stages are the same, else the largest stage's.
  if (x.stages.size() == y.stages.size() && !x.stages.empty()) {
    std::size_t best = 0;
    double delta = 0;
    for (std::size_t s = 0; s < x.stages.size(); ++s) {
      const double d = y.stages[s].activation_bytes - x.stages[s].activation_bytes;
      if (std::fabs(d) > std::fabs(delta)) {
        delta = d;
        best = s;
      }
    }
    if (std::fabs(delta) >= gib_to_bytes(0.05))
      parts.push_back(fmt::format("activation memory on stage {} {}", best, signed_gib(delta)));
  } else {
    auto largest = [](const SweepMetrics& m) {
      double v = 0;
      for (const auto& s : m.stages) v = std::max(v, s.activation_bytes);
      return v;
    };
    if (std::fabs(largest(x) - largest(y)) >= gib_to_bytes(0.05))
      parts.push_back(fmt::format("activation memory (largest stage) {} -> {}", gib(largest(x)), gib(largest(y))));
  }
  if (std::fabs(x.peak_memory_bytes - y.peak_memory_bytes) >= gib_to_bytes(0.05))
    parts.push_back(fmt::format("peak memory per GPU {} -> {}", gib(x.peak_memory_bytes), gib(y.peak_memory_bytes)));
  if (a.global_batch_size != b.global_batch_size)
    parts.push_back(fmt::format("step time {} -> {}", secs(x.step_time_s), secs(y.step_time_s)));
  const double gain = x.tokens_per_s > 0 ? y.tokens_per_s / x.tokens_per_s - 1 : 0;
  parts.push_back(fmt::format("tokens/s {} -> {} ({}{:.1f}%)", human_count(x.tokens_per_s), human_count(y.tokens_per_s),
                              gain >= 0 ? "+" : "", 100 * gain));
  std::string s = fmt::format("{}", fmt::join(parts, ", "));
  if (a.status == SweepStatus::out_of_memory && b.status != SweepStatus::out_of_memory) s += "; now fits in memory";
  if (a.status != SweepStatus::out_of_memory && b.status == SweepStatus::out_of_memory)
    s += "; " + b.reason.substr(0, b.reason.find(';'));
  return s;
}

std::vector<PlanStep> explain(const ScenarioConfig& original, const SweepRow& original_row, const ScenarioConfig& chosen,
                              const SweepConstraints& constraints) {
  const std::vector<std::string> keys = changed_keys(original, chosen);
  std::map<int, std::vector<std::string>> grouped;
  for (const auto& k : keys) grouped[group_of(k)].push_back(k);

  std::vector<PlanStep> steps;
  Predictor predictor;
  ScenarioConfig cur = original;
  SweepRow cur_row = original_row;
  std::vector<std::string> pending;
  std::size_t left = grouped.size();
  for (const auto& [g, group_keys] : grouped) {
    --left;
    pending.insert(pending.end(), group_keys.begin(), group_keys.end());
    ScenarioConfig next = cur;
    for (const auto& k : pending) {
      const FieldSpec* f = find_field(k);
      f->set(next, f->get(chosen));
    }
    SweepConfiguration point;
    point.config = next;
    SweepRow row = evaluate_configuration(predictor, point, constraints);
    // A group that cannot run alone is explained together with the next one.
    if (!row.simulated && left > 0) continue;
    PlanStep step;
    step.keys = pending;
    step.change = describe_change(pending, cur, next, cur_row, row);
    step.effect = describe_effect(cur_row, row);
    step.before = cur_row;
    step.after = row;
    step.before.point.values.clear();
    step.after.point.values.clear();
    for (const auto& k : pending) {
      step.before.point.values.emplace_back(k, find_field(k)->get(cur));
      step.after.point.values.emplace_back(k, find_field(k)->get(next));
    }
    steps.push_back(std::move(step));
    pending.clear();
    cur = std::move(next);
    cur_row = std::move(row);
  }
  return steps;
}

}  // namespace

// ---- the fragment ---------------------------------------------------------------------

nlohmann::ordered_json scenario_fragment(const Scenario& original, const ScenarioConfig& config) {
  // An uneven split the plan derived (default_layers_per_virtual_stage) is written out: the file
  // says what runs, in the form a framework's own setting takes.
  ScenarioConfig chosen = config;
  if (std::vector<int> split = layers_per_virtual_stage_of(chosen); !is_even_split(split))
    chosen.parallelism.layers_per_stage = std::move(split);
  std::set<std::string> keys(original.explicit_keys.begin(), original.explicit_keys.end());
  for (const auto& k : changed_keys(original.config, chosen)) keys.insert(k);
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& f : scenario_fields()) {
    if (!keys.count(f.path) || !f.get) continue;
    // The file's split dropped for a layout with other chunks: trainsim's even split, unwritten.
    if (f.path == "parallelism.layers_per_stage" && chosen.parallelism.layers_per_stage.empty()) continue;
    const FieldValue v = f.get(chosen);
    nlohmann::ordered_json value;
    std::visit([&](const auto& x) { value = x; }, v);
    // Nest by the dotted path: sections become maps, as a person writes them.
    nlohmann::ordered_json* node = &j;
    std::string rest = f.path;
    for (auto dot = rest.find('.'); dot != std::string::npos; dot = rest.find('.')) {
      const std::string section = rest.substr(0, dot);
      if (!node->contains(section)) (*node)[section] = nlohmann::ordered_json::object();
      node = &(*node)[section];
      rest = rest.substr(dot + 1);
    }
    (*node)[rest] = value;
  }
  if (j.contains("name")) j["name"] = j["name"].get<std::string>() + "-plan";
  if (j.contains("description"))
    j["description"] = fmt::format("Chosen by `trainsim plan` from {}{}.", original.file.empty() ? "a scenario" : original.file,
                                   original.config.name.empty() ? "" : " (" + original.config.name + ")");
  return j;
}

namespace {

void emit_yaml(const nlohmann::ordered_json& j, int indent, std::string& out) {
  const std::string pad(static_cast<std::size_t>(indent), ' ');
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.value().is_object()) {
      out += fmt::format("{}{}:\n", pad, it.key());
      emit_yaml(it.value(), indent + 2, out);
    } else {
      // JSON scalars and flow lists are YAML; strings stay quoted (JSON escapes are YAML's).
      out += fmt::format("{}{}: {}\n", pad, it.key(), it.value().dump());
    }
  }
}

}  // namespace

std::string scenario_fragment_yaml(const nlohmann::ordered_json& fragment, const std::string& comment) {
  std::string out;
  std::size_t i = 0;
  while (i < comment.size()) {
    const std::size_t j = std::min(comment.find('\n', i), comment.size());
    out += "# " + comment.substr(i, j - i) + "\n";
    i = j + 1;
  }
  emit_yaml(fragment, 0, out);
  return out;
}

// ---- when nothing fits ------------------------------------------------------------------

Infeasibility diagnose_infeasible(const SweepResult& sweep, const ScenarioConfig& c) {
  Infeasibility d;
  bool searched_zero3 = false, searched_full = false;
  for (std::size_t i = 0; i < sweep.rows.size(); ++i) {
    const SweepRow& r = sweep.rows[i];
    if (r.point.config.parallelism.zero_stage == 3 && r.point.config.parallelism.data_parallel_size > 1)
      searched_zero3 = true;
    if (r.point.config.training.activation_recompute == Recompute::full) searched_full = true;
    if (!r.simulated) continue;
    if (!d.smallest || r.metrics.peak_memory_bytes < sweep.rows[*d.smallest].metrics.peak_memory_bytes) d.smallest = i;
  }
  for (std::size_t k = sweep.ranking.size(); k < sweep.order.size() && d.near_misses.size() < 5; ++k)
    if (sweep.rows[sweep.order[k]].simulated) d.near_misses.push_back(sweep.order[k]);

  // Model states alone, as the file's precision and optimizer keep them, sharded over every GPU.
  const auto& pr = c.precision;
  const double w = pr.compute == DType::fp8 ? 2.0 : dtype_bytes(pr.compute);
  const double master = pr.master_weights != pr.compute && !(pr.compute == DType::tf32 && pr.master_weights == DType::fp32)
                            ? dtype_bytes(pr.master_weights)
                            : 0.0;
  const double moments = c.training.optimizer == Optimizer::sgd ? 4.0 : 8.0;
  d.model_state_bytes_per_param = w + dtype_bytes(pr.grad_accumulation) + master + moments;
  d.model_state_bytes = d.model_state_bytes_per_param * ModelShape(c.model).total_params();
  const double cap = gib_to_bytes(c.cluster.memory_gib);
  d.min_gpus_zero3 = cap > 0 ? static_cast<int>(std::ceil(d.model_state_bytes / cap)) : 0;

  const int n = c.cluster.num_gpus;
  if (d.min_gpus_zero3 > n)
    d.suggestions.push_back(fmt::format(
        "more GPUs: the model states alone ({:g} bytes x {} parameters = {:.0f} GB) need at least {} GPUs of {:.0f} "
        "GiB with ZeRO-3 sharding them over all GPUs (you have {}), before any activation",
        d.model_state_bytes_per_param, human_count(ModelShape(c.model).total_params()), d.model_state_bytes / 1e9,
        d.min_gpus_zero3, c.cluster.memory_gib, n));
  if (!searched_zero3 && n > 1)
    d.suggestions.push_back("ZeRO-3 (parallelism.zero_stage: 3): shards the weights too, over the data-parallel ranks");
  if (!searched_full)
    d.suggestions.push_back("full activation recompute (training.activation_recompute: full): keeps only each "
                            "layer's input");
  // Where the smallest configuration's memory is mostly activations (long sequences), splitting
  // each sequence over GPUs divides them; say so when no candidate did.
  bool searched_cp = false;
  for (const SweepRow& r : sweep.rows) searched_cp |= r.point.config.parallelism.context_parallel_size > 1;
  if (!searched_cp && d.smallest && n > 1) {
    const SweepMetrics& m = sweep.rows[*d.smallest].metrics;
    double activations = 0;
    for (const StageMemory& st : m.stages) activations = std::max(activations, st.activation_bytes);
    if (activations > 0.5 * m.peak_memory_bytes)
      d.suggestions.push_back(fmt::format(
          "context parallelism (parallelism.context_parallel_size: 2, 4, ...): activations are {:.1f} of the "
          "smallest configuration's {:.1f} GiB, and each GPU of a context-parallel group holds 1/c of every "
          "sequence's tokens (needs flash or cudnn attention)",
          bytes_to_gib(activations), bytes_to_gib(m.peak_memory_bytes)));
  }
  d.suggestions.push_back(fmt::format(
      "offload the optimizer states to CPU memory (DeepSpeed ZeRO-Offload, FSDP CPUOffload; not modelled here): "
      "{:g} of the {:g} bytes per parameter leave the GPU, at the price of PCIe traffic every step",
      master + moments, d.model_state_bytes_per_param));
  if (d.smallest) {
    const double need = sweep.rows[*d.smallest].metrics.peak_memory_bytes;
    const GpuPreset* bigger = nullptr;
    for (const auto& g : gpu_presets())
      if (gib_to_bytes(g.memory_gib) >= need && g.memory_gib > c.cluster.memory_gib &&
          (!bigger || g.memory_gib < bigger->memory_gib))
        bigger = &g;
    if (bigger)
      d.suggestions.push_back(fmt::format("a GPU with more memory: {} ({:.1f} GiB) holds the smallest configuration "
                                          "found ({:.1f} GiB)",
                                          bigger->name, bigger->memory_gib, bytes_to_gib(need)));
  }
  return d;
}

// ---- the plan -------------------------------------------------------------------------

namespace {

// What FP8 would buy on this GPU, and what it costs: said, never applied.
std::vector<PlanNote> fp8_notes(const ScenarioConfig& chosen, const SweepRow& chosen_row,
                                const SweepConstraints& constraints) {
  std::vector<PlanNote> out;
  if (rate_of(chosen.cluster, DType::fp8) <= 0) return out;
  const char* caveats =
      "only the linear layers' matrix products run in FP8 (attention's core, norms, softmax and the optimizer stay in "
      "BF16), so the prediction, which prices the products at the FP8 peak, is an upper bound; each tensor is scaled "
      "by its own amax history (Transformer Engine's delayed scaling), not by a loss scale, so there is no found-inf "
      "check; the first and last layers are usually kept in BF16; and FP8 runs must be checked against a BF16 "
      "baseline's loss curve (FP8 recipes have diverged at scale)";
  if (chosen.precision.compute == DType::fp8) {
    out.push_back({"fp8_caveats", fmt::format("FP8 compute: {}.", caveats)});
    return out;
  }
  if (chosen.precision.compute != DType::bf16 && chosen.precision.compute != DType::fp16) return out;
  ScenarioConfig f = chosen;
  f.precision.compute = DType::fp8;
  f.precision.loss_scaling.mode = LossScalingMode::none;
  Predictor predictor;
  SweepConfiguration point;
  point.config = f;
  const SweepRow row = evaluate_configuration(predictor, point, constraints);
  const std::string gpu = chosen.cluster.gpu.empty() ? std::string("this GPU") : chosen.cluster.gpu;
  if (!row.simulated || chosen_row.metrics.tokens_per_s <= 0) return out;
  out.push_back({"fp8_option",
                 fmt::format("FP8 option (not applied): {} has FP8 at {:g} TFLOP/s; with precision.compute: fp8 the "
                             "chosen configuration would run at {} tokens/s ({:+.0f}%){}. Caveats: {}.",
                             gpu, rate_of(chosen.cluster, DType::fp8), human_count(row.metrics.tokens_per_s),
                             100 * (row.metrics.tokens_per_s / chosen_row.metrics.tokens_per_s - 1),
                             row.feasible() ? "" : fmt::format(" but {}", row.reason), caveats)});
  return out;
}

// Full recompute of every layer is what a memory-bound candidate of the grid gets; recomputing a
// chunk's first layers alone (training.recompute_num_layers, Megatron-LM's block method) trades
// less time for the memory it needs. For the kRecomputeRefinements fastest feasible candidates
// with full recompute, the fewest of each chunk's first layers that still leave the candidate
// feasible (fits and meets the constraints) with room, found by bisection below the layers it
// rebuilds (memory only falls as layers are recomputed), added as rows.
void refine_block_recompute(SweepResult& sweep, const SweepConstraints& constraints) {
  std::vector<std::size_t> full;
  for (std::size_t i : sweep.ranking) {
    const ScenarioConfig& c = sweep.rows[i].point.config;
    if (c.training.activation_recompute == Recompute::full) full.push_back(i);
    if (full.size() == kRecomputeRefinements) break;
  }
  // As the choice among near-ties does: the GPU's unmodelled share left free (kUnmodelledMemoryGib)
  // unless the file states its own margin (which feasibility holds); a candidate already short of
  // it is not made shorter.
  const bool own_margin = constraints.min_memory_headroom_gib.has_value();
  auto roomy = [&](const SweepRow& r) {
    return r.feasible() && (own_margin || bytes_to_gib(r.metrics.headroom_bytes()) >= kUnmodelledMemoryGib);
  };
  Predictor predictor;
  const std::size_t before = sweep.rows.size();
  for (std::size_t i : full) {
    const SweepRow& row = sweep.rows[i];
    const std::vector<int> split = layers_per_virtual_stage_of(row.point.config);
    const int most = recomputed_layers(row.point.config.training,
                                       split.empty() ? 0 : *std::max_element(split.begin(), split.end()));
    // The fewest layers in [1, most) meeting `ok` (memory only falls as layers are recomputed).
    auto fewest = [&](auto&& ok) {
      std::optional<SweepRow> best;
      int lo = 1, hi = most;  // `most`: the row itself
      while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        SweepConfiguration point = row.point;
        point.config.training.recompute_num_layers = mid;
        SweepRow probe = evaluate_configuration(predictor, std::move(point), constraints);
        if (ok(probe)) {
          hi = mid;
          best = std::move(probe);
        } else {
          lo = mid + 1;
        }
      }
      return best;
    };
    if (!roomy(row)) continue;
    std::optional<SweepRow> best = fewest(roomy);
    if (!best) continue;
    best->point.index = sweep.rows.size();
    sweep.rows.push_back(std::move(*best));
  }
  if (sweep.rows.size() == before) return;
  // A column of its own, so that a refined row and its candidate differ in the tables.
  constexpr const char* kKey = "training.recompute_num_layers";
  if (std::find(sweep.keys.begin(), sweep.keys.end(), kKey) == sweep.keys.end()) {
    const FieldSpec* f = find_field(kKey);
    sweep.keys.push_back(kKey);
    for (SweepRow& r : sweep.rows) r.point.values.emplace_back(kKey, f->get(r.point.config));
  }
  rank_rows(sweep);
}

}  // namespace

PlanResult make_plan(const Scenario& scenario, const PlanOptions& options) {
  PlanResult plan;
  plan.scenario = scenario;
  plan.margin = options.margin;
  {
    Predictor predictor;
    SweepConfiguration own;
    own.config = scenario.config;
    plan.original = evaluate_configuration(predictor, own, scenario.constraints);
  }
  plan.precision = precision_issues(scenario.config);

  Scenario search = scenario;
  if (search.sweep.empty()) {
    search.sweep = default_search_space(scenario.config);
    plan.default_space = true;
  }
  if (options.fix_precision) apply_precision_fixes(search.config);
  SweepOptions so;
  so.threads = options.threads;
  so.progress = options.progress;
  const bool fix = options.fix_precision, normalize = plan.default_space;
  if (fix || normalize)
    so.adjust = [fix, normalize](ScenarioConfig& c) {
      if (normalize) normalize_default_candidate(c);
      if (fix) apply_precision_fixes(c);
    };
  plan.sweep = run_sweep(search, so);
  if (plan.default_space) refine_block_recompute(plan.sweep, scenario.constraints);
  // The original's row reports the same keys as the candidates.
  plan.original.point.values.clear();
  for (const auto& k : plan.sweep.keys) plan.original.point.values.emplace_back(k, find_field(k)->get(scenario.config));

  // Setups: hardware and model are not choices. Only rows of the file's own setup (its swept
  // hardware and model keys as the file writes them) are chosen from; each setup gets its own best.
  ScenarioConfig incumbent = scenario.config;  // the file's configuration as the plan runs it
  if (fix) apply_precision_fixes(incumbent);
  for (const auto& k : plan.sweep.keys)
    if (is_setup_key(k)) plan.setup_keys.push_back(k);
  auto is_own = [&](const SweepRow& row) {
    for (const auto& [k, v] : row.point.values)
      if (is_setup_key(k) && format_field_value(v) != format_field_value(find_field(k)->get(incumbent))) return false;
    return true;
  };
  bool own_setup_swept = false;
  for (const auto& row : plan.sweep.rows) own_setup_swept |= is_own(row);

  // The file's configuration is a candidate too: found among the rows, or added to them when
  // its setup is one the sweep searches.
  {
    const std::string want = config_fingerprint(incumbent);
    for (std::size_t i = 0; i < plan.sweep.rows.size() && !plan.incumbent; ++i)
      if (plan.sweep.rows[i].point.error.empty() && config_fingerprint(plan.sweep.rows[i].point.config) == want)
        plan.incumbent = i;
    if (!plan.incumbent && own_setup_swept) {
      Predictor predictor;
      SweepConfiguration point;
      point.index = plan.sweep.rows.size();
      point.config = incumbent;
      for (const auto& k : plan.sweep.keys) point.values.emplace_back(k, find_field(k)->get(incumbent));
      plan.sweep.rows.push_back(evaluate_configuration(predictor, point, scenario.constraints));
      rank_rows(plan.sweep);
      plan.incumbent = point.index;
    }
  }

  std::vector<bool> own_row(plan.sweep.rows.size(), true);
  if (!plan.setup_keys.empty()) {
    if (own_setup_swept)  // else the file's setup is not searched: choose among all
      for (std::size_t i = 0; i < plan.sweep.rows.size(); ++i) own_row[i] = is_own(plan.sweep.rows[i]);
    for (const auto& g : setup_groups(plan.sweep)) {
      SetupOption o{g.values, g.best, g.rows.size(), own_setup_swept && !g.rows.empty() && own_row[g.rows.front()]};
      plan.setups.push_back(std::move(o));
    }
    std::stable_partition(plan.setups.begin(), plan.setups.end(), [](const SetupOption& o) { return o.own; });
  }

  std::vector<std::size_t> ranked;  // the own setup's feasible rows, fastest first
  for (std::size_t i : plan.sweep.ranking)
    if (own_row[i]) ranked.push_back(i);
  if (!ranked.empty()) {
    plan.fastest = ranked.front();
    const SweepRow& fastest = plan.sweep.rows[*plan.fastest];
    const double best = fastest.metrics.tokens_per_s;
    const SweepRow* inc = plan.incumbent ? &plan.sweep.rows[*plan.incumbent] : nullptr;
    if (inc && inc->feasible() && best <= inc->metrics.tokens_per_s * (1 + plan.margin)) {
      plan.chosen = plan.incumbent;
      plan.choice = *plan.chosen == *plan.fastest ? "fastest" : "kept";
    } else {
      // Among the near-ties of the fastest: one that leaves the GPU's unmodelled share free
      // (kUnmodelledMemoryGib) where any does, unless the file states its own margin
      // (constraints: min_memory_headroom_gib); then the simplest layout; then the fastest.
      const bool own_margin = scenario.constraints.min_memory_headroom_gib.has_value();
      auto short_of_room = [&](const SweepRow& r) {
        return !own_margin && bytes_to_gib(r.metrics.headroom_bytes()) < kUnmodelledMemoryGib;
      };
      auto order = [&](std::size_t i) {
        const SweepRow& r = plan.sweep.rows[i];
        return std::pair(short_of_room(r), layout_complexity(r.point.config));
      };
      std::size_t pick = *plan.fastest;
      for (std::size_t i : ranked) {
        const SweepRow& r = plan.sweep.rows[i];
        if (r.metrics.tokens_per_s * (1 + plan.margin) < best) break;
        if (order(i) < order(pick)) pick = i;
      }
      plan.chosen = pick;
      plan.choice = pick == *plan.fastest                                               ? "fastest"
                    : short_of_room(fastest) && !short_of_room(plan.sweep.rows[pick]) ? "headroom"
                                                                                        : "simpler";
    }
    const SweepRow& c = plan.sweep.rows[*plan.chosen];
    const double gap = best / c.metrics.tokens_per_s - 1;
    if (plan.incumbent && *plan.incumbent == *plan.fastest)
      plan.choice_reason = "your configuration is the best found";
    else if (plan.choice == "kept")
      plan.choice_reason = fmt::format(
          "your configuration is within {:.1f}% of the best found ({} tokens/s), inside the {:g}% margin that a "
          "change must beat (the model's own error, docs/sweep.md): kept",
          100 * gap, human_count(best), 100 * plan.margin);
    else {
      const std::string yours =
          !inc              ? std::string("your configuration's setup is not among the swept ones")
          : inc->feasible() ? fmt::format("your configuration is {:.1f}% below the best found (more than the {:g}% "
                                          "margin)",
                                          100 * (1 - inc->metrics.tokens_per_s / best), 100 * plan.margin)
                            : fmt::format("your configuration is not feasible ({})", sweep_status_name(inc->status));
      if (plan.choice == "simpler")
        plan.choice_reason = fmt::format(
            "the fastest found ({} tokens/s) is only {:.1f}% faster, inside the {:g}% margin: the simpler layout is "
            "chosen; {}",
            human_count(best), 100 * gap, 100 * plan.margin, yours);
      else if (plan.choice == "headroom")
        plan.choice_reason = fmt::format(
            "the fastest found ({} tokens/s, {:.1f}% faster, inside the {:g}% margin) leaves {:.1f} GiB free on its "
            "fullest GPU, less than the {:g} GiB the CUDA context, library workspaces and allocator typically take "
            "(not modelled); this one leaves {:.1f} GiB; {}",
            human_count(best), 100 * gap, 100 * plan.margin, bytes_to_gib(fastest.metrics.headroom_bytes()),
            kUnmodelledMemoryGib, bytes_to_gib(c.metrics.headroom_bytes()), yours);
      else
        plan.choice_reason = fmt::format("the best found; {}", yours);
    }
    for (std::size_t i : ranked)
      if (i != *plan.chosen && plan.runners_up.size() < options.runners_up) plan.runners_up.push_back(i);
    const ScenarioConfig& chosen = c.point.config;
    plan.steps = explain(scenario.config, plan.original, chosen, scenario.constraints);
    plan.fragment = scenario_fragment(scenario, chosen);
    plan.notes = fp8_notes(chosen, c, scenario.constraints);
  } else {
    plan.infeasible = diagnose_infeasible(plan.sweep, scenario.config);
  }
  return plan;
}

}  // namespace trainsim
