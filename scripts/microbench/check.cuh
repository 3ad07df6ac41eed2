// The microbenchmarks' CUDA error check (each microbenchmark is one source file built with one
// nvcc command; this header sits beside them, so `#include "check.cuh"` needs no -I flag).
#pragma once
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e_ = (x);                                                                 \
        if (e_ != cudaSuccess) {                                                              \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                    \
                         cudaGetErrorString(e_));                                             \
            std::exit(1);                                                                     \
        }                                                                                     \
    } while (0)
