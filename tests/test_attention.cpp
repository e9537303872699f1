// ops/attention.hpp: dot_product_attention against softmax(scale q k^T) v written out, with masks and causal,
// and its gradients against finite differences in double. Built for the CPU, and by nvcc with every tensor on
// CUDA (TG_TEST_CUDA).
#include "ops_common.hpp"

#include <cmath>
#include <vector>

namespace attention_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;
using namespace op_test;

/// jax.nn.dot_product_attention written out: einsum, scale, where(mask, s, large negative), softmax, einsum.
template <class T>
tg::Tensor<T, D> ref_attention(const tg::Tensor<T, D>& q, const tg::Tensor<T, D>& k, const tg::Tensor<T, D>& v, const tg::Tensor<std::uint8_t, D>* mask,
                               bool causal, double scale) {
  auto s = tg::einsum("btnh,bsnh->bnts", q, k) * scale;
  const std::int64_t T_ = q.dim(1), S_ = k.dim(1);
  std::vector<std::uint8_t> allowed(static_cast<std::size_t>(T_ * S_), 1);
  if (causal)
    for (std::int64_t i = 0; i < T_; ++i)
      for (std::int64_t j = i + 1; j < S_; ++j) allowed[static_cast<std::size_t>(i * S_ + j)] = 0;
  auto m = tg::from_vector<D>(allowed, {T_, S_});
  if (mask) m = tg::mul(m, *mask);
  const auto neg = tg::full<T, D>({}, tg::detail::convert_to<T>(tg::detail::masked_logit<tg::compute_t<T>>()));
  return tg::einsum("bnts,bsnh->btnh", tg::softmax(tg::where(m, s, neg)), v);
}

TEST_CASE("dot_product_attention equals softmax(scale q k^T) v written out, with masks, causal, and finite-difference gradients",
          "[ops][transformer][attention]") {
  const std::int64_t B = 2, T_ = 5, S_ = 7, N = 3, H = 4;
  const auto q = dnormal(51, {B, T_, N, H}), k = dnormal(52, {B, S_, N, H}), v = dnormal(53, {B, S_, N, H});
  // A mask over (B, 1, 1, S): the last two keys of batch 1 are padding.
  std::vector<std::uint8_t> pad(static_cast<std::size_t>(B * S_), 1);
  pad[static_cast<std::size_t>(S_ + 5)] = pad[static_cast<std::size_t>(S_ + 6)] = 0;
  const auto mask = tg::from_vector<D>(pad, {B, 1, 1, S_});
  using Impl = tg::AttentionImplementation;
  for (const Impl impl : {Impl::composed, Impl::fused})
    for (const bool causal : {false, true})
      for (const bool masked : {false, true}) {
        INFO("implementation " << static_cast<int>(impl) << ", causal " << causal << ", masked " << masked);
        const tg::AttentionOptions o{.scale = 0.37, .is_causal = causal, .implementation = impl};
        const auto ours = masked ? tg::dot_product_attention(q, k, v, mask, o) : tg::dot_product_attention(q, k, v, o);
        const auto ref = ref_attention(q, k, v, masked ? &mask : nullptr, causal, 0.37);
        REQUIRE(ours.shape() == tg::Shape({B, T_, N, H}));
        const auto a = ours.to_vector(), r = ref.to_vector();
        double worst = 0;
        for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - r[i]));
        CHECK(worst < 1e-13);  // f64, summed in another order than the GEMMs'
        // A step of 1e-5: at 1e-6 the central differences of this sum carry ~3e-6 relative rounding noise
        // (measured: every order and mode passes at 1e-4 and 1e-5 with errors of 2e-7, fails at 1e-6 and 1e-7).
        check_fd("dot_product_attention", Leaves3<double>{q, k, v}, [&](const Leaves3<double>& p) {
          return masked ? tg::dot_product_attention(p.a, p.b, p.c, mask, o) : tg::dot_product_attention(p.a, p.b, p.c, o);
        }, 1e-5);
      }
#if !defined(TG_TEST_CUDA)
  // The fused kernels' GPU form (a query row per item forward; query rows and key rows backward), run
  // here on the CPU: the same values and gradients as the CPU's (batch, head) blocks, to rounding.
  {
    const auto w = dnormal(54, {B, T_, N, H});
    for (const bool causal : {false, true})
      for (const bool masked : {false, true}) {
        INFO("GPU form, causal " << causal << ", masked " << masked);
        const tg::AttentionOptions o{.scale = 0.37, .is_causal = causal};
        const auto d = tg::detail::attention_dims(q, k, v, masked ? &mask : nullptr, o, "test");
        auto loss = [&]<bool ByBlock>(std::bool_constant<ByBlock>) {
          return tg::value_and_grad([&](const Leaves3<double>& p) {
            return tg::sum(tg::detail::attention_fused<double, tg::Cpu, ByBlock>(p.a, p.b, p.c, masked ? &mask : nullptr, d) * w);
          })(Leaves3<double>{q, k, v});
        };
        const auto [blocks, g_blocks] = loss(std::true_type{});
        const auto [rows, g_rows] = loss(std::false_type{});
        CHECK(rows.item() == Approx(blocks.item()).epsilon(1e-13));
        std::string why;
        CHECK(tg::tree_all_close(g_rows, g_blocks, 1e-12, 1e-13, &why));
        INFO(why);
      }
  }
#endif
  // The default scale is 1 / sqrt(head_dim); the batch axis may be left out.
  const auto def = tg::dot_product_attention(q, k, v).to_vector(), half = ref_attention(q, k, v, nullptr, false, 0.5).to_vector();
  for (std::size_t i = 0; i < def.size(); ++i) CHECK(def[i] == Approx(half[i]).margin(1e-13));
  const auto unbatched = tg::dot_product_attention(tg::index_in_dim(q, 1), tg::index_in_dim(k, 1), tg::index_in_dim(v, 1));
  CHECK(unbatched.to_vector() == tg::index_in_dim(tg::dot_product_attention(q, k, v), 1).to_vector());
  // A query row with every key masked attends to all keys evenly, as JAX's large negative logit makes it.
  const auto none = tg::zeros<std::uint8_t, D>({1, 1, 1, S_});
  const auto even = tg::dot_product_attention(q, k, v, none).to_vector(), mean_v = tg::mean(v, 1, true).to_vector();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t c = 0; c < N * H; ++c)
      CHECK(even[static_cast<std::size_t>((b * T_ + 3) * N * H + c)] == Approx(mean_v[static_cast<std::size_t>(b * N * H + c)]).margin(1e-13));
  // f32 and bf16 within their rounding of the f64 result; bf16's statistics in f32.
  const auto ref64 = ref_attention(q, k, v, &mask, true, 0.5).to_vector();
  for (const Impl impl : {Impl::composed, Impl::fused}) {
    INFO("implementation " << static_cast<int>(impl));
    const tg::AttentionOptions o{.is_causal = true, .implementation = impl};
    const auto f32 = tg::dot_product_attention(tg::cast<float>(q), tg::cast<float>(k), tg::cast<float>(v), mask, o).to_vector();
    const auto b16 = tg::cast<float>(tg::dot_product_attention(tg::cast<tg::bf16>(q), tg::cast<tg::bf16>(k), tg::cast<tg::bf16>(v), mask, o)).to_vector();
    double worst32 = 0, worst16 = 0;
    for (std::size_t i = 0; i < ref64.size(); ++i)
      worst32 = std::max(worst32, std::fabs(f32[i] - ref64[i])), worst16 = std::max(worst16, std::fabs(b16[i] - ref64[i]));
    CHECK(worst32 < 1e-5);  // |v| < 5: a few f32 ulps of accumulation
    CHECK(worst16 < 0.05);  // inputs rounded to bf16 (2^-8 relative) and the output rounded once
  }
  // The weights, as flax's dot_product_attention_weights, sum to 1 over the keys and equal the softmax.
  const auto w = tg::dot_product_attention_weights(q, k, {.is_causal = true});
  REQUIRE(w.shape() == tg::Shape({B, N, T_, S_}));
  const auto sums = tg::sum(w, -1).to_vector();
  for (double s : sums) CHECK(s == Approx(1.0).margin(1e-14));
  CHECK(w.at({1, 2, 1, 2}) == 0.0);  // causal: query 1 does not see key 2
  // Errors name the op and the shapes.
  CHECK_THROWS_WITH(tg::dot_product_attention(q, dnormal(1, {B, S_, N, H + 1}), v), Contains("[dot_product_attention] key and value must be"));
  CHECK_THROWS_WITH(tg::dot_product_attention(q, k, v, tg::zeros<std::uint8_t, D>({3, 1, 1, S_})), Contains("does not broadcast"));
  // head_dim above the fused kernels' 256: an error when asked for them, the composed form otherwise.
  const auto wide = dnormal(1, {1, 2, 1, 300});
  CHECK_THROWS_WITH(tg::dot_product_attention(wide, wide, wide, {.implementation = tg::AttentionImplementation::fused}),
                    Contains("head_dim 300 is above the fused kernels' 256"));
  CHECK(tg::dot_product_attention(wide, wide, wide).shape() == wide.shape());
}

}  // namespace attention_tests
