// The model of the runtime: each layer of runtime/model/layers.h against central finite
// differences in double precision; a whole StageModel against finite differences in float;
// cuts into 1, 2 and 4 stages against the whole model; the zero-bubble split backward against
// the unsplit one; low-precision storage and the numerics report; the order of backward units.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numbers>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/in_process.h"
#include "runtime/model/layers.h"
#include "runtime/model/stage_model.h"
#include "runtime/model/stage_layout.h"
#include "runtime/model/model_parallel.h"
#include "runtime/numerics/lowp.h"
#include "tests/runtime/stage_call_order.h"

namespace trainsim::runtime {
namespace {

namespace L = layers;

std::vector<double> randn(std::size_t n, std::mt19937_64& rng, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<double> v(n);
  for (double& x : v) x = nd(rng);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of `loss` with respect to every element of x, against `analytic`:
// each element within 1e-6 of the gradient's largest magnitude (double, eps 1e-5: the
// truncation error is ~eps^2, the cancellation error ~1e-16 / eps).
void expect_gradient(const char* what, std::vector<double>& x, const std::vector<double>& analytic,
                     const std::function<double()>& loss) {
  ASSERT_EQ(x.size(), analytic.size());
  const double eps = 1e-5;
  double scale = 0, worst = 0;
  for (double a : analytic) scale = std::max(scale, std::fabs(a));
  ASSERT_GT(scale, 0) << what << ": the analytic gradient is all zeros";
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + eps;
    const double up = loss();
    x[i] = keep - eps;
    const double down = loss();
    x[i] = keep;
    const double fd = (up - down) / (2 * eps);
    worst = std::max(worst, std::fabs(fd - analytic[i]) / scale);
  }
  EXPECT_LT(worst, 1e-6) << what << ": finite differences disagree with the backward";
}

// ---------------------------------------------------------------------------------------
// (1) Layers in double
// ---------------------------------------------------------------------------------------
TEST(Layers, EmbeddingGradients) {
  const int B = 3, T = 5, C = 4, V = 7;
  std::mt19937_64 rng(1);
  std::vector<double> wte = randn(V * C, rng), wpe = randn(T * C, rng), R = randn(B * T * C, rng);
  std::vector<std::int32_t> tokens(B * T);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 4);  // repeats: the scatter must add
  std::vector<double> out(B * T * C);
  auto loss = [&] {
    L::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, R);
  };
  loss();
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) ASSERT_EQ(out[(b * T + t) * C + c], wte[tokens[b * T + t] * C + c] + wpe[t * C + c]);
  std::vector<double> dwte(V * C, 0.0), dwpe(T * C, 0.0);
  L::embedding_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, T, C);
  expect_gradient("wte", wte, dwte, loss);
  expect_gradient("wpe", wpe, dwpe, loss);
}

TEST(Layers, LayerNormGradients) {
  const int N = 6, C = 8;
  std::mt19937_64 rng(2);
  std::vector<double> x = randn(N * C, rng, 2.0), gamma = randn(C, rng), beta = randn(C, rng), R = randn(N * C, rng);
  for (int c = 0; c < C; ++c) x[c] += 5.0;  // a row far from zero mean
  std::vector<double> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    L::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(), N, C);
    return dot(out, R);
  };
  loss();
  // Independent check of the forward: each row of (out - beta) / gamma has mean 0, variance 1.
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += (out[n * C + c] - beta[c]) / gamma[c] / C;
    for (int c = 0; c < C; ++c) v += std::pow((out[n * C + c] - beta[c]) / gamma[c] - m, 2) / C;
    EXPECT_NEAR(m, 0.0, 1e-12);
    EXPECT_NEAR(v * (1 + L::kLayerNormEps * rstd[n] * rstd[n]), 1.0, 1e-9);
  }
  std::vector<double> dx(N * C), dgamma(C, 0.0), dbeta(C, 0.0);
  L::layernorm_backward_input(dx.data(), R.data(), x.data(), mean.data(), rstd.data(), gamma.data(),
                              static_cast<const double*>(nullptr), N, C);
  L::layernorm_backward_weight(dgamma.data(), dbeta.data(), R.data(), x.data(), mean.data(), rstd.data(), N, C);
  expect_gradient("layernorm x", x, dx, loss);
  expect_gradient("layernorm gamma", gamma, dgamma, loss);
  expect_gradient("layernorm beta", beta, dbeta, loss);
  // With a residual gradient, dx is that plus the same LayerNorm gradient.
  std::vector<double> dres = randn(N * C, rng), dx2(N * C);
  L::layernorm_backward_input(dx2.data(), R.data(), x.data(), mean.data(), rstd.data(), gamma.data(), dres.data(), N,
                              C);
  for (int i = 0; i < N * C; ++i) EXPECT_NEAR(dx2[i], dx[i] + dres[i], 1e-12);
}

TEST(Layers, LinearGradients) {
  const int N = 5, in = 6, out = 4;
  std::mt19937_64 rng(3);
  std::vector<double> x = randn(N * in, rng), w = randn(out * in, rng), b = randn(out, rng), R = randn(N * out, rng);
  std::vector<double> y(N * out);
  auto loss = [&] {
    L::linear_forward(y.data(), x.data(), w.data(), b.data(), N, in, out);
    return dot(y, R);
  };
  loss();
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < out; ++o) {
      double s = b[o];
      for (int i = 0; i < in; ++i) s += x[n * in + i] * w[o * in + i];
      ASSERT_NEAR(y[n * out + o], s, 1e-12);
    }
  std::vector<double> dx(N * in), dw(out * in, 7.0), db(out, 7.0);
  L::linear_backward_input(dx.data(), R.data(), w.data(), N, in, out);
  L::linear_backward_weight(dw.data(), db.data(), R.data(), x.data(), N, in, out, /*accumulate=*/false);
  expect_gradient("linear x", x, dx, loss);
  expect_gradient("linear w", w, dw, loss);
  expect_gradient("linear b", b, db, loss);
  // Accumulating twice doubles.
  std::vector<double> dw2(out * in, 0.0), db2(out, 0.0);
  for (int k = 0; k < 2; ++k) L::linear_backward_weight(dw2.data(), db2.data(), R.data(), x.data(), N, in, out);
  for (int i = 0; i < out * in; ++i) EXPECT_NEAR(dw2[i], 2 * dw[i], 1e-12);
  for (int i = 0; i < out; ++i) EXPECT_NEAR(db2[i], 2 * db[i], 1e-12);
}

TEST(Layers, GeluGradients) {
  const int n = 600;  // spans several of gelu_backward's chunks
  std::mt19937_64 rng(4);
  std::vector<double> x = randn(n, rng, 3.0), R = randn(n, rng), y(n);
  auto loss = [&] {
    L::gelu_forward(y.data(), x.data(), n);
    return dot(y, R);
  };
  loss();
  for (int i = 0; i < n; ++i) {
    const double v = x[i];
    ASSERT_NEAR(y[i], 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v))), 1e-14);
  }
  std::vector<double> dx(n);
  L::gelu_backward(dx.data(), x.data(), R.data(), n);
  expect_gradient("gelu", x, dx, loss);
}

// Attention written the plain way: per (b, h, i), softmax over j <= i of q_i.k_j / sqrt(hs).
std::vector<double> naive_attention(const std::vector<double>& qkv, int B, int T, int C, int H) {
  const int hs = C / H;
  std::vector<double> out(B * T * C, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        std::vector<double> s(i + 1);
        double mx = -1e300, sum = 0;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int k = 0; k < hs; ++k)
            d += qkv[(b * T + i) * 3 * C + h * hs + k] * qkv[(b * T + j) * 3 * C + C + h * hs + k];
          s[j] = d / std::sqrt(static_cast<double>(hs));
          mx = std::max(mx, s[j]);
        }
        for (int j = 0; j <= i; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int j = 0; j <= i; ++j)
          for (int k = 0; k < hs; ++k)
            out[(b * T + i) * C + h * hs + k] += s[j] / sum * qkv[(b * T + j) * 3 * C + 2 * C + h * hs + k];
      }
  return out;
}

TEST(Layers, AttentionMatchesNaiveAndGradients) {
  const int B = 2, T = 5, C = 8, H = 2;
  std::mt19937_64 rng(5);
  std::vector<double> qkv = randn(B * T * 3 * C, rng), R = randn(B * T * C, rng);
  std::vector<double> out(B * T * C), probs(B * H * T * T), scratch(T * T);
  auto loss = [&] {
    L::attention_forward(out.data(), probs.data(), scratch.data(), qkv.data(), B, T, C, H, L::no_post);
    return dot(out, R);
  };
  loss();
  const std::vector<double> want = naive_attention(qkv, B, T, C, H);
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-12);
  for (int r = 0; r < B * H * T; ++r) {
    const int i = r % T;
    double sum = 0;
    for (int j = 0; j < T; ++j) {
      if (j > i) {
        EXPECT_EQ(probs[r * T + j], 0.0) << "causal mask";
      }
      sum += probs[r * T + j];
    }
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
  std::vector<double> dqkv(B * T * 3 * C);
  L::attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), probs.data(), B, T, C, H, L::no_post);
  expect_gradient("attention qkv", qkv, dqkv, loss);
  std::vector<double> R0(B * T * C, 0.0);
  for (int c = 0; c < C; ++c) R0[c] = 1.0;  // loss on position 0 of batch 0 only
  L::attention_backward(dqkv.data(), scratch.data(), R0.data(), qkv.data(), probs.data(), B, T, C, H, L::no_post);
  for (int t = 1; t < T; ++t)
    for (int c = 0; c < 3 * C; ++c) EXPECT_EQ(dqkv[t * 3 * C + c], 0.0) << "position " << t << " leaks into 0";
}

// Context parallelism's attention (stage_layout.h): a rank's queries, at their positions, over the
// whole sequence's keys and values give the rows the whole sequence's attention gives at those
// positions, and the ranks' key and value gradients sum to the whole's. In double, over several
// query blocks (T > kAttnRows), for 2, 3 and 4 ranks.
TEST(Layers, ContextParallelAttentionIsTheWholeSequencesRows) {
  const int B = 2, T = 72, C = 8, H = 2;
  std::mt19937_64 rng(11);
  const std::vector<double> qkv = randn(B * T * 3 * C, rng), R = randn(B * T * C, rng);
  std::vector<double> out(B * T * C), probs(B * H * T * T), scratch(T * T), dqkv(B * T * 3 * C);
  L::attention_forward(out.data(), probs.data(), scratch.data(), qkv.data(), B, T, C, H, L::no_post);
  L::attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), probs.data(), B, T, C, H, L::no_post);
  const std::ptrdiff_t w = 3 * C;
  for (const int cp : {2, 3, 4}) {
    std::vector<double> dk_sum(B * T * C, 0.0), dv_sum(B * T * C, 0.0);
    for (int rank = 0; rank < cp; ++rank) {
      SCOPED_TRACE(::testing::Message() << "rank " << rank << " of " << cp);
      const std::vector<int> pos = context_parallel_positions(T, cp, rank);
      const int Tq = T / cp;
      ASSERT_EQ(pos.size(), static_cast<std::size_t>(Tq));
      std::vector<double> mine(B * Tq * 3 * C), dout(B * Tq * C);
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < Tq; ++t) {
          std::copy_n(qkv.begin() + (b * T + pos[t]) * 3 * C, 3 * C, mine.begin() + (b * Tq + t) * 3 * C);
          std::copy_n(R.begin() + (b * T + pos[t]) * C, C, dout.begin() + (b * Tq + t) * C);
        }
      const L::AttentionShape shape{B, Tq, T, pos.data()};
      std::vector<double> o(B * Tq * C), p(B * H * Tq * T), s(Tq * T);
      L::attention_forward<double>(o.data(), p.data(), s.data(), {mine.data(), w}, {qkv.data() + C, w},
                                   {qkv.data() + 2 * C, w}, shape, C, H, L::no_post);
      std::vector<double> dq(B * Tq * C), dk(B * T * C), dv(B * T * C);
      L::attention_backward<double>({dq.data(), C}, {dk.data(), C}, {dv.data(), C}, s.data(), dout.data(),
                                    {mine.data(), w}, {qkv.data() + C, w}, {qkv.data() + 2 * C, w}, p.data(), shape, C,
                                    H, L::no_post);
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < Tq; ++t)
          for (int c = 0; c < C; ++c) {
            const std::size_t whole = static_cast<std::size_t>(b * T + pos[t]);
            ASSERT_NEAR(o[(b * Tq + t) * C + c], out[whole * C + c], 1e-13) << "position " << pos[t];
            ASSERT_NEAR(dq[(b * Tq + t) * C + c], dqkv[whole * 3 * C + c], 1e-12) << "position " << pos[t];
          }
      for (std::size_t i = 0; i < dk.size(); ++i) {
        dk_sum[i] += dk[i];
        dv_sum[i] += dv[i];
      }
    }
    for (int n = 0; n < B * T; ++n)
      for (int c = 0; c < C; ++c) {
        ASSERT_NEAR(dk_sum[n * C + c], dqkv[n * 3 * C + C + c], 1e-12) << "row " << n;
        ASSERT_NEAR(dv_sum[n * C + c], dqkv[n * 3 * C + 2 * C + c], 1e-12) << "row " << n;
      }
  }
}

TEST(Layers, CrossEntropyGradients) {
  const int N = 6, V = 9;
  std::mt19937_64 rng(6);
  std::vector<double> logits = randn(N * V, rng, 2.0), lse(N);
  std::vector<std::int32_t> targets(N);
  for (auto& t : targets) t = static_cast<std::int32_t>(rng() % V);
  auto loss = [&] { return L::cross_entropy_forward(lse.data(), logits.data(), targets.data(), N, V); };
  double want = 0;
  for (int n = 0; n < N; ++n) {
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(logits[n * V + v]);
    want += (std::log(z) - logits[n * V + targets[n]]) / N;
  }
  EXPECT_NEAR(loss(), want, 1e-12);
  std::vector<double> dlogits(N * V);
  const double scale = 0.37;  // e.g. loss scale / micro-batches
  L::cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), N, V, scale / N);
  for (double& d : dlogits) d /= scale;
  expect_gradient("cross-entropy logits", logits, dlogits, loss);
}

// ---------------------------------------------------------------------------------------
// Whole stages
// ---------------------------------------------------------------------------------------
ModelDims small_dims(int layers = 2) {
  ModelDims d;
  d.num_layers = layers;
  d.hidden_size = 16;
  d.num_heads = 2;
  d.seq_length = 8;
  d.vocab_size = 32;
  return d;
}

StageSpec stage_spec(const ModelDims& d, int first, int count, int mbs = 2, DType compute = DType::fp32,
                     DType accum = DType::fp32) {
  StageSpec s;
  s.dims = d;
  s.first_layer = first;
  s.num_layers = count;
  s.has_embedding = first == 0;
  s.has_head = first + count == d.num_layers;
  s.compute = compute;
  s.grad_accumulation = accum;
  s.micro_batch_size = mbs;
  return s;
}

struct Batch {
  std::vector<std::int32_t> tokens, targets;
};
Batch make_batch(const StageSpec& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::size_t n = static_cast<std::size_t>(s.micro_batch_size) * s.dims.seq_length;
  Batch b{std::vector<std::int32_t>(n), std::vector<std::int32_t>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    b.tokens[i] = static_cast<std::int32_t>(rng() % s.dims.vocab_size);
    b.targets[i] = static_cast<std::int32_t>(rng() % s.dims.vocab_size);
  }
  return b;
}

// Master weights made larger than GPT-2's init so gradients are far from zero everywhere.
void randomize(StageModel& m, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const ParamInfo& p : m.params()) {
    const bool gain = p.name.find("ln") != std::string::npos && p.name.ends_with("weight");
    const float sd = p.name.ends_with("bias") ? 0.1f : gain ? 0.2f : 0.3f;
    for (std::size_t i = 0; i < p.size; ++i) m.master_weights()[p.offset + i] = (gain ? 1.0f : 0.0f) + sd * nd(rng);
  }
  m.refresh_working_weights();
}

// A pipeline of stages driven by hand: forward chains outputs to inputs, backward chains
// grad_input to grad_output.
struct Pipeline {
  std::vector<StageModel> stages;
  Pipeline(const ModelDims& d, const std::vector<int>& cuts, int mbs, DType compute = DType::fp32) {
    int first = 0;
    for (int count : cuts) {
      stages.emplace_back(stage_spec(d, first, count, mbs, compute, compute == DType::fp32 ? DType::fp32 : compute));
      first += count;
    }
  }
  float forward(int mb, const Batch& b) {
    std::vector<float> x, y;
    float loss = 0;
    for (std::size_t i = 0; i < stages.size(); ++i) {
      y.assign(stages[i].activation_elements(), 0.0f);
      loss = stages[i].forward(mb, b.tokens.data(), b.targets.data(), x.data(), y.data());
      std::swap(x, y);
    }
    return loss;
  }
  void backward(int mb, float scale) {
    std::vector<float> g, gin;
    for (std::size_t k = stages.size(); k-- > 0;) {
      StageModel& s = stages[k];
      gin.assign(s.activation_elements(), 0.0f);
      s.backward_begin(mb, g.data(), scale);
      for (int u = 0; u < s.backward_units(); ++u) s.backward_unit(mb);
      s.backward_end(mb, gin.data());
      std::swap(g, gin);
    }
  }
  // Gradient by global name, summed over the stages holding it (the tied embedding).
  std::map<std::string, std::vector<double>> gradients() {
    std::map<std::string, std::vector<double>> out;
    for (StageModel& s : stages)
      for (const ParamInfo& p : s.params()) {
        auto& v = out[p.name];
        v.resize(p.size, 0.0);
        for (std::size_t i = 0; i < p.size; ++i) v[i] += s.gradients()[p.offset + i];
      }
    return out;
  }
};

TEST(StageModel, ParameterTableCoversTheBuffersInCompletionOrder) {
  const ModelDims d = small_dims(3);
  for (bool tied : {true, false}) {
    ModelDims dd = d;
    dd.tied_embeddings = tied;
    StageModel m(stage_spec(dd, 0, 3));
    std::size_t offset = 0;
    std::map<std::string, int> seen;
    for (const ParamInfo& p : m.params()) {
      EXPECT_EQ(p.offset, offset) << p.name;
      offset += p.size;
      EXPECT_EQ(seen[p.name]++, 0) << "duplicate " << p.name;
      const bool no_decay = p.name.ends_with("bias") || p.name.find("ln") != std::string::npos;
      EXPECT_EQ(p.decay, !no_decay) << p.name;
    }
    EXPECT_EQ(offset, m.gradients().size());
    EXPECT_EQ(m.master_weights().size(), m.gradients().size());
    EXPECT_EQ(m.params().front().name, tied ? "lnf.weight" : "lm_head.weight");  // head side first
    EXPECT_EQ(m.params().back().name, "wpe");                                    // embedding last
    EXPECT_EQ(m.token_embedding().name, "wte");
    EXPECT_EQ(m.token_embedding().size, static_cast<std::size_t>(d.vocab_size * d.hidden_size));
    EXPECT_EQ(m.backward_units(), 3 + 2);
    EXPECT_EQ(seen.count("lm_head.weight"), tied ? 0u : 1u);
    // Blocks appear last to first.
    const auto pos = [&](const std::string& n) {
      for (std::size_t i = 0; i < m.params().size(); ++i)
        if (m.params()[i].name == n) return i;
      return m.params().size();
    };
    EXPECT_LT(pos("block.2.ln1.bias"), pos("block.1.mlp.proj.weight"));
    EXPECT_LT(pos("block.1.ln1.bias"), pos("block.0.mlp.proj.weight"));
    EXPECT_LT(pos("block.0.ln1.bias"), pos("wte"));
  }
  StageModel middle(stage_spec(d, 1, 1));
  EXPECT_EQ(middle.token_embedding().size, 0u);
  EXPECT_EQ(middle.backward_units(), 1);
  StageModel last(stage_spec(d, 2, 1));
  EXPECT_EQ(last.token_embedding().name, "wte");  // the last stage's copy of the tied embedding
  EXPECT_EQ(last.params().front().name, "wte");
}

TEST(StageModel, InitIsGpt2StyleAndDependsOnlyOnSeedAndName) {
  const ModelDims d = small_dims(4);
  StageModel whole(stage_spec(d, 0, 4)), tail(stage_spec(d, 2, 2)), again(stage_spec(d, 0, 4)),
      other(stage_spec(d, 0, 4));
  whole.init(42);
  tail.init(42);
  again.init(42);
  other.init(43);
  EXPECT_TRUE(std::equal(whole.master_weights().begin(), whole.master_weights().end(), again.master_weights().begin()));
  EXPECT_FALSE(
      std::equal(whole.master_weights().begin(), whole.master_weights().end(), other.master_weights().begin()));
  std::map<std::string, std::vector<float>> by_name;
  for (const ParamInfo& p : whole.params())
    by_name[p.name].assign(whole.master_weights().begin() + p.offset,
                           whole.master_weights().begin() + p.offset + p.size);
  for (const ParamInfo& p : tail.params()) {
    const std::vector<float> v(tail.master_weights().begin() + p.offset,
                               tail.master_weights().begin() + p.offset + p.size);
    EXPECT_EQ(v, by_name.at(p.name)) << p.name << " differs between the cut and the whole model";
  }
  for (const auto& [name, v] : by_name) {
    double sum = 0, sq = 0;
    for (float x : v) sum += x, sq += double(x) * x;
    const double mean = sum / v.size(), sd = std::sqrt(sq / v.size() - mean * mean);
    if (name.ends_with("bias"))
      EXPECT_EQ(sq, 0.0) << name;
    else if (name.find("ln") != std::string::npos)
      EXPECT_EQ(sum, double(v.size())) << name;
    else {
      const double want = name.ends_with("proj.weight") ? 0.02 / std::sqrt(2.0 * d.num_layers) : 0.02;
      EXPECT_NEAR(sd, want, 5 * want / std::sqrt(double(v.size()))) << name;
      EXPECT_NEAR(mean, 0.0, 5 * want / std::sqrt(double(v.size()))) << name;
    }
  }
}

// (2) A whole fp32 model against finite differences of the loss, parameter by parameter.
TEST(StageModel, WholeModelGradientsMatchFiniteDifferences) {
  const ModelDims d = small_dims(2);
  const StageSpec spec = stage_spec(d, 0, 2, 2);
  StageModel m(spec);
  randomize(m, 7);
  const Batch b = make_batch(spec, 8);
  auto loss = [&] {
    m.refresh_working_weights();
    const float l = m.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr);
    m.backward_input(0, nullptr, 1.0f, nullptr);  // frees the stash (weights untouched: no backward_weight)
    m.backward_weight(0);
    return static_cast<double>(l);
  };
  m.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr);
  m.backward_begin(0, nullptr, 1.0f);
  for (int u = 0; u < m.backward_units(); ++u) m.backward_unit(0);
  m.backward_end(0, nullptr);
  const std::vector<float> grads(m.gradients().begin(), m.gradients().end());
  std::mt19937_64 rng(9);
  int checked = 0;
  for (const ParamInfo& p : m.params()) {
    // The element with the largest gradient and two random ones of every tensor.
    std::vector<std::size_t> idx{
        static_cast<std::size_t>(std::max_element(grads.begin() + p.offset, grads.begin() + p.offset + p.size,
                                                  [](float a, float c) { return std::fabs(a) < std::fabs(c); }) -
                                 grads.begin() - p.offset)};
    idx.push_back(rng() % p.size);
    idx.push_back(rng() % p.size);
    for (std::size_t i : idx) {
      float& w = m.master_weights()[p.offset + i];
      const float keep = w, eps = 1e-2f;
      w = keep + eps;
      const double up = loss();
      w = keep - eps;
      const double down = loss();
      w = keep;
      const double fd = (up - down) / (double(keep + eps) - double(keep - eps));
      const double g = grads[p.offset + i];
      EXPECT_NEAR(fd, g, 2e-4 + 1e-2 * std::fabs(g)) << p.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3 * static_cast<int>(m.params().size()));
}

// (3) Any cut into stages computes what the whole model does.
TEST(StageModel, CutsIntoStagesMatchTheWholeModel) {
  for (bool tied : {true, false}) {
    ModelDims d = small_dims(4);
    d.tied_embeddings = tied;
    std::vector<float> loss_ref;
    std::map<std::string, std::vector<double>> grads_ref;
    for (const std::vector<int>& cuts : {std::vector<int>{4}, {2, 2}, {1, 1, 1, 1}, {1, 3}}) {
      Pipeline p(d, cuts, 2);
      for (StageModel& s : p.stages) s.init(11);
      std::vector<float> losses;
      for (int mb = 0; mb < 3; ++mb) {
        const Batch b = make_batch(p.stages[0].spec(), 100 + mb);
        losses.push_back(p.forward(mb, b));
        p.backward(mb, 1.0f / 3);
      }
      const auto grads = p.gradients();
      if (loss_ref.empty()) {
        loss_ref = losses;
        grads_ref = grads;
        continue;
      }
      const std::string what = std::string(tied ? "tied" : "untied") + ", " + std::to_string(cuts.size()) + " stages";
      for (int mb = 0; mb < 3; ++mb) EXPECT_NEAR(losses[mb], loss_ref[mb], 1e-6f * loss_ref[mb]) << what;
      ASSERT_EQ(grads.size(), grads_ref.size()) << what;
      for (const auto& [name, g] : grads) {
        const std::vector<double>& r = grads_ref.at(name);
        double scale = 0, worst = 0;
        for (double x : r) scale = std::max(scale, std::fabs(x));
        for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - r[i]));
        EXPECT_LE(worst, 1e-5 * scale) << what << ": " << name;
      }
    }
  }
}

// (4) The zero-bubble split equals the unsplit backward bit for bit.
TEST(StageModel, SplitBackwardEqualsUnsplit) {
  const ModelDims d = small_dims(3);
  for (DType dt : {DType::fp32, DType::bf16, DType::fp16}) {
    for (auto [first, count] : {std::pair{0, 3}, std::pair{1, 1}, std::pair{0, 1}, std::pair{2, 1}}) {
      const StageSpec spec = stage_spec(d, first, count, 2, dt, dt == DType::bf16 ? DType::bf16 : DType::fp32);
      StageModel a(spec), b(spec);
      a.init(5);
      b.init(5);
      const std::size_t n = a.activation_elements();
      std::mt19937_64 rng(6);
      std::vector<Batch> batches;
      std::vector<std::vector<float>> inputs, gouts;
      for (int mb = 0; mb < 2; ++mb) {
        batches.push_back(make_batch(spec, 20 + mb));
        std::vector<double> x = randn(n, rng), g = randn(n, rng, 1e-3);
        inputs.emplace_back(x.begin(), x.end());
        gouts.emplace_back(g.begin(), g.end());
      }
      std::vector<std::vector<float>> gin_a(2, std::vector<float>(n)), gin_b(2, std::vector<float>(n));
      std::vector<float> out(n);
      for (StageModel* m : {&a, &b})
        for (int mb = 0; mb < 2; ++mb)
          m->forward(mb, batches[mb].tokens.data(), batches[mb].targets.data(), inputs[mb].data(), out.data());
      for (int mb = 0; mb < 2; ++mb) {
        a.backward_begin(mb, gouts[mb].data(), 0.5f);
        for (int u = 0; u < a.backward_units(); ++u) a.backward_unit(mb);
        a.backward_end(mb, gin_a[mb].data());
      }
      for (int mb = 0; mb < 2; ++mb) b.backward_input(mb, gouts[mb].data(), 0.5f, gin_b[mb].data());
      EXPECT_GT(b.activation_bytes(), 0u);
      for (int mb = 0; mb < 2; ++mb) b.backward_weight(mb);
      EXPECT_EQ(b.activation_bytes(), 0u);
      const std::string what =
          std::string(dtype_name(dt)) + " blocks " + std::to_string(first) + "+" + std::to_string(count);
      if (!spec.has_embedding) {
        for (int mb = 0; mb < 2; ++mb) EXPECT_EQ(gin_a[mb], gin_b[mb]) << what;
      }
      const std::vector<float> ga(a.gradients().begin(), a.gradients().end()),
          gb(b.gradients().begin(), b.gradients().end());
      EXPECT_EQ(ga, gb) << what;
      EXPECT_TRUE(std::any_of(ga.begin(), ga.end(), [](float x) { return x != 0; })) << what;
    }
  }
}

// (5) Low precision: what is stored is representable; overflow is reported by name.
TEST(StageModel, LowPrecisionStoresRepresentableValues) {
  const ModelDims d = small_dims(2);
  for (DType dt : {DType::fp16, DType::bf16}) {
    const StageSpec spec = stage_spec(d, 0, 2, 2, dt, dt);
    StageModel m(spec);
    m.init(3);
    randomize(m, 4);
    const Batch b = make_batch(spec, 5);
    auto representable = [&](float x) { return round_to(dt, x) == x || std::isnan(x); };
    for (float w : m.working_weights()) ASSERT_TRUE(representable(w)) << dtype_name(dt);
    EXPECT_FALSE(std::all_of(m.master_weights().begin(), m.master_weights().end(), representable))
        << "master weights stay fp32";
    const float loss = m.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr);
    EXPECT_TRUE(std::isfinite(loss));
    const auto stashed = m.stashed_tensors(0);
    EXPECT_GE(stashed.size(), 2u + 9u * 2u);
    for (const auto& t : stashed)
      for (float x : t.values) ASSERT_TRUE(representable(x)) << dtype_name(dt) << " " << t.name;
    // Stash bytes: compute-format tensors at 2 bytes, plus the fp32 LayerNorm statistics (4 per
    // row and block, 3 per row for the final norm and the loss) and the int32 tokens and targets.
    std::size_t elems = 0;
    for (const auto& t : stashed) elems += t.values.size();
    const std::size_t rows = static_cast<std::size_t>(spec.micro_batch_size) * d.seq_length;
    EXPECT_EQ(m.activation_bytes(), 2 * elems + 4 * rows * (4 * 2 + 3) + 4 * 2 * rows);
    m.backward_begin(0, nullptr, 1024.0f);
    for (int u = 0; u < m.backward_units(); ++u) m.backward_unit(0);
    m.backward_end(0, nullptr);
    for (float g : m.gradients()) ASSERT_TRUE(representable(g)) << dtype_name(dt);
    EXPECT_EQ(m.numerics().nonfinite_activations + m.numerics().nonfinite_gradients, 0);
    EXPECT_TRUE(m.numerics().first_nonfinite.empty());
    EXPECT_EQ(m.working_weight_bytes(), m.master_weights().size() * 2);
    EXPECT_EQ(m.gradient_bytes(), m.gradients().size() * 2);
    EXPECT_EQ(m.master_weight_bytes(), m.master_weights().size() * 4);
  }
}

TEST(StageModel, MiddleStageInFp16PassesRepresentableTensors) {
  const ModelDims d = small_dims(3);
  const StageSpec spec = stage_spec(d, 1, 1, 2, DType::fp16, DType::fp32);
  StageModel m(spec);
  m.init(1);
  std::mt19937_64 rng(2);
  const std::vector<double> x = randn(m.activation_elements(), rng), g = randn(m.activation_elements(), rng);
  std::vector<float> in(x.begin(), x.end()), gout(g.begin(), g.end()), out(in.size()), gin(in.size());
  m.forward(0, nullptr, nullptr, in.data(), out.data());
  m.backward_begin(0, gout.data(), 1.0f);
  for (int u = 0; u < m.backward_units(); ++u) m.backward_unit(0);
  m.backward_end(0, gin.data());
  for (float v : out) ASSERT_EQ(round_to_fp16(v), v);
  for (float v : gin) ASSERT_EQ(round_to_fp16(v), v);
  // Accumulated in fp32: one micro-batch's fp16 gradients summed exactly.
  for (float v : m.gradients()) ASSERT_EQ(round_to_fp16(v), v);
}

// The stage's own vectorised rounding (F16C for fp16) gives lowp.h's values bit for bit: a stage
// of no blocks passes its input on rounded, so feed it the values where rounding is delicate.
TEST(StageModel, StageRoundingMatchesLowp) {
  const ModelDims d = small_dims(2);
  std::vector<float> in;
  std::mt19937 rng(3);
  for (int e = -27; e <= 17; ++e)  // across fp16's subnormals, normals and overflow
    for (int k = 0; k < 64; ++k) {
      const float base = std::ldexp(1.0f + k / 64.0f, e);
      in.push_back(base);
      in.push_back(-base);
      in.push_back(std::nextafter(base, 0.0f));
      in.push_back(base + std::ldexp(1.0f, e - 11));  // fp16 ties
      in.push_back(base + std::ldexp(1.0f, e - 8));   // bf16 ties
    }
  for (float x : {65504.0f, 65519.99f, 65520.0f, -65520.0f, INFINITY, -INFINITY, NAN, 0.0f, -0.0f,
                  std::ldexp(1.0f, -25), 3 * std::ldexp(1.0f, -25), std::ldexp(1.0f, -24)})
    in.push_back(x);
  while (in.size() % (d.seq_length * d.hidden_size) != 0)
    in.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  const int mbs = static_cast<int>(in.size() / (d.seq_length * d.hidden_size));
  for (DType dt : {DType::fp16, DType::bf16, DType::tf32}) {
    StageModel m(stage_spec(d, 1, 0, mbs, dt, DType::fp32));
    ASSERT_EQ(m.activation_elements(), in.size());
    std::vector<float> out(in.size()), gin(in.size());
    m.forward(0, nullptr, nullptr, in.data(), out.data());
    m.backward_begin(0, in.data(), 1.0f);
    m.backward_end(0, gin.data());
    for (std::size_t i = 0; i < in.size(); ++i) {
      const float want = round_to(dt, in[i]);
      ASSERT_TRUE(std::bit_cast<std::uint32_t>(out[i]) == std::bit_cast<std::uint32_t>(want) ||
                  (std::isnan(want) && std::isnan(out[i])))
          << dtype_name(dt) << " " << std::hexfloat << in[i] << " -> " << out[i] << ", want " << want;
      ASSERT_TRUE(std::bit_cast<std::uint32_t>(gin[i]) == std::bit_cast<std::uint32_t>(out[i]) || std::isnan(out[i]));
    }
    EXPECT_GT(m.numerics().nonfinite_activations, 0);  // the infinities and NaN went through
    EXPECT_EQ(m.numerics().first_nonfinite, "stage input (forward, micro-batch 0)");
  }
}

TEST(StageModel, NumericsNameTheFirstNonfiniteTensor) {
  const ModelDims d = small_dims(2);
  const StageSpec spec = stage_spec(d, 0, 2, 2, DType::fp16, DType::fp16);
  const Batch b = make_batch(spec, 5);
  {
    StageModel m(spec);
    m.init(3);
    m.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr);
    EXPECT_EQ(m.numerics().nonfinite_activations, 0);
    m.backward_begin(0, nullptr, 1e30f);  // a loss scale far past fp16's range
    for (int u = 0; u < m.backward_units(); ++u) m.backward_unit(0);
    m.backward_end(0, nullptr);
    const StageNumerics& n = m.numerics();
    EXPECT_GT(n.nonfinite_gradients, 0);
    EXPECT_EQ(n.first_nonfinite, "logits gradient (backward, micro-batch 0)");
    EXPECT_TRUE(std::isinf(n.max_abs_gradient));
    EXPECT_GT(n.max_abs_activation, 0);
    EXPECT_LT(n.max_abs_activation, 65504.0 + 1);
  }
  {
    StageModel m(spec);
    m.init(3);
    for (const ParamInfo& p : m.params())  // only block 1's MLP input weights blow up
      if (p.name == "block.1.mlp.fc.weight")
        for (std::size_t i = 0; i < p.size; ++i) m.master_weights()[p.offset + i] *= 3e5f;
    m.refresh_working_weights();
    EXPECT_EQ(m.numerics().nonfinite_activations, 0);
    m.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr);
    m.forward(1, b.tokens.data(), b.targets.data(), nullptr, nullptr);
    EXPECT_GT(m.numerics().nonfinite_activations, 0);
    EXPECT_EQ(m.numerics().first_nonfinite, "block 1 mlp.fc output (forward, micro-batch 0)");
  }
}

// (6) After k backward units a prefix of the gradients is final, growing to all of them.
TEST(StageModel, GradientsCompleteIsMonotoneAndFinal) {
  const ModelDims d = small_dims(3);
  for (auto [first, count] : {std::pair{0, 3}, std::pair{1, 2}, std::pair{0, 2}}) {
    const StageSpec spec = stage_spec(d, first, count, 2);
    StageModel m(spec);
    m.init(8);
    const Batch b = make_batch(spec, 9);
    std::mt19937_64 rng(1);
    const std::vector<double> x = randn(m.activation_elements(), rng), g = randn(m.activation_elements(), rng, 1e-2);
    std::vector<float> in(x.begin(), x.end()), gout(g.begin(), g.end()), out(in.size());
    for (int mb = 0; mb < 2; ++mb) {
      m.forward(mb, b.tokens.data(), b.targets.data(), in.data(), out.data());
      EXPECT_EQ(m.gradients_complete(mb), 0u);
      m.backward_begin(mb, gout.data(), 0.5f);
      EXPECT_EQ(m.gradients_complete(mb), 0u);
      std::vector<std::size_t> complete;
      std::vector<std::vector<float>> snapshots;
      for (int u = 0; u < m.backward_units(); ++u) {
        m.backward_unit(mb);
        complete.push_back(m.gradients_complete(mb));
        snapshots.emplace_back(m.gradients().begin(), m.gradients().end());
        if (u > 0) {
          EXPECT_GT(complete[u], complete[u - 1]);
        }
      }
      EXPECT_EQ(complete.back(), m.gradients().size());
      // What was reported final after unit u is never touched again.
      for (std::size_t u = 0; u < complete.size(); ++u)
        for (std::size_t i = 0; i < complete[u]; ++i) ASSERT_EQ(snapshots[u][i], snapshots.back()[i]);
      m.backward_end(mb, nullptr);
      EXPECT_EQ(m.gradients_complete(mb), m.gradients().size());
    }
    // The split backward: nothing final after the input half, everything after the weight half.
    m.forward(0, b.tokens.data(), b.targets.data(), in.data(), out.data());
    m.backward_input(0, gout.data(), 0.5f, nullptr);
    EXPECT_EQ(m.gradients_complete(0), 0u);
    m.backward_weight(0);
    EXPECT_EQ(m.gradients_complete(0), m.gradients().size());
  }
}

// A micro-batch's calls out of their order throw and change nothing (tests/runtime/stage_call_order.h,
// which the CUDA stage model's test shares).
TEST(StageModel, CallsOutOfOrderThrowAndChangeNothing) {
  const StageSpec spec = stage_spec(small_dims(2), 0, 2, 2);
  StageModel m(spec), clean(spec);
  m.init(3);
  clean.init(3);
  const Batch b = make_batch(spec, 4);
  testing::expect_calls_out_of_order_throw(m, clean, b.tokens.data(), b.targets.data(), [](StageModel& s) {
    return std::vector<float>(s.gradients().begin(), s.gradients().end());
  });
}

// Micro-batches in flight: stashes by micro-batch, any backward order, memory accounted.
TEST(StageModel, GpipeOrderMatchesOneAtATime) {
  const ModelDims d = small_dims(2);
  const StageSpec spec = stage_spec(d, 0, 2, 2);
  StageModel a(spec), b(spec);
  a.init(1);
  b.init(1);
  std::vector<Batch> batches;
  for (int mb = 0; mb < 4; ++mb) batches.push_back(make_batch(spec, 50 + mb));
  std::vector<float> la, lb;
  for (int mb = 0; mb < 4; ++mb) {
    la.push_back(a.forward(mb, batches[mb].tokens.data(), batches[mb].targets.data(), nullptr, nullptr));
    const std::size_t one = a.activation_bytes();
    EXPECT_GT(one, 0u);
    a.backward_begin(mb, nullptr, 0.25f);
    for (int u = 0; u < a.backward_units(); ++u) a.backward_unit(mb);
    a.backward_end(mb, nullptr);
    EXPECT_EQ(a.activation_bytes(), 0u);
    if (mb == 0) {
      // b: all forwards first, stash bytes growing by one micro-batch's each time.
      for (int k = 0; k < 4; ++k) {
        lb.push_back(b.forward(k, batches[k].tokens.data(), batches[k].targets.data(), nullptr, nullptr));
        EXPECT_EQ(b.activation_bytes(), (k + 1) * one);
      }
      EXPECT_THROW(b.forward(0, batches[0].tokens.data(), batches[0].targets.data(), nullptr, nullptr),
                   std::logic_error);
    }
  }
  for (int mb = 3; mb >= 0; --mb) {
    b.backward_begin(mb, nullptr, 0.25f);
    for (int u = 0; u < b.backward_units(); ++u) b.backward_unit(mb);
    b.backward_end(mb, nullptr);
  }
  EXPECT_EQ(b.activation_bytes(), 0u);
  EXPECT_EQ(la, lb);
  for (std::size_t i = 0; i < a.gradients().size(); ++i)
    ASSERT_NEAR(a.gradients()[i], b.gradients()[i], 1e-6f + 1e-5f * std::fabs(a.gradients()[i]));
  const StageNumerics& n = a.numerics();
  EXPECT_EQ(n.nonfinite_activations + n.nonfinite_gradients, 0);
  EXPECT_GT(n.max_abs_activation, 0);
  EXPECT_GT(n.max_abs_gradient, 0);
  // Untrained GPT-2 init predicts nearly uniformly: the loss is close to log(vocab).
  EXPECT_NEAR(la[0], std::log(double(d.vocab_size)), 0.2);
}

TEST(StageModel, RejectsBadSpecsAndInputs) {
  ModelDims d = small_dims(2);
  d.num_heads = 3;  // 16 is not a multiple of 3
  EXPECT_THROW(StageModel(stage_spec(d, 0, 2)), std::invalid_argument);
  EXPECT_THROW(StageModel(stage_spec(small_dims(2), 1, 2)), std::invalid_argument);
  const StageSpec spec = stage_spec(small_dims(2), 0, 2);
  StageModel m(spec);
  m.init(1);
  Batch b = make_batch(spec, 1);
  b.tokens[3] = 32;
  EXPECT_THROW(m.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr), std::out_of_range);
  EXPECT_THROW(m.backward_begin(0, nullptr, 1.0f), std::logic_error);
}

// ---------------------------------------------------------------------------------------
// Tensor parallelism: tp shards of a stage, each on its own thread with the in-process ring as
// its group, compute what the whole stage computes.
// ---------------------------------------------------------------------------------------
struct ShardRun {
  std::vector<float> loss, output, grad_input, gradients, weights;
  std::size_t stashed = 0, recompute = 0;  // activation_bytes() after both forwards; backward_workspace_bytes()
  StageNumerics numerics;
};

// Two micro-batches through `spec` (shard `rank` of `tp`; tp 1: the whole stage): the first with the
// unsplit backward, the second split (backward_input, then backward_weight), the first's whole
// backward between the second's two passes, as a zero-bubble schedule may run them. Weights: the
// whole model's `whole` (by its params), cut to the shard. Middle and last stages take `input`
// (all N rows, the shard keeps its own under sequence parallelism) and `grad_output` likewise.
ShardRun run_shard(StageSpec spec, int tp, int rank, bool sp, ModelParallelGroup* group, const StageModel& whole,
                   const std::vector<float>& whole_weights, const Batch& batch, const std::vector<float>& input,
                   const std::vector<float>& grad_output) {
  spec.tensor_parallel_size = tp;
  spec.tensor_parallel_rank = rank;
  spec.sequence_parallel = sp;
  StageModel m(spec);
  m.set_tensor_parallel_group(group);
  m.init(3);
  for (std::size_t i = 0; i < m.params().size(); ++i) {
    const ParamInfo& p = m.params()[i];
    const ParamInfo& w = whole.params()[i];
    for (std::size_t k = 0; k < p.size; ++k) m.master_weights()[p.offset + k] = whole_weights[w.offset + p.shard.global_index(k)];
  }
  m.refresh_working_weights();
  const std::size_t rows = m.activation_elements(), first_row = sp ? rows * rank : 0;
  ShardRun out;
  out.weights.assign(m.master_weights().begin(), m.master_weights().end());
  for (int mb = 0; mb < 2; ++mb) {
    std::vector<float> y(rows);
    const float* in = spec.has_embedding ? nullptr : input.data() + first_row;
    out.loss.push_back(m.forward(mb, batch.tokens.data(), batch.targets.data(), in, y.data()));
    if (!spec.has_head) out.output.insert(out.output.end(), y.begin(), y.end());
  }
  out.stashed = m.activation_bytes();
  out.recompute = m.backward_workspace_bytes();
  const float* gout = spec.has_head ? nullptr : grad_output.data() + first_row;
  std::vector<float> gin0(rows), gin1(rows);
  m.backward_input(1, gout, 4.0f, gin1.data());
  m.backward_begin(0, gout, 4.0f);
  for (int u = 0; u < m.backward_units(); ++u) m.backward_unit(0);
  m.backward_end(0, gin0.data());
  m.backward_weight(1);
  if (!spec.has_embedding)
    for (const std::vector<float>* gin : {&gin0, &gin1}) out.grad_input.insert(out.grad_input.end(), gin->begin(), gin->end());
  out.gradients.assign(m.gradients().begin(), m.gradients().end());
  out.numerics = m.numerics();
  return out;
}

// Every shard of `spec` over `tp` (each on its own thread, the in-process ring as its group; tp 1:
// the whole stage), as run_shard runs one.
std::vector<ShardRun> run_shards(const StageSpec& spec, int tp, bool sp, const StageModel& whole,
                                 const std::vector<float>& whole_weights, const Batch& batch,
                                 const std::vector<float>& input, const std::vector<float>& grad_output) {
  if (tp == 1) return {run_shard(spec, 1, 0, false, nullptr, whole, whole_weights, batch, input, grad_output)};
  InProcessWorld world(tp);
  std::vector<ShardRun> shards(tp);
  std::vector<int> members(tp);
  std::iota(members.begin(), members.end(), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      auto comm = world.communicator(r);
      CommunicatorGroup group(*comm, members);
      group.restart(1);
      shards[r] = run_shard(spec, tp, r, sp, &group, whole, whole_weights, batch, input, grad_output);
    });
  for (auto& t : threads) t.join();
  return shards;
}

// The whole stage of `spec` with random weights, and a random input and output gradient (values of
// `dt`) for it: what the shard tests run every cut of against.
struct ShardCase {
  StageModel whole;
  std::vector<float> weights;
  Batch batch;
  std::vector<float> input, grad_output;
};
ShardCase shard_case(const StageSpec& spec, DType dt = DType::fp32) {
  ShardCase c{StageModel(spec), {}, make_batch(spec, 5), {}, {}};
  c.whole.init(3);
  randomize(c.whole, 11);
  c.weights.assign(c.whole.master_weights().begin(), c.whole.master_weights().end());
  std::mt19937_64 rng(9);
  for (double x : randn(c.whole.activation_elements(), rng)) c.input.push_back(round_to(dt, static_cast<float>(x)));
  for (double x : randn(c.whole.activation_elements(), rng, 0.1))
    c.grad_output.push_back(round_to(dt, static_cast<float>(x)));
  return c;
}

TEST(StageModel, TensorParallelShardsComputeTheWholeStage) {
  const ModelDims d = small_dims(3);  // 2 heads, vocabulary 32, sequence 8
  const int mbs = 2, tp = 2;
  for (const auto& [first, count] : {std::pair{0, 3}, std::pair{1, 1}, std::pair{0, 1}, std::pair{1, 2}})
    for (const bool sp : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "blocks [" << first << ", " << first + count << ") sp " << sp);
      const StageSpec spec = stage_spec(d, first, count, mbs);
      const ShardCase sc = shard_case(spec);
      const auto& [whole, weights, batch, input, grad_output] = sc;
      const ShardRun ref = run_shard(spec, 1, 0, false, nullptr, whole, weights, batch, input, grad_output);
      const std::vector<ShardRun> shards = run_shards(spec, tp, sp, whole, weights, batch, input, grad_output);

      auto largest = [](const std::vector<float>& v, std::size_t from, std::size_t n) {
        double m = 0;
        for (std::size_t i = from; i < from + n; ++i) m = std::max(m, std::fabs(static_cast<double>(v[i])));
        return m;
      };
      for (int r = 0; r < tp; ++r) {
        const ShardRun& s = shards[r];
        for (std::size_t mb = 0; mb < ref.loss.size(); ++mb)
          EXPECT_NEAR(s.loss[mb], ref.loss[mb], 1e-6 * std::fabs(ref.loss[mb])) << "shard " << r;
        // The rows it holds of what passes between stages: all of them, or its slice under SP.
        const std::size_t per_mb = whole.activation_elements();
        const std::size_t rows = sp ? per_mb / tp : per_mb;
        for (const auto* pair : {&ref.output, &ref.grad_input}) {
          const std::vector<float>& mine = pair == &ref.output ? s.output : s.grad_input;
          if (pair->empty()) continue;
          ASSERT_EQ(mine.size(), 2 * rows);
          for (std::size_t mb = 0; mb < 2; ++mb) {
            const double scale = largest(*pair, mb * per_mb, per_mb);
            for (std::size_t i = 0; i < rows; ++i)
              ASSERT_NEAR(mine[mb * rows + i], (*pair)[mb * per_mb + (sp ? r * rows : 0) + i], 2e-6 * scale)
                  << (pair == &ref.output ? "output" : "input gradient") << " of micro-batch " << mb << ", element " << i;
          }
        }
      }
      // Every parameter: the shard's slice of the whole's, weights exactly, gradients to FP32
      // rounding of the sums' order; replicated ones bit-identical on every shard.
      StageSpec shard_spec = spec;
      shard_spec.tensor_parallel_size = tp;
      shard_spec.sequence_parallel = sp;
      std::size_t held = 0;
      for (int r = 0; r < tp; ++r) {
        shard_spec.tensor_parallel_rank = r;
        const StageModel shard(shard_spec);
        held += shard.params().back().offset + shard.params().back().size;
        for (std::size_t i = 0; i < shard.params().size(); ++i) {
          const ParamInfo& p = shard.params()[i];
          const ParamInfo& w = whole.params()[i];
          ASSERT_EQ(p.name, w.name);
          const double scale = largest(ref.gradients, w.offset, w.size);
          for (std::size_t k = 0; k < p.size; ++k) {
            const std::size_t at = w.offset + p.shard.global_index(k);
            ASSERT_EQ(shards[r].weights[p.offset + k], weights[at]) << p.name;
            ASSERT_NEAR(shards[r].gradients[p.offset + k], ref.gradients[at], 1e-5 * scale) << p.name << "[" << k << "]";
            if (!p.tensor_parallel) {
              ASSERT_EQ(shards[r].gradients[p.offset + k], shards[0].gradients[p.offset + k]) << p.name << " replicated";
            }
          }
        }
      }
      // Each shard holds 1/tp of the sharded tensors: with the replicated ones, just over 1/tp of the whole.
      EXPECT_LT(static_cast<double>(held), 1.1 * weights.size());
    }
}

// Activation recompute rebuilds in a block's backward what its forward made, with the same code on
// the same inputs (and, on a shard, the same collectives on every shard of the group): the losses,
// the activations passed on, the input gradients and every weight gradient are those of keeping
// everything, bit for bit, whole and split (run_shard: a split backward's weight pass waits over a
// whole backward's rebuild), in FP32 and BF16, whole stages and tensor-parallel shards with and
// without sequence parallelism; numerics are the forward's, recorded once. Only the stash shrinks:
// selective drops the softmax outputs; selective_op keeps each block's input, qkv, att and fc;
// full the inputs alone (both: the stage's output only where its head reads it).
TEST(StageModel, RecomputeGivesTheKeptStashsBitsWithLessStashed) {
  const ModelDims d = small_dims(3);  // C 16, 2 heads, T 8, F 64
  const int mbs = 2;
  const std::vector<Recompute> modes = {Recompute::none, Recompute::selective, Recompute::selective_op,
                                        Recompute::full};
  for (const DType dt : {DType::fp32, DType::bf16})
    for (const auto& [first, count] : {std::pair{0, 3}, std::pair{1, 1}, std::pair{1, 2}})
      for (const auto& [tp, sp] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " blocks [" << first << ", " << first + count
                                          << ") tp " << tp << " sp " << sp);
        StageSpec spec = stage_spec(d, first, count, mbs, dt, dt);
        const ShardCase sc = shard_case(spec, dt);
        const auto& [whole, weights, batch, input, grad_output] = sc;
        std::vector<std::vector<ShardRun>> runs;
        for (const Recompute r : modes) {
          spec.recompute = r;
          runs.push_back(run_shards(spec, tp, sp, whole, weights, batch, input, grad_output));
        }
        const std::vector<ShardRun>& kept = runs[0];
        for (std::size_t k = 1; k < modes.size(); ++k)
          for (int r = 0; r < tp; ++r) {
            SCOPED_TRACE(::testing::Message() << recompute_name(modes[k]) << " shard " << r);
            const ShardRun &got = runs[k][r], &ref = kept[r];
            EXPECT_EQ(got.loss, ref.loss);
            EXPECT_EQ(got.output, ref.output);
            EXPECT_EQ(got.grad_input, ref.grad_input);
            EXPECT_EQ(got.gradients, ref.gradients);
            EXPECT_TRUE(std::any_of(got.gradients.begin(), got.gradients.end(), [](float x) { return x != 0; }));
            EXPECT_EQ(got.numerics.max_abs_activation, ref.numerics.max_abs_activation);
            EXPECT_EQ(got.numerics.max_abs_gradient, ref.numerics.max_abs_gradient);
          }
        // A shard's sizes (stage_layout.h) and bytes of a compute-format element.
        const std::size_t eb = dtype_bytes(dt), N = static_cast<std::size_t>(mbs) * d.seq_length,
                          Nl = sp ? N / tp : N, C = d.hidden_size, Cl = C / tp, Fl = d.ffn() / tp,
                          probs = static_cast<std::size_t>(mbs) * (d.num_heads / tp) * d.seq_length * d.seq_length;
        const std::size_t blocks = 2 * static_cast<std::size_t>(count);  // two micro-batches' stashes
        const bool passes_output = first + count < d.num_layers;       // not kept under full and selective_op
        // What selective_op keeps beyond the inputs (qkv, att, fc), and what it rebuilds in a
        // block's backward (ln1, x1, ln2, gelu and the norms' statistics; the softmax output).
        const std::size_t products = (3 * N * Cl + N * Cl + N * Fl) * eb;
        const std::size_t rest = (3 * Nl * C + N * Fl) * eb + 4 * Nl * sizeof(float);
        for (int r = 0; r < tp; ++r) {
          const std::size_t none = runs[0][r].stashed, selective = runs[1][r].stashed, op = runs[2][r].stashed,
                            full = runs[3][r].stashed;
          EXPECT_GT(none, selective);
          EXPECT_GT(selective, op);
          EXPECT_GT(op, full);
          EXPECT_EQ(none - selective, blocks * probs * eb);
          EXPECT_EQ(op, full + blocks * products);
          EXPECT_EQ(selective, op + blocks * rest + (passes_output ? 2 * Nl * C * eb : 0));
          EXPECT_EQ(runs[0][r].recompute, 0u);
          EXPECT_EQ(runs[1][r].recompute, probs * eb);
          EXPECT_EQ(runs[2][r].recompute, rest + probs * eb + (passes_output ? Nl * C * eb : 0));
          EXPECT_EQ(runs[3][r].recompute, products + rest + probs * eb + Nl * C * eb);
        }
      }
}

TEST(StageModel, TensorParallelRefusesShardsThatDoNotDivide) {
  StageSpec spec = stage_spec(small_dims(2), 0, 2);
  spec.tensor_parallel_size = 4;  // 2 heads
  EXPECT_THROW(StageModel{spec}, std::invalid_argument);
  spec.tensor_parallel_size = 2;
  spec.tensor_parallel_rank = 2;
  EXPECT_THROW(StageModel{spec}, std::invalid_argument);
  spec.tensor_parallel_rank = 1;
  spec.dims.vocab_size = 33;
  EXPECT_THROW(StageModel{spec}, std::invalid_argument);
  spec.dims.vocab_size = 32;
  spec.dims.seq_length = 7;
  spec.sequence_parallel = true;
  EXPECT_THROW(StageModel{spec}, std::invalid_argument);
  spec.sequence_parallel = false;
  StageModel no_group(spec);  // 7 rows split only under SP: fine; but a shard needs its group
  no_group.init(1);
  const Batch b = make_batch(spec, 1);
  EXPECT_THROW(no_group.forward(0, b.tokens.data(), b.targets.data(), nullptr, nullptr), std::logic_error);
}

}  // namespace
}  // namespace trainsim::runtime
