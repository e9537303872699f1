// What tests/test_vmap.cpp and tests/test_vmap_composed.cpp share: a small MLP, random inputs, the loop
// vmap replaces (loop_of) and an exact-or-to-rounding comparison.
#pragma once

#include "test_common.hpp"

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;

namespace vmap_test {

template <class T, class Dev>
struct Mlp {
  tg::Tensor<T, Dev> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

template <class T, class Dev>
tg::Tensor<T, Dev> mlp(const Mlp<T, Dev>& p, const tg::Tensor<T, Dev>& x) {
  auto h = tg::linear(x, p.w1, p.b1, tg::Activation::gelu);
  h = tg::linear(h, p.w2, p.b2, tg::Activation::gelu);
  return tg::linear(h, p.w3, p.b3);
}

template <class T>
Mlp<T, D> init_mlp(int in, int h1, int h2, int out, std::int64_t seed) {
  auto k = rnd::split(rnd::key(seed), 6);
  auto n = [&](int i, tg::Shape s, double scale) { return tg::mul(rnd::normal<T, D>(k[static_cast<std::size_t>(i)], s), scale); };
  return {n(0, {in, h1}, 0.1), n(1, {h1}, 0.1), n(2, {h1, h2}, 0.1), n(3, {h2}, 0.1), n(4, {h2, out}, 0.1), n(5, {out}, 0.1)};
}

template <class T>
tg::Tensor<T, D> randn(tg::Shape s, std::int64_t seed) {
  return rnd::normal<T, D>(rnd::key(seed), s);
}

/// The loop vmap replaces: f on each example's slice (index_in_dim along its in_axis; an unmapped
/// argument whole), the results stacked along out_axis.
template <class F, class... A>
auto loop_of(F f, std::vector<std::optional<int>> in_axes, int out_axis, std::int64_t n, const A&... args) {
  using Y = decltype(f(args...));
  std::vector<Y> ys;
  for (std::int64_t i = 0; i < n; ++i) {
    std::size_t k = 0;
    auto pick = [&](const auto& x) {
      const auto ax = in_axes[k++];
      if constexpr (tg::detail::is_tensor<std::remove_cvref_t<decltype(x)>>::value) return ax ? tg::index_in_dim(x, i, *ax) : x;
      else return x;
    };
    ys.push_back(std::apply(f, std::tuple{pick(args)...}));
  }
  return tg::stack(std::span<const Y>(ys), out_axis);
}

/// Where a GEMM is compared with GEMMs of other shapes: bit for bit on the CPU (oneDNN computes a row the
/// same way whatever the rows around it), to rounding on a GPU, whose GEMM libraries pick kernels by shape.
#if defined(TG_TEST_CUDA)
constexpr double gemm_exact = 1e-13;
#else
constexpr double gemm_exact = 0.0;
#endif

template <class T, class Dev>
void require_equal(const tg::Tensor<T, Dev>& got, const tg::Tensor<T, Dev>& want, double rel = 0.0) {
  REQUIRE(got.shape() == want.shape());
  const auto g = got.to_vector(), w = want.to_vector();
  double worst = 0.0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double a = static_cast<double>(g[i]), b = static_cast<double>(w[i]);
    if (rel == 0.0) {
      if (!(a == b || (std::isnan(a) && std::isnan(b)))) {
        INFO("element " << i << ": " << a << " vs " << b);
        REQUIRE(a == b);
      }
    } else {
      worst = std::max(worst, std::abs(a - b) / std::max(1.0, std::abs(b)));
    }
  }
  if (rel != 0.0) REQUIRE(worst <= rel);
}

}  // namespace vmap_test
