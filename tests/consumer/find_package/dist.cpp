// A consumer of the installed tapegrad::dist: one process (a singleton MPI job) averages a tree.
#include <tapegrad/tapegrad.hpp>
#include <tapegrad/distributed/distributed.hpp>

#include <cstdio>

struct Grads {
  tg::Tensor<float> w;
  tg::Tensor<double> b;
};
TG_PYTREE(Grads, w, b)

int main() {
  auto& comm = tg::dist::Communicator::world();
  const Grads g{tg::full<float>({3}, 2.0f), tg::full<double>({2}, -1.0)};
  const Grads mean = tg::dist::all_reduce_mean(g);
  const bool ok = mean.w.to_vector() == g.w.to_vector() && mean.b.to_vector() == g.b.to_vector();
  tg::dist::check_identical(mean, "the mean");
  std::printf("consumer_dist %s: rank %d of %d\n", ok ? "ok" : "FAILED", comm.rank(), comm.size());
  return ok ? 0 : 1;
}
