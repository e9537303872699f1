// tg::build_info(): what this program was built with and runs on — tapegrad's version, the CPU GEMM
// library's, CUDA's runtime, cuBLASLt's and cuDNN's where built with CUDA, and the devices — for logs and reports.
#pragma once

#include "tapegrad/config.hpp"

#include <string>
#include <utility>
#include <vector>

#include "tapegrad/backend/cpu/onednn.hpp"
#include "tapegrad/backend/cuda/blaslt.hpp"
#include "tapegrad/backend/cuda/cudnn.hpp"
#include "tapegrad/runtime/cpu/loops.hpp"
#include "tapegrad/runtime/device.hpp"

TG_BEGIN_NAMESPACE

/// Versions and devices, each as text (CUDA's fields say "not in this build" without TG_WITH_CUDA).
struct BuildInfo {
  std::string tapegrad, onednn, cuda_runtime, cublaslt, cudnn, cuda_devices;
  int cpu_threads = 0;     ///< OpenMP threads the CPU loops and oneDNN use
  bool cpu_bf16 = false;   ///< the CPU has bf16 instructions oneDNN uses (else bf16 GEMMs run as f32)

  /// (name, value) rows, in the order above, for a table.
  std::vector<std::pair<std::string, std::string>> rows() const {
    return {{"tapegrad", tapegrad},          {"oneDNN (CPU GEMMs, convolutions)", onednn}, {"CUDA runtime", cuda_runtime},
            {"cuBLASLt", cublaslt},          {"cuDNN (CUDA convolutions)", cudnn}, {"CUDA devices", cuda_devices}, {"CPU threads (OpenMP)", std::to_string(cpu_threads)},
            {"CPU bf16 instructions", cpu_bf16 ? "yes (oneDNN's native bf16 kernels)" : "no (bf16 GEMMs run as f32)"}};
  }
};

/// What this translation unit was built with and the machine it runs on.
inline BuildInfo build_info() {
  BuildInfo info;
  info.tapegrad = version;
  info.onednn = cpu::onednn_version();
  info.cuda_runtime = cuda::runtime_version();
  info.cublaslt = cuda::blaslt_version();
  info.cudnn = cuda::cudnn_version();
  info.cuda_devices = cuda::describe_devices();
  info.cpu_threads = cpu::threads();
  info.cpu_bf16 = cpu::OneDnn::instance().bf16_supported();
  return info;
}

TG_END_NAMESPACE
