//! Random-weight models for tests, and writers that persist weights as an HF folder or a
//! GGUF file (so loaders can be tested by round trip).
//!
//! - [`random_config`]: a tiny model of each architecture (hidden 64, 4 query heads over 2 KV
//!   heads, 2 layers, vocab 256). Llama's has Llama 3.1-style RoPE scaling; Qwen3's has
//!   `head_dim` 32 so that `q_dim` (128) differs from `hidden_size`, as in real Qwen3.
//! - [`named_config`]: the exact shapes of a few real models.
//! - [`random_weights`]: deterministic weights with realistic statistics: linears
//!   ~ N(0, 1/in), embeddings ~ N(0, 4/D), norms 1 + N(0, 0.01), biases N(0, 0.01).
//! - [`write_hf_folder`] / [`write_hf_folder_sharded`] and [`write_gguf`]; the GGUF writer
//!   applies llama.cpp's q/k row permutation for `llama`/`mistral` (as `convert_hf_to_gguf.py`
//!   does), so loading the file back must undo it.

use std::collections::HashMap;
use std::io::BufWriter;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype as StDtype;

use crate::config::{Arch, Llama3RopeScaling, ModelConfig};
use crate::error::{Error, Result};
use crate::gguf::{self, gguf_tensor_name, llama_permute_index, reorder_rows_dense};
use crate::hf::hf_tensor_name;
use crate::load::{self, expected_shape, weight_names};
use crate::weights::{LayerWeight, LayerWeights, Linear, ModelWeights, WeightName};

/// The names [`named_config`] knows.
pub const NAMED_CONFIGS: &[&str] = &["smollm2-135m", "llama3.2-1b", "llama3-8b", "qwen2.5-7b"];

/// A tiny config of `arch`: hidden 64, intermediate 128, 2 layers, 4 heads over 2 KV heads
/// (head_dim 16; 32 for Qwen3), vocab 256, context 256. Qwen2 has q/k/v bias, Qwen3 q/k
/// norms, Llama Llama 3.1 RoPE scaling (factor 8, low 1, high 4, original context 64, so some
/// frequencies fall in each of the three bands).
pub fn random_config(arch: Arch, tied: bool) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: if arch == Arch::Qwen3 { 32 } else { 16 },
        rope_theta: 10000.0,
        rope_scaling: (arch == Arch::Llama).then_some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        rms_norm_eps: 1e-5,
        max_position_embeddings: 256,
        tie_word_embeddings: tied,
        attention_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// The shapes of a few real models (as their HF `config.json` gives them).
pub fn named_config(name: &str) -> Option<ModelConfig> {
    let base = |arch, vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, rope_theta| {
        ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim: hidden_size / num_heads,
            rope_theta,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
            attention_bias: false,
            qk_norm: false,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    };
    Some(match name {
        "smollm2-135m" => ModelConfig {
            tie_word_embeddings: true,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            ..base(Arch::Llama, 49152, 576, 1536, 30, 9, 3, 100000.0)
        },
        "llama3.2-1b" => ModelConfig {
            rope_scaling: Some(Llama3RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            max_position_embeddings: 131072,
            tie_word_embeddings: true,
            bos_token_id: Some(128000),
            eos_token_ids: vec![128001, 128008, 128009],
            ..base(Arch::Llama, 128256, 2048, 8192, 16, 32, 8, 500000.0)
        },
        "llama3-8b" => ModelConfig {
            bos_token_id: Some(128000),
            eos_token_ids: vec![128001, 128009],
            ..base(Arch::Llama, 128256, 4096, 14336, 32, 32, 8, 500000.0)
        },
        "qwen2.5-7b" => ModelConfig {
            attention_bias: true,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 32768,
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645, 151643],
            ..base(Arch::Qwen2, 152064, 3584, 18944, 28, 28, 4, 1000000.0)
        },
        _ => return None,
    })
}

/// SplitMix64: a tiny, fully specified generator, so weights are the same on every platform
/// and every version of every dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// `n` draws of N(mean, std²) (Box-Muller).
    fn normals(&mut self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let (u1, u2) = (self.unit(), self.unit());
            let r = (-2.0 * u1.ln()).sqrt();
            let t = 2.0 * std::f64::consts::PI * u2;
            v.push(mean + std * (r * t.cos()) as f32);
            if v.len() < n {
                v.push(mean + std * (r * t.sin()) as f32);
            }
        }
        v
    }
}

fn check_dense_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        d => Err(Error::InvalidInput(format!("synthetic weights must be f32, f16 or bf16, not {d:?}"))),
    }
}

/// Deterministic random weights for `cfg` (validated first), dense in `dtype`.
pub fn random_weights(cfg: &ModelConfig, dtype: DType, seed: u64) -> Result<ModelWeights> {
    cfg.validate()?;
    check_dense_dtype(dtype)?;
    if cfg.has_o_bias() {
        return Err(Error::BadConfig("o_proj bias (attention_bias on llama/qwen3) is not supported yet".into()));
    }
    let mut rng = SplitMix64(seed ^ 0x6665_7272_756d_0001);
    let mut gen = |name: WeightName| -> Result<Tensor> {
        use LayerWeight::*;
        let shape = expected_shape(cfg, name);
        let n = shape.iter().product();
        let (mean, std) = match name {
            WeightName::Embed | WeightName::LmHead => (0.0, 2.0 / (cfg.hidden_size as f32).sqrt()),
            WeightName::FinalNorm => (1.0, 0.1),
            WeightName::Layer(_, AttnNorm | MlpNorm | QNorm | KNorm) => (1.0, 0.1),
            WeightName::Layer(_, QBias | KBias | VBias | OBias) => (0.0, 0.1),
            WeightName::Layer(..) => (0.0, 1.0 / (shape[1] as f32).sqrt()),
        };
        let t = Tensor::from_vec(rng.normals(n, mean, std), shape, &Device::Cpu)?;
        Ok(if dtype == DType::F32 { t } else { t.to_dtype(dtype)? })
    };
    let embed = gen(WeightName::Embed)?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        // Generation order is fixed (the field order below) so a seed always gives the same model.
        let attn_norm = gen(WeightName::Layer(i, LayerWeight::AttnNorm))?;
        let q = Linear::Dense(gen(WeightName::Layer(i, LayerWeight::Q))?);
        let k = Linear::Dense(gen(WeightName::Layer(i, LayerWeight::K))?);
        let v = Linear::Dense(gen(WeightName::Layer(i, LayerWeight::V))?);
        let o = Linear::Dense(gen(WeightName::Layer(i, LayerWeight::O))?);
        let bias = cfg.attention_bias;
        let q_bias = if bias { Some(gen(WeightName::Layer(i, LayerWeight::QBias))?) } else { None };
        let k_bias = if bias { Some(gen(WeightName::Layer(i, LayerWeight::KBias))?) } else { None };
        let v_bias = if bias { Some(gen(WeightName::Layer(i, LayerWeight::VBias))?) } else { None };
        let q_norm = if cfg.qk_norm { Some(gen(WeightName::Layer(i, LayerWeight::QNorm))?) } else { None };
        let k_norm = if cfg.qk_norm { Some(gen(WeightName::Layer(i, LayerWeight::KNorm))?) } else { None };
        let mlp_norm = gen(WeightName::Layer(i, LayerWeight::MlpNorm))?;
        let gate = Linear::Dense(gen(WeightName::Layer(i, LayerWeight::Gate))?);
        let up = Linear::Dense(gen(WeightName::Layer(i, LayerWeight::Up))?);
        let down = Linear::Dense(gen(WeightName::Layer(i, LayerWeight::Down))?);
        layers.push(LayerWeights {
            attn_norm,
            q,
            k,
            v,
            o,
            q_bias,
            k_bias,
            v_bias,
            q_norm,
            k_norm,
            mlp_norm,
            gate,
            up,
            down,
        });
    }
    let final_norm = gen(WeightName::FinalNorm)?;
    let lm_head =
        if cfg.tie_word_embeddings { Linear::Dense(embed.clone()) } else { Linear::Dense(gen(WeightName::LmHead)?) };
    Ok(ModelWeights { config: cfg.clone(), dtype, embed, layers, final_norm, lm_head })
}

/// The same model with every linear weight quantized to `qtype` (a tied LM head is the
/// quantized embedding); dense tensors become f32, as the GGUF loader gives them.
pub fn quantize_weights(w: &ModelWeights, qtype: GgmlDType) -> Result<ModelWeights> {
    let q = |l: &Linear| -> Result<Linear> {
        Ok(Linear::Quantized(Arc::new(QTensor::quantize(&l.to_dense(DType::F32)?, qtype)?)))
    };
    let f = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?) };
    let fo = |t: &Option<Tensor>| -> Result<Option<Tensor>> { t.as_ref().map(f).transpose() };
    let layers = w
        .layers
        .iter()
        .map(|l| {
            Ok(LayerWeights {
                attn_norm: f(&l.attn_norm)?,
                q: q(&l.q)?,
                k: q(&l.k)?,
                v: q(&l.v)?,
                o: q(&l.o)?,
                q_bias: fo(&l.q_bias)?,
                k_bias: fo(&l.k_bias)?,
                v_bias: fo(&l.v_bias)?,
                q_norm: fo(&l.q_norm)?,
                k_norm: fo(&l.k_norm)?,
                mlp_norm: f(&l.mlp_norm)?,
                gate: q(&l.gate)?,
                up: q(&l.up)?,
                down: q(&l.down)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ModelWeights {
        config: w.config.clone(),
        dtype: DType::F32,
        embed: f(&w.embed)?,
        layers,
        final_norm: f(&w.final_norm)?,
        lm_head: q(&w.lm_head)?,
    })
}

/// Every weight of a model as a dense f32 tensor, in [`weight_names`] order (the LM head only
/// when it is not tied). Quantized linears are dequantized.
pub fn dense_tensors(w: &ModelWeights) -> Result<Vec<(WeightName, Tensor)>> {
    let cfg = &w.config;
    if w.layers.len() != cfg.num_layers {
        return Err(Error::BadConfig(format!("{} layers for a config of {}", w.layers.len(), cfg.num_layers)));
    }
    let f = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?) };
    let missing = |name: WeightName| Error::BadConfig(format!("weight {name:?} is absent from the model"));
    weight_names(cfg)
        .into_iter()
        .map(|name| {
            use LayerWeight::*;
            let t = match name {
                WeightName::Embed => f(&w.embed)?,
                WeightName::FinalNorm => f(&w.final_norm)?,
                WeightName::LmHead => w.lm_head.to_dense(DType::F32)?,
                WeightName::Layer(i, lw) => {
                    let l = &w.layers[i];
                    let opt = |t: &Option<Tensor>| t.as_ref().ok_or_else(|| missing(name)).and_then(f);
                    match lw {
                        AttnNorm => f(&l.attn_norm)?,
                        MlpNorm => f(&l.mlp_norm)?,
                        Q => l.q.to_dense(DType::F32)?,
                        K => l.k.to_dense(DType::F32)?,
                        V => l.v.to_dense(DType::F32)?,
                        O => l.o.to_dense(DType::F32)?,
                        Gate => l.gate.to_dense(DType::F32)?,
                        Up => l.up.to_dense(DType::F32)?,
                        Down => l.down.to_dense(DType::F32)?,
                        QBias => opt(&l.q_bias)?,
                        KBias => opt(&l.k_bias)?,
                        VBias => opt(&l.v_bias)?,
                        OBias => return Err(missing(name)),
                        QNorm => opt(&l.q_norm)?,
                        KNorm => opt(&l.k_norm)?,
                    }
                }
            };
            let expected = expected_shape(cfg, name);
            if t.dims() != expected.as_slice() {
                return Err(Error::BadShape { name: format!("{name:?}"), got: t.dims().to_vec(), expected });
            }
            Ok((name, t))
        })
        .collect()
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// A tensor's bytes in a safetensors dtype.
fn st_bytes(t: &Tensor, dtype: DType) -> Result<(StDtype, Vec<u8>)> {
    let t = t.to_dtype(dtype)?.flatten_all()?;
    Ok(match dtype {
        DType::F32 => (StDtype::F32, bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec()),
        DType::F16 => (StDtype::F16, bytemuck::cast_slice(&t.to_vec1::<half::f16>()?).to_vec()),
        DType::BF16 => (StDtype::BF16, bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?).to_vec()),
        d => return Err(Error::InvalidInput(format!("cannot write {d:?} tensors"))),
    })
}

/// One tensor ready for safetensors: name, dtype, shape, bytes.
type StTensor = (String, StDtype, Vec<usize>, Vec<u8>);

fn write_safetensors(path: &Path, tensors: &[StTensor]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| Error::InvalidInput(format!("safetensors: {e}")))?;
    let info = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(info), path)
        .map_err(|e| Error::Corrupt { path: path.to_path_buf(), detail: format!("writing safetensors: {e}") })
}

/// Writes `dir/config.json` and `dir/model.safetensors` (tensors in `dtype`: F32, F16 or BF16).
pub fn write_hf_folder(weights: &ModelWeights, dir: &Path, dtype: DType) -> Result<()> {
    write_hf_folder_sharded(weights, dir, dtype, None)
}

/// Like [`write_hf_folder`]; with `Some(max_bytes)` the tensors are split over
/// `model-0000i-of-0000n.safetensors` shards of at most about `max_bytes` each, with a
/// `model.safetensors.index.json`, as `save_pretrained` does.
pub fn write_hf_folder_sharded(
    weights: &ModelWeights,
    dir: &Path,
    dtype: DType,
    max_shard_bytes: Option<usize>,
) -> Result<()> {
    check_dense_dtype(dtype)?;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, weights.config.to_hf_config_json()).map_err(io(&cfg_path))?;
    let mut tensors = Vec::new();
    for (name, t) in dense_tensors(weights)? {
        let (d, b) = st_bytes(&t, dtype)?;
        tensors.push((hf_tensor_name(name), d, t.dims().to_vec(), b));
    }
    let Some(max) = max_shard_bytes else {
        return write_safetensors(&dir.join("model.safetensors"), &tensors);
    };
    let mut shards: Vec<Vec<StTensor>> = vec![vec![]];
    let mut size = 0usize;
    let total: usize = tensors.iter().map(|t| t.3.len()).sum();
    for t in tensors {
        if size > 0 && size + t.3.len() > max {
            shards.push(vec![]);
            size = 0;
        }
        size += t.3.len();
        if let Some(last) = shards.last_mut() {
            last.push(t);
        }
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        for t in shard {
            weight_map.insert(t.0.clone(), file.clone().into());
        }
        write_safetensors(&dir.join(&file), shard)?;
    }
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, serde_json::to_string_pretty(&index).unwrap_or_default()).map_err(io(&index_path))
}

/// A SentencePiece-style vocabulary of `cfg.vocab_size` pieces for synthetic GGUF files:
/// (pieces, scores, ggml token types). Id 0 is `<unk>`, the BOS id `<s>`, the EOS ids `</s>`
/// (then `<|eos_k|>`), then the single characters `▁`, `a-z`, `A-Z`, `0-9` and punctuation,
/// then `▁x` and two-letter pieces, then `<t{i}>` fillers. Higher ids score lower.
pub fn synthetic_vocab(cfg: &ModelConfig) -> (Vec<String>, Vec<f32>, Vec<i32>) {
    const NORMAL: i32 = 1;
    const UNKNOWN: i32 = 2;
    const CONTROL: i32 = 3;
    let mut pool: Vec<String> = Vec::new();
    let letters: Vec<char> = ('a'..='z').collect();
    pool.push("\u{2581}".into());
    pool.extend(letters.iter().map(|c| c.to_string()));
    pool.extend(('A'..='Z').map(|c| c.to_string()));
    pool.extend(('0'..='9').map(|c| c.to_string()));
    pool.extend(".,!?'\"-:;()".chars().map(|c| c.to_string()));
    pool.extend(letters.iter().map(|c| format!("\u{2581}{c}")));
    for a in &letters {
        for b in &letters {
            pool.push(format!("{a}{b}"));
        }
    }
    let mut pool = pool.into_iter();
    let mut eos_k = 0;
    let mut tokens = Vec::with_capacity(cfg.vocab_size);
    let mut types = Vec::with_capacity(cfg.vocab_size);
    for i in 0..cfg.vocab_size {
        let id = i as u32;
        let (t, ty) = if cfg.bos_token_id == Some(id) {
            ("<s>".to_string(), CONTROL)
        } else if cfg.eos_token_ids.contains(&id) {
            eos_k += 1;
            (if eos_k == 1 { "</s>".to_string() } else { format!("<|eos_{eos_k}|>") }, CONTROL)
        } else if i == 0 {
            ("<unk>".to_string(), UNKNOWN)
        } else if i < 3 {
            (format!("<unused{i}>"), CONTROL)
        } else {
            (pool.next().unwrap_or_else(|| format!("<t{i}>")), NORMAL)
        };
        tokens.push(t);
        types.push(ty);
    }
    let scores = (0..cfg.vocab_size).map(|i| -(i as f32)).collect();
    (tokens, scores, types)
}

/// How [`write_gguf`] stores tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgufWriteOptions {
    /// Type of the linear weights (and the untied LM head): F32, F16, Q8_0, Q4_0, …
    pub linear: GgmlDType,
    /// Type of the token embedding.
    pub embed: GgmlDType,
    /// Write a small SentencePiece-style (`llama`) vocabulary as `tokenizer.ggml.*` (see
    /// [`synthetic_vocab`]) instead of `{arch}.vocab_size`.
    pub tokens: bool,
}

impl Default for GgufWriteOptions {
    fn default() -> Self {
        GgufWriteOptions { linear: GgmlDType::F32, embed: GgmlDType::F32, tokens: true }
    }
}

/// Writes a model as a GGUF file, the way llama.cpp's converter would: llama.cpp tensor
/// names and metadata keys, q/k rows permuted for `llama`/`mistral`, Llama 3.1 RoPE scaling
/// as a `rope_freqs.weight` tensor, norms and biases in f32. Only the first two end-of-sequence
/// ids survive (as `eos_token_id` and `eot_token_id`).
pub fn write_gguf(weights: &ModelWeights, path: &Path, opts: &GgufWriteOptions) -> Result<()> {
    let cfg = &weights.config;
    cfg.validate()?;
    let a = cfg.arch.name();
    let u = |n: usize| u32::try_from(n).map(Value::U32).map_err(|_| Error::InvalidInput(format!("{n} exceeds u32")));
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.name".into(), Value::String("ferrum synthetic".into())),
        (format!("{a}.context_length"), u(cfg.max_position_embeddings)?),
        (format!("{a}.embedding_length"), u(cfg.hidden_size)?),
        (format!("{a}.feed_forward_length"), u(cfg.intermediate_size)?),
        (format!("{a}.block_count"), u(cfg.num_layers)?),
        (format!("{a}.attention.head_count"), u(cfg.num_heads)?),
        (format!("{a}.attention.head_count_kv"), u(cfg.num_kv_heads)?),
        (format!("{a}.attention.key_length"), u(cfg.head_dim)?),
        (format!("{a}.attention.value_length"), u(cfg.head_dim)?),
        (format!("{a}.rope.dimension_count"), u(cfg.head_dim)?),
        (format!("{a}.rope.freq_base"), Value::F32(cfg.rope_theta)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)),
    ];
    if opts.tokens {
        let (tokens, scores, types) = synthetic_vocab(cfg);
        md.push(("tokenizer.ggml.model".into(), Value::String("llama".into())));
        md.push(("tokenizer.ggml.tokens".into(), Value::Array(tokens.into_iter().map(Value::String).collect())));
        md.push(("tokenizer.ggml.scores".into(), Value::Array(scores.into_iter().map(Value::F32).collect())));
        md.push(("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect())));
        if cfg.bos_token_id != Some(0) && !cfg.eos_token_ids.contains(&0) {
            md.push(("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)));
        }
    } else {
        md.push((format!("{a}.vocab_size"), u(cfg.vocab_size)?));
    }
    if let Some(b) = cfg.bos_token_id {
        md.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
    }
    for (key, id) in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"].iter().zip(&cfg.eos_token_ids) {
        md.push((key.to_string(), Value::U32(*id)));
    }

    let permute = gguf::arch_is_permuted(cfg.arch);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in dense_tensors(weights)? {
        use LayerWeight::*;
        let heads = match name {
            WeightName::Layer(_, Q | QBias) => Some(cfg.num_heads),
            WeightName::Layer(_, K | KBias) => Some(cfg.num_kv_heads),
            _ => None,
        };
        let t = match heads {
            Some(h) if permute => reorder_rows_dense(&t, &llama_permute_index(t.dims()[0], h)?)?,
            _ => t,
        };
        let qtype = match name {
            WeightName::Embed => opts.embed,
            n if load::is_linear(n) => opts.linear,
            _ => GgmlDType::F32,
        };
        tensors.push((gguf_tensor_name(name), QTensor::quantize(&t, qtype)?));
    }
    if let Some(f) = gguf::llama3_rope_freq_factors(cfg) {
        let n = f.len();
        let t = Tensor::from_vec(f, n, &Device::Cpu)?;
        tensors.push((gguf::ROPE_FREQS.into(), QTensor::quantize(&t, GgmlDType::F32)?));
    }

    let file = std::fs::File::create(path).map_err(io(path))?;
    let mut w = BufWriter::new(file);
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &md_refs, &t_refs)?;
    std::io::Write::flush(&mut w).map_err(io(path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_validate() {
        for arch in [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3] {
            for tied in [false, true] {
                let c = random_config(arch, tied);
                c.validate().unwrap();
                assert!(c.group_size() > 1);
            }
        }
        for n in NAMED_CONFIGS {
            named_config(n).unwrap().validate().unwrap();
        }
        assert!(named_config("gpt2").is_none());
        let c = named_config("qwen2.5-7b").unwrap();
        assert_eq!((c.head_dim, c.kv_dim()), (128, 512));
    }

    #[test]
    fn random_weights_are_deterministic_and_realistic() {
        let cfg = random_config(Arch::Qwen2, false);
        let a = random_weights(&cfg, DType::F32, 7).unwrap();
        let b = random_weights(&cfg, DType::F32, 7).unwrap();
        let c = random_weights(&cfg, DType::F32, 8).unwrap();
        let ta = dense_tensors(&a).unwrap();
        let tb = dense_tensors(&b).unwrap();
        let tc = dense_tensors(&c).unwrap();
        for ((x, y), z) in ta.iter().zip(&tb).zip(&tc) {
            let d = (&x.1 - &y.1).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(d, 0.0);
            let d = (&x.1 - &z.1).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d > 0.0, "{:?}", x.0);
        }
        let q = a.layers[0].q.to_dense(DType::F32).unwrap();
        let std = q.sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        assert!((std - 0.125).abs() < 0.02, "{std}");
        let n = a.layers[1].mlp_norm.mean_all().unwrap().to_scalar::<f32>().unwrap();
        assert!((n - 1.0).abs() < 0.05, "{n}");
        let b = a.layers[0].k_bias.as_ref().unwrap().abs().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(b > 0.01 && b < 0.3, "{b}");
        // f16 weights are the f32 ones rounded.
        let h = random_weights(&cfg, DType::F16, 7).unwrap();
        assert_eq!(h.embed.dtype(), DType::F16);
        assert!(random_weights(&cfg, DType::U8, 7).is_err());
    }
}
