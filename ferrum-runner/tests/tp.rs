//! Tensor parallelism over CPU ranks against the single-rank model.
//!
//! Sharding changes only the summation order of the two per-layer reductions, so in f32 the
//! TP logits must match TP1 to ‖Δ‖/‖ref‖ ≤ 1e-5 and greedy ids must be identical.
use candle_core::quantized::GgmlDType;
use candle_core::DType;
use ferrum_runner::backend::{CpuBackend, DecodeBackend};
use ferrum_runner::config::{Arch, ModelConfig};
use ferrum_runner::model::CpuModel;
use ferrum_runner::sampling::argmax;
use ferrum_runner::synthetic::{quantize_weights, random_config, random_weights};
use ferrum_runner::tp::CpuTpBackend;
use ferrum_runner::weights::ModelWeights;

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Greedy run of `steps` tokens; returns every step's logits.
fn run(b: &mut dyn DecodeBackend, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut out = vec![b.prefill(prompt, prompt.len() + steps).unwrap()];
    for _ in 1..steps {
        let tok = argmax(out.last().unwrap());
        out.push(b.step(tok).unwrap());
    }
    out
}

/// A tiny config with 3 KV heads (so TP3 and uneven TP2 splits exist), per architecture.
fn three_kv(arch: Arch, tied: bool) -> ModelConfig {
    let mut c = random_config(arch, tied);
    c.num_kv_heads = 3;
    c.num_heads = 6;
    c.hidden_size = 96;
    c.intermediate_size = 192;
    c
}

fn compare(w: &ModelWeights, tp: usize, tol: f64) {
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 % w.config.vocab_size) as u32).collect();
    let mut one = CpuBackend::new(CpuModel::new(w).unwrap(), "ref");
    let mut many = CpuTpBackend::new(w, tp, false).unwrap();
    let a = run(&mut one, &prompt, 16);
    let b = run(&mut many, &prompt, 16);
    for (i, (x, y)) in b.iter().zip(&a).enumerate() {
        let r = rel_l2(x, y);
        assert!(r <= tol, "{:?} tp{tp} step {i}: rel {r:.2e}", w.config.arch);
        assert_eq!(argmax(x), argmax(y), "{:?} tp{tp} step {i}: greedy token", w.config.arch);
    }
    // A second sequence on the same group starts clean.
    let c = run(&mut many, &prompt, 4);
    assert_eq!(c[3], b[3], "second sequence reproduces the first bit for bit");
}

#[test]
fn tp2_and_tp3_match_tp1_for_every_architecture() {
    for arch in [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3] {
        for tied in [true, false] {
            let w = random_weights(&three_kv(arch, tied), DType::F32, 3).unwrap();
            compare(&w, 2, 1e-5);
            compare(&w, 3, 1e-5);
        }
    }
}

#[test]
fn quantized_shards_stay_close() {
    let w = random_weights(&three_kv(Arch::Llama, true), DType::F32, 5).unwrap();
    let q = quantize_weights(&w, GgmlDType::Q8_0).unwrap();
    compare(&q, 2, 1e-4);
}

#[test]
fn bad_tp_degrees_are_errors() {
    let w = random_weights(&random_config(Arch::Llama, true), DType::F32, 1).unwrap();
    let e = CpuTpBackend::new(&w, 3, false).unwrap_err().to_string();
    assert!(e.contains("KV heads"), "{e}");
    assert!(CpuTpBackend::new(&w, 0, false).is_err());
    let mut b = CpuTpBackend::new(&w, 2, false).unwrap();
    assert!(b.step(1).is_err(), "step before prefill");
    // A prompt past the capacity fails on the ranks and comes back as an error, not a hang.
    let e = b.prefill(&[1, 2, 3, 4], 2).unwrap_err().to_string();
    assert!(e.contains("rank") && e.contains("capacity"), "{e}");
    // The group is now poisoned: later calls fail at once.
    assert!(b.prefill(&[1], 4).is_err());
}

/// `ferrum generate --tp 2/3` on the default model prints TP1's greedy text (f32 weights).
#[test]
#[cfg(feature = "cli")] // runs the `ferrum` binary
fn cli_tp_matches_tp1_on_the_default_model() {
    use std::process::Command;
    let model = ferrum_runner::fetch::default_model_path(false).unwrap();
    let gen = |tp: &str, prompt: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
            .args(["generate", "--dtype", "f32", "--max-tokens", "24", "--tp", tp, "--model"])
            .arg(&model)
            .arg(prompt)
            .output()
            .unwrap();
        assert!(out.status.success(), "tp {tp}: {}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8(out.stdout).unwrap(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    for prompt in ["The quick brown fox jumps over the lazy dog. Once upon a time,", "def fibonacci(n):"] {
        let (one, _) = gen("1", prompt);
        let (two, err2) = gen("2", prompt);
        let (three, _) = gen("3", prompt);
        assert!(err2.contains("rank 0: 2 KV heads") && err2.contains("rank 1: 1 KV heads"), "{err2}");
        assert_eq!(two, one, "tp2 vs tp1 on {prompt:?}");
        assert_eq!(three, one, "tp3 vs tp1 on {prompt:?}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(["generate", "--tp", "4", "--model"])
        .arg(&model)
        .arg("hi")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("KV heads"));
}
