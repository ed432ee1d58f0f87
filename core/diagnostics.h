// Errors in a scenario, each with the file, line, column and key path it is about.
// Library code throws ScenarioError (carrying every problem found, not just the first);
// only main() turns it into an exit status.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace trainsim {

struct SourceLocation {
  int line = 0;    // 1-based; 0 when unknown
  int column = 0;  // 1-based; 0 when unknown
};

struct Diagnostic {
  std::string file;
  SourceLocation where;
  std::string key_path;  // e.g. "parallelism.data_parallel_size"; empty for file-level errors
  std::string message;
};

std::string format_diagnostic(const Diagnostic& d);

class ScenarioError : public std::runtime_error {
 public:
  explicit ScenarioError(std::vector<Diagnostic> diagnostics);
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::vector<Diagnostic> diagnostics_;
};

// Closest candidate by edit distance, for "did you mean" hints; empty when nothing is close.
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace trainsim
