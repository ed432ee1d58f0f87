// Evicting the calling core's own cache before a timed call, so that the call finds its
// operands in the shared last-level cache or memory, as it does inside a training step where
// the work before it has streamed megabytes of its own through the core's cache.
#pragma once

#include <unistd.h>

#include <vector>

namespace trainsim::runtime {

// Writes over a buffer twice the size of the core's L2 (one per thread).
inline void evict_core_cache() {
  thread_local std::vector<float> junk = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return std::vector<float>(static_cast<std::size_t>(2 * (l2 > 0 ? l2 : 2 << 20)) / sizeof(float), 1.0f);
  }();
  for (float& x : junk) x += 1.0f;
}

}  // namespace trainsim::runtime
