// Device queries and CUDA requests in a build without CUDA: clean "none" answers and errors that say
// how to enable CUDA.
#include "test_common.hpp"

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
