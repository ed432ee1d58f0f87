// Checks every benchmark table must pass, whatever the transport (the in-process world's in
// tests/runtime/test_calibrate_comm.cpp, the single-GPU world's in tests/cuda/test_calibrate_cuda.cpp):
// nccl-tests' definitions of the columns, exact data, sizes doubling from min_bytes per section.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <string>

#include "runtime/calibrate/comm_bench.h"

namespace trainsim::runtime::testing {

// `element_bytes`: the all-reduce wire format's bytes per element (sendrecv rows move floats).
inline void expect_rows_follow_the_definitions(const CommBenchResult& r, const CommBenchOptions& o, int element_bytes) {
  ASSERT_FALSE(r.rows.empty());
  for (std::size_t i = 0; i < r.rows.size(); ++i) {
    const CollectiveRow& row = r.rows[i];
    SCOPED_TRACE(row.op + " ranks " + std::to_string(row.ranks) + " bytes " + std::to_string(row.bytes));
    EXPECT_EQ(row.wrong, 0);
    EXPECT_GT(row.time_us, 0.0);
    EXPECT_TRUE(std::isfinite(row.time_us));
    EXPECT_GT(row.algbw_gbps, 0.0);
    EXPECT_GE(row.iters, 1);
    EXPECT_DOUBLE_EQ(row.algbw_gbps, double(row.bytes) / (row.time_us * 1e-6) / 1e9);
    if (row.op == "sendrecv") {
      EXPECT_EQ(row.ranks, 2);
      EXPECT_EQ(row.redop, "none");
      EXPECT_EQ(row.type, "float");
      EXPECT_EQ(row.count * 4, row.bytes);
      EXPECT_EQ(row.busbw_gbps, row.algbw_gbps);
    } else {
      ASSERT_EQ(row.op, "all_reduce");
      EXPECT_EQ(row.count * std::size_t(element_bytes), row.bytes);
      const int n = row.ranks;
      EXPECT_EQ(row.busbw_gbps, row.algbw_gbps * (2.0 * (n - 1) / n));
    }
    const bool section_start = i == 0 || r.rows[i - 1].op != row.op || r.rows[i - 1].ranks != row.ranks ||
                               r.rows[i - 1].redop != row.redop;
    EXPECT_EQ(row.bytes, section_start ? o.min_bytes : 2 * r.rows[i - 1].bytes);
  }
}

}  // namespace trainsim::runtime::testing
