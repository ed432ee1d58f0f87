#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/report/format.h"
#include "core/hardware_profile.h"
#include "core/report/report.h"
#include "core/presets.h"

namespace trainsim {

std::string human_count(double x) {
  const char* units[] = {"", "K", "M", "B", "T"};
  int u = 0;
  while (std::fabs(x) >= 1000 && u < 4) {
    x /= 1000;
    ++u;
  }
  return fmt::format("{:.{}f}{}", x, u == 0 ? 0 : (x < 10 ? 2 : 1), units[u]);
}

std::string format_seconds(double s) {
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string format_duration(double s) {
  if (s >= 2 * 86400) return fmt::format("{:.1f} days", s / 86400);
  if (s >= 2 * 3600) return fmt::format("{:.1f} hours", s / 3600);
  if (s >= 120) return fmt::format("{:.1f} minutes", s / 60);
  return format_seconds(s);
}

std::string text_bar(double fraction, int width) {
  const int full = static_cast<int>(std::lround(std::clamp(fraction, 0.0, 1.0) * width));
  std::string s;
  for (int i = 0; i < width; ++i) s += i < full ? "#" : ".";
  return s;
}

namespace {

// Words of `text` on lines of at most `width` characters, each starting with `indent`.
std::string wrapped(const std::string& text, std::size_t width, const std::string& indent) {
  std::string out, line;
  std::size_t i = 0;
  while (i < text.size()) {
    const std::size_t j = std::min(text.find(' ', i), text.size());
    const std::string word = text.substr(i, j - i);
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += indent + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    i = j + 1;
  }
  if (!line.empty()) out += indent + line + "\n";
  return out;
}

// The gradient buckets a data-parallel step reduces, and whose size they are (a hidden default
// moves the step: it is shown).
std::string gradient_buckets_text(const Plan& plan) {
  if (plan.data_shards() <= 1 || plan.reduces_by_unit()) return {};
  std::size_t count = 0;
  for (int j = 0; j < plan.vpp; ++j) count += plan.gradient_buckets(j * plan.pp).size();
  const double size = mib_to_bytes(plan.config.communication.bucket_size_mib);
  std::string whose = "bucket_size_mib";
  if (std::abs(size - plan.framework_bucket_bytes()) < 1.0) switch (plan.framework) {
      case Framework::megatron:
        whose = plan.config.communication.overlap_grad_reduce
                    ? fmt::format("Megatron-Core's max(40M, 1M x {} replicas) parameters", plan.dp)
                    : "Megatron-Core without overlap_grad_reduce";
        break;
      case Framework::deepspeed: whose = "DeepSpeed's reduce_bucket_size, 5e8 elements"; break;
      default: whose = "PyTorch DDP's bucket_cap_mb"; break;
    }
  const std::string when = plan.reduces_every_microbatch()
                               ? fmt::format(" after each of {} micro-batches", plan.num_microbatches)
                               : std::string();
  if (count == static_cast<std::size_t>(plan.vpp))
    return fmt::format("gradients reduced in one call a chunk ({}), {:.1f} MiB on stage 0{}", whose,
                       static_cast<double>(plan.gradient_bytes(0)) / kMiB, when);
  return fmt::format("gradients reduced in buckets of {:.1f} MiB ({}): {} a step on stage 0{}", size / kMiB, whose,
                     count, when);
}

}  // namespace

std::string format_summary(const Plan& plan, const Result& res) {
  const auto& c = plan.config;
  const ModelShape m = plan.shape();
  std::string o;
  o += fmt::format("{}{}\n", c.name.empty() ? std::string("scenario") : c.name,
                   plan.source.empty() ? "" : fmt::format(" ({})", plan.source));
  if (!c.description.empty()) o += wrapped(c.description, 96, "  ");
  const std::string label = model_label(c.model);
  o += fmt::format("  model    {} parameters{}: {} layers, hidden {}, {} heads, seq {}, vocab {}, {} attention\n",
                   human_count(m.total_params()), label.empty() ? "" : " (" + label + ")", m.L, m.h, m.a, m.s, m.V,
                   m.attention == AttentionKernel::flash   ? "flash"
                   : m.attention == AttentionKernel::cudnn ? "cudnn"
                   : m.attention == AttentionKernel::fused ? "fused"
                                                           : "naive");
  const int nodes = (c.cluster.num_gpus + c.cluster.gpus_per_node - 1) / c.cluster.gpus_per_node;
  if (const auto& p = c.cluster.calibrated)
    o += fmt::format("  cluster  {} ranks priced by the calibrated profile {} ({}: {}, measured {}), {:.1f} GiB each\n",
                     c.cluster.num_gpus, p->name, p->backend, p->device, p->measured, c.cluster.memory_gib);
  else
    o += fmt::format("  cluster  {} x {} GPUs ({} node{} of {}), {:.1f} GiB each\n", c.cluster.num_gpus,
                     c.cluster.gpu.empty() ? "custom" : c.cluster.gpu, nodes, nodes > 1 ? "s" : "",
                     c.cluster.gpus_per_node, c.cluster.memory_gib);
  o += fmt::format(
      "  plan     {}{}, {} schedule{}, {} micro-batches of {} per replica (global batch {}), ZeRO {}, recompute {}\n",
      parallel_sizes_text(c.parallelism), uneven_layers_text(plan.layers_per_virtual_stage),
      schedule_name(c.parallelism.schedule),
      plan.vpp > 1 && plan.microbatch_group != plan.pp
          ? fmt::format(" in groups of {} micro-batches", plan.microbatch_group)
          : std::string(),
      plan.num_microbatches, plan.micro_batch_size, plan.global_batch_size, c.parallelism.zero_stage,
      recompute_text(c.training));
  o += fmt::format("  data par {}: {}\n", res.framework, res.framework_setting);
  if (const std::string buckets = gradient_buckets_text(plan); !buckets.empty())
    o += fmt::format("  buckets  {}\n", buckets);
  if (c.communication.tp_comm_overlap && plan.tp > 1)
    o += fmt::format("  tensor   sequence parallel; its collectives overlapped with their products as Transformer Engine's "
                     "userbuffers run them (all-gathers by ring exchange, forward reduce-scatters {}, backward ones "
                     "beside the weight-gradient products)\n",
                     c.communication.tp_comm_overlap_reduce_scatter == TpOverlapReduceScatter::ring_exchange
                         ? "by ring exchange"
                         : "pipelined in 4 chunks");
  else if (plan.tp > 1)
    o += fmt::format("  tensor   the column-parallel layers' backward {} {} (communication.tp_backward_comm {})\n",
                     c.parallelism.sequence_parallel ? "reduce-scatters and input re-gathers" : "all-reduces",
                     plan.tp_backward_overlapped
                         ? "beside its products, as Megatron-LM runs them"
                         : "after its products, exposed",
                     c.communication.tp_backward_comm == TpBackwardComm::auto_select
                         ? fmt::format("auto, under {}", res.framework)
                         : c.communication.tp_backward_comm == TpBackwardComm::overlapped ? "overlapped" : "exposed");
  const auto& pr = c.precision;
  o += fmt::format("  numerics {} compute, {} master weights, {} grad accumulation, {} all-reduce (divide {}), "
                   "overflow check {}\n\n",
                   dtype_name(pr.compute), dtype_name(pr.master_weights), dtype_name(pr.grad_accumulation),
                   dtype_name(pr.allreduce), pr.allreduce_divide == AllReduceDivide::before ? "before" : "after",
                   pr.overflow_check == OverflowScope::global ? "global" : "local");

  o += fmt::format("  step time        {:>12}    tokens/s  {:>10}    MFU {:5.1f}%\n", format_seconds(res.step_time_s),
                   human_count(res.tokens_per_s), 100 * res.mfu);
  o += fmt::format("  per GPU          {:>12} tokens/s, model {:.1f} TFLOP/s, hardware {:.1f} TFLOP/s (with recompute)\n",
                   human_count(res.tokens_per_s_per_gpu), res.model_tflops_per_gpu, res.hardware_tflops_per_gpu);
  if (res.time_to_train_s >= 0)
    o += fmt::format("  whole run        {} ({}), {} GPU-hours{}\n", format_duration(res.time_to_train_s),
                     c.training.total_tokens > 0 ? fmt::format("{} tokens", human_count(c.training.total_tokens))
                                                 : fmt::format("{} steps", c.training.train_steps),
                     human_count(res.gpu_hours),
                     res.cost >= 0 ? fmt::format(", cost {} at {:g} per GPU-hour", human_count(res.cost),
                                                 c.cluster.price_per_gpu_hour)
                                   : std::string(" (set cluster.price_per_gpu_hour for the cost)"));
  o += fmt::format("  bubble fraction  {:>11.1f}%    = pipeline bubble {:.1f}% + exposed communication {:.1f}% "
                   "(idle, mean over ranks)\n",
                   100 * res.bubble_fraction, 100 * res.pipeline_bubble_fraction, 100 * res.exposed_comm_fraction);
  o += fmt::format("  all-reduce       {:>12}    exposed communication {} (the most on one rank)\n",
                   format_seconds(res.allreduce_time_s),
                   format_seconds(res.exposed_comm_time_s));
  double worst = 0;
  int worst_rank = 0;
  for (const auto& r : res.ranks)
    if (r.peak_memory_bytes > worst) {
      worst = r.peak_memory_bytes;
      worst_rank = r.rank;
    }
  const double cap = res.memory_capacity_bytes;
  if (res.fits_in_memory)
    o += fmt::format("  memory           fits: peak {:.1f} of {:.1f} GiB (rank {}), {:.1f} GiB headroom\n",
                     bytes_to_gib(worst), bytes_to_gib(cap), worst_rank, bytes_to_gib(cap - worst));
  else
    o += fmt::format("  memory           DOES NOT FIT: rank {} needs {:.1f} GiB of {:.1f} GiB ({:.1f} GiB over)\n",
                     worst_rank, bytes_to_gib(worst), bytes_to_gib(cap), bytes_to_gib(worst - cap));

  o += fmt::format("\n  {:>4} {:>5} {:>7}  {:>6} {:<20} {:>9} {:>9}   {:>7} {:>7} {:>7} {:>7} {:>7} {:>8}\n", "rank",
                   "stage", "replica", "util", "", "busy", "idle", "weights", "grads", "optim", "activ", "buffers",
                   "peak GiB");
  const std::size_t shown = std::min<std::size_t>(res.ranks.size(), 64);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto& r = res.ranks[i];
    o += fmt::format("  {:>4} {:>5} {:>7}  {:5.1f}% {:<20} {:>9} {:>9}   {:7.2f} {:7.2f} {:7.2f} {:7.2f} {:7.2f} {:>7.2f}{}\n",
                     r.rank, r.stage, r.replica, 100 * r.utilization, text_bar(r.utilization, 20), format_seconds(r.busy_s),
                     format_seconds(r.idle_s), bytes_to_gib(r.memory.weights), bytes_to_gib(r.memory.gradients),
                     bytes_to_gib(r.memory.optimizer), bytes_to_gib(r.memory.activations),
                     bytes_to_gib(r.memory.buffers), bytes_to_gib(r.peak_memory_bytes),
                     r.peak_memory_bytes > cap ? " !" : "");
  }
  if (shown < res.ranks.size())
    o += fmt::format("  ... {} more ranks (use --json for all)\n", res.ranks.size() - shown);
  if (plan.cp > 1)
    o += fmt::format("  (each rank is {} GPUs: tensor {} x context {}, each with {} of every sequence's tokens; figures "
                     "are per GPU)\n",
                     plan.gpus_per_rank(), plan.tp, plan.cp, plan.local_seq_length());
  else if (plan.tp > 1)
    o += fmt::format("  (each rank is a tensor-parallel group of {} GPUs; figures are per GPU)\n", plan.tp);

  if (!res.warnings.empty()) {
    o += "\nwarnings:\n";
    for (const auto& w : res.warnings) o += fmt::format("  - {}\n", w);
  }
  return o;
}

}  // namespace trainsim
