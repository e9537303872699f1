// Tensor<T, D>: a row-major, contiguous array on one device with shared, immutable-by-convention storage.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/dtype.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/base/shape.hpp"
#include "tapegrad/runtime/device.hpp"
#include "tapegrad/runtime/dispatch.hpp"
#include "tapegrad/runtime/recorder.hpp"
#include "tapegrad/runtime/storage.hpp"
#include "tapegrad/core/tape.hpp"

TG_BEGIN_NAMESPACE

template <Element T, Device D = Cpu>
class Tensor;

namespace detail {

template <Element T>
struct FillFn {
  T* out;
  T value;
  TG_HD void operator()(std::int64_t i) const { out[i] = value; }
};

/// out[i] = x[i % n]: one example repeated (a broadcast view materialised).
template <Element T>
struct RepeatFn {
  const T* x;
  T* out;
  std::int64_t n;
  TG_HD void operator()(std::int64_t i) const { out[i] = x[i % n]; }
};

template <Element T>
struct ArangeFn {
  T* out;
  double start, step;
  TG_HD void operator()(std::int64_t i) const { out[i] = convert_to<T>(start + step * static_cast<double>(i)); }
};

}  // namespace detail

/// A row-major, contiguous n-d array of T on device D (tg::Cpu or tg::Cuda).
/// Copies are cheap and share storage; ops return new tensors and never change their inputs.
/// Inside value_and_grad a tensor may also carry a trace: its node on the tape recording the function.
/// Inside tg::vmap it may be batched: its storage holds one per-example tensor per batch element (the
/// batch axes first, one per vmap level it is batched at, outermost first), while shape(), size(),
/// rank() and dim() describe one example, as in the function vmap was given (autodiff/vmap.hpp).
template <Element T, Device D>
class Tensor {
 public:
  using value_type = T;
  using device_type = D;

  /// An undefined tensor (no storage); most operations on it are errors.
  Tensor() = default;

  /// An uninitialised tensor of `shape` (prefer tg::empty / tg::zeros).
  explicit Tensor(Shape shape)
      : storage_(detail::new_storage<D>(static_cast<std::size_t>(shape.numel()) * sizeof(T))), shape_(shape) {}

  /// A tensor of `shape` over an existing block (at least shape.numel() elements of T); for compile()
  /// and other code that manages buffers itself.
  Tensor(std::shared_ptr<Storage<D>> storage, Shape shape) : storage_(std::move(storage)), shape_(shape) {
    TG_CHECK(storage_ && storage_->bytes() >= static_cast<std::size_t>(shape.numel()) * sizeof(T), "Tensor",
             "a block of ", storage_ ? storage_->bytes() : 0, " bytes cannot hold shape ", shape.str(), " of ",
             dtype_name<T>);
  }

  /// The shared block this tensor views (null when undefined).
  const std::shared_ptr<Storage<D>>& storage() const { return storage_; }

  bool defined() const { return storage_ != nullptr; }
  /// The shape (of one example, inside tg::vmap).
  const Shape& shape() const { return batch_levels_ ? logical_ : shape_; }
  /// Number of elements.
  std::int64_t size() const { return shape().numel(); }
  int rank() const { return shape().rank(); }
  /// Size of dimension `axis` (negative counts from the end).
  std::int64_t dim(int axis) const { return shape()[axis]; }
  /// Bytes of the storage this tensor views (all examples of a batched tensor).
  std::size_t nbytes() const { return static_cast<std::size_t>(shape_.numel()) * sizeof(T); }
  static constexpr DType dtype() { return dtype_of<T>; }

  /// Pointer to the first element, in D's memory. A batched tensor has none: an op reads it through
  /// its batching rule, which works on physical(); reaching here means the op has none.
  T* data() const {
    if (batch_levels_ != 0) [[unlikely]] batched_data_error();
    return storage_ ? static_cast<T*>(storage_->data()) : nullptr;
  }

  /// The vmap levels this tensor is batched at (bit d: the d-th enclosing tg::vmap); 0 when unbatched.
  std::uint32_t batch_levels() const { return batch_levels_; }
  /// The batched tensor as the ops see it: every example, the batch axes first; unbatched, itself. A
  /// broadcast view is copied out once per example here (with its trace: the copies are its value).
  Tensor physical() const {
    if (shared_) {
      Tensor r(shape_);
      const std::int64_t n = logical_.numel();
      if (r.size() > 0) ::tg::detail::index_map<D>(r.size(), ::tg::detail::RepeatFn<T>{static_cast<const T*>(storage_->data()), r.data(), n});
      r.trace_ = trace_;
      return r;
    }
    Tensor r = *this;
    r.batch_levels_ = 0;
    r.logical_ = Shape{};
    return r;
  }
  /// The storage's shape: the batch axes first when batched (physical().shape(), without the copy).
  const Shape& physical_shape() const { return shape_; }
  /// `one` seen as batched at `levels` with every example equal to it, without copying it: how
  /// value_and_grad inside tg::vmap gives each example the shared parameters, whose gradients are per
  /// example (`physical_shape`: the batch axes, then one's shape). Ops whose batching rules know such
  /// views (linear, matmul) use the one copy; the others see physical().
  static Tensor broadcast_view(const Tensor& one, std::uint32_t levels, const Shape& physical_shape) {
    TG_CHECK(one.batch_levels_ == 0 && levels != 0 && physical_shape.numel() % std::max<std::int64_t>(one.size(), 1) == 0, "vmap",
             "cannot view ", one.shape().str(), " as ", physical_shape.str(), "; please report this as a tapegrad bug");
    Tensor r = one;
    r.batch_levels_ = levels;
    r.logical_ = one.shape_;
    r.shape_ = physical_shape;
    r.shared_ = true;
    return r;
  }
  /// True for a broadcast view: one example's storage, shared by every example.
  bool is_broadcast_view() const { return shared_; }
  /// The example a broadcast view holds, untraced and unbatched.
  Tensor shared_example() const {
    TG_CHECK(shared_, "vmap", "shared_example() of a tensor that is not a broadcast view; please report this as a tapegrad bug");
    Tensor r = *this;
    r.shape_ = logical_;
    r.logical_ = Shape{};
    r.batch_levels_ = 0;
    r.shared_ = false;
    r.trace_ = {};
    return r;
  }
  /// `physical` seen as batched at `levels`: its first popcount(levels) axes are the batch axes, one per
  /// level, outermost first (the batching rules and tg::vmap make these; a user has no need to).
  static Tensor batched(const Tensor& physical, std::uint32_t levels) {
    Tensor r = physical;
    const int nb = std::popcount(levels);
    TG_CHECK(physical.batch_levels_ == 0 && !physical.shared_ && nb <= physical.shape_.rank(), "vmap", "cannot batch a tensor of shape ",
             physical.shape_.str(), " at ", nb, " levels; please report this as a tapegrad bug");
    r.batch_levels_ = levels;
    if (levels) r.logical_ = Shape(physical.shape_.dims().subspan(static_cast<std::size_t>(nb)));
    return r;
  }

  /// "cpu", or "cuda:<index> <device name>".
  std::string device_name() const {
    if constexpr (std::is_same_v<D, Cpu>) {
      return "cpu";
    } else {
      const int index = storage_ ? storage_->device() : cuda::current_device();
      return ::tg::detail::concat("cuda:", index, " ", cuda::device_info(index).name);
    }
  }

  /// The same data seen with another shape of the same size; shares storage. One dimension may be -1.
  Tensor reshape(std::initializer_list<std::int64_t> dims) const { return reshape(std::span(dims.begin(), dims.size())); }
  Tensor reshape(std::span<const std::int64_t> dims) const {
    std::vector<std::int64_t> d(dims.begin(), dims.end());
    const auto n_inferred = std::count(d.begin(), d.end(), -1);
    TG_CHECK(n_inferred <= 1, "reshape", "at most one dimension may be -1, got ", n_inferred);
    if (n_inferred == 1) {
      std::int64_t known = 1;
      for (auto x : d)
        if (x != -1) known *= x;
      TG_CHECK(known != 0 && size() % known == 0, "reshape", "cannot infer -1: ", size(),
               " elements do not divide into dimensions of size ", known, " (from ", shape_.str(), ")");
      for (std::int64_t& x : d)
        if (x == -1) x = size() / known;
    }
    return reshape(Shape(d));
  }
  Tensor reshape(const Shape& shape) const {
    TG_CHECK(shape.numel() == size(), "reshape", "cannot reshape ", this->shape().str(), " (", size(), " elements) to ",
             shape.str(), " (", shape.numel(), " elements)");
    if (batch_levels_) {  // batching rule: the batch axes stay in front
      const int nb = std::popcount(batch_levels_);
      std::vector<std::int64_t> dims(shape_.dims().begin(), shape_.dims().begin() + nb);
      dims.insert(dims.end(), shape.dims().begin(), shape.dims().end());
      TG_CHECK(static_cast<int>(dims.size()) <= Shape::max_rank, "reshape", "inside tg::vmap the shape ", shape.str(),
               " and ", nb, " batch axes exceed the maximum rank ", Shape::max_rank);
      return batched(physical().reshape(Shape(dims)), batch_levels_);
    }
    Tensor r = *this;
    r.shape_ = shape;
    r.trace_ = {};
    ::tg::detail::record_reshape(*this, r);
    return r;
  }

  /// A copy on device D2 (for D2 == D, a shared copy: tensors are never mutated in place).
  template <Device D2>
  Tensor<T, D2> to() const {
    require_defined("to");
    if constexpr (std::is_same_v<D, D2>) {
      return *this;
    } else if (batch_levels_) {  // batching rule: every example moves
      return Tensor<T, D2>::batched(physical().template to<D2>(), batch_levels_);
    } else {
      ::tg::detail::forbid_in_compiled_step("to", "a transfer between the host and a device");
      Tensor<T, D2> r(shape_);
      ::tg::detail::copy_bytes<D2, D>(r.data(), data(), nbytes());
      ::tg::detail::record_transfer(*this, r);
      return r;
    }
  }

  /// The elements, in row-major order, copied to the host.
  std::vector<T> to_vector() const {
    require_defined("to_vector");
    forbid_batched("to_vector");
    ::tg::detail::forbid_in_compiled_step("to_vector", "a host read");
    std::vector<T> v(static_cast<std::size_t>(size()));
    ::tg::detail::copy_bytes<Cpu, D>(v.data(), data(), nbytes());
    return v;
  }

  /// The single element of a one-element tensor, copied to the host.
  T item() const {
    require_defined("item");
    forbid_batched("item");
    ::tg::detail::forbid_in_compiled_step("item", "a host read");
    TG_CHECK(size() == 1, "item", "needs a tensor with exactly one element, got shape ", shape_.str(), " (",
             size(), " elements); index it with at({...}) or reduce it first");
    T v;
    ::tg::detail::copy_bytes<Cpu, D>(&v, data(), sizeof(T));
    return v;
  }

  /// The element at a full index (each in [-dim, dim)), copied to the host.
  T at(std::initializer_list<std::int64_t> index) const {
    require_defined("at");
    forbid_batched("at");
    ::tg::detail::forbid_in_compiled_step("at", "a host read");
    TG_CHECK(static_cast<int>(index.size()) == rank(), "at", "index has ", index.size(),
             " components but the tensor has shape ", shape_.str());
    std::int64_t offset = 0;
    int axis = 0;
    for (std::int64_t i : index) {
      const std::int64_t n = shape_[axis];
      TG_CHECK(i >= -n && i < n, "at", "index ", i, " is out of range for axis ", axis, " of size ", n,
               " (shape ", shape_.str(), ")");
      offset = offset * n + (i < 0 ? i + n : i);
      ++axis;
    }
    T v;
    ::tg::detail::copy_bytes<Cpu, D>(&v, data() + offset, sizeof(T));
    return v;
  }

  /// Prints shape, dtype, device and up to the first 8 values.
  friend std::ostream& operator<<(std::ostream& os, const Tensor& t) {
    if (!t.defined()) return os << "Tensor(undefined)";
    t.forbid_batched("operator<<");
    ::tg::detail::forbid_in_compiled_step("operator<<", "printing (a host read)");
    os << "Tensor(shape=" << t.shape() << ", dtype=" << dtype_name<T> << ", device=" << t.device_name() << ") [";
    constexpr std::int64_t shown = 8;
    const std::int64_t n = std::min(t.size(), shown);
    std::vector<T> head(static_cast<std::size_t>(n));
    ::tg::detail::copy_bytes<Cpu, D>(head.data(), t.data(), static_cast<std::size_t>(n) * sizeof(T));
    for (std::int64_t i = 0; i < n; ++i) {
      if (i) os << ", ";
      if constexpr (std::is_same_v<T, std::uint8_t> || std::is_same_v<T, bf16>) os << +static_cast<float>(head[i]);
      else os << head[i];
    }
    if (t.size() > shown) os << ", ... (" << t.size() << " total)";
    return os << "]";
  }

  /// The tape node this tensor is, inside value_and_grad (tape 0 when untraced).
  const detail::Trace& trace() const { return trace_; }
  void set_trace(const detail::Trace& t) { trace_ = t; }
  /// The same tensor without its trace: a constant to any tape (tg::stop_gradient).
  Tensor untraced() const {
    Tensor r = *this;
    r.trace_ = {};
    return r;
  }

 private:
  void require_defined(const char* op) const {
    TG_CHECK(defined(), op, "the tensor is undefined (default-constructed); create it with tg::zeros, "
                            "tg::from_vector or an op");
  }
  std::string batch_str() const {
    return shape_.str() + " with " + std::to_string(std::popcount(batch_levels_)) + " batch axes in front";
  }
  void forbid_batched(const char* op) const {
    TG_CHECK(batch_levels_ == 0, op, "cannot read the values of a tensor batched by tg::vmap (per-example shape ",
             logical_.str(), ", stored as ", batch_str(), ") inside the vmapped function, as jax.vmap cannot; return it "
             "from the function and read the result");
  }
  [[noreturn]] void batched_data_error() const {
    throw Error(::tg::detail::concat("[vmap] an op without a batching rule was given a tensor batched by tg::vmap "
                                     "(per-example shape ", logical_.str(), ", stored as ", batch_str(),
                                     "); docs/vmap.md lists the ops that have one: write the function with those, or "
                                     "call this op outside vmap"));
  }

  std::shared_ptr<Storage<D>> storage_;
  Shape shape_;  // the storage's shape: with the batch axes when batched
  detail::Trace trace_;
  std::uint32_t batch_levels_ = 0;
  bool shared_ = false;  // a broadcast view: the storage holds one example (logical_), shared by all
  Shape logical_;  // one example's shape, when batched
};

/// An uninitialised tensor.
template <Element T, Device D = Cpu>
Tensor<T, D> empty(const Shape& shape) {
  return Tensor<T, D>(shape);
}

/// A tensor filled with `value`.
template <Element T, Device D = Cpu>
Tensor<T, D> full(const Shape& shape, T value) {
  Tensor<T, D> t(shape);
  detail::index_map<D>(t.size(), detail::FillFn<T>{t.data(), value});
  return t;
}

template <Element T, Device D = Cpu>
Tensor<T, D> zeros(const Shape& shape) {
  return full<T, D>(shape, detail::convert_to<T>(0.0));
}

template <Element T, Device D = Cpu>
Tensor<T, D> ones(const Shape& shape) {
  return full<T, D>(shape, detail::convert_to<T>(1.0));
}

/// [start, start + step, ...) up to but excluding `stop`, as NumPy's arange.
template <Element T, Device D = Cpu>
Tensor<T, D> arange(double start, double stop, double step = 1.0) {
  TG_CHECK(step != 0.0, "arange", "step must be non-zero");
  const double n = (stop - start) / step;
  TG_CHECK(n < 9.0e15, "arange", "too many elements: (", stop, " - ", start, ") / ", step);
  const auto count = n > 0 ? static_cast<std::int64_t>(std::ceil(n)) : std::int64_t{0};
  Tensor<T, D> t(Shape{count});
  detail::index_map<D>(count, detail::ArangeFn<T>{t.data(), start, step});
  return t;
}

/// 0, 1, ..., n - 1.
template <Element T, Device D = Cpu>
Tensor<T, D> arange(std::int64_t n) {
  TG_CHECK(n >= 0, "arange", "n must be >= 0, got ", n);
  return arange<T, D>(0.0, static_cast<double>(n));
}

/// A tensor of `shape` holding a copy of `values` (row-major); the counts must agree.
template <Device D = Cpu, Element T>
Tensor<T, D> from_span(std::span<const T> values, const Shape& shape) {
  TG_CHECK(static_cast<std::int64_t>(values.size()) == shape.numel(), "from_vector", "got ", values.size(),
           " values for shape ", shape.str(), ", which holds ", shape.numel());
  Tensor<T, D> t(shape);
  // Inside a compiled step this is a constant: its buffer is kept by the plan and filled once, when
  // recorded (the CUDA capture pass is served that same, already filled buffer).
  const detail::Recorder* r = detail::active_recorder;
  if (!(r && r->mode == detail::Recorder::Mode::serve)) detail::copy_bytes<D, Cpu>(t.data(), values.data(), t.nbytes());
  return t;
}

template <Device D = Cpu, Element T>
Tensor<T, D> from_vector(const std::vector<T>& values, const Shape& shape) {
  return from_span<D>(std::span<const T>(values), shape);
}

/// A 1-d tensor holding `values`.
template <Device D = Cpu, Element T>
Tensor<T, D> from_vector(const std::vector<T>& values) {
  return from_span<D>(std::span<const T>(values), Shape{static_cast<std::int64_t>(values.size())});
}

/// A copy of `t` on device D2, as jax.device_put.
template <Device D2, Element T, Device D>
Tensor<T, D2> device_put(const Tensor<T, D>& t) {
  return t.template to<D2>();
}

/// `x` as a constant: gradients do not flow through it (jax.lax.stop_gradient).
template <Element T, Device D>
Tensor<T, D> stop_gradient(const Tensor<T, D>& x) {
  return x.untraced();
}

TG_END_NAMESPACE
