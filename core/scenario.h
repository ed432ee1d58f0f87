// Loading a scenario file: YAML -> ScenarioConfig, with presets applied, every key checked
// against the field table and every problem reported with its file, line, column and key.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <string_view>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/config_fields.h"
#include "core/diagnostics.h"

namespace trainsim {

// An axis of `sweep:`. Most list values of one key; three are generated per configuration:
//   parallelism: auto                 every (data, pipeline, tensor) factorisation of num_gpus
//                                     the model allows (sim/sweep/sweep.h says which)
//   training.micro_batch_size: auto   every divisor of global_batch_size / data_parallel_size
//   parallelism.virtual_pipeline_stages: auto
//                                     under interleaved-1f1b, every way to cut a stage's layers
//                                     into chunks (interleaving_depths, sim/sweep/sweep.h)
enum class SweepAxisKind { values, auto_parallelism, auto_micro_batch_size, auto_virtual_stages };

struct SweepAxis {
  std::string path;  // a row of the field table ("parallelism" for `parallelism: auto`)
  std::vector<FieldValue> values;  // empty for generated axes
  SourceLocation where;
  SweepAxisKind kind = SweepAxisKind::values;
  bool generated() const { return kind != SweepAxisKind::values; }
};

// The optional top-level `constraints:` section: what a configuration must meet, besides
// being valid and fitting in memory, to be ranked by `trainsim sweep` and chosen by
// `trainsim plan`. Unset entries constrain nothing. Keys, bounds and help text are in
// constraint_fields(); docs/sweep.md documents them.
struct SweepConstraints {
  double max_memory_fraction = 1.0;  // peak per GPU <= fraction * cluster.memory_gib
  std::optional<double> min_memory_headroom_gib;  // memory_gib - peak per GPU >= this
  std::optional<std::int64_t> min_global_batch_size, max_global_batch_size;
  std::optional<std::int64_t> max_data_parallel_size, max_pipeline_parallel_size, max_tensor_parallel_size;
  std::optional<std::int64_t> max_micro_batch_size;
  std::optional<std::int64_t> min_micro_batches;  // micro-batches per replica per step
};

struct ConstraintField {
  std::string key;  // under `constraints:`, e.g. "max_memory_fraction"
  FieldKind kind = FieldKind::integer;  // integer or real
  double min = 0, max = 0;  // inclusive bounds
  std::string unit, help;
  std::function<void(SweepConstraints&, const FieldValue&)> set;
  // The value when set (nullopt: the constraint is off).
  std::function<std::optional<FieldValue>(const SweepConstraints&)> get;
};
const std::vector<ConstraintField>& constraint_fields();

struct Scenario {
  std::string file;  // as given by the user, for messages
  ScenarioConfig config;
  std::vector<SweepAxis> sweep;
  SweepConstraints constraints;
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

// What a file leaves unwritten and follows from what it wrote, as Megatron-LM and torchrun have
// it. The layout: data_parallel_size = num_gpus / (pipeline x tensor x context) when the file does not
// write it (1 when that does not divide: Plan states the mismatch and why), num_gpus = data x
// pipeline x tensor x context when it writes data_parallel_size but not num_gpus. The loss scaling:
// dynamic under FP16 compute, none otherwise (BF16, FP8 and FP32 keep FP32's exponent range).
// `written(key)`: whether the file (or a sweep axis) sets the key. Loading applies it; a sweep
// again to each configuration, after its axes.
void derive_unwritten(ScenarioConfig& config, const std::function<bool(std::string_view key)>& written);

// A key set from the command line (`--set KEY=VALUE`): the key's dotted path and its value as
// YAML text (`4`, `bf16`, `[10, 10, 12]`).
struct KeyOverride {
  std::string key, value;
};
// "KEY=VALUE" split at its first '='; throws ScenarioError (naming --set) without one.
KeyOverride parse_key_override(const std::string& text);

// Throws ScenarioError listing every problem found (syntax, unknown keys, types, ranges).
// `overrides` apply after the file's keys, each as if the file wrote it in place of what it
// wrote for that key (so it counts as written: derive_unwritten, diagnostics); their errors name
// --set.
Scenario load_scenario_file(const std::string& path, const std::vector<KeyOverride>& overrides = {});
Scenario load_scenario_text(const std::string& yaml_text, const std::string& file_name = "<string>",
                            const std::vector<KeyOverride>& overrides = {});

}  // namespace trainsim
