//! The CUDA backend: device queries, the decode runner, its KV cache store.
mod launch;
pub mod peer;

use crate::error::{Error, Result};
use crate::plan::{attn_splits, attn_splits_tc, attn_warps, MAX_SPLITS};
use crate::spec::{
    CopyBandwidth, CudaModelSpec, DType, DeviceInfo, DeviceSampling, Fusion, HostTensor, HostWeights, Projection,
    ShardRange,
};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags, CUgraphInstantiate_flags, CUresult, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, PinnedHostSlice,
    ValidAsZeroBits,
};
use launch::{
    region, whole, ArgmaxSplit, AttnO, AttnRope, Feed, GemvIo, GemvVariant, HeadScreen, Kernels, Region, GEMV_VARIANTS,
};
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) type DevBuf<T> = CudaSlice<T>;

/// Prompt chunks of at least this many tokens take the tensor-core prefill attention (a
/// 32-row query tile per block; shorter ones the row-walking kernel).
const PREFILL_MIN_TOKENS: usize = 16;

/// Tokens per prefill pass (longer prompts are processed in chunks of this many).
pub const PREFILL_CHUNK: usize = 512;

fn unavailable(e: DriverError) -> Error {
    Error::Unavailable(e.to_string())
}

fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let n = CudaContext::device_count().map_err(unavailable)?;
    if ordinal >= n.max(0) as usize {
        return Err(Error::Unavailable(format!("no CUDA device {ordinal} ({n} found)")));
    }
    CudaContext::new(ordinal).map_err(unavailable)
}

/// Number of CUDA devices.
pub fn device_count() -> Result<usize> {
    Ok(CudaContext::device_count().map_err(unavailable)?.max(0) as usize)
}

fn info_of(ctx: &Arc<CudaContext>) -> Result<DeviceInfo> {
    let (free, total) = ctx.mem_get_info().map_err(Error::driver("cuMemGetInfo"))?;
    Ok(DeviceInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name().map_err(Error::driver("cuDeviceGetName"))?,
        compute_capability: ctx.compute_capability().map_err(Error::driver("compute capability"))?,
        total_memory: total as u64,
        free_memory: free as u64,
    })
}

/// Name, compute capability and memory of device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    info_of(&context(ordinal)?)
}

/// Times device-to-device copies of `bytes` bytes with CUDA events (3 warm-ups, median of 10)
/// and reports bytes read plus bytes written per second.
pub fn measure_copy_bandwidth(ordinal: usize, bytes: usize) -> Result<CopyBandwidth> {
    if bytes == 0 {
        return Err(Error::InvalidArgument("copy of 0 bytes".into()));
    }
    let ctx = context(ordinal)?;
    let stream = ctx.new_stream().map_err(Error::driver("creating a stream"))?;
    let src: CudaSlice<u8> = alloc(&ctx, &stream, bytes, "copy-bandwidth source")?;
    let mut dst: CudaSlice<u8> = alloc(&ctx, &stream, bytes, "copy-bandwidth destination")?;
    let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver("creating an event"));
    let (start, end) = (ev()?, ev()?);
    for _ in 0..3 {
        stream.memcpy_dtod(&src, &mut dst).map_err(Error::driver("memcpy"))?;
    }
    let mut times = Vec::with_capacity(10);
    for _ in 0..10 {
        start.record(&stream).map_err(Error::driver("event record"))?;
        stream.memcpy_dtod(&src, &mut dst).map_err(Error::driver("memcpy"))?;
        end.record(&stream).map_err(Error::driver("event record"))?;
        end.synchronize().map_err(Error::driver("event sync"))?;
        times.push(start.elapsed_ms(&end).map_err(Error::driver("event time"))? as f64 / 1e3);
    }
    times.sort_by(f64::total_cmp);
    let seconds = times[times.len() / 2];
    Ok(CopyBandwidth { bytes: bytes as u64, seconds, bytes_per_second: 2.0 * bytes as f64 / seconds })
}

/// Starts (`on`) or stops the active profiling tool's collection on GPU `ordinal`'s primary
/// context (`cuProfilerStart` / `cuProfilerStop`): under `ncu --profile-from-start off` only
/// the kernels launched in between are profiled. Without a profiling tool attached it does
/// nothing.
pub fn profiler_range(ordinal: usize, on: bool) -> Result<()> {
    let ctx = context(ordinal)?;
    ctx.bind_to_thread().map_err(Error::driver("binding the context"))?;
    // SAFETY: both calls take no arguments and act on the current context, which was bound to
    // this thread just above and is kept alive by `ctx` across the call.
    let r = unsafe {
        if on {
            cudarc::driver::sys::cuProfilerStart()
        } else {
            cudarc::driver::sys::cuProfilerStop()
        }
    };
    r.result().map_err(Error::driver(if on { "cuProfilerStart" } else { "cuProfilerStop" }))
}

/// Allocates `n` zeroed elements, failing with [`Error::OutOfMemory`] (bytes asked and free)
/// when the device lacks room.
fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    n: usize,
    what: &str,
) -> Result<CudaSlice<T>> {
    let n = n.max(1);
    let asked = n.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| Error::OutOfMemory {
        what: what.into(),
        asked: u64::MAX,
        free: 0,
        total: 0,
    })?;
    let (free, total) = ctx.mem_get_info().map_err(Error::driver("cuMemGetInfo"))?;
    let oom = || Error::OutOfMemory { what: what.into(), asked: asked as u64, free: free as u64, total: total as u64 };
    if asked > free {
        return Err(oom());
    }
    stream.alloc_zeros::<T>(n).map_err(|e| {
        if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            oom()
        } else {
            Error::Driver { what: "cuMemAlloc", msg: e.to_string() }
        }
    })
}

/// Where the TP layer sums a per-layer partial result over ranks.
pub struct ReduceBuf<'a> {
    /// The buffer, reduced in place. Always fp32, whatever the model dtype: activations stay
    /// fp32 between kernels (only weights and the KV cache are 16-bit).
    pub data: &'a mut CudaSlice<f32>,
    /// Elements to reduce (from the start of `data`).
    pub len: usize,
    /// The runner's stream: enqueue the reduction on it (or order against it).
    pub stream: &'a Arc<CudaStream>,
}

impl std::fmt::Debug for ReduceBuf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReduceBuf").field("len", &self.len).finish()
    }
}

/// The two per-layer reduction points (after the o-projection, after the down-projection).
/// Tensor parallelism inserts an all-reduce here; one GPU needs none ([`NoReduce`]).
pub trait Reducer: Send {
    /// Sums `buf` over ranks, in place, ordered on `buf.stream`.
    fn all_reduce(&mut self, buf: ReduceBuf<'_>) -> Result<()>;

    /// True when [`all_reduce`](Self::all_reduce) does nothing (one rank): the runner may then
    /// fuse the residual adds and norms into the projections around the reduction points.
    fn is_identity(&self) -> bool {
        false
    }

    /// The one-shot peer all-reduce behind this reducer, if any ([`peer::PeerReducer`]): the
    /// runner then sums a decode step's partials with the kernel that also does the residual
    /// add + RMSNorm after it (one launch instead of the collective and the norm).
    fn peer(&self) -> Option<&peer::PeerRank> {
        None
    }
}

/// The single-GPU reducer: does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoReduce;

impl Reducer for NoReduce {
    fn all_reduce(&mut self, _buf: ReduceBuf<'_>) -> Result<()> {
        Ok(())
    }
    fn is_identity(&self) -> bool {
        true
    }
}

/// The buffers and launch shapes a captured device-fed step bakes in (see
/// [`CudaDecodeRunner::device_step_key`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceStepKey {
    k: u64,
    v: u64,
    history: u64,
    capacity: usize,
    n_splits: usize,
    dtype: DType,
    projection: Projection,
    /// Bumped whenever something a captured step bakes in changes outside the sequence
    /// (the reducer, the projection mode, the GEMV variants, the fusion settings).
    generation: u64,
}

/// Logits of the last position, on the device (fp32, `vocab` of them).
#[derive(Debug)]
pub struct DeviceLogits {
    buf: CudaSlice<f32>,
}

impl DeviceLogits {
    /// Number of logits (the vocabulary size).
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    /// The device buffer.
    pub fn as_slice(&self) -> &CudaSlice<f32> {
        &self.buf
    }
}

#[derive(Debug)]
struct LayerW {
    attn_norm: CudaSlice<u16>,
    /// `[q_dim + 2*kv_dim, hidden]` (q, k, v stacked).
    wqkv: CudaSlice<u16>,
    bqkv: Option<CudaSlice<u16>>,
    q_norm: Option<CudaSlice<u16>>,
    k_norm: Option<CudaSlice<u16>>,
    wo: CudaSlice<u16>,
    mlp_norm: CudaSlice<u16>,
    /// `[2*intermediate, hidden]` (gate, up stacked).
    wgu: CudaSlice<u16>,
    wdown: CudaSlice<u16>,
}

#[derive(Debug)]
struct Weights {
    embed: CudaSlice<u16>,
    layers: Vec<LayerW>,
    final_norm: CudaSlice<u16>,
    /// `None`: tied to `embed`.
    lm_head: Option<CudaSlice<u16>>,
    /// The folded q/k/v projection ([`CudaDecodeRunner::set_folded_qkv`]; fold.cu's fold_qkv):
    /// for each layer but the last, its down projection with the next layer's q/k/v,
    /// `[(hidden + qkv) x (inter + hidden)]`.
    fold: Option<Vec<CudaSlice<u16>>>,
}

/// The screened LM head's device buffers ([`CudaDecodeRunner::set_screened_head`]; misc.cu):
/// an int8 copy of the rows a device-fed step covers (the whole head, or a vocab split's
/// share) with a scale and a bound coefficient a row, the overflow guard, the hand-off state
/// and the candidate list.
struct ScreenedHead {
    /// The head's rows `(r0, rn)` the copy holds.
    rows: (usize, usize),
    /// `[rn][hidden]`
    q: CudaSlice<i8>,
    scale: CudaSlice<f32>,
    coef: CudaSlice<f32>,
    /// `(1 + gamma) max |w|` over the finite rows, rounded up (`+inf`: never a bound).
    ovf: f32,
    /// `[floor, count, last step's count]`; the pick kernel resets the first two after every
    /// step, `device_decode_begin` all three.
    state: CudaSlice<i32>,
    /// `[rn][2]`: (logit bits, vocabulary row) of each re-read row.
    list: CudaSlice<u32>,
}

impl ScreenedHead {
    /// A step's view of the copy.
    fn view<'a>(&'a self, st: &CudaStream) -> Result<HeadScreen<'a>> {
        Ok(HeadScreen {
            q: whole(&self.q, st)?,
            scale: whole(&self.scale, st)?,
            coef: whole(&self.coef, st)?,
            ovf: self.ovf,
            state: whole(&self.state, st)?,
            list: whole(&self.list, st)?,
            base: self.rows.0,
        })
    }
}

/// What a forward pass ends with: the LM head's rows `r0 .. r0 + rn` (all of them, or a vocab
/// split's share) into the logits, or the screened head over those rows (its list, for
/// `head_pick`; the logits are not written).
enum HeadJob<'a> {
    Logits(&'a mut CudaSlice<f32>, (usize, usize)),
    /// Over the copy's own rows.
    Screen(&'a ScreenedHead),
}

/// The initial hand-off state of the screened head: the floor at -inf (misc.cu's ord_of), no
/// entries, none last step.
const HEAD_STATE_INIT: [i32; 3] = [(0xff80_0000u32 ^ 0x7fff_ffff) as i32, 0, 0];

/// Activation buffers for up to `cap` tokens per pass (allocated once). Every activation is
/// fp32 (x the residual stream, y the normed input of the projections, ...); `xh` holds the
/// model-dtype copy of a projection input that a cuBLAS GEMM needs (prefill, or
/// [`Projection::Cublas`]).
#[derive(Debug)]
struct Acts {
    cap: usize,
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    o: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    h: CudaSlice<f32>,
    xh: CudaSlice<u16>,
    /// `[tokens (cap) | start position]`: the step parameters kernels read.
    step: CudaSlice<u32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// One ticket counter per head for the fused split-KV merge (zero between launches).
    attn_counters: CudaSlice<u32>,
    /// Each head's share of the o projection `[heads][hidden]` and the o-fused attention's
    /// ticket counter per row range (`plan::ATTN_MAX_CLUSTER`, zero between launches).
    part_o: CudaSlice<f32>,
    o_ticket: CudaSlice<u32>,
    /// The folded q/k/v projection's activations (one token): two buffers of
    /// [`fold_stride`] floats, `[h (inter) | x (hidden) | u (qkv)]`; layer `l` uses buffer
    /// `l % 2` (its residual x, its MLP's h, and u, its q/k/v before the norm's scalar, written
    /// by the previous layer's down projection) and its down projection reads `[h | x]` and
    /// writes the other buffer's `[x | u]`. Allocated by `set_folded_qkv` with the folded
    /// matrices and freed with them (the decode activations only), so that an unfolded
    /// runner allocates nothing for it.
    fold: Option<CudaSlice<f32>>,
}

/// Floats in one of [`Acts::fold`]'s two buffers.
fn fold_stride(s: &CudaModelSpec) -> usize {
    s.intermediate + s.hidden + s.qkv_dim()
}

impl Acts {
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        s: &CudaModelSpec,
        cap: usize,
        splits: usize,
    ) -> Result<Self> {
        let a = |n: usize, w: &str| alloc::<f32>(ctx, stream, n, w);
        let widest_input = s.hidden.max(s.q_dim()).max(s.intermediate);
        Ok(Acts {
            cap,
            x: a(cap * s.hidden, "activations (residual)")?,
            y: a(cap * s.hidden, "activations (normed)")?,
            qkv: a(cap * s.qkv_dim(), "activations (qkv)")?,
            attn: a(cap * s.q_dim(), "activations (attention)")?,
            o: a(cap * s.hidden, "activations (projection out)")?,
            gu: a(cap * 2 * s.intermediate, "activations (gate|up)")?,
            h: a(cap * s.intermediate, "activations (mlp)")?,
            xh: alloc::<u16>(ctx, stream, cap * widest_input, "activations (GEMM input)")?,
            step: alloc::<u32>(ctx, stream, cap + 1, "step parameters")?,
            part_acc: alloc::<f32>(ctx, stream, s.heads * splits * s.head_dim, "attention partials")?,
            part_ml: alloc::<f32>(ctx, stream, s.heads * splits * 2, "attention partials")?,
            attn_counters: alloc::<u32>(ctx, stream, s.heads, "attention split counters")?,
            part_o: alloc::<f32>(ctx, stream, s.heads * s.hidden, "o projection partials")?,
            o_ticket: alloc::<u32>(ctx, stream, crate::plan::ATTN_MAX_CLUSTER, "o projection tickets")?,
            fold: None,
        })
    }
}

#[derive(Debug)]
struct Sequence {
    /// `[layers][kv_heads][capacity][head_dim]`
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    /// Tokens chosen on the device, by position (`capacity + 1` entries; see
    /// [`CudaDecodeRunner::enqueue_device_step`]).
    history: CudaSlice<u32>,
    capacity: usize,
    len: usize,
    /// KV splits of the decode attention (fixed per sequence, so the grid never changes).
    n_splits: usize,
}

/// One GPU's decode runner: weights, activations, KV caches of its sequences, one stream.
pub struct CudaDecodeRunner {
    spec: CudaModelSpec,
    ctx: Arc<CudaContext>,
    k: Kernels,
    w: Weights,
    inv_freq: CudaSlice<f32>,
    decode: Acts,
    prefill: Option<Acts>,
    logits: DeviceLogits,
    argmax_v: CudaSlice<f32>,
    argmax_i: CudaSlice<u32>,
    argmax_out: CudaSlice<u32>,
    seqs: HashMap<u64, Sequence>,
    /// The sequence whose device-fed decoding owns the decode step buffer (set by
    /// [`CudaDecodeRunner::device_decode_begin`], cleared by anything else that writes it).
    fed: Option<u64>,
    /// Pinned host buffer the token read-back copies into, and how many it last received.
    readback: Option<PinnedHostSlice<u32>>,
    readback_len: usize,
    /// Recorded after each read-back copy; waited for before the tokens are read.
    readback_done: Option<CudaEvent>,
    /// See [`DeviceStepKey`]'s `generation`.
    generation: u64,
    /// The GEMV shapes the last encoded one-token device-fed step launched, and the
    /// `generation` it was encoded under ([`GemvShape::launched`]).
    step_gemvs: Option<(u64, std::collections::BTreeSet<GemvKey>)>,
    reducer: Box<dyn Reducer>,
    projection: Projection,
    sms: usize,
    /// The TP vocab split of device-fed steps ([`CudaDecodeRunner::set_vocab_split`]).
    head_split: Option<HeadSplit>,
    /// The screened head of greedy device-fed steps ([`CudaDecodeRunner::set_screened_head`]).
    screen: Option<ScreenedHead>,
}

/// A TP rank's share of the LM head under the vocab split: it computes logits for the rows
/// `rows` only, and the ranks agree on the token through `xchg` (`2 * world` floats: each
/// rank's best value and index, summed over the ranks by the reducer).
#[derive(Debug)]
struct HeadSplit {
    rank: usize,
    world: usize,
    rows: std::ops::Range<usize>,
    xchg: CudaSlice<f32>,
}

impl std::fmt::Debug for CudaDecodeRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDecodeRunner")
            .field("spec", &self.spec)
            .field("dtype", &self.k.dtype)
            .field("device", &self.ctx.ordinal())
            .field("sequences", &self.seqs.len())
            .field("projection", &self.projection)
            .finish()
    }
}

const MATRIX_HALF_WIDTH: f32 = 0.02 * 1.732_050_8; // uniform with std 0.02
const NORM_HALF_WIDTH: f32 = 0.1;

struct Setup {
    ctx: Arc<CudaContext>,
    k: Kernels,
    sms: usize,
}

fn setup(spec: &CudaModelSpec, dtype: DType, device: usize) -> Result<Setup> {
    spec.validate()?;
    let ctx = context(device)?;
    // SAFETY: every buffer of this runner is used on its one stream only (the Reducer
    // contract says reductions are ordered on that stream), so cudarc's cross-stream event
    // tracking is not needed; it is turned off before anything is allocated.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(Error::driver("creating a stream"))?;
    let k = Kernels::load(&ctx, stream, dtype)?;
    let sms = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(Error::driver("device attribute"))?
        .max(1) as usize;
    Ok(Setup { ctx, k, sms })
}

/// Expected shapes of the per-layer weights.
struct Shapes {
    q: [usize; 2],
    kv: [usize; 2],
    o: [usize; 2],
    gu: [usize; 2],
    down: [usize; 2],
}

fn shapes(s: &CudaModelSpec) -> Shapes {
    Shapes {
        q: [s.q_dim(), s.hidden],
        kv: [s.kv_dim(), s.hidden],
        o: [s.hidden, s.q_dim()],
        gu: [s.intermediate, s.hidden],
        down: [s.hidden, s.intermediate],
    }
}

/// Uploads host tensors (converted to the dtype) into consecutive parts of one buffer.
struct Uploader<'p> {
    dtype: DType,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    staging: Vec<u16>,
    done: u64,
    total: u64,
    progress: &'p mut dyn FnMut(u64, u64),
}

const STAGING: usize = 1 << 22;

impl Uploader<'_> {
    fn upload(&mut self, parts: &[(&str, &HostTensor<'_>)], what: &str) -> Result<CudaSlice<u16>> {
        let n: usize = parts.iter().map(|(_, t)| t.data.len()).sum();
        let mut buf = alloc::<u16>(&self.ctx, &self.stream, n, what)?;
        let mut off = 0;
        for (_, t) in parts {
            let len = t.data.len();
            let mut i = 0;
            while i < len {
                let c = (len - i).min(STAGING);
                self.staging.resize(c, 0);
                t.data.convert_into(self.dtype, i, &mut self.staging[..c]);
                let mut dst = buf.slice_mut(off + i..off + i + c);
                self.stream.memcpy_htod(&self.staging[..c], &mut dst).map_err(Error::driver("uploading weights"))?;
                // The staging buffer is reused: wait for the copy to finish reading it.
                self.stream.synchronize().map_err(Error::driver("uploading weights"))?;
                i += c;
                self.done += (c * 2) as u64;
                (self.progress)(self.done, self.total);
            }
            off += len;
        }
        Ok(buf)
    }
}

impl CudaDecodeRunner {
    /// Uploads `weights` (converted to `dtype`) to GPU `device`. `progress(done, total)` is called
    /// with bytes uploaded so far.
    pub fn new(
        spec: CudaModelSpec,
        weights: &HostWeights<'_>,
        dtype: DType,
        device: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        spec.validate()?;
        // Check every shape before touching the GPU.
        let sh = shapes(&spec);
        weights.embed.check("embed", &[spec.vocab, spec.hidden])?;
        weights.final_norm.check("final_norm", &[spec.hidden])?;
        match (&weights.lm_head, spec.tied_embeddings) {
            (Some(t), false) => t.check("lm_head", &[spec.vocab, spec.hidden])?,
            (None, true) => {}
            (Some(_), true) => {
                return Err(Error::BadWeight { name: "lm_head".into(), msg: "given, but the spec says tied".into() })
            }
            (None, false) => {
                return Err(Error::BadWeight { name: "lm_head".into(), msg: "missing (the spec says untied)".into() })
            }
        }
        if weights.layers.len() != spec.layers {
            return Err(Error::BadWeight {
                name: "layers".into(),
                msg: format!("{} layers, spec says {}", weights.layers.len(), spec.layers),
            });
        }
        for (i, l) in weights.layers.iter().enumerate() {
            let n = |s: &str| format!("layers.{i}.{s}");
            l.attn_norm.check(&n("attn_norm"), &[spec.hidden])?;
            l.mlp_norm.check(&n("mlp_norm"), &[spec.hidden])?;
            l.q.check(&n("q"), &sh.q)?;
            l.k.check(&n("k"), &sh.kv)?;
            l.v.check(&n("v"), &sh.kv)?;
            l.o.check(&n("o"), &sh.o)?;
            l.gate.check(&n("gate"), &sh.gu)?;
            l.up.check(&n("up"), &sh.gu)?;
            l.down.check(&n("down"), &sh.down)?;
            for (name, t, want, on) in [
                ("q_bias", &l.q_bias, spec.q_dim(), spec.qkv_bias),
                ("k_bias", &l.k_bias, spec.kv_dim(), spec.qkv_bias),
                ("v_bias", &l.v_bias, spec.kv_dim(), spec.qkv_bias),
                ("q_norm", &l.q_norm, spec.head_dim, spec.qk_norm),
                ("k_norm", &l.k_norm, spec.head_dim, spec.qk_norm),
            ] {
                match (t, on) {
                    (Some(t), true) => t.check(&n(name), &[want])?,
                    (None, false) => {}
                    (Some(_), false) => {
                        return Err(Error::BadWeight { name: n(name), msg: "given, but the spec has none".into() })
                    }
                    (None, true) => return Err(Error::BadWeight { name: n(name), msg: "missing".into() }),
                }
            }
        }
        let Setup { ctx, k, sms } = setup(&spec, dtype, device)?;
        let total = 2
            * (weights.embed.data.len()
                + weights.final_norm.data.len()
                + weights.lm_head.as_ref().map_or(0, |t| t.data.len())
                + weights
                    .layers
                    .iter()
                    .map(|l| {
                        [&l.attn_norm, &l.q, &l.k, &l.v, &l.o, &l.mlp_norm, &l.gate, &l.up, &l.down]
                            .iter()
                            .map(|t| t.data.len())
                            .sum::<usize>()
                            + [&l.q_bias, &l.k_bias, &l.v_bias, &l.q_norm, &l.k_norm]
                                .iter()
                                .filter_map(|t| t.as_ref().map(|t| t.data.len()))
                                .sum::<usize>()
                    })
                    .sum::<usize>()) as u64;
        let mut up = Uploader {
            dtype,
            stream: k.stream.clone(),
            ctx: ctx.clone(),
            staging: Vec::new(),
            done: 0,
            total,
            progress,
        };
        let embed = up.upload(&[("embed", &weights.embed)], "embedding")?;
        let mut layers = Vec::with_capacity(spec.layers);
        for l in &weights.layers {
            let bqkv = match (&l.q_bias, &l.k_bias, &l.v_bias) {
                (Some(q), Some(k), Some(v)) => {
                    Some(up.upload(&[("q_bias", q), ("k_bias", k), ("v_bias", v)], "qkv bias")?)
                }
                _ => None,
            };
            layers.push(LayerW {
                attn_norm: up.upload(&[("attn_norm", &l.attn_norm)], "attn norm")?,
                wqkv: up.upload(&[("q", &l.q), ("k", &l.k), ("v", &l.v)], "qkv weights")?,
                bqkv,
                q_norm: l.q_norm.as_ref().map(|t| up.upload(&[("q_norm", t)], "q norm")).transpose()?,
                k_norm: l.k_norm.as_ref().map(|t| up.upload(&[("k_norm", t)], "k norm")).transpose()?,
                wo: up.upload(&[("o", &l.o)], "o weights")?,
                mlp_norm: up.upload(&[("mlp_norm", &l.mlp_norm)], "mlp norm")?,
                wgu: up.upload(&[("gate", &l.gate), ("up", &l.up)], "gate|up weights")?,
                wdown: up.upload(&[("down", &l.down)], "down weights")?,
            });
        }
        let final_norm = up.upload(&[("final_norm", &weights.final_norm)], "final norm")?;
        let lm_head = weights.lm_head.as_ref().map(|t| up.upload(&[("lm_head", t)], "lm head")).transpose()?;
        let w = Weights { embed, layers, final_norm, lm_head, fold: None };
        Self::finish(spec, ctx, k, w, sms)
    }

    /// A runner with random weights generated on the GPU (no host copy): matrices uniform with
    /// std 0.02, norms uniform in [0.9, 1.1], biases like matrices. Deterministic in `seed`.
    pub fn random(spec: CudaModelSpec, dtype: DType, seed: u64, device: usize) -> Result<Self> {
        let whole = ShardRange::whole(&spec);
        Self::random_shard(&spec, &whole, dtype, seed, device)
    }

    /// One tensor-parallel rank's shard (`range`) of the random model that [`random`](Self::random)
    /// makes for the whole spec `full` with the same seed: every element is hashed from its
    /// index in the whole tensor, so the shards of TP2 are exactly slices of the TP1 model.
    pub fn random_shard(
        full: &CudaModelSpec,
        range: &ShardRange,
        dtype: DType,
        seed: u64,
        device: usize,
    ) -> Result<Self> {
        let spec = full.shard(range)?;
        let Setup { ctx, k, sms } = setup(&spec, dtype, device)?;
        let (f, hd, h) = (full, full.head_dim, full.hidden);
        let (q0, kv0, ff0) =
            (range.q_heads(f.heads / f.kv_heads).start * hd, range.kv_heads.start * hd, range.ffn.start);
        let (qn, kvn, ffn) = (spec.q_dim(), spec.kv_dim(), spec.intermediate);
        let st = &k.stream;
        // (layer, tensor) -> seed; the same for every rank.
        let tseed = |layer: usize, id: u64| {
            seed ^ ((layer as u64) << 8 | id).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        };
        let mat = MATRIX_HALF_WIDTH;
        // One slice `rows x cols` at (row0, col0) of a whole tensor with `full_cols` columns.
        struct Part {
            rows: usize,
            cols: usize,
            full_cols: usize,
            row0: usize,
            col0: usize,
            seed: u64,
        }
        let gen = |parts: &[Part], what: &str, offset: f32, hw: f32| -> Result<CudaSlice<u16>> {
            let n = parts.iter().map(|p| p.rows * p.cols).sum();
            let buf = alloc::<u16>(&ctx, st, n, what)?;
            let mut off = 0;
            for p in parts {
                let r = region(&buf, st, off, p.rows * p.cols)?;
                k.init_uniform(r, p.rows, p.cols, p.full_cols, p.row0, p.col0, p.seed, offset, hw)?;
                off += p.rows * p.cols;
            }
            Ok(buf)
        };
        let vec = |len: usize, seed: u64| Part { rows: 1, cols: len, full_cols: len, row0: 0, col0: 0, seed };
        let rows = |rows: usize, cols: usize, row0: usize, seed: u64| Part {
            rows,
            cols,
            full_cols: cols,
            row0,
            col0: 0,
            seed,
        };
        let cols = |rows: usize, cols: usize, full_cols: usize, col0: usize, seed: u64| Part {
            rows,
            cols,
            full_cols,
            row0: 0,
            col0,
            seed,
        };
        let slice = |len: usize, full: usize, start: usize, seed: u64| Part {
            rows: 1,
            cols: len,
            full_cols: full,
            row0: 0,
            col0: start,
            seed,
        };
        let (fq, fkv) = (f.q_dim(), f.kv_dim());
        let embed = gen(&[rows(f.vocab, h, 0, tseed(0, 1))], "embedding", 0.0, mat)?;
        let mut layers = Vec::with_capacity(f.layers);
        for l in 1..=f.layers {
            let t = |id| tseed(l, id);
            layers.push(LayerW {
                attn_norm: gen(&[vec(h, t(1))], "attn norm", 1.0, NORM_HALF_WIDTH)?,
                wqkv: gen(
                    &[rows(qn, h, q0, t(2)), rows(kvn, h, kv0, t(3)), rows(kvn, h, kv0, t(4))],
                    "qkv weights",
                    0.0,
                    mat,
                )?,
                bqkv: if f.qkv_bias {
                    Some(gen(
                        &[slice(qn, fq, q0, t(5)), slice(kvn, fkv, kv0, t(6)), slice(kvn, fkv, kv0, t(7))],
                        "qkv bias",
                        0.0,
                        mat,
                    )?)
                } else {
                    None
                },
                q_norm: if f.qk_norm { Some(gen(&[vec(hd, t(8))], "q norm", 1.0, NORM_HALF_WIDTH)?) } else { None },
                k_norm: if f.qk_norm { Some(gen(&[vec(hd, t(9))], "k norm", 1.0, NORM_HALF_WIDTH)?) } else { None },
                wo: gen(&[cols(h, qn, fq, q0, t(10))], "o weights", 0.0, mat)?,
                mlp_norm: gen(&[vec(h, t(11))], "mlp norm", 1.0, NORM_HALF_WIDTH)?,
                wgu: gen(&[rows(ffn, h, ff0, t(12)), rows(ffn, h, ff0, t(13))], "gate|up weights", 0.0, mat)?,
                wdown: gen(&[cols(h, ffn, f.intermediate, ff0, t(14))], "down weights", 0.0, mat)?,
            });
        }
        let final_norm = gen(&[vec(h, tseed(0, 2))], "final norm", 1.0, NORM_HALF_WIDTH)?;
        let lm_head =
            if f.tied_embeddings { None } else { Some(gen(&[rows(f.vocab, h, 0, tseed(0, 3))], "lm head", 0.0, mat)?) };
        let w = Weights { embed, layers, final_norm, lm_head, fold: None };
        Self::finish(spec, ctx, k, w, sms)
    }

    fn finish(spec: CudaModelSpec, ctx: Arc<CudaContext>, mut k: Kernels, w: Weights, sms: usize) -> Result<Self> {
        // The GEMVs read weights before their programmatic-launch wait (common.cuh), so the
        // kernels that generated synthetic weights must be complete before the first GEMV.
        k.stream.synchronize().map_err(Error::driver("finishing the weights"))?;
        tune_gemv(&ctx, &mut k, &spec, &w, sms)?;
        let stream = k.stream.clone();
        let mut inv_freq = alloc::<f32>(&ctx, &stream, spec.rope_inv_freq.len(), "RoPE table")?;
        stream.memcpy_htod(&spec.rope_inv_freq, &mut inv_freq).map_err(Error::driver("uploading the RoPE table"))?;
        let decode = Acts::new(&ctx, &stream, &spec, 1, MAX_SPLITS)?;
        let logits = DeviceLogits { buf: alloc::<f32>(&ctx, &stream, spec.vocab, "logits")? };
        let parts = spec.vocab.div_ceil(launch::ARGMAX_CHUNK);
        let argmax_v = alloc::<f32>(&ctx, &stream, parts, "argmax partials")?;
        let argmax_i = alloc::<u32>(&ctx, &stream, parts, "argmax partials")?;
        let argmax_out = alloc::<u32>(&ctx, &stream, 1, "argmax result")?;
        stream.synchronize().map_err(Error::driver("initialising the runner"))?;
        let mut r = CudaDecodeRunner {
            spec,
            ctx,
            k,
            w,
            inv_freq,
            decode,
            prefill: None,
            logits,
            argmax_v,
            argmax_i,
            argmax_out,
            seqs: HashMap::new(),
            fed: None,
            readback: None,
            readback_len: 0,
            readback_done: None,
            generation: 0,
            step_gemvs: None,
            reducer: Box::new(NoReduce),
            projection: Projection::default(),
            sms,
            head_split: None,
            screen: None,
        };
        if r.k.screen_head {
            r.set_screened_head(true)?;
        }
        if r.k.fold_qkv {
            r.set_folded_qkv(true)?;
        }
        Ok(r)
    }

    /// The model description.
    pub fn spec(&self) -> &CudaModelSpec {
        &self.spec
    }
    /// The storage dtype.
    pub fn dtype(&self) -> DType {
        self.k.dtype
    }
    /// The runner's stream (every kernel, copy and reduction of this runner is ordered on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.k.stream
    }
    /// The runner's CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// Installs the reducer called after the o- and down-projections (default: [`NoReduce`]).
    pub fn set_reducer(&mut self, reducer: Box<dyn Reducer>) {
        self.reducer = reducer;
        self.generation += 1;
        if !self.reducer.is_identity() {
            // A TP rank's step has no fused norms, so the folded q/k/v would never run.
            self.w.fold = None;
            self.decode.fold = None;
        }
    }
    /// Splits the LM head of device-fed steps over `world` tensor-parallel ranks, this runner
    /// being rank `rank` (`world` 1: no split, the default). Each rank then computes the logits
    /// of its own contiguous share of the vocabulary (ranks below `vocab % world` take one row
    /// more) and its best candidate by the argmax's rule, with vocabulary indices; the
    /// candidates are exchanged through the reducer's all-reduce (two floats per rank) and every
    /// rank picks the same token: the one the whole vocabulary's argmax (or Gumbel-max sample)
    /// chooses, because each row's dot product is launched as in the whole LM head GEMV
    /// (the same rounding) and the noise is hashed from vocabulary indices. The weights stay
    /// whole (the rows are a region of them; a tied head is a region of the embedding).
    ///
    /// Applies to [`enqueue_device_step`](Self::enqueue_device_step) with
    /// [`Projection::Gemv`] only; host-fed steps and prefills still compute every logit, so
    /// [`logits`](Self::logits) is whole after them (after a split device-fed step it holds
    /// this rank's rows first). Every rank of the reducer's group must make the same call
    /// (the exchange is a collective). Errors: `rank >= world`, `world` 0, or a vocabulary of
    /// 2^24 or more (indices cross the exchange as floats).
    pub fn set_vocab_split(&mut self, rank: usize, world: usize) -> Result<()> {
        let v = self.spec.vocab;
        if world == 0 || rank >= world || v >= 1 << 24 || world > v {
            return Err(Error::InvalidArgument(format!(
                "vocab split: rank {rank} of {world} over a vocabulary of {v} (needs rank < world <= vocab < 2^24)"
            )));
        }
        self.generation += 1;
        if world == 1 {
            self.head_split = None;
            if self.screen.is_some() {
                self.set_screened_head(true)?;
            }
            return Ok(());
        }
        let share = |r: usize| v / world + usize::from(r < v % world);
        let start: usize = (0..rank).map(share).sum();
        let xchg = alloc::<f32>(&self.ctx, &self.k.stream, 2 * world, "argmax exchange")?;
        self.head_split = Some(HeadSplit { rank, world, rows: start..start + share(rank), xchg });
        // A screened head follows the split: a copy of this rank's rows only.
        if self.screen.is_some() {
            self.set_screened_head(true)?;
        }
        Ok(())
    }

    /// The LM head rows this runner computes in a device-fed step: `(start, len)` of its vocab
    /// split, or the whole vocabulary.
    pub fn vocab_rows(&self) -> (usize, usize) {
        match &self.head_split {
            Some(sp) if self.projection == Projection::Gemv => (sp.rows.start, sp.rows.len()),
            _ => (0, self.spec.vocab),
        }
    }

    /// Turns the screened LM head of greedy device-fed steps on or off (default: off); returns
    /// whether greedy device-fed steps now screen it. On, a greedy
    /// [`enqueue_device_step`](Self::enqueue_device_step) picks the token without computing
    /// the logits: an int8 copy of the head (made on the device by this call: one byte a weight
    /// and 16 bytes a row more memory, for this runner's rows only under a vocab split)
    /// brackets every row's logit, and only the rows that may hold the argmax are read again in
    /// the model dtype, by the LM head GEMV's own arithmetic, so the token is the full head's,
    /// bit for bit (misc.cu's screened head has the argument; `ferrum_runner::screen` is its CPU
    /// reference). A step then reads about half of the head's bytes. Such a step does not write
    /// the logits buffer. Sampled steps, host-fed steps and prefills compute the full head as
    /// before, and so does every step with [`Projection::Cublas`]. A hidden size that is not a
    /// multiple of 16 or is above 8192, or a vocabulary of 2^24 rows or more, has no screened
    /// head: the call then returns `false` and allocates nothing.
    ///
    /// Off frees the copy. Captured device steps are captured again after a change (the
    /// generation changes).
    pub fn set_screened_head(&mut self, on: bool) -> Result<bool> {
        let rows = self.split_rows();
        let (v, h) = (self.spec.vocab, self.spec.hidden);
        let possible = h % 16 == 0 && h <= launch::HEAD_MAX_COLS && v < 1 << 24;
        if !on || !possible {
            if self.screen.take().is_some() {
                self.generation += 1;
            }
            return Ok(false);
        }
        if self.screen.as_ref().is_some_and(|sc| sc.rows == rows) {
            return Ok(true);
        }
        self.screen = None; // free an old copy first
        self.generation += 1;
        let (r0, rn) = rows;
        let n = rn.checked_mul(h).ok_or_else(|| Error::InvalidArgument("head size overflows".into()))?;
        let (ctx, st) = (&self.ctx, &self.k.stream);
        let mut sc = ScreenedHead {
            rows,
            q: alloc::<i8>(ctx, st, n, "screened head")?,
            scale: alloc::<f32>(ctx, st, rn, "screened head scales")?,
            coef: alloc::<f32>(ctx, st, rn, "screened head bounds")?,
            ovf: f32::INFINITY,
            state: alloc::<i32>(ctx, st, HEAD_STATE_INIT.len(), "screened head state")?,
            list: alloc::<u32>(ctx, st, 2 * rn, "screened head list")?,
        };
        let wmax = alloc::<i32>(ctx, st, 1, "screened head max")?;
        let hw = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        self.k.head_quantize(
            region(hw, st, r0 * h, n)?,
            rn,
            h,
            whole(&sc.q, st)?,
            whole(&sc.scale, st)?,
            whole(&sc.coef, st)?,
            whole(&wmax, st)?,
        )?;
        st.memcpy_htod(&HEAD_STATE_INIT, &mut sc.state).map_err(Error::driver("initialising the screened head"))?;
        let mut m = [0i32; 1];
        // The screen kernels read the copy before their programmatic-launch wait: it must be
        // complete before any of them is launched (this synchronize), as the weights are.
        st.memcpy_dtoh(&wmax, &mut m).map_err(Error::driver("reading the screened head's max"))?;
        st.synchronize().map_err(Error::driver("making the screened head"))?;
        sc.ovf = screen_overflow_guard(f32::from_bits(m[0] as u32), h);
        self.screen = Some(sc);
        Ok(true)
    }

    /// Whether the screened head is on ([`set_screened_head`](Self::set_screened_head)).
    pub fn screened_head(&self) -> bool {
        self.screen.is_some()
    }

    /// Folds each layer's q/k/v projection into the previous layer's down projection (on) or
    /// not (off), for one-token decode steps on the GEMV path with the fused norms and the
    /// attention's own RoPE (the row-walking kernel; the tensor-core attention of long caches,
    /// TP ranks, prefill and cuBLAS steps keep the unfolded projections).
    ///
    /// Layer `l`'s down projection then reads `[h | x]` and computes both the residual
    /// `r = x + W_d h` and `u = W_qkv diag(n1) r` (n1 the next layer's input norm weight), by a
    /// matrix built once on the device: `[W_d | I; M | W_qkv diag(n1)]`, `M = W_qkv diag(n1)
    /// W_d` rounded to the dtype; the next attention scales u by the norm's `rsqrt(mean(r^2) +
    /// eps)` itself. So a layer has four kernels instead of five, at the price of reading `M`
    /// (`qkv x inter`) and a `hidden x hidden` block in every step. Off by default
    /// (`FERRUM_FOLD_QKV=1` turns it on for every new runner): at SmolLM2-135M, where a layer's
    /// kernels are nearly all fixed cost, the saved q/k/v GEMV (~2.4 us) went to the larger
    /// down GEMV (+1.0 us) and the attention's norm (+0.3 us after its loads joined the
    /// row's), +0.3% a token in all (docs/PERF.md, session 35; -1.0% in session 36: noise
    /// either way); larger models lose, since M grows as `qkv x inter`: Llama-3-8B (210 MB more
    /// a layer) measured 270 -> 170 tok/s (-37%, session 36), and the call warns above
    /// `plan::FOLD_MAX_EXTRA_BYTES`. The logits
    /// differ from the unfolded step's by rounding only (M's rounding to the dtype is the
    /// largest term; the GPU tests compare both with the CPU reference and with each other).
    ///
    /// Returns whether the folded matrices are built; steps fold only where the step itself
    /// takes the fused path with the row-walking attention (not with `FERRUM_ATTN_O=1`'s o
    /// fusion, nor over caches long enough for the tensor-core attention). Refused (returns
    /// `false`, allocates nothing) with fewer than two layers, a head dim without a folded
    /// attention kernel (`plan::FOLD_HEAD_DIMS`), a hidden size, MLP width or q/k/v width that
    /// is not a multiple of 8 (the buffers' float4 alignment), a hidden size above the fused
    /// norms' limit or `launch::FOLD_MAX_HIDDEN`, fused norms or RoPE turned off, or a reducer
    /// other than the identity (a TP rank); refused after building, with a warning and the
    /// matrices freed, when an entry of the folded matrix is not finite in the dtype (f16
    /// overflow) or the device memory runs out. Captured device steps are captured again after
    /// a change.
    pub fn set_folded_qkv(&mut self, on: bool) -> Result<bool> {
        let s = &self.spec;
        let (h, inter, q) = (s.hidden, s.intermediate, s.qkv_dim());
        let possible = s.layers >= 2
            && crate::plan::FOLD_HEAD_DIMS.contains(&s.head_dim)
            && h % 8 == 0
            && inter % 8 == 0
            && q % 8 == 0
            && h <= launch::FOLD_MAX_HIDDEN
            && h <= self.k.norms_max_hidden
            && self.k.fuse_norms
            && self.k.fuse_rope
            && self.reducer.is_identity();
        if !on || !possible {
            self.decode.fold = None;
            if self.w.fold.take().is_some() {
                self.generation += 1;
            }
            return Ok(false);
        }
        if self.w.fold.is_some() {
            return Ok(true);
        }
        let n = (h + q).checked_mul(inter + h).ok_or_else(|| Error::InvalidArgument("fold size overflows".into()))?;
        let (ctx, st) = (&self.ctx, &self.k.stream);
        // The small activation buffer first: running out of memory here wastes no matrix
        // building. Stored only at the end, with the matrices (never one without the other).
        let acts = match alloc::<f32>(ctx, st, 2 * fold_stride(s), "activations (folded q/k/v)") {
            Ok(acts) => acts,
            Err(e @ Error::OutOfMemory { .. }) => {
                tracing::warn!(%e, "not folding the q/k/v projections");
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let bad = alloc::<i32>(ctx, st, 1, "folded q/k/v check")?;
        let mut mats = Vec::with_capacity(s.layers - 1);
        for (lw, next) in self.w.layers.iter().zip(&self.w.layers[1..]) {
            let out = match alloc::<u16>(ctx, st, n, "folded q/k/v") {
                Ok(o) => o,
                Err(e @ Error::OutOfMemory { .. }) => {
                    // An opt-in speed-up: the runner works without it. The matrices built so
                    // far are freed once the kernels writing them are done.
                    st.synchronize().map_err(Error::driver("folding the q/k/v projections"))?;
                    tracing::warn!(%e, "not folding the q/k/v projections");
                    return Ok(false);
                }
                Err(e) => return Err(e),
            };
            self.k.fold_qkv(
                whole(&lw.wdown, st)?,
                whole(&next.wqkv, st)?,
                whole(&next.attn_norm, st)?,
                h,
                inter,
                q,
                whole(&out, st)?,
                whole(&bad, st)?,
            )?;
            mats.push(out);
        }
        let mut b = [0i32; 1];
        // The GEMVs read their weights before their programmatic-launch wait: the matrices must
        // be complete before any step runs (this synchronize), as the weights are.
        st.memcpy_dtoh(&bad, &mut b).map_err(Error::driver("reading the folded q/k/v check"))?;
        st.synchronize().map_err(Error::driver("folding the q/k/v projections"))?;
        if b[0] != 0 {
            tracing::warn!("the folded q/k/v matrix has entries outside the dtype's range: not folding");
            return Ok(false);
        }
        tune_shapes(&self.ctx, &mut self.k, vec![(h + q, inter + h, false, mats.iter().collect())], self.sms)?;
        let extra = crate::plan::fold_extra_bytes(h, inter, q);
        if extra > crate::plan::FOLD_MAX_EXTRA_BYTES {
            // Built as asked (an explicit opt-in), but the caller should know what it costs.
            tracing::warn!(
                extra_mb_a_layer = extra as f64 / 1e6,
                "the folded q/k/v projection reads more a layer than the kernel it saves can be \
                 worth: expect a slower step (Llama-3-8B measured -37%)"
            );
        }
        self.decode.fold = Some(acts);
        self.w.fold = Some(mats);
        self.generation += 1;
        Ok(true)
    }

    /// Whether one-token steps fold the q/k/v projection ([`set_folded_qkv`](Self::set_folded_qkv)).
    pub fn folded_qkv(&self) -> bool {
        self.w.fold.is_some()
    }

    /// The rows the last screened device-fed step read again and their exact logits (those of
    /// the full head, bit for bit), as `(vocabulary row, logit)` in the order the screen found
    /// them; empty before any screened step. For tests and diagnostics: waits for the stream.
    pub fn screened_rows(&self) -> Result<Vec<(u32, f32)>> {
        let Some(sc) = &self.screen else { return Ok(Vec::new()) };
        let st = &self.k.stream;
        let mut state = [0i32; HEAD_STATE_INIT.len()];
        st.memcpy_dtoh(&sc.state, &mut state).map_err(Error::driver("reading the screened head's state"))?;
        let mut list = vec![0u32; sc.list.len()];
        st.memcpy_dtoh(&sc.list, list.as_mut_slice()).map_err(Error::driver("reading the screened head's list"))?;
        st.synchronize().map_err(Error::driver("reading the screened head"))?;
        let n = (state[2].max(0) as usize).min(list.len() / 2);
        Ok(list[..2 * n].chunks_exact(2).map(|e| (e[1], f32::from_bits(e[0]))).collect())
    }

    /// The rows a device-fed step of the GEMV path covers: the vocab split's share, or all.
    fn split_rows(&self) -> (usize, usize) {
        match &self.head_split {
            Some(sp) => (sp.rows.start, sp.rows.len()),
            None => (0, self.spec.vocab),
        }
    }

    /// Whether a device-fed step (greedy or not) takes the screened head.
    fn screens(&self, greedy: bool) -> bool {
        greedy
            && self.projection == Projection::Gemv
            && self.screen.as_ref().is_some_and(|sc| sc.rows == self.vocab_rows())
    }

    /// Chooses how batch-1 projections run (default: [`Projection::Gemv`]).
    pub fn set_projection(&mut self, projection: Projection) {
        self.projection = projection;
        self.generation += 1;
    }
    /// Current projection choice.
    pub fn projection(&self) -> Projection {
        self.projection
    }
    /// Name, memory and compute capability of this runner's GPU.
    pub fn device_info(&self) -> Result<DeviceInfo> {
        info_of(&self.ctx)
    }
    /// Waits for all work queued on the runner's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.k.stream.synchronize().map_err(Error::driver("stream synchronize"))
    }

    /// Allocates a KV cache of `capacity` tokens for sequence `seq`
    /// (`2 * layers * kv_heads * capacity * head_dim` elements).
    pub fn init_sequence(&mut self, seq: u64, capacity: usize) -> Result<()> {
        if self.seqs.contains_key(&seq) {
            return Err(Error::SequenceExists(seq));
        }
        if capacity == 0 || capacity > i32::MAX as usize / 2 {
            return Err(Error::InvalidArgument(format!("KV capacity {capacity}")));
        }
        let s = &self.spec;
        let n = s
            .layers
            .checked_mul(s.kv_dim())
            .and_then(|x| x.checked_mul(capacity))
            .ok_or_else(|| Error::InvalidArgument(format!("KV capacity {capacity} overflows")))?;
        let what = format!("KV cache of sequence {seq} ({capacity} tokens, K)");
        let k = alloc::<u16>(&self.ctx, &self.k.stream, n, &what)?;
        let what = format!("KV cache of sequence {seq} ({capacity} tokens, V)");
        let v = alloc::<u16>(&self.ctx, &self.k.stream, n, &what)?;
        let history = alloc::<u32>(&self.ctx, &self.k.stream, capacity + 1, "token history")?;
        // The tensor-core decode attention (long caches) takes longer splits than the
        // row-walking kernel (plan::ATTN_TC_ROWS_PER_SPLIT).
        let tc = crate::plan::attn_tensor_core(s.head_dim, s.heads, s.kv_heads, capacity, self.k.attn_tc_min_capacity);
        let n_splits = if tc { attn_splits_tc } else { attn_splits }(capacity, s.heads, self.sms);
        let n_splits = self.k.attn_splits.unwrap_or(n_splits);
        self.seqs.insert(seq, Sequence { k, v, history, capacity, len: 0, n_splits });
        Ok(())
    }

    /// Frees sequence `seq`'s KV cache.
    pub fn release(&mut self, seq: u64) -> Result<()> {
        if self.fed == Some(seq) {
            self.fed = None;
        }
        self.seqs.remove(&seq).map(|_| ()).ok_or(Error::UnknownSequence(seq))
    }

    /// Tokens held by sequence `seq`.
    pub fn sequence_len(&self, seq: u64) -> Result<usize> {
        self.seqs.get(&seq).map(|s| s.len).ok_or(Error::UnknownSequence(seq))
    }

    /// KV capacity of sequence `seq`.
    pub fn sequence_capacity(&self, seq: u64) -> Result<usize> {
        self.seqs.get(&seq).map(|s| s.capacity).ok_or(Error::UnknownSequence(seq))
    }

    fn check_token(&self, token: u32) -> Result<()> {
        if token as usize >= self.spec.vocab {
            return Err(Error::TokenOutOfRange { token, vocab: self.spec.vocab });
        }
        Ok(())
    }

    /// The decode forward pass of one token of `seq`, reading the token and position from the
    /// decode step buffer (written by the caller, or by the previous device-fed step). The
    /// caller updates the sequence's length. Logits for the LM head rows `head` (`(start, len)`:
    /// all of them, or a vocab split's share), from the start of the logits buffer.
    /// One decode pass of `seq` ending with the LM head's `rows` into the logits, or, with
    /// `screened`, with the screened head (which must be set up, over those rows).
    fn forward_one(&mut self, seq: u64, rows: (usize, usize), screened: bool) -> Result<()> {
        let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        let head = match (&self.screen, screened) {
            (Some(sc), true) if sc.rows == rows => HeadJob::Screen(sc),
            (Some(_), true) => return Err(Error::Internal("the screened head covers other rows".into())),
            (None, true) => return Err(Error::Internal("a screened step without the screened head".into())),
            (_, false) => HeadJob::Logits(&mut self.logits.buf, rows),
        };
        forward(
            &self.k,
            &self.spec,
            &self.w,
            &self.inv_freq,
            &mut self.decode,
            s,
            1,
            true,
            self.projection,
            self.reducer.as_mut(),
            head,
        )
    }

    /// Checks that `token` may be decoded at `position` of `seq` (a known sequence, a position
    /// at most its length and below its capacity).
    fn check_step(&self, seq: u64, token: u32, position: usize) -> Result<()> {
        self.check_token(token)?;
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        if position >= s.capacity {
            if position == s.len {
                return Err(Error::CapacityExhausted { seq, len: s.len, capacity: s.capacity, asked: 1 });
            }
            return Err(Error::PositionOutOfRange { seq, position, capacity: s.capacity });
        }
        if position > s.len {
            return Err(Error::PositionGap { seq, position, len: s.len });
        }
        Ok(())
    }

    /// Appends `tokens` to sequence `seq` (positions `len .. len + tokens.len()`) in passes of
    /// up to [`PREFILL_CHUNK`] tokens (cuBLAS GEMMs, causal attention); returns the logits of
    /// the last position.
    pub fn prefill(&mut self, seq: u64, tokens: &[u32]) -> Result<&DeviceLogits> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("prefill of no tokens".into()));
        }
        for &t in tokens {
            self.check_token(t)?;
        }
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        if self.fed == Some(seq) {
            // The step buffer's position is stale once the prefill moves the length on.
            self.fed = None;
        }
        if s.len + tokens.len() > s.capacity {
            return Err(Error::CapacityExhausted { seq, len: s.len, capacity: s.capacity, asked: tokens.len() });
        }
        let want = tokens.len().min(PREFILL_CHUNK);
        if self.prefill.as_ref().is_none_or(|a| a.cap < want) {
            self.prefill = None; // free the old buffers first
            self.prefill = Some(Acts::new(&self.ctx, &self.k.stream, &self.spec, want, 1)?);
        }
        let mut step = Vec::with_capacity(want + 1);
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
            let a = self.prefill.as_mut().ok_or_else(|| Error::Internal("prefill buffers".into()))?;
            step.clear();
            step.extend_from_slice(chunk);
            step.resize(a.cap, 0);
            step.push(s.len as u32);
            self.k.stream.memcpy_htod(&step, &mut a.step).map_err(Error::driver("uploading prefill tokens"))?;
            forward(
                &self.k,
                &self.spec,
                &self.w,
                &self.inv_freq,
                a,
                s,
                chunk.len(),
                false,
                self.projection,
                self.reducer.as_mut(),
                HeadJob::Logits(&mut self.logits.buf, (0, self.spec.vocab)),
            )?;
            s.len += chunk.len();
            // `step` is reused next chunk: wait for the copy (and surface kernel errors).
            self.k.stream.synchronize().map_err(Error::driver("prefill"))?;
        }
        Ok(&self.logits)
    }

    /// Runs one decode step: `token` at `position` of sequence `seq` (`position` must be at most
    /// the sequence's length, and below its capacity); returns the next-token logits (on the
    /// device). Nothing is allocated; the token and position go to a small device buffer that
    /// the kernels read, so the launches do not depend on them.
    pub fn decode_step(&mut self, seq: u64, token: u32, position: usize) -> Result<&DeviceLogits> {
        self.check_step(seq, token, position)?;
        let step = [token, position as u32];
        self.k.stream.memcpy_htod(&step, &mut self.decode.step).map_err(Error::driver("uploading the step"))?;
        self.fed = None;
        self.forward_one(seq, (0, self.spec.vocab), false)?;
        self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?.len = position + 1;
        Ok(&self.logits)
    }

    /// Runs [`decode_step`](Self::decode_step) with a CUDA event recorded after every kernel
    /// launch and returns, per launch in order, the kernel's name and the GPU time from the
    /// previous event (the step's start for the first) to the end of that kernel, in µs; a
    /// last entry `"(end)"` covers what follows the last kernel launch. cuBLAS GEMMs get their
    /// own entries (`"cublas_gemm"`); other work between two of ferrum's kernels (the
    /// reducer's collectives, the step upload) is counted in the next kernel's time. The events
    /// serialise the kernels (no programmatic overlap), so the total is at least the normal
    /// step time: use it to see where a step's time goes, not to time it.
    pub fn profile_decode_step(&mut self, seq: u64, token: u32, position: usize) -> Result<Vec<(&'static str, f64)>> {
        self.profile(|r| r.decode_step(seq, token, position).map(|_| ()))
    }

    /// Whether the kernels are the timeline build (`cargo xtask ptx --timeline`; see
    /// [`crate::timeline`]).
    pub fn has_timeline(&self) -> bool {
        self.k.has_timeline()
    }

    /// Timeline build: the kernels enqueued after this call on [`stream`](Self::stream) stamp
    /// as replay `Some(r)` (`r == 0` resets the tables; `r < timeline::REPLAYS`) or not at all
    /// (`None`), in stream order: call it between graph replays. An `InvalidArgument` error
    /// when the kernels are not the timeline build.
    pub fn timeline_arm(&self, replay: Option<u32>) -> Result<()> {
        self.k.timeline_set(replay)
    }

    /// Timeline build: the stamps since the last reset, per replay row (each sorted by grid
    /// id; waits for the stream). Map them onto a graph's kernels with
    /// [`crate::timeline::step_timeline`].
    pub fn timeline_read(&self) -> Result<Vec<Vec<crate::timeline::GridStamp>>> {
        self.k.timeline_read()
    }

    /// [`prefill`](Self::prefill) profiled like [`profile_decode_step`](Self::profile_decode_step).
    pub fn profile_prefill(&mut self, seq: u64, tokens: &[u32]) -> Result<Vec<(&'static str, f64)>> {
        self.profile(|r| r.prefill(seq, tokens).map(|_| ()))
    }

    fn profile(&mut self, run: impl FnOnce(&mut Self) -> Result<()>) -> Result<Vec<(&'static str, f64)>> {
        let ctx = self.ctx.clone();
        let ev = |what: &'static str| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver(what));
        let start = ev("profile start event")?;
        start.record(&self.k.stream).map_err(Error::driver("profile start event"))?;
        *self.k.marks.borrow_mut() = Some(Vec::new());
        let ran = run(self);
        let marks = self.k.marks.borrow_mut().take().unwrap_or_default();
        ran?;
        let end = ev("profile end event")?;
        end.record(&self.k.stream).map_err(Error::driver("profile end event"))?;
        end.synchronize().map_err(Error::driver("profile end event"))?;
        let mut out = Vec::with_capacity(marks.len() + 1);
        let mut prev = &start;
        for (name, e) in &marks {
            out.push((*name, f64::from(prev.elapsed_ms(e).map_err(Error::driver("profile event"))?) * 1e3));
            prev = e;
        }
        out.push(("(end)", f64::from(prev.elapsed_ms(&end).map_err(Error::driver("profile event"))?) * 1e3));
        Ok(out)
    }

    /// The logits of the last step (prefill or decode) on the device. A greedy device-fed step
    /// with the screened head ([`set_screened_head`](Self::set_screened_head)) does not write
    /// them: they are then an earlier step's.
    pub fn logits(&self) -> &DeviceLogits {
        &self.logits
    }

    /// Copies the last logits to the host (`out` is resized to the vocabulary).
    pub fn logits_to_host(&self, out: &mut Vec<f32>) -> Result<()> {
        out.resize(self.spec.vocab, 0.0);
        self.k.stream.memcpy_dtoh(&self.logits.buf, out.as_mut_slice()).map_err(Error::driver("copying logits"))?;
        self.synchronize()
    }

    /// Times one `rows x cols` batch-1 projection (random data, `iters` runs after 5 warm-ups,
    /// median by CUDA events) through ferrum's GEMV and through cuBLAS; returns
    /// `(gemv_seconds, cublas_seconds)`. A helper for choosing [`Projection`] per shape. As in
    /// the decode step, x and y are fp32; the cuBLAS time includes rounding x to the dtype.
    pub fn time_projection(&self, rows: usize, cols: usize, iters: usize) -> Result<(f64, f64)> {
        let st = &self.k.stream;
        let w = alloc::<u16>(&self.ctx, st, rows * cols, "projection timing (W)")?;
        let xh = alloc::<u16>(&self.ctx, st, cols, "projection timing (x)")?;
        let mut x = alloc::<f32>(&self.ctx, st, cols, "projection timing (x)")?;
        let y = alloc::<f32>(&self.ctx, st, rows, "projection timing (y)")?;
        self.k.init_uniform(whole(&w, st)?, rows, cols, cols, 0, 0, 1, 0.0, MATRIX_HALF_WIDTH)?;
        // The GEMV reads W before its programmatic-launch wait: W must be final first.
        st.synchronize().map_err(Error::driver("initialising the projection weights"))?;
        let mut r = 0x2545_f491_4f6c_dd1du64;
        let xs: Vec<f32> = (0..cols)
            .map(|_| {
                r ^= r << 13;
                r ^= r >> 7;
                r ^= r << 17;
                (r >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        st.memcpy_htod(&xs, &mut x).map_err(Error::driver("uploading the projection input"))?;
        let ev =
            || self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver("creating an event"));
        let (e0, e1) = (ev()?, ev()?);
        let mut out = [0.0f64; 2];
        for (i, p) in [Projection::Gemv, Projection::Cublas].into_iter().enumerate() {
            let mut times = Vec::with_capacity(iters.max(1));
            for it in 0..iters.max(1) + 5 {
                e0.record(st).map_err(Error::driver("event record"))?;
                project(&self.k, p, whole(&y, st)?, whole(&w, st)?, whole(&x, st)?, whole(&xh, st)?, rows, cols, 1)?;
                e1.record(st).map_err(Error::driver("event record"))?;
                e1.synchronize().map_err(Error::driver("event sync"))?;
                if it >= 5 {
                    times.push(e0.elapsed_ms(&e1).map_err(Error::driver("event time"))? as f64 / 1e3);
                }
            }
            times.sort_by(f64::total_cmp);
            out[i] = times[times.len() / 2];
        }
        Ok((out[0], out[1]))
    }

    /// Greedy token of the last logits, computed on the device (smallest index on ties).
    pub fn argmax(&mut self) -> Result<u32> {
        let st = &self.k.stream;
        self.k.argmax(
            whole(&self.logits.buf, st)?,
            self.spec.vocab,
            None,
            whole(&self.argmax_v, st)?,
            whole(&self.argmax_i, st)?,
            whole(&self.argmax_out, st)?,
            None,
            None,
        )?;
        let mut out = [0u32];
        st.memcpy_dtoh(&self.argmax_out, &mut out).map_err(Error::driver("copying argmax"))?;
        self.synchronize()?;
        Ok(out[0])
    }

    // -----------------------------------------------------------------------------------------
    // Device-fed decoding: the step's token and position live in the decode step buffer, and
    // each step's own argmax (or Gumbel-max sample) writes the next token and position there,
    // so N steps run as N graph replays with no host round trip.
    //
    //   device_decode_begin(seq, token, pos)     host -> device: [token, pos]   (not capturable)
    //   enqueue_device_step(seq, sampling)  x N  forward + pick + advance       (capturable)
    //   enqueue_token_readback(seq, from, n)     history[from..from+n] -> pinned host buffer
    //   token_readback(n)                        waits for that copy, returns the tokens
    //   device_decode_end(seq, len)              the host's bookkeeping: len tokens are kept
    // -----------------------------------------------------------------------------------------

    /// Starts device-fed decoding of `seq`: `token` at `position` (the same checks as
    /// [`decode_step`](Self::decode_step)) is written to the decode step buffer, and the
    /// sequence's length becomes `position` (KV entries past it are overwritten). Enqueued on
    /// the runner's stream (asynchronous); not allowed while the stream captures.
    pub fn device_decode_begin(&mut self, seq: u64, token: u32, position: usize) -> Result<()> {
        self.check_step(seq, token, position)?;
        let step = [token, position as u32];
        self.k.stream.memcpy_htod(&step, &mut self.decode.step).map_err(Error::driver("uploading the step"))?;
        if let Some(sc) = self.screen.as_mut() {
            // A fresh hand-off state, whatever a step that failed between its screen and its
            // pick left (the pick resets it after every step).
            self.k
                .stream
                .memcpy_htod(&HEAD_STATE_INIT, &mut sc.state)
                .map_err(Error::driver("resetting the screened head"))?;
        }
        let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        s.len = position;
        self.fed = Some(seq);
        Ok(())
    }

    /// Enqueues one device-fed decode step of `seq` (after
    /// [`device_decode_begin`](Self::device_decode_begin)): the whole forward pass reading the
    /// token and position from the step buffer, then the choice of the next token (greedy or
    /// sampled), which goes to the step buffer (the next step's input), to the sequence's token
    /// history at the next position, and to the position, advanced by one while below the
    /// capacity. Only enqueues kernels (and the reducer's collectives): no host copy, no
    /// allocation, no synchronisation, so a CUDA graph can capture it and replay it for every
    /// position. The host's length bookkeeping is left to
    /// [`device_decode_end`](Self::device_decode_end); the kernels never touch KV entries at or
    /// past the capacity, however many steps run.
    ///
    /// One capture may hold several steps (see [`steps_per_graph`](Self::steps_per_graph)):
    /// the boundary between two steps is then a programmatic launch like the others. That is
    /// safe for the reason every boundary is (common.cuh): each kernel waits before it lets the
    /// next launch, so a kernel's pre-wait reads see every kernel but the one just before it
    /// completed (after an early-triggering o or down projection, every kernel but the two
    /// before it: the kernel after one reads only weights before its wait; no such kernel lies
    /// between the embedding and the first attention). The step's first kernel (the
    /// embedding) reads the token only after its wait,
    /// and the two kernels that read the step buffer (the position) before their wait, the
    /// fused-RoPE decode attention and the tensor-core one, run at least two kernels after the
    /// embedding (embedding → [norm →] q/k/v projection [→ rope_qkv] → attention), so the
    /// previous step's pick (argmax_final, or argmax_pick on a TP vocab split) has completed by
    /// then (attention.cu's ROPE note).
    pub fn enqueue_device_step(&mut self, seq: u64, sampling: DeviceSampling) -> Result<()> {
        self.check_fed(seq)?;
        let sample = sampling.kernel_args()?;
        let (r0, rn) = self.vocab_rows();
        let screened = self.screens(sample.is_none());
        // The GEMV shapes this step launches, for gemv_shapes (the log is off again whatever
        // the forward pass returns).
        *self.k.gemv_log.borrow_mut() = Some(Default::default());
        let encoded = self.forward_one(seq, (r0, rn), screened);
        let log = self.k.gemv_log.borrow_mut().take();
        encoded?;
        self.step_gemvs = log.map(|l| (self.generation, l));
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        let st = &self.k.stream;
        let feed = || -> Result<Feed<'_>> {
            Ok(Feed { step: whole(&self.decode.step, st)?, history: whole(&s.history, st)?, capacity: s.capacity })
        };
        if let Some(sc) = self.screen.as_ref().filter(|_| screened) {
            // The screened head's pick (the list the forward pass's screen filled), then, under
            // a vocab split, the same exchange and pick as the argmax's.
            let (state, list, out) = (whole(&sc.state, st)?, whole(&sc.list, st)?, whole(&self.argmax_out, st)?);
            let Some(sp) = self.head_split.as_ref().filter(|_| rn < self.spec.vocab) else {
                return self.k.head_pick(state, list, rn, out, Some(feed()?), None);
            };
            let split = ArgmaxSplit { base: r0, xchg: whole(&sp.xchg, st)?, rank: sp.rank, world: sp.world };
            self.k.head_pick(state, list, rn, out, Some(feed()?), Some(split))?;
            let sp = self.head_split.as_mut().ok_or_else(|| Error::Internal("vocab split".into()))?;
            self.reducer.all_reduce(ReduceBuf { data: &mut sp.xchg, len: 2 * sp.world, stream: st })?;
            return self.k.argmax_pick(whole(&sp.xchg, st)?, sp.world, whole(&self.argmax_out, st)?, Some(feed()?));
        }
        let (logits, pv, pi, out) = (
            region(&self.logits.buf, st, 0, rn)?,
            whole(&self.argmax_v, st)?,
            whole(&self.argmax_i, st)?,
            whole(&self.argmax_out, st)?,
        );
        let Some(sp) = self.head_split.as_mut().filter(|_| rn < self.spec.vocab) else {
            return self.k.argmax(logits, rn, sample, pv, pi, out, Some(feed()?), None);
        };
        // Vocab split: this rank's candidate into its slot, the slots summed over the ranks,
        // then every rank picks the same token from them.
        let split = ArgmaxSplit { base: r0, xchg: whole(&sp.xchg, st)?, rank: sp.rank, world: sp.world };
        // The feed goes along: the sampling noise is keyed by its position (step[1]); the final
        // pass writes only the exchange buffer, the pick updates the feed.
        self.k.argmax(logits, rn, sample, pv, pi, out, Some(feed()?), Some(split))?;
        self.reducer.all_reduce(ReduceBuf { data: &mut sp.xchg, len: 2 * sp.world, stream: st })?;
        self.k.argmax_pick(whole(&sp.xchg, st)?, sp.world, whole(&self.argmax_out, st)?, Some(feed()?))
    }

    /// Checks that `seq` owns the decode step buffer (its last
    /// [`device_decode_begin`](Self::device_decode_begin) was not followed by a host-fed step,
    /// a prefill or a `device_decode_begin` of another sequence). Call it before replaying a
    /// captured device-fed step: a replay does not go through these checks.
    pub fn check_fed(&self, seq: u64) -> Result<()> {
        if self.fed != Some(seq) {
            return Err(Error::InvalidArgument(format!(
                "device-fed step of sequence {seq} without a current device_decode_begin for it"
            )));
        }
        Ok(())
    }

    /// What a captured device-fed step of `seq` references that can change between sequences:
    /// use it (with the sampling mode) as the graph-cache key, so a graph is re-captured exactly
    /// when a new KV cache lands at another address or has another capacity.
    pub fn device_step_key(&self, seq: u64) -> Result<DeviceStepKey> {
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        let st = &self.k.stream;
        let ptr = |b: &CudaSlice<u16>| b.device_ptr(st).0;
        Ok(DeviceStepKey {
            k: ptr(&s.k),
            v: ptr(&s.v),
            history: s.history.device_ptr(st).0,
            capacity: s.capacity,
            n_splits: s.n_splits,
            dtype: self.k.dtype,
            projection: self.projection,
            generation: self.generation,
        })
    }

    /// Enqueues the copy of the device-chosen tokens at positions `first .. first + n` of `seq`
    /// into the runner's pinned host buffer (asynchronous; read them with
    /// [`token_readback`](Self::token_readback)). Not capturable (a host copy).
    pub fn enqueue_token_readback(&mut self, seq: u64, first: usize, n: usize) -> Result<()> {
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        first.checked_add(n).filter(|&e| e <= s.capacity + 1 && n > 0).ok_or_else(|| {
            Error::InvalidArgument(format!("token read-back {first}+{n} of a {}-token history", s.capacity + 1))
        })?;
        self.readback_len = 0;
        self.ctx.bind_to_thread().map_err(Error::driver("binding the context"))?;
        if let Some(done) = &self.readback_done {
            // A copy into the current buffer may still be in flight: let it land before the
            // buffer is reused or freed (cudarc's own event on it is never recorded).
            done.synchronize().map_err(Error::driver("token read-back"))?;
        }
        if self.readback.as_ref().is_none_or(|b| b.len() < n) {
            // SAFETY: the pinned buffer is only read after the copy below fills the part that
            // is read (token_readback reads the `n` last copied); u32 has no invalid bit patterns.
            let buf = unsafe { self.ctx.alloc_pinned_with_flags::<u32>(n.max(64), 0) }
                .map_err(Error::driver("cuMemHostAlloc (token read-back)"))?;
            self.readback = Some(buf);
        }
        let event = match &self.readback_done {
            Some(e) => e,
            None => self.readback_done.insert(
                self.ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(Error::driver("creating an event"))?,
            ),
        };
        let dst = self.readback.as_mut().ok_or_else(|| Error::Internal("read-back buffer".into()))?;
        // Waits for nothing of ours: cudarc's own event on the buffer is never recorded, since
        // the copy below is made with the raw call (cudarc's would copy the whole buffer).
        let host = dst.as_mut_slice().map_err(Error::driver("token read-back"))?;
        let (src, _) = s.history.device_ptr(&self.k.stream);
        let src = src + (first * std::mem::size_of::<u32>()) as u64;
        // SAFETY: `src` is `n` u32 inside the history allocation (first + n <= capacity + 1,
        // checked above), which outlives the copy (freed only in `release`, on this stream,
        // after it); `host[..n]` is pinned memory owned by the runner that nothing else writes,
        // read only after `readback_done` (recorded just after) completes.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host[..n], src, self.k.stream.cu_stream()) }
            .map_err(Error::driver("token read-back"))?;
        event.record(&self.k.stream).map_err(Error::driver("token read-back"))?;
        self.readback_len = n;
        Ok(())
    }

    /// Waits for the last [`enqueue_token_readback`](Self::enqueue_token_readback) and returns
    /// its tokens (also surfaces any error of the work enqueued before it).
    pub fn token_readback(&mut self) -> Result<&[u32]> {
        let n = self.readback_len;
        let (Some(buf), Some(done)) = (self.readback.as_ref(), self.readback_done.as_ref()) else {
            return Err(Error::InvalidArgument("no token read-back enqueued".into()));
        };
        done.synchronize().map_err(Error::driver("token read-back"))?;
        let all = buf.as_slice().map_err(Error::driver("token read-back"))?;
        Ok(&all[..n.min(all.len())])
    }

    /// The GEMV launch variant chosen per projection shape at start-up, as
    /// `(rows, cols, gate|up, "rows per warp x threads per block / k split-K")`.
    pub fn gemv_choices(&self) -> Vec<(usize, usize, bool, String)> {
        let mut v: Vec<_> = self
            .k
            .gemv_table
            .iter()
            .map(|(&(r, c, g), v)| {
                let lanes = if g { 32 } else { crate::plan::gemv_lanes_per_row(r, c, v.ks, self.k.gemv_lanes) };
                // The short-row kernels take two rows per group whatever the variant's `rows4`.
                let (rows, l) = match lanes {
                    32 => (if v.rows4 { 4 } else { 2 }, String::new()),
                    l => (2, format!("/l{l}")),
                };
                (r, c, g, format!("{rows}x{}/k{}{l}", v.block, v.ks))
            })
            .collect();
        v.sort();
        v
    }

    /// The tuned GEMV shapes of this runner's steps, in a fixed order (by rows, columns,
    /// gate|up), each with its launch variant now and the variants it may launch (indices into
    /// the variant list, `plan::GEMV_VARIANT_COUNT` of them: all of them, unless
    /// `FERRUM_GEMV_VARIANT` forces one; the start-up tuning picks among the balanced ones
    /// only, `plan::gemv_balanced`). For a
    /// tuning of the whole step ([`set_gemv_variant`](Self::set_gemv_variant)): the start-up
    /// tuning times each shape alone, and variants that time alike there may not run alike
    /// between the step's other kernels. Every shape tuned at start-up is listed, whether the
    /// step launches it now or not ([`GemvShape::launched`] says which).
    pub fn gemv_shapes(&self) -> Vec<GemvShape> {
        let launched = self.step_gemvs.as_ref().filter(|(g, _)| *g == self.generation).map(|(_, l)| l);
        let mut v: Vec<_> = self
            .k
            .gemv_table
            .iter()
            .map(|(&key @ (rows, cols, gateup), var)| GemvShape {
                rows,
                cols,
                gateup,
                variant: variant_index(var),
                candidates: self.k.gemv_candidates.get(&key).cloned().unwrap_or_default(),
                launched: launched.map(|l| l.contains(&key)),
            })
            .collect();
        v.sort_by_key(|s| (s.rows, s.cols, s.gateup));
        v
    }

    /// Launches the GEMV shape `(rows, cols, gateup)` with variant `variant` from now on (one
    /// of the shape's [`candidates`](GemvShape::candidates); its split-K factor is kept, so the
    /// results stay bit-identical). Captured steps are re-captured (their
    /// [`DeviceStepKey`] changes). An `InvalidArgument` error, and nothing changed, for a
    /// shape this runner does not launch or a variant that is not a candidate.
    pub fn set_gemv_variant(&mut self, rows: usize, cols: usize, gateup: bool, variant: usize) -> Result<()> {
        let key = (rows, cols, gateup);
        let ok = self.k.gemv_candidates.get(&key).is_some_and(|c| c.contains(&variant));
        let (Some(e), true) = (self.k.gemv_table.get_mut(&key), ok) else {
            return Err(Error::InvalidArgument(format!(
                "GEMV variant {variant} for the {rows} x {cols} shape (gate|up {gateup}): not one this runner may launch"
            )));
        };
        let v = GemvVariant { ks: e.ks, ..GEMV_VARIANTS[variant] };
        if *e != v {
            *e = v;
            self.generation += 1;
        }
        Ok(())
    }

    /// For tests: launches every tuned GEMV shape with variant `i` (of 4), keeping each shape's
    /// split-K factor. All such variants give bit-identical results; this lets a test check that.
    /// Under `FERRUM_GEMV_VARIANT` it may leave a shape at a variant outside its
    /// [`candidates`](GemvShape::candidates) (then the forced one only), which
    /// [`set_gemv_variant`](Self::set_gemv_variant) would refuse.
    #[doc(hidden)]
    pub fn force_gemv_variant(&mut self, i: usize) {
        let v = GEMV_VARIANTS[i % GEMV_VARIANTS.len()];
        self.generation += 1;
        for e in self.k.gemv_table.values_mut() {
            *e = GemvVariant { ks: e.ks, ..v };
        }
    }

    /// For tests: recomputes every tuned GEMV shape's split-K factor as
    /// `FERRUM_GEMV_KS_EXACT=max` would have chosen it at start-up (`plan::gemv_split_k_exact`,
    /// or the split `FERRUM_GEMV_KS_SHAPES` names for the shape), keeping each shape's launch
    /// variant. A shape whose split changes rounds differently (its
    /// stripes are summed in another grouping), so the result is checked against the CPU
    /// reference, not against the other splits' bits.
    #[doc(hidden)]
    pub fn force_gemv_ks_exact(&mut self, max: u32) {
        self.generation += 1;
        self.k.gemv_ks_exact = max;
        let splits: Vec<_> =
            self.k.gemv_table.keys().map(|&(r, c, g)| ((r, c, g), self.k.gemv_ks(r, c, g, self.sms))).collect();
        for (key, ks) in splits {
            if let Some(e) = self.k.gemv_table.get_mut(&key) {
                e.ks = ks;
            }
        }
    }

    /// Turns the decode-step fusions on or off (see [`Fusion`]; default all on, `FERRUM_FUSE=0`
    /// turns all off at start-up). For tests and A/B benchmarks. A captured step depends on
    /// them (its [`DeviceStepKey`] changes).
    #[doc(hidden)]
    pub fn set_fusion(&mut self, f: Fusion) {
        self.k.fuse_merge = f.split_merge;
        self.k.fuse_cluster = f.cluster;
        self.k.fuse_norms = f.norms;
        self.k.fuse_rope = f.rope;
        self.k.fuse_push = f.push;
        self.generation += 1;
    }

    /// How many consecutive device-fed steps a captured graph of them should hold
    /// ([`plan::GRAPH_STEPS`](crate::plan::GRAPH_STEPS), or `FERRUM_GRAPH_STEPS` at start-up):
    /// [`enqueue_device_step`](Self::enqueue_device_step) may be called that many times in one
    /// capture, each step reading what the one before wrote to the step buffer.
    pub fn steps_per_graph(&self) -> usize {
        self.k.graph_steps
    }

    /// Sets [`steps_per_graph`](Self::steps_per_graph), 1..=[`plan::MAX_GRAPH_STEPS`](crate::plan::MAX_GRAPH_STEPS).
    /// Only the caller's replay plan changes (a captured step does not depend on it).
    pub fn set_steps_per_graph(&mut self, steps: usize) -> Result<()> {
        self.k.graph_steps = crate::plan::check_graph_steps(steps)?;
        Ok(())
    }

    /// Whether the kernels launch with programmatic dependent launch (the compute_90 PTX on an
    /// sm_90 or later GPU, unless `FERRUM_PDL=0`).
    pub fn programmatic_launch(&self) -> bool {
        self.k.pdl
    }

    /// Whether the fused decode attention runs its own kernel for the head dims of
    /// `plan::ATTN_OWN_HEAD_DIMS` (default on, or `FERRUM_ATTN_HD_KERNELS`); off, the generic
    /// kernel runs. Bit-identical either way. For tests and A/B benchmarks.
    #[doc(hidden)]
    pub fn set_attn_head_dim_kernels(&mut self, on: bool) {
        self.k.attn_head_dim_kernels = on;
        self.generation += 1;
    }

    /// Whether one-GPU decode steps do the o projection inside the decode attention where it
    /// applies (as `FERRUM_ATTN_O` would at start-up; off by default, `plan::attn_o`): with the
    /// fused norms and RoPE, the cluster merge, and W_o slices within
    /// `plan::ATTN_O_MAX_BYTES`. The same math as the o GEMV with other f32 rounding. For tests
    /// and A/B benchmarks.
    #[doc(hidden)]
    pub fn set_attn_o(&mut self, on: bool) {
        self.k.fuse_o = on;
        self.generation += 1;
    }

    /// Whether the fused decode attention's one-token early-copy cluster case at head dim 64
    /// without bias or norms runs the compact kernel (as `FERRUM_ATTN_COMPACT` would at
    /// start-up; default on, `plan::attn_compact`). The same math with other f32 rounding (the
    /// sums over warps and splits in another order). For tests and A/B benchmarks.
    #[doc(hidden)]
    pub fn set_attn_compact(&mut self, on: bool) {
        self.k.attn_compact = on;
        self.generation += 1;
    }

    /// Which GEMVs load half their usual chunks before their wait (as
    /// `FERRUM_GEMV_PF_HALF` would at start-up; default `plan::HALF_PREFETCH_DEFAULT`). The same
    /// arithmetic whatever the setting. For tests and A/B benchmarks.
    #[doc(hidden)]
    pub fn set_half_prefetch(&mut self, t: crate::plan::HalfPrefetch) {
        self.k.half_prefetch = t;
        self.generation += 1;
    }

    /// Which one-GPU decode GEMVs let the next kernel launch before their wait (as
    /// `FERRUM_EARLY_TRIGGER` would at start-up; default `plan::EARLY_TRIGGER_DEFAULT`). The
    /// same arithmetic whatever the setting. For tests and A/B benchmarks.
    #[doc(hidden)]
    pub fn set_early_trigger(&mut self, t: crate::plan::EarlyTrigger) {
        self.k.early_trigger = t;
        self.generation += 1;
    }

    /// Enqueues a kernel on the runner's stream that leaves every byte of every
    /// multiprocessor's shared memory all-ones (NaN as f32, f16 and bf16); the GPU does not
    /// clear shared memory between kernels, so the next kernels' blocks start on it. For tests
    /// that check no kernel's results take in shared memory it did not write.
    #[doc(hidden)]
    pub fn poison_shared_memory(&self) -> Result<()> {
        self.k.poison_shared(self.sms)
    }

    /// Sets the tensor-core decode attention's shared-memory stages (as `FERRUM_ATTN_TC_STAGES`
    /// would at start-up, 2..=`plan::ATTN_TC_MAX_STAGES`) and whether it issues tiles before the
    /// programmatic-launch wait (`FERRUM_ATTN_TC_EARLY`). Bit-identical for every setting (the
    /// same tiles in the same order). For tests and A/B benchmarks.
    #[doc(hidden)]
    pub fn set_attn_tc_stages(&mut self, stages: usize, early: bool) -> Result<()> {
        if !(2..=crate::plan::ATTN_TC_MAX_STAGES).contains(&stages) {
            let max = crate::plan::ATTN_TC_MAX_STAGES;
            return Err(Error::InvalidArgument(format!("{stages} tensor-core attention stages (2..={max})")));
        }
        self.k.attn_tc_stages = stages;
        self.k.attn_tc_early = early;
        self.generation += 1;
        Ok(())
    }

    /// How the last decode step's attention merged its KV splits: `"none"` (one split),
    /// `"cluster"` (distributed shared memory in a thread-block cluster), `"ticket"` (the last
    /// split block, through global memory) or `"combine"` (a separate kernel). For tests.
    #[doc(hidden)]
    pub fn last_attention_merge(&self) -> &'static str {
        self.k.last_merge.get()
    }

    /// Sets how many KV splits `seq`'s decode attention uses (normally chosen from the capacity
    /// by [`init_sequence`](Self::init_sequence)), `1..=MAX_SPLITS`. For tests that need long
    /// splits (several 512-row tiles in one block) without a huge cache. A captured step
    /// depends on it (its [`DeviceStepKey`] holds the split count).
    #[doc(hidden)]
    pub fn set_attention_splits(&mut self, seq: u64, n: usize) -> Result<()> {
        if n == 0 || n > MAX_SPLITS {
            return Err(Error::InvalidArgument(format!("{n} attention splits (1..={MAX_SPLITS})")));
        }
        let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        s.n_splits = n;
        self.generation += 1;
        Ok(())
    }

    /// Fault injection for failure tests: enqueues a kernel launch that CUDA rejects (a block of
    /// 2048 threads) and returns the driver's genuine error. Nothing is written.
    #[doc(hidden)]
    pub fn inject_launch_failure(&self) -> Result<()> {
        let st = &self.k.stream;
        self.k.invalid_launch(whole(&self.argmax_v, st)?, whole(&self.argmax_i, st)?, whole(&self.argmax_out, st)?)
    }

    /// Ends (or checkpoints) device-fed decoding of `seq`: the sequence keeps `len` tokens
    /// (from the position given to `device_decode_begin` to at most its capacity). Steps run
    /// past `len` are discarded (their KV entries are overwritten later).
    pub fn device_decode_end(&mut self, seq: u64, len: usize) -> Result<()> {
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        if self.fed != Some(seq) {
            return Err(Error::InvalidArgument(format!("sequence {seq} is not being device-fed (len {})", s.len)));
        }
        let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        if len < s.len || len > s.capacity {
            return Err(Error::InvalidArgument(format!(
                "device-fed decoding of sequence {seq} began at {} and cannot keep {len} of {} tokens",
                s.len, s.capacity
            )));
        }
        s.len = len;
        Ok(())
    }
}

/// One GEMV shape of the decode step and its launch variants (see
/// [`CudaDecodeRunner::gemv_shapes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemvShape {
    /// Output rows (gate|up: outputs, each from two weight rows).
    pub rows: usize,
    pub cols: usize,
    /// The stacked gate|up projection.
    pub gateup: bool,
    /// The variant launched now.
    pub variant: usize,
    /// The variants [`CudaDecodeRunner::set_gemv_variant`] accepts for this shape (the one
    /// launched now among them); one only when `FERRUM_GEMV_VARIANT` forces it.
    pub candidates: Vec<usize>,
    /// Whether the last one-token device-fed step the runner encoded (captured or queued)
    /// launched this shape's GEMV; `None` when no such step was encoded since the settings
    /// last changed (anything that changes a [`DeviceStepKey`]'s generation: a variant, the
    /// screened head, the fold, the fusions, the projection). The LM head's is not launched
    /// under the screened head (its exact rows take the head variant's summation order, not
    /// its launch), the folded q/k/v's only with the fold, none with [`Projection::Cublas`].
    pub launched: Option<bool>,
}

/// A GEMV shape as the tuning table keys it: `(rows, cols, gate|up)` (the stacked gate|up
/// counts its outputs, not its weight rows).
pub type GemvKey = (usize, usize, bool);

impl GemvShape {
    /// The shape as the tuning table keys it.
    pub fn key(&self) -> GemvKey {
        (self.rows, self.cols, self.gateup)
    }
}

/// The index of `v`'s launch shape in [`GEMV_VARIANTS`] (its split-K factor aside).
fn variant_index(v: &GemvVariant) -> usize {
    GEMV_VARIANTS.iter().position(|g| (g.rows4, g.block) == (v.rows4, v.block)).unwrap_or(0)
}

/// Captures what `enqueue` queues on `st` into a graph (thread-local capture mode). The capture
/// is ended whatever `enqueue` returns, so that the stream stays usable after an error.
fn capture_chain(st: &Arc<CudaStream>, enqueue: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(Error::driver("beginning a GEMV tuning capture"))?;
    let queued = enqueue();
    let ended = st.end_capture(CUgraphInstantiate_flags(0));
    queued?;
    ended
        .map_err(Error::driver("ending a GEMV tuning capture"))?
        .ok_or_else(|| Error::Driver { what: "a GEMV tuning capture", msg: "the captured graph is empty".into() })
}

/// Launches of the LM head's GEMV per timed chain in [`tune_gemv`] (one matrix, re-read).
const TUNE_HEAD_CHAIN: usize = 3;
/// Timed chains per variant in [`tune_gemv`] (after one untimed warm-up chain); the median counts.
const TUNE_CHAINS: usize = 5;

/// Times the GEMV variants on each decode projection shape and keeps the fastest per shape:
/// the variants whose busiest multiprocessor has the least work, or within
/// `plan::GEMV_BALANCE_SLACK_PCT` of it (`plan::gemv_balanced`; the others are never timed).
/// All variants give bit-identical results, so this changes speed only.
///
/// A variant's time is the median of [`TUNE_CHAINS`] chains of launches with a zero input:
/// for a layer's projection, one launch per layer over that layer's own matrix; for the LM
/// head, [`TUNE_HEAD_CHAIN`] launches over its one matrix. Before each chain a memset of twice
/// the L2's size evicts the weights, so that they stream from memory as in a decode step (one
/// matrix re-launched, as the earlier tuning timed it, sat in the L2 whenever it was smaller,
/// which favours other variants), and consecutive launches overlap through programmatic
/// dependent launch as the step's kernels do. Every variant is timed under the same
/// conditions, and a layer chain averages over as many launches as the step makes, so the
/// choice no longer flips between runs on the noise of single launches. Where it differs from
/// the step: the memset leaves written lines in the L2 for the chain's first reads to evict;
/// and an LM head smaller than the L2 is partly cached after its first launch. Each chain is
/// captured into a graph once per variant and replayed, so launches of a few µs
/// (SmolLM2-135M's, about as long to queue as to run) are timed on the device alone.
///
/// With `FERRUM_GEMV_VARIANT` set nothing is timed. The flush buffer is for speed only: when
/// it does not fit beside the weights the chains run without it (a warning says so).
fn tune_gemv(ctx: &Arc<CudaContext>, k: &mut Kernels, s: &CudaModelSpec, w: &Weights, sms: usize) -> Result<()> {
    if w.layers.is_empty() {
        return Ok(());
    }
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    let of = |f: fn(&LayerW) -> &CudaSlice<u16>| w.layers.iter().map(f).collect::<Vec<_>>();
    let shapes: Vec<TuneShape<'_>> = vec![
        (s.qkv_dim(), s.hidden, false, of(|l| &l.wqkv)),
        (s.hidden, s.q_dim(), false, of(|l| &l.wo)),
        (s.intermediate, s.hidden, true, of(|l| &l.wgu)),
        (s.hidden, s.intermediate, false, of(|l| &l.wdown)),
        (s.vocab, s.hidden, false, vec![head; TUNE_HEAD_CHAIN]),
    ];
    // The split-K factor follows from the shape (Kernels::gemv_ks; weight rows: 2·inter for
    // gate|up); the variants timed below all share it, so the choice changes speed only.
    // A FERRUM_GEMV_KS_SHAPES entry that names no shape of this model changes nothing: say so
    // (gate|up's rows count both halves there, unlike the choices logged below). The folded
    // q/k/v's shape (set_folded_qkv, tuned when it is built) is one of the model's.
    let fold = (s.hidden + s.qkv_dim(), s.intermediate + s.hidden);
    for &(r, c, ks) in &k.gemv_ks_shapes {
        if (r, c) != fold
            && !shapes
                .iter()
                .any(|(rows, cols, gateup, _)| (crate::plan::gemv_weight_rows(*rows, *gateup), *cols) == (r, c))
        {
            tracing::warn!(rows = r, cols = c, ks, "FERRUM_GEMV_KS_SHAPES names no GEMV shape of this model");
        }
    }
    tune_shapes(ctx, k, shapes, sms)
}

/// A GEMV shape to tune: rows, columns, whether it is the stacked gate|up, and the matrices
/// of that shape (timed as one chain).
type TuneShape<'a> = (usize, usize, bool, Vec<&'a CudaSlice<u16>>);

/// Times the launch variants of each shape not yet in `k`'s table (see [`tune_gemv`]) and
/// records the pick.
fn tune_shapes(ctx: &Arc<CudaContext>, k: &mut Kernels, shapes: Vec<TuneShape<'_>>, sms: usize) -> Result<()> {
    if let Some(i) = k.gemv_variant {
        // FERRUM_GEMV_VARIANT: no timing, the same variant for every shape.
        for (rows, cols, gateup, _) in &shapes {
            let v = GemvVariant { ks: k.gemv_ks(*rows, *cols, *gateup, sms), ..GEMV_VARIANTS[i] };
            k.gemv_table.entry((*rows, *cols, *gateup)).or_insert(v);
            // Forced: no other variant for a step-level tuning to try.
            k.gemv_candidates.entry((*rows, *cols, *gateup)).or_insert_with(|| vec![i]);
        }
        return Ok(());
    }
    let st = k.stream.clone();
    let widest = shapes.iter().map(|x| x.1).max().unwrap_or(1);
    let tallest = shapes.iter().map(|x| x.0).max().unwrap_or(1);
    let x = alloc::<f32>(ctx, &st, widest, "GEMV tuning input")?;
    let y = alloc::<f32>(ctx, &st, tallest, "GEMV tuning output")?;
    let l2 = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        .map_err(Error::driver("device attribute"))?
        .max(1 << 20) as usize;
    let mut flush = match alloc::<u8>(ctx, &st, 2 * l2, "GEMV tuning L2 flush") {
        Ok(f) => Some(f),
        Err(e @ Error::OutOfMemory { .. }) => {
            tracing::warn!(%e, "GEMV tuning without the L2 flush");
            None
        }
        Err(e) => return Err(e),
    };
    let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver("creating an event"));
    let (e0, e1) = (ev()?, ev()?);
    for (rows, cols, gateup, mats) in shapes {
        let key = (rows, cols, gateup);
        if k.gemv_table.contains_key(&key) {
            continue;
        }
        let ks = k.gemv_ks(rows, cols, gateup, sms);
        // Only the variants that load the busiest multiprocessor least are timed
        // (plan::gemv_balanced says why); the lane count is the launch's (gemv_as).
        let lanes = if gateup { 32 } else { crate::plan::gemv_lanes_per_row(rows, cols, ks, k.gemv_lanes) };
        let launches = GEMV_VARIANTS
            .iter()
            .map(|v| GemvVariant { ks, ..*v }.blocks(rows, gateup, lanes))
            .collect::<Result<Vec<_>>>()?;
        let balanced = crate::plan::gemv_balanced(&launches, sms);
        // (time, blocks, variant) of each timed launch; plan::gemv_pick chooses.
        let mut timed: Vec<(f32, usize, GemvVariant)> = Vec::new();
        for ((v, _), launch) in GEMV_VARIANTS.iter().zip(&balanced).zip(&launches).filter(|((_, b), _)| **b) {
            let v = GemvVariant { ks, ..*v };
            k.gemv_table.insert(key, v);
            let mut times = Vec::with_capacity(TUNE_CHAINS);
            // The chain as one graph, so that its launches are all queued on the device when
            // it starts and no host enqueue time enters the timing.
            let graph = capture_chain(&st, || {
                for wb in &mats {
                    let (yr, wr, xr) = (region(&y, &st, 0, rows)?, whole(wb, &st)?, region(&x, &st, 0, cols)?);
                    if gateup {
                        k.gemv_gateup(yr, wr, xr, rows, cols)?;
                    } else {
                        k.gemv(yr, wr, xr, rows, cols)?;
                    }
                }
                Ok(())
            })?;
            graph.upload().map_err(Error::driver("uploading a GEMV tuning graph"))?;
            for chain in 0..=TUNE_CHAINS {
                if let Some(f) = flush.as_mut() {
                    st.memset_zeros(f).map_err(Error::driver("GEMV tuning L2 flush"))?;
                }
                e0.record(&st).map_err(Error::driver("event record"))?;
                graph.launch().map_err(Error::driver("launching a GEMV tuning graph"))?;
                e1.record(&st).map_err(Error::driver("event record"))?;
                e1.synchronize().map_err(Error::driver("event sync"))?;
                if chain > 0 {
                    times.push(e0.elapsed_ms(&e1).map_err(Error::driver("event time"))? / mats.len() as f32);
                }
            }
            times.sort_by(f32::total_cmp);
            let t = times[times.len() / 2];
            tracing::debug!(rows, cols, gateup, variant = ?v, blocks = launch.0, us = t * 1e3, "GEMV variant timed");
            timed.push((t, launch.0, v));
        }
        let pick = crate::plan::gemv_pick(&timed.iter().map(|t| (t.0, t.1)).collect::<Vec<_>>(), k.gemv_tie);
        let (t, _, v) = pick.map_or((f32::MAX, 0, GemvVariant { ks, ..GemvVariant::default() }), |i| timed[i]);
        k.gemv_table.insert(key, v);
        // Every variant stays a candidate for a tuning on the whole step, the unbalanced ones
        // too: what a launch costs between the step's other kernels is what that tuning measures.
        k.gemv_candidates.insert(key, (0..GEMV_VARIANTS.len()).collect());
        tracing::debug!(rows, cols, gateup, variant = ?v, us = t * 1e3, "GEMV variant chosen");
    }
    Ok(())
}

/// y = W x for `n` rows of x (x and y fp32, W in the dtype): GEMV at batch 1 (unless cuBLAS
/// is chosen), else x is rounded to the dtype into `xh` (cuBLAS's tensor-core GEMM needs
/// 16-bit inputs) and multiplied by a cuBLAS GEMM with fp32 output.
#[allow(clippy::too_many_arguments)]
fn project(
    k: &Kernels,
    p: Projection,
    y: Region<'_, f32>,
    w: Region<'_, u16>,
    x: Region<'_, f32>,
    xh: Region<'_, u16>,
    rows: usize,
    cols: usize,
    n: usize,
) -> Result<()> {
    if n == 1 && p == Projection::Gemv {
        k.gemv(y, w, x, rows, cols)
    } else {
        k.to_dtype(xh, x, n * cols)?;
        k.gemm(y, w, xh, rows, cols, n)
    }
}

fn opt<'a>(b: &'a Option<CudaSlice<u16>>, st: &CudaStream) -> Result<Region<'a, u16>> {
    match b {
        Some(b) => whole(b, st),
        None => Ok(Region::null()),
    }
}

/// `x += Σ_ranks o; y = RMSNorm(x) * norm` over `n` rows (`o`: this rank's partial; its
/// contents afterwards are unspecified): one peer kernel for a decode token when the reducer has a peer group, else the
/// reducer's all-reduce and then `add_rmsnorm`.
#[allow(clippy::too_many_arguments)]
fn reduce_add_rmsnorm(
    k: &Kernels,
    reducer: &mut dyn Reducer,
    (x, o, y): (&DevBuf<f32>, &mut DevBuf<f32>, &DevBuf<f32>),
    norm: &DevBuf<u16>,
    n: usize,
    h: usize,
    eps: f32,
) -> Result<()> {
    let st = &k.stream;
    if let Some(peer) = reducer.peer().filter(|p| n == 1 && h <= p.capacity()) {
        let (x, o, y) = (region(x, st, 0, h)?, region(o, st, 0, h)?, region(y, st, 0, h)?);
        return k.peer_add_rmsnorm(peer, x, o, y, whole(norm, st)?, h, eps, false);
    }
    reducer.all_reduce(ReduceBuf { data: o, len: n * h, stream: st })?;
    k.add_rmsnorm(
        region(x, st, 0, n * h)?,
        region(o, st, 0, n * h)?,
        region(y, st, 0, n * h)?,
        whole(norm, st)?,
        n,
        h,
        eps,
    )
}

/// `o = W input` (one decode token, `h` rows of `cols`) by the `_push` GEMV, which also pushes
/// this rank's partial to the peers, then `x += Σ_ranks o; y = RMSNorm(x) * norm` by the peer
/// kernel that only waits for the peers' lines and sums: bit-identical to [`project`] and
/// [`reduce_add_rmsnorm`]'s peer path, with the push off the serial chain (it happens as each
/// GEMV warp stores its outputs, not after a kernel boundary and a reload of `o`).
#[allow(clippy::too_many_arguments)]
fn push_add_rmsnorm(
    k: &Kernels,
    peer: &peer::PeerRank,
    (x, o, y): (&DevBuf<f32>, &DevBuf<f32>, &DevBuf<f32>),
    w: Region<'_, u16>,
    input: Region<'_, f32>,
    cols: usize,
    norm: &DevBuf<u16>,
    h: usize,
    eps: f32,
) -> Result<()> {
    let st = &k.stream;
    k.gemv_push(peer, region(o, st, 0, h)?, w, input, h, cols)?;
    let (x, o, y) = (region(x, st, 0, h)?, region(o, st, 0, h)?, region(y, st, 0, h)?);
    k.peer_add_rmsnorm(peer, x, o, y, whole(norm, st)?, h, eps, true)
}

/// `o = W input; x += Σ_ranks o; y = RMSNorm(x) * norm` for the o and down projections of a
/// layer whose norms are not fused (`input`: the projection's input buffer and its width
/// `cols`; `xh` its dtype copy for cuBLAS). With `push` (one decode token on the GEMV path)
/// over a peer group whose capacity takes the row: [`push_add_rmsnorm`]; otherwise [`project`]
/// and [`reduce_add_rmsnorm`]. The two are bit-identical.
#[allow(clippy::too_many_arguments)]
fn project_add_rmsnorm(
    k: &Kernels,
    p: Projection,
    reducer: &mut dyn Reducer,
    push: bool,
    (x, o, y, xh): (&DevBuf<f32>, &mut DevBuf<f32>, &DevBuf<f32>, &DevBuf<u16>),
    w: Region<'_, u16>,
    (input, cols): (&DevBuf<f32>, usize),
    norm: &DevBuf<u16>,
    n: usize,
    h: usize,
    eps: f32,
) -> Result<()> {
    let st = &k.stream;
    if let Some(peer) = reducer.peer().filter(|pr| push && h <= pr.capacity()) {
        return push_add_rmsnorm(k, peer, (x, o, y), w, region(input, st, 0, cols)?, cols, norm, h, eps);
    }
    let (input, inh) = (region(input, st, 0, n * cols)?, region(xh, st, 0, n * cols)?);
    project(k, p, region(o, st, 0, n * h)?, w, input, inh, h, cols, n)?;
    reduce_add_rmsnorm(k, reducer, (x, o, y), norm, n, h, eps)
}

/// The screened head's overflow guard `(1 + gamma) wmax`, rounded up (misc.cu): no bound when
/// it times `||x'||_1` reaches `f32::MAX`. `wmax` is the largest `max |w|` of a finite row.
fn screen_overflow_guard(wmax: f32, cols: usize) -> f32 {
    let k = cols as f64 / 16_777_216.0;
    let g = (1.0 + k / (1.0 - k)) * wmax as f64 * (1.0 + 1e-6);
    // f64 -> f32 rounds to nearest; one step up makes it an upper bound (inf stays inf).
    let f = g as f32;
    if f.is_finite() && (f as f64) < g {
        f32::from_bits(f.to_bits() + 1)
    } else if f.is_finite() {
        f
    } else {
        f32::INFINITY
    }
}

/// One pass over `n` tokens whose ids are `a.step[0..n]`, the first at position `a.step[a.cap]`.
/// Leaves the last row's logits in `logits`. Activations stay fp32 from kernel to kernel; the
/// only roundings to the dtype are the K/V written to the cache and, on the cuBLAS path, the
/// GEMM inputs (`project`).
#[allow(clippy::too_many_arguments)]
fn forward(
    k: &Kernels,
    s: &CudaModelSpec,
    w: &Weights,
    inv_freq: &CudaSlice<f32>,
    a: &mut Acts,
    seq: &mut Sequence,
    n: usize,
    decode: bool,
    p: Projection,
    reducer: &mut dyn Reducer,
    head: HeadJob<'_>,
) -> Result<()> {
    if n == 0 || n > a.cap {
        return Err(Error::Internal(format!("forward of {n} tokens with buffers for {}", a.cap)));
    }
    let st = &k.stream;
    let (h, eps, inter) = (s.hidden, s.rms_eps, s.intermediate);
    let (qkv_dim, q_dim) = (s.qkv_dim(), s.q_dim());
    let layer_len = s.kv_dim() * seq.capacity;
    let pos = region(&a.step, st, a.cap, 1)?;
    // One token on one GPU with the GEMV path: the residual adds and RMSNorms fold into the
    // projections (gemv.cu's `_res` and `_norm` kernels), so a layer is qkv, rope, attention,
    // o (+= x), gate|up (of norm(x)), down (+= x). Otherwise (prefill, cuBLAS, TP, whose
    // all-reduce sits between a projection and its residual add) the norms run on their own.
    // Only up to k.norms_max_hidden (launch::FUSED_NORMS_MAX_HIDDEN by default).
    let fused_norms =
        k.fuse_norms && n == 1 && p == Projection::Gemv && reducer.is_identity() && h <= k.norms_max_hidden;
    // TP over a peer group, one token on the GEMV path: the o / down GEMVs push their partials
    // to the peers (push_add_rmsnorm), when the group's capacity takes the message.
    let push = k.fuse_push && n == 1 && p == Projection::Gemv;
    let splits = if decode { seq.n_splits } else { 1 };
    // Decode: warps, and whether the fused kernel copies its split's rows before the
    // programmatic-launch wait (plan::attn_warps). Only with PDL: without it (the compute_80
    // PTX) the copies gain nothing, and their shared memory would only cost occupancy.
    let (attn_warps, early) = if decode { attn_warps(s.head_dim, seq.capacity.div_ceil(splits)) } else { (4, false) };
    let early = early && k.pdl;
    // Which attention runs (the same for every layer): prompt chunks of PREFILL_MIN_TOKENS or
    // more take the tensor-core prefill kernel; one decode token over a long cache the
    // tensor-core decode kernel, after the separate rope kernel; otherwise the row-walking
    // kernel, with RoPE inside it when fused.
    let prefill_tc = !decode && n >= PREFILL_MIN_TOKENS && crate::plan::PREFILL_HEAD_DIMS.contains(&s.head_dim);
    let tensor_core = decode
        && n == 1
        && crate::plan::attn_tensor_core(s.head_dim, s.heads, s.kv_heads, seq.capacity, k.attn_tc_min_capacity);
    let fused_rope = k.fuse_rope && decode && n == 1 && !tensor_core;
    // Several splits (decode only, one token): the row-walking kernel's last split block merges
    // them when fused; otherwise (fusion off, or the tensor-core kernel) a combine kernel does.
    let fused_merge = k.fuse_merge && splits > 1 && n == 1 && !tensor_core;
    // At most plan::ATTN_MAX_CLUSTER splits on the compute_90 kernels (k.pdl): the split blocks
    // of each head run as one thread-block cluster and merge through distributed shared memory.
    let cluster_merge = fused_merge && k.fuse_cluster && crate::plan::attn_cluster(splits, k.pdl);
    // One GPU with the fused norms and RoPE, the splits of each head in one cluster (which
    // shares the head's o-projection rows), and the W_o slices within the shared-memory
    // allowance: the attention also does x += W_o attn, in place of the o GEMV.
    let fused_o = k.fuse_o
        && fused_norms
        && fused_rope
        && cluster_merge
        && crate::plan::attn_o_fits(
            crate::plan::attn_dyn_bytes(attn_warps, early, cluster_merge, splits, s.head_dim),
            h,
            s.head_dim,
            splits,
            k.attn_o_smem_max,
        );
    // The folded q/k/v projection (CudaDecodeRunner::set_folded_qkv): one token on the fused
    // path with the attention's own RoPE (the row-walking kernel, no o fusion). Layer li's
    // activations are then buffer li % 2 of a.fold, `[h | x | u]` (Acts::fold).
    let fold = match (&w.fold, &a.fold) {
        (Some(f), Some(buf)) if fused_norms && fused_rope && !fused_o && decode && f.len() + 1 == w.layers.len() => {
            Some((f, buf))
        }
        _ => None,
    };
    let fw = fold_stride(s);
    // The early triggers (plan::EarlyTrigger; common.cuh): the o projection lets gate|up launch,
    // and the down projection the next q/k/v projection or the LM head, before their own wait
    // (both read only weights before theirs, the screen its int8 copy; the kernels before the
    // two GEMVs, the attention or the split combine, and gate|up, trigger after their wait).
    // The one-GPU fused path with programmatic launch only (without it the trigger compiles
    // to nothing), without the fold (whose down GEMV feeds the next attention, which reads the
    // position and the cache before its wait) and without the o projection inside the
    // attention (no o GEMV there, and the down projection's trigger was not measured with it).
    let et = match fold {
        None if fused_norms && !fused_o && k.pdl => k.early_trigger,
        _ => crate::plan::EarlyTrigger::NONE,
    };
    // Layer li's residual x (`[hidden]`, one token on the fused path).
    let x_of = |li: usize| match fold {
        Some((_, buf)) => region(buf, st, (li % 2) * fw + inter, h),
        None => region(&a.x, st, 0, h),
    };
    match fold {
        Some(_) => k.embed(x_of(0)?, whole(&w.embed, st)?, region(&a.step, st, 0, n)?, n, s.vocab, h)?,
        None => {
            k.embed(region(&a.x, st, 0, n * h)?, whole(&w.embed, st)?, region(&a.step, st, 0, n)?, n, s.vocab, h)?
        }
    }
    if !fused_norms {
        k.rmsnorm(
            region(&a.y, st, 0, n * h)?,
            region(&a.x, st, 0, n * h)?,
            whole(&w.layers[0].attn_norm, st)?,
            n,
            h,
            eps,
        )?;
    }
    if decode {
        k.last_merge.set(match (splits > 1, cluster_merge, fused_merge) {
            (false, _, _) => "none",
            (true, true, _) => "cluster",
            (true, false, true) => "ticket",
            (true, false, false) => "combine",
        });
    }
    for (li, lw) in w.layers.iter().enumerate() {
        // Folded, past layer 0: the previous down projection wrote u (q/k/v before the norm's
        // scalar) after this layer's x, and the attention applies the scalar.
        let (qkv_row, pre) = match fold {
            Some((_, buf)) if li > 0 => (region(buf, st, (li % 2) * fw + inter + h, qkv_dim)?, x_of(li)?),
            _ => (region(&a.qkv, st, 0, n * qkv_dim)?, Region::null()),
        };
        let folded_in = fold.is_some() && li > 0;
        if folded_in {
            // (u is already in place)
        } else if fused_norms {
            // qkv = W_qkv (RMSNorm(x) * attn_norm)
            let norm = GemvIo::Norm { w: whole(&lw.attn_norm, st)?, eps };
            k.gemv_io(region(&a.qkv, st, 0, qkv_dim)?, whole(&lw.wqkv, st)?, x_of(li)?, qkv_dim, h, norm)?;
        } else {
            project(
                k,
                p,
                region(&a.qkv, st, 0, n * qkv_dim)?,
                whole(&lw.wqkv, st)?,
                region(&a.y, st, 0, n * h)?,
                region(&a.xh, st, 0, n * h)?,
                qkv_dim,
                h,
                n,
            )?;
        }
        let kc = region(&seq.k, st, li * layer_len, layer_len)?;
        let vc = region(&seq.v, st, li * layer_len, layer_len)?;
        // One decode token: the attention kernel does RoPE and the K/V append itself.
        let rope = AttnRope {
            bias: opt(&lw.bqkv, st)?,
            q_norm: opt(&lw.q_norm, st)?,
            k_norm: opt(&lw.k_norm, st)?,
            inv_freq: whole(inv_freq, st)?,
            eps,
            pre,
            early,
        };
        if !fused_rope {
            k.rope_qkv(
                region(&a.qkv, st, 0, n * qkv_dim)?,
                rope.bias,
                rope.q_norm,
                rope.k_norm,
                kc,
                vc,
                rope.inv_freq,
                pos,
                n,
                s.heads,
                s.kv_heads,
                s.head_dim,
                seq.capacity,
                eps,
            )?;
        }
        if prefill_tc {
            k.attn_prefill(
                region(&a.qkv, st, 0, n * qkv_dim)?,
                qkv_dim,
                kc,
                vc,
                region(&a.attn, st, 0, n * q_dim)?,
                pos,
                n,
                s.heads,
                s.kv_heads,
                s.head_dim,
                seq.capacity,
            )?;
        } else if tensor_core {
            k.attn_gqa(
                region(&a.qkv, st, 0, qkv_dim)?,
                qkv_dim,
                kc,
                vc,
                region(&a.attn, st, 0, q_dim)?,
                whole(&a.part_acc, st)?,
                whole(&a.part_ml, st)?,
                pos,
                1,
                splits,
                s.heads,
                s.kv_heads,
                s.head_dim,
                seq.capacity,
            )?;
        } else {
            let o = AttnO {
                wo: whole(&lw.wo, st)?,
                x: region(&a.x, st, 0, h)?,
                part: whole(&a.part_o, st)?,
                ticket: whole(&a.o_ticket, st)?,
                hidden: h,
            };
            k.attn(
                fused_rope.then_some(rope),
                fused_o.then_some(o),
                qkv_row,
                qkv_dim,
                kc,
                vc,
                region(&a.attn, st, 0, n * q_dim)?,
                whole(&a.part_acc, st)?,
                whole(&a.part_ml, st)?,
                if fused_merge { whole(&a.attn_counters, st)? } else { Region::null() },
                pos,
                n,
                splits,
                attn_warps,
                cluster_merge,
                s.heads,
                s.kv_heads,
                s.head_dim,
                seq.capacity,
            )?;
        }
        if splits > 1 && !fused_merge {
            k.attn_combine(
                region(&a.attn, st, 0, n * q_dim)?,
                whole(&a.part_acc, st)?,
                whole(&a.part_ml, st)?,
                n,
                splits,
                s.heads,
                s.head_dim,
            )?;
        }
        if fused_norms {
            // x += W_o attn (unless the attention did it); h = silu·mul of W_gu (RMSNorm(x) *
            // mlp_norm); x += W_down h
            if !fused_o {
                k.gemv_io(
                    x_of(li)?,
                    whole(&lw.wo, st)?,
                    region(&a.attn, st, 0, q_dim)?,
                    h,
                    q_dim,
                    GemvIo::AddTo { early_trigger: et.o },
                )?;
            }
            let mlp_norm = Some((whole(&lw.mlp_norm, st)?, eps));
            let cur = (li % 2) * fw;
            let hr = match fold {
                Some((_, buf)) => region(buf, st, cur, inter)?,
                None => region(&a.h, st, 0, inter)?,
            };
            k.gemv_gateup_io(hr, whole(&lw.wgu, st)?, x_of(li)?, inter, h, mlp_norm)?;
            match fold.and_then(|(f, buf)| f.get(li).map(|d| (d, buf))) {
                // [x' | u'] (the other buffer) = D [h | x]: the next layer's residual and its q/k/v
                // before the norm's scalar (fold.cu's fold_qkv)
                Some((d, buf)) => k.gemv_io(
                    region(buf, st, fw - cur + inter, h + qkv_dim)?,
                    whole(d, st)?,
                    region(buf, st, cur, inter + h)?,
                    h + qkv_dim,
                    inter + h,
                    GemvIo::Plain,
                )?,
                None => {
                    k.gemv_io(x_of(li)?, whole(&lw.wdown, st)?, hr, h, inter, GemvIo::AddTo { early_trigger: et.down })?
                }
            }
            continue;
        }
        let acts = (&a.x, &mut a.o, &a.y, &a.xh);
        project_add_rmsnorm(k, p, reducer, push, acts, whole(&lw.wo, st)?, (&a.attn, q_dim), &lw.mlp_norm, n, h, eps)?;
        if n == 1 && p == Projection::Gemv {
            k.gemv_gateup(region(&a.h, st, 0, inter)?, whole(&lw.wgu, st)?, region(&a.y, st, 0, h)?, inter, h)?;
        } else {
            project(
                k,
                p,
                region(&a.gu, st, 0, n * 2 * inter)?,
                whole(&lw.wgu, st)?,
                region(&a.y, st, 0, n * h)?,
                region(&a.xh, st, 0, n * h)?,
                2 * inter,
                h,
                n,
            )?;
            k.silu_mul(region(&a.h, st, 0, n * inter)?, region(&a.gu, st, 0, n * 2 * inter)?, inter, n)?;
        }
        let next_norm = match w.layers.get(li + 1) {
            Some(next) => &next.attn_norm,
            None => &w.final_norm,
        };
        let acts = (&a.x, &mut a.o, &a.y, &a.xh);
        project_add_rmsnorm(k, p, reducer, push, acts, whole(&lw.wdown, st)?, (&a.h, inter), next_norm, n, h, eps)?;
    }
    // The LM head's rows r0 .. r0 + rn (all of them, or a vocab split's share: see
    // `set_vocab_split`), launched as the whole head's GEMV so each row rounds alike.
    let hw = w.lm_head.as_ref().unwrap_or(&w.embed);
    let (logits, (r0, rn)) = match head {
        HeadJob::Logits(logits, rows) => (logits, rows),
        HeadJob::Screen(sc) => {
            let (r0, rn) = sc.rows;
            // The screened head reads the GEMV's input (and applies the final norm when the
            // GEMV would) and repeats its arithmetic for the rows it re-reads.
            if n != 1 || p != Projection::Gemv {
                return Err(Error::Internal("the screened head runs on one-token GEMV steps only".into()));
            }
            let head = region(hw, st, r0 * h, rn * h)?;
            let (input, norm) = if fused_norms {
                (x_of(w.layers.len() - 1)?, Some((whole(&w.final_norm, st)?, eps)))
            } else {
                (region(&a.y, st, 0, h)?, None)
            };
            return k.head_screen(&sc.view(st)?, head, input, norm, rn, h, s.vocab);
        }
    };
    let (logits, head) = (region(logits, st, 0, rn)?, region(hw, st, r0 * h, rn * h)?);
    if fused_norms {
        // logits = W_head (RMSNorm(x) * final_norm)
        let norm = GemvIo::Norm { w: whole(&w.final_norm, st)?, eps };
        return k.gemv_as(logits, head, x_of(w.layers.len() - 1)?, rn, h, norm, s.vocab);
    }
    let last = region(&a.y, st, (n - 1) * h, h)?;
    if p == Projection::Gemv {
        return k.gemv_as(logits, head, last, rn, h, GemvIo::Plain, s.vocab);
    }
    project(k, p, logits, head, last, region(&a.xh, st, 0, h)?, rn, h, 1)
}
