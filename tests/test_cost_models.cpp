// Cost models against their closed forms, computed here independently of the models.
#include <gtest/gtest.h>

#include <cmath>

#include "core/kernel_inventory.h"
#include "core/model_shape.h"
#include "core/presets.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/gemm_model.h"
#include "sim/cost/p2p_model.h"
#include "sim/simulator.h"
#include "tests/test_helpers.h"

namespace trainsim {
namespace {

// ---- collectives ---------------------------------------------------------------------

TEST(Collectives, RingAllReduceFormula) {
  const double a = 5e-6, B = 100e9;
  for (int n : {2, 3, 8, 64})
    for (double S : {4.0, 1e6, 25 * 1048576.0, 1e10}) {
      const double expected = 2.0 * (n - 1) * a + 2.0 * (n - 1) / n * S / B;
      EXPECT_NEAR(ring_allreduce_seconds(n, S, a, B), expected, expected * 1e-12) << "n=" << n << " S=" << S;
      // reduce-scatter and all-gather are each half of the all-reduce
      EXPECT_NEAR(ring_reduce_scatter_seconds(n, S, a, B) + ring_allgather_seconds(n, S, a, B), expected,
                  expected * 1e-12);
    }
  EXPECT_EQ(ring_allreduce_seconds(1, 1e9, a, B), 0.0);
}

TEST(Collectives, BusBandwidthAsNcclTestsReportsIt) {
  // With zero latency a ring all-reduce moves 2(n-1)/n S over each link: busbw equals the link.
  const double B = 50e9, S = 1e9;
  for (int n : {2, 4, 16}) {
    const double t = ring_allreduce_seconds(n, S, 0, B);
    EXPECT_NEAR(allreduce_busbw(n, S, t), B, B * 1e-12);
  }
}

Plan cluster_plan(int d, int gpus_per_node, AllReduceAlgorithm algo) {
  ScenarioConfig c = testing::small_config(1, 1, ScheduleKind::one_f_one_b, 1, d);
  c.cluster.gpus_per_node = gpus_per_node;
  c.cluster.intra_node = {300, 3, 0.8};
  c.cluster.inter_node = {25, 6, 0.94};
  c.cluster.nvlink_sharp = false;
  c.communication.allreduce_algorithm = algo;
  return Plan::from_config(c);
}

std::vector<int> all_ranks(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// NCCL's ring inside one node, written out: base latency, 2(n-1) hops, the bus bytes and the
// pipeline's fill at NCCL's share of the NVLink line rate.
double ring_in_node(int n, double S, double hop, double busbw) {
  const double steps = 2.0 * (n - 1);
  return kNcclBaseLatencyUs * 1e-6 + steps * hop + (2.0 * (n - 1) / n * S + steps * std::min(S / n, kPipelineChunkBytes)) / busbw;
}

TEST(Collectives, InsideANodeTheRingRunsAtNcclsShareOfNvlink) {
  const Plan plan = cluster_plan(8, 8, AllReduceAlgorithm::ring);
  for (double S : {1e6, 100e6, 4e9})
    EXPECT_NEAR(NetworkCollectiveModel(plan).seconds(OpKind::AllReduce, all_ranks(8), S),
                ring_in_node(8, S, 3e-6, 300e9 * 0.8), 1e-12)
        << S;
  // At large sizes the bus bandwidth nccl-tests would print tends to the link's share.
  const double S = 64e9;
  const double t = NetworkCollectiveModel(plan).seconds(OpKind::AllReduce, all_ranks(8), S);
  EXPECT_NEAR(allreduce_busbw(8, S, t), 240e9, 240e9 * 0.002);
}

TEST(Collectives, AcrossNodesARingRunsOneChannelPerNicRail) {
  // 16 ranks, 8 per node: the ring crosses between nodes on all 8 GPUs' NICs at once, so its bus
  // bandwidth is min(NVLink share, 8 x NIC share) = min(240, 8 x 23.5) = 188 GB/s, not one NIC's.
  const Plan plan = cluster_plan(16, 8, AllReduceAlgorithm::ring);
  const NetworkCollectiveModel model(plan);
  const GroupShape g = model.shape_of(all_ranks(16));
  EXPECT_EQ(g.n, 16);
  EXPECT_EQ(g.nodes, 2);
  EXPECT_EQ(g.per_node, 8);
  const double S = 8e9;
  const double busbw = 8 * 25e9 * 0.94;
  const double steps = 30, inter = 2;
  const double ring = kNcclBaseLatencyUs * 1e-6 + (steps - inter) * 3e-6 + inter * 6e-6 +
                      (2.0 * 15 / 16 * S + steps * kPipelineChunkBytes) / busbw;
  const CollectiveCost c = nccl_collective(OpKind::AllReduce, g, S, plan.config.cluster);
  EXPECT_EQ(c.algorithm, CollectiveAlgorithm::ring);
  EXPECT_NEAR(c.seconds, ring, 1e-12);
  // One GPU per node (a tensor-parallel group filling each node): each ring has its own NIC only.
  const CollectiveCost one = nccl_collective(OpKind::AllReduce, {16, 16, 1}, S, plan.config.cluster);
  EXPECT_NEAR(allreduce_busbw(16, S, one.seconds), 25e9 * 0.94, 25e9 * 0.94 * 0.02);
}

TEST(Collectives, SmallBuffersAcrossManyNodesTakeTheTree) {
  // 64 nodes of one GPU: a ring pays 126 network hops, NCCL's tree 2 log2(64) = 12.
  ClusterConfig cl = cluster_plan(8, 8, AllReduceAlgorithm::ring).config.cluster;
  const double S = 1 << 20;
  const CollectiveCost c = nccl_collective(OpKind::AllReduce, {64, 64, 1}, S, cl);
  EXPECT_EQ(c.algorithm, CollectiveAlgorithm::tree);
  const double busbw = kTreeBandwidthFactor * 25e9 * 0.94;
  const double expected = kNcclBaseLatencyUs * 1e-6 + 2.0 * 6 * 6e-6 + (2.0 * 63 / 64 * S + 12 * S / 64) / busbw;
  EXPECT_NEAR(c.seconds, expected, 1e-12);
  // Large buffers go back to the ring, whose bandwidth is higher.
  EXPECT_EQ(nccl_collective(OpKind::AllReduce, {64, 64, 1}, 8e9, cl).algorithm, CollectiveAlgorithm::ring);
}

TEST(Collectives, NvlinkSharpAllReduceInsideAnH100Node) {
  ClusterConfig cl;
  apply_gpu_preset(*find_gpu_preset("h100-80gb"), cl);
  const double S = 64e9;
  const CollectiveCost c = nccl_collective(OpKind::AllReduce, {8, 1, 8}, S, cl);
  EXPECT_EQ(c.algorithm, CollectiveAlgorithm::nvls);
  // Algorithm bandwidth 275 GB/s on a 450 GB/s link: busbw 275 x 2(8-1)/8 = 481 GB/s.
  EXPECT_NEAR(allreduce_busbw(8, S, c.seconds), 275e9 * 14 / 8, 481e9 * 0.003);
  // All-gather has no NVLS here: the ring at NCCL's 370 GB/s.
  const CollectiveCost ag = nccl_collective(OpKind::AllGather, {8, 1, 8}, S, cl);
  EXPECT_EQ(ag.algorithm, CollectiveAlgorithm::ring);
  EXPECT_NEAR(busbw(OpKind::AllGather, 8, S, ag.seconds), 450e9 * 0.824, 371e9 * 0.003);
}

// The issue that asked for rails: a 64-GPU all-reduce of GPT-3 1.3B's FP32 gradients (5.3 GB) on
// DGX A100 nodes takes ~55 ms on such clusters; one NIC's ring took 566 ms.
TEST(Collectives, Gpt3XlGradientsOn64A100) {
  ClusterConfig cl;
  apply_gpu_preset(*find_gpu_preset("a100-80gb"), cl);
  const double bytes = ModelShape(find_model_preset("gpt3-1.3b")->model).total_params() * 4;
  const double t = nccl_collective(OpKind::AllReduce, {64, 8, 8}, bytes, cl).seconds;
  EXPECT_NEAR(t, 0.055, 0.055 * 0.10);
}

// The published 8 x A100 all-reduce sweep (Azure ND A100 v4, NCCL 2.18.5) from 4 MiB to 8 GiB:
// the pipeline-fill chunk is fit to its middle sizes, the rest follows from NCCL's link figures.
TEST(Collectives, PublishedA100AllReduceSweep) {
  ClusterConfig cl;
  apply_gpu_preset(*find_gpu_preset("a100-80gb"), cl);
  const std::vector<std::pair<double, double>> measured = {
      {4 << 20, 71.43},       {8 << 20, 89.99},          {16 << 20, 109.22},       {32 << 20, 132.77},
      {64 << 20, 166.63},     {256 << 20, 213.87},       {512 << 20, 221.58},      {1 << 30, 228.10},
      {2.0 * (1 << 30), 230.22}, {4.0 * (1 << 30), 230.48}, {8.0 * (1 << 30), 231.58}};
  for (const auto& [S, gbps] : measured) {
    const double t = nccl_collective(OpKind::AllReduce, {8, 1, 8}, S, cl).seconds;
    EXPECT_NEAR(allreduce_busbw(8, S, t) / 1e9, gbps, gbps * 0.10) << S;
  }
}

TEST(Collectives, HierarchicalWhenAskedSplitsTheWorkOverEveryNic) {
  const Plan hier = cluster_plan(16, 8, AllReduceAlgorithm::hierarchical);
  const double S = 1e9;
  // Reduce-scatter in each node of 8, all-reduce of S/8 between the 2 nodes on each GPU's own
  // NIC, all-gather in each node.
  const double intra = 7 * 3e-6 + 7.0 / 8 * S / 240e9;
  const double inter = 2.0 * 1 * 6e-6 + 2.0 * 1 / 2 * (S / 8) / (25e9 * 0.94);
  EXPECT_NEAR(NetworkCollectiveModel(hier).seconds(OpKind::AllReduce, all_ranks(16), S),
              kNcclBaseLatencyUs * 1e-6 + intra + inter + intra, 1e-12);
  // Inside one node there is nothing to split: NCCL's own choice.
  const Plan one = cluster_plan(8, 8, AllReduceAlgorithm::hierarchical);
  EXPECT_NEAR(NetworkCollectiveModel(one).seconds(OpKind::AllReduce, all_ranks(8), S),
              ring_in_node(8, S, 3e-6, 240e9), 1e-12);
}

// ZeRO's reduce-scatter and all-gather, when the scenario asks for two levels: one pass inside
// each node, one between the nodes on S/g, each GPU on its own NIC.
TEST(Collectives, HierarchicalReduceScatterAndAllGatherAreTwoPasses) {
  const Plan hier = cluster_plan(16, 8, AllReduceAlgorithm::hierarchical);
  const ClusterConfig& cl = hier.config.cluster;
  const double S = 1e9;
  const double intra = 7 * 3e-6 + 7.0 / 8 * S / 240e9;
  const double inter = 1 * 6e-6 + 1.0 / 2 * (S / 8) / (25e9 * 0.94);
  for (OpKind kind : {OpKind::ReduceScatter, OpKind::AllGather}) {
    SCOPED_TRACE(op_kind_name(kind));
    EXPECT_NEAR(NetworkCollectiveModel(hier).seconds(kind, all_ranks(16), S),
                kNcclBaseLatencyUs * 1e-6 + intra + inter, 1e-12);
    // Eight members per node already cross on all eight rails: the flat ring is faster than
    // paying the NVLink pass first. Two per node (a data-parallel group beside tensor
    // parallelism 4) leave the rails 3/4 of S/2 to carry flat, 1/2 of it in two levels.
    EXPECT_GT(nccl_collective(kind, {16, 2, 8}, S, cl, true).seconds, nccl_collective(kind, {16, 2, 8}, S, cl).seconds);
    EXPECT_LT(nccl_collective(kind, {4, 2, 2}, S, cl, true).seconds, nccl_collective(kind, {4, 2, 2}, S, cl).seconds);
  }
}

TEST(PointToPoint, LatencyPlusBytesOverTheJoiningLinksShare) {
  // 16 ranks, 8 per node: 7 -> 8 crosses nodes, 0 -> 1 does not. No pipeline: nothing but the
  // link limits a send (a two-member communicator on one node gets 16 channels of 20 GB/s).
  const Plan plan = cluster_plan(16, 8, AllReduceAlgorithm::ring);
  const LinkP2PModel p2p(plan);
  const Bytes S = 32 << 20;
  EXPECT_EQ(p2p.duration(0, 1, S), seconds_to_ticks(3e-6 + S / (300e9 * 0.8)));
  EXPECT_EQ(p2p.duration(7, 8, S), seconds_to_ticks(6e-6 + S / (25e9 * 0.94)));
}

// NCCL's channel arithmetic (src/graph/paths.cc, src/enqueue.cc), worked by hand for the
// nodes in the presets. An A100 has 12 NVLinks: 24 collective channels, 32 p2p channels, 32 per
// NVLink peer, each at one NVLink's effective 20 GB/s.
TEST(PointToPoint, NcclStripesASendOverTheChannelsItsCommunicatorAllows) {
  ClusterConfig a100;
  a100.intra_node = {300, 3, 0.8};
  a100.inter_node = {25, 6, 0.94};
  // Eight members on one node: 32 -> 16 -> 8 -> 4 channels to start (4 x 8 <= 32), at most 16
  // (16 x 8 <= 4 x 32); a 28 MiB activation stays on 4 (7 MiB parts, under 16 MiB).
  const P2pChannels eight = nccl_p2p_channel_range(8, false, a100);
  EXPECT_EQ(eight.min, 4);
  EXPECT_EQ(eight.max, 16);
  EXPECT_EQ(nccl_p2p_channels(eight, false, 28.0 * 1048576), 4);
  EXPECT_DOUBLE_EQ(nccl_p2p_bytes_per_second(28.0 * 1048576, true, eight, false, a100), 4 * 20e9);
  // 256 MiB doubles to 8 (32 MiB parts), then 16 (16 MiB): 320 GB/s of channels, the link's 240.
  EXPECT_EQ(nccl_p2p_channels(eight, false, 256.0 * 1048576), 16);
  EXPECT_DOUBLE_EQ(nccl_p2p_bytes_per_second(256.0 * 1048576, true, eight, false, a100), 240e9);
  // Two members: 16 channels from the start, so the link limits.
  const P2pChannels two = nccl_p2p_channel_range(2, false, a100);
  EXPECT_EQ(two.min, 16);
  EXPECT_DOUBLE_EQ(nccl_p2p_bytes_per_second(1048576, true, two, false, a100), 240e9);
  // A communicator with a member on another node: every peer gets the NIC's 2 channels (200 Gb/s
  // HDR: max(2, 25 / 14)), its NVLink neighbours too (40 GB/s); the NIC's hop is the NIC's 23.5.
  const P2pChannels spread = nccl_p2p_channel_range(16, true, a100);
  EXPECT_EQ(spread.min, 2);
  EXPECT_EQ(nccl_p2p_channels(spread, true, 1e9), 2);
  EXPECT_DOUBLE_EQ(nccl_p2p_bytes_per_second(28.0 * 1048576, true, spread, true, a100), 40e9);
  EXPECT_DOUBLE_EQ(nccl_p2p_bytes_per_second(28.0 * 1048576, false, spread, true, a100), 25e9 * 0.94);
  // H100: 18 NVLinks at 20.6 GB/s, 400 Gb/s NICs: ceil(50 / 14) = 4 channels per remote peer.
  ClusterConfig h100;
  h100.intra_node = {450, 3, 0.824};
  h100.inter_node = {50, 6, 0.94};
  const P2pChannels h100_spread = nccl_p2p_channel_range(16, true, h100);
  EXPECT_EQ(h100_spread.min, 4);
  EXPECT_NEAR(nccl_p2p_bytes_per_second(28.0 * 1048576, true, h100_spread, true, h100), 4 * 25e9 * 0.824, 1.0);
}

// A pipeline of 8 stages on one A100 node sends its 28 MiB activations at 4 channels' 80 GB/s;
// stretched over two nodes, every NVLink hop of it runs at the NIC's 2 channels.
TEST(PointToPoint, APipelinesSendsRunAtItsCommunicatorsChannels) {
  ScenarioConfig c = testing::small_config(8, 8, ScheduleKind::one_f_one_b);
  c.cluster.intra_node = {300, 3, 0.8};
  c.cluster.inter_node = {25, 6, 0.94};
  const Bytes S = 28 << 20;
  const Plan one_node = Plan::from_config(c);
  EXPECT_EQ(LinkP2PModel(one_node).duration(0, 1, S), seconds_to_ticks(3e-6 + S / 80e9));
  c.cluster.gpus_per_node = 4;
  const Plan two_nodes = Plan::from_config(c);
  const LinkP2PModel p2p(two_nodes);
  EXPECT_EQ(p2p.duration(0, 1, S), seconds_to_ticks(3e-6 + S / 40e9));
  EXPECT_EQ(p2p.duration(3, 4, S), seconds_to_ticks(6e-6 + S / (25e9 * 0.94)));
}

// Without p2p overlap a send holds its rank's compute stream: the step is longer than with
// overlap, and a Predictor that meets the plan again (its compiled program) gives what predict()
// gives.
TEST(PointToPoint, BlockingSendsHoldTheComputeStream) {
  ScenarioConfig c = testing::small_config(4, 8, ScheduleKind::one_f_one_b);
  c.cluster.intra_node = {1, 3, 1};  // sends slow enough to see
  const Plan overlapped = Plan::from_config(c);
  c.communication.overlap_p2p_comm = false;
  const Plan blocking = Plan::from_config(c);
  const double t_overlapped = predict(overlapped).result.step_time_s, t_blocking = predict(blocking).result.step_time_s;
  EXPECT_GT(t_blocking, t_overlapped);
  Predictor p;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(p.evaluate(blocking).step_time_s, t_blocking) << "evaluation " << i;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(p.evaluate(overlapped).step_time_s, t_overlapped) << "evaluation " << i;
}

// ---- model shape and compute ----------------------------------------------------------

TEST(ModelShape, ParameterCountsOfPublishedModels) {
  // Llama 2 7B has exactly 6,738,415,616 parameters (the released checkpoint).
  EXPECT_EQ(ModelShape(find_model_preset("llama2-7b")->model).total_params(), 6738415616.0);
  // Llama 3 8B, 3 70B and 3.1 405B, as their released checkpoints count them.
  EXPECT_EQ(ModelShape(find_model_preset("llama3-8b")->model).total_params(), 8030261248.0);
  EXPECT_EQ(ModelShape(find_model_preset("llama3-70b")->model).total_params(), 70553706496.0);
  EXPECT_EQ(ModelShape(find_model_preset("llama3-405b")->model).total_params(), 405853388800.0);
  // GPT-3 175B: 12 L h^2 + 13 L h + (V + s) h + 2h with biases and LayerNorms (Megatron's count).
  const ModelShape g(find_model_preset("gpt3-175b")->model);
  const double L = 96, h = 12288, V = 50304, s = 2048;
  EXPECT_EQ(g.total_params(), 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h);
  EXPECT_NEAR(g.total_params() / 1e9, 175.0, 0.5);
  // Llama 2 70B with grouped-query attention: 68.98B.
  EXPECT_NEAR(ModelShape(find_model_preset("llama2-70b")->model).total_params() / 1e9, 68.98, 0.01);
}

TEST(ModelShape, ForwardFlopsOfAGptLayer) {
  // Narayanan et al. 2021: 24 b s h^2 + 4 b s^2 h per layer (ffn = 4h, no GQA).
  ModelConfig m;
  m.hidden_size = 4096;
  m.num_attention_heads = 32;
  m.seq_length = 2048;
  const ModelShape shape(m);
  for (int b : {1, 4}) {
    const double h = 4096, s = 2048;
    EXPECT_EQ(shape.layer_forward_flops(b), 24 * b * s * h * h + 4 * b * s * s * h);
    EXPECT_EQ(shape.lm_head_forward_flops(b), 2 * b * s * h * m.vocab_size);
  }
}

// ---- matrix products by shape ----------------------------------------------------------

ClusterConfig gpu(const char* name) {
  ClusterConfig c;
  apply_gpu_preset(*find_gpu_preset(name), c);
  return c;
}

KernelShape product(long m, long n, long k, long batch = 1) {
  KernelShape s;
  s.m = m, s.n = n, s.k = k, s.batch = batch;
  return s;
}

TEST(GemmModel, AFullWaveOfWholeTilesReachesTheCeilingLessItsDepthOverhead) {
  ClusterConfig c = gpu("a100-80gb");
  // 108 tiles of 256 x 128 on 108 SMs: one full wave, every tile whole.
  const KernelShape s = product(256 * 108, 128, 4096);
  EXPECT_NEAR(gemm_compute_efficiency(s, c), c.compute_efficiency * 4096 / (4096 + kDepthOverhead), 1e-12);
  // One tile more: a second wave that runs one tile: the best tiling loses a lot of the GPU.
  EXPECT_LT(gemm_compute_efficiency(product(256 * 109, 128, 4096), c), 0.7 * gemm_compute_efficiency(s, c));
  c.sm_count = 0;  // no waves: only whole tiles and depth count
  EXPECT_NEAR(gemm_compute_efficiency(product(256 * 109, 128, 4096), c), gemm_compute_efficiency(s, c), 1e-12);
}

// Published cuBLASLt measurements, never fit: Azure ND A100 v4 (FP16, A100-SXM4-80GB, Azure/
// AI-benchmarking-guide Azure_Results/ND_A100_v4_results.md) and OpenXLA's H100 matmul table
// (BF16, sm_90, xla/service/gpu/model/matmul_interpolator_data.h). Large products within 7%;
// small ones, where cuBLAS's own tile choices rule, within 25%. (Products under ~2048 x 2048 on
// an H100 run far below this model, at 35% of peak: training's products are larger.)
TEST(GemmModel, PublishedCublasThroughputs) {
  struct Row {
    const char* gpu;
    long m, n, k, batch;
    double tflops, tolerance;
  };
  const Row rows[] = {
      {"a100-80gb", 4096, 4096, 4096, 1, 228.0, 0.07},      {"a100-80gb", 8192, 8192, 8192, 1, 253.7, 0.07},
      {"a100-80gb", 16384, 16384, 16384, 1, 256.5, 0.07},   {"a100-80gb", 6144, 12288, 12288, 1, 250.8, 0.07},
      {"a100-80gb", 2048, 2048, 2048, 1, 221.8, 0.25},      {"a100-80gb", 1024, 1024, 1024, 1, 119.4, 0.25},
      {"a100-80gb", 1024, 2145, 1024, 1, 132.8, 0.25},      {"a100-80gb", 802816, 192, 768, 1, 157.8, 0.25},
      {"h100-80gb", 4096, 4096, 4096, 1, 783.3, 0.07},      {"h100-80gb", 4096, 2048, 4096, 2, 783.2, 0.07},
      {"h100-80gb", 4096, 4096, 2048, 2, 763.0, 0.07},      {"h100-80gb", 2048, 2048, 2048, 1, 632.0, 0.25},
      {"h100-80gb", 4096, 1024, 4096, 2, 750.6, 0.10},
  };
  for (const Row& r : rows) {
    const ClusterConfig c = gpu(r.gpu);
    const KernelShape s = product(r.m, r.n, r.k, r.batch);
    const double peak = c.peak_tflops.at(DType::bf16) * 1e12;
    const double tflops = s.flops() / gemm_seconds(s, 2, peak, c) / 1e12;
    EXPECT_NEAR(tflops, r.tflops, r.tflops * r.tolerance) << r.gpu << " " << r.m << "x" << r.n << "x" << r.k;
  }
}

// ---- compute model: the framework's kernels, priced ------------------------------------

// A GPT whose products are all made of whole 256 x 128 tiles, on a GPU without wave limits, with
// memory bandwidth so high that memory-bound work vanishes: each product then costs exactly
// 2 m n k / (peak * k / (k + kDepthOverhead)).
ScenarioConfig compute_config(Recompute r, int t = 1) {
  ScenarioConfig c = testing::small_config(4, 8, ScheduleKind::one_f_one_b);
  c.model.hidden_size = 1024;
  c.model.num_attention_heads = 8;
  c.model.seq_length = 512;
  c.model.num_layers = 8;
  c.model.hidden_dropout = 0;
  c.model.attention_dropout = 0;
  c.model.attention = AttentionKernel::flash;
  c.cluster.num_gpus = 4 * t;
  c.parallelism.tensor_parallel_size = t;
  c.cluster.compute_efficiency = 1;
  c.cluster.sm_count = 0;
  c.cluster.attention_efficiency = 0.5;
  c.cluster.hbm_bandwidth_gbps = 1e12;  // memory-bound work vanishes: only matrix products remain
  c.cluster.memory_efficiency = 1;
  c.cluster.intra_node = {1e12, 0, 1};
  c.training.activation_recompute = r;
  c.precision.compute = DType::bf16;
  c.precision.grad_accumulation = DType::bf16;
  return c;
}

double product_seconds(double m, double n, double k, double peak) { return 2 * m * n * k / (peak * k / (k + kDepthOverhead)); }

// cuDNN's fused attention does FlashAttention's work (the same products, no s x s scores stored)
// at its own measured rate: the same chunk priced with cudnn_attention_efficiency in place of
// attention_efficiency, its products and its memory unchanged.
TEST(ComputeModel, CudnnAttentionIsFlashAttentionsWorkAtItsOwnRate) {
  const double peak = 312e12, s = 512, h = 1024;
  const double flash_rate = 0.5, cudnn_rate = 0.8;
  ScenarioConfig c = compute_config(Recompute::none);
  c.cluster.attention_efficiency = flash_rate;
  c.cluster.cudnn_attention_efficiency = cudnn_rate;
  const RooflineComputeModel flash(Plan::from_config(c));
  c.model.attention = AttentionKernel::cudnn;
  const RooflineComputeModel cudnn(Plan::from_config(c));
  // Two layers of a middle stage: 4 b s^2 h forward, 2.5 times that backward, causal.
  const double work = 2 * 4 * s * s * h * (0.5 + 64 / s) / peak;
  EXPECT_NEAR(flash.chunk(1).forward - cudnn.chunk(1).forward, work / flash_rate - work / cudnn_rate, work * 1e-6);
  EXPECT_NEAR(flash.chunk(1).backward_input - cudnn.chunk(1).backward_input,
              2.5 * (work / flash_rate - work / cudnn_rate), work * 1e-6);
  EXPECT_DOUBLE_EQ(flash.chunk(1).backward_weight, cudnn.chunk(1).backward_weight);
  c.cluster.cudnn_attention_efficiency = flash_rate;  // at the same rate, the same chunk
  const RooflineComputeModel same(Plan::from_config(c));
  EXPECT_DOUBLE_EQ(same.chunk(1).forward, flash.chunk(1).forward);
  EXPECT_DOUBLE_EQ(same.chunk(1).backward_input, flash.chunk(1).backward_input);
  c.model.attention = AttentionKernel::flash;
  const ModelShape a(Plan::from_config(c).config.model);
  c.model.attention = AttentionKernel::cudnn;
  const ModelShape b(Plan::from_config(c).config.model);
  EXPECT_DOUBLE_EQ(a.layer_stored_activation_bytes(2, 2, 1, false, Recompute::selective),
                   b.layer_stored_activation_bytes(2, 2, 1, false, Recompute::selective));
  EXPECT_DOUBLE_EQ(a.hardware_flops_per_sample(Recompute::selective_op), b.hardware_flops_per_sample(Recompute::selective_op));
}

// The Hopper presets price cuDNN's fused attention 1.63x FlashAttention 2 (the FlashAttention-3
// paper's H100 measurements of both at head dimension 128, 8k tokens, forward and backward
// weighted by their work: docs/presets.md); elsewhere the two are priced alike.
TEST(Presets, CudnnAttentionIsFasterOnHopperOnly) {
  for (const GpuPreset& g : gpu_presets()) {
    const bool hopper = g.name.rfind("h100", 0) == 0 || g.name == "h200";
    if (hopper) {
      const double fa2 = 1.0 / (1 / 370.0 + 2.5 / 318.0), cudnn = 1.0 / (1 / 600.0 + 2.5 / 518.0);
      EXPECT_NEAR(g.cudnn_attention_efficiency / g.attention_efficiency, cudnn / fa2, 0.01) << g.name;
    } else {
      EXPECT_EQ(g.cudnn_attention_efficiency, g.attention_efficiency) << g.name;
    }
  }
}

TEST(ComputeModel, ForwardIsEachProductAtItsDepthEfficiencyPlusFlashAttention) {
  const double peak = 312e12, N = 512, h = 1024, f = 4096, s = 512;
  const double weights = product_seconds(N, 3 * h, h, peak) + product_seconds(N, h, h, peak) +
                         product_seconds(N, f, h, peak) + product_seconds(N, h, f, peak);
  // FlashAttention on a causal decoder: QK^T and AV (4 b s^2 h), about half of it computed.
  const double attention = 4 * s * s * h * (0.5 + 64 / s) / (peak * 0.5);
  const RooflineComputeModel cm(Plan::from_config(compute_config(Recompute::none)));
  const auto& mid = cm.chunk(1);  // a middle stage: 2 layers, no embedding or head
  EXPECT_NEAR(mid.forward, 2 * (weights + attention), 2 * (weights + attention) * 1e-6);
  // Backward: input gradients (the transposed products; flash's backward does 2.5x its forward)
  // and weight gradients (the same FLOPs with k = N tokens).
  const double input = product_seconds(N, f, h, peak) + product_seconds(N, h, f, peak) + product_seconds(N, h, h, peak) +
                       product_seconds(N, h, 3 * h, peak) + 2.5 * attention;
  const double weight = product_seconds(h, f, N, peak) + product_seconds(f, h, N, peak) + product_seconds(h, h, N, peak) +
                        product_seconds(3 * h, h, N, peak);
  EXPECT_NEAR(mid.backward_input, 2 * input, 2 * input * 1e-6);
  EXPECT_NEAR(mid.backward_weight, 2 * weight, 2 * weight * 1e-6);
  // The first and last stages are heavier with the same layer count.
  EXPECT_GT(cm.chunk(0).forward, mid.forward);
  EXPECT_GT(cm.chunk(3).forward, mid.forward);
}

TEST(ComputeModel, RecomputeRepeatsTheForwardOrItsAttention) {
  const RooflineComputeModel none(Plan::from_config(compute_config(Recompute::none)));
  const RooflineComputeModel full(Plan::from_config(compute_config(Recompute::full)));
  const RooflineComputeModel sel(Plan::from_config(compute_config(Recompute::selective)));
  EXPECT_NEAR(full.chunk(1).backward_input - none.chunk(1).backward_input, none.chunk(1).forward, 1e-12);
  const double attention = 4.0 * 512 * 512 * 1024 * (0.5 + 64.0 / 512) / (312e12 * 0.5);
  EXPECT_NEAR(sel.chunk(1).backward_input - none.chunk(1).backward_input, 2 * attention, 1e-12);
  EXPECT_EQ(full.chunk(1).backward_weight, none.chunk(1).backward_weight);
}

// torchtitan's op-level policy reruns, before a layer's input gradients, the products whose output
// it did not keep (with flash attention and memory-bound work free, only they cost): Megatron-LM's
// fused qkv, o, fc1, fc2 rerun o and fc2; PyTorch-native code's q, k, v, o, fc1, fc2 (FSDP) rerun k,
// o and fc2.
TEST(ComputeModel, OpLevelRecomputeRerunsTheProductsItDidNotKeep) {
  const double peak = 312e12, N = 512, h = 1024, f = 4096;
  for (Framework fw : {Framework::megatron, Framework::fsdp}) {
    ScenarioConfig c = compute_config(Recompute::none);
    c.parallelism.framework = fw;
    if (fw == Framework::fsdp) {  // FSDP shards without a pipeline
      c.parallelism.pipeline_parallel_size = 1;
      c.parallelism.data_parallel_size = 4;
      c.parallelism.zero_stage = 3;
      c.training.global_batch_size = 32;
    }
    const RooflineComputeModel none(Plan::from_config(c));
    c.training.activation_recompute = Recompute::selective_op;
    const RooflineComputeModel op(Plan::from_config(c));
    const int layers = fw == Framework::fsdp ? 8 : 2;
    const int chunk = fw == Framework::fsdp ? 0 : 1;
    double again = product_seconds(N, h, h, peak) + product_seconds(N, h, f, peak);
    if (fw == Framework::fsdp) again += product_seconds(N, h, h, peak);  // k (as wide as q: no grouped heads)
    EXPECT_NEAR(op.chunk(chunk).backward_input - none.chunk(chunk).backward_input, layers * again, layers * again * 1e-9)
        << (fw == Framework::fsdp ? "fsdp" : "megatron");
    EXPECT_EQ(op.chunk(chunk).forward, none.chunk(chunk).forward);
    EXPECT_EQ(op.chunk(chunk).backward_weight, none.chunk(chunk).backward_weight);
  }
}

TEST(ComputeModel, TensorParallelSplitsProductsAndAddsTwoAllReducesEachWay) {
  ScenarioConfig c = compute_config(Recompute::none, 2);
  c.cluster.intra_node = {100, 2, 1};  // a link slow enough to see
  const Plan plan = Plan::from_config(c);
  const RooflineComputeModel split(plan);
  const double act_bytes = 512.0 * 1024 * 2;  // b s h in bf16
  // A middle stage's forward: two all-reduces per layer, and the all-gather of the pipeline
  // message that arrives as two slices (Megatron's scatter/gather).
  const double ar = nccl_collective(OpKind::AllReduce, {2, 1, 2}, act_bytes, c.cluster).seconds;
  const double ag = nccl_collective(OpKind::AllGather, {2, 1, 2}, act_bytes, c.cluster).seconds;
  // Each GPU computes half of every product (column-parallel: half the outputs; row-parallel:
  // half the depth) and half the attention heads.
  const double peak = 312e12, N = 512, h = 1024, f = 4096, s = 512;
  const double forward = product_seconds(N, 3 * h / 2, h, peak) + product_seconds(N, h, h / 2, peak) +
                         product_seconds(N, f / 2, h, peak) + product_seconds(N, h, f / 2, peak) +
                         4 * s * s * h / 2 * (0.5 + 64 / s) / (peak * 0.5);
  EXPECT_NEAR(split.chunk(1).forward, 2 * (forward + 2 * ar) + ag, forward * 1e-6);
}

// A tensor-parallel group over whole nodes (4 GPUs on nodes of 2) runs its per-layer collectives
// as NCCL's rings over the nodes' NICs: a middle stage's forward costs its two layers' two
// all-reduces each, and the pipeline message's all-gather, at that group's price instead of one
// node's; the plan warns how far the group reaches.
TEST(ComputeModel, TensorParallelOverWholeNodesRunsItsCollectivesOverTheNics) {
  ScenarioConfig c = compute_config(Recompute::none, 4);
  c.cluster.intra_node = {100, 2, 1};
  c.cluster.inter_node = {10, 5, 1};  // a NIC far slower than the link inside a node
  const double in_node = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  c.cluster.gpus_per_node = 2;
  const Plan spread = Plan::from_config(c);
  const double act_bytes = 512.0 * 1024 * 2;  // b s h in bf16
  auto cost = [&](OpKind kind, const GroupShape& g) { return nccl_collective(kind, g, act_bytes, c.cluster).seconds; };
  const double extra = 2 * 2 * (cost(OpKind::AllReduce, {4, 2, 2}) - cost(OpKind::AllReduce, {4, 1, 4})) +
                       cost(OpKind::AllGather, {4, 2, 2}) - cost(OpKind::AllGather, {4, 1, 4});
  EXPECT_GT(extra, 0);
  EXPECT_NEAR(RooflineComputeModel(spread).chunk(1).forward - in_node, extra, extra * 1e-9);
  EXPECT_TRUE(std::any_of(spread.warnings.begin(), spread.warnings.end(), [](const std::string& w) {
    return w.find("tensor_parallel_size(4) spans 2 nodes of 2 GPUs") != std::string::npos;
  }));
}

// Memory-bound work at HBM speed: with matrix products free, a layer's forward is the bytes of
// its fused kernels (Megatron-LM's: LayerNorm 2e, bias-dropout-add 3e (+1 mask byte), GELU 2e
// over the FFN) over the HBM bandwidth, plus the products' own operands.
TEST(ComputeModel, DropoutCostsItsMasksAndNaiveAttentionItsScores) {
  ScenarioConfig c = compute_config(Recompute::none);
  c.cluster.peak_tflops = {{DType::bf16, 1e9}};
  c.cluster.hbm_bandwidth_gbps = 1000;
  c.cluster.int32_tops = 1e9;  // drawing the masks free: only their bytes (next test)
  const double hbm = 1000e9, N = 512, h = 1024, bHT2 = 8.0 * 512 * 512;
  const double base = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  c.model.hidden_dropout = 0.1;  // two 1-byte masks per layer in bias-dropout-add
  const double hidden = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  EXPECT_NEAR(hidden - base, 2 * 2 * N * h / hbm, 1e-12);
  // Flash keeps attention dropout inside its kernel: no bytes.
  c.model.attention_dropout = 0.1;
  EXPECT_NEAR(RooflineComputeModel(Plan::from_config(c)).chunk(1).forward, hidden, 1e-12);
  // Fused attention writes the scores, and with dropout their mask and dropped copy.
  c.model.attention = AttentionKernel::fused;
  c.model.attention_dropout = 0;
  const double fused = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  c.model.attention_dropout = 0.1;
  const double fused_dropout = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  EXPECT_NEAR(fused_dropout - fused, 2 * bHT2 * (2 * 2 + 1) / hbm, 1e-12);
  c.model.attention = AttentionKernel::naive;
  EXPECT_NEAR(RooflineComputeModel(Plan::from_config(c)).chunk(1).forward - fused_dropout, 2 * bHT2 * 2 * 2 / hbm, 1e-12);
  EXPECT_GT(fused, hidden);
}

// A dropout kernel draws its mask with Philox: about 25 integer instructions per element on the
// SMs' INT32 lanes, overlapping its bytes as a soft roofline, sqrt(memory^2 + draws^2). With
// products free, memory at 1 TB/s and 1 tera-instruction/s, a middle stage's two layers each
// draw the attention dropout's mask over b H s^2 scores (5 bytes each: read and write 2, mask 1)
// and two bias-dropout-adds' over N h (3 x 2 bytes + the mask byte); halving the clock the SMs
// hold doubles the draws' time, not the bytes'.
TEST(ComputeModel, DropoutDrawsItsMaskOnTheIntegerLanes) {
  ScenarioConfig c = compute_config(Recompute::none);
  c.cluster.peak_tflops = {{DType::bf16, 1e9}};
  c.cluster.hbm_bandwidth_gbps = 1000;
  c.model.attention = AttentionKernel::fused;
  c.model.hidden_dropout = c.model.attention_dropout = 0.1;
  const double hbm = 1000e9, N = 512, h = 1024, bHT2 = 8.0 * 512 * 512;
  auto extra = [&](double elements, double bytes, double rate) {
    const double memory = elements * bytes / hbm, draws = elements * 25 / rate;
    return std::sqrt(memory * memory + draws * draws) - memory;
  };
  c.cluster.int32_tops = 1e9;
  const double free_draws = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  for (double clock : {1.0, 0.5}) {
    c.cluster.int32_tops = 1;
    c.cluster.sustained_clock_fraction = clock;
    const double rate = 1e12 * clock;
    const double drawn = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
    EXPECT_NEAR(drawn - free_draws, 2 * (extra(bHT2, 5, rate) + 2 * extra(N * h, 7, rate)), 1e-12) << clock;
  }
  // Without dropout nothing is drawn.
  c.model.hidden_dropout = c.model.attention_dropout = 0;
  const double none = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  c.cluster.int32_tops = 1e9;
  EXPECT_NEAR(RooflineComputeModel(Plan::from_config(c)).chunk(1).forward, none, 1e-15);
}

// Gradient accumulation over m micro-batches into an FP32 buffer: a separate add per weight
// (read the sum and the new gradient, write the sum: 2 * 4 + 2 bytes, from the second
// micro-batch on), or Megatron-LM's fusion, where each weight-gradient product reads and writes
// its FP32 main_grad tile itself (8 bytes per weight instead of writing 2). With products free
// and memory at 1 TB/s, a middle stage's weight pass differs by exactly those bytes.
TEST(ComputeModel, GradientAccumulationFusionMovesTheSumIntoTheProduct) {
  ScenarioConfig c = compute_config(Recompute::none);
  c.cluster.peak_tflops = {{DType::bf16, 1e9}};
  c.cluster.hbm_bandwidth_gbps = 1000;
  c.precision.grad_accumulation = DType::fp32;
  c.parallelism.framework = Framework::megatron;
  const Plan plan = Plan::from_config(c);
  const int m = plan.num_microbatches;
  ASSERT_GT(m, 1);
  const double hbm = 1000e9, h = 1024, f = 4096;
  const double matrices = 3 * h * h + h * h + f * h + h * f;  // one layer's weight matrices
  const double layer = ModelShape(c.model).params_per_layer();
  const double fused = RooflineComputeModel(plan).chunk(1).backward_weight;
  c.training.gradient_accumulation_fusion = false;
  const double separate = RooflineComputeModel(Plan::from_config(c)).chunk(1).backward_weight;
  const double per_layer = layer * (2 * 4 + 2) * (m - 1) / m - matrices * (8 - 2);
  EXPECT_NEAR(separate - fused, 2 * per_layer / hbm, 1e-12);
  // Only Megatron-LM fuses: DeepSpeed and FSDP add separately whatever the key says.
  c.training.gradient_accumulation_fusion = true;
  c.parallelism.framework = Framework::deepspeed;
  EXPECT_NEAR(RooflineComputeModel(Plan::from_config(c)).chunk(1).backward_weight, separate, 1e-12);
}

// apex's FusedLayerNorm (Megatron-LM before November 2021) against the persistent kernel, both
// measured on one A100 at one shape (NVIDIA/apex pull request #1037): with products free, a
// middle stage's two LayerNorms per layer take 0.0751 / 0.0535 of the time forward and
// 0.1762 / 0.0866 backward.
TEST(ComputeModel, ApexLayerNormTakesItsMeasuredShareLonger) {
  ScenarioConfig c = compute_config(Recompute::none);
  c.cluster.peak_tflops = {{DType::bf16, 1e9}};
  c.cluster.hbm_bandwidth_gbps = 1000;
  const double hbm = 1000e9, N = 512, h = 1024, e = 2;
  const RooflineComputeModel fast(Plan::from_config(c));
  c.model.layernorm_kernel = LayerNormKernel::apex;
  const RooflineComputeModel apex(Plan::from_config(c));
  // Per layer: two forwards of 2e bytes per element; two input-gradient passes of 4e and two
  // weight-gradient passes of 2e. Two layers in a middle stage.
  EXPECT_NEAR(apex.chunk(1).forward - fast.chunk(1).forward, 2 * 2 * (2 * e * N * h / hbm) * (0.0751 / 0.0535 - 1),
              1e-12);
  EXPECT_NEAR(apex.chunk(1).backward_input - fast.chunk(1).backward_input,
              2 * 2 * (4 * e * N * h / hbm) * (0.1762 / 0.0866 - 1), 1e-12);
  EXPECT_NEAR(apex.chunk(1).backward_weight - fast.chunk(1).backward_weight,
              2 * 2 * (2 * e * N * h / hbm) * (0.1762 / 0.0866 - 1), 1e-12);
}

// Megatron-LM's own linear layers (model.fused_linear_bias false): with products free and memory
// at 1 TB/s, a middle stage's forward gains the QKV bias added after its product (read and
// write N x 3h) and its input-gradient pass the four bias gradients summed over the tokens (QKV
// 3h, first MLP product f, attention and MLP outputs h each).
TEST(ComputeModel, SeparateBiasKernelsAddTheirBytes) {
  ScenarioConfig c = compute_config(Recompute::none);
  c.cluster.peak_tflops = {{DType::bf16, 1e9}};
  c.cluster.hbm_bandwidth_gbps = 1000;
  const double hbm = 1000e9, N = 512, h = 1024, f = 4096, e = 2;
  const RooflineComputeModel fused(Plan::from_config(c));
  c.model.fused_linear_bias = false;
  const RooflineComputeModel separate(Plan::from_config(c));
  EXPECT_NEAR(separate.chunk(1).forward - fused.chunk(1).forward, 2 * (2 * N * 3 * h * e) / hbm, 1e-12);
  EXPECT_NEAR(separate.chunk(1).backward_input - fused.chunk(1).backward_input,
              2 * (N * (3 * h + f + 2 * h) * e) / hbm, 1e-12);
  // A model without biases has nothing to add.
  c.model.add_bias_linear = false;
  const RooflineComputeModel no_bias(Plan::from_config(c));
  c.model.fused_linear_bias = true;
  EXPECT_NEAR(no_bias.chunk(1).forward, RooflineComputeModel(Plan::from_config(c)).chunk(1).forward, 1e-15);
}

// The unfused attention core (fused, naive) in Megatron's [s, b, np, hn] layout: per layer the
// context is permuted back (read and write N x h/t) in forward, and the q, k, v gradients are
// concatenated into the QKV product's (read and write N x 3h/t) in backward; FlashAttention
// handles the layout in its kernel.
TEST(ComputeModel, UnfusedAttentionPaysItsLayoutCopies) {
  const double N = 512, h = 1024, e = 2;
  const int t = 2;
  auto bytes = [&](AttentionKernel a, const char* kernel, bool backward) {
    ScenarioConfig c = compute_config(Recompute::none, t);
    c.model.attention = a;
    const auto chunks = chunk_kernels(Plan::from_config(c), 2, InventoryTarget::framework);
    double sum = 0;
    for (const KernelWork& w : backward ? chunks[1].backward_input : chunks[1].forward)
      if (w.kernel == kernel) sum += w.count * w.bytes;
    return sum;
  };
  for (AttentionKernel a : {AttentionKernel::fused, AttentionKernel::naive}) {
    EXPECT_DOUBLE_EQ(bytes(a, "attention.transpose", false), 2 * (2 * N * h / t * e));  // two layers
    EXPECT_DOUBLE_EQ(bytes(a, "qkv.concat", true), 2 * (2 * N * 3 * h / t * e));
  }
  EXPECT_EQ(bytes(AttentionKernel::flash, "attention.transpose", false), 0.0);
  EXPECT_EQ(bytes(AttentionKernel::flash, "qkv.concat", true), 0.0);
}

// FP8 (Transformer Engine, torchao's Float8): each layer product's input and weight are cast in
// the forward and its output gradient in the backward, each read in 16 bits and written in FP8
// twice (row- and column-major): 4 bytes an element. A tensor of the stream's width is cast on
// the rank's rows before it is gathered (1/t under sequence parallelism). The output layer stays
// in BF16, at BF16's rate; nothing is cast in 16-bit training.
TEST(ComputeModel, Fp8CastsEachProductsOperandsAndKeepsTheOutputLayerInBf16) {
  const double N = 512, h = 1024, f = 4096, qkv = 3 * h;  // compute_config: GELU, no grouped heads
  for (const auto& [t, sp] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    SCOPED_TRACE(::testing::Message() << "t " << t << " sp " << sp);
    ScenarioConfig c = compute_config(Recompute::none, t);
    c.parallelism.sequence_parallel = sp;
    c.cluster.peak_tflops[DType::fp8] = 624;
    c.precision.compute = DType::fp8;
    const auto chunks = chunk_kernels(Plan::from_config(c), 2, InventoryTarget::framework);
    auto cast_elements = [&](const std::vector<KernelWork>& ws) {
      double sum = 0;
      for (const KernelWork& w : ws)
        if (w.kernel == "fp8.cast") {
          EXPECT_DOUBLE_EQ(w.bytes, 4.0 * w.shape.elements);
          sum += w.count * static_cast<double>(w.shape.elements);
        }
      return sum;
    };
    const double stream = sp ? N / t : N;  // rows of a stream-width tensor a rank casts
    // Per layer, forward: qkv's and fc1's inputs (stream width), proj's and fc2's (split t ways),
    // and the four weights; backward: proj's and fc2's output gradients (stream width), qkv's and
    // fc1's (split).
    const double forward = stream * h * 2 + N * h / t + N * f / t + (qkv * h + h * h + f * h + h * f) / t;
    const double backward = stream * h * 2 + N * qkv / t + N * f / t;
    EXPECT_DOUBLE_EQ(cast_elements(chunks[1].forward), 2 * forward);  // a middle chunk: two layers
    EXPECT_DOUBLE_EQ(cast_elements(chunks[1].backward_input), 2 * backward);
    EXPECT_EQ(cast_elements(chunks[1].backward_weight), 0.0);
    int head_products = 0;
    for (const auto& ws : {chunks.back().forward, chunks.back().backward_input, chunks.back().backward_weight})
      for (const KernelWork& w : ws)
        if (w.kernel.rfind("linear.", 0) == 0 &&
            (w.shape.n == c.model.vocab_size / t || w.shape.m == c.model.vocab_size / t ||
             w.shape.k == c.model.vocab_size / t)) {
          EXPECT_EQ(w.dtype, DType::bf16) << w.kernel;
          ++head_products;
        }
    EXPECT_EQ(head_products, 3);  // logits, their input gradient, the weight gradient
    // Sequence parallelism's collectives: a reduce-scatter sums a product's 16-bit output; an
    // all-gather moves the FP8 copy the next product reads, one byte an element, except the
    // ones that feed the output layer (the last layer's output) and the embedding's gradient
    // (the first layer's input gradient) in 16 bits.
    auto gathered = [&](const std::vector<KernelWork>& ws, const char* kernel, double bytes_per_element) {
      double elements = 0;
      for (const KernelWork& w : ws)
        if (w.kernel == kernel && w.bytes == bytes_per_element * static_cast<double>(w.shape.elements))
          elements += w.count * static_cast<double>(w.shape.elements);
      return elements;
    };
    const double per_layer = sp ? 2 * N * h : 0;  // two of each per layer and pass
    EXPECT_DOUBLE_EQ(gathered(chunks[1].forward, "tp.allgather", 1), 2 * per_layer);
    EXPECT_DOUBLE_EQ(gathered(chunks[1].backward_input, "tp.allgather", 1), 2 * per_layer);
    EXPECT_DOUBLE_EQ(gathered(chunks[1].forward, "tp.reducescatter", 2), 2 * per_layer);
    if (sp) {
      EXPECT_DOUBLE_EQ(gathered(chunks.back().forward, "tp.allgather", 2), N * h);  // into the head
      EXPECT_DOUBLE_EQ(gathered(chunks.front().backward_input, "tp.allgather", 2), N * h);  // to the embedding
    }
  }
  ScenarioConfig c = compute_config(Recompute::none);
  for (const auto& ws : {chunk_kernels(Plan::from_config(c), 2, InventoryTarget::framework)[1].forward})
    for (const KernelWork& w : ws) EXPECT_NE(w.kernel, "fp8.cast");
}

TEST(ComputeModel, PrecisionPicksItsPeakRate) {
  ScenarioConfig c = compute_config(Recompute::none);
  c.precision.compute = DType::fp32;
  const double fp32 = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  c.precision.compute = DType::bf16;
  const double bf16 = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  EXPECT_NEAR(fp32 / bf16, 312.0 / 19.5, 1e-6);  // the (vanishing) memory-bound term differs by element size
}

// `trainsim simulate --kernels` lists what the prediction priced: each virtual stage's kernels,
// summed per pass, are its chunk's forward, input and weight passes, on plans that exercise
// every kind of kernel (tensor and sequence parallelism's collectives, recompute, FP8's casts,
// unfused attention with dropout, an interleaved pipeline's first, middle and last chunks).
TEST(ComputeModel, TheKernelListingSumsToTheChunksPrices) {
  std::vector<ScenarioConfig> configs;
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full, Recompute::selective_op})
    configs.push_back(compute_config(r, 2));
  ScenarioConfig real = compute_config(Recompute::selective, 2);
  apply_gpu_preset(*find_gpu_preset("h100-80gb"), real.cluster);
  real.cluster.num_gpus = 8;
  real.parallelism.sequence_parallel = true;
  real.precision.compute = DType::fp8;
  configs.push_back(real);
  ScenarioConfig unfused = real;
  unfused.parallelism.sequence_parallel = false;
  unfused.precision.compute = DType::fp16;
  unfused.model.attention = AttentionKernel::fused;
  unfused.model.hidden_dropout = unfused.model.attention_dropout = 0.1;
  unfused.parallelism.schedule = ScheduleKind::interleaved_1f1b;
  unfused.parallelism.virtual_pipeline_stages = 2;
  configs.push_back(unfused);
  for (const ScenarioConfig& c : configs) {
    const Plan plan = Plan::from_config(c);
    const RooflineComputeModel cm(plan);
    const std::vector<std::vector<PricedKernel>> priced = kernel_prices(plan);
    for (int vs = 0; vs < plan.num_virtual_stages(); ++vs) {
      SCOPED_TRACE(::testing::Message() << recompute_name(c.training.activation_recompute) << " "
                                      << dtype_name(c.precision.compute) << " chunk " << vs);
      double pass[3] = {0, 0, 0};
      bool collectives = false;
      for (const PricedKernel& k : priced[static_cast<std::size_t>(vs)]) {
        EXPECT_GE(k.seconds, 0) << k.work.kernel;
        pass[static_cast<int>(k.pass)] += k.seconds;
        collectives |= std::string_view(k.bound) == "collective";
      }
      const auto& chunk = cm.chunk(vs);
      EXPECT_NEAR(pass[0], chunk.forward, chunk.forward * 1e-12);
      EXPECT_NEAR(pass[1], chunk.backward_input, chunk.backward_input * 1e-12);
      EXPECT_NEAR(pass[2], chunk.backward_weight, chunk.backward_weight * 1e-12);
      EXPECT_TRUE(collectives);  // tensor parallelism's, named as such
    }
  }
}

}  // namespace
}  // namespace trainsim
