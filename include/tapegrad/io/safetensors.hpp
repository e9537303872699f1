// Saving a pytree of tensors (parameters, optimizer state) in the safetensors format: an 8-byte
// little-endian header length, a JSON header naming each tensor by its tree path with dtype, shape and
// byte range, then the raw little-endian data. Loads in Python with the `safetensors` package, or with
// the standard library and NumPy. Writes are atomic: a temporary file in the same directory, fsync,
// rename, so a crash mid-write leaves any previous file intact.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tapegrad/core/error.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/tree/pytree.hpp"

namespace tg::io {

namespace detail {

template <class T> inline constexpr const char* safetensors_dtype = nullptr;
template <> inline constexpr const char* safetensors_dtype<float> = "F32";
template <> inline constexpr const char* safetensors_dtype<double> = "F64";
template <> inline constexpr const char* safetensors_dtype<bf16> = "BF16";
template <> inline constexpr const char* safetensors_dtype<std::int32_t> = "I32";
template <> inline constexpr const char* safetensors_dtype<std::uint32_t> = "U32";
template <> inline constexpr const char* safetensors_dtype<std::uint8_t> = "U8";

/// Writes `bytes` to `path` atomically: `path`.tmp-<pid>, fsync, rename over `path`, fsync the directory.
inline void write_file_atomically(const std::string& path, const std::vector<std::uint8_t>& bytes, const char* op) {
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

}  // namespace tg::io
