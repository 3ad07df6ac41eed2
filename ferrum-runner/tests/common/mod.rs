//! Helpers shared by the GPU test files (`gpu.rs`, `gpu_tp.rs`).
#![allow(dead_code)]

/// ‖a − b‖ / ‖b‖ in f64; infinite when `a` holds a non-finite value.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    if a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// `n` pseudo-random token ids below `vocab`, deterministic in `seed`.
pub fn prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}
