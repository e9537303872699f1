// check_grads: derivatives against central finite differences, leaf by leaf, reporting the worst leaf by
// path: reverse mode (grad), forward mode (jvp) and, to any order, the derivatives of those derivatives
// (jax.test_util.check_grads for C++ tests).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/autodiff/grad.hpp"
#include "tapegrad/autodiff/jvp.hpp"
#include "tapegrad/random/random.hpp"

TG_BEGIN_NAMESPACE

/// The modes check_grads compares (jax.test_util.check_grads's modes): tg::rev is grad (reverse mode),
/// tg::fwd is jvp (forward mode); combine them with |.
enum class GradMode : unsigned { fwd = 1, rev = 2 };
constexpr GradMode operator|(GradMode a, GradMode b) { return GradMode(static_cast<unsigned>(a) | static_cast<unsigned>(b)); }
constexpr bool has_mode(GradMode set, GradMode m) { return (static_cast<unsigned>(set) & static_cast<unsigned>(m)) != 0; }
inline constexpr GradMode fwd = GradMode::fwd;
inline constexpr GradMode rev = GradMode::rev;

/// Settings of check_grads. The defaults suit double-precision functions; for float32 use a larger step
/// (eps ~ 1e-3) and tolerance (rtol ~ 1e-2).
struct GradCheckOptions {
  double eps = 1e-6;                   ///< finite-difference step
  double rtol = 1e-6;                  ///< pass when |fd - ad| <= rtol * max(|fd|, |ad|) + the FD noise bound
  double noise_factor = 16;            ///< FD noise bound: this many ulps of f, divided by the step
  double floor = 1e-12;                ///< magnitude below which the reported relative error is absolute
  std::int64_t max_elements = 256;     ///< leaves up to this size are checked element by element...
  int directions = 8;                  ///< ...larger ones along this many random directions
  std::uint32_t seed = 0;              ///< for the random directions
  int order = 1;                       ///< 1: first derivatives; 2: also the derivatives of each mode's derivative; ...
  GradMode modes = rev;                ///< which modes: tg::rev, tg::fwd or tg::fwd | tg::rev
  bool print = true;                   ///< print the summary line (and every failing leaf) to std::cout
};

/// One leaf's comparison.
struct LeafGradCheck {
  std::string path;
  std::int64_t checks = 0;   ///< elements or directions compared
  bool directional = false;  ///< compared along random directions
  double worst_error = 0.0;  ///< relative error at the worst check
  double worst_ratio = 0.0;  ///< |fd - ad| over what is allowed there (passes when <= 1)
  double analytic = 0.0, numeric = 0.0;  ///< at the worst check
  bool passed() const { return worst_ratio <= 1.0; }
};

/// The result of check_grads: passed, and the leaves with the worst (relative to its tolerance) first.
struct GradCheckResult {
  bool passed = true;
  std::vector<LeafGradCheck> leaves;  ///< sorted, worst first
  const LeafGradCheck* worst() const { return leaves.empty() ? nullptr : &leaves.front(); }

  friend std::ostream& operator<<(std::ostream& os, const GradCheckResult& r) {
    os << "check_grads: " << (r.passed ? "passed" : "FAILED") << ", " << r.leaves.size() << " leaves";
    if (const auto* w = r.worst())
      os << "; worst leaf '" << w->path << "': relative error " << w->worst_error << " (analytic " << w->analytic
         << ", finite difference " << w->numeric << ", " << w->checks << (w->directional ? " directions)" : " elements)");
    return os;
  }
};

namespace detail {

template <class X> struct is_grad_check_options : std::is_same<std::remove_cvref_t<X>, GradCheckOptions> {};

/// Replaces leaf number `index` (in visit order) of `tree` with values `v`.
template <class Tree, class T>
void set_leaf(Tree& tree, std::int64_t index, const std::vector<T>& v) {
  std::int64_t i = 0;
  tree_for_each([&](const std::string&, auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (std::is_same_v<typename L::value_type, T>) {
      if (i == index) leaf = from_vector<typename L::device_type>(v, leaf.shape());
    }
    ++i;
  }, tree);
}

/// A scalar tensor's value in double, as its own type computes it (bf16 through float).
template <class Scalar>
double value_of(const Scalar& t) {
  const auto y = t.item();
  if constexpr (std::is_same_v<std::remove_cvref_t<decltype(y)>, double>) return y;
  else return static_cast<double>(static_cast<float>(y));
}

/// sum over the leaves of sum(a * b): a scalar of type T (traced where a is), to turn a derivative of
/// parameters' type into a scalar function whose derivative is the next order's.
template <class T, class Tree>
auto tree_vdot(const Tree& a, const Tree& b) {
  using D = tree_device_t<Tree>;
  Tensor<T, D> total = zeros<T, D>(Shape{});
  tree_for_each([&](const std::string&, const auto& x, const auto& y) {
    using L = std::remove_cvref_t<decltype(x)>;
    if constexpr (FloatElement<typename L::value_type>) total = add(total, cast<T>(sum(mul(x, y))));
  }, a, b);
  return total;
}

/// A tree like `params` of random normal leaves (a fixed direction for the higher orders).
template <class Params>
Params random_tree(const Params& params, std::uint32_t seed) {
  Params r = params;
  std::uint32_t i = 0;
  tree_for_each([&](const std::string&, auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    using T = typename L::value_type;
    if constexpr (FloatElement<T>)
      leaf = cast<T>(random::normal<double, typename L::device_type>(random::fold_in(random::key(seed), 7919 + i++), leaf.shape()));
  }, r);
  return r;
}

/// One mode's first derivatives of f against finite differences, appended to `result` (paths prefixed).
template <class Loss, class Params>
void check_first_order(const std::function<Loss(const Params&)>& f, const Params& params, const GradCheckOptions& o, GradMode mode,
                       const std::string& prefix, GradCheckResult& result) {
  auto eval_exact = [&](const Params& p) { return value_of(f(p)); };
  using LossT = typename Loss::value_type;
  const double loss_epsilon = std::is_same_v<LossT, double> ? 0x1p-53 : std::is_same_v<LossT, float> ? 0x1p-24 : 0x1p-8;
  // Reverse mode: the gradient, read element by element (or along directions). Forward mode: one jvp per
  // element (or direction), each a backward pass over one linearisation.
  Params grads = params;
  std::function<double(const Params&)> directional;
  if (mode == GradMode::rev) {
    grads = grad(f)(params);
  } else {
    auto lin = linearize(f, params);
    directional = [f_jvp = std::move(lin.second)](const Params& t) { return value_of(f_jvp(t)); };
  }
  const Params zero = tree_zeros_like(params);

  std::int64_t index = 0;
  tree_for_each([&](const std::string& path, const auto& leaf, const auto& g) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    using T = typename L::value_type;
    const std::int64_t my_index = index++;
    if constexpr (FloatElement<T>) {
      LeafGradCheck c;
      c.path = prefix + path;
      const std::vector<T> base = leaf.to_vector();
      const std::vector<T> gv = mode == GradMode::rev ? g.to_vector() : std::vector<T>{};
      // A central difference of f evaluated in its dtype carries rounding noise of about
      // ulp(f) / step; the check allows noise_factor of those on top of the relative tolerance.
      auto measure = [&](double analytic, double f_up, double f_down) {
        const double numeric = (f_up - f_down) / (2 * o.eps);
        const double diff = std::fabs(analytic - numeric), scale = std::max(std::fabs(analytic), std::fabs(numeric));
        const double noise = o.noise_factor * loss_epsilon * (std::fabs(f_up) + std::fabs(f_down)) / (2 * o.eps);
        const double ratio = diff / (o.rtol * scale + noise);
        if (ratio >= c.worst_ratio)
          c.worst_ratio = ratio, c.worst_error = diff / std::max(scale, o.floor), c.analytic = analytic, c.numeric = numeric;
        ++c.checks;
      };
      auto to_leaf = [&](const std::vector<double>& v) {
        std::vector<T> t(v.size());
        for (std::size_t i = 0; i < v.size(); ++i) t[i] = ::tg::detail::convert_to<T>(v[i]);
        return t;
      };
      auto at = [&](const std::vector<double>& v) {
        Params p = params;
        set_leaf(p, my_index, to_leaf(v));
        return eval_exact(p);
      };
      auto along = [&](const std::vector<double>& dir) {  // the forward-mode derivative along dir (this leaf only)
        Params t = zero;
        set_leaf(t, my_index, to_leaf(dir));
        return directional(t);
      };
      std::vector<double> x(base.size());
      for (std::size_t i = 0; i < base.size(); ++i) x[i] = static_cast<double>(static_cast<compute_t<T>>(base[i]));
      if (leaf.size() <= o.max_elements) {
        for (std::size_t i = 0; i < x.size(); ++i) {
          std::vector<double> up = x, down = x;
          up[i] += o.eps;
          down[i] -= o.eps;
          double analytic = 0.0;
          if (mode == GradMode::rev) {
            analytic = static_cast<double>(static_cast<compute_t<T>>(gv[i]));
          } else {
            std::vector<double> e(x.size(), 0.0);
            e[i] = 1.0;
            analytic = along(e);
          }
          measure(analytic, at(up), at(down));
        }
      } else {
        c.directional = true;
        for (int d = 0; d < o.directions; ++d) {
          const auto dir = random::normal<double>(random::fold_in(random::key(o.seed), static_cast<std::uint32_t>(my_index * 1000 + d)),
                                                  leaf.shape()).to_vector();
          std::vector<double> up = x, down = x;
          double analytic = 0.0;
          for (std::size_t i = 0; i < x.size(); ++i) {
            up[i] += o.eps * dir[i];
            down[i] -= o.eps * dir[i];
            if (mode == GradMode::rev) analytic += static_cast<double>(static_cast<compute_t<T>>(gv[i])) * dir[i];
          }
          if (mode == GradMode::fwd) analytic = along(dir);
          measure(analytic, at(up), at(down));
        }
      }
      if (!c.passed()) result.passed = false;
      result.leaves.push_back(c);
    }
  }, params, grads);
}

/// Every requested mode at this order, then (order > 1) the same checks, one order lower, of each mode's
/// derivative along a fixed random direction r: <grad f(p), r> (reverse) and jvp(f, p, r) (forward), as
/// jax.test_util.check_grads recurses.
/// (One function type for every order: the recursion instantiates nothing new.)
template <class Loss, class Params>
void check_orders(const std::function<Loss(const Params&)>& f, const Params& params, const GradCheckOptions& o, int order,
                  const std::string& prefix, GradCheckResult& result) {
  for (GradMode mode : {GradMode::rev, GradMode::fwd})
    if (has_mode(o.modes, mode)) {
      // Leaves are named by mode too, except in the plain reverse-mode first-order check (paths alone).
      const bool named = o.order > 1 || has_mode(o.modes, GradMode::fwd);
      check_first_order(f, params, o, mode, prefix + (!named ? "" : mode == GradMode::rev ? "rev " : "fwd "), result);
    }
  if (order <= 1) return;
  const Params r = random_tree(params, o.seed + 101u * static_cast<std::uint32_t>(order));
  if (has_mode(o.modes, GradMode::rev)) {
    const std::function<Loss(const Params&)> h = [&](const Params& p) { return tree_vdot<typename Loss::value_type>(grad(f)(p), r); };
    check_orders(h, params, o, order - 1, prefix + "d(rev) ", result);
  }
  if (has_mode(o.modes, GradMode::fwd)) {
    const std::function<Loss(const Params&)> h = [&](const Params& p) { return jvp(f, p, r).second; };
    check_orders(h, params, o, order - 1, prefix + "d(fwd) ", result);
  }
}

template <class F, class Params, class ArgsTuple>
GradCheckResult check_grads_impl(F& f, const Params& params, ArgsTuple& args, const GradCheckOptions& o) {
  using Loss = std::remove_cvref_t<decltype(std::apply([&](auto&... a) { return f(params, a...); }, args))>;
  const std::function<Loss(const Params&)> g = [&](const Params& p) { return std::apply([&](auto&... a) { return f(p, a...); }, args); };
  TG_CHECK(o.order >= 1, "check_grads", "order must be >= 1, got ", o.order);
  TG_CHECK(has_mode(o.modes, GradMode::rev) || has_mode(o.modes, GradMode::fwd), "check_grads", "modes must name tg::rev, tg::fwd or both");
  GradCheckResult result;
  check_orders(g, params, o, o.order, "", result);
  std::sort(result.leaves.begin(), result.leaves.end(),
            [](const LeafGradCheck& a, const LeafGradCheck& b) { return a.worst_ratio > b.worst_ratio; });
  if (o.print) {
    std::cout << result << "\n";
    for (const auto& c : result.leaves)
      if (!c.passed())
        std::cout << "  '" << c.path << "': relative error " << c.worst_error << ", " << c.worst_ratio
                  << "x the tolerance (analytic " << c.analytic << ", finite difference " << c.numeric << ")\n";
  }
  return result;
}

}  // namespace detail

/// Compares grad(f)(params, args...) with central finite differences in double precision: every element
/// of small leaves, random directions for large ones. Pass GradCheckOptions as the last argument to
/// change the step, tolerance or sampling, and `order` / `modes` to check forward mode and higher orders
/// as jax.test_util.check_grads(f, args, order, modes) does (leaves then named "rev w1", "fwd w1",
/// "d(rev) fwd w1", ...). Returns the result (worst leaf first) and prints a summary.
template <class F, class Params, class... Args>
GradCheckResult check_grads(F f, const Params& params, Args&&... args) {
  if constexpr (sizeof...(Args) > 0 && detail::is_grad_check_options<std::tuple_element_t<sizeof...(Args) - 1, std::tuple<Args...>>>::value) {
    auto all = std::forward_as_tuple(std::forward<Args>(args)...);
    const GradCheckOptions options = std::get<sizeof...(Args) - 1>(all);
    auto front = [&]<std::size_t... I>(std::index_sequence<I...>) { return std::make_tuple(std::get<I>(all)...); }(
        std::make_index_sequence<sizeof...(Args) - 1>{});
    return detail::check_grads_impl(f, params, front, options);
  } else {
    auto all = std::make_tuple(std::forward<Args>(args)...);
    return detail::check_grads_impl(f, params, all, GradCheckOptions{});
  }
}

TG_END_NAMESPACE
