// The optimizer step's kernels: the fused loss-scaling step (unscale + found-inf), deterministic
// reductions (squared gradient norm, sum of the rows' losses), and Adam/AdamW/SGD on fp32 master
// weights that also write the low-precision working copy. CPU references: the engine's
// optimizer_step (runtime/cpu/cpu_engine.cpp) and runtime/numerics/optimizer.cpp; tests:
// tests/kernels/test_kernels.cpp.
#include <cmath>
#include <string>

#include "kernels/common.cuh"
#include "kernels/kernels.h"

namespace trainsim::cuda {

using namespace detail;

namespace {

// ---------------------------------------------------------------------------------------
// Loss scaling
// ---------------------------------------------------------------------------------------

// One thread per pack (or element): g = g * inv_scale (one fp32 multiply, as the executor),
// rounded to T; a thread that sees an inf/NaN input or result sets *found_inf = 1 (a plain store
// of the same value from any number of threads: no atomics needed, nothing ever clears it).
template <class T>
__global__ void unscale_kernel(T* g, std::size_t n, float inv_scale, int* found_inf, bool packed) {
  bool bad = false;
  // The result as stored (rounded to T), so that its check sees what is written.
  map_elements(g, g, n, packed, [&](float v) {
    const float u = to_float(from_float<T>(v * inv_scale));
    bad |= !isfinite(v) || !isfinite(u);
    return u;
  });
  if (bad) *found_inf = 1;
}

// ---------------------------------------------------------------------------------------
// Reductions in double, two passes with a fixed shape (kReductionBlocks x kReduceThreads, then
// one block of kReductionBlocks threads): the order of every addition is fixed by n alone, so
// the result is the same on every run and every device.
// ---------------------------------------------------------------------------------------
constexpr int kReduceThreads = 256;
static_assert(kReductionBlocks % 32 == 0 && kReductionBlocks <= 1024, "the final pass is one block");

// Thread k of the grid sums elements k, k + grid size, ... (squared when kSquare: an fp32 value
// squared in double is exact), then the block sums its threads; one partial per block.
// Packed (when x is aligned), thread k sums packs k, k + grid size, ... element by element in
// order, then the elements after the last whole pack: the order is still fixed by n (and x's
// alignment) alone.
template <class T, bool kSquare>
__global__ void reduce_partials_kernel(double* partials, const T* x, std::size_t n, bool packed) {
  __shared__ double shared[32];
  double acc = 0.0;
  for_each_value(x, n, packed, [&](float f) {
    const double v = f;
    acc += kSquare ? v * v : v;
  });
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block of kReductionBlocks threads: thread k loads partial k; block sum; *out = or +=.
__global__ void __launch_bounds__(kReductionBlocks)
    reduce_final_kernel(double* out, const double* partials, bool accumulate) {
  __shared__ double shared[32];
  double v = partials[threadIdx.x];
  v = block_sum(v, shared);
  if (threadIdx.x == 0) *out = accumulate ? *out + v : v;
}

template <class T, bool kSquare>
void reduce(const char* name, double* out, const T* x, std::size_t n, double* scratch, bool accumulate,
            cudaStream_t stream) {
  reduce_partials_kernel<T, kSquare><<<kReductionBlocks, kReduceThreads, 0, stream>>>(scratch, x, n, aligned16(x));
  check_launch(name);
  reduce_final_kernel<<<1, kReductionBlocks, 0, stream>>>(out, scratch, accumulate);
  check_launch(name);
}

// ---------------------------------------------------------------------------------------
// Optimizers: grid-stride, one thread per parameter; the element arithmetic of optimizer.cpp in
// double (IEEE division and sqrt; nvcc may contract a*b+c into fma, as the host compiler may, so
// the two can differ in the last bit of a double, which moves the stored fp32 value by at most
// one ulp and almost never). Moments and master weights stored as fp32 (round to nearest).
// ---------------------------------------------------------------------------------------
struct AdamConstants {
  double lr, b1, b2, eps, wd, c1, c2, scale;
  bool decoupled;
};

template <class G, class W>
__global__ void adam_kernel(float* master, float* m, float* v, const G* grads, const std::uint8_t* mask, W* working,
                            std::size_t n, AdamConstants k) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const double w = master[i];
    const bool decays = mask == nullptr || mask[i] != 0;
    double g = static_cast<double>(to_float(grads[i])) * k.scale;
    if (!k.decoupled && decays) g += k.wd * w;  // Adam: L2 decay through the gradient and moments
    const double mm = k.b1 * m[i] + (1 - k.b1) * g;
    const double vv = k.b2 * v[i] + (1 - k.b2) * g * g;
    m[i] = static_cast<float>(mm);
    v[i] = static_cast<float>(vv);
    double update = (mm / k.c1) / (sqrt(vv / k.c2) + k.eps);
    if (k.decoupled && decays) update += k.wd * w;  // AdamW: decay applied to the weight directly
    const float wn = static_cast<float>(w - k.lr * update);
    master[i] = wn;
    if (working) working[i] = from_float<W>(wn);
  }
}

template <class G, class W>
__global__ void sgd_kernel(float* master, const G* grads, const std::uint8_t* mask, W* working, std::size_t n,
                           double lr, double wd, double scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const double w = master[i];
    const bool decays = mask == nullptr || mask[i] != 0;
    const double g = static_cast<double>(to_float(grads[i])) * scale + (decays ? wd * w : 0.0);
    const float wn = static_cast<float>(w - lr * g);
    master[i] = wn;
    if (working) working[i] = from_float<W>(wn);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------
void unscale_and_check(void* grads, std::size_t n, float inv_scale, int* found_inf, DType dt, StreamHandle stream) {
  const char* name = "unscale_and_check";
  if (n == 0) return;
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const bool packed = aligned16(grads);
    unscale_kernel<S><<<packed_blocks(n, packed), kElementwiseThreads, 0, stream>>>(static_cast<S*>(grads), n,
                                                                                    inv_scale, found_inf, packed);
  });
  check_launch(name);
}

void squared_norm(double* out, const void* x, std::size_t n, DType dt, double* scratch, bool accumulate, StreamHandle stream) {
  const char* name = "squared_norm";
  dispatch(dt, name, [&](auto tag) {
    using S = typename decltype(tag)::type;
    reduce<S, true>(name, out, static_cast<const S*>(x), n, scratch, accumulate, stream);
  });
}

void sum(double* out, const float* x, std::size_t n, double* scratch, bool accumulate, StreamHandle stream) {
  reduce<float, false>("sum", out, x, n, scratch, accumulate, stream);
}

void adam_update(float* master, float* m, float* v, const void* grads, DType grad_dt, const std::uint8_t* decay_mask,
                 void* working, DType working_dt, std::size_t n, const AdamParams& p, StreamHandle stream) {
  const char* name = "adam_update";
  require(p.beta1 >= 0 && p.beta1 < 1 && p.beta2 >= 0 && p.beta2 < 1, name,
          "beta1 and beta2 must be in [0, 1), got " + std::to_string(p.beta1) + " and " + std::to_string(p.beta2));
  require(p.step >= 1, name, "step (t after the increment) must be >= 1, got " + std::to_string(p.step));
  if (n == 0) return;
  // The bias corrections on the host with std::pow, as optimizer.cpp computes them.
  const double t = static_cast<double>(p.step);
  AdamConstants k{};
  k.lr = p.learning_rate;
  k.b1 = p.beta1;
  k.b2 = p.beta2;
  k.eps = p.eps;
  k.wd = p.weight_decay;
  k.c1 = 1 - std::pow(p.beta1, t);
  k.c2 = 1 - std::pow(p.beta2, t);
  k.scale = static_cast<double>(p.grad_scale);
  k.decoupled = p.decoupled;
  dispatch(grad_dt, name, [&](auto grad_tag) {
    using G = typename decltype(grad_tag)::type;
    dispatch(working_dt, name, [&](auto working_tag) {
      using W = typename decltype(working_tag)::type;
      adam_kernel<G, W><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
          master, m, v, static_cast<const G*>(grads), decay_mask, static_cast<W*>(working), n, k);
    });
  });
  check_launch(name);
}

void sgd_update(float* master, const void* grads, DType grad_dt, const std::uint8_t* decay_mask, void* working,
                DType working_dt, std::size_t n, double learning_rate, double weight_decay, float grad_scale,
                StreamHandle stream) {
  const char* name = "sgd_update";
  if (n == 0) return;
  dispatch(grad_dt, name, [&](auto grad_tag) {
    using G = typename decltype(grad_tag)::type;
    dispatch(working_dt, name, [&](auto working_tag) {
      using W = typename decltype(working_tag)::type;
      sgd_kernel<G, W><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
          master, static_cast<const G*>(grads), decay_mask, static_cast<W*>(working), n, learning_rate, weight_decay,
          static_cast<double>(grad_scale));
    });
  });
  check_launch(name);
}

}  // namespace trainsim::cuda
