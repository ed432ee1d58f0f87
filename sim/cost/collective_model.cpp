#include "sim/cost/collective_model.h"

#include <algorithm>
#include <cmath>

#include "core/kernel_inventory.h"

namespace trainsim {

double ring_allreduce_seconds(int n, double bytes, double alpha, double bw) {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) * alpha + 2.0 * (n - 1) / n * bytes / bw;
}
double ring_reduce_scatter_seconds(int n, double bytes, double alpha, double bw) {
  if (n <= 1) return 0;
  return (n - 1) * alpha + static_cast<double>(n - 1) / n * bytes / bw;
}
double ring_allgather_seconds(int n, double bytes, double alpha, double bw) {
  return ring_reduce_scatter_seconds(n, bytes, alpha, bw);
}

double allreduce_busbw(int n, double bytes, double seconds) {
  return seconds > 0 ? bytes / seconds * 2.0 * (n - 1) / n : 0;
}

namespace {

// nccl-tests' bus factor: bus bytes = factor * S.
double bus_factor(OpKind kind, int n) {
  if (n <= 1) return 0;
  return kind == OpKind::ReduceScatter || kind == OpKind::AllGather ? static_cast<double>(n - 1) / n
                                                                    : 2.0 * (n - 1) / n;
}

double log2_ceil(int k) { return k <= 1 ? 0.0 : std::ceil(std::log2(static_cast<double>(k))); }

}  // namespace

double busbw(OpKind kind, int n, double bytes, double seconds) {
  return seconds > 0 ? bytes * bus_factor(kind, n) / seconds : 0;
}

const char* collective_algorithm_name(CollectiveAlgorithm a) {
  switch (a) {
    case CollectiveAlgorithm::ring: return "ring";
    case CollectiveAlgorithm::tree: return "tree";
    case CollectiveAlgorithm::nvls: return "nvls";
    case CollectiveAlgorithm::nvls_tree: return "nvls-tree";
    case CollectiveAlgorithm::hierarchical: return "hierarchical";
    case CollectiveAlgorithm::tree_latency: return "tree (latency)";
  }
  return "?";
}

CollectiveCost nccl_collective(OpKind kind, const GroupShape& group, double bytes, const ClusterConfig& cl,
                               bool hierarchical) {
  const int n = group.n, k = std::max(1, group.nodes), g = std::max(1, group.per_node);
  if (n <= 1) return {0, CollectiveAlgorithm::ring};
  const double a_intra = us_to_seconds(cl.intra_node.latency_us), a_inter = us_to_seconds(cl.inter_node.latency_us);
  const double b_nvl = gbps_to_bytes_per_second(cl.intra_node.bandwidth_gbps) * cl.intra_node.efficiency;
  const double b_net = gbps_to_bytes_per_second(cl.inter_node.bandwidth_gbps) * cl.inter_node.efficiency;
  const double base = us_to_seconds(kNcclBaseLatencyUs);

  if (kind == OpKind::OverflowCheck) {
    // A few bytes: latency alone, as a tree over the group.
    const double a = k > 1 ? a_inter : a_intra;
    return {2.0 * log2_ceil(n) * a + 2.0 * bytes / (k > 1 ? b_net : b_nvl), CollectiveAlgorithm::tree_latency};
  }
  const bool allreduce = kind == OpKind::AllReduce;
  const double bus = bytes * bus_factor(kind, n);

  // Ring: one channel per NIC across nodes.
  const double ring_bw = k > 1 ? std::min(b_nvl, g * b_net) : b_nvl;
  const int steps = allreduce ? 2 * (n - 1) : n - 1;
  const int inter_steps = k > 1 ? (allreduce ? 2 * (k - 1) : k - 1) : 0;
  const double chunk = std::min(bytes / n, kPipelineChunkBytes);
  CollectiveCost best{base + (steps - inter_steps) * a_intra + inter_steps * a_inter + (bus + steps * chunk) / ring_bw,
                      CollectiveAlgorithm::ring};
  auto consider = [&](double seconds, CollectiveAlgorithm a) {
    if (seconds < best.seconds) best = {seconds, a};
  };

  if (hierarchical && k > 1) {
    // Two levels, as the scenario asked, used as is: inside each node over NVLink (g ranks),
    // between the k nodes on S/g with every GPU on its own NIC. An all-reduce is reduce-scatter
    // in the node, all-reduce between nodes, all-gather in the node; a reduce-scatter (ZeRO's
    // gradients) is reduce-scatter in the node then between nodes; an all-gather the reverse.
    // Between nodes each GPU's NIC carries (k-1)/k of S/g per pass, where a flat ring's rails
    // carry (n-1)/n of S/g.
    const double intra = g > 1 ? (g - 1) * a_intra + static_cast<double>(g - 1) / g * bytes / b_nvl : 0.0;
    const double passes = allreduce ? 2.0 : 1.0;
    const double inter = passes * ((k - 1) * a_inter + static_cast<double>(k - 1) / k * (bytes / g) / b_net);
    return {base + passes * intra + inter, CollectiveAlgorithm::hierarchical};
  }
  if (allreduce && k > 1) {
    const double depth = 2.0 * ((g - 1) + log2_ceil(k));
    consider(base + 2.0 * ((g - 1) * a_intra + log2_ceil(k) * a_inter) +
                 (bus + depth * chunk) / (kTreeBandwidthFactor * ring_bw),
             CollectiveAlgorithm::tree);
  }
  if (allreduce && cl.nvlink_sharp && g > 1) {
    // NVLS: the switch reduces; the algorithm bandwidth is a fixed share of the NVLink line rate.
    const double nvls_algbw = gbps_to_bytes_per_second(cl.intra_node.bandwidth_gbps) * kNvlsAlgbwFraction;
    const double lat = us_to_seconds(kNvlsLatencyUs);
    // In bus-bandwidth terms (x 2(n-1)/n). The switch reduces and multicasts each slice in one
    // pass, so the pipeline fills in n-1 chunk steps, not a ring's 2(n-1).
    double bw = nvls_algbw * 2.0 * (n - 1) / n, extra = 0;
    CollectiveAlgorithm a = CollectiveAlgorithm::nvls;
    if (k > 1) {  // NVLSTree: NVLS inside each node, a tree between nodes on all of the node's NICs
      bw = std::min(bw, kTreeBandwidthFactor * g * b_net);
      extra = 2.0 * log2_ceil(k) * a_inter;
      a = CollectiveAlgorithm::nvls_tree;
    }
    consider(lat + extra + (bus + (n - 1) * chunk) / bw, a);
  }
  return best;
}

GroupShape NetworkCollectiveModel::shape_of(const std::vector<int>& members, bool whole_ranks) const {
  GroupShape s;
  s.n = static_cast<int>(members.size());
  if (s.n == 0) return s;
  if (whole_ranks && plan_.cp > 1) {
    // Each member rank's cp GPUs of one tensor-parallel shard, tp apart: count them by node.
    const int per_node = std::max(1, plan_.config.cluster.gpus_per_node);
    s.n *= plan_.cp;
    s.nodes = 0;
    s.per_node = 0;
    int node = -1, run = 0;
    for (int r : members)
      for (int j = 0; j < plan_.cp; ++j) {
        const int at = (plan_.first_gpu_of(r) + j * plan_.tp) / per_node;
        run = at == node ? run + 1 : 1;
        if (at != node) ++s.nodes;
        node = at;
        s.per_node = std::max(s.per_node, run);
      }
    return s;
  }
  // Members are ascending and ranks fill nodes in order, so nodes change monotonically.
  int run = 1;
  s.nodes = 1;
  s.per_node = 1;
  for (int i = 1; i < s.n; ++i) {
    if (plan_.node_of(members[i]) != plan_.node_of(members[i - 1])) {
      ++s.nodes;
      run = 1;
    } else {
      s.per_node = std::max(s.per_node, ++run);
    }
  }
  return s;
}

double NetworkCollectiveModel::seconds(OpKind kind, const std::vector<int>& members, double bytes,
                                       bool whole_ranks) const {
  const int n = static_cast<int>(members.size()) * (whole_ranks ? plan_.cp : 1);
  if (n <= 1) return 0;
  const auto& cl = plan_.config.cluster;
  if (const auto& profile = cl.calibrated; profile && (!profile->allreduce.empty() || !profile->allreduce_tables.empty())) {
    // Measured: each collective from its own table for this group size where the profile has
    // one (the found-inf flag is a 4-byte all-reduce); a ring's half at half the all-reduce.
    if (kind == OpKind::ReduceScatter) return profile->reduce_scatter_seconds(n, bytes);
    if (kind == OpKind::AllGather) return profile->allgather_seconds(n, bytes);
    return profile->allreduce_seconds(n, bytes);
  }
  const bool hierarchical = plan_.config.communication.allreduce_algorithm == AllReduceAlgorithm::hierarchical;
  return nccl_collective(kind, shape_of(members, whole_ranks), bytes, cl, hierarchical).seconds;
}

Tick NetworkCollectiveModel::duration(const Collective& c) const {
  if (c.parts <= 0) return 0;
  double bytes = static_cast<double>(c.bytes);
  // A runtime that emulates 16-bit formats (the CPU backend) moves every element as a 4-byte
  // float whatever the wire format: its cost goes with the elements, and its profile's tables
  // count bytes in the wire format they were measured in (HardwareProfile::allreduce_wire).
  if (const auto& profile = plan_.config.cluster.calibrated; profile && profile->emulated_low_precision)
    bytes *= dtype_bytes(profile->allreduce_wire) / wire_bytes(c);
  // One call per part (ZeRO-3's units after the first), each paying its own latency and fill.
  const double per_part = seconds(c.kind, c.members, bytes / c.parts, spans_whole_ranks(c));
  return seconds_to_ticks(c.parts * per_part + shard_copy_seconds(c));
}

// The data-parallel collectives (gradients, gathered parameters) span every context-parallel GPU
// of their ranks; the embedding group and the overflow flag pair each GPU with its counterparts.
bool NetworkCollectiveModel::spans_whole_ranks(const Collective& c) {
  return c.purpose == CollectivePurpose::gradients || c.purpose == CollectivePurpose::parameters;
}

int NetworkCollectiveModel::group_size(const Collective& c) const {
  return static_cast<int>(c.members.size()) * (spans_whole_ranks(c) ? plan_.cp : 1);
}

NetworkCollectiveModel::NetworkCollectiveModel(const Plan& plan) : plan_(plan) {
  if (const auto& profile = plan.config.cluster.calibrated) {
    if (profile->comm_wake_us > 0) {
      wake_ = seconds_to_ticks(profile->comm_wake_us * 1e-6);
      poll_ = seconds_to_ticks(profile->comm_poll_us * 1e-6);
    }
  }
}

bool NetworkCollectiveModel::prices_wake() const {
  const auto& profile = plan_.config.cluster.calibrated;
  return wake_ > 0 || (profile && !profile->comm_late.empty());
}

Tick NetworkCollectiveModel::wake_after(Tick waited) const {
  if (wake_ > 0 && waited > poll_) return wake_;
  const auto& profile = plan_.config.cluster.calibrated;
  if (!profile || profile->comm_late.empty()) return 0;
  return seconds_to_ticks(profile->comm_late_charge_us(ticks_to_seconds(waited) * 1e6) * 1e-6);
}

double NetworkCollectiveModel::wire_bytes(const Collective& c) const {
  // schedule.cpp: gathers move working weights, the overflow check one fp32 flag, the rest
  // gradients in the all-reduce format.
  if (c.purpose == CollectivePurpose::parameters) return plan_.weight_bytes();
  if (c.purpose == CollectivePurpose::overflow) return 4.0;
  return dtype_bytes(plan_.config.precision.allreduce);
}

double NetworkCollectiveModel::elements_per_call(const Collective& c) const {
  return c.parts > 0 ? static_cast<double>(c.bytes) / wire_bytes(c) / c.parts : 0.0;
}

double NetworkCollectiveModel::shard_copy_seconds(const Collective& c) const {
  const auto [before, after] = shard_copies(c);
  return before + after;
}

std::pair<double, double> NetworkCollectiveModel::shard_copies(const Collective& c) const {
  const auto& profile = plan_.config.cluster.calibrated;
  const int n = static_cast<int>(c.members.size());
  const int zero = plan_.config.parallelism.zero_stage;
  if (!profile || zero < 1 || n <= 1 || c.parts <= 0) return {0, 0};
  // Elements of the collective's buffer (schedule.cpp: a reduce-scatter's bucket on the wire, a
  // gather's chunk of working weights), and those the runtime copies around the ring, per call
  // (ZeRO-3's units are one call each, each copied on its own).
  const double elements = elements_per_call(c);
  double before = 0, after = 0;
  if (c.kind == OpKind::ReduceScatter && c.purpose == CollectivePurpose::gradients) {
    // Stage 1 packs the bucket from the flat gradients and takes its own section; stages 2-3
    // packed it after the backward (the compute op's) and add their section into the shard.
    before = zero == 1 ? elements : 0;
    after = elements / n;
  } else if (c.kind == OpKind::AllGather && c.purpose == CollectivePurpose::parameters) {
    // Its own section in, every section out to the flat weights (stage 3: the unit's).
    before = elements / n;
    after = elements;
  }
  const double copied = before + after;
  if (copied <= 0) return {0, 0};
  const double storage = profile->emulated_low_precision ? 4.0 : plan_.activation_bytes();
  KernelShape shape;
  shape.elements = static_cast<long>(copied);
  // Stage 3 copies each unit in and out of its gather's buffer (kUnitCopyKernel); the others
  // pack from, or unpack into, flat arrays written long before.
  const bool unit = zero == 3 && c.kind == OpKind::AllGather;
  const double s =
      profile->kernel_seconds(unit ? kUnitCopyKernel : kShardCopyKernel, DType::fp32, shape, 2 * copied * storage);
  if (s <= 0) return {0, 0};  // a profile without the kernel's rate: not priced
  // A copy's time goes with its elements.
  return {c.parts * s * before / copied, c.parts * s * after / copied};
}

}  // namespace trainsim
