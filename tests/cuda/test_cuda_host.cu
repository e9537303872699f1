// CUDA-build tests that need no GPU: tg::bf16 against CUDA's own __float2bfloat16, and the answers a
// machine without a GPU or driver must give. Built by nvcc; runs everywhere.
#include "../test_common.hpp"

#include <cuda_bf16.h>


using Catch::Matchers::Contains;

TEST_CASE("tg::bf16 is bit-identical to __float2bfloat16", "[bf16][cuda]") {
  auto cuda_bits = [](float f) {
    const __nv_bfloat16 b = __float2bfloat16(f);
    __nv_bfloat16_raw raw = b;
    return raw.x;
  };
  // Every bf16 value and the floats around its rounding midpoints first, for a readable first failure.
  for (std::uint32_t b = 0; b <= 0xffff; ++b)
    for (std::uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const float f = float_of((b << 16) | low);
      if (tg::bf16(f).bits != cuda_bits(f)) FAIL("float bits " << std::hex << ((b << 16) | low));
    }
  // Then every one of the 2^32 float bit patterns (a few seconds on 2 cores).
  std::int64_t mismatches = 0;
#pragma omp parallel for reduction(+ : mismatches) schedule(static)
  for (std::int64_t i = 0; i <= 0xffffffffLL; ++i) {
    const float f = float_of(static_cast<std::uint32_t>(i));
    mismatches += tg::bf16(f).bits != cuda_bits(f);
  }
  CHECK(mismatches == 0);
  // And back: bf16 -> float agrees with __bfloat162float for every pattern.
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    __nv_bfloat16_raw raw;
    raw.x = static_cast<unsigned short>(b);
    const float want = __bfloat162float(__nv_bfloat16(raw));
    const float have = tg::bf16::from_bits(static_cast<std::uint16_t>(b));
    if (bits_of(want) != bits_of(have)) FAIL("bf16 bits " << std::hex << b);
  }
}

TEST_CASE("without a GPU, CUDA answers none and CUDA work is a clear error", "[device][cuda]") {
  CHECK(tg::built_with_cuda);
  if (tg::cuda::available()) {
    WARN("a GPU is present: the no-device answers are not exercised here (" << tg::cuda::describe_devices() << ")");
    CHECK(tg::cuda::device_info(0).total_memory > 0);
    return;
  }
  CHECK(tg::cuda::device_count() == 0);
  CHECK(tg::cuda::current_device() == -1);
  CHECK(tg::cuda::describe_devices() == "none");
  // Asking again is just as clean: no throw, the same answer (the runtime keeps its init failure, so
  // nothing of ours may read cudaGetLastError before a device has been found).
  CHECK_NOTHROW(tg::cuda::device_count());
  CHECK(tg::cuda::device_count() == 0);
  CHECK_THROWS_WITH(tg::cuda::device_info(0), Contains("[cuda::device_info] no CUDA device"));
  CHECK_THROWS_WITH(tg::cuda::stream(), Contains("no CUDA device"));
  CHECK_THROWS_WITH((tg::zeros<float, tg::Cuda>({4})), Contains("[cuda::allocate] no CUDA device"));
  CHECK_THROWS_WITH(tg::device_put<tg::Cuda>(tg::arange<float>(4)), Contains("no CUDA device"));
  CHECK_THROWS_WITH((tg::random::normal<float, tg::Cuda>(tg::random::key(1), {8})), Contains("no CUDA device"));
  CHECK_THROWS_WITH(tg::cuda::GraphCapture(), Contains("[cuda::GraphCapture] no CUDA device"));
  // A program built for both devices picks the CPU where there is no GPU, and says why it cannot use CUDA.
  auto which = [](const char* device) { return tg::with_device(device, [&]<class D>() { return tg::device_name<D>(); }); };
  CHECK(which("auto") == "cpu");
  CHECK_THROWS_WITH(which("cuda"), Contains("[with_device(cuda)] no CUDA device"));
  // The CPU side of a CUDA build is unaffected.
  CHECK(tg::random::normal<float>(tg::random::key(1), {2}).to_vector().size() == 2);
}

TEST_CASE("CUDA and cuBLAS failures carry file:line, the call and the library's message", "[errors][cuda]") {
  try {
    TG_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("no throw");
  } catch (const tg::Error& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Contains("test_cuda_host.cu:") && Contains("cudaErrorInvalidValue") &&
                         Contains("failed: cudaErrorInvalidValue (invalid argument)"));
  }
  CHECK_THROWS_WITH([] { TG_CUBLAS_CHECK(CUBLAS_STATUS_NOT_INITIALIZED); }(),
                    Contains("[cublas]") && Contains("CUBLAS_STATUS_NOT_INITIALIZED"));
  if (!tg::cuda::available()) {
    // No driver: cuBLASLt cannot start, and the check says so instead of crashing.
    CHECK_THROWS_WITH([] {
      cublasLtHandle_t handle = nullptr;
      TG_CUBLAS_CHECK(cublasLtCreate(&handle));
    }(), Contains("cublasLtCreate(&handle) failed"));
  }
}

TEST_CASE("launch failures and out of memory name the op, the sizes and what to do", "[errors][cuda]") {
  // The paths that need a GPU to happen; their messages are built here.
  using Fn = tg::detail::UnaryFn<tg::fn::Gelu, float, float>;
  CHECK_THROWS_WITH(tg::cuda::detail::throw_launch(cudaErrorLaunchOutOfResources, "index_map_kernel", tg::cuda::detail::type_name<Fn>(),
                                                   1000, 4, 256, "launch.hpp", 29),
                    Contains("[cuda] launch.hpp:29: launch of index_map_kernel running tg::detail::UnaryFn<tg::fn::Gelu, float, float> over "
                             "1000 elements (4 blocks of 256 threads) failed: cudaErrorLaunchOutOfResources (too many resources requested for launch)"));
  const std::string oom = tg::cuda::detail::out_of_memory_message(std::size_t{3} << 30, 0, std::size_t{1} << 30, std::size_t{141} << 30);
  CHECK_THAT(oom, Contains("[cuda::allocate] out of memory allocating 3221225472 bytes (3072 MiB) on cuda:0 (1073741824 of ") &&
                      Contains("bytes free); use smaller batches or free tensors first"));
}

TEST_CASE("cuBLASLt descriptors for every epilogue are set up without a GPU", "[matmul][cuda]") {
  using tg::cuda::Epilogue;
  // The row-major problem (512, 784) @ (784, 256) as cuBLASLt sees it: D^T (256 x 512) = W^T X^T.
  const tg::backend::GemmProblem dims{512, 256, 784};
  for (Epilogue e : {Epilogue::none, Epilogue::bias, Epilogue::relu_bias, Epilogue::gelu_aux_bias,
                     Epilogue::dgelu_bgrad, Epilogue::bgrada, Epilogue::bgradb}) {
    const tg::cuda::LtGemm g = tg::cuda::lt_problem<float>(dims, e);
    CHECK(g.m == 256);
    CHECK(g.n == 512);
    CHECK(g.k == 784);
    CHECK(g.lda == 256);  // W (784, 256) row-major is a 256 x 784 column-major matrix
    CHECK(g.ldb == 784);  // X (512, 784) row-major is 784 x 512 column-major
    const tg::cuda::LtPlan plan(g);
    CHECK(plan.desc.get<cublasLtEpilogue_t>(CUBLASLT_MATMUL_DESC_EPILOGUE) == tg::cuda::lt_epilogue(e));
    CHECK(plan.desc.get<cublasOperation_t>(CUBLASLT_MATMUL_DESC_TRANSA) == CUBLAS_OP_N);
    CHECK(plan.desc.get<cublasComputeType_t>(CUBLASLT_MATMUL_DESC_COMPUTE_TYPE) == CUBLAS_COMPUTE_32F);
    if (tg::cuda::uses_aux(e)) CHECK(plan.desc.get<std::int64_t>(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD) == 256);
    CHECK(plan.a.attribute<std::uint64_t>(CUBLASLT_MATRIX_LAYOUT_ROWS) == 256);
    CHECK(plan.a.attribute<std::uint64_t>(CUBLASLT_MATRIX_LAYOUT_COLS) == 784);
    CHECK(plan.b.attribute<std::uint64_t>(CUBLASLT_MATRIX_LAYOUT_ROWS) == 784);
    CHECK(plan.d.attribute<std::uint64_t>(CUBLASLT_MATRIX_LAYOUT_COLS) == 512);
  }
  // Transposed operands (the weight gradient x^T dz) and the other dtypes.
  const tg::cuda::LtGemm wg = tg::cuda::lt_problem<tg::bf16>(tg::backend::GemmProblem{784, 256, 512, true, false}, Epilogue::bgrada);
  CHECK(wg.trans_b);
  CHECK(wg.ldb == 784);
  const tg::cuda::LtPlan bf(wg);
  CHECK(bf.desc.get<cublasOperation_t>(CUBLASLT_MATMUL_DESC_TRANSB) == CUBLAS_OP_T);
  CHECK(bf.b.attribute<std::uint64_t>(CUBLASLT_MATRIX_LAYOUT_ROWS) == 784);  // stored x: 784 x 512 column-major
  CHECK(bf.a.attribute<cudaDataType_t>(CUBLASLT_MATRIX_LAYOUT_TYPE) == CUDA_R_16BF);
  CHECK(bf.desc.get<cublasComputeType_t>(CUBLASLT_MATMUL_DESC_COMPUTE_TYPE) == CUBLAS_COMPUTE_32F);
  const tg::cuda::LtPlan f64(tg::cuda::lt_problem<double>(tg::backend::GemmProblem{512, 256, 784, false, true}, Epilogue::none));
  CHECK(f64.desc.get<cublasComputeType_t>(CUBLASLT_MATMUL_DESC_COMPUTE_TYPE) == CUBLAS_COMPUTE_64F);
  tg::set_allow_tf32(true);
  CHECK(tg::cuda::lt_problem<float>(dims, Epilogue::none).type == tg::cuda::LtType::tf32);
  tg::set_allow_tf32(false);
  // A strided batch (attention's q k^T): 8 GEMMs, each operand's matrices one after another.
  const tg::cuda::LtGemm batched = tg::cuda::lt_problem<float>(tg::backend::GemmProblem{16, 12, 32, false, true, 8}, Epilogue::none);
  CHECK(batched.batch == 8);
  CHECK(batched.stride_a == 32 * 12);  // cuBLASLt's A is our b, (12, 32) per batch
  CHECK(batched.stride_b == 16 * 32);
  CHECK(batched.stride_d == 16 * 12);
  const tg::cuda::LtPlan bp(batched);
  CHECK(bp.a.attribute<std::int32_t>(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) == 8);
  CHECK(bp.d.attribute<std::int64_t>(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) == 16 * 12);
}

TEST_CASE("which cuBLASLt epilogues serve each dtype", "[matmul][cuda]") {
  using tg::Activation;
  using tg::cuda::Epilogue;
  // Forward: bias, relu + bias when no pre-activation is kept, GELU + bias with aux (ld a multiple of 8).
  CHECK(tg::cuda::forward_epilogue<float>(true, true, Activation::none, true, 256) == Epilogue::bias);
  CHECK(tg::cuda::forward_epilogue<float>(true, true, Activation::relu, false, 256) == Epilogue::relu_bias);
  CHECK(tg::cuda::forward_epilogue<float>(true, true, Activation::relu, true, 256) == Epilogue::none);
  CHECK(tg::cuda::forward_epilogue<tg::bf16>(true, true, Activation::gelu, true, 256) == Epilogue::gelu_aux_bias);
  CHECK(tg::cuda::forward_epilogue<float>(true, true, Activation::gelu, true, 10) == Epilogue::none);
  CHECK(tg::cuda::forward_epilogue<float>(true, true, Activation::gelu_exact, true, 256) == Epilogue::none);
  CHECK(tg::cuda::forward_epilogue<float>(true, true, Activation::silu, false, 256) == Epilogue::none);
  CHECK(tg::cuda::forward_epilogue<float>(false, true, Activation::gelu, true, 256) == Epilogue::none);
  // f64 never runs an epilogue: cuBLASLt's computed in single precision there (2e-6 relative on an H200).
  for (Activation a : {Activation::none, Activation::relu, Activation::gelu})
    CHECK(tg::cuda::forward_epilogue<double>(true, true, a, false, 256) == Epilogue::none);
  // Backward: DGELU_BGRAD only in bf16 (its f32 derivative was off by 5.6e-5 relative on an H200).
  CHECK(tg::backend::fuses_dact<tg::bf16, tg::Cuda>(Activation::gelu, 256));
  CHECK_FALSE(tg::backend::fuses_dact<tg::bf16, tg::Cuda>(Activation::gelu, 10));
  CHECK_FALSE(tg::backend::fuses_dact<float, tg::Cuda>(Activation::gelu, 256));
  CHECK_FALSE(tg::backend::fuses_dact<double, tg::Cuda>(Activation::gelu, 256));
  CHECK_FALSE(tg::backend::fuses_dact<tg::bf16, tg::Cpu>(Activation::gelu, 256));
}
