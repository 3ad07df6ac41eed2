//! GPU tests of the decode graphs, the device loop and tensor parallelism over NCCL.
//! Each test needs a CUDA GPU (`--ignored`); tests named `tp2_*` need two.
//! Built by `cargo xtask gpu-bundle` (twice: with the spin-park barrier and with
//! `barrier-std`); run by `bundle/run-gpu-suite.sh`.
#![cfg(feature = "cuda")]

mod common;
use common::{prompt, rel_err};
use ferrum_runner::sampling::argmax;

use std::time::{Duration, Instant};

use candle_core::DType;
use ferrum_cuda::Fusion;
use ferrum_runner::backend::{DecodeBackend, DeviceSampling};
use ferrum_runner::config::{Arch, ModelConfig};
use ferrum_runner::cuda_backend::{build_runner, CudaBackend};
use ferrum_runner::cuda_rank::{Fault, FaultKind};
use ferrum_runner::cuda_tp::{
    open_group, synthetic_group, synthetic_group_opts, synthetic_group_with, AllReduce, TpOptions,
};
use ferrum_runner::generate::{generate, GenerateOptions};
use ferrum_runner::sampling::SamplingParams;
use ferrum_runner::synthetic::{random_config, random_weights};
use ferrum_runner::weights::{Linear, ModelWeights};

const ARCHS: [Arch; 4] = [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3];
const BF16: ferrum_cuda::DType = ferrum_cuda::DType::BF16;

fn init() {
    // NCCL reads it at its first communicator; the tests never use NVLink multicast.
    std::env::set_var(ferrum_runner::NVLS_ENV, "0");
    // `RUST_LOG=ferrum_runner=debug,ferrum_nccl=debug …` traces the failure paths to stderr.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_thread_names(true)
            .with_writer(std::io::stderr)
            .try_init();
    }
}

/// Small model, realistic head_dim 64; `kv_heads` KV heads with 2 query heads each (3 for
/// Qwen3). Three KV heads split 2 + 1 over two GPUs (the uneven split).
fn config(arch: Arch, tied: bool, kv_heads: usize) -> ModelConfig {
    let mut c = random_config(arch, tied);
    c.hidden_size = 256;
    c.intermediate_size = 512;
    c.head_dim = 64;
    c.num_kv_heads = kv_heads;
    c.num_heads = kv_heads * if arch == Arch::Qwen3 { 3 } else { 2 };
    c
}

fn weights(cfg: &ModelConfig, seed: u64) -> ModelWeights {
    random_weights(cfg, DType::F32, seed).unwrap()
}

/// Multiplies the (untied) LM head by `k`, so the logits are peaked and greedy choices have
/// margins far above bf16 rounding.
fn peaked(mut w: ModelWeights, k: f64) -> ModelWeights {
    let t = w.lm_head.to_dense(DType::F32).unwrap();
    w.lm_head = Linear::Dense((t * k).unwrap());
    w
}

fn tp1(w: &ModelWeights) -> CudaBackend {
    CudaBackend::new(build_runner(w, BF16, 0, &mut |_, _| {}).unwrap())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Host loop: prefill, then `steps` steps fed with the argmax of the previous logits; every
/// logits vector (prefill first).
fn host_logits(b: &mut dyn DecodeBackend, prompt: &[u32], steps: usize, capacity: usize) -> Vec<Vec<f32>> {
    let mut out = vec![b.prefill(prompt, capacity).unwrap()];
    for _ in 0..steps {
        let next = argmax(out.last().unwrap());
        out.push(b.step(next).unwrap());
    }
    out
}

/// Device loop after a prefill: the tokens the device chose in `steps` steps, fed from the
/// prefill's argmax.
fn device_tokens(
    b: &mut dyn DecodeBackend,
    prompt: &[u32],
    steps: usize,
    capacity: usize,
    s: DeviceSampling,
) -> Vec<u32> {
    let logits = b.prefill(prompt, capacity).unwrap();
    let mut toks = Vec::new();
    let run = b
        .decode_on_device(argmax(&logits), steps, s, &mut |t| {
            toks.push(t);
            Ok(true)
        })
        .unwrap();
    assert_eq!((run.kept, run.run), (steps, steps));
    toks
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_replay_is_bit_identical_to_eager() {
    init();
    for arch in ARCHS {
        for tied in [true, false] {
            let cfg = config(arch, tied, 2);
            let w = weights(&cfg, 3);
            let p = prompt(100, cfg.vocab_size, 7);
            // Reference: host-fed eager steps, logits copied back every step.
            let mut host = tp1(&w);
            let want = host_logits(&mut host, &p, 64, 200);
            for graphed in [true, false] {
                let mut b = tp1(&w);
                b.rank().set_graphed(graphed);
                let logits = b.prefill(&p, 200).unwrap();
                let mut tok = argmax(&logits);
                b.rank().device_begin(0, tok, p.len()).unwrap();
                for i in 0..64 {
                    let got = b.rank().device_steps(0, p.len() + 1 + i, 1, DeviceSampling::Greedy).unwrap();
                    let mut l = Vec::new();
                    b.runner().logits_to_host(&mut l).unwrap();
                    assert_eq!(bits(&l), bits(&want[i + 1]), "{arch:?} tied={tied} graphed={graphed}: step {i} logits");
                    tok = argmax(&want[i + 1]);
                    assert_eq!(got, vec![tok], "{arch:?} tied={tied} graphed={graphed}: step {i} token");
                }
                let stats = b.rank().stats();
                assert_eq!(stats.steps, 64);
                assert_eq!(stats.captures, u64::from(graphed), "one capture serves every position");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_new_cache_is_captured_again_and_still_matches() {
    init();
    let cfg = config(Arch::Llama, false, 2);
    let w = weights(&cfg, 5);
    let mut host = tp1(&w);
    let mut dev = tp1(&w);
    for (i, capacity) in [96usize, 400, 96].into_iter().enumerate() {
        let p = prompt(40 + i, cfg.vocab_size, i as u64);
        let want: Vec<u32> = host_logits(&mut host, &p, 32, capacity)[1..].iter().map(|l| argmax(l)).collect();
        let got = device_tokens(&mut dev, &p, 32, capacity, DeviceSampling::Greedy);
        // Step i's token is the argmax of step i's logits.
        assert_eq!(got, want, "sequence {i} (capacity {capacity})");
    }
    let captures = dev.rank().stats().captures;
    assert!((2..=3).contains(&captures), "{captures} captures for 3 sequences (2 or 3 buffer sets)");
}

/// Several device-fed steps per captured graph (the next step's first kernel launched
/// programmatically inside the graph, after the previous step's pick): the same tokens, and the
/// same last logits bit for bit, as one step per graph, greedy and sampled, on three decode
/// paths: the fused one (a 200-row cache: the fused RoPE attention reads the position before
/// its wait), the tensor-core attention (an 1100-row cache: rope_qkv, then the attention that
/// reads the position before its wait, then the combine) and every fusion off (separate norm,
/// RoPE and combine kernels). The device loop's batches for 70 steps (2, 4, 8, 16, 32, 8) leave
/// remainders at three steps a graph, which run as one-step replays, and batches shorter than
/// eight steps a graph run one step a graph: 70, 30 and 14 replays.
#[test]
#[ignore = "needs a CUDA GPU"]
fn multi_step_graphs_are_bit_identical_to_one_step_graphs() {
    init();
    let paths =
        [("fused", 200, Fusion::ALL), ("tensor-core attention", 1100, Fusion::ALL), ("unfused", 200, Fusion::NONE)];
    for arch in ARCHS {
        let cfg = config(arch, arch == Arch::Llama, 2);
        let w = weights(&cfg, 5);
        let p = prompt(60, cfg.vocab_size, 3);
        for (path, capacity, fusion) in paths {
            for s in [DeviceSampling::Greedy, DeviceSampling::Temperature { temperature: 1.0, seed: 7 }] {
                let mut want: Option<(Vec<u32>, Vec<u32>)> = None;
                for (k, replays) in [(1, 70), (3, 30), (8, 14)] {
                    let mut b = tp1(&w);
                    b.runner().set_fusion(fusion);
                    b.runner().set_steps_per_graph(k).unwrap();
                    let toks = device_tokens(&mut b, &p, 70, capacity, s);
                    let mut l = Vec::new();
                    b.runner().logits_to_host(&mut l).unwrap();
                    let stats = b.rank().stats();
                    let what = format!("{arch:?} {path} {s:?} {k} steps a graph");
                    assert_eq!(stats.replays, replays, "{what}: replays");
                    // One graph per step count used: the k-step graph and the one-step graph.
                    assert_eq!(stats.captures, if k == 1 { 1 } else { 2 }, "{what}: captures");
                    match &want {
                        None => want = Some((toks, bits(&l))),
                        Some((t, lb)) => {
                            assert_eq!(&toks, t, "{what}: tokens");
                            assert_eq!(&bits(&l), lb, "{what}: last logits");
                        }
                    }
                }
            }
        }
    }
    // Out of range: refused, the setting kept.
    let cfg = config(Arch::Llama, true, 2);
    let mut b = tp1(&weights(&cfg, 5));
    for bad in [0, ferrum_cuda::plan::MAX_GRAPH_STEPS + 1] {
        let e = b.runner().set_steps_per_graph(bad).unwrap_err().to_string();
        assert!(e.contains("steps per graph"), "{bad}: {e}");
    }
    assert_eq!(b.runner().steps_per_graph(), ferrum_cuda::plan::GRAPH_STEPS);
}

fn opts(max_tokens: usize, stop: Vec<u32>, device_loop: bool, sampling: SamplingParams) -> GenerateOptions {
    GenerateOptions { max_tokens, sampling, stop_ids: stop, keep_logits: false, device_loop }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn generate_on_the_device_equals_the_host_loop() {
    init();
    let cfg = config(Arch::Qwen2, false, 2);
    let w = weights(&cfg, 9);
    let p = prompt(20, cfg.vocab_size, 1);
    let greedy = SamplingParams::default();
    let mut host = tp1(&w);
    let mut dev = tp1(&w);
    let want = generate(&mut host, &p, 4096, &opts(70, vec![], false, greedy), &mut |_| Ok(())).unwrap();
    let got = generate(&mut dev, &p, 4096, &opts(70, vec![], true, greedy), &mut |_| Ok(())).unwrap();
    assert!(want.device.is_none() && got.device.is_some());
    assert_eq!(got.generated, want.generated);
    assert_eq!(got.decode_steps, want.decode_steps);
    // A stop token met mid-batch: generation ends there; the steps run past it are discarded.
    let stop = want.generated[13];
    let first = want.generated.iter().position(|&t| t == stop).unwrap();
    let got = generate(&mut dev, &p, 4096, &opts(70, vec![stop], true, greedy), &mut |_| Ok(())).unwrap();
    assert!(got.stopped_on_eos);
    assert_eq!(got.generated, want.generated[..first]);
    let run = got.device.unwrap();
    assert!(run.run >= run.kept && run.kept == first, "{run:?}");
    // The context limit: the last fed position is capacity - 1.
    let got = generate(&mut dev, &p, p.len() + 10, &opts(70, vec![], true, greedy), &mut |_| Ok(())).unwrap();
    assert_eq!(got.generated, want.generated[..11]);
    // After a device run, host steps continue from the last token handed out.
    let mut a = tp1(&w);
    let l0 = a.prefill(&p, 200).unwrap();
    let mut toks = Vec::new();
    a.decode_on_device(argmax(&l0), 9, DeviceSampling::Greedy, &mut |t| {
        toks.push(t);
        Ok(toks.len() < 5)
    })
    .unwrap();
    assert_eq!(toks, want.generated[1..6]);
    let next = a.step(toks[4]).unwrap();
    let mut h = tp1(&w);
    let all = host_logits(&mut h, &p, 6, 200);
    assert_eq!(bits(&next), bits(&all[6]));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_sampling_is_seeded() {
    init();
    let cfg = config(Arch::Llama, true, 2);
    let w = weights(&cfg, 11);
    let p = prompt(16, cfg.vocab_size, 2);
    let mut b = tp1(&w);
    let t = |seed| DeviceSampling::Temperature { temperature: 1.0, seed };
    let a1 = device_tokens(&mut b, &p, 64, 128, t(1));
    let a2 = device_tokens(&mut b, &p, 64, 128, t(1));
    let b1 = device_tokens(&mut b, &p, 64, 128, t(2));
    let g = device_tokens(&mut b, &p, 64, 128, DeviceSampling::Greedy);
    assert_eq!(a1, a2, "same seed, same tokens");
    assert_ne!(a1, b1, "another seed, other tokens");
    assert_ne!(a1, g, "sampling at T=1 on near-flat logits is not greedy");
    assert!(a1.iter().chain(&b1).all(|&t| (t as usize) < cfg.vocab_size));
    // On very peaked logits a draw at T=1 is the argmax.
    let wp = peaked(weights(&cfg_untied(), 11), 400.0);
    let mut bp = tp1(&wp);
    let s = device_tokens(&mut bp, &p, 32, 128, t(3));
    let g = device_tokens(&mut bp, &p, 32, 128, DeviceSampling::Greedy);
    assert_eq!(s, g);
}

fn cfg_untied() -> ModelConfig {
    config(Arch::Llama, false, 2)
}

// ---------------------------------------------------------------------------------------------
// Two GPUs
// ---------------------------------------------------------------------------------------------

/// `w` with its (untied) LM head rewritten by `edit` (rows of `hidden` f32).
fn edit_head(mut w: ModelWeights, edit: impl Fn(&mut [Vec<f32>])) -> ModelWeights {
    let t = w.lm_head.to_dense(DType::F32).unwrap();
    let mut rows: Vec<Vec<f32>> = t.to_vec2().unwrap();
    edit(&mut rows);
    let (v, h) = (rows.len(), rows[0].len());
    let flat: Vec<f32> = rows.into_iter().flatten().collect();
    w.lm_head = Linear::Dense(candle_core::Tensor::from_vec(flat, (v, h), &candle_core::Device::Cpu).unwrap());
    w
}

/// Greedy device tokens with the screened head off, then on, on the same runner (the graphs are
/// captured again after the switch); the two token lists.
fn screened_pair(b: &mut CudaBackend, p: &[u32], steps: usize, capacity: usize) -> (Vec<u32>, Vec<u32>) {
    assert!(!b.runner().set_screened_head(false).unwrap());
    let full = device_tokens(b, p, steps, capacity, DeviceSampling::Greedy);
    assert!(b.runner().set_screened_head(true).unwrap(), "this shape has a screened head");
    assert!(b.runner().screened_head());
    let screened = device_tokens(b, p, steps, capacity, DeviceSampling::Greedy);
    // The last step screened: it re-read at least the row it chose.
    let rows = b.runner().screened_rows().unwrap();
    assert!(rows.iter().any(|&(r, _)| r == *screened.last().unwrap()), "{rows:?}");
    (full, screened)
}

/// The screened LM head (`CudaDecodeRunner::set_screened_head`: an int8 copy brackets every
/// row's logit, the rows that may win are re-read by the head GEMV's own arithmetic) picks the
/// full head's greedy token at every step, bit for bit, on every architecture, tied and untied
/// heads (vocabularies of 1000 and 1001: a partial last block), both dtypes and the three
/// decode paths (fused, the tensor-core attention, every fusion off: the screen then reads the
/// normed input instead of fusing the final norm). Sampled steps keep the full head (the same
/// draws with the switch on), and the logits of a greedy screened step are not needed by it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn screened_head_picks_the_full_heads_greedy_tokens() {
    init();
    let paths =
        [("fused", 200, Fusion::ALL), ("tensor-core attention", 1100, Fusion::ALL), ("unfused", 200, Fusion::NONE)];
    for arch in ARCHS {
        for (tied, vocab) in [(true, 1000), (false, 1001)] {
            let mut cfg = config(arch, tied, 2);
            cfg.vocab_size = vocab;
            let w = weights(&cfg, 21);
            let p = prompt(40, vocab, 5);
            for dtype in [BF16, ferrum_cuda::DType::F16] {
                let mut b = CudaBackend::new(build_runner(&w, dtype, 0, &mut |_, _| {}).unwrap());
                for (path, capacity, fusion) in paths {
                    b.runner().set_fusion(fusion);
                    let (full, screened) = screened_pair(&mut b, &p, 64, capacity);
                    assert_eq!(screened, full, "{arch:?} tied={tied} {dtype:?} {path}: greedy tokens");
                    let t = DeviceSampling::Temperature { temperature: 1.0, seed: 7 };
                    let sampled_on = device_tokens(&mut b, &p, 32, capacity, t);
                    assert!(!b.runner().set_screened_head(false).unwrap());
                    let sampled_off = device_tokens(&mut b, &p, 32, capacity, t);
                    assert_eq!(sampled_on, sampled_off, "{arch:?} tied={tied} {dtype:?} {path}: sampled tokens");
                }
                println!("{arch:?} tied={tied} vocab {vocab} {dtype:?}: screened = full head on 3 paths (64 greedy tokens each)");
            }
        }
    }
}

/// The screened head on heads built to break it: exact ties (every row twice: the smaller row
/// must win), rows with an infinite or a NaN weight (always re-read; NaN never wins), rows of
/// zeros, a peaked head (margins far above rounding) and one so large that logits overflow
/// (no bound: every row is re-read). Same tokens as the full head, both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn screened_head_matches_the_full_head_on_adversarial_heads() {
    init();
    let mut cfg = config(Arch::Llama, false, 2);
    cfg.vocab_size = 1001;
    let base = weights(&cfg, 33);
    let p = prompt(40, cfg.vocab_size, 9);
    type Edit = fn(&mut [Vec<f32>]);
    let heads: [(&str, Edit); 5] = [
        ("ties", |r| {
            for i in (0..r.len() - 1).step_by(2) {
                r[i + 1] = r[i].clone();
            }
        }),
        ("non-finite rows", |r| {
            r[500][3] = f32::INFINITY;
            r[600][7] = f32::NAN;
            r[601][0] = f32::NEG_INFINITY;
        }),
        ("zero rows", |r| r[..100].iter_mut().for_each(|row| row.fill(0.0))),
        ("peaked", |r| r.iter_mut().flatten().for_each(|v| *v *= 50.0)),
        // Past the overflow guard ((1 + gamma) max |w| ||x'||_1 >= f32::MAX): every row re-read.
        ("overflowing", |r| r.iter_mut().flatten().for_each(|v| *v *= 1e37)),
    ];
    for (name, edit) in heads {
        let w = edit_head(base.clone(), edit);
        for dtype in [BF16, ferrum_cuda::DType::F16] {
            // f16 holds the overflowing head as infinities: still a valid (if odd) head.
            let mut b = CudaBackend::new(build_runner(&w, dtype, 0, &mut |_, _| {}).unwrap());
            let (full, screened) = screened_pair(&mut b, &p, 48, 200);
            assert_eq!(screened, full, "{name} {dtype:?}: greedy tokens");
            if name == "ties" {
                assert!(full.iter().all(|t| t % 2 == 0), "{name}: a tie goes to the smaller row: {full:?}");
            }
            if name == "overflowing" {
                // No bound (or, in f16, every row infinite): the last step re-read every row.
                let n = b.runner().screened_rows().unwrap().len();
                assert_eq!(n, cfg.vocab_size, "{name} {dtype:?}: rows re-read");
            }
            println!("{name} {dtype:?}: screened = full head (48 greedy tokens)");
        }
    }
}

/// The screen visits every row exactly once on a head of several waves of blocks. On a head
/// past the overflow guard every row is re-read, so the last step's re-read rows must be
/// 0 .. vocab, each once (a skipped or repeated row group would show), and the tokens the full
/// head's. 70001 rows of 256: 1094 blocks of 64 rows against an H200's 528 at once (132
/// multiprocessors of 4), and a partial last row group; both dtypes (f16 holds the head as
/// infinities: every row re-read too). (Session 44 ran it on a persistent form of the screen,
/// measured and not kept: docs/PERF.md.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn screened_head_screens_every_row_once() {
    init();
    let cfg = wide_config(Arch::Llama, 256, 70001);
    let w = edit_head(weights(&cfg, 43), |r| r.iter_mut().flatten().for_each(|v| *v *= 1e37));
    let p = prompt(20, cfg.vocab_size, 3);
    for dtype in [BF16, ferrum_cuda::DType::F16] {
        let mut b = CudaBackend::new(build_runner(&w, dtype, 0, &mut |_, _| {}).unwrap());
        let (full, screened) = screened_pair(&mut b, &p, 8, 64);
        assert_eq!(screened, full, "{dtype:?}: greedy tokens");
        let mut rows: Vec<u32> = b.runner().screened_rows().unwrap().into_iter().map(|(r, _)| r).collect();
        let n = rows.len();
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(n, cfg.vocab_size, "{dtype:?}: rows re-read (a row group skipped or repeated)");
        assert!(rows.iter().copied().eq(0..cfg.vocab_size as u32), "{dtype:?}: every row once");
        println!("{dtype:?}: {n} rows of {} re-read, each once; screened = full head", cfg.vocab_size);
    }
}

/// The screened head on the shapes the bench decodes (random weights made on the device):
/// SmolLM2-135M (a 49152 x 576 head: the short-row GEMV, 8 or 16 lanes a row) and
/// Llama-3.2-1B (128256 x 2048), bf16: the same greedy tokens as the full head.
#[test]
#[ignore = "needs a CUDA GPU"]
fn screened_head_matches_the_full_head_at_real_shapes() {
    init();
    for name in ["smollm2-135m", "llama3.2-1b"] {
        let cfg = ferrum_runner::synthetic::named_config(name).unwrap();
        let mut g = synthetic_group(&cfg, 0, 1, BF16, 17).unwrap();
        let p = prompt(64, cfg.vocab_size, 2);
        let full = device_tokens(&mut g, &p, 64, 256, DeviceSampling::Greedy);
        assert!(g.set_screened_head(true).unwrap());
        let screened = device_tokens(&mut g, &p, 64, 256, DeviceSampling::Greedy);
        assert_eq!(screened, full, "{name}: greedy tokens");
        println!("{name}: screened = full head (64 greedy tokens)");
    }
}

/// A model of `hidden` columns with `vocab` rows: hidden / 64 query heads of 64 (q_dim =
/// hidden) over the most KV heads of 4, 3, 2, 1 that divides them (16 over 4 at 1024; 9 over 3
/// at 576, as SmolLM2-135M).
fn wide_config(arch: Arch, hidden: usize, vocab: usize) -> ModelConfig {
    let heads = hidden / 64;
    let kv = [4, 3, 2, 1].into_iter().find(|k| heads % k == 0).unwrap_or(1);
    let mut c = config(arch, false, kv);
    c.hidden_size = hidden;
    c.num_heads = heads;
    c.vocab_size = vocab;
    c
}

/// Every row the screened head re-reads carries the full head's logit bit for bit (the
/// GEMV's own summation order), not only the chosen one: compared with the host-fed steps'
/// logits at every step, on heads whose GEMV sums a row with split-K (hidden 1024 over 1000
/// rows: several warps a row group) and with 16 or 8 lanes a row (20000 rows of 1024 and
/// 49152 of 256: the short-row kernels), and on SmolLM2-135M's 49152 x 576 (36 chunks a row:
/// the screen's lanes 0-3 take a second chunk of each of their 8 rows), each with the fused
/// final norm and without it, both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn screened_rows_carry_the_full_heads_logits_bit_for_bit() {
    init();
    for (hidden, vocab) in [(256, 1001), (1024, 1000), (1024, 20000), (256, 49152), (576, 49152)] {
        let cfg = wide_config(Arch::Llama, hidden, vocab);
        let w = weights(&cfg, 41);
        let p = prompt(24, vocab, 4);
        for dtype in [BF16, ferrum_cuda::DType::F16] {
            for (path, fusion) in [("fused", Fusion::ALL), ("unfused", Fusion::NONE)] {
                let what = format!("hidden {hidden} vocab {vocab} {dtype:?} {path}");
                let mut host = CudaBackend::new(build_runner(&w, dtype, 0, &mut |_, _| {}).unwrap());
                host.runner().set_fusion(fusion);
                let want = host_logits(&mut host, &p, 16, 64);
                let mut b = CudaBackend::new(build_runner(&w, dtype, 0, &mut |_, _| {}).unwrap());
                b.runner().set_fusion(fusion);
                assert!(b.runner().set_screened_head(true).unwrap(), "{what}");
                let logits = b.prefill(&p, 64).unwrap();
                b.rank().device_begin(0, argmax(&logits), p.len()).unwrap();
                let mut checked = 0;
                for (i, l) in want[1..].iter().enumerate() {
                    let got = b.rank().device_steps(0, p.len() + 1 + i, 1, DeviceSampling::Greedy).unwrap();
                    assert_eq!(got, vec![argmax(l)], "{what}: step {i} token");
                    let rows = b.runner().screened_rows().unwrap();
                    assert!(rows.iter().any(|&(r, _)| r == got[0]), "{what}: step {i}: the token was not re-read");
                    for (r, v) in rows {
                        assert_eq!(
                            v.to_bits(),
                            l[r as usize].to_bits(),
                            "{what}: step {i} row {r}: {v} vs {}",
                            l[r as usize]
                        );
                        checked += 1;
                    }
                }
                println!("{what}: {checked} re-read rows over 16 steps, every one the full head's logit bit for bit");
            }
        }
    }
}

/// Where the screened head cannot run, it says so and the steps compute the whole head: a
/// hidden size that is not a multiple of 16 (nothing allocated), and the cuBLAS projection
/// (the copy kept, the full head used). The same greedy tokens either way.
#[test]
#[ignore = "needs a CUDA GPU"]
fn screened_head_falls_back_where_it_cannot_run() {
    init();
    let mut cfg = config(Arch::Llama, false, 2);
    cfg.hidden_size = 200; // a multiple of 8 (the GEMV's vector path), not of 16
    let w = weights(&cfg, 5);
    let p = prompt(20, cfg.vocab_size, 1);
    let mut b = CudaBackend::new(build_runner(&w, BF16, 0, &mut |_, _| {}).unwrap());
    let full = device_tokens(&mut b, &p, 24, 64, DeviceSampling::Greedy);
    assert!(!b.runner().set_screened_head(true).unwrap(), "hidden 200 has no screened head");
    assert!(!b.runner().screened_head());
    assert_eq!(device_tokens(&mut b, &p, 24, 64, DeviceSampling::Greedy), full, "hidden 200");
    let cfg = config(Arch::Llama, false, 2);
    let w = weights(&cfg, 6);
    let mut b = CudaBackend::new(build_runner(&w, BF16, 0, &mut |_, _| {}).unwrap());
    b.runner().set_projection(ferrum_cuda::Projection::Cublas);
    let full = device_tokens(&mut b, &p, 24, 64, DeviceSampling::Greedy);
    assert!(b.runner().set_screened_head(true).unwrap());
    assert_eq!(device_tokens(&mut b, &p, 24, 64, DeviceSampling::Greedy), full, "cuBLAS projection");
    assert!(b.runner().screened_rows().unwrap().is_empty(), "no step screened");
    println!("hidden 200: no screened head; cuBLAS projection: the full head; same tokens");
}

/// With the vocab split, each rank screens its own rows and the ranks exchange their
/// candidates as the argmax's do: the same tokens as the full head, even and odd vocabularies.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_screened_head_with_the_vocab_split_matches_the_full_head() {
    init();
    for arch in [Arch::Llama, Arch::Qwen3] {
        for (tied, vocab) in [(true, 1000), (false, 1001)] {
            let mut cfg = config(arch, tied, 3);
            cfg.vocab_size = vocab;
            let p = prompt(30, vocab, 3);
            let opts = TpOptions { all_reduce: AllReduce::Auto, vocab_split: true, fusion: None };
            let mut g = synthetic_group_opts(&cfg, 0, 2, BF16, 13, opts).unwrap();
            let full = device_tokens(&mut g, &p, 48, 128, DeviceSampling::Greedy);
            assert!(g.set_screened_head(true).unwrap());
            let screened = device_tokens(&mut g, &p, 48, 128, DeviceSampling::Greedy);
            assert_eq!(screened, full, "{arch:?} tied={tied} vocab {vocab}: greedy tokens");
            println!("{arch:?} tied={tied} vocab {vocab}: TP2 screened = full head (48 greedy tokens)");
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_matches_tp1_every_arch() {
    init();
    for arch in ARCHS {
        // A short cache (the fused row-walking attention) and a long one (the tensor-core one).
        for (tied, kv, cap) in [(true, 2, 200), (false, 3, 200), (false, 3, ferrum_cuda::plan::ATTN_TC_MIN_CAPACITY)] {
            let cfg = config(arch, tied, kv);
            let w = weights(&cfg, 21);
            let p = prompt(100, cfg.vocab_size, 3);
            let mut one = tp1(&w);
            let mut two = open_group(&w, 0, 2, BF16, false).unwrap();
            let want = host_logits(&mut one, &p, 0, cap);
            let got = two.prefill(&p, cap).unwrap();
            let mut worst = rel_err(&got, &want[0]);
            // Both fed the same tokens (TP1's argmax), 64 steps.
            let mut next = argmax(&want[0]);
            for _ in 0..64 {
                let a = one.step(next).unwrap();
                let b = two.step(next).unwrap();
                worst = worst.max(rel_err(&b, &a));
                next = argmax(&a);
            }
            println!("{arch:?} tied={tied} kv={kv} capacity {cap}: TP2 vs TP1 worst rel err {worst:.3e}");
            assert!(worst <= 1e-2, "{arch:?} tied={tied} capacity {cap}: {worst:.3e}");
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_greedy_tokens_equal_tp1_on_peaked_logits() {
    init();
    for arch in ARCHS {
        let cfg = config(arch, false, 3);
        let w = peaked(weights(&cfg, 23), 16.0);
        let p = prompt(100, cfg.vocab_size, 4);
        let a = device_tokens(&mut tp1(&w), &p, 64, 200, DeviceSampling::Greedy);
        let b = device_tokens(open_group(&w, 0, 2, BF16, false).unwrap().as_mut(), &p, 64, 200, DeviceSampling::Greedy);
        let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        println!("{arch:?}: TP2 greedy equals TP1 for {same} of 64 steps");
        assert!(same >= 32, "{arch:?}: only {same} equal steps\n{a:?}\n{b:?}");
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_runs_are_bit_identical_and_graphs_match_eager() {
    init();
    let cfg = config(Arch::Llama, false, 3);
    let w = weights(&cfg, 25);
    let p = prompt(100, cfg.vocab_size, 5);
    let mut x = open_group(&w, 0, 2, BF16, false).unwrap();
    let mut y = open_group(&w, 0, 2, BF16, false).unwrap();
    let lx = host_logits(x.as_mut(), &p, 64, 300);
    let ly = host_logits(y.as_mut(), &p, 64, 300);
    for (i, (a, b)) in lx.iter().zip(&ly).enumerate() {
        assert_eq!(bits(a), bits(b), "step {i}: two TP2 runs differ");
    }
    // Graphed vs eager device loop on two GPUs: the same tokens, and the same KV cache (the
    // next host step's logits are bit-identical).
    let mut g = group_graphed(&w, true);
    let mut e = group_graphed(&w, false);
    let tg = device_tokens(g.as_mut(), &p, 64, 300, DeviceSampling::Greedy);
    let te = device_tokens(e.as_mut(), &p, 64, 300, DeviceSampling::Greedy);
    assert_eq!(tg, te);
    let want: Vec<u32> = lx[1..65].iter().map(|l| argmax(l)).collect();
    assert_eq!(tg, want, "device loop vs host loop on TP2");
    let (a, b) = (g.step(tg[63]).unwrap(), e.step(te[63]).unwrap());
    assert_eq!(bits(&a), bits(&b));
    // Four steps a graph: the same tokens, and the same KV cache.
    let mut m = ferrum_runner::cuda_tp::group(&w, 0, 2, BF16, false).unwrap();
    // A count out of range is refused before any rank sees it: the group stays usable.
    assert!(m.set_steps_per_graph(0).unwrap_err().to_string().contains("steps per graph"));
    m.set_steps_per_graph(4).unwrap();
    let tm = device_tokens(&mut m, &p, 64, 300, DeviceSampling::Greedy);
    assert_eq!(tm, tg, "four steps a graph vs one on TP2");
    assert_eq!(bits(&m.step(tm[63]).unwrap()), bits(&a));
    // The same over NCCL's all-reduce, whose graphs hold NCCL kernels (each replay waited for by
    // the host, under the communicator's liveness lock).
    let mut n1 = synthetic_group_with(&cfg, 0, 2, BF16, 9, AllReduce::Nccl).unwrap();
    let mut n4 = synthetic_group_with(&cfg, 0, 2, BF16, 9, AllReduce::Nccl).unwrap();
    n4.set_steps_per_graph(4).unwrap();
    let (t1, t4) = (
        device_tokens(&mut n1, &p, 64, 300, DeviceSampling::Greedy),
        device_tokens(&mut n4, &p, 64, 300, DeviceSampling::Greedy),
    );
    assert_eq!(t4, t1, "four steps a graph vs one over NCCL");
}

fn group_graphed(w: &ModelWeights, graphed: bool) -> Box<dyn DecodeBackend> {
    let mut b = ferrum_runner::cuda_tp::group(w, 0, 2, BF16, false).unwrap();
    b.set_graphed(graphed).unwrap();
    Box::new(b)
}

/// Free memory of each GPU, read through contexts the caller keeps alive (so releasing the
/// group's own context references cannot free anything behind the measurement's back).
fn free_memory(ctxs: &[std::sync::Arc<ferrum_cuda::cudarc::driver::CudaContext>]) -> Vec<u64> {
    ctxs.iter().map(|c| c.mem_get_info().unwrap().0 as u64).collect()
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_failure_injection() {
    init();
    let ctxs: Vec<_> = (0..2).map(|o| ferrum_cuda::cudarc::driver::CudaContext::new(o).unwrap()).collect();
    let cfg = config(Arch::Llama, false, 2);
    let p = prompt(30, cfg.vocab_size, 6);
    // A first group loads NCCL's and ferrum's modules; later groups must give back all they take.
    {
        let mut warm = synthetic_group(&cfg, 0, 2, BF16, 1).unwrap();
        device_tokens(&mut warm, &p, 8, 128, DeviceSampling::Greedy);
    }
    let mut problems = Vec::new();
    // Every case with the peer all-reduce in the decode steps (NcclAbort then aborts the rank's
    // communicator and its peer kernels), and with NCCL only.
    for (mode, kind) in [AllReduce::Peer, AllReduce::Nccl]
        .into_iter()
        .flat_map(|m| [FaultKind::CudaLaunch, FaultKind::NcclAbort, FaultKind::Panic].map(|k| (m, k)))
    {
        for rank in [1usize, 0] {
            for graphed in [true, false] {
                let before = free_memory(&ctxs);
                let mut g = synthetic_group_with(&cfg, 0, 2, BF16, 1, mode).unwrap();
                g.set_graphed(graphed).unwrap();
                let l = g.prefill(&p, 128).unwrap();
                g.set_fault(Fault { rank, after_steps: 6, kind }).unwrap();
                let t = Instant::now();
                let r = g.decode_on_device(argmax(&l), 64, DeviceSampling::Greedy, &mut |_| Ok(true));
                let took = t.elapsed();
                let err = r.expect_err("the injected failure must surface").to_string();
                let case = format!("{kind:?} on rank {rank} ({mode:?}, graphed {graphed})");
                if took >= Duration::from_secs(1) {
                    problems.push(format!("{case}: error after {took:?}"));
                }
                if !err.contains(&format!("TP rank {rank}")) {
                    problems.push(format!("{case}: `{err}` does not name rank {rank}"));
                }
                // Poisoned: every later call fails at once.
                if g.step(0).is_ok() {
                    problems.push(format!("{case}: a step after the failure succeeded"));
                }
                let t = Instant::now();
                drop(g);
                let dropped = t.elapsed();
                if dropped >= Duration::from_secs(5) {
                    problems.push(format!("{case}: drop took {dropped:?}"));
                }
                let after = free_memory(&ctxs);
                println!(
                    "{case}: error in {:.1} ms, drop {:.1} ms, free memory {before:?} -> {after:?}: `{err}`",
                    took.as_secs_f64() * 1e3,
                    dropped.as_secs_f64() * 1e3,
                );
                if after != before {
                    problems.push(format!("{case}: GPU memory not returned ({before:?} -> {after:?})"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The one-shot peer all-reduce (fused with the add + RMSNorm after it) against NCCL's
/// all-reduce followed by the separate add + RMSNorm: for two ranks both compute `a + b` and
/// then the same norm code, so every logit and token must match bit for bit — host-fed eager
/// steps and the device loop's graphs, every architecture, both dtypes, the uneven KV split.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_peer_all_reduce_is_bit_identical_to_nccl() {
    init();
    for arch in ARCHS {
        for dtype in [BF16, ferrum_cuda::DType::F16] {
            let cfg = config(arch, arch == Arch::Mistral, 3);
            let p = prompt(40, cfg.vocab_size, 5);
            let mut peer = synthetic_group_with(&cfg, 0, 2, dtype, 9, AllReduce::Peer).unwrap();
            let mut nccl = synthetic_group_with(&cfg, 0, 2, dtype, 9, AllReduce::Nccl).unwrap();
            assert!(peer.describe().contains("peer-allreduce"), "{}", peer.describe());
            assert!(!nccl.describe().contains("peer"), "{}", nccl.describe());
            let a = host_logits(&mut peer, &p, 12, 128);
            let b = host_logits(&mut nccl, &p, 12, 128);
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(bits(x) == bits(y), "{arch:?} {dtype:?}: logits {i} differ (peer vs NCCL)");
            }
            let ta = device_tokens(&mut peer, &p, 48, 128, DeviceSampling::Greedy);
            let tb = device_tokens(&mut nccl, &p, 48, 128, DeviceSampling::Greedy);
            assert_eq!(ta, tb, "{arch:?} {dtype:?}: device-loop tokens (peer vs NCCL)");
            println!("{arch:?} {dtype:?}: peer all-reduce bit-identical to NCCL (13 logits, 48 graph tokens)");
        }
    }
}

/// The peer add + RMSNorm kernel keeps a row of up to 4 values a thread in registers (hidden
/// 2048 at 512 threads, 4096 at 1024: two threads share each line at every k); wider rows take
/// its in-memory path (4608). Each against NCCL + the add + RMSNorm kernel, bit for bit, with
/// the GEMVs pushing the partials (`_pushed` kernel) and without (the kernel pushes): host-fed
/// steps and the device loop's graphs.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_peer_all_reduce_of_wide_rows_is_bit_identical_to_nccl() {
    init();
    for hidden in [2048, 4096, 4608] {
        let mut cfg = config(Arch::Llama, false, 2);
        cfg.hidden_size = hidden;
        let p = prompt(24, cfg.vocab_size, 8);
        let group = |all_reduce, push| {
            let fusion = Some(Fusion { push, ..Fusion::ALL });
            synthetic_group_opts(&cfg, 0, 2, BF16, 11, TpOptions { all_reduce, vocab_split: true, fusion }).unwrap()
        };
        let mut nccl = group(AllReduce::Nccl, true);
        let want = host_logits(&mut nccl, &p, 8, 64);
        let want_tokens = device_tokens(&mut nccl, &p, 16, 64, DeviceSampling::Greedy);
        for push in [true, false] {
            let mut peer = group(AllReduce::Peer, push);
            assert!(peer.describe().contains("peer-allreduce"), "{}", peer.describe());
            let got = host_logits(&mut peer, &p, 8, 64);
            for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                assert!(bits(x) == bits(y), "hidden {hidden} push={push}: logits {i} differ (peer vs NCCL)");
            }
            let tokens = device_tokens(&mut peer, &p, 16, 64, DeviceSampling::Greedy);
            assert_eq!(tokens, want_tokens, "hidden {hidden} push={push}: device-loop tokens (peer vs NCCL)");
            println!("hidden {hidden} push={push}: peer all-reduce bit-identical to NCCL (9 logits, 16 graph tokens)");
        }
    }
}

/// The vocab split (each rank computes its share of the LM head rows, the ranks exchange one
/// candidate each) against the whole head on every rank: the device loop's tokens must be
/// identical, greedy and sampled (the Gumbel noise is hashed from vocabulary indices, so a
/// split that used its local indices would draw other tokens), every architecture, tied and
/// untied heads, an even and an odd vocabulary (ranks of unequal shares), both all-reduces.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_vocab_split_picks_the_whole_vocabulary_token() {
    init();
    for arch in ARCHS {
        for (tied, vocab) in [(true, 1000), (false, 1001)] {
            let mut cfg = config(arch, tied, 3);
            cfg.vocab_size = vocab;
            let p = prompt(30, vocab, 3);
            let all_reduce = if vocab % 2 == 0 { AllReduce::Auto } else { AllReduce::Nccl };
            let mut split =
                synthetic_group_opts(&cfg, 0, 2, BF16, 13, TpOptions { all_reduce, vocab_split: true, fusion: None })
                    .unwrap();
            let mut whole =
                synthetic_group_opts(&cfg, 0, 2, BF16, 13, TpOptions { all_reduce, vocab_split: false, fusion: None })
                    .unwrap();
            let t = DeviceSampling::Temperature { temperature: 1.0, seed: 5 };
            let (gs, gw) = (
                device_tokens(&mut split, &p, 48, 128, DeviceSampling::Greedy),
                device_tokens(&mut whole, &p, 48, 128, DeviceSampling::Greedy),
            );
            assert_eq!(gs, gw, "{arch:?} tied={tied} vocab {vocab}: greedy tokens (split vs whole head)");
            let (ss, sw) = (device_tokens(&mut split, &p, 48, 128, t), device_tokens(&mut whole, &p, 48, 128, t));
            assert_eq!(ss, sw, "{arch:?} tied={tied} vocab {vocab}: sampled tokens (split vs whole head)");
            assert_ne!(ss, gs, "{arch:?}: sampling at T=1 on near-flat logits is not greedy");
            // Both halves of the vocabulary are reachable: a split that only ever answered
            // from one rank's rows would fail here.
            let half = vocab.div_ceil(2) as u32;
            assert!(ss.iter().any(|&t| t < half) && ss.iter().any(|&t| t >= half), "{arch:?}: sampled {ss:?}");
            println!("{arch:?} tied={tied} vocab {vocab} ({all_reduce:?}): vocab split = whole head (48 greedy, 48 sampled tokens)");
        }
    }
    // Bad splits are refused.
    let cfg = config(Arch::Llama, false, 2);
    let mut r = build_runner(&weights(&cfg, 1), BF16, 0, &mut |_, _| {}).unwrap();
    for (rank, world) in [(2, 2), (0, 0), (0, cfg.vocab_size + 1)] {
        let e = r.set_vocab_split(rank, world).unwrap_err().to_string();
        assert!(e.contains("vocab split"), "{rank}/{world}: {e}");
    }
    r.set_vocab_split(0, 1).unwrap();
    assert_eq!(r.vocab_rows(), (0, cfg.vocab_size));
    r.set_vocab_split(1, 2).unwrap();
    assert_eq!(r.vocab_rows(), (cfg.vocab_size / 2, cfg.vocab_size - cfg.vocab_size / 2));
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_synthetic_shards_are_slices_of_the_tp1_model() {
    init();
    for arch in ARCHS {
        let cfg = config(arch, arch == Arch::Mistral, 3);
        let spec = ferrum_runner::cuda_backend::spec_of(&cfg);
        let one = ferrum_cuda::CudaDecodeRunner::random(spec, BF16, 77, 0).unwrap();
        let mut one = CudaBackend::new(one);
        let mut two = synthetic_group(&cfg, 0, 2, BF16, 77).unwrap();
        let p = prompt(64, cfg.vocab_size, 8);
        let a = host_logits(&mut one, &p, 16, 128);
        let b = host_logits(&mut two, &p, 16, 128);
        let worst = a.iter().zip(&b).map(|(x, y)| rel_err(y, x)).fold(0.0, f64::max);
        println!("{arch:?}: synthetic TP2 vs TP1 worst rel err {worst:.3e}");
        assert!(worst <= 1e-2, "{arch:?}: {worst:.3e}");
    }
}

/// Every GEMV launch variant gives the same logits, bit for bit, with and without the
/// half-prefetch kernels (`set_half_prefetch`, `plan::HalfPrefetch`), and a profiled step shows
/// those kernels where they are meant to run. (At this width a lane has one chunk of a row, so
/// both prefetch forms load the same one: that the half-prefetch kernels compute the other
/// kernels' results where they do differ is ferrum-cuda's
/// `gemv_variants_are_bit_identical_at_every_split`, up to 8192 columns.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_variants_are_bit_identical() {
    init();
    // hidden 256 / intermediate 512 and an odd vocabulary (rows not a multiple of any variant's
    // outputs per block), every architecture.
    for arch in ARCHS {
        let mut cfg = config(arch, false, 2);
        cfg.vocab_size = 1001;
        // Not a multiple of any variant's outputs per warp or block: exercises the row clamps
        // of the gate|up variants.
        cfg.intermediate_size = 1000 + 8 * (arch as usize % 2) + 4;
        let w = weights(&cfg, 31);
        let p = prompt(40, cfg.vocab_size, 9);
        let mut want = None;
        // Variants 0 and 1 are the two-row ones, which take the gate|up and `_res`
        // half-prefetch kernels by default (plan::HalfPrefetch); the `_norm` GEMV takes them in
        // every variant: with and without them.
        let halves = [ferrum_cuda::plan::half_prefetch(None).unwrap(), ferrum_cuda::plan::HalfPrefetch::NONE];
        for (v, half) in (0..4).flat_map(|v| halves.map(|h| (v, h))) {
            let mut b = tp1(&w);
            let choices = b.runner().gemv_choices();
            assert_eq!(choices.len(), 5, "{choices:?}");
            b.runner().force_gemv_variant(v);
            b.runner().set_half_prefetch(half);
            let got: Vec<Vec<u32>> = host_logits(&mut b, &p, 16, 64).iter().map(|l| bits(l)).collect();
            if b.runner().programmatic_launch() {
                // The half-prefetch kernels ran where they should (the o and down projections
                // take the early-trigger `_res` kernels on this fused one-GPU path, the q/k/v
                // projection a `_norm` GEMV).
                let prof = b.profile_step(0).unwrap().expect("a CUDA backend profiles");
                let pfh = |k: &str| prof.iter().filter(|(n, _)| n.contains(k)).count();
                let (layers, two_row) = (cfg.num_layers, usize::from(v < 2));
                let on = usize::from(half.gateup) * layers * two_row;
                assert_eq!(pfh("gemv_gateup_norm_pfh_"), on, "{arch:?} variant {v} {half:?}: {prof:?}");
                assert_eq!(
                    pfh("gemv_res_et_pfh_"),
                    2 * usize::from(half.res) * layers * two_row,
                    "{arch:?} variant {v} {half:?}: {prof:?}"
                );
                // Every `_norm` GEMV (q/k/v; the LM head's too when it is one) in the form the
                // setting names, in both row forms (the short-row kernels have no such form).
                let norm = |n: &str| {
                    (n.starts_with("ferrum_gemv_norm_") || n.starts_with("ferrum_gemv4_norm_"))
                        && !n.contains("_l8_")
                        && !n.contains("_l16_")
                };
                let (with, without) = prof.iter().filter(|(n, _)| norm(n)).fold((0, 0), |(a, b), (n, _)| {
                    if n.contains("_pfh_") {
                        (a + 1, b)
                    } else {
                        (a, b + 1)
                    }
                });
                let want = if half.norm { (with, 0) } else { (0, without) };
                assert_eq!((with, without), want, "{arch:?} variant {v} {half:?}: {prof:?}");
                assert!(with + without >= layers, "{arch:?} variant {v}: a `_norm` q/k/v a layer: {prof:?}");
            }
            match &want {
                None => want = Some(got),
                Some(w) => assert!(w == &got, "{arch:?}: GEMV variant {v} with {half:?} differs from variant 0"),
            }
        }
    }
}

/// Each shape's key and launch variant (what a tuning changes; `launched` depends on what was
/// encoded since).
fn variants(shapes: &[ferrum_cuda::GemvShape]) -> Vec<(ferrum_cuda::GemvKey, usize)> {
    shapes.iter().map(|s| (s.key(), s.variant)).collect()
}

/// Launches every shape of `shapes` that has a choice with another of its candidates.
fn move_every_shape(b: &mut CudaBackend, shapes: &[ferrum_cuda::GemvShape]) {
    for s in shapes.iter().filter(|s| s.candidates.len() > 1) {
        let other = *s.candidates.iter().find(|&&c| c != s.variant).unwrap();
        b.runner().set_gemv_variant(s.rows, s.cols, s.gateup, other).unwrap();
    }
}

/// A small one-GPU model of `arch` (vocab 1001) for the step tuning's tests: the backend, a
/// 24-token prompt and the 40 greedy tokens the device chose before any tuning.
fn tuning_model(arch: Arch, seed: u64) -> (CudaBackend, Vec<u32>, Vec<u32>) {
    let mut cfg = config(arch, false, 2);
    cfg.vocab_size = 1001;
    let w = weights(&cfg, seed);
    let p = prompt(24, cfg.vocab_size, seed);
    let mut b = tp1(&w);
    let before = device_tokens(&mut b, &p, 40, 80, DeviceSampling::Greedy);
    (b, p, before)
}

/// The step-level tuning ([`ferrum_runner::step_tune`]) changes speed only: the device loop's
/// tokens and the host loop's logits are bit-identical before and after it, every shape ends
/// at one of its candidates, the sequence it decoded is gone, and `set_gemv_variant` refuses
/// shapes and variants it must not launch (changing nothing). `gemv_shapes` marks the LM
/// head's shape as not launched under the screened head (the tuning leaves it alone then).
#[test]
#[ignore = "needs a CUDA GPU"]
fn step_tuning_changes_no_result_and_refuses_bad_variants() {
    use ferrum_runner::step_tune::StepTune;
    init();
    let mut tuned = 0;
    for arch in ARCHS {
        let (mut b, p, before) = tuning_model(arch, 61);
        let logits_before: Vec<Vec<u32>> = host_logits(&mut b, &p, 8, 80).iter().map(|l| bits(l)).collect();
        assert!(b.tune_step(StepTune::Off).unwrap().is_none());
        let shapes = b.runner().gemv_shapes();
        assert_eq!(shapes.len(), 5, "{shapes:?}");
        let Some(r) = b.tune_step(StepTune::On).unwrap() else {
            // Only where no shape has a second candidate (then nothing can change).
            assert!(shapes.iter().all(|s| s.candidates.len() < 2), "{arch:?}: no tuning with {shapes:?}");
            continue;
        };
        tuned += 1;
        assert!(r.searched, "{arch:?}: On searches whatever the step's length");
        println!(
            "{arch:?}: step tuning {:.1} -> {:.1} us a step in {:.0} ms, {:?}",
            r.first_step_s * 1e6,
            r.best_step_s * 1e6,
            r.wall_s * 1e3,
            r.shapes.iter().map(|(k, c)| (k, c.from, c.to)).collect::<Vec<_>>()
        );
        assert!(r.first_step_s > 0.0 && r.best_step_s > 0.0, "{r:?}");
        let after = b.runner().gemv_shapes();
        for ((rows, cols, gateup), c) in &r.shapes {
            let s = after.iter().find(|s| (s.rows, s.cols, s.gateup) == (*rows, *cols, *gateup)).unwrap();
            assert_eq!(s.variant, c.to, "{s:?}");
            assert!(s.candidates.contains(&c.to) && c.timed.len() == s.candidates.len(), "{s:?} {c:?}");
        }
        // The tuning's sequence was released: a step now is refused like any step before a prefill.
        assert!(matches!(b.runner().sequence_len(0), Err(ferrum_cuda::Error::UnknownSequence(0))));
        assert!(b.step(0).is_err());
        assert_eq!(device_tokens(&mut b, &p, 40, 80, DeviceSampling::Greedy), before, "{arch:?}");
        // Each shape launched with another candidate: the step graph is captured again (a stale
        // graph would replay the old launches and hide a changed result), the tokens the same.
        for s in after.iter().filter(|s| s.candidates.len() > 1) {
            let other = *s.candidates.iter().find(|&&c| c != s.variant).unwrap();
            // The step's graph key changes with the variant (not only with a new KV cache).
            let key = b.runner().device_step_key(0).unwrap();
            b.runner().set_gemv_variant(s.rows, s.cols, s.gateup, other).unwrap();
            assert_ne!(b.runner().device_step_key(0).unwrap(), key, "{arch:?} {s:?} -> {other}");
            let captures = b.rank().stats().captures;
            assert_eq!(device_tokens(&mut b, &p, 40, 80, DeviceSampling::Greedy), before, "{arch:?} {s:?} -> {other}");
            assert!(b.rank().stats().captures > captures, "{arch:?} {s:?} -> {other}: no new capture");
            b.runner().set_gemv_variant(s.rows, s.cols, s.gateup, s.variant).unwrap();
        }
        let logits_after: Vec<Vec<u32>> = host_logits(&mut b, &p, 8, 80).iter().map(|l| bits(l)).collect();
        assert!(logits_after == logits_before, "{arch:?}: logits changed with the tuning");
        // Refusals: a shape the runner does not launch, and a variant outside a shape's
        // candidates; neither changes anything.
        let s = &after[0];
        let e = b.runner().set_gemv_variant(s.rows + 1, s.cols, s.gateup, s.variant).unwrap_err();
        assert!(matches!(e, ferrum_cuda::Error::InvalidArgument(_)), "{e:?}");
        let outside = (0..ferrum_cuda::plan::GEMV_VARIANT_COUNT + 1).find(|v| !s.candidates.contains(v)).unwrap();
        let e = b.runner().set_gemv_variant(s.rows, s.cols, s.gateup, outside).unwrap_err();
        assert!(matches!(e, ferrum_cuda::Error::InvalidArgument(_)), "{e:?}");
        assert_eq!(variants(&b.runner().gemv_shapes()), variants(&after));
        // What the step launches, as recorded when a device-fed step is encoded under the
        // settings of the moment: all five shapes; under the screened head all but the LM
        // head's (1001 rows: no layer projection of these models has that shape).
        device_tokens(&mut b, &p, 4, 80, DeviceSampling::Greedy);
        let full = b.runner().gemv_shapes();
        assert!(full.iter().all(|s| s.launched == Some(true)), "{arch:?}: {full:?}");
        assert!(b.runner().set_screened_head(true).unwrap(), "{arch:?}: this shape has a screened head");
        let changed = b.runner().gemv_shapes();
        assert!(changed.iter().all(|s| s.launched.is_none()), "{arch:?}: nothing encoded since: {changed:?}");
        device_tokens(&mut b, &p, 4, 80, DeviceSampling::Greedy);
        for s in b.runner().gemv_shapes() {
            assert_eq!(s.launched, Some(s.rows != 1001), "{arch:?} screened: {s:?}");
        }
        // The tuning searches what the step launches: the LM head's shape (a candidate above,
        // where the whole head ran) not under the screened head.
        let head_searched = |r: &ferrum_runner::step_tune::StepTuneReport| r.shapes.iter().any(|(k, _)| k.0 == 1001);
        if shapes.iter().any(|s| s.rows == 1001 && s.candidates.len() > 1) {
            assert!(head_searched(&r), "{arch:?}: {r:?}");
        }
        let screened = b.tune_step(StepTune::On).unwrap().expect("a shape with a choice");
        assert!(
            screened.searched && !screened.shapes.is_empty() && !head_searched(&screened),
            "{arch:?}: {screened:?}"
        );
        assert_eq!(device_tokens(&mut b, &p, 40, 80, DeviceSampling::Greedy), before, "{arch:?} screened");
        assert!(!b.runner().set_screened_head(false).unwrap());
    }
    assert!(tuned > 0, "no architecture had a shape with two candidates: the test checked nothing");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_failed_step_tuning_is_a_warning_under_auto_and_the_error_under_on() {
    use ferrum_runner::step_tune::{StepTune, TUNE_CAPACITY, TUNE_PROBE_STEPS, TUNE_PROMPT, TUNE_REPS, TUNE_WINDOWS};
    init();
    let (mut b, p, before) = tuning_model(Arch::Llama, 62);
    let start = b.runner().gemv_shapes();
    assert!(start.iter().any(|s| s.candidates.len() > 1), "{start:?}");
    // The tuning's device steps: two probes of the step's length, its untimed pass over the
    // windows' positions, then one measurement (an untimed and TUNE_REPS timed passes over the
    // windows). A launch failure a few steps later falls in the search, after its first change
    // of a variant.
    let fill = (2 * TUNE_PROBE_STEPS + TUNE_WINDOWS.iter().map(|w| w.0 + w.1).max().unwrap() - TUNE_PROMPT) as u64;
    let measurement = (TUNE_WINDOWS.iter().map(|w| w.1).sum::<usize>() * (TUNE_REPS + 1)) as u64;
    assert!(TUNE_WINDOWS.iter().all(|w| w.0 + w.1 <= TUNE_CAPACITY));
    for mode in [StepTune::Auto, StepTune::On] {
        let after_steps = b.rank().stats().steps + fill + measurement + 3;
        b.rank().set_fault(Some(Fault { rank: 0, after_steps, kind: FaultKind::CudaLaunch }), None);
        b.tune_at_first_prefill(mode);
        if mode == StepTune::On {
            let e = b.prefill(&p, 80).unwrap_err();
            assert!(e.to_string().contains("launch") || e.to_string().contains("CUDA"), "{e}");
            assert!(matches!(b.runner().sequence_len(0), Err(ferrum_cuda::Error::UnknownSequence(0))));
        }
        // Auto: the prefill goes on after the warning, the start-up variants set back; On: the
        // next prefill runs without a tuning. Either way the tokens are the same.
        assert_eq!(device_tokens(&mut b, &p, 40, 80, DeviceSampling::Greedy), before, "{mode:?}");
        // The fault fired at the search's first window (the steps before it: after_steps - 3),
        // and nothing but the decode's 40 steps ran after it.
        assert_eq!(b.rank().stats().steps, after_steps - 3 + 40, "{mode:?}: the fault fired elsewhere");
        // Either way the start-up variants are back (On sets them back before its error).
        assert_eq!(b.runner().gemv_shapes(), start, "{mode:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cached_step_tuning_is_reused_and_a_bad_entry_is_tuned_again() {
    use ferrum_runner::step_tune::{CacheEntry, StepTune, TuneCache};
    init();
    let (mut b, p, before) = tuning_model(Arch::Qwen2, 63);
    let dir = tempfile::tempdir().unwrap();
    let cache = TuneCache::new(dir.path().join("tune.json"));
    // Tuning steps beyond a decode's own 40: none when the cache answers.
    let run = |b: &mut CudaBackend, mode| {
        b.tune_at_first_prefill(mode);
        let steps = b.rank().stats().steps;
        assert_eq!(device_tokens(b, &p, 40, 80, DeviceSampling::Greedy), before, "{mode:?}");
        b.rank().stats().steps - steps - 40
    };
    b.set_tune_cache(Some(cache.clone()));
    assert!(run(&mut b, StepTune::Auto) > 0, "the first tuning ran");
    let stored = std::fs::read_to_string(cache.path()).unwrap();
    let file: serde_json::Value = serde_json::from_str(&stored).unwrap();
    let entries = file["entries"].as_object().unwrap();
    assert_eq!(entries.len(), 1, "{stored}");
    let entry: CacheEntry = serde_json::from_value(entries.values().next().unwrap().clone()).unwrap();
    let tuned = b.runner().gemv_shapes();
    for &(rows, cols, gateup, v) in &entry.variants {
        assert!(tuned.iter().any(|s| (s.rows, s.cols, s.gateup, s.variant) == (rows, cols, gateup, v)), "{entry:?}");
    }
    // Every shape moved elsewhere: Auto takes the cached variants back without tuning.
    move_every_shape(&mut b, &tuned);
    assert_eq!(run(&mut b, StepTune::Auto), 0, "a cached tuning ran again");
    assert_eq!(variants(&b.runner().gemv_shapes()), variants(&tuned));
    // An entry of a step too long to tune (no variants, a 1 s step): Auto skips even the probe
    // and changes nothing; the same entry with a step Auto would tune is not taken (a probe
    // and a tuning run).
    let mut long = file.clone();
    for e in long["entries"].as_object_mut().unwrap().values_mut() {
        e["variants"] = serde_json::json!([]);
        e["step_us"] = serde_json::json!(1e6);
    }
    std::fs::write(cache.path(), serde_json::to_string(&long).unwrap()).unwrap();
    move_every_shape(&mut b, &tuned);
    let moved_now = variants(&b.runner().gemv_shapes());
    assert_eq!(run(&mut b, StepTune::Auto), 0, "a cached 'too long' probed or tuned");
    assert_eq!(variants(&b.runner().gemv_shapes()), moved_now, "a cached 'too long' changed a variant");
    for e in long["entries"].as_object_mut().unwrap().values_mut() {
        e["step_us"] = serde_json::json!(10.0);
    }
    std::fs::write(cache.path(), serde_json::to_string(&long).unwrap()).unwrap();
    assert!(run(&mut b, StepTune::Auto) > 0, "a stale 'too long' was taken");
    // On tunes whatever the cache holds.
    assert!(run(&mut b, StepTune::On) > 0);
    // An entry naming a variant the runner refuses (the file edited by hand): a warning, and a
    // tuning instead; a corrupt file too.
    let mut bad = file.clone();
    for e in bad["entries"].as_object_mut().unwrap().values_mut() {
        e["variants"][0][3] = serde_json::json!(9);
    }
    std::fs::write(cache.path(), serde_json::to_string(&bad).unwrap()).unwrap();
    assert!(run(&mut b, StepTune::Auto) > 0);
    std::fs::write(cache.path(), "{ not json").unwrap();
    assert!(run(&mut b, StepTune::Auto) > 0);
    assert!(TuneCache::new(cache.path()).get("x").is_ok(), "the tuning rewrote the corrupt file");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_sampling_never_picks_an_impossible_token() {
    // At T = 1e-5 on a ×400 LM head the logit gaps (×1e5) dwarf any finite Gumbel noise (at most
    // ~17 for a draw in [2^-24, 1 - 2^-24]), so every draw is the argmax, unless the uniform
    // draw can round to 1 (that token's noise is then +inf). With 131072 tokens and 500 steps, a
    // draw reaching 1.0 with probability 2^-24 per logit fails this about 98% of the time.
    init();
    let mut cfg = config(Arch::Llama, false, 2);
    cfg.vocab_size = 131_072;
    let w = peaked(weights(&cfg, 41), 400.0);
    let p = prompt(8, cfg.vocab_size, 3);
    let mut b = tp1(&w);
    let g = device_tokens(&mut b, &p, 500, 520, DeviceSampling::Greedy);
    let s = device_tokens(&mut b, &p, 500, 520, DeviceSampling::Temperature { temperature: 1e-5, seed: 5 });
    let same = g.iter().zip(&s).take_while(|(a, b)| a == b).count();
    assert_eq!(same, 500, "sampling left the argmax at step {same}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_fed_calls_refuse_bad_input() {
    use ferrum_cuda::Error as E;
    init();
    let cfg = config(Arch::Llama, false, 2);
    let w = weights(&cfg, 51);
    let mut b = tp1(&w);
    let p = prompt(10, cfg.vocab_size, 1);
    b.prefill(&p, 32).unwrap();
    let r = b.runner();
    // Nothing device-fed before a begin.
    assert!(r.enqueue_device_step(0, DeviceSampling::Greedy).is_err());
    assert!(r.device_decode_end(0, 11).is_err());
    assert!(matches!(r.device_decode_begin(9, 1, 10), Err(E::UnknownSequence(9))));
    assert!(matches!(r.device_decode_begin(0, cfg.vocab_size as u32, 10), Err(E::TokenOutOfRange { .. })));
    assert!(matches!(r.device_decode_begin(0, 1, 11), Err(E::PositionGap { .. })));
    r.device_decode_begin(0, 1, 10).unwrap();
    let cold = DeviceSampling::Temperature { temperature: 0.0, seed: 1 };
    assert!(matches!(r.enqueue_device_step(0, cold), Err(E::InvalidArgument(_))));
    // The history holds capacity + 1 = 33 tokens.
    assert!(r.enqueue_token_readback(0, 30, 4).is_err());
    assert!(r.enqueue_token_readback(0, 0, 0).is_err());
    assert!(r.device_decode_end(0, 9).is_err(), "below the begin position");
    assert!(r.device_decode_end(0, 33).is_err(), "past the capacity");
    // A host-fed step takes the step buffer back: replays must be refused until a new begin.
    r.decode_step(0, 1, 10).unwrap();
    assert!(r.check_fed(0).is_err());
    // More steps than the cache holds: a clear error before anything runs.
    let l = b.prefill(&p, 32).unwrap();
    let err = b.decode_on_device(argmax(&l), 23, DeviceSampling::Greedy, &mut |_| Ok(true)).unwrap_err();
    assert!(matches!(err, ferrum_runner::error::Error::ContextOverflow { .. }), "{err}");
}

/// A KV capacity below `plan::ATTN_TC_MIN_CAPACITY`: decode takes the fused row-walking attention
/// (RoPE and the split merge inside it), which the fusion checks need.
const SHORT_CAPACITY: usize = ferrum_cuda::plan::ATTN_TC_MIN_CAPACITY - 24;

/// Graphed device-fed greedy steps with `fusion` (and `splits` KV splits when given, and the o
/// projection inside the attention with `attn_o`),
/// after a prefill of `p`, bit for bit against the eager host-fed logits `want` (`want[0]` the
/// prefill's, `want[i + 1]` step i's): each step's logits and its greedy token. Returns the
/// backend, for checks on how the steps ran.
fn assert_graphed_steps_match(
    w: &ModelWeights,
    p: &[u32],
    splits: Option<usize>,
    fusion: Fusion,
    attn_o: bool,
    want: &[Vec<f32>],
    what: &str,
) -> CudaBackend {
    let mut g = tp1(w);
    g.runner().set_fusion(fusion);
    g.runner().set_attn_o(attn_o);
    let l = g.prefill(p, SHORT_CAPACITY).unwrap();
    if let Some(n) = splits {
        g.runner().set_attention_splits(0, n).unwrap();
    }
    g.rank().device_begin(0, argmax(&l), p.len()).unwrap();
    for (i, want) in want[1..].iter().enumerate() {
        let got = g.rank().device_steps(0, p.len() + 1 + i, 1, DeviceSampling::Greedy).unwrap();
        let mut l = Vec::new();
        g.runner().logits_to_host(&mut l).unwrap();
        assert_eq!(bits(&l), bits(want), "{what}: graphed step {i} logits");
        assert_eq!(got, vec![argmax(want)], "{what}: graphed step {i} token");
    }
    g
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fusions_match_the_unfused_step() {
    // 1. The attention kernel's last split block merging the split-KV partials must give
    //    exactly what the separate combine kernel gives (norm fusion off in both), over a long
    //    prompt (every split busy) and a short one (16 splits over 21-44 rows: empty splits).
    // 2. The residual adds and RMSNorms fused into the projections compute the same math with
    //    other f32 rounding: logits within 1e-3 of the unfused step (the K/V cache rounding to
    //    bf16 can amplify a last-bit difference), graphed device-fed steps bit-identical to
    //    eager host-fed ones with every fusion on, and the same greedy tokens on peaked logits.
    init();
    for arch in ARCHS {
        let cfg = config(arch, false, 2);
        let w = weights(&cfg, 61);
        let long = prompt(300, cfg.vocab_size, 4);
        let run = |p: &[u32], f: Fusion| {
            let mut b = tp1(&w);
            b.runner().set_fusion(f);
            host_logits(&mut b, p, 24, SHORT_CAPACITY)
        };
        let only = |split_merge, rope| Fusion { split_merge, rope, ..Fusion::NONE };
        for p in [&long[..], &long[..20]] {
            let plain = run(p, Fusion::NONE);
            let merged = run(p, only(true, false));
            for (i, (a, b)) in merged.iter().zip(&plain).enumerate() {
                assert_eq!(bits(a), bits(b), "{arch:?} prompt {}: fused split merge changed step {i}", p.len());
            }
            // RoPE and the K/V append inside the attention kernel: bit-identical too (the
            // appended rows feed every later step, so 24 steps check the cache writes).
            let roped = run(p, only(true, true));
            for (i, (a, b)) in roped.iter().zip(&plain).enumerate() {
                assert_eq!(bits(a), bits(b), "{arch:?} prompt {}: fused RoPE changed step {i}", p.len());
            }
        }
        let plain = run(&long, Fusion::NONE);
        let all = run(&long, Fusion::ALL);
        // Step 0 is the prefill (never fused); decode steps follow.
        let worst = all[1..].iter().zip(&plain[1..]).map(|(a, b)| rel_err(a, b)).fold(0.0, f64::max);
        println!("{arch:?}: split merge bit-identical; fused norms vs unfused worst rel err {worst:.2e}");
        assert!(worst <= 1e-3, "{arch:?}: fused norms: {worst:.3e}");
        // Graphed device-fed steps with every fusion on vs the eager host-fed ones, bit for bit.
        assert_graphed_steps_match(&w, &long, None, Fusion::ALL, false, &all, &format!("{arch:?} fused"));
        // 3. The o projection inside the attention (opt-in, `FERRUM_ATTN_O`; with the cluster
        //    merge only: 6 splits here, a cluster on sm_90): the same math as the o GEMV in another f32
        //    summation order, so within 1e-3 of it; graphed steps bit-identical to eager ones
        //    (the heads' partials are summed in head order whichever block finishes last); and
        //    the o kernel really ran (its name in the profile, no o GEMV beside it).
        let six = |attn_o: bool| {
            let mut b = tp1(&w);
            b.runner().set_fusion(Fusion::ALL);
            b.runner().set_attn_o(attn_o);
            let mut out = vec![b.prefill(&long, SHORT_CAPACITY).unwrap()];
            b.runner().set_attention_splits(0, 6).unwrap();
            for _ in 0..24 {
                let next = argmax(out.last().unwrap());
                out.push(b.step(next).unwrap());
            }
            let prof = b.profile_step(argmax(out.last().unwrap())).unwrap().expect("a CUDA backend profiles");
            let o_attn = prof
                .iter()
                .filter(|(n, _)| n.starts_with("ferrum_attn_rope_o_") || n.starts_with("ferrum_attn_rope_early_o_"))
                .count();
            (out, o_attn, prof.len())
        };
        let (o_on, o_launches, n_on) = six(true);
        let (o_off, none, n_off) = six(false);
        assert_eq!((o_launches, none), (cfg.num_layers, 0), "{arch:?}: o-fused attention launches");
        assert_eq!(n_on + cfg.num_layers, n_off, "{arch:?}: one o GEMV fewer a layer");
        let worst = o_on[1..].iter().zip(&o_off[1..]).map(|(a, b)| rel_err(a, b)).fold(0.0, f64::max);
        println!("{arch:?}: o projection inside the attention vs the o GEMV worst rel err {worst:.2e}");
        assert!(worst <= 1e-3, "{arch:?}: o fusion: {worst:.3e}");
        assert_graphed_steps_match(&w, &long, Some(6), Fusion::ALL, true, &o_on, &format!("{arch:?} o fused"));
        // Peaked logits: the greedy tokens must not depend on the fusion.
        let pw = peaked(weights(&cfg, 62), 30.0);
        let mut on = tp1(&pw);
        on.runner().set_fusion(Fusion::ALL);
        let mut off = tp1(&pw);
        off.runner().set_fusion(Fusion::NONE);
        let a = device_tokens(&mut on, &long[..100], 32, SHORT_CAPACITY, DeviceSampling::Greedy);
        let b = device_tokens(&mut off, &long[..100], 32, SHORT_CAPACITY, DeviceSampling::Greedy);
        assert_eq!(a, b, "{arch:?}: greedy tokens with and without fusion");
    }
}

/// The compact decode attention (`set_attn_compact`: head dim 64 without bias or norms, the
/// cluster merge, at most `plan::ATTN_COMPACT_ROWS` rows a split; here a 384-row cache in 6
/// splits, the bench's case), every step on shared memory filled with NaN first
/// (`poison_shared_memory`: session 41's kernel read its stale row slots and made the graphed
/// bench's logits NaN): eager host-fed logits within 1e-3 of the generic kernel's fed the same
/// tokens (the same math in another f32 summation order, through the bf16 K/V cache); graphed
/// device-fed steps bit-identical to the eager host-fed ones with the same kernel; and the
/// compact kernel really ran, once a layer (with programmatic launch: the sm_90 PTX).
#[test]
#[ignore = "needs a CUDA GPU"]
fn compact_attention_matches_the_generic_kernel_and_graphs_match_eager() {
    init();
    const CAP: usize = 384;
    const SPLITS: usize = 6;
    const STEPS: usize = 24;
    for arch in [Arch::Llama, Arch::Mistral] {
        let cfg = config(arch, false, 2);
        let w = weights(&cfg, 71);
        let p = prompt(127, cfg.vocab_size, 5);
        // Eager host-fed steps (each fed `feed[i]`, or without `feed` the last argmax) and the
        // compact launches of one more profiled step, or `None` without programmatic launch.
        let eager = |compact: bool, feed: Option<&[u32]>| {
            let mut b = tp1(&w);
            b.runner().set_attn_compact(compact);
            let mut out = vec![b.prefill(&p, CAP).unwrap()];
            b.runner().set_attention_splits(0, SPLITS).unwrap();
            for i in 0..STEPS {
                let next = feed.map_or_else(|| argmax(out.last().unwrap()), |f| f[i]);
                b.runner().poison_shared_memory().unwrap();
                out.push(b.step(next).unwrap());
            }
            let prof = b.profile_step(argmax(out.last().unwrap())).unwrap().expect("a CUDA backend profiles");
            let n = prof.iter().filter(|(n, _)| n.contains("_compact_")).count();
            (out, b.runner().programmatic_launch().then_some(n))
        };
        let (generic, none) = eager(false, None);
        let fed: Vec<u32> = generic[..STEPS].iter().map(|l| argmax(l)).collect();
        let (compact, launches) = eager(true, Some(&fed));
        assert_eq!(none.unwrap_or(0), 0, "{arch:?}: compact launches with the generic kernel chosen");
        if let Some(n) = launches {
            assert_eq!(n, cfg.num_layers, "{arch:?}: compact launches a step");
        }
        let worst = compact[1..].iter().zip(&generic[1..]).map(|(a, b)| rel_err(a, b)).fold(0.0, f64::max);
        println!("{arch:?}: compact vs generic decode attention worst rel err {worst:.2e} over {STEPS} steps");
        assert!(worst <= 1e-3, "{arch:?}: compact attention: {worst:.3e}");
        // Graphed device-fed steps against the eager steps that chose their own tokens.
        let (own, _) = eager(true, None);
        let mut g = tp1(&w);
        g.runner().set_attn_compact(true);
        let l = g.prefill(&p, CAP).unwrap();
        g.runner().set_attention_splits(0, SPLITS).unwrap();
        g.rank().device_begin(0, argmax(&l), p.len()).unwrap();
        for (i, want) in own[1..].iter().enumerate() {
            g.runner().poison_shared_memory().unwrap();
            let got = g.rank().device_steps(0, p.len() + 1 + i, 1, DeviceSampling::Greedy).unwrap();
            let mut l = Vec::new();
            g.runner().logits_to_host(&mut l).unwrap();
            assert_eq!(bits(&l), bits(want), "{arch:?}: graphed compact step {i} logits");
            assert_eq!(got, vec![argmax(want)], "{arch:?}: graphed compact step {i} token");
        }
    }
}

/// The early triggers (`set_early_trigger`, `plan::EarlyTrigger`: the o and down projections
/// let the next kernel launch at their entry instead of after their wait) change when kernels
/// start, never what they compute: graphed device-fed steps (programmatic launch inside the
/// graph) bit-identical to eager host-fed steps without them, for the default (both), each
/// alone, and none; on every architecture (Llama and Mistral take the compact attention at this
/// shape, Qwen2 and Qwen3 the generic one), a 384-row cache in 6 splits as the bench runs; and
/// with the screened head on (whose screen follows the last down projection), the same greedy
/// device tokens as without the triggers; and at a capacity that takes the tensor-core attention
/// and its split combine (the 8k row's path). A profiled step counts the early-trigger launches
/// where they belong (after the attention or the combine: the o projection; after gate|up: the
/// down projection), and none with the fold or the o projection inside the attention (with
/// programmatic launch: the sm_90 PTX). (Multi-step graphs run the default triggers in
/// `multi_step_graphs_are_bit_identical_to_one_step_graphs`.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn early_triggers_change_no_logit() {
    use ferrum_cuda::plan::EarlyTrigger;
    init();
    const CAP: usize = 384;
    const SPLITS: usize = 6;
    const STEPS: usize = 16;
    let none = EarlyTrigger::NONE;
    let settings = [
        ("the default", ferrum_cuda::plan::early_trigger(None).unwrap()),
        ("o", EarlyTrigger { o: true, ..none }),
        ("down", EarlyTrigger { down: true, ..none }),
        ("none", none),
    ];
    assert_eq!(settings[0].1, EarlyTrigger { o: true, down: true }, "the default set");
    for arch in ARCHS {
        let cfg = config(arch, false, 2);
        let w = weights(&cfg, 67);
        let p = prompt(127, cfg.vocab_size, 3);
        let start = |t: EarlyTrigger| {
            let mut b = tp1(&w);
            b.runner().set_early_trigger(t);
            let l = b.prefill(&p, CAP).unwrap();
            b.runner().set_attention_splits(0, SPLITS).unwrap();
            (b, l)
        };
        let (mut e, l) = start(none);
        let mut want = vec![l];
        for _ in 0..STEPS {
            let next = argmax(want.last().unwrap());
            want.push(e.step(next).unwrap());
        }
        // Greedy device tokens with the screened head.
        let screened = |t: EarlyTrigger| {
            let mut b = tp1(&w);
            b.runner().set_early_trigger(t);
            assert!(b.runner().set_screened_head(true).unwrap(), "this shape has a screened head");
            device_tokens(&mut b, &p, STEPS, CAP, DeviceSampling::Greedy)
        };
        let want_tokens = screened(none);
        assert_eq!(want_tokens, want[1..].iter().map(|l| argmax(l)).collect::<Vec<_>>(), "{arch:?}: screened");
        for (what, t) in settings {
            let (mut g, l) = start(t);
            assert_eq!(bits(&l), bits(&want[0]), "{arch:?} {what}: prefill logits");
            g.rank().device_begin(0, argmax(&l), p.len()).unwrap();
            for (i, want) in want[1..].iter().enumerate() {
                let got = g.rank().device_steps(0, p.len() + 1 + i, 1, DeviceSampling::Greedy).unwrap();
                let mut l = Vec::new();
                g.runner().logits_to_host(&mut l).unwrap();
                assert_eq!(bits(&l), bits(want), "{arch:?} {what}: graphed step {i} logits");
                assert_eq!(got, vec![argmax(want)], "{arch:?} {what}: graphed step {i} token");
            }
            assert_eq!(screened(t), want_tokens, "{arch:?} {what}: screened greedy tokens");
            let (mut b, l) = start(t);
            let prof = b.profile_step(argmax(&l)).unwrap().expect("a CUDA backend profiles");
            if b.runner().programmatic_launch() {
                assert_eq!(
                    et_launches(&prof),
                    (cfg.num_layers * usize::from(t.o), cfg.num_layers * usize::from(t.down)),
                    "{arch:?} {what}: early-trigger launches (o, down) a step: {prof:?}"
                );
            }
            println!("{arch:?}: early triggers ({what}) bit-identical over {STEPS} graphed steps");
        }
        // Where the triggers must not run: the fold (its down GEMV feeds the attention) and the
        // o projection inside the attention (no o GEMV), when they apply to this shape.
        for (what, fold) in [("the fold", true), ("the o fusion", false)] {
            let mut b = tp1(&w);
            if fold {
                b.runner().set_folded_qkv(true).unwrap();
            } else {
                b.runner().set_attn_o(true);
            }
            let l = b.prefill(&p, CAP).unwrap();
            b.runner().set_attention_splits(0, SPLITS).unwrap();
            let prof = b.profile_step(argmax(&l)).unwrap().expect("a CUDA backend profiles");
            let ran = prof.iter().any(|(n, _)| n.contains(if fold { "_fold_" } else { "_o_hd64_" }));
            if ran {
                assert_eq!(et_launches(&prof), (0, 0), "{arch:?} {what}: no early trigger: {prof:?}");
            }
            println!("{arch:?}: {what} {}", if ran { "ran without early triggers" } else { "does not apply" });
        }
    }
    // The tensor-core attention and its split combine (a cache of ATTN_TC_MIN_CAPACITY rows or
    // more): the default triggers against none, graphed against eager, bit for bit.
    let cfg = config(Arch::Llama, false, 2);
    let w = weights(&cfg, 68);
    let p = prompt(200, cfg.vocab_size, 3);
    let cap = ferrum_cuda::plan::ATTN_TC_MIN_CAPACITY + 64;
    let mut e = tp1(&w);
    e.runner().set_early_trigger(none);
    let mut want = vec![e.prefill(&p, cap).unwrap()];
    for _ in 0..8 {
        let next = argmax(want.last().unwrap());
        want.push(e.step(next).unwrap());
    }
    let mut g = tp1(&w);
    let l = g.prefill(&p, cap).unwrap();
    g.rank().device_begin(0, argmax(&l), p.len()).unwrap();
    for (i, want) in want[1..].iter().enumerate() {
        g.rank().device_steps(0, p.len() + 1 + i, 1, DeviceSampling::Greedy).unwrap();
        let mut l = Vec::new();
        g.runner().logits_to_host(&mut l).unwrap();
        assert_eq!(bits(&l), bits(want), "tensor-core attention: graphed step {i} logits");
    }
    let mut b = tp1(&w);
    let l = b.prefill(&p, cap).unwrap();
    let prof = b.profile_step(argmax(&l)).unwrap().expect("a CUDA backend profiles");
    if b.runner().programmatic_launch() {
        assert!(prof.iter().any(|(n, _)| n.contains("attn_gqa")), "the tensor-core attention ran: {prof:?}");
        assert_eq!(et_launches(&prof), (cfg.num_layers, cfg.num_layers), "tensor-core attention: {prof:?}");
    }
    println!("tensor-core attention: the default early triggers bit-identical over 8 graphed steps");
}

/// The early-trigger `_res` GEMVs of a profiled step, as (o projections, down projections):
/// those launched just after an attention or split-combine kernel, and just after gate|up.
/// Any other place is a failure.
fn et_launches(prof: &[(&str, f64)]) -> (usize, usize) {
    let (mut o, mut down) = (0, 0);
    for (i, (name, _)) in prof.iter().enumerate().filter(|(_, (n, _))| n.contains("_res_et_")) {
        let before = if i > 0 { prof[i - 1].0 } else { "" };
        if before.contains("_attn_") || before.contains("combine") {
            o += 1;
        } else if before.contains("gateup") {
            down += 1;
        } else {
            panic!("{name} after {before:?}: {prof:?}");
        }
    }
    (o, down)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cluster_split_merge_is_bit_identical_to_the_ticket_and_combine_merges() {
    // Up to plan::ATTN_MAX_CLUSTER splits on sm_90, the split blocks of each head run as one
    // thread-block cluster and merge through distributed shared memory. Against the last-block
    // (ticket) merge and the separate combine kernel, over 6 and 8 splits (a long prompt: every
    // split busy; a short one: empty splits), eager host-fed steps and graphed device-fed ones,
    // bit for bit. Norm fusion on in all (it does not touch the merge).
    init();
    for arch in ARCHS {
        let cfg = config(arch, false, 2);
        let w = weights(&cfg, 63);
        let long = prompt(300, cfg.vocab_size, 5);
        for splits in [6, 8] {
            let eager = |p: &[u32], f: Fusion, merge: &str| {
                let mut b = tp1(&w);
                b.runner().set_fusion(f);
                let mut out = vec![b.prefill(p, SHORT_CAPACITY).unwrap()];
                b.runner().set_attention_splits(0, splits).unwrap();
                for _ in 0..24 {
                    let next = argmax(out.last().unwrap());
                    out.push(b.step(next).unwrap());
                }
                // The H200 is sm_90: the cluster merge really ran.
                assert_eq!(b.runner().last_attention_merge(), merge, "{arch:?} {splits} splits");
                out
            };
            for p in [&long[..], &long[..20]] {
                let cluster = eager(p, Fusion::ALL, "cluster");
                let ticket = eager(p, Fusion { cluster: false, ..Fusion::ALL }, "ticket");
                let combine = eager(p, Fusion { cluster: false, split_merge: false, ..Fusion::ALL }, "combine");
                for i in 1..cluster.len() {
                    assert_eq!(
                        bits(&cluster[i]),
                        bits(&ticket[i]),
                        "{arch:?} {splits} splits prompt {}: step {i}",
                        p.len()
                    );
                    assert_eq!(
                        bits(&cluster[i]),
                        bits(&combine[i]),
                        "{arch:?} {splits} splits prompt {}: step {i}",
                        p.len()
                    );
                }
                if p.len() == long.len() {
                    // Graphed device-fed steps with the cluster merge vs the eager ticket merge.
                    let what = format!("{arch:?} {splits} splits");
                    let mut g = assert_graphed_steps_match(&w, p, Some(splits), Fusion::ALL, false, &ticket, &what);
                    assert_eq!(g.runner().last_attention_merge(), "cluster", "{what}: graphed");
                }
            }
            println!("{arch:?}: {splits} splits: cluster merge bit-identical to the ticket and combine merges");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernel_profile_names_every_launch_and_changes_nothing() {
    init();
    let cfg = config(Arch::Qwen3, false, 2);
    let w = weights(&cfg, 71);
    let p = prompt(50, cfg.vocab_size, 2);
    let (mut a, mut b) = (tp1(&w), tp1(&w));
    a.runner().set_fusion(Fusion::ALL);
    b.runner().set_fusion(Fusion::ALL);
    let t = argmax(&a.prefill(&p, 128).unwrap());
    b.prefill(&p, 128).unwrap();
    let want = a.step(t).unwrap();
    let prof = b.profile_step(t).unwrap().expect("a CUDA backend profiles");
    let mut got = Vec::new();
    b.runner().logits_to_host(&mut got).unwrap();
    assert_eq!(bits(&got), bits(&want), "profiling changed the step's logits");
    // One entry per launch, then "(end)": per layer one attention kernel, which does RoPE
    // itself (every fusion on).
    assert_eq!(prof.last().map(|x| x.0), Some("(end)"));
    let count = |name: &str| prof.iter().filter(|(k, _)| *k == name).count();
    assert_eq!(count("ferrum_rope_qkv_bf16"), 0, "{prof:?}");
    // (the `_early` instance when the split fits in its early rows, as this short one does; the
    // `_o` ones, which also add the o projection, where that fusion applies: then no o GEMV)
    let attn = ["ferrum_attn_rope_bf16", "ferrum_attn_rope_early_bf16"].map(count).iter().sum::<usize>();
    let attn_o =
        ["ferrum_attn_rope_o_hd64_bf16", "ferrum_attn_rope_early_o_hd64_bf16"].map(count).iter().sum::<usize>();
    assert_eq!(attn + attn_o, cfg.num_layers, "{prof:?}");
    // (every form: two- or four-row, with the early trigger (`_res_et`, the o and down
    // projections by default) and half the early loads (`_res_et_pfh`, two-row by default))
    let res = prof.iter().filter(|(k, _)| k.starts_with("ferrum_gemv") && k.contains("_res")).count();
    let res_per_layer = if attn_o > 0 { 1 } else { 2 };
    assert_eq!(res, res_per_layer * cfg.num_layers, "one or two `_res` GEMVs a layer: {prof:?}");
    assert!(prof.iter().all(|(_, us)| us.is_finite() && *us >= 0.0), "{prof:?}");
    assert!(prof.iter().map(|x| x.1).sum::<f64>() > 0.0);
    // The next (unprofiled) step continues from the profiled one.
    let next = argmax(&want);
    assert_eq!(bits(&b.step(next).unwrap()), bits(&a.step(next).unwrap()));

    // A profiled prefill: the same logits, the tensor-core attention once per layer (50
    // tokens), and the cuBLAS GEMMs named (four projections per layer at least).
    let mut c = tp1(&w);
    c.runner().set_fusion(Fusion::ALL);
    let pp = c.profile_prefill(&p, 128).unwrap().expect("a CUDA backend profiles");
    let mut got = Vec::new();
    c.runner().logits_to_host(&mut got).unwrap();
    assert_eq!(bits(&got), bits(&a.prefill(&p, 128).unwrap()), "profiling changed the prefill's logits");
    let count = |name: &str| pp.iter().filter(|(k, _)| *k == name).count();
    assert_eq!(count("ferrum_attn_prefill_bf16"), cfg.num_layers, "{pp:?}");
    assert!(count("cublas_gemm") >= 4 * cfg.num_layers, "{pp:?}");
    assert_eq!(pp.last().map(|x| x.0), Some("(end)"));
    assert!(pp.iter().all(|(_, us)| us.is_finite() && *us >= 0.0), "{pp:?}");
}

/// A rank of a multi-process group whose peer stops (the peer's backend stays open but never
/// joins another collective, as when its process dies): the rank's watchdog aborts its
/// communicator after the stall timeout, and the call fails instead of waiting forever. The
/// two ranks are threads here, each with its own communicator from a file rendezvous: the
/// process-rank code path.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn tp2_process_rank_whose_peer_stops_fails_instead_of_hanging() {
    use ferrum_runner::session::DistOptions;
    init();
    std::env::set_var("FERRUM_TP_STALL_TIMEOUT_S", "2");
    let cfg = config(Arch::Llama, false, 2);
    let p = prompt(20, cfg.vocab_size, 3);
    let path = std::env::temp_dir().join(format!("ferrum-watchdog-{}.id", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let dist = |rank| DistOptions { rank, world_size: 2, rendezvous: format!("file:{}", path.display()) };
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let peer = {
        let (cfg, p, d) = (cfg.clone(), p.clone(), dist(1));
        std::thread::spawn(move || {
            let mut b = ferrum_runner::cuda_tp::open_process_rank(&weights(&cfg, 5), 0, 2, &d, BF16, false).unwrap();
            b.prefill(&p, 128).unwrap();
            // "Dies": no further collective until rank 0 has given up.
            let _ = done_rx.recv();
            drop(b);
        })
    };
    let mut b = ferrum_runner::cuda_tp::open_process_rank(&weights(&cfg, 5), 0, 2, &dist(0), BF16, false).unwrap();
    let l = b.prefill(&p, 128).unwrap();
    let t = Instant::now();
    let r = b.decode_on_device(argmax(&l), 32, DeviceSampling::Greedy, &mut |_| Ok(true));
    let took = t.elapsed();
    let err = r.expect_err("a rank whose peer stopped must fail").to_string();
    println!("rank 0 with a stopped peer: error after {took:?}: `{err}`");
    assert!(err.contains("no progress"), "{err}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(10), "{took:?}");
    // Failed for good: the next call fails at once.
    let t = Instant::now();
    assert!(b.step(0).is_err());
    assert!(t.elapsed() < Duration::from_secs(1));
    drop(b);
    done_tx.send(()).unwrap();
    peer.join().unwrap();
    std::env::remove_var("FERRUM_TP_STALL_TIMEOUT_S");
    let _ = std::fs::remove_file(&path);
}
