// Does a decode step's code fit the instruction caches? (session 39)
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/icache scripts/microbench/icache.cu && /tmp/icache
//
// Why: Nsight Compute's warp-stall samples of SmolLM2-135M's layer kernels (session 39, calls
// 1-2) put 6-16% of the GEMVs' samples on "no instruction" and another 9-16% on "IMC miss"
// (the constant cache that holds kernel parameters), and the attention's 4-warp blocks at
// 6-15% "no instruction"; but ncu runs each kernel alone, so those counts say nothing about
// the caches' state inside the replayed step, where the same five kernels (~20-64 KB of SASS
// each) run again every layer. This measures the instruction caches directly: K kernels, each
// S bytes of straight-line code (every kernel's own addresses), launched in turn in one graph,
// one warp (or four) per multiprocessor. If the code of all K fits the caches, a kernel's time
// does not depend on K; once the footprint K x S passes a cache's size, each kernel fetches its
// code again and the time per instruction jumps. Printed: µs per launch, and cycles per
// instruction over the empty kernel (at 1.98 GHz: the H200's SM clock in these runs).
//
// Results (H200, session 39): docs/bench/2026-12-03-session39/call{3,4}-icache.txt and
// docs/PERF.md (those runs labelled each kernel by its FFMA bytes, N x 256, not its whole code,
// 640 bytes more). In short: ~1 cycle an FFMA while the kernels' code fits ~28 KB (6 x 4.6 KiB),
// ~2.85 from ~33 KB (2 x 16.6 KiB: 1.5) up; code a kernel jumps over takes room too; with 32
// warps a multiprocessor the misses are hidden.
//
// Each body is N groups of 16 FFMA (four independent chains, 4 deep each; an FFMA is 16 bytes,
// so a group is 256 bytes of code), with immediates that differ by kernel and group so that no
// two kernels' code is alike; the sink store keeps the chains live.
#include <cstdio>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "check.cuh"
#include "graph.cuh"

constexpr int LAUNCHES = 240;  // launches per graph (a multiple of every K below)

// A kernel's code, bytes: its section in the sm_90a cubin (nvcc 13.0: 640, 4736, 17024, 33408
// and 66176 bytes for N = 0, 16, 64, 128 and 256 groups).
constexpr int code_bytes(int n) { return 640 + 256 * n; }
constexpr int REPS = 9;

// N groups of straight-line code; with `skip` (a runtime value the compiler cannot see) the
// second three quarters of them are jumped over, so a kernel of N groups executes N / 4.
template <int ID, int N>
__global__ void __launch_bounds__(1024) code_kernel(float *sink, float seed, int pdl, int skip) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    float a0 = seed + threadIdx.x, a1 = a0 + 1.0f, a2 = a0 + 2.0f, a3 = a0 + 3.0f;
    auto group = [&](int i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float c = 1.0f + (float)(ID * 4096 + i * 4 + j) * 1e-7f;
            a0 = fmaf(a0, c, 0.25f);
            a1 = fmaf(a1, c, 0.5f);
            a2 = fmaf(a2, c, 0.75f);
            a3 = fmaf(a3, c, 1.0f);
        }
    };
#pragma unroll
    for (int i = 0; i < N / 4; ++i) group(i);
    if (!skip) {
#pragma unroll
        for (int i = N / 4; i < N; ++i) group(i);
    }
    if (a0 + a1 + a2 + a3 == 1234.5f) sink[blockIdx.x] = a0;
}

using Kern = void (*)(float *, float, int, int);
template <int N, int... IDs> std::vector<Kern> table(std::integer_sequence<int, IDs...>) {
    return {code_kernel<IDs, N>...};
}
constexpr int KMAX = 24;
template <int N> std::vector<Kern> kernels() { return table<N>(std::make_integer_sequence<int, KMAX>{}); }

// µs per launch: LAUNCHES launches of kernels[i % k] in one graph.
static float run(const std::vector<Kern> &ks, int k, int blocks, int threads, bool pdl, float *sink, int skip = 0) {
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < LAUNCHES; ++i) launch(st, blocks, threads, pdl, ks[i % k], sink, 1.0f, pdl ? 1 : 0, skip);
    CHECK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    const float t = time_graph(exec, st, LAUNCHES, REPS);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaStreamDestroy(st));
    return t;
}

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *sink;
    CHECK(cudaMalloc(&sink, sms * sizeof(float)));
    // Code per kernel: N groups of 256 bytes (N = 0: the launch alone).
    const std::vector<std::pair<int, std::vector<Kern>>> sizes = {
        {0, kernels<0>()},     {16, kernels<16>()},   {32, kernels<32>()},
        {64, kernels<64>()},   {128, kernels<128>()}, {256, kernels<256>()},
    };
    const int counts[] = {1, 2, 3, 4, 6, 8, 12, 24};
    for (const bool pdl : {true, false}) {
        for (const int threads : {32, 128}) {
            // Under programmatic launch a kernel's body overlaps the next launch's start, so the
            // time over the empty kernel is not a cost per instruction: µs only there.
            std::printf("== %s, %d blocks of %d threads (µs per launch%s)\n",
                        pdl ? "programmatic launch" : "plain launches", sms, threads,
                        pdl ? "" : "; cycles per FFMA over the empty kernel at 1.98 GHz, the H200's SM clock");
            std::printf("%-22s", "code per kernel \\ K");
            for (const int k : counts) std::printf("  K=%-12d", k);
            std::printf("\n");
            std::vector<float> base;
            for (const int k : counts) base.push_back(run(sizes[0].second, k, sms, threads, pdl, sink));
            for (const auto &[n, ks] : sizes) {
                std::printf("%6d B (%4d FFMA)    ", code_bytes(n), n * 16);
                for (size_t i = 0; i < std::size(counts); ++i) {
                    const float t = n == 0 ? base[i] : run(ks, counts[i], sms, threads, pdl, sink);
                    if (n == 0 || pdl)
                        std::printf("  %6.3f        ", t);
                    else
                        std::printf("  %6.3f (%5.2f)", t, (t - base[i]) * 1980.0f / (n * 16));
                }
                std::printf("   footprint %.1f..%.1f KiB\n", code_bytes(n) / 1024.0, code_bytes(n) * KMAX / 1024.0);
            }
        }
    }
    // Code jumped over: kernels of N groups that execute N / 4 of them (`skip`), against
    // kernels of N / 4 groups; does code a kernel never runs fill the caches too? And many warps
    // of one block running the same code (a GEMV's 8-32 warps a multiprocessor): is a miss
    // paid once per multiprocessor?
    std::printf("== jumped-over code, programmatic launch, %d blocks of 32 threads: N/4 groups run\n", sms);
    for (size_t s = 2; s < sizes.size(); ++s) {
        const int n = sizes[s].first;
        std::printf("%6d B kernels running ~%5d B:", code_bytes(n), code_bytes(n / 4));
        for (const int k : {1, 3, 6}) {
            const float t = run(sizes[s].second, k, sms, 32, true, sink, 1);
            std::printf("  K=%d %6.3f", k, t);
        }
        std::printf("   against %d B kernels:", code_bytes(n / 4));
        for (size_t q = 0; q < sizes.size(); ++q) {
            if (sizes[q].first != n / 4) continue;
            for (const int k : {1, 3, 6}) std::printf("  K=%d %6.3f", k, run(sizes[q].second, k, sms, 32, true, sink));
        }
        std::printf("\n");
    }
    for (const int threads : {256, 1024}) {
        std::printf("== programmatic launch, %d blocks of %d threads (µs per launch)\n", sms, threads);
        for (const auto &[n, ks] : sizes) {
            std::printf("%6d B:", code_bytes(n));
            for (const int k : {1, 2, 3, 6}) std::printf("  K=%d %7.3f", k, run(ks, k, sms, threads, true, sink));
            std::printf("\n");
        }
    }
    CHECK(cudaFree(sink));
    return 0;
}
