// Elementwise kernels and the embedding: embedding forward/backward, GELU forward/backward,
// residual add, gradient accumulation and format casts. CPU references: runtime/model/layers.h
// and runtime/numerics/lowp.h; tests: tests/kernels/test_kernels.cpp.
#include <cmath>
#include <initializer_list>

#include "kernels/common.cuh"
#include "kernels/kernels.h"

namespace trainsim::cuda {

using namespace detail;

namespace {

// ---------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------

// Grid-stride, one thread per output element of (N, C). out = wte[token] + wpe[t]: one fp32 add
// rounded once to T, the same operations as the CPU's float add then round_to(dt), so the result
// is bit-identical to it. A token outside [0, V) writes NaN.
template <class T>
__global__ void embedding_forward_kernel(T* out, const std::int32_t* tokens, const T* wte, const T* wpe, int seq, int C,
                                         int V, std::size_t total) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t n = i / C, c = i % C;
    const int t = static_cast<int>(n % seq);
    const std::int32_t tok = tokens[n];
    if (tok < 0 || tok >= V) {
      out[i] = from_float<T>(NAN);
      continue;
    }
    out[i] = from_float<T>(to_float(wte[static_cast<std::size_t>(tok) * C + c]) +
                           to_float(wpe[static_cast<std::size_t>(t) * C + c]));
  }
}

// dwpe: one thread per (t, c); adds dout[b, t, c] for b = 0, 1, ... in order onto the existing
// value, the order of the CPU loop, so the fp32 result is bit-identical.
template <class T>
__global__ void embedding_backward_wpe_kernel(float* dwpe, const T* dout, int B, int seq, int C) {
  const std::size_t total = static_cast<std::size_t>(seq) * C;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float acc = dwpe[i];
    for (int b = 0; b < B; ++b) acc += to_float(dout[static_cast<std::size_t>(b) * total + i]);
    dwpe[i] = acc;
  }
}

// dwte: one block per vocabulary row v (kEmbedThreads threads). The block walks the tokens in
// chunks of blockDim, compacts the rows n with tokens[n] == v into shared memory in increasing n
// (ballot + prefix counts: an ordered, deterministic compaction), then adds those dout rows to
// dwte[v] in that order; thread k owns columns k, k + blockDim, ... of row v, and no other block
// touches row v. Each element therefore receives its terms in the CPU's (b, t) order: the fp32
// result is bit-identical. Cost: every block reads all N tokens (V*N reads, from L2); fine at the
// runtime's vocabulary, and a sorted-bucket version is the optimisation for V*N in the 1e8s.
constexpr int kEmbedThreads = 256;

template <class T>
__global__ void embedding_backward_wte_kernel(float* dwte, const T* dout, const std::int32_t* tokens, int N, int C) {
  __shared__ int rows[kEmbedThreads];
  __shared__ int warp_counts[kEmbedThreads / 32];
  const int v = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* dst = dwte + static_cast<std::size_t>(v) * C;
  for (int base = 0; base < N; base += kEmbedThreads) {  // uniform trip count: every thread ballots
    const int n = base + static_cast<int>(threadIdx.x);
    const bool match = n < N && tokens[n] == v;
    const unsigned ballot = __ballot_sync(kFullMask, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kEmbedThreads / 32; ++w) {
      if (w < warp) before += warp_counts[w];
      total += warp_counts[w];
    }
    if (match) rows[before + __popc(ballot & ((1u << lane) - 1u))] = n;
    __syncthreads();
    for (int k = 0; k < total; ++k) {
      const T* src = dout + static_cast<std::size_t>(rows[k]) * C;
      for (int c = threadIdx.x; c < C; c += kEmbedThreads) dst[c] += to_float(src[c]);
    }
    __syncthreads();  // rows[] and warp_counts[] are rewritten by the next chunk
  }
}

// Tensor parallelism. Grid-stride, one thread per output element.
template <class T>
__global__ void embedding_shard_forward_kernel(T* out, const std::int32_t* local_tokens, const T* wte, int C, int Vl,
                                               std::size_t total) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t n = i / C, c = i % C;
    const std::int32_t tok = local_tokens[n];
    out[i] = tok >= 0 && tok < Vl ? wte[static_cast<std::size_t>(tok) * C + c] : from_float<T>(0.0f);
  }
}

template <class T>
__global__ void add_position_embedding_kernel(T* out, const T* wpe, std::size_t row0, int seq, int C, std::size_t total) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t n = i / C, c = i % C;
    const std::size_t t = (row0 + n) % static_cast<std::size_t>(seq);
    out[i] = from_float<T>(to_float(out[i]) + to_float(wpe[t * C + c]));
  }
}

template <class T>
__global__ void add_bias_kernel(T* y, const T* b, int OC, std::size_t total) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    y[i] = from_float<T>(to_float(y[i]) + to_float(b[i % OC]));
}

// ---------------------------------------------------------------------------------------
// GELU (tanh approximation), with layers.h's constants and order of operations; fp32 inside.
// ---------------------------------------------------------------------------------------
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

// Grid-stride, one thread per element. y = 0.5 x (1 + tanh(s (x + c x^3))).
template <class T>
__global__ void gelu_forward_kernel(T* y, const T* x, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float v = to_float(x[i]);
    y[i] = from_float<T>(0.5f * v * (1.0f + tanhf(kGeluScale * (v + kGeluCubic * (v * v * v)))));
  }
}

// Grid-stride, one thread per element; tanh evaluated once per element as on the CPU.
// dx = dy (0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 c x^2)). dx may alias dy.
template <class T>
__global__ void gelu_backward_kernel(T* dx, const T* x, const T* dy, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float v = to_float(x[i]);
    const float th = tanhf(kGeluScale * (v + kGeluCubic * (v * v * v)));
    const float d = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
    dx[i] = from_float<T>(to_float(dy[i]) * d);
  }
}

// ---------------------------------------------------------------------------------------
// Residual add, accumulation, casts: one fp32 operation (or none) and one rounding, as the CPU
// does them, so results are bit-identical to the CPU's.
// ---------------------------------------------------------------------------------------
template <class T>
__global__ void residual_add_kernel(T* out, const T* a, const T* b, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

template <class A, class X>
__global__ void accumulate_kernel(A* acc, const X* x, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    acc[i] = from_float<A>(to_float(acc[i]) + to_float(x[i]));
}

// fp16 <-> bf16 go through fp32, which holds both exactly: one rounding in all.
template <class D, class S>
__global__ void cast_kernel(D* dst, const S* src, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = from_float<D>(to_float(src[i]));
}

void require_dims(const char* kernel, std::initializer_list<long long> dims) {
  for (long long d : dims) require(d > 0, kernel, "every dimension must be positive");
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------
void embedding_forward(void* out, const std::int32_t* tokens, const void* wte, const void* wpe, int B, int T, int C,
                       int V, DType dt, StreamHandle stream) {
  const char* name = "embedding_forward";
  require_dims(name, {B, T, C, V});
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const std::size_t total = static_cast<std::size_t>(B) * T * C;
    embedding_forward_kernel<S><<<elementwise_blocks(total), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), tokens, static_cast<const S*>(wte), static_cast<const S*>(wpe), T, C, V, total);
  });
  check_launch(name);
}

void embedding_backward(float* dwte, float* dwpe, const void* dout, const std::int32_t* tokens, int B, int T, int C,
                        int V, DType dt, StreamHandle stream) {
  const char* name = "embedding_backward";
  require_dims(name, {B, T, C, V});
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* d = static_cast<const S*>(dout);
    embedding_backward_wpe_kernel<S>
        <<<elementwise_blocks(static_cast<std::size_t>(T) * C), kElementwiseThreads, 0, stream>>>(dwpe, d, B,
                                                                                                             T, C);
    check_launch("embedding_backward (wpe)");
    embedding_backward_wte_kernel<S><<<V, kEmbedThreads, 0, stream>>>(dwte, d, tokens, B * T, C);
    check_launch("embedding_backward (wte)");
  });
}

void embedding_shard_forward(void* out, const std::int32_t* local_tokens, const void* wte_shard, int N, int C, int Vl,
                             DType dt, StreamHandle stream) {
  const char* name = "embedding_shard_forward";
  require_dims(name, {N, C, Vl});
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const std::size_t total = static_cast<std::size_t>(N) * C;
    embedding_shard_forward_kernel<S><<<elementwise_blocks(total), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), local_tokens, static_cast<const S*>(wte_shard), C, Vl, total);
  });
  check_launch(name);
}

void add_position_embedding(void* out, const void* wpe, std::size_t row0, std::size_t rows, int T, int C, DType dt,
                            StreamHandle stream) {
  const char* name = "add_position_embedding";
  require_dims(name, {T, C});
  const std::size_t total = rows * static_cast<std::size_t>(C);
  if (total == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    add_position_embedding_kernel<S><<<elementwise_blocks(total), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), static_cast<const S*>(wpe), row0, T, C, total);
  });
  check_launch(name);
}

void add_bias(void* y, const void* b, std::size_t N, int OC, DType dt, StreamHandle stream) {
  const char* name = "add_bias";
  require_dims(name, {OC});
  const std::size_t total = N * static_cast<std::size_t>(OC);
  if (total == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    add_bias_kernel<S><<<elementwise_blocks(total), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(y), static_cast<const S*>(b), OC, total);
  });
  check_launch(name);
}

void gelu_forward(void* y, const void* x, std::size_t n, DType dt, StreamHandle stream) {
  const char* name = "gelu_forward";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    gelu_forward_kernel<S><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(y), static_cast<const S*>(x), n);
  });
  check_launch(name);
}

void gelu_backward(void* dx, const void* x, const void* dy, std::size_t n, DType dt, StreamHandle stream) {
  const char* name = "gelu_backward";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    gelu_backward_kernel<S><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(dx), static_cast<const S*>(x), static_cast<const S*>(dy), n);
  });
  check_launch(name);
}

void residual_add(void* out, const void* a, const void* b, std::size_t n, DType dt, StreamHandle stream) {
  const char* name = "residual_add";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    residual_add_kernel<S><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), static_cast<const S*>(a), static_cast<const S*>(b), n);
  });
  check_launch(name);
}

void accumulate(void* acc, DType acc_dt, const void* x, DType x_dt, std::size_t n, StreamHandle stream) {
  const char* name = "accumulate";
  if (n == 0) return;
  dispatch(acc_dt, name, [&](auto acc_tag) {
    using A = typename decltype(acc_tag)::type;
    dispatch(x_dt, name, [&](auto x_tag) {
      using X = typename decltype(x_tag)::type;
      accumulate_kernel<A, X><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
          static_cast<A*>(acc), static_cast<const X*>(x), n);
    });
  });
  check_launch(name);
}

void cast(void* dst, DType dst_dt, const void* src, DType src_dt, std::size_t n, StreamHandle stream) {
  const char* name = "cast";
  if (n == 0) return;
  dispatch(dst_dt, name, [&](auto dst_tag) {
    using D = typename decltype(dst_tag)::type;
    dispatch(src_dt, name, [&](auto src_tag) {
      using S = typename decltype(src_tag)::type;
      cast_kernel<D, S><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
          static_cast<D*>(dst), static_cast<const S*>(src), n);
    });
  });
  check_launch(name);
}

}  // namespace trainsim::cuda
