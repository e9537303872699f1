// Forward mode: what a JVP and a Hessian-vector product cost against the forward pass and the gradient
// they are built on, in the same process, each way tapegrad can compute them: by the ops' JVP rules
// (tg::jvp, tg::hvp) and by transposing the recorded VJP (tg::detail::jvp_by_transposition, what jvp did
// before the rules, and still does for a function with an op that has none). Eager, f32, on the CPU.
//  1. The MLP of the HVP comparison (issue 38): 64 -> 256 -> 128 -> 10, tanh and layer_norm after each hidden
//     layer, 51,594 parameters, batch 256, mean softmax cross-entropy: forward, grad, the JVP of the logits
//     in the parameters, the HVP of the loss.
//  2. The ViT's forward (examples/vit_fashion_mnist, its default size), batch --vit-batch: the JVP of the
//     logits in the parameters.
//  3. The PINN's network (examples/pinn_poisson, width 32) at 1,024 points: the JVP of u in the parameters,
//     and its Laplacian (jvp of grad in the points, the loss's inner part).
// Prints the medians (ms) and the ratios JVP / forward and HVP / grad. scripts/bench_forward_jax.py times
// the same in JAX under jax.jit.
//   bench_forward [--runs R] [--reps N] [--vit-batch B] [--only mlp|vit|pinn]
#include <tapegrad/tapegrad.hpp>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "timing.hpp"
#include "../examples/pinn_poisson/pinn.hpp"
#include "../examples/vit_fashion_mnist/vit.hpp"

namespace {

using D = tg::Cpu;
using T = tg::Tensor<float, D>;
namespace rnd = tg::random;

struct Mlp {
  T w1, b1, s1, o1, w2, b2, s2, o2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, s1, o1, w2, b2, s2, o2, w3, b3)

Mlp init_mlp(int seed) {
  auto w = [&](int k, std::int64_t in, std::int64_t out) { return rnd::normal<float, D>(rnd::key(seed + k), {in, out}) * (1.0f / std::sqrt(static_cast<float>(in))); };
  auto b = [&](int k, std::int64_t n) { return rnd::normal<float, D>(rnd::key(seed + k), {n}) * 0.1f; };
  return {w(0, 64, 256), b(1, 256), b(2, 256) + 1.0f, b(3, 256), w(4, 256, 128), b(5, 128), b(6, 128) + 1.0f, b(7, 128), w(8, 128, 10), b(9, 10)};
}

T logits(const Mlp& p, const T& x) {
  auto h = tg::layer_norm(tg::tanh(tg::linear(x, p.w1, p.b1)), p.s1, p.o1);
  h = tg::layer_norm(tg::tanh(tg::linear(h, p.w2, p.b2)), p.s2, p.o2);
  return tg::linear(h, p.w3, p.b3);
}

T loss(const Mlp& p, const T& x, const tg::Tensor<std::int32_t, D>& y) { return tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits(p, x), y)); }

template <class F>
double ms(int runs, int reps, F&& f) {
  return bench::median_ms(runs, reps, f);
}

void row(const char* what, double t, double base, const char* of) { std::printf("  %-44s %9.3f ms   %5.2fx %s\n", what, t, t / base, of); }

}  // namespace

int main(int argc, char** argv) {
  int runs = 5, reps = 10;
  std::int64_t vit_batch = 128;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::stoll(argv[++i]) : 0LL; };
    if (a == "--runs") runs = static_cast<int>(next());
    else if (a == "--reps") reps = static_cast<int>(next());
    else if (a == "--vit-batch") vit_batch = next();
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_forward [--runs R] [--reps N] [--vit-batch B] [--only mlp|vit|pinn]\n");
      return 2;
    }
  }
  tg::cpu::FlushDenormals flush;
  std::printf("bench_forward: medians of %d runs of %d calls, eager f32, %d OpenMP threads\n", runs, reps, omp_get_max_threads());

  if (only.empty() || only == "mlp") {
    const Mlp p = init_mlp(1), v = init_mlp(20);
    const T x = rnd::normal<float, D>(rnd::key(40), {256, 64});
    std::vector<std::int32_t> yv(256);
    for (std::size_t i = 0; i < yv.size(); ++i) yv[i] = static_cast<std::int32_t>((i * 7) % 10);
    const auto y = tg::from_vector<D>(yv, {256});
    std::printf("MLP 64-256-128-10, tanh + layer_norm, %lld parameters, batch 256\n", static_cast<long long>(tg::tree_count(p)));
    auto f = [&](const Mlp& q) { return logits(q, x); };
    auto l = [&](const Mlp& q) { return loss(q, x, y); };
    const double fwd = ms(runs, reps, [&] { f(p).data(); });
    const double grad = ms(runs, reps, [&] { tg::grad(l)(p).w1.data(); });
    const double jvp = ms(runs, reps, [&] { tg::jvp(f, p, v).second.data(); });
    const double jvp_t = ms(runs, reps, [&] { tg::detail::jvp_by_transposition(f, p, v).second.data(); });
    const double hvp = ms(runs, reps, [&] { tg::hvp(l, p, v).w1.data(); });
    auto g = [&](const Mlp& q) { return tg::grad(l)(q); };
    const double hvp_t = ms(runs, reps, [&] { tg::detail::jvp_by_transposition(g, p, v).second.w1.data(); });
    row("forward (logits)", fwd, fwd, "forward");
    row("jvp of the logits, by the rules", jvp, fwd, "forward");
    row("jvp of the logits, by transposition", jvp_t, fwd, "forward");
    row("grad of the loss", grad, grad, "grad");
    row("hvp of the loss, by the rules", hvp, grad, "grad");
    row("hvp of the loss, by transposition", hvp_t, grad, "grad");
  }
  if (only.empty() || only == "vit") {
    const vit::Config c;
    const auto p = vit::init_params<D>(rnd::key(0), c), v = vit::init_params<D>(rnd::key(5), c);
    const T x = rnd::uniform<float, D>(rnd::key(41), {vit_batch, c.image, c.image});
    std::printf("ViT forward (%s), batch %lld\n", c.str().c_str(), static_cast<long long>(vit_batch));
    auto f = [&](const vit::Vit<D>& q) { return vit::forward<float>(q, x, c); };
    const double fwd = ms(runs, std::max(1, reps / 5), [&] { f(p).data(); });
    const double jvp = ms(runs, std::max(1, reps / 5), [&] { tg::jvp(f, p, v).second.data(); });
    const double jvp_t = ms(runs, std::max(1, reps / 5), [&] { tg::detail::jvp_by_transposition(f, p, v).second.data(); });
    row("forward (logits)", fwd, fwd, "forward");
    row("jvp of the logits, by the rules", jvp, fwd, "forward");
    row("jvp of the logits, by transposition", jvp_t, fwd, "forward");
  }
  if (only.empty() || only == "pinn") {
    const auto p = pinn::init_params<D>(rnd::key(0), 32), v = pinn::init_params<D>(rnd::key(9), 32);
    const auto col = pinn::collocation<D>(32);
    std::printf("PINN network (width 32) at %lld points\n", static_cast<long long>(col.xy.dim(0)));
    auto f = [&](const pinn::Mlp<D>& q) { return pinn::u(q, col.xy); };
    const double fwd = ms(runs, reps, [&] { f(p).data(); });
    const double jvp = ms(runs, reps, [&] { tg::jvp(f, p, v).second.data(); });
    const double jvp_t = ms(runs, reps, [&] { tg::detail::jvp_by_transposition(f, p, v).second.data(); });
    auto grad_u = [&](const T& points) { return tg::grad([&](const T& q) { return tg::sum(pinn::u(p, q)); })(points); };
    const double grad = ms(runs, reps, [&] { grad_u(col.xy).data(); });
    const double lap = ms(runs, reps, [&] { tg::jvp(grad_u, col.xy, col.e0).second.data(); });
    const double lap_t = ms(runs, reps, [&] { tg::detail::jvp_by_transposition(grad_u, col.xy, col.e0).second.data(); });
    const double loss_grad = ms(runs, reps, [&] {
      tg::grad([&](const pinn::Mlp<D>& q) { return pinn::loss(q, col.xy, col.f, col.e0, col.e1); })(p).w1.data();
    });
    row("forward (u)", fwd, fwd, "forward");
    row("jvp of u in the parameters, by the rules", jvp, fwd, "forward");
    row("jvp of u in the parameters, by transposition", jvp_t, fwd, "forward");
    row("grad of sum(u) in the points", grad, grad, "grad");
    row("jvp of that grad along e0, by the rules", lap, grad, "grad");
    row("jvp of that grad along e0, by transposition", lap_t, grad, "grad");
    row("the training step's gradient (eager)", loss_grad, grad, "grad");
  }
  return 0;
}
