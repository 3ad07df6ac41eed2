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
    /// Random seed for sampling. On CUDA, temperature-only sampling draws on the GPU unless
    /// --dump-logits or --host-loop moves the draw to the host: the same seed then gives
    /// different text.
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
    // Opened before the model loads, so that an unwritable path fails before any work.
    let dump = a.dump_logits.as_deref().map(LogitsDump::open).transpose()?;
    let r = generate_text(&a, sampling, &prompt, dump.is_some());
    if let Some(d) = dump {
        if matches!(r, Ok(None)) {
            eprintln!("stdout was closed: the generation stopped early and no logits were written");
        }
        d.finish(r.as_ref().ok().and_then(|o| o.as_ref()))?;
    }
    r.map(|_| ())
}

/// Loads the model and generates, streaming the text to stdout. Returns the vocabulary size and
/// every step's logits (with `keep_logits`; else none), or `None` when a closed stdout stopped
/// the generation (`| head`: a quiet end, nothing more to report or write).
fn generate_text(
    a: &GenerateArgs,
    sampling: SamplingParams,
    prompt: &str,
    keep_logits: bool,
) -> Result<Option<(usize, Vec<f32>)>> {
    let mut s = Session::open(&a.model.to_options()?, true)?;
    let ids = s.encode_prompt(prompt, a.chat)?;
    eprintln!("prompt: {} tokens", ids.len());

    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampling,
        stop_ids: s.tokenizer.eos_ids().to_vec(),
        keep_logits,
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
    // Set when writing to stdout fails: the generation stops there. In a multi-process run the
    // other ranks step in lockstep with rank 0 and cannot be told to stop, so rank 0 goes on to
    // the end with a closed stdout (`| head`), writing nothing more, and its peers finish too.
    let process_ranks = a.model.rank.is_some();
    let mut stdout_closed = false;
    let mut write_error: Option<std::io::Error> = None;
    // A write error other than a closed stdout on rank 0 of a multi-process run: reported once
    // every rank has finished.
    let mut deferred_error: Option<std::io::Error> = None;
    let r = generate(s.backend.as_mut(), &ids, context, &opts, &mut |tok| {
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
            if stdout_closed {
                return Ok(());
            }
            // A failed write stops the generation; a closed stdout (`| head`) quietly (below).
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                if process_ranks {
                    // The peers step in lockstep with rank 0: go on, writing nothing more.
                    stdout_closed = true;
                    if e.kind() != std::io::ErrorKind::BrokenPipe {
                        deferred_error = Some(e);
                    }
                    return Ok(());
                }
                let stop = ferrum_runner::error::Error::io("<stdout>", e.kind().into());
                write_error = Some(e);
                return Err(stop);
            }
        }
        Ok(())
    });
    let stats = match write_error {
        // The callback's error stopped the generation: the write error is the one to report.
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(None),
        Some(e) => return Err(e).context("writing the generated text to stdout"),
        None => r?,
    };
    if let Some(e) = deferred_error {
        return Err(e).context("writing the generated text to stdout");
    }
    let mut tail = String::new();
    if let Some(rest) = stream.flush()? {
        tail.push_str(&rest);
    }
    if !quiet {
        tail.push('\n');
    }
    // The generation is complete: a stdout closed by now loses only the tail, so the report and
    // the logits still follow.
    match out.write_all(tail.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            return Err(e).context("writing the generated text to stdout")
        }
        _ => {}
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
    Ok(Some((s.backend.vocab_size(), stats.logits)))
}

/// The `--dump-logits` file, opened before the model loads (an unwritable path fails before
/// any work) and written after the generation. An existing file keeps its contents until then,
/// and a file this run created is removed again when there is nothing to write.
struct LogitsDump {
    path: PathBuf,
    file: std::fs::File,
    created: bool,
}

impl LogitsDump {
    fn open(path: &Path) -> Result<Self> {
        let what = || format!("--dump-logits: creating {}", path.display());
        let (file, created) = match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(f) => (f, true),
            // Not truncated yet: a run that fails loses nothing.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // `create`: a dangling symlink's target is made, as `File::create` would.
                let open = || format!("--dump-logits: opening {}", path.display());
                (
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(path)
                        .with_context(open)?,
                    false,
                )
            }
            Err(e) => return Err(e).with_context(what),
        };
        Ok(Self { path: path.to_path_buf(), file, created })
    }

    /// Writes `logits` (`vocab` and the steps' rows); with `None` leaves the file as it was.
    fn finish(self, logits: Option<&(usize, Vec<f32>)>) -> Result<()> {
        let Some((vocab, logits)) = logits else {
            if self.created {
                drop(self.file);
                let _ = std::fs::remove_file(&self.path);
            }
            return Ok(());
        };
        let path = &self.path;
        let what = || format!("--dump-logits: writing {}", path.display());
        // A regular file is cut to the new contents; a pipe or device cannot be (nor need be).
        if self.file.metadata().with_context(what)?.is_file() {
            self.file.set_len(0).with_context(what)?;
        }
        let rows = logits.len() / vocab;
        ferrum_runner::npy::write_f32_2d(std::io::BufWriter::new(self.file), rows, *vocab, logits)
            .with_context(what)?;
        eprintln!("wrote {rows} steps of logits to {}", path.display());
        Ok(())
    }
}
