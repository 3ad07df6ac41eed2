// Batch-1 projections: y[r] = sum_c W[r][c] * x[c], W row-major [rows][cols].
// Each warp computes ROWS rows; lanes stream 16-byte chunks of the rows (8
// values) and of x; fp32 accumulate; a fixed-order warp reduction.
// The `gateup` variant multiplies by the stacked [gate; up] weight and writes
// silu(gate . x) * (up . x): SiLU-mul fused into the gate/up projection.
#include "common.cuh"

#define GEMV_ROWS 2  // the gate/up variant relies on exactly two rows per warp

template <typename T> __device__ __forceinline__ float silu_mul_ref(float g, float u) {
    // Round like the reference: gate and up are stored in the model dtype, silu(gate) too.
    g = to_f(from_f<T>(g));
    u = to_f(from_f<T>(u));
    return to_f(from_f<T>(g / (1.0f + expf(-g)))) * u;
}

// GATEUP = false: warp w computes rows 2w, 2w+1 of y = W x (`rows` rows).
// GATEUP = true: W is [gate; up] with `rows` rows each; warp w computes gate row w and up row
// rows + w and writes y[w] = silu(gate . x) * (up . x) (SiLU-mul fused into the projection).
template <typename T, typename O, bool GATEUP>
__device__ void gemv(O *y, const T *W, const T *x, int rows, int cols) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int wg = blockIdx.x * nw + warp;
    const int r0 = GATEUP ? wg : wg * GEMV_ROWS;
    if (r0 >= rows) return;
    size_t row_idx[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
        row_idx[r] = GATEUP ? (size_t)r0 + (size_t)r * rows : (size_t)min(r0 + r, rows - 1);
    float acc[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;
    if ((cols & 7) == 0) {
        // 16-byte path: rows are 16-byte aligned because cols % 8 == 0 and
        // buffers come from cuMemAlloc (256-byte aligned).
        const int n8 = cols >> 3;
        const uint4 *x4 = reinterpret_cast<const uint4 *>(x);
        const uint4 *w4[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) w4[r] = reinterpret_cast<const uint4 *>(W + row_idx[r] * cols);
#pragma unroll 4
        for (int c = lane; c < n8; c += 32) {
            float xf[8];
            unpack8(__ldg(x4 + c), xf, T());
            uint4 wv[GEMV_ROWS];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) wv[r] = __ldg(w4[r] + c);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                float wf[8];
                unpack8(wv[r], wf, T());
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[r] = fmaf(wf[j], xf[j], acc[r]);
            }
        }
    } else {
        for (int c = lane; c < cols; c += 32) {
            const float xv = to_f(x[c]);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = fmaf(to_f(W[row_idx[r] * cols + c]), xv, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
        if (GATEUP) {
            y[r0] = from_f<O>(silu_mul_ref<T>(acc[0], acc[1]));
        } else {
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r)
                if (r0 + r < rows) y[r0 + r] = from_f<O>(acc[r]);
        }
    }
}

// out[t][i] = silu(gu[t][i]) * gu[t][inter + i] (prefill path).
template <typename T>
__device__ void silu_mul(T *out, const T *gu, int inter, int n_tok) {
    const size_t n = (size_t)inter * n_tok;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        const size_t t = k / inter, i = k % inter;
        out[k] = from_f<T>(silu_mul_ref<T>(to_f(gu[t * 2 * inter + i]), to_f(gu[t * 2 * inter + inter + i])));
    }
}

#define FERRUM_GEMV(S, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_##S(T *y, const T *W, const T *x, int rows, int cols) {                        \
        gemv<T, T, false>(y, W, x, rows, cols);                                                    \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_f32out_##S(float *y, const T *W, const T *x, int rows, int cols) {             \
        gemv<T, float, false>(y, W, x, rows, cols);                                                \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        ferrum_gemv_gateup_##S(T *y, const T *W, const T *x, int rows, int cols) {                 \
        gemv<T, T, true>(y, W, x, rows, cols);                                                     \
    }                                                                                              \
    extern "C" __global__ void ferrum_silu_mul_##S(T *out, const T *gu, int inter, int n_tok) {    \
        silu_mul<T>(out, gu, inter, n_tok);                                                        \
    }

FERRUM_GEMV(f16, f16)
FERRUM_GEMV(bf16, bf16)
