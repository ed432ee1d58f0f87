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
//    reports the median over the timed calls. In-process all_reduce calls are timed as a step
//    times a collective: from the moment its last member started it (the barrier releases the
//    ranks a wake-up apart), and on buffers the caches no longer hold, behind lines waiting to be
//    written back (ranks that have a core each write other data first, twice the last-level
//    cache in all), as a step's gradient buckets are when they are reduced: its backward wrote
//    them long before, and much else since.
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
//  * all_gather, reduce_scatter (nccl-tests' all_gather_perf and reduce_scatter_perf): the
//    ring's halves in place over the same world; `bytes` is the whole buffer (n chunks, its count
//    a multiple of n). An all_gather starts with each rank's own chunk and NaN elsewhere and is
//    checked everywhere; a reduce_scatter is checked on the rank's own chunk (the rest is
//    unspecified). Tensor parallelism's sequence-parallel collectives and ZeRO's shards are
//    priced from these rows where a profile holds them; an all-reduce's cost is not theirs on
//    every transport (the single-GPU world's all-reduce moves about 5 buffers a member, its
//    all-gather 2).
//
// Sizes. `bytes` is what the modelled wire moves: count · (bytes per element of the wire
// format), as nccl-tests counts them. Buffers stay float in memory whatever the wire format
// (low precision is emulated by rounding), and the in-process communicator moves 4 bytes per
// element, so an fp16 or bf16 row of B bytes moves 2·B bytes in memory and shows about half
// the bandwidth of an fp32 row of the same size: that is what the in-process backend costs.
//
// Bandwidths: algbw = bytes / time; busbw (nccl-tests' PERFORMANCE.md) = algbw · 2(n-1)/n for
// an all-reduce of n ranks, algbw · (n-1)/n for an all-gather or reduce-scatter, algbw for
// sendrecv. GB/s is 1e9 bytes per second.
#pragma once

#include <chrono>
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
  std::string op;                 // "all_reduce", "all_gather", "reduce_scatter" or "sendrecv"
  int ranks = 0;                  // group size
  std::size_t bytes = 0;          // buffer size (collectives: the whole buffer; sendrecv: the message)
  std::size_t count = 0;          // elements
  std::string type = "float";     // element type as nccl-tests names it (float, half, bfloat16: wire format)
  std::string redop = "sum";      // "sum"/"max" for all_reduce, "none" for sendrecv
  double time_us = 0;             // median over iterations of the slowest rank's time per call
  double algbw_gbps = 0;          // bytes / time   (GB/s = 1e9 B/s)
  double busbw_gbps = 0;          // all_reduce: algbw * 2(n-1)/n; all_gather, reduce_scatter: algbw * (n-1)/n; sendrecv: algbw
  std::int64_t wrong = 0;         // elements that differ from the expected result (#wrong)
  int warmup_iters = 0;           // warm-up calls run for this row (after scaling for size)
  int iters = 0;                  // timed calls the median is taken over (after scaling for size)
};

// Fits are core/hardware_profile.h's LinkFit: t = latency + bytes / bandwidth (all_reduce: bus
// bytes = bytes*2(n-1)/n).

struct CommBenchOptions {
  std::vector<int> group_sizes;        // all_reduce group sizes, e.g. {2, 4}; default: {2}
  std::size_t min_bytes = 8, max_bytes = 64u << 20;  // sizes double from min to max, like nccl-tests -b 8 -e 64M -f 2
  // When not empty: the sendrecv / all_reduce rows at exactly these sizes (bytes, each at least
  // one element of the row's format; any order, repeats once) instead of min_bytes doubling to
  // max_bytes. `validate` measures only the rows its plan's prediction reads.
  std::vector<std::size_t> sendrecv_sizes, all_reduce_sizes;
  // all_gather and reduce_scatter (sum) rows per group size at exactly these sizes (bytes of the
  // whole buffer, rounded down to a whole number of elements per member); none when empty (no
  // sweep: `validate` asks for the sizes its plan gathers and scatters).
  std::vector<std::size_t> all_gather_sizes, reduce_scatter_sizes;
  // Calls per size. Scaled down automatically for big buffers so a full run stays under ~3 s
  // on 2 cores: a size of B bytes runs min(iters, max(2, 64 MiB / B)) timed calls and
  // min(warmup_iters, max(1, 32 MiB / B)) warm-ups (CollectiveRow says how many it ran).
  int warmup_iters = 2, iters = 10;
  DType wire = DType::fp32;            // all_reduce wire format: fp32, tf32, fp16 or bf16 (no fp8)
  std::vector<ReduceOp> redops = {ReduceOp::sum};  // one all_reduce table per group size and op
  bool sendrecv = true;                // run the point-to-point table (and fit `p2p`)
  // In-process worlds whose ranks each have a core (they are pinned then): how long a waiting rank
  // polls before it sleeps (InProcessWorld's `poll`), as the engine that will run the plan does.
  std::chrono::microseconds poll{0};
  // Called as each row is finished (progress / streaming print), on a benchmark thread, one
  // row at a time, in the order of CommBenchResult::rows. An exception it throws stops the
  // run and comes out of bench_in_process_comm.
  std::function<void(const CollectiveRow&)> on_row;
};

struct CommBenchResult {
  std::vector<CollectiveRow> rows;      // sendrecv rows, then per group size (options' order) all_reduce per op, all_gather, reduce_scatter; sizes ascending
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
// origin (latency 0); if the slope is not positive, the time has no size term: bandwidth 0 (the
// profile's "no bandwidth term", LinkFit::seconds; an infinity would not load back) and latency
// the weighted mean time. Needs at least two points with distinct x, x >= 0 and t > 0 (finite);
// throws std::invalid_argument otherwise. Exposed for tests.
LinkFit fit_latency_bandwidth(const std::vector<std::pair<double, double>>& bytes_and_seconds);

// The largest data cache of this machine (sysfs), or 32 MiB when it does not say.
std::size_t last_level_cache_bytes();

// Elements where got[i] != expected[i] (NaN always counts as wrong): the #wrong column.
// Throws std::invalid_argument if the sizes differ.
std::int64_t count_wrong(std::span<const float> got, std::span<const float> expected);

// nccl-tests' name for the element type on the wire: "float", "tf32", "half", "bfloat16".
std::string nccl_type_name(DType wire);

// min_bytes, doubling up to max_bytes: the sizes a row series runs without a list (nccl-tests
// -b -e -f 2).
std::vector<std::size_t> doubling_sizes(const CommBenchOptions& o);

// ---------------------------------------------------------------------------------------
// The benchmark over any transport. bench_in_process_comm is these pieces over the in-process
// world; the CUDA backend's bench_device_world_comm (runtime/cuda/calibrate_cuda.h) is them over
// the single-GPU world. A transport keeps only what is its own: the world, the ranks' threads
// and buffers, the calls, their timing and the data's way to and from the host.
// ---------------------------------------------------------------------------------------

// `options` checked for a transport, with group_sizes defaulted to {2}. Throws
// std::invalid_argument, saying which field and what is accepted, for a wire format not in
// `wires` ("calibrate: wire <w> is not a format <transport> moves; accepted: ..."), sizes below
// one float element or reversed (a listed size: below one element of its row's format), iters < 1, warmup_iters < 0, a group size below 2, above
// `max_ranks` (when positive: "<transport> reduces over at most <max_ranks> ranks"), repeated,
// or too large to check exactly in the wire format, and empty or repeated redops.
CommBenchOptions checked_comm_options(const CommBenchOptions& options, std::span<const DType> wires,
                                      const std::string& transport, int max_ranks = 0);

struct CommSize {                 // one row's size and calls (see CommBenchOptions::iters)
  std::size_t bytes = 0, count = 0;
  int warmup = 0, iters = 0;
};

// One section of the table: an op on a world of `ranks`, one row per size, with the exact
// contributions and expected result (the top of this file). A transport runs the op itself:
//  * "sendrecv": rank 0 sends its buffer to rank 1 and receives it back, rank 1 receives and
//    echoes it; rank 0's time is the round trip / 2, rank 1's does not count;
//  * "all_reduce": in place over `members` (0..ranks-1) with `reduce`, rounding to `wire`.
struct CommSection {
  std::string op, type, redop;   // the rows' columns
  int ranks = 0;
  std::vector<int> members;      // all_reduce: every rank
  ReduceOp reduce = ReduceOp::sum;
  DType wire = DType::fp32;      // a call's format on the wire: bytes = count * dtype_bytes(wire)
  double bus_factor = 1;         // busbw = algbw * bus_factor
  std::vector<CommSize> sizes;   // ascending
  std::size_t max_count = 0;     // the largest count and iters of `sizes`
  int max_iters = 0;
  // The result every rank must hold after a call, as host floats.
  std::function<void(std::span<float>)> fill_expected;
  // The part of rank r's buffer of `count` elements that holds the result: [first, second).
  // Empty: all of it.
  std::function<std::pair<std::size_t, std::size_t>(int, std::size_t)> checked;
  // Before each call (not timed): what rank r's buffer holds going in (sendrecv's rank 1: NaN,
  // so that a recv that writes nothing shows).
  std::function<void(int, std::span<float>)> prepare;
};

// The sections of a run of `options` (as checked_comm_options returns them), in the order of
// CommBenchResult::rows: sendrecv when options.sendrecv, then all_reduce per group size per op.
std::vector<CommSection> comm_sections(const CommBenchOptions& options);

// One rank's end of a transport in a section, as run_comm_section drives it.
struct CommRankCalls {
  // Each call's input (written by the section's prepare) and, after the call, its output
  // (checked against the expected result): at least the section's max_count elements.
  std::span<float> host;
  // Moves host's first `count` elements to where the call reads them; not timed, before the
  // ranks meet for the call. Empty when the call works on `host` itself.
  std::function<void(std::size_t count)> load;
  // One call of the section's op on `count` elements, timed inside, leaving its result in
  // host's first `count` elements. Returns this rank's seconds, or a negative number if this
  // rank's time does not count.
  std::function<double(std::size_t count)> call;
  // Leaves the caches as a step leaves them, after load and before each timed call (a warm-up's
  // caches do not matter); not timed. Empty: the caches as the previous call left them.
  std::function<void()> evict;
};

// Runs section `s` on one thread per rank and appends its rows to out.rows (calling
// options.on_row for each, on rank 0's thread). rank(r, measure) runs on rank r's thread: it
// sets the rank up (pinning, current device, buffers) and calls measure once with the rank's
// calls, which makes every call of every size. Before each call every rank prepares its
// buffer and loads it (and evicts, before a timed call), then all meet at a barrier; every
// call's output (warm-ups included) is checked. A row's time is the median over timed calls of
// the slowest rank's (at least 1 ns), its #wrong the sum over ranks and calls. The first failure
// on a rank calls abort(r, message) (the transport aborts its world, so ranks blocked in a call
// throw instead of waiting) and drops that rank from the barrier; it is rethrown once every
// thread has ended.
void run_comm_section(const CommSection& s, const CommBenchOptions& options, CommBenchResult& out,
                      const std::function<void(int, const std::function<void(const CommRankCalls&)>&)>& rank,
                      const std::function<void(int, const std::string&)>& abort);

// Fits `r`'s rows: p2p from the sendrecv rows, allreduce[n] from the all_reduce rows of n
// ranks (bus bytes); a fit of fewer than two sizes stays zero.
void fit_comm_rows(CommBenchResult& r);

// One table from the same benchmark run several times (between a run's steps, say): each row
// (matched by op, ranks, bytes, type and redop; in the order the first run that has it lists it)
// takes the median of its runs' times, its bandwidths follow that time, its #wrong and timed
// calls are the runs' sums; the fits are redone. Empty for no runs.
CommBenchResult median_of_runs(const std::vector<CommBenchResult>& runs);

// The table, as nccl-tests prints it: per op and group size a title line, the header
//   #       size         count      type   redop     time(us)  algbw(GB/s)  busbw(GB/s)  #wrong
// one line per row (8 whitespace-separated columns), the fitted latency and bandwidth, and
// "# Avg bus bandwidth    : x" over the section's rows; at the end "# Out of bounds
// values : N OK|FAILED" (nccl-tests' total of wrong elements).
std::string format_comm_table(const CommBenchResult& r);

}  // namespace trainsim::runtime
