// tg::compile: a compiled training step against the same step run eagerly (bitwise on the CPU), over
// several steps, with donated and kept arguments; re-recording at a new shape; outputs the caller keeps
// are never overwritten; host reads, transfers and host-key draws inside a step are errors; a bad label
// is still caught on replay. Built for the CPU, and by nvcc with every tensor on CUDA.
#include "test_common.hpp"

#include <string>
#include <utility>
#include <vector>

namespace compile_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace opt = tg::optim;
namespace rnd = tg::random;

namespace compile_test {

template <class T, class Dev>
struct Mlp {
  tg::Tensor<T, Dev> w1, b1, w2, b2;
};
TG_PYTREE(Mlp, w1, b1, w2, b2)

template <class Dev>
struct Metrics {
  tg::Tensor<float, Dev> loss, accuracy, grad_norm;
};
TG_PYTREE(Metrics, loss, accuracy, grad_norm)

}  // namespace compile_test

using compile_test::Metrics;
using compile_test::Mlp;

namespace {

using Params = Mlp<float, D>;

Params init_params() {
  const auto k = rnd::split(rnd::key(3), 2);
  return {rnd::normal<float, D>(k[0], {12, 16}) * 0.3f, tg::zeros<float, D>({16}),
          rnd::normal<float, D>(k[1], {16, 5}) * 0.3f, tg::zeros<float, D>({5})};
}

std::pair<tg::Tensor<float, D>, tg::Tensor<std::int32_t, D>> batch(int seed, std::int64_t n) {
  const auto x = rnd::normal<float, D>(rnd::key(100 + seed), {n, 12});
  std::vector<std::int32_t> y(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>((i * 7 + static_cast<std::size_t>(seed)) % 5);
  return {x, tg::from_vector<D>(y)};
}

std::pair<tg::Tensor<float, D>, tg::Tensor<float, D>> loss_fn(const Params& p, const tg::Tensor<float, D>& x,
                                                              const tg::Tensor<std::int32_t, D>& y) {
  const auto h = tg::linear(x, p.w1, p.b1, tg::Activation::gelu);
  const auto logits = tg::linear(h, p.w2, p.b2);
  return {tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::accuracy(logits, y)};
}

/// The codelab's step shape: value_and_grad with aux, clipping, a scheduled AdamW, metrics on the device.
template <class Opt>
auto make_step(const Opt& optimizer) {
  return [optimizer](const Params& params, const auto& state, const tg::Tensor<float, D>& x, const tg::Tensor<std::int32_t, D>& y) {
    auto [value, grads] = tg::value_and_grad(loss_fn, tg::has_aux)(params, x, y);
    auto [loss, accuracy] = value;
    auto [updates, next] = optimizer.update(grads, state, params);
    return std::make_tuple(opt::apply_updates(params, updates), next,
                           Metrics<D>{loss, accuracy, tg::global_norm(grads)});
  };
}

template <class Tree>
void require_bitwise(const Tree& a, const Tree& b) {
  std::vector<std::string> paths = tg::tree_paths(a);
  std::size_t k = 0;
  tg::tree_for_each([&](const std::string&, const auto& x, const auto& y) {
    using L = std::remove_cvref_t<decltype(x)>;
    if constexpr (!std::is_same_v<L, bool>) {
      INFO("leaf " << paths[k]);
      const auto xv = x.to_vector(), yv = y.to_vector();
      REQUIRE(xv.size() == yv.size());
      REQUIRE(std::memcmp(xv.data(), yv.data(), xv.size() * sizeof(xv[0])) == 0);
    }
    ++k;
  }, a, b);
}

template <class Tree>
void require_equal(const Tree& a, const Tree& b) {
#if defined(TG_TEST_CUDA)
  std::string why;
  INFO(why);
  REQUIRE(tg::tree_all_close(a, b, 1e-6, 1e-7, &why));
#else
  require_bitwise(a, b);  // the CPU replays the very kernels it recorded
#endif
}

}  // namespace

TEST_CASE("compiled step equals the eager step over several steps", "[compile]") {
  const auto optimizer = opt::chain(opt::clip_by_global_norm(1.0),
                                    opt::adamw(opt::warmup_cosine_decay_schedule(0.0, 1e-2, 2, 8), {.weight_decay = 1e-3}));
  const auto step = make_step(optimizer);
  auto compiled = tg::compile(step);

  Params eager_params = init_params(), params = init_params();
  auto eager_state = optimizer.init(eager_params), state = optimizer.init(params);
  for (int i = 0; i < 6; ++i) {
    const auto [x, y] = batch(i % 3, 8);
    auto [ep, es, em] = step(eager_params, eager_state, x, y);
    eager_params = ep, eager_state = es;
    // Donated: parameters and state handed over with std::move, as a training loop does.
    auto [p, s, m] = compiled(std::move(params), std::move(state), x, y);
    params = std::move(p), state = std::move(s);
    INFO("step " << i);
    require_equal(params, eager_params);
    require_equal(state, eager_state);
    require_equal(m, em);
  }
  CHECK(compiled.recordings() == 1);
}

TEST_CASE("compiled fused AdamW step equals eager, and arguments kept by the caller are not changed", "[compile]") {
  const auto optimizer = opt::fused_adamw(3e-3, {.weight_decay = 1e-4});
  const auto step = make_step(optimizer);
  auto compiled = tg::compile(step);
  Params params = init_params();
  auto state = optimizer.init(params);
  std::vector<Params> history;
  std::vector<Metrics<D>> metrics;
  Params eager = params;
  auto eager_state = state;
  std::vector<Params> eager_history;
  std::vector<Metrics<D>> eager_metrics;
  for (int i = 0; i < 4; ++i) {
    const auto [x, y] = batch(i, 8);
    // Passed as lvalues and kept: the compiled step must not write through them.
    auto [p, s, m] = compiled(params, state, x, y);
    history.push_back(params);
    metrics.push_back(m);
    params = p, state = s;
    auto [ep, es, em] = step(eager, eager_state, x, y);
    eager_history.push_back(eager);
    eager_metrics.push_back(em);
    eager = ep, eager_state = es;
  }
  for (std::size_t i = 0; i < history.size(); ++i) {
    INFO("kept step " << i);
    require_equal(history[i], eager_history[i]);
    require_equal(metrics[i], eager_metrics[i]);
  }
  require_equal(params, eager);
}

TEST_CASE("compile records again for a new shape and replays each shape's recording", "[compile]") {
  const auto optimizer = opt::sgd(0.1, 0.9);
  const auto step = make_step(optimizer);
  auto compiled = tg::compile(step);
  Params params = init_params(), eager = params;
  auto state = optimizer.init(params), eager_state = state;
  for (std::int64_t n : {8, 4, 8, 4, 6}) {
    const auto [x, y] = batch(static_cast<int>(n), n);
    auto [p, s, m] = compiled(std::move(params), std::move(state), x, y);
    params = std::move(p), state = std::move(s);
    auto [ep, es, em] = step(eager, eager_state, x, y);
    eager = ep, eager_state = es;
    INFO("batch " << n);
    require_equal(params, eager);
    require_equal(m, em);
  }
  CHECK(compiled.recordings() == 3);
  compiled.clear();
  CHECK(compiled.recordings() == 0);
}

TEST_CASE("a compiled step gives the same tensor passed twice the right values", "[compile]") {
  auto f = [](const tg::Tensor<float, D>& a, const tg::Tensor<float, D>& b) { return std::make_pair(a * 2.0f + b, a - b); };
  auto compiled = tg::compile(f);
  auto a = tg::arange<float, D>(6).reshape({2, 3});
  for (int i = 0; i < 3; ++i) {
    const auto [sum, diff] = compiled(a, a);
    const auto [esum, ediff] = f(a, a);
    require_equal(sum, esum);
    require_equal(diff, ediff);
    a = compiled(std::move(a), tg::ones<float, D>({2, 3})).first;  // donated; the result takes a's buffer
  }
  CHECK(a.to_vector() == std::vector<float>{7, 15, 23, 31, 39, 47});
}

TEST_CASE("host reads, transfers and host-key draws inside a compiled step are errors naming them", "[compile]") {
  const auto x = tg::ones<float, D>({2, 2});
  auto reads = tg::compile([](const tg::Tensor<float, D>& t) { return t * tg::sum(t).item(); });
  CHECK_THROWS_WITH(reads(x), Contains("[item] a host read inside a compiled step"));
  auto vector = tg::compile([](const tg::Tensor<float, D>& t) { return t * static_cast<float>(t.to_vector().size()); });
  CHECK_THROWS_WITH(vector(x), Contains("[to_vector] a host read inside a compiled step"));
  auto draws = tg::compile([](const tg::Tensor<float, D>& t) { return t + rnd::normal<float, D>(rnd::key(0), {2, 2}); });
  CHECK_THROWS_WITH(draws(x), Contains("[random::normal] a draw from a host key inside a compiled step"));
  CHECK(reads.recordings() == 0);
  // Outside a compiled step the same calls work.
  CHECK(tg::sum(x).item() == 4.0f);
}

TEST_CASE("a compiled step still rejects labels out of range when it replays", "[compile]") {
  auto f = [](const tg::Tensor<float, D>& logits, const tg::Tensor<std::int32_t, D>& y) {
    return tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y));
  };
  auto compiled = tg::compile(f);
  const auto logits = tg::zeros<float, D>({3, 4});
  CHECK(compiled(logits, tg::from_vector<D>(std::vector<std::int32_t>{0, 1, 3})).item() == Approx(std::log(4.0)));
  CHECK(compiled(logits, tg::from_vector<D>(std::vector<std::int32_t>{2, 2, 2})).item() == Approx(std::log(4.0)));
  // On the CPU the replayed check throws; on CUDA a kernel reports it and the next synchronisation raises.
  CHECK_THROWS_WITH(compiled(logits, tg::from_vector<D>(std::vector<std::int32_t>{0, 7, 1})).item(),
                    Contains("label 7 at position 1 is out of range for 4 classes"));
  CHECK(compiled(logits, tg::from_vector<D>(std::vector<std::int32_t>{1, 1, 1})).item() == Approx(std::log(4.0)));
}

TEST_CASE("donated CPU steps alternate between two buffer sets with no copies, and kept results stay intact", "[compile]") {
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    const auto optimizer = opt::fused_adamw(3e-3, {.weight_decay = 1e-4});
    const auto step = make_step(optimizer);
    auto compiled = tg::compile(step);
    Params params = init_params(), eager = params;
    auto state = optimizer.init(params), eager_state = state;
    std::vector<const void*> where;  // w1's buffer after each call
    std::vector<Params> kept, eager_kept;
    for (int i = 0; i < 7; ++i) {
      const auto [x, y] = batch(i % 3, 8);
      auto [p, s, m] = i == 3 ? compiled(params, state, x, y)  // once as lvalues: copied in, not written
                              : compiled(std::move(params), std::move(state), x, y);
      params = std::move(p), state = std::move(s);
      where.push_back(params.w1.data());
      if (i == 4) kept.push_back(params);  // a handle kept while the next calls donate it
      auto [ep, es, em] = step(eager, eager_state, x, y);
      eager = ep, eager_state = es;
      if (i == 4) eager_kept.push_back(eager);
      INFO("step " << i);
      require_equal(params, eager);
      require_equal(state, eager_state);
      require_equal(m, em);
    }
    // Ping-pong: each call's outputs are in the buffers the call before last wrote.
    CHECK(where[0] != where[1]);
    CHECK(where[2] == where[0]);
    CHECK(where[5] == where[1]);
    require_equal(kept[0], eager_kept[0]);
    CHECK(compiled.recordings() == 1);
  }
}

TEST_CASE("a compiled CPU step reuses the blocks of its freed temporaries, and replays equal eager", "[compile]") {
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    // Twenty temporaries of 64 KiB in a chain, each dead once the next exists: the plan needs a few blocks,
    // not twenty; the input (held by the plan) and the output are never handed out while in use.
    auto chain = [](const tg::Tensor<float, D>& x) {
      tg::Tensor<float, D> h = x;
      for (int i = 0; i < 20; ++i) h = tg::tanh(h * 0.9f + 0.1f);
      return std::make_tuple(h, tg::sum(h));
    };
    auto compiled = tg::compile(chain);
    const auto x = rnd::normal<float, D>(rnd::key(3), {128, 128});
    const auto [h1, s1] = compiled(x);
    const auto [h2, s2] = compiled(x * 2.0f);
    const auto [e1, es1] = chain(x);
    const auto [e2, es2] = chain(x * 2.0f);
    CHECK(h1.to_vector() == e1.to_vector());  // h1 kept by the caller: the second call must not write it
    CHECK(h2.to_vector() == e2.to_vector());
    CHECK(s2.item() == es2.item());
    const std::size_t block = 128 * 128 * sizeof(float);
    INFO("plan memory " << compiled.memory_bytes() << " bytes");
    CHECK(compiled.memory_bytes() <= 6 * block);  // 41 temporaries of that size were allocated
  }
}

TEST_CASE("a CPU step that allocates differently when recorded again falls back to copying donated outputs", "[compile]") {
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    // Breaks the rule on purpose: the second recording (the dry twin) allocates one tensor more.
    int calls = 0;
    auto f = [&calls](const tg::Tensor<float, D>& a) {
      if (calls++ == 1) (void)tg::zeros<float, D>({3});
      return a * 2.0f + 1.0f;
    };
    auto compiled = tg::compile(f);
    auto a = tg::arange<float, D>(4);
    float want = 0.0f;  // element 0 of a
    for (int i = 0; i < 4; ++i) {
      a = compiled(std::move(a));
      want = want * 2.0f + 1.0f;
      INFO("call " << i);
      CHECK(a.to_vector()[0] == want);
    }
    CHECK(a.to_vector() == std::vector<float>{15, 31, 47, 63});
  }
}

}  // namespace compile_tests
