//! A loaded model ready to generate: weights on a backend, the tokenizer, the chat template.
//!
//! This is what the CLI opens; library users can open one the same way.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use candle_core::DType;

use crate::backend::{CpuBackend, DecodeBackend};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::load::{load_model, LoadedModel};
use crate::model::CpuModel;
use crate::tokenizer::Tokenizer;
use crate::weights::{ModelWeights, WeightFormat};

/// Where to run: `cpu`, `cuda` or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(n)),
                _ => Err(Error::InvalidInput(format!("--device `{s}`: expected cpu, cuda or cuda:N"))),
            },
        }
    }
}

/// The dtype names accepted by `--dtype`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        _ => Err(Error::InvalidInput(format!("--dtype `{s}`: expected f32, f16 or bf16"))),
    }
}

/// This process's place in a multi-process tensor-parallel run (one process per GPU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistOptions {
    /// This process's rank, `0 .. world_size`.
    pub rank: usize,
    /// Number of processes (= the TP degree).
    pub world_size: usize,
    /// How rank 0 hands NCCL's unique id to the others: `file:<path>` or `tcp:<host>:<port>`.
    pub rendezvous: String,
}

/// How to open a session.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// A GGUF file or HF folder; `None` fetches the default model.
    pub model: Option<PathBuf>,
    pub device: DeviceSpec,
    /// Tensor-parallel ranks (≥ 1).
    pub tp: usize,
    /// `None`: GGUF keeps its quantized weights on the CPU, HF folders use f32; on GPUs f16 for an
    /// f16 checkpoint, else bf16 ([`crate::config::gpu_run_dtype`]).
    pub dtype: Option<DType>,
    /// One rank of a multi-process run (CUDA only), `None` for a one-process run.
    pub dist: Option<DistOptions>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self { model: None, device: DeviceSpec::Cpu, tp: 1, dtype: None, dist: None }
    }
}

/// A model opened for generation.
pub struct Session {
    pub tokenizer: Tokenizer,
    pub backend: Box<dyn DecodeBackend>,
    pub config: ModelConfig,
    pub model_path: PathBuf,
    pub load_time: Duration,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("model_path", &self.model_path)
            .field("backend", &self.backend.describe())
            .finish()
    }
}

impl Session {
    /// Loads the model and tokenizer and builds the backend. `progress` prints to stderr.
    pub fn open(opts: &SessionOptions, progress: bool) -> Result<Self> {
        if opts.tp == 0 {
            return Err(Error::InvalidInput("--tp must be at least 1".into()));
        }
        if opts.dist.is_some() && opts.device == DeviceSpec::Cpu {
            return Err(Error::InvalidInput("--rank/--world-size run one process per GPU: use --device cuda".into()));
        }
        let t0 = Instant::now();
        let path = match &opts.model {
            Some(p) => p.clone(),
            None => crate::fetch::default_model_path(progress)?,
        };
        let format = match (opts.dtype, opts.device) {
            (Some(d), _) => WeightFormat::Dense(d),
            (None, DeviceSpec::Cuda(_)) => WeightFormat::Dense(DType::F32),
            (None, DeviceSpec::Cpu) => WeightFormat::Quantized,
        };
        let loaded = load_model(&path, format)?;
        let tokenizer = load_tokenizer(&loaded)?;
        let config = loaded.weights.config.clone();
        let backend = match opts.device {
            DeviceSpec::Cpu => cpu_backend(&loaded.weights, format, opts.tp, progress)?,
            DeviceSpec::Cuda(ordinal) => cuda_backend(&loaded, ordinal, opts, progress)?,
        };
        let load_time = t0.elapsed();
        if progress {
            eprintln!(
                "loaded {} ({} layers, vocab {}) on {} in {:.2} s",
                path.display(),
                config.num_layers,
                config.vocab_size,
                backend.describe(),
                load_time.as_secs_f64()
            );
        }
        Ok(Self { tokenizer, backend, config, model_path: path, load_time })
    }

    /// The model's context length (the KV capacity limit).
    pub fn context_len(&self) -> usize {
        self.config.max_position_embeddings
    }

    /// Tokenizes a prompt; with `chat`, first renders it as one user message through the
    /// model's chat template (whose text already holds any special tokens).
    pub fn encode_prompt(&self, text: &str, chat: bool) -> Result<Vec<u32>> {
        if text.trim().is_empty() {
            return Err(Error::InvalidInput("the prompt is empty".into()));
        }
        let ids = if chat {
            let rendered = self.tokenizer.render_user_prompt(text)?;
            self.tokenizer.encode(&rendered, false)?
        } else {
            self.tokenizer.encode(text, true)?
        };
        if ids.len() >= self.context_len() {
            return Err(Error::InvalidInput(format!(
                "the prompt has {} tokens, but the model's context holds {}: shorten it",
                ids.len(),
                self.context_len()
            )));
        }
        Ok(ids)
    }
}

/// The CPU backend for loaded weights: one rank, or `tp` ranks over shards of them.
pub fn cpu_backend(
    weights: &ModelWeights,
    format: WeightFormat,
    tp: usize,
    progress: bool,
) -> Result<Box<dyn DecodeBackend>> {
    if tp > 1 {
        return crate::tp::cpu_tp_backend(weights, tp, progress);
    }
    let label = match format {
        WeightFormat::Quantized => "quantized".to_string(),
        WeightFormat::Dense(d) => format!("{d:?}").to_lowercase(),
    };
    Ok(Box::new(CpuBackend::new(CpuModel::new(weights)?, label)))
}

/// Bytes of weights a decode step reads: every linear layer, the norms, one embedding row.
pub fn weight_bytes_per_token(w: &ModelWeights) -> u64 {
    use crate::weights::Linear;
    use candle_core::quantized::GgmlDType;
    let t = |x: &candle_core::Tensor| (x.elem_count() * x.dtype().size_in_bytes()) as u64;
    let lin = |l: &Linear| match l {
        Linear::Dense(x) => t(x),
        // Q5_x run as Q8_0 on the CPU (see `Linear::qmatmul`): 34 bytes per 32 weights. Q4_1 runs
        // on ferrum's own kernel (`cpu_quant`) and reads its own 20 bytes per 32 weights.
        Linear::Quantized(q) if matches!(q.dtype(), GgmlDType::Q5_0 | GgmlDType::Q5_1) => {
            q.shape().elem_count() as u64 / 32 * 34
        }
        Linear::Quantized(q) => q.storage_size_in_bytes() as u64,
    };
    let ot = |x: &Option<candle_core::Tensor>| x.as_ref().map_or(0, t);
    let layers: u64 = w
        .layers
        .iter()
        .map(|l| {
            t(&l.attn_norm)
                + t(&l.mlp_norm)
                + lin(&l.q)
                + lin(&l.k)
                + lin(&l.v)
                + lin(&l.o)
                + lin(&l.gate)
                + lin(&l.up)
                + lin(&l.down)
                + ot(&l.q_bias)
                + ot(&l.k_bias)
                + ot(&l.v_bias)
                + ot(&l.q_norm)
                + ot(&l.k_norm)
        })
        .sum();
    let row = t(&w.embed) / w.config.vocab_size as u64;
    layers + t(&w.final_norm) + lin(&w.lm_head) + row
}

fn load_tokenizer(m: &LoadedModel) -> Result<Tokenizer> {
    match &m.source {
        crate::load::ModelSource::Gguf { metadata, .. } => Tokenizer::from_gguf_metadata(metadata),
        crate::load::ModelSource::HfDir { path } => Tokenizer::from_hf_dir(path),
    }
}

#[cfg(feature = "cuda")]
pub fn cuda_backend(
    m: &LoadedModel,
    ordinal: usize,
    opts: &SessionOptions,
    progress: bool,
) -> Result<Box<dyn DecodeBackend>> {
    crate::cuda_backend::open(m, ordinal, opts, progress)
}

/// The CUDA backend (only with the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub fn cuda_backend(_: &LoadedModel, _: usize, _: &SessionOptions, _: bool) -> Result<Box<dyn DecodeBackend>> {
    Err(Error::Unavailable(
        "--device cuda",
        "this ferrum was built without CUDA support; rebuild with `--features cuda`".into(),
    ))
}
