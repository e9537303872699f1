// dot_product_attention forward + backward, its two implementations side by side in one process (composed:
// einsum, masked logits, softmax, einsum; fused: one kernel forward, two backward), over problem sizes from
// the ViT example's (16 tokens, head_dim 16) to a 1,024-token sequence: the measurements behind the
// `automatic` choice (detail::attention_fused_is_faster).
//   bench_attention [--runs R] [--bf16]
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "timing.hpp"

namespace {

template <class T>
struct Qkv {
  tg::Tensor<T> q, k, v;
};
TG_PYTREE(Qkv, q, k, v)

struct Problem {
  std::int64_t B, T, N, H;
  bool causal;
};

template <class T>
void run(const Problem& p, int runs) {
  namespace rnd = tg::random;
  using Ten = tg::Tensor<T>;
  const Ten q = tg::cast<T>(rnd::normal<float>(rnd::key(1), {p.B, p.T, p.N, p.H}));
  const Ten k = tg::cast<T>(rnd::normal<float>(rnd::key(2), {p.B, p.T, p.N, p.H}));
  const Ten v = tg::cast<T>(rnd::normal<float>(rnd::key(3), {p.B, p.T, p.N, p.H}));
  const Ten w = tg::cast<T>(rnd::normal<float>(rnd::key(4), {p.B, p.T, p.N, p.H}));
  const Qkv<T> params{q, k, v};
  double ms[2] = {};
  const tg::AttentionImplementation which[2] = {tg::AttentionImplementation::composed, tg::AttentionImplementation::fused};
  for (int i = 0; i < 2; ++i) {
    const tg::AttentionOptions o{.is_causal = p.causal, .implementation = which[i]};
    auto step = tg::compile([&] {
      return tg::grad([&](const Qkv<T>& x) { return tg::sum(tg::cast<float>(tg::dot_product_attention(x.q, x.k, x.v, o) * w)); })(params);
    });
    const double flops = 4.0 * p.B * p.N * p.T * p.T * p.H * 3.5;  // forward 2 GEMMs, backward 5
    const int reps = std::max(1, static_cast<int>(2e8 / flops));
    ms[i] = bench::median_ms(runs, reps, [&] { (void)step(); });
  }
  std::printf("  B %4lld  T %5lld  N %2lld  H %3lld  %-6s  composed %9.3f ms  fused %9.3f ms  fused / composed time %5.2f\n",
              static_cast<long long>(p.B), static_cast<long long>(p.T), static_cast<long long>(p.N), static_cast<long long>(p.H),
              p.causal ? "causal" : "", ms[0], ms[1], ms[1] / ms[0]);
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 5;
  bool bf16 = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc) runs = std::stoi(argv[++i]);
    else if (a == "--bf16") bf16 = true;
    else {
      std::fprintf(stderr, "usage: bench_attention [--runs R] [--bf16]\n");
      return 2;
    }
  }
  tg::cpu::FlushDenormals flush;
  std::printf("bench_attention: tapegrad %s, %d OpenMP threads, cpu, %s; compiled grad of sum(attention(q, k, v) w), median of %d runs\n",
              tg::version, tg::cpu::threads(), bf16 ? "bf16" : "f32", runs);
  const Problem problems[] = {{128, 16, 4, 16, false}, {64, 64, 4, 16, false}, {32, 128, 8, 32, false}, {16, 256, 8, 64, false},
                              {16, 256, 8, 64, true},  {4, 512, 8, 64, false},  {2, 1024, 8, 64, true}};
  for (const Problem& p : problems) bf16 ? run<tg::bf16>(p, runs) : run<float>(p, runs);
  return 0;
}
