// Device graphs: the work queued on the library's CUDA stream, captured once and replayed with one launch
// (a CUDA Graph), behind two small RAII types that tg::compile uses without naming CUDA. Their layout is
// the same with and without TG_WITH_CUDA (the executable graph is held type-erased); without the CUDA
// backend, starting a capture raises cuda::not_compiled_in.
#pragma once

#include <cstddef>
#include <memory>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/runtime/device.hpp"

#if defined(TG_WITH_CUDA)
#include "tapegrad/runtime/cuda/check.hpp"
#include "tapegrad/runtime/cuda/context.hpp"
#endif

TG_BEGIN_NAMESPACE
namespace cuda {

/// A captured, instantiated graph: replayed by launch() on the library's stream. Empty by default.
class Graph {
 public:
  Graph() = default;

  explicit operator bool() const { return exec_ != nullptr; }
  /// Kernels and copies in the graph (what one replay runs).
  std::size_t nodes() const { return nodes_; }

  /// Queues one replay on the library's stream.
  void launch() const {
    TG_CHECK(exec_ != nullptr, "cuda::Graph::launch", "the graph is empty (nothing was captured)");
#if defined(TG_WITH_CUDA)
    TG_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_.get()), stream()));
#endif
  }

 private:
  friend class GraphCapture;
  std::shared_ptr<void> exec_;  // a cudaGraphExec_t, destroyed by the deleter it was made with
  std::size_t nodes_ = 0;
};

/// Captures the work queued on the library's stream by this thread from construction until finish(),
/// which instantiates it as a Graph. Destroyed before finish() (an exception while capturing), it ends
/// the capture and drops what was captured, leaving the stream usable.
class GraphCapture {
 public:
  GraphCapture() {
    require_device("cuda::GraphCapture");
#if defined(TG_WITH_CUDA)
    stream_ = stream();
    TG_CUDA_CHECK(cudaStreamBeginCapture(static_cast<cudaStream_t>(stream_), cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
#endif
  }
  ~GraphCapture() {
#if defined(TG_WITH_CUDA)
    if (!capturing_) return;
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(static_cast<cudaStream_t>(stream_), &graph) == cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
#endif
  }
  GraphCapture(const GraphCapture&) = delete;
  GraphCapture& operator=(const GraphCapture&) = delete;

  /// Ends the capture and instantiates what was captured.
  Graph finish() {
    Graph g;
#if defined(TG_WITH_CUDA)
    TG_CHECK(capturing_, "cuda::GraphCapture::finish", "the capture has already finished");
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    TG_CUDA_CHECK(cudaStreamEndCapture(static_cast<cudaStream_t>(stream_), &graph));
    std::size_t nodes = 0;
    if (cudaGraphGetNodes(graph, nullptr, &nodes) == cudaSuccess) g.nodes_ = nodes;
    cudaGraphExec_t exec = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    TG_CUDA_CHECK(instantiated);
    g.exec_ = std::shared_ptr<void>(exec, [](void* e) { (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(e)); });
#endif
    return g;
  }

 private:
  void* stream_ = nullptr;  // the cudaStream_t being captured
  bool capturing_ = false;
};

}  // namespace cuda
TG_END_NAMESPACE
