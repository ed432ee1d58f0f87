#include "runtime/calibrate/comm_bench.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>

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
  throw std::invalid_argument(
      fmt::format("calibrate: an all_reduce in {} cannot be checked exactly; accepted: fp32, tf32, fp16, bf16",
                  dtype_name(wire)));
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

// The section's sizes (`listed`, else doubling_sizes(o)) and its largest count and iters. A
// collective over n chunks takes counts that are multiples of `multiple` (a listed size is
// rounded down to one; one too small for a chunk each is left out).
void set_sizes(CommSection& s, const CommBenchOptions& o, const std::vector<std::size_t>& listed,
               std::size_t multiple = 1) {
  const auto element_bytes = static_cast<std::size_t>(dtype_bytes(s.wire)) * multiple;
  std::set<std::size_t> asked(listed.begin(), listed.end());
  if (asked.empty())
    for (std::size_t b : doubling_sizes(o)) asked.insert(b);
  for (std::size_t b : asked) {
    const std::size_t count = b / element_bytes * multiple, bytes = b / element_bytes * element_bytes;
    if (count == 0) continue;
    if (!s.sizes.empty() && s.sizes.back().count == count) continue;  // two listed sizes rounded alike
    const auto scaled = [&](int wanted, std::size_t budget, std::size_t floor) {
      return static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(wanted), std::max(floor, budget / bytes)));
    };
    s.sizes.push_back(
        CommSize{bytes, count, scaled(o.warmup_iters, kWarmupBytes, 1), scaled(o.iters, kTimedBytes, 2)});
    s.max_count = std::max(s.max_count, count);
    s.max_iters = std::max(s.max_iters, s.sizes.back().iters);
  }
}

CommSection sendrecv_section(const CommBenchOptions& o) {
  CommSection s;
  s.op = "sendrecv";
  s.type = "float";  // send/recv carry floats whatever the all_reduce wire format
  s.redop = "none";
  s.ranks = 2;
  s.wire = DType::fp32;
  s.bus_factor = 1;
  set_sizes(s, o, o.sendrecv_sizes);
  s.fill_expected = [](std::span<float> e) { fill(e, 1.0f, kPeriod); };
  s.prepare = [](int r, std::span<float> buf) {
    if (r == 0)
      fill(buf, 1.0f, kPeriod);
    else
      std::fill(buf.begin(), buf.end(), std::numeric_limits<float>::quiet_NaN());  // a recv that writes nothing shows
  };
  return s;
}

// A collective over ranks 0..n-1 (every rank a member), its rows' columns and sizes: counts a
// multiple of `multiple` elements.
CommSection group_section(const CommBenchOptions& o, int n, const char* op, const char* redop, double bus_factor,
                          const std::vector<std::size_t>& listed, std::size_t multiple) {
  CommSection s;
  s.op = op;
  s.type = nccl_type_name(o.wire);
  s.redop = redop;
  s.ranks = n;
  s.members.resize(static_cast<std::size_t>(n));
  std::iota(s.members.begin(), s.members.end(), 0);
  s.wire = o.wire;
  s.bus_factor = bus_factor;
  set_sizes(s, o, listed, multiple);
  return s;
}

// Rank r contributes weight r's pattern everywhere; the reduction by `op` is the expected result
// (an all-reduce's whole buffer, a reduce-scatter's own chunk).
void reduce_patterns(CommSection& s, int n, ReduceOp op) {
  s.reduce = op;
  const Pattern p = pattern_for(n, s.wire);
  const float total = std::accumulate(p.weight.begin(), p.weight.end(), 0.0f);  // exact: small integers
  const float largest = *std::max_element(p.weight.begin(), p.weight.end());
  s.fill_expected = [p, op, total, largest](std::span<float> e) {
    fill(e, op == ReduceOp::sum ? total : largest, p.period);
  };
  s.prepare = [p](int r, std::span<float> buf) { fill(buf, p.weight[static_cast<std::size_t>(r)], p.period); };
}

CommSection all_reduce_section(const CommBenchOptions& o, int n, ReduceOp op) {
  CommSection s =
      group_section(o, n, "all_reduce", op == ReduceOp::sum ? "sum" : "max", 2.0 * (n - 1) / n, o.all_reduce_sizes, 1);
  reduce_patterns(s, n, op);
  return s;
}

// The ring's halves (communicator.h), in place: member p owns chunk p of `count`; nccl-tests'
// bus factor (n-1)/n.
CommSection half_ring_section(const CommBenchOptions& o, int n, const char* op, const char* redop,
                              const std::vector<std::size_t>& listed) {
  return group_section(o, n, op, redop, (n - 1.0) / n, listed, static_cast<std::size_t>(n));
}

// Every chunk ends as its owner's contribution; each rank starts with its own and NaN elsewhere
// (a chunk the call does not fill shows).
CommSection all_gather_section(const CommBenchOptions& o, int n) {
  CommSection s = half_ring_section(o, n, "all_gather", "none", o.all_gather_sizes);
  const Pattern p = pattern_for(n, o.wire);
  const auto chunk = [n](std::span<float> buf, int k) {
    const std::size_t per = buf.size() / static_cast<std::size_t>(n);
    return buf.subspan(static_cast<std::size_t>(k) * per, per);
  };
  s.fill_expected = [p, n, chunk](std::span<float> e) {
    for (int k = 0; k < n; ++k) fill(chunk(e, k), p.weight[static_cast<std::size_t>(k)], p.period);
  };
  s.prepare = [p, chunk](int r, std::span<float> buf) {
    std::fill(buf.begin(), buf.end(), std::numeric_limits<float>::quiet_NaN());
    fill(chunk(buf, r), p.weight[static_cast<std::size_t>(r)], p.period);
  };
  return s;
}

// Rank r's chunk ends as the sum of every rank's (the rest of its buffer is unspecified).
CommSection reduce_scatter_section(const CommBenchOptions& o, int n) {
  CommSection s = half_ring_section(o, n, "reduce_scatter", "sum", o.reduce_scatter_sizes);
  reduce_patterns(s, n, ReduceOp::sum);
  s.checked = [n](int r, std::size_t count) {
    const std::size_t per = count / static_cast<std::size_t>(n);
    return std::pair{static_cast<std::size_t>(r) * per, static_cast<std::size_t>(r + 1) * per};
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

double seconds_since(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string format_fit(const LinkFit& f) {
  if (f.bandwidth_gbps == 0 && f.latency_us == 0) return "not fitted (needs at least two sizes)";
  return fmt::format("latency {:.2f} us, bandwidth {:.3f} GB/s", f.latency_us, f.bandwidth_gbps);
}

}  // namespace

std::size_t last_level_cache_bytes() {
  std::size_t largest = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/size", index));
    std::string text;
    if (!(in >> text) || text.empty()) continue;
    std::size_t value = std::strtoull(text.c_str(), nullptr, 10);
    if (text.back() == 'K') value <<= 10;
    if (text.back() == 'M') value <<= 20;
    largest = std::max(largest, value);
  }
  return largest > 0 ? largest : std::size_t{32} << 20;
}


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
    // Time does not grow with size: no measurable bandwidth (0: no size term, as a profile
    // stores it); the latency is the weighted mean.
    return LinkFit{tm * 1e6, 0.0};
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

std::vector<std::size_t> doubling_sizes(const CommBenchOptions& o) {
  std::vector<std::size_t> sizes;
  for (std::size_t b = o.min_bytes; b <= o.max_bytes; b *= 2) {
    sizes.push_back(b);
    if (b > std::numeric_limits<std::size_t>::max() / 2) break;
  }
  return sizes;
}

CommBenchOptions checked_comm_options(const CommBenchOptions& options, std::span<const DType> wires,
                                      const std::string& transport, int max_ranks) {
  CommBenchOptions o = options;
  if (o.group_sizes.empty()) o.group_sizes = {2};
  auto bad = [](const std::string& what) { throw std::invalid_argument("calibrate: " + what); };
  if (std::find(wires.begin(), wires.end(), o.wire) == wires.end()) {
    std::string accepted;
    for (DType w : wires) accepted += (accepted.empty() ? "" : ", ") + std::string(dtype_name(w));
    bad(fmt::format("wire {} is not a format {} moves; accepted: {}", dtype_name(o.wire), transport, accepted));
  }
  if (o.min_bytes < 4) bad(fmt::format("min_bytes must be at least 4 (one float element), got {}", o.min_bytes));
  if (o.max_bytes < o.min_bytes)
    bad(fmt::format("max_bytes ({}) must be at least min_bytes ({})", o.max_bytes, o.min_bytes));
  for (std::size_t b : o.sendrecv_sizes)
    if (b < 4) bad(fmt::format("sendrecv_sizes: {} bytes is less than one float element", b));
  const auto wire_bytes = static_cast<std::size_t>(dtype_bytes(o.wire));
  for (std::size_t b : o.all_reduce_sizes)
    if (b < wire_bytes)
      bad(fmt::format("all_reduce_sizes: {} bytes is less than one {} element", b, dtype_name(o.wire)));
  if (o.iters < 1) bad(fmt::format("iters must be at least 1, got {}", o.iters));
  if (o.warmup_iters < 0) bad(fmt::format("warmup_iters must be 0 or more, got {}", o.warmup_iters));
  std::set<int> seen;
  for (int n : o.group_sizes) {
    if (n < 2) bad(fmt::format("group size {} in group_sizes: an all_reduce benchmark needs at least 2 ranks", n));
    if (max_ranks > 0 && n > max_ranks)
      bad(fmt::format("group size {} in group_sizes: {} reduces over at most {} ranks", n, transport, max_ranks));
    if (!seen.insert(n).second) bad(fmt::format("group size {} appears twice in group_sizes", n));
    (void)pattern_for(n, o.wire);  // too many ranks to check exactly in this wire format
  }
  if (o.redops.empty() && !o.group_sizes.empty()) bad("redops is empty: give at least one of sum, max");
  std::set<ReduceOp> ops;
  for (ReduceOp op : o.redops)
    if (!ops.insert(op).second) bad("redops lists the same op twice");
  return o;
}

std::vector<CommSection> comm_sections(const CommBenchOptions& options) {
  std::vector<CommSection> sections;
  if (options.sendrecv) sections.push_back(sendrecv_section(options));
  for (int n : options.group_sizes) {
    for (ReduceOp op : options.redops) sections.push_back(all_reduce_section(options, n, op));
    if (!options.all_gather_sizes.empty()) sections.push_back(all_gather_section(options, n));
    if (!options.reduce_scatter_sizes.empty()) sections.push_back(reduce_scatter_section(options, n));
  }
  std::erase_if(sections, [](const CommSection& s) { return s.sizes.empty(); });
  return sections;
}

void run_comm_section(const CommSection& s, const CommBenchOptions& options, CommBenchResult& out,
                      const std::function<void(int, const std::function<void(const CommRankCalls&)>&)>& rank,
                      const std::function<void(int, const std::string&)>& abort) {
  const auto n = static_cast<std::size_t>(s.ranks);
  std::vector<float> expected(s.max_count);
  std::vector<std::vector<double>> times(n, std::vector<double>(static_cast<std::size_t>(s.max_iters)));
  std::vector<std::int64_t> wrong(n);
  std::barrier<> sync(s.ranks);

  // Rank r's calls of every size; rank 0 finishes the rows.
  const auto measure = [&](int r, const CommRankCalls& calls) {
    const auto ru = static_cast<std::size_t>(r);
    for (const CommSize& z : s.sizes) {
      const std::span<float> buf = calls.host.first(z.count);
      const std::span<const float> want(expected.data(), z.count);
      if (r == 0) s.fill_expected(std::span<float>(expected.data(), z.count));
      sync.arrive_and_wait();  // expected is written
      std::int64_t bad = 0;
      for (int it = 0; it < z.warmup + z.iters; ++it) {
        s.prepare(r, buf);
        if (calls.load) calls.load(z.count);
        if (calls.evict && it >= z.warmup) calls.evict();
        sync.arrive_and_wait();
        const double seconds = calls.call(z.count);
        if (it >= z.warmup) times[ru][static_cast<std::size_t>(it - z.warmup)] = seconds;
        const auto [from, to] = s.checked ? s.checked(r, z.count) : std::pair<std::size_t, std::size_t>{0, z.count};
        bad += count_wrong(buf.subspan(from, to - from), want.subspan(from, to - from));
      }
      wrong[ru] = bad;
      sync.arrive_and_wait();  // every rank's times and #wrong are in
      if (r != 0) continue;
      std::vector<double> per_call(static_cast<std::size_t>(z.iters), 0.0);
      for (std::size_t k = 0; k < per_call.size(); ++k)
        for (std::size_t q = 0; q < n; ++q) per_call[k] = std::max(per_call[k], times[q][k]);
      // A call shorter than the clock's tick would read 0: never report less than 1 ns.
      const double t = std::max(median(std::move(per_call)), 1e-9);
      const double algbw = static_cast<double>(z.bytes) / t / 1e9;
      out.rows.push_back(CollectiveRow{.op = s.op, .ranks = s.ranks, .bytes = z.bytes, .count = z.count,
                                       .type = s.type, .redop = s.redop, .time_us = t * 1e6, .algbw_gbps = algbw,
                                       .busbw_gbps = algbw * s.bus_factor,
                                       .wrong = std::accumulate(wrong.begin(), wrong.end(), std::int64_t{0}),
                                       .warmup_iters = z.warmup, .iters = z.iters});
      if (options.on_row) options.on_row(out.rows.back());
    }
  };

  std::mutex error_mu;
  std::exception_ptr first_error;
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < s.ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          rank(r, [&](const CommRankCalls& calls) { measure(r, calls); });
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
          abort(r, fmt::format("calibrate: rank {} failed: {}", r, what));
          sync.arrive_and_drop();
        }
      });
  }
  if (first_error) std::rethrow_exception(first_error);
}

void fit_comm_rows(CommBenchResult& r) {
  r.p2p = fit_rows(r.rows, [](const CollectiveRow& row) { return row.op == "sendrecv"; }, 1.0);
  r.allreduce.clear();
  for (const CollectiveRow& row : r.rows) {
    const int n = row.ranks;
    if (row.op != "all_reduce" || r.allreduce.contains(n)) continue;
    r.allreduce[n] = fit_rows(
        r.rows, [n](const CollectiveRow& q) { return q.op == "all_reduce" && q.ranks == n; }, 2.0 * (n - 1) / n);
  }
}

CommBenchResult bench_in_process_comm(const CommBenchOptions& options) {
  static constexpr DType kWires[] = {DType::fp32, DType::tf32, DType::fp16, DType::bf16};
  const CommBenchOptions o = checked_comm_options(options, kWires, "the in-process communicator");
  CommBenchResult result;
  for (const CommSection& s : comm_sections(o)) {
    const bool collective = s.op != "sendrecv";
    // When each rank started the current call: a collective is timed from its last member's start
    // (every rank has written its own before any rank's call can end).
    std::vector<std::atomic<double>> starts(static_cast<std::size_t>(s.ranks));
    // Rank r on core r, as the executor pins a rank's threads, when the cores suffice.
    const bool pinned = s.ranks <= static_cast<int>(std::thread::hardware_concurrency());
    const auto n_ranks = static_cast<std::size_t>(s.ranks);
    InProcessWorld world(s.ranks, kTimeout);
    std::vector<std::unique_ptr<Communicator>> comms;
    for (int r = 0; r < s.ranks; ++r) comms.push_back(world.communicator(r, pinned ? o.poll : std::chrono::microseconds{0}));
    const auto rank = [&](int r, const std::function<void(const CommRankCalls&)>& measure) {
      Communicator& comm = *comms[static_cast<std::size_t>(r)];
      if (pinned) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(r, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      }
      std::vector<float> buffer(s.max_count);
      // A step's gradient buckets were written by its backward long before they are reduced, and
      // the caches hold what the backward wrote since. Each all_reduce call of ranks that have a
      // core each starts from that state: together the ranks write twice the last-level cache's
      // size of other data (at least 4 MiB each, for their own caches), so the call's buffer comes
      // from memory and every line it brings in first writes a dirty one back.
      const std::size_t evict_bytes =
          collective && pinned ? std::max(std::size_t{4} << 20, 2 * last_level_cache_bytes() / n_ranks) : 0;
      std::vector<float> other(evict_bytes / sizeof(float), 1.0f);
      const auto evict = [&] {
        for (std::size_t i = 0; i < other.size(); i += 16) other[i] += 1.0f;  // a cache line per write
      };
      const auto call = [&](std::size_t count) {
        const std::span<float> buf(buffer.data(), count);
        const auto t0 = Clock::now();
        if (collective) {
          starts[static_cast<std::size_t>(r)].store(seconds_since(t0.time_since_epoch()));
          if (s.op == "all_gather")
            comm.all_gather(buf, s.members, kTag, s.wire);
          else if (s.op == "reduce_scatter")
            comm.reduce_scatter(buf, s.members, kTag, s.reduce, s.wire, Divide::none);
          else
            comm.all_reduce(buf, s.members, kTag, s.reduce, s.wire, Divide::none);
          const double end = seconds_since(Clock::now().time_since_epoch());
          double last = 0;
          for (const auto& t : starts) last = std::max(last, t.load());
          return end - last;
        }
        if (r == 0) {
          comm.send(1, kTag, buf);
          comm.recv(1, kTag, buf);
          return std::chrono::duration<double>(Clock::now() - t0).count() / 2;  // round trip / 2
        }
        comm.recv(0, kTag, buf);
        comm.send(0, kTag, buf);  // echo what arrived: a corrupted message is counted on both ranks
        return -1.0;              // only rank 0 sees the round trip
      };
      measure(CommRankCalls{buffer, nullptr, call, other.empty() ? nullptr : std::function<void()>(evict)});
    };
    run_comm_section(s, o, result, rank,
                     [&](int r, const std::string& why) { comms[static_cast<std::size_t>(r)]->abort(why); });
  }
  fit_comm_rows(result);
  return result;
}

CommBenchResult median_of_runs(const std::vector<CommBenchResult>& runs) {
  const auto key = [](const CollectiveRow& r) { return std::tie(r.op, r.ranks, r.bytes, r.type, r.redop); };
  CommBenchResult out;
  std::vector<std::vector<double>> times;  // [i]: out.rows[i]'s time in every run that has it
  for (const CommBenchResult& run : runs)
    for (const CollectiveRow& row : run.rows) {
      auto same = std::find_if(out.rows.begin(), out.rows.end(), [&](const CollectiveRow& o) { return key(o) == key(row); });
      if (same == out.rows.end()) {
        out.rows.push_back(row);
        out.rows.back().wrong = 0;
        out.rows.back().iters = 0;
        times.emplace_back();
        same = out.rows.end() - 1;
      }
      same->wrong += row.wrong;
      same->iters += row.iters;
      times[static_cast<std::size_t>(same - out.rows.begin())].push_back(row.time_us);
    }
  for (std::size_t i = 0; i < out.rows.size(); ++i) {
    CollectiveRow& row = out.rows[i];
    const double bus_factor = row.algbw_gbps > 0 ? row.busbw_gbps / row.algbw_gbps : 1.0;
    row.time_us = median(std::move(times[i]));
    row.algbw_gbps = static_cast<double>(row.bytes) / (row.time_us * 1e-6) / 1e9;
    row.busbw_gbps = row.algbw_gbps * bus_factor;
  }
  fit_comm_rows(out);
  return out;
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
    else if (first.op == "all_reduce")
      out += fmt::format("#\n# all_reduce: {} ranks, ring, {}, {}\n#\n", first.ranks, first.redop, first.type);
    else
      out += fmt::format("#\n# {}: {} ranks, the ring's half, {}, {}; size = the whole buffer\n#\n", first.op,
                         first.ranks, first.redop, first.type);
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
    } else if (first.op == "all_reduce") {
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
