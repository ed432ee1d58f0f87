// The CUDA backend's update of one model chunk's FP32 master weights: Adam/AdamW or SGD as the
// plan's optimizer settings say (kernels/kernels.h), what the CUDA engine's optimizer step launches
// and the CUDA calibrator times. Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim::runtime::cuda {

// `step`: the update's count after the increment (Adam's bias correction); `grad_scale`: the
// clipping coefficient. m and v are not read by SGD. The working copy is refreshed by the caller.
inline void update_chunk(const OptimizerSettings& os, float* master, float* m, float* v, const void* grads,
                         DType grad_dt, const std::uint8_t* decay_mask, std::size_t n, std::int64_t step,
                         float grad_scale, StreamHandle stream) {
  namespace k = ::trainsim::cuda;
  if (os.kind == Optimizer::sgd) {
    k::sgd_update(master, grads, grad_dt, decay_mask, nullptr, DType::fp32, n, os.learning_rate, os.weight_decay,
                  grad_scale, stream);
    return;
  }
  k::AdamParams p;
  p.learning_rate = os.learning_rate;
  p.beta1 = os.beta1;
  p.beta2 = os.beta2;
  p.eps = os.eps;
  p.weight_decay = os.weight_decay;
  p.decoupled = os.kind == Optimizer::adamw;
  p.step = step;
  p.grad_scale = grad_scale;
  k::adam_update(master, m, v, grads, grad_dt, decay_mask, nullptr, DType::fp32, n, p, stream);
}

}  // namespace trainsim::runtime::cuda
