// The graph microbenchmarks' launch and timing helpers (boundary.cu, postwait.cu; beside them,
// like check.cuh, so each still builds with one nvcc command).
#pragma once
#include <algorithm>
#include <vector>

#include <cuda_runtime.h>

#include "check.cuh"

// One step's launch, captured into the graph: g blocks of th threads, with programmatic
// dependent launch when `pdl`.
template <typename... Args>
static void launch(cudaStream_t st, int g, int th, bool pdl, void (*kernel)(Args...), Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(g);
    cfg.blockDim = dim3(th);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// The median over `reps` launches (after two warm-up launches) of the graph's time divided by
// its `steps` steps, in µs.
static float time_graph(cudaGraphExec_t exec, cudaStream_t st, int steps, int reps) {
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < reps + 2; ++r) {
        CHECK(cudaEventRecord(e0, st));
        CHECK(cudaGraphLaunch(exec, st));
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) t.push_back(ms * 1000.0f / steps);
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}
