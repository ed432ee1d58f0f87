// cuBLAS wrapper (see gemm.h for the precision contract). Row-major products are issued as the
// column-major products cuBLAS computes: a row-major (r, c) matrix with row stride ld is, read
// column-major, its (c, r) transpose with leading dimension ld. So row-major C = op(A) op(B) is
// column-major C^T = op(B)^T op(A)^T: cuBLAS is called with the operands swapped (B first),
// m = N, n = M, and each operand's transpose flag as given.
#include "kernels/gemm.h"

#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/cublas_api.h"
#include "kernels/device_buffer.h"

namespace trainsim::cuda {

using namespace detail;

namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS error in ") + what + ": " + cublas().status_name(status) + " (" +
                             cublas().status_string(status) + ")");
}

// The format the elements of `d` are stored in (tf32 is stored as fp32).
DType storage_of(DType d) { return d == DType::tf32 ? DType::fp32 : d; }

cudaDataType_t data_type(DType d, const char* what) {
  switch (storage_of(d)) {
    case DType::fp32: return CUDA_R_32F;
    case DType::fp16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: break;
  }
  throw std::invalid_argument(std::string(what) + ": matrix products take fp32, tf32, fp16 or bf16, got " +
                              dtype_label(d));
}

cublasComputeType_t compute_type(DType ab) {
  return ab == DType::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

void check_formats(const char* what, DType ab, DType c) {
  data_type(ab, what);
  if (!(c == DType::fp32 || c == storage_of(ab)))
    throw std::invalid_argument(std::string(what) + ": the output of a " + dtype_label(ab) + " product is fp32 or " +
                                dtype_label(storage_of(ab)) + ", got " + dtype_label(c));
}

void check_shape(const char* what, int M, int N, int K, bool trans_a, bool trans_b, int lda, int ldb, int ldc) {
  if (M <= 0 || N <= 0 || K <= 0)
    throw std::invalid_argument(std::string(what) + ": M, N, K must be positive, got " + std::to_string(M) + ", " +
                                std::to_string(N) + ", " + std::to_string(K));
  const int min_lda = trans_a ? M : K, min_ldb = trans_b ? K : N;
  if (lda < min_lda || ldb < min_ldb || ldc < N)
    throw std::invalid_argument(std::string(what) + ": row strides too small: lda " + std::to_string(lda) +
                                " (>= " + std::to_string(min_lda) + "), ldb " + std::to_string(ldb) +
                                " (>= " + std::to_string(min_ldb) + "), ldc " + std::to_string(ldc) +
                                " (>= " + std::to_string(N) + ")");
}

// Grid-stride, one thread per element of y (rows, OC): y[r, c] = b[c] (a copy, no rounding).
template <class T>
__global__ void broadcast_rows_kernel(T* y, const T* b, int OC, std::size_t total) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    y[i] = b[i % OC];
}

}  // namespace

// ---------------------------------------------------------------------------------------
// GemmContext
// ---------------------------------------------------------------------------------------
// A cuBLASLt product of one shape: its descriptors and the heuristic's algorithm, made on first
// use (a linear layer's product with its bias in the epilogue; an FP8 product with its scales).
struct LtProduct {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;  // the heuristic offered an algorithm

  LtProduct() = default;
  LtProduct(const LtProduct&) = delete;
  LtProduct& operator=(const LtProduct&) = delete;
  ~LtProduct() {
    if (d) cublas().lt_matrix_layout_destroy(d);
    if (b) cublas().lt_matrix_layout_destroy(b);
    if (a) cublas().lt_matrix_layout_destroy(a);
    if (op) cublas().lt_matmul_desc_destroy(op);
  }
};

struct GemmContext::Impl {
  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt = nullptr;
  std::map<std::tuple<int, int, int, int>, std::unique_ptr<LtProduct>> biased;  // (N, in, out, format)
  std::map<std::tuple<int, int, int, int, bool>, std::unique_ptr<LtProduct>> fp8;  // (M, N, K, output, fast)
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  MemoryAccount* account = nullptr;  // charged for the workspace (device_buffer.h)

  ~Impl() {
    biased.clear();
    fp8.clear();
    if (lt) cublas().lt_destroy(lt);
    if (handle) cublas().destroy(handle);
    if (workspace) {
      cudaFree(workspace);
      if (account) account->refund(workspace_bytes);
    }
  }
  // cublasSetStream resets the handle to cuBLAS's default workspace pool, so ours is set again.
  void bind(cudaStream_t s) {
    check_cublas(cublas().set_stream(handle, s), "cublasSetStream");
    if (workspace) check_cublas(cublas().set_workspace(handle, workspace, workspace_bytes), "cublasSetWorkspace");
    stream = s;
  }
};

GemmContext::GemmContext(StreamHandle stream, std::size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  check_cublas(cublas().create(&impl_->handle), "cublasCreate (is a CUDA device present?)");
  if (workspace_bytes > 0) {
    check_cuda(cudaMalloc(&impl_->workspace, workspace_bytes), "cudaMalloc of the cuBLAS workspace");
    impl_->workspace_bytes = workspace_bytes;
    impl_->account = current_account();
    if (impl_->account) impl_->account->charge(workspace_bytes);
  }
  // Default math (no TF32 unless the compute type asks for it), and reductions kept in the fp32
  // accumulator type rather than a 16-bit output type.
  check_cublas(cublas().set_math_mode(
                   impl_->handle,
                   static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
               "cublasSetMathMode");
  impl_->bind(stream);
}

GemmContext::~GemmContext() = default;
GemmContext::GemmContext(GemmContext&&) noexcept = default;
GemmContext& GemmContext::operator=(GemmContext&&) noexcept = default;

void GemmContext::set_stream(StreamHandle stream) { impl_->bind(stream); }
StreamHandle GemmContext::stream() const { return impl_->stream; }

// ---------------------------------------------------------------------------------------
// Products
// ---------------------------------------------------------------------------------------
void gemm(GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A, int lda,
          const void* B, int ldb, float beta, void* C, int ldc, DType ab, DType c) {
  const char* what = "gemm";
  check_formats(what, ab, c);
  check_shape(what, M, N, K, trans_a, trans_b, lda, ldb, ldc);
  const cudaDataType_t t_ab = data_type(ab, what), t_c = data_type(c, what);
  check_cublas(
      cublas().gemm_ex(ctx.impl().handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                   &alpha, B, t_ab, ldb, A, t_ab, lda, &beta, C, t_c, ldc, compute_type(ab), CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

void gemm_strided_batched(GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A,
                          int lda, long long stride_a, const void* B, int ldb, long long stride_b, float beta, void* C,
                          int ldc, long long stride_c, int batch, DType ab, DType c) {
  const char* what = "gemm_strided_batched";
  check_formats(what, ab, c);
  check_shape(what, M, N, K, trans_a, trans_b, lda, ldb, ldc);
  if (batch <= 0) throw std::invalid_argument(std::string(what) + ": batch must be positive");
  const cudaDataType_t t_ab = data_type(ab, what), t_c = data_type(c, what);
  check_cublas(cublas().gemm_strided_batched_ex(ctx.impl().handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                          trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B, t_ab, ldb, stride_b,
                                          A, t_ab, lda, stride_a, &beta, C, t_c, ldc, stride_c, batch, compute_type(ab),
                                          CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
}

namespace {

// p's descriptor for the column-major product D = op(A)^T B (the first operand transposed, the
// second not: both of this file's cuBLASLt products read their row-major operands so), FP32 scale.
void create_tn_descriptor(LtProduct& p, cublasComputeType_t compute) {
  check_cublas(cublas().lt_matmul_desc_create(&p.op, compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t trans = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  check_cublas(cublas().lt_matmul_desc_set_attribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)),
               "cublasLtMatmulDescSetAttribute(TRANSA)");
  check_cublas(cublas().lt_matmul_desc_set_attribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)),
               "cublasLtMatmulDescSetAttribute(TRANSB)");
}

// The heuristic's first algorithm for `p` within the context's workspace (p.usable false when it
// offers none). Split-K partial sums only in the FP32 compute type (gemm.h's contract), never the
// output's.
void choose_algorithm(GemmContext::Impl& impl, LtProduct& p) {
  cublasLtMatmulPreference_t pref = nullptr;
  check_cublas(cublas().lt_preference_create(&pref), "cublasLtMatmulPreferenceCreate");
  const std::size_t ws = impl.workspace_bytes;
  const std::uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  cublas().lt_preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublas().lt_preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublas().lt_algo_get_heuristic(impl.lt, p.op, p.a, p.b, p.d, p.d, pref, 1, &result, &found);
  cublas().lt_preference_destroy(pref);
  p.usable = status == CUBLAS_STATUS_SUCCESS && found > 0;
  if (p.usable) p.algo = result.algo;
}

// y = x w^T + b rounded once to y's format: cuBLASLt adds the bias in the FP32 epilogue. (The
// bias broadcast into y and added as beta C, below, is rounded twice on some GPUs: an H200's
// cuBLAS 13 rounded x w^T to y's 16-bit format before adding C, an error of half an ulp of the
// product, which cancellation against the bias makes large relative to y.) Column-major, as
// cuBLAS reads it: y^T (out x N) = w (in x out)^T x^T (in x N), the bias one per row of y^T.
// Returns false, having done nothing, when cuBLASLt offers no algorithm for the shape.
bool linear_forward_biased(GemmContext::Impl& impl, void* y, const void* x, const void* w, const void* bias, int N,
                           int in, int out, DType dt) {
  const char* what = "linear_forward";
  const DType st = storage_of(dt);
  if (!impl.lt) check_cublas(cublas().lt_create(&impl.lt), "cublasLtCreate");
  auto& slot = impl.biased[{N, in, out, static_cast<int>(dt)}];
  if (!slot) {
    auto p = std::make_unique<LtProduct>();
    const cudaDataType_t t = data_type(st, what);
    create_tn_descriptor(*p, compute_type(dt));
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const std::int32_t bias_type = t;
    check_cublas(cublas().lt_matmul_desc_set_attribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
                 "cublasLtMatmulDescSetAttribute(EPILOGUE)");
    check_cublas(
        cublas().lt_matmul_desc_set_attribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)),
        "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)");
    check_cublas(cublas().lt_matrix_layout_create(&p->a, t, in, out, in), "cublasLtMatrixLayoutCreate(w)");
    check_cublas(cublas().lt_matrix_layout_create(&p->b, t, in, N, in), "cublasLtMatrixLayoutCreate(x)");
    check_cublas(cublas().lt_matrix_layout_create(&p->d, t, out, N, out), "cublasLtMatrixLayoutCreate(y)");
    choose_algorithm(impl, *p);
    slot = std::move(p);
  }
  if (!slot->usable) return false;
  check_cublas(cublas().lt_matmul_desc_set_attribute(slot->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
               "cublasLtMatmulDescSetAttribute(BIAS_POINTER)");
  const float alpha = 1.0f, beta = 0.0f;
  check_cublas(cublas().lt_matmul(impl.lt, slot->op, &alpha, w, slot->a, x, slot->b, &beta, y, slot->d, y, slot->d,
                              &slot->algo, impl.workspace, impl.workspace_bytes, impl.stream),
               "cublasLtMatmul");
  return true;
}

}  // namespace

void linear_forward(GemmContext& ctx, void* y, const void* x, const void* w, const void* b, int N, int in, int out,
                    DType dt) {
  const DType st = storage_of(dt);
  float beta = 0.0f;
  check_formats("linear_forward", dt, st);
  if (b && linear_forward_biased(ctx.impl(), y, x, w, b, N, in, out, dt)) return;
  if (b) {
    const std::size_t total = static_cast<std::size_t>(N) * out;
    dispatch(st, "linear_forward (bias)", [&](auto tag) {
      using S = typename decltype(tag)::type;
      broadcast_rows_kernel<S><<<elementwise_blocks(total), kElementwiseThreads, 0, ctx.impl().stream>>>(
          static_cast<S*>(y), static_cast<const S*>(b), out, total);
    });
    check_launch("linear_forward (bias broadcast)");
    beta = 1.0f;
  }
  gemm(ctx, false, true, N, out, in, 1.0f, x, in, w, in, beta, y, out, dt, st);
}

void linear_backward_input(GemmContext& ctx, void* dx, const void* dy, const void* w, int N, int in, int out,
                           DType dt) {
  gemm(ctx, false, false, N, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in, dt, storage_of(dt));
}

void linear_backward_weight(GemmContext& ctx, void* dw, DType dw_dt, const void* dy, const void* x, int N, int in,
                            int out, DType dt, bool accumulate) {
  gemm(ctx, true, false, out, in, N, 1.0f, dy, out, x, in, accumulate ? 1.0f : 0.0f, dw, in, dt, dw_dt);
}

void gemm_fp8(GemmContext& ctx, int M, int N, int K, const void* A, const void* B, const float* scale_a,
              const float* scale_b, void* C, DType c, bool fast_accumulation) {
  const char* what = "gemm_fp8";
  if (!(c == DType::bf16 || c == DType::fp32))
    throw std::invalid_argument(std::string(what) + ": the output of an fp8 product is bf16 or fp32, got " +
                                dtype_label(c));
  check_shape(what, M, N, K, false, true, K, K, N);
  if (K % 16 != 0 || N % 8 != 0)
    throw std::invalid_argument(std::string(what) + ": cuBLASLt's fp8 products need K a multiple of 16 and N of 8, got K " +
                                std::to_string(K) + ", N " + std::to_string(N));
  if (!scale_a || !scale_b) throw std::invalid_argument(std::string(what) + ": both scales are required");
  GemmContext::Impl& impl = ctx.impl();
  if (!impl.lt) check_cublas(cublas().lt_create(&impl.lt), "cublasLtCreate");
  auto& slot = impl.fp8[{M, N, K, static_cast<int>(c), fast_accumulation}];
  if (!slot) {
    // Column-major, as cuBLASLt reads it: C^T (N x M) = B (K x N)^T x A^T (K x M): the first
    // operand transposed, the second not (the "TN" layout Hopper's fp8 products require).
    auto p = std::make_unique<LtProduct>();
    const cudaDataType_t out = c == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    create_tn_descriptor(*p, CUBLAS_COMPUTE_32F);
    const std::int8_t fast = fast_accumulation ? 1 : 0;
    check_cublas(cublas().lt_matmul_desc_set_attribute(p->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                 "cublasLtMatmulDescSetAttribute(FAST_ACCUM)");
    check_cublas(cublas().lt_matrix_layout_create(&p->a, CUDA_R_8F_E4M3, K, N, K), "cublasLtMatrixLayoutCreate(B)");
    check_cublas(cublas().lt_matrix_layout_create(&p->b, CUDA_R_8F_E4M3, K, M, K), "cublasLtMatrixLayoutCreate(A)");
    check_cublas(cublas().lt_matrix_layout_create(&p->d, out, N, M, N), "cublasLtMatrixLayoutCreate(C)");
    choose_algorithm(impl, *p);
    slot = std::move(p);
  }
  if (!slot->usable)
    throw std::runtime_error(std::string(what) + ": cuBLASLt offers no fp8 algorithm for " + std::to_string(M) + " x " +
                             std::to_string(N) + " x " + std::to_string(K) + " on this device (fp8 needs sm_89 or later)");
  // The first operand is B, the second A: each scale goes with its matrix.
  check_cublas(cublas().lt_matmul_desc_set_attribute(slot->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b,
                                                     sizeof(scale_b)),
               "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)");
  check_cublas(cublas().lt_matmul_desc_set_attribute(slot->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a,
                                                     sizeof(scale_a)),
               "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
  const float alpha = 1.0f, beta = 0.0f;
  check_cublas(cublas().lt_matmul(impl.lt, slot->op, &alpha, B, slot->a, A, slot->b, &beta, C, slot->d, C, slot->d,
                                  &slot->algo, impl.workspace, impl.workspace_bytes, impl.stream),
               "cublasLtMatmul (fp8)");
}

}  // namespace trainsim::cuda
