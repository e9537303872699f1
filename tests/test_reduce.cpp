// ops/reduce.hpp: sums, means, max and logsumexp over an axis and over everything (accurate, bitwise
// reproducible), softmax and log_softmax, and their derivatives against finite differences in double. Built
// for the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "ops_common.hpp"

#include <cmath>
#include <limits>
#include <vector>

namespace reduce_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;
using namespace op_test;

TEST_CASE("reductions over an axis and over everything", "[ops][reduce]") {
  const auto x = input(31, {3, 4, 5});
  const auto dx = values(x);
  auto at = [&](int i, int j, int k) { return dx[static_cast<std::size_t>((i * 4 + j) * 5 + k)]; };
  std::vector<double> s1(15), m1(15), lse1(15);
  std::vector<std::int32_t> am1(15);
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < 5; ++k) {
      double s = 0, m = -INFINITY, e = 0;
      int arg = 0;
      for (int j = 0; j < 4; ++j) {
        s += at(i, j, k);
        if (at(i, j, k) > m) m = at(i, j, k), arg = j;
      }
      for (int j = 0; j < 4; ++j) e += std::exp(at(i, j, k) - m);
      s1[i * 5 + k] = s, m1[i * 5 + k] = m, am1[i * 5 + k] = arg, lse1[i * 5 + k] = m + std::log(e);
    }
  check_close(values(tg::sum(x, 1)), s1, 1e-6, 1e-6, "sum axis 1");
  check_close(values(tg::mean(x, -2)), ref_unary(s1, [](double v) { return v / 4; }), 1e-6, 1e-6, "mean axis -2");
  check_close(values(tg::max(x, 1)), m1, 0, 0, "max axis 1");
  CHECK(tg::argmax(x, 1).to_vector() == am1);
  check_close(values(tg::logsumexp(x, 1)), lse1, 1e-6, 1e-6, "logsumexp axis 1");
  CHECK(tg::sum(x, 1, true).shape() == tg::Shape{3, 1, 5});
  CHECK(tg::max(x, 0, false).shape() == tg::Shape{4, 5});
  double total = 0;
  for (double v : dx) total += v;
  CHECK(tg::sum(x).rank() == 0);
  CHECK(tg::sum(x).item() == Approx(total).margin(1e-5));
  CHECK(tg::mean(x).item() == Approx(total / 60).margin(1e-6));
  CHECK(tg::max(x).item() == *std::max_element(dx.begin(), dx.end()));
  CHECK(tg::argmax(x).item() == std::max_element(dx.begin(), dx.end()) - dx.begin());
  CHECK_THROWS_WITH(tg::sum(x, 3), Contains("[sum] axis 3 is out of range for shape (3, 4, 5)"));
}

TEST_CASE("column reductions (inner > 1) equal the in-order loop bitwise, across column chunks", "[ops][reduce]") {
  // 130 columns: two full 64-wide chunks and a partial one; 3 outer rows; 37 reduced rows.
  const auto x = input(33, {3, 37, 130}, 3.0);
  const auto v = x.to_vector();
  std::vector<float> sum(3 * 130), max(3 * 130);
  for (int o = 0; o < 3; ++o)
    for (int c = 0; c < 130; ++c) {
      float s = 0.0f, m = -INFINITY;
      for (int k = 0; k < 37; ++k) {
        const float e = v[static_cast<std::size_t>((o * 37 + k) * 130 + c)];
        s += e;
        m = std::max(m, e);
      }
      sum[static_cast<std::size_t>(o * 130 + c)] = s, max[static_cast<std::size_t>(o * 130 + c)] = m;
    }
  CHECK(tg::sum(x, 1).to_vector() == sum);
  CHECK(tg::max(x, 1).to_vector() == max);
  const auto means = tg::mean(x, 1).to_vector();
  for (std::size_t i = 0; i < means.size(); ++i) CHECK(means[i] == sum[i] / 37.0f);
}

TEST_CASE("whole-tensor sums are accurate and bitwise reproducible", "[ops][reduce]") {
  // 1,000,003 elements: several chunk levels and a ragged tail. Chunked f32 accumulation keeps the
  // relative error near 4096 * 2^-24 ~ 2.4e-4 at worst; against the double sum we allow 1e-4 relative.
  const auto x = input(41, {1000003}, 1.0, 0.5);
  const auto dx = values(x);
  double want = 0;
  for (double v : dx) want += v;
  const float got = tg::sum(x).item();
  CHECK(got == Approx(want).epsilon(1e-4));
  CHECK(tg::sum(x).item() == got);  // same bits every time
  CHECK(tg::max(x).item() == static_cast<float>(*std::max_element(dx.begin(), dx.end())));
  CHECK(tg::mean(x).item() == Approx(want / 1000003).epsilon(1e-4));
#if defined(_OPENMP) && !defined(TG_TEST_CUDA)
  // The CPU result does not depend on the thread count: every chunk is summed by one thread, in order.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const float one_thread = tg::sum(x).item();
  omp_set_num_threads(threads);
  CHECK(one_thread == got);
#endif
}

TEST_CASE("softmax and log_softmax are stable and normalised", "[ops][reduce]") {
  const auto x = input(51, {6, 10}, 3.0);
  const auto big = x + 1000.0f;  // would overflow exp without the max shift
  const auto p = values(tg::softmax(big));
  const auto lp = values(tg::log_softmax(big));
  const auto dx = values(x);
  for (int r = 0; r < 6; ++r) {
    double m = -INFINITY, s = 0, total = 0;
    for (int k = 0; k < 10; ++k) m = std::max(m, dx[r * 10 + k]);
    for (int k = 0; k < 10; ++k) s += std::exp(dx[r * 10 + k] - m);
    for (int k = 0; k < 10; ++k) {
      const double want_log = dx[r * 10 + k] - m - std::log(s);
      CHECK(lp[r * 10 + k] == Approx(want_log).margin(2e-4));  // 1000 + x loses ~1e-4 in float
      CHECK(p[r * 10 + k] == Approx(std::exp(want_log)).margin(2e-4));
      total += p[r * 10 + k];
    }
    CHECK(total == Approx(1.0).margin(1e-5));
  }
  CHECK(std::isfinite(tg::logsumexp(big, -1).to_vector()[0]));
}


TEST_CASE("reductions, softmax and log_softmax differentiate correctly", "[autodiff][reduce]") {
  const AB<double, D> p{dnormal(21, {3, 5}, 2.0), dnormal(22, {3, 5})};
  check_op("sum axis 0", [](auto a, auto) { return tg::sum(a, 0); }, p);
  check_op("sum axis -1 keepdims", [](auto a, auto) { return tg::sum(a, -1, true); }, p);
  check_op("sum all", [](auto a, auto) { return tg::sum(a); }, p);
  check_op("mean axis 1", [](auto a, auto) { return tg::mean(a, 1); }, p);
  check_op("mean all", [](auto a, auto) { return tg::mean(a); }, p);
  check_op("max axis 1", [](auto a, auto) { return tg::max(a, 1); }, p);
  check_op("max all", [](auto a, auto) { return tg::max(a); }, p);
  check_op("logsumexp axis 0", [](auto a, auto) { return tg::logsumexp(a, 0); }, p);
  check_op("softmax", [](auto a, auto) { return tg::softmax(a); }, p);
  check_op("log_softmax", [](auto a, auto) { return tg::log_softmax(a); }, p);
  // Ties in max share the cotangent evenly, as JAX does.
  const auto tied = tg::full<double, D>({4}, 2.0);
  const auto g = tg::grad([](const AB<double, D>& q) { return tg::max(q.a); })(AB<double, D>{tied, tied});
  CHECK(g.a.to_vector() == std::vector<double>(4, 0.25));
}

#if defined(TG_TEST_CUDA)
TEST_CASE("CUDA reductions equal the CPU's", "[ops][cuda]") {
  const auto xc = rnd::normal<float>(rnd::key(7), {300, 70});
  const auto xg = tg::device_put<tg::Cuda>(xc);
  check_close(values(tg::softmax(xg)), values(tg::softmax(xc)), 1e-6, 1e-6, "softmax");
  check_close(values(tg::sum(xg, 0)), values(tg::sum(xc, 0)), 0, 0, "sum axis 0 (same order)");
  CHECK(tg::sum(xg).item() == tg::sum(xc).item());  // same chunking, same order
}
#endif

}  // namespace reduce_tests
