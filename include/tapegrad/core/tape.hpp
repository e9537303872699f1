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

#include <algorithm>
#include <any>
#include <climits>
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
  /// The first node the pass wants: its transformation's first node, which names the pass's level (see
  /// Level below).
  std::int64_t floor() const { return floor_; }

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

/// Thrown by an op that has no forward (JVP) rule when a forward-mode pass reaches it with a tangent:
/// tg::jvp then computes the JVP by transposing the VJP instead (autodiff/jvp.hpp), so the number is right
/// either way.
struct NoForwardRule {
  const char* op;
};

/// One forward-mode pass (a tg::jvp's): the tangent of each node of its tape from `floor` on, pushed
/// forward op by op by the ops' JVP rules as they run. An undefined tangent is zero.
class Forward {
 public:
  explicit Forward(std::int64_t floor) : floor_(floor) {}
  std::int64_t floor() const { return floor_; }

  template <Element T, Device D>
  Tensor<T, D> tangent(std::int64_t node) const {
    const std::size_t i = static_cast<std::size_t>(node - floor_);
    if (node < floor_ || i >= tangents_.size()) return {};
    if (const auto* g = std::any_cast<Tensor<T, D>>(&tangents_[i])) return *g;
    return {};
  }
  bool has(std::int64_t node) const {
    const std::size_t i = static_cast<std::size_t>(node - floor_);
    return node >= floor_ && i < tangents_.size() && tangents_[i].has_value();
  }
  template <Element T, Device D>
  void set(std::int64_t node, const Tensor<T, D>& g) {
    if (node < floor_ || !g.defined()) return;
    const std::size_t i = static_cast<std::size_t>(node - floor_);
    if (i >= tangents_.size()) tangents_.resize(i + 1);
    tangents_[i] = g;
  }

 private:
  std::int64_t floor_;
  std::vector<std::any> tangents_;
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
  /// The running pass's floor (its level's first node; see Level), -1 outside a pass.
  std::int64_t walk_floor() const { return walk_ ? walk_->floor() : -1; }

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

  void push(Backward fn) {
    if (keeps_entries()) entries_.push_back(std::move(fn));
  }

  // ---- forward mode ----
  // A tape made by a forward-mode tg::jvp is forward-only: its backward rules are kept only while a
  // reverse transformation nested in it will walk them (a pending level, below), so a JVP keeps no
  // intermediate values. Any other tape keeps every rule.
  void set_forward_only() { forward_only_ = true; }
  /// Whether a rule pushed now is kept: on a forward-only tape, while a reverse level is pending whose
  /// floor is below the cutoff (a forward rule's own ops are walked only by reverse levels outside its
  /// pass).
  bool keeps_entries() const {
    if (!forward_only_) return true;
    for (std::int64_t f : pending_)
      if (f < cutoff_) return true;
    return false;
  }
  void add_pending(std::int64_t floor) { pending_.push_back(floor); }
  void remove_pending(std::int64_t floor) {
    for (auto it = pending_.end(); it != pending_.begin();)
      if (*--it == floor) {
        pending_.erase(it);
        return;
      }
  }
  /// The forward passes running on this tape, outermost first; the ones an op's rule sees are the first
  /// visible_forwards() (a rule for pass i runs with passes i and inward hidden: its ops belong to the
  /// outer passes, which differentiate them).
  void add_forward(Forward* f) {
    forwards_.push_back(f);
    visible_ = forwards_.size();
  }
  void remove_forward() {
    forwards_.pop_back();
    visible_ = forwards_.size();
  }
  std::size_t visible_forwards() const { return visible_; }
  /// Hides the forward pass `f` and the ones inside it (while f's own rule runs); returns how many were
  /// visible, for show_forwards.
  std::size_t hide_forwards_from(const Forward* f) {
    const std::size_t old = visible_;
    for (std::size_t i = 0; i < visible_; ++i)
      if (forwards_[i] == f) {
        visible_ = i;
        break;
      }
    return old;
  }
  void show_forwards(std::size_t n) { visible_ = n; }
  bool forward_mode() const { return visible_ != 0; }
  Forward& forward(std::size_t i) { return *forwards_[i]; }

  /// Runs rule(i) for each visible forward pass i, with pass i and the ones inside it hidden, and with
  /// nothing recorded at all where no outer pass or pending reverse level needs the rule's ops.
  template <class Rule>
  void for_each_forward(Rule&& rule);

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
  bool forward_only_ = false;
  std::vector<std::int64_t> pending_;  // the floors of the reverse levels that will walk the tape
  std::int64_t cutoff_ = INT64_MAX;
  std::vector<Forward*> forwards_;
  std::size_t visible_ = 0;
};

/// The tape being recorded on this thread (null outside value_and_grad and during a first-order walk).
inline thread_local Tape* active_tape = nullptr;

/// How many differentiating transformations enclose the code running on this thread (grad counts one,
/// jvp two: it differentiates a backward pass). From two on, an op whose backward pass is a fused kernel
/// records its composition of primitive ops instead, whose rules are traced to any order.
inline thread_local int differentiation_depth = 0;

/// True where the ops run under two or more differentiating transformations (see differentiation_depth).
inline bool higher_order() { return differentiation_depth >= 2; }

/// True where a forward-mode pass (tg::jvp) sees the ops run on this thread: an op whose fused kernel has
/// no JVP rule runs its composition of primitives instead (as under higher order).
inline bool forward_mode();

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

/// A differentiation level: the tape a transformation records on and the first node it made, which is
/// also the floor of the backward pass it walks. Transformations nest as levels, innermost last. A custom
/// rule (autodiff/custom.hpp) belongs to the innermost level where it is called, as in JAX: that level's
/// pass applies the rule; the passes of outer levels differentiate what the rule's function computes.
struct Level {
  std::uint64_t tape = 0;
  std::int64_t floor = 0;
  Forward* forward = nullptr;  ///< a forward-mode level's tangents (null: a reverse level)
};

/// The levels enclosing the code running on this thread, innermost last.
inline thread_local std::vector<Level> levels;

/// The innermost level when it records on `tape` (a custom rule called there belongs to it), else none.
inline const Level* innermost_level(const Tape& tape) {
  return !levels.empty() && levels.back().tape == tape.id() ? &levels.back() : nullptr;
}

/// Pushes a level for a scope (a transformation's), or, with `pop_from`, hides the levels from that floor
/// inward (what a custom rule's own functions run under: they belong to the outer levels, as JAX runs them
/// on the outer levels' tracers). Restores the stack after.
class LevelScope {
 public:
  explicit LevelScope(Level level) : size_(levels.size()) { levels.push_back(level); }
  static LevelScope hiding_from(const Tape& tape, std::int64_t floor) {
    std::vector<Level> hidden;
    while (!levels.empty() && levels.back().tape == tape.id() && levels.back().floor >= floor) {
      hidden.push_back(levels.back());
      levels.pop_back();
    }
    return LevelScope(std::move(hidden));
  }
  ~LevelScope() {
    if (pushed_) {
      levels.resize(size_);
      return;
    }
    for (auto it = hidden_.rbegin(); it != hidden_.rend(); ++it) levels.push_back(*it);
  }
  LevelScope(LevelScope&& o) noexcept : size_(o.size_), pushed_(o.pushed_), hidden_(std::move(o.hidden_)) { o.pushed_ = false; o.hidden_.clear(); }
  LevelScope(const LevelScope&) = delete;
  LevelScope& operator=(const LevelScope&) = delete;
  LevelScope& operator=(LevelScope&&) = delete;

 private:
  explicit LevelScope(std::vector<Level> hidden) : size_(0), pushed_(false), hidden_(std::move(hidden)) {}
  std::size_t size_;
  bool pushed_ = true;
  std::vector<Level> hidden_;
};

/// A reverse level that will walk `tape` from `floor` on, pending for a scope (its rules must be kept on a
/// forward-only tape until its walk).
class PendingReverse {
 public:
  PendingReverse(Tape& tape, std::int64_t floor) : tape_(&tape), floor_(floor) { tape.add_pending(floor); }
  ~PendingReverse() { end(); }
  /// The walk begins: the rules it walks are all pushed.
  void end() {
    if (tape_) tape_->remove_pending(floor_);
    tape_ = nullptr;
  }
  PendingReverse(const PendingReverse&) = delete;
  PendingReverse& operator=(const PendingReverse&) = delete;

 private:
  Tape* tape_;
  std::int64_t floor_;
};

/// A forward pass registered on its tape for a scope.
class ForwardScope {
 public:
  ForwardScope(Tape& tape, Forward& f) : tape_(tape) { tape.add_forward(&f); }
  ~ForwardScope() { tape_.remove_forward(); }
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;

 private:
  Tape& tape_;
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

template <class Rule>
void Tape::for_each_forward(Rule&& rule) {
  const std::size_t visible = visible_;
  const std::int64_t cutoff = cutoff_;
  struct Restore {
    Tape& tape;
    std::size_t visible;
    std::int64_t cutoff;
    ~Restore() {
      tape.visible_ = visible;
      tape.cutoff_ = cutoff;
    }
  } restore{*this, visible, cutoff};
  for (std::size_t i = 0; i < visible; ++i) {
    visible_ = i;
    cutoff_ = std::min(cutoff, forwards_[i]->floor());
    ActiveTape active(i > 0 || keeps_entries() ? this : nullptr);  // the rule's ops as plain ops where nothing differentiates them
    rule(*forwards_[i]);
  }
}

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

inline bool forward_mode() { return active_tape != nullptr && active_tape->forward_mode(); }

/// True when any of `xs` is traced on the tape being recorded: the one check untraced code pays.
template <class... Ts>
bool recording(const Ts&... xs) {
  const Tape* t = active_tape;
  return t != nullptr && (t->holds(xs.trace()) || ...);
}

/// The tangents a forward rule reads: tangent(x) is x's in the pass the rule runs for (undefined: zero).
struct Tangents {
  const Forward& pass;
  template <Element T, Device D>
  Tensor<T, D> operator()(const Tensor<T, D>& x) const {
    return pass.tangent<T, D>(x.trace().node);
  }
  bool any(std::initializer_list<Trace> xs) const {
    for (const Trace& t : xs)
      if (pass.has(t.node)) return true;
    return false;
  }
};

/// No forward rule: an op recorded without one throws NoForwardRule where a forward pass reaches it with a
/// tangent (tg::jvp then transposes the VJP instead).
struct NoRule {};

/// Gives `out` (node `node`) its tangent in each forward pass running on the tape: forward(tangents), the
/// op's JVP rule, which returns out's tangent (undefined for zero) from its inputs' tangents.
template <Element T, Device D, class Fwd>
void push_tangents(Tape& tape, std::int64_t node, const Tensor<T, D>& out, std::initializer_list<Trace> inputs, const Fwd& forward,
                   const char* op) {
  tape.for_each_forward([&](Forward& pass) {
    const Tangents tangents{pass};
    if constexpr (std::is_same_v<Fwd, NoRule>) {
      if (tangents.any(inputs)) throw NoForwardRule{op};
    } else {
      const Tensor<T, D> t = forward(tangents);
      if (!t.defined()) return;
      TG_CHECK(t.physical_shape() == out.physical_shape(), op, "a forward rule gave a tangent of shape ", t.physical_shape().str(),
               " for a value of shape ", out.physical_shape().str(), "; please report this as a tapegrad bug");
      pass.set(node, t);
    }
  });
}

/// Makes `out` a new node of the active tape and returns it; `fn(tape, node)` runs in the backward walk
/// whether or not a cotangent reached the node (an op fused with its consumer finds its gradient in its
/// node's state instead). Most ops use record(). `forward` is the op's JVP rule (NoRule: none).
template <class Out, class F, class Fwd = NoRule>
std::int64_t record_node(Out& out, std::initializer_list<Trace> inputs, F fn, const Fwd& forward = {}, const char* op = "an op") {
  Tape& tape = *active_tape;
  for (const Trace& in : inputs) tape.use(in);
  const std::int64_t node = tape.new_node(out.shape());
  out.set_trace({tape.id(), node});
  if (tape.keeps_entries()) tape.push([node, fn = std::move(fn)](Tape& t) { fn(t, node); });
  if (tape.forward_mode()) push_tangents(tape, node, out, inputs, forward, op);
  return node;
}

/// Makes `out` a new node whose backward rule is fn(tape, dy), dy being out's cotangent; it runs only
/// when a cotangent reached the node. `forward(tangents)` is its JVP rule: out's tangent from its inputs'
/// (tangents(x), undefined for zero), computed with ops (they are recorded, and differentiated, by the
/// transformations outside the forward pass).
template <Element T, Device D, class F, class Fwd = NoRule>
void record(Tensor<T, D>& out, std::initializer_list<Trace> inputs, F fn, const Fwd& forward = {}, const char* op = "an op") {
  record_node(out, inputs, [fn = std::move(fn)](Tape& t, std::int64_t node) {
    const Tensor<T, D> dy = t.cotangent<T, D>(node);
    if (dy.defined()) fn(t, dy);
  }, forward, op);
}

/// record() for a rule that needs the output as a traced value (its derivative reads y, as exp's and
/// softmax's do): fn(tape, dy, y).
template <Element T, Device D, class F, class Fwd = NoRule>
void record_with_output(Tensor<T, D>& out, std::initializer_list<Trace> inputs, F fn, const Fwd& forward = {}, const char* op = "an op") {
  record_node(out, inputs, [fn = std::move(fn), y0 = out.untraced()](Tape& t, std::int64_t node) {
    const Tensor<T, D> dy = t.cotangent<T, D>(node);
    if (!dy.defined()) return;
    Tensor<T, D> y = y0;
    y.set_trace({t.id(), node});
    fn(t, dy, y);
  }, forward, op);
}

/// The tangent of `to` is the tangent of `from` (an identity: a transformation's leaf linked to its outer
/// node).
template <Element T, Device D>
void forward_identity(Tape& tape, const Trace& from, std::int64_t to) {
  if (!tape.forward_mode()) return;
  for (std::size_t i = 0; i < tape.visible_forwards(); ++i) tape.forward(i).set(to, tape.forward(i).tangent<T, D>(from.node));
}

/// The recording of the view and transfer ops that live on Tensor itself.
template <Element T, Device D>
void record_reshape(const Tensor<T, D>& from, Tensor<T, D>& to) {
  if constexpr (FloatElement<T>) {
    if (!recording(from)) return;
    record(to, {from.trace()}, [in = from.trace(), shape = from.shape()](Tape& t, const Tensor<T, D>& dy) {
      t.accumulate(in, dy.reshape(shape));
    }, [&](const Tangents& tangent) {
      const Tensor<T, D> tx = tangent(from);
      return tx.defined() ? tx.reshape(to.shape()) : tx;
    }, "reshape");
  }
}

template <Element T, Device D, Device D2>
void record_transfer(const Tensor<T, D>& from, Tensor<T, D2>& to) {
  if constexpr (FloatElement<T>) {
    if (!recording(from)) return;
    record(to, {from.trace()}, [in = from.trace()](Tape& t, const Tensor<T, D2>& dy) {
      t.accumulate(in, dy.template to<D>());
    }, [&](const Tangents& tangent) {
      const Tensor<T, D> tx = tangent(from);
      return tx.defined() ? tx.template to<D2>() : Tensor<T, D2>{};
    }, "to");
  }
}

}  // namespace detail
TG_END_NAMESPACE
