// Argmax over the logits (two passes, deterministic: the smallest index wins
// ties, NaN never wins), optionally a Gumbel-max sample, with the device-fed
// step update; the screened LM head (the greedy token without the logits); and
// the hash-based random init for synthetic weights.
#include "common.cuh"

__device__ __forceinline__ bool better(float v, uint32_t i, float bv, uint32_t bi) {
    return v > bv || (v == bv && i < bi);
}

// Reduces (value, index) pairs over the block into thread 0. blockDim.x = 256.
__device__ __forceinline__ void block_argmax(float &v, uint32_t &i) {
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const uint32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sv[lane] : FERRUM_NEG_INF;
        i = lane < nw ? si[lane] : 0xffffffffu;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const uint32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (better(ov, oi, v, i)) {
                v = ov;
                i = oi;
            }
        }
    }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Logits a thread loads at once in pass 1 (the host's chunk is ARGMAX_PER * 256: one round).
#define ARGMAX_PER 4

// Pass 1: block b reduces logits[b*chunk, min((b+1)*chunk, n)).
//
// With inv_temp > 0 it samples instead of taking the maximum (the Gumbel-max
// trick): logit k becomes x_k * inv_temp + g_k with g_k = -log(-log(u_k)) and
// u_k uniform in (0, 1) hashed from (seed, position, k), so the argmax is a
// draw from softmax(x / T), reproducible from (seed, position). The position
// is step[1] (the decode step buffer), or 0 when step is null.
//
// `base`: the vocabulary index of logits[0]. A tensor-parallel rank that computes only its
// rows [base, base + n) of the LM head (the vocab split) reduces them with their vocabulary
// indices, for the ties and for the Gumbel noise, so its candidate is the one the whole
// vocabulary's argmax would pick among those rows.
extern "C" __global__ void ferrum_argmax_partial(const float *logits, int n, int chunk,
                                                 float inv_temp, unsigned long long seed,
                                                 const uint32_t *step, float *part_v,
                                                 uint32_t *part_i, unsigned int base) {
    FERRUM_PDL_ENTRY();
    const int start = blockIdx.x * chunk, end = min(start + chunk, n);
    const uint64_t pos = step ? (uint64_t)step[1] : 0ull;
    const uint64_t key = splitmix64(seed ^ splitmix64(pos));
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    // ARGMAX_PER logits a thread per round, all loaded before the first comparison: one L2
    // round trip per round instead of one per logit (the compare-and-keep chain would otherwise
    // wait for each load in turn). The order of the comparisons does not change the result:
    // `better` is a strict total order on (value, index), NaN is skipped.
    const int B = blockDim.x;
    for (int k0 = start + threadIdx.x; k0 < end; k0 += ARGMAX_PER * B) {
        float xs[ARGMAX_PER];
#pragma unroll
        for (int u = 0; u < ARGMAX_PER; ++u) xs[u] = k0 + u * B < end ? logits[k0 + u * B] : 0.0f;
#pragma unroll
        for (int u = 0; u < ARGMAX_PER; ++u) {
            const int k = k0 + u * B;
            if (k >= end) continue;
            float x = xs[u];
            const uint32_t g = base + (uint32_t)k;  // the vocabulary index (the host checks it fits)
            if (inv_temp > 0.0f) {
                const uint64_t h = splitmix64(key ^ (uint64_t)g);
                // 23 bits: (k + 0.5) / 2^23 is exact in f32 for k < 2^23, so u lies in
                // [2^-24, 1 - 2^-24] and never rounds to 1 (which would make -log(-log u) +inf).
                const float uu = ((float)(h >> 41) + 0.5f) * (1.0f / 8388608.0f);
                x = x * inv_temp - logf(-logf(uu));
            }
            if (!isnan(x) && better(x, g, v, i)) {
                v = x;
                i = g;
            }
        }
    }
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = i;
    }
}

// The chosen token to out[0] and, for device-fed decoding (step non-null), to
// the next step's input. With pos = step[1] (the position just decoded), the
// token is the one at position pos + 1: it goes to history[pos + 1] (history
// holds capacity + 1 entries) and step[0]; step[1] advances to pos + 1 while
// that is below capacity (it never points past the KV cache, whatever the host
// does). One thread.
__device__ __forceinline__ void emit_token(uint32_t i, uint32_t *out, uint32_t *step,
                                           uint32_t *history, int capacity) {
    const uint32_t tok = (i == 0xffffffffu) ? 0u : i;
    out[0] = tok;
    if (step) {
        const uint32_t next = step[1] + 1u;
        if (next <= (uint32_t)capacity) history[next] = tok;
        if (next < (uint32_t)capacity) step[1] = next;
        step[0] = tok;
    }
}

// The block's choice (v, i), from one thread: to this rank's slot of the exchange buffer under a
// vocab split (below), else through emit_token.
__device__ __forceinline__ void pick_done(float v, uint32_t i, uint32_t *out, uint32_t *step, uint32_t *history,
                                          int capacity, float *xchg, int rank, int world) {
    if (xchg) {
        for (int s = 0; s < world; ++s) {
            const bool mine = s == rank;
            xchg[2 * s] = mine && i != 0xffffffffu ? v : 0.0f;
            xchg[2 * s + 1] = mine && i != 0xffffffffu ? (float)i : (mine ? -1.0f : 0.0f);
        }
    } else {
        emit_token(i, out, step, history, capacity);
    }
}

// Pass 2: one block over the n_parts partials; writes the index (0 if every
// logit is NaN) through emit_token.
//
// Vocab split (xchg non-null): this rank's best (value, index) goes to its
// slot of the exchange buffer instead, xchg[2 rank] = value and
// xchg[2 rank + 1] = index as a float (exact: the host checks the vocabulary
// is below 2^24; -1 for none), and every other slot is zeroed, so that a sum
// over the ranks (the TP all-reduce, adding exact zeros) leaves every rank's
// candidate in every rank's buffer; ferrum_argmax_pick then chooses.
extern "C" __global__ void ferrum_argmax_final(const float *part_v, const uint32_t *part_i,
                                               int n_parts, uint32_t *out, uint32_t *step,
                                               uint32_t *history, int capacity, float *xchg,
                                               int rank, int world) {
    FERRUM_PDL_ENTRY();
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    for (int k = threadIdx.x; k < n_parts; k += blockDim.x) {
        if (better(part_v[k], part_i[k], v, i)) {
            v = part_v[k];
            i = part_i[k];
        }
    }
    block_argmax(v, i);
    if (threadIdx.x == 0) pick_done(v, i, out, step, history, capacity, xchg, rank, world);
}

// The vocab split's last step: the best of the world ranks' candidates in the
// summed exchange buffer (ferrum_argmax_final), by the same rule as the
// argmax (larger value, then smaller index; a slot with index -1 has none), so
// the token is the one the whole vocabulary's argmax picks; then emit_token.
// Every rank holds the same buffer, so every rank picks the same token.
extern "C" __global__ void ferrum_argmax_pick(const float *xchg, int world, uint32_t *out,
                                              uint32_t *step, uint32_t *history, int capacity) {
    FERRUM_PDL_ENTRY();
    if (threadIdx.x != 0) return;
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    for (int s = 0; s < world; ++s) {
        const float fi = xchg[2 * s + 1];
        if (fi < 0.0f) continue;
        if (better(xchg[2 * s], (uint32_t)fi, v, i)) {
            v = xchg[2 * s];
            i = (uint32_t)fi;
        }
    }
    emit_token(i, out, step, history, capacity);
}

// -----------------------------------------------------------------------------------------
// The screened LM head: the greedy token without the logits (ferrum_runner::screen is the CPU
// reference of the method and proves the bound; the runner's set_screened_head says when it
// runs). An int8 copy of the head, one scale s_i a row, bounds each row's logit; only the rows
// whose upper bound reaches the largest lower bound of all rows (the floor) are read again in
// the model dtype, by the full head GEMV's own arithmetic, so the token is that GEMV's argmax
// bit for bit while about half of the head's bytes are read.
//
//   ferrum_head_quantize  (at set-up)  W -> q (int8), s_i, c_i, max |w|
//   ferrum_head_screen    (each step)  raise the floor; re-read the rows that reach it
//   ferrum_head_pick      (each step)  the best re-read row -> the token; reset the state
//
// The bound. x' is the GEMV's input after the fused norm's weight (x' = x * norm_w, rounded as
// gemv_chunk rounds it; x' = x without the norm), ||x'||_1 summed rounding up. A row's exact
// dot product d = W_i . x' and its screening value s^ = fl(s_i * fl(q_i . x')) differ by at
// most B = c_i ||x'||_1 + u |s^| + (K + 2) 2^-149, c_i = e_i + gamma (127 s_i + max |w_i|)
// rounded up at set-up (e_i the row's largest rounding error, exact; gamma = K u / (1 - K u)),
// and any f32 evaluation a of that dot product lies in [s^ - B, s^ + B] (screen.rs: the proof,
// which holds for every summation order, FMA or not, while no partial sum overflows). B and
// s^ +- B are computed rounding outwards (__fadd_ru and friends), so they only widen.
// The GEMV's logit is a itself, or fl(a * rn) with the fused norm (rn > 0, one rounding to
// nearest): rounding is monotonic, so fl((s^ - B) rn) rounded down and fl((s^ + B) rn) rounded
// up still bracket it. If r* is the full head's argmax (the largest logit, the smallest row on
// ties) and m any row with a finite bracket [lo_m, up_m]: logit(r*) >= logit(m) >= lo_m, and
// logit(r*) <= up_r*, so up_r* >= the floor = max_m lo_m: r* is re-read. The re-read rows' exact
// logits are the GEMV's (head_exact repeats its order), so the best of them is r*.
// No bound (every row re-read: slow, still exact) when ||x'||_1 is not finite, when a partial
// sum could overflow ((1 + gamma) max |w| ||x'||_1 >= FLT_MAX, `ovf` = (1 + gamma) max |w|
// rounded up by the host), or when rn is not a positive finite number; a row with a
// non-finite weight (c_i = +inf) or a non-finite s^ is always re-read and never raises the floor.
//
// The hand-off. The floor (an order-preserving integer image of the float, for atomicMax) and
// the list's length live in a HeadState; the screen kernel's warps raise the floor with the
// largest lower bound of their rows, then re-read every row whose upper bound reaches the floor
// seen so far (a superset of the rows that reach the final floor: it only rises), appending
// (logit, row) to the list. The pick kernel, launched after the screen kernel completes (its
// programmatic-launch wait), picks the best entry by the argmax's rule and resets the state for
// the next step, whose screen kernel runs several kernels later (after its own wait). The list
// holds one entry a row, so it never overflows.
struct HeadState {
    int floor_ord;  // ord_of(the floor)
    int count;      // entries in the list
    int last;       // the last pick's count (read by the host for tests and diagnostics)
};
struct HeadEntry {
    float logit;
    uint32_t row;  // vocabulary index
};

#define HEAD_WARPS 8  // warps a block of the screen kernel
#define HEAD_ROWS 8   // rows a warp: 8 16-byte loads a lane in flight
#define HEAD_U (1.0f / 16777216.0f)

// An order-preserving integer image of a float (-inf included; never NaN here), and back.
__device__ __forceinline__ int ord_of(float f) {
    const int i = __float_as_int(f);
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float of_ord(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Byte t of w, an int8, as a float: the byte offset by 128 in the low mantissa bits of 2^23
// ([b ^ 0x80, 0, 0, 0x4B] = 2^23 + b + 128), minus 2^23 + 128. Exact; a permute and a
// subtraction instead of a shift and an integer conversion (quarter rate).
__device__ __forceinline__ float i8_to_f(int w, int t) {
    return __int_as_float(__byte_perm(w ^ 0x80808080, 0x4B000000, (unsigned)t | 0x7540u)) - 8388736.0f;
}

// Set-up, one warp a row: the int8 copy (q = round(w / s), s = max |w| / 127), s, c (above) and
// max |w| over the finite rows into *wmax_bits (an atomicMax on the bits of a non-negative float).
template <typename T>
__device__ void head_quantize(const T *W, int rows, int cols, int8_t *q, float *scale, float *coef, int *wmax_bits) {
    const int lane = threadIdx.x & 31;
    const double k = (double)cols, u = 1.0 / 16777216.0, gamma = k * u / (1.0 - k * u);
    for (int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += gridDim.x * (blockDim.x >> 5)) {
        const T *w = W + (size_t)r * cols;
        int8_t *qr = q + (size_t)r * cols;
        float m = 0.0f;
        bool bad = false;
        for (int c = lane; c < cols; c += 32) {
            const float v = to_f(w[c]);
            bad |= !isfinite(v);
            m = fmaxf(m, fabsf(v));
        }
        bad = __any_sync(0xffffffffu, bad);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (bad) {
            // Always re-read (c = +inf), never raises the floor.
            for (int c = lane; c < cols; c += 32) qr[c] = 0;
            if (lane == 0) scale[r] = 0.0f, coef[r] = __int_as_float(0x7f800000);
            continue;
        }
        const float s = m / 127.0f;
        double e = 0.0;
        for (int c = lane; c < cols; c += 32) {
            const float v = to_f(w[c]);
            const float kq = s > 0.0f ? fminf(127.0f, fmaxf(-127.0f, roundf(v / s))) : 0.0f;
            qr[c] = (int8_t)kq;
            e = fmax(e, fabs((double)v - (double)s * (double)kq));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) e = fmax(e, __shfl_xor_sync(0xffffffffu, e, o));
        if (lane == 0) {
            // 1 + 1e-6 covers the f64 roundings (screen.rs's BOUND_SLACK), then rounded up.
            scale[r] = s;
            coef[r] = __double2float_ru((e + gamma * (127.0 * (double)s + (double)m)) * (1.0 + 1e-6));
            atomicMax(wmax_bits, __float_as_int(m));
        }
    }
}

#define FERRUM_HEAD_QUANTIZE(S, T)                                                                 \
    extern "C" __global__ void ferrum_head_quantize_##S(const T *W, int rows, int cols, int8_t *q, \
                                                        float *scale, float *coef, int *wmax_bits) { \
        FERRUM_PDL_ENTRY();                                                                        \
        head_quantize<T>(W, rows, cols, q, scale, coef, wmax_bits);                                \
    }
FERRUM_HEAD_QUANTIZE(f16, f16)
FERRUM_HEAD_QUANTIZE(bf16, bf16)

// x' in shared memory, padded: element e at xs_at(e), 20 floats for every 16 (a 16-byte int8
// chunk's 16 inputs, then 4 unused), so that the float4 loads of 8 consecutive lanes (chunks 80
// bytes apart) fall in distinct banks: a 64-byte stride would put four lanes on each bank.
#define HEAD_XS_STRIDE 20
__device__ __forceinline__ int xs_at(int e) { return (e >> 4) * HEAD_XS_STRIDE + (e & 15); }

// The head GEMV's summation order (gemv.cu's gemv with KS = ks and LPR = lpr lanes a row
// group, 16-byte path), in every lane: lane gl = lane % lpr of "warp" k takes chunks
// gl + lpr (k + ks u) in order, `a = chunk(c, a)` from 0; the group's sum by xor shuffles from
// lpr / 2 down; with ks > 1 (lpr 32) the warp sums added in k order from 0. Both callers below
// repeat the GEMV's rounding through it, so it must stay the GEMV's order step for step.
template <typename F>
__device__ __forceinline__ float gemv_order_sum(int n8, int ks, int lpr, int lane, F chunk) {
    const int gl = lane % lpr;
    float tot = 0.0f;
    for (int k = 0; k < ks; ++k) {
        float a = 0.0f;
        for (int c = gl + lpr * k; c < n8; c += lpr * ks) a = chunk(c, a);
        for (int o = lpr / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        tot = ks > 1 ? tot + a : a;
    }
    return tot;
}

// One row's logit by the head GEMV's arithmetic (gemv_order_sum), from x' in shared memory.
// The caller multiplies by rn as the GEMV does.
template <typename T>
__device__ __forceinline__ float head_exact(const T *row, const float *xs, int cols, int ks, int lpr, int lane) {
    const uint4 *w4 = reinterpret_cast<const uint4 *>(row);
    return gemv_order_sum(cols >> 3, ks, lpr, lane, [&](int c, float a) {
        float wf[8];
        unpack8(__ldg(w4 + c), wf, T());
        const float *xc = xs + xs_at(8 * c);  // 8 consecutive elements of one 16-group
#pragma unroll
        for (int j = 0; j < 8; ++j) a = fmaf(wf[j], xc[j], a);
        return a;
    });
}

// The fused norm's scale rn = rsqrt(ss / cols + eps), ss = sum x^2 by the GEMV's order
// (gemv_order_sum, over x before the norm's weight), in every lane of the calling warp.
__device__ __forceinline__ float head_rn(const float *x, int cols, int ks, int lpr, float eps, int lane) {
    const float ss = gemv_order_sum(cols >> 3, ks, lpr, lane, [&](int c, float a) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float v = x[8 * c + j];
            a = fmaf(v, v, a);
        }
        return a;
    });
    return rsqrtf(ss / (float)cols + eps);
}

// acc[j] += the int8 chunk c of row j (16 weights) . x'[16c .. 16c + 16] (padded shared memory).
__device__ __forceinline__ void head_chunk(float (&acc)[HEAD_ROWS], const uint4 (&v)[HEAD_ROWS], const float4 *xs4, int c) {
    float xv[16];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const float4 a = xs4[(HEAD_XS_STRIDE / 4) * c + t];
        xv[4 * t] = a.x, xv[4 * t + 1] = a.y, xv[4 * t + 2] = a.z, xv[4 * t + 3] = a.w;
    }
#pragma unroll
    for (int j = 0; j < HEAD_ROWS; ++j) {
        const int ws[4] = {(int)v[j].x, (int)v[j].y, (int)v[j].z, (int)v[j].w};
#pragma unroll
        for (int t = 0; t < 16; ++t) acc[j] = fmaf(i8_to_f(ws[t >> 2], t & 3), xv[t], acc[j]);
    }
}

// Each step: the screen (block b, warp w: rows (b HEAD_WARPS + w) HEAD_ROWS + 0..7 of the
// `rows` rows of q / scale / coef / W, vocabulary indices base + row). Dynamic shared memory:
// x', padded (xs_at): 5 cols bytes. cols % 16 == 0 (the host checks).
template <typename T, bool NORM>
__device__ void head_screen(const int8_t *q, const float *scale, const float *coef, const T *W, const float *x,
                            const T *norm_w, float eps, int rows, int cols, int ks, int lpr, float ovf,
                            HeadState *st, HeadEntry *list, unsigned base) {
    extern __shared__ float4 head_xs4[];
    float *xs = reinterpret_cast<float *>(head_xs4);
    __shared__ float s_l1[HEAD_WARPS];
    __shared__ float s_rn;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * HEAD_WARPS + wid) * HEAD_ROWS, n16 = cols >> 4;
    // Rows past the end are clamped to the last one (screened, never used). The first chunk of
    // each row is loaded before the wait where there is one (the compute_90 build): the copy is
    // written once at set-up (then the stream is synchronised) and never by a decode kernel,
    // like the weights (common.cuh).
    const uint4 *qr[HEAD_ROWS];
#pragma unroll
    for (int j = 0; j < HEAD_ROWS; ++j) qr[j] = reinterpret_cast<const uint4 *>(q + (size_t)min(r0 + j, rows - 1) * cols);
    constexpr bool early = FERRUM_HAS_PDL;
    const bool first = r0 < rows && lane < n16;
    uint4 pre[HEAD_ROWS];
#pragma unroll
    for (int j = 0; j < HEAD_ROWS; ++j) pre[j] = early && first ? ldg_early(qr[j] + lane) : make_uint4(0, 0, 0, 0);
    FERRUM_PDL_ENTRY();  // x comes from the previous kernel
    float l1 = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = NORM ? x[c] * to_f(norm_w[c]) : x[c];  // gemv_chunk's xf[j] *= nf[j]
        xs[xs_at(c)] = v;
        l1 = __fadd_ru(l1, fabsf(v));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l1 = __fadd_ru(l1, __shfl_xor_sync(0xffffffffu, l1, o));
    if (lane == 0) s_l1[wid] = l1;
    if (NORM && wid == 0) {
        const float rn = head_rn(x, cols, ks, lpr, eps, lane);
        if (lane == 0) s_rn = rn;
    }
    __syncthreads();
    // The timeline build's phase stamps (common.cuh; no code in other builds): 0 x' staged, 1
    // the screening dot products and bounds, 2 the floor raised, 3 the re-reads (a block's
    // first warp); 4 the end of any warp of the block.
    const unsigned tl_on = FERRUM_TL_FLAG();
    FERRUM_TL_PHASE(tl_on, 0, 0.0f);
    l1 = 0.0f;
#pragma unroll
    for (int i = 0; i < HEAD_WARPS; ++i) l1 = __fadd_ru(l1, s_l1[i]);
    const float rn = NORM ? s_rn : 1.0f;
    if (r0 >= rows) return;  // after the block's barrier
    const float inf = __int_as_float(0x7f800000);
    const bool bounded = l1 <= 3.4028234e38f && __fmul_ru(ovf, l1) <= 3.4028234e38f && rn > 0.0f && rn <= 3.4028234e38f;
    // The screening dot products, 16 int8 weights a 16-byte chunk: lane l takes chunks l, l + 32,
    // ... (the first one prefetched), in any order (the bound holds for every order).
    float acc[HEAD_ROWS];
#pragma unroll
    for (int j = 0; j < HEAD_ROWS; ++j) acc[j] = 0.0f;
    if (first) {
        if (!early) {
#pragma unroll
            for (int j = 0; j < HEAD_ROWS; ++j) pre[j] = __ldg(qr[j] + lane);
        }
        head_chunk(acc, pre, head_xs4, lane);
    }
    for (int c = lane + 32; c < n16; c += 32) {
        uint4 v[HEAD_ROWS];
#pragma unroll
        for (int j = 0; j < HEAD_ROWS; ++j) v[j] = __ldg(qr[j] + c);
        head_chunk(acc, v, head_xs4, c);
    }
    // Each row's bracket [lo, up] of its logit, rounded outwards; the warp's largest lo.
    const float tiny = __fmul_ru((float)(cols + 2), 1.401298464e-45f);  // (K + 2) 2^-149
    float up[HEAD_ROWS], best_lo = -inf;
#pragma unroll
    for (int j = 0; j < HEAD_ROWS; ++j) {
        const float sh = warp_sum(acc[j]) * (r0 + j < rows ? scale[r0 + j] : 0.0f);
        float lo = -inf, hi = inf;
        if (bounded && r0 + j < rows && isfinite(sh)) {
            const float b = __fadd_ru(__fadd_ru(__fmul_ru(coef[r0 + j], l1), __fmul_ru(HEAD_U, fabsf(sh))), tiny);
            lo = __fsub_rd(sh, b);
            hi = __fadd_ru(sh, b);
            if (NORM) lo = __fmul_rd(lo, rn), hi = __fmul_ru(hi, rn);
            // A non-finite weight row (c = +inf): hi = +inf, lo = -inf, as intended.
        }
        up[j] = hi;
        best_lo = fmaxf(best_lo, lo);
    }
    FERRUM_TL_PHASE(tl_on, 1, best_lo);
    // Raise the floor (lane 0; the old value comes back), then re-read the rows that reach it.
    int f = 0;
    if (lane == 0) f = max(atomicMax(&st->floor_ord, ord_of(best_lo)), ord_of(best_lo));
    const float floor_now = of_ord(__shfl_sync(0xffffffffu, f, 0));
    FERRUM_TL_PHASE(tl_on, 2, floor_now);
#pragma unroll
    for (int j = 0; j < HEAD_ROWS; ++j) {
        if (r0 + j >= rows || up[j] < floor_now) continue;
        float l = head_exact<T>(W + (size_t)(r0 + j) * cols, xs, cols, ks, lpr, lane);
        if (NORM) l *= rn;  // the GEMV's acc[r] *= rn
        if (lane == 0) {
            const int at = atomicAdd(&st->count, 1);
            if (at < rows) list[at] = HeadEntry{l, base + (uint32_t)(r0 + j)};
        }
    }
    FERRUM_TL_PHASE(tl_on, 3, 0.0f);
    FERRUM_TL_PHASE_WARP(tl_on, 4, 0.0f);
}

#define FERRUM_HEAD_SCREEN(S, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(HEAD_WARPS * 32) ferrum_head_screen_##S(          \
        const int8_t *q, const float *scale, const float *coef, const T *W, const float *x,        \
        const T *norm_w, float eps, int rows, int cols, int ks, int lpr, float ovf, HeadState *st, \
        HeadEntry *list, unsigned base) {                                                          \
        head_screen<T, false>(q, scale, coef, W, x, norm_w, eps, rows, cols, ks, lpr, ovf, st, list, base); \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(HEAD_WARPS * 32) ferrum_head_screen_norm_##S(     \
        const int8_t *q, const float *scale, const float *coef, const T *W, const float *x,        \
        const T *norm_w, float eps, int rows, int cols, int ks, int lpr, float ovf, HeadState *st, \
        HeadEntry *list, unsigned base) {                                                          \
        head_screen<T, true>(q, scale, coef, W, x, norm_w, eps, rows, cols, ks, lpr, ovf, st, list, base); \
    }
FERRUM_HEAD_SCREEN(f16, f16)
FERRUM_HEAD_SCREEN(bf16, bf16)

// Each step, one block: the best list entry by the argmax's rule (NaN never wins; none: token
// 0 as the argmax gives), written as ferrum_argmax_final writes its choice; then the state is
// reset for the next step (every thread has read it: block_argmax's barrier comes between).
extern "C" __global__ void ferrum_head_pick(HeadState *st, const HeadEntry *list, int cap, uint32_t *out,
                                            uint32_t *step, uint32_t *history, int capacity, float *xchg, int rank,
                                            int world) {
    FERRUM_PDL_ENTRY();
    const int n = min(st->count, cap);
    float v = FERRUM_NEG_INF;
    uint32_t i = 0xffffffffu;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        const HeadEntry h = list[e];
        if (!isnan(h.logit) && better(h.logit, h.row, v, i)) {
            v = h.logit;
            i = h.row;
        }
    }
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        st->last = n;
        st->floor_ord = ord_of(FERRUM_NEG_INF);
        st->count = 0;
        pick_done(v, i, out, step, history, capacity, xchg, rank, world);
    }
}

// A [rows x cols] slice, at (row0, col0), of a [* x full_cols] matrix whose
// element e (row-major index) is offset + half_width * u_e, u_e uniform in
// [-1, 1) hashed from (seed, e). A tensor-parallel shard of a random model is
// thus exactly the slice of the whole model that the same seed makes.
template <typename T>
__device__ void init_uniform(T *out, int rows, int cols, long long full_cols, long long row0,
                             long long col0, unsigned long long seed, float offset,
                             float half_width) {
    const unsigned long long n = (unsigned long long)rows * (unsigned long long)cols;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = k / (unsigned long long)cols, c = k % (unsigned long long)cols;
        const unsigned long long e = (row0 + r) * full_cols + col0 + c;
        const uint64_t h = splitmix64(seed ^ splitmix64(e));
        const float u = (float)(h >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
        out[k] = from_f<T>(offset + half_width * (2.0f * u - 1.0f));
    }
}

#define FERRUM_INIT(S, T)                                                                          \
    extern "C" __global__ void ferrum_init_uniform_##S(T *out, int rows, int cols,                 \
                                                       long long full_cols, long long row0,        \
                                                       long long col0, unsigned long long seed,    \
                                                       float offset, float half_width) {           \
        FERRUM_PDL_ENTRY();                                                                        \
        init_uniform<T>(out, rows, cols, full_cols, row0, col0, seed, offset, half_width);         \
    }

FERRUM_INIT(f16, f16)
FERRUM_INIT(bf16, bf16)

// Fills the block's dynamic shared memory with all-ones bytes: NaN as f32, f16 and bf16. The GPU
// does not clear shared memory between the kernels of a context, so the next kernels on these
// multiprocessors start on it: a test launches this over every multiprocessor, with the whole
// opt-in shared memory a block, to check that no kernel's results take in shared memory it did
// not write (CudaDecodeRunner::poison_shared_memory; for tests only). Inline-assembly stores, so
// the compiler cannot drop them as dead (nothing in the kernel reads them back).
extern "C" __global__ void ferrum_poison_shared(void) {
    FERRUM_PDL_ENTRY();
    extern __shared__ uint4 s_poison[];
    uint32_t bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(s_poison);
    for (uint32_t i = threadIdx.x * 16u; i + 16u <= bytes; i += blockDim.x * 16u)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(base + i), "r"(0xffffffffu) : "memory");
}
