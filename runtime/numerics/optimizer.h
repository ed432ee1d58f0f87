// Optimizers on the FP32 master weights of one rank: Adam (L2 weight decay added to the
// gradient, so it passes through the moments), AdamW (decoupled weight decay, Loshchilov &
// Hutter: w -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)) and SGD (plain: no
// momentum, L2 decay added to the gradient; first and second moments stay empty). Adam and
// AdamW use the bias correction of Kingma & Ba (m_hat = m / (1 - beta1^t), likewise v), with
// t = steps_taken() after the increment. Element arithmetic is in double; weights and moments
// are stored in fp32. Gradients come in already unscaled and averaged; `grad_scale`
// multiplies them once more (clipping).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/config.h"

namespace trainsim::runtime {

struct OptimizerSettings {
  Optimizer kind = Optimizer::adamw;
  double learning_rate = 1e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
};

class OptimizerState {
 public:
  OptimizerState(const OptimizerSettings& settings, std::size_t num_params);
  // One update of `weights` with `grads` * grad_scale. `decay_mask` (same size, or empty for
  // all) says which elements get weight decay (not biases and norms).
  void step(std::span<float> weights, std::span<const float> grads, float grad_scale,
            std::span<const std::uint8_t> decay_mask = {});
  std::int64_t steps_taken() const { return steps_; }
  // First and second moments (empty for SGD), for checkpoints.
  std::vector<float>& first_moment() { return m_; }
  std::vector<float>& second_moment() { return v_; }
  void set_steps_taken(std::int64_t n) { steps_ = n; }
  std::size_t bytes() const { return (m_.size() + v_.size()) * sizeof(float); }

 private:
  OptimizerSettings settings_;
  std::vector<float> m_, v_;
  std::int64_t steps_ = 0;
};

}  // namespace trainsim::runtime
