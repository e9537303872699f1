// bench_random: normals per second from tg::random::normal on the CPU, against std::normal_distribution
// (mt19937) in the same process as the reference.
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

namespace {

template <class F>
double median_seconds(F&& f, int repeats) {
  f();  // warm-up: page in the buffers, start the thread pool
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main() {
  constexpr std::int64_t n = 784 * 256 * 16;
  const double ours = median_seconds([&] { (void)tg::random::normal(tg::random::key(1), {n}); }, 7);
  std::vector<float> out(static_cast<std::size_t>(n));
  std::mt19937 gen(1);
  std::normal_distribution<float> dist;
  const double ref = median_seconds([&] { for (auto& v : out) v = dist(gen); }, 7);
  std::printf("normal float32, %lld values (median of 7)\n", static_cast<long long>(n));
  std::printf("  tg::random::normal (cpu, Threefry, JAX-exact): %8.1f M/s\n", n / ours / 1e6);
  std::printf("  std::normal_distribution (mt19937, 1 thread):   %8.1f M/s\n", n / ref / 1e6);
  std::printf("  ratio: %.2fx\n", ref / ours);
  return 0;
}
