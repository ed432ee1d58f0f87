// Tensor-parallel communication overlap (communication.tp_comm_overlap: Transformer Engine's
// userbuffers) against its closed forms: each of a layer's sequence-parallel collectives becomes
// one entry beside the product it overlaps, priced as what the pair takes beyond that product,
// from the products' own prices and the NVLink link; the products themselves do not move; the
// buffers TE registers are counted; the layouts it cannot run are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

#include "core/presets.h"
#include "core/report/report.h"
#include "core/scenario.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "sim/cost/gemm_model.h"
#include "sim/simulator.h"

namespace trainsim {
namespace {

// Llama 3 70B's layer on one node of H100s: tensor 4 with sequence parallelism, pipeline 2 so that
// the middle chunk of an interleaved schedule has neither embedding nor output layer.
// `backward`: how the layers' backward runs its collectives without userbuffers (exposed unless
// a test says otherwise: the userbuffers tests hold their pairs against every collective exposed).
ScenarioConfig llama_config(DType compute, bool overlap, TpBackwardComm backward = TpBackwardComm::exposed) {
  ScenarioConfig c;
  c.model = find_model_preset("llama3-70b")->model;
  c.model.num_layers = 6;
  c.model.seq_length = 8192;
  c.model.attention = AttentionKernel::cudnn;
  apply_gpu_preset(*find_gpu_preset("h100-80gb"), c.cluster);
  c.cluster.num_gpus = 8;
  c.parallelism.tensor_parallel_size = 4;
  c.parallelism.pipeline_parallel_size = 2;
  c.parallelism.virtual_pipeline_stages = 3;
  c.parallelism.schedule = ScheduleKind::interleaved_1f1b;
  c.parallelism.sequence_parallel = true;
  c.parallelism.framework = Framework::megatron;
  c.training.micro_batch_size = 1;
  c.training.global_batch_size = 8;
  c.precision.compute = compute;
  c.precision.loss_scaling.mode = LossScalingMode::none;
  c.communication.tp_comm_overlap = overlap;
  c.communication.tp_backward_comm = backward;
  return c;
}

struct Priced {
  double seconds = 0;
  int count = 0;
  KernelWork last;
};
// Seconds and launches of each kernel of virtual stage `vs`, by name and pass.
std::map<std::string, Priced> priced(const Plan& plan, int vs) {
  std::map<std::string, Priced> out;
  const std::vector<std::vector<PricedKernel>> all = kernel_prices(plan);
  for (const PricedKernel& k : all[static_cast<std::size_t>(vs)]) {
    const char* pass = k.pass == PricedKernel::Pass::forward ? "F " : k.pass == PricedKernel::Pass::backward_input ? "B " : "W ";
    for (const std::string& key : {std::string(pass) + k.work.kernel, k.work.kernel}) {
      Priced& p = out[key];
      p.seconds += k.seconds;
      p.count += k.work.count;
      p.last = k.work;
    }
  }
  return out;
}

// The product's seconds on `sms` of the GPU's SMs, its peak scaled with them, as an independent
// reference through gemm_model.h's public price.
double product(const Plan& plan, KernelShape s, double elem, int sms, double c_bytes = -1) {
  ClusterConfig cl = plan.config.cluster;
  const double share = static_cast<double>(sms) / cl.sm_count;
  cl.sm_count = sms;
  const double peak = plan.peak_flops(plan.config.precision.compute) * cl.sustained_clock_fraction * share;
  return gemm_seconds(s, elem, peak, cl, c_bytes);
}

KernelShape rows_of(KernelShape s, int parts) {
  s.m = (s.m + parts - 1) / parts;
  return s;
}

TEST(TpCommOverlap, EachCollectiveOfALayerRunsBesideItsProduct) {
  for (DType compute : {DType::bf16, DType::fp8}) {
    const Plan exposed = Plan::from_config(llama_config(compute, false));
    const Plan overlapped = Plan::from_config(llama_config(compute, true));
    const auto a = priced(exposed, 1), b = priced(overlapped, 1);  // a middle chunk: one layer
    const int layers = exposed.layers_per_virtual_stage[1];
    // Exposed: per layer a reduce-scatter after each row-parallel product and an all-gather before
    // each column-parallel one, forward and backward.
    EXPECT_EQ(a.at("tp.reducescatter").count, 4 * layers);
    EXPECT_EQ(a.at("tp.allgather").count, 4 * layers);
    // Overlapped: none left exposed; forward two pipelined reduce-scatters and two ring-exchanged
    // all-gathers, backward two ring-exchanged all-gathers and two bulk reduce-scatters.
    EXPECT_FALSE(b.contains("tp.reducescatter"));
    EXPECT_FALSE(b.contains("tp.allgather"));
    EXPECT_EQ(b.at("F tp.overlap.pipeline_reducescatter").count, 2 * layers);
    EXPECT_EQ(b.at("F tp.overlap.ring_allgather").count, 2 * layers);
    EXPECT_EQ(b.at("B tp.overlap.ring_allgather").count, 2 * layers);
    EXPECT_EQ(b.at("B tp.overlap.bulk_reducescatter").count, 2 * layers);
    // The products and every other kernel are priced as before.
    for (const auto& [name, p] : a) {
      if (name.find("tp.") != std::string::npos) continue;
      ASSERT_TRUE(b.contains(name)) << name;
      EXPECT_DOUBLE_EQ(b.at(name).seconds, p.seconds) << name;
    }
    // The overlapped chunk is faster than the exposed one, and never faster than its kernels
    // with the collectives free.
    double with = 0, without = 0, free = 0;
    const auto exposed_prices = kernel_prices(exposed), overlapped_prices = kernel_prices(overlapped);
    for (const PricedKernel& k : exposed_prices[1]) {
      without += k.seconds;
      if (k.work.kernel.rfind("tp.", 0) != 0) free += k.seconds;
    }
    for (const PricedKernel& k : overlapped_prices[1]) with += k.seconds;
    EXPECT_LT(with, without) << dtype_name(compute);
    EXPECT_GE(with, free) << dtype_name(compute);
  }
}

TEST(TpCommOverlap, PairsArePricedByTheirClosedForms) {
  const Plan plan = Plan::from_config(llama_config(DType::bf16, true));
  const ClusterConfig& cl = plan.config.cluster;
  const int t = plan.tp;
  const double e = 2, b_nvl = cl.intra_node.bandwidth_gbps * 1e9 * cl.intra_node.efficiency;
  const double hop = cl.intra_node.latency_us * 1e-6;
  // A ring exchange runs t steps of N/t rows each, passing N/t rows of the gathered input on.
  const std::vector<std::vector<PricedKernel>> prices = kernel_prices(plan);
  const std::vector<PricedKernel>& kernels = prices[1];
  double ring_total = 0, ring_expected = 0, pipeline_total = 0, pipeline_expected = 0, bulk_total = 0,
         bulk_expected = 0;
  for (const PricedKernel& k : kernels) {
    const KernelShape& s = k.work.shape;
    const double alone = product(plan, s, e, cl.sm_count);
    if (k.work.kernel == "tp.overlap.ring_allgather") {
      const double g = product(plan, rows_of(s, t), e, cl.sm_count), send = hop + k.work.bytes / t / b_nvl;
      ring_total += k.seconds;
      ring_expected += k.work.count * std::max(0.0, g + (t - 1) * std::max(g, send) - alone);
    } else if (k.work.kernel == "tp.overlap.pipeline_reducescatter") {
      // Four chunks on the 116 SMs the collective's 16 leave; each chunk's reduce-scatter, one hop
      // and (t-1)/t of its quarter of the bytes, runs beside the next chunk's product.
      const double g = product(plan, rows_of(s, 4), e, cl.sm_count - 16);
      const double c = hop + (t - 1.0) / t * k.work.bytes / 4 / b_nvl;
      pipeline_total += k.seconds;
      pipeline_expected += k.work.count * std::max(0.0, g + 3 * std::max(g, c) + c - alone);
    } else if (k.work.kernel == "tp.overlap.bulk_reducescatter") {
      // Beside the weight-gradient product, which accumulates into FP32 main_grad (Megatron-LM).
      const double w = product(plan, s, e, cl.sm_count, 8.0), w16 = product(plan, s, e, cl.sm_count - 16, 8.0);
      const double c = hop + (t - 1.0) / t * k.work.bytes / b_nvl;
      bulk_total += k.seconds;
      bulk_expected += k.work.count * std::max(0.0, std::max(w16, c) - w);
    }
  }
  EXPECT_NEAR(ring_total, ring_expected, 1e-12);
  EXPECT_NEAR(pipeline_total, pipeline_expected, 1e-12);
  EXPECT_NEAR(bulk_total, bulk_expected, 1e-12);
  EXPECT_GT(ring_expected, 0);
  EXPECT_GT(pipeline_expected, 0);
  EXPECT_GT(bulk_expected, 0);

  // The reduce-scatter by ring exchange (Megatron-Bridge's FP8 recipes) is the all-gather's form
  // beside the row-parallel product, its partial sums passed on.
  ScenarioConfig r = llama_config(DType::bf16, true);
  r.communication.tp_comm_overlap_reduce_scatter = TpOverlapReduceScatter::ring_exchange;
  const Plan ringed = Plan::from_config(r);
  double rs_total = 0, rs_expected = 0;
  const auto ringed_prices = kernel_prices(ringed);
  for (const PricedKernel& k : ringed_prices[1]) {
    EXPECT_NE(k.work.kernel, "tp.overlap.pipeline_reducescatter");
    if (k.work.kernel != "tp.overlap.ring_reducescatter") continue;
    const KernelShape& s = k.work.shape;
    const double g = product(ringed, rows_of(s, t), e, cl.sm_count), send = hop + k.work.bytes / t / b_nvl;
    rs_total += k.seconds;
    rs_expected += k.work.count * std::max(0.0, g + (t - 1) * std::max(g, send) - product(ringed, s, e, cl.sm_count));
  }
  EXPECT_GT(rs_expected, 0);
  EXPECT_NEAR(rs_total, rs_expected, 1e-12);
}

TEST(TpCommOverlap, TheEmbeddingsAndOutputLayersCollectivesStayExposed) {
  // Megatron-LM's embedding and output layer are not Transformer Engine layers: the first chunk
  // reduce-scatters the embedding's output and the last gathers the output layer's input exposed.
  const Plan plan = Plan::from_config(llama_config(DType::bf16, true));
  const auto first = priced(plan, 0), last = priced(plan, plan.num_virtual_stages() - 1);
  EXPECT_EQ(first.at("F tp.reducescatter").count, 1);
  EXPECT_FALSE(first.contains("F tp.allgather"));  // the first layer's gather runs beside its qkv product
  EXPECT_EQ(last.at("F tp.allgather").count, 1);
  EXPECT_EQ(last.at("B tp.reducescatter").count, 1);
  // Under ZB-H1 the weight-gradient products run later: the bulk reduce-scatters stay exposed.
  ScenarioConfig z = llama_config(DType::bf16, true);
  z.parallelism.virtual_pipeline_stages = 1;
  z.parallelism.schedule = ScheduleKind::zb_h1;
  const auto zb = priced(Plan::from_config(z), 0);
  EXPECT_FALSE(zb.contains("tp.overlap.bulk_reducescatter"));
  EXPECT_TRUE(zb.contains("B tp.reducescatter"));
  EXPECT_TRUE(zb.contains("B tp.overlap.ring_allgather"));
}

TEST(TpCommOverlap, RegisteredBuffersAreCounted) {
  // Twelve buffers of a micro-batch's gathered rows x hidden: the eight all-gathering ones in FP8
  // under FP8, the four reduce-scattering ones in BF16.
  for (DType compute : {DType::bf16, DType::fp8}) {
    const Prediction a = predict(Plan::from_config(llama_config(compute, false)));
    const Prediction b = predict(Plan::from_config(llama_config(compute, true)));
    const double elements = 8192.0 * 8192, gathered = compute == DType::fp8 ? 1 : 2;
    EXPECT_DOUBLE_EQ(b.result.ranks[0].memory.buffers - a.result.ranks[0].memory.buffers,
                     elements * (8 * gathered + 4 * 2))
        << dtype_name(compute);
    EXPECT_LT(b.result.step_time_s, a.result.step_time_s) << dtype_name(compute);
    // The summary says so, and how.
    const std::string on = format_summary(Plan::from_config(llama_config(compute, true)), b.result);
    const std::string off = format_summary(Plan::from_config(llama_config(compute, false)), a.result);
    EXPECT_NE(on.find("overlapped with their products"), std::string::npos) << on;
    EXPECT_NE(on.find("pipelined in 4 chunks"), std::string::npos) << on;
    EXPECT_EQ(off.find("overlapped with their products"), std::string::npos) << off;
  }
}

TEST(TpCommOverlap, TheLayoutsItCannotRunAreRefused) {
  ScenarioConfig c = llama_config(DType::bf16, true);
  c.parallelism.sequence_parallel = false;
  try {
    Plan::from_config(c);
    FAIL() << "overlap without sequence parallelism";
  } catch (const ScenarioError& e) {
    EXPECT_NE(std::string(e.what()).find("set parallelism.sequence_parallel"), std::string::npos) << e.what();
  }
  c = llama_config(DType::bf16, true);
  c.cluster.gpus_per_node = 2;
  try {
    Plan::from_config(c);
    FAIL() << "a tensor-parallel group over two nodes";
  } catch (const ScenarioError& e) {
    EXPECT_NE(std::string(e.what()).find("inside one node"), std::string::npos) << e.what();
  }
  // Off, or with one tensor-parallel GPU, nothing changes.
  ScenarioConfig one = llama_config(DType::bf16, true);
  one.parallelism.tensor_parallel_size = 1;
  one.parallelism.sequence_parallel = false;
  one.cluster.num_gpus = 2;
  ScenarioConfig off = one;
  off.communication.tp_comm_overlap = false;
  EXPECT_DOUBLE_EQ(predict(Plan::from_config(one)).result.step_time_s,
                   predict(Plan::from_config(off)).result.step_time_s);
}

// Megatron-LM's column-parallel backward without userbuffers (communication.tp_backward_comm,
// LinearWithGradAccumulationAndAsyncCommunication): the input gradient's collective runs on NCCL's
// stream beside the weight-gradient product, and under sequence parallelism the layer's input is
// re-gathered beside the input-gradient product. `auto` does so under framework megatron only;
// ZB-H1's weight products run later, so its collectives stay exposed.
TEST(TpBackwardComm, TheColumnParallelBackwardRunsItsCollectivesBesideItsProducts) {
  for (const bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "all-reduces");
    ScenarioConfig c = llama_config(DType::bf16, false, TpBackwardComm::auto_select);
    c.parallelism.sequence_parallel = sp;
    const Plan megatron = Plan::from_config(c);
    ScenarioConfig e = c;
    e.communication.tp_backward_comm = TpBackwardComm::exposed;
    const Plan exposed = Plan::from_config(e);
    ScenarioConfig f = c;
    f.parallelism.framework = Framework::fsdp;
    EXPECT_TRUE(megatron.tp_backward_overlapped);
    EXPECT_FALSE(exposed.tp_backward_overlapped);
    EXPECT_FALSE(Plan::from_config(f).tp_backward_overlapped);
    const auto a = priced(exposed, 1), b = priced(megatron, 1);
    const int layers = megatron.layers_per_virtual_stage[1];
    if (sp) {
      // Backward: the two row-parallel products' gradients still gathered before them; the two
      // column-parallel ones' reduce-scatters beside the weight products, their inputs re-gathered.
      EXPECT_EQ(a.at("B tp.reducescatter").count, 2 * layers);
      EXPECT_FALSE(b.contains("B tp.reducescatter"));
      EXPECT_EQ(b.at("B tp.allgather").count, 2 * layers);
      EXPECT_EQ(b.at("B tp.overlap.async_reducescatter").count, 2 * layers);
      EXPECT_EQ(b.at("B tp.overlap.async_allgather").count, 2 * layers);
    } else {
      EXPECT_EQ(a.at("B tp.allreduce").count, 2 * layers);
      EXPECT_FALSE(b.contains("B tp.allreduce"));
      EXPECT_EQ(b.at("B tp.overlap.async_allreduce").count, 2 * layers);
    }
    // The forward and every product are priced as before.
    for (const auto& [name, p] : a) {
      if (name.find("tp.") != std::string::npos) continue;
      ASSERT_TRUE(b.contains(name)) << name;
      EXPECT_DOUBLE_EQ(b.at(name).seconds, p.seconds) << name;
    }
    for (const char* fwd : {"F tp.allreduce", "F tp.reducescatter", "F tp.allgather"}) {
      if (a.contains(fwd)) {
        EXPECT_DOUBLE_EQ(b.at(fwd).seconds, a.at(fwd).seconds) << fwd;
      }
    }
    // Each pair costs what NCCL's collective takes beyond the product beside it (no SMs held by
    // default: cluster.collective_sms 0), an independent reference through the public prices.
    const ClusterConfig& cl = megatron.config.cluster;
    const GroupShape group{megatron.tp, 1, megatron.tp};
    for (const PricedKernel& k : kernel_prices(megatron)[1]) {
      if (k.work.kernel.rfind("tp.overlap.async_", 0) != 0) continue;
      const OpKind kind = k.work.kernel == "tp.overlap.async_allreduce"       ? OpKind::AllReduce
                          : k.work.kernel == "tp.overlap.async_reducescatter" ? OpKind::ReduceScatter
                                                                              : OpKind::AllGather;
      const bool accumulates = kind != OpKind::AllGather && megatron.config.training.gradient_accumulation_fusion;
      const double g = product(megatron, k.work.shape, 2, cl.sm_count, accumulates ? 8.0 : -1);
      const double comm = nccl_collective(kind, group, k.work.bytes, cl).seconds;
      EXPECT_NEAR(k.seconds, k.work.count * std::max(0.0, comm - g), 1e-12) << k.work.kernel;
    }
    // The step is faster than with the collectives exposed, never faster than with them free.
    double with = 0, without = 0, free = 0;
    for (const PricedKernel& k : kernel_prices(exposed)[1]) {
      without += k.seconds;
      if (k.work.kernel.rfind("tp.", 0) != 0) free += k.seconds;
    }
    for (const PricedKernel& k : kernel_prices(megatron)[1]) with += k.seconds;
    EXPECT_LT(with, without);
    EXPECT_GE(with, free);
    // ZB-H1 runs the weight products later: nothing beside them.
    ScenarioConfig z = c;
    z.parallelism.schedule = ScheduleKind::zb_h1;
    z.parallelism.virtual_pipeline_stages = 1;
    const auto zb = priced(Plan::from_config(z), 0);
    for (const auto& [name, p] : zb) EXPECT_EQ(name.find("async"), std::string::npos) << name;
    // The summary says which.
    const std::string said = format_summary(megatron, predict(megatron).result);
    const std::string not_said = format_summary(exposed, predict(exposed).result);
    EXPECT_NE(said.find("beside its products, as Megatron-LM runs them (communication.tp_backward_comm auto, under "
                        "megatron)"),
              std::string::npos)
        << said;
    EXPECT_NE(not_said.find("after its products, exposed (communication.tp_backward_comm exposed)"), std::string::npos)
        << not_said;
  }
}

// Megatron-LM's output layer is its own column-parallel linear, not a Transformer Engine layer:
// with userbuffers running every layer's collectives, its backward still re-gathers its input and
// reduce-scatters its input gradient on NCCL's stream beside its products, which stay in 16 bits
// under FP8; with the backward exposed, neither.
TEST(TpBackwardComm, TheOutputLayersBackwardRunsItsCollectivesBesideItsProductsUnderUserbuffersToo) {
  for (const DType compute : {DType::bf16, DType::fp8}) {
    const Plan ub = Plan::from_config(llama_config(compute, true, TpBackwardComm::auto_select));
    const int last = ub.num_virtual_stages() - 1;
    const auto head = priced(ub, last);
    ASSERT_TRUE(head.contains("B tp.overlap.async_reducescatter")) << dtype_name(compute);
    EXPECT_EQ(head.at("B tp.overlap.async_reducescatter").count, 1);
    EXPECT_EQ(head.at("B tp.overlap.async_reducescatter").last.dtype, DType::bf16);
    EXPECT_EQ(head.at("B tp.overlap.async_reducescatter").last.shape.m, ub.shape().V / ub.tp);
    EXPECT_EQ(head.at("B tp.overlap.async_allgather").count, 1);
    EXPECT_EQ(head.at("B tp.overlap.async_allgather").last.dtype, DType::bf16);
    // The layers' backward reduce-scatters stay userbuffers' bulk ones.
    EXPECT_EQ(head.at("B tp.overlap.bulk_reducescatter").count, 2 * ub.layers_per_virtual_stage[last]);
    const auto exposed = priced(Plan::from_config(llama_config(compute, true, TpBackwardComm::exposed)), last);
    for (const auto& [name, p] : exposed) EXPECT_EQ(name.find("async"), std::string::npos) << name;
  }
}

}  // namespace
}  // namespace trainsim
