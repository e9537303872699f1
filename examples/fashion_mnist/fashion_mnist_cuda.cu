// fashion_mnist_cuda: the trainer built by nvcc, with the CUDA backend (--device auto picks the GPU).
#include "fashion_mnist.cpp"
