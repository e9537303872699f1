// check_grads: reverse-mode gradients against central finite differences, leaf by leaf, reporting the
// worst leaf by path (jax.test_util.check_grads for C++ tests).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/autodiff/grad.hpp"
#include "tapegrad/random/random.hpp"

TG_BEGIN_NAMESPACE

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

template <class F, class Params, class ArgsTuple>
GradCheckResult check_grads_impl(F& f, const Params& params, ArgsTuple& args, const GradCheckOptions& o) {
  auto eval_exact = [&](const Params& p) {
    return std::apply([&](auto&... a) {
      const auto y = f(p, a...).item();
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(y)>, double>) return y;
      else return static_cast<double>(static_cast<float>(y));
    }, args);
  };
  const auto value_and_grads = std::apply([&](auto&... a) { return value_and_grad(f)(params, a...); }, args);
  const Params& grads = value_and_grads.second;
  using LossT = typename std::remove_cvref_t<decltype(value_and_grads.first)>::value_type;
  const double loss_epsilon = std::is_same_v<LossT, double> ? 0x1p-53 : std::is_same_v<LossT, float> ? 0x1p-24 : 0x1p-8;

  GradCheckResult result;
  std::int64_t index = 0;
  tree_for_each([&](const std::string& path, const auto& leaf, const auto& g) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    using T = typename L::value_type;
    const std::int64_t my_index = index++;
    if constexpr (FloatElement<T>) {
      LeafGradCheck c;
      c.path = path;
      const std::vector<T> base = leaf.to_vector();
      const std::vector<T> gv = g.to_vector();
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
      auto at = [&](const std::vector<double>& v) {
        std::vector<T> t(v.size());
        for (std::size_t i = 0; i < v.size(); ++i) t[i] = ::tg::detail::convert_to<T>(v[i]);
        Params p = params;
        set_leaf(p, my_index, t);
        return eval_exact(p);
      };
      std::vector<double> x(base.size());
      for (std::size_t i = 0; i < base.size(); ++i) x[i] = static_cast<double>(static_cast<compute_t<T>>(base[i]));
      if (leaf.size() <= o.max_elements) {
        for (std::size_t i = 0; i < x.size(); ++i) {
          std::vector<double> up = x, down = x;
          up[i] += o.eps;
          down[i] -= o.eps;
          measure(static_cast<double>(static_cast<compute_t<T>>(gv[i])), at(up), at(down));
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
            analytic += static_cast<double>(static_cast<compute_t<T>>(gv[i])) * dir[i];
          }
          measure(analytic, at(up), at(down));
        }
      }
      if (!c.passed()) result.passed = false;
      result.leaves.push_back(c);
    }
  }, params, grads);
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
/// change the step, tolerance or sampling. Returns the result (worst leaf first) and prints a summary.
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
