// dp_sgd: the codelab's MLP trained on the real Fashion-MNIST with differential privacy (DP-SGD,
// dp_sgd.hpp): per-example gradients from tg::vmap(tg::grad(...)), each clipped, summed, noised and
// averaged, the step compiled with tg::compile. It reports the training curve, the test accuracy and the
// privacy spent (epsilon at --delta) after every epoch, and examples/sec; writes metrics.json and
// report.html with the examples' shared report code (examples/common). --check-golden compares the
// per-example gradient norms of the codelab's first batch, and one DP-SGD step, with the same code in JAX
// (scripts/dp_sgd_reference.py, dp_sgd_golden.json); --bench times the step alone (for
// scripts/bench-dp-sgd-vs-jax). Built by g++ as dp_sgd and by nvcc as dp_sgd_cuda (this file).
#include <tapegrad/tapegrad.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

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
#include "accountant.hpp"
#include "dp_sgd.hpp"

namespace ex = examples;
using json = nlohmann::ordered_json;

namespace {

struct Options : ex::CommonOptions {
  dp_sgd::Privacy privacy;
  int epochs = 3;
  std::int64_t batch = 512;
  double lr = 0.1, momentum = 0.9, delta = 1e-5;
  int max_steps = 0;  ///< stop after this many steps (0: all epochs), for smoke tests
  int log_every = 20;
  int bench = 0;      ///< time this many compiled steps, print one JSON line and exit
  std::uint32_t seed = 0;
  std::string golden = EXAMPLE_GOLDEN;
  bool check_golden = false;
};

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

template <class D>
class DpRun {
 public:
  using Params = dp_sgd::Mlp<D>;
  using Key = tg::Tensor<std::uint32_t, D>;
  using Optimizer = decltype(tg::optim::sgd(0.1, 0.9));
  using State = decltype(std::declval<const Optimizer&>().init(std::declval<const Params&>()));

  DpRun(const Options& o, const ex::Loaded& data, json& metrics, ex::Report& report)
      : o_(o), data_(data), metrics_(metrics), log_(report, o.quiet), optimizer_(tg::optim::sgd(o.lr, o.momentum)) {}

  int run() {
    if (o_.check_golden) return beside_jax();
    if (o_.bench > 0) return bench();
    settings();
    training();
    return 0;
  }

 private:
  /// The training set in NumPy's order, np.random.default_rng(seed + epoch).permutation(60000), cut into
  /// batches (tail trimmed): epoch 0 with seed 0 is the codelab's order.
  std::vector<tg::data::Batch<D>> epoch_batches(int epoch, std::int64_t batch) const {
    const auto order = tg::random::numpy::default_rng(o_.seed + static_cast<std::uint32_t>(epoch)).permutation(data_.train.labels.size());
    return tg::data::fixed_batches<D>(data_.train.images, data_.train.labels, batch, 10, std::span<const std::int64_t>(order));
  }

  /// The step's key: fold_in(key(seed), step), as the JAX reference.
  Key step_key(int step) const { return tg::random::key_data<D>(tg::random::fold_in(tg::random::key(o_.seed), static_cast<std::uint32_t>(step))); }

  /// dp_sgd::train_step with this run's optimizer and privacy settings.
  struct Step {
    Optimizer optimizer;
    dp_sgd::Privacy privacy;
    auto operator()(const Params& p, const State& s, const tg::Tensor<float, D>& x, const tg::Tensor<std::int32_t, D>& y, const Key& key) const {
      return dp_sgd::train_step(optimizer, privacy, p, s, x, y, key);
    }
  };

  /// The compiled step; the parameters and optimizer state are passed as rvalues, so donated.
  tg::Compiled<Step> compiled_step() const { return tg::compile(Step{optimizer_, o_.privacy}); }

  void settings() {
    const double q = static_cast<double>(o_.batch) / static_cast<double>(data_.train.labels.size());
    log_.heading("DP-SGD", "The codelab's MLP (784-256-128-10, GELU) trained with differential privacy on " + tg::device_name<D>() +
                               ": each example's gradient clipped to L2 norm " + ex::fmt("%g", o_.privacy.l2_norm_clip) +
                               ", summed, Gaussian noise of standard deviation " + ex::fmt("%g", o_.privacy.noise_multiplier) + " x " +
                               ex::fmt("%g", o_.privacy.l2_norm_clip) + " added, divided by the batch of " + std::to_string(o_.batch) +
                               "; then SGD with momentum. Per-example gradients come from tg::vmap(tg::grad(example_loss)).");
    ex::Table t{"settings", {"setting", "value"}, {}};
    t.rows = {{"batch size (sampling rate q)", std::to_string(o_.batch) + " (" + ex::fmt("%.5f", q) + ")"},
              {"L2 norm clip C", ex::fmt("%g", o_.privacy.l2_norm_clip)},
              {"noise multiplier sigma", ex::fmt("%g", o_.privacy.noise_multiplier)},
              {"optimizer", "sgd(" + ex::fmt("%g", o_.lr) + ", momentum " + ex::fmt("%g", o_.momentum) + ")"},
              {"epochs", std::to_string(o_.epochs)},
              {"delta", ex::fmt("%g", o_.delta)}};
    log_.show(t);
    metrics_["settings"] = {{"batch", o_.batch}, {"l2_norm_clip", o_.privacy.l2_norm_clip}, {"noise_multiplier", o_.privacy.noise_multiplier},
                            {"lr", o_.lr}, {"momentum", o_.momentum}, {"epochs", o_.epochs}, {"delta", o_.delta}, {"device", tg::device_name<D>()}};
  }

  void training() {
    Params params = codelab::init_mlp_params<D>(tg::random::key(static_cast<std::int64_t>(o_.seed)));
    auto state = optimizer_.init(params);
    auto step_fn = compiled_step();
    const auto [test_x, test_y] = test_batches();
    auto evaluate = tg::compile(&codelab::evaluate_batches<D>);
    const double q = static_cast<double>(o_.batch) / static_cast<double>(data_.train.labels.size());
    ex::History history;
    ex::Table epochs{"after each epoch", {"epoch", "steps", "test accuracy", "test loss", "epsilon (delta " + ex::fmt("%g", o_.delta) + ")"}, {}};
    json per_epoch = json::array();
    int step = 0;
    double train_seconds = 0;
    std::int64_t timed_examples = 0;
    log_.heading("Training", "Metrics of the logged steps: the batch's mean loss and accuracy before the step, the mean per-example gradient "
                             "norm and the fraction of examples clipped.");
    for (int epoch = 0; epoch < o_.epochs && !(o_.max_steps && step >= o_.max_steps); ++epoch) {
      const auto batches = epoch_batches(epoch, o_.batch);
      ex::Progress progress("epoch " + std::to_string(epoch + 1), static_cast<int>(batches.size()), o_.quiet);
      for (std::size_t i = 0; i < batches.size() && !(o_.max_steps && step >= o_.max_steps); ++i) {
        const auto t0 = clock_type::now();
        auto [p, s, m] = step_fn(std::move(params), std::move(state), batches[i].x, batches[i].y, step_key(step));
        params = std::move(p), state = std::move(s);
        ++step;
        const bool logged = step % o_.log_every == 0 || step == 1;
        if (logged) {
          const double loss = m.loss.item();  // synchronises
          if (!std::isfinite(loss)) throw ex::Diverged("the training loss is " + std::to_string(loss) + " at step " + std::to_string(step));
          history.step.push_back(step), history.loss.push_back(loss), history.accuracy.push_back(m.accuracy.item());
          history.grad_norm.push_back(m.mean_norm.item());
          progress.update(static_cast<int>(i + 1), "loss " + ex::fmt("%.4f", loss) + ", clipped " + ex::fmt("%.2f", m.clipped.item()), true);
        } else {
          progress.update(static_cast<int>(i + 1), "", false);
        }
        if (step > 1) train_seconds += seconds_since(t0), timed_examples += o_.batch;  // the first step records the plan
      }
      const auto [losses, pred] = evaluate(params, test_x, test_y);
      double loss_sum = 0;
      for (const float l : losses.to_vector()) loss_sum += l;
      const auto pv = pred.to_vector(), yv = test_y.to_vector();
      std::size_t correct = 0;
      for (std::size_t k = 0; k < yv.size(); ++k) correct += pv[k] == yv[k];
      const double n = static_cast<double>(yv.size()), acc = static_cast<double>(correct) / n;
      const double eps = dp_sgd::epsilon(q, o_.privacy.noise_multiplier, step, o_.delta);
      epochs.rows.push_back({std::to_string(epoch + 1), std::to_string(step), ex::fmt("%.4f", acc), ex::fmt("%.4f", loss_sum / n), ex::fmt("%.3f", eps)});
      per_epoch.push_back({{"epoch", epoch + 1}, {"steps", step}, {"test_accuracy", acc}, {"test_loss", loss_sum / n}, {"epsilon", eps}});
    }
    metrics_["history"] = ex::report_history(log_, "logged steps (the last column: mean per-example gradient norm)", history);
    log_.show(epochs);
    metrics_["epochs"] = per_epoch;
    // The clock stops after each step's host-side call returns; the logged steps read a metric, which waits
    // for the device: the rate is the work done, synchronised at the logged steps and at the end.
    const double eps_per_sec = train_seconds > 0 ? static_cast<double>(timed_examples) / train_seconds : 0.0;
    ex::Table tp{"throughput", {"measure", "value"}, {}};
    tp.rows.push_back({"examples/sec (per-example gradients, clipping, noise and the update; the first step excluded)", ex::grouped(eps_per_sec)});
    log_.show(tp);
    metrics_["throughput"] = {{"examples_per_sec", eps_per_sec}};
    if (!per_epoch.empty()) {
      metrics_["test"] = {{"accuracy", per_epoch.back()["test_accuracy"]}, {"loss", per_epoch.back()["test_loss"]}};
      metrics_["privacy"] = {{"epsilon", per_epoch.back()["epsilon"]}, {"delta", o_.delta}, {"steps", step}, {"sampling_rate", q}};
      log_.say("Privacy spent: (" + ex::fmt("%.3f", per_epoch.back()["epsilon"].get<double>()) + ", " + ex::fmt("%g", o_.delta) +
               ")-DP after " + std::to_string(step) + " steps, by the Renyi DP of the sampled Gaussian mechanism (as TensorFlow Privacy and "
               "Opacus account; the fixed batches are treated as Poisson samples, as JAX's DP-SGD example does).");
    }
  }

  std::pair<tg::Tensor<float, D>, tg::Tensor<std::int32_t, D>> test_batches() const {
    const auto test = tg::data::fixed_batches<D>(data_.test.images, data_.test.labels, 512, 10);
    std::vector<tg::Tensor<float, D>> xs;
    std::vector<tg::Tensor<std::int32_t, D>> ys;
    for (const auto& b : test) xs.push_back(b.x), ys.push_back(b.y);
    return {tg::stack(std::span<const tg::Tensor<float, D>>(xs)), tg::stack(std::span<const tg::Tensor<std::int32_t, D>>(ys))};
  }

  /// The codelab's first batch (512, default_rng(0)) at its key(1) parameters: each example's gradient
  /// norm, and the loss after one DP-SGD step with fold_in(key(0), 0), against the JAX reference.
  int beside_jax() {
    std::ifstream in(o_.golden);
    if (!in) throw ex::DataError("--golden " + o_.golden + ": cannot open the JAX reference's values (scripts/dp_sgd_reference.py golden)");
    const json golden = json::parse(in);
    const auto b = epoch_batches(0, 512)[0];
    const Params p = codelab::init_mlp_params<D>(tg::random::key(1));
    const auto [out, grads] = dp_sgd::per_example_grads(p, b.x, b.y);
    const auto norms = dp_sgd::per_example_norms(grads).to_vector();
    const auto want = golden["per_example_grad_norms"].get<std::vector<double>>();
    double worst = 0;
    std::size_t at = 0;
    for (std::size_t i = 0; i < want.size() && i < norms.size(); ++i) {
      const double r = std::fabs(norms[i] - want[i]) / std::fabs(want[i]);
      if (r > worst) worst = r, at = i;
    }
    auto state = optimizer_.init(p);
    const auto [p1, s1, m] = dp_sgd::train_step(optimizer_, dp_sgd::Privacy{}, p, state, b.x, b.y, step_key(0));
    (void)s1;
    const double loss_after = codelab::cross_entropy_loss(p1, b.x, b.y).item(), want_after = golden["loss_after_one_dp_step"].get<double>();
    const double r_after = std::fabs(loss_after - want_after) / want_after;
    const json& priv = golden["privacy"];
    const double eps = dp_sgd::epsilon(priv["sampling_rate"].get<double>(), priv["noise_multiplier"].get<double>(), priv["steps"].get<std::int64_t>(),
                                       priv["delta"].get<double>());
    const double want_eps = priv["epsilon"].get<double>(), r_eps = std::fabs(eps - want_eps) / want_eps;
    const bool ok = norms.size() == want.size() && worst <= 1e-6 && r_after <= 1e-6 && r_eps <= 1e-6;
    if (!o_.quiet) {
      std::printf("per-example gradient norms of the codelab's first batch (%zu examples): worst relative difference %.2e (example %zu: %.8f vs JAX %.8f)\n",
                  norms.size(), worst, at, norms[at], want[at]);
      std::printf("loss after one DP-SGD step (sgd %g, momentum %g): %.8f vs JAX %.8f (relative %.2e)\n", o_.lr, o_.momentum, loss_after, want_after, r_after);
      std::printf("epsilon after %lld steps at q %.6f, sigma %g, delta %g: %.8f vs dp_accounting's %.8f (relative %.2e)\n",
                  static_cast<long long>(priv["steps"].get<std::int64_t>()), priv["sampling_rate"].get<double>(), priv["noise_multiplier"].get<double>(),
                  priv["delta"].get<double>(), eps, want_eps, r_eps);
      std::printf("%s (tolerance 1e-6 relative; JAX %s)\n", ok ? "match" : "MISMATCH", golden.value("jax", std::string("?")).c_str());
    }
    return ok ? 0 : 1;
  }

  /// --bench N: N compiled steps after one that records, over the first batches; one JSON line.
  int bench() {
    Params params = codelab::init_mlp_params<D>(tg::random::key(1));
    auto state = optimizer_.init(params);
    auto step_fn = compiled_step();
    const auto batches = epoch_batches(0, o_.batch);
    auto go = [&](int i) {
      auto [p, s, m] = step_fn(std::move(params), std::move(state), batches[static_cast<std::size_t>(i) % batches.size()].x,
                               batches[static_cast<std::size_t>(i) % batches.size()].y, step_key(i));
      params = std::move(p), state = std::move(s);
      return m;
    };
    (void)go(0).loss.item();
    const auto t0 = clock_type::now();
    dp_sgd::Metrics<D> m;
    for (int i = 1; i <= o_.bench; ++i) m = go(i);
    const double loss = m.loss.item();
    const double eps = static_cast<double>(o_.bench) * static_cast<double>(o_.batch) / seconds_since(t0);
    std::printf("{\"examples_per_sec\": %.1f, \"batch\": %lld, \"steps\": %d, \"loss\": %.6f}\n", eps, static_cast<long long>(o_.batch), o_.bench, loss);
    return 0;
  }

  const Options& o_;
  const ex::Loaded& data_;
  json& metrics_;
  ex::Log log_;
  Optimizer optimizer_;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.out = "dp_sgd_out";
  CLI::App app{"dp_sgd: the codelab's MLP trained on Fashion-MNIST with DP-SGD (per-example gradients by tg::vmap); writes report.html and "
               "metrics.json under --out"};
  app.add_option("--epochs", o.epochs, "training epochs")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--batch-size", o.batch, "examples per batch")->check(CLI::Range(1, 60000))->capture_default_str();
  app.add_option("--max-steps", o.max_steps, "stop after this many steps (0: all the epochs)")->check(CLI::Range(0, 100000000))->capture_default_str();
  app.add_option("--lr", o.lr, "SGD learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(CLI::Range(0.0, 0.999))->capture_default_str();
  app.add_option("--l2-norm-clip", o.privacy.l2_norm_clip, "clip each example's gradient to this L2 norm")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--noise-multiplier", o.privacy.noise_multiplier, "noise standard deviation over the clip norm")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--delta", o.delta, "the delta of the (epsilon, delta)-DP reported")->check(CLI::Range(1e-12, 0.1))->capture_default_str();
  app.add_option("--log-every", o.log_every, "log the metrics every N steps")->check(CLI::Range(1, 100000000))->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the initial parameters, the noise (key(seed)) and the data order (np.random.default_rng(seed + epoch))")
      ->capture_default_str();
  app.add_option("--bench", o.bench, "time this many compiled steps after one warm-up step, print examples/sec as JSON and exit")->check(CLI::Range(0, 1000000));
  app.add_option("--golden", o.golden, "the JAX reference's values (scripts/dp_sgd_reference.py golden)")->capture_default_str();
  app.add_flag("--check-golden", o.check_golden, "only compare per-example gradient norms and one step with JAX; exit 0 when they match, 1 when not");
  ex::add_device_data_output_options(app, o);  // no --dtype: DP-SGD here computes in f32
  CLI11_PARSE(app, argc, argv);
  return ex::run_main("dp_sgd", [&] {
    ex::check_device_option(o.device);
    const ex::Loaded data = ex::find_and_load(o.data_dir, !o.no_download, true, o.quiet || o.bench > 0);
    const bool report = !o.check_golden && o.bench == 0;
    if (report) ex::check_output_dir(o.out);  // before training, not after it
    json metrics;
    ex::Report html;
    const auto t0 = clock_type::now();
    const int rc = tg::with_device(o.device, [&]<class D>() { return DpRun<D>(o, data, metrics, html).run(); });
    if (!report) return rc;
    metrics["seconds"] = seconds_since(t0);
    ex::write_metrics_and_report(o.out, metrics.dump(2) + "\n", html.document("tapegrad: DP-SGD on Fashion-MNIST"), o.quiet, seconds_since(t0));
    return rc;
  });
}
