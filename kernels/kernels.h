// CUDA kernels for the work cuBLAS does not do (matrix products: kernels/gemm.h). Plain C++:
// no CUDA type crosses this header, so callers compile with g++ (STYLE.md habit 7).
//
// Conventions, shared by every launcher:
//  * shapes follow runtime/model/layers.h: B micro-batch, T sequence, C hidden, H heads, F ffn
//    hidden, V vocabulary, N = B * T rows; tensors are row-major; weights are (out, in);
//  * `dt` is the storage format of the activations (and of the working-copy weights and the
//    gradients passed between layers): DType::fp32, fp16 or bf16. Values are loaded into fp32,
//    all arithmetic is fp32 (fp64 where a comment says so), and what is stored is rounded once to
//    `dt` with round-to-nearest-even (the rounding of runtime/numerics/lowp.h). DType::tf32 and
//    fp8 are refused here (std::invalid_argument); tf32 is a matrix-product mode (gemm.h);
//  * pointers are device pointers; `void*` ones hold elements of `dt`, `float*` ones fp32;
//  * `stream` is a cudaStream_t (nullptr: the legacy default stream). Launchers are asynchronous;
//    a launch that fails throws std::runtime_error naming the kernel. Errors raised while a
//    kernel runs surface at the next synchronising call (kernels/device_buffer.h synchronize());
//  * reductions use a fixed launch shape and a fixed order, so results are bit-identical run to
//    run and across devices with the same compiled code; no floating-point atomics anywhere;
//  * weight gradients accumulate (+=) into fp32 buffers, as layers.h's backward functions do;
//    input gradients are written (=).
//
// How the runtime's layers map onto launchers (the CPU reference of each kernel is named):
//   embedding          embedding_forward / embedding_backward      layers::embedding_*
//   LayerNorm          layernorm_forward / layernorm_backward_input / layernorm_backward_weight
//   linear             gemm.h (linear_forward ...) + bias_backward (the bias gradient)
//   GELU               gelu_forward / gelu_backward                layers::gelu_*
//   attention          gemm.h batched products + causal_softmax_forward / _backward (below)
//   cross-entropy      cross_entropy_forward / cross_entropy_backward, mean loss via sum()
//   residual stream    residual_add; gradient accumulation: accumulate
//   mixed precision    cast, unscale_and_check, squared_norm, adam_update, sgd_update
//   tensor parallelism embedding_shard_forward, add_position_embedding, add_bias,
//                      cross_entropy_shard_*                      layers::*_shard_*, add_*
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/cuda_handles.h"

namespace trainsim::cuda {

// ---------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------
// out (B,T,C) = wte[tokens] (V,C) + wpe[t] (T,C); out, wte, wpe in dt. A token outside [0, V)
// makes its output row NaN (visible to the numerics scan) instead of reading out of bounds.
void embedding_forward(void* out, const std::int32_t* tokens, const void* wte, const void* wpe, int B, int T, int C,
                       int V, DType dt, StreamHandle stream);

// dwte (V,C) += dout rows by token; dwpe (T,C) += dout summed over b; dwte, dwpe fp32, dout in dt.
// Every element receives its terms in the order of layers::embedding_backward ((b, t) order), so
// the fp32 result is bit-identical to the CPU's.
void embedding_backward(float* dwte, float* dwpe, const void* dout, const std::int32_t* tokens, int B, int T, int C,
                        int V, DType dt, StreamHandle stream);

// ---------------------------------------------------------------------------------------
// LayerNorm over the last dimension (eps = layers::kLayerNormEps = 1e-5)
// ---------------------------------------------------------------------------------------
// out (N,C) = (x - mean) * rstd * gamma + beta; x, gamma, beta, out in dt; mean, rstd (N) fp32
// (the statistics the backward reads, kept in fp32 as the CPU stash keeps them).
void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const void* gamma, const void* beta, int N,
                       int C, DType dt, StreamHandle stream);

// dx (N,C) = dresidual + (d out / d x)^T dout; dresidual may be null, and dx may be the same
// buffer as dresidual. All tensors in dt except mean, rstd.
void layernorm_backward_input(void* dx, const void* dout, const void* x, const float* mean, const float* rstd,
                              const void* gamma, const void* dresidual, int N, int C, DType dt, StreamHandle stream);

// dgamma (C) += sum over rows of dout * xhat; dbeta (C) += sum over rows of dout (fp32).
void layernorm_backward_weight(float* dgamma, float* dbeta, const void* dout, const void* x, const float* mean,
                               const float* rstd, int N, int C, DType dt, StreamHandle stream);

// db (OC) += column sums of dy (N,OC): the bias gradient of a linear layer (fp32), the part of
// layers::linear_backward_weight that is not a matrix product.
void bias_backward(float* db, const void* dy, int N, int OC, DType dt, StreamHandle stream);

// ---------------------------------------------------------------------------------------
// GELU, tanh approximation, exactly as layers.h: y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// ---------------------------------------------------------------------------------------
void gelu_forward(void* y, const void* x, std::size_t n, DType dt, StreamHandle stream);
// dx = dy * gelu'(x); dx may be the same buffer as dy.
void gelu_backward(void* dx, const void* x, const void* dy, std::size_t n, DType dt, StreamHandle stream);

// ---------------------------------------------------------------------------------------
// Causal softmax of attention, rows of (B*H, T, T) matrices (row i of a matrix: query i)
// ---------------------------------------------------------------------------------------
// layers::attention_forward/backward compute, per (b, h):
//   scores = (1/sqrt(hs)) * q k^T       a matrix product; rounded to dt (post: scores)
//   probs  = causal softmax(scores)     rounded to dt (post: probs)      <- causal_softmax_forward
//   out    = probs v                    a matrix product
//   dprobs = dout v^T                   a matrix product; rounded to dt (post: probs_grad)
//   dscores = probs * (dprobs - rowdot(probs, dprobs)) * (1/sqrt(hs))   <- causal_softmax_backward
//                                       rounded to dt (post: scores_grad); it is the gradient of
//                                       q k^T, so dq = dscores k, dk = dscores^T q with no scale.
// So layers.h puts the 1/sqrt(hs) inside the forward's matrix product (cuBLAS alpha) and inside
// the backward's softmax. Both launchers take `scale`: the forward computes softmax(scale * s);
// pass scale = 1 with alpha = 1/sqrt(hs) to round exactly where layers.h rounds. The backward
// multiplies by `scale` as layers.h does; pass 1/sqrt(hs).

// probs[r, j] = exp(scale*s[r,j] - max) / sum over j <= i (i = r mod T), 0 for j > i; the row sum
// is inverted once and multiplied in (as layers.h). probs may be the same buffer as scores.
void causal_softmax_forward(void* probs, const void* scores, int BH, int T, float scale, DType dt, StreamHandle stream);

// dscores[r, j] = probs * (dprobs - sum_{k<=i} probs*dprobs) * scale for j <= i, 0 for j > i.
// dscores may be the same buffer as dprobs.
void causal_softmax_backward(void* dscores, const void* probs, const void* dprobs, int BH, int T, float scale, DType dt,
                             StreamHandle stream);

// ---------------------------------------------------------------------------------------
// Cross-entropy (layers::cross_entropy_forward / _backward)
// ---------------------------------------------------------------------------------------
// Per row: lse[n] = logsumexp(logits[n]) (max-shifted, fp32) and losses[n] = lse[n] -
// logits[n, targets[n]] (fp32). The micro-batch's mean loss, as layers.h returns it (summed in
// double), is sum(losses) / N: see sum() below. A target outside [0, V) gives a NaN loss.
void cross_entropy_forward(float* losses, float* lse, const void* logits, const std::int32_t* targets, int N, int V,
                           DType dt, StreamHandle stream);

// dlogits = scale * (softmax(logits) - onehot(target)), computed as layers.h does:
// exp(logit - lse) * scale, minus scale at the target. The stage model passes
// scale = loss_gradient_scale / N (loss scale / micro-batches, divided by the rows for the mean;
// runtime/model/stage_model.cpp, StageModel::Impl::begin). dlogits may be the same buffer as logits.
void cross_entropy_backward(void* dlogits, const void* logits, const float* lse, const std::int32_t* targets, int N,
                            int V, float scale, DType dt, StreamHandle stream);

// ---------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------
// out = a + b (the residual stream), all in dt; out may be a or b.
void residual_add(void* out, const void* a, const void* b, std::size_t n, DType dt, StreamHandle stream);

// acc = acc + x, the sum in fp32 rounded to acc_dt (a micro-batch's gradient added into the
// accumulation buffer, as StageModel::Impl::commit does; x in x_dt).
void accumulate(void* acc, DType acc_dt, const void* x, DType x_dt, std::size_t n, StreamHandle stream);

// dst = src converted, for any pair of fp32, fp16, bf16: round-to-nearest-even, overflow to
// +-inf, NaN stays NaN, subnormals as the format has them (exactly lowp.h's round_to).
void cast(void* dst, DType dst_dt, const void* src, DType src_dt, std::size_t n, StreamHandle stream);

// dst[i] = scale * z_i rounded to dt (or its square, `squared`: a second moment), z_i a standard
// normal draw (Box-Muller) from a hash of (seed, i): the same values for the same seed on any
// device and launch shape. Operands for benchmarks and calibration, drawn where they are used
// (a host draw of the ~10^9 values a GPU-sized calibration times took half a minute); the
// model's own initialisation stays the CPU's (the backends' weights must agree).
void fill_normal(void* dst, DType dt, std::size_t n, float scale, std::uint64_t seed, bool squared,
                 StreamHandle stream);

// ---------------------------------------------------------------------------------------
// Mixed-precision optimizer step
// ---------------------------------------------------------------------------------------
// The loss-scaling step, fused: grads *= inv_scale in place (an fp32 multiply, as the CPU
// executor does it, then rounded to dt) and *found_inf = 1 if any gradient is inf or NaN before
// or after the multiply. The flag is only ever set, never cleared: zero it before the step (it
// may collect several buffers), read it after.
void unscale_and_check(void* grads, std::size_t n, float inv_scale, int* found_inf, DType dt, StreamHandle stream);

// Deterministic two-pass reductions, accumulated in double (every fp32 square is exact in
// double): a fixed grid of kReductionBlocks blocks writes one partial each into `scratch`, then
// one block sums the partials in a fixed order. *out = result, or *out += result when
// `accumulate` (to sum several ranges). scratch: kReductionScratchDoubles doubles on the device.
inline constexpr int kReductionBlocks = 1024;
inline constexpr std::size_t kReductionScratchDoubles = kReductionBlocks;
void squared_norm(double* out, const void* x, std::size_t n, DType dt, double* scratch, bool accumulate, StreamHandle stream);
void sum(double* out, const float* x, std::size_t n, double* scratch, bool accumulate, StreamHandle stream);

// One Adam/AdamW step on fp32 master weights, matching runtime/numerics/optimizer.cpp element by
// element: arithmetic in double, moments stored in fp32, Kingma & Ba's bias correction with
// t = step (the count after the increment, 1 on the first step), eps added to sqrt(v_hat),
// g = grad * grad_scale (the clipping coefficient), weight decay as an L2 term through the
// gradient (Adam) or decoupled (AdamW: update += weight_decay * w) where decay_mask[i] != 0
// (decay_mask null: every element). Also writes the new master weight, rounded to working_dt,
// into `working` (may be null). grads in grad_dt.
struct AdamParams {
  double learning_rate = 1e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  bool decoupled = true;  // AdamW; false: Adam with L2 decay through the moments
  std::int64_t step = 1;  // t, >= 1
  float grad_scale = 1.0f;
};
void adam_update(float* master, float* m, float* v, const void* grads, DType grad_dt, const std::uint8_t* decay_mask,
                 void* working, DType working_dt, std::size_t n, const AdamParams& p, StreamHandle stream);

// Plain SGD as optimizer.cpp: w -= lr * (grad * grad_scale + weight_decay * w where decayed), in
// double; writes the working copy as adam_update does.
void sgd_update(float* master, const void* grads, DType grad_dt, const std::uint8_t* decay_mask, void* working,
                DType working_dt, std::size_t n, double learning_rate, double weight_decay, float grad_scale,
                StreamHandle stream);

// ---------------------------------------------------------------------------------------
// Scaling
// ---------------------------------------------------------------------------------------
// x = x * factor in place: one fp32 multiply, rounded once to dt (the NCCL communicator's
// Divide::after, factor = 1/n).
void scale_inplace(void* x, std::size_t n, float factor, DType dt, StreamHandle stream);

// ---------------------------------------------------------------------------------------
// Tensor parallelism (Megatron-LM; runtime/model/layers.h's shard functions). A shard holds the
// vocabulary rows [vocab0, vocab0 + Vl); the ids these launchers take are its LOCAL ids: id - vocab0
// where the shard holds the id, -1 where it does not. With local ids, a shard's embedding gradient
// is embedding_backward(dwte_shard, dwpe, dout, local_tokens, B, T, C, Vl) and its cross-entropy
// gradient cross_entropy_backward(dlogits, logits, lse, local_targets, N, Vl, ...).
// ---------------------------------------------------------------------------------------
// out (N,C) = wte_shard[local token] (Vl,C), zeros where the local token is -1 (the group's sum is the
// lookup): layers::embedding_shard_forward.
void embedding_shard_forward(void* out, const std::int32_t* local_tokens, const void* wte_shard, int N, int C, int Vl,
                             DType dt, StreamHandle stream);
// out (rows,C) += wpe[(row0 + i) % T] (T,C) for row i: one fp32 add rounded to dt
// (layers::add_position_embedding, then the stage model's rounding).
void add_position_embedding(void* out, const void* wpe, std::size_t row0, std::size_t rows, int T, int C, DType dt,
                            StreamHandle stream);
// y (N,OC) += b (OC) broadcast over the rows, rounded to dt: the bias of a row-parallel product,
// added once after the group summed its partial products (layers::add_bias).
void add_bias(void* y, const void* b, std::size_t N, int OC, DType dt, StreamHandle stream);
// Vocabulary-parallel cross-entropy, fp32: rowmax (N) = the shard's row maxima (max-reduced over
// the group by the caller); sums[n] = sum of exp(logit - rowmax[n]) over the shard's Vl columns and
// sums[N + n] = the local target's logit (0 where it is -1), both summed over the group by the
// caller; then lse[n] = rowmax[n] + log(sums[n]) and losses[n] = lse[n] - sums[N + n].
void cross_entropy_shard_max(float* rowmax, const void* logits, int N, int Vl, DType dt, StreamHandle stream);
void cross_entropy_shard_sums(float* sums, const void* logits, const float* rowmax, const std::int32_t* local_targets,
                              int N, int Vl, DType dt, StreamHandle stream);
void cross_entropy_shard_loss(float* losses, float* lse, const float* rowmax, const float* sums, int N,
                              StreamHandle stream);

}  // namespace trainsim::cuda
