// The tape a traced Tensor records on: nodes, recording, and the backward walks. value_and_grad
// (autodiff/) creates a tape, marks the parameters' leaves as its first nodes, and walks it backward;
// each op records itself here with its backward rule beside its forward (ops/). The tape sits below
// Tensor and the ops: it holds cotangents type-erased, and what it needs from the ops (adding two
// cotangents of one value) it receives through AddCotangents, which the elementwise ops define.
//
// Higher order: a transformation nested in another (grad of grad, jvp, hessian) records on the tape it
// finds active and walks its own part of it with the tape still active, so the backward rules' ops are
// themselves recorded and an outer walk differentiates them. Each walk keeps its own cotangents.
#pragma once

#include <any>
#include <atomic>
#include <cstdint>
#include <deque>
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

class Tape;

/// One backward pass over a tape: the cotangents it has gathered, one slot per node that existed when it
/// began. `floor`: nodes below it are not wanted (values made before the transformation's inputs, whose
/// cotangents nothing reads); `records`: the pass runs with its tape active, so its rules' ops are
/// recorded (a nested transformation's pass, which an outer one differentiates).
class Walk {
 public:
  Walk(std::int64_t nodes, std::int64_t floor, bool records)
      : cotangents_(static_cast<std::size_t>(nodes)), floor_(floor), records_(records) {}

  bool wants(std::int64_t node) const { return node >= floor_ && node < static_cast<std::int64_t>(cotangents_.size()); }
  bool records() const { return records_; }

  /// The cotangent of `node`, or an undefined tensor when nothing has flowed into it.
  template <Element T, Device D>
  Tensor<T, D> cotangent(std::int64_t node) const {
    if (!wants(node)) return {};
    if (const auto* g = std::any_cast<Tensor<T, D>>(&cotangents_[static_cast<std::size_t>(node)])) return *g;
    return {};
  }

 private:
  friend class Tape;
  std::vector<std::any> cotangents_;
  std::int64_t floor_;
  bool records_;
};

/// A record of the ops applied to traced tensors, in order.
class Tape {
 public:
  using Backward = std::function<void(Tape&)>;

  Tape() : id_(next_id()) {}
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  std::uint64_t id() const { return id_; }
  /// `t` is a node of this tape (what an op checks to decide whether to record).
  bool holds(const Trace& t) const { return t.tape == id_; }
  /// `t` is a node of this tape that the running backward pass wants a cotangent for (what a backward
  /// rule checks before computing one); outside a pass, holds(t).
  bool owns(const Trace& t) const { return holds(t) && (walk_ == nullptr || walk_->wants(t.node)); }
  std::int64_t size() const { return static_cast<std::int64_t>(shapes_.size()); }
  /// The number of recorded backward rules: a transformation's part of the tape is a range of them.
  std::int64_t entries() const { return static_cast<std::int64_t>(entries_.size()); }
  /// The running backward pass records its rules' ops (a nested transformation's pass): rules then use
  /// their traced formulas rather than fused kernels.
  bool records() const { return walk_ != nullptr && walk_->records(); }

  /// A fresh node for a value of `shape`, with no cotangent yet.
  std::int64_t new_node(const Shape& shape) {
    shapes_.push_back(shape);
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

  /// Adds `g` to the cotangent of the traced tensor `t` in the running pass (nothing if the pass does
  /// not want `t`).
  template <Element T, Device D>
  void accumulate(const Trace& t, const Tensor<T, D>& g) {
    if (walk_ == nullptr || !owns(t) || !g.defined()) return;
    // A backward rule must hand back a cotangent of its input's shape; anything else is a library bug,
    // caught here rather than silently broadcast.
    const Shape& want = shapes_[static_cast<std::size_t>(t.node)];
    TG_CHECK(g.shape() == want, "backward", "a cotangent of shape ", g.shape().str(), " reached a value of shape ", want.str(),
             "; please report this as a tapegrad bug");
    std::any& slot = walk_->cotangents_[static_cast<std::size_t>(t.node)];
    if (!slot.has_value()) {
      slot = walk_->records() ? g : g.untraced();
      return;
    }
    auto* have = std::any_cast<Tensor<T, D>>(&slot);
    TG_CHECK(have != nullptr, "backward", "cotangents of different dtypes or devices meet at one node");
    *have = AddCotangents<T, D>{}(*have, g);
  }

  /// The cotangent of `node` in the running pass, or an undefined tensor when nothing has flowed into it.
  template <Element T, Device D>
  Tensor<T, D> cotangent(std::int64_t node) const {
    return walk_ ? walk_->cotangent<T, D>(node) : Tensor<T, D>{};
  }

  /// What an op leaves on its output's node for the op that consumes it, so that the two can fuse their
  /// backward passes (the fused linear layer keeps its pre-activation here, ops/matmul.hpp).
  std::any& state(std::int64_t node) { return states_[static_cast<std::size_t>(node)]; }

  /// Runs the backward rules of entries [first, last), last op first, gathering cotangents in `walk`
  /// (seeded by the caller with accumulate_in). Rules recorded meanwhile (a recording pass) are not run.
  void backward(Walk& walk, std::int64_t first, std::int64_t last);

  /// Seeds `walk` with the cotangent `g` of `t` (the output's, before the pass).
  template <Element T, Device D>
  void accumulate_in(Walk& walk, const Trace& t, const Tensor<T, D>& g) {
    Walk* outer = walk_;
    walk_ = &walk;
    accumulate(t, g);
    walk_ = outer;
  }

 private:
  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> counter{0};
    return ++counter;
  }

  std::uint64_t id_;
  std::vector<Shape> shapes_;
  std::vector<int> uses_;
  std::vector<std::any> states_;
  std::deque<Backward> entries_;  // a deque: a recording pass appends while a rule runs
  Walk* walk_ = nullptr;
};

/// The tape being recorded on this thread (null outside value_and_grad and during a first-order walk).
inline thread_local Tape* active_tape = nullptr;

/// How many differentiating transformations enclose the code running on this thread (grad counts one,
/// jvp two: it differentiates a backward pass). From two on, an op whose backward pass is a fused kernel
/// records its composition of primitive ops instead, whose rules are traced to any order.
inline thread_local int differentiation_depth = 0;

/// True where the ops run under two or more differentiating transformations (see differentiation_depth).
inline bool higher_order() { return differentiation_depth >= 2; }

/// Adds `levels` to differentiation_depth for a scope.
class DepthScope {
 public:
  explicit DepthScope(int levels) : levels_(levels) { differentiation_depth += levels_; }
  ~DepthScope() { differentiation_depth -= levels_; }
  DepthScope(const DepthScope&) = delete;
  DepthScope& operator=(const DepthScope&) = delete;

 private:
  int levels_;
};

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

/// Sets the active tape and the running pass for a backward walk, restoring both after.
inline void Tape::backward(Walk& walk, std::int64_t first, std::int64_t last) {
  Walk* outer_walk = walk_;
  walk_ = &walk;
  struct Restore {
    Tape& tape;
    Walk* walk;
    ~Restore() { tape.walk_ = walk; }
  } restore{*this, outer_walk};
  ActiveTape active(walk.records() ? this : nullptr);
  for (std::int64_t i = last - 1; i >= first; --i) {
    // A recording pass appends to entries_ while this rule runs: a deque keeps the reference valid.
    const Backward& fn = entries_[static_cast<std::size_t>(i)];
    fn(*this);
  }
}

/// True when any of `xs` is traced on the tape being recorded: the one check untraced code pays.
template <class... Ts>
bool recording(const Ts&... xs) {
  const Tape* t = active_tape;
  return t != nullptr && (t->holds(xs.trace()) || ...);
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

/// record() for a rule that needs the output as a traced value (its derivative reads y, as exp's and
/// softmax's do): fn(tape, dy, y).
template <Element T, Device D, class F>
void record_with_output(Tensor<T, D>& out, std::initializer_list<Trace> inputs, F fn) {
  record_node(out, inputs, [fn = std::move(fn), y0 = out.untraced()](Tape& t, std::int64_t node) {
    const Tensor<T, D> dy = t.cotangent<T, D>(node);
    if (!dy.defined()) return;
    Tensor<T, D> y = y0;
    y.set_trace({t.id(), node});
    fn(t, dy, y);
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
