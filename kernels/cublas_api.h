// cuBLAS and cuBLASLt, opened on first use instead of linked. Loading libcublasLt runs its static
// initializers (60-85 ms of CPU and ~100 MB of pages touched on a 2-core Xeon, measured with
// dlopen), which every trainsim command paid at start when the CUDA build linked it, though only
// a CUDA run multiplies matrices: `simulate`, `plan` and `sweep` never do. gemm.cu calls cuBLAS
// through the table below; the first call opens both libraries (by soname, so the library path
// decides, then in the folder CMake found them in) and resolves every entry, or throws
// std::runtime_error naming the library and the loader's reason.
//
// Each entry's type is the header's own declaration, so a call is checked against the cuBLAS
// headers this file is compiled with, as a linked call would be.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <type_traits>

namespace trainsim::cuda {

// X(member, symbol): the exported symbol each entry resolves (cublas_v2.h maps cublasCreate to
// cublasCreate_v2 and so on).
#define TRAINSIM_CUBLAS_ENTRIES(X)    \
  X(create, cublasCreate_v2)          \
  X(destroy, cublasDestroy_v2)        \
  X(set_stream, cublasSetStream_v2)   \
  X(set_workspace, cublasSetWorkspace_v2) \
  X(set_math_mode, cublasSetMathMode) \
  X(status_name, cublasGetStatusName) \
  X(status_string, cublasGetStatusString)

#define TRAINSIM_CUBLASLT_ENTRIES(X)                                   \
  X(lt_create, cublasLtCreate)                                         \
  X(lt_destroy, cublasLtDestroy)                                       \
  X(lt_matmul, cublasLtMatmul)                                         \
  X(lt_matmul_desc_create, cublasLtMatmulDescCreate)                   \
  X(lt_matmul_desc_destroy, cublasLtMatmulDescDestroy)                 \
  X(lt_matmul_desc_set_attribute, cublasLtMatmulDescSetAttribute)      \
  X(lt_matrix_layout_create, cublasLtMatrixLayoutCreate)               \
  X(lt_matrix_layout_destroy, cublasLtMatrixLayoutDestroy)             \
  X(lt_preference_create, cublasLtMatmulPreferenceCreate)              \
  X(lt_preference_destroy, cublasLtMatmulPreferenceDestroy)            \
  X(lt_preference_set_attribute, cublasLtMatmulPreferenceSetAttribute) \
  X(lt_algo_get_heuristic, cublasLtMatmulAlgoGetHeuristic)

// C++ sees two declarations of each of these: the exported function, whose compute type is a
// cublasComputeType_t, and an inline overload for older code that passes a cudaDataType. The
// entry is the exported one, its signature spelt out (the static_asserts below check it).
using CublasGemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                        const void*, const void*, cudaDataType, int, const void*, cudaDataType, int,
                                        const void*, void*, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
using CublasGemmStridedBatchedEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                                      int, const void*, const void*, cudaDataType, int, long long int,
                                                      const void*, cudaDataType, int, long long int, const void*, void*,
                                                      cudaDataType, int, long long int, int, cublasComputeType_t,
                                                      cublasGemmAlgo_t);
// Y(member, symbol, type)
#define TRAINSIM_CUBLAS_OVERLOADED_ENTRIES(Y)        \
  Y(gemm_ex, cublasGemmEx, CublasGemmEx)             \
  Y(gemm_strided_batched_ex, cublasGemmStridedBatchedEx, CublasGemmStridedBatchedEx)

struct CublasApi {
#define TRAINSIM_CUBLAS_MEMBER(member, symbol) decltype(&::symbol) member = nullptr;
#define TRAINSIM_CUBLAS_OVERLOADED_MEMBER(member, symbol, type) type member = nullptr;
  TRAINSIM_CUBLAS_ENTRIES(TRAINSIM_CUBLAS_MEMBER)
  TRAINSIM_CUBLASLT_ENTRIES(TRAINSIM_CUBLAS_MEMBER)
  TRAINSIM_CUBLAS_OVERLOADED_ENTRIES(TRAINSIM_CUBLAS_OVERLOADED_MEMBER)
#undef TRAINSIM_CUBLAS_MEMBER
#undef TRAINSIM_CUBLAS_OVERLOADED_MEMBER
};

// Unevaluated: names the overload without referring to the symbol, so nothing links cuBLAS.
#define TRAINSIM_CUBLAS_SIGNATURE_CHECK(member, symbol, type) \
  static_assert(std::is_same_v<decltype(static_cast<type>(&::symbol)), type>);
TRAINSIM_CUBLAS_OVERLOADED_ENTRIES(TRAINSIM_CUBLAS_SIGNATURE_CHECK)
#undef TRAINSIM_CUBLAS_SIGNATURE_CHECK

// The table, the libraries opened by the first call (thread-safe; never closed). Throws
// std::runtime_error when a library or an entry cannot be found.
const CublasApi& cublas();

}  // namespace trainsim::cuda
