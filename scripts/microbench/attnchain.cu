// How short can the short-context decode attention be? The question the session-39 stall
// samples left (PERF.md): a SmolLM2-135M layer's attention takes ~4.4 us of its ~12.2 (1B: 5.4
// of ~38), nearly all of it latency: ~1100 instructions a warp at ~8 cycles each, one 4-warp
// block a multiprocessor. This file times ferrum's own kernel (attention.cu's
// ferrum_attn_rope_early_bf16, included from the source tree, launched as the engine launches
// it: one block a (head, split), 4 warps, the splits of a head as one thread-block cluster,
// the early K/V copies and the cluster merge buffer in dynamic shared memory) against a
// compact kernel for the same case (head dim 64, every split's rows in the early copies, the
// cluster merge, no bias or head norm: SmolLM2, Llama-3.2-1B), both between two GEMV-shaped
// kernels in a chain of layers, the chain without an attention, and the chain with the floor of
// any attention kernel in that place (attn_copy: the same launch and cluster barrier, q's round
// trip, no arithmetic). Both attentions' outputs, every layer, are checked against a host
// reference in double precision.
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/ac scripts/microbench/attnchain.cu && /tmp/ac
//
// The compact kernel (attn_c64 below) keeps the engine's lane layout (8 lanes a cache row, one
// 16-byte chunk each, 4 rows a warp at once, 16 row slots a block, up to 4 early rows a slot)
// and its RoPE arithmetic, and takes out what costs latency on the chain:
// - q, and the new row's k and v, never go through shared memory: each lane loads its own
//   chunk and the chunk it pairs with under RoPE (one L2 round trip), rotates in registers;
//   only the lanes whose slot holds the new row compute (and append) it;
// - the scores and probabilities stay in registers (4 rows a lane), the warp max and sum are
//   two shuffles each (the 8 lanes of a row share its score);
// - no block combine: each warp pushes its own partial (64 sums, max, sum) into block 0 of the
//   cluster with st.async, so the cluster merges splits x warps partials in one pass (the
//   engine's kernel combines the warps in a block barrier and its shared memory first, then
//   merges the splits).
// Results differ from the engine's kernel by rounding only (another summation order for the
// sums over warps and splits); the program checks every layer's output against it.
//
// Each layer of the chain: `qkv` (a GEMV-shaped kernel of 132 x 256 threads: two 16-byte weight
// chunks a thread loaded before the wait, from a region of its own per layer, so the weights
// stream from DRAM as in the step; then every warp reads the whole residual x, and the warps
// write the q/k/v row round robin), the attention, `o` (the same shape, reading the attention's
// output, writing x). Without an attention, `o` reads q directly. Every kernel is launched with
// programmatic dependent launch (the attention's blocks become resident and issue their early
// copies while `qkv` runs). Figures: the graph's time divided by its layers, median of REPS
// replays; the attention's cost is the difference to the chain without it.
#define FERRUM_PDL 1
#include "../../ferrum-cuda/kernels/attention.cu"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "check.cuh"
#include "graph.cuh"

constexpr int HD = 64;
constexpr int REPS = 15;
constexpr int CW = 4;                      // the compact kernel's warps a block
constexpr int C_SLOTS = CW * 4;            // row slots a block (4 rows a warp at once)
constexpr int C_ROWS = C_SLOTS * ATTN_EARLY_ROWS;  // rows a split can hold: 64

// One 16-byte st.async: four floats into a block of the cluster, completing on its mbarrier.
__device__ __forceinline__ void st_async4(uint32_t addr, float4 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(addr),
                 "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
                 : "memory");
}

// ------------------------------------------------------------------------------------------
// The chain's GEMV-shaped kernels: each warp reads all `n_in` inputs (one round trip), folds
// them into a value, and the warps write `n_out` outputs round robin, bounded (sines), so that
// rounding differences in the attention do not grow along the chain.
__global__ void gemv_like(const float *in, int n_in, float *out, int n_out, const uint4 *w, float phase) {
    const int gt = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
    uint4 a, b;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w)
                 : "l"(w + gt));
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w)
                 : "l"(w + nt + gt));
    FERRUM_PDL_ENTRY();
    const int lane = threadIdx.x & 31, gw = gt >> 5, W = nt >> 5;
    const float4 *in4 = reinterpret_cast<const float4 *>(in);
    float v = __uint_as_float((a.x ^ b.x) & 0x007fffffu);  // a denormal: the weights' loads count
    for (int c = lane; c < n_in / 4; c += 32) {
        const float4 x = in4[c];
        v += x.x + x.y + x.z + x.w;
    }
    v = warp_sum(v);
    if (lane == 0)
        for (int r = gw; r < n_out; r += W) out[r] = 0.5f * __sinf(0.37f * (float)r + phase + 1e-3f * v);
}

// ------------------------------------------------------------------------------------------
// The compact decode attention: head dim 64, one decode token, grid (heads, splits), the
// splits of a head one cluster, 4 warps, every row of a split in the early copies (the host
// checks: at most C_ROWS rows a split). Dynamic shared memory: the merge buffer (splits x 4
// partials of 66 floats, in block 0) then the early K/V copies.
// How attn_c64's partials reach block 0 (the push alone, measured by attn_push below, costs
// ~26 ns a warp-wide st.async instruction, serialised: the instructions count, not the bytes):
// C_SCALAR each warp's partial as 66 4-byte stores from 8 lanes (10 instructions a warp);
// C_WARP4 each warp's partial in one instruction (17 lanes, a 16-byte store each); C_BLOCK the
// block's four warps combined first (shared memory, one barrier), then one instruction a block.
enum CPush { C_SCALAR = 0, C_WARP4 = 1, C_BLOCK = 2 };
__host__ __device__ constexpr int c_parts_per_block(int push) { return push == C_BLOCK ? 1 : CW; }
__host__ __device__ constexpr int c_part_floats(int push) { return push == C_SCALAR ? HD + 2 : HD + 4; }
template <typename T, int PUSH>
__global__ void __launch_bounds__(CW * 32, 1)
    attn_c64(const float *qkv, T *k_cache, T *v_cache, float *out, const uint32_t *pos_base, const float *inv_freq,
             int heads, int kv_heads, int capacity, float scale) {
    constexpr int CH = HD / 8, ER = ATTN_EARLY_ROWS;
    extern __shared__ uint4 s_dyn[];
    __shared__ float2 s_cs[HD / 2];
    __shared__ uint64_t s_mbar;
    __shared__ float s_w[ATTN_MAX_CLUSTER * CW];
    const int h = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gl = lane & 7, sub = lane >> 3, slot = warp * 4 + sub;
    const int n_parts = n_splits * c_parts_per_block(PUSH);
    const uint32_t part_floats = c_part_floats(PUSH);
    float *s_mrg = reinterpret_cast<float *>(s_dyn);
    const uint32_t mrg_bytes = ((uint32_t)n_parts * part_floats * 4u + 15u) & ~15u;
    uint4 *s_early = s_dyn + mrg_bytes / 16;
    const uint32_t rank = cluster_rank();
    if (rank == 0 && tid == 0) merge_bar_init(&s_mbar, (uint32_t)n_parts * part_floats * 4u);
    cluster_arrive_relaxed();
    // Before the wait: the position, the angles, the split's cache rows (as the engine's kernel).
    const float inv_f = tid < HD / 2 ? ld_early_f(inv_freq + tid) : 0.0f;
    const uint32_t pos = ld_early(pos_base);
    const int len = (int)min(pos + 1u, (uint32_t)capacity);
    const int chunk = (len + n_splits - 1) / n_splits;
    const int start = split * chunk, end = min(start + chunk, len);
    const int kvh = h / (heads / kv_heads);
    const uint4 *kb = reinterpret_cast<const uint4 *>(k_cache + (size_t)kvh * capacity * HD) + gl;
    const uint4 *vb = reinterpret_cast<const uint4 *>(v_cache + (size_t)kvh * capacity * HD) + gl;
#pragma unroll
    for (int u = 0; u < ER; ++u) {
        const int t = start + slot + u * C_SLOTS;
        if (t < end && t != (int)pos) {
            cp_early16(s_early + u * blockDim.x + tid, kb + (size_t)t * CH);
            cp_early16(s_early + (ER + u) * blockDim.x + tid, vb + (size_t)t * CH);
        }
    }
    if (tid < HD / 2) {
        float c, sn;
        rope_angle(pos, inv_f, c, sn);
        s_cs[tid] = make_float2(c, sn);
    }
    __syncthreads();  // s_cs (before the wait: off the chain when the block is resident early)
    FERRUM_PDL_ENTRY();
    // This lane's 8 dims d = 8 gl + j and their RoPE partners d ^ 32 (HF's half split).
    const int d0 = gl * 8, p0 = d0 ^ (HD / 2);
    const bool lo = d0 < HD / 2;
    const float4 *row4 = reinterpret_cast<const float4 *>(qkv);
    const int qo = h * HD / 4;
    const float4 qa0 = row4[qo + d0 / 4], qa1 = row4[qo + d0 / 4 + 1];
    const float4 qp0 = row4[qo + p0 / 4], qp1 = row4[qo + p0 / 4 + 1];
    // The new row: in this split, in this lane's slot, at step u_new.
    const bool has_new = (int)pos >= start && (int)pos < end;
    const int rel = (int)pos - start;
    const bool mine_new = has_new && (rel % C_SLOTS) == slot;
    const int u_new = mine_new ? rel / C_SLOTS : -1;
    float4 ka0 = {}, ka1 = {}, kp0 = {}, kp1 = {}, va0 = {}, va1 = {};
    if (mine_new) {
        const int ko = (heads + kvh) * HD / 4, vo = (heads + kv_heads + kvh) * HD / 4;
        ka0 = row4[ko + d0 / 4], ka1 = row4[ko + d0 / 4 + 1];
        kp0 = row4[ko + p0 / 4], kp1 = row4[ko + p0 / 4 + 1];
        va0 = row4[vo + d0 / 4], va1 = row4[vo + d0 / 4 + 1];
    }
    const float qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
    const float qp[8] = {qp0.x, qp0.y, qp0.z, qp0.w, qp1.x, qp1.y, qp1.z, qp1.w};
    // RoPE as rope_pair computes it (the same operations, so q matches the engine's bit for
    // bit): a' = a c - b s, b' = b c + a s, with (a, b) = (x[i], x[i + 32]).
    float qv[8], nk[8], nv[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float2 cs = s_cs[(d0 + j) & (HD / 2 - 1)];
        const float a = lo ? qa[j] : qp[j], b = lo ? qp[j] : qa[j];
        const float r = lo ? __fsub_rn(__fmul_rn(a, cs.x), __fmul_rn(b, cs.y))
                           : __fadd_rn(__fmul_rn(b, cs.x), __fmul_rn(a, cs.y));
        qv[j] = __fmul_rn(r, scale);
    }
    if (mine_new) {
        const float ka[8] = {ka0.x, ka0.y, ka0.z, ka0.w, ka1.x, ka1.y, ka1.z, ka1.w};
        const float kp[8] = {kp0.x, kp0.y, kp0.z, kp0.w, kp1.x, kp1.y, kp1.z, kp1.w};
        const float va[8] = {va0.x, va0.y, va0.z, va0.w, va1.x, va1.y, va1.z, va1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 cs = s_cs[(d0 + j) & (HD / 2 - 1)];
            const float a = lo ? ka[j] : kp[j], b = lo ? kp[j] : ka[j];
            const float r = lo ? __fsub_rn(__fmul_rn(a, cs.x), __fmul_rn(b, cs.y))
                               : __fadd_rn(__fmul_rn(b, cs.x), __fmul_rn(a, cs.y));
            nk[j] = to_f(from_f<T>(r));
            nv[j] = to_f(from_f<T>(va[j]));
        }
        if (h % (heads / kv_heads) == 0) {  // the first q head of the group appends the row
            __align__(16) T kt[8];
            __align__(16) T vt[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) kt[j] = from_f<T>(nk[j]), vt[j] = from_f<T>(nv[j]);
            const size_t at = ((size_t)kvh * capacity + pos) * HD + d0;
            *reinterpret_cast<uint4 *>(k_cache + at) = *reinterpret_cast<const uint4 *>(kt);
            *reinterpret_cast<uint4 *>(v_cache + at) = *reinterpret_cast<const uint4 *>(vt);
        }
    }
    cp_early_wait();
    // Scores of this slot's rows (4 at most), in registers; each row's 8 lanes end with its
    // score (the engine's dot and butterfly, so the same scores bit for bit).
    float sc[ER];
    float mt = FERRUM_NEG_INF;
#pragma unroll
    for (int u = 0; u < ER; ++u) {
        const int t = start + slot + u * C_SLOTS;
        float kf[8];
        if (u == u_new) {
#pragma unroll
            for (int j = 0; j < 8; ++j) kf[j] = nk[j];
        } else {
            unpack8(s_early[u * blockDim.x + tid], kf, T());
        }
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(qv[j], kf[j], s);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        sc[u] = t < end ? s : FERRUM_NEG_INF;
        mt = fmaxf(mt, sc[u]);
    }
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, ls = 0.0f;
#pragma unroll
    for (int u = 0; u < ER; ++u) {
        // Only the split's rows: a slot past it holds stale shared memory (NaN possibly, and
        // 0 x NaN is NaN). Session 41 ran this without the check (timing unaffected).
        if (start + slot + u * C_SLOTS >= end) continue;
        const float p = expf(sc[u] - mt);
        ls += p;
        float vf[8];
        if (u == u_new) {
#pragma unroll
            for (int j = 0; j < 8; ++j) vf[j] = nv[j];
        } else {
            unpack8(s_early[(ER + u) * blockDim.x + tid], vf, T());
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(p, vf[j], acc[j]);
    }
    // The warp's partial: sums over its four row groups.
    ls += __shfl_xor_sync(0xffffffffu, ls, 16);
    ls += __shfl_xor_sync(0xffffffffu, ls, 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 16);
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 8);
    }
    // Into block 0's merge buffer, completing on its mbarrier.
    cluster_wait();  // every block of the cluster started; block 0's mbarrier initialised
    const uint32_t mrg0 = cluster_map(s_mrg, 0), bar0 = cluster_map(&s_mbar, 0);
    if (PUSH == C_SCALAR) {  // partial (split, warp)
        const uint32_t part = (uint32_t)(split * CW + warp) * part_floats;
        if (sub == 0) {
#pragma unroll
            for (int j = 0; j < 8; ++j) st_async(mrg0 + 4u * (part + (uint32_t)(d0 + j)), acc[j], bar0);
        }
        if (lane == 0) {
            st_async(mrg0 + 4u * (part + HD), mt, bar0);
            st_async(mrg0 + 4u * (part + HD + 1), ls, bar0);
        }
    } else if (PUSH == C_WARP4) {  // partial (split, warp): lanes 0-15 the sums (every row group
        // of lanes holds them after the reductions above), lane 16 (max, sum), one instruction
        const uint32_t part = (uint32_t)(split * CW + warp) * part_floats;
        const float4 v = lane < 8    ? make_float4(acc[0], acc[1], acc[2], acc[3])
                         : lane < 16 ? make_float4(acc[4], acc[5], acc[6], acc[7])
                                     : make_float4(mt, ls, 0.0f, 0.0f);
        const uint32_t at = lane < 16 ? (uint32_t)(d0 + 4 * sub) : (uint32_t)HD;
        if (lane < 17) st_async4(mrg0 + 4u * (part + at), v, bar0);
    } else {  // C_BLOCK: the block's partial (split), its warps combined in shared memory first
        __shared__ __align__(16) float s_wp[CW][HD + 4];
        if (lane < 8) {
            *reinterpret_cast<float4 *>(&s_wp[warp][d0]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
            *reinterpret_cast<float4 *>(&s_wp[warp][d0 + 4]) = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
        if (lane == 0) s_wp[warp][HD] = mt, s_wp[warp][HD + 1] = ls;
        __syncthreads();
        if (warp == 0) {
            float Mb = FERRUM_NEG_INF;
#pragma unroll
            for (int w = 0; w < CW; ++w) Mb = fmaxf(Mb, s_wp[w][HD]);
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float Lb = 0.0f;
#pragma unroll
            for (int w = 0; w < CW; ++w) {
                const float mw = s_wp[w][HD], e = mw == FERRUM_NEG_INF ? 0.0f : expf(mw - Mb);
                Lb = fmaf(s_wp[w][HD + 1], e, Lb);
                if (lane < 16) {
                    const float4 a = *reinterpret_cast<const float4 *>(&s_wp[w][4 * lane]);
                    v.x = fmaf(a.x, e, v.x), v.y = fmaf(a.y, e, v.y), v.z = fmaf(a.z, e, v.z), v.w = fmaf(a.w, e, v.w);
                }
            }
            if (lane == 16) v = make_float4(Mb, Lb, 0.0f, 0.0f);
            const uint32_t part = (uint32_t)split * part_floats;
            if (lane < 17) st_async4(mrg0 + 4u * (part + (lane < 16 ? 4u * lane : (uint32_t)HD)), v, bar0);
        }
    }
    if (rank != 0) return;
    merge_bar_wait(&s_mbar);
    // Block 0: the partials' weights exp(m_p - M), once each, then every column in order.
    float M = FERRUM_NEG_INF;
    for (int p = 0; p < n_parts; ++p) M = fmaxf(M, s_mrg[p * part_floats + HD]);
    if (tid < n_parts) {
        const float mp = s_mrg[tid * part_floats + HD];
        s_w[tid] = mp == FERRUM_NEG_INF ? 0.0f : expf(mp - M);
    }
    __syncthreads();
    if (tid < HD) {
        float A = 0.0f, L = 0.0f;
        for (int p = 0; p < n_parts; ++p) {
            const float w = s_w[p];
            A = fmaf(s_mrg[p * part_floats + tid], w, A);
            L = fmaf(s_mrg[p * part_floats + HD + 1], w, L);
        }
        out[h * HD + tid] = L > 0.0f ? A / L : 0.0f;
    }
}

// ------------------------------------------------------------------------------------------
// The floor of any separate attention kernel in the chain: the same launch (grid (heads,
// splits), the splits one cluster, programmatic launch), the cluster barrier, and q's round
// trip: block 0 of each cluster copies its head's 64 raw q values to the output.
__global__ void __launch_bounds__(CW * 32, 1) attn_copy(const float *qkv, float *out) {
    cluster_arrive_relaxed();
    FERRUM_PDL_ENTRY();
    cluster_wait();
    if (cluster_rank() == 0 && threadIdx.x < HD) out[blockIdx.x * HD + threadIdx.x] = qkv[blockIdx.x * HD + threadIdx.x];
}

// The cluster merge's push alone (the copy floor above plus the partials' st.async stores into
// block 0 and its mbarrier wait; no attention arithmetic), in four forms: PUSH_ENGINE as the
// engine's kernel pushes (blocks 1.. of the cluster, one thread a float: 66 4-byte stores a
// block, 330 at 6 splits), PUSH_ENGINE4 the same in 16-byte stores (17 a block, the pair (M, L)
// padded to 4 floats), PUSH_COMPACT as attn_c64 pushes (every warp of every block, 8 lanes x 8
// floats plus the pair: 66 4-byte stores a warp, 1584 at 6 splits), PUSH_COMPACT4 the same in
// 16-byte stores (17 a warp). The value pushed is q (every part the same), so block 0 writes
// parts x q: the host checks that.
enum PushMode { PUSH_ENGINE = 0, PUSH_ENGINE4 = 1, PUSH_COMPACT = 2, PUSH_COMPACT4 = 3 };
template <int MODE>
__global__ void __launch_bounds__(CW * 32, 1) attn_push(const float *qkv, float *out) {
    constexpr bool COMPACT_FORM = MODE == PUSH_COMPACT || MODE == PUSH_COMPACT4, V4 = MODE == PUSH_ENGINE4 || MODE == PUSH_COMPACT4;
    constexpr uint32_t PF = V4 ? HD + 4 : HD + 2;  // floats a part
    __shared__ __align__(16) float s_mrg[ATTN_MAX_CLUSTER * CW * (HD + 4)];
    __shared__ uint64_t s_mbar;
    const uint32_t rank = cluster_rank(), n = cluster_blocks();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = blockIdx.x;
    const uint32_t parts = COMPACT_FORM ? n * CW : n - 1;
    if (rank == 0 && tid == 0) merge_bar_init(&s_mbar, parts * PF * 4u);
    cluster_arrive_relaxed();
    FERRUM_PDL_ENTRY();
    const float4 *q4 = reinterpret_cast<const float4 *>(qkv + h * HD);
    cluster_wait();
    const uint32_t mrg0 = cluster_map(s_mrg, 0), bar0 = cluster_map(&s_mbar, 0);
    if (COMPACT_FORM) {
        const uint32_t part = (rank * CW + (uint32_t)warp) * PF;
        if (lane < 8) {
            const float4 a = q4[2 * lane], b = q4[2 * lane + 1];
            if (V4) {
                st_async4(mrg0 + 4u * (part + 8u * lane), a, bar0);
                st_async4(mrg0 + 4u * (part + 8u * lane + 4u), b, bar0);
            } else {
                const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int j = 0; j < 8; ++j) st_async(mrg0 + 4u * (part + 8u * lane + j), v[j], bar0);
            }
        }
        if (lane == 0) {
            if (V4) {
                st_async4(mrg0 + 4u * (part + HD), make_float4(1.0f, 1.0f, 0.0f, 0.0f), bar0);
            } else {
                st_async(mrg0 + 4u * (part + HD), 1.0f, bar0);
                st_async(mrg0 + 4u * (part + HD + 1), 1.0f, bar0);
            }
        }
    } else if (rank != 0) {
        const uint32_t part = (rank - 1) * PF;
        if (V4) {
            if (tid < HD / 4) st_async4(mrg0 + 4u * (part + 4u * tid), q4[tid], bar0);
            if (tid == HD / 4) st_async4(mrg0 + 4u * (part + HD), make_float4(1.0f, 1.0f, 0.0f, 0.0f), bar0);
        } else {
            const float *q = qkv + h * HD;
            if (tid < HD) st_async(mrg0 + 4u * (part + tid), q[tid], bar0);
            if (tid == 0) {
                st_async(mrg0 + 4u * (part + HD), 1.0f, bar0);
                st_async(mrg0 + 4u * (part + HD + 1), 1.0f, bar0);
            }
        }
    }
    if (rank != 0) return;
    merge_bar_wait(&s_mbar);
    if (tid < HD) {
        float A = COMPACT_FORM ? 0.0f : qkv[h * HD + tid];
        for (uint32_t p = 0; p < parts; ++p) A += s_mrg[p * PF + tid] * s_mrg[p * PF + HD];
        out[h * HD + tid] = A;
    }
}

// The host reference for one layer's attention: every head's output from the layer's raw qkv
// row (q and the new k RoPE'd in double, the new k and v rounded to bf16 as the cache holds
// them) and the layer's cache rows below pos. Returns max |got - ref| and max |ref|.
static void host_attention(const float *qkv, const bf16 *kc, const bf16 *vc, int heads, int kv_heads, int capacity,
                           int pos, const std::vector<float> &inv, float scale, const float *got, double &err,
                           double &mref) {
    auto rope = [&](const float *x, double *y) {
        for (int i = 0; i < HD / 2; ++i) {
            const double th = (double)((float)pos * inv[i]), c = std::cos(th), s = std::sin(th);  // rope_angle's float angle
            y[i] = x[i] * c - x[i + HD / 2] * s;
            y[i + HD / 2] = x[i + HD / 2] * c + x[i] * s;
        }
    };
    for (int h = 0; h < heads; ++h) {
        const int kvh = h / (heads / kv_heads);
        double q[HD], nk[HD], nv[HD];
        rope(qkv + h * HD, q);
        rope(qkv + (heads + kvh) * HD, nk);
        for (int d = 0; d < HD; ++d) {
            nk[d] = __bfloat162float(__float2bfloat16((float)nk[d]));
            nv[d] = __bfloat162float(__float2bfloat16(qkv[(heads + kv_heads + kvh) * HD + d]));
        }
        std::vector<double> sc(pos + 1);
        double m = -1e300;
        for (int t = 0; t <= pos; ++t) {
            const bf16 *k = kc + ((size_t)kvh * capacity + t) * HD;
            double s = 0.0;
            for (int d = 0; d < HD; ++d) s += q[d] * (t == pos ? nk[d] : (double)__bfloat162float(k[d]));
            sc[t] = s * scale;
            m = std::max(m, sc[t]);
        }
        double l = 0.0, o[HD] = {};
        for (int t = 0; t <= pos; ++t) {
            const double p = std::exp(sc[t] - m);
            l += p;
            const bf16 *v = vc + ((size_t)kvh * capacity + t) * HD;
            for (int d = 0; d < HD; ++d) o[d] += p * (t == pos ? nv[d] : (double)__bfloat162float(v[d]));
        }
        for (int d = 0; d < HD; ++d) {
            err = std::max(err, std::fabs(got[h * HD + d] - o[d] / l));
            mref = std::max(mref, std::fabs(o[d] / l));
        }
    }
}

// ------------------------------------------------------------------------------------------
struct Shape {
    const char *name;
    int hidden, heads, kv_heads, layers;
};

// COMPACT + CPush, PUSH0 + PushMode
enum Variant { NONE = 0, COPY = 1, ENGINE = 2, COMPACT = 3, PUSH0 = 6, N_VARIANTS = 10 };

template <typename... Args>
static void launch_attn(cudaStream_t st, dim3 grid, int threads, int cluster, size_t dyn, void (*kernel)(Args...),
                        Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = dyn;
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = 1;
    attr[1].val.clusterDim.y = cluster;
    attr[1].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 2;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

int main() {
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const Shape shapes[] = {{"smollm2-135m", 576, 9, 3, 30}, {"llama3.2-1b", 2048, 32, 8, 16}};
    const int positions[] = {127, 255, 383};  // the bench's first, middle and last decode rows
    const int capacity = 384;
    const int gt = sms * 256;  // the GEMV-shaped kernels: sms x 256 threads
    std::printf("SMs %d; us a layer (qkv-like GEMV, attention, o-like GEMV), median of %d replays\n", sms, REPS);
    for (const Shape &s : shapes) {
        const int qkv_n = (s.heads + 2 * s.kv_heads) * HD, out_n = s.heads * HD;
        const int splits = std::min(ATTN_MAX_CLUSTER, (capacity + 63) / 64);  // plan::attn_splits: 6
        // Buffers: x, one qkv row and one output per layer (every layer's output is compared).
        float *x, *qkv, *outs, *part_acc, *part_ml, *inv_freq;
        uint32_t *counters, *pos;
        bf16 *kc, *vc;
        uint4 *w;
        const size_t cache = (size_t)s.layers * s.kv_heads * capacity * HD;
        const size_t wregion = (size_t)gt * 2;  // uint4 a thread x 2, a region per kernel
        CHECK(cudaMalloc(&x, s.hidden * sizeof(float)));
        CHECK(cudaMalloc(&qkv, (size_t)s.layers * qkv_n * sizeof(float)));
        CHECK(cudaMalloc(&outs, (size_t)s.layers * out_n * sizeof(float)));
        CHECK(cudaMalloc(&part_acc, (size_t)s.heads * ATTN_MAX_SPLITS * HD * sizeof(float)));
        CHECK(cudaMalloc(&part_ml, (size_t)s.heads * ATTN_MAX_SPLITS * 2 * sizeof(float)));
        CHECK(cudaMalloc(&counters, (size_t)s.heads * sizeof(uint32_t)));
        CHECK(cudaMalloc(&pos, sizeof(uint32_t)));
        CHECK(cudaMalloc(&inv_freq, HD / 2 * sizeof(float)));
        CHECK(cudaMalloc(&kc, cache * sizeof(bf16)));
        CHECK(cudaMalloc(&vc, cache * sizeof(bf16)));
        CHECK(cudaMalloc(&w, wregion * 2 * s.layers * sizeof(uint4)));
        CHECK(cudaMemset(w, 0, wregion * 2 * s.layers * sizeof(uint4)));
        CHECK(cudaMemset(counters, 0, s.heads * sizeof(uint32_t)));
        std::vector<float> h_inv(HD / 2);
        for (int i = 0; i < HD / 2; ++i) h_inv[i] = (float)std::pow(10000.0, -2.0 * i / HD);
        CHECK(cudaMemcpy(inv_freq, h_inv.data(), HD / 2 * sizeof(float), cudaMemcpyHostToDevice));
        std::vector<bf16> h_cache(cache);
        uint32_t seed = 12345;
        for (size_t i = 0; i < cache; ++i) {
            seed = seed * 1664525u + 1013904223u;
            h_cache[i] = __float2bfloat16((float)(seed >> 8) / 8388608.0f - 1.0f);
        }
        CHECK(cudaMemcpy(kc, h_cache.data(), cache * sizeof(bf16), cudaMemcpyHostToDevice));
        for (size_t i = 0; i < cache; ++i) h_cache[i] = __float2bfloat16(__bfloat162float(h_cache[i]) * 0.5f);
        CHECK(cudaMemcpy(vc, h_cache.data(), cache * sizeof(bf16), cudaMemcpyHostToDevice));
        const size_t eng_dyn = (((size_t)splits * (HD + 2) * 4 + 15) & ~(size_t)15) + 2 * ATTN_EARLY_ROWS * 128 * 16;
        const size_t c_dyn = (((size_t)splits * CW * (HD + 4) * 4 + 15) & ~(size_t)15) + 2 * ATTN_EARLY_ROWS * CW * 32 * 16;
        const float scale = 1.0f / std::sqrt((float)HD);
        for (int p : positions) {
            const uint32_t hp = (uint32_t)p;
            CHECK(cudaMemcpy(pos, &hp, sizeof hp, cudaMemcpyHostToDevice));
            const int rows = (p + 1 + splits - 1) / splits;
            if (rows > C_ROWS) {
                std::printf("%s pos %d: %d rows a split, more than the compact kernel holds\n", s.name, p, rows);
                continue;
            }
            // Per variant: outputs, qkv rows and (for the attentions) the caches after the run.
            std::vector<std::vector<float>> o_v(N_VARIANTS), q_v(N_VARIANTS);
            std::vector<std::vector<bf16>> k_v(N_VARIANTS), v_v(N_VARIANTS);
            float t[N_VARIANTS];
            double herr[N_VARIANTS] = {}, href[N_VARIANTS] = {};
            for (int v = 0; v < N_VARIANTS; ++v) {
                CHECK(cudaMemset(x, 0, s.hidden * sizeof(float)));
                CHECK(cudaMemset(outs, 0, (size_t)s.layers * out_n * sizeof(float)));
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int l = 0; l < s.layers; ++l) {
                    float *q = qkv + (size_t)l * qkv_n, *o = outs + (size_t)l * out_n;
                    bf16 *kl = kc + (size_t)l * s.kv_heads * capacity * HD, *vl = vc + (size_t)l * s.kv_heads * capacity * HD;
                    const uint4 *w0 = w + (size_t)(2 * l) * wregion, *w1 = w + (size_t)(2 * l + 1) * wregion;
                    launch(st, sms, 256, true, gemv_like, (const float *)x, s.hidden, q, qkv_n, w0, (float)l);
                    if (v == COPY) {
                        launch_attn(st, dim3(s.heads, splits, 1), CW * 32, splits, 0, attn_copy, (const float *)q, o);
                    } else if (v == ENGINE) {
                        launch_attn(st, dim3(s.heads, splits, 1), 128, splits, eng_dyn, ferrum_attn_rope_early_bf16,
                                    (const float *)q, qkv_n, kl, vl, o, part_acc, part_ml, counters,
                                    (const uint32_t *)pos, s.heads, s.kv_heads, HD, capacity, scale,
                                    (const bf16 *)nullptr, (const bf16 *)nullptr, (const bf16 *)nullptr,
                                    (const float *)inv_freq, 1e-5f);
                    } else if (v >= PUSH0) {
                        void (*const k[4])(const float *, float *) = {attn_push<PUSH_ENGINE>, attn_push<PUSH_ENGINE4>,
                                                                      attn_push<PUSH_COMPACT>, attn_push<PUSH_COMPACT4>};
                        launch_attn(st, dim3(s.heads, splits, 1), CW * 32, splits, 0, k[v - PUSH0], (const float *)q, o);
                    } else if (v >= COMPACT) {
                        void (*const k[3])(const float *, bf16 *, bf16 *, float *, const uint32_t *, const float *, int,
                                           int, int, float) = {attn_c64<bf16, C_SCALAR>, attn_c64<bf16, C_WARP4>,
                                                               attn_c64<bf16, C_BLOCK>};
                        launch_attn(st, dim3(s.heads, splits, 1), CW * 32, splits, c_dyn, k[v - COMPACT],
                                    (const float *)q, kl, vl, o, (const uint32_t *)pos, (const float *)inv_freq,
                                    s.heads, s.kv_heads, capacity, scale);
                    }
                    launch(st, sms, 256, true, gemv_like, (const float *)(v == NONE ? q : o), out_n, x, s.hidden, w1,
                           (float)l + 0.5f);
                }
                CHECK(cudaStreamEndCapture(st, &graph));
                CHECK(cudaGraphInstantiate(&exec, graph, 0));
                t[v] = time_graph(exec, st, s.layers, REPS);
                CHECK(cudaStreamSynchronize(st));
                CHECK(cudaGraphExecDestroy(exec));
                CHECK(cudaGraphDestroy(graph));
                o_v[v].resize((size_t)s.layers * out_n);
                q_v[v].resize((size_t)s.layers * qkv_n);
                CHECK(cudaMemcpy(o_v[v].data(), outs, o_v[v].size() * sizeof(float), cudaMemcpyDeviceToHost));
                CHECK(cudaMemcpy(q_v[v].data(), qkv, q_v[v].size() * sizeof(float), cudaMemcpyDeviceToHost));
                if (v >= PUSH0) {  // block 0 wrote parts x q
                    const int parts = v - PUSH0 >= PUSH_COMPACT ? splits * CW : splits;
                    for (int l = 0; l < s.layers; ++l)
                        for (int i = 0; i < out_n; ++i) {
                            const double r = parts * (double)q_v[v][(size_t)l * qkv_n + i];
                            herr[v] = std::max(herr[v], std::fabs(o_v[v][(size_t)l * out_n + i] - r) / std::fabs(r));
                        }
                } else if (v == COPY) {  // the caches before any attention ran at this position
                    k_v[v].resize(cache), v_v[v].resize(cache);
                    CHECK(cudaMemcpy(k_v[v].data(), kc, cache * sizeof(bf16), cudaMemcpyDeviceToHost));
                    CHECK(cudaMemcpy(v_v[v].data(), vc, cache * sizeof(bf16), cudaMemcpyDeviceToHost));
                } else if (v >= ENGINE) {
                    // Every layer against the host reference, from this run's own qkv rows and cache.
                    k_v[v].resize(cache), v_v[v].resize(cache);
                    CHECK(cudaMemcpy(k_v[v].data(), kc, cache * sizeof(bf16), cudaMemcpyDeviceToHost));
                    CHECK(cudaMemcpy(v_v[v].data(), vc, cache * sizeof(bf16), cudaMemcpyDeviceToHost));
                    for (int l = 0; l < s.layers; ++l) {
                        const size_t lo = (size_t)l * s.kv_heads * capacity * HD;
                        host_attention(q_v[v].data() + (size_t)l * qkv_n, k_v[v].data() + lo, v_v[v].data() + lo,
                                       s.heads, s.kv_heads, capacity, p, h_inv, scale, o_v[v].data() + (size_t)l * out_n,
                                       herr[v], href[v]);
                    }
                }
            }
            auto ok = [](double e, double r) { return e <= 1e-4 * std::max(r, 1e-3) ? "" : " MISMATCH"; };
            std::printf("%-13s pos %3d (%2d rows a split): none %5.2f  copy +%4.2f  engine +%4.2f  compact: scalar push "
                        "+%4.2f, a warp's in one store +%4.2f, the block's +%4.2f\n",
                        s.name, p, rows, t[NONE], t[COPY] - t[NONE], t[ENGINE] - t[NONE], t[COMPACT] - t[NONE],
                        t[COMPACT + 1] - t[NONE], t[COMPACT + 2] - t[NONE]);
            std::printf("    max |err| against the host reference (every layer; max |ref| %.2e): engine %.1e%s",
                        href[ENGINE], herr[ENGINE], ok(herr[ENGINE], href[ENGINE]));
            for (int v = COMPACT; v < PUSH0; ++v) std::printf(", %.1e%s", herr[v], ok(herr[v], href[v]));
            std::printf("\n");
            // Each compact run against the engine's: outputs, and where their inputs part (the
            // first layer whose qkv row differs; the first cache element that differs).
            for (int v = COMPACT; v < PUSH0; ++v) {
                double d = 0.0, r = 0.0;
                for (size_t i = 0; i < o_v[v].size(); ++i) {
                    d = std::max(d, (double)std::fabs(o_v[v][i] - o_v[ENGINE][i]));
                    r = std::max(r, (double)std::fabs(o_v[ENGINE][i]));
                }
                if (!*ok(d, r)) continue;
                int ql = -1;
                for (int l = 0; l < s.layers && ql < 0; ++l)
                    for (int i = 0; i < qkv_n; ++i)
                        if (std::fabs(q_v[v][(size_t)l * qkv_n + i] - q_v[ENGINE][(size_t)l * qkv_n + i]) > 1e-5) ql = l;
                long long ck = -1;
                for (size_t i = 0; i < cache && ck < 0; ++i)
                    if (std::memcmp(&k_v[v][i], &k_v[ENGINE][i], sizeof(bf16)) ||
                        std::memcmp(&v_v[v][i], &v_v[ENGINE][i], sizeof(bf16)))
                        ck = (long long)i;
                std::printf("    compact %d against the engine: max |diff| %.2e MISMATCH; qkv rows part at layer %d; "
                            "first differing cache element: %s",
                            v - COMPACT, d, ql, ck < 0 ? "none\n" : "");
                if (ck >= 0)
                    std::printf("layer %lld, kv head %lld, row %lld\n", ck / ((long long)s.kv_heads * capacity * HD),
                                ck / ((long long)capacity * HD) % s.kv_heads, ck / HD % capacity);
            }
            // What each attention run wrote into the caches, besides row pos (nothing, if correct).
            for (int v = ENGINE; v < PUSH0; ++v) {
                long long n = 0, first = -1;
                for (size_t i = 0; i < cache; ++i)
                    if ((long long)(i / HD % capacity) != p &&
                        (std::memcmp(&k_v[v][i], &k_v[COPY][i], sizeof(bf16)) ||
                         std::memcmp(&v_v[v][i], &v_v[COPY][i], sizeof(bf16))))
                        first = first < 0 ? (long long)i : first, ++n;
                if (n)
                    std::printf("    %s wrote %lld cache elements outside row %d (first: layer %lld, kv head %lld, row %lld) "
                                "MISMATCH\n",
                                v == ENGINE ? "the engine" : "a compact kernel", n, p,
                                first / ((long long)s.kv_heads * capacity * HD), first / ((long long)capacity * HD) % s.kv_heads,
                                first / HD % capacity);
            }
            std::printf("    push alone: engine's +%4.2f, in 16-byte stores +%4.2f; compact's +%4.2f, in 16-byte "
                        "stores +%4.2f; max relative err %.1e%s\n",
                        t[PUSH0] - t[NONE], t[PUSH0 + 1] - t[NONE], t[PUSH0 + 2] - t[NONE], t[PUSH0 + 3] - t[NONE],
                        std::max({herr[PUSH0], herr[PUSH0 + 1], herr[PUSH0 + 2], herr[PUSH0 + 3]}),
                        std::max({herr[PUSH0], herr[PUSH0 + 1], herr[PUSH0 + 2], herr[PUSH0 + 3]}) <= 1e-5
                            ? ""
                            : " MISMATCH");
        }
        CHECK(cudaFree(x));
        CHECK(cudaFree(qkv));
        CHECK(cudaFree(outs));
        CHECK(cudaFree(part_acc));
        CHECK(cudaFree(part_ml));
        CHECK(cudaFree(counters));
        CHECK(cudaFree(pos));
        CHECK(cudaFree(inv_freq));
        CHECK(cudaFree(kc));
        CHECK(cudaFree(vc));
        CHECK(cudaFree(w));
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}
