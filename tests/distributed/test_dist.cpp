// tg::dist under `mpirun -np 2` (CPU ranks over MPI, loopback): collectives on trees of mixed dtypes,
// broadcast, a data-parallel AdamW step (each rank half of the global batch) against one rank on the whole
// batch, the same step compiled, the cross-rank identity check, and the cost of one all-reduce of the
// codelab MLP's gradients. `--fail-rank R` makes rank R fail before a collective: every rank must exit
// (MPI_Abort) with a message instead of waiting forever. Prints "ok"/"FAIL" lines; exit status 1 on FAIL.
#include <tapegrad/tapegrad.hpp>
#include <tapegrad/distributed/distributed.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace dist_test {
struct Mixed {
  tg::Tensor<float> a;
  tg::Tensor<double> b;
  tg::Tensor<tg::bf16> c;
  tg::Tensor<std::int32_t> count;
  std::vector<tg::Tensor<std::uint8_t>> bytes;
};
TG_PYTREE(Mixed, a, b, c, count, bytes)

struct Mlp {
  tg::Tensor<float> w1, b1, w2, b2;
};
TG_PYTREE(Mlp, w1, b1, w2, b2)

struct Big {
  tg::Tensor<float> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Big, w1, b1, w2, b2, w3, b3)
}  // namespace dist_test

using namespace dist_test;

namespace {

int failures = 0;
void check(bool ok, const std::string& what) {
  auto& comm = tg::dist::Communicator::world();
  if (comm.rank() == 0 || !ok) std::printf("%s rank %d: %s\n", ok ? "ok  " : "FAIL", comm.rank(), what.c_str());
  failures += !ok;
}

tg::Tensor<float> loss(const Mlp& p, const tg::Tensor<float>& x, const tg::Tensor<std::int32_t>& y) {
  const auto h = tg::linear(x, p.w1, p.b1, tg::Activation::gelu);
  return tg::mean(tg::softmax_cross_entropy_with_integer_labels(tg::linear(h, p.w2, p.b2), y));
}

const auto optimizer = tg::optim::adamw(3e-3, {.weight_decay = 1e-4});
using State = decltype(optimizer.init(std::declval<Mlp>()));

/// One AdamW step; with `data_parallel`, the gradients are averaged over the ranks first.
std::tuple<Mlp, State> step(const Mlp& p, const State& s, const tg::Tensor<float>& x, const tg::Tensor<std::int32_t>& y, bool data_parallel) {
  auto grads = tg::grad(loss)(p, x, y);
  if (data_parallel) grads = tg::dist::all_reduce_mean(grads);
  auto [updates, next] = optimizer.update(grads, s, p);
  return {tg::optim::apply_updates(p, updates), next};
}

double max_abs_diff(const Mlp& a, const Mlp& b) {
  double m = 0;
  tg::tree_for_each([&](const std::string&, const auto& u, const auto& v) {
    const auto x = u.to_vector(), y = v.to_vector();
    for (std::size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(x[i]) - y[i]));
  }, a, b);
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  auto& comm = tg::dist::Communicator::world();
  const int rank = comm.rank(), size = comm.size();
  try {
    if (argc == 3 && std::strcmp(argv[1], "--fail-rank") == 0) {
      if (rank == std::atoi(argv[2])) throw tg::Error("[test] this rank fails on purpose before the all-reduce");
      (void)tg::dist::all_reduce_mean(tg::ones<float>({4}));  // the other ranks wait here
      comm.barrier();
      return 0;
    }
    if (rank == 0) std::printf("tg::dist: %d ranks\n", size);

    // Mixed dtypes: floating leaves averaged, integer leaves untouched.
    const float r = static_cast<float>(rank);
    Mixed m{tg::full<float>({3}, r + 1.0f), tg::full<double>({2, 2}, 10.0 * (r + 1.0)), tg::full<tg::bf16>({5}, tg::bf16(2.0f * (r + 1.0f))),
            tg::full<std::int32_t>({}, 7), {tg::full<std::uint8_t>({2}, static_cast<std::uint8_t>(rank))}};
    const Mixed avg = tg::dist::all_reduce_mean(m);
    const double mean_r = (size - 1) / 2.0;  // mean of 0..size-1
    check(avg.a.to_vector() == std::vector<float>(3, static_cast<float>(mean_r + 1.0)), "f32 leaf averaged");
    check(avg.b.to_vector() == std::vector<double>(4, 10.0 * (mean_r + 1.0)), "f64 leaf averaged");
    check(static_cast<float>(avg.c.to_vector()[4]) == static_cast<float>(2.0 * (mean_r + 1.0)), "bf16 leaf averaged");
    check(avg.count.item() == 7 && avg.bytes[0].to_vector()[0] == static_cast<std::uint8_t>(rank), "integer leaves untouched");

    // Broadcast: every rank ends with rank 0's tree, all dtypes.
    Mixed b = m;
    tg::dist::broadcast(b, 0);
    check(b.a.to_vector()[0] == 1.0f && b.b.to_vector()[3] == 10.0 && static_cast<float>(b.c.to_vector()[0]) == 2.0f &&
              b.bytes[0].to_vector()[1] == 0,
          "broadcast from rank 0, every dtype");

    // Data parallel: a global batch of 64 split over the ranks vs one rank on all 64.
    const std::int64_t global = 64, shard = global / size, in = 20, hidden = 16, classes = 4;
    const auto k = tg::random::split(tg::random::key(3), 4);
    Mlp init{tg::random::normal(k[0], {in, hidden}) * 0.3f, tg::zeros<float>({hidden}), tg::random::normal(k[1], {hidden, classes}) * 0.3f,
             tg::zeros<float>({classes})};
    tg::dist::broadcast(init, 0);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(global));
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>((i * 7) % classes);
    const auto x_all = tg::random::uniform(k[2], {global, in});
    const auto y_all = tg::from_vector(labels, {global});
    std::vector<float> xs = x_all.to_vector();
    const auto x_shard = tg::from_vector(std::vector<float>(xs.begin() + rank * shard * in, xs.begin() + (rank + 1) * shard * in), {shard, in});
    const auto y_shard = tg::from_vector(std::vector<std::int32_t>(labels.begin() + rank * shard, labels.begin() + (rank + 1) * shard), {shard});

    Mlp single = init, dp = init, dpc = init;
    State s_single = optimizer.init(init), s_dp = s_single, s_dpc = s_single;
    auto compiled = tg::compile([](const Mlp& p, const State& s, const tg::Tensor<float>& x, const tg::Tensor<std::int32_t>& y) {
      return step(p, s, x, y, true);
    });
    const int steps = 20;
    for (int i = 0; i < steps; ++i) {
      std::tie(single, s_single) = step(single, s_single, x_all, y_all, false);
      std::tie(dp, s_dp) = step(dp, s_dp, x_shard, y_shard, true);
      std::tie(dpc, s_dpc) = compiled(std::move(dpc), std::move(s_dpc), x_shard, y_shard);
    }
    const double diff = max_abs_diff(single, dp);
    // Tolerance: the mean over 64 examples and the mean of per-rank means differ in summation order only
    // (a few f32 ulps of the gradient per step); through 20 AdamW steps of lr 3e-3 that stays far below
    // 1e-5 in parameters of size ~0.3, while a wrong average (a sum, or one rank's gradient) moves them by
    // more than 1e-3 within a step.
    char line[160];
    std::snprintf(line, sizeof line, "%d ranks x %lld examples vs 1 rank x %lld, %d AdamW steps: max |param diff| = %.3g (tolerance 1e-5)", size,
                  static_cast<long long>(shard), static_cast<long long>(global), steps, diff);
    check(diff <= 1e-5, line);
    check(max_abs_diff(dp, dpc) == 0.0 && compiled.recordings() == 1, "the compiled data-parallel step equals the eager one bitwise");
    tg::dist::check_identical(dp, "parameters");
    check(true, "parameters identical on every rank (hash)");
    Mlp drifted = dp;
    if (rank == size - 1 && size > 1) drifted.b2 = drifted.b2 + 1e-7f;
    bool caught = false;
    try {
      tg::dist::check_identical(drifted, "parameters");
    } catch (const tg::Error& e) {
      caught = std::string(e.what()).find("differs between rank 0 and rank " + std::to_string(size - 1)) != std::string::npos;
    }
    check(size == 1 || caught, "a parameter that drifted on one rank is caught on every rank");

    // The cost of one all-reduce of the codelab MLP's gradients (235,146 floats).
    Big g{tg::ones<float>({784, 256}), tg::ones<float>({256}), tg::ones<float>({256, 128}), tg::ones<float>({128}), tg::ones<float>({128, 10}),
          tg::ones<float>({10})};
    for (int i = 0; i < 5; ++i) (void)tg::dist::all_reduce_mean(g);
    comm.barrier();
    const int reps = 50;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) (void)tg::dist::all_reduce_mean(g);
    comm.barrier();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
    if (rank == 0) std::printf("info: one all_reduce_mean of the 784-256-128-10 MLP's gradients (235,146 floats, 0.94 MB), %d ranks: %.0f us\n", size, us);
  } catch (const std::exception& e) {
    comm.abort(e.what());
  }
  if (rank == 0) std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
