// cnn_fashion_mnist: a small convolutional network (cnn.hpp: two 3x3 convolutions with 2x2 max pooling,
// a dense layer, a linear head) trained on the real Fashion-MNIST with tapegrad: tg::conv and tg::max_pool
// (oneDNN's convolutions on the CPU, cuDNN's on CUDA), AdamW with a cosine decay, the step compiled with
// tg::compile. It measures images/sec (forward and backward, warm-up excluded, the device synchronised
// before each clock stops), evaluates on the whole test set after every epoch, and writes a report with the
// training curve, sample predictions, the confusion matrix and the first layer's filters and feature maps,
// with the examples' shared report, command line, outputs and data checks (examples/common). Its
// first-batch loss and gradient norm are checked against the same model in JAX + Flax
// (scripts/cnn_reference.py, cnn_golden.json).
#include <tapegrad/tapegrad.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <openssl/evp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "../common/cli.hpp"
#include "../common/dataset.hpp"
#include "../common/evaluation.hpp"
#include "../common/outputs.hpp"
#include "../common/report.hpp"
#include "cnn.hpp"

namespace fm = fashion_mnist;
using json = nlohmann::ordered_json;

namespace {

struct Options : fm::CommonOptions {
  cnn::Config model;
  cnn::OptimConfig optim;
  int epochs = 8;
  std::int64_t batch = 128;
  int max_steps = 0;  ///< stop after this many steps (0: all epochs), for smoke tests
  int log_every = 50;
  std::uint32_t seed = 0;
  std::string golden = CNN_GOLDEN, export_init;
  bool check_golden = false, augment = true;
};

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

/// The CNN on device D, section by section; the members are what the sections hand on to each other.
template <class D>
class CnnRun {
 public:
  using Params = cnn::Cnn<D>;

  CnnRun(const Options& o, const fm::Loaded& data, json& metrics, fm::Report& report)
      : o_(o), data_(data), metrics_(metrics), log_(report, o.quiet), device_(tg::device_name<D>()), order_rng_(o.seed),
        params_(cnn::init_params<D>(tg::random::key(o.seed), o.model)) {}

  int run() {
    train_ = epoch_batches(false);
    if (!o_.export_init.empty()) return export_init();
    model();
    const int golden = beside_jax();
    if (o_.check_golden) return golden;
    fm::with_compute_dtype(o_.dtype, [&]<class C>() { training<C>(); });
    evaluation();
    return 0;
  }

 private:
  /// The training set in NumPy's order (np.random.default_rng(seed), one permutation per epoch) and, from
  /// the second epoch on, with half of the images mirrored left to right (those whose rank in a second
  /// permutation is below N / 2), a standard augmentation for Fashion-MNIST. The first epoch sees the images
  /// as they are, so its first batch is the one the JAX reference computes.
  std::vector<tg::data::Batch<D>> epoch_batches(bool augment) {
    const std::int64_t n = data_.train.labels.size();
    const auto order = order_rng_.permutation(n);
    if (!augment) return tg::data::fixed_batches<D>(data_.train.images, data_.train.labels, o_.batch, 10, std::span<const std::int64_t>(order));
    const auto rank = order_rng_.permutation(n);
    auto px = data_.train.images.to_vector();
    for (std::int64_t i = 0; i < n; ++i)
      if (rank[static_cast<std::size_t>(i)] < n / 2)
        for (std::ptrdiff_t r = 0; r < 28; ++r) std::reverse(px.begin() + i * 784 + r * 28, px.begin() + i * 784 + r * 28 + 28);
    return tg::data::fixed_batches<D>(tg::from_vector(px, data_.train.images.shape()), data_.train.labels, o_.batch, 10,
                                      std::span<const std::int64_t>(order));
  }

  int export_init() {
    tg::io::save_safetensors(o_.export_init, params_, {{"model", o_.model.str()}, {"seed", std::to_string(o_.seed)}});
    std::cout << "wrote the initial parameters to " << o_.export_init << " (" << tg::tree_count(params_)
              << " floats, SHA-256 of the f32 bytes " << fm::params_digest(params_) << ")\n";
    return 0;
  }

  // 1. The model.
  void model() {
    log_.heading("1. The model", "A convolutional network (" + o_.model.str() + "), on " + device_ + ", compute " + o_.dtype + ".");
    fm::Table t{"model", {"item", "value"}, {}};
    const auto& m = o_.model;
    const auto k = std::to_string(m.kernel) + "x" + std::to_string(m.kernel);
    t.rows.push_back({"block 1", "conv " + k + " \"SAME\", 1 -> " + std::to_string(m.conv1) + " features, ReLU; max_pool 2x2, stride 2"});
    t.rows.push_back({"block 2", "conv " + k + " \"SAME\", " + std::to_string(m.conv1) + " -> " + std::to_string(m.conv2) +
                                     " features, ReLU; max_pool 2x2, stride 2"});
    t.rows.push_back({"head", "flatten (" + std::to_string(m.flat()) + "), dense " + std::to_string(m.dense) + " ReLU, dense " +
                                  std::to_string(m.classes)});
    t.rows.push_back({"layouts", "images NHWC, kernels HWIO (Flax's)"});
    t.rows.push_back({"parameters", fm::grouped(static_cast<double>(tg::tree_count(params_)))});
    log_.show(t);
  }

  // 2. The first batch at the initial parameters beside the JAX + Flax reference's numbers (cnn_golden.json):
  // loss (1e-6 relative), gradient global norm (1e-5 relative) and identical parameters. Returns the exit
  // code of --check-golden: 0 when they match, 1 when not.
  int beside_jax() {
    log_.heading("2. Beside JAX", "The first batch at the initial parameters, through tapegrad and through the same model in JAX + Flax "
                                  "(scripts/cnn_reference.py, from these parameters exported with --export-init).");
    std::ifstream f(o_.golden);
    std::string why;
    json g;
    if (!f) {
      why = "cannot read the golden values " + o_.golden + " (--golden: the cnn_golden.json of this source tree)";
    } else {
      g = json::parse(f);
      const auto& gc = g.at("config");
      if (gc.at("conv1") != o_.model.conv1 || gc.at("conv2") != o_.model.conv2 || gc.at("kernel") != o_.model.kernel ||
          gc.at("dense") != o_.model.dense || gc.at("batch") != o_.batch || gc.at("seed") != o_.seed)
        why = "the golden values (" + o_.golden + ") were made for " + gc.dump() + ", not this run's sizes, batch and seed; "
              "regenerate them for these with scripts/cnn_reference.py golden";
    }
    if (!why.empty()) {
      log_.say("Skipped: " + why + ".");
      if (o_.check_golden) throw fm::DataError("--check-golden: " + why);
      return 1;
    }
    auto loss_fn = [this](const Params& p, const cnn::Tensor<D>& x, const cnn::Labels<D>& y) {
      return cnn::loss_with_metrics<float>(p, x, y, o_.model);
    };
    const auto [la, grads] = tg::value_and_grad(loss_fn, tg::has_aux)(params_, train_[0].x, train_[0].y);
    const double loss = la.first.item(), norm = tg::global_norm(grads).item();
    const double want_loss = g.at("loss"), want_norm = g.at("grad_global_norm");
    const double loss_err = std::fabs(loss - want_loss) / std::fabs(want_loss), norm_err = std::fabs(norm - want_norm) / std::fabs(want_norm);
    const std::string digest = fm::params_digest(params_), want_digest = g.at("params_digest");
    fm::Table t{"first batch (f32): tapegrad vs JAX", {"quantity", "tapegrad", "JAX", "relative difference"}, {}};
    t.rows.push_back({"initial parameters (SHA-256 of the f32 bytes)", digest.substr(0, 16) + "...", want_digest.substr(0, 16) + "...",
                      digest == want_digest ? "identical" : "DIFFERENT"});
    t.rows.push_back({"first-batch loss", fm::fmt("%.9f", loss), fm::fmt("%.9f", want_loss), fm::fmt("%.2e", loss_err)});
    t.rows.push_back({"gradient global norm", fm::fmt("%.9f", norm), fm::fmt("%.9f", want_norm), fm::fmt("%.2e", norm_err)});
    const bool ok = digest == want_digest && loss_err <= 1e-6 && norm_err <= 1e-5;
    log_.show(t);
    log_.say(ok ? "Matches: loss within 1e-6 and gradient norm within 1e-5 relative, from identical parameters."
                : "DOES NOT MATCH the JAX reference (loss 1e-6, gradient norm 1e-5 relative, identical parameters required).");
    metrics_["beside_jax"] = {{"loss", loss}, {"jax_loss", want_loss}, {"loss_rel_err", loss_err}, {"grad_norm", norm},
                              {"jax_grad_norm", want_norm}, {"grad_norm_rel_err", norm_err}, {"params_identical", digest == want_digest},
                              {"jax", g.value("jax", "?")}, {"ok", ok}};
    return ok ? 0 : 1;
  }

  // 3. The training, computing in C: the compiled step over the epochs, the test accuracy after each.
  template <class C>
  void training() {
    const std::int64_t steps_per_epoch = static_cast<std::int64_t>(train_.size());
    std::int64_t total = steps_per_epoch * o_.epochs;
    if (o_.max_steps > 0) total = std::min<std::int64_t>(total, o_.max_steps);
    cnn::OptimConfig oc = o_.optim;
    oc.total_steps = total;
    optim_ = oc;
    const auto optimizer = cnn::make_optimizer(oc);
    using State = decltype(optimizer.init(std::declval<Params>()));
    State state = optimizer.init(params_);
    auto step = tg::compile([&](const Params& p, const State& s, const cnn::Tensor<D>& x, const cnn::Labels<D>& y) {
      return cnn::train_step<C>(optimizer, o_.model, p, s, x, y);
    });
    log_.heading("3. Training", std::to_string(o_.epochs) + " epochs of " + std::to_string(steps_per_epoch) + " steps (batch " +
                                    std::to_string(o_.batch) + "), compiled step (tg::compile), compute " + o_.dtype +
                                    ". adamw(cosine_decay_schedule(" + fm::fmt("%g", oc.peak_lr) + ", " + std::to_string(oc.total_steps) +
                                    ", 0.01), weight_decay=" + fm::fmt("%g", oc.weight_decay) + "). Test accuracy over all 10,000 test images after each epoch.");
    fm::History history;
    std::vector<double> e_epoch, e_test, e_seconds;
    double train_seconds = 0;
    std::int64_t timed_steps = 0;
    const auto wall0 = clock_type::now();
    fm::Progress progress("training", static_cast<int>(total), o_.quiet);
    std::string status;
    for (int epoch = 1; epoch <= o_.epochs && steps_ < total; ++epoch) {
      if (epoch > 1) train_ = epoch_batches(o_.augment);  // outside the timed region: the next epoch's batches, moved to the device
      clock_type::time_point t0 = clock_type::now();
      std::int64_t timed_here = 0;
      cnn::Metrics<D> last;
      for (const auto& b : train_) {
        if (steps_ == total) break;
        ++steps_;
        auto [p, s, m] = step(std::move(params_), std::move(state), b.x, b.y);
        params_ = std::move(p), state = std::move(s), last = m;
        if (steps_ == 1) {  // the first step records the compiled step: the warm-up, not timed
          (void)m.loss.item();
          t0 = clock_type::now();
        } else {
          ++timed_here;
        }
        const bool log = steps_ % o_.log_every == 0 || steps_ == 1 || steps_ == total;
        if (log) {
          history.step.push_back(static_cast<double>(steps_)), history.loss.push_back(m.loss.item()), history.accuracy.push_back(m.accuracy.item());
          if (!std::isfinite(history.loss.back()))
            throw fm::Diverged("the training loss is " + fm::fmt("%g", history.loss.back()) + " at step " + std::to_string(steps_) +
                               ": the training diverged; lower --lr (now " + fm::fmt("%g", oc.peak_lr) + ")");
          status = "loss " + fm::fmt("%.4f", history.loss.back()) + "  acc " + fm::fmt("%.3f", history.accuracy.back());
        }
        progress.update(static_cast<int>(steps_), status, log);
      }
      (void)last.loss.item();  // synchronise before the clock stops
      const double seconds = seconds_since(t0);
      train_seconds += seconds, timed_steps += timed_here;
      e_epoch.push_back(epoch), e_seconds.push_back(seconds_since(wall0)), e_test.push_back(test_accuracy().accuracy);
      if (!o_.quiet) std::printf("  epoch %d: test accuracy %.4f (%.1f s since the start)\n", epoch, e_test.back(), e_seconds.back());
    }
    const double wall = seconds_since(wall0);
    eps_ = timed_steps > 0 ? static_cast<double>(timed_steps * o_.batch) / train_seconds : 0.0;
    metrics_["history"] = fm::report_history(log_, "training curve", history);
    fm::Table acc{"accuracy curve (test set, after each epoch)", {"epoch", "test accuracy", "seconds since the start of training"}, {}};
    json curve = json::array();
    for (std::size_t i = 0; i < e_epoch.size(); ++i) {
      acc.rows.push_back({fm::fmt("%.0f", e_epoch[i]), fm::fmt("%.4f", e_test[i]), fm::fmt("%.1f", e_seconds[i])});
      curve.push_back({{"epoch", e_epoch[i]}, {"test_accuracy", e_test[i]}, {"seconds", e_seconds[i]}});
    }
    log_.show(acc);
    fm::Table tp{"throughput (measured)", {"measure", "value"}, {}};
    tp.rows.push_back({"images/sec (" + std::to_string(timed_steps) + " steps after 1 warm-up step)", fm::grouped(eps_)});
    tp.rows.push_back({"training time (steps only)", fm::fmt("%.1f s", train_seconds)});
    tp.rows.push_back({"wall time of the training section (with data order and evaluations)", fm::fmt("%.1f s", wall)});
    log_.show(tp);
    log_.say("Timing: the clock runs over the training steps only; it starts after the first (recording) step and after each epoch's "
             "batches are on the device, and stops after the device is synchronised (a metric read back).");
    metrics_["accuracy_curve"] = curve;
    metrics_["throughput"] = {{"images_per_sec", eps_}, {"timed_steps", timed_steps}, {"train_seconds", train_seconds}, {"wall_seconds", wall}};
  }

  struct TestResult {
    double loss = 0, accuracy = 0;
    std::vector<std::int32_t> predicted;
  };

  /// The whole test set through the compiled evaluation (10 batches of 1,000, in file order).
  TestResult test_accuracy() {
    TestResult r;
    std::int64_t correct = 0;
    for (const auto& b : test_) {
      const auto [l, pred] = evaluate_(params_, b.x, b.y);
      const auto pv = pred.to_vector(), yv = b.y.to_vector();
      r.loss += l.item();
      for (std::size_t i = 0; i < pv.size(); ++i) correct += pv[i] == yv[i];
      r.predicted.insert(r.predicted.end(), pv.begin(), pv.end());
    }
    const auto n = static_cast<double>(r.predicted.size());
    r.loss /= n, r.accuracy = static_cast<double>(correct) / n;
    return r;
  }

  // 4. Evaluation on all 10,000 test images, and 5. the first layer's filters and feature maps for one of them.
  void evaluation() {
    log_.heading("4. Evaluation", "All 10,000 test images.");
    const TestResult r = test_accuracy();
    fm::Table t{"test set", {"images", "loss", "accuracy"}, {}};
    t.rows.push_back({fm::grouped(static_cast<double>(r.predicted.size())), fm::fmt("%.4f", r.loss), fm::fmt("%.4f", r.accuracy)});
    log_.show(t);
    metrics_["test"] = {{"images", r.predicted.size()}, {"loss", r.loss}, {"accuracy", r.accuracy}};
    const auto labels = data_.test.labels.to_vector();
    const auto px = data_.test.images.to_vector();
    // 25 sample test images, as the MLP example: np.random.default_rng(7).choice(10000, 25, replace=False).
    const auto pick = tg::random::numpy::default_rng(7).choice(static_cast<std::int64_t>(labels.size()), 25);
    std::vector<std::int32_t> sample_predicted;
    for (const auto i : pick) sample_predicted.push_back(r.predicted[static_cast<std::size_t>(i)]);
    (void)fm::report_samples(log_, px, labels, pick, sample_predicted);
    metrics_["test"]["confusion_counts"] = fm::report_confusion(log_, std::vector<std::int32_t>(labels.begin(), labels.end()), r.predicted);
    features(px, labels, pick[0]);
    metrics_["config"] = {{"model", o_.model.str()}, {"epochs", o_.epochs}, {"batch", o_.batch}, {"dtype", o_.dtype}, {"device", device_},
                          {"peak_lr", optim_.peak_lr}, {"weight_decay", optim_.weight_decay}, {"total_steps", optim_.total_steps}};
    log_.say("Final test accuracy " + fm::fmt("%.4f", r.accuracy) + " after " + std::to_string(steps_) + " steps; " + fm::grouped(eps_) +
             " images/sec measured.");
  }

  void features(const std::vector<std::uint8_t>& px, const std::vector<std::uint8_t>& labels, std::int64_t image) {
    log_.heading("5. What the first layer sees", "The first convolution's " + std::to_string(o_.model.conv1) + " trained 3x3 filters (their "
                                                 "positive weights, dark: large) and their pooled ReLU feature maps (14x14) for test image " +
                                                 std::to_string(image) + ".");
    const std::uint8_t* pixels = px.data() + image * 784;
    const auto x = tg::from_vector<D>(std::vector<float>(pixels, pixels + 784), {1, 784}) * (1.0f / 255.0f);
    tg::Tensor<float, D> maps;
    (void)cnn::forward<float>(params_, x, o_.model, &maps);
    const auto m = maps.to_vector();  // (1, 14, 14, conv1)
    const auto w = params_.conv1.w.to_vector();  // (3, 3, 1, conv1)
    const int F = static_cast<int>(o_.model.conv1), K = static_cast<int>(o_.model.kernel), S = static_cast<int>(o_.model.image / 2);
    std::string html = fm::img_tag(fm::image_grid({{pixels, 255, 255, 255}}, 1, 2),
                               "image " + std::to_string(image) + ": " + fm::class_names[labels[static_cast<std::size_t>(image)]]);
    json filters = json::array();
    for (int f = 0; f < F; ++f) {
      std::vector<float> k(static_cast<std::size_t>(K * K)), fmap(static_cast<std::size_t>(S * S));
      for (int i = 0; i < K * K; ++i) k[static_cast<std::size_t>(i)] = std::max(0.0f, w[static_cast<std::size_t>(i * F + f)]);
      for (int i = 0; i < S * S; ++i) fmap[static_cast<std::size_t>(i)] = m[static_cast<std::size_t>(i * F + f)];
      html += fm::img_tag(fm::heatmap(k, K, K, 12), "filter " + std::to_string(f));
      html += fm::img_tag(fm::heatmap(fmap, S, S, 4), "map " + std::to_string(f));
      filters.push_back(k);
    }
    log_.html("<div>" + html + "</div>");
    metrics_["features"] = {{"test_index", image}, {"filters_positive_part", filters}};
  }

  const Options& o_;
  const fm::Loaded& data_;
  json& metrics_;
  fm::Log log_;
  const std::string device_;
  tg::random::numpy::Generator order_rng_;
  Params params_;
  std::vector<tg::data::Batch<D>> train_;
  const std::vector<tg::data::Batch<D>> test_ = tg::data::fixed_batches<D>(data_.test.images, data_.test.labels, 1000, 10);  // in file order
  struct Evaluate {
    const cnn::Config* model;
    auto operator()(const Params& p, const cnn::Tensor<D>& x, const cnn::Labels<D>& y) const { return cnn::evaluate(p, x, y, *model); }
  };
  tg::Compiled<Evaluate> evaluate_ = tg::compile(Evaluate{&o_.model});
  cnn::OptimConfig optim_;
  std::int64_t steps_ = 0;
  double eps_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.out = "cnn_out";
  CLI::App app{"cnn_fashion_mnist: a small convolutional network trained on Fashion-MNIST with tapegrad; writes report.html and "
               "metrics.json under --out"};
  app.add_option("--epochs", o.epochs, "training epochs")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--batch-size", o.batch, "examples per batch")->check(CLI::Range(1, 60000))->capture_default_str();
  app.add_option("--max-steps", o.max_steps, "stop after this many steps (0: all the epochs)")->check(CLI::Range(0, 100000000))->capture_default_str();
  app.add_option("--conv1", o.model.conv1, "features of the first convolution")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--conv2", o.model.conv2, "features of the second convolution")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--dense", o.model.dense, "width of the dense layer")->check(CLI::Range(1, 16384))->capture_default_str();
  app.add_option("--lr", o.optim.peak_lr, "peak learning rate of the cosine decay")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--weight-decay", o.optim.weight_decay, "AdamW weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--log-every", o.log_every, "log the metrics every N steps")->check(CLI::Range(1, 100000000))->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the initial parameters (key(seed)) and of the data order (np.random.default_rng(seed))")->capture_default_str();
  fm::add_common_options(app, o, "compute dtype (parameters stay f32)");
  app.add_option("--golden", o.golden, "the JAX + Flax reference's first-batch values (scripts/cnn_reference.py golden)")->capture_default_str();
  app.add_option("--export-init", o.export_init, "write the initial parameters to this safetensors file and exit (the JAX reference's input)");
  app.add_flag("--check-golden", o.check_golden, "only compare the first batch with the JAX golden values; exit 0 when they match, 1 when not");
  app.add_flag("!--no-augment", o.augment, "train without mirroring half of the images from the second epoch on");
  CLI11_PARSE(app, argc, argv);
  return fm::run_main("cnn_fashion_mnist", [&] {
    fm::check_device_option(o.device);
    const fm::Loaded data = fm::find_and_load(o.data_dir, !o.no_download, true, o.quiet);
    const bool report = !o.check_golden && o.export_init.empty();
    if (report) fm::check_output_dir(o.out);  // before training, not after it
    json metrics;
    fm::Report html;
    const auto t0 = clock_type::now();
    const int rc = tg::with_device(o.device, [&]<class D>() { return CnnRun<D>(o, data, metrics, html).run(); });
    if (!report) return rc;
    metrics["seconds"] = seconds_since(t0);
    fm::write_metrics_and_report(o.out, metrics.dump(2) + "\n", html.document("tapegrad: a convolutional network on Fashion-MNIST"), o.quiet, seconds_since(t0));
    return rc;
  });
}
