// tg::data: IDX files raw and gzip-compressed, every way a file can be wrong (each error names the file
// and the problem), and fixed batches (scaling, the seeded shuffle's order, the trimmed tail, labels).
#include "test_common.hpp"

#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <unistd.h>
#include <fstream>
#include <string>
#include <vector>

namespace data_tests {

using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

/// A fresh directory under the system's temporary directory, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("tapegrad_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::vector<std::uint8_t> idx_bytes(const std::vector<std::uint32_t>& dims, std::uint8_t type = 0x08) {
  std::vector<std::uint8_t> b{0, 0, type, static_cast<std::uint8_t>(dims.size())};
  std::size_t n = 1;
  for (std::uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<std::uint8_t>(d >> s));
    n *= d;
  }
  for (std::size_t i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(i * 7 % 251));
  return b;
}

void write_raw(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void write_gz(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

std::vector<std::uint8_t> read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("read_idx reads raw and gzip-compressed IDX files", "[data]") {
  TempDir dir;
  const auto bytes = idx_bytes({3, 4, 5});
  write_raw(dir.file("a.idx"), bytes);
  write_gz(dir.file("a.idx.gz"), bytes);
  for (const auto& name : {"a.idx", "a.idx.gz"}) {
    const auto t = tg::data::read_idx(dir.file(name));
    CHECK(t.shape() == tg::Shape{3, 4, 5});
    CHECK(t.to_vector() == std::vector<std::uint8_t>(bytes.begin() + 16, bytes.end()));
  }
  CHECK(tg::data::read_file_decompressed(dir.file("a.idx.gz")) == bytes);
  CHECK(tg::data::read_idx(dir.file("a.idx")).shape() == tg::data::parse_idx(bytes, "x").shape());
}

TEST_CASE("read_idx rejects every malformed file with the file's name and the problem", "[data][errors]") {
  TempDir dir;
  const auto good = idx_bytes({6, 7});
  auto expect = [&](const std::vector<std::uint8_t>& bytes, const std::string& what, bool gz = false) {
    const std::string path = dir.file(gz ? "bad.gz" : "bad.idx");
    if (gz) write_gz(path, bytes);
    else write_raw(path, bytes);
    CHECK_THROWS_WITH(tg::data::read_idx(path), Contains(path) && Contains(what));
  };
  CHECK_THROWS_WITH(tg::data::read_idx(dir.file("missing.gz")), Contains("missing.gz: cannot open (No such file or directory)"));
  expect({0, 0}, "too short for an IDX header");
  auto magic = good;
  magic[0] = 0x1f, magic[1] = 0x0b;
  expect(magic, "not an IDX file: the magic number starts with bytes 31, 11");
  auto type = good;
  type[2] = 0x0D;
  expect(type, "IDX type code 13 is not supported");
  auto rank0 = good;
  rank0[3] = 0;
  expect(rank0, "rank 0 in the header");
  expect({0, 0, 8, 3, 0, 0}, "the header of a rank-3 file needs 16 bytes, the file has 6");
  expect(std::vector<std::uint8_t>(good.begin(), good.end() - 1), "the header says shape (6, 7) = 42 bytes of data, but the file has 41 (truncated)");
  auto trailing = good;
  trailing.push_back(9);
  expect(trailing, "the header says shape (6, 7) = 42 bytes of data, but the file has 43 (trailing bytes)");
  auto big = idx_bytes({2, 3});
  big[7] = 4;  // dimension 0 says 4 rows where 2 are stored
  expect(big, "the header says shape (4, 3) = 12 bytes of data, but the file has 6 (truncated)", true);
  auto huge = good;
  huge[4] = 0x7f;  // ~2^30 rows
  expect(huge, "describe more elements than the file's");

  // gzip damage: a stream cut short, and flipped bytes in the compressed data.
  write_gz(dir.file("ok.gz"), idx_bytes({64, 64}));
  const auto gz = read_raw(dir.file("ok.gz"));
  write_raw(dir.file("cut.gz"), std::vector<std::uint8_t>(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
  CHECK_THROWS_WITH(tg::data::read_idx(dir.file("cut.gz")), Contains("cut.gz") && Contains("truncated or corrupt"));
  auto flipped = gz;
  for (std::size_t i = 20; i < 60; ++i) flipped[i] ^= 0x5a;
  write_raw(dir.file("flipped.gz"), flipped);
  CHECK_THROWS_WITH(tg::data::read_idx(dir.file("flipped.gz")), Contains("flipped.gz") && Contains("corrupt"));
}

TEST_CASE("fixed_batches scales, shuffles in permutation order, trims the tail and checks labels", "[data]") {
  const std::int64_t n = 23;
  std::vector<std::uint8_t> px(static_cast<std::size_t>(n * 2 * 3)), lab(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < px.size(); ++i) px[i] = static_cast<std::uint8_t>(i % 256);
  for (std::size_t i = 0; i < lab.size(); ++i) lab[i] = static_cast<std::uint8_t>(i % 10);
  const auto images = tg::from_vector(px, {n, 2, 3});
  const auto labels = tg::from_vector(lab, {n});

  const auto plain = tg::data::fixed_batches<tg::Cpu>(images, labels, 5, 10);
  REQUIRE(plain.size() == 4);  // 23 / 5, three examples dropped
  CHECK(plain[1].x.shape() == tg::Shape{5, 6});
  CHECK(plain[1].y.to_vector() == std::vector<std::int32_t>{5, 6, 7, 8, 9});
  CHECK(plain[1].x.at({0, 0}) == static_cast<float>(px[30]) / 255.0f);
  CHECK(plain[3].x.at({4, 5}) == static_cast<float>(px[19 * 6 + 5]) / 255.0f);

  const auto key = tg::random::key(7);
  const auto order = tg::random::permutation(key, n).to_vector();
  const auto shuffled = tg::data::fixed_batches<tg::Cpu>(images, labels, 5, 10, key);
  REQUIRE(shuffled.size() == 4);
  for (std::int64_t b = 0; b < 4; ++b)
    for (std::int64_t r = 0; r < 5; ++r) {
      const auto src = order[static_cast<std::size_t>(b * 5 + r)];
      CHECK(shuffled[static_cast<std::size_t>(b)].y.at({r}) == src % 10);
      CHECK(shuffled[static_cast<std::size_t>(b)].x.at({r, 2}) == static_cast<float>(px[static_cast<std::size_t>(src * 6 + 2)]) / 255.0f);
    }

  // Shards: rank r's batches are the r-th halves of the global batches, in order.
  const auto half0 = tg::data::fixed_batches<tg::Cpu>(images, labels, 10, 10, key, 0, 2);
  const auto half1 = tg::data::fixed_batches<tg::Cpu>(images, labels, 10, 10, key, 1, 2);
  const auto whole = tg::data::fixed_batches<tg::Cpu>(images, labels, 10, 10, key);
  REQUIRE(half0.size() == 2);
  REQUIRE(half1.size() == 2);
  for (std::size_t b = 0; b < 2; ++b) {
    const auto y = whole[b].y.to_vector(), y0 = half0[b].y.to_vector(), y1 = half1[b].y.to_vector();
    CHECK(std::vector<std::int32_t>(y.begin(), y.begin() + 5) == y0);
    CHECK(std::vector<std::int32_t>(y.begin() + 5, y.end()) == y1);
    CHECK(half1[b].x.at({4, 5}) == whole[b].x.at({9, 5}));
  }
  CHECK_THROWS_WITH(tg::data::fixed_batches<tg::Cpu>(images, labels, 5, 10, key, 0, 2), Contains("batch size 5 does not split into 2 equal shards"));

  // A given order (NumPy's, as the codelab shuffles): the batches take the examples in exactly that order.
  const auto numpy_order = tg::random::numpy::default_rng(0).permutation(n);
  const auto by_numpy = tg::data::fixed_batches<tg::Cpu>(images, labels, 5, 10, std::span<const std::int64_t>(numpy_order));
  REQUIRE(by_numpy.size() == 4);
  for (std::int64_t b = 0; b < 4; ++b)
    for (std::int64_t r = 0; r < 5; ++r) {
      const auto src = numpy_order[static_cast<std::size_t>(b * 5 + r)];
      CHECK(by_numpy[static_cast<std::size_t>(b)].y.at({r}) == src % 10);
      CHECK(by_numpy[static_cast<std::size_t>(b)].x.at({r, 4}) == static_cast<float>(px[static_cast<std::size_t>(src * 6 + 4)]) / 255.0f);
    }
  std::vector<std::int64_t> bad_order(numpy_order.begin(), numpy_order.end());
  bad_order[3] = bad_order[4];
  CHECK_THROWS_WITH(tg::data::fixed_batches<tg::Cpu>(images, labels, 5, 10, std::span<const std::int64_t>(bad_order)),
                    Contains("[fixed_batches] the order is not a permutation of [0, 23): index " + std::to_string(bad_order[4]) + " appears twice"));
  CHECK_THROWS_WITH(tg::data::fixed_batches<tg::Cpu>(images, labels, 5, 10, std::span<const std::int64_t>(bad_order.data(), 20)),
                    Contains("an order of 20 indices for 23 examples"));

  lab[17] = 10;
  CHECK_THROWS_WITH(tg::data::fixed_batches<tg::Cpu>(images, tg::from_vector(lab, {n}), 5, 10),
                    Contains("[fixed_batches] label 10 of example 17 is outside [0, 10)"));
  CHECK_THROWS_WITH(tg::data::fixed_batches<tg::Cpu>(images, labels, 24, 10), Contains("batch size 24 must be in [1, 23]"));
  CHECK_THROWS_WITH(tg::data::fixed_batches<tg::Cpu>(images, tg::from_vector(std::vector<std::uint8_t>(4), {4}), 2, 10),
                    Contains("must hold the same number of examples"));
}

}  // namespace data_tests
