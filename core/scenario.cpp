#include "core/scenario.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

namespace trainsim {

namespace {

// The source diagnostics about command-line overrides name.
constexpr std::string_view kOverrideSource = "--set";

template <class T>
ConstraintField int_constraint(std::string key, std::optional<T> SweepConstraints::*member, double min, double max,
                               std::string help) {
  ConstraintField c;
  c.key = std::move(key);
  c.kind = FieldKind::integer;
  c.min = min;
  c.max = max;
  c.help = std::move(help);
  c.set = [member](SweepConstraints& s, const FieldValue& v) { s.*member = static_cast<T>(std::get<std::int64_t>(v)); };
  c.get = [member](const SweepConstraints& s) -> std::optional<FieldValue> {
    if (!(s.*member)) return std::nullopt;
    return FieldValue{static_cast<std::int64_t>(*(s.*member))};
  };
  return c;
}

std::vector<ConstraintField> make_constraint_fields() {
  std::vector<ConstraintField> t;
  {
    ConstraintField c;
    c.key = "max_memory_fraction";
    c.kind = FieldKind::real;
    c.min = 0.01;
    c.max = 1;
    c.help = "A configuration fits only if its peak memory per GPU is at most this fraction of cluster.memory_gib "
             "(default 1: the whole GPU)";
    c.set = [](SweepConstraints& s, const FieldValue& v) { s.max_memory_fraction = std::get<double>(v); };
    c.get = [](const SweepConstraints& s) -> std::optional<FieldValue> {
      if (s.max_memory_fraction >= 1) return std::nullopt;
      return FieldValue{s.max_memory_fraction};
    };
    t.push_back(std::move(c));
  }
  {
    ConstraintField c;
    c.key = "min_memory_headroom_gib";
    c.kind = FieldKind::real;
    c.min = 0;
    c.max = 1e6;
    c.unit = "GiB";
    c.help = "Memory each GPU must keep free at its peak (CUDA context, workspaces, fragmentation)";
    c.set = [](SweepConstraints& s, const FieldValue& v) { s.min_memory_headroom_gib = std::get<double>(v); };
    c.get = [](const SweepConstraints& s) -> std::optional<FieldValue> {
      if (!s.min_memory_headroom_gib) return std::nullopt;
      return FieldValue{*s.min_memory_headroom_gib};
    };
    t.push_back(std::move(c));
  }
  t.push_back(int_constraint("min_global_batch_size", &SweepConstraints::min_global_batch_size, 1, 1 << 30,
                             "Smallest global batch (samples per optimizer step) allowed"));
  t.push_back(int_constraint("max_global_batch_size", &SweepConstraints::max_global_batch_size, 1, 1 << 30,
                             "Largest global batch (samples per optimizer step) allowed"));
  t.push_back(int_constraint("max_data_parallel_size", &SweepConstraints::max_data_parallel_size, 1, 1 << 20,
                             "Largest data_parallel_size allowed"));
  t.push_back(int_constraint("max_pipeline_parallel_size", &SweepConstraints::max_pipeline_parallel_size, 1, 4096,
                             "Largest pipeline_parallel_size allowed"));
  t.push_back(int_constraint("max_tensor_parallel_size", &SweepConstraints::max_tensor_parallel_size, 1, 1024,
                             "Largest tensor_parallel_size allowed"));
  t.push_back(int_constraint("max_micro_batch_size", &SweepConstraints::max_micro_batch_size, 1, 1 << 20,
                             "Largest micro_batch_size allowed"));
  t.push_back(int_constraint("min_micro_batches", &SweepConstraints::min_micro_batches, 1, 1 << 30,
                             "Fewest micro-batches per replica per step allowed"));
  return t;
}

}  // namespace

const std::vector<ConstraintField>& constraint_fields() {
  static const std::vector<ConstraintField> fields = make_constraint_fields();
  return fields;
}

bool Scenario::has_key(const std::string& path) const {
  return std::find(explicit_keys.begin(), explicit_keys.end(), path) != explicit_keys.end();
}

Diagnostic Scenario::diagnostic(const std::string& key_path, std::string message,
                                std::initializer_list<std::string_view> related) const {
  auto written = [&](const std::string& p) -> const SourceLocation* {
    auto it = locations.find(p);
    return it == locations.end() ? nullptr : &it->second;
  };
  SourceLocation where;
  const SourceLocation* found = written(key_path);
  for (auto it = related.begin(); !found && it != related.end(); ++it) found = written(std::string(*it));
  // Else the closest enclosing section that was written.
  for (std::string p = key_path; !found && !p.empty();) {
    auto dot = p.rfind('.');
    p = dot == std::string::npos ? "" : p.substr(0, dot);
    if (!p.empty()) found = written(p);
  }
  if (found) where = *found;
  return Diagnostic{file, where, key_path, std::move(message)};
}

namespace {

SourceLocation location_of(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  if (m.is_null()) return {};
  return {m.line + 1, m.column + 1};
}

std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null: return "nothing";
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return n.size() == 0 ? "an empty list" : "a list";
    case YAML::NodeType::Scalar:
      return n.Tag() == "!" ? fmt::format("the quoted text \"{}\"", n.Scalar()) : fmt::format("\"{}\"", n.Scalar());
    default: return "an undefined value";
  }
}

bool is_plain_scalar(const YAML::Node& n) { return n.IsScalar() && n.Tag() != "!"; }

std::optional<std::int64_t> to_integer(const std::string& s) {
  std::int64_t v = 0;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  auto [ptr, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || ptr != e || b == e) return std::nullopt;
  return v;
}

std::optional<double> to_real(const std::string& s) {
  if (s.empty()) return std::nullopt;
  std::istringstream in(s);
  in.imbue(std::locale::classic());
  double v = 0;
  in >> v;
  if (in.fail() || !in.eof() || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<bool> to_boolean(const std::string& s) {
  std::string l = s;
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  if (l == "true" || l == "yes" || l == "on") return true;
  if (l == "false" || l == "no" || l == "off") return false;
  return std::nullopt;
}

// Integer bounds are printed in full ("1048576", not "1.04858e+06").
std::string bound_text(const FieldSpec& f, double x) {
  const bool integral = f.kind == FieldKind::integer || f.kind == FieldKind::integer_list;
  if (integral && std::fabs(x) < 1e18) return fmt::format("{:.0f}", x);
  return fmt::format("{:g}", x);
}

std::string bounds_text(const FieldSpec& f) {
  const bool has_min = std::isfinite(f.min), has_max = std::isfinite(f.max);
  if (has_min && has_max) return fmt::format("between {} and {}", bound_text(f, f.min), bound_text(f, f.max));
  if (has_min) return fmt::format("at least {}", bound_text(f, f.min));
  if (has_max) return fmt::format("at most {}", bound_text(f, f.max));
  return "";
}

// Digits with an optional sign: an integer, though perhaps too large for 64 bits.
bool looks_like_integer(const std::string& s) {
  std::size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
  return true;
}

// An empty value (`key:` with nothing after it) has no position of its own: yaml-cpp marks
// it where the next token starts, often the next line. Point at its key instead.
SourceLocation value_location(const YAML::Node& v, SourceLocation key_at) {
  if (v.IsNull()) return key_at;
  const SourceLocation at = location_of(v);
  return at.line > 0 ? at : key_at;
}

class Loader {
 public:
  explicit Loader(Scenario& sc) : sc_(sc) {}

  void load(const YAML::Node& root, const std::vector<KeyOverride>& overrides) {
    if (!root.IsDefined() || root.IsNull()) {
      error("", {}, "the scenario is empty; start from scenarios/postmortem-8x40gb.yaml");
      return;
    }
    if (!root.IsMap()) {
      error("", location_of(root), fmt::format("a scenario must be a map of sections, got {}", describe(root)));
      return;
    }
    walk(root, "");
    for (const KeyOverride& o : overrides) override_key(o);
    // Presets first, wherever and however (nested or dotted) they are written, so that
    // every explicit key overrides them whatever the order of keys in the file.
    for (const auto& p : pending_)
      if (p.field->applies_preset) apply(p);
    for (const auto& p : pending_)
      if (!p.field->applies_preset) apply(p);
    check_generated_axes();
  }

  std::vector<Diagnostic> errors;

 private:
  struct Pending {
    const FieldSpec* field;
    YAML::Node value;
    SourceLocation key_at;
    bool from_command_line = false;
    bool replaced = false;  // by a command-line override
  };

  void error(const std::string& path, SourceLocation where, std::string message) {
    // An override's value is a document of its own: its line and column say nothing.
    if (applying_override_)
      errors.push_back(Diagnostic{std::string(kOverrideSource), {}, path, std::move(message)});
    else
      errors.push_back(Diagnostic{sc_.file, where, path, std::move(message)});
  }

  // `--set KEY=VALUE`: in place of what the file wrote for the key (its location dropped, so a
  // later diagnostic does not point at a line whose value was replaced).
  void override_key(const KeyOverride& o) {
    applying_override_ = true;
    const FieldSpec* f = find_field(o.key);
    YAML::Node value;
    try {
      value = YAML::Load(o.value);
    } catch (const YAML::Exception& e) {
      error(o.key, {}, "YAML syntax in the value: " + e.msg);
    }
    if (!f) {
      if (o.key == "sweep" || o.key.rfind("sweep.", 0) == 0 || o.key.rfind("constraints", 0) == 0)
        error(o.key, {}, "only scenario keys can be set (`trainsim fields`); write sweeps and constraints in the file");
      else
        unknown_key(o.key.substr(0, o.key.rfind('.') == std::string::npos ? 0 : o.key.rfind('.')),
                    o.key.substr(o.key.rfind('.') == std::string::npos ? 0 : o.key.rfind('.') + 1), {});
    } else if (value.IsDefined()) {
      // Marked, not erased: assigning a YAML::Node writes through to the node it refers to, so
      // a vector of them must not shift.
      for (Pending& p : pending_)
        if (p.field == f) p.replaced = true;
      sc_.locations.erase(f->path);
      pending_.push_back(Pending{f, value, {}, true});
    }
    applying_override_ = false;
  }
  bool applying_override_ = false;

  // Records where each key path was written; false (and an error) when it was written
  // before, in this map or elsewhere (a dotted key `cluster.num_gpus` and a nested one
  // name the same field).
  bool record(const std::string& path, SourceLocation at) {
    auto [prev, fresh] = sc_.locations.emplace(path, at);
    if (!fresh) error(path, at, fmt::format("given twice (first on line {})", prev->second.line));
    return fresh;
  }

  void walk(const YAML::Node& map, const std::string& prefix) {
    for (auto it = map.begin(); it != map.end(); ++it) {
      // Copies (a Node is a handle): `it->` returns a proxy that dies with the statement, so
      // a reference to its members would dangle.
      const YAML::Node key_node = it->first;
      const YAML::Node value = it->second;
      const SourceLocation key_at = location_of(key_node);
      if (!key_node.IsScalar()) {
        error(prefix, key_at, fmt::format("keys must be names, got {}", describe(key_node)));
        continue;
      }
      const std::string key = key_node.Scalar();
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      if (!record(path, key_at)) continue;

      if (prefix.empty() && key == "sweep") {
        load_sweep(value, key_at);
      } else if (prefix.empty() && key == "constraints") {
        load_constraints(value, key_at);
      } else if (const FieldSpec* f = find_field(path)) {
        pending_.push_back(Pending{f, value, key_at});
      } else if (is_field_section(path)) {
        if (!value.IsMap()) {
          error(path, value_location(value, key_at),
                fmt::format("expected a section (a map of keys), got {}", describe(value)));
          continue;
        }
        walk(value, path);
      } else {
        unknown_key(prefix, key, key_at);
      }
    }
  }

  void unknown_key(const std::string& prefix, const std::string& key, SourceLocation at) {
    std::vector<std::string> siblings = section_children(prefix);
    if (prefix.empty()) {
      siblings.push_back("sweep");
      siblings.push_back("constraints");  // only `trainsim sweep` and `trainsim plan` read it (docs/sweep.md)
    }
    std::string hint = closest_match(key, siblings);
    std::string path = prefix.empty() ? key : prefix + "." + key;
    std::string msg = "unknown key";
    if (!hint.empty())
      msg += fmt::format("; did you mean \"{}\"?", hint);
    else
      msg += fmt::format("; {} accepts: {}", prefix.empty() ? "the top level" : prefix, fmt::join(siblings, ", "));
    error(path, at, msg);
  }

  // Parses one value against its row of the table; reports and returns nullopt on error.
  std::optional<FieldValue> parse(const FieldSpec& f, const YAML::Node& v, const std::string& path,
                                  SourceLocation key_at) {
    const SourceLocation at = value_location(v, key_at);
    auto fail = [&](std::string what) {
      error(path, at, std::move(what));
      return std::optional<FieldValue>{};
    };
    auto check_range = [&](double x) {
      return x >= f.min && x <= f.max;
    };
    switch (f.kind) {
      case FieldKind::integer: {
        auto x = is_plain_scalar(v) ? to_integer(v.Scalar()) : std::nullopt;
        if (!x && is_plain_scalar(v) && looks_like_integer(v.Scalar()))
          return fail(fmt::format("must be {}, got {}", bounds_text(f), v.Scalar()));
        if (!x) return fail(fmt::format("expected an integer, got {}", describe(v)));
        if (!check_range(static_cast<double>(*x))) return fail(fmt::format("must be {}, got {}", bounds_text(f), *x));
        return FieldValue{*x};
      }
      case FieldKind::real: {
        auto x = is_plain_scalar(v) ? to_real(v.Scalar()) : std::nullopt;
        if (!x) return fail(fmt::format("expected a number, got {}", describe(v)));
        if (!check_range(*x)) return fail(fmt::format("must be {}, got {}", bounds_text(f), v.Scalar()));
        return FieldValue{*x};
      }
      case FieldKind::boolean: {
        auto x = is_plain_scalar(v) ? to_boolean(v.Scalar()) : std::nullopt;
        if (!x) return fail(fmt::format("expected true or false, got {}", describe(v)));
        return FieldValue{*x};
      }
      case FieldKind::text: {
        if (!v.IsScalar()) return fail(fmt::format("expected text, got {}", describe(v)));
        return FieldValue{v.Scalar()};
      }
      case FieldKind::choice: {
        if (!v.IsScalar()) return fail(fmt::format("expected one of {}, got {}", fmt::join(f.choices, ", "), describe(v)));
        const std::string s = v.Scalar();
        if (std::find(f.choices.begin(), f.choices.end(), s) == f.choices.end()) {
          std::string hint = closest_match(s, f.choices);
          return fail(fmt::format("unknown value \"{}\"; expected one of: {}{}", s, fmt::join(f.choices, ", "),
                                  hint.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", hint)));
        }
        return FieldValue{s};
      }
      case FieldKind::integer_list: {
        if (!v.IsSequence()) return fail(fmt::format("expected a list of integers, got {}", describe(v)));
        IntList out;
        for (std::size_t i = 0; i < v.size(); ++i) {
          const SourceLocation entry_at = value_location(v[i], at);
          auto x = is_plain_scalar(v[i]) ? to_integer(v[i].Scalar()) : std::nullopt;
          if (!x && !(is_plain_scalar(v[i]) && looks_like_integer(v[i].Scalar()))) {
            error(path, entry_at, fmt::format("entry {} must be an integer, got {}", i, describe(v[i])));
            return std::nullopt;
          }
          if (!x || !check_range(static_cast<double>(*x))) {
            error(path, entry_at, fmt::format("entry {} must be {}, got {}", i, bounds_text(f), v[i].Scalar()));
            return std::nullopt;
          }
          out.push_back(*x);
        }
        return FieldValue{out};
      }
    }
    return std::nullopt;
  }

  void apply(const Pending& p) {
    if (p.replaced) return;
    applying_override_ = p.from_command_line;
    apply(*p.field, p.value, p.key_at);
    applying_override_ = false;
  }

  void apply(const FieldSpec& f, const YAML::Node& v, SourceLocation key_at) {
    auto value = parse(f, v, f.path, key_at);
    if (!value) return;
    if (f.is_path) {
      auto& path = std::get<std::string>(*value);
      if (!path.empty() && std::filesystem::path(path).is_relative() && !sc_.file.empty() && sc_.file.front() != '<')
        path = (std::filesystem::path(sc_.file).parent_path() / path).lexically_normal().string();
    }
    try {
      f.set(sc_.config, *value);
      sc_.explicit_keys.push_back(f.path);
    } catch (const std::invalid_argument& e) {
      std::string msg = fmt::format("\"{}\": {}", format_field_value(*value), e.what());
      error(f.path, value_location(v, key_at), msg);
    }
  }

  void load_sweep(const YAML::Node& node, SourceLocation sweep_at) {
    if (!node.IsMap()) {
      error("sweep", value_location(node, sweep_at),
            fmt::format("expected a map from key paths to lists of values, got {}", describe(node)));
      return;
    }
    std::vector<std::string> all_paths;
    for (const auto& f : scenario_fields()) all_paths.push_back(f.path);
    for (auto it = node.begin(); it != node.end(); ++it) {
      const YAML::Node key_node = it->first;
      const YAML::Node values = it->second;
      const SourceLocation at = location_of(key_node);
      if (!key_node.IsScalar()) {
        error("sweep", at, fmt::format("keys must be dotted key paths, got {}", describe(key_node)));
        continue;
      }
      const std::string path = key_node.Scalar();
      if (!record("sweep." + path, at)) continue;
      if (path == "parallelism") {
        if (is_plain_scalar(values) && values.Scalar() == "auto") {
          sc_.sweep.push_back(SweepAxis{path, {}, at, SweepAxisKind::auto_parallelism});
        } else {
          error("sweep.parallelism", value_location(values, at),
                fmt::format("expected auto (every data x pipeline x tensor factorisation of num_gpus), got {}; "
                            "to list the sizes of one key, sweep it by its dotted path, e.g. "
                            "parallelism.pipeline_parallel_size: [1, 2, 4]",
                            describe(values)));
        }
        continue;
      }
      const FieldSpec* f = find_field(path);
      if (f && is_plain_scalar(values) && values.Scalar() == "auto") {
        if (path == "training.micro_batch_size")
          sc_.sweep.push_back(SweepAxis{path, {}, at, SweepAxisKind::auto_micro_batch_size});
        else if (path == "parallelism.virtual_pipeline_stages")
          sc_.sweep.push_back(SweepAxis{path, {}, at, SweepAxisKind::auto_virtual_stages});
        else
          error("sweep." + path, value_location(values, at),
                "auto is generated only for `parallelism`, `training.micro_batch_size` and "
                "`parallelism.virtual_pipeline_stages`; list this key's values, e.g. [a, b, c]");
        continue;
      }
      if (!f) {
        std::string hint = closest_match(path, all_paths);
        error("sweep." + path, at,
              fmt::format("not a scenario key{}", hint.empty() ? "; see `trainsim fields`" : fmt::format("; did you mean \"{}\"?", hint)));
        continue;
      }
      if (!values.IsSequence() || values.size() == 0) {
        error("sweep." + path, value_location(values, at),
              fmt::format("expected a non-empty list of values, got {}", describe(values)));
        continue;
      }
      SweepAxis axis{path, {}, at};
      bool ok = true;
      for (std::size_t i = 0; i < values.size(); ++i) {
        auto v = parse(*f, values[i], "sweep." + path, location_of(values));
        if (!v) {
          ok = false;
          continue;
        }
        // Presets are checked by name now, so a sweep over GPUs fails here rather than midway.
        if (f->applies_preset) {
          ScenarioConfig probe;
          try {
            f->set(probe, *v);
          } catch (const std::invalid_argument& e) {
            error("sweep." + path, value_location(values[i], location_of(values)),
                  fmt::format("\"{}\": {}", format_field_value(*v), e.what()));
            ok = false;
            continue;
          }
        }
        axis.values.push_back(std::move(*v));
      }
      if (ok) sc_.sweep.push_back(std::move(axis));
    }
  }


  // Generated axes that cannot work with the rest of the file.
  void check_generated_axes() {
    auto axis = [&](const std::string& path) -> const SweepAxis* {
      for (const auto& a : sc_.sweep)
        if (a.path == path) return &a;
      return nullptr;
    };
    if (const SweepAxis* a = axis("parallelism")) {
      for (const char* k : {"parallelism.data_parallel_size", "parallelism.pipeline_parallel_size",
                            "parallelism.tensor_parallel_size"})
        if (const SweepAxis* b = axis(k))
          error(std::string("sweep.") + k, b->where,
                fmt::format("parallelism: auto (line {}) already generates this size; remove one of the two",
                            a->where.line));
    }
    if (const SweepAxis* a = axis("training.micro_batch_size"); a && a->generated()) {
      if (sc_.config.training.global_batch_size <= 0 && !axis("training.global_batch_size"))
        error("sweep.training.micro_batch_size", a->where,
              "auto takes the divisors of global_batch_size / data_parallel_size, but training.global_batch_size "
              "is not set; set it (or list the micro-batch sizes)");
    }
  }

  void load_constraints(const YAML::Node& node, SourceLocation section_at) {
    if (!node.IsMap()) {
      error("constraints", value_location(node, section_at),
            fmt::format("expected a section (a map of keys), got {}", describe(node)));
      return;
    }
    std::vector<std::string> keys;
    for (const auto& c : constraint_fields()) keys.push_back(c.key);
    for (auto it = node.begin(); it != node.end(); ++it) {
      const YAML::Node key_node = it->first;
      const YAML::Node value = it->second;
      const SourceLocation at = location_of(key_node);
      if (!key_node.IsScalar()) {
        error("constraints", at, fmt::format("keys must be names, got {}", describe(key_node)));
        continue;
      }
      const std::string key = key_node.Scalar();
      const std::string path = "constraints." + key;
      if (!record(path, at)) continue;
      const ConstraintField* cf = nullptr;
      for (const auto& c : constraint_fields())
        if (c.key == key) cf = &c;
      if (!cf) {
        const std::string hint = closest_match(key, keys);
        error(path, at,
              hint.empty() ? fmt::format("unknown key; constraints accepts: {}", fmt::join(keys, ", "))
                           : fmt::format("unknown key; did you mean \"{}\"?", hint));
        continue;
      }
      // Parsed with the loader's own rules, through a field spec with the same bounds.
      FieldSpec spec;
      spec.path = path;
      spec.kind = cf->kind;
      spec.min = cf->min;
      spec.max = cf->max;
      if (auto v = parse(spec, value, path, at)) cf->set(sc_.constraints, *v);
    }
  }

  Scenario& sc_;
  std::vector<Pending> pending_;
};

// Where each document of a YAML stream starts, without building it. yaml-cpp 0.7 (Debian 12's)
// has a token its parser neither accepts nor refuses at the top level (`,` as in "a: 1\n,"):
// it then ends a document without consuming it, and YAML::LoadAll loops forever, adding an
// empty document each time (jbeder/yaml-cpp#1040, fixed upstream by #1319). Such a token is
// found here as a document that starts where the previous one started, and reported as the
// syntax error it is.
class DocumentStarts : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> starts;
  void OnDocumentStart(const YAML::Mark& mark) override { starts.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// Throws YAML::ParserException at a token the parser cannot get past.
void check_parser_progress(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStarts docs;
  while (parser.HandleNextDocument(docs)) {
    const std::size_t n = docs.starts.size();
    if (n >= 2 && docs.starts[n - 1].pos == docs.starts[n - 2].pos) {
      const YAML::Mark at = docs.starts[n - 1];
      const std::size_t pos = static_cast<std::size_t>(at.pos);
      const unsigned char c = pos < text.size() ? static_cast<unsigned char>(text[pos]) : 0;
      const std::string what = pos >= text.size() ? "unexpected end of the file"
                               : std::isprint(c)   ? fmt::format("unexpected '{}'", static_cast<char>(c))
                                                   : fmt::format("unexpected byte 0x{:02x}", c);
      throw YAML::ParserException(at, what);
    }
  }
}

Scenario load(const std::string& text, const std::string& file_name, const std::vector<KeyOverride>& overrides) {
  Scenario sc;
  sc.file = file_name;
  std::vector<YAML::Node> documents;
  try {
    check_parser_progress(text);
    documents = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    SourceLocation where;
    if (!e.mark.is_null()) where = {e.mark.line + 1, e.mark.column + 1};
    throw ScenarioError({Diagnostic{file_name, where, "", "YAML syntax: " + e.msg}});
  }
  // A second document (after `---`) would otherwise be dropped without a word.
  if (documents.size() > 1)
    throw ScenarioError({Diagnostic{file_name, location_of(documents[1]), "",
                                    fmt::format("the file holds {} YAML documents separated by `---`; a scenario "
                                                "is one document (put variants in `sweep:` or in separate files)",
                                                documents.size())}});
  Loader loader(sc);
  loader.load(documents.empty() ? YAML::Node() : documents.front(), overrides);
  // In the order of the file, as a compiler lists them (presets are applied first).
  std::stable_sort(loader.errors.begin(), loader.errors.end(), [](const Diagnostic& a, const Diagnostic& b) {
    return std::pair(a.where.line, a.where.column) < std::pair(b.where.line, b.where.column);
  });
  if (!loader.errors.empty()) throw ScenarioError(std::move(loader.errors));
  derive_unwritten(sc.config, [&](std::string_view key) { return sc.has_key(std::string(key)); });
  return sc;
}

}  // namespace

void derive_unwritten(ScenarioConfig& c, const std::function<bool(std::string_view)>& written) {
  if (!written("precision.loss_scaling.mode"))
    c.precision.loss_scaling.mode = c.precision.compute == DType::fp16 ? LossScalingMode::dynamic : LossScalingMode::none;
  ParallelismConfig& par = c.parallelism;
  const long long model_parallel =
      static_cast<long long>(par.pipeline_parallel_size) * par.tensor_parallel_size * par.context_parallel_size;
  if (model_parallel < 1) return;  // out of range: the loader or Plan says so
  if (!written("parallelism.data_parallel_size")) {
    const bool whole = c.cluster.num_gpus >= model_parallel && c.cluster.num_gpus % model_parallel == 0;
    par.data_parallel_size = whole ? static_cast<int>(c.cluster.num_gpus / model_parallel) : 1;
  } else if (!written("cluster.num_gpus")) {
    const long long gpus = model_parallel * par.data_parallel_size;
    if (gpus <= (1 << 20)) c.cluster.num_gpus = static_cast<int>(gpus);
  }
}

KeyOverride parse_key_override(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ScenarioError({Diagnostic{std::string(kOverrideSource), {}, "",
                                    fmt::format("expects KEY=VALUE (a scenario key's dotted path, `trainsim fields`), got \"{}\"", text)}});
  return KeyOverride{text.substr(0, eq), text.substr(eq + 1)};
}

Scenario load_scenario_text(const std::string& yaml_text, const std::string& file_name,
                            const std::vector<KeyOverride>& overrides) {
  return load(yaml_text, file_name, overrides);
}

Scenario load_scenario_file(const std::string& path, const std::vector<KeyOverride>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ScenarioError({Diagnostic{path, {}, "", "is a folder, not a scenario file"}});
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ScenarioError({Diagnostic{path, {}, "", "cannot open the file (does it exist and is it readable?)"}});
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ScenarioError({Diagnostic{path, {}, "", "cannot read the file"}});
  return load(text.str(), path, overrides);
}

}  // namespace trainsim
