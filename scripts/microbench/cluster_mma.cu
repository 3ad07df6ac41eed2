// SmolLM2-135M's four projections a layer on one 16-block thread-block cluster, with
// tensor-core dot products (session 33). cluster_layer.cu (session 32) ran the same layer loop
// with FMA dot products at 24-37 us a layer, and its per-warp cycle sums (session 33, call 1)
// put 56-68% of a warp's cycles in the dot products and 3% in waiting for weights: on 16
// multiprocessors the FMA form cannot keep up with the weights (7.1 MB a layer). Here every
// dot product is an mma.sync.m16n8k16 (bf16 in, f32 accumulate): A is a 16-row tile of the
// weights, B holds the input x split into two bf16 halves, x_hi = bf16(x) in column 0 and
// x_lo = bf16(x - x_hi) in column 1 (the other six columns zero), so that a row's dot product
// is D[row][0] + D[row][1], with ~16 bits of x's mantissa kept. One instruction covers 256
// weights, against 32 for an FMA.
//
// A stand-alone CUDA program (not part of the build; the GPU machine has nvcc):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/cm scripts/microbench/cluster_mma.cu && /tmp/cm
//
// Layout: the work of a layer is units of 16 output rows (a tile): qkv 60 tiles and o 36 (K =
// H: 3 chunks each), g|u 96 (a gate tile and the same up tile: 6 chunks), down 36 (K = I: 8
// chunks); a chunk is 12 k-steps of a tile, 6144 bytes in mma-fragment order (lane l's 16 bytes
// of step s at s 512 + 16 l), so a lane's A fragment is one 16-byte shared-memory load without
// bank conflicts. The host packs, per block, every chunk the block consumes, in the order it
// consumes them (an engine would do this at load time), and assigns units to blocks (plan()'s
// `spread`: 0, largest first to the block with the fewest chunks so far over all
// layers; 1, each op's tiles to the blocks in turn) and, within a block and op, to the warps
// with the shortest lists. Each block has PW producer warps whose PL lanes each stream every
// (PW PL)-th of the block's chunks through S slots of shared memory with bulk copies (one
// mbarrier a chunk index mod 2S, so that a warp may run up to 2S chunks ahead of the oldest
// unlanded one; an empty mbarrier a slot, on which the consuming warp arrives), and NW consumer
// warps. An op's outputs go to every block's copy of the next op's input with st.async.v4
// (completing on that block's mbarrier for the buffer); before an op, the consumer warps wait
// for its input, turn it into B fragments in shared memory and meet at a named barrier, or,
// with PUSHF, receive the fragments ready-made. The result is checked against the
// double-precision host reference of smollm_layers.cuh.
//
// MODE 0: the layer as described; 1: no hand-off (no waits for inputs, no pushes: timing only);
// 2: the stream alone (the consumers wait for each chunk and free it, no dot products).
// cluster_pieces (call 13) spreads each op's chunks over all of a block's warps instead.
// Arguments: none (calls 9, 10 and 13's sets), `latest` (call 13's), `profile` (one form, for
// ncu), `--plans` (the host's plans only; no GPU needed). Session 33's figures and what they say:
// docs/PERF.md, "Session 33: tensor cores on one cluster".
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "check.cuh"
#include "smollm_layers.cuh"
#include "timing.cuh"

constexpr int C = 16;               // blocks of the cluster, one a multiprocessor
constexpr int STEPS = 12;           // k-steps (16 columns each) a chunk
constexpr int CHUNK = STEPS * 512;  // bytes a chunk
constexpr int TL = 10;              // the layer whose op times block 0's thread 0 records
constexpr unsigned END = 0xffffffffu;
constexpr int WLMAX = 64;  // entries a warp's work list, at most (END included)

// Chunks a unit of op `op` (0 qkv, 1 o, 2 g|u, 3 down), tiles an op, and its row length K.
__host__ __device__ constexpr int unit_chunks(int op) { return op == 2 ? 6 : op == 3 ? 8 : 3; }
__host__ __device__ constexpr int op_tiles(int op) { return (op == 0 ? Q : op == 2 ? I : H) / 16; }
__host__ __device__ constexpr int op_k(int op) { return op == 3 ? I : H; }
// Where op `op`'s input fragments start in xf (lanes 0-7 of each k-step: 8 uint2).
__host__ __device__ constexpr int xf_off(int op) { return op < 3 ? op * (H / 16) * 8 : 3 * (H / 16) * 8; }
constexpr int XF = 3 * (H / 16) * 8 + (I / 16) * 8;

// A warp's work-list entry: the layer (bits 25-29), the op (23-24), the tile (16-22) and the
// unit's first chunk in the block's stream (0-15); END closes the list.
__host__ __device__ constexpr unsigned entry(int l, int op, int tile, int chunk) {
    return (unsigned)l << 25 | (unsigned)op << 23 | (unsigned)tile << 16 | (unsigned)chunk;
}

// D += A B for one m16n8k16 tile (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void mma16816(float (&d)[4], uint4 a, uint2 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned *>(&v);
}

// Entry q of an input's B fragments (k-step q / 8, lane l = q % 8 < 8): x_hi (l < 4) or x_lo
// (4 <= l < 8) at columns 2t, 2t + 1, 2t + 8, 2t + 9 of the step (t = l % 4).
__device__ __forceinline__ uint2 frag_entry(const float *x, int q) {
    const int k = (q >> 3) * 16 + 2 * (q & 3);
    float v[4] = {x[k], x[k + 1], x[k + 8], x[k + 9]};
    if (q & 4)
        for (float &t : v) t -= __bfloat162float(__float2bfloat16_rn(t));
    return make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
}

// Thread 0: the ring's mbarriers (one arrival each): full[2S] and empty[S].
template <int S> __device__ __forceinline__ void init_ring(unsigned long long *full, unsigned long long *empty) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < 2 * S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&full[s])) : "memory");
        for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&empty[s])) : "memory");
    }
}

// PUSHF's hand-off of one tile (by a whole warp; `st` holds its 16 output values): lanes 0-7
// turn them into the next op's B fragments for k-step `tile` (entry l: x_hi (l < 4) or x_lo of
// rows 2t, 2t + 1, 2t + 8, 2t + 9, t = l % 4) in `stf`; then lane j sends half j / 16 of them
// (and of the f32 values, for xb and xa) to block j % 16, completing on its ibar[op]. The k and v
// tiles of qkv (tile >= H / 16) go to kvf.
__device__ __forceinline__ void push_frags(const float *st, uint2 *stf, int op, int tile, float *xa, float *xb, uint2 *xf,
                                           uint2 *kvf, unsigned long long *ibar) {
    const int lane = threadIdx.x & 31;
    if (lane < 8) stf[lane] = frag_entry(st, lane);  // k-step 0 of the 16 values
    __syncwarp();
    const int nop = (op + 1) & 3, half = lane >> 4, dst = lane & 15;
    unsigned bar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar) : "r"(saddr(&ibar[op])), "r"(dst));
    uint2 *to = op == 0 && tile >= H / 16 ? kvf + (tile - H / 16) * 8 : xf + xf_off(nop) + tile * 8;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const uint4 v = *reinterpret_cast<const uint4 *>(&stf[4 * half + 2 * q]);
        unsigned a;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(saddr(to + 4 * half + 2 * q)), "r"(dst));
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(a), "r"(v.x),
                     "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
                     : "memory");
    }
    if (op == 1 || op == 3) {
        float *buf = op == 1 ? xb : xa;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int r = 8 * half + 4 * q;
            const float4 v = *reinterpret_cast<const float4 *>(&st[r]);
            unsigned a;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(saddr(buf + tile * 16 + r)), "r"(dst));
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(a), "f"(v.x),
                         "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
                         : "memory");
        }
    }
}

// The producers' loop (PW warps, PL issuing lanes each: issuer q = PL (warp - NW) + lane): the
// block's chunks q, q + NQ, ... in order, chunk i into slot i % S once chunk i - S has been
// consumed (empty[i % S]), landing on full[i % 2S]. NQ divides S, so one issuer owns each slot
// and its barriers and waits for their phases in order.
template <int NW, int S, int PW, int PL, bool SPIN>
__device__ __forceinline__ void produce(const uint4 *src, int total, unsigned char *ring, unsigned long long *full,
                                        unsigned long long *empty) {
    constexpr int NQ = PW * PL;
    static_assert(S % NQ == 0, "one issuer a slot");
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane < PL) {
        for (int i = (w - NW) * PL + lane; i < total; i += NQ) {
            const int s = i % S;
            if (i >= S) wait_parity<false, SPIN>(saddr(&empty[s]), (i / S - 1) & 1, 100000 + i);
            bulk_load(saddr(ring + s * CHUNK), src + (size_t)i * (CHUNK / 16), CHUNK, saddr(&full[i % (2 * S)]));
        }
    }
    __syncwarp();
}

// SPIN (call 10): every mbarrier wait polls with test_wait instead of try_wait.
// PUSHF (call 5): each unit pushes its 16 outputs as the next op's B fragments (k-step = its
// tile; f32 values too where the next op needs them: RMSNorm and the residual), so no block
// converts its input nor meets at a named barrier.
template <int NW, int S, int MODE, int PW = 1, int PL = 1, bool TM = false, bool PUSHF = false, bool SPIN = false>
__global__ void __launch_bounds__((NW + PW) * 32, 1)
    cluster_mma(const uint4 *packed, size_t block_chunks, const int *counts, const unsigned *work, int work_stride,
                const float *x0, float *out, unsigned long long *ns, unsigned long long *tl, unsigned long long *regions) {
    extern __shared__ __align__(128) unsigned char ring[];  // S slots of CHUNK bytes
    __shared__ __align__(16) float xa[H], xb[H], qo[PUSHF ? 4 : Q], hh[PUSHF ? 4 : I];
    __shared__ __align__(16) uint2 xf[XF];
    __shared__ __align__(16) float stage[NW][16];
    __shared__ __align__(16) uint2 stagef[NW][8];
    // PUSHF: the k and v rows of qkv (tiles H / 16 ..), sent like the q rows but unused (the
    // attention is left out), so that o waits for every qkv tile as the attention would: a
    // warp whose tiles nothing waits for could fall a layer behind and stall its block's ring
    // (call 6 hung so).
    __shared__ __align__(16) uint2 kvf[PUSHF ? (Q - H) / 16 * 8 : 2];
    __shared__ unsigned wl[NW][WLMAX];  // the warps' work lists
    __shared__ __align__(8) unsigned long long full[2 * S], empty[S], ibar[4];  // ibar: 0 qo, 1 xb, 2 hh, 3 xa
    unsigned b;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(b));
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    // Bytes a phase of each input buffer's mbarrier (PUSHF: 64 bytes of fragments a tile, and
    // the f32 values of xb and xa).
    const unsigned bytes_in[4] = {PUSHF ? Q / 16 * 64 : Q * 4, PUSHF ? 2 * H * 4 : H * 4, PUSHF ? I / 16 * 64 : I * 4,
                                  PUSHF ? 2 * H * 4 : H * 4};
    unsigned long long g0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    for (int k = threadIdx.x; k < H; k += blockDim.x) xa[k] = x0[k];
    for (int k = threadIdx.x; k < NW * work_stride; k += blockDim.x) wl[k / work_stride][k % work_stride] = work[b * NW * work_stride + k];
    if (PUSHF) {
        // Layer 0's qkv input as B fragments (later layers' come with the down projection's pushes).
        for (int q = threadIdx.x; q < H / 16 * 8; q += blockDim.x) xf[q] = frag_entry(x0, q);
    }
    init_ring<S>(full, empty);
    arm_inputs_and_sync(ibar, bytes_in);

    if (w >= NW) {
        // (MODE 1 keeps no order between a block's warps but the named barrier: PUSHF has none.)
        static_assert(!(MODE == 1 && PUSHF), "MODE 1 needs the named barrier");
        produce<NW, S, PW, PL, SPIN>(packed + b * block_chunks * (CHUNK / 16), counts[b], ring, full, empty);
    } else {
        // TM: lane 0's clock64 cycles in each region (0 waiting for the op's input, 1 its RMS, B
        // fragments and named barrier, 2 waiting for weight chunks, 3 dot products and epilogue,
        // 4 pushes), written to regions[(b NW + w) 6 + k] with the loop's total in k = 5. The
        // split is approximate: the timer reads are no ordering barrier (clock64 has no memory
        // clobber, the mma asm is not volatile), so the compiler may move work across them (the
        // no-hand-off form, which pushes nothing, books 17-59% to region 4), and a warp with
        // two tiles in an op would book its first tile's push to region 3 (the committed plans
        // give a warp at most one tile an op).
        unsigned long long tm[5] = {0, 0, 0, 0, 0};
        long long t_last = clock64();
        const long long t_loop0 = t_last;
        auto lap = [&](int k) {
            if (TM) {
                const long long t = clock64();
                tm[k] += t - t_last;
                t_last = t;
            }
        };
        const unsigned *my = wl[w];
        int ei = 0;
        unsigned e = my[0];
        unsigned long long *tlp = tl;
        auto stamp = [&](int l) {
            if ((l == TL || l == TL + 1) && b == 0 && threadIdx.x == 0) {
                unsigned long long t;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                *tlp++ = t;
            }
        };
        // Waits for buffer k's phase `ph`; thread 0 then arms its next phase. No block can
        // complete that phase before this block's later outputs exist, which every warp here
        // computes only after it has waited for phase ph (every warp waits every phase in
        // order; without PUSHF the op's named barrier also holds them together). Bytes of the
        // next phase that land before the arming leave its tx-count negative for that while,
        // which the mbarrier allows.
        auto ready = [&](int k, int ph) {
            wait_parity<true, SPIN>(saddr(&ibar[k]), ph & 1, 200000 + 1000 * k + ph);
            if (threadIdx.x == 0)
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&ibar[k])), "r"(bytes_in[k]) : "memory");
        };
        auto rms = [&](const float *x) {
            float s = 0.0f;
            for (int c = lane; c < H; c += 32) s += x[c] * x[c];
            return rsqrtf(warp_sum(s) * (1.0f / H) + EPS);
        };
        // The dot products of one chunk (stream index i) into acc (four accumulators, one a
        // k-step mod 4, so that consecutive mma.sync do not wait on each other).
        auto chunk = [&](int i, const uint2 *xfk, float (&acc)[4][4]) {
            const int s = i % S;
            lap(3);
            wait_parity<false, SPIN>(saddr(&full[i % (2 * S)]), (i / (2 * S)) & 1, 300000 + i);
            lap(2);
            if (MODE != 2) {
                const uint4 *a = reinterpret_cast<const uint4 *>(ring + s * CHUNK) + lane;
#pragma unroll
                for (int st = 0; st < STEPS; ++st) {
                    const uint2 bf = lane < 8 ? xfk[st * 8 + lane] : make_uint2(0u, 0u);
                    mma16816(acc[st & 3], a[st * 32], bf);
                }
            }
            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(&empty[s])) : "memory");
        };
        // Lane 4g's rows g and g + 8 of the tile: the column-0 (x_hi) plus column-1 (x_lo) sums.
        auto rows_of = [](float (&acc)[4][4], float &r0, float &r1) {
            r0 = (acc[0][0] + acc[1][0]) + (acc[2][0] + acc[3][0]) + (acc[0][1] + acc[1][1]) + (acc[2][1] + acc[3][1]);
            r1 = (acc[0][2] + acc[1][2]) + (acc[2][2] + acc[3][2]) + (acc[0][3] + acc[1][3]) + (acc[2][3] + acc[3][3]);
        };
        for (int l = 0; l < L; ++l) {
            for (int op = 0; op < 4; ++op) {
                const int kin = (op + 3) & 3;  // the buffer op reads: xa, qo, xb, hh
                lap(4);
                const bool mine = e != END && (e >> 23) == (unsigned)(l << 2 | op);
                // Every warp waits for every phase of every input, in order, whether or not it has
                // units in the op: a parity wait is only sound if the phase before the awaited one
                // is known complete (call 7: warps that skipped the ops they had no units in ran
                // ahead on a stale parity and hung the rings).
                if (MODE == 0 && (l > 0 || op > 0)) ready(kin, op == 0 ? l - 1 : l);
                lap(0);
                stamp(l);
                const float *x = op == 0 ? xa : op == 1 ? qo : op == 2 ? xb : hh;
                const float sc = (op == 0 || op == 2) && (!PUSHF || mine) ? rms(x) : 1.0f;
                uint2 *xo = xf + xf_off(op);
                if (!PUSHF) {
                // x as B fragments (frag_entry), by the block's consumer threads together.
                for (int q = threadIdx.x; q < op_k(op) / 16 * 8; q += NW * 32) xo[q] = frag_entry(x, q);
                asm volatile("bar.sync 1, %0;" ::"r"(NW * 32) : "memory");
                }
                lap(1);
                while (e != END && (e >> 23) == (unsigned)(l << 2 | op)) {
                    const int tile = (e >> 16) & 127, c0 = e & 0xffff;
                    float r0, r1;  // this lane's rows' values (lanes 4g)
                    if (op == 2) {
                        float ga[4][4] = {}, ua[4][4] = {};
                        for (int c = 0; c < 3; ++c) {
                            chunk(c0 + 2 * c, xo + c * STEPS * 8, ga);
                            chunk(c0 + 2 * c + 1, xo + c * STEPS * 8, ua);
                        }
                        float g0r, g1r, u0r, u1r;
                        rows_of(ga, g0r, g1r);
                        rows_of(ua, u0r, u1r);
                        g0r *= sc, g1r *= sc, u0r *= sc, u1r *= sc;
                        r0 = __fdividef(g0r, 1.0f + __expf(-g0r)) * u0r;
                        r1 = __fdividef(g1r, 1.0f + __expf(-g1r)) * u1r;
                    } else {
                        float acc[4][4] = {};
                        const int n = unit_chunks(op);
                        for (int c = 0; c < n; ++c) chunk(c0 + c, xo + c * STEPS * 8, acc);
                        rows_of(acc, r0, r1);
                        const int row = tile * 16 + (lane >> 2);
                        if (op == 0) r0 *= sc, r1 *= sc;
                        if (op == 1) r0 += xa[row], r1 += xa[row + 8];
                        if (op == 3) r0 += xb[row], r1 += xb[row + 8];
                    }
                    if ((lane & 3) == 0) {
                        stage[w][lane >> 2] = r0;
                        stage[w][(lane >> 2) + 8] = r1;
                    }
                    __syncwarp();
                    lap(3);
                    if (MODE == 0 && PUSHF) {
                        push_frags(stage[w], stagef[w], op, tile, xa, xb, xf, kvf, ibar);
                    } else if (MODE == 0) {
                        // Lane j: rows 8 (j / 16) .. + 7 of the tile to block j % 16.
                        float *buf = op == 0 ? qo : op == 1 ? xb : op == 2 ? hh : xa;
                        const int half = lane >> 4;
                        unsigned bar;
                        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar) : "r"(saddr(&ibar[op])), "r"(lane & 15));
#pragma unroll
                        for (int q = 0; q < 2; ++q) {
                            const int r = 8 * half + 4 * q;
                            const float4 v = *reinterpret_cast<const float4 *>(&stage[w][r]);
                            unsigned a;
                            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(saddr(buf + tile * 16 + r)), "r"(lane & 15));
                            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(a),
                                         "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
                                         : "memory");
                        }
                    } else if (lane == 0 && stage[w][0] == 1.2345f) {
                        out[0] = stage[w][1];  // (keeps the dot products alive in the timing modes)
                    }
                    __syncwarp();
                    e = my[++ei];
                }
            }
        }
        lap(4);
        if (MODE == 0) ready(3, L - 1);
        lap(0);
        if (TM && lane == 0) {
            unsigned long long *r = regions + (b * NW + w) * 6;
            for (int k = 0; k < 5; ++k) r[k] = tm[k];
            r[5] = clock64() - t_loop0;
        }
        stamp(TL + 1);
        if (b == 0 && MODE == 0)
            for (int k = threadIdx.x; k < H; k += NW * 32) out[k] = xa[k];
    }
    unsigned long long g1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
    if (threadIdx.x == 0) ns[b] = g1 - g0;
    // No block exits while another may still store into its shared memory.
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Pieces (call 13): a warp's unit of work is one chunk (a piece) of a tile instead of the whole
// tile: each op's chunks in a block go to the block's warps in turn (piece p of the op to warp
// p % NW), so every warp works on every op and no warp runs a tile's chunks one after another.
// Each piece's 16 partial sums are added into the tile's slot in shared memory (atomicAdd); the
// warp that adds a tile's last piece (a counter per slot) finishes the tile (RMSNorm scale,
// residual, SiLU) and pushes it as PUSHF does. The sums' order varies with timing (not
// bit-reproducible). Every warp waits for every op's input in order (the parity rule above).
// Work-list entry: layer (27-31), op (25-26), slot (22-24: the tile's place in the block's
// op), tile (15-21), piece within the tile (12-14), chunk index in the block's stream (0-11).
constexpr int MAXU = 8;  // a block's tiles in one op, at most
__host__ __device__ constexpr unsigned piece_entry(int l, int op, int slot, int tile, int c, int chunk) {
    return (unsigned)l << 27 | (unsigned)op << 25 | (unsigned)slot << 22 | (unsigned)tile << 15 | (unsigned)c << 12 | (unsigned)chunk;
}
template <int NW, int S, int PW, bool SPIN = false>
__global__ void __launch_bounds__((NW + PW) * 32, 1)
    cluster_pieces(const uint4 *packed, size_t block_chunks, const int *counts, const unsigned *work, int work_stride,
                   const float *x0, float *out, unsigned long long *ns, unsigned long long *tl, unsigned long long *) {
    extern __shared__ __align__(128) unsigned char ring[];  // S slots of CHUNK bytes
    __shared__ __align__(16) float xa[H], xb[H];
    __shared__ __align__(16) uint2 xf[XF];
    __shared__ __align__(16) float stage[NW][16];
    __shared__ __align__(16) uint2 stagef[NW][8];
    __shared__ __align__(16) uint2 kvf[(Q - H) / 16 * 8];
    __shared__ float part[4][MAXU][2][16];  // per op and slot: the gate (or only) and up sums
    __shared__ unsigned cnt[4][MAXU];       // per op and slot: pieces added
    __shared__ __align__(8) unsigned long long full[2 * S], empty[S], ibar[4];  // ibar: 0 qo, 1 xb, 2 hh, 3 xa
    unsigned b;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(b));
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const unsigned bytes_in[4] = {Q / 16 * 64, 2 * H * 4, I / 16 * 64, 2 * H * 4};
    unsigned long long g0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    for (int k = threadIdx.x; k < H; k += blockDim.x) xa[k] = x0[k];
    for (int k = threadIdx.x; k < 4 * MAXU * 2 * 16; k += blockDim.x) (&part[0][0][0][0])[k] = 0.0f;
    for (int k = threadIdx.x; k < 4 * MAXU; k += blockDim.x) (&cnt[0][0])[k] = 0u;
    for (int q = threadIdx.x; q < H / 16 * 8; q += blockDim.x) xf[q] = frag_entry(x0, q);  // layer 0's qkv input
    init_ring<S>(full, empty);
    arm_inputs_and_sync(ibar, bytes_in);

    if (w >= NW) {
        produce<NW, S, PW, 1, SPIN>(packed + b * block_chunks * (CHUNK / 16), counts[b], ring, full, empty);
    } else {
        // The work list, 32 entries at a time in the lanes' registers (the next 32 loaded ahead).
        const unsigned *my = work + (b * NW + w) * work_stride;
        unsigned wcur = my[lane], wnext = my[32 + lane];
        int ei = 0;
        unsigned e = __shfl_sync(0xffffffffu, wcur, 0);
        auto advance = [&] {
            if ((++ei & 31) == 0) {
                wcur = wnext;
                wnext = my[ei + 32 + lane];  // the host pads each list with END past its last 64
            }
            e = __shfl_sync(0xffffffffu, wcur, ei & 31);
        };
        unsigned long long *tlp = tl;
        for (int l = 0; l < L; ++l) {
            for (int op = 0; op < 4; ++op) {
                if (l > 0 || op > 0) {
                    const int k = (op + 3) & 3;
                    wait_parity<true, SPIN>(saddr(&ibar[k]), (op == 0 ? l - 1 : l) & 1, 200000 + 1000 * k + l);
                    if (threadIdx.x == 0)
                        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&ibar[k])), "r"(bytes_in[k])
                                     : "memory");
                }
                if ((l == TL || l == TL + 1) && b == 0 && threadIdx.x == 0) {
                    unsigned long long t;
                    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                    *tlp++ = t;
                }
                const bool mine = e != END && (e >> 25) == (unsigned)(l << 2 | op);
                float sc = 1.0f;
                if (mine && (op == 0 || op == 2)) {
                    const float *x = op == 0 ? xa : xb;
                    float ss = 0.0f;
                    for (int c = lane; c < H; c += 32) ss += x[c] * x[c];
                    sc = rsqrtf(warp_sum(ss) * (1.0f / H) + EPS);
                }
                const uint2 *xo = xf + xf_off(op);
                while (e != END && (e >> 25) == (unsigned)(l << 2 | op)) {
                    const int slot = (e >> 22) & 7, tile = (e >> 15) & 127, c = (e >> 12) & 7, i = e & 0xfff;
                    const int half = op == 2 ? (c & 1) : 0, kc = op == 2 ? c >> 1 : c;
                    float acc[4][4] = {};
                    wait_parity<false, SPIN>(saddr(&full[i % (2 * S)]), (i / (2 * S)) & 1, 300000 + i);
                    const uint4 *a = reinterpret_cast<const uint4 *>(ring + (i % S) * CHUNK) + lane;
                    const uint2 *xk = xo + kc * STEPS * 8;
#pragma unroll
                    for (int st = 0; st < STEPS; ++st) mma16816(acc[st & 3], a[st * 32], lane < 8 ? xk[st * 8 + lane] : make_uint2(0u, 0u));
                    __syncwarp();
                    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(&empty[i % S])) : "memory");
                    // Lane 4g: rows g and g + 8 (the x_hi column plus the x_lo column).
                    const float r0 = (acc[0][0] + acc[1][0]) + (acc[2][0] + acc[3][0]) + (acc[0][1] + acc[1][1]) + (acc[2][1] + acc[3][1]);
                    const float r1 = (acc[0][2] + acc[1][2]) + (acc[2][2] + acc[3][2]) + (acc[0][3] + acc[1][3]) + (acc[2][3] + acc[3][3]);
                    float *ps = part[op][slot][half];
                    if ((lane & 3) == 0) {
                        atomicAdd(&ps[lane >> 2], r0);
                        atomicAdd(&ps[(lane >> 2) + 8], r1);
                    }
                    __syncwarp();
                    // The tile's last piece: its adds, and every other warp's (each fenced before
                    // its counter increment), are visible after the fence that follows the count.
                    unsigned last = 0;
                    if (lane == 0) {
                        __threadfence_block();
                        last = atomicAdd(&cnt[op][slot], 1u) == (unsigned)unit_chunks(op) - 1u;
                        __threadfence_block();
                    }
                    last = __shfl_sync(0xffffffffu, last, 0);
                    if (last) {
                        __syncwarp();
                        if (lane < 16) {
                            const int row = tile * 16 + lane;
                            float v;
                            if (op == 2) {
                                const float g = part[2][slot][0][lane] * sc, u = part[2][slot][1][lane] * sc;
                                v = __fdividef(g, 1.0f + __expf(-g)) * u;
                                part[2][slot][1][lane] = 0.0f;
                            } else {
                                v = part[op][slot][0][lane];
                                if (op == 0) v *= sc;
                                if (op == 1) v += xa[row];
                                if (op == 3) v += xb[row];
                            }
                            part[op][slot][0][lane] = 0.0f;  // for the same op of the next layer
                            stage[w][lane] = v;
                        }
                        if (lane == 0) cnt[op][slot] = 0u;
                        __syncwarp();
                        push_frags(stage[w], stagef[w], op, tile, xa, xb, xf, kvf, ibar);
                        __syncwarp();
                    }
                    advance();
                }
            }
        }
        wait_parity<true, SPIN>(saddr(&ibar[3]), (L - 1) & 1, 203000 + L);
        if (b == 0)
            for (int k = threadIdx.x; k < H; k += NW * 32) out[k] = xa[k];
    }
    unsigned long long g1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
    if (threadIdx.x == 0) ns[b] = g1 - g0;
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <int NW_, int S_, int MODE_, int PW_ = 1, int PL_ = 1, bool TM_ = false, bool PUSHF_ = false, bool SPIN_ = false>
struct Form {
    static constexpr int nw = NW_, slots = S_, mode = MODE_, pw = PW_, pl = PL_;
    static constexpr bool timed = TM_;
    static constexpr auto kernel = cluster_mma<NW_, S_, MODE_, PW_, PL_, TM_, PUSHF_, SPIN_>;
    static constexpr bool pieces = false;
};
template <int NW_, int S_, int PW_, bool SPIN_ = false> struct Pieces {
    static constexpr int nw = NW_, slots = S_, mode = 0, pw = PW_, pl = 1;
    static constexpr bool timed = false, pieces = true;
    static constexpr auto kernel = cluster_pieces<NW_, S_, PW_, SPIN_>;
};

// The host's plan: which block and warp computes each unit of each layer, and each block's
// chunks in the order it consumes them.
struct Plan {
    std::vector<std::vector<unsigned>> work;        // [C * NW] lists, END-terminated
    std::vector<std::vector<std::pair<int, int>>> chunks;  // per block: (layer, unit id) a chunk, in order
    std::vector<std::vector<int>> chunk_part;        // per block: the chunk's index within its unit
    std::vector<int> counts;                         // chunks a block
};
struct Unit {
    int op, tile;
};

// The op of unit id u (units listed largest first: down, g|u, qkv, o).
static int units_op(int u) {
    for (int op : {3, 2, 0, 1}) {
        if (u < op_tiles(op)) return op;
        u -= op_tiles(op);
    }
    return -1;
}

// spread 0: each layer's units largest first, each to the block with the fewest chunks so far
// (over all layers); 1: each op's tiles to the blocks in turn, the turn carried over from op to
// op and layer to layer (each op's tiles within one of even over the blocks).
// pieces: the work lists of cluster_pieces (a chunk an entry, each op's chunks in a block to
// its warps in turn).
static Plan plan(int nw, int spread, bool pieces = false) {
    Plan p;
    // The work-list entries' fields (entry(), piece_entry()) must hold every value.
    static_assert(L <= 32 && Q / 16 <= 128 && I / 16 <= 128, "an entry's layer or tile field is too narrow");
    auto fits = [&](int chunk) {
        if (chunk < (pieces ? 1 << 12 : 1 << 16)) return true;
        std::printf("plan: chunk %d does not fit an entry's chunk field\n", chunk);
        return false;
    };
    p.work.assign(C * nw, {});
    p.chunks.assign(C, {});
    p.chunk_part.assign(C, {});
    std::vector<Unit> units;
    for (int op : {3, 2, 0, 1})  // largest first
        for (int t = 0; t < op_tiles(op); ++t) units.push_back({op, t});
    std::vector<long> load(C, 0);
    std::vector<int> next_piece(C, 0);
    int turn = 0;
    for (int l = 0; l < L; ++l) {
        std::vector<std::vector<int>> mine(C);  // unit ids a block
        for (int u = 0; u < (int)units.size(); ++u) {
            const int blk = spread == 1 ? turn++ % C : (int)(std::min_element(load.begin(), load.end()) - load.begin());
            mine[blk].push_back(u);
            load[blk] += unit_chunks(units[u].op);
        }
        for (int blk = 0; blk < C; ++blk) {
            for (int op = 0; op < 4 && pieces; ++op) {
                int slot = 0;
                int &piece = next_piece[blk];  // the turn carries over from op to op
                for (int u : mine[blk]) {
                    if (units[u].op != op) continue;
                    if (slot >= MAXU) {
                        std::printf("plan: more than %d tiles of op %d in block %d\n", MAXU, op, blk);
                        return Plan{};  // (empty: run() skips the form)
                    }
                    for (int c = 0; c < unit_chunks(op); ++c) {
                        if (!fits((int)p.chunks[blk].size())) return Plan{};
                        p.work[blk * nw + piece++ % nw].push_back(piece_entry(l, op, slot, units[u].tile, c, (int)p.chunks[blk].size()));
                        p.chunks[blk].push_back({l, u});
                        p.chunk_part[blk].push_back(c);
                    }
                    ++slot;
                }
            }
            for (int op = 0; op < 4 && !pieces; ++op) {
                // Each unit to the warp with the shortest list among those with no unit of this
                // op yet (all again once every warp has one).
                std::vector<bool> used(nw, false);
                for (int u : mine[blk]) {
                    if (units[u].op != op) continue;
                    if (std::find(used.begin(), used.end(), false) == used.end()) used.assign(nw, false);
                    int best = -1;
                    for (int ww = 0; ww < nw; ++ww)
                        if (!used[ww] && (best < 0 || p.work[blk * nw + ww].size() < p.work[blk * nw + best].size())) best = ww;
                    used[best] = true;
                    const int first = (int)p.chunks[blk].size();
                    if (!fits(first)) return Plan{};
                    p.work[blk * nw + best].push_back(entry(l, op, units[u].tile, first));
                    for (int c = 0; c < unit_chunks(op); ++c) {
                        p.chunks[blk].push_back({l, u});
                        p.chunk_part[blk].push_back(c);
                    }
                }
            }
        }
    }
    for (auto &v : p.work) v.push_back(END);
    for (int blk = 0; blk < C; ++blk) p.counts.push_back((int)p.chunks[blk].size());
    return p;
}

int main(int argc, char **argv) {
    // --plans: the host's plans only (no GPU needed): work-list lengths and chunk counts.
    if (argc > 1 && std::string(argv[1]) == "--plans") {
        for (int nw : {8, 16})
            for (int spread : {0, 1}) {
                const Plan p = plan(nw, spread);
                const Plan pp = plan(nw, spread, true);
                if (p.counts.empty() || pp.counts.empty()) continue;
                size_t pmax = 0;
                for (auto &v : pp.work) pmax = std::max(pmax, v.size());
                size_t wmax = 0;
                for (auto &v : p.work) wmax = std::max(wmax, v.size());
                std::printf("%2d warps, spread %d: work lists up to %zu entries (limit %d; pieces %zu), chunks a block %d-%d\n", nw,
                            spread, wmax, WLMAX, pmax, *std::min_element(p.counts.begin(), p.counts.end()),
                            *std::max_element(p.counts.begin(), p.counts.end()));
            }
        return 0;
    }
    const HostLayers m = make_layers();
    const double wbytes = 2.0 * L * ((double)Q * H + (double)H * H + 2.0 * I * H + (double)H * I);
    std::printf("weights %.1f MB a launch (%d layers)\n", wbytes / 1e6, L);

    float *dx0, *dout;
    unsigned long long *dns, *dtl;
    CHECK(cudaMalloc(&dx0, H * 4));
    CHECK(cudaMalloc(&dout, H * 4));
    CHECK(cudaMalloc(&dns, 64 * 8));
    CHECK(cudaMalloc(&dtl, 64 * 8));
    unsigned long long *dreg;
    CHECK(cudaMalloc(&dreg, C * 32 * 6 * 8));
    CHECK(cudaMemcpy(dx0, m.x0.data(), H * 4, cudaMemcpyHostToDevice));

    // One form (a Form<...>: the kernel and its launch shape from one list of template
    // arguments), its units spread by `spread` (see plan()).
    auto run = [&](auto form, const char *what, int spread) {
        using F = decltype(form);
        const auto kern = F::kernel;
        const int nw = F::nw, slots = F::slots, mode = F::mode, pw = F::pw, pl = F::pl;
        const bool timed = F::timed;
        const Plan p = plan(nw, spread, F::pieces);
        if (p.counts.empty()) {
            std::printf("%s: no plan; not run\n", what);
            return;
        }
        // A warp may wait for a chunk up to 2S chunks past the first chunk of its op (full
        // barriers by chunk index mod 2S): no block's op may hold more.
        for (int blk = 0; blk < C; ++blk) {
            int run_len = 0;
            for (int i = 0; i < p.counts[blk]; ++i) {
                const bool same = i > 0 && p.chunks[blk][i].first == p.chunks[blk][i - 1].first &&
                                  units_op(p.chunks[blk][i].second) == units_op(p.chunks[blk][i - 1].second);
                run_len = same ? run_len + 1 : 1;
                if (run_len > 2 * slots) {
                    std::printf("%s: a block's op holds more than %d chunks; not run\n", what, 2 * slots);
                    return;
                }
            }
        }
        const int maxc = *std::max_element(p.counts.begin(), p.counts.end());
        const int minc = *std::min_element(p.counts.begin(), p.counts.end());
        // Pack every block's chunks: lane l's 16 bytes of k-step s of a tile at rows r0 = 16 tile
        // + l / 4 and r1 = r0 + 8, columns k = 16 (K-step) + 2 (l % 4): W[r0][k, k+1],
        // W[r1][k, k+1], W[r0][k+8, k+9], W[r1][k+8, k+9] (the m16n8k16 A fragment).
        std::vector<__nv_bfloat16> pk((size_t)C * maxc * (CHUNK / 2));
        std::vector<Unit> units;
        for (int op : {3, 2, 0, 1})
            for (int t = 0; t < op_tiles(op); ++t) units.push_back({op, t});
        for (int blk = 0; blk < C; ++blk)
            for (int i = 0; i < p.counts[blk]; ++i) {
                const int l = p.chunks[blk][i].first, c = p.chunk_part[blk][i];
                const Unit u = units[p.chunks[blk][i].second];
                const int K = op_k(u.op), R = u.op == 0 ? Q : u.op == 2 ? I : H;
                const std::vector<__nv_bfloat16> &W = u.op == 0 ? m.q : u.op == 1 ? m.o : u.op == 2 ? (c & 1 ? m.u : m.g) : m.d;
                const int kc = u.op == 2 ? c / 2 : c;
                __nv_bfloat16 *dst = pk.data() + ((size_t)blk * maxc + i) * (CHUNK / 2);
                for (int st = 0; st < STEPS; ++st)
                    for (int ln = 0; ln < 32; ++ln) {
                        const int r0 = u.tile * 16 + ln / 4, r1 = r0 + 8, k = (kc * STEPS + st) * 16 + 2 * (ln % 4);
                        auto wt = [&](int r, int col) { return W[((size_t)l * R + r) * K + col]; };
                        __nv_bfloat16 *f = dst + st * 256 + ln * 8;
                        f[0] = wt(r0, k), f[1] = wt(r0, k + 1), f[2] = wt(r1, k), f[3] = wt(r1, k + 1);
                        f[4] = wt(r0, k + 8), f[5] = wt(r0, k + 9), f[6] = wt(r1, k + 8), f[7] = wt(r1, k + 9);
                    }
            }
        size_t stride = 0;
        for (auto &v : p.work) stride = std::max(stride, v.size());
        if (F::pieces) {
            stride = (stride + 31) / 32 * 32 + 64;  // cluster_pieces loads 32 entries ahead
        } else if (stride > WLMAX) {
            std::printf("%s: a work list of %zu entries (at most %d); not run\n", what, stride, WLMAX);
            return;
        }
        std::vector<unsigned> work(C * nw * stride, END);
        for (int i = 0; i < C * nw; ++i) std::copy(p.work[i].begin(), p.work[i].end(), work.begin() + i * stride);
        uint4 *dpk;
        unsigned *dwork;
        int *dcounts;
        CHECK(cudaMalloc(&dpk, pk.size() * 2));
        CHECK(cudaMalloc(&dwork, work.size() * 4));
        CHECK(cudaMalloc(&dcounts, C * 4));
        CHECK(cudaMemcpy(dpk, pk.data(), pk.size() * 2, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(dwork, work.data(), work.size() * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(dcounts, p.counts.data(), C * 4, cudaMemcpyHostToDevice));

        const int smem = slots * CHUNK;
        CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaLaunchAttribute at;
        const cudaLaunchConfig_t cfg = cluster_config(at, C, C, (nw + pw) * 32, smem);
        const LayersRun r = time_layers(
            [&] {
                CHECK(cudaLaunchKernelEx(&cfg, kern, (const uint4 *)dpk, (size_t)maxc, (const int *)dcounts, (const unsigned *)dwork,
                                         (int)stride, (const float *)dx0, dout, dns, dtl, dreg));
            },
            dout, dns, dtl, m.out);
        const double us = r.us, maxerr = r.maxerr, maxref = r.maxref;
        const unsigned long long *htl = r.tl;
        std::printf("%s: %2d consumer warps, %d x %2d issuers, %2d slots, spread %d, chunks a block %d-%d: kernel %.1f us (block 0, "
                    "median of 10), %.2f us a layer, %.0f GB/s",
                    what, nw, pw, pl, slots, spread, minc, maxc, us, us / L, wbytes / (us * 1e-6) / 1e9);
        if (mode == 0) std::printf("; max |err| %.3g of max |x| %.3g", maxerr, maxref);
        std::printf("\n");
        if (mode == 0) {
            std::printf("   layer %d, block 0 thread 0, us from each op's input to the next's (qkv, o, g|u, down):", TL);
            for (int k = 1; k < 5; ++k) std::printf(" %.2f", (htl[k] - htl[k - 1]) / 1e3);
            std::printf("\n");
        }
        if (timed) {
            // The last launch's per-warp cycle sums, as shares of the loop's cycles over all warps.
            std::vector<unsigned long long> reg(C * nw * 6);
            CHECK(cudaMemcpy(reg.data(), dreg, reg.size() * 8, cudaMemcpyDeviceToHost));
            double sum[6] = {};
            for (size_t i = 0; i < reg.size(); ++i) sum[i % 6] += (double)reg[i];
            std::printf("   consumer lane 0 cycles, share: input wait %.1f%%, rms+fragments+barrier %.1f%%, chunk waits %.1f%%, "
                        "dot products %.1f%%, pushes %.1f%%\n",
                        100 * sum[0] / sum[5], 100 * sum[1] / sum[5], 100 * sum[2] / sum[5], 100 * sum[3] / sum[5], 100 * sum[4] / sum[5]);
        }
        CHECK(cudaFree(dpk));
        CHECK(cudaFree(dwork));
        CHECK(cudaFree(dcounts));
    };
    // Call 2 (session 33): one issuing thread streamed 484 GB/s (stream only), the layer 17.3 us.
    // cluster_stream.cu's rings streamed ~12-16 GB/s an issuing warp whatever their depth, so:
    // more issuers (producer warps x issuing lanes).
    // Call 3: 4 producer warps of one issuer streamed 1224 GB/s (stream only, 5.78 us a layer);
    // the layer took 13.5 us at best. Call 4 (even spread, cycle sums): 11.85 us a layer, 61% of
    // the consumers' cycles waiting for inputs, 15% converting them and at the named barrier.
    // Call 5 (the work lists in shared memory, the fragments pushed: PUSHF) ran only its host
    // check (work lists over the limit); calls 6 and 7's PUSHF launches hung (6: its k and v
    // tiles had no waiter; 7: warps skipped the waits of ops they had no units in). Call 8:
    // PUSHF 11.17 us a layer (16 warps), 10.81 (8 warps), against 11.31 with the named barrier;
    // 75% of the consumers' cycles wait for inputs. Call 9: the ring's depth (fewer slots: is the
    // stream stalled by a full ring during the hand-offs?) and the layer without hand-offs.
    // `cluster_mma latest`: only the latest call's set (with the first line as its baseline).
    const bool latest = argc > 1 && std::string(argv[1]) == "latest";
    // `cluster_mma profile`: one form only (no hand-off, 8 warps), for Nsight Compute.
    if (argc > 1 && std::string(argv[1]) == "profile") {
        run(Form<8, 32, 1, 4, 1>{}, "no hand-off", 1);
        return 0;
    }
    run(Form<8, 32, 0, 4, 1, false, true>{}, "pushed fragments", 1);
    if (!latest) {
        run(Form<8, 24, 0, 4, 1, false, true>{}, "pushed fragments", 1);
        run(Form<8, 20, 0, 4, 1, false, true>{}, "pushed fragments", 1);
        run(Form<8, 32, 1, 4, 1, true>{}, "no hand-off", 1);
        run(Form<16, 32, 1, 4, 1, true>{}, "no hand-off", 1);
        run(Form<8, 32, 2, 4, 1>{}, "stream only", 1);
        run(Form<8, 20, 2, 4, 1>{}, "stream only", 1);
    }
    // Call 9: 10.77 us a layer at 32 slots, 11.70 at 24, 11.81 at 20; 9.14 without hand-offs;
    // the stream alone 5.67 (6.08 at 20 slots). Call 10: the waits never suspend (SPIN): 11.00.
    if (!latest) {
        run(Form<8, 32, 0, 4, 1, false, true, true>{}, "pushed frags, spin", 1);
        run(Form<16, 32, 0, 4, 1, true, true, true>{}, "pushed frags, spin", 1);
        run(Form<8, 32, 1, 4, 1, true, false, true>{}, "no hand-off, spin", 1);
    }
    // Call 13: pieces (cluster_pieces): every op's chunks over all of a block's warps.
    run(Pieces<8, 32, 4>{}, "pieces", 1);
    run(Pieces<16, 32, 4>{}, "pieces", 1);
    run(Pieces<16, 32, 4>{}, "pieces", 0);
    run(Pieces<12, 32, 4>{}, "pieces", 1);
    return 0;
}
