// The decoder's layers as plain functions over row-major buffers, forward and backward, templated
// on the scalar type: float for the runtime (runtime/model/stage_model.cpp), double for the
// finite-difference checks (tests/runtime/test_model.cpp). No rounding happens here; the stage
// model rounds what each layer produces to the compute format. The attention functions take a
// `post(row, n, kind)` callable that sees each row of their internal tensors (scores, softmax
// output and their gradients) before it is used, so that rounding can happen where a mixed-
// precision kernel would round; pass `layers::no_post` for the pure math.
//
// Shapes, as in llm.c: B micro-batch, T sequence, C hidden, H heads (head size hs = C / H),
// F ffn hidden, V vocabulary, N = B * T rows. Linear weights are (out, in), as torch.nn.Linear.
// Backward functions for weights accumulate (+=) unless told otherwise; input gradients are
// written (=). Every matrix product goes through gemm() below: float through the packed kernel of
// matmul.h (its summation order is documented there), double through Eigen.
#pragma once

// GCC 12 reports spurious (maybe-)uninitialized warnings inside its AVX-512 intrinsics as Eigen
// uses them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "runtime/model/eigen_gemm.h"
#include "runtime/model/matmul.h"

namespace trainsim::runtime::layers {

template <class S>
using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using MatMap = Eigen::Map<Mat<S>>;
template <class S>
using ConstMatMap = Eigen::Map<const Mat<S>>;
// A block of columns inside a wider row-major buffer (one head's slice of q, k, v).
template <class S>
using StridedMap = Eigen::Map<Mat<S>, 0, Eigen::OuterStride<>>;
template <class S>
using ConstStridedMap = Eigen::Map<const Mat<S>, 0, Eigen::OuterStride<>>;
template <class S>
using RowMap = Eigen::Map<Eigen::Array<S, 1, Eigen::Dynamic>>;
template <class S>
using ConstRowMap = Eigen::Map<const Eigen::Array<S, 1, Eigen::Dynamic>>;

inline constexpr double kLayerNormEps = 1e-5;

// C (M,N) = alpha * op(A) (M,K) * op(B) (K,N) + beta * C, row-major with row strides (matmul.h's
// contract; beta 0: C is not read).
template <class S>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, S alpha, const S* A, std::ptrdiff_t lda, const S* B,
          std::ptrdiff_t ldb, S beta, S* C, std::ptrdiff_t ldc) {
  if constexpr (std::is_same_v<S, float>)
    matmul::sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    matmul::eigen_gemm<S>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// What an attention `post` callable is shown.
enum class AttnTensor { scores, probs, probs_grad, scores_grad };
inline constexpr auto no_post = [](auto*, int, AttnTensor) {};

// ---------------------------------------------------------------------------------------
// Embedding: out (B,T,C) = wte[tokens] (V,C) + wpe[t] (T,C). `positions`: row t of each
// sequence sits at position positions[t] (context parallelism: a rank's rows); null: at t.
// ---------------------------------------------------------------------------------------
inline std::size_t position_of(const int* positions, std::size_t t) {
  return positions ? static_cast<std::size_t>(positions[t]) : t;
}

template <class S>
void embedding_forward(S* out, const std::int32_t* tokens, const S* wte, const S* wpe, int B, int T, int C,
                       const int* positions = nullptr) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const std::size_t n = static_cast<std::size_t>(b) * T + t;
      RowMap<S>(out + n * C, C) = ConstRowMap<S>(wte + static_cast<std::size_t>(tokens[n]) * C, C) +
                                  ConstRowMap<S>(wpe + position_of(positions, t) * C, C);
    }
}

// dwte[tokens] += dout; dwpe[position] += sum over b of dout. Rows are added in (b, t) order.
template <class S>
void embedding_backward(S* dwte, S* dwpe, const S* dout, const std::int32_t* tokens, int B, int T, int C,
                        const int* positions = nullptr) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const std::size_t n = static_cast<std::size_t>(b) * T + t;
      ConstRowMap<S> d(dout + n * C, C);
      RowMap<S>(dwte + static_cast<std::size_t>(tokens[n]) * C, C) += d;
      RowMap<S>(dwpe + position_of(positions, t) * C, C) += d;
    }
}

// ---------------------------------------------------------------------------------------
// LayerNorm over the last dimension: out (N,C) = (x - mean) * rstd * gamma + beta
// ---------------------------------------------------------------------------------------
template <class S>
void layernorm_forward(S* out, S* mean, S* rstd, const S* x, const S* gamma, const S* beta, int N, int C) {
  ConstRowMap<S> g(gamma, C), be(beta, C);
  for (int n = 0; n < N; ++n) {
    ConstRowMap<S> xr(x + static_cast<std::size_t>(n) * C, C);
    const S m = xr.mean();
    const S var = (xr - m).square().mean();
    const S r = S(1) / std::sqrt(var + S(kLayerNormEps));
    RowMap<S>(out + static_cast<std::size_t>(n) * C, C) = (xr - m) * r * g + be;
    mean[n] = m;
    rstd[n] = r;
  }
}

// dx = dresidual + (d out / d x)^T dout; dresidual may be null.
template <class S>
void layernorm_backward_input(S* dx, const S* dout, const S* x, const S* mean, const S* rstd, const S* gamma,
                              const S* dresidual, int N, int C) {
  ConstRowMap<S> g(gamma, C);
  for (int n = 0; n < N; ++n) {
    const std::size_t row = static_cast<std::size_t>(n) * C;
    ConstRowMap<S> xr(x + row, C), dy(dout + row, C);
    const S m = mean[n], r = rstd[n];
    const auto xhat = (xr - m) * r;
    const auto dnorm = dy * g;
    const S dnorm_mean = dnorm.mean();
    const S dnorm_xhat_mean = (dnorm * xhat).mean();
    RowMap<S> d(dx + row, C);
    if (dresidual)
      d = ConstRowMap<S>(dresidual + row, C) + (dnorm - dnorm_mean - xhat * dnorm_xhat_mean) * r;
    else
      d = (dnorm - dnorm_mean - xhat * dnorm_xhat_mean) * r;
  }
}

// dgamma += sum over rows of dout * xhat; dbeta += sum over rows of dout.
template <class S>
void layernorm_backward_weight(S* dgamma, S* dbeta, const S* dout, const S* x, const S* mean, const S* rstd, int N,
                               int C) {
  RowMap<S> dg(dgamma, C), db(dbeta, C);
  for (int n = 0; n < N; ++n) {
    const std::size_t row = static_cast<std::size_t>(n) * C;
    ConstRowMap<S> xr(x + row, C), dy(dout + row, C);
    dg += dy * ((xr - mean[n]) * rstd[n]);
    db += dy;
  }
}

// ---------------------------------------------------------------------------------------
// Linear: y (N,out) = x (N,in) w^T + b, w (out,in), b (out) or null
// ---------------------------------------------------------------------------------------
template <class S>
void linear_forward(S* y, const S* x, const S* w, const S* b, int N, int in, int out) {
  if (b) {  // the bias first, then the product added onto it: one pass less than zeroing first
    MatMap<S>(y, N, out).rowwise() = Eigen::Map<const Eigen::Matrix<S, 1, Eigen::Dynamic>>(b, out);
    gemm<S>(false, true, N, out, in, S(1), x, in, w, in, S(1), y, out);
  } else {
    gemm<S>(false, true, N, out, in, S(1), x, in, w, in, S(0), y, out);
  }
}

// dx (N,in) = dy (N,out) w
template <class S>
void linear_backward_input(S* dx, const S* dy, const S* w, int N, int in, int out) {
  gemm<S>(false, false, N, in, out, S(1), dy, out, w, in, S(0), dx, in);
}

// dw (out,in) (+)= dy^T x; db (out) (+)= column sums of dy (db may be null). `accumulate`
// false overwrites.
template <class S>
void linear_backward_weight(S* dw, S* db, const S* dy, const S* x, int N, int in, int out, bool accumulate = true) {
  gemm<S>(true, false, out, in, N, S(1), dy, out, x, in, accumulate ? S(1) : S(0), dw, in);
  if (db) {
    RowMap<S> dbias(db, out);
    if (!accumulate) dbias.setZero();
    for (int n = 0; n < N; ++n) dbias += ConstRowMap<S>(dy + static_cast<std::size_t>(n) * out, out);
  }
}

// ---------------------------------------------------------------------------------------
// GELU, tanh approximation: y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// ---------------------------------------------------------------------------------------
template <class S>
inline constexpr S kGeluScale = S(0.7978845608028654);  // sqrt(2/pi)
template <class S>
inline constexpr S kGeluCubic = S(0.044715);

template <class S>
void gelu_forward(S* y, const S* x, std::size_t n) {
  ConstRowMap<S> X(x, static_cast<Eigen::Index>(n));
  RowMap<S>(y, static_cast<Eigen::Index>(n)) =
      S(0.5) * X * (S(1) + (kGeluScale<S> * (X + kGeluCubic<S> * X.cube())).tanh());
}

// dx = dy * gelu'(x), in chunks so tanh is evaluated once per element.
template <class S>
void gelu_backward(S* dx, const S* x, const S* dy, std::size_t n) {
  constexpr Eigen::Index kChunk = 256;
  alignas(64) S tanh_buf[kChunk];
  for (std::size_t i = 0; i < n; i += kChunk) {
    const Eigen::Index m = static_cast<Eigen::Index>(std::min<std::size_t>(kChunk, n - i));
    ConstRowMap<S> X(x + i, m), dY(dy + i, m);
    RowMap<S> th(tanh_buf, m);
    th = (kGeluScale<S> * (X + kGeluCubic<S> * X.cube())).tanh();
    RowMap<S>(dx + i, m) = dY * (S(0.5) * (S(1) + th) + S(0.5) * X * (S(1) - th.square()) * kGeluScale<S> *
                                                            (S(1) + S(3) * kGeluCubic<S> * X.square()));
  }
}

// ---------------------------------------------------------------------------------------
// Causal multi-head self-attention.
// qkv (B,T,3C): q, k, v side by side, each (B,T,H,hs); out (B,T,C) with heads side by side;
// probs (B,H,T,T): softmax(q k^T / sqrt(hs)) over keys j <= i, zero above the diagonal.
// scratch: T*T. Every matrix product is a GEMM per (b, h), over blocks of kAttnRows query rows:
// the rows [r0, r1) of a block see only keys j < r1, so the products leave out the terms the
// causal mask makes zero (about half of them), and scores above the diagonal past the block are
// not computed. The terms left out are zeros at the ends of each k range: for finite inputs every
// value is the one the whole T x T products give, bit for bit while T is at most matmul's k block
// (a longer sequence moves the block bounds of dk and dv, not the values' accuracy).
//
// The general form (context parallelism, stage_layout.h): Tq queries at positions qpos[0..Tq),
// increasing, over Tk keys at positions 0..Tk-1 (the whole sequence's, gathered); query i sees keys
// j <= qpos[i]. Queries, keys and values are rows of wider buffers (AttentionRows); probs
// (B,H,Tq,Tk), scratch Tq*Tk. With qpos null (query i at position i) and Tq = Tk = T it is the
// function above, the same products over the same ranges.
// ---------------------------------------------------------------------------------------
inline constexpr int kAttnRows = 32;

// Rows of one of attention's operands (or its gradient): row r of sequence b at
// data + (b * rows + r) * stride, its heads side by side from there.
template <class S>
struct AttentionRows {
  S* data;
  std::ptrdiff_t stride;
};
struct AttentionShape {
  int B, Tq, Tk;
  const int* qpos = nullptr;  // null: query i at position i
  int pos(int i) const { return qpos ? qpos[i] : i; }
  // The first query that sees key `j` (queries are in increasing position).
  int first_query_seeing(int j) const {
    if (!qpos) return j;
    return static_cast<int>(std::lower_bound(qpos, qpos + Tq, j) - qpos);
  }
};

template <class S, class Post>
void attention_forward(S* out, S* probs, S* scratch, AttentionRows<const S> q, AttentionRows<const S> k,
                       AttentionRows<const S> v, AttentionShape shape, int C, int H, Post&& post) {
  const int hs = C / H, Tq = shape.Tq, Tk = shape.Tk;
  const S scale = S(1) / std::sqrt(S(hs));
  for (int b = 0; b < shape.B; ++b) {
    for (int h = 0; h < H; ++h) {
      const S* qb = q.data + static_cast<std::size_t>(b) * Tq * q.stride + h * hs;
      const S* kb = k.data + static_cast<std::size_t>(b) * Tk * k.stride + h * hs;
      const S* vb = v.data + static_cast<std::size_t>(b) * Tk * v.stride + h * hs;
      S* p = probs + (static_cast<std::size_t>(b) * H + h) * Tq * Tk;
      S* y = out + static_cast<std::size_t>(b) * Tq * C + h * hs;
      for (int r0 = 0; r0 < Tq; r0 += kAttnRows) {
        const int r1 = std::min(Tq, r0 + kAttnRows);
        const int keys = shape.pos(r1 - 1) + 1;  // the block's last query sees the most
        // scores[r0:r1, 0:keys] = scale * q[r0:r1] k[0:keys]^T
        gemm<S>(false, true, r1 - r0, keys, hs, scale, qb + r0 * q.stride, q.stride, kb, k.stride, S(0),
                scratch + r0 * Tk, Tk);
        for (int i = r0; i < r1; ++i) {
          const int n = shape.pos(i) + 1;
          S* srow = scratch + static_cast<std::size_t>(i) * Tk;
          S* prow = p + static_cast<std::size_t>(i) * Tk;
          post(srow, n, AttnTensor::scores);
          RowMap<S> s(srow, n), pr(prow, n);
          const S mx = s.maxCoeff();
          pr = (s - mx).exp();
          pr *= S(1) / pr.sum();
          for (int j = n; j < Tk; ++j) prow[j] = S(0);
          post(prow, n, AttnTensor::probs);
        }
        // y[r0:r1] = probs[r0:r1, 0:keys] v[0:keys]
        gemm<S>(false, false, r1 - r0, hs, keys, S(1), p + r0 * Tk, Tk, vb, v.stride, S(0), y + r0 * C, C);
      }
    }
  }
}

template <class S, class Post>
void attention_forward(S* out, S* probs, S* scratch, const S* qkv, int B, int T, int C, int H, Post&& post) {
  const std::ptrdiff_t stride = 3 * static_cast<std::ptrdiff_t>(C);
  attention_forward<S>(out, probs, scratch, {qkv, stride}, {qkv + C, stride}, {qkv + 2 * C, stride}, {B, T, T}, C, H,
                       post);
}

// The gradients dq (the queries' rows) and dk, dv (every key's) of attention_forward's out given
// dout (B,Tq,C). scratch: Tq*Tk. Keys no query sees get zero gradients.
template <class S, class Post>
void attention_backward(AttentionRows<S> dq, AttentionRows<S> dk, AttentionRows<S> dv, S* scratch, const S* dout,
                        AttentionRows<const S> q, AttentionRows<const S> k, AttentionRows<const S> v, const S* probs,
                        AttentionShape shape, int C, int H, Post&& post) {
  const int hs = C / H, Tq = shape.Tq, Tk = shape.Tk;
  const S scale = S(1) / std::sqrt(S(hs));
  // scratch holds first d(probs), then, row by row, d(scores); zero past each query's keys.
  for (int b = 0; b < shape.B; ++b) {
    for (int h = 0; h < H; ++h) {
      const S* qb = q.data + static_cast<std::size_t>(b) * Tq * q.stride + h * hs;
      const S* kb = k.data + static_cast<std::size_t>(b) * Tk * k.stride + h * hs;
      const S* vb = v.data + static_cast<std::size_t>(b) * Tk * v.stride + h * hs;
      const S* dy = dout + static_cast<std::size_t>(b) * Tq * C + h * hs;
      const S* p = probs + (static_cast<std::size_t>(b) * H + h) * Tq * Tk;
      S* dqb = dq.data + static_cast<std::size_t>(b) * Tq * dq.stride + h * hs;
      S* dkb = dk.data + static_cast<std::size_t>(b) * Tk * dk.stride + h * hs;
      S* dvb = dv.data + static_cast<std::size_t>(b) * Tk * dv.stride + h * hs;
      for (int r0 = 0; r0 < Tq; r0 += kAttnRows) {
        const int r1 = std::min(Tq, r0 + kAttnRows);
        const int keys = shape.pos(r1 - 1) + 1;
        // dprobs[r0:r1, 0:keys] = dy[r0:r1] v[0:keys]^T
        gemm<S>(false, true, r1 - r0, keys, hs, S(1), dy + r0 * C, C, vb, v.stride, S(0), scratch + r0 * Tk, Tk);
        for (int i = r0; i < r1; ++i) {
          const int n = shape.pos(i) + 1;
          S* drow = scratch + static_cast<std::size_t>(i) * Tk;
          post(drow, n, AttnTensor::probs_grad);
          RowMap<S> d(drow, n);
          ConstRowMap<S> pr(p + static_cast<std::size_t>(i) * Tk, n);
          const S dot = (pr * d).sum();
          d = pr * (d - dot) * scale;
          for (int j = n; j < Tk; ++j) drow[j] = S(0);
          post(drow, n, AttnTensor::scores_grad);
        }
        // dq[r0:r1] = dscores[r0:r1, 0:keys] k[0:keys]
        gemm<S>(false, false, r1 - r0, hs, keys, S(1), scratch + r0 * Tk, Tk, kb, k.stride, S(0), dqb + r0 * dq.stride,
                dq.stride);
      }
      // Key and value rows [k0, k1) receive from the queries i >= first_query_seeing(k0) only.
      for (int k0 = 0; k0 < Tk; k0 += kAttnRows) {
        const int k1 = std::min(Tk, k0 + kAttnRows);
        const int i0 = shape.first_query_seeing(k0);
        if (i0 >= Tq) {  // no query of this rank sees them
          for (int j = k0; j < k1; ++j) {
            RowMap<S>(dkb + j * dk.stride, hs).setZero();
            RowMap<S>(dvb + j * dv.stride, hs).setZero();
          }
          continue;
        }
        // dk[k0:k1] = dscores[i0:Tq, k0:k1]^T q[i0:Tq]; dv[k0:k1] = probs[i0:Tq, k0:k1]^T dy[i0:Tq]
        gemm<S>(true, false, k1 - k0, hs, Tq - i0, S(1), scratch + i0 * Tk + k0, Tk, qb + i0 * q.stride, q.stride,
                S(0), dkb + k0 * dk.stride, dk.stride);
        gemm<S>(true, false, k1 - k0, hs, Tq - i0, S(1), p + i0 * Tk + k0, Tk, dy + i0 * C, C, S(0),
                dvb + k0 * dv.stride, dv.stride);
      }
    }
  }
}

// dqkv (B,T,3C) = gradient of attention_forward's out given dout (B,T,C). scratch: T*T.
template <class S, class Post>
void attention_backward(S* dqkv, S* scratch, const S* dout, const S* qkv, const S* probs, int B, int T, int C, int H,
                        Post&& post) {
  const std::ptrdiff_t stride = 3 * static_cast<std::ptrdiff_t>(C);
  attention_backward<S>({dqkv, stride}, {dqkv + C, stride}, {dqkv + 2 * C, stride}, scratch, dout, {qkv, stride},
                        {qkv + C, stride}, {qkv + 2 * C, stride}, probs, {B, T, T}, C, H, post);
}

// ---------------------------------------------------------------------------------------
// Cross-entropy: loss = mean over N rows of logsumexp(logits) - logits[target].
// lse (N) is kept for the backward. Returns the mean (accumulated in double).
// ---------------------------------------------------------------------------------------
template <class S>
S cross_entropy_forward(S* lse, const S* logits, const std::int32_t* targets, int N, int V) {
  double total = 0;
  for (int n = 0; n < N; ++n) {
    ConstRowMap<S> l(logits + static_cast<std::size_t>(n) * V, V);
    const S mx = l.maxCoeff();
    const S z = mx + std::log((l - mx).exp().sum());
    lse[n] = z;
    total += static_cast<double>(z - l[targets[n]]);
  }
  return static_cast<S>(total / N);
}

// dlogits = scale * (softmax(logits) - onehot(target)): the gradient of scale * (sum of the rows'
// losses); pass scale = loss_gradient / N for the mean.
template <class S>
void cross_entropy_backward(S* dlogits, const S* logits, const S* lse, const std::int32_t* targets, int N, int V,
                            S scale) {
  for (int n = 0; n < N; ++n) {
    const std::size_t row = static_cast<std::size_t>(n) * V;
    RowMap<S> d(dlogits + row, V);
    d = (ConstRowMap<S>(logits + row, V) - lse[n]).exp() * scale;
    d[targets[n]] -= scale;
  }
}

// ---------------------------------------------------------------------------------------
// Tensor parallelism's pieces (Megatron-LM): a shard holds vocabulary rows [vocab0, vocab0 + Vl)
// of wte (or the LM head). The stage model sums the shards' results over the group between them.
// ---------------------------------------------------------------------------------------
// Vocabulary-parallel embedding: out (N,C) = wte_shard[token - vocab0] for the tokens this shard
// holds, 0 for the others (the group's sum is the lookup; no position embedding yet).
template <class S>
void embedding_shard_forward(S* out, const std::int32_t* tokens, const S* wte_shard, int vocab0, int Vl, int N, int C) {
  for (int n = 0; n < N; ++n) {
    RowMap<S> o(out + static_cast<std::size_t>(n) * C, C);
    const int v = tokens[n] - vocab0;
    if (v >= 0 && v < Vl)
      o = ConstRowMap<S>(wte_shard + static_cast<std::size_t>(v) * C, C);
    else
      o.setZero();
  }
}

// out (rows,C) += wpe[position]: row i of out is row row0 + i of the (B,T) micro-batch, at
// position (row0 + i) % T (or positions[that], as embedding_forward).
template <class S>
void add_position_embedding(S* out, const S* wpe, std::size_t row0, std::size_t rows, int T, int C,
                            const int* positions = nullptr) {
  for (std::size_t i = 0; i < rows; ++i)
    RowMap<S>(out + i * C, C) +=
        ConstRowMap<S>(wpe + position_of(positions, (row0 + i) % static_cast<std::size_t>(T)) * C, C);
}

// dwte_shard[token - vocab0] += dout for the tokens this shard holds; dwpe[t] += dout (all rows,
// dwpe may be null). Rows are added in (b, t) order, as embedding_backward adds them.
template <class S>
void embedding_shard_backward(S* dwte_shard, S* dwpe, const S* dout, const std::int32_t* tokens, int vocab0, int Vl,
                              int N, int T, int C, const int* positions = nullptr) {
  for (int n = 0; n < N; ++n) {
    ConstRowMap<S> d(dout + static_cast<std::size_t>(n) * C, C);
    const int v = tokens[n] - vocab0;
    if (v >= 0 && v < Vl) RowMap<S>(dwte_shard + static_cast<std::size_t>(v) * C, C) += d;
    if (dwpe) RowMap<S>(dwpe + position_of(positions, static_cast<std::size_t>(n % T)) * C, C) += d;
  }
}

// Vocabulary-parallel cross-entropy (Megatron's vocab_parallel_cross_entropy): each shard holds
// the logits (N,Vl) of its vocabulary rows. (1) rowmax = this shard's row maxima, max-reduced over
// the group; (2) sums[n] = sum exp(logit - rowmax) over the shard's columns and sums[N + n] = the
// target's logit where the shard holds it (else 0), both summed over the group; (3) the loss.
template <class S>
void cross_entropy_shard_max(S* rowmax, const S* logits, int N, int Vl) {
  for (int n = 0; n < N; ++n) rowmax[n] = ConstRowMap<S>(logits + static_cast<std::size_t>(n) * Vl, Vl).maxCoeff();
}
template <class S>
void cross_entropy_shard_sums(S* sums, const S* logits, const S* rowmax, const std::int32_t* targets, int vocab0,
                              int N, int Vl) {
  for (int n = 0; n < N; ++n) {
    ConstRowMap<S> l(logits + static_cast<std::size_t>(n) * Vl, Vl);
    sums[n] = (l - rowmax[n]).exp().sum();
    const int v = targets[n] - vocab0;
    sums[N + n] = v >= 0 && v < Vl ? l[v] : S(0);
  }
}
// lse[n] = rowmax + log(sum); returns the mean of lse - target logit over the rows (in double),
// as cross_entropy_forward does.
template <class S>
S cross_entropy_shard_loss(S* lse, const S* rowmax, const S* sums, int N) {
  double total = 0;
  for (int n = 0; n < N; ++n) {
    lse[n] = rowmax[n] + std::log(sums[n]);
    total += static_cast<double>(lse[n] - sums[N + n]);
  }
  return static_cast<S>(total / N);
}
// dlogits (N,Vl) = scale * (softmax - onehot(target)) on the shard's columns: cross_entropy_backward
// with the target's column where the shard holds it.
template <class S>
void cross_entropy_shard_backward(S* dlogits, const S* logits, const S* lse, const std::int32_t* targets, int vocab0,
                                  int N, int Vl, S scale) {
  for (int n = 0; n < N; ++n) {
    const std::size_t row = static_cast<std::size_t>(n) * Vl;
    RowMap<S> d(dlogits + row, Vl);
    d = (ConstRowMap<S>(logits + row, Vl) - lse[n]).exp() * scale;
    const int v = targets[n] - vocab0;
    if (v >= 0 && v < Vl) d[v] -= scale;
  }
}

// y (N,out) += b broadcast over rows: the bias of a row-parallel product, added once after its
// partial products are summed over the group.
template <class S>
void add_bias(S* y, const S* b, std::size_t N, int out) {
  MatMap<S>(y, static_cast<Eigen::Index>(N), out).rowwise() += Eigen::Map<const Eigen::Matrix<S, 1, Eigen::Dynamic>>(b, out);
}

}  // namespace trainsim::runtime::layers
