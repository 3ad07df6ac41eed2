//! Helpers shared by the test files (the GPU tests `gpu.rs`, `gpu_tp.rs`; the screened-head
//! studies in `fixture.rs` and `screen.rs`).
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

/// Greedy decoding on the CPU model through screened LM heads (`ferrum_runner::screen`): from
/// `prompt`, `steps` greedy tokens of the full head `w` (`rows × cols`, f32, the model's head);
/// at each step checks that every head's screened token (its candidates' exact logits, by the
/// same f32 arithmetic) is the full head's token, and records how many candidates it left.
/// Returns the sorted counts per head.
pub fn screened_greedy(
    model: &ferrum_runner::model::CpuModel,
    w: &[f32],
    cols: usize,
    heads: &[ferrum_runner::screen::ScreenedHead],
    prompt: &[u32],
    steps: usize,
) -> Vec<Vec<usize>> {
    let mut counts = vec![Vec::new(); heads.len()];
    let mut cache = model.new_cache(prompt.len() + steps).unwrap();
    let mut x = model.forward_normed(&mut cache, prompt).unwrap();
    for _ in 0..steps {
        let full: Vec<f32> = w.chunks_exact(cols).map(|row| row.iter().zip(&x).map(|(a, b)| a * b).sum()).collect();
        let want = ferrum_runner::sampling::argmax(&full);
        for (head, n) in heads.iter().zip(&mut counts) {
            let c = head.candidates(&x).unwrap().expect("a finite hidden state");
            let got = ferrum_runner::screen::argmax_among(&c, |i| full[i as usize]);
            assert_eq!(got, Some(want), "{} bits", head.bits());
            n.push(c.len());
        }
        x = model.forward_normed(&mut cache, &[want]).unwrap();
    }
    for n in &mut counts {
        n.sort_unstable();
    }
    counts
}

/// One line per head: its width, the bytes it reads against the bf16 head's, and the median
/// and largest candidate counts (`counts` sorted, from [`screened_greedy`]).
pub fn report_screening(label: &str, heads: &[ferrum_runner::screen::ScreenedHead], counts: &[Vec<usize>]) {
    for (head, n) in heads.iter().zip(counts) {
        eprintln!(
            "{label}, {} bits ({:.1} MB against {:.1} MB of bf16 rows): candidates of {} rows over {} steps: median {}, max {}",
            head.bits(),
            head.screen_bytes() as f64 / 1e6,
            (head.rows() * head.cols() * 2) as f64 / 1e6,
            head.rows(),
            n.len(),
            n[n.len() / 2],
            n[n.len() - 1]
        );
    }
}
