// Data parallelism on the transports the field trusts: MPI between processes and machines (CPU tensors,
// and to bootstrap NCCL), NCCL between GPUs (CUDA tensors). Pytree collectives pack every leaf of a dtype
// into one buffer, run one collective, and unpack. Needs tapegrad::dist (MPI; with CUDA also NCCL).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"
#include "tapegrad/runtime/recorder.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/tree/pytree.hpp"

#if defined(TG_WITH_CUDA)
#include <nccl.h>
#endif

TG_BEGIN_NAMESPACE
namespace dist {

namespace detail {

inline void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int n = 0;
  MPI_Error_string(rc, text, &n);
  ::tg::detail::fail("dist", call, " failed: ", std::string(text, static_cast<std::size_t>(n)));
}

#if defined(TG_WITH_CUDA)
inline void check_nccl(ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess) ::tg::detail::fail("dist", call, " failed: ", ncclGetErrorString(rc), " (", ncclGetLastError(nullptr), ")");
}
#endif

/// The element type a leaf is reduced in: f32 for f32 and bf16 (no MPI bf16 type; bf16 converts exactly
/// to f32 and rounds back once), f64 for f64.
template <class T> using reduce_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

}  // namespace detail

/// A communicator: MPI_COMM_WORLD's processes (ranks), each with its rank, the number of ranks, and its
/// rank among the processes of its machine (local_rank, which picks its GPU). Made once per process;
/// MPI is initialised on first use and finalised at exit. On CUDA, an NCCL communicator is made on first
/// use, its unique id broadcast over MPI.
class Communicator {
 public:
  static Communicator& world() {
    static Communicator c;
    return c;
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  MPI_Comm mpi() const { return comm_; }

  /// Ends every rank's process with `code` after printing `message` (MPI_Abort): for an error on one rank,
  /// so that the others, possibly waiting in a collective, exit instead of hanging.
  [[noreturn]] void abort(const std::string& message, int code = 1) const {
    std::fprintf(stderr, "[dist] rank %d of %d: %s; stopping all ranks\n", rank_, size_, message.c_str());
    std::fflush(stderr);
    MPI_Abort(comm_, code);
    std::abort();
  }

  /// Blocks until every rank arrives.
  void barrier() const { detail::check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }

#if defined(TG_WITH_CUDA)
  /// This rank's NCCL communicator (made on first use: rank 0 makes the unique id, MPI broadcasts it;
  /// the device is local_rank % the machine's device count, made current first).
  ncclComm_t nccl() {
    if (nccl_ == nullptr) {
      TG_CHECK(cuda::available(), "dist", "NCCL needs a GPU on every rank; rank ", rank_, " has none");
      cuda::set_device(local_rank_ % cuda::device_count());
      ncclUniqueId id;
      if (rank_ == 0) detail::check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      detail::check_mpi(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm_), "MPI_Bcast(nccl id)");
      ncclComm_t made = nullptr;
      detail::check_nccl(ncclCommInitRank(&made, size_, id, rank_), "ncclCommInitRank");
      nccl_ = made;
    }
    return static_cast<ncclComm_t>(nccl_);
  }
#endif

 private:
  Communicator() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      int provided = 0;
      detail::check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      owns_mpi_ = true;
    }
    detail::check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // errors become tg::Error, not a silent exit
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm local;
    detail::check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local), "MPI_Comm_split_type");
    MPI_Comm_rank(local, &local_rank_);
    MPI_Comm_free(&local);
  }
  ~Communicator() {
#if defined(TG_WITH_CUDA)
    if (nccl_ != nullptr) (void)ncclCommDestroy(static_cast<ncclComm_t>(nccl_));
#endif
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!finalised) {
      MPI_Comm_free(&comm_);
      if (owns_mpi_) MPI_Finalize();
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  bool owns_mpi_ = false;
  void* nccl_ = nullptr;  // an ncclComm_t; void* so the layout is the same with and without TG_WITH_CUDA
};

namespace detail {

/// The floating leaves of a tree of dtype R's reduce type, as (input, output, count) for packing.
template <class C>
struct Packed {
  std::vector<const void*> in;
  std::vector<void*> out;
  std::vector<std::int64_t> count;
  std::vector<bool> is_bf16;
  std::int64_t total = 0;
};

template <class C, class Tree>
Packed<C> collect(const Tree& in, Tree& out) {
  Packed<C> p;
  tree_for_each([&](const std::string&, const auto& a, auto& b) {
    using L = std::remove_cvref_t<decltype(a)>;
    if constexpr (!std::is_same_v<L, bool>) {
      using T = typename L::value_type;
      if constexpr (FloatElement<T> && std::is_same_v<reduce_t<T>, C>) {
        p.in.push_back(a.data());
        p.out.push_back(b.data());
        p.count.push_back(a.size());
        p.is_bf16.push_back(std::is_same_v<T, bf16>);
        p.total += a.size();
      }
    }
  }, in, out);
  return p;
}

/// CPU: one MPI_Allreduce (sum) over every leaf of reduce type C, packed; outputs = sum / size. Runs as one
/// recorded CPU kernel, so a compiled step replays the collective.
template <class C>
void all_reduce_mean_cpu(const Packed<C>& p, MPI_Comm comm, int size) {
  if (p.total == 0) return;
  ::tg::detail::cpu_kernel([p, comm, size, buffer = std::make_shared<std::vector<C>>(static_cast<std::size_t>(p.total))] {
    C* b = buffer->data();
    for (std::size_t k = 0; k < p.in.size(); ++k) {
      if (p.is_bf16[k]) {
        const auto* x = static_cast<const bf16*>(p.in[k]);
        for (std::int64_t i = 0; i < p.count[k]; ++i) b[i] = static_cast<C>(static_cast<float>(x[i]));
      } else {
        std::memcpy(b, p.in[k], static_cast<std::size_t>(p.count[k]) * sizeof(C));
      }
      b += p.count[k];
    }
    const MPI_Datatype type = std::is_same_v<C, double> ? MPI_DOUBLE : MPI_FLOAT;
    // MPI counts are int: reduce in chunks of at most 2^30 elements.
    for (std::int64_t at = 0; at < p.total; at += std::int64_t{1} << 30) {
      const int n = static_cast<int>(std::min<std::int64_t>(p.total - at, std::int64_t{1} << 30));
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, buffer->data() + at, n, type, MPI_SUM, comm), "MPI_Allreduce");
    }
    const C scale = C(1) / static_cast<C>(size);
    b = buffer->data();
    for (std::size_t k = 0; k < p.in.size(); ++k) {
      if (p.is_bf16[k]) {
        auto* y = static_cast<bf16*>(p.out[k]);
        for (std::int64_t i = 0; i < p.count[k]; ++i) y[i] = bf16(static_cast<float>(b[i] * scale));
      } else {
        C* y = static_cast<C*>(p.out[k]);
        for (std::int64_t i = 0; i < p.count[k]; ++i) y[i] = b[i] * scale;
      }
      b += p.count[k];
    }
  });
}

#if defined(TG_WITH_CUDA)
/// CUDA: the same with NCCL on the library's stream: pack (device copies), ncclAllReduce with ncclAvg,
/// unpack. Stream-ordered with no host synchronisation, so it can be captured into a CUDA Graph. bf16
/// leaves reduce in bf16 (ncclBfloat16).
template <class C>
void all_reduce_mean_cuda(const Packed<C>& p, ncclComm_t comm, bool bf16_leaves) {
  if (p.total == 0) return;
  const std::size_t item = bf16_leaves ? sizeof(bf16) : sizeof(C);
  const auto buffer = ::tg::detail::new_storage<Cuda>(static_cast<std::size_t>(p.total) * item);
  auto* b = static_cast<char*>(buffer->data());
  for (std::size_t k = 0; k < p.in.size(); ++k) {
    if (p.is_bf16[k] != bf16_leaves) continue;
    ::tg::detail::copy_bytes<Cuda, Cuda>(b, p.in[k], static_cast<std::size_t>(p.count[k]) * item);
    b += static_cast<std::size_t>(p.count[k]) * item;
  }
  const std::size_t n = static_cast<std::size_t>(b - static_cast<char*>(buffer->data())) / item;
  if (n == 0) return;
  const ncclDataType_t type = bf16_leaves ? ncclBfloat16 : std::is_same_v<C, double> ? ncclFloat64 : ncclFloat32;
  check_nccl(ncclAllReduce(buffer->data(), buffer->data(), n, type, ncclAvg, comm, cuda::stream()), "ncclAllReduce");
  b = static_cast<char*>(buffer->data());
  for (std::size_t k = 0; k < p.in.size(); ++k) {
    if (p.is_bf16[k] != bf16_leaves) continue;
    ::tg::detail::copy_bytes<Cuda, Cuda>(p.out[k], b, static_cast<std::size_t>(p.count[k]) * item);
    b += static_cast<std::size_t>(p.count[k]) * item;
  }
}
#endif

}  // namespace detail

/// The mean over all ranks of every floating leaf (f32, bf16, f64), as jax.lax.pmean: leaves of one
/// reduce type are packed into one buffer and reduced by one collective (MPI on the CPU, NCCL on CUDA).
/// Integer leaves (step counts) are returned as they are: they must already agree. Every rank must call
/// it with a tree of the same structure and shapes. Usable inside tg::compile.
template <class Tree>
Tree all_reduce_mean(const Tree& tree, Communicator& comm = Communicator::world()) {
  Tree out = tree_map([](const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (std::is_same_v<L, bool>) return leaf;
    else if constexpr (FloatElement<typename L::value_type>) return L(leaf.shape());
    else return leaf;
  }, tree);
  using D = tree_device_t<Tree>;
  if (comm.size() == 1) {
    tree_for_each([](const std::string&, const auto& a, auto& b) {
      using L = std::remove_cvref_t<decltype(a)>;
      if constexpr (!std::is_same_v<L, bool>) {
        if constexpr (FloatElement<typename L::value_type>) b = a;
      }
    }, tree, out);
    return out;
  }
  const auto f32 = detail::collect<float>(tree, out);
  const auto f64 = detail::collect<double>(tree, out);
  if constexpr (std::is_same_v<D, Cpu>) {
    detail::all_reduce_mean_cpu(f32, comm.mpi(), comm.size());
    detail::all_reduce_mean_cpu(f64, comm.mpi(), comm.size());
  } else {
#if defined(TG_WITH_CUDA)
    detail::all_reduce_mean_cuda(f32, comm.nccl(), false);
    detail::all_reduce_mean_cuda(f32, comm.nccl(), true);
    detail::all_reduce_mean_cuda(f64, comm.nccl(), false);
#endif
  }
  return out;
}

/// Every leaf of `tree` replaced by rank `root`'s (all dtypes, bytes as they are): for initial parameters
/// and optimizer state. CPU tensors over MPI; CUDA tensors over NCCL. Not for use inside tg::compile.
template <class Tree>
void broadcast(Tree& tree, int root = 0, Communicator& comm = Communicator::world()) {
  TG_CHECK(root >= 0 && root < comm.size(), "broadcast", "root ", root, " is not a rank of ", comm.size());
  tree_for_each([&](const std::string&, auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (!std::is_same_v<L, bool>) {
      using D = typename L::device_type;
      L copy(leaf.shape());
      ::tg::detail::copy_bytes<D, D>(copy.data(), leaf.data(), leaf.nbytes());
      if constexpr (std::is_same_v<D, Cpu>) {
        auto* bytes = static_cast<char*>(static_cast<void*>(copy.data()));
        for (std::size_t at = 0; at < copy.nbytes(); at += std::size_t{1} << 30) {  // MPI counts are int
          const int n = static_cast<int>(std::min<std::size_t>(copy.nbytes() - at, std::size_t{1} << 30));
          detail::check_mpi(MPI_Bcast(bytes + at, n, MPI_BYTE, root, comm.mpi()), "MPI_Bcast");
        }
      } else {
#if defined(TG_WITH_CUDA)
        detail::check_nccl(ncclBroadcast(copy.data(), copy.data(), copy.nbytes(), ncclUint8, root, comm.nccl(), cuda::stream()), "ncclBroadcast");
#endif
      }
      leaf = std::move(copy);
    }
  }, tree);
}

/// FNV-1a over every leaf's bytes, in tree order (a host read).
template <class Tree>
std::uint64_t tree_hash(const Tree& tree) {
  std::uint64_t h = 1469598103934665603ull;
  tree_for_each([&](const std::string&, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (!std::is_same_v<L, bool>) {
      const auto v = leaf.to_vector();
      const auto* p = reinterpret_cast<const unsigned char*>(v.data());
      for (std::size_t i = 0; i < v.size() * sizeof(typename L::value_type); ++i) h = (h ^ p[i]) * 1099511628211ull;
    }
  }, tree);
  return h;
}

/// Throws tg::Error on every rank unless `tree` is bitwise identical on all ranks (compares tree_hash
/// across ranks): the check that data-parallel parameters have not drifted.
template <class Tree>
void check_identical(const Tree& tree, const std::string& what, Communicator& comm = Communicator::world()) {
  const std::uint64_t mine = tree_hash(tree);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.size()));
  detail::check_mpi(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm.mpi()), "MPI_Allgather");
  for (int r = 0; r < comm.size(); ++r)
    if (all[static_cast<std::size_t>(r)] != all[0])
      ::tg::detail::fail("check_identical", what, " differs between rank 0 and rank ", r, " (hash ", all[0], " vs ",
                         all[static_cast<std::size_t>(r)], "): the ranks have drifted apart");
}

}  // namespace dist
TG_END_NAMESPACE
