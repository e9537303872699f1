// bench_gemm_cuda: the 8 GEMMs of one training step at batch 512 on the GPU, f32 and bf16, through
// tg::matmul and through cuBLASLt called directly (own handle, descriptors and heuristic; no tapegrad code
// in the timed call), in the same process. Without a GPU it says so and exits 0.
#include <tapegrad/tapegrad.hpp>

#include "direct_lt.hpp"
#include "step_gemms.hpp"

#include <cstdio>
#include <algorithm>
#include <functional>
#include <vector>

namespace {

using bench::step_gemms;
using Shape3 = bench::StepGemm;
using bench::DirectLt;

/// Median milliseconds per call, timed with CUDA events on the library's stream after a warm-up.
double median_ms(const std::function<void()>& f, int reps = 200, int rounds = 7) {
  for (int i = 0; i < reps; ++i) f();
  cudaEvent_t start, stop;
  TG_CUDA_CHECK(cudaEventCreate(&start));
  TG_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> t;
  for (int r = 0; r < rounds; ++r) {
    TG_CUDA_CHECK(cudaEventRecord(start, tg::cuda::stream()));
    for (int i = 0; i < reps; ++i) f();
    TG_CUDA_CHECK(cudaEventRecord(stop, tg::cuda::stream()));
    TG_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TG_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    t.push_back(ms / reps);
  }
  std::sort(t.begin(), t.end());
  TG_CUDA_CHECK(cudaEventDestroy(start));
  TG_CUDA_CHECK(cudaEventDestroy(stop));
  return t[t.size() / 2];
}

template <class T>
void run(const char* type_name, cudaDataType_t type) {
  std::printf("\n%s on %s (reference: cuBLASLt called directly)\n", type_name, tg::cuda::describe_devices().c_str());
  std::printf("  %-15s %12s %10s %10s %10s %7s\n", "GEMM", "m x n x k", "ours ms", "GFLOP/s", "direct ms", "ratio");
  double ours_total = 0, ref_total = 0;
  for (const Shape3& s : step_gemms) {
    const auto a = tg::cast<T>(tg::random::normal<float, tg::Cuda>(tg::random::key(1), s.ta ? tg::Shape{s.k, s.m} : tg::Shape{s.m, s.k}));
    const auto b = tg::cast<T>(tg::random::normal<float, tg::Cuda>(tg::random::key(2), s.tb ? tg::Shape{s.n, s.k} : tg::Shape{s.k, s.n}));
    const double ours = median_ms([&] { (void)tg::matmul(a, b, s.ta, s.tb); });
    DirectLt direct(s, type);
    auto c = tg::empty<T, tg::Cuda>({s.m, s.n});
    const double ref = median_ms([&] { direct.run(a.data(), b.data(), c.data()); });
    ours_total += ours;
    ref_total += ref;
    std::printf("  %-15s %4lldx%3lldx%3lld %10.4f %10.1f %10.4f %7.2f\n", s.what, (long long)s.m, (long long)s.n,
                (long long)s.k, ours, 2.0 * s.m * s.n * s.k / ours / 1e6, ref, ours / ref);
  }
  std::printf("  %-15s %12s %10.4f %10s %10.4f %7.2f\n", "all 8", "", ours_total, "", ref_total, ours_total / ref_total);
}

}  // namespace

int main() {
  if (!tg::cuda::available()) {
    std::printf("bench_gemm_cuda: no CUDA device here (%s); nothing to measure\n", tg::cuda::describe_devices().c_str());
    return 0;
  }
  run<float>("float32", CUDA_R_32F);
  run<tg::bf16>("bfloat16", CUDA_R_16BF);
  return 0;
}
