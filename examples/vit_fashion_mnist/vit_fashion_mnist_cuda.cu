// The ViT trainer built by nvcc: CUDA when a GPU is there (--device auto), else the CPU.
#include "vit_fashion_mnist.cpp"
