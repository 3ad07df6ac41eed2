//! The exact greedy token through a screened LM head.
//!
//! Greedy decoding needs only the argmax of the logits `W x`, not the logits. A low-precision
//! copy of the head (`bits` = 8 or 4 a weight, a scale a row) gives every row's logit to within
//! a bound that is known exactly, so the rows whose upper bound falls below the largest lower
//! bound cannot hold the argmax; only the others (the candidates) need their exact logits. The
//! token is the same as the full head's, bit for bit, whenever the exact logits of the
//! candidates are computed by the same arithmetic as the full head's: the bound covers the
//! distance from the screening logit to *any* f32 evaluation of the row's dot product.
//!
//! This module is the CPU reference of the method; a GPU head that reads the copy instead of
//! the bf16 rows would read a half (8 bits) or a quarter (4 bits) of the head's bytes a token.
//! Measured on SmolLM2-135M's head (49152 × 576; `tests/fixture.rs`, 96 greedy steps of the HF
//! fixture's prompts) at 8 bits: 2 candidates at the median, 34 at most; on the random weights
//! that `ferrum bench --synthetic smollm2-135m` decodes (`tests/screen.rs`): 2 and 4. At 4 bits
//! the bound is too loose: every row stays a candidate on both heads.
//!
//! The full head's argmax row is always among the candidates, whatever summation order that
//! head uses (the bound covers them all). For the screened token to equal that head's token bit
//! for bit, the candidates' exact logits must come from the same arithmetic as that head's;
//! otherwise two candidates whose logits differ by less than f32 rounding may be ordered
//! differently, as they may between any two orders of one dot product.
//!
//! ```
//! use ferrum_runner::sampling::argmax;
//! use ferrum_runner::screen::{argmax_among, ScreenedHead};
//!
//! let (rows, cols) = (1000, 64);
//! let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 1e-4).collect();
//! let x: Vec<f32> = (0..cols).map(|j| (j as f32 * 0.37).sin()).collect();
//! let logit = |i: u32| w[i as usize * cols..][..cols].iter().zip(&x).map(|(a, b)| a * b).sum::<f32>();
//!
//! let head = ScreenedHead::new(&w, rows, cols, 8)?; // once, at load
//! let candidates = head.candidates(&x)?.expect("a finite input");
//! let token = argmax_among(&candidates, logit).unwrap(); // exact logits of the candidates only
//! let full: Vec<f32> = (0..rows as u32).map(logit).collect();
//! assert_eq!(token, argmax(&full));
//! assert!(candidates.len() < rows / 10);
//! # Ok::<(), ferrum_runner::error::Error>(())
//! ```
//!
//! ## The bound
//! Row `i` of `W` (`K` columns) is stored as `q_ij` in `[-Q, Q]` (`Q` = 127 or 7) with scale
//! `s_i = max_j |w_ij| / Q`, `q_ij = round(w_ij / s_i)`; `e_i = max_j |w_ij − s_i q_ij|` is
//! computed exactly (in f64, from the f32 values). With `u = 2⁻²⁴`, `γ = K u / (1 − K u)` and
//! `‖x‖₁ = Σ |x_j|`:
//! - the exact dot `d_i = Σ w_ij x_j` and `s_i Σ q_ij x_j` differ by at most `e_i ‖x‖₁`;
//! - the screening logit `ŝ_i = fl(s_i · fl(Σ q_ij x_j))` (f32, any summation order) differs
//!   from `s_i Σ q_ij x_j` by at most `γ Q s_i ‖x‖₁ + u |ŝ_i|` (the standard dot-product bound
//!   `|fl(Σ a b) − Σ a b| ≤ γ Σ |a b|`, which holds for every order and with or without FMA,
//!   and one rounding of the scale product);
//! - any f32 evaluation `ℓ_i` of the full row's dot product differs from `d_i` by at most
//!   `γ max_j |w_ij| ‖x‖₁`.
//!
//! Those are the relative rounding model's bounds, which hold while no result is subnormal.
//! An operation whose result underflows errs by at most 2⁻¹⁵⁰ absolutely (sums of subnormals
//! are exact, and the screening products `q x` are exact there: an integer times a multiple of
//! 2⁻¹⁴⁹), so `(K + 2) 2⁻¹⁴⁹` more covers the full dot's K products and the scale product.
//! An evaluation that overflows has no bound: when `(1 + γ) max_j |w_ij| ‖x‖₁`, which caps every
//! partial sum of the row's dot product in any order, reaches `f32::MAX` for any row, there is
//! no screening (see below).
//!
//! So `|ℓ_i − ŝ_i| ≤ B_i`, the sum of the four, computed in f64 and enlarged by a factor
//! `1 + 10⁻⁶` that covers the f64 rounding of the bound itself and of `‖x‖₁`. If `i*` is the
//! full head's argmax, `ŝ_{i*} + B_{i*} ≥ ℓ_{i*} ≥ ℓ_k ≥ ŝ_k − B_k` for every `k`, so `i*` is among
//! the rows with `ŝ_i + B_i ≥ max_k (ŝ_k − B_k)`. Ties between candidates go to the smallest
//! index, as [`crate::sampling::argmax`] breaks them. A row with a non-finite weight is always
//! a candidate; an input with a non-finite value, or one whose logits could overflow, has no
//! bound ([`ScreenedHead::candidates`] returns `None`: compute the full head). The bound is
//! about f32 evaluations of the row's dot product with these f32 inputs: a head that rounds
//! its input first (to bf16, say) computes another function, outside it.
use crate::error::{Error, Result};

/// f32's unit roundoff.
const U: f64 = 1.0 / 16_777_216.0;
/// The factor that covers the f64 evaluation of the bound (a few hundred roundings of 2⁻⁵³).
const BOUND_SLACK: f64 = 1.0 + 1e-6;

/// A low-precision copy of an LM head `W` (`rows × cols`, row-major) for
/// [`candidates`](Self::candidates).
#[derive(Debug, Clone)]
pub struct ScreenedHead {
    rows: usize,
    cols: usize,
    bits: u32,
    /// `rows × cols`, each in `[-Q, Q]`.
    q: Vec<i8>,
    /// Per row: `s_i` (0 for a row of zeros or a row with a non-finite weight).
    scale: Vec<f32>,
    /// Per row: `e_i`, or +inf for a row with a non-finite weight (always a candidate).
    err: Vec<f64>,
    /// Per row: `max_j |w_ij|`.
    wmax: Vec<f64>,
    /// The largest `wmax` of a finite row (for the overflow test).
    wmax_all: f64,
}

impl ScreenedHead {
    /// Quantizes `w` (`rows × cols`, row-major f32) to `bits` (8 or 4) a weight with one scale a
    /// row, and records each row's largest rounding error.
    pub fn new(w: &[f32], rows: usize, cols: usize, bits: u32) -> Result<Self> {
        if bits != 8 && bits != 4 {
            return Err(Error::InvalidInput(format!("screened head: {bits} bits a weight (8 or 4)")));
        }
        let n = rows
            .checked_mul(cols)
            .filter(|&n| n > 0 && n == w.len())
            .ok_or_else(|| Error::InvalidInput(format!("screened head: {} weights for {rows} x {cols}", w.len())))?;
        if (cols as f64) * U >= 0.5 {
            return Err(Error::InvalidInput(format!("screened head: {cols} columns (the bound needs K u < 1/2)")));
        }
        let qmax = ((1i32 << (bits - 1)) - 1) as f32;
        let (mut q, mut scale, mut err, mut wmax) =
            (vec![0i8; n], Vec::with_capacity(rows), Vec::with_capacity(rows), Vec::with_capacity(rows));
        for (wr, qr) in w.chunks_exact(cols).zip(q.chunks_exact_mut(cols)) {
            if wr.iter().any(|v| !v.is_finite()) {
                scale.push(0.0);
                err.push(f64::INFINITY);
                wmax.push(f64::INFINITY);
                continue;
            }
            let m = wr.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let s = m / qmax;
            let mut e = 0.0f64;
            if s > 0.0 {
                for (qv, &wv) in qr.iter_mut().zip(wr) {
                    let k = (wv / s).round().clamp(-qmax, qmax);
                    *qv = k as i8;
                    e = e.max((wv as f64 - s as f64 * k as f64).abs());
                }
            } else {
                // All zeros, or a scale that underflowed: q = 0, and e is the row's largest weight.
                e = m as f64;
            }
            scale.push(s);
            err.push(e);
            wmax.push(m as f64);
        }
        let wmax_all = wmax.iter().copied().filter(|v: &f64| v.is_finite()).fold(0.0, f64::max);
        Ok(Self { rows, cols, bits, q, scale, err, wmax, wmax_all })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The bytes a device copy of the screening head would read a token: each row's packed
    /// weights (whole bytes) and two f32 values a row (the scale, and the bound's coefficient
    /// of `‖x‖₁`, rounded up).
    pub fn screen_bytes(&self) -> usize {
        self.rows * ((self.cols * self.bits as usize).div_ceil(8) + 8)
    }

    /// The rows that may hold the argmax of `W x` (ascending), or `None` when `x` holds a
    /// non-finite value or a logit could overflow (then there is no bound: compute the full
    /// head). Never empty otherwise.
    pub fn candidates(&self, x: &[f32]) -> Result<Option<Vec<u32>>> {
        let Some(sb) = self.bounds(x)? else { return Ok(None) };
        let floor = sb.iter().map(|&(s, b)| s - b).fold(f64::NEG_INFINITY, f64::max);
        Ok(Some(sb.iter().enumerate().filter(|&(_, &(s, b))| s + b >= floor).map(|(i, _)| i as u32).collect()))
    }

    /// Every row's screening logit `ŝ_i` and bound `B_i` (module documentation), or `None`
    /// when there is no bound.
    fn bounds(&self, x: &[f32]) -> Result<Option<Vec<(f64, f64)>>> {
        if x.len() != self.cols {
            return Err(Error::InvalidInput(format!("screened head: input of {} for {} columns", x.len(), self.cols)));
        }
        let l1: f64 = x.iter().map(|v| (*v as f64).abs()).sum();
        let k = self.cols as f64;
        let gamma = k * U / (1.0 - k * U);
        if !l1.is_finite() || (1.0 + gamma) * self.wmax_all * l1 * BOUND_SLACK >= f32::MAX as f64 {
            return Ok(None);
        }
        let qmax = ((1i32 << (self.bits - 1)) - 1) as f64;
        let tiny = (k + 2.0) * f64::from(f32::from_bits(1)); // (K + 2) 2⁻¹⁴⁹: underflows
        let mut sb = Vec::with_capacity(self.rows);
        for (i, qr) in self.q.chunks_exact(self.cols).enumerate() {
            if self.err[i].is_infinite() {
                sb.push((0.0, f64::INFINITY)); // a non-finite row: always a candidate
                continue;
            }
            let acc: f32 = qr.iter().zip(x).map(|(&qv, &xv)| qv as f32 * xv).sum();
            let s = self.scale[i] * acc;
            if !s.is_finite() {
                return Ok(None);
            }
            let b = (self.err[i] * l1
                + gamma * qmax * self.scale[i] as f64 * l1
                + U * (s as f64).abs()
                + gamma * self.wmax[i] * l1
                + tiny)
                * BOUND_SLACK;
            sb.push((s as f64, b));
        }
        Ok(Some(sb))
    }
}

/// The argmax of `logit(i)` over `rows` (ascending) by [`crate::sampling::argmax`]'s rule: the
/// largest value, the smallest index on ties, NaN never wins (the first row when every value
/// is NaN); `None` for no rows.
pub fn argmax_among(rows: &[u32], mut logit: impl FnMut(u32) -> f32) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for &i in rows {
        let v = logit(i);
        match best {
            None => best = Some((i, if v.is_nan() { f32::NEG_INFINITY } else { v })),
            Some((_, bv)) if v > bv => best = Some((i, v)),
            _ => {}
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::argmax;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Row i's dot product with x in f32, sequentially (one f32 evaluation among many).
    fn dot(w: &[f32], cols: usize, i: u32, x: &[f32]) -> f32 {
        w[i as usize * cols..][..cols].iter().zip(x).map(|(a, b)| a * b).sum()
    }

    /// The screened token against the full head's, for `trials` random heads and inputs.
    fn check(rows: usize, cols: usize, bits: u32, trials: u64, make: impl Fn(&mut StdRng, usize, usize) -> Vec<f32>) {
        for seed in 0..trials {
            let mut r = StdRng::seed_from_u64(seed);
            let w = make(&mut r, rows, cols);
            let x: Vec<f32> = (0..cols).map(|_| r.random_range(-3.0f32..3.0)).collect();
            let head = ScreenedHead::new(&w, rows, cols, bits).unwrap();
            let full: Vec<f32> = (0..rows as u32).map(|i| dot(&w, cols, i, &x)).collect();
            let c = head.candidates(&x).unwrap().expect("finite input");
            assert!(!c.is_empty() && c.windows(2).all(|p| p[0] < p[1]));
            assert_eq!(argmax_among(&c, |i| full[i as usize]), Some(argmax(&full)), "seed {seed}, {bits} bits");
        }
    }

    fn uniform(r: &mut StdRng, rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|_| r.random_range(-0.1f32..0.1)).collect()
    }

    #[test]
    fn the_screened_token_is_the_full_heads_token() {
        for bits in [8, 4] {
            check(300, 64, bits, 40, uniform);
        }
    }

    #[test]
    fn near_ties_and_exact_ties_keep_the_smallest_index() {
        // Rows that differ from a base row by one ulp-sized step in one weight, and exact
        // copies: the argmax is decided by the last bits or by the index.
        let near = |r: &mut StdRng, rows: usize, cols: usize| {
            let base: Vec<f32> = (0..cols).map(|_| r.random_range(-0.1f32..0.1)).collect();
            let mut w = Vec::with_capacity(rows * cols);
            for i in 0..rows {
                let mut row = base.clone();
                if i % 3 != 0 {
                    let j = r.random_range(0..cols);
                    row[j] = f32::from_bits(row[j].to_bits() ^ (i as u32 & 3));
                }
                w.extend(row);
            }
            w
        };
        for bits in [8, 4] {
            check(64, 48, bits, 40, near);
        }
    }

    #[test]
    fn candidates_shrink_with_more_bits() {
        let mut r = StdRng::seed_from_u64(7);
        let (rows, cols) = (4000, 256);
        let w = uniform(&mut r, rows, cols);
        let x: Vec<f32> = (0..cols).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let n = |bits| ScreenedHead::new(&w, rows, cols, bits).unwrap().candidates(&x).unwrap().unwrap().len();
        let (n8, n4) = (n(8), n(4));
        assert!(n8 <= n4, "{n8} candidates at 8 bits, {n4} at 4");
        assert!(n8 < rows / 10, "8 bits left {n8} of {rows} rows");
    }

    #[test]
    fn non_finite_rows_are_candidates_and_non_finite_inputs_have_no_bound() {
        let mut r = StdRng::seed_from_u64(3);
        let (rows, cols) = (50, 32);
        let mut w = uniform(&mut r, rows, cols);
        w[7 * cols + 5] = f32::INFINITY;
        w[9 * cols] = f32::NAN;
        for v in &mut w[11 * cols..12 * cols] {
            *v = 0.0; // a row of zeros
        }
        let head = ScreenedHead::new(&w, rows, cols, 8).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let c = head.candidates(&x).unwrap().unwrap();
        assert!(c.contains(&7) && c.contains(&9));
        let mut bad = x.clone();
        bad[3] = f32::NAN;
        assert!(head.candidates(&bad).unwrap().is_none());
        bad[3] = f32::INFINITY;
        assert!(head.candidates(&bad).unwrap().is_none());
    }

    #[test]
    fn bad_shapes_and_widths_are_errors() {
        let w = vec![0.5f32; 12];
        assert!(ScreenedHead::new(&w, 3, 4, 8).is_ok());
        assert!(ScreenedHead::new(&w, 3, 5, 8).is_err());
        assert!(ScreenedHead::new(&w, 0, 4, 8).is_err());
        assert!(ScreenedHead::new(&w, 3, 4, 6).is_err());
        assert!(ScreenedHead::new(&w, usize::MAX, 2, 8).is_err());
        let head = ScreenedHead::new(&w, 3, 4, 4).unwrap();
        assert!(head.candidates(&[1.0; 3]).is_err());
        assert_eq!(head.screen_bytes(), 3 * (2 + 8));
        assert_eq!(ScreenedHead::new(&w[..9], 3, 3, 4).unwrap().screen_bytes(), 3 * (2 + 8));
    }

    /// Four f32 evaluations of one dot product: forward, backward, forward with FMA, pairwise.
    fn orders(w: &[f32], x: &[f32]) -> [f32; 4] {
        fn pairwise(p: &[f32]) -> f32 {
            if p.len() == 1 {
                return p[0];
            }
            let (a, b) = p.split_at(p.len() / 2);
            pairwise(a) + pairwise(b)
        }
        let prods: Vec<f32> = w.iter().zip(x).map(|(a, b)| a * b).collect();
        [
            prods.iter().fold(0.0f32, |s, p| s + p),
            prods.iter().rev().fold(0.0f32, |s, p| s + p),
            w.iter().zip(x).fold(0.0f32, |s, (a, b)| a.mul_add(*b, s)),
            pairwise(&prods),
        ]
    }

    #[test]
    fn the_bound_holds_where_only_the_rounding_terms_decide() {
        // An exact copy (w = s q, so e = 0) and an input whose small entries sit at the f32
        // rounding scale of the large one: only the γ and u terms cover the distance.
        let cols = 128;
        let s0 = 1.5f32 / 128.0;
        let w: Vec<f32> = (0..cols).map(|j| s0 * if j == 0 { 127.0 } else { 1.0 }).collect();
        let x: Vec<f32> = (0..cols).map(|j| if j == 0 { 1.0 / 127.0 } else { 0.9 * 2f32.powi(-24) }).collect();
        let head = ScreenedHead::new(&w, 1, cols, 8).unwrap();
        assert_eq!(head.err[0], 0.0);
        let (sh, b) = head.bounds(&x).unwrap().unwrap()[0];
        for l in orders(&w, &x) {
            assert!((l as f64 - sh).abs() <= b, "|{l} - {sh}| > {b}");
        }
        // Two rows whose order only the rounding terms settle (found by a search over such
        // heads: with all three rounding terms dropped the screened token was wrong).
        let (s0, s1) = (1.5f32 / 128.0, 1.25f32 / 128.0);
        let mut w = vec![0.0f32; 2 * cols];
        w[0] = 127.0 * s0;
        w[cols + 1] = 127.0 * s1;
        w[2..65].fill(s0);
        w[cols + 65..2 * cols].fill(s1);
        let x: Vec<f32> = (0..cols)
            .map(|j| match j {
                0 => 1.0 / 127.0,
                1 => 9.448761e-3,
                2..=64 => 0.6 * 2f32.powi(-24),
                _ => 1.05 * 2f32.powi(-25),
            })
            .collect();
        let head = ScreenedHead::new(&w, 2, cols, 8).unwrap();
        let c = head.candidates(&x).unwrap().unwrap();
        for o in 0..4 {
            let full: Vec<f32> = (0..2).map(|i| orders(&w[i * cols..][..cols], &x)[o]).collect();
            assert_eq!(argmax_among(&c, |i| full[i as usize]), Some(argmax(&full)), "order {o}");
        }
    }

    #[test]
    fn subnormal_logits_keep_the_token() {
        // Every product underflows: the bound's absolute term covers what the relative model
        // does not (without it the screened token was row 1).
        let t = 2f32.powi(-49);
        let w = [1.5 * t, 1.5 * t, 1.5 * t, 5.0 * t, 0.0, 0.0];
        let x = [2f32.powi(-100); 3];
        let head = ScreenedHead::new(&w, 2, 3, 8).unwrap();
        let c = head.candidates(&x).unwrap().unwrap();
        for o in 0..4 {
            let full: Vec<f32> = (0..2).map(|i| orders(&w[i * 3..][..3], &x)[o]).collect();
            assert_eq!(argmax_among(&c, |i| full[i as usize]), Some(argmax(&full)), "order {o}");
        }
    }

    #[test]
    fn logits_that_may_overflow_have_no_bound() {
        // Row 0's sequential sum overflows to +inf although its screening logit is finite.
        let w = [3e38f32, 3e38, -3e38, 3.3e38, 0.0, 0.0];
        let head = ScreenedHead::new(&w, 2, 3, 8).unwrap();
        assert!(head.candidates(&[1.0; 3]).unwrap().is_none());
        // Small inputs keep every partial sum far from the limit: screened as usual.
        assert!(head.candidates(&[1e-3; 3]).unwrap().is_some());
    }

    #[test]
    fn argmax_among_follows_argmax() {
        assert_eq!(argmax_among(&[], |_| 0.0), None);
        let v = [0.1, 3.0, f32::NAN, 3.0, -1.0];
        assert_eq!(argmax_among(&[0, 1, 2, 3, 4], |i| v[i as usize]), Some(argmax(&v)));
        assert_eq!(argmax_among(&[2, 3], |i| v[i as usize]), Some(3));
        assert_eq!(argmax_among(&[2], |i| v[i as usize]), Some(2));
    }
}
