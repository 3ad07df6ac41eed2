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

// The angle of RoPE pair i at position pos: pos * inv_f in f32 (as HF computes it), its sine
// and cosine through sincospi in f64, whose argument reduction is exact (no Payne-Hanek path
// with its local array, which sincosf needs for angles past 105615 and which cost a stack frame
// here), then rounded to f32: at least as accurate as sincosf, at any position. It reads no
// memory, so the fused attention computes it before its programmatic-launch wait.
__device__ __forceinline__ void rope_angle(uint32_t pos, float inv_f, float &c, float &sn) {
    const float theta = __fmul_rn((float)pos, inv_f);
    double sd, cd;
    sincospi(__dmul_rn((double)theta, 0.318309886183790671537767526745), &sd, &cd);  // 1/pi
    sn = (float)sd;
    c = (float)cd;
}

// What RoPE pair i of one head needs besides the pair itself, none of it written by any kernel:
// the bias of the pair, the head norm's weights, and the angle's cosine and sine (rope_angle;
// the fused attention computes the angle before its wait and loads the rest after it, together
// with the new token's row).
struct RopeConsts {
    bool bias, norm, rotate;  // uniform over the block
    float ba, bb, na, nb, c, sn;
};

// RoPE's per-pair math, shared by rope_qkv and the fused attention (rope_head) so that the two
// agree bit for bit: thread i < half holds the pair (a, b) = (x[i], x[i + half]) of one head
// (zeros for the other threads); adds the bias (when k.bias), applies the head's RMSNorm with
// weights (k.na, k.nb) (when k.norm: the sum of squares runs through block_sum, so every thread
// of the block must call this, and threads without a pair add exact zeros), then rotates by the
// angle (k.c, k.sn) (when k.rotate). Sharing the source is not enough: inlined into two
// kernels, the compiler may contract a * c - b * sn into an FMA in one and not the other
// (seen on the GPU). So every step is an explicitly rounded intrinsic (__fmul_rn, __fadd_rn,
// __fsub_rn, __fmaf_rn), which nvcc never contracts or reorders.
__device__ __forceinline__ void rope_pair(float &a, float &b, bool active, int hd, const RopeConsts &k,
                                          float eps, float *red) {
    if (active && k.bias) {
        a = __fadd_rn(a, k.ba);
        b = __fadd_rn(b, k.bb);
    }
    if (k.norm) {  // uniform over the block
        const float ss = block_sum(__fmaf_rn(a, a, __fmul_rn(b, b)), red);
        const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)hd), eps));
        if (active) {
            a = __fmul_rn(__fmul_rn(a, r), k.na);
            b = __fmul_rn(__fmul_rn(b, r), k.nb);
        }
    }
    if (k.rotate && active) {
        const float na = __fsub_rn(__fmul_rn(a, k.c), __fmul_rn(b, k.sn));
        const float nb = __fadd_rn(__fmul_rn(b, k.c), __fmul_rn(a, k.sn));
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
    const bool is_q = h < heads, is_v = h >= heads + kv_heads;
    const T *nw = is_v ? nullptr : (is_q ? q_norm : k_norm);
    RopeConsts k = {bias != nullptr, nw != nullptr, !is_v, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f};
    float a = 0.0f, b = 0.0f;
    if (active) {
        a = row[off + i];
        b = row[off + i + half_d];
        if (k.bias) {
            k.ba = to_f(bias[off + i]);
            k.bb = to_f(bias[off + i + half_d]);
        }
        if (k.norm) {
            k.na = to_f(nw[i]);
            k.nb = to_f(nw[i + half_d]);
        }
        if (k.rotate) rope_angle(pos, inv_freq[i], k.c, k.sn);
    }
    rope_pair(a, b, active, hd, k, eps, sh);
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

// Most KV splits (plan::MAX_SPLITS): the merge keeps one weight per split in shared memory.
#define ATTN_MAX_SPLITS 64
// Most KV splits merged inside a thread-block cluster (plan::ATTN_MAX_CLUSTER: the portable
// cluster size).
#define ATTN_MAX_CLUSTER 8

// merge_rows' first step, by every thread of the block (blockDim.x >= 32): the first warp
// computes the max M of the n_splits (max, sum) pairs at ml and each split's weight
// exp(m_s - M) (0 for an empty split) into sw[s], and the sums into sw[n_splits + s]; then the
// block barrier publishes them.
__device__ __forceinline__ void merge_weights(const float *ml, int n_splits, float *sw) {
    float *s_w = sw, *s_l = sw + n_splits;
    if (threadIdx.x < 32) {
        float M = FERRUM_NEG_INF;
        for (int s = threadIdx.x; s < n_splits; s += 32) M = fmaxf(M, __ldcg(ml + 2 * s));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));  // exact
        for (int s = threadIdx.x; s < n_splits; s += 32) {
            const float ms = __ldcg(ml + 2 * s);
            s_w[s] = ms == FERRUM_NEG_INF ? 0.0f : expf(ms - M);
            s_l[s] = __ldcg(ml + 2 * s + 1);
        }
    }
    __syncthreads();
}
// Merges n_splits partials of one (token, head) into out_row[d] for d = threadIdx.x,
// threadIdx.x + blockDim.x, ... < hd, in split order (so the result depends neither on which
// block runs it, nor on its size, nor on where the partials lie). Split s's unnormalised sums
// are acc[s * hd + d], its (max, sum) ml[2 s] and ml[2 s + 1], in global memory, written by
// other blocks of the same launch and read through L2 (__ldcg, never a stale L1 line); the
// cluster merge, whose partials are in shared memory, has its own form (merge_cluster_rows).
// `sw` is 2 * n_splits floats of shared scratch. Called by every thread of the block (blockDim.x
// >= 32): the first warp computes the max M and each split's weight exp(m_s - M) (0 for an empty
// split) into `sw`, then each thread sums its columns with the weights in split order; the
// loads of that sum do not depend on one another, so they are in flight together (a loop that
// loads m_s and branches per split waits on each load in turn, ~30 us for 64 splits at head
// dim 128).
__device__ __forceinline__ void merge_rows(float *out_row, const float *acc, const float *ml, int hd,
                                           int n_splits, float *sw) {
    const float *s_w = sw, *s_l = sw + n_splits;
    merge_weights(ml, n_splits, sw);
    float L = 0.0f;
    for (int s = 0; s < n_splits; ++s) L = fmaf(s_l[s], s_w[s], L);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float *a = acc + d;
        float A = 0.0f;
#pragma unroll 16
        for (int s = 0; s < n_splits; ++s) A = fmaf(__ldcg(a + (size_t)s * hd), s_w[s], A);
        out_row[d] = L > 0.0f ? A / L : 0.0f;
    }
}

// The combine kernel's form of merge_rows, one column per thread (blockDim.x >= hd): each
// thread loads its column of the first COMBINE_PRE partials before the weights, so those
// loads are in flight with the first warp's (max, sum) loads instead of after the block
// barrier (one L2 round trip fewer). The same operations in the same order as merge_rows, so
// bit-identical.
#define COMBINE_PRE 32
__device__ __forceinline__ void combine_rows(float *out_row, const float *acc, const float *ml, int hd,
                                             int n_splits, float *sw) {
    const float *s_w = sw, *s_l = sw + n_splits;
    const int d = threadIdx.x;
    const bool col = d < hd;
    float pre[COMBINE_PRE];
#pragma unroll
    for (int s = 0; s < COMBINE_PRE; ++s) pre[s] = col && s < n_splits ? __ldcg(acc + (size_t)s * hd + d) : 0.0f;
    merge_weights(ml, n_splits, sw);
    if (!col) return;
    float L = 0.0f;
    for (int s = 0; s < n_splits; ++s) L = fmaf(s_l[s], s_w[s], L);
    float A = 0.0f;
#pragma unroll
    for (int s = 0; s < COMBINE_PRE; ++s) {
        if (s < n_splits) A = fmaf(pre[s], s_w[s], A);
    }
#pragma unroll 16
    for (int s = COMBINE_PRE; s < n_splits; ++s) A = fmaf(__ldcg(acc + (size_t)s * hd + d), s_w[s], A);
    out_row[d] = L > 0.0f ? A / L : 0.0f;
}

// The cluster merge's form of merge_rows (n_splits <= ATTN_MAX_CLUSTER partials in block 0's
// own shared memory, head dim HD): every thread reads the n_splits (max, sum) pairs itself
// (broadcast reads) and computes M, the weights and L in registers, so the merge is one chain
// of loads and arithmetic per thread, with no warp reduction, shared scratch or block barrier
// between them (the whole merge took 1.02 µs of a 135M layer's attention in the kernel
// timeline's phase stamps with merge_rows, session 26 call 3, and 0.62 in this form, call 4).
// The same operations in the same order as merge_rows (M is a maximum, exact in any order), so
// bit-identical. At most ATTN_MAX_CLUSTER splits: the host clusters no more
// (plan::attn_cluster, the portable cluster size); more would be left out here.
// With `copy` (non-null, shared memory) the merged row also goes there (the o projection
// inside the attention reads it: attn_o).
template <int HD>
__device__ __forceinline__ void merge_cluster_rows(float *out_row, const float *acc, const float *ml, int n_splits,
                                                   float *copy) {
    float M = FERRUM_NEG_INF;
#pragma unroll
    for (int s = 0; s < ATTN_MAX_CLUSTER; ++s)
        if (s < n_splits) M = fmaxf(M, ml[2 * s]);
    float w[ATTN_MAX_CLUSTER], L = 0.0f;
#pragma unroll
    for (int s = 0; s < ATTN_MAX_CLUSTER; ++s) {
        if (s < n_splits) {
            const float ms = ml[2 * s];
            w[s] = ms == FERRUM_NEG_INF ? 0.0f : expf(ms - M);
            L = fmaf(ml[2 * s + 1], w[s], L);
        }
    }
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float A = 0.0f;
#pragma unroll
        for (int s = 0; s < ATTN_MAX_CLUSTER; ++s)
            if (s < n_splits) A = fmaf(acc[s * HD + d], w[s], A);
        const float o = L > 0.0f ? A / L : 0.0f;
        out_row[d] = o;
        if (copy != nullptr) copy[d] = o;
    }
}

// merge_rows over the global partials of (token `tok`, head `h`): part_acc
// [n_tok][heads][n_splits][hd] and part_ml [n_tok][heads][n_splits][2], into
// out[tok][h*hd .. +hd). Called by every thread of the block.
__device__ __forceinline__ void merge_into(float *out, const float *part_acc, const float *part_ml,
                                           int tok, int h, int heads, int hd, int n_splits) {
    __shared__ float s_wl[2 * ATTN_MAX_SPLITS];
    const size_t base = ((size_t)tok * heads + h) * n_splits;
    merge_rows(out + ((size_t)tok * heads + h) * hd, part_acc + base * hd, part_ml + base * 2, hd,
                     n_splits, s_wl);
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

// Thread-block clusters (sm_90): the decode attention's n_splits blocks of one (token, head)
// can run as one cluster (the host's choice: plan::attn_cluster), and then merge their partials
// through distributed shared memory instead of global memory, a fence and a ticket. The
// protocol (attn_impl):
// 0. the first thread of the cluster's block 0 initialises an mbarrier in its shared memory
//    (one arrival, its own, expecting the other blocks' partial bytes: (n_splits - 1) x
//    (head dim + 2) floats) and fences the initialisation for the cluster;
// 1. at entry every thread arrives (relaxed) at the cluster barrier: "this block has started";
// 2. before its first remote store, every thread waits on that phase, so every block of the
//    cluster is running (a block's shared memory may be written only while the block exists)
//    and block 0's mbarrier is initialised;
// 3. each other block stores its partial into its split's slot of block 0's merge buffer with
//    st.async, each store completing its bytes on block 0's mbarrier, and exits: none of its
//    own shared memory is read by anyone (with O, the o projection, it does not exit: it
//    waits for block 0's push of the merged row into its own shared memory, OArgs). (Its stores may still be in flight when it exits;
//    the PTX ISA ties st.async to the target block's lifetime, which block 0's wait covers, and
//    says nothing against the source exiting: the GPU tests merge correctly this way.) Block 0 stores its own partial locally, passes a
//    block barrier, and waits (acquire, cluster scope) for the mbarrier's phase: then every
//    block's bytes have landed and are visible to it;
// 4. block 0 merges from its own shared memory.
// Every thread arrives at and waits on the one cluster barrier phase before any returns, so
// that phase completes; block 0 lives until its own reads are done. The compact kernel
// (attn_compact_hd64) runs the same steps with another merge buffer: every warp of every block,
// block 0's own included, pushes its partial with st.async (n_splits x 4 partials of C64_PART
// floats, all of them counted by block 0's mbarrier), and block 0 merges them in step 4. (Before session 26 step 3
// was a second cluster barrier phase, release and acquire, that every block waited on: the
// kernel timeline's phase stamps put 0.78 µs of a 135M layer's attention there.)
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define FERRUM_HAS_CLUSTER 1
__device__ __forceinline__ uint32_t cluster_blocks() {
    uint32_t n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// The shared::cluster address of `p` (this block's shared memory) in block `rank`.
__device__ __forceinline__ uint32_t cluster_map(const void *p, uint32_t rank) {
    uint32_t out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(out)
                 : "r"((uint32_t)__cvta_generic_to_shared(p)), "r"(rank));
    return out;
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }
// Step 0: the merge mbarrier at `bar` (this block's shared memory), one arrival (the caller's,
// made here) and `bytes` expected; the fence orders the initialisation before the cluster
// barrier's relaxed arrive (the pattern CUTLASS's cluster pipelines use).
__device__ __forceinline__ void merge_bar_init(uint64_t *bar, uint32_t bytes) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Step 3: one float into block 0's buffer at cluster address `addr`, its 4 bytes completing on
// the mbarrier at cluster address `bar`.
__device__ __forceinline__ void st_async(uint32_t addr, float v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(addr), "f"(v),
                 "r"(bar)
                 : "memory");
}
// The same for four floats in one 16-byte store (addr 16-byte aligned). A warp-wide st.async
// instruction costs ~26 ns at the receiving block, serialised, whatever its width
// (scripts/microbench/attnchain.cu, session 41): fewer, wider stores are what pays.
__device__ __forceinline__ void st_async4(uint32_t addr, float4 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(addr),
                 "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
                 : "memory");
}
// Step 3 in block 0: waits for the mbarrier's first phase (every expected byte landed), with
// acquire semantics at cluster scope, so the other blocks' stores are visible after it.
__device__ __forceinline__ void merge_bar_wait(uint64_t *bar) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(bar);
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(a)
            : "memory");
    }
}
#else
#define FERRUM_HAS_CLUSTER 0
__device__ __forceinline__ uint32_t cluster_blocks() { return 1; }
__device__ __forceinline__ uint32_t cluster_rank() { return 0; }
__device__ __forceinline__ uint32_t cluster_map(const void *, uint32_t) { return 0; }
__device__ __forceinline__ void cluster_arrive_relaxed() {}
__device__ __forceinline__ void cluster_wait() {}
__device__ __forceinline__ void merge_bar_init(uint64_t *, uint32_t) {}
__device__ __forceinline__ void st_async(uint32_t, float, uint32_t) {}
__device__ __forceinline__ void st_async4(uint32_t, float4, uint32_t) {}
__device__ __forceinline__ void merge_bar_wait(uint64_t *) {}
#endif

#define ATTN_MAX_WARPS 8
#define ATTN_MAX_HD 256
// Scores held in shared memory at a time; longer splits run tile after tile with the online
// softmax rescale between tiles.
#define ATTN_TILE 512
// TPW * HD = 32 * 8 * CH / G <= 256 for every HD, so the value partials take at most
// ATTN_MAX_WARPS * 256 floats; then each warp's (max, sum).
#define ATTN_SMEM_FLOATS (3 * ATTN_MAX_HD + ATTN_TILE + 32 + ATTN_MAX_WARPS * 256 + 2 * ATTN_MAX_WARPS)

// How a warp covers cache rows of head_dim HD: each lane takes one 16-byte chunk (8 values)
// of a row, G lanes (a power of two >= the HD / 8 chunks, the extra lanes idle) share one row,
// so a warp walks TPW rows at once.
template <int HD> struct AttnGeom {
    static constexpr int CH = HD / 8;
    static constexpr int G = CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
    static constexpr int TPW = 32 / G;
};

// The cluster merge buffer at the start of the launch's dynamic shared memory: n_splits rows
// of HD unnormalised sums, then n_splits (max, sum) pairs; rounded up to 16 bytes, so the early
// copies that follow stay aligned (plan::attn_merge_bytes computes the same).
__device__ __forceinline__ uint32_t attn_merge_bytes(int n_splits, int hd) {
    return ((uint32_t)n_splits * (uint32_t)(hd + 2) * 4u + 15u) & ~15u;
}

// The folded q/k/v (RopeArgs::pre_x): elements of the residual each thread holds in registers
// (4 warps: 640 of them, SmolLM2-135M's 576 with room; a wider residual loops over the rest).
#define ATTN_PRE_REGS 5

// What ferrum_attn_rope_* adds to the attention: rope_qkv's inputs and the cache to append to.
template <typename T> struct RopeArgs {
    const T *bias, *q_norm, *k_norm;  // each may be null
    const float *inv_freq;
    T *k_out, *v_out;                 // the caches (k_cache / v_cache), written at row pos
    float eps;
    // The folded q/k/v projection (fold.cu's fold_qkv; null in every other launch): the row is
    // u, q/k/v before the scalar rn of the layer's RMSNorm, and pre_x (pre_n floats) is the
    // residual r that rn normalises: rn = rsqrt(mean(r^2) + eps).
    const float *pre_x;
    int pre_n;
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The decode attention's own RoPE (ferrum_attn_rope_*): dst[0..HD) = the head whose raw pair
// (a, b) = (x[i], x[i + HD/2]) thread i < HD/2 holds (loaded by the caller, so the loads of q, k
// and v are in flight together), with the bias, head norm and angle in `k`, through the same
// rope_pair as rope_qkv (the norm's sum runs through block_sum, whose extra warps add exact
// zeros), so the fused and the separate kernels agree bit for bit. With `round` the values are
// rounded to the cache dtype (as the separate kernel's cache write does); else they are
// multiplied by `mul` (q's softmax scale: one rounding, as the multiplication of rope_qkv's
// fp32 output is). Called by every thread of the block (blockDim.x >= HD/2, checked by the
// host); `dst` is read after a barrier.
template <typename T, int HD>
__device__ __forceinline__ void rope_head(float *dst, float a, float b, const RopeConsts &k, bool round, float mul,
                          float eps, float *red) {
    constexpr int HALF = HD / 2;
    const int i = threadIdx.x;
    const bool active = i < HALF;
    rope_pair(a, b, active, HD, k, eps, red);
    if (active) {
        dst[i] = round ? to_f(from_f<T>(a)) : __fmul_rn(a, mul);
        dst[i + HALF] = round ? to_f(from_f<T>(b)) : __fmul_rn(b, mul);
    }
}

// Loads issued before the programmatic-launch wait (ferrum_attn_rope_* only). The position is
// a weak L2 load (.cg: never a stale L1 line); RoPE's inverse frequencies (written by no
// kernel) a weak load; cache rows go straight to shared memory
// with cp.async (.cg, 16 bytes), so they hold no registers while the previous kernel finishes.
// All are asm volatile, so that neither the compiler nor ptxas moves them past the wait (see
// ldg_early in gemv.cu for why a plain __ldg would be).
__device__ __forceinline__ uint32_t ld_early(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float ld_early_f(const float *p) {
    float v;
    asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void cp_early16(uint4 *dst_smem, const uint4 *src) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst_smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
// Waits for this thread's own cp.async copies (each thread reads back only what it copied).
__device__ __forceinline__ void cp_early_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// The o projection inside the decode attention (ferrum_attn_rope[_early]_o_hd*: one GPU,
// one decode token, the fused norms, the cluster merge; opt-in, plan::attn_o and attn_o_fits):
// x += W_o attn, with W_o [hidden][heads * HD] in the model dtype, in place of the separate
// `_res` GEMV after the attention. Head h's output o_h touches only W_o's columns h*HD .. +HD,
// so x += y_0 + ... + y_{H-1} with y_h = W_o[:, h] o_h. The n_splits blocks of head h's cluster
// share y_h's rows: block (rank) j takes rows [j R, (j + 1) R), R = ceil(hidden / n_splits).
// 1. Before the programmatic-launch wait, each block copies its rows' slice of W_o's head-h
//    columns (R x HD values; weights are written by no kernel) to the end of its dynamic shared
//    memory with cp.async, as its last cp.async group. Rows are padded to HD + 8 values (OLayout::LD),
//    so the 16-byte reads of step 3, one row per thread, are free of bank conflicts (a row
//    stride of HD / 2 + 4 words moves each thread of a quarter warp by 4 banks).
// 2. Block 0 merges o_h (merge_cluster_rows, into its s_q) and pushes it into every other
//    block's s_q with st.async, each completing on that block's own mbarrier (initialised at
//    the block's start, before the cluster barrier's arrive that block 0 waits on before any
//    remote store: the protocol of the cluster merge below); the other blocks wait on it.
// 3. Each block computes its rows of y_h (fp32, its dot in column order with two accumulators,
//    even and odd columns, summed at the end) into part[h][rows] in global memory.
// 4. Per row range j, the last of the H blocks (one per head) to finish sums the H partials in
//    head order and adds the sum to x (the ticket protocol of merge_splits: a fence per thread,
//    a block barrier, atomicInc of ticket[j] by thread 0, wrapping back to 0 for the next
//    launch). The result depends neither on which block is last nor on timing:
//    deterministic, with other f32 rounding than the GEMV (another summation order).
// x is read and written after the wait only: the kernel this one depends on (the QKV GEMV)
// reads x and never writes it, and the next one (the gate|up GEMV) reads it after its own wait,
// which returns once this grid has completed and its writes are visible.
template <typename T> struct OArgs {
    const T *wo;        // [hidden][heads * HD]
    float *x;           // [hidden], x += W_o attn
    float *part;        // [heads][hidden]: each head's partial
    uint32_t *ticket;   // [ATTN_MAX_CLUSTER], zero between launches
    int hidden;
};

template <int HD> struct OLayout {
    static constexpr int LD = HD + 8;  // values per padded row
};

// Rows of y_h per block of an n_splits cluster (plan::attn_o_rows).
__device__ __forceinline__ int attn_o_rows(int hidden, int n_splits) { return (hidden + n_splits - 1) / n_splits; }

// The shared-memory bytes of a block's W_o slice, 16-byte aligned (plan::attn_o_bytes computes
// the same for 2-byte weights).
template <typename T, int HD> __device__ __forceinline__ uint32_t attn_o_bytes(int hidden, int n_splits) {
    return ((uint32_t)attn_o_rows(hidden, n_splits) * OLayout<HD>::LD * (uint32_t)sizeof(T) + 15u) & ~15u;
}

// Step 1: this thread's share of rows [r0, r1) of W_o's head-h columns (16 bytes a copy) to
// s_wo (row r at (r - r0) * OLayout::LD), as one cp.async group committed after every earlier copy of
// this thread. Every row of W_o starts at a multiple of heads * HD values and the slice at
// h * HD, both multiples of 8 (HD % 8 == 0), so each 16-byte source is aligned (cuMemAlloc).
template <typename T, int HD>
__device__ __forceinline__ void attn_o_load(T *s_wo, const OArgs<T> &o, int heads, int h, int r0, int r1) {
    constexpr int CH = HD / 8;
    const T *src = o.wo + (size_t)r0 * heads * HD + (size_t)h * HD;
    const size_t row = (size_t)heads * HD;
    for (int i = threadIdx.x; i < (r1 - r0) * CH; i += blockDim.x) {
        const int r = i / CH, c = i - r * CH;
        cp_early16(reinterpret_cast<uint4 *>(s_wo + r * OLayout<HD>::LD + c * 8),
                   reinterpret_cast<const uint4 *>(src + r * row + c * 8));
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Steps 3 and 4, by every thread of the block that holds rows [r0, r1) of head h, with o_h
// in `oh` (HD floats in shared memory, float4-aligned: written by this block's threads, or
// landed on its mbarrier, before the call), `j` the row range's ticket.
template <typename T, int HD>
__device__ void attn_o(const T *s_wo, const float *oh, const OArgs<T> &o, int heads, int h, int j, int r0, int r1) {
    asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's slice copies landed
    __syncthreads();                                   // and every other thread's (and oh)
    const float4 *x4 = reinterpret_cast<const float4 *>(oh);
    float *part = o.part + (size_t)h * o.hidden;
    for (int r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        const uint4 *w = reinterpret_cast<const uint4 *>(s_wo + (r - r0) * OLayout<HD>::LD);
        float a0 = 0.0f, a1 = 0.0f;
        // At most 8 chunks unrolled: whole, ptxas would keep oh's HD values (loop-invariant)
        // in registers across rows, 2 * HD of them at head dim 256 (255 registers and spills).
#pragma unroll 8
        for (int c = 0; c < HD / 8; ++c) {
            float wf[8];
            unpack8(w[c], wf, T());
            const float4 u = x4[2 * c], v = x4[2 * c + 1];
            a0 = fmaf(wf[0], u.x, a0);
            a1 = fmaf(wf[1], u.y, a1);
            a0 = fmaf(wf[2], u.z, a0);
            a1 = fmaf(wf[3], u.w, a1);
            a0 = fmaf(wf[4], v.x, a0);
            a1 = fmaf(wf[5], v.y, a1);
            a0 = fmaf(wf[6], v.z, a0);
            a1 = fmaf(wf[7], v.w, a1);
        }
        part[r] = a0 + a1;
    }
    // Step 4 (merge_splits gives the argument for the fence, the barrier and the ticket).
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicInc(o.ticket + j, (uint32_t)heads - 1) == (uint32_t)heads - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // The other blocks' partials through L2 (__ldcg: never a stale L1 line), eight heads' loads
    // in flight at a time, summed in head order (a missing head adds +0: exact).
    for (int r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        const float *p = o.part + r;
        float sum = 0.0f;
        for (int h0 = 0; h0 < heads; h0 += 8) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = h0 + i < heads ? __ldcg(p + (size_t)(h0 + i) * o.hidden) : 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += v[i];
        }
        o.x[r] += sum;
    }
}

// Cache rows per row slot that ferrum_attn_rope_* copies to shared memory before the wait (K
// and V: 2 * 16 * ATTN_EARLY_ROWS bytes per thread, 32 KiB for 8 warps, in dynamic shared
// memory after the cluster merge buffer). When a split's rows fit (ATTN_EARLY_ROWS x the
// block's slots; the host picks 4 or 8 warps for that, plan::attn_warps, and
// plan::ATTN_EARLY_ROWS must equal this), every cache load is in flight before the previous
// kernel ends; longer splits get no buffer and walk the cache after the wait.
#define ATTN_EARLY_ROWS 4
// Every early row lies in the first tile: slots <= ATTN_MAX_WARPS * 16 (G >= 2 lanes per row).
static_assert(ATTN_EARLY_ROWS * ATTN_MAX_WARPS * 16 <= ATTN_TILE, "early rows fit the first tile");

// grid (heads, n_splits, n_tok); block: 32 * n_warps threads (n_warps <= 8).
// Query token `tok` sits at position pos_base[0] + tok and attends to cache rows [0, pos].
// Split s covers an equal share of those rows (the share is computed from the length read on
// the device). With one split the normalised output is written to `out` [n_tok][heads*hd];
// otherwise the splits' unnormalised partials are merged: inside a thread-block cluster when
// the host launched the splits of each (token, head) as one (see cluster_blocks above), else
// through part_acc [n_tok][heads][n_splits][hd] and part_ml (max, sum), by a separate
// attn_combine launch (`counters` null) or by the last split block of each (token, head)
// (merge_splits). All three merges compute the same operations in the same order.
//
// The walk over rows is built for latency (batch-1 decode reads few rows per block): no loop
// iteration waits on the previous one, so every load of a pass is in flight at once, and no
// block barrier sits inside the walk: each warp keeps its own online softmax over the rows it
// walks (flash-decoding within the block).
// 1. scores: G lanes per row, a 16-byte load each, a dot with the scaled q, a G-lane
//    butterfly; each row's score goes to this warp's entries of shared memory (s_p) and into
//    the warp's running maximum;
// 2. the warp's new maximum (a shuffle reduction), its running (m, l) rescaled;
// 3. values: the same lane layout, p = exp(score - m) and acc += p * v per lane (8 values),
//    one partial per row slot (warp, row of the warp);
// 4. at the end, the block's (M, L, A): M the maximum of the warps' m, each warp weighted by
//    exp(m_w - M), its slots summed in slot order.
// Every order is fixed by the launch shape, so results are deterministic.
//
// ROPE (ferrum_attn_rope_*, one decode token): `q` is the raw qkv row and this kernel also does
// rope_qkv's work. Every block computes its head's q; the block whose split holds the new row
// (position pos) computes that row's K and V and uses them from shared memory, never from the
// cache, and the first query head of each KV group writes them to the cache for later steps.
// No block of the launch reads cache row pos, so that write races with nothing.
// ROPE also loads the position, the RoPE constants (and computes the angle) and up to
// ATTN_EARLY_ROWS cache rows per slot (K and V) before the programmatic-launch wait, while
// the QKV projection finishes. Why that is safe: the kernel it depends on waits
// (griddepcontrol.wait) before it lets its dependent launch (it is never an early-triggering
// `_et` kernel: common.cuh), so when this grid starts, every kernel before that one has
// completed and its writes are visible. (A kernel that
// never signals, such as a cuBLAS GEMM on the cuBLAS decode path, counts as finished only when
// it completes, which keeps the chain.) The kernel it depends on (the QKV projection, a GEMV
// or a GEMM; with the folded q/k/v, the previous layer's down GEMV) writes neither the
// position (the previous step's argmax, or a host copy, wrote it; in a graph of several steps that argmax is in the same graph, at least two kernels
// back) nor the cache (rows below pos were written by earlier attention launches, row pos is
// never read here), and the loads go through L2.
//
// O (ferrum_attn_rope[_early]_o_hd64_*, with ROPE and the cluster merge only: without the
// cluster no block does the projection, so the host never launches that): every block of a
// head's cluster also adds its rows of the head's share of the o projection to the residual
// (see OArgs above); its W_o slice goes at the end of the dynamic shared memory.
template <typename T, int HD, bool ROPE, bool EARLY, bool O, bool FOLD = false>
__device__ void attn_impl(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                          float *out, float *part_acc, float *part_ml, uint32_t *counters,
                          const uint32_t *pos_base, int heads, int kv_heads, int capacity,
                          float scale, float *smem, uint4 *s_dyn, const RopeArgs<T> &rope,
                          const OArgs<T> &oa) {
    static_assert(!O || ROPE, "the o projection runs inside the fused (RoPE) kernel only");
    constexpr int CH = AttnGeom<HD>::CH, G = AttnGeom<HD>::G, TPW = AttnGeom<HD>::TPW;
    // smem (ATTN_SMEM_FLOATS, shared by every HD instance): q, the new K/V row, the tile's
    // scores, a reduction scratch, the per-slot value partials [ATTN_MAX_WARPS * TPW][HD], and
    // each warp's (max, sum).
    float *s_q = smem, *s_k = s_q + ATTN_MAX_HD, *s_v = s_k + ATTN_MAX_HD;
    float *s_p = s_v + ATTN_MAX_HD, *s_red = s_p + ATTN_TILE;
    float(*s_acc)[HD] = reinterpret_cast<float(*)[HD]>(s_red + 32);
    float *s_wm = s_red + 32 + ATTN_MAX_WARPS * 256, *s_wl = s_wm + ATTN_MAX_WARPS;
    const int h = blockIdx.x, split = blockIdx.y, tok = blockIdx.z, n_splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int gl = lane % G, sub = lane / G;        // chunk of the row, row of the warp
    const int slots = nw * TPW, slot = warp * TPW + sub;
    const bool chunk_on = gl < CH;
    // The timeline build's phase stamps (common.cuh; 0 and no code in every other build): 0 q
    // (and the new row) in shared memory, 1 the early copies landed, 2 the walk done, 3 the
    // block's (M, L) computed and the cluster started (its partial is summed after this, as
    // it is stored), 4 the cluster's partials at block 0, 5 the merged row stored (block 0 of
    // each cluster).
    const unsigned tl_on = FERRUM_TL_FLAG();
    // The dynamic shared memory: the cluster merge buffer (when the splits of each (token,
    // head) run as one cluster and the host gave the buffer), then the early copies.
    uint32_t dyn_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
    const uint32_t mrg_bytes = attn_merge_bytes(n_splits, HD);
    // Uniform over the launch (the launch shape, the cluster shape, the dynamic size).
    const bool cluster =
        FERRUM_HAS_CLUSTER && n_splits > 1 && cluster_blocks() == (uint32_t)n_splits && dyn_bytes >= mrg_bytes;
    // Step 0 (block 0 of each cluster) and step 1.
    __shared__ uint64_t s_mbar;
    const uint32_t rank = cluster ? cluster_rank() : 0u;
    const bool merger = cluster && rank == 0;
    // O (the o projection: OArgs above) with the cluster: this block's rows [o_r0, o_r1) of
    // y_h, its W_o slice at the end of the dynamic shared memory (the host sizes it:
    // attn_o_bytes after the merge buffer and the early copies), and the mbarrier on which
    // block 0's push of o_h lands (every block but block 0).
    const uint32_t o_bytes = O ? attn_o_bytes<T, HD>(oa.hidden, n_splits) : 0u;
    const bool o_on = O && cluster && dyn_bytes >= mrg_bytes + o_bytes;
    const int o_rows = O ? attn_o_rows(oa.hidden, n_splits) : 0;
    const int o_r0 = min((int)rank * o_rows, oa.hidden), o_r1 = min(o_r0 + o_rows, oa.hidden);
    T *s_wo = reinterpret_cast<T *>(reinterpret_cast<unsigned char *>(s_dyn) + (dyn_bytes - o_bytes));
    __shared__ uint64_t s_obar;
    if (merger && threadIdx.x == 0) merge_bar_init(&s_mbar, (uint32_t)(n_splits - 1) * (HD + 2) * 4u);
    if (o_on && !merger && threadIdx.x == 0) merge_bar_init(&s_obar, (uint32_t)HD * 4u);
    if (cluster) cluster_arrive_relaxed();  // step 1: this block has started
    float *s_mrg = reinterpret_cast<float *>(s_dyn);
    uint4 *s_early = s_dyn + (cluster ? mrg_bytes / 16 : 0);
    if (!ROPE) FERRUM_PDL_ENTRY();  // the position and the cache may come from the last kernel
    // ROPE: this thread's inverse frequency (RoPE pair threadIdx.x), loaded before the position
    // so that the two loads are in flight together: the early copies below wait on the
    // position, the angle on both, and all of it runs before the wait.
    const float inv_f = ROPE && threadIdx.x < HD / 2 ? ld_early_f(rope.inv_freq + threadIdx.x) : 0.0f;
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
    // per thread, after the merge buffer) only when the whole split fits in the early rows
    // (plan::attn_warps): for long splits the buffer would cost more occupancy than the early
    // rows save.
    // A separate instance (EARLY, ferrum_attn_rope_early_*): its buffer handling costs ~40
    // registers, which would halve the blocks resident per multiprocessor for long contexts.
    constexpr int ER = ROPE && EARLY && FERRUM_HAS_PDL ? ATTN_EARLY_ROWS : 0;
    const bool early = ER > 0 && dyn_bytes >= (cluster ? mrg_bytes : 0u) + 2u * ER * blockDim.x * (uint32_t)sizeof(uint4) + o_bytes;
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
    // O: the W_o slice, before the wait (weights: written by no kernel), as the last cp.async
    // group, after the early rows' own group, so the walk waits for those only.
    if (o_on) {
        if (early) asm volatile("cp.async.commit_group;" ::: "memory");
        attn_o_load<T, HD>(s_wo, oa, heads, h, o_r0, o_r1);
    }

    const float *qh = q + (size_t)tok * q_stride + h * HD;
    // The new row (ROPE only): its position when this split holds it, else -1.
    int new_row = -1;
    if (ROPE) {
        const int i = threadIdx.x, half = HD / 2;
        const bool active = i < half;
        const bool has_new = (int)pos >= start && (int)pos < end;  // pos < len <= capacity; uniform
        const int q_off = h * HD, k_off = (heads + kvh) * HD, v_off = (heads + kv_heads + kvh) * HD;
        // RoPE's angle (the same for q and k) is computed before the wait: it reads only the
        // position and the inverse frequencies, which no kernel writes; the sine and cosine
        // in f64 are a long dependent chain. The biases and norm weights (written by no kernel
        // either) are loaded after the wait, together with the new token's row: one round trip.
        const bool bias = rope.bias != nullptr;
        RopeConsts kq = {bias, rope.q_norm != nullptr, true, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f};
        if (active) rope_angle(pos, inv_f, kq.c, kq.sn);
        FERRUM_PDL_ENTRY();  // q, k and v of the new token come from the QKV projection
        // (The early copies are waited for after the RoPE work, before the walk reads them: the
        // loads of the new token's row below need not queue behind copies still in flight.)
        RopeConsts kk = {bias, rope.k_norm != nullptr, true, 0.0f, 0.0f, 0.0f, 0.0f, kq.c, kq.sn};
        RopeConsts kv = {bias, false, false, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f};
        const float *row = q + (size_t)tok * q_stride;
        // FOLD (the folded q/k/v, rope.pre_x non-null: the host launches these instances with
        // it only): this thread's first ATTN_PRE_REGS elements of r, loaded into registers
        // before the row's loads and used after them, so that both are one round trip (a loop
        // that sums as it loads put a round trip of its own ahead of the row's: +1.2 us a layer
        // at 135M, session 35 call 5's timeline). The other instances have none of this code.
        float pv[FOLD ? ATTN_PRE_REGS : 1];
        if constexpr (FOLD) {
#pragma unroll
            for (int j = 0; j < ATTN_PRE_REGS; ++j) {
                const int c = threadIdx.x + j * blockDim.x;
                pv[j] = c < rope.pre_n ? rope.pre_x[c] : 0.0f;
            }
        }
        // The raw pairs of q, k and v and their constants, loaded together (k and v only where
        // needed).
        float qa = 0.0f, qb = 0.0f, ka = 0.0f, kb2 = 0.0f, va = 0.0f, vb2 = 0.0f;
        if (active) {
            qa = row[q_off + i];
            qb = row[q_off + i + half];
            if (bias) {
                kq.ba = to_f(rope.bias[q_off + i]);
                kq.bb = to_f(rope.bias[q_off + i + half]);
            }
            if (kq.norm) {
                kq.na = to_f(rope.q_norm[i]);
                kq.nb = to_f(rope.q_norm[i + half]);
            }
            if (has_new) {
                ka = row[k_off + i];
                kb2 = row[k_off + i + half];
                va = row[v_off + i];
                vb2 = row[v_off + i + half];
                if (bias) {
                    kk.ba = to_f(rope.bias[k_off + i]);
                    kk.bb = to_f(rope.bias[k_off + i + half]);
                    kv.ba = to_f(rope.bias[v_off + i]);
                    kv.bb = to_f(rope.bias[v_off + i + half]);
                }
                if (kk.norm) {
                    kk.na = to_f(rope.k_norm[i]);
                    kk.nb = to_f(rope.k_norm[i + half]);
                }
            }
        }
        if constexpr (FOLD) {
            // u * rn: what the unfolded projection's GEMV gives (its acc * rn), up to rounding.
            // Uniform over the block (every thread calls block_sum).
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < ATTN_PRE_REGS; ++j) ss = fmaf(pv[j], pv[j], ss);
            for (int c = threadIdx.x + ATTN_PRE_REGS * blockDim.x; c < rope.pre_n; c += blockDim.x)
                ss = fmaf(rope.pre_x[c], rope.pre_x[c], ss);  // wider residuals: the rest
            const float rn = rsqrtf(block_sum(ss, s_red) / (float)rope.pre_n + rope.eps);
            qa *= rn, qb *= rn, ka *= rn, kb2 *= rn, va *= rn, vb2 *= rn;
        }
        rope_head<T, HD>(s_q, qa, qb, kq, false, scale, rope.eps, s_red);  // q, scaled
        if (has_new) {
            new_row = (int)pos;
            rope_head<T, HD>(s_k, ka, kb2, kk, true, 1.0f, rope.eps, s_red);
            rope_head<T, HD>(s_v, va, vb2, kv, true, 1.0f, rope.eps, s_red);
        }
        __syncthreads();
        if (new_row >= 0 && h % (heads / kv_heads) == 0) {
            const size_t at = ((size_t)kvh * capacity + pos) * HD;
            for (int d = threadIdx.x; d < HD; d += blockDim.x) {
                rope.k_out[at + d] = from_f<T>(s_k[d]);  // exact: s_k is already rounded
                rope.v_out[at + d] = from_f<T>(s_v[d]);
            }
        }
    } else {
        for (int d = threadIdx.x; d < HD; d += blockDim.x) s_q[d] = qh[d] * scale;
        __syncthreads();
    }
    FERRUM_TL_PHASE(tl_on, 0, 0.0f);
    // This thread's early copies have landed (it reads back only the slots it copied).
    if (early) {
        if (o_on) {
            asm volatile("cp.async.wait_group 1;" ::: "memory");  // all but the W_o group
        } else {
            cp_early_wait();
        }
    }
    FERRUM_TL_PHASE(tl_on, 1, 0.0f);
    float qv[8], acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        qv[j] = chunk_on ? s_q[gl * 8 + j] : 0.0f;
        acc[j] = 0.0f;
    }
    // This warp's running max and sum over the rows it walked (warp-uniform: each comes from a
    // warp reduction). A warp that has seen no row keeps m = -inf, l = 0 and acc = 0.
    float m = FERRUM_NEG_INF, l = 0.0f;
    for (int t0 = start; t0 < end; t0 += ATTN_TILE) {
        const int n = min(ATTN_TILE, end - t0);
        // The early rows lie in the first tile (ER * slots <= ATTN_EARLY_ROWS * ATTN_MAX_WARPS
        // * 16 = ATTN_TILE at most: static_assert above); later iterations and tiles load from
        // the cache here.
        const bool first_early = early && t0 == start;
        const int ib_late = warp * TPW + (first_early ? ER * slots : 0);
        // 1. Scores. The loop bounds are warp-uniform (every lane reaches the shuffles). Row i
        //    is this warp's (i = warp * TPW + sub modulo slots), so s_p[i] is written and read
        //    by this warp only.
        float mt = FERRUM_NEG_INF;
        if (first_early) {
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
                    if (i < n) {
                        mt = fmaxf(mt, sc);
                        if (gl == 0) s_p[i] = sc;
                    }
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
            if (i < n) {
                mt = fmaxf(mt, sc);
                if (gl == 0) s_p[i] = sc;
            }
        }
        // 2. The warp's softmax bookkeeping (no block barrier: the rows are the warp's own).
        mt = warp_max(mt);
        __syncwarp();  // publishes this warp's s_p entries to its lanes
        const float mn = fmaxf(m, mt);
        // A warp with no row so far keeps mn = -inf (and acc = l = 0): nothing to rescale.
        const float corr = mn == FERRUM_NEG_INF ? 1.0f : expf(m - mn);  // exp(-inf) = 0 at first
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] *= corr;
        // 3. Values. Each lane of a row's group computes the row's p; lane gl == 0 counts it.
        float ls = 0.0f;
        if (first_early) {
#pragma unroll
            for (int u = 0; u < ER; ++u) {
                const int i = warp * TPW + u * slots + sub;
                if (i < n) {
                    const float p = expf(s_p[i] - mn);
                    if (gl == 0) ls += p;
                    if (chunk_on) {
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
        }
#pragma unroll 4
        for (int ib = ib_late; ib < n; ib += slots) {
            const int i = ib + sub;
            if (i < n) {
                const float p = expf(s_p[i] - mn);
                if (gl == 0) ls += p;
                if (chunk_on) {
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
        }
        l = fmaf(l, corr, warp_sum(ls));
        m = mn;
        __syncwarp();  // s_p is rewritten by the next tile
    }
    FERRUM_TL_PHASE(tl_on, 2, l + acc[7]);
    // 4. The block's partial: each warp's slots summed in slot order, weighted by exp(m_w - M).
    if (chunk_on) {
#pragma unroll
        for (int j = 0; j < 8; ++j) s_acc[slot][gl * 8 + j] = acc[j];
    }
    if (lane == 0) {
        s_wm[warp] = m;
        s_wl[warp] = l;
    }
    __syncthreads();
    float M = FERRUM_NEG_INF;
    for (int w = 0; w < nw; ++w) M = fmaxf(M, s_wm[w]);
    // Warp w's weight exp(m_w - M) (0 for a warp that saw no row), recomputed where used: an
    // array of them costs ptxas a stack frame.
    auto weight = [&](int w) {
        const float mw = s_wm[w];
        return mw == FERRUM_NEG_INF ? 0.0f : expf(mw - M);
    };
    float L = 0.0f;
    for (int w = 0; w < nw; ++w) L = fmaf(s_wl[w], weight(w), L);
    // Cluster step 2 (before the first remote store): every block of the cluster has started.
    if (cluster) cluster_wait();
    FERRUM_TL_PHASE(tl_on, 3, L);
    const uint32_t mrg0 = cluster ? cluster_map(s_mrg, 0) : 0u;  // block 0's merge buffer
    const uint32_t bar0 = cluster ? cluster_map(&s_mbar, 0) : 0u;  // and its mbarrier
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float A = 0.0f;
        for (int w = 0; w < nw; ++w) {
            float aw = 0.0f;
#pragma unroll
            for (int t = 0; t < TPW; ++t) aw += s_acc[w * TPW + t][d];
            A = fmaf(aw, weight(w), A);
        }
        if (n_splits == 1) {
            const float o = L > 0.0f ? A / L : 0.0f;
            out[(size_t)tok * heads * HD + h * HD + d] = o;
        } else if (merger) {
            s_mrg[split * HD + d] = A;
        } else if (cluster) {
            st_async(mrg0 + 4u * (uint32_t)(split * HD + d), A, bar0);
        } else {
            part_acc[(((size_t)tok * heads + h) * n_splits + split) * HD + d] = A;
        }
    }
    if (n_splits > 1 && threadIdx.x == 0) {
        if (merger) {
            s_mrg[n_splits * HD + 2 * split] = M;
            s_mrg[n_splits * HD + 2 * split + 1] = L;
        } else if (cluster) {
            st_async(mrg0 + 4u * (uint32_t)(n_splits * HD + 2 * split), M, bar0);
            st_async(mrg0 + 4u * (uint32_t)(n_splits * HD + 2 * split + 1), L, bar0);
        } else {
            float *ml = part_ml + (((size_t)tok * heads + h) * n_splits + split) * 2;
            ml[0] = M;
            ml[1] = L;
        }
    }
    if (cluster) {
        // Step 3: the other blocks are done (their bytes complete on block 0's mbarrier).
        if (!merger) {
            if (!o_on) return;
            // O step 2 (OArgs above): o_h lands in this block's s_q (q is in registers since
            // the walk began), pushed by block 0 after its merge.
            merge_bar_wait(&s_obar);
            attn_o<T, HD>(s_wo, s_q, oa, heads, h, (int)rank, o_r0, o_r1);
            return;
        }
        __syncthreads();  // block 0's own partial, stored by its threads above
        merge_bar_wait(&s_mbar);
        FERRUM_TL_PHASE(tl_on, 4, 0.0f);
        // Step 4.
        merge_cluster_rows<HD>(out + ((size_t)tok * heads + h) * HD, s_mrg, s_mrg + n_splits * HD, n_splits,
                               o_on ? s_q : nullptr);
        FERRUM_TL_PHASE(tl_on, 5, 0.0f);
        if (!o_on) return;
        // O step 2: o_h (each thread its own columns of s_q, as merge_cluster_rows wrote them)
        // into every other block's s_q, completing on that block's mbarrier; every block of
        // the cluster passed step 2 of the merge (cluster_wait above) after initialising it.
        for (int d = threadIdx.x; d < HD; d += blockDim.x) {
            for (int rk = 1; rk < n_splits; ++rk)
                st_async(cluster_map(s_q + d, (uint32_t)rk), s_q[d], cluster_map(&s_obar, (uint32_t)rk));
        }
        attn_o<T, HD>(s_wo, s_q, oa, heads, h, 0, o_r0, o_r1);
        return;
    }
    if (n_splits > 1 && counters != nullptr)
        merge_splits(out, part_acc, part_ml, counters + (size_t)tok * heads + h, heads, HD, n_splits);
}

template <typename T, bool ROPE, bool EARLY = false>
__device__ void attn(const float *q, int q_stride, const T *k_cache, const T *v_cache, float *out,
                     float *part_acc, float *part_ml, uint32_t *counters,
                     const uint32_t *pos_base, int heads, int kv_heads, int hd, int capacity,
                     float scale, const RopeArgs<T> &rope) {
    const OArgs<T> oa = {nullptr, nullptr, nullptr, nullptr, 0};  // the o projection: none
    __shared__ __align__(16) float smem[ATTN_SMEM_FLOATS];
    // The cluster merge buffer and the early K/V copies (see attn_impl), in the launch's
    // dynamic shared memory (none unless the host gives it).
    extern __shared__ uint4 s_dyn[];
    switch (hd) {
    case 16:
        attn_impl<T, 16, ROPE, EARLY, false>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                         kv_heads, capacity, scale, smem, s_dyn, rope, oa);
        break;
    case 32:
        attn_impl<T, 32, ROPE, EARLY, false>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                         kv_heads, capacity, scale, smem, s_dyn, rope, oa);
        break;
    case 64:
        attn_impl<T, 64, ROPE, EARLY, false>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_dyn, rope, oa);
        break;
    case 96:
        attn_impl<T, 96, ROPE, EARLY, false>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_dyn, rope, oa);
        break;
    case 128:
        attn_impl<T, 128, ROPE, EARLY, false>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_dyn, rope, oa);
        break;
    case 256:
        attn_impl<T, 256, ROPE, EARLY, false>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale, smem, s_dyn, rope, oa);
        break;
    default:
        break;  // the host only launches supported head dims
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill attention on tensor cores (ferrum_attn_prefill_*), FlashAttention-2 style: causal
// attention of n_tok query rows (positions pos_base[0] + t) over one layer's cache, head dims
// 16..128 (multiples of 16). The decode kernel above walks rows with CUDA-core dot products,
// which for a 1024-token prompt is n_tok times the whole cache per head; here each block takes
// PF_BM query rows of one head and streams PF_BN-row tiles of K and V through shared memory
// (cp.async, double-buffered: tile i+1 is in flight while tile i is multiplied), with raw
// mma.sync m16n8k16 in the model dtype and f32 accumulation, whose register layouts are
// documented (PTX ISA, "Matrix Fragments for mma.m16n8k16"), so that the softmax runs on the
// score fragments in registers and P feeds the P.V product without a trip through memory.
//
// Warp w owns query rows q0 + 16w .. + 16. In a fragment, lane l holds rows g = l / 4 and
// g + 8 and, per 8-column block, the columns 2 (l % 4) and 2 (l % 4) + 1 (C/D layout); the
// A operand of the next product takes two adjacent 8-column blocks of C as one 16-wide k
// step, which is why P never leaves registers.
//
// One pass, online softmax (per row: running max m, running sum l, output O rescaled by
// 2^(m_old - m_new) when the max grows). q is scaled by scale * log2(e) before it is rounded,
// so scores are in base 2 and every exponential is one exp2f. Row max and sum are reduced
// over the 4 lanes of a row by a fixed xor tree, so every order is fixed by the launch shape
// and results are deterministic.
//
// Numerics: q, K, V and P are rounded to the model dtype (bf16 or f16; K and V already are,
// and are copied as stored); scores, m, l and O accumulate in f32. P = 2^(s - m) lies in
// (0, 1] with the row's largest term exactly 1, so its rounding is relative (values below
// 2^-14 in f16 lose bits as subnormals, but they are under 2^-14 of the row's largest term).
// For f16 models q is clamped to +-65504 first, so no infinity can appear.
//
// Grid (heads, ceil(n_tok / PF_BM)), block PF_WARPS * 32 threads; blockIdx.y counts from the
// last query block, so the blocks with the most keys start first. Keys of the block: [0, kend)
// with kend = min(pos of its last row + 1, capacity); key j is masked for row t when
// j > pos_base[0] + t. Tile rows at or past kend are zero-filled by cp.async (source size 0,
// the cache is not read there), so masked lanes multiply exact zeros.

#define PF_WARPS 4
#define PF_BM (16 * PF_WARPS)
#define PF_BN 32

// Shared memory: stages of K and V tiles, [stage][K|V][PF_BN][HD + 8] in the model dtype (two
// in the prefill kernel; `stages` in the decode one, attn_gqa_impl).
// The 8-element pad makes the row stride an odd number of 16-byte units for every supported
// head dim, so the 8 row addresses of one ldmatrix hit 8 different bank groups.
template <int HD> struct PfLayout {
    static constexpr int LD = HD + 8;          // elements per row
    static constexpr int TILE = PF_BN * LD;    // elements of one K or V tile
    static constexpr int BYTES = 2 * 2 * TILE * 2;
};
#define PF_SMEM_BYTES (PfLayout<128>::BYTES)

// Two floats as one 32-bit register of the dtype (lo in the low half: the lower k index).
__device__ __forceinline__ uint32_t pf_pack(float lo, float hi, f16) {
    __half2 h = __floats2half2_rn(fminf(fmaxf(lo, -65504.0f), 65504.0f), fminf(fmaxf(hi, -65504.0f), 65504.0f));
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}
__device__ __forceinline__ uint32_t pf_pack(float lo, float hi, bf16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}

// d += a (16x16, row) . b (16x8, col), f32 accumulators.
__device__ __forceinline__ void pf_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, f16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void pf_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 matrices of 16-bit elements from shared memory: lane l gives the address of row
// l % 8 of matrix l / 8; register i receives matrix i, lane l holding row l / 4, elements
// 2 (l % 4) and +1 (.trans: column l / 4, rows 2 (l % 4) and +1). Volatile with a memory
// clobber, so it stays between the barriers that publish the tile.
__device__ __forceinline__ void pf_ldsm4(uint32_t (&r)[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
__device__ __forceinline__ void pf_ldsm4_t(uint32_t (&r)[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// 16 bytes global -> shared, asynchronously; `valid` false writes 16 zero bytes and reads
// nothing (source size 0; `src` must still be a valid address, the callers pass row 0).
__device__ __forceinline__ void pf_cp16(void *dst, const void *src, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(n) : "memory");
}

// Rows [k0, k0 + PF_BN) of one KV head's K and V into stage `st` (rows >= kend as zeros), as one
// cp.async group, by the NTH threads of the block.
template <typename T, int HD, int NTH>
__device__ __forceinline__ void pf_load_tile(T *smem, int st, const T *kc, const T *vc, int k0, int kend) {
    using L = PfLayout<HD>;
    constexpr int CH = HD / 8;  // 16-byte chunks per row
    T *sk = smem + st * 2 * L::TILE, *sv = sk + L::TILE;
    for (int i = threadIdx.x; i < PF_BN * CH; i += NTH) {
        const int r = i / CH, ch = i % CH, key = k0 + r;
        const bool in = key < kend;
        const size_t off = (size_t)(in ? key : 0) * HD + ch * 8;
        pf_cp16(sk + r * L::LD + ch * 8, kc + off, in);
        pf_cp16(sv + r * L::LD + ch * 8, vc + off, in);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most n of this thread's cp.async groups are pending (n <= PF_MAX_STAGES - 2;
// the count must be an immediate, hence the switch).
#define PF_MAX_STAGES 6
__device__ __forceinline__ void pf_wait_pending(int n) {
    switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    }
}

// The A fragments of 16 query rows (HD wide, scaled by qs, rounded to the dtype): `qa` and `qb`
// point at element 2 (lane % 4) of rows g and g + 8; a row whose flag is false is zeros (its
// pointer is not read).
template <typename T, int HD>
__device__ __forceinline__ void pf_q_frags(uint32_t (&qf)[HD / 16][4], const float *qa, bool va,
                                           const float *qb, bool vb, float qs) {
    const float2 z = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const float2 a0 = va ? *reinterpret_cast<const float2 *>(qa + 16 * kk) : z;
        const float2 a1 = vb ? *reinterpret_cast<const float2 *>(qb + 16 * kk) : z;
        const float2 a2 = va ? *reinterpret_cast<const float2 *>(qa + 16 * kk + 8) : z;
        const float2 a3 = vb ? *reinterpret_cast<const float2 *>(qb + 16 * kk + 8) : z;
        qf[kk][0] = pf_pack(a0.x * qs, a0.y * qs, T());
        qf[kk][1] = pf_pack(a1.x * qs, a1.y * qs, T());
        qf[kk][2] = pf_pack(a2.x * qs, a2.y * qs, T());
        qf[kk][3] = pf_pack(a3.x * qs, a3.y * qs, T());
    }
}

// One warp's running softmax state over its 16 rows: lane l holds rows g = l / 4 (index 0)
// and g + 8 (index 1): max m (base 2), this lane's share of the sum l, and the output O
// (8-column blocks, C layout).
template <int HD> struct PfState {
    float o[HD / 8][4];
    float m[2], l[2];
    __device__ __forceinline__ void init() {
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
        m[0] = m[1] = FERRUM_NEG_INF;
        l[0] = l[1] = 0.0f;
    }
    // The row sums over the row's 4 lanes (a fixed xor tree: the same value on each).
    __device__ __forceinline__ void reduce_l() {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        }
    }
};

// One K/V tile (PF_BN keys from k0, in shared memory at sk / sv) into one warp's 16 rows:
// s = q . K^T, the online softmax update, O += P V. With `mask`, key j is dropped for row i
// when j > lim[i] or j >= kend (the caller sets it for tiles that cross a limit).
template <typename T, int HD>
__device__ __forceinline__ void pf_tile(PfState<HD> &st, const uint32_t (&qf)[HD / 16][4], const T *sk,
                                        const T *sv, int k0, bool mask, const int (&lim)[2], int kend) {
    constexpr int LD = PfLayout<HD>::LD;
    constexpr int KS = HD / 16;     // k steps of q . K^T
    constexpr int NS = PF_BN / 8;   // 8-column blocks of a score tile
    constexpr int NO = HD / 8;      // 8-column blocks of the output
    const int lane = threadIdx.x & 31, c = lane & 3;
    // s = q . K^T: 16 x PF_BN scores (base 2). ldmatrix (no transpose) of K rows gives the
    // col-major B operand: matrices (keys 16np + 0..7 | + 8..15) x (dims lo | hi).
    float s[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int np = 0; np < NS / 2; ++np) {
            uint32_t b[4];
            pf_ldsm4(b, sk + (16 * np + (lane >> 4) * 8 + (lane & 7)) * LD + 16 * kk + ((lane >> 3) & 1) * 8);
            pf_mma(s[2 * np], qf[kk], b[0], b[1], T());
            pf_mma(s[2 * np + 1], qf[kk], b[2], b[3], T());
        }
    }
    if (mask) {
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + 8 * j + 2 * c + (e & 1);
                if (key > lim[e >> 1] || key >= kend) s[j][e] = FERRUM_NEG_INF;
            }
        }
    }
    // Online softmax: the row max over this lane's columns, then over the row's 4 lanes.
    float x[2] = {st.m[0], st.m[1]}, base[2];
#pragma unroll
    for (int j = 0; j < NS; ++j) {
        x[0] = fmaxf(x[0], fmaxf(s[j][0], s[j][1]));
        x[1] = fmaxf(x[1], fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        x[i] = fmaxf(x[i], __shfl_xor_sync(0xffffffffu, x[i], 1));
        x[i] = fmaxf(x[i], __shfl_xor_sync(0xffffffffu, x[i], 2));
        // A row with no key yet keeps m = -inf; the 0 base keeps it free of inf - inf.
        base[i] = x[i] == FERRUM_NEG_INF ? 0.0f : x[i];
        const float a = exp2f(st.m[i] - base[i]);  // 0 when m was -inf
        st.m[i] = x[i];
        st.l[i] *= a;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            st.o[j][2 * i] *= a;
            st.o[j][2 * i + 1] *= a;
        }
    }
    // P = 2^(s - m) as A fragments: 8-column blocks 2j and 2j + 1 form k step j.
    uint32_t pa[PF_BN / 16][4];
#pragma unroll
    for (int j = 0; j < PF_BN / 16; ++j) {
        const float p00 = exp2f(s[2 * j][0] - base[0]), p01 = exp2f(s[2 * j][1] - base[0]);
        const float p02 = exp2f(s[2 * j][2] - base[1]), p03 = exp2f(s[2 * j][3] - base[1]);
        const float p10 = exp2f(s[2 * j + 1][0] - base[0]), p11 = exp2f(s[2 * j + 1][1] - base[0]);
        const float p12 = exp2f(s[2 * j + 1][2] - base[1]), p13 = exp2f(s[2 * j + 1][3] - base[1]);
        st.l[0] += (p00 + p01) + (p10 + p11);
        st.l[1] += (p02 + p03) + (p12 + p13);
        pa[j][0] = pf_pack(p00, p01, T());
        pa[j][1] = pf_pack(p02, p03, T());
        pa[j][2] = pf_pack(p10, p11, T());
        pa[j][3] = pf_pack(p12, p13, T());
    }
    // O += P V. ldmatrix.trans of V rows gives the col-major B operand: matrices
    // (keys 16j + 0..7 | + 8..15) x (dims 16np + 0..7 | + 8..15).
#pragma unroll
    for (int j = 0; j < PF_BN / 16; ++j) {
#pragma unroll
        for (int np = 0; np < NO / 2; ++np) {
            uint32_t b[4];
            pf_ldsm4_t(b, sv + (16 * j + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + 16 * np + (lane >> 4) * 8);
            pf_mma(st.o[2 * np], pa[j], b[0], b[1], T());
            pf_mma(st.o[2 * np + 1], pa[j], b[2], b[3], T());
        }
    }
}

// Row i (0: g, 1: g + 8) of the warp's output, times `scale`, to `dst` (f32, HD wide): 8 bytes
// per lane per 8-column block.
template <int HD>
__device__ __forceinline__ void pf_store_row(float *dst, const PfState<HD> &st, int i, float scale) {
    const int c = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
        *reinterpret_cast<float2 *>(dst + 8 * j + 2 * c) = make_float2(st.o[j][2 * i] * scale, st.o[j][2 * i + 1] * scale);
}

template <typename T, int HD>
__device__ void attn_prefill_impl(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                                  float *out, const uint32_t *pos_base, int n_tok, int heads,
                                  int kv_heads, int capacity, float scale, T *smem) {
    using L = PfLayout<HD>;
    static_assert(HD % 16 == 0 && PF_BN % 16 == 0, "whole mma tiles");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;  // fragment row (and row + 8), column pair
    const int h = blockIdx.x;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * PF_BM;  // q0 < n_tok (grid)
    const int kvh = h / (heads / kv_heads);
    const int p0 = (int)pos_base[0];                        // p0 + n_tok <= capacity (host)
    const int last = min(q0 + PF_BM, n_tok) - 1;
    const int kend = min(p0 + last + 1, capacity);
    const T *kc = k_cache + (size_t)kvh * capacity * HD;
    const T *vc = v_cache + (size_t)kvh * capacity * HD;

    pf_load_tile<T, HD, PF_WARPS * 32>(smem, 0, kc, vc, 0, kend);  // in flight while q loads

    // This lane's query rows r0 and r1 = r0 + 8; q scaled by scale * log2(e) (base-2 scores).
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    uint32_t qf[HD / 16][4];
    pf_q_frags<T, HD>(qf, q + (size_t)r0 * q_stride + h * HD + 2 * c, r0 < n_tok,
                      q + (size_t)r1 * q_stride + h * HD + 2 * c, r1 < n_tok, scale * 1.4426950408889634f);
    const int lim[2] = {p0 + r0, p0 + r1};       // the last key each row may see
    const int wlo = p0 + q0 + warp * 16;          // the warp's smallest limit
    // The warp's largest limit among real rows (-1: no real row, nothing to compute).
    const int whi = q0 + warp * 16 < n_tok ? p0 + min(q0 + warp * 16 + 15, n_tok - 1) : -1;

    PfState<HD> st;
    st.init();
    const int ntiles = (kend + PF_BN - 1) / PF_BN;
    for (int it = 0; it < ntiles; ++it) {
        const int k0 = it * PF_BN, stage = it & 1;
        if (it + 1 < ntiles) {
            // Stage stage ^ 1 was last read in iteration it - 1, which ended with a barrier.
            pf_load_tile<T, HD, PF_WARPS * 32>(smem, stage ^ 1, kc, vc, k0 + PF_BN, kend);
            asm volatile("cp.async.wait_group 1;" ::: "memory");  // this thread's tile it landed
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();  // every thread's part of tile it is visible
        if (k0 <= whi) {  // warp-uniform
            const T *sk = smem + stage * 2 * L::TILE;
            pf_tile<T, HD>(st, qf, sk, sk + L::TILE, k0, k0 + PF_BN - 1 > wlo || k0 + PF_BN > kend, lim, kend);
        }
        __syncthreads();  // tile it is no longer read: the next iteration refills its stage
    }
    st.reduce_l();
    // Every real row sees key 0, so its l > 0.
    const size_t ost = (size_t)heads * HD;
    if (r0 < n_tok) pf_store_row<HD>(out + (size_t)r0 * ost + h * HD, st, 0, 1.0f / st.l[0]);
    if (r1 < n_tok) pf_store_row<HD>(out + (size_t)r1 * ost + h * HD, st, 1, 1.0f / st.l[1]);
}

// The head-dim switch of the tensor-core kernels (plan::PREFILL_HEAD_DIMS; a unit test checks
// the list): CALL(HD) for hd in the list, nothing for any other (the host launches these only).
#define PF_HEAD_DIMS(hd, CALL)                                                                     \
    switch (hd) {                                                                                  \
    case 16: CALL(16); break;                                                                      \
    case 32: CALL(32); break;                                                                      \
    case 64: CALL(64); break;                                                                      \
    case 96: CALL(96); break;                                                                      \
    case 128: CALL(128); break;                                                                    \
    default: break;                                                                                \
    }

template <typename T>
__device__ void attn_prefill(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                             float *out, const uint32_t *pos_base, int n_tok, int heads,
                             int kv_heads, int hd, int capacity, float scale) {
    __shared__ __align__(128) unsigned char smem_raw[PF_SMEM_BYTES];
    T *smem = reinterpret_cast<T *>(smem_raw);
#define PF_CALL(HD) \
    attn_prefill_impl<T, HD>(q, q_stride, k_cache, v_cache, out, pos_base, n_tok, heads, kv_heads, capacity, scale, smem)
    PF_HEAD_DIMS(hd, PF_CALL)
#undef PF_CALL
}

// ---------------------------------------------------------------------------------------------
// Long-context decode attention on tensor cores (ferrum_attn_gqa_*): one query token, with the
// G = heads / kv_heads q heads of one KV group as the rows of one warp's 16-row tile (G <= 16,
// host-checked; rows G..15 are zeros), over one split of the cache. Each K/V row is read once
// per group (the row-walking kernel above reads it once per q head), and the tiles stream
// through shared memory with cp.async, `stages - 1` tiles ahead (those of the first
// `stages - 1` whose rows precede the new token issued before the programmatic-launch wait),
// through the prefill kernel's tile step
// (pf_tile: same numerics). The host takes this path for long caches
// (plan::attn_tensor_core), after rope_qkv: q is the roped qkv row.
//
// grid (kv_heads, n_splits, n_tok), block 32 threads (one warp). Split s covers cache rows
// [s * chunk, min((s + 1) * chunk, len)) with len = min(pos + 1, capacity) and chunk =
// ceil(len / n_splits), as in attn_impl. With one split the normalised output goes to `out`;
// otherwise the unnormalised partial and (max, sum) go to part_acc / part_ml in attn_impl's
// layout (the max in natural-log units) for attn_combine; an empty split writes max -inf and
// sum 0, which the combine skips.
template <typename T, int HD>
__device__ void attn_gqa_impl(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                              float *out, float *part_acc, float *part_ml, const uint32_t *pos_base,
                              int heads, int kv_heads, int capacity, float scale, int stages,
                              bool allow_early, T *smem) {
    using L = PfLayout<HD>;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int kvh = blockIdx.x, split = blockIdx.y, tok = blockIdx.z, n_splits = gridDim.y;
    const int G = heads / kv_heads;
    // Before the wait, through L2 (ld_early: never a stale L1 line), as attn_impl's ROPE note
    // says: the position is written by the previous step, never by rope_qkv.
    const uint32_t pos0 = ld_early(pos_base);
    const uint32_t pos = pos0 + (uint32_t)tok;
    const int len = (int)min(pos + 1u, (uint32_t)capacity);
    const int chunk = (len + n_splits - 1) / n_splits;
    const int start = min(split * chunk, len), end = min(start + chunk, len);
    const T *kc = k_cache + (size_t)kvh * capacity * HD;
    const T *vc = v_cache + (size_t)kvh * capacity * HD;
    const int ntiles = (end - start + PF_BN - 1) / PF_BN;

    // The pipeline (stages >= 2, host-checked): tile i goes to stage i % stages as cp.async
    // group i: one group per tile, and past the last tile an empty group, so that after
    // stages - 1 + i commits, "tile i has landed" is "at most stages - 2 groups pending". The
    // prologue's tiles whose rows all lie before pos_base[0] are issued before the
    // programmatic-launch wait: rope_qkv, the kernel this one depends on, writes cache rows
    // from pos_base[0] on only, and the earlier rows were written by launches that completed
    // before this grid started (attn_impl's ROPE note). Rows are split in order, so the tiles
    // that hold new rows come last; they are issued after the wait, still in tile order.
    // Without allow_early (the host's choice) every tile is issued after the wait (the
    // position is still read before it).
    const int pre = min(ntiles, stages - 1);
    const int early = !allow_early ? 0 : end <= (int)pos0 ? pre : min(pre, max(0, ((int)pos0 - start) / PF_BN));
    for (int i = 0; i < early; ++i) pf_load_tile<T, HD, 32>(smem, i, kc, vc, start + i * PF_BN, end);
    FERRUM_PDL_ENTRY();  // q and the new cache rows come from rope_qkv
    for (int i = early; i < pre; ++i) pf_load_tile<T, HD, 32>(smem, i, kc, vc, start + i * PF_BN, end);
    for (int i = pre; i < stages - 1; ++i) asm volatile("cp.async.commit_group;" ::: "memory");

    const int hq[2] = {kvh * G + g, kvh * G + g + 8};  // the q heads of rows g and g + 8
    const bool real[2] = {g < G, g + 8 < G};
    const float *qrow = q + (size_t)tok * q_stride + 2 * c;
    uint32_t qf[HD / 16][4];
    pf_q_frags<T, HD>(qf, qrow + (size_t)hq[0] * HD, real[0], qrow + (size_t)hq[1] * HD, real[1],
                      scale * 1.4426950408889634f);
    const int lim[2] = {end - 1, end - 1};  // every row of the split is at or before pos

    PfState<HD> st;
    st.init();
    // cur = it % stages and fill = (it + stages - 1) % stages, kept without a division.
    for (int it = 0, cur = 0, fill = stages - 1; it < ntiles; ++it) {
        if (it + 1 == ntiles) {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        } else {
            pf_wait_pending(stages - 2);
        }
        __syncwarp();  // (memory-ordering among the warp's lanes) every lane's copies visible
        // Stage `fill` was last read in iteration it - 1, which ended with __syncwarp: refill it
        // with tile it + stages - 1 (an empty group past the last tile).
        const int next = it + stages - 1;
        if (next < ntiles) {
            pf_load_tile<T, HD, 32>(smem, fill, kc, vc, start + next * PF_BN, end);
        } else {
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
        const int k0 = start + it * PF_BN;
        const T *sk = smem + cur * 2 * L::TILE;
        cur = cur + 1 == stages ? 0 : cur + 1;
        fill = fill + 1 == stages ? 0 : fill + 1;
        pf_tile<T, HD>(st, qf, sk, sk + L::TILE, k0, k0 + PF_BN > end, lim, end);
        __syncwarp();  // the tile is no longer read: a later iteration refills its stage
    }
    st.reduce_l();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!real[i]) continue;
        const size_t th = (size_t)tok * heads + hq[i];
        if (n_splits == 1) {
            pf_store_row<HD>(out + th * HD, st, i, 1.0f / st.l[i]);  // len >= 1: l > 0
        } else {
            const size_t slot = th * n_splits + split;
            pf_store_row<HD>(part_acc + slot * HD, st, i, 1.0f);
            if (c == 0) {
                part_ml[slot * 2] = st.m[i] * 0.6931471805599453f;  // base 2 -> natural log
                part_ml[slot * 2 + 1] = st.l[i];
            }
        }
    }
}

// The decode tensor-core attention. Dynamic shared memory: `stages` stages of K and V tiles,
// PfLayout<hd> each (plan::attn_gqa_dyn_bytes sizes it).
template <typename T>
__device__ void attn_gqa(const float *q, int q_stride, const T *k_cache, const T *v_cache, float *out,
                         float *part_acc, float *part_ml, const uint32_t *pos_base, int heads,
                         int kv_heads, int hd, int capacity, float scale, int stages, int allow_early) {
    extern __shared__ __align__(128) unsigned char smem_dyn[];
    T *smem = reinterpret_cast<T *>(smem_dyn);
#define PF_CALL(HD)                                                                                \
    attn_gqa_impl<T, HD>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, pos_base, heads,   \
                         kv_heads, capacity, scale, stages, allow_early != 0, smem)
    PF_HEAD_DIMS(hd, PF_CALL)
#undef PF_CALL
}

// grid (heads, n_tok); block: round_up(hd, 32) threads, one column each. Merges the splits
// (the unfused path), as merge_into would, bit for bit.
__device__ void attn_combine(float *out, const float *part_acc, const float *part_ml, int heads,
                             int hd, int n_splits) {
    __shared__ float s_wl[2 * ATTN_MAX_SPLITS];
    const int tok = blockIdx.y, h = blockIdx.x;
    const size_t base = ((size_t)tok * heads + h) * n_splits;
    combine_rows(out + ((size_t)tok * heads + h) * hd, part_acc + base * hd, part_ml + base * 2, hd,
                 n_splits, s_wl);
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
    extern "C" __global__ void __launch_bounds__(32) ferrum_attn_gqa_##S(                          \
        const float *q, int q_stride, const T *k_cache, const T *v_cache, float *out,              \
        float *part_acc, float *part_ml, const uint32_t *pos_base, int heads, int kv_heads,        \
        int hd, int capacity, float scale, int stages, int allow_early) {                          \
        /* attn_gqa_impl runs FERRUM_PDL_ENTRY, after its early tiles */                           \
        attn_gqa<T>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, pos_base, heads,        \
                    kv_heads, hd, capacity, scale, stages, allow_early);                           \
    }                                                                                              \
    extern "C" __global__ void ferrum_attn_combine_##S(float *out, const float *part_acc,          \
                                                       const float *part_ml, int heads, int hd,    \
                                                       int n_splits) {                             \
        FERRUM_PDL_ENTRY();                                                                        \
        attn_combine(out, part_acc, part_ml, heads, hd, n_splits);                                 \
    }

// fold.cu includes this file for its templates and instantiates only its own kernels.
#ifndef FERRUM_FOLD_MODULE
FERRUM_ATTN(f16, f16)
FERRUM_ATTN(bf16, bf16)
#endif

// The fused decode attention with its own kernel per head dim (plan::ATTN_OWN_HEAD_DIMS; the
// host launches these for that head dim only and passes it anyway, so the signature is the
// generic kernel's): one attn_impl instance instead of the six of the head-dim switch, the
// same source, so the same results bit for bit (GPU test attention_head_dim_kernels_are_bit_
// identical). Where the generic kernel gets 102 registers (its largest instance's need) for
// every head dim, ptxas fits this one in 76, so while it runs, more of the next GEMV's warps
// are resident and stream their first weights. The minimum of one block per multiprocessor in
// __launch_bounds__ matters: without it ptxas's default register heuristic gives the
// one-instance kernel 64 registers and a 24-byte stack frame (spills), which measured 11%
// slower at 8B (session 20, call 2); with it, +5% over the generic kernel (call 3).
// One such kernel: NAME ferrum_attn_rope[_early]_hdHD_S, EARLY as in attn_impl.
#define FERRUM_ATTN_ROPE_HD_KERNEL(NAME, T, HD, EARLY)                                             \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                     \
        const float *qkv, int q_stride, T *k_cache, T *v_cache, float *out, float *part_acc,       \
        float *part_ml, uint32_t *counters, const uint32_t *pos_base, int heads, int kv_heads,     \
        int /* hd == HD */, int capacity, float scale, const T *bias, const T *q_norm,             \
        const T *k_norm, const float *inv_freq, float eps) {                                       \
        __shared__ __align__(16) float smem[ATTN_SMEM_FLOATS];                                     \
        extern __shared__ uint4 s_dyn[];                                                           \
        const RopeArgs<T> rope = {bias, q_norm, k_norm, inv_freq, k_cache, v_cache, eps};         \
        const OArgs<T> no_o = {nullptr, nullptr, nullptr, nullptr, 0};                             \
        attn_impl<T, HD, true, EARLY, false>(qkv, q_stride, k_cache, v_cache, out, part_acc,       \
                                             part_ml, counters, pos_base, heads, kv_heads,         \
                                             capacity, scale, smem, s_dyn, rope, no_o);            \
    }
#define FERRUM_ATTN_ROPE_HD(S, T, HD)                                                              \
    FERRUM_ATTN_ROPE_HD_KERNEL(ferrum_attn_rope_hd##HD##_##S, T, HD, false)                        \
    FERRUM_ATTN_ROPE_HD_KERNEL(ferrum_attn_rope_early_hd##HD##_##S, T, HD, true)

#ifndef FERRUM_FOLD_MODULE
FERRUM_ATTN_ROPE_HD(f16, f16, 128)
FERRUM_ATTN_ROPE_HD(bf16, bf16, 128)
#endif

// The compact decode attention (ferrum_attn_rope_early_compact_hd64_*; plan::attn_compact):
// the fused RoPE kernel's one-token, early-copy, cluster-merge case at head dim 64 without
// bias or head norms (SmolLM2, Llama-3.2-1B), as a short kernel of its own. The generic
// kernel's path for that case runs through shared memory and block barriers at every stage
// (q and the new row, the scores, the slot partials, the block's combine) inside a 374 KB
// kernel; this one keeps them in registers:
// - each lane loads its own 16-byte chunk of q (and, in the slot that holds the new row, of k
//   and v) and the chunk it pairs with under RoPE (d ^ 32), one round trip, and rotates in
//   registers (rope_pair's operations: a' = a c - b s, b' = b c + a s);
// - each slot's (up to ATTN_EARLY_ROWS) rows come from the early copies, scores and
//   probabilities stay in registers, a row's 8 lanes share its score by butterfly;
// - no block combine: each warp pushes its partial (64 sums, max, sum: 17 16-byte stores, one
//   st.async instruction, the lanes of every row group holding the sums after the reduction)
//   into block 0 of the cluster, which merges n_splits x 4 partials in one pass.
// What it needs, which the host guarantees (launch.rs `attn`): one token, 128 threads (4
// warps), the n_splits (2..=ATTN_MAX_CLUSTER) blocks of a head as one cluster along y, a split
// of at most C64_ROWS rows (ceil(capacity / n_splits); plan::attn_warps gives the early copies
// then), no bias or norms, and plan::attn_compact_dyn_bytes of dynamic shared memory: block
// 0's merge buffer (n_splits x 4 partials of 68 floats) then the early copies. The kernel
// checks the launch shape and the dynamic size and does nothing on a mismatch (the output is
// then not written: the host never launches it so); rows of a split past C64_ROWS are not
// read. Results differ from the generic kernel's by rounding (the sums over warps and splits
// run in another order).
#define C64_WARPS 4
#define C64_SLOTS (C64_WARPS * 4)                  // row slots a block: 4 rows a warp at once
#define C64_ROWS (C64_SLOTS * ATTN_EARLY_ROWS)     // rows a split holds: 64 (plan::ATTN_COMPACT_ROWS)
#define C64_PART 68                                // floats a partial: 64 sums, max, sum, 2 pad
// RoPE of one dim: x its value, p its partner's (d ^ 32), lo whether d is in the first half,
// cs the pair's (cos, sin): rope_pair's operations (a' = a c - b s, b' = b c + a s), rounded
// the same way, for the half this dim is.
__device__ __forceinline__ float c64_rope(float x, float p, bool lo, float2 cs) {
    return lo ? __fsub_rn(__fmul_rn(x, cs.x), __fmul_rn(p, cs.y)) : __fadd_rn(__fmul_rn(x, cs.x), __fmul_rn(p, cs.y));
}
template <typename T>
__device__ void attn_compact_hd64(const float *qkv, T *k_cache, T *v_cache, float *out, const uint32_t *pos_base,
                                  int heads, int kv_heads, int capacity, float scale, const float *inv_freq,
                                  uint4 *s_dyn) {
#if FERRUM_HAS_CLUSTER && FERRUM_HAS_PDL
    constexpr int HD = 64, CH = HD / 8, ER = ATTN_EARLY_ROWS;
    __shared__ float2 s_cs[HD / 2];               // RoPE's (cos, sin) of pair i
    __shared__ uint64_t s_mbar;                   // block 0: the partials' arrival
    __shared__ float s_w[ATTN_MAX_CLUSTER * C64_WARPS];
    const int h = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gl = lane & 7, sub = lane >> 3, slot = warp * 4 + sub;  // chunk of the row, row of the warp
    const int n_parts = n_splits * C64_WARPS;
    uint32_t dyn_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
    const uint32_t mrg_bytes = (uint32_t)n_parts * C64_PART * 4u;  // a multiple of 16
    // Uniform over the launch: every block returns here, or none does (before any cluster step).
    // (n_splits <= ATTN_MAX_CLUSTER: s_w holds that many splits' weights, and n_parts <= 32
    // threads compute them.)
    if (blockDim.x != C64_WARPS * 32 || gridDim.z != 1 || n_splits < 2 || n_splits > ATTN_MAX_CLUSTER ||
        cluster_blocks() != (uint32_t)n_splits || dyn_bytes < mrg_bytes + 2u * ER * blockDim.x * (uint32_t)sizeof(uint4))
        return;
    float *s_mrg = reinterpret_cast<float *>(s_dyn);
    uint4 *s_early = s_dyn + mrg_bytes / 16;
    const uint32_t rank = cluster_rank();
    if (rank == 0 && tid == 0) merge_bar_init(&s_mbar, mrg_bytes);
    cluster_arrive_relaxed();  // step 1 of the cluster merge (see above attn_impl)
    // Before the wait, as attn_impl's ROPE path (the argument for reading these there is
    // attn_impl's): the position, the angles, the split's cache rows.
    const float inv_f = tid < HD / 2 ? ld_early_f(inv_freq + tid) : 0.0f;
    const uint32_t pos = ld_early(pos_base);
    const int len = (int)min(pos + 1u, (uint32_t)capacity);
    const int chunk = (len + n_splits - 1) / n_splits;
    const int start = split * chunk, end = min(min(start + chunk, len), start + C64_ROWS);
    const int kvh = h / (heads / kv_heads);
    const uint4 *kb = reinterpret_cast<const uint4 *>(k_cache + (size_t)kvh * capacity * HD) + gl;
    const uint4 *vb = reinterpret_cast<const uint4 *>(v_cache + (size_t)kvh * capacity * HD) + gl;
#pragma unroll
    for (int u = 0; u < ER; ++u) {
        const int t = start + slot + u * C64_SLOTS;
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
    __syncthreads();  // s_cs
    FERRUM_PDL_ENTRY();  // the qkv row comes from the QKV projection
    // This lane's dims d0 .. d0 + 7 and their RoPE partners p0 .. p0 + 7 (HF's half split).
    const int d0 = gl * 8, p0 = d0 ^ (HD / 2);
    const bool lo = d0 < HD / 2;
    const float4 *row4 = reinterpret_cast<const float4 *>(qkv);
    const int qo = h * HD / 4;
    const float4 qa0 = row4[qo + d0 / 4], qa1 = row4[qo + d0 / 4 + 1];
    const float4 qp0 = row4[qo + p0 / 4], qp1 = row4[qo + p0 / 4 + 1];
    // The new row: in this split (pos < end <= capacity), in this lane's slot, at step u_new.
    const bool has_new = (int)pos >= start && (int)pos < end;
    const int rel = (int)pos - start;
    const bool mine_new = has_new && rel % C64_SLOTS == slot;
    const int u_new = mine_new ? rel / C64_SLOTS : -1;
    float4 ka0 = {}, ka1 = {}, kp0 = {}, kp1 = {}, va0 = {}, va1 = {};
    if (mine_new) {
        const int ko = (heads + kvh) * HD / 4, vo = (heads + kv_heads + kvh) * HD / 4;
        ka0 = row4[ko + d0 / 4], ka1 = row4[ko + d0 / 4 + 1];
        kp0 = row4[ko + p0 / 4], kp1 = row4[ko + p0 / 4 + 1];
        va0 = row4[vo + d0 / 4], va1 = row4[vo + d0 / 4 + 1];
    }
    const float qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
    const float qp[8] = {qp0.x, qp0.y, qp0.z, qp0.w, qp1.x, qp1.y, qp1.z, qp1.w};
    // Rotated and scaled q (rope_pair's operations, then the scale, as rope_head).
    float qv[8], nk[8], nv[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) qv[j] = __fmul_rn(c64_rope(qa[j], qp[j], lo, s_cs[(d0 + j) & (HD / 2 - 1)]), scale);
    if (mine_new) {
        const float ka[8] = {ka0.x, ka0.y, ka0.z, ka0.w, ka1.x, ka1.y, ka1.z, ka1.w};
        const float kp[8] = {kp0.x, kp0.y, kp0.z, kp0.w, kp1.x, kp1.y, kp1.z, kp1.w};
        const float va[8] = {va0.x, va0.y, va0.z, va0.w, va1.x, va1.y, va1.z, va1.w};
        __align__(16) T kt[8];
        __align__(16) T vt[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            kt[j] = from_f<T>(c64_rope(ka[j], kp[j], lo, s_cs[(d0 + j) & (HD / 2 - 1)])), vt[j] = from_f<T>(va[j]);
            nk[j] = to_f(kt[j]), nv[j] = to_f(vt[j]);  // the cache's rounding, as the walk reads rows
        }
        // The first q head of the KV group appends the row (cache row [kvh][pos], pos <
        // capacity: has_new). No block of the launch reads that row from the cache.
        if (h % (heads / kv_heads) == 0) {
            const size_t at = ((size_t)kvh * capacity + pos) * HD + d0;
            *reinterpret_cast<uint4 *>(k_cache + at) = *reinterpret_cast<const uint4 *>(kt);
            *reinterpret_cast<uint4 *>(v_cache + at) = *reinterpret_cast<const uint4 *>(vt);
        }
    }
    cp_early_wait();  // this thread's own copies (it reads back only those)
    // Scores of this slot's rows, in registers; each row's 8 lanes end with its score.
    float sc[ER];
    float mt = FERRUM_NEG_INF;
#pragma unroll
    for (int u = 0; u < ER; ++u) {
        const int t = start + slot + u * C64_SLOTS;
        float kf[8];
        if (u == u_new) {
#pragma unroll
            for (int j = 0; j < 8; ++j) kf[j] = nk[j];
        } else {
            // A slot past the split (t >= end) reads stale shared memory here, and its score
            // may be NaN: the select below drops it, and the butterfly mixes only the 8 lanes
            // of this row. (Skipping the read instead cost 0.5% at Llama-3.2-1B: session 43.)
            unpack8(s_early[u * blockDim.x + tid], kf, T());
        }
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(qv[j], kf[j], s);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        sc[u] = t < end ? s : FERRUM_NEG_INF;  // a select: a stale slot's NaN goes nowhere
        mt = fmaxf(mt, sc[u]);
    }
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));  // the warp's max over its 4 row groups
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, ls = 0.0f;
#pragma unroll
    for (int u = 0; u < ER; ++u) {
        // Only the split's rows: a slot past it holds stale shared memory (whatever the SM's
        // last kernel left there, NaN or infinity included), and p = 0 would not cancel it
        // (0 x NaN is NaN), so its values are never read.
        if (start + slot + u * C64_SLOTS >= end) continue;
        const float p = expf(sc[u] - mt);  // mt is finite: this row's score is in it
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
    // The warp's partial: its 4 row groups summed (every row group then holds the sums).
    ls += __shfl_xor_sync(0xffffffffu, ls, 16);
    ls += __shfl_xor_sync(0xffffffffu, ls, 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 16);
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 8);
    }
    // Step 2: every block of the cluster started (block 0's mbarrier initialised). Step 3:
    // partial (split, warp) into block 0's buffer in one instruction: lanes 0-7 the first
    // four sums of their chunk, lanes 8-15 the last four, lane 16 (max, sum).
    cluster_wait();
    const uint32_t mrg0 = cluster_map(s_mrg, 0), bar0 = cluster_map(&s_mbar, 0);
    const uint32_t part = (uint32_t)(split * C64_WARPS + warp) * C64_PART;
    const float4 v = lane < 8    ? make_float4(acc[0], acc[1], acc[2], acc[3])
                     : lane < 16 ? make_float4(acc[4], acc[5], acc[6], acc[7])
                                 : make_float4(mt, ls, 0.0f, 0.0f);
    const uint32_t at = lane < 16 ? (uint32_t)(d0 + 4 * sub) : (uint32_t)HD;
    if (lane < 17) st_async4(mrg0 + 4u * (part + at), v, bar0);
    if (rank != 0) return;  // block 0 lives until its own reads are done
    merge_bar_wait(&s_mbar);
    // Step 4 (block 0): the partials' weights exp(m_p - M) once each, then every column.
    float M = FERRUM_NEG_INF;
    for (int p = 0; p < n_parts; ++p) M = fmaxf(M, s_mrg[p * C64_PART + HD]);
    if (tid < n_parts) {
        const float mp = s_mrg[tid * C64_PART + HD];
        s_w[tid] = mp == FERRUM_NEG_INF ? 0.0f : expf(mp - M);
    }
    __syncthreads();
    if (tid < HD) {
        float A = 0.0f, L = 0.0f;
        for (int p = 0; p < n_parts; ++p) {
            const float w = s_w[p];
            A = fmaf(s_mrg[p * C64_PART + tid], w, A);
            L = fmaf(s_mrg[p * C64_PART + HD + 1], w, L);
        }
        out[h * HD + tid] = L > 0.0f ? A / L : 0.0f;
    }
#endif
}
// NAME ferrum_attn_rope_early_compact_hd64_S: the generic fused kernel's signature (the
// arguments it does not use are named in comments), so the host's launch is the same.
#define FERRUM_ATTN_COMPACT_KERNEL(S, T)                                                           \
    extern "C" __global__ void __launch_bounds__(C64_WARPS * 32, 1) ferrum_attn_rope_early_compact_hd64_##S( \
        const float *qkv, int /* q_stride */, T *k_cache, T *v_cache, float *out,                 \
        float * /* part_acc */, float * /* part_ml */, uint32_t * /* counters */,                  \
        const uint32_t *pos_base, int heads, int kv_heads, int /* hd == 64 */, int capacity,       \
        float scale, const T * /* bias */, const T * /* q_norm */, const T * /* k_norm */,         \
        const float *inv_freq, float /* eps */) {                                                  \
        extern __shared__ uint4 s_dyn[];                                                           \
        attn_compact_hd64<T>(qkv, k_cache, v_cache, out, pos_base, heads, kv_heads, capacity,      \
                             scale, inv_freq, s_dyn);                                              \
    }

#ifndef FERRUM_FOLD_MODULE
FERRUM_ATTN_COMPACT_KERNEL(f16, f16)
FERRUM_ATTN_COMPACT_KERNEL(bf16, bf16)
#endif

// The fused decode attention of the folded q/k/v projection (RopeArgs::pre_x; opt-in:
// CudaDecodeRunner::set_folded_qkv), one instance per head dim of plan::FOLD_HEAD_DIMS: the
// generic kernel's parameters, then the residual r (pre_x, pre_n floats) whose norm scalar the
// kernel applies to the raw row. Instances of their own, so that the default kernels carry none
// of its code, instantiated in a module of their own (fold.cu) so that this one is what it was
// before the fold. NAME ferrum_attn_rope[_early]_fold_hdHD_S.
#define FERRUM_ATTN_ROPE_FOLD_HD_KERNEL(NAME, T, HD, EARLY)                                        \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                     \
        const float *qkv, int q_stride, T *k_cache, T *v_cache, float *out, float *part_acc,       \
        float *part_ml, uint32_t *counters, const uint32_t *pos_base, int heads, int kv_heads,     \
        int /* hd == HD */, int capacity, float scale, const T *bias, const T *q_norm,             \
        const T *k_norm, const float *inv_freq, float eps, const float *pre_x, int pre_n) {        \
        __shared__ __align__(16) float smem[ATTN_SMEM_FLOATS];                                     \
        extern __shared__ uint4 s_dyn[];                                                           \
        const RopeArgs<T> rope = {bias, q_norm, k_norm, inv_freq, k_cache, v_cache, eps, pre_x, pre_n}; \
        const OArgs<T> no_o = {nullptr, nullptr, nullptr, nullptr, 0};                             \
        attn_impl<T, HD, true, EARLY, false, true>(qkv, q_stride, k_cache, v_cache, out, part_acc, \
                                                   part_ml, counters, pos_base, heads, kv_heads,   \
                                                   capacity, scale, smem, s_dyn, rope, no_o);      \
    }
#define FERRUM_ATTN_ROPE_FOLD_HD(S, T, HD)                                                         \
    FERRUM_ATTN_ROPE_FOLD_HD_KERNEL(ferrum_attn_rope_fold_hd##HD##_##S, T, HD, false)              \
    FERRUM_ATTN_ROPE_FOLD_HD_KERNEL(ferrum_attn_rope_early_fold_hd##HD##_##S, T, HD, true)


// The fused decode attention that also adds the o projection to the residual (OArgs above;
// opt-in: plan::attn_o), one kernel per head dim of plan::ATTN_O_HEAD_DIMS, the generic
// kernel's parameters and then the o projection's. One instance each keeps the PTX small (the
// six-head-dim switch took ~35k lines a kernel). NAME ferrum_attn_rope[_early]_o_hdHD_S.
#define FERRUM_ATTN_ROPE_O_HD_KERNEL(NAME, T, HD, EARLY)                                           \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                     \
        const float *qkv, int q_stride, T *k_cache, T *v_cache, float *out, float *part_acc,       \
        float *part_ml, uint32_t *counters, const uint32_t *pos_base, int heads, int kv_heads,     \
        int /* hd == HD */, int capacity, float scale, const T *bias, const T *q_norm,             \
        const T *k_norm, const float *inv_freq, float eps, const T *wo, float *x, float *part_o,   \
        uint32_t *o_ticket, int hidden) {                                                          \
        __shared__ __align__(16) float smem[ATTN_SMEM_FLOATS];                                     \
        extern __shared__ uint4 s_dyn[];                                                           \
        const RopeArgs<T> rope = {bias, q_norm, k_norm, inv_freq, k_cache, v_cache, eps};         \
        const OArgs<T> o = {wo, x, part_o, o_ticket, hidden};                                      \
        attn_impl<T, HD, true, EARLY, true>(qkv, q_stride, k_cache, v_cache, out, part_acc,        \
                                            part_ml, counters, pos_base, heads, kv_heads,          \
                                            capacity, scale, smem, s_dyn, rope, o);                \
    }
#define FERRUM_ATTN_ROPE_O_HD(S, T, HD)                                                            \
    FERRUM_ATTN_ROPE_O_HD_KERNEL(ferrum_attn_rope_o_hd##HD##_##S, T, HD, false)                    \
    FERRUM_ATTN_ROPE_O_HD_KERNEL(ferrum_attn_rope_early_o_hd##HD##_##S, T, HD, true)

#ifndef FERRUM_FOLD_MODULE
FERRUM_ATTN_ROPE_O_HD(f16, f16, 64)
FERRUM_ATTN_ROPE_O_HD(bf16, bf16, 64)
#endif
