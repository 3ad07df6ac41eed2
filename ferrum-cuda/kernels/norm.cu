// Embedding gather, RMSNorm and the fused residual-add + RMSNorm.
// The residual stream `x`, the normalised outputs `y` and the deltas are fp32 (only the
// weights are in the model dtype).
#include "common.cuh"
#include "peer.cuh"

// x[row][:] = table[tokens[row]][:] (as fp32). One block per row.
// A token id >= vocab (the host validates ids first) yields a zero row, never an out-of-bounds read.
// Every load of a round (EMBED_PER chunks a thread) is issued before its first store, so a row
// of up to EMBED_PER * blockDim.x chunks costs one memory round trip: a loop that stores
// between its loads waits for every load in turn (the compiler cannot move a load above a
// store that may alias it), which the decode step's kernel timeline showed as ~0.5 µs per
// iteration (8.9 µs for a 4096-wide row). Chunks are 16 bytes (8 values) when the row width
// is a multiple of 8 (table rows and x rows then 16- and 32-byte aligned: cuMemAlloc buffers
// whose rows start at multiples of `hidden` elements), single values otherwise.
#define EMBED_PER 4
template <typename T>
__device__ void embed(float *x, const T *table, const uint32_t *tokens, int vocab, int hidden) {
    const int row = blockIdx.x, B = blockDim.x;
    const uint32_t tok = tokens[row];
    float *o = x + (size_t)row * hidden;
    if (tok >= (uint32_t)vocab) {
        for (int i = threadIdx.x; i < hidden; i += B) o[i] = 0.0f;
        return;
    }
    const T *src = table + (size_t)tok * hidden;
    if ((hidden & 7) == 0) {
        const uint4 *s4 = reinterpret_cast<const uint4 *>(src);
        float4 *o4 = reinterpret_cast<float4 *>(o);
        const int n8 = hidden >> 3;
        for (int c0 = threadIdx.x; c0 < n8; c0 += EMBED_PER * B) {
            uint4 v[EMBED_PER];
#pragma unroll
            for (int u = 0; u < EMBED_PER; ++u) v[u] = c0 + u * B < n8 ? __ldg(s4 + c0 + u * B) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < EMBED_PER; ++u) {
                const int c = c0 + u * B;
                if (c < n8) {
                    float f[8];
                    unpack8(v[u], f, T());
                    o4[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
                    o4[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
                }
            }
        }
        return;
    }
    for (int i0 = threadIdx.x; i0 < hidden; i0 += EMBED_PER * B) {
        float f[EMBED_PER];
#pragma unroll
        for (int u = 0; u < EMBED_PER; ++u) f[u] = i0 + u * B < hidden ? to_f(src[i0 + u * B]) : 0.0f;
#pragma unroll
        for (int u = 0; u < EMBED_PER; ++u)
            if (i0 + u * B < hidden) o[i0 + u * B] = f[u];
    }
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

// One fp32 value loaded before the programmatic-launch wait (peer_add_rmsnorm_regs says when
// that is safe): from L2 (.cg: an L1 may hold a line from before the value's last write), in
// asm volatile so that the load stays ahead of the wait (gemv.cu's ldg_early).
__device__ __forceinline__ float ld_early_cg_f32(const float *p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
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

// x += sum over ranks of delta; y = rmsnorm(x) * w: the peer all-reduce (peer.cuh's steps 1-3)
// and add_rmsnorm in one kernel, bit-identical to an all-reduce followed by ferrum_add_rmsnorm
// (for two ranks NCCL returns round(a + b): the same fp32 sum in rank order). One block, one
// row. When the row fits PEER_NORM_PER values a thread (`hidden <= PEER_NORM_PER *
// blockDim.x`: with the runner's block sizes hidden <= 1024, 2048 or 4096), thread t keeps add_rmsnorm's elements i = t + kB and waits for the peers'
// lines that hold them (two threads share each 2-value line), so the sums never go through
// memory: the row costs one poll round trip, the add, the block sum and the stores, in
// add_rmsnorm's order. Its x values and norm weights are loaded before the programmatic-launch
// wait: the caller guarantees that the kernel launched just before this one does not write x
// (the decode step: the o or down projection, which write delta), so every earlier writer of
// x has completed when this grid starts (common.cuh: that kernel lets its dependents launch
// only after its own wait; only the one-GPU step's o and down projections trigger early).
// Longer rows take peer_all_reduce and add_rmsnorm as they are.
#define PEER_NORM_PER 4

// PUSHED: the `_push` GEMV before this kernel (gemv.cu) pushed delta's lines itself (peer.cuh),
// so step 1 is skipped.
template <typename T, bool PUSHED>
__device__ __forceinline__ void peer_add_rmsnorm_regs(const PeerArgs &a, float *x, const float *delta, float *y,
                                                      const float (&wf)[PEER_NORM_PER],
                                                      const float (&xv)[PEER_NORM_PER], int hidden, float eps) {
    const int B = blockDim.x, t = threadIdx.x;
    __shared__ float sh[32];
    __shared__ unsigned s_fail;
    if (t == 0) s_fail = 0u;
    __syncthreads(); // before any atomicOr below
    // Every thread reads the {epoch, failed} words itself (thread 0 writes them only after the
    // block sum's barriers, when every thread has read them); from L2.
    const unsigned c0 = __ldcg(a.counter), c1 = __ldcg(a.counter + 1);
    if (c1 != 0u) return; // an earlier call failed: the rank is finished (peer.cuh)
    const unsigned e = c0 + 1u;
    const int lines = (hidden + 1) / 2;
    const size_t slot = 2 * (size_t)a.cap;
    const size_t parity = (size_t)(e & 1u) * a.world * slot;
    const size_t mine = parity + (size_t)a.rank * slot;
    // 1. Push this thread's lines (l = t, t + B, ...) to every peer.
    for (int l = t; !PUSHED && l < lines; l += B) {
        const uint2 wd = peer_payload(delta, l, hidden);
#pragma unroll
        for (int p = 0; p < PEER_MAX_RANKS; ++p)
            if (p < a.world && p != a.rank) peer_st_line(a.recv[p] + mine + 4 * (size_t)l, wd, e);
    }
    // 2-3. This thread's elements: every rank's value, summed in rank order (its own from
    // delta), the peers' lines all loaded before the first epoch test.
    const unsigned long long t0 = peer_clock_ns();
    const unsigned long long deadline = a.timeout_ns > ~0ull - t0 ? ~0ull : t0 + a.timeout_ns;
    unsigned fail = 0u;
    float s[PEER_NORM_PER];
    for (int q = 0; q < a.world; ++q) {
        if (q == a.rank) {
#pragma unroll
            for (int k = 0; k < PEER_NORM_PER; ++k) {
                const int i = t + k * B;
                const float d = i < hidden ? __ldcg(delta + i) : 0.0f;
                s[k] = q == 0 ? d : s[k] + d;
            }
            continue;
        }
        const float *base = a.own_recv + parity + (size_t)q * slot;
        ulonglong2 v[PEER_NORM_PER];
#pragma unroll
        for (int k = 0; k < PEER_NORM_PER; ++k) {
            // Past the row: a made-up ready line (nothing loaded).
            const int i = t + k * B;
            v[k] = i < hidden ? peer_ld_line(base + 4 * (size_t)(i / 2))
                              : make_ulonglong2((unsigned long long)e << 32, (unsigned long long)e << 32);
        }
#pragma unroll
        for (int k = 0; k < PEER_NORM_PER; ++k) {
            const int i = t + k * B;
            unsigned spins = 0;
            while (fail == 0u && ((unsigned)(v[k].x >> 32) != e || (unsigned)(v[k].y >> 32) != e)) {
                ++spins;
                if (spins % PEER_POLL_SPINS == 0 && peer_clock_ns() > deadline) fail = PEER_TIMED_OUT;
                if (spins % PEER_ABORT_SPINS == 0 && *a.abort != 0u) fail = PEER_ABORTED;
                v[k] = peer_ld_line(base + 4 * (size_t)(i / 2));
            }
            const float d = __uint_as_float((unsigned)((i & 1) ? v[k].y : v[k].x));
            s[k] = q == 0 ? d : s[k] + d;
        }
    }
    if (fail != 0u) atomicOr(&s_fail, fail);
    // add_rmsnorm's register path (norm_store_regs) on the sums: the same operations in the
    // same order.
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < PEER_NORM_PER; ++k) {
        if (t + k * B < hidden) {
            s[k] = xv[k] + s[k];
            ss += s[k] * s[k];
        }
    }
    ss = block_sum(ss, sh); // its barriers order every atomicOr before the read of s_fail
    const float r = rsqrtf(ss / (float)hidden + eps);
    // A call that gave up leaves x and y as they were (peer.cuh: "returns without its outputs").
    const bool ok = s_fail == 0u;
#pragma unroll
    for (int k = 0; k < PEER_NORM_PER; ++k) {
        if (ok && t + k * B < hidden) {
            x[t + k * B] = s[k];
            y[t + k * B] = s[k] * r * wf[k];
        }
    }
    if (t == 0) {
        if (ok) {
            a.counter[0] = e; // read again only by the next call (kernel boundary)
        } else {
            const unsigned why = (s_fail & PEER_TIMED_OUT) ? PEER_TIMED_OUT : PEER_ABORTED;
            a.counter[1] = why; // sticky: the rank's later calls return at once
            *a.status = why;
            __threadfence_system();
        }
    }
}

#define FERRUM_PEER_NORM_ONE(NAME, T, PUSHED)                                                      \
    extern "C" __global__ void __launch_bounds__(1024)                                             \
        NAME(PeerArgs a, float *x, float *delta, float *y, const T *w, int hidden, float eps) {    \
        if (hidden <= PEER_NORM_PER * (int)blockDim.x) {                                           \
            float wf[PEER_NORM_PER], xv[PEER_NORM_PER];                                            \
            _Pragma("unroll") for (int k = 0; k < PEER_NORM_PER; ++k) {                            \
                const int i = threadIdx.x + k * blockDim.x;                                        \
                wf[k] = i < hidden ? to_f(w[i]) : 0.0f;                                            \
                xv[k] = i < hidden ? ld_early_cg_f32(x + i) : 0.0f;                                \
            }                                                                                      \
            FERRUM_PDL_ENTRY();                                                                    \
            peer_add_rmsnorm_regs<T, PUSHED>(a, x, delta, y, wf, xv, hidden, eps);                 \
            return;                                                                                \
        }                                                                                          \
        float wf[NORM_PER];                                                                        \
        if (hidden <= NORM_PER * (int)blockDim.x) norm_weight_early<T>(wf, w, hidden);             \
        FERRUM_PDL_ENTRY();                                                                        \
        if (!peer_all_reduce<float, PUSHED>(a, delta, delta, hidden)) return;                      \
        add_rmsnorm<T>(x, delta, y, w, wf, hidden, eps);                                           \
    }
// `_pushed`: after a `_push` GEMV, which pushed delta's lines itself: waits and sums only.
#define FERRUM_PEER_NORM(S, T)                                                                     \
    FERRUM_PEER_NORM_ONE(ferrum_peer_add_rmsnorm_##S, T, false)                                    \
    FERRUM_PEER_NORM_ONE(ferrum_peer_add_rmsnorm_pushed_##S, T, true)

FERRUM_PEER_NORM(f16, f16)
FERRUM_PEER_NORM(bf16, bf16)
