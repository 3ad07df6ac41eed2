// SmolLM2-135M's layer shapes, random bf16 weights for its four projections and a
// double-precision host reference of the projections-only layer loop, with the device helpers
// the cluster microbenchmarks share (cluster_layer.cu, cluster_mma.cu; beside them, like
// check.cuh, so each still builds with one nvcc command).
//
// The layer loop (the attention left out: o reads the first H outputs of qkv):
//   qkv = Wqkv RMSNorm(xa); xb = xa + Wo qkv[0..H); g|u = Wg|Wu RMSNorm(xb); xa = xb + Wd (SiLU(g) u)
// with RMSNorm(x) = x / sqrt(mean(x^2) + EPS) (no norm weight) and f32 activations.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <vector>

#include "check.cuh"

constexpr int H = 576, Q = 960, I = 1536, L = 30;
constexpr float EPS = 1e-5f;

// The shared-memory address of a generic pointer into this block's shared memory.
__device__ __forceinline__ unsigned saddr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

// Waits for the phase of parity `parity` of the mbarrier at shared address `bar`. CLUSTER:
// acquire at cluster scope (data stored by other blocks: st.async); else at CTA scope (this
// block's own bulk copies or arrivals). Traps after ~2^26 polls, printing `tag` (the caller's
// name for the wait): a bug here must not hang the GPU machine.
//
// TEST: poll with mbarrier.test_wait (never suspends the thread) instead of try_wait (which may
// suspend it for a system-dependent time while the phase is incomplete).
template <bool CLUSTER, bool TEST = false>
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity, int tag = -1) {
    unsigned done = 0, spins = 0;
// One poll: `done` = whether the phase of parity `parity` of the mbarrier at `bar` completed.
#define SMOLLM_POLL(OP, SEM)                                                                       \
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier." OP ".parity" SEM ".shared::cta.b64 p, [%1], %2;\n\t" \
                 "selp.u32 %0, 1, 0, p;\n\t}"                                                      \
                 : "=r"(done)                                                                     \
                 : "r"(bar), "r"(parity)                                                          \
                 : "memory")
    while (!done) {
        if (TEST && CLUSTER)
            SMOLLM_POLL("test_wait", ".acquire.cluster");
        else if (TEST)
            SMOLLM_POLL("test_wait", "");
        else if (CLUSTER)
            SMOLLM_POLL("try_wait", ".acquire.cluster");
        else
            SMOLLM_POLL("try_wait", "");
        if (++spins > (1u << 26)) {
            unsigned rank;
            asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
            printf("mbarrier wait timed out: block %u thread %d tag %d parity %u\n", rank, (int)threadIdx.x, tag, parity);
            __trap();
        }
    }
#undef SMOLLM_POLL
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The layer loops' start: thread 0 initialises the four input buffers' mbarriers at ibar[0..4)
// (one arrival each) and arms their first phase for bytes[k]; then the inits are made visible
// to the cluster and every block of it meets at a cluster barrier, so that no block stores into
// another (st.async) before that block's mbarriers exist. All threads of the block call it.
__device__ __forceinline__ void arm_inputs_and_sync(unsigned long long *ibar, const unsigned *bytes) {
    if (threadIdx.x == 0) {
        for (int k = 0; k < 4; ++k) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&ibar[k])) : "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&ibar[k])), "r"(bytes[k]) : "memory");
        }
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The host side: the weights ([L][rows][cols], row-major), the input and the reference output.
struct HostLayers {
    std::vector<__nv_bfloat16> q, o, g, u, d;
    std::vector<float> x0;
    std::vector<double> out;  // xa after L layers
};

inline HostLayers make_layers() {
    HostLayers m;
    m.q.resize((size_t)L * Q * H);
    m.o.resize((size_t)L * H * H);
    m.g.resize((size_t)L * I * H);
    m.u.resize((size_t)L * I * H);
    m.d.resize((size_t)L * H * I);
    uint64_t st = 0x9e3779b97f4a7c15ull;  // xorshift64
    auto rnd = [&](float scale) {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        return scale * ((float)(st >> 40) / 16777216.0f * 2.0f - 1.0f);
    };
    for (auto *m_ : {&m.q, &m.o, &m.g, &m.u})
        for (auto &v : *m_) v = __float2bfloat16(rnd(1.7f / std::sqrt((float)H)));
    for (auto &v : m.d) v = __float2bfloat16(rnd(1.7f / std::sqrt((float)I)));
    m.x0.resize(H);
    for (auto &v : m.x0) v = rnd(1.0f);

    std::vector<double> xa(m.x0.begin(), m.x0.end()), xb(H), qo(Q), hh(I);
    auto W = [](const std::vector<__nv_bfloat16> &w, size_t i) { return (double)__bfloat162float(w[i]); };
    auto rms = [](const std::vector<double> &x) {
        double ss = 0;
        for (double v : x) ss += v * v;
        return 1.0 / std::sqrt(ss / H + EPS);
    };
    for (int l = 0; l < L; ++l) {
        double sc = rms(xa);
        for (int r = 0; r < Q; ++r) {
            double a = 0;
            for (int c = 0; c < H; ++c) a += W(m.q, ((size_t)l * Q + r) * H + c) * xa[c];
            qo[r] = sc * a;
        }
        for (int r = 0; r < H; ++r) {
            double a = 0;
            for (int c = 0; c < H; ++c) a += W(m.o, ((size_t)l * H + r) * H + c) * qo[c];
            xb[r] = xa[r] + a;
        }
        sc = rms(xb);
        for (int r = 0; r < I; ++r) {
            double g = 0, u = 0;
            for (int c = 0; c < H; ++c) {
                g += W(m.g, ((size_t)l * I + r) * H + c) * xb[c];
                u += W(m.u, ((size_t)l * I + r) * H + c) * xb[c];
            }
            g *= sc;
            u *= sc;
            hh[r] = g / (1.0 + std::exp(-g)) * u;
        }
        for (int r = 0; r < H; ++r) {
            double a = 0;
            for (int c = 0; c < I; ++c) a += W(m.d, ((size_t)l * H + r) * I + c) * hh[c];
            xa[r] = xb[r] + a;
        }
    }
    m.out = xa;
    return m;
}

// Host side: `launch()` (one launch of a kernel that writes xa after L layers to dout and each
// block's %globaltimer span to dns[block], block 0's op stamps to dtl) 11 times, the first a
// warm-up, each after zeroing dout and followed by a synchronisation. Returns the median of
// block 0's spans over the 10 timed launches in µs (the upper of the two middle values), and
// the last launch's largest error of dout against the host reference and its stamps.
struct LayersRun {
    double us, maxerr, maxref;
    unsigned long long tl[9];
};
template <typename F>
LayersRun time_layers(F launch, float *dout, const unsigned long long *dns, const unsigned long long *dtl, const std::vector<double> &ref) {
    std::vector<unsigned long long> kns;
    for (int rep = 0; rep < 11; ++rep) {
        CHECK(cudaMemset(dout, 0, H * 4));
        launch();
        CHECK(cudaDeviceSynchronize());
        unsigned long long n0;
        CHECK(cudaMemcpy(&n0, dns, 8, cudaMemcpyDeviceToHost));
        if (rep > 0) kns.push_back(n0);
    }
    std::sort(kns.begin(), kns.end());
    LayersRun r{kns[kns.size() / 2] / 1e3, 0, 0, {}};
    std::vector<float> got(H);
    CHECK(cudaMemcpy(got.data(), dout, H * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(r.tl, dtl, sizeof r.tl, cudaMemcpyDeviceToHost));
    for (int k = 0; k < H; ++k) {
        r.maxerr = std::max(r.maxerr, std::fabs(got[k] - ref[k]));
        r.maxref = std::max(r.maxref, std::fabs(ref[k]));
    }
    return r;
}
