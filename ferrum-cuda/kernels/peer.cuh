// One-shot all-reduce over peer-to-peer (NVLink) buffers, for the ranks of one process
// (ferrum-cuda's `peer` module sets the buffers up; NCCL stays the general path).
//
// # Protocol (push model, one block per call, every rank runs the same sequence of calls)
//
// Each rank `p` owns, in its own device memory:
//   recv[p]  : [2 parities][world][cap] floats   rank q's partial of call e lands in
//              recv[p][e % 2][q]
//   flags[p] : [world] epochs                     flags[p][q] = the last epoch rank q pushed
//   counter  : the epoch of this rank's last completed call (0 before the first)
// and all of them start zeroed. Call e (e = counter + 1, the same e on every rank because every
// rank makes the same calls) on rank r:
//   1. every thread stores its part of r's partial into recv[p][e % 2][r] of every peer p;
//   2. bar.sync, then thread 0 stores flags[p][r] = e with release semantics at system scope:
//      the barrier ordered the block's stores before thread 0's release, and release is
//      cumulative, so a peer that acquires the flag sees the whole partial;
//   3. thread 0 spins (acquire, system scope) until flags[r][q] >= e for every peer q, then
//      bar.sync publishes that to the block (the same cumulativity in the other direction);
//   4. every thread sums the partials of ranks 0, 1, …, world-1 in that order, its own from its
//      own buffer: every rank executes the same float additions on the same values, so every
//      rank gets bit-identical sums (for two ranks a + b, which is also what NCCL returns).
//
// Why two parities suffice: rank q writes recv[r][e % 2][q] again only in call e + 2, which it
// starts after its wait of call e + 1, which needs r's flag e + 1, which r stores only after
// its call e finished reading (the kernel boundary orders r's reads of call e before call
// e + 1 begins). So no slot is overwritten while it is read. A peer can thus be at most one
// epoch ahead, which is why the wait tests `>= e` (as a wrapping difference) and not `== e`.
//
// # Never hang
// Thread 0 polls, every PEER_POLL_SPINS spins, its rank's host-mapped abort word (set by the
// host when the TP group fails) and %globaltimer against the timeout. On either it records why in
// this rank's host-mapped status word and the kernel returns without touching its outputs
// (the host turns the status into an error; the group is then finished).
#pragma once
#include "common.cuh"

#define PEER_MAX_RANKS 8
#define PEER_POLL_SPINS 256u

// Status codes written to the host-mapped status word (`peer::Status` on the Rust side).
#define PEER_ABORTED 1u
#define PEER_TIMED_OUT 2u

// The kernels' first parameter, passed by value (`peer::PeerArgs` on the Rust side: same field
// order and types; a unit test compares the sizes against the PTX).
// Loops over ranks are unrolled to PEER_MAX_RANKS so that the arrays are indexed with constants
// (a runtime index would copy the whole struct to local memory); `own_*` are this rank's entries.
struct PeerArgs {
    float *recv[PEER_MAX_RANKS];
    unsigned *flags[PEER_MAX_RANKS];
    float *own_recv;
    unsigned *own_flags;
    unsigned *counter;
    const volatile unsigned *abort; // host-mapped, this rank's abort word (written by the host)
    volatile unsigned *status;      // host-mapped, this rank's word
    unsigned long long timeout_ns;
    int rank, world, cap;
};

__device__ __forceinline__ unsigned peer_ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void peer_st_release(unsigned *p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long peer_clock_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Step 3 (thread 0 only): 0 once every peer pushed epoch e, else PEER_ABORTED / PEER_TIMED_OUT.
__device__ unsigned peer_wait(const PeerArgs &a, unsigned e) {
    const unsigned long long t0 = peer_clock_ns();
    for (int q = 0; q < a.world; ++q) {
        if (q == a.rank) continue;
        const unsigned *f = a.own_flags + q;
        unsigned spins = 0;
        // Wrapping difference: a peer is at most one epoch ahead (see above).
        while ((int)(peer_ld_acquire(f) - e) < 0) {
            if (++spins % PEER_POLL_SPINS == 0) {
                if (*a.abort != 0u) return PEER_ABORTED;
                if (peer_clock_ns() - t0 > a.timeout_ns) return PEER_TIMED_OUT;
            }
        }
    }
    return 0u;
}

// Steps 1-3 for src[0..n) of T (f32, f16 or bf16; n * sizeof(T) <= cap floats' bytes).
// Returns this rank's receive slots of the call's parity (`[world][cap]` floats, slot `rank`
// unused; slot q holds rank q's n values of T from its start), or null on abort/timeout; every
// thread gets the same answer. Ends with a bar.sync.
template <typename T> __device__ const float *peer_exchange(const PeerArgs &a, const T *src, int n) {
    __shared__ unsigned s_epoch, s_fail;
    if (threadIdx.x == 0) s_epoch = *a.counter + 1u;
    __syncthreads();
    const unsigned e = s_epoch;
    const size_t parity = (size_t)(e & 1u) * a.world * a.cap;
    const size_t mine = parity + (size_t)a.rank * a.cap;
    // 16-byte stores where src is 16-byte aligned (cap is a multiple of 4 floats, so every
    // slot is), then the tail value by value.
    constexpr int V = 16 / sizeof(T);
    const int nv = ((reinterpret_cast<uintptr_t>(src) & 15) == 0) ? n / V : 0;
    const uint4 *sv = reinterpret_cast<const uint4 *>(src);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        const uint4 v = sv[i];
#pragma unroll
        for (int p = 0; p < PEER_MAX_RANKS; ++p)
            if (p < a.world && p != a.rank) reinterpret_cast<uint4 *>(a.recv[p] + mine)[i] = v;
    }
    for (int i = V * nv + threadIdx.x; i < n; i += blockDim.x) {
        const T v = src[i];
#pragma unroll
        for (int p = 0; p < PEER_MAX_RANKS; ++p)
            if (p < a.world && p != a.rank) reinterpret_cast<T *>(a.recv[p] + mine)[i] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int p = 0; p < PEER_MAX_RANKS; ++p)
            if (p < a.world && p != a.rank) peer_st_release(a.flags[p] + a.rank, e);
        const unsigned fail = peer_wait(a, e);
        if (fail == 0u) {
            *a.counter = e; // read again only by the next call (kernel boundary)
        } else {
            *a.status = fail;
            __threadfence_system();
        }
        s_fail = fail;
    }
    __syncthreads();
    return s_fail == 0u ? a.own_recv + parity : nullptr;
}

__device__ __forceinline__ float peer_ldcg(const float *p) { return __ldcg(p); }
__device__ __forceinline__ float peer_ldcg(const f16 *p) { return to_f(__ldcg(p)); }
__device__ __forceinline__ float peer_ldcg(const bf16 *p) { return to_f(__ldcg(p)); }

// Step 4: dst[i] = sum over ranks q = 0..world-1 (in order) of partial q, in fp32, rounded
// to T once at the end; partial `rank` is own[i], the others are in `slots` (from
// peer_exchange). dst may be own. For two ranks this is round(a + b), what NCCL computes.
template <typename T>
__device__ void peer_sum(const PeerArgs &a, const float *slots, const T *own, T *dst, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float s = (a.rank == 0) ? to_f(own[i]) : peer_ldcg(reinterpret_cast<const T *>(slots) + i);
        for (int q = 1; q < a.world; ++q)
            s += (q == a.rank) ? to_f(own[i])
                               : peer_ldcg(reinterpret_cast<const T *>(slots + (size_t)q * a.cap) + i);
        dst[i] = from_f<T>(s);
    }
}
