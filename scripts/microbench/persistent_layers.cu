// Can a persistent decode step whose parts hand off through flags in memory beat kernel
// boundaries? The question session 35 left for the two open TP1 rows of issue 6 (135M, 1B):
// its layers' GEMVs with their boundaries take ~9.5 us (135M) and ~34 us (1B) a layer in the
// stamped timelines (PERF.md, sessions 21 and 26), against 1.7 us and 28.7 us of weights at
// copy bandwidth (4.24 TB/s).
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/pl scripts/microbench/persistent_layers.cu && /tmp/pl
//
// One kernel runs STEPS decode steps of a Llama layer stack's four projections, with one block
// a multiprocessor (a cooperative launch, so every block is resident and no wait can hang on a
// block that never runs; every wait also gives up after TIMEOUT_NS and raises `err`):
//   qkv  = W_qkv rmsnorm(h)                 (the norm's weight taken as folded into W)
//   h   += W_o qkv[0..H)                    (the attention left out: its input is q)
//   act  = silu(g) * u, [g; u] = W_gu rmsnorm(h)   (gate and up rows interleaved)
//   h   += W_d act
// Block b owns a contiguous share of each projection's rows (the same share of h for o and
// down, so it keeps its rows of the residual in shared memory). Its weights reach it through a
// ring of 16 KiB shared-memory slots that one producer warp fills with bulk copies
// (cp.async.bulk, one mbarrier a slot for "full" and one for "empty"), running ahead of the
// consumers by as many slots as the ring holds: weights do not depend on the activations, so
// the stream never waits for a hand-off while the ring has room. Sixteen consumer warps take
// each projection's input from a hand-off buffer written in the NCCL "LL" form: every element
// a 64-bit word of (f32 value, u32 flag) stored by one single-copy-atomic 8-byte store, so a
// reader that sees the flag of this step and layer sees the value with it, with no fence and no
// separate flag (a consumer polls the data itself). Flags are unique per (launch, step, layer),
// so no buffer needs clearing; a buffer is rewritten only after every block has read it, since
// its next write follows a later hand-off whose input every block wrote after its own read (hb
// is rewritten after act is complete, qkv after hb, ha after qkv, act after ha). As in NCCL's
// LL protocol, that order rests on the readers' control and data dependencies (a block stores
// its outputs only after the values it polled), not on acquire/release.
//
// Modes, each the median of REPS launches divided by STEPS x layers (us a layer):
// - full:        as above;
// - no-handoff:  consumers never poll (they use whatever x they hold): the ring's stream alone,
//                each block at its own pace (the weights' floor for this kernel);
// - no-weights:  the producer copies nothing and the consumers do not wait for slots (their dot
//                products read stale shared memory): the hand-off chain alone;
// - chain:       no weights and no dot products either: each projection's poll, norm and stores.
// Build flags: -DCONSUMER_WARPS=N (default 16), -DSTAMPS=0 (no stamps, for the plain timing).
// A check runs first: one step of every layer against a double-precision host reference.
// Thread 0 of every block stamps %globaltimer through each projection of the last step
// (NSTAMP); print_stamps gives block 0's phases, the writers' spread at each hand-off and the
// hand-off's latency, and the SM clock.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.cuh"
#include "timing.cuh"

constexpr int SLOT = 16384;           // bytes a ring slot
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 16
#endif
#ifndef STAMPS
#define STAMPS 1
#endif
constexpr int CW = CONSUMER_WARPS;    // consumer warps (-DCONSUMER_WARPS=8 for eight)
constexpr int CT = CW * 32;           // consumer threads
constexpr int THREADS = CT + 32;      // and one producer warp
constexpr int MAXROWS = 512;          // physical rows a block may own in one projection
constexpr int MAXH = 64;              // rows of h a block may own
constexpr unsigned long long TIMEOUT_NS = 200000000ull;  // 200 ms
constexpr int STEPS = 8;
constexpr int REPS = 7;
constexpr float EPS = 1e-5f;
// Thread 0 of every block stamps each projection of the last step: 0 start, 1 its own input
// words seen, 2 every thread's (after the barrier), 3 the norm's scale, 4 its own rows' dot
// products, 5 every warp's (after the barrier), 6 its stores issued; 7 is clock64 at 0.
constexpr int NSTAMP = 8;

enum Proj { QKV = 0, O = 1, GU = 2, DOWN = 3 };
enum Mode { FULL = 0, NO_HANDOFF = 1, NO_WEIGHTS = 2, CHAIN = 3 };

struct Model {
    int H, I, Q, L;
    const __nv_bfloat16 *w[4];  // layer 0 of each projection; layer l at + l * layer_elems[p]
    size_t layer_elems[4];
    unsigned long long *qkv, *ha, *act, *hb;  // hand-off buffers (LL words)
    const float *h0;
    unsigned *err;
    unsigned long long *stamps;  // [block][layer][proj][NSTAMP] of the last step (thread 0)
};

// A projection's shape: logical rows (an output each), physical rows a logical row (2 for
// gate|up), columns, and its input / output buffers.
struct Shape {
    int rows, mult, K;
    bool norm;
};
__device__ __forceinline__ Shape shape_of(const Model &m, int p) {
    switch (p) {
    case QKV: return {m.Q, 1, m.H, true};
    case O: return {m.H, 1, m.H, false};
    case GU: return {m.I, 2, m.H, true};
    default: return {m.H, 1, m.I, false};
    }
}

__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
// Relaxed gpu-scope loads and stores of whole 64-bit words: single-copy atomic, so a word's
// flag and value are seen together; relaxed suffices since no other data rides on the flag.
__device__ __forceinline__ unsigned long long ld_word(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_word(unsigned long long *p, float x, unsigned flag) {
    const unsigned long long v = ((unsigned long long)flag << 32) | __float_as_uint(x);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ bool failed(const unsigned *err) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(err) : "memory");
    return v != 0;
}
__device__ __forceinline__ bool mbar_try(unsigned bar, unsigned parity) {
    unsigned ok;
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
// Waits for the phase of `parity` to complete; after TIMEOUT_NS, or once another thread has
// raised err, raises err and traps (the launch fails with a CUDA error instead of hanging).
__device__ bool mbar_wait(unsigned bar, unsigned parity, unsigned *err) {
    if (mbar_try(bar, parity)) return true;
    const unsigned long long t0 = gtime();
    for (unsigned it = 0;; ++it) {
        if (mbar_try(bar, parity)) return true;
        if ((it & 63) == 63 && (failed(err) || gtime() - t0 > TIMEOUT_NS)) {
            atomicExch(err, 1u);
            asm volatile("trap;");
        }
    }
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CT) : "memory"); }

__device__ __forceinline__ float dot8(uint4 u, const float4 *x, int c) {
    const float4 a = x[2 * c], b = x[2 * c + 1];
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
    const float2 t0 = __bfloat1622float2(h[0]), t1 = __bfloat1622float2(h[1]);
    const float2 t2 = __bfloat1622float2(h[2]), t3 = __bfloat1622float2(h[3]);
    float s = t0.x * a.x;
    s = fmaf(t0.y, a.y, s);
    s = fmaf(t1.x, a.z, s);
    s = fmaf(t1.y, a.w, s);
    s = fmaf(t2.x, b.x, s);
    s = fmaf(t2.y, b.y, s);
    s = fmaf(t3.x, b.z, s);
    return fmaf(t3.y, b.w, s);
}

// EPT: input elements a consumer thread polls (ceil(largest K / CT)).
template <int EPT>
__global__ void __launch_bounds__(THREADS, 1) layers(Model m, int steps, unsigned base, int mode, int ns) {
    extern __shared__ __align__(128) unsigned char smem[];
    uint4 *ring = reinterpret_cast<uint4 *>(smem);
    float *xs = reinterpret_cast<float *>(smem + (size_t)ns * SLOT);  // [largest K]
    __shared__ float rowres[MAXROWS];
    __shared__ float hown[MAXH];
    __shared__ float red[CW];
    __shared__ __align__(8) unsigned long long bars[2 * 16];  // full[ns], empty[ns]
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, G = gridDim.x, b = blockIdx.x;
    const unsigned full0 = (unsigned)__cvta_generic_to_shared(&bars[0]);
    const unsigned empty0 = full0 + 8 * ns;
    const int maxk = max(m.H, m.I);
    if (t == 0) {
        for (int s = 0; s < ns; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full0 + 8 * s) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty0 + 8 * s), "n"(CW) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    // h's rows of this block (the o and down projections' share), and h0 published as the
    // hand-off of "layer -1" (flag base).
    const int h0r = m.H * b / G, h1r = m.H * (b + 1) / G;
    for (int r = h0r + t; r < h1r; r += blockDim.x) {
        hown[r - h0r] = m.h0[r];
        st_word(m.hb + r, m.h0[r], base);
    }
    for (int i = t; i < maxk; i += blockDim.x) xs[i] = 0.01f;
    __syncthreads();

    if (warp == CW) {  // the producer: lane 0 issues every slot's copy, in the consumers' order
        if (lane != 0 || mode >= NO_WEIGHTS) return;
        unsigned n = 0;
        for (int s = 0; s < steps; ++s)
            for (int l = 0; l < m.L; ++l)
                for (int p = 0; p < 4; ++p) {
                    const Shape sh = shape_of(m, p);
                    const int r0 = sh.rows * b / G, r1 = sh.rows * (b + 1) / G;
                    const int nrows = sh.mult * (r1 - r0), rb = 2 * sh.K, rps = SLOT / rb;
                    const __nv_bfloat16 *src = m.w[p] + l * m.layer_elems[p] + (size_t)sh.mult * r0 * sh.K;
                    for (int q = 0; q < nrows; q += rps, ++n) {
                        const int slot = n % ns;
                        if (n >= (unsigned)ns && !mbar_wait(empty0 + 8 * slot, ((n / ns) - 1) & 1, m.err)) return;
                        const unsigned bytes = (unsigned)(min(rps, nrows - q) * rb);
                        bulk_load((unsigned)__cvta_generic_to_shared(smem) + slot * SLOT, src + (size_t)q * sh.K, bytes,
                                  full0 + 8 * slot);
                    }
                }
        return;
    }

    // The consumers.
    unsigned n = 0;
    const float4 *xs4 = reinterpret_cast<const float4 *>(xs);
    for (int s = 0; s < steps; ++s)
        for (int l = 0; l < m.L; ++l) {
            const unsigned flag = base + (unsigned)(s * m.L + l) + 1;
            for (int p = 0; p < 4; ++p) {
                const Shape sh = shape_of(m, p);
                const unsigned long long *in = p == QKV ? m.hb : p == O ? m.qkv : p == GU ? m.ha : m.act;
                const unsigned want = p == QKV ? flag - 1 : flag;
                const bool stamp = STAMPS && t == 0 && s == steps - 1;  // -DSTAMPS=0: none
                unsigned long long *sp = m.stamps + ((size_t)(b * m.L + l) * 4 + p) * NSTAMP;
                if (stamp) {
                    sp[0] = gtime();
                    sp[7] = clock64();
                }
                // 1. The input, polled as it lands.
                float ss = 0.0f;
                if (mode != NO_HANDOFF) {
                    unsigned long long v[EPT];
#pragma unroll
                    for (int j = 0; j < EPT; ++j) {
                        const int i = t + j * CT;
                        v[j] = i < sh.K ? ld_word(in + i) : (unsigned long long)want << 32;
                    }
                    const unsigned long long t0 = gtime();
                    for (unsigned it = 0;; ++it) {
                        bool ok = true;
#pragma unroll
                        for (int j = 0; j < EPT; ++j)
                            if ((unsigned)(v[j] >> 32) != want) {
                                ok = false;
                                v[j] = ld_word(in + t + j * CT);
                            }
                        if (ok) {
                            if (stamp) sp[1] = gtime();
                            break;
                        }
                        if ((it & 63) == 63 && (failed(m.err) || gtime() - t0 > TIMEOUT_NS)) {
                            atomicExch(m.err, 1u);
                            asm volatile("trap;");  // a bar.sync would hang on a thread that returned
                        }
                    }
#pragma unroll
                    for (int j = 0; j < EPT; ++j) {
                        const int i = t + j * CT;
                        if (i < sh.K) {
                            const float x = __uint_as_float((unsigned)v[j]);
                            xs[i] = x;
                            ss = fmaf(x, x, ss);
                        }
                    }
                } else {
                    for (int i = t; i < sh.K; i += CT) ss = fmaf(xs[i], xs[i], ss);
                }
                float rs = 1.0f;
                if (sh.norm) {
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                    if (lane == 0) red[warp] = ss;
                }
                consumers_sync();
                if (stamp) sp[2] = gtime();
                if (sh.norm) {
                    float tot = 0.0f;
#pragma unroll
                    for (int w = 0; w < CW; ++w) tot += red[w];
                    rs = rsqrtf(tot / sh.K + EPS);
                }
                if (stamp) sp[3] = __float_as_uint(rs) == 0x12345678u ? 0 : gtime();
                // 2. The block's rows, slot by slot: a warp a row, the lanes along K.
                const int r0 = sh.rows * b / G, r1 = sh.rows * (b + 1) / G;
                const int nrows = sh.mult * (r1 - r0), k8 = sh.K / 8, rps = SLOT / (2 * sh.K);
                for (int q = 0; q < (mode == CHAIN ? 0 : nrows); q += rps, ++n) {
                    const int slot = n % ns;
                    if (mode != NO_WEIGHTS && !mbar_wait(full0 + 8 * slot, (n / ns) & 1, m.err)) return;
                    const uint4 *sl = ring + (size_t)slot * (SLOT / 16);
                    const int prow = min(rps, nrows - q);
                    // Row q + rr goes to warp (q + rr) % CW, so a warp with no row in this slot
                    // releases it at once and goes on to the next: up to CW / rps slots are
                    // consumed at a time.
                    for (int rr = (warp - q % CW + CW) % CW; rr < prow; rr += CW) {
                        float acc = 0.0f;
                        for (int c = lane; c < k8; c += 32) acc += dot8(sl[rr * k8 + c], xs4, c);
#pragma unroll
                        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                        if (lane == 0) rowres[q + rr] = acc;
                    }
                    __syncwarp();
                    if (lane == 0 && mode != NO_WEIGHTS) mbar_arrive(empty0 + 8 * slot);
                }
                if (stamp) sp[4] = __float_as_uint(rowres[0]) == 0x12345678u ? 0 : gtime();
                consumers_sync();
                if (stamp) sp[5] = gtime();
                // 3. The outputs, as LL words.
                for (int j = t; j < r1 - r0; j += CT) {
                    const int r = r0 + j;
                    switch (p) {
                    case QKV: st_word(m.qkv + r, rowres[j] * rs, flag); break;
                    case O:
                        hown[j] += rowres[j];
                        st_word(m.ha + r, hown[j], flag);
                        break;
                    case GU: {
                        const float g = rowres[2 * j] * rs, u = rowres[2 * j + 1] * rs;
                        st_word(m.act + r, g / (1.0f + __expf(-g)) * u, flag);
                        break;
                    }
                    default:
                        hown[j] += rowres[j];
                        st_word(m.hb + r, hown[j], flag);
                    }
                }
                if (stamp) sp[6] = gtime();
            }
        }
}

// Weights: a hash of (projection, layer, index) scaled by sqrt(3 / K) (variance 1 / K), the
// same function on the host for the reference.
__host__ __device__ inline float wval(unsigned p, unsigned l, size_t i, int K) {
    unsigned long long x = (unsigned long long)i * 0x9E3779B97F4A7C15ull ^ ((unsigned long long)(p * 131 + l) << 40);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u = (float)(x & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f;
    return u * sqrtf(3.0f / K);
}
__global__ void init_w(__nv_bfloat16 *w, unsigned p, int L, size_t per, int K) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < per * L; i += (size_t)gridDim.x * blockDim.x)
        w[i] = __float2bfloat16(wval(p, (unsigned)(i / per), i % per, K));
}

struct Dims {
    const char *name;
    int H, I, Q, L;
};

static void reference(const Dims &d, const std::vector<std::vector<float>> &w, std::vector<double> &h) {
    // w[p]: every layer's weights of projection p, as rounded to bf16 on the device.
    const int H = d.H, I = d.I, Q = d.Q;
    std::vector<double> x(std::max(H, I)), qkv(Q), act(I);
    for (int l = 0; l < d.L; ++l) {
        auto rms = [&](const std::vector<double> &v) {
            double s = 0;
            for (int i = 0; i < H; ++i) s += v[i] * v[i];
            return 1.0 / std::sqrt(s / H + EPS);
        };
        const double r1 = rms(h);
        const float *wq = w[QKV].data() + (size_t)l * Q * H;
        for (int r = 0; r < Q; ++r) {
            double a = 0;
            for (int k = 0; k < H; ++k) a += wq[(size_t)r * H + k] * h[k];
            qkv[r] = a * r1;
        }
        const float *wo = w[O].data() + (size_t)l * H * H;
        for (int r = 0; r < H; ++r) {
            double a = 0;
            for (int k = 0; k < H; ++k) a += wo[(size_t)r * H + k] * qkv[k];
            x[r] = a;
        }
        for (int r = 0; r < H; ++r) h[r] += x[r];
        const double r2 = rms(h);
        const float *wg = w[GU].data() + (size_t)l * 2 * I * H;
        for (int r = 0; r < I; ++r) {
            double g = 0, u = 0;
            for (int k = 0; k < H; ++k) {
                g += wg[(size_t)(2 * r) * H + k] * h[k];
                u += wg[(size_t)(2 * r + 1) * H + k] * h[k];
            }
            g *= r2;
            u *= r2;
            act[r] = g / (1.0 + std::exp(-g)) * u;
        }
        const float *wd = w[DOWN].data() + (size_t)l * H * I;
        for (int r = 0; r < H; ++r) {
            double a = 0;
            for (int k = 0; k < I; ++k) a += wd[(size_t)r * I + k] * act[k];
            x[r] = a;
        }
        for (int r = 0; r < H; ++r) h[r] += x[r];
    }
}

// Means over the layers after the first of the last step's stamps: block 0's phases, and for
// each hand-off the spread of its writers' last stores (for o, the blocks that own q rows) and
// how long after the last of them block 0 held its whole input (after the barrier) and its
// thread 0's own words; the SM clock from clock64. Caveat: phases with no work in them (o's
// norm, the chain's dots) read 0.3-0.9 us, so sub-microsecond phases are rough.
static void print_stamps(const Dims &d, int G, const unsigned long long *dev) {
    std::vector<unsigned long long> st((size_t)G * d.L * 4 * NSTAMP);
    CHECK(cudaMemcpy(st.data(), dev, st.size() * 8, cudaMemcpyDeviceToHost));
    auto at = [&](int b, int l, int p, int k) { return (double)st[((size_t)(b * d.L + l) * 4 + p) * NSTAMP + k]; };
    const char *pn[] = {"qkv", "o", "gu", "down"};
    for (int p = 0; p < 4; ++p) {
        double ph[6] = {}, skew = 0, late = 0, late_own = 0;
        int cnt = 0;
        for (int l = 1; l < d.L; ++l, ++cnt) {
            for (int k = 0; k < 6; ++k) ph[k] += (at(0, l, p, k + 1) - at(0, l, p, k)) * 1e-3;
            const int pl = p ? l : l - 1, pp = p ? p - 1 : 3;
            double lo = 1e30, hi = 0;
            for (int b = 0; b < G; ++b) {
                if (p == O && d.Q * b / G >= d.H) continue;  // o reads q only: not a writer
                lo = std::min(lo, at(b, pl, pp, 6));
                hi = std::max(hi, at(b, pl, pp, 6));
            }
            skew += (hi - lo) * 1e-3;
            late += (at(0, l, p, 2) - hi) * 1e-3;
            late_own += (at(0, l, p, 1) - hi) * 1e-3;
        }
        std::printf("  %-4s block 0: own input %.2f, all %.2f, norm %.2f, own dots %.2f, all %.2f, stores %.2f us; "
                    "writers' last stores spread %.2f; block 0 held its input %.2f after the last (own words %.2f)\n",
                    pn[p], ph[0] / cnt, ph[1] / cnt, ph[2] / cnt, ph[3] / cnt, ph[4] / cnt, ph[5] / cnt, skew / cnt,
                    late / cnt, late_own / cnt);
    }
    const double cyc = at(0, d.L - 1, 3, 7) - at(0, 1, 0, 7), ns = at(0, d.L - 1, 3, 0) - at(0, 1, 0, 0);
    std::printf("  SM clock over the step: %.3f GHz\n", cyc / ns);
}

template <int EPT> static void run(const Dims &d, int sms, int only_mode) {
    Model m = {};
    m.H = d.H;
    m.I = d.I;
    m.Q = d.Q;
    m.L = d.L;
    const size_t per[4] = {(size_t)d.Q * d.H, (size_t)d.H * d.H, (size_t)2 * d.I * d.H, (size_t)d.H * d.I};
    const int Ks[4] = {d.H, d.H, d.H, d.I};
    double bytes = 0;
    for (int p = 0; p < 4; ++p) {
        __nv_bfloat16 *w;
        CHECK(cudaMalloc(&w, per[p] * d.L * 2));
        init_w<<<1024, 256>>>(w, p, d.L, per[p], Ks[p]);
        CHECK(cudaGetLastError());
        m.w[p] = w;
        m.layer_elems[p] = per[p];
        bytes += per[p] * 2.0;
    }
    CHECK(cudaMalloc(&m.qkv, d.Q * 8));
    CHECK(cudaMalloc(&m.ha, d.H * 8));
    CHECK(cudaMalloc(&m.act, d.I * 8));
    CHECK(cudaMalloc(&m.hb, d.H * 8));
    CHECK(cudaMemset(m.qkv, 0, d.Q * 8));
    CHECK(cudaMemset(m.ha, 0, d.H * 8));
    CHECK(cudaMemset(m.act, 0, d.I * 8));
    CHECK(cudaMemset(m.hb, 0, d.H * 8));
    float *h0;
    std::vector<float> h0h(d.H);
    for (int i = 0; i < d.H; ++i) h0h[i] = std::sin(0.37f * i + 0.1f);
    CHECK(cudaMalloc(&h0, d.H * 4));
    CHECK(cudaMemcpy(h0, h0h.data(), d.H * 4, cudaMemcpyHostToDevice));
    m.h0 = h0;
    CHECK(cudaMalloc(&m.err, 4));
    CHECK(cudaMemset(m.err, 0, 4));
    CHECK(cudaMalloc(&m.stamps, (size_t)sms * d.L * 4 * NSTAMP * 8));
    CHECK(cudaMemset(m.stamps, 0, (size_t)sms * d.L * 4 * NSTAMP * 8));
    CHECK(cudaDeviceSynchronize());

    const int maxk = std::max(d.H, d.I);
    int optin;
    CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    const int statics = (MAXROWS + MAXH + CW) * 4 + 2 * 16 * 8 + 1024;  // and some slack
    const int ns = std::min(16, (optin - maxk * 4 - statics) / SLOT);
    const int dyn = ns * SLOT + maxk * 4;
    CHECK(cudaFuncSetAttribute(layers<EPT>, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn));
    for (int p = 0; p < 4; ++p) {
        const int rows = p == QKV ? d.Q : p == GU ? d.I : d.H, mult = p == GU ? 2 : 1;
        if (mult * ((rows + sms - 1) / sms) > MAXROWS || (d.H + sms - 1) / sms > MAXH || Ks[p] * 2 > SLOT) {
            std::printf("%s: shape too large for this kernel\n", d.name);
            return;
        }
    }
    unsigned base = 1;
    auto launch = [&](int steps, int mode) {
        void *args[] = {&m, &steps, &base, &mode, const_cast<int *>(&ns)};
        CHECK(cudaLaunchCooperativeKernel((void *)layers<EPT>, sms, THREADS, args, dyn, 0));
        base += (unsigned)(steps * d.L) + 1;
    };
    auto check_err = [&](const char *what) {
        CHECK(cudaDeviceSynchronize());
        unsigned e;
        CHECK(cudaMemcpy(&e, m.err, 4, cudaMemcpyDeviceToHost));
        if (e) {
            std::printf("%s %s: a wait timed out\n", d.name, what);
            std::exit(1);
        }
    };

    // The check: one step against the host.
    launch(1, FULL);
    check_err("check");
    {
        std::vector<std::vector<float>> w(4);
        for (int p = 0; p < 4; ++p) {
            std::vector<__nv_bfloat16> raw(per[p] * d.L);
            CHECK(cudaMemcpy(raw.data(), m.w[p], raw.size() * 2, cudaMemcpyDeviceToHost));
            w[p].resize(raw.size());
            for (size_t i = 0; i < raw.size(); ++i) w[p][i] = __bfloat162float(raw[i]);
        }
        std::vector<double> h(h0h.begin(), h0h.end());
        reference(d, w, h);
        std::vector<unsigned long long> got(d.H);
        CHECK(cudaMemcpy(got.data(), m.hb, d.H * 8, cudaMemcpyDeviceToHost));
        double worst = 0, scale = 0;
        unsigned flags_ok = 1;
        for (int i = 0; i < d.H; ++i) {
            scale = std::max(scale, std::fabs(h[i]));
            float gv;
            const unsigned bits = (unsigned)got[i];
            std::memcpy(&gv, &bits, 4);
            worst = std::max(worst, std::fabs((double)gv - h[i]));
            flags_ok &= (unsigned)(got[i] >> 32) == base - 1;
        }
        std::printf("%s check: %d layers, max |err| %.3e of max |h| %.3e (rel %.2e, tol 1e-3), flags %s -> %s\n",
                    d.name, d.L, worst, scale, worst / scale, flags_ok ? "ok" : "WRONG",
                    worst / scale < 1e-3 && flags_ok ? "PASS" : "FAIL");
    }

    const char *names[] = {"full", "no-handoff", "no-weights", "chain"};
    for (int mode = 0; mode < 4; ++mode) {
        if (only_mode >= 0 && mode != only_mode) continue;
        const float ms = median_ms([&] { launch(STEPS, mode); }, REPS);
        check_err(names[mode]);
        const double us = ms * 1000.0 / (STEPS * d.L);
        std::printf("%s %-10s %7.2f us a layer (%d slots of %d KiB, %d blocks x %d threads; weights %.2f MB a layer",
                    d.name, names[mode], us, ns, SLOT / 1024, sms, THREADS, bytes / 1e6);
        if (mode <= NO_HANDOFF) std::printf(", %.2f TB/s", bytes / us / 1e6);  // the others read none
        std::printf(")\n");
        if (STAMPS && mode != NO_HANDOFF) print_stamps(d, sms, m.stamps);
    }
    for (int p = 0; p < 4; ++p) CHECK(cudaFree((void *)m.w[p]));
    for (auto *p : {m.qkv, m.ha, m.act, m.hb, m.stamps}) CHECK(cudaFree(p));
    CHECK(cudaFree(h0));
    CHECK(cudaFree(m.err));
}

// `pl` runs both models in every mode; `pl MODEL MODE` one model (135m or 1b) in one mode (0-3),
// after the check (for a profiler: the second launch is the mode's first).
int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : nullptr;
    const int only_mode = argc > 2 ? std::atoi(argv[2]) : -1;
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::printf("SMs %d, %d steps a launch, median of %d launches\n", sms, STEPS, REPS);
    if (!only || !std::strcmp(only, "135m")) run<(1536 + CT - 1) / CT>({"smollm2-135m", 576, 1536, 960, 30}, sms, only_mode);
    if (!only || !std::strcmp(only, "1b")) run<(8192 + CT - 1) / CT>({"llama3.2-1b", 2048, 8192, 3072, 16}, sms, only_mode);
    return 0;
}
