// tg::io::save_safetensors: the file's layout (header length, JSON header with dtypes, shapes and byte
// ranges named by tree paths, metadata, 8-byte aligned data), the bytes of every dtype, atomic
// replacement, and a clear error for a directory that does not exist.
#include "test_common.hpp"

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace io_test {
struct Mixed {
  tg::Tensor<float> w;
  tg::Tensor<double> d;
  tg::Tensor<tg::bf16> h;
  tg::Tensor<std::int32_t> count;
  std::vector<tg::Tensor<std::uint8_t>> masks;
};
TG_PYTREE(Mixed, w, d, h, count, masks)
}  // namespace io_test

namespace {
std::vector<std::uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
}  // namespace

TEST_CASE("save_safetensors writes the safetensors layout with tree paths, dtypes and metadata", "[io]") {
  const fs::path dir = fs::temp_directory_path() / ("tapegrad_test_io_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "tree.safetensors").string();
  io_test::Mixed tree{tg::arange<float>(6).reshape({2, 3}), tg::from_vector(std::vector<double>{0.5, -2.0}, {2}),
                      tg::from_vector(std::vector<tg::bf16>{tg::bf16(1.5f)}, {1}), tg::from_vector(std::vector<std::int32_t>{7}, tg::Shape{}),
                      {tg::from_vector(std::vector<std::uint8_t>{1, 0, 1}, {3})}};
  { std::ofstream(path) << "an older file"; }  // replaced whole
  tg::io::save_safetensors(path, tree, {{"step", "12"}});

  const auto bytes = file_bytes(path);
  REQUIRE(bytes.size() > 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<std::size_t>(i)];
  CHECK((8 + n) % 8 == 0);
  const auto header = nlohmann::json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n)));
  CHECK(header["__metadata__"]["step"] == "12");
  const std::uint8_t* data = bytes.data() + 8 + n;
  auto check = [&](const std::string& name, const char* dtype, std::vector<std::int64_t> shape, const void* expect, std::size_t nbytes) {
    INFO(name);
    REQUIRE(header.contains(name));
    CHECK(header[name]["dtype"] == dtype);
    CHECK(header[name]["shape"].get<std::vector<std::int64_t>>() == shape);
    const auto off = header[name]["data_offsets"].get<std::vector<std::size_t>>();
    REQUIRE(off.size() == 2);
    REQUIRE(off[1] - off[0] == nbytes);
    REQUIRE(8 + n + off[1] <= bytes.size());
    CHECK(std::memcmp(data + off[0], expect, nbytes) == 0);
  };
  const auto w = tree.w.to_vector();
  check("w", "F32", {2, 3}, w.data(), 24);
  const double d[2] = {0.5, -2.0};
  check("d", "F64", {2}, d, 16);
  const std::uint16_t h = tg::bf16(1.5f).bits;
  check("h", "BF16", {1}, &h, 2);
  const std::int32_t c = 7;
  check("count", "I32", {}, &c, 4);
  const std::uint8_t m[3] = {1, 0, 1};
  check("masks[0]", "U8", {3}, m, 3);
  CHECK(header.size() == 6);
  CHECK(8 + n + 24 + 16 + 2 + 4 + 3 == bytes.size());
  // Nothing but the file itself is left in the directory (the temporary was renamed).
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);

  CHECK_THROWS_WITH(tg::io::save_safetensors((dir / "no" / "such" / "dir.safetensors").string(), tree),
                    Contains("[save_safetensors]") && Contains("no/such/dir.safetensors: cannot create") &&
                        Contains("No such file or directory"));
  fs::remove_all(dir);
}
