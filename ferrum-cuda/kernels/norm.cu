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

// y[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * w. One block per row.
template <typename T>
__device__ void rmsnorm(float *y, const float *x, const T *w, int hidden, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = x[base + i];
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = rsqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        y[base + i] = x[base + i] * r * to_f(w[i]);
}

// x[row] += delta[row]; y[row] = rmsnorm(x[row]) * w. One block per row.
template <typename T>
__device__ void add_rmsnorm(float *x, const float *delta, float *y, const T *w, int hidden,
                            float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = x[base + i] + delta[base + i];
        x[base + i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = rsqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        y[base + i] = x[base + i] * r * to_f(w[i]);
}

#define FERRUM_NORM(S, T)                                                                          \
    extern "C" __global__ void ferrum_embed_##S(float *x, const T *table, const uint32_t *tokens,  \
                                                int vocab, int hidden) {                           \
        FERRUM_PDL_ENTRY();                                                                        \
        embed<T>(x, table, tokens, vocab, hidden);                                                 \
    }                                                                                              \
    extern "C" __global__ void ferrum_rmsnorm_##S(float *y, const float *x, const T *w,            \
                                                  int hidden, float eps) {                         \
        FERRUM_PDL_ENTRY();                                                                        \
        rmsnorm<T>(y, x, w, hidden, eps);                                                          \
    }                                                                                              \
    extern "C" __global__ void ferrum_add_rmsnorm_##S(float *x, const float *delta, float *y,      \
                                                      const T *w, int hidden, float eps) {         \
        FERRUM_PDL_ENTRY();                                                                        \
        add_rmsnorm<T>(x, delta, y, w, hidden, eps);                                               \
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
        FERRUM_PDL_ENTRY();                                                                        \
        if (!peer_all_reduce<float>(a, delta, delta, hidden)) return;                              \
        add_rmsnorm<T>(x, delta, y, w, hidden, eps);                                               \
    }

FERRUM_PEER_NORM(f16, f16)
FERRUM_PEER_NORM(bf16, bf16)
