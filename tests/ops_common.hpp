// What the op tests share (tests/test_<op family>.cpp): random inputs on the test device, double-precision
// references (matmul, einsum), closeness checks that print the first mismatches, the CPU kernels a function
// records, and the finite-difference checks of sum(op(...) * w) to second order in both modes.
#pragma once

#include "test_common.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace op_test {

using D = TestDevice;
namespace rnd = tg::random;

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<double>(static_cast<float>(v[i]));
  return r;
}
inline std::vector<double> as_double(const std::vector<double>& v) { return v; }

template <class T, class Dev>
std::vector<double> values(const tg::Tensor<T, Dev>& t) { return as_double(t.to_vector()); }

/// Random inputs on device D: normals (never exact zeros in practice), optionally shifted into a domain.
template <class T = float>
tg::Tensor<T, TestDevice> input(int seed, const tg::Shape& shape, double scale = 1.0, double shift = 0.0) {
  auto z = tg::random::normal<double>(tg::random::key(seed), shape).to_vector();
  std::vector<T> v(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) v[i] = tg::detail::convert_to<T>(z[i] * scale + shift);
  return tg::from_vector<TestDevice>(v, shape);
}

/// |got - want| <= atol + rtol |want| everywhere; otherwise the first mismatches are reported.
inline void check_close(const std::vector<double>& got, const std::vector<double>& want, double atol, double rtol,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const bool ok = err <= atol + rtol * std::fabs(want[i]) || (std::isnan(got[i]) && std::isnan(want[i]));
    worst = std::max(worst, err);
    if (!ok && ++bad <= 5) UNSCOPED_INFO(what << "[" << i << "]: got " << got[i] << ", want " << want[i]);
  }
  INFO(what << ": " << bad << " of " << got.size() << " outside atol " << atol << " + rtol " << rtol << " (worst |err| " << worst << ")");
  CHECK(bad == 0);
}

inline std::vector<double> ref_unary(const std::vector<double>& x, const std::function<double(double)>& f) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = f(x[i]);
  return y;
}

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

/// Two inputs for the op tests.
template <class T, class Dev>
struct AB {
  tg::Tensor<T, Dev> a, b;
};
TG_PYTREE(AB, a, b)

/// Checks the derivatives of sum(op(a, b) * w) for fixed random weights w, so every output element
/// matters differently, against finite differences in double: to second order, in forward and reverse
/// mode (grad, jvp, grad of grad, jvp of grad, grad of jvp, jvp of jvp), as JAX's tests check_grads(f,
/// args, order=2).
template <class Op>
void check_op(const char* name, Op op, AB<double, D> p) {
  INFO("op " << name);
  const auto w = dnormal(999, op(p.a, p.b).shape());
  auto f = [&](const AB<double, D>& q) { return tg::sum(tg::mul(op(q.a, q.b), w)); };
  const auto r = tg::check_grads(f, p, tg::GradCheckOptions{.order = 2, .modes = tg::fwd | tg::rev, .print = false});
  INFO(r);
  CHECK(r.passed);
  CHECK(r.leaves.size() == 12);  // 2 leaves x (rev, fwd, and rev and fwd of each of those)
}

}  // namespace op_test
