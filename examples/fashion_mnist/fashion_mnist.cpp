// fashion_mnist: the JAX codelab's first job, end to end — an MLP (784-256-128-10, GELU) trained on the
// real Fashion-MNIST with fixed device batches, value_and_grad with aux metrics, a compiled step, AdamW
// built from composable transforms, honest throughput, evaluation, f32 vs bf16 compute and a placement
// check. Each step prints its table; everything lands in a self-contained HTML report under --out.
// Built by g++ as fashion_mnist (CPU) and by nvcc as fashion_mnist_cuda (this file, included by
// fashion_mnist_cuda.cu), where --device auto picks the GPU when there is one.
#include <tapegrad/tapegrad.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <iostream>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#if defined(TG_WITH_DIST)
#include <tapegrad/dist/dist.hpp>
#endif

#include "dataset.hpp"
#include "report.hpp"

namespace fm = fashion_mnist;
using json = nlohmann::ordered_json;

namespace {

struct Config {
  int steps = 400;
  std::int64_t batch = 512;
  std::vector<std::int64_t> hidden{256, 128};
  double lr = 3e-3, weight_decay = 1e-4, sgd_lr = 0.1;
  int log_every = 25;
  std::uint32_t seed = 0;
  std::string dtype = "f32";
  std::string device = "auto";
  std::string data_dir, out = "fashion_mnist_out", save, resume;
  bool no_download = false, no_verify = false, quiet = false, check_numerics = false, data_parallel = false;
  int rank = 0, ranks = 1;  // data parallel: this process's rank and the number of ranks
  int timing_steps = 100;
  double tokens_per_example = 784;
};

template <class T, class D>
struct Mlp {
  tg::Tensor<T, D> w1, b1, w2, b2, w3, b3;
};
TG_PYTREE(Mlp, w1, b1, w2, b2, w3, b3)

/// What --save writes and --resume reads: parameters and optimizer state (the step is in the metadata).
template <class P, class S>
struct TrainState {
  P params;
  S opt_state;
};
TG_PYTREE(TrainState, params, opt_state)

template <class D>
struct Metrics {
  tg::Tensor<float, D> loss, accuracy, grad_norm;
  Mlp<float, D> grad_flags;  // tg::nonfinite_flags of the gradients under --check-numerics, else zeros
};
TG_PYTREE(Metrics, loss, accuracy, grad_norm, grad_flags)

/// He-normal weights from key(1) (split in three, one per layer, as the codelab's JAX code), zero biases.
template <class D>
Mlp<float, D> init_params(const Config& c) {
  const auto k = tg::random::split(tg::random::key(1), 3);
  auto he = [](tg::random::Key key, std::int64_t fan_in, std::int64_t fan_out) {
    return tg::random::normal<float, D>(key, {fan_in, fan_out}) * static_cast<float>(std::sqrt(2.0 / static_cast<double>(fan_in)));
  };
  const std::int64_t h1 = c.hidden[0], h2 = c.hidden[1];
  return {he(k[0], 784, h1), tg::zeros<float, D>({h1}), he(k[1], h1, h2), tg::zeros<float, D>({h2}), he(k[2], h2, 10),
          tg::zeros<float, D>({10})};
}

/// Logits (B, 10) in f32, the layers computed in C (f32 parameters cast per step: mixed precision).
template <class C, class D>
tg::Tensor<float, D> logits_of(const Mlp<float, D>& p, const tg::Tensor<float, D>& x) {
  const auto h1 = tg::linear(tg::cast<C>(x), tg::cast<C>(p.w1), tg::cast<C>(p.b1), tg::Activation::gelu);
  const auto h2 = tg::linear(h1, tg::cast<C>(p.w2), tg::cast<C>(p.b2), tg::Activation::gelu);
  return tg::cast<float>(tg::linear(h2, tg::cast<C>(p.w3), tg::cast<C>(p.b3)));
}

/// Mean cross-entropy, with the batch accuracy as aux (not differentiated).
template <class C, class D>
std::pair<tg::Tensor<float, D>, tg::Tensor<float, D>> loss_with_accuracy(const Mlp<float, D>& p, const tg::Tensor<float, D>& x,
                                                                         const tg::Tensor<std::int32_t, D>& y) {
  const auto logits = logits_of<C>(p, x);
  return {tg::mean(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::accuracy(logits, y)};
}

template <class D>
tg::Tensor<float, D> loss_only(const Mlp<float, D>& p, const tg::Tensor<float, D>& x, const tg::Tensor<std::int32_t, D>& y) {
  return loss_with_accuracy<float>(p, x, y).first;
}

/// The hand-written step: pure SGD, new parameters out (no optimizer library).
template <class D>
std::tuple<Mlp<float, D>, tg::Tensor<float, D>> sgd_step(const Mlp<float, D>& p, const tg::Tensor<float, D>& x,
                                                         const tg::Tensor<std::int32_t, D>& y, float lr) {
  auto [value, grads] = tg::value_and_grad(loss_only<D>)(p, x, y);
  return {tg::tree_map([lr](const auto& w, const auto& g) { return w - g * lr; }, p, grads), value};
}

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

std::string shape_str(const tg::Shape& s) { return s.str(); }

template <class D>
std::string device_label() {
  if constexpr (std::is_same_v<D, tg::Cpu>) return "cpu";
  else return tg::zeros<float, D>({1}).device_name();
}

/// Everything a run produces that is written at the end (nothing is written under --out before).
struct Outputs {
  fm::Report report;
  json metrics = json::object();
  std::vector<std::uint8_t> class_png, predictions_png;
  std::function<void(const std::string&)> save_params, save_checkpoint;
};

template <class D>
int run(const Config& c, fm::Loaded& data, Outputs& out) {
  using Params = Mlp<float, D>;
  using Tensor = tg::Tensor<float, D>;
  using Labels = tg::Tensor<std::int32_t, D>;
  auto& report = out.report;
  auto& metrics = out.metrics;
  const std::string device = device_label<D>();
  auto show = [&](const fm::Table& t) {
    if (!c.quiet) {
      t.print(std::cout);
      std::cout << "\n";
    }
    report.table(t);
  };
  auto say = [&](const std::string& s) {
    if (!c.quiet) std::cout << "  " << s << "\n";
    report.text(s);
  };
  auto heading = [&](const std::string& title, const std::string& intro) {
    if (!c.quiet) std::cout << "== " << title << "\n";
    report.section(title, intro);
  };
  std::optional<tg::cpu::FlushDenormals> flush;
  if constexpr (std::is_same_v<D, tg::Cpu>) flush.emplace();  // as XLA on the CPU: see docs/performance.md

  // 1. Setup ---------------------------------------------------------------------------------------
  heading("1. Setup", "The library, its backends and the device this run uses.");
  {
    fm::Table t{"versions and devices", {"item", "value"}, {}};
    t.rows.push_back({"tapegrad", tg::version});
    const dnnl_version_t* dv = dnnl_version();
    t.rows.push_back({"oneDNN (CPU GEMMs)", std::to_string(dv->major) + "." + std::to_string(dv->minor) + "." + std::to_string(dv->patch)});
#if defined(TG_WITH_CUDA)
    int runtime = 0;
    (void)cudaRuntimeGetVersion(&runtime);
    (void)cudaGetLastError();
    t.rows.push_back({"CUDA runtime", std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10)});
    const std::size_t lt = cublasLtGetVersion();
    t.rows.push_back({"cuBLASLt", std::to_string(lt / 10000) + "." + std::to_string(lt / 100 % 100) + "." + std::to_string(lt % 100)});
#else
    t.rows.push_back({"CUDA", "not in this build (g++); fashion_mnist_cuda is the nvcc build"});
#endif
    t.rows.push_back({"CUDA devices", tg::cuda::describe_devices()});
    t.rows.push_back({"CPU threads (OpenMP)", std::to_string(omp_get_max_threads())});
    t.rows.push_back({"device in use", device});
    if (c.ranks > 1) t.rows.push_back({"data parallel", std::to_string(c.ranks) + " ranks (MPI" + std::string(std::is_same_v<D, tg::Cpu> ? ")" : "; NCCL between GPUs)")});
    show(t);
    metrics["versions"] = {{"tapegrad", tg::version}, {"onednn", t.rows[1][1]}};
    metrics["device"] = device;
  }

  // 2. Data ----------------------------------------------------------------------------------------
  heading("2. Data", "Fashion-MNIST from " + data.dir.string() + ", every file verified by the SHA-256 of its decompressed payload.");
  {
    fm::Table t{"Fashion-MNIST", {"split", "images", "image shape", "labels", "payload SHA-256 (images / labels)"}, {}};
    const fm::Split* splits[2] = {&data.train, &data.test};
    const char* names[2] = {"train", "test"};
    for (int s = 0; s < 2; ++s) {
      const auto& sh = splits[s]->images.shape();
      t.rows.push_back({names[s], fm::grouped(static_cast<double>(sh[0])), "(" + std::to_string(sh[1]) + ", " + std::to_string(sh[2]) + ")",
                        fm::grouped(static_cast<double>(splits[s]->labels.size())),
                        data.sha256[static_cast<std::size_t>(2 * s)].substr(0, 12) + "... / " + data.sha256[static_cast<std::size_t>(2 * s + 1)].substr(0, 12) + "..."});
    }
    show(t);
    if (c.no_verify) say("Checksums NOT verified (--no-verify).");
    metrics["data"] = {{"dir", data.dir.string()}, {"verified", !c.no_verify}, {"payload_sha256", data.sha256}};
    // One example per class: the first of each in the training set.
    const auto px = data.train.images.to_vector();
    const auto lab = data.train.labels.to_vector();
    std::vector<fm::Tile> tiles;
    std::string figures = "<div class=\"grid\">";
    for (int k = 0; k < 10; ++k) {
      const auto at = static_cast<std::size_t>(std::find(lab.begin(), lab.end(), k) - lab.begin());
      const std::uint8_t* p = px.data() + at * 784;
      tiles.push_back({p, 200, 200, 200});
      figures += "<figure><img alt=\"" + std::string(fm::class_names[static_cast<std::size_t>(k)]) + "\" src=\"" +
                 fm::png_data_uri(fm::encode_png(fm::image_grid({{p, 255, 255, 255}}, 1, 3))) + "\"><figcaption>" +
                 fm::html_escape(fm::class_names[static_cast<std::size_t>(k)]) + "</figcaption></figure>";
    }
    out.class_png = fm::encode_png(fm::image_grid(tiles, 10, 3));
    report.html("<p>One example per class (the first of each in the training set):</p>" + figures + "</div>");
  }

  // 3. Batches -------------------------------------------------------------------------------------
  heading("3. Fixed batches on the device",
          "Pixels / 255, flattened to 784; the training set shuffled once with key(" + std::to_string(c.seed) +
              ") (jax.random.permutation's order) and cut into batches of " + std::to_string(c.batch) +
              " (tail trimmed); the test set in file order. Moved to the device once.");
  const auto train = tg::data::fixed_batches<D>(data.train.images, data.train.labels, c.batch, 10, tg::random::key(c.seed), c.rank, c.ranks);
  const auto test = tg::data::fixed_batches<D>(data.test.images, data.test.labels, c.batch, 10);
  {
    fm::Table t{"device arrays", {"array", "shape", "dtype", "device"}, {}};
    auto row = [&](const std::string& name, std::size_t n, const auto& one) {
      using T = typename std::remove_cvref_t<decltype(one)>::value_type;
      t.rows.push_back({name, std::to_string(n) + " x " + shape_str(one.shape()), tg::dtype_name<T>, one.device_name()});
    };
    row("train images", train.size(), train[0].x);
    row("train labels", train.size(), train[0].y);
    row("test images", test.size(), test[0].x);
    row("test labels", test.size(), test[0].y);
    show(t);
    if (c.ranks > 1)
      say("Data parallel: each of the " + std::to_string(c.ranks) + " ranks holds its " + std::to_string(c.batch / c.ranks) +
          " examples of every global batch of " + std::to_string(c.batch) + " (shown: rank 0's); the test set is evaluated whole on every rank.");
    metrics["batches"] = {{"train", train.size()}, {"test", test.size()}, {"batch_size", c.batch}, {"ranks", c.ranks}};
  }

  // 4. Model and one step by hand ---------------------------------------------------------------------
  heading("4. Model", "MLP 784-" + std::to_string(c.hidden[0]) + "-" + std::to_string(c.hidden[1]) +
                          "-10 with GELU (tanh form), He-normal weights from key(1), zero biases, as a TG_PYTREE struct.");
  Params params = init_params<D>(c);
  {
    fm::Table t{"parameters", {"parameter", "shape", "dtype", "device"}, {}};
    std::int64_t total = 0;
    tg::tree_for_each([&](const std::string& path, const auto& leaf) {
      t.rows.push_back({path, shape_str(leaf.shape()), "float32", leaf.device_name()});
      total += leaf.size();
    }, params);
    t.rows.push_back({"total", fm::grouped(static_cast<double>(total)) + " parameters", "", ""});
    show(t);
    metrics["parameters"] = total;
  }
  {
    const auto& b = train[0];
    const auto grads = tg::grad(loss_only<D>)(params, b.x, b.y);
    const auto [value, grads2] = tg::value_and_grad(loss_only<D>)(params, b.x, b.y);
    double max_diff = 0;
    fm::Table t{"the gradient tree beside the parameter tree (first batch)", {"path", "parameter", "gradient", "gradient norm"}, {}};
    tg::tree_for_each([&](const std::string& path, const auto& w, const auto& g, const auto& g2) {
      max_diff = std::max(max_diff, static_cast<double>(tg::max(tg::abs(g - g2)).item()));
      t.rows.push_back({path, shape_str(w.shape()), shape_str(g.shape()), fm::fmt("%.6f", std::sqrt(tg::sum(g * g).item()))});
    }, params, grads, grads2);
    show(t);
    const double loss0 = value.item();
    auto [next, loss_sgd] = sgd_step<D>(params, b.x, b.y, static_cast<float>(c.sgd_lr));
    const double loss1 = loss_only<D>(next, b.x, b.y).item();
    fm::Table s{"one step by hand", {"quantity", "value"}, {}};
    s.rows.push_back({"max |grad - value_and_grad's grad|", fm::fmt("%.3g", max_diff)});
    s.rows.push_back({"loss before the update (first batch)", fm::fmt("%.8f", loss0)});
    s.rows.push_back({"loss after one pure SGD step (lr " + fm::fmt("%g", c.sgd_lr) + ", same batch)", fm::fmt("%.8f", loss1)});
    show(s);
    metrics["initial_loss"] = loss0;
    metrics["grad_vs_value_and_grad_max_diff"] = max_diff;
    metrics["loss_after_one_sgd_step"] = loss1;
  }

  // 5. Eager vs compiled ----------------------------------------------------------------------------------
  heading("5. Eager vs compiled step",
          "The hand-written SGD step run eagerly (the tape every call) and through tg::compile (recorded once, replayed). "
          "Examples/sec after warm-up, the device synchronised before the clock stops.");
  double eager_eps = 0, compiled_eps = 0;
  {
    const int eager_steps = std::max(1, c.timing_steps / 5), compiled_steps = c.timing_steps;
    const float lr = static_cast<float>(c.sgd_lr);
    Params p = params;
    Tensor last;
    for (int i = 0; i < 3; ++i) std::tie(p, last) = sgd_step<D>(p, train[i % train.size()].x, train[i % train.size()].y, lr);
    (void)last.item();
    auto t0 = clock_type::now();
    for (int i = 0; i < eager_steps; ++i) {
      const auto& b = train[static_cast<std::size_t>(i) % train.size()];
      std::tie(p, last) = sgd_step<D>(p, b.x, b.y, lr);
    }
    (void)last.item();  // synchronises
    const std::int64_t local_batch = c.batch / c.ranks;  // step 5 runs on this rank alone
    eager_eps = static_cast<double>(eager_steps * local_batch) / seconds_since(t0);
    auto step = tg::compile([lr](const Params& q, const Tensor& x, const Labels& y) { return sgd_step<D>(q, x, y, lr); });
    Params q = params;
    for (int i = 0; i < 5; ++i) std::tie(q, last) = step(std::move(q), train[i % train.size()].x, train[i % train.size()].y);
    (void)last.item();
    t0 = clock_type::now();
    for (int i = 0; i < compiled_steps; ++i) {
      const auto& b = train[static_cast<std::size_t>(i) % train.size()];
      std::tie(q, last) = step(std::move(q), b.x, b.y);
    }
    (void)last.item();
    compiled_eps = static_cast<double>(compiled_steps * local_batch) / seconds_since(t0);
    fm::Table t{"SGD step throughput", {"mode", "steps timed", "examples/sec", "vs eager"}, {}};
    t.rows.push_back({"eager", std::to_string(eager_steps), fm::grouped(eager_eps), "1.00x"});
    t.rows.push_back({"compiled (tg::compile)", std::to_string(compiled_steps), fm::grouped(compiled_eps), fm::fmt("%.2fx", compiled_eps / eager_eps)});
    show(t);
    report.html(fm::svg_bars({"eager", "compiled"}, {eager_eps, compiled_eps}, "examples/s"));
    if constexpr (std::is_same_v<D, tg::Cpu>)
      say("On the CPU the kernels themselves dominate and the eager step's bookkeeping is small, so compile gains little here "
          "(and each call copies its batch into the plan's input buffer); on a GPU it replaces tens of kernel launches per step "
          "with one graph launch.");
    metrics["throughput"]["sgd_eager"] = eager_eps;
    metrics["throughput"]["sgd_compiled"] = compiled_eps;
  }

  // 6. AdamW ------------------------------------------------------------------------------------------
  const auto optimizer = tg::optim::adamw(c.lr, {.weight_decay = c.weight_decay});  // chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)
  using State = decltype(optimizer.init(std::declval<Params>()));
  const bool check = c.check_numerics, data_parallel = c.ranks > 1;
  auto train_step = [&optimizer, check, data_parallel]<class C>(const Params& p, const State& s, const Tensor& x, const Labels& y) {
    auto [out_, grads] = tg::value_and_grad(loss_with_accuracy<C, D>, tg::has_aux)(p, x, y);
#if defined(TG_WITH_DIST)
    if (data_parallel) {  // the mean over ranks: the gradient of the global batch's mean loss
      grads = tg::dist::all_reduce_mean(grads);
      out_ = tg::dist::all_reduce_mean(out_);
    }
#else
    (void)data_parallel;
#endif
    auto [updates, next] = optimizer.update(grads, s, p);
    auto flags = check ? tg::nonfinite_flags(grads) : tg::tree_map([](const auto&) { return tg::zeros<float, D>({}); }, grads);
    Metrics<D> m{out_.first, out_.second, tg::global_norm(grads), flags};
    return std::tuple{tg::optim::apply_updates(p, updates), next, m};
  };
  auto step_f32 = tg::compile([&](const Params& p, const State& s, const Tensor& x, const Labels& y) {
    return train_step.template operator()<float>(p, s, x, y);
  });
  auto step_bf16 = tg::compile([&](const Params& p, const State& s, const Tensor& x, const Labels& y) {
    return train_step.template operator()<tg::bf16>(p, s, x, y);
  });
  auto step_main = [&](Params&& p, State&& s, const Tensor& x, const Labels& y) {
    return c.dtype == "bf16" ? step_bf16(std::move(p), std::move(s), x, y) : step_f32(std::move(p), std::move(s), x, y);
  };
  heading("6. AdamW", "adamw(" + fm::fmt("%g", c.lr) + ", weight_decay=" + fm::fmt("%g", c.weight_decay) +
                          "), built by chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate); compute dtype " + c.dtype +
                          ". Metrics stay on the device until logged every " + std::to_string(c.log_every) + " steps.");
  State state = optimizer.init(params);
  std::vector<double> h_step, h_loss, h_acc, h_norm;
  double adamw_eps = 0;
  // What must match for a checkpoint to continue this run bitwise: the data order and the model.
  const std::map<std::string, std::string> run_identity{{"seed", std::to_string(c.seed)}, {"batch", std::to_string(c.batch)},
                                                        {"hidden", std::to_string(c.hidden[0]) + "," + std::to_string(c.hidden[1])},
                                                        {"lr", fm::fmt("%.17g", c.lr)}, {"weight_decay", fm::fmt("%.17g", c.weight_decay)},
                                                        {"dtype", c.dtype}};
  int first_step = 1;
  if (!c.resume.empty()) {
    TrainState<Params, State> loaded{params, state};
    std::map<std::string, std::string> meta;
    try {
      meta = tg::io::load_safetensors(c.resume, loaded);
    } catch (const tg::Error& e) {
      throw fm::DataError(std::string("--resume: ") + e.what());
    }
    for (const auto& [key, value] : run_identity)
      if (!meta.count(key) || meta.at(key) != value)
        throw fm::DataError("--resume " + c.resume + ": saved with " + key + " = " + (meta.count(key) ? meta.at(key) : "(none)") +
                            ", this run has " + value + "; resume with the same options");
    const int saved = meta.count("step") ? std::atoi(meta.at("step").c_str()) : -1;
    if (saved < 0 || saved >= c.steps)
      throw fm::DataError("--resume " + c.resume + ": saved at step " + std::to_string(saved) + ", but --steps is " + std::to_string(c.steps) +
                          "; ask for more steps than were done");
    params = std::move(loaded.params), state = std::move(loaded.opt_state);
    first_step = saved + 1;
    say("Resumed from " + c.resume + " after step " + std::to_string(saved) + ".");
  }
  {
    auto [p1, s1, m1] = step_main(Params(params), State(state), train[0].x, train[0].y);
    fm::Table one{"one AdamW step (first batch)", {"loss", "batch accuracy", "gradient norm"}, {}};
    one.rows.push_back({fm::fmt("%.6f", m1.loss.item()), fm::fmt("%.4f", m1.accuracy.item()), fm::fmt("%.6f", m1.grad_norm.item())});
    show(one);

    fm::Progress progress("training", c.steps, c.quiet);
    const int warmup = std::min(5, c.steps - first_step + 1);
    std::vector<std::pair<int, Metrics<D>>> pending;  // on the device until logged
    clock_type::time_point t0 = clock_type::now();
    std::string status;
    for (int i = first_step; i <= c.steps; ++i) {
      if (i == first_step + warmup) t0 = clock_type::now();
      const auto& b = train[static_cast<std::size_t>(i - 1) % train.size()];
      auto [p, s, m] = step_main(std::move(params), std::move(state), b.x, b.y);
      params = std::move(p), state = std::move(s);
      if (c.check_numerics) {
        tg::check_finite(m.loss, "loss at step " + std::to_string(i));
        tg::raise_if_nonfinite(m.grad_flags, "gradient at step " + std::to_string(i));
      }
      const bool log = i % c.log_every == 0 || i == first_step || i == c.steps;
      if (log) pending.emplace_back(i, m);
      if (log) {
        for (auto& [at, mm] : pending) {
          h_step.push_back(at), h_loss.push_back(mm.loss.item()), h_acc.push_back(mm.accuracy.item()), h_norm.push_back(mm.grad_norm.item());
        }
        pending.clear();
        status = "loss " + fm::fmt("%.4f", h_loss.back()) + "  acc " + fm::fmt("%.3f", h_acc.back());
      }
      progress.update(i, status, log);
    }
    const int timed = c.steps - first_step + 1 - warmup;
    // Global examples: c.batch per step over all ranks together.
    adamw_eps = timed > 0 ? static_cast<double>(timed) * static_cast<double>(c.batch) / seconds_since(t0) : 0.0;  // the last log synchronised
    fm::Table hist{"history", {"step", "loss", "batch accuracy", "gradient norm"}, {}};
    json history = json::array();
    for (std::size_t i = 0; i < h_step.size(); ++i) {
      hist.rows.push_back({fm::fmt("%.0f", h_step[i]), fm::fmt("%.4f", h_loss[i]), fm::fmt("%.4f", h_acc[i]), fm::fmt("%.4f", h_norm[i])});
      history.push_back({{"step", h_step[i]}, {"loss", h_loss[i]}, {"accuracy", h_acc[i]}, {"grad_norm", h_norm[i]}});
    }
    show(hist);
    report.html(fm::svg_curve(h_step, h_loss, h_acc));
    fm::Table tp{"AdamW training throughput", {"measure", "value"}, {}};
    tp.rows.push_back({"examples/sec (" + std::to_string(timed) + " steps after " + std::to_string(warmup) + " warm-up)", fm::grouped(adamw_eps)});
    tp.rows.push_back({"tokens/sec (projection)", fm::grouped(adamw_eps * c.tokens_per_example)});
    show(tp);
    say("The tokens/sec figure is a projection, not a measurement: examples/sec times " + fm::fmt("%g", c.tokens_per_example) +
        " tokens per example (--tokens-per-example; 784 counts each pixel as a token), to compare with sequence-model throughputs.");
    metrics["history"] = history;
    metrics["throughput"]["adamw"] = adamw_eps;
    metrics["throughput"]["tokens_per_sec_projection"] = adamw_eps * c.tokens_per_example;
    metrics["throughput"]["tokens_per_example"] = c.tokens_per_example;
  }

  // 7. Evaluation -------------------------------------------------------------------------------------
  heading("7. Evaluation", "Over the " + std::to_string(test.size()) + " test batches (" +
                               fm::grouped(static_cast<double>(test.size()) * static_cast<double>(c.batch)) + " images).");
  {
    auto evaluate = tg::compile([](const Params& p, const Tensor& x, const Labels& y) {
      const auto logits = logits_of<float>(p, x);
      return std::tuple{tg::sum(tg::softmax_cross_entropy_with_integer_labels(logits, y)), tg::argmax(logits, 1)};
    });
    double loss_sum = 0;
    std::vector<std::int32_t> predicted, truth;
    for (const auto& b : test) {
      const auto [l, pred] = evaluate(params, b.x, b.y);
      loss_sum += l.item();
      const auto pv = pred.to_vector(), yv = b.y.to_vector();
      predicted.insert(predicted.end(), pv.begin(), pv.end());
      truth.insert(truth.end(), yv.begin(), yv.end());
    }
    std::vector<std::vector<double>> confusion(10, std::vector<double>(10, 0.0));
    std::size_t correct = 0;
    for (std::size_t i = 0; i < truth.size(); ++i) {
      confusion[static_cast<std::size_t>(truth[i])][static_cast<std::size_t>(predicted[i])] += 1;
      correct += truth[i] == predicted[i];
    }
    const double n = static_cast<double>(truth.size());
    const double test_loss = loss_sum / n, test_acc = static_cast<double>(correct) / n;
    fm::Table t{"test set", {"images", "loss", "accuracy"}, {}};
    t.rows.push_back({fm::grouped(n), fm::fmt("%.4f", test_loss), fm::fmt("%.4f", test_acc)});
    show(t);
    metrics["test"] = {{"images", truth.size()}, {"loss", test_loss}, {"accuracy", test_acc}};

    // 25 random test images with predicted and true labels.
    const auto pick = tg::random::permutation(tg::random::fold_in(tg::random::key(c.seed), 25), static_cast<std::int64_t>(truth.size())).to_vector();
    const auto px = data.test.images.to_vector();
    std::vector<fm::Tile> tiles;
    std::string figures = "<div class=\"grid\">";
    for (int k = 0; k < 25; ++k) {
      const auto i = static_cast<std::size_t>(pick[static_cast<std::size_t>(k)]);
      const bool ok = predicted[i] == truth[i];
      const std::uint8_t* p = px.data() + i * 784;
      tiles.push_back(ok ? fm::Tile{p, 30, 132, 73} : fm::Tile{p, 192, 57, 43});
      figures += std::string("<figure class=\"") + (ok ? "ok" : "bad") + "\"><img alt=\"test image " + std::to_string(i) + "\" src=\"" +
                 fm::png_data_uri(fm::encode_png(fm::image_grid({{p, 255, 255, 255}}, 1, 3))) + "\"><figcaption>" +
                 fm::html_escape(fm::class_names[static_cast<std::size_t>(predicted[i])]) +
                 (ok ? "" : "<br>(true: " + fm::html_escape(fm::class_names[static_cast<std::size_t>(truth[i])]) + ")") + "</figcaption></figure>";
    }
    out.predictions_png = fm::encode_png(fm::image_grid(tiles, 5, 3));
    report.html("<p>25 random test images: the prediction, green when right, red (with the true class) when wrong.</p>" + figures + "</div>");
    if (!c.quiet) {
      std::cout << "  25 random test images (prediction / truth):\n";
      for (int k = 0; k < 25; ++k) {
        const auto i = static_cast<std::size_t>(pick[static_cast<std::size_t>(k)]);
        std::printf("    %-12s %-12s %s\n", fm::class_names[static_cast<std::size_t>(predicted[i])],
                    fm::class_names[static_cast<std::size_t>(truth[i])], predicted[i] == truth[i] ? "right" : "WRONG");
      }
    }
    // The confusion matrix, as fractions of each true class.
    std::vector<std::string> names(fm::class_names.begin(), fm::class_names.end());
    fm::Table cm{"confusion matrix (rows: true class; fraction predicted as each column)", {"true \\ predicted"}, {}};
    for (const auto& nm : names) cm.header.push_back(nm.substr(0, 7));
    json cmj = json::array();
    for (std::size_t i = 0; i < 10; ++i) {
      double row_total = 0;
      for (double v : confusion[i]) row_total += v;
      std::vector<std::string> row{names[i]};
      json counts = json::array();
      for (std::size_t j = 0; j < 10; ++j) {
        counts.push_back(confusion[i][j]);
        confusion[i][j] = row_total > 0 ? confusion[i][j] / row_total : 0.0;
        row.push_back(fm::fmt("%.2f", confusion[i][j]));
      }
      cm.rows.push_back(row);
      cmj.push_back(counts);
    }
    show(cm);
    report.html(fm::svg_heatmap(confusion, names));
    metrics["test"]["confusion_counts"] = cmj;
  }

  // 8. f32 vs bf16 compute ---------------------------------------------------------------------------
  heading("8. f32 vs bf16 compute", "The same AdamW step computing in f32 and in bf16 (parameters and optimizer state stay f32), " +
                                        std::to_string(c.timing_steps) + " compiled steps each after 5 warm-up steps, from the initial parameters.");
  {
    fm::Table t{"compute dtype", {"compute", "examples/sec", "loss after", "vs f32"}, {}};
    std::vector<double> eps;
    for (const bool bf16 : {false, true}) {
      Params p = init_params<D>(c);
      State s = optimizer.init(p);
      Metrics<D> m;
      auto go = [&](int i) {
        const auto& b = train[static_cast<std::size_t>(i) % train.size()];
        auto [p2, s2, m2] = bf16 ? step_bf16(std::move(p), std::move(s), b.x, b.y) : step_f32(std::move(p), std::move(s), b.x, b.y);
        p = std::move(p2), s = std::move(s2), m = std::move(m2);
      };
      for (int i = 0; i < 5; ++i) go(i);
      (void)m.loss.item();
      const auto t0 = clock_type::now();
      for (int i = 5; i < 5 + c.timing_steps; ++i) go(i);
      const double loss = m.loss.item();
      eps.push_back(static_cast<double>(c.timing_steps) * static_cast<double>(c.batch) / seconds_since(t0));  // global batch
      t.rows.push_back({bf16 ? "bf16" : "f32", fm::grouped(eps.back()), fm::fmt("%.4f", loss), fm::fmt("%.2fx", eps.back() / eps.front())});
      metrics["throughput"][bf16 ? "adamw_bf16" : "adamw_f32"] = eps.back();
    }
    show(t);
    report.html(fm::svg_bars({"f32 compute", "bf16 compute"}, eps, "examples/s"));
    if constexpr (std::is_same_v<D, tg::Cpu>) {
      if (!tg::cpu::OneDnn::instance().bf16_supported())
        say("This CPU has no bf16 instructions (AVX-512 BF16 / AMX): bf16 GEMMs run as f32 after a conversion, so bf16 compute is "
            "slower here; it pays on GPUs and on CPUs with those instructions.");
    }
  }

  // 9. Placement ----------------------------------------------------------------------------------------
  heading("9. Placement check", "Where everything the training touched lives.");
  {
    fm::Table t{"placement", {"what", "tensors", "devices"}, {}};
    bool all_here = true;
    auto check = [&](const std::string& what, const auto& tree) {
      std::set<std::string> devices;
      int n = 0;
      tg::tree_for_each([&](const std::string&, const auto& leaf) {
        if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(leaf)>, bool>) devices.insert(leaf.device_name()), ++n;
      }, tree);
      std::string list;
      for (const auto& d : devices) list += (list.empty() ? "" : ", ") + d, all_here = all_here && d == device;
      t.rows.push_back({what, std::to_string(n), list});
    };
    check("parameters", params);
    check("optimizer state", state);
    std::vector<tg::data::Batch<D>> all(train.begin(), train.end());
    all.insert(all.end(), test.begin(), test.end());
    std::set<std::string> bdev;
    for (const auto& b : all) bdev.insert(b.x.device_name()), bdev.insert(b.y.device_name());
    std::string list;
    for (const auto& d : bdev) list += (list.empty() ? "" : ", ") + d, all_here = all_here && d == device;
    t.rows.push_back({"batches (train and test)", std::to_string(2 * all.size()), list});
#if defined(TG_WITH_DIST)
    if (c.ranks > 1) {
      tg::dist::check_identical(params, "parameters");  // throws on every rank if any rank drifted
      tg::dist::check_identical(state, "optimizer state");
      t.rows.push_back({"parameters and optimizer state on all " + std::to_string(c.ranks) + " ranks", "", "identical (hash compared)"});
      metrics["ranks_identical"] = true;
    }
#endif
    show(t);
    say(std::string(all_here ? "Everything stayed on " : "NOT everything is on ") + device + ". Final training loss (step " +
        std::to_string(static_cast<int>(h_step.back())) + "): " + fm::fmt("%.4f", h_loss.back()) + ".");
    metrics["placement_ok"] = all_here;
    metrics["final_train_loss"] = h_loss.back();
  }
  metrics["config"] = {{"steps", c.steps}, {"batch", c.batch}, {"hidden", c.hidden}, {"lr", c.lr}, {"weight_decay", c.weight_decay},
                       {"sgd_lr", c.sgd_lr}, {"log_every", c.log_every}, {"seed", c.seed}, {"dtype", c.dtype}, {"timing_steps", c.timing_steps}};
  if (!c.save.empty()) {
    std::map<std::string, std::string> meta = run_identity;
    meta["step"] = std::to_string(c.steps);
    meta["tapegrad"] = tg::version;
    out.save_checkpoint = [ts = TrainState<Params, State>{params, state}, meta](const std::string& path) {
      tg::io::save_safetensors(path, ts, meta);
    };
  }
  out.save_params = [p = params, steps = c.steps](const std::string& path) {
    tg::io::save_safetensors(path, p, {{"tapegrad", tg::version}, {"steps", std::to_string(steps)}});
  };
  return 0;
}

}  // namespace

namespace {

/// Writes `bytes` to `path` through a temporary file and a rename: a file under --out is whole or absent.
void write_whole(const std::filesystem::path& path, const std::string& bytes) {
  tg::io::detail::write_file_atomically(path.string(), std::vector<std::uint8_t>(bytes.begin(), bytes.end()), "fashion_mnist");
}

std::string as_string(const std::vector<std::uint8_t>& b) { return std::string(b.begin(), b.end()); }

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"fashion_mnist: the JAX codelab's Fashion-MNIST MLP, trained step by step with tapegrad; "
               "writes report.html, metrics.json, PNG images and the final parameters under --out"};
  app.add_option("--steps", c.steps, "AdamW training steps")->check(CLI::Range(1, 10000000))->capture_default_str();
  app.add_option("--batch-size", c.batch, "examples per batch")->check(CLI::Range(1, 10000))->capture_default_str();
  app.add_option("--hidden", c.hidden, "the two hidden layer sizes")->expected(2)->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--lr", c.lr, "AdamW learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--sgd-lr", c.sgd_lr, "learning rate of the hand-written SGD step (steps 4 and 5)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--log-every", c.log_every, "log the metrics every N steps")->check(CLI::Range(1, 10000000))->capture_default_str();
  app.add_option("--seed", c.seed, "seed of the training-set shuffle and of the sample images (parameters: key(1))")->capture_default_str();
  app.add_option("--dtype", c.dtype, "compute dtype of the AdamW training (parameters stay f32)")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--device", c.device, "auto: CUDA when a GPU is there, else the CPU")->check(CLI::IsMember({"auto", "cpu", "cuda"}))->capture_default_str();
  app.add_option("--data-dir", c.data_dir, "directory searched first for the four Fashion-MNIST .gz files");
  app.add_option("--out", c.out, "output directory")->capture_default_str();
  app.add_option("--timing-steps", c.timing_steps, "timed steps of the compiled SGD step (step 5, eager: a fifth) and of each compute dtype (step 8)")
      ->check(CLI::Range(1, 10000000))->capture_default_str();
  app.add_option("--tokens-per-example", c.tokens_per_example, "tokens per example for the tokens/sec projection")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--save", c.save, "write a checkpoint (parameters, optimizer state, step) here at the end of training");
  app.add_option("--resume", c.resume, "continue the AdamW training from a checkpoint written by --save (same options)");
  app.add_flag("--no-download", c.no_download, "never download the data set");
  app.add_flag("--no-verify", c.no_verify, "skip the SHA-256 check of the data (for a modified copy of the data set)");
  app.add_flag("--quiet", c.quiet, "print nothing but errors");
  app.add_flag("--data-parallel", c.data_parallel, "under mpirun: every rank trains on its shard of each global batch, gradients averaged (MPI / NCCL)");
  app.add_flag("--check-numerics", c.check_numerics, "stop with an error naming the leaf when the loss or a gradient becomes NaN or Inf (reads flags every step)");
  CLI11_PARSE(app, argc, argv);

#if defined(TG_WITH_DIST)
  tg::dist::Communicator* comm = nullptr;
  if (c.data_parallel) {
    comm = &tg::dist::Communicator::world();
    c.rank = comm->rank(), c.ranks = comm->size();
    if (c.rank != 0) c.quiet = true;  // rank 0 logs and writes the outputs
  }
#else
  if (c.data_parallel) {
    std::cerr << "fashion_mnist: --data-parallel: this build has no MPI (install libopenmpi-dev and rebuild)\n";
    return 2;
  }
#endif
  try {
    bool use_cuda = false;
#if defined(TG_WITH_CUDA)
    use_cuda = c.device == "cuda" || (c.device == "auto" && tg::cuda::available());
    if (use_cuda && !tg::cuda::available())
      throw fm::DataError("--device cuda: no CUDA device here (" + tg::cuda::describe_devices() + "); use --device cpu or auto");
#else
    if (c.device == "cuda")
      throw fm::DataError("--device cuda: this build has no CUDA (built by g++); build the fashion_mnist_cuda target with nvcc");
#endif
    if (!c.quiet) std::cout << "fashion_mnist: tapegrad " << tg::version << "\n== finding the data\n";
    fm::Loaded data = fm::find_and_load(c.data_dir, !c.no_download, !c.no_verify, c.quiet);
    Outputs out;
    const auto t0 = clock_type::now();
#if defined(TG_WITH_CUDA)
    if (use_cuda) run<tg::Cuda>(c, data, out);
    else run<tg::Cpu>(c, data, out);
#else
    (void)use_cuda;
    run<tg::Cpu>(c, data, out);
#endif
    out.metrics["seconds"] = seconds_since(t0);
    if (c.rank != 0) return 0;
    // Everything is written at the end, each file whole or not at all (by rank 0 alone).
    const std::filesystem::path dir(c.out);
    std::filesystem::create_directories(dir);
    write_whole(dir / "class_examples.png", as_string(out.class_png));
    write_whole(dir / "test_predictions.png", as_string(out.predictions_png));
    write_whole(dir / "metrics.json", out.metrics.dump(2) + "\n");
    out.save_params((dir / "params.safetensors").string());
    if (out.save_checkpoint) out.save_checkpoint(c.save);
    write_whole(dir / "report.html", out.report.document("tapegrad: Fashion-MNIST, the codelab end to end"));
    if (!c.quiet)
      std::cout << "wrote " << (dir / "report.html").string() << ", metrics.json, class_examples.png, test_predictions.png, params.safetensors ("
                << fm::fmt("%.1f", seconds_since(t0)) << " s)\n";
    return 0;
  } catch (const fm::DataError& e) {
#if defined(TG_WITH_DIST)
    if (comm && comm->size() > 1) comm->abort(std::string("fashion_mnist: ") + e.what(), 2);
#endif
    std::cerr << "fashion_mnist: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
#if defined(TG_WITH_DIST)
    if (comm && comm->size() > 1) comm->abort(std::string("fashion_mnist: error: ") + e.what(), 1);
#endif
    std::cerr << "fashion_mnist: error: " << e.what() << "\n";
    return 1;
  }
}
