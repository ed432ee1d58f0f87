// Fidelity at scale: predictions held against published measurements of real clusters
// (validation/published/, docs/validation.md "Fidelity at scale").
//
// Each file of the folder is one published row: a `published:` section (the source, the table
// and row, the measured figure and how it is defined) and a `scenario:` section (a scenario as
// `trainsim simulate` reads it: the model, cluster, parallelism, batch, precision and recompute
// the source states). The figure is one of
//   tflops_per_gpu         FLOPs per step / (step time x GPUs); `flops:` says whose count:
//                            megatron  96 B s l h^2 (1 + s/6h + V/16lh)       (Narayanan et al. eq. 3)
//                            palm      (6 N + 12 l h s) per token, N without the input embedding
//                                                                          (Chowdhery et al. app. B)
//   tokens_per_s_per_gpu   tokens per step / (step time x GPUs)
//   samples_per_s_per_gpu  samples per step / (step time x GPUs)
//   step_time_s            the step time itself
//   busbw_gbps             nccl-tests' bus bandwidth of one collective (`collective:` op, bytes)
//                          over the scenario's num_gpus
//   throughput_ratio       a list of `variants`, each a set of scenario keys changed and its
//                          published throughput, against the `baseline`'s: each variant is a row
//                          whose figure is its throughput over the baseline's
// Error = predicted / published - 1 for throughputs, published / predicted - 1 for times: positive
// when the prediction is faster than the measurement.
//
// A row may also give `memory_gib`, the peak memory per GPU the source measured (GiB, as its
// table defines it: torchtitan's is PyTorch's peak reserved bytes): a memory row beside it, held
// against the simulator's peak per GPU (error predicted / published - 1: positive when more is
// predicted), accepted like the others and summed up on its own, not into the sources' figures.
#pragma once

#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "core/model_error.h"
#include "core/model_shape.h"
#include "core/scenario.h"

namespace trainsim::validation {

// The FLOP counts the sources quote their throughput in (see above).
double megatron_flops_per_step(const ModelShape& m, double batch);
double palm_flops_per_token(const ModelShape& m);

struct PublishedVariant {
  std::string label;
  double value = 0;
  std::vector<std::pair<std::string, std::string>> set;  // key path -> YAML text of the value
};

struct PublishedFile {
  std::string file;  // path as found
  std::string source, citation, label, note;
  std::string metric;       // one of the names above
  std::string flops;        // tflops_per_gpu: megatron | palm
  double value = 0;
  double memory_gib = 0;    // 0: not published
  std::string collective;   // busbw_gbps: all_reduce | reduce_scatter | all_gather
  double bytes = 0;
  std::string baseline_label;  // throughput_ratio
  std::vector<PublishedVariant> variants;
  Scenario scenario;
};

struct FidelityRow {
  std::string id;      // file stem, plus "#variant" for ratio rows
  std::string source, label, metric, citation;
  int gpus = 0;
  double published = 0, predicted = 0;
  bool time = false;  // a time (step_time_s): lower is faster
  // The throughput error: positive when the prediction is faster than the measurement.
  double error() const {
    if (published <= 0 || predicted <= 0) return 0;
    return time ? published / predicted - 1 : predicted / published - 1;
  }
  std::string detail;  // the algorithm a collective used, and the like
};

struct SourceSummary {
  std::string source;
  int rows = 0;
  double mean_abs = 0, max_abs = 0;
  int min_gpus = 0, max_gpus = 0;
};

struct FidelityReport {
  std::vector<FidelityRow> rows;
  std::vector<SourceSummary> sources;  // in order of first appearance
  SourceSummary overall;
  // Peak memory per GPU where the source published it (metric peak_memory_gib, id "<row>@memory"),
  // and their summary (source "peak memory").
  std::vector<FidelityRow> memory;
  SourceSummary memory_overall;
};

// Reads every *.yaml of `folder` except accepted.yaml. Throws ScenarioError (file, line, key)
// on a malformed file.
std::vector<PublishedFile> load_published(const std::string& folder);
PublishedFile load_published_file(const std::string& path);
// When the file at `path` is a published row (a YAML map whose top level holds `published:` and
// `scenario:`), its `scenario:` section as the text of a scenario file, with the row file's own
// line numbers; nothing for any other file (a scenario, or a file that does not read as YAML,
// which the scenario loader then reports). Every command that reads a scenario accepts a row so
// (`trainsim simulate validation/published/ROW.yaml --kernels`): the run the source states.
std::optional<std::string> published_row_scenario_text(const std::string& path);

FidelityReport run_fidelity(const std::vector<PublishedFile>& files);
// Sets `key` (a scenario key path) to `value` (YAML) in every row's scenario: what-if runs and the
// ablations of docs/model.md. Throws ScenarioError for an unknown key or a bad value.
void override_all(std::vector<PublishedFile>& files, const std::string& key, const std::string& value);

std::string format_fidelity(const FidelityReport& r);
// Predicted against published, log-log, one colour per source, the diagonal and +-5% bands.
void write_fidelity_svg(const FidelityReport& r, std::ostream& out);

// The accepted errors (accepted.yaml beside the rows): each row's error as accepted and how far
// a prediction may move from it; and the targets per source and overall.
struct AcceptedErrors {
  double target_mean = kFidelityTargetMeanError, target_max = kFidelityTargetMaxError, tolerance = 0.002;
  std::map<std::string, double> rows;  // id -> accepted error
  // Per source (and "all"): the mean and max |error| accepted with the rows. A source whose mean
  // or max rises above its accepted figure by more than `tolerance` is a regression.
  struct Figures {
    double mean = 0, max = 0;
  };
  std::map<std::string, Figures> sources;
};
AcceptedErrors load_accepted(const std::string& path);
std::string accepted_to_yaml(const FidelityReport& r, const AcceptedErrors& previous);
// Problems, one line each: a row that moved from its accepted error, a row without one, an
// accepted row that is gone, a source (or the whole set) whose mean or max |error| rose above its
// accepted figure. Empty: passed (the model is deterministic, so any move is a change of the model
// that must be accepted on purpose).
std::vector<std::string> check_fidelity(const FidelityReport& r, const AcceptedErrors& accepted);
// The sources (and the whole set) whose mean or max |error| is over the targets, one line each:
// reported, not gated.
std::vector<std::string> target_misses(const FidelityReport& r, const AcceptedErrors& accepted);

}  // namespace trainsim::validation
