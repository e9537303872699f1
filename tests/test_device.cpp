// Device queries and CUDA requests in a build without CUDA: clean "none" answers and errors that say
// how to enable CUDA.
#include "test_common.hpp"

#include <algorithm>
#include <cmath>

namespace device_tests {

using Catch::Matchers::Contains;

#if !defined(TG_WITH_CUDA)
TEST_CASE("a CPU-only build reports no CUDA devices", "[device]") {
  CHECK_FALSE(tg::built_with_cuda);
  CHECK(tg::cuda::device_count() == 0);
  CHECK_FALSE(tg::cuda::available());
  CHECK(tg::cuda::current_device() == -1);
  CHECK(tg::cuda::describe_devices() == "none");
  CHECK_THROWS_WITH(tg::cuda::device_info(0), Contains("CUDA support not compiled in: build this file with nvcc and link tapegrad::cuda"));
}

TEST_CASE("asking for CUDA tensors without CUDA support says how to enable it", "[device][errors]") {
  CHECK_THROWS_WITH((tg::zeros<float, tg::Cuda>({2, 2})), Contains("CUDA support not compiled in"));
  CHECK_THROWS_WITH(tg::device_put<tg::Cuda>(tg::ones<float>({3})), Contains("link tapegrad::cuda"));
  CHECK_THROWS_WITH(tg::cuda::GraphCapture(), Contains("[cuda::GraphCapture] CUDA support not compiled in"));
  CHECK_THROWS_WITH(tg::device_name<tg::Cuda>(), Contains("[device_name] CUDA support not compiled in"));
}

TEST_CASE("with_device picks the device at run time; a CPU-only build runs \"auto\" on the CPU", "[device]") {
  auto which = [](const char* device) { return tg::with_device(device, [&]<class D>() { return tg::device_name<D>(); }); };
  CHECK(which("cpu") == "cpu");
  CHECK(which("auto") == "cpu");
  CHECK_THROWS_WITH(which("cuda"), Contains("[with_device(cuda)] CUDA support not compiled in: build this file with nvcc and link tapegrad::cuda"));
  CHECK_THROWS_WITH(which("gpu"), Contains("[with_device] unknown device 'gpu'; use auto, cpu or cuda"));
}
#endif

TEST_CASE("CPU storage is 64-byte aligned", "[device]") {
  for (std::int64_t n : {1, 3, 17, 1000}) {
    const auto t = tg::zeros<float>({n});
    CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
  }
  CHECK(tg::zeros<float>({2}).device_name() == "cpu");
  CHECK(tg::version == std::string("0.1.0"));
}

TEST_CASE("freed host blocks of 64 KiB and more are kept and reused; release_cached_memory gives them back", "[device][memory]") {
  tg::cpu::release_cached_memory();
  REQUIRE(tg::cpu::cached_memory() == 0);
  const void* first = nullptr;
  {
    const auto big = tg::zeros<float>({1 << 18});  // 1 MiB
    first = big.data();
  }
  if (!tg::cpu::detail::cache_blocks) {  // AddressSanitizer: every block goes back at once
    CHECK(tg::cpu::cached_memory() == 0);
    return;
  }
  CHECK(tg::cpu::cached_memory() == std::size_t{1} << 20);
  const auto again = tg::ones<float>({1 << 18});  // the same size: the same block, without a page fault per 4 KiB
  CHECK(again.data() == first);
  CHECK(tg::cpu::cached_memory() == 0);
  CHECK(again.to_vector() == std::vector<float>(1 << 18, 1.0f));  // initialised by its op, not by the cache
  { const auto small = tg::zeros<float>({100}); }  // 400 bytes: malloc's business
  CHECK(tg::cpu::cached_memory() == 0);
  { const auto other = tg::zeros<double>({1 << 17}); }
  CHECK(tg::cpu::release_cached_memory() == std::size_t{1} << 20);
  CHECK(tg::cpu::cached_memory() == 0);
}

TEST_CASE("FlushDenormals flushes subnormals in the pool's threads and restores the previous setting", "[device]") {
#if defined(TG_HAVE_MXCSR)
  // Large enough that the multiply runs on every OpenMP thread.
  const std::int64_t n = 1 << 17;
  const float tiny = 1e-39f;  // subnormal
  REQUIRE(std::fpclassify(tiny) == FP_SUBNORMAL);
  const auto x = tg::full<float>({n}, tiny);
  auto count_nonzero = [](const tg::Tensor<float>& t) {
    const auto v = t.to_vector();
    return std::count_if(v.begin(), v.end(), [](float e) { return e != 0.0f; });
  };
  REQUIRE_FALSE(tg::cpu::flushing_denormals());
  CHECK(count_nonzero(x * 0.5f) == n);  // IEEE: a smaller subnormal
  {
    tg::cpu::FlushDenormals flush;
    CHECK(tg::cpu::flushing_denormals());
    CHECK(count_nonzero(x * 0.5f) == 0);    // FTZ, in every thread
    CHECK(count_nonzero(x * 1e30f) == 0);   // DAZ: a subnormal input reads as zero
    CHECK(count_nonzero(tg::full<float>({n}, 1e-30f) * 1e-10f) == 0);  // normal inputs, subnormal result
    CHECK(count_nonzero(tg::full<float>({n}, 1e-30f) * 1e3f) == n);   // normal results untouched
  }
  CHECK_FALSE(tg::cpu::flushing_denormals());
  CHECK(count_nonzero(x * 0.5f) == n);
#else
  WARN("not x86: no subnormal flushing to test");
#endif
}

TEST_CASE("running out of host memory is a tg::Error, and the process goes on", "[device][memory]") {
  // 4 PiB: more than any machine's address space. (Under AddressSanitizer this needs
  // allocator_may_return_null=1, which scripts/sanitize sets.)
  CHECK_THROWS_WITH((tg::empty<float>({std::int64_t{1} << 50})),
                    Contains("[cpu::allocate] out of memory allocating 4503599627370496 bytes"));
  CHECK(tg::sum(tg::ones<float>({1000})).item() == 1000.0f);
}

TEST_CASE("build_info names the versions and the devices", "[device]") {
  const tg::BuildInfo info = tg::build_info();
  CHECK(info.tapegrad == tg::version);
  CHECK(info.onednn.find('.') != std::string::npos);
  CHECK(info.cpu_threads >= 1);
  CHECK(info.cuda_devices == tg::cuda::describe_devices());
#if !defined(TG_WITH_CUDA)
  CHECK_THAT(info.cuda_runtime, Contains("not in this build"));
  CHECK_THAT(info.cudnn, Contains("not in this build"));
#endif
  CHECK(info.cudnn == tg::cuda::cudnn_version());
  CHECK(info.rows().size() == 8);
  CHECK(info.rows().front() == std::pair<std::string, std::string>{"tapegrad", tg::version});
}

}  // namespace device_tests
