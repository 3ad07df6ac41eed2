//! Tensor parallelism on GPUs: one [`CudaRank`] per GPU with an NCCL reducer, either all in
//! this process (ferrum-tp's [`TpDecodeGroup`], one persistent thread per GPU) or one rank per
//! process (`--rank / --world-size / --rendezvous`, the path to several machines).
//!
//! Sharding is the same pass as on the CPU ([`crate::shard`]): whole KV groups per rank (uneven
//! when the ranks do not divide the KV heads), MLP columns split evenly, embeddings, norms and
//! the LM head replicated. Each rank sums its two per-layer partial results on its stream,
//! inside the rank's decode graph: in an in-process group whose GPUs reach each other's memory,
//! a decode token's sums take ferrum-cuda's one-shot peer all-reduce fused with the residual
//! add + RMSNorm after it ([`ferrum_cuda::peer`]; `FERRUM_ALLREDUCE=nccl` turns it off), and
//! everything else (prefill chunks, process ranks) an in-place NCCL all-reduce. Both hand every
//! rank the same sums, so every rank computes the same logits and chooses the same tokens.
//!
//! **Failure.** Any rank error or panic poisons the group (ferrum-tp returns it at once, naming
//! the rank); this backend then aborts every rank's communicator and peer kernels, so ranks
//! blocked in an all-reduce on the GPU return, and the group's threads can be joined when it is
//! dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferrum_cuda::peer::{peer_group, PeerHandle, PeerRank, PeerReducer, DEFAULT_PEER_TIMEOUT};
use ferrum_cuda::{CudaDecodeRunner, ReduceBuf, Reducer, ShardRange};
use ferrum_nccl::{AbortHandle, NcclRank, Rendezvous, RendezvousOptions};
use ferrum_tp::{RankContext, RankWorker, SequenceId, StepInput, TpConfig, TpDecodeGroup, TpError};
use parking_lot::Mutex;

use crate::backend::{drive_device_batches, DecodeBackend, DeviceRun, DeviceSampling};
use crate::config::ModelConfig;
use crate::cuda_backend::{build_runner, cuda_error, device_run, spec_of, CudaBackend};
use crate::cuda_rank::{CudaRank, Fault};
use crate::error::{Error, Result};
use crate::session::DistOptions;
use crate::tp::flatten;
use crate::weights::ModelWeights;

fn nccl_error(e: ferrum_nccl::Error) -> Error {
    Error::Tp(format!("NCCL: {e}"))
}

/// Sums the runner's partial results over the ranks with NCCL (in place, on the runner's
/// stream: graph-capturable).
#[derive(Debug)]
pub struct NcclReducer {
    rank: Arc<NcclRank>,
}

impl NcclReducer {
    /// A reducer over `rank`'s communicator.
    pub fn new(rank: Arc<NcclRank>) -> Self {
        Self { rank }
    }
}

impl Reducer for NcclReducer {
    fn all_reduce(&mut self, buf: ReduceBuf<'_>) -> ferrum_cuda::Result<()> {
        let mut view = buf.data.slice_mut(0..buf.len);
        self.rank
            .all_reduce_sum_in_place(&mut view, buf.stream)
            .map_err(|e| ferrum_cuda::Error::Reduce(format!("rank {}: {e}", self.rank.rank())))
    }
}

/// One eager all-reduce of a decode step's size on the runner's stream, waited for. NCCL
/// connects peers lazily, at a size's first collective, and cannot do so while a stream
/// captures: this makes the connections the captured decode all-reduces use. Every rank must
/// call it (it is a collective).
fn warm_up(runner: &CudaDecodeRunner, nccl: &NcclRank) -> Result<()> {
    let st = runner.stream();
    let mut buf = st
        .alloc_zeros::<f32>(runner.spec().hidden)
        .map_err(|e| Error::Unavailable("CUDA", format!("allocating the NCCL warm-up buffer: {e}")))?;
    nccl.all_reduce_sum_in_place(&mut buf, st).map_err(nccl_error)?;
    runner.synchronize().map_err(cuda_error)
}

/// One GPU of an in-process group.
pub struct CudaTpWorker {
    rank: CudaRank,
    nccl: Arc<NcclRank>,
    /// KV capacity for the next `kv_init` (set by the driver before the command).
    capacity: Arc<AtomicUsize>,
    /// Rank 0's logits of the last host-fed step or prefill.
    out: Arc<Mutex<Vec<f32>>>,
}

impl std::fmt::Debug for CudaTpWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTpWorker").field("rank", &self.rank).finish_non_exhaustive()
    }
}

impl CudaTpWorker {
    /// Rank 0 copies its logits out (waiting for the GPU); the others wait for their stream, so
    /// their errors surface in this round too.
    fn publish(&mut self, ctx: &RankContext) -> Result<()> {
        if ctx.rank() == 0 {
            let mut out = self.out.lock();
            self.rank.runner().logits_to_host(&mut out).map_err(cuda_error)?;
        } else {
            self.rank.runner().synchronize().map_err(cuda_error)?;
        }
        self.rank.check_peer()
    }

    fn prefill(&mut self, ctx: &RankContext, seq: SequenceId, tokens: &[u32]) -> Result<()> {
        self.rank.runner().prefill(seq.0, tokens).map_err(cuda_error)?;
        self.publish(ctx)
    }
}

impl RankWorker for CudaTpWorker {
    type Error = Error;

    fn decode_step(&mut self, ctx: &RankContext, step: StepInput) -> Result<()> {
        self.rank.step(step.sequence.0, step.token, step.position)?;
        self.publish(ctx)
    }

    fn kv_init(&mut self, _: &RankContext, sequence: SequenceId) -> Result<()> {
        // Relaxed: the kv_init command that triggers this read was sent through a channel
        // after the store, which orders them.
        let cap = self.capacity.load(Ordering::Relaxed);
        self.rank.runner().init_sequence(sequence.0, cap).map_err(cuda_error)
    }

    fn kv_release(&mut self, _: &RankContext, sequence: SequenceId) -> Result<()> {
        self.rank.runner().release(sequence.0).map_err(cuda_error)
    }
}

/// Which all-reduce an in-process group's decode steps use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AllReduce {
    /// The one-shot peer kernel when every pair of GPUs has peer access, else NCCL.
    #[default]
    Auto,
    /// NCCL only.
    Nccl,
    /// The one-shot peer kernel (an error when the GPUs lack peer access).
    Peer,
}

impl AllReduce {
    /// `FERRUM_ALLREDUCE` (`auto`, `nccl` or `peer`; unset: auto).
    pub fn from_env() -> Result<Self> {
        match std::env::var("FERRUM_ALLREDUCE").ok().as_deref().map(str::trim) {
            None | Some("auto") => Ok(Self::Auto),
            Some("nccl") => Ok(Self::Nccl),
            Some("peer") => Ok(Self::Peer),
            Some(v) => Err(Error::InvalidInput(format!("FERRUM_ALLREDUCE={v:?}: expected auto, nccl or peer"))),
        }
    }
}

/// How an in-process TP group is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpOptions {
    /// Which all-reduce sums the decode steps.
    pub all_reduce: AllReduce,
    /// Device-fed steps split the LM head by vocabulary rows over the ranks
    /// (`CudaDecodeRunner::set_vocab_split`): each rank reads its share of the head instead of
    /// the whole, and the ranks exchange one candidate each.
    pub vocab_split: bool,
    /// The decode fusions of every rank's runner (`None`: the runner's default, i.e.
    /// `FERRUM_FUSE`); for A/B tests.
    pub fusion: Option<ferrum_cuda::Fusion>,
}

impl Default for TpOptions {
    fn default() -> Self {
        Self { all_reduce: AllReduce::Auto, vocab_split: true, fusion: None }
    }
}

impl TpOptions {
    /// `FERRUM_ALLREDUCE` ([`AllReduce::from_env`]) and `FERRUM_TP_VOCAB_SPLIT` (`1`, the
    /// default, or `0`).
    pub fn from_env() -> Result<Self> {
        Ok(Self { all_reduce: AllReduce::from_env()?, vocab_split: vocab_split_from_env()?, fusion: None })
    }
}

/// `FERRUM_TP_VOCAB_SPLIT`: `1` (unset: on) or `0`.
pub fn vocab_split_from_env() -> Result<bool> {
    parse_vocab_split(std::env::var("FERRUM_TP_VOCAB_SPLIT").ok().as_deref())
}

fn parse_vocab_split(v: Option<&str>) -> Result<bool> {
    match v.map(str::trim) {
        None | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(Error::InvalidInput(format!("FERRUM_TP_VOCAB_SPLIT={v:?}: expected 0 or 1"))),
    }
}

/// The peer group of `ordinals` for messages of `hidden` floats, as `mode` asks.
fn peer_ranks(mode: AllReduce, ordinals: &[usize], hidden: usize) -> Result<Option<Vec<PeerRank>>> {
    if mode == AllReduce::Nccl || ordinals.len() < 2 {
        return Ok(None);
    }
    match peer_group(ordinals, hidden, DEFAULT_PEER_TIMEOUT) {
        Ok(r) => Ok(Some(r)),
        Err(e) if mode == AllReduce::Auto => {
            tracing::info!(error = %e, "no peer all-reduce: NCCL sums the decode steps");
            Ok(None)
        }
        Err(e) => Err(cuda_error(e)),
    }
}

/// What a failed group aborts: every rank's communicator and peer kernels.
struct Aborts {
    nccl: Vec<AbortHandle>,
    peer: Vec<PeerHandle>,
}

impl Aborts {
    /// Aborts every rank's peer kernels and communicator (so no rank stays blocked in a
    /// collective). ncclCommAbort takes a while (it stops NCCL's proxy threads): the
    /// communicators are aborted in parallel.
    #[cold]
    fn abort_all(&self, msg: &str) {
        for p in &self.peer {
            p.abort();
        }
        std::thread::scope(|s| {
            for a in &self.nccl {
                s.spawn(|| a.abort(msg));
            }
        });
    }
}

/// Aborts the whole group ([`Aborts::abort_all`]) and returns the error.
#[cold]
fn fail(aborts: &Aborts, e: TpError<Error>) -> Error {
    let msg = flatten(&e);
    tracing::debug!(error = %msg, "TP group failed: aborting every communicator");
    aborts.abort_all(&msg);
    tracing::debug!("every communicator aborted");
    Error::Tp(msg)
}

/// A [`DecodeBackend`] over `tp` GPUs of this process.
pub struct CudaTpBackend {
    group: TpDecodeGroup<CudaTpWorker>,
    aborts: Aborts,
    capacity: Arc<AtomicUsize>,
    out: Arc<Mutex<Vec<f32>>>,
    seq: Option<SequenceId>,
    next_seq: u64,
    pos: usize,
    vocab: usize,
    label: String,
}

impl std::fmt::Debug for CudaTpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTpBackend").field("label", &self.label).field("seq", &self.seq).finish_non_exhaustive()
    }
}

/// The GPUs `first .. first + tp`, checked against the device count.
fn ordinals(first: usize, tp: usize) -> Result<Vec<usize>> {
    let n = ferrum_cuda::device_count().map_err(cuda_error)?;
    if first + tp > n {
        return Err(Error::Tp(format!("--tp {tp} from cuda:{first} needs {} GPUs, this machine has {n}", first + tp)));
    }
    Ok((first..first + tp).collect())
}

impl CudaTpBackend {
    /// Starts one rank thread per GPU in `ordinals`; rank `r` builds its runner with
    /// `make(r, ordinal)` on its own thread and gets a reducer over the group: NCCL, with the
    /// one-shot peer all-reduce for decode tokens (messages of `hidden` floats) as
    /// `opts.all_reduce` says; with `opts.vocab_split`, each rank's device-fed steps compute its
    /// share of the LM head (`CudaDecodeRunner::set_vocab_split`).
    pub fn new<F>(
        ordinals: &[usize],
        vocab: usize,
        hidden: usize,
        opts: TpOptions,
        label: String,
        make: F,
    ) -> Result<Self>
    where
        F: Fn(usize, usize) -> Result<CudaDecodeRunner> + Send + Sync + 'static,
    {
        let tp = ordinals.len();
        let ranks = NcclRank::init_all(ordinals).map_err(nccl_error)?;
        let peers = peer_ranks(opts.all_reduce, ordinals, hidden)?;
        let aborts = Aborts {
            nccl: ranks.iter().map(NcclRank::abort_handle).collect(),
            peer: peers.iter().flatten().map(PeerRank::handle).collect(),
        };
        let label = if peers.is_some() { format!("{label} peer-allreduce") } else { label };
        // Each rank thread takes its communicator and peer rank out of its slot.
        type Slot = Mutex<Option<(NcclRank, Option<PeerRank>)>>;
        let slots: Arc<Vec<Slot>> = Arc::new(match peers {
            Some(p) => ranks.into_iter().zip(p).map(|(r, p)| Mutex::new(Some((r, Some(p))))).collect(),
            None => ranks.into_iter().map(|r| Mutex::new(Some((r, None)))).collect(),
        });
        let capacity = Arc::new(AtomicUsize::new(0));
        let out = Arc::new(Mutex::new(Vec::with_capacity(vocab)));
        let (cap, o, ords) = (capacity.clone(), out.clone(), ordinals.to_vec());
        let group = TpDecodeGroup::new(TpConfig::new(tp), move |ctx: &RankContext| {
            let r = ctx.rank();
            let (nccl, peer) = slots[r].lock().take().ok_or_else(|| Error::Tp("a rank was built twice".into()))?;
            let nccl = Arc::new(nccl);
            let mut runner = make(r, ords[r])?;
            warm_up(&runner, &nccl)?;
            let reducer = Box::new(NcclReducer::new(nccl.clone()));
            let peer_handle = peer.as_ref().map(PeerRank::handle);
            match peer {
                Some(p) => runner.set_reducer(Box::new(PeerReducer::new(p, reducer))),
                None => runner.set_reducer(reducer),
            }
            if opts.vocab_split {
                runner.set_vocab_split(r, tp).map_err(cuda_error)?;
            }
            if let Some(f) = opts.fusion {
                runner.set_fusion(f);
            }
            let mut rank = CudaRank::new(runner, r);
            match peer_handle {
                // Decode graphs then hold peer kernels only (NCCL sums prefill chunks, eagerly).
                Some(h) => rank.set_peer(h),
                None => rank.set_comm(nccl.clone()),
            }
            Ok(CudaTpWorker { rank, nccl, capacity: cap.clone(), out: o.clone() })
        })
        .map_err(|e| fail(&aborts, e))?;
        Ok(Self { group, aborts, capacity, out, seq: None, next_seq: 1, pos: 0, vocab, label })
    }

    /// Replay captured graphs (default) or enqueue every kernel, on every rank.
    pub fn set_graphed(&mut self, graphed: bool) -> Result<()> {
        self.on_ranks(move |w, _| {
            w.rank.set_graphed(graphed);
            Ok(())
        })
        .map(|_| ())
    }

    /// The screened LM head of greedy device-fed steps on every rank
    /// (`CudaDecodeRunner::set_screened_head`; with the vocab split, each rank screens its
    /// share); whether every rank's greedy steps now screen it.
    pub fn set_screened_head(&mut self, on: bool) -> Result<bool> {
        let on = self.on_ranks(move |w, _| w.rank.runner().set_screened_head(on).map_err(cuda_error))?;
        Ok(on.iter().all(|&b| b))
    }

    /// Device-fed steps per captured graph on every rank (see
    /// `CudaDecodeRunner::set_steps_per_graph`; default `FERRUM_GRAPH_STEPS` or 1),
    /// 1..=`ferrum_cuda::plan::MAX_GRAPH_STEPS`. A value out of range is refused here, before
    /// any rank sees it (`InvalidInput`; a rank's error would fail the whole group).
    pub fn set_steps_per_graph(&mut self, steps: usize) -> Result<()> {
        let steps = ferrum_cuda::plan::check_graph_steps(steps).map_err(cuda_error)?;
        self.on_ranks(move |w, _| w.rank.runner().set_steps_per_graph(steps).map_err(cuda_error)).map(|_| ())
    }

    /// Arms a failure for tests on `fault.rank`.
    pub fn set_fault(&mut self, fault: Fault) -> Result<()> {
        self.on_ranks(move |w, _| {
            let handle = w.nccl.abort_handle();
            let peer = w.rank.peer().cloned();
            let abort = move || {
                handle.abort("injected failure");
                if let Some(p) = &peer {
                    p.abort();
                }
            };
            w.rank.set_fault(Some(fault), Some(Box::new(abort)));
            Ok(())
        })
        .map(|_| ())
    }

    /// The GPU ordinal of each rank.
    pub fn device_ordinals(&mut self) -> Result<Vec<usize>> {
        self.on_ranks(|w, _| Ok(w.rank.runner().context().ordinal()))
    }

    fn on_ranks<R, F>(&mut self, f: F) -> Result<Vec<R>>
    where
        R: Send + 'static,
        F: Fn(&mut CudaTpWorker, &RankContext) -> Result<R> + Send + Sync + 'static,
    {
        let aborts = &self.aborts;
        self.group.run_on_ranks(f).map_err(|e| fail(aborts, e))
    }
}

impl DecodeBackend for CudaTpBackend {
    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        if let Some(old) = self.seq.take() {
            self.group.kv_release(old).map_err(|e| fail(&self.aborts, e))?;
        }
        let seq = SequenceId(self.next_seq);
        self.next_seq += 1;
        // Relaxed: the kv_init command that reads it is sent through a channel after this store.
        self.capacity.store(capacity, Ordering::Relaxed);
        self.group.kv_init(seq).map_err(|e| fail(&self.aborts, e))?;
        self.seq = Some(seq);
        let toks: Arc<[u32]> = tokens.into();
        self.on_ranks(move |w, ctx| w.prefill(ctx, seq, &toks))?;
        self.pos = tokens.len();
        Ok(self.out.lock().clone())
    }

    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let seq = self.seq.ok_or_else(|| Error::InvalidInput("step before prefill".into()))?;
        self.group.decode_step(token, self.pos, seq).map_err(|e| fail(&self.aborts, e))?;
        self.pos += 1;
        Ok(self.out.lock().clone())
    }

    fn describe(&self) -> String {
        self.label.clone()
    }

    fn arm_timeline(&mut self, steps: usize) -> Result<bool> {
        let armed = self.on_ranks(move |w, _| Ok(w.rank.graphed() && w.rank.arm_timeline(steps)))?;
        Ok(armed.iter().all(|&a| a))
    }

    fn take_timelines(&mut self) -> Result<Vec<ferrum_cuda::timeline::StepTimeline>> {
        let t = self.on_ranks(|w, _| Ok(w.rank.take_timeline()))?;
        Ok(t.into_iter().flatten().collect())
    }

    fn has_device_decode(&self) -> bool {
        true
    }

    fn set_screened_head(&mut self, on: bool) -> Result<bool> {
        CudaTpBackend::set_screened_head(self, on)
    }

    fn decode_on_device(
        &mut self,
        token: u32,
        max_steps: usize,
        sampling: DeviceSampling,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<DeviceRun> {
        let seq = self.seq.ok_or_else(|| Error::InvalidInput("decode before prefill".into()))?;
        let pos0 = self.pos;
        // Relaxed: only this thread writes it (before the kv_init of the current sequence).
        let capacity = self.capacity.load(Ordering::Relaxed);
        if pos0 + max_steps > capacity {
            return Err(Error::ContextOverflow { position: pos0 + max_steps, capacity });
        }
        let before = self.on_ranks(|w, _| Ok((w.rank.stats(), w.rank.graphed())))?[0];
        self.on_ranks(move |w, _| w.rank.device_begin(seq.0, token, pos0))?;
        let (kept, run) = drive_device_batches(max_steps, on_token, &mut |done, n| {
            let first = pos0 + 1 + done;
            let tokens = self.on_ranks(move |w, _| w.rank.device_steps(seq.0, first, n, sampling))?;
            // Every rank saw the same sums, so every rank must have chosen the same tokens.
            if let Some(r) = tokens.iter().position(|t| *t != tokens[0]) {
                return Err(Error::Tp(format!(
                    "rank {r} chose other tokens than rank 0 ({:?} vs {:?})",
                    tokens[r], tokens[0]
                )));
            }
            Ok(tokens.into_iter().next().unwrap_or_default())
        })?;
        self.on_ranks(move |w, _| w.rank.device_end(seq.0, pos0 + kept))?;
        self.pos = pos0 + kept;
        let after = self.on_ranks(|w, _| Ok(w.rank.stats()))?[0];
        Ok(device_run(before.0, after, kept, run, before.1))
    }
}

impl Drop for CudaTpBackend {
    fn drop(&mut self) {
        if self.group.is_poisoned() {
            // Already aborted by `fail`; again in case the poison came another way.
            self.aborts.abort_all("the TP group was dropped after a failure");
        }
        // The group's own Drop shuts the ranks down (or joins them, when poisoned).
    }
}

/// The shard ranges of `cfg` over `tp` ranks (the CPU sharding pass's plan).
pub fn shard_ranges(cfg: &ModelConfig, tp: usize) -> Result<Vec<ShardRange>> {
    Ok(crate::shard::plan(cfg, tp, 1)?.into_iter().map(|s| ShardRange { kv_heads: s.kv, ffn: s.ffn }).collect())
}

/// Weight bytes a decode step reads on the busiest rank of a `tp`-way split of `cfg`.
pub fn shard_bytes_per_token(cfg: &ModelConfig, tp: usize) -> Result<u64> {
    let full = spec_of(cfg);
    let mut worst = 0u64;
    for r in shard_ranges(cfg, tp)? {
        let s = full.shard(&r).map_err(cuda_error)?;
        let (h, i, v) = (s.hidden as u64, s.intermediate as u64, s.vocab as u64);
        let layer = h * s.qkv_dim() as u64 + s.q_dim() as u64 * h + 3 * h * i + 2 * h;
        worst = worst.max(2 * (s.layers as u64 * layer + v * h + 2 * h));
    }
    Ok(worst)
}

fn group_label(ordinals: &[usize], dtype: ferrum_cuda::DType) -> String {
    let gpus: Vec<String> = ordinals.iter().map(|o| o.to_string()).collect();
    format!("cuda:{} {} tp{}", gpus.join("+"), dtype.name(), ordinals.len())
}

/// `tp` GPUs from `first`, each with its shard of `weights`.
pub fn open_group(
    weights: &ModelWeights,
    first: usize,
    tp: usize,
    dtype: ferrum_cuda::DType,
    progress: bool,
) -> Result<Box<dyn DecodeBackend>> {
    Ok(Box::new(group(weights, first, tp, dtype, progress)?))
}

/// [`open_group`]'s backend itself (for its graph switch and fault injection).
pub fn group(
    weights: &ModelWeights,
    first: usize,
    tp: usize,
    dtype: ferrum_cuda::DType,
    progress: bool,
) -> Result<CudaTpBackend> {
    let ords = ordinals(first, tp)?;
    let (shards, plan) = crate::shard::shard(weights, tp)?;
    if progress {
        eprintln!("tensor parallel over {tp} GPUs: {}", crate::shard::describe(&plan));
    }
    let shards: Arc<Vec<Mutex<Option<ModelWeights>>>> =
        Arc::new(shards.into_iter().map(|s| Mutex::new(Some(s))).collect());
    let label = group_label(&ords, dtype);
    let (vocab, hidden) = (weights.config.vocab_size, weights.config.hidden_size);
    CudaTpBackend::new(&ords, vocab, hidden, TpOptions::from_env()?, label, move |r, ordinal| {
        let w = shards[r].lock().take().ok_or_else(|| Error::Tp("a rank was built twice".into()))?;
        build_runner(&w, dtype, ordinal, &mut |_, _| {})
    })
}

/// `tp` GPUs from `first`, each with its shard of the random model of shape `cfg` (the same
/// model as the one-GPU synthetic runner: shards are slices of it).
pub fn open_group_synthetic(
    cfg: &ModelConfig,
    first: usize,
    tp: usize,
    dtype: ferrum_cuda::DType,
) -> Result<Box<dyn DecodeBackend>> {
    Ok(Box::new(synthetic_group_with(cfg, first, tp, dtype, 0x5eed, AllReduce::from_env()?)?))
}

/// The synthetic TP group itself (tests reach its fault injection through it).
pub fn synthetic_group(
    cfg: &ModelConfig,
    first: usize,
    tp: usize,
    dtype: ferrum_cuda::DType,
    seed: u64,
) -> Result<CudaTpBackend> {
    synthetic_group_with(cfg, first, tp, dtype, seed, AllReduce::Auto)
}

/// [`synthetic_group`] with the all-reduce chosen.
pub fn synthetic_group_with(
    cfg: &ModelConfig,
    first: usize,
    tp: usize,
    dtype: ferrum_cuda::DType,
    seed: u64,
    all_reduce: AllReduce,
) -> Result<CudaTpBackend> {
    let opts = TpOptions { all_reduce, vocab_split: vocab_split_from_env()?, fusion: None };
    synthetic_group_opts(cfg, first, tp, dtype, seed, opts)
}

/// [`synthetic_group`] with every group option chosen.
pub fn synthetic_group_opts(
    cfg: &ModelConfig,
    first: usize,
    tp: usize,
    dtype: ferrum_cuda::DType,
    seed: u64,
    opts: TpOptions,
) -> Result<CudaTpBackend> {
    let ords = ordinals(first, tp)?;
    let ranges = shard_ranges(cfg, tp)?;
    let full = spec_of(cfg);
    let label = group_label(&ords, dtype);
    CudaTpBackend::new(&ords, cfg.vocab_size, cfg.hidden_size, opts, label, move |r, ordinal| {
        CudaDecodeRunner::random_shard(&full, &ranges[r], dtype, seed, ordinal).map_err(cuda_error)
    })
}

/// This process's rank of a multi-process group: its shard of `weights` on GPU
/// `(ordinal + rank) % device count` (so `--device cuda` puts rank r on GPU r of a shared
/// machine, and on GPU 0 of a machine with one GPU per rank, e.g. one process per node; NCCL
/// refuses two ranks on one GPU), joined to the others through `dist.rendezvous`.
///
/// A watchdog thread ([`crate::watchdog`]) aborts the rank's communicator when NCCL reports an
/// asynchronous error or a call makes no progress for `FERRUM_TP_STALL_TIMEOUT_S` (default
/// 120 s), from the warm-up all-reduce on: a rank whose peer process died then fails instead
/// of waiting forever. Before that, the rendezvous waits at most its own timeout (120 s); NCCL's
/// init with a peer that died during it is the one wait left to NCCL.
pub fn open_process_rank(
    weights: &ModelWeights,
    ordinal: usize,
    tp: usize,
    dist: &DistOptions,
    dtype: ferrum_cuda::DType,
    progress: bool,
) -> Result<Box<dyn DecodeBackend>> {
    if tp != dist.world_size {
        return Err(Error::InvalidInput(format!("--tp {tp} differs from --world-size {}", dist.world_size)));
    }
    if dist.rank >= dist.world_size {
        return Err(Error::InvalidInput(format!("--rank {} is not below --world-size {}", dist.rank, dist.world_size)));
    }
    let rendezvous = Rendezvous::parse(&dist.rendezvous).map_err(|e| Error::InvalidInput(e.to_string()))?;
    let n = ferrum_cuda::device_count().map_err(cuda_error)?;
    if n == 0 {
        return Err(Error::Unavailable("CUDA", "no GPU".into()));
    }
    let gpu = (ordinal + dist.rank) % n;
    let (shards, plan) = crate::shard::shard(weights, tp)?;
    if progress {
        eprintln!("rank {} of {} on cuda:{gpu}: {}", dist.rank, dist.world_size, crate::shard::describe(&plan));
    }
    let shard = shards.into_iter().nth(dist.rank).ok_or_else(|| Error::Tp("no shard for this rank".into()))?;
    let mut runner = build_runner(&shard, dtype, gpu, &mut |_, _| {})?;
    let opts = RendezvousOptions::default();
    let nccl = NcclRank::init_rank_rendezvous(runner.context(), dist.rank, dist.world_size, &rendezvous, &opts)
        .map_err(nccl_error)?;
    let nccl = Arc::new(nccl);
    // Watched from the first collective on (the warm-up all-reduce).
    let dog = crate::watchdog::Watchdog::start(nccl.clone(), crate::watchdog::stall_timeout_from_env()?)?;
    {
        let _busy = dog.busy();
        warm_up(&runner, &nccl)?;
    }
    runner.set_reducer(Box::new(NcclReducer::new(nccl.clone())));
    if vocab_split_from_env()? {
        runner.set_vocab_split(dist.rank, dist.world_size).map_err(cuda_error)?;
    }
    let label = format!("cuda:{gpu} {} rank {}/{}", dtype.name(), dist.rank, dist.world_size);
    let mut rank = CudaRank::new(runner, dist.rank);
    rank.set_comm(nccl);
    Ok(Box::new(crate::watchdog::Watched::new(CudaBackend::with_rank(rank, label), dog)))
}

#[cfg(test)]
mod tests {
    use super::{parse_vocab_split, AllReduce};

    /// `FERRUM_TP_VOCAB_SPLIT`: 0 and 1 (and unset: on) parse; anything else names the variable.
    #[test]
    fn vocab_split_knob() {
        assert!(parse_vocab_split(None).unwrap());
        assert!(parse_vocab_split(Some(" 1 ")).unwrap());
        assert!(!parse_vocab_split(Some("0")).unwrap());
        for bad in ["yes", "2", ""] {
            let e = parse_vocab_split(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_TP_VOCAB_SPLIT"), "{bad:?}: {e}");
        }
    }

    /// `FERRUM_ALLREDUCE`: the three modes (and unset) parse; anything else is an error that
    /// names the variable and the accepted values. One test, as it sets the process's
    /// environment.
    #[test]
    fn all_reduce_knob() {
        let var = "FERRUM_ALLREDUCE";
        std::env::remove_var(var);
        assert_eq!(AllReduce::from_env().unwrap(), AllReduce::Auto);
        for (v, want) in [("auto", AllReduce::Auto), ("nccl", AllReduce::Nccl), (" peer ", AllReduce::Peer)] {
            std::env::set_var(var, v);
            assert_eq!(AllReduce::from_env().unwrap(), want, "{v:?}");
        }
        for bad in ["", "NCCL", "p2p", "1"] {
            std::env::set_var(var, bad);
            let e = AllReduce::from_env().expect_err(bad).to_string();
            assert!(e.contains(var) && e.contains("auto, nccl or peer"), "{bad:?}: {e}");
        }
        std::env::remove_var(var);
    }
}
