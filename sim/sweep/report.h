// What a person or a program reads from a sweep or a plan: a ranked table, CSV, JSON and an
// SVG scatter plot (throughput against peak memory per GPU, Pareto front marked). Everything
// is a function of the SweepResult alone, so output is byte-identical whatever the thread
// count; nothing here prints timings.
//
// JSON row (sweep_row_to_json; metric fields are null when the row was not simulated):
//   {"rank": 1 | null, "index": 17, "config": {"parallelism.pipeline_parallel_size": 2, ...},
//    "status": "ok" | "out_of_memory" | "invalid" | "unsupported_precision" | "constraint",
//    "reason": "",  "step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "allreduce_time_s",
//    "exposed_comm_time_s", "peak_memory_gib", "peak_memory_rank", "memory_capacity_gib",
//    "headroom_gib", "num_microbatches", "global_batch_size", "pareto": true | false,
//    "warnings": [...]}, plus pipeline_bubble_fraction, exposed_comm_fraction, the per-GPU
//    figures, time_to_train_s / gpu_hours / cost (null when not given), binding and shortfall
//    (null for feasible rows).
#pragma once

#include <cstddef>
#include <iosfwd>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/scenario.h"
#include "sim/sweep/advice.h"
#include "sim/sweep/sweep.h"

namespace trainsim {

// ---- sweep ----------------------------------------------------------------------------

// The best `top` feasible rows (rank, swept values, micro-batches, tokens/s, step time,
// bubble, exposed communication, peak memory and headroom per GPU; * marks the Pareto
// front), then up to `infeasible` rows that cannot run, each with its reason.
std::string format_sweep_table(const SweepResult& sweep, const std::string& title, std::size_t top = 10,
                               std::size_t infeasible = 10);

// What follows the table: each swept setup's best configuration (hardware compared, each on
// its own best layout), why `trainsim plan` may choose differently, and, when nothing is
// feasible, the smallest need, the nearest misses with the limit that bound each, and what
// would make it fit.
std::string format_sweep_notes(const SweepResult& sweep, const Scenario& scenario);

nlohmann::ordered_json sweep_row_to_json(const SweepRow& row, std::optional<std::size_t> rank, bool pareto);

// {"scenario", "name", "axes": [{"key", "values"} | {"key", "generated": "auto"}],
//  "constraints": {...}, "counts": {"total", "ok", "out_of_memory", "invalid",
//  "unsupported_precision", "constraint"}, "best": index | null, "pareto": [index...],
//  "rows": [row... in SweepResult::order]}
nlohmann::ordered_json sweep_to_json(const SweepResult& sweep, const Scenario& scenario);

// One line per configuration in SweepResult::order: rank, index, the swept keys, status,
// reason, then the metric columns of the JSON row (empty when not simulated).
void write_sweep_csv(const SweepResult& sweep, std::ostream& out);

// Throughput against peak memory per GPU: feasible points, out-of-memory points and
// constraint violations distinguished, GPU memory (and max_memory_fraction) marked, the
// Pareto front drawn as a line, the best point labelled; every point has a tooltip.
void write_sweep_svg(const SweepResult& sweep, const Scenario& scenario, std::ostream& out);
// The same picture in a self-contained HTML page: hovering any point shows its swept
// configuration, status and figures in a box (no network access needed).
void write_sweep_html(const SweepResult& sweep, const Scenario& scenario, std::ostream& out);

// One line of a progress bar, e.g. "[#########...........]  412/960 configurations  85.3/s  6 s left".
std::string format_progress(const SweepProgress& progress, int bar_width = 30);

// ---- plan -----------------------------------------------------------------------------

// The plan in plain words: as written vs chosen, each change and what it buys, precision
// advice, runners-up.
std::string format_plan(const PlanResult& plan);

// {"scenario", "name", "search_space": {"default": bool, "axes": [...]}, "counts": {...},
//  "original": row, "chosen": row | null, "runners_up": [row...],
//  "changes": [{"keys", "change", "effect", "before": row, "after": row}],
//  "precision_advice": [{"id", "problem", "fix", "why", "changes": {key: value}}],
//  "scenario_fragment": {...} | null}
nlohmann::ordered_json plan_to_json(const PlanResult& plan);

}  // namespace trainsim
