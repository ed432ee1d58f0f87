// Row kernels: LayerNorm forward/backward, the bias gradient, the causal softmax of attention and
// cross-entropy. CPU references: runtime/model/layers.h; tests: tests/kernels/test_kernels.cpp.
// Every reduction has a fixed shape (warp per row, block per row, or 32 x 32 column tiles) and a
// fixed order, so results are deterministic.
#include <cmath>

#include "kernels/common.cuh"
#include "kernels/kernels.h"

namespace trainsim::cuda {

using namespace detail;

namespace {

constexpr int kWarpRowThreads = 32 * kRowsPerBlock;  // warp-per-row kernels: 256 threads, 8 rows

// ---------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------

// One warp per row (8 rows per 256-thread block); lane k handles columns k, k+32, ...
// Two passes over the row as layers.h: mean = sum/C, then var = sum((x - mean)^2)/C (no
// E[x^2] - mean^2 cancellation), rstd = 1/sqrt(var + 1e-5f) with IEEE sqrt and division.
// Sums: per-lane sequential, then a 32-lane butterfly; fp32.
template <class T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* x, const T* gamma, const T* beta,
                                         int N, int C) {
  const int lane = threadIdx.x % 32;
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(N)) return;  // the whole warp leaves together
  const T* xr = x + row * C;
  T* yr = out + row * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s += to_float(xr[c]);
  const float m = warp_sum(s) / static_cast<float>(C);
  float s2 = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float d = to_float(xr[c]) - m;
    s2 += d * d;
  }
  const float var = warp_sum(s2) / static_cast<float>(C);
  const float r = 1.0f / sqrtf(var + 1e-5f);
  for (int c = lane; c < C; c += 32)
    yr[c] = from_float<T>((to_float(xr[c]) - m) * r * to_float(gamma[c]) + to_float(beta[c]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// One warp per row. Pass 1: mean of dnorm = dout*gamma and of dnorm*xhat (warp sums); pass 2:
// dx = dresidual + (dnorm - mean(dnorm) - xhat * mean(dnorm*xhat)) * rstd. Each element is read
// and written by the same lane after pass 1 ends, so dx may alias dresidual.
template <class T>
__global__ void layernorm_backward_input_kernel(T* dx, const T* dout, const T* x, const float* mean, const float* rstd,
                                                const T* gamma, const T* dresidual, int N, int C) {
  const int lane = threadIdx.x % 32;
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(N)) return;
  const std::size_t base = row * C;
  const float m = mean[row], r = rstd[row];
  float a = 0.0f, b = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float xhat = (to_float(x[base + c]) - m) * r;
    const float dn = to_float(dout[base + c]) * to_float(gamma[c]);
    a += dn;
    b += dn * xhat;
  }
  const float dn_mean = warp_sum(a) / static_cast<float>(C);
  const float dn_xhat_mean = warp_sum(b) / static_cast<float>(C);
  for (int c = lane; c < C; c += 32) {
    const float xhat = (to_float(x[base + c]) - m) * r;
    const float dn = to_float(dout[base + c]) * to_float(gamma[c]);
    float v = (dn - dn_mean - xhat * dn_xhat_mean) * r;
    if (dresidual) v = to_float(dresidual[base + c]) + v;
    dx[base + c] = from_float<T>(v);
  }
}

// Column sums over N rows, for dgamma/dbeta (kWithNorm: dout*xhat and dout) or a bias gradient
// (dout only). Block of 32 x 32 threads per tile of 32 columns: threadIdx.x is the column (a warp
// reads 32 adjacent elements of one row), threadIdx.y the row lane, which sums rows y, y+32, ...
// in order; then thread y = 0 adds the 32 partials in order and adds the total onto the fp32
// gradient. No atomics: deterministic.
constexpr int kColumnTile = 32;

template <class T, bool kWithNorm>
__global__ void __launch_bounds__(kColumnTile* kColumnTile)
    column_reduce_kernel(float* dgamma, float* dbeta, const T* dout, const T* x, const float* mean, const float* rstd,
                         int N, int C) {
  __shared__ float partial_g[kColumnTile][kColumnTile + 1];
  __shared__ float partial_b[kColumnTile][kColumnTile + 1];
  const int c = blockIdx.x * kColumnTile + threadIdx.x;
  float g = 0.0f, b = 0.0f;
  if (c < C) {
    for (int n = threadIdx.y; n < N; n += kColumnTile) {
      const std::size_t i = static_cast<std::size_t>(n) * C + c;
      const float dy = to_float(dout[i]);
      if constexpr (kWithNorm) g += dy * ((to_float(x[i]) - mean[n]) * rstd[n]);
      b += dy;
    }
  }
  partial_g[threadIdx.y][threadIdx.x] = g;
  partial_b[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tg = 0.0f, tb = 0.0f;
    for (int k = 0; k < kColumnTile; ++k) {
      tg += partial_g[k][threadIdx.x];
      tb += partial_b[k][threadIdx.x];
    }
    if constexpr (kWithNorm) dgamma[c] += tg;
    dbeta[c] += tb;
  }
}

// ---------------------------------------------------------------------------------------
// Causal softmax: one warp per row of a (BH, seq, seq) stack; row r is query i = r mod seq and
// covers keys j <= i. Lane k handles j = k, k+32, ... in every pass, so each element is read and
// written by one lane and the output may alias the input.
// ---------------------------------------------------------------------------------------

// Max (ignoring NaN, as fmaxf does), sum of exp(scale*s - max) with expf, 1/sum once, then
// p = exp(scale*s - max) * (1/sum) for j <= i and exactly 0 above the diagonal.
template <class T>
__global__ void causal_softmax_forward_kernel(T* probs, const T* scores, std::size_t rows, int seq, float scale) {
  const int lane = threadIdx.x % 32;
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int len = static_cast<int>(row % seq) + 1;
  const T* s = scores + row * seq;
  T* p = probs + row * seq;
  float mx = -INFINITY;
  for (int j = lane; j < len; j += 32) mx = fmaxf(mx, scale * to_float(s[j]));
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int j = lane; j < len; j += 32) sum += expf(scale * to_float(s[j]) - mx);
  const float inv = 1.0f / warp_sum(sum);
  for (int j = lane; j < seq; j += 32) p[j] = from_float<T>(j < len ? expf(scale * to_float(s[j]) - mx) * inv : 0.0f);
}

// dot = sum_{j<=i} p*dp (warp sum), then ds = p * (dp - dot) * scale for j <= i, 0 above.
template <class T>
__global__ void causal_softmax_backward_kernel(T* dscores, const T* probs, const T* dprobs, std::size_t rows, int seq,
                                               float scale) {
  const int lane = threadIdx.x % 32;
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int len = static_cast<int>(row % seq) + 1;
  const T* p = probs + row * seq;
  const T* dp = dprobs + row * seq;
  T* ds = dscores + row * seq;
  float dot = 0.0f;
  for (int j = lane; j < len; j += 32) dot += to_float(p[j]) * to_float(dp[j]);
  dot = warp_sum(dot);
  for (int j = lane; j < seq; j += 32)
    ds[j] = from_float<T>(j < len ? to_float(p[j]) * (to_float(dp[j]) - dot) * scale : 0.0f);
}

// ---------------------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------------------
constexpr int kRowThreads = 256;  // block-per-row kernels

// A block's reductions over one row of V logits: its maximum, and the sum of exp(l - mx) (strided
// per thread, then warp butterflies and the 8 warp partials in order). Every thread gets the result.
template <class T>
__device__ float row_max(const T* l, int V, float* shared) {
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, to_float(l[j]));
  return block_max(mx, shared);
}
template <class T>
__device__ float row_exp_sum(const T* l, int V, float mx, float* shared) {
  float s = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_float(l[j]) - mx);
  return block_sum(s, shared);
}

// One block of 256 threads per row of V logits: block max, block sum of exp(l - max), lse = max +
// log(sum).
template <class T>
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const T* logits, const std::int32_t* targets,
                                             int V) {
  __shared__ float shared[32];
  const std::size_t n = blockIdx.x;
  const T* l = logits + n * V;
  const float mx = row_max(l, V, shared);
  const float s = row_exp_sum(l, V, mx, shared);
  if (threadIdx.x == 0) {
    const float z = mx + logf(s);
    lse[n] = z;
    const std::int32_t t = targets[n];
    losses[n] = (t >= 0 && t < V) ? z - to_float(l[t]) : NAN;
  }
}

// Grid-stride, one thread per logit: d = exp(l - lse) * scale, minus scale at the target.
template <class T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const float* lse,
                                              const std::int32_t* targets, int V, std::size_t total, float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t n = i / V;
    const int j = static_cast<int>(i % V);
    float d = expf(to_float(logits[i]) - lse[n]) * scale;
    if (j == targets[n]) d -= scale;
    dlogits[i] = from_float<T>(d);
  }
}

// Vocabulary-parallel cross-entropy: one block of 256 threads per row of the shard's Vl logits,
// the reductions of cross_entropy_forward_kernel.
template <class T>
__global__ void cross_entropy_shard_max_kernel(float* rowmax, const T* logits, int Vl) {
  __shared__ float shared[32];
  const float mx = row_max(logits + static_cast<std::size_t>(blockIdx.x) * Vl, Vl, shared);
  if (threadIdx.x == 0) rowmax[blockIdx.x] = mx;
}

template <class T>
__global__ void cross_entropy_shard_sums_kernel(float* sums, const T* logits, const float* rowmax,
                                                const std::int32_t* local_targets, int N, int Vl) {
  __shared__ float shared[32];
  const std::size_t n = blockIdx.x;
  const T* l = logits + n * Vl;
  const float s = row_exp_sum(l, Vl, rowmax[n], shared);
  if (threadIdx.x == 0) {
    sums[n] = s;
    const std::int32_t t = local_targets[n];
    sums[static_cast<std::size_t>(N) + n] = t >= 0 && t < Vl ? to_float(l[t]) : 0.0f;
  }
}

__global__ void cross_entropy_shard_loss_kernel(float* losses, float* lse, const float* rowmax, const float* sums,
                                                int N) {
  for (int n = blockIdx.x * blockDim.x + threadIdx.x; n < N; n += gridDim.x * blockDim.x) {
    const float z = rowmax[n] + logf(sums[n]);
    lse[n] = z;
    losses[n] = z - sums[N + n];
  }
}

void require_positive(const char* kernel, int a, int b) {
  require(a > 0 && b > 0, kernel, "dimensions must be positive, got " + std::to_string(a) + " x " + std::to_string(b));
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------
void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const void* gamma, const void* beta, int N,
                       int C, DType dt, StreamHandle stream) {
  const char* name = "layernorm_forward";
  require_positive(name, N, C);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    layernorm_forward_kernel<S><<<row_blocks(N), kWarpRowThreads, 0, stream>>>(
        static_cast<S*>(out), mean, rstd, static_cast<const S*>(x), static_cast<const S*>(gamma),
        static_cast<const S*>(beta), N, C);
  });
  check_launch(name);
}

void layernorm_backward_input(void* dx, const void* dout, const void* x, const float* mean, const float* rstd,
                              const void* gamma, const void* dresidual, int N, int C, DType dt, StreamHandle stream) {
  const char* name = "layernorm_backward_input";
  require_positive(name, N, C);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    layernorm_backward_input_kernel<S><<<row_blocks(N), kWarpRowThreads, 0, stream>>>(
        static_cast<S*>(dx), static_cast<const S*>(dout), static_cast<const S*>(x), mean, rstd,
        static_cast<const S*>(gamma), static_cast<const S*>(dresidual), N, C);
  });
  check_launch(name);
}

void layernorm_backward_weight(float* dgamma, float* dbeta, const void* dout, const void* x, const float* mean,
                               const float* rstd, int N, int C, DType dt, StreamHandle stream) {
  const char* name = "layernorm_backward_weight";
  require_positive(name, N, C);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const unsigned tiles = static_cast<unsigned>((C + kColumnTile - 1) / kColumnTile);
    column_reduce_kernel<S, true><<<tiles, dim3(kColumnTile, kColumnTile), 0, stream>>>(
        dgamma, dbeta, static_cast<const S*>(dout), static_cast<const S*>(x), mean, rstd, N, C);
  });
  check_launch(name);
}

void bias_backward(float* db, const void* dy, int N, int OC, DType dt, StreamHandle stream) {
  const char* name = "bias_backward";
  require_positive(name, N, OC);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const unsigned tiles = static_cast<unsigned>((OC + kColumnTile - 1) / kColumnTile);
    column_reduce_kernel<S, false><<<tiles, dim3(kColumnTile, kColumnTile), 0, stream>>>(
        nullptr, db, static_cast<const S*>(dy), nullptr, nullptr, nullptr, N, OC);
  });
  check_launch(name);
}

void causal_softmax_forward(void* probs, const void* scores, int BH, int T, float scale, DType dt, StreamHandle stream) {
  const char* name = "causal_softmax_forward";
  require_positive(name, BH, T);
  const std::size_t rows = static_cast<std::size_t>(BH) * T;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    causal_softmax_forward_kernel<S><<<row_blocks(rows), kWarpRowThreads, 0, stream>>>(
        static_cast<S*>(probs), static_cast<const S*>(scores), rows, T, scale);
  });
  check_launch(name);
}

void causal_softmax_backward(void* dscores, const void* probs, const void* dprobs, int BH, int T, float scale, DType dt,
                             StreamHandle stream) {
  const char* name = "causal_softmax_backward";
  require_positive(name, BH, T);
  const std::size_t rows = static_cast<std::size_t>(BH) * T;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    causal_softmax_backward_kernel<S><<<row_blocks(rows), kWarpRowThreads, 0, stream>>>(
        static_cast<S*>(dscores), static_cast<const S*>(probs), static_cast<const S*>(dprobs), rows, T, scale);
  });
  check_launch(name);
}

void cross_entropy_forward(float* losses, float* lse, const void* logits, const std::int32_t* targets, int N, int V,
                           DType dt, StreamHandle stream) {
  const char* name = "cross_entropy_forward";
  require_positive(name, N, V);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    cross_entropy_forward_kernel<S><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
        losses, lse, static_cast<const S*>(logits), targets, V);
  });
  check_launch(name);
}

void cross_entropy_backward(void* dlogits, const void* logits, const float* lse, const std::int32_t* targets, int N,
                            int V, float scale, DType dt, StreamHandle stream) {
  const char* name = "cross_entropy_backward";
  require_positive(name, N, V);
  const std::size_t total = static_cast<std::size_t>(N) * V;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    cross_entropy_backward_kernel<S><<<elementwise_blocks(total), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(dlogits), static_cast<const S*>(logits), lse, targets, V, total, scale);
  });
  check_launch(name);
}

void cross_entropy_shard_max(float* rowmax, const void* logits, int N, int Vl, DType dt, StreamHandle stream) {
  const char* name = "cross_entropy_shard_max";
  require_positive(name, N, Vl);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    cross_entropy_shard_max_kernel<S><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
        rowmax, static_cast<const S*>(logits), Vl);
  });
  check_launch(name);
}

void cross_entropy_shard_sums(float* sums, const void* logits, const float* rowmax, const std::int32_t* local_targets,
                              int N, int Vl, DType dt, StreamHandle stream) {
  const char* name = "cross_entropy_shard_sums";
  require_positive(name, N, Vl);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    cross_entropy_shard_sums_kernel<S><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
        sums, static_cast<const S*>(logits), rowmax, local_targets, N, Vl);
  });
  check_launch(name);
}

void cross_entropy_shard_loss(float* losses, float* lse, const float* rowmax, const float* sums, int N,
                              StreamHandle stream) {
  const char* name = "cross_entropy_shard_loss";
  require_positive(name, N, 1);
  cross_entropy_shard_loss_kernel<<<elementwise_blocks(static_cast<std::size_t>(N)), kElementwiseThreads, 0, stream>>>(
      losses, lse, rowmax, sums, N);
  check_launch(name);
}

}  // namespace trainsim::cuda
