// CPU loops: an OpenMP parallel loop over element indices that runs a TG_HD functor.
#pragma once

#include <cstdint>

namespace tg::cpu {

/// Calls f(i) for i in [0, n), in parallel when n is large enough to pay for the threads.
template <class F>
void index_map(std::int64_t n, const F& f) {
  constexpr std::int64_t parallel_threshold = 1 << 15;
  if (n < parallel_threshold) {
    for (std::int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

}  // namespace tg::cpu
