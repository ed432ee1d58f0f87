#include "validation/fidelity.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "core/config_fields.h"
#include "core/diagnostics.h"
#include "core/model_shape.h"
#include "core/plan.h"
#include "core/units.h"
#include "sim/cost/collective_model.h"
#include "sim/simulator.h"

namespace trainsim::validation {

namespace {

const std::set<std::string> kMetrics = {"tflops_per_gpu",        "tokens_per_s_per_gpu", "samples_per_s_per_gpu",
                                        "step_time_s",           "busbw_gbps",           "throughput_ratio"};

[[noreturn]] void fail(const std::string& file, const YAML::Node& at, const std::string& key, const std::string& msg) {
  SourceLocation where;
  if (at && !at.Mark().is_null()) where = {at.Mark().line + 1, at.Mark().column + 1};
  throw ScenarioError({Diagnostic{file, where, key, msg}});
}

template <class T>
T get(const std::string& file, const YAML::Node& map, const char* key, const std::string& section) {
  const YAML::Node v = map[key];
  if (!v) fail(file, map, section + "." + key, fmt::format("{} needs `{}`", section, key));
  try {
    return v.as<T>();
  } catch (const YAML::Exception&) {
    fail(file, v, section + "." + key, "not a valid value");
  }
}

std::string text_or(const YAML::Node& map, const char* key, const std::string& fallback = "") {
  const YAML::Node v = map[key];
  return v ? v.as<std::string>() : fallback;
}

void check_keys(const std::string& file, const YAML::Node& map, const std::string& section,
                std::initializer_list<const char*> allowed) {
  for (const auto& kv : map) {
    const std::string key = kv.first.as<std::string>();
    if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return key == a; }))
      fail(file, kv.first, section + "." + key,
           fmt::format("unknown key; {} accepts: {}", section, fmt::join(allowed, ", ")));
  }
}

// A scenario key's value from YAML, by the field table's kind.
FieldValue field_value(const std::string& file, const std::string& path, const YAML::Node& v) {
  const FieldSpec* spec = find_field(path);
  if (!spec) fail(file, v, path, "not a scenario key (see `trainsim fields`)");
  try {
    switch (spec->kind) {
      case FieldKind::integer: return FieldValue{v.as<std::int64_t>()};
      case FieldKind::real: return FieldValue{v.as<double>()};
      case FieldKind::boolean: return FieldValue{v.as<bool>()};
      case FieldKind::text:
      case FieldKind::choice: {
        const std::string s = v.as<std::string>();
        if (spec->kind == FieldKind::choice && std::find(spec->choices.begin(), spec->choices.end(), s) == spec->choices.end())
          fail(file, v, path, fmt::format("'{}' is not one of: {}", s, fmt::join(spec->choices, ", ")));
        return FieldValue{s};
      }
      case FieldKind::integer_list: return FieldValue{v.as<std::vector<std::int64_t>>()};
    }
  } catch (const YAML::Exception&) {
    fail(file, v, path, fmt::format("not a valid {}", field_kind_name(spec->kind)));
  }
  return {};
}

// The file's bytes; nothing when it cannot be opened.
std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// The `scenario:` section as the text of a scenario file: its lines, de-indented, after as many
// empty lines as precede it, so that line numbers in diagnostics are the file's own.
std::string scenario_text(const std::string& text, const YAML::Node& node) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  const int first = node.Mark().line, indent = node.Mark().column;
  std::string out;
  for (int i = 0; i < first && i < static_cast<int>(lines.size()); ++i) out += "\n";
  for (int i = first; i < static_cast<int>(lines.size()); ++i) {
    const std::string& l = lines[i];
    const auto nonblank = l.find_first_not_of(' ');
    if (nonblank == std::string::npos || l[nonblank] == '#') {
      out += "\n";
      continue;
    }
    if (static_cast<int>(nonblank) < indent) break;  // the next top-level key
    out += l.substr(indent) + "\n";
  }
  return out;
}

OpKind collective_kind(const std::string& op) {
  if (op == "reduce_scatter") return OpKind::ReduceScatter;
  if (op == "all_gather") return OpKind::AllGather;
  return OpKind::AllReduce;
}

double predicted_figure(const PublishedFile& f, const Plan& plan, double step_s) {
  const ModelShape m = plan.shape();
  const double gpus = plan.config.cluster.num_gpus;
  const double samples = plan.global_batch_size, tokens = samples * m.s;
  if (f.metric == "step_time_s") return step_s;
  if (f.metric == "samples_per_s_per_gpu" || f.metric == "throughput_ratio") return samples / step_s / gpus;
  if (f.metric == "tokens_per_s_per_gpu") return tokens / step_s / gpus;
  // tflops_per_gpu
  const double flops = f.flops == "palm" ? tokens * palm_flops_per_token(m) : megatron_flops_per_step(m, samples);
  return flops / step_s / gpus / 1e12;
}

}  // namespace

double palm_flops_per_token(const ModelShape& m) {
  const double n = m.total_params() - static_cast<double>(m.V) * m.h;  // without the input embedding
  return 6 * n + 12.0 * m.L * m.h * m.s;
}

double megatron_flops_per_step(const ModelShape& m, double batch) {
  const double s = m.s, l = m.L, h = m.h, V = m.V;
  return 96 * batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
}

std::optional<std::string> published_row_scenario_text(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return std::nullopt;
  const std::optional<std::string> text = read_text(path);
  if (!text) return std::nullopt;
  YAML::Node root;
  try {
    root = YAML::Load(*text);
  } catch (const YAML::Exception&) {
    return std::nullopt;
  }
  if (!root.IsMap() || !root["published"] || !root["scenario"] || !root["scenario"].IsMap()) return std::nullopt;
  return scenario_text(*text, root["scenario"]);
}

PublishedFile load_published_file(const std::string& path) {
  const std::optional<std::string> read = read_text(path);
  if (!read) throw ScenarioError({Diagnostic{path, {}, "", "cannot open the file"}});
  const std::string& text = *read;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    SourceLocation where;
    if (!e.mark.is_null()) where = {e.mark.line + 1, e.mark.column + 1};
    throw ScenarioError({Diagnostic{path, where, "", "YAML syntax: " + e.msg}});
  }
  if (!root.IsMap()) fail(path, root, "", "a published row is a map with `published:` and `scenario:`");
  check_keys(path, root, "the top level", {"published", "scenario"});
  const YAML::Node pub = root["published"], sc = root["scenario"];
  if (!pub || !pub.IsMap()) fail(path, root, "published", "needs a `published:` section");
  if (!sc || !sc.IsMap()) fail(path, root, "scenario", "needs a `scenario:` section (a scenario, indented)");
  check_keys(path, pub, "published",
             {"source", "citation", "label", "note", "metric", "flops", "value", "memory_gib", "collective", "baseline",
              "variants"});

  PublishedFile f;
  f.file = path;
  f.source = get<std::string>(path, pub, "source", "published");
  f.citation = get<std::string>(path, pub, "citation", "published");
  f.label = get<std::string>(path, pub, "label", "published");
  f.note = text_or(pub, "note");
  f.metric = get<std::string>(path, pub, "metric", "published");
  if (!kMetrics.count(f.metric))
    fail(path, pub["metric"], "published.metric",
         fmt::format("'{}' is not one of: {}", f.metric, fmt::join(kMetrics, ", ")));
  if (f.metric == "throughput_ratio") {
    const YAML::Node base = pub["baseline"], vars = pub["variants"];
    if (!base || !vars || !vars.IsSequence())
      fail(path, pub, "published", "a throughput_ratio row needs `baseline: {label, value}` and `variants:`");
    f.baseline_label = get<std::string>(path, base, "label", "published.baseline");
    f.value = get<double>(path, base, "value", "published.baseline");
    for (const YAML::Node& v : vars) {
      check_keys(path, v, "published.variants[]", {"label", "value", "set"});
      PublishedVariant pv;
      pv.label = get<std::string>(path, v, "label", "published.variants[]");
      pv.value = get<double>(path, v, "value", "published.variants[]");
      if (const YAML::Node set = v["set"])
        for (const auto& kv : set) pv.set.emplace_back(kv.first.as<std::string>(), YAML::Dump(kv.second));
      f.variants.push_back(std::move(pv));
    }
  } else {
    f.value = get<double>(path, pub, "value", "published");
  }
  if (pub["memory_gib"]) {
    if (f.metric == "busbw_gbps" || f.metric == "throughput_ratio")
      fail(path, pub["memory_gib"], "published.memory_gib", "a memory figure belongs to a row of one training run");
    f.memory_gib = get<double>(path, pub, "memory_gib", "published");
    if (!(f.memory_gib > 0)) fail(path, pub["memory_gib"], "published.memory_gib", "must be > 0 (GiB per GPU)");
  }
  if (f.metric == "tflops_per_gpu") {
    f.flops = get<std::string>(path, pub, "flops", "published");
    if (f.flops != "megatron" && f.flops != "palm")
      fail(path, pub["flops"], "published.flops", "one of: megatron, palm");
  }
  if (f.metric == "busbw_gbps") {
    const YAML::Node c = pub["collective"];
    if (!c) fail(path, pub, "published.collective", "a busbw_gbps row needs `collective: {op, bytes}`");
    check_keys(path, c, "published.collective", {"op", "bytes"});
    f.collective = get<std::string>(path, c, "op", "published.collective");
    if (f.collective != "all_reduce" && f.collective != "reduce_scatter" && f.collective != "all_gather")
      fail(path, c["op"], "published.collective.op", "one of: all_reduce, reduce_scatter, all_gather");
    f.bytes = get<double>(path, c, "bytes", "published.collective");
  }
  f.scenario = load_scenario_text(scenario_text(text, sc), path);
  // The variants' keys are checked now, not when the suite runs.
  for (const PublishedVariant& v : f.variants)
    for (const auto& [key, value] : v.set) field_value(path, key, YAML::Load(value));
  return f;
}

std::vector<PublishedFile> load_published(const std::string& folder) {
  std::vector<std::string> paths;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    const auto& p = entry.path();
    if (p.extension() == ".yaml" && p.filename() != "accepted.yaml") paths.push_back(p.string());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<PublishedFile> out;
  for (const auto& p : paths) out.push_back(load_published_file(p));
  return out;
}

void override_all(std::vector<PublishedFile>& files, const std::string& key, const std::string& value) {
  YAML::Node v;
  try {
    v = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw ScenarioError({Diagnostic{"--set", {}, key, "YAML syntax: " + e.msg}});
  }
  const FieldValue fv = field_value("--set", key, v);
  for (PublishedFile& f : files) find_field(key)->set(f.scenario.config, fv);
}

FidelityReport run_fidelity(const std::vector<PublishedFile>& files) {
  FidelityReport r;
  Predictor predictor;
  for (const PublishedFile& f : files) {
    const std::string stem = std::filesystem::path(f.file).stem().string();
    const Plan plan = Plan::from_scenario(f.scenario);
    FidelityRow row{stem, f.source, f.label, f.metric, f.citation, plan.config.cluster.num_gpus, f.value, 0, false, ""};
    row.time = f.metric == "step_time_s";
    if (f.metric == "busbw_gbps") {
      std::vector<int> members(plan.num_ranks());
      for (int i = 0; i < plan.num_ranks(); ++i) members[i] = i;
      const NetworkCollectiveModel model(plan);
      const OpKind kind = collective_kind(f.collective);
      const bool hier = plan.config.communication.allreduce_algorithm == AllReduceAlgorithm::hierarchical;
      const CollectiveCost c = nccl_collective(kind, model.shape_of(members), f.bytes, plan.config.cluster, hier);
      row.predicted = busbw(kind, plan.num_ranks(), f.bytes, c.seconds) / 1e9;
      row.detail = fmt::format("{} of {:.0f} MiB, {}", f.collective, f.bytes / 1048576.0, collective_algorithm_name(c.algorithm));
      r.rows.push_back(row);
      continue;
    }
    const Result base = predictor.evaluate(plan);
    const double base_s = base.step_time_s;
    if (f.metric != "throughput_ratio") {
      row.predicted = predicted_figure(f, plan, base_s);
      row.detail = fmt::format("step {:.3f} s", base_s);
      r.rows.push_back(row);
      if (f.memory_gib > 0) {
        FidelityRow mem = row;
        mem.id = stem + "@memory";
        mem.metric = "peak_memory_gib";
        mem.time = false;
        mem.published = f.memory_gib;
        double peak = 0;
        for (const RankResult& rank : base.ranks) peak = std::max(peak, rank.peak_memory_bytes);
        mem.predicted = peak / 1073741824.0;
        mem.detail = fmt::format("of {:.1f} GiB", plan.config.cluster.memory_gib);
        r.memory.push_back(mem);
      }
      continue;
    }
    for (const PublishedVariant& v : f.variants) {
      ScenarioConfig c = f.scenario.config;
      for (const auto& [key, value] : v.set) find_field(key)->set(c, field_value(f.file, key, YAML::Load(value)));
      const Plan vplan = Plan::from_config(c);
      const double vs = predictor.evaluate(vplan).step_time_s;
      FidelityRow vr = row;
      vr.id = stem + "#" + v.label;
      vr.label = f.label + ": " + v.label + " / " + f.baseline_label;
      vr.published = v.value / f.value;
      vr.predicted = (vplan.global_batch_size / vs) / (plan.global_batch_size / base_s);
      vr.detail = fmt::format("step {:.3f} s vs {:.3f} s", vs, base_s);
      r.rows.push_back(vr);
    }
  }
  // Per source, in order of first appearance, and overall.
  auto add = [](SourceSummary& s, const FidelityRow& row) {
    const double e = std::abs(row.error());
    s.mean_abs += e;
    s.max_abs = std::max(s.max_abs, e);
    s.min_gpus = s.rows == 0 ? row.gpus : std::min(s.min_gpus, row.gpus);
    s.max_gpus = std::max(s.max_gpus, row.gpus);
    ++s.rows;
  };
  r.overall.source = "all";
  for (const FidelityRow& row : r.rows) {
    auto it = std::find_if(r.sources.begin(), r.sources.end(), [&](const SourceSummary& s) { return s.source == row.source; });
    if (it == r.sources.end()) {
      r.sources.push_back(SourceSummary{row.source});
      it = r.sources.end() - 1;
    }
    add(*it, row);
    add(r.overall, row);
  }
  for (SourceSummary& s : r.sources) s.mean_abs /= std::max(1, s.rows);
  r.overall.mean_abs /= std::max(1, r.overall.rows);
  r.memory_overall.source = "peak memory";
  for (const FidelityRow& row : r.memory) add(r.memory_overall, row);
  r.memory_overall.mean_abs /= std::max(1, r.memory_overall.rows);
  return r;
}

std::string format_fidelity(const FidelityReport& r) {
  std::string out = fmt::format("{:<44} {:>6} {:<22} {:>10} {:>10} {:>8}  {}\n", "row", "GPUs", "figure", "published",
                                "predicted", "error", "detail");
  for (const FidelityRow& row : r.rows)
    out += fmt::format("{:<44} {:>6} {:<22} {:>10.4g} {:>10.4g} {:>+7.1f}%  {}\n", row.id, row.gpus, row.metric,
                       row.published, row.predicted, 100 * row.error(), row.detail);
  out += fmt::format("\n{:<36} {:>5} {:>11} {:>10} {:>10}\n", "source", "rows", "GPUs", "mean |err|", "max |err|");
  auto line = [&](const SourceSummary& s) {
    out += fmt::format("{:<36} {:>5} {:>11} {:>9.1f}% {:>9.1f}%\n", s.source, s.rows,
                       fmt::format("{}-{}", s.min_gpus, s.max_gpus), 100 * s.mean_abs, 100 * s.max_abs);
  };
  for (const SourceSummary& s : r.sources) line(s);
  line(r.overall);
  if (r.memory.empty()) return out;
  out += fmt::format("\n{:<44} {:>6} {:<22} {:>10} {:>10} {:>8}  {}\n", "peak memory per GPU (over: +)", "GPUs",
                     "figure", "published", "predicted", "error", "capacity");
  for (const FidelityRow& row : r.memory)
    out += fmt::format("{:<44} {:>6} {:<22} {:>10.4g} {:>10.4g} {:>+7.1f}%  {}\n", row.id, row.gpus, row.metric,
                       row.published, row.predicted, 100 * row.error(), row.detail);
  line(r.memory_overall);
  return out;
}

void write_fidelity_svg(const FidelityReport& r, std::ostream& out) {
  constexpr double W = 760, H = 720, L = 70, R = 230, T = 40, B = 60;
  const double pw = W - L - R, ph = H - T - B;
  double lo = 1e300, hi = 0;
  for (const FidelityRow& row : r.rows) {
    if (row.published <= 0 || row.predicted <= 0) continue;
    lo = std::min({lo, row.published, row.predicted});
    hi = std::max({hi, row.published, row.predicted});
  }
  if (hi <= 0) lo = 1, hi = 10;
  const double l0 = std::floor(std::log10(lo) * 2) / 2 - 0.1, l1 = std::ceil(std::log10(hi) * 2) / 2 + 0.1;
  auto px = [&](double v) { return L + (std::log10(v) - l0) / (l1 - l0) * pw; };
  auto py = [&](double v) { return T + ph - (std::log10(v) - l0) / (l1 - l0) * ph; };
  static const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};
  out << fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      W, H);
  out << fmt::format("<text x=\"{:.1f}\" y=\"22\" font-size=\"15\">Predicted against published ({} rows, mean "
                     "|error| {:.1f}%, max {:.1f}%)</text>\n",
                     L, r.overall.rows, 100 * r.overall.mean_abs, 100 * r.overall.max_abs);
  // +-5% band and the diagonal.
  const double a = std::pow(10, l0), b = std::pow(10, l1);
  out << fmt::format("<polygon points=\"{:.1f},{:.1f} {:.1f},{:.1f} {:.1f},{:.1f} {:.1f},{:.1f}\" fill=\"#e8e8e8\"/>\n",
                     px(a), py(a * 1.05), px(b / 1.05), py(b), px(b), py(b * 0.95), px(a / 0.95), py(a));
  out << fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#555\"/>\n", px(a), py(a),
                     px(b), py(b));
  for (double f : {1.05, 0.95})
    out << fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#999\" "
                       "stroke-dasharray=\"4 3\"/>\n",
                       px(a), py(a * f), px(b / f), py(b));
  // Decade grid and labels.
  for (int d = static_cast<int>(std::ceil(l0)); d <= static_cast<int>(std::floor(l1)); ++d) {
    const double v = std::pow(10, d);
    out << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#ccc\"/>"
                       "<text x=\"{0:.1f}\" y=\"{3:.1f}\" text-anchor=\"middle\">{4:g}</text>\n",
                       px(v), T, T + ph, T + ph + 16, v);
    out << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"#ccc\"/>"
                       "<text x=\"{3:.1f}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:g}</text>\n",
                       L, py(v), L + pw, L - 6, py(v) + 4, v);
  }
  out << fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" stroke=\"#333\"/>\n",
                     L, T, pw, ph);
  out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">published (each row in its own unit: "
                     "TFLOP/s, tokens/s, GB/s, ratio)</text>\n",
                     L + pw / 2, H - 18);
  out << fmt::format("<text transform=\"translate(18,{:.1f}) rotate(-90)\" text-anchor=\"middle\">predicted</text>\n",
                     T + ph / 2);
  out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#555\">diagonal, grey band: &#177;5%</text>\n", L + 8,
                     T + 16);
  for (std::size_t si = 0; si < r.sources.size(); ++si) {
    const char* colour = colours[si % std::size(colours)];
    const SourceSummary& s = r.sources[si];
    out << fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"5\" fill=\"{}\"/><text x=\"{:.1f}\" y=\"{:.1f}\">{} "
                       "({} rows, {:.1f}% / {:.1f}%)</text>\n",
                       L + pw + 16, T + 10 + 22.0 * si, colour, L + pw + 26, T + 14 + 22.0 * si,
                       s.source.size() > 24 ? s.source.substr(0, 24) : s.source, s.rows, 100 * s.mean_abs,
                       100 * s.max_abs);
    for (const FidelityRow& row : r.rows) {
      if (row.source != s.source || row.published <= 0 || row.predicted <= 0) continue;
      out << fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\" fill-opacity=\"0.75\"><title>{}: "
                         "published {:.4g}, predicted {:.4g} ({:+.1f}%)</title></circle>\n",
                         px(row.published), py(row.predicted), colour, row.id, row.published, row.predicted,
                         100 * row.error());
    }
  }
  out << "</svg>\n";
}

AcceptedErrors load_accepted(const std::string& path) {
  AcceptedErrors a;
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    throw std::runtime_error(fmt::format("{}: {}", path, e.what()));
  }
  if (const YAML::Node t = root["targets"]) {
    a.target_mean = t["mean"].as<double>(a.target_mean);
    a.target_max = t["max"].as<double>(a.target_max);
  }
  a.tolerance = root["tolerance"].as<double>(a.tolerance);
  if (const YAML::Node rows = root["rows"])
    for (const auto& kv : rows) a.rows[kv.first.as<std::string>()] = kv.second.as<double>();
  if (const YAML::Node sources = root["sources"])
    for (const auto& kv : sources)
      a.sources[kv.first.as<std::string>()] = {kv.second["mean"].as<double>(), kv.second["max"].as<double>()};
  return a;
}

std::string accepted_to_yaml(const FidelityReport& r, const AcceptedErrors& previous) {
  std::string out =
      "# Accepted errors of the published-data suite (predicted / published - 1), written by\n"
      "# `trainsim fidelity validation/published --update`. A re-run fails when a row moves more than\n"
      "# `tolerance` from its accepted error (the model is deterministic: a move is a change of the\n"
      "# model), or when a source's mean or max |error| rises more than `tolerance` above the figure\n"
      "# accepted under `sources`. Sources over the targets are reported by --check, not failed\n"
      "# (docs/validation.md).\n";
  out += fmt::format("targets: {{mean: {}, max: {}}}\ntolerance: {}\nsources:\n", previous.target_mean,
                     previous.target_max, previous.tolerance);
  auto source = [&](const SourceSummary& s) {
    out += fmt::format("  \"{}\": {{mean: {:.4f}, max: {:.4f}}}\n", s.source, s.mean_abs, s.max_abs);
  };
  for (const SourceSummary& s : r.sources) source(s);
  source(r.overall);
  out += "rows:\n";
  for (const FidelityRow& row : r.rows) out += fmt::format("  \"{}\": {:.4f}\n", row.id, row.error());
  for (const FidelityRow& row : r.memory) out += fmt::format("  \"{}\": {:.4f}\n", row.id, row.error());
  return out;
}

std::vector<std::string> check_fidelity(const FidelityReport& r, const AcceptedErrors& a) {
  std::vector<std::string> problems;
  std::set<std::string> seen;
  std::vector<FidelityRow> rows = r.rows;
  rows.insert(rows.end(), r.memory.begin(), r.memory.end());
  for (const FidelityRow& row : rows) {
    seen.insert(row.id);
    auto it = a.rows.find(row.id);
    if (it == a.rows.end()) {
      problems.push_back(fmt::format("{}: no accepted error (run with --update once the row is right)", row.id));
      continue;
    }
    if (std::abs(row.error() - it->second) > a.tolerance)
      problems.push_back(fmt::format("{}: error {:+.2f}% moved from the accepted {:+.2f}% (tolerance {:.2f}%)", row.id,
                                     100 * row.error(), 100 * it->second, 100 * a.tolerance));
  }
  for (const auto& [id, e] : a.rows)
    if (!seen.count(id)) problems.push_back(fmt::format("{}: accepted but no longer in the suite", id));
  // Each source's mean and max against what was accepted with the rows: a regression fails even
  // when every row stays inside its own tolerance.
  auto source = [&](const SourceSummary& s) {
    auto it = a.sources.find(s.source);
    if (it == a.sources.end()) {
      problems.push_back(fmt::format("{}: no accepted mean and max (run with --update)", s.source));
      return;
    }
    if (s.mean_abs > it->second.mean + a.tolerance)
      problems.push_back(fmt::format("{}: mean |error| {:.2f}% is above the accepted {:.2f}%", s.source,
                                     100 * s.mean_abs, 100 * it->second.mean));
    if (s.max_abs > it->second.max + a.tolerance)
      problems.push_back(fmt::format("{}: max |error| {:.2f}% is above the accepted {:.2f}%", s.source,
                                     100 * s.max_abs, 100 * it->second.max));
  };
  for (const SourceSummary& s : r.sources) source(s);
  source(r.overall);
  return problems;
}

std::vector<std::string> target_misses(const FidelityReport& r, const AcceptedErrors& a) {
  std::vector<std::string> misses;
  auto target = [&](const SourceSummary& s) {
    if (s.mean_abs > a.target_mean)
      misses.push_back(fmt::format("{}: mean |error| {:.1f}% over the target {:.1f}%", s.source, 100 * s.mean_abs,
                                   100 * a.target_mean));
    if (s.max_abs > a.target_max)
      misses.push_back(fmt::format("{}: max |error| {:.1f}% over the target {:.1f}%", s.source, 100 * s.max_abs,
                                   100 * a.target_max));
  };
  for (const SourceSummary& s : r.sources) target(s);
  target(r.overall);
  return misses;
}

}  // namespace trainsim::validation
