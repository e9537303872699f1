// The device-generic tests built by nvcc with every tensor on the GPU (TG_TEST_CUDA), and the GPU-only
// cases; the binary reports skipped (exit 77) on a machine without one.
#include "../test_tensor.cpp"
#include "../test_random.cpp"
#include "../test_ops.cpp"
#include "../test_transformer_ops.cpp"
#include "../test_autodiff.cpp"
#include "../test_optim.cpp"
#include "../test_compile.cpp"
#include "../test_vmap.cpp"
#include "../test_higher_order.cpp"
#include "../test_conv.cpp"
#include "test_cuda_memory.cpp"
