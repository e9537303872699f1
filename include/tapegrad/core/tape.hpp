// The tape a traced Tensor records on: nodes, recording, and the backward walk. value_and_grad
// (autodiff/) creates a tape, marks the parameters' leaves as its first nodes, and walks it backward;
// each op records itself here with its backward rule beside its forward (ops/). The tape sits below
// Tensor and the ops: it holds cotangents type-erased, and what it needs from the ops (adding two
// cotangents of one value) it receives through AddCotangents, which the elementwise ops define.
#pragma once

#include <any>
#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/runtime/device.hpp"
#include "tapegrad/base/dtype.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/base/shape.hpp"

TG_BEGIN_NAMESPACE

template <Element T, Device D>
class Tensor;  // core/tensor.hpp

namespace detail {

/// Which tape, and which node on it, a traced tensor is. Untraced: tape == 0.
struct Trace {
  std::uint64_t tape = 0;
  std::int64_t node = -1;
};

/// How two cotangents of one value add up (a tensor used twice): declared here, defined with the
/// elementwise ops (ops/elementwise.hpp) as their add. The tape names no op of a higher layer.
template <Element T, Device D>
struct AddCotangents;

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
    states_.emplace_back();
    return size() - 1;
  }

  /// Counts one more consumer of a traced input (an op can fuse its backward pass with its input's
  /// producer only when it is that value's single consumer).
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
    std::any& slot = cotangents_[static_cast<std::size_t>(t.node)];
    if (!slot.has_value()) {
      slot = g.untraced();
      return;
    }
    auto* have = std::any_cast<Tensor<T, D>>(&slot);
    TG_CHECK(have != nullptr, "backward", "cotangents of different dtypes or devices meet at one node");
    *have = AddCotangents<T, D>{}(*have, g);
  }

  /// The cotangent of `node`, or an undefined tensor when nothing has flowed into it.
  template <Element T, Device D>
  Tensor<T, D> cotangent(std::int64_t node) const {
    if (const auto* g = std::any_cast<Tensor<T, D>>(&cotangents_[static_cast<std::size_t>(node)])) return *g;
    return {};
  }

  /// What an op leaves on its output's node for the op that consumes it, so that the two can fuse their
  /// backward passes (the fused linear layer keeps its pre-activation here, ops/matmul.hpp).
  std::any& state(std::int64_t node) { return states_[static_cast<std::size_t>(node)]; }

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
  std::vector<std::any> cotangents_;
  std::vector<int> uses_;
  std::vector<std::any> states_;
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

/// Makes `out` a new node of the active tape and returns it; `fn(tape, node)` runs in the backward walk
/// whether or not a cotangent reached the node (an op fused with its consumer finds its gradient in its
/// node's state instead). Most ops use record().
template <class Out, class F>
std::int64_t record_node(Out& out, std::initializer_list<Trace> inputs, F fn) {
  Tape& tape = *active_tape;
  for (const Trace& in : inputs) tape.use(in);
  const std::int64_t node = tape.new_node(out.shape());
  out.set_trace({tape.id(), node});
  tape.push([node, fn = std::move(fn)](Tape& t) { fn(t, node); });
  return node;
}

/// Makes `out` a new node whose backward rule is fn(tape, dy), dy being out's cotangent; it runs only
/// when a cotangent reached the node.
template <Element T, Device D, class F>
void record(Tensor<T, D>& out, std::initializer_list<Trace> inputs, F fn) {
  record_node(out, inputs, [fn = std::move(fn)](Tape& t, std::int64_t node) {
    const Tensor<T, D> dy = t.cotangent<T, D>(node);
    if (dy.defined()) fn(t, dy);
  });
}

/// The recording of the view and transfer ops that live on Tensor itself.
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
TG_END_NAMESPACE
