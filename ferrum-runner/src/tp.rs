//! Tensor parallelism over CPU ranks: one persistent `tp-rank-{r}` thread per shard, driven by
//! ferrum-tp's [`TpDecodeGroup`], with the two per-layer reductions done by its in-process
//! all-reduce over shared buffers.
//!
//! The sharding itself is [`crate::shard`]; each rank runs the ordinary [`CpuModel`] on its
//! shard with a [`Reducer`] that sums over the group. Every rank computes the (replicated)
//! LM head; rank 0 publishes the logits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ferrum_tp::{RankContext, RankWorker, SequenceId, StepInput, TpConfig, TpDecodeGroup, TpError};
use parking_lot::Mutex;

use crate::backend::DecodeBackend;
use crate::error::{Error, Result};
use crate::model::{CpuModel, KvCache, Reducer};
use crate::weights::ModelWeights;

/// Floats per all-reduce call; longer (prefill) tensors are reduced in chunks of this size.
const ALL_REDUCE_CHUNK: usize = 1 << 16;

/// Sums a rank's partial results over the group, in chunks, identically on every rank.
struct GroupReducer<'a> {
    ctx: &'a RankContext,
}

impl Reducer for GroupReducer<'_> {
    fn all_reduce(&mut self, partial: Tensor) -> Result<Tensor> {
        let (shape, dtype) = (partial.shape().clone(), partial.dtype());
        let mut v = partial.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for chunk in v.chunks_mut(ALL_REDUCE_CHUNK) {
            self.ctx
                .all_reduce_sum(chunk)
                .map_err(|e| Error::Tp(format!("rank {}: all-reduce: {e}", self.ctx.rank())))?;
        }
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?)
    }
}

/// One CPU rank: its shard and its sequences' KV caches.
struct CpuRank {
    model: CpuModel,
    caches: HashMap<SequenceId, KvCache>,
    /// Capacity for the next `kv_init`, set by the driver before the command.
    capacity: Arc<AtomicUsize>,
    /// Rank 0's logits of the last step.
    out: Arc<Mutex<Vec<f32>>>,
}

impl CpuRank {
    fn run(&mut self, ctx: &RankContext, seq: SequenceId, tokens: &[u32]) -> Result<()> {
        let cache = self.caches.get_mut(&seq).ok_or(Error::UnknownSequence(seq.0))?;
        let logits = self.model.forward_with(cache, tokens, &mut GroupReducer { ctx })?;
        if ctx.rank() == 0 {
            let mut out = self.out.lock();
            out.clear();
            out.extend_from_slice(&logits);
        }
        Ok(())
    }
}

impl RankWorker for CpuRank {
    type Error = Error;

    fn decode_step(&mut self, ctx: &RankContext, step: StepInput) -> Result<()> {
        let pos = self.caches.get(&step.sequence).map(KvCache::len).ok_or(Error::UnknownSequence(step.sequence.0))?;
        if pos != step.position {
            return Err(Error::InvalidInput(format!(
                "step at position {} but {} holds {pos} tokens",
                step.position, step.sequence
            )));
        }
        self.run(ctx, step.sequence, &[step.token])
    }

    fn kv_init(&mut self, _: &RankContext, sequence: SequenceId) -> Result<()> {
        // Acquire is not needed: the group's command channel orders this read after the store.
        let cap = self.capacity.load(Ordering::Relaxed);
        let cache = self.model.new_cache(cap)?;
        self.caches.insert(sequence, cache);
        Ok(())
    }

    fn kv_release(&mut self, _: &RankContext, sequence: SequenceId) -> Result<()> {
        self.caches.remove(&sequence).map(|_| ()).ok_or(Error::UnknownSequence(sequence.0))
    }
}

/// A [`DecodeBackend`] over `tp` CPU ranks.
pub struct CpuTpBackend {
    group: TpDecodeGroup<CpuRank>,
    capacity: Arc<AtomicUsize>,
    out: Arc<Mutex<Vec<f32>>>,
    seq: Option<SequenceId>,
    next_seq: u64,
    pos: usize,
    tp: usize,
    vocab: usize,
}

impl std::fmt::Debug for CpuTpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTpBackend").field("tp", &self.tp).field("seq", &self.seq).finish_non_exhaustive()
    }
}

/// Flattens a group error and its causes (the rank's own error) into one message.
fn tp_err(e: TpError<Error>) -> Error {
    Error::Tp(flatten(&e))
}

/// A group error and its causes (the rank's own error) as one message.
pub(crate) fn flatten(e: &TpError<Error>) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

impl CpuTpBackend {
    /// Shards `weights` over `tp` ranks and starts the rank threads. With `progress`, prints
    /// how the heads and MLP landed on each rank.
    pub fn new(weights: &ModelWeights, tp: usize, progress: bool) -> Result<Self> {
        let (shards, plan) = crate::shard::shard(weights, tp)?;
        if progress {
            eprintln!("tensor parallel over {tp} CPU ranks: {}", crate::shard::describe(&plan));
        }
        let shards: Arc<Vec<Mutex<Option<ModelWeights>>>> =
            Arc::new(shards.into_iter().map(|s| Mutex::new(Some(s))).collect());
        let capacity = Arc::new(AtomicUsize::new(0));
        let out = Arc::new(Mutex::new(Vec::with_capacity(weights.config.vocab_size)));
        let (cap, o) = (capacity.clone(), out.clone());
        let cfg = TpConfig::new(tp).all_reduce_max_len(ALL_REDUCE_CHUNK);
        let group = TpDecodeGroup::new(cfg, move |ctx: &RankContext| {
            let w = shards[ctx.rank()].lock().take().ok_or_else(|| Error::Tp("a rank was built twice".into()))?;
            Ok(CpuRank { model: CpuModel::new(&w)?, caches: HashMap::new(), capacity: cap.clone(), out: o.clone() })
        })
        .map_err(tp_err)?;
        Ok(Self { group, capacity, out, seq: None, next_seq: 1, pos: 0, tp, vocab: weights.config.vocab_size })
    }
}

impl DecodeBackend for CpuTpBackend {
    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        if let Some(old) = self.seq.take() {
            self.group.kv_release(old).map_err(tp_err)?;
        }
        let seq = SequenceId(self.next_seq);
        self.next_seq += 1;
        // Relaxed: the kv_init command that reads it is sent through a channel after this store.
        self.capacity.store(capacity, Ordering::Relaxed);
        self.group.kv_init(seq).map_err(tp_err)?;
        self.seq = Some(seq);
        let toks: Arc<[u32]> = tokens.into();
        self.group.run_on_ranks(move |w: &mut CpuRank, ctx| w.run(ctx, seq, &toks)).map_err(tp_err)?;
        self.pos = tokens.len();
        Ok(self.out.lock().clone())
    }

    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let seq = self.seq.ok_or_else(|| Error::InvalidInput("step before prefill".into()))?;
        self.group.decode_step(token, self.pos, seq).map_err(tp_err)?;
        self.pos += 1;
        Ok(self.out.lock().clone())
    }

    fn describe(&self) -> String {
        format!("cpu tp{}", self.tp)
    }
}

/// A backend that runs `tp` CPU ranks, each on its shard of `weights`.
pub fn cpu_tp_backend(weights: &ModelWeights, tp: usize, progress: bool) -> Result<Box<dyn DecodeBackend>> {
    Ok(Box::new(CpuTpBackend::new(weights, tp, progress)?))
}
