// The higher-order transformations against JAX on the real models (ctest golden_higher_order): the
// Hessian-vector product of the codelab's loss at its key(1) parameters on its first batch, and the JVP
// of the ViT's forward at its key(0) parameters on the ViT example's first batch, each along the tangent
// scripts/higher_order_golden.py draws (leaf i: tg::random::normal(fold_in(key(7), i)), JAX's numbers bit
// for bit), compared with tests/data/higher_order_golden.json. f32 on the CPU (TG_GOLDEN_CUDA selects
// tg::Cuda for an nvcc build; none is configured yet). Exit 0 when every quantity is within 1e-6 relative.
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/dataset.hpp"
#include "fashion_mnist/codelab.hpp"
#include "vit_fashion_mnist/vit.hpp"

#if defined(TG_GOLDEN_CUDA)
using D = tg::Cuda;
#else
using D = tg::Cpu;
#endif
using json = nlohmann::json;
namespace ex = examples;

namespace {

constexpr double tolerance = 1e-6;
bool all_ok = true;

/// The first `n` training images in np.random.default_rng(seed)'s order (pixels / 255 in f32), with labels,
/// as the examples cut them.
tg::data::Batch<D> first_batch(const ex::Split& train, std::int64_t n, std::uint32_t seed) {
  const auto order = tg::random::numpy::default_rng(seed).permutation(train.labels.size());
  return tg::data::fixed_batches<D>(train.images, train.labels, n, 10, std::span<const std::int64_t>(order))[0];
}

/// ours against JAX's values: the L2 norm of all values (relative) and the golden file's sample of them,
/// every stride-th (max |difference| over max |value|).
void compare(const std::string& what, const std::vector<float>& ours, const json& want) {
  const auto values = want.at("values").get<std::vector<double>>();
  const auto stride = want.at("stride").get<std::size_t>();
  double norm = 0, diff = 0, scale = 0;
  for (float v : ours) norm += static_cast<double>(v) * v;
  norm = std::sqrt(norm);
  for (std::size_t i = 0; i < values.size() && i * stride < ours.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(ours[i * stride]) - values[i]));
    scale = std::max(scale, std::fabs(values[i]));
  }
  const double want_norm = want.at("norm").get<double>();
  const double norm_err = std::fabs(norm - want_norm) / want_norm, value_err = scale > 0 ? diff / scale : diff;
  const bool ok = ours.size() == want.at("size").get<std::size_t>() && norm_err <= tolerance && value_err <= tolerance;
  all_ok = all_ok && ok;
  std::printf("  %-28s %8zu values (%zu compared)  norm %.9g (JAX %.9g, %.2e)  max |diff| / max |value| %.2e  %s\n", what.c_str(), ours.size(), values.size(), norm,
              want_norm, norm_err, value_err, ok ? "ok" : "DIFFERENT");
}

/// A tangent like `params`: the leaf of rank `index_of(path)` is normal(fold_in(key(7), rank)).
template <class Tree, class IndexOf>
Tree tangent_like(const Tree& params, std::uint32_t key, IndexOf index_of) {
  Tree t = params;
  tg::tree_for_each([&](const std::string& path, auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    leaf = tg::random::normal<typename L::value_type, D>(tg::random::fold_in(tg::random::key(key), index_of(path)), leaf.shape());
  }, t);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string golden_path = argc > 1 ? argv[1] : TG_HIGHER_ORDER_GOLDEN;
  std::ifstream in(golden_path);
  if (!in) {
    std::fprintf(stderr, "higher_order_golden: cannot open %s (scripts/higher_order_golden.py writes it)\n", golden_path.c_str());
    return 2;
  }
  const json golden = json::parse(in);
  const auto key = golden.at("tangent_key").get<std::uint32_t>();
  try {
    const ex::Split train = ex::find_and_load("", /*allow_download=*/false, /*verify=*/true, /*quiet=*/true).train;

    // 1. The codelab's loss: H v by tg::hvp (jvp of grad), leaf by leaf.
    const json& ch = golden.at("codelab_hvp");
    const auto [x, y] = first_batch(train, ch.at("batch").get<std::int64_t>(), ch.at("data_order_seed").get<std::uint32_t>());
    const auto params = codelab::init_mlp_params<D>(tg::random::key(ch.at("params_key").get<std::int64_t>()));
    const std::vector<std::string> names = tg::tree_paths(params);
    const auto v = tangent_like(params, key, [&](const std::string& p) {
      return static_cast<std::uint32_t>(std::find(names.begin(), names.end(), p) - names.begin());
    });
    const double loss = codelab::cross_entropy_loss(params, x, y).item();
    std::printf("codelab loss at key(1) on its first batch: %.9g (JAX %.9g)\n", loss, ch.at("loss").get<double>());
    const auto hv = tg::hvp(codelab::cross_entropy_loss<D>, params, v, x, y);
    std::printf("Hessian-vector product of the codelab's loss (tg::hvp) beside jax.jvp(jax.grad(loss)):\n");
    tg::tree_for_each([&](const std::string& path, const auto& leaf) { compare(path, leaf.template to<tg::Cpu>().to_vector(), ch.at("leaves").at(path)); }, hv);

    // 2. The ViT forward: its JVP by tg::jvp along a tangent keyed by the leaves' sorted names.
    const json& vj = golden.at("vit_jvp");
    const vit::Config c{};
    const auto vparams = vit::init_params<D>(tg::random::key(vj.at("params_key").get<std::int64_t>()), c);
    const auto order = vj.at("tangent_leaf_order").get<std::vector<std::string>>();
    const auto vt = tangent_like(vparams, key, [&](const std::string& p) {
      const auto it = std::find(order.begin(), order.end(), p);
      if (it == order.end()) throw std::runtime_error("the golden file names no ViT leaf '" + p + "'; regenerate it");
      return static_cast<std::uint32_t>(it - order.begin());
    });
    const auto vx = first_batch(train, vj.at("batch").get<std::int64_t>(), vj.at("data_order_seed").get<std::uint32_t>()).x;
    auto forward = [&](const vit::Vit<D>& p) { return vit::forward<float>(p, vx, c); };
    const auto [logits, logits_t] = tg::jvp(forward, vparams, vt);
    std::printf("JVP of the ViT forward (tg::jvp) beside jax.jvp(forward):\n");
    compare("logits", logits.to<tg::Cpu>().to_vector(), vj.at("logits"));
    compare("logits tangent", logits_t.to<tg::Cpu>().to_vector(), vj.at("logits_tangent"));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "higher_order_golden: %s\n", e.what());
    return 2;
  }
  std::printf(all_ok ? "All match JAX within 1e-6 relative.\n" : "SOME DO NOT MATCH JAX within 1e-6 relative.\n");
  return all_ok ? 0 : 1;
}
