// Can a few multiprocessors run a small model's decode layer? The questions behind a decode step
// for SmolLM2-135M that runs on one thread-block cluster instead of 132 multiprocessors
// (session 32): its layer's weights (7.1 MB) must stream into few multiprocessors fast enough,
// and the hops between its projections (every block needs the whole previous output) must cost
// less inside a cluster than a kernel boundary (~1 µs, boundary.cu) or a grid barrier
// (1.4-1.9 µs, boundary.cu).
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/cs scripts/microbench/cluster_stream.cu && /tmp/cs
//
// 1. stream: G blocks, one a multiprocessor (their shared memory keeps a second one out), read
//    a 512 MiB buffer once (each block a contiguous share) and sum it. `ring`: W warps a block,
//    each streaming its share through its own ring of `depth` slots filled by bulk copies
//    (cp.async.bulk, one mbarrier a slot; ring_stream.cu's pattern); `reg`: 1024 threads a
//    block, 8 16-byte loads a lane in flight. Printed: GB/s over all G and per multiprocessor.
//    1b: the ring configuration that streamed fastest, its G blocks launched as clusters of C
//    (a cluster's blocks share one GPC).
// 2. cluster barrier: C blocks of one cluster pass barrier.cluster arrive (release) + wait
//    (acquire) N times; µs a barrier (the median block's %globaltimer over N).
// 3. all-gather in a cluster: each of C blocks owns 576 / C floats of a 576-float vector (the
//    135M hidden size) and writes them into every block's shared memory with st.async (each
//    store completing its bytes on the target's mbarrier); each block waits for its mbarrier
//    (576 * 4 bytes), sums the vector and feeds the sum into its next slice, so the N rounds
//    form one dependent chain. Two buffers and two mbarriers alternate. µs a round.
// 4. the same all-gather through global memory over G blocks not in a cluster: each writes its
//    slice, then (one thread, after a fence) adds 1 to a counter with red.release.gpu; every
//    block polls the counter (ld.acquire.gpu) until all G slices of the round are counted, then
//    reads the vector through L2 (ld.global.cg). µs a round.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.cuh"
#include "timing.cuh"

constexpr size_t BYTES = size_t(512) << 20;
constexpr int HID = 576;
constexpr int ROUNDS = 2000;

__device__ __forceinline__ unsigned smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint64_t gtimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ float sum16(uint4 u) {
    return __uint_as_float(u.x) + __uint_as_float(u.y) + __uint_as_float(u.z) + __uint_as_float(u.w);
}

// ---- 1. streaming into G multiprocessors ----------------------------------------------------
__global__ void __launch_bounds__(1024) reg_stream(const uint4 *w, size_t per_block, float *out) {
    const uint4 *p = w + blockIdx.x * per_block;
    float s = 0.0f;
    for (size_t i = threadIdx.x; i < per_block; i += 8 * 1024) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = i + k * 1024 < per_block ? __ldg(p + i + k * 1024) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < 8; ++k) s += sum16(v[k]);
    }
    if (s == 1.2345f) out[blockIdx.x] = s;
}

__global__ void __launch_bounds__(1024) ring_stream(const uint4 *w, size_t per_block, float *out, int slot, int depth) {
    extern __shared__ __align__(128) uint4 ring[];
    __shared__ __align__(8) unsigned long long bars[32][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per_slot = slot / 16;
    const size_t per_warp = per_block / nw;
    const int total = (int)(per_warp / per_slot);
    const uint4 *src = w + blockIdx.x * per_block + warp * per_warp;
    const unsigned bar0 = smem_addr(&bars[warp][0]);
    const unsigned ring0 = smem_addr(ring) + warp * depth * slot;
    const uint4 *mine = ring + (size_t)warp * depth * per_slot;
    auto issue = [&](int i) {
        const int s = i % depth;
        bulk_load(ring0 + s * slot, src + (size_t)i * per_slot, slot, bar0 + 8 * s);
    };
    if (lane == 0) {
        mbar_init(bar0, depth);
        for (int i = 0; i < min(depth, total); ++i) issue(i);
    }
    __syncwarp();
    float acc = 0.0f;
    for (int i = 0; i < total; ++i) {
        const int s = i % depth;
        const unsigned bar = bar0 + 8 * s, parity = (i / depth) & 1;
        asm volatile("{\n\t.reg .pred p;\nW8:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra W8;\n}" ::"r"(bar),
                     "r"(parity)
                     : "memory");
        const uint4 *sl = mine + s * per_slot;
        for (int c = lane; c < per_slot; c += 32) acc += sum16(sl[c]);
        // The lanes' reads have returned before __syncwarp; a generic-proxy read before an
        // async-proxy refill would need fence.proxy.async in a kernel whose data matters (here
        // the data is constant and only summed).
        __syncwarp();
        if (lane == 0 && i + depth < total) issue(i + depth);
    }
    if (acc == 1.2345f) out[blockIdx.x * 32 + warp] = acc;
}

// ---- 2. cluster barrier ---------------------------------------------------------------------
__global__ void cluster_barrier(int n, unsigned long long *ns) {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    const uint64_t t0 = gtimer();
    for (int i = 0; i < n; ++i)
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    const uint64_t t1 = gtimer();
    if (threadIdx.x == 0) ns[blockIdx.x] = t1 - t0;
}

// ---- 3. all-gather inside a cluster (st.async into every block, mbarrier completion) --------
__global__ void cluster_allgather(int n, unsigned long long *ns, float *out) {
    __shared__ __align__(16) float buf[2][HID];
    __shared__ __align__(8) unsigned long long bar[2];
    __shared__ float total;
    unsigned rank, nb;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(nb));
    const int per = HID / (int)nb;
    if (threadIdx.x == 0) {
        for (int b = 0; b < 2; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[b])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        total = 0.0f;
    }
    // Every block's mbarriers are initialised before any block stores into another.
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    float carry = (float)rank;
    const uint64_t t0 = gtimer();
    for (int i = 0; i < n; ++i) {
        const int b = i & 1;
        const unsigned my_bar = smem_addr(&bar[b]);
        // Arm this round's phase: one arrival (this one) and every block's bytes. Another
        // block's bytes may land before it (the tx-count goes below zero until then); the phase
        // cannot complete before this arrival.
        if (threadIdx.x == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(my_bar), "r"(HID * 4) : "memory");
        // This block's slice into every block's buffer b (its own included).
        for (int k = threadIdx.x; k < per * (int)nb; k += blockDim.x) {
            const int dst = k / per, j = k % per;
            unsigned a, rb;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(&buf[b][rank * per + j])), "r"(dst));
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(my_bar), "r"(dst));
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(a),
                         "f"(carry + (float)j), "r"(rb)
                         : "memory");
        }
        unsigned done = 0;
        while (!done)
            asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                         "selp.u32 %0, 1, 0, p;\n\t}"
                         : "=r"(done)
                         : "r"(my_bar), "r"((unsigned)((i >> 1) & 1))
                         : "memory");
        // Use the vector: the first warp sums it (the next round's values depend on it).
        if (threadIdx.x < 32) {
            float s = 0.0f;
            for (int k = threadIdx.x; k < HID; k += 32) s += buf[b][k];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (threadIdx.x == 0) total = s;
        }
        __syncthreads();
        carry = total * 1e-30f;
    }
    const uint64_t t1 = gtimer();
    // No block exits while another may still store into its shared memory.
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (threadIdx.x == 0) {
        ns[blockIdx.x] = t1 - t0;
        if (carry == 1.2345f) out[blockIdx.x] = carry;
    }
}

// ---- 4. all-gather through global memory and a counter --------------------------------------
__global__ void global_allgather(int n, unsigned long long *ns, float *vec, unsigned *counter, float *out) {
    __shared__ float total;
    const int G = gridDim.x, per = (HID + G - 1) / G;
    float carry = (float)blockIdx.x;
    const uint64_t t0 = gtimer();
    for (int i = 0; i < n; ++i) {
        float *v = vec + (i & 1) * HID;
        for (int j = threadIdx.x; j < per && blockIdx.x * per + j < HID; j += blockDim.x) v[blockIdx.x * per + j] = carry + j;
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
            const unsigned want = (unsigned)(i + 1) * (unsigned)G;
            unsigned c = 0;
            do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counter) : "memory");
            while (c < want);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            float s = 0.0f;
            for (int k = threadIdx.x; k < HID; k += 32) s += __ldcg(v + k);
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (threadIdx.x == 0) total = s;
        }
        __syncthreads();
        carry = total * 1e-30f;
    }
    const uint64_t t1 = gtimer();
    if (threadIdx.x == 0) {
        ns[blockIdx.x] = t1 - t0;
        if (carry == 1.2345f) out[blockIdx.x] = carry;
    }
}

// The median block's ns over `blocks` entries, divided by ROUNDS, in µs.
double per_round_us(unsigned long long *d, int blocks) {
    std::vector<unsigned long long> h(blocks);
    CHECK(cudaMemcpy(h.data(), d, blocks * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    std::sort(h.begin(), h.end());
    return h[blocks / 2] / 1e3 / ROUNDS;
}

template <typename K, typename... A>
cudaError_t launch_cluster_smem(K kernel, int blocks, int cluster, int threads, int smem, A... args) {
    cudaLaunchAttribute at;
    const cudaLaunchConfig_t cfg = cluster_config(at, blocks, cluster, threads, smem);
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}
template <typename K, typename... A> cudaError_t launch_cluster(K kernel, int blocks, int cluster, int threads, A... args) {
    return launch_cluster_smem(kernel, blocks, cluster, threads, 0, args...);
}

int main() {
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint4 *w;
    float *out, *vec;
    unsigned long long *ns;
    unsigned *counter;
    CHECK(cudaMalloc(&w, BYTES));
    CHECK(cudaMemset(w, 0, BYTES));
    CHECK(cudaMalloc(&out, 1 << 20));
    CHECK(cudaMalloc(&vec, 2 * HID * sizeof(float)));
    CHECK(cudaMalloc(&ns, 1024 * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&counter, sizeof(unsigned)));
    const size_t n16 = BYTES / 16;

    // 1. streaming
    const int smem_max = 200 * 1024;
    CHECK(cudaFuncSetAttribute(ring_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
    CHECK(cudaFuncSetAttribute(reg_stream, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    struct Ring {
        int warps, slot, depth;
    };
    const Ring rings[] = {{4, 8192, 4}, {4, 8192, 6}, {8, 8192, 3}, {4, 16384, 3}, {8, 4096, 6}, {16, 4096, 3}};
    for (int G : {8, 16, 32, 66, 132}) {
        if (G > sms) continue;
        const size_t per_block = n16 / G;
        // reg: 1024 threads and 100 KB of static-free dynamic shared memory keep one block a multiprocessor.
        float ms = median_ms([&] { reg_stream<<<G, 1024>>>(w, per_block, out); });
        double gbs = per_block * G * 16.0 / (ms * 1e-3) / 1e9;
        std::printf("stream reg  G=%3d 1024 thr, 8 loads a lane: %6.0f GB/s, %5.1f GB/s a multiprocessor\n", G, gbs, gbs / G);
        for (const Ring &r : rings) {
            const int smem = r.warps * r.depth * r.slot;
            if (smem > smem_max) continue;
            // Whole slots for every warp.
            const size_t unit = (size_t)r.warps * (r.slot / 16);
            const size_t pb = per_block / unit * unit;
            ms = median_ms([&] { ring_stream<<<G, 32 * r.warps, smem>>>(w, pb, out, r.slot, r.depth); });
            gbs = pb * G * 16.0 / (ms * 1e-3) / 1e9;
            std::printf("stream ring G=%3d %2d warps x %2d x %5d B (%3d KiB in flight): %6.0f GB/s, %5.1f GB/s a multiprocessor\n", G,
                        r.warps, r.depth, r.slot, smem / 1024, gbs, gbs / G);
        }
    }

    // How many clusters of C blocks (1024 threads, 192 KiB of shared memory each: a whole
    // multiprocessor) the GPU can hold at once.
    CHECK(cudaFuncSetAttribute(ring_stream, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    for (int C : {8, 16}) {
        cudaLaunchAttribute at;
        const cudaLaunchConfig_t cfg = cluster_config(at, C, C, 1024, 192 * 1024);
        int n = -1;
        cudaError_t e = cudaOccupancyMaxActiveClusters(&n, ring_stream, &cfg);
        std::printf("clusters of %2d whole-multiprocessor blocks at once: %d (%s)\n", C, n, cudaGetErrorString(e));
        (void)cudaGetLastError();
    }

    // 1b. The same ring streaming, the blocks launched as clusters: a cluster's blocks run on
    // one GPC (session 32: a layer loop on one 16-block cluster streamed ~0.3 TB/s).
    for (int G : {16, 32, 64, 128}) {
        for (int C : {1, 2, 4, 8, 16}) {
            if (G % C) continue;
            const Ring r = {16, 4096, 3};
            const int smem = r.warps * r.depth * r.slot;
            const size_t unit = (size_t)r.warps * (r.slot / 16);
            const size_t pb = n16 / G / unit * unit;
            cudaError_t err = cudaSuccess;
            float ms = median_ms([&] { err = launch_cluster_smem(ring_stream, G, C, 32 * r.warps, smem, (const uint4 *)w, pb, out, r.slot, r.depth); });
            if (err != cudaSuccess) {
                std::printf("stream ring G=%3d as clusters of %2d: %s\n", G, C, cudaGetErrorString(err));
                continue;
            }
            const double gbs = pb * G * 16.0 / (ms * 1e-3) / 1e9;
            std::printf("stream ring G=%3d as clusters of %2d, 16 warps x 3 x 4096 B: %6.0f GB/s, %5.1f GB/s a multiprocessor\n", G, C, gbs,
                        gbs / G);
        }
    }

    // 2-3. cluster barrier and all-gather, clusters of 2..16 (16 is non-portable).
    CHECK(cudaFuncSetAttribute(cluster_barrier, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CHECK(cudaFuncSetAttribute(cluster_allgather, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    // One cluster of C blocks running `kernel`; prints the median block's µs a round.
    auto per_round = [&](const char *what, cudaError_t e, int C, int threads) {
        if (e != cudaSuccess) {
            std::printf("%s C=%2d: launch failed: %s\n", what, C, cudaGetErrorString(e));
            (void)cudaGetLastError();
            return false;
        }
        CHECK(cudaDeviceSynchronize());
        std::printf("%s C=%2d %3d thr: %.3f us a round\n", what, C, threads, per_round_us(ns, C));
        return true;
    };
    for (int C : {2, 4, 8, 16}) {
        for (int threads : {128, 512}) {
            if (!per_round("cluster barrier   ", launch_cluster(cluster_barrier, C, C, threads, ROUNDS, ns), C, threads)) continue;
            per_round("cluster all-gather (576 floats)", launch_cluster(cluster_allgather, C, C, threads, ROUNDS, ns, out), C, threads);
        }
    }
    // 4. the global all-gather over G co-resident blocks.
    for (int G : {16, 66, 132}) {
        for (int threads : {128, 512}) {
            CHECK(cudaMemset(counter, 0, sizeof(unsigned)));
            global_allgather<<<G, threads>>>(ROUNDS, ns, vec, counter, out);
            CHECK(cudaDeviceSynchronize());
            std::printf("global all-gather G=%3d %3d thr: %.3f us a round (576 floats)\n", G, threads, per_round_us(ns, G));
        }
    }
    return 0;
}
