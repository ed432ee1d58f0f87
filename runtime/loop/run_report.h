// What `trainsim run` shows: a readable summary (throughput, utilization and memory per
// rank, the loss curve as text), the JSON object (DESIGN.md's result fields, measured, plus
// `steps`), and an SVG with the measured timeline above the loss curve.
#pragma once

#include <iosfwd>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/contract.h"

namespace trainsim::runtime {

std::string format_run_summary(const RunReport& report);
nlohmann::ordered_json run_to_json(const RunReport& report);
void write_run_svg(const RunReport& report, std::ostream& out);

}  // namespace trainsim::runtime
