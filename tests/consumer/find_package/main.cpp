// A user's program: includes the umbrella header and draws JAX's initial weights on the CPU.
#include <tapegrad/tapegrad.hpp>

#include <iostream>

int main() {
  const auto w = tg::random::normal(tg::random::key(1), {784, 256});
  if (w.shape() != tg::Shape{784, 256} || w.at({0, 0}) == 0.0f) return 1;
  std::cout << w << "\nconsumer ok: tapegrad " << tg::version << "\n";
  return 0;
}
