#include "runtime/calibrate/comm_bench.h"

#include <pthread.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "core/median.h"
#include "runtime/comm/in_process.h"

namespace trainsim::runtime {

namespace {

using Clock = std::chrono::steady_clock;

// Calls per size for big buffers (CommBenchOptions::iters): a size of B bytes runs at most
// kTimedBytes / B timed calls (at least 2) and kWarmupBytes / B warm-ups (at least 1).
constexpr std::size_t kTimedBytes = std::size_t{64} << 20;
constexpr std::size_t kWarmupBytes = std::size_t{32} << 20;
// A call that has not completed after this long fails with CommError instead of hanging.
constexpr std::chrono::milliseconds kTimeout{60'000};
constexpr std::uint64_t kTag = 1;
constexpr int kPeriod = 7;  // element pattern i mod 7 + 1, as the brief's checkable values

// Significand bits (implicit bit included) of the wire format: integers up to 2^bits are exact.
int significand_bits(DType wire) {
  switch (wire) {
    case DType::fp32: return 24;
    case DType::tf32: return 11;
    case DType::fp16: return 11;
    case DType::bf16: return 8;
    case DType::fp8: break;
  }
  throw std::invalid_argument("calibrate: an fp8 wire format is not emulated by the in-process communicator; "
                              "accepted: fp32, tf32, fp16, bf16");
}

// Contributions: rank r, element i holds weight[r] * (i mod period + 1). Every partial sum of
// a ring is then an integer no larger than the full sum, so it is exact in the wire format as
// long as sum(weight) * period <= 2^significand_bits. The brief's pattern (weights r + 1,
// period 7) where it fits; a shorter period, then equal weights, where it does not.
struct Pattern {
  std::vector<float> weight;  // per rank
  int period = kPeriod;
};

Pattern pattern_for(int n, DType wire) {
  const double limit = std::ldexp(1.0, significand_bits(wire));
  Pattern p;
  const double triangle = 0.5 * n * (n + 1.0);
  if (2.0 * triangle <= limit) {
    for (int r = 0; r < n; ++r) p.weight.push_back(static_cast<float>(r + 1));
    p.period = static_cast<int>(std::min<double>(kPeriod, std::floor(limit / triangle)));
    return p;
  }
  if (2.0 * n > limit)
    throw std::invalid_argument(fmt::format(
        "calibrate: group size {} is too large to check an all_reduce exactly in {} (at most {} ranks)", n,
        dtype_name(wire), static_cast<long long>(limit / 2)));
  p.weight.assign(static_cast<std::size_t>(n), 1.0f);
  p.period = static_cast<int>(std::min<double>(kPeriod, std::floor(limit / n)));
  return p;
}

void fill(std::span<float> buf, float weight, int period) {
  int k = 0;
  for (float& x : buf) {
    x = weight * static_cast<float>(k + 1);
    if (++k == period) k = 0;
  }
}


// Runs body(rank, comm, barrier) on one thread per rank of a fresh world of n. The first
// failure aborts the world (so ranks blocked in a call throw instead of waiting) and drops
// the failing thread from the barrier (so ranks waiting there go on, and fail at their next
// call); it is rethrown here once every thread has ended.
template <typename Body>
void run_ranks(int n, Body&& body) {
  InProcessWorld world(n, kTimeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(world.communicator(r));
  std::barrier<> sync(n);
  std::mutex error_mu;
  std::exception_ptr first_error;
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        Communicator& comm = *comms[static_cast<std::size_t>(r)];
        // Rank r on core r, as the executor pins a rank's threads, when the cores suffice.
        if (n <= static_cast<int>(std::thread::hardware_concurrency())) {
          cpu_set_t set;
          CPU_ZERO(&set);
          CPU_SET(r, &set);
          pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        }
        try {
          body(r, comm, sync);
        } catch (...) {
          std::string what = "unknown error";
          try {
            throw;
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          {
            std::lock_guard lock(error_mu);
            if (!first_error) first_error = std::current_exception();
          }
          comm.abort(fmt::format("calibrate: rank {} failed: {}", r, what));
          sync.arrive_and_drop();
        }
      });
  }
  if (first_error) std::rethrow_exception(first_error);
}

// One table section: an op on a world of `ranks`, over the sizes.
struct Section {
  std::string op, type, redop;
  int ranks = 0;
  std::size_t element_bytes = 4;  // wire bytes per element: bytes = count * element_bytes
  double bus_factor = 1;          // busbw = algbw * bus_factor
  // The result every checked rank must hold after the call.
  std::function<void(std::span<float>)> fill_expected;
  // Before each call (not timed): what rank r's buffer holds going in.
  std::function<void(int, std::span<float>)> prepare;
  // The call itself, timed inside; returns this rank's seconds, or a negative number if
  // this rank's time does not count (sendrecv: only rank 0 sees the round trip).
  std::function<double(int, Communicator&, std::span<float>)> call;
};

struct Size {
  std::size_t bytes, count;
  int warmup, iters;
};

std::vector<Size> sizes_for(const CommBenchOptions& o, std::size_t element_bytes) {
  std::vector<Size> sizes;
  for (std::size_t b = o.min_bytes; b <= o.max_bytes; b *= 2) {
    const std::size_t count = b / element_bytes, bytes = count * element_bytes;
    const auto scaled = [&](int asked, std::size_t budget, std::size_t floor) {
      return static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(asked), std::max(floor, budget / bytes)));
    };
    sizes.push_back(Size{bytes, count, scaled(o.warmup_iters, kWarmupBytes, 1), scaled(o.iters, kTimedBytes, 2)});
    if (b > std::numeric_limits<std::size_t>::max() / 2) break;
  }
  return sizes;
}

void run_section(const Section& s, const CommBenchOptions& o, CommBenchResult& out) {
  const std::vector<Size> sizes = sizes_for(o, s.element_bytes);
  std::size_t max_count = 0;
  int max_iters = 0;
  for (const Size& z : sizes) {
    max_count = std::max(max_count, z.count);
    max_iters = std::max(max_iters, z.iters);
  }
  const auto n = static_cast<std::size_t>(s.ranks);
  std::vector<float> expected(max_count);
  std::vector<std::vector<double>> times(n, std::vector<double>(static_cast<std::size_t>(max_iters)));
  std::vector<std::int64_t> wrong(n);

  run_ranks(s.ranks, [&](int r, Communicator& comm, std::barrier<>& sync) {
    const auto ru = static_cast<std::size_t>(r);
    std::vector<float> buffer(max_count);
    for (const Size& z : sizes) {
      const std::span<float> buf(buffer.data(), z.count);
      const std::span<const float> want(expected.data(), z.count);
      if (r == 0) s.fill_expected(std::span<float>(expected.data(), z.count));
      sync.arrive_and_wait();  // expected is written
      std::int64_t bad = 0;
      for (int it = 0; it < z.warmup + z.iters; ++it) {
        s.prepare(r, buf);
        sync.arrive_and_wait();
        const double seconds = s.call(r, comm, buf);
        if (it >= z.warmup) times[ru][static_cast<std::size_t>(it - z.warmup)] = seconds;
        bad += count_wrong(buf, want);
      }
      wrong[ru] = bad;
      sync.arrive_and_wait();  // every rank's times and #wrong are in
      if (r != 0) continue;
      std::vector<double> per_call(static_cast<std::size_t>(z.iters), 0.0);
      for (std::size_t k = 0; k < per_call.size(); ++k)
        for (std::size_t q = 0; q < n; ++q) per_call[k] = std::max(per_call[k], times[q][k]);
      CollectiveRow row;
      row.op = s.op;
      row.ranks = s.ranks;
      row.bytes = z.bytes;
      row.count = z.count;
      row.type = s.type;
      row.redop = s.redop;
      // A call shorter than the clock's tick would read 0: never report less than 1 ns.
      const double t = std::max(median(std::move(per_call)), 1e-9);
      row.time_us = t * 1e6;
      row.algbw_gbps = static_cast<double>(z.bytes) / t / 1e9;
      row.busbw_gbps = row.algbw_gbps * s.bus_factor;
      row.wrong = std::accumulate(wrong.begin(), wrong.end(), std::int64_t{0});
      row.warmup_iters = z.warmup;
      row.iters = z.iters;
      out.rows.push_back(row);
      if (o.on_row) o.on_row(out.rows.back());
    }
  });
}

void validate(const CommBenchOptions& o) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("calibrate: " + what); };
  if (o.min_bytes < 4)
    bad(fmt::format("min_bytes must be at least 4 (one float element), got {}", o.min_bytes));
  if (o.max_bytes < o.min_bytes)
    bad(fmt::format("max_bytes ({}) must be at least min_bytes ({})", o.max_bytes, o.min_bytes));
  if (o.iters < 1) bad(fmt::format("iters must be at least 1, got {}", o.iters));
  if (o.warmup_iters < 0) bad(fmt::format("warmup_iters must be 0 or more, got {}", o.warmup_iters));
  (void)significand_bits(o.wire);  // rejects fp8
  std::set<int> seen;
  for (int n : o.group_sizes) {
    if (n < 2) bad(fmt::format("group size {} in group_sizes: an all_reduce benchmark needs at least 2 ranks", n));
    if (!seen.insert(n).second) bad(fmt::format("group size {} appears twice in group_sizes", n));
    (void)pattern_for(n, o.wire);  // too many ranks to check exactly in this wire format
  }
  if (o.redops.empty() && !o.group_sizes.empty()) bad("redops is empty: give at least one of sum, max");
  std::set<ReduceOp> ops;
  for (ReduceOp op : o.redops)
    if (!ops.insert(op).second) bad("redops lists the same op twice");
}

Section sendrecv_section() {
  Section s;
  s.op = "sendrecv";
  s.type = "float";  // send/recv carry floats whatever the all_reduce wire format
  s.redop = "none";
  s.ranks = 2;
  s.element_bytes = sizeof(float);
  s.bus_factor = 1;
  s.fill_expected = [](std::span<float> e) { fill(e, 1.0f, kPeriod); };
  s.prepare = [](int r, std::span<float> buf) {
    if (r == 0)
      fill(buf, 1.0f, kPeriod);
    else
      std::fill(buf.begin(), buf.end(), std::numeric_limits<float>::quiet_NaN());  // a recv that writes nothing shows
  };
  s.call = [](int r, Communicator& comm, std::span<float> buf) {
    const auto t0 = Clock::now();
    if (r == 0) {
      comm.send(1, kTag, buf);
      comm.recv(1, kTag, buf);
    } else {
      comm.recv(0, kTag, buf);
      comm.send(0, kTag, buf);  // echo what arrived: a corrupted message is counted on both ranks
    }
    const auto t1 = Clock::now();
    return r == 0 ? std::chrono::duration<double>(t1 - t0).count() / 2 : -1.0;
  };
  return s;
}

Section all_reduce_section(int n, ReduceOp op, DType wire) {
  Section s;
  s.op = "all_reduce";
  s.type = nccl_type_name(wire);
  s.redop = op == ReduceOp::sum ? "sum" : "max";
  s.ranks = n;
  s.element_bytes = static_cast<std::size_t>(dtype_bytes(wire));
  s.bus_factor = 2.0 * (n - 1) / n;
  const Pattern p = pattern_for(n, wire);
  const float total = std::accumulate(p.weight.begin(), p.weight.end(), 0.0f);  // exact: small integers
  const float largest = *std::max_element(p.weight.begin(), p.weight.end());
  s.fill_expected = [p, op, total, largest](std::span<float> e) {
    fill(e, op == ReduceOp::sum ? total : largest, p.period);
  };
  s.prepare = [p](int r, std::span<float> buf) { fill(buf, p.weight[static_cast<std::size_t>(r)], p.period); };
  std::vector<int> members(static_cast<std::size_t>(n));
  std::iota(members.begin(), members.end(), 0);
  s.call = [members, op, wire](int, Communicator& comm, std::span<float> buf) {
    const auto t0 = Clock::now();
    comm.all_reduce(buf, members, kTag, op, wire, Divide::none);
    const auto t1 = Clock::now();
    return std::chrono::duration<double>(t1 - t0).count();
  };
  return s;
}

// Fits the rows selected by `keep`, x = bytes * x_factor; leaves the fit at zero when fewer
// than two sizes were run.
template <typename Keep>
LinkFit fit_rows(const std::vector<CollectiveRow>& rows, Keep&& keep, double x_factor) {
  std::vector<std::pair<double, double>> points;
  for (const CollectiveRow& row : rows)
    if (keep(row)) points.emplace_back(static_cast<double>(row.bytes) * x_factor, row.time_us * 1e-6);
  if (points.size() < 2) return {};
  return fit_latency_bandwidth(points);
}

std::string format_time_us(double us) {
  // nccl-tests' precision: fewer decimals as times grow.
  if (us >= 10000.0) return fmt::format("{:12.0f}", us);
  if (us >= 100.0) return fmt::format("{:12.1f}", us);
  return fmt::format("{:12.2f}", us);
}

std::string format_fit(const LinkFit& f) {
  if (f.bandwidth_gbps == 0 && f.latency_us == 0) return "not fitted (needs at least two sizes)";
  return fmt::format("latency {:.2f} us, bandwidth {:.3f} GB/s", f.latency_us, f.bandwidth_gbps);
}

}  // namespace

std::string nccl_type_name(DType wire) {
  switch (wire) {
    case DType::fp32: return "float";
    case DType::tf32: return "tf32";
    case DType::fp16: return "half";
    case DType::bf16: return "bfloat16";
    case DType::fp8: return "fp8";
  }
  return "unknown";
}

std::int64_t count_wrong(std::span<const float> got, std::span<const float> expected) {
  if (got.size() != expected.size())
    throw std::invalid_argument(fmt::format("count_wrong: got {} elements, expected {}", got.size(), expected.size()));
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) wrong += got[i] != expected[i] ? 1 : 0;  // NaN != anything
  return wrong;
}

LinkFit fit_latency_bandwidth(const std::vector<std::pair<double, double>>& bytes_and_seconds) {
  if (bytes_and_seconds.size() < 2)
    throw std::invalid_argument(
        fmt::format("fit_latency_bandwidth: needs at least two points, got {}", bytes_and_seconds.size()));
  for (const auto& [x, t] : bytes_and_seconds)
    if (!(x >= 0) || !std::isfinite(x) || !(t > 0) || !std::isfinite(t))
      throw std::invalid_argument(fmt::format(
          "fit_latency_bandwidth: point (bytes {}, seconds {}) is invalid: bytes must be >= 0 and seconds > 0, "
          "both finite",
          x, t));
  // Minimise sum w (a + b x - t)^2 with w = 1/t^2 (relative error): weighted means, then the
  // centred slope, which keeps the sums well conditioned for x spanning 8 B to 64 MiB.
  double W = 0, xm = 0, tm = 0;
  for (const auto& [x, t] : bytes_and_seconds) {
    const double w = 1.0 / (t * t);
    W += w;
    xm += w * x;
    tm += w * t;
  }
  xm /= W;
  tm /= W;
  double sxx = 0, sxt = 0;
  for (const auto& [x, t] : bytes_and_seconds) {
    const double w = 1.0 / (t * t);
    sxx += w * (x - xm) * (x - xm);
    sxt += w * (x - xm) * (t - tm);
  }
  if (!(sxx > 0))
    throw std::invalid_argument("fit_latency_bandwidth: all points have the same size; needs two distinct sizes");
  double b = sxt / sxx, a = tm - b * xm;  // seconds per byte, seconds
  if (!(b > 0)) {
    // Time does not grow with size: no measurable bandwidth; the latency is the weighted mean.
    return LinkFit{tm * 1e6, std::numeric_limits<double>::infinity()};
  }
  if (a < 0) {
    // Refit through the origin: minimise sum w (b x - t)^2.
    double sxx0 = 0, sxt0 = 0;
    for (const auto& [x, t] : bytes_and_seconds) {
      const double w = 1.0 / (t * t);
      sxx0 += w * x * x;
      sxt0 += w * x * t;
    }
    a = 0;
    b = sxt0 / sxx0;
  }
  return LinkFit{a * 1e6, 1.0 / b / 1e9};
}

CommBenchResult bench_in_process_comm(const CommBenchOptions& options) {
  CommBenchOptions o = options;
  if (o.group_sizes.empty()) o.group_sizes = {2};
  validate(o);

  CommBenchResult result;
  if (o.sendrecv) {
    run_section(sendrecv_section(), o, result);
    result.p2p = fit_rows(result.rows, [](const CollectiveRow& r) { return r.op == "sendrecv"; }, 1.0);
  }
  for (int n : o.group_sizes) {
    for (ReduceOp op : o.redops) run_section(all_reduce_section(n, op, o.wire), o, result);
    result.allreduce[n] = fit_rows(
        result.rows, [n](const CollectiveRow& r) { return r.op == "all_reduce" && r.ranks == n; },
        2.0 * (n - 1) / n);
  }
  return result;
}

std::string format_comm_table(const CommBenchResult& r) {
  std::string out;
  std::int64_t total_wrong = 0;
  for (std::size_t begin = 0; begin < r.rows.size();) {
    const CollectiveRow& first = r.rows[begin];
    std::size_t end = begin;
    while (end < r.rows.size() && r.rows[end].op == first.op && r.rows[end].ranks == first.ranks &&
           r.rows[end].redop == first.redop && r.rows[end].type == first.type)
      ++end;

    const bool p2p = first.op == "sendrecv";
    if (p2p)
      out += fmt::format("#\n# sendrecv: ranks 0 <-> 1, ping-pong, time = round trip / 2\n#\n");
    else
      out += fmt::format("#\n# all_reduce: {} ranks, ring, {}, {}\n#\n", first.ranks, first.redop, first.type);
    out += fmt::format("# {:>10}  {:>12}  {:>8}  {:>6}  {:>11}  {:>11}  {:>11}  {:>6}\n", "size", "count", "type",
                       "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
    out += fmt::format("# {:>10}  {:>12}\n", "(B)", "(elements)");
    double busbw_sum = 0;
    for (std::size_t i = begin; i < end; ++i) {
      const CollectiveRow& row = r.rows[i];
      out += fmt::format("  {:>10}  {:>12}  {:>8}  {:>6} {}  {:>11.2f}  {:>11.2f}  {:>6}\n", row.bytes, row.count,
                         row.type, row.redop, format_time_us(row.time_us), row.algbw_gbps, row.busbw_gbps, row.wrong);
      busbw_sum += row.busbw_gbps;
      total_wrong += row.wrong;
    }
    if (p2p) {
      out += fmt::format("# fit t = latency + bytes / bandwidth: {}\n", format_fit(r.p2p));
    } else {
      const auto it = r.allreduce.find(first.ranks);
      out += fmt::format("# fit t = latency + bytes*2(n-1)/n / bus bandwidth (n = {}): {}\n", first.ranks,
                         format_fit(it == r.allreduce.end() ? LinkFit{} : it->second));
    }
    out += fmt::format("# Avg bus bandwidth    : {:g}\n", busbw_sum / static_cast<double>(end - begin));
    begin = end;
  }
  out += fmt::format("#\n# Out of bounds values : {} {}\n#\n", total_wrong, total_wrong == 0 ? "OK" : "FAILED");
  return out;
}

}  // namespace trainsim::runtime
