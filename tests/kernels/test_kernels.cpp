// The CUDA kernels (kernels/kernels.h) and matrix products (kernels/gemm.h) against the CPU
// backend's own implementation: runtime/model/layers.h, runtime/numerics/lowp.h and
// runtime/numerics/optimizer.cpp. Fresh random inputs from a fixed seed (never zeros), every
// storage format, tolerances derived from the precision. Plain C++: only the launchers and the
// device-buffer helpers are called. Every test skips (GTEST_SKIP in the fixture's SetUp) when no
// CUDA device can be used, so the suite runs, and passes, on machines without a GPU.
//
// How a tolerance is built. Inputs are drawn in the storage format (exactly representable), so
// the GPU and the reference read the same values. The reference is layers.h instantiated in
// double (exact to ~1e-16 for our purpose) unless said otherwise. The GPU computes in fp32 with
// some error e32 (bounded per kernel below, from the length and shape of its reductions) and
// rounds once to the storage format, whose unit roundoff u is 2^-24 (fp32), 2^-11 (fp16) or
// 2^-8 (bf16) (runtime::unit_roundoff). Rounding v = ref + d with |d| <= e32 gives
// |round(v) - ref| <= u |ref| + (1 + u) e32 <= u |ref| + 2 e32, plus half the format's smallest
// subnormal spacing for results in its subnormal range. That is the bound checked, element by
// element: tol_i = u |ref_i| + 2 e32_i + sub. Where the GPU does the CPU's very operations in the
// same order (embedding, residual add, casts, accumulation, unscaling) the check is exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/device_buffer.h"
#include "kernels/device_info.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "runtime/model/layers.h"
#include "runtime/numerics/lowp.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim {
// Parameterised tests name their format ("GetParam() = bf16") instead of printing bytes.
void PrintTo(DType d, std::ostream* os) { *os << dtype_name(d); }
}  // namespace trainsim

namespace trainsim::cuda {
namespace {

namespace L = runtime::layers;
using runtime::round_to;

// ---------------------------------------------------------------------------------------
// Skipping without a device
// ---------------------------------------------------------------------------------------
void skip_without_device() {
  std::string why;
  if (!device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
}

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override { skip_without_device(); }
};

// Kernels that take a storage format: each runs for fp32, fp16 and bf16.
class GpuByDType : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { skip_without_device(); }
};

// Matrix products: fp32, tf32, fp16, bf16.
class GpuGemm : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { skip_without_device(); }
};

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return std::string(dtype_name(info.param));
}

// ---------------------------------------------------------------------------------------
// Host encodings of the storage formats (independent of the kernels under test)
// ---------------------------------------------------------------------------------------
constexpr double kU32 = 0x1p-24;  // fp32 unit roundoff

double unit_roundoff_of(DType d) { return runtime::unit_roundoff(d); }

// Half the spacing of the format's subnormals: the absolute error of rounding a tiny result.
double subnormal_half_spacing(DType d) {
  switch (d) {
    case DType::fp16: return 0x1p-25;
    case DType::bf16: return 0x1p-134;
    default: return 0x1p-150;
  }
}

// x must be exactly representable in fp16 (or inf/NaN).
std::uint16_t fp16_bits(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (mag == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // inf
  if (mag < 0x38800000u) {  // zero or subnormal: an integer multiple of 2^-24, exact in float
    const float q = std::bit_cast<float>(mag) * 16777216.0f;
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(q));
  }
  const std::uint32_t e = (mag >> 23) - 127 + 15;
  return static_cast<std::uint16_t>(sign | (e << 10) | ((mag >> 13) & 0x3ffu));
}

float fp16_value(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e - 15 + 127) << 23) | (m << 13));
}

std::uint16_t bf16_bits(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  return static_cast<std::uint16_t>(u >> 16);
}

float bf16_value(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

std::vector<std::uint8_t> encode(DType dt, const std::vector<float>& v) {
  std::vector<std::uint8_t> out(v.size() * dtype_bytes(dt));
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!std::isnan(v[i]) && round_to(dt, v[i]) != v[i])
      throw std::logic_error("test input not representable in " + std::string(dtype_name(dt)));
    if (dt == DType::fp32 || dt == DType::tf32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const std::uint16_t h = dt == DType::fp16 ? fp16_bits(v[i]) : bf16_bits(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

std::vector<float> decode(DType dt, const std::vector<std::uint8_t>& bytes, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (dt == DType::fp32 || dt == DType::tf32) {
      std::memcpy(&v[i], bytes.data() + 4 * i, 4);
    } else {
      std::uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      v[i] = dt == DType::fp16 ? fp16_value(h) : bf16_value(h);
    }
  }
  return v;
}

DeviceBuffer to_device(DType dt, const std::vector<float>& v) {
  const auto bytes = encode(dt, v);
  DeviceBuffer d(bytes.size());
  d.upload(bytes.data(), bytes.size());
  return d;
}

std::vector<float> from_device(DType dt, const DeviceBuffer& d, std::size_t n) {
  std::vector<std::uint8_t> bytes(n * dtype_bytes(dt));
  d.download(bytes.data(), bytes.size());
  return decode(dt, bytes, n);
}

template <class T>
DeviceBuffer to_device_raw(const std::vector<T>& v) {
  DeviceBuffer d(v.size() * sizeof(T));
  d.upload(v.data(), v.size() * sizeof(T));
  return d;
}

template <class T>
std::vector<T> from_device_raw(const DeviceBuffer& d, std::size_t n) {
  std::vector<T> v(n);
  d.download(v.data(), n * sizeof(T));
  return v;
}

// ---------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------
// n normal values rounded to the format (so exactly representable); never all zeros.
std::vector<float> randn(DType dt, std::size_t n, std::mt19937& rng, double mean = 0.0, double sd = 1.0) {
  std::normal_distribution<double> nd(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = round_to(dt == DType::tf32 ? DType::fp32 : dt, static_cast<float>(nd(rng)));
  return v;
}

std::vector<std::int32_t> random_ids(std::size_t n, int V, std::mt19937& rng) {
  std::uniform_int_distribution<int> ud(0, V - 1);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = ud(rng);
  return v;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ---------------------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------------------
// |got_i - ref_i| <= tol(i) for every i (a NaN fails); reports the count and the worst element.
template <class Tol>
void expect_within(const std::string& what, const std::vector<float>& got, const std::vector<double>& ref, Tol&& tol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t bad = 0, worst_i = 0;
  double worst = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double t = tol(i), err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(err <= t)) ++bad;
    const double ratio = std::isnan(err) ? std::numeric_limits<double>::infinity()
                         : t > 0         ? err / t
                         : err > 0       ? std::numeric_limits<double>::infinity()
                                         : 0.0;
    if (ratio > worst) {
      worst = ratio;
      worst_i = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements outside the tolerance; worst at ["
                     << worst_i << "]: got " << got[worst_i] << ", reference " << ref[worst_i] << ", tolerance "
                     << tol(worst_i);
}

// Bit-identical, except that any NaN matches any NaN.
void expect_identical(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool same = (std::isnan(got[i]) && std::isnan(ref[i])) ||
                      std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(ref[i]);
    if (!same && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ; first at [" << first
                     << "]: got " << got[first] << ", reference " << ref[first];
}

std::vector<float> rounded(DType dt, std::vector<float> v) {
  for (float& x : v) x = round_to(dt, x);
  return v;
}

// ---------------------------------------------------------------------------------------
// Shapes: small, with every awkward edge (rows not a multiple of the 8 rows per block, widths not
// a multiple of the 32 lanes, a vocabulary not a multiple of the 256 threads per row).
// ---------------------------------------------------------------------------------------
constexpr int kB = 3, kT = 40, kC = 80, kV = 97;
constexpr int kN = kB * kT;

// fp32 error bound of the row and column reductions, relative to the sum of the terms'
// magnitudes: per-lane (or per-thread) sequential sums of at most ceil(len/32) terms, then at most
// 32 more additions in a tree or in order, plus a few roundings of the elementwise work around them:
// (len/32 + 32 + 8) u32 <= 1e-5 for every length in these tests (<= 1288 columns, <= 300 rows).
constexpr double kReduce = 1e-5;

// =======================================================================================
// Embedding
// =======================================================================================
TEST_P(GpuByDType, EmbeddingForwardIsIdenticalToTheCpu) {
  const DType dt = GetParam();
  std::mt19937 rng(101);
  const auto wte = randn(dt, std::size_t(kV) * kC, rng, 0, 0.5), wpe = randn(dt, std::size_t(kT) * kC, rng, 0, 0.5);
  auto tokens = random_ids(kN, kV, rng);
  std::vector<float> ref(std::size_t(kN) * kC);
  L::embedding_forward<float>(ref.data(), tokens.data(), wte.data(), wpe.data(), kB, kT, kC);
  ref = rounded(dt, ref);  // the float sum rounded to the format, as the stage model does

  auto d_wte = to_device(dt, wte), d_wpe = to_device(dt, wpe), d_tok = to_device_raw(tokens);
  DeviceBuffer d_out(ref.size() * dtype_bytes(dt));
  embedding_forward(d_out.data(), d_tok.as<std::int32_t>(), d_wte.data(), d_wpe.data(), kB, kT, kC, kV, dt, nullptr);
  synchronize();
  expect_identical("embedding output", from_device(dt, d_out, ref.size()), ref);

  // A token outside the vocabulary poisons its row (NaN) and nothing else.
  tokens[7] = kV;
  d_tok.upload(tokens.data(), tokens.size() * sizeof(std::int32_t));
  embedding_forward(d_out.data(), d_tok.as<std::int32_t>(), d_wte.data(), d_wpe.data(), kB, kT, kC, kV, dt, nullptr);
  synchronize();
  const auto got = from_device(dt, d_out, ref.size());
  for (int c = 0; c < kC; ++c) EXPECT_TRUE(std::isnan(got[7 * kC + c])) << "column " << c;
  EXPECT_EQ(got[6 * kC], ref[6 * kC]);
}

TEST_P(GpuByDType, EmbeddingBackwardIsIdenticalToTheCpu) {
  const DType dt = GetParam();
  std::mt19937 rng(102);
  auto tokens = random_ids(kN, kV, rng);
  for (int n : {3, 17, 18, 64, 119}) tokens[n] = 5;  // one token many times: the order of its sums matters
  const auto dout = randn(dt, std::size_t(kN) * kC, rng);
  // Gradients accumulate: start from nonzero fp32 buffers.
  auto dwte = randn(DType::fp32, std::size_t(kV) * kC, rng, 0, 0.1),
       dwpe = randn(DType::fp32, std::size_t(kT) * kC, rng, 0, 0.1);

  auto d_dout = to_device(dt, dout), d_tok = to_device_raw(tokens);
  auto d_dwte = to_device(DType::fp32, dwte), d_dwpe = to_device(DType::fp32, dwpe);
  embedding_backward(d_dwte.as<float>(), d_dwpe.as<float>(), d_dout.data(), d_tok.as<std::int32_t>(), kB, kT, kC, kV,
                     dt, nullptr);
  synchronize();
  L::embedding_backward<float>(dwte.data(), dwpe.data(), dout.data(), tokens.data(), kB, kT, kC);
  expect_identical("dwte", from_device(DType::fp32, d_dwte, dwte.size()), dwte);
  expect_identical("dwpe", from_device(DType::fp32, d_dwpe, dwpe.size()), dwpe);
}

// Text's skew: one token in most positions (runs longer than the kernel's batches of loads, and
// a remainder), a row wider than one block of columns and no whole number of them.
TEST_P(GpuByDType, EmbeddingBackwardOfASkewedBatchIsIdenticalToTheCpu) {
  const DType dt = GetParam();
  constexpr int B = 4, T = 61, C = 300, V = 11;
  std::mt19937 rng(103);
  auto tokens = random_ids(B * T, V, rng);
  for (int n = 0; n < B * T; n += 2) tokens[n] = 7;  // ~130 of 244 positions
  tokens[5] = -3, tokens[200] = V + 5;               // outside the vocabulary: no row, their positions still summed
  const auto dout = randn(dt, std::size_t(B) * T * C, rng);
  auto dwte = randn(DType::fp32, std::size_t(V) * C, rng, 0, 0.1), dwpe = randn(DType::fp32, std::size_t(T) * C, rng, 0, 0.1);
  auto d_dout = to_device(dt, dout), d_tok = to_device_raw(tokens);
  auto d_dwte = to_device(DType::fp32, dwte), d_dwpe = to_device(DType::fp32, dwpe);
  embedding_backward(d_dwte.as<float>(), d_dwpe.as<float>(), d_dout.data(), d_tok.as<std::int32_t>(), B, T, C, V, dt,
                     nullptr);
  synchronize();
  // The CPU layer indexes any token: the reference sends the two outside ones to a row past the
  // vocabulary, which the device's result does not have.
  auto ref_tokens = tokens;
  ref_tokens[5] = ref_tokens[200] = V;
  dwte.resize(std::size_t(V + 1) * C, 0.0f);
  L::embedding_backward<float>(dwte.data(), dwpe.data(), dout.data(), ref_tokens.data(), B, T, C);
  dwte.resize(std::size_t(V) * C);
  expect_identical("dwte", from_device(DType::fp32, d_dwte, dwte.size()), dwte);
  expect_identical("dwpe", from_device(DType::fp32, d_dwpe, dwpe.size()), dwpe);
}

// =======================================================================================
// LayerNorm
// =======================================================================================
struct RowShape {
  int N, C;
};
// The stage's (N, C), a wide row (GPT-2 small's hidden size: 24 columns per lane), a row wider
// than a lane's registers hold (1288 columns: read again for each pass), and a row that is no
// whole number of 16-byte packs (element by element) over more rows than one column chunk
// (kernels/norm_softmax.cu: 64 rows packed, 128 not).
const RowShape kRowShapes[] = {{kN, kC}, {64, 768}, {16, 1288}, {300, 100}};

TEST_P(GpuByDType, LayerNormForwardMatchesLayers) {
  const DType dt = GetParam();
  const double u = unit_roundoff_of(dt), sub = subnormal_half_spacing(dt);
  std::mt19937 rng(201);
  for (const auto [N, C] : kRowShapes) {
    SCOPED_TRACE("N " + std::to_string(N) + ", C " + std::to_string(C));
    // An offset mean, so the two-pass variance matters.
    const auto x = randn(dt, std::size_t(N) * C, rng, 0.5, 2.0);
    const auto gamma = randn(dt, C, rng, 1.0, 0.3), beta = randn(dt, C, rng, 0.0, 0.3);
    std::vector<double> out(x.size()), mean(N), rstd(N);
    const auto xd = to_double(x), gd = to_double(gamma), bd = to_double(beta);
    L::layernorm_forward<double>(out.data(), mean.data(), rstd.data(), xd.data(), gd.data(), bd.data(), N, C);

    auto d_x = to_device(dt, x), d_g = to_device(dt, gamma), d_b = to_device(dt, beta);
    DeviceBuffer d_out(x.size() * dtype_bytes(dt)), d_mean(N * 4), d_rstd(N * 4);
    layernorm_forward(d_out.data(), d_mean.as<float>(), d_rstd.as<float>(), d_x.data(), d_g.data(), d_b.data(), N, C,
                      dt, nullptr);
    synchronize();

    std::vector<double> mean_abs(N, 0.0);
    for (int n = 0; n < N; ++n) {
      for (int c = 0; c < C; ++c) mean_abs[n] += std::fabs(xd[std::size_t(n) * C + c]);
      mean_abs[n] /= C;
    }
    // mean: a sum of C terms; rstd: from a sum of C squares (the mean's error enters only at
    // second order); out: (x - mean) * rstd * gamma + beta, whose error is the mean's, scaled by
    // rstd, plus rstd's relative error on xhat, plus a few roundings.
    expect_within("mean", from_device(DType::fp32, d_mean, N), mean,
                  [&](std::size_t n) { return kReduce * mean_abs[n]; });
    expect_within("rstd", from_device(DType::fp32, d_rstd, N), rstd, [&](std::size_t n) { return kReduce * rstd[n]; });
    expect_within("output", from_device(dt, d_out, x.size()), out, [&](std::size_t i) {
      const std::size_t n = i / C, c = i % C;
      const double xhat = (xd[i] - mean[n]) * rstd[n];
      const double e32 = kReduce * (std::fabs(gd[c]) * (std::fabs(xhat) + rstd[n] * mean_abs[n]) + std::fabs(bd[c]));
      return u * std::fabs(out[i]) + 2 * e32 + sub;
    });
  }
}

TEST_P(GpuByDType, LayerNormBackwardInputMatchesLayers) {
  const DType dt = GetParam();
  const double u = unit_roundoff_of(dt), sub = subnormal_half_spacing(dt);
  std::mt19937 rng(202);
  for (const auto [N, C] : kRowShapes) {
    for (const bool with_residual : {false, true}) {
      SCOPED_TRACE("N " + std::to_string(N) + ", C " + std::to_string(C) + (with_residual ? ", residual" : ""));
      const auto x = randn(dt, std::size_t(N) * C, rng, 0.5, 2.0), dout = randn(dt, x.size(), rng);
      const auto gamma = randn(dt, C, rng, 1.0, 0.3), dres = randn(dt, x.size(), rng);
      const auto xd = to_double(x), dyd = to_double(dout), gd = to_double(gamma), rd = to_double(dres);
      // The statistics as the GPU receives them: fp32 (from the exact forward).
      std::vector<double> tmp(x.size()), mean(N), rstd(N);
      const std::vector<double> zeros(C, 0.0);
      L::layernorm_forward<double>(tmp.data(), mean.data(), rstd.data(), xd.data(), gd.data(), zeros.data(), N, C);
      std::vector<float> mean_f(mean.begin(), mean.end()), rstd_f(rstd.begin(), rstd.end());
      mean = to_double(mean_f);
      rstd = to_double(rstd_f);
      std::vector<double> ref(x.size());
      L::layernorm_backward_input<double>(ref.data(), dyd.data(), xd.data(), mean.data(), rstd.data(), gd.data(),
                                          with_residual ? rd.data() : nullptr, N, C);

      auto d_x = to_device(dt, x), d_dy = to_device(dt, dout), d_g = to_device(dt, gamma);
      auto d_mean = to_device(DType::fp32, mean_f), d_rstd = to_device(DType::fp32, rstd_f);
      auto d_dx = to_device(dt, dres);  // with a residual: dx is the residual buffer (in place)
      layernorm_backward_input(d_dx.data(), d_dy.data(), d_x.data(), d_mean.as<float>(), d_rstd.as<float>(), d_g.data(),
                               with_residual ? d_dx.data() : nullptr, N, C, dt, nullptr);
      synchronize();

      // dx = dres + (dn - mean(dn) - xhat * mean(dn xhat)) * rstd, dn = dout * gamma: the two row
      // means carry the reduction error of their terms' magnitudes.
      std::vector<double> mean_abs_dn(N, 0.0), mean_abs_dnx(N, 0.0);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::size_t n = i / C, c = i % C;
        const double dn = dyd[i] * gd[c], xhat = (xd[i] - mean[n]) * rstd[n];
        mean_abs_dn[n] += std::fabs(dn) / C;
        mean_abs_dnx[n] += std::fabs(dn * xhat) / C;
      }
      expect_within("dx", from_device(dt, d_dx, x.size()), ref, [&](std::size_t i) {
        const std::size_t n = i / C, c = i % C;
        const double dn = dyd[i] * gd[c], xhat = (xd[i] - mean[n]) * rstd[n];
        const double mag = (with_residual ? std::fabs(rd[i]) : 0.0) +
                           rstd[n] * (std::fabs(dn) + mean_abs_dn[n] + std::fabs(xhat) * mean_abs_dnx[n]);
        return u * std::fabs(ref[i]) + 2 * kReduce * mag + sub;
      });
    }
  }
}

TEST_P(GpuByDType, LayerNormBackwardWeightMatchesLayers) {
  const DType dt = GetParam();
  std::mt19937 rng(203);
  for (const auto [N, C] : kRowShapes) {
    SCOPED_TRACE("N " + std::to_string(N) + ", C " + std::to_string(C));
    const auto x = randn(dt, std::size_t(N) * C, rng, 0.5, 2.0), dout = randn(dt, x.size(), rng);
    std::vector<float> mean_f(N), rstd_f(N);
    for (int n = 0; n < N; ++n) {  // any positive statistics will do for the weight gradient
      mean_f[n] = static_cast<float>(0.5 + 0.01 * n);
      rstd_f[n] = static_cast<float>(0.4 + 0.003 * n);
    }
    const auto dg0 = randn(DType::fp32, C, rng, 0, 0.5), db0 = randn(DType::fp32, C, rng, 0, 0.5);
    auto dg = to_double(dg0), db = to_double(db0);
    const auto xd = to_double(x), dyd = to_double(dout), meand = to_double(mean_f), rstdd = to_double(rstd_f);
    L::layernorm_backward_weight<double>(dg.data(), db.data(), dyd.data(), xd.data(), meand.data(), rstdd.data(), N, C);

    auto d_x = to_device(dt, x), d_dy = to_device(dt, dout), d_mean = to_device(DType::fp32, mean_f),
         d_rstd = to_device(DType::fp32, rstd_f), d_dg = to_device(DType::fp32, dg0),
         d_db = to_device(DType::fp32, db0);
    layernorm_backward_weight(d_dg.as<float>(), d_db.as<float>(), d_dy.data(), d_x.data(), d_mean.as<float>(),
                              d_rstd.as<float>(), N, C, dt, nullptr);
    synchronize();

    // Column sums over N rows: the reduction error relative to the sum of the terms' magnitudes.
    std::vector<double> mag_g(C), mag_b(C);
    for (int c = 0; c < C; ++c) {
      mag_g[c] = std::fabs(dg0[c]);
      mag_b[c] = std::fabs(db0[c]);
    }
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::size_t n = i / C, c = i % C;
      mag_g[c] += std::fabs(dyd[i] * (xd[i] - meand[n]) * rstdd[n]);
      mag_b[c] += std::fabs(dyd[i]);
    }
    expect_within("dgamma", from_device(DType::fp32, d_dg, C), dg,
                  [&](std::size_t c) { return kU32 * std::fabs(dg[c]) + 2 * kReduce * mag_g[c]; });
    expect_within("dbeta", from_device(DType::fp32, d_db, C), db,
                  [&](std::size_t c) { return kU32 * std::fabs(db[c]) + 2 * kReduce * mag_b[c]; });
  }
}

TEST_P(GpuByDType, BiasBackwardMatchesLayers) {
  const DType dt = GetParam();
  std::mt19937 rng(204);
  const int N = kN, OC = 3 * kC;  // the qkv projection's bias
  const auto dy = randn(dt, std::size_t(N) * OC, rng);
  const auto db0 = randn(DType::fp32, OC, rng, 0, 0.5);
  // layers::linear_backward_weight computes the bias gradient along with the weight's; a zero x
  // of width 1 leaves only the column sums of dy, which is the reference here.
  std::vector<double> dw(OC, 0.0), db = to_double(db0), x1(N, 0.0);
  const auto dyd = to_double(dy);
  L::linear_backward_weight<double>(dw.data(), db.data(), dyd.data(), x1.data(), N, 1, OC, true);

  auto d_dy = to_device(dt, dy), d_db = to_device(DType::fp32, db0);
  bias_backward(d_db.as<float>(), d_dy.data(), N, OC, dt, nullptr);
  synchronize();
  std::vector<double> mag(OC);
  for (int o = 0; o < OC; ++o) mag[o] = std::fabs(db0[o]);
  for (std::size_t i = 0; i < dy.size(); ++i) mag[i % OC] += std::fabs(dyd[i]);
  expect_within("db", from_device(DType::fp32, d_db, OC), db,
                [&](std::size_t o) { return kU32 * std::fabs(db[o]) + 2 * kReduce * mag[o]; });
}

// =======================================================================================
// GELU
// =======================================================================================
// fp32 error: tanhf is within 2 ulp; near the tails 1 + tanh and 1 - tanh^2 cancel, so their
// absolute error (a few ulp of 1, i.e. <= 8 u32) is multiplied by 0.5|x| (forward) or by
// |dy| (1 + |x| s (1 + 3c x^2)) (backward); a few more roundings of the result. Bound used:
// 16 u32 times (|ref| + those magnitudes), twice what the sum of the terms gives.
TEST_P(GpuByDType, GeluForwardAndBackwardMatchLayers) {
  const DType dt = GetParam();
  const double u = unit_roundoff_of(dt), sub = subnormal_half_spacing(dt);
  std::mt19937 rng(301);
  const std::size_t n = 10007;  // not a multiple of the block
  const auto x = randn(dt, n, rng, 0.0, 2.5), dy = randn(dt, n, rng);
  const auto xd = to_double(x), dyd = to_double(dy);
  std::vector<double> y(n), dx(n);
  L::gelu_forward<double>(y.data(), xd.data(), n);
  L::gelu_backward<double>(dx.data(), xd.data(), dyd.data(), n);

  auto d_x = to_device(dt, x), d_dy = to_device(dt, dy);
  DeviceBuffer d_y(n * dtype_bytes(dt)), d_dx(n * dtype_bytes(dt));
  gelu_forward(d_y.data(), d_x.data(), n, dt, nullptr);
  gelu_backward(d_dx.data(), d_x.data(), d_dy.data(), n, dt, nullptr);
  synchronize();
  expect_within("gelu", from_device(dt, d_y, n), y, [&](std::size_t i) {
    const double e32 = 16 * kU32 * (std::fabs(y[i]) + 0.5 * std::fabs(xd[i]));
    return u * std::fabs(y[i]) + 2 * e32 + sub;
  });
  auto dx_tol = [&](std::size_t i) {
    const double a = std::fabs(xd[i]);
    const double e32 = 16 * kU32 * (std::fabs(dx[i]) + std::fabs(dyd[i]) * (1 + a * (1 + 0.134 * a * a)));
    return u * std::fabs(dx[i]) + 2 * e32 + sub;
  };
  expect_within("gelu backward", from_device(dt, d_dx, n), dx, dx_tol);

  // In place: dx written over dy.
  gelu_backward(d_dy.data(), d_x.data(), d_dy.data(), n, dt, nullptr);
  synchronize();
  expect_within("gelu backward in place", from_device(dt, d_dy, n), dx, dx_tol);
}

// =======================================================================================
// Causal softmax, against layers::attention_forward/backward: its `post` callable sees every
// row of the scores before the softmax and of the softmax's output gradient before the backward,
// so the test writes its own random rows there and reads back what layers.h computes from them.
// =======================================================================================
constexpr int kAttB = 2, kAttH = 3, kAttHs = 16, kAttC = kAttH * kAttHs;  // 1/sqrt(16) is exact
constexpr int kAttBH = kAttB * kAttH;
// Sequence lengths: rows of 16-byte packs (64) and rows that are not (70, element by element).
const int kAttTs[] = {70, 64};

// Reference softmax of `scores` (BH, T, T) scaled by `scale`, computed by layers::attention_forward.
std::vector<double> reference_softmax(const std::vector<float>& scores, int T, double scale, std::mt19937& rng) {
  const int B = kAttB, C = kAttC, H = kAttH;
  const auto qkv = to_double(randn(DType::fp32, std::size_t(B) * T * 3 * C, rng));
  std::vector<double> out(std::size_t(B) * T * C), probs(std::size_t(kAttBH) * T * T), scratch(std::size_t(T) * T);
  std::size_t row = 0;  // rows come in (b, h, i) order
  L::attention_forward<double>(out.data(), probs.data(), scratch.data(), qkv.data(), B, T, C, H,
                               [&](double* r, int n, L::AttnTensor t) {
                                 if (t == L::AttnTensor::scores) {
                                   for (int j = 0; j < n; ++j) r[j] = scale * scores[row * T + j];
                                 } else if (t == L::AttnTensor::probs) {
                                   ++row;
                                 }
                               });
  return probs;
}

// fp32 error of one probability p_j: expf within 2 ulp, its argument's rounding u|z_j - max|
// amplified by exp, the row sum over at most ceil(T/32) terms per lane plus a 5-level tree,
// the reciprocal and the product: (|z_j - max| + T/32 + 12) u32 relative; twice that is used.
TEST_P(GpuByDType, CausalSoftmaxForwardMatchesLayers) {
  const DType dt = GetParam();
  const double u = unit_roundoff_of(dt), sub = subnormal_half_spacing(dt);
  std::mt19937 rng(401);
  for (const int T : kAttTs)
  for (const float scale : {1.0f, 0.125f}) {  // 1: as layers.h (scale in the product); 0.125: exact in both
    SCOPED_TRACE("T " + std::to_string(T) + ", scale " + std::to_string(scale));
    const auto scores = randn(dt, std::size_t(kAttBH) * T * T, rng, 0.0, 2.0);  // above the diagonal too: ignored
    const auto ref = reference_softmax(scores, T, scale, rng);
    auto tol = [&](std::size_t i) {
      const std::size_t r = i / T;
      const int row_i = static_cast<int>(r % T), j = static_cast<int>(i % T);
      if (j > row_i) return 0.0;  // exactly zero above the diagonal
      double mx = -INFINITY;
      for (int k = 0; k <= row_i; ++k) mx = std::max(mx, double(scale) * scores[r * T + k]);
      const double z = double(scale) * scores[i];
      const double e32 = 2 * kU32 * ref[i] * (std::fabs(z - mx) + T / 32.0 + 16);
      return u * ref[i] + 2 * e32 + sub;
    };
    auto d_s = to_device(dt, scores);
    DeviceBuffer d_p(scores.size() * dtype_bytes(dt));
    causal_softmax_forward(d_p.data(), d_s.data(), kAttBH, T, scale, dt, nullptr);
    synchronize();
    expect_within("probs", from_device(dt, d_p, scores.size()), ref, tol);
    // In place: the probabilities written over the scores.
    causal_softmax_forward(d_s.data(), d_s.data(), kAttBH, T, scale, dt, nullptr);
    synchronize();
    expect_within("probs in place", from_device(dt, d_s, scores.size()), ref, tol);
  }
}

// fp32 error of ds_j = p_j (dp_j - dot) scale: the dot product over <= T terms ((T/32 + 6) u32 of
// sum |p dp|), the subtraction and two products (3 u32 of |dp_j| + |dot|); twice that is used.
TEST_P(GpuByDType, CausalSoftmaxBackwardMatchesLayers) {
  const DType dt = GetParam();
  const double u = unit_roundoff_of(dt), sub = subnormal_half_spacing(dt);
  const int B = kAttB, C = kAttC, H = kAttH;
  const float scale = 0.25f;  // 1/sqrt(hs), as attention_backward computes it (exact for hs = 16)
  std::mt19937 rng(402);
  for (const int T : kAttTs) {
  SCOPED_TRACE("T " + std::to_string(T));
  // Realistic probabilities: the softmax of random scores, rounded to the format.
  const auto scores = randn(DType::fp32, std::size_t(kAttBH) * T * T, rng, 0.0, 2.0);
  const auto p_exact = reference_softmax(scores, T, 1.0, rng);
  std::vector<float> probs(p_exact.size());
  for (std::size_t i = 0; i < probs.size(); ++i) probs[i] = round_to(dt, static_cast<float>(p_exact[i]));
  const auto dprobs = randn(dt, probs.size(), rng);

  const auto qkv = to_double(randn(DType::fp32, std::size_t(B) * T * 3 * C, rng));
  const auto dout = to_double(randn(DType::fp32, std::size_t(B) * T * C, rng));
  const auto pd = to_double(probs);
  std::vector<double> dqkv(qkv.size()), scratch(std::size_t(T) * T), ref(probs.size(), 0.0);
  std::size_t row = 0;
  L::attention_backward<double>(dqkv.data(), scratch.data(), dout.data(), qkv.data(), pd.data(), B, T, C, H,
                                [&](double* r, int n, L::AttnTensor t) {
                                  if (t == L::AttnTensor::probs_grad) {
                                    for (int j = 0; j < n; ++j) r[j] = dprobs[row * T + j];
                                  } else if (t == L::AttnTensor::scores_grad) {
                                    for (int j = 0; j < n; ++j) ref[row * T + j] = r[j];
                                    ++row;
                                  }
                                });
  ASSERT_EQ(row, std::size_t(kAttBH) * T);

  auto tol = [&](std::size_t i) {
    const std::size_t r = i / T;
    const int row_i = static_cast<int>(r % T), j = static_cast<int>(i % T);
    if (j > row_i) return 0.0;
    double dot = 0, mag = 0;
    for (int k = 0; k <= row_i; ++k) {
      dot += pd[r * T + k] * dprobs[r * T + k];
      mag += std::fabs(pd[r * T + k] * dprobs[r * T + k]);
    }
    const double e32 =
        2 * scale * pd[i] * ((T / 32.0 + 8) * kU32 * mag + 3 * kU32 * (std::fabs(dprobs[i]) + std::fabs(dot)));
    return u * std::fabs(ref[i]) + 2 * e32 + sub;
  };
  auto d_p = to_device(dt, probs), d_dp = to_device(dt, dprobs);
  DeviceBuffer d_ds(probs.size() * dtype_bytes(dt));
  causal_softmax_backward(d_ds.data(), d_p.data(), d_dp.data(), kAttBH, T, scale, dt, nullptr);
  synchronize();
  expect_within("dscores", from_device(dt, d_ds, probs.size()), ref, tol);
  causal_softmax_backward(d_dp.data(), d_p.data(), d_dp.data(), kAttBH, T, scale, dt, nullptr);  // in place
  synchronize();
  expect_within("dscores in place", from_device(dt, d_dp, probs.size()), ref, tol);
  }
}

// =======================================================================================
// Cross-entropy
// =======================================================================================
// fp32 error of lse = max + log(sum exp(l - max)): the block sum of V positive terms
// (ceil(V/256) per thread, then 10 tree levels) is within (V/256 + 10) u32 relative, each term
// within (|l - max| + 4) u32 (argument rounding, expf's 2 ulp), log adds an ulp, the final add
// u32 |lse|: e32 = (|lse| + max|l - max| + V/256 + 16) u32; twice that is used.
constexpr int kCeN = 128;  // rows; 1/128 is exact, so the backward's scale is the same in fp32 and double
const int kCeVocab[] = {kV, 1000};

TEST_P(GpuByDType, CrossEntropyForwardMatchesLayers) {
  const DType dt = GetParam();
  std::mt19937 rng(501);
  for (const int V : kCeVocab) {
    SCOPED_TRACE("V " + std::to_string(V));
    const int N = kCeN;
    const auto logits = randn(dt, std::size_t(N) * V, rng, 0.0, 2.0);
    auto targets = random_ids(N, V, rng);
    const auto ld = to_double(logits);
    std::vector<double> lse(N);
    const double mean_loss = L::cross_entropy_forward<double>(lse.data(), ld.data(), targets.data(), N, V);
    std::vector<double> loss(N), e_lse(N);
    for (int n = 0; n < N; ++n) {
      double mx = -INFINITY, mn = INFINITY;
      for (int j = 0; j < V; ++j) {
        mx = std::max(mx, ld[std::size_t(n) * V + j]);
        mn = std::min(mn, ld[std::size_t(n) * V + j]);
      }
      loss[n] = lse[n] - ld[std::size_t(n) * V + targets[n]];
      e_lse[n] = 2 * kU32 * (std::fabs(lse[n]) + (mx - mn) + V / 256.0 + 16);
    }

    auto d_l = to_device(dt, logits), d_t = to_device_raw(targets);
    DeviceBuffer d_loss(N * 4), d_lse(N * 4), d_mean(8), d_scratch(kReductionScratchDoubles * 8);
    cross_entropy_forward(d_loss.as<float>(), d_lse.as<float>(), d_l.data(), d_t.as<std::int32_t>(), N, V, dt, nullptr);
    sum(d_mean.as<double>(), d_loss.as<float>(), N, d_scratch.as<double>(), false, nullptr);
    synchronize();
    expect_within("lse", from_device(DType::fp32, d_lse, N), lse,
                  [&](std::size_t n) { return kU32 * std::fabs(lse[n]) + 2 * e_lse[n]; });
    expect_within("loss", from_device(DType::fp32, d_loss, N), loss,
                  [&](std::size_t n) { return kU32 * std::fabs(loss[n]) + 2 * e_lse[n]; });
    const double got_mean = from_device_raw<double>(d_mean, 1)[0] / N;
    const double worst = *std::max_element(e_lse.begin(), e_lse.end());
    EXPECT_NEAR(got_mean, mean_loss, kU32 * std::fabs(mean_loss) + 2 * worst) << "mean loss";

    // A target outside the vocabulary gives a NaN loss for its row only.
    targets[3] = V;
    d_t.upload(targets.data(), targets.size() * sizeof(std::int32_t));
    cross_entropy_forward(d_loss.as<float>(), d_lse.as<float>(), d_l.data(), d_t.as<std::int32_t>(), N, V, dt, nullptr);
    synchronize();
    const auto got = from_device(DType::fp32, d_loss, N);
    EXPECT_TRUE(std::isnan(got[3]));
    EXPECT_FALSE(std::isnan(got[2]));
  }
}

// fp32 error of d = exp(l - lse) scale - [target] scale: expf's argument rounding and 2 ulp,
// (|l - lse| + 4) u32 of the probability, the product and the subtraction 2 u32 of |scale|;
// twice that is used.
TEST_P(GpuByDType, CrossEntropyBackwardMatchesLayers) {
  const DType dt = GetParam();
  const double u = unit_roundoff_of(dt), sub = subnormal_half_spacing(dt);
  std::mt19937 rng(502);
  for (const int V : kCeVocab) {
    SCOPED_TRACE("V " + std::to_string(V));
    const int N = kCeN;
    // The stage model's scale: loss scale / micro-batches, divided by the rows for the mean.
    const float scale = 1024.0f / 4.0f / static_cast<float>(N);
    const auto logits = randn(dt, std::size_t(N) * V, rng, 0.0, 2.0);
    const auto targets = random_ids(N, V, rng);
    const auto ld = to_double(logits);
    std::vector<double> lse(N);
    L::cross_entropy_forward<double>(lse.data(), ld.data(), targets.data(), N, V);
    std::vector<float> lse_f(lse.begin(), lse.end());  // the backward reads fp32 lse
    const auto lsed = to_double(lse_f);
    std::vector<double> ref(logits.size());
    L::cross_entropy_backward<double>(ref.data(), ld.data(), lsed.data(), targets.data(), N, V, double(scale));

    auto tol = [&](std::size_t i) {
      const std::size_t n = i / V;
      const double z = ld[i] - lsed[n], p = std::exp(z);
      const double e32 = 2 * kU32 * scale * (p * (std::fabs(z) + 4) + 2);
      return u * std::fabs(ref[i]) + 2 * e32 + sub;
    };
    auto d_l = to_device(dt, logits), d_t = to_device_raw(targets), d_lse = to_device(DType::fp32, lse_f);
    DeviceBuffer d_d(logits.size() * dtype_bytes(dt));
    cross_entropy_backward(d_d.data(), d_l.data(), d_lse.as<float>(), d_t.as<std::int32_t>(), N, V, scale, dt, nullptr);
    synchronize();
    expect_within("dlogits", from_device(dt, d_d, logits.size()), ref, tol);
    cross_entropy_backward(d_l.data(), d_l.data(), d_lse.as<float>(), d_t.as<std::int32_t>(), N, V, scale, dt,
                           nullptr);  // in place, over the logits
    synchronize();
    expect_within("dlogits in place", from_device(dt, d_l, logits.size()), ref, tol);
  }
}

// =======================================================================================
// Elementwise: one fp32 operation and one rounding, as the CPU does them: exact.
// =======================================================================================
TEST_P(GpuByDType, ResidualAddIsIdenticalToTheCpu) {
  const DType dt = GetParam();
  std::mt19937 rng(601);
  const std::size_t n = 10007;
  const auto a = randn(dt, n, rng), b = randn(dt, n, rng, 0.0, 0.1);
  std::vector<float> ref(n);
  for (std::size_t i = 0; i < n; ++i) ref[i] = round_to(dt, a[i] + b[i]);  // Row + Row in float, then finish()
  auto d_a = to_device(dt, a), d_b = to_device(dt, b);
  DeviceBuffer d_out(n * dtype_bytes(dt));
  residual_add(d_out.data(), d_a.data(), d_b.data(), n, dt, nullptr);
  residual_add(d_a.data(), d_a.data(), d_b.data(), n, dt, nullptr);  // in place
  synchronize();
  expect_identical("residual", from_device(dt, d_out, n), ref);
  expect_identical("residual in place", from_device(dt, d_a, n), ref);
}

// The packed path (16-byte accesses, taken where every operand is aligned) and the one-element
// path (here: every operand one element off alignment) do the same arithmetic on each element:
// the same bits. The aligned results are checked against the CPU by the tests above.
TEST_P(GpuByDType, ElementwiseKernelsGiveTheSameBitsOffAlignment) {
  const DType dt = GetParam();
  const std::size_t n = 1003, e = dtype_bytes(dt);
  std::mt19937 rng(612);
  const auto x = randn(dt, n, rng, 0.0, 2.0), y = randn(dt, n, rng);
  auto shifted = [&](const std::vector<float>& v) {  // v one element past a 16-byte boundary
    std::vector<float> s(v.size() + 1, 0.0f);
    std::copy(v.begin(), v.end(), s.begin() + 1);
    return to_device(dt, s);
  };
  auto off = [&](DeviceBuffer& b) { return static_cast<void*>(b.as<std::uint8_t>() + e); };
  auto x0 = to_device(dt, x), x1 = shifted(x), y0 = to_device(dt, y), y1 = shifted(y);
  DeviceBuffer o0(n * e), o1((n + 1) * e);
  auto same = [&](const std::string& what, DeviceBuffer& aligned, DeviceBuffer& unaligned, std::size_t count) {
    synchronize();
    auto b = from_device(dt, unaligned, count + 1);
    b.erase(b.begin());
    expect_identical(what, from_device(dt, aligned, count), b);
  };
  gelu_forward(o0.data(), x0.data(), n, dt, nullptr);
  gelu_forward(off(o1), off(x1), n, dt, nullptr);
  same("gelu forward", o0, o1, n);
  gelu_backward(o0.data(), x0.data(), y0.data(), n, dt, nullptr);
  gelu_backward(off(o1), off(x1), off(y1), n, dt, nullptr);
  same("gelu backward", o0, o1, n);
  residual_add(o0.data(), x0.data(), y0.data(), n, dt, nullptr);
  residual_add(off(o1), off(x1), off(y1), n, dt, nullptr);
  same("residual add", o0, o1, n);
  // Rows of 8 columns (a whole pack when aligned): a bias, then the embedding's lookups.
  const int rows = 125, cols = 8;
  add_bias(o0.data(), y0.data(), rows, cols, dt, nullptr);
  add_bias(off(o1), off(y1), rows, cols, dt, nullptr);
  same("bias", o0, o1, n);
  std::vector<std::int32_t> tokens(rows);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 9);  // 8 is outside a vocabulary of 8: NaN
  auto d_tok = to_device_raw(tokens);
  embedding_forward(o0.data(), d_tok.as<std::int32_t>(), x0.data(), y0.data(), 5, 25, cols, 8, dt, nullptr);
  embedding_forward(off(o1), d_tok.as<std::int32_t>(), off(x1), off(y1), 5, 25, cols, 8, dt, nullptr);
  same("embedding", o0, o1, std::size_t(rows) * cols);
  DeviceBuffer f0(sizeof(int)), f1(sizeof(int));
  fill_zero(f0.data(), sizeof(int));
  fill_zero(f1.data(), sizeof(int));
  unscale_and_check(x0.data(), n, 0.5f, f0.as<int>(), dt, nullptr);
  unscale_and_check(off(x1), n, 0.5f, f1.as<int>(), dt, nullptr);
  same("unscale", x0, x1, n);
}

// Random operands for benchmarks and calibration: a standard normal's moments (the sample mean
// within 5 standard errors, the variance within 5% at n = 10^6: 5 sigma of its estimate is 0.7%,
// the rest the 24-bit uniforms and the format's rounding), the same bits for the same seed, other
// bits for another, squares never negative and the draws' squares.
TEST_P(GpuByDType, FillNormalDrawsStandardNormalsBySeed) {
  const DType dt = GetParam();
  const std::size_t n = 1000000;
  const float scale = 2.0f;
  DeviceBuffer a(n * dtype_bytes(dt)), b(n * dtype_bytes(dt)), c(n * dtype_bytes(dt));
  fill_normal(a.data(), dt, n, scale, 7, false, nullptr);
  fill_normal(b.data(), dt, n, scale, 7, false, nullptr);
  fill_normal(c.data(), dt, n, scale, 8, false, nullptr);
  synchronize();
  const auto x = from_device(dt, a, n);
  expect_identical("same seed", from_device(dt, b, n), x);
  const auto y = from_device(dt, c, n);
  std::size_t same = 0;
  double sum = 0, sq = 0;
  for (std::size_t i = 0; i < n; ++i) {
    same += x[i] == y[i];
    ASSERT_TRUE(std::isfinite(x[i])) << i;
    sum += x[i];
    sq += double(x[i]) * x[i];
  }
  EXPECT_LT(same, n / 100) << "another seed, mostly other values";
  const double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_LT(std::fabs(mean), 5 * scale / std::sqrt(double(n)));
  EXPECT_NEAR(var, scale * scale, 0.05 * scale * scale);
  fill_normal(a.data(), dt, n, scale, 7, true, nullptr);
  synchronize();
  const auto squares = from_device(dt, a, n);
  // The square of the unrounded draw, rounded once: within 2u (x's own rounding, squared) + u of x^2.
  const double u = unit_roundoff_of(dt), sub = subnormal_half_spacing(dt);
  for (std::size_t i = 0; i < n; i += 997) {
    const double x2 = double(x[i]) * x[i];
    ASSERT_GE(squares[i], 0.0f) << i;
    ASSERT_NEAR(squares[i], x2, 4 * u * x2 + sub) << i;
  }
}

// =======================================================================================
// Tensor parallelism's kernels against layers.h's shard functions. A shard of vocab0 = 16, Vl =
// 16 rows of a vocabulary of kV; ids it does not hold are -1 on the device (kernels.h).
// =======================================================================================
std::vector<std::int32_t> local_ids(const std::vector<std::int32_t>& ids, int vocab0, int Vl) {
  std::vector<std::int32_t> out(ids);
  for (std::int32_t& id : out) id = id >= vocab0 && id < vocab0 + Vl ? id - vocab0 : -1;
  return out;
}

TEST_P(GpuByDType, ShardEmbeddingPositionsAndBiasAreIdenticalToTheCpu) {
  const DType dt = GetParam();
  std::mt19937 rng(611);
  const int vocab0 = 16, Vl = 16;
  const auto wte = randn(dt, std::size_t(Vl) * kC, rng, 0, 0.5), wpe = randn(dt, std::size_t(kT) * kC, rng, 0, 0.5);
  const auto tokens = random_ids(kN, kV, rng);
  std::vector<float> ref(std::size_t(kN) * kC);
  L::embedding_shard_forward<float>(ref.data(), tokens.data(), wte.data(), vocab0, Vl, kN, kC);
  auto d_wte = to_device(dt, wte), d_wpe = to_device(dt, wpe), d_tok = to_device_raw(local_ids(tokens, vocab0, Vl));
  DeviceBuffer d_out(ref.size() * dtype_bytes(dt));
  embedding_shard_forward(d_out.data(), d_tok.as<std::int32_t>(), d_wte.data(), kN, kC, Vl, dt, nullptr);
  synchronize();
  expect_identical("shard lookup", from_device(dt, d_out, ref.size()), ref);

  // The position embedding onto rows [row0, row0 + rows) of the micro-batch (a sequence-parallel
  // shard's), then a bias: each one fp32 add rounded to the format.
  const std::size_t row0 = 24, rows = 40;
  std::vector<float> slice(ref.begin() + row0 * kC, ref.begin() + (row0 + rows) * kC);
  L::add_position_embedding<float>(slice.data(), wpe.data(), row0, rows, kT, kC);
  slice = rounded(dt, slice);
  DeviceBuffer d_slice = to_device(dt, std::vector<float>(ref.begin() + row0 * kC, ref.begin() + (row0 + rows) * kC));
  add_position_embedding(d_slice.data(), d_wpe.data(), row0, rows, kT, kC, dt, nullptr);
  synchronize();
  expect_identical("positions", from_device(dt, d_slice, slice.size()), slice);
  const auto bias = randn(dt, kC, rng, 0, 0.3);
  L::add_bias<float>(slice.data(), bias.data(), rows, kC);
  slice = rounded(dt, slice);
  auto d_bias = to_device(dt, bias);
  add_bias(d_slice.data(), d_bias.data(), rows, kC, dt, nullptr);
  synchronize();
  expect_identical("bias", from_device(dt, d_slice, slice.size()), slice);
}

TEST_P(GpuByDType, ShardCrossEntropyMatchesLayers) {
  const DType dt = GetParam();
  std::mt19937 rng(612);
  const int N = kCeN, V = 256, vocab0 = 128, Vl = 128;
  const auto logits = randn(dt, std::size_t(N) * Vl, rng, 0.0, 2.0);
  const auto targets = random_ids(N, V, rng);
  const auto ld = to_double(logits);
  // The reference in double: (1) row maxima, (2) the sums and target logits, (3) the loss.
  std::vector<double> rowmax(N), sums(2 * N), lse(N);
  L::cross_entropy_shard_max<double>(rowmax.data(), ld.data(), N, Vl);
  L::cross_entropy_shard_sums<double>(sums.data(), ld.data(), rowmax.data(), targets.data(), vocab0, N, Vl);
  L::cross_entropy_shard_loss<double>(lse.data(), rowmax.data(), sums.data(), N);

  auto d_l = to_device(dt, logits), d_t = to_device_raw(local_ids(targets, vocab0, Vl));
  DeviceBuffer d_max(N * 4), d_sums(2 * N * 4), d_loss(N * 4), d_lse(N * 4);
  cross_entropy_shard_max(d_max.as<float>(), d_l.data(), N, Vl, dt, nullptr);
  cross_entropy_shard_sums(d_sums.as<float>(), d_l.data(), d_max.as<float>(), d_t.as<std::int32_t>(), N, Vl, dt,
                           nullptr);
  cross_entropy_shard_loss(d_loss.as<float>(), d_lse.as<float>(), d_max.as<float>(), d_sums.as<float>(), N, nullptr);
  synchronize();
  expect_identical("row maxima", from_device(DType::fp32, d_max, N), std::vector<float>(rowmax.begin(), rowmax.end()));
  const auto got_sums = from_device(DType::fp32, d_sums, 2 * N);
  expect_within("sums", got_sums, sums, [&](std::size_t i) { return i < std::size_t(N) ? kReduce * sums[i] : 0.0; });
  std::vector<double> loss(N);
  for (int n = 0; n < N; ++n) loss[n] = lse[n] - sums[N + n];
  expect_within("loss", from_device(DType::fp32, d_loss, N), loss,
                [&](std::size_t n) { return 4 * kU32 * (std::fabs(lse[n]) + std::fabs(sums[N + n]) + 1) + kReduce; });
}

const DType kStorage[] = {DType::fp32, DType::fp16, DType::bf16};

TEST_F(Gpu, AccumulateIsIdenticalToTheCpuForEveryPairOfFormats) {
  std::mt19937 rng(602);
  const std::size_t n = 5003;
  for (const DType acc_dt : kStorage)
    for (const DType x_dt : kStorage) {
      SCOPED_TRACE(std::string(dtype_name(acc_dt)) + " += " + std::string(dtype_name(x_dt)));
      const auto acc = randn(acc_dt, n, rng), x = randn(x_dt, n, rng, 0.0, 0.01);
      std::vector<float> ref(n);
      for (std::size_t i = 0; i < n; ++i) ref[i] = round_to(acc_dt, acc[i] + x[i]);  // commit(): add, round
      auto d_acc = to_device(acc_dt, acc), d_x = to_device(x_dt, x);
      accumulate(d_acc.data(), acc_dt, d_x.data(), x_dt, n, nullptr);
      synchronize();
      expect_identical("accumulation", from_device(acc_dt, d_acc, n), ref);
    }
}

// Values across every range that matters: fp16 subnormals and overflow, exact ties for both
// formats (round to even), fp32 subnormals, infinities, NaN, signed zeros.
std::vector<float> cast_inputs(std::mt19937& rng) {
  const float fmax = std::numeric_limits<float>::max(), fmin = std::numeric_limits<float>::min();
  // clang-format off
  std::vector<float> v = {
      0.0f, -0.0f, INFINITY, -INFINITY, NAN,
      65504.0f, 65519.99f, 65520.0f, -65520.0f,                         // fp16's largest, and past it
      0x1p-24f, 0x1p-25f, 0x1.0001p-25f, 0x3p-26f,                      // fp16 subnormals and their ties
      1.0f + 0x1p-11f, 1.0f + 0x3p-11f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f, // ties to even (fp16, bf16)
      fmax, std::numeric_limits<float>::denorm_min(), fmin * 0.75f, -0x1.8p-140f};
  // clang-format on
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ud(-30, 20);
  for (int i = 0; i < 20000; ++i) v.push_back(std::ldexp(nd(rng), ud(rng)));
  return v;
}

TEST_F(Gpu, CastRoundsExactlyAsLowp) {
  std::mt19937 rng(603);
  const auto raw = cast_inputs(rng);
  for (const DType src : kStorage)
    for (const DType dst : kStorage) {
      SCOPED_TRACE(std::string(dtype_name(src)) + " -> " + std::string(dtype_name(dst)));
      const auto x = rounded(src, raw);  // the source values as the source format holds them
      const auto ref = rounded(dst, x);
      auto d_src = to_device(src, x);
      DeviceBuffer d_dst(x.size() * dtype_bytes(dst));
      cast(d_dst.data(), dst, d_src.data(), src, x.size(), nullptr);
      synchronize();
      expect_identical("cast", from_device(dst, d_dst, x.size()), ref);
    }
}

// =======================================================================================
// Loss scaling and reductions
// =======================================================================================
TEST_P(GpuByDType, UnscaleIsIdenticalToTheCpuAndFindsInfAndNan) {
  const DType dt = GetParam();
  std::mt19937 rng(701);
  const std::size_t n = 100003;
  const float inv_scale = static_cast<float>(1.0 / 1024.0);  // as the executor: float(1 / scale)
  const auto g = randn(dt, n, rng, 0.0, 1000.0);
  std::vector<float> ref(n);
  for (std::size_t i = 0; i < n; ++i) ref[i] = round_to(dt, g[i] * inv_scale);

  auto d_g = to_device(dt, g);
  DeviceBuffer d_flag(sizeof(int));
  fill_zero(d_flag.data(), sizeof(int));
  unscale_and_check(d_g.data(), n, inv_scale, d_flag.as<int>(), dt, nullptr);
  synchronize();
  expect_identical("unscaled gradients", from_device(dt, d_g, n), ref);
  EXPECT_EQ(from_device_raw<int>(d_flag, 1)[0], 0) << "finite gradients raised the flag";

  for (const float bad : {INFINITY, -INFINITY, NAN}) {
    SCOPED_TRACE("bad value " + std::to_string(bad));
    auto with_bad = g;
    with_bad[n - 2] = bad;  // near the end: the last grid-stride iteration
    auto d_b = to_device(dt, with_bad);
    fill_zero(d_flag.data(), sizeof(int));
    unscale_and_check(d_b.data(), n, inv_scale, d_flag.as<int>(), dt, nullptr);
    synchronize();
    EXPECT_EQ(from_device_raw<int>(d_flag, 1)[0], 1);
  }
  // The flag is never cleared: a clean buffer after a bad one leaves it set.
  unscale_and_check(d_g.data(), n, 1.0f, d_flag.as<int>(), dt, nullptr);
  synchronize();
  EXPECT_EQ(from_device_raw<int>(d_flag, 1)[0], 1);
}

// Squares of fp32 values are exact in double and the sums run in double; the reference sums in
// long double. Error: at most (n / (1024 * 256) + 18) double roundings of the total (all
// terms positive), i.e. ~1e-15 relative; 1e-12 is checked.
TEST_P(GpuByDType, SquaredNormIsDeterministicAndMatchesALongDoubleSum) {
  const DType dt = GetParam();
  std::mt19937 rng(702);
  const std::size_t n = 1000003, m = 4099;
  const auto x = randn(dt, n, rng), y = randn(dt, m, rng, 0.0, 3.0);
  long double sx = 0, sy = 0;
  for (float v : x) sx += static_cast<long double>(v) * v;
  for (float v : y) sy += static_cast<long double>(v) * v;

  auto d_x = to_device(dt, x), d_y = to_device(dt, y);
  DeviceBuffer d_out(8), d_scratch(kReductionScratchDoubles * 8);
  squared_norm(d_out.as<double>(), d_x.data(), n, dt, d_scratch.as<double>(), false, nullptr);
  synchronize();
  const double first = from_device_raw<double>(d_out, 1)[0];
  EXPECT_NEAR(first, static_cast<double>(sx), 1e-12 * static_cast<double>(sx));
  squared_norm(d_out.as<double>(), d_x.data(), n, dt, d_scratch.as<double>(), false, nullptr);
  synchronize();
  EXPECT_EQ(std::bit_cast<std::uint64_t>(from_device_raw<double>(d_out, 1)[0]), std::bit_cast<std::uint64_t>(first))
      << "two runs differ: the reduction is not deterministic";
  // accumulate: a second range added on top (the norm over several buffers).
  squared_norm(d_out.as<double>(), d_y.data(), m, dt, d_scratch.as<double>(), true, nullptr);
  synchronize();
  EXPECT_NEAR(from_device_raw<double>(d_out, 1)[0], static_cast<double>(sx + sy), 1e-12 * static_cast<double>(sx + sy));
}

TEST_F(Gpu, SumMatchesALongDoubleSum) {
  std::mt19937 rng(703);
  const std::size_t n = 12345;
  const auto x = randn(DType::fp32, n, rng, 3.0, 2.0);
  long double s = 0, mag = 0;
  for (float v : x) {
    s += v;
    mag += std::fabs(v);
  }
  auto d_x = to_device(DType::fp32, x);
  DeviceBuffer d_out(8), d_scratch(kReductionScratchDoubles * 8);
  sum(d_out.as<double>(), d_x.as<float>(), n, d_scratch.as<double>(), false, nullptr);
  synchronize();
  EXPECT_NEAR(from_device_raw<double>(d_out, 1)[0], static_cast<double>(s), 1e-12 * static_cast<double>(mag));
}

// =======================================================================================
// Optimizers, against runtime::OptimizerState over three steps (bias correction at t = 1, 2, 3).
// Both sides compute in double and store fp32; they may differ in the last bit of a double (fma
// contraction on either compiler), which can move a stored fp32 value by one ulp: the bound.
// The working copy must be exactly the rounding of the GPU's new master weights.
// =======================================================================================
void expect_within_one_ulp(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float big = std::max(std::fabs(got[i]), std::fabs(ref[i]));
    const float ulp = std::nextafter(big, INFINITY) - big;
    if (!(std::fabs(got[i] - ref[i]) <= ulp) && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements more than 1 ulp apart; first at ["
                     << first << "]: got " << got[first] << ", reference " << ref[first];
}

void check_optimizer(Optimizer kind, DType dt) {
  std::mt19937 rng(801);
  const std::size_t n = 4099;
  runtime::OptimizerSettings s;
  s.kind = kind;
  s.learning_rate = 1e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  runtime::OptimizerState cpu(s, n);
  auto master = randn(DType::fp32, n, rng, 0.0, 0.02);
  std::vector<std::uint8_t> mask(n);
  for (std::size_t i = 0; i < n; ++i) mask[i] = i % 3 != 0;  // biases and norms do not decay
  const float grad_scale = 0.7f;                             // a clipping coefficient

  auto d_master = to_device(DType::fp32, master), d_mask = to_device_raw(mask);
  DeviceBuffer d_m(n * 4), d_v(n * 4), d_work(n * dtype_bytes(dt));
  fill_zero(d_m.data(), n * 4);
  fill_zero(d_v.data(), n * 4);
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto grads = randn(dt, n, rng, 0.0, 0.01);
    auto d_g = to_device(dt, grads);
    if (kind == Optimizer::sgd) {
      sgd_update(d_master.as<float>(), d_g.data(), dt, d_mask.as<std::uint8_t>(), d_work.data(), dt, n, s.learning_rate,
                 s.weight_decay, grad_scale, nullptr);
    } else {
      AdamParams p;
      p.learning_rate = s.learning_rate;
      p.beta1 = s.beta1;
      p.beta2 = s.beta2;
      p.eps = s.eps;
      p.weight_decay = s.weight_decay;
      p.decoupled = kind == Optimizer::adamw;
      p.step = step;
      p.grad_scale = grad_scale;
      adam_update(d_master.as<float>(), d_m.as<float>(), d_v.as<float>(), d_g.data(), dt, d_mask.as<std::uint8_t>(),
                  d_work.data(), dt, n, p, nullptr);
    }
    synchronize();
    cpu.step(master, grads, grad_scale, mask);
    const auto got = from_device(DType::fp32, d_master, n);
    expect_within_one_ulp("master weights", got, master);
    if (kind != Optimizer::sgd) {
      expect_within_one_ulp("first moment", from_device(DType::fp32, d_m, n), cpu.first_moment());
      expect_within_one_ulp("second moment", from_device(DType::fp32, d_v, n), cpu.second_moment());
    }
    expect_identical("working copy", from_device(dt, d_work, n), rounded(dt, got));
    // The next step starts both sides from the CPU's state, so each step is checked on its own
    // (a one-ulp difference is not carried into the next step).
    d_master.upload(master.data(), n * 4);
    if (kind != Optimizer::sgd) {
      d_m.upload(cpu.first_moment().data(), n * 4);
      d_v.upload(cpu.second_moment().data(), n * 4);
    }
  }
}

TEST_P(GpuByDType, AdamWMatchesTheCpuOptimizer) { check_optimizer(Optimizer::adamw, GetParam()); }
TEST_P(GpuByDType, AdamMatchesTheCpuOptimizer) { check_optimizer(Optimizer::adam, GetParam()); }
TEST_P(GpuByDType, SgdMatchesTheCpuOptimizer) { check_optimizer(Optimizer::sgd, GetParam()); }

INSTANTIATE_TEST_SUITE_P(Storage, GpuByDType, ::testing::Values(DType::fp32, DType::fp16, DType::bf16),
                         dtype_param_name);

// =======================================================================================
// Matrix products. Error of a K-term dot product accumulated in fp32 in any order: at most
// K u32 times sum |a_k b_k| (Higham's gamma_K, worst case). TF32 inputs are cut to 10 mantissa
// bits (by rounding or truncation: at most 2^-10 relative each), which adds 2 * 2^-10 of the same
// sum. The output is rounded once to its format (the handle disallows reduced-precision split-K
// reductions): u_out |ref|. tol = u_out |ref| + 2 (K u32 + 2 u_in) sum|a b| + sub.
// =======================================================================================
struct GemmShape {
  int N, in, out;
};
const GemmShape kGemmShapes[] = {{128, 96, 288}, {120, 72, 40}};  // a qkv projection; odd sizes

TEST_P(GpuGemm, LinearForwardAndBackwardMatchLayers) {
  const DType dt = GetParam();
  const DType st = dt == DType::tf32 ? DType::fp32 : dt;  // what the elements are stored as
  const double u_out = unit_roundoff_of(st), sub = subnormal_half_spacing(st);
  const double u_in = dt == DType::tf32 ? 0x1p-10 : 0.0;
  std::mt19937 rng(901);
  GemmContext ctx;
  for (const auto [N, in, out] : kGemmShapes) {
    SCOPED_TRACE("N " + std::to_string(N) + ", in " + std::to_string(in) + ", out " + std::to_string(out));
    const auto x = randn(st, std::size_t(N) * in, rng), w = randn(st, std::size_t(out) * in, rng, 0.0, 0.5);
    const auto b = randn(st, out, rng), dy = randn(st, std::size_t(N) * out, rng);
    const auto dw0 = randn(DType::fp32, std::size_t(out) * in, rng);
    const auto xd = to_double(x), wd = to_double(w), bd = to_double(b), dyd = to_double(dy);
    auto tol_for = [&](const std::vector<double>& ref, const std::vector<double>& mag, int K, double u_c, double s) {
      return [&ref, &mag, K, u_c, s, u_in](std::size_t i) {
        return u_c * std::fabs(ref[i]) + 2 * ((K + 1) * kU32 + 2 * u_in) * mag[i] + s;
      };
    };

    // y = x w^T + b
    std::vector<double> y(std::size_t(N) * out), mag_y(y.size());
    L::linear_forward<double>(y.data(), xd.data(), wd.data(), bd.data(), N, in, out);
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < out; ++o) {
        double m = std::fabs(bd[o]);
        for (int k = 0; k < in; ++k) m += std::fabs(xd[std::size_t(n) * in + k] * wd[std::size_t(o) * in + k]);
        mag_y[std::size_t(n) * out + o] = m;
      }
    // dx = dy w
    std::vector<double> dx(std::size_t(N) * in), mag_dx(dx.size());
    L::linear_backward_input<double>(dx.data(), dyd.data(), wd.data(), N, in, out);
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < in; ++k) {
        double m = 0;
        for (int o = 0; o < out; ++o) m += std::fabs(dyd[std::size_t(n) * out + o] * wd[std::size_t(o) * in + k]);
        mag_dx[std::size_t(n) * in + k] = m;
      }
    // dw += dy^T x (fp32 accumulation buffer), and dw = dy^T x (in the storage format)
    std::vector<double> dw_acc = to_double(dw0), dw_new(dw0.size()), mag_acc(dw0.size()), mag_new(dw0.size());
    L::linear_backward_weight<double>(dw_acc.data(), nullptr, dyd.data(), xd.data(), N, in, out, true);
    L::linear_backward_weight<double>(dw_new.data(), nullptr, dyd.data(), xd.data(), N, in, out, false);
    for (int o = 0; o < out; ++o)
      for (int k = 0; k < in; ++k) {
        double m = 0;
        for (int n = 0; n < N; ++n) m += std::fabs(dyd[std::size_t(n) * out + o] * xd[std::size_t(n) * in + k]);
        mag_new[std::size_t(o) * in + k] = m;
        mag_acc[std::size_t(o) * in + k] = m + std::fabs(dw0[std::size_t(o) * in + k]);
      }

    auto d_x = to_device(st, x), d_w = to_device(st, w), d_b = to_device(st, b), d_dy = to_device(st, dy);
    auto d_dw_acc = to_device(DType::fp32, dw0);
    DeviceBuffer d_y(y.size() * dtype_bytes(st)), d_dx(dx.size() * dtype_bytes(st)),
        d_dw_new(dw_new.size() * dtype_bytes(st));
    linear_forward(ctx, d_y.data(), d_x.data(), d_w.data(), d_b.data(), N, in, out, dt);
    linear_backward_input(ctx, d_dx.data(), d_dy.data(), d_w.data(), N, in, out, dt);
    linear_backward_weight(ctx, d_dw_acc.data(), DType::fp32, d_dy.data(), d_x.data(), N, in, out, dt, true);
    linear_backward_weight(ctx, d_dw_new.data(), st, d_dy.data(), d_x.data(), N, in, out, dt, false);
    synchronize();
    expect_within("y", from_device(st, d_y, y.size()), y, tol_for(y, mag_y, in, u_out, sub));
    expect_within("dx", from_device(st, d_dx, dx.size()), dx, tol_for(dx, mag_dx, out, u_out, sub));
    expect_within("dw accumulated (fp32)", from_device(DType::fp32, d_dw_acc, dw_acc.size()), dw_acc,
                  tol_for(dw_acc, mag_acc, N, kU32, 0x1p-150));
    expect_within("dw", from_device(st, d_dw_new, dw_new.size()), dw_new, tol_for(dw_new, mag_new, N, u_out, sub));
  }
}

INSTANTIATE_TEST_SUITE_P(Precision, GpuGemm, ::testing::Values(DType::fp32, DType::tf32, DType::fp16, DType::bf16),
                         dtype_param_name);

// =======================================================================================
// FP8 products (gemm_fp8): E4M3 codes decoded on the host (OCP 8-bit floating point: bias 7,
// three mantissa bits, exponent 0 subnormal, S.1111.111 NaN), scales that are powers of two. A
// product of two E4M3 values has at most 8 significant bits, so every term is exact in fp32 and
// the bound is the dot product's: tol = u_out |ref| + 2 (K + 1) u_acc sum|a b| with u_acc = 2^-24
// for FP32 accumulation. Fast accumulation keeps partial sums in the tensor cores' narrower
// accumulator between promotions to FP32 (DeepSeek-V3's report: about 14 bits): u_acc 2^-13.
// Needs an sm_89 or later device (skipped elsewhere).
// =======================================================================================
double e4m3_value(std::uint8_t code) {
  const int sign = code >> 7, exponent = (code >> 3) & 0xF, mantissa = code & 0x7;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

TEST(E4m3, CodesDecodeToTheOcpValues) {
  EXPECT_EQ(e4m3_value(0x00), 0.0);
  EXPECT_EQ(e4m3_value(0x38), 1.0);                  // exponent 7, mantissa 0
  EXPECT_EQ(e4m3_value(0x7E), 448.0);                // the largest finite: 1.75 x 2^8
  EXPECT_EQ(e4m3_value(0x01), std::ldexp(1.0, -9));  // the smallest subnormal
  EXPECT_EQ(e4m3_value(0xB8), -1.0);
}

TEST_F(Gpu, Fp8ProductMatchesAnExactHostSum) {
  const std::vector<CudaDevice> devices = query_cuda_devices().devices;
  if (devices.empty() || devices[0].compute_capability_major * 10 + devices[0].compute_capability_minor < 89)
    GTEST_SKIP() << "fp8 products need an sm_89 or later device";
  const int M = 72, N = 48, K = 160;
  std::mt19937 rng(977);
  // Codes of magnitude 2^-6 to 15 (exponents 1 to 10), either sign: no NaN, no subnormal.
  std::uniform_int_distribution<int> exponent(1, 10), mantissa(0, 7), sign(0, 1);
  auto draw = [&](std::size_t n) {
    std::vector<std::uint8_t> v(n);
    for (auto& c : v) c = static_cast<std::uint8_t>(sign(rng) << 7 | exponent(rng) << 3 | mantissa(rng));
    return v;
  };
  const auto a = draw(std::size_t(M) * K), b = draw(std::size_t(N) * K);
  const float scale_a = 0.5f, scale_b = 4.0f;
  std::vector<double> ref(std::size_t(M) * N), mag(ref.size());
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double sum = 0, abs_sum = 0;
      for (int k = 0; k < K; ++k) {
        const double t = e4m3_value(a[std::size_t(m) * K + k]) * e4m3_value(b[std::size_t(n) * K + k]);
        sum += t;
        abs_sum += std::fabs(t);
      }
      ref[std::size_t(m) * N + n] = sum * scale_a * scale_b;
      mag[std::size_t(m) * N + n] = abs_sum * scale_a * scale_b;
    }
  const auto d_a = to_device_raw(a), d_b = to_device_raw(b);
  const auto d_scales = to_device_raw(std::vector<float>{scale_a, scale_b});
  GemmContext ctx;
  for (const DType out : {DType::fp32, DType::bf16})
    for (const bool fast : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(out)) + (fast ? ", fast accumulation" : ""));
      DeviceBuffer d_c(ref.size() * dtype_bytes(out));
      gemm_fp8(ctx, M, N, K, d_a.data(), d_b.data(), d_scales.as<float>(), d_scales.as<float>() + 1, d_c.data(), out,
               fast);
      synchronize();
      const double u_out = out == DType::fp32 ? 0.0 : unit_roundoff_of(out), u_acc = fast ? 0x1p-13 : kU32;
      expect_within("C", from_device(out, d_c, ref.size()), ref,
                    [&](std::size_t i) { return u_out * std::fabs(ref[i]) + 2 * (K + 1) * u_acc * mag[i]; });
    }
}

// =======================================================================================
// The attention split of kernels.h, end to end in fp32: per-head products through
// gemm_strided_batched (one call per micro-batch row b, heads as the batch), the scale in the
// forward product's alpha and in the softmax backward, against layers::attention_forward/backward.
// Every step is fp32 with dot products of at most max(T, hs) = 70 terms, chained three deep
// (dprobs, dscores, dqkv): errors of a few 1e-7 to 1e-6 of the tensor's largest value in practice
// (sqrt(K) u32 growth); a normwise bound of 5e-5 of the largest value is checked. An indexing
// mistake (a wrong stride or transpose) gives errors of order 1.
// =======================================================================================
TEST_F(Gpu, AttentionFromProductsAndSoftmaxMatchesLayers) {
  const int B = kAttB, T = kAttTs[0], C = kAttC, H = kAttH, hs = kAttHs, C3 = 3 * C;
  const float scale = 0.25f;  // 1/sqrt(16)
  const DType f = DType::fp32;
  std::mt19937 rng(1001);
  const auto qkv = randn(f, std::size_t(B) * T * C3, rng), dout = randn(f, std::size_t(B) * T * C, rng);
  const auto qkvd = to_double(qkv), doutd = to_double(dout);
  std::vector<double> out(std::size_t(B) * T * C), probs(std::size_t(B) * H * T * T), scratch(std::size_t(T) * T),
      dqkv(qkvd.size());
  L::attention_forward<double>(out.data(), probs.data(), scratch.data(), qkvd.data(), B, T, C, H, L::no_post);
  L::attention_backward<double>(dqkv.data(), scratch.data(), doutd.data(), qkvd.data(), probs.data(), B, T, C, H,
                                L::no_post);

  GemmContext ctx;
  auto d_qkv = to_device(f, qkv), d_dout = to_device(f, dout);
  const std::size_t TT = std::size_t(T) * T;
  DeviceBuffer d_s(B * H * TT * 4), d_p(B * H * TT * 4), d_dp(B * H * TT * 4), d_out(out.size() * 4),
      d_dqkv(dqkv.size() * 4);
  const float* q0 = d_qkv.as<float>();
  float* dq0 = d_dqkv.as<float>();
  for (int b = 0; b < B; ++b) {
    const float* q = q0 + std::size_t(b) * T * C3;  // head h at + h*hs; k at + C, v at + 2C
    float* s = d_s.as<float>() + std::size_t(b) * H * TT;
    // scores_h = scale * q_h k_h^T
    gemm_strided_batched(ctx, false, true, T, T, hs, scale, q, C3, hs, q + C, C3, hs, 0.0f, s, T, TT, H, f, f);
  }
  causal_softmax_forward(d_p.data(), d_s.data(), B * H, T, 1.0f, f, nullptr);
  for (int b = 0; b < B; ++b) {
    const float* q = q0 + std::size_t(b) * T * C3;
    const float* p = d_p.as<float>() + std::size_t(b) * H * TT;
    // out_h = p_h v_h, heads side by side in (T, C)
    gemm_strided_batched(ctx, false, false, T, hs, T, 1.0f, p, T, TT, q + 2 * C, C3, hs, 0.0f,
                         d_out.as<float>() + std::size_t(b) * T * C, C, hs, H, f, f);
    // dprobs_h = dout_h v_h^T
    const float* dy = d_dout.as<float>() + std::size_t(b) * T * C;
    gemm_strided_batched(ctx, false, true, T, T, hs, 1.0f, dy, C, hs, q + 2 * C, C3, hs, 0.0f,
                         d_dp.as<float>() + std::size_t(b) * H * TT, T, TT, H, f, f);
  }
  causal_softmax_backward(d_dp.data(), d_p.data(), d_dp.data(), B * H, T, scale, f, nullptr);  // dscores in place
  for (int b = 0; b < B; ++b) {
    const float* q = q0 + std::size_t(b) * T * C3;
    const float* p = d_p.as<float>() + std::size_t(b) * H * TT;
    const float* ds = d_dp.as<float>() + std::size_t(b) * H * TT;
    const float* dy = d_dout.as<float>() + std::size_t(b) * T * C;
    float* dq = dq0 + std::size_t(b) * T * C3;
    gemm_strided_batched(ctx, false, false, T, hs, T, 1.0f, ds, T, TT, q + C, C3, hs, 0.0f, dq, C3, hs, H, f, f);
    gemm_strided_batched(ctx, true, false, T, hs, T, 1.0f, ds, T, TT, q, C3, hs, 0.0f, dq + C, C3, hs, H, f, f);
    gemm_strided_batched(ctx, true, false, T, hs, T, 1.0f, p, T, TT, dy, C, hs, 0.0f, dq + 2 * C, C3, hs, H, f, f);
  }
  synchronize();
  auto normwise = [](const std::vector<double>& ref) {
    double m = 0;
    for (double v : ref) m = std::max(m, std::fabs(v));
    return [m](std::size_t) { return 5e-5 * m; };
  };
  expect_within("probs", from_device(f, d_p, probs.size()), probs, normwise(probs));
  expect_within("out", from_device(f, d_out, out.size()), out, normwise(out));
  expect_within("dqkv", from_device(f, d_dqkv, dqkv.size()), dqkv, normwise(dqkv));
}

// Launchers refuse formats they do not store, before touching the device.
TEST(KernelsWithoutDevice, RefuseFormatsTheyDoNotStore) {
  EXPECT_THROW(gelu_forward(nullptr, nullptr, 4, DType::tf32, nullptr), std::invalid_argument);
  EXPECT_THROW(residual_add(nullptr, nullptr, nullptr, 4, DType::fp8, nullptr), std::invalid_argument);
  EXPECT_THROW(layernorm_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, DType::fp32, nullptr),
               std::invalid_argument);
  AdamParams p;
  p.step = 0;
  EXPECT_THROW(
      adam_update(nullptr, nullptr, nullptr, nullptr, DType::fp32, nullptr, nullptr, DType::fp32, 4, p, nullptr),
      std::invalid_argument);
}

}  // namespace
}  // namespace trainsim::cuda
