// The device dispatch: the few ways tapegrad runs work on a device, each written once for both devices.
// Ops above name a device only as a template parameter; what a device does is decided here: an OpenMP
// loop on the CPU (appended to the plan while tg::compile records), a grid-stride kernel on CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/base/bf16.hpp"
#include "tapegrad/base/dtype.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/runtime/cpu/loops.hpp"
#include "tapegrad/runtime/cuda/launch.hpp"
#include "tapegrad/runtime/device.hpp"
#include "tapegrad/runtime/recorder.hpp"
#include "tapegrad/runtime/storage.hpp"

TG_BEGIN_NAMESPACE
namespace detail {

/// Runs f(i) for i in [0, n) on device D: an OpenMP loop on the CPU, a grid-stride kernel on CUDA.
/// `work_per_item` (in element operations; a transcendental function counts several) lets the CPU loop
/// go parallel for few but heavy items, such as the rows of a softmax.
template <Device D, class F>
void index_map(std::int64_t n, const F& f, std::int64_t work_per_item = 1) {
  if constexpr (std::is_same_v<D, Cpu>) cpu_kernel([n, f, work_per_item] { cpu::index_map(n, f, work_per_item); });
  else cuda::index_map(n, f);
}

/// The same work written for each device: `cpu` over n_cpu items on the CPU (rows or column blocks:
/// contiguous loops that vectorise, few items), `gpu` over n_gpu items on CUDA (an element per thread,
/// coalesced). Both must compute the same result.
template <Device D, class FCpu, class FGpu>
void index_map_per_device(std::int64_t n_cpu, const FCpu& cpu, std::int64_t cpu_work_per_item, std::int64_t n_gpu, const FGpu& gpu) {
  if constexpr (std::is_same_v<D, Cpu>) index_map<D>(n_cpu, cpu, cpu_work_per_item);
  else index_map<D>(n_gpu, gpu);
}

/// The elements per item of elementwise work on D that is split into items (the multi-tensor launcher's
/// chunks): long contiguous runs on the CPU (loops that vectorise, few items), one element per thread on a
/// GPU.
template <Device D>
inline constexpr std::int64_t elementwise_chunk = std::is_same_v<D, Cpu> ? 2048 : 1;

/// The floats one vector instruction of D's loops holds: 16, 8 or 4 on the CPU (the instruction set its
/// loops picked at run time: AVX-512, AVX2 or SSE2), 1 on CUDA (a thread an element). For ops whose best
/// algorithm depends on it.
template <Device D>
int vector_floats() {
  if constexpr (std::is_same_v<D, Cpu>) return cpu::isa() == cpu::Isa::avx512 ? 16 : cpu::isa() == cpu::Isa::avx2 ? 8 : 4;
  else return 1;
}

/// Whether D runs few long items best (the CPU's threads, each item a block of work with its own scratch)
/// rather than many short ones (a GPU's threads): for ops whose two forms need different buffers.
template <Device D>
inline constexpr bool few_long_items = std::is_same_v<D, Cpu>;

template <class From, class To>
struct ConvertFn {
  const From* x;
  To* y;
  TG_HD void operator()(std::int64_t i) const { y[i] = convert_to<To>(convert_from<compute_t<From>>(x[i])); }
};

/// y = x converted to To, n elements on device D (to bf16: rounded to nearest even). f32 <-> bf16 on the
/// CPU runs as a vectorised loop; every other pair through the elementwise loop.
template <Device D, class From, class To>
void convert(std::int64_t n, const From* x, To* y) {
  constexpr bool f32_bf16 = (std::is_same_v<From, float> && std::is_same_v<To, bf16>) || (std::is_same_v<From, bf16> && std::is_same_v<To, float>);
  if constexpr (std::is_same_v<D, Cpu> && f32_bf16) cpu_kernel([n, x, y] { cpu::convert(n, x, y); });
  else index_map<D>(n, ConvertFn<From, To>{x, y});
}

/// Rejects a value of index[0, n) outside [0, limit), naming `op`, the value, its position and the limit,
/// without synchronising: on the CPU a kernel of its own (replayed by compiled steps too), on CUDA a kernel
/// that reports to the device's error slot, raised at the next synchronisation.
template <Device D>
void check_indices(const std::int32_t* index, std::int64_t n, std::int64_t limit, const char* op) {
  if constexpr (std::is_same_v<D, Cpu>) {
    cpu_kernel([index, n, limit, op] {
      for (std::int64_t i = 0; i < n; ++i)
        if (index[i] < 0 || index[i] >= limit)
          fail(op, "label ", index[i], " at position ", i, " is out of range for ", limit, " classes; labels must be in [0, ", limit, ")");
    });
  } else {
    cuda::check_indices(index, n, limit, op);
  }
}

/// Copies `bytes` between two buffers on D as part of the work being recorded: on the CPU a kernel (run,
/// and appended to the plan while tg::compile records), on CUDA a copy ordered on the library's stream
/// (captured into the graph while a step is captured).
template <Device D>
void recorded_copy(void* dst, const void* src, std::size_t bytes) {
  if constexpr (std::is_same_v<D, Cpu>) cpu_kernel([dst, src, bytes] { cpu::copy(dst, src, bytes); });
  else copy_bytes<D, D>(dst, src, bytes);
}

}  // namespace detail
TG_END_NAMESPACE
