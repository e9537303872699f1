// oneDNN's convolution primitives in its own terms: forward (with a bias and an eltwise post-op),
// backward data and backward weights, on NHWC activations and HWIO kernels, f32 and bf16 (f32 accumulation;
// bf16 where the CPU has native bf16 kernels). The primitive chooses its own (blocked) layout for the
// kernel; a reorder from HWIO into it, or back for the kernel's gradient, is built with the primitive and
// cached with it, per problem, pass and type. Written against oneDNN's C API (see onednn.hpp).
#pragma once

#include <oneapi/dnnl/dnnl.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "tapegrad/config.hpp"
#include "tapegrad/backend/cpu/onednn.hpp"
#include "tapegrad/backend/problem.hpp"
#include "tapegrad/base/error.hpp"

TG_BEGIN_NAMESPACE
namespace cpu {

/// The process-wide oneDNN convolutions: an engine and stream of their own (onednn::Engine), primitives cached
/// per shape.
class OneDnnConv {
 public:
  static OneDnnConv& instance() {
    static OneDnnConv self;
    return self;
  }

  /// Runs one pass on raw buffers (`type` for x, w and y; bias f32, length o). forward: y = conv(a = x,
  /// b = w) [+ bias] [then the post-op]; backward_data: out = dx from a = dy, b = w; backward_weights:
  /// out = dw from a = x, b = dy. Blocks until done.
  void run(backend::ConvPass pass, const backend::ConvProblem& p, GemmType type, Eltwise post_op, const void* a, const void* b,
           const float* bias, void* out) {
    std::lock_guard lock(mutex_);
    const auto key = std::tuple(pass, p, type, post_op);
    auto it = cache_.find(key);
    if (it == cache_.end()) it = cache_.emplace(key, make(pass, p, type, post_op)).first;
    Entry& e = it->second;
    using backend::ConvPass;
    // The kernel, in HWIO or in the primitive's layout, and the primitive's arguments.
    dnnl_memory_t kernel = e.reorder ? e.blocked.get() : e.user_w.get();
    if (pass == ConvPass::backward_weights) {
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(e.x.get(), const_cast<void*>(a)));
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(e.y.get(), const_cast<void*>(b)));
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(e.user_w.get(), out));
    } else {
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(pass == ConvPass::forward ? e.x.get() : e.y.get(), const_cast<void*>(a)));
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(e.user_w.get(), const_cast<void*>(b)));
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(pass == ConvPass::forward ? e.y.get() : e.x.get(), out));
      if (e.reorder) reorder(e.reorder.get(), e.user_w.get(), e.blocked.get());
    }
    dnnl_exec_arg_t args[4];
    int n = 0;
    switch (pass) {
      case ConvPass::forward:
        args[n++] = {DNNL_ARG_SRC, e.x.get()}, args[n++] = {DNNL_ARG_WEIGHTS, kernel}, args[n++] = {DNNL_ARG_DST, e.y.get()};
        if (p.bias) {
          TG_DNNL_CHECK(dnnl_memory_set_data_handle(e.bias.get(), const_cast<float*>(bias)));
          args[n++] = {DNNL_ARG_BIAS, e.bias.get()};
        }
        break;
      case ConvPass::backward_data:
        args[n++] = {DNNL_ARG_DIFF_DST, e.y.get()}, args[n++] = {DNNL_ARG_WEIGHTS, kernel}, args[n++] = {DNNL_ARG_DIFF_SRC, e.x.get()};
        break;
      case ConvPass::backward_weights:
        args[n++] = {DNNL_ARG_SRC, e.x.get()}, args[n++] = {DNNL_ARG_DIFF_DST, e.y.get()}, args[n++] = {DNNL_ARG_DIFF_WEIGHTS, kernel};
        break;
    }
    engine_.execute(e.primitive.get(), n, args);
    if (pass == ConvPass::backward_weights && e.reorder) reorder(e.reorder.get(), e.blocked.get(), e.user_w.get());
    engine_.wait();
  }

 private:
  using MemoryPtr = onednn::MemoryPtr;
  using PdPtr = onednn::PdPtr;

  /// A cached pass: the primitive, memory objects for x, y, the HWIO kernel and the bias whose data
  /// handles are swapped in per call, and (when the primitive chose another layout for the kernel) the
  /// reorder between HWIO and that layout with the buffer it owns.
  struct Entry {
    onednn::PrimitivePtr primitive, reorder;
    MemoryPtr x, y, user_w, blocked, bias;
  };

  OneDnnConv() = default;

  void reorder(dnnl_primitive_t r, dnnl_memory_t from, dnnl_memory_t to) {
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
    engine_.execute(r, 2, args);
  }

  Entry make(backend::ConvPass pass, const backend::ConvProblem& p, GemmType type, Eltwise post_op) {
    using backend::ConvPass;
    const dnnl_data_type_t dt = type == GemmType::bf16 ? dnnl_bf16 : dnnl_f32;
    const std::int64_t g = p.groups, ig = p.c / g, og = p.o / g;
    // x and y NHWC (oneDNN's logical order is N, C, H, W); the kernel HWIO, with the groups split out of
    // O when there are several: logical (G, O/G, I/G, KH, KW).
    const dnnl_dims_t x_dims = {p.n, p.c, p.h, p.w}, y_dims = {p.n, p.o, p.oh, p.ow};
    dnnl_memory_desc_t x_md, y_md, w_user, w_any, bias_md;
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_tag(&x_md, 4, x_dims, dt, dnnl_nhwc));
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_tag(&y_md, 4, y_dims, dt, dnnl_nhwc));
    if (g == 1) {
      const dnnl_dims_t dims = {p.o, p.c, p.kh, p.kw}, strides = {1, p.o, p.kw * p.c * p.o, p.c * p.o};
      TG_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&w_user, 4, dims, dt, strides));
      TG_DNNL_CHECK(dnnl_memory_desc_init_by_tag(&w_any, 4, dims, dt, dnnl_format_tag_any));
    } else {
      const dnnl_dims_t dims = {g, og, ig, p.kh, p.kw}, strides = {og, 1, p.o, p.kw * ig * p.o, ig * p.o};
      TG_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&w_user, 5, dims, dt, strides));
      TG_DNNL_CHECK(dnnl_memory_desc_init_by_tag(&w_any, 5, dims, dt, dnnl_format_tag_any));
    }
    const dnnl_dims_t bias_dims = {p.o};
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_tag(&bias_md, 1, bias_dims, dnnl_f32, dnnl_a));
    // oneDNN counts dilation from 0 (no gaps).
    const dnnl_dims_t strides = {p.stride[0], p.stride[1]}, dilates = {p.dilation[0] - 1, p.dilation[1] - 1};
    const dnnl_dims_t pad_l = {p.pad_lo[0], p.pad_lo[1]}, pad_r = {p.pad_hi[0], p.pad_hi[1]};

    auto fail = [&](dnnl_status_t st, const char* what) {
      throw Error(::tg::detail::concat(p.op, ": oneDNN has no ", what, " for x (", p.n, ", ", p.h, ", ", p.w, ", ", p.c, "), kernel (", p.kh,
                                       ", ", p.kw, ", ", ig, ", ", p.o, "), strides (", p.stride[0], ", ", p.stride[1], "), ", g,
                                       " groups in ", type == GemmType::bf16 ? "bf16" : "f32", ": ", dnnl_status2str(st)));
    };
    // The forward descriptor: the pass itself, or the hint the backward passes are created from.
    dnnl_convolution_desc_t fwd;
    TG_DNNL_CHECK(dnnl_dilated_convolution_forward_desc_init(&fwd, dnnl_forward_training, dnnl_convolution_direct, &x_md, &w_any,
                                                             p.bias && pass == ConvPass::forward ? &bias_md : nullptr, &y_md, strides,
                                                             dilates, pad_l, pad_r));
    // The post-op on the forward pass only (the backward passes are not fused).
    const onednn::AttrPtr attr = onednn::attr_with_post_op(pass == ConvPass::forward ? post_op : Eltwise{});
    dnnl_primitive_desc_t raw = nullptr;
    dnnl_status_t st = dnnl_primitive_desc_create(&raw, &fwd, attr.get(), engine_.get(), nullptr);
    if (st != dnnl_success) fail(st, "forward convolution");
    PdPtr fwd_pd(raw), pd;
    if (pass == ConvPass::forward) {
      pd = std::move(fwd_pd);
    } else {
      dnnl_convolution_desc_t bwd;
      if (pass == ConvPass::backward_data)
        TG_DNNL_CHECK(dnnl_dilated_convolution_backward_data_desc_init(&bwd, dnnl_convolution_direct, &x_md, &w_any, &y_md, strides, dilates,
                                                                       pad_l, pad_r));
      else
        TG_DNNL_CHECK(dnnl_dilated_convolution_backward_weights_desc_init(&bwd, dnnl_convolution_direct, &x_md, &w_any, nullptr, &y_md,
                                                                          strides, dilates, pad_l, pad_r));
      raw = nullptr;
      st = dnnl_primitive_desc_create(&raw, &bwd, nullptr, engine_.get(), fwd_pd.get());
      if (st != dnnl_success) fail(st, pass == ConvPass::backward_data ? "backward-data convolution" : "backward-weights convolution");
      pd.reset(raw);
    }
    Entry e;
    dnnl_primitive_t prim = nullptr;
    TG_DNNL_CHECK(dnnl_primitive_create(&prim, pd.get()));
    e.primitive.reset(prim);
    e.x = engine_.memory(&x_md);
    e.y = engine_.memory(&y_md);
    e.user_w = engine_.memory(&w_user);
    if (p.bias && pass == ConvPass::forward) e.bias = engine_.memory(&bias_md);
    // The layout the primitive chose for the kernel, and the reorder to or from HWIO when it differs.
    const dnnl_memory_desc_t* chosen =
        dnnl_primitive_desc_query_md(pd.get(), pass == ConvPass::backward_weights ? dnnl_query_diff_weights_md : dnnl_query_weights_md, 0);
    if (dnnl_memory_desc_equal(chosen, &w_user) == 0) {
      e.blocked = engine_.memory(chosen, DNNL_MEMORY_ALLOCATE);
      const bool to_user = pass == ConvPass::backward_weights;
      raw = nullptr;
      TG_DNNL_CHECK(dnnl_reorder_primitive_desc_create(&raw, to_user ? chosen : &w_user, engine_.get(), to_user ? &w_user : chosen,
                                                       engine_.get(), nullptr));
      PdPtr reorder_pd(raw);
      dnnl_primitive_t r = nullptr;
      TG_DNNL_CHECK(dnnl_primitive_create(&r, reorder_pd.get()));
      e.reorder.reset(r);
    }
    return e;
  }

  onednn::Engine engine_;
  std::mutex mutex_;
  std::map<std::tuple<backend::ConvPass, backend::ConvProblem, GemmType, Eltwise>, Entry> cache_;
};

}  // namespace cpu
TG_END_NAMESPACE
