// The benchmarks' clock: the median over `runs` of the time per call of f, each run `reps` calls, after one
// warm-up call (which records a compiled step and touches the memory).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace bench {

template <class F>
double median_ms(int runs, int reps, F&& f) {
  using clock_type = std::chrono::steady_clock;
  f();
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = clock_type::now();
    for (int i = 0; i < reps; ++i) f();
    t.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count() / reps);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace bench
