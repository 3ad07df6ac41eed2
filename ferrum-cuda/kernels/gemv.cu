// Batch-1 projections: y[r] = sum_c W[r][c] * x[c], W row-major [rows][cols] in the model
// dtype, x and y in fp32 (activations stay fp32 between the decode kernels; only weights and
// the KV cache are 16-bit). Each warp computes GEMV_ROWS rows; lanes stream 16-byte chunks of
// the rows (8 values) and the matching 32 bytes of x (two float4); fp32 accumulate; a
// fixed-order warp reduction.
// The `gateup` variant multiplies by the stacked [gate; up] weight and writes
// silu(gate . x) * (up . x) in fp32: SiLU-mul fused into the gate/up projection.
// Two more fusions for one-GPU decode (the residual stream never leaves fp32):
// - `_norm`: the input is the residual stream x and the projection applies RMSNorm on the
//   way in: acc = W . (x * norm_w) and ss = sum(x^2) accumulate in the same loop, then
//   y = acc * rsqrt(ss / cols + eps) (the norm's scalar commutes with the dot product).
// - `_res`: the residual add on the way out: y[r] += W[r] . x (y is the residual stream; its
//   old value is read before the programmatic-launch wait, so the kernel before this one must
//   not write y: see gemv()).
// - `_res_et`: `_res` with the early trigger (common.cuh): the next kernel may launch before
//   this one's wait (plan::EarlyTrigger; the o and down projections of the one-GPU step).
// - `_pfh` (two-row gate|up `_norm` and `_res_et`, `_norm` in both row forms): half the chunks
//   loaded before the wait (plan::HalfPrefetch), for fewer registers or fewer early loads.
// And one for tensor parallelism over a peer group (peer.cuh):
// - `_push`: y is this rank's partial of an all-reduce that the next kernel completes
//   (ferrum_peer_add_rmsnorm_pushed_*); the lane that stores outputs o, o + 1 also pushes them,
//   as line o / 2 of the call's message, into every peer's receive slot (peer.cuh's step 1,
//   done here as each warp finishes instead of by the next kernel after this one ends).
#include "common.cuh"
#include "peer.cuh"

__device__ __forceinline__ float silu_mul_f(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// ROWS rows per warp (2 or 4): more rows share each load of x, fewer warps stream W.
// Split-K: the block is (32 * groups, KS) threads; the KS warps with the same threadIdx.x >> 5
// share one row group, warp k (threadIdx.y) taking the 32-chunk stripes k, k + KS, k + 2 KS, ...
// of the columns; their warp sums are added in k order through shared memory. KS = 1 is the
// plain layout. Shapes with few rows get KS > 1 so that enough warps stream W to keep the
// memory busy (the host picks KS from the shape, the multiprocessor count, the
// FERRUM_GEMV_SPLIT_K cap and the FERRUM_GEMV_WARPS_PER_SM target, never from timing:
// plan::gemv_split_k_exact; any KS up to GEMV_MAX_KS works, 3 and 6 included).
// GATEUP = false: warp w computes rows ROWS*w .. ROWS*w + ROWS - 1 of y = W x (`rows` rows).
// GATEUP = true: W is [gate; up] with `rows` rows each; warp w computes OUT = ROWS/2 outputs
// o = OUT*w + j: gate row o and up row rows + o, and writes y[o] = silu(gate . x) * (up . x)
// (SiLU-mul fused into the projection).
// For a given KS every variant computes each row's dot product in the same order (lane l of
// warp k takes chunks l + 32 k, l + 32 (k + KS), ...; then the same warp reduction and the
// same k-order sum), so the ROWS and block-size variants give bit-identical results: the
// runner may pick the fastest per shape without changing the output.
// NORM / RES: the fusions above. Each lane accumulates ss over the same chunks in the same
// order in every variant, so the variants stay bit-identical with them too.
// One 16-byte chunk c of every row: acc[r] += W[r][8c..8c+8] . x[8c..8c+8] (times the norm
// weight and with ss += x^2 for NORM). The same operations in the same order wherever it is
// called, so the prefetched and the streamed chunks round alike.
template <typename T, int ROWS, bool NORM>
__device__ __forceinline__ void gemv_chunk(float (&acc)[ROWS], float &ss, const uint4 (&wv)[ROWS],
                                           const float4 *x4, const T *norm_w, int c) {
    const float4 xa = __ldg(x4 + 2 * c), xb = __ldg(x4 + 2 * c + 1);
    float xf[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    if (NORM) {
        // norm_w is a whole cols-element allocation: chunk c is 16-byte aligned.
        float nf[8];
        unpack8(__ldg(reinterpret_cast<const uint4 *>(norm_w) + c), nf, T());
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            ss = fmaf(xf[j], xf[j], ss);
            xf[j] *= nf[j];
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float wf[8];
        unpack8(wv[r], wf, T());
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r] = fmaf(wf[j], xf[j], acc[r]);
    }
}

// RES: one fp32 value of the residual stream y, loaded before the programmatic-launch wait. An
// L2 load (.cg: an SM's L1 may still hold the line from a kernel that read it before it was
// last written) in asm volatile, so that it stays ahead of the wait (see ldg_early).
__device__ __forceinline__ float ld_early_cg(const float *p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned ld_cg_u32(const unsigned *p) {
    unsigned v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Chunks per lane loaded before the programmatic-launch wait, while the previous kernel
// finishes: 8 16-byte loads per lane either way (the `_pfh` kernels: 4, gemv's PF_DIV). The main loop keeps as many in flight (unrolled
// 4 times with 2 rows, twice with 4: more makes ptxas spill, which `cargo xtask ptx --check`
// refuses).
template <int ROWS> struct GemvPrefetch {
    static constexpr int CHUNKS = 8 / ROWS;
    static constexpr int UNROLL = 8 / ROWS;
};

// Block shape limits of the split-K layout: (32 * groups, ks) threads, groups * ks <= 8.
#define GEMV_MAX_GROUPS 8
#define GEMV_MAX_KS 8

// ET: the early trigger (common.cuh): the next kernel may launch as soon as this one's blocks
// are all scheduled, before this one's wait. PF_DIV: the chunks loaded before the wait are
// GemvPrefetch's divided by it (the same chunks in the same order either way: bit-identical).
template <typename T, int ROWS, bool GATEUP, bool NORM = false, bool RES = false, bool PUSH = false, int LPR = 32,
          bool ET = false, int PF_DIV = 1>
__device__ void gemv(float *y, const T *W, const float *x, int rows, int cols, const T *norm_w,
                     float eps, const PeerArgs *pa = nullptr) {
    if (ET) FERRUM_PDL_TRIGGER();
    static_assert(LPR == 32 || LPR == 16 || LPR == 8, "lanes per row group: 32, 16 or 8");
    constexpr int OUT = GATEUP ? ROWS / 2 : ROWS, SUBS = 32 / LPR;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int gl = lane % LPR, sub = lane / LPR;  // lane in its row group, the group in the warp
    // The timeline build's phase stamps (common.cuh; 0 and no code in every other build): 0 the
    // prefetched chunks' FMAs done, 1 the loop and warp sums, 2 the split-K sum, 3 the stores
    // (the first warp of a block); 4 and 5: phases 1 and 3 of any warp of the block.
    const unsigned tl_on = FERRUM_TL_FLAG();
    const int ks = blockDim.y, kw = threadIdx.y;  // split-K: warp kw of the group's ks
    const int wg = blockIdx.x * nw + warp;
    const int o0 = (wg * SUBS + sub) * OUT;
    // Touches no memory: leaving before the wait is fine. The ks warps of a group share o0,
    // so they leave together (the group barrier below never waits for a warp that left). With
    // LPR < 32 a warp leaves when its first group is past the end; its other groups past the
    // end stay for the shuffles (their rows are clamped below) and store nothing.
    if (wg * SUBS * OUT >= rows) return;
    const bool live = o0 < rows;
    size_t row_idx[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        // Rows past the end are clamped to the last one (computed, never written).
        if (GATEUP)
            row_idx[r] = r < OUT ? (size_t)min(o0 + r, rows - 1)
                                 : (size_t)rows + (size_t)min(o0 + r - OUT, rows - 1);
        else
            row_idx[r] = (size_t)min(o0 + r, rows - 1);
    }
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    float ss = 0.0f;  // sum of x^2 (NORM only)
    // 16-byte path when cols % 8 == 0: W's rows are 16-byte aligned and x is 32-byte aligned
    // because buffers come from cuMemAlloc (256-byte aligned), every region starting at a
    // multiple of cols elements.
    const bool vec = (cols & 7) == 0;
    const int n8 = cols >> 3;
    const uint4 *w4[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) w4[r] = reinterpret_cast<const uint4 *>(W + row_idx[r] * cols);
    // Lane l of warp kw takes chunks l + 32 kw, l + 32 (kw + ks), ...: the first PF of them
    // are loaded now, before the wait
    // (weights are never written by a kernel of the decode stream: common.cuh), with
    // ldg_early so that they stay ahead of it.
    constexpr int PF = GemvPrefetch<ROWS>::CHUNKS / PF_DIV;
    static_assert(PF >= 1, "at least one chunk before the wait");
    uint4 pre[PF][ROWS];
#pragma unroll
    for (int u = 0; u < PF; ++u) {
        const int c = gl + LPR * (kw + ks * u);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) pre[u][r] = vec && c < n8 ? ldg_early(w4[r] + c) : make_uint4(0, 0, 0, 0);
    }
    // RES: the writing lane's old values of y, loaded before the wait too, so that the
    // epilogue's read-modify-write costs no L2 round trip after the dot products. The caller
    // guarantees that the kernel launched just before this one does not write y (the decode
    // step: the attention precedes the o projection, gate|up the down projection). That kernel
    // waits before it lets this one launch (it is never an early-triggering `_et` kernel:
    // common.cuh), so when this grid starts, every kernel before it has completed and its
    // writes to y are visible.
    // Lane 0 of warp kw == 0 is the only thread that writes this warp's outputs, and it reads
    // them nowhere else, so the early value is the one the add would have read.
    float y_old[OUT];
#pragma unroll
    for (int j = 0; j < OUT; ++j)
        y_old[j] = RES && gl == 0 && kw == 0 && o0 + j < rows ? ld_early_cg(y + o0 + j) : 0.0f;
    // x comes from the previous kernel
    if (ET)
        FERRUM_PDL_WAIT();
    else
        FERRUM_PDL_ENTRY();
    if (vec) {
        const float4 *x4 = reinterpret_cast<const float4 *>(x);
#pragma unroll
        for (int u = 0; u < PF; ++u) {
            const int c = gl + LPR * (kw + ks * u);
            if (c < n8) gemv_chunk<T, ROWS, NORM>(acc, ss, pre[u], x4, norm_w, c);
        }
        FERRUM_TL_PHASE(tl_on, 0, acc[ROWS - 1]);
#pragma unroll (GemvPrefetch<ROWS>::UNROLL)
        for (int c = gl + LPR * (kw + ks * PF); c < n8; c += LPR * ks) {
            uint4 wv[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) wv[r] = __ldg(w4[r] + c);
            gemv_chunk<T, ROWS, NORM>(acc, ss, wv, x4, norm_w, c);
        }
    } else {
        for (int c = gl + LPR * kw; c < cols; c += LPR * ks) {
            float xv = x[c];
            if (NORM) {
                ss = fmaf(xv, xv, ss);
                xv *= to_f(norm_w[c]);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(to_f(W[row_idx[r] * cols + c]), xv, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = group_sum<LPR>(acc[r]);
    if (NORM) ss = group_sum<LPR>(ss);
    FERRUM_TL_PHASE(tl_on, 1, acc[ROWS - 1]);
    FERRUM_TL_PHASE_WARP(tl_on, 4, acc[ROWS - 1]);  // phase 1 of every warp (4: the latest)
    if (LPR == 32 && ks > 1) {
        // The group's ks warp sums, added in k order by warp 0 of the group. Named barrier
        // 1 + warp (0 is __syncthreads') over the group's ks * 32 threads only: every group of
        // the block has its own slots and its own barrier, and groups that left early (o0 >=
        // rows, all ks warps together) are not waited for.
        __shared__ float s_part[GEMV_MAX_GROUPS][GEMV_MAX_KS][ROWS + 1];
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) s_part[warp][kw][r] = acc[r];
            s_part[warp][kw][ROWS] = ss;
        }
        asm volatile("bar.sync %0, %1;" ::"r"(1 + warp), "r"(ks * 32) : "memory");
        if (kw != 0) return;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float a = 0.0f;
            for (int k = 0; k < ks; ++k) a += s_part[warp][k][r];
            acc[r] = a;
        }
        if (NORM) {
            float a = 0.0f;
            for (int k = 0; k < ks; ++k) a += s_part[warp][k][ROWS];
            ss = a;
        }
    }
    FERRUM_TL_PHASE(tl_on, 2, acc[ROWS - 1]);
    if (NORM) {
        const float rn = rsqrtf(ss / (float)cols + eps);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] *= rn;
    }
    if (gl == 0 && live) {
#pragma unroll
        for (int j = 0; j < OUT; ++j) {
            if (o0 + j < rows) {
                const float v = GATEUP ? silu_mul_f(acc[j], acc[OUT + j]) : acc[j];
                if (RES)
                    y[o0 + j] = y_old[j] + v;  // the same fp32 add as y[o0 + j] += v
                else
                    y[o0 + j] = v;
            }
        }
        if (PUSH) {
            // Outputs o0 .. o0 + OUT - 1 (o0 even: OUT is 2 or 4) are lines o0 / 2 .. of the
            // message y[0 .. rows), each line exactly the payload peer_payload(y, l, rows) forms
            // (two f32, zero past rows). Call e = the rank's completed calls + 1, as the
            // all-reduce kernel that follows computes it: the counter was last written by this
            // rank's previous peer kernel, which has completed (it precedes the kernel this one
            // waited for); an L2 load, never a stale L1 line. A failed rank pushes nothing.
            const PeerArgs &a = *pa;
            const uint2 c = make_uint2(ld_cg_u32(a.counter), ld_cg_u32(a.counter + 1));
            if (c.y == 0u) {
                const unsigned e = c.x + 1u;
                const size_t slot = 2 * (size_t)a.cap;
                const size_t mine = (size_t)(e & 1u) * a.world * slot + (size_t)a.rank * slot;
#pragma unroll
                for (int j = 0; j < OUT; j += 2) {
                    if (o0 + j < rows) {
                        const float lo = acc[j], hi = o0 + j + 1 < rows ? acc[j + 1] : 0.0f;
                        const uint2 w = make_uint2(__float_as_uint(lo), __float_as_uint(hi));
                        const size_t l = (size_t)(o0 + j) / 2;
#pragma unroll
                        for (int p = 0; p < PEER_MAX_RANKS; ++p)
                            if (p < a.world && p != a.rank) peer_st_line(a.recv[p] + mine + 4 * l, w, e);
                    }
                }
            }
        }
    }
    FERRUM_TL_PHASE(tl_on, 3, 0.0f);
    FERRUM_TL_PHASE_WARP(tl_on, 5, 0.0f);  // phase 3 of every storing warp (5: the latest)
}

// The `_push` entry points (plain y = W x, TP partials) take the rank's peer arguments first.
#define FERRUM_GEMV_PUSH(S, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_push_##S(PeerArgs a, float *y, const T *W, const float *x, int rows, int cols) { \
        gemv<T, 2, false, false, false, true>(y, W, x, rows, cols, nullptr, 0.0f, &a);            \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_push_##S(PeerArgs a, float *y, const T *W, const float *x, int rows, int cols) { \
        gemv<T, 4, false, false, false, true>(y, W, x, rows, cols, nullptr, 0.0f, &a);            \
    }

FERRUM_GEMV_PUSH(f16, f16)
FERRUM_GEMV_PUSH(bf16, bf16)

// Every GEMV entry point has the same parameters; norm_w and eps are read by the _norm ones only.
// gemv() itself runs FERRUM_PDL_ENTRY, after loading its first weight chunks.
#define FERRUM_GEMV(S, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_##S(float *y, const T *W, const float *x, int rows, int cols,                  \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, false, false>(y, W, x, rows, cols, norm_w, eps);                         \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_##S(float *y, const T *W, const float *x, int rows, int cols,                 \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 4, false, false, false>(y, W, x, rows, cols, norm_w, eps);                         \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_gateup_##S(float *y, const T *W, const float *x, int rows, int cols,           \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, true, false, false>(y, W, x, rows, cols, norm_w, eps);                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_gateup_##S(float *y, const T *W, const float *x, int rows, int cols,          \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 4, true, false, false>(y, W, x, rows, cols, norm_w, eps);                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_norm_##S(float *y, const T *W, const float *x, int rows, int cols,             \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, true, false>(y, W, x, rows, cols, norm_w, eps);                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_norm_##S(float *y, const T *W, const float *x, int rows, int cols,            \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 4, false, true, false>(y, W, x, rows, cols, norm_w, eps);                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_gateup_norm_##S(float *y, const T *W, const float *x, int rows, int cols,      \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, true, true, false>(y, W, x, rows, cols, norm_w, eps);                           \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_gateup_norm_##S(float *y, const T *W, const float *x, int rows, int cols,     \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 4, true, true, false>(y, W, x, rows, cols, norm_w, eps);                           \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_res_##S(float *y, const T *W, const float *x, int rows, int cols,              \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, false, true>(y, W, x, rows, cols, norm_w, eps);                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_res_##S(float *y, const T *W, const float *x, int rows, int cols,             \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 4, false, false, true>(y, W, x, rows, cols, norm_w, eps);                          \
    }

FERRUM_GEMV(f16, f16)
FERRUM_GEMV(bf16, bf16)

// The `_res` GEMVs with the early trigger (FERRUM_EARLY_TRIGGER; common.cuh says where the
// host may launch them).
#define FERRUM_GEMV_ET(S, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_res_et_##S(float *y, const T *W, const float *x, int rows, int cols,           \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, false, true, false, 32, true>(y, W, x, rows, cols, norm_w, eps);         \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_res_et_##S(float *y, const T *W, const float *x, int rows, int cols,          \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 4, false, false, true, false, 32, true>(y, W, x, rows, cols, norm_w, eps);         \
    }

FERRUM_GEMV_ET(f16, f16)
FERRUM_GEMV_ET(bf16, bf16)

// GEMVs with half the chunks loaded before the wait (`_pfh`; plan::HalfPrefetch,
// FERRUM_GEMV_PF_HALF). Two-row gate|up `_norm`, early-trigger `_res` and `_norm`: 2 a lane
// instead of 4, 46-48 registers instead of 60-64, so 40 warps fit a multiprocessor instead of
// 32. Four-row `_norm` (the q/k/v projection of Llama-3.2-1B and 8B): 1 a lane instead of 2,
// 62 registers instead of 64 (the same allocation): fewer early loads beside the down
// projection before it. ptx --check prints the counts. The same chunks in the same order as
// the other kernels: bit-identical.
#define FERRUM_GEMV_PFH(S, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_gateup_norm_pfh_##S(float *y, const T *W, const float *x, int rows, int cols,  \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, true, true, false, false, 32, false, 2>(y, W, x, rows, cols, norm_w, eps);      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_res_et_pfh_##S(float *y, const T *W, const float *x, int rows, int cols,       \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, false, true, false, 32, true, 2>(y, W, x, rows, cols, norm_w, eps);      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_norm_pfh_##S(float *y, const T *W, const float *x, int rows, int cols,         \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, true, false, false, 32, false, 2>(y, W, x, rows, cols, norm_w, eps);     \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv4_norm_pfh_##S(float *y, const T *W, const float *x, int rows, int cols,        \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 4, false, true, false, false, 32, false, 2>(y, W, x, rows, cols, norm_w, eps);     \
    }

FERRUM_GEMV_PFH(f16, f16)
FERRUM_GEMV_PFH(bf16, bf16)

// Short rows (plan::gemv_lanes_per_row): two rows per row group, LPR lanes per group.
#define FERRUM_GEMV_LANES(S, T, L)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_l##L##_##S(float *y, const T *W, const float *x, int rows, int cols,           \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, false, false, false, L>(y, W, x, rows, cols, norm_w, eps);               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_norm_l##L##_##S(float *y, const T *W, const float *x, int rows, int cols,      \
                          const T *norm_w, float eps) {                                            \
        gemv<T, 2, false, true, false, false, L>(y, W, x, rows, cols, norm_w, eps);                \
    }

FERRUM_GEMV_LANES(f16, f16, 8)
FERRUM_GEMV_LANES(bf16, bf16, 8)
FERRUM_GEMV_LANES(f16, f16, 16)
FERRUM_GEMV_LANES(bf16, bf16, 16)

// out[t][i] = silu(gu[t][i]) * gu[t][inter + i], all fp32 (prefill and the cuBLAS path).
extern "C" __global__ void ferrum_silu_mul(float *out, const float *gu, int inter, int n_tok) {
    FERRUM_PDL_ENTRY();
    const size_t n = (size_t)inter * n_tok;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        const size_t t = k / inter, i = k % inter;
        out[k] = silu_mul_f(gu[t * 2 * inter + i], gu[t * 2 * inter + inter + i]);
    }
}

// out[k] = x[k] rounded to the model dtype, k < n: the 16-bit input of a cuBLAS GEMM
// (tensor cores need f16/bf16 operands; the activations themselves stay fp32).
template <typename T> __device__ void to_dtype(T *out, const float *x, unsigned long long n) {
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (unsigned long long)gridDim.x * blockDim.x)
        out[k] = from_f<T>(x[k]);
}
extern "C" __global__ void ferrum_to_dtype_f16(f16 *out, const float *x, unsigned long long n) {
    FERRUM_PDL_ENTRY();
    to_dtype<f16>(out, x, n);
}
extern "C" __global__ void ferrum_to_dtype_bf16(bf16 *out, const float *x, unsigned long long n) {
    FERRUM_PDL_ENTRY();
    to_dtype<bf16>(out, x, n);
}
