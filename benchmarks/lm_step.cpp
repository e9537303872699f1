// A small transformer language model's training step, as a user would write one: token embeddings
// gathered with take (scatter-added back by its segment sum), learned positions, pre-norm blocks with
// causal dot_product_attention and a GELU MLP, the output projection tied to the embedding (logits =
// h emb^T), next-token cross-entropy, AdamW, the step compiled with its parameters and state donated.
// scripts/bench_lm_jax.py is the same model and step in JAX + Optax; scripts/bench-lm-vs-jax runs both
// alternately and prints the ratio.
//   bench_lm_step [--runs R] [--steps S] [--batch B] [--length T] [--vocab V] [--dim E] [--layers L]
#include <tapegrad/tapegrad.hpp>

#include "../examples/vit_fashion_mnist/vit.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using D = tg::Cpu;
using Tensor = tg::Tensor<float, D>;
using Ids = tg::Tensor<std::int32_t, D>;

struct Config {
  std::int64_t batch = 16, length = 64, vocab = 2048, dim = 128, heads = 4, layers = 2, mlp = 512;
};

/// The model: vit's Dense, LayerNorm and Block (the same pre-norm block), a token embedding (vocab, dim)
/// that is also the output projection, learned positions (length, dim), a final LayerNorm.
struct Gpt {
  Tensor emb, pos;
  std::vector<vit::Block<D>> blocks;
  vit::LayerNorm<D> ln;
};
TG_PYTREE(Gpt, emb, pos, blocks, ln)

Gpt init(const Config& c) {
  namespace rnd = tg::random;
  auto dense = [](rnd::Key k, std::int64_t in, std::int64_t out) {
    return vit::Dense<D>{rnd::normal<float, D>(k, {in, out}) * static_cast<float>(1.0 / std::sqrt(static_cast<double>(in))), tg::zeros<float, D>({out})};
  };
  auto norm = [&] { return vit::LayerNorm<D>{tg::ones<float, D>({c.dim}), tg::zeros<float, D>({c.dim})}; };
  Gpt p{rnd::normal<float, D>(rnd::key(1), {c.vocab, c.dim}) * 0.02f, rnd::normal<float, D>(rnd::key(2), {c.length, c.dim}) * 0.02f, {}, norm()};
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const auto k = rnd::split(rnd::fold_in(rnd::key(3), static_cast<std::uint32_t>(l)), 4);
    p.blocks.push_back({norm(), dense(k[0], c.dim, 3 * c.dim), dense(k[1], c.dim, c.dim), norm(), dense(k[2], c.dim, c.mlp), dense(k[3], c.mlp, c.dim)});
  }
  return p;
}

/// Mean next-token cross-entropy of tokens (B, T) predicting targets (B, T).
Tensor loss(const Gpt& p, const Ids& tokens, const Ids& targets, const Config& c) {
  const std::int64_t B = tokens.dim(0), T = tokens.dim(1), hd = c.dim / c.heads;
  auto h = tg::take(p.emb, tokens, 0) + p.pos;  // (B, T, dim)
  for (const auto& b : p.blocks) {
    const auto qkv = b.qkv(b.ln1(h, 1e-6).reshape({B * T, c.dim})).reshape({B, T, 3, c.heads, hd});
    const auto a = tg::dot_product_attention(tg::index_in_dim(qkv, 0, 2), tg::index_in_dim(qkv, 1, 2), tg::index_in_dim(qkv, 2, 2), {.is_causal = true});
    h = h + b.out(a.reshape({B * T, c.dim})).reshape({B, T, c.dim});
    h = h + b.fc2(b.fc1(b.ln2(h, 1e-6).reshape({B * T, c.dim}), tg::Activation::gelu)).reshape({B, T, c.dim});
  }
  const auto logits = tg::matmul(p.ln(h, 1e-6).reshape({B * T, c.dim}), p.emb, false, true);  // tied: (B T, vocab)
  return tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, targets.reshape({B * T})));
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  int runs = 5, steps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::stoll(argv[++i]) : 0LL; };
    if (a == "--runs") runs = static_cast<int>(next());
    else if (a == "--steps") steps = static_cast<int>(next());
    else if (a == "--batch") c.batch = next();
    else if (a == "--length") c.length = next();
    else if (a == "--vocab") c.vocab = next();
    else if (a == "--dim") c.dim = next();
    else if (a == "--layers") c.layers = next();
    else {
      std::fprintf(stderr, "usage: bench_lm_step [--runs R] [--steps S] [--batch B] [--length T] [--vocab V] [--dim E] [--layers L]\n");
      return 2;
    }
  }
  tg::cpu::FlushDenormals flush;
  const auto optimizer = tg::optim::adamw(1e-3, {.weight_decay = 0.01});
  Gpt params = init(c);
  auto state = optimizer.init(params);
  const auto ids = tg::random::bits<D>(tg::random::key(7), {c.batch, c.length + 1}).to_vector();
  std::vector<std::int32_t> tok, tgt;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t t = 0; t < c.length; ++t) {
      tok.push_back(static_cast<std::int32_t>(ids[static_cast<std::size_t>(b * (c.length + 1) + t)] % c.vocab));
      tgt.push_back(static_cast<std::int32_t>(ids[static_cast<std::size_t>(b * (c.length + 1) + t + 1)] % c.vocab));
    }
  const Ids tokens = tg::from_vector(tok, {c.batch, c.length}), targets = tg::from_vector(tgt, {c.batch, c.length});
  auto step = [&](const Gpt& p, const decltype(state)& s, const Ids& x, const Ids& y) {
    auto [l, g] = tg::value_and_grad([&](const Gpt& q) { return loss(q, x, y, c); })(p);
    auto [u, ns] = optimizer.update(g, s, p);
    return std::make_tuple(tg::optim::apply_updates(p, u), ns, l);
  };
  auto compiled = tg::compile(step);
  float first = 0, last = 0;
  auto run = [&] {
    auto [p, s, l] = compiled(std::move(params), std::move(state), tokens, targets);
    params = std::move(p), state = std::move(s);
    return l;
  };
  first = run().item();
  std::vector<double> rates;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    Tensor l;
    for (int i = 0; i < steps; ++i) l = run();
    last = l.item();
    rates.push_back(static_cast<double>(steps * c.batch) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  std::printf("bench_lm_step: tapegrad %s, %d OpenMP threads; batch %lld x %lld tokens, vocab %lld, dim %lld, %lld layers, %lld heads, "
              "MLP %lld; %zu kernels per compiled step, plan %.1f MB; loss %.4f -> %.4f\n",
              tg::version, tg::cpu::threads(), static_cast<long long>(c.batch), static_cast<long long>(c.length), static_cast<long long>(c.vocab),
              static_cast<long long>(c.dim), static_cast<long long>(c.layers), static_cast<long long>(c.heads), static_cast<long long>(c.mlp),
              compiled.kernels(), static_cast<double>(compiled.memory_bytes()) / 1e6, first, last);
  std::printf("  LM compiled f32  %10.0f sequences/s  %12.0f tokens/s  (min %.0f, max %.0f)\n", median, median * static_cast<double>(c.length), rates.front(),
              rates.back());
  std::printf("{\"sequences_per_sec\": %.1f, \"tokens_per_sec\": %.1f}\n", median, median * static_cast<double>(c.length));
}
