//! Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded.
//!
//! The order of operations follows HF transformers' logits warpers: temperature, then top-k,
//! then top-p (nucleus), then a draw from the renormalised distribution. With the same seed
//! and the same logits the same token comes out, on every run and every platform.

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::error::{Error, Result};

/// Sampling settings, validated by [`SamplingParams::validate`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1.0 disables.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 299_792_458 }
    }
}

impl SamplingParams {
    /// Rejects values that have no meaning (negative or non-finite temperature, a temperature
    /// whose inverse overflows f32, top-p outside (0, 1]).
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        // A positive subnormal temperature (below f32::MIN_POSITIVE, ~1.2e-38) is refused: the
        // smallest of them have no finite inverse, which the GPU's Gumbel draw (it scales the
        // logits by 1 / T) refuses too.
        if !(t.is_finite() && (t == 0.0 || t >= f32::MIN_POSITIVE)) {
            return Err(Error::InvalidInput(format!(
                "--temperature must be 0 (greedy) or a finite number ≥ {:?} (its inverse must be finite), got {t:?}",
                f32::MIN_POSITIVE
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidInput(format!("--top-p must be in (0, 1], got {}", self.top_p)));
        }
        Ok(())
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// Index of the largest logit; the smallest index wins ties (as on the GPU). NaNs never win.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// A seeded sampler. Allocates its scratch once and reuses it.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    /// A sampler with validated parameters.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self { rng: StdRng::seed_from_u64(params.seed), params, scratch: Vec::new() })
    }

    /// The parameters this sampler was made with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (`[V]`).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(Error::InvalidInput("empty logits".into()));
        }
        if self.params.is_greedy() {
            return Ok(argmax(logits));
        }
        let p = self.params;
        let s = &mut self.scratch;
        s.clear();
        // The raw logits: dividing by the temperature first overflows to +inf for a small T (5 /
        // 1e-38), and inf - inf in the softmax is NaN. Dividing by T > 0 keeps the order, so
        // top-k and the sort see the same ranking either way.
        s.extend(logits.iter().enumerate().filter(|(_, v)| !v.is_nan()).map(|(i, &v)| (v, i as u32)));
        if s.is_empty() {
            return Err(Error::InvalidInput("all logits are NaN".into()));
        }
        // Highest first; ties by smaller id, so the order is total and deterministic.
        let by_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if p.top_k > 0 && p.top_k < s.len() {
            s.select_nth_unstable_by(p.top_k - 1, by_desc);
            s.truncate(p.top_k);
        }
        s.sort_unstable_by(by_desc);
        // An infinite largest logit: +inf takes all the mass (the first of several, as argmax
        // picks); -inf everywhere leaves none. Either way the first survivor, never NaN mass.
        let max = s[0].0;
        if !max.is_finite() {
            return Ok(s[0].1);
        }
        // Softmax over the survivors: (v - max) ≤ 0, so each term is in [0, 1] and the largest
        // is exactly 1 (an overflow to -inf only makes a term 0).
        let mut total = 0.0f64;
        for e in s.iter_mut() {
            e.0 = ((e.0 - max) / p.temperature).exp();
            total += e.0 as f64;
        }
        if !(total.is_finite() && total > 0.0) {
            return Ok(s[0].1);
        }
        // Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
        if p.top_p < 1.0 {
            let mut acc = 0.0f64;
            let mut keep = s.len();
            for (i, e) in s.iter().enumerate() {
                acc += e.0 as f64 / total;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            s.truncate(keep);
            total = s.iter().map(|e| e.0 as f64).sum();
        }
        let mut r = self.rng.random::<f64>() * total;
        for e in s.iter() {
            r -= e.0 as f64;
            if r <= 0.0 {
                return Ok(e.1);
            }
        }
        Ok(s[s.len() - 1].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature: t, top_k: k, top_p: p, seed }
    }

    #[test]
    fn greedy_is_argmax_with_smallest_index_on_ties() {
        let mut s = Sampler::new(params(0.0, 0, 1.0, 1)).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 0.5]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(0.8, 20, 0.9, seed)).unwrap();
            (0..50).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_restricts_support() {
        let logits = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(params(10.0, 2, 1.0, 3)).unwrap();
        for _ in 0..500 {
            assert!(s.sample(&logits).unwrap() < 2);
        }
    }

    #[test]
    fn top_p_restricts_support() {
        // softmax([10, 9, 0, 0]) puts ~0.73 / 0.27 on the first two: p = 0.5 keeps only the first.
        let logits = [10.0, 9.0, 0.0, 0.0];
        let mut s = Sampler::new(params(1.0, 0, 0.5, 3)).unwrap();
        for _ in 0..200 {
            assert_eq!(s.sample(&logits).unwrap(), 0);
        }
        let mut s = Sampler::new(params(1.0, 0, 0.99, 3)).unwrap();
        let seen: std::collections::HashSet<u32> = (0..500).map(|_| s.sample(&logits).unwrap()).collect();
        assert!(seen.contains(&1) && !seen.contains(&2) && !seen.contains(&3), "{seen:?}");
    }

    #[test]
    fn frequencies_follow_softmax() {
        // Two tokens with logit gap ln(3): expect a 3:1 split at temperature 1.
        let logits = [3f32.ln(), 0.0];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 11)).unwrap();
        let n = 20_000;
        let zeros = (0..n).filter(|_| s.sample(&logits).unwrap() == 0).count();
        let frac = zeros as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.015, "got {frac}");
    }

    #[test]
    fn tiny_temperatures_pick_the_largest_logit() {
        // f32::MIN_POSITIVE (~1.18e-38) is a normal f32 with a finite inverse, but 5 / it overflows to +inf: the
        // softmax must not subtract inf from inf (NaN mass, and the last survivor came out).
        for k in [0, 2] {
            for p in [1.0, 0.5] {
                let mut s = Sampler::new(params(f32::MIN_POSITIVE, k, p, 1)).unwrap();
                for _ in 0..50 {
                    assert_eq!(s.sample(&[1.0, 5.0, -3.0]).unwrap(), 1, "top-k {k}, top-p {p}");
                }
            }
        }
    }

    #[test]
    fn an_infinite_logit_wins() {
        let inf = f32::INFINITY;
        for (k, p) in [(0, 1.0), (2, 1.0), (0, 0.9), (2, 0.5), (5, 0.999)] {
            let mut s = Sampler::new(params(1.0, k, p, 1)).unwrap();
            for _ in 0..50 {
                assert_eq!(s.sample(&[0.0, inf, -1.0]).unwrap(), 1, "top-k {k}, top-p {p}");
                assert_eq!(s.sample(&[-inf, 2.0, inf, inf, f32::NAN]).unwrap(), 2, "top-k {k}, top-p {p}");
            }
        }
        // Only -inf (and NaN) left: no mass anywhere, still a token and no error.
        let mut s = Sampler::new(params(1.0, 0, 1.0, 1)).unwrap();
        assert_eq!(s.sample(&[f32::NAN, -inf, -inf]).unwrap(), 1);
    }

    #[test]
    fn a_temperature_with_no_finite_inverse_is_rejected() {
        // 1e-39 is subnormal: 1 / 1e-39 is +inf in f32 (the GPU's Gumbel draw refuses it too).
        let e = Sampler::new(params(1e-39, 0, 1.0, 1)).unwrap_err().to_string();
        assert!(e.contains("--temperature") && e.contains("1e-39"), "{e}");
        assert!(params(f32::MIN_POSITIVE, 0, 1.0, 1).validate().is_ok());
    }

    #[test]
    fn bad_params_are_rejected() {
        for p in [params(-1.0, 0, 1.0, 0), params(f32::NAN, 0, 1.0, 0), params(1.0, 0, 1.5, 0), params(1.0, 0, 0.0, 0)]
        {
            let e = Sampler::new(p).unwrap_err().to_string();
            assert!(e.contains("--temperature") || e.contains("--top-p"), "{e}");
        }
    }
}
