// Shared helpers for ferrum's kernels. All reductions accumulate in fp32 in a
// fixed order (no float atomics), so every kernel is deterministic.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

typedef __half f16;
typedef __nv_bfloat16 bf16;

#define FERRUM_NEG_INF (-__int_as_float(0x7f800000))

// Programmatic dependent launch (the compute_90 build, -DFERRUM_PDL; the runner launches with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION). Every kernel runs this before it
// touches global memory that an earlier kernel may write (the GEMVs read weights first: see
// below): griddepcontrol.wait returns once the previous kernel in the stream
// has completed and its writes are visible, so neither a read-after-write nor a
// write-after-read hazard with it is possible (and by induction with any earlier kernel); then
// griddepcontrol.launch_dependents lets the next kernel's blocks launch while this one runs
// (they wait in their own griddepcontrol.wait), which hides the launch gap between kernels.
// The next kernel launches only once every block of this one has triggered or exited, i.e.
// after all of this kernel's blocks were scheduled, so it cannot starve them. The wait is a
// no-op when this kernel was launched without the attribute; the trigger only matters when the
// next kernel was launched with it; the compute_80 build omits both.
//
// A kernel may read memory that no kernel ever writes (the weights) before it waits: the
// GEMVs load their first weight chunks ahead of FERRUM_PDL_ENTRY() (see gemv.cu), so while the
// previous kernel finishes, the next one's weight stream is already in flight. Weights are
// written only by host copies and init kernels that complete (stream order plus a synchronize)
// before any decode kernel is launched, so those early reads see final values. The fused
// decode attention also reads the position and past KV-cache rows early; attention.cu says
// why that is safe (FERRUM_HAS_PDL: only the build with the wait does so).
#if defined(FERRUM_PDL) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define FERRUM_HAS_PDL 1
#define FERRUM_PDL_ENTRY()                                                                         \
    do {                                                                                           \
        asm volatile("griddepcontrol.wait;" ::: "memory");                                         \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");                            \
    } while (0)
#else
#define FERRUM_HAS_PDL 0
#define FERRUM_PDL_ENTRY() \
    do {                   \
    } while (0)
#endif

__device__ __forceinline__ float to_f(f16 x) { return __half2float(x); }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ f16 from_f<f16>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }

// Unpacks 8 packed 16-bit values (one 16-byte load) to fp32.
__device__ __forceinline__ void unpack8(const uint4 &u, float *f, f16) {
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __half22float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}
__device__ __forceinline__ void unpack8(const uint4 &u, float *f, bf16) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). Every thread
// of the block must call it. `sh` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = (threadIdx.x < nw) ? sh[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    const float r = sh[0];
    __syncthreads();
    return r;
}
