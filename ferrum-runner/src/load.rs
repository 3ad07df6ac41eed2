//! Loading a model from a path: a GGUF file or a Hugging Face folder (`config.json` plus
//! safetensors).
//!
//! [`load_model`] looks at the path and dispatches to [`crate::gguf`] or [`crate::hf`]. Both
//! loaders share the list of weights a config needs ([`weight_names`]), their shapes
//! ([`expected_shape`]) and the assembly of [`ModelWeights`] from them, so both check exactly
//! the same things.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Tensor};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::weights::{LayerWeight, LayerWeights, Linear, ModelWeights, WeightFormat, WeightName};

/// Where a loaded model came from.
pub enum ModelSource {
    /// A GGUF file, with its parsed metadata (the tokenizer reads `tokenizer.ggml.*` from it).
    Gguf { path: PathBuf, metadata: HashMap<String, gguf_file::Value> },
    /// A Hugging Face folder (`config.json`, `model.safetensors[.index.json]`, tokenizer files).
    HfDir { path: PathBuf },
}

impl fmt::Debug for ModelSource {
    // The GGUF metadata holds the whole vocabulary: print its size, not its contents.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelSource::Gguf { path, metadata } => f
                .debug_struct("Gguf")
                .field("path", path)
                .field("metadata", &format_args!("{} keys", metadata.len()))
                .finish(),
            ModelSource::HfDir { path } => f.debug_struct("HfDir").field("path", path).finish(),
        }
    }
}

impl ModelSource {
    /// The GGUF file or the HF folder.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf { path, .. } | ModelSource::HfDir { path } => path,
        }
    }

    /// The GGUF metadata, for a GGUF source.
    pub fn gguf_metadata(&self) -> Option<&HashMap<String, gguf_file::Value>> {
        match self {
            ModelSource::Gguf { metadata, .. } => Some(metadata),
            ModelSource::HfDir { .. } => None,
        }
    }

    /// True for a GGUF file.
    pub fn is_gguf(&self) -> bool {
        matches!(self, ModelSource::Gguf { .. })
    }
}

/// A model's weights and where they came from.
#[derive(Debug)]
pub struct LoadedModel {
    pub weights: ModelWeights,
    pub source: ModelSource,
}

/// Progress of a load: called once per weight tensor, with (tensors done, tensors in all).
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize);

/// Loads a model from a GGUF file or an HF folder.
///
/// - A directory is an HF folder (`config.json` + `model.safetensors` or
///   `model.safetensors.index.json` + shards). `WeightFormat::Quantized` has nothing to keep
///   quantized there and is treated as `Dense(F32)`.
/// - A file starting with the GGUF magic is a GGUF file.
/// - A `.safetensors` file or a `config.json` with a `config.json` beside it loads that folder;
///   a bare safetensors file without a config is an error (its shapes are not enough to know
///   the architecture).
///
/// The files are memory-mapped while they load. Precondition: nothing modifies or truncates
/// them meanwhile (see [`GgufFile::open`](crate::gguf::GgufFile::open) and
/// [`load_hf_dir`](crate::hf::load_hf_dir)).
pub fn load_model(path: &Path, format: WeightFormat) -> Result<LoadedModel> {
    load_model_with_progress(path, format, &mut |_, _| {})
}

/// [`load_model`] reporting progress once per tensor, with the same precondition.
pub fn load_model_with_progress(path: &Path, format: WeightFormat, progress: Progress<'_>) -> Result<LoadedModel> {
    check_format(format)?;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return load_hf(path, format, progress);
    }
    match sniff(path)? {
        FileKind::Gguf => {
            let file = crate::gguf::GgufFile::open(path)?;
            let weights = file.load_weights_with_progress(format, progress)?;
            Ok(LoadedModel {
                weights,
                source: ModelSource::Gguf { path: path.to_path_buf(), metadata: file.into_metadata() },
            })
        }
        FileKind::Safetensors | FileKind::ConfigJson => {
            let dir = match path.parent() {
                Some(p) if p.as_os_str().is_empty() => Path::new("."),
                Some(p) => p,
                None => Path::new("."),
            };
            if dir.join("config.json").is_file() {
                load_hf(dir, format, progress)
            } else {
                Err(Error::NotAModelFile {
                    path: path.to_path_buf(),
                    expected: "GGUF",
                    detail: "this is a safetensors file with no config.json beside it; pass the Hugging Face \
                             folder that holds config.json and the safetensors files"
                        .into(),
                })
            }
        }
        FileKind::Other(detail) => {
            Err(Error::NotAModelFile { path: path.to_path_buf(), expected: "GGUF or Hugging Face model", detail })
        }
    }
}

fn load_hf(dir: &Path, format: WeightFormat, progress: Progress<'_>) -> Result<LoadedModel> {
    let weights = crate::hf::load_hf_dir_with_progress(dir, format, progress)?;
    Ok(LoadedModel { weights, source: ModelSource::HfDir { path: dir.to_path_buf() } })
}

enum FileKind {
    Gguf,
    Safetensors,
    ConfigJson,
    Other(String),
}

/// Looks at the first bytes of a file.
fn sniff(path: &Path) -> Result<FileKind> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut head = [0u8; 9];
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(path, e)),
        }
    }
    let head = &head[..n];
    if head.starts_with(b"GGUF") {
        return Ok(FileKind::Gguf);
    }
    if path.file_name().is_some_and(|n| n == "config.json") {
        return Ok(FileKind::ConfigJson);
    }
    // safetensors: u64 header length, then a JSON object.
    if n == 9 && head[8] == b'{' {
        return Ok(FileKind::Safetensors);
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        return Ok(FileKind::Safetensors);
    }
    Ok(FileKind::Other(if n == 0 {
        "the file is empty".into()
    } else {
        format!("unrecognised leading bytes {:02x?}", head)
    }))
}

/// Rejects dense dtypes the backends cannot use.
pub(crate) fn check_format(format: WeightFormat) -> Result<()> {
    match format {
        WeightFormat::Quantized | WeightFormat::Dense(DType::F32 | DType::F16 | DType::BF16) => Ok(()),
        WeightFormat::Dense(d) => {
            Err(Error::InvalidInput(format!("dense weights must be f32, f16 or bf16, not {d:?}")))
        }
    }
}

/// The dtype of a model's dense tensors for a format.
pub(crate) fn dense_dtype(format: WeightFormat) -> DType {
    match format {
        WeightFormat::Quantized => DType::F32,
        WeightFormat::Dense(d) => d,
    }
}

/// Every weight a config needs, in file order: the embedding, each layer, the final norm, and
/// the LM head when it is not tied to the embedding.
pub fn weight_names(cfg: &ModelConfig) -> Vec<WeightName> {
    let mut v = vec![WeightName::Embed];
    for i in 0..cfg.num_layers {
        for w in layer_weight_names(cfg) {
            v.push(WeightName::Layer(i, w));
        }
    }
    v.push(WeightName::FinalNorm);
    if !cfg.tie_word_embeddings {
        v.push(WeightName::LmHead);
    }
    v
}

/// The weights of one layer for a config.
pub fn layer_weight_names(cfg: &ModelConfig) -> Vec<LayerWeight> {
    use LayerWeight::*;
    let mut v = vec![AttnNorm, Q, K, V, O];
    if cfg.attention_bias {
        v.extend([QBias, KBias, VBias]);
    }
    if cfg.has_o_bias() {
        v.push(OBias);
    }
    if cfg.qk_norm {
        v.extend([QNorm, KNorm]);
    }
    v.extend([MlpNorm, Gate, Up, Down]);
    v
}

/// True for the weights kept as [`Linear`] (matrices multiplied by activations).
pub fn is_linear(name: WeightName) -> bool {
    use LayerWeight::*;
    match name {
        WeightName::LmHead => true,
        WeightName::Embed | WeightName::FinalNorm => false,
        WeightName::Layer(_, w) => matches!(w, Q | K | V | O | Gate | Up | Down),
    }
}

/// The shape of a weight, HF layout (`[out, in]` for linears).
pub fn expected_shape(cfg: &ModelConfig, name: WeightName) -> Vec<usize> {
    use LayerWeight::*;
    let (d, f, v, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim);
    let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
    match name {
        WeightName::Embed | WeightName::LmHead => vec![v, d],
        WeightName::FinalNorm => vec![d],
        WeightName::Layer(_, w) => match w {
            AttnNorm | MlpNorm | OBias => vec![d],
            Q => vec![qd, d],
            K | V => vec![kvd, d],
            O => vec![d, qd],
            QBias => vec![qd],
            KBias | VBias => vec![kvd],
            QNorm | KNorm => vec![hd],
            Gate | Up => vec![f, d],
            Down => vec![d, f],
        },
    }
}

/// Checks a tensor's shape against the config; `file_name` is the name in the file.
pub(crate) fn check_shape(file_name: &str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::BadShape { name: file_name.to_string(), got: got.to_vec(), expected: expected.to_vec() })
    }
}

/// A loader's view of its file: one call per weight, each already shape-checked.
pub(crate) trait WeightSource {
    /// A norm, bias or the embedding, as a dense tensor of `dtype`.
    fn dense(&mut self, name: WeightName, dtype: DType) -> Result<Tensor>;
    /// A projection (or the untied LM head).
    fn linear(&mut self, name: WeightName, dtype: DType) -> Result<Linear>;
    /// The LM head of a tied model, given the embedding already loaded.
    fn tied_lm_head(&mut self, embed: &Tensor) -> Result<Linear>;
}

/// Builds [`ModelWeights`] from a source, in [`weight_names`] order.
pub(crate) fn assemble(
    cfg: &ModelConfig,
    dtype: DType,
    src: &mut dyn WeightSource,
    progress: Progress<'_>,
) -> Result<ModelWeights> {
    cfg.validate()?;
    if cfg.has_o_bias() {
        // HF Llama/Qwen3 put the bias on o_proj too when `attention_bias` is set;
        // `LayerWeights` has no field for it yet.
        return Err(Error::BadConfig(format!(
            "{} with attention_bias (which also biases o_proj) is not supported yet",
            cfg.arch.name()
        )));
    }
    let total = weight_names(cfg).len();
    let mut done = 0usize;
    let mut tick = |progress: &mut dyn FnMut(usize, usize)| {
        done += 1;
        progress(done, total);
    };
    let embed = src.dense(WeightName::Embed, dtype)?;
    tick(progress);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let names = layer_weight_names(cfg);
        let mut dense: HashMap<LayerWeight, Tensor> = HashMap::new();
        let mut lin: HashMap<LayerWeight, Linear> = HashMap::new();
        for w in names {
            let name = WeightName::Layer(i, w);
            if is_linear(name) {
                lin.insert(w, src.linear(name, dtype)?);
            } else {
                dense.insert(w, src.dense(name, dtype)?);
            }
            tick(progress);
        }
        let missing = |w: LayerWeight| Error::BadConfig(format!("internal: layer {i} weight {w:?} was not loaded"));
        let mut take_lin = |w: LayerWeight| lin.remove(&w).ok_or_else(|| missing(w));
        let q = take_lin(LayerWeight::Q)?;
        let k = take_lin(LayerWeight::K)?;
        let v = take_lin(LayerWeight::V)?;
        let o = take_lin(LayerWeight::O)?;
        let gate = take_lin(LayerWeight::Gate)?;
        let up = take_lin(LayerWeight::Up)?;
        let down = take_lin(LayerWeight::Down)?;
        let attn_norm = dense.remove(&LayerWeight::AttnNorm).ok_or_else(|| missing(LayerWeight::AttnNorm))?;
        let mlp_norm = dense.remove(&LayerWeight::MlpNorm).ok_or_else(|| missing(LayerWeight::MlpNorm))?;
        layers.push(LayerWeights {
            attn_norm,
            q,
            k,
            v,
            o,
            q_bias: dense.remove(&LayerWeight::QBias),
            k_bias: dense.remove(&LayerWeight::KBias),
            v_bias: dense.remove(&LayerWeight::VBias),
            q_norm: dense.remove(&LayerWeight::QNorm),
            k_norm: dense.remove(&LayerWeight::KNorm),
            mlp_norm,
            gate,
            up,
            down,
        });
    }
    let final_norm = src.dense(WeightName::FinalNorm, dtype)?;
    tick(progress);
    let lm_head = if cfg.tie_word_embeddings {
        src.tied_lm_head(&embed)?
    } else {
        let l = src.linear(WeightName::LmHead, dtype)?;
        tick(progress);
        l
    };
    Ok(ModelWeights { config: cfg.clone(), dtype, embed, layers, final_norm, lm_head })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;

    #[test]
    fn names_follow_flags() {
        let mut cfg = crate::synthetic::random_config(Arch::Qwen2, false);
        let names = weight_names(&cfg);
        assert!(names.contains(&WeightName::Layer(1, LayerWeight::KBias)));
        assert!(!names.contains(&WeightName::Layer(0, LayerWeight::OBias)));
        assert!(names.contains(&WeightName::LmHead));
        cfg.tie_word_embeddings = true;
        assert!(!weight_names(&cfg).contains(&WeightName::LmHead));
        let cfg = crate::synthetic::random_config(Arch::Qwen3, true);
        assert_eq!(expected_shape(&cfg, WeightName::Layer(0, LayerWeight::QNorm)), vec![cfg.head_dim]);
        assert_eq!(expected_shape(&cfg, WeightName::Layer(0, LayerWeight::O)), vec![cfg.hidden_size, cfg.q_dim()]);
    }
}
