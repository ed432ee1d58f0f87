// Units of time, size and rate, and the only place they are converted.
//
// Simulated and measured time is an integer number of picoseconds (`Tick`): sums of
// thousands of op durations must not accumulate floating-point error, and ties between
// events must compare exactly. int64 picoseconds cover about 106 days.
#pragma once

#include <cmath>
#include <cstdint>

namespace trainsim {

using Tick = std::int64_t;  // picoseconds
using Bytes = std::int64_t;

inline constexpr Tick kTicksPerSecond = 1'000'000'000'000;
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
inline constexpr double kMiB = 1024.0 * 1024.0;
inline constexpr double kGB = 1e9;  // bandwidth_gbps keys are in GB/s = 1e9 bytes/s

// Rounds to the nearest tick; durations of real work are never rounded down to zero.
inline Tick seconds_to_ticks(double seconds) {
  if (seconds <= 0) return 0;
  Tick t = static_cast<Tick>(seconds * static_cast<double>(kTicksPerSecond) + 0.5);  // positive: round half up
  return t > 0 ? t : 1;
}
inline double ticks_to_seconds(Tick t) { return static_cast<double>(t) / static_cast<double>(kTicksPerSecond); }
inline double bytes_to_gib(double b) { return b / kGiB; }
inline double gib_to_bytes(double gib) { return gib * kGiB; }
inline double mib_to_bytes(double mib) { return mib * kMiB; }
inline double gbps_to_bytes_per_second(double gbps) { return gbps * kGB; }
inline double us_to_seconds(double us) { return us * 1e-6; }
inline double tflops_to_flops(double tflops) { return tflops * 1e12; }

}  // namespace trainsim
