// What a kernel boundary costs inside a CUDA graph, against a grid barrier inside one
// persistent kernel: the question behind the small-model decode rows of issue 6 (a 135M layer
// is five kernels of ~2.7 µs each, nearly all fixed cost).
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -o /tmp/boundary scripts/microbench/boundary.cu && /tmp/boundary
//
// Every variant runs STEPS dependent steps; a step's body is nothing (`empty`), one read of the
// previous step's output and one write per thread (`read`), or a GEMV's tail: two float4 of
// the input per lane, a warp sum, one store per warp (`gemv`):
// - chain:      one kernel per step, STEPS kernels captured into one graph, launched with
//               programmatic dependent launch (griddepcontrol.wait first, then
//               launch_dependents, as ferrum's kernels do) or without it, for several
//               (blocks x threads) shapes;
// - persistent: one kernel of G co-resident blocks, a grid barrier between steps;
// - weights:    the gemv step that also loads two 16-byte weight chunks per thread before its
//               wait, the weights in L2 (one region reused) or in DRAM (a new region per step).
// Each figure is the graph's (or kernel's) time divided by STEPS, the median of REPS launches.
// Results (H200, session 16): docs/bench/2026-11-30-session16/call{2,3,5}-boundary.txt and
// docs/PERF.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "check.cuh"
#include "graph.cuh"

constexpr int N = 576;  // SmolLM2-135M's hidden size
constexpr int STEPS = 300;
constexpr int REPS = 15;

// One step's body. touch 0: no memory at all. touch 1: thread t of block b reads
// in[(b * blockDim + t) % N] (written by the previous step, so an L2 round trip) and writes
// out[the same index]. touch 2, a GEMV's tail: each lane reads two float4 of the input, the
// warp sums them (a shuffle reduction) and lane 0 stores one value per warp.
__device__ __forceinline__ void body(const float *in, float *out, int touch) {
    if (touch == 0) return;
    const int gt = blockIdx.x * blockDim.x + threadIdx.x;
    if (touch == 1) {
        const int i = gt % N;
        out[i] = in[i] + 1.0f;
        return;
    }
    const float4 *in4 = reinterpret_cast<const float4 *>(in);
    const int lane = threadIdx.x & 31, c = (2 * lane) % (N / 4);
    const float4 a = in4[c], b = in4[c + 1];
    float v = a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[(gt >> 5) % N] = v * 1e-3f;
}

__global__ void step_kernel(const float *in, float *out, int touch, int pdl) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    body(in, out, touch);
}

// Sense-free generation barrier: thread 0 reads the generation, arrives (acq_rel), and the
// last arriver resets the count and publishes generation + 1 (release); the others poll it
// (acquire). The block's bar.sync before and after makes it a block-wide barrier.
__device__ __forceinline__ void grid_sync(unsigned *count, unsigned *gen, unsigned nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g, old, v;
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");
        asm volatile("atom.acq_rel.gpu.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
        if (old == nblocks - 1) {
            asm volatile("st.relaxed.gpu.u32 [%0], 0;" ::"l"(count) : "memory");
            asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(gen), "r"(g + 1) : "memory");
        } else {
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(gen) : "memory");
            } while (v == g);
        }
    }
    __syncthreads();
}

__global__ void persistent_kernel(float *a, float *b, unsigned *count, unsigned *gen, int steps,
                                  int touch) {
    for (int s = 0; s < steps; ++s) {
        body(s % 2 ? b : a, s % 2 ? a : b, touch);
        grid_sync(count, gen, gridDim.x);
    }
}

// A GEMV-shaped step whose weights are loaded before the programmatic-launch wait, as
// ferrum's GEMVs do: each thread loads two 16-byte chunks of W (weak loads in asm volatile, so
// they stay ahead of the wait), waits, reads the previous step's output, and folds both into
// one warp sum. W = base + step * stride: stride 0 reuses one region (it stays in L2), a stride
// of the region's size walks a buffer larger than L2 (every step's weights come from DRAM).
__global__ void weights_step(const uint4 *w, const float *in, float *out) {
    const int gt = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
    uint4 a, b;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w)
                 : "l"(w + gt));
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w)
                 : "l"(w + nt + gt));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const float4 *in4 = reinterpret_cast<const float4 *>(in);
    const int lane = threadIdx.x & 31, c = (2 * lane) % (N / 4);
    const float4 x = in4[c];
    float v = x.x * __uint_as_float(a.x ^ b.x) + x.y * __uint_as_float(a.y ^ b.y) +
              x.z * __uint_as_float(a.z ^ b.z) + x.w * __uint_as_float(a.w ^ b.w);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[(gt >> 5) % N] = v * 1e-30f;
}

int main() {
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float *a, *b;
    unsigned *sync;
    CHECK(cudaMalloc(&a, N * sizeof(float)));
    CHECK(cudaMalloc(&b, N * sizeof(float)));
    CHECK(cudaMalloc(&sync, 2 * sizeof(unsigned)));
    CHECK(cudaMemset(a, 0, N * sizeof(float)));
    CHECK(cudaMemset(b, 0, N * sizeof(float)));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::printf("SMs %d, %d steps per graph, median of %d launches\n", sms, STEPS, REPS);

    // (blocks, threads per block): equal thread counts in different shapes too.
    const int shapes[][2] = {{1, 256},     {36, 256},    {sms, 128},   {sms, 256},
                             {sms, 512},   {sms, 1024},  {2 * sms, 128}, {2 * sms, 256},
                             {2 * sms, 512}, {4 * sms, 128}, {4 * sms, 256}, {8 * sms, 128}};
    const char *names[] = {"empty", "read", "gemv"};
    for (int touch = 0; touch < 3; ++touch) {
        for (auto &sh : shapes) {
            const int g = sh[0], th = sh[1];
            for (int pdl = 0; pdl < 2; ++pdl) {
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int s = 0; s < STEPS; ++s)
                    launch(st, g, th, pdl != 0, step_kernel, (const float *)(s % 2 ? b : a), s % 2 ? a : b, touch,
                           pdl);
                CHECK(cudaStreamEndCapture(st, &graph));
                CHECK(cudaGraphInstantiate(&exec, graph, 0));
                std::printf("chain      blocks %4d x %4d  pdl %d  %-6s %6.2f us per step\n", g, th, pdl,
                            names[touch], time_graph(exec, st, STEPS, REPS));
                CHECK(cudaGraphExecDestroy(exec));
                CHECK(cudaGraphDestroy(graph));
            }
        }
        for (auto &sh : shapes) {
            const int g = sh[0], th = sh[1];
            if (g > sms || th != 256) continue;  // every block must be resident for the barrier
            CHECK(cudaMemset(sync, 0, 2 * sizeof(unsigned)));
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            persistent_kernel<<<g, th, 0, st>>>(a, b, sync, sync + 1, STEPS, touch);
            CHECK(cudaGetLastError());
            CHECK(cudaStreamEndCapture(st, &graph));
            CHECK(cudaGraphInstantiate(&exec, graph, 0));
            std::printf("persistent blocks %4d x %4d         %-6s %6.2f us per step\n", g, th,
                        names[touch], time_graph(exec, st, STEPS, REPS));
            CHECK(cudaGraphExecDestroy(exec));
            CHECK(cudaGraphDestroy(graph));
        }
    }
    // Weights before the wait: from L2 (one region reused) or from DRAM (a new region every
    // step, STEPS regions: larger than the 50 MB L2 for every grid below).
    {
        const int wshapes[][2] = {{36, 256}, {sms, 128}, {sms, 256}, {2 * sms, 256}, {4 * sms, 256}};
        const size_t max_region = (size_t)4 * sms * 256 * 2;  // uint4 per step, largest grid
        uint4 *w;
        CHECK(cudaMalloc(&w, max_region * STEPS * sizeof(uint4)));
        CHECK(cudaMemset(w, 0, max_region * STEPS * sizeof(uint4)));
        for (auto &sh : wshapes) {
            const int g = sh[0], th = sh[1];
            const size_t region = (size_t)g * th * 2;
            for (int dram = 0; dram < 2; ++dram) {
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int s = 0; s < STEPS; ++s)
                    launch(st, g, th, true, weights_step, (const uint4 *)(w + (dram ? (size_t)s * max_region : 0)),
                           (const float *)(s % 2 ? b : a), s % 2 ? a : b);
                CHECK(cudaStreamEndCapture(st, &graph));
                CHECK(cudaGraphInstantiate(&exec, graph, 0));
                std::printf("weights    blocks %4d x %4d  pdl 1  %-6s %6.2f us per step (%zu KiB of weights)\n", g,
                            th, dram ? "dram" : "l2", time_graph(exec, st, STEPS, REPS), region * 16 / 1024);
                CHECK(cudaGraphExecDestroy(exec));
                CHECK(cudaGraphDestroy(graph));
            }
        }
        CHECK(cudaFree(w));
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}
