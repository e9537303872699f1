// The image classifiers' run, shared by the examples that train a model on Fashion-MNIST with tg::optim
// under tg::compile (cnn_fashion_mnist, vit_fashion_mnist): the command line, the epochs over the training
// set in NumPy's order (mirroring half of the images from the second epoch on), the compiled training step,
// the test accuracy after each epoch, honest throughput, the evaluation, the first batch beside JAX's golden
// values, and the report's sections. What differs per model is its Model type's hooks (below); an example
// is then its model file, that type, a short main and one line of CMake (examples/CMakeLists.txt).
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "dataset.hpp"
#include "evaluation.hpp"
#include "outputs.hpp"
#include "report.hpp"

namespace examples {

/// What a model gives the run (all static; `M` below is the model type, `Params<D>` its parameters):
///   Config, OptimConfig                   its sizes and its optimizer's settings
///   template <class D> using Params       its parameter pytree on device D
///   program, title, reference, reference_script, default_epochs, default_out
///   add_options(app, Config&, OptimConfig&)          its own command-line options
///   check(Config) -> std::string                      why the sizes cannot work ("" when they can)
///   init<D>(key, Config), describe(Config), model_rows(Table&, Config)
///   golden_fits(json config, Config)                  the golden file's sizes are these
///   loss_with_metrics<C>(params, x, y, Config)        -> (loss, accuracy)
///   schedule(OptimConfig&, total_steps), make_optimizer(OptimConfig), optimizer_text(OptimConfig),
///   optim_metrics(OptimConfig) -> json
///   uses_key; train_step<C>(optimizer, Config, params, state, x, y[, key]) -> (params, state, metrics)
///   step_key(Config) -> bool                          a fresh dropout key each step (uses_key only)
///   evaluate(params, x, y, Config)                    -> (summed loss, predicted classes)
///   throughput(Table&, json&, images_per_sec, Config), summary(images_per_sec, Config)
///   inspect(Log&, json&, params, Config, pixels, labels, image)   the report's fifth section
template <class M>
struct ClassifierOptions : CommonOptions {
  typename M::Config model;
  typename M::OptimConfig optim;
  int epochs = M::default_epochs;
  std::int64_t batch = 128;
  int max_steps = 0;  ///< stop after this many steps (0: all epochs), for smoke tests
  int log_every = 50;
  std::uint32_t seed = 0;
  std::string golden = EXAMPLE_GOLDEN, export_init;
  bool check_golden = false, augment = true;
};

using json = nlohmann::ordered_json;
using clock_type = std::chrono::steady_clock;
inline double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

/// One model on device D, section by section; the members are what the sections hand on to each other.
template <class M, class D>
class ClassifierRun {
 public:
  using Params = typename M::template Params<D>;
  using Images = tg::Tensor<float, D>;
  using Labels = tg::Tensor<std::int32_t, D>;
  using Key = tg::Tensor<std::uint32_t, D>;

  ClassifierRun(const ClassifierOptions<M>& o, const Loaded& data, json& metrics, Report& report)
      : o_(o), data_(data), metrics_(metrics), log_(report, o.quiet), device_(tg::device_name<D>()), order_rng_(o.seed),
        params_(M::template init<D>(tg::random::key(o.seed), o.model)) {}

  int run() {
    train_ = epoch_batches(false);
    if (!o_.export_init.empty()) return export_init();
    model();
    const int golden = beside_jax();
    if (o_.check_golden) return golden;
    with_compute_dtype(o_.dtype, [&]<class C>() { training<C>(); });
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
              << " floats, SHA-256 of the f32 bytes " << params_digest(params_) << ")\n";
    return 0;
  }

  // 1. The model.
  void model() {
    log_.heading("1. The model", M::describe(o_.model) + ", on " + device_ + ", compute " + o_.dtype + ".");
    Table t{"model", {"item", "value"}, {}};
    M::model_rows(t, o_.model);
    t.rows.push_back({"parameters", grouped(static_cast<double>(tg::tree_count(params_)))});
    log_.show(t);
  }

  // 2. The first batch at the initial parameters beside the reference's numbers (the golden file): loss
  // (1e-6 relative), gradient global norm (1e-5 relative) and identical parameters. Returns the exit code
  // of --check-golden: 0 when they match, 1 when not.
  int beside_jax() {
    log_.heading("2. Beside JAX", std::string("The first batch at the initial parameters, through tapegrad and through the same model in ") +
                                      M::reference + " (" + M::reference_script + ", from these parameters exported with --export-init).");
    std::ifstream f(o_.golden);
    std::string why;
    json g;
    if (!f) {
      why = "cannot read the golden values " + o_.golden + " (--golden: the golden file of this example in the source tree)";
    } else {
      g = json::parse(f);
      const auto& gc = g.at("config");
      if (!M::golden_fits(gc, o_.model) || gc.at("batch") != o_.batch || gc.at("seed") != o_.seed)
        why = "the golden values (" + o_.golden + ") were made for " + gc.dump() + ", not this run's sizes, batch and seed; "
              "regenerate them for these with " + M::reference_script + " golden";
    }
    if (!why.empty()) {
      log_.say("Skipped: " + why + ".");
      if (o_.check_golden) throw DataError("--check-golden: " + why);
      return 1;
    }
    auto loss_fn = [this](const Params& p, const Images& x, const Labels& y) { return M::template loss_with_metrics<float>(p, x, y, o_.model); };
    const auto [la, grads] = tg::value_and_grad(loss_fn, tg::has_aux)(params_, train_[0].x, train_[0].y);
    const double loss = la.first.item(), norm = tg::global_norm(grads).item();
    const double want_loss = g.at("loss"), want_norm = g.at("grad_global_norm");
    const double loss_err = std::fabs(loss - want_loss) / std::fabs(want_loss), norm_err = std::fabs(norm - want_norm) / std::fabs(want_norm);
    const std::string digest = params_digest(params_), want_digest = g.at("params_digest");
    Table t{"first batch (f32): tapegrad vs JAX", {"quantity", "tapegrad", "JAX", "relative difference"}, {}};
    t.rows.push_back({"initial parameters (SHA-256 of the f32 bytes)", digest.substr(0, 16) + "...", want_digest.substr(0, 16) + "...",
                      digest == want_digest ? "identical" : "DIFFERENT"});
    t.rows.push_back({"first-batch loss", fmt("%.9f", loss), fmt("%.9f", want_loss), fmt("%.2e", loss_err)});
    t.rows.push_back({"gradient global norm", fmt("%.9f", norm), fmt("%.9f", want_norm), fmt("%.2e", norm_err)});
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
    optim_ = o_.optim;
    M::schedule(optim_, total);
    const auto optimizer = M::make_optimizer(optim_);
    using State = decltype(optimizer.init(std::declval<Params>()));
    State state = optimizer.init(params_);
    // The step as the model writes it; with a dropout key when the model takes one (an argument of the
    // compiled step, so a replay draws new masks).
    auto step = tg::compile([&](const Params& p, const State& s, const Images& x, const Labels& y, const auto&... key) {
      return M::template train_step<C>(optimizer, o_.model, p, s, x, y, key...);
    });
    log_.heading("3. Training", std::to_string(o_.epochs) + " epochs of " + std::to_string(steps_per_epoch) + " steps (batch " +
                                    std::to_string(o_.batch) + "), compiled step (tg::compile), compute " + o_.dtype + ". " +
                                    M::optimizer_text(optim_) + ". Test accuracy over all 10,000 test images after each epoch.");
    const auto base_key = tg::random::key(o_.seed + 1);
    const Key fixed_key = tg::random::key_data<D>(base_key);
    auto run_step = [&](Params p, State s, const tg::data::Batch<D>& b) {
      if constexpr (M::uses_key) {
        const Key key = M::step_key(o_.model) ? tg::random::key_data<D>(tg::random::fold_in(base_key, static_cast<std::uint32_t>(steps_))) : fixed_key;
        return step(std::move(p), std::move(s), b.x, b.y, key);
      } else {
        return step(std::move(p), std::move(s), b.x, b.y);
      }
    };
    History history;
    std::vector<double> e_epoch, e_test, e_seconds;
    double train_seconds = 0;
    std::int64_t timed_steps = 0;
    const auto wall0 = clock_type::now();
    Progress progress("training", static_cast<int>(total), o_.quiet);
    std::string status;
    for (int epoch = 1; epoch <= o_.epochs && steps_ < total; ++epoch) {
      if (epoch > 1) train_ = epoch_batches(o_.augment);  // outside the timed region: the next epoch's batches, moved to the device
      clock_type::time_point t0 = clock_type::now();
      std::int64_t timed_here = 0;
      Images last_loss;
      for (const auto& b : train_) {
        if (steps_ == total) break;
        ++steps_;
        auto [p, s, m] = run_step(std::move(params_), std::move(state), b);
        params_ = std::move(p), state = std::move(s), last_loss = m.loss;
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
            throw Diverged("the training loss is " + fmt("%g", history.loss.back()) + " at step " + std::to_string(steps_) +
                           ": the training diverged; lower --lr (now " + fmt("%g", optim_.peak_lr) + ")");
          status = "loss " + fmt("%.4f", history.loss.back()) + "  acc " + fmt("%.3f", history.accuracy.back());
        }
        progress.update(static_cast<int>(steps_), status, log);
      }
      (void)last_loss.item();  // synchronise before the clock stops
      const double seconds = seconds_since(t0);
      train_seconds += seconds, timed_steps += timed_here;
      e_epoch.push_back(epoch), e_seconds.push_back(seconds_since(wall0)), e_test.push_back(test_accuracy().accuracy);
      if (!o_.quiet) std::printf("  epoch %d: test accuracy %.4f (%.1f s since the start)\n", epoch, e_test.back(), e_seconds.back());
    }
    const double wall = seconds_since(wall0);
    ips_ = timed_steps > 0 ? static_cast<double>(timed_steps * o_.batch) / train_seconds : 0.0;
    metrics_["history"] = report_history(log_, "training curve", history);
    Table acc{"accuracy curve (test set, after each epoch)", {"epoch", "test accuracy", "seconds since the start of training"}, {}};
    json curve = json::array();
    for (std::size_t i = 0; i < e_epoch.size(); ++i) {
      acc.rows.push_back({fmt("%.0f", e_epoch[i]), fmt("%.4f", e_test[i]), fmt("%.1f", e_seconds[i])});
      curve.push_back({{"epoch", e_epoch[i]}, {"test_accuracy", e_test[i]}, {"seconds", e_seconds[i]}});
    }
    log_.show(acc);
    json throughput = {{"images_per_sec", ips_}};
    Table tp{"throughput (measured)", {"measure", "value"}, {}};
    tp.rows.push_back({"images/sec (" + std::to_string(timed_steps) + " steps after 1 warm-up step)", grouped(ips_)});
    M::throughput(tp, throughput, ips_, o_.model);
    tp.rows.push_back({"training time (steps only)", fmt("%.1f s", train_seconds)});
    tp.rows.push_back({"wall time of the training section (with data order and evaluations)", fmt("%.1f s", wall)});
    log_.show(tp);
    log_.say("Timing: the clock runs over the training steps only; it starts after the first (recording) step and after each epoch's "
             "batches are on the device, and stops after the device is synchronised (a metric read back).");
    metrics_["accuracy_curve"] = curve;
    throughput["timed_steps"] = timed_steps, throughput["train_seconds"] = train_seconds, throughput["wall_seconds"] = wall;
    metrics_["throughput"] = throughput;
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

  // 4. Evaluation on all 10,000 test images, and 5. the model's own look at one of them.
  void evaluation() {
    log_.heading("4. Evaluation", "All 10,000 test images.");
    const TestResult r = test_accuracy();
    Table t{"test set", {"images", "loss", "accuracy"}, {}};
    t.rows.push_back({grouped(static_cast<double>(r.predicted.size())), fmt("%.4f", r.loss), fmt("%.4f", r.accuracy)});
    log_.show(t);
    metrics_["test"] = {{"images", r.predicted.size()}, {"loss", r.loss}, {"accuracy", r.accuracy}};
    const auto labels = data_.test.labels.to_vector();
    const auto px = data_.test.images.to_vector();
    // 25 sample test images, as the MLP example: np.random.default_rng(7).choice(10000, 25, replace=False).
    const auto pick = tg::random::numpy::default_rng(7).choice(static_cast<std::int64_t>(labels.size()), 25);
    std::vector<std::int32_t> sample_predicted;
    for (const auto i : pick) sample_predicted.push_back(r.predicted[static_cast<std::size_t>(i)]);
    (void)report_samples(log_, px, labels, pick, sample_predicted);
    metrics_["test"]["confusion_counts"] = report_confusion(log_, std::vector<std::int32_t>(labels.begin(), labels.end()), r.predicted);
    M::inspect(log_, metrics_, params_, o_.model, px, labels, pick[0]);
    json config = {{"model", o_.model.str()}, {"epochs", o_.epochs}, {"batch", o_.batch}, {"dtype", o_.dtype}, {"device", device_}};
    config.update(M::optim_metrics(optim_));
    metrics_["config"] = config;
    log_.say("Final test accuracy " + fmt("%.4f", r.accuracy) + " after " + std::to_string(steps_) + " steps; " + M::summary(ips_, o_.model) + ".");
  }

  const ClassifierOptions<M>& o_;
  const Loaded& data_;
  json& metrics_;
  Log log_;
  const std::string device_;
  tg::random::numpy::Generator order_rng_;
  Params params_;
  std::vector<tg::data::Batch<D>> train_;
  const std::vector<tg::data::Batch<D>> test_ = tg::data::fixed_batches<D>(data_.test.images, data_.test.labels, 1000, 10);  // in file order
  struct Evaluate {
    const typename M::Config* model;
    auto operator()(const Params& p, const Images& x, const Labels& y) const { return M::evaluate(p, x, y, *model); }
  };
  tg::Compiled<Evaluate> evaluate_ = tg::compile(Evaluate{&o_.model});
  typename M::OptimConfig optim_;
  std::int64_t steps_ = 0;
  double ips_ = 0;
};

/// The options every classifier has (the model adds its own first, M::add_options).
template <class M>
void add_classifier_options(CLI::App& app, ClassifierOptions<M>& o) {
  M::add_options(app, o.model, o.optim);
  app.add_option("--epochs", o.epochs, "training epochs")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--batch-size", o.batch, "examples per batch")->check(CLI::Range(1, 60000))->capture_default_str();
  app.add_option("--max-steps", o.max_steps, "stop after this many steps (0: all the epochs)")->check(CLI::Range(0, 100000000))->capture_default_str();
  app.add_option("--log-every", o.log_every, "log the metrics every N steps")->check(CLI::Range(1, 100000000))->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the initial parameters (key(seed)) and of the data order (np.random.default_rng(seed))")->capture_default_str();
  add_common_options(app, o, "compute dtype (parameters stay f32)");
  app.add_option("--golden", o.golden, std::string("the ") + M::reference + " reference's first-batch values (" + M::reference_script + " golden)")
      ->capture_default_str();
  app.add_option("--export-init", o.export_init, "write the initial parameters to this safetensors file and exit (the JAX reference's input)");
  app.add_flag("--check-golden", o.check_golden, "only compare the first batch with the JAX golden values; exit 0 when they match, 1 when not");
  app.add_flag("!--no-augment", o.augment, "train without mirroring half of the images from the second epoch on");
}

/// A classifier example's main: the command line, then the data, the run on the device --device picks,
/// and report.html and metrics.json under --out. Exit codes as run_main's.
template <class M>
int classifier_main(int argc, char** argv, const std::string& description) {
  ClassifierOptions<M> o;
  o.out = M::default_out;
  CLI::App app{description};
  add_classifier_options(app, o);
  CLI11_PARSE(app, argc, argv);
  if (const std::string why = M::check(o.model); !why.empty()) {
    std::cerr << M::program << ": " << why << "\n";
    return 2;
  }
  return run_main(M::program, [&] {
    check_device_option(o.device);
    const Loaded data = find_and_load(o.data_dir, !o.no_download, true, o.quiet);
    const bool report = !o.check_golden && o.export_init.empty();
    if (report) check_output_dir(o.out);  // before training, not after it
    json metrics;
    Report html;
    const auto t0 = clock_type::now();
    const int rc = tg::with_device(o.device, [&]<class D>() { return ClassifierRun<M, D>(o, data, metrics, html).run(); });
    if (!report) return rc;
    metrics["seconds"] = seconds_since(t0);
    write_metrics_and_report(o.out, metrics.dump(2) + "\n", html.document(M::title), o.quiet, seconds_since(t0));
    return rc;
  });
}

}  // namespace examples
