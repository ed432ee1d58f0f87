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

// A lane's share of a row of `len` elements: packs lane, lane + 32, ... (16-byte accesses) when
// packed, else elements lane, lane + 32, .... f(c, v) sees an element's column c and its values
// v[0..3] in the input rows r[0..3] of one format (0 where a row is null), and returns the
// element's output, stored to `out` when it is not null. Each element is read and written by one
// lane, so `out` may alias an input row. A row kernel is packed where the row length is a multiple
// of kPack and every row pointer is aligned.
template <class T, class F>
__device__ __forceinline__ void lane_map(T* out, int len, bool packed, const T* const (&r)[4], F&& f) {
  const int lane = threadIdx.x % 32;
  if (packed) {
    for (int c = lane * kPack; c < len; c += 32 * kPack) {
      float v[4][kPack] = {};
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (r[q]) load_pack(v[q], r[q] + c);
      float y[kPack];
#pragma unroll
      for (int k = 0; k < kPack; ++k) y[k] = f(c + k, v[0][k], v[1][k], v[2][k], v[3][k]);
      if (out) store_pack(out + c, y);
    }
  } else {
    for (int c = lane; c < len; c += 32) {
      float v[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) v[q] = r[q] ? to_float(r[q][c]) : 0.0f;
      const float y = f(c, v[0], v[1], v[2], v[3]);
      if (out) out[c] = from_float<T>(y);
    }
  }
}

// ---------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------

// One warp per row (8 rows per 256-thread block); each lane its share of the columns (lane_map).
// Two passes over the row as layers.h: mean = sum/C, then var = sum((x - mean)^2)/C (no
// E[x^2] - mean^2 cancellation), rstd = 1/sqrt(var + 1e-5f) with IEEE sqrt and division.
// Sums: per-lane sequential, then a 32-lane butterfly; fp32.
template <class T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* x, const T* gamma, const T* beta,
                                         int N, int C, bool packed) {
  const int lane = threadIdx.x % 32;
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(N)) return;  // the whole warp leaves together
  const T* const xr[4] = {x + row * C, gamma, beta, nullptr};
  float s = 0.0f;
  lane_map<T>(nullptr, C, packed, {xr[0], nullptr, nullptr, nullptr}, [&](int, float v, float, float, float) {
    s += v;
    return 0.0f;
  });
  const float m = warp_sum(s) / static_cast<float>(C);
  float s2 = 0.0f;
  lane_map<T>(nullptr, C, packed, {xr[0], nullptr, nullptr, nullptr}, [&](int, float v, float, float, float) {
    s2 += (v - m) * (v - m);
    return 0.0f;
  });
  const float var = warp_sum(s2) / static_cast<float>(C);
  const float r = 1.0f / sqrtf(var + 1e-5f);
  lane_map(out + row * C, C, packed, xr, [&](int, float v, float g, float b, float) { return (v - m) * r * g + b; });
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
                                                const T* gamma, const T* dresidual, int N, int C, bool packed) {
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(N)) return;
  const std::size_t base = row * C;
  const float m = mean[row], r = rstd[row];
  const T* const rows[4] = {x + base, dout + base, gamma, dresidual ? dresidual + base : nullptr};
  float a = 0.0f, b = 0.0f;
  lane_map<T>(nullptr, C, packed, {rows[0], rows[1], rows[2], nullptr}, [&](int, float xv, float dy, float g, float) {
    const float xhat = (xv - m) * r;
    const float dn = dy * g;
    a += dn;
    b += dn * xhat;
    return 0.0f;
  });
  const float dn_mean = warp_sum(a) / static_cast<float>(C);
  const float dn_xhat_mean = warp_sum(b) / static_cast<float>(C);
  lane_map(dx + base, C, packed, rows, [&](int, float xv, float dy, float g, float dres) {
    const float xhat = (xv - m) * r;
    const float dn = dy * g;
    const float v = (dn - dn_mean - xhat * dn_xhat_mean) * r;
    return dresidual ? dres + v : v;
  });
}

// Rows of up to kCachedColumns, packed: the same two kernels with the lane's share of the row
// held in registers (read from memory once, all its loads in flight together) instead of read
// again for every pass. The same elements in the same order as lane_map, so the same bits.
constexpr int kCachedPacks = 4;  // per lane
constexpr int kCachedColumns = 32 * kPack * kCachedPacks;

// f(q, c) for each of the lane's packs q present in a row of C columns (c its first column).
template <class F>
__device__ __forceinline__ void for_lane_packs(int C, F&& f) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int q = 0; q < kCachedPacks; ++q) {
    const int c = (lane + 32 * q) * kPack;
    if (c < C) f(q, c);
  }
}

template <class T>
__device__ __forceinline__ void load_lane_row(float (&v)[kCachedPacks][kPack], const T* row, int C) {
  for_lane_packs(C, [&](int q, int c) { load_pack(v[q], row + c); });
}

template <class T>
__global__ void layernorm_forward_cached_kernel(T* out, float* mean, float* rstd, const T* x, const T* gamma,
                                                const T* beta, int N, int C) {
  const int lane = threadIdx.x % 32;
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(N)) return;
  float v[kCachedPacks][kPack];
  load_lane_row(v, x + row * C, C);
  float s = 0.0f;
  for_lane_packs(C, [&](int q, int) {
#pragma unroll
    for (int k = 0; k < kPack; ++k) s += v[q][k];
  });
  const float m = warp_sum(s) / static_cast<float>(C);
  float s2 = 0.0f;
  for_lane_packs(C, [&](int q, int) {
#pragma unroll
    for (int k = 0; k < kPack; ++k) s2 += (v[q][k] - m) * (v[q][k] - m);
  });
  const float var = warp_sum(s2) / static_cast<float>(C);
  const float r = 1.0f / sqrtf(var + 1e-5f);
  T* yr = out + row * C;
  for_lane_packs(C, [&](int q, int c) {
    float g[kPack], b[kPack], y[kPack];
    load_pack(g, gamma + c);
    load_pack(b, beta + c);
#pragma unroll
    for (int k = 0; k < kPack; ++k) y[k] = (v[q][k] - m) * r * g[k] + b[k];
    store_pack(yr + c, y);
  });
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

template <class T>
__global__ void layernorm_backward_input_cached_kernel(T* dx, const T* dout, const T* x, const float* mean,
                                                       const float* rstd, const T* gamma, const T* dresidual, int N,
                                                       int C) {
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(N)) return;
  const std::size_t base = row * C;
  const float m = mean[row], r = rstd[row];
  float xv[kCachedPacks][kPack], dy[kCachedPacks][kPack];
  load_lane_row(xv, x + base, C);
  load_lane_row(dy, dout + base, C);
  float a = 0.0f, b = 0.0f;
  for_lane_packs(C, [&](int q, int c) {
    float g[kPack];
    load_pack(g, gamma + c);
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float xhat = (xv[q][k] - m) * r;
      const float dn = dy[q][k] * g[k];
      a += dn;
      b += dn * xhat;
    }
  });
  const float dn_mean = warp_sum(a) / static_cast<float>(C);
  const float dn_xhat_mean = warp_sum(b) / static_cast<float>(C);
  for_lane_packs(C, [&](int q, int c) {
    float g[kPack], res[kPack] = {}, out[kPack];
    load_pack(g, gamma + c);
    if (dresidual) load_pack(res, dresidual + base + c);
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float xhat = (xv[q][k] - m) * r;
      const float dn = dy[q][k] * g[k];
      const float v = (dn - dn_mean - xhat * dn_xhat_mean) * r;
      out[k] = dresidual ? res[k] + v : v;
    }
    store_pack(dx + base + c, out);
  });
}

// Column sums over N rows, for dgamma/dbeta (kWithNorm: dout*xhat and dout) or a bias gradient
// (dout only), in two launches (column_reduce; packed rows: column_chunk_packed_kernel below).
// (1) A block of 32 x 32 threads per tile of 32 columns and chunk of kColumnRows rows:
// threadIdx.x is the column (a warp reads 32 adjacent elements of one row), threadIdx.y the row
// lane, which sums rows y, y+32, ... of the chunk in order; thread y = 0 adds the 32 partials in
// order and writes the chunk's column total. (2) column_total_kernel adds the chunks' totals onto
// the fp32 gradient in a fixed order. Chunks give the GPU enough blocks (a
// GPT-2 layer's 768 columns are 24 tiles) and their number depends on N alone; no atomics, so the
// result is deterministic.
constexpr int kColumnTile = 32;
constexpr int kColumnRows = 128;

template <class T, bool kWithNorm>
__global__ void __launch_bounds__(kColumnTile* kColumnTile)
    column_chunk_kernel(float* chunk_g, float* chunk_b, const T* dout, const T* x, const float* mean, const float* rstd,
                        int N, int C) {
  __shared__ float partial_g[kColumnTile][kColumnTile + 1];
  __shared__ float partial_b[kColumnTile][kColumnTile + 1];
  const int c = blockIdx.x * kColumnTile + threadIdx.x;
  const int row0 = blockIdx.y * kColumnRows, row1 = min(N, row0 + kColumnRows);
  float g = 0.0f, b = 0.0f;
  if (c < C) {
    for (int n = row0 + threadIdx.y; n < row1; n += kColumnTile) {
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
    const std::size_t o = static_cast<std::size_t>(blockIdx.y) * C + c;
    if constexpr (kWithNorm) chunk_g[o] = tg;
    chunk_b[o] = tb;
  }
}

// Packed (C a multiple of kPack, rows aligned): a block of 32 x kPackedRowLanes threads covers
// 32 packs (256 columns) and a chunk of kPackedColumnRows rows; thread (x, y) sums rows y, y +
// kPackedRowLanes, ... of the chunk in order for the 8 columns of its pack (16-byte loads, where
// the one-column kernel's warp reads 32 two-byte values of a row), kRowsInFlight rows' loads
// issued before any is added; then one thread per column adds the kPackedRowLanes partials in
// order. Chunks of 256 rows keep the chunks' totals few (32 at 8192 rows), so the second launch
// reads little (on the H100, 128 totals a column read one after another by C threads cost more
// than the first launch's whole pass over the rows).
constexpr int kPackedRowLanes = 16;
constexpr int kPackedColumnRows = 256;
constexpr int kRowsInFlight = 4;
static_assert(kPackedColumnRows % (kPackedRowLanes * kRowsInFlight) == 0);

template <class T, bool kWithNorm>
__global__ void __launch_bounds__(32 * kPackedRowLanes)
    column_chunk_packed_kernel(float* chunk_g, float* chunk_b, const T* dout, const T* x, const float* mean,
                               const float* rstd, int N, int C) {
  __shared__ float partial_g[kPackedRowLanes][kPack][32];  // [row lane][column in pack][pack]
  __shared__ float partial_b[kPackedRowLanes][kPack][32];
  const int c0 = (blockIdx.x * 32 + threadIdx.x) * kPack;
  const int row0 = blockIdx.y * kPackedColumnRows, row1 = min(N, row0 + kPackedColumnRows);
  float g[kPack] = {}, b[kPack] = {};
  if (c0 < C) {
    for (int base = row0 + threadIdx.y; base < row1; base += kPackedRowLanes * kRowsInFlight) {
      float dy[kRowsInFlight][kPack] = {}, xv[kRowsInFlight][kPack] = {};
      float m[kRowsInFlight] = {}, r[kRowsInFlight] = {};
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j) {
        const int n = base + j * kPackedRowLanes;
        if (n >= row1) continue;
        const std::size_t i = static_cast<std::size_t>(n) * C + c0;
        load_pack(dy[j], dout + i);
        if constexpr (kWithNorm) {
          load_pack(xv[j], x + i);
          m[j] = mean[n];
          r[j] = rstd[n];
        }
      }
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j) {
        if (base + j * kPackedRowLanes >= row1) continue;  // rows in order: a missing row ends the chunk
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          if constexpr (kWithNorm) g[k] += dy[j][k] * ((xv[j][k] - m[j]) * r[j]);
          b[k] += dy[j][k];
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPack; ++k) {
    partial_g[threadIdx.y][k][threadIdx.x] = g[k];
    partial_b[threadIdx.y][k][threadIdx.x] = b[k];
  }
  __syncthreads();
  const int t = threadIdx.y * 32 + threadIdx.x;  // 0 .. 32 * kPackedRowLanes - 1
  if (t >= 32 * kPack) return;
  const int pack = t % 32, k = t / 32;  // consecutive threads read consecutive shared words
  const int c = (blockIdx.x * 32 + pack) * kPack + k;
  if (c >= C) return;
  float tg = 0.0f, tb = 0.0f;
  for (int y = 0; y < kPackedRowLanes; ++y) {
    tg += partial_g[y][k][pack];
    tb += partial_b[y][k][pack];
  }
  const std::size_t o = static_cast<std::size_t>(blockIdx.y) * C + c;
  if constexpr (kWithNorm) chunk_g[o] = tg;
  chunk_b[o] = tb;
}

// The chunks' totals added onto the fp32 gradients: a block of 32 columns x kTotalLanes lanes;
// lane y adds chunks y, y + kTotalLanes, ... in order (their loads issued together), then one
// thread per column adds the lanes' sums in order. Fixed order throughout: deterministic.
constexpr int kTotalLanes = 8;

__global__ void __launch_bounds__(32 * kTotalLanes)
    column_total_kernel(float* dgamma, float* dbeta, const float* chunk_g, const float* chunk_b, int chunks, int C) {
  __shared__ float lane_g[kTotalLanes][32], lane_b[kTotalLanes][32];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float tg = 0.0f, tb = 0.0f;
  if (c < C) {
#pragma unroll 4
    for (int k = threadIdx.y; k < chunks; k += kTotalLanes) {
      if (dgamma) tg += chunk_g[static_cast<std::size_t>(k) * C + c];
      tb += chunk_b[static_cast<std::size_t>(k) * C + c];
    }
  }
  lane_g[threadIdx.y][threadIdx.x] = tg;
  lane_b[threadIdx.y][threadIdx.x] = tb;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float sg = 0.0f, sb = 0.0f;
  for (int y = 0; y < kTotalLanes; ++y) {
    sg += lane_g[y][threadIdx.x];
    sb += lane_b[y][threadIdx.x];
  }
  if (dgamma) dgamma[c] += sg;
  dbeta[c] += sb;
}

// Both launches, the chunks' totals in scratch from the stream-ordered pool.
template <class T, bool kWithNorm>
void column_reduce(const char* name, float* dgamma, float* dbeta, const T* dout, const T* x, const float* mean,
                   const float* rstd, int N, int C, cudaStream_t stream) {
  const bool packed = C % kPack == 0 && aligned16(dout, x);
  const int rows_per_chunk = packed ? kPackedColumnRows : kColumnRows;
  const int chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  const std::size_t per = static_cast<std::size_t>(chunks) * C;
  void* scratch = nullptr;
  check_cuda(cudaMallocAsync(&scratch, (kWithNorm ? 2 : 1) * per * sizeof(float), stream),
             (std::string(name) + ": cudaMallocAsync of its scratch").c_str());
  float* chunk_b = static_cast<float*>(scratch);
  float* chunk_g = kWithNorm ? chunk_b + per : nullptr;
  if (packed) {
    const dim3 grid(static_cast<unsigned>((C / kPack + 31) / 32), static_cast<unsigned>(chunks));
    column_chunk_packed_kernel<T, kWithNorm><<<grid, dim3(32, kPackedRowLanes), 0, stream>>>(chunk_g, chunk_b, dout, x,
                                                                                              mean, rstd, N, C);
  } else {
    const dim3 grid(static_cast<unsigned>((C + kColumnTile - 1) / kColumnTile), static_cast<unsigned>(chunks));
    column_chunk_kernel<T, kWithNorm><<<grid, dim3(kColumnTile, kColumnTile), 0, stream>>>(chunk_g, chunk_b, dout, x,
                                                                                            mean, rstd, N, C);
  }
  check_launch(name);
  column_total_kernel<<<static_cast<unsigned>((C + 31) / 32), dim3(32, kTotalLanes), 0, stream>>>(
      kWithNorm ? dgamma : nullptr, dbeta, chunk_g, chunk_b, chunks, C);
  check_launch(name);
  check_cuda(cudaFreeAsync(scratch, stream), (std::string(name) + ": cudaFreeAsync of its scratch").c_str());
}

// A thread's elements step by step: kStep = kPack loads a whole pack (16-byte accesses), kStep =
// 1 a single element; v[0..kStep) hold the values.
template <int kStep, class T>
__device__ __forceinline__ void load_step(float (&v)[kPack], const T* p) {
  if constexpr (kStep == kPack) {
    load_pack(v, p);
  } else {
    v[0] = to_float(*p);
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

// Rows of up to kCachedColumns keys, packed (T a multiple of kPack, aligned): the same arithmetic
// with a lane's share of the row in registers, read once by 16-byte loads (the forward also keeps
// each exp for the output instead of computing it again). Lane k holds keys 8k..8k+7, 8(k+32)..,
// so its sums run in another order than above's: the same error bound.
template <class T>
__global__ void causal_softmax_forward_cached_kernel(T* probs, const T* scores, std::size_t rows, int seq,
                                                     float scale) {
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int len = static_cast<int>(row % seq) + 1;
  float v[kCachedPacks][kPack];
  load_lane_row(v, scores + row * seq, len);  // the packs that hold keys j <= i
  float mx = -INFINITY;
  for_lane_packs(len, [&](int q, int c) {
#pragma unroll
    for (int k = 0; k < kPack; ++k)
      if (c + k < len) mx = fmaxf(mx, scale * v[q][k]);
  });
  mx = warp_max(mx);
  float sum = 0.0f;
  for_lane_packs(len, [&](int q, int c) {
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      v[q][k] = c + k < len ? expf(scale * v[q][k] - mx) : 0.0f;
      sum += v[q][k];  // + 0 above the diagonal: the same sum
    }
  });
  const float inv = 1.0f / warp_sum(sum);
  T* p = probs + row * seq;
  for_lane_packs(seq, [&](int q, int c) {
    float y[kPack];
#pragma unroll
    for (int k = 0; k < kPack; ++k) y[k] = c + k < len ? v[q][k] * inv : 0.0f;
    store_pack(p + c, y);
  });
}

template <class T>
__global__ void causal_softmax_backward_cached_kernel(T* dscores, const T* probs, const T* dprobs, std::size_t rows,
                                                      int seq, float scale) {
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int len = static_cast<int>(row % seq) + 1;
  float a[kCachedPacks][kPack], b[kCachedPacks][kPack];
  load_lane_row(a, probs + row * seq, len);
  load_lane_row(b, dprobs + row * seq, len);
  float dot = 0.0f;
  for_lane_packs(len, [&](int q, int c) {
#pragma unroll
    for (int k = 0; k < kPack; ++k)
      if (c + k < len) dot += a[q][k] * b[q][k];
  });
  dot = warp_sum(dot);
  T* ds = dscores + row * seq;
  for_lane_packs(seq, [&](int q, int c) {
    float y[kPack];
#pragma unroll
    for (int k = 0; k < kPack; ++k) y[k] = c + k < len ? a[q][k] * (b[q][k] - dot) * scale : 0.0f;
    store_pack(ds + c, y);
  });
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

// A running (max m, sum s of exp(l - m)) merged with another: both sums moved to the larger max.
// Symmetric (the two products are added, and fp addition commutes), so a butterfly leaves every
// lane with the same pair. A max of -inf has an empty sum (nothing to rescale).
struct MaxSum {
  float m = -INFINITY, s = 0.0f;
  __device__ void merge(float m2, float s2) {
    const float nm = fmaxf(m, m2);
    s = (m == -INFINITY ? 0.0f : s * expf(m - nm)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - nm));
    m = nm;
  }
};

// One block of 256 threads per row of V logits, one pass over the row (the online softmax of
// Milakov and Gimelshein): each thread keeps a running MaxSum over its steps (a step's max first,
// then its exps against the new max), then warp butterflies and the 8 warps' pairs in order;
// lse = max + log(sum). A NaN logit makes the sum, so lse and the loss, NaN (fmaxf ignores it).
template <class T, int kStep>
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const T* logits, const std::int32_t* targets,
                                             int V) {
  __shared__ float shared_m[32], shared_s[32];
  const std::size_t n = blockIdx.x;
  const T* l = logits + n * V;
  MaxSum ms;
  for (int j0 = threadIdx.x * kStep; j0 < V; j0 += blockDim.x * kStep) {
    float v[kPack];
    load_step<kStep>(v, l + j0);
    float step_max = v[0];
#pragma unroll
    for (int k = 1; k < kStep; ++k) step_max = fmaxf(step_max, v[k]);
    const float nm = fmaxf(ms.m, step_max);
    float add = 0.0f;
#pragma unroll
    for (int k = 0; k < kStep; ++k) add += expf(v[k] - nm);
    ms.s = (ms.m == -INFINITY ? 0.0f : ms.s * expf(ms.m - nm)) + add;
    ms.m = nm;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset >>= 1)
    ms.merge(__shfl_xor_sync(kFullMask, ms.m, offset), __shfl_xor_sync(kFullMask, ms.s, offset));
  if (lane == 0) {
    shared_m[warp] = ms.m;
    shared_s[warp] = ms.s;
  }
  __syncthreads();
  MaxSum total;
  if (lane < warps) total = MaxSum{shared_m[lane], shared_s[lane]};
  for (int offset = 16; offset > 0; offset >>= 1)
    total.merge(__shfl_xor_sync(kFullMask, total.m, offset), __shfl_xor_sync(kFullMask, total.s, offset));
  const float mx = total.m, s = total.s;
  if (threadIdx.x == 0) {
    const float z = mx + logf(s);
    lse[n] = z;
    const std::int32_t t = targets[n];
    losses[n] = (t >= 0 && t < V) ? z - to_float(l[t]) : NAN;
  }
}

// One thread per pack (or logit; packs within a row: V a multiple of kPack): d = exp(l - lse) *
// scale, minus scale at the target.
template <class T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const float* lse,
                                              const std::int32_t* targets, int V, std::size_t total, float scale,
                                              bool packed) {
  auto grad = [&](float l, std::size_t n, int j) {
    float d = expf(l - lse[n]) * scale;
    if (j == targets[n]) d -= scale;
    return d;
  };
  for_each_element(
      total, packed,
      [&](std::size_t i) {
        const std::size_t n = i / V;
        const int j = static_cast<int>(i % V);
        float v[kPack];
        load_pack(v, logits + i);
#pragma unroll
        for (int k = 0; k < kPack; ++k) v[k] = grad(v[k], n, j + k);
        store_pack(dlogits + i, v);
      },
      [&](std::size_t i) {
        dlogits[i] = from_float<T>(grad(to_float(logits[i]), i / V, static_cast<int>(i % V)));
      });
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
    const bool packed = C % kPack == 0 && aligned16(out, x, gamma, beta);
    if (packed && C <= kCachedColumns)
      layernorm_forward_cached_kernel<S><<<row_blocks(N), kWarpRowThreads, 0, stream>>>(
          static_cast<S*>(out), mean, rstd, static_cast<const S*>(x), static_cast<const S*>(gamma),
          static_cast<const S*>(beta), N, C);
    else
      layernorm_forward_kernel<S><<<row_blocks(N), kWarpRowThreads, 0, stream>>>(
        static_cast<S*>(out), mean, rstd, static_cast<const S*>(x), static_cast<const S*>(gamma),
        static_cast<const S*>(beta), N, C, packed);
  });
  check_launch(name);
}

void layernorm_backward_input(void* dx, const void* dout, const void* x, const float* mean, const float* rstd,
                              const void* gamma, const void* dresidual, int N, int C, DType dt, StreamHandle stream) {
  const char* name = "layernorm_backward_input";
  require_positive(name, N, C);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const bool packed = C % kPack == 0 && aligned16(dx, dout, x, gamma, dresidual);
    if (packed && C <= kCachedColumns)
      layernorm_backward_input_cached_kernel<S><<<row_blocks(N), kWarpRowThreads, 0, stream>>>(
          static_cast<S*>(dx), static_cast<const S*>(dout), static_cast<const S*>(x), mean, rstd,
          static_cast<const S*>(gamma), static_cast<const S*>(dresidual), N, C);
    else
      layernorm_backward_input_kernel<S><<<row_blocks(N), kWarpRowThreads, 0, stream>>>(
        static_cast<S*>(dx), static_cast<const S*>(dout), static_cast<const S*>(x), mean, rstd,
        static_cast<const S*>(gamma), static_cast<const S*>(dresidual), N, C, packed);
  });
  check_launch(name);
}

void layernorm_backward_weight(float* dgamma, float* dbeta, const void* dout, const void* x, const float* mean,
                               const float* rstd, int N, int C, DType dt, StreamHandle stream) {
  const char* name = "layernorm_backward_weight";
  require_positive(name, N, C);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    column_reduce<S, true>(name, dgamma, dbeta, static_cast<const S*>(dout), static_cast<const S*>(x), mean, rstd, N,
                           C, stream);
  });
}

void bias_backward(float* db, const void* dy, int N, int OC, DType dt, StreamHandle stream) {
  const char* name = "bias_backward";
  require_positive(name, N, OC);
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    column_reduce<S, false>(name, nullptr, db, static_cast<const S*>(dy), static_cast<const S*>(nullptr), nullptr,
                            nullptr, N, OC, stream);
  });
}

void causal_softmax_forward(void* probs, const void* scores, int BH, int T, float scale, DType dt, StreamHandle stream) {
  const char* name = "causal_softmax_forward";
  require_positive(name, BH, T);
  const std::size_t rows = static_cast<std::size_t>(BH) * T;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    if (T % kPack == 0 && T <= kCachedColumns && aligned16(probs, scores))
      causal_softmax_forward_cached_kernel<S><<<row_blocks(rows), kWarpRowThreads, 0, stream>>>(
          static_cast<S*>(probs), static_cast<const S*>(scores), rows, T, scale);
    else
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
    if (T % kPack == 0 && T <= kCachedColumns && aligned16(dscores, probs, dprobs))
      causal_softmax_backward_cached_kernel<S><<<row_blocks(rows), kWarpRowThreads, 0, stream>>>(
          static_cast<S*>(dscores), static_cast<const S*>(probs), static_cast<const S*>(dprobs), rows, T, scale);
    else
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
    if (V % kPack == 0 && aligned16(logits))
      cross_entropy_forward_kernel<S, kPack><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
          losses, lse, static_cast<const S*>(logits), targets, V);
    else
      cross_entropy_forward_kernel<S, 1><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
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
    const bool packed = V % kPack == 0 && aligned16(dlogits, logits);
    cross_entropy_backward_kernel<S><<<packed_blocks(total, packed), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(dlogits), static_cast<const S*>(logits), lse, targets, V, total, scale, packed);
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
