// How fast one H200 streams weights through a shared-memory ring filled by bulk copies
// (sm_90's cp.async.bulk, a warp's own ring of `depth` slots, one mbarrier a slot) against
// register loads: the question behind session 23's ring GEMV, which ran the 8B decode at 80 tok/s
// (the register GEMV: 263) with four warps a multiprocessor.
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/ring scripts/microbench/ring_stream.cu && /tmp/ring
//
// Every kernel reads the same 1 GiB of bf16 once and sums it (each warp stores its sum, so
// nothing is dead); a figure is GB/s over the median of 7 launches (timing.cuh):
// - reg:  grid-stride 16-byte loads, UNROLL in flight a lane (the register GEMV's pattern),
//         blocks of 256 threads, 8 a multiprocessor;
// - ring: one block a multiprocessor (or two) of W warps, each warp streaming its own
//         contiguous share through `depth` slots of S bytes (one bulk copy a slot), the lanes
//         summing a slot from shared memory before lane 0 refills it;
// - ring+x: the same, each 16-byte chunk also multiplied by 8 floats of an x vector read with
//         __ldg (the GEMV's input, 4096 floats, as the ring GEMV's lanes read it);
// - ring+xs: x copied into shared memory once a block, four chunks a lane loaded (weights and
//         x) before their FMAs;
// - ring+gv: GEMV-like: an 8 KiB slot is two rows' 2048-column stripe of a 4096-column matrix,
//         each lane's 16 weight chunks loaded from the slot at once, x from shared memory, two
//         accumulators of 8 sequential fmaf a chunk (the ring GEMV's arithmetic).
// Results (H200, session 23): docs/bench/2026-12-01-session23/ring-stream.txt (this version
// printed its call-4b lines; calls 3 and 4 ran earlier versions) and docs/PERF.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.cuh"
#include "timing.cuh"

constexpr size_t BYTES = size_t(1) << 30;

__device__ __forceinline__ float sum8(uint4 u) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        s += t.x + t.y;
    }
    return s;
}
__device__ __forceinline__ float dot8(uint4 u, const float4 *x, int c) {
    const float4 a = __ldg(x + 2 * c), b = __ldg(x + 2 * c + 1);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
    float2 t0 = __bfloat1622float2(h[0]), t1 = __bfloat1622float2(h[1]);
    float2 t2 = __bfloat1622float2(h[2]), t3 = __bfloat1622float2(h[3]);
    return t0.x * a.x + t0.y * a.y + t1.x * a.z + t1.y * a.w + t2.x * b.x + t2.y * b.y + t3.x * b.z + t3.y * b.w;
}

template <int UNROLL> __global__ void __launch_bounds__(256) reg_stream(const uint4 *w, size_t n16, float *out) {
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, nt = (size_t)gridDim.x * blockDim.x;
    float s = 0.0f;
    for (size_t i = tid; i < n16; i += nt * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) v[k] = i + k * nt < n16 ? __ldg(w + i + k * nt) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) s += sum8(v[k]);
    }
    if (s == 1.2345f) out[tid] = s;
}

__device__ __forceinline__ unsigned smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

template <int MODE>  // 0: sum the weights, 1: times x read with __ldg, 2: times x staged in shared memory,
                    // 3: GEMV-like (a slot is two rows' 2048-column stripe, x staged in shared memory)
__global__ void __launch_bounds__(512) ring_stream(const uint4 *w, size_t n16, float *out, int slot, int depth,
                                                   const float4 *x, int cols8) {
    extern __shared__ __align__(128) uint4 ring[];
    __shared__ __align__(16) float4 xs[2 * 4096 / 8];
    __shared__ __align__(8) unsigned long long bars[16][16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const size_t gw = blockIdx.x * (size_t)nw + warp, W = (size_t)gridDim.x * nw;
    const size_t per = n16 / W, first = gw * per;  // this warp's chunks (n16 a multiple of W here)
    const int per_slot = slot / 16;
    const int total = (int)(per / per_slot);
    const unsigned bar0 = smem_addr(&bars[warp][0]);
    const unsigned ring0 = smem_addr(ring) + warp * depth * slot;
    const uint4 *mine = ring + (size_t)warp * depth * per_slot;
    auto issue = [&](int i) {
        const int s = i % depth;
        bulk_load(ring0 + s * slot, w + first + (size_t)i * per_slot, slot, bar0 + 8 * s);
    };
    if (lane == 0) {
        mbar_init(bar0, depth);
        for (int i = 0; i < min(depth, total); ++i) issue(i);
    }
    __syncwarp();
    if (MODE >= 2) {
        for (int k = threadIdx.x; k < 2 * cols8; k += blockDim.x) xs[k] = x[k];
        __syncthreads();
    }
    float acc = 0.0f;
    for (int i = 0; i < total; ++i) {
        const int s = i % depth;
        const unsigned bar = bar0 + 8 * s, parity = (i / depth) & 1;
        asm volatile(
            "{\n\t.reg .pred p;\nW8:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra W8;\n}" ::"r"(bar),
            "r"(parity)
            : "memory");
        const uint4 *sl = mine + s * per_slot;
        if (MODE == 3) {
            // Slot i read as a two-row tile of a 4096-column matrix: rows 2 floor(i / 2) and the
            // next, columns (i % 2) * 2048 ..: 256 chunks a row, 8 a lane; both rows share each x
            // chunk; 8 sequential fmaf a row and chunk.
            const int c0 = (i & 1) * 256;
            float a0 = 0.0f, a1 = 0.0f;
            uint4 w0[8], w1[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                w0[u] = sl[32 * u + lane];
                w1[u] = sl[256 + 32 * u + lane];
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int c = c0 + 32 * u + lane;
                const float4 xa = xs[2 * c], xb = xs[2 * c + 1];
                const float xf[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                const __nv_bfloat162 *h0 = reinterpret_cast<const __nv_bfloat162 *>(&w0[u]);
                const __nv_bfloat162 *h1 = reinterpret_cast<const __nv_bfloat162 *>(&w1[u]);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float2 t0 = __bfloat1622float2(h0[k]), t1 = __bfloat1622float2(h1[k]);
                    a0 = fmaf(t0.x, xf[2 * k], a0);
                    a0 = fmaf(t0.y, xf[2 * k + 1], a0);
                    a1 = fmaf(t1.x, xf[2 * k], a1);
                    a1 = fmaf(t1.y, xf[2 * k + 1], a1);
                }
            }
            acc += a0 + a1;
        } else if (MODE == 2) {
            // Four chunks a lane at a time, every load of them issued before the first FMA.
            const int base = (int)((first + (size_t)i * per_slot) % cols8);
            for (int c = lane; c < per_slot; c += 128) {
                uint4 wv[4];
                float4 xa[4], xb[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int cc = c + 32 * u, xc = (base + cc) % cols8;
                    wv[u] = cc < per_slot ? sl[cc] : make_uint4(0, 0, 0, 0);
                    xa[u] = xs[2 * xc];
                    xb[u] = xs[2 * xc + 1];
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&wv[u]);
                    float2 t0 = __bfloat1622float2(h[0]), t1 = __bfloat1622float2(h[1]);
                    float2 t2 = __bfloat1622float2(h[2]), t3 = __bfloat1622float2(h[3]);
                    acc += t0.x * xa[u].x + t0.y * xa[u].y + t1.x * xa[u].z + t1.y * xa[u].w + t2.x * xb[u].x +
                           t2.y * xb[u].y + t3.x * xb[u].z + t3.y * xb[u].w;
                }
            }
        } else {
            for (int c = lane; c < per_slot; c += 32) {
                if (MODE == 1)
                    acc += dot8(sl[c], x, (int)((first + (size_t)i * per_slot + c) % cols8));
                else
                    acc += sum8(sl[c]);
            }
        }
        // The lanes' reads of the slot have returned (their values are in registers) before
        // __syncwarp. No fence.proxy.async orders them before the refill's async-proxy writes,
        // which the PTX memory model asks for: a measurement shortcut (the data is constant and
        // never checked); ferrum's kernels would need it.
        __syncwarp();
        if (lane == 0 && i + depth < total) issue(i + depth);
    }
    if (acc == 1.2345f) out[gw] = acc;
}

int main() {
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint4 *w;
    float *out, *x;
    CHECK(cudaMalloc(&w, BYTES));
    CHECK(cudaMemset(w, 0x3c, BYTES));
    CHECK(cudaMalloc(&out, 1 << 24));
    CHECK(cudaMalloc(&x, 14336 * 4));
    CHECK(cudaMemset(x, 0, 14336 * 4));
    const size_t n16 = BYTES / 16;
    auto gbs = [](float ms) { return BYTES / (ms * 1e-3) / 1e9; };
    std::printf("reg  8 blocks x 256 a multiprocessor, 8 loads a lane: %.0f GB/s\n",
                gbs(median_ms([&] { reg_stream<8><<<sms * 8, 256>>>(w, n16, out); })));
    std::printf("reg  8 blocks x 256 a multiprocessor, 4 loads a lane: %.0f GB/s\n",
                gbs(median_ms([&] { reg_stream<4><<<sms * 8, 256>>>(w, n16, out); })));
    std::printf("reg  2 blocks x 256 a multiprocessor, 8 loads a lane: %.0f GB/s\n",
                gbs(median_ms([&] { reg_stream<8><<<sms * 2, 256>>>(w, n16, out); })));
    CHECK(cudaFuncSetAttribute(ring_stream<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, 180 * 1024));
    CHECK(cudaFuncSetAttribute(ring_stream<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, 180 * 1024));
    CHECK(cudaFuncSetAttribute(ring_stream<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 180 * 1024));
    CHECK(cudaFuncSetAttribute(ring_stream<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 180 * 1024));
    struct Cfg {
        int bps, warps, slot, depth;
    };
    const Cfg cfgs[] = {{1, 4, 4096, 4}, {1, 4, 8192, 2}, {1, 4, 8192, 3}, {1, 4, 8192, 4}, {1, 4, 16384, 2},
                        {1, 8, 4096, 2}, {1, 8, 8192, 2}, {1, 16, 4096, 2}, {2, 4, 8192, 2}, {1, 2, 16384, 2},
                        {1, 2, 8192, 4}, {1, 6, 8192, 2}, {2, 2, 8192, 2}};
    for (int mode : {0, 1, 2, 3}) {
        const bool withx = mode != 0;
        for (const Cfg &c : cfgs) {
            if (mode == 3 && c.slot != 8192) continue;  // the GEMV-like slot: two rows of 4 KiB
            const int blocks = sms * c.bps, smem = c.warps * c.depth * c.slot;
            // Whole slots for every warp: trim the buffer to a multiple of warps x slot.
            const size_t unit = (size_t)blocks * c.warps * (c.slot / 16);
            const size_t n = n16 / unit * unit;
            float ms = median_ms([&] {
                const float4 *x4 = reinterpret_cast<float4 *>(x);
                if (mode == 3)
                    ring_stream<3><<<blocks, 32 * c.warps, smem>>>(w, n, out, c.slot, c.depth, x4, 4096 / 8);
                else if (mode == 2)
                    ring_stream<2><<<blocks, 32 * c.warps, smem>>>(w, n, out, c.slot, c.depth, x4, 4096 / 8);
                else if (mode == 1)
                    ring_stream<1><<<blocks, 32 * c.warps, smem>>>(w, n, out, c.slot, c.depth, x4, 4096 / 8);
                else
                    ring_stream<0><<<blocks, 32 * c.warps, smem>>>(w, n, out, c.slot, c.depth, x4, 1);
            });
            std::printf("ring%s %d block(s) x %2d warps, %5d-byte slots x %d (%3d KiB a block): %.0f GB/s\n",
                        mode == 3 ? "+gv" : mode == 2 ? "+xs" : withx ? "+x " : "   ", c.bps, c.warps, c.slot, c.depth, smem / 1024,
                        (n * 16) / (ms * 1e-3) / 1e9);
        }
    }
    return 0;
}
