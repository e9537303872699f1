// vit_fashion_mnist: a small Vision Transformer (vit.hpp) trained on the real Fashion-MNIST with
// tapegrad: 16 tokens of 7x7 pixels, pre-norm attention blocks, AdamW with a warm-up cosine schedule and
// global-norm clipping, the step compiled with tg::compile. The run is the examples' classifier run
// (examples/common/classifier.hpp: throughput, the test accuracy after every epoch, the report with the
// training curve, sample predictions and the confusion matrix); this file says what is the ViT's own: its
// options, its table, its optimizer, dropout keys, tokens/sec (16 tokens per image, forward and backward),
// and the report's fifth section, each head's attention for a test image. Its first-batch loss and
// gradient norm are checked against the same model in JAX (scripts/vit_reference.py, vit_golden.json).
// Built by g++ as vit_fashion_mnist and by nvcc as vit_fashion_mnist_cuda (this file, included by the .cu).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <tapegrad/tapegrad.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/classifier.hpp"
#include "vit.hpp"

namespace ex = examples;

/// The ViT's hooks for ex::ClassifierRun.
struct VitModel {
  using Config = vit::Config;
  using OptimConfig = vit::OptimConfig;
  template <class D>
  using Params = vit::Vit<D>;
  static constexpr const char* program = "vit_fashion_mnist";
  static constexpr const char* title = "tapegrad: a Vision Transformer on Fashion-MNIST";
  static constexpr const char* reference = "JAX + Optax";
  static constexpr const char* reference_script = "scripts/vit_reference.py";
  static constexpr const char* default_out = "vit_out";
  static constexpr int default_epochs = 20;
  static constexpr bool uses_key = true;

  static void add_options(CLI::App& app, Config& m, OptimConfig& o) {
    app.add_option("--dim", m.dim, "token width")->check(CLI::Range(1, 4096))->capture_default_str();
    app.add_option("--heads", m.heads, "attention heads (must divide --dim)")->check(CLI::Range(1, 256))->capture_default_str();
    app.add_option("--layers", m.layers, "transformer blocks")->check(CLI::Range(1, 64))->capture_default_str();
    app.add_option("--mlp", m.mlp, "hidden width of each block's MLP")->check(CLI::Range(1, 16384))->capture_default_str();
    app.add_option("--dropout", m.dropout, "dropout rate after attention and MLP in training")->check(CLI::Range(0.0, 0.99))->capture_default_str();
    app.add_option("--lr", o.peak_lr, "peak learning rate of the warm-up cosine schedule")->check(CLI::PositiveNumber)->capture_default_str();
    app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
    app.add_option("--warmup-steps", o.warmup_steps, "warm-up steps (at most a tenth of the run)")->check(CLI::Range(1, 100000000))->capture_default_str();
  }
  static std::string check(const Config& m) {
    return m.dim % m.heads == 0 ? std::string() : "--heads " + std::to_string(m.heads) + " does not divide --dim " + std::to_string(m.dim);
  }

  template <class D>
  static Params<D> init(tg::random::Key key, const Config& c) { return vit::init_params<D>(key, c); }
  static std::string describe(const Config& c) { return "A Vision Transformer (" + c.str() + ")"; }
  static void model_rows(ex::Table& t, const Config& m) {
    t.rows.push_back({"tokens per image", std::to_string(m.tokens()) + " patches of " + std::to_string(m.patch) + "x" + std::to_string(m.patch) +
                                              " pixels, linearly embedded, plus a learned position embedding"});
    t.rows.push_back({"blocks", std::to_string(m.layers) + " x pre-norm [LayerNorm, " + std::to_string(m.heads) +
                                    "-head self-attention, residual; LayerNorm, GELU MLP " + std::to_string(m.dim) + "-" + std::to_string(m.mlp) +
                                    "-" + std::to_string(m.dim) + ", residual]"});
    t.rows.push_back({"head", "LayerNorm, mean over the tokens, linear to 10 classes"});
    t.rows.push_back({"dropout", ex::fmt("%g", m.dropout)});
  }
  static bool golden_fits(const ex::json& g, const Config& m) {
    return g.at("dim") == m.dim && g.at("heads") == m.heads && g.at("layers") == m.layers && g.at("mlp") == m.mlp;
  }

  template <class C, class... A>
  static auto loss_with_metrics(const A&... a) { return vit::loss_with_metrics<C>(a...); }
  static void schedule(OptimConfig& o, std::int64_t total) {
    o.total_steps = total;
    o.warmup_steps = std::min<std::int64_t>(o.warmup_steps, std::max<std::int64_t>(1, total / 10));
  }
  static auto make_optimizer(const OptimConfig& o) { return vit::make_optimizer(o); }
  static std::string optimizer_text(const OptimConfig& o) {
    return "chain(clip_by_global_norm(" + ex::fmt("%g", o.clip) + "), adamw(warmup_cosine_decay_schedule(0, " + ex::fmt("%g", o.peak_lr) + ", " +
           std::to_string(o.warmup_steps) + ", " + std::to_string(o.total_steps) + "), weight_decay=" + ex::fmt("%g", o.weight_decay) + "))";
  }
  static ex::json optim_metrics(const OptimConfig& o) {
    return {{"peak_lr", o.peak_lr}, {"weight_decay", o.weight_decay}, {"warmup_steps", o.warmup_steps}, {"total_steps", o.total_steps}};
  }
  template <class C, class... A>
  static auto train_step(const A&... a) { return vit::train_step<C>(a...); }
  /// A fresh dropout key each step (fold_in(key(seed + 1), step)) when there is dropout; else one fixed key.
  static bool step_key(const Config& c) { return c.dropout > 0; }
  template <class... A>
  static auto evaluate(const A&... a) { return vit::evaluate(a...); }

  static void throughput(ex::Table& t, ex::json& metrics, double images_per_sec, const Config& c) {
    const double tps = images_per_sec * static_cast<double>(c.tokens());
    t.rows.push_back({"tokens/sec (" + std::to_string(c.tokens()) + " tokens per image, forward and backward)", ex::grouped(tps)});
    metrics["tokens_per_sec"] = tps, metrics["tokens_per_example"] = c.tokens();
  }
  static std::string summary(double images_per_sec, const Config& c) {
    return ex::grouped(images_per_sec * static_cast<double>(c.tokens())) + " tokens/sec measured (" + ex::grouped(images_per_sec) + " images/sec)";
  }

  /// 5. Each head's softmax weights in the last block for one test image, and the attention each patch receives.
  template <class D>
  static void inspect(ex::Log& log, ex::json& metrics, const Params<D>& params, const Config& c, const std::vector<std::uint8_t>& px,
                      const std::vector<std::uint8_t>& labels, std::int64_t image) {
    log.heading("5. Attention", "Each head's softmax weights in the last block for test image " + std::to_string(image) +
                                    " (rows: the 16 query patches, columns: the 16 key patches, both in reading order), and the "
                                    "attention each patch receives averaged over the queries, drawn over the image.");
    const auto first = px.begin() + static_cast<std::ptrdiff_t>(image * 784);
    const auto x = tg::from_vector<D>(std::vector<float>(first, first + 784), {1, 784}) * (1.0f / 255.0f);
    std::vector<vit::Tensor<D>> weights;
    (void)vit::forward<float>(params, x, c, {}, &weights);
    const auto w = weights.back().to_vector();  // (1, heads, 16, 16)
    const int T = static_cast<int>(c.tokens()), g = static_cast<int>(c.image / c.patch);
    const std::uint8_t* pixels = px.data() + image * 784;
    std::string html = ex::img_tag(ex::image_grid({{pixels, 255, 255, 255}}, 1, 2),
                                   "image " + std::to_string(image) + ": " + ex::class_names[labels[static_cast<std::size_t>(image)]]);
    ex::json heads = ex::json::array();
    for (int h = 0; h < static_cast<int>(c.heads); ++h) {
      const std::vector<float> m(w.begin() + h * T * T, w.begin() + (h + 1) * T * T);
      html += ex::img_tag(ex::heatmap(m, T, T, 8), "head " + std::to_string(h) + ": query x key");
      std::vector<float> received(static_cast<std::size_t>(T), 0.0f);
      for (int q = 0; q < T; ++q)
        for (int k = 0; k < T; ++k) received[static_cast<std::size_t>(k)] += m[static_cast<std::size_t>(q * T + k)] / static_cast<float>(T);
      // The image tinted by the attention each patch receives.
      ex::Image over(28 * 3, 28 * 3);
      const float top = *std::max_element(received.begin(), received.end());
      for (int y = 0; y < 28 * 3; ++y)
        for (int xx = 0; xx < 28 * 3; ++xx) {
          const int py = y / 3, pxl = xx / 3, tok = (py / c.patch) * g + pxl / c.patch;
          const float a = received[static_cast<std::size_t>(tok)] / top, v = pixels[py * 28 + pxl] / 255.0f;
          over.set(xx, y, static_cast<std::uint8_t>(255 * (1 - v) * (1 - 0.6f * a)), static_cast<std::uint8_t>(255 * (1 - v) * (1 - 0.3f * a)),
                   static_cast<std::uint8_t>(255 * (1 - v)));
        }
      html += ex::img_tag(over, "head " + std::to_string(h) + ": attention received");
      heads.push_back(m);
    }
    log.html("<div>" + html + "</div>");
    metrics["attention"] = {{"test_index", image}, {"block", c.layers - 1}, {"heads", heads}};
  }
};

int main(int argc, char** argv) {
  return ex::classifier_main<VitModel>(argc, argv, "vit_fashion_mnist: a small Vision Transformer trained on Fashion-MNIST with tapegrad; "
                                                   "writes report.html and metrics.json under --out");
}
