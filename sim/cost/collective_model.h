// Collectives over a group of ranks, priced as NCCL runs them (the facts, not the code, of
// NCCL's src/graph/tuning.cc; docs/model.md "Collectives"):
//
//   Bus bandwidth (nccl-tests' busbw: what each GPU's busiest link carries per second):
//     inside a node     B_nvl = intra_node.bandwidth_gbps * intra_node.efficiency
//     across nodes      a ring runs one channel per NIC ("rails"): the members on one node cross
//                       over as many NICs as they are, so the ring's busbw is
//                       min(B_nvl, g * B_net), g = members per node, B_net = the per-GPU NIC
//                       rate inter_node.bandwidth_gbps * inter_node.efficiency
//   Algorithms, the fastest for the size chosen as NCCL's tuner does:
//     ring       base + steps * hop latency + (bus bytes + steps * chunk) / busbw; steps 2(n-1)
//                for all-reduce, n-1 for reduce-scatter and all-gather, the 2(k-1) (or k-1) that
//                cross nodes at the network's latency; chunk = min(S/n, kPipelineChunkBytes): the
//                pipeline's fill
//     tree       all-reduce across nodes: NCCL's double binary tree, 0.92 of the ring's busbw,
//                latency 2((g-1) hop_intra + ceil(log2 k) hop_inter)
//     NVLS       all-reduce inside an NVSwitch node with in-switch reduction (cluster.nvlink_sharp):
//                algorithm bandwidth kNvlsAlgbwFraction of the NVLink line rate, 25 us latency;
//                across nodes NVLS + tree (NVLSTree) at min(NVLS, tree) bandwidth
//     hierarchical   only when the scenario asks (communication.allreduce_algorithm):
//                reduce-scatter in each node, all-reduce of S/g between nodes (each GPU on its own
//                NIC), all-gather in each node; ZeRO's reduce-scatter is the first two of those
//                (in the node, then between nodes), its all-gather the reverse
//   bus bytes: all-reduce 2(n-1)/n S; reduce-scatter and all-gather (n-1)/n S (S the whole buffer)
// The 4-byte found-inf reduction is latency-bound: a tree, 2 ceil(log2 n) hops.
// A calibrated profile's measured table replaces all of this (core/hardware_profile.h).
#pragma once

#include "core/hardware_profile.h"
#include "core/plan.h"
#include "sim/cost/cost_models.h"

namespace trainsim {

// Pure closed forms (alpha: per-step latency, B: bus bandwidth, S: buffer bytes, n: members).
double ring_allreduce_seconds(int n, double bytes, double latency_s, double bytes_per_s);
double ring_reduce_scatter_seconds(int n, double bytes, double latency_s, double bytes_per_s);
double ring_allgather_seconds(int n, double bytes, double latency_s, double bytes_per_s);
double allreduce_busbw(int n, double bytes, double seconds);
// nccl-tests' bus bandwidth of a collective of `kind` over n ranks that took `seconds`.
double busbw(OpKind kind, int n, double bytes, double seconds);

// NCCL's per-operation constants (src/graph/tuning.cc, Simple protocol).
inline constexpr double kNcclBaseLatencyUs = 8.4;   // ring and tree
inline constexpr double kNvlsLatencyUs = 25.0;      // NVLS on NVLink
inline constexpr double kTreeBandwidthFactor = 0.92;
// NCCL pipelines a collective in chunks: before the data streams, one chunk per step has to
// cross every hop. Each of the `steps` hops costs min(S/n, kPipelineChunkBytes) at the bus
// bandwidth. The chunk is fit to the published all-reduce sweep of 8 x A100 (Azure ND A100 v4,
// 8 MiB - 256 MiB; docs/model.md), not to any suite row.
inline constexpr double kPipelineChunkBytes = 3.0 * 1048576;
// NVLS all-reduce on 8 H100s peaks at ~275 GB/s algorithm bandwidth (~480 busbw) on a 450 GB/s
// link (S. Jeaugey, NVIDIA, nccl-tests issue #212).
inline constexpr double kNvlsAlgbwFraction = 275.0 / 450.0;

enum class CollectiveAlgorithm { ring, tree, nvls, nvls_tree, hierarchical, tree_latency };
const char* collective_algorithm_name(CollectiveAlgorithm a);

// Where a group's members sit: n members over `nodes` nodes, at most `per_node` on one node.
struct GroupShape {
  int n = 1, nodes = 1, per_node = 1;
};

struct CollectiveCost {
  double seconds = 0;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::ring;
};

// The cost NCCL would pay for `kind` (AllReduce, ReduceScatter, AllGather, OverflowCheck) of
// `bytes` (nccl-tests' size: the whole buffer) over `group`, with the cluster's links.
// `hierarchical`: the scenario asked for the two-level form (all-reduce, reduce-scatter, all-gather).
CollectiveCost nccl_collective(OpKind kind, const GroupShape& group, double bytes, const ClusterConfig& cl,
                               bool hierarchical = false);

class NetworkCollectiveModel final : public CollectiveModel {
 public:
  explicit NetworkCollectiveModel(const Plan& plan);
  Tick duration(const Collective& c) const override;
  // A calibrated profile's comm_wake_us where `waited` exceeds its comm_poll_us; else what its
  // comm_late curve charges at `waited` (HardwareProfile::comm_late_charge_us); else 0.
  Tick wake_after(Tick waited) const override;
  // Whether wake_after can be non-zero (the compiled step program, sim/step_program.h, does not
  // price it: such plans run on the engine).
  bool prices_wake() const;
  // Seconds for a collective of `kind` over `members` (schedule ranks; each stands for its
  // tensor-parallel group, whose t GPUs run t such collectives side by side, each on its own
  // GPU's links).
  // `whole_ranks`: the collective is over every GPU of each member rank's context-parallel group
  // too (the data-parallel collectives: Plan::data_shards), not one per shard side by side.
  double seconds(OpKind kind, const std::vector<int>& members, double bytes, bool whole_ranks = false) const;
  GroupShape shape_of(const std::vector<int>& members, bool whole_ranks = false) const;
  // Whether `c` is over every GPU of its member ranks' context-parallel groups (the data-parallel
  // collectives, gradients and gathered parameters), and the GPUs it is then over.
  static bool spans_whole_ranks(const Collective& c);
  int group_size(const Collective& c) const;
  // A calibrated runtime's copies around a ZeRO reduce-scatter or gather (kShardCopyKernel at its
  // measured rate; core/kernel_inventory.h), 0 for other collectives and for presets.
  double shard_copy_seconds(const Collective& c) const;
  // The same, split: {before the ring's first step, after its last} (a reduce-scatter packs its
  // bucket before and takes its section after; a gather puts its section in before and every
  // section out after).
  std::pair<double, double> shard_copies(const Collective& c) const;
  // The elements one call of `c` moves per member (its parts are one call each).
  double elements_per_call(const Collective& c) const;

 private:
  // Bytes per element of `c` on the wire.
  double wire_bytes(const Collective& c) const;
  const Plan& plan_;
  Tick wake_ = 0, poll_ = 0;  // the calibrated profile's comm_wake_us and comm_poll_us (0: none)
};

}  // namespace trainsim
