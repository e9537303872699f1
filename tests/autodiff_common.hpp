// What the tests of the transformations share (test_grad, test_jvp, test_custom): a small tanh MLP of a
// 2-d input, a user's functor with its first derivative only, a double vector on the test device and an
// element-wise comparison with a relative tolerance.
#pragma once

#include "test_common.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;

namespace ho_test {

template <class Dev>
struct Net {
  tg::Tensor<double, Dev> w1, b1, w2, b2;
};
TG_PYTREE(Net, w1, b1, w2, b2)

/// A small tanh MLP of a 2-d input: (n, 2) -> (n,).
template <class Dev>
tg::Tensor<double, Dev> net(const Net<Dev>& p, const tg::Tensor<double, Dev>& x) {
  const auto h = tg::tanh(tg::linear(x, p.w1, p.b1));
  return tg::linear(h, p.w2, p.b2).reshape({-1});
}

/// A user's functor with its first derivative only (at namespace scope: a CUDA kernel cannot take a type
/// local to a function).
struct Cube {
  TG_HD double operator()(double v) const { return v * v * v; }
  TG_HD double backward(double v, double, double dy) const { return 3 * v * v * dy; }
};

/// The same with its derivative as one generic expression (math/functors.hpp): differentiable to any order.
struct CubeWithDerivative {
  TG_HD double operator()(double v) const { return v * v * v; }
  TG_HD_GENERIC template <class V> TG_HD V derivative(const V& x, const V&) const { return tg::math::k<V>(3) * x * x; }
};

template <class Dev>
Net<Dev> init_net(int seed) {
  return {rnd::normal<double, Dev>(rnd::key(seed), {2, 8}) * 0.7, rnd::normal<double, Dev>(rnd::key(seed + 1), {8}) * 0.1,
          rnd::normal<double, Dev>(rnd::key(seed + 2), {8, 1}) * 0.5, rnd::normal<double, Dev>(rnd::key(seed + 3), {1}) * 0.1};
}

inline tg::Tensor<double, D> dvec(std::vector<double> v, tg::Shape s) { return tg::from_vector<D>(v, s); }

inline void check_close(const tg::Tensor<double, D>& got, const std::vector<double>& want, double tol) {
  const auto g = got.to_vector();
  REQUIRE(g.size() == want.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": got " << g[i] << ", want " << want[i]);
    CHECK(std::fabs(g[i] - want[i]) <= tol * std::max(1.0, std::fabs(want[i])));
  }
}

}  // namespace ho_test
