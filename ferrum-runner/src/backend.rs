//! The decode backends behind the CLI: one sequence, prefill then one token at a time.
//!
//! [`DecodeBackend`] is what the generation loop and `ferrum bench` drive; the CPU reference
//! ([`CpuBackend`]), CPU tensor parallelism and the CUDA runner each implement it.

use std::time::Duration;

pub use ferrum_cuda::DeviceSampling;

use crate::error::{Error, Result};
use crate::model::{CpuModel, KvCache};

/// What a device-fed decode run did (see [`DecodeBackend::decode_on_device`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceRun {
    /// Steps whose tokens were handed out (the last one included).
    pub kept: usize,
    /// Steps run (at most a batch more than kept).
    pub run: usize,
    /// Graphs captured during the run, and the time that took.
    pub captures: u64,
    pub capture_time: Duration,
    /// Host time spent queueing graph replays (from each call to its replay being queued).
    pub enqueue_time: Duration,
    /// Graph replays queued (0 when the steps ran eagerly; a replay may run several steps:
    /// `CudaDecodeRunner::steps_per_graph`).
    pub replays: u64,
}

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

    /// Feeds `token` like [`step`](Self::step), timing every kernel of the step: per kernel
    /// launch in order, its name and GPU µs (see ferrum-cuda's
    /// `CudaDecodeRunner::profile_decode_step`). `None` where there is nothing to profile (the
    /// CPU, TP groups); the token is then not fed.
    fn profile_step(&mut self, _token: u32) -> Result<Option<Vec<(&'static str, f64)>>> {
        Ok(None)
    }

    /// Runs [`prefill`](Self::prefill) timing every kernel (cuBLAS GEMMs as `cublas_gemm`), as
    /// [`profile_step`](Self::profile_step) does for a step. `None` where there is nothing to
    /// profile; the prompt is then not fed.
    fn profile_prefill(&mut self, _tokens: &[u32], _capacity: usize) -> Result<Option<Vec<(&'static str, f64)>>> {
        Ok(None)
    }

    /// Records the kernel timeline of the first `steps` graph replays of the next
    /// [`decode_on_device`](Self::decode_on_device) on every rank (ferrum-cuda's `timeline`:
    /// the timeline build of the kernels only). `false` where nothing can be recorded (the CPU,
    /// the eager loop, kernels without the stamps).
    fn arm_timeline(&mut self, _steps: usize) -> Result<bool> {
        Ok(false)
    }

    /// The timelines recorded since [`arm_timeline`](Self::arm_timeline), one per rank.
    fn take_timelines(&mut self) -> Result<Vec<ferrum_cuda::timeline::StepTimeline>> {
        Ok(Vec::new())
    }

    /// Whether [`decode_on_device`](Self::decode_on_device) works here (CUDA backends).
    fn has_device_decode(&self) -> bool {
        false
    }

    /// Turns the screened LM head of greedy device-fed steps on or off (ferrum-cuda's
    /// `CudaDecodeRunner::set_screened_head`: the same tokens, bit for bit, reading about half
    /// of the head's bytes; every rank of a TP group); `false` where there is none (the CPU,
    /// and then nothing changed).
    fn set_screened_head(&mut self, _on: bool) -> Result<bool> {
        Ok(false)
    }

    /// Runs the one-off work a backend defers until its decode step is set up (the CUDA
    /// backend's step-level GEMV tuning, ~1.8 s at SmolLM2-135M when nothing is cached), so
    /// that it is not charged to the first prefill. Call it after
    /// [`set_screened_head`](Self::set_screened_head); without the call the first prefill runs
    /// it. Nothing to do by default.
    fn prepare(&mut self) -> Result<()> {
        Ok(())
    }

    /// Device-fed decoding: feeds `token` (chosen, not yet fed) at the next position, and lets
    /// the device choose every next token (`sampling`) for up to `max_steps` steps, with no
    /// host round trip per token; `on_token` receives the chosen tokens in order and returns
    /// whether to go on. Steps run past the last kept one are discarded, so afterwards
    /// [`step`](Self::step) continues from the last token handed out.
    fn decode_on_device(
        &mut self,
        _token: u32,
        _max_steps: usize,
        _sampling: DeviceSampling,
        _on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<DeviceRun> {
        Err(Error::Unavailable("device-fed decoding", format!("not on {}", self.describe())))
    }
}

/// Steps the host asks for per read-back at first (so the first tokens show at once); the
/// batch then doubles up to [`MAX_DEVICE_BATCH`].
pub const FIRST_DEVICE_BATCH: usize = 2;
/// Most steps between two read-backs (so at most this many run past a stop).
pub const MAX_DEVICE_BATCH: usize = 32;

/// The host side of device-fed decoding, for any backend: asks `run_batch(done, n)` for the
/// tokens of steps `done .. done + n` in growing batches, up to `max_steps` steps, handing each
/// token to `on_token` until it returns `false`. Returns `(steps kept, steps run)`: kept steps
/// are those whose tokens `on_token` saw (the last one included).
pub fn drive_device_batches(
    max_steps: usize,
    on_token: &mut dyn FnMut(u32) -> Result<bool>,
    run_batch: &mut dyn FnMut(usize, usize) -> Result<Vec<u32>>,
) -> Result<(usize, usize)> {
    let (mut done, mut kept, mut batch) = (0, 0, FIRST_DEVICE_BATCH);
    while done < max_steps {
        let n = batch.min(max_steps - done);
        let tokens = run_batch(done, n)?;
        if tokens.len() != n {
            return Err(Error::Unavailable("device-fed decoding", format!("{} tokens for {n} steps", tokens.len())));
        }
        done += n;
        for t in tokens {
            kept += 1;
            if !on_token(t)? {
                return Ok((kept, done));
            }
        }
        batch = (batch * 2).min(MAX_DEVICE_BATCH);
    }
    Ok((kept, done))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_batches_grow_and_stop_early() {
        let mut asked = Vec::new();
        let mut seen = Vec::new();
        let (kept, run) = drive_device_batches(
            100,
            &mut |t| {
                seen.push(t);
                Ok(t != 9)
            },
            &mut |done, n| {
                asked.push((done, n));
                Ok((done..done + n).map(|i| i as u32).collect())
            },
        )
        .unwrap();
        assert_eq!(seen, (0..=9).collect::<Vec<_>>());
        assert_eq!((kept, run), (10, 14));
        assert_eq!(asked, vec![(0, 2), (2, 4), (6, 8)]);
    }

    #[test]
    fn device_batches_respect_max_steps_and_check_counts() {
        let mut asked = Vec::new();
        let (kept, run) = drive_device_batches(5, &mut |_| Ok(true), &mut |d, n| {
            asked.push((d, n));
            Ok(vec![0; n])
        })
        .unwrap();
        assert_eq!((kept, run), (5, 5));
        assert_eq!(asked, vec![(0, 2), (2, 3)]);
        assert!(drive_device_batches(5, &mut |_| Ok(true), &mut |_, _| Ok(vec![1])).is_err());
        let none = drive_device_batches(0, &mut |_| Ok(true), &mut |_, _| Err(Error::InvalidInput("called".into())));
        assert_eq!(none.unwrap(), (0, 0));
    }

    #[test]
    fn device_batches_cap_at_the_maximum() {
        let mut sizes = Vec::new();
        drive_device_batches(300, &mut |_| Ok(true), &mut |_, n| {
            sizes.push(n);
            Ok(vec![0; n])
        })
        .unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 300);
        assert!(sizes.iter().all(|&n| n <= MAX_DEVICE_BATCH));
        assert_eq!(&sizes[..5], &[2, 4, 8, 16, 32]);
    }
}
