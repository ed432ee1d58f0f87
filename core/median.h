// The median of a sample (the mean of the two middle values for an even count; 0 for none):
// what calibration, the communication benchmark and the baselines' check summarise with.
#pragma once

#include <algorithm>
#include <vector>

namespace trainsim {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const std::size_t m = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(m), v.end());
  if (v.size() % 2 == 1) return v[m];
  const double upper = v[m];
  return 0.5 * (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(m)) + upper);
}

}  // namespace trainsim
