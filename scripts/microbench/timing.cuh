// The stream microbenchmarks' timing, cluster-launch and bulk-copy helpers (ring_stream.cu,
// cluster_stream.cu, cluster_layer.cu; beside them, like check.cuh, so each still builds with
// one nvcc command).
#pragma once
#include <algorithm>
#include <vector>

#include <cuda_runtime.h>

#include "check.cuh"

// The median of `reps` timed calls of `launch` (after one untimed warm-up call), in ms: events
// recorded on the default stream around each call; `before()` is enqueued ahead of each call,
// outside the timed span (an L2 eviction, say).
template <typename F, typename B> float median_ms(F launch, int reps, B before) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r <= reps; ++r) {
        before();
        CHECK(cudaEventRecord(a));
        launch();
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        if (r > 0) t.push_back(ms);
    }
    CHECK(cudaGetLastError());
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}
template <typename F> float median_ms(F launch, int reps = 7) {
    return median_ms(launch, reps, [] {});
}

// A launch of `blocks` blocks of `threads` threads with `smem` bytes of dynamic shared memory,
// as thread-block clusters of `cluster` blocks along x. `attr` holds the cluster attribute and
// must outlive the launch.
inline cudaLaunchConfig_t cluster_config(cudaLaunchAttribute &attr, int blocks, int cluster, int threads, int smem) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return cfg;
}

// Device side (sm_90): one bulk copy of `bytes` bytes from global `src` to this block's shared
// memory at shared address `dst`, its bytes completing on the mbarrier at shared address `bar`,
// whose current phase the call arms (one arrival, expecting the bytes).
__device__ __forceinline__ void bulk_load(unsigned dst, const void *src, unsigned bytes, unsigned bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// `n` mbarriers of one arrival each at shared addresses bar0, bar0 + 8, ..., made visible to
// the bulk copies (one thread).
__device__ __forceinline__ void mbar_init(unsigned bar0, int n) {
    for (int s = 0; s < n; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
