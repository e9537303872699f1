// bench_train_step_cuda: the training-step benchmark (train_step.cpp) on the GPU, with cuBLASLt called
// directly as the GEMM floor. Without a GPU it says so and exits 0.
#define TG_BENCH_CUDA 1
#include "train_step.cpp"
