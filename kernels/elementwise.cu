// Elementwise kernels and the embedding: embedding forward/backward, GELU forward/backward,
// residual add, gradient accumulation and format casts. CPU references: runtime/model/layers.h
// and runtime/numerics/lowp.h; tests: tests/kernels/test_kernels.cpp.
#include <cub/device/device_radix_sort.cuh>

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

// One thread per pack (or element) of the (N, C) output; a pack never spans two rows (packed
// only when C is a multiple of kPack). out = wte[token] + wpe[t]: one fp32 add rounded once to T,
// the same operations as the CPU's float add then round_to(dt), so the result is bit-identical to
// it. A token outside [0, V) writes NaN.
template <class T>
__global__ void embedding_forward_kernel(T* out, const std::int32_t* tokens, const T* wte, const T* wpe, int seq, int C,
                                         int V, std::size_t total, bool packed) {
  auto row_of = [&](std::size_t i, const T*& e, const T*& p) {
    const std::size_t n = i / C, c = i % C;
    const std::int32_t tok = tokens[n];
    if (tok < 0 || tok >= V) return false;
    e = wte + static_cast<std::size_t>(tok) * C + c;
    p = wpe + (n % seq) * C + c;
    return true;
  };
  for_each_element(
      total, packed,
      [&](std::size_t i) {
        const T *e, *p;
        float v[kPack], w[kPack];
        if (row_of(i, e, p)) {
          load_pack(v, e);
          load_pack(w, p);
#pragma unroll
          for (int k = 0; k < kPack; ++k) v[k] += w[k];
        } else {
#pragma unroll
          for (int k = 0; k < kPack; ++k) v[k] = NAN;
        }
        store_pack(out + i, v);
      },
      [&](std::size_t i) {
        const T *e, *p;
        out[i] = from_float<T>(row_of(i, e, p) ? to_float(*e) + to_float(*p) : NAN);
      });
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

// dwte, in three launches. (1) Each position n = 0..N-1 gets its token as a key, V for a token
// outside [0, V) (it names no row), so the sort needs only the bits of V (16 for GPT-2's 50304,
// not 32). (2) The positions are sorted by key with a stable radix sort (cub::DeviceRadixSort):
// equal tokens keep increasing n. (3) Blocks (i, y), one per sorted position: the block whose
// position starts a run of one in-vocabulary token (its key differs from the one before) adds the
// run's dout rows to dwte[v]'s columns y * kEmbedThreads + threadIdx.x, one column per thread,
// the sum held in a register and written once; every other block returns at once, and no other
// thread touches that element. Each element therefore receives its terms in the CPU's (b, t)
// order: the fp32 result is bit-identical to layers::embedding_backward. Work: N rows of dout read
// once, and N blocks, not V: one per vocabulary row launched 150,000 blocks at GPT-2's shape, most
// of them for rows no token names (155 us on an H100 where the bytes take ~25 us), and cleared
// two V-long arrays of run bounds first.
//
// A run is as long as its token is frequent, and text is skewed (a space is ~1 in 6 bytes of
// the bundled Shakespeare): one row then adds thousands of terms in order. The terms' loads do
// not depend on the sum, so each thread fetches kEmbedLoads of them before adding them in order;
// an earlier version re-read and re-wrote dwte[v] in global memory per term, one dependent round
// trip each, and took 2.4 ms of a 4-layer backward at 8192 tokens x hidden 1024 on an H100's 64-SM
// share (validation/gpu-baselines, pipeline stage 0 against stage 1).
constexpr int kEmbedThreads = 256;
constexpr int kEmbedLoads = 16;

__global__ void embedding_keys_kernel(std::int32_t* keys, std::int32_t* positions, const std::int32_t* tokens, int n,
                                      int V) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const std::int32_t t = tokens[i];
    keys[i] = t >= 0 && t < V ? t : V;
    positions[i] = i;
  }
}

template <class T>
__global__ void embedding_backward_wte_kernel(float* dwte, const T* dout, const std::int32_t* positions,
                                              const std::int32_t* sorted, int N, int C, int V) {
  const int begin = static_cast<int>(blockIdx.x);
  const std::int32_t v = sorted[begin];
  if (v >= V || (begin > 0 && sorted[begin - 1] == v)) return;  // no row, or not the run's first position
  const int c = static_cast<int>(blockIdx.y) * kEmbedThreads + static_cast<int>(threadIdx.x);
  if (c >= C) return;
  int end = begin + 1;
  while (end < N && sorted[end] == v) ++end;  // the same keys for every thread: read once, from cache
  float* dst = dwte + static_cast<std::size_t>(v) * C + c;
  const T* col = dout + c;
  float acc = *dst;
  int k = begin;
  for (; k + kEmbedLoads <= end; k += kEmbedLoads) {
    float term[kEmbedLoads];
#pragma unroll
    for (int i = 0; i < kEmbedLoads; ++i) term[i] = to_float(col[static_cast<std::size_t>(positions[k + i]) * C]);
#pragma unroll
    for (int i = 0; i < kEmbedLoads; ++i) acc += term[i];
  }
  for (; k < end; ++k) acc += to_float(col[static_cast<std::size_t>(positions[k]) * C]);
  *dst = acc;
}

// Tensor parallelism. One thread per pack (or element), packs within a row as above.
template <class T>
__global__ void embedding_shard_forward_kernel(T* out, const std::int32_t* local_tokens, const T* wte, int C, int Vl,
                                               std::size_t total, bool packed) {
  auto row_of = [&](std::size_t i) -> const T* {  // null: a token this shard does not hold
    const std::size_t n = i / C, c = i % C;
    const std::int32_t tok = local_tokens[n];
    return tok >= 0 && tok < Vl ? wte + static_cast<std::size_t>(tok) * C + c : nullptr;
  };
  for_each_element(
      total, packed,
      [&](std::size_t i) {
        float v[kPack] = {};
        if (const T* e = row_of(i)) load_pack(v, e);
        store_pack(out + i, v);
      },
      [&](std::size_t i) {
        const T* e = row_of(i);
        out[i] = e ? *e : from_float<T>(0.0f);
      });
}

// out[i] += row[i mod C] of `table`, whose row is picked by row_of(n), n = i / C: a position
// embedding or a bias. One fp32 add, one rounding.
template <class T, class RowOf>
__device__ __forceinline__ void add_rows(T* out, const T* table, int C, std::size_t total, bool packed, RowOf row_of) {
  for_each_element(
      total, packed,
      [&](std::size_t i) {
        const T* r = table + row_of(i / C) * C + i % C;
        float v[kPack], w[kPack];
        load_pack(v, out + i);
        load_pack(w, r);
#pragma unroll
        for (int k = 0; k < kPack; ++k) v[k] += w[k];
        store_pack(out + i, v);
      },
      [&](std::size_t i) { out[i] = from_float<T>(to_float(out[i]) + to_float(table[row_of(i / C) * C + i % C])); });
}

template <class T>
__global__ void add_position_embedding_kernel(T* out, const T* wpe, std::size_t row0, int seq, int C, std::size_t total,
                                              bool packed) {
  add_rows(out, wpe, C, total, packed, [&](std::size_t n) { return (row0 + n) % static_cast<std::size_t>(seq); });
}

template <class T>
__global__ void add_bias_kernel(T* y, const T* b, int OC, std::size_t total, bool packed) {
  add_rows(y, b, OC, total, packed, [](std::size_t) { return std::size_t(0); });
}

// ---------------------------------------------------------------------------------------
// GELU (tanh approximation), with layers.h's constants and order of operations; fp32 inside.
// ---------------------------------------------------------------------------------------
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

// ---------------------------------------------------------------------------------------
// Elementwise maps: out[i] = f(a[i]) or f(a[i], b[i]) in fp32, rounded once to the output's
// format, by packs where aligned (for_each_element). The output may alias an input: each element
// is read and written by one thread.
// ---------------------------------------------------------------------------------------
template <class O, class A, class F>
__global__ void map_kernel(O* out, const A* a, std::size_t n, bool packed, F f) {
  map_elements(out, a, n, packed, f);
}

template <class O, class A, class B, class F>
__global__ void map_kernel(O* out, const A* a, const B* b, std::size_t n, bool packed, F f) {
  for_each_element(
      n, packed,
      [&](std::size_t i) {
        float v[kPack], w[kPack];
        load_pack(v, a + i);
        load_pack(w, b + i);
#pragma unroll
        for (int k = 0; k < kPack; ++k) v[k] = f(v[k], w[k]);
        store_pack(out + i, v);
      },
      [&](std::size_t i) { out[i] = from_float<O>(f(to_float(a[i]), to_float(b[i]))); });
}

template <class O, class A, class F>
void launch_map(O* out, const A* a, std::size_t n, StreamHandle stream, F f) {
  const bool packed = aligned16(out, a);
  map_kernel<<<packed_blocks(n, packed), kElementwiseThreads, 0, stream>>>(out, a, n, packed, f);
}

template <class O, class A, class B, class F>
void launch_map(O* out, const A* a, const B* b, std::size_t n, StreamHandle stream, F f) {
  const bool packed = aligned16(out, a, b);
  map_kernel<<<packed_blocks(n, packed), kElementwiseThreads, 0, stream>>>(out, a, b, n, packed, f);
}

// y = 0.5 x (1 + tanh(s (x + c x^3))).
struct GeluForward {
  __device__ float operator()(float v) const {
    return 0.5f * v * (1.0f + tanhf(kGeluScale * (v + kGeluCubic * (v * v * v))));
  }
};

// tanh evaluated once per element as on the CPU. dx = dy (0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 c x^2)).
struct GeluBackward {
  __device__ float operator()(float v, float dy) const {
    const float th = tanhf(kGeluScale * (v + kGeluCubic * (v * v * v)));
    const float d = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
    return dy * d;
  }
};

// Residual add, accumulation, casts: one fp32 operation (or none) and one rounding, as the CPU
// does them, so results are bit-identical to the CPU's. fp16 <-> bf16 casts go through fp32,
// which holds both exactly: one rounding in all.
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Identity {
  __device__ float operator()(float a) const { return a; }
};

// ---------------------------------------------------------------------------------------
// Random operands: splitmix64 (Steele, Lea and Flood) of (seed, i), two 24-bit uniforms, one
// Box-Muller normal.
// ---------------------------------------------------------------------------------------
__host__ __device__ inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <class T>
__global__ void fill_normal_kernel(T* dst, std::size_t n, float scale, std::uint64_t key, bool squared) {
  constexpr float kTwoToMinus24 = 5.9604644775390625e-8f;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t h = splitmix64(key + i);
    const float u1 = static_cast<float>((h >> 40) + 1) * kTwoToMinus24;          // (0, 1]: log is finite
    const float u2 = static_cast<float>((h >> 16) & 0xffffffu) * kTwoToMinus24;  // [0, 1)
    const float v = scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    dst[i] = from_float<T>(squared ? v * v : v);
  }
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
    const bool packed = C % kPack == 0 && aligned16(out, wte, wpe);
    embedding_forward_kernel<S><<<packed_blocks(total, packed), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), tokens, static_cast<const S*>(wte), static_cast<const S*>(wpe), T, C, V, total, packed);
  });
  check_launch(name);
}

namespace {

// dwte's three launches (above), with their scratch from the stream-ordered pool.
template <class S>
void embedding_backward_wte(float* dwte, const S* dout, const std::int32_t* tokens, int N, int C, int V,
                            StreamHandle stream) {
  const char* what = "embedding_backward (wte)";
  // Keys 0..V: the bits that hold V.
  int key_bits = 1;
  while (key_bits < 31 && (std::int64_t{1} << key_bits) <= V) ++key_bits;
  std::size_t sort_bytes = 0;
  check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const std::int32_t*>(nullptr),
                                             static_cast<std::int32_t*>(nullptr),
                                             static_cast<const std::int32_t*>(nullptr),
                                             static_cast<std::int32_t*>(nullptr), N, 0, key_bits, stream),
             "embedding_backward: the sort's scratch size");
  const std::size_t ints = 4 * static_cast<std::size_t>(N);
  void* scratch = nullptr;
  check_cuda(cudaMallocAsync(&scratch, ints * sizeof(std::int32_t) + sort_bytes, stream),
             "embedding_backward: cudaMallocAsync of its scratch");
  auto* keys = static_cast<std::int32_t*>(scratch);
  std::int32_t* order = keys + N;      // 0..N-1, the sort's values
  std::int32_t* sorted = order + N;    // keys, sorted
  std::int32_t* positions = sorted + N;  // positions in the sorted keys' order
  void* sort_scratch = positions + N;
  embedding_keys_kernel<<<elementwise_blocks(static_cast<std::size_t>(N)), kElementwiseThreads, 0, stream>>>(
      keys, order, tokens, N, V);
  check_cuda(cub::DeviceRadixSort::SortPairs(sort_scratch, sort_bytes, keys, sorted, order, positions, N, 0, key_bits,
                                             stream),
             "embedding_backward: cub::DeviceRadixSort::SortPairs");
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((C + kEmbedThreads - 1) / kEmbedThreads));
  embedding_backward_wte_kernel<S><<<grid, kEmbedThreads, 0, stream>>>(dwte, dout, positions, sorted, N, C, V);
  check_launch(what);
  check_cuda(cudaFreeAsync(scratch, stream), "embedding_backward: cudaFreeAsync of its scratch");
}

}  // namespace

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
    embedding_backward_wte(dwte, d, tokens, B * T, C, V, stream);
  });
}

void embedding_shard_forward(void* out, const std::int32_t* local_tokens, const void* wte_shard, int N, int C, int Vl,
                             DType dt, StreamHandle stream) {
  const char* name = "embedding_shard_forward";
  require_dims(name, {N, C, Vl});
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const std::size_t total = static_cast<std::size_t>(N) * C;
    const bool packed = C % kPack == 0 && aligned16(out, wte_shard);
    embedding_shard_forward_kernel<S><<<packed_blocks(total, packed), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), local_tokens, static_cast<const S*>(wte_shard), C, Vl, total, packed);
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
    const bool packed = C % kPack == 0 && aligned16(out, wpe);
    add_position_embedding_kernel<S><<<packed_blocks(total, packed), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(out), static_cast<const S*>(wpe), row0, T, C, total, packed);
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
    const bool packed = OC % kPack == 0 && aligned16(y, b);
    add_bias_kernel<S><<<packed_blocks(total, packed), kElementwiseThreads, 0, stream>>>(
        static_cast<S*>(y), static_cast<const S*>(b), OC, total, packed);
  });
  check_launch(name);
}

void gelu_forward(void* y, const void* x, std::size_t n, DType dt, StreamHandle stream) {
  const char* name = "gelu_forward";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    launch_map(static_cast<S*>(y), static_cast<const S*>(x), n, stream, GeluForward{});
  });
  check_launch(name);
}

void gelu_backward(void* dx, const void* x, const void* dy, std::size_t n, DType dt, StreamHandle stream) {
  const char* name = "gelu_backward";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    launch_map(static_cast<S*>(dx), static_cast<const S*>(x), static_cast<const S*>(dy), n, stream, GeluBackward{});
  });
  check_launch(name);
}

void residual_add(void* out, const void* a, const void* b, std::size_t n, DType dt, StreamHandle stream) {
  const char* name = "residual_add";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    launch_map(static_cast<S*>(out), static_cast<const S*>(a), static_cast<const S*>(b), n, stream, Add{});
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
      launch_map(static_cast<A*>(acc), static_cast<const A*>(acc), static_cast<const X*>(x), n, stream, Add{});
    });
  });
  check_launch(name);
}

void fill_normal(void* dst, DType dt, std::size_t n, float scale, std::uint64_t seed, bool squared,
                 StreamHandle stream) {
  const char* name = "fill_normal";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    fill_normal_kernel<S><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(static_cast<S*>(dst), n, scale,
                                                                                     splitmix64(seed), squared);
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
      launch_map(static_cast<D*>(dst), static_cast<const S*>(src), n, stream, Identity{});
    });
  });
  check_launch(name);
}

}  // namespace trainsim::cuda
