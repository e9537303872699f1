// Device tags (tg::Cpu, tg::Cuda) and the CUDA device queries, which answer "none" cleanly on a
// machine without a GPU or driver.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"

#if defined(TG_WITH_CUDA)
#include "tapegrad/runtime/cuda/check.hpp"
#endif

TG_BEGIN_NAMESPACE

/// Host memory, computed by OpenMP loops and oneDNN.
struct Cpu {
  static constexpr const char* name = "cpu";
};
/// NVIDIA GPU memory, computed by CUDA kernels and cuBLASLt. Needs a build with tapegrad::cuda.
struct Cuda {
  static constexpr const char* name = "cuda";
};

template <class D>
concept Device = std::is_same_v<D, Cpu> || std::is_same_v<D, Cuda>;

namespace detail {
template <class...> inline constexpr bool always_false = false;
}  // namespace detail

namespace cuda {

/// What a CUDA device is: its name, memory and compute capability.
struct DeviceInfo {
  int index = -1;
  std::string name;
  std::size_t total_memory = 0;  ///< bytes
  std::size_t free_memory = 0;   ///< bytes, at the time of the query
  int major = 0, minor = 0;      ///< compute capability, e.g. 9.0 for H100/H200
  int multiprocessors = 0;
};

/// Number of usable CUDA devices: 0 without a GPU, a driver, or a CUDA build. Never throws.
inline int device_count() {
#if defined(TG_WITH_CUDA)
  int n = 0;
  // Without a driver this returns cudaErrorInsufficientDriver (or NoDevice) and leaves n at 0: report
  // none and clear the last error. (The runtime keeps reporting an initialisation failure anyway, so
  // everything else checks for a device before it launches and reads cudaGetLastError.)
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

/// True when CUDA support is built in and at least one GPU can be used.
inline bool available() { return device_count() > 0; }

/// The one error of a build without the CUDA backend, raised by every CUDA entry point there (the device
/// queries answer "none" instead): what to build to get it.
[[noreturn]] inline void not_compiled_in(const char* op) {
  ::tg::detail::fail(op, "CUDA support not compiled in: build this file with nvcc and link tapegrad::cuda");
}

/// Throws tg::Error("no CUDA device: ...") naming `op` unless a GPU is usable (without the CUDA backend:
/// not_compiled_in).
inline void require_device(const char* op) {
#if defined(TG_WITH_CUDA)
  if (!available())
    ::tg::detail::fail(op, "no CUDA device: this machine has no usable NVIDIA GPU or driver "
                           "(cudaGetDeviceCount found none); use tg::Cpu tensors here");
#else
  not_compiled_in(op);
#endif
}

/// The CUDA runtime's version ("13.0"), "unknown" when the runtime cannot say, or "not in this build".
inline std::string runtime_version() {
#if defined(TG_WITH_CUDA)
  int runtime = 0;
  const bool known = cudaRuntimeGetVersion(&runtime) == cudaSuccess;
  (void)cudaGetLastError();
  return known ? std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10) : "unknown";
#else
  return "not in this build (no TG_WITH_CUDA: link tapegrad::cuda)";
#endif
}

/// The device CUDA work runs on (cudaGetDevice), or -1 without a GPU.
inline int current_device() {
#if defined(TG_WITH_CUDA)
  if (!available()) return -1;
  int d = 0;
  TG_CUDA_CHECK(cudaGetDevice(&d));
  return d;
#else
  return -1;
#endif
}

/// Makes device `index` current for this thread's CUDA work (the library's stream and pool follow it).
inline void set_device(int index) {
  require_device("cuda::set_device");
#if defined(TG_WITH_CUDA)
  TG_CHECK(index >= 0 && index < device_count(), "cuda::set_device", "device index ", index, " is out of range: ", device_count(),
           " device(s)");
  TG_CUDA_CHECK(cudaSetDevice(index));
#else
  (void)index;
#endif
}

/// Name, memory and compute capability of device `index`; an error naming the count if there is none.
inline DeviceInfo device_info(int index = 0) {
  require_device("cuda::device_info");
  DeviceInfo info;
#if defined(TG_WITH_CUDA)
  const int n = device_count();
  TG_CHECK(index >= 0 && index < n, "cuda::device_info", "device index ", index, " is out of range: ", n,
           " device(s)");
  cudaDeviceProp prop{};
  TG_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  info.index = index;
  info.name = prop.name;
  info.total_memory = prop.totalGlobalMem;
  info.major = prop.major;
  info.minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  int previous = 0;
  TG_CUDA_CHECK(cudaGetDevice(&previous));
  TG_CUDA_CHECK(cudaSetDevice(index));
  std::size_t free = 0, total = 0;
  TG_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  TG_CUDA_CHECK(cudaSetDevice(previous));
  info.free_memory = free;
#else
  (void)index;
#endif
  return info;
}

/// One line per device ("cuda:0 NVIDIA H200, 139.8 GiB, sm_90"), or "none" without a GPU.
inline std::string describe_devices() {
  const int n = device_count();
  if (n == 0) return "none";
  std::string s;
  for (int i = 0; i < n; ++i) {
    const DeviceInfo d = device_info(i);
    if (i) s += "\n";
    s += ::tg::detail::concat("cuda:", i, " ", d.name, ", ", static_cast<double>(d.total_memory) / (1 << 30),
                              " GiB, sm_", d.major, d.minor);
  }
  return s;
}

}  // namespace cuda

/// "cpu", or for CUDA the current device as "cuda:0 NVIDIA H200" (an error without one).
template <Device D>
std::string device_name() {
  if constexpr (std::is_same_v<D, Cpu>) {
    return "cpu";
  } else {
    cuda::require_device("device_name");
    const int index = cuda::current_device();
    return ::tg::detail::concat("cuda:", index, " ", cuda::device_info(index).name);
  }
}

/// Runs `f.template operator()<D>()` for the device `device` names, chosen at run time: "cpu"; "cuda" (an
/// error naming what is missing where this file cannot run CUDA work: no GPU, or not compiled by nvcc
/// with tapegrad::cuda); "auto", CUDA where it can run, else the CPU. A training program's main picks its
/// device with it and writes its body once, as a template on D; both instantiations return the same type.
template <class F>
decltype(auto) with_device(std::string_view device, F&& f) {
  TG_CHECK(device == "auto" || device == "cpu" || device == "cuda", "with_device", "unknown device '", device,
           "'; use auto, cpu or cuda");
  if constexpr (cuda_kernels) {
    if (device == "cuda" || (device == "auto" && cuda::available())) {
      cuda::require_device("with_device(cuda)");
      return f.template operator()<Cuda>();
    }
  } else if (device == "cuda") {
    if constexpr (built_with_cuda)
      ::tg::detail::fail("with_device(cuda)", "this file launches no CUDA kernels: compile it with nvcc (a .cu file, or "
                                              "set_source_files_properties(... LANGUAGE CUDA))");
    cuda::not_compiled_in("with_device(cuda)");
  }
  return f.template operator()<Cpu>();
}

TG_END_NAMESPACE
