// The privacy accountant of the DP-SGD example: epsilon at delta after a number of steps of the subsampled
// Gaussian mechanism, from its Renyi differential privacy at integer orders. Checked against Google's
// dp_accounting (dp_sgd_golden.json, ctest example_dp_sgd_golden).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace dp_sgd {

/// The privacy spent: epsilon at `delta` after `steps` steps of the subsampled Gaussian mechanism with
/// sampling rate q and noise multiplier sigma, from its Renyi DP at integer orders (Mironov, Talwar and
/// Zhang 2019, section 3.3: the binomial expansion, exact for Poisson sampling; what TensorFlow Privacy's
/// compute_rdp and Opacus's accountant compute), converted with the bound of Balle et al. 2020
/// (Opacus's get_privacy_spent). As JAX's DP example, the accounting treats the fixed batches as sampled.
inline double epsilon(double q, double sigma, std::int64_t steps, double delta) {
  double best = INFINITY;
  for (int alpha = 2; alpha <= 256; ++alpha) {
    // log A_alpha = log sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 sigma^2)), summed in logs.
    double log_a = -INFINITY;
    for (int k = 0; k <= alpha; ++k) {
      const double log_term = std::lgamma(alpha + 1.0) - std::lgamma(k + 1.0) - std::lgamma(alpha - k + 1.0) +
                              (alpha - k) * std::log1p(-q) + (k > 0 ? k * std::log(q) : 0.0) + (k * k - k) / (2 * sigma * sigma);
      const double hi = std::max(log_a, log_term);
      log_a = hi + std::log(std::exp(log_a - hi) + std::exp(log_term - hi));
    }
    const double rdp = static_cast<double>(steps) * log_a / (alpha - 1.0);
    const double eps = rdp + std::log1p(-1.0 / alpha) - (std::log(delta) + std::log(static_cast<double>(alpha))) / (alpha - 1.0);
    best = std::min(best, eps);
  }
  return std::max(best, 0.0);
}

}  // namespace dp_sgd
