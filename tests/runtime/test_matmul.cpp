// The CPU backend's FP32 matrix product (runtime/model/matmul.h) and the float layers built on it:
//  * every transpose case, alpha and beta, odd sizes around the register tile and the k block,
//    strided operands, against a product in double on fresh random inputs: within the bound of
//    an FP32 dot product of K terms, gamma_K * sum |a||b| (Higham, Theorem 3.5);
//  * the summation order matmul.h promises: an element does not depend on M, N, where it falls
//    in a tile or on the buffers' alignment; beta 0 does not read C;
//  * the causal attention in float (blocks of query rows, the masked terms left out) against the
//    whole T x T products computed in double.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "runtime/model/layers.h"
#include "runtime/model/matmul.h"

namespace trainsim::runtime {
namespace {

std::vector<float> randf(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

struct Case {
  bool ta, tb;
  int M, N, K;
  float alpha, beta;
};

// op(A)[i][k] and op(B)[k][j] of row-major buffers with strides.
float at(const std::vector<float>& A, bool trans, std::ptrdiff_t ld, int i, int k) {
  return trans ? A[static_cast<std::size_t>(k * ld + i)] : A[static_cast<std::size_t>(i * ld + k)];
}

void check_against_double(const Case& c, std::mt19937_64& rng) {
  // Strides wider than the operands, so strided access is exercised too.
  const std::ptrdiff_t lda = (c.ta ? c.M : c.K) + 3, ldb = (c.tb ? c.K : c.N) + 5, ldc = c.N + 2;
  const auto A = randf(static_cast<std::size_t>((c.ta ? c.K : c.M) * lda), rng);
  const auto B = randf(static_cast<std::size_t>((c.tb ? c.N : c.K) * ldb), rng);
  const auto C0 = randf(static_cast<std::size_t>(c.M * ldc), rng);
  auto C = C0;
  matmul::sgemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data(), lda, B.data(), ldb, c.beta, C.data(), ldc);
  const double u = std::numeric_limits<float>::epsilon() / 2;
  const double gamma = (c.K + 2) * u / (1 - (c.K + 2) * u);  // K products and sums, alpha and beta
  for (int i = 0; i < c.M; ++i)
    for (int j = 0; j < c.N; ++j) {
      double exact = 0, magnitude = 0;
      for (int k = 0; k < c.K; ++k) {
        const double t = static_cast<double>(at(A, c.ta, lda, i, k)) * at(B, !c.tb, ldb, j, k);
        exact += t;
        magnitude += std::fabs(t);
      }
      const double before = C0[static_cast<std::size_t>(i * ldc + j)];
      const double want = c.alpha * exact + c.beta * before;
      const double bound = gamma * (std::fabs(c.alpha) * magnitude + std::fabs(c.beta * before)) + 1e-30;
      const float got = C[static_cast<std::size_t>(i * ldc + j)];
      ASSERT_LE(std::fabs(got - want), bound) << "ta " << c.ta << " tb " << c.tb << " M " << c.M << " N " << c.N
                                              << " K " << c.K << " at (" << i << ", " << j << ")";
    }
  // Padding between rows of C is left alone.
  for (int i = 0; i < c.M; ++i)
    for (std::ptrdiff_t j = c.N; j < ldc; ++j)
      ASSERT_EQ(C[static_cast<std::size_t>(i * ldc + j)], C0[static_cast<std::size_t>(i * ldc + j)]);
}

TEST(Matmul, EveryTransposeAndSizeWithinTheDotProductBound) {
  std::mt19937_64 rng(11);
  const auto blk = matmul::blocking();
  // Sizes at the tile's edges and the k block's (kernel tiles are at most 16 x 64, k blocks 256).
  const int ms[] = {1, 5, 8, 17, 33};
  const int ns[] = {1, 7, 16, 33, 70};
  const int ks[] = {1, 3, 64, 257, 520};
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int M : ms)
        for (int N : ns)
          for (int K : ks) check_against_double({ta, tb, M, N, K, 1.0f, 0.0f}, rng);
  for (float alpha : {1.0f, 0.125f, -2.5f})
    for (float beta : {0.0f, 1.0f, 0.5f}) {
      check_against_double({false, true, 37, 45, 300, alpha, beta}, rng);
      check_against_double({true, false, 45, 37, 19, alpha, beta}, rng);
    }
  if (blk.mr > 0) check_against_double({false, false, 3 * blk.mr + 1, 2 * blk.nr + 1, blk.kc + 1, 1.0f, 1.0f}, rng);
}

TEST(Matmul, NoTermsLeaveBetaTimesC) {
  std::vector<float> C = {1, 2, 3, 4};
  const float a = 7, b = 9;
  matmul::sgemm(false, false, 2, 2, 0, 1.0f, &a, 1, &b, 2, 0.5f, C.data(), 2);
  EXPECT_EQ(C, (std::vector<float>{0.5f, 1, 1.5f, 2}));
  matmul::sgemm(false, false, 2, 2, 0, 1.0f, &a, 1, &b, 2, 0.0f, C.data(), 2);
  EXPECT_EQ(C, (std::vector<float>{0, 0, 0, 0}));
}

TEST(Matmul, BetaZeroDoesNotReadC) {
  std::mt19937_64 rng(12);
  const int M = 19, N = 23, K = 40;
  const auto A = randf(M * K, rng), B = randf(K * N, rng);
  std::vector<float> clean(M * N, 0.0f), dirty(M * N, std::numeric_limits<float>::quiet_NaN());
  matmul::sgemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, clean.data(), N);
  matmul::sgemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, dirty.data(), N);
  EXPECT_EQ(0, std::memcmp(clean.data(), dirty.data(), clean.size() * sizeof(float)));
}

// What the packed kernel promises about its summation order (the Eigen fallback does not).
TEST(Matmul, AnElementDependsOnlyOnItsRowColumnAndK) {
  if (!matmul::packed_kernel()) GTEST_SKIP() << "this build multiplies with Eigen (no AVX2 + FMA)";
  std::mt19937_64 rng(13);
  const int M = 61, N = 75, K = 700;  // several k blocks, edge tiles in both directions
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const auto A = randf(M * K, rng), B = randf(K * N, rng);
      const std::ptrdiff_t lda = ta ? M : K, ldb = tb ? K : N;
      std::vector<float> whole(M * N);
      matmul::sgemm(ta, tb, M, N, K, 1.0f, A.data(), lda, B.data(), ldb, 0.0f, whole.data(), N);
      // Rows [r0, r1) and columns [c0, c1) alone, written into a buffer at an odd offset.
      for (auto [r0, r1, c0, c1] : {std::array{0, 1, 0, N}, std::array{3, 20, 5, 6}, std::array{13, 61, 17, 75}}) {
        std::vector<float> part(static_cast<std::size_t>((r1 - r0) * (c1 - c0)) + 1);
        float* out = part.data() + 1;  // not 64-byte aligned
        const float* a = ta ? A.data() + r0 : A.data() + r0 * lda;
        const float* b = tb ? B.data() + c0 * ldb : B.data() + c0;
        matmul::sgemm(ta, tb, r1 - r0, c1 - c0, K, 1.0f, a, lda, b, ldb, 0.0f, out, c1 - c0);
        for (int i = r0; i < r1; ++i)
          for (int j = c0; j < c1; ++j)
            ASSERT_EQ(out[(i - r0) * (c1 - c0) + (j - c0)], whole[i * N + j])
                << "ta " << ta << " tb " << tb << " (" << i << ", " << j << ")";
      }
    }
}

// The float attention against the whole products in double: q k^T, the causal softmax, p v, and
// the backward's four products, with T spanning several blocks of query rows (the last partial).
TEST(Matmul, CausalAttentionInFloatMatchesTheWholeProducts) {
  const int B = 2, T = 2 * layers::kAttnRows + 7, C = 48, H = 3, hs = C / H;
  std::mt19937_64 rng(14);
  const auto qkv = randf(static_cast<std::size_t>(B) * T * 3 * C, rng);
  const auto dout = randf(static_cast<std::size_t>(B) * T * C, rng);
  std::vector<float> out(B * T * C), probs(B * H * T * T, -1.0f), scratch(T * T), dqkv(B * T * 3 * C);
  layers::attention_forward(out.data(), probs.data(), scratch.data(), qkv.data(), B, T, C, H, layers::no_post);
  layers::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), probs.data(), B, T, C, H,
                             layers::no_post);

  auto Q = [&](int b, int t, int part, int h, int d) {
    return static_cast<double>(qkv[((static_cast<std::size_t>(b) * T + t) * 3 + part) * C + h * hs + d]);
  };
  double worst_out = 0, worst_grad = 0, scale_out = 0, scale_grad = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      // Forward in double: p (T,T), y (T,hs).
      std::vector<double> p(T * T, 0.0), dp(T * T, 0.0), ds(T * T, 0.0);
      for (int i = 0; i < T; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          double s = 0;
          for (int d = 0; d < hs; ++d) s += Q(b, i, 0, h, d) * Q(b, j, 1, h, d);
          p[i * T + j] = s / std::sqrt(static_cast<double>(hs));
          mx = std::max(mx, p[i * T + j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += (p[i * T + j] = std::exp(p[i * T + j] - mx));
        for (int j = 0; j <= i; ++j) p[i * T + j] /= sum;
        for (int j = 0; j < T; ++j) {
          const float got = probs[((static_cast<std::size_t>(b) * H + h) * T + i) * T + j];
          if (j > i) {
            ASSERT_EQ(got, 0.0f) << "causal mask";
          }
          worst_out = std::max(worst_out, std::fabs(got - p[i * T + j]));
        }
        for (int d = 0; d < hs; ++d) {
          double y = 0;
          for (int j = 0; j <= i; ++j) y += p[i * T + j] * Q(b, j, 2, h, d);
          const float got = out[(static_cast<std::size_t>(b) * T + i) * C + h * hs + d];
          worst_out = std::max(worst_out, std::fabs(got - y));
          scale_out = std::max(scale_out, std::fabs(y));
        }
      }
      // Backward in double.
      auto dY = [&](int t, int d) { return static_cast<double>(dout[(static_cast<std::size_t>(b) * T + t) * C + h * hs + d]); };
      for (int i = 0; i < T; ++i) {
        double dot = 0;
        for (int j = 0; j <= i; ++j) {
          double s = 0;
          for (int d = 0; d < hs; ++d) s += dY(i, d) * Q(b, j, 2, h, d);
          dp[i * T + j] = s;
          dot += s * p[i * T + j];
        }
        for (int j = 0; j <= i; ++j) ds[i * T + j] = p[i * T + j] * (dp[i * T + j] - dot) / std::sqrt(double(hs));
      }
      for (int t = 0; t < T; ++t)
        for (int d = 0; d < hs; ++d) {
          double gq = 0, gk = 0, gv = 0;
          for (int j = 0; j <= t; ++j) gq += ds[t * T + j] * Q(b, j, 1, h, d);
          for (int i = t; i < T; ++i) {
            gk += ds[i * T + t] * Q(b, i, 0, h, d);
            gv += p[i * T + t] * dY(i, d);
          }
          const double want[3] = {gq, gk, gv};
          for (int part = 0; part < 3; ++part) {
            const float got = dqkv[((static_cast<std::size_t>(b) * T + t) * 3 + part) * C + h * hs + d];
            worst_grad = std::max(worst_grad, std::fabs(got - want[part]));
            scale_grad = std::max(scale_grad, std::fabs(want[part]));
          }
        }
    }
  // FP32 rounding of sums of ~T terms of unit size: well within 1e-5 of the largest value.
  EXPECT_LT(worst_out, 1e-5 * std::max(1.0, scale_out));
  EXPECT_LT(worst_grad, 1e-5 * std::max(1.0, scale_grad));
}

}  // namespace
}  // namespace trainsim::runtime
