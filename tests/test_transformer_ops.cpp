// The ops a transformer needs beyond the MLP's: transpose / swapaxes, batched and broadcast matmul,
// layer_norm, dropout, slice_in_dim / index_in_dim / take, concatenate / stack. Values against double
// references, gradients against finite differences in double (tg::check_grads). Built for the CPU, and
// by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "test_common.hpp"

#include <cmath>
#include <map>
#include <string>
#include <vector>

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;

namespace tops {

template <class T>
struct Leaves3 {
  tg::Tensor<T, D> a, b, c;
};
TG_PYTREE(Leaves3, a, b, c)

inline tg::Tensor<double, D> dnormal(int seed, const tg::Shape& s, double scale = 1.0, double shift = 0.0) {
  return rnd::normal<double, D>(rnd::key(seed), s) * scale + shift;
}

inline std::vector<double> host(const tg::Tensor<double, D>& t) { return t.to_vector(); }
inline std::vector<double> host(const tg::Tensor<float, D>& t) {
  const auto v = t.to_vector();
  return {v.begin(), v.end()};
}

/// check_grads of sum(f(p) * w) over a pytree p, w fixed random weights, so every output element counts
/// differently: to second order, forward and reverse mode.
template <class P, class F>
void check_fd(const char* what, const P& p, F f, double eps = 1e-6) {
  INFO(what);
  const auto w = dnormal(4242, f(p).shape());
  auto loss = [&](const P& q) { return tg::sum(tg::mul(f(q), w)); };
  const auto r = tg::check_grads(loss, p, tg::GradCheckOptions{.eps = eps, .order = 2, .modes = tg::fwd | tg::rev, .print = false});
  INFO(r);
  CHECK(r.passed);
}

/// Row-major strides.
inline std::vector<std::int64_t> strides(const tg::Shape& s) {
  std::vector<std::int64_t> st(static_cast<std::size_t>(s.rank()));
  std::int64_t k = 1;
  for (int d = s.rank() - 1; d >= 0; --d) st[static_cast<std::size_t>(d)] = k, k *= s[d];
  return st;
}

/// Batched matmul reference in double: NumPy broadcasting over the leading dims.
inline std::vector<double> ref_matmul(const std::vector<double>& a, const tg::Shape& sa, const std::vector<double>& b,
                                      const tg::Shape& sb, bool ta, bool tb, tg::Shape& out) {
  const int rank = std::max(sa.rank(), sb.rank());
  const std::int64_t m = ta ? sa[-1] : sa[-2], k = ta ? sa[-2] : sa[-1], n = tb ? sb[-2] : sb[-1];
  std::vector<std::int64_t> dims;
  for (int i = 0; i < rank - 2; ++i) {
    const int ia = sa.rank() - rank + i, ib = sb.rank() - rank + i;
    const std::int64_t da = ia >= 0 ? sa[ia] : 1, db = ib >= 0 ? sb[ib] : 1;
    dims.push_back(std::max(da, db));
  }
  std::int64_t batches = 1;
  for (auto d : dims) batches *= d;
  dims.push_back(m), dims.push_back(n);
  out = tg::Shape(dims);
  std::vector<double> c(static_cast<std::size_t>(batches * m * n), 0.0);
  for (std::int64_t bi = 0; bi < batches; ++bi) {
    // Offsets of the batch in a and b (broadcast axes read index 0).
    std::int64_t rem = bi, oa = 0, ob = 0, sa_k = sa[-1] * sa[-2], sb_k = sb[-1] * sb[-2];
    for (int i = rank - 3; i >= 0; --i) {
      const std::int64_t d = dims[static_cast<std::size_t>(i)], ci = rem % d;
      rem /= d;
      const int ia = sa.rank() - rank + i, ib = sb.rank() - rank + i;
      if (ia >= 0 && sa[ia] != 1) oa += ci * sa_k;
      if (ib >= 0 && sb[ib] != 1) ob += ci * sb_k;
      if (ia >= 0) sa_k *= sa[ia];
      if (ib >= 0) sb_k *= sb[ib];
    }
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double acc = 0.0;
        for (std::int64_t p = 0; p < k; ++p)
          acc += a[static_cast<std::size_t>(oa + (ta ? p * m + i : i * k + p))] * b[static_cast<std::size_t>(ob + (tb ? j * k + p : p * n + j))];
        c[static_cast<std::size_t>((bi * m + i) * n + j)] = acc;
      }
  }
  return c;
}

inline void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol, const char* what) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]) / (1.0 + std::fabs(want[i])));
  INFO("worst relative error " << worst);
  CHECK(worst <= tol);
}

}  // namespace tops

TEST_CASE("transpose and swapaxes permute as jnp.transpose, and their gradients are the inverse permutation", "[ops][transformer]") {
  const auto x = tops::dnormal(1, {2, 3, 4, 5});
  const auto y = tg::transpose(x, {2, 0, 3, 1});
  REQUIRE(y.shape() == tg::Shape({4, 2, 5, 3}));
  const auto xv = x.to_vector(), yv = y.to_vector();
  const auto sx = tops::strides(x.shape());
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
  tops::check_fd("transpose", x, [](const tg::Tensor<double, D>& p) { return tg::transpose(p, {2, 0, 3, 1}); });
  tops::check_fd("swapaxes", x, [](const tg::Tensor<double, D>& p) { return tg::swapaxes(p, 0, 2); });
  CHECK_THROWS_WITH(tg::transpose(x, {0, 1, 2}), Contains("transpose") && Contains("perm has 3 axes"));
  CHECK_THROWS_WITH(tg::transpose(x, {0, 1, 1, 2}), Contains("axis 1 appears twice"));
}

TEST_CASE("matmul batches over leading axes with NumPy broadcasting, for every transpose", "[ops][transformer][matmul]") {
  struct Case {
    tg::Shape a, b;
    bool ta, tb;
  };
  const std::vector<Case> cases = {
      {{2, 3, 4, 5}, {2, 3, 5, 6}, false, false},  // same batch
      {{2, 3, 4, 5}, {3, 6, 5}, false, true},      // b broadcast over the first axis
      {{2, 1, 5, 4}, {1, 3, 5, 6}, true, false},   // both broadcast
      {{3, 5, 4}, {3, 6, 5}, true, true},
      {{2, 3, 4, 5}, {5, 6}, false, false},        // a 2-d weight: one GEMM over the folded batch
      {{4, 5}, {3, 5, 6}, false, false},           // a 2-d left operand broadcast over b's batch
      {{2, 5, 4}, {5, 6}, true, false},
  };
  int seed = 10;
  for (const auto& c : cases) {
    INFO("a " << c.a << (c.ta ? "^T" : "") << " @ b " << c.b << (c.tb ? "^T" : ""));
    const auto a = tops::dnormal(seed++, c.a), b = tops::dnormal(seed++, c.b);
    tg::Shape want_shape;
    const auto want = tops::ref_matmul(a.to_vector(), c.a, b.to_vector(), c.b, c.ta, c.tb, want_shape);
    const auto got = tg::matmul(a, b, c.ta, c.tb);
    REQUIRE(got.shape() == want_shape);
    tops::check_close(got.to_vector(), want, 1e-12, "f64 values");
    const auto got32 = tg::matmul(tg::cast<float>(a), tg::cast<float>(b), c.ta, c.tb);
    tops::check_close(tops::host(got32), want, 2e-5, "f32 values");
    const auto got16 = tg::cast<float>(tg::matmul(tg::cast<tg::bf16>(a), tg::cast<tg::bf16>(b), c.ta, c.tb));
    tops::check_close(tops::host(got16), want, 0.05, "bf16 values");
    tops::check_fd("batched matmul", tops::Leaves3<double>{a, b, tg::zeros<double, D>({})},
                   [&](const tops::Leaves3<double>& p) { return tg::matmul(p.a, p.b, c.ta, c.tb); });
  }
  CHECK_THROWS_WITH(tg::matmul(tops::dnormal(1, {2, 3, 4}), tops::dnormal(2, {2, 5, 6})), Contains("inner dims differ"));
  CHECK_THROWS_WITH(tg::matmul(tops::dnormal(1, {2, 3, 4}), tops::dnormal(2, {3, 4, 6})), Contains("cannot be broadcast"));
  CHECK_THROWS_WITH(tg::matmul(tops::dnormal(1, {4}), tops::dnormal(2, {4, 6})), Contains("rank >= 2"));
}

TEST_CASE("layer_norm normalises the last axis as flax's LayerNorm, with finite-difference gradients", "[ops][transformer][layer_norm]") {
  const std::int64_t rows = 37, n = 24;  // rows not a multiple of the backward's chunk
  const auto x = tops::dnormal(3, {rows, n}, 2.0, 0.5), scale = tops::dnormal(4, {n}, 0.5, 1.0), bias = tops::dnormal(5, {n});
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
  tops::check_close(y, want, 1e-13, "layer_norm f64");
  tops::check_close(tops::host(tg::layer_norm(tg::cast<float>(x), tg::cast<float>(scale), tg::cast<float>(bias), eps)), want, 1e-5, "layer_norm f32");
  // bf16: statistics in f32, so the result is the f32 computation on the bf16 inputs, rounded once.
  const auto xb = tg::cast<tg::bf16>(x), sb = tg::cast<tg::bf16>(scale), bb = tg::cast<tg::bf16>(bias);
  const auto yb = tg::cast<float>(tg::layer_norm(xb, sb, bb, eps)).to_vector();
  const auto yf = tg::cast<float>(tg::cast<tg::bf16>(tg::layer_norm(tg::cast<float>(xb), tg::cast<float>(sb), tg::cast<float>(bb), eps))).to_vector();
  CHECK(yb == yf);
  // Higher rank: the rows are every leading index.
  tops::check_fd("layer_norm", tops::Leaves3<double>{x.reshape({1, rows, n}), scale, bias},
                 [&](const tops::Leaves3<double>& p) { return tg::layer_norm(p.a, p.b, p.c, eps); });
  CHECK_THROWS_WITH(tg::layer_norm(x, tops::dnormal(1, {n + 1}), bias), Contains("layer_norm") && Contains("scale and bias must have shape (24,)"));
}

TEST_CASE("dropout is jax.random.bernoulli's mask, deterministic given the key, the identity at rate 0", "[ops][transformer][dropout]") {
  const auto x = tops::dnormal(6, {64, 33});
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
  tops::check_fd("dropout", x, [&](const tg::Tensor<double, D>& p) { return tg::dropout(key, p, rate); });
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

TEST_CASE("slice_in_dim, index_in_dim and take read as JAX, and their gradients scatter back", "[ops][transformer][indexing]") {
  const auto x = tops::dnormal(7, {3, 7, 4});
  const auto s = tg::slice_in_dim(x, 1, 6, 2, 1);  // positions 1, 3, 5
  REQUIRE(s.shape() == tg::Shape({3, 3, 4}));
  CHECK(s.at({2, 1, 3}) == x.at({2, 3, 3}));
  CHECK(tg::slice_in_dim(x, -3, 100, 1, 1).shape() == tg::Shape({3, 3, 4}));  // clamped, negative from the end
  CHECK(tg::slice_in_dim(x, -3, 100, 1, 1).at({0, 0, 0}) == x.at({0, 4, 0}));
  CHECK(tg::slice_in_dim(x, 5, 2, 1, 1).shape() == tg::Shape({3, 0, 4}));
  CHECK(tg::index_in_dim(x, -1, 1).shape() == tg::Shape({3, 4}));
  CHECK(tg::index_in_dim(x, -1, 1).at({1, 2}) == x.at({1, 6, 2}));
  tops::check_fd("slice_in_dim", x, [](const tg::Tensor<double, D>& p) { return tg::slice_in_dim(p, 1, 6, 2, 1); });
  tops::check_fd("index_in_dim", x, [](const tg::Tensor<double, D>& p) { return tg::index_in_dim(p, 2, -1); });

  const auto idx = tg::from_vector<D>(std::vector<std::int32_t>{4, -1, 0, 4, 2, 9}, {2, 3});
  const auto t = tg::take(x, idx, 1);
  REQUIRE(t.shape() == tg::Shape({3, 2, 3, 4}));
  CHECK(t.at({1, 0, 0, 2}) == x.at({1, 4, 2}));
  CHECK(t.at({1, 0, 1, 2}) == x.at({1, 6, 2}));  // -1: the last
  CHECK(std::isnan(t.at({0, 1, 2, 0})));          // 9 is out of range: NaN, as jnp.take's mode "fill"
  const auto in_range = tg::from_vector<D>(std::vector<std::int32_t>{4, -1, 0, 4, 2}, {5});  // 4 twice: cotangents add
  tops::check_fd("take", x, [&](const tg::Tensor<double, D>& p) { return tg::take(p, in_range, 1); });
  tops::check_fd("take axis 0", x, [&](const tg::Tensor<double, D>& p) {
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
  const auto table = tops::dnormal(41, {vocab, dim});
  const auto w = tops::dnormal(42, {tokens, dim});
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
  const auto a = tops::dnormal(8, {2, 3, 4}), b = tops::dnormal(9, {2, 5, 4}), c = tops::dnormal(10, {2, 1, 4});
  const auto j = tg::concatenate({a, b, c}, 1);
  REQUIRE(j.shape() == tg::Shape({2, 9, 4}));
  CHECK(j.at({1, 2, 3}) == a.at({1, 2, 3}));
  CHECK(j.at({1, 4, 0}) == b.at({1, 1, 0}));
  CHECK(j.at({0, 8, 2}) == c.at({0, 0, 2}));
  tops::check_fd("concatenate", tops::Leaves3<double>{a, b, c},
                 [](const tops::Leaves3<double>& p) { return tg::concatenate({p.a, p.b, p.c}, -2); });
  const auto b2 = tops::dnormal(11, {2, 3, 4}), c2 = tops::dnormal(12, {2, 3, 4});
  const auto st = tg::stack({a, b2, c2}, -1);
  REQUIRE(st.shape() == tg::Shape({2, 3, 4, 3}));
  CHECK(st.at({1, 2, 3, 1}) == b2.at({1, 2, 3}));
  CHECK(tg::stack({a, b2}, 0).shape() == tg::Shape({2, 2, 3, 4}));
  tops::check_fd("stack", tops::Leaves3<double>{a, b2, c2},
                 [](const tops::Leaves3<double>& p) { return tg::stack({p.a, p.b, p.c}, 1); });
  // A tensor used twice: both cotangents arrive.
  tops::check_fd("concatenate with repeats", a, [](const tg::Tensor<double, D>& p) { return tg::concatenate({p, p}, 0); });
  CHECK_THROWS_WITH(tg::concatenate({a, tops::dnormal(1, {3, 3, 4})}, 1), Contains("tensor 1 has shape (3, 3, 4)"));
  CHECK_THROWS_WITH(tg::stack({a, b}, 0), Contains("stacked tensors must have one shape"));
}

#if !defined(TG_TEST_CUDA)
TEST_CASE("the per-element index functors CUDA runs equal the CPU's row forms", "[ops][transformer][indexing]") {
  // CUDA launches a thread per element (PermuteFn, SliceFn, ... operator()); the CPU copies rows. Run
  // the element forms here on the CPU and compare with the ops.
  const auto x = tops::dnormal(21, {3, 5, 4, 6});
  const auto y = tg::transpose(x, {2, 0, 3, 1});
  tg::detail::PermuteFn<double> f{};
  const auto st = tops::strides(x.shape());
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

namespace tops {

/// jnp.einsum in double by the definition: every assignment of the indices, products summed.
inline std::vector<double> ref_einsum(const std::string& spec, const tg::Tensor<double, D>& a, const tg::Tensor<double, D>& b) {
  const auto arrow = spec.find("->"), comma = spec.find(',');
  const std::string la = spec.substr(0, comma), lb = spec.substr(comma + 1, arrow - comma - 1), lo = spec.substr(arrow + 2);
  std::string all;
  std::map<char, std::int64_t> size;
  for (std::size_t i = 0; i < la.size(); ++i) size[la[i]] = a.dim(static_cast<int>(i));
  for (std::size_t i = 0; i < lb.size(); ++i) size[lb[i]] = b.dim(static_cast<int>(i));
  for (const auto& [c, n] : size) all += c;
  const auto av = a.to_vector(), bv = b.to_vector();
  auto offset = [&](const std::string& term, const std::map<char, std::int64_t>& at) {
    std::int64_t off = 0;
    for (char c : term) off = off * size[c] + at.at(c);
    return off;
  };
  std::int64_t out_size = 1;
  for (char c : lo) out_size *= size[c];
  std::vector<double> out(static_cast<std::size_t>(out_size), 0.0);
  std::map<char, std::int64_t> at;
  for (char c : all) at[c] = 0;
  while (true) {
    out[static_cast<std::size_t>(offset(lo, at))] += av[static_cast<std::size_t>(offset(la, at))] * bv[static_cast<std::size_t>(offset(lb, at))];
    int i = static_cast<int>(all.size()) - 1;
    for (; i >= 0; --i) {
      if (++at[all[static_cast<std::size_t>(i)]] < size[all[static_cast<std::size_t>(i)]]) break;
      at[all[static_cast<std::size_t>(i)]] = 0;
    }
    if (i < 0) break;
  }
  return out;
}

/// The CPU kernels a function records (as tg::compile counts them).
template <class F>
std::size_t kernels_of(F f) {
  tg::detail::Recorder recorder;
  {
    tg::detail::ActiveRecorder active(recorder);
    (void)f();
  }
  return recorder.cpu_kernels.size();
}

}  // namespace tops

TEST_CASE("einsum of two operands equals the definition, in one GEMM, with finite-difference gradients", "[ops][transformer][einsum]") {
  struct Case {
    std::string spec;
    tg::Shape a, b;
  };
  const std::vector<Case> cases = {
      {"ij,jk->ik", {3, 4}, {4, 5}},              // a matmul
      {"bhqd,bhkd->bhqk", {2, 3, 4, 5}, {2, 3, 6, 5}},  // attention's scores: k read transposed in place
      {"bhqk,bhkd->bhqd", {2, 3, 4, 6}, {2, 3, 6, 5}},  // attention's weighted values
      {"ik,jk->ij", {3, 4}, {5, 4}},
      {"ki,kj->ij", {4, 3}, {4, 5}},
      {"bij,bjk->bki", {2, 3, 4}, {2, 4, 5}},     // the output permuted
      {"ij,k->ijk", {2, 3}, {4}},                 // an outer product: nothing contracted
      {"abc,cd->ad", {2, 3, 4}, {4, 5}},          // b appears once: summed first
      {"ij,ij->i", {3, 4}, {3, 4}},               // a batch of dot products
      {"bqhd,bkhd->bhqk", {2, 4, 3, 5}, {2, 6, 3, 5}},  // flax's layout: both operands transposed first
      {"...qd,...kd->...qk", {2, 3, 4, 5}, {2, 3, 6, 5}},
      {"...qd,kd->...qk", {2, 3, 4, 5}, {6, 5}},  // "..." in one operand only: its own rows
  };
  for (const auto& c : cases) {
    INFO(c.spec);
    const auto a = tops::dnormal(31, c.a), b = tops::dnormal(32, c.b);
    const auto y = tg::einsum(c.spec, a, b);
    std::string plain = c.spec;
    if (plain.find("...") != std::string::npos) continue;  // the reference reads letters only; the ellipsis cases are checked below
    const auto want = tops::ref_einsum(plain, a, b);
    const auto have = y.to_vector();
    REQUIRE(have.size() == want.size());
    double worst = 0;
    for (std::size_t i = 0; i < have.size(); ++i) worst = std::max(worst, std::fabs(have[i] - want[i]) / (1.0 + std::fabs(want[i])));
    CHECK(worst < 1e-13);  // f64, summed in another order than the definition's
    tops::check_fd(c.spec.c_str(), tops::Leaves3<double>{a, b, b},
                   [&](const tops::Leaves3<double>& p) { return tg::einsum(c.spec, p.a, p.b); });
  }
  // The ellipsis is the leading axes: the same as the letters written out.
  const auto q = tops::dnormal(33, {2, 3, 4, 5}), k = tops::dnormal(34, {2, 3, 6, 5}), w = tops::dnormal(35, {6, 5});
  CHECK(tg::einsum("...qd,...kd->...qk", q, k).to_vector() == tg::einsum("bhqd,bhkd->bhqk", q, k).to_vector());
  CHECK(tg::einsum("...qd,kd->...qk", q, w).to_vector() == tg::einsum("bhqd,kd->bhqk", q, w).to_vector());
  // In f32, attention's scores are exactly matmul(q, k, false, true): the same strided-batched GEMM.
  const auto qf = tg::cast<float>(q), kf = tg::cast<float>(k);
  CHECK(tg::einsum("bhqd,bhkd->bhqk", qf, kf).to_vector() == tg::matmul(qf, kf, false, true).to_vector());
  CHECK(tg::einsum("bhqd,bhkd->bhqk", qf, kf).to_vector() == tg::matmul(qf, tg::swapaxes(kf, -1, -2)).to_vector());
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    // One GEMM and nothing else when the operands' layout allows it; transposes only where it does not.
    CHECK(tops::kernels_of([&] { return tg::einsum("bhqd,bhkd->bhqk", qf, kf); }) == 1);
    CHECK(tops::kernels_of([&] { return tg::einsum("bhqk,bhkd->bhqd", tg::einsum("bhqd,bhkd->bhqk", qf, kf), kf); }) == 2);
    const auto kf2 = tg::cast<float>(tops::dnormal(36, {2, 6, 4, 5}));
    CHECK(tops::kernels_of([&] { return tg::einsum("bqhd,bkhd->bhqk", qf, kf2); }) == 3);  // both transposed first
  }
  // Errors name the spec and what is wrong.
  CHECK_THROWS_WITH(tg::einsum("ij,jk", q, k), Contains("[einsum] 'ij,jk' has no '->'"));
  CHECK_THROWS_WITH(tg::einsum("ij,jk,kl->il", q, k), Contains("exactly two operands"));
  CHECK_THROWS_WITH(tg::einsum("abc,abed->abce", q, k), Contains("the first operand has rank 4 but 3 indices"));
  CHECK_THROWS_WITH(tg::einsum("aacd,abed->abce", q, k), Contains("index 'a' appears twice in one term"));
  CHECK_THROWS_WITH(tg::einsum("abcd,abed->abcz", q, k), Contains("the output's index 'z' is in neither operand"));
  CHECK_THROWS_WITH(tg::einsum("ab1d,abed->abce", q, k), Contains("'1' is not an index"));
  CHECK_THROWS_WITH(tg::einsum("abcd,abcd->abd", q, tops::dnormal(1, {2, 3, 7, 5})), Contains("index 'c' has size 4 in (2, 3, 4, 5) but 7"));
}

namespace tops {

/// jax.nn.dot_product_attention written out: einsum, scale, where(mask, s, large negative), softmax, einsum.
template <class T>
tg::Tensor<T, D> ref_attention(const tg::Tensor<T, D>& q, const tg::Tensor<T, D>& k, const tg::Tensor<T, D>& v, const tg::Tensor<std::uint8_t, D>* mask,
                               bool causal, double scale) {
  auto s = tg::einsum("btnh,bsnh->bnts", q, k) * scale;
  const std::int64_t T_ = q.dim(1), S_ = k.dim(1);
  std::vector<std::uint8_t> allowed(static_cast<std::size_t>(T_ * S_), 1);
  if (causal)
    for (std::int64_t i = 0; i < T_; ++i)
      for (std::int64_t j = i + 1; j < S_; ++j) allowed[static_cast<std::size_t>(i * S_ + j)] = 0;
  auto m = tg::from_vector<D>(allowed, {T_, S_});
  if (mask) m = tg::mul(m, *mask);
  const auto neg = tg::full<T, D>({}, tg::detail::convert_to<T>(tg::detail::masked_logit<tg::compute_t<T>>()));
  return tg::einsum("bnts,bsnh->btnh", tg::softmax(tg::where(m, s, neg)), v);
}

}  // namespace tops

TEST_CASE("dot_product_attention equals softmax(scale q k^T) v written out, with masks, causal, and finite-difference gradients",
          "[ops][transformer][attention]") {
  const std::int64_t B = 2, T_ = 5, S_ = 7, N = 3, H = 4;
  const auto q = tops::dnormal(51, {B, T_, N, H}), k = tops::dnormal(52, {B, S_, N, H}), v = tops::dnormal(53, {B, S_, N, H});
  // A mask over (B, 1, 1, S): the last two keys of batch 1 are padding.
  std::vector<std::uint8_t> pad(static_cast<std::size_t>(B * S_), 1);
  pad[static_cast<std::size_t>(S_ + 5)] = pad[static_cast<std::size_t>(S_ + 6)] = 0;
  const auto mask = tg::from_vector<D>(pad, {B, 1, 1, S_});
  using Impl = tg::AttentionImplementation;
  for (const Impl impl : {Impl::composed, Impl::fused})
    for (const bool causal : {false, true})
      for (const bool masked : {false, true}) {
        INFO("implementation " << static_cast<int>(impl) << ", causal " << causal << ", masked " << masked);
        const tg::AttentionOptions o{.scale = 0.37, .is_causal = causal, .implementation = impl};
        const auto ours = masked ? tg::dot_product_attention(q, k, v, mask, o) : tg::dot_product_attention(q, k, v, o);
        const auto ref = tops::ref_attention(q, k, v, masked ? &mask : nullptr, causal, 0.37);
        REQUIRE(ours.shape() == tg::Shape({B, T_, N, H}));
        const auto a = ours.to_vector(), r = ref.to_vector();
        double worst = 0;
        for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - r[i]));
        CHECK(worst < 1e-13);  // f64, summed in another order than the GEMMs'
        // A step of 1e-5: at 1e-6 the central differences of this sum carry ~3e-6 relative rounding noise
        // (measured: every order and mode passes at 1e-4 and 1e-5 with errors of 2e-7, fails at 1e-6 and 1e-7).
        tops::check_fd("dot_product_attention", tops::Leaves3<double>{q, k, v}, [&](const tops::Leaves3<double>& p) {
          return masked ? tg::dot_product_attention(p.a, p.b, p.c, mask, o) : tg::dot_product_attention(p.a, p.b, p.c, o);
        }, 1e-5);
      }
#if !defined(TG_TEST_CUDA)
  // The fused kernels' GPU form (a query row per item forward; query rows and key rows backward), run
  // here on the CPU: the same values and gradients as the CPU's (batch, head) blocks, to rounding.
  {
    const auto w = tops::dnormal(54, {B, T_, N, H});
    for (const bool causal : {false, true})
      for (const bool masked : {false, true}) {
        INFO("GPU form, causal " << causal << ", masked " << masked);
        const tg::AttentionOptions o{.scale = 0.37, .is_causal = causal};
        const auto d = tg::detail::attention_dims(q, k, v, masked ? &mask : nullptr, o, "test");
        auto loss = [&]<bool ByBlock>(std::bool_constant<ByBlock>) {
          return tg::value_and_grad([&](const tops::Leaves3<double>& p) {
            return tg::sum(tg::detail::attention_fused<double, tg::Cpu, ByBlock>(p.a, p.b, p.c, masked ? &mask : nullptr, d) * w);
          })(tops::Leaves3<double>{q, k, v});
        };
        const auto [blocks, g_blocks] = loss(std::true_type{});
        const auto [rows, g_rows] = loss(std::false_type{});
        CHECK(rows.item() == Approx(blocks.item()).epsilon(1e-13));
        std::string why;
        CHECK(tg::tree_all_close(g_rows, g_blocks, 1e-12, 1e-13, &why));
        INFO(why);
      }
  }
#endif
  // The default scale is 1 / sqrt(head_dim); the batch axis may be left out.
  const auto def = tg::dot_product_attention(q, k, v).to_vector(), half = tops::ref_attention(q, k, v, nullptr, false, 0.5).to_vector();
  for (std::size_t i = 0; i < def.size(); ++i) CHECK(def[i] == Approx(half[i]).margin(1e-13));
  const auto unbatched = tg::dot_product_attention(tg::index_in_dim(q, 1), tg::index_in_dim(k, 1), tg::index_in_dim(v, 1));
  CHECK(unbatched.to_vector() == tg::index_in_dim(tg::dot_product_attention(q, k, v), 1).to_vector());
  // A query row with every key masked attends to all keys evenly, as JAX's large negative logit makes it.
  const auto none = tg::zeros<std::uint8_t, D>({1, 1, 1, S_});
  const auto even = tg::dot_product_attention(q, k, v, none).to_vector(), mean_v = tg::mean(v, 1, true).to_vector();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t c = 0; c < N * H; ++c)
      CHECK(even[static_cast<std::size_t>((b * T_ + 3) * N * H + c)] == Approx(mean_v[static_cast<std::size_t>(b * N * H + c)]).margin(1e-13));
  // f32 and bf16 within their rounding of the f64 result; bf16's statistics in f32.
  const auto ref64 = tops::ref_attention(q, k, v, &mask, true, 0.5).to_vector();
  for (const Impl impl : {Impl::composed, Impl::fused}) {
    INFO("implementation " << static_cast<int>(impl));
    const tg::AttentionOptions o{.is_causal = true, .implementation = impl};
    const auto f32 = tg::dot_product_attention(tg::cast<float>(q), tg::cast<float>(k), tg::cast<float>(v), mask, o).to_vector();
    const auto b16 = tg::cast<float>(tg::dot_product_attention(tg::cast<tg::bf16>(q), tg::cast<tg::bf16>(k), tg::cast<tg::bf16>(v), mask, o)).to_vector();
    double worst32 = 0, worst16 = 0;
    for (std::size_t i = 0; i < ref64.size(); ++i)
      worst32 = std::max(worst32, std::fabs(f32[i] - ref64[i])), worst16 = std::max(worst16, std::fabs(b16[i] - ref64[i]));
    CHECK(worst32 < 1e-5);  // |v| < 5: a few f32 ulps of accumulation
    CHECK(worst16 < 0.05);  // inputs rounded to bf16 (2^-8 relative) and the output rounded once
  }
  // The weights, as flax's dot_product_attention_weights, sum to 1 over the keys and equal the softmax.
  const auto w = tg::dot_product_attention_weights(q, k, {.is_causal = true});
  REQUIRE(w.shape() == tg::Shape({B, N, T_, S_}));
  const auto sums = tg::sum(w, -1).to_vector();
  for (double s : sums) CHECK(s == Approx(1.0).margin(1e-14));
  CHECK(w.at({1, 2, 1, 2}) == 0.0);  // causal: query 1 does not see key 2
  // Errors name the op and the shapes.
  CHECK_THROWS_WITH(tg::dot_product_attention(q, tops::dnormal(1, {B, S_, N, H + 1}), v), Contains("[dot_product_attention] key and value must be"));
  CHECK_THROWS_WITH(tg::dot_product_attention(q, k, v, tg::zeros<std::uint8_t, D>({3, 1, 1, S_})), Contains("does not broadcast"));
  // head_dim above the fused kernels' 256: an error when asked for them, the composed form otherwise.
  const auto wide = tops::dnormal(1, {1, 2, 1, 300});
  CHECK_THROWS_WITH(tg::dot_product_attention(wide, wide, wide, {.implementation = tg::AttentionImplementation::fused}),
                    Contains("head_dim 300 is above the fused kernels' 256"));
  CHECK(tg::dot_product_attention(wide, wide, wide).shape() == wide.shape());
}
