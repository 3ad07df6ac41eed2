// A SmolLM2-135M decode layer's projections on one thread-block cluster (session 32): how long
// does a layer of four GEMVs take when C blocks (one a multiprocessor) stream every weight
// through shared-memory rings and hand each projection's output to the next through
// distributed shared memory, instead of 132 multiprocessors and a kernel boundary a projection?
// (cluster_stream.cu measured the parts: 16 multiprocessors stream 1.74 TB/s, a cluster barrier
// costs 0.18 µs, an all-gather of 576 floats 0.7 µs, a global-memory one 2.0 µs.)
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/cl scripts/microbench/cluster_layer.cu && /tmp/cl
//
// One kernel runs L layers, each: qkv = Wqkv RMSNorm(xa) (Q rows), xb = xa + Wo qkv[0..H) (the
// attention left out: o reads the first H outputs of qkv), g|u = Wg|Wu RMSNorm(xb), h = SiLU(g)
// u, xa = xb + Wd h; H = 576, Q = 960, I = 1536 (SmolLM2-135M), bf16 weights (213 MB for 30
// layers: more than the L2, so every launch reads them from memory), f32 activations. Block b
// of the cluster owns rows [b R / C, (b + 1) R / C) of every matrix, and its warp w a
// contiguous 1/WARPS of them. Each warp streams its rows, in the order it computes them across
// all layers, through its own ring of RING bytes (cp.async.bulk copies of up to CHUNK bytes of
// whole rows, one mbarrier a copy; lane 0 refills as copies are consumed), so loads run ahead
// across projections and layers, bounded by the ring. Each output value goes to every block's
// copy of the next input with st.async (lane j to block j), completing its bytes on that
// block's mbarrier for the buffer; a warp waits on it before the projection that reads the
// buffer. The result is checked against a double-precision host reference.
//
// The template's other switches are the variants session 32 measured (all slower than hoped:
// docs/PERF.md, "SmolLM2-135M's four projections on one 16-block cluster"): MODE 1 drops the
// hand-off (timing only), PACKED reads each warp's copies from its own contiguous region
// (timing only), SLOTS puts one copy in each fixed slot instead of a byte ring, SPLIT_ACC sums
// a row's products in independent partial sums; CC and TIMERS were added after the session's
// device time was spent (see the kernel) and run in session 33 (call 1: 56-68% of the warps'
// cycles in the dot products, 3% waiting for copies; its successor with tensor-core dot products
// is cluster_mma.cu). main() runs that set; the sets measured in session 32 are in its call logs
// (docs/bench/2026-12-02-session32/, the last in call15-committed-microbench.txt).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "check.cuh"
#include "smollm_layers.cuh"
#include "timing.cuh"

constexpr int M = 32;  // row slots (mbarriers) a warp
constexpr int TL = 10;  // the layer whose op times block 0's thread 0 records

struct Weights {
    const __nv_bfloat16 *qkv, *o, *g, *u, *d;  // [L][rows][cols]
};

__device__ __forceinline__ float dot8(uint4 w, const float *x) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&w);
    const float4 a = *reinterpret_cast<const float4 *>(x), b = *reinterpret_cast<const float4 *>(x + 4);
    const float2 t0 = __bfloat1622float2(h[0]), t1 = __bfloat1622float2(h[1]);
    const float2 t2 = __bfloat1622float2(h[2]), t3 = __bfloat1622float2(h[3]);
    return t0.x * a.x + t0.y * a.y + t1.x * a.z + t1.y * a.w + t2.x * b.x + t2.y * b.y + t3.x * b.z + t3.y * b.w;
}
// dot8 as two independent halves (four FMAs each).
__device__ __forceinline__ void dot8x2(uint4 w, const float *x, float &lo, float &hi) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&w);
    const float4 a = *reinterpret_cast<const float4 *>(x), b = *reinterpret_cast<const float4 *>(x + 4);
    const float2 t0 = __bfloat1622float2(h[0]), t1 = __bfloat1622float2(h[1]);
    const float2 t2 = __bfloat1622float2(h[2]), t3 = __bfloat1622float2(h[3]);
    lo = fmaf(t0.x, a.x, fmaf(t0.y, a.y, fmaf(t1.x, a.z, t1.y * a.w)));
    hi = fmaf(t2.x, b.x, fmaf(t2.y, b.y, fmaf(t3.x, b.z, t3.y * b.w)));
}
// The bytes of one bulk copy at most: a copy moves whole consecutive rows of one matrix, so a
// warp's rows arrive in few copies (one copy a row ran at ~16 GB/s a multiprocessor: session
// 32, call 6).
__device__ __forceinline__ int op_rows(int op) { return op == 0 ? Q : op == 2 ? I : H; }
__device__ __forceinline__ int op_cols(int op) { return op == 3 ? I : H; }
// Rows per copy of a projection (its row length K): chunk / (2 K), at least 1 (chunk: the
// kernel's CHUNK, 6144 unless a variant says otherwise).
__device__ __forceinline__ int chunk_rows(int op, int chunk) { return max(1, chunk / (2 * op_cols(op))); }

// Warp w's copies, in the order it consumes them: per layer and projection, its contiguous rows
// [lo, hi) of the block's share, CR at a time (the gate|up projection: the gate rows, then the
// same up rows). CC > 0: the cluster size and the warp count are constants, and every
// division is by a constant (CC == 0, the form measured in session 32: divisions by the
// runtime cluster size and a division call for the rows a copy, ~200 single-lane instructions
// a copy by a reading of its SASS).
template <int CC, int NW, int CHUNK> struct CopyIter {
    int l = 0, op = 0, s = 0, half = 0;
    int b, w, C;
    __device__ int rows_per_block(int o) const {
        constexpr int D = CC > 0 ? CC : 1;  // (no division by zero in the CC == 0 instance)
        if (CC > 0) return o == 0 ? Q / D : (o == 2 ? I / D : H / D);
        return op_rows(o) / C;
    }
    __device__ int rows_per_copy(int o) const {
        if (CC > 0) return o == 3 ? max(1, CHUNK / (2 * I)) : max(1, CHUNK / (2 * H));
        return chunk_rows(o, CHUNK);
    }
    __device__ void range(int o, int &lo, int &hi) const {
        const int rb = rows_per_block(o);
        lo = w * rb / NW;
        hi = (w + 1) * rb / NW;
    }
    __device__ void first() {
        int lo, hi;
        range(op, lo, hi);
        s = lo;
        if (lo >= hi) next_op();
    }
    __device__ void next_op() {
        for (;;) {
            if (++op == 4) {
                op = 0;
                ++l;
            }
            if (l >= L) return;
            int lo, hi;
            range(op, lo, hi);
            if (lo < hi) {
                s = lo;
                return;
            }
        }
    }
    // The copy's global address, bytes and rows.
    __device__ void copy(const Weights &W, const __nv_bfloat16 *&p, unsigned &bytes) const {
        int lo, hi;
        range(op, lo, hi);
        const int n = min(rows_per_copy(op), hi - s), r = b * rows_per_block(op) + s;
        const int K = op_cols(op);
        switch (op) {
            case 0: p = W.qkv + ((size_t)l * Q + r) * H; break;
            case 1: p = W.o + ((size_t)l * H + r) * H; break;
            case 2: p = (half ? W.u : W.g) + ((size_t)l * I + r) * H; break;
            default: p = W.d + ((size_t)l * H + r) * I; break;
        }
        bytes = n * K * 2;
    }
    __device__ void next() {
        if (op == 2 && half == 0) {
            half = 1;
            return;
        }
        half = 0;
        int lo, hi;
        range(op, lo, hi);
        s += rows_per_copy(op);
        if (s < hi) return;
        next_op();
    }
};

// MODE 0: the layer as described; 1: no hand-off (no pushes, no waits for inputs: the rows
// stream and are multiplied with whatever the buffers hold; timing only). PACKED (timing only:
// the values are not the model's): each warp's copies come from its own contiguous region of
// `packed` (pw bytes a warp), in order, as if the weights had been laid out at load time in the
// order each warp consumes them.
//
// Added after session 32's device time, run in session 33: CC > 0 (the cluster size as a constant,
// see CopyIter) and TIMERS (each warp's lane 0 sums the clock64 cycles spent waiting for its
// copies, in the dot products, and refilling the ring, into regions[(b WARPS + w) 4 + 0..2],
// with the whole loop's cycles in + 3): the split that says which of the two comes first.
// Approximate: the dot-product region includes each output's emit (with the hand-off, its
// st.async pushes), the loop's total includes the set-up before the loop, and the timer reads
// are no ordering barrier for the compiler.
template <int WARPS, int RING, int MODE = 0, bool PACKED = false, int CHUNK = 6144, bool SLOTS = false, bool SPLIT_ACC = false,
          int CC = 0, bool TIMERS = false>
__global__ void __launch_bounds__(WARPS * 32, 1) cluster_layers(Weights W, const float *x0, float *out, unsigned long long *ns,
                                                                unsigned long long *tl, const unsigned char *packed, size_t pw,
                                                                unsigned long long *regions) {
    extern __shared__ __align__(128) unsigned char ring_all[];
    __shared__ __align__(16) float xa[H], xb[H], qo[Q], hh[I];
    __shared__ float gtmp[WARPS][8];
    __shared__ __align__(8) unsigned long long rbar[WARPS][M];
    __shared__ unsigned slot_off[WARPS][M], slot_end[WARPS][M];
    __shared__ __align__(8) unsigned long long ibar[4];  // 0: qo, 1: xb, 2: hh, 3: xa
    unsigned b, C_rt;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(b));
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(C_rt));
    if (CC > 0 && C_rt != (unsigned)CC) __trap();  // launched with another cluster size
    const unsigned C = CC > 0 ? (unsigned)CC : C_rt;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    unsigned long long t_wait = 0, t_rows = 0, t_refill = 0;
    const long long t_loop0 = clock64();
    unsigned long long g0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    unsigned char *ring = ring_all + w * RING;
    const unsigned bytes_in[4] = {Q * 4, H * 4, I * 4, H * 4};
    for (int k = threadIdx.x; k < H; k += blockDim.x) xa[k] = x0[k];
    if (lane == 0) mbar_init(saddr(&rbar[w][0]), M);
    arm_inputs_and_sync(ibar, bytes_in);

    // Producer state (lane 0).
    CopyIter<CC, WARPS, CHUNK> it;
    it.b = b;
    it.w = w;
    it.C = C;
    it.first();
    unsigned issued = 0, consumed = 0, prod = 0, cons = 0;
    size_t streamed = 0;
    const unsigned char *mine = packed + (b * WARPS + w) * pw;
    auto pump = [&] {
        while (it.l < L && issued - consumed < M) {
            // (CC > 0: the free-slot check before the copy's address is computed, not after.)
            if (SLOTS && CC > 0 && issued - consumed >= RING / CHUNK) break;
            const __nv_bfloat16 *p;
            unsigned bytes;
            it.copy(W, p, bytes);
            if (PACKED) p = reinterpret_cast<const __nv_bfloat16 *>(mine + streamed);
            unsigned pos = prod;
            if (SLOTS) {
                // Fixed slots of CHUNK bytes: copy i goes to slot i % (RING / CHUNK).
                if (issued - consumed >= RING / CHUNK) break;
                pos = (issued % (RING / CHUNK)) * CHUNK;
            } else {
                // A byte ring: a copy that would cross the end starts at the beginning.
                if (pos % RING + bytes > RING) pos += RING - pos % RING;
                if (pos + bytes - cons > RING) break;
            }
            const unsigned s = issued % M, bar = saddr(&rbar[w][s]);
            slot_off[w][s] = pos % RING;
            slot_end[w][s] = pos + bytes;
            bulk_load(saddr(ring + pos % RING), p, bytes, bar);
            prod = pos + bytes;
            streamed += bytes;
            ++issued;
            it.next();
        }
    };
    if (lane == 0) pump();
    __syncwarp();

    unsigned seq = 0;  // copies consumed by this warp
    // Waits for the next copy; its rows start at the returned pointer.
    auto take = [&]() {
        const unsigned s = seq % M;
        const long long t0 = TIMERS ? clock64() : 0;
        wait_parity<false>(saddr(&rbar[w][s]), (seq / M) & 1);
        if (TIMERS) t_wait += clock64() - t0;
        return reinterpret_cast<const uint4 *>(ring + slot_off[w][s]);
    };
    // Frees the copy: lane 0 refills the ring.
    auto release = [&]() {
        __syncwarp();
        if (lane == 0) {
            const long long t0 = TIMERS ? clock64() : 0;
            // The lanes' generic reads of the slot come before the async-proxy refill.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            cons = slot_end[w][seq % M];
            ++consumed;
            pump();
            if (TIMERS) t_refill += clock64() - t0;
        }
        __syncwarp();
        ++seq;
    };
    // The dot products of a copy's n rows (row length K) with x, ROWS_AT_ONCE rows a pass: G
    // lanes a row, each loading its KC chunks before its FMAs; calls emit(j, v) for each row j
    // with v on every lane.
    auto rows = [&](const uint4 *rp, int n, const float *x, int K, auto &&emit) {
        const long long t0 = TIMERS ? clock64() : 0;
        auto pass = [&](auto g_tag, auto kc_tag) {
            constexpr int G = decltype(g_tag)::value, KC = decltype(kc_tag)::value, R = 32 / G;
            const int sub = lane % G;
            for (int j0 = 0; j0 < n; j0 += R) {
                const int row = min(j0 + lane / G, n - 1);
                const uint4 *r = rp + row * (G * KC);
                uint4 wv[KC];
#pragma unroll
                for (int k = 0; k < KC; ++k) wv[k] = r[sub + G * k];
                float acc = 0.0f;
                if (SPLIT_ACC) {
                    // Independent partial sums (two per chunk, four FMAs each), added as a tree:
                    // a chain of ~4 + log2(2 KC) dependent operations instead of 8 KC.
                    float part[2 * KC];
#pragma unroll
                    for (int k = 0; k < KC; ++k) dot8x2(wv[k], x + 8 * (sub + G * k), part[2 * k], part[2 * k + 1]);
#pragma unroll
                    for (int step = 1; step < 2 * KC; step *= 2)
#pragma unroll
                        for (int k = 0; k + step < 2 * KC; k += 2 * step) part[k] += part[k + step];
                    acc = part[0];
                } else {
#pragma unroll
                    for (int k = 0; k < KC; ++k) acc += dot8(wv[k], x + 8 * (sub + G * k));
                }
#pragma unroll
                for (int o = G / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                for (int j = j0; j < min(j0 + R, n); ++j) emit(j, __shfl_sync(0xffffffffu, acc, (j - j0) * G));
            }
        };
        if (K == H)
            pass(std::integral_constant<int, 8>{}, std::integral_constant<int, H / 64>{});
        else
            pass(std::integral_constant<int, 16>{}, std::integral_constant<int, I / 128>{});
        if (TIMERS) t_rows += clock64() - t0;
    };
    // Sends value v of output row r into every block's buffer `buf` (ibar[k]).
    auto push = [&](float *buf, int k, int r, float v) {
        if (MODE == 1) {
            if (lane == 0 && v == 1.2345f) buf[r] = v;
            return;
        }
        if (lane < (int)C) {
            unsigned a, bar;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(saddr(buf + r)), "r"(lane));
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar) : "r"(saddr(&ibar[k])), "r"(lane));
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(a), "f"(v), "r"(bar)
                         : "memory");
        }
    };
    unsigned long long *tlp = tl;
    auto stamp = [&](int l) {
        if (l == TL && b == 0 && threadIdx.x == 0) {
            unsigned long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            *tlp++ = t;
        }
    };
    // Waits for buffer k's phase `ph`; warp 0's lane 0 then arms its next phase.
    auto ready = [&](int k, unsigned ph) {
        if (MODE == 1) return;
        wait_parity<true>(saddr(&ibar[k]), ph & 1);
        if (threadIdx.x == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&ibar[k])), "r"(bytes_in[k]) : "memory");
        __syncwarp();
    };
    auto rms = [&](const float *x) {
        float s = 0.0f;
        for (int c = lane; c < H; c += 32) s += x[c] * x[c];
        // (CC > 0: a multiply by 1/H, not an IEEE division with its slow-path call.)
        return rsqrtf((CC > 0 ? warp_sum(s) * (1.0f / H) : warp_sum(s) / H) + EPS);
    };
    // One projection: this warp's rows [lo, hi) of the block's share, a copy at a time.
    auto project = [&](int op, const float *x, float sc, auto &&emit) {
        const int rb = op_rows(op) / C, lo = w * rb / WARPS, hi = (w + 1) * rb / WARPS, K = op_cols(op), cr = chunk_rows(op, CHUNK);
        for (int s = lo; s < hi; s += cr) {
            const int n = min(cr, hi - s);
            const uint4 *rp = take();
            if (op == 2) {
                rows(rp, n, x, K, [&](int j, float v) {
                    if (lane == 0) gtmp[w][j] = sc * v;
                });
                release();
                rp = take();
            }
            rows(rp, n, x, K, [&](int j, float v) { emit(b * rb + s + j, j, sc * v); });
            release();
        }
    };

    for (int l = 0; l < L; ++l) {
        if (l > 0) ready(3, l - 1);
        stamp(l);
        float sc = rms(xa);
        project(0, xa, sc, [&](int r, int, float v) { push(qo, 0, r, v); });
        stamp(l);
        ready(0, l);
        stamp(l);
        project(1, qo, 1.0f, [&](int r, int, float v) { push(xb, 1, r, xa[r] + v); });
        stamp(l);
        ready(1, l);
        stamp(l);
        sc = rms(xb);
        project(2, xb, sc, [&](int r, int j, float u) {
            const float g = gtmp[w][j];
            push(hh, 2, r, (CC > 0 ? __fdividef(g, 1.0f + __expf(-g)) : g / (1.0f + __expf(-g))) * u);
        });
        stamp(l);
        ready(2, l);
        stamp(l);
        project(3, hh, 1.0f, [&](int r, int, float v) { push(xa, 3, r, xb[r] + v); });
        stamp(l);
    }
    ready(3, L - 1);
    if (TIMERS && lane == 0) {
        unsigned long long *r = regions + (b * WARPS + w) * 4;
        r[0] = t_wait;
        r[1] = t_rows;
        r[2] = t_refill;
        r[3] = clock64() - t_loop0;
    }
    unsigned long long g1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
    if (b == 0)
        for (int k = threadIdx.x; k < H; k += blockDim.x) out[k] = xa[k];
    if (threadIdx.x == 0) ns[b] = g1 - g0;
    // No block exits while another may still store into its shared memory.
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

int main() {
    const size_t nq = (size_t)L * Q * H, no = (size_t)L * H * H, ng = (size_t)L * I * H, nd = (size_t)L * H * I;
    const HostLayers m = make_layers();  // the weights, the input and the host reference
    const auto &hq = m.q, &ho = m.o, &hg = m.g, &hu = m.u, &hd = m.d;
    const std::vector<float> &x0 = m.x0;
    const std::vector<double> &xa = m.out;

    __nv_bfloat16 *dq, *dO, *dg, *du, *dd;
    float *dx0, *dout;
    unsigned long long *dns;
    CHECK(cudaMalloc(&dq, nq * 2));
    CHECK(cudaMalloc(&dO, no * 2));
    CHECK(cudaMalloc(&dg, ng * 2));
    CHECK(cudaMalloc(&du, ng * 2));
    CHECK(cudaMalloc(&dd, nd * 2));
    CHECK(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dO, ho.data(), no * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dg, hg.data(), ng * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(du, hu.data(), ng * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dd, hd.data(), nd * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&dx0, H * 4));
    CHECK(cudaMalloc(&dout, H * 4));
    CHECK(cudaMalloc(&dns, 64 * 8));
    CHECK(cudaMemcpy(dx0, x0.data(), H * 4, cudaMemcpyHostToDevice));
    // A buffer twice the L2 to evict the weights between launches is not needed: 213 MB of
    // weights per launch already exceed the 60 MB L2.
    Weights Wd{dq, dO, dg, du, dd};
    std::printf("weights %.1f MB a launch (%d layers)\n", (nq + no + 2 * ng + nd) * 2 / 1e6, L);

    unsigned long long *dtl, *dreg;
    CHECK(cudaMalloc(&dtl, 64 * 8));
    CHECK(cudaMalloc(&dreg, 16 * 32 * 4 * 8));
    // The packed layout's buffer: every warp's share of a launch's weights, with room to spare.
    unsigned char *dpk;
    const size_t wbytes = (nq + no + 2 * ng + nd) * 2, pk_bytes = wbytes + (64 << 20);
    CHECK(cudaMalloc(&dpk, pk_bytes));
    CHECK(cudaMemset(dpk, 0, pk_bytes));
    size_t pw = 0;
    auto run = [&](auto kern, int warps, int ring, int C, bool timed = false) {
        pw = (wbytes / (C * warps) * 5 / 4) / 256 * 256;  // a warp takes at most ~12% over its even share
        const int smem = warps * ring;
        CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaLaunchAttribute at;
        const cudaLaunchConfig_t cfg = cluster_config(at, C, C, warps * 32, smem);
        const LayersRun r = time_layers(
            [&] {
                CHECK(cudaLaunchKernelEx(&cfg, kern, Wd, (const float *)dx0, dout, dns, dtl, (const unsigned char *)dpk, pw, dreg));
            },
            dout, dns, dtl, xa);
        const double us = r.us, maxerr = r.maxerr, maxref = r.maxref;
        const unsigned long long *htl = r.tl;
        std::printf("C=%2d, %2d warps a block, %5d-byte rings: kernel %.1f us (block 0's timer, median of 10): "
                    "%.2f us a layer of 4 projections, %.0f GB/s; max |err| %.3g of max |x| %.3g\n",
                    C, warps, ring, us, us / L, (nq + no + 2 * ng + nd) * 2 / (us * 1e-6) / 1e9, maxerr, maxref);
        std::printf("   layer %d, block 0 thread 0, us (qkv rows, wait, o rows, wait, g|u rows, wait, down rows):", TL);
        for (int k = 1; k < 8; ++k) std::printf(" %.2f", (htl[k] - htl[k - 1]) / 1e3);
        std::printf("\n");
        if (timed) {
            // The last launch's per-warp cycle sums, as shares of the loop's cycles over all warps.
            std::vector<unsigned long long> reg(C * warps * 4);
            CHECK(cudaMemcpy(reg.data(), dreg, reg.size() * 8, cudaMemcpyDeviceToHost));
            double sum[4] = {0, 0, 0, 0};
            for (size_t i = 0; i < reg.size(); ++i) sum[i % 4] += (double)reg[i];
            std::printf("   lane 0's cycles, share of the loop: waiting for copies %.1f%%, dot products %.1f%%, refills %.1f%%\n",
                        100 * sum[0] / sum[3], 100 * sum[1] / sum[3], 100 * sum[2] / sum[3]);
        }
    };
    // Session 33, call 1 (prepared after session 32's device time): where a warp's cycles go, for the
    // form measured last (runtime cluster size) and with the cluster size as a constant.
    for (int C : {16}) {
        std::printf("-- the layer, independent partial sums, fixed slots (session 32's last form), with cycle sums\n");
        run(cluster_layers<16, 12288, 0, false, 6144, true, true, 0, true>, 16, 12288, C, true);
        std::printf("-- the same, the cluster size a constant\n");
        run(cluster_layers<16, 12288, 0, false, 6144, true, true, 16, true>, 16, 12288, C, true);
        run(cluster_layers<16, 12288, 0, false, 6144, true, true, 16, false>, 16, 12288, C);
        std::printf("-- no hand-off (timing only), the cluster size a constant\n");
        run(cluster_layers<16, 12288, 1, false, 6144, true, true, 16, true>, 16, 12288, C, true);
    }
    return 0;
}
