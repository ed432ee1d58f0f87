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

// The all_gather and reduce_scatter rows of a run whose options listed `listed` bytes for both
// (and no sweep of them): exact (#wrong 0), each size rounded down to a whole number of elements
// per member, nccl-tests' bus factor (n-1)/n, one section per op per group size of o.
inline void expect_half_ring_rows(const CommBenchResult& r, const CommBenchOptions& o,
                                  const std::vector<std::size_t>& listed, int element_bytes) {
  for (const char* op : {"all_gather", "reduce_scatter"})
    for (int n : o.group_sizes) {
      SCOPED_TRACE(std::string(op) + " over " + std::to_string(n));
      std::vector<CollectiveRow> rows;
      for (const CollectiveRow& row : r.rows)
        if (row.op == op && row.ranks == n) rows.push_back(row);
      std::vector<std::size_t> want;
      for (std::size_t b : listed) {
        const std::size_t per_member = b / std::size_t(element_bytes) / std::size_t(n);
        if (per_member > 0 && (want.empty() || want.back() != per_member * n)) want.push_back(per_member * n);
      }
      ASSERT_EQ(rows.size(), want.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(rows[i].count, want[i]);
        EXPECT_EQ(rows[i].bytes, want[i] * std::size_t(element_bytes));
        EXPECT_EQ(rows[i].wrong, 0);
        EXPECT_EQ(rows[i].redop, std::string(op) == "all_gather" ? "none" : "sum");
        EXPECT_GT(rows[i].time_us, 0.0);
        EXPECT_EQ(rows[i].busbw_gbps, rows[i].algbw_gbps * ((n - 1.0) / n));
      }
    }
}

}  // namespace trainsim::runtime::testing
