// Fashion-MNIST: where to find it, how to verify it (SHA-256 of each decompressed payload: Debian's
// dataset-fashion-mnist recompressed the upstream .gz files, so only the payloads match upstream), and
// how to download it from the upstream repository when no copy is found.
#pragma once

#include <curl/curl.h>
#include <openssl/evp.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <tapegrad/tapegrad.hpp>

namespace examples {

namespace fs = std::filesystem;

/// A problem with the data a user can act on: the program prints it and exits with status 2.
struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline const std::array<const char*, 10> class_names = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                                        "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

struct FileSpec {
  const char* name;         // as upstream and Debian name it
  const char* split;        // train / test
  const char* kind;         // images / labels
  const char* payload_sha256;  // of the decompressed IDX bytes (identical upstream and in Debian)
  const char* upstream_md5;    // of upstream's .gz (Debian's differ: recompressed)
  std::int64_t examples;
};

inline const std::array<FileSpec, 4> files = {{
    {"train-images-idx3-ubyte.gz", "train", "images", "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
     "8d4fb7e6c68d591d4c3dfef9ec88bf0d", 60000},
    {"train-labels-idx1-ubyte.gz", "train", "labels", "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
     "25c81989df183df01b3e8a0aad5dffbe", 60000},
    {"t10k-images-idx3-ubyte.gz", "test", "images", "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
     "bef4ecab320f06d8554ea6380940ec79", 10000},
    {"t10k-labels-idx1-ubyte.gz", "test", "labels", "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
     "bb300cfdad3c16e7a12a480ee83cd310", 10000},
}};

inline const char* upstream_url = "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/";

/// Hex digest of `bytes` with OpenSSL's EVP interface (md: EVP_sha256() or EVP_md5()).
inline std::string hex_digest(const EVP_MD* md, const std::vector<std::uint8_t>& bytes) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), out, &n, md, nullptr) != 1) throw std::runtime_error("OpenSSL EVP_Digest failed");
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned i = 0; i < n; ++i) s += hex[out[i] >> 4], s += hex[out[i] & 15];
  return s;
}

inline std::vector<std::uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path.string() + ": cannot open");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline fs::path cache_dir() {
  const char* home = std::getenv("HOME");
  return fs::path(home && *home ? home : ".") / ".cache" / "tapegrad" / "fashion-mnist";
}

/// The directories searched, in order: --data-dir, $TAPEGRAD_DATA, ~/.cache/tapegrad/fashion-mnist,
/// Debian's /usr/share/datasets/fashion-mnist ($TAPEGRAD_SYSTEM_DATA/fashion-mnist when set).
inline std::vector<fs::path> search_path(const std::string& data_dir) {
  std::vector<fs::path> dirs;
  if (!data_dir.empty()) dirs.emplace_back(data_dir);
  if (const char* env = std::getenv("TAPEGRAD_DATA"); env && *env) dirs.emplace_back(env);
  dirs.push_back(cache_dir());
  // TAPEGRAD_SYSTEM_DATA stands in for /usr/share/datasets (relocated installs, and the tests of a machine
  // without the data).
  const char* system = std::getenv("TAPEGRAD_SYSTEM_DATA");
  dirs.push_back(fs::path(system && *system ? system : "/usr/share/datasets") / "fashion-mnist");
  return dirs;
}

/// The first directory of `dirs` holding all four files, or an empty path.
inline fs::path find(const std::vector<fs::path>& dirs) {
  for (const fs::path& d : dirs) {
    bool all = true;
    for (const FileSpec& f : files) all = all && fs::is_regular_file(d / f.name);
    if (all) return d;
  }
  return {};
}

/// Downloads the four files from upstream into `dir` (each .gz checked against upstream's MD5 and its
/// payload against the SHA-256, then renamed into place: an interrupted download leaves no file behind).
inline void download(const fs::path& dir, bool quiet) {
  fs::create_directories(dir);
  curl_global_init(CURL_GLOBAL_DEFAULT);
  for (const FileSpec& f : files) {
    const fs::path final_path = dir / f.name, part = dir / (std::string(f.name) + ".part");
    if (fs::is_regular_file(final_path)) continue;
    const std::string url = std::string(upstream_url) + f.name;
    if (!quiet) std::printf("  downloading %s\n", url.c_str());
    std::FILE* out = std::fopen(part.c_str(), "wb");
    if (!out) throw DataError(part.string() + ": cannot create the download file");
    CURL* curl = curl_easy_init();
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(curl, CURLOPT_FAILONERROR, 1L);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, 20L);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, out);
    const CURLcode rc = curl_easy_perform(curl);
    curl_easy_cleanup(curl);
    std::fclose(out);
    if (rc != CURLE_OK) {
      fs::remove(part);
      throw DataError(std::string("download of ") + url + " failed: " + curl_easy_strerror(rc));
    }
    const std::string md5 = hex_digest(EVP_md5(), read_bytes(part));
    if (md5 != f.upstream_md5) {
      fs::remove(part);
      throw DataError(url + ": MD5 " + md5 + " is not upstream's " + f.upstream_md5 + "; the download was damaged: try again");
    }
    fs::rename(part, final_path);
  }
}

/// One split as read from its files: images (N, 28, 28) and labels (N,), uint8 on the host.
struct Split {
  tg::Tensor<std::uint8_t> images, labels;
};

struct Loaded {
  fs::path dir;
  Split train, test;
  std::vector<std::string> sha256;  // per file, in `files` order
};

/// Reads and validates the four files of `dir`: payload SHA-256 (unless `verify` is false), IDX
/// structure, shapes (N, 28, 28) and (N,) with upstream's N, labels in 0..9. Throws DataError naming the
/// file and the problem.
inline Loaded load(const fs::path& dir, bool verify) {
  Loaded out{dir, {}, {}, {}};
  for (const FileSpec& f : files) {
    const std::string path = (dir / f.name).string();
    std::vector<std::uint8_t> payload;
    tg::Tensor<std::uint8_t> t;
    try {
      payload = tg::data::read_file_decompressed(path);
      const std::string sha = hex_digest(EVP_sha256(), payload);
      out.sha256.push_back(sha);
      if (verify && sha != f.payload_sha256)
        throw DataError(path + ": the SHA-256 of the decompressed data is " + sha + ", not Fashion-MNIST's " + f.payload_sha256 +
                        ": the file is damaged or not Fashion-MNIST's " + f.split + " " + f.kind +
                        "; delete it (it is downloaded again) or reinstall Debian's dataset-fashion-mnist");
      t = tg::data::parse_idx(payload, path);
    } catch (const tg::Error& e) {
      throw DataError(e.what());
    }
    const bool images = std::string(f.kind) == "images";
    const tg::Shape want = images ? tg::Shape{f.examples, 28, 28} : tg::Shape{f.examples};
    if (t.shape() != want)
      throw DataError(path + ": shape " + t.shape().str() + ", expected " + want.str() + " for Fashion-MNIST's " + f.split + " " + f.kind);
    if (!images) {
      const auto v = t.to_vector();
      for (std::size_t i = 0; i < v.size(); ++i)
        if (v[i] > 9)
          throw DataError(path + ": label " + std::to_string(v[i]) + " of example " + std::to_string(i) + " is outside 0..9");
    }
    Split& s = std::string(f.split) == "train" ? out.train : out.test;
    (images ? s.images : s.labels) = std::move(t);
  }
  return out;
}

/// Finds, downloads if allowed and needed, and loads the data set; the DataError for "nowhere" names
/// every directory searched and the two ways to get the data.
inline Loaded find_and_load(const std::string& data_dir, bool allow_download, bool verify, bool quiet) {
  const std::vector<fs::path> dirs = search_path(data_dir);
  fs::path dir = find(dirs);
  std::string download_error;
  if (dir.empty() && allow_download) {
    try {
      download(cache_dir(), quiet);
      dir = cache_dir();
    } catch (const std::exception& e) {
      download_error = e.what();
    }
  }
  if (dir.empty()) {
    std::string msg = "Fashion-MNIST not found. Searched (each needs the four files";
    for (const FileSpec& f : files) msg += std::string(" ") + f.name;
    msg += "):\n";
    for (const fs::path& d : dirs) msg += "  " + d.string() + (fs::is_directory(d) ? " (incomplete)" : " (no such directory)") + "\n";
    msg += allow_download ? "Download from " + std::string(upstream_url) + " failed: " + download_error + "\n"
                          : std::string("Download disabled by --no-download.\n");
    msg += "Get the data either way:\n"
           "  1. install Debian's package: sudo apt-get install dataset-fashion-mnist\n"
           "  2. or put the four .gz files from " + std::string(upstream_url) + " in one of the directories above\n"
           "     (or run without --no-download on a machine with network access)";
    throw DataError(msg);
  }
  return load(dir, verify);
}

/// SHA-256 over every parameter's float32 bytes, leaves in tree order (= the safetensors file's order):
/// the fingerprint that ties the JAX golden values to these initial parameters.
template <class P>
std::string params_digest(const P& params) {
  std::vector<std::uint8_t> bytes;
  tg::tree_for_each_tensor([&](std::size_t, const std::string&, const auto& leaf) {
    const auto v = leaf.to_vector();
    const auto* p = reinterpret_cast<const std::uint8_t*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(float));
  }, params);
  return hex_digest(EVP_sha256(), bytes);
}

}  // namespace examples
