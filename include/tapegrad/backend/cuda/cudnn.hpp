// The CUDA convolution door: cuDNN 9's convolutions (forward, backward data, backward filter) on NHWC
// activations, f32 (FMA math unless tg::set_allow_tf32) and bf16 (f32 accumulation, tensor cores). cuDNN
// takes the kernel as (o, kh, kw, c / groups) ("NHWC" filters), so the HWIO kernel is transposed into that
// layout by a kernel on the way in (and the kernel's gradient back on the way out); cuDNN pads both sides
// of an axis alike, so an uneven padding ("SAME" with a stride) runs on a zero-padded copy of the images. A plan (descriptors,
// the algorithm cuDNN's heuristics rank first that fits, its workspace) is built once per problem, pass,
// type and device, and cached: its workspace is never freed, so a captured CUDA graph may replay it.
// Not f64 (the op's own loop, exact), no fused bias or activation (the op adds them).
// Without cuDNN at build time (TG_WITH_CUDNN unset) a CUDA convolution is an error naming what is missing;
// without CUDA, cuda::not_compiled_in.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/problem.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/runtime/device.hpp"

#if defined(TG_WITH_CUDA) && defined(TG_WITH_CUDNN)
#include <cudnn.h>

#include "tapegrad/runtime/cuda/context.hpp"
#include "tapegrad/runtime/cuda/launch.hpp"
#endif

TG_BEGIN_NAMESPACE
namespace cuda {

// The layout moves around cuDNN's calls, as TG_HD functors (tested on the CPU: tests/test_conv.cpp).
namespace detail {

/// Moves a kernel between HWIO (kh, kw, i, o) and cuDNN's (o, kh, kw, i): element `e` of `to`.
template <class T>
struct KernelLayoutFn {
  const T* from;
  T* to;
  std::int64_t spatial, i, o;  ///< kh * kw, c / groups, o
  bool to_ohwi;
  TG_HD void operator()(std::int64_t e) const {
    if (to_ohwi) {  // to[o][s][c] = from[s][c][o]
      const std::int64_t c = e % i, s = e / i % spatial, oo = e / (i * spatial);
      to[e] = from[(s * i + c) * o + oo];
    } else {  // to[s][c][o] = from[o][s][c]
      const std::int64_t oo = e % o, c = e / o % i, s = e / (o * i);
      to[e] = from[(oo * spatial + s) * i + c];
    }
  }
};

/// Images (n, h, w, c) and the same images with `top` / `left` rows and columns of zeros before them and
/// the rest after, (n, hp, wp, c): pad writes element `e` of the padded images, crop element `e` of the
/// unpadded ones (for cuDNN, which pads both sides of an axis alike, an uneven padding is a padded copy).
template <class T>
struct PadImagesFn {
  const T* from;
  T* to;
  std::int64_t h, w, c, hp, wp, top, left;
  bool pad;
  TG_HD void operator()(std::int64_t e) const {
    if (pad) {
      const std::int64_t ch = e % c, iw = e / c % wp - left, ih = e / (c * wp) % hp - top, n = e / (c * wp * hp);
      to[e] = ih >= 0 && ih < h && iw >= 0 && iw < w ? from[((n * h + ih) * w + iw) * c + ch] : T(0);
    } else {
      const std::int64_t ch = e % c, iw = e / c % w, ih = e / (c * w) % h, n = e / (c * w * h);
      to[e] = from[((n * hp + ih + top) * wp + iw + left) * c + ch];
    }
  }
};

}  // namespace detail

#if defined(TG_WITH_CUDA) && defined(TG_WITH_CUDNN)

/// cuDNN's version, "9.19.0".
inline std::string cudnn_version() {
  const std::size_t v = cudnnGetVersion();
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

namespace detail {

[[noreturn]] inline void throw_cudnn(cudnnStatus_t st, const char* call, const char* file, int line) {
  throw Error(::tg::detail::concat("[cudnn] ", file, ":", line, ": ", call, " failed: ", cudnnGetErrorString(st)));
}

}  // namespace detail

#define TG_CUDNN_CHECK(call)                                                                   \
  do {                                                                                         \
    const cudnnStatus_t tg_st_ = (call);                                                       \
    if (tg_st_ != CUDNN_STATUS_SUCCESS) ::tg::cuda::detail::throw_cudnn(tg_st_, #call, __FILE__, __LINE__); \
  } while (0)

/// Per-device cuDNN handles (on the library's stream) and the plan cache.
class CuDnn {
 public:
  static CuDnn& instance() {
    static CuDnn self;
    return self;
  }

  /// One pass on device buffers of `dtype` with the kernel in cuDNN's layout: forward y = conv(a, w);
  /// backward_data dx (out) from a = dy and w; backward_weights dw (out, cuDNN's layout) from a = x and
  /// b = dy. Queued on the library's stream.
  void run(backend::ConvPass pass, const backend::ConvProblem& p, cudnnDataType_t dtype, const void* a, const void* b, void* out) {
    std::lock_guard lock(mutex_);
    const int device = current_device();
    State& st = state(device);
    const auto key = std::tuple(pass, p.key(), static_cast<int>(dtype), allow_tf32());
    auto it = st.plans.find(key);
    if (it == st.plans.end()) it = st.plans.emplace(key, make(st.handle, pass, p, dtype, device)).first;
    Plan& plan = *it->second;
    const float one = 1.0f, zero = 0.0f;
    using backend::ConvPass;
    switch (pass) {
      case ConvPass::forward:
        TG_CUDNN_CHECK(cudnnConvolutionForward(st.handle, &one, plan.x, a, plan.w, b, plan.conv, plan.fwd, plan.workspace, plan.workspace_bytes,
                                               &zero, plan.y, out));
        break;
      case ConvPass::backward_data:
        TG_CUDNN_CHECK(cudnnConvolutionBackwardData(st.handle, &one, plan.w, b, plan.y, a, plan.conv, plan.bwd_data, plan.workspace,
                                                    plan.workspace_bytes, &zero, plan.x, out));
        break;
      case ConvPass::backward_weights:
        TG_CUDNN_CHECK(cudnnConvolutionBackwardFilter(st.handle, &one, plan.x, a, plan.y, b, plan.conv, plan.bwd_filter, plan.workspace,
                                                      plan.workspace_bytes, &zero, plan.w, out));
        break;
    }
  }

 private:
  struct Plan {
    cudnnTensorDescriptor_t x = nullptr, y = nullptr;
    cudnnFilterDescriptor_t w = nullptr;
    cudnnConvolutionDescriptor_t conv = nullptr;
    cudnnConvolutionFwdAlgo_t fwd{};
    cudnnConvolutionBwdDataAlgo_t bwd_data{};
    cudnnConvolutionBwdFilterAlgo_t bwd_filter{};
    void* workspace = nullptr;  ///< never freed: a captured graph may hold it
    std::size_t workspace_bytes = 0;
  };
  struct State {
    cudnnHandle_t handle = nullptr;
    std::map<std::tuple<backend::ConvPass, decltype(backend::ConvProblem{}.key()), int, bool>, std::unique_ptr<Plan>> plans;
  };
  /// The most workspace an algorithm may ask for.
  static constexpr std::size_t max_workspace = std::size_t{256} << 20;

  State& state(int device) {
    State& st = states_[device];
    if (st.handle == nullptr) {
      TG_CUDNN_CHECK(cudnnCreate(&st.handle));
      TG_CUDNN_CHECK(cudnnSetStream(st.handle, stream()));
    }
    return st;
  }

  /// The first of cuDNN's ranked algorithms that succeeded and fits the workspace cap.
  template <class Perf>
  static const Perf& pick(const Perf* perf, int found, const backend::ConvProblem& p, const char* what) {
    for (int i = 0; i < found; ++i)
      if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].memory <= max_workspace) return perf[i];
    throw Error(::tg::detail::concat(p.op, ": cuDNN has no ", what, " algorithm for x (", p.n, ", ", p.h, ", ", p.w, ", ", p.c, "), kernel (",
                                     p.kh, ", ", p.kw, ", ", p.c / p.groups, ", ", p.o, "), ", p.groups, " groups"));
  }

  std::unique_ptr<Plan> make(cudnnHandle_t h, backend::ConvPass pass, const backend::ConvProblem& p, cudnnDataType_t dtype, int device) {
    auto plan = std::make_unique<Plan>();
    auto dim = [](std::int64_t v) { return static_cast<int>(v); };
    TG_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->x));
    TG_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->y));
    TG_CUDNN_CHECK(cudnnCreateFilterDescriptor(&plan->w));
    TG_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&plan->conv));
    TG_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->x, CUDNN_TENSOR_NHWC, dtype, dim(p.n), dim(p.c), dim(p.h), dim(p.w)));
    TG_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y, CUDNN_TENSOR_NHWC, dtype, dim(p.n), dim(p.o), dim(p.oh), dim(p.ow)));
    TG_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w, dtype, CUDNN_TENSOR_NHWC, dim(p.o), dim(p.c / p.groups), dim(p.kh), dim(p.kw)));
    // cuDNN pads both sides of an axis alike: conv() hands it an uneven padding as a padded copy.
    TG_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(plan->conv, dim(p.pad_lo[0]), dim(p.pad_lo[1]), dim(p.stride[0]), dim(p.stride[1]),
                                                   dim(p.dilation[0]), dim(p.dilation[1]), CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    TG_CUDNN_CHECK(cudnnSetConvolutionGroupCount(plan->conv, dim(p.groups)));
    const cudnnMathType_t math = dtype == CUDNN_DATA_BFLOAT16 || allow_tf32() ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    TG_CUDNN_CHECK(cudnnSetConvolutionMathType(plan->conv, math));
    constexpr int want = 8;
    int found = 0;
    using backend::ConvPass;
    if (pass == ConvPass::forward) {
      cudnnConvolutionFwdAlgoPerf_t perf[want];
      TG_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, plan->x, plan->w, plan->conv, plan->y, want, &found, perf));
      const auto& best = pick(perf, found, p, "forward");
      plan->fwd = best.algo, plan->workspace_bytes = best.memory;
    } else if (pass == ConvPass::backward_data) {
      cudnnConvolutionBwdDataAlgoPerf_t perf[want];
      TG_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, plan->w, plan->y, plan->conv, plan->x, want, &found, perf));
      const auto& best = pick(perf, found, p, "backward-data");
      plan->bwd_data = best.algo, plan->workspace_bytes = best.memory;
    } else {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[want];
      TG_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, plan->x, plan->y, plan->conv, plan->w, want, &found, perf));
      const auto& best = pick(perf, found, p, "backward-filter");
      plan->bwd_filter = best.algo, plan->workspace_bytes = best.memory;
    }
    if (plan->workspace_bytes > 0) plan->workspace = allocate(plan->workspace_bytes, device);
    return plan;
  }

  std::mutex mutex_;
  std::map<int, State> states_;
};

template <class T>
constexpr cudnnDataType_t cudnn_type() {
  return std::is_same_v<T, bf16> ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
}

/// Runs one pass of `p` on CUDA (see backend/problem.hpp); f64 is left to the op (done = false).
template <class T>
backend::ConvResult conv(backend::ConvPass pass, const backend::ConvProblem& p, const Tensor<T, Cuda>& a, const Tensor<T, Cuda>& b,
                         const Tensor<T, Cuda>*, Tensor<T, Cuda>& out) {
  backend::ConvResult r;
  if constexpr (std::is_same_v<T, double>) {
    return r;
  } else {
    if (a.size() == 0 || b.size() == 0) return r;  // an empty sum: the op's loop writes the zeros
    r.done = true;
    if (out.size() == 0) return r;
    backend::ConvProblem q = p;
    q.bias = false, q.act = Activation::none;
    using backend::ConvPass;
    // An uneven padding: the images padded by a kernel, cuDNN's convolution without padding, and for
    // backward data the padded gradient cropped.
    const bool uneven = p.pad_lo[0] != p.pad_hi[0] || p.pad_lo[1] != p.pad_hi[1];
    const std::int64_t hp = p.h + p.pad_lo[0] + p.pad_hi[0], wp = p.w + p.pad_lo[1] + p.pad_hi[1];
    Tensor<T, Cuda> padded;
    if (uneven) {
      q.h = hp, q.w = wp, q.pad_lo[0] = q.pad_lo[1] = q.pad_hi[0] = q.pad_hi[1] = 0;
      padded = Tensor<T, Cuda>(Shape{p.n, hp, wp, p.c});
      if (pass != ConvPass::backward_data)
        index_map(padded.size(), detail::PadImagesFn<T>{a.data(), padded.data(), p.h, p.w, p.c, hp, wp, p.pad_lo[0], p.pad_lo[1], true});
    }
    const void* x_or_dy = uneven && pass != ConvPass::backward_data ? padded.data() : a.data();
    const std::int64_t spatial = p.kh * p.kw, i = p.c / p.groups, n = p.w_size();
    Tensor<T, Cuda> w(Shape{n});  // the kernel in cuDNN's layout
    if (pass == ConvPass::backward_weights) {
      CuDnn::instance().run(pass, q, cudnn_type<T>(), x_or_dy, b.data(), w.data());
      index_map(n, detail::KernelLayoutFn<T>{w.data(), out.data(), spatial, i, p.o, false});
    } else {
      index_map(n, detail::KernelLayoutFn<T>{b.data(), w.data(), spatial, i, p.o, true});
      const bool crop = uneven && pass == ConvPass::backward_data;
      CuDnn::instance().run(pass, q, cudnn_type<T>(), x_or_dy, w.data(), crop ? padded.data() : out.data());
      if (crop) index_map(out.size(), detail::PadImagesFn<T>{padded.data(), out.data(), p.h, p.w, p.c, hp, wp, p.pad_lo[0], p.pad_lo[1], false});
    }
    return r;
  }
}

#elif defined(TG_WITH_CUDA)

inline std::string cudnn_version() { return "not in this build (cuDNN was not found when tapegrad was configured)"; }

template <class T>
backend::ConvResult conv(backend::ConvPass, const backend::ConvProblem& p, const Tensor<T, Cuda>&, const Tensor<T, Cuda>&,
                         const Tensor<T, Cuda>*, Tensor<T, Cuda>&) {
  if constexpr (std::is_same_v<T, double>) {
    return {};
  } else {
    ::tg::detail::fail(p.op, "CUDA convolutions run through cuDNN, which this build did not find: install cuDNN 9 for your CUDA "
                             "(NVIDIA's cudnn9-cuda-13 package, or cuDNN inside the CUDA toolkit), then configure again "
                             "(CMake looks for cudnn.h and libcudnn beside the toolkit; set CUDNN_INCLUDE_DIR and CUDNN_LIBRARY "
                             "if they are elsewhere)");
  }
}

#else

inline std::string cudnn_version() { return "not in this build (no TG_WITH_CUDA: link tapegrad::cuda)"; }

template <class T>
backend::ConvResult conv(backend::ConvPass, const backend::ConvProblem& p, const Tensor<T, Cuda>&, const Tensor<T, Cuda>&,
                         const Tensor<T, Cuda>*, Tensor<T, Cuda>&) {
  not_compiled_in(p.op);
}

#endif

}  // namespace cuda
TG_END_NAMESPACE
