/* Matrix multiplication, with help from cuBLASLt, in its own terms: RAII descriptors, the epilogues,
   heuristics cached per (m, n, k, transposes, dtype, epilogue), and an explicit workspace. What to fuse
   is decided by the CUDA GEMM door (backend/cuda/gemm.hpp). Empty but for its version string without
   TG_WITH_CUDA. */
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "tapegrad/config.hpp"

#if defined(TG_WITH_CUDA)
#include <cublasLt.h>
#include <cublas_v2.h>

#include "tapegrad/base/error.hpp"
#include "tapegrad/runtime/cuda/check.hpp"
#include "tapegrad/runtime/cuda/context.hpp"
#include "tapegrad/runtime/device.hpp"
#endif

TG_BEGIN_NAMESPACE
namespace cuda {

#if defined(TG_WITH_CUDA)

namespace detail {
[[noreturn]] inline void throw_cublas(cublasStatus_t st, const char* call, const char* file, int line) {
  throw Error(::tg::detail::concat("[cublas] ", file, ":", line, ": ", call, " failed: ", cublasGetStatusName(st),
                                   " (", cublasGetStatusString(st), ")"));
}
}  // namespace detail

/// TG_CUBLAS_CHECK(cublasLtMatmul(...)): throws tg::Error naming the call and cuBLAS's status unless it succeeded.
#define TG_CUBLAS_CHECK(call)                                                                  \
  do {                                                                                         \
    const cublasStatus_t tg_st_ = (call);                                                      \
    if (tg_st_ != CUBLAS_STATUS_SUCCESS)                                                       \
      ::tg::cuda::detail::throw_cublas(tg_st_, #call, __FILE__, __LINE__);                     \
  } while (0)

/// cuBLASLt's version, "13.0.2".
inline std::string blaslt_version() {
  const std::size_t lt = cublasLtGetVersion();
  return std::to_string(lt / 10000) + "." + std::to_string(lt / 100 % 100) + "." + std::to_string(lt % 100);
}

/// What cuBLASLt fuses after the GEMM (column-major terms: D is m x n).
enum class Epilogue {
  none,           ///< D = A B
  bias,           ///< D = A B + bias (length m, broadcast over columns)
  relu_bias,      ///< D = relu(A B + bias)
  gelu_aux_bias,  ///< D = gelu(A B + bias), the pre-activation written to aux (forward, kept for backward)
  dgelu_bgrad,    ///< D = (A B) * gelu'(aux); bias = row sums of D (backward through a GELU layer)
  bgrada,         ///< D = A B; bias = sums of A over k (bias gradient from the A operand)
  bgradb,         ///< D = A B; bias = sums of B over k (bias gradient from the B operand)
};

inline cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::relu_bias: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case Epilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::dgelu_bgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case Epilogue::bgrada: return CUBLASLT_EPILOGUE_BGRADA;
    case Epilogue::bgradb: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

inline bool uses_aux(Epilogue e) { return e == Epilogue::gelu_aux_bias || e == Epilogue::dgelu_bgrad; }
inline bool uses_bias(Epilogue e) { return e != Epilogue::none; }

/// Element type of a cuBLASLt GEMM: inputs and output share it; accumulation is f32 (f64 for f64).
enum class LtType { f32, tf32, bf16, f64 };

/// One column-major GEMM: D(m, n) = op(A) op(B) with op(A) m x k and op(B) k x n.
struct LtGemm {
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  std::int64_t lda = 0, ldb = 0, ldd = 0;
  LtType type = LtType::f32;
  Epilogue epilogue = Epilogue::none;
  std::int64_t aux_ld = 0;
  /// Strided batches: `batch` GEMMs, the i-th reading A + i stride_a, B + i stride_b, writing D + i stride_d
  /// (elements).
  std::int64_t batch = 1, stride_a = 0, stride_b = 0, stride_d = 0;

  auto key() const { return std::tuple(m, n, k, trans_a, trans_b, lda, ldb, ldd, type, epilogue, aux_ld, batch, stride_a, stride_b, stride_d); }
  friend bool operator<(const LtGemm& a, const LtGemm& b) { return a.key() < b.key(); }
};

namespace detail {

inline cudaDataType_t data_type(LtType t) {
  switch (t) {
    case LtType::bf16: return CUDA_R_16BF;
    case LtType::f64: return CUDA_R_64F;
    default: return CUDA_R_32F;
  }
}

inline cublasComputeType_t compute_type(LtType t) {
  switch (t) {
    case LtType::tf32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case LtType::f64: return CUBLAS_COMPUTE_64F;
    default: return CUBLAS_COMPUTE_32F;  // bf16 inputs accumulate in f32
  }
}

}  // namespace detail

/// Owns a cublasLtMatmulDesc_t.
class LtMatmulDesc {
 public:
  explicit LtMatmulDesc(const LtGemm& g) {
    const cudaDataType_t scale = g.type == LtType::f64 ? CUDA_R_64F : CUDA_R_32F;
    TG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_, detail::compute_type(g.type), scale));
    const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    set(CUBLASLT_MATMUL_DESC_TRANSA, ta);
    set(CUBLASLT_MATMUL_DESC_TRANSB, tb);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(g.epilogue));
    if (uses_aux(g.epilogue)) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
  }
  ~LtMatmulDesc() {
    if (desc_) (void)cublasLtMatmulDescDestroy(desc_);
  }
  LtMatmulDesc(const LtMatmulDesc&) = delete;
  LtMatmulDesc& operator=(const LtMatmulDesc&) = delete;

  template <class V>
  void set(cublasLtMatmulDescAttributes_t attr, const V& value) {
    TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, attr, &value, sizeof(V)));
  }
  template <class V>
  V get(cublasLtMatmulDescAttributes_t attr) const {
    V value{};
    std::size_t written = 0;
    TG_CUBLAS_CHECK(cublasLtMatmulDescGetAttribute(desc_, attr, &value, sizeof(V), &written));
    return value;
  }
  cublasLtMatmulDesc_t get() const { return desc_; }

 private:
  cublasLtMatmulDesc_t desc_ = nullptr;
};

/// Owns a cublasLtMatrixLayout_t: a column-major rows x cols matrix with leading dimension ld.
class LtLayout {
 public:
  LtLayout(LtType type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_, detail::data_type(type), static_cast<std::uint64_t>(rows),
                                               static_cast<std::uint64_t>(cols), ld));
  }
  ~LtLayout() {
    if (layout_) (void)cublasLtMatrixLayoutDestroy(layout_);
  }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
  cublasLtMatrixLayout_t get() const { return layout_; }

  /// Makes the layout `count` matrices `stride` elements apart (a strided batch); nothing for count 1.
  void set_batch(std::int64_t count, std::int64_t stride) {
    if (count <= 1) return;
    const auto c = static_cast<std::int32_t>(count);
    TG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout_, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &c, sizeof c));
    TG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout_, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }

  template <class V>
  V attribute(cublasLtMatrixLayoutAttribute_t attr) const {
    V value{};
    std::size_t written = 0;
    TG_CUBLAS_CHECK(cublasLtMatrixLayoutGetAttribute(layout_, attr, &value, sizeof(V), &written));
    return value;
  }

 private:
  cublasLtMatrixLayout_t layout_ = nullptr;
};

/// Descriptors of one GEMM; built without touching the GPU (so they can be unit-tested anywhere).
struct LtPlan {
  explicit LtPlan(const LtGemm& g)
      : gemm(g),
        desc(g),
        a(g.type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda),
        b(g.type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb),
        d(g.type, g.m, g.n, g.ldd) {
    a.set_batch(g.batch, g.stride_a);
    b.set_batch(g.batch, g.stride_b);
    d.set_batch(g.batch, g.stride_d);
  }
  LtGemm gemm;
  LtMatmulDesc desc;
  LtLayout a, b, d;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
};

/// Per-device cuBLASLt state: handle, workspace and the plan cache.
class Lt {
 public:
  static constexpr std::size_t workspace_bytes = 32u << 20;  // cuBLASLt's recommendation for Hopper

  static Lt& instance() {
    static Lt self;
    return self;
  }

  /// Runs the GEMM on the library's stream. Returns false (doing nothing) when cuBLASLt has no algorithm
  /// for this epilogue and shape, so the caller can take the unfused path.
  bool matmul(const LtGemm& g, const void* A, const void* B, void* D, const void* bias = nullptr, void* aux = nullptr) {
    std::lock_guard lock(mutex_);
    const int device = current_device();
    DeviceState& st = state(device);
    auto it = st.plans.find(g);
    if (it == st.plans.end()) {
      auto plan = std::make_unique<LtPlan>(g);
      set_pointers(*plan, bias, aux);
      cublasLtMatmulPreference_t pref = nullptr;
      TG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      const std::uint64_t ws = workspace_bytes;
      cublasStatus_t st_attr = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t st_h = st_attr == CUBLAS_STATUS_SUCCESS
          ? cublasLtMatmulAlgoGetHeuristic(st.handle, plan->desc.get(), plan->a.get(), plan->b.get(), plan->d.get(),
                                           plan->d.get(), pref, 1, &result, &found)
          : st_attr;
      (void)cublasLtMatmulPreferenceDestroy(pref);
      if (st_h != CUBLAS_STATUS_SUCCESS && st_h != CUBLAS_STATUS_NOT_SUPPORTED) TG_CUBLAS_CHECK(st_h);
      plan->has_algo = st_h == CUBLAS_STATUS_SUCCESS && found > 0;
      if (plan->has_algo) plan->algo = result.algo;
      it = st.plans.emplace(g, std::move(plan)).first;
    }
    LtPlan& plan = *it->second;
    if (!plan.has_algo) return false;
    set_pointers(plan, bias, aux);
    const float one_f = 1.0f, zero_f = 0.0f;
    const double one_d = 1.0, zero_d = 0.0;
    const bool f64 = g.type == LtType::f64;
    TG_CUBLAS_CHECK(cublasLtMatmul(st.handle, plan.desc.get(), f64 ? static_cast<const void*>(&one_d) : &one_f, A,
                                   plan.a.get(), B, plan.b.get(), f64 ? static_cast<const void*>(&zero_d) : &zero_f, D,
                                   plan.d.get(), D, plan.d.get(), &plan.algo, st.workspace, workspace_bytes, stream()));
    return true;
  }

 private:
  struct DeviceState {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    std::map<LtGemm, std::unique_ptr<LtPlan>> plans;
  };

  static void set_pointers(LtPlan& plan, const void* bias, void* aux) {
    if (uses_bias(plan.gemm.epilogue)) plan.desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    if (uses_aux(plan.gemm.epilogue)) plan.desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
  }

  DeviceState& state(int device) {
    auto& st = states_[device];
    if (st.handle == nullptr) {
      TG_CUBLAS_CHECK(cublasLtCreate(&st.handle));
      st.workspace = allocate(workspace_bytes, device);
    }
    return st;
  }

  std::mutex mutex_;
  std::map<int, DeviceState> states_;
};

#else
inline std::string blaslt_version() { return "not in this build (no TG_WITH_CUDA: link tapegrad::cuda)"; }
#endif

}  // namespace cuda
TG_END_NAMESPACE
