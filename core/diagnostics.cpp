#include "core/diagnostics.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

namespace trainsim {

std::string format_diagnostic(const Diagnostic& d) {
  std::string loc = d.file.empty() ? "<scenario>" : d.file;
  if (d.where.line > 0) loc += fmt::format(":{}:{}", d.where.line, d.where.column);
  if (d.key_path.empty()) return fmt::format("{}: error: {}", loc, d.message);
  return fmt::format("{}: error: {}: {}", loc, d.key_path, d.message);
}

namespace {
std::string join_messages(const std::vector<Diagnostic>& ds) {
  std::string s;
  for (const auto& d : ds) s += (s.empty() ? "" : "\n") + format_diagnostic(d);
  return s;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  std::iota(prev.begin(), prev.end(), 0);
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

ScenarioError::ScenarioError(std::vector<Diagnostic> diagnostics)
    : std::runtime_error(join_messages(diagnostics)), diagnostics_(std::move(diagnostics)) {}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    std::size_t d = edit_distance(word, c);
    // A candidate that contains the word (or vice versa) is a good hint too: "dp" vs "data_parallel_size" is not.
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  // Accept up to a third of the word's length in edits (at least 2), as compilers do for typos.
  std::size_t limit = std::max<std::size_t>(2, word.size() / 3);
  return best_d <= limit ? best : std::string();
}

}  // namespace trainsim
