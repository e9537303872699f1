// The report's common sections about a trained classifier, shared by both examples: its training curve,
// the codelab's 25 sample test images with their predictions, and the confusion matrix over the test set.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dataset.hpp"
#include "report.hpp"

namespace examples {

/// The logged steps of a training: step, loss, batch accuracy and, where logged, the gradient norm.
struct History {
  std::vector<double> step, loss, accuracy, grad_norm;
};

/// The training curve as a table and a chart; returns it as JSON for metrics.json.
inline nlohmann::ordered_json report_history(Log& log, const std::string& title, const History& h) {
  const bool norms = !h.grad_norm.empty();
  Table t{title, {"step", "loss", "batch accuracy"}, {}};
  if (norms) t.header.push_back("gradient norm");
  auto history = nlohmann::ordered_json::array();
  for (std::size_t i = 0; i < h.step.size(); ++i) {
    t.rows.push_back({fmt("%.0f", h.step[i]), fmt("%.4f", h.loss[i]), fmt("%.4f", h.accuracy[i])});
    nlohmann::ordered_json row = {{"step", h.step[i]}, {"loss", h.loss[i]}, {"accuracy", h.accuracy[i]}};
    if (norms) t.rows.back().push_back(fmt("%.4f", h.grad_norm[i])), row["grad_norm"] = h.grad_norm[i];
    history.push_back(row);
  }
  log.show(t);
  log.html(svg_curve(h.step, h.loss, h.accuracy));
  return history;
}

/// The 25 sample test images (pick: their indices) with the classes predicted for them, as a table and
/// as figures (green when right, red with the true class when wrong); returns the figures as one PNG grid.
inline std::vector<std::uint8_t> report_samples(Log& log, const std::vector<std::uint8_t>& images, const std::vector<std::uint8_t>& labels,
                                                const std::vector<std::int64_t>& pick, const std::vector<std::int32_t>& predicted) {
  Table t{"the codelab's 25 sample test images", {"test image", "predicted", "true class", ""}, {}};
  std::vector<Tile> tiles;
  std::string figures = "<div class=\"grid\">";
  for (std::size_t k = 0; k < pick.size(); ++k) {
    const auto i = static_cast<std::size_t>(pick[k]);
    const auto pred = static_cast<std::size_t>(predicted[k]), truth = static_cast<std::size_t>(labels[i]);
    const bool ok = pred == truth;
    t.rows.push_back({std::to_string(i), class_names[pred], class_names[truth], ok ? "right" : "WRONG"});
    const std::uint8_t* p = images.data() + i * 784;
    tiles.push_back(ok ? Tile{p, 30, 132, 73} : Tile{p, 192, 57, 43});
    figures += std::string("<figure class=\"") + (ok ? "ok" : "bad") + "\"><img alt=\"test image " + std::to_string(i) + "\" src=\"" +
               png_data_uri(encode_png(image_grid({{p, 255, 255, 255}}, 1, 3))) + "\"><figcaption>" + html_escape(class_names[pred]) +
               (ok ? "" : "<br>(true: " + html_escape(class_names[truth]) + ")") + "</figcaption></figure>";
  }
  log.show(t);
  log.html("<p>The codelab's 25 sample test images (<code>np.random.default_rng(7).choice(10000, 25, replace=False)</code>): "
           "the prediction, green when right, red (with the true class) when wrong.</p>" + figures + "</div>");
  return encode_png(image_grid(tiles, 5, 3));
}

/// The confusion matrix of predictions against the true classes, as fractions of each true class (a table
/// and a heatmap); returns the counts, row by row, as JSON.
inline nlohmann::ordered_json report_confusion(Log& log, const std::vector<std::int32_t>& truth, const std::vector<std::int32_t>& predicted) {
  std::vector<std::vector<double>> confusion(10, std::vector<double>(10, 0.0));
  for (std::size_t i = 0; i < truth.size(); ++i) confusion[static_cast<std::size_t>(truth[i])][static_cast<std::size_t>(predicted[i])] += 1;
  std::vector<std::string> names(class_names.begin(), class_names.end());
  Table cm{"confusion matrix (rows: true class; fraction predicted as each column)", {"true \\ predicted"}, {}};
  for (const auto& name : names) cm.header.push_back(name.substr(0, 7));
  auto counts = nlohmann::ordered_json::array();
  for (std::size_t i = 0; i < 10; ++i) {
    double row_total = 0;
    for (double v : confusion[i]) row_total += v;
    std::vector<std::string> row{names[i]};
    counts.push_back(confusion[i]);
    for (double& v : confusion[i]) v = row_total > 0 ? v / row_total : 0.0, row.push_back(fmt("%.2f", v));
    cm.rows.push_back(row);
  }
  log.show(cm);
  log.html(svg_heatmap(confusion, names));
  return counts;
}

}  // namespace examples
