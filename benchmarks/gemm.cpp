// bench_gemm: GFLOP/s of the 8 GEMMs of one training step of the 784-256-128-10 MLP at batch 512,
// f32 and bf16, through tg::matmul and through the vendor library called directly in the same process
// (oneDNN on the CPU; cuBLASLt on CUDA in the nvcc build), with the ratio.
#include <tapegrad/tapegrad.hpp>

#include "step_gemms.hpp"

#include <dnnl.hpp>  // the reference: oneDNN's own C++ API, independent of our wrapper

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <omp.h>
#include <string>
#include <vector>

namespace {

using bench::step_gemms;
using Shape3 = bench::StepGemm;

/// Median seconds per call over `rounds` rounds of `reps` calls, after a warm-up round.
double median_seconds(const std::function<void()>& f, int reps = 50, int rounds = 7) {
  for (int i = 0; i < reps; ++i) f();
  std::vector<double> t;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class T>
void run_cpu(const char* type_name) {
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  auto& dnn = tg::cpu::OneDnn::instance();
  const bool native = std::is_same_v<T, float> || dnn.bf16_supported();
  std::printf("\n%s on the CPU (reference: oneDNN matmul primitive called directly, %s)\n", type_name,
              native ? "same dtype" : "f32: this CPU has no oneDNN bf16 kernels, so tapegrad converts bf16 to f32");
  std::printf("  %-15s %10s %10s %10s %10s %7s\n", "GEMM", "m x n x k", "ours ms", "GFLOP/s", "oneDNN ms", "ratio");
  double ours_total = 0, ref_total = 0;
  for (const Shape3& s : step_gemms) {
    const auto a = tg::cast<T>(tg::random::normal(tg::random::key(1), s.ta ? tg::Shape{s.k, s.m} : tg::Shape{s.m, s.k}));
    const auto b = tg::cast<T>(tg::random::normal(tg::random::key(2), s.tb ? tg::Shape{s.n, s.k} : tg::Shape{s.k, s.n}));
    const double ours = median_seconds([&] { (void)tg::matmul(a, b, s.ta, s.tb); });
    // The direct call: primitive and memory objects created once, only execute() timed.
    using dt = dnnl::memory::data_type;
    using dims = dnnl::memory::dims;
    const dt type = native && !std::is_same_v<T, float> ? dt::bf16 : dt::f32;
    const dnnl::memory::desc a_md(dims{s.m, s.k}, type, s.ta ? dims{1, s.m} : dims{s.k, 1});
    const dnnl::memory::desc b_md(dims{s.k, s.n}, type, s.tb ? dims{1, s.k} : dims{s.n, 1});
    const dnnl::memory::desc c_md(dims{s.m, s.n}, type, dims{s.n, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), engine);
    const dnnl::matmul prim(pd);
    const auto af = tg::cast<float>(a), bf = tg::cast<float>(b);
    const void* ap = type == dt::f32 ? static_cast<const void*>(af.data()) : a.data();
    const void* bp = type == dt::f32 ? static_cast<const void*>(bf.data()) : b.data();
    dnnl::memory A(a_md, engine, const_cast<void*>(ap)), B(b_md, engine, const_cast<void*>(bp)), C(c_md, engine);
    const std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}};
    const double ref = median_seconds([&] {
      prim.execute(stream, args);
      stream.wait();
    });
    ours_total += ours;
    ref_total += ref;
    std::printf("  %-15s %4lldx%3lldx%3lld %10.3f %10.1f %10.3f %7.2f\n", s.what, static_cast<long long>(s.m),
                static_cast<long long>(s.n), static_cast<long long>(s.k), ours * 1e3, 2.0 * s.m * s.n * s.k / ours / 1e9,
                ref * 1e3, ours / ref);
  }
  std::printf("  %-15s %10s %10.3f %10s %10.3f %7.2f   (time ratio ours / direct; 1.10 = 10%% slower)\n", "all 8", "",
              ours_total * 1e3, "", ref_total * 1e3, ours_total / ref_total);
}

}  // namespace

int main() {
  std::printf("bench_gemm: tapegrad %s, oneDNN %d.%d.%d, %d OpenMP threads\n", tg::version, dnnl_version()->major,
              dnnl_version()->minor, dnnl_version()->patch, omp_get_max_threads());
  run_cpu<float>("float32");
  run_cpu<tg::bf16>("bfloat16");
  return 0;
}
