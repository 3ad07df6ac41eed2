// What the instructions between a GEMV's programmatic-launch wait and its first FMA cost, the
// question session 25 left (docs/PERF.md, "Session 25: what the arrivals and the SASS show"):
// three ways to issue a GEMV's second x chunk earlier lost 3-50% in the decode step, more than
// the one L1-miss round trip each was meant to save.
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -o /tmp/postwait scripts/microbench/postwait.cu && /tmp/postwait
//
// STEPS GEMV-shaped steps captured into one graph, each a kernel launched with programmatic
// dependent launch. Every thread loads two 16-byte weight chunks before its wait (weak asm
// loads from a region of its own step, so from DRAM, as ferrum's GEMVs do), waits, then reads
// two 32-byte chunks of x (the previous step's output, 1 KiB apart, as lane l's chunks l and
// l + 32 are) and folds both into one warp sum, one store per warp. The x reads, by MODE:
// - 0 branchy:  chunk 0's loads, its FMAs, then chunk 1's loads and FMAs behind a condition
//               on chunk 0's sum (the chunk-by-chunk order of ferrum's GEMVs: two dependent
//               round trips);
// - 1 hoisted:  both chunks' loads, then the FMAs (one round trip; two more float4 registers);
// - 2 prefetch: `prefetch.global.L1` of chunk 1's line, then as branchy;
// - 3 cpasync:  chunk 1 copied to shared memory with cp.async after the wait, chunk 0 loaded
//               directly, cp.async.wait_all, chunk 1 from shared memory;
// - 4 cpasync-early: as hoisted, plus one cp.async of a weight chunk issued before the wait
//               and waited for after it (the decode attention's pattern, which costs nothing
//               there): does an async copy in flight at the wait cost anything?
// Each figure is the graph's time divided by STEPS, the median of REPS launches.
// Run in session 26 call 1 (docs/bench/2026-12-01-session26/call1-postwait.txt, docs/PERF.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "check.cuh"
#include "graph.cuh"

constexpr int N = 2048;  // x: Llama-3.2-1B's hidden size
constexpr int STEPS = 300;
constexpr int REPS = 15;

__device__ __forceinline__ uint4 ld_early(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void cp16(void *dst_smem, const void *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst_smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

// The weights' bits as floats times x: the step's arithmetic (its value is never checked).
__device__ __forceinline__ float dot(uint4 w, float4 a, float4 b) {
    return __uint_as_float(w.x) * a.x + __uint_as_float(w.y) * a.y + __uint_as_float(w.z) * a.z +
           __uint_as_float(w.w) * a.w + __uint_as_float(w.x ^ w.y) * b.x + __uint_as_float(w.y ^ w.z) * b.y +
           __uint_as_float(w.z ^ w.w) * b.z + __uint_as_float(w.w ^ w.x) * b.w;
}

template <int MODE>
__global__ void __launch_bounds__(256) step(const uint4 *w, const float *in, float *out, int n) {
    __shared__ __align__(16) float4 s_x[2][256];
    __shared__ __align__(16) uint4 s_w[256];
    const int gt = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
    const int lane = threadIdx.x & 31;
    const uint4 w0 = ld_early(w + gt), w1 = ld_early(w + nt + gt);
    if (MODE == 4) cp16(&s_w[threadIdx.x], w + 2 * nt + gt);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const float4 *x4 = reinterpret_cast<const float4 *>(in);
    const int c0 = lane, c1 = lane + 32;  // 32-byte chunks of x: 2 float4 each
    float v = 0.0f;
    if (MODE == 0 || MODE == 2) {
        if (MODE == 2) asm volatile("prefetch.global.L1 [%0];" ::"l"(x4 + 2 * c1));
        v = dot(w0, x4[2 * c0], x4[2 * c0 + 1]);
        // The condition reads v, so chunk 1's loads issue only once chunk 0's FMAs are done
        // (in ferrum's GEMVs the 64-register budget gives the same order; here the compiler
        // would otherwise predicate both chunks' loads together). v == v: never NaN here.
        if (c1 < n && v == v) v += dot(w1, x4[2 * c1], x4[2 * c1 + 1]);
    } else if (MODE == 1 || MODE == 4) {
        const int cc = c1 < n ? c1 : 0;
        const float4 a0 = x4[2 * c0], b0 = x4[2 * c0 + 1], a1 = x4[2 * cc], b1 = x4[2 * cc + 1];
        v = dot(w0, a0, b0) + (c1 < n ? dot(w1, a1, b1) : 0.0f);
        if (MODE == 4) {
            asm volatile("cp.async.wait_all;" ::: "memory");
            v += __uint_as_float(s_w[threadIdx.x].x);
        }
    } else {
        if (c1 < n) {
            cp16(&s_x[0][threadIdx.x], x4 + 2 * c1);
            cp16(&s_x[1][threadIdx.x], x4 + 2 * c1 + 1);
        }
        v = dot(w0, x4[2 * c0], x4[2 * c0 + 1]);
        asm volatile("cp.async.wait_all;" ::: "memory");
        if (c1 < n) v += dot(w1, s_x[0][threadIdx.x], s_x[1][threadIdx.x]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[gt >> 5] = v * 1e-30f;
}

template <int MODE>
static float run(cudaStream_t st, int g, const uint4 *w, size_t region, float *a, float *b) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int s = 0; s < STEPS; ++s)
        launch(st, g, 256, true, step<MODE>, w + (size_t)s * region, (const float *)(s % 2 ? b : a), s % 2 ? a : b,
               N / 8);
    CHECK(cudaStreamEndCapture(st, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const float us = time_graph(exec, st, STEPS, REPS);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return us;
}

int main() {
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    // The largest grid: 4 blocks of 256 a multiprocessor (the 64-register GEMVs' one wave).
    const size_t max_threads = (size_t)4 * sms * 256, region = 3 * max_threads;  // uint4 a step
    uint4 *w;
    float *a, *b;
    const size_t xs = std::max((size_t)N, max_threads / 32);
    CHECK(cudaMalloc(&w, region * STEPS * sizeof(uint4)));
    CHECK(cudaMemset(w, 0, region * STEPS * sizeof(uint4)));
    CHECK(cudaMalloc(&a, xs * sizeof(float)));
    CHECK(cudaMalloc(&b, xs * sizeof(float)));
    CHECK(cudaMemset(a, 0, xs * sizeof(float)));
    CHECK(cudaMemset(b, 0, xs * sizeof(float)));
    std::printf("SMs %d, %d steps per graph, median of %d launches, weights from DRAM\n", sms, STEPS, REPS);
    const char *names[] = {"branchy", "hoisted", "prefetch", "cpasync", "cpasync-early"};
    for (int g : {sms, 2 * sms, 4 * sms}) {
        const float t[5] = {run<0>(st, g, w, region, a, b), run<1>(st, g, w, region, a, b),
                            run<2>(st, g, w, region, a, b), run<3>(st, g, w, region, a, b),
                            run<4>(st, g, w, region, a, b)};
        for (int m = 0; m < 5; ++m)
            std::printf("blocks %4d x 256  %-14s %6.2f us per step\n", g, names[m], t[m]);
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}
