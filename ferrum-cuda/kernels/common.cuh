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
#ifdef FERRUM_TIMELINE
// The timeline build (`cargo xtask ptx --timeline`, a measurement build, never committed):
// thread (0, 0, 0) of every block stamps %globaltimer right after its wait, into its grid's
// slot of this module's table while the host has set ferrum_tl_on to a replay number r + 1
// (a stream-ordered copy before each recorded graph replay; no kernel writes it, so reading it
// before the wait is safe). Row r % FERRUM_TL_REPLAYS of the table holds replay r, one slot per
// grid at %gridid modulo FERRUM_TL_NODES (in a graph replay the low bits of the grid id
// number its kernel nodes; the host checks that every node stamped a distinct slot). A slot
// holds the grid id, the earliest and the latest stamp (the latter complemented, so that one
// all-ones reset serves every field and both take an atomicMin), a block count (all-ones
// plus one per stamping block), and the earliest and latest arrival at the wait (the timer read
// just before it, after the kernel's pre-wait work: a block that arrives after the release of
// the grid's first block was dispatched late or spent its pre-wait path on the critical path).
// The atomics' results are unused (fire-and-forget reductions), so a stamp costs the block's
// first thread a timer read and six reductions, and every thread a timer read before the wait
// (FERRUM_PDL_ENTRY and FERRUM_PDL_WAIT read it before they know which thread stamps).
// Some kernels also stamp phases of their body (FERRUM_TL_PHASE below): the latest time a
// stamped block's first thread reached phase k, complemented like last_not.
#define FERRUM_TL_REPLAYS 64
#define FERRUM_TL_NODES 4096
#define FERRUM_TL_PHASES 6
struct FerrumTlSlot {
    unsigned long long grid, first, last_not;
    unsigned blocks, pad;
    unsigned long long arrive_first, arrive_last_not;
    unsigned long long phase_last_not[FERRUM_TL_PHASES];
};
__device__ FerrumTlSlot ferrum_tl[FERRUM_TL_REPLAYS * FERRUM_TL_NODES];
__device__ unsigned ferrum_tl_on;
// Blocks that stamp: the first FERRUM_TL_FIRST_BLOCKS (dispatched first, so the earliest
// release is among them) and every FERRUM_TL_EVERY-th (for the latest), not every block: the
// reductions of thousands of blocks on one slot would queue at its L2 slice and slow the
// kernel being measured.
#define FERRUM_TL_FIRST_BLOCKS 8
#define FERRUM_TL_EVERY 32
// This grid's slot of replay on - 1 when this thread stamps (the first thread of a stamped
// block, while the host has armed a replay), else null; `t` gets the timer and `g` the grid id.
// The timer read has a memory clobber, so the compiler keeps every memory access of the code
// before it ahead.
__device__ __forceinline__ FerrumTlSlot *ferrum_tl_slot(unsigned on, unsigned long long &t, unsigned long long &g,
                                                        bool any_thread = false) {
    if (on == 0u || (!any_thread && (threadIdx.x | threadIdx.y | threadIdx.z) != 0u)) return nullptr;
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (b >= FERRUM_TL_FIRST_BLOCKS && b % FERRUM_TL_EVERY != 0u) return nullptr;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    return &ferrum_tl[((on - 1u) % FERRUM_TL_REPLAYS) * FERRUM_TL_NODES + (g % FERRUM_TL_NODES)];
}
__device__ __forceinline__ void ferrum_tl_stamp(unsigned on, unsigned long long arrived) {
    unsigned long long t, g;
    FerrumTlSlot *s = ferrum_tl_slot(on, t, g);
    if (s == nullptr) return;
    s->grid = g;
    atomicMin(&s->first, t);
    atomicMin(&s->last_not, ~t);
    atomicAdd(&s->blocks, 1u);
    atomicMin(&s->arrive_first, arrived);
    atomicMin(&s->arrive_last_not, ~arrived);
}
// Phase k of a stamped block's body (its first thread; `on` is FERRUM_TL_FLAG() read by the
// kernel at entry): the latest such time over the stamped blocks. With `every_warp`, lane 0 of
// every warp of a stamped block stamps (blockDim.x a multiple of 32), so the phase gives the
// latest warp's time (FERRUM_TL_PHASE_WARP). A fire-and-forget reduction, as above. `dep` is a
// value the phase computes last, where there is one (0.0f where the phase ends at a barrier or
// a store, which the timer read's memory clobber keeps ahead): the stamp branches on its bits
// (a test that never holds for a value an FMA or a load from this kernel's own arithmetic
// gives: the all-ones NaN), so the timer is read only once that value exists, wherever the
// compiler schedules the arithmetic before it.
__device__ __forceinline__ void ferrum_tl_phase(unsigned on, int k, float dep, bool every_warp = false) {
    // The stamping threads only (the test on dep would otherwise hold every thread).
    const bool stamps = every_warp ? (threadIdx.x & 31u) == 0u : (threadIdx.x | threadIdx.y | threadIdx.z) == 0u;
    if (on == 0u || !stamps) return;
    if (__float_as_uint(dep) == 0xffffffffu) return;
    unsigned long long t, g;
    FerrumTlSlot *s = ferrum_tl_slot(on, t, g, every_warp);
    if (s != nullptr) atomicMin(&s->phase_last_not[k], ~t);
}
__device__ __forceinline__ unsigned long long ferrum_tl_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define FERRUM_TL_FLAG() (*(volatile unsigned *)&ferrum_tl_on)
#define FERRUM_TL_NOW() ferrum_tl_now()
#define FERRUM_TL_PHASE(on, k, dep) ferrum_tl_phase(on, k, dep)
#define FERRUM_TL_PHASE_WARP(on, k, dep) ferrum_tl_phase(on, k, dep, true)
#else
#define FERRUM_TL_FLAG() 0u
#define FERRUM_TL_NOW() 0ull
#define ferrum_tl_stamp(on, arrived) ((void)(on), (void)(arrived))
#endif
#define FERRUM_PDL_WAIT()                                                                          \
    do {                                                                                           \
        const unsigned ferrum_tl_on_ = FERRUM_TL_FLAG();                                           \
        const unsigned long long ferrum_tl_arrived_ = FERRUM_TL_NOW();                             \
        asm volatile("griddepcontrol.wait;" ::: "memory");                                         \
        ferrum_tl_stamp(ferrum_tl_on_, ferrum_tl_arrived_);                                        \
    } while (0)
#define FERRUM_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
// (the trigger before the timeline's stamp, so that the stamp never delays the next launch)
#define FERRUM_PDL_ENTRY()                                                                         \
    do {                                                                                           \
        const unsigned ferrum_tl_on_ = FERRUM_TL_FLAG();                                           \
        const unsigned long long ferrum_tl_arrived_ = FERRUM_TL_NOW();                             \
        asm volatile("griddepcontrol.wait;" ::: "memory");                                         \
        FERRUM_PDL_TRIGGER();                                                                      \
        ferrum_tl_stamp(ferrum_tl_on_, ferrum_tl_arrived_);                                        \
    } while (0)
#else
#define FERRUM_HAS_PDL 0
#define FERRUM_PDL_WAIT() \
    do {                  \
    } while (0)
#define FERRUM_PDL_TRIGGER() \
    do {                     \
    } while (0)
#define FERRUM_PDL_ENTRY() \
    do {                   \
    } while (0)
#endif
// The early trigger (the `_et` kernels, FERRUM_EARLY_TRIGGER): FERRUM_PDL_TRIGGER() at the
// kernel's entry and FERRUM_PDL_WAIT() where FERRUM_PDL_ENTRY() would be, so that the next
// kernel's blocks are dispatched, and start their early weight loads, while this one still
// waits for its predecessor. That weakens the rule above for the kernel after an `_et` one:
// when it starts, only the kernels before the `_et` kernel's predecessor are known complete
// (the predecessor itself has passed its wait, since it let the `_et` kernel launch only
// then). So the host launches an `_et` kernel only where the next kernel reads nothing before
// its wait but weights (the screened head's int8 copy counts: it is written at set-up only),
// and never two in a row, nor just before a kernel whose pre-wait reads rely on the rule
// above (ferrum_cuda's forward pass: the o projection before gate|up, the down projection
// before the next q/k/v projection or the LM head; their predecessors, the attention or the
// split combine, and gate|up, trigger after their wait).
// Outside the timeline build the phase stamps compile to nothing.
#ifndef FERRUM_TL_PHASE
#undef FERRUM_TL_FLAG
#define FERRUM_TL_FLAG() 0u
#define FERRUM_TL_PHASE(on, k, dep) ((void)(on), (void)(k), (void)(dep))
#endif
#ifndef FERRUM_TL_PHASE_WARP
#define FERRUM_TL_PHASE_WARP(on, k, dep) ((void)(on), (void)(k), (void)(dep))
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

// A 16-byte load issued before the programmatic-launch wait. Two traps keep a plain __ldg
// from doing that: the compiler may sink an invariant (.nc) load to its use, past the wait,
// and ptxas (13.0) schedules griddepcontrol.wait (SASS ACQBULK) ahead of .nc loads even when
// the PTX has them first; it keeps ordinary weak loads where they are. So this is an asm
// volatile weak load (not allocated in L1: weights are streamed once). Checked in the SASS:
// the LDG.E.NA.128 of the prefetch come before ACQBULK.
__device__ __forceinline__ uint4 ldg_early(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// gemv.cu's row sums (and misc.cu's exact rows of the screened head, which repeat them).
// LPR: lanes per row group (32, or 16 / 8 for short rows: a warp then holds 32 / LPR row
// groups side by side, lane l in group l / LPR taking chunks l % LPR + LPR k, and the sums go
// over the group's lanes only). With LPR = 32 the code is the original one. LPR < 32 is for
// ks == 1 only (the host's choice, plan::gemv_lanes_per_row): the split-K slots hold one sum
// per warp.
template <int LPR> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
