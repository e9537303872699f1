// Running out of GPU memory (part of the GPU suite, tapegrad_gpu_tests): one allocation larger than the
// device, and a growing loop of allocations, each end in a tg::Error naming the op, the bytes asked and the
// bytes free; the process then frees its tensors and computes correctly.
#include "../test_common.hpp"

#include <string>
#include <vector>

using Catch::Matchers::Contains;

TEST_CASE("running out of GPU memory is a tg::Error, and the process goes on", "[cuda][memory]") {
  const auto info = tg::cuda::device_info();
  const std::int64_t more_than_the_device = static_cast<std::int64_t>(info.total_memory / sizeof(float)) + (std::int64_t{1} << 28);
  std::string one;
  try {
    (void)tg::empty<float, tg::Cuda>({more_than_the_device});
  } catch (const tg::Error& e) {
    one = e.what();
  }
  INFO(one);
  CHECK_THAT(one, Contains("[cuda::allocate] out of memory allocating " + std::to_string(more_than_the_device * 4) + " bytes") &&
                      Contains(" bytes free); use smaller batches or free tensors first"));

  // 2 GiB at a time until the device is full.
  constexpr std::int64_t block = std::int64_t{1} << 29;  // floats
  std::vector<tg::Tensor<float, tg::Cuda>> held;
  std::string loop;
  try {
    for (int i = 0; i < 1024; ++i) held.push_back(tg::empty<float, tg::Cuda>({block}));
  } catch (const tg::Error& e) {
    loop = e.what();
  }
  INFO(held.size() << " blocks of 2 GiB before: " << loop);
  CHECK(held.size() >= 1);
  CHECK(static_cast<double>(held.size()) * 2.0 <= static_cast<double>(info.total_memory) / (1 << 30));
  CHECK_THAT(loop, Contains("out of memory allocating 2147483648 bytes (2048 MiB) on cuda:"));

  // Freed, the memory serves again, and the device computes correctly.
  held.clear();
  const auto again = tg::empty<float, tg::Cuda>({block});
  CHECK(again.defined());
  const auto x = tg::full<float, tg::Cuda>({std::int64_t{1} << 20}, 0.5f);
  CHECK(tg::sum(x).item() == 524288.0f);
  CHECK(tg::matmul(tg::ones<float, tg::Cuda>({64, 32}), tg::ones<float, tg::Cuda>({32, 16})).to_vector() == std::vector<float>(64 * 16, 32.0f));
}
