// The PRNG: Threefry's known-answer vectors, JAX's golden values, and distribution sanity.
// Built for the CPU, and by nvcc for CUDA (TG_TEST_CUDA), where the numbers are drawn on the GPU.
#include "test_common.hpp"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

namespace random_tests {

using D = TestDevice;
namespace rnd = tg::random;

namespace {

/// One array of tests/data/jax_random_golden.txt: its size and the sampled (index, bits) pairs.
struct Golden {
  std::int64_t size = 0;
  std::vector<std::pair<std::int64_t, std::uint32_t>> values;
};

const std::map<std::string, Golden>& golden() {
  static const std::map<std::string, Golden> table = [] {
    std::map<std::string, Golden> t;
    const std::string path = test_data_dir() + "/jax_random_golden.txt";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path);
    std::string line;
    Golden* current = nullptr;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream ls(line);
      if (line[0] == '@') {
        std::string at, name;
        std::int64_t size = 0;
        ls >> at >> name >> size;
        current = &t[name];
        current->size = size;
      } else {
        std::int64_t index = 0;
        std::uint32_t bits = 0;
        ls >> index >> std::hex >> bits;
        if (!ls || current == nullptr) throw std::runtime_error("bad line in " + path + ": " + line);
        current->values.emplace_back(index, bits);
      }
    }
    return t;
  }();
  return table;
}

const Golden& gold(const std::string& name) {
  const auto it = golden().find(name);
  if (it == golden().end()) throw std::runtime_error("no golden array " + name);
  return it->second;
}

std::vector<std::uint32_t> key_words(const std::vector<rnd::Key>& keys) {
  std::vector<std::uint32_t> w;
  for (const auto& k : keys) w.insert(w.end(), {k.k0, k.k1});
  return w;
}

/// Every sampled golden value equals the element at its index, bit for bit.
template <class T>
void require_bitwise(const std::string& name, const std::vector<T>& got) {
  const Golden& g = gold(name);
  REQUIRE(static_cast<std::int64_t>(got.size()) == g.size);
  int mismatches = 0;
  for (auto [i, want] : g.values) {
    std::uint32_t have;
    if constexpr (std::is_same_v<T, float>) have = bits_of(got[static_cast<std::size_t>(i)]);
    else if constexpr (std::is_same_v<T, tg::bf16>) have = got[static_cast<std::size_t>(i)].bits;
    else have = static_cast<std::uint32_t>(got[static_cast<std::size_t>(i)]);
    if (have != want && ++mismatches <= 5) UNSCOPED_INFO(name << "[" << i << "]: got " << std::hex << have << ", want " << want);
  }
  INFO(name << ": " << g.values.size() << " values compared");
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("Threefry-2x32-20 matches the Random123 known-answer vectors", "[random]") {
  struct Kat { std::uint32_t c0, c1, k0, k1, r0, r1; };
  const Kat kats[] = {
      {0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x6b200159, 0x99ba4efe},
      {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x1cb996fc, 0xbb002be7},
      {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xc4923a9c, 0x483df7a0},
  };
  for (const Kat& k : kats) {
    std::uint32_t x0 = k.c0, x1 = k.c1;
    rnd::threefry2x32({k.k0, k.k1}, x0, x1);
    CHECK(x0 == k.r0);
    CHECK(x1 == k.r1);
  }
}

TEST_CASE("keys, split and fold_in equal JAX's", "[random][jax]") {
  for (std::int64_t seed : {0, 1, 42, 2147483647, -1}) {
    INFO("seed " << seed);
    require_bitwise("key/" + std::to_string(seed), key_words({rnd::key(seed)}));
  }
  require_bitwise("split/1/5", key_words(rnd::split(rnd::key(1), 5)));
  const auto [a, b] = rnd::split(rnd::key(42));
  require_bitwise("split/42/2", key_words({a, b}));
  require_bitwise("fold_in/1/7", key_words({rnd::fold_in(rnd::key(1), 7)}));
  require_bitwise("fold_in/1/4294967295", key_words({rnd::fold_in(rnd::key(1), 0xFFFFFFFFu)}));
  CHECK(rnd::key(1LL << 40) == rnd::Key{256u, 0u});  // beyond 32 bits: JAX's x64 layout
  // fold_in of a key held on the device (key_data), as a compiled step derives per-site keys.
  require_bitwise("fold_in/1/7", rnd::fold_in(rnd::key_data<D>(rnd::key(1)), 7).to_vector());
  require_bitwise("fold_in/1/4294967295", rnd::fold_in(rnd::key_data<D>(rnd::key(1)), 0xFFFFFFFFu).to_vector());
  auto derive = tg::compile([](const tg::Tensor<std::uint32_t, D>& k) { return rnd::fold_in(rnd::fold_in(k, 3), 1000); });
  for (int seed : {5, 6}) {  // recorded, then replayed with another key
    const auto want = rnd::fold_in(rnd::fold_in(rnd::key(seed), 3), 1000);
    CHECK(derive(rnd::key_data<D>(rnd::key(seed))).to_vector() == std::vector<std::uint32_t>{want.k0, want.k1});
  }
  CHECK_THROWS_WITH(rnd::fold_in(tg::zeros<std::uint32_t, D>({3}), 1), Catch::Matchers::Contains("[random::fold_in] a key tensor must have shape (2,)"));
}

TEST_CASE("random bits and uniforms equal JAX's bit for bit", "[random][jax]") {
  require_bitwise("bits/1/7x11", rnd::bits<D>(rnd::key(1), {7, 11}).to_vector());
  require_bitwise("uniform/1/784x256", rnd::uniform<float, D>(rnd::key(1), {784, 256}).to_vector());
  require_bitwise("uniform_range/3/1000/-2.5/7.25", rnd::uniform<float, D>(rnd::key(3), {1000}, -2.5, 7.25).to_vector());
  require_bitwise("uniform_bf16/5/300", rnd::uniform<tg::bf16, D>(rnd::key(5), {300}).to_vector());
}

TEST_CASE("normal(key(1), {784, 256}) equals jax.random.normal within 2 ulp", "[random][jax]") {
  const auto z = rnd::normal<float, D>(rnd::key(1), {784, 256}).to_vector();
  const Golden& g = gold("normal/1/784x256");
  REQUIRE(static_cast<std::int64_t>(z.size()) == g.size);
  std::int64_t worst = 0, exact = 0, tails = 0;
  for (auto [i, want] : g.values) {
    const float have = z[static_cast<std::size_t>(i)];
    const std::int64_t d = ulp_distance(have, float_of(want));
    worst = std::max(worst, d);
    exact += d == 0;
    tails += std::fabs(have) > 2.93f;  // erf_inv's second branch (w >= 5)
  }
  INFO(g.values.size() << " values compared, " << exact << " bit-identical, " << tails
                       << " in the tail branch, worst " << worst << " ulp");
  CHECK(worst <= 2);
  CHECK(tails > 100);  // the sample really covers both polynomial branches
  WARN("normal vs JAX: " << exact << "/" << g.values.size() << " bit-identical, worst " << worst << " ulp");
}

TEST_CASE("bf16 normals equal JAX's", "[random][jax]") {
  // JAX evaluates erf_inv for bf16 in float and rounds; bf16's coarse grid absorbs the float path's
  // last-ulp differences except at rounding boundaries, so a few elements may differ by one bf16 ulp.
  const auto z = rnd::normal<tg::bf16, D>(rnd::key(1), {1000}).to_vector();
  const Golden& g = gold("normal_bf16/1/1000");
  REQUIRE(static_cast<std::int64_t>(z.size()) == g.size);
  int exact = 0, worst = 0;
  for (auto [i, want] : g.values) {
    const int d = std::abs(static_cast<int>(z[static_cast<std::size_t>(i)].bits) - static_cast<int>(want));
    exact += d == 0;
    worst = std::max(worst, d);
  }
  INFO(exact << "/" << g.values.size() << " bit-identical, worst " << worst << " bf16 ulp");
  CHECK(worst <= 1);
  CHECK(exact >= 995);
}

TEST_CASE("permutation equals jax.random.permutation", "[random][jax]") {
  require_bitwise("permutation/1/10", rnd::permutation<D>(rnd::key(1), 10).to_vector());
  require_bitwise("permutation/7/2000", rnd::permutation<D>(rnd::key(7), 2000).to_vector());
  const auto p = rnd::permutation<D>(rnd::key(0), 60000).to_vector();
  require_bitwise("permutation/0/60000", p);
  std::vector<int> seen(p.size(), 0);
  for (auto v : p) ++seen[static_cast<std::size_t>(v)];
  CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  CHECK(rnd::permutation<D>(rnd::key(0), 0).size() == 0);
  CHECK_THROWS_AS(rnd::permutation<D>(rnd::key(0), -1), tg::Error);
}

TEST_CASE("float64 normals invert erf to double precision; moments are standard", "[random]") {
  const auto key = rnd::key(9);
  const auto z = rnd::normal<double, D>(key, {100000}).to_vector();
  double worst = 0.0, sum = 0.0, sum_sq = 0.0;
  for (std::size_t i = 0; i < z.size(); ++i) {
    // Recompute the uniform that produced z[i] and check erf(z / sqrt 2) gives it back.
    const double u = std::fmax(-0.99999999999999989,
                               std::fma(rnd::detail::unit_double(rnd::detail::bits64(key, i)), 2.0, -0.99999999999999989));
    const double back = std::fabs(u) > 0.5 ? std::copysign(1.0 - std::erfc(std::fabs(z[i]) / std::sqrt(2.0)), u)
                                           : std::erf(z[i] / std::sqrt(2.0));
    worst = std::max(worst, std::fabs(back - u) / std::max(std::fabs(u), 1e-300));
    sum += z[i];
    sum_sq += z[i] * z[i];
  }
  INFO("worst relative error of erf(z / sqrt 2) against u: " << worst);
  CHECK(worst < 1e-14);  // a few ulp of double, amplified by at most erf's conditioning near 0
  const double n = static_cast<double>(z.size());
  CHECK(std::fabs(sum / n) < 5.0 / std::sqrt(n));            // 5 sigma
  CHECK(std::fabs(sum_sq / n - 1.0) < 5.0 * std::sqrt(2.0 / n));
}

TEST_CASE("uniform stays in range; bad arguments are errors", "[random]") {
  const auto u = rnd::uniform<float, D>(rnd::key(2), {10000}, -3.0, 5.0).to_vector();
  CHECK(*std::min_element(u.begin(), u.end()) >= -3.0f);
  CHECK(*std::max_element(u.begin(), u.end()) < 5.0f);
  CHECK_THROWS_WITH((rnd::uniform<float, D>(rnd::key(2), {3}, 1.0, 1.0)),
                    Catch::Matchers::Contains("[random::uniform] minval must be < maxval"));
  CHECK_THROWS_AS(rnd::split(rnd::key(0), -1), tg::Error);
}

#if defined(TG_TEST_CUDA)
TEST_CASE("CUDA draws the same bits as the CPU", "[random][cuda]") {
  const auto key = rnd::key(1);
  CHECK(rnd::normal<float, tg::Cuda>(key, {784, 256}).to_vector() == rnd::normal<float, tg::Cpu>(key, {784, 256}).to_vector());
  // Doubles go through erf/erfc/exp, whose CUDA and glibc versions may differ in the last bit.
  const auto gpu = rnd::normal<double, tg::Cuda>(key, {4096}).to_vector();
  const auto cpu = rnd::normal<double, tg::Cpu>(key, {4096}).to_vector();
  for (std::size_t i = 0; i < gpu.size(); ++i) CHECK(gpu[i] == Approx(cpu[i]).epsilon(1e-14).margin(1e-300));
  CHECK(rnd::uniform<float, tg::Cuda>(key, {4096}, -1.5, 2.0).to_vector() ==
        rnd::uniform<float, tg::Cpu>(key, {4096}, -1.5, 2.0).to_vector());
}
#endif

#if !defined(TG_TEST_CUDA)
TEST_CASE("test binaries find their golden files through the environment, beside the executable, or in the source tree", "[random][data]") {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("tg_test_data_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path env = root / "env", exe = root / "bin", compiled = root / "src";
  for (const fs::path& d : {env, exe / "data", compiled}) {
    fs::create_directories(d);
    std::ofstream(d / "jax_random_golden.txt") << "# test\n";
  }
  using test_data::find;
  CHECK(find(env.c_str(), exe.string(), compiled.string()) == env.string());             // the variable wins
  CHECK(find(nullptr, exe.string(), compiled.string()) == (exe / "data").string());      // then beside the binary
  CHECK(find("", exe.string(), compiled.string()) == (exe / "data").string());           // an empty variable is unset
  fs::remove_all(exe / "data");
  CHECK(find(nullptr, exe.string(), compiled.string()) == compiled.string());            // then the source tree
  CHECK(find((root / "nowhere").c_str(), exe.string(), compiled.string()).empty());      // a wrong variable: no fallback
  fs::remove_all(compiled);
  CHECK(find(nullptr, exe.string(), compiled.string()).empty());
  fs::remove_all(root);
}
#endif

}  // namespace random_tests
