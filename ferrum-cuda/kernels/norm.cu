// Embedding gather, RMSNorm and the fused residual-add + RMSNorm.
// The residual stream `x`, the normalised outputs `y` and the deltas are fp32 (only the
// weights are in the model dtype).
#include "common.cuh"
#include "peer.cuh"

// x[row][:] = table[tokens[row]][:] (as fp32). One block per row.
// A token id >= vocab (the host validates ids first) yields a zero row, never an out-of-bounds read.
template <typename T>
__device__ void embed(float *x, const T *table, const uint32_t *tokens, int vocab, int hidden) {
    const int row = blockIdx.x;
    const uint32_t tok = tokens[row];
    float *o = x + (size_t)row * hidden;
    if (tok >= (uint32_t)vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    const T *src = table + (size_t)tok * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = to_f(src[i]);
}

// The norms keep a row in registers: thread t owns elements t, t + B, t + 2B, ... (B =
// blockDim.x) and loads all of them at once, so a row costs one memory round trip in and one
// out (a loop that stores between its loads makes every iteration wait for the last: the
// compiler cannot move a load above a store that may alias it). Rows longer than
// NORM_PER * B take the loop. Both paths add the squares in the same order (t, t + B, ...;
// then block_sum), so they round alike.
#define NORM_PER 8

// The norm weight of thread t's elements, loaded before the programmatic-launch wait: weights
// are never written by a decode kernel (common.cuh), so the load may overlap the previous
// kernel. Only when the row fits the registers (`hidden <= NORM_PER * blockDim.x`).
template <typename T>
__device__ __forceinline__ void norm_weight_early(float (&wf)[NORM_PER], const T *w, int hidden) {
#pragma unroll
    for (int k = 0; k < NORM_PER; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        wf[k] = i < hidden ? to_f(w[i]) : 0.0f;
    }
}

// The register path's end, shared by both norms: y[base + t + kB] = v[k] * rsqrt(mean(x^2) +
// eps) * wf[k], with ss this thread's sum of squares. Every thread of the block calls it.
__device__ __forceinline__ void norm_store_regs(float *y, const float (&v)[NORM_PER], const float (&wf)[NORM_PER],
                                                float ss, size_t base, int hidden, float eps, float *sh) {
    const int B = blockDim.x, t = threadIdx.x;
    ss = block_sum(ss, sh);
    const float r = rsqrtf(ss / (float)hidden + eps);
#pragma unroll
    for (int k = 0; k < NORM_PER; ++k)
        if (t + k * B < hidden) y[base + t + k * B] = v[k] * r * wf[k];
}

// y[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * w. One block per row. `wf`: the thread's
// norm weights from norm_weight_early when the row fits the registers (unread otherwise).
template <typename T>
__device__ void rmsnorm(float *y, const float *x, const T *w, const float (&wf)[NORM_PER], int hidden,
                        float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * hidden;
    const int B = blockDim.x, t = threadIdx.x;
    if (hidden <= NORM_PER * B) {
        float v[NORM_PER];
#pragma unroll
        for (int k = 0; k < NORM_PER; ++k) v[k] = t + k * B < hidden ? x[base + t + k * B] : 0.0f;
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_PER; ++k)
            if (t + k * B < hidden) ss += v[k] * v[k];
        norm_store_regs(y, v, wf, ss, base, hidden, eps, sh);
        return;
    }
    float ss = 0.0f;
    for (int i = t; i < hidden; i += B) {
        const float v = x[base + i];
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = rsqrtf(ss / (float)hidden + eps);
    for (int i = t; i < hidden; i += B) y[base + i] = x[base + i] * r * to_f(w[i]);
}

// x[row] += delta[row]; y[row] = rmsnorm(x[row]) * w. One block per row; `wf` as for rmsnorm.
template <typename T>
__device__ void add_rmsnorm(float *x, const float *delta, float *y, const T *w,
                            const float (&wf)[NORM_PER], int hidden, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * hidden;
    const int B = blockDim.x, t = threadIdx.x;
    if (hidden <= NORM_PER * B) {
        float v[NORM_PER], d[NORM_PER];
#pragma unroll
        for (int k = 0; k < NORM_PER; ++k) {
            const bool in = t + k * B < hidden;
            v[k] = in ? x[base + t + k * B] : 0.0f;
            d[k] = in ? delta[base + t + k * B] : 0.0f;
        }
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_PER; ++k) {
            if (t + k * B < hidden) {
                v[k] = v[k] + d[k];
                x[base + t + k * B] = v[k];
                ss += v[k] * v[k];
            }
        }
        norm_store_regs(y, v, wf, ss, base, hidden, eps, sh);
        return;
    }
    float ss = 0.0f;
    for (int i = t; i < hidden; i += B) {
        const float v = x[base + i] + delta[base + i];
        x[base + i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = rsqrtf(ss / (float)hidden + eps);
    for (int i = t; i < hidden; i += B) y[base + i] = x[base + i] * r * to_f(w[i]);
}

#define FERRUM_NORM(S, T)                                                                          \
    extern "C" __global__ void ferrum_embed_##S(float *x, const T *table, const uint32_t *tokens,  \
                                                int vocab, int hidden) {                           \
        FERRUM_PDL_ENTRY();                                                                        \
        embed<T>(x, table, tokens, vocab, hidden);                                                 \
    }                                                                                              \
    extern "C" __global__ void ferrum_rmsnorm_##S(float *y, const float *x, const T *w,            \
                                                  int hidden, float eps) {                         \
        float wf[NORM_PER];                                                                        \
        if (hidden <= NORM_PER * (int)blockDim.x) norm_weight_early<T>(wf, w, hidden);             \
        FERRUM_PDL_ENTRY();                                                                        \
        rmsnorm<T>(y, x, w, wf, hidden, eps);                                                      \
    }                                                                                              \
    extern "C" __global__ void ferrum_add_rmsnorm_##S(float *x, const float *delta, float *y,      \
                                                      const T *w, int hidden, float eps) {         \
        float wf[NORM_PER];                                                                        \
        if (hidden <= NORM_PER * (int)blockDim.x) norm_weight_early<T>(wf, w, hidden);             \
        FERRUM_PDL_ENTRY();                                                                        \
        add_rmsnorm<T>(x, delta, y, w, wf, hidden, eps);                                           \
    }

FERRUM_NORM(f16, f16)
FERRUM_NORM(bf16, bf16)

// In-place sum of data[0..n) over the ranks of a peer group (peer.cuh). One block.
#define FERRUM_PEER_ALL_REDUCE(S, T)                                                               \
    extern "C" __global__ void ferrum_peer_all_reduce_##S(PeerArgs a, T *data, int n) {            \
        FERRUM_PDL_ENTRY();                                                                        \
        peer_all_reduce<T>(a, data, data, n);                                                      \
    }

FERRUM_PEER_ALL_REDUCE(f32, float)
FERRUM_PEER_ALL_REDUCE(f16, f16)
FERRUM_PEER_ALL_REDUCE(bf16, bf16)

// delta = sum over ranks of delta; then add_rmsnorm (x += delta; y = rmsnorm(x) * w), the same
// code as ferrum_add_rmsnorm, so the result is bit-identical to an all-reduce followed by it.
// One block, one row. peer_all_reduce ends with a bar.sync, so the sums it stored are visible
// to every thread of add_rmsnorm.
#define FERRUM_PEER_NORM(S, T)                                                                     \
    extern "C" __global__ void ferrum_peer_add_rmsnorm_##S(PeerArgs a, float *x, float *delta,     \
                                                           float *y, const T *w, int hidden,       \
                                                           float eps) {                            \
        float wf[NORM_PER];                                                                        \
        if (hidden <= NORM_PER * (int)blockDim.x) norm_weight_early<T>(wf, w, hidden);             \
        FERRUM_PDL_ENTRY();                                                                        \
        if (!peer_all_reduce<float>(a, delta, delta, hidden)) return;                              \
        add_rmsnorm<T>(x, delta, y, w, wf, hidden, eps);                                           \
    }

FERRUM_PEER_NORM(f16, f16)
FERRUM_PEER_NORM(bf16, bf16)
