// oneDNN, in its own terms: the matmul primitive (f32, and bf16 inputs with f32 accumulation where the CPU
// has bf16 kernels; a bias and an eltwise post-op), its eltwise kernels, primitives cached per shape, dtype
// and post-op. What to ask of it is decided by the CPU's doors (backend/cpu/gemm.hpp, backend/eltwise.hpp).
// Written against oneDNN's C API: nvcc 13 cannot parse dnnl.hpp in C++20 mode, and these headers are
// included by .cu files too.
#pragma once

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"

TG_BEGIN_NAMESPACE

namespace cpu {

namespace detail {

[[noreturn]] inline void throw_dnnl(dnnl_status_t st, const char* call, const char* file, int line) {
  throw Error(::tg::detail::concat("[onednn] ", file, ":", line, ": ", call, " failed: ", dnnl_status2str(st)));
}

}  // namespace detail

#define TG_DNNL_CHECK(call)                                                                  \
  do {                                                                                       \
    const dnnl_status_t tg_st_ = (call);                                                     \
    if (tg_st_ != dnnl_success) ::tg::cpu::detail::throw_dnnl(tg_st_, #call, __FILE__, __LINE__); \
  } while (0)

/// oneDNN's version, "2.6.3".
inline std::string onednn_version() {
  const dnnl_version_t* v = dnnl_version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

/// Element type of a GEMM operand.
enum class GemmType { f32, bf16 };

/// An elementwise function oneDNN computes: an eltwise algorithm and its alpha (undef: none).
struct Eltwise {
  dnnl_alg_kind_t alg = dnnl_alg_kind_undef;
  float alpha = 0.0f;
  auto key() const { return std::tuple(static_cast<int>(alg), alpha); }
  friend bool operator<(const Eltwise& a, const Eltwise& b) { return a.key() < b.key(); }
};

/// One row-major GEMM: C(m, n) = op(A) op(B) [+ bias(n)] [then post_op]; A is (m, k), or stored
/// (k, m) when trans_a; B is (k, n), or stored (n, k) when trans_b. C has the inputs' type.
struct GemmShape {
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  GemmType type = GemmType::f32;
  bool bias = false;
  Eltwise post_op{};
  /// `batch` GEMMs over (batch, m, k) @ (batch, k, n) -> (batch, m, n), each operand's matrices contiguous
  /// one after another (oneDNN's batched matmul); bias is for batch 1 only.
  std::int64_t batch = 1;

  auto key() const { return std::tuple(m, n, k, trans_a, trans_b, type, bias, post_op.key(), batch); }
  friend bool operator<(const GemmShape& a, const GemmShape& b) { return a.key() < b.key(); }
};

/// What every user of oneDNN here sets up, written once: its handles as unique_ptrs that destroy them (the
/// C API's create / destroy pairs), the CPU engine with a stream on it, and an eltwise post-op attribute.
namespace onednn {

template <class H, dnnl_status_t (*Destroy)(H)>
struct Deleter {
  void operator()(H h) const { (void)Destroy(h); }
};
using EnginePtr = std::unique_ptr<dnnl_engine, Deleter<dnnl_engine_t, dnnl_engine_destroy>>;
using StreamPtr = std::unique_ptr<dnnl_stream, Deleter<dnnl_stream_t, dnnl_stream_destroy>>;
using PrimitivePtr = std::unique_ptr<dnnl_primitive, Deleter<dnnl_primitive_t, dnnl_primitive_destroy>>;
using MemoryPtr = std::unique_ptr<dnnl_memory, Deleter<dnnl_memory_t, dnnl_memory_destroy>>;
using PdPtr = std::unique_ptr<dnnl_primitive_desc, Deleter<dnnl_primitive_desc_t, dnnl_primitive_desc_destroy>>;
using AttrPtr = std::unique_ptr<dnnl_primitive_attr, Deleter<dnnl_primitive_attr_t, dnnl_primitive_attr_destroy>>;
using PostOpsPtr = std::unique_ptr<dnnl_post_ops, Deleter<dnnl_post_ops_t, dnnl_post_ops_destroy>>;

/// The CPU engine and an in-order stream on it. Each user (the GEMMs and eltwise kernels, the convolutions)
/// keeps its own and uses it under its own lock: a stream is not shared between threads.
class Engine {
 public:
  Engine() {
    dnnl_engine_t e = nullptr;
    TG_DNNL_CHECK(dnnl_engine_create(&e, dnnl_cpu, 0));
    engine_.reset(e);
    dnnl_stream_t s = nullptr;
    TG_DNNL_CHECK(dnnl_stream_create(&s, engine_.get(), dnnl_stream_default_flags));
    stream_.reset(s);
  }

  dnnl_engine_t get() const { return engine_.get(); }

  /// A memory object for `md` on this engine: its data handle set per call (DNNL_MEMORY_NONE), or a
  /// buffer of its own (DNNL_MEMORY_ALLOCATE).
  MemoryPtr memory(const dnnl_memory_desc_t* md, void* handle = DNNL_MEMORY_NONE) const {
    dnnl_memory_t m = nullptr;
    TG_DNNL_CHECK(dnnl_memory_create(&m, md, engine_.get(), handle));
    return MemoryPtr(m);
  }

  /// Queues `p` on the stream with its arguments.
  void execute(dnnl_primitive_t p, int n_args, const dnnl_exec_arg_t* args) const {
    TG_DNNL_CHECK(dnnl_primitive_execute(p, stream_.get(), n_args, args));
  }

  /// Blocks until everything queued has run.
  void wait() const { TG_DNNL_CHECK(dnnl_stream_wait(stream_.get())); }

 private:
  EnginePtr engine_;
  StreamPtr stream_;
};

/// A primitive attribute with `post_op` appended as an eltwise post-op (none when its algorithm is undef).
inline AttrPtr attr_with_post_op(Eltwise post_op) {
  dnnl_primitive_attr_t raw = nullptr;
  TG_DNNL_CHECK(dnnl_primitive_attr_create(&raw));
  AttrPtr attr(raw);
  if (post_op.alg != dnnl_alg_kind_undef) {
    dnnl_post_ops_t po_raw = nullptr;
    TG_DNNL_CHECK(dnnl_post_ops_create(&po_raw));
    PostOpsPtr po(po_raw);
    TG_DNNL_CHECK(dnnl_post_ops_append_eltwise(po.get(), 1.0f, post_op.alg, post_op.alpha, 0.0f));
    TG_DNNL_CHECK(dnnl_primitive_attr_set_post_ops(attr.get(), po.get()));
  }
  return attr;
}

}  // namespace onednn

/// The process-wide oneDNN engine, stream and primitive cache.
class OneDnn {
 public:
  static OneDnn& instance() {
    static OneDnn self;
    return self;
  }

  /// True when oneDNN has a native bf16 matmul on this CPU (AVX-512 BF16 or AMX instructions). oneDNN
  /// also emulates bf16 on plain AVX-512, but that path measured ~10x slower here than converting the
  /// inputs to f32 and running the f32 kernel (which gives the same f32-accumulated result), so it is
  /// not used.
  bool bf16_supported() {
    std::lock_guard lock(mutex_);
    if (bf16_known_) return bf16_;
    const auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    const auto native = static_cast<unsigned>(dnnl_cpu_isa_avx512_core_bf16);
    Primitive probe;
    bf16_ = (isa & native) == native &&
            make(GemmShape{8, 8, 8, false, false, GemmType::bf16, false, {}}, probe) == dnnl_success;
    bf16_known_ = true;
    return bf16_;
  }

  /// Runs the GEMM on raw row-major buffers (bias f32, length n). Blocks until done.
  void gemm(const GemmShape& s, const void* a, const void* b, const float* bias, void* c) {
    // One stream for the process: calls from several threads take turns.
    std::lock_guard lock(mutex_);
    auto it = cache_.find(s);
    if (it == cache_.end()) {
      Primitive p;
      const dnnl_status_t st = make(s, p);
      TG_CHECK(st == dnnl_success, "matmul", "oneDNN has no matmul for ", s.batch, " x (", s.m, ", ", s.k, ") @ (", s.k, ", ", s.n, ") in ",
               s.type == GemmType::bf16 ? "bf16" : "f32", ": ", dnnl_status2str(st));
      it = cache_.emplace(s, std::move(p)).first;
    }
    Primitive& p = it->second;
    TG_DNNL_CHECK(dnnl_memory_set_data_handle(p.a.get(), const_cast<void*>(a)));
    TG_DNNL_CHECK(dnnl_memory_set_data_handle(p.b.get(), const_cast<void*>(b)));
    TG_DNNL_CHECK(dnnl_memory_set_data_handle(p.c.get(), c));
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, p.a.get()}, {DNNL_ARG_WEIGHTS, p.b.get()}, {DNNL_ARG_DST, p.c.get()}, {}};
    int n_args = 3;
    if (s.bias) {
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(p.bias.get(), const_cast<float*>(bias)));
      args[n_args++] = {DNNL_ARG_BIAS, p.bias.get()};
    }
    engine_.execute(p.primitive.get(), n_args, args);
    engine_.wait();
  }

  /// True when oneDNN has the eltwise kernels for `op` on elements of `type` on this CPU (f32 always;
  /// bf16 with AVX-512, computed in f32 and rounded to nearest even).
  bool eltwise_supported(Eltwise op, GemmType type) {
    std::lock_guard lock(mutex_);
    const auto key = std::pair(op, type);
    if (const auto it = eltwise_known_.find(key); it != eltwise_known_.end()) return it->second;
    bool ok = true;
    try {
      (void)make_eltwise(op, true, 64, type);
      (void)make_eltwise(op, false, 64, type);
    } catch (const Error&) {
      ok = false;
    }
    return eltwise_known_[key] = ok;
  }

  /// y = op(x) (backward: dx = dy * op'(x)) on n contiguous elements of `type` with oneDNN's JIT eltwise
  /// kernels (vectorised, transcendental functions included). Blocks until done.
  void eltwise(Eltwise op, bool backward, std::int64_t n, const void* x, const void* dy, void* out, GemmType type = GemmType::f32) {
    std::lock_guard lock(mutex_);
    const auto key = std::tuple(op, backward, n, type);
    auto it = eltwise_cache_.find(key);
    if (it == eltwise_cache_.end()) it = eltwise_cache_.emplace(key, make_eltwise(op, backward, n, type)).first;
    Primitive& p = it->second;
    TG_DNNL_CHECK(dnnl_memory_set_data_handle(p.a.get(), const_cast<void*>(x)));
    TG_DNNL_CHECK(dnnl_memory_set_data_handle(p.c.get(), out));
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, p.a.get()}, {backward ? DNNL_ARG_DIFF_SRC : DNNL_ARG_DST, p.c.get()}, {}};
    int n_args = 2;
    if (backward) {
      TG_DNNL_CHECK(dnnl_memory_set_data_handle(p.b.get(), const_cast<void*>(dy)));
      args[n_args++] = {DNNL_ARG_DIFF_DST, p.b.get()};
    }
    engine_.execute(p.primitive.get(), n_args, args);
    engine_.wait();
  }

 private:
  using MemoryPtr = onednn::MemoryPtr;
  using PdPtr = onednn::PdPtr;

  /// A cached primitive with memory objects whose data handles are swapped in per call.
  struct Primitive {
    onednn::PrimitivePtr primitive;
    MemoryPtr a, b, c, bias;
  };

  OneDnn() = default;

  /// Builds the primitive for `s`; returns oneDNN's status (dnnl_unimplemented where the CPU lacks it).
  dnnl_status_t make(const GemmShape& s, Primitive& out) {
    const dnnl_data_type_t dt = s.type == GemmType::bf16 ? dnnl_bf16 : dnnl_f32;
    // Row-major (m, k); a transposed operand is the same bytes read with swapped strides.
    // A batch is a leading dimension whose stride is one whole matrix.
    const bool batched = s.batch > 1;
    const int nd = batched ? 3 : 2;
    auto dims = [&](std::int64_t r, std::int64_t c) {
      return batched ? std::array<dnnl_dim_t, 3>{s.batch, r, c} : std::array<dnnl_dim_t, 3>{r, c, 0};
    };
    auto strides = [&](std::int64_t rs, std::int64_t cs, std::int64_t matrix) {
      return batched ? std::array<dnnl_dim_t, 3>{matrix, rs, cs} : std::array<dnnl_dim_t, 3>{rs, cs, 0};
    };
    const auto a_dims = dims(s.m, s.k), b_dims = dims(s.k, s.n), c_dims = dims(s.m, s.n);
    const auto a_strides = strides(s.trans_a ? 1 : s.k, s.trans_a ? s.m : 1, s.m * s.k);
    const auto b_strides = strides(s.trans_b ? 1 : s.n, s.trans_b ? s.k : 1, s.k * s.n);
    const auto c_strides = strides(s.n, 1, s.m * s.n);
    const dnnl_dims_t bias_dims = {1, s.n}, bias_strides = {s.n, 1};
    dnnl_memory_desc_t a_md, b_md, c_md, bias_md;
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&a_md, nd, a_dims.data(), dt, a_strides.data()));
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&b_md, nd, b_dims.data(), dt, b_strides.data()));
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&c_md, nd, c_dims.data(), dt, c_strides.data()));
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&bias_md, 2, bias_dims, dnnl_f32, bias_strides));
    dnnl_matmul_desc_t desc;
    TG_DNNL_CHECK(dnnl_matmul_desc_init(&desc, &a_md, &b_md, s.bias ? &bias_md : nullptr, &c_md));

    const onednn::AttrPtr attr = onednn::attr_with_post_op(s.post_op);
    dnnl_primitive_desc_t pd_raw = nullptr;
    const dnnl_status_t st = dnnl_primitive_desc_create(&pd_raw, &desc, attr.get(), engine_.get(), nullptr);
    if (st != dnnl_success) return st;
    PdPtr pd(pd_raw);
    dnnl_primitive_t prim = nullptr;
    TG_DNNL_CHECK(dnnl_primitive_create(&prim, pd.get()));
    out.primitive.reset(prim);
    out.a = engine_.memory(&a_md);
    out.b = engine_.memory(&b_md);
    out.c = engine_.memory(&c_md);
    if (s.bias) out.bias = engine_.memory(&bias_md);
    return dnnl_success;
  }

  Primitive make_eltwise(Eltwise op, bool backward, std::int64_t n, GemmType type) {
    TG_CHECK(op.alg != dnnl_alg_kind_undef, "onednn::eltwise", "needs an eltwise algorithm");
    dnnl_memory_desc_t md;
    const dnnl_dims_t dims = {n};
    TG_DNNL_CHECK(dnnl_memory_desc_init_by_tag(&md, 1, dims, type == GemmType::bf16 ? dnnl_bf16 : dnnl_f32, dnnl_a));
    dnnl_eltwise_desc_t fwd;
    TG_DNNL_CHECK(dnnl_eltwise_forward_desc_init(&fwd, dnnl_forward_training, op.alg, &md, op.alpha, 0.0f));
    dnnl_primitive_desc_t fwd_raw = nullptr;
    TG_DNNL_CHECK(dnnl_primitive_desc_create(&fwd_raw, &fwd, nullptr, engine_.get(), nullptr));
    PdPtr fwd_pd(fwd_raw), pd;
    if (backward) {
      dnnl_eltwise_desc_t bwd;
      TG_DNNL_CHECK(dnnl_eltwise_backward_desc_init(&bwd, op.alg, &md, &md, op.alpha, 0.0f));
      dnnl_primitive_desc_t bwd_raw = nullptr;
      TG_DNNL_CHECK(dnnl_primitive_desc_create(&bwd_raw, &bwd, nullptr, engine_.get(), fwd_pd.get()));
      pd.reset(bwd_raw);
    } else {
      pd = std::move(fwd_pd);
    }
    Primitive p;
    dnnl_primitive_t prim = nullptr;
    TG_DNNL_CHECK(dnnl_primitive_create(&prim, pd.get()));
    p.primitive.reset(prim);
    p.a = engine_.memory(&md), p.c = engine_.memory(&md);
    if (backward) p.b = engine_.memory(&md);
    return p;
  }

  onednn::Engine engine_;
  std::mutex mutex_;
  std::map<GemmShape, Primitive> cache_;
  std::map<std::tuple<Eltwise, bool, std::int64_t, GemmType>, Primitive> eltwise_cache_;
  std::map<std::pair<Eltwise, GemmType>, bool> eltwise_known_;
  bool bf16_known_ = false, bf16_ = false;
};

}  // namespace cpu
TG_END_NAMESPACE
