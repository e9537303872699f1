// What the examples write under --out: files written whole or not at all, and the check, before any
// training, that --out can be written. Shared by the examples.
#pragma once

#include <tapegrad/tapegrad.hpp>

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

#include "dataset.hpp"

namespace examples {

/// Writes `bytes` to `path` through a temporary file and a rename: a file under --out is whole or absent.
inline void write_whole(const std::filesystem::path& path, const std::string& bytes) {
  tg::io::write_file_atomically(path.string(), bytes);
}

inline std::string as_string(const std::vector<std::uint8_t>& b) { return std::string(b.begin(), b.end()); }

/// Writes metrics.json and report.html under `out` (each whole or absent) and, unless quiet, says so with
/// the run's time.
inline void write_metrics_and_report(const std::string& out, const std::string& metrics_json, const std::string& report_html, bool quiet,
                                     double seconds) {
  const std::filesystem::path dir(out);
  std::filesystem::create_directories(dir);
  write_whole(dir / "metrics.json", metrics_json);
  write_whole(dir / "report.html", report_html);
  if (!quiet) std::cout << "wrote " << (dir / "report.html").string() << " and metrics.json (" << std::fixed << std::setprecision(1) << seconds << " s)\n";
}

/// Fails before any training, exit 2, when --out cannot be created or written: each missing folder is
/// created and a probe file written and removed, then what was created is removed again (a run that
/// fails later leaves nothing), and the reason names the folder and the system's answer.
inline void check_output_dir(const std::string& out) {
  namespace fs = std::filesystem;
  const fs::path dir(out);
  std::vector<fs::path> created;
  for (fs::path p = dir; !p.empty() && !fs::exists(p); p = p.parent_path()) created.push_back(p);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw DataError("--out " + out + ": cannot create this folder (" + ec.message() + "); choose a writable place for the outputs");
  if (!fs::is_directory(dir)) throw DataError("--out " + out + ": not a folder; choose a folder for the outputs");
  const fs::path probe = dir / (".tapegrad_probe_" + std::to_string(::getpid()));
  {
    std::ofstream f(probe);
    f << "probe";
    f.close();
    if (!f) {
      const std::string why = std::strerror(errno);
      std::error_code ignored;
      fs::remove(probe, ignored);
      for (const fs::path& p : created) fs::remove(p, ignored);
      throw DataError("--out " + out + ": cannot write into this folder (" + why + "); choose a writable place for the outputs");
    }
  }
  fs::remove(probe, ec);
  for (const fs::path& p : created) fs::remove(p, ec);  // deepest first
}

}  // namespace examples
