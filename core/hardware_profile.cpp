#include "core/hardware_profile.h"

#include <algorithm>
#include <cmath>
#include <limits>
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
  return std::exp(std::log(lo->second) + f * (std::log(hi->second) - std::log(lo->second)));
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

template <class T>
T get(const std::string& path, const YAML::Node& map, const char* key, T fallback) {
  const YAML::Node v = map[key];
  if (!v) return fallback;
  try {
    return v.as<T>();
  } catch (const YAML::Exception&) {
    throw std::runtime_error(fmt::format("{}: {} is not a valid value", where(path, v), key));
  }
}

DType dtype_of(const std::string& path, const YAML::Node& n) {
  const std::string name = get<std::string>(path, n, "dtype", "fp32");
  const auto d = parse_dtype(name);
  if (!d) throw std::runtime_error(fmt::format("{}: unknown dtype '{}'", where(path, n), name));
  return *d;
}

LinkFit link_of(const std::string& path, const YAML::Node& n) {
  return LinkFit{get<double>(path, n, "latency_us", 0), get<double>(path, n, "bandwidth_gbps", 0)};
}

// `table: [[bytes, us], ...]`
SizeTable table_of(const std::string& path, const YAML::Node& n) {
  SizeTable t;
  if (const YAML::Node rows = n["table"]) {
    for (const YAML::Node& r : rows) {
      if (!r.IsSequence() || r.size() != 2)
        throw std::runtime_error(fmt::format("{}: a table row is [bytes, us]", where(path, r)));
      t.rows.emplace_back(r[0].as<double>(), r[1].as<double>() * 1e-6);
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
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    throw std::runtime_error(fmt::format("cannot read the hardware profile {}", path));
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
  p.memory_gib = get<double>(path, root, "memory_gib", 0);
  p.ranks_per_node = get<int>(path, root, "ranks_per_node", 1);
  p.emulated_low_precision = get<bool>(path, root, "emulated_low_precision", false);
  for (const YAML::Node& k : root["kernels"]) {
    KernelRate r;
    r.kernel = get<std::string>(path, k, "kernel", "");
    if (r.kernel.empty()) throw std::runtime_error(fmt::format("{}: a kernel entry has no name", where(path, k)));
    r.dtype = dtype_of(path, k);
    r.shape.m = get<long>(path, k, "m", 0);
    r.shape.n = get<long>(path, k, "n", 0);
    r.shape.k = get<long>(path, k, "k", 0);
    r.shape.batch = get<long>(path, k, "batch", 1);
    r.shape.elements = get<long>(path, k, "elements", 0);
    r.bytes = get<double>(path, k, "bytes", 0);
    r.seconds = get<double>(path, k, "us", 0) * 1e-6;
    if (!(r.seconds >= 0))
      throw std::runtime_error(fmt::format("{}: kernel {} has a negative time (us)", where(path, k), r.kernel));
    p.kernels.push_back(std::move(r));
  }
  if (const YAML::Node c = root["composition"])
    p.composition = Composition{get<double>(path, c, "forward", 1), get<double>(path, c, "backward", 1)};
  if (const YAML::Node f = root["core_factors"]) p.core_factors = f.as<std::vector<double>>();
  p.core_factors_include_tensor_parallel = get<bool>(path, root, "core_factors_include_tensor_parallel", false);
  if (root["p2p"]) {
    p.p2p = link_of(path, root["p2p"]);
    p.p2p_table = table_of(path, root["p2p"]);
  }
  if (const YAML::Node ar = root["allreduce"])
    for (const YAML::Node& g : ar) {
      const int n = get<int>(path, g, "ranks", 0);
      p.allreduce[n] = link_of(path, g);
      if (g["table"]) p.allreduce_tables[n] = table_of(path, g);
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
      << YAML::Value << p.composition.forward << YAML::Key << "backward" << YAML::Value << p.composition.backward
      << YAML::EndMap;
  if (!p.core_factors.empty()) out << YAML::Key << "core_factors" << YAML::Value << YAML::Flow << p.core_factors;
  if (p.core_factors_include_tensor_parallel)
    out << YAML::Key << "core_factors_include_tensor_parallel" << YAML::Value << true;
  out << YAML::Key << "p2p" << YAML::Value << YAML::BeginMap << YAML::Key << "latency_us" << YAML::Value
      << p.p2p.latency_us << YAML::Key << "bandwidth_gbps" << YAML::Value << p.p2p.bandwidth_gbps;
  emit_table(out, p.p2p_table);
  out << YAML::EndMap;
  out << YAML::Key << "allreduce" << YAML::Value << YAML::BeginSeq;
  for (const auto& [n, f] : p.allreduce) {
    out << YAML::BeginMap << YAML::Key << "ranks" << YAML::Value << n << YAML::Key << "latency_us" << YAML::Value
        << f.latency_us << YAML::Key << "bandwidth_gbps" << YAML::Value << f.bandwidth_gbps;
    if (auto t = p.allreduce_tables.find(n); t != p.allreduce_tables.end()) emit_table(out, t->second);
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
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
