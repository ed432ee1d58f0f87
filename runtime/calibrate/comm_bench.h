// The communication half of `trainsim calibrate --backend cpu`: point-to-point and
// all-reduce benchmarks over the Communicator interface (here the in-process one, ranks as
// threads), printed as the table engineers know from nccl-tests
//   size  count  type  redop  time(us)  algbw(GB/s)  busbw(GB/s)  #wrong
// with a data check on every call, and a latency/bandwidth fit per link the simulator's
// cost models can take.
//
// How a row is measured (nccl-tests' method, adapted to one process):
//  * warm-up calls, then timed calls. Before each call every rank refills its buffer with
//    its contribution and all ranks meet at a barrier, both outside the timed region; each
//    rank times its own call with steady_clock. A call's time is the slowest rank's; the row
//    reports the median over the timed calls.
//  * every call's output (warm-ups included) is compared element by element with the exact
//    expected result: contributions are small integers (rank r, element i: w(r)·(i mod m + 1),
//    w(r) = r + 1 and m = 7 where the wire format holds every partial sum exactly, smaller
//    otherwise), so sums are exact in fp32, tf32, fp16 and bf16 alike and any difference is a
//    wrong element (#wrong, summed over ranks and calls).
//  * sendrecv: ping-pong between ranks 0 and 1 of a world of two; time = round trip / 2 as
//    rank 0 measures it. Both the message rank 1 received and the echo rank 0 got back are
//    checked (rank 1's buffer is poisoned with NaN before each call). Messages travel as
//    float whatever `wire` says (send/recv carry floats), so these rows are type "float".
//  * all_reduce: the ring of comm/in_process.h over all ranks of a world of n, in place,
//    rounding to `wire`.
//
// Sizes. `bytes` is what the modelled wire moves: count · (bytes per element of the wire
// format), as nccl-tests counts them. Buffers stay float in memory whatever the wire format
// (low precision is emulated by rounding), and the in-process communicator moves 4 bytes per
// element, so an fp16 or bf16 row of B bytes moves 2·B bytes in memory and shows about half
// the bandwidth of an fp32 row of the same size: that is what the in-process backend costs.
//
// Bandwidths: algbw = bytes / time; busbw (nccl-tests' PERFORMANCE.md) = algbw · 2(n-1)/n for
// an all-reduce of n ranks, algbw for sendrecv. GB/s is 1e9 bytes per second.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/hardware_profile.h"
#include "runtime/comm/communicator.h"

namespace trainsim::runtime {

struct CollectiveRow {            // one line of the nccl-tests style table
  std::string op;                 // "all_reduce" or "sendrecv"
  int ranks = 0;                  // group size
  std::size_t bytes = 0;          // buffer size (all_reduce: the whole buffer; sendrecv: the message)
  std::size_t count = 0;          // elements
  std::string type = "float";     // element type as nccl-tests names it (float, half, bfloat16: wire format)
  std::string redop = "sum";      // "sum"/"max" for all_reduce, "none" for sendrecv
  double time_us = 0;             // median over iterations of the slowest rank's time per call
  double algbw_gbps = 0;          // bytes / time   (GB/s = 1e9 B/s)
  double busbw_gbps = 0;          // all_reduce: algbw * 2(n-1)/n ; sendrecv: algbw
  std::int64_t wrong = 0;         // elements that differ from the expected result (#wrong)
  int warmup_iters = 0;           // warm-up calls run for this row (after scaling for size)
  int iters = 0;                  // timed calls the median is taken over (after scaling for size)
};

// Fits are core/hardware_profile.h's LinkFit: t = latency + bytes / bandwidth (all_reduce: bus
// bytes = bytes*2(n-1)/n).

struct CommBenchOptions {
  std::vector<int> group_sizes;        // all_reduce group sizes, e.g. {2, 4}; default: {2}
  std::size_t min_bytes = 8, max_bytes = 64u << 20;  // sizes double from min to max, like nccl-tests -b 8 -e 64M -f 2
  // Calls per size. Scaled down automatically for big buffers so a full run stays under ~3 s
  // on 2 cores: a size of B bytes runs min(iters, max(2, 64 MiB / B)) timed calls and
  // min(warmup_iters, max(1, 32 MiB / B)) warm-ups (CollectiveRow says how many it ran).
  int warmup_iters = 2, iters = 10;
  DType wire = DType::fp32;            // all_reduce wire format: fp32, tf32, fp16 or bf16 (no fp8)
  std::vector<ReduceOp> redops = {ReduceOp::sum};  // one all_reduce table per group size and op
  bool sendrecv = true;                // run the point-to-point table (and fit `p2p`)
  // Called as each row is finished (progress / streaming print), on a benchmark thread, one
  // row at a time, in the order of CommBenchResult::rows. An exception it throws stops the
  // run and comes out of bench_in_process_comm.
  std::function<void(const CollectiveRow&)> on_row;
};

struct CommBenchResult {
  std::vector<CollectiveRow> rows;      // sendrecv rows, then all_reduce per group size (options' order), per op; sizes ascending
  LinkFit p2p;                          // from the sendrecv rows
  std::map<int, LinkFit> allreduce;     // per group size, from the all_reduce rows
};

// Runs the benchmarks on fresh in-process worlds (one thread per rank). Throws
// std::invalid_argument for options it cannot run (saying which field and what is accepted)
// and CommError if a communicator call fails; never hangs on a failed rank.
CommBenchResult bench_in_process_comm(const CommBenchOptions& options);

// Least-squares fit of t = latency + x / bandwidth (x in bytes, t in seconds) in relative
// error: minimises sum ((model - t) / t)^2, i.e. weighted least squares with weights 1/t^2,
// so small and large sizes both matter. Closed form (weighted means, centred). Parameters are
// kept physical: if the unconstrained latency is negative the fit is redone through the
// origin (latency 0); if the slope is not positive, bandwidth is +infinity and latency the
// weighted mean time. Needs at least two points with distinct x, x >= 0 and t > 0 (finite);
// throws std::invalid_argument otherwise. Exposed for tests.
LinkFit fit_latency_bandwidth(const std::vector<std::pair<double, double>>& bytes_and_seconds);

// Elements where got[i] != expected[i] (NaN always counts as wrong): the #wrong column.
// Throws std::invalid_argument if the sizes differ.
std::int64_t count_wrong(std::span<const float> got, std::span<const float> expected);

// nccl-tests' name for the element type on the wire: "float", "tf32", "half", "bfloat16".
std::string nccl_type_name(DType wire);

// The table, as nccl-tests prints it: per op and group size a title line, the header
//   #       size         count      type   redop     time(us)  algbw(GB/s)  busbw(GB/s)  #wrong
// one line per row (8 whitespace-separated columns), the fitted latency and bandwidth, and
// "# Avg bus bandwidth    : x" over the section's rows; at the end "# Out of bounds
// values : N OK|FAILED" (nccl-tests' total of wrong elements).
std::string format_comm_table(const CommBenchResult& r);

}  // namespace trainsim::runtime
