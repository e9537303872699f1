// tg::random::numpy against NumPy's own outputs: SeedSequence, PCG64, and the Generator's permutation, choice
// and integers, for several seeds, every value exact (tests/data/numpy_random_golden.txt from
// scripts/gen_numpy_golden.py).
#include "test_common.hpp"

#include <tapegrad/random/numpy.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace numpy_random_tests {

using Catch::Matchers::Contains;
namespace np = tg::random::numpy;

namespace {

// The seeds the script writes, as Python spells them in the section names.
constexpr std::uint64_t seeds[] = {0, 1, 7, 42, 12345, (1ULL << 32) + 5, (1ULL << 63) - 1, ~0ULL};

/// Every section of the golden file: name -> its values as written (hexadecimal or decimal).
const std::map<std::string, std::vector<std::string>>& golden() {
  static const std::map<std::string, std::vector<std::string>> table = [] {
    std::map<std::string, std::vector<std::string>> t;
    const std::string path = test_data_dir() + "/numpy_random_golden.txt";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path);
    std::string line, name;
    std::size_t count = 0;
    std::vector<std::string>* current = nullptr;
    const auto close = [&] {
      if (current != nullptr && current->size() != count)
        throw std::runtime_error(path + ": section " + name + " holds " + std::to_string(current->size()) +
                                 " values, not " + std::to_string(count));
    };
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream ls(line);
      if (line[0] == '@') {
        close();
        std::string at;
        ls >> at >> name >> count;
        current = &t[name];
      } else {
        if (current == nullptr) throw std::runtime_error("value before any section in " + path);
        for (std::string v; ls >> v;) current->push_back(v);
      }
    }
    close();
    return t;
  }();
  return table;
}

const std::vector<std::string>& section(const std::string& name) {
  const auto it = golden().find(name);
  if (it == golden().end()) throw std::runtime_error("no golden section " + name);
  return it->second;
}

std::vector<std::uint64_t> hex_u64(const std::string& name) {
  std::vector<std::uint64_t> v;
  for (const auto& s : section(name)) v.push_back(std::stoull(s, nullptr, 16));
  return v;
}

std::vector<std::int64_t> dec_i64(const std::string& name) {
  std::vector<std::int64_t> v;
  for (const auto& s : section(name)) v.push_back(std::stoll(s));
  return v;
}

/// FNV-1a 64 over the little-endian bytes of the int64 values, as the script hashes the large arrays.
std::uint64_t fnv1a(const std::vector<std::int64_t>& values) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (const std::int64_t x : values)
    for (int b = 0; b < 8; ++b) h = (h ^ ((static_cast<std::uint64_t>(x) >> (8 * b)) & 0xff)) * 0x100000001B3ULL;
  return h;
}

/// got == the golden section, with the first mismatch named (a 60000-element diff is useless in full).
void require_equal(const std::string& name, const std::vector<std::int64_t>& got) {
  const auto want = dec_i64(name);
  INFO(name);
  REQUIRE(got.size() == want.size());
  const auto [g, w] = std::mismatch(got.begin(), got.end(), want.begin());
  if (g != got.end()) FAIL("first mismatch at index " << (g - got.begin()) << ": got " << *g << ", NumPy " << *w);
  SUCCEED();
}

std::string s(std::uint64_t seed) { return std::to_string(seed); }

}  // namespace

TEST_CASE("numpy::SeedSequence mixes an integer seed into NumPy's pool and state words", "[numpy]") {
  for (const std::uint64_t seed : seeds) {
    INFO("seed " << seed);
    const np::SeedSequence ss(seed);
    const auto pool = hex_u64("pool/" + s(seed));
    REQUIRE(std::vector<std::uint64_t>(ss.pool().begin(), ss.pool().end()) == pool);
    const auto w32 = ss.generate_state32(4);
    REQUIRE(std::vector<std::uint64_t>(w32.begin(), w32.end()) == hex_u64("state32/" + s(seed)));
    REQUIRE(ss.generate_state64(4) == hex_u64("state64/" + s(seed)));
  }
}

TEST_CASE("numpy::PCG64 seeds, steps and outputs like np.random.PCG64", "[numpy]") {
  for (const std::uint64_t seed : seeds) {
    INFO("seed " << seed);
    np::PCG64 bg(seed);
    const auto st = hex_u64("pcg_state/" + s(seed));  // state high, low, inc high, low
    REQUIRE(static_cast<std::uint64_t>(bg.state().state >> 64) == st[0]);
    REQUIRE(static_cast<std::uint64_t>(bg.state().state) == st[1]);
    REQUIRE(static_cast<std::uint64_t>(bg.state().inc >> 64) == st[2]);
    REQUIRE(static_cast<std::uint64_t>(bg.state().inc) == st[3]);
    REQUIRE_FALSE(bg.state().has_uint32);

    std::vector<std::uint64_t> raw;
    for (int i = 0; i < 8; ++i) raw.push_back(bg.next64());
    REQUIRE(raw == hex_u64("raw64/" + s(seed)));

    np::PCG64 bg32(seed);
    std::vector<std::uint64_t> halves;
    for (int i = 0; i < 9; ++i) halves.push_back(bg32.next32());
    REQUIRE(halves == hex_u64("next32/" + s(seed)));
    REQUIRE(bg32.state().has_uint32);  // nine halves leave the tenth buffered
  }
}

TEST_CASE("numpy::PCG64 next32 buffers the high half across next64 calls, as pcg64_next32 does", "[numpy]") {
  const auto raw = hex_u64("raw64/0");
  np::PCG64 bg(0);
  REQUIRE(bg.next32() == static_cast<std::uint32_t>(raw[0]));
  REQUIRE(bg.next64() == raw[1]);  // next64 neither uses nor clears the buffer
  REQUIRE(bg.next32() == static_cast<std::uint32_t>(raw[0] >> 32));
  REQUIRE(bg.next32() == static_cast<std::uint32_t>(raw[2]));
}

TEST_CASE("numpy::Generator::permutation equals default_rng(seed).permutation(n)", "[numpy]") {
  for (const std::uint64_t seed : seeds) {
    INFO("seed " << seed);
    for (const std::int64_t n : {0, 1, 2, 10, 1000})
      require_equal("permutation/" + s(seed) + "/" + std::to_string(n), np::default_rng(seed).permutation(n));
    const auto p = np::Generator(seed).permutation(60000);
    if (seed == 1 || seed == 7 || seed == 42) require_equal("permutation/" + s(seed) + "/60000", p);
    REQUIRE(fnv1a(p) == hex_u64("fnv1a/permutation/" + s(seed) + "/60000").at(0));
  }
}

TEST_CASE("numpy::Generator::choice equals choice(n, k, replace=False) in both of NumPy's branches", "[numpy]") {
  const std::pair<std::int64_t, std::int64_t> cases[] = {
      {10000, 25}, {60000, 1000}, {100, 100}, {50, 3},       {5, 0},         {1, 1},
      {20000, 400}, {20000, 401}, {10001, 201}, {10000, 5000}, {1LL << 40, 10}, {(1LL << 32) + 2, 4}};
  for (const std::uint64_t seed : seeds) {
    INFO("seed " << seed);
    for (const auto& [n, k] : cases)
      require_equal("choice/" + s(seed) + "/" + std::to_string(n) + "/" + std::to_string(k),
                    np::Generator(seed).choice(n, k));
    const auto all = np::Generator(seed).choice(30000, 30000);
    REQUIRE(fnv1a(all) == hex_u64("fnv1a/choice/" + s(seed) + "/30000/30000").at(0));
  }
}

TEST_CASE("numpy::Generator::integers equals integers(low, high, size=20) (int64)", "[numpy]") {
  const std::pair<std::int64_t, std::int64_t> ranges[] = {
      {0, 10}, {-5, 5}, {0, 1}, {0, 3LL << 30}, {0, 1LL << 32}, {0, (1LL << 32) + 1}, {0, 1LL << 33},
      {-(1LL << 62), INT64_MAX}, {INT64_MIN, INT64_MAX}};
  for (const std::uint64_t seed : seeds) {
    INFO("seed " << seed);
    for (const auto& [lo, hi] : ranges) {
      np::Generator g(seed);
      std::vector<std::int64_t> got;
      for (int i = 0; i < 20; ++i) got.push_back(g.integers(lo, hi));
      require_equal("integers/" + s(seed) + "/" + std::to_string(lo) + "/" + std::to_string(hi), got);
    }
  }
}

TEST_CASE("numpy::Generator carries next32's buffered half from one call into the next", "[numpy]") {
  for (const std::uint64_t seed : seeds) {
    INFO("seed " << seed);
    np::Generator g(seed);
    std::vector<std::int64_t> seq{g.integers(0, 1LL << 32)};
    const auto append = [&](const std::vector<std::int64_t>& v) { seq.insert(seq.end(), v.begin(), v.end()); };
    append(g.permutation(10));
    append(g.choice(50, 3));
    seq.push_back(g.integers(0, 10));
    append(g.choice(30000, 1000));
    append(g.permutation(7));
    seq.push_back(g.integers(0, 1LL << 40));
    seq.push_back(g.integers(0, 1LL << 32));
    require_equal("sequence/" + s(seed), seq);
  }
}

TEST_CASE("numpy: the codelab's shuffle and sample picks are NumPy's", "[numpy]") {
  // np.random.default_rng(0).permutation(60000) and np.random.default_rng(7).choice(10000, 25, replace=False)
  require_equal("codelab/permutation", np::default_rng(0).permutation(60000));
  require_equal("codelab/choice", np::default_rng(7).choice(10000, 25));
}

TEST_CASE("numpy::Generator::choice returns k distinct indices in [0, n) on both branches", "[numpy]") {
  np::Generator g(3);
  const std::pair<std::int64_t, std::int64_t> cases[] = {{7, 7}, {1000, 999}, {10001, 10001}, {50000, 1001}};
  for (const auto& [n, k] : cases) {
    const auto c = g.choice(n, k);
    REQUIRE(static_cast<std::int64_t>(c.size()) == k);
    const std::set<std::int64_t> distinct(c.begin(), c.end());
    REQUIRE(static_cast<std::int64_t>(distinct.size()) == k);
    REQUIRE(*distinct.begin() >= 0);
    REQUIRE(*distinct.rbegin() < n);
  }
}

TEST_CASE("numpy::Generator rejects bad arguments with tg::Error", "[numpy]") {
  np::Generator g(0);
  REQUIRE_THROWS_WITH(g.permutation(-1), Contains("[numpy::permutation]") && Contains("got -1"));
  REQUIRE_THROWS_WITH(g.choice(10, 11), Contains("[numpy::choice]") && Contains("k = 11") && Contains("n = 10"));
  REQUIRE_THROWS_WITH(g.choice(10, -1), Contains("[numpy::choice]") && Contains("k must be >= 0, got -1"));
  REQUIRE_THROWS_WITH(g.choice(0, 1), Contains("[numpy::choice]") && Contains("n must be > 0"));
  REQUIRE_THROWS_WITH(g.choice(-3, 0), Contains("[numpy::choice]") && Contains("n = -3"));
  REQUIRE_THROWS_WITH(g.integers(5, 5), Contains("[numpy::integers]") && Contains("low = 5, high = 5"));
  REQUIRE_THROWS_AS(g.choice(10, 11), tg::Error);
  REQUIRE(g.choice(0, 0).empty());  // NumPy allows an empty population when nothing is taken
  // The failed calls drew nothing: the generator is still at default_rng(0)'s start.
  require_equal("permutation/0/10", g.permutation(10));
}

}  // namespace numpy_random_tests
