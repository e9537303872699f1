// Neural-network ops: the fused, stable softmax cross-entropy with integer labels, accuracy, one_hot.
#pragma once

#include <cstdint>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/matmul.hpp"
#include "tapegrad/ops/reduce.hpp"

namespace tg::inline TG_ABI {

namespace detail {

/// loss[r] = logsumexp(logits[r]) - logits[r, label[r]] for each row of (rows, n) logits.
template <class T>
struct SoftmaxCrossEntropyFn {
  const T* logits;
  const std::int32_t* labels;
  T* loss;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<T>;
    const T* x = logits + row * n;
    const auto [m, s] = max_sum_exp(x, n, 1);
    const std::int32_t label = labels[row];
    // Out-of-range labels were rejected before the launch; NaN guards against a label changed since.
    const C picked = label >= 0 && label < n ? convert_from<C>(x[label]) : C(NAN);
    loss[row] = convert_to<T>(m + math::log(s) - picked);
  }
};

/// dlogits[r, k] = dloss[r] (softmax(logits[r])[k] - [k == label[r]]): softmax minus one-hot, per row.
template <class T>
struct SoftmaxCrossEntropyBackwardFn {
  const T* logits;
  const std::int32_t* labels;
  const T* dloss;
  T* dlogits;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    using C = compute_t<T>;
    const T* x = logits + row * n;
    T* dx = dlogits + row * n;
    const auto [m, s] = max_sum_exp(x, n, 1);
    const C g = convert_from<C>(dloss[row]), inv = C(1) / s;
    for (std::int64_t k = 0; k < n; ++k) {
      const C p = math::exp(convert_from<C>(x[k]) - m) * inv;
      dx[k] = convert_to<T>(g * (p - (k == labels[row] ? C(1) : C(0))));
    }
  }
};

#if defined(TG_WITH_CUDA)
/// Reports the first label outside [0, n_classes) to the device's error slot (raised at the next sync).
struct LabelCheckFn {
  const std::int32_t* labels;
  std::int64_t n_classes;
  const char* op;
  cuda::DeviceError* slot;
  TG_HD void operator()(std::int64_t i) const {
    const std::int32_t label = labels[i];
    if (label >= 0 && label < n_classes) return;
#if defined(__CUDA_ARCH__)
    if (atomicCAS(&slot->code, 0, 1) == 0) {
      slot->value = label, slot->position = i, slot->limit = n_classes, slot->op = op;
      __threadfence_system();
    }
#endif
  }
};
#endif

/// Rejects labels outside [0, n_classes), naming the op, the first bad label and its position. Never
/// synchronises: on the CPU the check is a kernel of its own (replayed by compiled steps too), on CUDA
/// a kernel reports to the device's error slot and the next synchronisation raises it.
template <class D>
void check_labels(const Tensor<std::int32_t, D>& labels, std::int64_t n_classes, const char* op) {
  if constexpr (std::is_same_v<D, Cpu>) {
    cpu_kernel([p = labels.data(), count = labels.size(), n_classes, op] {
      for (std::int64_t i = 0; i < count; ++i)
        if (p[i] < 0 || p[i] >= n_classes)
          fail(op, "label ", p[i], " at position ", i, " is out of range for ", n_classes,
               " classes; labels must be in [0, ", n_classes, ")");
    });
  } else {
#if defined(TG_WITH_CUDA)
    index_map<D>(labels.size(), LabelCheckFn{labels.data(), n_classes, op, cuda::error_slot()});
#else
    (void)labels, (void)n_classes, (void)op;
    cuda::require_device(op);
#endif
  }
}

template <class T>
struct CorrectFn {
  const T* logits;
  const std::int32_t* labels;
  compute_t<T>* correct;
  std::int64_t n;
  TG_HD void operator()(std::int64_t row) const {
    std::int32_t best = 0;
    ArgmaxAxisFn<T>{logits + row * n, &best, n, 1}(0);
    correct[row] = best == labels[row] ? compute_t<T>(1) : compute_t<T>(0);
  }
};

template <class T>
struct OneHotFn {
  const std::int32_t* labels;
  T* out;
  std::int64_t n;
  TG_HD void operator()(std::int64_t i) const {
    const std::int64_t row = i / n, k = i % n;
    out[i] = convert_to<T>(labels[row] == k ? 1.0f : 0.0f);
  }
};

template <class T, class D>
void check_logits_labels(const Tensor<T, D>& logits, const Tensor<std::int32_t, D>& labels, const char* op) {
  check_defined(logits, op);
  check_defined(labels, op);
  TG_CHECK(logits.rank() >= 1, op, "logits need a class axis, got a scalar");
  std::vector<std::int64_t> batch(logits.shape().dims().begin(), logits.shape().dims().end() - 1);
  TG_CHECK(labels.shape() == Shape(std::span<const std::int64_t>(batch)), op, "labels of shape ", labels.shape().str(),
           " do not match logits of shape ", logits.shape().str(), "; labels need the logits' shape without the class axis");
}

}  // namespace detail

/// Per-example -log softmax(logits)[label], fused and stable: logits (..., C), int32 labels (...) -> (...).
/// As optax.softmax_cross_entropy_with_integer_labels. A label outside [0, C) is an error.
template <FloatElement T, Device D>
Tensor<T, D> softmax_cross_entropy_with_integer_labels(const Tensor<T, D>& logits, const Tensor<std::int32_t, D>& labels) {
  const char* op = "softmax_cross_entropy_with_integer_labels";
  detail::check_logits_labels(logits, labels, op);
  const std::int64_t n = logits.dim(-1);
  detail::check_labels(labels, n, op);
  Tensor<T, D> loss(labels.shape());
  detail::index_map<D>(labels.size(), detail::SoftmaxCrossEntropyFn<T>{logits.data(), labels.data(), loss.data(), n}, 8 * n);
  if (detail::recording(logits)) {
    detail::record(loss, {logits.trace()}, [in = logits.trace(), x0 = logits.untraced(), y = labels, n](
                                               detail::Tape& t, const Tensor<T, D>& dloss) {
      Tensor<T, D> dx(x0.shape());
      detail::index_map<D>(y.size(), detail::SoftmaxCrossEntropyBackwardFn<T>{x0.data(), y.data(), dloss.data(), dx.data(), n}, 16 * n);
      t.accumulate(in, dx);
    });
  }
  return loss;
}

/// Fraction of rows whose argmax equals the label, as a 0-d tensor (float; double for double logits).
template <FloatElement T, Device D>
Tensor<compute_t<T>, D> accuracy(const Tensor<T, D>& logits, const Tensor<std::int32_t, D>& labels) {
  detail::check_logits_labels(logits, labels, "accuracy");
  TG_CHECK(labels.size() > 0, "accuracy", "needs at least one example");
  const std::int64_t n = logits.dim(-1);
  Tensor<compute_t<T>, D> correct(labels.shape());
  detail::index_map<D>(labels.size(), detail::CorrectFn<T>{logits.data(), labels.data(), correct.data(), n});
  return mean(correct);
}

/// one_hot(labels, n): (..., n) with 1 at each label; a label outside [0, n) gives a row of zeros, as
/// jax.nn.one_hot.
template <FloatElement T = float, Device D>
Tensor<T, D> one_hot(const Tensor<std::int32_t, D>& labels, std::int64_t num_classes) {
  detail::check_defined(labels, "one_hot");
  TG_CHECK(num_classes > 0, "one_hot", "num_classes must be > 0, got ", num_classes);
  std::vector<std::int64_t> dims(labels.shape().dims().begin(), labels.shape().dims().end());
  dims.push_back(num_classes);
  Tensor<T, D> out{Shape(std::span<const std::int64_t>(dims))};
  detail::index_map<D>(out.size(), detail::OneHotFn<T>{labels.data(), out.data(), num_classes});
  return out;
}

}  // namespace tg
