// RoPE (HF Llama half-split) fused with the optional bias add (Qwen2), the
// optional per-head q/k RMSNorm (Qwen3) and the append of K/V to the cache;
// GQA attention over one sequence's cache (split over the KV length,
// flash-decoding style) and the combine of the splits; and for one decode token
// the attention with that RoPE work inside it (ferrum_attn_rope_*).
//
// Layouts: qkv rows are [q heads | k heads | v heads] x head_dim, one row per
// token, in fp32 (as are the attention outputs); the cache is in the model dtype. A layer's cache is [kv_heads][capacity][head_dim]. Positions come
// from device memory (pos_base[0] + token index), so the launch does not
// depend on the position (CUDA graphs can replay it).
#include "common.cuh"
#include <mma.h>

// RoPE's per-pair math, shared by rope_qkv and the fused attention (rope_head) so that the two
// agree bit for bit: thread i < half holds the pair (a, b) = (x[i], x[i + half]) of one head
// (zeros for the other threads); adds the bias (when non-null), applies the head's RMSNorm with
// weight nw (when non-null: the sum of squares runs through block_sum, so every thread of the
// block must call this, and threads without a pair add exact zeros), then rotates by
// pos * inv_freq[i] (when `rotate`). Sharing the source is not enough: inlined into two
// kernels, the compiler may contract a * c - b * sn into an FMA in one and not the other
// (seen on the GPU). So every step is an explicitly rounded intrinsic (__fmul_rn, __fadd_rn,
// __fsub_rn, __fmaf_rn), which nvcc never contracts or reorders.
template <typename T>
__device__ __forceinline__ void rope_pair(float &a, float &b, bool active, int i, int half,
                                          int hd, const T *bias, int off, const T *nw,
                                          bool rotate, const float *inv_freq, uint32_t pos,
                                          float eps, float *red) {
    if (active && bias != nullptr) {
        a = __fadd_rn(a, to_f(bias[off + i]));
        b = __fadd_rn(b, to_f(bias[off + i + half]));
    }
    if (nw != nullptr) {  // uniform over the block
        const float ss = block_sum(__fmaf_rn(a, a, __fmul_rn(b, b)), red);
        const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)hd), eps));
        if (active) {
            a = __fmul_rn(__fmul_rn(a, r), to_f(nw[i]));
            b = __fmul_rn(__fmul_rn(b, r), to_f(nw[i + half]));
        }
    }
    if (rotate && active) {
        // The angle in f32 (as HF computes it); its sine and cosine through sincospi in f64,
        // whose argument reduction is exact (no Payne-Hanek path with its local array, which
        // sincosf needs for angles past 105615 and which cost a stack frame here), then rounded
        // to f32: at least as accurate as sincosf, at any position.
        const float theta = __fmul_rn((float)pos, inv_freq[i]);
        double sd, cd;
        sincospi(__dmul_rn((double)theta, 0.318309886183790671537767526745), &sd, &cd);  // 1/pi
        const float sn = (float)sd, c = (float)cd;
        const float na = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn));
        const float nb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn));
        a = na;
        b = nb;
    }
}

// grid (heads + 2*kv_heads, n_tok); block: round_up(head_dim/2, 32) threads.
template <typename T>
__device__ void rope_qkv(float *qkv, const T *bias, const T *q_norm, const T *k_norm, T *k_cache,
                         T *v_cache, const float *inv_freq, const uint32_t *pos_base, int heads,
                         int kv_heads, int hd, int capacity, float eps) {
    __shared__ float sh[32];
    const int h = blockIdx.x, tok = blockIdx.y, i = threadIdx.x, half_d = hd >> 1;
    const int row_len = (heads + 2 * kv_heads) * hd;
    float *row = qkv + (size_t)tok * row_len;
    const uint32_t pos = pos_base[0] + (uint32_t)tok;
    const bool active = i < half_d;
    const int off = h * hd;
    float a = 0.0f, b = 0.0f;
    if (active) {
        a = row[off + i];
        b = row[off + i + half_d];
    }
    const bool is_q = h < heads, is_v = h >= heads + kv_heads;
    rope_pair<T>(a, b, active, i, half_d, hd, bias, off, is_v ? nullptr : (is_q ? q_norm : k_norm),
                 !is_v, inv_freq, pos, eps, sh);
    if (is_q) {  // q stays fp32 (in place); only K/V are rounded, into the cache
        if (active) {
            row[off + i] = a;
            row[off + i + half_d] = b;
        }
        return;
    }
    if (pos >= (uint32_t)capacity) return;  // bounds guard (the host validates positions first)
    const int kvh = is_v ? h - heads - kv_heads : h - heads;
    T *dst = (is_v ? v_cache : k_cache) + ((size_t)kvh * capacity + pos) * hd;
    if (active) {
        dst[i] = from_f<T>(a);
        dst[i + half_d] = from_f<T>(b);
    }
}

// Merges the n_splits partials of (token `tok`, head `h`) into out[tok][h*hd + d] for
// d = threadIdx.x, threadIdx.x + blockDim.x, ... < hd, in split order (so the result does not
// depend on which block runs it). `ld` loads a partial (plain, or L2-coherent `__ldcg` when
// other blocks wrote it in the same launch).
__device__ __forceinline__ void merge_into(float *out, const float *part_acc, const float *part_ml,
                                           int tok, int h, int heads, int hd, int n_splits) {
    const size_t base = ((size_t)tok * heads + h) * n_splits;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float M = FERRUM_NEG_INF;
        for (int s = 0; s < n_splits; ++s) M = fmaxf(M, __ldcg(part_ml + (base + s) * 2));
        float L = 0.0f, A = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float ms = __ldcg(part_ml + (base + s) * 2);
            if (ms == FERRUM_NEG_INF) continue;
            const float w = expf(ms - M);
            L += __ldcg(part_ml + (base + s) * 2 + 1) * w;
            A += __ldcg(part_acc + (base + s) * hd + d) * w;
        }
        out[(size_t)tok * heads * hd + h * hd + d] = L > 0.0f ? A / L : 0.0f;
    }
}

// The last of the n_splits blocks of one (token, head) to finish merges their partials, so no
// separate combine launch is needed (the "last block" pattern of CUDA's threadFenceReduction
// sample). Why the last block sees every partial: each thread fences its partial writes
// (__threadfence: visible device-wide before anything it does later), the block synchronises,
// then thread 0 takes a ticket with atomicInc; a block that draws ticket n_splits - 1 knows
// every other block took its ticket after fencing its writes, and it reads them through L2
// (__ldcg, never a stale L1 line). atomicInc wraps the counter from n_splits - 1 back to 0 with
// that last ticket, so it is 0 again for the next launch with no separate store. Called by
// every thread of the block.
__device__ void merge_splits(float *out, const float *part_acc, const float *part_ml,
                             uint32_t *counter, int heads, int hd, int n_splits) {
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t ticket = atomicInc(counter, (uint32_t)n_splits - 1);
        s_last = ticket == (uint32_t)n_splits - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    merge_into(out, part_acc, part_ml, blockIdx.z, blockIdx.x, heads, hd, n_splits);
}

#define ATTN_MAX_WARPS 8
#define ATTN_MAX_HD 256
// Scores held in shared memory at a time; longer splits run tile after tile with the online
// softmax rescale between tiles.
#define ATTN_TILE 512
// TPW * HD = 32 * 8 * CH / G <= 256 for every HD, so the value partials take at most
// ATTN_MAX_WARPS * 256 floats.
#define ATTN_SMEM_FLOATS (3 * ATTN_MAX_HD + ATTN_TILE + 32 + ATTN_MAX_WARPS * 256)

// How a warp covers cache rows of head_dim HD: each lane takes one 16-byte chunk (8 values)
// of a row, G lanes (a power of two >= the HD / 8 chunks, the extra lanes idle) share one row,
// so a warp walks TPW rows at once.
template <int HD> struct AttnGeom {
    static constexpr int CH = HD / 8;
    static constexpr int G = CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
    static constexpr int TPW = 32 / G;
};

// What ferrum_attn_rope_* adds to the attention: rope_qkv's inputs and the cache to append to.
template <typename T> struct RopeArgs {
    const T *bias, *q_norm, *k_norm;  // each may be null
    const float *inv_freq;
    T *k_out, *v_out;                 // the caches (k_cache / v_cache), written at row pos
    float eps;
};

__device__ __forceinline__ float block_max(float v, float *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = FERRUM_NEG_INF;
    for (int w = 0; w < nw; ++w) v = fmaxf(v, sh[w]);
    __syncthreads();
    return v;
}

// The decode attention's own RoPE (ferrum_attn_rope_*): dst[0..HD) = the head whose raw pair
// (a, b) = (x[i], x[i + HD/2]) thread i < HD/2 holds (loaded by the caller, so the loads of q, k
// and v are in flight together), with the bias at `off`, the optional per-head RMSNorm `nw`
// and, when `rotate`, RoPE at position pos, through the same rope_pair as rope_qkv (the
// norm's sum runs through block_sum, whose extra warps add exact zeros), so the fused and
// the separate kernels agree bit for bit. With `round` the values are rounded to the cache
// dtype (as the separate kernel's cache write does). Called by every thread of the block
// (blockDim.x >= HD/2, checked by the host); `dst` is read after a barrier.
template <typename T, int HD>
__device__ void rope_head(float *dst, float a, float b, const T *bias, const T *nw, bool rotate,
                          bool round, const float *inv_freq, uint32_t pos, int off, float eps,
                          float *red) {
    constexpr int HALF = HD / 2;
    const int i = threadIdx.x;
    const bool active = i < HALF;
    rope_pair<T>(a, b, active, i, HALF, HD, bias, off, nw, rotate, inv_freq, pos, eps, red);
    if (active) {
        dst[i] = round ? to_f(from_f<T>(a)) : a;
        dst[i + HALF] = round ? to_f(from_f<T>(b)) : b;
    }
}

// Copies issued before the programmatic-launch wait (ferrum_attn_rope_* only). The position is
// a weak L2 load (.cg: never a stale L1 line); cache rows go straight to shared memory with
// cp.async (.cg, 16 bytes), so they hold no registers while the previous kernel finishes. Both
// are asm volatile, so that neither the compiler nor ptxas moves them past the wait (see
// ldg_early in gemv.cu for why a plain __ldg would be).
__device__ __forceinline__ uint32_t ld_early(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void cp_early16(uint4 *dst_smem, const uint4 *src) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst_smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
// Waits for this thread's own cp.async copies (each thread reads back only what it copied).
__device__ __forceinline__ void cp_early_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Cache rows per row slot that ferrum_attn_rope_* copies to shared memory before the wait (K
// and V: 2 * 16 * ATTN_EARLY_ROWS bytes per thread, 32 KiB for 8 warps, in dynamic shared
// memory). When a split's rows fit (ATTN_EARLY_ROWS x the block's slots; the host picks 4 or 8
// warps for that, plan::attn_warps, and plan::ATTN_EARLY_ROWS must equal this), every cache
// load is in flight before the previous kernel ends; longer splits get no buffer and walk the
// cache after the wait.
#define ATTN_EARLY_ROWS 4
// Every early row lies in the first tile: slots <= ATTN_MAX_WARPS * 16 (G >= 2 lanes per row).
static_assert(ATTN_EARLY_ROWS * ATTN_MAX_WARPS * 16 <= ATTN_TILE, "early rows fit the first tile");

// grid (heads, n_splits, n_tok); block: 32 * n_warps threads (n_warps <= 8).
// Query token `tok` sits at position pos_base[0] + tok and attends to cache rows [0, pos].
// Split s covers an equal share of those rows (the share is computed from the length read on
// the device). With one split the normalised output is written to `out` [n_tok][heads*hd];
// otherwise the unnormalised partials go to part_acc [n_tok][heads][n_splits][hd] and part_ml
// (max, sum), and then either a separate attn_combine launch merges them (`counters` null) or
// the last split block of each (token, head) does (see merge_splits).
//
// The walk over rows is built for latency (batch-1 decode reads few rows per block): no loop
// iteration waits on the previous one, so every load of a pass is in flight at once.
// 1. scores: G lanes per row, a 16-byte load each, a dot with the scaled q, a G-lane
//    butterfly; each row's score goes to shared memory (s_p);
// 2. the tile's maximum and exp(score - max) over the block, the running (m, l) rescaled;
// 3. values: the same lane layout, acc += p * v per lane (8 values), one partial per row slot
//    (warp, row of the warp), summed over the slots in slot order at the end.
// Every order is fixed by the launch shape, so results are deterministic.
//
// ROPE (ferrum_attn_rope_*, one decode token): `q` is the raw qkv row and this kernel also does
// rope_qkv's work. Every block computes its head's q; the block whose split holds the new row
// (position pos) computes that row's K and V and uses them from shared memory, never from the
// cache, and the first query head of each KV group writes them to the cache for later steps.
// No block of the launch reads cache row pos, so that write races with nothing.
// ROPE also loads the position and up to ATTN_EARLY_ROWS cache rows per slot (K and V) before
// the programmatic-launch wait, while the QKV projection finishes. Why that is safe: every
// decode kernel waits (griddepcontrol.wait) before it lets its dependent launch, so when this
// grid starts, every kernel before the one it depends on has completed and its writes are
// visible. (A kernel that never signals, such as a cuBLAS GEMM on the cuBLAS decode path,
// counts as finished only when it completes, which keeps the chain.) The kernel it depends on
// (the QKV projection, a GEMV or a GEMM) writes neither the position (the previous step's
// argmax, or a host copy, wrote it) nor the cache (rows below pos were written by earlier
// attention launches, row pos is never read here), and the loads go through L2.
template <typename T, int HD, bool ROPE, bool EARLY>
__device__ void attn_impl(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                          float *out, float *part_acc, float *part_ml, uint32_t *counters,
                          const uint32_t *pos_base, int heads, int kv_heads, int capacity,
                          float scale, float *smem, uint4 *s_early, const RopeArgs<T> &rope) {
    constexpr int CH = AttnGeom<HD>::CH, G = AttnGeom<HD>::G, TPW = AttnGeom<HD>::TPW;
    // smem (ATTN_SMEM_FLOATS, shared by every HD instance): q, the tile's scores, a reduction
    // scratch, and the per-slot value partials [ATTN_MAX_WARPS * TPW][HD].
    float *s_q = smem, *s_k = s_q + ATTN_MAX_HD, *s_v = s_k + ATTN_MAX_HD;
    float *s_p = s_v + ATTN_MAX_HD, *s_red = s_p + ATTN_TILE;
    float(*s_acc)[HD] = reinterpret_cast<float(*)[HD]>(s_red + 32);
    const int h = blockIdx.x, split = blockIdx.y, tok = blockIdx.z, n_splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int gl = lane % G, sub = lane / G;        // chunk of the row, row of the warp
    const int slots = nw * TPW, slot = warp * TPW + sub;
    const bool chunk_on = gl < CH;
    if (!ROPE) FERRUM_PDL_ENTRY();  // the position and the cache may come from the last kernel
    const uint32_t pos = (ROPE ? ld_early(pos_base) : pos_base[0]) + (uint32_t)tok;
    const int len = (int)min(pos + 1u, (uint32_t)capacity);
    const int chunk = (len + n_splits - 1) / n_splits;
    const int start = split * chunk;
    const int end = min(start + chunk, len);
    const int kvh = h / (heads / kv_heads);
    // Chunk gl of row t starts at element t * HD + gl * 8: 16-byte aligned (HD % 8 == 0 and the
    // cache is a cuMemAlloc allocation whose layer regions start at multiples of HD elements).
    const uint4 *kb = reinterpret_cast<const uint4 *>(k_cache + (size_t)kvh * capacity * HD) + gl;
    const uint4 *vb = reinterpret_cast<const uint4 *>(v_cache + (size_t)kvh * capacity * HD) + gl;

    // ROPE: this thread's chunk of its slot's first ATTN_EARLY_ROWS rows of the split (rows
    // start + slot + u * slots, the first iterations of the score and value loops below),
    // copied to s_early (K at u * blockDim.x + threadIdx.x, V ER * blockDim.x further) before
    // the wait. Rows past the split, row pos (not written yet) and idle lanes copy nothing,
    // and nothing reads those slots.
    // Only with a wait to run ahead of (FERRUM_HAS_PDL); without, the copies would gain nothing.
    // The copies go to the launch's dynamic shared memory; the host gives it (2 * ER chunks
    // per thread) only when the whole split fits in the early rows (plan::attn_warps): for
    // long splits the buffer would cost more occupancy than the early rows save.
    // A separate instance (EARLY, ferrum_attn_rope_early_*): its buffer handling costs ~40
    // registers, which would halve the blocks resident per multiprocessor for long contexts.
    constexpr int ER = ROPE && EARLY && FERRUM_HAS_PDL ? ATTN_EARLY_ROWS : 0;
    uint32_t dyn_bytes = 0;
    if (ER > 0) asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
    const bool early = ER > 0 && dyn_bytes >= 2u * ER * blockDim.x * (uint32_t)sizeof(uint4);
    if (early) {
#pragma unroll
        for (int u = 0; u < ER; ++u) {
            const int t = start + slot + u * slots;
            if (chunk_on && t < end && t != (int)pos) {
                cp_early16(s_early + u * blockDim.x + threadIdx.x, kb + (size_t)t * CH);
                cp_early16(s_early + (ER + u) * blockDim.x + threadIdx.x, vb + (size_t)t * CH);
            }
        }
    }

    const float *qh = q + (size_t)tok * q_stride + h * HD;
    // The new row (ROPE only): its position when this split holds it, else -1.
    int new_row = -1;
    if (ROPE) {
        FERRUM_PDL_ENTRY();  // q, k and v of the new token come from the QKV projection
        if (early) cp_early_wait();
        const float *row = q + (size_t)tok * q_stride;
        const int i = threadIdx.x, half = HD / 2;
        const bool has_new = (int)pos >= start && (int)pos < end;  // pos < len <= capacity
        const int k_off = (heads + kvh) * HD, v_off = (heads + kv_heads + kvh) * HD;
        // The raw pairs of q, k and v, loaded together (k and v only where needed).
        float qa = 0.0f, qb = 0.0f, ka = 0.0f, kb2 = 0.0f, va = 0.0f, vb2 = 0.0f;
        if (i < half) {
            qa = row[h * HD + i];
            qb = row[h * HD + i + half];
            if (has_new) {
                ka = row[k_off + i];
                kb2 = row[k_off + i + half];
                va = row[v_off + i];
                vb2 = row[v_off + i + half];
            }
        }
        rope_head<T, HD>(s_q, qa, qb, rope.bias, rope.q_norm, true, false, rope.inv_freq, pos,
                         h * HD, rope.eps, s_red);
        if (has_new) {  // uniform over the block
            new_row = (int)pos;
            rope_head<T, HD>(s_k, ka, kb2, rope.bias, rope.k_norm, true, true, rope.inv_freq, pos,
                             k_off, rope.eps, s_red);
            rope_head<T, HD>(s_v, va, vb2, rope.bias, nullptr, false, true, rope.inv_freq, pos,
                             v_off, rope.eps, s_red);
        }
        __syncthreads();
        if (new_row >= 0 && h % (heads / kv_heads) == 0) {
            const size_t at = ((size_t)kvh * capacity + pos) * HD;
            for (int d = threadIdx.x; d < HD; d += blockDim.x) {
                rope.k_out[at + d] = from_f<T>(s_k[d]);  // exact: s_k is already rounded
                rope.v_out[at + d] = from_f<T>(s_v[d]);
            }
        }
        for (int d = threadIdx.x; d < HD; d += blockDim.x) s_q[d] *= scale;
    } else {
        for (int d = threadIdx.x; d < HD; d += blockDim.x) s_q[d] = qh[d] * scale;
    }
    __syncthreads();
    float qv[8], acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        qv[j] = chunk_on ? s_q[gl * 8 + j] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = FERRUM_NEG_INF, l = 0.0f;  // block-uniform: they come from block reductions
    for (int t0 = start; t0 < end; t0 += ATTN_TILE) {
        const int n = min(ATTN_TILE, end - t0);
        // The early rows lie in the first tile (ER * slots <= ATTN_EARLY_ROWS * ATTN_MAX_WARPS
        // * 16 = ATTN_TILE at most: static_assert below); later iterations and tiles load from
        // the cache here.
        const int ib_late = warp * TPW + (early && t0 == start ? ER * slots : 0);
        // 1. Scores. The loop bounds are warp-uniform (every lane reaches the shuffles).
        if (early && t0 == start) {
#pragma unroll
            for (int u = 0; u < ER; ++u) {
                const int ib = warp * TPW + u * slots;
                if (ib < n) {
                    const int i = ib + sub;
                    float sc = 0.0f;
                    if (i < n && chunk_on) {
                        float kf[8];
                        if (t0 + i == new_row) {
#pragma unroll
                            for (int j = 0; j < 8; ++j) kf[j] = s_k[gl * 8 + j];
                        } else {
                            unpack8(s_early[u * blockDim.x + threadIdx.x], kf, T());
                        }
#pragma unroll
                        for (int j = 0; j < 8; ++j) sc = fmaf(qv[j], kf[j], sc);
                    }
#pragma unroll
                    for (int o = G / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
                    if (i < n && gl == 0) s_p[i] = sc;
                }
            }
        }
#pragma unroll 4
        for (int ib = ib_late; ib < n; ib += slots) {
            const int i = ib + sub;
            float sc = 0.0f;
            if (i < n && chunk_on) {
                float kf[8];
                if (ROPE && t0 + i == new_row) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) kf[j] = s_k[gl * 8 + j];
                } else {
                    unpack8(__ldg(kb + (size_t)(t0 + i) * CH), kf, T());
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) sc = fmaf(qv[j], kf[j], sc);
            }
#pragma unroll
            for (int o = G / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
            if (i < n && gl == 0) s_p[i] = sc;
        }
        __syncthreads();
        // 2. Softmax bookkeeping over the tile.
        float mt = FERRUM_NEG_INF;
        for (int i = threadIdx.x; i < n; i += blockDim.x) mt = fmaxf(mt, s_p[i]);
        mt = block_max(mt, s_red);
        const float mn = fmaxf(m, mt);
        const float corr = expf(m - mn);  // exp(-inf) = 0 on the first tile
        float ls = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float p = expf(s_p[i] - mn);
            s_p[i] = p;
            ls += p;
        }
        ls = block_sum(ls, s_red);  // its barriers also publish s_p
        l = l * corr + ls;
        m = mn;
        // 3. Values.
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] *= corr;
        if (early && t0 == start) {
#pragma unroll
            for (int u = 0; u < ER; ++u) {
                const int i = warp * TPW + u * slots + sub;
                if (i < n && chunk_on) {
                    const float p = s_p[i];
                    float vf[8];
                    if (t0 + i == new_row) {
#pragma unroll
                        for (int j = 0; j < 8; ++j) vf[j] = s_v[gl * 8 + j];
                    } else {
                        unpack8(s_early[(ER + u) * blockDim.x + threadIdx.x], vf, T());
                    }
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[j] = fmaf(p, vf[j], acc[j]);
                }
            }
        }
#pragma unroll 4
        for (int ib = ib_late; ib < n; ib += slots) {
            const int i = ib + sub;
            if (i < n && chunk_on) {
                const float p = s_p[i];
                float vf[8];
                if (ROPE && t0 + i == new_row) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) vf[j] = s_v[gl * 8 + j];
                } else {
                    unpack8(__ldg(vb + (size_t)(t0 + i) * CH), vf, T());
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[j] = fmaf(p, vf[j], acc[j]);
            }
        }
        __syncthreads();  // s_p is rewritten by the next tile
    }
    if (chunk_on) {
#pragma unroll
        for (int j = 0; j < 8; ++j) s_acc[slot][gl * 8 + j] = acc[j];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float A = 0.0f;
        for (int sl = 0; sl < slots; ++sl) A += s_acc[sl][d];
        if (n_splits == 1) {
            out[(size_t)tok * heads * HD + h * HD + d] = l > 0.0f ? A / l : 0.0f;
        } else {
            part_acc[(((size_t)tok * heads + h) * n_splits + split) * HD + d] = A;
        }
    }
    if (n_splits > 1 && threadIdx.x == 0) {
        float *ml = part_ml + (((size_t)tok * heads + h) * n_splits + split) * 2;
        ml[0] = m;
        ml[1] = l;
    }
    if (n_splits > 1 && counters != nullptr)
        merge_splits(out, part_acc, part_ml, counters + (size_t)tok * heads + h, heads, HD, n_splits);
}

template <typename T, bool ROPE, bool EARLY = false>
__device__ void attn(const float *q, int q_stride, const T *k_cache, const T *v_cache, float *out,
                     float *part_acc, float *part_ml, uint32_t *counters,
                     const uint32_t *pos_base, int heads, int kv_heads, int hd, int capacity,
                     float scale, const RopeArgs<T> &rope) {
    __shared__ __align__(16) float smem[ATTN_SMEM_FLOATS];
    // The early K/V copies (ROPE only): 2 * ATTN_EARLY_ROWS chunks per thread, in the launch's
    // dynamic shared memory (none unless the host enables them).
    extern __shared__ uint4 s_early[];
    switch (hd) {
    case 16:
        attn_impl<T, 16, ROPE, EARLY>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                         kv_heads, capacity, scale, smem, s_early, rope);
        break;
    case 32:
        attn_impl<T, 32, ROPE, EARLY>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                         kv_heads, capacity, scale, smem, s_early, rope);
        break;
    case 64:
        attn_impl<T, 64, ROPE, EARLY>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_early, rope);
        break;
    case 96:
        attn_impl<T, 96, ROPE, EARLY>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_early, rope);
        break;
    case 128:
        attn_impl<T, 128, ROPE, EARLY>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_early, rope);
        break;
    case 256:
        attn_impl<T, 256, ROPE, EARLY>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_early, rope);
        break;
    default:
        break;  // the host only launches supported head dims
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill attention on tensor cores (ferrum_attn_prefill_*): causal attention of n_tok query
// rows (positions pos_base[0] + t) over one layer's cache, head dims 16..128 (multiples of 16).
// The decode kernel above walks rows with CUDA-core dot products, which for a 1024-token
// prompt is n_tok times the whole cache per head; here each block takes PF_BM query rows of
// one head and multiplies them by PF_BN-row tiles of K and V with WMMA (16x16x16, f16 inputs,
// f32 accumulation).
//
// Numerics: q (scaled by `scale`), the K and V tiles and the probabilities are rounded to f16
// for the tensor cores, whatever the model dtype (bf16 caches convert exactly unless a value
// is beyond f16's range, where it is clamped to +-65504 so that no infinity can appear, or
// below 2^-14 in magnitude, where it loses bits as an f16 subnormal or flushes to zero);
// scores, the softmax statistics and the output accumulate in f32. Two passes over the keys:
// the first finds each row's max m and sum l (online, in f32), the second accumulates
// O += (exp(s - m) / l) V, so the output needs no rescaling between tiles (the price is
// computing q K^T twice, which the tensor cores do far faster than the memory walk it
// replaces). Every order is fixed by the launch shape, so results are deterministic.
//
// Grid (heads, ceil(n_tok / PF_BM)); block PF_WARPS * 32 threads; warp w owns query rows
// q0 + 16 w .. + 16 of the block. Keys of the block: [0, kend) with kend = min(pos of its last
// row + 1, capacity); key j is masked for row t when j > pos_base[0] + t. Rows past kend are
// zero-filled in shared memory (never read from the cache), so masked products are exact
// zeros.

#define PF_WARPS 2
#define PF_BM (16 * PF_WARPS)
#define PF_BN 32

// Shared memory of one block, in halves unless noted: q [PF_BM][HD + 8], k and v
// [PF_BN][HD + 8] (8 halves of padding per row against bank conflicts, keeping every WMMA
// pointer 32-byte aligned), scores (f32) [PF_WARPS][16][PF_BN + 4], probabilities
// [PF_WARPS][16][PF_BN + 8]. At the end the q/k/v region holds the f32 output [PF_BM][HD].
template <int HD> struct PfLayout {
    static constexpr int LDH = HD + 8, LDS = PF_BN + 4, LDP = PF_BN + 8;
    static constexpr int Q = 0, K = Q + PF_BM * LDH * 2, V = K + PF_BN * LDH * 2;  // bytes
    static constexpr int S = V + PF_BN * LDH * 2, P = S + PF_WARPS * 16 * LDS * 4;
    static constexpr int BYTES = P + PF_WARPS * 16 * LDP * 2;
    static_assert(PF_BM * HD * 4 <= S, "the output staging fits in the q/k/v region");
};
#define PF_SMEM_BYTES (PfLayout<128>::BYTES)

__device__ __forceinline__ __half pf_half(float x) {
    return __float2half_rn(fminf(fmaxf(x, -65504.0f), 65504.0f));
}

// Rows [k0, k0 + PF_BN) of one KV head's cache (rows >= kend as zeros) into `dst` as f16.
template <typename T, int HD>
__device__ __forceinline__ void pf_load_tile(__half *dst, const T *cache, int k0, int kend) {
    constexpr int CH = HD / 8, LDH = PfLayout<HD>::LDH;
    for (int c = threadIdx.x; c < PF_BN * CH; c += blockDim.x) {
        const int r = c / CH, ch = c % CH;
        float f[8];
        if (k0 + r < kend) {
            unpack8(__ldg(reinterpret_cast<const uint4 *>(cache + (size_t)(k0 + r) * HD) + ch), f, T());
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) f[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) dst[r * LDH + ch * 8 + j] = pf_half(f[j]);
    }
}

// s_s (this warp's 16 x PF_BN f32 scores) = q (16 x HD, fragments qf) . K tile^T.
template <int HD>
__device__ __forceinline__ void pf_scores(
    float *s_s, const __half *s_k,
    const nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> (&qf)[HD / 16]) {
    using namespace nvcuda;
    constexpr int LDH = PfLayout<HD>::LDH, LDS = PfLayout<HD>::LDS;
#pragma unroll
    for (int nb = 0; nb < PF_BN / 16; ++nb) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            // K^T as matrix_b: element (d, key) at s_k[key * LDH + d], column-major.
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> kf;
            wmma::load_matrix_sync(kf, s_k + nb * 16 * LDH + kk * 16, LDH);
            wmma::mma_sync(acc, qf[kk], kf, acc);
        }
        wmma::store_matrix_sync(s_s + nb * 16, acc, LDS, wmma::mem_row_major);
    }
}

template <typename T, int HD>
__device__ void attn_prefill_impl(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                                  float *out, const uint32_t *pos_base, int n_tok, int heads,
                                  int kv_heads, int capacity, float scale, unsigned char *smem) {
    using namespace nvcuda;
    using L = PfLayout<HD>;
    constexpr int LDH = L::LDH, LDS = L::LDS, LDP = L::LDP;
    __half *s_q = reinterpret_cast<__half *>(smem + L::Q);
    __half *s_k = reinterpret_cast<__half *>(smem + L::K);
    __half *s_v = reinterpret_cast<__half *>(smem + L::V);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *s_s = reinterpret_cast<float *>(smem + L::S) + warp * 16 * LDS;
    __half *s_p = reinterpret_cast<__half *>(smem + L::P) + warp * 16 * LDP;
    const int h = blockIdx.x, q0 = blockIdx.y * PF_BM;
    const int kvh = h / (heads / kv_heads);
    const uint32_t p0 = pos_base[0];
    const int last = min(q0 + PF_BM, n_tok) - 1;  // q0 < n_tok (grid)
    const int kend = (int)min(p0 + (uint32_t)last + 1u, (uint32_t)capacity);
    const T *kc = k_cache + (size_t)kvh * capacity * HD;
    const T *vc = v_cache + (size_t)kvh * capacity * HD;

    // q tile (scaled, f16; rows past n_tok as zeros).
    for (int e = threadIdx.x; e < PF_BM * HD; e += blockDim.x) {
        const int r = e / HD, d = e % HD, t = q0 + r;
        s_q[r * LDH + d] = pf_half(t < n_tok ? q[(size_t)t * q_stride + h * HD + d] * scale : 0.0f);
    }
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> qf[HD / 16];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wmma::load_matrix_sync(qf[kk], s_q + warp * 16 * LDH + kk * 16, LDH);

    // Lane l takes row r = l / 2 of the warp's 16 and the half (l % 2) of each tile's columns.
    const int r = lane >> 1, c0 = (lane & 1) * (PF_BN / 2);
    const int t = q0 + warp * 16 + r;
    const long long lim = (long long)p0 + t;  // last key row t may see
    float m = FERRUM_NEG_INF, l = 0.0f;

    // Pass 1: row max and sum.
    for (int k0 = 0; k0 < kend; k0 += PF_BN) {
        __syncthreads();  // the previous tile is no longer read
        pf_load_tile<T, HD>(s_k, kc, k0, kend);
        __syncthreads();
        pf_scores<HD>(s_s, s_k, qf);
        __syncwarp();
        float mt = FERRUM_NEG_INF;
        for (int c = c0; c < c0 + PF_BN / 2; ++c)
            if (k0 + c <= lim && k0 + c < kend) mt = fmaxf(mt, s_s[r * LDS + c]);
        if (mt != FERRUM_NEG_INF) {
            const float mn = fmaxf(m, mt);
            float ls = 0.0f;
            for (int c = c0; c < c0 + PF_BN / 2; ++c)
                if (k0 + c <= lim && k0 + c < kend) ls += expf(s_s[r * LDS + c] - mn);
            l = l * expf(m - mn) + ls;
            m = mn;
        }
        __syncwarp();  // s_s is rewritten by the next tile
    }
    // The two lanes of a row combine (in lane order, the same on both).
    {
        const float mo = __shfl_xor_sync(0xffffffffu, m, 1), lo = __shfl_xor_sync(0xffffffffu, l, 1);
        const float M = fmaxf(m, mo);
        const float la = (lane & 1) ? lo : l, ma = (lane & 1) ? mo : m;
        const float lb = (lane & 1) ? l : lo, mb = (lane & 1) ? m : mo;
        l = (ma == FERRUM_NEG_INF ? 0.0f : la * expf(ma - M)) + (mb == FERRUM_NEG_INF ? 0.0f : lb * expf(mb - M));
        m = M;
    }
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;

    // Pass 2: O += P V with P = exp(s - m) / l.
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> of[HD / 16];
#pragma unroll
    for (int j = 0; j < HD / 16; ++j) wmma::fill_fragment(of[j], 0.0f);
    for (int k0 = 0; k0 < kend; k0 += PF_BN) {
        __syncthreads();
        pf_load_tile<T, HD>(s_k, kc, k0, kend);
        pf_load_tile<T, HD>(s_v, vc, k0, kend);
        __syncthreads();
        pf_scores<HD>(s_s, s_k, qf);
        __syncwarp();
        for (int c = c0; c < c0 + PF_BN / 2; ++c) {
            const bool on = k0 + c <= lim && k0 + c < kend;
            s_p[r * LDP + c] = __float2half_rn(on ? expf(s_s[r * LDS + c] - m) * inv_l : 0.0f);
        }
        __syncwarp();
#pragma unroll
        for (int kk = 0; kk < PF_BN / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> pf;
            wmma::load_matrix_sync(pf, s_p + kk * 16, LDP);
#pragma unroll
            for (int j = 0; j < HD / 16; ++j) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> vf;
                wmma::load_matrix_sync(vf, s_v + kk * 16 * LDH + j * 16, LDH);
                wmma::mma_sync(of[j], pf, vf, of[j]);
            }
        }
    }
    // Stage the f32 output in the q/k/v region, then write the block's valid rows.
    __syncthreads();
    float *s_o = reinterpret_cast<float *>(smem);  // [PF_BM][HD]
#pragma unroll
    for (int j = 0; j < HD / 16; ++j)
        wmma::store_matrix_sync(s_o + warp * 16 * HD + j * 16, of[j], HD, wmma::mem_row_major);
    __syncthreads();
    for (int e = threadIdx.x; e < PF_BM * HD; e += blockDim.x) {
        const int rr = e / HD, d = e % HD, tt = q0 + rr;
        if (tt < n_tok) out[(size_t)tt * heads * HD + h * HD + d] = s_o[e];
    }
}

template <typename T>
__device__ void attn_prefill(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                             float *out, const uint32_t *pos_base, int n_tok, int heads,
                             int kv_heads, int hd, int capacity, float scale) {
    __shared__ __align__(128) unsigned char smem[PF_SMEM_BYTES];
    switch (hd) {
    case 16:
        attn_prefill_impl<T, 16>(q, q_stride, k_cache, v_cache, out, pos_base, n_tok, heads, kv_heads, capacity, scale, smem);
        break;
    case 32:
        attn_prefill_impl<T, 32>(q, q_stride, k_cache, v_cache, out, pos_base, n_tok, heads, kv_heads, capacity, scale, smem);
        break;
    case 64:
        attn_prefill_impl<T, 64>(q, q_stride, k_cache, v_cache, out, pos_base, n_tok, heads, kv_heads, capacity, scale, smem);
        break;
    case 96:
        attn_prefill_impl<T, 96>(q, q_stride, k_cache, v_cache, out, pos_base, n_tok, heads, kv_heads, capacity, scale, smem);
        break;
    case 128:
        attn_prefill_impl<T, 128>(q, q_stride, k_cache, v_cache, out, pos_base, n_tok, heads, kv_heads, capacity, scale, smem);
        break;
    default:
        break;  // the host launches head dims 16..128 only
    }
}

// grid (heads, n_tok); block: round_up(hd, 32) threads. Merges the splits (the unfused path).
__device__ void attn_combine(float *out, const float *part_acc, const float *part_ml, int heads,
                             int hd, int n_splits) {
    merge_into(out, part_acc, part_ml, blockIdx.y, blockIdx.x, heads, hd, n_splits);
}

#define FERRUM_ATTN(S, T)                                                                          \
    extern "C" __global__ void ferrum_rope_qkv_##S(                                                \
        float *qkv, const T *bias, const T *q_norm, const T *k_norm, T *k_cache, T *v_cache,       \
        const float *inv_freq, const uint32_t *pos_base, int heads, int kv_heads, int hd,          \
        int capacity, float eps) {                                                                 \
        FERRUM_PDL_ENTRY();                                                                        \
        rope_qkv<T>(qkv, bias, q_norm, k_norm, k_cache, v_cache, inv_freq, pos_base, heads,        \
                    kv_heads, hd, capacity, eps);                                                  \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) ferrum_attn_##S(                             \
        const float *q, int q_stride, const T *k_cache, const T *v_cache, float *out,              \
        float *part_acc, float *part_ml, uint32_t *counters, const uint32_t *pos_base,             \
        int heads, int kv_heads, int hd, int capacity, float scale) {                              \
        /* attn_impl runs FERRUM_PDL_ENTRY */                                                      \
        const RopeArgs<T> none = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0.0f};     \
        attn<T, false>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base,  \
                       heads, kv_heads, hd, capacity, scale, none);                                \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) ferrum_attn_rope_##S(                        \
        const float *qkv, int q_stride, T *k_cache, T *v_cache, float *out, float *part_acc,       \
        float *part_ml, uint32_t *counters, const uint32_t *pos_base, int heads, int kv_heads,     \
        int hd, int capacity, float scale, const T *bias, const T *q_norm, const T *k_norm,        \
        const float *inv_freq, float eps) {                                                        \
        /* attn_impl runs FERRUM_PDL_ENTRY, after its early loads */                               \
        const RopeArgs<T> rope = {bias, q_norm, k_norm, inv_freq, k_cache, v_cache, eps};         \
        attn<T, true>(qkv, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, \
                      heads, kv_heads, hd, capacity, scale, rope);                                 \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32) ferrum_attn_prefill_##S(          \
        const float *q, int q_stride, const T *k_cache, const T *v_cache, float *out,              \
        const uint32_t *pos_base, int n_tok, int heads, int kv_heads, int hd, int capacity,        \
        float scale) {                                                                             \
        FERRUM_PDL_ENTRY();                                                                        \
        attn_prefill<T>(q, q_stride, k_cache, v_cache, out, pos_base, n_tok, heads, kv_heads, hd,  \
                        capacity, scale);                                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) ferrum_attn_rope_early_##S(                  \
        const float *qkv, int q_stride, T *k_cache, T *v_cache, float *out, float *part_acc,       \
        float *part_ml, uint32_t *counters, const uint32_t *pos_base, int heads, int kv_heads,     \
        int hd, int capacity, float scale, const T *bias, const T *q_norm, const T *k_norm,        \
        const float *inv_freq, float eps) {                                                        \
        /* attn_impl runs FERRUM_PDL_ENTRY, after its early copies */                              \
        const RopeArgs<T> rope = {bias, q_norm, k_norm, inv_freq, k_cache, v_cache, eps};         \
        attn<T, true, true>(qkv, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters,     \
                            pos_base, heads, kv_heads, hd, capacity, scale, rope);                 \
    }                                                                                              \
    extern "C" __global__ void ferrum_attn_combine_##S(float *out, const float *part_acc,          \
                                                       const float *part_ml, int heads, int hd,    \
                                                       int n_splits) {                             \
        FERRUM_PDL_ENTRY();                                                                        \
        attn_combine(out, part_acc, part_ml, heads, hd, n_splits);                                 \
    }

FERRUM_ATTN(f16, f16)
FERRUM_ATTN(bf16, bf16)
