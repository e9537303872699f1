// The examples' output: tables printed in the terminal and collected into a self-contained HTML report
// (inline SVG charts, PNG images as data: URIs), PNG files through libpng, a progress bar, and Log, which
// does both at once for a report's sections. Shared by the examples.
#pragma once

#include <png.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

inline std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

inline std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

/// A number with thousands separators: 235146 -> "235,146".
inline std::string grouped(double v) {
  std::string digits = fmt("%.0f", std::fabs(v)), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (v < 0 ? "-" : "") + out;
}

/// A table: printed with aligned columns in the terminal, and as an HTML table in the report.
struct Table {
  std::string title;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;

  void print(std::ostream& os) const {
    std::vector<std::size_t> width(header.size(), 0);
    auto measure = [&](const std::vector<std::string>& r) {
      for (std::size_t i = 0; i < r.size() && i < width.size(); ++i) width[i] = std::max(width[i], r[i].size());
    };
    measure(header);
    for (const auto& r : rows) measure(r);
    auto line = [&](const std::vector<std::string>& r) {
      os << "  ";
      for (std::size_t i = 0; i < width.size(); ++i) {
        const std::string& cell = i < r.size() ? r[i] : std::string();
        os << cell << std::string(width[i] - cell.size() + 2, ' ');
      }
      os << "\n";
    };
    os << "  " << title << "\n";
    line(header);
    std::size_t total = 0;
    for (std::size_t w : width) total += w + 2;
    os << "  " << std::string(total, '-') << "\n";
    for (const auto& r : rows) line(r);
  }

  std::string html() const {
    std::ostringstream h;
    h << "<table><caption>" << html_escape(title) << "</caption><thead><tr>";
    for (const auto& c : header) h << "<th>" << html_escape(c) << "</th>";
    h << "</tr></thead><tbody>";
    for (const auto& r : rows) {
      h << "<tr>";
      for (const auto& c : r) h << "<td>" << html_escape(c) << "</td>";
      h << "</tr>";
    }
    h << "</tbody></table>";
    return h.str();
  }
};

/// An RGB image, 8 bits per channel.
struct Image {
  int width = 0, height = 0;
  std::vector<std::uint8_t> rgb;
  Image(int w, int h, std::uint8_t fill = 255) : width(w), height(h), rgb(static_cast<std::size_t>(w) * h * 3, fill) {}
  void set(int x, int y, std::uint8_t r, std::uint8_t g, std::uint8_t b) {
    std::uint8_t* p = rgb.data() + (static_cast<std::size_t>(y) * width + x) * 3;
    p[0] = r, p[1] = g, p[2] = b;
  }
};

/// PNG bytes of `image` (libpng, written to memory).
inline std::vector<std::uint8_t> encode_png(const Image& image) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info) throw std::runtime_error("libpng: out of memory");
  std::vector<std::uint8_t> out;
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw std::runtime_error("libpng: encoding failed");
  }
  png_set_write_fn(
      png, &out,
      [](png_structp p, png_bytep data, png_size_t n) {
        auto* v = static_cast<std::vector<std::uint8_t>*>(png_get_io_ptr(p));
        v->insert(v->end(), data, data + n);
      },
      nullptr);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width), static_cast<png_uint_32>(image.height), 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < image.height; ++y)
    png_write_row(png, const_cast<png_bytep>(image.rgb.data() + static_cast<std::size_t>(y) * image.width * 3));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

inline std::string base64(const std::vector<std::uint8_t>& bytes) {
  static const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (std::size_t i = 0; i < bytes.size(); i += 3) {
    const std::uint32_t n = (std::uint32_t{bytes[i]} << 16) | (i + 1 < bytes.size() ? std::uint32_t{bytes[i + 1]} << 8 : 0) |
                            (i + 2 < bytes.size() ? bytes[i + 2] : 0);
    out += table[(n >> 18) & 63];
    out += table[(n >> 12) & 63];
    out += i + 1 < bytes.size() ? table[(n >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? table[n & 63] : '=';
  }
  return out;
}

inline std::string png_data_uri(const std::vector<std::uint8_t>& png) { return "data:image/png;base64," + base64(png); }

/// A grid of 28x28 grey images, `scale`x enlarged, each framed by a 2-pixel border of its colour.
struct Tile {
  const std::uint8_t* pixels;  // 28 * 28, 0 = background
  std::uint8_t r, g, b;        // border
};
inline Image image_grid(const std::vector<Tile>& tiles, int columns, int scale) {
  const int cell = 28 * scale + 8, rows = (static_cast<int>(tiles.size()) + columns - 1) / columns;
  Image img(columns * cell, rows * cell, 255);
  for (std::size_t t = 0; t < tiles.size(); ++t) {
    const int x0 = static_cast<int>(t % columns) * cell + 2, y0 = static_cast<int>(t / columns) * cell + 2;
    for (int y = 0; y < 28 * scale + 4; ++y)
      for (int x = 0; x < 28 * scale + 4; ++x) {
        const bool border = x < 2 || y < 2 || x >= 28 * scale + 2 || y >= 28 * scale + 2;
        if (border) {
          img.set(x0 + x, y0 + y, tiles[t].r, tiles[t].g, tiles[t].b);
        } else {
          const std::uint8_t v = 255 - tiles[t].pixels[((y - 2) / scale) * 28 + (x - 2) / scale];  // dark clothes on white
          img.set(x0 + x, y0 + y, v, v, v);
        }
      }
  }
  return img;
}

/// A scalar field sampled on a k x k grid (row i: x = i / (k - 1), column j: y = j / (k - 1)) as an image,
/// `scale`x enlarged, y upwards: values in [lo, hi] coloured from dark blue through white to dark red
/// (diverging), or, with lo == 0, white to dark red.
inline Image field_image(const std::vector<double>& v, int k, double lo, double hi, int scale) {
  Image img(k * scale, k * scale, 255);
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) {
      const double t = hi > lo ? std::clamp((v[static_cast<std::size_t>(i) * k + j] - lo) / (hi - lo), 0.0, 1.0) : 0.5;
      const double s = lo < 0 ? 2 * t - 1 : t;  // signed strength: blue below the middle, red above
      const double a = std::fabs(s);
      const auto mix = [&](double to) { return static_cast<std::uint8_t>(std::lround(255 + (to - 255) * a)); };
      const std::uint8_t r = s >= 0 ? mix(165) : mix(33), g = s >= 0 ? mix(0) : mix(102), b = s >= 0 ? mix(38) : mix(172);
      for (int dy = 0; dy < scale; ++dy)
        for (int dx = 0; dx < scale; ++dx) img.set(i * scale + dx, (k - 1 - j) * scale + dy, r, g, b);
    }
  return img;
}

/// Curves on a log10 y axis (SVG) against the step: each series a (name, colour, values) of positive values.
struct Series {
  std::string name, colour;
  std::vector<double> values;
};
inline std::string svg_log_curves(const std::vector<double>& steps, const std::vector<Series>& series) {
  const double W = 760, H = 360, l = 70, r = 160, t = 20, b = 50, pw = W - l - r, ph = H - t - b;
  double lo = 1e300, hi = -1e300;
  for (const auto& c : series)
    for (double v : c.values)
      if (v > 0) lo = std::min(lo, std::log10(v)), hi = std::max(hi, std::log10(v));
  lo = std::floor(lo), hi = std::max(lo + 1, std::ceil(hi));
  const double x_max = std::max(1.0, steps.back());
  auto X = [&](double v) { return l + v / x_max * pw; };
  auto Y = [&](double v) { return t + ph - (std::log10(std::max(v, 1e-300)) - lo) / (hi - lo) * ph; };
  std::ostringstream s;
  s << "<svg class=\"chart\" viewBox=\"0 0 " << W << " " << H << "\" width=\"" << W << "\" role=\"img\">";
  s << "<rect x=\"" << l << "\" y=\"" << t << "\" width=\"" << pw << "\" height=\"" << ph << "\" fill=\"none\" stroke=\"#999\"/>";
  for (double e = lo; e <= hi; e += 1)
    s << "<text x=\"" << l - 6 << "\" y=\"" << Y(std::pow(10.0, e)) + 4 << "\" text-anchor=\"end\">1e" << fmt("%.0f", e) << "</text>";
  for (int i = 0; i <= 5; ++i)
    s << "<text x=\"" << X(x_max * i / 5) << "\" y=\"" << t + ph + 18 << "\" text-anchor=\"middle\">" << fmt("%.0f", x_max * i / 5) << "</text>";
  for (std::size_t c = 0; c < series.size(); ++c) {
    s << "<polyline fill=\"none\" stroke=\"" << series[c].colour << "\" stroke-width=\"2\" points=\"";
    for (std::size_t i = 0; i < series[c].values.size() && i < steps.size(); ++i) s << X(steps[i]) << "," << Y(series[c].values[i]) << " ";
    s << "\"/><text x=\"" << l + pw + 10 << "\" y=\"" << t + 16 + 20 * static_cast<double>(c) << "\" fill=\"" << series[c].colour << "\">"
      << html_escape(series[c].name) << "</text>";
  }
  s << "<text x=\"" << l + pw / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text></svg>";
  return s.str();
}

/// A horizontal bar chart (SVG): one bar per label, the value printed at its end.
inline std::string svg_bars(const std::vector<std::string>& labels, const std::vector<double>& values, const std::string& unit) {
  const double top = *std::max_element(values.begin(), values.end());
  const int bar_h = 28, left = 200, width = 720, plot = width - left - 150;
  std::ostringstream s;
  s << "<svg class=\"chart\" viewBox=\"0 0 " << width << " " << (labels.size() * (bar_h + 10) + 20) << "\" width=\"" << width
    << "\" role=\"img\">";
  for (std::size_t i = 0; i < labels.size(); ++i) {
    const double w = top > 0 ? values[i] / top * plot : 0;
    const double y = 10 + static_cast<double>(i) * (bar_h + 10);
    s << "<text x=\"" << left - 8 << "\" y=\"" << y + bar_h * 0.68 << "\" text-anchor=\"end\">" << html_escape(labels[i]) << "</text>"
      << "<rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << std::max(1.0, w) << "\" height=\"" << bar_h
      << "\" fill=\"#4878a8\"/><text x=\"" << left + w + 6 << "\" y=\"" << y + bar_h * 0.68 << "\">" << grouped(values[i]) << " "
      << html_escape(unit) << "</text>";
  }
  s << "</svg>";
  return s.str();
}

/// The training curve (SVG): loss on the left axis, batch accuracy on the right, against the step.
inline std::string svg_curve(const std::vector<double>& steps, const std::vector<double>& loss, const std::vector<double>& accuracy) {
  const double W = 760, H = 360, l = 60, r = 60, t = 20, b = 50, pw = W - l - r, ph = H - t - b;
  const double x_max = std::max(1.0, steps.back());
  const double loss_max = std::max(1e-6, *std::max_element(loss.begin(), loss.end())) * 1.05;
  auto X = [&](double v) { return l + v / x_max * pw; };
  auto YL = [&](double v) { return t + ph - v / loss_max * ph; };
  auto YA = [&](double v) { return t + ph - v * ph; };
  std::ostringstream s;
  s << "<svg class=\"chart\" viewBox=\"0 0 " << W << " " << H << "\" width=\"" << W << "\" role=\"img\">";
  s << "<rect x=\"" << l << "\" y=\"" << t << "\" width=\"" << pw << "\" height=\"" << ph << "\" fill=\"none\" stroke=\"#999\"/>";
  for (int i = 0; i <= 5; ++i) {
    const double fl = loss_max * i / 5, fa = i / 5.0, fx = x_max * i / 5;
    s << "<text x=\"" << l - 6 << "\" y=\"" << YL(fl) + 4 << "\" text-anchor=\"end\" fill=\"#c0392b\">" << fmt("%.2f", fl) << "</text>";
    s << "<text x=\"" << l + pw + 6 << "\" y=\"" << YA(fa) + 4 << "\" fill=\"#2471a3\">" << fmt("%.1f", fa) << "</text>";
    s << "<text x=\"" << X(fx) << "\" y=\"" << t + ph + 18 << "\" text-anchor=\"middle\">" << fmt("%.0f", fx) << "</text>";
  }
  auto path = [&](const std::vector<double>& v, auto Y, const char* colour) {
    s << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"2\" points=\"";
    for (std::size_t i = 0; i < v.size(); ++i) s << X(steps[i]) << "," << Y(v[i]) << " ";
    s << "\"/>";
  };
  path(loss, YL, "#c0392b");
  path(accuracy, YA, "#2471a3");
  s << "<text x=\"" << l + pw / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text>"
    << "<text x=\"14\" y=\"" << t + ph / 2 << "\" fill=\"#c0392b\" transform=\"rotate(-90 14 " << t + ph / 2
    << ")\" text-anchor=\"middle\">training loss</text>"
    << "<text x=\"" << W - 12 << "\" y=\"" << t + ph / 2 << "\" fill=\"#2471a3\" transform=\"rotate(90 " << W - 12 << " " << t + ph / 2
    << ")\" text-anchor=\"middle\">batch accuracy</text></svg>";
  return s.str();
}

/// The confusion matrix as a heatmap (SVG): rows are the true class, columns the prediction, each cell the
/// fraction of the true class, annotated.
inline std::string svg_heatmap(const std::vector<std::vector<double>>& fraction, const std::vector<std::string>& names) {
  const int n = static_cast<int>(names.size()), cell = 54, left = 110, top = 110;
  const int W = left + n * cell + 20, H = top + n * cell + 40;
  std::ostringstream s;
  s << "<svg class=\"chart\" viewBox=\"0 0 " << W << " " << H << "\" width=\"" << W << "\" role=\"img\">";
  for (int i = 0; i < n; ++i) {
    s << "<text x=\"" << left - 6 << "\" y=\"" << top + i * cell + cell / 2 + 4 << "\" text-anchor=\"end\">" << html_escape(names[i])
      << "</text>";
    const int cx = left + i * cell + cell / 2;
    s << "<text x=\"" << cx << "\" y=\"" << top - 6 << "\" transform=\"rotate(-45 " << cx << " " << top - 6 << ")\">" << html_escape(names[i])
      << "</text>";
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      const double f = fraction[i][j];
      const int shade = static_cast<int>(255 - 200 * std::sqrt(f));  // sqrt: small confusions stay visible
      s << "<rect x=\"" << left + j * cell << "\" y=\"" << top + i * cell << "\" width=\"" << cell << "\" height=\"" << cell
        << "\" fill=\"rgb(" << shade << "," << shade << ",255)\" stroke=\"#fff\"/>"
        << "<text x=\"" << left + j * cell + cell / 2 << "\" y=\"" << top + i * cell + cell / 2 + 4 << "\" text-anchor=\"middle\" fill=\""
        << (f > 0.5 ? "#fff" : "#222") << "\">" << fmt("%.2f", f) << "</text>";
    }
  s << "<text x=\"" << left + n * cell / 2 << "\" y=\"" << H - 8 << "\" text-anchor=\"middle\">rows: true class; columns: predicted</text>";
  s << "</svg>";
  return s.str();
}

/// The report: sections of HTML in order, written as one self-contained file.
struct Report {
  std::vector<std::string> sections;
  std::string current;

  void section(const std::string& title, const std::string& intro = "") {
    flush();
    current = "<section><h2>" + html_escape(title) + "</h2>";
    if (!intro.empty()) current += "<p>" + html_escape(intro) + "</p>";
  }
  void text(const std::string& t) { current += "<p>" + html_escape(t) + "</p>"; }
  void html(const std::string& h) { current += h; }
  void table(const Table& t) { current += t.html(); }
  void flush() {
    if (!current.empty()) sections.push_back(current + "</section>");
    current.clear();
  }

  std::string document(const std::string& title) {
    flush();
    std::ostringstream h;
    h << "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>" << html_escape(title) << "</title><style>"
      << "body{font:15px/1.45 system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
      << "h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}"
      << "table{border-collapse:collapse;margin:.8em 0}caption{text-align:left;font-weight:600;padding:.3em 0}"
      << "td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}th{background:#f4f4f4}"
      << "svg.chart{display:block;max-width:100%;height:auto;font-size:13px;margin:.8em 0}"
      << ".grid{display:flex;flex-wrap:wrap;gap:10px}.grid figure{margin:0;text-align:center;width:96px}"
      << ".grid img{width:84px;height:84px;image-rendering:pixelated;border:3px solid #ccc}"
      << ".grid figcaption{font-size:12px}.ok img{border-color:#1e8449}.bad img{border-color:#c0392b}"
      << ".ok figcaption{color:#1e8449}.bad figcaption{color:#c0392b}</style></head><body><h1>" << html_escape(title) << "</h1>";
    for (const auto& s : sections) h << s;
    // A self-check for automated rendering tests: records, on the root element, whether every table,
    // chart and image has a size on the page and every image decoded.
    h << "<script>addEventListener('load',()=>{const els=[...document.querySelectorAll('table,svg.chart,img')];"
         "const bad=els.filter(e=>{const r=e.getBoundingClientRect();return r.width<1||r.height<1||"
         "(e.tagName==='IMG'&&!(e.complete&&e.naturalWidth>0));});"
         "document.documentElement.dataset.check=(bad.length?'fail':'ok')+' tables='+document.querySelectorAll('table').length+"
         "' charts='+document.querySelectorAll('svg.chart').length+' images='+document.querySelectorAll('img').length+"
         "' invisible='+bad.length;});</script>";
    h << "</body></html>\n";
    return h.str();
  }
};

/// A report's sections as they are made: each heading, table and sentence printed on the terminal (unless
/// quiet) and added to the HTML report.
class Log {
 public:
  Log(Report& report, bool quiet) : report_(report), quiet_(quiet) {}

  void heading(const std::string& title, const std::string& intro) {
    if (!quiet_) std::cout << "== " << title << "\n";
    report_.section(title, intro);
  }
  void show(const Table& t) {
    if (!quiet_) {
      t.print(std::cout);
      std::cout << "\n";
    }
    report_.table(t);
  }
  void say(const std::string& s) {
    if (!quiet_) std::cout << "  " << s << "\n";
    report_.text(s);
  }
  /// HTML for the report alone (figures, charts).
  void html(const std::string& h) { report_.html(h); }
  bool quiet() const { return quiet_; }

 private:
  Report& report_;
  bool quiet_;
};

/// A progress bar on a terminal; plain lines at the logged steps otherwise; nothing when quiet.
class Progress {
 public:
  Progress(std::string label, int total, bool quiet)
      : label_(std::move(label)), total_(total), quiet_(quiet), tty_(::isatty(STDOUT_FILENO) == 1) {}
  /// After step `done` (1-based); `status` is shown beside the bar, and on the plain line when logged.
  void update(int done, const std::string& status, bool logged) {
    if (quiet_) return;
    if (tty_) {
      const int width = 30, filled = total_ > 0 ? done * width / total_ : width;
      std::printf("\r  %s [%s%s] %d/%d %s   ", label_.c_str(), std::string(static_cast<std::size_t>(filled), '#').c_str(),
                  std::string(static_cast<std::size_t>(width - filled), '.').c_str(), done, total_, status.c_str());
      if (done == total_) std::printf("\n");
      std::fflush(stdout);
    } else if (logged || done == total_) {
      std::printf("  %s %d/%d %s\n", label_.c_str(), done, total_, status.c_str());
    }
  }

 private:
  std::string label_;
  int total_;
  bool quiet_, tty_;
};

/// A heatmap of a (rows, cols) matrix of weights in [0, max], each cell `scale` pixels, white to dark blue.
inline Image heatmap(const std::vector<float>& w, int rows, int cols, int scale) {
  Image img(cols * scale, rows * scale);
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

/// An image as an inline figure with a caption, for the report (at most 160 pixels wide, pixels kept sharp).
inline std::string img_tag(const Image& img, const std::string& caption) {
  return "<figure style=\"display:inline-block;margin:4px;text-align:center\"><img style=\"image-rendering:pixelated;width:" +
         std::to_string(std::min(img.width, 160)) + "px\" src=\"" + png_data_uri(encode_png(img)) + "\"><figcaption>" +
         html_escape(caption) + "</figcaption></figure>";
}

}  // namespace examples
