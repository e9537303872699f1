// ops/nn.hpp: softmax cross-entropy, accuracy and one_hot, layer_norm (as flax's LayerNorm) and dropout
// (jax.random.bernoulli's mask), with their derivatives against finite differences in double. Built for the
// CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "ops_common.hpp"

#include <cmath>
#include <vector>

namespace nn_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;
using namespace op_test;

TEST_CASE("softmax cross-entropy, accuracy and one_hot", "[ops][nn]") {
  const auto logits = input(101, {8, 10}, 4.0);
  const std::vector<std::int32_t> lv{0, 9, 3, 3, 7, 1, 2, 5};
  const auto labels = tg::from_vector<D>(lv);
  const auto dl = values(logits);
  std::vector<double> want(8);
  int correct = 0;
  for (int r = 0; r < 8; ++r) {
    double m = -INFINITY, s = 0;
    int arg = 0;
    for (int k = 0; k < 10; ++k)
      if (dl[r * 10 + k] > m) m = dl[r * 10 + k], arg = k;
    for (int k = 0; k < 10; ++k) s += std::exp(dl[r * 10 + k] - m);
    want[r] = m + std::log(s) - dl[r * 10 + lv[r]];
    correct += arg == lv[r];
  }
  check_close(values(tg::softmax_cross_entropy_with_integer_labels(logits, labels)), want, 1e-5, 1e-5, "cross-entropy");
  // Stable for logits far from 0.
  const auto shifted = values(tg::softmax_cross_entropy_with_integer_labels(logits + 5000.0f, labels));
  check_close(shifted, want, 2e-3, 1e-3, "cross-entropy at +5000");  // 5000 + x keeps ~2^-11 of x
  CHECK(tg::accuracy(logits, labels).item() == Approx(correct / 8.0));
  const auto oh = tg::one_hot<float>(tg::from_vector<D>(std::vector<std::int32_t>{2, 0, 5}), 3).to_vector();
  CHECK(oh == std::vector<float>{0, 0, 1, 1, 0, 0, 0, 0, 0});  // 5 is out of range: a zero row, as JAX
  const auto ten = tg::from_vector<D>(std::vector<std::int32_t>{0, 1, 2, 3, 10, 1, 2, 3});
  const auto minus_one = tg::from_vector<D>(std::vector<std::int32_t>{-1, 1, 2, 3, 1, 1, 2, 3});
  const std::string ten_message = "[softmax_cross_entropy_with_integer_labels] label 10 at position 4 is out of range for 10 classes";
#if defined(TG_TEST_CUDA)
  // CUDA (docs/cuda.md): the labels are checked on the device; the call that queued the check returns,
  // and the error is raised, once, by the next synchronisation or host read, then cleared.
  tg::cuda::synchronize();  // nothing pending
  const auto bad_loss = tg::softmax_cross_entropy_with_integer_labels(logits, ten);
  CHECK_THROWS_WITH(tg::cuda::synchronize(), Contains(ten_message) && Contains("found on the device"));
  CHECK_NOTHROW(tg::cuda::synchronize());  // raised once
  (void)tg::softmax_cross_entropy_with_integer_labels(logits, minus_one);
  const auto upload = tg::from_vector<D>(std::vector<float>{1.0f});  // a transfer to the device does not raise it
  CHECK_THROWS_WITH(bad_loss.to_vector(), Contains("label -1 at position 0"));  // a host read does
  CHECK(upload.item() == 1.0f);
  // The first error since the last raise wins; a later one is not reported on top of it.
  (void)tg::softmax_cross_entropy_with_integer_labels(logits, ten);
  (void)tg::softmax_cross_entropy_with_integer_labels(logits, minus_one);
  CHECK_THROWS_WITH(tg::cuda::synchronize(), Contains(ten_message));
  CHECK_NOTHROW(tg::cuda::synchronize());
#else
  // CPU: the op checks and throws itself.
  CHECK_THROWS_WITH(tg::softmax_cross_entropy_with_integer_labels(logits, ten), Contains(ten_message));
  CHECK_THROWS_WITH(tg::softmax_cross_entropy_with_integer_labels(logits, minus_one), Contains("label -1 at position 0"));
#endif
  CHECK_THROWS_WITH(tg::softmax_cross_entropy_with_integer_labels(logits, tg::from_vector<D>(std::vector<std::int32_t>{1, 2})),
                    Contains("labels of shape (2,) do not match logits of shape (8, 10)"));
}


TEST_CASE("layer_norm normalises the last axis as flax's LayerNorm, with finite-difference gradients", "[ops][transformer][layer_norm]") {
  const std::int64_t rows = 37, n = 24;  // rows not a multiple of the backward's chunk
  const auto x = op_test::dnormal(3, {rows, n}, 2.0, 0.5), scale = op_test::dnormal(4, {n}, 0.5, 1.0), bias = op_test::dnormal(5, {n});
  const double eps = 1e-5;
  const auto y = tg::layer_norm(x, scale, bias, eps).to_vector();
  const auto xv = x.to_vector(), sv = scale.to_vector(), bv = bias.to_vector();
  std::vector<double> want(xv.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double mu = 0.0, var = 0.0;
    for (std::int64_t k = 0; k < n; ++k) mu += xv[static_cast<std::size_t>(r * n + k)] / n;
    for (std::int64_t k = 0; k < n; ++k) var += std::pow(xv[static_cast<std::size_t>(r * n + k)] - mu, 2) / n;
    for (std::int64_t k = 0; k < n; ++k) {
      const auto i = static_cast<std::size_t>(r * n + k);
      want[i] = (xv[i] - mu) / std::sqrt(var + eps) * sv[static_cast<std::size_t>(k)] + bv[static_cast<std::size_t>(k)];
    }
  }
  op_test::check_close(y, want, 1e-13, "layer_norm f64");
  op_test::check_close(op_test::host(tg::layer_norm(tg::cast<float>(x), tg::cast<float>(scale), tg::cast<float>(bias), eps)), want, 1e-5, "layer_norm f32");
  // bf16: statistics in f32, so the result is the f32 computation on the bf16 inputs, rounded once.
  const auto xb = tg::cast<tg::bf16>(x), sb = tg::cast<tg::bf16>(scale), bb = tg::cast<tg::bf16>(bias);
  const auto yb = tg::cast<float>(tg::layer_norm(xb, sb, bb, eps)).to_vector();
  const auto yf = tg::cast<float>(tg::cast<tg::bf16>(tg::layer_norm(tg::cast<float>(xb), tg::cast<float>(sb), tg::cast<float>(bb), eps))).to_vector();
  CHECK(yb == yf);
  // Higher rank: the rows are every leading index.
  op_test::check_fd("layer_norm", op_test::Leaves3<double>{x.reshape({1, rows, n}), scale, bias},
                 [&](const op_test::Leaves3<double>& p) { return tg::layer_norm(p.a, p.b, p.c, eps); });
  CHECK_THROWS_WITH(tg::layer_norm(x, op_test::dnormal(1, {n + 1}), bias), Contains("layer_norm") && Contains("scale and bias must have shape (24,)"));
}

TEST_CASE("dropout is jax.random.bernoulli's mask, deterministic given the key, the identity at rate 0", "[ops][transformer][dropout]") {
  const auto x = op_test::dnormal(6, {64, 33});
  const double rate = 0.25;
  const auto key = rnd::key(17);
  const auto y = tg::dropout(key, x, rate).to_vector();
  const auto u = rnd::uniform<float, D>(key, x.shape()).to_vector();
  const auto xv = x.to_vector();
  std::size_t kept = 0;
  bool all = true;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const bool keep = u[i] < static_cast<float>(1.0 - rate);
    kept += keep;
    all = all && y[i] == (keep ? xv[i] / static_cast<double>(static_cast<float>(1.0 - rate)) : 0.0);
  }
  CHECK(all);
  CHECK(std::fabs(static_cast<double>(kept) / static_cast<double>(xv.size()) - 0.75) < 0.03);
  CHECK(tg::dropout(key, x, rate).to_vector() == y);
  CHECK(tg::dropout(rnd::key(18), x, rate).to_vector() != y);
  CHECK(tg::dropout(rnd::key_data<D>(key), x, rate).to_vector() == y);
  CHECK(tg::dropout(key, x, 0.0).to_vector() == xv);
  CHECK(tg::dropout(key, x, rate, /*deterministic=*/true).to_vector() == xv);
  op_test::check_fd("dropout", x, [&](const tg::Tensor<double, D>& p) { return tg::dropout(key, p, rate); });
  CHECK_THROWS_WITH(tg::dropout(key, x, 1.0), Contains("rate must be in [0, 1)"));
  CHECK_THROWS_WITH(tg::dropout(tg::zeros<std::uint32_t, D>({3}), x, 0.5), Contains("shape (2,)"));

  // In a compiled step the key is an input: each call draws its own mask.
  auto step = tg::compile([](const tg::Tensor<std::uint32_t, D>& k, const tg::Tensor<float, D>& v) { return tg::dropout(k, v, 0.5); });
  const auto xf = tg::cast<float>(x);
  const auto m1 = step(rnd::key_data<D>(rnd::key(1)), xf).to_vector(), m2 = step(rnd::key_data<D>(rnd::key(2)), xf).to_vector();
  CHECK(m1 == tg::dropout(rnd::key(1), xf, 0.5).to_vector());
  CHECK(m2 == tg::dropout(rnd::key(2), xf, 0.5).to_vector());
  CHECK(m1 != m2);
  auto frozen = tg::compile([key](const tg::Tensor<float, D>& v) { return tg::dropout(key, v, 0.5); });
  CHECK_THROWS_WITH(frozen(xf), Contains("dropout") && Contains("key_data"));
}

TEST_CASE("softmax cross-entropy differentiates correctly", "[autodiff][nn]") {
  const auto labels = tg::from_vector<D>(std::vector<std::int32_t>{0, 3, 2, 1, 3, 0});
  check_op("softmax_cross_entropy", [&](auto logits, auto) { return tg::softmax_cross_entropy_with_integer_labels(logits, labels); },
           AB<double, D>{dnormal(38, {6, 4}, 3.0), dnormal(39, {1})});
}

}  // namespace nn_tests
