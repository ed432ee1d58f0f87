// Matrix products through cuBLAS (cublasGemmEx / cublasGemmStridedBatchedEx), in the project's
// row-major terms. Plain C++: the cuBLAS handle stays behind GemmContext (STYLE.md habit 7).
//
// Precision, by the DType of the inputs (`ab`):
//   fp16, bf16  inputs in that format, tensor cores, FP32 accumulation (CUBLAS_COMPUTE_32F);
//               the output (`c`) is fp32 or the input format, rounded once from the fp32 result
//   tf32        fp32 storage, tensor cores reading the inputs as TF32 (CUBLAS_COMPUTE_32F_FAST_TF32),
//               FP32 accumulation; output fp32
//   fp32        pure FP32 (CUBLAS_COMPUTE_32F on fp32 data: no reduced-precision shortcut)
// The handle's math mode disallows reduced-precision reductions (split-K partial sums are kept in
// fp32, not in a 16-bit output type), so a 16-bit output is rounded once, as the CPU emulation
// (runtime/numerics/lowp.h) assumes. alpha and beta are fp32.
//
// Why cublasGemmEx for most: it is the simplest call that does exactly the above. cuBLASLt runs
// what it cannot: the linear layer's bias in the product's epilogue, and the FP8 product (gemm_fp8).
#pragma once

#include <cstddef>
#include <memory>

#include "core/dtype.h"
#include "kernels/cuda_handles.h"

namespace trainsim::cuda {

// A cuBLAS handle bound to a stream, with its own workspace (so work on different streams never
// shares one). Create one per stream; not thread-safe. Move-only.
class GemmContext {
 public:
  static constexpr std::size_t kDefaultWorkspaceBytes = 32u << 20;  // cuBLAS's recommendation for Hopper
  explicit GemmContext(StreamHandle stream = nullptr, std::size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~GemmContext();
  GemmContext(GemmContext&&) noexcept;
  GemmContext& operator=(GemmContext&&) noexcept;
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  void set_stream(StreamHandle stream);
  StreamHandle stream() const;

  // The handle, workspace and stream, for kernels/gemm.cu; Impl is defined there only, so callers
  // cannot see a CUDA type.
  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Row-major C (M,N) = alpha * op(A) op(B) + beta * C, with op(A) (M,K) and op(B) (K,N).
// A is stored (M,K) with row stride lda, or (K,M) when trans_a; B is (K,N) with row stride ldb, or
// (N,K) when trans_b; C is (M,N) with row stride ldc. `ab` is the format of A and B (see above),
// `c` the format of C: fp32, or the storage format of `ab`.
void gemm(GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A, int lda,
          const void* B, int ldb, float beta, void* C, int ldc, DType ab, DType c);

// `batch` independent products, matrix i at A + i*stride_a, B + i*stride_b, C + i*stride_c
// (strides in elements). Attention's per-head products are this, one call per micro-batch row b:
// q, k, v of head h start at qkv + b*T*3C + {0, C, 2C} + h*hs with row stride 3C (stride_a =
// stride_b = hs), scores at (b*H + h)*T*T.
void gemm_strided_batched(GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A,
                          int lda, long long stride_a, const void* B, int ldb, long long stride_b, float beta, void* C,
                          int ldc, long long stride_c, int batch, DType ab, DType c);

// The linear layer of layers.h, weights (out, in) as torch.nn.Linear:
// y (N,out) = x (N,in) w^T + b. b (out) may be null; with a bias, y is first filled with b
// (rows broadcast) and the product added with beta = 1, as layers::linear_forward does, so the
// sum is formed in fp32 and rounded once. All in the storage format of `dt`.
void linear_forward(GemmContext& ctx, void* y, const void* x, const void* w, const void* b, int N, int in, int out,
                    DType dt);
// dx (N,in) = dy (N,out) w (out,in).
void linear_backward_input(GemmContext& ctx, void* dx, const void* dy, const void* w, int N, int in, int out, DType dt);
// dw (out,in) (+)= dy^T x; accumulate false overwrites. dw in dw_dt (fp32 or dt's storage). The
// bias gradient is kernels.h's bias_backward.
void linear_backward_weight(GemmContext& ctx, void* dw, DType dw_dt, const void* dy, const void* x, int N, int in,
                            int out, DType dt, bool accumulate);

// Row-major C (M,N) = scale_a scale_b A (M,K) B (N,K)^T with A and B in FP8 E4M3 (one byte an
// element, the codes as the OCP format defines them) and per-tensor scales (device pointers to one
// float each): the product torchao's Float8Linear runs through torch._scaled_mm (tensor-wise
// scaling), on cuBLASLt. FP32 accumulation; `fast_accumulation` lets Hopper's tensor cores keep
// partial sums in their own narrower accumulator between promotions (CUBLASLT_MATMUL_DESC_FAST_ACCUM:
// torchao's choice for the forward product, not for the two backward ones). C is bf16 or fp32,
// rounded once. Needs sm_89 or later (std::runtime_error naming the shape otherwise), K a
// multiple of 16 and N of 8 (std::invalid_argument). Used by the benchmarks that measure what an
// FP8 product reaches against a BF16 one (tests/bench/bench_kernels.cpp, BM_ProductByFormat); the
// runtime's products do not run in FP8.
void gemm_fp8(GemmContext& ctx, int M, int N, int K, const void* A, const void* B, const float* scale_a,
              const float* scale_b, void* C, DType c, bool fast_accumulation);

}  // namespace trainsim::cuda
