// Writes a known pytree (every dtype tapegrad saves, nested names, a scalar, an empty tensor) to argv[1]
// as safetensors, for tests/io/read_with_numpy.py to read back with nothing but Python and NumPy.
#include <tapegrad/tapegrad.hpp>

#include <cstdio>
#include <vector>

namespace known {
struct Layer {
  tg::Tensor<float> w;
  tg::Tensor<tg::bf16> b;
};
TG_PYTREE(Layer, w, b)
struct Tree {
  std::vector<Layer> layers;
  tg::Tensor<double> scale;
  tg::Tensor<std::int32_t> count;
  tg::Tensor<std::uint32_t> seed;
  tg::Tensor<std::uint8_t> mask, empty;
};
TG_PYTREE(Tree, layers, scale, count, seed, mask, empty)
}  // namespace known

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: write_known out.safetensors\n");
    return 2;
  }
  // Values: element i of each tensor is i * 0.25 - 1 (floats), i - 3 (int32), 4000000000 + i, i % 2.
  auto f = [](std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.25f - 1.0f;
    return v;
  };
  auto h = [&](std::int64_t n) {
    std::vector<tg::bf16> v;
    for (float x : f(n)) v.emplace_back(x);
    return v;
  };
  known::Tree t{{{tg::from_vector(f(6), {2, 3}), tg::from_vector(h(3), {3})}, {tg::from_vector(f(12), {3, 4}), tg::from_vector(h(4), {4})}},
                tg::from_vector(std::vector<double>{-1.0, -0.75}, {2}),
                tg::from_vector(std::vector<std::int32_t>{-3}, tg::Shape{}),
                tg::from_vector(std::vector<std::uint32_t>{4000000000u, 4000000001u}, {2}),
                tg::from_vector(std::vector<std::uint8_t>{0, 1, 0, 1, 0}, {5}),
                tg::zeros<std::uint8_t>({0, 3})};
  tg::io::save_safetensors(argv[1], t, {{"format", "pt"}, {"step", "42"}});
  return 0;
}
