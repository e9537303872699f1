// Optimizers: each atom against a double-precision transcription of Optax's formula, the aliases on a
// quadratic and on Rosenbrock, schedules at known points, chain order, clipping, masks, fused vs
// chained AdamW, bad hyperparameters. Built for the CPU, and by nvcc with every tensor on CUDA.
#include "test_common.hpp"

#include <cmath>
#include <string>
#include <vector>

namespace optim_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace opt = tg::optim;
namespace rnd = tg::random;

namespace optim_test {

template <class T, class Dev>
struct W {
  tg::Tensor<T, Dev> a, b;
};
TG_PYTREE(W, a, b)

struct WMask {
  bool a, b;
};
TG_PYTREE(WMask, a, b)

template <class T, class Dev>
struct XY {
  tg::Tensor<T, Dev> x, y;
};
TG_PYTREE(XY, x, y)

}  // namespace optim_test

using optim_test::W;
using optim_test::XY;

namespace {

using Vec = std::vector<double>;

template <class T = double>
W<T, D> random_w(int seed) {
  return {rnd::normal<T, D>(rnd::key(seed), {3, 4}), rnd::normal<T, D>(rnd::key(seed + 1), {4})};
}

template <class T>
std::pair<Vec, Vec> host(const W<T, D>& w) {
  auto conv = [](const auto& t) {
    Vec v;
    for (auto x : t.to_vector()) v.push_back(static_cast<double>(x));
    return v;
  };
  return {conv(w.a), conv(w.b)};
}

void check_vec(const Vec& got, const Vec& want, double rtol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), 1e-12));
  INFO(what << ": worst relative error " << worst);
  CHECK(worst <= rtol);
}

/// Runs `g` for `steps` steps on random gradients and compares every step's updates with `ref`, which
/// maps (grads, params, step) of one leaf in double to the expected updates (keeping its own state).
template <class G, class Ref>
void check_atom(const char* name, const G& g, Ref ref_a, Ref ref_b, int steps = 5) {
  INFO("atom " << name);
  const auto params = random_w(1);
  auto state = g.init(params);
  const auto [pa, pb] = host(params);
  for (int t = 0; t < steps; ++t) {
    const auto grads = random_w(100 + 2 * t);
    auto [updates, next] = g.update(grads, state, params);
    state = next;
    const auto [ga, gb] = host(grads);
    const auto [ua, ub] = host(updates);
    check_vec(ua, ref_a(ga, pa, t), 1e-12, "a, step " + std::to_string(t));
    check_vec(ub, ref_b(gb, pb, t), 1e-12, "b, step " + std::to_string(t));
  }
}

/// A leaf-wise reference with its own state, written from Optax's formulas.
template <class F>
auto leafwise(F f) {
  return [f, state = std::vector<Vec>()](const Vec& g, const Vec& p, int t) mutable {
    if (state.empty()) state.assign(2, Vec(g.size(), 0.0));
    Vec u(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) u[i] = f(g[i], p[i], t, state[0][i], state[1][i]);
    return u;
  };
}

}  // namespace

TEST_CASE("each atom matches Optax's formula in double over several steps", "[optim]") {
  using R = std::function<Vec(const Vec&, const Vec&, int)>;
  auto same = [](auto f) { return std::pair<R, R>{leafwise(f), leafwise(f)}; };
  {
    auto [ra, rb] = same([](double g, double, int, double&, double&) { return 0.5 * g; });
    check_atom("scale", opt::scale(0.5), ra, rb);
  }
  {
    auto [ra, rb] = same([](double g, double, int t, double& m, double& v) {
      m = (1 - 0.8) * g + 0.8 * m;
      v = (1 - 0.95) * g * g + 0.95 * v;
      const double c = t + 1;
      return (m / (1 - std::pow(0.8, c))) / (std::sqrt(v / (1 - std::pow(0.95, c)) + 1e-9) + 1e-6);
    });
    check_atom("scale_by_adam", opt::scale_by_adam(0.8, 0.95, 1e-6, 1e-9), ra, rb);
  }
  {
    auto [ra, rb] = same([](double g, double p, int, double&, double&) { return g + 0.1 * p; });
    check_atom("add_decayed_weights", opt::add_decayed_weights(0.1), ra, rb);
  }
  {
    auto [ra, rb] = same([](double g, double, int, double&, double&) { return -0.1 * g; });
    check_atom("scale_by_learning_rate", opt::scale_by_learning_rate(0.1), ra, rb);
  }
  {
    // linear 1 -> 0 over 4 steps: 1, 0.75, 0.5, 0.25, 0 (then held).
    auto [ra, rb] = same([](double g, double, int t, double&, double&) { return std::max(0.0, 1.0 - t / 4.0) * g; });
    check_atom("scale_by_schedule", opt::scale_by_schedule(opt::linear_schedule(1.0, 0.0, 4)), ra, rb, 6);
    auto [la, lb] = same([](double g, double, int t, double&, double&) { return -0.5 * std::pow(0.5, t) * g; });
    check_atom("scale_by_learning_rate(schedule)", opt::scale_by_learning_rate(opt::exponential_decay(0.5, 1, 0.5)), la, lb);
  }
  {
    auto [ra, rb] = same([](double g, double, int, double& tr, double&) { return tr = g + 0.9 * tr; });
    check_atom("trace", opt::trace(0.9), ra, rb);
    auto [na, nb] = same([](double g, double, int, double& tr, double&) {
      tr = g + 0.9 * tr;
      return g + 0.9 * tr;
    });
    check_atom("trace nesterov", opt::trace(0.9, true), na, nb);
  }
  {
    auto [ra, rb] = same([](double g, double, int, double&, double&) { return std::clamp(g, -0.5, 0.5); });
    check_atom("clip", opt::clip(0.5), ra, rb);
  }
  // clip_by_global_norm: the norm spans both leaves, so the reference is written for the whole tree.
  const auto params = random_w(1);
  for (double max_norm : {0.5, 100.0}) {
    const auto g = opt::clip_by_global_norm(max_norm);
    const auto grads = random_w(7);
    const auto [u, s] = g.update(grads, g.init(params), params);
    const auto [ga, gb] = host(grads);
    double sq = 0;
    for (double v : ga) sq += v * v;
    for (double v : gb) sq += v * v;
    const double norm = std::sqrt(sq), f = norm < max_norm ? 1.0 : max_norm / norm;
    const auto [ua, ub] = host(u);
    for (std::size_t i = 0; i < ua.size(); ++i) CHECK(ua[i] == Approx(ga[i] * f).epsilon(1e-6));  // norm in float
    CHECK(tg::global_norm(u).item() == Approx(std::min(norm, max_norm)).epsilon(1e-6));
  }
  {
    // Many leaves of three dtypes (launches of up to 32 leaves per dtype, an empty leaf among them): each
    // element is fn::ClipToNorm of the norm, in its leaf's compute type, as the per-leaf formula.
    std::vector<tg::Tensor<float, D>> fs;
    for (int i = 0; i < 70; ++i) fs.push_back(rnd::normal<float, D>(rnd::key(100 + i), {(i * 13) % 50}));
    const auto tree = std::tuple{fs, rnd::normal<double, D>(rnd::key(200), {7}), tg::cast<tg::bf16>(rnd::normal<float, D>(rnd::key(201), {9}))};
    const auto g = opt::clip_by_global_norm(1.0);
    const auto [u, s] = g.update(tree, g.init(tree), tree);
    const double norm = tg::global_norm(tree).item();  // a double leaf makes the norm double, as in optax
    REQUIRE(norm > 1.0);
    const float normf = static_cast<float>(norm);
    bool all = true;
    for (std::size_t i = 0; i < fs.size(); ++i) {
      const auto in = fs[i].to_vector(), out = std::get<0>(u)[i].to_vector();
      for (std::size_t j = 0; j < in.size(); ++j) all = all && out[j] == (in[j] / normf) * 1.0f;
    }
    const auto din = std::get<1>(tree).to_vector(), dout = std::get<1>(u).to_vector();
    for (std::size_t j = 0; j < din.size(); ++j) all = all && dout[j] == (din[j] / norm) * 1.0;
    const auto bin = std::get<2>(tree).to_vector(), bout = std::get<2>(u).to_vector();
    for (std::size_t j = 0; j < bin.size(); ++j) all = all && bout[j].bits == tg::bf16((static_cast<float>(bin[j]) / normf) * 1.0f).bits;
    CHECK(all);
  }
  // Counts live on the device and advance once per update.
  const auto adam = opt::scale_by_adam();
  auto st = adam.init(params);
  for (int t = 0; t < 3; ++t) st = adam.update(params, st, params).second;
  CHECK(st.count.item() == 3);
}

TEST_CASE("schedules at known points", "[optim][schedule]") {
  const auto lin = opt::linear_schedule(1.0, 0.1, 10, 5);
  CHECK(lin(0) == 1.0);
  CHECK(lin(5) == 1.0);
  CHECK(lin(10) == Approx(0.55));
  CHECK(lin(15) == Approx(0.1));
  CHECK(lin(1000) == Approx(0.1));
  CHECK(opt::linear_schedule(2.0, 0.0, 0)(7) == 2.0);  // non-positive steps: constant init, as optax
  CHECK(opt::polynomial_schedule(1.0, 0.0, 2.0, 10)(5) == Approx(0.25));
  const auto cosd = opt::cosine_decay_schedule(1.0, 100, 0.1);
  CHECK(cosd(0) == 1.0);
  CHECK(cosd(50) == Approx(0.55));
  CHECK(cosd(100) == Approx(0.1));
  CHECK(cosd(500) == Approx(0.1));
  const auto warm = opt::warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, 0.01);
  CHECK(warm(0) == 0.0);
  CHECK(warm(5) == Approx(0.5));
  CHECK(warm(10) == Approx(1.0));
  CHECK(warm(60) == Approx(0.01 + 0.99 * 0.5));
  CHECK(warm(110) == Approx(0.01));
  CHECK(warm(1000) == Approx(0.01));
  const auto ex = opt::exponential_decay(1.0, 10, 0.5);
  CHECK(ex(0) == 1.0);
  CHECK(ex(10) == Approx(0.5));
  CHECK(ex(15) == Approx(std::pow(0.5, 1.5)));
  CHECK(opt::exponential_decay(1.0, 10, 0.5, 0, true)(15) == Approx(0.5));  // staircase
  CHECK(opt::exponential_decay(1.0, 10, 0.5, 0, false, 0.3)(100) == Approx(0.3));  // clipped at end_value
  CHECK(opt::exponential_decay(1.0, 10, 0.5, 5)(5) == 1.0);  // before / at transition_begin
  const auto pw = opt::piecewise_constant_schedule(1.0, {{20, 0.1}, {10, 0.5}});
  CHECK(pw(9) == 1.0);
  CHECK(pw(10) == 0.5);
  CHECK(pw(19) == 0.5);
  CHECK(pw(20) == Approx(0.05));
  const auto j = opt::join_schedules(opt::constant_schedule(1.0), 10, opt::constant_schedule(2.0), 20, opt::linear_schedule(3.0, 4.0, 10));
  CHECK(j(9) == 1.0);
  CHECK(j(10) == 2.0);
  CHECK(j(19) == 2.0);
  CHECK(j(20) == 3.0);
  CHECK(j(25) == Approx(3.5));
  CHECK(j(100) == 4.0);
}

TEST_CASE("chain applies in order and keeps its states in order", "[optim][chain]") {
  const auto params = random_w(1);
  const auto ones = tg::tree_map([](const auto& t) { return tg::full<double, D>(t.shape(), 1.0); }, params);
  const auto clip_then_scale = opt::chain(opt::clip(0.1), opt::scale(10.0));
  const auto scale_then_clip = opt::chain(opt::scale(10.0), opt::clip(0.1));
  CHECK(clip_then_scale.update(ones, clip_then_scale.init(params), params).first.a.to_vector() == Vec(12, 1.0));
  CHECK(scale_then_clip.update(ones, scale_then_clip.init(params), params).first.a.to_vector() == Vec(12, 0.1));
  const auto c = opt::chain(opt::scale_by_adam(), opt::trace(0.5), opt::scale_by_learning_rate(opt::constant_schedule(0.1)));
  auto state = c.init(params);
  static_assert(std::is_same_v<decltype(state), std::tuple<opt::ScaleByAdamState<W<double, D>>, opt::TraceState<W<double, D>>,
                                                           opt::ScaleByScheduleState<W<double, D>>>>);
  state = c.update(ones, state, params).second;
  CHECK(std::get<0>(state).count.item() == 1);
  CHECK(std::get<2>(state).count.item() == 1);
  // The state is a pytree: its leaves have paths, so it can be checkpointed like parameters.
  const auto paths = tg::tree_paths(state);
  CHECK(paths.front() == "[0].count");
  CHECK(paths.back() == "[2].count");
  CHECK(std::find(paths.begin(), paths.end(), "[1].trace.b") != paths.end());
}

TEST_CASE("every alias minimises a quadratic and Rosenbrock", "[optim][alias]") {
  const auto target = W<double, D>{tg::full<double, D>({3, 4}, 1.5), tg::full<double, D>({4}, -2.0)};
  auto quadratic = [&](const W<double, D>& p) { return tg::sum(tg::square(p.a - target.a)) + tg::sum(tg::square(p.b - target.b)); };
  auto minimise = [](auto optimizer, auto params, auto loss, int steps) {
    auto state = optimizer.init(params);
    for (int i = 0; i < steps; ++i) {
      const auto g = tg::grad(loss)(params);
      auto [u, s] = optimizer.update(g, state, params);
      params = opt::apply_updates(params, u);
      state = s;
    }
    return params;
  };
  auto near = [](const auto& got, const auto& want, double atol) {
    std::string why;
    const bool ok = tg::tree_all_close(got, want, 0.0, atol, &why);
    INFO(why);
    return ok;
  };
  const auto start = tg::tree_zeros_like(target);
  CHECK(near(minimise(opt::sgd(0.1), start, quadratic, 200), target, 1e-6));
  CHECK(near(minimise(opt::sgd(0.05, 0.9), start, quadratic, 300), target, 1e-6));
  CHECK(near(minimise(opt::sgd(0.05, 0.9, true), start, quadratic, 300), target, 1e-6));
  CHECK(near(minimise(opt::adam(0.05), start, quadratic, 1000), target, 1e-3));
  // Weight decay pulls the optimum towards 0 by about lr * wd per step against Adam's normalised step.
  CHECK(near(minimise(opt::adamw(0.05, {.weight_decay = 1e-4}), start, quadratic, 1000), target, 1e-2));
  CHECK(near(minimise(opt::fused_adamw(0.05, {.weight_decay = 1e-4}), start, quadratic, 1000), target, 1e-2));

  // Rosenbrock (a = 1, b = 100) from (-1, 1): minimum at (1, 1).
  auto rosenbrock = [](const XY<double, D>& p) {
    return tg::square(1.0 - p.x) + 100.0 * tg::square(p.y - tg::square(p.x));
  };
  const XY<double, D> r0{tg::full<double, D>({}, -1.0), tg::full<double, D>({}, 1.0)};
  const XY<double, D> r_min{tg::full<double, D>({}, 1.0), tg::full<double, D>({}, 1.0)};
  CHECK(near(minimise(opt::sgd(2e-3), r0, rosenbrock, 30000), r_min, 1e-2));
  CHECK(near(minimise(opt::sgd(1e-3, 0.9), r0, rosenbrock, 8000), r_min, 1e-2));
  CHECK(near(minimise(opt::sgd(1e-3, 0.9, true), r0, rosenbrock, 8000), r_min, 1e-2));
  CHECK(near(minimise(opt::adam(0.02), r0, rosenbrock, 4000), r_min, 1e-2));
  CHECK(near(minimise(opt::adamw(0.02, {.weight_decay = 0.0}), r0, rosenbrock, 4000), r_min, 1e-2));
  // With decay the optimum moves towards 0 (by about wd / 2 here): a looser bound, as optax's tests use.
  CHECK(near(minimise(opt::adamw(0.02, {.weight_decay = 1e-4}), r0, rosenbrock, 4000), r_min, 2e-2));
  CHECK(near(minimise(opt::fused_adamw(0.02, {.weight_decay = 1e-4}), r0, rosenbrock, 4000), r_min, 2e-2));
}

TEST_CASE("masks skip weight decay where they say", "[optim][mask]") {
  const auto params = random_w(1), grads = random_w(3);
  auto no_bias = [](const std::string& path) { return path != "b"; };
  const auto by_predicate = opt::adamw(0.1, {.weight_decay = 0.5}, no_bias);
  const auto by_tree = opt::adamw(0.1, {.weight_decay = 0.5}, optim_test::WMask{true, false});
  const auto plain = opt::adam(0.1);
  const auto decayed = opt::adamw(0.1, {.weight_decay = 0.5});
  const auto u1 = by_predicate.update(grads, by_predicate.init(params), params).first;
  const auto u2 = by_tree.update(grads, by_tree.init(params), params).first;
  const auto u_plain = plain.update(grads, plain.init(params), params).first;
  const auto u_all = decayed.update(grads, decayed.init(params), params).first;
  CHECK(tg::tree_all_close(u1, u2, 0.0, 0.0));
  CHECK(u1.b.to_vector() == u_plain.b.to_vector());  // masked out: no decay
  CHECK(u1.a.to_vector() == u_all.a.to_vector());    // masked in: decayed
  CHECK(u1.a.to_vector() != u_plain.a.to_vector());
}

TEST_CASE("adamw runs its atoms in one pass, equal to chaining them bit for bit", "[optim][fused]") {
  // `chained` runs atom by atom (AdamW::atoms(), the chain adamw stands for), `fused` is adamw itself.
  auto compare = [](auto chained, auto fused, auto params) {
    auto s1 = chained.init(params);
    auto s2 = fused.init(params);
    static_assert(std::is_same_v<decltype(s1), decltype(s2)>);  // interchangeable: the chain's state
    auto p1 = params, p2 = params;
    for (int t = 0; t < 10; ++t) {
      const auto g = tg::tree_map([&](const auto& x) { return x * 0.3 + rnd::normal<typename std::remove_cvref_t<decltype(x)>::value_type, D>(
                                                                              rnd::key(t), x.shape()); }, p1);
      auto [u1, n1] = chained.update(g, s1, p1);
      auto [u2, n2] = fused.update(g, s2, p2);
      s1 = n1, s2 = n2;
      p1 = opt::apply_updates(p1, u1);
      p2 = opt::apply_updates(p2, u2);
    }
    std::string why;
    CHECK(tg::tree_all_close(p1, p2, 0.0, 0.0, &why));
    INFO(why);
    CHECK(tg::tree_all_close(std::get<0>(s1).nu, std::get<0>(s2).nu, 0.0, 0.0));
    CHECK(std::get<0>(s1).count.item() == 10);  // the counts the pass writes itself
    CHECK(std::get<0>(s2).count.item() == 10);
    if constexpr (requires { std::get<2>(s2).count; }) CHECK(std::get<2>(s2).count.item() == std::get<2>(s1).count.item());
  };
  auto with_atoms = [&](auto adamw, auto params) { compare(adamw.atoms(), adamw, params); };
  with_atoms(opt::adamw(3e-3), random_w<float>(1));
  with_atoms(opt::adamw(3e-3, {.weight_decay = 0.1}, [](const std::string& p) { return p == "a"; }), random_w<float>(2));
  with_atoms(opt::adamw(opt::warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10)), random_w<float>(3));
  with_atoms(opt::adamw(1e-3), random_w<double>(4));
  with_atoms(opt::adamw(1e-3), W<tg::bf16, D>{tg::cast<tg::bf16>(random_w<float>(5).a), tg::cast<tg::bf16>(random_w<float>(5).b)});
  // The atoms written out by hand, as Optax's alias writes them.
  compare(opt::chain(opt::scale_by_adam(), opt::add_decayed_weights(1e-2), opt::scale_by_learning_rate(1e-3)), opt::adamw(1e-3, {.weight_decay = 1e-2}),
          random_w<float>(6));
  static_assert(std::is_same_v<decltype(opt::fused_adamw(1e-3)), decltype(opt::adamw(1e-3))>);  // 0.1's name for it
}

TEST_CASE("adamw is one kernel for all its leaves, apply_updates one more", "[optim][fused]") {
  // Counted as compile() counts them: the CPU kernels a step records.
  const auto params = random_w<float>(7);
  const auto optimizer = opt::adamw(3e-3);
  const auto state = optimizer.init(params);
  auto kernels = [&](const auto& transformation) {
    tg::detail::Recorder recorder;
    {
      tg::detail::ActiveRecorder active(recorder);
      (void)transformation.update(params, state, params);
    }
    return recorder.cpu_kernels.size();
  };
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    CHECK(kernels(optimizer) == 1);  // both leaves, the counts and bias corrections inside it
    CHECK(kernels(optimizer.atoms()) == 2 + 3 * 2);  // count + 1, corrections, then adam, decay and scale per leaf
  }
  // apply_updates: params + updates for all leaves in one kernel, the same bits as tg::add per leaf.
  const auto [updates, next] = optimizer.update(params, state, params);
  tg::detail::Recorder recorder;
  W<float, D> applied;
  {
    tg::detail::ActiveRecorder active(recorder);
    applied = opt::apply_updates(params, updates);
  }
  if constexpr (std::is_same_v<D, tg::Cpu>) CHECK(recorder.cpu_kernels.size() == 1);
  CHECK(tg::tree_all_close(applied, tg::tree_map([](const auto& p, const auto& u) { return p + u; }, params, updates), 0.0, 0.0));
  CHECK_THROWS_WITH(opt::apply_updates(params, W<float, D>{params.b, params.b}),
                    Contains("[apply_updates] update of shape") && Contains("for the parameter 'a'"));
}

TEST_CASE("apply_updates over many leaves of many sizes and dtypes equals tg::add leaf by leaf", "[optim][multi_tensor]") {
  // 75 f32 leaves (three launches of at most 32), sizes across the CPU's chunk of 2,048 elements and empty
  // ones, beside f64 and bf16 leaves: every element the same bits as adding leaf by leaf.
  std::vector<tg::Tensor<float, D>> p, u;
  for (int i = 0; i < 75; ++i) {
    const std::int64_t n = i % 7 == 0 ? 0 : (i * 977) % 5000 + 1;
    p.push_back(rnd::normal<float, D>(rnd::key(i), {n}));
    u.push_back(rnd::normal<float, D>(rnd::key(1000 + i), {n}) * 1e-3f);
  }
  const auto d = rnd::normal<double, D>(rnd::key(3), {4099});
  const auto b = tg::cast<tg::bf16>(rnd::normal<float, D>(rnd::key(4), {33}));
  const auto params = std::tuple{p, d, b};
  const auto updates = std::tuple{u, d * 1e-3, b * 0.5};
  const auto applied = opt::apply_updates(params, updates);
  const auto reference = tg::tree_map([](const auto& x, const auto& y) { return x + y; }, params, updates);
  CHECK(tg::tree_all_close(applied, reference, 0.0, 0.0));
}

TEST_CASE("adamw(3e-3, weight_decay=1e-4) matches a hand-written double AdamW over 100 steps", "[optim][adamw]") {
  // The reference: Optax's adamw written out in double (Loshchilov & Hutter's update with Optax's
  // ordering: decay added to the Adam direction, then scaled by -lr).
  const double lr = 3e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 1e-4;
  auto run = [&]<class T>(T) {
    const auto p0 = random_w<T>(1);
    auto [ra, rb] = host(p0);
    Vec ma(ra.size()), va(ra.size()), mb(rb.size()), vb(rb.size());
    auto ref_step = [&](Vec& p, Vec& m, Vec& v, const Vec& g, int t) {
      for (std::size_t i = 0; i < p.size(); ++i) {
        m[i] = (1 - b1) * g[i] + b1 * m[i];
        v[i] = (1 - b2) * g[i] * g[i] + b2 * v[i];
        const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
        p[i] += -lr * (mh / (std::sqrt(vh) + eps) + wd * p[i]);
      }
    };
    const auto optimizer = opt::adamw(lr, {.weight_decay = wd});
    auto state = optimizer.init(p0);
    auto p = p0;
    for (int t = 1; t <= 100; ++t) {
      // The same gradients for both: drawn in double, rounded to T for ours.
      const auto gd = random_w<double>(1000 + 2 * t);
      const W<T, D> g{tg::cast<T>(gd.a), tg::cast<T>(gd.b)};
      const auto [ga, gb] = host(g);
      ref_step(ra, ma, va, ga, t);
      ref_step(rb, mb, vb, gb, t);
      auto [u, s] = optimizer.update(g, state, p);
      p = opt::apply_updates(p, u);
      state = s;
    }
    const auto [pa, pb] = host(p);
    // Element-wise relative error, and norm-wise: max |ours - ref| / max |ref|.
    double worst = 0, max_err = 0, max_ref = 0;
    for (auto [got, want] : {std::pair{&pa, &ra}, std::pair{&pb, &rb}})
      for (std::size_t i = 0; i < got->size(); ++i) {
        const double err = std::fabs((*got)[i] - (*want)[i]);
        worst = std::max(worst, err / std::fabs((*want)[i]));
        max_err = std::max(max_err, err);
        max_ref = std::max(max_ref, std::fabs((*want)[i]));
      }
    return std::pair{worst, max_err / max_ref};
  };
  const auto [elem64, norm64] = run(double{});
  const auto [elem32, norm32] = run(float{});
  WARN("adamw vs double reference after 100 steps: relative error element-wise " << elem64 << " / norm-wise " << norm64
       << " (f64 params); " << elem32 << " / " << norm32 << " (f32 params)");
  // In double, ours is Optax's formula to the last bits.
  CHECK(elem64 < 1e-12);
  // In f32 the parameters themselves are rounded to f32 after every step (half an ulp of p each time:
  // up to 100 * 2^-25 = 3e-6 relative element-wise after 100 steps, more for a parameter that shrank on
  // the way), so the 1e-6 criterion holds relative to the parameters' scale.
  CHECK(norm32 < 1e-6);
  CHECK(elem32 < 1e-5);
}

TEST_CASE("AnyTransformation chooses an optimizer at run time", "[optim]") {
  const auto params = random_w(1), grads = random_w(2);
  for (const std::string name : {"sgd", "adam", "adamw"}) {
    opt::AnyTransformation<W<double, D>> any;
    if (name == "sgd") any = opt::sgd(0.1, 0.9);
    else if (name == "adam") any = opt::adam(1e-3);
    else any = opt::adamw(1e-3);
    const auto [u, s] = any.update(grads, any.init(params), params);
    const auto want = name == "sgd" ? opt::sgd(0.1, 0.9).update(grads, opt::sgd(0.1, 0.9).init(params), params).first
                      : name == "adam" ? opt::adam(1e-3).update(grads, opt::adam(1e-3).init(params), params).first
                                       : opt::adamw(1e-3).update(grads, opt::adamw(1e-3).init(params), params).first;
    CHECK(tg::tree_all_close(u, want, 0.0, 0.0));
  }
  opt::AnyTransformation<W<double, D>> empty;
  CHECK_THROWS_WITH(empty.init(params), Contains("[AnyTransformation] empty"));
}

TEST_CASE("bad hyperparameters are clear errors", "[optim][errors]") {
  CHECK_THROWS_WITH(opt::adam(1e-3, 1.2), Contains("[adam] b1 must be in [0, 1), got 1.2"));
  CHECK_THROWS_WITH(opt::adamw(1e-3, {.b2 = -0.1}), Contains("[adamw] b2 must be in [0, 1), got -0.1"));
  CHECK_THROWS_WITH(opt::scale_by_adam(0.9, 0.999, -1.0), Contains("[scale_by_adam] eps must be finite and >= 0, got -1"));
  CHECK_THROWS_WITH(opt::scale_by_adam(0.9, 0.999, 0.0, 0.0), Contains("eps and eps_root cannot both be 0"));
  CHECK_THROWS_WITH(opt::sgd(NAN), Contains("[scale_by_learning_rate] learning_rate must be finite, got nan"));
  CHECK_THROWS_WITH(opt::sgd(0.1, -0.5), Contains("[trace] decay (momentum) must be finite and >= 0, got -0.5"));
  CHECK_THROWS_WITH(opt::adamw(1e-3, {.weight_decay = -1}), Contains("[add_decayed_weights] weight_decay must be finite and >= 0"));
  CHECK_THROWS_WITH(opt::clip(-1), Contains("[clip] max_delta must be >= 0, got -1"));
  CHECK_THROWS_WITH(opt::clip_by_global_norm(0), Contains("[clip_by_global_norm] max_norm must be > 0, got 0"));
  CHECK_THROWS_WITH(opt::cosine_decay_schedule(1.0, 0), Contains("[cosine_decay_schedule] requires positive decay_steps, got 0"));
  CHECK_THROWS_WITH(opt::warmup_cosine_decay_schedule(0, 1, 100, 50), Contains("requires positive decay_steps, got -50"));
  CHECK_THROWS_WITH(opt::piecewise_constant_schedule(1.0, {{10, -0.5}}), Contains("expects non-negative scale factors, got -0.5"));
  CHECK_THROWS_WITH(opt::join_schedules(opt::constant_schedule(1), 10, opt::constant_schedule(2), 5, opt::constant_schedule(3)),
                    Contains("[join_schedules] boundaries must be increasing, got 10 then 5"));
}

TEST_CASE("apply_updates keeps the parameters' dtype", "[optim]") {
  const W<tg::bf16, D> p{tg::full<tg::bf16, D>({2}, tg::bf16(1.0f)), tg::full<tg::bf16, D>({1}, tg::bf16(2.0f))};
  const W<tg::bf16, D> u{tg::full<tg::bf16, D>({2}, tg::bf16(0.00390625f)), tg::full<tg::bf16, D>({1}, tg::bf16(-0.5f))};
  const auto q = opt::apply_updates(p, u);
  CHECK(static_cast<float>(q.a.to_vector()[0]) == 1.0f);  // 1 + 2^-8 rounds to even in bf16
  CHECK(static_cast<float>(q.b.to_vector()[0]) == 1.5f);
}

#if defined(TG_TEST_CUDA)
TEST_CASE("an AdamW update can be captured in a CUDA Graph (no host round trip)", "[optim][cuda]") {
  const auto params = random_w<float>(1), grads = random_w<float>(2);
  const auto optimizer = opt::chain(opt::clip_by_global_norm(1.0), opt::adamw(opt::warmup_cosine_decay_schedule(0.0, 3e-3, 10, 100)));
  const auto state = optimizer.init(params);
  const auto eager = optimizer.update(grads, state, params);
  tg::cuda::synchronize();
  tg::cuda::GraphCapture capture;
  auto captured = optimizer.update(grads, state, params);
  const tg::cuda::Graph graph = capture.finish();
  CHECK(graph.nodes() > 0);
  graph.launch();
  tg::cuda::synchronize();
  CHECK(tg::tree_all_close(captured.first, eager.first, 0.0, 0.0));
  CHECK(std::get<0>(std::get<1>(captured.second)).count.item() == 1);
}
#endif

}  // namespace optim_tests
