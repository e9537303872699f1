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
// Before a TG_HD template that is also instantiated for host-only types (a generic derivative compiled for
// a tg::Tensor, math/functors.hpp): nvcc then checks host / device calls only where it runs on the device.
#define TG_HD_GENERIC _Pragma("nv_exec_check_disable")
#else
#define TG_HD
#define TG_DEVICE
#define TG_HD_GENERIC
#endif

// TG_CPU_MULTI_ISA: whether the CPU loops are also compiled for wider vector units and picked at run
// time (runtime/cpu/loops.hpp says why and where not).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TG_CPU_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define TG_CPU_SANITIZED 1
#endif
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && !defined(__AVX512F__) && \
    !defined(TG_CPU_SANITIZED)
#define TG_CPU_MULTI_ISA 1
#else
#define TG_CPU_MULTI_ISA 0
#endif

// TG_HOST_NOINLINE keeps a function out of line in host code, so that the host compiler takes its
// __restrict parameters as given and vectorises the loop inside without run-time alias checks (which g++
// adds, and then fails, once such a function is inlined into a caller that reads its pointers from an
// array). Device code inlines it as usual. Being out of line, such a loop is not inlined into the CPU
// loops' wider versions, so with g++ it has its own: x86-64-v4 (AVX-512), v3 (AVX2) and the baseline,
// picked by the loader (target_clones), without FMA contraction, like the loops (the same bits).
#if defined(__CUDA_ARCH__)
#define TG_HOST_NOINLINE
#elif TG_CPU_MULTI_ISA && !defined(__clang__)
#define TG_HOST_NOINLINE \
  __attribute__((noinline, flatten, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), optimize("fp-contract=off")))
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
