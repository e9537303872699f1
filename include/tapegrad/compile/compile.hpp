// tg::compile(step): the jit of this library. The first call at a shape signature runs the step eagerly
// and records it; later calls replay the recording: on the CPU a plan of kernels over preallocated
// buffers (no tape, no allocation), on CUDA one CUDA Graph launch. Results equal the eager step's
// (bitwise on the CPU). A new shape signature records again, as JAX recompiles.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/runtime/dispatch.hpp"
#include "tapegrad/runtime/graph.hpp"
#include "tapegrad/runtime/recorder.hpp"
#include "tapegrad/tree/pytree.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

/// A recorded step for one shape signature: the buffers its kernels were recorded with, which of them
/// the inputs are copied into and which hold the outputs, and the work to replay.
template <Device D>
struct Plan {
  struct Leaf {
    std::size_t buffer = 0;
    Shape shape;
    DType dtype = DType::f32;
  };
  std::vector<std::shared_ptr<Storage<D>>> buffers;
  std::vector<Leaf> inputs, outputs;          // tensor leaves, in tree order
  std::vector<std::function<void()>> kernels;  // the CPU plan
  /// CPU donation without copies: a second plan, the twin, that reads the first plan's donated outputs
  /// and writes the next ones where the first plan's donated inputs were. Calls alternate between the two
  /// (ping-pong), so each call's outputs are already the next call's input buffers.
  struct Twin {
    std::vector<Leaf> inputs, outputs;
    std::vector<std::function<void()>> kernels;
    std::size_t probe = 0;  // an input leaf that is donated: the argument there tells which plan runs
  };
  std::optional<Twin> twin;
  /// The CUDA plan: one graph, replayed with one launch (runtime/graph.hpp).
  cuda::Graph graph;
  std::unordered_map<const Storage<D>*, std::size_t> index;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  std::size_t add(const std::shared_ptr<Storage<D>>& s) {
    const auto [it, added] = index.emplace(s.get(), buffers.size());
    if (added) buffers.push_back(s);
    return it->second;
  }

  /// Before the plan writes buffer `i`: if anyone else (a tensor the caller kept) still views it, that
  /// tensor gets a copy of the current contents and the plan keeps the recorded address.
  void make_exclusive(std::size_t i) {
    std::shared_ptr<Storage<D>>& buf = buffers[i];
    if (buf.use_count() == 1) return;
    auto fresh = std::make_shared<Storage<D>>(buf->bytes());
    copy_bytes<D, D>(fresh->data(), buf->data(), buf->bytes());
    swap_blocks(*buf, *fresh);
    index.erase(buf.get());
    index.emplace(fresh.get(), i);
    buf = std::move(fresh);
  }
};

struct PlanBase {
  virtual ~PlanBase() = default;
  /// The work one replay runs: the CPU plan's kernels, or the CUDA graph's nodes.
  virtual std::size_t kernels() const = 0;
  /// The bytes of the buffers it holds: inputs, outputs and the step's temporaries.
  virtual std::size_t bytes() const = 0;
};

template <Device D, class Out>
struct PlanFor : PlanBase {
  std::size_t kernels() const override { return std::is_same_v<D, Cpu> ? plan.kernels.size() : plan.graph.nodes(); }
  std::size_t bytes() const override {
    std::size_t n = 0;
    for (const auto& b : plan.buffers) n += b->bytes();
    return n;
  }
  Plan<D> plan;
  Out prototype;  // the output tree with its tensor leaves undefined; filled from the buffers per call
};

template <class Tuple>
std::string signature(Tuple& args) {
  std::string key = typeid(Tuple).name();
  std::apply([&](auto&... a) {
    (tree_for_each([&](const std::string& path, const auto& leaf) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      if constexpr (std::is_same_v<L, bool>) {
        key += leaf ? "|T" : "|F";
      } else {
        TG_CHECK(leaf.batch_levels() == 0, "compile", "argument ", path.empty() ? std::string("value") : path,
                 " is batched by an enclosing tg::vmap: a compiled function cannot run inside vmap; put the vmap inside it "
                 "(tg::compile(tg::vmap(f))), which records the batched ops as one plan");
        key += '|';
        key += leaf.shape().str();
        key += leaf.defined() ? "" : "undef";
      }
    }, a), ...);
  }, args);
  return key;
}


template <Device D, class Leaf>
void require_device_of(const std::string& path, const Leaf& leaf, const char* what) {
  using L = std::remove_cvref_t<Leaf>;
  if constexpr (!std::is_same_v<typename L::device_type, D>) {
    fail("compile", what, " '", path, "' is on ", L::device_type::name, " but the step runs on ", D::name,
         "; a compiled step runs on one device: move it with tg::device_put first");
  }
  TG_CHECK(leaf.defined(), "compile", what, " '", path, "' is an undefined tensor");
}

}  // namespace detail

/// A step function made into a compiled one (see tg::compile).
template <class F>
class Compiled {
 public:
  explicit Compiled(F f) : f_(std::move(f)) {}

  /// Runs the step: records it at a new shape signature, replays the recording otherwise.
  /// Arguments passed as rvalues (std::move(params)) are donated: their buffers are reused in place
  /// with no copy. Arguments passed as lvalues are left as they were, at the cost of a copy.
  template <class... Args>
  auto operator()(Args&&... args) {
    using Held = std::tuple<std::remove_cvref_t<Args>...>;
    using Out = std::remove_cvref_t<std::invoke_result_t<F&, const std::remove_cvref_t<Args>&...>>;
    using D = tree_device_t<Held>;
    Held held(std::forward<Args>(args)...);
    const std::string key = detail::signature(held);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      auto entry = std::make_unique<detail::PlanFor<D, Out>>();
      Out out = record<D, Out>(*entry, std::move(held));
      last_ = entry.get();
      plans_.emplace(key, std::move(entry));
      return out;
    }
    last_ = it->second.get();
    return replay<D, Out>(static_cast<detail::PlanFor<D, Out>&>(*it->second), std::move(held));
  }

  /// How many shape signatures have been recorded (jax's jitted._cache_size()).
  std::size_t recordings() const { return plans_.size(); }
  /// How much work one replay of the most recent recording runs: its CPU kernels, or on CUDA the nodes
  /// (kernels and copies) of its graph. 0 before the first call.
  std::size_t kernels() const { return last_ ? last_->kernels() : 0; }
  /// The memory the most recent recording holds, in bytes (0 before the first call). On the CPU a
  /// temporary's block serves the step's later temporaries of its size once it is free, so this is about
  /// the step's peak, not the sum of all it allocates.
  std::size_t memory_bytes() const { return last_ ? last_->bytes() : 0; }
  /// Drops every recording and the buffers they hold.
  void clear() {
    plans_.clear();
    last_ = nullptr;
  }

 private:
  template <class D, class Out, class Held>
  Out record(detail::PlanFor<D, Out>& entry, Held held) {
    detail::Plan<D>& plan = entry.plan;
    // The inputs live in buffers of the plan's own, copied from the first call's arguments.
    Held statics = held;
    tree_for_each_tensor([&](std::size_t, const std::string& path, auto& leaf) {
      detail::require_device_of<D>(path, leaf, "input");
      using L = std::remove_cvref_t<decltype(leaf)>;
      auto buf = std::make_shared<Storage<D>>(leaf.nbytes());
      detail::copy_bytes<D, D>(buf->data(), leaf.data(), leaf.nbytes());
      leaf = L(buf, leaf.shape());
      plan.inputs.push_back({plan.add(buf), leaf.shape(), L::dtype()});
    }, statics);
    held = Held{};

    detail::Recorder recorder;
    std::vector<std::pair<std::size_t, std::size_t>> copy_back;  // (output leaf, input leaf)
    std::optional<Out> out;
    constexpr bool cpu = std::is_same_v<D, Cpu>;
    {
      detail::ActiveRecorder active(recorder);
      out.emplace(std::apply(f_, std::as_const(statics)));
      copy_back = donate(plan, *out, /*copy=*/!cpu);  // the CPU ping-pongs instead (below), if it can
    }
    if constexpr (cpu) {
      for (const auto& b : recorder.cpu_buffers) plan.add(b);
    } else {
      for (const auto& b : recorder.cuda_buffers) plan.add(b);
    }
    plan.kernels = std::move(recorder.cpu_kernels);
    if constexpr (!cpu) capture(plan, recorder, statics, *out, copy_back);
    if constexpr (cpu) {
      if (!copy_back.empty() && !record_twin(plan, recorder, statics, *out, copy_back)) {
        // No twin (the step allocated differently a second time): copy the donated outputs back instead.
        // Run now as well: this first call returns the outputs from the donated buffers.
        for (const auto& [o, j] : copy_back) {
          void* dst = plan.buffers[plan.inputs[j].buffer]->data();
          const Storage<D>* src = output_storage(*out, o).get();
          auto copy = [dst, src] { detail::copy_bytes<Cpu, Cpu>(dst, src->data(), src->bytes()); };
          copy();
          plan.kernels.push_back(copy);
        }
      } else {
        copy_back.clear();  // the outputs stay where they were computed
      }
    }

    // Outputs: buffers of the plan (an output the step did not compute, a constant, is kept too).
    entry.prototype = *out;
    tree_for_each_tensor([&](std::size_t k, const std::string& path, auto& leaf, auto& proto) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      detail::require_device_of<D>(path, leaf, "output");
      const auto it = std::find_if(copy_back.begin(), copy_back.end(), [&](const auto& c) { return c.first == k; });
      const std::size_t buffer = it != copy_back.end() ? plan.inputs[it->second].buffer : plan.add(leaf.storage());
      plan.outputs.push_back({buffer, leaf.shape(), L::dtype()});
      leaf = L(plan.buffers[buffer], leaf.shape());
      proto = L{};
    }, *out, entry.prototype);
    return std::move(*out);
  }

  template <class Tree>
  static std::shared_ptr<Storage<Cpu>> output_storage(const Tree& tree, std::size_t index) {
    std::shared_ptr<Storage<Cpu>> found;
    tree_for_each_tensor([&](std::size_t k, const std::string&, const auto& leaf) {
      if constexpr (std::is_same_v<typename std::remove_cvref_t<decltype(leaf)>::device_type, Cpu>)
        if (k == index) found = leaf.storage();
    }, tree);
    return found;
  }

  /// CPU: records the twin plan without running it (a dry recording). Its inputs are the first plan's
  /// inputs with each donated one replaced by the output it was donated to; it is served the first
  /// plan's buffers in allocation order, except that each donated output is allocated where its input
  /// was. The two plans then share every buffer and alternate. Returns false (and leaves no twin) when the
  /// second recording did not allocate and return exactly as the first.
  template <class Held, class Out>
  bool record_twin(detail::Plan<Cpu>& plan, const detail::Recorder& first, const Held& statics, const Out& out,
                   const std::vector<std::pair<std::size_t, std::size_t>>& pairs) {
    detail::Recorder recorder;
    recorder.mode = detail::Recorder::Mode::serve;
    recorder.dry = true;
    recorder.cpu_buffers = first.cpu_buffers;
    Held inputs = statics;
    for (const auto& [o, j] : pairs) {
      // The twin is the first plan with the donated output's block and its input's block swapped: every
      // allocation of the output's block (it may have held temporaries before the output, the block
      // reused) goes to the input's, which the first plan only read.
      const auto computed = output_storage(out, o);
      bool found = false;
      for (auto& b : recorder.cpu_buffers)
        if (b == computed) b = plan.buffers[plan.inputs[j].buffer], found = true;
      if (!found) return false;
      const std::size_t input = j;  // clang 14 cannot capture a structured binding
      tree_for_each_tensor([&](std::size_t k, const std::string&, auto& leaf) {
        using L = std::remove_cvref_t<decltype(leaf)>;
        if (k == input) leaf = L(computed, leaf.shape());
      }, inputs);
    }
    std::optional<Out> again;
    try {
      detail::ActiveRecorder active(recorder);
      again.emplace(std::apply(f_, std::as_const(inputs)));
    } catch (const Error&) {
      return false;  // allocated differently: new_storage refused to serve
    }
    if (recorder.served != recorder.cpu_buffers.size()) return false;
    // Each output must be where the first plan's is, except the donated ones, which must be in their inputs.
    bool same = true;
    tree_for_each_tensor([&](std::size_t k, const std::string&, const auto& a, const auto& b) {
      const auto it = std::find_if(pairs.begin(), pairs.end(), [&](const auto& c) { return c.first == k; });
      const auto expected = it != pairs.end() ? plan.buffers[plan.inputs[it->second].buffer] : a.storage();
      same = same && b.storage() == expected;
    }, out, *again);
    if (!same) return false;
    typename detail::Plan<Cpu>::Twin twin;
    tree_for_each_tensor([&](std::size_t, const std::string&, const auto& leaf) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      twin.inputs.push_back({plan.add(leaf.storage()), leaf.shape(), L::dtype()});
    }, inputs);
    tree_for_each_tensor([&](std::size_t, const std::string&, const auto& leaf) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      twin.outputs.push_back({plan.add(leaf.storage()), leaf.shape(), L::dtype()});
    }, *again);
    twin.kernels = std::move(recorder.cpu_kernels);
    twin.probe = pairs.front().second;
    plan.twin = std::move(twin);
    return true;
  }

  /// Donation: each output the step computed takes the buffer of the first unused input of the same
  /// dtype and shape (new parameters take the old parameters' buffers); with `copy`, the step ends by
  /// copying it there (CUDA; the CPU alternates with a twin plan instead). Returns the (output leaf, input
  /// leaf) pairs.
  template <class D, class Out>
  std::vector<std::pair<std::size_t, std::size_t>> donate(detail::Plan<D>& plan, const Out& out, bool copy) {
    std::vector<bool> taken(plan.inputs.size(), false);
    tree_for_each_tensor([&](std::size_t, const std::string&, const auto& leaf) {  // inputs returned as they are stay theirs
      for (std::size_t j = 0; j < plan.inputs.size(); ++j)
        if (leaf.storage() == plan.buffers[plan.inputs[j].buffer]) taken[j] = true;
    }, out);
    std::vector<std::pair<std::size_t, std::size_t>> pairs;
    tree_for_each_tensor([&](std::size_t k, const std::string&, const auto& leaf) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      if (!leaf.defined() || plan.index.count(leaf.storage().get()) != 0) return;
      for (std::size_t j = 0; j < plan.inputs.size(); ++j) {
        const auto& in = plan.inputs[j];
        if (taken[j] || in.dtype != L::dtype() || in.shape != leaf.shape()) continue;
        if (copy) detail::recorded_copy<D>(plan.buffers[in.buffer]->data(), leaf.data(), leaf.nbytes());
        taken[j] = true;
        pairs.emplace_back(k, j);
        break;
      }
    }, out);
    return pairs;
  }

  /// CUDA: the eager pass has run and kept its buffers; capture the step again on the library's stream,
  /// served the same buffers in the same order, into one graph.
  template <class D, class Held, class Out>
  void capture(detail::Plan<D>& plan, detail::Recorder& recorder, const Held& statics, const Out& out,
               const std::vector<std::pair<std::size_t, std::size_t>>& copy_back) {
    recorder.mode = detail::Recorder::Mode::serve;
    recorder.served = 0;
    cuda::GraphCapture capture;  // ends the capture and drops it if the step throws
    {
      detail::ActiveRecorder active(recorder);
      const Out again = std::apply(f_, statics);
      std::vector<const void*> first, second;
      tree_for_each_tensor([&](std::size_t, const std::string&, const auto& a, const auto& b) {
        first.push_back(a.data()), second.push_back(b.data());
      }, out, again);
      TG_CHECK(first == second, "compile", "the step's outputs moved between its recording and capture passes; a compiled "
               "step must do the same work every time it is called with the same shapes");
      tree_for_each_tensor([&](std::size_t k, const std::string&, const auto& leaf) {
        for (const auto& [o, j] : copy_back)
          if (o == k) detail::recorded_copy<D>(plan.buffers[plan.inputs[j].buffer]->data(), leaf.data(), leaf.nbytes());
      }, again);
      TG_CHECK(recorder.served == recorder.cuda_buffers.size(), "compile", "the step allocated ", recorder.served,
               " buffers on its capture pass but ", recorder.cuda_buffers.size(), " when recorded; a compiled step must do "
               "the same work every time it is called with the same shapes");
    }
    plan.graph = capture.finish();
  }

  template <class D, class Out, class Held>
  Out replay(detail::PlanFor<D, Out>& entry, Held held) {
    detail::Plan<D>& plan = entry.plan;
    // On the CPU with donation, the twin runs when the arguments are the first plan's outputs.
    bool use_twin = false;
    if (plan.twin) {
      tree_for_each_tensor([&](std::size_t k, const std::string&, const auto& leaf) {
        if (k == plan.twin->probe) use_twin = leaf.storage() == plan.buffers[plan.twin->inputs[plan.twin->probe].buffer];
      }, held);
    }
    const auto& inputs = use_twin ? plan.twin->inputs : plan.inputs;
    const auto& outputs = use_twin ? plan.twin->outputs : plan.outputs;
    // Arguments not already in their input buffers are copied in (a donated argument returned by the
    // previous call is already there).
    tree_for_each_tensor([&](std::size_t k, const std::string& path, const auto& leaf) {
      detail::require_device_of<D>(path, leaf, "input");
      const std::size_t i = inputs[k].buffer;
      if (leaf.storage() == plan.buffers[i]) return;
      plan.make_exclusive(i);
      detail::copy_bytes<D, D>(plan.buffers[i]->data(), leaf.data(), leaf.nbytes());
    }, held);
    held = Held{};
    // Whatever the caller still holds of the buffers the step writes gets a copy first.
    for (const auto& in : inputs) plan.make_exclusive(in.buffer);
    for (const auto& o : outputs) plan.make_exclusive(o.buffer);
    if constexpr (std::is_same_v<D, Cpu>) {
      for (const auto& kernel : use_twin ? plan.twin->kernels : plan.kernels) kernel();
    } else {
      plan.graph.launch();
    }
    Out out = entry.prototype;
    tree_for_each_tensor([&](std::size_t k, const std::string&, auto& leaf) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      leaf = L(plan.buffers[outputs[k].buffer], outputs[k].shape);
    }, out);
    return out;
  }

  F f_;
  std::map<std::string, std::unique_ptr<detail::PlanBase>> plans_;
  const detail::PlanBase* last_ = nullptr;
};

/// The jit of this library: `auto step = tg::compile(train_step);`. The step must be a function of its
/// arguments (pytrees of tensors on one device) that stays on the device: host reads (item, to_vector),
/// transfers and host-side random draws inside it are errors, and values it captures are frozen when it
/// is recorded. Pass parameters and optimizer state with std::move to donate them (updated in place).
template <class F>
Compiled<std::decay_t<F>> compile(F&& step) {
  return Compiled<std::decay_t<F>>(std::forward<F>(step));
}

TG_END_NAMESPACE
