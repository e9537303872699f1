// The tape a traced Tensor records on: nodes, recording, and the backward walk. value_and_grad
// (autodiff/) creates a tape, marks the parameters' leaves as its first nodes, and walks it backward;
// each op records itself here with its backward rule beside its forward (ops/).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <variant>
#include <vector>

#include "tapegrad/core/tensor.hpp"

namespace tg {

/// Any floating-point tensor: what a tape holds cotangents as.
using AnyFloatTensor = std::variant<std::monostate, Tensor<float, Cpu>, Tensor<double, Cpu>, Tensor<bf16, Cpu>,
                                    Tensor<float, Cuda>, Tensor<double, Cuda>, Tensor<bf16, Cuda>>;

namespace detail {

/// State an op leaves for the op that consumes its output, so the two can fuse their backward passes
/// (the fused linear layer uses it for cuBLASLt's DGELU_BGRAD).
struct FusedProducer {
  virtual ~FusedProducer() = default;
  bool pending = false;  ///< the consumer has already delivered this node's gradient in fused form
};

/// A record of the ops applied to traced tensors, in order.
class Tape {
 public:
  using Backward = std::function<void(Tape&)>;

  Tape() : id_(next_id()) {}
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  std::uint64_t id() const { return id_; }
  bool owns(const Trace& t) const { return t.tape == id_; }
  std::int64_t size() const { return static_cast<std::int64_t>(cotangents_.size()); }

  /// A fresh node for a value of `shape`, with no cotangent yet.
  std::int64_t new_node(const Shape& shape) {
    shapes_.push_back(shape);
    cotangents_.emplace_back();
    uses_.push_back(0);
    producers_.emplace_back();
    return size() - 1;
  }

  /// Counts one more consumer of a traced input (fusion across ops needs a single consumer).
  void use(const Trace& t) {
    if (owns(t)) ++uses_[static_cast<std::size_t>(t.node)];
  }
  int uses(std::int64_t node) const { return uses_[static_cast<std::size_t>(node)]; }

  void push(Backward fn) { entries_.push_back(std::move(fn)); }

  /// Adds `g` to the cotangent of the traced tensor `t` (nothing if `t` is not on this tape).
  template <Element T, Device D>
  void accumulate(const Trace& t, const Tensor<T, D>& g) {
    if (!owns(t) || !g.defined()) return;
    // A backward rule must hand back a cotangent of its input's shape; anything else is a library bug,
    // caught here rather than silently broadcast.
    const Shape& want = shapes_[static_cast<std::size_t>(t.node)];
    TG_CHECK(g.shape() == want, "backward", "a cotangent of shape ", g.shape().str(), " reached a value of shape ", want.str(),
             "; please report this as a tapegrad bug");
    AnyFloatTensor& slot = cotangents_[static_cast<std::size_t>(t.node)];
    if (std::holds_alternative<std::monostate>(slot)) {
      slot = g.untraced();
    } else {
      auto* have = std::get_if<Tensor<T, D>>(&slot);
      TG_CHECK(have != nullptr, "backward", "cotangents of different dtypes or devices meet at one node");
      *have = add(*have, g);  // a tensor used twice: its cotangents add up
    }
  }

  /// The cotangent of `node`, or an undefined tensor when nothing has flowed into it.
  template <Element T, Device D>
  Tensor<T, D> cotangent(std::int64_t node) const {
    const AnyFloatTensor& slot = cotangents_[static_cast<std::size_t>(node)];
    if (const auto* g = std::get_if<Tensor<T, D>>(&slot)) return *g;
    return {};
  }

  std::shared_ptr<FusedProducer>& producer(std::int64_t node) { return producers_[static_cast<std::size_t>(node)]; }

  /// Runs every recorded backward rule, last op first.
  void backward() {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) (*it)(*this);
  }

 private:
  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> counter{0};
    return ++counter;
  }

  std::uint64_t id_;
  std::vector<Shape> shapes_;
  std::vector<AnyFloatTensor> cotangents_;
  std::vector<int> uses_;
  std::vector<std::shared_ptr<FusedProducer>> producers_;
  std::vector<Backward> entries_;
};

/// The tape being recorded on this thread (null outside value_and_grad and during the backward walk).
inline thread_local Tape* active_tape = nullptr;

/// Sets the active tape for a scope and restores the previous one after.
class ActiveTape {
 public:
  explicit ActiveTape(Tape* t) : previous_(active_tape) { active_tape = t; }
  ~ActiveTape() { active_tape = previous_; }
  ActiveTape(const ActiveTape&) = delete;
  ActiveTape& operator=(const ActiveTape&) = delete;

 private:
  Tape* previous_;
};

/// True when any of `xs` is traced on the tape being recorded: the one check untraced code pays.
template <class... Ts>
bool recording(const Ts&... xs) {
  const Tape* t = active_tape;
  return t != nullptr && (t->owns(xs.trace()) || ...);
}

/// Makes `out` a new node whose backward rule is fn(tape, dy), dy being out's cotangent (an undefined
/// tensor only when a fused consumer has delivered the gradient through the node's producer state).
template <Element T, Device D, class F>
void record(Tensor<T, D>& out, std::initializer_list<Trace> inputs, F fn) {
  Tape& tape = *active_tape;
  for (const Trace& in : inputs) tape.use(in);
  const std::int64_t node = tape.new_node(out.shape());
  out.set_trace({tape.id(), node});
  tape.push([node, fn = std::move(fn)](Tape& t) {
    const Tensor<T, D> dy = t.cotangent<T, D>(node);
    const auto& producer = t.producer(node);
    if (dy.defined() || (producer && producer->pending)) fn(t, dy);
  });
}

template <Element T, Device D>
void record_reshape(const Tensor<T, D>& from, Tensor<T, D>& to) {
  if constexpr (FloatElement<T>) {
    if (!recording(from)) return;
    record(to, {from.trace()}, [in = from.trace(), shape = from.shape()](Tape& t, const Tensor<T, D>& dy) {
      t.accumulate(in, dy.reshape(shape));
    });
  }
}

template <Element T, Device D, Device D2>
void record_transfer(const Tensor<T, D>& from, Tensor<T, D2>& to) {
  if constexpr (FloatElement<T>) {
    if (!recording(from)) return;
    record(to, {from.trace()}, [in = from.trace()](Tape& t, const Tensor<T, D2>& dy) {
      t.accumulate(in, dy.template to<D>());
    });
  }
}

}  // namespace detail
}  // namespace tg
