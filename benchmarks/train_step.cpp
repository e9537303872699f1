// bench_train_step: examples/sec of the codelab's training step (784-256-128-10 GELU MLP, softmax
// cross-entropy, AdamW 3e-3 / 1e-4) on the CPU, eager f32 and eager bf16 compute (f32 parameters),
// against the "GEMM floor": the same step's 8 GEMMs alone through oneDNN called directly, in the same
// process. Prints medians and min-max over several runs after warm-up, the ratios to the floor, peak
// RSS, and writes JSON. The compiled step (tg::compile) is not built yet; it will join this table.
//   bench_train_step [--batch N] [--runs R] [--steps S] [--json path] [--sweep]
#include <tapegrad/tapegrad.hpp>

#include <dnnl.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <omp.h>

namespace {

template <class T>
struct Mlp {
  tg::Tensor<T> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

struct Sizes {
  std::int64_t batch = 512, in = 784, h1 = 256, h2 = 128, out = 10;
};

Mlp<float> init(const Sizes& s) {
  const auto k = tg::random::split(tg::random::key(1), 3);
  auto he = [](tg::random::Key key, std::int64_t fan_in, std::int64_t fan_out) {
    return tg::random::normal(key, {fan_in, fan_out}) * static_cast<float>(std::sqrt(2.0 / static_cast<double>(fan_in)));
  };
  return {he(k[0], s.in, s.h1), tg::zeros<float>({s.h1}), he(k[1], s.h1, s.h2), tg::zeros<float>({s.h2}),
          he(k[2], s.h2, s.out), tg::zeros<float>({s.out})};
}

/// The loss with the forward pass in compute dtype C (f32 parameters cast per step, as JAX's mixed precision).
template <class C>
tg::Tensor<float> loss(const Mlp<float>& p, const tg::Tensor<float>& x, const tg::Tensor<std::int32_t>& y) {
  const auto h1 = tg::linear(x.cast<C>(), p.w1.cast<C>(), p.b1.cast<C>(), tg::Activation::gelu);
  const auto h2 = tg::linear(h1, p.w2.cast<C>(), p.b2.cast<C>(), tg::Activation::gelu);
  const auto logits = tg::linear(h2, p.w3.cast<C>(), p.b3.cast<C>()).template cast<float>();
  return tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y));
}

struct Stats {
  double median = 0, min = 0, max = 0;  // examples/sec
};

/// Runs `step` `steps` times per run after `warmup` steps; each run ends by reading a result back.
Stats measure(const std::function<float()>& step, std::int64_t batch, int runs, int steps, int warmup = 5) {
  for (int i = 0; i < warmup; ++i) (void)step();
  std::vector<double> eps;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    float last = 0;
    for (int i = 0; i < steps; ++i) last = step();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!std::isfinite(last)) std::fprintf(stderr, "warning: non-finite loss %f\n", last);
    eps.push_back(static_cast<double>(batch) * steps / s);
  }
  std::sort(eps.begin(), eps.end());
  return {eps[eps.size() / 2], eps.front(), eps.back()};
}

/// The step's 8 GEMMs through oneDNN's own API (primitives and memory created once).
struct GemmFloor {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::vector<std::pair<dnnl::matmul, std::unordered_map<int, dnnl::memory>>> gemms;

  explicit GemmFloor(const Sizes& s) {
    const std::int64_t B = s.batch;
    struct G { std::int64_t m, n, k; bool ta, tb; };
    const G list[] = {{B, s.h1, s.in, false, false}, {B, s.h2, s.h1, false, false}, {B, s.out, s.h2, false, false},
                      {s.in, s.h1, B, true, false},  {s.h1, s.h2, B, true, false},  {s.h2, s.out, B, true, false},
                      {B, s.h2, s.out, false, true}, {B, s.h1, s.h2, false, true}};
    using dims = dnnl::memory::dims;
    const auto f32 = dnnl::memory::data_type::f32;
    for (const G& g : list) {
      const dnnl::memory::desc a(dims{g.m, g.k}, f32, g.ta ? dims{1, g.m} : dims{g.k, 1});
      const dnnl::memory::desc b(dims{g.k, g.n}, f32, g.tb ? dims{1, g.k} : dims{g.n, 1});
      const dnnl::memory::desc c(dims{g.m, g.n}, f32, dims{g.n, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), engine);
      std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, dnnl::memory(a, engine)}, {DNNL_ARG_WEIGHTS, dnnl::memory(b, engine)},
                                                 {DNNL_ARG_DST, dnnl::memory(c, engine)}};
      for (auto& [k, m] : args) std::memset(m.get_data_handle(), 0, m.get_desc().get_size());
      gemms.emplace_back(dnnl::matmul(pd), std::move(args));
    }
  }
  float run() {
    for (auto& [prim, args] : gemms) prim.execute(stream, args);
    stream.wait();
    return 0.0f;
  }
};

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux reports KiB
}

struct Row {
  std::string mode;
  Sizes sizes;
  Stats stats;
  double floor_ratio;
};

template <class C>
std::function<float()> eager_step(Mlp<float>& params, const tg::Tensor<float>& x, const tg::Tensor<std::int32_t>& y) {
  static const auto optimizer = tg::optim::adamw(3e-3, {.weight_decay = 1e-4});
  auto state = std::make_shared<decltype(optimizer.init(params))>(optimizer.init(params));
  return [&params, &x, &y, state]() {
    auto [value, grads] = tg::value_and_grad(loss<C>)(params, x, y);
    auto [updates, next] = optimizer.update(grads, *state, params);
    params = tg::optim::apply_updates(params, updates);
    *state = next;
    return value.item();
  };
}

std::vector<Row> bench(const Sizes& s, int runs, int steps) {
  const auto x = tg::random::uniform(tg::random::key(2), {s.batch, s.in});
  std::vector<std::int32_t> labels(static_cast<std::size_t>(s.batch));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % static_cast<std::size_t>(s.out));
  const auto y = tg::from_vector(labels);
  GemmFloor floor(s);
  const Stats f = measure([&] { return floor.run(); }, s.batch, runs, steps);
  auto p32 = init(s);
  const Stats e32 = measure(eager_step<float>(p32, x, y), s.batch, runs, steps);
  auto p16 = init(s);
  const Stats e16 = measure(eager_step<tg::bf16>(p16, x, y), s.batch, runs, steps);
  return {{"GEMM floor (oneDNN f32)", s, f, 1.0}, {"eager f32", s, e32, e32.median / f.median}, {"eager bf16 compute", s, e16, e16.median / f.median}};
}

void print(const std::vector<Row>& rows) {
  for (const Row& r : rows)
    std::printf("  %-26s batch %5lld  hidden %4lld-%4lld  %10.0f ex/s  (min %9.0f, max %9.0f)  %5.2f x floor\n", r.mode.c_str(),
                static_cast<long long>(r.sizes.batch), static_cast<long long>(r.sizes.h1), static_cast<long long>(r.sizes.h2),
                r.stats.median, r.stats.min, r.stats.max, r.floor_ratio);
}

}  // namespace

int main(int argc, char** argv) {
  Sizes sizes;
  int runs = 5, steps = 20;
  std::string json_path = "train_step.json";
  bool sweep = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw tg::Error("[bench_train_step] " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--batch") sizes.batch = std::stoll(next());
    else if (a == "--runs") runs = std::stoi(next());
    else if (a == "--steps") steps = std::stoi(next());
    else if (a == "--json") json_path = next();
    else if (a == "--sweep") sweep = true;
    else {
      std::fprintf(stderr, "usage: bench_train_step [--batch N] [--runs R] [--steps S] [--json path] [--sweep]\n");
      return 2;
    }
  }
  std::printf("bench_train_step: tapegrad %s, oneDNN %d.%d.%d, %d OpenMP threads, cpu\n", tg::version, dnnl_version()->major,
              dnnl_version()->minor, dnnl_version()->patch, omp_get_max_threads());
  std::printf("step: 784-%lld-%lld-10 GELU MLP, softmax cross-entropy, adamw(3e-3, wd 1e-4); median of %d runs x %d steps\n",
              static_cast<long long>(sizes.h1), static_cast<long long>(sizes.h2), runs, steps);
  std::vector<Row> all = bench(sizes, runs, steps);
  print(all);
  if (sweep) {
    std::printf("sweep over batch sizes:\n");
    for (std::int64_t b : {128, 256, 1024, 2048, 4096, 8192}) {
      Sizes s = sizes;
      s.batch = b;
      auto rows = bench(s, 3, std::max(2, static_cast<int>(steps * 512 / b)));
      print(rows);
      all.insert(all.end(), rows.begin(), rows.end());
    }
    std::printf("sweep over hidden sizes (batch %lld):\n", static_cast<long long>(sizes.batch));
    for (auto [h1, h2] : {std::pair<std::int64_t, std::int64_t>{512, 256}, {1024, 512}}) {
      Sizes s = sizes;
      s.h1 = h1, s.h2 = h2;
      auto rows = bench(s, 3, steps);
      print(rows);
      all.insert(all.end(), rows.begin(), rows.end());
    }
  }
  std::printf("peak host RSS: %.1f MiB\n", peak_rss_mib());
  std::ofstream json(json_path);
  json << "{\n  \"device\": \"cpu\",\n  \"threads\": " << omp_get_max_threads() << ",\n  \"peak_rss_mib\": " << peak_rss_mib() << ",\n  \"rows\": [\n";
  for (std::size_t i = 0; i < all.size(); ++i) {
    const Row& r = all[i];
    json << "    {\"mode\": \"" << r.mode << "\", \"batch\": " << r.sizes.batch << ", \"hidden\": [" << r.sizes.h1 << ", " << r.sizes.h2
         << "], \"examples_per_sec_median\": " << r.stats.median << ", \"min\": " << r.stats.min << ", \"max\": " << r.stats.max
         << ", \"ratio_to_floor\": " << r.floor_ratio << "}" << (i + 1 < all.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
}
