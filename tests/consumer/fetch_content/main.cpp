// A user's program built with a tapegrad fetched by FetchContent: a few AdamW steps on a quadratic.
#include <tapegrad/tapegrad.hpp>

#include <iostream>

struct Params {
  tg::Tensor<float> w;
};
TG_PYTREE(Params, w)

int main() {
  const auto loss = [](const Params& p) { return tg::sum(tg::square(p.w - 1.0f)); };
  Params params{tg::random::normal(tg::random::key(1), {16})};
  const auto optimizer = tg::optim::adamw(0.1, {.weight_decay = 1e-4});
  auto state = optimizer.init(params);
  const float before = loss(params).item();
  for (int step = 0; step < 20; ++step) {
    auto [value, grads] = tg::value_and_grad(loss)(params);
    auto [updates, next] = optimizer.update(grads, state, params);
    params = tg::optim::apply_updates(params, updates);
    state = std::move(next);
  }
  const float after = loss(params).item();
  std::cout << "loss " << before << " -> " << after << " after 20 AdamW steps\n";
  if (!(after < 0.5f * before)) return 1;
  std::cout << "consumer ok: tapegrad " << tg::version << " from FetchContent\n";
  return 0;
}
