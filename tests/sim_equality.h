// Bit-for-bit comparisons of two predictions' parts, for the tests that hold a fast path to the
// full simulation (test_engine.cpp's Predictor, test_step_program.cpp's step programs): on a
// mismatch they say which field differs.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>

#include "core/result.h"
#include "core/schedule.h"

namespace trainsim::testing {

// Every field of the op that the engine reads.
inline bool same_op(const Op& a, const Op& b) {
  return a.kind == b.kind && a.chunk == b.chunk && a.microbatch == b.microbatch && a.dep == b.dep &&
         a.peer == b.peer && a.channel == b.channel && a.bucket == b.bucket && a.bytes == b.bytes && a.work == b.work;
}

inline void expect_same_memory(const MemoryBreakdown& a, const MemoryBreakdown& b) {
  EXPECT_EQ(a.weights, b.weights);
  EXPECT_EQ(a.gradients, b.gradients);
  EXPECT_EQ(a.optimizer, b.optimizer);
  EXPECT_EQ(a.activations, b.activations);
  EXPECT_EQ(a.buffers, b.buffers);
}

// The whole Result: operator== covers every field, including any added to Result later; on a
// mismatch the lines below say which one differs.
inline void expect_same_result(const Result& got, const Result& want) {
  if (got == want) return;
  ADD_FAILURE() << "results differ";
  EXPECT_EQ(got.step_time_s, want.step_time_s);
  EXPECT_EQ(got.bubble_fraction, want.bubble_fraction);
  EXPECT_EQ(got.tokens_per_s, want.tokens_per_s);
  EXPECT_EQ(got.mfu, want.mfu);
  EXPECT_EQ(got.allreduce_time_s, want.allreduce_time_s);
  EXPECT_EQ(got.exposed_comm_time_s, want.exposed_comm_time_s);
  EXPECT_EQ(got.fits_in_memory, want.fits_in_memory);
  EXPECT_EQ(got.memory_capacity_bytes, want.memory_capacity_bytes);
  EXPECT_EQ(got.warnings, want.warnings);
  ASSERT_EQ(got.ranks.size(), want.ranks.size());
  for (std::size_t r = 0; r < got.ranks.size(); ++r) {
    const RankResult &x = got.ranks[r], &y = want.ranks[r];
    if (x == y) continue;
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    EXPECT_EQ(x.rank, y.rank);
    EXPECT_EQ(x.stage, y.stage);
    EXPECT_EQ(x.replica, y.replica);
    EXPECT_EQ(x.busy_s, y.busy_s);
    EXPECT_EQ(x.idle_s, y.idle_s);
    EXPECT_EQ(x.utilization, y.utilization);
    EXPECT_EQ(x.allreduce_s, y.allreduce_s);
    EXPECT_EQ(x.exposed_comm_s, y.exposed_comm_s);
    EXPECT_EQ(x.peak_memory_bytes, y.peak_memory_bytes);
    expect_same_memory(x.memory, y.memory);
  }
}

}  // namespace trainsim::testing
