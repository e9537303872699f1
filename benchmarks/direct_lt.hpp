// cuBLASLt called directly (own handle, descriptors, heuristic and workspace; no tapegrad code in the
// timed call): the reference the CUDA benchmarks compare against.
#pragma once

#include <tapegrad/tapegrad.hpp>

#include "step_gemms.hpp"

namespace bench {

/// cuBLASLt called directly for row-major C = op(A) op(B) (as C^T = op(B)^T op(A)^T column-major).
struct DirectLt {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void* workspace = nullptr;
  std::size_t ws_bytes = 32u << 20;

  /// `batch` > 1: a strided batch of that many GEMMs, each operand's matrices one after another.
  DirectLt(const StepGemm& s, cudaDataType_t type, std::int64_t batch = 1) {
    TG_CUBLAS_CHECK(cublasLtCreate(&handle));
    TG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opa = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, type, s.tb ? s.k : s.n, s.tb ? s.n : s.k, s.tb ? s.k : s.n));
    TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, type, s.ta ? s.m : s.k, s.ta ? s.k : s.m, s.ta ? s.m : s.k));
    TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, type, s.n, s.m, s.n));
    if (batch > 1) {
      const auto count = static_cast<std::int32_t>(batch);
      const std::int64_t strides[3] = {s.k * s.n, s.m * s.k, s.m * s.n};
      cublasLtMatrixLayout_t layouts[3] = {la, lb, lc};
      for (int i = 0; i < 3; ++i) {
        TG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
        TG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i], sizeof strides[i]));
      }
    }
    TG_CUDA_CHECK(cudaMalloc(&workspace, ws_bytes));
    cublasLtMatmulPreference_t pref;
    TG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    TG_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 1, &result, &found));
    TG_CHECK(found > 0, "bench", "cuBLASLt found no algorithm");
    algo = result.algo;
    TG_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  }
  ~DirectLt() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(handle);
    cudaFree(workspace);
  }
  void run(const void* a, const void* b, void* c) {
    const float one = 1, zero = 0;
    TG_CUBLAS_CHECK(cublasLtMatmul(handle, desc, &one, b, la, a, lb, &zero, c, lc, c, lc, &algo, workspace, ws_bytes,
                                   tg::cuda::stream()));
  }
};

}  // namespace bench
