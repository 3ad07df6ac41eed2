//! The CUDA backend: turns [`ModelWeights`] into ferrum-cuda's [`CudaDecodeRunner`] (one GPU)
//! and drives it through [`DecodeBackend`].
//!
//! Weights are converted on the host to the GPU dtype (`--dtype`, else f16 for an f16
//! checkpoint and bf16 for any other: [`crate::config::gpu_run_dtype`]); quantized GGUF
//! linears are dequantized first. `--synthetic` shapes get random weights generated on the GPU.

use candle_core::{DType, Tensor};
use std::time::Instant;

use ferrum_cuda::{CudaDecodeRunner, CudaModelSpec, GemvShape, HostData, HostLayer, HostTensor, HostWeights};

use crate::backend::{drive_device_batches, DecodeBackend, DeviceRun, DeviceSampling};
use crate::config::ModelConfig;
use crate::cuda_rank::{CudaRank, DeviceLoopStats};
use crate::error::{Error, Result};
use crate::load::LoadedModel;
use crate::session::SessionOptions;
use crate::step_tune::{
    coordinate_descent, gemv_set, median, tune_windows, CacheEntry, GemvKey, ShapeChoice, StepTune, StepTuneReport,
    TuneCache, TUNE_CAPACITY, TUNE_MARGIN, TUNE_PROBE_STEPS, TUNE_PROMPT, TUNE_REPS, TUNE_WINDOWS,
};
use crate::weights::{Linear, ModelWeights};

/// Maps ferrum-cuda's errors onto ferrum-runner's.
pub fn cuda_error(e: ferrum_cuda::Error) -> Error {
    match e {
        ferrum_cuda::Error::TokenOutOfRange { token, vocab } => Error::TokenOutOfRange { token, vocab },
        ferrum_cuda::Error::PositionOutOfRange { position, capacity, .. } => {
            Error::ContextOverflow { position, capacity }
        }
        ferrum_cuda::Error::CapacityExhausted { len, capacity, .. } => {
            Error::ContextOverflow { position: len, capacity }
        }
        ferrum_cuda::Error::UnknownSequence(s) => Error::UnknownSequence(s),
        ferrum_cuda::Error::Reduce(msg) => Error::Tp(msg),
        // A bad argument or setting (e.g. a malformed FERRUM_* knob) is the caller's input,
        // not an unavailable GPU.
        ferrum_cuda::Error::InvalidArgument(msg) => Error::InvalidInput(msg),
        other => Error::Unavailable("CUDA", other.to_string()),
    }
}

/// The runner's model description for a (single-GPU) config.
pub fn spec_of(cfg: &ModelConfig) -> CudaModelSpec {
    CudaModelSpec {
        vocab: cfg.vocab_size,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        layers: cfg.num_layers,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        rope_inv_freq: cfg.rope_inv_freq(),
        rms_eps: cfg.rms_norm_eps as f32,
        qkv_bias: cfg.attention_bias,
        qk_norm: cfg.qk_norm,
        tied_embeddings: cfg.tie_word_embeddings,
    }
}

/// The GPU dtype for `--dtype` and the checkpoint's own dtype ([`crate::config::gpu_run_dtype`]:
/// `--dtype` wins; else f16 for an f16 checkpoint, bf16 otherwise).
pub fn gpu_dtype(d: Option<DType>, checkpoint: Option<DType>) -> Result<ferrum_cuda::DType> {
    match crate::config::gpu_run_dtype(d, checkpoint) {
        DType::BF16 => Ok(ferrum_cuda::DType::BF16),
        DType::F16 => Ok(ferrum_cuda::DType::F16),
        other => Err(Error::InvalidInput(format!("--device cuda runs f16 or bf16, not {other:?}"))),
    }
}

/// Bytes of weights one decode step reads: every matrix, the norms, one embedding row.
pub fn weight_bytes_per_token(cfg: &ModelConfig, _opts: &SessionOptions) -> u64 {
    let (h, i, v) = (cfg.hidden_size as u64, cfg.intermediate_size as u64, cfg.vocab_size as u64);
    let (q, kv) = (cfg.q_dim() as u64, cfg.kv_dim() as u64);
    let layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h;
    2 * (cfg.num_layers as u64 * layer + v * h + h + h)
}

/// Host copies of the weights in the GPU dtype (what [`HostWeights`] borrows).
struct Converted {
    embed: Vec<half::bf16>,
    embed16: Vec<half::f16>,
    tensors: Vec<Conv>,
}

enum Conv {
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

impl Conv {
    fn data(&self) -> HostData<'_> {
        match self {
            Conv::Bf16(v) => HostData::BF16(v),
            Conv::F16(v) => HostData::F16(v),
        }
    }
}

fn convert(t: &Tensor, dtype: ferrum_cuda::DType) -> Result<Conv> {
    let flat = t.flatten_all()?;
    Ok(match dtype {
        ferrum_cuda::DType::BF16 => Conv::Bf16(flat.to_dtype(DType::BF16)?.to_vec1::<half::bf16>()?),
        ferrum_cuda::DType::F16 => Conv::F16(flat.to_dtype(DType::F16)?.to_vec1::<half::f16>()?),
    })
}

fn dense(l: &Linear) -> Result<Tensor> {
    match l {
        Linear::Dense(t) => Ok(t.clone()),
        Linear::Quantized(_) => l.to_dense(DType::F32),
    }
}

/// Builds a single-GPU runner from host weights. `progress(done, total)` gets bytes uploaded.
pub fn build_runner(
    w: &ModelWeights,
    dtype: ferrum_cuda::DType,
    ordinal: usize,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<CudaDecodeRunner> {
    let cfg = &w.config;
    cfg.validate()?;
    if cfg.has_o_bias() {
        return Err(Error::BadConfig("o_proj bias is not supported by the CUDA runner".into()));
    }
    let mut spec = spec_of(cfg);
    // A tensor-parallel shard keeps the global config; its own widths are its tensors' rows.
    if let Some(l) = w.layers.first() {
        spec.heads = l.q.dims().0 / cfg.head_dim;
        spec.kv_heads = l.k.dims().0 / cfg.head_dim;
        spec.intermediate = l.gate.dims().0;
    }
    // Convert in a fixed order; HostWeights then borrows the converted buffers.
    let mut conv = Converted { embed: Vec::new(), embed16: Vec::new(), tensors: Vec::new() };
    match convert(&w.embed, dtype)? {
        Conv::Bf16(v) => conv.embed = v,
        Conv::F16(v) => conv.embed16 = v,
    }
    let mut shapes: Vec<Vec<usize>> = Vec::new();
    let mut push = |conv: &mut Converted, t: Tensor| -> Result<()> {
        shapes.push(t.dims().to_vec());
        conv.tensors.push(convert(&t, dtype)?);
        Ok(())
    };
    for l in &w.layers {
        push(&mut conv, l.attn_norm.clone())?;
        for lin in [&l.q, &l.k, &l.v, &l.o] {
            push(&mut conv, dense(lin)?)?;
        }
        for t in [&l.q_bias, &l.k_bias, &l.v_bias, &l.q_norm, &l.k_norm].into_iter().flatten() {
            push(&mut conv, t.clone())?;
        }
        push(&mut conv, l.mlp_norm.clone())?;
        for lin in [&l.gate, &l.up, &l.down] {
            push(&mut conv, dense(lin)?)?;
        }
    }
    push(&mut conv, w.final_norm.clone())?;
    if !cfg.tie_word_embeddings {
        push(&mut conv, dense(&w.lm_head)?)?;
    }
    let embed_data = match dtype {
        ferrum_cuda::DType::BF16 => HostData::BF16(&conv.embed),
        ferrum_cuda::DType::F16 => HostData::F16(&conv.embed16),
    };
    let mut it = conv.tensors.iter().zip(shapes).map(|(c, s)| HostTensor::new(s, c.data()));
    let mut next = || it.next().ok_or_else(|| Error::BadConfig("internal: weight list out of step".into()));
    let mut layers = Vec::with_capacity(w.layers.len());
    for l in &w.layers {
        let attn_norm = next()?;
        let (q, k, v, o) = (next()?, next()?, next()?, next()?);
        let mut opt = |present: bool| -> Result<Option<HostTensor<'_>>> {
            if present {
                next().map(Some)
            } else {
                Ok(None)
            }
        };
        let q_bias = opt(l.q_bias.is_some())?;
        let k_bias = opt(l.k_bias.is_some())?;
        let v_bias = opt(l.v_bias.is_some())?;
        let q_norm = opt(l.q_norm.is_some())?;
        let k_norm = opt(l.k_norm.is_some())?;
        let mlp_norm = next()?;
        let (gate, up, down) = (next()?, next()?, next()?);
        layers.push(HostLayer {
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
    let final_norm = next()?;
    let lm_head = if cfg.tie_word_embeddings { None } else { Some(next()?) };
    let hw = HostWeights { embed: HostTensor::new(w.embed.dims().to_vec(), embed_data), layers, final_norm, lm_head };
    CudaDecodeRunner::new(spec, &hw, dtype, ordinal, progress).map_err(cuda_error)
}

/// One sequence on one GPU (or one rank of a multi-process group: then the runner's reducer
/// is NCCL), as a [`DecodeBackend`]. Decodes through captured graphs by default.
#[derive(Debug)]
pub struct CudaBackend {
    rank: CudaRank,
    active: bool,
    pos: usize,
    logits: Vec<f32>,
    label: String,
    /// A step-level tuning `open` asked for, run at the first prefill (so that it times the
    /// step the caller set up, the screened head on or off).
    pending_tune: Option<StepTune>,
    /// The positions a step-level tuning times ([`tune_windows`]).
    tune_windows: Vec<(usize, usize)>,
    /// Shapes a step-level tuning leaves alone (set by `FERRUM_GEMV_SET`).
    pinned: Vec<GemvKey>,
    /// Where the pending tuning looks for an earlier one's result and keeps its own.
    tune_cache: Option<TuneCache>,
}

const SEQ: u64 = 0;

impl CudaBackend {
    /// Releases the current sequence (if any) and starts a new one of `capacity` tokens.
    fn new_sequence(&mut self, capacity: usize) -> Result<()> {
        if self.active {
            self.rank.runner().release(SEQ).map_err(cuda_error)?;
            self.active = false;
        }
        self.rank.runner().init_sequence(SEQ, capacity).map_err(cuda_error)?;
        self.active = true;
        Ok(())
    }

    /// Wraps a runner.
    pub fn new(runner: CudaDecodeRunner) -> Self {
        let label = match runner.device_info() {
            Ok(i) => format!("cuda:{} {} ({})", i.ordinal, runner.dtype().name(), i.name),
            Err(_) => format!("cuda {}", runner.dtype().name()),
        };
        Self::with_rank(CudaRank::new(runner, 0), label)
    }
    /// Wraps a rank of a multi-process group (its runner already has its NCCL reducer).
    pub fn with_rank(rank: CudaRank, label: String) -> Self {
        Self {
            rank,
            active: false,
            pos: 0,
            logits: Vec::new(),
            label,
            pending_tune: None,
            tune_windows: TUNE_WINDOWS.to_vec(),
            pinned: Vec::new(),
            tune_cache: None,
        }
    }
    /// The runner.
    pub fn runner(&mut self) -> &mut CudaDecodeRunner {
        self.rank.runner()
    }
    /// The rank (graphs, counters, fault injection).
    pub fn rank(&mut self) -> &mut CudaRank {
        &mut self.rank
    }
}

impl CudaBackend {
    /// Tunes the GEMV launch variants on the whole captured step ([`crate::step_tune`]), now:
    /// a sequence of [`TUNE_CAPACITY`] rows gets a prompt of [`TUNE_PROMPT`] tokens; a probe of
    /// [`TUNE_PROBE_STEPS`] steps decides whether `mode` wants the step's length; then one
    /// untimed greedy pass up to the last timed position (so every KV row a window reads was
    /// written); a measurement then times device-fed greedy steps over each of the tuning's
    /// windows ([`tune_windows`]), shape by shape and candidate by candidate
    /// ([`coordinate_descent`]). The variants give bit-identical results, so only speed
    /// changes. Runs only with graphs (eager steps time the host); `None` when it did not run,
    /// a report whose [`searched`](StepTuneReport::searched) is false when the probe's step
    /// was too long for `mode` (nothing changed). Shapes `FERRUM_GEMV_SET` set are left alone,
    /// and so are shapes the step does not launch now ([`GemvShape::launched`]: the LM head's
    /// under the screened head, the folded q/k/v's when it is off). With more than [`TUNE_PROBE_STEPS`] steps a graph
    /// (`FERRUM_GRAPH_STEPS`) the windows replay shorter graphs than a long decode does.
    /// Any sequence is released first; afterwards there is none (the next
    /// [`prefill`](DecodeBackend::prefill) starts one). On an error the variants may be any of
    /// the candidates (all valid).
    pub fn tune_step(&mut self, mode: StepTune) -> Result<Option<StepTuneReport>> {
        // Shapes with a choice that the step may launch (the probe's step below says which it
        // does: GemvShape::launched), less those FERRUM_GEMV_SET pinned.
        let shapes: Vec<GemvShape> = (self.rank.runner().gemv_shapes().into_iter())
            .filter(|s| s.candidates.len() > 1 && s.launched != Some(false) && !self.pinned.contains(&s.key()))
            .collect();
        if mode == StepTune::Off || !self.rank.graphed() || shapes.is_empty() {
            return Ok(None);
        }
        let t0 = Instant::now();
        self.new_sequence(TUNE_CAPACITY)?;
        let out = self.tune_shapes(mode, shapes);
        // The tuning's sequence goes whatever happened; an error of the tuning comes first.
        // `release` fails only for a sequence that is already gone, so none is active either way.
        let released = self.rank.runner().release(SEQ).map_err(cuda_error);
        self.active = false;
        let out = out?;
        released?;
        let (first, best, choices) = out;
        Ok(Some(StepTuneReport {
            first_step_s: first,
            best_step_s: best,
            searched: choices.is_some(),
            shapes: choices.unwrap_or_default(),
            wall_s: t0.elapsed().as_secs_f64(),
        }))
    }

    /// [`tune_step`](Self::tune_step)'s search on the open tuning sequence over those of
    /// `shapes` that the probe's step launched: `(first step, best step, each searched shape
    /// and its decision)`, seconds a step; no decisions (and the probe's step twice) when
    /// `mode` does not want a step that long.
    fn tune_shapes(&mut self, mode: StepTune, shapes: Vec<GemvShape>) -> Result<TuneOutcome> {
        let windows = self.tune_windows.clone();
        // tune_windows keeps every window inside TUNE_PROMPT..=TUNE_CAPACITY.
        let end = windows.iter().map(|w| w.0 + w.1).max().unwrap_or(TUNE_PROMPT).max(TUNE_PROMPT + TUNE_PROBE_STEPS);
        self.rank.runner().prefill(SEQ, &[0; TUNE_PROMPT]).map_err(cuda_error)?;
        // Whether the step is short enough, from a few steps (a long step's model is not
        // tuned, and should not pay for the passes below): the second of two runs (the first
        // captures the graphs).
        let probe = (TUNE_PROMPT, TUNE_PROBE_STEPS);
        measure_once(&mut self.rank, &[probe], TUNE_PROMPT + TUNE_PROBE_STEPS)?;
        let probed = measure_once(&mut self.rank, &[probe], TUNE_PROMPT + TUNE_PROBE_STEPS)?;
        if !mode.wants(probed) {
            return Ok((probed, probed, None));
        }
        // The probe encoded the step under the current settings (or replayed a graph of them):
        // only the shapes it launched are searched.
        let now = self.rank.runner().gemv_shapes();
        let shapes: Vec<GemvShape> =
            shapes.into_iter().filter(|s| now.iter().any(|n| n.key() == s.key() && n.launched == Some(true))).collect();
        if shapes.is_empty() {
            return Ok((probed, probed, Some(Vec::new()))); // nothing with a choice runs (cuBLAS, say)
        }
        // One untimed pass over every position a window reads.
        self.rank.device_begin(SEQ, 0, TUNE_PROMPT)?;
        self.rank.device_steps(SEQ, TUNE_PROMPT + 1, end - TUNE_PROMPT, DeviceSampling::Greedy)?;
        self.rank.device_end(SEQ, end)?;
        let first = measure_step(&mut self.rank, &windows, end)?;
        let list: Vec<(usize, Vec<usize>)> = shapes.iter().map(|s| (s.variant, s.candidates.clone())).collect();
        // Both closures need the rank (one at a time).
        let rank = std::cell::RefCell::new(&mut self.rank);
        let mut set = |i: usize, v: usize| {
            let s = &shapes[i];
            rank.borrow_mut().runner().set_gemv_variant(s.rows, s.cols, s.gateup, v).map_err(cuda_error)
        };
        let mut measure = || measure_step(&mut rank.borrow_mut(), &windows, end);
        let (best, choices) = coordinate_descent(&list, TUNE_MARGIN, first, &mut set, &mut measure)?;
        Ok((first, best, Some(choices.into_iter().map(|c| (shapes[c.shape].key(), c)).collect())))
    }

    /// Has the next [`prefill`](DecodeBackend::prefill) (or `profile_prefill`) run a step-level
    /// tuning first ([`tune_step`](Self::tune_step) with `mode`; what `open` does with
    /// `FERRUM_STEP_TUNE`), so that it times the step as the caller then has it set up (the
    /// screened head on or off). Under [`StepTune::Auto`] a failed tuning is a warning and the
    /// variants it had changed are set back; under [`StepTune::On`] that prefill returns the
    /// tuning's error (and the next one runs without a tuning).
    pub fn tune_at_first_prefill(&mut self, mode: StepTune) {
        self.pending_tune = Some(mode);
    }

    /// Where [`tune_at_first_prefill`](Self::tune_at_first_prefill)'s tuning looks for an
    /// earlier result (under [`StepTune::Auto`]) and keeps its own; `open` sets
    /// `FERRUM_STEP_TUNE_CACHE`'s ([`TuneCache::from_env`]). None: always tune, keep nothing.
    pub fn set_tune_cache(&mut self, cache: Option<TuneCache>) {
        self.tune_cache = cache;
    }

    /// Runs the tuning `open` deferred (once; before the first prefill). Under
    /// [`StepTune::Auto`] an error of the tuning is a warning and the start-up variants are set
    /// back (an error doing that is returned); under [`StepTune::On`] it is returned.
    fn run_pending_tune(&mut self) -> Result<()> {
        let Some(mode) = self.pending_tune.take() else { return Ok(()) };
        if mode == StepTune::Off {
            return Ok(());
        }
        let start = self.rank.runner().gemv_shapes();
        let cache = self.tune_cache.clone().map(|c| (self.tune_about(), c));
        // Auto takes an earlier tuning's result when one ran on the same build, GPU, model and
        // settings; On always tunes (and refreshes the entry).
        if let (StepTune::Auto, Some((about, c))) = (mode, &cache) {
            match c.get(about) {
                Ok(Some(e)) if !e.usable() => {
                    tracing::debug!(
                        step_us = e.step_us,
                        "step tuning: a cached 'too long' that auto would tune now; probing again"
                    );
                }
                Ok(Some(e)) if e.variants.is_empty() => {
                    tracing::info!(path = %c.path().display(), step_us = e.step_us, "step tuning: skipped (cached: the step is too long)");
                    return Ok(());
                }
                Ok(Some(e)) => match self.apply_cached(&e) {
                    Ok(()) => {
                        tracing::info!(path = %c.path().display(), step_us = e.step_us, variants = ?e.variants, "step tuning: cached");
                        return Ok(());
                    }
                    Err(err) => {
                        tracing::warn!(%err, "step tuning: the cached variants do not apply; tuning again");
                        self.restore_variants(&start)?;
                    }
                },
                Ok(None) => {}
                Err(err) => tracing::warn!(%err, "step tuning: cache not read"),
            }
        }
        match self.tune_step(mode) {
            Ok(Some(r)) => {
                for ((rows, cols, gateup), c) in &r.shapes {
                    tracing::info!(rows, cols, gateup, from = c.from, to = c.to, timed = ?c.timed, "step tuning: GEMV variant");
                }
                if r.searched {
                    tracing::info!(
                        step_us_before = r.first_step_s * 1e6,
                        step_us_after = r.best_step_s * 1e6,
                        tuning_ms = r.wall_s * 1e3,
                        "step tuning done"
                    );
                } else {
                    tracing::info!(
                        step_us = r.first_step_s * 1e6,
                        probe_ms = r.wall_s * 1e3,
                        "step tuning: step too long, not tuned"
                    );
                }
                // A step clearly too long to tune is cached too: later processes skip the probe.
                let stored =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                if let Some((c, entry)) =
                    cache.and_then(|(about, c)| Some((c, CacheEntry::from_report(about, &r, stored)?)))
                {
                    if let Err(err) = c.put(entry) {
                        tracing::warn!(%err, "step tuning: result not cached");
                    }
                }
            }
            Ok(None) => {}
            Err(e) if mode.strict() => {
                // Valid variants either way; the start-up ones are the known state.
                self.restore_variants(&start)?;
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(%e, "step tuning failed: keeping the start-up GEMV variants");
                self.restore_variants(&start)?;
            }
        }
        Ok(())
    }

    /// Sets every shape of `start` (an earlier [`gemv_shapes`](CudaDecodeRunner::gemv_shapes))
    /// back to its variant there.
    fn restore_variants(&mut self, start: &[GemvShape]) -> Result<()> {
        let now = self.rank.runner().gemv_shapes();
        for s in start.iter().filter(|s| !now.contains(s)) {
            self.rank.runner().set_gemv_variant(s.rows, s.cols, s.gateup, s.variant).map_err(cuda_error)?;
        }
        Ok(())
    }

    /// Sets the variants of a cached tuning (each checked by `set_gemv_variant`).
    fn apply_cached(&mut self, e: &CacheEntry) -> Result<()> {
        for &(rows, cols, gateup, v) in &e.variants {
            self.rank.runner().set_gemv_variant(rows, cols, gateup, v).map_err(cuda_error)?;
        }
        Ok(())
    }

    /// What a step tuning's result depends on, in words (its cache key is the hash): this
    /// crate's version and the kernels' build (a hash of the embedded PTX; other host code is
    /// not hashed), the GPU, the dtype, the model's shape, the GEMV shapes and their
    /// candidates, the step's options (projection, screened head, folded q/k/v, steps a
    /// graph), the timed windows, `auto`'s step limit and every `FERRUM_*` setting but the
    /// cache's own.
    fn tune_about(&mut self) -> String {
        static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let ptx = PTX.get_or_init(|| {
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            for (name, text) in ferrum_cuda::ptx::MODULES.iter().chain(ferrum_cuda::ptx::MODULES_SM90) {
                h.update(name.as_bytes());
                h.update(text.as_bytes());
            }
            h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect()
        });
        let mut env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| {
                k.starts_with("FERRUM_")
                    && !matches!(
                        k.as_str(),
                        "FERRUM_STEP_TUNE" | "FERRUM_STEP_TUNE_CACHE" | "FERRUM_CACHE" | "FERRUM_PYTHON"
                    )
            })
            .collect();
        env.sort();
        let windows = self.tune_windows.clone();
        let r = self.rank.runner();
        let device = match r.device_info() {
            Ok(i) => {
                format!("{} cc {}.{} {} B", i.name, i.compute_capability.0, i.compute_capability.1, i.total_memory)
            }
            Err(e) => format!("unknown device ({e})"),
        };
        let shapes: Vec<_> = r.gemv_shapes().into_iter().map(|s| (s.rows, s.cols, s.gateup, s.candidates)).collect();
        format!(
            "ferrum-runner {} | ptx {ptx} | {device} | {} | {:?} | shapes {shapes:?} | {:?} projection | screened head {} \
             folded qkv {} steps a graph {} | windows {windows:?} | auto up to {} us | env {env:?}",
            env!("CARGO_PKG_VERSION"),
            r.dtype().name(),
            r.spec(),
            r.projection(),
            r.screened_head(),
            r.folded_qkv(),
            r.steps_per_graph(),
            crate::step_tune::AUTO_MAX_STEP_S * 1e6,
        )
    }
}

/// What [`CudaBackend::tune_shapes`] found: the first and the best step (seconds) and, when it
/// searched, each searched shape and its decision.
type TuneOutcome = (f64, f64, Option<Vec<(GemvKey, ShapeChoice)>>);

/// Seconds a step of device-fed greedy decoding over `windows` (`(first position, steps)`) of
/// the tuning sequence, whose rows up to `end` hold a decoded sequence (or will not be read):
/// the median of [`TUNE_REPS`] timed passes over every window, after one untimed pass (which
/// captures the graphs when the settings changed).
fn measure_step(rank: &mut CudaRank, windows: &[(usize, usize)], end: usize) -> Result<f64> {
    measure_once(rank, windows, end)?;
    let mut times = Vec::with_capacity(TUNE_REPS);
    for _ in 0..TUNE_REPS {
        times.push(measure_once(rank, windows, end)?);
    }
    Ok(median(times))
}

/// One timed pass of [`measure_step`]: seconds a step. Each window waits for its tokens, so it
/// times the GPU's steps plus one read-back, the same for every setting.
fn measure_once(rank: &mut CudaRank, windows: &[(usize, usize)], end: usize) -> Result<f64> {
    let steps: usize = windows.iter().map(|w| w.1).sum();
    let mut t = 0.0;
    for &(first, n) in windows {
        rank.device_begin(SEQ, 0, first)?;
        let t0 = Instant::now();
        rank.device_steps(SEQ, first + 1, n, DeviceSampling::Greedy)?;
        t += t0.elapsed().as_secs_f64();
        // The rows past the window keep what the sequence held there.
        rank.device_end(SEQ, end)?;
    }
    Ok(t / steps.max(1) as f64)
}

impl DecodeBackend for CudaBackend {
    fn vocab_size(&self) -> usize {
        self.rank.spec_vocab()
    }

    fn prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        self.run_pending_tune()?;
        self.new_sequence(capacity)?;
        self.rank.runner().prefill(SEQ, tokens).map_err(cuda_error)?;
        self.pos = tokens.len();
        self.rank.runner().logits_to_host(&mut self.logits).map_err(cuda_error)?;
        self.rank.check_collectives()?;
        Ok(self.logits.clone())
    }

    fn profile_prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Option<Vec<(&'static str, f64)>>> {
        self.run_pending_tune()?;
        self.new_sequence(capacity)?;
        let p = self.rank.runner().profile_prefill(SEQ, tokens).map_err(cuda_error)?;
        self.pos = tokens.len();
        self.rank.check_collectives()?;
        Ok(Some(p))
    }

    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        if !self.active {
            return Err(Error::InvalidInput("step before prefill".into()));
        }
        self.rank.step(SEQ, token, self.pos)?;
        self.pos += 1;
        self.rank.runner().logits_to_host(&mut self.logits).map_err(cuda_error)?;
        self.rank.check_collectives()?;
        Ok(self.logits.clone())
    }

    fn describe(&self) -> String {
        self.label.clone()
    }

    fn profile_step(&mut self, token: u32) -> Result<Option<Vec<(&'static str, f64)>>> {
        if !self.active {
            return Err(Error::InvalidInput("step before prefill".into()));
        }
        let p = self.rank.runner().profile_decode_step(SEQ, token, self.pos).map_err(cuda_error)?;
        self.pos += 1;
        self.rank.check_collectives()?;
        Ok(Some(p))
    }

    fn arm_timeline(&mut self, steps: usize) -> Result<bool> {
        Ok(self.rank.graphed() && self.rank.arm_timeline(steps))
    }

    fn take_timelines(&mut self) -> Result<Vec<ferrum_cuda::timeline::StepTimeline>> {
        Ok(self.rank.take_timeline().into_iter().collect())
    }

    fn has_device_decode(&self) -> bool {
        true
    }

    fn set_screened_head(&mut self, on: bool) -> Result<bool> {
        self.rank.runner().set_screened_head(on).map_err(cuda_error)
    }

    fn prepare(&mut self) -> Result<()> {
        self.run_pending_tune()
    }

    fn decode_on_device(
        &mut self,
        token: u32,
        max_steps: usize,
        sampling: DeviceSampling,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<DeviceRun> {
        if !self.active {
            return Err(Error::InvalidInput("decode before prefill".into()));
        }
        let before = self.rank.stats();
        let pos0 = self.pos;
        let capacity = self.rank.runner().sequence_capacity(SEQ).map_err(cuda_error)?;
        if pos0 + max_steps > capacity {
            return Err(Error::ContextOverflow { position: pos0 + max_steps, capacity });
        }
        self.rank.device_begin(SEQ, token, pos0)?;
        let rank = &mut self.rank;
        let (kept, run) = drive_device_batches(max_steps, on_token, &mut |done, n| {
            rank.device_steps(SEQ, pos0 + 1 + done, n, sampling)
        })?;
        self.rank.device_end(SEQ, pos0 + kept)?;
        self.pos = pos0 + kept;
        Ok(device_run(before, self.rank.stats(), kept, run, self.rank.graphed()))
    }
}

/// The [`DeviceRun`] between two snapshots of a rank's counters.
pub(crate) fn device_run(
    before: DeviceLoopStats,
    after: DeviceLoopStats,
    kept: usize,
    run: usize,
    graphed: bool,
) -> DeviceRun {
    DeviceRun {
        kept,
        run,
        captures: after.captures - before.captures,
        capture_time: after.capture_time - before.capture_time,
        enqueue_time: after.enqueue_time - before.enqueue_time,
        replays: if graphed { after.replays - before.replays } else { 0 },
    }
}

/// Opens a loaded model on GPU `ordinal` (with `opts.tp > 1`: on GPUs `ordinal ..
/// ordinal + tp` in one process; with `opts.dist`: this process's rank of a multi-process group).
pub fn open(m: &LoadedModel, ordinal: usize, opts: &SessionOptions, progress: bool) -> Result<Box<dyn DecodeBackend>> {
    let dtype = gpu_dtype(opts.dtype, crate::config::checkpoint_dtype(&m.source)?)?;
    if let Some(dist) = &opts.dist {
        warn_one_gpu_knobs();
        return crate::cuda_tp::open_process_rank(&m.weights, ordinal, opts.tp, dist, dtype, progress);
    }
    if opts.tp > 1 {
        warn_one_gpu_knobs();
        return crate::cuda_tp::open_group(&m.weights, ordinal, opts.tp, dtype, progress);
    }
    let mut last = 0u64;
    let mut cb = |done: u64, total: u64| {
        if progress && (done == total || done - last >= 1 << 30) {
            last = done;
            eprintln!("uploading weights: {:.1} / {:.1} GB", done as f64 / 1e9, total as f64 / 1e9);
        }
    };
    tuned(CudaBackend::new(build_runner(&m.weights, dtype, ordinal, &mut cb)?))
}

/// A one-GPU backend with the variants `FERRUM_GEMV_SET` names
/// ([`gemv_set`](crate::step_tune::gemv_set)) set, and the step-level tuning `FERRUM_STEP_TUNE`
/// asks for ([`CudaBackend::tune_step`], over `FERRUM_STEP_TUNE_WINDOW`'s positions) due at the
/// first prefill; its decisions are logged (`RUST_LOG=ferrum_runner=info`). Every knob is read
/// and checked here, before anything is timed.
fn tuned(mut b: CudaBackend) -> Result<Box<dyn DecodeBackend>> {
    let env = |k: &str| std::env::var(k).ok();
    let mode = StepTune::from_env()?;
    let windows = tune_windows(env("FERRUM_STEP_TUNE_WINDOW").as_deref())?;
    for ((rows, cols, gateup), v) in gemv_set(env("FERRUM_GEMV_SET").as_deref())? {
        b.runner().set_gemv_variant(rows, cols, gateup, v).map_err(cuda_error)?;
        b.pinned.push((rows, cols, gateup));
    }
    b.tune_windows = windows;
    b.set_tune_cache(if mode == StepTune::Off { None } else { TuneCache::from_env() });
    b.tune_at_first_prefill(mode);
    Ok(Box::new(b))
}

/// Says so when a knob of the one-GPU backend's GEMV variants is set for a tensor-parallel
/// group, which does not read it.
fn warn_one_gpu_knobs() {
    for k in ["FERRUM_GEMV_SET", "FERRUM_STEP_TUNE", "FERRUM_STEP_TUNE_WINDOW", "FERRUM_STEP_TUNE_CACHE"] {
        if std::env::var_os(k).is_some() {
            tracing::warn!("{k} is read by one-GPU backends only: ignored with tensor parallelism");
        }
    }
}

/// Opens a random-weight model of shape `cfg` (weights generated on the GPU, TP shards as slices
/// of the same model); also returns the weight bytes one decode step reads (per rank: the
/// largest shard's).
pub fn open_synthetic(
    cfg: &ModelConfig,
    ordinal: usize,
    opts: &SessionOptions,
) -> Result<(Box<dyn DecodeBackend>, u64)> {
    cfg.validate()?;
    let dtype = gpu_dtype(opts.dtype, None)?;
    if opts.dist.is_some() {
        return Err(Error::InvalidInput("synthetic models run in one process (drop --rank/--world-size)".into()));
    }
    if opts.tp > 1 {
        warn_one_gpu_knobs();
        let backend = crate::cuda_tp::open_group_synthetic(cfg, ordinal, opts.tp, dtype)?;
        return Ok((backend, crate::cuda_tp::shard_bytes_per_token(cfg, opts.tp)?));
    }
    let runner = CudaDecodeRunner::random(spec_of(cfg), dtype, 0x5eed, ordinal).map_err(cuda_error)?;
    Ok((tuned(CudaBackend::new(runner))?, weight_bytes_per_token(cfg, opts)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_arguments_are_invalid_input_not_an_unavailable_gpu() {
        let e = cuda_error(ferrum_cuda::Error::InvalidArgument(
            "FERRUM_GEMV_VARIANT=\"9\": expected a number in 0..=3".into(),
        ));
        assert!(matches!(e, Error::InvalidInput(_)), "{e:?}");
        assert_eq!(e.to_string(), "invalid input: FERRUM_GEMV_VARIANT=\"9\": expected a number in 0..=3");
    }
}
