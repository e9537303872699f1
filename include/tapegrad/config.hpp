// Version, portability macros and feature switches: the single home of TG_HD and TG_WITH_CUDA.
#pragma once

#define TG_VERSION_MAJOR 0
#define TG_VERSION_MINOR 1
#define TG_VERSION_PATCH 0
#define TG_VERSION_STRING "0.1.0"

// TG_HD marks functions that run on the host and, under nvcc, on the device too.
#if defined(__CUDACC__)
#define TG_HD __host__ __device__
#define TG_DEVICE __device__
#else
#define TG_HD
#define TG_DEVICE
#endif

// TG_HOST_NOINLINE keeps a function out of line in host code, so that the host compiler takes its
// __restrict parameters as given and vectorises the loop inside without run-time alias checks (which g++
// adds, and then fails, once such a function is inlined into a caller that reads its pointers from an
// array). Device code inlines it as usual.
#if defined(__CUDA_ARCH__)
#define TG_HOST_NOINLINE
#else
#define TG_HOST_NOINLINE __attribute__((noinline))
#endif

// TG_WITH_CUDA is set by the tapegrad::cuda CMake target (CUDA runtime, cuBLAS and cuBLASLt linked).
// Host-side CUDA work (device queries, memory, copies) needs only that; work that launches kernels also
// needs the translation unit to be compiled by nvcc, which TG_CUDA_KERNELS says.
#if defined(TG_WITH_CUDA) && defined(__CUDACC__)
#define TG_CUDA_KERNELS 1
#endif

// The configuration's ABI namespace. Every tapegrad name lives in an inline namespace that says whether
// the translation unit was built with the CUDA backend: tg::abi_cuda (TG_WITH_CUDA) or tg::abi_cpu.
// Class layouts are the same either way, but inline functions whose bodies depend on TG_WITH_CUDA (the
// device queries, the allocators, the CUDA paths of the ops) would otherwise be one symbol with two
// definitions in a program that links a CPU-only translation unit with a CUDA one, and the linker would
// keep either. With the namespace, such a program holds two consistent copies; passing a tapegrad type
// between the halves fails to link, naming tg::abi_cpu and tg::abi_cuda (build both with tapegrad::cuda).
#if defined(TG_WITH_CUDA)
#define TG_ABI abi_cuda
#else
#define TG_ABI abi_cpu
#endif
#define TG_STRINGIFY_(x) #x
#define TG_STRINGIFY(x) TG_STRINGIFY_(x)
/// "abi_cpu" or "abi_cuda": messages that print type names leave it out ("tg::fn::Gelu").
#define TG_ABI_NAME TG_STRINGIFY(TG_ABI)

/// Every header wraps its declarations in these, as fmt does (FMT_BEGIN_NAMESPACE): plain C++17 nested
/// namespaces that code indexers (ctags, cscope) read, rather than C++20's `namespace tg::inline abi_cpu`.
#define TG_BEGIN_NAMESPACE \
  namespace tg {           \
  inline namespace TG_ABI {
#define TG_END_NAMESPACE \
  }                      \
  }

TG_BEGIN_NAMESPACE

/// The library version as "major.minor.patch".
inline constexpr const char* version = TG_VERSION_STRING;

/// True when this translation unit was built with the CUDA backend (TG_WITH_CUDA).
#if defined(TG_WITH_CUDA)
inline constexpr bool built_with_cuda = true;
#else
inline constexpr bool built_with_cuda = false;
#endif

/// True when this translation unit can launch CUDA kernels: built with the CUDA backend and by nvcc.
#if defined(TG_CUDA_KERNELS)
inline constexpr bool cuda_kernels = true;
#else
inline constexpr bool cuda_kernels = false;
#endif

TG_END_NAMESPACE
