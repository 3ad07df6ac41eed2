//! The generation loop: prefill, then sample and step until a stop token or the token budget.

use std::time::{Duration, Instant};

use crate::backend::{DecodeBackend, DeviceRun, DeviceSampling};
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingParams};

/// What to generate and how.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// At most this many new tokens (≥ 1).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end the generation (not emitted).
    pub stop_ids: Vec<u32>,
    /// Keep every step's logits (`steps × vocab`) for `--dump-logits` (forces host steps).
    pub keep_logits: bool,
    /// Let backends that can (CUDA) choose tokens on the device, with no host round trip per
    /// token: greedy, or temperature-only sampling (a seeded Gumbel-max draw on the GPU);
    /// top-k / top-p always sample on the host.
    pub device_loop: bool,
}

/// The largest `1 / temperature` the device's Gumbel draw is given. It scales the logits by
/// `1 / T` before it adds the noise, so a larger factor could overflow logits to +inf, and the
/// tie among them would go to the smallest index rather than the largest logit; past it (T below
/// 1e-30, all but greedy) the host draws, whose softmax subtracts the maximum first.
pub const MAX_DEVICE_INV_TEMPERATURE: f32 = 1e30;

impl GenerateOptions {
    /// How the device can choose tokens for these settings, if it can (see
    /// [`device_loop`](Self::device_loop)).
    pub fn device_sampling(&self) -> Option<DeviceSampling> {
        let s = &self.sampling;
        if self.keep_logits || !self.device_loop {
            None
        } else if s.is_greedy() {
            Some(DeviceSampling::Greedy)
        } else if s.top_k == 0 && s.top_p >= 1.0 && 1.0 / s.temperature <= MAX_DEVICE_INV_TEMPERATURE {
            Some(DeviceSampling::Temperature { temperature: s.temperature, seed: s.seed })
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(temperature: f32, top_k: usize, keep_logits: bool, device_loop: bool) -> GenerateOptions {
        let sampling = SamplingParams { temperature, top_k, ..SamplingParams::default() };
        GenerateOptions { max_tokens: 8, sampling, stop_ids: vec![], keep_logits, device_loop }
    }

    #[test]
    fn greedy_and_temperature_only_run_on_the_device() {
        assert_eq!(opts(0.0, 0, false, true).device_sampling(), Some(DeviceSampling::Greedy));
        assert_eq!(opts(0.7, 1, false, true).device_sampling(), Some(DeviceSampling::Greedy));
        let seed = SamplingParams::default().seed;
        assert_eq!(
            opts(0.7, 0, false, true).device_sampling(),
            Some(DeviceSampling::Temperature { temperature: 0.7, seed })
        );
        assert_eq!(opts(0.7, 40, false, true).device_sampling(), None, "top-k samples on the host");
        let mut top_p = opts(0.7, 0, false, true);
        top_p.sampling.top_p = 0.9;
        assert_eq!(top_p.device_sampling(), None, "top-p samples on the host");
        assert_eq!(opts(0.0, 0, true, true).device_sampling(), None, "--dump-logits needs every step's logits");
        assert_eq!(opts(0.0, 0, false, false).device_sampling(), None, "--host-loop");
    }

    #[test]
    fn temperatures_whose_scaled_logits_could_overflow_draw_on_the_host() {
        let seed = SamplingParams::default().seed;
        assert_eq!(
            opts(1e-29, 0, false, true).device_sampling(),
            Some(DeviceSampling::Temperature { temperature: 1e-29, seed })
        );
        assert_eq!(opts(1e-31, 0, false, true).device_sampling(), None);
        assert_eq!(opts(f32::MIN_POSITIVE, 0, false, true).device_sampling(), None);
    }

    #[test]
    fn capacity_is_capped_by_the_context_without_overflow() {
        assert_eq!(required_capacity(5, 3, 100).unwrap(), 8);
        assert_eq!(required_capacity(5, 300, 100).unwrap(), 100);
        // `--max-tokens 18446744073709551615`: prompt + max_tokens overflows usize.
        assert_eq!(required_capacity(5, usize::MAX, 100).unwrap(), 100);
        assert!(matches!(required_capacity(100, 1, 100), Err(Error::InvalidInput(_))));
    }
}

/// What a generation did, for the stderr report and `ferrum bench`.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Tokens emitted (the stop token excluded).
    pub generated: Vec<u32>,
    pub prefill_time: Duration,
    /// Time spent in decode steps (each step consumes one generated token).
    pub decode_time: Duration,
    pub decode_steps: usize,
    /// Row-major `steps × vocab` logits: row 0 from the prefill, row i from decode step i.
    pub logits: Vec<f32>,
    pub stopped_on_eos: bool,
    /// Set when the tokens were chosen on the device (see [`GenerateOptions::device_loop`]).
    pub device: Option<DeviceRun>,
}

impl GenerationStats {
    /// Decode throughput in tokens per second (0 when no step ran).
    pub fn decode_tok_per_s(&self) -> f64 {
        if self.decode_steps == 0 || self.decode_time.is_zero() {
            0.0
        } else {
            self.decode_steps as f64 / self.decode_time.as_secs_f64()
        }
    }
}

/// The KV capacity a generation needs: the prompt plus every new token, within `context`.
pub fn required_capacity(prompt_len: usize, max_tokens: usize, context: usize) -> Result<usize> {
    if prompt_len == 0 {
        return Err(Error::InvalidInput("the prompt is empty".into()));
    }
    if prompt_len >= context {
        return Err(Error::InvalidInput(format!(
            "the prompt has {prompt_len} tokens, but the model's context holds {context}: shorten it"
        )));
    }
    // Saturating: `--max-tokens` may be anything up to usize::MAX, and the context caps it.
    Ok(prompt_len.saturating_add(max_tokens).min(context))
}

/// Runs one generation, calling `on_token` with each new token as soon as it is chosen.
/// Generation stops early, without error, when the context is full.
pub fn generate(
    backend: &mut dyn DecodeBackend,
    prompt: &[u32],
    context: usize,
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationStats> {
    if opts.max_tokens == 0 {
        return Err(Error::InvalidInput("--max-tokens must be at least 1".into()));
    }
    let capacity = required_capacity(prompt.len(), opts.max_tokens, context)?;
    let mut sampler = Sampler::new(opts.sampling)?;
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };

    let t0 = Instant::now();
    let mut logits = backend.prefill(prompt, capacity)?;
    stats.prefill_time = t0.elapsed();
    let mut pos = prompt.len();
    let t1 = Instant::now();
    if let (Some(sampling), true) = (opts.device_sampling(), backend.has_device_decode()) {
        let tok = sampler.sample(&logits)?;
        if opts.stop_ids.contains(&tok) {
            stats.stopped_on_eos = true;
            return Ok(stats);
        }
        stats.generated.push(tok);
        on_token(tok)?;
        // Fed positions pos .. pos + steps - 1 must fit the cache.
        let max_steps = (opts.max_tokens - 1).min(capacity - pos);
        let mut emit = |t: u32| -> Result<bool> {
            if opts.stop_ids.contains(&t) {
                stats.stopped_on_eos = true;
                return Ok(false);
            }
            stats.generated.push(t);
            on_token(t)?;
            Ok(stats.generated.len() < opts.max_tokens)
        };
        let run = backend.decode_on_device(tok, max_steps, sampling, &mut emit)?;
        stats.decode_steps = run.kept;
        stats.device = Some(run);
        stats.decode_time = t1.elapsed();
        return Ok(stats);
    }
    loop {
        if opts.keep_logits {
            stats.logits.extend_from_slice(&logits);
        }
        let tok = sampler.sample(&logits)?;
        if opts.stop_ids.contains(&tok) {
            stats.stopped_on_eos = true;
            break;
        }
        stats.generated.push(tok);
        on_token(tok)?;
        if stats.generated.len() >= opts.max_tokens || pos >= capacity {
            break;
        }
        logits = backend.step(tok)?;
        stats.decode_steps += 1;
        pos += 1;
    }
    stats.decode_time = t1.elapsed();
    Ok(stats)
}
