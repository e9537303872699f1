// train_step: examples/sec of the codelab's training step (784-256-128-10 GELU MLP, softmax
// cross-entropy, AdamW 3e-3 / 1e-4) on the available device: eager f32, compiled f32 (tg::compile),
// compiled bf16 compute (f32 parameters), and the codelab's loop as users write it (value_and_grad with
// has_aux, adamw, compile, metrics read every 25 steps, eight batches in turn), against the "GEMM floor": the same step's 8 GEMMs alone,
// called straight through oneDNN (CPU) or cuBLASLt (CUDA) in the same process. Prints medians and
// min-max over several runs after warm-up (each run ends with the device synchronised), the ratios to the
// floor, peak memory, and writes JSON. The modes' runs are interleaved. Built by g++ as bench_train_step and by nvcc as
// bench_train_step_cuda (this file, included by train_step_cuda.cu).
//   bench_train_step [--batch N] [--runs R] [--steps S] [--json path] [--sweep] [--threads-sweep] [--keep-denormals] [--tf32]
// On CUDA it also reports the graph floor (the 8 GEMMs in one CUDA graph), the kernels per compiled step
// (the nodes of its graph) and, with --tf32, the compiled f32 step with TF32 allowed.
// On the CPU, subnormal floats are flushed to zero (tg::cpu::FlushDenormals, as XLA computes) unless
// --keep-denormals is given. --model vit and --model cnn time the ViT and CNN examples' steps instead.
#include <tapegrad/tapegrad.hpp>

#if defined(TG_BENCH_CUDA)
#include "direct_lt.hpp"
#else
#include <dnnl.hpp>
#endif

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <omp.h>

#include "../examples/cnn_fashion_mnist/cnn.hpp"
#include "../examples/vit_fashion_mnist/vit.hpp"

namespace {

#if defined(TG_BENCH_CUDA)
using Dev = tg::Cuda;
#else
using Dev = tg::Cpu;
#endif
using Tensor = tg::Tensor<float, Dev>;
using Labels = tg::Tensor<std::int32_t, Dev>;

template <class T>
struct Mlp {
  tg::Tensor<T, Dev> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

struct Sizes {
  std::int64_t batch = 512, in = 784, h1 = 256, h2 = 128, out = 10;
};

Mlp<float> init(const Sizes& s) {
  const auto k = tg::random::split(tg::random::key(1), 3);
  auto he = [](tg::random::Key key, std::int64_t fan_in, std::int64_t fan_out) {
    return tg::random::normal<float, Dev>(key, {fan_in, fan_out}) * static_cast<float>(std::sqrt(2.0 / static_cast<double>(fan_in)));
  };
  return {he(k[0], s.in, s.h1), tg::zeros<float, Dev>({s.h1}), he(k[1], s.h1, s.h2), tg::zeros<float, Dev>({s.h2}),
          he(k[2], s.h2, s.out), tg::zeros<float, Dev>({s.out})};
}

/// The loss with the forward pass in compute dtype C (f32 parameters cast per step, as JAX's mixed precision).
template <class C>
Tensor loss(const Mlp<float>& p, const Tensor& x, const Labels& y) {
  const auto h1 = tg::linear(tg::cast<C>(x), tg::cast<C>(p.w1), tg::cast<C>(p.b1), tg::Activation::gelu);
  const auto h2 = tg::linear(h1, tg::cast<C>(p.w2), tg::cast<C>(p.b2), tg::Activation::gelu);
  const auto logits = tg::cast<float>(tg::linear(h2, tg::cast<C>(p.w3), tg::cast<C>(p.b3)));
  return tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y));
}

// Optax's adamw as users write it: tg::optim::adamw runs its atoms as one pass (optim/adamw.hpp).
const auto optimizer = tg::optim::adamw(3e-3, {.weight_decay = 1e-4});
using OptState = decltype(optimizer.init(std::declval<Mlp<float>>()));

/// One training step: gradients, AdamW, new parameters; the loss stays on the device.
template <class C>
std::tuple<Mlp<float>, OptState, Tensor> train_step(const Mlp<float>& params, const OptState& state, const Tensor& x, const Labels& y) {
  auto [value, grads] = tg::value_and_grad(loss<C>)(params, x, y);
  auto [updates, next] = optimizer.update(grads, state, params);
  return {tg::optim::apply_updates(params, updates), next, value};
}

/// The codelab's step as its JAX code writes it, with the public API: the loss with the batch accuracy as
/// aux (value_and_grad with has_aux), adamw, apply_updates; the metrics stay on the device.
struct Metrics {
  Tensor loss, accuracy;
};
TG_PYTREE(Metrics, loss, accuracy)

std::pair<Tensor, Tensor> loss_with_accuracy(const Mlp<float>& p, const Tensor& x, const Labels& y) {
  const auto h1 = tg::linear(x, p.w1, p.b1, tg::Activation::gelu);
  const auto h2 = tg::linear(h1, p.w2, p.b2, tg::Activation::gelu);
  const auto logits = tg::linear(h2, p.w3, p.b3);
  return {tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::accuracy(logits, y)};
}

std::tuple<Mlp<float>, OptState, Metrics> codelab_step(const Mlp<float>& params, const OptState& state, const Tensor& x, const Labels& y) {
  auto [out, grads] = tg::value_and_grad(loss_with_accuracy, tg::has_aux)(params, x, y);
  auto [updates, next] = optimizer.update(grads, state, params);
  return {tg::optim::apply_updates(params, updates), next, Metrics{out.first, out.second}};
}

void synchronize() {
#if defined(TG_BENCH_CUDA)
  tg::cuda::synchronize();
#endif
}

struct Stats {
  double median = 0, min = 0, max = 0;  // examples/sec
};

struct Mode {
  std::string name;
  std::function<Tensor()> step;
  std::function<std::size_t()> kernels = {};  // per step, for the compiled modes: CPU kernels or CUDA graph nodes
};

/// Runs each mode's step `warmup` times, then `runs` rounds in which every mode runs `steps` steps in
/// turn (interleaved, so that a change in the machine's load hits all modes alike). Each run's clock stops
/// after the device has finished (the last loss is read back, which synchronises).
std::vector<Stats> measure(const std::vector<Mode>& modes, std::int64_t batch, int runs, int steps, int warmup = 5) {
  for (const Mode& m : modes)
    for (int i = 0; i < warmup; ++i) (void)m.step();
  synchronize();
  std::vector<std::vector<double>> eps(modes.size());
  for (int r = 0; r < runs; ++r) {
    for (std::size_t m = 0; m < modes.size(); ++m) {
      const auto t0 = std::chrono::steady_clock::now();
      Tensor last;
      for (int i = 0; i < steps; ++i) last = modes[m].step();
      const float value = last.defined() ? last.item() : 0.0f;
      synchronize();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!std::isfinite(value)) std::fprintf(stderr, "warning: %s: non-finite loss %f\n", modes[m].name.c_str(), value);
      eps[m].push_back(static_cast<double>(batch) * steps / s);
    }
  }
  std::vector<Stats> stats;
  for (auto& e : eps) {
    std::sort(e.begin(), e.end());
    stats.push_back({e[e.size() / 2], e.front(), e.back()});
  }
  return stats;
}

struct GemmList {
  std::int64_t m, n, k;
  bool ta, tb;
  std::int64_t batch = 1;  ///< a strided batch of this many GEMMs
};

std::vector<GemmList> step_gemms(const Sizes& s) {
  const std::int64_t B = s.batch;
  return {{B, s.h1, s.in, false, false}, {B, s.h2, s.h1, false, false}, {B, s.out, s.h2, false, false},
          {s.in, s.h1, B, true, false},  {s.h1, s.h2, B, true, false},  {s.h2, s.out, B, true, false},
          {B, s.h2, s.out, false, true}, {B, s.h1, s.h2, false, true}};
}

#if defined(TG_BENCH_CUDA)
/// The step's 8 GEMMs through cuBLASLt called directly (f32, or bf16 inputs with f32 accumulation).
struct GemmFloor {
  std::vector<std::unique_ptr<bench::DirectLt>> gemms;
  std::vector<tg::Tensor<float, Dev>> a, b, c;
  explicit GemmFloor(const std::vector<GemmList>& list) {
    for (const GemmList& g : list) {
      gemms.push_back(std::make_unique<bench::DirectLt>(bench::StepGemm{"", g.m, g.n, g.k, g.ta, g.tb}, CUDA_R_32F, g.batch));
      a.push_back(tg::zeros<float, Dev>({g.batch * g.m * g.k}));
      b.push_back(tg::zeros<float, Dev>({g.batch * g.k * g.n}));
      c.push_back(tg::zeros<float, Dev>({g.batch * g.m * g.n}));
    }
  }
  Tensor run() {
    for (std::size_t i = 0; i < gemms.size(); ++i) gemms[i]->run(a[i].data(), b[i].data(), c[i].data());
    return {};
  }
  static std::string name() { return "GEMM floor (cuBLASLt f32)"; }
};

/// The same 8 GEMMs captured once in one CUDA graph and replayed: the floor without 8 launches per step
/// (the compiled step is one graph launch too, so this is the fair floor at small batches).
struct GraphFloor {
  GemmFloor gemms;
  cudaGraphExec_t exec = nullptr;
  explicit GraphFloor(const std::vector<GemmList>& list) : gemms(list) {
    gemms.run();  // plans and workspace made outside the capture
    tg::cuda::synchronize();
    cudaGraph_t graph = nullptr;
    TG_CUDA_CHECK(cudaStreamBeginCapture(tg::cuda::stream(), cudaStreamCaptureModeThreadLocal));
    gemms.run();
    TG_CUDA_CHECK(cudaStreamEndCapture(tg::cuda::stream(), &graph));
    TG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    (void)cudaGraphDestroy(graph);
  }
  ~GraphFloor() {
    if (exec) (void)cudaGraphExecDestroy(exec);
  }
  GraphFloor(const GraphFloor&) = delete;
  GraphFloor& operator=(const GraphFloor&) = delete;
  Tensor run() {
    TG_CUDA_CHECK(cudaGraphLaunch(exec, tg::cuda::stream()));
    return {};
  }
};
#else
/// The step's 8 GEMMs through oneDNN's own API (primitives and memory created once).
struct GemmFloor {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::vector<std::pair<dnnl::matmul, std::unordered_map<int, dnnl::memory>>> gemms;

  explicit GemmFloor(const std::vector<GemmList>& list) {
    using dims = dnnl::memory::dims;
    const auto f32 = dnnl::memory::data_type::f32;
    for (const GemmList& g : list) {
      // A batch is a leading dimension whose stride is one whole matrix.
      auto md = [&](std::int64_t r, std::int64_t c, dims strides) {
        if (g.batch == 1) return dnnl::memory::desc(dims{r, c}, f32, strides);
        return dnnl::memory::desc(dims{g.batch, r, c}, f32, dims{r * c, strides[0], strides[1]});
      };
      const dnnl::memory::desc a = md(g.m, g.k, g.ta ? dims{1, g.m} : dims{g.k, 1});
      const dnnl::memory::desc b = md(g.k, g.n, g.tb ? dims{1, g.k} : dims{g.n, 1});
      const dnnl::memory::desc c = md(g.m, g.n, dims{g.n, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), engine);
      std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, dnnl::memory(a, engine)}, {DNNL_ARG_WEIGHTS, dnnl::memory(b, engine)},
                                                 {DNNL_ARG_DST, dnnl::memory(c, engine)}};
      for (auto& [k, m] : args) std::memset(m.get_data_handle(), 0, m.get_desc().get_size());
      gemms.emplace_back(dnnl::matmul(pd), std::move(args));
    }
  }
  Tensor run() {
    for (auto& [prim, args] : gemms) prim.execute(stream, args);
    stream.wait();
    return {};
  }
  static std::string name() { return "GEMM floor (oneDNN f32)"; }
};
#endif

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux reports KiB
}

/// Peak bytes in use in the library's CUDA memory pool (0 on the CPU).
double peak_device_mib() {
#if defined(TG_BENCH_CUDA)
  cudaMemPool_t pool;
  TG_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, tg::cuda::current_device()));
  std::uint64_t high = 0;
  TG_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
  return static_cast<double>(high) / (1024.0 * 1024.0);
#else
  return 0.0;
#endif
}

struct Row {
  std::string mode;
  Sizes sizes;
  int threads;
  Stats stats;
  double floor_ratio;
};

template <class C>
std::function<Tensor()> eager(Mlp<float> params, const Tensor& x, const Labels& y) {
  auto state = std::make_shared<OptState>(optimizer.init(params));
  auto p = std::make_shared<Mlp<float>>(std::move(params));
  return [p, state, x, y]() {
    auto [next_params, next_state, value] = train_step<C>(*p, *state, x, y);
    *p = std::move(next_params), *state = std::move(next_state);
    return value;
  };
}

template <class C>
Mode compiled(const std::string& name, Mlp<float> params, const Tensor& x, const Labels& y) {
  auto state = std::make_shared<OptState>(optimizer.init(params));
  auto p = std::make_shared<Mlp<float>>(std::move(params));
  auto step = std::make_shared<tg::Compiled<decltype(&train_step<C>)>>(tg::compile(&train_step<C>));
  return {name,
          [p, state, step, x, y]() {
            auto [next_params, next_state, value] = (*step)(std::move(*p), std::move(*state), x, y);  // donated
            *p = std::move(next_params), *state = std::move(next_state);
            return value;
          },
          [step] { return step->kernels(); }};
}

/// The codelab's AdamW loop: the compiled codelab_step over the batches in turn, its metrics read on the
/// host every 25 steps (as the codelab logs them), which also synchronises.
Mode codelab_loop(Mlp<float> params, const std::vector<Tensor>& xs, const std::vector<Labels>& ys) {
  struct Loop {
    Mlp<float> params;
    OptState state;
    tg::Compiled<decltype(&codelab_step)> step = tg::compile(&codelab_step);
    std::size_t i = 0;
    double logged = 0;
  };
  auto loop = std::make_shared<Loop>(Loop{params, optimizer.init(params)});
  return {"codelab loop f32",
          [loop, xs, ys]() {
            Loop& l = *loop;
            const std::size_t b = l.i % xs.size();
            auto [p, s, metrics] = l.step(std::move(l.params), std::move(l.state), xs[b], ys[b]);
            l.params = std::move(p), l.state = std::move(s);
            if (++l.i % 25 == 0) l.logged += metrics.loss.item() + metrics.accuracy.item();
            return metrics.loss;
          },
          [loop] { return loop->step.kernels(); }};
}

/// Kernels per step of the compiled modes (CPU: the plan's kernels; CUDA: the nodes of the step's graph).
void print_kernels(const std::vector<Mode>& modes) {
  std::string line;
  for (const Mode& m : modes)
    if (m.kernels) line += (line.empty() ? "" : ", ") + m.name + " " + std::to_string(m.kernels());
  if (!line.empty()) std::printf("  kernels per step: %s\n", line.c_str());
}

std::vector<Row> run_modes(const Sizes& s, int runs, int steps, bool all_modes, bool tf32 = false) {
  const auto x = tg::random::uniform<float, Dev>(tg::random::key(2), {s.batch, s.in});
  std::vector<std::int32_t> labels(static_cast<std::size_t>(s.batch));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % static_cast<std::size_t>(s.out));
  const auto y = tg::from_vector<Dev>(labels);
  const int threads = omp_get_max_threads();
  GemmFloor floor(step_gemms(s));
  std::vector<Mode> modes{{GemmFloor::name(), [&] { return floor.run(); }}};
#if defined(TG_BENCH_CUDA)
  GraphFloor graph_floor(step_gemms(s));
  modes.push_back({"graph floor (8 GEMMs, 1 graph)", [&] { return graph_floor.run(); }});
#endif
  if (all_modes) modes.push_back({"eager f32", eager<float>(init(s), x, y)});
  modes.push_back(compiled<float>("compiled f32", init(s), x, y));
  if (all_modes) modes.push_back(compiled<tg::bf16>("compiled bf16 compute", init(s), x, y));
  if (tf32) {
    // TF32 tensor cores for the f32 GEMMs (opt-in; f32 stays the default): recorded with TF32 allowed.
    tg::set_allow_tf32(true);
    modes.push_back(compiled<float>("compiled f32, TF32 allowed", init(s), x, y));
    (void)modes.back().step();
    tg::set_allow_tf32(false);
  }
  if (all_modes) {
    // Eight batches in turn, as a training loop feeds them (the other modes repeat one batch).
    std::vector<Tensor> xs;
    std::vector<Labels> ys;
    for (int b = 0; b < 8; ++b) {
      xs.push_back(tg::random::uniform<float, Dev>(tg::random::key(100 + b), {s.batch, s.in}));
      ys.push_back(y);
    }
    modes.push_back(codelab_loop(init(s), xs, ys));
  }
  const std::vector<Stats> stats = measure(modes, s.batch, runs, steps);
  if (all_modes) print_kernels(modes);
  std::vector<Row> rows;
  for (std::size_t m = 0; m < modes.size(); ++m) rows.push_back({modes[m].name, s, threads, stats[m], stats[m].median / stats[0].median});
  return rows;
}

// ---- The Vision Transformer of examples/vit_fashion_mnist (--model vit) ----

/// The GEMMs of one ViT training step at batch B: each layer's forward GEMM and its two backward ones
/// (the patch embedding needs no input gradient), the attention's batched GEMMs over B x heads.
std::vector<GemmList> vit_gemms(const vit::Config& c, std::int64_t B) {
  const std::int64_t R = B * c.tokens(), T = c.tokens(), hd = c.head_dim(), bh = B * c.heads, d = c.dim;
  std::vector<GemmList> g;
  auto dense = [&](std::int64_t m, std::int64_t k, std::int64_t n, bool input_grad) {
    g.push_back({m, n, k, false, false});                  // y = x @ w
    g.push_back({k, n, m, true, false});                   // dw = x^T @ dy
    if (input_grad) g.push_back({m, k, n, false, true});   // dx = dy @ w^T
  };
  dense(R, c.patch_pixels(), d, false);
  for (std::int64_t l = 0; l < c.layers; ++l) {
    dense(R, d, 3 * d, true);
    g.push_back({T, T, hd, false, true, bh}), g.push_back({T, hd, T, false, false, bh}), g.push_back({T, hd, T, true, false, bh});  // q k^T
    g.push_back({T, hd, T, false, false, bh}), g.push_back({T, T, hd, false, true, bh}), g.push_back({T, hd, T, true, false, bh});  // p v
    dense(R, d, d, true);
    dense(R, d, c.mlp, true);
    dense(R, c.mlp, d, true);
  }
  dense(B, d, c.classes, true);
  return g;
}

using VitOptimizer = decltype(vit::make_optimizer(vit::OptimConfig{}));
using VitState = decltype(std::declval<VitOptimizer>().init(std::declval<vit::Vit<Dev>>()));

/// The example's compiled training step (vit::train_step) in compute type C, parameters and state donated.
template <class C>
Mode vit_compiled(const std::string& name, const vit::Config& c, const Tensor& x, const Labels& y) {
  struct Loop {
    vit::Config c;
    VitOptimizer optimizer = vit::make_optimizer(vit::OptimConfig{});
    vit::Vit<Dev> params;
    VitState state;
    tg::Tensor<std::uint32_t, Dev> key;
  };
  auto l = std::make_shared<Loop>();
  l->c = c;
  l->params = vit::init_params<Dev>(tg::random::key(0), c);
  l->state = l->optimizer.init(l->params);
  l->key = tg::random::key_data<Dev>(tg::random::key(1));
  auto fn = [raw = l.get()](const vit::Vit<Dev>& p, const VitState& s, const Tensor& xb, const Labels& yb, const tg::Tensor<std::uint32_t, Dev>& k) {
    return vit::train_step<C>(raw->optimizer, raw->c, p, s, xb, yb, k);
  };
  auto compiled = std::make_shared<decltype(tg::compile(fn))>(tg::compile(fn));
  return {name,
          [l, compiled, x, y]() {
            auto [p, s, m] = (*compiled)(std::move(l->params), std::move(l->state), x, y, l->key);
            l->params = std::move(p), l->state = std::move(s);
            return m.loss;
          },
          [compiled] { return compiled->kernels(); }};
}

/// The same step run eagerly (the tape recorded every call).
Mode vit_eager(const vit::Config& c, const Tensor& x, const Labels& y) {
  auto optimizer = std::make_shared<VitOptimizer>(vit::make_optimizer(vit::OptimConfig{}));
  auto p = std::make_shared<vit::Vit<Dev>>(vit::init_params<Dev>(tg::random::key(0), c));
  auto state = std::make_shared<VitState>(optimizer->init(*p));
  auto key = tg::random::key_data<Dev>(tg::random::key(1));
  return {"ViT eager f32", [=]() {
            auto [np, ns, m] = vit::train_step<float>(*optimizer, c, *p, *state, x, y, key);
            *p = std::move(np), *state = std::move(ns);
            return m.loss;
          }};
}

/// The host memory tensors hold at the peak of one eager ViT step (value_and_grad, clip, AdamW) from the
/// parameters and optimizer state alone, with and without tg::checkpoint on each block (CPU only: the
/// CUDA pool's peak is not tracked).
void vit_peak_memory(const vit::Config& c, const Tensor& x, const Labels& y) {
  if constexpr (std::is_same_v<Dev, tg::Cpu>) {
    auto peak = [&](bool checkpointed) {
      vit::Config cc = c;
      cc.checkpoint_blocks = checkpointed;
      const auto optimizer = vit::make_optimizer(vit::OptimConfig{});
      const auto p = vit::init_params<Dev>(tg::random::key(0), cc);
      const auto s = optimizer.init(p);
      const auto key = tg::random::key_data<Dev>(tg::random::key(1));
      tg::cpu::reset_peak_memory();
      const std::size_t before = tg::cpu::memory_in_use();
      auto [np, ns, m] = vit::train_step<float>(optimizer, cc, p, s, x, y, key);
      (void)m.loss.item();
      return static_cast<double>(tg::cpu::peak_memory() - before) / (1 << 20);
    };
    const double plain = peak(false), remat = peak(true);
    std::printf("ViT step peak memory above the parameters and state (eager f32): %.2f MiB plain, %.2f MiB with each block "
                "checkpointed (%.2fx less)\n", plain, remat, plain / remat);
  }
}

/// The ViT modes at `batch`: the GEMM floor (the step's GEMMs through oneDNN / cuBLASLt directly), the
/// compiled step in f32 and bf16 compute, and the eager step; examples/sec and tokens/sec (16 per image).
std::vector<Row> run_vit(std::int64_t batch, int runs, int steps) {
  const vit::Config c;
  Sizes s;
  s.batch = batch, s.in = 784, s.h1 = c.dim, s.h2 = c.mlp, s.out = c.classes;
  const auto x = tg::random::uniform<float, Dev>(tg::random::key(2), {batch, 784});
  std::vector<std::int32_t> labels(static_cast<std::size_t>(batch));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 10);
  const auto y = tg::from_vector<Dev>(labels);
  GemmFloor floor(vit_gemms(c, batch));
  std::vector<Mode> modes{{"ViT " + GemmFloor::name(), [&] { return floor.run(); }}};
#if defined(TG_BENCH_CUDA)
  GraphFloor graph_floor(vit_gemms(c, batch));
  modes.push_back({"ViT graph floor", [&] { return graph_floor.run(); }});
#endif
  modes.push_back(vit_compiled<float>("ViT compiled f32", c, x, y));
  modes.push_back(vit_compiled<tg::bf16>("ViT compiled bf16 compute", c, x, y));
  modes.push_back(vit_eager(c, x, y));
  vit::Config remat = c;
  remat.checkpoint_blocks = true;
  modes.push_back(vit_compiled<float>("ViT compiled f32, blocks checkpointed", remat, x, y));
  vit_peak_memory(c, x, y);
  std::printf("ViT step: %s, batch %lld, clip + adamw(warmup cosine), %zu GEMMs per step; median of %d runs x %d steps\n", c.str().c_str(),
              static_cast<long long>(batch), vit_gemms(c, batch).size(), runs, steps);
  const std::vector<Stats> stats = measure(modes, batch, runs, steps);
  print_kernels(modes);
  std::vector<Row> rows;
  const int threads = omp_get_max_threads();
  for (std::size_t m = 0; m < modes.size(); ++m) {
    rows.push_back({modes[m].name, s, threads, stats[m], stats[m].median / stats[0].median});
    std::printf("  %-30s batch %5lld  threads %2d  %9.0f ex/s  %11.0f tokens/s  (min %9.0f, max %9.0f ex/s)  %5.2f x floor\n",
                modes[m].name.c_str(), static_cast<long long>(batch), threads, stats[m].median, stats[m].median * static_cast<double>(c.tokens()),
                stats[m].min, stats[m].max, rows.back().floor_ratio);
  }
  return rows;
}

// ---- The convolutional network of examples/cnn_fashion_mnist (--model cnn) ----

using CnnOptimizer = decltype(cnn::make_optimizer(cnn::OptimConfig{}));
using CnnState = decltype(std::declval<CnnOptimizer>().init(std::declval<cnn::Cnn<Dev>>()));

/// The example's compiled training step (cnn::train_step) in compute type C, parameters and state donated.
template <class C>
Mode cnn_compiled(const std::string& name, const Tensor& x, const Labels& y) {
  struct Loop {
    cnn::Config c;
    CnnOptimizer optimizer = cnn::make_optimizer(cnn::OptimConfig{});
    cnn::Cnn<Dev> params;
    CnnState state;
  };
  auto l = std::make_shared<Loop>();
  l->params = cnn::init_params<Dev>(tg::random::key(0), l->c);
  l->state = l->optimizer.init(l->params);
  auto fn = [raw = l.get()](const cnn::Cnn<Dev>& p, const CnnState& s, const Tensor& xb, const Labels& yb) {
    return cnn::train_step<C>(raw->optimizer, raw->c, p, s, xb, yb);
  };
  auto compiled = std::make_shared<decltype(tg::compile(fn))>(tg::compile(fn));
  return {name,
          [l, compiled, x, y]() {
            auto [p, s, m] = (*compiled)(std::move(l->params), std::move(l->state), x, y);
            l->params = std::move(p), l->state = std::move(s);
            return m.loss;
          },
          [compiled] { return compiled->kernels(); }};
}

/// The CNN modes at `batch`: the compiled step in f32 and bf16 compute and the eager step; images/sec, and
/// each mode's ratio to the compiled f32 step.
std::vector<Row> run_cnn(std::int64_t batch, int runs, int steps) {
  const cnn::Config c;
  Sizes s;
  s.batch = batch, s.in = 784, s.h1 = c.conv1, s.h2 = c.conv2, s.out = c.classes;
  const auto x = tg::random::uniform<float, Dev>(tg::random::key(2), {batch, 784});
  std::vector<std::int32_t> labels(static_cast<std::size_t>(batch));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 10);
  const auto y = tg::from_vector<Dev>(labels);
  std::vector<Mode> modes;
  modes.push_back(cnn_compiled<float>("CNN compiled f32", x, y));
  modes.push_back(cnn_compiled<tg::bf16>("CNN compiled bf16 compute", x, y));
  auto optimizer = std::make_shared<CnnOptimizer>(cnn::make_optimizer(cnn::OptimConfig{}));
  auto p = std::make_shared<cnn::Cnn<Dev>>(cnn::init_params<Dev>(tg::random::key(0), c));
  auto state = std::make_shared<CnnState>(optimizer->init(*p));
  modes.push_back({"CNN eager f32", [=]() {
                     auto [np, ns, m] = cnn::train_step<float>(*optimizer, c, *p, *state, x, y);
                     *p = std::move(np), *state = std::move(ns);
                     return m.loss;
                   }});
  std::printf("CNN step: %s, batch %lld, adamw(cosine decay); median of %d runs x %d steps\n", c.str().c_str(), static_cast<long long>(batch),
              runs, steps);
  const std::vector<Stats> stats = measure(modes, batch, runs, steps);
  print_kernels(modes);
  std::vector<Row> rows;
  const int threads = omp_get_max_threads();
  for (std::size_t m = 0; m < modes.size(); ++m) {
    rows.push_back({modes[m].name, s, threads, stats[m], stats[m].median / stats[0].median});
    std::printf("  %-30s batch %5lld  threads %2d  %9.0f ex/s  (min %9.0f, max %9.0f ex/s)  %5.2f x compiled f32\n", modes[m].name.c_str(),
                static_cast<long long>(batch), threads, stats[m].median, stats[m].min, stats[m].max, rows.back().floor_ratio);
  }
  return rows;
}

void print(const std::vector<Row>& rows) {
  for (const Row& r : rows)
    std::printf("  %-26s batch %5lld  hidden %4lld-%4lld  threads %2d  %10.0f ex/s  (min %9.0f, max %9.0f)  %5.2f x floor\n",
                r.mode.c_str(), static_cast<long long>(r.sizes.batch), static_cast<long long>(r.sizes.h1),
                static_cast<long long>(r.sizes.h2), r.threads, r.stats.median, r.stats.min, r.stats.max, r.floor_ratio);
}

}  // namespace

int main(int argc, char** argv) {
  Sizes sizes;
  // Runs of 100 steps: a training loop runs steps back to back; runs of 20 measured mostly how each mode
  // recovers from the one before it (caches, threads), 15-20% below the steady state here.
  int runs = 7, steps = 100;
  std::string json_path = "train_step.json";
  [[maybe_unused]] bool keep_denormals = false;  // the CPU's setting (nvcc sees it set and never read)
  bool sweep = false, threads_sweep = false, tf32 = false;
  std::string model = "mlp";
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
    else if (a == "--threads-sweep") threads_sweep = true;
    else if (a == "--keep-denormals") keep_denormals = true;
    else if (a == "--tf32") tf32 = true;
    else if (a == "--model") model = next();
    else {
      std::fprintf(stderr, "usage: bench_train_step [--model mlp|vit|cnn] [--batch N] [--runs R] [--steps S] [--json path] [--sweep] [--threads-sweep] "
                           "[--keep-denormals] [--tf32]\n");
      return 2;
    }
  }
  if (model != "mlp" && model != "vit" && model != "cnn") {
    std::fprintf(stderr, "bench_train_step: --model must be mlp, vit or cnn, got %s\n", model.c_str());
    return 2;
  }
#if defined(TG_BENCH_CUDA)
  if (!tg::cuda::available()) {
    std::printf("bench_train_step_cuda: no CUDA device here (%s); nothing to measure\n", tg::cuda::describe_devices().c_str());
    return 0;
  }
  const std::string device = tg::cuda::device_info(tg::cuda::current_device()).name;
  std::printf("bench_train_step: tapegrad %s, %s\n", tg::version, tg::cuda::describe_devices().c_str());
#else
  const std::string device = "cpu";
  std::optional<tg::cpu::FlushDenormals> flush;
  if (!keep_denormals) flush.emplace();
  std::printf("bench_train_step: tapegrad %s, oneDNN %d.%d.%d, %d OpenMP threads (default), cpu, subnormals %s\n", tg::version,
              dnnl_version()->major, dnnl_version()->minor, dnnl_version()->patch, omp_get_max_threads(),
              keep_denormals ? "kept (IEEE)" : "flushed to zero");
#endif
  if (model == "vit" || model == "cnn") {
    bool batch_given = false;
    for (int i = 1; i < argc; ++i) batch_given = batch_given || std::string(argv[i]) == "--batch";
    const std::int64_t batch = batch_given ? sizes.batch : 128;
    const std::vector<Row> rows = model == "vit" ? run_vit(batch, runs, steps) : run_cnn(batch, runs, steps);
    std::ofstream json(json_path);
    json << "{\n  \"device\": \"" << device << "\",\n  \"model\": \"" << model << "\",\n  \"tokens_per_example\": "
         << (model == "vit" ? vit::Config{}.tokens() : 1) << ",\n  \"rows\": [\n";
    for (std::size_t i = 0; i < rows.size(); ++i)
      json << "    {\"mode\": \"" << rows[i].mode << "\", \"batch\": " << rows[i].sizes.batch << ", \"examples_per_sec_median\": "
           << rows[i].stats.median << ", \"min\": " << rows[i].stats.min << ", \"max\": " << rows[i].stats.max
           << ", \"ratio_to_floor\": " << rows[i].floor_ratio << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
    json << "  ]\n}\n";
    std::printf("peak host RSS: %.1f MiB; peak device memory in use: %.1f MiB\n", peak_rss_mib(), peak_device_mib());
    return json ? 0 : 1;
  }
  std::printf("step: 784-%lld-%lld-10 GELU MLP, softmax cross-entropy, adamw(3e-3, wd 1e-4) (its atoms in one pass); median of %d runs x %d steps\n",
              static_cast<long long>(sizes.h1), static_cast<long long>(sizes.h2), runs, steps);
#if !defined(TG_BENCH_CUDA)
  if (tf32) std::printf("--tf32: the CPU has no TF32; no such row here\n");
  tf32 = false;
#endif
  std::vector<Row> all = run_modes(sizes, runs, steps, true, tf32);
  print(all);
  const auto ratio = [&](const char* a, const char* b) {
    double x = 0, y = 0;
    for (const Row& r : all) {
      if (r.mode == a && r.sizes.batch == sizes.batch) x = r.stats.median;
      if (r.mode == b && r.sizes.batch == sizes.batch) y = r.stats.median;
    }
    return y > 0 ? x / y : 0.0;
  };
  std::printf("compiled f32 / eager f32: %.2fx; compiled bf16 / compiled f32: %.2fx\n", ratio("compiled f32", "eager f32"),
              ratio("compiled bf16 compute", "compiled f32"));
  if (threads_sweep) {
    const int defaults = omp_get_max_threads();
    std::printf("OpenMP threads (the default is %d):\n", defaults);
    for (int t : {1, 2, 4, 8}) {
      omp_set_num_threads(t);
      auto rows = run_modes(sizes, runs, steps, false);
      print(rows);
      all.insert(all.end(), rows.begin(), rows.end());
    }
    omp_set_num_threads(defaults);
  }
  if (sweep) {
    std::printf("sweep over batch sizes:\n");
    for (std::int64_t b : {128, 256, 1024, 2048, 4096, 8192}) {
      Sizes s = sizes;
      s.batch = b;
      auto rows = run_modes(s, 3, std::max(2, static_cast<int>(steps * 512 / b)), true);
      print(rows);
      all.insert(all.end(), rows.begin(), rows.end());
    }
    std::printf("sweep over hidden sizes (batch %lld):\n", static_cast<long long>(sizes.batch));
    for (auto [h1, h2] : {std::pair<std::int64_t, std::int64_t>{512, 256}, {1024, 512}}) {
      Sizes s = sizes;
      s.h1 = h1, s.h2 = h2;
      auto rows = run_modes(s, 3, steps, true);
      print(rows);
      all.insert(all.end(), rows.begin(), rows.end());
    }
  }
  std::printf("peak host RSS: %.1f MiB; peak device memory in use: %.1f MiB\n", peak_rss_mib(), peak_device_mib());
  std::ofstream json(json_path);
  if (!json) {
    std::fprintf(stderr, "bench_train_step: cannot write %s (does its directory exist?)\n", json_path.c_str());
    return 1;
  }
  json << "{\n  \"device\": \"" << device << "\",\n  \"default_threads\": " << omp_get_max_threads()
       << ",\n  \"peak_rss_mib\": " << peak_rss_mib() << ",\n  \"peak_device_mib\": " << peak_device_mib() << ",\n  \"rows\": [\n";
  for (std::size_t i = 0; i < all.size(); ++i) {
    const Row& r = all[i];
    json << "    {\"mode\": \"" << r.mode << "\", \"batch\": " << r.sizes.batch << ", \"hidden\": [" << r.sizes.h1 << ", " << r.sizes.h2
         << "], \"threads\": " << r.threads << ", \"examples_per_sec_median\": " << r.stats.median << ", \"min\": " << r.stats.min
         << ", \"max\": " << r.stats.max << ", \"ratio_to_floor\": " << r.floor_ratio << "}" << (i + 1 < all.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  json.close();
  if (!json) {
    std::fprintf(stderr, "bench_train_step: writing %s failed\n", json_path.c_str());
    return 1;
  }
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
}
