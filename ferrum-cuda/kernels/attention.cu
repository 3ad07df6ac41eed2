// RoPE (HF Llama half-split) fused with the optional bias add (Qwen2), the
// optional per-head q/k RMSNorm (Qwen3) and the append of K/V to the cache;
// GQA attention over one sequence's cache (split over the KV length,
// flash-decoding style) and the combine of the splits.
//
// Layouts: qkv rows are [q heads | k heads | v heads] x head_dim, one row per
// token, in fp32 (as are the attention outputs); the cache is in the model dtype. A layer's cache is [kv_heads][capacity][head_dim]. Positions come
// from device memory (pos_base[0] + token index), so the launch does not
// depend on the position (CUDA graphs can replay it).
#include "common.cuh"

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
        if (bias != nullptr) {
            a += to_f(bias[off + i]);
            b += to_f(bias[off + i + half_d]);
        }
    }
    const bool is_q = h < heads, is_v = h >= heads + kv_heads;
    if (!is_v) {
        const T *nw = is_q ? q_norm : k_norm;
        if (nw != nullptr) {  // uniform over the block: every thread reaches block_sum
            const float ss = block_sum(a * a + b * b, sh);
            const float r = rsqrtf(ss / (float)hd + eps);
            if (active) {
                a = a * r * to_f(nw[i]);
                b = b * r * to_f(nw[i + half_d]);
            }
        }
        if (active) {
            float s, c;
            sincosf((float)pos * inv_freq[i], &s, &c);
            const float na = a * c - b * s;
            const float nb = b * c + a * s;
            a = na;
            b = nb;
        }
    }
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
// then thread 0 takes a ticket with atomicAdd; a block that draws ticket n_splits - 1 knows
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

// grid (heads, n_splits, n_tok); block: 32 * n_warps threads (n_warps <= 8).
// Query token `tok` sits at position pos_base[0] + tok and attends to cache
// rows [0, pos]. Split s covers an equal share of those rows (the share is
// computed from the length read on the device). With one split the normalised
// output is written to `out` [n_tok][heads*hd]; otherwise the unnormalised
// partials go to part_acc [n_tok][heads][n_splits][hd] and part_ml (max, sum),
// and then either a separate attn_combine launch merges them (`counters` null)
// or the last split block of each (token, head) does (see merge_splits).
template <typename T, int HD>
__device__ void attn_impl(const float *q, int q_stride, const T *k_cache, const T *v_cache,
                          float *out, float *part_acc, float *part_ml, uint32_t *counters,
                          const uint32_t *pos_base, int heads, int kv_heads, int capacity,
                          float scale) {
    constexpr int E = (HD + 31) / 32;  // elements per lane; lanes past HD/E idle when HD < 32
    __shared__ float s_m[ATTN_MAX_WARPS], s_l[ATTN_MAX_WARPS];
    __shared__ float s_acc[ATTN_MAX_WARPS][HD];
    const int h = blockIdx.x, split = blockIdx.y, tok = blockIdx.z, n_splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const uint32_t pos = pos_base[0] + (uint32_t)tok;
    const int len = (int)min(pos + 1u, (uint32_t)capacity);
    const int chunk = (len + n_splits - 1) / n_splits;
    const int start = split * chunk;
    const int end = min(start + chunk, len);
    const int kvh = h / (heads / kv_heads);

    float qv[E], acc[E];
    const bool lane_on = lane * E < HD;  // always true when HD is a multiple of 32
    const float *qh = q + (size_t)tok * q_stride + h * HD + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        qv[e] = lane_on ? qh[e] * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = FERRUM_NEG_INF, l = 0.0f;
    const T *kb = k_cache + (size_t)kvh * capacity * HD + lane * E;
    const T *vb = v_cache + (size_t)kvh * capacity * HD + lane * E;
    for (int t = start + warp; t < end; t += nw) {
        const T *kr = kb + (size_t)t * HD;
        float s = 0.0f;
        if (lane_on) {
#pragma unroll
            for (int e = 0; e < E; ++e) s += qv[e] * to_f(kr[e]);
        }
        s = warp_sum(s);
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn);  // exp(-inf) = 0 on the first row
        const float p = expf(s - mn);
        l = l * corr + p;
        const T *vr = vb + (size_t)t * HD;
        if (lane_on) {
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] = acc[e] * corr + p * to_f(vr[e]);
        }
        m = mn;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    if (lane_on) {
#pragma unroll
        for (int e = 0; e < E; ++e) s_acc[warp][lane * E + e] = acc[e];
    }
    __syncthreads();
    float M = FERRUM_NEG_INF;
    for (int w = 0; w < nw; ++w) M = fmaxf(M, s_m[w]);
    float L = 0.0f;
    for (int w = 0; w < nw; ++w) L += (s_m[w] == FERRUM_NEG_INF) ? 0.0f : s_l[w] * expf(s_m[w] - M);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float A = 0.0f;
        for (int w = 0; w < nw; ++w)
            A += (s_m[w] == FERRUM_NEG_INF) ? 0.0f : s_acc[w][d] * expf(s_m[w] - M);
        if (n_splits == 1) {
            out[(size_t)tok * heads * HD + h * HD + d] = L > 0.0f ? A / L : 0.0f;
        } else {
            part_acc[(((size_t)tok * heads + h) * n_splits + split) * HD + d] = A;
        }
    }
    if (n_splits > 1 && threadIdx.x == 0) {
        float *ml = part_ml + (((size_t)tok * heads + h) * n_splits + split) * 2;
        ml[0] = M;
        ml[1] = L;
    }
    if (n_splits > 1 && counters != nullptr)
        merge_splits(out, part_acc, part_ml, counters + (size_t)tok * heads + h, heads, HD, n_splits);
}

template <typename T>
__device__ void attn(const float *q, int q_stride, const T *k_cache, const T *v_cache, float *out,
                     float *part_acc, float *part_ml, uint32_t *counters,
                     const uint32_t *pos_base, int heads, int kv_heads, int hd, int capacity,
                     float scale) {
    switch (hd) {
    case 16:
        attn_impl<T, 16>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                         kv_heads, capacity, scale);
        break;
    case 32:
        attn_impl<T, 32>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                         kv_heads, capacity, scale);
        break;
    case 64:
        attn_impl<T, 64>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale);
        break;
    case 96:
        attn_impl<T, 96>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale);
        break;
    case 128:
        attn_impl<T, 128>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale);
        break;
    case 256:
        attn_impl<T, 256>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base, heads,
                        kv_heads, capacity, scale);
        break;
    default:
        break;  // the host only launches supported head dims
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
        FERRUM_PDL_ENTRY();                                                                        \
        attn<T>(q, q_stride, k_cache, v_cache, out, part_acc, part_ml, counters, pos_base,         \
                heads, kv_heads, hd, capacity, scale);                                             \
    }                                                                                              \
    extern "C" __global__ void ferrum_attn_combine_##S(float *out, const float *part_acc,          \
                                                       const float *part_ml, int heads, int hd,    \
                                                       int n_splits) {                             \
        FERRUM_PDL_ENTRY();                                                                        \
        attn_combine(out, part_acc, part_ml, heads, hd, n_splits);                                 \
    }

FERRUM_ATTN(f16, f16)
FERRUM_ATTN(bf16, bf16)
