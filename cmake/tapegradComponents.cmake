# The usage requirements of tapegrad's optional targets, in one place for both ways of getting them: the
# build tree (CMakeLists.txt: tapegrad_cuda, tapegrad_dist, tapegrad_dist_cuda behind the tapegrad::
# aliases) and the installed package (tapegradConfig.cmake: imported tapegrad::cuda, tapegrad::dist,
# tapegrad::dist_cuda, created on the consumer's machine when what they need is found there). The
# headers are the same with and without CUDA or MPI, so only these requirements differ.

# tapegrad::cuda: the CUDA runtime, cuBLAS and cuBLASLt, and TG_WITH_CUDA for the headers.
function(_tapegrad_cuda_usage target tapegrad_target)
  target_link_libraries(${target} INTERFACE ${tapegrad_target} CUDA::cudart CUDA::cublas CUDA::cublasLt)
  target_compile_definitions(${target} INTERFACE TG_WITH_CUDA=1)
  # cuDNN 9 (cudnn.h, libcudnn): the CUDA convolutions. Beside the toolkit in NVIDIA's CUDA images (and
  # here); elsewhere NVIDIA's cudnn9-cuda-13 package. Without it tapegrad::cuda still builds, and a CUDA
  # convolution raises an error saying so. CUDNN_INCLUDE_DIR and CUDNN_LIBRARY may be set by the user.
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(CUDNN_INCLUDE_DIR AND CUDNN_LIBRARY)
    target_include_directories(${target} INTERFACE ${CUDNN_INCLUDE_DIR})
    target_link_libraries(${target} INTERFACE ${CUDNN_LIBRARY})
    target_compile_definitions(${target} INTERFACE TG_WITH_CUDNN=1)
  else()
    message(STATUS "tapegrad: cuDNN not found (cudnn.h, libcudnn): CUDA convolutions will raise an error; "
                   "install cuDNN 9 for your CUDA (NVIDIA's cudnn9-cuda-13) or set CUDNN_INCLUDE_DIR and CUDNN_LIBRARY")
  endif()
  # C++20 for .cu files (CMake 3.25 has no cuda_std_20 feature entry for nvcc 13), and OpenMP for the
  # host loops in them: nvcc passes host flags through -Xcompiler.
  target_compile_options(${target} INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 -Xcompiler=-fopenmp -Xcompiler=-fno-math-errno>)
endfunction()

# tapegrad::dist: data parallelism over MPI (CPU tensors).
function(_tapegrad_dist_usage target tapegrad_target)
  target_link_libraries(${target} INTERFACE ${tapegrad_target} MPI::MPI_CXX)
  target_compile_definitions(${target} INTERFACE TG_WITH_DIST=1)
endfunction()

# NCCL ships with the CUDA toolkit here (nccl.h, libnccl.so); elsewhere it is NVIDIA's libnccl-dev. Sets
# the cache variables NCCL_INCLUDE_DIR and NCCL_LIBRARY (a user may set them), *-NOTFOUND when missing.
# Call after find_package(CUDAToolkit).
macro(_tapegrad_find_nccl)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
endmacro()

# tapegrad::dist_cuda: tapegrad::cuda, MPI and NCCL (CUDA tensors across ranks).
function(_tapegrad_dist_cuda_usage target cuda_target)
  target_include_directories(${target} INTERFACE ${NCCL_INCLUDE_DIR})
  target_link_libraries(${target} INTERFACE ${cuda_target} MPI::MPI_CXX ${NCCL_LIBRARY})
  target_compile_definitions(${target} INTERFACE TG_WITH_DIST=1)
endfunction()
