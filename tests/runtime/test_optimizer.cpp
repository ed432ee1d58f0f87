// Loss scaling's state machine (runtime/numerics/loss_scaler.h, after Megatron-LM's
// DynamicGradScaler) and the optimizers (runtime/numerics/optimizer.h) against a
// double-precision reference written here from the papers, and against the closed form of
// Adam's first step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "runtime/numerics/loss_scaler.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim::runtime {
namespace {

// ---------------------------------------------------------------------------------------
// Loss scaling
// ---------------------------------------------------------------------------------------

LossScalingConfig dynamic_config(double initial, int growth_interval, int hysteresis) {
  LossScalingConfig c;
  c.mode = LossScalingMode::dynamic;
  c.initial_scale = initial;
  c.growth_interval = growth_interval;
  c.growth_factor = 2;
  c.backoff_factor = 0.5;
  c.hysteresis = hysteresis;
  return c;
}

TEST(LossScaler, DynamicGrowsAfterGrowthIntervalGoodSteps) {
  LossScaler s(dynamic_config(1024, 3, 2));
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.state().hysteresis_left, 2);
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.state().good_steps, 2);
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 2048);
  EXPECT_EQ(s.state().good_steps, 0);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 4096);
}

TEST(LossScaler, DynamicBacksOffOnlyWhenHysteresisIsUsedUp) {
  LossScaler s(dynamic_config(1024, 1000, 2));
  EXPECT_TRUE(s.update(true));  // first overflow: skipped, tolerated
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  EXPECT_TRUE(s.update(true));  // second: hysteresis used up, back off
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.state().hysteresis_left, 0);
  EXPECT_TRUE(s.update(true));  // every further overflow backs off until a growth refills it
  EXPECT_EQ(s.scale(), 256);
  // A good step in between does not refill the hysteresis (only growth does).
  EXPECT_FALSE(s.update(false));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 128);
}

TEST(LossScaler, DynamicGrowthRefillsHysteresisAndOverflowRestartsTheGrowthCount) {
  LossScaler s(dynamic_config(64, 3, 2));
  s.update(true);
  s.update(true);
  ASSERT_EQ(s.scale(), 32);
  ASSERT_EQ(s.state().hysteresis_left, 0);
  s.update(false);
  s.update(false);
  EXPECT_TRUE(s.update(true));  // restarts the count: the two good steps are lost
  EXPECT_EQ(s.scale(), 16);
  EXPECT_EQ(s.state().good_steps, 0);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16);
  s.update(false);  // third consecutive good step: growth, hysteresis back to 2
  EXPECT_EQ(s.scale(), 32);
  EXPECT_EQ(s.state().hysteresis_left, 2);
  EXPECT_TRUE(s.update(true));  // tolerated again
  EXPECT_EQ(s.scale(), 32);
}

TEST(LossScaler, DynamicScaleNeverDropsBelowOne) {
  LossScaler s(dynamic_config(2, 1000, 1));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 1);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 1);
}

TEST(LossScaler, StaticKeepsItsScaleAndSkipsOverflowingSteps) {
  LossScalingConfig c;
  c.mode = LossScalingMode::static_scale;
  c.initial_scale = 65536;
  c.growth_interval = 1;
  c.hysteresis = 1;
  LossScaler s(c);
  EXPECT_EQ(s.scale(), 65536);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 65536);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 65536);
}

TEST(LossScaler, NoneHasScaleOneAndNeverSkips) {
  LossScalingConfig c;
  c.mode = LossScalingMode::none;
  c.initial_scale = 65536;  // ignored
  LossScaler s(c);
  EXPECT_EQ(s.scale(), 1);
  EXPECT_FALSE(s.update(true));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 1);
}

TEST(LossScaler, RestoredStateContinuesIdentically) {
  LossScaler a(dynamic_config(1024, 4, 2));
  const bool verdicts[] = {false, true, false, false, true, true, false};
  for (bool v : verdicts) a.update(v);
  LossScaler b(dynamic_config(1024, 4, 2));
  b.restore(a.state());
  EXPECT_EQ(b.state(), a.state());
  for (bool v : {false, false, false, false, true}) EXPECT_EQ(a.update(v), b.update(v));
  EXPECT_EQ(b.state(), a.state());
}

TEST(LossScaler, InvalidSettingsAreRejected) {
  EXPECT_THROW(LossScaler(dynamic_config(0, 10, 2)), std::invalid_argument);
  EXPECT_THROW(LossScaler(dynamic_config(1024, 0, 2)), std::invalid_argument);
  EXPECT_THROW(LossScaler(dynamic_config(1024, 10, 0)), std::invalid_argument);
  auto c = dynamic_config(1024, 10, 2);
  c.backoff_factor = 1.5;
  EXPECT_THROW((LossScaler(c)), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// Optimizers
// ---------------------------------------------------------------------------------------

// An independent reference, in double throughout (weights and moments), from the papers:
// Adam (Kingma & Ba 2015, Algorithm 1) with L2 decay added to the gradient; AdamW
// (Loshchilov & Hutter 2019, Algorithm 2 with schedule multiplier 1) with decoupled decay;
// SGD without momentum, L2 decay added to the gradient.
struct Reference {
  OptimizerSettings s;
  std::vector<double> w, m, v;
  int t = 0;

  void step(const std::vector<double>& grad, const std::vector<std::uint8_t>& mask) {
    ++t;
    for (std::size_t i = 0; i < w.size(); ++i) {
      const double lam = mask.empty() || mask[i] ? s.weight_decay : 0.0;
      if (s.kind == Optimizer::sgd) {
        w[i] -= s.learning_rate * (grad[i] + lam * w[i]);
        continue;
      }
      const double g = s.kind == Optimizer::adam ? grad[i] + lam * w[i] : grad[i];
      m[i] = s.beta1 * m[i] + (1 - s.beta1) * g;
      v[i] = s.beta2 * v[i] + (1 - s.beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(s.beta1, t));
      const double v_hat = v[i] / (1 - std::pow(s.beta2, t));
      double delta = m_hat / (std::sqrt(v_hat) + s.eps);
      if (s.kind == Optimizer::adamw) delta += lam * w[i];
      w[i] -= s.learning_rate * delta;
    }
  }
};

class OptimizerVsReference : public ::testing::TestWithParam<Optimizer> {};

TEST_P(OptimizerVsReference, FiveStepsMatchTheDoublePrecisionReference) {
  const std::size_t n = 257;
  OptimizerSettings s;
  s.kind = GetParam();
  s.learning_rate = 1e-2;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(n);
  for (float& x : w) x = normal(gen);
  std::vector<std::uint8_t> mask(n);
  for (std::size_t i = 0; i < n; ++i) mask[i] = i % 5 != 0;  // every fifth element: no decay

  OptimizerState opt(s, n);
  Reference ref{s, std::vector<double>(w.begin(), w.end()), std::vector<double>(n), std::vector<double>(n)};
  const float grad_scale = 0.5f;
  for (int step = 0; step < 5; ++step) {
    std::vector<float> g(n);
    for (float& x : g) x = normal(gen) * 4;  // scaled by grad_scale = 0.5 below
    std::vector<double> g_ref(n);
    for (std::size_t i = 0; i < n; ++i) g_ref[i] = double(g[i]) * grad_scale;
    opt.step(w, g, grad_scale, mask);
    ref.step(g_ref, mask);
  }
  EXPECT_EQ(opt.steps_taken(), 5);
  for (std::size_t i = 0; i < n; ++i) {
    // fp32 weights and moments against double: a few fp32 ulps of the weight per step.
    EXPECT_NEAR(w[i], ref.w[i], 5 * 6e-8 * std::abs(ref.w[i]) + 5e-6 * s.learning_rate) << "element " << i;
    if (s.kind != Optimizer::sgd) {
      EXPECT_NEAR(opt.first_moment()[i], ref.m[i], 1e-6 * (std::abs(ref.m[i]) + 1));
      EXPECT_NEAR(opt.second_moment()[i], ref.v[i], 1e-6 * std::abs(ref.v[i]) + 1e-12);
    }
  }
  if (s.kind == Optimizer::sgd) {
    EXPECT_TRUE(opt.first_moment().empty());
    EXPECT_TRUE(opt.second_moment().empty());
    EXPECT_EQ(opt.bytes(), 0u);
  } else {
    EXPECT_EQ(opt.bytes(), 2 * n * sizeof(float));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, OptimizerVsReference,
                         ::testing::Values(Optimizer::adam, Optimizer::adamw, Optimizer::sgd));

// Adam's first step in closed form: m_1 = (1-b1) g and v_1 = (1-b2) g^2, so after bias
// correction m_hat = g and v_hat = g^2 and the update is lr * g / (|g| + eps): exactly lr
// in the direction of -sign(g) when eps is negligible, and nothing where g = 0.
TEST(Optimizer, FirstAdamStepMovesEveryElementByTheLearningRate) {
  for (Optimizer kind : {Optimizer::adam, Optimizer::adamw}) {
    OptimizerSettings s;
    s.kind = kind;
    s.learning_rate = 1e-3;
    s.beta1 = 0.9;
    s.beta2 = 0.999;
    s.eps = 1e-30;
    s.weight_decay = 0;
    const std::vector<float> w0 = {1.0f, -2.0f, 0.5f, 3.0f, -0.25f, 8.0f};
    const std::vector<float> g = {1e-6f, -3.0f, 250.0f, 0.0f, -1e-3f, 7.5f};
    std::vector<float> w = w0;
    OptimizerState opt(s, w.size());
    opt.step(w, g, 1.0f);
    for (std::size_t i = 0; i < w.size(); ++i) {
      const double expect = g[i] == 0 ? w0[i] : w0[i] - (g[i] > 0 ? 1 : -1) * s.learning_rate;
      // What is left: the rounding of the new weight to fp32 (half an ulp) and the fp32
      // storage of the moments (relative 1e-7 of the update).
      EXPECT_NEAR(w[i], expect, 0.5 * std::ldexp(1.0, std::ilogb(expect) - 23) + 1e-6 * s.learning_rate)
          << "element " << i;
    }
  }
}

// Adam's L2 decay goes through the moments (a weight with zero gradient still moves by lr on
// the first step, as g = wd * w is normalized), AdamW's is decoupled (it moves by lr*wd*w);
// masked elements do not decay at all.
TEST(Optimizer, AdamCouplesWeightDecayAndAdamWDecouplesIt) {
  const std::vector<float> w0 = {2.0f, -4.0f, 2.0f};
  const std::vector<float> zero(3, 0.0f);
  const std::vector<std::uint8_t> mask = {1, 1, 0};
  OptimizerSettings s;
  s.learning_rate = 0.01;
  s.weight_decay = 0.1;
  s.eps = 1e-30;

  s.kind = Optimizer::adam;
  std::vector<float> a = w0;
  OptimizerState adam(s, 3);
  adam.step(a, zero, 1.0f, mask);
  EXPECT_FLOAT_EQ(a[0], 2.0f - 0.01f);
  EXPECT_FLOAT_EQ(a[1], -4.0f + 0.01f);
  EXPECT_EQ(a[2], 2.0f);

  s.kind = Optimizer::adamw;
  std::vector<float> b = w0;
  OptimizerState adamw(s, 3);
  adamw.step(b, zero, 1.0f, mask);
  EXPECT_FLOAT_EQ(b[0], 2.0f * (1 - 0.01f * 0.1f));
  EXPECT_FLOAT_EQ(b[1], -4.0f * (1 - 0.01f * 0.1f));
  EXPECT_EQ(b[2], 2.0f);
}

TEST(Optimizer, GradScaleMultipliesTheGradient) {
  for (Optimizer kind : {Optimizer::adam, Optimizer::adamw, Optimizer::sgd}) {
    OptimizerSettings s;
    s.kind = kind;
    const std::vector<float> g = {0.5f, -1.5f, 3.0f}, g4 = {2.0f, -6.0f, 12.0f};
    std::vector<float> w1 = {1, 2, 3}, w2 = w1;
    OptimizerState o1(s, 3), o2(s, 3);
    for (int i = 0; i < 3; ++i) {
      o1.step(w1, g, 1.0f);
      o2.step(w2, g4, 0.25f);
    }
    EXPECT_EQ(w1, w2);
  }
}

TEST(Optimizer, RestoredStateContinuesIdentically) {
  OptimizerSettings s;
  s.kind = Optimizer::adamw;
  const std::vector<float> g = {0.5f, -1.5f, 3.0f, 0.01f};
  std::vector<float> w = {1, 2, 3, 4};
  OptimizerState a(s, 4);
  for (int i = 0; i < 3; ++i) a.step(w, g, 1.0f);
  OptimizerState b(s, 4);
  b.first_moment() = a.first_moment();
  b.second_moment() = a.second_moment();
  b.set_steps_taken(a.steps_taken());
  std::vector<float> wa = w, wb = w;
  a.step(wa, g, 1.0f);
  b.step(wb, g, 1.0f);
  EXPECT_EQ(wa, wb);
  EXPECT_EQ(b.steps_taken(), 4);
}

TEST(Optimizer, MismatchedSizesAreRejected) {
  OptimizerState opt(OptimizerSettings{}, 4);
  std::vector<float> w(4), g(3);
  EXPECT_THROW(opt.step(w, g, 1.0f), std::invalid_argument);
  std::vector<float> g4(4);
  std::vector<std::uint8_t> mask(2);
  EXPECT_THROW(opt.step(w, g4, 1.0f, mask), std::invalid_argument);
  std::vector<float> w5(5), g5(5);
  EXPECT_THROW(opt.step(w5, g5, 1.0f), std::invalid_argument);
}

// The vectorised loops (optimizer.cpp, compiled to vectorise) against the one scalar loop with
// branches they replaced, written out here: the same bits for Adam and AdamW, with and without a
// decay mask, over steps whose gradients span tiny, zero, negative-zero and huge values.
void scalar_adam_step(const OptimizerSettings& s, std::int64_t step, std::vector<float>& w, const std::vector<float>& g,
                      float grad_scale, const std::vector<std::uint8_t>& mask, std::vector<float>& m,
                      std::vector<float>& v) {
  const double lr = s.learning_rate, wd = s.weight_decay, scale = grad_scale;
  const double b1 = s.beta1, b2 = s.beta2, eps = s.eps, t = static_cast<double>(step);
  const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
  const bool decoupled = s.kind == Optimizer::adamw;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const double wi = w[i];
    const bool d = mask.empty() || mask[i] != 0;
    double gi = g[i] * scale;
    if (!decoupled && d) gi += wd * wi;
    const double mi = b1 * m[i] + (1 - b1) * gi;
    const double vi = b2 * v[i] + (1 - b2) * gi * gi;
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
    double update = (mi / c1) / (std::sqrt(vi / c2) + eps);
    if (decoupled && d) update += wd * wi;
    w[i] = static_cast<float>(wi - lr * update);
  }
}

TEST(Optimizer, VectorisedStepIsTheScalarLoopBitForBit) {
  std::mt19937_64 rng(21);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::size_t n = 1037;  // not a multiple of any vector width
  for (Optimizer kind : {Optimizer::adam, Optimizer::adamw})
    for (bool masked : {false, true}) {
      OptimizerSettings s;
      s.kind = kind;
      std::vector<float> w(n), g(n), m(n, 0.0f), v(n, 0.0f);
      std::vector<std::uint8_t> mask(masked ? n : 0);
      for (float& x : w) x = 0.02f * nd(rng);
      for (auto& x : mask) x = static_cast<std::uint8_t>(rng() % 2);
      OptimizerState opt(s, n);
      std::vector<float> w_ref = w;
      for (int step = 1; step <= 4; ++step) {
        for (float& x : g) x = (step == 3 ? 1e-30f : 1e-2f) * nd(rng);
        g[0] = 0.0f;
        g[1] = -0.0f;
        g[2] = 1e30f;
        opt.step(w, g, 0.7f, mask);
        scalar_adam_step(s, step, w_ref, g, 0.7f, mask, m, v);
        ASSERT_EQ(0, std::memcmp(w.data(), w_ref.data(), n * sizeof(float))) << "step " << step;
        ASSERT_EQ(0, std::memcmp(opt.first_moment().data(), m.data(), n * sizeof(float)));
        ASSERT_EQ(0, std::memcmp(opt.second_moment().data(), v.data(), n * sizeof(float)));
      }
    }
}

}  // namespace
}  // namespace trainsim::runtime
