#include "runtime/numerics/optimizer.h"

#include <cmath>
#include <stdexcept>
#include <string>

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
  // double and the moments are stored in fp32.
  const double b1 = settings_.beta1, b2 = settings_.beta2, eps = settings_.eps;
  const double t = static_cast<double>(steps_);
  const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
  const bool decoupled = settings_.kind == Optimizer::adamw;
  for (std::size_t i = 0; i < n; ++i) {
    const double w = weights[i];
    const bool d = decays(i);
    double g = grads[i] * scale;
    if (!decoupled && d) g += wd * w;  // Adam: L2 decay through the gradient (and the moments)
    const double m = b1 * m_[i] + (1 - b1) * g;
    const double v = b2 * v_[i] + (1 - b2) * g * g;
    m_[i] = static_cast<float>(m);
    v_[i] = static_cast<float>(v);
    double update = (m / c1) / (std::sqrt(v / c2) + eps);
    if (decoupled && d) update += wd * w;  // AdamW: decay applied to the weight directly
    weights[i] = static_cast<float>(w - lr * update);
  }
}

}  // namespace trainsim::runtime
