// One table of scenario fields: key path, kind, default, unit, bounds and help text.
// The YAML loader, `trainsim fields` and docs/scenario-reference.md are all driven by it,
// so they cannot disagree. A sweep axis names a row of this table by its dotted path.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/config.h"

namespace trainsim {

using IntList = std::vector<std::int64_t>;
using FieldValue = std::variant<std::int64_t, double, bool, std::string, IntList>;

enum class FieldKind { integer, real, boolean, text, choice, integer_list };

struct FieldSpec {
  std::string path;  // dotted key path, e.g. "parallelism.pipeline_parallel_size"
  FieldKind kind = FieldKind::integer;
  std::string unit;  // empty when dimensionless; otherwise also visible in the key name
  std::string help;
  std::vector<std::string> choices;  // accepted spellings for choice fields
  double min = -std::numeric_limits<double>::infinity();  // inclusive bounds for numbers
  double max = std::numeric_limits<double>::infinity();
  std::string default_note;  // shown instead of the default value when it is derived
  bool applies_preset = false;  // model.preset / cluster.gpu: applied before every other key
  bool is_path = false;         // a file path: a relative one is taken from the scenario's folder
  // Setter and getter. The setter may throw std::invalid_argument with a message that
  // names what is accepted (unknown preset names, for instance).
  std::function<void(ScenarioConfig&, const FieldValue&)> set;
  std::function<FieldValue(const ScenarioConfig&)> get;
};

const std::vector<FieldSpec>& scenario_fields();
const FieldSpec* find_field(std::string_view path);
// True when `path` names a section (a prefix of at least one field path).
bool is_field_section(std::string_view path);
// The keys directly under a section ("" for the top level), for "did you mean" hints.
std::vector<std::string> section_children(std::string_view section);

std::string field_kind_name(FieldKind k);
std::string format_field_value(const FieldValue& v);
void append_field_value(std::string& out, const FieldValue& v);  // the same text, appended
// The same value, doubles bit for bit: values that are the same read the same (0.0 and -0.0
// are not the same; a NaN is not the same as itself).
bool same_field_value(const FieldValue& a, const FieldValue& b);
// The default shown to users: the note for derived defaults, else the value of a
// default-constructed ScenarioConfig.
std::string field_default_text(const FieldSpec& f);

// Markdown reference of every field, grouped by section (docs/scenario-reference.md).
std::string fields_reference_markdown();

}  // namespace trainsim
