// Checks for CUDA runtime calls and kernel launches: failures throw tg::Error with file:line, the call and
// CUDA's own message.
#pragma once

#include "tapegrad/config.hpp"

// Only with the CUDA backend: without TG_WITH_CUDA this header is empty, so no CUDA header is needed.
#if defined(TG_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cxxabi.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <typeinfo>

#include "tapegrad/base/error.hpp"

TG_BEGIN_NAMESPACE
namespace cuda::detail {

/// The readable name of a type (for messages about the functor a kernel ran), without tapegrad's ABI
/// namespace: "tg::fn::Gelu", as the user writes it.
template <class T>
std::string type_name() {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(typeid(T).name(), nullptr, nullptr, &status), std::free);
  std::string s = status == 0 && name ? name.get() : typeid(T).name();
  const std::string abi = TG_ABI_NAME "::";
  for (std::size_t at = s.find(abi); at != std::string::npos; at = s.find(abi, at)) s.erase(at, abi.size());
  return s;
}

/// A failed kernel launch: the kernel, the functor (which names the op), the size and the launch shape.
[[noreturn]] inline void throw_launch(cudaError_t err, const char* kernel, const std::string& functor, std::int64_t n,
                                      std::int64_t blocks, int threads, const char* file, int line) {
  throw Error(::tg::detail::concat("[cuda] ", file, ":", line, ": launch of ", kernel, " running ", functor, " over ", n,
                                   " elements (", blocks, " blocks of ", threads, " threads) failed: ", cudaGetErrorName(err), " (",
                                   cudaGetErrorString(err), ")"));
}

/// The message for an allocation the pool could not serve.
inline std::string out_of_memory_message(std::size_t bytes, int device, std::size_t free, std::size_t total) {
  return ::tg::detail::concat("[cuda::allocate] out of memory allocating ", bytes, " bytes (", static_cast<double>(bytes) / (1 << 20),
                              " MiB) on cuda:", device, " (", free, " of ", total,
                              " bytes free); use smaller batches or free tensors first");
}

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(::tg::detail::concat("[cuda] ", file, ":", line, ": ", call, " failed: ", cudaGetErrorName(err),
                                   " (", cudaGetErrorString(err), ")"));
}

}  // namespace cuda::detail
TG_END_NAMESPACE

/// TG_CUDA_CHECK(cudaMemcpy(...)): throws tg::Error naming the call and CUDA's error unless it succeeded.
#define TG_CUDA_CHECK(call)                                                                \
  do {                                                                                     \
    const cudaError_t tg_err_ = (call);                                                    \
    if (tg_err_ != cudaSuccess) ::tg::cuda::detail::throw_cuda(tg_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// After a kernel launch: a bad configuration or an earlier asynchronous fault becomes a tg::Error.
#define TG_CUDA_CHECK_LAUNCH(kernel_name)                                                      \
  do {                                                                                         \
    const cudaError_t tg_err_ = cudaGetLastError();                                            \
    if (tg_err_ != cudaSuccess)                                                                \
      ::tg::cuda::detail::throw_cuda(tg_err_, "launch of " kernel_name, __FILE__, __LINE__);   \
  } while (0)

#endif  // TG_WITH_CUDA
