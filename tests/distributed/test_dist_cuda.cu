// tg::dist on CUDA tensors over NCCL under `mpirun -np 2`: the mean of a mixed-dtype tree and a broadcast,
// one GPU per rank. Exits 77 (skipped) where a rank has no GPU; in CI this proves the NCCL path compiles
// and links.
#include <tapegrad/tapegrad.hpp>
#include <tapegrad/distributed/distributed.hpp>

#include <cstdio>

namespace dist_cuda_test {
struct Tree {
  tg::Tensor<float, tg::Cuda> a;
  tg::Tensor<tg::bf16, tg::Cuda> b;
  tg::Tensor<double, tg::Cuda> c;
  tg::Tensor<std::int32_t, tg::Cuda> count;
};
TG_PYTREE(Tree, a, b, c, count)
}  // namespace dist_cuda_test

int main() {
  auto& comm = tg::dist::Communicator::world();
  int any_missing = tg::cuda::available() ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &any_missing, 1, MPI_INT, MPI_MAX, comm.mpi());
  if (any_missing) {
    if (comm.rank() == 0) std::printf("a rank has no CUDA device (%s): skipping the NCCL test\n", tg::cuda::describe_devices().c_str());
    return 77;
  }
  try {
    const float r = static_cast<float>(comm.rank());
    dist_cuda_test::Tree t{tg::full<float, tg::Cuda>({1000}, r + 1.0f), tg::full<tg::bf16, tg::Cuda>({10}, tg::bf16(2.0f * (r + 1.0f))),
                           tg::full<double, tg::Cuda>({3}, 10.0 * (r + 1.0)), tg::full<std::int32_t, tg::Cuda>({}, 5)};
    const auto avg = tg::dist::all_reduce_mean(t);
    const double mean = (comm.size() - 1) / 2.0 + 1.0;
    bool ok = avg.a.to_vector()[999] == static_cast<float>(mean) && static_cast<float>(avg.b.to_vector()[0]) == static_cast<float>(2.0 * mean) &&
              avg.c.to_vector()[2] == 10.0 * mean && avg.count.item() == 5;
    auto b = t;
    tg::dist::broadcast(b, 0);
    ok = ok && b.a.to_vector()[0] == 1.0f;
    tg::dist::check_identical(b, "broadcast tree");
    std::printf("%s rank %d: NCCL mean and broadcast\n", ok ? "ok  " : "FAIL", comm.rank());
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    comm.abort(e.what());
  }
}
