//! Model configuration shared by every loader and backend.
//!
//! One [`ModelConfig`] describes a Llama-family decoder: Llama 2/3 (with Llama 3.1-style
//! `rope_scaling`), TinyLlama, SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k
//! RMSNorm). Loaders fill it from `config.json` or GGUF metadata and call
//! [`ModelConfig::validate`] before anything is allocated from it.

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::load::ModelSource;

/// The architecture family. All are pre-norm decoders with RMSNorm, RoPE (half-split, as in
/// HF transformers), grouped-query attention and a SwiGLU MLP; they differ only in the flags
/// of [`ModelConfig`] (`attention_bias`, `qk_norm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 2/3, TinyLlama, SmolLM2.
    Llama,
    /// Mistral. Its sliding-window attention is served by capping the context at the window
    /// (below it the window masks nothing): Mistral-7B-v0.1 runs 4096 positions, not 32768.
    Mistral,
    /// Qwen2 / Qwen2.5: bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k before RoPE, no bias.
    Qwen3,
}

impl Arch {
    /// Parses an HF `model_type` or GGUF `general.architecture` string.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "llama" => Ok(Arch::Llama),
            "mistral" => Ok(Arch::Mistral),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(Error::UnknownArchitecture(other.to_string())),
        }
    }

    /// The lowercase name used by HF `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Llama 3.1-style RoPE frequency scaling (`rope_scaling.rope_type == "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub rms_norm_eps: f64,
    /// The longest context the model was trained for, capped at the attention window of a
    /// model whose layers slide (see [`ModelConfig::from_hf_config_json`]); also the default KV
    /// capacity.
    pub max_position_embeddings: usize,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Bias on q, k and v projections (Qwen2).
    pub attention_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// Hard upper bounds on header-supplied sizes, so a corrupt config can never make us
/// allocate according to an unchecked count.
pub mod limits {
    pub const MAX_VOCAB: usize = 1 << 22;
    pub const MAX_HIDDEN: usize = 1 << 16;
    pub const MAX_INTERMEDIATE: usize = 1 << 18;
    pub const MAX_LAYERS: usize = 1024;
    pub const MAX_HEADS: usize = 1024;
    pub const MAX_HEAD_DIM: usize = 1024;
    pub const MAX_CONTEXT: usize = 1 << 24;
}

impl ModelConfig {
    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Width of the concatenated q projection output.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of one of the k or v projection outputs.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Whether the attention output projection has a bias. HF Llama and Qwen3 put a bias on
    /// all four projections when `attention_bias` is set; Qwen2 has q/k/v bias only, Mistral
    /// none. (Added by the loaders engineer.)
    pub fn has_o_bias(&self) -> bool {
        self.attention_bias && matches!(self.arch, Arch::Llama | Arch::Qwen3)
    }

    /// Checks every size against [`limits`] and the relations between them.
    pub fn validate(&self) -> Result<()> {
        use limits::*;
        let bad = |what: &str, v: usize, max: usize| -> Result<()> {
            if v == 0 || v > max {
                Err(Error::BadConfig(format!("{what} = {v} is out of range 1..={max}")))
            } else {
                Ok(())
            }
        };
        bad("vocab_size", self.vocab_size, MAX_VOCAB)?;
        bad("hidden_size", self.hidden_size, MAX_HIDDEN)?;
        bad("intermediate_size", self.intermediate_size, MAX_INTERMEDIATE)?;
        bad("num_hidden_layers", self.num_layers, MAX_LAYERS)?;
        bad("num_attention_heads", self.num_heads, MAX_HEADS)?;
        bad("num_key_value_heads", self.num_kv_heads, MAX_HEADS)?;
        bad("head_dim", self.head_dim, MAX_HEAD_DIM)?;
        bad("max_position_embeddings", self.max_position_embeddings, MAX_CONTEXT)?;
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(Error::BadConfig(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            )));
        }
        if self.head_dim % 2 != 0 {
            return Err(Error::BadConfig(format!("head_dim ({}) must be even for RoPE", self.head_dim)));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(Error::BadConfig(format!("rope_theta ({}) must be positive", self.rope_theta)));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(Error::BadConfig(format!("rms_norm_eps ({}) must be positive", self.rms_norm_eps)));
        }
        if let Some(s) = &self.rope_scaling {
            // Finite too: a factor of 1e39 in config.json reads as f32 infinity, which passes
            // `> 0` and then divides the low frequencies down to zero.
            let factors = [s.factor, s.low_freq_factor, s.high_freq_factor];
            if !(factors.iter().all(|f| f.is_finite())
                && s.factor > 0.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor)
                || s.original_max_position_embeddings == 0
            {
                return Err(Error::BadConfig(format!("invalid llama3 rope_scaling {s:?}")));
            }
        }
        Ok(())
    }

    /// RoPE inverse frequencies, `head_dim / 2` of them, with Llama 3.1 scaling applied
    /// exactly as HF transformers' `_compute_llama3_parameters` does.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> =
            (0..d / 2).map(|i| 1.0 / (self.rope_theta as f64).powf((2 * i) as f64 / d as f64) as f32).collect();
        let Some(s) = self.rope_scaling else { return base };
        let old_ctx = s.original_max_position_embeddings as f32;
        let low_freq_wavelen = old_ctx / s.low_freq_factor;
        let high_freq_wavelen = old_ctx / s.high_freq_factor;
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                if wavelen < high_freq_wavelen {
                    f
                } else if wavelen > low_freq_wavelen {
                    f / s.factor
                } else {
                    let smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect()
    }
}

/// The dtype a checkpoint says its weights are stored in: an HF folder's `config.json`
/// `dtype`/`torch_dtype`, a GGUF file's `general.file_type` (F32, F16 or BF16 files; `None` for
/// quantized ones and when it says nothing).
pub fn checkpoint_dtype(source: &ModelSource) -> Result<Option<DType>> {
    match source {
        ModelSource::Gguf { metadata, .. } => Ok(crate::gguf::file_type_dtype(metadata)),
        ModelSource::HfDir { path } => crate::hf::read_config_dtype(path),
    }
}

/// The dtype a GPU runs a model in: `--dtype` when given; else f16 for a checkpoint stored in
/// f16 (exact there, where bf16 would drop 3 of each weight's 10 mantissa bits); else bf16.
pub fn gpu_run_dtype(explicit: Option<DType>, checkpoint: Option<DType>) -> DType {
    match (explicit, checkpoint) {
        (Some(d), _) => d,
        (None, Some(DType::F16)) => DType::F16,
        (None, _) => DType::BF16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_dtype_follows_an_f16_checkpoint_unless_told() {
        assert_eq!(gpu_run_dtype(None, Some(DType::F16)), DType::F16);
        for ckpt in [None, Some(DType::BF16), Some(DType::F32)] {
            assert_eq!(gpu_run_dtype(None, ckpt), DType::BF16, "{ckpt:?}");
        }
        for d in [DType::BF16, DType::F16, DType::F32] {
            assert_eq!(gpu_run_dtype(Some(d), Some(DType::F16)), d);
            assert_eq!(gpu_run_dtype(Some(d), Some(DType::BF16)), d);
        }
    }

    #[test]
    fn checkpoint_dtype_reads_config_json_and_gguf_file_type() {
        use candle_core::quantized::gguf_file::Value as Gv;
        let dir = tempfile::tempdir().unwrap();
        let hf = ModelSource::HfDir { path: dir.path().to_path_buf() };
        // config.json is read again: a folder without one is an error naming it, not a guess.
        assert!(matches!(checkpoint_dtype(&hf), Err(Error::Io { .. })));
        for (entry, want) in [
            (r#""torch_dtype": "float16""#, Some(DType::F16)),
            (r#""dtype": "float16", "torch_dtype": "bfloat16""#, Some(DType::F16)),
            (r#""dtype": null, "torch_dtype": "float16""#, Some(DType::F16)),
            (r#""torch_dtype": "bfloat16""#, Some(DType::BF16)),
            (r#""dtype": "float32""#, Some(DType::F32)),
            (r#""torch_dtype": "int8""#, None),
            (r#""torch_dtype": 16"#, None),
            (r#""model_type": "llama""#, None),
        ] {
            std::fs::write(dir.path().join("config.json"), format!("{{{entry}}}")).unwrap();
            assert_eq!(checkpoint_dtype(&hf).unwrap(), want, "{entry}");
        }
        let gguf = |file_type: Option<Gv>| {
            let metadata = file_type.into_iter().map(|v| ("general.file_type".to_string(), v)).collect();
            ModelSource::Gguf { path: "m.gguf".into(), metadata }
        };
        for (ft, want) in [
            (Some(Gv::U32(1)), Some(DType::F16)),
            (Some(Gv::U32(0)), Some(DType::F32)),
            (Some(Gv::U32(32)), Some(DType::BF16)),
            (Some(Gv::U32(3)), None), // Q4_1
            (Some(Gv::String("1".into())), None),
            (None, None),
        ] {
            assert_eq!(checkpoint_dtype(&gguf(ft.clone())).unwrap(), want, "{ft:?}");
        }
        // The real default model is Q4_1: bf16 on GPUs, as before.
        let gpu = |s: &ModelSource| gpu_run_dtype(None, checkpoint_dtype(s).unwrap());
        assert_eq!(gpu(&gguf(Some(Gv::U32(3)))), DType::BF16);
        assert_eq!(gpu(&gguf(Some(Gv::U32(1)))), DType::F16);
    }
}
