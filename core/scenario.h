// Loading a scenario file: YAML -> ScenarioConfig, with presets applied, every key checked
// against the field table and every problem reported with its file, line, column and key.
#pragma once

#include <map>
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
  Diagnostic diagnostic(const std::string& key_path, std::string message) const;
};

// Throws ScenarioError listing every problem found (syntax, unknown keys, types, ranges).
Scenario load_scenario_file(const std::string& path);
Scenario load_scenario_text(const std::string& yaml_text, const std::string& file_name = "<string>");

}  // namespace trainsim
