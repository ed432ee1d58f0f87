#include "core/diagnostics.h"

#include <algorithm>
#include <cctype>

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
  for (const auto& d : ds) {
    if (!s.empty()) s += '\n';
    s += format_diagnostic(d);
  }
  return s;
}

// Optimal string alignment distance: insertions, deletions, substitutions and swaps of
// two neighbouring letters ("cdua" is one edit from "cuda", as a typist would count it).
std::size_t edit_distance(const std::string& a, const std::string& b) {
  // Three rows of the table (a transposition looks two rows back), not a row per character:
  // the loader calls this for every unknown key against every key name.
  const std::size_t n = b.size();
  std::vector<std::size_t> before(n + 1), prev(n + 1), cur(n + 1);
  for (std::size_t j = 0; j <= n; ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= n; ++j) {
      std::size_t d = std::min(prev[j] + 1, cur[j - 1] + 1);
      d = std::min(d, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1));
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d = std::min(d, before[j - 2] + 1);
      cur[j] = d;
    }
    std::swap(before, prev);
    std::swap(prev, cur);
  }
  return prev[n];
}

std::string lowercase(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool is_separator(char c) { return c == '-' || c == '_' || c == '.' || c == ' '; }

// The words of a name split at '-', '_', '.' and spaces, sorted.
std::vector<std::string> sorted_words(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (is_separator(c)) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  std::sort(out.begin(), out.end());
  return out;
}

// True when `part` occurs in `whole` starting and ending at word boundaries.
bool contains_on_boundaries(const std::string& whole, const std::string& part) {
  if (part.empty()) return false;
  for (std::size_t pos = whole.find(part); pos != std::string::npos; pos = whole.find(part, pos + 1)) {
    const std::size_t end = pos + part.size();
    const bool starts = pos == 0 || is_separator(whole[pos - 1]);
    const bool ends = end == whole.size() || is_separator(whole[end]);
    if (starts && ends) return true;
  }
  return false;
}
}  // namespace

ScenarioError::ScenarioError(std::vector<Diagnostic> diagnostics)
    : std::runtime_error(join_messages(diagnostics)), diagnostics_(std::move(diagnostics)) {}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  // Case does not count ("Num_GPUs" is a typo of "num_gpus").
  const std::string w = lowercase(word);
  // Accept up to a third of the word's length in edits (at least 2), as compilers do for typos.
  const std::size_t limit = std::max<std::size_t>(2, word.size() / 3);
  std::string best;
  std::size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    // The lengths' difference is a lower bound of the distance: a candidate that cannot be
    // accepted, or cannot beat the best so far, is not measured (a long unknown key would
    // otherwise be compared character by character with every key name).
    const std::size_t gap = w.size() > c.size() ? w.size() - c.size() : c.size() - w.size();
    if (gap > limit || gap >= best_d) continue;
    std::size_t d = edit_distance(w, lowercase(c));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  if (best_d <= limit) return best;

  // The same words in another order: "1f1b-interleaved" for "interleaved-1f1b".
  const std::vector<std::string> wt = sorted_words(w);
  if (wt.size() > 1)
    for (const auto& c : candidates)
      if (sorted_words(lowercase(c)) == wt) return c;

  // One contains the other, on word boundaries: "micro_batch_size" for the sweep axis
  // "training.micro_batch_size". Short words are left out: "dp" is in too many names.
  constexpr std::size_t kMinContained = 5;
  best.clear();
  best_d = std::string::npos;
  for (const auto& c : candidates) {
    const std::string lc = lowercase(c);
    const bool contained = (w.size() >= kMinContained && contains_on_boundaries(lc, w)) ||
                           (lc.size() >= kMinContained && contains_on_boundaries(w, lc));
    if (!contained) continue;
    // One holds the other: the distance is the letters the longer has beyond the shorter.
    const std::size_t d = w.size() > lc.size() ? w.size() - lc.size() : lc.size() - w.size();
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

}  // namespace trainsim
