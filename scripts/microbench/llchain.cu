// Can consecutive decode kernels hand their outputs on through flagged words instead of the
// programmatic-launch wait? Session 36 measured that hand-off inside one persistent kernel
// (persistent_layers.cu: ~1.5 us an all-to-all hand-off, more than a kernel boundary); this
// file measures it between ordinary kernels of one graph, where nothing else changes: each
// step is still its own launch with programmatic dependent launch (so its blocks are resident
// before the previous kernel ends), but instead of `griddepcontrol.wait` (which returns once
// the whole previous grid has completed and flushed) it polls its input words until they carry
// this launch's flag. What it can save is the grid-completion latency after the previous
// kernel's last store (0.45-0.65 us a boundary in session 26's phase stamps), five boundaries a
// layer.
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/ll scripts/microbench/llchain.cu && /tmp/ll
//
// Every step is a GEMV's tail on a 576-element vector (SmolLM2-135M's hidden size): each warp
// reads the whole input (one round trip: every lane's chunks issued together), folds it into
// one value (a warp sum), and the warps store the 576 outputs round robin (warp w stores rows
// w, w + W, ... of the W warps of the launch), so every output has one writer and every
// consumer warp needs every writer: an all-to-all hand-off, as between two GEMVs of a layer.
// STEPS such steps are captured into one graph; each figure is the graph's time divided by
// STEPS, the median of REPS replays (graph.cuh).
//
// Hand-offs:
// - pdl:       the baseline, ferrum's today: griddepcontrol.wait, launch_dependents, the body
//              on plain f32 (ping-pong buffers);
// - ll:        the input as NCCL "LL" words (f32 value, u32 flag) written by one 8-byte store
//              each, so a reader that sees the flag sees the value (single-copy atomicity of an
//              aligned 8-byte access; no fence, no separate flag); the consumer polls its words
//              (all of a lane's loads issued together, again until every word in the warp is
//              current), then launch_dependents, the body, the LL stores; no grid wait;
// - ll+tail:   ll, and griddepcontrol.wait at the very end (before exit), so a kernel completes
//              only after its predecessor has: the transitive completion that the engine's
//              early loads rely on ("when a kernel starts, every kernel before the one it
//              depends on has completed") is kept at the cost of this wait, off the chain;
// - ll-block:  ll with one polling warp a block: warp 0 polls the words, puts the values in
//              shared memory, a block barrier, then every warp reads them there (a block's
//              polling traffic divided by its warps: is it the polls' L2 traffic that costs?);
// - ll-early:  launch_dependents first, then the poll (successors become resident as soon as
//              every block of this kernel has started; no deadlock: a kernel is launched only
//              once every block of its predecessor is resident, so a polling block never
//              keeps a producer block from running).
// Flags: step s writes its own buffer (STEPS + 1 of them), flagged with the replay's
// generation, which a one-thread kernel at the end of the graph increments (a plain launch:
// it runs after the last step has completed, and the next replay's kernels run after it). So
// a word is current only if this replay wrote it; no buffer is ever cleared. A plain kernel
// at the start of the graph writes buffer 0.
//
// The weights variant loads two 16-byte weight chunks a thread before the wait or the poll
// (from DRAM: a new region each step), as ferrum's GEMVs do before theirs.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "check.cuh"
#include "graph.cuh"

constexpr int N = 576;
constexpr int STEPS = 300;
constexpr int REPS = 15;
// A lane's share of the input: 576 values = 144 float4 = 288 LL pairs of 16 bytes.
constexpr int F4 = N / 4;    // float4 chunks of the plain input
constexpr int P16 = N / 2;   // 16-byte LL chunks (two words each)
constexpr int F4_PER_LANE = (F4 + 31) / 32;    // 5
constexpr int P16_PER_LANE = (P16 + 31) / 32;  // 9
// A poll that never sees its flags gives up after this long, raises the error word and goes on
// with whatever it read, and every later poll gives up at once (a bug in the benchmark must
// not hang the GPU machine; the table marks the run).
constexpr unsigned long long POLL_TIMEOUT_NS = 20000000ull;

enum Mode { PDL = 0, LL = 1, LL_TAIL = 2, LL_BLOCK = 3, LL_EARLY = 4 };
constexpr int MODES = 5;
const char *mode_names[MODES] = {"pdl", "ll", "ll+tail", "ll-block", "ll-early"};

__device__ __forceinline__ uint4 ld_volatile16(const uint4 *p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ void st_ll(uint2 *p, float v, uint32_t flag) {
    asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(__float_as_uint(v)), "r"(flag)
                 : "memory");
}

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Two 16-byte weight chunks a thread, before the wait (as weights_step in boundary.cu).
__device__ __forceinline__ void load_weights(const uint4 *w, uint4 &a, uint4 &b) {
    const int gt = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w)
                 : "l"(w + gt));
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w)
                 : "l"(w + nt + gt));
}

// The stores of a step's outputs: warp gw of W stores rows gw, gw + W, ...
template <bool LLOUT>
__device__ __forceinline__ void store_rows(float v, void *out, uint32_t flag) {
    const int lane = threadIdx.x & 31;
    const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, W = (gridDim.x * blockDim.x) >> 5;
    if (lane != 0) return;
    for (int r = gw; r < N; r += W) {
        const float o = v * 1e-3f + (float)r;
        if (LLOUT) {
            st_ll(reinterpret_cast<uint2 *>(out) + r, o, flag);
        } else {
            reinterpret_cast<float *>(out)[r] = o;
        }
    }
}

__global__ void pdl_step(const float *in, float *out, const uint4 *w, int weights) {
    uint4 a = {}, b = {};
    if (weights) load_weights(w, a, b);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int lane = threadIdx.x & 31;
    const float4 *in4 = reinterpret_cast<const float4 *>(in);
    float4 x[F4_PER_LANE];
#pragma unroll
    for (int j = 0; j < F4_PER_LANE; ++j) {
        const int c = lane + 32 * j;
        x[j] = c < F4 ? in4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float v = __uint_as_float(a.x ^ b.x) * 1e-30f;
#pragma unroll
    for (int j = 0; j < F4_PER_LANE; ++j) v += x[j].x + x[j].y + x[j].z + x[j].w;
    v = warp_sum(v);
    store_rows<false>(v, out, 0);
}

template <int MODE>
__global__ void ll_step(const uint4 *in, uint2 *out, const uint4 *w, int weights, const uint32_t *gen,
                        uint32_t *err) {
    uint4 a = {}, b = {};
    if (weights) load_weights(w, a, b);
    const uint32_t flag = *gen;  // written by the previous replay's last kernel: stable here
    if (MODE == LL_EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4 x[P16_PER_LANE];
    __shared__ uint4 s_x[MODE == LL_BLOCK ? P16_PER_LANE * 32 : 1];
    unsigned polls = 0;
    unsigned long long t0 = 0;
    for (;;) {
        if (MODE == LL_BLOCK && warp != 0) break;
#pragma unroll
        for (int j = 0; j < P16_PER_LANE; ++j) {
            const int c = lane + 32 * j;
            x[j] = c < P16 ? ld_volatile16(in + c) : make_uint4(0u, flag, 0u, flag);
        }
        bool ok = true;
#pragma unroll
        for (int j = 0; j < P16_PER_LANE; ++j) ok = ok && x[j].y == flag && x[j].w == flag;
        if (__all_sync(0xffffffffu, ok)) break;
        if ((++polls & 1023u) == 0) {  // now and then: the error word, the clock
            const unsigned long long t = now_ns();
            if (t0 == 0) t0 = t;
            const bool give_up = *(volatile uint32_t *)err != 0 || t - t0 > POLL_TIMEOUT_NS;
            if (__any_sync(0xffffffffu, give_up)) {  // warp-uniform; the data is then garbage
                if (lane == 0) atomicExch(err, 1u);
                break;
            }
        }
    }
    if (MODE == LL_BLOCK) {
        if (warp == 0) {
#pragma unroll
            for (int j = 0; j < P16_PER_LANE; ++j) s_x[lane + 32 * j] = x[j];
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < P16_PER_LANE; ++j) x[j] = s_x[lane + 32 * j];
    }
    if (MODE != LL_EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    float v = __uint_as_float(a.x ^ b.x) * 1e-30f;
#pragma unroll
    for (int j = 0; j < P16_PER_LANE; ++j) v += __uint_as_float(x[j].x) + __uint_as_float(x[j].z);
    v = warp_sum(v);
    store_rows<true>(v, out, flag);
    if (MODE == LL_TAIL) asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The plain chain's first input (the LL chain's buffer 0 holds the same values).
__global__ void pdl_init(float *buf) {
    for (int r = threadIdx.x; r < N; r += blockDim.x) buf[r] = (float)r;
}
// Buffer 0 of the LL chain, flagged with this replay's generation.
__global__ void ll_init(uint2 *buf, const uint32_t *gen) {
    for (int r = threadIdx.x; r < N; r += blockDim.x) st_ll(buf + r, (float)r, *gen);
}
__global__ void ll_next_gen(uint32_t *gen) { *gen += 1; }

// One graph of STEPS steps of (mode, shape), timed; for LL modes, checks the last buffer's
// values against the plain chain's (the same sums in another grouping: within 1e-5).
static float run(int mode, int g, int th, int weights, cudaStream_t st, float *pa, float *pb, uint2 *ll,
                 uint32_t *gen, uint32_t *err, const uint4 *w, size_t wregion) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    if (mode == PDL) {
        pdl_init<<<1, 256, 0, st>>>(pa);
        CHECK(cudaGetLastError());
        for (int s = 0; s < STEPS; ++s)
            launch(st, g, th, true, pdl_step, (const float *)(s % 2 ? pb : pa), s % 2 ? pa : pb,
                   w + (weights ? (size_t)s * wregion : 0), weights);
    } else {
        ll_init<<<1, 256, 0, st>>>(ll, gen);
        CHECK(cudaGetLastError());
        for (int s = 0; s < STEPS; ++s) {
            const uint4 *in = reinterpret_cast<const uint4 *>(ll + (size_t)s * N);
            uint2 *out = ll + (size_t)(s + 1) * N;
            const uint4 *ws = w + (weights ? (size_t)s * wregion : 0);
            if (mode == LL) launch(st, g, th, true, ll_step<LL>, in, out, ws, weights, (const uint32_t *)gen, err);
            if (mode == LL_TAIL)
                launch(st, g, th, true, ll_step<LL_TAIL>, in, out, ws, weights, (const uint32_t *)gen, err);
            if (mode == LL_BLOCK)
                launch(st, g, th, true, ll_step<LL_BLOCK>, in, out, ws, weights, (const uint32_t *)gen, err);
            if (mode == LL_EARLY)
                launch(st, g, th, true, ll_step<LL_EARLY>, in, out, ws, weights, (const uint32_t *)gen, err);
        }
        ll_next_gen<<<1, 1, 0, st>>>(gen);
        CHECK(cudaGetLastError());
    }
    CHECK(cudaStreamEndCapture(st, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const float us = time_graph(exec, st, STEPS, REPS);
    CHECK(cudaStreamSynchronize(st));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return us;
}

int main() {
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *pa, *pb;
    uint2 *ll;
    uint32_t *gen, *err;
    CHECK(cudaMalloc(&pa, N * sizeof(float)));
    CHECK(cudaMalloc(&pb, N * sizeof(float)));
    CHECK(cudaMalloc(&ll, (size_t)(STEPS + 1) * N * sizeof(uint2)));
    CHECK(cudaMalloc(&gen, sizeof(uint32_t)));
    CHECK(cudaMalloc(&err, sizeof(uint32_t)));
    CHECK(cudaMemset(ll, 0, (size_t)(STEPS + 1) * N * sizeof(uint2)));
    const uint32_t one = 1;
    CHECK(cudaMemcpy(gen, &one, sizeof one, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(err, 0, sizeof(uint32_t)));
    // Weights: a region of two chunks a thread per step, for the largest grid.
    const int shapes[][2] = {{36, 256}, {72, 256}, {144, 128}, {sms, 256}, {2 * sms, 256}, {4 * sms, 256}};
    size_t wregion = 0;
    for (auto &s : shapes) wregion = std::max(wregion, (size_t)s[0] * s[1] * 2);
    uint4 *w;
    CHECK(cudaMalloc(&w, wregion * STEPS * sizeof(uint4)));
    CHECK(cudaMemset(w, 0, wregion * STEPS * sizeof(uint4)));
    std::printf("SMs %d, %d steps a graph, median of %d replays; us a step (576-value all-to-all hand-off)\n", sms,
                STEPS, REPS);
    std::printf("%-10s %-8s", "blocks", "weights");
    for (const char *m : mode_names) std::printf(" %9s", m);
    std::printf("\n");
    for (int weights = 0; weights < 2; ++weights) {
        for (auto &s : shapes) {
            const int g = s[0], th = s[1];
            char shape[32];
            std::snprintf(shape, sizeof shape, "%dx%d", g, th);
            std::printf("%-10s %-8s", shape, weights ? "dram" : "none");
            float ref[N];
            for (int mode = 0; mode < MODES; ++mode) {
                const float us = run(mode, g, th, weights, st, pa, pb, ll, gen, err, w, wregion);
                uint32_t e = 0;
                CHECK(cudaMemcpy(&e, err, sizeof e, cudaMemcpyDeviceToHost));
                // The last step's outputs: the plain chain's are the reference.
                float got[N];
                if (mode == PDL) {
                    CHECK(cudaMemcpy(ref, (STEPS - 1) % 2 ? pa : pb, sizeof ref, cudaMemcpyDeviceToHost));
                } else {
                    uint2 words[N];
                    CHECK(cudaMemcpy(words, ll + (size_t)STEPS * N, sizeof words, cudaMemcpyDeviceToHost));
                    for (int r = 0; r < N; ++r) std::memcpy(&got[r], &words[r].x, sizeof(float));
                }
                int bad = 0;
                if (mode != PDL)
                    for (int r = 0; r < N; ++r) bad += !(std::fabs(got[r] - ref[r]) <= 1e-5f * std::fabs(ref[r]));
                std::printf(" %9.3f%s", us, e ? "!T" : bad ? "!V" : "");
                if (e) CHECK(cudaMemset(err, 0, sizeof(uint32_t)));
            }
            std::printf("\n");
        }
    }
    std::printf("(!T: a poll timed out; !V: the last outputs differ from the plain chain's by more than 1e-5)\n");
    CHECK(cudaDeviceSynchronize());
    return 0;
}
