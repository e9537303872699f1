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

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
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

#include "codelab.hpp"
#include "dataset.hpp"
#include "outputs.hpp"
#include "report.hpp"

namespace fm = fashion_mnist;
using json = nlohmann::ordered_json;

namespace {

struct Config {
  int steps = 400;
  std::int64_t batch = 512;
  std::vector<std::int64_t> hidden{256, 128};
  double lr = 3e-3, weight_decay = 1e-4, sgd_lr = 3e-3;
  int log_every = 25;
  std::uint32_t seed = 0;
  std::string order = "numpy";  // the training set's shuffle: NumPy's default_rng(seed) (the codelab's) or jax.random
  std::string codelab_golden = FM_CODELAB_GOLDEN;
  std::string dtype = "f32";
  std::string device = "auto";
  std::string data_dir, out = "fashion_mnist_out", save, resume;
  bool no_download = false, no_verify = false, quiet = false, check_numerics = false, data_parallel = false;
  int rank = 0, ranks = 1;  // data parallel: this process's rank and the number of ranks
  int timing_steps = 100;
  double tokens_per_example = 784;
};

using codelab::Metrics;
template <class D>
using Mlp = codelab::Mlp<D>;

/// What --save writes and --resume reads: parameters and optimizer state (the step is in the metadata).
template <class P, class S>
struct TrainState {
  P params;
  S opt_state;
};
TG_PYTREE(TrainState, params, opt_state)

/// The training loss went NaN or infinite: the run stops at the first logged step that shows it.
struct Diverged : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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

/// The side-by-side table: the codelab's numbers (tests/data/codelab_golden.json) and this run's, with
/// their differences. Equal to f32 rounding before any training; after training they differ in the last
/// digits (f32 summation order in the GEMMs and reductions, oneDNN's vs XLA's kernels, GELU's and exp's
/// implementations), which AdamW's 401 steps carry into the third or fourth digit of the test metrics.
template <class Show, class Say>
void beside_the_codelab(const Config& c, json& metrics, Show&& show, Say&& say) {
  std::ifstream in(c.codelab_golden);
  if (!in) {
    say("The codelab's numbers are not here (" + c.codelab_golden + "; --codelab-golden): no comparison.");
    return;
  }
  const json golden = json::parse(in);
  const bool codelab_run = c.steps == 400 && c.batch == 512 && c.hidden == std::vector<std::int64_t>{256, 128} && c.lr == 3e-3 &&
                           c.weight_decay == 1e-4 && c.sgd_lr == 3e-3 && c.seed == 0 && c.order == "numpy" && c.dtype == "f32" &&
                           c.ranks == 1 && c.resume.empty();
  fm::Table t{"the codelab (JAX " + golden.value("jax", std::string("?")) + ", Optax " + golden.value("optax", std::string("?")) +
                  ") and this run",
              {"number", "codelab", "tapegrad", "difference", "relative"}, {}};
  json rows = json::array();
  auto row = [&](const std::string& what, double theirs, const json& ours_json) {
    if (!ours_json.is_number()) return;
    const double ours = ours_json.get<double>(), diff = ours - theirs, rel = std::fabs(diff) / std::max(std::fabs(theirs), 1e-30);
    t.rows.push_back({what, fm::fmt("%.8f", theirs), fm::fmt("%.8f", ours), fm::fmt("%+.2e", diff), fm::fmt("%.2e", rel)});
    rows.push_back({{"number", what}, {"codelab", theirs}, {"tapegrad", ours}, {"relative", rel}});
  };
  auto at = [&](const char* a, const char* b = nullptr) -> json {
    if (!metrics.contains(a)) return json();
    return b ? (metrics[a].contains(b) ? metrics[a][b] : json()) : metrics[a];
  };
  row("first-batch loss (key(1))", golden["first_batch_loss"], at("initial_loss"));
  row("loss after one SGD step (lr 3e-3)", golden["loss_after_one_sgd_step"], at("loss_after_one_sgd_step"));
  row("one compiled AdamW step (key(2)): loss", golden["one_step"]["loss"], at("one_step", "loss"));
  row("  batch accuracy", golden["one_step"]["accuracy"], at("one_step", "accuracy"));
  row("  gradient norm", golden["one_step"]["grad_norm"], at("one_step", "grad_norm"));
  const json& last = golden["history"].back();
  if (metrics.contains("history") && !metrics["history"].empty())
    row("training loss at step 400 (key(3))", last["loss"], metrics["history"].back()["loss"]);
  row("test loss after 400 steps", golden["test_loss"], at("test", "loss"));
  row("test accuracy after 400 steps", golden["test_accuracy"], at("test", "accuracy"));
  show(t);
  const bool same_samples = metrics.contains("test") && metrics["test"].contains("samples") &&
                            metrics["test"]["samples"]["images"] == golden["sample_test_images"];
  say(std::string(same_samples ? "The 25 sample test images are the codelab's." : "The 25 sample test images differ from the codelab's.") +
      (codelab_run ? " Before any training the numbers agree to f32 rounding; after 401 AdamW steps they differ in the last digits: "
                     "the same arithmetic in another order (f32 sums in oneDNN's GEMMs and tapegrad's reductions vs XLA's), "
                     "and GELU's and exp's float implementations, compounded over the steps."
                   : " This run's options differ from the codelab's (400 steps, batch 512, 256-128, adamw 3e-3 / 1e-4, SGD 3e-3, "
                     "--order numpy --seed 0, f32, one process): only the numbers before training are comparable."));
  metrics["codelab"] = {{"comparable", codelab_run}, {"same_sample_images", same_samples}, {"rows", rows}};
}

template <class D>
int run(const Config& c, fm::Loaded& data, Outputs& out) {
  using Params = Mlp<D>;
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
    const tg::BuildInfo info = tg::build_info();
    for (const auto& [item, value] : info.rows()) t.rows.push_back({item, value});
    t.rows.push_back({"device in use", device});
    if (c.ranks > 1) t.rows.push_back({"data parallel", std::to_string(c.ranks) + " ranks (MPI" + std::string(std::is_same_v<D, tg::Cpu> ? ")" : "; NCCL between GPUs)")});
    show(t);
    metrics["versions"] = {{"tapegrad", info.tapegrad}, {"onednn", info.onednn}, {"cuda_runtime", info.cuda_runtime}, {"cublaslt", info.cublaslt}};
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
          "Pixels / 255, flattened to 784; the training set shuffled once, " +
              (c.order == "numpy" ? "as the codelab, with np.random.default_rng(" + std::to_string(c.seed) + ").permutation(60000)"
                                  : "with jax.random.permutation(key(" + std::to_string(c.seed) + "), 60000) (--order jax)") +
              ", and cut into batches of " + std::to_string(c.batch) + " (tail trimmed); the test set in file order. Moved to the device once.");
  // The codelab's order: np.random.default_rng(0).permutation(60000); --order jax: jax.random.permutation(key(seed)).
  const auto train = c.order == "numpy"
      ? tg::data::fixed_batches<D>(data.train.images, data.train.labels, c.batch, 10,
                                   std::span<const std::int64_t>(tg::random::numpy::default_rng(c.seed).permutation(data.train.labels.size())),
                                   c.rank, c.ranks)
      : tg::data::fixed_batches<D>(data.train.images, data.train.labels, c.batch, 10, tg::random::key(c.seed), c.rank, c.ranks);
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
  const codelab::Sizes sizes{784, c.hidden[0], c.hidden[1], 10};
  Params params = codelab::init_mlp_params<D>(tg::random::key(1), sizes);  // the one-step demo's key
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
    const auto grads = tg::grad(codelab::cross_entropy_loss<D>)(params, b.x, b.y);
    const auto [value, grads2] = tg::value_and_grad(codelab::cross_entropy_loss<D>)(params, b.x, b.y);
    double max_diff = 0;
    fm::Table t{"the gradient tree beside the parameter tree (first batch)", {"path", "parameter", "gradient", "gradient norm"}, {}};
    tg::tree_for_each([&](const std::string& path, const auto& w, const auto& g, const auto& g2) {
      max_diff = std::max(max_diff, static_cast<double>(tg::max(tg::abs(g - g2)).item()));
      t.rows.push_back({path, shape_str(w.shape()), shape_str(g.shape()), fm::fmt("%.6f", std::sqrt(tg::sum(g * g).item()))});
    }, params, grads, grads2);
    show(t);
    const double loss0 = value.item();
    auto [next, loss_sgd] = codelab::sgd_step<D>(params, b.x, b.y, static_cast<float>(c.sgd_lr));
    const double loss1 = codelab::cross_entropy_loss<D>(next, b.x, b.y).item();
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
    for (int i = 0; i < 3; ++i) std::tie(p, last) = codelab::sgd_step<D>(p, train[i % train.size()].x, train[i % train.size()].y, lr);
    (void)last.item();
    auto t0 = clock_type::now();
    for (int i = 0; i < eager_steps; ++i) {
      const auto& b = train[static_cast<std::size_t>(i) % train.size()];
      std::tie(p, last) = codelab::sgd_step<D>(p, b.x, b.y, lr);
    }
    (void)last.item();  // synchronises
    const std::int64_t local_batch = c.batch / c.ranks;  // step 5 runs on this rank alone
    eager_eps = static_cast<double>(eager_steps * local_batch) / seconds_since(t0);
    auto step = tg::compile([lr](const Params& q, const Tensor& x, const Labels& y) { return codelab::sgd_step<D>(q, x, y, lr); });
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
  const codelab::StepOptions step_options{c.check_numerics, c.ranks > 1};
  auto step_f32 = tg::compile([&](const Params& p, const State& s, const Tensor& x, const Labels& y) {
    return codelab::train_step<float>(optimizer, p, s, x, y, step_options);
  });
  auto step_bf16 = tg::compile([&](const Params& p, const State& s, const Tensor& x, const Labels& y) {
    return codelab::train_step<tg::bf16>(optimizer, p, s, x, y, step_options);
  });
  auto step_main = [&](Params&& p, State&& s, const Tensor& x, const Labels& y) {
    return c.dtype == "bf16" ? step_bf16(std::move(p), std::move(s), x, y) : step_f32(std::move(p), std::move(s), x, y);
  };
  heading("6. AdamW", "adamw(" + fm::fmt("%g", c.lr) + ", weight_decay=" + fm::fmt("%g", c.weight_decay) +
                          "), built by chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate); compute dtype " + c.dtype +
                          ". Metrics stay on the device until logged every " + std::to_string(c.log_every) + " steps.");
  // The training starts from key(3), the one-step table below from key(2): the codelab's keys.
  params = codelab::init_mlp_params<D>(tg::random::key(3), sizes);
  State state = optimizer.init(params);
  std::vector<double> h_step, h_loss, h_acc, h_norm;
  double adamw_eps = 0;
  // What must match for a checkpoint to continue this run bitwise: the data order and the model.
  const std::map<std::string, std::string> run_identity{{"seed", std::to_string(c.seed)}, {"batch", std::to_string(c.batch)},
                                                        {"hidden", std::to_string(c.hidden[0]) + "," + std::to_string(c.hidden[1])},
                                                        {"lr", fm::fmt("%.17g", c.lr)}, {"weight_decay", fm::fmt("%.17g", c.weight_decay)},
                                                        {"dtype", c.dtype}, {"order", c.order}};
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
    const Params p2 = codelab::init_mlp_params<D>(tg::random::key(2), sizes);
    auto [p1, s1, m1] = step_main(Params(p2), optimizer.init(p2), train[0].x, train[0].y);
    fm::Table one{"one compiled AdamW step (first batch, parameters from key(2))", {"loss", "batch accuracy", "gradient norm"}, {}};
    one.rows.push_back({fm::fmt("%.6f", m1.loss.item()), fm::fmt("%.4f", m1.accuracy.item()), fm::fmt("%.6f", m1.grad_norm.item())});
    show(one);
    metrics["one_step"] = {{"loss", m1.loss.item()}, {"accuracy", m1.accuracy.item()}, {"grad_norm", m1.grad_norm.item()}};
    if (first_step == 1) {
      // As the codelab: one step on the first batch before the loop (it compiles the step), then the loop.
      auto [pw, sw, mw] = step_main(std::move(params), std::move(state), train[0].x, train[0].y);
      params = std::move(pw), state = std::move(sw);
      (void)mw.loss.item();
    }

    fm::Progress progress("training", c.steps, c.quiet);
    clock_type::time_point t0 = clock_type::now();
    std::string status;
    codelab::train_loop(step_main, params, state, train, first_step, c.steps, c.log_every, [&](int at, const Metrics<D>& m, bool log) {
      if (c.check_numerics) {
        tg::check_finite(m.loss, "loss at step " + std::to_string(at));
        tg::raise_if_nonfinite(m.grad_flags, "gradient at step " + std::to_string(at));
      }
      if (log) {
        h_step.push_back(at), h_loss.push_back(m.loss.item()), h_acc.push_back(m.accuracy.item()), h_norm.push_back(m.grad_norm.item());
        if (!std::isfinite(h_loss.back()))
          throw Diverged("the training loss is " + fm::fmt("%g", h_loss.back()) + " at step " + std::to_string(at) +
                         " (the first logged step where it is not finite; logging every " + std::to_string(c.log_every) +
                         "): the training diverged. The likely cause is the learning rate (--lr " + fm::fmt("%g", c.lr) +
                         "; the codelab's is 3e-3). Rerun with --check-numerics to stop at the first step whose loss or "
                         "gradients are not finite, naming the leaf");
        status = "loss " + fm::fmt("%.4f", h_loss.back()) + "  acc " + fm::fmt("%.3f", h_acc.back());
      }
      progress.update(at, status, log);
    });
    const int timed = c.steps - first_step + 1;  // the step before the loop recorded the compiled step
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
    tp.rows.push_back({"examples/sec (" + std::to_string(timed) + " steps after 1 warm-up step)", fm::grouped(adamw_eps)});
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
    auto evaluate = tg::compile(&codelab::evaluate<D>);
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

    // The codelab's 25 sample test images, np.random.default_rng(7).choice(10000, 25, replace=False),
    // predicted from the images themselves (the batches hold only the first 19 x 512).
    const auto pick = tg::random::numpy::default_rng(7).choice(data.test.labels.size(), 25);
    const auto px = data.test.images.to_vector();
    const auto all_labels = data.test.labels.to_vector();
    std::vector<std::int32_t> sample_predicted, sample_truth;  // of the 25, in the order picked
    {
      std::vector<float> xs;
      for (const std::int64_t i : pick)
        for (std::size_t f = 0; f < 784; ++f) xs.push_back(static_cast<float>(px[static_cast<std::size_t>(i) * 784 + f]) / 255.0f);
      sample_predicted = tg::argmax(codelab::mlp<float>(params, tg::from_vector<D>(xs, {25, 784})), 1).to_vector();
      for (const std::int64_t i : pick) sample_truth.push_back(all_labels[static_cast<std::size_t>(i)]);
    }
    std::vector<fm::Tile> tiles;
    std::string figures = "<div class=\"grid\">";
    for (std::size_t k = 0; k < 25; ++k) {
      const auto i = static_cast<std::size_t>(pick[k]);
      const auto pred = static_cast<std::size_t>(sample_predicted[k]), true_class = static_cast<std::size_t>(sample_truth[k]);
      const bool ok = pred == true_class;
      const std::uint8_t* p = px.data() + i * 784;
      tiles.push_back(ok ? fm::Tile{p, 30, 132, 73} : fm::Tile{p, 192, 57, 43});
      figures += std::string("<figure class=\"") + (ok ? "ok" : "bad") + "\"><img alt=\"test image " + std::to_string(i) + "\" src=\"" +
                 fm::png_data_uri(fm::encode_png(fm::image_grid({{p, 255, 255, 255}}, 1, 3))) + "\"><figcaption>" +
                 fm::html_escape(fm::class_names[pred]) + (ok ? "" : "<br>(true: " + fm::html_escape(fm::class_names[true_class]) + ")") +
                 "</figcaption></figure>";
    }
    out.predictions_png = fm::encode_png(fm::image_grid(tiles, 5, 3));
    report.html("<p>The codelab's 25 sample test images (<code>np.random.default_rng(7).choice(10000, 25, replace=False)</code>): "
                "the prediction, green when right, red (with the true class) when wrong.</p>" + figures + "</div>");
    metrics["test"]["samples"] = {{"images", pick}, {"predicted", sample_predicted}, {"truth", sample_truth}};
    if (!c.quiet) {
      std::cout << "  the codelab's 25 sample test images (index: prediction / truth):\n";
      for (std::size_t k = 0; k < 25; ++k)
        std::printf("    %5lld  %-12s %-12s %s\n", static_cast<long long>(pick[k]), fm::class_names[static_cast<std::size_t>(sample_predicted[k])],
                    fm::class_names[static_cast<std::size_t>(sample_truth[k])], sample_predicted[k] == sample_truth[k] ? "right" : "WRONG");
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
                                        std::to_string(c.timing_steps) + " compiled steps each after one warm-up step, from parameters drawn with key(10) "
                                        "(the codelab's).");
  {
    fm::Table t{"compute dtype", {"compute", "examples/sec", "loss after", "vs f32"}, {}};
    std::vector<double> eps;
    for (const bool bf16 : {false, true}) {
      Params p = codelab::init_mlp_params<D>(tg::random::key(10), sizes);  // the codelab's key for this comparison
      State s = optimizer.init(p);
      Metrics<D> m;
      auto go = [&](int i) {
        const auto& b = train[static_cast<std::size_t>(i) % train.size()];
        auto [p2, s2, m2] = bf16 ? step_bf16(std::move(p), std::move(s), b.x, b.y) : step_f32(std::move(p), std::move(s), b.x, b.y);
        p = std::move(p2), s = std::move(s2), m = std::move(m2);
      };
      go(0);  // as the codelab: one step on the first batch (it compiles), then the timed steps from batch 0
      (void)m.loss.item();
      const auto t0 = clock_type::now();
      for (int i = 0; i < c.timing_steps; ++i) go(i);
      const double loss = m.loss.item();
      eps.push_back(static_cast<double>(c.timing_steps) * static_cast<double>(c.batch) / seconds_since(t0));  // global batch
      t.rows.push_back({bf16 ? "bf16" : "f32", fm::grouped(eps.back()), fm::fmt("%.4f", loss), fm::fmt("%.2fx", eps.back() / eps.front())});
      metrics["throughput"][bf16 ? "adamw_bf16" : "adamw_f32"] = eps.back();
    }
    show(t);
    report.html(fm::svg_bars({"f32 compute", "bf16 compute"}, eps, "examples/s"));
    if constexpr (std::is_same_v<D, tg::Cpu>) {
      if (!tg::build_info().cpu_bf16)
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
  // 10. Beside the codelab --------------------------------------------------------------------------------
  heading("10. Beside the codelab", "Each number the codelab prints, computed by its own JAX + Optax code on the same data "
                                    "(scripts/codelab_golden.py, JAX's CPU backend), beside this run's.");
  beside_the_codelab(c, metrics, show, say);

  metrics["config"] = {{"steps", c.steps}, {"batch", c.batch}, {"hidden", c.hidden}, {"lr", c.lr}, {"weight_decay", c.weight_decay},
                       {"sgd_lr", c.sgd_lr}, {"log_every", c.log_every}, {"seed", c.seed}, {"order", c.order}, {"dtype", c.dtype},
                       {"timing_steps", c.timing_steps}};
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
  app.add_option("--sgd-lr", c.sgd_lr, "learning rate of the hand-written SGD step (steps 4 and 5; the codelab's LEARNING_RATE)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--log-every", c.log_every, "log the metrics every N steps")->check(CLI::Range(1, 10000000))->capture_default_str();
  app.add_option("--seed", c.seed, "seed of the training-set shuffle (the codelab's keys and sample images are fixed)")->capture_default_str();
  app.add_option("--order", c.order, "the training set's shuffle: numpy (np.random.default_rng(seed).permutation, the codelab's) or jax "
                                     "(jax.random.permutation(key(seed)), tapegrad 0.1's order)")
      ->check(CLI::IsMember({"numpy", "jax"}))->capture_default_str();
  app.add_option("--codelab-golden", c.codelab_golden, "the codelab's numbers for the side-by-side table (scripts/codelab_golden.py)")
      ->capture_default_str();
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
    if (c.rank == 0) fm::check_output_dir(c.out);  // before training, not after it
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
    std::filesystem::create_directories(dir);  // checked writable before training
    fm::write_whole(dir / "class_examples.png", fm::as_string(out.class_png));
    fm::write_whole(dir / "test_predictions.png", fm::as_string(out.predictions_png));
    fm::write_whole(dir / "metrics.json", out.metrics.dump(2) + "\n");
    out.save_params((dir / "params.safetensors").string());
    if (out.save_checkpoint) out.save_checkpoint(c.save);
    fm::write_whole(dir / "report.html", out.report.document("tapegrad: Fashion-MNIST, the codelab end to end"));
    if (!c.quiet)
      std::cout << "wrote " << (dir / "report.html").string() << ", metrics.json, class_examples.png, test_predictions.png, params.safetensors ("
                << fm::fmt("%.1f", seconds_since(t0)) << " s)\n";
    return 0;
  } catch (const Diverged& e) {
#if defined(TG_WITH_DIST)
    if (comm && comm->size() > 1) comm->abort(std::string("fashion_mnist: ") + e.what(), 1);
#endif
    std::cerr << "fashion_mnist: " << e.what() << "\n";
    return 1;
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
