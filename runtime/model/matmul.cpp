// The packed FP32 matrix product of matmul.h. Structure (BLIS's, with C row-major so the vectors
// run along N):
//   for each block of kNc columns of C:
//     for each block of kKc values of k:    pack op(B)[k block, column block] into slivers of kNr
//                                           columns, k-major (kKc x kNr floats each, L1-sized)
//       for each block of kMc rows of C:    pack op(A)[row block, k block] into slivers of kMr rows,
//                                           k-major (kMr x kKc floats each)
//         for each B sliver, each A sliver: the kernel: kMr x kNr accumulators in registers, one
//                                           broadcast of A and kNr/width loads of B per k,
//                                           then C updated in place.
// Slivers are zero-padded to kMr rows and kNr columns; a tile that sticks out of C is computed
// whole into a local buffer and only its inside written, with the same operations as a full tile
// (so an element's value does not depend on where it falls).
#include "runtime/model/matmul.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TRAINSIM_PACKED_GEMM 1
#else
#include "runtime/model/eigen_gemm.h"
#endif

namespace trainsim::runtime::matmul {

#if TRAINSIM_PACKED_GEMM
namespace {

// The vector operations, on 512-bit registers with AVX-512, else on 256-bit ones.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kWidth = 16;
#define TRAINSIM_VEC(op) _mm512_##op
// 8 rows x 2 vectors: 16 accumulators of the 32 registers, 2 loads and 8 broadcasts per k.
constexpr int kMr = 8, kVecs = 2;
#else
using Vec = __m256;
constexpr int kWidth = 8;
#define TRAINSIM_VEC(op) _mm256_##op
// 6 rows x 2 vectors: 12 accumulators of the 16 registers (BLIS's and OpenBLAS's Haswell shape).
constexpr int kMr = 6, kVecs = 2;
#endif
inline Vec vload(const float* p) { return TRAINSIM_VEC(load_ps)(p); }
inline Vec vloadu(const float* p) { return TRAINSIM_VEC(loadu_ps)(p); }
inline void vstoreu(float* p, Vec v) { TRAINSIM_VEC(storeu_ps)(p, v); }
inline Vec vset1(float x) { return TRAINSIM_VEC(set1_ps)(x); }
inline Vec vzero() { return TRAINSIM_VEC(setzero_ps)(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return TRAINSIM_VEC(fmadd_ps)(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return TRAINSIM_VEC(mul_ps)(a, b); }
#undef TRAINSIM_VEC
constexpr int kNr = kVecs * kWidth;
// k block: a B sliver (kKc x kNr floats: 32 KiB with AVX-512, 16 KiB with AVX2) stays in L1 while
// the A slivers of a row block stream past it; the packed A block (kMc x kKc) stays in L2.
constexpr int kKc = 256;
constexpr int kMc = 16 * kMr;
constexpr int kNc = 1024;

// How the kernel leaves C: the first k block with beta 0, with another beta, or a later block.
enum class Update { assign, scale, accumulate };

// acc (kMr x kNr) = sum over k < kc of Ap[k] (kMr) x Bp[k] (kNr), then C updated per `u`.
template <Update u>
inline void kernel(int kc, const float* __restrict Ap, const float* __restrict Bp, float* __restrict C,
                   std::ptrdiff_t ldc, float alpha, float beta) {
  Vec c[kMr][kVecs];
#pragma GCC unroll 16
  for (int i = 0; i < kMr; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) c[i][v] = vzero();
  for (int k = 0; k < kc; ++k) {
    Vec b[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) b[v] = vload(Bp + v * kWidth);
#pragma GCC unroll 16
    for (int i = 0; i < kMr; ++i) {
      const Vec a = vset1(Ap[i]);
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) c[i][v] = vfma(a, b[v], c[i][v]);
    }
    Ap += kMr;
    Bp += kNr;
  }
  const Vec va = vset1(alpha), vb = vset1(beta);
#pragma GCC unroll 16
  for (int i = 0; i < kMr; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      float* p = C + i * ldc + v * kWidth;
      if constexpr (u == Update::assign)
        vstoreu(p, vmul(va, c[i][v]));
      else if constexpr (u == Update::scale)
        vstoreu(p, vfma(va, c[i][v], vmul(vb, vloadu(p))));
      else
        vstoreu(p, vfma(va, c[i][v], vloadu(p)));
    }
}

template <Update u>
void tile(int kc, const float* Ap, const float* Bp, float* C, std::ptrdiff_t ldc, int mr, int nr, float alpha,
          float beta) {
  if (mr == kMr && nr == kNr) return kernel<u>(kc, Ap, Bp, C, ldc, alpha, beta);
  // An edge tile: the same kernel into a whole tile of zeros (assign with alpha 1 keeps acc exact:
  // 1 * acc), then the same update, element by element, for the part inside C.
  alignas(64) float acc[kMr * kNr];
  kernel<Update::assign>(kc, Ap, Bp, acc, kNr, 1.0f, 0.0f);
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float& out = C[i * ldc + j];
      const float a = acc[i * kNr + j];
      if constexpr (u == Update::assign)
        out = alpha * a;
      else if constexpr (u == Update::scale)
        out = std::fma(alpha, a, beta * out);
      else
        out = std::fma(alpha, a, out);
    }
}

// dst[k * ld + r] = src[r * lds + k] for k < 8 and r < rows (<= 8), through registers (AVX); the
// rows past `rows` read as zeros. Each k writes 8 floats: with ld < 8 the last 8 - ld spill into
// the start of row k + 1, which the next store (or the caller) overwrites.
inline void transpose8(const float* src, std::ptrdiff_t lds, int rows, float* dst, std::ptrdiff_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = i < rows ? _mm256_loadu_ps(src + i * lds) : _mm256_setzero_ps();
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
  for (int i = 0; i < 4; ++i) t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ld, t[i]);
}

// dst[k * width + r] = src[r * lds + k] for r < rows, k < kc, and 0 for rows <= r < width:
// `rows` runs of kc contiguous floats, transposed into kc rows of `width` (kNr, or kMr for A).
// Blocks of 8 k go through registers when the groups of 8 rows are whole (or, for a width below
// 8, when rows == width: its spill past the panel's end needs kSpill floats of room).
constexpr int kSpill = 8;
void transpose_panel(const float* src, std::ptrdiff_t lds, int rows, int kc, float* dst, int width) {
  const bool blocks = rows == width && (width % 8 == 0 || width < 8);
  const int k8 = blocks ? kc - kc % 8 : 0;
  for (int r = 0; r < rows; r += 8)
    for (int k = 0; k < k8; k += 8) transpose8(src + r * lds + k, lds, std::min(8, rows - r), dst + k * width + r, width);
  for (int r = 0; r < rows; ++r)
    for (int k = k8; k < kc; ++k) dst[k * width + r] = src[r * lds + k];
  for (int r = rows; r < width; ++r)
    for (int k = 0; k < kc; ++k) dst[k * width + r] = 0.0f;
}

// op(B)[k0 + k, j0 + j] for k < kc, j < nc, into slivers of kNr columns: sliver s holds columns
// [s*kNr, s*kNr + kNr) as kc rows of kNr floats; columns past nc are zeros.
void pack_b(bool trans, const float* B, std::ptrdiff_t ldb, int k0, int j0, int kc, int nc, float* dst) {
  for (int js = 0; js < nc; js += kNr, dst += static_cast<std::size_t>(kc) * kNr) {
    const int nr = std::min(kNr, nc - js);
    if (!trans) {  // rows of B are contiguous along j
      for (int k = 0; k < kc; ++k) {
        const float* s = B + (k0 + k) * ldb + j0 + js;
        float* d = dst + k * kNr;
        if (nr == kNr) {  // a constant length: vector moves, not a call
          std::memcpy(d, s, sizeof(float) * kNr);
        } else {
          std::memcpy(d, s, sizeof(float) * nr);
          std::fill(d + nr, d + kNr, 0.0f);
        }
      }
    } else {  // B is (N,K): column j of op(B) is a contiguous run of B's row j
      transpose_panel(B + (j0 + js) * ldb + k0, ldb, nr, kc, dst, kNr);
    }
  }
}

// op(A)[i0 + i, k0 + k] for i < mc, k < kc, into slivers of kMr rows (kc x kMr floats, k-major);
// rows past mc are zeros.
void pack_a(bool trans, const float* A, std::ptrdiff_t lda, int i0, int k0, int mc, int kc, float* dst) {
  for (int is = 0; is < mc; is += kMr, dst += static_cast<std::size_t>(kc) * kMr) {
    const int mr = std::min(kMr, mc - is);
    if (trans) {  // A is (K,M): row k of A holds op(A)'s column k contiguously
      for (int k = 0; k < kc; ++k) {
        const float* s = A + (k0 + k) * lda + i0 + is;
        float* d = dst + k * kMr;
        if (mr == kMr) {
          std::memcpy(d, s, sizeof(float) * kMr);
        } else {
          std::memcpy(d, s, sizeof(float) * mr);
          std::fill(d + mr, d + kMr, 0.0f);
        }
      }
    } else {
      transpose_panel(A + (i0 + is) * lda + k0, lda, mr, kc, dst, kMr);
    }
  }
}

// Packing buffers, one pair per thread (every rank thread calls sgemm on its own), 64-byte aligned.
struct Scratch {
  struct Free {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<float[], Free> a, b;
  Scratch()
      : a(static_cast<float*>(::operator new[](sizeof(float) * (kMc * kKc + kSpill), std::align_val_t{64}))),
        b(static_cast<float*>(::operator new[](sizeof(float) * (kKc * (kNc + kNr) + kSpill), std::align_val_t{64}))) {}
};

}  // namespace

bool packed_kernel() { return true; }
Blocking blocking() { return {kMr, kNr, kKc}; }

void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::ptrdiff_t lda,
           const float* B, std::ptrdiff_t ldb, float beta, float* C, std::ptrdiff_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // no terms: C = beta * C
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  static thread_local Scratch scratch;
  float* Ap = scratch.a.get();
  float* Bp = scratch.b.get();
  for (int jc = 0; jc < N; jc += kNc) {
    const int nc = std::min(kNc, N - jc);
    for (int pc = 0; pc < K; pc += kKc) {
      const int kc = std::min(kKc, K - pc);
      const Update u = pc > 0 ? Update::accumulate : beta == 0.0f ? Update::assign
                                                   : beta == 1.0f ? Update::accumulate
                                                                  : Update::scale;
      pack_b(trans_b, B, ldb, pc, jc, kc, nc, Bp);
      for (int ic = 0; ic < M; ic += kMc) {
        const int mc = std::min(kMc, M - ic);
        pack_a(trans_a, A, lda, ic, pc, mc, kc, Ap);
        for (int jr = 0; jr < nc; jr += kNr) {
          const float* bs = Bp + static_cast<std::size_t>(jr) * kc;
          const int nr = std::min(kNr, nc - jr);
          for (int ir = 0; ir < mc; ir += kMr) {
            const float* as = Ap + static_cast<std::size_t>(ir) * kc;
            float* c = C + (ic + ir) * ldc + jc + jr;
            const int mr = std::min(kMr, mc - ir);
            switch (u) {
              case Update::assign:
                tile<Update::assign>(kc, as, bs, c, ldc, mr, nr, alpha, beta);
                break;
              case Update::scale:
                tile<Update::scale>(kc, as, bs, c, ldc, mr, nr, alpha, beta);
                break;
              case Update::accumulate:
                tile<Update::accumulate>(kc, as, bs, c, ldc, mr, nr, alpha, beta);
                break;
            }
          }
        }
      }
    }
  }
}

#else  // no AVX2 + FMA: Eigen's product

bool packed_kernel() { return false; }
Blocking blocking() { return {}; }

void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::ptrdiff_t lda,
           const float* B, std::ptrdiff_t ldb, float beta, float* C, std::ptrdiff_t ldc) {
  eigen_gemm<float>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

#endif

}  // namespace trainsim::runtime::matmul
