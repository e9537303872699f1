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

namespace io_tests {

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

namespace {

/// A safetensors file from a header text and a data section, written as is (for the corrupt cases).
void write_st(const std::string& path, const std::string& header, const std::vector<std::uint8_t>& data, std::uint64_t length_field = 0) {
  const std::uint64_t n = length_field ? length_field : header.size();
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

struct Pair {
  tg::Tensor<float> a;
  tg::Tensor<std::int32_t> b;
};
TG_PYTREE(Pair, a, b)

}  // namespace

TEST_CASE("write_file_atomically replaces a file whole and names the path when it cannot", "[io]") {
  const fs::path dir = fs::temp_directory_path() / ("tg_atomic_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "out.txt").string();
  tg::io::write_file_atomically(path, std::string_view("first version"));
  tg::io::write_file_atomically(path, std::string_view("second"));
  const auto bytes = file_bytes(path);
  CHECK(std::string(bytes.begin(), bytes.end()) == "second");
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);  // no temporary file left
  const std::vector<std::uint8_t> raw{0, 1, 2, 255};
  tg::io::write_file_atomically(path, std::span<const std::uint8_t>(raw));
  CHECK(file_bytes(path) == raw);
  CHECK_THROWS_WITH(tg::io::write_file_atomically((dir / "missing" / "x.txt").string(), std::string_view("x")),
                    Contains("[write_file_atomically] " + (dir / "missing" / "x.txt").string() + ": cannot create"));
  fs::remove_all(dir);
}

TEST_CASE("load_safetensors round-trips every dtype and leaves the tree unchanged on any error", "[io]") {
  const fs::path dir = fs::temp_directory_path() / ("tapegrad_test_io_load_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "t.safetensors").string();
  io_test::Mixed tree{tg::arange<float>(6).reshape({2, 3}), tg::from_vector(std::vector<double>{0.5, -2.0}, {2}),
                      tg::from_vector(std::vector<tg::bf16>{tg::bf16(1.5f)}, {1}), tg::from_vector(std::vector<std::int32_t>{7}, tg::Shape{}),
                      {tg::from_vector(std::vector<std::uint8_t>{1, 0, 1}, {3})}};
  tg::io::save_safetensors(path, tree, {{"step", "3"}});
  io_test::Mixed target = tg::tree_map([](const auto& leaf) { return leaf * 0; }, tree);
  target.count = tg::zeros<std::int32_t>({});
  target.masks = {tg::zeros<std::uint8_t>({3})};
  const auto meta = tg::io::load_safetensors(path, target);
  CHECK(meta.at("step") == "3");
  CHECK(target.w.to_vector() == tree.w.to_vector());
  CHECK(target.d.to_vector() == tree.d.to_vector());
  CHECK(target.h.to_vector()[0].bits == tg::bf16(1.5f).bits);
  CHECK(target.count.item() == 7);
  CHECK(target.masks[0].to_vector() == tree.masks[0].to_vector());

  // The target's structure is the contract: dtype, shape, names.
  Pair pair{tg::ones<float>({2}), tg::ones<std::int32_t>({1})};
  auto rejects = [&](const std::string& file, const std::string& what) {
    const auto before_a = pair.a.to_vector();
    CHECK_THROWS_WITH(tg::io::load_safetensors(file, pair), Contains("[load_safetensors] " + file) && Contains(what));
    CHECK(pair.a.to_vector() == before_a);  // untouched
  };
  const std::string f = (dir / "bad.safetensors").string();
  auto floats = [](std::vector<float> v) {
    std::vector<std::uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  auto both = floats({5, 6});
  both.insert(both.end(), {9, 0, 0, 0});
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})";
  write_st(f, good, both);
  tg::io::load_safetensors(f, pair);
  CHECK(pair.a.to_vector() == std::vector<float>{5, 6});
  CHECK(pair.b.to_vector() == std::vector<std::int32_t>{9});
  pair = Pair{tg::ones<float>({2}), tg::ones<std::int32_t>({1})};

  rejects(path, "the file has no tensor 'a'");
  write_st(f, R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "tensor 'a' is F64 in the file but F32 in the tree");
  write_st(f, R"({"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "tensor 'a' has shape (1, 2) in the file but (2,) in the tree");
  write_st(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]},"c":{"dtype":"U8","shape":[0],"data_offsets":[12,12]}})", both);
  rejects(f, "the file holds tensors the tree lacks: 'c'");

  // Corrupt files.
  write_st(f, "", {});
  rejects(f, "the header is not valid JSON");
  { std::ofstream(f) << "abc"; }
  rejects(f, "3 bytes is too short for a safetensors file");
  write_st(f, good, both, 1ull << 40);
  rejects(f, "header length 1099511627776 exceeds the format's bound");
  write_st(f, good, both, good.size() + 100);
  rejects(f, "but only " + std::to_string(good.size() + 12) + " bytes follow the length field: the file is truncated");
  write_st(f, "[1, 2]", {});
  rejects(f, "the header is JSON but not an object");
  write_st(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})",
           std::vector<std::uint8_t>(both.begin(), both.begin() + 10));
  rejects(f, "tensor 'b': data_offsets [8, 12] are not a range inside the 10 bytes of data");
  write_st(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[4,8]}})", both);
  rejects(f, "two tensors share the bytes from 4 to 8");
  write_st(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"b":{"dtype":"I32","shape":[1],"data_offsets":[12,16]}})",
           std::vector<std::uint8_t>(16, 0));
  rejects(f, "bytes 0 to 4 of the data belong to no tensor");
  write_st(f, R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "data_offsets [0, 8] hold 8 bytes but shape [3] of F32 needs 12");
  write_st(f, R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "shape [-2] has an entry that is not a non-negative integer");
  write_st(f, R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "describes more elements than the file holds");
  write_st(f, R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "tensor 'a': unknown dtype 'Q7'");
  write_st(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "data_offsets [8, 0] are not a range");
  write_st(f, R"({"__metadata__":{"step":3},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "__metadata__ entry 'step' is not a string");
  write_st(f, R"({"a":{"dtype":"F32","shape":[2]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})", both);
  rejects(f, "tensor 'a': no data_offsets pair");
  rejects((dir / "missing.safetensors").string(), "cannot open (No such file or directory)");
  fs::remove_all(dir);
}

}  // namespace io_tests
