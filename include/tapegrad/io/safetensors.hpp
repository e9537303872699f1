// Checkpoints: any pytree of tensors (parameters, optimizer state, both) saved to and loaded from the
// safetensors format: an 8-byte little-endian header length, a JSON header naming each tensor by its tree
// path with dtype, shape and byte range, then the raw little-endian data. Loads in Python with the
// `safetensors` package, or with the standard library and NumPy. Writes are atomic: a temporary file in
// the same directory, fsync, rename, so a crash mid-write leaves any previous file intact. Reads validate
// everything before touching the target tree, and never read outside the file.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <algorithm>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE
namespace io {

namespace detail {

template <class T> inline constexpr const char* safetensors_dtype = nullptr;
template <> inline constexpr const char* safetensors_dtype<float> = "F32";
template <> inline constexpr const char* safetensors_dtype<double> = "F64";
template <> inline constexpr const char* safetensors_dtype<bf16> = "BF16";
template <> inline constexpr const char* safetensors_dtype<std::int32_t> = "I32";
template <> inline constexpr const char* safetensors_dtype<std::uint32_t> = "U32";
template <> inline constexpr const char* safetensors_dtype<std::uint8_t> = "U8";

/// Writes `bytes` to `path` atomically: `path`.tmp-<pid>, fsync, rename over `path`, fsync the directory.
inline void write_file_atomically(const std::string& path, std::span<const std::uint8_t> bytes, const char* op) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) ::tg::detail::fail(op, path, ": cannot create ", tmp, " (", std::strerror(errno), "); does the directory exist?");
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      ::tg::detail::fail(op, path, ": write failed after ", done, " of ", bytes.size(), " bytes (", std::strerror(err), ")");
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ::tg::detail::fail(op, path, ": flushing to disk failed (", std::strerror(err), ")");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ::tg::detail::fail(op, path, ": renaming ", tmp, " into place failed (", std::strerror(err), ")");
  }
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    (void)::fsync(dfd);  // makes the rename itself durable
    ::close(dfd);
  }
}

}  // namespace detail

/// Saves every tensor leaf of `tree` (any device; copied to the host) to `path` in the safetensors
/// format, named by its tree path ("w1", "mu.w1", "layers[0].w"), with `metadata` as the header's
/// "__metadata__" (string to string, as the format requires). Atomic: see the file comment.
template <class Tree>
void save_safetensors(const std::string& path, const Tree& tree, const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<std::uint8_t> data;
  tree_for_each([&](const std::string& name, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (!std::is_same_v<L, bool>) {
      using T = typename L::value_type;
      TG_CHECK(leaf.defined(), "save_safetensors", path, ": leaf '", name, "' is an undefined tensor");
      TG_CHECK(!header.contains(name), "save_safetensors", path, ": two leaves are named '", name, "'");
      const auto host = leaf.template to<Cpu>();
      const auto* bytes = reinterpret_cast<const std::uint8_t*>(host.data());
      const std::size_t begin = data.size();
      data.insert(data.end(), bytes, bytes + host.nbytes());
      std::vector<std::int64_t> shape;
      for (int d = 0; d < host.rank(); ++d) shape.push_back(host.shape()[d]);
      header[name] = {{"dtype", detail::safetensors_dtype<T>}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
    }
  }, tree);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::vector<std::uint8_t> file(8 + text.size() + data.size());
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) file[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
  std::memcpy(file.data() + 8, text.data(), text.size());
  if (!data.empty()) std::memcpy(file.data() + 8 + text.size(), data.data(), data.size());
  detail::write_file_atomically(path, file, "save_safetensors");
}

/// Writes `bytes` to `path` whole or not at all: a temporary file beside it, flushed to disk, renamed over
/// `path` (a reader never sees half a file; a crash leaves the old one). Errors name `path` and the cause.
inline void write_file_atomically(const std::string& path, std::span<const std::uint8_t> bytes) {
  detail::write_file_atomically(path, bytes, "write_file_atomically");
}
inline void write_file_atomically(const std::string& path, std::string_view text) {
  detail::write_file_atomically(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()), "write_file_atomically");
}

/// The largest header accepted (the safetensors reference implementation's bound): a length field beyond
/// it is corruption, not a header to allocate.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

namespace detail {

inline std::size_t dtype_size(const std::string& dtype) {
  if (dtype == "F64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "U8" || dtype == "I8" || dtype == "BOOL") return 1;
  if (dtype == "I64" || dtype == "U64") return 8;
  return 0;
}

/// One tensor entry of a validated header.
struct Entry {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // within the data section
};

/// A parsed and fully validated safetensors file held in memory.
struct Parsed {
  std::map<std::string, std::string> metadata;
  std::map<std::string, Entry> entries;
  const std::uint8_t* data = nullptr;  // the data section
  std::uint64_t data_size = 0;
};

/// Validates `bytes` as a safetensors file (`name` for errors): the length field within bounds, the header
/// UTF-8 JSON object, each entry's dtype known, shape non-negative, byte range inside the data section
/// and of exactly shape x dtype size, ranges neither overlapping nor leaving holes, metadata string to
/// string. Throws tg::Error naming the file and the problem.
inline Parsed parse_safetensors(const std::uint8_t* bytes, std::uint64_t size, const std::string& name) {
  const char* op = "load_safetensors";
  if (size < 8) ::tg::detail::fail(op, name, ": ", size, " bytes is too short for a safetensors file (an 8-byte header length first)");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > max_header_bytes) ::tg::detail::fail(op, name, ": header length ", n, " exceeds the format's bound of ", max_header_bytes, " bytes: the file is corrupt");
  if (n > size - 8) ::tg::detail::fail(op, name, ": header length ", n, " but only ", size - 8, " bytes follow the length field: the file is truncated");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    ::tg::detail::fail(op, name, ": the header is not valid JSON (", e.what(), ")");
  }
  if (!header.is_object()) ::tg::detail::fail(op, name, ": the header is JSON but not an object");
  Parsed p;
  p.data = bytes + 8 + n;
  p.data_size = size - 8 - n;
  for (const auto& entry : header.items()) {
    // Named copies, not structured bindings: clang 14 cannot capture those in the lambda below.
    const std::string key = entry.key();
    const nlohmann::json& value = entry.value();
    if (key == "__metadata__") {
      if (!value.is_object()) ::tg::detail::fail(op, name, ": __metadata__ must be an object of strings");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) ::tg::detail::fail(op, name, ": __metadata__ entry '", k, "' is not a string");
        p.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const auto&... what) { ::tg::detail::fail(op, name, ": tensor '", key, "': ", what...); };
    if (!value.is_object()) bad("its entry is not an object");
    if (!value.contains("dtype") || !value["dtype"].is_string()) bad("no dtype string");
    if (!value.contains("shape") || !value["shape"].is_array()) bad("no shape array");
    if (!value.contains("data_offsets") || !value["data_offsets"].is_array() || value["data_offsets"].size() != 2) bad("no data_offsets pair");
    Entry e;
    e.dtype = value["dtype"].get<std::string>();
    const std::size_t item = dtype_size(e.dtype);
    if (item == 0) bad("unknown dtype '", e.dtype, "'");
    std::uint64_t count = 1;
    for (const auto& d : value["shape"]) {
      if (!d.is_number_unsigned()) bad("shape ", value["shape"].dump(), " has an entry that is not a non-negative integer");
      const auto v = d.get<std::uint64_t>();
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) || (v != 0 && count > size / v))
        bad("shape ", value["shape"].dump(), " describes more elements than the file holds");
      count *= v;
      e.shape.push_back(static_cast<std::int64_t>(v));
    }
    if (e.shape.size() > static_cast<std::size_t>(Shape::max_rank)) bad("rank ", e.shape.size(), " is above tapegrad's ", Shape::max_rank);
    for (const auto& o : value["data_offsets"])
      if (!o.is_number_unsigned()) bad("data_offsets ", value["data_offsets"].dump(), " are not non-negative integers");
    e.begin = value["data_offsets"][0].get<std::uint64_t>();
    e.end = value["data_offsets"][1].get<std::uint64_t>();
    if (e.begin > e.end || e.end > p.data_size)
      bad("data_offsets [", e.begin, ", ", e.end, "] are not a range inside the ", p.data_size, " bytes of data: the file is truncated or corrupt");
    if (e.end - e.begin != count * item)
      bad("data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin, " bytes but shape ", value["shape"].dump(), " of ", e.dtype,
          " needs ", count * item);
    p.entries.emplace(key, std::move(e));
  }
  // The data section must be covered exactly once: no overlaps (two tensors sharing bytes) and no holes.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const auto& [k, e] : p.entries)
    if (e.end > e.begin) ranges.emplace_back(e.begin, e.end);
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t at = 0;
  for (const auto& [b, e] : ranges) {
    if (b < at) ::tg::detail::fail(op, name, ": two tensors share the bytes from ", b, " to ", std::min(at, e), ": the header is corrupt");
    if (b > at) ::tg::detail::fail(op, name, ": bytes ", at, " to ", b, " of the data belong to no tensor: the header is corrupt");
    at = e;
  }
  if (at != p.data_size) ::tg::detail::fail(op, name, ": the data section has ", p.data_size, " bytes but the tensors cover ", at, " of them");
  return p;
}

/// Reads the whole file at `path` (throws naming it when it cannot).
inline std::vector<std::uint8_t> read_all(const std::string& path, const char* op) {
  std::ifstream in(path, std::ios::binary);
  if (!in) ::tg::detail::fail(op, path, ": cannot open (", std::strerror(errno), ")");
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) ::tg::detail::fail(op, path, ": read error");
  return bytes;
}

}  // namespace detail

/// Fills `tree` from the safetensors file at `path`, matching tensors by tree path: every leaf must be in
/// the file with its own dtype and shape, and the file may hold no tensor the tree lacks. Leaves are
/// replaced by new tensors on their own device. Everything is validated before the tree is touched: on any
/// error `tree` is unchanged. Returns the file's __metadata__.
template <class Tree>
std::map<std::string, std::string> load_safetensors(const std::string& path, Tree& tree);

/// load_safetensors from a file's bytes in memory (`name` for errors).
template <class Tree>
std::map<std::string, std::string> load_safetensors_bytes(const std::uint8_t* bytes, std::size_t size, const std::string& name, Tree& tree) {
  const char* op = "load_safetensors";
  const std::string& path = name;
  const detail::Parsed parsed = detail::parse_safetensors(bytes, size, name);
  Tree loaded = tree;
  std::size_t used = 0;
  tree_for_each([&](const std::string& name, auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (!std::is_same_v<L, bool>) {
      using T = typename L::value_type;
      using D = typename L::device_type;
      const auto it = parsed.entries.find(name);
      if (it == parsed.entries.end()) ::tg::detail::fail(op, path, ": the file has no tensor '", name, "' (the tree's leaf of that path)");
      const detail::Entry& e = it->second;
      if (e.dtype != detail::safetensors_dtype<T>)
        ::tg::detail::fail(op, path, ": tensor '", name, "' is ", e.dtype, " in the file but ", detail::safetensors_dtype<T>, " in the tree");
      const Shape shape{std::span<const std::int64_t>(e.shape)};
      if (leaf.defined() && leaf.shape() != shape)
        ::tg::detail::fail(op, path, ": tensor '", name, "' has shape ", shape.str(), " in the file but ", leaf.shape().str(), " in the tree");
      std::vector<T> values(static_cast<std::size_t>(shape.numel()));
      if (!values.empty()) std::memcpy(values.data(), parsed.data + e.begin, e.end - e.begin);
      leaf = from_vector<D>(values, shape);
      ++used;
    }
  }, loaded);
  if (used != parsed.entries.size()) {
    std::string extra;
    const auto paths = tree_paths(tree);
    for (const auto& [k, e] : parsed.entries)
      if (std::find(paths.begin(), paths.end(), k) == paths.end()) extra += (extra.empty() ? "'" : ", '") + k + "'";
    ::tg::detail::fail(op, path, ": the file holds tensors the tree lacks: ", extra, "; load it into the tree it was saved from");
  }
  tree = std::move(loaded);
  return parsed.metadata;
}

template <class Tree>
std::map<std::string, std::string> load_safetensors(const std::string& path, Tree& tree) {
  const std::vector<std::uint8_t> bytes = detail::read_all(path, "load_safetensors");
  return load_safetensors_bytes(bytes.data(), bytes.size(), path, tree);
}

}  // namespace io
TG_END_NAMESPACE
