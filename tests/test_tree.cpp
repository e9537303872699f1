// Pytrees: registration of structs and class templates, containers, paths, counts, maps, norms.
#include "test_common.hpp"

#include <array>
#include <cmath>
#include <tuple>
#include <vector>

namespace tree_tests {

using Catch::Matchers::Contains;

namespace tree_test {

template <class D>
struct Dense {
  tg::Tensor<float, D> w, b;
};
TG_PYTREE(Dense, w, b)

struct Encoder {
  std::vector<Dense<tg::Cpu>> layers;
  std::array<tg::Tensor<double>, 2> scales;
  std::tuple<tg::Tensor<std::int32_t>, Dense<tg::Cpu>> extra;
};
TG_PYTREE(Encoder, layers, scales, extra)

struct Model {
  Encoder enc;
  tg::Tensor<tg::bf16> head;
};
TG_PYTREE(Model, enc, head)

Model make_model() {
  const Dense<tg::Cpu> l0{tg::full<float>({2, 3}, 1.0f), tg::full<float>({3}, 2.0f)};
  const Dense<tg::Cpu> l1{tg::full<float>({3, 1}, -1.0f), tg::full<float>({1}, 0.5f)};
  return {{{l0, l1}, {tg::full<double>({2}, 3.0), tg::full<double>({}, 4.0)},
           {tg::full<std::int32_t>({2}, 7), Dense<tg::Cpu>{tg::ones<float>({1}), tg::ones<float>({1})}}},
          tg::full<tg::bf16>({2}, tg::bf16(0.5f))};
}

/// Registered templates with an element type: what tree_cast rebinds (the Flax way: Dense, LayerNorm).
template <class D, class T = float>
struct Layer {
  tg::Tensor<T, D> w, b;
  tg::Tensor<std::int32_t, D> steps;
};
TG_PYTREE(Layer, w, b, steps)

template <class D, class T = float>
struct Net {
  Layer<D, T> first;
  std::vector<Layer<D, T>> more;
  std::tuple<tg::Tensor<T, D>, tg::Tensor<double, D>> extra;
};
TG_PYTREE(Net, first, more, extra)

}  // namespace tree_test

using tree_test::make_model;

TEST_CASE("paths, leaves and counts follow the declared order", "[tree]") {
  const auto m = make_model();
  const std::vector<std::string> want{"enc.layers[0].w", "enc.layers[0].b", "enc.layers[1].w", "enc.layers[1].b",
                                      "enc.scales[0]",   "enc.scales[1]",   "enc.extra[0]",    "enc.extra[1].w",
                                      "enc.extra[1].b",  "head"};
  CHECK(tg::tree_paths(m) == want);
  const auto leaves = tg::tree_leaves(m);
  REQUIRE(leaves.size() == 10);
  CHECK(std::get<tg::Tensor<float>>(leaves[0]).data() == m.enc.layers[0].w.data());  // shared, not copied
  CHECK(std::holds_alternative<tg::Tensor<std::int32_t>>(leaves[6]));
  CHECK(tg::tree_count(m) == 6 + 3 + 3 + 1 + 2 + 1 + 2 + 1 + 1 + 2);
  static_assert(std::is_same_v<tg::tree_device_t<tree_test::Model>, tg::Cpu>);
  static_assert(std::is_same_v<tg::tree_device_t<tree_test::Dense<tg::Cuda>>, tg::Cuda>);
}

TEST_CASE("tree_for_each_tensor numbers the tensor leaves, skipping a mask's bools", "[tree]") {
  // A tuple of a mask-like tree and a model: the index counts tensors only, across the tuple's elements.
  std::tuple<std::array<bool, 2>, tree_test::Dense<tg::Cpu>, std::vector<tg::Tensor<double>>> t{
      {true, false}, {tg::ones<float>({2}), tg::zeros<float>({1})}, {tg::ones<double>({3})}};
  std::vector<std::pair<std::size_t, std::string>> seen;
  tg::tree_for_each_tensor([&](std::size_t index, const std::string& path, const auto& leaf) {
    CHECK(leaf.defined());
    seen.emplace_back(index, path);
  }, t);
  const std::vector<std::pair<std::size_t, std::string>> want{{0, "[1].w"}, {1, "[1].b"}, {2, "[2][0]"}};
  CHECK(seen == want);
}

TEST_CASE("tree_map, zeros_like, global_norm and all_close", "[tree]") {
  const auto m = make_model();
  const auto doubled = tg::tree_map([](const auto& a) { return tg::add(a, a); }, m);
  static_assert(std::is_same_v<decltype(doubled), const tree_test::Model>);
  CHECK(doubled.enc.layers[1].w.to_vector() == std::vector<float>(3, -2.0f));
  CHECK(std::get<0>(doubled.enc.extra).to_vector() == std::vector<std::int32_t>{14, 14});
  const auto sum2 = tg::tree_map([](const auto& a, const auto& b) { return tg::add(a, b); }, m, doubled);
  CHECK(sum2.head.to_vector()[0].bits == tg::bf16(1.5f).bits);

  const auto z = tg::tree_zeros_like(m);
  CHECK(tg::tree_count(z) == tg::tree_count(m));
  CHECK(z.enc.scales[1].shape() == tg::Shape{});
  CHECK(z.enc.layers[0].w.to_vector() == std::vector<float>(6, 0.0f));

  // Floating leaves only (the int32 leaf is skipped): 6*1 + 3*4 + 3*1 + 0.25 + 2*9 + 16 + 1 + 1 + 2*0.25.
  const double want = std::sqrt(6 * 1.0 + 3 * 4.0 + 3 * 1.0 + 0.25 + 2 * 9.0 + 16.0 + 1.0 + 1.0 + 2 * 0.25);
  const auto norm = tg::global_norm(m);  // the model has double leaves: a double norm, as JAX promotes
  static_assert(std::is_same_v<decltype(norm), const tg::Tensor<double, tg::Cpu>>);
  CHECK(norm.rank() == 0);
  CHECK(norm.item() == Approx(want).epsilon(1e-6));

  std::string why;
  CHECK(tg::tree_all_close(m, m, 0.0, 0.0));
  CHECK_FALSE(tg::tree_all_close(m, doubled, 1e-5, 1e-8, &why));
  CHECK(why == "enc.layers[0].w[0]: 1 vs 2");
}

TEST_CASE("global_norm of many leaves of many sizes equals the double reference", "[tree]") {
  // 150 float leaves (three launches of up to 64 leaves), sizes from 0 to past several 256-element
  // chunks, beside a double and a bf16 leaf.
  std::vector<tg::Tensor<float>> floats;
  double want = 0.0;
  for (int i = 0; i < 150; ++i) {
    const std::int64_t n = (i * 37) % 700;
    const auto t = tg::random::normal<float>(tg::random::key(i), {n});
    for (float v : t.to_vector()) want += static_cast<double>(v) * v;
    floats.push_back(t);
  }
  const auto d = tg::random::normal<double>(tg::random::key(500), {33});
  for (double v : d.to_vector()) want += v * v;
  const auto b = tg::cast<tg::bf16>(tg::random::normal<float>(tg::random::key(501), {40}));
  for (auto v : b.to_vector()) want += static_cast<double>(static_cast<float>(v)) * static_cast<float>(v);
  const auto norm = tg::global_norm(std::tuple{floats, d, b});
  static_assert(std::is_same_v<decltype(norm), const tg::Tensor<double, tg::Cpu>>);
  CHECK(norm.item() == Approx(std::sqrt(want)).epsilon(2e-6));
  CHECK(tg::global_norm(std::tuple{floats, d, b}).item() == norm.item());  // reproducible
  CHECK(tg::global_norm(std::vector<tg::Tensor<float>>{}).item() == 0.0f);
}

TEST_CASE("global_norm keeps the tree's floating type: double trees to double precision, as optax", "[tree]") {
  // A double tree's norm is computed and returned in double (it once came back in float: 9.7243013381958
  // for 9.724301358657133).
  const std::vector<tg::Tensor<double>> d{tg::random::normal<double>(tg::random::key(7), {40}), tg::random::normal<double>(tg::random::key(8), {3, 19})};
  long double want = 0;
  for (const auto& t : d)
    for (double v : t.to_vector()) want += static_cast<long double>(v) * v;
  const auto norm = tg::global_norm(d);
  static_assert(std::is_same_v<decltype(norm), const tg::Tensor<double, tg::Cpu>>);
  CHECK(std::abs(norm.item() - static_cast<double>(std::sqrt(want))) <= 1e-15 * norm.item());
  // Float alone stays float; bf16 alone is bf16 (JAX's sum of bf16 squares is bf16), summed in float.
  static_assert(std::is_same_v<decltype(tg::global_norm(std::vector<tg::Tensor<float>>{})), tg::Tensor<float, tg::Cpu>>);
  const auto b = tg::cast<tg::bf16>(tg::random::normal<float>(tg::random::key(9), {50}));
  const auto nb = tg::global_norm(std::vector{b});
  static_assert(std::is_same_v<decltype(nb), const tg::Tensor<tg::bf16, tg::Cpu>>);
  double sb = 0;
  for (auto v : b.to_vector()) sb += static_cast<double>(static_cast<float>(v)) * static_cast<float>(v);
  CHECK(nb.item().bits == tg::bf16(static_cast<float>(std::sqrt(sb))).bits);
}

TEST_CASE("mismatched structures are errors that name the path", "[tree][errors]") {
  auto a = make_model();
  auto b = make_model();
  b.enc.layers.pop_back();
  CHECK_THROWS_WITH(tg::tree_map([](const auto& x, const auto&) { return x; }, a, b),
                    Contains("[tree] structures differ at 'enc.layers': a list of 2 vs one of 1 elements"));
}

TEST_CASE("tree_cast changes the floating leaves' dtype, and the tree's type with it, as jax.tree.map(astype)", "[tree][tree_cast]") {
  using tree_test::Layer;
  using tree_test::Net;
  using Cpu = tg::Cpu;
  auto layer = [](int seed) {
    return Layer<Cpu>{tg::random::normal<float>(tg::random::key(seed), {3, 2}), tg::random::normal<float>(tg::random::key(seed + 1), {2}),
                      tg::full<std::int32_t>({}, seed)};
  };
  const Net<Cpu> net{layer(1), {layer(3), layer(5)}, {tg::random::normal<float>(tg::random::key(7), {4}), tg::full<double>({2}, 0.1)}};
  const auto half = tg::tree_cast<tg::bf16>(net);
  static_assert(std::is_same_v<decltype(half), const Net<Cpu, tg::bf16>>);
  static_assert(std::is_same_v<tg::tree_rebind_t<Net<Cpu>, tg::bf16>, Net<Cpu, tg::bf16>>);
  CHECK(tg::tree_paths(half) == tg::tree_paths(net));
  // The leaves of the element type cast; a leaf the struct declares as double, and integer leaves, kept.
  CHECK(half.first.w.to_vector() == tg::cast<tg::bf16>(net.first.w).to_vector());
  CHECK(half.more[1].b.to_vector() == tg::cast<tg::bf16>(net.more[1].b).to_vector());
  CHECK(std::get<0>(half.extra).to_vector() == tg::cast<tg::bf16>(std::get<0>(net.extra)).to_vector());
  CHECK(std::get<1>(half.extra).data() == std::get<1>(net.extra).data());
  CHECK(half.more[0].steps.data() == net.more[0].steps.data());
  // Casting to the type a leaf has shares it: no copy, no kernel.
  const auto same = tg::tree_cast<float>(net);
  static_assert(std::is_same_v<decltype(same), const Net<Cpu, float>>);
  CHECK(same.first.w.data() == net.first.w.data());
  // Differentiable: a loss computed on tree_cast<bf16>(params) sends f32 gradients, each leaf's cast's.
  auto loss_tree = [](const Net<Cpu>& p) {
    const auto h = tg::tree_cast<tg::bf16>(p);
    return tg::cast<float>(tg::sum(h.first.w * h.first.w) + tg::sum(h.more[0].b) + tg::sum(std::get<0>(h.extra)));
  };
  auto loss_leaf = [](const Net<Cpu>& p) {
    return tg::cast<float>(tg::sum(tg::cast<tg::bf16>(p.first.w) * tg::cast<tg::bf16>(p.first.w)) + tg::sum(tg::cast<tg::bf16>(p.more[0].b)) +
                           tg::sum(tg::cast<tg::bf16>(std::get<0>(p.extra))));
  };
  const auto g1 = tg::grad(loss_tree)(net), g2 = tg::grad(loss_leaf)(net);
  CHECK(tg::tree_all_close(g1, g2, 0.0, 0.0));
  CHECK(g1.first.w.to_vector() != std::vector<float>(6, 0.0f));
}

}  // namespace tree_tests
