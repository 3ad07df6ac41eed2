//! The `ferrum` binary: bad input gets a clear error naming the flag or file, and a small
//! random-weight GGUF model generates, streams, dumps logits and benchmarks end to end.
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use ferrum_runner::config::Arch;
use ferrum_runner::synthetic::{random_config, random_weights, write_gguf, GgufWriteOptions};

fn ferrum(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrum")).args(args).stdin(Stdio::null()).output().unwrap()
}

/// Runs ferrum expecting failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = ferrum(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "ferrum {args:?} should fail; stderr: {err}");
    assert!(!err.contains("panicked"), "ferrum {args:?} panicked: {err}");
    err
}

/// A tiny random llama GGUF with a tokenizer, written once per test into `dir`.
fn tiny_model(dir: &Path) -> PathBuf {
    let cfg = random_config(Arch::Llama, true);
    let w = random_weights(&cfg, DType::F32, 7).unwrap();
    let path = dir.join("tiny.gguf");
    write_gguf(&w, &path, &GgufWriteOptions { linear: GgmlDType::F32, embed: GgmlDType::F32, tokens: true }).unwrap();
    path
}

#[test]
fn bad_flags_are_clear_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["generate", "--top-p", "1.5", "hi"], "--top-p"),
        (&["generate", "--top-p", "0", "hi"], "--top-p"),
        (&["generate", "--temperature", "-1", "hi"], "--temperature"),
        (&["generate", "--max-tokens", "0", "hi"], "--max-tokens"),
        (&["generate", "--tp", "0", "hi"], "--tp"),
        (&["generate", "--device", "tpu", "hi"], "--device"),
        (&["generate", "--dtype", "f8", "hi"], "--dtype"),
        (&["generate", "   "], "prompt is empty"),
        (&["bench", "--runs", "0"], "--runs"),
        // Multi-process tensor parallelism: the three flags go together and must agree.
        (&["generate", "--rank", "0", "hi"], "--world-size"),
        (
            &["generate", "--tp", "2", "--rank", "2", "--world-size", "2", "--rendezvous", "file:/tmp/r", "hi"],
            "--rank 2",
        ),
        (&["generate", "--tp", "2", "--rank", "0", "--world-size", "3", "--rendezvous", "file:/tmp/r", "hi"], "--tp 2"),
        (&["generate", "--tp", "2", "--rank", "0", "--world-size", "2", "--rendezvous", "bogus", "hi"], "--rendezvous"),
        (
            &["generate", "--tp", "2", "--rank", "0", "--world-size", "2", "--rendezvous", "tcp:nohost", "hi"],
            "host:port",
        ),
        (
            &["generate", "--tp", "2", "--rank", "0", "--world-size", "2", "--rendezvous", "file:/tmp/r", "hi"],
            "--device cuda",
        ),
        (&["bench", "--all-reduce", "--tp", "2"], "--all-reduce"),
        (&["bench", "--all-reduce", "--synthetic", "llama3-8b"], "--synthetic"),
    ];
    for (args, needle) in cases {
        let err = fails(args);
        assert!(err.contains(needle), "ferrum {args:?}: expected `{needle}` in: {err}");
    }
}

#[test]
fn a_bad_rust_log_is_reported_and_ignored() {
    let with_log = |v: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
            .args(["generate", "--help"])
            .env("RUST_LOG", v)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "RUST_LOG={v}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = with_log("ferrum_cuda=loudest");
    assert!(err.contains("ignoring RUST_LOG=\"ferrum_cuda=loudest\""), "{err}");
    // A valid one is taken without a word.
    let err = with_log("ferrum_cuda=debug");
    assert!(!err.contains("RUST_LOG"), "{err}");
}

#[test]
fn bad_model_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let err = fails(&["generate", "--model", missing.to_str().unwrap(), "hi"]);
    assert!(err.contains("nope.gguf"), "{err}");
    let junk = dir.path().join("junk.bin");
    std::fs::write(&junk, b"this is not a model file at all").unwrap();
    let err = fails(&["generate", "--model", junk.to_str().unwrap(), "hi"]);
    assert!(err.contains("junk.bin") && err.contains("not a"), "{err}");
    let model = tiny_model(dir.path());
    let bytes = std::fs::read(&model).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(&["generate", "--model", cut.to_str().unwrap(), "hi"]);
    assert!(err.contains("cut.gguf"), "{err}");
}

#[test]
fn tiny_model_generates_streams_and_dumps_logits() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let npy = dir.path().join("logits.npy");
    let out = ferrum(&["generate", "--model", m, "--max-tokens", "5", "--dump-logits", npy.to_str().unwrap(), "abc"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("prompt:") && err.contains("tok/s"), "stderr reports speed: {err}");
    let bytes = std::fs::read(&npy).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
    let steps: usize = header.split("'shape': (").nth(1).unwrap().split(',').next().unwrap().trim().parse().unwrap();
    assert!((1..=5).contains(&steps), "{header}");
    assert_eq!(bytes.len() - 10 - hlen, steps * 256 * 4, "steps × vocab f32");

    // Same seed, same text; stdin prompt works.
    let run = |seed: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ferrum"));
        c.args(["generate", "--model", m, "--max-tokens", "8", "--temperature", "0.9", "--top-k", "20"]);
        c.args(["--top-p", "0.9", "--seed", seed, "-"]).stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = c.stderr(Stdio::null()).spawn().unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b"hello world").unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success());
        o.stdout
    };
    assert_eq!(run("5"), run("5"));
}

#[test]
fn prompt_longer_than_context_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let long = "a b c d e f g h ".repeat(100);
    let err = fails(&["generate", "--model", model.to_str().unwrap(), &long]);
    assert!(err.contains("context"), "{err}");
}

#[test]
fn bench_reports_json() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = ferrum(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
        "--runs",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["decode_tok_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["prefill_ms_median"].as_f64().unwrap() > 0.0);
    assert!(v["weight_bytes_per_token"].as_u64().unwrap() > 0);
    // The CPU has no screened head: the report says the full head ran, with or without
    // --full-head (which parses for every backend).
    assert_eq!(v["lm_head"], "full");
    let m = model.to_str().unwrap();
    let out = ferrum(&[
        "bench",
        "--model",
        m,
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "2",
        "--runs",
        "1",
        "--full-head",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["lm_head"], "full");
}

#[test]
fn profiler_range_without_the_device_loop_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let err =
        fails(&["bench", "--model", m, "--prompt-tokens", "4", "--gen-tokens", "2", "--runs", "1", "--profiler-range"]);
    assert!(err.contains("--profiler-range needs the device loop"), "{err}");
    let err = fails(&["bench", "--all-reduce", "--profiler-range"]);
    assert!(err.contains("--profiler-range") && err.contains("--all-reduce"), "{err}");
}

#[test]
fn timeline_needs_the_device_loop_and_a_step_count() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let err =
        fails(&["bench", "--model", m, "--prompt-tokens", "4", "--gen-tokens", "2", "--runs", "1", "--timeline", "4"]);
    assert!(err.contains("--timeline needs the device loop"), "{err}");
    let err = fails(&["bench", "--model", m, "--timeline", "0"]);
    assert!(err.contains("--timeline"), "{err}");
    let err = fails(&["bench", "--all-reduce", "--timeline", "2"]);
    assert!(err.contains("--timeline") && err.contains("--all-reduce"), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_says_how_to_get_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let err = fails(&["generate", "--device", "cuda", "--model", model.to_str().unwrap(), "hi"]);
    assert!(err.contains("--features cuda"), "{err}");
}

/// Spawns ferrum with stdout on a pipe whose reading end is closed at once (as `| head -c1`
/// does after its byte); returns the exit status and stderr.
fn with_stdout_closed(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn an_unwritable_dump_file_fails_before_generating() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = ferrum(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--max-tokens",
        "5",
        "--dump-logits",
        "/nonexistent/x.npy",
        "abc",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--dump-logits") && err.contains("/nonexistent/x.npy"), "{err}");
    assert!(!err.contains("panicked") && !err.contains("generated"), "failed before generating: {err}");
    assert!(out.stdout.is_empty(), "nothing generated: {:?}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn a_failed_generation_keeps_an_existing_dump_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let npy = dir.path().join("old.npy");
    std::fs::write(&npy, b"earlier logits").unwrap();
    let long = "a b c d e f g h ".repeat(100);
    let err = fails(&["generate", "--model", model.to_str().unwrap(), "--dump-logits", npy.to_str().unwrap(), &long]);
    assert!(err.contains("context"), "{err}");
    assert_eq!(std::fs::read(&npy).unwrap(), b"earlier logits");
    // A new file that got no logits is not left behind.
    let new = dir.path().join("new.npy");
    fails(&["generate", "--model", model.to_str().unwrap(), "--dump-logits", new.to_str().unwrap(), &long]);
    assert!(!new.exists());
}

#[test]
fn a_closed_stdout_stops_the_generation_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    // The tiny model's greedy text runs the whole budget (no EOS) when stdout stays open.
    let out = ferrum(&["generate", "--model", m, "--max-tokens", "200", "abc"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("generated 200 tokens"), "{err}");
    let (status, err) = with_stdout_closed(&["generate", "--model", m, "--max-tokens", "200", "abc"]);
    assert!(status.success(), "{status:?}: {err}");
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
    assert!(!err.contains("generated 200 tokens"), "the generation went on: {err}");
}

#[test]
fn bench_with_a_closed_stdout_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    for json in [false, true] {
        let mut args = vec!["bench", "--model", m, "--prompt-tokens", "4", "--gen-tokens", "2", "--runs", "1"];
        if json {
            args.push("--json");
        }
        let (status, err) = with_stdout_closed(&args);
        assert!(!err.contains("panicked"), "{err}");
        assert!(status.success(), "{status:?}: {err}");
    }
}

#[test]
fn bench_token_counts_that_overflow_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let max = usize::MAX.to_string();
    for (p, g) in [(max.as_str(), "1"), ("1", max.as_str()), ("200", "100")] {
        let err = fails(&["bench", "--model", m, "--prompt-tokens", p, "--gen-tokens", g, "--runs", "1"]);
        assert!(err.contains("--prompt-tokens + --gen-tokens"), "{p} + {g}: {err}");
    }
}

#[test]
fn bench_refuses_process_ranks_where_they_are_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let rv = format!("file:{}", dir.path().join("rv").display());
    let dist = ["--rank", "0", "--world-size", "1", "--rendezvous", rv.as_str()];
    let mut args = vec!["bench", "--model", model.to_str().unwrap(), "--prompt-tokens", "4", "--gen-tokens", "2"];
    args.extend(dist);
    let err = fails(&args);
    assert!(err.contains("--rank") && err.contains("--device cuda"), "{err}");
    let mut args = vec!["bench", "--synthetic", "smollm2-135m"];
    args.extend(dist);
    let err = fails(&args);
    assert!(err.contains("--rank") && err.contains("--device cuda"), "{err}");
    let mut args = vec!["bench", "--all-reduce", "--device", "cuda", "--tp", "2", "--rank", "0", "--world-size", "2"];
    args.extend(["--rendezvous", rv.as_str()]);
    let err = fails(&args);
    assert!(err.contains("--all-reduce") && err.contains("--rank"), "{err}");
}

#[cfg(target_os = "linux")]
#[test]
fn a_stdout_that_cannot_be_written_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let to_full = |args: &[&str]| {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out =
            Command::new(env!("CARGO_BIN_EXE_ferrum")).args(args).stdin(Stdio::null()).stdout(full).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success() && !err.contains("panicked"), "{args:?}: {err}");
        err
    };
    // Not a closed stdout (that ends quietly): the write error is reported.
    let err = to_full(&["generate", "--model", m, "--max-tokens", "20", "abc"]);
    assert!(err.contains("writing the generated text to stdout") && err.contains("No space"), "{err}");
    assert!(!err.contains("generated 20 tokens"), "{err}");
    let err = to_full(&["bench", "--model", m, "--prompt-tokens", "4", "--gen-tokens", "2", "--runs", "1"]);
    assert!(err.contains("writing the report to stdout"), "{err}");
}
