// One-shot all-reduce over peer-to-peer (NVLink) buffers, for the ranks of one process
// (ferrum-cuda's `peer` module sets the buffers up; NCCL stays the general path).
//
// # Protocol (push model, flags inside the data, one block per call; every rank runs the same
// # sequence of calls)
//
// A message of n values of T is cut into 8-byte payloads ("lines" of 8 / sizeof(T) values).
// Each rank `p` owns, in its own device memory,
//   recv[p]  : [2 parities][world][2 * cap] floats: rank q's lines of call e land in
//              recv[p][e % 2][q], each as a 16-byte {payload word 0, e, payload word 1, e}
//   counter  : the epoch of this rank's last completed call (0 before the first)
// both zeroed at the start. Call e (e = counter + 1, the same e on every rank because every
// rank makes the same calls) on rank r, every thread for its own lines l:
//   1. stores line l of r's partial, with the epoch beside each payload word, into
//      recv[p][e % 2][r] of every peer p, as one 16-byte store;
//   2. loads (volatile) line l of every peer q from its own recv[r][e % 2][q] until both epoch
//      words read e. Each 8-byte half (payload word, epoch) of the 16-byte store is written
//      and read as a unit (single-copy atomic, the property NCCL's LL protocol rests on), so a
//      half whose epoch is e carries call e's payload: no fence and no separate flag, so a
//      value crosses NVLink once, one way;
//   3. sums the partials of ranks 0, 1, …, world-1 in that order in fp32 (its own from its
//      own input) and rounds once to T: every rank executes the same float operations on the
//      same values, so every rank gets bit-identical sums (for two ranks round(a + b), which
//      is also what NCCL returns).
//
// Why two parities suffice: rank q writes recv[r][e % 2][q] again only in call e + 2, which it
// starts after its call e + 1 finished, which needed r's lines of call e + 1, which r pushes
// only in its call e + 1, after its call e (and all its reads of parity e % 2) finished. So no
// slot is overwritten while it is read, and a slot's epoch words are e - 2 (or 0 before its
// first use) until call e's lines land: "equal to e" is the exact test, wrapping included.
//
// # Never hang
// Each waiting thread reads %globaltimer every PEER_POLL_SPINS spins and its rank's
// host-mapped abort word (set by the host when the TP group fails) every PEER_ABORT_SPINS
// spins. On a timeout or an abort the block records why in the rank's host-mapped status word
// and returns without its outputs (the host turns the status into an error; the group is
// then finished).
#pragma once
#include "common.cuh"

#define PEER_MAX_RANKS 8
#define PEER_POLL_SPINS 256u
#define PEER_ABORT_SPINS 4096u

// Status codes written to the host-mapped status word (`STATUS_*` on the Rust side).
#define PEER_ABORTED 1u
#define PEER_TIMED_OUT 2u

// The kernels' first parameter, passed by value (`peer_abi::PeerArgs` on the Rust side: same
// field order and types; a unit test compares the sizes against the PTX). The rank loop of the
// push is unrolled to PEER_MAX_RANKS so that `recv` is indexed with constants (a runtime index
// would copy the whole struct to local memory); `own_recv` is recv[rank].
struct PeerArgs {
    float *recv[PEER_MAX_RANKS];
    float *own_recv;
    unsigned *counter;
    const volatile unsigned *abort; // host-mapped, this rank's abort word (written by the host)
    volatile unsigned *status;      // host-mapped, this rank's status word
    unsigned long long timeout_ns;
    int rank, world, cap;
};

__device__ __forceinline__ void peer_st_line(float *p, uint2 w, unsigned e) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(e), "r"(w.y),
                 "r"(e)
                 : "memory");
}

__device__ __forceinline__ uint4 peer_ld_line(const float *p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long peer_clock_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The 8-byte payload of line l of src[0..n): values l*L .. l*L + L - 1 (L = 8 / sizeof(T)),
// zero past n (never read past it).
template <typename T> __device__ __forceinline__ uint2 peer_payload(const T *src, int l, int n) {
    constexpr int L = 8 / sizeof(T);
    union {
        T v[L];
        uint2 w;
    } u;
    u.w = make_uint2(0u, 0u);
    const int i0 = l * L;
    if (i0 + L <= n && (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
        u.w = *reinterpret_cast<const uint2 *>(src + i0);
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j)
            if (i0 + j < n) u.v[j] = src[i0 + j];
    }
    return u.w;
}

// Value j of a payload.
template <typename T> __device__ __forceinline__ float peer_value(uint2 w, int j) {
    constexpr int L = 8 / sizeof(T);
    union {
        T v[L];
        uint2 w;
    } u;
    u.w = w;
    return to_f(u.v[j]);
}

// Steps 1-3: dst[i] = T(sum over ranks in rank order of src[i]) for i < n (n <= 2 * cap *
// sizeof(float) / sizeof(T) values… the host keeps n <= cap); dst may be src. Returns false
// (every thread alike) when the call gave up (abort or timeout; dst is then garbage). Ends
// with a bar.sync.
template <typename T> __device__ bool peer_all_reduce(const PeerArgs &a, const T *src, T *dst, int n) {
    constexpr int L = 8 / sizeof(T);
    __shared__ unsigned s_epoch, s_fail;
    if (threadIdx.x == 0) {
        s_epoch = *a.counter + 1u;
        s_fail = 0u;
    }
    __syncthreads();
    const unsigned e = s_epoch;
    const int lines = (n + L - 1) / L;
    // Slot of rank q in rank p's buffer, parity e % 2: 2 * cap floats = cap / 2 lines.
    const size_t slot = 2 * (size_t)a.cap;
    const size_t parity = (size_t)(e & 1u) * a.world * slot;
    const size_t mine = parity + (size_t)a.rank * slot;
    // 1. Push every line of this thread to every peer.
    for (int l = threadIdx.x; l < lines; l += blockDim.x) {
        const uint2 w = peer_payload(src, l, n);
#pragma unroll
        for (int p = 0; p < PEER_MAX_RANKS; ++p)
            if (p < a.world && p != a.rank) peer_st_line(a.recv[p] + mine + 4 * (size_t)l, w, e);
    }
    // 2-3. Wait for every peer's lines of this thread, sum in rank order, store.
    const unsigned long long t0 = peer_clock_ns();
    unsigned fail = 0u;
    for (int l = threadIdx.x; l < lines && fail == 0u; l += blockDim.x) {
        float s[L];
        const uint2 own = peer_payload(src, l, n);
        for (int q = 0; q < a.world && fail == 0u; ++q) {
            uint2 w = own;
            if (q != a.rank) {
                const float *line = a.own_recv + parity + (size_t)q * slot + 4 * (size_t)l;
                uint4 v = peer_ld_line(line);
                unsigned spins = 0;
                while (v.y != e || v.w != e) {
                    ++spins;
                    if (spins % PEER_POLL_SPINS == 0 && peer_clock_ns() - t0 > a.timeout_ns) fail = PEER_TIMED_OUT;
                    if (spins % PEER_ABORT_SPINS == 0 && *a.abort != 0u) fail = PEER_ABORTED;
                    if (fail != 0u) break;
                    v = peer_ld_line(line);
                }
                w = make_uint2(v.x, v.z);
            }
#pragma unroll
            for (int j = 0; j < L; ++j) s[j] = (q == 0) ? peer_value<T>(w, j) : s[j] + peer_value<T>(w, j);
        }
        if (fail == 0u) {
#pragma unroll
            for (int j = 0; j < L; ++j)
                if (l * L + j < n) dst[l * L + j] = from_f<T>(s[j]);
        }
    }
    if (fail != 0u) atomicOr(&s_fail, fail);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (s_fail == 0u) {
            *a.counter = e; // read again only by the next call (kernel boundary)
        } else {
            // Timed out wins over aborted when both happened (either way the call failed).
            *a.status = (s_fail & PEER_TIMED_OUT) ? PEER_TIMED_OUT : PEER_ABORTED;
            __threadfence_system();
        }
    }
    const bool ok = s_fail == 0u;
    __syncthreads(); // every thread has read s_fail before a later call could reset it
    return ok;
}
