// Checks for CUDA runtime and cuBLAS / cuBLASLt calls: failures throw tg::Error with file:line, the
// call and the library's own message.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "tapegrad/core/error.hpp"

namespace tg::cuda::detail {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(::tg::detail::concat("[cuda] ", file, ":", line, ": ", call, " failed: ", cudaGetErrorName(err),
                                   " (", cudaGetErrorString(err), ")"));
}

[[noreturn]] inline void throw_cublas(cublasStatus_t st, const char* call, const char* file, int line) {
  throw Error(::tg::detail::concat("[cublas] ", file, ":", line, ": ", call, " failed: ", cublasGetStatusName(st),
                                   " (", cublasGetStatusString(st), ")"));
}

}  // namespace tg::cuda::detail

/// TG_CUDA_CHECK(cudaMemcpy(...)): throws tg::Error naming the call and CUDA's error unless it succeeded.
#define TG_CUDA_CHECK(call)                                                                \
  do {                                                                                     \
    const cudaError_t tg_err_ = (call);                                                    \
    if (tg_err_ != cudaSuccess) ::tg::cuda::detail::throw_cuda(tg_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// TG_CUBLAS_CHECK(cublasLtMatmul(...)): the same for cuBLAS and cuBLASLt status codes.
#define TG_CUBLAS_CHECK(call)                                                                  \
  do {                                                                                         \
    const cublasStatus_t tg_st_ = (call);                                                      \
    if (tg_st_ != CUBLAS_STATUS_SUCCESS)                                                       \
      ::tg::cuda::detail::throw_cublas(tg_st_, #call, __FILE__, __LINE__);                     \
  } while (0)

/// After a kernel launch: a bad configuration or an earlier asynchronous fault becomes a tg::Error.
#define TG_CUDA_CHECK_LAUNCH(kernel_name)                                                      \
  do {                                                                                         \
    const cudaError_t tg_err_ = cudaGetLastError();                                            \
    if (tg_err_ != cudaSuccess)                                                                \
      ::tg::cuda::detail::throw_cuda(tg_err_, "launch of " kernel_name, __FILE__, __LINE__);   \
  } while (0)
