//! The decode backends behind the CLI: one sequence, prefill then one token at a time.
//!
//! [`DecodeBackend`] is what the generation loop and `ferrum bench` drive; the CPU reference
//! ([`CpuBackend`]), CPU tensor parallelism and the CUDA runner each implement it.

use crate::error::{Error, Result};
use crate::model::{CpuModel, KvCache};

/// A model that decodes one sequence.
pub trait DecodeBackend {
    /// Vocabulary size (length of every logits vector).
    fn vocab_size(&self) -> usize;
    /// Starts a new sequence with room for `capacity` tokens and runs the prompt through it;
    /// returns the last position's logits.
    fn prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Vec<f32>>;
    /// Runs one token at the next position; returns its logits.
    fn step(&mut self, token: u32) -> Result<Vec<f32>>;
    /// A one-line description for logs (`cpu f32`, `cuda:0 bf16`, …).
    fn describe(&self) -> String;
}

/// The single-threaded-per-op CPU reference path (candle uses its own worker threads inside matmuls).
#[derive(Debug)]
pub struct CpuBackend {
    model: CpuModel,
    cache: Option<KvCache>,
    label: String,
}

impl CpuBackend {
    /// Wraps a CPU model; `label` names its dtype for logs.
    pub fn new(model: CpuModel, label: impl Into<String>) -> Self {
        Self { model, cache: None, label: label.into() }
    }
}

impl DecodeBackend for CpuBackend {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        // Reuse the cache's buffers when the capacity matches.
        let mut cache = match self.cache.take() {
            Some(c) if c.capacity() == capacity => c,
            _ => self.model.new_cache(capacity)?,
        };
        cache.clear();
        let out = self.model.prefill(&mut cache, tokens);
        self.cache = Some(cache);
        out
    }

    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let cache = self.cache.as_mut().ok_or_else(|| Error::InvalidInput("step before prefill".into()))?;
        self.model.decode_step(cache, token)
    }

    fn describe(&self) -> String {
        format!("cpu {}", self.label)
    }
}
