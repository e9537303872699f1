// pinn_poisson: a physics-informed network (pinn.hpp) solving -lap(u) = 2 pi^2 sin(pi x) sin(pi y) on the
// unit square with u = 0 on its boundary. The loss is the squared residual at 32 x 32 collocation points,
// the Laplacian from tg::jvp of tg::grad; its gradient in the parameters is a third derivative of the
// network. Adam, then a second phase with the learning rate decaying to a hundredth, the step compiled
// with tg::compile. Reports the relative L2 error against sin(pi x) sin(pi y) on a 101 x 101 grid as it
// trains, the time to reach --target, the solution and its error field, and the loss curve; writes
// metrics.json and report.html (examples/common). --check-golden compares the first loss and one step
// with the same model in JAX (scripts/pinn_poisson_reference.py, pinn_golden.json).
#include <tapegrad/tapegrad.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "../common/cli.hpp"
#include "../common/outputs.hpp"
#include "../common/report.hpp"
#include "pinn.hpp"

namespace ex = examples;
using json = nlohmann::ordered_json;

namespace {

struct Options {
  std::int64_t width = 32, points = 32, grid = 101;
  double lr = 3e-3, target = 1e-3;
  std::int64_t adam_steps = 2000, decay_steps = 3000;
  int eval_every = 100, max_steps = 0;
  std::uint32_t seed = 0;
  std::string device = "auto", out = "pinn_poisson_out", golden = EXAMPLE_GOLDEN;
  bool check_golden = false, quiet = false;
};

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

template <class D>
class PinnRun {
 public:
  using Params = pinn::Mlp<D>;
  using Optimizer = decltype(pinn::make_optimizer(0.0, 0, 0));
  using State = decltype(std::declval<const Optimizer&>().init(std::declval<const Params&>()));

  PinnRun(const Options& o, json& metrics, ex::Report& report)
      : o_(o), metrics_(metrics), log_(report, o.quiet), optimizer_(pinn::make_optimizer(o.lr, o.adam_steps, o.decay_steps)),
        points_(pinn::collocation<D>(o.points)), grid_(pinn::grid<D>(o.grid)) {
    for (std::int64_t i = 0; i < o.grid; ++i)
      for (std::int64_t j = 0; j < o.grid; ++j)
        exact_.push_back(pinn::exact(static_cast<double>(i) / static_cast<double>(o.grid - 1), static_cast<double>(j) / static_cast<double>(o.grid - 1)));
  }

  int run() {
    settings();
    const int golden = beside_jax();
    if (o_.check_golden) return golden;
    training();
    return 0;
  }

 private:
  /// The compiled step: the parameters and optimizer state passed as rvalues, so donated.
  struct Step {
    Optimizer optimizer;
    auto operator()(const Params& p, const State& s, const pinn::Collocation<D>& c) const { return pinn::train_step(optimizer, p, s, c); }
  };

  /// u on the evaluation grid, and its relative L2 error against the exact solution.
  std::pair<std::vector<double>, double> evaluate(const Params& p) {
    const auto uv = predict_(p, grid_).template to<tg::Cpu>().to_vector();
    std::vector<double> u(uv.begin(), uv.end());
    double num = 0, den = 0;
    for (std::size_t i = 0; i < u.size(); ++i) num += (u[i] - exact_[i]) * (u[i] - exact_[i]), den += exact_[i] * exact_[i];
    return {u, std::sqrt(num / den)};
  }

  void settings() {
    log_.heading("A physics-informed network for the Poisson problem",
                 "-lap(u) = 2 pi^2 sin(pi x) sin(pi y) on the unit square, u = 0 on its boundary (exact solution sin(pi x) sin(pi y)), on " +
                     tg::device_name<D>() + ". u = x (1 - x) y (1 - y) N(x, y) with N an MLP; the loss is the mean squared residual "
                     "lap(u) + f at the collocation points, the Laplacian by tg::jvp of tg::grad (forward over reverse), and its gradient "
                     "in the parameters by tg::value_and_grad: third derivatives of the network, all in one compiled step.");
    ex::Table t{"settings", {"setting", "value"}, {}};
    t.rows = {{"network N", "2-" + std::to_string(o_.width) + "-" + std::to_string(o_.width) + "-1, tanh, Glorot-normal from key(" +
                                std::to_string(o_.seed) + ") (" + ex::grouped(static_cast<double>(tg::tree_count(pinn::init_params<D>(tg::random::key(o_.seed), o_.width)))) +
                                " parameters)"},
              {"collocation points", std::to_string(o_.points) + " x " + std::to_string(o_.points) + " cell centres"},
              {"optimizer", "Adam " + ex::fmt("%g", o_.lr) + " for " + std::to_string(o_.adam_steps) + " steps, then decaying exponentially to " +
                                ex::fmt("%g", o_.lr / 100) + " over " + std::to_string(o_.decay_steps)},
              {"error", "relative L2 against the exact solution on a " + std::to_string(o_.grid) + " x " + std::to_string(o_.grid) +
                            " grid, every " + std::to_string(o_.eval_every) + " steps; target " + ex::fmt("%g", o_.target)},
              {"precision", "float32"}};
    log_.show(t);
    metrics_["settings"] = {{"width", o_.width}, {"points", o_.points}, {"lr", o_.lr}, {"adam_steps", o_.adam_steps}, {"decay_steps", o_.decay_steps},
                            {"seed", o_.seed}, {"grid", o_.grid}, {"target", o_.target}, {"device", tg::device_name<D>()}};
  }

  /// The first loss and the loss after one step beside the same model in JAX. Returns the exit code of
  /// --check-golden: 0 when both are within 1e-6 relative.
  int beside_jax() {
    log_.heading("Beside JAX", "The loss at the initial parameters and after one step, through tapegrad and through the same model in JAX + "
                               "Optax (scripts/pinn_poisson_reference.py golden).");
    std::ifstream in(o_.golden);
    if (!in) throw ex::DataError("--golden " + o_.golden + ": cannot open the JAX reference's values (scripts/pinn_poisson_reference.py golden)");
    const json g = json::parse(in);
    const json& gc = g.at("config");
    if (gc.at("width") != o_.width || gc.at("points") != o_.points || gc.at("lr") != o_.lr || gc.at("adam_steps") != o_.adam_steps ||
        gc.at("decay_steps") != o_.decay_steps || gc.at("seed") != o_.seed) {
      log_.say("Skipped: the golden values were made for " + gc.dump() + ", not this run's settings.");
      if (o_.check_golden) throw ex::DataError("--check-golden: the golden values were made for other settings: " + gc.dump());
      return 1;
    }
    const Params p = pinn::init_params<D>(tg::random::key(o_.seed), o_.width);
    auto loss = [&](const Params& q) { return pinn::loss(q, points_.xy, points_.f, points_.e0, points_.e1).item(); };
    const double first = loss(p);
    const auto [p1, s1, v1] = pinn::train_step(optimizer_, p, optimizer_.init(p), points_);
    const double after = loss(p1);
    const double want_first = g.at("first_loss"), want_after = g.at("loss_after_one_step");
    const double e1 = std::fabs(first - want_first) / want_first, e2 = std::fabs(after - want_after) / want_after;
    ex::Table t{"tapegrad vs JAX (float32)", {"quantity", "tapegrad", "JAX", "relative difference"}, {}};
    t.rows.push_back({"first loss", ex::fmt("%.9g", first), ex::fmt("%.9g", want_first), ex::fmt("%.2e", e1)});
    t.rows.push_back({"loss after one Adam step", ex::fmt("%.9g", after), ex::fmt("%.9g", want_after), ex::fmt("%.2e", e2)});
    log_.show(t);
    const bool ok = e1 <= 1e-6 && e2 <= 1e-6;
    log_.say(ok ? "Matches JAX: both within 1e-6 relative." : "DOES NOT MATCH JAX within 1e-6 relative.");
    metrics_["beside_jax"] = {{"first_loss", first}, {"jax_first_loss", want_first}, {"first_loss_rel_err", e1}, {"loss_after_one_step", after},
                              {"jax_loss_after_one_step", want_after}, {"after_one_step_rel_err", e2}, {"jax", g.value("jax", "?")}, {"ok", ok}};
    return ok ? 0 : 1;
  }

  void training() {
    Params params = pinn::init_params<D>(tg::random::key(o_.seed), o_.width);
    auto state = optimizer_.init(params);
    auto step_fn = tg::compile(Step{optimizer_});
    {  // record the plan on copies (as the JAX reference compiles first), then train from the start
      auto warm = step_fn(Params(params), State(state), points_);
      (void)std::get<2>(warm).item();
    }
    const std::int64_t total = o_.max_steps > 0 ? std::min<std::int64_t>(o_.max_steps, o_.adam_steps + o_.decay_steps) : o_.adam_steps + o_.decay_steps;
    std::vector<double> steps, losses, errors;
    ex::Table curve{"every " + std::to_string(o_.eval_every) + " steps", {"step", "loss", "relative L2 error", "training seconds"}, {}};
    double train_seconds = 0, reached_seconds = -1;
    std::int64_t reached_step = -1, step = 0;
    tg::Tensor<float, D> value;
    std::vector<double> u;
    double err = evaluate(params).second;
    ex::Progress progress("training", static_cast<int>(total), o_.quiet);
    while (step < total) {
      const auto t0 = clock_type::now();
      for (int k = 0; k < o_.eval_every && step < total; ++k, ++step) {
        auto [p, s, v] = step_fn(std::move(params), std::move(state), points_);
        params = std::move(p), state = std::move(s), value = std::move(v);
      }
      const double loss = value.item();  // waits for the device
      train_seconds += seconds_since(t0);
      if (!std::isfinite(loss)) throw ex::Diverged("the loss is " + std::to_string(loss) + " at step " + std::to_string(step));
      std::tie(u, err) = evaluate(params);
      if (reached_step < 0 && err <= o_.target) reached_step = step, reached_seconds = train_seconds;
      steps.push_back(static_cast<double>(step)), losses.push_back(loss), errors.push_back(err);
      curve.rows.push_back({std::to_string(step), ex::fmt("%.3e", loss), ex::fmt("%.3e", err), ex::fmt("%.2f", train_seconds)});
      progress.update(static_cast<int>(step), "loss " + ex::fmt("%.3e", loss) + ", error " + ex::fmt("%.2e", err), true);
    }
    log_.heading("Training", "The loss (mean squared residual) and the relative L2 error on the " + std::to_string(o_.grid) + " x " +
                                 std::to_string(o_.grid) + " grid; training time only (the evaluations and the recording of the plan excluded).");
    log_.show(curve);
    log_.html(ex::svg_log_curves(steps, {{"loss", "#c0392b", losses}, {"relative L2 error", "#2471a3", errors}}));
    json history = json::array();
    for (std::size_t i = 0; i < steps.size(); ++i) history.push_back({{"step", steps[i]}, {"loss", losses[i]}, {"rel_l2", errors[i]}});
    metrics_["history"] = history;

    const double steps_per_sec = train_seconds > 0 ? static_cast<double>(step) / train_seconds : 0.0;
    ex::Table r{"result", {"measure", "value"}, {}};
    r.rows.push_back({"relative L2 error after " + std::to_string(step) + " steps", ex::fmt("%.3e", err)});
    r.rows.push_back({"steps to reach " + ex::fmt("%g", o_.target), reached_step >= 0 ? std::to_string(reached_step) : "not reached"});
    r.rows.push_back({"training seconds to reach " + ex::fmt("%g", o_.target), reached_step >= 0 ? ex::fmt("%.2f", reached_seconds) : "-"});
    r.rows.push_back({"steps/sec", ex::fmt("%.1f", steps_per_sec)});
    log_.show(r);
    metrics_["result"] = {{"rel_l2", err}, {"steps", step}, {"target", o_.target}, {"reached_step", reached_step},
                          {"reached_seconds", reached_seconds}, {"train_seconds", train_seconds}, {"steps_per_sec", steps_per_sec}};
    log_.say(reached_step >= 0 ? "Reached the target " + ex::fmt("%g", o_.target) + " at step " + std::to_string(reached_step) + " after " +
                                     ex::fmt("%.2f", reached_seconds) + " s of training; final relative L2 error " + ex::fmt("%.3e", err) + "."
                               : "Did not reach the target " + ex::fmt("%g", o_.target) + "; final relative L2 error " + ex::fmt("%.3e", err) + ".");

    // The solution and its error on the grid, as images (x to the right, y upwards).
    std::vector<double> diff(u.size());
    double worst = 0;
    for (std::size_t i = 0; i < u.size(); ++i) diff[i] = u[i] - exact_[i], worst = std::max(worst, std::fabs(diff[i]));
    const int k = static_cast<int>(o_.grid), scale = std::max(1, 303 / k);
    log_.heading("Solution", "Left: u from the network on the grid (white 0, dark red 1). Right: u minus the exact solution, blue below and "
                             "red above, full colour at +-" + ex::fmt("%.2e", worst) + " (the largest error).");
    log_.html("<div class=\"grid\" style=\"gap:24px\"><figure style=\"width:auto\"><img style=\"width:303px;height:303px\" src=\"" +
              ex::png_data_uri(ex::encode_png(ex::field_image(u, k, 0.0, 1.0, scale))) + "\" alt=\"u\"><figcaption>u(x, y)</figcaption></figure>" +
              "<figure style=\"width:auto\"><img style=\"width:303px;height:303px\" src=\"" +
              ex::png_data_uri(ex::encode_png(ex::field_image(diff, k, -worst, worst, scale))) +
              "\" alt=\"error\"><figcaption>u - exact</figcaption></figure></div>");
    metrics_["max_abs_error"] = worst;
  }

  const Options& o_;
  json& metrics_;
  ex::Log log_;
  Optimizer optimizer_;
  pinn::Collocation<D> points_;
  tg::Tensor<float, D> grid_;
  std::vector<double> exact_;
  tg::Compiled<decltype(&pinn::u<D>)> predict_ = tg::compile(&pinn::u<D>);
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"pinn_poisson: a physics-informed network for the 2-D Poisson problem (second derivatives by tg::jvp of tg::grad); writes "
               "report.html and metrics.json under --out"};
  app.add_option("--width", o.width, "hidden units per layer")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--points", o.points, "collocation grid: points x points")->check(CLI::Range(2, 1024))->capture_default_str();
  app.add_option("--lr", o.lr, "Adam's learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--adam-steps", o.adam_steps, "steps at the learning rate")->check(CLI::Range(0, 100000000))->capture_default_str();
  app.add_option("--decay-steps", o.decay_steps, "steps of the second phase, the rate decaying to a hundredth")->check(CLI::Range(0, 100000000))
      ->capture_default_str();
  app.add_option("--max-steps", o.max_steps, "stop after this many steps (0: both phases)")->check(CLI::Range(0, 100000000))->capture_default_str();
  app.add_option("--eval-every", o.eval_every, "measure the error every N steps")->check(CLI::Range(1, 100000000))->capture_default_str();
  app.add_option("--grid", o.grid, "evaluation grid: grid x grid points")->check(CLI::Range(2, 2001))->capture_default_str();
  app.add_option("--target", o.target, "the relative L2 error whose time to reach is reported")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the initial parameters (key(seed))")->capture_default_str();
  app.add_option("--device", o.device, "auto: CUDA when a GPU is there (in an nvcc build), else the CPU")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))->capture_default_str();
  app.add_option("--golden", o.golden, "the JAX reference's values (scripts/pinn_poisson_reference.py golden)")->capture_default_str();
  app.add_flag("--check-golden", o.check_golden, "only compare the first loss and one step with JAX; exit 0 when they match, 1 when not");
  app.add_option("--out", o.out, "output directory")->capture_default_str();
  app.add_flag("--quiet", o.quiet, "print nothing but errors");
  CLI11_PARSE(app, argc, argv);
  return ex::run_main("pinn_poisson", [&] {
    ex::check_device_option(o.device);
    if (!o.check_golden) ex::check_output_dir(o.out);  // before training, not after it
    json metrics;
    ex::Report html;
    const auto t0 = clock_type::now();
    const int rc = tg::with_device(o.device, [&]<class D>() { return PinnRun<D>(o, metrics, html).run(); });
    if (o.check_golden) return rc;
    metrics["seconds"] = seconds_since(t0);
    ex::write_metrics_and_report(o.out, metrics.dump(2) + "\n", html.document("tapegrad: a physics-informed network for the Poisson problem"), o.quiet,
                                 seconds_since(t0));
    return rc;
  });
}
