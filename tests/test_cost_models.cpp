// Cost models against their closed forms, computed here independently of the models.
#include <gtest/gtest.h>

#include <cmath>

#include "core/model_shape.h"
#include "core/presets.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/p2p_model.h"
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
  c.cluster.intra_node = {300, 3};
  c.cluster.inter_node = {25, 6};
  c.communication.allreduce_algorithm = algo;
  return Plan::from_config(c);
}

std::vector<int> all_ranks(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

TEST(Collectives, HierarchicalReducesToRingInsideOneNode) {
  const Plan ring = cluster_plan(8, 8, AllReduceAlgorithm::ring);
  const Plan hier = cluster_plan(8, 8, AllReduceAlgorithm::hierarchical);
  const double S = 100e6;
  const double expected = ring_allreduce_seconds(8, S, 3e-6, 300e9);
  EXPECT_NEAR(NetworkCollectiveModel(ring).seconds(OpKind::AllReduce, all_ranks(8), S), expected, 1e-15);
  EXPECT_NEAR(NetworkCollectiveModel(hier).seconds(OpKind::AllReduce, all_ranks(8), S), expected, 1e-15);
  // The closed form itself: one node of g ranks is reduce-scatter + all-gather = ring.
  EXPECT_NEAR(hierarchical_allreduce_seconds(1, 8, S, {300, 3}, {25, 6}), expected, 1e-15);
}

TEST(Collectives, AcrossNodesRingUsesTheSlowLinkHierarchicalSplitsTheWork) {
  const Plan ring = cluster_plan(16, 8, AllReduceAlgorithm::ring);
  const Plan hier = cluster_plan(16, 8, AllReduceAlgorithm::hierarchical);
  const double S = 1e9;
  const double ring_expected = 2.0 * 15 * 6e-6 + 2.0 * 15 / 16 * S / 25e9;
  EXPECT_NEAR(NetworkCollectiveModel(ring).seconds(OpKind::AllReduce, all_ranks(16), S), ring_expected, 1e-12);
  // Reduce-scatter in each node of 8, all-reduce of S/8 between the 2 nodes, all-gather in each node.
  const double intra = 7 * 3e-6 + 7.0 / 8 * S / 300e9;
  const double inter = 2.0 * 1 * 6e-6 + 2.0 * 1 / 2 * (S / 8) / 25e9;
  const double hier_expected = intra + inter + intra;
  EXPECT_NEAR(NetworkCollectiveModel(hier).seconds(OpKind::AllReduce, all_ranks(16), S), hier_expected, 1e-12);
  EXPECT_LT(hier_expected, ring_expected);
}

TEST(PointToPoint, LatencyPlusBytesOverTheJoiningLink) {
  // 16 ranks, 8 per node: 7 -> 8 crosses nodes, 0 -> 1 does not.
  const Plan plan = cluster_plan(16, 8, AllReduceAlgorithm::ring);
  const LinkP2PModel p2p(plan);
  const Bytes S = 32 << 20;
  EXPECT_EQ(p2p.duration(0, 1, S), seconds_to_ticks(3e-6 + S / 300e9));
  EXPECT_EQ(p2p.duration(7, 8, S), seconds_to_ticks(6e-6 + S / 25e9));
}

// ---- model shape and compute ----------------------------------------------------------

TEST(ModelShape, ParameterCountsOfPublishedModels) {
  // Llama 2 7B has exactly 6,738,415,616 parameters (the released checkpoint).
  EXPECT_EQ(ModelShape(find_model_preset("llama2-7b")->model).total_params(), 6738415616.0);
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

ScenarioConfig compute_config(Recompute r, int t = 1) {
  ScenarioConfig c = testing::small_config(4, 8, ScheduleKind::one_f_one_b);
  c.model.hidden_size = 1024;
  c.model.num_attention_heads = 16;
  c.model.seq_length = 512;
  c.model.num_layers = 8;
  c.cluster.num_gpus = 4 * t;
  c.parallelism.tensor_parallel_size = t;
  c.cluster.hbm_bandwidth_gbps = 1e12;  // memory-bound work vanishes: only matrix products remain
  c.cluster.intra_node.latency_us = 0;
  c.cluster.intra_node.bandwidth_gbps = 1e12;
  c.training.activation_recompute = r;
  c.precision.compute = DType::bf16;
  return c;
}

TEST(ComputeModel, ForwardIsFlopsOverRateBackwardTwiceRecomputeAddsForward) {
  const double rate = 312e12 * 0.6;  // the default cluster's bf16 peak and efficiency
  const ModelShape m(compute_config(Recompute::none).model);
  const double layer = (24.0 * 512 * 1024 * 1024 + 4.0 * 512 * 512 * 1024) / rate;  // b = 1
  const double core = 4.0 * 512 * 512 * 1024 / rate;
  {
    const RooflineComputeModel cm(Plan::from_config(compute_config(Recompute::none)));
    const auto& mid = cm.chunk(1);  // a middle stage: 2 layers, no embedding or head
    EXPECT_NEAR(mid.forward, 2 * layer, 1e-12);
    EXPECT_NEAR(mid.backward(), 2 * 2 * layer, 1e-12);
    // The weight gradient repeats the weight products only; attention's core is all input gradient.
    EXPECT_NEAR(mid.backward_weight, 2 * (layer - core), 1e-12);
    // The first and last stages are heavier with the same layer count.
    EXPECT_GT(cm.chunk(0).forward, mid.forward);
    EXPECT_NEAR(cm.chunk(3).forward - mid.forward, m.lm_head_forward_flops(1) / rate, 1e-9);
  }
  {
    const RooflineComputeModel cm(Plan::from_config(compute_config(Recompute::full)));
    EXPECT_NEAR(cm.chunk(1).backward(), 3 * 2 * layer, 1e-12);
  }
  {
    const RooflineComputeModel cm(Plan::from_config(compute_config(Recompute::selective)));
    EXPECT_NEAR(cm.chunk(1).backward(), 2 * 2 * layer + 2 * core, 1e-12);
  }
}

TEST(ComputeModel, TensorParallelSplitsFlopsAndAddsFourAllReducesPerLayer) {
  ScenarioConfig c = compute_config(Recompute::none, 2);
  c.cluster.intra_node = {100, 2};  // a link slow enough to see
  const Plan plan = Plan::from_config(c);
  const RooflineComputeModel cm(plan);
  const double rate = 312e12 * 0.6;
  const double layer_flops = (24.0 * 512 * 1024 * 1024 + 4.0 * 512 * 512 * 1024) / 2;
  const double act_bytes = 512.0 * 1024 * 2;  // b s h in bf16
  const double ar = ring_allreduce_seconds(2, act_bytes, 2e-6, 100e9);
  EXPECT_NEAR(cm.chunk(1).forward, 2 * (layer_flops / rate + 2 * ar), 1e-12);
  EXPECT_NEAR(cm.chunk(1).backward(), 2 * (2 * layer_flops / rate + 2 * ar), 1e-12);
}

TEST(ComputeModel, PrecisionPicksItsPeakRate) {
  ScenarioConfig c = compute_config(Recompute::none);
  c.precision.compute = DType::fp32;
  const double fp32 = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  c.precision.compute = DType::bf16;
  const double bf16 = RooflineComputeModel(Plan::from_config(c)).chunk(1).forward;
  EXPECT_NEAR(fp32 / bf16, 312.0 / 19.5, 1e-7);  // the (vanishing) memory-bound term differs by element size
}

}  // namespace
}  // namespace trainsim
