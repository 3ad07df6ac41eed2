//! Hugging Face folders: `config.json` plus `model.safetensors`, or
//! `model.safetensors.index.json` plus its shards.
//!
//! Tensors are memory-mapped and converted one at a time from f32/f16/bf16 to the requested
//! dense dtype. Every tensor's presence, dtype and shape is checked against the config.
//! `WeightFormat::Quantized` has nothing to keep quantized in a safetensors folder and is
//! treated as `Dense(F32)`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, Metadata};
use serde_json::{Map, Value};

use crate::config::{Arch, Llama3RopeScaling, ModelConfig};
use crate::error::{Error, Result};
use crate::load::{self, check_shape, Progress, WeightSource};
use crate::weights::{LayerWeight, Linear, ModelWeights, WeightFormat, WeightName};

/// The safetensors name of a weight (HF transformers' Llama/Mistral/Qwen2/Qwen3 names).
pub fn hf_tensor_name(name: WeightName) -> String {
    use LayerWeight::*;
    match name {
        WeightName::Embed => "model.embed_tokens.weight".into(),
        WeightName::FinalNorm => "model.norm.weight".into(),
        WeightName::LmHead => "lm_head.weight".into(),
        WeightName::Layer(i, w) => {
            let suffix = match w {
                AttnNorm => "input_layernorm.weight",
                Q => "self_attn.q_proj.weight",
                K => "self_attn.k_proj.weight",
                V => "self_attn.v_proj.weight",
                O => "self_attn.o_proj.weight",
                QBias => "self_attn.q_proj.bias",
                KBias => "self_attn.k_proj.bias",
                VBias => "self_attn.v_proj.bias",
                OBias => "self_attn.o_proj.bias",
                QNorm => "self_attn.q_norm.weight",
                KNorm => "self_attn.k_norm.weight",
                MlpNorm => "post_attention_layernorm.weight",
                Gate => "mlp.gate_proj.weight",
                Up => "mlp.up_proj.weight",
                Down => "mlp.down_proj.weight",
            };
            format!("model.layers.{i}.{suffix}")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------------------------

fn bad(msg: impl Into<String>) -> Error {
    Error::BadConfig(msg.into())
}

fn get_usize(o: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|u| usize::try_from(u).ok())
            .map(Some)
            .ok_or_else(|| bad(format!("`{key}` must be a non-negative integer, got {v}"))),
    }
}

fn req_usize(o: &Map<String, Value>, key: &str) -> Result<usize> {
    get_usize(o, key)?.ok_or_else(|| bad(format!("`{key}` is missing")))
}

fn get_f64(o: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| bad(format!("`{key}` must be a number, got {v}"))),
    }
}

fn get_bool(o: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(bad(format!("`{key}` must be true or false, got {v}"))),
    }
}

fn token_id(v: &Value, key: &str) -> Result<u32> {
    v.as_u64().and_then(|u| u32::try_from(u).ok()).ok_or_else(|| bad(format!("`{key}` must hold token ids, got {v}")))
}

/// `eos_token_id`: absent, null, an integer or a list of integers.
fn token_ids(o: &Map<String, Value>, key: &str) -> Result<Vec<u32>> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(|v| token_id(v, key)).collect(),
        Some(v) => Ok(vec![token_id(v, key)?]),
    }
}

/// Parses `rope_scaling` (or the newer `rope_parameters`): `None` for no scaling.
fn parse_rope_scaling(v: Option<&Value>) -> Result<Option<Llama3RopeScaling>> {
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(bad(format!("`rope_scaling` must be an object, got {v}"))),
    };
    let ty = o.get("rope_type").or_else(|| o.get("type")).and_then(Value::as_str).unwrap_or("default");
    match ty {
        "default" => Ok(None),
        "llama3" => {
            let f = |k: &str| -> Result<f32> {
                get_f64(o, k)?.map(|x| x as f32).ok_or_else(|| bad(format!("llama3 `rope_scaling` lacks `{k}`")))
            };
            Ok(Some(Llama3RopeScaling {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: req_usize(o, "original_max_position_embeddings")?,
            }))
        }
        other => Err(bad(format!("rope scaling type `{other}` is not supported (supported: none/default and llama3)"))),
    }
}

/// transformers' `sliding_window` when `config.json` has no such key (MistralConfig,
/// Qwen2Config and Qwen3Config alike).
const DEFAULT_SLIDING_WINDOW: usize = 4096;

/// transformers' Qwen2/Qwen3 `max_window_layers` when `config.json` has no such key.
const DEFAULT_MAX_WINDOW_LAYERS: usize = 28;

/// The attention window of the layers that slide, as transformers reads the config; `None`
/// when no layer slides.
///
/// - Mistral: every layer slides by `sliding_window` (absent: 4096; null: no window).
/// - Qwen2/Qwen3: only with `use_sliding_window: true` (otherwise transformers drops the
///   window); the layers `layer_types` marks `sliding_attention`, or without `layer_types` the
///   layers from `max_window_layers` (default 28) on. A `sliding_attention` layer with no
///   window in effect is an error (transformers fails on it at the first forward).
/// - Llama: transformers' Llama has no sliding window; the key is ignored.
fn sliding_window(o: &Map<String, Value>, arch: Arch, num_layers: usize) -> Result<Option<usize>> {
    let window = || -> Result<Option<usize>> {
        match o.get("sliding_window") {
            None => Ok(Some(DEFAULT_SLIDING_WINDOW)),
            Some(_) => match get_usize(o, "sliding_window")? {
                Some(0) => Err(bad("`sliding_window` must be at least 1")),
                w => Ok(w),
            },
        }
    };
    match arch {
        Arch::Llama => Ok(None),
        Arch::Mistral => window(),
        Arch::Qwen2 | Arch::Qwen3 => {
            let window = if get_bool(o, "use_sliding_window")?.unwrap_or(false) { window()? } else { None };
            let slides = match o.get("layer_types") {
                None | Some(Value::Null) => match window {
                    Some(_) => get_usize(o, "max_window_layers")?.unwrap_or(DEFAULT_MAX_WINDOW_LAYERS) < num_layers,
                    None => false,
                },
                Some(Value::Array(types)) => {
                    if types.len() != num_layers {
                        return Err(bad(format!(
                            "`layer_types` lists {} layers, but num_hidden_layers is {num_layers}",
                            types.len()
                        )));
                    }
                    let mut slides = false;
                    for t in types {
                        match t.as_str() {
                            Some("full_attention") => {}
                            Some("sliding_attention") => slides = true,
                            _ => {
                                return Err(bad(format!(
                                    "`layer_types` entry {t} is not supported (supported: full_attention, \
                                     sliding_attention)"
                                )))
                            }
                        }
                    }
                    if slides && window.is_none() {
                        return Err(bad(
                            "`layer_types` has sliding_attention layers, but no sliding window is in effect \
                             (`use_sliding_window` is false or `sliding_window` is null)",
                        ));
                    }
                    slides
                }
                Some(v) => return Err(bad(format!("`layer_types` must be a list, got {v}"))),
            };
            Ok(window.filter(|_| slides))
        }
    }
}

/// Refuses partial RoPE: `partial_rotary_factor` other than 1 (top level, or in
/// `rope_parameters` / `rope_scaling` as newer transformers writes it) rotates only part of
/// each head, which ferrum does not do.
fn check_partial_rotary(o: &Map<String, Value>) -> Result<()> {
    let nested = |k: &str| o.get(k).and_then(Value::as_object);
    for (scope, obj) in
        [("", Some(o)), ("rope_parameters.", nested("rope_parameters")), ("rope_scaling.", nested("rope_scaling"))]
    {
        if let Some(f) = obj.map(|obj| get_f64(obj, "partial_rotary_factor")).transpose()?.flatten() {
            if f != 1.0 {
                return Err(bad(format!("partial RoPE (`{scope}partial_rotary_factor` {f}) is not supported")));
            }
        }
    }
    Ok(())
}

/// The dtype a `config.json` says the checkpoint's weights are stored in (`dtype`, or the older
/// `torch_dtype`): `None` when it says nothing ferrum knows (it is only a hint for the GPU
/// dtype, [`crate::config::gpu_run_dtype`]).
pub fn config_json_dtype(json: &str) -> Option<DType> {
    let v: Value = serde_json::from_str(json).ok()?;
    let o = v.as_object()?;
    let name = o.get("dtype").filter(|d| !d.is_null()).or_else(|| o.get("torch_dtype"))?.as_str()?;
    match name.strip_prefix("torch.").unwrap_or(name) {
        "float16" | "half" => Some(DType::F16),
        "bfloat16" => Some(DType::BF16),
        "float32" | "float" => Some(DType::F32),
        _ => None,
    }
}

/// [`config_json_dtype`] of `dir/config.json`.
pub fn read_config_dtype(dir: &Path) -> Result<Option<DType>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    Ok(config_json_dtype(&text))
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json` of a Llama-family model and validates it.
    ///
    /// Defaults follow transformers: `num_key_value_heads` = `num_attention_heads`,
    /// `head_dim` = `hidden_size / num_attention_heads`, `rope_theta` = 10000,
    /// `rms_norm_eps` = 1e-6, `tie_word_embeddings` = false. Qwen2 always has q/k/v bias;
    /// Llama and Qwen3 follow `attention_bias` (which also puts a bias on o_proj); Mistral has
    /// none. `rope_scaling` may be absent, `default` or `llama3`; other types are an error, and
    /// so is a `partial_rotary_factor` other than 1. `mlp_bias: true` is an error for Llama
    /// (transformers' Mistral and Qwen MLPs have no bias whatever it says, so there it is ignored).
    ///
    /// Sliding-window attention ([`sliding_window`]: Mistral's `sliding_window`, Qwen's
    /// `use_sliding_window` layers) caps `max_position_embeddings` at the window: below the
    /// window it masks nothing, so the capped model is exact, and ferrum has no windowed
    /// attention to go further.
    pub fn from_hf_config_json(json: &str) -> Result<ModelConfig> {
        let v: Value = serde_json::from_str(json).map_err(|e| bad(format!("config.json is not valid JSON: {e}")))?;
        let o = v.as_object().ok_or_else(|| bad("config.json is not a JSON object"))?;
        let model_type = o
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("`model_type` is missing (expected llama, mistral, qwen2 or qwen3)"))?;
        let arch = Arch::parse(model_type)?;
        if let Some(act) = o.get("hidden_act").or_else(|| o.get("hidden_activation")).and_then(Value::as_str) {
            if act != "silu" && act != "swish" {
                return Err(bad(format!("hidden_act `{act}` is not supported (only silu)")));
            }
        }
        let hidden_size = req_usize(o, "hidden_size")?;
        let num_heads = req_usize(o, "num_attention_heads")?;
        let num_kv_heads = get_usize(o, "num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match get_usize(o, "head_dim")? {
            Some(hd) => hd,
            None => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    return Err(bad(format!(
                        "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}) and no head_dim is given"
                    )));
                }
                hidden_size / num_heads
            }
        };
        // Newer transformers nest theta and scaling under `rope_parameters`.
        let rope_params = o.get("rope_parameters").and_then(Value::as_object);
        let rope_theta = match get_f64(o, "rope_theta")? {
            Some(t) => t,
            None => match rope_params {
                Some(p) => get_f64(p, "rope_theta")?.unwrap_or(10000.0),
                None => 10000.0,
            },
        };
        let rope_scaling = match o.get("rope_scaling") {
            Some(v) if !v.is_null() => parse_rope_scaling(Some(v))?,
            _ => parse_rope_scaling(o.get("rope_parameters"))?,
        };
        check_partial_rotary(o)?;
        let num_layers = req_usize(o, "num_hidden_layers")?;
        let default_ctx = match arch {
            Arch::Llama => 2048,
            Arch::Mistral => 131072,
            Arch::Qwen2 | Arch::Qwen3 => 32768,
        };
        let mut max_position_embeddings = get_usize(o, "max_position_embeddings")?.unwrap_or(default_ctx);
        if let Some(window) = sliding_window(o, arch, num_layers)? {
            if window < max_position_embeddings {
                tracing::warn!(
                    sliding_window = window,
                    max_position_embeddings,
                    "the context is capped at the sliding window (exact below it; ferrum has no windowed attention)"
                );
                max_position_embeddings = window;
            }
        }
        let attention_bias = match arch {
            Arch::Qwen2 => true,
            Arch::Mistral => false,
            Arch::Llama | Arch::Qwen3 => get_bool(o, "attention_bias")?.unwrap_or(false),
        };
        if arch == Arch::Llama && get_bool(o, "mlp_bias")? == Some(true) {
            return Err(bad("`mlp_bias: true` is not supported"));
        }
        let bos_token_id = match o.get("bos_token_id") {
            None | Some(Value::Null) => None,
            Some(v) => Some(token_id(v, "bos_token_id")?),
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: req_usize(o, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(o, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: rope_theta as f32,
            rope_scaling,
            rms_norm_eps: get_f64(o, "rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings,
            tie_word_embeddings: get_bool(o, "tie_word_embeddings")?.unwrap_or(false),
            attention_bias,
            qk_norm: arch == Arch::Qwen3,
            bos_token_id,
            eos_token_ids: token_ids(o, "eos_token_id")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Writes this config as an HF `config.json` (what [`ModelConfig::from_hf_config_json`]
    /// reads back to an equal config).
    pub fn to_hf_config_json(&self) -> String {
        let arch_class = match self.arch {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        };
        let mut o = Map::new();
        o.insert("architectures".into(), serde_json::json!([arch_class]));
        o.insert("model_type".into(), self.arch.name().into());
        o.insert("hidden_act".into(), "silu".into());
        o.insert("vocab_size".into(), self.vocab_size.into());
        o.insert("hidden_size".into(), self.hidden_size.into());
        o.insert("intermediate_size".into(), self.intermediate_size.into());
        o.insert("num_hidden_layers".into(), self.num_layers.into());
        o.insert("num_attention_heads".into(), self.num_heads.into());
        o.insert("num_key_value_heads".into(), self.num_kv_heads.into());
        o.insert("head_dim".into(), self.head_dim.into());
        o.insert("rope_theta".into(), (self.rope_theta as f64).into());
        o.insert(
            "rope_scaling".into(),
            match &self.rope_scaling {
                None => Value::Null,
                Some(s) => serde_json::json!({
                    "rope_type": "llama3",
                    "factor": s.factor as f64,
                    "low_freq_factor": s.low_freq_factor as f64,
                    "high_freq_factor": s.high_freq_factor as f64,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }),
            },
        );
        o.insert("rms_norm_eps".into(), self.rms_norm_eps.into());
        o.insert("max_position_embeddings".into(), self.max_position_embeddings.into());
        // The window, stated, so transformers reads the folder as ferrum does: absent, it would
        // take Mistral's window to be 4096. A read config is already capped at its window, and a
        // window of the whole context masks nothing within it; Qwen's window is off.
        match self.arch {
            Arch::Llama => {}
            Arch::Mistral => {
                o.insert("sliding_window".into(), self.max_position_embeddings.into());
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                o.insert("use_sliding_window".into(), false.into());
                o.insert("sliding_window".into(), Value::Null);
            }
        }
        o.insert("tie_word_embeddings".into(), self.tie_word_embeddings.into());
        o.insert("attention_bias".into(), self.attention_bias.into());
        o.insert("bos_token_id".into(), self.bos_token_id.map_or(Value::Null, Value::from));
        o.insert(
            "eos_token_id".into(),
            match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => (*one).into(),
                many => many.to_vec().into(),
            },
        );
        // serde_json's pretty printer cannot fail on a `Value`.
        serde_json::to_string_pretty(&Value::Object(o)).unwrap_or_default()
    }
}

/// Prefixes a config error with the file it came from.
fn in_file(path: &Path, e: Error) -> Error {
    match e {
        Error::BadConfig(m) => Error::BadConfig(format!("{}: {m}", path.display())),
        e => e,
    }
}

/// Reads and validates `dir/config.json`; end-of-sequence ids listed in
/// `generation_config.json` (Llama 3 instruct lists several there) are added to the config's.
pub fn read_hf_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let mut cfg = ModelConfig::from_hf_config_json(&text).map_err(|e| in_file(&path, e))?;
    let gen_path = dir.join("generation_config.json");
    if let Ok(text) = std::fs::read_to_string(&gen_path) {
        let v: Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("{}: not valid JSON: {e}", gen_path.display())))?;
        if let Some(o) = v.as_object() {
            for id in token_ids(o, "eos_token_id").map_err(|e| in_file(&gen_path, e))? {
                if !cfg.eos_token_ids.contains(&id) {
                    cfg.eos_token_ids.push(id);
                }
            }
        }
    }
    Ok(cfg)
}

// ---------------------------------------------------------------------------------------------
// safetensors
// ---------------------------------------------------------------------------------------------

/// One memory-mapped safetensors file with its parsed header.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    meta: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Shard> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: `Mmap::map` is unsafe because the slice it returns is only sound while no
        // one writes to or truncates the file, which this process cannot enforce against other
        // processes: a write changes bytes behind a `&[u8]` (undefined behaviour) and a
        // truncation raises SIGBUS on the next read past the new end. We rely on the
        // precondition documented on `load_hf_dir` (the files are not modified while the model
        // loads, as every memory-mapping loader does), never write through the read-only map,
        // and drop it when the load ends. Tensor offsets are checked against its length.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| Error::Corrupt { path: path.to_path_buf(), detail: format!("safetensors header: {e}") })?;
        Ok(Shard { path: path.to_path_buf(), mmap, header_len, meta })
    }

    /// The tensor's dtype, shape and bytes (bounds already validated by `read_metadata`).
    fn get(&self, name: &str) -> Result<(StDtype, &[usize], &[u8])> {
        let info =
            self.meta.info(name).ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: name.into() })?;
        let (s, e) = info.data_offsets;
        let base = 8 + self.header_len;
        let data =
            base.checked_add(s).zip(base.checked_add(e)).and_then(|(a, b)| self.mmap.get(a..b)).ok_or_else(|| {
                Error::Corrupt {
                    path: self.path.clone(),
                    detail: format!("tensor `{name}` data {s}..{e} is outside the file"),
                }
            })?;
        Ok((info.dtype, &info.shape, data))
    }
}

/// The safetensors files of a folder and which one holds each tensor.
struct HfSource {
    shards: Vec<Shard>,
    /// The index file and its tensor name → shard map; `None` for a single-file folder.
    index: Option<(PathBuf, HashMap<String, usize>)>,
    cfg: ModelConfig,
}

impl HfSource {
    fn open(dir: &Path, cfg: ModelConfig) -> Result<HfSource> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        if single.is_file() {
            return Ok(HfSource { shards: vec![Shard::open(&single)?], index: None, cfg });
        }
        if !index_path.is_file() {
            return Err(Error::NotAModelFile {
                path: dir.to_path_buf(),
                expected: "Hugging Face model",
                detail: "the folder has no model.safetensors or model.safetensors.index.json".into(),
            });
        }
        let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
        let corrupt = |detail: String| Error::Corrupt { path: index_path.clone(), detail };
        let v: Value = serde_json::from_str(&text).map_err(|e| corrupt(format!("not valid JSON: {e}")))?;
        let map =
            v.get("weight_map").and_then(Value::as_object).ok_or_else(|| corrupt("no `weight_map` object".into()))?;
        let mut shard_ids: HashMap<String, usize> = HashMap::new();
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| corrupt(format!("`{tensor}` maps to a non-string {file}")))?;
            // Shards live beside the index: a bare file name, nothing that climbs out.
            let p = Path::new(file);
            if p.components().count() != 1 || !matches!(p.components().next(), Some(std::path::Component::Normal(_))) {
                return Err(corrupt(format!("shard name `{file}` is not a plain file name")));
            }
            let id = match shard_ids.get(file) {
                Some(&id) => id,
                None => {
                    let id = shards.len();
                    shards.push(Shard::open(&dir.join(file))?);
                    shard_ids.insert(file.to_string(), id);
                    id
                }
            };
            index.insert(tensor.clone(), id);
        }
        Ok(HfSource { shards, index: Some((index_path, index)), cfg })
    }

    fn shard_for(&self, name: &str) -> Result<&Shard> {
        match &self.index {
            None => self.shards.first().ok_or_else(|| Error::InvalidInput("no safetensors files".into())),
            Some((index_path, ix)) => match ix.get(name) {
                Some(&i) => Ok(&self.shards[i]),
                None => Err(Error::MissingTensor { path: index_path.clone(), name: name.into() }),
            },
        }
    }

    /// Loads, checks and converts one weight.
    fn tensor(&self, name: WeightName, dtype: DType) -> Result<Tensor> {
        let file_name = hf_tensor_name(name);
        let shard = self.shard_for(&file_name)?;
        let (st_dtype, shape, data) = shard.get(&file_name)?;
        check_shape(&file_name, shape, &load::expected_shape(&self.cfg, name))?;
        let src_dtype = match st_dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(Error::BadDtype {
                    name: file_name,
                    got: format!("{other:?}"),
                    expected: "F32, F16 or BF16".into(),
                })
            }
        };
        let t = Tensor::from_raw_buffer(data, src_dtype, shape, &Device::Cpu)?;
        Ok(if src_dtype == dtype { t } else { t.to_dtype(dtype)? })
    }
}

impl WeightSource for HfSource {
    fn dense(&mut self, name: WeightName, dtype: DType) -> Result<Tensor> {
        self.tensor(name, dtype)
    }

    fn linear(&mut self, name: WeightName, dtype: DType) -> Result<Linear> {
        Ok(Linear::Dense(self.tensor(name, dtype)?))
    }

    fn tied_lm_head(&mut self, embed: &Tensor) -> Result<Linear> {
        Ok(Linear::Dense(embed.clone()))
    }
}

/// Loads an HF folder. `WeightFormat::Quantized` loads dense f32.
///
/// The safetensors files are memory-mapped while they load. Precondition: nothing modifies or
/// truncates them meanwhile. That cannot be checked; a file changed under the map is undefined
/// behaviour, and one truncated under it kills the process with SIGBUS.
pub fn load_hf_dir(dir: &Path, format: WeightFormat) -> Result<ModelWeights> {
    load_hf_dir_with_progress(dir, format, &mut |_, _| {})
}

/// [`load_hf_dir`] reporting progress once per tensor, with the same precondition.
pub fn load_hf_dir_with_progress(dir: &Path, format: WeightFormat, progress: Progress<'_>) -> Result<ModelWeights> {
    load::check_format(format)?;
    let cfg = read_hf_config(dir)?;
    let mut src = HfSource::open(dir, cfg.clone())?;
    load::assemble(&cfg, load::dense_dtype(format), &mut src, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_135M: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
      "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": true,
      "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9,
      "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
      "rms_norm_eps": 1e-05, "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
      "use_cache": true, "vocab_size": 49152 }"#;

    const LLAMA32_1B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
      "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
      "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256 }"#;

    const QWEN25_05B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
      "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
      "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
      "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
      "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 151936 }"#;

    const QWEN3_06B: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
      "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
      "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
      "use_cache": true, "use_sliding_window": false, "vocab_size": 151936 }"#;

    const MISTRAL_7B: &str = r#"{
      "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0",
      "use_cache": true, "vocab_size": 32000 }"#;

    #[test]
    fn parses_real_configs() {
        let c = ModelConfig::from_hf_config_json(SMOLLM2_135M).unwrap();
        assert_eq!(c, crate::synthetic::named_config("smollm2-135m").unwrap());

        let c = ModelConfig::from_hf_config_json(LLAMA32_1B).unwrap();
        assert_eq!(c, crate::synthetic::named_config("llama3.2-1b").unwrap());
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);

        let c = ModelConfig::from_hf_config_json(QWEN25_05B).unwrap();
        assert_eq!((c.arch, c.attention_bias, c.tie_word_embeddings, c.head_dim), (Arch::Qwen2, true, true, 64));
        assert!(!c.has_o_bias());

        let c = ModelConfig::from_hf_config_json(QWEN3_06B).unwrap();
        assert_eq!((c.arch, c.qk_norm, c.head_dim, c.q_dim()), (Arch::Qwen3, true, 128, 2048));
        assert!(!c.attention_bias);

        let c = ModelConfig::from_hf_config_json(MISTRAL_7B).unwrap();
        assert_eq!((c.arch, c.num_kv_heads, c.head_dim, c.rope_theta), (Arch::Mistral, 8, 128, 10000.0));
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    #[test]
    fn defaults_and_variants() {
        let min = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                      "num_attention_heads":4,"vocab_size":256}"#;
        let c = ModelConfig::from_hf_config_json(min).unwrap();
        assert_eq!((c.num_kv_heads, c.head_dim, c.rope_theta, c.rms_norm_eps), (4, 16, 10000.0, 1e-6));
        assert!(!c.tie_word_embeddings && !c.attention_bias && c.eos_token_ids.is_empty() && c.bos_token_id.is_none());

        let with_bias = min.replace("\"vocab_size\"", "\"attention_bias\":true,\"vocab_size\"");
        let c = ModelConfig::from_hf_config_json(&with_bias).unwrap();
        assert!(c.attention_bias && c.has_o_bias());

        let default_rope = min.replace("\"vocab_size\"", "\"rope_scaling\":{\"rope_type\":\"default\"},\"vocab_size\"");
        assert_eq!(ModelConfig::from_hf_config_json(&default_rope).unwrap().rope_scaling, None);

        let rope_params = min.replace(
            "\"vocab_size\"",
            "\"rope_parameters\":{\"rope_type\":\"llama3\",\"rope_theta\":500000.0,\"factor\":8.0,\
             \"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192},\"vocab_size\"",
        );
        let c = ModelConfig::from_hf_config_json(&rope_params).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
    }

    #[test]
    fn rejects_bad_configs() {
        let min = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                      "num_attention_heads":4,"vocab_size":256}"#;
        let e = ModelConfig::from_hf_config_json(&min.replace("llama", "gpt2")).unwrap_err();
        assert!(matches!(e, Error::UnknownArchitecture(ref a) if a == "gpt2"), "{e}");
        let yarn = min.replace("\"vocab_size\"", "\"rope_scaling\":{\"type\":\"yarn\",\"factor\":4.0},\"vocab_size\"");
        let e = ModelConfig::from_hf_config_json(&yarn).unwrap_err();
        assert!(matches!(e, Error::BadConfig(ref m) if m.contains("yarn")), "{e}");
        let e = ModelConfig::from_hf_config_json(&min.replace("\"num_hidden_layers\":2,", "")).unwrap_err();
        assert!(matches!(e, Error::BadConfig(ref m) if m.contains("num_hidden_layers")), "{e}");
        let e = ModelConfig::from_hf_config_json(&min.replace("\"hidden_size\":64", "\"hidden_size\":-3")).unwrap_err();
        assert!(matches!(e, Error::BadConfig(ref m) if m.contains("hidden_size")), "{e}");
        let e = ModelConfig::from_hf_config_json(&min.replace("256", "99999999999")).unwrap_err();
        assert!(matches!(e, Error::BadConfig(ref m) if m.contains("vocab_size")), "{e}");
        let e = ModelConfig::from_hf_config_json("[1,2]").unwrap_err();
        assert!(matches!(e, Error::BadConfig(_)), "{e}");
        let e = ModelConfig::from_hf_config_json("{not json").unwrap_err();
        assert!(matches!(e, Error::BadConfig(_)), "{e}");
        let e =
            ModelConfig::from_hf_config_json(&min.replace("\"vocab_size\"", "\"eos_token_id\":\"x\",\"vocab_size\""))
                .unwrap_err();
        assert!(matches!(e, Error::BadConfig(ref m) if m.contains("eos_token_id")), "{e}");

        // Numbers past f32's range read as infinity, which passes `> 0` and `high > low`.
        let llama3 = |factor: &str, high: &str| {
            min.replace(
                "\"vocab_size\"",
                &format!(
                    "\"rope_scaling\":{{\"rope_type\":\"llama3\",\"factor\":{factor},\"low_freq_factor\":1.0,\
                     \"high_freq_factor\":{high},\"original_max_position_embeddings\":64}},\"vocab_size\""
                ),
            )
        };
        ModelConfig::from_hf_config_json(&llama3("8.0", "4.0")).unwrap();
        for (factor, high) in [("1e39", "4.0"), ("8.0", "1e39"), ("-1e39", "4.0")] {
            let e = ModelConfig::from_hf_config_json(&llama3(factor, high)).unwrap_err();
            assert!(matches!(e, Error::BadConfig(ref m) if m.contains("rope_scaling")), "{factor}/{high}: {e}");
        }
        let e = ModelConfig::from_hf_config_json(&min.replace("\"vocab_size\"", "\"rope_theta\":1e39,\"vocab_size\""))
            .unwrap_err();
        assert!(matches!(e, Error::BadConfig(ref m) if m.contains("rope_theta")), "{e}");
    }

    fn parse(json: &str) -> Result<ModelConfig> {
        ModelConfig::from_hf_config_json(json)
    }

    fn bad_config_mentions(json: &str, needle: &str) {
        match parse(json) {
            Err(Error::BadConfig(m)) => assert!(m.contains(needle), "`{m}` does not mention `{needle}`"),
            other => panic!("expected a BadConfig naming `{needle}`, got {other:?}"),
        }
    }

    const MIN_LLAMA: &str = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                      "num_attention_heads":4,"vocab_size":256}"#;

    #[test]
    fn mistral_sliding_window_caps_the_context() {
        // Mistral-7B-v0.1: a 4096 window, 32768 positions. Below 4096 positions the window
        // masks nothing, so the cap is exact; past it full attention would be wrong.
        let c = parse(MISTRAL_7B).unwrap();
        assert_eq!(c.max_position_embeddings, 4096);
        // Absent: transformers' MistralConfig defaults the window to 4096.
        let absent = MISTRAL_7B.replace("\"sliding_window\": 4096,", "");
        assert!(!absent.contains("sliding_window"));
        assert_eq!(parse(&absent).unwrap().max_position_embeddings, 4096);
        let min = MIN_LLAMA.replace("llama", "mistral");
        assert_eq!(parse(&min).unwrap().max_position_embeddings, 4096);
        // null: no window (Mistral-7B-v0.2 and later), the trained context stands.
        let none = MISTRAL_7B.replace("\"sliding_window\": 4096", "\"sliding_window\": null");
        assert_eq!(parse(&none).unwrap().max_position_embeddings, 32768);
        // A window at least as wide as the context changes nothing.
        for w in ["32768", "65536"] {
            let wide = MISTRAL_7B.replace("\"sliding_window\": 4096", &format!("\"sliding_window\": {w}"));
            assert_eq!(parse(&wide).unwrap().max_position_embeddings, 32768, "{w}");
        }
        for bad in ["0", "-1", "1.5", "\"x\""] {
            bad_config_mentions(
                &MISTRAL_7B.replace("\"sliding_window\": 4096", &format!("\"sliding_window\": {bad}")),
                "sliding_window",
            );
        }
        // Llama has no sliding window in transformers: the key is ignored there.
        let llama =
            MIN_LLAMA.replace("\"vocab_size\"", "\"sliding_window\":16,\"max_position_embeddings\":64,\"vocab_size\"");
        assert_eq!(parse(&llama).unwrap().max_position_embeddings, 64);
        // A written folder states the window, so transformers reading it back agrees (an absent
        // key would mean 4096 to it), and ferrum reads the same config back.
        for c in [parse(MISTRAL_7B).unwrap(), parse(&none).unwrap()] {
            let json = c.to_hf_config_json();
            let v: Value = serde_json::from_str(&json).unwrap();
            let w = v["sliding_window"].as_u64().map(|w| w as usize);
            assert!(w.is_none_or(|w| w >= c.max_position_embeddings), "{json}");
            assert_eq!(parse(&json).unwrap(), c);
        }
    }

    #[test]
    fn qwen_sliding_layers_cap_the_context() {
        let set = |base: &str, edits: &[(&str, &str)]| {
            let mut s = base.to_string();
            for (from, to) in edits {
                assert!(s.contains(from), "{from}");
                s = s.replace(from, to);
            }
            s
        };
        let ctx = |json: &str| parse(json).unwrap().max_position_embeddings;
        let on = ("\"use_sliding_window\": false", "\"use_sliding_window\": true");
        // The real configs: use_sliding_window false, so no layer slides whatever the window.
        assert_eq!(ctx(QWEN25_05B), 32768);
        assert_eq!(ctx(QWEN3_06B), 40960);
        // Qwen2.5-0.5B with the window on: layers 21.. of 24 slide (max_window_layers 21).
        let w4k = ("\"sliding_window\": 32768", "\"sliding_window\": 4096");
        assert_eq!(ctx(&set(QWEN25_05B, &[on, w4k])), 4096);
        // max_window_layers at or past the layer count: every layer is full attention.
        let all_full = ("\"max_window_layers\": 21", "\"max_window_layers\": 24");
        assert_eq!(ctx(&set(QWEN25_05B, &[on, w4k, all_full])), 32768);
        // max_window_layers absent: transformers' default 28 (> 24 layers): nothing slides.
        assert_eq!(ctx(&set(QWEN25_05B, &[on, w4k, ("\"max_window_layers\": 21,", "")])), 32768);
        // The window on but null: nothing slides, even with every layer past max_window_layers.
        assert_eq!(ctx(&set(QWEN3_06B, &[on, ("\"max_window_layers\": 28", "\"max_window_layers\": 0")])), 40960);
        // Qwen3-0.6B with the window on and absent (default 4096), max_window_layers 0.
        let q3 = set(
            QWEN3_06B,
            &[on, ("\"sliding_window\": null,", ""), ("\"max_window_layers\": 28", "\"max_window_layers\": 0")],
        );
        assert_eq!(ctx(&q3), 4096);
        // Explicit layer_types decide, not max_window_layers.
        let types = |kinds: &[&str]| {
            let list: Vec<String> = (0..24).map(|i| format!("\"{}\"", kinds[i % kinds.len()])).collect();
            ("\"vocab_size\"", format!("\"layer_types\": [{}], \"vocab_size\"", list.join(",")))
        };
        let (k, v) = types(&["full_attention", "sliding_attention"]);
        assert_eq!(ctx(&set(QWEN25_05B, &[on, w4k, all_full, (k, &v)])), 4096);
        let (k, v) = types(&["full_attention"]);
        assert_eq!(ctx(&set(QWEN25_05B, &[on, w4k, (k, &v)])), 32768);
        // Sliding layers with no window in effect: transformers fails at its first forward.
        let (k, v) = types(&["sliding_attention"]);
        bad_config_mentions(&set(QWEN25_05B, &[(k, &v)]), "sliding_attention");
        // A list of the wrong length, or a kind of attention ferrum does not have.
        let short = set(QWEN25_05B, &[on, ("\"vocab_size\"", "\"layer_types\": [\"full_attention\"], \"vocab_size\"")]);
        bad_config_mentions(&short, "layer_types");
        let (k, v) = types(&["full_attention", "chunked_attention"]);
        bad_config_mentions(&set(QWEN25_05B, &[on, (k, &v)]), "chunked_attention");
        bad_config_mentions(
            &set(QWEN25_05B, &[on, ("\"sliding_window\": 32768", "\"sliding_window\": 0")]),
            "sliding_window",
        );
        // A written Qwen folder turns the window off (the context is already capped).
        let c = parse(&set(QWEN25_05B, &[on, w4k])).unwrap();
        let json = c.to_hf_config_json();
        let v: Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["use_sliding_window"], Value::Bool(false), "{json}");
        assert_eq!(parse(&json).unwrap(), c);
    }

    #[test]
    fn partial_rotary_factor_other_than_one_is_refused() {
        let with = |entry: &str| MIN_LLAMA.replace("\"vocab_size\"", &format!("{entry},\"vocab_size\""));
        for f in ["0.5", "0.25", "2", "0", "\"half\""] {
            bad_config_mentions(&with(&format!("\"partial_rotary_factor\":{f}")), "partial_rotary_factor");
            for key in ["rope_parameters", "rope_scaling"] {
                let nested = format!("\"{key}\":{{\"rope_type\":\"default\",\"partial_rotary_factor\":{f}}}");
                bad_config_mentions(&with(&nested), "partial_rotary_factor");
            }
        }
        parse(&with("\"partial_rotary_factor\":1.0")).unwrap();
        parse(&with("\"partial_rotary_factor\":null")).unwrap();
        parse(&with(
            "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":10000.0,\"partial_rotary_factor\":1}",
        ))
        .unwrap();
    }

    #[test]
    fn mlp_bias_is_refused_only_where_transformers_reads_it() {
        let with_bias = MIN_LLAMA.replace("\"vocab_size\"", "\"mlp_bias\":true,\"vocab_size\"");
        bad_config_mentions(&with_bias, "mlp_bias");
        // MistralMLP, Qwen2MLP and Qwen3MLP build their projections with bias=False.
        for arch in ["mistral", "qwen2", "qwen3"] {
            let c = parse(&with_bias.replace("llama", arch)).unwrap();
            assert_eq!(c.arch.name(), arch);
        }
    }

    #[test]
    fn config_json_round_trips() {
        for arch in [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3] {
            for tied in [false, true] {
                let c = crate::synthetic::random_config(arch, tied);
                assert_eq!(ModelConfig::from_hf_config_json(&c.to_hf_config_json()).unwrap(), c);
            }
        }
        for name in crate::synthetic::NAMED_CONFIGS {
            let c = crate::synthetic::named_config(name).unwrap();
            assert_eq!(ModelConfig::from_hf_config_json(&c.to_hf_config_json()).unwrap(), c, "{name}");
        }
    }
}
