#include "sim/sweep/sweep.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include <sched.h>
#include <time.h>

#include <fmt/format.h>

#include "core/plan.h"
#include "core/units.h"
#include "sim/simulator.h"

namespace trainsim {

namespace {

constexpr const char* kDp = "parallelism.data_parallel_size";
constexpr const char* kPp = "parallelism.pipeline_parallel_size";
constexpr const char* kTp = "parallelism.tensor_parallel_size";

const FieldSpec& field(const std::string& path) {
  const FieldSpec* f = find_field(path);
  if (!f) throw std::logic_error("no field " + path);
  return *f;
}

}  // namespace

std::string config_fingerprint(const ScenarioConfig& c) {
  std::string s;
  for (const auto& f : scenario_fields()) {
    if (!f.get) continue;
    s += format_field_value(f.get(c));
    s += '\x1f';
  }
  return s;
}

bool is_setup_key(const std::string& path) { return path.rfind("cluster.", 0) == 0 || path.rfind("model.", 0) == 0; }

std::vector<std::int64_t> divisors(std::int64_t n) {
  std::vector<std::int64_t> small, large;
  for (std::int64_t i = 1; i * i <= n; ++i)
    if (n % i == 0) {
      small.push_back(i);
      if (i != n / i) large.push_back(n / i);
    }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

std::vector<ParallelLayout> auto_parallel_layouts(const ScenarioConfig& c) {
  std::vector<ParallelLayout> out;
  // The context-parallel size stays as written (or swept): the layouts share the other GPUs.
  const int cp = std::max(1, c.parallelism.context_parallel_size);
  if (c.cluster.num_gpus < 1 || c.cluster.num_gpus % cp != 0) return out;
  const int n = c.cluster.num_gpus / cp;
  const int heads = c.model.num_attention_heads;
  const int groups = c.model.num_query_groups > 0 ? c.model.num_query_groups : heads;
  for (std::int64_t t : divisors(n)) {
    if (t > c.cluster.gpus_per_node || heads % t != 0 || groups % t != 0) continue;
    for (std::int64_t p : divisors(n / t)) {
      if (p > c.model.num_layers) continue;
      out.push_back(ParallelLayout{static_cast<int>(n / t / p), static_cast<int>(p), static_cast<int>(t)});
    }
  }
  return out;
}

std::vector<std::int64_t> interleaving_depths(const ScenarioConfig& c) {
  const auto& p = c.parallelism;
  const std::int64_t stages = p.pipeline_parallel_size, layers = c.model.num_layers;
  if (p.schedule != ScheduleKind::interleaved_1f1b || stages < 2 || layers < 1) return {p.virtual_pipeline_stages};
  std::vector<std::int64_t> out;
  for (std::int64_t v : divisors((layers + stages - 1) / stages))
    if (v >= 2) out.push_back(v);
  if (out.empty()) out.push_back(p.virtual_pipeline_stages);  // a layer a stage: Plan says why not
  return out;
}

std::vector<std::string> sweep_keys(const Scenario& sc) {
  std::vector<std::string> keys;
  bool layout_swept = false, data_swept = false;
  for (const auto& a : sc.sweep) {
    if (a.kind == SweepAxisKind::auto_parallelism) {
      keys.insert(keys.end(), {kDp, kPp, kTp});
      data_swept = true;
    } else {
      keys.push_back(a.path);
      data_swept = data_swept || a.path == kDp;
      layout_swept = layout_swept || a.path == kPp || a.path == kTp || a.path == "cluster.num_gpus" ||
                     a.path == "parallelism.context_parallel_size";
    }
  }
  // A data-parallel size the file leaves to each configuration (derive_unwritten) moves with the
  // swept sizes: a column of its own.
  if (layout_swept && !data_swept && !sc.has_key(kDp)) keys.insert(keys.begin(), kDp);
  return keys;
}

std::vector<SweepConfiguration> expand_sweep(const Scenario& sc,
                                             const std::function<void(ScenarioConfig&)>& adjust) {
  // Presets first, then the file's own keys again, then the other axes: the loader's order,
  // so a swept GPU keeps the overrides the file wrote (num_gpus, memory_gib, ...).
  std::vector<const SweepAxis*> preset_axes, value_axes;
  bool auto_parallel = false, auto_micro = false, auto_virtual = false;
  for (const auto& a : sc.sweep) {
    if (a.kind == SweepAxisKind::auto_parallelism)
      auto_parallel = true;
    else if (a.kind == SweepAxisKind::auto_micro_batch_size)
      auto_micro = true;
    else if (a.kind == SweepAxisKind::auto_virtual_stages)
      auto_virtual = true;
    else if (field(a.path).applies_preset)
      preset_axes.push_back(&a);
    else
      value_axes.push_back(&a);
  }

  // Configurations as they are built (index and values set at the end, in place).
  std::vector<SweepConfiguration> cur(1);
  cur.front().config = sc.config;
  auto apply = [](SweepConfiguration& p, const FieldSpec& f, const FieldValue& v) {
    try {
      f.set(p.config, v);
    } catch (const std::invalid_argument& e) {
      if (p.error.empty()) p.error = fmt::format("{}: \"{}\": {}", f.path, format_field_value(v), e.what());
    }
  };
  auto product = [&](const SweepAxis& axis) {
    const FieldSpec& f = field(axis.path);
    std::vector<SweepConfiguration> next;
    next.reserve(cur.size() * axis.values.size());
    for (const auto& p : cur)
      for (const auto& v : axis.values) {
        SweepConfiguration q = p;
        apply(q, f, v);
        next.push_back(std::move(q));
      }
    cur = std::move(next);
  };
  for (const SweepAxis* a : preset_axes) product(*a);
  if (!preset_axes.empty()) {
    for (auto& p : cur)
      for (const auto& key : sc.explicit_keys) {
        const FieldSpec& f = field(key);
        if (f.applies_preset) continue;
        apply(p, f, f.get(sc.config));
      }
  }
  // The other axes: each configuration copied once from its preset stage's and every value
  // applied in axis order (first axis outermost), not copied again at every axis.
  if (!value_axes.empty()) {
    std::vector<const FieldSpec*> fields;
    std::size_t combos = 1;
    for (const SweepAxis* a : value_axes) {
      fields.push_back(&field(a->path));
      combos *= a->values.size();
    }
    std::vector<SweepConfiguration> next;
    next.reserve(cur.size() * combos);
    std::vector<std::size_t> at(value_axes.size());
    for (const auto& p : cur) {
      if (combos == 0) break;
      std::fill(at.begin(), at.end(), 0);
      for (std::size_t n = 0; n < combos; ++n) {
        SweepConfiguration& q = next.emplace_back(p);
        for (std::size_t k = 0; k < value_axes.size(); ++k) apply(q, *fields[k], value_axes[k]->values[at[k]]);
        for (std::size_t k = value_axes.size(); k-- > 0;) {  // the last axis turns fastest
          if (++at[k] < value_axes[k]->values.size()) break;
          at[k] = 0;
        }
      }
    }
    cur = std::move(next);
  }

  // What the file leaves to be derived follows each configuration's swept keys: the layout its
  // GPU count and pipeline and tensor sizes (`parallelism: auto` sets all three itself), the
  // loss scaling its compute format.
  auto written = [&](std::string_view key) {
    if (sc.has_key(std::string(key))) return true;
    if (auto_parallel && (key == kDp || key == kPp || key == kTp)) return true;
    return std::any_of(value_axes.begin(), value_axes.end(), [&](const SweepAxis* a) { return a->path == key; });
  };
  for (auto& p : cur) derive_unwritten(p.config, written);
  if (auto_parallel) {
    std::vector<SweepConfiguration> next;
    for (const auto& p : cur) {
      const auto layouts = auto_parallel_layouts(p.config);
      if (layouts.empty()) {  // nothing fits the rule: the configuration as written, invalid or not
        next.push_back(p);
        continue;
      }
      for (const auto& l : layouts) {
        SweepConfiguration q = p;
        q.config.parallelism.data_parallel_size = l.dp;
        q.config.parallelism.pipeline_parallel_size = l.pp;
        q.config.parallelism.tensor_parallel_size = l.tp;
        next.push_back(std::move(q));
      }
    }
    cur = std::move(next);
  }
  if (auto_virtual) {  // after the pipeline's size is known
    std::vector<SweepConfiguration> next;
    for (const auto& p : cur)
      for (std::int64_t v : interleaving_depths(p.config)) {
        SweepConfiguration q = p;
        q.config.parallelism.virtual_pipeline_stages = static_cast<int>(v);
        next.push_back(std::move(q));
      }
    cur = std::move(next);
  }
  if (auto_micro) {
    std::vector<SweepConfiguration> next;
    for (const auto& p : cur) {
      const std::int64_t gb = p.config.training.global_batch_size, d = p.config.parallelism.data_parallel_size;
      if (gb <= 0 || d <= 0 || gb % d != 0) {  // kept as written: Plan states why it cannot run
        next.push_back(p);
        continue;
      }
      for (std::int64_t b : divisors(gb / d)) {
        SweepConfiguration q = p;
        q.config.training.micro_batch_size = static_cast<int>(b);
        next.push_back(std::move(q));
      }
    }
    cur = std::move(next);
  }

  const std::vector<std::string> keys = sweep_keys(sc);
  std::vector<const FieldSpec*> key_fields;
  for (const auto& k : keys) key_fields.push_back(&field(k));
  // Kept configurations are compacted to the front of `cur`, in order.
  std::size_t kept = 0;
  // A configuration is dropped when an earlier one kept has the same fingerprint and error.
  // Those have the same swept values too, so only configurations whose swept values (and
  // error) collide need their fingerprints (every field formatted) compared.
  // Kept ones with the same values form a chain: the map gives its first and last, next_same
  // (per kept one) the one after it.
  constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::unordered_map<std::string, std::pair<std::size_t, std::size_t>> by_values;
  by_values.reserve(cur.size());
  std::vector<std::size_t> next_same;
  next_same.reserve(cur.size());
  std::vector<std::string> fingerprints;  // of kept ones, "" until needed
  fingerprints.reserve(cur.size());
  std::string bucket;
  for (auto& p : cur) {
    if (adjust) adjust(p.config);
    p.values.reserve(keys.size());
    for (std::size_t k = 0; k < keys.size(); ++k) p.values.emplace_back(keys[k], key_fields[k]->get(p.config));
    bucket.clear();
    for (const auto& [k, v] : p.values) {
      append_field_value(bucket, v);
      bucket += '\x1f';
    }
    bucket += p.error;
    const auto [chain, first_with_values] = by_values.try_emplace(bucket, kNone, kNone);
    if (!first_with_values) {
      const std::string mine = config_fingerprint(p.config) + p.error;
      bool duplicate = false;
      for (std::size_t j = chain->second.first; j != kNone; j = next_same[j]) {
        if (fingerprints[j].empty()) fingerprints[j] = config_fingerprint(cur[j].config) + cur[j].error;
        if (fingerprints[j] == mine) {
          duplicate = true;
          break;
        }
      }
      if (duplicate) continue;
      fingerprints.push_back(mine);
    } else {
      fingerprints.emplace_back();
    }
    next_same.push_back(kNone);
    if (first_with_values)
      chain->second.first = kept;
    else
      next_same[chain->second.second] = kept;
    chain->second.second = kept;
    p.index = kept;
    if (&p != &cur[kept]) cur[kept] = std::move(p);
    ++kept;
  }
  cur.erase(cur.begin() + static_cast<std::ptrdiff_t>(kept), cur.end());
  return cur;
}

std::string_view sweep_status_name(SweepStatus s) {
  switch (s) {
    case SweepStatus::ok: return "ok";
    case SweepStatus::out_of_memory: return "out_of_memory";
    case SweepStatus::invalid: return "invalid";
    case SweepStatus::unsupported_precision: return "unsupported_precision";
    case SweepStatus::constraint: return "constraint";
  }
  return "?";
}

namespace {

double rate_of(const ClusterConfig& cl, DType d) {
  auto it = cl.peak_tflops.find(d);
  return it == cl.peak_tflops.end() ? 0.0 : it->second;
}

// Why the GPU cannot run this configuration's formats; empty when it can.
std::string unsupported_precision(const ScenarioConfig& c) {
  const auto& cl = c.cluster;
  const bool bf16_allreduce = c.precision.allreduce == DType::bf16 && c.precision.compute != DType::bf16;
  const std::pair<const char*, DType> need[] = {{"precision.compute", c.precision.compute},
                                                {"precision.allreduce", DType::bf16}};
  for (const auto& [key, d] : std::span(need, bf16_allreduce ? 2 : 1)) {
    if (rate_of(cl, d) > 0) continue;
    std::vector<std::string> has;
    for (DType x : kAllDTypes)
      if (rate_of(cl, x) > 0) has.emplace_back(dtype_name(x));
    return fmt::format("{}: {} is not supported by GPU {} (cluster.peak_tflops.{} is 0); it has {}", key,
                       dtype_name(d), cl.gpu.empty() ? std::string("of this cluster") : cl.gpu, dtype_name(d),
                       has.empty() ? std::string("no format") : fmt::format("{}", fmt::join(has, ", ")));
  }
  return "";
}

struct Violation {
  std::string text;
  std::string key;     // the constraint (or "memory")
  double excess = 0;   // by how much, relative to the limit
};

std::vector<Violation> constraint_violations(const SweepConstraints& k, const Plan& plan, const SweepMetrics& m) {
  std::vector<Violation> v;
  const double cap = m.memory_capacity_bytes;
  // Out of memory already says more than these two.
  const bool oom = m.peak_memory_bytes > cap;
  if (!oom && k.max_memory_fraction < 1 && m.peak_memory_bytes > k.max_memory_fraction * cap)
    v.push_back({fmt::format("max_memory_fraction: peak {:.2f} GiB on rank {} > {:g} x {:.2f} GiB = {:.2f} GiB (by {:.2f} "
                             "GiB)",
                             bytes_to_gib(m.peak_memory_bytes), m.peak_memory_rank, k.max_memory_fraction,
                             bytes_to_gib(cap), bytes_to_gib(k.max_memory_fraction * cap),
                             bytes_to_gib(m.peak_memory_bytes - k.max_memory_fraction * cap)),
                 "max_memory_fraction", m.peak_memory_bytes / (k.max_memory_fraction * cap) - 1});
  if (!oom && k.min_memory_headroom_gib && bytes_to_gib(m.headroom_bytes()) < *k.min_memory_headroom_gib)
    v.push_back({fmt::format("min_memory_headroom_gib: {:.2f} GiB free on rank {} < {:g} GiB",
                             bytes_to_gib(m.headroom_bytes()), m.peak_memory_rank, *k.min_memory_headroom_gib),
                 "min_memory_headroom_gib",
                 (gib_to_bytes(*k.min_memory_headroom_gib) - m.headroom_bytes()) / std::max(cap, 1.0)});
  auto at_most = [&](const std::optional<std::int64_t>& lim, const char* key, const char* what, std::int64_t x) {
    if (lim && x > *lim)
      v.push_back({fmt::format("{}: {}({}) > {}", key, what, x, *lim), key,
                   static_cast<double>(x) / static_cast<double>(std::max<std::int64_t>(*lim, 1)) - 1});
  };
  auto at_least = [&](const std::optional<std::int64_t>& lim, const char* key, const char* what, std::int64_t x) {
    if (lim && x < *lim)
      v.push_back({fmt::format("{}: {}({}) < {}", key, what, x, *lim), key,
                   static_cast<double>(*lim) / static_cast<double>(std::max<std::int64_t>(x, 1)) - 1});
  };
  at_least(k.min_global_batch_size, "min_global_batch_size", "global_batch_size", plan.global_batch_size);
  at_most(k.max_global_batch_size, "max_global_batch_size", "global_batch_size", plan.global_batch_size);
  at_most(k.max_data_parallel_size, "max_data_parallel_size", "data_parallel_size", plan.dp);
  at_most(k.max_pipeline_parallel_size, "max_pipeline_parallel_size", "pipeline_parallel_size", plan.pp);
  at_most(k.max_tensor_parallel_size, "max_tensor_parallel_size", "tensor_parallel_size", plan.tp);
  at_most(k.max_micro_batch_size, "max_micro_batch_size", "micro_batch_size", plan.micro_batch_size);
  at_least(k.min_micro_batches, "min_micro_batches", "micro-batches per replica", plan.num_microbatches);
  return v;
}

}  // namespace

namespace {

// The checks before simulation: the row's verdict where they refuse it (nothing returned),
// else its plan.
std::optional<Plan> admit(SweepRow& row) {
  const SweepConfiguration& point = row.point;
  if (!point.error.empty()) {
    row.status = SweepStatus::invalid;
    row.reason = point.error;
    return std::nullopt;
  }
  if (std::string why = unsupported_precision(point.config); !why.empty()) {
    row.status = SweepStatus::unsupported_precision;
    row.reason = std::move(why);
    return std::nullopt;
  }
  std::optional<Plan> plan;
  try {
    plan = Plan::from_config(point.config);
  } catch (const ScenarioError& e) {
    row.status = SweepStatus::invalid;
    std::vector<std::string> parts;
    for (const auto& d : e.diagnostics())
      parts.push_back(d.key_path.empty() ? d.message : fmt::format("{}: {}", d.key_path, d.message));
    row.reason = fmt::format("{}", fmt::join(parts, "; "));
    return std::nullopt;
  }
  row.num_microbatches = plan->num_microbatches;
  row.global_batch_size = plan->global_batch_size;
  return plan;
}

// The row's metrics and verdict from its simulated Result.
void judge(SweepRow& row, const Plan& plan, const Result& r, const SweepConstraints& constraints) {
  SweepMetrics& m = row.metrics;
  m.step_time_s = r.step_time_s;
  m.tokens_per_s = r.tokens_per_s;
  m.mfu = r.mfu;
  m.tokens_per_s_per_gpu = r.tokens_per_s_per_gpu;
  m.model_tflops_per_gpu = r.model_tflops_per_gpu;
  m.hardware_tflops_per_gpu = r.hardware_tflops_per_gpu;
  m.time_to_train_s = r.time_to_train_s;
  m.gpu_hours = r.gpu_hours;
  m.cost = r.cost;
  m.bubble_fraction = r.bubble_fraction;
  m.pipeline_bubble_fraction = r.pipeline_bubble_fraction;
  m.exposed_comm_fraction = r.exposed_comm_fraction;
  m.allreduce_time_s = r.allreduce_time_s;
  m.exposed_comm_time_s = r.exposed_comm_time_s;
  m.memory_capacity_bytes = r.memory_capacity_bytes;
  m.stages.resize(static_cast<std::size_t>(plan.pp));
  for (int s = 0; s < plan.pp; ++s) m.stages[static_cast<std::size_t>(s)].stage = s;
  const RankResult* worst = nullptr;
  for (const auto& rr : r.ranks) {
    if (!worst || rr.peak_memory_bytes > worst->peak_memory_bytes) worst = &rr;
    if (rr.stage >= 0 && rr.stage < plan.pp) {
      auto& st = m.stages[static_cast<std::size_t>(rr.stage)];
      st.peak_bytes = std::max(st.peak_bytes, rr.peak_memory_bytes);
      st.activation_bytes = std::max(st.activation_bytes, rr.memory.activations);
    }
  }
  if (worst) {
    m.peak_memory_bytes = worst->peak_memory_bytes;
    m.peak_memory_rank = worst->rank;
  }
  row.warnings = r.warnings;
  row.simulated = true;
  std::vector<std::string> reasons;
  row.status = SweepStatus::ok;
  row.shortfall = 0;
  auto bind = [&](const std::string& key, double excess) {
    if (row.binding.empty() || excess > row.shortfall) {
      row.binding = key;
      row.shortfall = excess;
    }
  };
  if (worst && worst->peak_memory_bytes > m.memory_capacity_bytes) {
    row.status = SweepStatus::out_of_memory;
    reasons.push_back(fmt::format("out of memory on rank {} (stage {}, replica {}) by {:.2f} GiB: needs {:.2f} of "
                                  "{:.2f} GiB",
                                  worst->rank, worst->stage, worst->replica,
                                  bytes_to_gib(worst->peak_memory_bytes - m.memory_capacity_bytes),
                                  bytes_to_gib(worst->peak_memory_bytes), bytes_to_gib(m.memory_capacity_bytes)));
    bind("memory", worst->peak_memory_bytes / m.memory_capacity_bytes - 1);
  }
  for (auto& v : constraint_violations(constraints, plan, m)) {
    if (row.status == SweepStatus::ok) row.status = SweepStatus::constraint;
    reasons.push_back(std::move(v.text));
    bind(v.key, v.excess);
  }
  // The reasons joined by "; " (most rows have none or one).
  if (reasons.size() == 1) {
    row.reason = std::move(reasons.front());
  } else {
    row.reason.clear();
    for (std::size_t i = 0; i < reasons.size(); ++i) {
      if (i) row.reason += "; ";
      row.reason += reasons[i];
    }
  }
}

void simulation_failed(SweepRow& row, const std::exception& e) {
  row.status = SweepStatus::invalid;
  row.simulated = false;
  row.metrics = {};
  row.reason = fmt::format("the simulation failed: {}", e.what());
}

}  // namespace

SweepRow evaluate_configuration(Predictor& predictor, const SweepConfiguration& point,
                                const SweepConstraints& constraints) {
  return evaluate_configuration(predictor, SweepConfiguration(point), constraints);
}

SweepRow evaluate_configuration(Predictor& predictor, SweepConfiguration&& moved, const SweepConstraints& constraints) {
  SweepRow row(std::move(moved));
  const std::optional<Plan> plan = admit(row);
  if (!plan) return row;
  try {
    judge(row, *plan, predictor.evaluate(*plan), constraints);
  } catch (const std::exception& e) {
    simulation_failed(row, e);
  }
  return row;
}

void evaluate_rows(Predictor& predictor, SweepRow* rows, std::size_t n, const SweepConstraints& constraints) {
  constexpr int kBatch = Predictor::kMaxBatch;
  for (std::size_t i0 = 0; i0 < n; i0 += kBatch) {
    const int count = static_cast<int>(std::min<std::size_t>(kBatch, n - i0));
    std::array<std::optional<Plan>, kBatch> plans;
    std::array<const Plan*, kBatch> admitted{};
    std::array<SweepRow*, kBatch> admitted_rows{};
    int k = 0;
    for (int q = 0; q < count; ++q) {
      SweepRow& row = rows[i0 + q];
      plans[q] = admit(row);
      if (!plans[q]) continue;
      admitted[k] = &*plans[q];
      admitted_rows[k++] = &row;
    }
    std::array<const Result*, kBatch> results{};
    try {
      predictor.evaluate_batch(admitted.data(), k, results.data());
      for (int q = 0; q < k; ++q) judge(*admitted_rows[q], *admitted[q], *results[q], constraints);
    } catch (const std::exception&) {  // one of them failed: each on its own, to say which
      for (int q = 0; q < k; ++q)
        *admitted_rows[q] = evaluate_configuration(predictor, std::move(admitted_rows[q]->point), constraints);
    }
  }
}

std::vector<std::size_t> pareto_front(const std::vector<SweepRow>& rows) {
  std::vector<std::size_t> feasible;
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (rows[i].feasible()) feasible.push_back(i);
  std::sort(feasible.begin(), feasible.end(), [&](std::size_t a, std::size_t b) {
    const auto &x = rows[a].metrics, &y = rows[b].metrics;
    if (x.peak_memory_bytes != y.peak_memory_bytes) return x.peak_memory_bytes < y.peak_memory_bytes;
    if (x.tokens_per_s != y.tokens_per_s) return x.tokens_per_s > y.tokens_per_s;
    return a < b;
  });
  // Groups of equal peak memory, smallest first: a group's best points are on the front
  // when they beat every point with strictly less memory.
  std::vector<std::size_t> front;
  bool any = false;
  double best_below = 0;
  for (std::size_t i = 0; i < feasible.size();) {
    std::size_t j = i;
    const double peak = rows[feasible[i]].metrics.peak_memory_bytes;
    const double top = rows[feasible[i]].metrics.tokens_per_s;  // the group's best (sorted)
    while (j < feasible.size() && rows[feasible[j]].metrics.peak_memory_bytes == peak) ++j;
    if (!any || top > best_below)
      for (std::size_t k = i; k < j && rows[feasible[k]].metrics.tokens_per_s == top; ++k) front.push_back(feasible[k]);
    best_below = any ? std::max(best_below, top) : top;
    any = true;
    i = j;
  }
  return front;
}

namespace {

// Cores this process may run on (its affinity mask: `taskset -c 1 trainsim sweep` gets one
// worker, not one per core of the machine).
unsigned usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return static_cast<unsigned>(CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// CPU time of the whole process, every thread, in seconds.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// 12345 as "12,345".
std::string with_thousands(double x) {
  std::string digits = fmt::format("{:.0f}", x), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

std::string format_sweep_stats(const SweepStats& st, std::size_t configurations) {
  return fmt::format(
      "{} configurations: {} evaluated, {} rejected before simulation; evaluation {:.3f} s CPU ({:.3f} s wall, {} "
      "thread{}): {} evaluations per CPU-second; expansion {:.3f} s",
      configurations, st.evaluations, st.rejected, st.evaluate_cpu_s, st.evaluate_wall_s, st.threads,
      st.threads == 1 ? "" : "s", with_thousands(st.evaluations_per_cpu_s()), st.expand_s);
}

SweepResult run_configurations(std::vector<SweepConfiguration> points, const SweepConstraints& constraints,
                               std::vector<std::string> keys, const SweepOptions& options) {
  SweepResult res;
  res.keys = std::move(keys);
  const std::size_t n = points.size();
  // Each row takes its configuration over (no row is built empty first: an empty
  // configuration allocates its defaults).
  res.rows.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    points[i].index = i;
    res.rows.emplace_back(std::move(points[i]));
  }
  points.clear();

  unsigned threads = options.threads ? options.threads : usable_cores();
  threads = static_cast<unsigned>(std::min<std::size_t>(threads, std::max<std::size_t>(n, 1)));
  std::atomic<std::size_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
  auto worker = [&] {
    Predictor predictor;  // one per thread: its buffers are reused, nothing is shared
    // A few consecutive configurations at a time: a sweep's neighbours differ in prices, and
    // the Predictor steps those of one schedule together.
    constexpr std::size_t kChunk = Predictor::kMaxBatch;
    for (std::size_t i; (i = next.fetch_add(kChunk)) < n;) {
      const std::size_t count = std::min(kChunk, n - i);
      evaluate_rows(predictor, res.rows.data() + i, count, constraints);
      if (done.fetch_add(count) + count == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  };
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = process_cpu_seconds();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  if (threads == 1) {
    // One worker: this thread, which then reports progress between chunks (and allocates from
    // the memory expansion just gave back, not from a new thread's).
    Predictor predictor;
    double reported = 0;
    for (std::size_t i = 0; i < n; i += Predictor::kMaxBatch) {
      const std::size_t count = std::min<std::size_t>(Predictor::kMaxBatch, n - i);
      evaluate_rows(predictor, res.rows.data() + i, count, constraints);
      if (options.progress && i + count < n && elapsed() - reported >= 0.1) {
        reported = elapsed();
        options.progress(SweepProgress{i + count, n, reported});
      }
    }
  } else {
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) pool.emplace_back(worker);
    std::unique_lock<std::mutex> lock(mu);
    while (done.load() < n) {
      cv.wait_for(lock, std::chrono::milliseconds(100));
      if (options.progress && done.load() < n) options.progress(SweepProgress{done.load(), n, elapsed()});
    }
    lock.unlock();
    for (auto& t : pool) t.join();
  }
  res.stats.evaluate_cpu_s = process_cpu_seconds() - cpu_start;
  res.stats.evaluate_wall_s = elapsed();
  res.stats.threads = threads;
  if (options.progress) options.progress(SweepProgress{n, n, elapsed()});

  rank_rows(res);
  return res;
}

void rank_rows(SweepResult& res) {
  const std::size_t n = res.rows.size();
  res.counts = {};
  res.stats.evaluations = res.stats.rejected = 0;
  res.ranking.clear();
  for (std::size_t i = 0; i < n; ++i) {
    const SweepRow& r = res.rows[i];
    ++(r.simulated ? res.stats.evaluations : res.stats.rejected);
    ++res.counts.total;
    switch (r.status) {
      case SweepStatus::ok: ++res.counts.ok; res.ranking.push_back(i); break;
      case SweepStatus::out_of_memory: ++res.counts.out_of_memory; break;
      case SweepStatus::invalid: ++res.counts.invalid; break;
      case SweepStatus::unsupported_precision: ++res.counts.unsupported_precision; break;
      case SweepStatus::constraint: ++res.counts.constraint; break;
    }
  }
  const auto& rows = res.rows;
  std::sort(res.ranking.begin(), res.ranking.end(), [&](std::size_t a, std::size_t b) {
    const auto &x = rows[a].metrics, &y = rows[b].metrics;
    if (x.tokens_per_s != y.tokens_per_s) return x.tokens_per_s > y.tokens_per_s;
    if (x.peak_memory_bytes != y.peak_memory_bytes) return x.peak_memory_bytes < y.peak_memory_bytes;
    return a < b;
  });
  std::vector<std::size_t> simulated, other;
  for (std::size_t i = 0; i < n; ++i) {
    if (rows[i].feasible()) continue;
    (rows[i].simulated ? simulated : other).push_back(i);
  }
  // Near misses first: by how far the binding limit is exceeded, then tokens/s.
  std::sort(simulated.begin(), simulated.end(), [&](std::size_t a, std::size_t b) {
    if (rows[a].shortfall != rows[b].shortfall) return rows[a].shortfall < rows[b].shortfall;
    if (rows[a].metrics.tokens_per_s != rows[b].metrics.tokens_per_s)
      return rows[a].metrics.tokens_per_s > rows[b].metrics.tokens_per_s;
    return a < b;
  });
  res.order = res.ranking;
  res.order.insert(res.order.end(), simulated.begin(), simulated.end());
  res.order.insert(res.order.end(), other.begin(), other.end());
  res.pareto = pareto_front(res.rows);
}

std::vector<SetupGroup> setup_groups(const SweepResult& res) {
  std::vector<std::size_t> setup_columns;
  for (std::size_t k = 0; k < res.keys.size(); ++k)
    if (is_setup_key(res.keys[k])) setup_columns.push_back(k);
  std::vector<SetupGroup> groups;
  std::unordered_map<std::string, std::size_t> names;  // a group's setup values -> its index
  // A row's group: the one whose setup values read the same. A row with the same values as
  // the row before it (a sweep's neighbours mostly are) is in its group without reading them.
  std::vector<std::size_t> group_of(res.rows.size());
  std::string name;
  for (std::size_t i = 0; i < res.rows.size(); ++i) {
    const auto& values = res.rows[i].point.values;
    if (i > 0) {
      const auto& before = res.rows[i - 1].point.values;
      bool same = true;
      for (std::size_t k : setup_columns) {
        const bool has = k < values.size();
        if (has != (k < before.size()) || (has && !same_field_value(values[k].second, before[k].second))) {
          same = false;
          break;
        }
      }
      if (same) {
        group_of[i] = group_of[i - 1];
        groups[group_of[i]].rows.push_back(i);
        continue;
      }
    }
    name.clear();
    for (std::size_t k : setup_columns) {
      if (k >= values.size()) continue;
      append_field_value(name, values[k].second);
      name += '\x1f';
    }
    const auto [it, added] = names.try_emplace(name, groups.size());
    if (added) {
      std::vector<std::pair<std::string, FieldValue>> setup;
      for (std::size_t k : setup_columns)
        if (k < values.size()) setup.push_back(values[k]);
      groups.push_back(SetupGroup{std::move(setup), {}, std::nullopt});
    }
    group_of[i] = it->second;
    groups[group_of[i]].rows.push_back(i);
  }
  for (std::size_t i : res.ranking) {
    SetupGroup& g = groups[group_of[i]];
    if (!g.best) g.best = i;
  }
  return groups;
}

SweepResult run_sweep(const Scenario& scenario, const SweepOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  auto points = expand_sweep(scenario, options.adjust);
  const double expand_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  SweepResult res = run_configurations(std::move(points), scenario.constraints, sweep_keys(scenario), options);
  res.stats.expand_s = expand_s;
  return res;
}

}  // namespace trainsim
