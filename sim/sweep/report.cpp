#include "sim/sweep/report.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/model_shape.h"
#include "core/metrics.h"
#include "core/plan.h"
#include "core/report/format.h"
#include "core/report/svg_kit.h"
#include "core/units.h"

namespace trainsim {

namespace {

// The layers of each chunk as the configuration runs them (layers_per_virtual_stage_of),
// "7 + 14 x 8 + 7" where they differ, "" where the split is even.
std::string layers_text(const ScenarioConfig& c) {
  const std::vector<int> split = layers_per_virtual_stage_of(c);
  return is_even_split(split) ? "" : layer_split_text(split);
}

double r6(double x) { return round6(x); }
double gib(double bytes) { return round6(bytes_to_gib(bytes)); }

nlohmann::ordered_json value_json(const FieldValue& v) {
  nlohmann::ordered_json j;
  std::visit([&](const auto& x) { j = x; }, v);
  return j;
}

// Column names for the table: the usual abbreviations, else the key's last part.
std::string abbreviation(const std::string& key) {
  static const std::map<std::string, std::string> known = {
      {"parallelism.data_parallel_size", "dp"},        {"parallelism.pipeline_parallel_size", "pp"},
      {"parallelism.tensor_parallel_size", "tp"},      {"parallelism.virtual_pipeline_stages", "vpp"},
      {"parallelism.sequence_parallel", "sp"},         {"parallelism.zero_stage", "zero"},
      {"parallelism.context_parallel_size", "cp"},
      {"training.micro_batch_size", "mbs"},            {"training.global_batch_size", "gbs"},
      {"training.activation_recompute", "recompute"},  {"communication.overlap_grad_reduce", "overlap"},
      {"training.recompute_num_layers", "recompute_layers"},
      {"communication.bucket_size_mib", "bucket_mib"}, {"communication.allreduce_algorithm", "allreduce_alg"},
  };
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  const auto dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

std::string config_text(const SweepRow& row) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : row.point.values) parts.push_back(abbreviation(k) + "=" + format_field_value(v));
  return parts.empty() ? std::string("(as written)") : fmt::format("{}", fmt::join(parts, " "));
}

std::string counts_text(const SweepCounts& c) {
  std::vector<std::string> parts{fmt::format("{} feasible", c.ok)};
  if (c.out_of_memory) parts.push_back(fmt::format("{} out of memory", c.out_of_memory));
  if (c.constraint) parts.push_back(fmt::format("{} outside the constraints", c.constraint));
  if (c.invalid) parts.push_back(fmt::format("{} invalid", c.invalid));
  if (c.unsupported_precision) parts.push_back(fmt::format("{} with a precision the GPU lacks", c.unsupported_precision));
  return fmt::format("{} configuration{}: {}", c.total, c.total == 1 ? "" : "s", fmt::join(parts, ", "));
}

// s as one CSV field, appended: quoted when it holds a comma, a quote or a newline.
void append_csv_field(std::string& out, std::string_view s) {
  if (s.find_first_of(",\"\n") == std::string_view::npos) {
    out += s;
    return;
  }
  out += '"';
  for (std::size_t at = 0;;) {  // each quote doubled: the text up to and with it, then another
    const std::size_t quote = s.find('"', at);
    if (quote == std::string_view::npos) {
      out += s.substr(at);
      break;
    }
    out += s.substr(at, quote + 1 - at);
    out += '"';
    at = quote + 1;
  }
  out += '"';
}

nlohmann::ordered_json axes_json(const std::vector<SweepAxis>& axes) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& a : axes) {
    nlohmann::ordered_json j;
    j["key"] = a.path;
    if (a.generated()) {
      j["generated"] = "auto";
    } else {
      auto vs = nlohmann::ordered_json::array();
      for (const auto& v : a.values) vs.push_back(value_json(v));
      j["values"] = std::move(vs);
    }
    out.push_back(std::move(j));
  }
  return out;
}

nlohmann::ordered_json counts_json(const SweepCounts& c) {
  return {{"total", c.total},
          {"ok", c.ok},
          {"out_of_memory", c.out_of_memory},
          {"invalid", c.invalid},
          {"unsupported_precision", c.unsupported_precision},
          {"constraint", c.constraint}};
}

nlohmann::ordered_json constraints_json(const SweepConstraints& k) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& f : constraint_fields())
    if (auto v = f.get(k)) j[f.key] = value_json(*v);
  return j;
}

std::optional<std::size_t> rank_of(const SweepResult& s, std::size_t index) {
  auto it = std::find(s.ranking.begin(), s.ranking.end(), index);
  if (it == s.ranking.end()) return std::nullopt;
  return static_cast<std::size_t>(it - s.ranking.begin()) + 1;
}

bool on_front(const SweepResult& s, std::size_t index) {
  return std::find(s.pareto.begin(), s.pareto.end(), index) != s.pareto.end();
}


std::string setup_text(const std::vector<std::pair<std::string, FieldValue>>& values) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : values) parts.push_back(abbreviation(k) + " " + format_field_value(v));
  return parts.empty() ? std::string("(as written)") : fmt::format("{}", fmt::join(parts, ", "));
}

// The swept keys of `row` other than the setup keys, as "dp=2 pp=4 ...".
std::string choice_text(const SweepRow& row) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : row.point.values)
    if (!is_setup_key(k)) parts.push_back(abbreviation(k) + "=" + format_field_value(v));
  return parts.empty() ? std::string("(as written)") : fmt::format("{}", fmt::join(parts, " "));
}

std::string binding_text(const SweepRow& r) {
  if (r.binding.empty()) return std::string(sweep_status_name(r.status));
  if (r.binding == "memory")
    return fmt::format("memory, {:.1f}% over ({:.1f} of {:.1f} GiB)", 100 * r.shortfall,
                       bytes_to_gib(r.metrics.peak_memory_bytes), bytes_to_gib(r.metrics.memory_capacity_bytes));
  return fmt::format("{}, {:.1f}% over", r.binding, 100 * r.shortfall);
}

// "nothing fits": the smallest need, the model states' floor, the nearest misses and what would help.
std::string infeasible_text(const SweepResult& s, const Infeasibility& d, const ScenarioConfig& c) {
  std::string o;
  if (d.smallest) {
    const SweepRow& r = s.rows[*d.smallest];
    o += fmt::format("  the smallest need found: {:.1f} GiB per GPU against {:.1f} GiB ({})\n",
                     bytes_to_gib(r.metrics.peak_memory_bytes), bytes_to_gib(r.metrics.memory_capacity_bytes),
                     config_text(r));
  }
  o += fmt::format("  model states alone: {:g} bytes x {} parameters = {:.0f} GB; ZeRO-3 over every GPU needs at "
                   "least {} GPUs of {:.1f} GiB ({} here)\n",
                   d.model_state_bytes_per_param, human_count(ModelShape(c.model).total_params()),
                   d.model_state_bytes / 1e9, d.min_gpus_zero3, c.cluster.memory_gib, c.cluster.num_gpus);
  if (!d.near_misses.empty()) {
    o += "  nearest misses, and the limit that bound each:\n";
    for (std::size_t i : d.near_misses)
      o += fmt::format("    {}: {}\n", config_text(s.rows[i]), binding_text(s.rows[i]));
  }
  if (!d.suggestions.empty()) {
    o += "  what would make it fit:\n";
    for (const auto& x : d.suggestions) o += fmt::format("    - {}\n", x);
  }
  return o;
}

nlohmann::ordered_json infeasible_json(const SweepResult& s, const Infeasibility& d) {
  nlohmann::ordered_json j;
  j["smallest"] = d.smallest ? sweep_row_to_json(s.rows[*d.smallest], std::nullopt, false) : nlohmann::ordered_json();
  j["model_state_bytes_per_param"] = d.model_state_bytes_per_param;
  j["model_state_gib"] = gib(d.model_state_bytes);
  j["min_gpus_zero3"] = d.min_gpus_zero3;
  auto near = nlohmann::ordered_json::array();
  for (std::size_t i : d.near_misses) near.push_back(sweep_row_to_json(s.rows[i], std::nullopt, false));
  j["near_misses"] = std::move(near);
  j["suggestions"] = d.suggestions;
  return j;
}

}  // namespace

// ---- table ------------------------------------------------------------------------------

std::string format_sweep_table(const SweepResult& s, const std::string& title, std::size_t top,
                               std::size_t infeasible) {
  std::string o = fmt::format("{}\n  {}\n", title, counts_text(s.counts));
  // Columns: rank, then one per swept key, then the metrics.
  std::vector<std::string> head{"rank"};
  for (const auto& k : s.keys) head.push_back(abbreviation(k));
  const std::vector<std::string> metric_head{"microbatches", "tokens/s", "step time", "pp bubble", "exposed comm",
                                             "peak GiB", "headroom GiB"};
  head.insert(head.end(), metric_head.begin(), metric_head.end());
  std::vector<std::vector<std::string>> cells;
  const std::size_t shown = std::min(top, s.ranking.size());
  // A layers column where a shown row's pipeline splits its layers unevenly ("7 + 14 x 8 + 7").
  std::vector<std::string> splits(shown);
  for (std::size_t r = 0; r < shown; ++r) splits[r] = layers_text(s.rows[s.ranking[r]].point.config);
  const bool uneven = std::any_of(splits.begin(), splits.end(), [](const std::string& t) { return !t.empty(); });
  if (uneven) head.insert(head.begin() + 1 + static_cast<std::ptrdiff_t>(s.keys.size()), "layers");
  for (std::size_t r = 0; r < shown; ++r) {
    const SweepRow& row = s.rows[s.ranking[r]];
    std::vector<std::string> c{fmt::format("{}{}{}", r + 1, on_front(s, s.ranking[r]) ? "*" : "",
                                           precision_issues(row.point.config).empty() ? "" : "!")};
    for (const auto& [k, v] : row.point.values) c.push_back(format_field_value(v));
    if (uneven) c.push_back(splits[r].empty() ? "even" : splits[r]);
    const SweepMetrics& m = row.metrics;
    c.push_back(std::to_string(row.num_microbatches));
    c.push_back(human_count(m.tokens_per_s));
    c.push_back(format_seconds(m.step_time_s));
    c.push_back(fmt::format("{:.1f}%", 100 * m.pipeline_bubble_fraction));
    c.push_back(fmt::format("{:.1f}%", 100 * m.exposed_comm_fraction));
    c.push_back(fmt::format("{:.2f}", bytes_to_gib(m.peak_memory_bytes)));
    c.push_back(fmt::format("{:.2f}", bytes_to_gib(m.headroom_bytes())));
    cells.push_back(std::move(c));
  }
  if (shown > 0) {
    std::vector<std::size_t> width(head.size());
    for (std::size_t i = 0; i < head.size(); ++i) width[i] = head[i].size();
    for (const auto& c : cells)
      for (std::size_t i = 0; i < c.size(); ++i) width[i] = std::max(width[i], c[i].size());
    auto line = [&](const std::vector<std::string>& c) {
      std::string l = " ";
      for (std::size_t i = 0; i < c.size(); ++i) {
        l.append(1 + width[i] - c[i].size(), ' ');
        l.append(c[i]);
      }
      return l + "\n";
    };
    o += fmt::format("\nbest {} of {} feasible, by tokens/s (* on the Pareto front of tokens/s against peak memory per "
                     "GPU; ! a numerics risk, see trainsim plan; pp bubble and exposed comm: idle shares of the step):\n",
                     shown, s.ranking.size());
    o += line(head);
    for (const auto& c : cells) o += line(c);
  } else {
    o += "\nno configuration is feasible.\n";
  }
  const std::size_t bad = s.order.size() - s.ranking.size();
  if (bad > 0 && infeasible > 0) {
    const std::size_t n = std::min(infeasible, bad);
    o += fmt::format("\nnot feasible ({} of {}, nearest misses first{}):\n", n, bad,
                     n < bad ? "; --csv or --json list them all" : "");
    for (std::size_t i = 0; i < n; ++i) {
      const SweepRow& row = s.rows[s.order[s.ranking.size() + i]];
      o += fmt::format("  {}: {}: {}\n", config_text(row), sweep_status_name(row.status), row.reason);
    }
  }
  return o;
}

std::string format_sweep_notes(const SweepResult& s, const Scenario& sc) {
  std::string o;
  const std::vector<SetupGroup> groups = setup_groups(s);
  if (groups.size() > 1) {
    o += "\nbest configuration of each setup (the swept hardware and model keys), each searched on its own:\n";
    double first = 0;
    for (const auto& g : groups) {
      if (!g.best) {
        o += fmt::format("  {}: nothing feasible ({} configurations)\n", setup_text(g.values), g.rows.size());
        continue;
      }
      const SweepRow& b = s.rows[*g.best];
      if (first <= 0) first = b.metrics.tokens_per_s;
      o += fmt::format("  {}: {} tokens/s ({:.2f}x), {}, peak {:.1f} GiB\n", setup_text(g.values),
                       human_count(b.metrics.tokens_per_s), b.metrics.tokens_per_s / first, choice_text(b),
                       bytes_to_gib(b.metrics.peak_memory_bytes));
    }
  }
  if (const SweepRow* b = s.best()) {
    const auto issues = precision_issues(b->point.config);
    if (!issues.empty()) {
      std::vector<std::string> ids;
      for (const auto& i : issues) ids.push_back(i.id);
      o += fmt::format("\nnote: the fastest row has numerics risks ({}); `trainsim plan` applies its precision fixes "
                       "to every candidate before ranking, keeps the file's configuration unless a change gains more "
                       "than {:g}%, and chooses only for the file's own hardware, so its choice can differ from this "
                       "table's first row\n",
                       fmt::join(ids, ", "), 100 * kPlanMargin);
    } else if (groups.size() > 1) {
      o += fmt::format("\nnote: `trainsim plan` chooses only for the file's own setup and keeps the file's "
                       "configuration unless a change gains more than {:g}%\n",
                       100 * kPlanMargin);
    }
  } else {
    o += "\nnothing fits:\n" + infeasible_text(s, diagnose_infeasible(s, sc.config), sc.config);
  }
  return o;
}

// ---- JSON -------------------------------------------------------------------------------

nlohmann::ordered_json sweep_row_to_json(const SweepRow& row, std::optional<std::size_t> rank, bool pareto) {
  nlohmann::ordered_json j;
  j["rank"] = rank ? nlohmann::ordered_json(*rank) : nlohmann::ordered_json();
  j["index"] = row.point.index;
  nlohmann::ordered_json cfg = nlohmann::ordered_json::object();
  for (const auto& [k, v] : row.point.values) cfg[k] = value_json(v);
  j["config"] = std::move(cfg);
  // Each chunk's layers as the row runs them (written, even or balanced); null where none splits.
  const std::vector<int> layers = layers_per_virtual_stage_of(row.point.config);
  j["layers_per_stage"] = layers.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(layers);
  j["status"] = std::string(sweep_status_name(row.status));
  j["reason"] = row.reason;
  const SweepMetrics& m = row.metrics;
  auto metric = [&](const char* key, double v) { j[key] = row.simulated ? nlohmann::ordered_json(r6(v)) : nullptr; };
  metric("step_time_s", m.step_time_s);
  metric("tokens_per_s", m.tokens_per_s);
  metric("mfu", m.mfu);
  metric("tokens_per_s_per_gpu", m.tokens_per_s_per_gpu);
  metric("model_tflops_per_gpu", m.model_tflops_per_gpu);
  metric("hardware_tflops_per_gpu", m.hardware_tflops_per_gpu);
  metric("bubble_fraction", m.bubble_fraction);
  metric("pipeline_bubble_fraction", m.pipeline_bubble_fraction);
  metric("exposed_comm_fraction", m.exposed_comm_fraction);
  metric("allreduce_time_s", m.allreduce_time_s);
  metric("exposed_comm_time_s", m.exposed_comm_time_s);
  j["peak_memory_gib"] = row.simulated ? nlohmann::ordered_json(gib(m.peak_memory_bytes)) : nullptr;
  j["peak_memory_rank"] = row.simulated ? nlohmann::ordered_json(m.peak_memory_rank) : nullptr;
  j["memory_capacity_gib"] = gib(gib_to_bytes(row.point.config.cluster.memory_gib));
  j["headroom_gib"] = row.simulated ? nlohmann::ordered_json(gib(m.headroom_bytes())) : nullptr;
  j["num_microbatches"] = row.num_microbatches > 0 ? nlohmann::ordered_json(row.num_microbatches) : nullptr;
  j["global_batch_size"] = row.global_batch_size > 0 ? nlohmann::ordered_json(row.global_batch_size) : nullptr;
  auto given = [&](double v) { return row.simulated && v >= 0 ? nlohmann::ordered_json(r6(v)) : nlohmann::ordered_json(); };
  j["time_to_train_s"] = given(m.time_to_train_s);
  j["gpu_hours"] = given(m.gpu_hours);
  j["cost"] = given(m.cost);
  j["binding"] = row.binding.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(row.binding);
  j["shortfall"] = row.binding.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(r6(row.shortfall));
  j["pareto"] = pareto;
  j["warnings"] = row.warnings;
  return j;
}

nlohmann::ordered_json sweep_to_json(const SweepResult& s, const Scenario& sc) {
  nlohmann::ordered_json j;
  j["scenario"] = sc.file;
  j["name"] = sc.config.name;
  j["axes"] = axes_json(sc.sweep);
  j["constraints"] = constraints_json(sc.constraints);
  j["counts"] = counts_json(s.counts);
  j["best"] = s.ranking.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(s.ranking.front());
  j["pareto"] = s.pareto;
  auto setups = nlohmann::ordered_json::array();
  for (const auto& g : setup_groups(s)) {
    if (g.values.empty()) continue;
    nlohmann::ordered_json e;
    nlohmann::ordered_json v = nlohmann::ordered_json::object();
    for (const auto& [k, x] : g.values) v[k] = value_json(x);
    e["setup"] = std::move(v);
    e["best"] = g.best ? nlohmann::ordered_json(*g.best) : nlohmann::ordered_json();
    e["configurations"] = g.rows.size();
    setups.push_back(std::move(e));
  }
  j["setups"] = std::move(setups);
  j["infeasible"] = s.ranking.empty() ? infeasible_json(s, diagnose_infeasible(s, sc.config)) : nlohmann::ordered_json();
  auto rows = nlohmann::ordered_json::array();
  for (std::size_t i : s.order) rows.push_back(sweep_row_to_json(s.rows[i], rank_of(s, i), on_front(s, i)));
  j["rows"] = std::move(rows);
  return j;
}

// ---- CSV --------------------------------------------------------------------------------

void write_sweep_csv(const SweepResult& s, std::ostream& out) {
  std::vector<std::string> head{"rank", "index"};
  head.insert(head.end(), s.keys.begin(), s.keys.end());
  for (const char* h : {"status", "reason", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction",
                        "pipeline_bubble_fraction", "exposed_comm_fraction", "allreduce_time_s",
                        "exposed_comm_time_s", "peak_memory_gib", "peak_memory_rank", "memory_capacity_gib",
                        "headroom_gib", "num_microbatches", "global_batch_size", "pareto", "layers_per_stage"})
    head.emplace_back(h);
  // Every line into one buffer, written at the end; rank and Pareto membership by index.
  std::vector<std::size_t> rank(s.rows.size(), 0);
  for (std::size_t r = 0; r < s.ranking.size(); ++r) rank[s.ranking[r]] = r + 1;
  std::vector<char> front(s.rows.size(), 0);
  for (std::size_t i : s.pareto) front[i] = 1;
  std::string text, cell;
  text.reserve(256 * (s.order.size() + 1));
  for (std::size_t i = 0; i < head.size(); ++i) {
    if (i) text += ',';
    append_csv_field(text, head[i]);
  }
  text += '\n';
  auto integer = [&](std::size_t x) { fmt::format_to(std::back_inserter(text), "{}", x); };
  // Each column's cells by value, the last few values met (a column holds a handful).
  constexpr std::size_t kCellsPerColumn = 16;
  std::vector<std::vector<std::pair<FieldValue, std::string>>> cells(s.keys.size());
  for (std::size_t idx : s.order) {
    const SweepRow& row = s.rows[idx];
    if (rank[idx]) integer(rank[idx]);
    text += ',';
    integer(idx);
    for (std::size_t k = 0; k < row.point.values.size(); ++k) {
      const FieldValue& v = row.point.values[k].second;
      text += ',';
      auto* column = k < cells.size() ? &cells[k] : nullptr;
      const std::pair<FieldValue, std::string>* known = nullptr;
      if (column)
        for (const auto& c : *column)
          if (same_field_value(c.first, v)) {  // a column's cells hold distinct values: one matches
            known = &c;
            break;
          }
      if (known) {
        text += known->second;
        continue;
      }
      cell.clear();
      append_field_value(cell, v);
      const std::size_t at = text.size();
      append_csv_field(text, cell);
      if (column) {
        if (column->size() == kCellsPerColumn) column->erase(column->begin());
        column->emplace_back(v, text.substr(at));
      }
    }
    text += ',';
    text += sweep_status_name(row.status);
    text += ',';
    append_csv_field(text, row.reason);
    const SweepMetrics& m = row.metrics;
    auto num = [&](double v) {  // {:.6g}
      text += ',';
      if (row.simulated) append_general6(text, v);
    };
    num(m.step_time_s);
    num(m.tokens_per_s);
    num(m.mfu);
    num(m.bubble_fraction);
    num(m.pipeline_bubble_fraction);
    num(m.exposed_comm_fraction);
    num(m.allreduce_time_s);
    num(m.exposed_comm_time_s);
    num(bytes_to_gib(m.peak_memory_bytes));
    text += ',';
    if (row.simulated) fmt::format_to(std::back_inserter(text), "{}", m.peak_memory_rank);
    text += ',';
    append_general6(text, row.point.config.cluster.memory_gib);
    num(bytes_to_gib(m.headroom_bytes()));
    text += ',';
    if (row.num_microbatches > 0) fmt::format_to(std::back_inserter(text), "{}", row.num_microbatches);
    text += ',';
    if (row.global_batch_size > 0) fmt::format_to(std::back_inserter(text), "{}", row.global_batch_size);
    text += front[idx] ? ",true," : ",false,";
    // Each chunk's layers as the row runs them (written, even or balanced), "/"-joined; empty
    // where none splits.
    fmt::format_to(std::back_inserter(text), "{}\n", fmt::join(layers_per_virtual_stage_of(row.point.config), "/"));
  }
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

// ---- SVG --------------------------------------------------------------------------------

namespace {

// A "nice" tick step (1, 2 or 5 times a power of ten) for about `n` ticks over [0, max].
double tick_step(double max, int n) {
  if (max <= 0) return 1;
  const double raw = max / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

// The best point's marker: a five-pointed star of outer radius r, larger than a Pareto ring
// (6.5 px plus its 2 px stroke), so the ring of a best point on the front cannot hide it.
constexpr double kBestStarRadius = 11;
std::string star_path(double x, double y, double r) {
  std::string d;
  for (int k = 0; k < 10; ++k) {
    const double a = -M_PI / 2 + k * M_PI / 5, rr = k % 2 == 0 ? r : 0.45 * r;
    d += fmt::format("{}{:.1f},{:.1f}", k == 0 ? "M" : " L", x + rr * std::cos(a), y + rr * std::sin(a));
  }
  return d + " Z";
}

std::string tick_label(double v, double step) {
  const char* unit = "";
  double scale = 1;
  if (step >= 1e6) unit = "M", scale = 1e6;
  else if (step >= 1e3) unit = "K", scale = 1e3;
  if (v == 0) return "0";
  const double x = v / scale, st = step / scale;
  const int decimals = st >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(st) - 1e-9));
  return fmt::format("{:.{}f}{}", x, decimals, unit);
}

}  // namespace

void write_sweep_svg(const SweepResult& s, const Scenario& sc, std::ostream& out) {
  constexpr double W = 960, H = 600, left = 90, right = 250, top = 60, bottom = 70;
  const double pw = W - left - right, ph = H - top - bottom;
  const double cap_gib = sc.config.cluster.memory_gib;
  // Capacity of the rows themselves (a swept GPU changes it); the scenario's for the line.
  double max_feasible_gib = 0, max_gib = 0, max_tps = 0;
  std::size_t simulated = 0;
  for (const auto& r : s.rows) {
    if (!r.simulated) continue;
    ++simulated;
    const double g = bytes_to_gib(r.metrics.peak_memory_bytes);
    max_gib = std::max(max_gib, g);
    if (r.feasible()) max_feasible_gib = std::max(max_feasible_gib, g);
    max_tps = std::max(max_tps, r.metrics.tokens_per_s);
  }
  // Out-of-memory points far to the right would squeeze the rest: beyond twice the
  // capacity they are drawn at the edge as arrows.
  const double x_max_data = std::max({max_feasible_gib, std::min(max_gib, 2 * cap_gib), cap_gib});
  const double x_step = tick_step(x_max_data * 1.05, 8);
  const double x_max = std::ceil(x_max_data * 1.05 / x_step) * x_step;
  const double y_step = tick_step(std::max(max_tps, 1.0) * 1.08, 6);
  const double y_max = std::ceil(std::max(max_tps, 1.0) * 1.08 / y_step) * y_step;
  auto X = [&](double g) { return left + pw * std::min(g, x_max) / x_max; };
  auto Y = [&](double t) { return top + ph * (1 - t / y_max); };

  out << svg::open(W, H, true, " font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\"");
  out << fmt::format("<rect width=\"{:.0f}\" height=\"{:.0f}\" fill=\"white\"/>\n", W, H);
  const std::string name = sc.config.name.empty() ? sc.file : sc.config.name;
  out << fmt::format("<text x=\"{:.0f}\" y=\"26\" font-size=\"16\" font-weight=\"bold\">{}</text>\n", left,
                     svg::escape("sweep of " + name + ": throughput against peak memory per GPU"));
  out << fmt::format("<text x=\"{:.0f}\" y=\"44\" fill=\"#555\">{}</text>\n", left, svg::escape(counts_text(s.counts)));

  // Memory beyond the GPU: shaded.
  out << fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"#fdecea\"/>\n", X(cap_gib),
                     top, std::max(0.0, left + pw - X(cap_gib)), ph);
  // Grid and ticks.
  for (double v = 0; v <= x_max + 1e-9; v += x_step) {
    out << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#eee\"/>\n", X(v), top,
                       top + ph);
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"#333\">{}</text>\n", X(v),
                       top + ph + 16, tick_label(v, x_step));
  }
  for (double v = 0; v <= y_max + 1e-9; v += y_step) {
    out << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"#eee\"/>\n", left,
                       Y(v), left + pw);
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\" fill=\"#333\">{}</text>\n", left - 6,
                       Y(v) + 4, tick_label(v, y_step));
  }
  out << fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" stroke=\"#888\"/>\n",
                     left, top, pw, ph);
  out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">peak memory per GPU (GiB)</text>\n",
                     left + pw / 2, H - 24);
  out << fmt::format("<text transform=\"translate(22,{:.1f}) rotate(-90)\" text-anchor=\"middle\">throughput "
                     "(tokens/s)</text>\n",
                     top + ph / 2);

  // Memory limits.
  out << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#c62828\" "
                     "stroke-width=\"1.5\" stroke-dasharray=\"6,4\"/>\n",
                     X(cap_gib), top, top + ph);
  out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#c62828\">GPU memory {:g} GiB</text>\n", X(cap_gib) + 4,
                     top + 14, cap_gib);
  const double frac = sc.constraints.max_memory_fraction;
  if (frac < 1) {
    out << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#ef6c00\" "
                       "stroke-width=\"1.5\" stroke-dasharray=\"2,3\"/>\n",
                       X(frac * cap_gib), top, top + ph);
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#ef6c00\" text-anchor=\"end\">limit {:g} x</text>\n",
                       X(frac * cap_gib) - 4, top + 14, frac);
  }

  if (sc.constraints.min_memory_headroom_gib && *sc.constraints.min_memory_headroom_gib > 0) {
    const double at = X(std::max(0.0, cap_gib - *sc.constraints.min_memory_headroom_gib));
    out << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#ef6c00\" "
                       "stroke-width=\"1.5\" stroke-dasharray=\"2,3\"/>\n",
                       at, top, top + ph);
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#ef6c00\" text-anchor=\"end\">{:g} GiB headroom</text>\n",
                       at - 4, top + 30, *sc.constraints.min_memory_headroom_gib);
  }

  // Points, in index order: infeasible first so feasible ones stay on top.
  auto tooltip = [&](const SweepRow& r) {
    std::string t = fmt::format(
        "#{} {}\ntokens/s {}, step {}, pipeline bubble {:.1f}%, exposed comm {:.1f}%\npeak {:.2f} GiB (rank {})",
        r.point.index, config_text(r), human_count(r.metrics.tokens_per_s), format_seconds(r.metrics.step_time_s),
        100 * r.metrics.pipeline_bubble_fraction, 100 * r.metrics.exposed_comm_fraction,
        bytes_to_gib(r.metrics.peak_memory_bytes), r.metrics.peak_memory_rank);
    if (!r.reason.empty()) t += "\n" + std::string(sweep_status_name(r.status)) + ": " + r.reason;
    return "<title>" + svg::escape(t) + "</title>";
  };
  for (const auto& r : s.rows) {
    if (!r.simulated || r.feasible()) continue;
    const double g = bytes_to_gib(r.metrics.peak_memory_bytes);
    const double x = X(g), y = Y(r.metrics.tokens_per_s);
    if (r.status == SweepStatus::out_of_memory) {
      if (g > x_max)  // beyond the axis: an arrow at the edge
        out << fmt::format("<g class=\"pt\" data-i=\"{}\">{}<path d=\"M{:.1f},{:.1f} l-8,-4 v8 z\" fill=\"#c62828\" "
                           "opacity=\"0.7\"/></g>\n",
                           r.point.index, tooltip(r), x, y);
      else
        out << fmt::format("<g class=\"pt\" data-i=\"{4}\">{0}<path d=\"M{1:.1f},{2:.1f} l8,8 M{3:.1f},{2:.1f} l-8,8\" "
                           "stroke=\"#c62828\" stroke-width=\"1.6\" opacity=\"0.75\"/></g>\n",
                           tooltip(r), x - 4, y - 4, x + 4, r.point.index);
    } else {
      out << fmt::format("<circle class=\"pt\" data-i=\"{}\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4.5\" fill=\"none\" "
                         "stroke=\"#ef6c00\" stroke-width=\"1.6\">{}</circle>\n",
                         r.point.index, x, y, tooltip(r));
    }
  }
  for (const auto& r : s.rows) {
    if (!r.feasible()) continue;
    out << fmt::format("<circle class=\"pt\" data-i=\"{}\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"#1565c0\" "
                       "fill-opacity=\"0.55\">{}</circle>\n",
                       r.point.index, X(bytes_to_gib(r.metrics.peak_memory_bytes)), Y(r.metrics.tokens_per_s),
                       tooltip(r));
  }
  // Pareto front: a staircase (more memory buys more throughput), its points ringed.
  if (!s.pareto.empty()) {
    std::string d;
    for (std::size_t i = 0; i < s.pareto.size(); ++i) {
      const auto& m = s.rows[s.pareto[i]].metrics;
      const double x = X(bytes_to_gib(m.peak_memory_bytes)), y = Y(m.tokens_per_s);
      d += i == 0 ? fmt::format("M{:.1f},{:.1f}", x, y) : fmt::format(" H{:.1f} V{:.1f}", x, y);
    }
    out << fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"#2e7d32\" stroke-width=\"2\"/>\n", d);
    for (std::size_t i : s.pareto) {
      if (!s.ranking.empty() && i == s.ranking.front()) continue;  // the best point's star stands there instead
      const auto& m = s.rows[i].metrics;
      out << fmt::format("<circle class=\"pt\" data-i=\"{}\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"6.5\" fill=\"none\" "
                         "stroke=\"#2e7d32\" stroke-width=\"2\">{}</circle>\n",
                         i, X(bytes_to_gib(m.peak_memory_bytes)), Y(m.tokens_per_s), tooltip(s.rows[i]));
    }
  }
  // The best point, last so that nothing covers it: a star larger than the Pareto rings,
  // outlined in white so it stands out from the points under it.
  if (const SweepRow* b = s.best()) {
    const double x = X(bytes_to_gib(b->metrics.peak_memory_bytes)), y = Y(b->metrics.tokens_per_s);
    out << fmt::format("<path id=\"best\" class=\"pt\" data-i=\"{}\" d=\"{}\" fill=\"#f9a825\" stroke=\"#ffffff\" "
                       "stroke-width=\"1.5\" paint-order=\"stroke\">{}</path>\n",
                       b->point.index, star_path(x, y, kBestStarRadius), tooltip(*b));
    out << fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"#6d4c00\" stroke-width=\"0.8\" "
                       "pointer-events=\"none\"/>\n",
                       star_path(x, y, kBestStarRadius));
  }

  // Legend.
  const double lx = left + pw + 24;
  double ly = top + 10;
  auto legend_text = [&](const std::string& t) {
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", lx + 20, ly + 4, svg::escape(t));
    ly += 24;
  };
  out << fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"#1565c0\" fill-opacity=\"0.55\"/>\n", lx + 6, ly);
  legend_text(fmt::format("feasible ({})", s.counts.ok));
  out << fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"6.5\" fill=\"none\" stroke=\"#2e7d32\" stroke-width=\"2\"/>\n",
                     lx + 6, ly);
  legend_text(fmt::format("Pareto front ({})", s.pareto.size()));
  out << fmt::format("<path d=\"{}\" fill=\"#f9a825\" stroke=\"#6d4c00\" stroke-width=\"0.8\"/>\n",
                     star_path(lx + 6, ly, 8));
  legend_text("best (max tokens/s)");
  out << fmt::format("<path d=\"M{0:.1f},{1:.1f} l8,8 M{2:.1f},{1:.1f} l-8,8\" stroke=\"#c62828\" stroke-width=\"1.6\"/>\n",
                     lx + 2, ly - 4, lx + 10);
  legend_text(fmt::format("out of memory ({})", s.counts.out_of_memory));
  out << fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4.5\" fill=\"none\" stroke=\"#ef6c00\" stroke-width=\"1.6\"/>\n",
                     lx + 6, ly);
  legend_text(fmt::format("outside constraints ({})", s.counts.constraint));
  ly += 6;
  const std::size_t hidden = s.counts.total - simulated;
  if (hidden > 0) {
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#555\">not drawn: {} invalid,</text>\n", lx, ly,
                       s.counts.invalid);
    ly += 16;
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#555\">{} unsupported precision</text>\n", lx, ly,
                       s.counts.unsupported_precision);
    ly += 16;
  }
  out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#555\">hover a point for its</text>\n", lx, ly + 6);
  out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#555\">configuration and figures</text>\n", lx, ly + 22);
  ly += 58;
  // The best configuration, spelled out beside the plot rather than over the points.
  if (const SweepRow* b = s.best()) {
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-weight=\"bold\">best: {} tokens/s</text>\n", lx, ly,
                       human_count(b->metrics.tokens_per_s));
    ly += 16;
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#333\">peak {:.1f} GiB, pipeline bubble {:.1f}%</text>\n",
                       lx, ly, bytes_to_gib(b->metrics.peak_memory_bytes), 100 * b->metrics.pipeline_bubble_fraction);
    for (const auto& [k, v] : b->point.values) {
      ly += 15;
      out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#333\">{} = {}</text>\n", lx + 8, ly,
                         svg::escape(abbreviation(k)), svg::escape(format_field_value(v)));
    }
  }
  out << svg::kClose;
}

void write_sweep_html(const SweepResult& s, const Scenario& sc, std::ostream& out) {
  std::ostringstream svg_out;
  write_sweep_svg(s, sc, svg_out);
  // The page's own hover box replaces the SVG's <title> tooltips (a browser would show both).
  std::string svg = svg_out.str();
  for (auto at = svg.find("<title>"); at != std::string::npos; at = svg.find("<title>", at)) {
    const auto end = svg.find("</title>", at);
    if (end == std::string::npos) break;
    svg.erase(at, end + 8 - at);
  }
  // One record per drawn point, keyed by its index: what the hover box shows.
  nlohmann::ordered_json rows = nlohmann::ordered_json::object();
  for (const auto& r : s.rows) {
    if (!r.simulated) continue;
    nlohmann::ordered_json e;
    nlohmann::ordered_json cfg = nlohmann::ordered_json::object();
    for (const auto& [k, v] : r.point.values) cfg[k] = value_json(v);
    e["config"] = std::move(cfg);
    e["status"] = std::string(sweep_status_name(r.status));
    e["reason"] = r.reason;
    e["rank"] = rank_of(s, r.point.index) ? nlohmann::ordered_json(*rank_of(s, r.point.index)) : nlohmann::ordered_json();
    e["tokens_per_s"] = human_count(r.metrics.tokens_per_s);
    e["step"] = format_seconds(r.metrics.step_time_s);
    e["pipeline_bubble"] = fmt::format("{:.1f}%", 100 * r.metrics.pipeline_bubble_fraction);
    e["exposed_comm"] = fmt::format("{:.1f}%", 100 * r.metrics.exposed_comm_fraction);
    e["peak_gib"] = fmt::format("{:.2f} of {:.2f}", bytes_to_gib(r.metrics.peak_memory_bytes),
                                bytes_to_gib(r.metrics.memory_capacity_bytes));
    e["mfu"] = fmt::format("{:.1f}%", 100 * r.metrics.mfu);
    rows[std::to_string(r.point.index)] = std::move(e);
  }
  std::string data = rows.dump();
  // Inside <script>, "</" must not appear.
  for (std::size_t at = data.find("</"); at != std::string::npos; at = data.find("</", at + 2)) data.replace(at, 2, "<\\/");
  const std::string name = sc.config.name.empty() ? sc.file : sc.config.name;
  out << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>" << svg::escape("sweep of " + name)
      << "</title>\n<style>\nbody{font-family:Helvetica,Arial,sans-serif;margin:16px}\n"
         "#tip{position:fixed;display:none;background:#fff;border:1px solid #888;border-radius:4px;padding:6px 9px;"
         "font-size:12px;box-shadow:0 2px 6px rgba(0,0,0,.25);pointer-events:none;max-width:420px}\n"
         "#tip table{border-collapse:collapse}#tip td{padding:0 6px 0 0;vertical-align:top}\n"
         ".pt{cursor:pointer}.pt:hover{stroke:#000;stroke-width:2.5}\n"
         "</style></head>\n<body>\n";
  out << svg;
  out << "<div id=\"tip\"></div>\n<p style=\"color:#555;font-size:12px\">Hover a point for its configuration and "
         "figures.</p>\n<script>\nconst rows = "
      << data << ";\n"
      << R"JS(const tip = document.getElementById('tip');
function esc(t) { return String(t).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c])); }
document.querySelectorAll('.pt').forEach(el => {
  el.addEventListener('mousemove', ev => {
    const r = rows[el.dataset.i];
    if (!r) return;
    let h = '<b>#' + el.dataset.i + (r.rank ? ' (rank ' + r.rank + ')' : '') + ': ' + esc(r.status) + '</b><table>';
    for (const [k, v] of Object.entries(r.config)) h += '<tr><td>' + esc(k) + '</td><td>' + esc(v) + '</td></tr>';
    h += '<tr><td>tokens/s</td><td>' + r.tokens_per_s + '</td></tr><tr><td>step</td><td>' + r.step + '</td></tr>';
    h += '<tr><td>pipeline bubble</td><td>' + r.pipeline_bubble + '</td></tr><tr><td>exposed comm</td><td>' +
         r.exposed_comm + '</td></tr><tr><td>peak GiB</td><td>' + r.peak_gib + '</td></tr><tr><td>MFU</td><td>' +
         r.mfu + '</td></tr></table>';
    if (r.reason) h += '<div style="color:#a00">' + esc(r.reason) + '</div>';
    tip.innerHTML = h;
    tip.style.display = 'block';
    tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 440) + 'px';
    tip.style.top = (ev.clientY + 14) + 'px';
  });
  el.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
});
)JS"
      << "</script>\n</body></html>\n";
}

std::string format_progress(const SweepProgress& p, int bar_width) {
  const double f = p.total ? static_cast<double>(p.done) / static_cast<double>(p.total) : 1.0;
  const int full = static_cast<int>(f * bar_width);
  std::string bar(static_cast<std::size_t>(full), '#');
  bar += std::string(static_cast<std::size_t>(bar_width - full), '.');
  const double rate = p.elapsed_s > 0 ? static_cast<double>(p.done) / p.elapsed_s : 0;
  std::string left = "--";
  if (p.done >= p.total) left = "0 s";
  else if (rate > 0) {
    const double s = static_cast<double>(p.total - p.done) / rate;
    left = s >= 60 ? fmt::format("{}m{:02d}s", static_cast<int>(s) / 60, static_cast<int>(s) % 60)
                   : fmt::format("{:.0f} s", std::ceil(s));
  }
  return fmt::format("[{}] {:>{}}/{} configurations  {:.1f}/s  {} left", bar, p.done,
                     std::to_string(p.total).size(), p.total, rate, left);
}

// ---- plan -------------------------------------------------------------------------------

namespace {

std::string layout_text(const ScenarioConfig& c, int microbatches) {
  const auto& p = c.parallelism;
  const bool groups = p.schedule == ScheduleKind::interleaved_1f1b && p.microbatch_group_size > 0 &&
                     p.microbatch_group_size != p.pipeline_parallel_size;
  std::string s = fmt::format("{}{}, {}{}, ", parallel_sizes_text(p), uneven_layers_text(layers_per_virtual_stage_of(c)),
                              schedule_name(p.schedule),
                              groups ? fmt::format(" in groups of {} micro-batches", p.microbatch_group_size) : "");
  if (microbatches > 0)
    s += fmt::format("{} micro-batch{} of {}", microbatches, microbatches == 1 ? "" : "es", c.training.micro_batch_size);
  else s += fmt::format("micro-batch size {}", c.training.micro_batch_size);
  s += fmt::format(", recompute {}, ZeRO {}, overlap {}; {} compute", recompute_text(c.training),
                   p.zero_stage, c.communication.overlap_grad_reduce ? "on" : "off", dtype_name(c.precision.compute));
  return s;
}

std::string figures_text(const SweepRow& r) {
  if (!r.simulated) return fmt::format("{}: {}", sweep_status_name(r.status), r.reason);
  const SweepMetrics& m = r.metrics;
  std::string s = fmt::format(
      "tokens/s {}, step {}, pipeline bubble {:.1f}%, exposed comm {:.1f}% ({}), peak {:.1f} of {:.1f} GiB",
      human_count(m.tokens_per_s), format_seconds(m.step_time_s), 100 * m.pipeline_bubble_fraction,
      100 * m.exposed_comm_fraction, format_seconds(m.exposed_comm_time_s), bytes_to_gib(m.peak_memory_bytes),
      bytes_to_gib(m.memory_capacity_bytes));
  if (r.status != SweepStatus::ok) s += fmt::format(" -- {}: {}", sweep_status_name(r.status), r.reason);
  return s;
}

}  // namespace

std::string format_plan(const PlanResult& p) {
  const Scenario& sc = p.scenario;
  std::string o;
  o += fmt::format("plan for {}{}\n", sc.config.name.empty() ? std::string("scenario") : sc.config.name,
                   sc.file.empty() ? "" : fmt::format(" ({})", sc.file));
  o += fmt::format("  searched {}: {}\n",
                   p.default_space ? "the default space (no `sweep:` in the file; see docs/sweep.md)" : "the file's sweep",
                   counts_text(p.sweep.counts));
  if (!p.setups.empty())
    o += fmt::format("  setups compared (swept {}): each searched on its own; only the file's own is chosen from\n",
                     fmt::join(p.setup_keys, ", "));
  o += fmt::format("\n  as written  {}\n              {}\n", layout_text(sc.config, p.original.num_microbatches),
                   figures_text(p.original));
  if (!p.chosen) {
    o += "\nno configuration in the search space is feasible.\n";
    if (p.infeasible) o += infeasible_text(p.sweep, *p.infeasible, sc.config);
  } else {
    const SweepRow& c = p.sweep.rows[*p.chosen];
    o += fmt::format("  chosen      {}\n              {}\n", layout_text(c.point.config, c.num_microbatches),
                     figures_text(c));
    if (p.original.simulated && p.original.metrics.tokens_per_s > 0)
      o += fmt::format("              {:+.0f}% tokens/s against the configuration as written\n",
                       100 * (c.metrics.tokens_per_s / p.original.metrics.tokens_per_s - 1));
    o += fmt::format("              why: {}\n", p.choice_reason);
    const SweepMetrics& m = c.metrics;
    o += fmt::format("              per GPU: {} tokens/s, model {:.0f} TFLOP/s, hardware {:.0f} TFLOP/s (with "
                     "recompute), MFU {:.1f}%\n",
                     human_count(m.tokens_per_s_per_gpu), m.model_tflops_per_gpu, m.hardware_tflops_per_gpu,
                     100 * m.mfu);
    if (m.time_to_train_s >= 0)
      o += fmt::format("              whole run: {}, {} GPU-hours{}\n", format_duration(m.time_to_train_s),
                       human_count(m.gpu_hours),
                       m.cost >= 0 ? fmt::format(", cost {}", human_count(m.cost))
                                   : std::string(" (cluster.price_per_gpu_hour gives the cost)"));
    if (p.fastest && *p.fastest != *p.chosen) {
      const SweepRow& f = p.sweep.rows[*p.fastest];
      o += fmt::format("  fastest     {}\n              {}\n", layout_text(f.point.config, f.num_microbatches),
                       figures_text(f));
    }
    if (bytes_to_gib(c.metrics.headroom_bytes()) < kUnmodelledMemoryGib && !sc.constraints.min_memory_headroom_gib)
      o += fmt::format("              note: only {:.1f} GiB stays free on the fullest GPU; the CUDA context and the "
                       "allocator typically take 0.5-2 GiB (set constraints: min_memory_headroom_gib: {:g} to keep a "
                       "margin)\n",
                       bytes_to_gib(c.metrics.headroom_bytes()), kUnmodelledMemoryGib);
    if (p.steps.empty()) {
      o += "\nthe configuration as written is kept unchanged.\n";
    } else {
      o += "\nwhat changes, and what each change buys (predicted, applied in this order):\n";
      for (std::size_t i = 0; i < p.steps.size(); ++i)
        o += fmt::format("  {}. {}:\n     {}\n", i + 1, p.steps[i].change, p.steps[i].effect);
    }
  }
  if (!p.setups.empty()) {
    o += "\nsetups compared, each with its own best configuration (not a choice the plan makes):\n";
    double own = 0;
    for (const auto& su : p.setups)
      if (su.own && su.best) own = p.sweep.rows[*su.best].metrics.tokens_per_s;
    for (const auto& su : p.setups) {
      if (!su.best) {
        o += fmt::format("  {}{}: nothing feasible ({} configurations)\n", setup_text(su.values),
                         su.own ? " (yours)" : "", su.candidates);
        continue;
      }
      const SweepRow& b = p.sweep.rows[*su.best];
      o += fmt::format("  {}{}: {} tokens/s{}, {}, peak {:.1f} GiB\n", setup_text(su.values), su.own ? " (yours)" : "",
                       human_count(b.metrics.tokens_per_s),
                       own > 0 && !su.own ? fmt::format(" ({:.2f}x yours at its best)", b.metrics.tokens_per_s / own) : "",
                       choice_text(b), bytes_to_gib(b.metrics.peak_memory_bytes));
    }
  }
  if (p.chosen && (!p.precision.empty() || !p.setups.empty()))
    o += fmt::format("\n`trainsim sweep` ranks the same candidates as written{}{}, so its first row can differ "
                     "from this choice (`plan --keep-precision --margin 0` ranks as it does).\n",
                     p.precision.empty() ? "" : ", without the precision fixes",
                     p.setups.empty() ? "" : " and across every setup");
  if (!p.precision.empty()) {
    o += "\nprecision (each fix is part of the chosen configuration):\n";
    for (const auto& i : p.precision)
      o += fmt::format("  - {}\n    fix: {}\n    why: {}\n", i.problem, i.fix, i.why);
  } else {
    o += "\nprecision: no numerics risk found in the configuration as written.\n";
  }
  if (!p.runners_up.empty()) {
    o += "\nrunners-up:\n";
    const SweepRow& c = p.sweep.rows[*p.chosen];
    for (std::size_t k = 0; k < p.runners_up.size(); ++k) {
      const SweepRow& r = p.sweep.rows[p.runners_up[k]];
      std::vector<std::string> diff;
      for (std::size_t i = 0; i < r.point.values.size() && i < c.point.values.size(); ++i)
        if (format_field_value(r.point.values[i].second) != format_field_value(c.point.values[i].second))
          diff.push_back(fmt::format("{}={}", abbreviation(r.point.values[i].first),
                                     format_field_value(r.point.values[i].second)));
      o += fmt::format("  {}. {:+.2f}% tokens/s, peak {:.1f} GiB, pipeline bubble {:.1f}%: {}\n", k + 2,
                       100 * (r.metrics.tokens_per_s / c.metrics.tokens_per_s - 1),
                       bytes_to_gib(r.metrics.peak_memory_bytes), 100 * r.metrics.pipeline_bubble_fraction,
                       diff.empty() ? config_text(r) : fmt::format("{}", fmt::join(diff, " ")));
    }
  }
  for (const auto& n : p.notes) o += fmt::format("\n{}\n", n.text);
  if (p.chosen)
    o += "\nsave the chosen configuration: trainsim plan FILE --write-scenario chosen.yaml (then trainsim simulate "
         "chosen.yaml)\n";
  return o;
}

nlohmann::ordered_json plan_to_json(const PlanResult& p) {
  const Scenario& sc = p.scenario;
  nlohmann::ordered_json j;
  j["scenario"] = sc.file;
  j["name"] = sc.config.name;
  std::vector<SweepAxis> axes = sc.sweep;
  j["search_space"] = {{"default", p.default_space}};
  j["search_space"]["axes"] = axes_json(p.default_space ? default_search_space(sc.config) : sc.sweep);
  j["constraints"] = constraints_json(sc.constraints);
  j["counts"] = counts_json(p.sweep.counts);
  j["original"] = sweep_row_to_json(p.original, std::nullopt, false);
  if (p.chosen)
    j["chosen"] = sweep_row_to_json(p.sweep.rows[*p.chosen], 1, on_front(p.sweep, *p.chosen));
  else
    j["chosen"] = nullptr;
  auto ru = nlohmann::ordered_json::array();
  for (std::size_t i = 0; i < p.runners_up.size(); ++i)
    ru.push_back(sweep_row_to_json(p.sweep.rows[p.runners_up[i]], i + 2, on_front(p.sweep, p.runners_up[i])));
  j["runners_up"] = std::move(ru);
  j["margin"] = p.margin;
  j["choice"] = p.choice.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(p.choice);
  j["choice_reason"] = p.choice_reason;
  j["fastest"] = p.fastest ? sweep_row_to_json(p.sweep.rows[*p.fastest], rank_of(p.sweep, *p.fastest),
                                               on_front(p.sweep, *p.fastest))
                           : nlohmann::ordered_json();
  auto setups = nlohmann::ordered_json::array();
  for (const auto& su : p.setups) {
    nlohmann::ordered_json e;
    nlohmann::ordered_json v = nlohmann::ordered_json::object();
    for (const auto& [k, x] : su.values) v[k] = value_json(x);
    e["setup"] = std::move(v);
    e["own"] = su.own;
    e["configurations"] = su.candidates;
    e["best"] = su.best ? sweep_row_to_json(p.sweep.rows[*su.best], rank_of(p.sweep, *su.best),
                                            on_front(p.sweep, *su.best))
                        : nlohmann::ordered_json();
    setups.push_back(std::move(e));
  }
  j["setups"] = std::move(setups);
  auto notes = nlohmann::ordered_json::array();
  for (const auto& n : p.notes) notes.push_back({{"id", n.id}, {"text", n.text}});
  j["notes"] = std::move(notes);
  j["infeasible"] = p.infeasible ? infeasible_json(p.sweep, *p.infeasible) : nlohmann::ordered_json();
  auto steps = nlohmann::ordered_json::array();
  for (const auto& s : p.steps) {
    nlohmann::ordered_json e;
    e["keys"] = s.keys;
    e["change"] = s.change;
    e["effect"] = s.effect;
    e["before"] = sweep_row_to_json(s.before, std::nullopt, false);
    e["after"] = sweep_row_to_json(s.after, std::nullopt, false);
    steps.push_back(std::move(e));
  }
  j["changes"] = std::move(steps);
  auto adv = nlohmann::ordered_json::array();
  for (const auto& i : p.precision) {
    nlohmann::ordered_json e;
    e["id"] = i.id;
    e["problem"] = i.problem;
    e["fix"] = i.fix;
    e["why"] = i.why;
    nlohmann::ordered_json ch = nlohmann::ordered_json::object();
    for (const auto& [k, v] : i.changes) ch[k] = value_json(v);
    e["changes"] = std::move(ch);
    adv.push_back(std::move(e));
  }
  j["precision_advice"] = std::move(adv);
  j["scenario_fragment"] = p.chosen ? p.fragment : nlohmann::ordered_json();
  return j;
}

}  // namespace trainsim
