// Private to the kernels' .cu files: error checks, the storage formats and their dispatch, and
// the warp and block reductions every row kernel uses. Not part of the public interface.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/dtype.h"
#include "kernels/cuda_check.h"
#include "kernels/cuda_handles.h"

namespace trainsim::cuda::detail {

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------
using trainsim::cuda::check_cuda;  // kernels/cuda_check.h: the one CUDA error check

// After every launch: a bad configuration (grid, block, shared memory) is reported here at once;
// a fault while the kernel runs is reported by the next synchronising call.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

inline std::string dtype_label(DType d) { return std::string(dtype_name(d)); }

inline void require(bool ok, const char* kernel, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(kernel) + ": " + what);
}

// ---------------------------------------------------------------------------------------
// Storage formats: load into fp32, store from fp32 with round-to-nearest-even.
// __float2half_rn and __float2bfloat16_rn are IEEE RNE with overflow to inf and NaN kept, the
// rounding runtime/numerics/lowp.h emulates.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Calls f(Type<T>{}) with T the storage type of `dt`; other formats are refused.
template <class T>
struct Type {
  using type = T;
};

template <class F>
void dispatch(DType dt, const char* kernel, F&& f) {
  switch (dt) {
    case DType::fp32: f(Type<float>{}); return;
    case DType::fp16: f(Type<__half>{}); return;
    case DType::bf16: f(Type<__nv_bfloat16>{}); return;
    case DType::tf32:
    case DType::fp8: break;
  }
  throw std::invalid_argument(std::string(kernel) + ": storage format must be fp32, fp16 or bf16, got " +
                              dtype_label(dt) + " (tf32 is a matrix-product mode, see kernels/gemm.h)");
}

// ---------------------------------------------------------------------------------------
// 16-byte accesses. A pack is kPack consecutive elements: 16 bytes of a 16-bit format (one
// 128-bit load or store) or 32 of fp32 (two). A memory-bound kernel moves whole packs where every
// pointer it touches is 16-byte aligned (the launcher asks aligned16) and single elements
// elsewhere, e.g. a shard at an odd offset; the arithmetic on each element is the same either way,
// so the results do not depend on the path.
// ---------------------------------------------------------------------------------------
inline constexpr int kPack = 8;

template <class T>
__device__ __forceinline__ void load_pack(float (&f)[kPack], const T* p) {
  constexpr int kWords = static_cast<int>(sizeof(T)) * kPack / 16;
  uint4 raw[kWords];
#pragma unroll
  for (int w = 0; w < kWords; ++w) raw[w] = reinterpret_cast<const uint4*>(p)[w];
  T t[kPack];
  memcpy(t, raw, sizeof t);
#pragma unroll
  for (int k = 0; k < kPack; ++k) f[k] = to_float(t[k]);
}

template <class T>
__device__ __forceinline__ void store_pack(T* p, const float (&f)[kPack]) {
  constexpr int kWords = static_cast<int>(sizeof(T)) * kPack / 16;
  T t[kPack];
#pragma unroll
  for (int k = 0; k < kPack; ++k) t[k] = from_float<T>(f[k]);
  uint4 raw[kWords];
  memcpy(raw, t, sizeof t);
#pragma unroll
  for (int w = 0; w < kWords; ++w) reinterpret_cast<uint4*>(p)[w] = raw[w];
}

// Every pointer 16-byte aligned (a null one, an operand the kernel skips, is).
template <class... P>
bool aligned16(const P*... p) {
  return ((reinterpret_cast<std::uintptr_t>(p) % 16 == 0) && ...);
}

// Grid-stride visit of n elements: pack_fn(i) for each whole pack (i = 0, kPack, 2 kPack, ...)
// when `packed`, then one_fn(i) for each element left (all n when not packed).
template <class PackFn, class OneFn>
__device__ __forceinline__ void for_each_element(std::size_t n, bool packed, PackFn&& pack_fn, OneFn&& one_fn) {
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t packs = packed ? n / kPack : 0;
  for (std::size_t p = first; p < packs; p += stride) pack_fn(p * kPack);
  for (std::size_t i = packs * kPack + first; i < n; i += stride) one_fn(i);
}

// f(a[i]) in fp32 for n elements, in for_each_element's order (a reduction's terms).
template <class A, class F>
__device__ __forceinline__ void for_each_value(const A* a, std::size_t n, bool packed, F&& f) {
  for_each_element(
      n, packed,
      [&](std::size_t i) {
        float v[kPack];
        load_pack(v, a + i);
#pragma unroll
        for (int k = 0; k < kPack; ++k) f(v[k]);
      },
      [&](std::size_t i) { f(to_float(a[i])); });
}

// out[i] = f(a[i]) for n elements (for_each_element), in fp32 and rounded once to O's format. Each
// element is read and written by one thread, so out may be a.
template <class O, class A, class F>
__device__ __forceinline__ void map_elements(O* out, const A* a, std::size_t n, bool packed, F&& f) {
  for_each_element(
      n, packed,
      [&](std::size_t i) {
        float v[kPack];
        load_pack(v, a + i);
#pragma unroll
        for (int k = 0; k < kPack; ++k) v[k] = f(v[k]);
        store_pack(out + i, v);
      },
      [&](std::size_t i) { out[i] = from_float<O>(f(to_float(a[i]))); });
}

// ---------------------------------------------------------------------------------------
// Launch shapes
// ---------------------------------------------------------------------------------------
inline constexpr int kElementwiseThreads = 256;
inline constexpr int kRowsPerBlock = 8;  // warp-per-row kernels: 8 warps, 8 rows per block

// Blocks for a grid-stride loop over n elements: enough to fill any current GPU several times
// over, few enough that each thread does a handful of elements. Never 0.
inline unsigned elementwise_blocks(std::size_t n) {
  const std::size_t want = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  const std::size_t cap = 1u << 16;
  return static_cast<unsigned>(want == 0 ? 1 : (want < cap ? want : cap));
}

// Blocks for for_each_element: one thread per pack (or per element when not packed).
inline unsigned packed_blocks(std::size_t n, bool packed) { return elementwise_blocks(packed ? (n + kPack - 1) / kPack : n); }

inline unsigned row_blocks(std::size_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

// ---------------------------------------------------------------------------------------
// Reductions. Butterfly (xor) shuffles: every lane ends with the same value, because each step
// adds the same two partials on both partner lanes and fp addition is commutative; the order of
// the additions is fixed, so results do not vary run to run.
// ---------------------------------------------------------------------------------------
inline constexpr unsigned kFullMask = 0xffffffffu;

template <class S>
__device__ __forceinline__ S warp_sum(S v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Block-wide sum / max for blockDim.x a multiple of 32 (at most 1024); every thread of the block
// must call it, and every thread gets the result. `shared` holds 32 values; the trailing barrier
// lets the caller reuse it at once.
template <class S>
__device__ S block_sum(S v, S* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  S total = lane < warps ? shared[lane] : S(0);
  total = warp_sum(total);  // every warp sums the partials itself, in the same order
  __syncthreads();
  return total;
}

__device__ inline float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float m = lane < warps ? shared[lane] : -INFINITY;
  m = warp_max(m);
  __syncthreads();
  return m;
}

}  // namespace trainsim::cuda::detail
