// dp_sgd_cuda: the DP-SGD example built by nvcc, with the CUDA backend (--device auto picks the GPU).
#include "dp_sgd.cpp"
