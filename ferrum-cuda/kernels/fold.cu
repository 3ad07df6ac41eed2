// The folded q/k/v projection's kernels (opt-in: CudaDecodeRunner::set_folded_qkv), a module of
// their own: the builder of the folded matrix and the decode attention instances that apply the
// norm's scalar themselves (attention.cu's templates, included below with its own kernels left
// out). Apart, so that the default modules hold the default kernels only. (Session 36 measured
// the build with these kernels inside attention.cu and misc.cu 1.1-1.2% slower at SmolLM2-135M
// than session 34's; session 37 found this split no faster, and the build as fast as session
// 34's with SmolLM2-135M's gate|up GEMV launched as 4-row warps, which the same launch choices
// did not need there: the cause is not isolated, docs/PERF.md.)
#define FERRUM_FOLD_MODULE
#include "attention.cu"

// The folded q/k/v projection (CudaDecodeRunner::set_folded_qkv; opt-in: it saves a kernel a
// layer for a few MB of weights, +0.2-0.3% at SmolLM2-135M in session 35, -1.0% in
// session 36: docs/PERF.md). Layer
// l's down projection also computes layer l + 1's q, k and v before their RMSNorm's scalar: with
// r = x + W_d h the residual that layer l + 1 normalises, its projection is
//   W_qkv (n1 * r * rn(r)) = rn(r) * (W_qkv diag(n1) x + W_qkv diag(n1) W_d h),
// and rn(r) = rsqrt(mean(r^2) + eps) is a scalar that the next attention applies (it reads r).
// So one GEMV of the concatenated input [h | x] (I + H) by
//   D = [ W_d | I_H                ]   H rows: x + W_d h = r, the residual (weight 1 on x_r)
//       [ M   | W_qkv diag(n1)     ]   Q rows: u = W_qkv diag(n1) r, q/k/v before rn,
// M = W_qkv diag(n1) W_d, gives [r | u] in one kernel, and layer l + 1 needs no q/k/v GEMV.
// This kernel builds D once (block b: row b; dynamic shared memory: H floats): s = W_qkv[i] * n1
// (exact products of two 16-bit floats), M's entries summed in f32 in k order, every entry
// rounded to the model dtype once; any non-finite entry sets *bad (the host then keeps the
// unfolded step).
template <typename T>
__device__ void fold_qkv(const T *wd, const T *wqkv, const T *n1, int H, int I, int Q, T *out, int *bad) {
    extern __shared__ float fold_s[];
    const int r = blockIdx.x, cols = I + H;
    T *o = out + (size_t)r * cols;
    bool nonfinite = false;
    if (r < H) {
        for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = j < I ? wd[(size_t)r * I + j] : from_f<T>(j - I == r ? 1.0f : 0.0f);
        for (int j = threadIdx.x; j < I; j += blockDim.x) nonfinite |= !isfinite(to_f(wd[(size_t)r * I + j]));
    } else if (r < H + Q) {
        const int i = r - H;
        for (int k = threadIdx.x; k < H; k += blockDim.x) fold_s[k] = to_f(wqkv[(size_t)i * H + k]) * to_f(n1[k]);
        __syncthreads();
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            float v;
            if (j < I) {
                v = 0.0f;
                for (int k = 0; k < H; ++k) v = fmaf(fold_s[k], to_f(wd[(size_t)k * I + j]), v);
            } else {
                v = fold_s[j - I];
            }
            const T t = from_f<T>(v);
            nonfinite |= !isfinite(to_f(t));
            o[j] = t;
        }
    }
    if (__syncthreads_or(nonfinite) && threadIdx.x == 0) atomicOr(bad, 1);
}
#define FERRUM_FOLD_QKV(S, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) ferrum_fold_qkv_##S(                         \
        const T *wd, const T *wqkv, const T *n1, int H, int I, int Q, T *out, int *bad) {          \
        FERRUM_PDL_ENTRY();                                                                        \
        fold_qkv<T>(wd, wqkv, n1, H, I, Q, out, bad);                                              \
    }
FERRUM_FOLD_QKV(f16, f16)
FERRUM_FOLD_QKV(bf16, bf16)

FERRUM_ATTN_ROPE_FOLD_HD(f16, f16, 64)
FERRUM_ATTN_ROPE_FOLD_HD(bf16, bf16, 64)
FERRUM_ATTN_ROPE_FOLD_HD(f16, f16, 128)
FERRUM_ATTN_ROPE_FOLD_HD(bf16, bf16, 128)
