// Argmax over the logits (two passes, deterministic: the smallest index wins
// ties, NaN never wins), optionally a Gumbel-max sample, with the device-fed
// step update; and the hash-based random init for synthetic weights.
#include "common.cuh"

__device__ __forceinline__ bool better(float v, uint32_t i, float bv, uint32_t bi) {
    return v > bv || (v == bv && i < bi);
}

// Reduces (value, index) pairs over the block into thread 0. blockDim.x = 256.
__device__ __forceinline__ void block_argmax(float &v, uint32_t &i) {
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const uint32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sv[lane] : FERRUM_NEG_INF;
        i = lane < nw ? si[lane] : 0xffffffffu;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const uint32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (better(ov, oi, v, i)) {
                v = ov;
                i = oi;
            }
        }
    }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Logits a thread loads at once in pass 1 (the host's chunk is ARGMAX_PER * 256: one round).
#define ARGMAX_PER 4

// Pass 1: block b reduces logits[b*chunk, min((b+1)*chunk, n)).
//
// With inv_temp > 0 it samples instead of taking the maximum (the Gumbel-max
// trick): logit k becomes x_k * inv_temp + g_k with g_k = -log(-log(u_k)) and
// u_k uniform in (0, 1) hashed from (seed, position, k), so the argmax is a
// draw from softmax(x / T), reproducible from (seed, position). The position
// is step[1] (the decode step buffer), or 0 when step is null.
//
// `base`: the vocabulary index of logits[0]. A tensor-parallel rank that computes only its
// rows [base, base + n) of the LM head (the vocab split) reduces them with their vocabulary
// indices, for the ties and for the Gumbel noise, so its candidate is the one the whole
// vocabulary's argmax would pick among those rows.
extern "C" __global__ void ferrum_argmax_partial(const float *logits, int n, int chunk,
                                                 float inv_temp, unsigned long long seed,
                                                 const uint32_t *step, float *part_v,
                                                 uint32_t *part_i, unsigned int base) {
    FERRUM_PDL_ENTRY();
    const int start = blockIdx.x * chunk, end = min(start + chunk, n);
    const uint64_t pos = step ? (uint64_t)step[1] : 0ull;
    const uint64_t key = splitmix64(seed ^ splitmix64(pos));
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    // ARGMAX_PER logits a thread per round, all loaded before the first comparison: one L2
    // round trip per round instead of one per logit (the compare-and-keep chain would otherwise
    // wait for each load in turn). The order of the comparisons does not change the result:
    // `better` is a strict total order on (value, index), NaN is skipped.
    const int B = blockDim.x;
    for (int k0 = start + threadIdx.x; k0 < end; k0 += ARGMAX_PER * B) {
        float xs[ARGMAX_PER];
#pragma unroll
        for (int u = 0; u < ARGMAX_PER; ++u) xs[u] = k0 + u * B < end ? logits[k0 + u * B] : 0.0f;
#pragma unroll
        for (int u = 0; u < ARGMAX_PER; ++u) {
            const int k = k0 + u * B;
            if (k >= end) continue;
            float x = xs[u];
            const uint32_t g = base + (uint32_t)k;  // the vocabulary index (the host checks it fits)
            if (inv_temp > 0.0f) {
                const uint64_t h = splitmix64(key ^ (uint64_t)g);
                // 23 bits: (k + 0.5) / 2^23 is exact in f32 for k < 2^23, so u lies in
                // [2^-24, 1 - 2^-24] and never rounds to 1 (which would make -log(-log u) +inf).
                const float uu = ((float)(h >> 41) + 0.5f) * (1.0f / 8388608.0f);
                x = x * inv_temp - logf(-logf(uu));
            }
            if (!isnan(x) && better(x, g, v, i)) {
                v = x;
                i = g;
            }
        }
    }
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = i;
    }
}

// The chosen token to out[0] and, for device-fed decoding (step non-null), to
// the next step's input. With pos = step[1] (the position just decoded), the
// token is the one at position pos + 1: it goes to history[pos + 1] (history
// holds capacity + 1 entries) and step[0]; step[1] advances to pos + 1 while
// that is below capacity (it never points past the KV cache, whatever the host
// does). One thread.
__device__ __forceinline__ void emit_token(uint32_t i, uint32_t *out, uint32_t *step,
                                           uint32_t *history, int capacity) {
    const uint32_t tok = (i == 0xffffffffu) ? 0u : i;
    out[0] = tok;
    if (step) {
        const uint32_t next = step[1] + 1u;
        if (next <= (uint32_t)capacity) history[next] = tok;
        if (next < (uint32_t)capacity) step[1] = next;
        step[0] = tok;
    }
}

// Pass 2: one block over the n_parts partials; writes the index (0 if every
// logit is NaN) through emit_token.
//
// Vocab split (xchg non-null): this rank's best (value, index) goes to its
// slot of the exchange buffer instead, xchg[2 rank] = value and
// xchg[2 rank + 1] = index as a float (exact: the host checks the vocabulary
// is below 2^24; -1 for none), and every other slot is zeroed, so that a sum
// over the ranks (the TP all-reduce, adding exact zeros) leaves every rank's
// candidate in every rank's buffer; ferrum_argmax_pick then chooses.
extern "C" __global__ void ferrum_argmax_final(const float *part_v, const uint32_t *part_i,
                                               int n_parts, uint32_t *out, uint32_t *step,
                                               uint32_t *history, int capacity, float *xchg,
                                               int rank, int world) {
    FERRUM_PDL_ENTRY();
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    for (int k = threadIdx.x; k < n_parts; k += blockDim.x) {
        if (better(part_v[k], part_i[k], v, i)) {
            v = part_v[k];
            i = part_i[k];
        }
    }
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        if (xchg) {
            for (int s = 0; s < world; ++s) {
                const bool mine = s == rank;
                xchg[2 * s] = mine && i != 0xffffffffu ? v : 0.0f;
                xchg[2 * s + 1] = mine && i != 0xffffffffu ? (float)i : (mine ? -1.0f : 0.0f);
            }
        } else {
            emit_token(i, out, step, history, capacity);
        }
    }
}

// The vocab split's last step: the best of the world ranks' candidates in the
// summed exchange buffer (ferrum_argmax_final), by the same rule as the
// argmax (larger value, then smaller index; a slot with index -1 has none), so
// the token is the one the whole vocabulary's argmax picks; then emit_token.
// Every rank holds the same buffer, so every rank picks the same token.
extern "C" __global__ void ferrum_argmax_pick(const float *xchg, int world, uint32_t *out,
                                              uint32_t *step, uint32_t *history, int capacity) {
    FERRUM_PDL_ENTRY();
    if (threadIdx.x != 0) return;
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    for (int s = 0; s < world; ++s) {
        const float fi = xchg[2 * s + 1];
        if (fi < 0.0f) continue;
        if (better(xchg[2 * s], (uint32_t)fi, v, i)) {
            v = xchg[2 * s];
            i = (uint32_t)fi;
        }
    }
    emit_token(i, out, step, history, capacity);
}

// A [rows x cols] slice, at (row0, col0), of a [* x full_cols] matrix whose
// element e (row-major index) is offset + half_width * u_e, u_e uniform in
// [-1, 1) hashed from (seed, e). A tensor-parallel shard of a random model is
// thus exactly the slice of the whole model that the same seed makes.
template <typename T>
__device__ void init_uniform(T *out, int rows, int cols, long long full_cols, long long row0,
                             long long col0, unsigned long long seed, float offset,
                             float half_width) {
    const unsigned long long n = (unsigned long long)rows * (unsigned long long)cols;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = k / (unsigned long long)cols, c = k % (unsigned long long)cols;
        const unsigned long long e = (row0 + r) * full_cols + col0 + c;
        const uint64_t h = splitmix64(seed ^ splitmix64(e));
        const float u = (float)(h >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
        out[k] = from_f<T>(offset + half_width * (2.0f * u - 1.0f));
    }
}

#define FERRUM_INIT(S, T)                                                                          \
    extern "C" __global__ void ferrum_init_uniform_##S(T *out, int rows, int cols,                 \
                                                       long long full_cols, long long row0,        \
                                                       long long col0, unsigned long long seed,    \
                                                       float offset, float half_width) {           \
        FERRUM_PDL_ENTRY();                                                                        \
        init_uniform<T>(out, rows, cols, full_cols, row0, col0, seed, offset, half_width);         \
    }

FERRUM_INIT(f16, f16)
FERRUM_INIT(bf16, bf16)
