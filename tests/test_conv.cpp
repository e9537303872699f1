// Convolutions and pooling: geometry as JAX's (padding "SAME" / "VALID" / pairs, strides, dilation,
// groups), the f64 loops against a naive reference written here, the device's library (oneDNN on the CPU,
// cuDNN on CUDA) against those loops in f32 and bf16, gradients against finite differences in double to
// second order in both modes, vmap against a loop, and the errors. Built for the CPU, and by nvcc with
// every tensor on CUDA (TG_TEST_CUDA).
#include "test_common.hpp"

#include <cmath>
#include <string>
#include <vector>

namespace conv_tests {

using Catch::Matchers::Contains;
using D = TestDevice;
namespace rnd = tg::random;

namespace tconv {

template <class T>
struct Xw {
  tg::Tensor<T, D> x, w;
};
TG_PYTREE(Xw, x, w)

template <class T>
struct Xwb {
  tg::Tensor<T, D> x, w, b;
};
TG_PYTREE(Xwb, x, w, b)

inline tg::Tensor<double, D> dnormal(int seed, const tg::Shape& s) { return rnd::normal<double, D>(rnd::key(seed), s); }

/// A configuration: x (n, h, w, c), kernel (kh, kw, c / groups, o), strides, padding, dilation, groups.
struct Case {
  const char* name;
  tg::Shape x, w;
  tg::Window2 strides;
  tg::Padding padding;
  tg::Window2 dilation;
  std::int64_t groups;
};

inline std::vector<Case> cases() {
  return {
      {"3x3 SAME", {2, 5, 6, 3}, {3, 3, 3, 4}, {1, 1}, "SAME", {1, 1}, 1},
      {"3x3 VALID stride 2", {2, 7, 6, 2}, {3, 3, 2, 3}, {2, 2}, "VALID", {1, 1}, 1},
      {"SAME stride 2 (uneven padding)", {1, 6, 5, 2}, {3, 2, 2, 3}, {2, 2}, "SAME", {1, 1}, 1},
      {"explicit padding, dilation 2", {2, 6, 7, 2}, {2, 3, 2, 2}, {1, 2}, tg::Padding({2, 1}, {0, 3}), {2, 2}, 1},
      {"2 groups", {1, 5, 5, 4}, {3, 3, 2, 6}, {1, 1}, "SAME", {1, 1}, 2},
      {"depthwise", {2, 4, 5, 3}, {3, 3, 1, 3}, {1, 1}, "VALID", {1, 1}, 3},
      {"1x1", {2, 3, 3, 5}, {1, 1, 5, 4}, {1, 1}, "VALID", {1, 1}, 1},
  };
}

/// The convolution written out over the definition, in double on the host.
inline std::vector<double> naive_conv(const std::vector<double>& x, const tg::Shape& xs, const std::vector<double>& w, const tg::Shape& ws,
                                      const tg::backend::ConvProblem& p) {
  std::vector<double> y(static_cast<std::size_t>(p.n * p.oh * p.ow * p.o), 0.0);
  const std::int64_t ig = ws[2], og = p.o / p.groups;
  for (std::int64_t n = 0; n < p.n; ++n)
    for (std::int64_t oh = 0; oh < p.oh; ++oh)
      for (std::int64_t ow = 0; ow < p.ow; ++ow)
        for (std::int64_t o = 0; o < p.o; ++o) {
          double acc = 0;
          for (std::int64_t kh = 0; kh < ws[0]; ++kh)
            for (std::int64_t kw = 0; kw < ws[1]; ++kw)
              for (std::int64_t i = 0; i < ig; ++i) {
                const std::int64_t ih = oh * p.stride[0] + kh * p.dilation[0] - p.pad_lo[0], iw = ow * p.stride[1] + kw * p.dilation[1] - p.pad_lo[1];
                if (ih < 0 || ih >= xs[1] || iw < 0 || iw >= xs[2]) continue;
                const std::int64_t c = (o / og) * ig + i;
                acc += x[static_cast<std::size_t>(((n * xs[1] + ih) * xs[2] + iw) * xs[3] + c)] *
                       w[static_cast<std::size_t>(((kh * ws[1] + kw) * ig + i) * p.o + o)];
              }
          y[static_cast<std::size_t>(((n * p.oh + oh) * p.ow + ow) * p.o + o)] = acc;
        }
  return y;
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

template <class T>
std::vector<double> host(const tg::Tensor<T, D>& t) {
  const auto v = tg::cast<double>(t).to_vector();
  return {v.begin(), v.end()};
}

/// sum(f(p) * r) for fixed random r, checked to second order in both modes.
template <class P, class F>
void check_fd(const char* what, const P& p, F f, double eps = 1e-6) {
  INFO(what);
  const auto r = dnormal(4242, f(p).shape());
  auto loss = [&](const P& q) { return tg::sum(tg::mul(f(q), r)); };
  const auto res = tg::check_grads(loss, p, tg::GradCheckOptions{.eps = eps, .order = 2, .modes = tg::fwd | tg::rev, .print = false});
  INFO(res);
  CHECK(res.passed);
}

}  // namespace tconv

using namespace tconv;

TEST_CASE("conv geometry: JAX's padding, output sizes and argument checks", "[conv]") {
  const tg::Shape x{1, 28, 28, 1};
  // "SAME", stride 2 over 28: 14 outputs, one row of padding at the end (lax.padtype_to_pads).
  auto p = tg::detail::conv_geometry(x, 3, 3, 8, {2, 2}, "SAME", {1, 1}, 1, "conv");
  CHECK(p.oh == 14);
  CHECK(p.ow == 14);
  CHECK(p.pad_lo[0] == 0);
  CHECK(p.pad_hi[0] == 1);
  p = tg::detail::conv_geometry(x, 3, 3, 8, {1, 1}, "SAME", {1, 1}, 1, "conv");
  CHECK((p.oh == 28 && p.pad_lo[0] == 1 && p.pad_hi[0] == 1));
  p = tg::detail::conv_geometry(x, 3, 3, 8, {1, 1}, "SAME", {2, 2}, 1, "conv");  // a 5 x 5 dilated window
  CHECK((p.oh == 28 && p.pad_lo[1] == 2 && p.pad_hi[1] == 2));
  p = tg::detail::conv_geometry(x, 5, 5, 8, {2, 2}, "VALID", {1, 1}, 1, "conv");
  CHECK((p.oh == 12 && p.pad_lo[0] == 0 && p.pad_hi[0] == 0));
  p = tg::detail::conv_geometry(x, 2, 2, 1, {2, 2}, tg::Padding({1, 0}, {0, 1}), {1, 1}, 1, "max_pool");
  CHECK((p.oh == 14 && p.ow == 14));

  const auto xt = tg::zeros<float, D>({2, 8, 8, 4});
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 3, 8})), Contains("has 4 channels") && Contains("needs 3"));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 2, 6}), {1, 1}, "SAME", {1, 1}, 4), Contains("feature_group_count 4"));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 2, 3}), {1, 1}, "SAME", {1, 1}, 2),
                    Contains("do not split into 2 groups"));
  CHECK_THROWS_WITH(tg::conv(tg::zeros<float, D>({8, 8, 4}), tg::zeros<float, D>({3, 3, 4, 8})), Contains("rank 4"));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 4})), Contains("HWIO"));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 4, 8}), {1, 1}, "same"), Contains("unknown padding \"same\""));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 4, 8}), {1, 1}, tg::Padding({-1, 0}, {0, 0})), Contains("negative"));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({9, 3, 4, 8}), {1, 1}, "VALID"), Contains("smaller than the (dilated) window 9"));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 4, 8}), {0, 1}), Contains("strides must be >= 1"));
  CHECK_THROWS_WITH(tg::conv(xt, tg::zeros<float, D>({3, 3, 4, 8}), tg::zeros<float, D>({4}), tg::Activation::relu),
                    Contains("bias must have shape (8,)"));
  CHECK_THROWS_WITH(tg::max_pool(tg::zeros<float, D>({8, 8, 4}), {2, 2}), Contains("max_pool") && Contains("rank 4"));
}

TEST_CASE("conv in f64 equals the definition; the device's library equals the loops in f32", "[conv]") {
  for (const Case& c : cases()) {
    INFO(c.name);
    const auto x = dnormal(1, c.x), w = dnormal(2, c.w);
    const auto p = tg::detail::conv_problem(x, w, c.strides, c.padding, c.dilation, c.groups, "conv");
    const auto y = tg::conv(x, w, c.strides, c.padding, c.dilation, c.groups);
    CHECK(y.shape() == tg::Shape{p.n, p.oh, p.ow, p.o});
    CHECK(max_abs_diff(host(y), naive_conv(host(x), c.x, host(w), c.w, p)) < 1e-12);

    // f32: the vendor library (oneDNN / cuDNN) against the same loops, each of the three passes.
    using tg::backend::ConvPass;
    const auto xf = tg::cast<float>(x), wf = tg::cast<float>(w), dy = tg::cast<float>(dnormal(3, y.shape()));
    for (const auto& [pass, a, b] : {std::tuple{ConvPass::forward, xf, wf}, std::tuple{ConvPass::backward_data, dy, wf},
                                    std::tuple{ConvPass::backward_weights, xf, dy}}) {
      INFO("pass " << static_cast<int>(pass));
      const auto lib = tg::detail::conv_pass(pass, p, a, b), loop = tg::detail::conv_pass(pass, p, a, b, nullptr, nullptr, true);
      CHECK(max_abs_diff(host(lib), host(loop)) < 1e-4);
    }
    // bf16: f32 accumulation, the result rounded once: within bf16's rounding of the f32 result.
    const auto yb = tg::conv(tg::cast<tg::bf16>(xf), tg::cast<tg::bf16>(wf), c.strides, c.padding, c.dilation, c.groups);
    const auto yr = tg::conv(tg::cast<float>(tg::cast<tg::bf16>(xf)), tg::cast<float>(tg::cast<tg::bf16>(wf)), c.strides, c.padding, c.dilation, c.groups);
    const auto vb = host(yb), vr = host(yr);
    for (std::size_t i = 0; i < vb.size(); ++i) CHECK(std::fabs(vb[i] - vr[i]) <= 1e-2 * std::fabs(vr[i]) + 1e-3);
  }
}

TEST_CASE("conv gradients against finite differences in double, to second order", "[conv][grad]") {
  for (const Case& c : cases()) {
    const Xw<double> p{dnormal(1, c.x), dnormal(2, c.w)};
    check_fd(c.name, p, [&](const Xw<double>& q) { return tg::conv(q.x, q.w, c.strides, c.padding, c.dilation, c.groups); });
  }
  // The fused layer: bias and activation; its pre-activation path and its composed (second-order) path.
  const Case c = cases()[1];
  for (const auto act : {tg::Activation::none, tg::Activation::gelu, tg::Activation::silu}) {
    const Xwb<double> p{dnormal(1, c.x), dnormal(2, c.w), dnormal(3, {c.w[3]})};
    check_fd(tg::name_of(act), p, [&](const Xwb<double>& q) { return tg::conv(q.x, q.w, q.b, act, c.strides, c.padding); });
  }
}

TEST_CASE("the fused conv layer equals conv, + b, then the activation, in f32", "[conv]") {
  const auto x = tg::cast<float>(dnormal(1, {2, 9, 9, 3})), w = tg::cast<float>(dnormal(2, {3, 3, 3, 8})), b = tg::cast<float>(dnormal(3, {8}));
  for (const auto act : {tg::Activation::none, tg::Activation::relu, tg::Activation::gelu}) {
    INFO(tg::name_of(act));
    const auto fused = tg::conv(x, w, b, act, {2, 2}, "SAME");
    const auto plain = tg::detail::activate(tg::add(tg::conv(x, w, {2, 2}, "SAME"), b), act);
    CHECK(max_abs_diff(host(fused), host(plain)) < 1e-5);
    // ... and so do its gradients.
    auto f1 = [&](const Xwb<float>& q) { return tg::sum(tg::mul(tg::conv(q.x, q.w, q.b, act, {2, 2}, "SAME"), tg::cast<float>(dnormal(9, fused.shape())))); };
    auto f2 = [&](const Xwb<float>& q) {
      return tg::sum(tg::mul(tg::detail::activate(tg::add(tg::conv(q.x, q.w, {2, 2}, "SAME"), q.b), act), tg::cast<float>(dnormal(9, fused.shape()))));
    };
    const Xwb<float> p{x, w, b};
    const auto g1 = tg::grad(f1)(p), g2 = tg::grad(f2)(p);
    CHECK(max_abs_diff(host(g1.x), host(g2.x)) < 1e-4);
    CHECK(max_abs_diff(host(g1.w), host(g2.w)) < 1e-3);
    CHECK(max_abs_diff(host(g1.b), host(g2.b)) < 1e-3);
  }
}

TEST_CASE("max_pool and avg_pool: values as flax.linen's, gradients against finite differences", "[conv][grad]") {
  // 4 x 4 image, one channel: 2 x 2 windows, stride 2.
  std::vector<double> v(16);
  for (int i = 0; i < 16; ++i) v[static_cast<std::size_t>(i)] = (i * 7) % 16;
  const auto x = tg::from_vector<D>(v, {1, 4, 4, 1});
  CHECK(host(tg::max_pool(x, {2, 2}, {2, 2})) == std::vector<double>{12, 14, 15, 13});
  CHECK(host(tg::avg_pool(x, {2, 2}, {2, 2})) == std::vector<double>{(0 + 7 + 12 + 3) / 4.0, (14 + 5 + 10 + 1) / 4.0, (8 + 15 + 4 + 11) / 4.0,
                                                                      (6 + 13 + 2 + 9) / 4.0});
  // "SAME" 3 x 3 windows, stride 1: padding is excluded from the max, counted as zeros by the average
  // unless count_include_pad is false.
  CHECK(host(tg::max_pool(x, {3, 3}, {1, 1}, "SAME"))[0] == 12);  // the corner's 2 x 2 inside x: 0, 7, 12, 3
  const double corner_sum = v[0] + v[1] + v[4] + v[5];
  CHECK(std::fabs(host(tg::avg_pool(x, {3, 3}, {1, 1}, "SAME"))[0] - corner_sum / 9) < 1e-14);
  CHECK(std::fabs(host(tg::avg_pool(x, {3, 3}, {1, 1}, "SAME", false))[0] - corner_sum / 4) < 1e-14);

  const tg::Shape s{2, 7, 6, 3};
  // Distinct values, so that no window's maximum is tied (finite differences need a unique argmax).
  const auto xd = tg::add(dnormal(5, s), tg::arange<double, D>(s.numel()).reshape(s) * 1e-3);
  check_fd("max_pool 2x2 stride 2", xd, [](const tg::Tensor<double, D>& q) { return tg::max_pool(q, {2, 2}, {2, 2}); });
  check_fd("max_pool 3x3 SAME", xd, [](const tg::Tensor<double, D>& q) { return tg::max_pool(q, {3, 3}, {1, 1}, "SAME"); });
  check_fd("avg_pool 2x3 stride (2, 1) SAME", xd, [](const tg::Tensor<double, D>& q) { return tg::avg_pool(q, {2, 3}, {2, 1}, "SAME"); });
  check_fd("avg_pool without padding counts", xd, [](const tg::Tensor<double, D>& q) { return tg::avg_pool(q, {3, 3}, {2, 2}, "SAME", false); });
  // A pooled convolution, as the CNN stacks them.
  const Xw<double> p{xd, dnormal(6, {3, 3, 3, 4})};
  check_fd("max_pool of conv", p, [](const Xw<double>& q) { return tg::max_pool(tg::tanh(tg::conv(q.x, q.w)), {2, 2}, {2, 2}); });
}

TEST_CASE("conv and pools inside tg::vmap equal a loop over the examples", "[conv][vmap]") {
  const auto xs = tg::cast<float>(dnormal(1, {3, 2, 6, 6, 2}));  // 3 examples of a batch of 2 images
  const auto w = tg::cast<float>(dnormal(2, {3, 3, 2, 4})), b = tg::cast<float>(dnormal(3, {4}));
  auto f = [&](const tg::Tensor<float, D>& x) { return tg::max_pool(tg::conv(x, w, b, tg::Activation::relu), {2, 2}, {2, 2}); };
  const auto ys = tg::vmap(f)(xs);
  for (std::int64_t i = 0; i < 3; ++i) CHECK(max_abs_diff(host(tg::index_in_dim(ys, i, 0)), host(f(tg::index_in_dim(xs, i, 0)))) < 1e-6);
  CHECK_THROWS_WITH(tg::vmap([&](const tg::Tensor<float, D>& wk) { return tg::conv(tg::index_in_dim(xs, 0, 0), wk); })(
                        tg::cast<float>(dnormal(4, {2, 3, 3, 2, 4}))),
                    Contains("a kernel (or bias) per example is not supported yet"));
  // grad of a vmapped loss (the kernel shared): one convolution over every example's images.
  auto total = [&](const tg::Tensor<float, D>& k) {
    return tg::sum(tg::vmap([&](const tg::Tensor<float, D>& x) { return tg::tanh(tg::conv(x, k)); })(xs));
  };
  const auto g = tg::grad(total)(w);
  const auto g_ref = tg::grad([&](const tg::Tensor<float, D>& k) { return tg::sum(tg::tanh(tg::conv(xs.reshape({6, 6, 6, 2}), k))); })(w);
  CHECK(max_abs_diff(host(g), host(g_ref)) < 1e-4);
  // Per-example gradients of a kernel (vmap of grad) are not supported yet: an error, not garbage.
  auto loss = [](const tg::Tensor<float, D>& k, const tg::Tensor<float, D>& x) { return tg::sum(tg::conv(x, k)); };
  CHECK_THROWS_WITH(tg::vmap(tg::grad(loss), {std::nullopt, 0})(w, xs), Contains("nor are per-example gradients"));
}

TEST_CASE("the pools' CPU row loops give the values of the per-element loops CUDA runs", "[conv]") {
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    const tg::Shape s{2, 7, 9, 70};  // more channels than one chunk of lanes
    for (const auto& [window, strides, padding] : {std::tuple{tg::Window2{2, 2}, tg::Window2{2, 2}, tg::Padding("VALID")},
                                                   std::tuple{tg::Window2{3, 3}, tg::Window2{1, 2}, tg::Padding("SAME")}}) {
      INFO(padding.str() << " stride " << strides[1]);
      for (const bool bf : {false, true}) {
        INFO("bf16 " << bf);
        auto x = tg::cast<float>(dnormal(11, s));
        if (bf) x = tg::cast<float>(tg::cast<tg::bf16>(x));
        const auto p = tg::detail::pool_problem(s, window, strides, padding, "max_pool");
        const tg::Tensor<float, D> y = tg::max_pool(x, window, strides, padding);
        tg::Tensor<float, D> y2(y.shape());
        tg::Tensor<std::int32_t, D> at(y.shape());
        for (std::int64_t e = 0; e < y.size(); ++e) tg::detail::MaxPoolFn<float>{x.data(), y2.data(), at.data(), p}(e);
        CHECK(y.to_vector() == y2.to_vector());
        const auto dy = tg::cast<float>(dnormal(12, y.shape()));
        tg::Tensor<float, D> dx(s), dx2(s);
        tg::detail::MaxPoolScatterRowsFn<float> rows{{dy.data(), at.data(), dx.data(), p}};
        for (std::int64_t r = 0; r < p.n * p.h; ++r) rows(r);
        for (std::int64_t e = 0; e < dx.size(); ++e) tg::detail::MaxPoolScatterFn<float>{dy.data(), at.data(), dx2.data(), p}(e);
        CHECK(dx.to_vector() == dx2.to_vector());
        const auto a = tg::avg_pool(x, window, strides, padding, false);
        tg::Tensor<float, D> a2(a.shape());
        for (std::int64_t e = 0; e < a.size(); ++e) tg::detail::AvgPoolFn<float>{x.data(), a2.data(), p, false}(e);
        CHECK(a.to_vector() == a2.to_vector());
        tg::detail::AvgPoolTransposeRowsFn<float> trows{{dy.data(), dx.data(), p, true}};
        for (std::int64_t r = 0; r < p.n * p.h; ++r) trows(r);
        for (std::int64_t e = 0; e < dx.size(); ++e) tg::detail::AvgPoolTransposeFn<float>{dy.data(), dx2.data(), p, true}(e);
        CHECK(dx.to_vector() == dx2.to_vector());
      }
    }
    // bf16 pools: the f32 result rounded.
    const auto xb = tg::cast<tg::bf16>(tg::cast<float>(dnormal(13, s)));
    CHECK(tg::cast<float>(tg::max_pool(xb, {2, 2}, {2, 2})).to_vector() == tg::max_pool(tg::cast<float>(xb), {2, 2}, {2, 2}).to_vector());
  }
}

TEST_CASE("conv of empty operands: an empty batch, no input channels", "[conv]") {
  const auto w = tg::cast<float>(dnormal(1, {3, 3, 2, 4}));
  CHECK(tg::conv(tg::zeros<float, D>({0, 5, 5, 2}), w).shape() == tg::Shape{0, 5, 5, 4});
  const auto y = tg::conv(tg::zeros<float, D>({2, 5, 5, 0}), tg::zeros<float, D>({3, 3, 0, 4}));
  CHECK(y.shape() == tg::Shape{2, 5, 5, 4});
  for (const float v : y.to_vector()) CHECK(v == 0.0f);
  const auto g = tg::grad([&](const tg::Tensor<float, D>& k) { return tg::sum(tg::conv(tg::zeros<float, D>({0, 5, 5, 2}), k)); })(w);
  for (const float v : g.to_vector()) CHECK(v == 0.0f);
}

TEST_CASE("cuDNN's layout moves, on the CPU: the kernel to (o, kh, kw, i) and back, images padded and cropped", "[conv]") {
  if constexpr (std::is_same_v<D, tg::Cpu>) {
    const tg::Shape ks{3, 2, 4, 5};  // HWIO
    const auto k = tg::arange<float, D>(ks.numel()).reshape(ks);
    tg::Tensor<float, D> ohwi(tg::Shape{ks.numel()}), back(ks);
    for (std::int64_t e = 0; e < ks.numel(); ++e) tg::cuda::detail::KernelLayoutFn<float>{k.data(), ohwi.data(), 6, 4, 5, true}(e);
    const auto kv = k.to_vector(), ov = ohwi.to_vector();
    for (std::int64_t o = 0; o < 5; ++o)
      for (std::int64_t s = 0; s < 6; ++s)
        for (std::int64_t i = 0; i < 4; ++i) CHECK(ov[static_cast<std::size_t>((o * 6 + s) * 4 + i)] == kv[static_cast<std::size_t>((s * 4 + i) * 5 + o)]);
    for (std::int64_t e = 0; e < ks.numel(); ++e) tg::cuda::detail::KernelLayoutFn<float>{ohwi.data(), back.data(), 6, 4, 5, false}(e);
    CHECK(back.to_vector() == kv);

    // "SAME" with stride 2 over 6 x 5 pads (0, 1) and (1, 1) or so: as cuDNN runs it, the images padded
    // by PadImagesFn and convolved without padding give the convolution, and cropping undoes the padding.
    const auto x = tg::cast<float>(dnormal(1, {2, 6, 5, 3})), w = tg::cast<float>(dnormal(2, {3, 2, 3, 4}));
    const auto p = tg::detail::conv_problem(x, w, {2, 2}, "SAME", {1, 1}, 1, "conv");
    REQUIRE((p.pad_lo[0] != p.pad_hi[0] || p.pad_lo[1] != p.pad_hi[1]));
    const std::int64_t hp = p.h + p.pad_lo[0] + p.pad_hi[0], wp = p.w + p.pad_lo[1] + p.pad_hi[1];
    tg::Tensor<float, D> xp(tg::Shape{p.n, hp, wp, p.c}), xc(x.shape());
    for (std::int64_t e = 0; e < xp.size(); ++e)
      tg::cuda::detail::PadImagesFn<float>{x.data(), xp.data(), p.h, p.w, p.c, hp, wp, p.pad_lo[0], p.pad_lo[1], true}(e);
    CHECK(max_abs_diff(host(tg::conv(xp, w, {2, 2}, "VALID")), host(tg::conv(x, w, {2, 2}, "SAME"))) < 1e-5);
    for (std::int64_t e = 0; e < xc.size(); ++e)
      tg::cuda::detail::PadImagesFn<float>{xp.data(), xc.data(), p.h, p.w, p.c, hp, wp, p.pad_lo[0], p.pad_lo[1], false}(e);
    CHECK(xc.to_vector() == x.to_vector());
  }
}

}  // namespace conv_tests
