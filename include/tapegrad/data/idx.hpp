// IDX files (the MNIST family's format), raw or gzip-compressed: read, validate, return a host tensor.
// Format: two zero bytes, a type code (0x08 = unsigned byte), the rank, then one big-endian uint32 size
// per dimension, then the elements in row-major order and nothing after them.
#pragma once

#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/base/shape.hpp"
#include "tapegrad/core/tensor.hpp"

TG_BEGIN_NAMESPACE
namespace data {

/// The bytes of `path`, decompressed when it is gzip (zlib detects it; other files are read as they are).
/// Throws naming the file for a missing or unreadable file and for a truncated or corrupt gzip stream.
inline std::vector<std::uint8_t> read_file_decompressed(const std::string& path) {
  struct Closer {
    void operator()(gzFile f) const { (void)gzclose(f); }
  };
  errno = 0;
  std::unique_ptr<gzFile_s, Closer> file(gzopen(path.c_str(), "rb"));
  if (!file) detail::fail("read_idx", path, ": cannot open (", errno ? std::strerror(errno) : "out of memory", ")");
  (void)gzbuffer(file.get(), 1 << 17);
  std::vector<std::uint8_t> bytes;
  constexpr unsigned chunk = 1u << 20;
  for (;;) {
    const std::size_t at = bytes.size();
    bytes.resize(at + chunk);
    const int got = gzread(file.get(), bytes.data() + at, chunk);
    if (got < 0) {
      int code = 0;
      const char* message = gzerror(file.get(), &code);
      detail::fail("read_idx", path, ": corrupt gzip data after ", at, " decompressed bytes (zlib: ", message,
           "); delete the file and fetch it again");
    }
    bytes.resize(at + static_cast<std::size_t>(got));
    if (got == 0) break;
  }
  // gzread returns 0 both at a clean end and at a stream cut short; only gzerror tells them apart.
  int code = Z_OK;
  const char* message = gzerror(file.get(), &code);
  if (code != Z_OK && code != Z_STREAM_END)
    detail::fail("read_idx", path, ": the gzip stream is truncated or corrupt after ", bytes.size(), " decompressed bytes (zlib: ",
         message, "); delete the file and fetch it again");
  return bytes;
}

/// Parses an IDX payload of unsigned bytes (type code 0x08) into a host uint8 tensor of its shape.
/// `name` (the file) is used in errors: a wrong magic number, an unsupported type code, a rank of 0 or
/// above 8, or a length that is not exactly the header's dimensions' product.
inline Tensor<std::uint8_t> parse_idx(const std::vector<std::uint8_t>& bytes, const std::string& name) {
  if (bytes.size() < 4)
    detail::fail("read_idx", name, ": ", bytes.size(), " bytes is too short for an IDX header (4 bytes of magic number)");
  if (bytes[0] != 0 || bytes[1] != 0)
    detail::fail("read_idx", name, ": not an IDX file: the magic number starts with bytes ", int(bytes[0]), ", ", int(bytes[1]),
         " instead of 0, 0");
  if (bytes[2] != 0x08)
    detail::fail("read_idx", name, ": IDX type code ", int(bytes[2]), " is not supported; only unsigned bytes (8), as in the MNIST family, are");
  const int rank = bytes[3];
  if (rank < 1 || rank > Shape::max_rank)
    detail::fail("read_idx", name, ": rank ", rank, " in the header; tapegrad reads ranks 1 to ", Shape::max_rank);
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(rank);
  if (bytes.size() < header)
    detail::fail("read_idx", name, ": the header of a rank-", rank, " file needs ", header, " bytes, the file has ", bytes.size());
  std::vector<std::int64_t> dims(static_cast<std::size_t>(rank));
  std::uint64_t n = 1;
  for (int d = 0; d < rank; ++d) {
    const std::uint8_t* p = bytes.data() + 4 + 4 * d;
    const std::uint32_t size = (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
    dims[static_cast<std::size_t>(d)] = size;
    n *= size;
    if (n > bytes.size())
      detail::fail("read_idx", name, ": the header's dimensions (dimension ", d, " is ", size, ") describe more elements than the file's ",
           bytes.size(), " bytes hold: the file is truncated or its header is corrupt");
  }
  const Shape shape{std::span<const std::int64_t>(dims)};
  if (bytes.size() - header != n)
    detail::fail("read_idx", name, ": the header says shape ", shape.str(), " = ", n, " bytes of data, but the file has ", bytes.size() - header,
         bytes.size() - header < n ? " (truncated)" : " (trailing bytes)");
  return from_span<Cpu>(std::span<const std::uint8_t>(bytes.data() + header, n), shape);
}

/// Reads an IDX file of unsigned bytes, raw or gzip-compressed, into a host tensor (tg::data::parse_idx
/// says what is validated).
inline Tensor<std::uint8_t> read_idx(const std::string& path) { return parse_idx(read_file_decompressed(path), path); }

}  // namespace data
TG_END_NAMESPACE
