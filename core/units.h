// Units of time, size and rate, and the only place they are converted.
//
// Simulated and measured time is an integer number of picoseconds (`Tick`): sums of
// thousands of op durations must not accumulate floating-point error, and ties between
// events must compare exactly. int64 picoseconds cover about 106 days.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace trainsim {

using Tick = std::int64_t;  // picoseconds
using Bytes = std::int64_t;

inline constexpr Tick kTicksPerSecond = 1'000'000'000'000;
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
inline constexpr double kMiB = 1024.0 * 1024.0;
inline constexpr double kGB = 1e9;  // bandwidth_gbps keys are in GB/s = 1e9 bytes/s

// The longest time a Tick holds, and what a plan gets that needs longer (a model far too large
// for its cluster): std::invalid_argument, as for any plan that cannot be run, never a wrapped
// integer (sweeps skip the configuration; the CLI calls it bad input).
inline constexpr double kMaxTickSeconds = 9.2e6;  // just under INT64_MAX picoseconds
[[noreturn]] inline void beyond_tick_range(double seconds) {
  throw std::invalid_argument("a simulated time of " + std::to_string(seconds) +
                              " s is beyond what the simulator represents (int64 picoseconds, about 106 days): "
                              "the plan is far too large for its cluster (model size, peak_tflops, bandwidths)");
}

// Rounds to the nearest tick; durations of real work are never rounded down to zero. NaN,
// infinite and too large times throw (beyond_tick_range).
inline Tick seconds_to_ticks(double seconds) {
  if (seconds <= 0) return 0;
  if (!(seconds < kMaxTickSeconds)) beyond_tick_range(seconds);
  Tick t = static_cast<Tick>(seconds * static_cast<double>(kTicksPerSecond) + 0.5);  // positive: round half up
  return t > 0 ? t : 1;
}
// A point in time plus a duration (both >= 0), checked: ops that each fit a Tick can still
// add up past it.
inline Tick add_ticks(Tick at, Tick duration) {
  Tick sum = 0;
  if (__builtin_add_overflow(at, duration, &sum))
    beyond_tick_range(static_cast<double>(at) / kTicksPerSecond + static_cast<double>(duration) / kTicksPerSecond);
  return sum;
}
inline double ticks_to_seconds(Tick t) { return static_cast<double>(t) / static_cast<double>(kTicksPerSecond); }
inline double bytes_to_gib(double b) { return b / kGiB; }
inline double gib_to_bytes(double gib) { return gib * kGiB; }
inline double mib_to_bytes(double mib) { return mib * kMiB; }
inline double gbps_to_bytes_per_second(double gbps) { return gbps * kGB; }
inline double us_to_seconds(double us) { return us * 1e-6; }
inline double tflops_to_flops(double tflops) { return tflops * 1e12; }

}  // namespace trainsim
