// The CPU backend's FP32 matrix product: C (M,N) = alpha * op(A) (M,K) * op(B) (K,N) + beta * C,
// row-major, as layers.h's linear and attention layers call it (float only; the double-precision
// finite-difference tests keep Eigen's product).
//
// Why not Eigen's product: at the model's shapes (e.g. 1024 x 256 x 768) Eigen 3.4's 3p x 4 kernel
// reaches ~75% of an AVX2 core's peak and less of an AVX-512 core's, where OpenBLAS (what PyTorch
// calls) reaches ~95%. This one packs panels the way BLIS and OpenBLAS do and runs a register-
// blocked kernel of kMr rows x kNr columns (AVX-512: 8 x 32, AVX2 + FMA: 6 x 16); docs/performance.md
// has the measurements. Without AVX2 and FMA it falls back to Eigen.
//
// Summation order, which is what makes results reproducible: every element of C is
//   acc_b = fma(a[k], b[k], ... fma(a[k0], b[k0], 0))   over the k of block b, in increasing k,
//   blocks of kKc consecutive k, in increasing order; the first block gives
//   C = fma(alpha, acc_0, beta * C) (C = alpha * acc_0 when beta is 0: C is not read), each later one
//   C = fma(alpha, acc_b, C).
// It depends on K and on nothing else: not on M or N, on where a row or column falls in a tile, on
// the alignment of the buffers, or on the machine's vector width. A product over rows [r0, r1) of A
// gives those rows of the whole product bit for bit. Zero terms at the end of the k range may be
// left out without changing a value (adding a zero product to a finite sum is exact), and so may
// zero terms at its start while K stays within one k block (a sum that starts with zeros starts
// from +0): this is how the causal attention skips the masked half (layers.h).
#pragma once

#include <cstddef>

namespace trainsim::runtime::matmul {

// Whether this build runs the packed kernel (false: Eigen's product; summation order as Eigen's).
bool packed_kernel();
// The kernel's register tile and k block (0 when packed_kernel() is false).
struct Blocking {
  int mr = 0, nr = 0, kc = 0;
};
Blocking blocking();

// op(A) is A (M,K) with row stride lda when !trans_a, else the transpose of A (K,M) with row
// stride lda; likewise op(B) (K,N) from B (K,N) or B (N,K) with row stride ldb. C (M,N) has row
// stride ldc and must not overlap A or B. M, N or K may be 0 (K = 0: C = beta * C).
void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::ptrdiff_t lda,
           const float* B, std::ptrdiff_t ldb, float beta, float* C, std::ptrdiff_t ldc);

}  // namespace trainsim::runtime::matmul
