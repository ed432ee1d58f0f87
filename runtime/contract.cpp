#include "runtime/contract.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace trainsim::runtime {

std::string plan_fingerprint(const RuntimePlan& rp) {
  const Plan& p = rp.plan;
  const auto& pr = p.config.precision;
  return fmt::format(
      "model L{} h{} a{} s{} V{} tied{} | dp{} pp{} v{} {} m{} b{} layers {} | compute {} master {} accum {} "
      "allreduce {} divide {} check {} | optimizer {} seed {}",
      rp.dims.num_layers, rp.dims.hidden_size, rp.dims.num_heads, rp.dims.seq_length, rp.dims.vocab_size,
      rp.dims.tied_embeddings ? 1 : 0, p.dp, p.pp, p.vpp, schedule_name(p.config.parallelism.schedule),
      p.num_microbatches, p.micro_batch_size, fmt::join(p.layers_per_virtual_stage, "/"), dtype_name(pr.compute),
      dtype_name(pr.master_weights), dtype_name(pr.grad_accumulation), dtype_name(pr.allreduce),
      pr.allreduce_divide == AllReduceDivide::before ? "before" : "after",
      pr.overflow_check == OverflowScope::global ? "global" : "local", static_cast<int>(p.config.training.optimizer),
      p.config.runtime.seed);
}

}  // namespace trainsim::runtime
