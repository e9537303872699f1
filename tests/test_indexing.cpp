// ops/indexing.hpp: transpose and swapaxes, slice_in_dim, index_in_dim, take, concatenate and stack as JAX,
// their gradients against finite differences in double, and the per-element index functors CUDA runs against
// the CPU's row forms. Built for the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "ops_common.hpp"

#include <cmath>
#include <vector>

namespace indexing_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;
using namespace op_test;

TEST_CASE("transpose and swapaxes permute as jnp.transpose, and their gradients are the inverse permutation", "[ops][transformer]") {
  const auto x = op_test::dnormal(1, {2, 3, 4, 5});
  const auto y = tg::transpose(x, {2, 0, 3, 1});
  REQUIRE(y.shape() == tg::Shape({4, 2, 5, 3}));
  const auto xv = x.to_vector(), yv = y.to_vector();
  const auto sx = op_test::strides(x.shape());
  bool all = true;
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t j = 0; j < 2; ++j)
      for (std::int64_t k = 0; k < 5; ++k)
        for (std::int64_t l = 0; l < 3; ++l)
          all = all && yv[static_cast<std::size_t>(((i * 2 + j) * 5 + k) * 3 + l)] == xv[static_cast<std::size_t>(j * sx[0] + l * sx[1] + i * sx[2] + k * sx[3])];
  CHECK(all);
  CHECK(tg::transpose(x).shape() == tg::Shape({5, 4, 3, 2}));
  CHECK(tg::swapaxes(x, 1, -1).shape() == tg::Shape({2, 5, 4, 3}));
  CHECK(tg::swapaxes(x, 1, -1).at({1, 4, 2, 0}) == x.at({1, 0, 2, 4}));
  // Merged adjacent axes: (0, 1) stay together in (2, 3, 0, 1).
  CHECK(tg::transpose(x, {2, 3, 0, 1}).at({3, 4, 1, 2}) == x.at({1, 2, 3, 4}));
  op_test::check_fd("transpose", x, [](const tg::Tensor<double, D>& p) { return tg::transpose(p, {2, 0, 3, 1}); });
  op_test::check_fd("swapaxes", x, [](const tg::Tensor<double, D>& p) { return tg::swapaxes(p, 0, 2); });
  CHECK_THROWS_WITH(tg::transpose(x, {0, 1, 2}), Contains("transpose") && Contains("perm has 3 axes"));
  CHECK_THROWS_WITH(tg::transpose(x, {0, 1, 1, 2}), Contains("axis 1 appears twice"));
}


TEST_CASE("slice_in_dim, index_in_dim and take read as JAX, and their gradients scatter back", "[ops][transformer][indexing]") {
  const auto x = op_test::dnormal(7, {3, 7, 4});
  const auto s = tg::slice_in_dim(x, 1, 6, 2, 1);  // positions 1, 3, 5
  REQUIRE(s.shape() == tg::Shape({3, 3, 4}));
  CHECK(s.at({2, 1, 3}) == x.at({2, 3, 3}));
  CHECK(tg::slice_in_dim(x, -3, 100, 1, 1).shape() == tg::Shape({3, 3, 4}));  // clamped, negative from the end
  CHECK(tg::slice_in_dim(x, -3, 100, 1, 1).at({0, 0, 0}) == x.at({0, 4, 0}));
  CHECK(tg::slice_in_dim(x, 5, 2, 1, 1).shape() == tg::Shape({3, 0, 4}));
  CHECK(tg::index_in_dim(x, -1, 1).shape() == tg::Shape({3, 4}));
  CHECK(tg::index_in_dim(x, -1, 1).at({1, 2}) == x.at({1, 6, 2}));
  op_test::check_fd("slice_in_dim", x, [](const tg::Tensor<double, D>& p) { return tg::slice_in_dim(p, 1, 6, 2, 1); });
  op_test::check_fd("index_in_dim", x, [](const tg::Tensor<double, D>& p) { return tg::index_in_dim(p, 2, -1); });

  const auto idx = tg::from_vector<D>(std::vector<std::int32_t>{4, -1, 0, 4, 2, 9}, {2, 3});
  const auto t = tg::take(x, idx, 1);
  REQUIRE(t.shape() == tg::Shape({3, 2, 3, 4}));
  CHECK(t.at({1, 0, 0, 2}) == x.at({1, 4, 2}));
  CHECK(t.at({1, 0, 1, 2}) == x.at({1, 6, 2}));  // -1: the last
  CHECK(std::isnan(t.at({0, 1, 2, 0})));          // 9 is out of range: NaN, as jnp.take's mode "fill"
  const auto in_range = tg::from_vector<D>(std::vector<std::int32_t>{4, -1, 0, 4, 2}, {5});  // 4 twice: cotangents add
  op_test::check_fd("take", x, [&](const tg::Tensor<double, D>& p) { return tg::take(p, in_range, 1); });
  op_test::check_fd("take axis 0", x, [&](const tg::Tensor<double, D>& p) {
    return tg::take(p, tg::from_vector<D>(std::vector<std::int32_t>{2, 2, 0}, {3}), 0);
  });
  CHECK_THROWS_WITH(tg::slice_in_dim(x, 0, 2, 0, 1), Contains("stride must be >= 1"));
  CHECK_THROWS_WITH(tg::index_in_dim(x, 7, 1), Contains("index 7 is out of range"));
}

TEST_CASE("take's gradient is a segment sum in index order: many repeated, negative and out-of-range indices", "[ops][transformer][indexing]") {
  // An embedding-shaped table (vocab 300, dim 37) and 2,000 token ids, many repeated, some negative and
  // some out of range: the gradient equals the scatter-add in double, and in f32 exactly the sums in k's
  // order (what each j's own segment adds up).
  const std::int64_t vocab = 300, dim = 37, tokens = 2000;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens));
  const auto r = rnd::bits<tg::Cpu>(rnd::key(5), {tokens}).to_vector();
  for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = static_cast<std::int32_t>(r[k] % 320) - 10;  // [-10, 310)
  const auto table = op_test::dnormal(41, {vocab, dim});
  const auto w = op_test::dnormal(42, {tokens, dim});
  const auto idx = tg::from_vector<D>(ids, {tokens});
  const auto g = tg::grad([&](const tg::Tensor<double, D>& p) { return tg::sum(tg::take(p, idx, 0) * w); })(table).to_vector();
  std::vector<double> want(static_cast<std::size_t>(vocab * dim), 0.0);
  const auto wv = w.to_vector();
  for (std::int64_t k = 0; k < tokens; ++k) {
    const std::int64_t j = ids[static_cast<std::size_t>(k)] < 0 ? ids[static_cast<std::size_t>(k)] + vocab : ids[static_cast<std::size_t>(k)];
    if (j < 0 || j >= vocab) continue;
    for (std::int64_t c = 0; c < dim; ++c) want[static_cast<std::size_t>(j * dim + c)] += wv[static_cast<std::size_t>(k * dim + c)];
  }
  CHECK(g == want);  // the same additions in the same order
  // f32 and bf16: the element form CUDA runs equals the CPU's rows (and the f32 sums are in k's order).
  const auto wf = tg::cast<float>(w);
  const auto gf = tg::grad([&](const tg::Tensor<float, D>& p) { return tg::sum(tg::take(p, idx, 0) * wf); })(tg::cast<float>(table));
  const auto wvf = wf.to_vector();
  std::vector<float> want_f(static_cast<std::size_t>(vocab * dim), 0.0f);
  for (std::int64_t k = 0; k < tokens; ++k) {
    const std::int64_t j = ids[static_cast<std::size_t>(k)] < 0 ? ids[static_cast<std::size_t>(k)] + vocab : ids[static_cast<std::size_t>(k)];
    if (j < 0 || j >= vocab) continue;
    for (std::int64_t c = 0; c < dim; ++c) want_f[static_cast<std::size_t>(j * dim + c)] += wvf[static_cast<std::size_t>(k * dim + c)];
  }
  CHECK(gf.to_vector() == want_f);
#if !defined(TG_TEST_CUDA)
  const auto inverse = tg::Tensor<std::int32_t>(tg::Shape{2 * vocab + 1 + tokens});
  tg::detail::index_map<tg::Cpu>(1, tg::detail::TakeInverseFn{idx.data(), vocab, tokens, inverse.data()});
  for (const bool bf16 : {false, true}) {
    auto both = [&]<class T>(T) {
      const auto dy = tg::cast<T>(wf);
      tg::Tensor<T> by_rows({vocab, dim}), by_elements({vocab, dim});
      const tg::detail::TakeBackwardFn<T> f{dy.data(), inverse.data(), nullptr, vocab, tokens, dim};
      auto rows = f, elements = f;
      rows.dx = by_rows.data(), elements.dx = by_elements.data();
      tg::detail::rows_or_elements<tg::Cpu>(by_rows.size(), dim, rows);
      tg::detail::index_map<tg::Cpu>(by_elements.size(), elements);
      CHECK(by_rows.to_vector() == by_elements.to_vector());
    };
    if (bf16) both(tg::bf16{});
    else both(0.0f);
  }
#endif
}

TEST_CASE("concatenate and stack join as JAX, and their gradients split back", "[ops][transformer][indexing]") {
  const auto a = op_test::dnormal(8, {2, 3, 4}), b = op_test::dnormal(9, {2, 5, 4}), c = op_test::dnormal(10, {2, 1, 4});
  const auto j = tg::concatenate({a, b, c}, 1);
  REQUIRE(j.shape() == tg::Shape({2, 9, 4}));
  CHECK(j.at({1, 2, 3}) == a.at({1, 2, 3}));
  CHECK(j.at({1, 4, 0}) == b.at({1, 1, 0}));
  CHECK(j.at({0, 8, 2}) == c.at({0, 0, 2}));
  op_test::check_fd("concatenate", op_test::Leaves3<double>{a, b, c},
                 [](const op_test::Leaves3<double>& p) { return tg::concatenate({p.a, p.b, p.c}, -2); });
  const auto b2 = op_test::dnormal(11, {2, 3, 4}), c2 = op_test::dnormal(12, {2, 3, 4});
  const auto st = tg::stack({a, b2, c2}, -1);
  REQUIRE(st.shape() == tg::Shape({2, 3, 4, 3}));
  CHECK(st.at({1, 2, 3, 1}) == b2.at({1, 2, 3}));
  CHECK(tg::stack({a, b2}, 0).shape() == tg::Shape({2, 2, 3, 4}));
  op_test::check_fd("stack", op_test::Leaves3<double>{a, b2, c2},
                 [](const op_test::Leaves3<double>& p) { return tg::stack({p.a, p.b, p.c}, 1); });
  // A tensor used twice: both cotangents arrive.
  op_test::check_fd("concatenate with repeats", a, [](const tg::Tensor<double, D>& p) { return tg::concatenate({p, p}, 0); });
  CHECK_THROWS_WITH(tg::concatenate({a, op_test::dnormal(1, {3, 3, 4})}, 1), Contains("tensor 1 has shape (3, 3, 4)"));
  CHECK_THROWS_WITH(tg::stack({a, b}, 0), Contains("stacked tensors must have one shape"));
}

#if !defined(TG_TEST_CUDA)
TEST_CASE("the per-element index functors CUDA runs equal the CPU's row forms", "[ops][transformer][indexing]") {
  // CUDA launches a thread per element (PermuteFn, SliceFn, ... operator()); the CPU copies rows. Run
  // the element forms here on the CPU and compare with the ops.
  const auto x = op_test::dnormal(21, {3, 5, 4, 6});
  const auto y = tg::transpose(x, {2, 0, 3, 1});
  tg::detail::PermuteFn<double> f{};
  const auto st = op_test::strides(x.shape());
  const int perm[4] = {2, 0, 3, 1};
  f.rank = 4;
  for (int d = 0; d < 4; ++d) f.dims[d] = x.shape()[perm[d]], f.strides[d] = st[static_cast<std::size_t>(perm[d])];
  tg::Tensor<double> out(y.shape());
  f.x = x.data(), f.y = out.data();
  tg::detail::index_map<tg::Cpu>(out.size(), f);
  CHECK(out.to_vector() == y.to_vector());

  const auto s = tg::slice_in_dim(x, 1, 5, 2, 1);
  tg::Tensor<double> s2(s.shape());
  tg::detail::index_map<tg::Cpu>(s2.size(), tg::detail::SliceFn<double>{x.data(), s2.data(), 5, 2, 24, 1, 2});
  CHECK(s2.to_vector() == s.to_vector());
  tg::Tensor<double> back(x.shape()), back_rows(x.shape());
  tg::detail::index_map<tg::Cpu>(back.size(), tg::detail::SliceBackwardFn<double>{s.data(), back.data(), 5, 2, 24, 1, 2});
  tg::detail::rows_or_elements<tg::Cpu>(back_rows.size(), 24, tg::detail::SliceBackwardFn<double>{s.data(), back_rows.data(), 5, 2, 24, 1, 2});
  CHECK(back.to_vector() == back_rows.to_vector());

  const auto idx = tg::from_vector(std::vector<std::int32_t>{4, -1, 7, 0});
  const auto t = tg::take(x, idx, 1);
  tg::Tensor<double> t2(t.shape());
  tg::detail::index_map<tg::Cpu>(t2.size(), tg::detail::TakeFn<double>{x.data(), idx.data(), t2.data(), 5, 4, 24});
  const auto tv = t.to_vector(), t2v = t2.to_vector();
  bool same = true;
  for (std::size_t i = 0; i < tv.size(); ++i) same = same && (tv[i] == t2v[i] || (std::isnan(tv[i]) && std::isnan(t2v[i])));
  CHECK(same);

  const auto c = tg::concatenate({x, x}, 2);
  tg::Tensor<double> c2(c.shape());
  for (std::int64_t off : {0, 4}) tg::detail::index_map<tg::Cpu>(x.size(), tg::detail::PlaceFn<double>{x.data(), c2.data(), 4, 8, 6, off});
  CHECK(c2.to_vector() == c.to_vector());
}
#endif

}  // namespace indexing_tests
