#include "core/hardware_profile.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "core/units.h"

namespace trainsim {

double KernelRate::rate() const {
  if (seconds <= 0) return 0;
  return shape.is_matmul() ? shape.flops() / seconds / 1e12 : bytes / seconds / 1e9;
}

double LinkFit::seconds(double bytes) const {
  return us_to_seconds(latency_us) + (bandwidth_gbps > 0 ? bytes / gbps_to_bytes_per_second(bandwidth_gbps) : 0.0);
}

double SizeTable::seconds(double bytes) const {
  if (rows.empty()) return 0;
  if (bytes <= rows.front().first) return rows.front().second;
  if (bytes >= rows.back().first) return rows.back().second * bytes / rows.back().first;
  const auto hi = std::lower_bound(rows.begin(), rows.end(), bytes,
                                   [](const std::pair<double, double>& r, double b) { return r.first < b; });
  const auto lo = hi - 1;
  const double f = std::log(bytes / lo->first) / std::log(hi->first / lo->first);
  // A row measured at zero time has no logarithm: between it and its neighbour, linearly in
  // the logarithm of the size.
  if (lo->second <= 0 || hi->second <= 0) return lo->second + f * (hi->second - lo->second);
  return std::exp(std::log(lo->second) + f * (std::log(hi->second) - std::log(lo->second)));
}

double HardwareProfile::comm_late_extra_us(double lead_us) const {
  LatePoint below{};
  for (const LatePoint& p : comm_late) {
    if (lead_us <= p.lead_us)
      return below.us + (p.us - below.us) * (lead_us - below.lead_us) / std::max(p.lead_us - below.lead_us, 1e-12);
    below = p;
  }
  return below.us;
}

double HardwareProfile::comm_late_charge_us(double lead_us) const {
  const double extra = comm_late_extra_us(lead_us);
  if (comm_late_bytes <= 0 || extra <= 0) return extra;
  return std::max(0.0, comm_late_base_us + extra - allreduce_seconds(2, comm_late_bytes) * 1e6);
}

double HardwareProfile::p2p_seconds(double bytes) const {
  return p2p_table.rows.empty() ? p2p.seconds(bytes) : p2p_table.seconds(bytes);
}

double HardwareProfile::kernel_seconds(const std::string& kernel, DType dtype, const KernelShape& shape,
                                       double bytes) const {
  const KernelRate* nearest = nullptr;
  double best = std::numeric_limits<double>::infinity();
  const double work = shape.is_matmul() ? shape.flops() : bytes;
  for (const KernelRate& k : kernels) {
    if (k.kernel != kernel || k.dtype != dtype || k.seconds < 0) continue;
    if (k.shape == shape) return k.seconds;
    const double kwork = k.shape.is_matmul() ? k.shape.flops() : k.bytes;
    if (kwork <= 0 || work <= 0) continue;
    const double distance = std::abs(std::log(kwork / work));
    if (distance < best) best = distance, nearest = &k;
  }
  if (!nearest) return -1;
  const double kwork = nearest->shape.is_matmul() ? nearest->shape.flops() : nearest->bytes;
  return nearest->seconds * work / kwork;
}

namespace {
double half_ring_seconds(const HardwareProfile& p, const std::map<int, SizeTable>& tables, int n, double bytes) {
  if (n <= 1) return 0;
  if (auto t = tables.find(n); t != tables.end() && !t->second.rows.empty()) return t->second.seconds(bytes);
  return p.allreduce_seconds(n, bytes) / 2;
}
}  // namespace

double HardwareProfile::allgather_seconds(int n, double bytes) const {
  return half_ring_seconds(*this, allgather_tables, n, bytes);
}

double HardwareProfile::reduce_scatter_seconds(int n, double bytes) const {
  return half_ring_seconds(*this, reduce_scatter_tables, n, bytes);
}

double HardwareProfile::allreduce_seconds(int n, double bytes) const {
  if (n <= 1) return 0;
  if (auto t = allreduce_tables.find(n); t != allreduce_tables.end() && !t->second.rows.empty())
    return t->second.seconds(bytes);
  if (allreduce.empty()) return 0;
  const double bus = bytes * 2.0 * (n - 1) / n;
  auto it = allreduce.find(n);
  if (it != allreduce.end()) return it->second.seconds(bus);
  // The nearest measured group size: its bus bandwidth, its latency per ring step.
  auto nearest = allreduce.begin();
  for (auto i = allreduce.begin(); i != allreduce.end(); ++i)
    if (std::abs(i->first - n) < std::abs(nearest->first - n)) nearest = i;
  const int m = nearest->first;
  LinkFit f = nearest->second;
  f.latency_us *= m > 1 ? static_cast<double>(n - 1) / (m - 1) : 1.0;
  return f.seconds(bus);
}

double HardwareProfile::best_matmul_tflops(DType dtype) const {
  double best = 0;
  for (const KernelRate& k : kernels)
    if (k.dtype == dtype && k.shape.is_matmul()) best = std::max(best, k.rate());
  return best;
}

void apply_profile(const HardwareProfile& p, ClusterConfig& cluster) {
  for (auto& [dtype, tflops] : cluster.peak_tflops) {
    const double measured = p.best_matmul_tflops(dtype);
    tflops = measured;  // a format the backend was not measured in is a format it does not have
  }
  cluster.compute_efficiency = 1.0;
  double bytes = 0, seconds = 0;
  for (const KernelRate& k : p.kernels)
    if (!k.shape.is_matmul() && k.seconds > 0) bytes += k.bytes, seconds += k.seconds;  // what moved memory
  if (seconds > 0) cluster.hbm_bandwidth_gbps = bytes / seconds / 1e9;
  if (p.p2p.bandwidth_gbps > 0) cluster.intra_node = cluster.inter_node = LinkConfig{p.p2p.bandwidth_gbps, p.p2p.latency_us};
  if (p.memory_gib > 0) cluster.memory_gib = p.memory_gib;
  if (p.ranks_per_node > 0) cluster.gpus_per_node = p.ranks_per_node;
}

// ---------------------------------------------------------------------------------------
// YAML
// ---------------------------------------------------------------------------------------
namespace {

std::string where(const std::string& path, const YAML::Node& n) {
  return fmt::format("{}:{}", path, n.Mark().line + 1);
}

[[noreturn]] void bad(const std::string& path, const YAML::Node& n, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {}", where(path, n), what));
}

// Every section is checked for its kind before it is read: yaml-cpp throws its own
// exceptions (with no file name) when a map is read as a list or the other way round.
void expect_map(const std::string& path, const YAML::Node& n, const char* what) {
  if (!n.IsMap()) bad(path, n, fmt::format("{} must be a map of keys", what));
}
void expect_list(const std::string& path, const YAML::Node& n, const char* what) {
  if (!n.IsSequence()) bad(path, n, fmt::format("{} must be a list", what));
}

template <class T>
T get(const std::string& path, const YAML::Node& map, const char* key, T fallback) {
  const YAML::Node v = map[key];
  if (!v) return fallback;
  try {
    if (!v.IsScalar()) throw YAML::Exception(v.Mark(), "not a scalar");
    return v.as<T>();
  } catch (const YAML::Exception&) {
    throw std::runtime_error(fmt::format("{}: {} is not a valid value", where(path, v), key));
  }
}

// A number the cost models divide by, take logarithms of or turn into ticks: finite and in
// [lo, hi], with the key named when it is not.
double number(const std::string& path, const YAML::Node& map, const char* key, double fallback, double lo,
              double hi) {
  const double x = get<double>(path, map, key, fallback);
  if (!(x >= lo && x <= hi)) bad(path, map[key], fmt::format("{} must be between {:g} and {:g}, got {}", key, lo, hi, x));
  return x;
}

// 0 (not measured, or nothing) or a value in [lo, hi]: a quantity between 0 and lo would give
// infinite rates and ratios (a kernel that moved 1e-320 bytes scales to an infinite time).
double number_or_zero(const std::string& path, const YAML::Node& map, const char* key, double lo, double hi) {
  const double x = get<double>(path, map, key, 0);
  if (!(x == 0 || (x >= lo && x <= hi)))
    bad(path, map[key], fmt::format("{} must be 0 or between {:g} and {:g}, got {}", key, lo, hi, x));
  return x;
}

long integer(const std::string& path, const YAML::Node& map, const char* key, long fallback, long lo, long hi) {
  const long x = get<long>(path, map, key, fallback);
  if (x < lo || x > hi) bad(path, map[key], fmt::format("{} must be between {} and {}, got {}", key, lo, hi, x));
  return x;
}

// Bounds: far beyond any machine, near enough that products of them stay finite doubles.
constexpr long kMaxDim = 1L << 40;        // matrix dimensions, batch, elements
constexpr double kMaxBytes = 1e18;
constexpr double kMinMicroseconds = 1e-6;  // one picosecond: the simulator's tick
constexpr double kMaxMicroseconds = 1e12;  // about 11 days per launch or message
constexpr double kMaxRate = 1e9;           // GB/s
constexpr double kMinRate = 1e-9;          // GB/s: a byte per second
constexpr int kMaxRanks = 1 << 20;         // as cluster.num_gpus

DType dtype_of(const std::string& path, const YAML::Node& n) {
  const std::string name = get<std::string>(path, n, "dtype", "fp32");
  const auto d = parse_dtype(name);
  if (!d) throw std::runtime_error(fmt::format("{}: unknown dtype '{}'", where(path, n), name));
  return *d;
}

LinkFit link_of(const std::string& path, const YAML::Node& n) {
  // A bandwidth of 0 is none measured; a positive one at least a byte per second (a denormal one
  // made every message's time infinite).
  return LinkFit{number(path, n, "latency_us", 0, 0, kMaxMicroseconds),
                 number_or_zero(path, n, "bandwidth_gbps", kMinRate, kMaxRate)};
}

// `table: [[bytes, us], ...]`: sizes of a byte or more (interpolated log-log), times 0 or a
// tick or more.
SizeTable table_of(const std::string& path, const YAML::Node& n) {
  SizeTable t;
  if (const YAML::Node rows = n["table"]) {
    expect_list(path, rows, "table");
    for (const YAML::Node& r : rows) {
      if (!r.IsSequence() || r.size() != 2 || !r[0].IsScalar() || !r[1].IsScalar())
        bad(path, r, "a table row is [bytes, us]");
      double bytes = 0, us = 0;
      try {
        bytes = r[0].as<double>();
        us = r[1].as<double>();
      } catch (const YAML::Exception&) {
        bad(path, r, "a table row is [bytes, us], two numbers");
      }
      if (!(bytes >= 1 && bytes <= kMaxBytes))
        bad(path, r, fmt::format("table row bytes must be between 1 and {:g}, got {}", kMaxBytes, bytes));
      if (!(us == 0 || (us >= kMinMicroseconds && us <= kMaxMicroseconds)))
        bad(path, r,
            fmt::format("table row us must be 0 or between {:g} and {:g}, got {}", kMinMicroseconds, kMaxMicroseconds, us));
      t.rows.emplace_back(bytes, us * 1e-6);
    }
    std::sort(t.rows.begin(), t.rows.end());
  }
  return t;
}

void emit_table(YAML::Emitter& out, const SizeTable& t) {
  if (t.rows.empty()) return;
  out << YAML::Key << "table" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (const auto& [bytes, s] : t.rows) out << YAML::Flow << YAML::BeginSeq << bytes << s * 1e6 << YAML::EndSeq;
  out << YAML::EndSeq;
}

}  // namespace

HardwareProfile load_profile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(fmt::format("cannot read the hardware profile {}: it is a folder", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("cannot read the hardware profile {}", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw std::runtime_error(fmt::format("cannot read the hardware profile {}", path));
  return load_profile_text(text.str(), path);
}

namespace {

// A list of per-core factors under `key` (absent: empty), each a number in [1e-6, 1e6].
std::vector<double> factor_list(const std::string& path, const YAML::Node& root, const char* key, const char* what) {
  std::vector<double> out;
  const YAML::Node f = root[key];
  if (!f) return out;
  expect_list(path, f, key);
  for (const YAML::Node& x : f) {
    double v = 0;
    try {
      if (!x.IsScalar()) throw YAML::Exception(x.Mark(), "not a scalar");
      v = x.as<double>();
    } catch (const YAML::Exception&) {
      bad(path, x, fmt::format("{} holds numbers", key));
    }
    if (!(v >= 1e-6 && v <= 1e6)) bad(path, x, fmt::format("{} must be between 1e-06 and 1e+06, got {}", what, v));
    out.push_back(v);
  }
  return out;
}

// comm_late: [[lead_us, us], ...], leads increasing. A profile written before the curve (one
// figure, comm_late_us, charged from comm_late_after_us on) reads as its one point.
std::vector<HardwareProfile::LatePoint> late_points(const std::string& path, const YAML::Node& root) {
  std::vector<HardwareProfile::LatePoint> out;
  if (!root["comm_late"]) {
    const double after = number_or_zero(path, root, "comm_late_after_us", kMinMicroseconds, kMaxMicroseconds);
    const double us = number_or_zero(path, root, "comm_late_us", kMinMicroseconds, kMaxMicroseconds);
    if (us > 0) out.push_back({after, us});
    return out;
  }
  const YAML::Node l = root["comm_late"];
  expect_list(path, l, "comm_late");
  for (const YAML::Node& x : l) {
    std::vector<double> pair;
    try {
      pair = x.as<std::vector<double>>();
    } catch (const YAML::Exception&) {
    }
    if (pair.size() != 2) bad(path, x, "comm_late holds [lead_us, us] pairs");
    if (!(pair[0] >= 0 && pair[0] <= kMaxMicroseconds && pair[1] >= 0 && pair[1] <= kMaxMicroseconds))
      bad(path, x, fmt::format("comm_late's lead and time must be between 0 and {:g} us", kMaxMicroseconds));
    if (!out.empty() && !(pair[0] > out.back().lead_us)) bad(path, x, "comm_late's leads must increase");
    out.push_back({pair[0], pair[1]});
  }
  return out;
}

}  // namespace

HardwareProfile load_profile_text(const std::string& yaml_text, const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw std::runtime_error(fmt::format("{}:{}: {}", path, e.mark.line + 1, e.msg));
  }
  if (!root.IsMap() || !root["kernels"])
    throw std::runtime_error(fmt::format("{} is not a hardware profile (written by `trainsim calibrate`)", path));
  HardwareProfile p;
  p.name = get<std::string>(path, root, "name", "");
  p.backend = get<std::string>(path, root, "backend", "");
  p.device = get<std::string>(path, root, "device", "");
  p.measured = get<std::string>(path, root, "measured", "");
  p.scenario = get<std::string>(path, root, "scenario", "");
  p.memory_gib = number(path, root, "memory_gib", 0, 0, 1e9);
  p.ranks_per_node = static_cast<int>(integer(path, root, "ranks_per_node", 1, 1, kMaxRanks));
  p.emulated_low_precision = get<bool>(path, root, "emulated_low_precision", false);
  expect_list(path, root["kernels"], "kernels");
  for (const YAML::Node& k : root["kernels"]) {
    expect_map(path, k, "a kernels entry");
    KernelRate r;
    r.kernel = get<std::string>(path, k, "kernel", "");
    if (r.kernel.empty()) throw std::runtime_error(fmt::format("{}: a kernel entry has no name", where(path, k)));
    r.dtype = dtype_of(path, k);
    r.shape.m = integer(path, k, "m", 0, 0, kMaxDim);
    r.shape.n = integer(path, k, "n", 0, 0, kMaxDim);
    r.shape.k = integer(path, k, "k", 0, 0, kMaxDim);
    r.shape.batch = integer(path, k, "batch", 1, 1, kMaxDim);
    r.shape.elements = integer(path, k, "elements", 0, 0, kMaxDim);
    r.bytes = number_or_zero(path, k, "bytes", 1, kMaxBytes);
    const double us = get<double>(path, k, "us", 0);
    if (!(us >= 0))
      throw std::runtime_error(fmt::format("{}: kernel {} has a negative time (us)", where(path, k), r.kernel));
    r.seconds = number_or_zero(path, k, "us", kMinMicroseconds, kMaxMicroseconds) * 1e-6;
    p.kernels.push_back(std::move(r));
  }
  if (const YAML::Node c = root["composition"]) {
    expect_map(path, c, "composition");
    p.composition = Composition{number(path, c, "forward", 1, 1e-6, 1e6), number(path, c, "backward", 1, 1e-6, 1e6),
                                number_or_zero(path, c, "backward_weight", 1e-6, 1e6),
                                number_or_zero(path, c, "first_forward", 1e-6, 1e6)};
  }
  p.core_factors = factor_list(path, root, "core_factors", "a core factor");
  p.core_alone_factors = factor_list(path, root, "core_alone_factors", "a core alone factor");
  p.optimizer_core_factors = factor_list(path, root, "optimizer_core_factors", "an optimizer core factor");
  p.core_factors_include_tensor_parallel = get<bool>(path, root, "core_factors_include_tensor_parallel", false);
  p.core_handoff_us = number_or_zero(path, root, "core_handoff_us", kMinMicroseconds, kMaxMicroseconds);
  p.comm_poll_us = number_or_zero(path, root, "comm_poll_us", kMinMicroseconds, kMaxMicroseconds);
  p.comm_wake_us = number_or_zero(path, root, "comm_wake_us", kMinMicroseconds, kMaxMicroseconds);
  p.comm_late = late_points(path, root);
  p.comm_late_bytes = number_or_zero(path, root, "comm_late_bytes", 1, kMaxBytes);
  p.comm_late_base_us = number_or_zero(path, root, "comm_late_base_us", kMinMicroseconds, kMaxMicroseconds);
  p.collectives_take_rank_core = get<bool>(path, root, "collectives_take_rank_core", false);
  if (const YAML::Node l = root["p2p"]) {
    expect_map(path, l, "p2p");
    p.p2p = link_of(path, l);
    p.p2p_table = table_of(path, l);
  }
  if (root["allreduce_wire"]) {
    const std::string name = get<std::string>(path, root, "allreduce_wire", "fp32");
    const auto d = parse_dtype(name);
    if (!d || *d == DType::fp8) bad(path, root["allreduce_wire"], fmt::format("allreduce_wire '{}' is not fp32, tf32, fp16 or bf16", name));
    p.allreduce_wire = *d;
  }
  if (const YAML::Node ar = root["allreduce"]) {
    expect_list(path, ar, "allreduce");
    for (const YAML::Node& g : ar) {
      expect_map(path, g, "an allreduce entry");
      if (!g["ranks"]) bad(path, g, "an allreduce entry needs its group size (ranks)");
      const int n = static_cast<int>(integer(path, g, "ranks", 0, 1, kMaxRanks));
      p.allreduce[n] = link_of(path, g);
      if (g["table"]) p.allreduce_tables[n] = table_of(path, g);
    }
  }
  for (auto [key, tables] : {std::pair{"allgather", &p.allgather_tables}, std::pair{"reduce_scatter", &p.reduce_scatter_tables}})
    if (const YAML::Node list = root[key]) {
      expect_list(path, list, key);
      for (const YAML::Node& g : list) {
        expect_map(path, g, key);
        if (!g["ranks"] || !g["table"]) bad(path, g, fmt::format("a {} entry is {{ranks: N, table: [[bytes, us], ...]}}", key));
        (*tables)[static_cast<int>(integer(path, g, "ranks", 0, 2, kMaxRanks))] = table_of(path, g);
      }
    }
  return p;
}

std::string profile_to_yaml(const HardwareProfile& p) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << p.name;
  out << YAML::Key << "backend" << YAML::Value << p.backend;
  out << YAML::Key << "device" << YAML::Value << p.device;
  out << YAML::Key << "measured" << YAML::Value << p.measured;
  out << YAML::Key << "scenario" << YAML::Value << p.scenario;
  out << YAML::Key << "memory_gib" << YAML::Value << p.memory_gib;
  out << YAML::Key << "ranks_per_node" << YAML::Value << p.ranks_per_node;
  out << YAML::Key << "emulated_low_precision" << YAML::Value << p.emulated_low_precision;
  out << YAML::Key << "composition" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "forward"
      << YAML::Value << p.composition.forward << YAML::Key << "backward" << YAML::Value << p.composition.backward;
  if (p.composition.backward_weight > 0)
    out << YAML::Key << "backward_weight" << YAML::Value << p.composition.backward_weight;
  if (p.composition.first_forward > 0)
    out << YAML::Key << "first_forward" << YAML::Value << p.composition.first_forward;
  out << YAML::EndMap;
  if (!p.core_factors.empty()) out << YAML::Key << "core_factors" << YAML::Value << YAML::Flow << p.core_factors;
  if (!p.core_alone_factors.empty())
    out << YAML::Key << "core_alone_factors" << YAML::Value << YAML::Flow << p.core_alone_factors;
  if (!p.optimizer_core_factors.empty())
    out << YAML::Key << "optimizer_core_factors" << YAML::Value << YAML::Flow << p.optimizer_core_factors;
  if (p.core_factors_include_tensor_parallel)
    out << YAML::Key << "core_factors_include_tensor_parallel" << YAML::Value << true;
  if (p.core_handoff_us > 0) out << YAML::Key << "core_handoff_us" << YAML::Value << p.core_handoff_us;
  if (p.comm_poll_us > 0) out << YAML::Key << "comm_poll_us" << YAML::Value << p.comm_poll_us;
  if (p.comm_wake_us > 0) out << YAML::Key << "comm_wake_us" << YAML::Value << p.comm_wake_us;
  if (!p.comm_late.empty()) {
    out << YAML::Key << "comm_late" << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (const HardwareProfile::LatePoint& l : p.comm_late) out << YAML::Flow << std::vector<double>{l.lead_us, l.us};
    out << YAML::EndSeq;
  }
  if (p.comm_late_bytes > 0) out << YAML::Key << "comm_late_bytes" << YAML::Value << p.comm_late_bytes;
  if (p.comm_late_base_us > 0) out << YAML::Key << "comm_late_base_us" << YAML::Value << p.comm_late_base_us;
  if (p.collectives_take_rank_core) out << YAML::Key << "collectives_take_rank_core" << YAML::Value << true;
  out << YAML::Key << "p2p" << YAML::Value << YAML::BeginMap << YAML::Key << "latency_us" << YAML::Value
      << p.p2p.latency_us << YAML::Key << "bandwidth_gbps" << YAML::Value << p.p2p.bandwidth_gbps;
  emit_table(out, p.p2p_table);
  out << YAML::EndMap;
  if (p.allreduce_wire != DType::fp32)
    out << YAML::Key << "allreduce_wire" << YAML::Value << std::string(dtype_name(p.allreduce_wire));
  out << YAML::Key << "allreduce" << YAML::Value << YAML::BeginSeq;
  for (const auto& [n, f] : p.allreduce) {
    out << YAML::BeginMap << YAML::Key << "ranks" << YAML::Value << n << YAML::Key << "latency_us" << YAML::Value
        << f.latency_us << YAML::Key << "bandwidth_gbps" << YAML::Value << f.bandwidth_gbps;
    if (auto t = p.allreduce_tables.find(n); t != p.allreduce_tables.end()) emit_table(out, t->second);
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  for (auto [key, tables] : {std::pair{"allgather", &p.allgather_tables}, std::pair{"reduce_scatter", &p.reduce_scatter_tables}}) {
    if (tables->empty()) continue;
    out << YAML::Key << key << YAML::Value << YAML::BeginSeq;
    for (const auto& [n, t] : *tables) {
      out << YAML::BeginMap << YAML::Key << "ranks" << YAML::Value << n;
      emit_table(out, t);
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::Key << "kernels" << YAML::Value << YAML::BeginSeq;
  for (const KernelRate& k : p.kernels) {
    out << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "kernel" << YAML::Value << k.kernel;
    out << YAML::Key << "dtype" << YAML::Value << std::string(dtype_name(k.dtype));
    if (k.shape.is_matmul()) {
      out << YAML::Key << "m" << YAML::Value << k.shape.m << YAML::Key << "n" << YAML::Value << k.shape.n;
      out << YAML::Key << "k" << YAML::Value << k.shape.k;
      if (k.shape.batch != 1) out << YAML::Key << "batch" << YAML::Value << k.shape.batch;
    } else {
      out << YAML::Key << "elements" << YAML::Value << k.shape.elements;
      out << YAML::Key << "bytes" << YAML::Value << k.bytes;
    }
    out << YAML::Key << "us" << YAML::Value << k.seconds * 1e6;
    out << YAML::Key << (k.shape.is_matmul() ? "tflops" : "gbps") << YAML::Value << k.rate();
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace trainsim
