// Schedules: TG_HD value functors of the step count, so an update evaluates them on the device.
// Names, formulas and argument handling follow optax/schedules/_schedule.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"

TG_BEGIN_NAMESPACE
namespace optim {

/// A schedule: a copyable value with TG_HD double operator()(int64 count).
template <class S>
concept Schedule = requires(const S s, std::int64_t c) {
  { s(c) } -> std::convertible_to<double>;
};

/// value, at every step.
struct ConstantSchedule {
  double value = 0.0;
  TG_HD double operator()(std::int64_t) const { return value; }
};
inline ConstantSchedule constant_schedule(double value) { return {value}; }

/// (init - end) (1 - t/T)^power + end over T steps after `begin`; init before, end after.
struct PolynomialSchedule {
  double init_value = 0.0, end_value = 0.0, power = 1.0;
  std::int64_t transition_steps = 1, transition_begin = 0;
  TG_HD double operator()(std::int64_t count) const {
    if (transition_steps <= 0) return init_value;  // optax: a constant schedule
    std::int64_t c = count - transition_begin;
    c = c < 0 ? 0 : (c > transition_steps ? transition_steps : c);
    const double frac = 1.0 - static_cast<double>(c) / static_cast<double>(transition_steps);
    return (init_value - end_value) * ::pow(frac, power) + end_value;
  }
};

/// optax.polynomial_schedule: non-positive transition_steps gives a constant init_value; a negative
/// transition_begin falls back to 0 (as optax).
inline PolynomialSchedule polynomial_schedule(double init_value, double end_value, double power, std::int64_t transition_steps,
                                              std::int64_t transition_begin = 0) {
  return {init_value, end_value, power, transition_steps, transition_begin < 0 ? 0 : transition_begin};
}

/// optax.linear_schedule: polynomial_schedule with power 1.
inline PolynomialSchedule linear_schedule(double init_value, double end_value, std::int64_t transition_steps,
                                          std::int64_t transition_begin = 0) {
  return polynomial_schedule(init_value, end_value, 1.0, transition_steps, transition_begin);
}

/// init * ((1 - alpha) (0.5 (1 + cos(pi min(t, T) / T)))^exponent + alpha).
struct CosineDecaySchedule {
  double init_value = 0.0;
  std::int64_t decay_steps = 1;
  double alpha = 0.0, exponent = 1.0;
  TG_HD double operator()(std::int64_t count) const {
    const double c = static_cast<double>(count < decay_steps ? count : decay_steps);
    const double cosine = 0.5 * (1.0 + ::cos(3.141592653589793 * c / static_cast<double>(decay_steps)));
    return init_value * ((1.0 - alpha) * ::pow(cosine, exponent) + alpha);
  }
};

/// optax.cosine_decay_schedule; decay_steps must be positive.
inline CosineDecaySchedule cosine_decay_schedule(double init_value, std::int64_t decay_steps, double alpha = 0.0,
                                                 double exponent = 1.0) {
  TG_CHECK(decay_steps > 0, "cosine_decay_schedule", "requires positive decay_steps, got ", decay_steps);
  return {init_value, decay_steps, alpha, exponent};
}

/// init * rate^((t - begin) / T) after `begin` (floored with staircase), clipped at end_value if given.
struct ExponentialDecaySchedule {
  double init_value = 0.0;
  std::int64_t transition_steps = 1;
  double decay_rate = 1.0;
  std::int64_t transition_begin = 0;
  bool staircase = false;
  bool has_end = false;
  double end_value = 0.0;
  TG_HD double operator()(std::int64_t count) const {
    if (transition_steps <= 0 || decay_rate == 0.0) return init_value;  // optax: a constant schedule
    const std::int64_t decreased = count - transition_begin;
    double p = static_cast<double>(decreased) / static_cast<double>(transition_steps);
    if (staircase) p = ::floor(p);
    double v = decreased <= 0 ? init_value : init_value * ::pow(decay_rate, p);
    if (has_end) v = decay_rate < 1.0 ? (v > end_value ? v : end_value) : (v < end_value ? v : end_value);
    return v;
  }
};

/// optax.exponential_decay: non-positive transition_steps or a zero decay_rate give a constant
/// init_value, a negative transition_begin falls back to 0 (as optax). Pass end_value to clip.
inline ExponentialDecaySchedule exponential_decay(double init_value, std::int64_t transition_steps, double decay_rate,
                                                  std::int64_t transition_begin = 0, bool staircase = false) {
  return {init_value, transition_steps, decay_rate, transition_begin < 0 ? 0 : transition_begin, staircase, false, 0.0};
}
inline ExponentialDecaySchedule exponential_decay(double init_value, std::int64_t transition_steps, double decay_rate,
                                                  std::int64_t transition_begin, bool staircase, double end_value) {
  auto s = exponential_decay(init_value, transition_steps, decay_rate, transition_begin, staircase);
  s.has_end = true;
  s.end_value = end_value;
  return s;
}

/// init scaled by every factor whose boundary the count has reached (up to 16 boundaries).
struct PiecewiseConstantSchedule {
  static constexpr int max_boundaries = 16;
  double init_value = 0.0;
  int n = 0;
  std::int64_t boundaries[max_boundaries] = {};
  double scales[max_boundaries] = {};
  TG_HD double operator()(std::int64_t count) const {
    double v = init_value;
    for (int i = 0; i < n; ++i)
      if (count >= boundaries[i]) v *= scales[i];
    return v;
  }
};

/// optax.piecewise_constant_schedule(init, {{step, scale}, ...}); scales must be non-negative.
inline PiecewiseConstantSchedule piecewise_constant_schedule(double init_value,
                                                             std::initializer_list<std::pair<std::int64_t, double>> boundaries_and_scales = {}) {
  PiecewiseConstantSchedule s;
  s.init_value = init_value;
  TG_CHECK(boundaries_and_scales.size() <= PiecewiseConstantSchedule::max_boundaries, "piecewise_constant_schedule",
           "at most ", PiecewiseConstantSchedule::max_boundaries, " boundaries, got ", boundaries_and_scales.size());
  for (const auto& [b, scale] : boundaries_and_scales) {
    TG_CHECK(scale >= 0.0, "piecewise_constant_schedule", "expects non-negative scale factors, got ", scale, " at step ", b);
    // Keep them sorted by boundary, as optax iterates sorted(items()).
    int i = s.n++;
    while (i > 0 && s.boundaries[i - 1] > b) {
      s.boundaries[i] = s.boundaries[i - 1];
      s.scales[i] = s.scales[i - 1];
      --i;
    }
    s.boundaries[i] = b;
    s.scales[i] = scale;
  }
  return s;
}

/// `first` before `boundary`, then `second` counted from the boundary (optax.join_schedules).
template <Schedule A, Schedule B>
struct JoinedSchedule {
  A first;
  B second;
  std::int64_t boundary = 0;
  TG_HD double operator()(std::int64_t count) const { return count < boundary ? first(count) : second(count - boundary); }
};

namespace detail {
/// Boundaries of a nested join count from the enclosing boundary; schedules pass through.
template <class X>
X shift_boundary(X x, std::int64_t offset) {
  if constexpr (std::is_integral_v<X>) return x - offset;
  else return x;
}
}  // namespace detail

/// join_schedules(s0, b1, s1, b2, s2, ...): s0 until step b1, then s1 counted from b1 until b2, then s2
/// counted from b2, and so on; boundaries are absolute steps, as optax.join_schedules.
template <Schedule A, Schedule B>
JoinedSchedule<A, B> join_schedules(A first, std::int64_t boundary, B second) {
  return {first, second, boundary};
}
template <Schedule A, Schedule B, Schedule C, class... Rest>
auto join_schedules(A first, std::int64_t b1, B second, std::int64_t b2, C third, Rest... rest) {
  TG_CHECK(b2 >= b1, "join_schedules", "boundaries must be increasing, got ", b1, " then ", b2);
  auto tail = join_schedules(second, b2 - b1, third, detail::shift_boundary(rest, b1)...);
  return JoinedSchedule<A, decltype(tail)>{first, tail, b1};
}

/// optax.warmup_cosine_decay_schedule: linear warm-up from init to peak over warmup_steps, then cosine
/// decay to end_value, reaching it at decay_steps (which counts the warm-up).
inline JoinedSchedule<PolynomialSchedule, CosineDecaySchedule> warmup_cosine_decay_schedule(
    double init_value, double peak_value, std::int64_t warmup_steps, std::int64_t decay_steps, double end_value = 0.0,
    double exponent = 1.0) {
  const double alpha = peak_value == 0.0 ? 0.0 : end_value / peak_value;
  return join_schedules(linear_schedule(init_value, peak_value, warmup_steps),
                        warmup_steps, cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent));
}

}  // namespace optim
TG_END_NAMESPACE
