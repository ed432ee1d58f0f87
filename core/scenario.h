// Loading a scenario file: YAML -> ScenarioConfig, with presets applied, every key checked
// against the field table and every problem reported with its file, line, column and key.
#pragma once

#include <initializer_list>
#include <map>
#include <string_view>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/config_fields.h"
#include "core/diagnostics.h"

namespace trainsim {

struct SweepAxis {
  std::string path;  // a row of the field table
  std::vector<FieldValue> values;
  SourceLocation where;
};

struct Scenario {
  std::string file;  // as given by the user, for messages
  ScenarioConfig config;
  std::vector<SweepAxis> sweep;
  // Where each key was written (key path -> location), so that invariant errors found
  // later (Plan::from_config) can point at the offending line. Sections are included.
  std::map<std::string, SourceLocation> locations;
  // Keys set explicitly in the file (presets' values are not in here).
  std::vector<std::string> explicit_keys;

  bool has_key(const std::string& path) const;
  // A diagnostic about `key_path`, located at that key if the file wrote it, else at the
  // first of `related` keys that it wrote (the keys whose values made the default wrong),
  // else at the closest enclosing section that it wrote.
  Diagnostic diagnostic(const std::string& key_path, std::string message,
                        std::initializer_list<std::string_view> related = {}) const;
};

// Throws ScenarioError listing every problem found (syntax, unknown keys, types, ranges).
Scenario load_scenario_file(const std::string& path);
Scenario load_scenario_text(const std::string& yaml_text, const std::string& file_name = "<string>");

}  // namespace trainsim
