// Argmax over the logits (two passes, deterministic: the smallest index wins
// ties, NaN never wins) and the hash-based random init for synthetic weights.
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

// Pass 1: block b reduces logits[b*chunk, min((b+1)*chunk, n)).
extern "C" __global__ void ferrum_argmax_partial(const float *logits, int n, int chunk,
                                                 float *part_v, uint32_t *part_i) {
    const int start = blockIdx.x * chunk, end = min(start + chunk, n);
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    for (int k = start + threadIdx.x; k < end; k += blockDim.x) {
        const float x = logits[k];
        if (!isnan(x) && better(x, (uint32_t)k, v, i)) {
            v = x;
            i = (uint32_t)k;
        }
    }
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = i;
    }
}

// Pass 2: one block over the n_parts partials; writes the index (0 if every logit is NaN).
extern "C" __global__ void ferrum_argmax_final(const float *part_v, const uint32_t *part_i,
                                               int n_parts, uint32_t *out) {
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    for (int k = threadIdx.x; k < n_parts; k += blockDim.x) {
        if (better(part_v[k], part_i[k], v, i)) {
            v = part_v[k];
            i = part_i[k];
        }
    }
    block_argmax(v, i);
    if (threadIdx.x == 0) out[0] = (i == 0xffffffffu) ? 0u : i;
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// out[k] = offset + half_width * u, u uniform in [-1, 1), from a hash of (seed, k).
template <typename T>
__device__ void init_uniform(T *out, unsigned long long n, unsigned long long seed,
                             float offset, float half_width) {
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (unsigned long long)gridDim.x * blockDim.x) {
        const uint64_t h = splitmix64(seed ^ splitmix64(k));
        const float u = (float)(h >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
        out[k] = from_f<T>(offset + half_width * (2.0f * u - 1.0f));
    }
}

extern "C" __global__ void ferrum_init_uniform_f16(f16 *out, unsigned long long n,
                                                   unsigned long long seed, float offset,
                                                   float half_width) {
    init_uniform<f16>(out, n, seed, offset, half_width);
}
extern "C" __global__ void ferrum_init_uniform_bf16(bf16 *out, unsigned long long n,
                                                    unsigned long long seed, float offset,
                                                    float half_width) {
    init_uniform<bf16>(out, n, seed, offset, half_width);
}
