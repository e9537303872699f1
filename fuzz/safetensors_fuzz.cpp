// libFuzzer target: the safetensors reader on arbitrary bytes, loading into a fixed tree (so that the
// name, dtype and shape checks and the copies run too). Any input must load or give a tg::Error, never a
// crash, a leak or an out-of-bounds read (built with ASan and UBSan).
#include <tapegrad/tapegrad.hpp>

#include <cstdint>

namespace fuzz {
struct Tree {
  tg::Tensor<float> a;
  tg::Tensor<std::int32_t> b;
  tg::Tensor<tg::bf16> c;
};
TG_PYTREE(Tree, a, b, c)
}  // namespace fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Tree tree{tg::zeros<float>({2}), tg::zeros<std::int32_t>({1}), tg::Tensor<tg::bf16>()};  // c: any shape
  try {
    (void)tg::io::load_safetensors_bytes(data, size, "fuzz", tree);
  } catch (const tg::Error&) {
  }
  return 0;
}
