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
// Embedding: out (B,T,C) = wte[tokens] (V,C) + wpe[t] (T,C)
// ---------------------------------------------------------------------------------------
template <class S>
void embedding_forward(S* out, const std::int32_t* tokens, const S* wte, const S* wpe, int B, int T, int C) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const std::size_t n = static_cast<std::size_t>(b) * T + t;
      RowMap<S>(out + n * C, C) = ConstRowMap<S>(wte + static_cast<std::size_t>(tokens[n]) * C, C) +
                                  ConstRowMap<S>(wpe + static_cast<std::size_t>(t) * C, C);
    }
}

// dwte[tokens] += dout; dwpe[t] += sum over b of dout. Rows are added in (b, t) order.
template <class S>
void embedding_backward(S* dwte, S* dwpe, const S* dout, const std::int32_t* tokens, int B, int T, int C) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const std::size_t n = static_cast<std::size_t>(b) * T + t;
      ConstRowMap<S> d(dout + n * C, C);
      RowMap<S>(dwte + static_cast<std::size_t>(tokens[n]) * C, C) += d;
      RowMap<S>(dwpe + static_cast<std::size_t>(t) * C, C) += d;
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
// ---------------------------------------------------------------------------------------
inline constexpr int kAttnRows = 32;

template <class S, class Post>
void attention_forward(S* out, S* probs, S* scratch, const S* qkv, int B, int T, int C, int H, Post&& post) {
  const int hs = C / H;
  const S scale = S(1) / std::sqrt(S(hs));
  const std::ptrdiff_t stride = 3 * static_cast<std::ptrdiff_t>(C);
  for (int b = 0; b < B; ++b) {
    const S* base = qkv + static_cast<std::size_t>(b) * T * 3 * C;
    for (int h = 0; h < H; ++h) {
      const S* q = base + h * hs;
      const S* k = base + C + h * hs;
      const S* v = base + 2 * C + h * hs;
      S* p = probs + (static_cast<std::size_t>(b) * H + h) * T * T;
      S* y = out + static_cast<std::size_t>(b) * T * C + h * hs;
      for (int r0 = 0; r0 < T; r0 += kAttnRows) {
        const int r1 = std::min(T, r0 + kAttnRows);
        // scores[r0:r1, 0:r1] = scale * q[r0:r1] k[0:r1]^T
        gemm<S>(false, true, r1 - r0, r1, hs, scale, q + r0 * stride, stride, k, stride, S(0), scratch + r0 * T, T);
        for (int i = r0; i < r1; ++i) {
          S* srow = scratch + static_cast<std::size_t>(i) * T;
          S* prow = p + static_cast<std::size_t>(i) * T;
          post(srow, i + 1, AttnTensor::scores);
          RowMap<S> s(srow, i + 1), pr(prow, i + 1);
          const S mx = s.maxCoeff();
          pr = (s - mx).exp();
          pr *= S(1) / pr.sum();
          for (int j = i + 1; j < T; ++j) prow[j] = S(0);
          post(prow, i + 1, AttnTensor::probs);
        }
        // y[r0:r1] = probs[r0:r1, 0:r1] v[0:r1]
        gemm<S>(false, false, r1 - r0, hs, r1, S(1), p + r0 * T, T, v, stride, S(0), y + r0 * C, C);
      }
    }
  }
}

// dqkv (B,T,3C) = gradient of attention_forward's out given dout (B,T,C). scratch: T*T.
template <class S, class Post>
void attention_backward(S* dqkv, S* scratch, const S* dout, const S* qkv, const S* probs, int B, int T, int C, int H,
                        Post&& post) {
  const int hs = C / H;
  const S scale = S(1) / std::sqrt(S(hs));
  const std::ptrdiff_t stride = 3 * static_cast<std::ptrdiff_t>(C);
  // scratch holds first d(probs), then, row by row, d(scores); zero above the diagonal.
  for (int b = 0; b < B; ++b) {
    const S* base = qkv + static_cast<std::size_t>(b) * T * 3 * C;
    S* dbase = dqkv + static_cast<std::size_t>(b) * T * 3 * C;
    for (int h = 0; h < H; ++h) {
      const S* q = base + h * hs;
      const S* k = base + C + h * hs;
      const S* v = base + 2 * C + h * hs;
      const S* dy = dout + static_cast<std::size_t>(b) * T * C + h * hs;
      const S* p = probs + (static_cast<std::size_t>(b) * H + h) * T * T;
      S* dq = dbase + h * hs;
      S* dk = dbase + C + h * hs;
      S* dv = dbase + 2 * C + h * hs;
      for (int r0 = 0; r0 < T; r0 += kAttnRows) {
        const int r1 = std::min(T, r0 + kAttnRows);
        // dprobs[r0:r1, 0:r1] = dy[r0:r1] v[0:r1]^T
        gemm<S>(false, true, r1 - r0, r1, hs, S(1), dy + r0 * C, C, v, stride, S(0), scratch + r0 * T, T);
        for (int i = r0; i < r1; ++i) {
          S* drow = scratch + static_cast<std::size_t>(i) * T;
          post(drow, i + 1, AttnTensor::probs_grad);
          RowMap<S> d(drow, i + 1);
          ConstRowMap<S> pr(p + static_cast<std::size_t>(i) * T, i + 1);
          const S dot = (pr * d).sum();
          d = pr * (d - dot) * scale;
          for (int j = i + 1; j < T; ++j) drow[j] = S(0);
          post(drow, i + 1, AttnTensor::scores_grad);
        }
        // dq[r0:r1] = dscores[r0:r1, 0:r1] k[0:r1]
        gemm<S>(false, false, r1 - r0, hs, r1, S(1), scratch + r0 * T, T, k, stride, S(0), dq + r0 * stride, stride);
      }
      // Key and value rows [r0, r1) receive from queries i >= r0 only.
      for (int r0 = 0; r0 < T; r0 += kAttnRows) {
        const int r1 = std::min(T, r0 + kAttnRows);
        // dk[r0:r1] = dscores[r0:T, r0:r1]^T q[r0:T]; dv[r0:r1] = probs[r0:T, r0:r1]^T dy[r0:T]
        gemm<S>(true, false, r1 - r0, hs, T - r0, S(1), scratch + r0 * T + r0, T, q + r0 * stride, stride, S(0),
                dk + r0 * stride, stride);
        gemm<S>(true, false, r1 - r0, hs, T - r0, S(1), p + r0 * T + r0, T, dy + r0 * C, C, S(0), dv + r0 * stride,
                stride);
      }
    }
  }
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

}  // namespace trainsim::runtime::layers
