// The SM arithmetic of the single-GPU multi-rank mode (runtime/cuda/sm_partition.h), without a GPU:
// per-rank partition sizes against hand-worked cases on real SM counts, and against the rule's
// defining properties over a grid of devices and rank counts.
#include <gtest/gtest.h>

#include "runtime/cuda/sm_partition.h"

namespace trainsim::runtime::cuda {
namespace {

// H100 SXM: 132 SMs, compute capability 9.0 (partitions of at least 8, multiples of 8).
// floor(132 / (ranks * 8)) * 8.
TEST(SmSplit, H100Sxm) {
  EXPECT_EQ(sms_per_rank(132, 1, 8, 8), 128);  // 16.5 units of 8 -> 16
  EXPECT_EQ(sms_per_rank(132, 2, 8, 8), 64);   // 66 -> 8 units
  EXPECT_EQ(sms_per_rank(132, 4, 8, 8), 32);   // 33 -> 4 units
  EXPECT_EQ(sms_per_rank(132, 8, 8, 8), 16);   // 16.5 -> 2 units; 128 used, 4 left over
  EXPECT_EQ(sms_per_rank(132, 9, 8, 8), 8);    // 14.7 -> 1 unit; 72 used
  EXPECT_EQ(sms_per_rank(132, 16, 8, 8), 8);   // 8.25 -> 1 unit; 128 used
  EXPECT_EQ(sms_per_rank(132, 17, 8, 8), 0);   // 17 x 8 = 136 > 132
}

// A100: 108 SMs, compute capability 8.0 (at least 4, multiples of 2).
TEST(SmSplit, A100) {
  EXPECT_EQ(sms_per_rank(108, 8, 4, 2), 12);  // 13.5 -> 6 units of 2
  EXPECT_EQ(sms_per_rank(108, 27, 4, 2), 4);  // exactly 4 each, nothing left over
  EXPECT_EQ(sms_per_rank(108, 28, 4, 2), 0);  // 28 x 4 = 112 > 108
}

TEST(SmSplit, MinimumNotAMultipleOfTheAlignmentRoundsUp) {
  // The smallest partition is 8 (5 rounded up to a multiple of 4).
  EXPECT_EQ(sms_per_rank(100, 10, 5, 4), 8);   // 10 each -> 8
  EXPECT_EQ(sms_per_rank(100, 12, 5, 4), 8);   // 8.3 -> 8
  EXPECT_EQ(sms_per_rank(100, 13, 5, 4), 0);   // 7.7 -> 4 < 8
}

TEST(SmSplit, DegenerateInputs) {
  EXPECT_EQ(sms_per_rank(0, 1, 8, 8), 0);
  EXPECT_EQ(sms_per_rank(132, 0, 8, 8), 0);
  EXPECT_EQ(sms_per_rank(132, -3, 8, 8), 0);
  EXPECT_EQ(sms_per_rank(-132, 2, 8, 8), 0);
  EXPECT_EQ(sms_per_rank(10, 3, 0, 0), 3);    // no granularity: whole SMs
  EXPECT_EQ(sms_per_rank(10, 11, 0, 0), 0);   // fewer SMs than ranks
  EXPECT_EQ(sms_per_rank(7, 1, 8, 8), 0);     // smaller than one partition
  EXPECT_EQ(sms_per_rank(8, 1, 8, 8), 8);
}

// The definition, checked independently of the formula: the result is a multiple of the
// alignment, at least the minimum, fits `ranks` times, and one more alignment unit would not;
// it is 0 exactly when `ranks` partitions of the smallest allowed size do not fit.
TEST(SmSplit, LargestAlignedPartitionThatFits) {
  const SmGranularity granularities[] = {{2, 2}, {4, 2}, {8, 8}, {5, 4}, {1, 1}};
  for (const SmGranularity g : granularities) {
    int smallest = g.alignment;
    while (smallest < g.min_partition) smallest += g.alignment;
    for (int total = 1; total <= 200; ++total) {
      for (int ranks = 1; ranks <= 40; ++ranks) {
        const int sms = sms_per_rank(total, ranks, g.min_partition, g.alignment);
        SCOPED_TRACE(testing::Message() << total << " SMs, " << ranks << " ranks, min " << g.min_partition
                                        << ", alignment " << g.alignment << " -> " << sms);
        if (ranks * smallest > total) {
          EXPECT_EQ(sms, 0);
          continue;
        }
        EXPECT_EQ(sms % g.alignment, 0);
        EXPECT_GE(sms, smallest);
        EXPECT_LE(ranks * sms, total);
        EXPECT_GT(ranks * (sms + g.alignment), total);
      }
    }
  }
}

// The driver documentation's table ("Green Contexts").
TEST(SmSplit, GranularityGuideline) {
  EXPECT_EQ(sm_granularity_guideline(10).min_partition, 8);  // Blackwell: 9.0+
  EXPECT_EQ(sm_granularity_guideline(10).alignment, 8);
  EXPECT_EQ(sm_granularity_guideline(9).min_partition, 8);
  EXPECT_EQ(sm_granularity_guideline(9).alignment, 8);
  EXPECT_EQ(sm_granularity_guideline(8).min_partition, 4);
  EXPECT_EQ(sm_granularity_guideline(8).alignment, 2);
  EXPECT_EQ(sm_granularity_guideline(7).min_partition, 2);
  EXPECT_EQ(sm_granularity_guideline(7).alignment, 2);
  EXPECT_EQ(sm_granularity_guideline(6).min_partition, 2);
  EXPECT_EQ(sm_granularity_guideline(6).alignment, 2);
  EXPECT_EQ(sm_granularity_guideline(5).min_partition, 0);
  EXPECT_EQ(sm_granularity_guideline(5).alignment, 0);
}

}  // namespace
}  // namespace trainsim::runtime::cuda
