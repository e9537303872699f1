// vit_fashion_mnist: a small Vision Transformer (vit.hpp) trained on the real Fashion-MNIST with
// tapegrad: 16 tokens of 7x7 pixels, pre-norm attention blocks, AdamW with a warm-up cosine schedule and
// global-norm clipping, the step compiled with tg::compile. It measures tokens/sec (16 tokens per image,
// forward and backward, warm-up excluded, the device synchronised before each clock stops), evaluates on
// the whole test set after every epoch, and writes a report with the training curve, sample predictions,
// the confusion matrix and each head's attention for a test image. Its first-batch loss and gradient norm
// are checked against the same model in JAX (scripts/vit_reference.py, vit_golden.json).
// Built by g++ as vit_fashion_mnist and by nvcc as vit_fashion_mnist_cuda (this file, included by the .cu).
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
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../fashion_mnist/dataset.hpp"
#include "../fashion_mnist/outputs.hpp"
#include "../fashion_mnist/report.hpp"
#include "vit.hpp"

namespace fm = fashion_mnist;
using json = nlohmann::ordered_json;

namespace {

struct Options {
  vit::Config model;
  vit::OptimConfig optim;
  int epochs = 20;
  std::int64_t batch = 128;
  int max_steps = 0;  ///< stop after this many steps (0: all epochs), for smoke tests
  int log_every = 50;
  std::uint32_t seed = 0;
  std::string dtype = "f32", device = "auto", data_dir, out = "vit_out", golden = VIT_GOLDEN, export_init;
  bool check_golden = false, quiet = false, no_download = false, augment = true;
};

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

const std::vector<std::string> class_names = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                              "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

/// SHA-256 over every parameter's float32 bytes, leaves in tree order (= the safetensors file's order):
/// the fingerprint that ties the JAX golden values to these initial parameters.
template <class P>
std::string params_digest(const P& params) {
  std::vector<std::uint8_t> bytes;
  tg::tree_for_each([&](const std::string&, const auto& leaf) {
    if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(leaf)>, bool>) {
      const auto v = leaf.to_vector();
      const auto* p = reinterpret_cast<const std::uint8_t*>(v.data());
      bytes.insert(bytes.end(), p, p + v.size() * sizeof(float));
    }
  }, params);
  return fm::hex_digest(EVP_sha256(), bytes);
}

template <class P>
std::int64_t count_params(const P& params) {
  std::int64_t n = 0;
  tg::tree_for_each([&](const std::string&, const auto& leaf) {
    if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(leaf)>, bool>) n += leaf.size();
  }, params);
  return n;
}

/// A heatmap of a (rows, cols) matrix of weights in [0, max], each cell `scale` pixels, white to dark blue.
fm::Image heatmap(const std::vector<float>& w, int rows, int cols, int scale) {
  fm::Image img(cols * scale, rows * scale);
  const float top = std::max(1e-12f, *std::max_element(w.begin(), w.end()));
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const float t = std::clamp(w[static_cast<std::size_t>(r * cols + c)] / top, 0.0f, 1.0f);
      const auto shade = [t](int lo, int hi) { return static_cast<std::uint8_t>(std::lround(lo + (hi - lo) * t)); };
      for (int y = 0; y < scale; ++y)
        for (int x = 0; x < scale; ++x) img.set(c * scale + x, r * scale + y, shade(255, 8), shade(255, 48), shade(255, 107));
    }
  return img;
}

std::string img_tag(const fm::Image& img, const std::string& caption) {
  return "<figure style=\"display:inline-block;margin:4px;text-align:center\"><img style=\"image-rendering:pixelated;width:" +
         std::to_string(std::min(img.width, 160)) + "px\" src=\"" + fm::png_data_uri(fm::encode_png(img)) + "\"><figcaption>" +
         fm::html_escape(caption) + "</figcaption></figure>";
}

enum class Golden { match, mismatch, other_run };

/// The first batch at the initial parameters beside the JAX reference's numbers (vit_golden.json):
/// whether loss (1e-6 relative), gradient global norm (1e-5 relative) and parameters match, or the
/// golden file was made for other sizes, batch or seed (`why` says which).
template <class D>
Golden beside_jax(const Options& o, const vit::Vit<D>& params, const tg::data::Batch<D>& first, fm::Table& t, json& metrics, std::string& why) {
  std::ifstream f(o.golden);
  if (!f) {
    why = "cannot read the golden values " + o.golden + " (--golden: the vit_golden.json of this source tree)";
    return Golden::other_run;
  }
  const json g = json::parse(f);
  const auto& gc = g.at("config");
  if (gc.at("dim") != o.model.dim || gc.at("heads") != o.model.heads || gc.at("layers") != o.model.layers || gc.at("mlp") != o.model.mlp ||
      gc.at("batch") != o.batch || gc.at("seed") != o.seed) {
    why = "the golden values (" + o.golden + ") were made for " + gc.dump() + ", not this run's sizes, batch and seed; "
          "regenerate them for these with scripts/vit_reference.py golden";
    return Golden::other_run;
  }
  auto loss_fn = [&o](const vit::Vit<D>& p, const vit::Tensor<D>& x, const vit::Labels<D>& y) {
    return vit::loss_with_metrics<float>(p, x, y, o.model);
  };
  const auto [la, grads] = tg::value_and_grad(loss_fn, tg::has_aux)(params, first.x, first.y);
  const double loss = la.first.item(), norm = tg::global_norm(grads).item();
  const double want_loss = g.at("loss"), want_norm = g.at("grad_global_norm");
  const double loss_err = std::fabs(loss - want_loss) / std::fabs(want_loss), norm_err = std::fabs(norm - want_norm) / std::fabs(want_norm);
  const std::string digest = params_digest(params), want_digest = g.at("params_digest");
  t.rows.push_back({"initial parameters (SHA-256 of the f32 bytes)", digest.substr(0, 16) + "...", want_digest.substr(0, 16) + "...",
                    digest == want_digest ? "identical" : "DIFFERENT"});
  t.rows.push_back({"first-batch loss", fm::fmt("%.9f", loss), fm::fmt("%.9f", want_loss), fm::fmt("%.2e", loss_err)});
  t.rows.push_back({"gradient global norm", fm::fmt("%.9f", norm), fm::fmt("%.9f", want_norm), fm::fmt("%.2e", norm_err)});
  const bool ok = digest == want_digest && loss_err <= 1e-6 && norm_err <= 1e-5;
  metrics["beside_jax"] = {{"loss", loss}, {"jax_loss", want_loss}, {"loss_rel_err", loss_err}, {"grad_norm", norm},
                           {"jax_grad_norm", want_norm}, {"grad_norm_rel_err", norm_err}, {"params_identical", digest == want_digest},
                           {"jax", g.value("jax", "?")}, {"ok", ok}};
  return ok ? Golden::match : Golden::mismatch;
}

template <class D>
int run(const Options& o, const fm::Loaded& data, json& metrics, fm::Report& report) {
  using Params = vit::Vit<D>;
  const std::string device = tg::zeros<float, D>({1}).device_name();
  auto say = [&](const std::string& s) {
    if (!o.quiet) std::cout << s << "\n";
    report.text(s);
  };
  auto show = [&](const fm::Table& t) {
    if (!o.quiet) t.print(std::cout);
    report.table(t);
  };
  auto heading = [&](const std::string& title, const std::string& intro) {
    if (!o.quiet) std::cout << "\n== " << title << "\n" << intro << "\n";
    report.section(title, intro);
  };

  // The data: the training set in NumPy's order (np.random.default_rng(seed), one permutation per epoch)
  // and, from the second epoch on, with half of the images mirrored left to right (those whose rank in a
  // second permutation is below N / 2), a standard augmentation for Fashion-MNIST. The first epoch sees the
  // images as they are, so its first batch is the one the JAX reference computes.
  tg::random::numpy::Generator order_rng(o.seed);
  const std::int64_t n_train = data.train.labels.size();
  auto epoch_batches = [&](bool augment) {
    const auto order = order_rng.permutation(n_train);
    if (!augment) return tg::data::fixed_batches<D>(data.train.images, data.train.labels, o.batch, 10, std::span<const std::int64_t>(order));
    const auto rank = order_rng.permutation(n_train);
    auto px = data.train.images.to_vector();
    for (std::int64_t i = 0; i < n_train; ++i)
      if (rank[static_cast<std::size_t>(i)] < n_train / 2)
        for (std::size_t r = 0; r < 28; ++r) std::reverse(px.begin() + static_cast<std::ptrdiff_t>(i * 784 + r * 28), px.begin() + static_cast<std::ptrdiff_t>(i * 784 + r * 28 + 28));
    return tg::data::fixed_batches<D>(tg::from_vector(px, data.train.images.shape()), data.train.labels, o.batch, 10,
                                      std::span<const std::int64_t>(order));
  };
  auto train = epoch_batches(false);
  const auto test = tg::data::fixed_batches<D>(data.test.images, data.test.labels, 1000, 10);  // all 10,000, in file order
  Params params = vit::init_params<D>(tg::random::key(o.seed), o.model);

  if (!o.export_init.empty()) {
    tg::io::save_safetensors(o.export_init, params, {{"model", o.model.str()}, {"seed", std::to_string(o.seed)}});
    std::cout << "wrote the initial parameters to " << o.export_init << " (" << count_params(params) << " floats, SHA-256 of the f32 bytes "
              << params_digest(params) << ")\n";
    return 0;
  }

  heading("1. The model", "A Vision Transformer (" + o.model.str() + "), on " + device + ", compute " + o.dtype + ".");
  {
    fm::Table t{"model", {"item", "value"}, {}};
    t.rows.push_back({"tokens per image", std::to_string(o.model.tokens()) + " patches of " + std::to_string(o.model.patch) + "x" +
                                              std::to_string(o.model.patch) + " pixels, linearly embedded, plus a learned position embedding"});
    t.rows.push_back({"blocks", std::to_string(o.model.layers) + " x pre-norm [LayerNorm, " + std::to_string(o.model.heads) +
                                    "-head self-attention, residual; LayerNorm, GELU MLP " + std::to_string(o.model.dim) + "-" +
                                    std::to_string(o.model.mlp) + "-" + std::to_string(o.model.dim) + ", residual]"});
    t.rows.push_back({"head", "LayerNorm, mean over the tokens, linear to 10 classes"});
    t.rows.push_back({"parameters", fm::grouped(static_cast<double>(count_params(params)))});
    t.rows.push_back({"dropout", fm::fmt("%g", o.model.dropout)});
    show(t);
  }

  heading("2. Beside JAX", "The first batch at the initial parameters, through tapegrad and through the same model in JAX + Optax "
                           "(scripts/vit_reference.py, from these parameters exported with --export-init).");
  fm::Table bj{"first batch (f32): tapegrad vs JAX", {"quantity", "tapegrad", "JAX", "relative difference"}, {}};
  std::string why;
  const Golden golden = beside_jax(o, params, train[0], bj, metrics, why);
  if (golden == Golden::other_run) {
    say("Skipped: " + why + ".");
    if (o.check_golden) throw fm::DataError("--check-golden: " + why);
  } else {
    show(bj);
    say(golden == Golden::match ? "Matches: loss within 1e-6 and gradient norm within 1e-5 relative, from identical parameters."
                                : "DOES NOT MATCH the JAX reference (loss 1e-6, gradient norm 1e-5 relative, identical parameters required).");
  }
  if (o.check_golden) return golden == Golden::match ? 0 : 1;

  // 3. Training ---------------------------------------------------------------------------------------
  const std::int64_t steps_per_epoch = static_cast<std::int64_t>(train.size());
  std::int64_t total = steps_per_epoch * o.epochs;
  if (o.max_steps > 0) total = std::min<std::int64_t>(total, o.max_steps);
  vit::OptimConfig oc = o.optim;
  oc.total_steps = total;
  oc.warmup_steps = std::min<std::int64_t>(oc.warmup_steps, std::max<std::int64_t>(1, total / 10));
  const auto optimizer = vit::make_optimizer(oc);
  using State = decltype(optimizer.init(std::declval<Params>()));
  State state = optimizer.init(params);
  using Key = tg::Tensor<std::uint32_t, D>;
  auto step_f32 = tg::compile([&](const Params& p, const State& s, const vit::Tensor<D>& x, const vit::Labels<D>& y, const Key& k) {
    return vit::train_step<float>(optimizer, o.model, p, s, x, y, k);
  });
  auto step_bf16 = tg::compile([&](const Params& p, const State& s, const vit::Tensor<D>& x, const vit::Labels<D>& y, const Key& k) {
    return vit::train_step<tg::bf16>(optimizer, o.model, p, s, x, y, k);
  });
  auto evaluate = tg::compile([&](const Params& p, const vit::Tensor<D>& x, const vit::Labels<D>& y) { return vit::evaluate(p, x, y, o.model); });
  auto test_accuracy = [&](std::vector<std::int32_t>* predicted, double* loss) {
    std::int64_t correct = 0, n = 0;
    double loss_sum = 0;
    for (const auto& b : test) {
      const auto [l, pred] = evaluate(params, b.x, b.y);
      const auto pv = pred.to_vector(), yv = b.y.to_vector();
      loss_sum += l.item();
      for (std::size_t i = 0; i < pv.size(); ++i) correct += pv[i] == yv[i];
      n += static_cast<std::int64_t>(pv.size());
      if (predicted) predicted->insert(predicted->end(), pv.begin(), pv.end());
    }
    if (loss) *loss = loss_sum / static_cast<double>(n);
    return static_cast<double>(correct) / static_cast<double>(n);
  };

  heading("3. Training", std::to_string(o.epochs) + " epochs of " + std::to_string(steps_per_epoch) + " steps (batch " + std::to_string(o.batch) +
                             "), compiled step (tg::compile), compute " + o.dtype + ". chain(clip_by_global_norm(" + fm::fmt("%g", oc.clip) +
                             "), adamw(warmup_cosine_decay_schedule(0, " + fm::fmt("%g", oc.peak_lr) + ", " + std::to_string(oc.warmup_steps) +
                             ", " + std::to_string(oc.total_steps) + "), weight_decay=" + fm::fmt("%g", oc.weight_decay) +
                             ")). Test accuracy over all 10,000 test images after each epoch.");
  const auto base_key = tg::random::key(o.seed + 1);
  const Key fixed_key = tg::random::key_data<D>(base_key);
  std::vector<double> h_step, h_loss, h_acc, e_epoch, e_test, e_seconds;
  double train_seconds = 0;
  std::int64_t timed_steps = 0, step = 0;
  const auto wall0 = clock_type::now();
  fm::Progress progress("training", static_cast<int>(total), o.quiet);
  std::string status;
  for (int epoch = 1; epoch <= o.epochs && step < total; ++epoch) {
    if (epoch > 1) train = epoch_batches(o.augment);  // outside the timed region: the next epoch's batches, moved to the device
    clock_type::time_point t0 = clock_type::now();
    std::int64_t timed_here = 0;
    vit::Metrics<D> last;
    for (const auto& b : train) {
      if (step == total) break;
      ++step;
      const Key key = o.model.dropout > 0 ? tg::random::key_data<D>(tg::random::fold_in(base_key, static_cast<std::uint32_t>(step))) : fixed_key;
      auto [p, s, m] = o.dtype == "bf16" ? step_bf16(std::move(params), std::move(state), b.x, b.y, key)
                                         : step_f32(std::move(params), std::move(state), b.x, b.y, key);
      params = std::move(p), state = std::move(s), last = m;
      if (step == 1) {  // the first step records the compiled step: the warm-up, not timed
        (void)m.loss.item();
        t0 = clock_type::now();
      } else {
        ++timed_here;
      }
      const bool log = step % o.log_every == 0 || step == 1 || step == total;
      if (log) {
        h_step.push_back(static_cast<double>(step)), h_loss.push_back(m.loss.item()), h_acc.push_back(m.accuracy.item());
        if (!std::isfinite(h_loss.back()))
          throw std::runtime_error("the training loss is " + fm::fmt("%g", h_loss.back()) + " at step " + std::to_string(step) +
                                   ": the training diverged; lower --lr (now " + fm::fmt("%g", oc.peak_lr) + ")");
        status = "loss " + fm::fmt("%.4f", h_loss.back()) + "  acc " + fm::fmt("%.3f", h_acc.back());
      }
      progress.update(static_cast<int>(step), status, log);
    }
    (void)last.loss.item();  // synchronise before the clock stops
    const double seconds = seconds_since(t0);
    train_seconds += seconds, timed_steps += timed_here;
    e_epoch.push_back(epoch), e_seconds.push_back(seconds_since(wall0)), e_test.push_back(test_accuracy(nullptr, nullptr));
    if (!o.quiet) std::printf("  epoch %d: test accuracy %.4f (%.1f s since the start)\n", epoch, e_test.back(), e_seconds.back());
  }
  const double wall = seconds_since(wall0);
  const double eps = timed_steps > 0 ? static_cast<double>(timed_steps * o.batch) / train_seconds : 0.0;
  const double tps = eps * static_cast<double>(o.model.tokens());
  {
    fm::Table hist{"training curve", {"step", "loss", "batch accuracy"}, {}};
    json history = json::array();
    for (std::size_t i = 0; i < h_step.size(); ++i) {
      hist.rows.push_back({fm::fmt("%.0f", h_step[i]), fm::fmt("%.4f", h_loss[i]), fm::fmt("%.4f", h_acc[i])});
      history.push_back({{"step", h_step[i]}, {"loss", h_loss[i]}, {"accuracy", h_acc[i]}});
    }
    if (!o.quiet) hist.print(std::cout);
    report.table(hist);
    report.html(fm::svg_curve(h_step, h_loss, h_acc));
    fm::Table acc{"accuracy curve (test set, after each epoch)", {"epoch", "test accuracy", "seconds since the start of training"}, {}};
    json curve = json::array();
    for (std::size_t i = 0; i < e_epoch.size(); ++i) {
      acc.rows.push_back({fm::fmt("%.0f", e_epoch[i]), fm::fmt("%.4f", e_test[i]), fm::fmt("%.1f", e_seconds[i])});
      curve.push_back({{"epoch", e_epoch[i]}, {"test_accuracy", e_test[i]}, {"seconds", e_seconds[i]}});
    }
    show(acc);
    fm::Table tp{"throughput (measured)", {"measure", "value"}, {}};
    tp.rows.push_back({"examples/sec (" + std::to_string(timed_steps) + " steps after 1 warm-up step)", fm::grouped(eps)});
    tp.rows.push_back({"tokens/sec (" + std::to_string(o.model.tokens()) + " tokens per image, forward and backward)", fm::grouped(tps)});
    tp.rows.push_back({"training time (steps only)", fm::fmt("%.1f s", train_seconds)});
    tp.rows.push_back({"wall time of the training section (with data order and evaluations)", fm::fmt("%.1f s", wall)});
    show(tp);
    say("Timing: the clock runs over the training steps only; it starts after the first (recording) step and after each epoch's "
        "batches are on the device, and stops after the device is synchronised (a metric read back).");
    metrics["history"] = history;
    metrics["accuracy_curve"] = curve;
    metrics["throughput"] = {{"examples_per_sec", eps}, {"tokens_per_sec", tps}, {"tokens_per_example", o.model.tokens()},
                             {"timed_steps", timed_steps}, {"train_seconds", train_seconds}, {"wall_seconds", wall}};
  }

  // 4. Evaluation -------------------------------------------------------------------------------------
  heading("4. Evaluation", "All 10,000 test images.");
  std::vector<std::int32_t> predicted;
  double test_loss = 0;
  const double test_acc = test_accuracy(&predicted, &test_loss);
  {
    fm::Table t{"test set", {"images", "loss", "accuracy"}, {}};
    t.rows.push_back({fm::grouped(static_cast<double>(predicted.size())), fm::fmt("%.4f", test_loss), fm::fmt("%.4f", test_acc)});
    show(t);
    metrics["test"] = {{"images", predicted.size()}, {"loss", test_loss}, {"accuracy", test_acc}};
    const auto truth = data.test.labels.to_vector();
    const auto px = data.test.images.to_vector();
    // 25 sample test images, as the MLP example: np.random.default_rng(7).choice(10000, 25, replace=False).
    const auto pick = tg::random::numpy::default_rng(7).choice(static_cast<std::int64_t>(truth.size()), 25);
    std::string figures = "<div class=\"grid\">";
    fm::Table s{"sample predictions", {"test index", "true", "predicted"}, {}};
    for (const auto i : pick) {
      const auto k = static_cast<std::size_t>(i);
      const bool ok = predicted[k] == truth[k];
      const std::uint8_t* p = px.data() + k * 784;
      figures += std::string("<figure class=\"") + (ok ? "ok" : "bad") + "\"><img src=\"" +
                 fm::png_data_uri(fm::encode_png(fm::image_grid({{p, 255, 255, 255}}, 1, 3))) + "\"><figcaption>" +
                 fm::html_escape(class_names[static_cast<std::size_t>(predicted[k])]) + "</figcaption></figure>";
      s.rows.push_back({std::to_string(i), class_names[truth[k]], class_names[static_cast<std::size_t>(predicted[k])] + (ok ? "" : "  (wrong)")});
    }
    show(s);
    report.html(figures + "</div>");
    std::vector<std::vector<double>> confusion(10, std::vector<double>(10, 0.0));
    for (std::size_t i = 0; i < predicted.size(); ++i) confusion[truth[i]][static_cast<std::size_t>(predicted[i])] += 1;
    fm::Table cm{"confusion matrix (rows: true class; fraction predicted as each column)", {"true \\ predicted"}, {}};
    for (int j = 0; j < 10; ++j) cm.header.push_back(std::to_string(j));
    for (std::size_t r = 0; r < 10; ++r) {
      double row_total = 0;
      for (double v : confusion[r]) row_total += v;
      std::vector<std::string> row{std::to_string(r) + " " + class_names[r]};
      for (double& v : confusion[r]) v /= std::max(1.0, row_total), row.push_back(fm::fmt("%.2f", v));
      cm.rows.push_back(row);
    }
    show(cm);
    report.html(fm::svg_heatmap(confusion, class_names));

    // 5. Attention ------------------------------------------------------------------------------------
    heading("5. Attention", "Each head's softmax weights in the last block for test image " + std::to_string(pick[0]) +
                                " (rows: the 16 query patches, columns: the 16 key patches, both in reading order), and the "
                                "attention each patch receives averaged over the queries, drawn over the image.");
    const auto x = tg::from_vector<D>(std::vector<float>(px.begin() + static_cast<std::ptrdiff_t>(pick[0] * 784),
                                                         px.begin() + static_cast<std::ptrdiff_t>((pick[0] + 1) * 784)),
                                      {1, 784}) * (1.0f / 255.0f);
    std::vector<vit::Tensor<D>> weights;
    (void)vit::forward<float>(params, x, o.model, {}, &weights);
    const auto w = weights.back().to_vector();  // (1, heads, 16, 16)
    const int T = static_cast<int>(o.model.tokens()), g = static_cast<int>(o.model.image / o.model.patch);
    std::string html;
    html += img_tag(fm::image_grid({{px.data() + pick[0] * 784, 255, 255, 255}}, 1, 2),
                    "image " + std::to_string(pick[0]) + ": " + class_names[truth[static_cast<std::size_t>(pick[0])]]);
    json heads = json::array();
    for (int h = 0; h < static_cast<int>(o.model.heads); ++h) {
      const std::vector<float> m(w.begin() + h * T * T, w.begin() + (h + 1) * T * T);
      html += img_tag(heatmap(m, T, T, 8), "head " + std::to_string(h) + ": query x key");
      std::vector<float> received(static_cast<std::size_t>(T), 0.0f);
      for (int q = 0; q < T; ++q)
        for (int k = 0; k < T; ++k) received[static_cast<std::size_t>(k)] += m[static_cast<std::size_t>(q * T + k)] / static_cast<float>(T);
      // The image tinted by the attention each patch receives.
      fm::Image over(28 * 3, 28 * 3);
      const float top = *std::max_element(received.begin(), received.end());
      for (int y = 0; y < 28 * 3; ++y)
        for (int xx = 0; xx < 28 * 3; ++xx) {
          const int py = y / 3, pxl = xx / 3, tok = (py / o.model.patch) * g + pxl / o.model.patch;
          const float a = received[static_cast<std::size_t>(tok)] / top, v = px[static_cast<std::size_t>(pick[0] * 784 + py * 28 + pxl)] / 255.0f;
          over.set(xx, y, static_cast<std::uint8_t>(255 * (1 - v) * (1 - 0.6f * a)), static_cast<std::uint8_t>(255 * (1 - v) * (1 - 0.3f * a)),
                   static_cast<std::uint8_t>(255 * (1 - v)));
        }
      html += img_tag(over, "head " + std::to_string(h) + ": attention received");
      heads.push_back(m);
    }
    report.html("<div>" + html + "</div>");
    metrics["attention"] = {{"test_index", pick[0]}, {"block", o.model.layers - 1}, {"heads", heads}};
  }
  metrics["config"] = {{"model", o.model.str()}, {"epochs", o.epochs}, {"batch", o.batch}, {"dtype", o.dtype}, {"device", device},
                       {"peak_lr", oc.peak_lr}, {"weight_decay", oc.weight_decay}, {"warmup_steps", oc.warmup_steps}, {"total_steps", oc.total_steps}};
  say("Final test accuracy " + fm::fmt("%.4f", test_acc) + " after " + std::to_string(step) + " steps; " + fm::grouped(tps) +
      " tokens/sec measured (" + fm::grouped(eps) + " images/sec).");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"vit_fashion_mnist: a small Vision Transformer trained on Fashion-MNIST with tapegrad; writes report.html and "
               "metrics.json under --out"};
  app.add_option("--epochs", o.epochs, "training epochs")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--batch-size", o.batch, "examples per batch")->check(CLI::Range(1, 60000))->capture_default_str();
  app.add_option("--max-steps", o.max_steps, "stop after this many steps (0: all the epochs)")->check(CLI::Range(0, 100000000))->capture_default_str();
  app.add_option("--dim", o.model.dim, "token width")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--heads", o.model.heads, "attention heads (must divide --dim)")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--layers", o.model.layers, "transformer blocks")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--mlp", o.model.mlp, "hidden width of each block's MLP")->check(CLI::Range(1, 16384))->capture_default_str();
  app.add_option("--dropout", o.model.dropout, "dropout rate after attention and MLP in training")->check(CLI::Range(0.0, 0.99))->capture_default_str();
  app.add_option("--lr", o.optim.peak_lr, "peak learning rate of the warm-up cosine schedule")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--weight-decay", o.optim.weight_decay, "AdamW weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--warmup-steps", o.optim.warmup_steps, "warm-up steps (at most a tenth of the run)")->check(CLI::Range(1, 100000000))->capture_default_str();
  app.add_option("--log-every", o.log_every, "log the metrics every N steps")->check(CLI::Range(1, 100000000))->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the initial parameters (key(seed)) and of the data order (np.random.default_rng(seed))")->capture_default_str();
  app.add_option("--dtype", o.dtype, "compute dtype (parameters stay f32)")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--device", o.device, "auto: CUDA when a GPU is there, else the CPU")->check(CLI::IsMember({"auto", "cpu", "cuda"}))->capture_default_str();
  app.add_option("--data-dir", o.data_dir, "directory searched first for the four Fashion-MNIST .gz files");
  app.add_option("--out", o.out, "output directory")->capture_default_str();
  app.add_option("--golden", o.golden, "the JAX reference's first-batch values (scripts/vit_reference.py golden)")->capture_default_str();
  app.add_option("--export-init", o.export_init, "write the initial parameters to this safetensors file and exit (the JAX reference's input)");
  app.add_flag("--check-golden", o.check_golden, "only compare the first batch with the JAX golden values; exit 0 when they match, 1 when not");
  app.add_flag("--no-download", o.no_download, "never download the data set");
  app.add_flag("!--no-augment", o.augment, "train without mirroring half of the images from the second epoch on");
  app.add_flag("--quiet", o.quiet, "print nothing but errors");
  CLI11_PARSE(app, argc, argv);
  if (o.model.dim % o.model.heads != 0) {
    std::cerr << "vit_fashion_mnist: --heads " << o.model.heads << " does not divide --dim " << o.model.dim << "\n";
    return 2;
  }
  try {
    bool use_cuda = false;
#if defined(TG_WITH_CUDA)
    use_cuda = o.device == "cuda" || (o.device == "auto" && tg::cuda::available());
    if (use_cuda && !tg::cuda::available())
      throw fm::DataError("--device cuda: no CUDA device here (" + tg::cuda::describe_devices() + "); use --device cpu or auto");
#else
    if (o.device == "cuda") throw fm::DataError("--device cuda: this build has no CUDA (built by g++); build vit_fashion_mnist_cuda with nvcc");
#endif
    const fm::Loaded data = fm::find_and_load(o.data_dir, !o.no_download, true, o.quiet);
    if (!o.check_golden && o.export_init.empty()) fm::check_output_dir(o.out);  // before training, not after it
    json metrics;
    fm::Report report;
    const auto t0 = clock_type::now();
#if defined(TG_WITH_CUDA)
    const int rc = use_cuda ? run<tg::Cuda>(o, data, metrics, report) : run<tg::Cpu>(o, data, metrics, report);
#else
    (void)use_cuda;
    const int rc = run<tg::Cpu>(o, data, metrics, report);
#endif
    if (o.check_golden || !o.export_init.empty()) return rc;
    metrics["seconds"] = seconds_since(t0);
    const std::filesystem::path dir(o.out);
    std::filesystem::create_directories(dir);
    fm::write_whole(dir / "metrics.json", metrics.dump(2) + "\n");
    fm::write_whole(dir / "report.html", report.document("tapegrad: a Vision Transformer on Fashion-MNIST"));
    if (!o.quiet) std::cout << "wrote " << (dir / "report.html").string() << " and metrics.json (" << fm::fmt("%.1f", seconds_since(t0)) << " s)\n";
    return rc;
  } catch (const fm::DataError& e) {
    std::cerr << "vit_fashion_mnist: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "vit_fashion_mnist: error: " << e.what() << "\n";
    return 1;
  }
}
