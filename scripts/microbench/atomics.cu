// What it costs for every block of a grid to add a whole hidden-size vector into one
// accumulator with L2 reductions (red.global.add), against each block storing its partial:
// the question behind a fused MLP kernel (gate|up and down in one kernel, split over the
// intermediate columns), whose blocks each hold a partial of the whole down-projection output.
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -o /tmp/atomics scripts/microbench/atomics.cu && /tmp/atomics
//
// STEPS dependent steps captured into one graph, one kernel each, programmatic dependent
// launch. A step reads n values of the previous step's output after its wait, then every block
// writes n values:
// - store: into its own slice of a partials buffer (plain stores: the baseline),
// - red64: red.global.add.u64 of the value in 32.32 fixed point into one accumulator (integer
//          addition is associative, so the sum is the same in any order: deterministic),
// - redf32: red.global.add.f32 into one accumulator (order-dependent),
// - redv4: red.global.add.v4.f32, four values an instruction (sm_90, order-dependent).
// Each figure is the graph's time divided by STEPS, the median of REPS launches.
// Results (H200, session 31): docs/bench/2026-12-02-session31/call1-atomics.txt and docs/PERF.md.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "check.cuh"
#include "graph.cuh"

constexpr int STEPS = 200;
constexpr int REPS = 11;
constexpr int MAXN = 4096;

enum Mode { STORE = 0, RED64 = 1, REDF32 = 2, REDV4 = 3 };

__global__ void step(const float *in, float *out, int n, int mode) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (mode == REDV4) {
        for (int r = 4 * threadIdx.x; r < n; r += 4 * blockDim.x) {
            const float4 x = *reinterpret_cast<const float4 *>(in + r);
            const float a = x.x * 1e-3f + blockIdx.x, b = x.y * 1e-3f, c = x.z * 1e-3f, d = x.w * 1e-3f;
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(out + r), "f"(a), "f"(b), "f"(c),
                         "f"(d)
                         : "memory");
        }
        return;
    }
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        const float v = in[r] * 1e-3f + blockIdx.x;
        if (mode == STORE) {
            out[MAXN + (size_t)blockIdx.x * n + r] = v;
        } else if (mode == RED64) {
            const long long q = __float2ll_rn(v * 4294967296.0f);
            asm volatile("red.global.add.u64 [%0], %1;" ::"l"(reinterpret_cast<unsigned long long *>(out) + r),
                         "l"(q)
                         : "memory");
        } else {
            asm volatile("red.global.add.f32 [%0], %1;" ::"l"(out + r), "f"(v) : "memory");
        }
    }
}

int main() {
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t words = MAXN * 2 + (size_t)MAXN * 2 * sms;  // accumulator (u64) + partials
    float *a, *b;
    CHECK(cudaMalloc(&a, words * sizeof(float)));
    CHECK(cudaMalloc(&b, words * sizeof(float)));
    CHECK(cudaMemset(a, 0, words * sizeof(float)));
    CHECK(cudaMemset(b, 0, words * sizeof(float)));
    std::printf("SMs %d, %d steps per graph, median of %d launches\n", sms, STEPS, REPS);
    const char *names[] = {"store", "red64", "redf32", "redv4"};
    const int ns[] = {576, 2048, 4096};
    const int grids[] = {sms / 2, 96, sms};
    for (int n : ns) {
        for (int g : grids) {
            for (int th : {128, 256}) {
                for (int mode = 0; mode < 4; ++mode) {
                    cudaGraph_t graph;
                    cudaGraphExec_t exec;
                    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                    for (int s = 0; s < STEPS; ++s)
                        launch(st, g, th, true, step, (const float *)(s % 2 ? b : a), s % 2 ? a : b, n, mode);
                    CHECK(cudaStreamEndCapture(st, &graph));
                    CHECK(cudaGraphInstantiate(&exec, graph, 0));
                    std::printf("n %4d  blocks %3d x %3d  %-6s %6.2f us per step (%d writes)\n", n, g, th, names[mode],
                                time_graph(exec, st, STEPS, REPS), n * g / (mode == REDV4 ? 4 : 1));
                    CHECK(cudaGraphExecDestroy(exec));
                    CHECK(cudaGraphDestroy(graph));
                }
            }
        }
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}
