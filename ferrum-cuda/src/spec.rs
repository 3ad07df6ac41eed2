//! The model description, host weights and dtypes (no CUDA needed).
use crate::error::{Error, Result};
use half::{bf16, f16};

/// The runner's storage and compute-input dtype (accumulation is always fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        2
    }
    /// Lower-case name (`f16`, `bf16`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
    /// Rounds an f32 to this dtype and back (what the GPU stores).
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F16 => f16::from_f32(x).to_f32(),
            DType::BF16 => bf16::from_f32(x).to_f32(),
        }
    }
    /// The bit pattern of `x` rounded to this dtype.
    pub fn bits(self, x: f32) -> u16 {
        match self {
            DType::F16 => f16::from_f32(x).to_bits(),
            DType::BF16 => bf16::from_f32(x).to_bits(),
        }
    }
}

/// Host weight data, converted to the runner's dtype while uploading.
#[derive(Clone, Copy, Debug)]
pub enum HostData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl HostData<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(d) => d.len(),
            HostData::F16(d) => d.len(),
            HostData::BF16(d) => d.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Converts `self[start..start + out.len()]` into `dtype` bit patterns.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn convert_into(&self, dtype: DType, start: usize, out: &mut [u16]) {
        let n = out.len();
        match (self, dtype) {
            (HostData::F16(d), DType::F16) => {
                for (o, v) in out.iter_mut().zip(&d[start..start + n]) {
                    *o = v.to_bits();
                }
            }
            (HostData::BF16(d), DType::BF16) => {
                for (o, v) in out.iter_mut().zip(&d[start..start + n]) {
                    *o = v.to_bits();
                }
            }
            (HostData::F32(d), _) => {
                for (o, v) in out.iter_mut().zip(&d[start..start + n]) {
                    *o = dtype.bits(*v);
                }
            }
            (HostData::F16(d), _) => {
                for (o, v) in out.iter_mut().zip(&d[start..start + n]) {
                    *o = dtype.bits(v.to_f32());
                }
            }
            (HostData::BF16(d), _) => {
                for (o, v) in out.iter_mut().zip(&d[start..start + n]) {
                    *o = dtype.bits(v.to_f32());
                }
            }
        }
    }
}

/// A host tensor: row-major, `shape` as in the checkpoint (`[out, in]` for linear weights).
#[derive(Clone, Debug)]
pub struct HostTensor<'a> {
    pub shape: Vec<usize>,
    pub data: HostData<'a>,
}

impl<'a> HostTensor<'a> {
    /// A tensor over `data` with `shape`.
    pub fn new(shape: impl Into<Vec<usize>>, data: HostData<'a>) -> Self {
        Self { shape: shape.into(), data }
    }
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn check(&self, name: &str, want: &[usize]) -> Result<()> {
        if self.shape != want {
            return Err(Error::BadWeight {
                name: name.into(),
                msg: format!("shape {:?}, expected {want:?}", self.shape),
            });
        }
        let n: usize = want.iter().product();
        if self.data.len() != n {
            return Err(Error::BadWeight {
                name: name.into(),
                msg: format!("{} elements for shape {want:?}", self.data.len()),
            });
        }
        Ok(())
    }
}

/// One decoder layer's host weights (this rank's shards).
#[derive(Clone, Debug)]
pub struct HostLayer<'a> {
    /// `[hidden]`
    pub attn_norm: HostTensor<'a>,
    /// `[heads*head_dim, hidden]`
    pub q: HostTensor<'a>,
    /// `[kv_heads*head_dim, hidden]`
    pub k: HostTensor<'a>,
    /// `[kv_heads*head_dim, hidden]`
    pub v: HostTensor<'a>,
    /// `[hidden, heads*head_dim]`
    pub o: HostTensor<'a>,
    /// `[heads*head_dim]`, when `spec.qkv_bias`
    pub q_bias: Option<HostTensor<'a>>,
    /// `[kv_heads*head_dim]`, when `spec.qkv_bias`
    pub k_bias: Option<HostTensor<'a>>,
    /// `[kv_heads*head_dim]`, when `spec.qkv_bias`
    pub v_bias: Option<HostTensor<'a>>,
    /// `[head_dim]`, when `spec.qk_norm`
    pub q_norm: Option<HostTensor<'a>>,
    /// `[head_dim]`, when `spec.qk_norm`
    pub k_norm: Option<HostTensor<'a>>,
    /// `[hidden]`
    pub mlp_norm: HostTensor<'a>,
    /// `[intermediate, hidden]`
    pub gate: HostTensor<'a>,
    /// `[intermediate, hidden]`
    pub up: HostTensor<'a>,
    /// `[hidden, intermediate]`
    pub down: HostTensor<'a>,
}

/// All host weights of a model (this rank's shards).
#[derive(Clone, Debug)]
pub struct HostWeights<'a> {
    /// `[vocab, hidden]`
    pub embed: HostTensor<'a>,
    pub layers: Vec<HostLayer<'a>>,
    /// `[hidden]`
    pub final_norm: HostTensor<'a>,
    /// `[vocab, hidden]`; `None` when tied (the embedding is reused).
    pub lm_head: Option<HostTensor<'a>>,
}

/// The model as the CUDA runner sees it (per rank: `heads`, `kv_heads` and `intermediate` are
/// this rank's shard).
#[derive(Clone, Debug, PartialEq)]
pub struct CudaModelSpec {
    pub vocab: usize,
    pub hidden: usize,
    /// This rank's shard of the MLP width.
    pub intermediate: usize,
    pub layers: usize,
    /// Query heads on this rank.
    pub heads: usize,
    /// KV heads on this rank.
    pub kv_heads: usize,
    /// One of [`SUPPORTED_HEAD_DIMS`].
    pub head_dim: usize,
    /// RoPE inverse frequencies, `head_dim / 2` of them (Llama 3.1 scaling already applied).
    pub rope_inv_freq: Vec<f32>,
    pub rms_eps: f32,
    /// q/k/v biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm before RoPE (Qwen3).
    pub qk_norm: bool,
    /// LM head tied to the embedding.
    pub tied_embeddings: bool,
}

/// Head dims the attention kernel supports.
pub const SUPPORTED_HEAD_DIMS: &[usize] = &[16, 32, 64, 96, 128, 256];

impl CudaModelSpec {
    /// `heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    /// `kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Width of the fused q|k|v projection.
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
    /// Bytes of KV cache per token (all layers, K and V).
    pub fn kv_bytes_per_token(&self, dtype: DType) -> usize {
        2 * self.layers * self.kv_dim() * dtype.size()
    }

    /// Checks the description for consistency and for the kernels' limits.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidSpec(m));
        for (n, v) in [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
        ] {
            if v == 0 {
                return bad(format!("{n} is 0"));
            }
            if v > i32::MAX as usize / 4 {
                return bad(format!("{n} = {v} is too large"));
            }
        }
        if self.heads % self.kv_heads != 0 {
            return bad(format!("heads {} is not a multiple of kv_heads {}", self.heads, self.kv_heads));
        }
        if !SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            return bad(format!("head_dim {} is not one of {SUPPORTED_HEAD_DIMS:?}", self.head_dim));
        }
        if self.rope_inv_freq.len() != self.head_dim / 2 {
            return bad(format!(
                "{} RoPE inverse frequencies for head_dim {}",
                self.rope_inv_freq.len(),
                self.head_dim
            ));
        }
        if self.hidden > 1 << 16 {
            return bad(format!("hidden {} is over 65536", self.hidden));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!("rms_eps {}", self.rms_eps));
        }
        for (n, v) in [
            ("vocab*hidden", self.vocab.checked_mul(self.hidden)),
            ("2*intermediate*hidden", self.intermediate.checked_mul(2 * self.hidden)),
            ("qkv_dim*hidden", self.qkv_dim().checked_mul(self.hidden)),
        ] {
            match v {
                Some(x) if x < isize::MAX as usize / 4 => {}
                _ => return bad(format!("{n} overflows")),
            }
        }
        Ok(())
    }
}

/// How batch-1 projections run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Projection {
    /// ferrum's GEMV kernels (16-byte loads, fp32 accumulate).
    #[default]
    Gemv,
    /// cuBLAS `cublasGemmEx` with n = 1 (fp32 compute).
    Cublas,
}

/// The GPU a runner is on.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: u64,
    pub free_memory: u64,
}

/// Result of [`measure_copy_bandwidth`](crate::measure_copy_bandwidth).
#[derive(Clone, Copy, Debug)]
pub struct CopyBandwidth {
    /// Bytes copied per memcpy (each is read once and written once).
    pub bytes: u64,
    /// Median seconds per memcpy.
    pub seconds: f64,
    /// Bytes read plus bytes written, per second.
    pub bytes_per_second: f64,
}

/// How the device picks each next token in device-fed decoding
/// ([`CudaDecodeRunner::enqueue_device_step`](crate::CudaDecodeRunner)).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum DeviceSampling {
    /// The largest logit (smallest index on ties).
    #[default]
    Greedy,
    /// A draw from `softmax(logits / temperature)` by the Gumbel-max trick, reproducible from
    /// `(seed, position)` (no top-k / top-p: those stay on the host path).
    Temperature {
        /// Must be finite and above 0.
        temperature: f32,
        /// The sampling seed.
        seed: u64,
    },
}

impl DeviceSampling {
    /// `(1 / temperature, seed)` for the kernel, or `None` for greedy. Checks the temperature.
    pub fn kernel_args(self) -> Result<Option<(f32, u64)>> {
        match self {
            DeviceSampling::Greedy => Ok(None),
            DeviceSampling::Temperature { temperature, seed } => {
                let inv = 1.0 / temperature;
                // A subnormal temperature has no finite inverse: logits * inf are ±inf or NaN.
                if !(temperature.is_finite() && temperature > 0.0 && inv.is_finite()) {
                    return Err(Error::InvalidArgument(format!("sampling temperature {temperature}")));
                }
                Ok(Some((inv, seed)))
            }
        }
    }
}

/// The part of a model that one tensor-parallel rank holds: whole KV heads (and the query heads
/// of their groups) and a range of MLP columns. Embeddings, norms and the LM head are replicated.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShardRange {
    /// KV heads `kv_heads.start .. kv_heads.end` of the whole model.
    pub kv_heads: std::ops::Range<usize>,
    /// MLP (intermediate) columns of the whole model.
    pub ffn: std::ops::Range<usize>,
}

impl ShardRange {
    /// The whole model (TP1).
    pub fn whole(spec: &CudaModelSpec) -> Self {
        ShardRange { kv_heads: 0..spec.kv_heads, ffn: 0..spec.intermediate }
    }

    /// Query heads of this shard in a model with `group` query heads per KV head.
    pub fn q_heads(&self, group: usize) -> std::ops::Range<usize> {
        self.kv_heads.start * group..self.kv_heads.end * group
    }
}

impl CudaModelSpec {
    /// The description of one rank's shard of this (whole) model.
    pub fn shard(&self, r: &ShardRange) -> Result<CudaModelSpec> {
        self.validate()?;
        if r.kv_heads.is_empty() || r.kv_heads.end > self.kv_heads {
            return Err(Error::InvalidSpec(format!("KV heads {:?} of {}", r.kv_heads, self.kv_heads)));
        }
        if r.ffn.is_empty() || r.ffn.end > self.intermediate {
            return Err(Error::InvalidSpec(format!("MLP columns {:?} of {}", r.ffn, self.intermediate)));
        }
        let group = self.heads / self.kv_heads;
        Ok(CudaModelSpec {
            intermediate: r.ffn.len(),
            heads: r.kv_heads.len() * group,
            kv_heads: r.kv_heads.len(),
            ..self.clone()
        })
    }
}

#[cfg(test)]
mod sampling_tests {
    use super::*;

    #[test]
    fn device_sampling_arguments_are_checked() {
        assert_eq!(DeviceSampling::Greedy.kernel_args().unwrap(), None);
        let t = |temperature| DeviceSampling::Temperature { temperature, seed: 7 };
        assert_eq!(t(0.5).kernel_args().unwrap(), Some((2.0, 7)));
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e-39] {
            assert!(t(bad).kernel_args().is_err(), "temperature {bad} accepted");
        }
    }
}

/// Which decode-step fusions a CUDA runner uses. All are on by default; `FERRUM_FUSE` picks
/// them at start-up ([`Fusion::parse`]). For tests and A/B benchmarks
/// (`CudaDecodeRunner::set_fusion`).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fusion {
    /// The attention kernel's last split block merges the split-KV partials (else a combine
    /// kernel does; bit-identical either way).
    pub split_merge: bool,
    /// Residual adds and RMSNorms inside the projections (one GPU, hidden <= 4096 only: the
    /// same math with other f32 rounding).
    pub norms: bool,
    /// RoPE and the K/V append inside the decode attention kernel (bit-identical, except
    /// where the compact kernel takes the case: other rounding; `FERRUM_ATTN_COMPACT=0`
    /// restores it).
    pub rope: bool,
    /// With `split_merge`, on sm_90 and for at most `plan::ATTN_MAX_CLUSTER` splits: the split
    /// blocks of each head run as one thread-block cluster and merge through distributed shared
    /// memory instead of global memory, a fence and a ticket (bit-identical, except where the
    /// compact kernel takes the case: other rounding; `FERRUM_ATTN_COMPACT=0` restores it).
    pub cluster: bool,
    /// Tensor parallelism over a peer group, one decode token: the o and down GEMVs push their
    /// partials' lines to the peers themselves, and the peer all-reduce kernel only waits and
    /// sums (bit-identical).
    pub push: bool,
}

impl Fusion {
    /// Every fusion on (the default).
    pub const ALL: Fusion = Fusion { split_merge: true, norms: true, rope: true, cluster: true, push: true };
    /// Every fusion off (`FERRUM_FUSE=0`).
    pub const NONE: Fusion = Fusion { split_merge: false, norms: false, rope: false, cluster: false, push: false };

    /// Reads a `FERRUM_FUSE` value: `0` (none), `1` or empty (all), or a comma-separated list
    /// of `merge`, `norms`, `rope`, `cluster`, `push` (exactly those on). `None` for anything
    /// else.
    pub fn parse(v: &str) -> Option<Fusion> {
        match v.trim() {
            "0" => return Some(Fusion::NONE),
            "1" | "" => return Some(Fusion::ALL),
            _ => {}
        }
        let mut f = Fusion::NONE;
        for name in v.split(',').map(str::trim) {
            match name {
                "merge" => f.split_merge = true,
                "norms" => f.norms = true,
                "rope" => f.rope = true,
                "cluster" => f.cluster = true,
                "push" => f.push = true,
                _ => return None,
            }
        }
        Some(f)
    }
}

#[cfg(test)]
mod fusion_tests {
    use super::Fusion;

    #[test]
    fn fusion_parses_ferrum_fuse_values() {
        assert_eq!(Fusion::parse("0"), Some(Fusion::NONE));
        assert_eq!(Fusion::parse("1"), Some(Fusion::ALL));
        assert_eq!(Fusion::parse(" "), Some(Fusion::ALL));
        assert_eq!(Fusion::parse("merge, norms"), Some(Fusion { norms: true, split_merge: true, ..Fusion::NONE }));
        assert_eq!(Fusion::parse("rope"), Some(Fusion { rope: true, ..Fusion::NONE }));
        assert_eq!(Fusion::parse("merge,norms,rope"), Some(Fusion { cluster: false, push: false, ..Fusion::ALL }));
        assert_eq!(Fusion::parse("merge,norms,rope,cluster"), Some(Fusion { push: false, ..Fusion::ALL }));
        assert_eq!(Fusion::parse("merge,norms,rope,cluster,push"), Some(Fusion::ALL));
        assert_eq!(Fusion::parse("merge,typo"), None);
        assert_eq!(Fusion::parse("yes"), None);
    }
}
