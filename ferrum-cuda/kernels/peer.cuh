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
//   counter  : {the epoch of this rank's last completed call (0 before the first), failed}
// all zeroed at the start. Call e (e = counter + 1, the same e on every rank because every
// rank makes the same calls) on rank r, every thread for its own lines l:
//   1. stores line l of r's partial, with the epoch beside each payload word, into
//      recv[p][e % 2][r] of every peer p, as one vector store of two 8-byte elements
//      (payload word | epoch << 32);
//   2. loads (volatile) line l of every peer q from its own recv[r][e % 2][q] until both epoch
//      words read e. Each 8-byte element is one naturally aligned 8-byte access, which the PTX
//      memory model makes single-copy atomic, so an element whose epoch is e carries call e's
//      payload (the idea of NCCL's LL protocol): no fence and no separate flag, so a value
//      crosses NVLink once, one way;
//   3. sums the partials of ranks 0, 1, …, world-1 in that order in fp32 (its own from its
//      own input) and rounds once to T: every rank executes the same float operations on the
//      same values, so every rank gets bit-identical sums (for two ranks round(a + b), which
//      is also what NCCL returns).
//
// Step 1 may instead be done by the kernel that produced the partial (gemv.cu's `_push`
// GEMVs, as each warp stores its outputs; then this call runs with PUSHED): the same lines,
// with the same epoch (the producer reads the rank's counter, last written by the rank's
// previous call, which had completed before the producer's programmatic-launch wait), into the
// same slots, and still after the rank's previous call has ended, which is all the argument
// below uses.
//
// Why two parities suffice (while every call succeeds): rank q writes recv[r][e % 2][q] again
// only in call e + 2, which it starts after its call e + 1 finished, which needed r's lines of
// call e + 1, which r pushes only in its call e + 1, after its call e (and all its reads of
// parity e % 2) finished. So no slot is overwritten while it is read, and a slot's epoch words
// are e - 2 (or 0 before its first use) until call e's lines land: "equal to e" is the exact
// test, wrapping included (2^32 is even, so the parity keeps alternating). A rank's calls must
// be ordered (one stream): the counter is read at a call's start and written at its end.
//
// # Never hang
// Each waiting thread reads %globaltimer every PEER_POLL_SPINS spins and its rank's
// host-mapped abort word (set by the host when the TP group fails) every PEER_ABORT_SPINS
// spins. On a timeout or an abort the block records why in the rank's host-mapped status word
// and in its device-side `failed` word, and returns without its outputs. `failed` is sticky:
// every later call of the rank returns at once without pushing (so a queue of calls behind a
// failed one cannot wait a timeout each, and no later push can land in a slot a peer is still
// reading). The host turns the status into an error; the group is then finished.
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
    unsigned *counter; // {epoch, failed}, 8-byte aligned
    const volatile unsigned *abort; // host-mapped, this rank's abort word (written by the host)
    volatile unsigned *status;      // host-mapped, this rank's status word
    unsigned long long timeout_ns;
    int rank, world, cap;
};
// The layout the Rust side mirrors (its test checks the same offsets with `offset_of!`).
static_assert(offsetof(PeerArgs, own_recv) == 64 && offsetof(PeerArgs, counter) == 72 &&
                  offsetof(PeerArgs, abort) == 80 && offsetof(PeerArgs, status) == 88 &&
                  offsetof(PeerArgs, timeout_ns) == 96 && offsetof(PeerArgs, rank) == 104 &&
                  offsetof(PeerArgs, world) == 108 && offsetof(PeerArgs, cap) == 112 &&
                  sizeof(PeerArgs) == 120,
              "PeerArgs layout (peer_abi.rs)");

// A line: two 8-byte elements, each (payload word | epoch << 32), in one vector access.
__device__ __forceinline__ void peer_st_line(float *p, uint2 w, unsigned e) {
    const unsigned long long lo = (unsigned long long)w.x | ((unsigned long long)e << 32);
    const unsigned long long hi = (unsigned long long)w.y | ((unsigned long long)e << 32);
    asm volatile("st.volatile.global.v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi) : "memory");
}

__device__ __forceinline__ ulonglong2 peer_ld_line(const float *p) {
    ulonglong2 v;
    asm volatile("ld.volatile.global.v2.b64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long peer_clock_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One 8-byte payload word of a line: L = 8 / sizeof(T) values of T, or the word itself.
template <typename T> union PeerWord {
    static constexpr int L = 8 / sizeof(T);
    T v[L];
    uint2 w;
};

// The 8-byte payload of line l of src[0..n): values l*L .. l*L + L - 1 (L = 8 / sizeof(T)),
// zero past n (never read past it).
template <typename T> __device__ __forceinline__ uint2 peer_payload(const T *src, int l, int n) {
    constexpr int L = PeerWord<T>::L;
    PeerWord<T> u;
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
    PeerWord<T> u;
    u.w = w;
    return to_f(u.v[j]);
}

// Steps 1-3: dst[i] = T(sum over ranks in rank order of src[i]) for i < n (a slot holds
// 4 * cap / sizeof(T) values; the host keeps n <= cap); dst may be src. Returns false (every
// thread alike) when the call gave up (abort, timeout, or an earlier failure of this rank; dst
// is then garbage). Ends with a bar.sync.
template <typename T, bool PUSHED = false>
__device__ bool peer_all_reduce(const PeerArgs &a, const T *src, T *dst, int n) {
    constexpr int L = 8 / sizeof(T);
    __shared__ unsigned s_epoch, s_fail;
    if (threadIdx.x == 0) {
        const uint2 c = *reinterpret_cast<const uint2 *>(a.counter); // {epoch, failed}
        s_epoch = c.x + 1u;
        s_fail = c.y;
    }
    __syncthreads();
    const unsigned e = s_epoch;
    if (s_fail != 0u) {
        __syncthreads(); // every thread has read s_fail before anyone returns
        return false;    // an earlier call failed: the rank is finished (see "Never hang")
    }
    const int lines = (n + L - 1) / L;
    // Slot of rank q in rank p's buffer, parity e % 2: 2 * cap floats = cap / 2 lines.
    const size_t slot = 2 * (size_t)a.cap;
    const size_t parity = (size_t)(e & 1u) * a.world * slot;
    const size_t mine = parity + (size_t)a.rank * slot;
    // 1. Push every line of this thread to every peer (unless the producer did).
    for (int l = threadIdx.x; !PUSHED && l < lines; l += blockDim.x) {
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
                ulonglong2 v = peer_ld_line(line);
                unsigned spins = 0;
                while ((unsigned)(v.x >> 32) != e || (unsigned)(v.y >> 32) != e) {
                    ++spins;
                    if (spins % PEER_POLL_SPINS == 0 && peer_clock_ns() - t0 > a.timeout_ns) fail = PEER_TIMED_OUT;
                    if (spins % PEER_ABORT_SPINS == 0 && *a.abort != 0u) fail = PEER_ABORTED;
                    if (fail != 0u) break;
                    v = peer_ld_line(line);
                }
                w = make_uint2((unsigned)v.x, (unsigned)v.y);
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
            a.counter[0] = e; // read again only by the next call (kernel boundary)
        } else {
            // Timed out wins over aborted when both happened (either way the call failed).
            const unsigned why = (s_fail & PEER_TIMED_OUT) ? PEER_TIMED_OUT : PEER_ABORTED;
            a.counter[1] = why; // sticky: the rank's later calls return at once
            *a.status = why;
            __threadfence_system();
        }
    }
    const bool ok = s_fail == 0u;
    __syncthreads(); // every thread has read s_fail before a later call could reset it
    return ok;
}
