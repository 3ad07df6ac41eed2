// How finely `%globaltimer` ticks on this GPU: the kernel timeline (`ferrum bench --timeline`,
// common.cuh's FERRUM_TIMELINE) reads it for every stamp, and its means are worth as much as the
// tick allows. One thread reads the timer back to back ITERS times (and `clock64` beside it) and
// the host prints the distinct nonzero steps between consecutive reads, with their counts; a
// second launch of one block per multiprocessor's worth has each block's first thread read it
// once and prints the spread (block dispatch skew and any skew between the multiprocessors'
// timers together: an upper bound on the latter).
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -o /tmp/globaltimer scripts/microbench/globaltimer.cu && /tmp/globaltimer
#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <vector>

#include "check.cuh"

constexpr int ITERS = 1 << 16;

__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}

__global__ void reads(unsigned long long *t, long long *c) {
    for (int i = 0; i < ITERS; ++i) {
        t[i] = gtimer();
        c[i] = clock64();
    }
}

__global__ void per_sm(unsigned long long *t) {
    if (threadIdx.x == 0) t[blockIdx.x] = gtimer();
}

int main() {
    unsigned long long *dt;
    long long *dc;
    CHECK(cudaMalloc(&dt, ITERS * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&dc, ITERS * sizeof(long long)));
    reads<<<1, 1>>>(dt, dc);
    CHECK(cudaGetLastError());
    std::vector<unsigned long long> t(ITERS);
    std::vector<long long> c(ITERS);
    CHECK(cudaMemcpy(t.data(), dt, ITERS * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(c.data(), dc, ITERS * sizeof(long long), cudaMemcpyDeviceToHost));
    std::map<unsigned long long, int> steps;
    for (int i = 1; i < ITERS; ++i)
        if (t[i] != t[i - 1]) ++steps[t[i] - t[i - 1]];
    const double ns = (double)(t[ITERS - 1] - t[0]), cyc = (double)(c[ITERS - 1] - c[0]);
    std::printf("%d back-to-back reads over %.0f ns (%.0f SM cycles, %.3f GHz): %zu distinct steps\n", ITERS, ns,
                cyc, cyc / ns, steps.size());
    int shown = 0;
    for (auto &[d, n] : steps)
        if (shown++ < 12) std::printf("  step %8llu ns  x %d\n", d, n);
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    per_sm<<<sms, 32>>>(dt);
    CHECK(cudaMemcpy(t.data(), dt, sms * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    unsigned long long lo = t[0], hi = t[0];
    for (int i = 1; i < sms; ++i) lo = t[i] < lo ? t[i] : lo, hi = t[i] > hi ? t[i] : hi;
    std::printf("one read per block of %d blocks: spread %llu ns\n", sms, hi - lo);
    return 0;
}
