// cnn_fashion_mnist: a small convolutional network (cnn.hpp: two 3x3 convolutions with 2x2 max pooling,
// a dense layer, a linear head) trained on the real Fashion-MNIST with tapegrad: tg::conv and tg::max_pool
// (oneDNN's convolutions on the CPU, cuDNN's on CUDA), AdamW with a cosine decay, the step compiled with
// tg::compile. The run is the examples' classifier run (examples/common/classifier.hpp: images/sec, the
// test accuracy after every epoch, the report with the training curve, sample predictions and the confusion
// matrix); this file says what is the CNN's own: its options, its table, its optimizer, and the report's
// fifth section, the first layer's filters and feature maps. Its first-batch loss and gradient norm are
// checked against the same model in JAX + Flax (scripts/cnn_reference.py, cnn_golden.json).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/classifier.hpp"
#include "cnn.hpp"

namespace ex = examples;

/// The CNN's hooks for ex::ClassifierRun.
struct CnnModel {
  using Config = cnn::Config;
  using OptimConfig = cnn::OptimConfig;
  template <class D>
  using Params = cnn::Cnn<D>;
  static constexpr const char* program = "cnn_fashion_mnist";
  static constexpr const char* title = "tapegrad: a convolutional network on Fashion-MNIST";
  static constexpr const char* reference = "JAX + Flax";
  static constexpr const char* reference_script = "scripts/cnn_reference.py";
  static constexpr const char* default_out = "cnn_out";
  static constexpr int default_epochs = 8;
  static constexpr bool uses_key = false;

  static void add_options(CLI::App& app, Config& m, OptimConfig& o) {
    app.add_option("--conv1", m.conv1, "features of the first convolution")->check(CLI::Range(1, 4096))->capture_default_str();
    app.add_option("--conv2", m.conv2, "features of the second convolution")->check(CLI::Range(1, 4096))->capture_default_str();
    app.add_option("--dense", m.dense, "width of the dense layer")->check(CLI::Range(1, 16384))->capture_default_str();
    app.add_option("--lr", o.peak_lr, "peak learning rate of the cosine decay")->check(CLI::PositiveNumber)->capture_default_str();
    app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  }
  static std::string check(const Config&) { return {}; }

  template <class D>
  static Params<D> init(tg::random::Key key, const Config& c) { return cnn::init_params<D>(key, c); }
  static std::string describe(const Config& c) { return "A convolutional network (" + c.str() + ")"; }
  static void model_rows(ex::Table& t, const Config& m) {
    const auto k = std::to_string(m.kernel) + "x" + std::to_string(m.kernel);
    t.rows.push_back({"block 1", "conv " + k + " \"SAME\", 1 -> " + std::to_string(m.conv1) + " features, ReLU; max_pool 2x2, stride 2"});
    t.rows.push_back({"block 2", "conv " + k + " \"SAME\", " + std::to_string(m.conv1) + " -> " + std::to_string(m.conv2) +
                                     " features, ReLU; max_pool 2x2, stride 2"});
    t.rows.push_back({"head", "flatten (" + std::to_string(m.flat()) + "), dense " + std::to_string(m.dense) + " ReLU, dense " + std::to_string(m.classes)});
    t.rows.push_back({"layouts", "images NHWC, kernels HWIO (Flax's)"});
  }
  static bool golden_fits(const ex::json& g, const Config& m) {
    return g.at("conv1") == m.conv1 && g.at("conv2") == m.conv2 && g.at("kernel") == m.kernel && g.at("dense") == m.dense;
  }

  template <class C, class... A>
  static auto loss_with_metrics(const A&... a) { return cnn::loss_with_metrics<C>(a...); }
  static void schedule(OptimConfig& o, std::int64_t total) { o.total_steps = total; }
  static auto make_optimizer(const OptimConfig& o) { return cnn::make_optimizer(o); }
  static std::string optimizer_text(const OptimConfig& o) {
    return "adamw(cosine_decay_schedule(" + ex::fmt("%g", o.peak_lr) + ", " + std::to_string(o.total_steps) + ", 0.01), weight_decay=" +
           ex::fmt("%g", o.weight_decay) + ")";
  }
  static ex::json optim_metrics(const OptimConfig& o) {
    return {{"peak_lr", o.peak_lr}, {"weight_decay", o.weight_decay}, {"total_steps", o.total_steps}};
  }
  template <class C, class... A>
  static auto train_step(const A&... a) { return cnn::train_step<C>(a...); }
  template <class... A>
  static auto evaluate(const A&... a) { return cnn::evaluate(a...); }

  static void throughput(ex::Table&, ex::json&, double, const Config&) {}
  static std::string summary(double images_per_sec, const Config&) { return ex::grouped(images_per_sec) + " images/sec measured"; }

  /// 5. The first convolution's filters and their pooled ReLU feature maps for one test image.
  template <class D>
  static void inspect(ex::Log& log, ex::json& metrics, const Params<D>& params, const Config& c, const std::vector<std::uint8_t>& px,
                      const std::vector<std::uint8_t>& labels, std::int64_t image) {
    log.heading("5. What the first layer sees", "The first convolution's " + std::to_string(c.conv1) + " trained 3x3 filters (their "
                                                "positive weights, dark: large) and their pooled ReLU feature maps (14x14) for test image " +
                                                std::to_string(image) + ".");
    const std::uint8_t* pixels = px.data() + image * 784;
    const auto x = tg::from_vector<D>(std::vector<float>(pixels, pixels + 784), {1, 784}) * (1.0f / 255.0f);
    tg::Tensor<float, D> maps;
    (void)cnn::forward<float>(params, x, c, &maps);
    const auto m = maps.to_vector();  // (1, 14, 14, conv1)
    const auto w = params.conv1.w.to_vector();  // (3, 3, 1, conv1)
    const int F = static_cast<int>(c.conv1), K = static_cast<int>(c.kernel), S = static_cast<int>(c.image / 2);
    std::string html = ex::img_tag(ex::image_grid({{pixels, 255, 255, 255}}, 1, 2),
                                   "image " + std::to_string(image) + ": " + ex::class_names[labels[static_cast<std::size_t>(image)]]);
    ex::json filters = ex::json::array();
    for (int f = 0; f < F; ++f) {
      std::vector<float> k(static_cast<std::size_t>(K * K)), fmap(static_cast<std::size_t>(S * S));
      for (int i = 0; i < K * K; ++i) k[static_cast<std::size_t>(i)] = std::max(0.0f, w[static_cast<std::size_t>(i * F + f)]);
      for (int i = 0; i < S * S; ++i) fmap[static_cast<std::size_t>(i)] = m[static_cast<std::size_t>(i * F + f)];
      html += ex::img_tag(ex::heatmap(k, K, K, 12), "filter " + std::to_string(f));
      html += ex::img_tag(ex::heatmap(fmap, S, S, 4), "map " + std::to_string(f));
      filters.push_back(k);
    }
    log.html("<div>" + html + "</div>");
    metrics["features"] = {{"test_index", image}, {"filters_positive_part", filters}};
  }
};

int main(int argc, char** argv) {
  return ex::classifier_main<CnnModel>(argc, argv, "cnn_fashion_mnist: a small convolutional network trained on Fashion-MNIST with tapegrad; "
                                                   "writes report.html and metrics.json under --out");
}
