// splitmix64 (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number generators"): the
// one source of the runtime's random numbers (initial weights, the data order, the operands the
// calibration times), integer arithmetic only, so a seed gives the same numbers on every
// platform and standard library.
#pragma once

#include <cstdint>

namespace trainsim::runtime {

inline constexpr std::uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, odd

// The finaliser: a bijection of 64-bit words in which every input bit moves every output bit.
// Counter-based use: splitmix64_mix(key + i * kSplitMixGamma) is the i-th number of stream `key`.
constexpr std::uint64_t splitmix64_mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The sequential generator: the finaliser of a counter stepped by the gamma.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() { return splitmix64_mix(state_ += kSplitMixGamma); }
  // Uniform in [0, n) by the multiply-shift reduction (no modulo bias worth the name for
  // n < 2^32, and no platform-dependent distribution code).
  std::uint32_t below(std::uint32_t n) {
    return static_cast<std::uint32_t>(((next() >> 32) * static_cast<std::uint64_t>(n)) >> 32);
  }

 private:
  std::uint64_t state_;
};

}  // namespace trainsim::runtime
