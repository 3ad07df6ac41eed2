// The kernels the Rust side launches, by name. This file has no dependencies:
// `cargo xtask ptx --check` `include!`s it to verify that every name is in the PTX.

/// The most parameters a kernel may take: the launcher's argument array has this many slots
/// (`cargo xtask ptx --check` counts every listed kernel's parameters in the PTX).
pub const MAX_KERNEL_ARGS: usize = 24;

macro_rules! kernels {
    ($($(#[$m:meta])* $variant:ident => $name:literal in $module:literal,)*) => {
        /// A kernel in the embedded PTX; [`Kernel::name`] is its `extern "C"` symbol.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($(#[$m])* $variant,)*
        }

        impl Kernel {
            /// Every kernel, in declaration order (`Kernel::ALL[k as usize] == k`).
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The kernel's symbol in the PTX.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $name,)*
                }
            }

            /// The PTX module (`kernels/<module>.cu`) that defines it.
            pub const fn module(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $module,)*
                }
            }
        }

        /// Every kernel name the Rust side uses.
        pub const KERNEL_NAMES: &[&str] = &[$($name,)*];
        /// `(kernel name, module)` for every kernel.
        pub const KERNEL_MODULES: &[(&str, &str)] = &[$(($name, $module),)*];
    };
}

kernels! {
    /// Embedding gather into the fp32 residual stream.
    EmbedF16 => "ferrum_embed_f16" in "norm",
    EmbedBf16 => "ferrum_embed_bf16" in "norm",
    /// RMSNorm of the fp32 residual stream (fp32 output).
    RmsNormF16 => "ferrum_rmsnorm_f16" in "norm",
    RmsNormBf16 => "ferrum_rmsnorm_bf16" in "norm",
    /// Residual add (fp32 delta) fused with RMSNorm (fp32 output).
    AddRmsNormF16 => "ferrum_add_rmsnorm_f16" in "norm",
    AddRmsNormBf16 => "ferrum_add_rmsnorm_bf16" in "norm",
    /// One-shot all-reduce (sum in place, accumulated in fp32) over the peer buffers of an
    /// in-process group, per element type.
    PeerAllReduceF32 => "ferrum_peer_all_reduce_f32" in "norm",
    PeerAllReduceF16 => "ferrum_peer_all_reduce_f16" in "norm",
    PeerAllReduceBf16 => "ferrum_peer_all_reduce_bf16" in "norm",
    /// The same all-reduce fused with the residual add + RMSNorm that follows it.
    PeerAddRmsNormF16 => "ferrum_peer_add_rmsnorm_f16" in "norm",
    PeerAddRmsNormBf16 => "ferrum_peer_add_rmsnorm_bf16" in "norm",
    /// The same after a `_push` GEMV pushed the partial's lines itself: waits and sums only.
    PeerAddRmsNormPushedF16 => "ferrum_peer_add_rmsnorm_pushed_f16" in "norm",
    PeerAddRmsNormPushedBf16 => "ferrum_peer_add_rmsnorm_pushed_bf16" in "norm",
    /// Bias + q/k norm + RoPE on fp32 q|k|v + K/V cache append (model dtype).
    RopeQkvF16 => "ferrum_rope_qkv_f16" in "attention",
    RopeQkvBf16 => "ferrum_rope_qkv_bf16" in "attention",
    /// GQA attention of fp32 queries over the cache (split-KV), fp32 output.
    AttnF16 => "ferrum_attn_f16" in "attention",
    AttnBf16 => "ferrum_attn_bf16" in "attention",
    /// Decode attention (one token) with rope_qkv's work inside it (the "rope" fusion).
    AttnRopeF16 => "ferrum_attn_rope_f16" in "attention",
    AttnRopeBf16 => "ferrum_attn_rope_bf16" in "attention",
    /// The same, copying the split's past K/V rows to shared memory before its wait.
    AttnRopeEarlyF16 => "ferrum_attn_rope_early_f16" in "attention",
    AttnRopeEarlyBf16 => "ferrum_attn_rope_early_bf16" in "attention",
    /// `AttnRope*` / `AttnRopeEarly*` with their own kernel for head dim 128
    /// (`plan::ATTN_OWN_HEAD_DIMS`; same signature, bit-identical).
    AttnRopeHd128F16 => "ferrum_attn_rope_hd128_f16" in "attention",
    AttnRopeHd128Bf16 => "ferrum_attn_rope_hd128_bf16" in "attention",
    AttnRopeEarlyHd128F16 => "ferrum_attn_rope_early_hd128_f16" in "attention",
    AttnRopeEarlyHd128Bf16 => "ferrum_attn_rope_early_hd128_bf16" in "attention",
    /// The compact fused decode attention (`plan::attn_compact`): one token, head dim 64, no
    /// bias or head norms, every split's rows in the early copies, the cluster merge; same
    /// signature as `AttnRopeEarly*`.
    AttnRopeEarlyCompactHd64F16 => "ferrum_attn_rope_early_compact_hd64_f16" in "attention",
    AttnRopeEarlyCompactHd64Bf16 => "ferrum_attn_rope_early_compact_hd64_bf16" in "attention",
    /// The fused decode attention of the folded q/k/v projection (`plan::FOLD_HEAD_DIMS`).
    AttnRopeFoldHd64F16 => "ferrum_attn_rope_fold_hd64_f16" in "fold",
    AttnRopeFoldHd64Bf16 => "ferrum_attn_rope_fold_hd64_bf16" in "fold",
    AttnRopeEarlyFoldHd64F16 => "ferrum_attn_rope_early_fold_hd64_f16" in "fold",
    AttnRopeEarlyFoldHd64Bf16 => "ferrum_attn_rope_early_fold_hd64_bf16" in "fold",
    AttnRopeFoldHd128F16 => "ferrum_attn_rope_fold_hd128_f16" in "fold",
    AttnRopeFoldHd128Bf16 => "ferrum_attn_rope_fold_hd128_bf16" in "fold",
    AttnRopeEarlyFoldHd128F16 => "ferrum_attn_rope_early_fold_hd128_f16" in "fold",
    AttnRopeEarlyFoldHd128Bf16 => "ferrum_attn_rope_early_fold_hd128_bf16" in "fold",
    /// `AttnRope*` / `AttnRopeEarly*` for head dim 64 that also add the o projection to the
    /// residual (x += W_o attn; opt-in, `plan::attn_o`: one GPU, the cluster merge).
    AttnRopeOHd64F16 => "ferrum_attn_rope_o_hd64_f16" in "attention",
    AttnRopeOHd64Bf16 => "ferrum_attn_rope_o_hd64_bf16" in "attention",
    AttnRopeEarlyOHd64F16 => "ferrum_attn_rope_early_o_hd64_f16" in "attention",
    AttnRopeEarlyOHd64Bf16 => "ferrum_attn_rope_early_o_hd64_bf16" in "attention",
    /// Prefill attention on tensor cores (head dims 16, 32, 64, 96, 128).
    AttnPrefillF16 => "ferrum_attn_prefill_f16" in "attention",
    AttnPrefillBf16 => "ferrum_attn_prefill_bf16" in "attention",
    /// Long-context decode attention on tensor cores (one KV group's q heads as the rows).
    AttnGqaF16 => "ferrum_attn_gqa_f16" in "attention",
    AttnGqaBf16 => "ferrum_attn_gqa_bf16" in "attention",
    /// Combine of the split-KV partials.
    AttnCombineF16 => "ferrum_attn_combine_f16" in "attention",
    AttnCombineBf16 => "ferrum_attn_combine_bf16" in "attention",
    /// Batch-1 projection: model-dtype weights, fp32 input and output.
    GemvF16 => "ferrum_gemv_f16" in "gemv",
    GemvBf16 => "ferrum_gemv_bf16" in "gemv",
    /// The same with four rows per warp (bit-identical results; faster on some shapes).
    Gemv4F16 => "ferrum_gemv4_f16" in "gemv",
    Gemv4Bf16 => "ferrum_gemv4_bf16" in "gemv",
    /// Batch-1 gate|up projection with SiLU·mul fused on its output (fp32).
    GemvGateUpF16 => "ferrum_gemv_gateup_f16" in "gemv",
    GemvGateUpBf16 => "ferrum_gemv_gateup_bf16" in "gemv",
    /// The same with two outputs (four weight rows) per warp.
    Gemv4GateUpF16 => "ferrum_gemv4_gateup_f16" in "gemv",
    Gemv4GateUpBf16 => "ferrum_gemv4_gateup_bf16" in "gemv",
    /// Batch-1 projection of RMSNorm(x) * norm_w, the norm fused in (x: the residual stream).
    GemvNormF16 => "ferrum_gemv_norm_f16" in "gemv",
    GemvNormBf16 => "ferrum_gemv_norm_bf16" in "gemv",
    Gemv4NormF16 => "ferrum_gemv4_norm_f16" in "gemv",
    Gemv4NormBf16 => "ferrum_gemv4_norm_bf16" in "gemv",
    /// Short rows (`plan::gemv_lanes_per_row`): 8 or 16 lanes per two-row group, 4 or 2 groups
    /// per warp; plain and with the norm fused.
    GemvL8F16 => "ferrum_gemv_l8_f16" in "gemv",
    GemvL8Bf16 => "ferrum_gemv_l8_bf16" in "gemv",
    GemvNormL8F16 => "ferrum_gemv_norm_l8_f16" in "gemv",
    GemvNormL8Bf16 => "ferrum_gemv_norm_l8_bf16" in "gemv",
    GemvL16F16 => "ferrum_gemv_l16_f16" in "gemv",
    GemvL16Bf16 => "ferrum_gemv_l16_bf16" in "gemv",
    GemvNormL16F16 => "ferrum_gemv_norm_l16_f16" in "gemv",
    GemvNormL16Bf16 => "ferrum_gemv_norm_l16_bf16" in "gemv",
    /// Gate|up projection of RMSNorm(x) * norm_w with SiLU·mul (both fused).
    GemvGateUpNormF16 => "ferrum_gemv_gateup_norm_f16" in "gemv",
    GemvGateUpNormBf16 => "ferrum_gemv_gateup_norm_bf16" in "gemv",
    Gemv4GateUpNormF16 => "ferrum_gemv4_gateup_norm_f16" in "gemv",
    Gemv4GateUpNormBf16 => "ferrum_gemv4_gateup_norm_bf16" in "gemv",
    /// The two-row gate|up `_norm` GEMV with half the chunks loaded before its wait
    /// (`plan::HalfPrefetch`).
    GemvGateUpNormPfhF16 => "ferrum_gemv_gateup_norm_pfh_f16" in "gemv",
    GemvGateUpNormPfhBf16 => "ferrum_gemv_gateup_norm_pfh_bf16" in "gemv",
    /// Batch-1 projection added into its output (the residual add fused in).
    GemvResF16 => "ferrum_gemv_res_f16" in "gemv",
    GemvResBf16 => "ferrum_gemv_res_bf16" in "gemv",
    Gemv4ResF16 => "ferrum_gemv4_res_f16" in "gemv",
    Gemv4ResBf16 => "ferrum_gemv4_res_bf16" in "gemv",
    /// The same with the early trigger (`plan::EarlyTrigger`: the next kernel may launch
    /// before this one's wait; common.cuh says where).
    GemvResEtF16 => "ferrum_gemv_res_et_f16" in "gemv",
    GemvResEtBf16 => "ferrum_gemv_res_et_bf16" in "gemv",
    /// The two-row one with half the chunks loaded before its wait (`plan::HalfPrefetch`).
    GemvResEtPfhF16 => "ferrum_gemv_res_et_pfh_f16" in "gemv",
    GemvResEtPfhBf16 => "ferrum_gemv_res_et_pfh_bf16" in "gemv",
    Gemv4ResEtF16 => "ferrum_gemv4_res_et_f16" in "gemv",
    Gemv4ResEtBf16 => "ferrum_gemv4_res_et_bf16" in "gemv",
    /// The `_norm` GEMVs with half the chunks loaded before their wait (`plan::HalfPrefetch`).
    GemvNormPfhF16 => "ferrum_gemv_norm_pfh_f16" in "gemv",
    GemvNormPfhBf16 => "ferrum_gemv_norm_pfh_bf16" in "gemv",
    Gemv4NormPfhF16 => "ferrum_gemv4_norm_pfh_f16" in "gemv",
    Gemv4NormPfhBf16 => "ferrum_gemv4_norm_pfh_bf16" in "gemv",
    /// The plain GEMV (2 or 4 rows per warp) that also pushes its outputs, a TP rank's partial,
    /// into the peer group's receive slots (the first step of the peer all-reduce).
    GemvPushF16 => "ferrum_gemv_push_f16" in "gemv",
    GemvPushBf16 => "ferrum_gemv_push_bf16" in "gemv",
    Gemv4PushF16 => "ferrum_gemv4_push_f16" in "gemv",
    Gemv4PushBf16 => "ferrum_gemv4_push_bf16" in "gemv",
    /// SiLU·mul in fp32 (prefill and cuBLAS path).
    SiluMul => "ferrum_silu_mul" in "gemv",
    /// fp32 activations to the model dtype (the input of a cuBLAS GEMM).
    ToDtypeF16 => "ferrum_to_dtype_f16" in "gemv",
    ToDtypeBf16 => "ferrum_to_dtype_bf16" in "gemv",
    /// Argmax, pass 1 (per-block partials).
    ArgmaxPartial => "ferrum_argmax_partial" in "misc",
    /// Argmax, pass 2 (final).
    ArgmaxFinal => "ferrum_argmax_final" in "misc",
    /// Argmax under a TP vocab split: the best of the ranks' candidates.
    ArgmaxPick => "ferrum_argmax_pick" in "misc",
    /// The screened LM head (misc.cu): the int8 copy of the head, made once.
    HeadQuantizeF16 => "ferrum_head_quantize_f16" in "misc",
    HeadQuantizeBf16 => "ferrum_head_quantize_bf16" in "misc",
    /// The screened LM head's screen: brackets every row's logit, re-reads the rows that may
    /// hold the argmax (plain input, or RMSNorm fused on the way in).
    HeadScreenF16 => "ferrum_head_screen_f16" in "misc",
    HeadScreenBf16 => "ferrum_head_screen_bf16" in "misc",
    HeadScreenNormF16 => "ferrum_head_screen_norm_f16" in "misc",
    HeadScreenNormBf16 => "ferrum_head_screen_norm_bf16" in "misc",
    /// The screened LM head's pick: the best re-read row becomes the token.
    HeadPick => "ferrum_head_pick" in "misc",
    /// The folded q/k/v projection (fold.cu): a down projection that also gives the next
    /// layer's q/k/v, built once.
    FoldQkvF16 => "ferrum_fold_qkv_f16" in "fold",
    FoldQkvBf16 => "ferrum_fold_qkv_bf16" in "fold",
    /// Hash-based uniform init (synthetic weights).
    InitUniformF16 => "ferrum_init_uniform_f16" in "misc",
    InitUniformBf16 => "ferrum_init_uniform_bf16" in "misc",
    /// Fills its blocks' dynamic shared memory with all-ones bytes (NaN in every float type),
    /// so tests can check that no kernel's results take in shared memory it did not write.
    PoisonShared => "ferrum_poison_shared" in "misc",
}

/// The PTX modules (`ferrum-cuda/ptx/<name>.ptx`, built from `kernels/<name>.cu`).
pub const PTX_MODULES: &[&str] = &["norm", "attention", "gemv", "misc", "fold"];
