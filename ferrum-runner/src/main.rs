//! `ferrum`: generate text or benchmark decode, on the CPU or (with `--features cuda`) a GPU.
//!
//! Stdout carries only the generated continuation, streamed as it is produced; everything
//! else (load time, prompt tokens, decode speed) goes to stderr.
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use ferrum_runner::generate::{generate, GenerateOptions};
use ferrum_runner::sampling::SamplingParams;
use ferrum_runner::session::Session;

mod bench;
#[cfg(feature = "cuda")]
mod bench_allreduce;
mod cli;

#[derive(Parser)]
#[command(name = "ferrum", version, about = "Fast batch-1 LLM decoding (Llama family)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a continuation of PROMPT (`-` reads it from stdin).
    Generate(GenerateArgs),
    /// Measure prefill time and decode speed (median of several runs).
    Bench(bench::BenchArgs),
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: cli::ModelArgs,
    /// At most this many new tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling: keep the smallest set reaching probability P (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Render PROMPT as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Write every step's logits (steps × vocab, f32) to this `.npy` file.
    #[arg(long, value_name = "FILE")]
    dump_logits: Option<PathBuf>,
    /// The prompt, or `-` for stdin.
    prompt: String,
}

fn main() {
    // candle asks for its thread count on most CPU ops and, without this variable, re-reads
    // /proc/cpuinfo each time (~0.5-1 ms per token on the default model). Set it once, before
    // any thread exists, to what it would have found.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    // ferrum's GPU machines must never use NVLink multicast; NCCL reads this once, at its first
    // communicator, so it is set here, before any thread exists (an explicit value wins).
    if std::env::var_os(ferrum_runner::NVLS_ENV).is_none() {
        std::env::set_var(ferrum_runner::NVLS_ENV, "0");
    }
    // Log lines (the GEMV variants chosen at start-up, the kernel settings, ...) go to stderr
    // when RUST_LOG asks for them, e.g. `RUST_LOG=ferrum_cuda=debug`; warnings otherwise. A
    // RUST_LOG that does not parse is reported and replaced by the default: logging settings
    // never stop a run.
    use tracing_subscriber::EnvFilter;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| {
            EnvFilter::try_new(&v)
                .map_err(|e| eprintln!("warning: ignoring RUST_LOG={v:?} ({e}); logging warnings only"))
                .ok()
        })
        .unwrap_or_else(|| EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Generate(a) => run_generate(a),
        Cmd::Bench(a) => bench::run(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn read_prompt(p: &str) -> Result<String> {
    let text = if p == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
        s
    } else {
        p.to_string()
    };
    if text.trim().is_empty() {
        bail!("the prompt is empty: give some text, or `-` to read it from stdin");
    }
    Ok(text)
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let sampling = SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed };
    sampling.validate()?;
    let prompt = read_prompt(&a.prompt)?;
    let mut s = Session::open(&a.model.to_options()?, true)?;
    let ids = s.encode_prompt(&prompt, a.chat)?;
    eprintln!("prompt: {} tokens", ids.len());

    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampling,
        stop_ids: s.tokenizer.eos_ids().to_vec(),
        keep_logits: a.dump_logits.is_some(),
        device_loop: !a.model.host_loop,
    };
    // Greedy device-fed steps screen the LM head unless --full-head (the same tokens).
    if !a.model.full_head && opts.device_sampling() == Some(ferrum_runner::backend::DeviceSampling::Greedy) {
        if let Err(e) = s.backend.set_screened_head(true) {
            // The full head gives the same tokens: go on without the copy (out of memory, say).
            eprintln!("no screened LM head ({e}); computing the whole head");
        }
    }
    // The backend's one-off set-up (the step tuning) before the prefill is timed.
    s.backend.prepare()?;
    // In a multi-process run every rank generates the same tokens; rank 0 prints them.
    let quiet = a.model.rank.is_some_and(|r| r != 0);
    let mut stream = s.tokenizer.stream_decoder();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let context = s.context_len();
    // Models may have more rows than the tokenizer has tokens (padded vocabularies): such ids
    // have no text, so they are generated but print nothing (as HF's decode skips them).
    let tokenizer_vocab = s.tokenizer.vocab_size();
    let mut warned = false;
    let stats = generate(s.backend.as_mut(), &ids, context, &opts, &mut |tok| {
        if tok as usize >= tokenizer_vocab {
            if !warned {
                eprintln!("note: token {tok} is past the tokenizer's {tokenizer_vocab} tokens; it has no text");
                warned = true;
            }
            return Ok(());
        }
        if quiet {
            return Ok(());
        }
        if let Some(text) = stream.step(tok)? {
            // A closed stdout (e.g. `| head`) ends the generation quietly.
            let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
        }
        Ok(())
    })?;
    if let Some(rest) = stream.flush()? {
        let _ = out.write_all(rest.as_bytes());
    }
    if !quiet {
        let _ = writeln!(out);
    }
    drop(out);
    let how = match &stats.device {
        Some(d) if d.replays > 0 => format!("; tokens chosen on the GPU, {} graph replays", d.replays),
        Some(_) => "; tokens chosen on the GPU, eager".to_string(),
        None => String::new(),
    };
    eprintln!(
        "generated {} tokens{}; prefill {:.1} ms; decode {:.1} tok/s ({}{how})",
        stats.generated.len(),
        if stats.stopped_on_eos { " (stopped at EOS)" } else { "" },
        stats.prefill_time.as_secs_f64() * 1e3,
        stats.decode_tok_per_s(),
        s.backend.describe()
    );
    if let Some(path) = &a.dump_logits {
        write_logits(path, s.backend.vocab_size(), &stats.logits)?;
        eprintln!("wrote {} steps of logits to {}", stats.logits.len() / s.backend.vocab_size(), path.display());
    }
    Ok(())
}

fn write_logits(path: &Path, vocab: usize, logits: &[f32]) -> Result<()> {
    let f = std::fs::File::create(path).with_context(|| format!("--dump-logits: creating {}", path.display()))?;
    ferrum_runner::npy::write_f32_2d(std::io::BufWriter::new(f), logits.len() / vocab, vocab, logits)
        .with_context(|| format!("--dump-logits: writing {}", path.display()))
}
