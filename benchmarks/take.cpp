// take: an embedding's lookup and its gradient at GPT-2's size (a 50,257 x 768 f32 table, 8,192 token
// ids), forward and forward + backward, eager and compiled, with the memory floor measured in the same
// process: the forward copies 8,192 rows; the backward writes the whole 154 MB gradient and adds 8,192
// rows into it, so no implementation can beat a memset of the table plus the rows' copy.
//   bench_take [--runs R] [--vocab V] [--tokens T] [--dim D]          (scripts/bench-take-vs-jax: beside JAX)
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "timing.hpp"

int main(int argc, char** argv) {
  std::int64_t vocab = 50257, tokens = 8192, dim = 768;
  int runs = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::stoll(argv[++i]) : 0LL; };
    if (a == "--runs") runs = static_cast<int>(next());
    else if (a == "--vocab") vocab = next();
    else if (a == "--tokens") tokens = next();
    else if (a == "--dim") dim = next();
    else {
      std::fprintf(stderr, "usage: bench_take [--runs R] [--vocab V] [--tokens T] [--dim D]\n");
      return 2;
    }
  }
  tg::cpu::FlushDenormals flush;
  namespace rnd = tg::random;
  const auto table = rnd::normal<float>(rnd::key(1), {vocab, dim});
  auto ids_v = rnd::bits<tg::Cpu>(rnd::key(2), {tokens}).to_vector();
  std::vector<std::int32_t> ids(ids_v.size());
  for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = static_cast<std::int32_t>(ids_v[k] % static_cast<std::uint32_t>(vocab));
  const auto idx = tg::from_vector(ids, {tokens});
  const auto w = rnd::normal<float>(rnd::key(3), {tokens, dim});
  using T = tg::Tensor<float>;
  auto loss = [&](const T& t) { return tg::sum(tg::take(t, idx, 0) * w); };
  auto forward = [&](const T& t) { return tg::take(t, idx, 0); };
  auto backward = [&](const T& t) { return tg::grad(loss)(t); };
  // Compiled with the table captured (a constant of the plan), so that no call copies its 154 MB in.
  auto forward_c = tg::compile([&] { return forward(table); });
  auto backward_c = tg::compile([&] { return backward(table); });
  // The floor: the rows copied (forward); the gradient zeroed and the rows added (backward).
  std::vector<float> out(static_cast<std::size_t>(tokens * dim)), grad(static_cast<std::size_t>(vocab * dim));
  const float* tab = table.data();
  const float* wv = w.data();
  auto floor_fwd = [&] {
    for (std::int64_t k = 0; k < tokens; ++k) std::memcpy(out.data() + k * dim, tab + ids[static_cast<std::size_t>(k)] * dim, dim * sizeof(float));
  };
  auto floor_bwd = [&] {
    std::memset(grad.data(), 0, grad.size() * sizeof(float));
    for (std::int64_t k = 0; k < tokens; ++k) {
      float* g = grad.data() + ids[static_cast<std::size_t>(k)] * dim;
      const float* src = wv + k * dim;
      for (std::int64_t c = 0; c < dim; ++c) g[c] += src[c];
    }
  };
  std::printf("bench_take: tapegrad %s, %d OpenMP threads; table (%lld, %lld) f32, %lld token ids; median of %d runs, ms\n", tg::version,
              tg::cpu::threads(), static_cast<long long>(vocab), static_cast<long long>(dim), static_cast<long long>(tokens), runs);
  const double ff = bench::median_ms(runs, 20, floor_fwd), fb = bench::median_ms(runs, 5, floor_bwd);
  const double fe = bench::median_ms(runs, 20, [&] { (void)forward(table); });
  const double fc = bench::median_ms(runs, 20, [&] { (void)forward_c(); });
  const double be = bench::median_ms(runs, 5, [&] { (void)backward(table); });
  const double bc = bench::median_ms(runs, 5, [&] { (void)backward_c(); });
  std::printf("  forward           eager %8.3f ms  compiled %8.3f ms  floor (row copies, one thread) %8.3f ms\n", fe, fc, ff);
  std::printf("  forward+backward  eager %8.3f ms  compiled %8.3f ms  floor (memset + row adds, one thread) %8.3f ms\n", be, bc, fb);
  std::printf("{\"forward_ms\": %.4f, \"forward_backward_ms\": %.4f, \"forward_compiled_ms\": %.4f, \"forward_backward_compiled_ms\": %.4f}\n", fe,
              be, fc, bc);
  return 0;
}
