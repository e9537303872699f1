// The numerics guard: nonfinite_flags marks exactly the leaves holding NaN or Inf (without a host read, so
// it runs inside a compiled step), and raise_if_nonfinite / check_finite name the first such leaf.
#include "test_common.hpp"

#include <cmath>
#include <limits>
#include <vector>

namespace check_numerics_tests {

using Catch::Matchers::Contains;

namespace numerics_test {
struct Net {
  tg::Tensor<float> w1, b1;
  std::vector<tg::Tensor<double>> extra;
  tg::Tensor<std::int32_t> count;
};
TG_PYTREE(Net, w1, b1, extra, count)
}  // namespace numerics_test

using numerics_test::Net;

TEST_CASE("nonfinite_flags and check_finite name the leaf that went NaN or Inf", "[numerics]") {
  Net net{tg::ones<float>({3, 4}), tg::zeros<float>({4}), {tg::ones<double>({2}), tg::zeros<double>({0})}, tg::zeros<std::int32_t>({})};
  CHECK_NOTHROW(tg::check_finite(net, "parameters"));
  const auto clean = tg::nonfinite_flags(net);
  CHECK(clean.w1.shape() == tg::Shape{});
  CHECK(clean.w1.item() == 0.0f);
  CHECK(clean.extra[1].item() == 0.0);

  std::vector<float> b(4, 0.0f);
  b[2] = std::numeric_limits<float>::infinity();
  net.b1 = tg::from_vector(b, {4});
  CHECK_THROWS_WITH(tg::check_finite(net, "gradient at step 7"),
                    Contains("[check_numerics] gradient at step 7: 'b1' holds a NaN or Inf; lower the learning rate"));
  net.b1 = tg::zeros<float>({4});
  net.extra[0] = tg::from_vector(std::vector<double>{1.0, std::nan("")}, {2});
  CHECK_THROWS_WITH(tg::check_finite(net, "params"), Contains("'extra[0]' holds a NaN or Inf"));
  CHECK(std::isnan(tg::nonfinite_flags(net).extra[0].item()));
  CHECK(tg::nonfinite_flags(net).w1.item() == 0.0f);
  // A single tensor is a tree too; -Inf and a bf16 NaN count.
  CHECK_THROWS_WITH(tg::check_finite(tg::full<float>({2}, -INFINITY), "loss"), Contains("[check_numerics] loss: '(the value)'"));
  CHECK_THROWS_WITH(tg::check_finite(tg::full<tg::bf16>({5}, tg::bf16(NAN)), "activations"), Contains("holds a NaN or Inf"));
}

TEST_CASE("nonfinite_flags is computed inside a compiled step and checked after it", "[numerics][compile]") {
  auto step = tg::compile([](const tg::Tensor<float>& x) {
    const auto y = tg::log(x);  // log(0) = -Inf, log(-1) = NaN
    return std::tuple{y, tg::nonfinite_flags(y)};
  });
  auto [y1, f1] = step(tg::full<float>({8}, 2.0f));
  CHECK_NOTHROW(tg::raise_if_nonfinite(f1, "log"));
  auto [y2, f2] = step(tg::from_vector(std::vector<float>{1, 2, 3, 0, 5, 6, 7, 8}, {8}));  // replayed
  CHECK(step.recordings() == 1);
  CHECK_THROWS_WITH(tg::raise_if_nonfinite(f2, "log at step 2"), Contains("[check_numerics] log at step 2"));
}

}  // namespace check_numerics_tests
