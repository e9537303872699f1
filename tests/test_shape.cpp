// Shape: ranks, sizes, axes, and the errors for impossible shapes.
#include "test_common.hpp"

namespace shape_tests {

using Catch::Matchers::Contains;

TEST_CASE("Shape counts elements and normalises axes", "[shape]") {
  const tg::Shape scalar;
  CHECK(scalar.rank() == 0);
  CHECK(scalar.numel() == 1);
  CHECK(scalar.str() == "()");

  const tg::Shape s{512, 784};
  CHECK(s.rank() == 2);
  CHECK(s.numel() == 512 * 784);
  CHECK(s[0] == 512);
  CHECK(s[-1] == 784);
  CHECK(s.str() == "(512, 784)");
  CHECK(tg::Shape{3}.str() == "(3,)");
  CHECK(tg::Shape{4, 0, 2}.numel() == 0);
  CHECK(s == tg::Shape{512, 784});
  CHECK_FALSE(s == tg::Shape{784, 512});
  CHECK(s.normalize_axis(-2, "test") == 0);
  CHECK_THROWS_WITH(s.normalize_axis(2, "sum"), Contains("[sum] axis 2 is out of range for shape (512, 784)"));
  CHECK(tg::Shape{1, 2, 3, 4, 5, 6, 7, 8}.numel() == 40320);
}

TEST_CASE("Shape rejects negative, overflowing and too many dimensions", "[shape][errors]") {
  CHECK_THROWS_WITH((tg::Shape{2, -3}), Contains("[Shape] dimension 1 is negative (-3) in (2, -3)"));
  CHECK_THROWS_WITH((tg::Shape{1, 2, 3, 4, 5, 6, 7, 8, 9}), Contains("rank 9 exceeds the maximum rank 8"));
  CHECK_THROWS_WITH((tg::Shape{1LL << 32, 1LL << 32}), Contains("overflows"));
  // The bound leaves room for 8-byte elements: 2^60 elements would be 2^63 bytes.
  CHECK_THROWS_AS((tg::Shape{1LL << 30, 1LL << 30}), tg::Error);
  CHECK_NOTHROW(tg::Shape{1LL << 29, 1LL << 30});
}

}  // namespace shape_tests
