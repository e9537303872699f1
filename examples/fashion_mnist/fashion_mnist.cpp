// fashion_mnist: the JAX codelab's first job, end to end — an MLP (784-256-128-10, GELU) trained on the
// real Fashion-MNIST with fixed device batches, value_and_grad with aux metrics, a compiled step, AdamW
// built from composable transforms, honest throughput, evaluation, f32 vs bf16 compute and a placement
// check. The training code is codelab.hpp's, under the codelab's names; this file runs it section by
// section, as the codelab's cells, and reports each (tables on the terminal, everything in a self-contained
// HTML report under --out) with the examples' shared report, command line, outputs and data checks
// (examples/common). Built by g++ as fashion_mnist (CPU) and by nvcc as fashion_mnist_cuda (this file,
// included by fashion_mnist_cuda.cu), where --device auto picks the GPU when there is one.
#include <tapegrad/tapegrad.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#if defined(TG_WITH_DIST)
#include <tapegrad/distributed/distributed.hpp>
#endif

#include "../common/cli.hpp"
#include "../common/dataset.hpp"
#include "../common/evaluation.hpp"
#include "../common/outputs.hpp"
#include "../common/report.hpp"
#include "codelab.hpp"

namespace ex = examples;
using json = nlohmann::ordered_json;

namespace {

struct Config : ex::CommonOptions {
  int steps = 400;
  std::int64_t batch = 512;
  std::vector<std::int64_t> hidden{256, 128};
  double lr = 3e-3, weight_decay = 1e-4, sgd_lr = 3e-3;
  int log_every = 25;
  std::uint32_t seed = 0;
  std::string order = "numpy";  // the training set's shuffle: NumPy's default_rng(seed) (the codelab's) or jax.random
  std::string codelab_golden = EXAMPLE_GOLDEN;
  std::string save, resume;
  bool no_verify = false, check_numerics = false, data_parallel = false;
  int rank = 0, ranks = 1;  // data parallel: this process's rank and the number of ranks
  int timing_steps = 100;
  double tokens_per_example = 784;
};

/// What --save writes and --resume reads: parameters and optimizer state (the step is in the metadata).
template <class P, class S>
struct TrainState {
  P params;
  S opt_state;
};
TG_PYTREE(TrainState, params, opt_state)

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

/// Everything a run produces that is written at the end (nothing is written under --out before).
struct Outputs {
  ex::Report report;
  json metrics = json::object();
  std::vector<std::uint8_t> class_png, predictions_png;
  std::function<void(const std::string&)> save_params, save_checkpoint;
};

/// The codelab on device D, section by section. The members are what the sections hand on to each other:
/// the batches, the model's sizes, the optimizer, its compiled step (one per compute dtype), the trained
/// parameters and state.
template <class D>
class Codelab {
 public:
  using Params = codelab::Mlp<D>;
  using Tensor = tg::Tensor<float, D>;
  using Labels = tg::Tensor<std::int32_t, D>;
  using Optimizer = decltype(tg::optim::adamw(3e-3));
  using State = decltype(std::declval<Optimizer>().init(std::declval<Params>()));

  Codelab(const Config& c, ex::Loaded& data, Outputs& out)
      : c_(c), data_(data), out_(out), log_(out.report, c.quiet), metrics_(out.metrics), device_(tg::device_name<D>()),
        sizes_{784, c.hidden[0], c.hidden[1], 10}, optimizer_(tg::optim::adamw(c.lr, {.weight_decay = c.weight_decay})),
        step_f32_(compiled_step<float>()), step_bf16_(compiled_step<tg::bf16>()) {}

  void run() {
    setup();
    data();
    batches();
    model();
    eager_vs_compiled();
    adamw();
    evaluation();
    compute_dtypes();
    placement();
    beside_the_codelab();
    outputs();
  }

 private:
  // 1. The library, its backends and the device.
  void setup() {
    log_.heading("1. Setup", "The library, its backends and the device this run uses.");
    ex::Table t{"versions and devices", {"item", "value"}, {}};
    const tg::BuildInfo info = tg::build_info();
    for (const auto& [item, value] : info.rows()) t.rows.push_back({item, value});
    t.rows.push_back({"device in use", device_});
    if (c_.ranks > 1)
      t.rows.push_back({"data parallel", std::to_string(c_.ranks) + " ranks (MPI" + std::string(std::is_same_v<D, tg::Cpu> ? ")" : "; NCCL between GPUs)")});
    log_.show(t);
    metrics_["versions"] = {{"tapegrad", info.tapegrad}, {"onednn", info.onednn}, {"cuda_runtime", info.cuda_runtime}, {"cublaslt", info.cublaslt}};
    metrics_["device"] = device_;
  }

  // 2. The data, verified, and one example per class.
  void data() {
    log_.heading("2. Data", "Fashion-MNIST from " + data_.dir.string() + ", every file verified by the SHA-256 of its decompressed payload.");
    ex::Table t{"Fashion-MNIST", {"split", "images", "image shape", "labels", "payload SHA-256 (images / labels)"}, {}};
    const ex::Split* splits[2] = {&data_.train, &data_.test};
    const char* names[2] = {"train", "test"};
    for (std::size_t s = 0; s < 2; ++s) {
      const auto& sh = splits[s]->images.shape();
      t.rows.push_back({names[s], ex::grouped(static_cast<double>(sh[0])), "(" + std::to_string(sh[1]) + ", " + std::to_string(sh[2]) + ")",
                        ex::grouped(static_cast<double>(splits[s]->labels.size())),
                        data_.sha256[2 * s].substr(0, 12) + "... / " + data_.sha256[2 * s + 1].substr(0, 12) + "..."});
    }
    log_.show(t);
    if (c_.no_verify) log_.say("Checksums NOT verified (--no-verify).");
    metrics_["data"] = {{"dir", data_.dir.string()}, {"verified", !c_.no_verify}, {"payload_sha256", data_.sha256}};
    // One example per class: the first of each in the training set.
    const auto px = data_.train.images.to_vector();
    const auto lab = data_.train.labels.to_vector();
    std::vector<ex::Tile> tiles;
    std::string figures = "<div class=\"grid\">";
    for (std::uint8_t k = 0; k < 10; ++k) {
      const auto at = static_cast<std::size_t>(std::find(lab.begin(), lab.end(), k) - lab.begin());
      const std::uint8_t* p = px.data() + at * 784;
      tiles.push_back({p, 200, 200, 200});
      figures += "<figure><img alt=\"" + std::string(ex::class_names[k]) + "\" src=\"" +
                 ex::png_data_uri(ex::encode_png(ex::image_grid({{p, 255, 255, 255}}, 1, 3))) + "\"><figcaption>" +
                 ex::html_escape(ex::class_names[k]) + "</figcaption></figure>";
    }
    out_.class_png = ex::encode_png(ex::image_grid(tiles, 10, 3));
    log_.html("<p>One example per class (the first of each in the training set):</p>" + figures + "</div>");
  }

  // 3. Fixed batches, moved to the device once.
  void batches() {
    log_.heading("3. Fixed batches on the device",
                 "Pixels / 255, flattened to 784; the training set shuffled once, " +
                     (c_.order == "numpy" ? "as the codelab, with np.random.default_rng(" + std::to_string(c_.seed) + ").permutation(60000)"
                                          : "with jax.random.permutation(key(" + std::to_string(c_.seed) + "), 60000) (--order jax)") +
                     ", and cut into batches of " + std::to_string(c_.batch) + " (tail trimmed); the test set in file order. Moved to the device once.");
    const auto& train = data_.train;
    train_ = c_.order == "numpy"
                 ? tg::data::fixed_batches<D>(train.images, train.labels, c_.batch, 10,
                                              std::span<const std::int64_t>(tg::random::numpy::default_rng(c_.seed).permutation(train.labels.size())),
                                              c_.rank, c_.ranks)
                 : tg::data::fixed_batches<D>(train.images, train.labels, c_.batch, 10, tg::random::key(c_.seed), c_.rank, c_.ranks);
    test_ = tg::data::fixed_batches<D>(data_.test.images, data_.test.labels, c_.batch, 10);
    std::vector<Tensor> xs;
    std::vector<tg::Tensor<std::int32_t, D>> ys;
    for (const auto& b : test_) xs.push_back(b.x), ys.push_back(b.y);
    test_x_ = tg::stack(std::span<const Tensor>(xs)), test_y_ = tg::stack(std::span<const tg::Tensor<std::int32_t, D>>(ys));
    ex::Table t{"device arrays", {"array", "shape", "dtype", "device"}, {}};
    auto row = [&](const std::string& name, std::size_t n, const auto& one) {
      using T = typename std::remove_cvref_t<decltype(one)>::value_type;
      t.rows.push_back({name, std::to_string(n) + " x " + one.shape().str(), tg::dtype_name<T>, one.device_name()});
    };
    row("train images", train_.size(), train_[0].x);
    row("train labels", train_.size(), train_[0].y);
    row("test images", test_.size(), test_[0].x);
    row("test labels", test_.size(), test_[0].y);
    log_.show(t);
    if (c_.ranks > 1)
      log_.say("Data parallel: each of the " + std::to_string(c_.ranks) + " ranks holds its " + std::to_string(c_.batch / c_.ranks) +
               " examples of every global batch of " + std::to_string(c_.batch) + " (shown: rank 0's); the test set is evaluated whole on every rank.");
    metrics_["batches"] = {{"train", train_.size()}, {"test", test_.size()}, {"batch_size", c_.batch}, {"ranks", c_.ranks}};
  }

  // 4. The model, its gradient tree, and one SGD step by hand.
  void model() {
    log_.heading("4. Model", "MLP 784-" + std::to_string(c_.hidden[0]) + "-" + std::to_string(c_.hidden[1]) +
                                 "-10 with GELU (tanh form), He-normal weights from key(1), zero biases, as a TG_PYTREE struct.");
    const Params params = codelab::init_mlp_params<D>(tg::random::key(1), sizes_);  // the one-step demo's key
    ex::Table t{"parameters", {"parameter", "shape", "dtype", "device"}, {}};
    tg::tree_for_each([&](const std::string& path, const auto& leaf) {
      t.rows.push_back({path, leaf.shape().str(), "float32", leaf.device_name()});
    }, params);
    t.rows.push_back({"total", ex::grouped(static_cast<double>(tg::tree_count(params))) + " parameters", "", ""});
    log_.show(t);
    metrics_["parameters"] = tg::tree_count(params);

    const auto& b = train_[0];
    const auto grads = tg::grad(codelab::cross_entropy_loss<D>)(params, b.x, b.y);
    const auto [value, grads2] = tg::value_and_grad(codelab::cross_entropy_loss<D>)(params, b.x, b.y);
    double max_diff = 0;
    ex::Table g{"the gradient tree beside the parameter tree (first batch)", {"path", "parameter", "gradient", "gradient norm"}, {}};
    tg::tree_for_each([&](const std::string& path, const auto& w, const auto& gw, const auto& gw2) {
      max_diff = std::max(max_diff, static_cast<double>(tg::max(tg::abs(gw - gw2)).item()));
      g.rows.push_back({path, w.shape().str(), gw.shape().str(), ex::fmt("%.6f", std::sqrt(tg::sum(gw * gw).item()))});
    }, params, grads, grads2);
    log_.show(g);
    const double loss0 = value.item();
    const auto [next, loss_sgd] = codelab::sgd_step<D>(params, b.x, b.y, static_cast<float>(c_.sgd_lr));
    const double loss1 = codelab::cross_entropy_loss<D>(next, b.x, b.y).item();
    ex::Table s{"one step by hand", {"quantity", "value"}, {}};
    s.rows.push_back({"max |grad - value_and_grad's grad|", ex::fmt("%.3g", max_diff)});
    s.rows.push_back({"loss before the update (first batch)", ex::fmt("%.8f", loss0)});
    s.rows.push_back({"loss after one pure SGD step (lr " + ex::fmt("%g", c_.sgd_lr) + ", same batch)", ex::fmt("%.8f", loss1)});
    log_.show(s);
    metrics_["initial_loss"] = loss0;
    metrics_["grad_vs_value_and_grad_max_diff"] = max_diff;
    metrics_["loss_after_one_sgd_step"] = loss1;
  }

  // 5. The hand-written SGD step, eager and compiled.
  void eager_vs_compiled() {
    log_.heading("5. Eager vs compiled step",
                 "The hand-written SGD step run eagerly (the tape every call) and through tg::compile (recorded once, replayed). "
                 "Examples/sec after warm-up, the device synchronised before the clock stops.");
    const int eager_steps = std::max(1, c_.timing_steps / 5), compiled_steps = c_.timing_steps;
    const float lr = static_cast<float>(c_.sgd_lr);
    const std::int64_t local_batch = c_.batch / c_.ranks;  // this section runs on each rank alone
    const Params params = codelab::init_mlp_params<D>(tg::random::key(1), sizes_);
    auto timed = [&](auto&& step, int warm_up, int steps) {
      Params p = params;
      Tensor last;
      for (int i = 0; i < warm_up; ++i) std::tie(p, last) = step(std::move(p), batch(i).x, batch(i).y);
      (void)last.item();
      const auto t0 = clock_type::now();
      for (int i = 0; i < steps; ++i) std::tie(p, last) = step(std::move(p), batch(i).x, batch(i).y);
      (void)last.item();  // synchronises
      return static_cast<double>(steps * local_batch) / seconds_since(t0);
    };
    const double eager = timed([lr](const Params& q, const Tensor& x, const Labels& y) { return codelab::sgd_step<D>(q, x, y, lr); }, 3,
                               eager_steps);
    auto step = tg::compile([lr](const Params& q, const Tensor& x, const Labels& y) { return codelab::sgd_step<D>(q, x, y, lr); });
    const double compiled = timed(step, 5, compiled_steps);
    ex::Table t{"SGD step throughput", {"mode", "steps timed", "examples/sec", "vs eager"}, {}};
    t.rows.push_back({"eager", std::to_string(eager_steps), ex::grouped(eager), "1.00x"});
    t.rows.push_back({"compiled (tg::compile)", std::to_string(compiled_steps), ex::grouped(compiled), ex::fmt("%.2fx", compiled / eager)});
    log_.show(t);
    log_.html(ex::svg_bars({"eager", "compiled"}, {eager, compiled}, "examples/s"));
    if constexpr (std::is_same_v<D, tg::Cpu>)
      log_.say("On the CPU the kernels themselves dominate and the eager step's bookkeeping is small, so compile gains little here "
               "(and each call copies its batch into the plan's input buffer); on a GPU it replaces tens of kernel launches per step "
               "with one graph launch.");
    metrics_["throughput"]["sgd_eager"] = eager;
    metrics_["throughput"]["sgd_compiled"] = compiled;
  }

  // 6. AdamW: the training loop over the compiled step, from a checkpoint with --resume.
  void adamw() {
    log_.heading("6. AdamW", "adamw(" + ex::fmt("%g", c_.lr) + ", weight_decay=" + ex::fmt("%g", c_.weight_decay) +
                                 "): chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate), run as one pass; compute dtype " +
                                 c_.dtype + ". Metrics stay on the device until logged every " + std::to_string(c_.log_every) + " steps.");
    // The training starts from key(3), the one-step table below from key(2): the codelab's keys.
    params_ = codelab::init_mlp_params<D>(tg::random::key(3), sizes_);
    state_ = optimizer_.init(params_);
    const int first_step = c_.resume.empty() ? 1 : resume();
    {
      const Params p2 = codelab::init_mlp_params<D>(tg::random::key(2), sizes_);
      const auto [p1, s1, m1] = step(Params(p2), optimizer_.init(p2), train_[0].x, train_[0].y);
      ex::Table one{"one compiled AdamW step (first batch, parameters from key(2))", {"loss", "batch accuracy", "gradient norm"}, {}};
      one.rows.push_back({ex::fmt("%.6f", m1.loss.item()), ex::fmt("%.4f", m1.accuracy.item()), ex::fmt("%.6f", m1.grad_norm.item())});
      log_.show(one);
      metrics_["one_step"] = {{"loss", m1.loss.item()}, {"accuracy", m1.accuracy.item()}, {"grad_norm", m1.grad_norm.item()}};
    }
    if (first_step == 1) {
      // As the codelab: one step on the first batch before the loop (it compiles the step), then the loop.
      auto [pw, sw, mw] = step(std::move(params_), std::move(state_), train_[0].x, train_[0].y);
      params_ = std::move(pw), state_ = std::move(sw);
      (void)mw.loss.item();
    }
    ex::Progress progress("training", c_.steps, c_.quiet);
    const auto t0 = clock_type::now();
    std::string status;
    auto compiled = [this](Params&& p, State&& s, const Tensor& x, const Labels& y) { return step(std::move(p), std::move(s), x, y); };
    codelab::train_loop(compiled, params_, state_, train_, first_step, c_.steps, c_.log_every, [&](int at, const codelab::Metrics<D>& m, bool log) {
      if (c_.check_numerics) {
        tg::check_finite(m.loss, "loss at step " + std::to_string(at));
        tg::raise_if_nonfinite(m.grad_flags, "gradient at step " + std::to_string(at));
      }
      if (log) {
        history_.step.push_back(at), history_.loss.push_back(m.loss.item()), history_.accuracy.push_back(m.accuracy.item());
        history_.grad_norm.push_back(m.grad_norm.item());
        if (!std::isfinite(history_.loss.back()))
          throw ex::Diverged("the training loss is " + ex::fmt("%g", history_.loss.back()) + " at step " + std::to_string(at) +
                             " (the first logged step where it is not finite; logging every " + std::to_string(c_.log_every) +
                             "): the training diverged. The likely cause is the learning rate (--lr " + ex::fmt("%g", c_.lr) +
                             "; the codelab's is 3e-3). Rerun with --check-numerics to stop at the first step whose loss or "
                             "gradients are not finite, naming the leaf");
        status = "loss " + ex::fmt("%.4f", history_.loss.back()) + "  acc " + ex::fmt("%.3f", history_.accuracy.back());
      }
      progress.update(at, status, log);
    });
    const int timed = c_.steps - first_step + 1;  // the step before the loop recorded the compiled step
    // Global examples: c.batch per step over all ranks together; the last log synchronised.
    const double eps = timed > 0 ? static_cast<double>(timed) * static_cast<double>(c_.batch) / seconds_since(t0) : 0.0;
    metrics_["history"] = ex::report_history(log_, "history", history_);
    ex::Table tp{"AdamW training throughput", {"measure", "value"}, {}};
    tp.rows.push_back({"examples/sec (" + std::to_string(timed) + " steps after 1 warm-up step)", ex::grouped(eps)});
    tp.rows.push_back({"tokens/sec (projection)", ex::grouped(eps * c_.tokens_per_example)});
    log_.show(tp);
    log_.say("The tokens/sec figure is a projection, not a measurement: examples/sec times " + ex::fmt("%g", c_.tokens_per_example) +
             " tokens per example (--tokens-per-example; 784 counts each pixel as a token), to compare with sequence-model throughputs.");
    metrics_["throughput"]["adamw"] = eps;
    metrics_["throughput"]["tokens_per_sec_projection"] = eps * c_.tokens_per_example;
    metrics_["throughput"]["tokens_per_example"] = c_.tokens_per_example;
  }

  // 7. The test set: loss and accuracy, the codelab's 25 sample images, the confusion matrix.
  void evaluation() {
    log_.heading("7. Evaluation", "Over the " + std::to_string(test_.size()) + " test batches (" +
                                      ex::grouped(static_cast<double>(test_.size()) * static_cast<double>(c_.batch)) + " images).");
    // The codelab's evaluation: eval_one_batch vmapped over the stacked test batches, compiled.
    auto evaluate = tg::compile(&codelab::evaluate_batches<D>);
    const auto [losses, pred] = evaluate(params_, test_x_, test_y_);
    double loss_sum = 0;
    for (const float l : losses.to_vector()) loss_sum += l;
    const std::vector<std::int32_t> predicted = pred.to_vector(), truth = test_y_.to_vector();
    std::size_t correct = 0;
    for (std::size_t i = 0; i < truth.size(); ++i) correct += truth[i] == predicted[i];
    const double n = static_cast<double>(truth.size());
    const double test_loss = loss_sum / n, test_acc = static_cast<double>(correct) / n;
    ex::Table t{"test set", {"images", "loss", "accuracy"}, {}};
    t.rows.push_back({ex::grouped(n), ex::fmt("%.4f", test_loss), ex::fmt("%.4f", test_acc)});
    log_.show(t);
    metrics_["test"] = {{"images", truth.size()}, {"loss", test_loss}, {"accuracy", test_acc}};

    // The codelab's 25 sample test images, np.random.default_rng(7).choice(10000, 25, replace=False),
    // predicted from the images themselves (the batches hold only the first 19 x 512).
    const auto pick = tg::random::numpy::default_rng(7).choice(data_.test.labels.size(), 25);
    const auto px = data_.test.images.to_vector();
    const auto labels = data_.test.labels.to_vector();
    std::vector<float> xs;
    for (const std::int64_t i : pick)
      for (std::size_t f = 0; f < 784; ++f) xs.push_back(static_cast<float>(px[static_cast<std::size_t>(i) * 784 + f]) / 255.0f);
    const auto sample_predicted = tg::argmax(codelab::mlp<float>(params_, tg::from_vector<D>(xs, {25, 784})), 1).to_vector();
    std::vector<std::int32_t> sample_truth;
    for (const std::int64_t i : pick) sample_truth.push_back(labels[static_cast<std::size_t>(i)]);
    out_.predictions_png = ex::report_samples(log_, px, labels, pick, sample_predicted);
    metrics_["test"]["samples"] = {{"images", pick}, {"predicted", sample_predicted}, {"truth", sample_truth}};
    metrics_["test"]["confusion_counts"] = ex::report_confusion(log_, truth, predicted);
  }

  // 8. The same step computing in f32 and in bf16.
  void compute_dtypes() {
    log_.heading("8. f32 vs bf16 compute", "The same AdamW step computing in f32 and in bf16 (parameters and optimizer state stay f32), " +
                                               std::to_string(c_.timing_steps) +
                                               " compiled steps each after one warm-up step, from parameters drawn with key(10) (the codelab's).");
    ex::Table t{"compute dtype", {"compute", "examples/sec", "loss after", "vs f32"}, {}};
    std::vector<double> eps;
    auto measure = [&]<class C>(auto& compiled) {
      Params p = codelab::init_mlp_params<D>(tg::random::key(10), sizes_);  // the codelab's key for this comparison
      State s = optimizer_.init(p);
      codelab::Metrics<D> m;
      auto go = [&](int i) {
        auto [p2, s2, m2] = compiled(std::move(p), std::move(s), batch(i).x, batch(i).y);
        p = std::move(p2), s = std::move(s2), m = std::move(m2);
      };
      go(0);  // as the codelab: one step on the first batch (it compiles), then the timed steps from batch 0
      (void)m.loss.item();
      const auto t0 = clock_type::now();
      for (int i = 0; i < c_.timing_steps; ++i) go(i);
      const double loss = m.loss.item();
      eps.push_back(static_cast<double>(c_.timing_steps) * static_cast<double>(c_.batch) / seconds_since(t0));  // global batch
      const char* name = std::is_same_v<C, float> ? "f32" : "bf16";
      t.rows.push_back({name, ex::grouped(eps.back()), ex::fmt("%.4f", loss), ex::fmt("%.2fx", eps.back() / eps.front())});
      metrics_["throughput"][std::string("adamw_") + name] = eps.back();
    };
    measure.template operator()<float>(step_f32_);
    measure.template operator()<tg::bf16>(step_bf16_);
    log_.show(t);
    log_.html(ex::svg_bars({"f32 compute", "bf16 compute"}, eps, "examples/s"));
    if (std::is_same_v<D, tg::Cpu> && !tg::build_info().cpu_bf16)
      log_.say("This CPU has no bf16 instructions (AVX-512 BF16 / AMX): bf16 GEMMs run as f32 after a conversion, so bf16 compute is "
               "slower here; it pays on GPUs and on CPUs with those instructions.");
  }

  // 9. Where everything the training touched lives.
  void placement() {
    log_.heading("9. Placement check", "Where everything the training touched lives.");
    ex::Table t{"placement", {"what", "tensors", "devices"}, {}};
    bool all_here = true;
    auto check = [&](const std::string& what, const auto& tree) {
      std::set<std::string> devices;
      int n = 0;
      tg::tree_for_each_tensor([&](std::size_t, const std::string&, const auto& leaf) { devices.insert(leaf.device_name()), ++n; }, tree);
      std::string list;
      for (const auto& d : devices) list += (list.empty() ? "" : ", ") + d, all_here = all_here && d == device_;
      t.rows.push_back({what, std::to_string(n), list});
    };
    check("parameters", params_);
    check("optimizer state", state_);
    std::vector<tg::data::Batch<D>> all(train_.begin(), train_.end());
    all.insert(all.end(), test_.begin(), test_.end());
    std::set<std::string> devices;
    for (const auto& b : all) devices.insert(b.x.device_name()), devices.insert(b.y.device_name());
    std::string list;
    for (const auto& d : devices) list += (list.empty() ? "" : ", ") + d, all_here = all_here && d == device_;
    t.rows.push_back({"batches (train and test)", std::to_string(2 * all.size()), list});
#if defined(TG_WITH_DIST)
    if (c_.ranks > 1) {
      tg::dist::check_identical(params_, "parameters");  // throws on every rank if any rank drifted
      tg::dist::check_identical(state_, "optimizer state");
      t.rows.push_back({"parameters and optimizer state on all " + std::to_string(c_.ranks) + " ranks", "", "identical (hash compared)"});
      metrics_["ranks_identical"] = true;
    }
#endif
    log_.show(t);
    log_.say(std::string(all_here ? "Everything stayed on " : "NOT everything is on ") + device_ + ". Final training loss (step " +
             std::to_string(static_cast<int>(history_.step.back())) + "): " + ex::fmt("%.4f", history_.loss.back()) + ".");
    metrics_["placement_ok"] = all_here;
    metrics_["final_train_loss"] = history_.loss.back();
  }

  // 10. Each number the codelab prints, beside this run's.
  void beside_the_codelab();

  // What is written at the end: the configuration, the parameters and, with --save, a checkpoint.
  void outputs() {
    metrics_["config"] = {{"steps", c_.steps}, {"batch", c_.batch}, {"hidden", c_.hidden}, {"lr", c_.lr}, {"weight_decay", c_.weight_decay},
                          {"sgd_lr", c_.sgd_lr}, {"log_every", c_.log_every}, {"seed", c_.seed}, {"order", c_.order}, {"dtype", c_.dtype},
                          {"timing_steps", c_.timing_steps}};
    if (!c_.save.empty()) {
      std::map<std::string, std::string> meta = run_identity();
      meta["step"] = std::to_string(c_.steps);
      meta["tapegrad"] = tg::version;
      out_.save_checkpoint = [ts = TrainState<Params, State>{params_, state_}, meta](const std::string& path) {
        tg::io::save_safetensors(path, ts, meta);
      };
    }
    out_.save_params = [p = params_, steps = c_.steps](const std::string& path) {
      tg::io::save_safetensors(path, p, {{"tapegrad", tg::version}, {"steps", std::to_string(steps)}});
    };
  }

  /// What must match for a checkpoint to continue this run bitwise: the data order and the model.
  std::map<std::string, std::string> run_identity() const {
    return {{"seed", std::to_string(c_.seed)}, {"batch", std::to_string(c_.batch)},
            {"hidden", std::to_string(c_.hidden[0]) + "," + std::to_string(c_.hidden[1])}, {"lr", ex::fmt("%.17g", c_.lr)},
            {"weight_decay", ex::fmt("%.17g", c_.weight_decay)}, {"dtype", c_.dtype}, {"order", c_.order}};
  }

  /// Loads --resume's checkpoint into the parameters and state, after checking it continues this run;
  /// returns the first step still to do.
  int resume() {
    TrainState<Params, State> loaded{params_, state_};
    std::map<std::string, std::string> meta;
    try {
      meta = tg::io::load_safetensors(c_.resume, loaded);
    } catch (const tg::Error& e) {
      throw ex::DataError(std::string("--resume: ") + e.what());
    }
    for (const auto& [key, value] : run_identity())
      if (!meta.count(key) || meta.at(key) != value)
        throw ex::DataError("--resume " + c_.resume + ": saved with " + key + " = " + (meta.count(key) ? meta.at(key) : "(none)") +
                            ", this run has " + value + "; resume with the same options");
    const int saved = meta.count("step") ? std::atoi(meta.at("step").c_str()) : -1;
    if (saved < 0 || saved >= c_.steps)
      throw ex::DataError("--resume " + c_.resume + ": saved at step " + std::to_string(saved) + ", but --steps is " + std::to_string(c_.steps) +
                          "; ask for more steps than were done");
    params_ = std::move(loaded.params), state_ = std::move(loaded.opt_state);
    log_.say("Resumed from " + c_.resume + " after step " + std::to_string(saved) + ".");
    return saved + 1;
  }

  /// codelab::train_step in compute dtype C, with this run's optimizer and options.
  template <class C>
  struct TrainStep {
    Optimizer optimizer;
    codelab::StepOptions options;
    auto operator()(const Params& p, const State& s, const Tensor& x, const Labels& y) const {
      return codelab::train_step<C>(optimizer, p, s, x, y, options);
    }
  };

  /// The compiled train_step in compute dtype C: each dtype's step is compiled once and reused.
  template <class C>
  tg::Compiled<TrainStep<C>> compiled_step() const {
    return tg::compile(TrainStep<C>{optimizer_, {c_.check_numerics, c_.ranks > 1}});
  }

  /// The compiled step of --dtype.
  std::tuple<Params, State, codelab::Metrics<D>> step(Params&& p, State&& s, const Tensor& x, const Labels& y) {
    return c_.dtype == "bf16" ? step_bf16_(std::move(p), std::move(s), x, y) : step_f32_(std::move(p), std::move(s), x, y);
  }

  const tg::data::Batch<D>& batch(int i) const { return train_[static_cast<std::size_t>(i) % train_.size()]; }

  const Config& c_;
  ex::Loaded& data_;
  Outputs& out_;
  ex::Log log_;
  json& metrics_;
  const std::string device_;
  const codelab::Sizes sizes_;
  const Optimizer optimizer_;
  tg::Compiled<TrainStep<float>> step_f32_;
  tg::Compiled<TrainStep<tg::bf16>> step_bf16_;
  std::vector<tg::data::Batch<D>> train_, test_;
  Tensor test_x_;                         // the test batches stacked: (batches, batch, 784), as the codelab's x_test_batches
  tg::Tensor<std::int32_t, D> test_y_;    // (batches, batch)
  Params params_;
  State state_;
  ex::History history_;
};

/// The side-by-side table: the codelab's numbers (codelab_golden.json) and this run's, with their
/// differences. Equal to f32 rounding before any training; after training they differ in the last digits
/// (f32 summation order in the GEMMs and reductions, oneDNN's vs XLA's kernels, GELU's and exp's
/// implementations), which AdamW's 401 steps carry into the third or fourth digit of the test metrics.
template <class D>
void Codelab<D>::beside_the_codelab() {
  log_.heading("10. Beside the codelab", "Each number the codelab prints, computed by its own JAX + Optax code on the same data "
                                         "(scripts/codelab_golden.py, JAX's CPU backend), beside this run's.");
  std::ifstream in(c_.codelab_golden);
  if (!in) {
    log_.say("The codelab's numbers are not here (" + c_.codelab_golden + "; --codelab-golden): no comparison.");
    return;
  }
  const json golden = json::parse(in);
  const bool codelab_run = c_.steps == 400 && c_.batch == 512 && c_.hidden == std::vector<std::int64_t>{256, 128} && c_.lr == 3e-3 &&
                           c_.weight_decay == 1e-4 && c_.sgd_lr == 3e-3 && c_.seed == 0 && c_.order == "numpy" && c_.dtype == "f32" &&
                           c_.ranks == 1 && c_.resume.empty();
  ex::Table t{"the codelab (JAX " + golden.value("jax", std::string("?")) + ", Optax " + golden.value("optax", std::string("?")) + ") and this run",
              {"number", "codelab", "tapegrad", "difference", "relative"}, {}};
  json rows = json::array();
  auto row = [&](const std::string& what, double theirs, const json& ours_json) {
    if (!ours_json.is_number()) return;
    const double ours = ours_json.get<double>(), diff = ours - theirs, rel = std::fabs(diff) / std::max(std::fabs(theirs), 1e-30);
    t.rows.push_back({what, ex::fmt("%.8f", theirs), ex::fmt("%.8f", ours), ex::fmt("%+.2e", diff), ex::fmt("%.2e", rel)});
    rows.push_back({{"number", what}, {"codelab", theirs}, {"tapegrad", ours}, {"relative", rel}});
  };
  auto at = [&](const char* a, const char* b = nullptr) -> json {
    if (!metrics_.contains(a)) return json();
    return b ? (metrics_[a].contains(b) ? metrics_[a][b] : json()) : metrics_[a];
  };
  row("first-batch loss (key(1))", golden["first_batch_loss"], at("initial_loss"));
  row("loss after one SGD step (lr 3e-3)", golden["loss_after_one_sgd_step"], at("loss_after_one_sgd_step"));
  row("one compiled AdamW step (key(2)): loss", golden["one_step"]["loss"], at("one_step", "loss"));
  row("  batch accuracy", golden["one_step"]["accuracy"], at("one_step", "accuracy"));
  row("  gradient norm", golden["one_step"]["grad_norm"], at("one_step", "grad_norm"));
  const json& last = golden["history"].back();
  if (metrics_.contains("history") && !metrics_["history"].empty())
    row("training loss at step 400 (key(3))", last["loss"], metrics_["history"].back()["loss"]);
  row("test loss after 400 steps", golden["test_loss"], at("test", "loss"));
  row("test accuracy after 400 steps", golden["test_accuracy"], at("test", "accuracy"));
  log_.show(t);
  const bool same_samples = metrics_.contains("test") && metrics_["test"].contains("samples") &&
                            metrics_["test"]["samples"]["images"] == golden["sample_test_images"];
  log_.say(std::string(same_samples ? "The 25 sample test images are the codelab's." : "The 25 sample test images differ from the codelab's.") +
           (codelab_run ? " Before any training the numbers agree to f32 rounding; after 401 AdamW steps they differ in the last digits: "
                          "the same arithmetic in another order (f32 sums in oneDNN's GEMMs and tapegrad's reductions vs XLA's), "
                          "and GELU's and exp's float implementations, compounded over the steps."
                        : " This run's options differ from the codelab's (400 steps, batch 512, 256-128, adamw 3e-3 / 1e-4, SGD 3e-3, "
                          "--order numpy --seed 0, f32, one process): only the numbers before training are comparable."));
  metrics_["codelab"] = {{"comparable", codelab_run}, {"same_sample_images", same_samples}, {"rows", rows}};
}

/// Writes what the run produced under --out, each file whole or not at all (rank 0 alone).
void write_outputs(const Config& c, Outputs& out, clock_type::time_point t0) {
  const std::filesystem::path dir(c.out);
  std::filesystem::create_directories(dir);  // checked writable before training
  ex::write_whole(dir / "class_examples.png", ex::as_string(out.class_png));
  ex::write_whole(dir / "test_predictions.png", ex::as_string(out.predictions_png));
  ex::write_whole(dir / "metrics.json", out.metrics.dump(2) + "\n");
  out.save_params((dir / "params.safetensors").string());
  if (out.save_checkpoint) out.save_checkpoint(c.save);
  ex::write_whole(dir / "report.html", out.report.document("tapegrad: Fashion-MNIST, the codelab end to end"));
  if (!c.quiet)
    std::cout << "wrote " << (dir / "report.html").string() << ", metrics.json, class_examples.png, test_predictions.png, params.safetensors ("
              << ex::fmt("%.1f", seconds_since(t0)) << " s)\n";
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  c.out = "fashion_mnist_out";
  CLI::App app{"fashion_mnist: the JAX codelab's Fashion-MNIST MLP, trained step by step with tapegrad; "
               "writes report.html, metrics.json, PNG images and the final parameters under --out"};
  app.add_option("--steps", c.steps, "AdamW training steps")->check(CLI::Range(1, 10000000))->capture_default_str();
  app.add_option("--batch-size", c.batch, "examples per batch")->check(CLI::Range(1, 10000))->capture_default_str();
  app.add_option("--hidden", c.hidden, "the two hidden layer sizes")->expected(2)->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--lr", c.lr, "AdamW learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--sgd-lr", c.sgd_lr, "learning rate of the hand-written SGD step (steps 4 and 5; the codelab's LEARNING_RATE)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--log-every", c.log_every, "log the metrics every N steps")->check(CLI::Range(1, 10000000))->capture_default_str();
  app.add_option("--seed", c.seed, "seed of the training-set shuffle (the codelab's keys and sample images are fixed)")->capture_default_str();
  app.add_option("--order", c.order, "the training set's shuffle: numpy (np.random.default_rng(seed).permutation, the codelab's) or jax "
                                     "(jax.random.permutation(key(seed)), tapegrad 0.1's order)")
      ->check(CLI::IsMember({"numpy", "jax"}))
      ->capture_default_str();
  app.add_option("--codelab-golden", c.codelab_golden, "the codelab's numbers for the side-by-side table (scripts/codelab_golden.py)")
      ->capture_default_str();
  ex::add_common_options(app, c, "compute dtype of the AdamW training (parameters stay f32)");
  app.add_option("--timing-steps", c.timing_steps, "timed steps of the compiled SGD step (step 5, eager: a fifth) and of each compute dtype (step 8)")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  app.add_option("--tokens-per-example", c.tokens_per_example, "tokens per example for the tokens/sec projection")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--save", c.save, "write a checkpoint (parameters, optimizer state, step) here at the end of training");
  app.add_option("--resume", c.resume, "continue the AdamW training from a checkpoint written by --save (same options)");
  app.add_flag("--no-verify", c.no_verify, "skip the SHA-256 check of the data (for a modified copy of the data set)");
  app.add_flag("--data-parallel", c.data_parallel, "under mpirun: every rank trains on its shard of each global batch, gradients averaged (MPI / NCCL)");
  app.add_flag("--check-numerics", c.check_numerics, "stop with an error naming the leaf when the loss or a gradient becomes NaN or Inf (reads flags every step)");
  CLI11_PARSE(app, argc, argv);

  std::function<void(const std::string&, int)> stop_others;
#if defined(TG_WITH_DIST)
  if (c.data_parallel) {
    auto& comm = tg::dist::Communicator::world();
    c.rank = comm.rank(), c.ranks = comm.size();
    if (c.rank != 0) c.quiet = true;  // rank 0 logs and writes the outputs
    if (c.ranks > 1) stop_others = [&comm](const std::string& message, int code) { comm.abort(message, code); };
  }
#else
  if (c.data_parallel) {
    std::cerr << "fashion_mnist: --data-parallel: this build has no MPI (install libopenmpi-dev and rebuild)\n";
    return 2;
  }
#endif
  return ex::run_main("fashion_mnist", [&] {
    ex::check_device_option(c.device);
    if (!c.quiet) std::cout << "fashion_mnist: tapegrad " << tg::version << "\n== finding the data\n";
    ex::Loaded data = ex::find_and_load(c.data_dir, !c.no_download, !c.no_verify, c.quiet);
    if (c.rank == 0) ex::check_output_dir(c.out);  // before training, not after it
    Outputs out;
    const auto t0 = clock_type::now();
    tg::with_device(c.device, [&]<class D>() { Codelab<D>(c, data, out).run(); });
    out.metrics["seconds"] = seconds_since(t0);
    if (c.rank == 0) write_outputs(c, out, t0);
    return 0;
  }, stop_others);
}
