// The hook tg::compile records a step through (compile/compile.hpp): while a Recorder is active on this
// thread, every buffer the step allocates is kept alive for the plan, so that replays find each tensor at
// the address it had when recorded (on the CPU a block the step freed serves its later allocations of the
// same size, as the eager allocator's would), and every CPU kernel is also appended to the plan as a closure over
// those addresses. On CUDA the kernels are captured by the stream instead (a CUDA Graph), and a second
// pass serves the recorded buffers back in allocation order while the stream is being captured.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/runtime/device.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/runtime/storage.hpp"

TG_BEGIN_NAMESPACE
namespace detail {

class Recorder {
 public:
  enum class Mode {
    record,  ///< allocate normally and keep every buffer; CPU kernels run and are appended
    serve,   ///< hand the kept CUDA buffers back in the order they were allocated (graph capture)
  };
  Mode mode = Mode::record;
  /// Append CPU kernels without running them (compile's second CPU plan, recorded over served buffers).
  bool dry = false;
  std::vector<std::shared_ptr<Storage<Cpu>>> cpu_buffers;  // in allocation order; a reused block again
  std::vector<std::shared_ptr<Storage<Cuda>>> cuda_buffers;
  /// The CPU blocks by size, each with how often it appears in cpu_buffers: a block that nothing else
  /// holds (its use count is that plus this entry's) is free again, and the next allocation of its size
  /// takes it (record mode).
  std::unordered_map<std::size_t, std::vector<std::pair<std::shared_ptr<Storage<Cpu>>, long>>> cpu_blocks;
  std::size_t served = 0;
  std::vector<std::function<void()>> cpu_kernels;
};

inline thread_local Recorder* active_recorder = nullptr;

/// Whether this thread is inside tg::compile's recording of a step.
inline bool compiling() { return active_recorder != nullptr; }

/// Makes this thread's allocations and CPU kernels go to `r` for the scope's lifetime.
class ActiveRecorder {
 public:
  explicit ActiveRecorder(Recorder& r) : previous_(active_recorder) { active_recorder = &r; }
  ~ActiveRecorder() { active_recorder = previous_; }
  ActiveRecorder(const ActiveRecorder&) = delete;
  ActiveRecorder& operator=(const ActiveRecorder&) = delete;

 private:
  Recorder* previous_;
};

/// A new block of `bytes` on D: from the allocator, or from the recording compile() is making.
template <Device D>
std::shared_ptr<Storage<D>> new_storage(std::size_t bytes) {
  Recorder* r = active_recorder;
  if (r == nullptr) return std::make_shared<Storage<D>>(bytes);
  auto& kept = [&]() -> auto& {
    if constexpr (std::is_same_v<D, Cpu>) return r->cpu_buffers;
    else return r->cuda_buffers;
  }();
  if (r->mode == Recorder::Mode::serve) {
    TG_CHECK(r->served < kept.size() && kept[r->served]->bytes() == bytes, "compile",
             "the step allocated differently on its second pass (allocation ", r->served, " of ", bytes,
             " bytes); a compiled step must do the same work every time it is called with the same shapes");
    return kept[r->served++];
  }
  if constexpr (std::is_same_v<D, Cpu>) {
    // A block the recording freed (only the recorder still holds it) is reused, as the eager allocator
    // would: the plan replays its kernels in the recorded order, so the block's earlier users have run by
    // then, and the plan's memory is what the step needs at its peak rather than all it ever allocated.
    auto& same_size = r->cpu_blocks[bytes];
    for (auto& [block, uses] : same_size) {
      if (block.use_count() == uses + 1) {
        ++uses;
        kept.push_back(block);
        return block;
      }
    }
    kept.push_back(std::make_shared<Storage<D>>(bytes));
    same_size.emplace_back(kept.back(), 1);
    return kept.back();
  } else {
    kept.push_back(std::make_shared<Storage<D>>(bytes));
    return kept.back();
  }
}

/// Runs a CPU kernel now and, while compile() records, also appends it to the plan it replays (a dry
/// recording only appends it).
template <class K>
void cpu_kernel(K&& kernel) {
  Recorder* r = active_recorder;
  if (r == nullptr || !r->dry) kernel();
  if (r != nullptr) r->cpu_kernels.emplace_back(std::forward<K>(kernel));
}

/// Throws when `what` (a host read, a transfer or a host-side random draw) happens inside a compiled step,
/// where its value would be frozen at recording.
inline void forbid_in_compiled_step(const char* op, const char* what) {
  TG_CHECK(!compiling(), op, what, " inside a compiled step (tg::compile): a compiled step must stay on the device and "
                         "cannot see host values, which would be frozen at recording; return the tensor as an output (metrics "
                         "stay on the device until logged) or pass host data in as an input");
}

}  // namespace detail
TG_END_NAMESPACE
