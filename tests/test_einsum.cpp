// ops/einsum.hpp: einsum of two operands against the definition, as one GEMM, with its gradients against
// finite differences in double. Built for the CPU, and by nvcc with every tensor on CUDA (TG_TEST_CUDA).
#include "ops_common.hpp"

#include <map>
#include <string>
#include <vector>

namespace einsum_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;
using namespace op_test;

TEST_CASE("einsum of two operands equals the definition, in one GEMM, with finite-difference gradients", "[ops][transformer][einsum]") {
  struct Case {
    std::string spec;
    tg::Shape a, b;
  };
  const std::vector<Case> cases = {
      {"ij,jk->ik", {3, 4}, {4, 5}},              // a matmul
      {"bhqd,bhkd->bhqk", {2, 3, 4, 5}, {2, 3, 6, 5}},  // attention's scores: k read transposed in place
      {"bhqk,bhkd->bhqd", {2, 3, 4, 6}, {2, 3, 6, 5}},  // attention's weighted values
      {"ik,jk->ij", {3, 4}, {5, 4}},
      {"ki,kj->ij", {4, 3}, {4, 5}},
      {"bij,bjk->bki", {2, 3, 4}, {2, 4, 5}},     // the output permuted
      {"ij,k->ijk", {2, 3}, {4}},                 // an outer product: nothing contracted
      {"abc,cd->ad", {2, 3, 4}, {4, 5}},          // b appears once: summed first
      {"ij,ij->i", {3, 4}, {3, 4}},               // a batch of dot products
      {"bqhd,bkhd->bhqk", {2, 4, 3, 5}, {2, 6, 3, 5}},  // flax's layout: both operands transposed first
      {"...qd,...kd->...qk", {2, 3, 4, 5}, {2, 3, 6, 5}},
      {"...qd,kd->...qk", {2, 3, 4, 5}, {6, 5}},  // "..." in one operand only: its own rows
  };
  for (const auto& c : cases) {
    INFO(c.spec);
    const auto a = op_test::dnormal(31, c.a), b = op_test::dnormal(32, c.b);
    const auto y = tg::einsum(c.spec, a, b);
    std::string plain = c.spec;
    if (plain.find("...") != std::string::npos) continue;  // the reference reads letters only; the ellipsis cases are checked below
    const auto want = op_test::ref_einsum(plain, a, b);
    const auto have = y.to_vector();
    REQUIRE(have.size() == want.size());
    double worst = 0;
    for (std::size_t i = 0; i < have.size(); ++i) worst = std::max(worst, std::fabs(have[i] - want[i]) / (1.0 + std::fabs(want[i])));
    CHECK(worst < 1e-13);  // f64, summed in another order than the definition's
    op_test::check_fd(c.spec.c_str(), op_test::Leaves3<double>{a, b, b},
                   [&](const op_test::Leaves3<double>& p) { return tg::einsum(c.spec, p.a, p.b); });
  }
  // The ellipsis is the leading axes: the same as the letters written out.
  const auto q = op_test::dnormal(33, {2, 3, 4, 5}), k = op_test::dnormal(34, {2, 3, 6, 5}), w = op_test::dnormal(35, {6, 5});
  CHECK(tg::einsum("...qd,...kd->...qk", q, k).to_vector() == tg::einsum("bhqd,bhkd->bhqk", q, k).to_vector());
  CHECK(tg::einsum("...qd,kd->...qk", q, w).to_vector() == tg::einsum("bhqd,kd->bhqk", q, w).to_vector());
  // In f32, attention's scores are exactly matmul(q, k, false, true): the same strided-batched GEMM.
  const auto qf = tg::cast<float>(q), kf = tg::cast<float>(k);
  CHECK(tg::einsum("bhqd,bhkd->bhqk", qf, kf).to_vector() == tg::matmul(qf, kf, false, true).to_vector());
  CHECK(tg::einsum("bhqd,bhkd->bhqk", qf, kf).to_vector() == tg::matmul(qf, tg::swapaxes(kf, -1, -2)).to_vector());
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    // One GEMM and nothing else when the operands' layout allows it; transposes only where it does not.
    CHECK(op_test::kernels_of([&] { return tg::einsum("bhqd,bhkd->bhqk", qf, kf); }) == 1);
    CHECK(op_test::kernels_of([&] { return tg::einsum("bhqk,bhkd->bhqd", tg::einsum("bhqd,bhkd->bhqk", qf, kf), kf); }) == 2);
    const auto kf2 = tg::cast<float>(op_test::dnormal(36, {2, 6, 4, 5}));
    CHECK(op_test::kernels_of([&] { return tg::einsum("bqhd,bkhd->bhqk", qf, kf2); }) == 3);  // both transposed first
  }
  // Errors name the spec and what is wrong.
  CHECK_THROWS_WITH(tg::einsum("ij,jk", q, k), Contains("[einsum] 'ij,jk' has no '->'"));
  CHECK_THROWS_WITH(tg::einsum("ij,jk,kl->il", q, k), Contains("exactly two operands"));
  CHECK_THROWS_WITH(tg::einsum("abc,abed->abce", q, k), Contains("the first operand has rank 4 but 3 indices"));
  CHECK_THROWS_WITH(tg::einsum("aacd,abed->abce", q, k), Contains("index 'a' appears twice in one term"));
  CHECK_THROWS_WITH(tg::einsum("abcd,abed->abcz", q, k), Contains("the output's index 'z' is in neither operand"));
  CHECK_THROWS_WITH(tg::einsum("ab1d,abed->abce", q, k), Contains("'1' is not an index"));
  CHECK_THROWS_WITH(tg::einsum("abcd,abcd->abd", q, op_test::dnormal(1, {2, 3, 7, 5})), Contains("index 'c' has size 4 in (2, 3, 4, 5) but 7"));
}

}  // namespace einsum_tests
