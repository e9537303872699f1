// Tensor: creation, copies between devices, views, element access, printing and bad input.
// Built for the CPU, and by nvcc for CUDA (TG_TEST_CUDA), where every tensor lives on the GPU.
#include "test_common.hpp"

#include <sstream>
#include <vector>

namespace tensor_tests {

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using D = TestDevice;

TEST_CASE("zeros, ones, full and arange fill every element", "[tensor]") {
  const auto z = tg::zeros<float, D>({3, 5});
  CHECK(z.shape() == tg::Shape{3, 5});
  CHECK(z.size() == 15);
  CHECK(z.to_vector() == std::vector<float>(15, 0.0f));
  CHECK(tg::ones<double, D>({4}).to_vector() == std::vector<double>(4, 1.0));
  CHECK(tg::full<std::int32_t, D>({2, 2}, -7).to_vector() == std::vector<std::int32_t>(4, -7));
  CHECK(tg::arange<std::int32_t, D>(5).to_vector() == std::vector<std::int32_t>{0, 1, 2, 3, 4});
  CHECK(tg::arange<float, D>(1.0, 2.0, 0.25).to_vector() == std::vector<float>{1.0f, 1.25f, 1.5f, 1.75f});
  CHECK(tg::arange<double, D>(3.0, 0.0, -1.0).to_vector() == std::vector<double>{3.0, 2.0, 1.0});
  CHECK(tg::arange<float, D>(0).size() == 0);
  // Large enough to take the parallel path on the CPU and many blocks on the GPU.
  const auto big = tg::arange<std::int32_t, D>(1 << 20).to_vector();
  bool ok = true;
  for (std::size_t i = 0; i < big.size(); ++i) ok = ok && big[i] == static_cast<std::int32_t>(i);
  CHECK(ok);
  const auto h = tg::full<tg::bf16, D>({3}, tg::bf16(1.5f)).to_vector();
  for (auto v : h) CHECK(static_cast<float>(v) == 1.5f);
  CHECK(tg::ones<std::uint8_t, D>({2}).to_vector() == std::vector<std::uint8_t>{1, 1});
}

TEST_CASE("from_vector keeps values and shape; device_put and to() copy across devices", "[tensor]") {
  const std::vector<float> v{1.5f, -2.0f, 3.25f, 0.125f, 7.0f, -0.5f};
  const auto t = tg::from_vector<D>(v, {2, 3});
  CHECK(t.shape() == tg::Shape{2, 3});
  CHECK(t.to_vector() == v);
  const auto host = t.to<tg::Cpu>();
  CHECK(host.to_vector() == v);
  const auto back = tg::device_put<D>(host);
  CHECK(back.to_vector() == v);
  if constexpr (std::is_same_v<D, tg::Cpu>) CHECK(back.data() == t.data());  // same device: shared, no copy
  else CHECK(back.data() != t.data());                                         // a real round trip
  CHECK(tg::from_vector<D>(std::vector<std::int32_t>{4, 5}).shape() == tg::Shape{2});
  CHECK_THROWS_WITH(tg::from_vector<D>(v, {4, 2}), Contains("[from_vector] got 6 values for shape (4, 2), which holds 8"));
}

TEST_CASE("copies share storage; reshape is a view", "[tensor]") {
  const auto t = tg::arange<float, D>(12);
  const auto copy = t;
  CHECK(copy.data() == t.data());
  const auto r = t.reshape({3, -1});
  CHECK(r.shape() == tg::Shape{3, 4});
  CHECK(r.data() == t.data());
  CHECK(r.to_vector() == t.to_vector());
  CHECK(t.reshape(tg::Shape{2, 2, 3}).dim(-1) == 3);
  CHECK_THROWS_WITH(t.reshape({5, 3}), Contains("[reshape] cannot reshape (12,) (12 elements) to (5, 3) (15 elements)"));
  CHECK_THROWS_WITH(t.reshape({-1, -1}), Contains("at most one dimension may be -1"));
  CHECK_THROWS_WITH(t.reshape({5, -1}), Contains("cannot infer -1"));
  CHECK_THROWS_WITH(t.reshape({-2, -6}), Contains("is negative"));
}

TEST_CASE("item and at read single elements; bad indices are errors", "[tensor]") {
  const auto s = tg::full<float, D>({}, 2.5f);
  CHECK(s.rank() == 0);
  CHECK(s.item() == 2.5f);
  CHECK(tg::full<float, D>({1, 1}, 4.0f).item() == 4.0f);
  const auto t = tg::arange<float, D>(6).reshape({2, 3});
  CHECK(t.at({1, 2}) == 5.0f);
  CHECK(t.at({-1, -3}) == 3.0f);
  CHECK_THROWS_WITH(t.item(), Contains("[item] needs a tensor with exactly one element, got shape (2, 3)"));
  CHECK_THROWS_WITH(t.at({2, 0}), Contains("[at] index 2 is out of range for axis 0 of size 2"));
  CHECK_THROWS_WITH(t.at({0, -4}), Contains("index -4 is out of range for axis 1 of size 3"));
  CHECK_THROWS_WITH(t.at({0}), Contains("[at] index has 1 components but the tensor has shape (2, 3)"));
  const tg::Tensor<float, D> undefined;
  CHECK_FALSE(undefined.defined());
  CHECK_THROWS_WITH(undefined.item(), Contains("[item] the tensor is undefined"));
}

TEST_CASE("empty tensors are legal", "[tensor]") {
  const auto e = tg::zeros<float, D>({0, 3});
  CHECK(e.size() == 0);
  CHECK(e.to_vector().empty());
  CHECK(e.reshape({3, 0}).shape() == tg::Shape{3, 0});
  CHECK(e.to<tg::Cpu>().size() == 0);
}

TEST_CASE("operator<< prints shape, dtype, device and leading values", "[tensor]") {
  std::ostringstream os;
  os << tg::arange<float, D>(10).reshape({2, 5});
  const std::string device = std::is_same_v<D, tg::Cpu> ? "cpu" : "cuda:0 ";
  CHECK_THAT(os.str(), StartsWith("Tensor(shape=(2, 5), dtype=float32, device=" + device));
  CHECK_THAT(os.str(), Contains("[0, 1, 2, 3, 4, 5, 6, 7, ... (10 total)]"));
  std::ostringstream small;
  small << tg::full<tg::bf16, D>({2}, tg::bf16(0.5f)) << tg::ones<std::uint8_t, D>({1});
  CHECK_THAT(small.str(), Contains("dtype=bfloat16") && Contains("[0.5, 0.5]") && Contains("dtype=uint8") &&
                              Contains("[1]"));
  CHECK_THAT((tg::zeros<float, D>({1}).device_name()), StartsWith(device));
}

}  // namespace tensor_tests
