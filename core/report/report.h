// What a person or a program reads: the text summary, the JSON result object of
// DESIGN.md, a Chrome/Perfetto trace and an SVG timeline. All are computed from a Result
// and a Timeline, so predicted and measured runs are reported by the same code.
#pragma once

#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/plan.h"
#include "core/result.h"
#include "core/timeline.h"

namespace trainsim {

// Readable summary: step time, tokens/s, MFU, bubble, all-reduce (total and exposed),
// per-rank utilization and memory, fit, warnings.
std::string format_summary(const Plan& plan, const Result& result);

// The DESIGN.md result object (memory in GiB). Keys in a fixed order, so the same input
// gives byte-identical output.
nlohmann::ordered_json result_to_json(const Result& result);

// Chrome trace event format (opens in Perfetto and chrome://tracing): one process per
// rank, one thread (track) per stream, ops named F3/B3/... with stage and micro-batch in args.
void write_chrome_trace(const Plan& plan, const Timeline& timeline, std::ostream& out);

// A self-contained SVG: one row per rank, forward, backward, communication and idle time
// in distinguishable colours, with a time axis and a legend.
// `time_span`: the width of the time axis (0: the timeline's own), so that two pictures can
// share one scale.
void write_timeline_svg(const Plan& plan, const Timeline& timeline, const Result& result, std::ostream& out,
                        Tick time_span = 0);
// Several SVGs from write_timeline_svg (or any with width and height on their first line)
// one above the other, in one document.
void stack_svgs(const std::vector<std::string>& svgs, std::ostream& out);
// Several timelines of one plan in one trace, each rank of timeline k as process
// k * 1000 + rank, named after its label ("predicted", "measured"), on one time origin each.
void write_chrome_traces(const Plan& plan, const std::vector<std::pair<std::string, const Timeline*>>& timelines,
                         std::ostream& out);

}  // namespace trainsim
