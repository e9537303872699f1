// Catch2 runner for the test binaries. The CUDA variant reports "skipped" (exit 77, ctest's
// SKIP_RETURN_CODE) on a machine without a GPU instead of failing.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <tapegrad/runtime/device.hpp>

#include <iostream>

int main(int argc, char** argv) {
#if defined(TG_TEST_NEEDS_GPU)
  if (!tg::cuda::available()) {
    std::cout << "no CUDA device: skipping the GPU tests (they ran nothing)\n";
    return 77;
  }
  std::cout << "CUDA devices:\n" << tg::cuda::describe_devices() << "\n";
#endif
  return Catch::Session().run(argc, argv);
}
