// matmul.h's product through Eigen, for any scalar: what layers.h uses for double (the
// finite-difference tests) and matmul::sgemm for float on a CPU without AVX2 and FMA.
#pragma once

#include <cstddef>

// GCC 12 reports spurious (maybe-)uninitialized warnings inside its AVX-512 intrinsics as Eigen
// uses them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#pragma GCC diagnostic pop

namespace trainsim::runtime::matmul {

// C (M,N) = alpha * op(A) (M,K) * op(B) (K,N) + beta * C, row-major with row strides; beta 0: C is
// not read. Summation order: Eigen's.
template <class S>
void eigen_gemm(bool trans_a, bool trans_b, int M, int N, int K, S alpha, const S* A, std::ptrdiff_t lda, const S* B,
                std::ptrdiff_t ldb, S beta, S* C, std::ptrdiff_t ldc) {
  using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Map = Eigen::Map<Mat, 0, Eigen::OuterStride<>>;
  using ConstMap = Eigen::Map<const Mat, 0, Eigen::OuterStride<>>;
  if (M <= 0 || N <= 0) return;
  Map c(C, M, N, Eigen::OuterStride<>(ldc));
  if (beta == S(0))
    c.setZero();
  else if (beta != S(1))
    c *= beta;
  if (K <= 0) return;
  const ConstMap a(A, trans_a ? K : M, trans_a ? M : K, Eigen::OuterStride<>(lda));
  const ConstMap b(B, trans_b ? N : K, trans_b ? K : N, Eigen::OuterStride<>(ldb));
  if (trans_a && trans_b)
    c.noalias() += alpha * (a.transpose() * b.transpose());
  else if (trans_a)
    c.noalias() += alpha * (a.transpose() * b);
  else if (trans_b)
    c.noalias() += alpha * (a * b.transpose());
  else
    c.noalias() += alpha * (a * b);
}

}  // namespace trainsim::runtime::matmul
