// Fixed-size batches for training: pixels scaled to [0, 1] and flattened, optionally shuffled once (with a
// key, in jax.random.permutation's order, or in a given order such as NumPy's), cut into equal batches with the tail trimmed, and moved to the
// device once, so that the training loop never copies from the host.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/random/random.hpp"

TG_BEGIN_NAMESPACE
namespace data {

/// One batch: x (B, features) float32, y (B,) int32 class labels.
template <Device D>
struct Batch {
  Tensor<float, D> x;
  Tensor<std::int32_t, D> y;
};

/// Batches of `batch_size` examples from images (N, d1, ...) and labels (N,) of a data set of
/// `num_classes` classes: each image flattened to d1 * d2 * ... floats = pixel / 255; with
/// `shuffle_key`, examples in the order of random::permutation(key, N), else in file order;
/// N / batch_size batches (the last N % batch_size examples are dropped); each batch moved to D.
/// With `shards` > 1 (data parallel), each batch is this shard's `batch_size / shards` consecutive
/// examples of the global batch (shard `shard` of `shards`), so the shards of all ranks together are
/// exactly the single-process batches. Throws for mismatched counts, a batch size out of [1, N] or not
/// divisible by `shards`, and a label outside [0, num_classes).
template <Device D>
std::vector<Batch<D>> fixed_batches(const Tensor<std::uint8_t>& images, const Tensor<std::uint8_t>& labels, std::int64_t batch_size,
                                    int num_classes, std::span<const std::int64_t> order, int shard = 0, int shards = 1);

template <Device D>
std::vector<Batch<D>> fixed_batches(const Tensor<std::uint8_t>& images, const Tensor<std::uint8_t>& labels, std::int64_t batch_size,
                                    int num_classes, std::optional<random::Key> shuffle_key = std::nullopt, int shard = 0, int shards = 1) {
  TG_CHECK(labels.rank() == 1, "fixed_batches", "labels must be 1-d, got ", labels.shape().str());
  const std::int64_t n = labels.shape()[0];
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  if (shuffle_key) {
    const auto p = random::permutation(*shuffle_key, n).to_vector();
    std::copy(p.begin(), p.end(), order.begin());
  } else {
    for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  }
  return fixed_batches<D>(images, labels, batch_size, num_classes, std::span<const std::int64_t>(order), shard, shards);
}

/// The same, with the examples in a given `order`, a permutation of [0, N): for example NumPy's,
/// tg::random::numpy::default_rng(0).permutation(N), which the JAX codelab shuffles with.
template <Device D>
std::vector<Batch<D>> fixed_batches(const Tensor<std::uint8_t>& images, const Tensor<std::uint8_t>& labels, std::int64_t batch_size,
                                    int num_classes, std::span<const std::int64_t> order, int shard, int shards) {
  TG_CHECK(shards >= 1 && shard >= 0 && shard < shards, "fixed_batches", "shard ", shard, " of ", shards, " does not exist");
  TG_CHECK(batch_size % shards == 0, "fixed_batches", "batch size ", batch_size, " does not split into ", shards,
           " equal shards; use a multiple of ", shards);
  TG_CHECK(images.rank() >= 1 && labels.rank() == 1 && images.shape()[0] == labels.shape()[0], "fixed_batches",
           "images ", images.shape().str(), " and labels ", labels.shape().str(), " must hold the same number of examples");
  const std::int64_t n = labels.shape()[0];
  TG_CHECK(batch_size >= 1 && batch_size <= n, "fixed_batches", "batch size ", batch_size, " must be in [1, ", n,
           "], the number of examples");
  const std::int64_t features = n > 0 ? images.size() / n : 0;
  const std::vector<std::uint8_t> pixels = images.to_vector();
  const std::vector<std::uint8_t> classes = labels.to_vector();
  for (std::int64_t i = 0; i < n; ++i)
    TG_CHECK(classes[static_cast<std::size_t>(i)] < num_classes, "fixed_batches", "label ", int(classes[static_cast<std::size_t>(i)]),
             " of example ", i, " is outside [0, ", num_classes, ")");
  TG_CHECK(static_cast<std::int64_t>(order.size()) == n, "fixed_batches", "an order of ", order.size(), " indices for ", n, " examples");
  std::vector<bool> seen(static_cast<std::size_t>(n), false);
  for (const std::int64_t i : order) {
    TG_CHECK(i >= 0 && i < n && !seen[static_cast<std::size_t>(i)], "fixed_batches", "the order is not a permutation of [0, ", n,
             "): index ", i, i >= 0 && i < n ? " appears twice" : " is out of range");
    seen[static_cast<std::size_t>(i)] = true;
  }

  std::vector<Batch<D>> batches;
  const std::int64_t local = batch_size / shards, first = shard * local;
  std::vector<float> x(static_cast<std::size_t>(local * features));
  std::vector<std::int32_t> y(static_cast<std::size_t>(local));
  for (std::int64_t b = 0; b + 1 <= n / batch_size; ++b) {
    for (std::int64_t r = 0; r < local; ++r) {
      const auto src = static_cast<std::size_t>(order[static_cast<std::size_t>(b * batch_size + first + r)]);
      const std::uint8_t* p = pixels.data() + src * static_cast<std::size_t>(features);
      float* q = x.data() + r * features;
      for (std::int64_t f = 0; f < features; ++f) q[f] = static_cast<float>(p[f]) / 255.0f;
      y[static_cast<std::size_t>(r)] = classes[src];
    }
    batches.push_back({from_vector<D>(x, {local, features}), from_vector<D>(y, {local})});
  }
  return batches;
}

}  // namespace data
TG_END_NAMESPACE
