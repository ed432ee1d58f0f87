// Context parallelism against what it must conserve: every token-wise kernel runs 1/c of a
// sequence's rows, attention's causal work splits evenly over the c GPUs, the keys and values
// cross the context-parallel group as NCCL prices a gather of their bytes, the gradients and
// ZeRO's shards span dp x c GPUs, and activations follow the tokens a GPU holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>

#include "core/hardware_profile.h"
#include "core/presets.h"
#include "core/scenario.h"
#include "runtime/runtime_plan.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/memory_model.h"
#include "sim/cost/p2p_model.h"
#include "sim/simulator.h"

namespace trainsim {
namespace {

// Llama 3 8B's layer shape (grouped-query attention) on H100 nodes of 8, BF16, flash attention.
ScenarioConfig llama_config(int dp, int cp, int tp, int seq) {
  ScenarioConfig c;
  c.model = find_model_preset("llama3-8b")->model;
  c.model.num_layers = 4;
  c.model.seq_length = seq;
  c.model.attention = AttentionKernel::flash;
  apply_gpu_preset(*find_gpu_preset("h100-80gb"), c.cluster);
  c.cluster.num_gpus = dp * cp * tp;
  c.parallelism.data_parallel_size = dp;
  c.parallelism.context_parallel_size = cp;
  c.parallelism.tensor_parallel_size = tp;
  c.parallelism.sequence_parallel = tp > 1;
  c.parallelism.context_parallel_comm = ContextParallelComm::all_gather;  // the ring: its own test
  c.training.micro_batch_size = 1;
  c.training.global_batch_size = 2 * dp;
  c.precision.compute = DType::bf16;
  c.precision.loss_scaling.mode = LossScalingMode::none;
  return c;
}

// Seconds and launches of each framework kernel of the first chunk, summed by name.
struct Priced {
  double seconds = 0;
  int count = 0;
  KernelWork last;
};
std::map<std::string, Priced> priced_by_kernel(const Plan& plan) {
  std::map<std::string, Priced> out;
  const std::vector<std::vector<PricedKernel>> chunks = kernel_prices(plan);
  for (const PricedKernel& k : chunks.front()) {
    Priced& p = out[k.work.kernel];
    p.seconds += k.seconds;
    p.count += k.work.count;
    p.last = k.work;
  }
  return out;
}

TEST(ContextParallel, TokenWiseKernelsRunTheGpusShareOfTheRows) {
  const Plan one = Plan::from_config(llama_config(1, 1, 1, 4096));
  const Plan four = Plan::from_config(llama_config(1, 4, 1, 16384));
  EXPECT_EQ(four.local_seq_length(), 4096);
  EXPECT_EQ(four.gpus_per_rank(), 4);
  const auto a = priced_by_kernel(one), b = priced_by_kernel(four);
  // Every product and elementwise kernel has the same rows: 16384 tokens over 4 GPUs is 4096
  // each, as the one GPU's 4096. Only attention (and its gathers) differ.
  for (const auto& [name, p] : a) {
    if (name.find("attention") != std::string::npos) continue;
    ASSERT_TRUE(b.contains(name)) << name;
    EXPECT_DOUBLE_EQ(b.at(name).seconds, p.seconds) << name;
    EXPECT_EQ(b.at(name).count, p.count) << name;
  }
  EXPECT_FALSE(a.contains("cp.allgather"));
  EXPECT_TRUE(b.contains("cp.allgather"));
}

TEST(ContextParallel, CausalAttentionSplitsEvenlyOverTheGroup) {
  // One GPU with the whole 16384-token sequence against four with a quarter of its queries
  // each over all its keys: the four GPUs' attention seconds add up to the one's, tile for tile.
  const Plan one = Plan::from_config(llama_config(1, 1, 1, 16384));
  for (int cp : {2, 4, 8}) {
    const Plan split = Plan::from_config(llama_config(1, cp, 1, 16384));
    const auto a = priced_by_kernel(one), b = priced_by_kernel(split);
    for (const char* k : {"flash_attention.forward", "flash_attention.backward"}) {
      EXPECT_NEAR(cp * b.at(k).seconds, a.at(k).seconds, 1e-12 * a.at(k).seconds) << k << " cp " << cp;
      EXPECT_EQ(b.at(k).last.shape.m, 16384 / cp);
      EXPECT_EQ(b.at(k).last.shape.n, 16384);
    }
  }
}

TEST(ContextParallel, KeysAndValuesCrossTheGroupAsNcclPricesTheirGather) {
  // Tensor 8 fills a node: the context-parallel group of 2 is one GPU on each of two nodes.
  const Plan plan = Plan::from_config(llama_config(1, 2, 8, 16384));
  EXPECT_EQ(plan.cp_members_per_node(), 1);
  const auto k = priced_by_kernel(plan);
  const ModelShape m = plan.shape();
  // The gathered buffer: every token's keys and values of this shard's one KV head, in BF16.
  const double bytes = 1.0 * 16384 * (2.0 * m.h / m.a * m.kv_heads) / 8 * 2;
  const GroupShape across{2, 2, 1};
  const double gather = nccl_collective(OpKind::AllGather, across, bytes, plan.config.cluster).seconds;
  const double reduce = nccl_collective(OpKind::ReduceScatter, across, bytes, plan.config.cluster).seconds;
  const int layers = plan.config.model.num_layers;
  // A gather before each layer's attention forward and again before its backward; the keys' and
  // values' gradients reduce-scattered after it.
  EXPECT_EQ(k.at("cp.allgather").count, 2 * layers);
  EXPECT_EQ(k.at("cp.reducescatter").count, layers);
  EXPECT_DOUBLE_EQ(k.at("cp.allgather").last.bytes, bytes);
  EXPECT_NEAR(k.at("cp.allgather").seconds, 2 * layers * gather, 1e-12);
  EXPECT_NEAR(k.at("cp.reducescatter").seconds, layers * reduce, 1e-12);
  // On one node (tensor 1) the same group rides NVLink, far faster than the two NICs.
  const Plan inside = Plan::from_config(llama_config(1, 2, 1, 16384));
  EXPECT_EQ(inside.cp_members_per_node(), 2);
  EXPECT_LT(priced_by_kernel(inside).at("cp.allgather").seconds / 8, k.at("cp.allgather").seconds);
}

TEST(ContextParallel, TheRingHidesItsSendsBehindEachStepsAttention) {
  // Transformer Engine's ring (p2p): no gathers; after each attention kernel what its c - 1 sends
  // add beyond the attention of the chunk in hand, and in the backward the last gradients' hop.
  auto ring = [](int tp, int cp, int seq) {
    ScenarioConfig c = llama_config(1, cp, tp, seq);
    c.parallelism.context_parallel_comm = ContextParallelComm::p2p;
    return Plan::from_config(c);
  };
  // Megatron-Core's default: the framework megatron resolves auto to the ring, FSDP to the gather.
  ScenarioConfig m = llama_config(1, 2, 1, 16384);
  m.parallelism.context_parallel_comm = ContextParallelComm::auto_select;
  m.parallelism.framework = Framework::megatron;
  EXPECT_EQ(Plan::from_config(m).cp_comm, ContextParallelComm::p2p);
  m.parallelism.framework = Framework::fsdp;
  EXPECT_EQ(Plan::from_config(m).cp_comm, ContextParallelComm::all_gather);

  // Long sequences inside a node: each step's attention covers its send; only the backward's
  // last hop is left, one send of this GPU's keys' and values' gradients.
  const Plan inside = ring(1, 4, 65536);
  const auto k = priced_by_kernel(inside);
  EXPECT_FALSE(k.contains("cp.allgather"));
  EXPECT_DOUBLE_EQ(k.at("cp.ring.forward").seconds, 0.0);
  const ModelShape shape = inside.shape();
  const double local_kv = 1.0 * (65536 / 4) * (2.0 * shape.h / shape.a * shape.kv_heads) * 2;  // BF16 K and V
  const ClusterConfig& cl = inside.config.cluster;
  const double hop = us_to_seconds(cl.intra_node.latency_us) +
                     local_kv / nccl_p2p_bytes_per_second(local_kv, true, nccl_p2p_channel_range(4, false, cl), false, cl);
  const int layers = inside.config.model.num_layers;
  EXPECT_NEAR(k.at("cp.ring.backward").seconds, layers * hop, 1e-12);
  // Against the gather on the same plan: the ring is never dearer here.
  ScenarioConfig g = inside.config;
  g.parallelism.context_parallel_comm = ContextParallelComm::all_gather;
  const auto gathered = priced_by_kernel(Plan::from_config(g));
  EXPECT_LT(k.at("cp.ring.backward").seconds,
            gathered.at("cp.allgather").seconds + gathered.at("cp.reducescatter").seconds);

  // Short sequences across nodes (tensor 8 fills each): the sends outlast the steps' attention and
  // the forward pays (c - 1) x (send - step).
  const Plan across = ring(8, 4, 4096);
  const auto a = priced_by_kernel(across);
  const double attention = a.at("flash_attention.forward").seconds / layers;
  const double bytes = 1.0 * (4096 / 4) * (2.0 * shape.h / shape.a * shape.kv_heads) / 8 * 2;
  const ClusterConfig& ca = across.config.cluster;
  const double send = us_to_seconds(ca.inter_node.latency_us) +
                      bytes / nccl_p2p_bytes_per_second(bytes, false, nccl_p2p_channel_range(4, true, ca), true, ca);
  ASSERT_GT(send, attention / 4);
  EXPECT_NEAR(a.at("cp.ring.forward").seconds, layers * 3 * (send - attention / 4), 1e-12);
}

TEST(ContextParallel, GradientsAndShardsSpanTheContextParallelGpus) {
  // ZeRO-3 over one replica of 8 context-parallel GPUs shards as over 8 replicas, and its
  // gradients are reduce-scattered over those 8 GPUs though the schedule has one rank per stage.
  ScenarioConfig c = llama_config(1, 8, 1, 8 * 4096);
  c.parallelism.zero_stage = 3;
  c.parallelism.framework = Framework::fsdp;
  const Plan split = Plan::from_config(c);
  ScenarioConfig d = llama_config(8, 1, 1, 4096);
  d.parallelism.zero_stage = 3;
  d.parallelism.framework = Framework::fsdp;
  const Plan replicas = Plan::from_config(d);
  EXPECT_EQ(split.data_shards(), 8);
  EXPECT_EQ(split.zero(), 3);
  const double params = split.shard_stage_params(0);
  const ModelStateBytes a = model_state_bytes(split, params), b = model_state_bytes(replicas, params);
  EXPECT_DOUBLE_EQ(a.weights, b.weights);
  EXPECT_DOUBLE_EQ(a.gradients, b.gradients);
  EXPECT_DOUBLE_EQ(a.optimizer, b.optimizer);

  const Prediction p = predict(split), q = predict(replicas);
  ASSERT_EQ(p.result.ranks.size(), 1u);
  EXPECT_GT(p.result.allreduce_time_s, 0);
  // The same bytes over the same 8 GPUs of one node: the same time in collectives a step.
  EXPECT_NEAR(p.result.allreduce_time_s, q.result.allreduce_time_s, 1e-9);
  // Model states are the same; activations are the same tokens a GPU, with the gathered keys and
  // values (and their gradients) during a layer's attention backward on top.
  EXPECT_DOUBLE_EQ(p.result.ranks[0].memory.weights, q.result.ranks[0].memory.weights);
  EXPECT_DOUBLE_EQ(p.result.ranks[0].memory.optimizer, q.result.ranks[0].memory.optimizer);
  const ModelShape m = split.shape();
  const double kv = 2.0 * 2 * (8.0 * 4096) * (m.h / m.a * m.kv_heads);  // BF16 K and V of every token
  EXPECT_NEAR(p.result.ranks[0].memory.activations - q.result.ranks[0].memory.activations, 2 * kv, 1.0);
}

TEST(ContextParallel, TheLayoutIsCheckedAndExplained) {
  ScenarioConfig c = llama_config(2, 4, 1, 8192);
  c.cluster.num_gpus = 4;
  try {
    Plan::from_config(c);
    FAIL() << "8 GPUs' layout on 4";
  } catch (const ScenarioError& e) {
    EXPECT_NE(std::string(e.what()).find("context_parallel_size(4) = 8 != num_gpus(4)"), std::string::npos) << e.what();
  }
  c = llama_config(1, 3, 1, 8192);  // 6 chunks do not divide 8192
  EXPECT_THROW(Plan::from_config(c), ScenarioError);
  // The ring runs attention a chunk of keys at a time: an unfused core cannot be its step.
  c = llama_config(1, 2, 1, 8192);
  c.model.attention = AttentionKernel::fused;
  c.parallelism.context_parallel_comm = ContextParallelComm::p2p;
  try {
    Plan::from_config(c);
    FAIL() << "an unfused attention core as the ring's step";
  } catch (const ScenarioError& e) {
    EXPECT_NE(std::string(e.what()).find("flash or cudnn"), std::string::npos) << e.what();
  }
  // Left unwritten, data_parallel_size is what the other sizes leave of the GPUs.
  const Scenario sc = load_scenario_text(
      "model: {preset: llama3-8b, seq_length: 16384}\ncluster: {gpu: h100-80gb, num_gpus: 32}\n"
      "parallelism: {tensor_parallel_size: 2, context_parallel_size: 4}\n",
      "cp.yaml");
  EXPECT_EQ(sc.config.parallelism.data_parallel_size, 4);
  // The runtime executes it as it runs it (tests/runtime/test_executor.cpp): gathered keys and
  // values around its unfused core, whatever the scenario's framework would pick.
  const runtime::RuntimePlan rp = runtime::make_runtime_plan(sc);
  EXPECT_EQ(rp.plan.cp, 4);
  EXPECT_EQ(rp.plan.cp_comm, ContextParallelComm::all_gather);
  EXPECT_EQ(rp.plan.config.cluster.num_gpus, 32);
}

// An unfused core with gathered keys (the runtime's decoder: it writes its probabilities) holds each
// GPU's s/c queries' scores over all s keys: a layer keeps what a model of s/c tokens keeps, plus
// the scores of the s - s/c keys the others hold.
TEST(ContextParallel, AnUnfusedCoreKeepsItsQueriesScoresOverEveryKey) {
  for (const AttentionKernel core : {AttentionKernel::naive, AttentionKernel::fused}) {
    ScenarioConfig c = llama_config(1, 4, 1, 8192);
    c.model.attention = core;
    const Plan split = Plan::from_config(c);
    ScenarioConfig local = llama_config(1, 1, 1, 2048);
    local.model.attention = core;
    const ModelShape whole_keys = split.token_shape(), own_keys = Plan::from_config(local).shape();
    EXPECT_EQ(whole_keys.s, 2048);
    EXPECT_EQ(whole_keys.keys, 8192);
    const double e = 2, b = 1, a = whole_keys.a;
    const double extra = e * a * b * 2048.0 * (8192 - 2048);
    EXPECT_DOUBLE_EQ(whole_keys.layer_stored_activation_bytes(1, 2, 1, false, Recompute::none),
                     own_keys.layer_stored_activation_bytes(1, 2, 1, false, Recompute::none) + extra);
    // Its products run the s/c queries against every key; the keys and values are gathered first.
    auto priced = priced_by_kernel(split);
    EXPECT_EQ(priced["cp.allgather"].count, 2 * 4) << "before each layer's forward and backward core";
    EXPECT_EQ(priced["cp.reducescatter"].count, 4);
    EXPECT_EQ(priced["attention.scores"].last.shape.m, 2048);
    EXPECT_EQ(priced["attention.scores"].last.shape.n, 8192);
  }
}

}  // namespace
}  // namespace trainsim
