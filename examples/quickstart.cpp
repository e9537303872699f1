// quickstart: the devices tapegrad sees, and the codelab's first layer drawn exactly as JAX draws it.
#include <tapegrad/tapegrad.hpp>

#include <cmath>
#include <iostream>

int main() {
  std::cout << "tapegrad " << tg::version << "\nCUDA devices: " << tg::cuda::describe_devices() << "\n";

  // The draw behind a He-normal init of the 784 -> 256 layer: the same numbers as
  // k1, k2 = jax.random.split(jax.random.key(1)); jax.random.normal(k1, (784, 256)).
  const auto key = tg::random::key(1);
  const auto [k1, k2] = tg::random::split(key);
  const auto z = tg::random::normal(k1, {784, 256});
  std::cout << "w1 ~ N(0, 1): " << z << "\n";
  std::cout << "scale sqrt(2 / 784) = " << std::sqrt(2.0 / 784.0) << "\n";
  std::cout << "a shuffled index set: " << tg::random::permutation(k2, 60000) << "\n";
  return 0;
}
