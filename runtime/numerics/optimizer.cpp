#include "runtime/numerics/optimizer.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace trainsim::runtime {

OptimizerState::OptimizerState(const OptimizerSettings& settings, std::size_t num_params) : settings_(settings) {
  if (settings_.kind != Optimizer::sgd) {
    if (!(settings_.beta1 >= 0 && settings_.beta1 < 1) || !(settings_.beta2 >= 0 && settings_.beta2 < 1))
      throw std::invalid_argument("optimizer: beta1 and beta2 must be in [0, 1), got " +
                                  std::to_string(settings_.beta1) + " and " + std::to_string(settings_.beta2));
    m_.assign(num_params, 0.0f);
    v_.assign(num_params, 0.0f);
  }
}

void OptimizerState::step(std::span<float> weights, std::span<const float> grads, float grad_scale,
                          std::span<const std::uint8_t> decay_mask) {
  const std::size_t n = weights.size();
  if (grads.size() != n || (!decay_mask.empty() && decay_mask.size() != n) ||
      (settings_.kind != Optimizer::sgd && m_.size() != n))
    throw std::invalid_argument("optimizer step: sizes disagree: weights " + std::to_string(n) + ", gradients " +
                                std::to_string(grads.size()) + ", decay mask " + std::to_string(decay_mask.size()) +
                                ", optimizer state " + std::to_string(m_.size()));
  ++steps_;
  const double lr = settings_.learning_rate, wd = settings_.weight_decay, scale = grad_scale;
  auto decays = [&](std::size_t i) { return decay_mask.empty() || decay_mask[i] != 0; };

  if (settings_.kind == Optimizer::sgd) {
    // Plain SGD, no momentum; weight decay as an L2 term added to the gradient.
    for (std::size_t i = 0; i < n; ++i) {
      const double w = weights[i];
      const double g = grads[i] * scale + (decays(i) ? wd * w : 0.0);
      weights[i] = static_cast<float>(w - lr * g);
    }
    return;
  }

  // Adam (Kingma & Ba, Algorithm 1) with bias correction; the element arithmetic is done in
  // double and the moments are stored in fp32. One loop per (Adam or AdamW, with or without a
  // mask), each without calls or a loop-invariant test, so that the compiler vectorises it (with
  // the flags of runtime/numerics/CMakeLists.txt); each element's arithmetic is the same as in
  // one scalar loop, bit for bit (docs/performance.md).
  const double b1 = settings_.beta1, b2 = settings_.beta2, eps = settings_.eps;
  const double t = static_cast<double>(steps_);
  const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
  float* const w_io = weights.data();
  const float* const g_in = grads.data();
  float* const m_io = m_.data();
  float* const v_io = v_.data();
  const std::uint8_t* const mask = decay_mask.data();
  auto adam = [&](auto decoupled, auto masked) {
    for (std::size_t i = 0; i < n; ++i) {
      const double w = w_io[i];
      const bool d = !masked || mask[i] != 0;
      double g = g_in[i] * scale;
      if (!decoupled && d) g += wd * w;  // Adam: L2 decay through the gradient (and the moments)
      const double m = b1 * m_io[i] + (1 - b1) * g;
      const double v = b2 * v_io[i] + (1 - b2) * g * g;
      m_io[i] = static_cast<float>(m);
      v_io[i] = static_cast<float>(v);
      double update = (m / c1) / (std::sqrt(v / c2) + eps);
      if (decoupled && d) update += wd * w;  // AdamW: decay applied to the weight directly
      w_io[i] = static_cast<float>(w - lr * update);
    }
  };
  const bool decoupled = settings_.kind == Optimizer::adamw, masked = !decay_mask.empty();
  if (decoupled && masked) adam(std::true_type{}, std::true_type{});
  if (decoupled && !masked) adam(std::true_type{}, std::false_type{});
  if (!decoupled && masked) adam(std::false_type{}, std::true_type{});
  if (!decoupled && !masked) adam(std::false_type{}, std::false_type{});
}

}  // namespace trainsim::runtime
