// The kernels one op of the schedule launches, with their shapes: what the calibrated compute
// model prices (compute_model.h) and what `trainsim calibrate` measures (runtime/calibrate/),
// so both sides name the same work and count its bytes the same way.
//
// The inventory follows the GPT-2 decoder as the runtime executes it
// (runtime/model/stage_model.cpp), per micro-batch of b samples (N = b s rows, C hidden,
// F ffn, H heads of hs = C/H, V vocabulary):
//   block forward   layernorm, qkv (N x 3C x C), attention core (QK^T, softmax, AV), projection
//                   (N x C x C), residual add, layernorm, fc (N x F x C), GELU, projection
//                   (N x C x F), residual add
//   block backward  input gradients: the four products' transposes, attention's four
//                   products, GELU and both layernorms' input gradients; weight gradients: the
//                   four dW products (out x in x N) and the layernorms' weights, then adding
//                   into the accumulation buffer
//   embedding       gather (forward), scatter-add of the token and position rows (weight pass)
//   head            final layernorm, logits (N x V x C), cross-entropy; and their gradients
//   optimizer step  gradient norm, Adam/AdamW or SGD over the rank's parameters, master
//                   rounding, working-copy refresh
// Every tensor a layer produces is checked for inf/NaN (and, in a low-precision format,
// rounded to it) in one pass: the `round` kernel over its elements.
// Memory-bound kernels count bytes as elements x `storage` bytes, each element read and
// written as the kernel does; matrix products count 2 m n k FLOPs per batch entry.
// Variants the runtime does not execute (SwiGLU, grouped-query attention, RMSNorm, rotary
// positions) are priced as their nearest GPT-2 counterpart with their own shapes.
//
// Two targets share the matrix products and differ in the memory-bound kernels around them:
//   runtime    what the runtime's decoder launches (above): what `trainsim calibrate` measures
//   framework  what Megatron-LM / PyTorch launch on a GPU for the plan's settings, priced by the
//              roofline (sim/cost/compute_model.h): no rounding passes (kernels write the compute
//              format), fused bias-GELU / bias-dropout-add, the attention core as the plan's
//              model.attention runs it (flash: one kernel and no s x s traffic; fused: scores,
//              softmax and dropout through HBM, the context permuted back and the q, k, v gradients
//              concatenated; naive: a separate mask pass too), biases added and their gradients
//              summed by kernels of their own unless model.fused_linear_bias, dropout masks
//              only when dropout > 0, FP32 logits for the loss, gradient accumulation into the
//              grad_accumulation format, activation recompute (full: the layer's forward again;
//              selective: the attention core again; selective_op: the layer's forward but for the
//              products and attention core it kept) and tensor-parallel all-reduces
//              (`tp.allreduce` entries whose bytes the collective model prices).
#pragma once

#include <string>
#include <vector>

#include "core/hardware_profile.h"
#include "core/plan.h"

namespace trainsim {

struct KernelWork {
  std::string kernel;  // as in KernelRate::kernel
  DType dtype = DType::fp32;
  KernelShape shape;
  double bytes = 0;    // memory-bound kernels
  int count = 1;       // launches of this exact kernel and shape in the op
  // Random numbers the kernel draws (a dropout mask generated in it: Philox, one per element);
  // the roofline prices them on the SMs' integer pipes beside the bytes (compute_model.cpp).
  double random_draws = 0;
};

struct ChunkKernels {
  std::vector<KernelWork> forward, backward_input, backward_weight;
};

enum class InventoryTarget { runtime, framework };

// `storage`: bytes per element the backend holds activations in (the CPU backend keeps fp32
// and rounds; the CUDA backend stores the compute format).
std::vector<ChunkKernels> chunk_kernels(const Plan& plan, int storage,
                                        InventoryTarget target = InventoryTarget::runtime);
// The framework inventory (InventoryTarget::framework) as it is built: `chunks` holds each
// chunk's kernels built once (the first chunk, the last, and the first middle chunk of each
// layer count), `chunk_of[vs]` the index in `chunks` of virtual stage vs's kernels.
// chunk_kernels(plan, storage, framework)[vs] is chunks[chunk_of[vs]].
struct BuiltChunks {
  std::vector<ChunkKernels> chunks;
  std::vector<int> chunk_of;
};
BuiltChunks framework_built_chunks(const Plan& plan, int storage);

// The optimizer step of a rank holding `params` parameters.
std::vector<KernelWork> optimizer_kernels(const Plan& plan, double params);
// The optimizer step as trainsim's runtime runs it (both engines), what a calibrated profile
// prices: optimizer_kernels, on a device (not emulated) the gradients' scan for the numerics
// report (a read, priced as the norm), and under ZeRO-1 first the rank's shard of `params` gradients
// copied out of the flat gradients, where the reduce-scatters left each section in place (as
// Megatron's distributed optimizer does): CpuEngine::optimizer_update's take,
// CudaEngine::take_flat_gradients. A gradient element is held in grad_accumulation's bytes, or
// in 4 where the engine emulates low precision (HardwareProfile::emulated_low_precision).
std::vector<KernelWork> runtime_optimizer_kernels(const Plan& plan, double params, bool emulated_low_precision);
// The update of a rank of pipeline stage `stage`: runtime_optimizer_kernels of its share of the
// stage's parameters (its tensor-parallel shard's, split among the replicas under ZeRO).
std::vector<KernelWork> rank_update_kernels(const Plan& plan, int stage, bool emulated_low_precision);

// The runtime's copy between a ZeRO collective's buffer and the flat parameters or gradients (a
// read and a write per element, in fp32 storage): what calibration times for the collective model,
// which adds it to the runtime's reduce-scatters and gathers when a profile has its rate.
inline constexpr const char* kShardCopyKernel = "shard_copy";
// ZeRO-3's copies around one unit's gather (elements: the unit's, times 1 + 1/d): its own section
// from the flat shard (in memory) into the gather's buffer, then every section out of that buffer
// (just written, in cache) into the unit's working weights (in memory: other units' weights and
// the passes' activations went through the cache since the unit was last read).
inline constexpr const char* kUnitCopyKernel = "unit_copy";

// Every distinct (kernel, dtype, shape) in the plan's inventory, once: what calibration measures.
std::vector<KernelWork> distinct_kernels(const Plan& plan, int storage);

}  // namespace trainsim
