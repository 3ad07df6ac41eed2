// Batch-1 projections: y[r] = sum_c W[r][c] * x[c], W row-major [rows][cols].
// Each warp computes ROWS rows; lanes stream 16-byte chunks of the rows (8
// values) and of x; fp32 accumulate; a fixed-order warp reduction.
// The `silu` variants take x = silu(gu[c]) * gu[cols + c] on the fly (the
// gate|up output of the MLP), which fuses SiLU-mul into the down projection.
#include "common.cuh"

#define GEMV_ROWS 2

template <typename T, typename O, bool SILU>
__device__ void gemv(O *y, const T *W, const T *x, int rows, int cols) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int r0 = (blockIdx.x * nw + warp) * GEMV_ROWS;
    if (r0 >= rows) return;
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
        for (int r = 0; r < GEMV_ROWS; ++r)
            w4[r] = reinterpret_cast<const uint4 *>(W + (size_t)min(r0 + r, rows - 1) * cols);
#pragma unroll 4
        for (int c = lane; c < n8; c += 32) {
            float xf[8];
            unpack8(__ldg(x4 + c), xf, T());
            if (SILU) {
                float uf[8];
                unpack8(__ldg(x4 + n8 + c), uf, T());
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float g = xf[j];
                    // Round like the reference: silu(g) is stored in the model dtype, then * up.
                    xf[j] = to_f(from_f<T>(to_f(from_f<T>(g / (1.0f + expf(-g)))) * uf[j]));
                }
            }
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
            float xv = to_f(x[c]);
            if (SILU) {
                const float u = to_f(x[cols + c]);
                xv = to_f(from_f<T>(to_f(from_f<T>(xv / (1.0f + expf(-xv)))) * u));
            }
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r)
                acc[r] = fmaf(to_f(W[(size_t)min(r0 + r, rows - 1) * cols + c]), xv, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const float s = warp_sum(acc[r]);
        if (lane == 0 && r0 + r < rows) y[r0 + r] = from_f<O>(s);
    }
}

// out[t][i] = silu(gu[t][i]) * gu[t][inter + i] (prefill path).
template <typename T>
__device__ void silu_mul(T *out, const T *gu, int inter, int n_tok) {
    const size_t n = (size_t)inter * n_tok;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        const size_t t = k / inter, i = k % inter;
        const float g = to_f(gu[t * 2 * inter + i]);
        const float u = to_f(gu[t * 2 * inter + inter + i]);
        out[k] = from_f<T>(to_f(from_f<T>(g / (1.0f + expf(-g)))) * u);
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
        ferrum_gemv_silu_##S(T *y, const T *W, const T *gu, int rows, int cols) {                  \
        gemv<T, T, true>(y, W, gu, rows, cols);                                                    \
    }                                                                                              \
    extern "C" __global__ void ferrum_silu_mul_##S(T *out, const T *gu, int inter, int n_tok) {    \
        silu_mul<T>(out, gu, inter, n_tok);                                                        \
    }

FERRUM_GEMV(f16, f16)
FERRUM_GEMV(bf16, bf16)
